"""`parity convert`: a streaming converter between the Linen and an NNX checkpoint layout.

Both sides of this project write the Linen layout (`parity.store.checkpoints`), so
they need no conversion. This is for codebases whose NNX side keeps its own
native tree: `0/<path>` for the model (parameters and fp8 scaling state,
Linen's `params/params/` and `fp8_meta/`; a model leaf is fp8 state when its
last path segment is an fp8 delayed-scaling variable's name, FP8_META_NAMES,
and no optimizer state mirrors it; `--to nnx` refuses any other `fp8_meta/` leaf),
`1/step` (uint32, as
`nnx.Optimizer` keeps it) and `1/opt_state/<...>/<param path>` for the
optimizer, the paths of `nnx.state((model, optimizer))`, and possibly
parameters stored differently. Layouts (`--layout`):

  same         layers stacked as on the Linen side (only the paths change)
  scan_axis<N> NNX stacks layers on axis N (e.g. scan_axis0); the Linen side
               on `param_scan_axis` (1 unless the config says otherwise)
  unscanned    one array per layer, `decoder/layers_<i>/...`, instead of
               `decoder/layers/...` stacked on the Linen scan axis

plus an optional rename-rule file: one `LINEN => NNX` rule per line, each
side a '/'-separated run of path segments (`self_attention => attn`); rules
rewrite parameter paths (and so their optimizer mirrors) in file order,
every whole-segment match; `#` starts a comment. `--to nnx` applies the
layout and then the rules; `--to linen` undoes them.

It streams. Each destination array is made chunk by chunk: where a source
chunk is small enough (an fsdp-sharded save), each destination chunk is the
image of one source chunk, decoded once; otherwise the destination is
written in boxes of at most 64 MiB while the source's decoded chunks stay
cached. An array whose bytes do not change is decoded once (to catch
damage) and its encoded chunks are copied as they are. Peak memory stays
near the largest array (about twice the largest chunk), never the whole
state. Arrays are written with tensorstore into a zarr3 + OCDBT Orbax step
directory, `_METADATA` and `_sharding` rewritten to match; other items (the
dropout key) are copied. Everything goes into a temporary directory next to
DST, renamed into place only when complete; SRC is only ever read; a
non-empty DST is refused unless `overwrite`, which renames the old DST aside,
the new one into its place, then removes the old one (SIGTERM and Ctrl-C wait
while the two renames run). SIGTERM or Ctrl-C removes the temporary
directory; after SIGKILL the next conversion to that DST does (and puts an
old DST back if the kill came between the two renames). A failure to write
(a full disk, a file size limit) is one ConvertError: nothing written to DST;
should the old DST of `overwrite` then fail to go back in place, the message
says where it is.

Damage is caught where the format allows: a truncated file, an overwritten
region (zarr3 shard indexes carry a crc32c). Orbax writes zstd frames
without checksums, so one flipped bit inside array data can go unnoticed.
Arrays the converter re-encodes (a layout change, the step's dtype) are
written with zstd checksums on; arrays copied byte for byte keep the
source's encoding, checksums or none.
"""
from __future__ import annotations

import argparse
import base64
import collections
import dataclasses
import itertools
import json
import math
import os
import re
import shutil
import signal
import sys
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from parity.core.errors import Problem, TreeMismatchError

ITEMS = 'items'  # the train state item (parity.store.checkpoints.ITEMS)
METADATA = '_METADATA'
CHECKPOINT_METADATA = '_CHECKPOINT_METADATA'
PYTREE_HANDLER = 'orbax.checkpoint._src.handlers.pytree_checkpoint_handler.PyTreeCheckpointHandler'
# A destination chunk that is the image of one source chunk may be this big;
# larger ones are split into boxes of BOX_BYTES.
ALIGNED_CHUNK_BYTES = 256 * 2**20
BOX_BYTES = 64 * 2**20
MAX_WRITES_IN_FLIGHT = 2
LAYERS = 'decoder/layers/'
FP8_META = 'fp8_meta/'  # fp8 scaling state (bridge.train_state.FP8_PREFIX); NNX: model state
# The fp8 delayed-scaling variables: flax's Fp8DirectDotGeneralOp on the Linen
# side, models/nnx/layers.py Fp8DotGeneral's `Fp8Meta` on the NNX side.
FP8_META_NAMES = frozenset({
    'input_amax_history', 'kernel_amax_history', 'output_grad_amax_history',
    'input_scale', 'kernel_scale', 'output_grad_scale',
})
_UNSCANNED = re.compile(r'^decoder/layers_(\d+)/(.*)$')
_SCAN_AXIS = re.compile(r'^scan_axis(\d+)$')
LAYOUT_HELP = "'same', 'scan_axis<N>' (e.g. scan_axis0) or 'unscanned'"
NNX_STEP_DTYPE = np.dtype(np.uint32)
LINEN_STEP_DTYPE = np.dtype(np.int32)


class ConvertError(ValueError):
  """Bad input to the converter: one clear message, nothing written."""


class Interrupted(ConvertError):
  """SIGTERM or Ctrl-C arrived mid-conversion (the temporary output is removed)."""


NOTHING_WRITTEN = 'nothing written to DST, SRC untouched'


# ---------------------------------------------------------------- layouts ---


@dataclasses.dataclass(frozen=True)
class Transform:
  """How one destination array is made from source arrays (given by path).

  `perm`: dst = src.transpose(perm). `take`: dst = src[(slice,)*axis + (i,)].
  `stack_axis`: dst = stack(sources, axis). `dtype`: an exact integer cast.
  """

  sources: tuple[str, ...]
  perm: tuple[int, ...] | None = None
  take: tuple[int, int] | None = None
  stack_axis: int | None = None
  dtype: np.dtype | None = None


@dataclasses.dataclass(frozen=True)
class Layout:
  """How the NNX side stores the parameters stacked under `decoder/layers/`."""

  name: str
  linen_axis: int = 1
  nnx_axis: int | None = None  # scan_axis<N>; None: unscanned (or same)
  unscanned: bool = False

  def param_to_nnx(self, path: str, shape: Sequence[int]) -> list[tuple[str, dict[str, Any]]]:
    """[(NNX param path, Transform fields)] for one Linen parameter."""
    if not path.startswith(LAYERS) or self.name == 'same':
      return [(path, {})]
    if self.unscanned:
      if len(shape) <= self.linen_axis:
        raise ConvertError(f'{path}: rank {len(shape)} has no layer axis {self.linen_axis}')
      rest = path[len(LAYERS):]
      return [
          (f'decoder/layers_{i}/{rest}', {'take': (self.linen_axis, i)})
          for i in range(shape[self.linen_axis])
      ]
    return [(path, {'perm': _move_perm(len(shape), self.linen_axis, self.nnx_axis)})]

  def param_to_linen(self, path: str) -> tuple[str, int | None]:
    """(Linen param path, layer index to stack at or None) for one NNX parameter."""
    if self.unscanned:
      match = _UNSCANNED.match(path)
      if match:
        return LAYERS + match.group(2), int(match.group(1))
    return path, None

  def linen_fields(self, path: str, ndim: int) -> dict[str, Any]:
    if self.unscanned and path.startswith(LAYERS):
      return {'stack_axis': self.linen_axis}
    if self.nnx_axis is not None and path.startswith(LAYERS):
      return {'perm': _move_perm(ndim, self.nnx_axis, self.linen_axis)}
    return {}


