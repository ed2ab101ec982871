"""A declared pair's own checkpoints: converted between its two sides, and compared.

A user's training code saves its own state with Orbax, not the kit's layout
(parity/store/checkpoints.py). Four trees are recognised, each as Orbax
writes it (`ocp.StandardCheckpointer().save(path, tree)`, or an item of a
`CheckpointManager` step, `args=ocp.args.Composite(state=ocp.args.StandardSave(tree))`):

  linen          the Linen side's TrainState as its `create` makes it (logical-axis
                 boxes kept: `<path>/value` on disk)
  linen-unboxed  the same TrainState unboxed (as StockLinen trains it; the same as
                 `linen` where the model makes no boxes)
  nnx            `nnx.state((model, optimizer))`: `0/<model path>/value`, `1/step/value`,
                 `1/opt_state/<int-keyed chain>/.../value`
  nnx-pure       `nnx.to_pure_dict` of it (no `/value`)

Each leaf on disk is matched to the pair's checkpoint layout through the
pair's sides (`parity.pairs.adapter.make_pair_sides`: the correspondences
given or inferred): the side's `_checkpoint_leaves` of its own template
names every leaf, so optimizer state of any optax chain is matched by
structure (Linen's tuple with its `EmptyState` placeholders, NNX's int-keyed
dicts), extra collections (`batch_stats`) by the side's collections, the
step by name (int32 on Linen, uint32 on `nnx.Optimizer`: cast exactly). State
only NNX keeps (`StockNnx.nnx_only`, RNG streams) is left out of a Linen
checkpoint and initialised as the pair's `create(0)` makes it in an NNX one.
A leaf whose shape differs between the sides is refused unless the side's
own `to_checkpoint` moves its axes (a transpose, read off the traced program:
the reference decoder's NNX side stacking layers on axis 0); it is then
written transposed, box by box.

It is the one converter: `parity convert` without `--pair` converts through
the reference decoder's pair (`bridge.reference.pair`). It streams: each
array is read and written chunk by chunk (boxes of at most 64 MiB where a
chunk is larger), in the source's array format (zarr or zarr3, whichever
Orbax wrote), so an array whose bytes do not change has its encoded chunks
copied as they are, after one decode to catch damage; host memory stays near
one box plus one largest array, never the model. The output goes into a
temporary directory beside DST, renamed into place only when complete (and,
with `verify`, verified): a failure leaves nothing at DST and never touches
SRC; `overwrite` swaps a non-empty DST out with two renames that SIGTERM and
Ctrl-C wait for, and a SIGKILL's leftovers are cleaned up (an old DST put
back) by the next conversion to DST. `_METADATA` is written in Orbax's own
order with its placeholders, so the other side's own restore code
(`StandardCheckpointer().restore(path, abstract_state)`) reads it.

A module per step (`atomic`: errors, partial directories, signals and the move
into place; `streaming`: boxes, the item writer, metadata and progress;
`layouts`, `reading`, `writing`, `restore`, `converting`, `comparing`, `cli`);
this package re-exports them."""
from __future__ import annotations

from parity.store.pair_convert.atomic import (  # noqa: F401
    ConvertError,
    Interrupted,
    NOTHING_WRITTEN,
    remove_stale_partials,
    restore_replaced,
)
from parity.store.pair_convert.streaming import (  # noqa: F401
    ItemWriter,
    Progress,
    tty_progress,
    write_step_metadata,
)

from parity.store.pair_convert.layouts import (  # noqa: F401
    ARRAY_TYPES,
    CHECKPOINT_METADATA,
    COMMIT,
    FORMATS,
    Layout,
    Leaf,
    METADATA,
    ORBAX_TMP,
    OWN_FORMATS,
    ROLES,
    SHARDING,
    SIDE_OF_FORMAT,
    checkpoint_paths,
    pair_layouts,
    side_layout,
    _format_tree,
    _keys,
    _needs,
)
from parity.store.pair_convert.reading import (  # noqa: F401
    Item,
    Stored,
    identify,
    locate,
    read_item,
    _STEP_FLAGS,
    _describe,
    _integer_scalar,
    _problems,
    _pytree_items,
    _store_spec,
    _unfinished,
    _unreadable,
)
from parity.store.pair_convert.writing import (  # noqa: F401
    nnx_only_values,
    _Job,
    _Writer,
    _box_chunk,
    _plan,
    _sharding_entries,
    _write_array_metadatas,
    _write_checkpoint,
    _write_commit,
    _write_item_dir,
    _write_jobs,
)
from parity.store.pair_convert.restore import (  # noqa: F401
    abstract_target,
    own_tree,
    pair_sides,
    restore_native,
    verify_conversion,
    _SIDES,
    _names,
    _native_shardings,
    _own_to_native,
    _uncommitted,
)
from parity.store.pair_convert.converting import (  # noqa: F401
    ConvertResult,
    convert_checkpoint,
    to_linen_layout,
    to_nnx_layout,
    _nnx_state,
)
from parity.store.pair_convert.comparing import (  # noqa: F401
    CheckpointDiff,
    DIFF_BOX_BYTES,
    compare_checkpoints,
    _chunk_bytes,
    _compare_arrays,
    _diff_boxes,
    _open_array,
    _read_pair,
    _shardings,
)
from parity.store.pair_convert.cli import (  # noqa: F401
    add_convert_parser,
    add_diff_parser,
    command_convert,
    command_diff,
)

# What the package re-exports (pyflakes reads it; the imports above say where each comes from).
__all__ = [
    'ConvertError', 'Interrupted', 'NOTHING_WRITTEN', 'remove_stale_partials', 'restore_replaced',
    'ItemWriter', 'Progress', 'tty_progress', 'write_step_metadata', 'ARRAY_TYPES', 'CHECKPOINT_METADATA',
    'COMMIT', 'FORMATS', 'Layout', 'Leaf', 'METADATA', 'ORBAX_TMP', 'OWN_FORMATS', 'ROLES', 'SHARDING',
    'SIDE_OF_FORMAT', 'checkpoint_paths', 'pair_layouts', 'side_layout', '_format_tree', '_keys', '_needs',
    'Item', 'Stored', 'identify', 'locate', 'read_item', '_STEP_FLAGS', '_describe', '_integer_scalar',
    '_problems', '_pytree_items', '_store_spec', '_unfinished', '_unreadable', 'nnx_only_values', '_Job',
    '_Writer', '_box_chunk', '_plan', '_sharding_entries', '_write_array_metadatas', '_write_checkpoint',
    '_write_commit', '_write_item_dir', '_write_jobs', 'abstract_target', 'own_tree', 'pair_sides',
    'restore_native', 'verify_conversion', '_SIDES', '_names', '_native_shardings', '_own_to_native',
    '_uncommitted', 'ConvertResult', 'convert_checkpoint', 'to_linen_layout', 'to_nnx_layout', '_nnx_state',
    'CheckpointDiff', 'DIFF_BOX_BYTES', 'compare_checkpoints', '_chunk_bytes', '_compare_arrays',
    '_diff_boxes', '_open_array', '_read_pair', '_shardings', 'add_convert_parser', 'add_diff_parser',
    'command_convert', 'command_diff',
]
