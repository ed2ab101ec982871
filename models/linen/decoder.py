"""The Linen decoder: DecoderLayer, Decoder, Transformer.

Mirrors models/nnx/decoder.py. Scanned layers use `nn.scan`, stacking
parameters on `config.param_scan_axis` and inserting the logical axis
'layers' there; per-layer dropout keys are scan inputs. With `decode=True`
the attention layers keep a KV cache (models/linen/decode.py), stacked on
CACHE_SCAN_AXIS when scanned.
"""
from __future__ import annotations

import flax.linen as nn
import jax
from flax.linen import fp8_ops

from models import rng
from models.config import ModelConfig
from models.linen.layers import MLP, Attention, DenseGeneral, Dropout, Embed, RMSNorm

EMBED_AXES = ('activation_batch', 'activation_norm_length', 'activation_embed')

# The scanned cache's layer axis: 0, not the parameters' axis, since the
# scalar `cache_index` has no axis 1 (the same on the NNX side).
CACHE_SCAN_AXIS = 0

REMAT_POLICIES = {
    'full': jax.checkpoint_policies.nothing_saveable,
    'save_dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class DecoderLayer(nn.Module):
  """Pre-norm attention and gated MLP with residuals (llama2)."""

  config: ModelConfig
  deterministic: bool = False
  decode: bool = False

  @nn.compact
  def __call__(self, x_BLE, positions_BL, segment_ids_BL, layer_key):
    cfg = self.config
    x_BLE = nn.with_logical_constraint(x_BLE, EMBED_AXES)
    h_BLE = RMSNorm(cfg, name='pre_self_attention_layer_norm')(x_BLE)
    attn_BLE = Attention(cfg, self.decode, name='self_attention')(h_BLE, positions_BL, segment_ids_BL)
    attn_BLE = Dropout(cfg.dropout_rate, self.deterministic)(attn_BLE, rng.site_key(layer_key, rng.Site.ATTENTION_OUTPUT))
    x_BLE = x_BLE + attn_BLE
    h_BLE = RMSNorm(cfg, name='post_self_attention_layer_norm')(x_BLE)
    mlp_BLE = MLP(cfg, name='mlp')(h_BLE)
    mlp_BLE = Dropout(cfg.dropout_rate, self.deterministic)(mlp_BLE, rng.site_key(layer_key, rng.Site.MLP_OUTPUT))
    x_BLE = nn.with_logical_constraint(x_BLE + mlp_BLE, EMBED_AXES)
    return x_BLE, None


class Decoder(nn.Module):
  """Embedding dropout, the layer stack, final norm and logits."""

  config: ModelConfig
  deterministic: bool = False
  decode: bool = False

  @nn.compact
  def __call__(self, token_embedder: Embed, inputs_BL, positions_BL, segment_ids_BL, dropout_key):
    cfg = self.config
    x_BLE = token_embedder(inputs_BL)
    x_BLE = nn.with_logical_constraint(x_BLE, EMBED_AXES)
    x_BLE = Dropout(cfg.dropout_rate, self.deterministic)(x_BLE, rng.embedding_key(dropout_key))
    keys = rng.layer_keys(dropout_key, cfg.num_layers)

    layer_cls = DecoderLayer
    # Decoding takes no gradients: nothing to rematerialise.
    if cfg.remat_policy != 'none' and not self.decode:
      layer_cls = nn.remat(
          layer_cls,
          policy=REMAT_POLICIES[cfg.remat_policy],
          prevent_cse=not cfg.scan_layers,
      )
    if cfg.scan_layers:
      stack = nn.scan(
          layer_cls,
          # fp8 scaling state (if any) is stacked like the parameters.
          variable_axes={
              'params': cfg.param_scan_axis,
              fp8_ops.OVERWRITE_WITH_GRADIENT: cfg.param_scan_axis,
              'cache': CACHE_SCAN_AXIS,
          },
          split_rngs={'params': True},
          in_axes=(nn.broadcast, nn.broadcast, 0),
          length=cfg.num_layers,
          metadata_params={nn.PARTITION_NAME: 'layers'},
      )
      x_BLE, _ = stack(cfg, self.deterministic, self.decode, name='layers')(
          x_BLE, positions_BL, segment_ids_BL, keys
      )
    else:
      for i in range(cfg.num_layers):
        x_BLE, _ = layer_cls(cfg, self.deterministic, self.decode, name=f'layers_{i}')(
            x_BLE, positions_BL, segment_ids_BL, keys[i]
        )

    x_BLE = RMSNorm(cfg, name='decoder_norm')(x_BLE)
    if cfg.logits_via_embedding:
      logits_BLV = token_embedder.attend(x_BLE)
    else:
      logits_BLV = DenseGeneral(
          (cfg.emb_dim,), (cfg.vocab_size,), ('embed_vocab', 'vocab'), cfg, name='logits_dense'
      )(x_BLE)
    return nn.with_logical_constraint(
        logits_BLV,
        ('activation_embed_and_logits_batch', 'activation_length', 'activation_vocab'),
    )


class Transformer(nn.Module):
  """Token embedder plus decoder; variables read params/token_embedder, params/decoder.

  `decode=True`: autoregressive decoding with a KV cache in the 'cache'
  collection (models/linen/decode.py).
  """

  config: ModelConfig
  deterministic: bool = False
  decode: bool = False

  @nn.compact
  def __call__(self, inputs_BL, positions_BL, segment_ids_BL, dropout_key):
    token_embedder = Embed(self.config, name='token_embedder')
    return Decoder(self.config, self.deterministic, self.decode, name='decoder')(
        token_embedder, inputs_BL, positions_BL, segment_ids_BL, dropout_key
    )
