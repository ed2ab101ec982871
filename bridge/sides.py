"""The two implementations behind one interface, for the runner, CLI and tests.

A side's state is what its step functions take: a Linen `TrainState`, or the
pure NNX `State` of `(model, optimizer)` (its graphdef is fixed per side).
States cross between sides only through the bridge's checkpoint layout.

On a mesh, each side derives its state's shardings in its own framework's
idiom (Linen: `nn.get_partition_spec` of the boxed abstract state; NNX:
`nnx.get_partition_spec` of the abstract state's metadata), both resolved by
the same rules; state is created directly in those shardings, every jitted
function is traced under the mesh and the rules (so activation constraints
apply), and train steps keep the state's shardings.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from typing import Any, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bridge import decode as bridge_decode
from bridge import layout as layout_lib
from parity.core import paths
from parity.core import specs as specs_lib
from parity.pairs import stock_layout as bridge_stock
from bridge import train_state as bridge_state
from models import data, rng
from parity.core import compat
from models.config import ModelConfig, TrainConfig
from models.linen import decode as linen_decode
from models.linen import train as linen_train
from models.nnx import decode as nnx_decode
from models.nnx import train as nnx_train
from parity.pairs import adapter
from parity.compare import model_calls
from parity.compare import localize
from parity.compare import programs


# The reference decoder's logical axis rules: the kit's (parameters, activations) and its
# decoding cache's (bridge/decode.py), so that both sides place the cache alike on a mesh.
RULES: specs_lib.Rules = specs_lib.DEFAULT_RULES + bridge_decode.CACHE_RULES


def as_jax_batch(batch: dict[str, Any]) -> dict[str, jax.Array]:
  return {k: jnp.asarray(v) for k, v in batch.items()}


def abstract_step_inputs(model_cfg: ModelConfig, train_cfg: TrainConfig):
  """(batch, dropout key) of a train step as ShapeDtypeStructs (for tracing and lowering)."""
  batch = {
      k: jax.ShapeDtypeStruct(v.shape, v.dtype)
      for k, v in data.make_batch(model_cfg, train_cfg, 0).items()
  }
  return batch, jax.eval_shape(rng.base_key, 0)


class _Placement:
  """The mesh and rules a side runs under (none: one device, no constraints)."""

  mesh: jax.sharding.Mesh | None
  rules: specs_lib.Rules

  @contextlib.contextmanager
  def context(self) -> Iterator[None]:
    """Mesh and logical-axis rules for tracing; nothing off a mesh."""
    if self.mesh is None:
      yield
      return
    with compat.use_mesh(self.mesh), nn.logical_axis_rules(list(self.rules)):
      yield

  @contextlib.contextmanager
  def decode_context(self) -> Iterator[None]:
    """`context()` for decoding: on a mesh the rules must map every cache axis (`RULES`).

    A logical name without a rule is replicated by Linen (`nn.unbox`) but read as a mesh axis
    by NNX (`nnx.eval_shape` of the cache), which fails: neither side decodes so.
    """
    if self.mesh is not None:
      ruled = {name for name, _ in self.rules}
      missing = [name for name, _ in bridge_decode.CACHE_RULES if name not in ruled]
      if missing:
        raise ValueError(f'{self.name} side: its rules map no mesh axes for the cache axes {missing};'
                         ' decode with bridge.sides.RULES (or add bridge.decode.CACHE_RULES)')
    with self.context():
      yield

  def _shardings(self, logical_specs: Any) -> Any:
    return nn.logical_to_mesh_sharding(logical_specs, self.mesh, list(self.rules))

  def checkpoint_shardings(self) -> dict[str, jax.sharding.NamedSharding]:
    return self._checkpoint_leaves(self.state_shardings)

  def abstract_checkpoint(self) -> dict[str, jax.ShapeDtypeStruct]:
    """`{checkpoint path: ShapeDtypeStruct}`, with this side's target sharding on a mesh."""
    flat = self.to_checkpoint(self.template)
    if self.mesh is None:
      return {p: jax.ShapeDtypeStruct(x.shape, x.dtype) for p, x in flat.items()}
    shardings = self.checkpoint_shardings()
    return {
        p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[p]) for p, x in flat.items()
    }

  def place(self, state: Any) -> Any:
    """`state` moved to this side's shardings (a no-op off a mesh)."""
    if self.mesh is None:
      return state
    return jax.device_put(state, self.state_shardings)

  def lower_train_step(self, state, batch, dropout_base) -> jax.stages.Lowered:
    """This side's train step lowered for these arguments, under its mesh and rules."""
    fn = self._train_step
    with self.context():
      if isinstance(fn, functools.partial):
        # The NNX step off a mesh: the model's jitted function with the
        # graphdef bound as its static first argument.
        return fn.func.lower(*fn.args, state, batch, dropout_base, **fn.keywords)
      return fn.lower(state, batch, dropout_base)

  def train_step_function(self):
    """The train step as this side runs it, a callable `(state, batch, dropout_base)`."""
    return self._train_step

  def argument_names(self, lowered: jax.stages.Lowered, state, batch, dropout_base) -> list[str]:
    """A name per argument of the lowered step (parity.pairs.adapter.step_argument_names)."""
    return adapter.step_argument_names(lowered, state, batch, self._checkpoint_leaves)

  def comparison_state(self, state):
    """The state the program comparison traces this side's step with (see programs.ALLOWED)."""
    return state

  def train_step(self, state, batch, dropout_base):
    with self.context():
      return self._train_step(state, batch, dropout_base)

  def place_batch(self, batch) -> dict[str, jax.Array]:
    """The batch as the step takes it: on a mesh, split over the logical batch axis.

    Each process supplies only its own rows (parity.procs.distributed), as a pod
    host's input pipeline does; in one process that is every row.
    """
    if self.mesh is None:
      return as_jax_batch(batch)
    from parity.procs import distributed

    return distributed.global_batch(batch, self.batch_sharding)

  @functools.cached_property
  def batch_sharding(self) -> jax.sharding.NamedSharding:
    spec = jax.sharding.PartitionSpec('activation_batch')
    return nn.logical_to_mesh_sharding(spec, self.mesh, list(self.rules))

  def probe(self, state, batch, dropout_key) -> adapter.Probe:
    """The localizer's probe; a scanned stack is probed on its unscanned twin.

    Module calls inside a scan body cannot be recorded from outside it, so
    the state is cut into per-layer parameters (bridge.layout.unstack_layers)
    and the same model code runs with `scan_layers=False`, one device: its
    module paths name each layer (`decoder/layers_<i>/...`).
    """
    if not self.model_cfg.scan_layers and self.mesh is None:
      return self._probe(state, batch, dropout_key)
    from parity.procs import distributed

    flat = distributed.host_arrays(self.to_checkpoint(state))
    if self.model_cfg.scan_layers:
      flat = layout_lib.unstack_layers(
          flat, self.model_cfg.num_layers, self.model_cfg.param_scan_axis
      )
    twin_cfg = dataclasses.replace(self.model_cfg, scan_layers=False)
    twin = make_sides(twin_cfg, self.train_cfg)[0 if self.name == 'linen' else 1]
    batch = {k: jnp.asarray(np.asarray(v)) for k, v in distributed.host_arrays(batch).items()}
    key = jnp.asarray(np.asarray(dropout_key))
    return twin._probe(twin.from_checkpoint(flat), batch, key)