def _move_perm(ndim: int, src: int, dst: int) -> tuple[int, ...]:
  """The transpose permutation of `np.moveaxis(x, src, dst)`."""
  if not (0 <= src < ndim and 0 <= dst < ndim):
    raise ConvertError(f'cannot move axis {src} to {dst} of a rank-{ndim} array')
  perm = list(range(ndim))
  perm.insert(dst, perm.pop(src))
  return tuple(perm)


def parse_layout(name: str, linen_axis: int = 1) -> Layout:
  if name == 'same':
    return Layout('same', linen_axis)
  if name == 'unscanned':
    return Layout('unscanned', linen_axis, unscanned=True)
  match = _SCAN_AXIS.match(name)
  if match:
    return Layout(name, linen_axis, nnx_axis=int(match.group(1)))
  raise ConvertError(f'unknown layout {name!r}; expected {LAYOUT_HELP}')


def layout_name_for(model_cfg) -> str:
  """The layout a config implies for its NNX side."""
  if model_cfg.scan_layers and model_cfg.nnx_scan_axis != model_cfg.param_scan_axis:
    return f'scan_axis{model_cfg.nnx_scan_axis}'
  return 'same'


# ----------------------------------------------------------------- renames ---


@dataclasses.dataclass(frozen=True)
class RenameRule:
  linen: tuple[str, ...]
  nnx: tuple[str, ...]
  line: int


def read_rename_rules(path: str | os.PathLike) -> list[RenameRule]:
  try:
    with open(path) as f:
      text = f.read()
  except OSError as e:
    raise ConvertError(f'cannot read rename rules {path}: {e.strerror}') from None
  return parse_rename_rules(text, str(path))


def parse_rename_rules(text: str, where: str = 'rules') -> list[RenameRule]:
  rules = []
  for number, raw in enumerate(text.splitlines(), 1):
    line = raw.split('#', 1)[0].strip()
    if not line:
      continue
    parts = [p.strip() for p in line.split('=>')]
    if len(parts) != 2 or not all(parts):
      raise ConvertError(f"{where}:{number}: expected 'LINEN => NNX', got {raw.strip()!r}")
    linen, nnx = (tuple(s for s in p.strip('/').split('/')) for p in parts)
    if '' in linen or '' in nnx:
      raise ConvertError(f'{where}:{number}: empty path segment in {raw.strip()!r}')
    rules.append(RenameRule(linen, nnx, number))
  return rules


def _replace_segments(segments: list[str], old: tuple[str, ...], new: tuple[str, ...]) -> tuple[list[str], int]:
  out, i, count = [], 0, 0
  while i < len(segments):
    if tuple(segments[i:i + len(old)]) == old:
      out.extend(new)
      i += len(old)
      count += 1
    else:
      out.append(segments[i])
      i += 1
  return out, count


class _Renamer:
  """Applies rename rules to parameter paths and counts their matches."""

  def __init__(self, rules: Sequence[RenameRule], to: str):
    self.rules = list(rules)
    self.to = to
    self.used = collections.Counter()

  def __call__(self, path: str) -> str:
    segments = path.split('/')
    rules = self.rules if self.to == 'nnx' else reversed(self.rules)
    for rule in rules:
      old, new = (rule.linen, rule.nnx) if self.to == 'nnx' else (rule.nnx, rule.linen)
      segments, count = _replace_segments(segments, old, new)
      self.used[rule.line] += count
    return '/'.join(segments)

  def check_all_used(self) -> None:
    unused = [r for r in self.rules if not self.used[r.line]]
    if unused:
      rule = unused[0]
      raise ConvertError(
          f"rename rule on line {rule.line} ({'/'.join(rule.linen)} => {'/'.join(rule.nnx)})"
          f' matches no parameter path' + (f' (and {len(unused) - 1} more rules)' if len(unused) > 1 else '')
      )


# ---------------------------------------------------- reading the source ---


@dataclasses.dataclass(frozen=True)
class SourceArray:
  path: str  # '/'-joined tree path
  name: str  # Orbax parameter name ('.'-joined)
  shape: tuple[int, ...]
  dtype: np.dtype
  chunk: tuple[int, ...]  # the decoding unit (zarr3 inner chunk)
  value_metadata: dict[str, Any]

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.dtype.itemsize


def find_step(src: str, step: int | None) -> tuple[int, str]:
  """(step, step directory) of an Orbax CheckpointManager directory."""
  if not os.path.exists(src):
    raise ConvertError(f'SRC {src} does not exist')
  if not os.path.isdir(src):
    raise ConvertError(f'SRC {src} is not an Orbax checkpoint directory (it is a file)')
  if os.path.exists(os.path.join(src, CHECKPOINT_METADATA)):
    raise ConvertError(
        f'SRC {src} is a single step directory; pass its parent (the checkpoint'
        f' directory) and --step {os.path.basename(os.path.normpath(src))}'
    )
  steps = sorted(
      int(name) for name in os.listdir(src)
      if name.isdigit() and os.path.exists(os.path.join(src, name, CHECKPOINT_METADATA))
  )
  if not steps:
    raise ConvertError(
        f'SRC {src} is not an Orbax checkpoint directory: no step directories'
        f' (<step>/{CHECKPOINT_METADATA}) in it'
    )
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise ConvertError(f'SRC {src} has no step {step}; steps there: {steps}')
  return step, os.path.join(src, str(step))


def _read_json(path: str, what: str) -> Any:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    raise ConvertError(f'not an Orbax checkpoint: {what} {path} is missing') from None
  except (OSError, ValueError) as e:
    raise ConvertError(f'{what} {path} is unreadable or corrupted: {e}') from None


def _ocdbt_spec(item_dir: str, *, write: bool) -> dict[str, Any]:
  spec: dict[str, Any] = {'driver': 'ocdbt', 'base': f'file://{os.path.abspath(item_dir)}/'}
  if write:
    # As Orbax writes it (orbax tensorstore_utils._add_ocdbt_write_options).
    spec['config'] = {'max_inline_value_bytes': 1024, 'max_decoded_node_bytes': 100_000_000}
    spec['target_data_file_size'] = 2**31
  return spec


