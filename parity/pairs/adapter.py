"""The adapter API: what one side of a migration gives the battery.

A `Side` is one framework's implementation of a model and its training: the
reference decoder's sides (bridge/sides.py) and the stock-state sides
(parity/pairs/stock/) both implement it, and the runner, checkpoints, program
comparison and the pytest plugin (parity/battery/plugin.py) take any pair of them.

Everything crosses between sides through one flat checkpoint layout,
`{path: array}`: states, gradients and shardings. A `Pair` declares the
two sides of one migration, the data they train on, and any difference the
user has proven inherent (`KnownDifference`), which the battery then
asserts as a bound instead of bitwise equality, for that path only.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import jax

from parity.core import paths
from parity.core import compat

Flat = dict[str, Any]


class BatchError(ValueError):
  """A batch a side cannot place as asked (rows its mesh's batch axis cannot split evenly).

  A user error: `parity compare` reports it in one line with exit status 2.
  """


@runtime_checkable
class Side(Protocol):
  """One side of a migration. States are pytrees; the step functions are compiled once.

  Every member is needed by some part of the battery, `probe` by the
  localizer only (a side without it runs every other part; `make_pair_sides`
  names what a side lacks). parity/pairs/stock/ implements them for flax's
  stock train states, bridge/sides.py for the reference decoder's own.

  The checkpoint layout, which every state crosses sides in: `{path: array}`,
  paths joined by `/`, the same paths on both sides (by convention the Linen
  side's). Parameters are the paths under `params/` (`params/Dense_0/kernel`
  from a stock `TrainState`), which the report counts and the localizer
  reads by that prefix, and the keys of `value_and_grads`, `param_specs` and
  a probe's `param_grads` are exactly the parameter paths `to_checkpoint`
  gives; anything else (optimizer state, batch statistics, an EMA) goes
  under names of your choice. `from_checkpoint` receives numpy or jax arrays of the
  layout's shapes and dtypes (an Orbax restore, the other side's
  `to_checkpoint`). `dropout_base` is one raw `uint32[2]` key per run, the
  same for both sides; `dropout_key`, which `value_and_grads` and `probe`
  receive, the step's key derived from it (`models.rng.step_key(dropout_base,
  step, 0)`).
  """

  name: str  # 'linen' or 'nnx'
  mesh: jax.sharding.Mesh | None  # where the side runs (None: one device)

  def init(self, seed: int) -> Any:
    """A fresh train state (in its target shardings on a mesh)."""

  def place_batch(self, batch: Mapping[str, Any]) -> dict[str, jax.Array]:
    """A batch of numpy arrays as the step takes it (split over the mesh's batch axis)."""

  def train_step(self, state: Any, batch: Any, dropout_base: jax.Array) -> tuple[Any, Mapping[str, jax.Array]]:
    """(next state, metrics with at least `loss`)."""

  def eval_step(self, state: Any, batch: Any) -> Mapping[str, jax.Array]:
    """Metrics of the model in eval mode."""

  def eval_outputs(self, state: Any, batch: Any) -> Any:
    """Optional: the model's eval-mode outputs (its logits), compared bit for bit by the eval
    part beside the metrics; None where the side gives none."""

  def decode(self, state: Any, prompt: jax.Array, steps: int, key: jax.Array, temperature: float) -> Any:
    """Optional (a pair that declares `decode`): `steps` tokens after `prompt` with a KV cache,
    `{'tokens': int[B, steps], 'logits': [B, steps, V] (what each token was drawn from),
    'cache': {path in the Linen layout: array}}`; temperature 0 is greedy."""

  def lower_decode_step(self, state: Any, batch: int, max_len: int) -> jax.stages.Lowered:
    """Optional (`parity compare --decode`): one decoding step's program, a token a row on a
    cache of `max_len`, for its memory analysis and program comparison (None: not lowered)."""

  def eval_calls(self, state: Any, batch: Any) -> Any:
    """Optional (the eval localizer): `eval_step`'s module calls, recorded as it runs eagerly, one
    Probe per model call (parity.compare.model_calls)."""

  def decode_calls(self, state: Any, prompt: jax.Array, steps: int, key: jax.Array, temperature: float) -> Any:
    """Optional (the decode localizer): `decode`'s module calls, recorded as it runs eagerly, one
    Probe per model call (parity.compare.decode_localize)."""

  def value_and_grads(self, state: Any, batch: Any, dropout_key: jax.Array) -> tuple[Any, Flat]:
    """(loss or (loss, aux), `{checkpoint path of a parameter: gradient}`) of one train-mode pass."""

  def to_checkpoint(self, state: Any) -> Flat:
    """The state in the checkpoint layout."""

  def from_checkpoint(self, flat: Mapping[str, Any]) -> Any:
    """A state from the checkpoint layout (placed in the side's shardings)."""

  def abstract_checkpoint(self) -> dict[str, jax.ShapeDtypeStruct]:
    """`{checkpoint path: ShapeDtypeStruct}` with the side's target sharding on a mesh."""

  def param_specs(self) -> dict[str, tuple[str | None, ...]]:
    """`{checkpoint path of a parameter: logical axis names}` (`()`: none declared)."""

  def train_step_function(self) -> Callable[..., Any]:
    """The traceable train step `(state, batch, dropout_base) -> (state, metrics)`.

    The activation-spec check traces it (`jax.make_jaxpr`, nothing compiled
    or run) to read every activation constraint's logical names.
    """

  def lower_train_step(self, state: Any, batch: Any, dropout_base: Any) -> jax.stages.Lowered:
    """The train step lowered for these (possibly abstract) arguments."""

  def comparison_state(self, state: Any) -> Any:
    """The state the program comparison traces with (the allowed differences removed)."""

  def argument_names(self, lowered: jax.stages.Lowered, state: Any, batch: Any, dropout_base: Any) -> list[str]:
    """A name per argument of the lowered step, the same on both sides (checkpoint paths)."""

  def probe(self, state: Any, batch: Any, dropout_key: jax.Array) -> 'Probe':
    """Every module's forward output, output cotangent and parameter gradients (the localizer).

    Optional. `parity.compare.localize.linen_probe(loss, has_aux, state, batch, key)`
    records a state with `.params` and `loss(params, state, batch, key)`;
    `parity.compare.localize.nnx_probe(loss, graphdef, state, batch, key, renames)`, a
    state split from a `(model, anything)` pair and `loss(model, batch, key)`.
    """


@dataclasses.dataclass(frozen=True)
class Probe:
  """What the localizer compares, keyed by module path in the checkpoint naming.

  `order` lists module calls in forward execution order (`path#call` when a
  module runs more than once); `unrecorded`, the modules called inside a
  transformed body (a Linen `nn.scan` or `nn.remat` stack), whose values
  cannot leave it.
  """

  order: list[str]
  inputs: Flat  # each call's array arguments, by argument name
  outputs: Flat
  cotangents: Flat
  param_grads: Flat  # checkpoint path of a parameter -> gradient
  unrecorded: tuple[str, ...] = ()


# What a KnownDifference may declare: values of a pass ('grads', 'train',
# 'eval'), the localizer's forward pass, the program, and its memory.
PASSES = ('grads', 'train', 'eval', 'forward', 'decode', 'program', 'memory')
# Passes whose declared difference is a bound on values (ULP): each needs a substitution.
VALUE_PASSES = ('grads', 'train', 'eval', 'forward', 'decode')
# The platforms a memory bound may name (jax's `Device.platform`).
PLATFORMS = ('cpu', 'gpu', 'tpu')
# A declared bound may be at most this many times the largest difference measured under it.
TIGHTNESS = 4


def _bytes(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def placement(platform: str, mesh_shape: Mapping[str, int] | None = None) -> str:
  """The key a memory bound is read under: the platform ('cpu'), and on a mesh its axes of more
  than one device after an '@' ('cpu@data=2,fsdp=2,tensor=2', axes sorted by name)."""
  axes = sorted((str(a), int(n)) for a, n in (mesh_shape or {}).items() if int(n) > 1)
  return platform if not axes else platform + '@' + ','.join(f'{a}={n}' for a, n in axes)


def _placement_key(key: Any) -> str | None:
  """`key` of a `max_temp_bytes` mapping as `placement` writes it ('cpu', 'cpu@data=2,tensor=2'),
  or None where it is neither a known platform nor one with a mesh spec of `axis=size` entries."""
  if not isinstance(key, str):
    return None
  platform, at, spec = key.partition('@')
  if platform not in PLATFORMS:
    return None
  if not at:
    return platform
  shape = {}
  for item in spec.split(','):
    axis, eq, size = item.strip().partition('=')
    if not eq or not axis.strip().isidentifier() or not size.strip().isdigit() or axis.strip() in shape:
      return None
    shape[axis.strip()] = int(size)
  key = placement(platform, shape)
  return key if '@' in key else None


def _by_platform(bound: Any) -> dict[str, int] | None:
  """A `max_temp_bytes` by platform (and mesh) as a dict (None: one figure everywhere); a value
  that is neither bytes nor a mapping of known platforms, or platforms on a mesh
  ('cpu@data=2,tensor=2'), each named once, to bytes is refused."""
  if _bytes(bound):
    return None
  pairs = list(bound.items()) if isinstance(bound, Mapping) else bound
  ok = isinstance(pairs, (list, tuple)) and pairs and all(
      isinstance(p, tuple) and len(p) == 2 and _placement_key(p[0]) is not None and _bytes(p[1]) for p in pairs)
  if ok:
    pairs = [(_placement_key(k), v) for k, v in pairs]
  if not ok or len({p[0] for p in pairs}) != len(pairs):
    raise ValueError(f'KnownDifference max_temp_bytes: bytes (an int of at least 0) or a non-empty mapping'
                     f' of platforms {PLATFORMS}, or of a platform on a mesh (\'cpu@data=2,tensor=2\', where'
                     f' it is measured there), to bytes, got {bound!r}')
  return dict(pairs)


def temp_bytes_text(bound: int | tuple, extra: tuple[str, int] | None = None) -> str:
  """A `max_temp_bytes` as a user writes it (bytes, or a mapping by platform), `extra` set in it."""
  if not isinstance(bound, tuple):
    return str(bound)
  return repr(dict(bound + ((extra,) if extra else ())))


@dataclasses.dataclass(frozen=True)
class KnownDifference:
  """A difference proven inherent to the frameworks, for the module paths it names only.

  `paths`: checkpoint paths (or `prefix/*`) whose values may differ in
  `passes` (any of 'grads', 'train', 'eval'), each within `max_ulp` units in
  the last place; with 'forward', module paths where the localizer may find
  the forward divergence starting, within `max_ulp`; or, with 'program' in `passes`, the modules whose stock
  implementations lower differently: the canonical programs then differ
  by at most `max_changed_lines` lines, and not at all once the operations
  located in those modules are left out (what feeds the modules is still
  compared; parity.compare.programs `opaque_modules`;
  the NNX side names its module calls by their Linen paths, parity/compare/scopes.py,
  in an optional `lower_for_comparison(state, batch, dropout_base)` as
  StockNnx has; a side without it leaves nothing out). With 'memory' (beside
  'program': a lowering that differs may place its temporaries differently;
  or alone: the same program whose loop carries its values in another order,
  by which XLA lays out the loop's buffers), XLA's memory analysis of the
  train steps may differ in the temporaries, and so the peak, by at most
  `max_temp_bytes` each; the arguments, outputs and aliased bytes (the
  state) stay equal to the byte. Temporaries are the backend's: where a
  lowering that differs moves them on one backend and not on another,
  `max_temp_bytes` is a mapping by platform (`{'cpu': 256}`); on a platform
  it does not name, memory is not declared and must be equal to the byte.
  `reason` (the cause, with its evidence) goes into the report and every
  failure message. A pass name the battery does not know is an error.

  A value bound (any of `VALUE_PASSES`) is proven, never assumed: it needs
  `substitute`, a `make_sides(mesh)` whose sides have the declared difference
  removed (the NNX module given the Linen function, say); the battery's
  `substitution` part runs the pair with it and requires every value bit for
  bit, so the declared modules are the only source. Every bound must be
  tight (values, program lines and temporaries alike): at most `TIGHTNESS`
  times the largest difference measured under it, and something must differ. A pattern covering a whole collection
  (`params/*`, `*`) is not a module's and is refused.

  Or `substitute` is a stand-in the kit applies itself (parity/pairs/substitutes.py
  `IN_PLACE`: `parity.linen_attention`): then there is no bound (`max_ulp` 0). The kit
  gives every stock `nnx.MultiHeadAttention` of the NNX side's models Linen's formula
  in place, in every part, with no change to the model, and every value is compared
  bit for bit; `paths` must name exactly the modules given it (Linen module paths), and
  a declaration that cannot take effect fails every part saying why.
  """

  paths: tuple[str, ...]
  passes: tuple[str, ...]
  reason: str
  max_ulp: int = 0
  max_changed_lines: int = 0
  max_temp_bytes: int | Mapping[str, int] = 0
  substitute: Callable[[Any], Any] | None = dataclasses.field(default=None, compare=False)

  def __post_init__(self):
    for field in ('paths', 'passes'):
      value = getattr(self, field)
      if isinstance(value, str) or not value or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f'KnownDifference {field}: a non-empty tuple of strings, got {value!r}')
    unknown = [p for p in self.passes if p not in PASSES]
    if unknown:
      raise ValueError(f'KnownDifference passes {unknown}: not passes the battery knows {PASSES}')
    # A mapping is kept as sorted (platform, bytes) pairs, so that the declaration stays hashable
    # and compares by value (dataclasses.replace hands the pairs back).
    by_platform = _by_platform(self.max_temp_bytes)
    if by_platform is not None:
      object.__setattr__(self, 'max_temp_bytes', tuple(sorted(by_platform.items())))

  def temp_bytes(self, platform: str) -> int | None:
    """The bound on temporaries and peak on `platform` ('cpu', 'gpu', 'tpu'), or on a platform's
    mesh ('cpu@data=2,tensor=2', `placement`: its own entry, else the platform's): None where
    memory is not declared there (no 'memory' pass, or a mapping that names neither)."""
    if 'memory' not in self.passes:
      return None
    if isinstance(self.max_temp_bytes, tuple):
      bounds, key = dict(self.max_temp_bytes), _placement_key(platform) or platform
      return bounds.get(key, bounds.get(key.split('@', 1)[0]))
    return self.max_temp_bytes

  def describe(self) -> str:
    """The declaration as it reads in a failure: its paths, passes and substitute (or bound)."""
    from parity.pairs import substitutes

    if substitutes.in_place(self.substitute):
      extra = f', substitute=parity.{self.substitute.__name__}'
    else:
      extra = f', max_ulp={self.max_ulp}' if self.max_ulp else ''
    return f'KnownDifference({self.paths!r}, {self.passes!r}{extra})'

  @property
  def value_passes(self) -> tuple[str, ...]:
    return tuple(p for p in self.passes if p in VALUE_PASSES)

  def global_paths(self) -> list[str]:
    """Patterns that cover a whole collection rather than a module's paths."""
    return [p for p in self.paths if p in ('*', '/*') or (p.endswith('/*') and '/' not in p[:-2])]

  def refusals(self, pass_name: str, measured: int) -> list[str]:
    """Why this value bound is not accepted in `pass_name`, given the largest difference
    measured under it (ULP): global, unproven or loose. Empty: accepted."""
    from parity.pairs import substitutes

    out = []
    what = f'KnownDifference({self.paths}, {pass_name!r}, max_ulp={self.max_ulp})'
    if substitutes.in_place(self.substitute):  # applied in every part: compared bit for bit, no bound
      return [] if not self.max_ulp else [
          f'{what}: its substitute, parity.{self.substitute.__name__}, is given to the NNX model in every'
          ' part, where every value is compared bit for bit: declare no max_ulp']
    if self.global_paths():
      out.append(f'{what} covers a whole collection ({", ".join(self.global_paths())}): a global'
                 f' bound proves nothing; declare the modules whose implementations differ, each'
                 f' with its substitution (measured maximum here: {measured} ULP)')
    if self.substitute is None:
      out.append(f'{what} has no substitution: a value bound is accepted only with `substitute=`, a'
                 f' make_sides(mesh) with the difference removed (e.g. the NNX module given the Linen'
                 f' function), under which the battery requires every value bit for bit (measured'
                 f' maximum here: {measured} ULP; docs/howto-differences.md, "Declared differences")')
    if measured == 0:
      out.append(f'{what}: nothing differs under it (measured maximum 0 ULP): remove the declaration')
    elif self.max_ulp > TIGHTNESS * measured:
      out.append(f'{what} is loose: the measured maximum is {measured} ULP; declare max_ulp={measured}'
                 f' (a bound may be at most {TIGHTNESS} times what is measured)')
    return out

  def loose_structure(self, pass_name: str, measured: int | None, platform: str | None = None) -> str:
    """Why this program or memory bound (memory: `platform`'s, which it needs) is not accepted
    given what was measured under it (changed canonical lines, or the largest temporaries' or
    peak's difference in bytes; None: nothing differs there at all): vacuous or loose. '' when
    accepted, or where no memory bound is declared on `platform`."""
    if pass_name == 'program':
      field, unit, bound, shown = 'max_changed_lines', 'canonical lines', self.max_changed_lines, None
    else:
      if platform is None:
        raise ValueError('loose_structure: a memory bound is read for a platform; none given')
      field, unit, bound = 'max_temp_bytes', 'B of temporaries', self.temp_bytes(platform)
      if bound is None:
        return ''
      shown = temp_bytes_text(self.max_temp_bytes)
    what = f'KnownDifference({self.paths}, {pass_name!r}, {field}={bound if shown is None else shown})'
    by_platform = shown is not None and isinstance(self.max_temp_bytes, tuple)
    if measured is None:
      if by_platform and len(self.max_temp_bytes) > 1:
        return (f'{what}: nothing differs under it on {platform} (the memory is the same on both sides):'
                f' remove {platform!r} from max_temp_bytes')
      return (f'{what}: nothing differs under it (the {pass_name} is the same on both sides):'
              f" remove {pass_name!r} from its passes" + (' and max_temp_bytes' if by_platform else ''))
    if bound > TIGHTNESS * measured:
      suggested = temp_bytes_text(self.max_temp_bytes, (platform, measured)) if by_platform else measured
      return (f'{what} is loose: the measured figure is {measured} {unit}; declare {field}={suggested}'
              f' (a bound may be at most {TIGHTNESS} times what is measured)')
    return ''

  def admits_program(self, diff: Any, outside: Any) -> bool:
    """The rule for a declared program difference, one place for the battery and the runner:
    `diff` (parity.compare.programs.ProgramDiff of the two train steps) within `max_changed_lines`
    and `outside` (the same with the declared modules' operations left out) identical."""
    return ('program' in self.passes and diff.changed_lines <= self.max_changed_lines
            and outside is not None and outside.identical)

  def covers(self, path: str, pass_name: str) -> bool:
    if pass_name not in self.passes:
      return False
    return any(path == p or (p.endswith('/*') and path.startswith(p[:-1])) for p in self.paths)


@dataclasses.dataclass(frozen=True)
class Decode:
  """What the decode part runs: `steps` tokens after `prompt(batch)` (from a batch of the
  pair's 'eval' split) at each of `temperatures` (0: greedy), one device and each mesh."""

  prompt: Callable[[Mapping[str, Any]], Any]
  steps: int = 8
  temperatures: tuple[float, ...] = (0.0, 0.8)

  def __post_init__(self):
    # No token, or no temperature, would compare no decoding at all, and pass.
    if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
      raise ValueError(f'Decode steps: a whole number of tokens to decode, 1 or more, got {self.steps!r}')
    if (isinstance(self.temperatures, (str, bytes)) or not isinstance(self.temperatures, (tuple, list))
        or not self.temperatures):
      raise ValueError('Decode temperatures: a tuple of one or more temperatures (0.0: greedy),'
                       f' got {self.temperatures!r}')


@dataclasses.dataclass(frozen=True, eq=False)
class Pair:
  """The two sides of one migration, and what to train them on.

  `make_sides(mesh)` returns `(linen side, nnx side)` placed on `mesh` (None:
  one device); `batch(step, split)` gives a batch of numpy (or jax) arrays for
  'train' or 'eval'. `meshes` are the mesh specs ('data=8', ...) the
  sharded part runs on (the kit's axes `data`, `fsdp`, `tensor` and any of the model's own,
  parity.core.specs.parse_mesh_spec; all of one size; `mesh_factory` lays them out the model's way). `steps` is the length of the training runs.
  `rules`: the logical axis rules of the model's parameters and activation
  constraints; on each mesh every parameter must sit where the rules put
  its logical axes (the sides shard by them: parity/pairs/stock/ takes `rules=`).
  """

  name: str
  make_sides: Callable[[jax.sharding.Mesh | None], tuple[Side, Side]]
  batch: Callable[[int, str], Mapping[str, Any]]
  steps: int = 4
  meshes: Sequence[str] = ('data=8',)
  known_differences: tuple[KnownDifference, ...] = ()
  seed: int = 0
  parts: Sequence[str] | None = None  # the battery's parts for this pair (None: all)
  group: str | None = None  # xdist group of its tests (default: parity-<name>)
  # The logical axis rules the model's annotations are written against
  # (`nn.with_logical_partitioning`, `nn.with_logical_constraint` names); None:
  # the Linen side's `rules` if it has them, else, for activation constraints,
  # the decoder's (parity.core.specs.DEFAULT_RULES), and for parameters none (replicated).
  rules: Sequence[tuple[str, Any]] | None = None
  # True: the model resolves its activations' logical names to mesh axes itself (or constrains
  # with mesh axes), so its constraints carry no logical name; the specs part then compares the
  # physical specs they resolve to on each mesh instead of failing as having nothing to compare.
  activations_resolved: bool = False
  # Decoding with a KV cache, compared bit for bit by the decode part (each side's `decode`).
  decode: Decode | None = None
  # mesh_factory(spec, devices) -> the model's own jax Mesh for a spec of `meshes` (its axis
  # names, order and shape, over `devices`); None: parity.core.specs.make_mesh.
  mesh_factory: Callable[[str, Sequence[Any]], jax.sharding.Mesh] | None = None
  # The tree each side's own save code hands Orbax, where it is not the side's state as it is:
  # role ('linen', 'nnx') -> a function of what that side's `create` returns (for instance an NNX
  # state saved in the Linen layout plus an `nnx_aux` subtree). Checkpoint conversion writes it and
  # reads it, the convert part saves with it (docs/howto-checkpoints.md).
  saves: Mapping[str, Callable[[Any], Any]] | None = None
  # What `parity compare`'s report says of the model beyond what it measures: `facts()` returns a
  # mapping with any of REPORT_FACTS (the reference decoder's: bridge/reference.py `pair`).
  facts: Callable[[], Mapping[str, Any]] | None = None

  def mesh(self, spec: str) -> jax.sharding.Mesh:
    """The mesh of one of the pair's mesh specs, over every device: the pair's own factory's."""
    from parity.core import specs

    devices = jax.devices()
    if self.mesh_factory is None:
      return specs.make_mesh(spec, devices)
    specs.parse_mesh_spec(spec, len(devices))  # a spec that does not fit fails as for the kit's
    mesh = self.mesh_factory(spec, devices)
    if not isinstance(mesh, jax.sharding.Mesh) or mesh.devices.size != len(devices):
      raise SideError(f'{self.name}: mesh_factory({spec!r}, devices) must return a jax Mesh over the'
                      f' {len(devices)} devices, got {mesh!r}')
    return mesh

  def __post_init__(self):
    # Zero steps would compare no training at all, and pass.
    if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
      raise ValueError(f'Pair {self.name!r} steps: a whole number of train steps, 1 or more, got {self.steps!r}')
    # A string would be taken as its characters, each a mesh spec.
    if isinstance(self.meshes, str) or not all(isinstance(m, str) and m for m in self.meshes):
      raise ValueError(f"Pair {self.name!r} meshes: a sequence of mesh specs such as ('data=8',), got {self.meshes!r}")
    # The program and memory parts read one declaration: a second would be left unread.
    steps = [d for d in self.known_differences if {'program', 'memory'} & set(d.passes)]
    if len(steps) > 1:
      raise ValueError(
          f"Pair {self.name!r} known_differences: {len(steps)} declarations of the steps' program or memory"
          f" ({'; '.join(f'{d.paths}, {d.passes}' for d in steps)}), where the battery reads one: declare"
          " them as one KnownDifference, with the paths of both, the passes of both and the bounds of both"
          " (max_changed_lines, max_temp_bytes)")

  def program_difference(self) -> KnownDifference | None:
    """The declared difference of the steps' programs or memory (None: none declared)."""
    return next((d for d in self.known_differences if {'program', 'memory'} & set(d.passes)), None)

  def known(self, path: str, pass_name: str) -> KnownDifference | None:
    for d in self.known_differences:
      if d.covers(path, pass_name):
        return d
    return None


class SideError(TypeError):
  """A side that does not implement `Side`, or a step returning what `Side` does not say.

  A user error: the message names the side, the member and what `Side` asks.
  """


def side_members() -> list[str]:
  """The attributes and methods `Side` declares."""
  return list(Side.__annotations__) + [
      k for k, v in vars(Side).items() if callable(v) and not k.startswith('_')]


# Only the localizer calls `probe`: a side without it runs every other part (the
# localize part fails naming it, and failures carry no localizer finding). Without
# `eval_outputs` the eval part compares the metrics alone, and says so.
OPTIONAL_MEMBERS = ('probe', 'eval_outputs', 'eval_calls', 'decode', 'decode_calls', 'lower_decode_step')


def make_pair_sides(pair: 'Pair', mesh: jax.sharding.Mesh | None) -> tuple[Side, Side]:
  """`pair.make_sides(mesh)`, checked: two sides, each with every member of `Side` but the optional.

  An NNX side that infers its module correspondences (`adopt_correspondence`,
  as `StockNnx` does) gets them from the Linen side, once per pair. A declared
  difference whose `substitute` is a stand-in the kit applies in place
  (`parity.linen_attention`) is given to the NNX side first (`adopt_substitutes`), and
  must take effect: every module it is given to declared, every declared module given it.
  """
  sides = pair.make_sides(mesh)
  if not isinstance(sides, (tuple, list)) or len(sides) != 2:
    raise SideError(f'{pair.name}: make_sides(mesh) returned {type(sides).__name__}, not (linen side, nnx side)')
  for role, side in zip(('Linen', 'NNX'), sides):
    missing = [m for m in side_members() if m not in OPTIONAL_MEMBERS and not hasattr(side, m)]
    if missing:
      raise SideError(
          f'{pair.name}: the {role} side ({type(side).__name__}) lacks {", ".join(missing)} of'
          ' parity.pairs.adapter.Side (each one\'s docstring says what it takes and returns; parity.pairs.stock'
          ' implements them for flax\'s stock train states)')
  linen, nnx_side = sides
  in_place = _in_place_substitutions(pair, nnx_side)
  if hasattr(linen, 'adopt_into'):  # a record standing for the deleted Linen side (parity/records/side.py)
    linen.attach(nnx_side)
    linen.adopt_into(nnx_side)
    if in_place:
      _check_substitutions(pair, nnx_side, in_place)
    return linen, nnx_side
  if getattr(nnx_side, 'infer_renames', False) is True and hasattr(nnx_side, 'adopt_correspondence'):
    found = _correspondence(pair, linen, nnx_side)
    if found is not None:
      nnx_side.adopt_correspondence(found)
  if hasattr(nnx_side, 'adopt_linen_draws'):
    from parity.core import rng

    nnx_side.adopt_linen_draws(linen, pair.batch(0, 'train'), rng.first_step_key(pair.seed))
  if in_place:
    _check_substitutions(pair, nnx_side, in_place)
  return linen, nnx_side


def _in_place_substitutions(pair: 'Pair', nnx_side: Any) -> tuple[KnownDifference, ...]:
  """The pair's declarations whose stand-in the kit applies in place, given to the NNX side
  (before it makes any model); a SideError where that side cannot take them."""
  from parity.pairs import substitutes

  declared = tuple(d for d in pair.known_differences if substitutes.in_place(d.substitute))
  if not declared:
    return ()
  if not hasattr(nnx_side, 'adopt_substitutes'):
    raise SideError(
        f'{pair.name}: {declared[0].describe()} cannot take effect: its stand-in is given in place to the'
        f' models a parity.StockNnx makes, and the NNX side ({type(nnx_side).__name__}) makes its own (no'
        ' adopt_substitutes), so every part would compare the stock formula. Give its'
        f' {substitutes.IN_PLACE[declared[0].substitute][0].__name__} modules'
        f' {substitutes.IN_PLACE[declared[0].substitute][1]}=parity.{declared[0].substitute.__name__} in'
        ' that side\'s create and remove the declaration, or build the side as a parity.StockNnx'
        ' (docs/howto-differences.md, "Stock attention")')
  nnx_side.adopt_substitutes(tuple(dict.fromkeys(d.substitute for d in declared)))
  return declared


def _check_substitutions(pair: 'Pair', nnx_side: Any, declared: tuple[KnownDifference, ...]) -> None:
  """Each in-place declaration took effect: the modules given its stand-in are exactly those it
  names (by Linen module path); a SideError naming what differs otherwise."""
  from parity.pairs import substitutes

  found = nnx_side.substituted_modules()
  problems = []
  for stand_in in dict.fromkeys(d.substitute for d in declared):
    cls, attribute, _ = substitutes.IN_PLACE[stand_in]
    what = f'{stand_in.__name__} ({cls.__name__} {attribute})'
    given = [p for p, state in found[stand_in.__name__].items() if state == 'substituted']
    named = [p for d in declared if d.substitute is stand_in for p in d.paths]
    for d in declared:
      if d.substitute is not stand_in:
        continue
      missing = [p for p in d.paths if p not in given]
      if not given:
        problems.append(
            f'{d.describe()} cannot take effect: its stand-in was given to no module, as the NNX model has'
            f' no {cls.__name__} with flax\'s default {attribute}'
            + (f' (its {cls.__name__} modules: {_states(found[stand_in.__name__])})' if found[stand_in.__name__]
               else f' (it has no {cls.__name__})') + ': remove the declaration')
      elif missing:
        problems.append(
            f'{d.describe()} names {", ".join(missing)}, where the kit gave no module {what}: the modules'
            f' given it are {", ".join(given)} (Linen paths); name those')
    undeclared = [p for p in given if p not in named]
    if undeclared:
      problems.append(
          f'the kit gives {what} to every stock {cls.__name__} of the NNX model, and {", ".join(undeclared)}'
          f' {"is" if len(undeclared) == 1 else "are"} declared by none: add them to the declaration\'s paths')
  if problems:
    raise SideError(f'{pair.name}: a declared substitution does not take effect as declared:\n  '
                    + '\n  '.join(problems) + '\n(docs/howto-differences.md, "Stock attention")')


def _states(found: Mapping[str, str]) -> str:
  """Each module of `substituted_modules` with what its model gives it (all but the kit's stand-in)."""
  return ', '.join(f'{p or "the model itself"}: {s if s == "stock" else s + ", given by the model"}'
                   for p, s in found.items())


# The inferred correspondence of each pair (by identity), computed once per process.
_CORRESPONDENCES: dict[int, Any] = {}


def _correspondence(pair: 'Pair', linen: Side, nnx_side: Any) -> Any:
  """The pair's inferred correspondence (None: the sides cannot infer one), once per process."""
  from parity.core import rng

  cached = _CORRESPONDENCES.get(id(pair))
  if cached is None or cached[0] is not pair:
    key = rng.first_step_key(pair.seed)
    cached = (pair, nnx_side.correspondence(linen, pair.batch(0, 'train'), key))
    _CORRESPONDENCES[id(pair)] = cached
  return cached[1]


def checked_metrics(pair_name: str, side: Side, step: str, metrics: Any, need_loss: bool) -> dict[str, Any]:
  """A step's metrics as a dict, or a SideError saying what `Side` asks of them."""
  if not isinstance(metrics, Mapping):
    what = paths.describe(metrics) if hasattr(metrics, 'dtype') else type(metrics).__name__
    raise SideError(f'{pair_name}: the {side.name} side\'s {step} returned {what},'
                    ' not a mapping of metric names to arrays')
  if need_loss and 'loss' not in metrics:
    raise SideError(f'{pair_name}: the {side.name} side\'s {step} returned metrics {sorted(metrics)}'
                    ' without `loss` (Side.train_step: metrics with at least `loss`)')
  return dict(metrics)


def check_structure(name: str, linen: Side, nnx_side: Side) -> None:
  """Raises the bridge's TreeMismatchError naming every path where the two sides' states
  differ in the checkpoint layout (a path on one side only, another shape or dtype)."""
  paths.check_leaves(
      f'{name}: NNX state vs Linen state (checkpoint layout)',
      linen.abstract_checkpoint(), nnx_side.abstract_checkpoint(),
  )


def step_argument_names(
    lowered: jax.stages.Lowered, state: Any, batch: Mapping[str, Any],
    checkpoint_leaves: Callable[[Any], dict[str, Any]],
) -> list[str]:
  """A name per argument of a lowered `step(state, batch, dropout_base)`'s `@main`.

  A state leaf is named by its checkpoint path (`checkpoint_leaves` maps a
  tree shaped like the state to `{checkpoint path: leaf}`), a batch entry
  `batch/<key>`, the key `dropout_base`; arguments jit dropped as unused have
  no entry. Both sides name the same argument alike, whatever their order.
  """
  leaves, treedef = jax.tree.flatten(state)
  index_tree = jax.tree.unflatten(treedef, list(range(len(leaves))))
  names = [''] * len(leaves)
  for path, index in checkpoint_leaves(index_tree).items():
    names[index] = path
  names += [f'batch/{key}' for key in sorted(batch)] + ['dropout_base']
  return [names[i] for i in compat.kept_argument_indices(lowered, len(names))]


def abstract_state(side: Side) -> Any:
  """The side's state as shapes alone: its `template` (the stock and reference sides have one)."""
  template = getattr(side, 'template', None)
  if template is None:
    raise ValueError(f'the {side.name} side ({type(side).__name__}) has no `template`, its state\'s shapes: record'
                     ' it with a part that runs (init, grads, train), which starts from its values')
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), template)

