"""How a model switches between train and eval mode, per framework, for the model-level sides.

A mode convention is one of:

* a keyword at the call: `'train'` (`train=True` in train mode, `False` in
  eval), `'deterministic'` (`deterministic=False` / `True`), None (neither);
* `Attribute(name)`: an attribute the model keeps, `name=False` in train
  mode and `True` in eval (`Attribute('train', eval_value=False)` the other
  way round). On the Linen side it is set by `clone`, on the module's own
  field or, where the module has none of that name, on the field of a
  dataclass it keeps (its `config`: `clone(config=replace(config, ...))`).
  On the NNX side by `set_attributes` on every module that has it (flax's
  `nnx.Dropout(deterministic=None)` included);
* `'eval()'`, NNX only: flax NNX's own idiom, `model.train()` /
  `model.eval()` (the `deterministic` and `use_running_average` attributes
  of every module that has them).

`Modes(linen=..., nnx=...)` gives each side its own; one convention alone
applies to both. An NNX model with modules whose `decode` is None (flax's
`nnx.MultiHeadAttention(decode=None)`) trains and evaluates with
`decode=False` set, as flax's own NNX examples set it in every step. An NNX model's attributes are set for the call and put
back after it, so the model a step returns is in the mode it came in (and
its graph, which jit keys its programs by, unchanged).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Mapping

import flax.linen as nn
from flax import nnx

KEYWORDS: dict[str | None, tuple[dict[str, bool], dict[str, bool]]] = {
    'train': ({'train': True}, {'train': False}),
    'deterministic': ({'deterministic': False}, {'deterministic': True}),
    None: ({}, {}),
}
NNX_IDIOM = 'eval()'
_NNX_IDIOM_ATTRIBUTES = ('deterministic', 'use_running_average')  # what model.train() / eval() set


@dataclasses.dataclass(frozen=True)
class Attribute:
  """A mode the model keeps as an attribute: `name` is `eval_value` in eval mode, the other in train."""

  name: str
  eval_value: bool = True

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name.isidentifier():
      raise ValueError(f'Attribute: the name of the attribute the model keeps its mode in, got {self.name!r}')


@dataclasses.dataclass(frozen=True)
class Modes:
  """Each side's mode convention (a keyword name, an `Attribute`, or for NNX `'eval()'`)."""

  linen: Any = 'train'
  nnx: Any = 'train'


@dataclasses.dataclass(frozen=True)
class Mode:
  """One side's mode, resolved: the keywords of each mode's call, and the attributes each sets."""

  train_kwargs: Mapping[str, Any]
  eval_kwargs: Mapping[str, Any]
  train_attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  eval_attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def resolve(mode: Any, side: str, train_kwargs: Mapping[str, Any] | None,
            eval_kwargs: Mapping[str, Any] | None) -> Mode:
  """`side`'s ('linen' or 'nnx') Mode of the convention `mode` (a `Modes` gives each side its own),
  `train_kwargs` and `eval_kwargs` added to (or overriding) each mode's call."""
  own = getattr(mode, side) if isinstance(mode, Modes) else mode
  extra_train, extra_eval = dict(train_kwargs or {}), dict(eval_kwargs or {})
  if isinstance(own, Attribute):
    return Mode(extra_train, extra_eval, {own.name: not own.eval_value}, {own.name: own.eval_value})
  if own == NNX_IDIOM:
    if side != 'nnx':
      raise ValueError(f"mode {NNX_IDIOM!r} is flax NNX's model.train() / model.eval(): give it to the NNX"
                       " side alone, parity.Modes(linen=..., nnx='eval()')")
    return Mode(extra_train, extra_eval, dict.fromkeys(_NNX_IDIOM_ATTRIBUTES, False),
                dict.fromkeys(_NNX_IDIOM_ATTRIBUTES, True))
  if isinstance(own, str) or own is None:
    if own not in KEYWORDS:
      raise ValueError(f"mode: one of {tuple(KEYWORDS)}, parity.Attribute(name), {NNX_IDIOM!r} (NNX), or"
                       f" parity.Modes(linen=..., nnx=...) (and train_kwargs/eval_kwargs), got {own!r}")
    train, evaluate = KEYWORDS[own]
    return Mode({**train, **extra_train}, {**evaluate, **extra_eval})
  raise ValueError(f'mode: a keyword name, parity.Attribute(name), {NNX_IDIOM!r} or parity.Modes(...),'
                   f' got {own!r}')


def linen_with(model: nn.Module, **values: Any) -> nn.Module:
  """`model.clone` with each of `values` set where the module keeps it: on its own field of that
  name, else on the field of a dataclass it keeps that has it (`config.decode`)."""
  if not values:
    return model
  fields = {f.name for f in dataclasses.fields(model)}
  direct = {k: v for k, v in values.items() if k in fields}
  rest = {k: v for k, v in values.items() if k not in fields}
  if rest:
    for name in sorted(fields - {'parent', 'name'}):
      held = getattr(model, name, None)
      if dataclasses.is_dataclass(held) and not isinstance(held, type) and all(
          k in {f.name for f in dataclasses.fields(held)} for k in rest):
        direct[name] = dataclasses.replace(held, **rest)
        break
    else:
      raise TypeError(f'{type(model).__name__} keeps no {", ".join(sorted(rest))}: neither a field of the module'
                      ' nor one of a dataclass field of it (its config); give the mode by keyword'
                      " (mode='train' or 'deterministic') or name the attribute it keeps (parity.Attribute)")
  return model.clone(**direct)


def undecided(model: nnx.Module) -> dict[str, bool]:
  """`{'decode': False}` where a module of `model` keeps `decode` as None (flax's
  `nnx.MultiHeadAttention(decode=None)`, decided at the call or by `set_attributes`), as a train
  or eval step sets it, flax's own NNX examples included; `{}` otherwise."""
  found = any(isinstance(node, nnx.Module) and 'decode' in vars(node) and vars(node)['decode'] is None
              for _, node in nnx.iter_graph(model))
  return {'decode': False} if found else {}


def require(model: nnx.Module, names: Any, side: str = 'nnx_side') -> None:
  """A TypeError where no module of `model` keeps any of the attributes `names` its mode sets."""
  if names and not any(isinstance(node, nnx.Module) and name in vars(node)
                       for _, node in nnx.iter_graph(model) for name in names):
    raise TypeError(f'{side}: no module of {type(model).__name__} keeps {" or ".join(names)}, which its mode'
                    " sets: name the attribute its modules keep (parity.Attribute), or give the mode by"
                    " keyword (mode='train' or 'deterministic')")


@contextlib.contextmanager
def nnx_set(model: nnx.Module, values: Mapping[str, Any]) -> Iterator[nnx.Module]:
  """`model.set_attributes(**values)` on every module that has them, for the block; each put back
  after it, so the model leaves in the mode it came in."""
  if not values:
    yield model
    return
  saved = [(node, name, vars(node)[name]) for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)
           for name in values if name in vars(node)]
  if not saved:
    require(model, list(values), type(model).__name__)
  model.set_attributes(**values, raise_if_not_found=False)
  try:
    yield model
  finally:
    for node, name, value in saved:
      setattr(node, name, value)
