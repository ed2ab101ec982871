"""Model-level pairs: the kit writes both sides' create, train, eval, forward and decode.

Most repositories keep their models apart from their train loop. Given a
Linen module, an NNX module (or its constructor taking `rngs`), how a batch
becomes the model's inputs, a loss on (outputs, batch) and an optax
optimizer, `linen_side` and `nnx_side` write what a user would write for
each framework, and return the stock sides (parity/pairs/stock/) over it;
`model_pair` returns the `Pair`:

* create: Linen `model.init` (eval mode, PRNGKey(seed) for 'params', its fold-in for 'dropout') into a flax
  `TrainState` whose extra fields are the collections `init` makes beside
  `params` (`batch_stats`, ...), parameters as `init` gives them (boxed where
  the model annotates them); NNX `model = make(rngs=nnx.Rngs(seed))` and
  `nnx.Optimizer(model, tx, wrt=nnx.Param)`.
* train: `jax.jit` / `nnx.jit` steps. The dropout key is
  `parity.step_key(dropout_base, step, 0)`; Linen applies with
  `rngs={'dropout': key}` and its extra collections mutable, NNX calls with
  `rngs=nnx.Rngs(dropout=key)` (its batch statistics update in place), and
  its side draws Linen's keys (`StockNnx(dropout_keys='linen')`).
* eval and forward: the model in eval mode, the loss (and its metrics) on
  its outputs; forward returns the outputs, which the eval part compares.
* decode: flax's `decode=True` cache convention, or a call of your own per
  side (parity/pairs/decoding.py).

Train and eval mode: `mode='train'` passes `train=True` / `train=False`,
`mode='deterministic'` passes `deterministic=False` / `deterministic=True`,
`mode=None` neither; `parity.Attribute(name)` sets an attribute the model
keeps (a Linen field or config field, NNX modules' attributes), `'eval()'`
NNX's `model.train()` / `model.eval()`, `parity.Modes(linen=, nnx=)` each
side its own (parity/pairs/modes.py); `train_kwargs` and `eval_kwargs` add
(or override) keywords of each mode's call. NNX dropouts that keep their
streams need no `rngs` at the call: with `dropout='rngs'` and a `__call__`
taking none, the kit seeds the streams they keep. A team's own train steps remain a StockLinen
or StockNnx of their own.

The arguments, the same on both sides: `inputs(batch)` gives the model's
positional arguments (a tuple for several, any other value for one);
`loss(outputs, batch)` the loss, or `(loss, {name: metric})`; `batch(step,
split)` the pair's batches (Linen's `init` runs on `batch(0, 'train')`);
`dropout` how the step's key reaches the model (`'rngs'`; a keyword name,
the key itself passed as that keyword on both sides; None, not at all);
`decode_inputs(tokens)` the model's arguments when decoding (default: the
tokens); `cache_call` (`cache_calls` of the pair: Linen's, NNX's) a cache
other than flax's (parity/pairs/decoding.py). The NNX `model` is a
constructor, called as `model(rngs=nnx.Rngs(seed))`, or a module, which
every `create` copies. `options` go to StockLinen / StockNnx (`rules`,
`renames`, `collections`, ...), `model_pair`'s other keywords to `Pair`.
`linen_side` and `nnx_side` write the code at each call (a `make_sides(mesh)`
calling them compiles its steps once per call); `model_pair` writes it once.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, ClassVar, Mapping, Sequence

import flax.linen as nn
import jax
import optax
from flax import nnx
from flax.training import train_state

from parity.core import rng
from parity.pairs import adapter
from parity.pairs import decoding
from parity.pairs import dropout as pair_dropout
from parity.pairs import modes
from parity.pairs import stock

# Collections `init` makes that are not state: sown intermediates, and a decoding cache.
NOT_STATE = ('params', 'intermediates', 'cache')


class TrainState(train_state.TrainState):
  """flax's `TrainState`; a subclass made per set of extra collections adds them as fields."""

  collections: ClassVar[tuple[str, ...]] = ()


