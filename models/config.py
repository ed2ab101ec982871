"""Model and training configuration, presets and scenarios.

Only stateless, framework-free things live here: both model sides read the
same dataclasses, so a config can never silently differ between them.
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer (llama2 layout, MaxText parameter names)."""

  vocab_size: int = 32000
  emb_dim: int = 2048
  num_layers: int = 16
  num_heads: int = 16
  num_kv_heads: int = 16
  head_dim: int = 128
  mlp_dim: int = 7168
  activation_dtype: str = 'bfloat16'
  weight_dtype: str = 'float32'
  norm_epsilon: float = 1e-6
  rope_min_timescale: float = 1.0
  rope_max_timescale: float = 10_000.0
  scan_layers: bool = True
  # Axis of the stacked layer parameters; 'layers' is inserted there in the
  # logical axes. Each side has its own so a layout rule can differ per side.
  param_scan_axis: int = 1
  nnx_param_scan_axis: int | None = None
  logits_via_embedding: bool = False
  dropout_rate: float = 0.0
  # 'none', 'full' or 'save_dots' (see models/linen/decoder.py REMAT_POLICIES).
  remat_policy: str = 'none'
  # 'fp8': every DenseGeneral contracts in fp8 (e4m3 forward, e5m2 gradients)
  # with delayed scaling. Its scales and amax histories are state that each
  # step overwrites with its "gradient"; the optimizer never touches them.
  quantization: str = 'none'
  fp8_amax_history_length: int = 16

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f'num_heads ({self.num_heads}) must be a multiple of num_kv_heads'
          f' ({self.num_kv_heads})'
      )
    if self.head_dim % 2:
      raise ValueError(f'head_dim must be even for RoPE, got {self.head_dim}')
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(
          f'remat_policy must be one of {REMAT_POLICIES}, got'
          f' {self.remat_policy!r}'
      )
    if self.quantization not in QUANTIZATIONS:
      raise ValueError(
          f'quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}'
      )

  @property
  def nnx_scan_axis(self) -> int:
    """The stacking axis of the NNX side (defaults to the Linen one)."""
    if self.nnx_param_scan_axis is None:
      return self.param_scan_axis
    return self.nnx_param_scan_axis

  def param_count(self) -> int:
    """Analytic parameter count (checked against both trees by the tests)."""
    e, m, l = self.emb_dim, self.mlp_dim, self.num_layers
    attn = e * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
    per_layer = attn + 3 * e * m + 2 * e
    count = l * per_layer + self.vocab_size * e + e
    if not self.logits_via_embedding:
      count += e * self.vocab_size
    return count


