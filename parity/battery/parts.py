"""The battery's parts and checkpoint directions, by name (no jax, no pytest).

The plugin generates one test per part (parity/battery/plugin.py), `Pair(parts=...)`
chooses some, and `parity compare --pair` compares what the pair's parts cover
(memory, program, the localizer).
"""
PARTS = (
    'structure', 'specs', 'init', 'grads', 'train', 'eval', 'checkpoints', 'resume', 'convert', 'mesh',
    'memory', 'program', 'localize', 'substitution', 'decode',
)
# 'substitution' and 'decode' are generated only for a pair that declares them: a value bound
# (parity.pairs.adapter.VALUE_PASSES), decoding (`Pair(decode=...)`); parity/battery/plugin.py.
ONE_DEVICE = 'one_device'  # the decode part's placement off any mesh
DIRECTIONS = ('linen->linen', 'linen->nnx', 'nnx->linen', 'nnx->nnx')

# Under xdist a pair's parts run as three groups, each on one worker, none compiling what another
# compiles: the parts that train on one device (one compiled train step per side, read by train,
# eval, checkpoints, resume, convert, memory and program), the parts on a mesh (the sharded train
# step, decoding on the mesh), and the parts with programs of their own (one loss-and-grad per side,
# read by grads and the localizer; activation specs, substitution, decoding on one device). So a
# single pair's battery uses up to three cores.
OWN_PROGRAM_PARTS = ('specs', 'grads', 'localize', 'substitution', 'decode')
OWN_PROGRAM_GROUP = '/own-programs'  # the suffix of their group's name
MESH_GROUP = '/mesh'  # the suffix of the mesh parts' group


def group_suffix(part: str, placement: str | None = None) -> str:
  """The suffix of the xdist group a part runs in (`placement`: the mesh spec, or ONE_DEVICE)."""
  if part == 'mesh' or (part == 'decode' and placement not in (None, ONE_DEVICE)):
    return MESH_GROUP
  return OWN_PROGRAM_GROUP if part in OWN_PROGRAM_PARTS else ''
