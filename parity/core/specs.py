"""Logical and physical sharding specs of both sides, and mesh specs.

Logical specs are read from either side as `{param path: tuple of logical
names}`. Physical specs come from one rule set kept as data (`DEFAULT_RULES`,
user-replaceable) through flax's own resolution
(`flax.linen.logical_to_mesh_axes`: rules in priority order, a mesh axis used
at most once per array, unmatched names unsharded). Printed physical specs
drop mesh axes of size 1, as the seed logs do.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
from flax import nnx

from parity.core import paths
from parity.core.errors import Problem, TreeMismatchError
from parity.core import compat

MESH_AXES = ('data', 'fsdp', 'tensor')

Rules = tuple[tuple[str, Any], ...]

DEFAULT_RULES: Rules = (
    # parameters
    ('embed', 'fsdp'),
    ('embed_vocab', 'fsdp'),
    ('vocab', 'tensor'),
    ('heads', 'tensor'),
    ('q_heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('mlp', 'tensor'),
    ('norm', 'tensor'),
    ('kv', None),
    ('kv_head_dim', None),
    ('layers', None),
    # activations
    ('activation_batch', ('data', 'fsdp')),
    ('activation_kv_batch', ('data', 'fsdp')),
    ('activation_embed_and_logits_batch', ('data', 'fsdp')),
    ('activation_length', None),
    ('activation_norm_length', None),
    ('activation_attn_length', None),
    ('activation_embed', 'tensor'),
    ('activation_attn_embed', 'tensor'),
    ('activation_heads', 'tensor'),
    ('activation_kv_heads', 'tensor'),
    ('activation_kv', None),
    ('activation_kv_head_dim', None),
    ('activation_mlp', 'tensor'),
    ('activation_vocab', 'tensor'),
)

LogicalSpecs = dict[str, tuple[str | None, ...]]


def linen_logical_specs(boxed_variables: Any) -> LogicalSpecs:
  """`{param path: logical names}` from Linen variables as returned by `init` (boxed)."""
  specs = nn.get_partition_spec(boxed_variables)
  flat = paths.items(specs, lambda x: isinstance(x, jax.sharding.PartitionSpec))
  return {p[len('params/'):]: tuple(s) for p, s in flat if p.startswith('params/')}


def nnx_logical_specs(nnx_params: Any) -> LogicalSpecs:
  """`{param path: logical names}` from an NNX params state (Variables with metadata)."""
  flat = paths.items(nnx_params, lambda x: isinstance(x, nnx.Variable))
  return {p: compat.nnx_logical_axes(v) or () for p, v in flat}


def parse_mesh_spec(spec: str, num_devices: int | None = None) -> dict[str, int]:
  """'fsdp=4,tensor=2' -> {'data': 1, 'fsdp': 4, 'tensor': 2}; checks the device count.

  The kit's axes (`MESH_AXES`) are always there (size 1 unless given); any
  other axis a model's own mesh has ('stage=1,sequence=2') follows them, in
  the order given (a pair's `mesh_factory` lays out its own mesh instead).
  """
  sizes = dict.fromkeys(MESH_AXES, 1)
  seen = set()
  for part in filter(None, (p.strip() for p in spec.split(','))):
    name, sep, value = part.partition('=')
    name = name.strip()
    if not sep or not name.isidentifier() or not value.strip().isdigit() or int(value) < 1:
      raise ValueError(
          f'bad mesh spec {spec!r}: expected AXIS=N[,AXIS=N...] with AXIS a name'
          f' (the kit\'s: {", ".join(MESH_AXES)}; or any of the model\'s own) and N >= 1, got {part!r}'
      )
    if name in seen:
      raise ValueError(f'bad mesh spec {spec!r}: axis {name!r} given twice')
    seen.add(name)
    sizes[name] = int(value)
  if num_devices is not None:
    product = 1
    for size in sizes.values():
      product *= size
    if product != num_devices:
      raise ValueError(
          f'mesh {spec!r} needs {product} devices, but {num_devices} are available'
      )
  return sizes


def make_mesh(spec: str, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """A mesh over all (or the given) devices with the spec's axes (`parse_mesh_spec`)."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = parse_mesh_spec(spec, len(devices))
  return compat.make_mesh(tuple(sizes.values()), tuple(sizes), devices)


def physical_spec(
    logical: Sequence[str | None], rules: Rules, mesh_sizes: Mapping[str, int]
) -> tuple[Any, ...]:
  """Mesh axes per array axis; mesh axes of size 1 dropped (printed form)."""
  spec = nn.logical_to_mesh_axes(tuple(logical), list(rules))
  return printed_spec(spec, mesh_sizes, len(logical))


def printed_spec(
    spec: Sequence[Any], mesh_sizes: Mapping[str, int], ndim: int
) -> tuple[Any, ...]:
  """A partition spec in the tables' form: mesh axes of size 1 dropped, one entry per array axis."""
  entries = tuple(_drop_unit_axes(entry, mesh_sizes) for entry in spec)
  return entries + (None,) * (ndim - len(entries))


def _drop_unit_axes(entry: Any, mesh_sizes: Mapping[str, int]) -> Any:
  if entry is None:
    return None
  axes = (entry,) if isinstance(entry, str) else tuple(entry)
  kept = tuple(a for a in axes if mesh_sizes.get(a, 1) > 1)
  if not kept:
    return None
  return kept[0] if len(kept) == 1 else kept


def physical_specs(
    logical: Mapping[str, Sequence[str | None]], rules: Rules, mesh_sizes: Mapping[str, int]
) -> dict[str, tuple[Any, ...]]:
  return {p: physical_spec(names, rules, mesh_sizes) for p, names in logical.items()}


def spec_drift(
    linen: Mapping[str, Sequence[Any]], nnx_specs: Mapping[str, Sequence[Any]], what: str
) -> list[Problem]:
  """Every parameter whose spec differs between the sides, with both values."""
  problems = []
  for path in sorted(set(linen) | set(nnx_specs)):
    a, b = linen.get(path), nnx_specs.get(path)
    if a is None or b is None or tuple(a) != tuple(b):
      problems.append(
          Problem(path, what, f'{tuple(a) if a is not None else None} (Linen)',
                  f'{tuple(b) if b is not None else None} (NNX)')
      )
  return problems


def check_no_drift(linen: Mapping[str, Any], nnx_specs: Mapping[str, Any], what: str) -> None:
  """Raises TreeMismatchError listing every parameter whose `what` spec differs."""
  problems = spec_drift(linen, nnx_specs, what)
  if problems:
    raise TreeMismatchError(f'{what} specs differ between Linen and NNX', problems)


def describe_sharding(sharding: Any) -> str:
  """A NamedSharding as `P('fsdp', None) on data=2,fsdp=2,tensor=2`; others by repr.

  Trailing unsharded dimensions are spelled out (`P()` and `P(None)` mean the
  same placement but print differently), so the shape's rank is in the text.
  """
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return repr(sharding)
  mesh = ','.join(f'{name}={size}' for name, size in sharding.mesh.shape.items())
  entries = ', '.join(repr(e) if e is not None else 'None' for e in sharding.spec)
  return f'P({entries}) on {mesh}'


def _normalised_entries(sharding: Any, ndim: int) -> Any:
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return sharding
  spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
  axes = tuple((e,) if isinstance(e, str) else tuple(e or ()) for e in spec)
  return (tuple(sharding.mesh.shape.items()), sharding.mesh.devices.tolist(), axes)


def sharding_drift(
    linen: Mapping[str, Any], nnx_shardings: Mapping[str, Any], ndims: Mapping[str, int]
) -> list[Problem]:
  """Every path whose sharding (mesh, devices, partition spec) differs between the sides.

  `ndims` gives each path's rank, so `P('fsdp')` and `P('fsdp', None)` of a
  2-D array compare equal (they place the array identically).
  """
  problems = []
  for path in sorted(set(linen) | set(nnx_shardings)):
    a, b = linen.get(path), nnx_shardings.get(path)
    ndim = ndims.get(path, 0)
    if a is None or b is None or _normalised_entries(a, ndim) != _normalised_entries(b, ndim):
      texts = [describe_sharding(x) if x is not None else 'None' for x in (a, b)]
      named = all(isinstance(x, jax.sharding.NamedSharding) for x in (a, b))
      if named and texts[0] == texts[1]:  # same mesh shape and spec: the devices differ
        texts = [f'{t} (devices {x.mesh.device_ids.ravel().tolist()})' for t, x in zip(texts, (a, b))]
      problems.append(Problem(path, 'sharding', f'{texts[0]} (Linen)', f'{texts[1]} (NNX)'))
  return problems


def check_same_shardings(
    linen: Mapping[str, Any], nnx_shardings: Mapping[str, Any], ndims: Mapping[str, int]
) -> None:
  """Raises TreeMismatchError naming every path whose sharding differs, with both values."""
  problems = sharding_drift(linen, nnx_shardings, ndims)
  if problems:
    raise TreeMismatchError('shardings differ between Linen and NNX', problems)


def format_names(names) -> str:
  """('embed','layers','mlp') in the style of the seed logs' parameter table."""
  def one(n):
    if n is None:
      return 'None'
    if isinstance(n, str):
      return repr(n)
    return '(' + ','.join(repr(x) for x in n) + ')'
  return '(' + ','.join(one(n) for n in names) + (',)' if len(names) == 1 else ')')


CONVENTIONS = ('logical names', 'mesh axes', 'none', 'mixed')


def _names(spec: Sequence[Any]) -> set[str]:
  out = set()
  for entry in spec:
    for name in entry if isinstance(entry, (tuple, list)) else (entry,):
      if name is not None:
        out.add(name)
  return out


def convention(specs: Mapping[str, Sequence[Any]], rules: Rules, mesh_axes: Sequence[str]) -> str:
  """How a side annotates its parameters: with the rules' logical names, with mesh axes
  already resolved, not at all ('none': every entry None), or a mix of the two."""
  names = set().union(*(_names(s) for s in specs.values())) if specs else set()
  if not names:
    return 'none'
  logical = {r[0] for r in rules}
  if names <= logical:
    return 'logical names'
  if names <= set(mesh_axes):
    return 'mesh axes'
  return 'mixed'


def placement(spec: Sequence[Any], kind: str, rules: Rules, mesh_sizes: Mapping[str, int]) -> tuple[Any, ...]:
  """Where a parameter annotated in convention `kind` sits on a mesh (printed form)."""
  if kind == 'mesh axes':
    return printed_spec(spec, mesh_sizes, len(spec))
  return physical_spec(spec, rules, mesh_sizes)


def placement_drift(
    linen: Mapping[str, Sequence[Any]], nnx_specs: Mapping[str, Sequence[Any]], kinds: tuple[str, str],
    rules: Rules, meshes: Mapping[str, Mapping[str, int]],
) -> list[Problem]:
  """Every parameter placed otherwise by the two sides' annotations on one of `meshes`, each
  side read in its own convention (`kinds`); the paths must be the same on both sides."""
  problems = []
  for spec_name, sizes in meshes.items():
    for path in sorted(linen):
      a = placement(linen[path], kinds[0], rules, sizes)
      b = placement(nnx_specs[path], kinds[1], rules, sizes)
      if a != b:
        problems.append(Problem(path, f'placement on {spec_name}', f'{a} (Linen {tuple(linen[path])})',
                                f'{b} (NNX {tuple(nnx_specs[path])})'))
  return problems
