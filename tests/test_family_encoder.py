"""The encoder family, through the plugin only: flax's stock attention, norm and embedding.

`encoder`: the NNX attention is given Linen's formula
(`parity.linen_attention`); the whole battery is bitwise.

`encoder_stock_attention`: both sides' stock defaults. The localizer names the
difference (forward pass, inside each attention module, between its q/k/v
projections and its output projection: where the attention weights are
computed), and it is declared here with its cause and its measured bound.
Every parameter's gradient and every later step differ downstream of it, so
this pair runs only the parts a forward divergence leaves meaningful.

Both models annotate every parameter with logical axes
(models/families.ENCODER_AXES) and constrain their activations by logical
names (ENCODER_ACTIVATION_AXES); given ENCODER_RULES, the stock sides shard
by them, so `encoder`'s mesh test trains tensor parallel (heads, MLP units
and vocabulary over `tensor`) and checks each parameter is where its axes
put it.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest

from parity.core import specs
from parity import KnownDifference, Pair, Renames, StockLinen, StockNnx
from models.families import ENCODER_RULES, EncoderConfig, encoder_batch
from models.linen import encoder as linen_encoder
from models.nnx import encoder as nnx_encoder
from tests import ema

CFG = EncoderConfig()
MESH = 'data=2,tensor=4'


def _layer_renames(i):
  linen, nnx_ = f'layers_{i}', f'layers/{i}'
  return (
      (linen, nnx_),
      (f'{linen}/LayerNorm_0', f'{nnx_}/norm1'),
      (f'{linen}/MultiHeadDotProductAttention_0', f'{nnx_}/attention'),
      (f'{linen}/LayerNorm_1', f'{nnx_}/norm2'),
      (f'{linen}/Dense_0', f'{nnx_}/mlp_in'),
      (f'{linen}/Dense_1', f'{nnx_}/mlp_out'),
  )


RENAMES = Renames(
    (('Embed_0', 'embed'), ('LayerNorm_0', 'final_norm'), ('Dense_0', 'head'))
    + sum((_layer_renames(i) for i in range(CFG.num_layers)), ())
)


def make_sides(cfg, mesh):
  linen = StockLinen(
      functools.partial(linen_encoder.create_train_state, cfg),
      linen_encoder.train_step, linen_encoder.eval_step, linen_encoder.loss_fn,
      mesh=mesh, rules=ENCODER_RULES, forward=linen_encoder.forward,
  )
  nnx_side = StockNnx(
      functools.partial(nnx_encoder.create_train_state, cfg),
      nnx_encoder.train_step, nnx_encoder.eval_step, nnx_encoder.loss_fn,
      mesh=mesh, rules=ENCODER_RULES, forward=nnx_encoder.forward,
  )  # no renames: the kit infers them (RENAMES, tested in tests/test_correspond.py)
  return linen, nnx_side


LAYER_NORM_PROGRAM = KnownDifference(
    paths=('LayerNorm_0',) + tuple(
        f'layers_{i}/LayerNorm_{j}' for i in range(CFG.num_layers) for j in range(2)
    ),
    passes=('program',),
    max_changed_lines=2172,
    reason=(
        "flax's stock layer norm lowers differently (the statistics expanded with"
        ' jnp.expand_dims, broadcast_in_dim, in Linen; reshaped in NNX), with the same'
        ' numbers: the batch-norm difference of the classifier family'
    ),
)
encoder = Pair(
    'encoder', functools.partial(make_sides, CFG), functools.partial(encoder_batch, CFG),
    known_differences=(LAYER_NORM_PROGRAM,),
    # Tensor parallel as the parameters' logical axes say (models/families.ENCODER_RULES):
    # heads, MLP units and vocabulary over `tensor`, the batch over `data`.
    meshes=(MESH,), rules=ENCODER_RULES,
)

STOCK = dataclasses.replace(CFG, nnx_attention='stock')
STOCK_ATTENTION = KnownDifference(
    paths=tuple(f'layers_{i}/MultiHeadDotProductAttention_0' for i in range(CFG.num_layers)),
    passes=('forward',),
    # Proven confined: NNX given Linen's attention formula, every value is bit for bit.
    substitute=functools.partial(make_sides, dataclasses.replace(STOCK, nnx_attention='linen')),
    max_ulp=1536,  # measured: 1408 on jax 0.10, 1536 on jax 0.12 (portable CPU flags)
    reason=(
        'stock attention scales at another point: Linen (flax.linen.dot_product_attention_weights)'
        ' divides the query by sqrt(head_dim) before q.k; nnx.MultiHeadAttention without dropout'
        ' calls jax.nn.dot_product_attention, which multiplies the logits by 1/sqrt(head_dim)'
        ' after it. Same constant bits, other rounding (and the sums laid out otherwise);'
        ' giving NNX the Linen formula makes every check bitwise (the encoder pair)'
    ),
)
STOCK_ATTENTION_PROGRAM = KnownDifference(
    paths=STOCK_ATTENTION.paths + LAYER_NORM_PROGRAM.paths,
    passes=('program',),
    max_changed_lines=2231,  # measured: 2231 on jax 0.10, 2219 on jax 0.12
    reason=(
        'the stock attention and layer norms lower differently; their constants (the scale, the'
        ' mask value), which jax locates at the jit root, are part of how they compute'
    ),
)
encoder_stock_attention = Pair(
    'encoder_stock_attention',
    functools.partial(make_sides, STOCK),
    functools.partial(encoder_batch, STOCK),
    known_differences=(STOCK_ATTENTION, STOCK_ATTENTION_PROGRAM),
    parts=('structure', 'specs', 'localize', 'program', 'substitution'),
    group='parity-encoder',  # the Linen side is the encoder pair's: its programs compile once
)


@pytest.mark.xdist_group('parity-encoder')  # the pair's runs are that group's
def test_the_encoders_activation_constraints_are_compared():
  """Not vacuous: each side constrains the embedding's output, each layer's MLP hidden
  units and its output; the backward pass constrains their cotangents alike."""
  from parity.battery import checks as battery

  (line,) = battery.check_specs(encoder)
  forward = 1 + 2 * CFG.num_layers
  assert line == f'activation constraints: {2 * forward} per train step, the same logical names on both sides'


@pytest.mark.xdist_group('parity-encoder')
def test_an_activation_name_the_rules_do_not_know_fails_the_specs_part():
  """flax leaves a logical name its rules do not know unsharded on both sides, which
  would compare as equal: the specs part names it instead (here the rules lack `mlp`)."""
  from parity.battery import checks as battery

  rules = tuple(r for r in ENCODER_RULES if r[0] != 'mlp')
  with pytest.raises(ValueError, match=r"logical axes the rules do not know: \['mlp'\]"):
    battery.check_specs(dataclasses.replace(encoder, rules=rules))


@pytest.mark.xdist_group('parity-encoder')
def test_parameters_flattened_in_another_order_are_named():
  """The encoder's NNX attributes sort otherwise than Linen's module names (`embed` first,
  `Dense_0` first): harmless with its optimizer, but a reduction over every leaf
  (optax.clip_by_global_norm) would round differently, so a failing update names it."""
  from parity.battery import checks as battery

  (line,) = battery._runs(encoder).parameter_order_lines()
  assert line.startswith('the sides flatten their parameters in different orders (parameter 0:'
                         ' Linen params/Dense_0/bias, NNX params/Embed_0/embedding)'), line
  assert 'optax.clip_by_global_norm' in line


def _sides_with_their_own_rules(linen_rules, nnx_rules, mesh):
  """The encoder's sides, each placing its state by the rules given it here."""
  linen, nnx_side = make_sides(CFG, mesh)
  return dataclasses.replace(linen, rules=linen_rules), dataclasses.replace(nnx_side, rules=nnx_rules)