def _first_line(error: BaseException) -> str:
  return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _write_failure(error: BaseException) -> str:
  """The first line of a failure to write, less tensorstore's spec (a long JSON)."""
  return re.sub(r" \[tensorstore_spec='.*?'\]", '', _first_line(error))


def _unreadable(path: str, item_dir: str, error: BaseException) -> str:
  return (
      f'array {path} in {item_dir} cannot be read (file missing, truncated or corrupted):'
      f' {_first_line(error)}'
  )


def read_item(item_dir: str, context) -> tuple[dict[str, SourceArray], dict[str, Any]]:
  """({path: SourceArray}, parsed _METADATA) of one Orbax PyTree item (OCDBT + zarr3)."""
  import tensorstore as ts

  metadata = _read_json(os.path.join(item_dir, METADATA), 'Orbax tree metadata')
  tree = metadata.get('tree_metadata') if isinstance(metadata, dict) else None
  if not isinstance(tree, dict):
    raise ConvertError(f'{item_dir}/{METADATA} is not Orbax tree metadata')
  if not metadata.get('use_ocdbt', False) or not metadata.get('use_zarr3', False):
    raise ConvertError(
        f'{item_dir}: only OCDBT + zarr3 Orbax checkpoints are supported'
        f" (this one has use_ocdbt={metadata.get('use_ocdbt')}, use_zarr3={metadata.get('use_zarr3')})"
    )
  if not os.path.exists(os.path.join(item_dir, 'manifest.ocdbt')):
    raise ConvertError(f'{item_dir}: OCDBT manifest (manifest.ocdbt) is missing')
  entries = []
  for entry in tree.values():
    keys = tuple(str(k['key']) for k in entry['key_metadata'])
    entries.append((keys, entry))
  opened = {}
  for keys, entry in entries:
    name = '.'.join(keys)
    spec = {'driver': 'zarr3', 'kvstore': {**_ocdbt_spec(item_dir, write=False), 'path': name + '/'}}
    opened[keys] = ts.open(spec, read=True, open=True, context=context)
  arrays = {}
  for keys, entry in entries:
    path = '/'.join(keys)
    try:
      store = opened[keys].result()
    except Exception as e:  # tensorstore raises ValueError and others
      raise ConvertError(_unreadable(path, item_dir, e)) from None
    arrays[path] = SourceArray(
        path, '.'.join(keys), tuple(store.shape), np.dtype(store.dtype.numpy_dtype),
        tuple(store.chunk_layout.read_chunk.shape or store.shape),
        dict(entry.get('value_metadata', {})),
    )
  return arrays, metadata


# ------------------------------------------------------------------- plan ---


def _describe(x) -> str:
  return f'{x.dtype.name}{list(x.shape)}'


@dataclasses.dataclass(frozen=True)
class Job:
  path: str
  shape: tuple[int, ...]
  dtype: np.dtype
  transform: Transform

  @property
  def nbytes(self) -> int:
    return math.prod(self.shape) * self.dtype.itemsize


def _split_linen(path: str) -> tuple[str, str] | None:
  """(head, model path) of a Linen checkpoint path of a parameter, its optimizer mirror or fp8 state."""
  for head in ('params/params/', FP8_META):
    if path.startswith(head):
      return head, path[len(head):]
  if path.startswith('opt_state/'):
    i = path.find('/params/')
    if i >= 0:
      return path[: i + len('/params/')], path[i + len('/params/'):]
  return None


def _nnx_head(linen_head: str) -> str:
  if linen_head in ('params/params/', FP8_META):
    return '0/'
  return '1/' + linen_head[: -len('params/')]


def _linen_head(nnx_head: str) -> str:
  return nnx_head[len('1/'):] + 'params/'


def _transformed_shape(shape: Sequence[int], fields: Mapping[str, Any], count: int = 1) -> tuple[int, ...]:
  shape = list(shape)
  if fields.get('perm') is not None:
    shape = [shape[a] for a in fields['perm']]
  if fields.get('take') is not None:
    shape.pop(fields['take'][0])
  if fields.get('stack_axis') is not None:
    shape.insert(fields['stack_axis'], count)
  return tuple(shape)


def plan_to_nnx(arrays: Mapping[str, SourceArray], layout: Layout, rename: _Renamer) -> list[Job]:
  """A `fp8_meta/` leaf must be fp8 scaling state as `plan_to_linen` tells it (named
  one of FP8_META_NAMES, without optimizer state): NNX keeps it with the parameters,
  and any other leaf there would come back as a parameter."""
  jobs, problems = [], []
  mirrored = {split[1] for p in arrays if p.startswith('opt_state/') and (split := _split_linen(p))}
  for path, src in arrays.items():
    split = _split_linen(path)
    if split is not None:
      head, param = split
      if head == FP8_META and not _is_fp8_meta(param, mirrored=param in mirrored):
        problems.append(Problem(
            path, 'fp8_meta',
            f'fp8 scaling state: named one of {", ".join(sorted(FP8_META_NAMES))}, without optimizer state',
            _describe(src) + (' with optimizer state' if param in mirrored else ''),
        ))
        continue
      for nnx_param, fields in layout.param_to_nnx(param, src.shape):
        dst = _nnx_head(head) + rename(nnx_param)
        jobs.append(Job(dst, _transformed_shape(src.shape, fields), src.dtype, Transform((path,), **fields)))
    elif path == 'step':
      jobs.append(Job('1/step', src.shape, NNX_STEP_DTYPE, Transform((path,), dtype=NNX_STEP_DTYPE)))
    elif path.startswith('opt_state/'):
      jobs.append(Job('1/' + path, src.shape, src.dtype, Transform((path,))))
    else:
      problems.append(Problem(
          path, 'extra', 'a Linen checkpoint path (step, params/params/..., opt_state/..., fp8_meta/...)',
          _describe(src),
      ))
  if problems:
    raise TreeMismatchError('SRC is not in the Linen checkpoint layout', problems)
  return jobs


def _is_fp8_meta(linen_param: str, mirrored: bool) -> bool:
  """Named as fp8 scaling state, and without optimizer state (a trainable parameter of
  such a name has its moments)."""
  return linen_param.rsplit('/', 1)[-1] in FP8_META_NAMES and not mirrored


