"""The equivalence battery of one declared pair: the checks the plugin turns into tests.

Each `check_*` function takes a `Pair` (parity/pairs/adapter.py) and raises
AssertionError with a bitwise report naming every differing path; they are
plain functions, so a test can call one directly (the plugin's tests are
thin wrappers over them). Runs that several
checks read (a pair's sides, its common start, training trajectories) are
computed once per process (`_runs`).

One module per part (`structure`, `specs`, `init`, `grads`, `train`, `evaluation`,
`checkpoints`, `convert`, `mesh`, `memory`, `program`, `localize`, `substitution`, `decode`)
over the runs they share (`shared`); this package re-exports every check."""
from __future__ import annotations

from parity.battery.checks.shared import (  # noqa: F401
    EarlierFailure,
    RefusedDeclaration,
    compare,
    first_divergent_step,
    per_step,
    _MEASURED,
    _Runs,
    _battery_frames_hidden,
    _is_scalar,
    _raises_once,
    _rules,
    _runs,
    _scalars_first,
    _stock_value_and_grads,
    _uncovered_lines,
    _unproven_line,
    _with_localization,
)
from parity.battery.checks.messages import (  # noqa: F401
    rnn_loop_line,
    stock_attention_lines,
    _is_dropout,
)
from parity.battery.checks.structure import (  # noqa: F401
    check_structure,
    renamed_parameters,
    _as_failure,
)
from parity.battery.checks.specs import (  # noqa: F401
    activation_tables,
    check_activation_tables,
    check_param_specs,
    check_specs,
    resolved_activation_tables,
    _check_resolved_activations,
)
from parity.battery.checks.init import (  # noqa: F401
    INIT_SIGMAS,
    check_init,
)
from parity.battery.checks.grads import (  # noqa: F401
    check_grads,
)
from parity.battery.checks.train import (  # noqa: F401
    check_train,
)
from parity.battery.checks.evaluation import (  # noqa: F401
    check_eval,
    _eval_localized,
)
from parity.battery.checks.checkpoints import (  # noqa: F401
    check_checkpoint,
    check_resume,
)
from parity.battery.checks.convert import (  # noqa: F401
    check_convert,
)
from parity.battery.checks.mesh import (  # noqa: F401
    check_mesh,
    state_sharding_drift,
    _mesh_localization,
    _off_their_rules,
)
from parity.battery.checks.memory import (  # noqa: F401
    check_memory,
    _measured_memory,
    _memory_cause,
    _platform_unnamed,
    _temporaries_alone_moved,
)
from parity.battery.checks.program import (  # noqa: F401
    STOCK_LOWERINGS,
    check_program,
    _nnx_modules,
    _numbers_part,
    _stock_types,
    _suggested_declaration,
)
from parity.battery.checks.localize import (  # noqa: F401
    check_localize,
    _nnx_only_calls,
)
from parity.battery.checks.substitution import (  # noqa: F401
    check_substitution,
    _in_place_lines,
)
from parity.battery.checks.decode import (  # noqa: F401
    check_decode,
    _cache_placed_alike,
    _decode_localized,
)