MLP_REPLICATED = tuple(('mlp', None) if name == 'mlp' else (name, axis) for name, axis in ENCODER_RULES)


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-encoder')
def test_a_parameter_placed_otherwise_on_one_side_fails_the_mesh_part_by_its_placement():
  """The mesh part checks where the state is before what it holds.

  Here the NNX side replicates the MLP's hidden units that Linen splits over
  `tensor`. That changes how the MLP's output projection adds up its products,
  so the numbers differ too (asserted below, so the order matters). The
  failure must still name the placement, which is the cause.
  """
  from parity.battery import checks as battery

  pair = dataclasses.replace(
      encoder, name='encoder_nnx_mlp_replicated',
      make_sides=functools.partial(_sides_with_their_own_rules, ENCODER_RULES, MLP_REPLICATED),
  )
  with pytest.raises(AssertionError) as e:
    battery.check_mesh(pair, MESH)
  message = str(e.value)
  assert message.startswith(f'encoder_nnx_mlp_replicated: final state shardings differ on {MESH}:'), message
  for i in range(CFG.num_layers):
    assert f'params/layers_{i}/Dense_0/kernel' in message  # mlp_in: [embed, mlp]
    assert f'params/layers_{i}/Dense_1/kernel' in message  # mlp_out: [mlp, embed]
  assert 'params/Dense_0/kernel' not in message  # the head is placed alike
  # The premise: the numbers differ as well, so a check of numbers first would have blamed them.
  runs = battery._runs(pair)
  (_, linen_final, _), (_, nnx_final, _) = (runs.trajectory(s, 'linen', MESH) for s in ('linen', 'nnx'))
  with pytest.raises(AssertionError, match='differ'):
    battery.compare(pair, 'train', linen_final, nnx_final, 'the final states')


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-encoder')
def test_numbers_that_differ_on_a_mesh_name_the_sharding_annotations_that_differ_too(monkeypatch):
  """The NNX encoder constrains its hidden states by another logical name (`mlp`, which the
  rules split over `tensor`, for Linen's `embed`, replicated): the parameters sit alike, the
  numbers differ, and the failure names the annotations that differ with them, the likely cause."""
  from models.nnx import encoder as nnx_encoder_module
  from parity.battery import checks as battery

  axes = dict(nnx_encoder_module.ENCODER_ACTIVATION_AXES, hidden=('batch', 'length', 'mlp'))
  monkeypatch.setattr(nnx_encoder_module, 'ENCODER_ACTIVATION_AXES', axes)
  pair = dataclasses.replace(encoder, name='encoder_nnx_mlp_constrained_otherwise')
  with pytest.raises(AssertionError) as e:
    battery.check_mesh(pair, MESH)
  message = str(e.value)
  assert f'encoder_nnx_mlp_constrained_otherwise: {encoder.steps} train steps on mesh {MESH} are not bit-identical' in message
  assert f'localizer on {MESH}:' in message, message
  assert 'places its intermediates otherwise' in message, message
  assert 'the sharding annotations of the train steps differ too' in message, message


