"""The encoder family, through the plugin only: flax's stock attention, norm and embedding.

`encoder`: the NNX attention is given Linen's formula
(models/nnx/encoder.linen_dot_product_attention); the whole battery is bitwise.

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

from bridge.stock import Renames
from models.families import ENCODER_RULES, EncoderConfig, encoder_batch
from models.linen import encoder as linen_encoder
from models.nnx import encoder as nnx_encoder
from parity.adapter import KnownDifference, Pair
from parity.stock import StockLinen, StockNnx

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
      mesh=mesh, rules=ENCODER_RULES,
  )
  nnx_side = StockNnx(
      functools.partial(nnx_encoder.create_train_state, cfg),
      nnx_encoder.train_step, nnx_encoder.eval_step, nnx_encoder.loss_fn,
      renames=RENAMES, mesh=mesh, rules=ENCODER_RULES,
  )
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
    max_ulp=1536,  # measured: 1408 on jax 0.10, 1536 on jax 0.12 (portable CPU flags)
    reason=(
        'stock attention scales at another point: Linen (flax.linen.dot_product_attention_weights)'
        ' divides the query by sqrt(head_dim) before q.k; nnx.MultiHeadAttention without dropout'
        ' calls jax.nn.dot_product_attention, which multiplies the logits by 1/sqrt(head_dim)'
        ' after it. Same constant bits, other rounding (none when head_dim is a power of 4);'
        ' giving NNX the Linen formula makes every check bitwise (the encoder pair)'
    ),
)
encoder_stock_attention = Pair(
    'encoder_stock_attention',
    functools.partial(make_sides, STOCK),
    functools.partial(encoder_batch, STOCK),
    known_differences=(STOCK_ATTENTION,),
    parts=('structure', 'specs', 'localize'),
)


@pytest.mark.xdist_group('parity-encoder')  # the pair's runs are that group's
def test_the_encoders_activation_constraints_are_compared():
  """Not vacuous: each side constrains the embedding's output, each layer's MLP hidden
  units and its output; the backward pass constrains their cotangents alike."""
  from parity import battery

  (line,) = battery.check_specs(encoder)
  forward = 1 + 2 * CFG.num_layers
  assert line == f'activation constraints: {2 * forward} per train step, the same logical names on both sides'


@pytest.mark.xdist_group('parity-encoder')
def test_an_activation_name_the_rules_do_not_know_fails_the_specs_part():
  """flax leaves a logical name its rules do not know unsharded on both sides, which
  would compare as equal: the specs part names it instead (here the rules lack `mlp`)."""
  from parity import battery

  rules = tuple(r for r in ENCODER_RULES if r[0] != 'mlp')
  with pytest.raises(ValueError, match=r"logical axes the rules do not know: \['mlp'\]"):
    battery.check_specs(dataclasses.replace(encoder, rules=rules))


@pytest.mark.xdist_group('parity-encoder')
def test_parameters_flattened_in_another_order_are_named():
  """The encoder's NNX attributes sort otherwise than Linen's module names (`embed` first,
  `Dense_0` first): harmless with its optimizer, but a reduction over every leaf
  (optax.clip_by_global_norm) would round differently, so a failing update names it."""
  from parity import battery

  (line,) = battery._runs(encoder).parameter_order_lines()
  assert line.startswith('the sides flatten their parameters in different orders (parameter 0:'
                         ' Linen params/Dense_0/bias, NNX params/Embed_0/embedding)'), line
  assert 'optax.clip_by_global_norm' in line