REMAT_POLICIES = ('none', 'full', 'save_dots')
QUANTIZATIONS = ('none', 'fp8')


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Data, optimizer and loss settings shared by both sides."""

  batch_size: int = 8
  seq_len: int = 64
  steps: int = 10
  seed: int = 0
  learning_rate: float = 1e-3
  warmup_steps: int = 2
  decay_steps: int = 10
  end_learning_rate_ratio: float = 0.1
  adam_b1: float = 0.9
  adam_b2: float = 0.95
  adam_eps: float = 1e-8
  weight_decay: float = 0.1
  max_grad_norm: float = 1.0
  z_loss_weight: float = 1e-4
  grad_accum_steps: int = 1
  # After every `eval_every` train steps, evaluate on `eval_batches` held-out
  # batches (data split 'eval'); 0: never.
  eval_every: int = 0
  eval_batches: int = 2

  def __post_init__(self):
    if self.batch_size % self.grad_accum_steps:
      raise ValueError(
          f'batch_size ({self.batch_size}) must be divisible by'
          f' grad_accum_steps ({self.grad_accum_steps})'
      )


PRESETS: dict[str, tuple[ModelConfig, TrainConfig]] = {
    # The model of the seed logs: 1,104,218,112 parameters.
    'default': (ModelConfig(), TrainConfig(batch_size=8, seq_len=2048)),
    # Fast numerics: grouped-query attention, 2 layers, some padding per row.
    'tiny': (
        ModelConfig(
            vocab_size=256,
            emb_dim=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            mlp_dim=128,
        ),
        TrainConfig(batch_size=8, seq_len=64),
    ),
    # Large enough that a CPU step takes well over 50 ms (speed benchmarks).
    'small': (
        ModelConfig(
            vocab_size=4096,
            emb_dim=256,
            num_layers=4,
            num_heads=8,
            num_kv_heads=4,
            head_dim=32,
            mlp_dim=1024,
        ),
        TrainConfig(batch_size=8, seq_len=256),
    ),
    # The `tpu` test tier on a TPU host: 443,073,536 parameters in bfloat16
    # (weights and Adam moments); batch 32 splits over up to 32 chips.
    'tpu': (
        ModelConfig(
            vocab_size=32000,
            emb_dim=1024,
            num_layers=24,
            num_heads=16,
            num_kv_heads=8,
            head_dim=64,
            mlp_dim=4096,
            weight_dtype='bfloat16',
        ),
        TrainConfig(batch_size=32, seq_len=1024),
    ),
}


def get_preset(name: str) -> tuple[ModelConfig, TrainConfig]:
  """Returns the (model, train) configs of a preset, or raises KeyError."""
  try:
    return PRESETS[name]
  except KeyError:
    raise KeyError(
        f'unknown preset {name!r}; expected one of {sorted(PRESETS)}'
    ) from None


def replace(cfg: Any, **changes: Any) -> Any:
  """dataclasses.replace that names the bad field on a typo."""
  fields = {f.name for f in dataclasses.fields(cfg)}
  unknown = sorted(set(changes) - fields)
  if unknown:
    raise TypeError(f'{type(cfg).__name__} has no field(s) {unknown}')
  return dataclasses.replace(cfg, **changes)


@dataclasses.dataclass(frozen=True)
class Scenario:
  """A named set of changes to a preset's model and train configs."""

  name: str
  description: str
  model_changes: tuple[tuple[str, Any], ...] = ()
  train_changes: tuple[tuple[str, Any], ...] = ()

  def apply(self, model_cfg: ModelConfig, train_cfg: TrainConfig) -> tuple[ModelConfig, TrainConfig]:
    return (
        replace(model_cfg, **dict(self.model_changes)),
        replace(train_cfg, **dict(self.train_changes)),
    )


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario('01_baseline', 'the preset as is'),
    Scenario('02_unscanned', 'layers unrolled: decoder/layers_0/..., no layers axis',
             (('scan_layers', False),)),
    Scenario('03_dropout', 'dropout 0.1 on embedding, attention and MLP outputs (explicit keys)',
             (('dropout_rate', 0.1),)),
    Scenario('04_remat', 'full rematerialisation of each decoder layer',
             (('remat_policy', 'full'),)),
    Scenario('04_remat_save_dots', 'rematerialisation saving only non-batch dot products',
             (('remat_policy', 'save_dots'),)),
    Scenario('05_fp8', 'fp8 dot products (e4m3 forward, e5m2 gradients), delayed scaling',
             (('quantization', 'fp8'),)),
    Scenario('06_grad_accum', '4 microbatches in a scan, token-weighted, dropout 0.1',
             (('dropout_rate', 0.1),), (('grad_accum_steps', 4),)),
    Scenario('07_eval', 'train with dropout 0.1; every 2 steps eval (dropout off) on 2 held-out batches',
             (('dropout_rate', 0.1),), (('eval_every', 2), ('eval_batches', 2))),
    Scenario('08_bf16_weights', 'bfloat16 weights (and so bfloat16 optimizer moments)',
             (('weight_dtype', 'bfloat16'),)),
    Scenario('09_tied_logits', 'logits through the embedding: no logits_dense',
             (('logits_via_embedding', True),)),
    Scenario('10_scan_axis0', 'NNX stacks layers on axis 0, Linen on axis 1',
             (('nnx_param_scan_axis', 0),)),
    # The core tier's two scenarios (tests/tiers.py): every feature above that composes, in
    # two scenarios because fp8 and gradient accumulation cannot share one (both models
    # refuse the pair). 10_scan_axis0's layout, which differs by design, is left out.
    Scenario('11_composite_accum',
             '06_grad_accum (4 microbatches, dropout 0.1) with remat saving dots, eval every'
             ' 2 steps on 2 held-out batches, bfloat16 weights and tied logits',
             (('dropout_rate', 0.1), ('remat_policy', 'save_dots'),
              ('weight_dtype', 'bfloat16'), ('logits_via_embedding', True)),
             (('grad_accum_steps', 4), ('eval_every', 2), ('eval_batches', 2))),
    Scenario('12_composite_fp8',
             '05_fp8 with layers unrolled, dropout 0.1, full remat and eval every 2 steps on'
             ' 2 held-out batches',
             (('quantization', 'fp8'), ('scan_layers', False), ('dropout_rate', 0.1),
              ('remat_policy', 'full')),
             (('eval_every', 2), ('eval_batches', 2))),
)}


def get_scenario(name: str) -> Scenario:
  try:
    return SCENARIOS[name]
  except KeyError:
    raise KeyError(
        f'unknown scenario {name!r}; expected one of {sorted(SCENARIOS)}'
    ) from None


def get_configs(preset: str, scenario: str = '01_baseline') -> tuple[ModelConfig, TrainConfig]:
  """A preset with a scenario applied."""
  return get_scenario(scenario).apply(*get_preset(preset))
