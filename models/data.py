"""Deterministic synthetic batches.

Each row packs one or two segments of random token ids followed by padding,
so segment masking, position resets and the loss mask are all exercised.
Batches depend only on (seed, split, step): both sides, and a resumed run,
see exactly the same data.
"""
from __future__ import annotations

import numpy as np

from models.config import ModelConfig, TrainConfig

_SPLITS = {'train': 0, 'eval': 1}


def make_batch(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    step: int,
    split: str = 'train',
    batch_size: int | None = None,
) -> dict[str, np.ndarray]:
  """Returns {inputs, targets, segment_ids, positions}, each int32 [B, L].

  `targets[b, t]` is the token after `inputs[b, t]` in the same segment;
  padding has segment id 0, and those positions carry no loss.
  """
  if split not in _SPLITS:
    raise ValueError(f'split must be one of {sorted(_SPLITS)}, got {split!r}')
  b = train_cfg.batch_size if batch_size is None else batch_size
  length = train_cfg.seq_len
  rng = np.random.default_rng([train_cfg.seed, _SPLITS[split], step])
  inputs = np.zeros((b, length), np.int32)
  targets = np.zeros((b, length), np.int32)
  segment_ids = np.zeros((b, length), np.int32)
  positions = np.zeros((b, length), np.int32)
  for row in range(b):
    # Leave between 1 and L/4 padding positions at the end of every row.
    used = length - int(rng.integers(1, length // 4 + 1))
    num_segments = 1 + row % 2
    cut = used // 2 if num_segments == 2 else used
    bounds = [(0, cut), (cut, used)][:num_segments]
    for seg, (start, stop) in enumerate(bounds, start=1):
      tokens = rng.integers(1, model_cfg.vocab_size, stop - start + 1)
      inputs[row, start:stop] = tokens[:-1]
      targets[row, start:stop] = tokens[1:]
      segment_ids[row, start:stop] = seg
      positions[row, start:stop] = np.arange(stop - start)
  return {
      'inputs': inputs,
      'targets': targets,
      'segment_ids': segment_ids,
      'positions': positions,
  }