@functools.cache
def train_state_class(collections: tuple[str, ...]) -> type[TrainState]:
  """The `TrainState` with a field per extra collection (`batch_stats`), as flax's docs subclass it."""
  if not collections:
    return TrainState
  fields = {'__annotations__': dict.fromkeys(collections, Any), **dict.fromkeys(collections, None),
            'collections': collections, '__module__': __name__, '__qualname__': 'TrainState'}
  return type('TrainState', (TrainState,), fields)


def _split_loss(value: Any) -> tuple[Any, dict[str, Any]]:
  """(loss, metrics) of what the user's loss returns: a loss, or (loss, {name: metric})."""
  if isinstance(value, tuple):
    if len(value) != 2 or not isinstance(value[1], Mapping):
      raise TypeError(f'loss(outputs, batch) returns a loss or (loss, {{name: metric}}), got a tuple of'
                      f' {len(value)}: {value!r}')
    return value[0], dict(value[1])
  return value, {}


def _args(inputs: Callable[[Any], Any], batch: Any) -> tuple:
  return decoding.as_args(inputs(batch))


def _check_dropout(dropout: str | None) -> None:
  if dropout is not None and (not isinstance(dropout, str) or not dropout.isidentifier()):
    raise ValueError(f"dropout: 'rngs', the keyword your models take the step's key by, or None; got {dropout!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class LinenModel:
  """The Linen side's code, written once (each mesh's side shares its compiled steps)."""

  model: nn.Module
  inputs: Callable[[Any], Any]
  loss_of: Callable[[Any, Any], Any]
  optimizer: optax.GradientTransformation
  batch: Callable[[int, str], Any]
  train_kwargs: Mapping[str, Any]
  eval_kwargs: Mapping[str, Any]
  dropout: str | None = 'rngs'
  decode_fn: Callable[..., Any] | None = None
  train_attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  eval_attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @functools.cached_property
  def train_model(self) -> nn.Module:
    """The model in train mode (`model` itself where the mode is a keyword at the call)."""
    return modes.linen_with(self.model, **self.train_attributes)

  @functools.cached_property
  def eval_model(self) -> nn.Module:
    """The model in eval mode (`model` itself where the mode is a keyword at the call)."""
    return modes.linen_with(self.model, **self.eval_attributes)

  def create(self, seed: int) -> TrainState:
    """`model.init` in eval mode on the pair's first train batch, into a flax TrainState."""
    _check_call('linen_side', self.model, self.train_kwargs, self.eval_kwargs,
                None if self.dropout == 'rngs' else self.dropout)  # rngs: apply's own keyword
    key = jax.random.PRNGKey(seed)
    # A 'dropout' key too, which init never draws from in eval mode, but which an NNX layer behind
    # flax's ToLinen needs to be built at init (its nnx.Dropout keeps a stream of it); the parameters
    # are drawn from the 'params' key alone, whatever other keys init gets.
    keys = {'params': key, 'dropout': jax.random.fold_in(key, 1)} if self.dropout is not None else key
    variables = dict(self.eval_model.init(keys, *_args(self.inputs, self.batch(0, 'train')),
                                          **self.eval_kwargs))
    state_class = train_state_class(tuple(sorted(c for c in variables if c not in NOT_STATE)))
    extra = {c: variables[c] for c in state_class.collections}
    return state_class.create(apply_fn=self.model.apply, params=variables['params'], tx=self.optimizer, **extra)

  def _train_call(self, dropout_key) -> dict[str, Any]:
    if self.dropout is None:
      return dict(self.train_kwargs)
    if self.dropout == 'rngs':
      return {**self.train_kwargs, 'rngs': {'dropout': dropout_key}}
    return {**self.train_kwargs, self.dropout: dropout_key}

  def loss(self, params, state: TrainState, batch, dropout_key):
    """(loss, (updated collections, metrics)) in train mode: StockLinen's `loss`, has_aux."""
    variables = {'params': params, **{c: getattr(state, c) for c in state.collections}}
    kwargs = self._train_call(dropout_key)
    apply = self.train_model.apply if self.train_attributes else state.apply_fn
    if state.collections:
      outputs, updates = apply(variables, *_args(self.inputs, batch), **kwargs, mutable=list(state.collections))
    else:
      outputs, updates = apply(variables, *_args(self.inputs, batch), **kwargs), {}
    value, metrics = _split_loss(self.loss_of(outputs, batch))
    return value, (dict(updates), metrics)

  @functools.cached_property
  def train_step(self):
    @jax.jit
    def train_step(state: TrainState, batch, dropout_base):
      key = rng.step_key(dropout_base, state.step, 0)
      (value, (updates, metrics)), grads = jax.value_and_grad(self.loss, has_aux=True)(
          state.params, state, batch, key)
      return state.apply_gradients(grads=grads).replace(**updates), {'loss': value, **metrics}

    return train_step

  def forward(self, state: TrainState, batch):
    """The model's eval-mode outputs."""
    variables = {'params': state.params, **{c: getattr(state, c) for c in state.collections}}
    apply = self.eval_model.apply if self.eval_attributes else state.apply_fn
    return apply(variables, *_args(self.inputs, batch), **self.eval_kwargs)

  @functools.cached_property
  def eval_step(self):
    @jax.jit
    def eval_step(state: TrainState, batch):
      value, metrics = _split_loss(self.loss_of(self.forward(state, batch), batch))
      return {'loss': value, **metrics}

    return eval_step

  def side(self, mesh: jax.sharding.Mesh | None = None, **options) -> stock.StockLinen:
    """A StockLinen over this code (`options`: StockLinen's, such as `rules`)."""
    return stock.StockLinen(self.create, self.train_step, self.eval_step, self.loss, has_aux=True, mesh=mesh,
                            forward=self.forward, decode_fn=self.decode_fn, **options)


@dataclasses.dataclass(frozen=True, eq=False)
class NnxModel:
  """The NNX side's code, written once (each mesh's side shares its compiled steps)."""

  make: Callable[..., nnx.Module] | nnx.Module
  inputs: Callable[[Any], Any]
  loss_of: Callable[[Any, Any], Any]
  optimizer: optax.GradientTransformation
  train_kwargs: Mapping[str, Any]
  eval_kwargs: Mapping[str, Any]
  dropout: str | None = 'rngs'
  decode_fn: Callable[..., Any] | None = None
  train_attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  eval_attributes: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  # Whether the model's own __call__ takes `rngs`, by model class: read at `create`, before the kit
  # wraps the class's call in its traces (a wrapper takes any keyword).
  takes_rngs: dict = dataclasses.field(default_factory=dict, repr=False)

  def create(self, seed: int) -> tuple[nnx.Module, nnx.Optimizer]:
    """The model (constructed with `rngs=nnx.Rngs(seed)`, or a copy of the one given) and its optimizer."""
    if isinstance(self.make, nnx.Module):
      model = nnx.clone(self.make)
    else:
      model = self.make(rngs=nnx.Rngs(seed))
    # dropout='rngs' and no `rngs` at the call: the model's dropouts draw from the streams they keep
    takes = self.takes_rngs.setdefault(type(model), _takes(model, 'rngs'))
    keeps = self.dropout == 'rngs' and not takes and bool(pair_dropout.held_streams(model))
    _check_call('nnx_side', model, self.train_kwargs, self.eval_kwargs, None if keeps else self.dropout)
    modes.require(model, list(self.train_attributes))
    return model, nnx.Optimizer(model, self.optimizer, wrt=nnx.Param)

  def _train_call(self, model: nnx.Module, dropout_key) -> dict[str, Any]:
    if self.dropout is None:
      return dict(self.train_kwargs)
    if self.dropout == 'rngs':
      if not self.takes_rngs.get(type(model), True):  # its dropouts keep their streams: the kit seeds them
        return dict(self.train_kwargs)
      return {**self.train_kwargs, 'rngs': nnx.Rngs(dropout=dropout_key)}
    return {**self.train_kwargs, self.dropout: dropout_key}

  def loss(self, model: nnx.Module, batch, dropout_key):
    """(loss, metrics) in train mode: StockNnx's `loss`, has_aux."""
    with modes.nnx_set(model, {**modes.undecided(model), **self.train_attributes}):
      outputs = model(*_args(self.inputs, batch), **self._train_call(model, dropout_key))
    return _split_loss(self.loss_of(outputs, batch))

  @functools.cached_property
  def train_step(self):
    @nnx.jit
    def train_step(model: nnx.Module, optimizer: nnx.Optimizer, batch, dropout_base):
      key = rng.step_key(dropout_base, optimizer.step[...], 0)
      (value, metrics), grads = nnx.value_and_grad(self.loss, has_aux=True)(model, batch, key)
      optimizer.update(model, grads)
      return {'loss': value, **metrics}

    return train_step

  def forward(self, model: nnx.Module, batch):
    """The model's eval-mode outputs."""
    with modes.nnx_set(model, {**modes.undecided(model), **self.eval_attributes}):
      return model(*_args(self.inputs, batch), **self.eval_kwargs)

  @functools.cached_property
  def eval_step(self):
    @nnx.jit
    def eval_step(model: nnx.Module, batch):
      value, metrics = _split_loss(self.loss_of(self.forward(model, batch), batch))
      return {'loss': value, **metrics}

    return eval_step

  def side(self, mesh: jax.sharding.Mesh | None = None, **options) -> stock.StockNnx:
    """A StockNnx over this code (`options`: StockNnx's, such as `rules`, `collections`, `renames`)."""
    if self.dropout == 'rngs':
      options = {'dropout_keys': 'linen', **options}
    return stock.StockNnx(self.create, self.train_step, self.eval_step, self.loss, has_aux=True, mesh=mesh,
                          forward=self.forward, decode_fn=self.decode_fn, **options)


def _takes(model: Any, keyword: str) -> bool:
  """Whether the model's `__call__` takes `keyword` (by name, or any keyword)."""
  try:
    parameters = inspect.signature(type(model).__call__).parameters.values()
  except (TypeError, ValueError):
    return True
  return any(p.name == keyword or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _check_call(side: str, model: Any, train_kwargs: Mapping[str, Any], eval_kwargs: Mapping[str, Any],
                dropout: str | None) -> None:
  """A TypeError naming each keyword the kit would pass that the model's `__call__` does not take."""
  name = f'{type(model).__name__}.__call__'
  for keyword in dict.fromkeys([*train_kwargs, *eval_kwargs]):
    if not _takes(model, keyword):
      raise TypeError(f'{side}: {name} takes no `{keyword}`, which the train or eval mode passes: give the'
                      " model's own (mode='train': train=, mode='deterministic': deterministic=, mode=None:"
                      ' neither; train_kwargs= and eval_kwargs= for any other; a side that switches by'
                      " model.train()/model.eval(), as NNX ports do: mode=parity.Modes(linen='train',"
                      " nnx='eval()'), docs/howto-modes.md)")
  if dropout is not None and not _takes(model, dropout):
    raise TypeError(f"{side}: {name} takes no `{dropout}`, which dropout={dropout!r} passes the step's dropout"
                    " key by: give dropout=None (no dropout), 'rngs' (Linen's rngs={'dropout': key}, NNX's"
                    " rngs=nnx.Rngs(dropout=key), or on the NNX side no key at all where its dropouts keep"
                    " their own streams, nnx.Dropout(rate, rngs=rngs), which the kit seeds with Linen's"
                    " keys) or the keyword your models take the key by")


def linen_model(model: nn.Module, *, inputs: Callable[[Any], Any], loss: Callable[[Any, Any], Any],
                optimizer: optax.GradientTransformation, batch: Callable[[int, str], Any],
                mode: Any = 'train', train_kwargs: Mapping[str, Any] | None = None,
                eval_kwargs: Mapping[str, Any] | None = None, dropout: str | None = 'rngs',
                decode_inputs: Callable[[Any], Any] | None = None,
                cache_call: Callable[..., Any] | None = None) -> LinenModel:
  """The Linen side's code (`linen_side` without the side): its `.side(mesh, **options)` makes one."""
  _check_dropout(dropout)
  own = modes.resolve(mode, 'linen', train_kwargs, eval_kwargs)
  code = LinenModel(model, inputs, loss, optimizer, batch, own.train_kwargs, own.eval_kwargs, dropout,
                    train_attributes=own.train_attributes, eval_attributes=own.eval_attributes)
  # The decoder reads the state's extra collections: the TrainState subclass names them.
  decoder = _LinenStateDecoder(decoding.linen_decoder(code.eval_model, inputs=decode_inputs,
                                                      kwargs=own.eval_kwargs, call=cache_call))
  return dataclasses.replace(code, decode_fn=decoder)


@dataclasses.dataclass(frozen=True, eq=False)
class _LinenStateDecoder:
  """A LinenDecoder given the state's extra collections (its TrainState's `collections`)."""

  decoder: decoding.LinenDecoder

  @functools.cached_property
  def _by_collections(self) -> dict[tuple[str, ...], decoding.LinenDecoder]:
    return {}

  def _for(self, state) -> decoding.LinenDecoder:
    names = tuple(getattr(state, 'collections', ()))
    return self._by_collections.setdefault(names, dataclasses.replace(self.decoder, collections=names))

  def lower_step(self, state, batch: int, max_len: int) -> jax.stages.Lowered:
    return self._for(state).lower_step(state, batch, max_len)

  def __call__(self, state, prompt, steps: int, key, temperature: float):
    return self._for(state)(state, prompt, steps, key, temperature)


def nnx_model(model: Callable[..., nnx.Module] | nnx.Module, *, inputs: Callable[[Any], Any],
              loss: Callable[[Any, Any], Any], optimizer: optax.GradientTransformation,
              mode: Any = 'train', train_kwargs: Mapping[str, Any] | None = None,
              eval_kwargs: Mapping[str, Any] | None = None, dropout: str | None = 'rngs',
              decode_inputs: Callable[[Any], Any] | None = None,
              cache_call: Callable[..., Any] | None = None) -> NnxModel:
  """The NNX side's code (`nnx_side` without the side): its `.side(mesh, **options)` makes one."""
  _check_dropout(dropout)
  own = modes.resolve(mode, 'nnx', train_kwargs, eval_kwargs)
  return NnxModel(model, inputs, loss, optimizer, own.train_kwargs, own.eval_kwargs, dropout,
                  decoding.nnx_decoder(inputs=decode_inputs, kwargs=own.eval_kwargs, call=cache_call,
                                       attributes=own.eval_attributes),
                  train_attributes=own.train_attributes, eval_attributes=own.eval_attributes)


def linen_side(model: nn.Module, *, inputs: Callable[[Any], Any], loss: Callable[[Any, Any], Any],
               optimizer: optax.GradientTransformation, batch: Callable[[int, str], Any],
               mesh: jax.sharding.Mesh | None = None, mode: Any = 'train',
               train_kwargs: Mapping[str, Any] | None = None, eval_kwargs: Mapping[str, Any] | None = None,
               dropout: str | None = 'rngs', decode_inputs: Callable[[Any], Any] | None = None,
               cache_call: Callable[..., Any] | None = None, **options) -> stock.StockLinen:
  """A StockLinen whose create, train, eval, forward and decode the kit writes for the Linen `model`."""
  code = linen_model(model, inputs=inputs, loss=loss, optimizer=optimizer, batch=batch, mode=mode,
                     train_kwargs=train_kwargs, eval_kwargs=eval_kwargs, dropout=dropout,
                     decode_inputs=decode_inputs, cache_call=cache_call)
  return code.side(mesh, **options)


def nnx_side(model: Callable[..., nnx.Module] | nnx.Module, *, inputs: Callable[[Any], Any],
             loss: Callable[[Any, Any], Any], optimizer: optax.GradientTransformation,
             mesh: jax.sharding.Mesh | None = None, mode: Any = 'train',
             train_kwargs: Mapping[str, Any] | None = None, eval_kwargs: Mapping[str, Any] | None = None,
             dropout: str | None = 'rngs', decode_inputs: Callable[[Any], Any] | None = None,
             cache_call: Callable[..., Any] | None = None, **options) -> stock.StockNnx:
  """A StockNnx whose create, train, eval, forward and decode the kit writes for the NNX `model`."""
  code = nnx_model(model, inputs=inputs, loss=loss, optimizer=optimizer, mode=mode,
                   train_kwargs=train_kwargs, eval_kwargs=eval_kwargs, dropout=dropout,
                   decode_inputs=decode_inputs, cache_call=cache_call)
  return code.side(mesh, **options)


@dataclasses.dataclass(frozen=True)
class PerMesh:
  """A model built for each mesh (`parity.per_mesh`): `make(mesh)` gives what `model_pair` takes as
  `linen=` or `nnx=` for that mesh (None: one device)."""

  make: Callable[[jax.sharding.Mesh | None], Any]

  def __post_init__(self):
    # A module is callable too, but is the model itself, not what builds it.
    if not callable(self.make) or isinstance(self.make, (nn.Module, nnx.Module)):
      raise TypeError(f'parity.per_mesh takes a function of the mesh that builds the model, got'
                      f' {type(self.make).__name__} {self.make!r}')


def per_mesh(make: Callable[[jax.sharding.Mesh | None], Any]) -> PerMesh:
  """A model whose constructor needs the mesh (`Transformer(config, mesh)`): `model_pair(linen=
  parity.per_mesh(lambda mesh: Transformer(config, mesh)), ...)`; each mesh's sides get the model
  made for it, and one device gets `make(None)`."""
  return PerMesh(make)


def model_pair(name: str, *, linen: nn.Module, nnx: Callable[..., nnx.Module] | nnx.Module,
               inputs: Callable[[Any], Any], loss: Callable[[Any, Any], Any],
               optimizer: optax.GradientTransformation, batch: Callable[[int, str], Any],
               mode: Any = 'train', train_kwargs: Mapping[str, Any] | None = None,
               eval_kwargs: Mapping[str, Any] | None = None, dropout: str | None = 'rngs',
               decode: adapter.Decode | None = None, decode_inputs: Callable[[Any], Any] | None = None,
               cache_calls: tuple[Callable[..., Any], Callable[..., Any]] | None = None,
               rules: Sequence[tuple[str, Any]] | None = None, linen_options: Mapping[str, Any] | None = None,
               nnx_options: Mapping[str, Any] | None = None, **pair_options) -> adapter.Pair:
  """A `Pair` of a Linen and an NNX model, both sides' code written by the kit (docs/first-pair.md).

  `linen=`/`nnx=` may be `parity.per_mesh(make)` for a model built with the mesh; `linen=` may be
  `parity.recorded(DIR)`, the record standing for a deleted Linen side (docs/after-linen.md). Every other
  keyword goes to `parity.Pair` (`steps`, `meshes`, `known_differences`, `saves` for a side whose
  own save code writes a tree of its own: docs/checkpoints.md)."""
  linen_call, nnx_call = cache_calls if cache_calls is not None else (None, None)
  common = dict(inputs=inputs, loss=loss, optimizer=optimizer, mode=mode, train_kwargs=train_kwargs,
                eval_kwargs=eval_kwargs, dropout=dropout, decode_inputs=decode_inputs)
  side_rules = {} if rules is None else {'rules': tuple(tuple(r) for r in rules)}
  # One side's code for every mesh, or, for a model made per mesh, one per mesh (each made once).
  codes: dict[tuple[str, Any], Any] = {}

  def code(role, model, build, mesh):
    key = (role, mesh if isinstance(model, PerMesh) else None)
    if key not in codes:
      codes[key] = build(model.make(mesh) if isinstance(model, PerMesh) else model)
    return codes[key]

  def make_sides(mesh):
    if hasattr(linen, 'side') and not isinstance(linen, (nn.Module, PerMesh)):  # parity.recorded(DIR)
      nnx_code = code('nnx', nnx, lambda m: nnx_model(m, cache_call=nnx_call, **common), mesh)
      return linen.side(mesh), nnx_code.side(mesh, **side_rules, **(nnx_options or {}))
    linen_code = code('linen', linen, lambda m: linen_model(m, batch=batch, cache_call=linen_call, **common), mesh)
    nnx_code = code('nnx', nnx, lambda m: nnx_model(m, cache_call=nnx_call, **common), mesh)
    return (linen_code.side(mesh, **side_rules, **(linen_options or {})),
            nnx_code.side(mesh, **side_rules, **(nnx_options or {})))

  return adapter.Pair(name, make_sides, batch, decode=decode, rules=rules, **pair_options)
