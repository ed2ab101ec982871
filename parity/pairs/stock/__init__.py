"""Sides for stock flax train states: the adapter a user's migration needs no code for.

`StockLinen` drives a `flax.training.train_state.TrainState` (extra
collection fields such as `batch_stats` included); `StockNnx` drives the
stateful NNX idiom: a `(model, nnx.Optimizer)` pair and a step that updates
them in place. The user passes their own functions (state creation, train
and eval steps, train-mode loss); these classes only adapt calling
conventions (the NNX objects are split into a graphdef and a pure state
once, and merged inside each compiled call) and map states to the
checkpoint layout through parity/pairs/stock_layout.py.

On a mesh each batch is split along its first axis over the side's
`batch_axis` (default `data`). The state is replicated (data parallel), unless the side is given
logical axis `rules`: then every state leaf whose parameter carries logical
axis names (Linen `nn.with_logical_partitioning`, NNX `out_sharding`
metadata; optimizer moments inherit them on both sides) is sharded as the
rules resolve them, in each framework's own idiom (`nn.get_partition_spec`,
`nnx.get_partition_spec`), and the steps are traced under the mesh and the
rules, so `nn.with_logical_constraint` on activations applies too.

A module per side (`linen_side`, `nnx_side`) over what they share (`common`); this package
re-exports them as the one module did."""
from __future__ import annotations

from parity.pairs.stock.common import (  # noqa: F401
    named,
    _INITIALISERS,
    _Stock,
    _decoded,
    _on_device,
    _one_program,
    _replicated,
    _via_host,
)
from parity.pairs.stock.linen_side import (  # noqa: F401
    StockLinen,
)
from parity.pairs.stock.nnx_side import (  # noqa: F401
    StockNnx,
)