def plan_to_linen(arrays: Mapping[str, SourceArray], layout: Layout, rename: _Renamer) -> list[Job]:
  """A model leaf named as fp8 scaling state (FP8_META_NAMES: its last path
  segment, rename rules undone) and without optimizer state goes to
  `fp8_meta/`, every other one is a parameter (`params/params/`), with or
  without optimizer state. Unscanned:
  every array under `decoder/layers/` comes from `decoder/layers_<i>/`
  arrays, as many layers for each."""
  model = [p[len('0/'):] for p in arrays if p.startswith('0/')]
  longest_first = sorted(model, key=len, reverse=True)
  # The model leaf each optimizer leaf mirrors: the longest path it ends with.
  mirrored = {next((p for p in longest_first if o.endswith('/' + p)), None)
              for o in arrays if o.startswith('1/opt_state/')}
  params = [p for p in model if not _is_fp8_meta(rename(p), mirrored=p in mirrored)]
  params.sort(key=len, reverse=True)
  param_set = set(params)
  groups: dict[str, dict[int | None, str]] = collections.defaultdict(dict)
  singles: list[Job] = []
  problems = []
  for path, src in arrays.items():
    head = param = None
    if path.startswith('0/'):
      param = path[len('0/'):]
      head = 'params/params/' if param in param_set else FP8_META
    elif path.startswith('1/opt_state/'):
      param = next((p for p in params if path.endswith('/' + p)), None)
      if param is not None:
        head = _linen_head(path[: len(path) - len(param)])
    if param is not None:
      linen_param, index = layout.param_to_linen(rename(param))
      dst = head + linen_param
      if index in groups[dst]:
        problems.append(Problem(dst, 'duplicate', 'one source', f'{groups[dst][index]} and {path}'))
      groups[dst][index] = path
    elif path == '1/step':
      singles.append(Job('step', src.shape, LINEN_STEP_DTYPE, Transform((path,), dtype=LINEN_STEP_DTYPE)))
    elif path.startswith('1/'):
      singles.append(Job(path[len('1/'):], src.shape, src.dtype, Transform((path,))))
    else:
      problems.append(Problem(
          path, 'extra', 'an NNX state path (0/<param>, 1/step, 1/opt_state/...)', _describe(src)
      ))
  # Every stacked array has as many layers: the most common count (the larger on a tie).
  counts = collections.Counter(max(m) + 1 for m in groups.values() if None not in m)
  layers = max(counts, key=lambda n: (counts[n], n), default=0)
  jobs = []
  for dst, members in groups.items():
    linen_param = _split_linen(dst)[1]
    if None in members:
      if len(members) > 1:
        problems.append(Problem(dst, 'duplicate', 'one source', ', '.join(sorted(members.values()))))
        continue
      src = arrays[members[None]]
      if layout.unscanned and linen_param.startswith(LAYERS):
        problems.append(Problem(
            src.path, 'layers', 'one array per layer (decoder/layers_<i>/...)',
            f'{_describe(src)} with no layer index',
        ))
        continue
      fields = layout.linen_fields(linen_param, len(src.shape))
      jobs.append(Job(dst, _transformed_shape(src.shape, fields), src.dtype, Transform((src.path,), **fields)))
      continue
    indices = sorted(members)
    if indices != list(range(layers)):
      problems.append(Problem(dst, 'layers', f'layers 0..{layers - 1}', f'layers {indices}'))
      continue
    sources = [arrays[members[i]] for i in indices]
    first = sources[0]
    odd = [s.path for s in sources if (s.shape, s.dtype) != (first.shape, first.dtype)]
    if odd:
      problems.append(Problem(dst, 'layers', f'every layer {first.dtype.name}{list(first.shape)}', f'{odd} differ'))
      continue
    fields = layout.linen_fields(linen_param, len(first.shape) + 1)
    shape = _transformed_shape(first.shape, fields, len(sources))
    jobs.append(Job(dst, shape, first.dtype, Transform(tuple(s.path for s in sources), **fields)))
  if problems:
    raise TreeMismatchError('SRC is not in the NNX layout given', problems)
  return jobs + singles


def _check_unique(jobs: Sequence[Job]) -> None:
  seen: dict[str, Job] = {}
  problems = []
  for job in jobs:
    if job.path in seen:
      problems.append(Problem(job.path, 'duplicate', 'one source', f'{seen[job.path].transform.sources} and {job.transform.sources}'))
    seen[job.path] = job
  if problems:
    raise TreeMismatchError('converted tree', problems)


def check_against_config(linen_tree: Mapping[str, Any], model_cfg, train_cfg, what: str) -> None:
  """Raises TreeMismatchError unless the Linen-layout tree is the config's train state (the reference decoder's)."""
  from parity.run.reference import reference_decoder

  reference_decoder().check_against_config(linen_tree, model_cfg, train_cfg, what)


# -------------------------------------------------------------- execution ---