@pytest.mark.xdist_group('parity-encoder')
def test_parameters_both_sides_replicate_against_the_rules_are_named_by_the_mesh_parts_rule_check():
  """Sides that agree with each other can both ignore the logical axes: each
  parameter is checked against what the pair's rules make of its axes."""
  from parity.battery import checks as battery

  mesh = specs.make_mesh(MESH)
  placed = []
  for rules in (None, ENCODER_RULES):  # None: the stock sides replicate the state
    linen, _ = _sides_with_their_own_rules(rules, rules, mesh)
    placed.append(battery._off_their_rules(encoder, linen, linen.to_checkpoint(linen.init(0))))
  replicated, by_the_rules = placed
  assert by_the_rules == []
  assert (
      "linen params/Embed_0/embedding: P() on data=2,fsdp=1,tensor=4; its logical axes ('vocab', 'embed')"
      " give P('tensor', None) on data=2,fsdp=1,tensor=4"
  ) in replicated, replicated
  assert not any('LayerNorm' in line for line in replicated)  # `embed` is not split: in place


def _ema_sides(keep_metadata, mesh):
  return ema.sides(linen_encoder, nnx_encoder, CFG, mesh, renames=RENAMES, rules=ENCODER_RULES,
                   keep_metadata=keep_metadata)


