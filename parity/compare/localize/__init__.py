"""The divergence localizer: which module first computes something different.

Each side's train-mode loss is traced once with every module call recorded
(parity/compare/bridged.py: Linen's `nn.intercept_methods`; NNX, each module
class's methods patched for the duration of the trace; through any wrapper
between the frameworks): `__call__` and the public methods a caller calls
(`Embed.attend`, a call keyed `embed.attend`), each with every array it was
given, positional or keyword, by its parameter's name. A zero probe is added
to every module's output, so one `value_and_grad` gives, per module call, its
arguments, its forward output, the cotangent arriving at that output, and
every parameter's gradient. `localize` then compares both sides bitwise:

- forward: the first difference in execution order, a call's arguments as it
  starts or its output as it returns. An output that differs from equal
  arguments names its module; an argument that differs while every earlier
  call agrees names the module whose call made it (its caller: the
  difference arose in that module's own code, between its submodules) and
  the argument, never the module that received it;
- backward: a module whose output cotangent is equal on both sides but
  whose parameters' gradients differ computes its own backward pass
  differently; the innermost such module is named (of several at one depth,
  the one the backward pass runs first).

Module calls inside a transform's body are that body's tracers. `localize_step`
probes with the bodies of `jax.lax.scan` and `jax.checkpoint` opened
(`layers_opened`): their calls leave as extra outputs of the body, a scan's
stacked by layer, so each layer of a scanned stack (Linen `nn.scan`, NNX
`nnx.scan` or `jax.lax.scan` over `nnx.split` state, rematerialised or not,
its layer behind a wrapper or not) is compared on its own, `layers/1/mlp`,
and a stacked parameter's gradient layer by layer. Calls inside other
transforms are listed as not recorded.

A module per step (`recording`, `probes`, `finding`); this package re-exports them as the one
module did."""
from __future__ import annotations

from parity.compare.localize.recording import (  # noqa: F401
    ROOT,
    Recorder,
    flat_outputs,
    _Bodies,
    _Frame,
    _LAYER,
    _LAYER_MARK,
    _SCANNED_LAYER,
    _arrays,
    _call_name,
    _common_path,
    _expand,
    _float_tree,
    _marked,
    _split_call,
    _zeros_like,
)
from parity.compare.localize.probes import (  # noqa: F401
    RecordedProbe,
    layers_opened,
    linen_intercept,
    linen_probe,
    nnx_intercept,
    nnx_names,
    nnx_probe,
    _OPENED,
    _layer_renamed,
    _on_call,
    _probe,
)
from parity.compare.localize.finding import (  # noqa: F401
    Localization,
    localize,
    localize_step,
    _alike,
    _argument_difference,
    _arguments,
    _caller,
    _contains,
    _depth,
    _layer_params,
    _loops,
    _max_ulp,
    _method_of,
    _module_of,
    _one_sided,
    _outermost_inside,
    _returns_its_input,
    _shown,
    _stacked,
    _under,
    _unnamed,
)
