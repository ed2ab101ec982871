"""The stock NNX side: `(model, nnx.Optimizer)` and the user's own steps that update them (`StockNnx`)."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, ClassVar, Mapping

import jax
import numpy as np
from flax import nnx

from parity.compare import localize
from parity.compare import model_calls
from parity.compare import scopes
from parity.core import compat
from parity.core import paths
from parity.pairs import adapter
from parity.pairs import dropout
from parity.pairs import stock_layout as bridge_stock
from parity.pairs import substitutes as substitutes_lib
from parity.pairs.stock.common import _Stock, _decoded, _one_program, named
from parity.pairs.stock.linen_side import StockLinen


@dataclasses.dataclass(frozen=True, eq=False)
class StockNnx(_Stock):
  """An NNX side over `(model, nnx.Optimizer)` and stateful steps.

  create(seed) -> (model, optimizer); train_step(model, optimizer, batch,
  dropout_base) -> metrics (updating both in place); eval_step(model,
  batch) -> metrics (`eval_step(model, optimizer, batch)` with
  `eval_sees_optimizer`); loss(model, batch, dropout_key) -> loss. `renames`
  maps NNX module paths to Linen's in the checkpoint layout; `collections`
  maps each NNX variable type of the model to the Linen collection (train
  state field) it is stored in (default: `nnx.Param` -> params,
  `nnx.BatchStat` -> batch_stats).

  `nnx_only`: variable types of state only the NNX side has (default: the
  RNG streams a layer given `rngs=` keeps, `nnx.RngState`; a Linen
  TrainState keeps none). They stay in the side's state and its programs,
  out of the checkpoint layout and so out of every comparison of numbers; a
  state made from a checkpoint takes them as `create(0)` makes them. They
  are declared and accounted: the memory part takes exactly their bytes off
  NNX's arguments and outputs, the program (and the mesh part's annotations)
  is compared without them (`comparison_state`, `lower_for_comparison`),
  and their placement is checked apart (`nnx_only_placement`).
  """

  create: Callable[[int], Any]
  train_step_fn: Callable[..., Any]
  eval_step_fn: Callable[..., Any]
  loss: Callable[..., Any]
  renames: bridge_stock.Renames = bridge_stock.Renames()
  mesh: jax.sharding.Mesh | None = None
  # `loss` returns (loss, aux), as StockLinen's `has_aux`: the kit differentiates the loss alone.
  has_aux: bool = False
  batch_axis: str = 'data'
  rules: tuple[tuple[str, Any], ...] | None = None  # logical axis rules (None: replicate the state)
  name: str = 'nnx'
  # forward(model, batch) -> the model's eval-mode outputs (its logits), as StockLinen's `forward`.
  forward: Callable[..., Any] | None = None
  # decode_fn(model, prompt, steps, key, temperature) -> (tokens, logits, {NNX cache path: array}),
  # as StockLinen's; cache paths are renamed to Linen's like the parameters.
  decode_fn: Callable[..., Any] | None = None
  collections: tuple[tuple[type, str], ...] = bridge_stock.DEFAULT_COLLECTIONS
  # (optimizer attribute, Linen train-state field): what the optimizer holds besides
  # step and opt_state, e.g. (('ema', 'ema_params'),) (parity.pairs.stock_layout.nnx_to_checkpoint).
  optimizer_fields: tuple[tuple[str, str], ...] = ()
  # eval_step(model, optimizer, batch) instead of eval_step(model, batch): an eval of
  # what the optimizer holds (an EMA), as a Linen eval_step sees the whole TrainState.
  eval_sees_optimizer: bool = False
  nnx_only: tuple[type, ...] = (nnx.RngState,)
  # Module correspondences inferred from both sides' traced calls (parity/pairs/correspond.py),
  # `renames` winning where it speaks; False: `renames` alone.
  infer_renames: bool = True
  # (NNX call by its Linen path, Linen call) where calls do not pair one to one: set by inference.
  call_keys: tuple[tuple[str, str], ...] = ()
  # 'linen': each nnx.Dropout call given an nnx.Rngs (or stream) at the call draws the key Linen's
  # make_rng('dropout') gives its Linen counterpart (parity/pairs/dropout.py); 'nnx': as drawn.
  dropout_keys: str = 'nnx'
  # (Linen scope path, the counts its make_rng('dropout') draws with): set from the Linen side
  # with dropout_keys='linen' (parity/pairs/dropout.py, `linen_draws`).
  linen_draws: tuple[tuple[str, tuple[int, ...]], ...] = ()
  # (Linen wrapper scope path, each NNX dropout behind it: (make_rng count, folds)), the same way.
  linen_wrapped: tuple[tuple[str, tuple[tuple[int, tuple[int, ...]], ...]], ...] = ()
  # (Linen dropout path, or a wrapper's path + '/*', its rate): what a failure compares NNX's rates with.
  linen_rates: tuple[tuple[str, float], ...] = ()
  # Stand-ins the kit applies in place to every model `create` makes (parity/pairs/substitutes.py
  # IN_PLACE: parity.linen_attention on each stock nnx.MultiHeadAttention): set from the pair's
  # declared differences that name one as their `substitute=` (`adopt_substitutes`).
  substitutes: tuple[Callable[..., Any], ...] = ()

  def __post_init__(self):
    if self.dropout_keys not in dropout.SCHEMES:
      raise ValueError(f"StockNnx dropout_keys: one of {dropout.SCHEMES}, got {self.dropout_keys!r}")

  @contextlib.contextmanager
  def _dropout_context(self, model=None):
    """Linen's dropout keys while tracing (`dropout_keys='linen'`), `model` tagged with its Linen paths."""
    if self.dropout_keys != 'linen':
      yield
      return
    if model is not None:
      scopes.tag_paths(model, self.renames.to_linen)
    with dropout.linen_dropout_keys(dict(self.call_keys), dict(self.linen_draws), dict(self.linen_wrapped)):
      yield

  def adopt_correspondence(self, found: Any) -> None:
    """Takes an inferred correspondence (renames, call keys) in place, before first use.

    In place so that a wrapper delegating to this side keeps wrapping it;
    `make_sides` builds new sides for every mesh, so nothing else sees the change.
    """
    object.__setattr__(self, 'renames', found.renames)
    object.__setattr__(self, 'call_keys', found.call_keys)
    object.__setattr__(self, 'infer_renames', False)

  def adopt_linen_draws(self, linen_side: Any, batch: Any, key: Any) -> None:
    """With Linen's dropout keys, takes in place the counts the Linen side's dropouts draw with
    (what a lifted transform such as `nn.scan` makes of them), before first use."""
    linen_side = getattr(linen_side, 'stock_linen', None)
    if self.dropout_keys != 'linen' or not isinstance(linen_side, StockLinen):
      return
    state = linen_side.template
    wrapped, rates = {}, {}
    draws = dropout.linen_draws(lambda state: linen_side.loss(state.params, state, batch, key), state,
                                wrapped=wrapped, rates=rates)
    object.__setattr__(self, 'linen_rates', tuple(sorted(rates.items())))
    object.__setattr__(self, 'linen_draws', tuple(sorted(draws.items())))
    object.__setattr__(self, 'linen_wrapped', tuple(sorted((p, tuple(d)) for p, d in wrapped.items())))

  # What the side took from the Linen side (`adopt_correspondence`, `adopt_linen_draws`), by name:
  # what a record of the Linen side keeps for this side once that side is gone (parity/records/).
  ADOPTED = ('renames', 'call_keys', 'linen_draws', 'linen_wrapped', 'linen_rates')

  def adopted(self) -> dict[str, Any]:
    """What this side took from the Linen side, as plain data (`ADOPTED`; renames as their rules)."""
    out = {name: getattr(self, name) for name in self.ADOPTED}
    out['renames'] = tuple(self.renames.rules)
    return out

  def adopt_recorded(self, adopted: Mapping[str, Any]) -> None:
    """Takes in place what `adopted()` gave (as tuples), read back from a record, before first use:
    the Linen side's correspondence and dropout draws without the Linen side."""
    for name in self.ADOPTED:
      value = adopted[name]
      object.__setattr__(self, name, bridge_stock.Renames(value) if name == 'renames' else value)
    object.__setattr__(self, 'infer_renames', False)

  def adopt_substitutes(self, stand_ins: tuple[Callable[..., Any], ...]) -> None:
    """Takes in place the stand-ins to apply to every model `create` makes, before first use
    (as `adopt_correspondence`: a wrapper delegating to this side keeps wrapping it)."""
    object.__setattr__(self, 'substitutes', tuple(stand_ins))
    for cached in ('_abstract', '_nnx_only_paths', '_nnx_only_state'):  # made from `create` before
      self.__dict__.pop(cached, None)

  def substituted_modules(self) -> dict[str, dict[str, str]]:
    """For each stand-in of `substitutes`, the instances of its stock class in a fresh model (an
    abstract one: nothing allocated), by Linen module path: 'substituted' (given the stand-in by
    the kit) or what the model gives it itself (the name of its function: the stand-in's own
    name where the model already computes Linen's formula)."""
    def made():
      with compat.eager_sharding_off():
        return self.create(0)

    graph = nnx.eval_shape(made)
    out = {}
    for stand_in in self.substitutes:
      before = substitutes_lib.instances(graph, stand_in)
      given = set(substitutes_lib.substitute_in_place(graph, stand_in))
      out[stand_in.__name__] = {self.renames.to_linen(p.split('/', 1)[1] if '/' in p else ''):
                                'substituted' if p in given else state
                                for p, state in before.items() if p == '0' or p.startswith('0/')}
    return out

  def correspondence(self, linen_side: 'StockLinen', batch: Any, key: Any):
    """The inferred correspondence (parity.pairs.correspond.Correspondence) with `linen_side`;
    None where that side is not a stock Linen side (nothing to trace its calls with)."""
    from parity.pairs import correspond

    linen_side = getattr(linen_side, 'stock_linen', None)  # itself, or what a wrapper delegates to
    if not isinstance(linen_side, StockLinen):
      return None
    return correspond.infer(
        correspond.linen_calls(linen_side, linen_side.template, batch, key),
        correspond.nnx_calls(self, self.template, batch, key),
        self.renames,
    )

  @functools.cached_property
  def _abstract(self):
    return nnx.eval_shape(lambda: nnx.split(self._create(0)))

  @property
  def graphdef(self):
    return self._abstract[0]

  @property
  def template(self):
    return self._abstract[1]

  def init(self, seed: int) -> Any:
    return self.place(self._created(seed))

  @functools.cache  # by the side's identity (eq=False): its arrays are never donated, so shared
  def _created(self, seed: int) -> Any:
    """`nnx.split(create(seed))[1]`, unplaced, made as one program (`_one_program`)."""
    return _one_program(('nnx', self.create, self.substitutes, seed), lambda: nnx.split(self._create(seed))[1],
                        seed, f'{self.name} create')

  def _create(self, seed: int):
    """`create(seed)`, annotated variables left unplaced (the kit places the state: `place`), each
    declared stand-in given in place (`substitutes`)."""
    with compat.eager_sharding_off():
      made = self.create(seed)
    for stand_in in self.substitutes:  # a declared difference's stand-in, given in place
      substitutes_lib.substitute_in_place(made, stand_in)
    return made

  def _merge(self, state):
    with compat.eager_sharding_off():
      return nnx.merge(self.graphdef, state)

  @contextlib.contextmanager
  def _held_streams_seeded(self, model, root, step=None):
    """With Linen's dropout keys, the streams `model` keeps seeded with the key Linen's apply
    receives, resolved in the model's call (parity/pairs/dropout.py, `seed_held_streams`)."""
    if self.dropout_keys != 'linen' or not dropout.seed_held_streams(model, root, step):
      yield
      return
    with dropout.resolving_seeds(type(model)):
      yield
    dropout.clear_seeds(model)

  def _train_fn(self, state, batch, dropout_base):
    model, optimizer = self._merge(state)
    # The key a stock Linen step gives its apply: parity.step_key(dropout_base, step, 0).
    with self._dropout_context(model), self._held_streams_seeded(model, dropout_base, optimizer.step[...]):
      metrics = self.train_step_fn(model, optimizer, batch, dropout_base)
    return nnx.state((model, optimizer)), metrics

  @functools.cached_property
  def _train_step(self):
    return self._jit(named(self._train_fn, f'{self.name}_train_step'), state_out=True)

  def lower_for_comparison(self, state, batch, dropout_base) -> jax.stages.Lowered:
    """The train step traced anew with every module call named by its Linen path.

    Only the debug locations differ from `lower_train_step` (parity/compare/scopes.py);
    the program comparison reads them to keep a declared difference inside its modules.
    """
    sample = self._merge(self.template)[0]
    # Traced anew: in the same trace context every jit, the user's `nnx.jit` too, reuses its trace.
    with compat.fresh_trace(), scopes.nnx_module_scopes(sample, self.renames.to_linen):
      if self._nnx_only_paths and self._is_reduced(state):
        with self._context():
          return self._reduced_step.lower(state, batch, dropout_base)
      return self.lower_train_step(state, batch, dropout_base)

  # -- state only this side keeps (`nnx_only`), left out of the compared program --------

  def _is_reduced(self, state) -> bool:
    return not (set(paths.flatten(state)) & self._nnx_only_paths)

  def _split_only(self, state):
    """(the `nnx_only` state, the rest) of a state."""
    return nnx.split_state(state, nnx.Any(*self.nnx_only), ...)

  @functools.cached_property
  def _reduced_step(self):
    """The train step on the state without the `nnx_only` leaves: they enter as `create(0)`'s
    values, constants of the program, and leave unreturned. Unused (a stream nothing draws
    from), they vanish from the program; used, their uses remain, on constants."""
    only = self._nnx_only_state

    def fn(state, batch, dropout_base):
      here = jax.tree.map(lambda x: x, only)  # Variables of this trace (the values: constants)
      new_state, metrics = self._train_fn(nnx.merge_state(state, here), batch, dropout_base)
      return self._split_only(new_state)[1], metrics

    # Compiled by the memory part alone (its analysis of the step without that state), named so.
    fn = named(fn, f'{self.name}_train_step_without_nnx_only_state')
    if self.mesh is None:
      return jax.jit(fn)
    return jax.jit(fn, out_shardings=(self._split_only(self.state_shardings)[1], None))

  def nnx_only_accounting(self) -> dict[str, Any]:
    """What the `nnx_only` state adds to the train step: its leaves, by path, and their bytes."""
    flat = paths.flatten(self.template)
    leaves = {p: flat[p] for p in sorted(self._nnx_only_paths)}
    return {'paths': list(leaves), 'bytes': sum(paths.data_bytes(x) for x in leaves.values())}

  def nnx_only_placement(self, state) -> list[str]:
    """Each `nnx_only` leaf of a placed state not where the side's shardings put it."""
    if self.mesh is None or not self._nnx_only_paths:
      return []
    flat, target = paths.flatten(state), paths.flatten(self.state_shardings)
    out = []
    for p in sorted(self._nnx_only_paths):
      got, want = flat[p].sharding, target.get(p)
      if want is not None and not got.is_equivalent_to(want, np.ndim(flat[p])):
        out.append(f'nnx-only/{p}: {got}; expected {want}')
    return out

  @functools.cached_property
  def _eval_step(self):
    return self._jit(self._evaluate, state_out=False)

  def _evaluate(self, state, batch):
    """`eval_step_fn` on a model merged from `state` (given the optimizer with `eval_sees_optimizer`)."""
    model, optimizer = self._merge(state)
    if self.eval_sees_optimizer:
      return self.eval_step_fn(model, optimizer, batch)
    return self.eval_step_fn(model, batch)

  @functools.cached_property
  def _forward(self):
    if self.forward is None:
      return None

    def fn(state, batch):
      return self.forward(self._merge(state)[0], batch)

    return self._jit(fn, state_out=False)

  @functools.cached_property
  def _eval_and_forward(self):
    if self.forward is None:
      return None

    def fn(state, batch):
      # Each call on a model of its own, as when they run apart: a mode one sets stays its own.
      return self._evaluate(state, batch), self.forward(self._merge(state)[0], batch)

    return self._jit(named(fn, f'{self.name}_eval_and_forward'), state_out=False)

  def decode(self, state, prompt, steps, key, temperature) -> dict[str, Any] | None:
    """`decode_fn`'s tokens, logits and cache (paths renamed to Linen's, under `cache/`)."""
    if self.decode_fn is None:
      return None
    with self._context(), compat.eager_sharding_off():
      model = self._merge(state)[0]
      return _decoded(*self.decode_fn(model, prompt, steps, key, temperature), self.renames.to_linen)

  decode_program_comparable: ClassVar[bool] = False  # as StockLinen's

  def lower_decode_step(self, state, batch: int, max_len: int) -> jax.stages.Lowered | None:
    """One decoding step's program, where `decode_fn` lowers one (the kit's decoders,
    `parity.nnx_decoder`, do: `lower_step`); None otherwise."""
    lower = getattr(self.decode_fn, 'lower_step', None)
    if lower is None:
      return None
    with self._context(), compat.eager_sharding_off():
      return lower(self._merge(state)[0], batch, max_len)

  def eval_calls(self, state, batch) -> list[adapter.Probe]:
    """The module calls of the eval step, run eagerly and named as Linen's, one probe per model
    call (the eval localizer)."""
    calls = dict(self.call_keys)
    with self._context(), compat.eager_sharding_off():
      model, optimizer = self._merge(state)
      if self.eval_sees_optimizer:
        run = lambda m: self.eval_step_fn(m, optimizer, batch)  # noqa: E731
      else:
        run = lambda m: self.eval_step_fn(m, batch)  # noqa: E731
      return model_calls.nnx_model_calls(model, run, self.renames.to_linen, lambda key: calls.get(key, key),
                                         self.renames.to_nnx)

  def decode_calls(self, state, prompt, steps, key, temperature) -> list[adapter.Probe] | None:
    """The module calls of `decode`, run eagerly and named as Linen's, one probe per model call."""
    if self.decode_fn is None:
      return None
    calls = dict(self.call_keys)
    with self._context(), compat.eager_sharding_off():
      model = self._merge(state)[0]
      return model_calls.nnx_model_calls(
          model, lambda m: self.decode_fn(m, prompt, steps, key, temperature), self.renames.to_linen,
          lambda key: calls.get(key, key), self.renames.to_nnx)

  def _loss_value(self, model, batch, key):
    """The loss alone (with `has_aux`, the first of what `loss` returns)."""
    with self._held_streams_seeded(model, key):
      value = self.loss(model, batch, key)
    return value[0] if self.has_aux else value

  @functools.cached_property
  def _value_and_grads(self):
    def fn(state, batch, key):
      model, _ = self._merge(state)
      with self._dropout_context(model):
        loss, grads = nnx.value_and_grad(self._loss_value)(model, batch, key)
      return loss, {
          'params/' + self.renames.to_linen(p): g for p, g in paths.flatten(grads).items()
      }

    return jax.jit(fn)

  def _checkpoint_leaves(self, tree) -> dict[str, Any]:
    return bridge_stock.nnx_to_checkpoint(
        tree, self.renames, nnx_template=self.template, collections=self.collections, convert=False,
        fields=self.optimizer_fields, nnx_only=self.nnx_only,
    )

  def to_checkpoint(self, state) -> dict[str, Any]:
    return bridge_stock.nnx_to_checkpoint(
        state, self.renames, collections=self.collections, fields=self.optimizer_fields,
        nnx_only=self.nnx_only)

  @functools.cached_property
  def _nnx_only_paths(self) -> set[str]:
    return bridge_stock.nnx_only_paths(self.template, self.nnx_only)

  def rng_stream_paths(self) -> list[str]:
    """The model's RNG-stream variables kept as `nnx_only` state, by their Linen paths
    (`renames.to_linen`, e.g. `Dropout_0/rngs/key`): what a layer drawing from a stream
    kept in the model reads, which a Linen `TrainState` does not hold."""
    streams = bridge_stock.nnx_only_paths(self.template, (nnx.RngState,)) & self._nnx_only_paths
    return sorted(self.renames.to_linen(p.split('/', 1)[1]) for p in streams if p.startswith('0/'))

  @functools.cached_property
  def _nnx_only_state(self) -> Any:
    """The state of the `nnx_only` types as `create(0)` makes it (None if there is none)."""
    if not self._nnx_only_paths:
      return None
    return self._split_only(self._created(0))[0]

  def from_checkpoint(self, flat) -> Any:
    return self.place(bridge_stock.checkpoint_to_nnx(
        flat, self.template, self.renames, self.collections, self.optimizer_fields,
        nnx_only=self.nnx_only, nnx_only_state=self._nnx_only_state))

  def argument_names(self, lowered, state, batch, dropout_base) -> list[str]:
    """Checkpoint paths, and `nnx-only/<path>` for the state no checkpoint holds."""
    def leaves(tree):
      flat = paths.flatten(tree)
      return {**self._checkpoint_leaves(tree),
              **{f'nnx-only/{p}': flat[p] for p in self._nnx_only_paths if p in flat}}

    return adapter.step_argument_names(lowered, state, batch, leaves)

  def _logical_specs(self) -> Any:
    return nnx.get_partition_spec(self.template)

  def param_specs(self) -> dict[str, tuple]:
    model_params = nnx.state(nnx.eval_shape(lambda: self._create(0)[0]), nnx.Param)
    return {
        'params/' + self.renames.to_linen(p): compat.nnx_logical_axes(v) or ()
        for p, v in paths.items(model_params, lambda x: isinstance(x, nnx.Variable))
    }

  def comparison_state(self, state):
    """The state without the `nnx_only` leaves (a Linen TrainState has none): the compared
    program takes them as constants and leaves them unreturned (`lower_for_comparison`)."""
    if not self._nnx_only_paths:
      return state
    return self._split_only(state)[1]

  def probe(self, state, batch, dropout_key) -> adapter.Probe:
    with self._context():
      calls = dict(self.call_keys)
      with self._dropout_context():  # the probe tags the model's paths itself
        return localize.nnx_probe(self._loss_value, self.graphdef, state, batch, dropout_key, self.renames,
                                  call_key=lambda key: calls.get(key, key))