@pytest.mark.exhaustive
@pytest.mark.xdist_group('parity-encoder')
def test_an_optimizer_attribute_is_placed_and_carried_on_a_mesh_by_its_logical_axes():
  """An EMA of the parameters (`StockNnx(optimizer_fields=...)`) on the tensor-parallel
  mesh. Linen's copy of the boxed parameters keeps their logical axes. An NNX copy made
  from the values alone has none: the EMA is then replicated on that side, and the mesh
  part names each such leaf. With each copy keeping its parameter's metadata, training
  on the mesh is bitwise, the EMA included."""
  from parity.battery import checks as battery

  def pair(keep_metadata):
    return Pair(f'encoder_ema_{keep_metadata}', functools.partial(_ema_sides, keep_metadata),
                functools.partial(encoder_batch, CFG), steps=2, meshes=(MESH,), rules=ENCODER_RULES)

  with pytest.raises(AssertionError) as e:
    battery.check_mesh(pair(False), MESH)
  message = str(e.value).split('\nassert ')[0]  # pytest's own lines follow the battery's
  first, *lines = (line.strip() for line in message.splitlines())
  assert first == f'encoder_ema_False: final state shardings differ on {MESH}:', first
  assert lines and all(line.startswith('ema_params/') for line in lines), lines
  assert (
      "ema_params/layers_0/Dense_0/kernel: sharding: expected P(None, 'tensor') on data=2,fsdp=1,tensor=4"
      " (Linen), got P() on data=2,fsdp=1,tensor=4 (NNX)"
  ) in lines
  assert battery.check_mesh(pair(True), MESH) == []


@pytest.mark.xdist_group('parity-encoder')
def test_a_substitution_that_does_not_remove_the_difference_fails():
  """The stock-attention bound with a `substitute` that keeps the stock formula: the
  substituted pair still differs, so the declaration is not proven confined."""
  from parity.battery import checks as battery

  unproven = dataclasses.replace(STOCK_ATTENTION, substitute=functools.partial(make_sides, STOCK))
  pair = dataclasses.replace(encoder_stock_attention, known_differences=(unproven, STOCK_ATTENTION_PROGRAM))
  with pytest.raises(AssertionError) as e:
    battery.check_substitution(pair)
  message = str(e.value)
  assert 'the pair is still not bit-identical, so the declared modules are not the only difference' in message
  assert 'MultiHeadDotProductAttention_0' in message
  # The localizer's finding says what differs in flax's stock attention, and the kit's stand-in.
  assert "is flax's stock attention" in message and 'attention_fn=parity.linen_attention' in message, message


@pytest.mark.xdist_group('parity-encoder')
def test_outputs_that_differ_inside_attention_fail_the_eval_part_whatever_the_metrics():
  """Stock attention (a few hundred ULP inside it): the eval part compares the eval-mode logits
  bit for bit and fails naming them, however the scalar metrics round."""
  from parity.battery import checks as battery

  pair = dataclasses.replace(encoder_stock_attention, name='stock_attention_eval', parts=None,
                             known_differences=(STOCK_ATTENTION_PROGRAM,))
  with pytest.raises(AssertionError) as e:
    battery.check_eval(pair)
  message = str(e.value)
  assert 'eval-mode outputs from one state' in message and '  outputs: bits: float32[' in message, message
