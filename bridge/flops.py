"""Analytic FLOPs of one train step, in the form training logs commonly print.

"Per train step: Total TFLOPs: 0.80 split as 99.60% learnable weight flops
and 0.40% attention flops". Two parts, each counted as 2 FLOPs
per multiply-add and tripled for training (forward once, backward twice: the
gradients with respect to the inputs and to the weights):

- learnable weight FLOPs: every matmul against a weight matrix (query, key,
  value, output projections, the gated MLP's three matrices, the logits
  projection, tied or not). The embedding lookup is a gather: no FLOPs.
- attention FLOPs: the two matmuls of attention (scores `QK^T` and the
  weighted sum of values) over the full `L x L` score matrix, which is what
  this model computes (the causal and segment masks select, they do not skip).

Not counted: elementwise work (norms, RoPE, softmax, activations, the loss,
the optimizer update) and rematerialised recomputation; the count is the
model's, not the program's. XLA's cost analysis of the compiled step counts
everything, so it lands a little above this (tests/test_report.py states by
how much).
"""
from __future__ import annotations

import dataclasses

from models.config import ModelConfig, TrainConfig

# Forward once, backward twice (input gradients and weight gradients).
TRAIN_MULTIPLIER = 3


@dataclasses.dataclass(frozen=True)
class StepFlops:
  weights: float  # learnable weight FLOPs of one train step
  attention: float  # attention FLOPs of one train step

  @property
  def total(self) -> float:
    return self.weights + self.attention

  def summary(self) -> str:
    """The seed's line: 'Total TFLOPs: 0.80 split as 99.60% ... and 0.40% ...'."""
    total = self.total
    # The seed's unit, unless that would print 0.00 (small presets).
    unit, scale = ('TFLOPs', 1e12) if total >= 5e9 else ('GFLOPs', 1e9)
    return (
        f'Per train step: Total {unit}: {total / scale:.2f} split as'
        f' {100 * self.weights / total:.2f}% learnable weight flops and'
        f' {100 * self.attention / total:.2f}% attention flops'
    )


def weight_macs_per_token(model_cfg: ModelConfig) -> int:
  """Multiply-adds per token against weight matrices, forward only."""
  e, d = model_cfg.emb_dim, model_cfg.head_dim
  attention = e * d * (2 * model_cfg.num_heads + 2 * model_cfg.num_kv_heads)  # q, out; k, v
  mlp = 3 * e * model_cfg.mlp_dim  # wi_0, wi_1, wo
  logits = e * model_cfg.vocab_size
  return model_cfg.num_layers * (attention + mlp) + logits


def attention_macs_per_sequence(model_cfg: ModelConfig, seq_len: int) -> int:
  """Multiply-adds of `QK^T` and `PV` per sequence, all layers, forward only."""
  per_layer = 2 * seq_len * seq_len * model_cfg.num_heads * model_cfg.head_dim
  return model_cfg.num_layers * per_layer


def train_step_flops(model_cfg: ModelConfig, train_cfg: TrainConfig) -> StepFlops:
  """FLOPs of one train step over the whole global batch (all devices together)."""
  tokens = train_cfg.batch_size * train_cfg.seq_len
  weights = 2 * TRAIN_MULTIPLIER * tokens * weight_macs_per_token(model_cfg)
  attention = (
      2 * TRAIN_MULTIPLIER * train_cfg.batch_size
      * attention_macs_per_sequence(model_cfg, train_cfg.seq_len)
  )
  return StepFlops(float(weights), float(attention))
