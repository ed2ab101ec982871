"""The reference decoder's bridge: layouts, train-state mapping, parameter tables, and its sides for the kit.

A client of the kit (`parity`), as `models` is: it imports the kit, never the
reverse, so a project's own top-level `models` or `bridge` never shadows the
kit. `bridge.reference` is what the `parity` command runs when no `--pair`
is given.
"""
