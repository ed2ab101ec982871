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

# Under xdist a pair's parts run as two groups, each on one worker: the parts that train
# (one compiled train step per side, shared by train, eval, checkpoints, resume, convert,
# mesh, memory and program) and the parts with programs of their own (the gradients, the
# localizer's probes, activation specs, substitution, decoding). Neither compiles what the
# other compiles, so a single pair's battery uses two cores.
OWN_PROGRAM_PARTS = ('specs', 'grads', 'localize', 'substitution', 'decode')
OWN_PROGRAM_GROUP = '/own-programs'  # the suffix of their group's name