def box_shape(shape: Sequence[int], itemsize: int, budget: int = BOX_BYTES) -> tuple[int, ...]:
  """A box of whole trailing axes, leading ones split to fit `budget` bytes."""
  shape = tuple(shape)
  for k in range(len(shape)):
    inner = math.prod(shape[k + 1:]) * itemsize
    if inner <= budget:
      return (1,) * k + (max(1, min(shape[k], budget // max(inner, 1))),) + shape[k + 1:]
  return shape  # a scalar


def chunking(job: Job, src_arrays: Mapping[str, SourceArray]) -> tuple[tuple[int, ...], int]:
  """(destination chunk shape, bytes of decoded source chunks to keep cached).

  Where a source chunk is small enough, the destination chunk is its image
  (moved axes moved, a taken axis dropped, a stacked axis of 1 inserted):
  every destination chunk is then made from one source chunk, decoded once,
  and nothing needs caching. Otherwise destination chunks are boxes of at
  most BOX_BYTES, and the source's decoded chunks stay cached until its last
  box is written. An unscanned split reads each source chunk once per layer,
  so it caches the source too. Peak memory is about the largest cached
  array plus a few chunks in flight, never the whole state.
  """
  t = job.transform
  src = src_arrays[t.sources[0]]
  image = list(src.chunk)
  if t.perm is not None:
    image = [image[a] for a in t.perm]
  if t.take is not None:
    image.pop(t.take[0])
  if t.stack_axis is not None:
    image.insert(t.stack_axis, 1)
  fits = math.prod(image) * job.dtype.itemsize <= ALIGNED_CHUNK_BYTES
  if fits and t.take is None:
    return tuple(image), 0
  if fits:
    return tuple(image), src.nbytes
  if t.stack_axis is not None:
    inner = list(job.shape)
    inner.pop(t.stack_axis)
    box = list(box_shape(inner, job.dtype.itemsize))
    box.insert(t.stack_axis, 1)  # one source per box
    return tuple(box), src.nbytes
  return box_shape(job.shape, job.dtype.itemsize), src.nbytes


def _boxes(shape: Sequence[int], box: Sequence[int]) -> Iterator[tuple[slice, ...]]:
  ranges = [range(0, n, b) for n, b in zip(shape, box)]
  for starts in itertools.product(*ranges):
    yield tuple(slice(s, min(s + b, n)) for s, b, n in zip(starts, box, shape))


def _zarr3_metadata(shape, dtype: np.dtype, chunk: Sequence[int]) -> dict[str, Any]:
  """As Orbax writes it (orbax tensorstore_utils._build_zarr3_metadata), plus a
  zstd checksum: Orbax's frames have none, so a flipped bit in array data
  goes unnoticed there; here it is caught on read."""
  return {
      'shape': list(shape),
      'data_type': dtype.name,
      'chunk_grid': {'name': 'regular', 'configuration': {'chunk_shape': list(chunk)}},
      'codecs': [{
          'name': 'sharding_indexed',
          'configuration': {
              'chunk_shape': list(chunk),
              'codecs': [
                  {'name': 'bytes', 'configuration': {'endian': 'little'}},
                  {'name': 'zstd', 'configuration': {'level': 3, 'checksum': True}},
              ],
              'index_codecs': [
                  {'name': 'bytes', 'configuration': {'endian': 'little'}},
                  {'name': 'crc32c'},
              ],
              'index_location': 'end',
          },
      }],
  }


def _read_box(job: Job, sources, box: tuple[slice, ...]):
  """A future-like read of the source data for one destination box, and its post-processing."""
  t = job.transform
  if t.stack_axis is not None:
    index = box[t.stack_axis].start
    src_box = box[: t.stack_axis] + box[t.stack_axis + 1:]
    return sources[t.sources[index]][src_box].read(), lambda x: np.expand_dims(x, t.stack_axis)
  src = sources[t.sources[0]]
  if t.take is not None:
    axis, index = t.take
    src_box = box[:axis] + (slice(index, index + 1),) + box[axis:]
    return src[src_box].read(), lambda x: np.squeeze(x, axis)
  if t.perm is not None:
    src_box = [None] * len(box)
    for dst_axis, src_axis in enumerate(t.perm):
      src_box[src_axis] = box[dst_axis]
    return src[tuple(src_box)].read(), lambda x: np.transpose(x, t.perm)
  if t.dtype is not None:
    return src[box].read(), lambda x: _exact_cast(job.path, x, t.dtype)
  return src[box].read(), lambda x: x


def _exact_cast(path: str, x: np.ndarray, dtype: np.dtype) -> np.ndarray:
  info = np.iinfo(dtype)
  if x.size and (x.min() < info.min or x.max() > info.max):
    raise ConvertError(f'{path}: value {x.min()}..{x.max()} does not fit {dtype.name}')
  return x.astype(dtype)


@dataclasses.dataclass
class Progress:
  arrays_total: int
  bytes_total: int
  arrays_done: int = 0
  bytes_done: int = 0


class ItemWriter:
  """Writes arrays box by box into a new Orbax PyTree item directory (OCDBT + zarr3).

  Each `write` gets whole destination chunks, so nothing is read back and
  rewritten; encoding runs in tensorstore's threads, overlapping the
  caller's next read, with at most MAX_WRITES_IN_FLIGHT boxes pending.
  """

  def __init__(self, item_dir: str):
    import tensorstore as ts

    self.item_dir = item_dir
    os.makedirs(item_dir)
    self._context = ts.Context({'cache_pool': {'total_bytes_limit': 0}})
    # One context: the zarr3 stores and this handle share one OCDBT writer.
    self._kv = ts.KvStore.open(_ocdbt_spec(item_dir, write=True), context=self._context).result()
    self._writes: collections.deque = collections.deque()
    self.tree_metadata: dict[str, Any] = {}

  def write(
      self, path: str, shape: Sequence[int], dtype: np.dtype, chunk: Sequence[int],
      boxes: Iterator[tuple[tuple[slice, ...], np.ndarray]],
      value_metadata: Mapping[str, Any] | None = None,
  ) -> None:
    """Writes array `path` from `(box, data)` pairs that cover its chunk grid."""
    import tensorstore as ts

    store = ts.open(
        {
            'driver': 'zarr3',
            'kvstore': {**_ocdbt_spec(self.item_dir, write=True), 'path': path.replace('/', '.') + '/'},
            'metadata': _zarr3_metadata(shape, np.dtype(dtype), chunk),
            # Orbax restores with fill_missing_data_reads off: every chunk must exist.
            'store_data_equal_to_fill_value': True,
        },
        create=True, context=self._context,
    ).result()
    for box, data in boxes:
      self._pending(store[box].write(data))
    self._add_metadata(path, chunk, value_metadata)

  def copy(
      self, path: str, src_kv, src_name: str, chunk: Sequence[int],
      value_metadata: Mapping[str, Any] | None = None,
  ) -> None:
    """Writes array `path` as a byte copy of array `src_name` of the OCDBT `src_kv`."""
    import tensorstore as ts

    prefix = src_name + '/'
    new_prefix = path.replace('/', '.') + '/'
    keys = src_kv.list(ts.KvStore.KeyRange(prefix, prefix[:-1] + '0')).result()
    for key in keys:
      value = src_kv.read(key).result().value
      self._pending(self._kv.write(new_prefix + key.decode()[len(prefix):], value))
    self._add_metadata(path, chunk, value_metadata)

  def _pending(self, future) -> None:
    self._writes.append(future)
    while len(self._writes) > MAX_WRITES_IN_FLIGHT:
      self._writes.popleft().result()

  def _add_metadata(self, path: str, chunk: Sequence[int], value_metadata: Mapping[str, Any] | None) -> None:
    keys = path.split('/')
    value = dict(value_metadata or {'value_type': 'jax.Array', 'skip_deserialize': False})
    value['write_shape'] = list(chunk)
    self.tree_metadata[str(tuple(keys))] = {
        'key_metadata': [{'key': k, 'key_type': 2} for k in keys],
        'value_metadata': value,
    }

  def finish(self, metadata: Mapping[str, Any] | None = None) -> None:
    """Waits for every write, then writes `_METADATA` (`metadata` gives its other fields)."""
    while self._writes:
      self._writes.popleft().result()
    out = {'store_array_data_equal_to_fill_value': True, 'custom_metadata': None, **(metadata or {})}
    out.update(tree_metadata=dict(sorted(self.tree_metadata.items())), use_ocdbt=True, use_zarr3=True)
    _write_json(os.path.join(self.item_dir, METADATA), out)

  def abandon(self) -> None:
    """On an error or a signal: pending writes end before their directory is removed."""
    for future in self._writes:
      try:
        future.result()
      except BaseException:  # already failing; the first error is the one reported
        pass
    self._writes.clear()


def write_step_metadata(step_dir: str, items: Sequence[str], custom: Mapping[str, Any] | None = None,
                        base: Mapping[str, Any] | None = None) -> None:
  """`_CHECKPOINT_METADATA` of a step whose items are all Orbax PyTrees."""
  metadata = dict(base) if isinstance(base, Mapping) else {
      'item_handlers': {name: PYTREE_HANDLER for name in items},
      'metrics': {}, 'performance_metrics': {}, 'init_timestamp_nsecs': time.time_ns(),
  }
  merged = metadata.get('custom_metadata')
  merged = dict(merged) if isinstance(merged, Mapping) else {}
  merged.update(custom or {})
  metadata['custom_metadata'] = merged
  metadata['commit_timestamp_nsecs'] = time.time_ns()
  _write_json(os.path.join(step_dir, CHECKPOINT_METADATA), metadata)


def _convert_item(
    jobs: Sequence[Job], src_arrays: Mapping[str, SourceArray], src_dir: str, writer: ItemWriter,
    progress: Progress, on_progress: Callable[[Progress], None] | None,
) -> None:
  """Every job's array, read from `src_dir` box by box, written by `writer`."""
  import tensorstore as ts

  last_use = {p: i for i, job in enumerate(jobs) for p in job.transform.sources}
  opened: dict[str, Any] = {}

  def boxes(job, chunk):
    sources = {p: opened[p] for p in job.transform.sources}
    for box in _boxes(job.shape, chunk):
      future, post = _read_box(job, sources, box)
      try:
        data = future.result()
      except Exception as e:  # tensorstore raises ValueError and others
        raise ConvertError(_unreadable(job.transform.sources[0], src_dir, e)) from None
      yield box, post(data)
      progress.bytes_done += math.prod(b.stop - b.start for b in box) * job.dtype.itemsize
      if on_progress is not None:
        on_progress(progress)

  src_kv = ts.KvStore.open(_ocdbt_spec(src_dir, write=False), context=ts.Context()).result()
  for i, job in enumerate(jobs):
    t = job.transform
    if t.perm is None and t.take is None and t.stack_axis is None and t.dtype is None:
      # Same bytes: decode once to catch damage, then copy the encoded chunks.
      src = src_arrays[t.sources[0]]
      context = ts.Context({'cache_pool': {'total_bytes_limit': 0}})
      spec = {'driver': 'zarr3', 'kvstore': {**_ocdbt_spec(src_dir, write=False), 'path': src.name + '/'}}
      store = ts.open(spec, read=True, open=True, context=context).result()
      for box in _boxes(src.shape, src.chunk):
        try:
          store[box].read().result()
        except Exception as e:  # tensorstore raises ValueError and others
          raise ConvertError(_unreadable(src.path, src_dir, e)) from None
      del store
      writer.copy(job.path, src_kv, src.name, src.chunk, src.value_metadata)
      progress.arrays_done += 1
      progress.bytes_done += job.nbytes
      if on_progress is not None:
        on_progress(progress)
      continue
    chunk, cache_bytes = chunking(job, src_arrays)
    for p in job.transform.sources:
      if p not in opened:
        # A context per source array: its cache goes when the array does.
        limit = cache_bytes + cache_bytes // 8 if cache_bytes else 0  # room for overhead
        context = ts.Context({'cache_pool': {'total_bytes_limit': limit}})
        spec = {'driver': 'zarr3', 'kvstore': {**_ocdbt_spec(src_dir, write=False), 'path': src_arrays[p].name + '/'}}
        opened[p] = ts.open(spec, read=True, open=True, context=context).result()
    first = src_arrays[job.transform.sources[0]]
    writer.write(job.path, job.shape, job.dtype, chunk, boxes(job, chunk), first.value_metadata)
    for p in job.transform.sources:
      if last_use[p] == i:
        del opened[p]
    progress.arrays_done += 1
    if on_progress is not None:
      on_progress(progress)


def _sharding_entries(jobs: Sequence[Job], src_arrays, src_dir: str) -> dict[str, str] | None:
  """`_sharding` for the converted arrays: each source entry, its partition spec moved with the axes."""
  path = os.path.join(src_dir, '_sharding')
  if not os.path.exists(path):
    return None
  src = _read_json(path, 'Orbax sharding metadata')
  out = {}
  for job in jobs:
    first = src_arrays[job.transform.sources[0]]
    key = base64.urlsafe_b64encode(first.name.encode()).decode()
    if key not in src:
      continue
    entry = json.loads(src[key])
    spec = entry.get('partition_spec')
    if isinstance(spec, list):
      t = job.transform
      spec = spec + [None] * (len(first.shape) - len(spec))
      if t.perm is not None:
        spec = [spec[a] for a in t.perm]
      if t.take is not None:
        spec.pop(t.take[0])
      if t.stack_axis is not None:
        spec.insert(t.stack_axis, None)
      entry['partition_spec'] = spec
    out[base64.urlsafe_b64encode(job.path.replace('/', '.').encode()).decode()] = json.dumps(entry)
  return out


# ------------------------------------------------------------ the command ---


@dataclasses.dataclass
class ConvertResult:
  step: int
  arrays: int
  bytes: int
  seconds: float
  dst: str


def _partial_prefix(dst: str) -> str:
  return os.path.join(os.path.dirname(dst), f'.{os.path.basename(dst)}.partial-')


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


_REPLACED = '-replaced'  # the old DST, renamed aside by the swap of `overwrite`
_REMOVING = '-removing'  # the old DST once the swap is done, being removed (never put back)


def _stale_partials(dst: str) -> list[tuple[str, bool]]:
  """[(path, is an old DST put aside)] left next to `dst` by conversions no longer running."""
  prefix = _partial_prefix(dst)
  parent, base = os.path.split(prefix)
  if not os.path.isdir(parent):
    return []
  out = []
  for name in sorted(os.listdir(parent)):
    if not name.startswith(base):
      continue
    pid = name[len(base):]
    replaced = pid.endswith(_REPLACED)
    pid = pid[: -len(_REPLACED)] if replaced else pid.removesuffix(_REMOVING)
    if not pid.isdigit() or (_pid_alive(int(pid)) and int(pid) != os.getpid()):
      continue  # another conversion's, still running (or not ours to judge)
    out.append((os.path.join(parent, name), replaced))
  return out


def restore_replaced(dst: str) -> str | None:
  """Puts an old DST back that a swap killed between its two renames left aside; returns where it was."""
  if os.path.lexists(dst):
    return None
  aside = [path for path, replaced in _stale_partials(dst) if replaced]
  if not aside:
    return None
  old = max(aside, key=lambda path: os.lstat(path).st_ctime)  # the latest swap's
  try:
    os.rename(old, dst)
  except OSError as e:
    raise ConvertError(
        f'DST {dst} is missing and the old DST, put aside in {old} by a conversion that was killed,'
        f' cannot be moved back: {e.strerror}'
    ) from None
  return old


def remove_stale_partials(dst: str) -> list[str]:
  """Removes temporary directories left by conversions to `dst` that were killed,
  and old DSTs they put aside (once DST exists)."""
  removed = []
  for path, replaced in _stale_partials(dst):
    if replaced and not os.path.lexists(dst):
      continue  # the only copy of DST: restore_replaced puts it back
    shutil.rmtree(path, ignore_errors=True)
    removed.append(path)
  return removed


def _check_dst(src: str, dst: str, overwrite: bool) -> None:
  src_real, dst_real = os.path.realpath(src), os.path.realpath(dst)
  if dst_real == src_real or dst_real.startswith(src_real + os.sep) or src_real.startswith(dst_real + os.sep):
    raise ConvertError(f'DST {dst} and SRC {src} overlap; DST must be outside SRC')
  parent = os.path.dirname(dst_real)
  if not os.path.isdir(parent):
    raise ConvertError(f'DST parent directory {parent} does not exist')
  if os.path.lexists(dst):
    if not os.path.isdir(dst) or os.path.islink(dst):
      raise ConvertError(f'DST {dst} exists and is not a directory')
    if os.listdir(dst) and not overwrite:
      raise ConvertError(f'DST {dst} is not empty; pass --overwrite to replace it')


class _Signals:
  """SIGTERM raises Interrupted in the main thread, so temporary output is removed.

  `moved`: DST holds the conversion now (an Interrupted says so).
  """

  def __init__(self):
    self.moved = False

  def interrupted(self, signum: int) -> Interrupted:
    if self.moved:
      return Interrupted(
          f'interrupted by signal {signum} after the conversion was moved into place; DST holds it, SRC untouched'
      )
    return Interrupted(f'interrupted by signal {signum}; {NOTHING_WRITTEN}')

  def __enter__(self):
    self.previous = None
    if hasattr(signal, 'SIGTERM') and _in_main_thread():
      self.previous = signal.signal(signal.SIGTERM, self._raise)
    return self

  def _raise(self, signum, frame):
    del frame
    raise self.interrupted(signum)

  def __exit__(self, *exc):
    if self.previous is not None:
      signal.signal(signal.SIGTERM, self.previous)
    return False


class _HeldSignals:
  """SIGTERM and SIGINT wait until the block ends (it is never cut in half), then raise Interrupted.

  Not a signal mask: a mask holds a signal back from one thread only, and the
  kernel then hands it to another (tensorstore's); Python runs every handler
  in the main thread anyway, so these handlers just note the signal.
  """

  def __init__(self, signals: _Signals):
    self.signals = signals
    self.caught: list[int] = []
    self.previous: dict[int, Any] = {}

  def __enter__(self):
    if _in_main_thread():
      for sig in (getattr(signal, 'SIGTERM', None), signal.SIGINT):
        if sig is not None and signal.getsignal(sig) not in (signal.SIG_IGN, None):  # not ignored
          self.previous[sig] = signal.signal(sig, lambda signum, frame: self.caught.append(signum))
    return self

  def __exit__(self, exc_type, exc, tb):
    for sig, handler in self.previous.items():
      signal.signal(sig, handler)
    if self.caught and exc_type is None:
      raise self.signals.interrupted(self.caught[0])
    return False


def _in_main_thread() -> bool:
  import threading

  return threading.current_thread() is threading.main_thread()


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    to: str,
    layout: str | Layout = 'same',
    step: int | None = None,
    overwrite: bool = False,
    rename_rules: Sequence[RenameRule] | None = None,
    progress: Callable[[Progress], None] | None = None,
    configs: tuple[Any, Any] | None = None,
) -> ConvertResult:
  """Converts one step of the checkpoint directory `src` into the new checkpoint directory `dst`.

  `to`: 'nnx' reads the Linen layout and writes the NNX one (`layout`,
  `rename_rules`); 'linen' reads that NNX layout and writes the Linen one.
  `configs` = (ModelConfig, TrainConfig): the Linen-side tree must be that
  config's train state (each mismatching path listed), and the Linen scan
  axis is taken from it. Raises ConvertError / TreeMismatchError on bad
  input, and ConvertError when the output cannot be written, with nothing
  written to DST (should the old DST of `overwrite` not go back in place,
  the message says where it is); Interrupted on SIGTERM or Ctrl-C (saying whether DST
  already holds the conversion).
  """
  import tensorstore as ts

  start = time.perf_counter()
  src, dst = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))
  if to not in ('linen', 'nnx'):
    raise ConvertError(f"--to must be 'linen' or 'nnx', got {to!r}")
  if isinstance(layout, str):
    linen_axis = configs[0].param_scan_axis if configs else 1
    layout = parse_layout(layout, linen_axis)
  step, step_dir = find_step(src, step)
  restore_replaced(dst)
  _check_dst(src, dst, overwrite)
  step_metadata = _read_json(os.path.join(step_dir, CHECKPOINT_METADATA), 'Orbax step metadata')
  items = [
      name for name in sorted(os.listdir(step_dir))
      if os.path.isdir(os.path.join(step_dir, name))
  ]
  if ITEMS not in items:
    raise ConvertError(f'SRC step {step} has no {ITEMS!r} item (the train state); items there: {items}')
  item_dir = os.path.join(step_dir, ITEMS)
  src_arrays, src_metadata = read_item(item_dir, ts.Context())

  renamer = _Renamer(rename_rules or (), to)
  jobs = (plan_to_nnx if to == 'nnx' else plan_to_linen)(src_arrays, layout, renamer)
  renamer.check_all_used()
  _check_unique(jobs)
  if configs is not None:
    if to == 'nnx':
      linen_tree = {p: a for p, a in src_arrays.items()}
      what = f'SRC step {step} vs the config'
    else:
      linen_tree = {j.path: j for j in jobs}
      what = f'SRC step {step}, converted to the Linen layout, vs the config'
    check_against_config(linen_tree, *configs, what)

  remove_stale_partials(dst)
  tmp = _partial_prefix(dst) + str(os.getpid())
  state = Progress(len(jobs), sum(j.nbytes for j in jobs))
  signals = _Signals()
  stage, old = 'writing the converted arrays', None
  try:
    with signals:
      step_dir_out = os.path.join(tmp, str(step))
      try:
        writer = ItemWriter(os.path.join(step_dir_out, ITEMS))
      except OSError as e:
        raise ConvertError(f'DST {dst} is not writable: {e.strerror}: {e.filename}') from None
      try:
        _convert_item(jobs, src_arrays, item_dir, writer, state, progress)
        writer.finish({k: v for k, v in src_metadata.items() if k != 'tree_metadata'})
      except BaseException:
        writer.abandon()
        raise
      sharding = _sharding_entries(jobs, src_arrays, item_dir)
      if sharding is not None:
        _write_json(os.path.join(writer.item_dir, '_sharding'), sharding)
      for name in items:
        if name != ITEMS:
          stage = f'copying item {name}'
          shutil.copytree(os.path.join(step_dir, name), os.path.join(step_dir_out, name))
      stage = 'writing the step metadata'
      write_step_metadata(
          step_dir_out, items, {'parity_convert': {'source': src, 'step': step, 'to': to, 'layout': layout.name}},
          base=step_metadata,
      )
      stage = 'syncing the conversion to disk'
      _fsync_tree(tmp)
      stage = 'moving the conversion into DST'
      with _HeldSignals(signals):
        old = _move_into_place(tmp, dst)
        signals.moved = True
      # A signal held back raised above; one from here on finds DST holding the conversion.
      if old is not None:
        shutil.rmtree(old, ignore_errors=True)
  except BaseException as e:
    if signals.moved:
      if old is not None:
        shutil.rmtree(old, ignore_errors=True)
      if isinstance(e, KeyboardInterrupt):
        raise signals.interrupted(signal.SIGINT) from None
      raise
    shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(e, (OSError, ValueError)) and not isinstance(e, (ConvertError, TreeMismatchError)):
      raise ConvertError(f'{stage} failed: {_write_failure(e)}; {NOTHING_WRITTEN}') from None
    raise
  return ConvertResult(step, len(jobs), state.bytes_total, time.perf_counter() - start, dst)