@dataclasses.dataclass(frozen=True)
class LinenSide(_Placement):
  model_cfg: ModelConfig
  train_cfg: TrainConfig
  mesh: jax.sharding.Mesh | None = None
  rules: specs_lib.Rules = RULES
  name: str = 'linen'

  def _make_state(self, seed: int) -> linen_train.TrainState:
    variables = linen_train.init_variables(self.model_cfg, self.train_cfg, seed)
    return linen_train.create_train_state(self.model_cfg, self.train_cfg, variables)

  def init(self, seed: int) -> linen_train.TrainState:
    """A fresh state, created in its target shardings on a mesh."""
    with self.context():
      return jax.tree.unflatten(jax.tree.structure(self.template), self._init_leaves(seed))

  @functools.cached_property
  def _init_leaves(self):
    """The jitted initialiser (one per side, one compile per seed).

    It returns leaves, not the TrainState: a TrainState's treedef holds
    `apply_fn`, which compares by identity, so the template's treedef is the
    one every state of this side shares.
    """
    shardings = None if self.mesh is None else jax.tree.leaves(self.state_shardings)
    return jax.jit(
        lambda seed: jax.tree.leaves(self._make_state(seed)),
        static_argnums=0,
        out_shardings=shardings,
    )

  @functools.cached_property
  def abstract_all_variables(self) -> Any:
    """Every boxed collection (parameters, fp8 state) as ShapeDtypeStructs."""
    return jax.eval_shape(lambda: linen_train.init_variables(self.model_cfg, self.train_cfg, 0))

  @functools.cached_property
  def abstract_variables(self) -> Any:
    """Boxed parameters `{'params': ...}` as ShapeDtypeStructs (nothing allocated)."""
    return {'params': self.abstract_all_variables['params']}

  @functools.cached_property
  def template(self) -> linen_train.TrainState:
    return jax.eval_shape(
        lambda: linen_train.create_train_state(
            self.model_cfg, self.train_cfg, nn.unbox(self.abstract_all_variables)
        )
    )

  @functools.cached_property
  def state_shardings(self) -> Any:
    """A TrainState of NamedShardings (same treedef as `template`); None off a mesh."""
    if self.mesh is None:
      return None
    boxed = jax.eval_shape(
        lambda: linen_train.create_train_state(
            self.model_cfg, self.train_cfg, self.abstract_all_variables, unbox=False
        )
    )
    leaves = jax.tree.leaves(self._shardings(nn.get_partition_spec(boxed)))
    return jax.tree.unflatten(jax.tree.structure(self.template), leaves)

  def _checkpoint_leaves(self, tree) -> dict[str, Any]:
    return bridge_state.linen_to_checkpoint_leaves(tree)

  def comparison_state(self, state):
    """`state` with the step counter typed as `nnx.Optimizer`'s (the allowed difference)."""
    step = jax.ShapeDtypeStruct(
        (), programs.STEP_COUNTER_DTYPE.nnx_dtype, sharding=getattr(state.step, 'sharding', None)
    )
    return state.replace(step=step)

  @functools.cached_property
  def _train_step(self):
    step = linen_train.make_train_step(self.model_cfg, self.train_cfg)
    if self.mesh is None:
      return step
    return jax.jit(step, out_shardings=(self.state_shardings, None))

  def eval_step(self, state, batch):
    with self.context():
      return linen_train.make_eval_step(self.model_cfg, self.train_cfg)(state, batch)

  def to_checkpoint(self, state) -> dict[str, Any]:
    return bridge_state.linen_to_checkpoint(state)

  def from_checkpoint(self, flat: dict[str, Any]) -> linen_train.TrainState:
    return self.place(bridge_state.checkpoint_to_linen(flat, self.template))

  def params(self, state) -> Any:
    return state.params

  def param_specs(self) -> dict[str, tuple]:
    specs = specs_lib.linen_logical_specs(self.abstract_variables)
    return {'params/params/' + p: names for p, names in specs.items()}

  def value_and_grads(self, state, batch, dropout_key):
    """The adapter's form of `loss_and_grad`: gradients keyed by checkpoint path."""
    value, grads = self.loss_and_grad(state, batch, dropout_key)
    return value, {'params/' + p: g for p, g in paths.flatten(grads).items()}

  def _probe(self, state, batch, dropout_key) -> adapter.Probe:
    def loss(params, state, batch, key):
      return linen_train._loss_sum(self.model_cfg, self.train_cfg, params, state.fp8_meta, batch, key)

    with self.context():
      return localize.linen_probe(loss, True, state, batch, dropout_key)

  def decode(self, state, prompt, steps, key, temperature) -> dict[str, Any]:
    """Decoding with the KV cache (models/linen/decode.py), the cache in the common layout."""
    with self.decode_context():
      tokens, logits, cache = linen_decode.decode(
          self.model_cfg, linen_train.model_variables(state), prompt, steps, key, temperature)
    return {'tokens': tokens, 'logits': logits, 'cache': bridge_decode.linen_cache(cache)}

  def lower_decode_step(self, state, batch: int, max_len: int) -> jax.stages.Lowered:
    """One decoding step's program (models/linen/decode.py `lower_step`)."""
    with self.decode_context():
      return linen_decode.lower_step(self.model_cfg, linen_train.model_variables(state), batch, max_len)

  def eval_calls(self, state, batch) -> list[adapter.Probe]:
    """The eval step's module calls, run eagerly (the eval localizer)."""
    with self.context():
      return model_calls.linen_model_calls(
          lambda: linen_train.make_eval_step(self.model_cfg, self.train_cfg)(state, batch))

  def decode_calls(self, state, prompt, steps, key, temperature) -> list[adapter.Probe]:
    """`decode`'s module calls, run eagerly (the decode localizer)."""
    with self.decode_context():
      return model_calls.linen_model_calls(lambda: linen_decode.decode(
          self.model_cfg, linen_train.model_variables(state), prompt, steps, key, temperature))

  def forward(self, state, batch, dropout_key):
    with self.context():
      return _linen_forward(self.model_cfg, linen_train.model_variables(state), batch, dropout_key)

  def loss_and_grad(self, state, batch, dropout_key):
    """((loss_sum, (z_sum, tokens)), grads as Linen variables `{'params': ...}`)."""
    fn = linen_train.make_loss_and_grad(self.model_cfg, self.train_cfg)
    with self.context():
      return fn(state, batch, dropout_key)


