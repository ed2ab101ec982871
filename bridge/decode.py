"""Decoding caches, Linen <-> one flat layout, so the two sides' caches compare bit for bit.

The layout is Linen's: `cache/<module path>/<name>`, the path of each array
in the variables' 'cache' collection, e.g.
`cache/decoder/layers/self_attention/cached_key`. The NNX cache (the model's
`nnx.Cache` variables) has the same module paths without the collection, so
the NNX side gains the `cache/` prefix. Both sides stack a scanned model's
cache on axis 0 with the logical axis 'layers' there (models/*/decoder.py
CACHE_SCAN_AXIS), so no array axis moves.

Pure and strict: a path that is not a cache array raises TreeMismatchError.
"""
from __future__ import annotations

from typing import Any, Mapping

from flax import nnx
from flax.core import meta

from parity.core import compat, paths
from parity.core.errors import Problem, TreeMismatchError

PREFIX = 'cache/'
NAMES = ('cached_key', 'cached_value', 'cache_index')

# Where the cache's logical axes go on a mesh, appended to a side's rules (parity.core.specs
# DEFAULT_RULES): its rows split like the batch, its kv heads like the key and value kernels'.
CACHE_RULES = (
    ('cache_batch', ('data', 'fsdp')),
    ('cache_length', None),
    ('cache_kv_heads', 'tensor'),
    ('cache_kv_head_dim', None),
)


def linen_cache(flat: Mapping[str, Any]) -> dict[str, Any]:
  """A Linen decode's flat cache (`{'cache/...': leaf}`) in the common layout: as it is, checked."""
  _check('Linen cache', {p: p for p in flat})
  return dict(flat)


def nnx_cache(flat: Mapping[str, Any]) -> dict[str, Any]:
  """An NNX decode's flat cache (`{'<module path>/<name>': leaf}`) in the common layout."""
  out = {PREFIX + p: x for p, x in flat.items()}
  _check('NNX cache', {PREFIX + p: p for p in flat})
  return out


def linen_cache_specs(abstract_cache: Any) -> dict[str, tuple | None]:
  """`{path: logical axes}` of a boxed Linen cache collection (None: not annotated)."""
  leaves = paths.items({'cache': abstract_cache}, lambda x: isinstance(x, meta.AxisMetadata))
  return linen_cache({p: tuple(x.names) if isinstance(x, meta.Partitioned) else None for p, x in leaves})


def nnx_cache_specs(abstract_cache: nnx.State) -> dict[str, tuple | None]:
  """`{path: logical axes}` of an NNX cache State (None: not annotated)."""
  leaves = paths.items(abstract_cache, lambda x: isinstance(x, nnx.Variable))
  return nnx_cache({p: compat.nnx_logical_axes(v) for p, v in leaves})


def _check(what: str, origin: Mapping[str, str]) -> None:
  problems = [
      Problem(source, 'path', f'{PREFIX}<module path>/<one of {", ".join(NAMES)}>', path)
      for path, source in origin.items()
      if not path.startswith(PREFIX) or path.rsplit('/', 1)[-1] not in NAMES
  ]
  if problems:
    raise TreeMismatchError(f'{what}: not a decoding cache', problems)

