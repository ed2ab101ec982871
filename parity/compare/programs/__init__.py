"""Compare the two sides' train-step programs as text, and read their shardings.

Two lowered programs can spell one computation differently: SSA value names,
private function names (`@_where_41` vs `@_where_40`: jax numbers them as it
traces), debug locations, the `jax.result_info` labels of the pytree paths,
the order in which the pytree flattening lays out arguments and results
(a Linen `TrainState` flattens `step` first, an NNX state last), the order in
which independent operations were traced, operations nothing uses, and
constants repeated per use. None of that is the computation, so
`canonicalize` removes all of it (it reads the program as a dataflow graph);
what is left differs only where the computation does, and `diff` shows where.

The order of a loop's carried values is spelling too: Linen's `nn.scan` and
a `jax.lax.scan` over `nnx.split` state carry the same values in another
order. Every loop is read with its carried values ordered by what they are,
so such loops are the same program. XLA's scheduler starts from that
order, and XLA:GPU has scheduled one loop body otherwise for it (the fp8
decoder on an H100: +32 KiB of temporaries, every number bitwise equal;
XLA:CPU gave equal memory): the memory part measures that, and where the
canonical programs are identical `diff` notes such a loop
(`loop_order_difference`; loops paired by what they carry, not by where
the text prints them) without calling it a difference.

`sharding_annotations` reads the sharding attributes of a lowered program
(GSPMD `mhlo.sharding` and Shardy `sdy.sharding` spellings), so tests can
assert that both sides' programs carry the same shardings.

A module per concern (`text`, `canonical`, `names`, `loops`, `diff`, `shardings`); this package
re-exports them as the one module did."""
from __future__ import annotations

from parity.compare.programs.text import (  # noqa: F401
    _BARRIER,
    _CALL_LINE,
    _CALL_OPERANDS,
    _CASE,
    _FUNC_HEADER,
    _FUNC_TOKEN,
    _Function,
    _INDENT,
    _LABEL_ATTRS,
    _LHS,
    _PLACEHOLDER,
    _REF,
    _RESULT_TYPES,
    _RETURN,
    _SSA,
    _STATEMENT_START,
    _STRUCTURE,
    _SYMBOL,
    _Statement,
    _TERMINATORS,
    _TOKEN_HEX,
    _TRANSPOSE,
    _VALUE_TOKEN,
    _WHILE,
    _canonical_indices,
    _hash,
    _indent_of,
    _matching_paren,
    _parse_functions,
    _permute_return,
    _refined,
    _result_type,
    _return_operands,
    _split_statements,
    _split_top_level,
    _strip_label_attrs,
    _strip_locations,
    _substitute,
)
from parity.compare.programs.canonical import (  # noqa: F401
    canonicalize,
    _Canonicalizer,
    _short_names,
    _sort_results,
)
from parity.compare.programs.names import (  # noqa: F401
    module_of,
    _JAX_SCOPES,
    _LOC_ALIAS,
    _LOOP_SCOPES,
    _OPAQUE,
    _TRAILING_LOC,
    _arg_name,
    _location_names,
    _mark_opaque,
)
from parity.compare.programs.loops import (  # noqa: F401
    ALLOWED,
    AllowedDifference,
    STEP_COUNTER_DTYPE,
    loop_carries,
    loop_carry_growth,
    loop_order_difference,
    _MAIN_ARGUMENT,
    _MAIN_SIGNATURE,
    _WHILE_TYPES,
    _parameter_types,
    _unpaired_loops,
    _without_loops_in,
)
from parity.compare.programs.diff import (  # noqa: F401
    ProgramDiff,
    diff,
    one_sided_arguments,
    _CALL,
    _REGION_OP,
    _RESHAPE_LIKE,
    _arguments_only,
    _clip,
    _clip_diff,
    _first_difference,
    _parting,
    _reshape_key,
    _tensor_type,
    _value_changes,
)
from parity.compare.programs.shardings import (  # noqa: F401
    sharding_annotations,
    _GSPMD,
    _SDY_ATTR,
    _SDY_CONSTRAINT,
    _angle_block,
    _normalise,
)