@dataclasses.dataclass(frozen=True)
class NnxSide(_Placement):
  model_cfg: ModelConfig
  train_cfg: TrainConfig
  mesh: jax.sharding.Mesh | None = None
  rules: specs_lib.Rules = RULES
  name: str = 'nnx'

  @property
  def layout(self) -> layout_lib.Layout:
    return layout_lib.layout_for(self.model_cfg)

  def _split_state(self, seed: int):
    """(graphdef, state) of (model, optimizer), as the model package builds them."""
    model = nnx_train.init_model(self.model_cfg, seed)
    return nnx_train.create_train_state(self.model_cfg, self.train_cfg, model)

  @functools.cached_property
  def _abstract(self):
    return nnx.eval_shape(lambda: self._split_state(0))

  @property
  def graphdef(self):
    return self._abstract[0]

  @property
  def template(self) -> nnx.State:
    return self._abstract[1]

  @functools.cached_property
  def abstract_params(self) -> nnx.State:
    """The Param state with metadata, as ShapeDtypeStructs (nothing allocated)."""
    return nnx.state(nnx.eval_shape(lambda: nnx_train.init_model(self.model_cfg, 0)), nnx.Param)

  @functools.cached_property
  def state_shardings(self) -> Any:
    """An NNX State of NamedShardings shaped like `template`; None off a mesh."""
    if self.mesh is None:
      return None
    return self._shardings(nnx.get_partition_spec(self.template))

  def _checkpoint_leaves(self, tree) -> dict[str, Any]:
    return bridge_state.nnx_to_checkpoint_leaves(tree, self.layout)

  def init(self, seed: int) -> nnx.State:
    """A fresh state, created in its target shardings on a mesh."""
    with self.context():
      return self._init_state(seed)

  @functools.cached_property
  def _init_state(self):
    """The jitted initialiser (one per side, one compile per seed)."""
    return jax.jit(
        lambda seed: self._split_state(seed)[1],
        static_argnums=0,
        out_shardings=self.state_shardings,
    )

  @functools.cached_property
  def _train_step(self):
    step = functools.partial(
        nnx_train.make_train_step(self.model_cfg, self.train_cfg), self.graphdef
    )
    if self.mesh is None:
      return step
    return jax.jit(step, out_shardings=(self.state_shardings, None))

  def eval_step(self, state, batch):
    with self.context():
      return nnx_train.make_eval_step(self.model_cfg, self.train_cfg)(self.graphdef, state, batch)

  def to_checkpoint(self, state) -> dict[str, Any]:
    return bridge_state.nnx_to_checkpoint(state, self.layout)

  def from_checkpoint(self, flat: dict[str, Any]) -> nnx.State:
    return self.place(bridge_state.checkpoint_to_nnx(flat, self.template, self.layout))

  def params(self, state) -> Any:
    model, _ = nnx.merge(self.graphdef, state)
    return nnx.state(model, nnx.Param)

  def param_specs(self) -> dict[str, tuple]:
    specs = specs_lib.nnx_logical_specs(self.abstract_params)
    return {'params/params/' + p: self.layout.names_to_linen(p, names) for p, names in specs.items()}

  def value_and_grads(self, state, batch, dropout_key):
    """The adapter's form of `loss_and_grad`: gradients keyed by checkpoint path, Linen layout."""
    value, grads = self.loss_and_grad(state, batch, dropout_key)
    return value, {
        'params/params/' + p: self.layout.array_to_linen(p, g) for p, g in paths.flatten(grads).items()
    }

  def _probe(self, state, batch, dropout_key) -> adapter.Probe:
    def loss(model, batch, key):
      return nnx_train._loss_sum(self.train_cfg, model, batch, key)[0]

    with self.context():
      return localize.nnx_probe(
          loss, self.graphdef, state, batch, dropout_key, bridge_stock.Renames(),
          prefix='params/params/', to_linen=self.layout.array_to_linen,
          call_key=_linen_dropout_call,
      )

  def decode(self, state, prompt, steps, key, temperature) -> dict[str, Any]:
    """Decoding with the KV cache (models/nnx/decode.py), the cache in the common layout."""
    with self.decode_context():
      model = nnx.merge(self.graphdef, state)[0]
      tokens, logits, cache = nnx_decode.decode(self.model_cfg, model, prompt, steps, key, temperature)
    return {'tokens': tokens, 'logits': logits, 'cache': bridge_decode.nnx_cache(cache)}

  def lower_decode_step(self, state, batch: int, max_len: int) -> jax.stages.Lowered:
    """One decoding step's program (models/nnx/decode.py `lower_step`)."""
    with self.decode_context():
      return nnx_decode.lower_step(nnx.merge(self.graphdef, state)[0], batch, max_len)

  def eval_calls(self, state, batch) -> list[adapter.Probe]:
    """The eval step's module calls, run eagerly and named as Linen's (the eval localizer)."""
    step = nnx_train.make_eval_step(self.model_cfg, self.train_cfg)
    with self.context():
      model, optimizer = nnx.merge(self.graphdef, state)
      return model_calls.nnx_model_calls(
          model, lambda m: step(*nnx.split((m, optimizer)), batch),
          bridge_stock.Renames().to_linen, _linen_dropout_call)

  def decode_calls(self, state, prompt, steps, key, temperature) -> list[adapter.Probe]:
    """`decode`'s module calls, run eagerly and named as Linen's (the decode localizer)."""
    with self.decode_context():
      return model_calls.nnx_model_calls(
          nnx.merge(self.graphdef, state)[0],
          lambda model: nnx_decode.decode(self.model_cfg, model, prompt, steps, key, temperature),
          bridge_stock.Renames().to_linen, _linen_dropout_call)

  def forward(self, state, batch, dropout_key):
    with self.context():
      return _nnx_forward(self.graphdef, state, batch, dropout_key)

  def loss_and_grad(self, state, batch, dropout_key):
    """((loss_sum, (z_sum, tokens)), grads as an NNX Param state)."""
    fn = nnx_train.make_loss_and_grad(self.model_cfg, self.train_cfg)
    with self.context():
      return fn(self.graphdef, state, batch, dropout_key)


