"""The stock Linen side: a flax `TrainState` and the user's own functional steps (`StockLinen`)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, ClassVar

import flax.linen as nn
import jax
from flax.core import meta

from parity.compare import localize
from parity.compare import model_calls
from parity.core import paths
from parity.core.state import NNX_STEP_DTYPE
from parity.pairs import adapter
from parity.pairs import stock_layout as bridge_stock
from parity.pairs.stock.common import _Stock, _decoded, _one_program, named


@dataclasses.dataclass(frozen=True, eq=False)
class StockLinen(_Stock):
  """A Linen side over a stock `TrainState`.

  create(seed) -> TrainState; train_step(state, batch, dropout_base) ->
  (state, metrics); eval_step(state, batch) -> metrics; loss(params, state,
  batch, dropout_key) -> loss, or (loss, aux) with `has_aux`.
  """

  create: Callable[[int], Any]
  train_step_fn: Callable[..., Any]
  eval_step_fn: Callable[..., Any]
  loss: Callable[..., Any]
  has_aux: bool = False
  mesh: jax.sharding.Mesh | None = None
  batch_axis: str = 'data'
  rules: tuple[tuple[str, Any], ...] | None = None  # logical axis rules (None: replicate the state)
  name: str = 'linen'
  # forward(state, batch) -> the model's eval-mode outputs (its logits): compared bit for bit by
  # the eval part, beside the metrics eval_step returns (which may round a difference away).
  forward: Callable[..., Any] | None = None
  # decode_fn(state, prompt, steps, key, temperature) -> (tokens, logits, {cache path: array}):
  # decoding with the model's KV cache, for the decode part (Pair(decode=...)).
  decode_fn: Callable[..., Any] | None = None

  @property
  def stock_linen(self) -> 'StockLinen':
    """This side (what a wrapper delegating to it reaches): the kit traces its module calls."""
    return self

  @functools.cached_property
  def _boxed_template(self) -> Any:
    """`create`'s state as ShapeDtypeStructs, logical-axis boxes (if any) kept: the specs."""
    return jax.eval_shape(lambda: self.create(0))

  @functools.cached_property
  def template(self) -> Any:
    """The state as trained: parameters (and moments) unboxed.

    The idiom of flax's sharded training: boxes give the specs, plain arrays
    train. Trained boxed, every parameter read would add a sharding
    constraint (`LogicallyPartitioned.unbox` under a mesh) that NNX's
    variables do not, and the two programs would differ by those.
    """
    return meta.unbox(self._boxed_template)

  def init(self, seed: int) -> Any:
    # A TrainState's treedef holds `apply_fn` and `tx`, which compare by
    # identity: every state of this side takes the template's.
    # (`TrainState.create` leaves the step a Python int: an array like every leaf.)
    def leaves():
      # A Python number (TrainState's step) as an array of its own dtype, not a weakly typed one: a
      # state carried from the other side holds it so, and one signature means one train program.
      return [jax.numpy.asarray(x, dtype=jax.numpy.result_type(x)) if isinstance(x, (int, float)) else
              jax.numpy.asarray(x) for x in jax.tree.leaves(meta.unbox(self.create(seed)))]

    made = _one_program(('linen', self.create, seed), leaves, seed, f'{self.name} create')
    return self.place(jax.tree.unflatten(jax.tree.structure(self.template), made))

  @functools.cached_property
  def _train_step(self):
    return self._jit(self.train_step_fn, state_out=True)

  @functools.cached_property
  def _eval_step(self):
    return self._jit(self.eval_step_fn, state_out=False)

  @functools.cached_property
  def _forward(self):
    return None if self.forward is None else self._jit(self.forward, state_out=False)

  @functools.cached_property
  def _eval_and_forward(self):
    if self.forward is None:
      return None
    return self._jit(named(lambda state, batch: (self.eval_step_fn(state, batch), self.forward(state, batch)),
                           f'{self.name}_eval_and_forward'), state_out=False)

  def decode(self, state, prompt, steps, key, temperature) -> dict[str, Any] | None:
    """`decode_fn`'s tokens, logits and cache (under `cache/`); None: no `decode_fn` given."""
    if self.decode_fn is None:
      return None
    with self._context():
      return _decoded(*self.decode_fn(state, prompt, steps, key, temperature))

  # The step's arguments come in each side's own path order: its memory is compared, not its
  # program position by position (parity/run/runner.py `decode_sides`).
  decode_program_comparable: ClassVar[bool] = False

  def lower_decode_step(self, state, batch: int, max_len: int) -> jax.stages.Lowered | None:
    """One decoding step's program, where `decode_fn` lowers one (the kit's decoders,
    `parity.linen_decoder`, do: `lower_step`); None otherwise."""
    lower = getattr(self.decode_fn, 'lower_step', None)
    if lower is None:
      return None
    with self._context():
      return lower(state, batch, max_len)

  def eval_calls(self, state, batch) -> list[adapter.Probe]:
    """The module calls of the eval step, run eagerly, one probe per model call (the eval localizer)."""
    with self._context():
      return model_calls.linen_model_calls(lambda: self.eval_step_fn(state, batch))

  def decode_calls(self, state, prompt, steps, key, temperature) -> list[adapter.Probe] | None:
    """The module calls of `decode`, run eagerly, one probe per model call (the decode localizer)."""
    if self.decode_fn is None:
      return None
    with self._context():
      return model_calls.linen_model_calls(lambda: self.decode_fn(state, prompt, steps, key, temperature))

  @functools.cached_property
  def _value_and_grads(self):
    grad = jax.value_and_grad(self.loss, has_aux=self.has_aux)

    def fn(state, batch, key):
      value, grads = grad(state.params, state, batch, key)
      loss = value[0] if self.has_aux else value
      return loss, {'params/' + p: g for p, g in paths.flatten(grads).items()}

    return jax.jit(fn)

  def _checkpoint_leaves(self, tree) -> dict[str, Any]:
    return paths.flatten(tree)

  def to_checkpoint(self, state) -> dict[str, Any]:
    return bridge_stock.linen_to_checkpoint(state)

  def from_checkpoint(self, flat) -> Any:
    return self.place(bridge_stock.checkpoint_to_linen(flat, self.template))

  def _logical_specs(self) -> Any:
    return nn.get_partition_spec(self._boxed_template)

  def param_specs(self) -> dict[str, tuple]:
    """Logical axis names of boxed parameters (`nn.with_logical_partitioning`); `()` if none."""
    specs = nn.get_partition_spec(self._boxed_template.params)
    flat = paths.items(specs, lambda x: isinstance(x, jax.sharding.PartitionSpec))
    return {'params/' + p: tuple(spec) for p, spec in flat}

  def comparison_state(self, state):
    """The step counter typed as `nnx.Optimizer`'s (parity.compare.programs.STEP_COUNTER_DTYPE)."""
    step = jax.ShapeDtypeStruct((), NNX_STEP_DTYPE, sharding=getattr(state.step, 'sharding', None))
    return state.replace(step=step)

  def probe(self, state, batch, dropout_key) -> adapter.Probe:
    with self._context():
      return localize.linen_probe(self.loss, self.has_aux, state, batch, dropout_key)