def _write_json(path: str, value: Any) -> None:
  with open(path, 'w') as f:
    json.dump(value, f)


def _fsync_tree(root: str) -> None:
  """Data reaches the disk before the rename makes it visible."""
  for parent, _, files in os.walk(root):
    for name in files:
      fd = os.open(os.path.join(parent, name), os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)


def _move_into_place(tmp: str, dst: str) -> str | None:
  """Renames `tmp` to `dst`; returns where the old DST was put aside, to remove (None if none).

  If the second rename fails, the old DST goes back; if that fails too, a
  ConvertError says where the old DST is (DST is then absent).
  """
  old, emptied = None, False
  if os.path.lexists(dst):
    if os.listdir(dst):
      old = _partial_prefix(dst) + f'{os.getpid()}{_REPLACED}'
      os.rename(dst, old)
    else:
      os.rmdir(dst)
      emptied = True
  try:
    os.rename(tmp, dst)
  except BaseException as e:
    if old is not None:
      try:
        os.rename(old, dst)
      except OSError as back:
        raise ConvertError(
            f'moving the conversion into DST failed: {_write_failure(e)}, and putting the old DST'
            f' back failed: {_write_failure(back)}; the old DST is at {old}: rename it to DST (the'
            ' next conversion to DST does while DST is absent); SRC untouched'
        ) from None
    elif emptied:
      os.mkdir(dst)
    raise
  if old is not None:  # from here on a leftover of it is only removed, never put back
    removing = old[: -len(_REPLACED)] + _REMOVING
    try:
      os.rename(old, removing)
      old = removing
    except OSError:
      pass  # DST holds the conversion; removed below as it is
  return old