_NNX_DROPOUT_CALL = re.compile(r'(^|/)dropout(?:#(\d+))?$')


def _linen_dropout_call(key: str) -> str:
  """An NNX decoder's dropout call as Linen names it.

  A block's one `dropout` module is called once per site (`dropout`,
  `dropout#1`); Linen makes a module per call (`Dropout_0`, `Dropout_1`).
  """
  m = _NNX_DROPOUT_CALL.search(key)
  if m is None:
    return key
  return f'{key[:m.start()]}{m.group(1)}Dropout_{int(m.group(2) or 0)}'


@functools.partial(jax.jit, static_argnums=0)
def _linen_forward(model_cfg, params, batch, dropout_key):
  return linen_train._forward(model_cfg, params, batch, dropout_key)


@functools.partial(jax.jit, static_argnums=0)
def _nnx_forward(graphdef, state, batch, dropout_key):
  model, _ = nnx.merge(graphdef, state)
  return nnx_train._forward(model, batch, dropout_key)


def make_sides(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    mesh: jax.sharding.Mesh | None = None,
    rules: specs_lib.Rules = RULES,
) -> tuple[LinenSide, NnxSide]:
  """Both sides of one config, on one device (`mesh=None`) or on `mesh` under `rules`.

  Made once per process and arguments: a side keeps its jitted functions, so
  every caller (runner, CLI, tests) shares their compilations.
  """
  return _make_sides(model_cfg, train_cfg, mesh, tuple(tuple(r) for r in rules))


@functools.cache
def _make_sides(model_cfg, train_cfg, mesh, rules) -> tuple[LinenSide, NnxSide]:
  return LinenSide(model_cfg, train_cfg, mesh, rules), NnxSide(model_cfg, train_cfg, mesh, rules)
