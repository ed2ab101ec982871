"""linen-nnx-parity: prove that a Flax NNX port is the same program as its Linen original.

Everything a user's test needs is here, under one import:

    import parity

    my_model = parity.Pair('my_model', make_sides, batch)

A test module that declares a `Pair` at module level gets the equivalence
battery from the pytest plugin (`parity.battery.plugin`, installed as a
`pytest11` entry point). The names below are the public API; the
subpackages (`core`, `pairs`, `battery`, `compare`, `store`, `records`, `run`,
`procs`, `env`) hold their implementation, grouped by job, and may change.

Names resolve on first use (PEP 562), so `import parity` imports no jax: the
plugin loads before a project's conftest sets jax's flags.
"""
from __future__ import annotations

import importlib
from typing import Any

# public name -> (module, attribute)
_EXPORTS = {
    # declaring a pair
    'Pair': ('parity.pairs.adapter', 'Pair'),
    'Side': ('parity.pairs.adapter', 'Side'),
    'KnownDifference': ('parity.pairs.adapter', 'KnownDifference'),
    'Decode': ('parity.pairs.adapter', 'Decode'),
    'Probe': ('parity.pairs.adapter', 'Probe'),
    'BatchError': ('parity.pairs.adapter', 'BatchError'),
    'SideError': ('parity.pairs.adapter', 'SideError'),
    'StockLinen': ('parity.pairs.stock', 'StockLinen'),
    'StockNnx': ('parity.pairs.stock', 'StockNnx'),
    'Renames': ('parity.pairs.stock_layout', 'Renames'),
    # model-level pairs: the kit writes both sides' create, train, eval, forward and decode
    'model_pair': ('parity.pairs.model_level', 'model_pair'),
    'per_mesh': ('parity.pairs.model_level', 'per_mesh'),
    'linen_side': ('parity.pairs.model_level', 'linen_side'),
    'nnx_side': ('parity.pairs.model_level', 'nnx_side'),
    # how a model switches between train and eval mode: a keyword at the call, or an attribute
    'Attribute': ('parity.pairs.modes', 'Attribute'),
    'Modes': ('parity.pairs.modes', 'Modes'),
    # decoding with a KV cache: the token loop, and decode functions for flax's cache convention
    'draw_tokens': ('parity.pairs.decoding', 'draw_tokens'),
    'decode_loop': ('parity.pairs.decoding', 'decode_loop'),
    'linen_decoder': ('parity.pairs.decoding', 'linen_decoder'),
    'nnx_decoder': ('parity.pairs.decoding', 'nnx_decoder'),
    'PARTS': ('parity.battery.parts', 'PARTS'),
    'DIRECTIONS': ('parity.battery.parts', 'DIRECTIONS'),
    # a stock NNX layer computing as its Linen counterpart, for a declared difference's substitute
    'linen_attention': ('parity.pairs.substitutes', 'linen_attention'),
    # dropout keys both sides derive alike
    'base_key': ('parity.core.rng', 'base_key'),
    'step_key': ('parity.core.rng', 'step_key'),
    # comparing trees, bit for bit
    'assert_bitwise_equal': ('parity.core.bitwise', 'assert_bitwise_equal'),
    'bitwise_equal': ('parity.core.bitwise', 'bitwise_equal'),
    'compare_trees': ('parity.core.bitwise', 'compare_trees'),
    'max_ulp': ('parity.core.bitwise', 'max_ulp'),
    'flatten': ('parity.core.paths', 'flatten'),
    'TreeMismatchError': ('parity.core.errors', 'TreeMismatchError'),
    # the localizer's probes, for a side that overrides `probe`
    'linen_probe': ('parity.compare.localize', 'linen_probe'),
    'nnx_probe': ('parity.compare.localize', 'nnx_probe'),
    # sharding specs and meshes
    'make_mesh': ('parity.core.specs', 'make_mesh'),
    'DEFAULT_RULES': ('parity.core.specs', 'DEFAULT_RULES'),
    # a pair's own checkpoints: converted between its sides, compared, or saved in the other's layout
    'convert_checkpoint': ('parity.store.pair_convert', 'convert_checkpoint'),
    'compare_checkpoints': ('parity.store.pair_convert', 'compare_checkpoints'),
    'to_linen_layout': ('parity.store.pair_convert', 'to_linen_layout'),
    'to_nnx_layout': ('parity.store.pair_convert', 'to_nnx_layout'),
    # after Linen: a record of the Linen side's results, standing for it once it is deleted
    'record': ('parity.records.writing', 'record'),
    'recorded': ('parity.records.side', 'recorded'),
    'RecordError': ('parity.records.files', 'RecordError'),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
  try:
    module, attribute = _EXPORTS[name]
  except KeyError:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}') from None
  value = getattr(importlib.import_module(module), attribute)
  globals()[name] = value  # resolved once
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(__all__))
