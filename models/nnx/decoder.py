"""The NNX decoder: DecoderLayer, Decoder, Transformer.

Mirrors models/linen/decoder.py. Scanned layers are created with
`nnx.vmap` (stacked on `config.nnx_scan_axis`, 'layers' inserted into the
logical axes there) and applied with `nnx.scan`; per-layer dropout keys are
scan inputs. `init_cache` and `decode = True` make the attention layers keep a
KV cache (models/nnx/decode.py), stacked on CACHE_SCAN_AXIS when scanned.
"""
from __future__ import annotations

import jax
from flax import nnx

from models import rng
from models.config import ModelConfig
from models.nnx.layers import MLP, Attention, DenseGeneral, Dropout, Embed, RMSNorm, logical_constraint

EMBED_AXES = ('activation_batch', 'activation_norm_length', 'activation_embed')

# The scanned cache's layer axis: 0, not the parameters' axis, since the
# scalar `cache_index` has no axis 1 (the same on the Linen side).
CACHE_SCAN_AXIS = 0

REMAT_POLICIES = {
    'full': jax.checkpoint_policies.nothing_saveable,
    'save_dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class DecoderLayer(nnx.Module):
  """Pre-norm attention and gated MLP with residuals (llama2)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.pre_self_attention_layer_norm = RMSNorm(config.emb_dim, config, rngs=rngs)
    self.self_attention = Attention(config, rngs=rngs)
    self.post_self_attention_layer_norm = RMSNorm(config.emb_dim, config, rngs=rngs)
    self.mlp = MLP(config, rngs=rngs)
    self.dropout = Dropout(config.dropout_rate)

  def __call__(self, x_BLE, positions_BL, segment_ids_BL, layer_key):
    x_BLE = logical_constraint(x_BLE, EMBED_AXES)
    h_BLE = self.pre_self_attention_layer_norm(x_BLE)
    attn_BLE = self.self_attention(h_BLE, positions_BL, segment_ids_BL)
    attn_BLE = self.dropout(attn_BLE, rng.site_key(layer_key, rng.Site.ATTENTION_OUTPUT))
    x_BLE = x_BLE + attn_BLE
    h_BLE = self.post_self_attention_layer_norm(x_BLE)
    mlp_BLE = self.mlp(h_BLE)
    mlp_BLE = self.dropout(mlp_BLE, rng.site_key(layer_key, rng.Site.MLP_OUTPUT))
    x_BLE = logical_constraint(x_BLE + mlp_BLE, EMBED_AXES)
    return x_BLE, None


def _apply_layer(layer: DecoderLayer, x_BLE, positions_BL, segment_ids_BL, layer_key):
  return layer(x_BLE, positions_BL, segment_ids_BL, layer_key)[0]


def _remat_layer(policy_name: str, prevent_cse: bool):
  """`_apply_layer` under `jax.checkpoint`, the layer entering as pure state.

  The layer's parameters are inputs of the rematerialised function and not
  outputs: `nnx.remat` over the module would also return the layer's state,
  and XLA then keeps those outputs alive for the backward pass (measured:
  +7% temporaries on `tiny`, +16% on `default`, against Linen's `nn.remat`,
  whose parameters are inputs only).

  The state enters in Linen's order: `nn.remat` takes a layer's variables as
  one dict of collections, which jax flattens in key order, so the fp8
  scaling state (`_overwrite_with_gradient`) comes before `params`. Split by
  path instead, fp8 under remat was another program (the canonical programs
  differed when unscanned; scanned, the backward loop carried its values in
  another order).
  """

  def apply_state(graphdef, states, x_BLE, positions_BL, segment_ids_BL, layer_key):
    return _apply_layer(nnx.merge(graphdef, *states), x_BLE, positions_BL, segment_ids_BL, layer_key)

  remat = jax.checkpoint(
      apply_state, policy=REMAT_POLICIES[policy_name], prevent_cse=prevent_cse, static_argnums=(0,)
  )

  def apply_layer(layer: DecoderLayer, x_BLE, positions_BL, segment_ids_BL, layer_key):
    graphdef, *states = nnx.split(layer, nnx.Not(nnx.Param), nnx.Param)
    return remat(graphdef, states, x_BLE, positions_BL, segment_ids_BL, layer_key)

  return apply_layer


class Decoder(nnx.Module):
  """Embedding dropout, the layer stack, final norm and logits."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    cfg = self.config = config
    if cfg.scan_layers:
      @nnx.split_rngs(splits=cfg.num_layers)
      @nnx.vmap(
          in_axes=(0,),
          out_axes=cfg.nnx_scan_axis,
          transform_metadata={nnx.PARTITION_NAME: 'layers'},
      )
      def make_stack(rngs: nnx.Rngs) -> DecoderLayer:
        return DecoderLayer(cfg, rngs=rngs)

      self.layers = make_stack(rngs)
    else:
      for i in range(cfg.num_layers):
        setattr(self, f'layers_{i}', DecoderLayer(cfg, rngs=rngs))
    self.decoder_norm = RMSNorm(cfg.emb_dim, cfg, rngs=rngs)
    if not cfg.logits_via_embedding:
      self.logits_dense = DenseGeneral(
          (cfg.emb_dim,), (cfg.vocab_size,), ('embed_vocab', 'vocab'), cfg, rngs=rngs
      )
    self.dropout = Dropout(cfg.dropout_rate)
    self.decode = False  # set with the attention layers' (see Attention)

  def _layer_axes(self) -> nnx.StateAxes:
    """The stacked layers' state axes: parameters and fp8 state on the scan axis, caches on 0."""
    ax = self.config.nnx_scan_axis
    return nnx.StateAxes({nnx.Param: ax, nnx.Cache: CACHE_SCAN_AXIS, ...: ax})

  def init_cache(self, batch: int, max_len: int):
    """Creates every attention layer's empty cache (stacked like the layers when scanned)."""
    cfg = self.config
    if cfg.scan_layers:
      @nnx.vmap(
          in_axes=(self._layer_axes(),),
          out_axes=None,
          transform_metadata={nnx.PARTITION_NAME: 'layers'},
      )
      def init_stack(layer: DecoderLayer):
        layer.self_attention.init_cache(batch, max_len)

      init_stack(self.layers)
    else:
      for i in range(cfg.num_layers):
        getattr(self, f'layers_{i}').self_attention.init_cache(batch, max_len)

  def __call__(self, token_embedder: Embed, inputs_BL, positions_BL, segment_ids_BL, dropout_key):
    cfg = self.config
    x_BLE = token_embedder(inputs_BL)
    x_BLE = logical_constraint(x_BLE, EMBED_AXES)
    x_BLE = self.dropout(x_BLE, rng.embedding_key(dropout_key))
    keys = rng.layer_keys(dropout_key, cfg.num_layers)

    apply_layer = _apply_layer
    # Decoding takes no gradients: nothing to rematerialise.
    if cfg.remat_policy != 'none' and not self.decode:
      apply_layer = _remat_layer(cfg.remat_policy, prevent_cse=not cfg.scan_layers)
    if cfg.scan_layers:
      # The layers' state goes in as Linen's `nn.scan` takes it: the parameters,
      # then the rest (fp8 scaling state), each in path order. Without the split,
      # nnx.scan flattens them interleaved by path; the loop then carries the same
      # arrays in another order, which XLA:GPU schedules otherwise (05_fp8 on an
      # H100: NNX +32 KiB temporaries, bitwise equal numbers). A cache (decoding) is
      # scanned on its own axis and comes out updated.
      layer_axes = self._layer_axes()

      @nnx.scan(
          in_axes=(nnx.Carry, layer_axes, None, None, 0),
          out_axes=nnx.Carry,
          transform_metadata={nnx.PARTITION_NAME: 'layers'},
      )
      def run_stack(x_BLE, layer, positions_BL, segment_ids_BL, layer_key):
        return apply_layer(layer, x_BLE, positions_BL, segment_ids_BL, layer_key)

      x_BLE = run_stack(x_BLE, self.layers, positions_BL, segment_ids_BL, keys)
    else:
      for i in range(cfg.num_layers):
        layer = getattr(self, f'layers_{i}')
        x_BLE = apply_layer(layer, x_BLE, positions_BL, segment_ids_BL, keys[i])

    x_BLE = self.decoder_norm(x_BLE)
    if cfg.logits_via_embedding:
      logits_BLV = token_embedder.attend(x_BLE)
    else:
      logits_BLV = self.logits_dense(x_BLE)
    return logical_constraint(
        logits_BLV,
        ('activation_embed_and_logits_batch', 'activation_length', 'activation_vocab'),
    )


class Transformer(nnx.Module):
  """Token embedder plus decoder; parameter paths token_embedder/..., decoder/...

  Decoding with a KV cache: `init_cache`, then `set_attributes(decode=True)`
  (models/nnx/decode.py).
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.token_embedder = Embed(config, rngs=rngs)
    self.decoder = Decoder(config, rngs=rngs)

  def init_cache(self, batch: int, max_len: int):
    """Creates the empty KV caches of `batch` rows and `max_len` positions."""
    self.decoder.init_cache(batch, max_len)

  def __call__(self, inputs_BL, positions_BL, segment_ids_BL, dropout_key):
    return self.decoder(self.token_embedder, inputs_BL, positions_BL, segment_ids_BL, dropout_key)