# -------------------------------------------------------------------- CLI ---


def _tty_progress(stream) -> Callable[[Progress], None]:
  shown = [0.0]

  def show(p: Progress) -> None:
    now = time.monotonic()
    if now - shown[0] < 0.1 and p.arrays_done < p.arrays_total:
      return
    shown[0] = now
    stream.write(
        f'\r  {p.arrays_done}/{p.arrays_total} arrays,'
        f' {p.bytes_done / 2**30:.2f}/{p.bytes_total / 2**30:.2f} GiB'
    )
    if p.arrays_done == p.arrays_total:
      stream.write('\n')
    stream.flush()

  return show


def add_convert_parser(subparsers) -> argparse.ArgumentParser:
  convert_parser = subparsers.add_parser(
      'convert', help='convert a checkpoint between the Linen and an NNX layout (streaming)',
      description=__doc__.split('\n\n')[0],
  )
  convert_parser.add_argument('src', metavar='SRC', help='Orbax checkpoint directory (holds <step>/)')
  convert_parser.add_argument('dst', metavar='DST', help='new checkpoint directory (must not exist or be empty)')
  convert_parser.add_argument('--to', required=True, choices=('linen', 'nnx'))
  convert_parser.add_argument('--layout', default=None, help=f'{LAYOUT_HELP}; default: from --scenario, else same')
  convert_parser.add_argument('--step', type=int, default=None, help='default: the latest step')
  convert_parser.add_argument('--overwrite', action='store_true', help='replace a non-empty DST')
  convert_parser.add_argument('--rules', default=None, metavar='FILE', help="path rename rules, 'LINEN => NNX' per line")
  convert_parser.add_argument('--preset', default=None,
                              help="check the tree against this preset (with --scenario's, default 01_baseline)")
  convert_parser.add_argument('--scenario', default=None,
                              help='the layout of this scenario; with --preset, the tree checked too')
  convert_parser.set_defaults(func=cmd_convert)
  return convert_parser


