"""Stock flax train states <-> one flat checkpoint layout, with module renames.

For a user's own Linen/NNX pair built from stock pieces: a Linen
`flax.training.train_state.TrainState` (optionally with extra collection
fields such as `batch_stats`) and the NNX state of `(model, nnx.Optimizer)`.
The checkpoint layout is the Linen one, flat: `step`, `params/<path>`,
`<collection>/<path>` for each extra collection, `opt_state/<...>/<path>`
for each optimizer leaf mirroring a parameter, and `<field>/<...>` for
each optimizer attribute declared to hold more (an EMA of the parameters in
`nnx.Optimizer.ema` against a TrainState field `ema_params`, a parameter path
in it renamed; flax's `DynamicScale`; `<field>` alone for one variable). State
of the `nnx_only` types (RNG streams kept in the model) has no place in it.
An NNX variable's collection
is given by its type (`nnx.Param` -> `params`, `nnx.BatchStat` ->
`batch_stats`, ...), and its module path is renamed by `Renames` (Linen's
automatic `Conv_0` against NNX's attribute `conv1`).

Pure and strict like bridge/train_state.py: templates give the target
structure; a missing, extra or mismatched path raises TreeMismatchError.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from flax import nnx

from parity.core import paths
from parity.core.errors import Problem, TreeMismatchError
from parity.core.state import LINEN_STEP_DTYPE, NNX_STEP_DTYPE, convert_step, param_suffix

# NNX variable type -> the Linen collection (TrainState field) it lives in.
DEFAULT_COLLECTIONS: tuple[tuple[type[nnx.Variable], str], ...] = (
    (nnx.Param, 'params'),
    (nnx.BatchStat, 'batch_stats'),
)


@dataclasses.dataclass(frozen=True)
class Renames:
  """Module path renames, `(linen prefix, nnx prefix)`, matched on whole path components.

  The longest matching prefix wins; a path no rule matches keeps its name.
  """

  rules: tuple[tuple[str, str], ...] = ()

  @staticmethod
  def _apply(path: str, pairs) -> str:
    best = None
    for src, dst in pairs:
      if (path == src or path.startswith(src + '/')) and (best is None or len(src) > len(best[0])):
        best = (src, dst)
    return path if best is None else best[1] + path[len(best[0]):]

  def to_linen(self, nnx_path: str) -> str:
    return self._apply(nnx_path, [(n, l) for l, n in self.rules])

  def to_nnx(self, linen_path: str) -> str:
    return self._apply(linen_path, self.rules)


RNG_STATE_HINT = (
    'an RNG stream kept in the model (a layer given `rngs=`, such as nnx.Dropout): a Linen'
    ' TrainState keeps no RNG state. Leave it out of the layout with `nnx_only=(nnx.RngState,)`'
    " (parity.pairs.stock.StockNnx's default), or make the layer without `rngs=` and pass the step's"
    ' key at the call (`nnx.Dropout(rate)(x, rngs=key)`, as models/nnx/classifier.py does)'
)


def _collections_of(types: Mapping[str, type], collections) -> dict[str, str]:
  """The Linen collection of each model variable (`0/...`) of `types`, by its type.

  Raises TreeMismatchError naming every variable whose type no collection takes.
  """
  out, problems, hints = {}, [], {}
  expected = 'one of ' + ', '.join(t.__name__ for t, _ in collections)
  for path, variable_type in types.items():
    if not path.startswith('0/'):
      continue
    name = next((n for t, n in collections if issubclass(variable_type, t)), None)
    if name is None:
      problems.append(Problem(path, 'type', expected, variable_type.__name__))
      rng = issubclass(variable_type, nnx.RngState)
      hints.setdefault(RNG_STATE_HINT if rng else 'pass `collections=` with the Linen collection each'
                       ' is stored in', set()).add(variable_type.__name__)
    out[path] = name
  if problems:
    raise TreeMismatchError('NNX model variables of a type with no Linen collection ('
                            + '; '.join(f'{", ".join(sorted(names))}: {hint}' for hint, names in hints.items())
                            + ')', problems)
  return out


def _variable_types(nnx_template: Any) -> dict[str, type]:
  return {
      p: type(v) for p, v in paths.items(nnx_template, lambda x: isinstance(x, nnx.Variable))
      if isinstance(v, nnx.Variable)
  }


def linen_to_checkpoint(linen_state: Any) -> dict[str, Any]:
  """The checkpoint layout of a Linen TrainState (its own flat form; step as int32)."""
  flat = paths.flatten(linen_state)
  flat['step'] = convert_step(flat['step'], LINEN_STEP_DTYPE)
  return flat


def checkpoint_to_linen(flat: Mapping[str, Any], linen_template: Any) -> Any:
  flat = dict(flat)
  if 'step' in flat:
    flat['step'] = convert_step(flat['step'], LINEN_STEP_DTYPE)
  return paths.fill('checkpoint -> Linen train state', linen_template, flat)


def nnx_to_checkpoint(
    nnx_tree: Any,
    renames: Renames,
    nnx_template: Any | None = None,
    collections=DEFAULT_COLLECTIONS,
    convert=True,
    fields: tuple[tuple[str, str], ...] = (),
    nnx_only: tuple[type, ...] = (),
) -> dict[str, Any]:
  """The checkpoint layout of the NNX state of `(model, optimizer)`.

  `nnx_tree` may hold arrays or any other leaves shaped like the state (for
  example shardings; then pass `convert=False` and the state as `nnx_template`).
  `fields`: `(optimizer attribute, train-state field)` pairs; the leaves at
  `1/<attribute>/...` go to `<field>/...`, a parameter path in them renamed
  (an EMA of the parameters: `1/ema/conv1/kernel` -> `ema_params/Conv_0/kernel`;
  flax's `DynamicScale`: `1/dynamic_scale/scale` -> `dynamic_scale/scale`), and an
  attribute that is one variable goes to the field itself (`1/loss_scale` -> `loss_scale`).
  `nnx_only`: variable types of state the Linen side has no counterpart for
  (RNG streams kept in the model, `nnx.RngState`): left out of the layout.
  """
  types = _variable_types(nnx_tree if nnx_template is None else nnx_template)
  only = _nnx_only_paths(types, nnx_only)
  types = {p: t for p, t in types.items() if p not in only}
  flat = {p: x for p, x in paths.flatten(nnx_tree).items() if p not in only}
  param_paths = {p[2:] for p, t in types.items() if p.startswith('0/') and issubclass(t, nnx.Param)}
  collection = _collections_of(types, collections)
  to_field = dict(fields)

  def mirrored(rest: str) -> str:  # a parameter path at the end of `rest` renamed
    p = rest if rest in param_paths else param_suffix(rest, param_paths)
    return rest if p is None else rest[: len(rest) - len(p)] + renames.to_linen(p)

  out: dict[str, Any] = {}
  extra: dict[str, list[str]] = {}  # leaves of neither the model nor nnx.Optimizer, by attribute
  for path, x in flat.items():
    attribute = path.split('/')[1] if path.startswith('1/') else None
    if path.startswith('0/'):
      p = path[2:]
      out[collection[path] + '/' + renames.to_linen(p)] = x
    elif path == '1/step':
      out['step'] = convert_step(x, LINEN_STEP_DTYPE) if convert else x
    elif path.startswith('1/opt_state/'):
      out[mirrored(path[2:])] = x
    elif attribute in to_field:
      rest = path[len(attribute) + 3:]  # empty for an attribute that is one variable
      out[to_field[attribute] + ('/' + mirrored(rest) if rest else '')] = x
    else:
      extra.setdefault('/'.join(path.split('/')[:2]), []).append(path)
  if extra:
    raise TreeMismatchError('NNX train state', [
        Problem(leaves[0], 'extra',
                "a model leaf (0/...) or nnx.Optimizer's step (1/step) or opt_state (1/opt_state/...)",
                f'{prefix} ({len(leaves)} leaves): the stock NNX side carries those alone; an'
                ' optimizer attribute holding more, such as EMA copies of the parameters or a loss'
                ' scale, is declared with the train-state field it is stored in'
                f" (StockNnx(optimizer_fields=(('{prefix[2:]}', '<the TrainState field>'),))); other"
                ' state needs a side of its own (parity.pairs.adapter.Side)')
        for prefix, leaves in extra.items()
    ])
  return out


def checkpoint_to_nnx(
    flat: Mapping[str, Any], nnx_template: Any, renames: Renames, collections=DEFAULT_COLLECTIONS,
    fields: tuple[tuple[str, str], ...] = (),
    nnx_only: tuple[type, ...] = (),
    nnx_only_state: Any = None,
) -> Any:
  """An NNX `(model, optimizer)` state shaped like `nnx_template`, from the checkpoint layout.

  The state of the `nnx_only` types, which the layout leaves out, is taken
  from `nnx_only_state` (the `(model, optimizer)` state of those types alone).
  """
  wanted = nnx_to_checkpoint(nnx_template, renames, collections=collections, convert=False,
                             fields=fields, nnx_only=nnx_only)
  only = nnx_only_paths(nnx_template, nnx_only)
  # Invert the mapping by the template's own paths: every checkpoint path has one NNX path.
  back = dict(zip(wanted, [p for p in paths.flatten(nnx_template) if p not in only]))
  out = {}
  for path, x in flat.items():
    target = back.get(path, path)  # an unknown path is reported as extra by fill
    out[target] = convert_step(x, NNX_STEP_DTYPE) if target == '1/step' else x
  if only:
    if nnx_only_state is None:
      raise ValueError(f'checkpoint -> NNX train state: {sorted(only)} are not in the checkpoint'
                       ' layout (nnx_only); pass their values as nnx_only_state')
    out.update(paths.flatten(nnx_only_state))
  return paths.fill('checkpoint -> NNX train state', nnx_template, out)


def nnx_only_paths(nnx_template: Any, nnx_only: tuple[type, ...]) -> set[str]:
  """The paths of the template's variables of the `nnx_only` types (in no checkpoint layout)."""
  return _nnx_only_paths(_variable_types(nnx_template), nnx_only)


def _nnx_only_paths(types: Mapping[str, type], nnx_only: tuple[type, ...]) -> set[str]:
  return {p for p, t in types.items() if issubclass(t, tuple(nnx_only))}