def cmd_convert(args) -> int:
  from parity.core.errors import BadInput

  try:
    configs = None  # the model the tree is checked against (--preset only)
    layout_configs = None
    if args.preset is not None or args.scenario is not None:
      from parity.run.reference import reference_decoder

      # A scenario's layout is the same in every preset.
      layout_configs = reference_decoder().configs(args.preset or 'tiny', args.scenario or '01_baseline')
      if args.preset is not None:
        configs = layout_configs
    layout = args.layout or (layout_name_for(layout_configs[0]) if layout_configs else 'same')
    # The Linen scan axis is the scenario's, with or without --preset.
    parsed = parse_layout(layout, layout_configs[0].param_scan_axis) if layout_configs else layout
    rules = read_rename_rules(args.rules) if args.rules else None
    result = convert(
        args.src, args.dst, to=args.to, layout=parsed, step=args.step, overwrite=args.overwrite,
        rename_rules=rules, progress=_tty_progress(sys.stderr) if sys.stderr.isatty() else None,
        configs=configs,
    )
  except (ConvertError, TreeMismatchError) as e:
    raise BadInput(str(e)) from None
  except KeyboardInterrupt:
    raise BadInput('interrupted; nothing written to DST, SRC untouched') from None
  print(
      f'converted step {result.step} to the {args.to} layout ({layout}): {result.arrays} arrays,'
      f' {result.bytes / 2**20:.1f} MiB, {result.seconds:.2f} s -> {result.dst}'
  )
  return 0
