# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Migrating a Linen decoder and its train state to NNX, step by step
#
# This guide walks through the migration of one real program: a llama2-style
# decoder (MaxText parameter names) with its AdamW train state, written once in
# Flax Linen and once in Flax NNX. Each section shows one step of the
# migration, the code on both sides, and a **check that proves the step
# right**. Every check is an `assert`: if a step were done wrong, the notebook
# would stop there. The test suite runs this notebook top to bottom, so what
# you read here is what the code does today.
#
# You need to know Linen; no NNX is assumed. Everything runs on CPU with the
# `tiny` preset (2 layers, 64-wide, vocabulary 256) in well under a minute.
#
# | section | step | the check |
# |---|---|---|
# | 1 | one layer, Linen vs NNX | same parameter paths, logical axes and output bits |
# | 2 | scanned layers | `'layers'` at `param_scan_axis` on both sides; a layout rule when they differ |
# | 3 | moving parameters with the bridge | both parameter tables equal; round trips are the identity |
# | 4 | logical and physical specs on 8 devices | no drift; the seed's `embed_vocab` vs `embed` bug caught |
# | 5 | logits, loss, gradients | bit-identical, no tolerance |
# | 6 | the train state | `TrainState` vs `nnx.Optimizer`; steps bit-identical |
# | 7 | dropout | explicit keys: same masks on both sides, new masks each step |
# | 8 | checkpoints | a Linen checkpoint restored into NNX, training resumed bit for bit |
# | 9 | `parity compare` | the side-by-side report |
# | 10 | your own model | path, layout and spec rules; the pytest helpers |
# | 11 | your own model pair | `parity.model_pair`: the battery's parts bit for bit; a slipped port caught |

# %% [markdown]
# ## 0. Set-up
#
# Two things must happen before `jax` is imported:
#
# * **8 CPU devices.** Section 4 places arrays on a mesh of 8 devices. XLA
#   can split the CPU into virtual devices; the flag only works if it is set
#   before jax starts, which is why this cell comes first. (Restart the kernel
#   if jax was already imported.) The guide runs on the CPU on any machine, a
#   GPU or TPU host too (`JAX_PLATFORMS=cpu`, unless you set another platform
#   before starting Jupyter): one accelerator is not a mesh of 8.
# * **The project on the import path.** If you installed the project
#   (`pip install -e '.[notebook]'`, or `make notebook`), there is nothing to
#   do. Otherwise the cell walks up from the working directory (Jupyter starts
#   a notebook in its own folder, `notebooks/`) to the repository root, the
#   folder holding `models/`, `bridge/` and `parity/`, and puts it first on
#   `sys.path`.

# %%
import os
import pathlib
import sys

DEVICE_FLAG = '--xla_force_host_platform_device_count=8'
if DEVICE_FLAG not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + DEVICE_FLAG).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
if 'jax' in sys.modules:
    print('note: jax was imported before this cell; restart the kernel to get 8 CPU devices')


def find_repository(start: pathlib.Path) -> pathlib.Path | None:
    """The first folder at or above `start` that holds this project's packages."""
    for folder in (start, *start.parents):
        if all((folder / name / '__init__.py').is_file() for name in ('models', 'bridge', 'parity')):
            return folder
    return None


REPO = find_repository(pathlib.Path.cwd().resolve())
if REPO is not None:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    print('project: the repository around this notebook')
else:
    import importlib.util
    if importlib.util.find_spec('parity') is None:
        raise ModuleNotFoundError(
            "the project is neither installed nor around this notebook: run `make notebook`,"
            " or `pip install -e '.[notebook]'` in the repository")
    print('project: the installed package')

# %%
import inspect
import json
import tempfile

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from parity.core import paths
from parity.core import specs
from bridge import train_state as bridge
from parity.core.errors import TreeMismatchError
from bridge.layout import IDENTITY, AxisMove, Layout, layout_for
from models import data, rng
from models.config import SCENARIOS, get_configs
from models.linen import decoder as linen_decoder
from models.linen import layers as linen_layers
from models.nnx import decoder as nnx_decoder
from models.nnx import layers as nnx_layers
from models.nnx import train as nnx_train
from parity.compare import activations
from parity.store import checkpoints
from parity.run import cli
from bridge import tables
from parity.core.bitwise import assert_bitwise_equal, compare_trees
from bridge.sides import abstract_step_inputs, as_jax_batch, make_sides

print(f'jax {jax.__version__}, flax {flax.__version__}, {jax.device_count()} {jax.default_backend()} devices')
assert jax.device_count() >= 8, 'section 4 needs 8 devices: restart the kernel and run this cell first'


# %% [markdown]
# Two small helpers for the rest of the guide: print part of a source file,
# and show a table (as Markdown in Jupyter, as text elsewhere).

# %%
def show_source(obj, start: str | None = None, stop: str | None = None) -> None:
    """Prints the source of `obj`, or its lines from the one containing `start`
    up to (not including) the next one containing `stop`."""
    lines = inspect.getsource(obj).splitlines()
    if start is not None:
        first = next(i for i, line in enumerate(lines) if start in line)
        last = next((i for i in range(first + 1, len(lines)) if stop and stop in lines[i]), len(lines))
        lines = lines[first:last]
    print('\n'.join(lines))


def show_table(header, rows) -> None:
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
        if get_ipython() is not None:
            md = ['| ' + ' | '.join(cells[0]) + ' |', '|' + '---|' * len(header)]
            md += ['| ' + ' | '.join(c.replace('|', '\\|') for c in row) + ' |' for row in cells[1:]]
            display(Markdown('\n'.join(md)))
            return
    except ImportError:
        pass
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        print('  '.join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


# %% [markdown]
# The configuration is plain dataclasses shared by both sides (so it can never
# differ between them): a `ModelConfig`, a `TrainConfig`, presets, and
# scenarios that change a few fields (dropout, unscanned layers, ...).

# %%
model_cfg, train_cfg = get_configs('tiny', '01_baseline')
print(model_cfg)
print(train_cfg)
print('scenarios:', ', '.join(SCENARIOS))

# %% [markdown]
# ## 1. One layer side by side: the gated MLP
#
# Here is the same module in both frameworks. Read them next to each other:
#
# * **Where parameters are created.** Linen's `@nn.compact` creates them
#   lazily, on the first call, under the names given by `name=`. NNX creates
#   them eagerly in `__init__`, as attributes; the attribute name *is* the
#   path segment. Naming every NNX attribute as the Linen submodule gives the
#   same parameter paths (`wi_0/kernel`, ...), which is what lets one
#   checkpoint serve both.
# * **Where logical axes live.** Linen wraps the initializer:
#   `nn.with_logical_partitioning(init, ('embed', 'mlp'))`. NNX puts the names on
#   the variable as metadata: `nnx.Param(value, out_sharding=('embed', 'mlp'))`
#   (flax renamed this keyword during 0.12.x, so the project keeps the call in
#   `parity/core/compat.py`: `compat.nnx_param`).
# * **Randomness.** Linen asks the framework for keys (`self.make_rng('params')`,
#   `self.make_rng('dropout')`); NNX takes an `nnx.Rngs` object in the
#   constructor. The two derive keys differently, so the same seed never gives
#   the same weights or dropout masks: parameters are *transferred* (section 3)
#   and dropout takes an *explicit key* argument on both sides (section 7).

# %%
print('# Linen: models/linen/layers.py')
show_source(linen_layers.MLP)
print('\n# NNX: models/nnx/layers.py')
show_source(nnx_layers.MLP)

# %% [markdown]
# `DenseGeneral` is where the parameter itself is declared; its first lines
# show both spellings of a parameter with logical axes:

# %%
print('# Linen')
show_source(linen_layers.DenseGeneral, 'def __call__', 'dtype = ')
print('\n# NNX')
show_source(nnx_layers.DenseGeneral, 'def __init__', 'if config.quantization')

# %% [markdown]
# **Check.** Initialise the Linen MLP, copy its parameters into a freshly built
# NNX MLP by path, and compare: the parameter paths and logical axes must be
# equal, and so must the outputs, bit for bit. (If an attribute were misnamed,
# say `w_in` for `wi_0`, the copy would fail naming the path; if `wi_0` and
# `wi_1` were swapped in `__call__`, the outputs would differ.)

# %%
x_BLE = jax.random.normal(jax.random.PRNGKey(1), (2, 8, model_cfg.emb_dim), jnp.float32)

linen_mlp = linen_layers.MLP(model_cfg)
linen_mlp_vars = linen_mlp.init(jax.random.PRNGKey(0), x_BLE)  # boxed: values carry logical axes
nnx_mlp = nnx_layers.MLP(model_cfg, rngs=nnx.Rngs(params=0))

mlp_linen_axes = specs.linen_logical_specs(linen_mlp_vars)
mlp_nnx_axes = specs.nnx_logical_specs(nnx.state(nnx_mlp, nnx.Param))
show_table(('path', 'Linen logical axes', 'NNX logical axes'),
           [(p, mlp_linen_axes[p], mlp_nnx_axes.get(p)) for p in sorted(mlp_linen_axes)])
specs.check_no_drift(mlp_linen_axes, mlp_nnx_axes, 'logical')

# Different init keys: the NNX weights are not the Linen ones until copied.
assert compare_trees(nn.unbox(linen_mlp_vars)['params'], nnx.state(nnx_mlp, nnx.Param))
nnx.update(nnx_mlp, bridge.linen_params_to_nnx(nn.unbox(linen_mlp_vars), nnx.state(nnx_mlp, nnx.Param)))
assert_bitwise_equal(linen_mlp.apply(linen_mlp_vars, x_BLE), nnx_mlp(x_BLE), 'MLP outputs')
print('MLP: same paths, same logical axes, bit-identical outputs')

# %% [markdown]
# ## 2. Scanned layers and `param_scan_axis`
#
# A deep model scans one layer over the stack instead of unrolling it. Linen
# does both the creation and the application with `nn.scan`; `variable_axes`
# says on which axis the per-layer parameters are stacked
# (`param_scan_axis`, 1 here as in MaxText), and `metadata_params` inserts the
# logical name `'layers'` into every parameter's axes at that position:

# %%
show_source(linen_decoder.Decoder, 'if cfg.scan_layers:', 'else:')

# %% [markdown]
# NNX separates the two. `__init__` *creates* the stack with `nnx.vmap` over a
# layer constructor (`nnx.split_rngs` gives each layer its own init key;
# `out_axes` is the stacking axis; `transform_metadata` inserts `'layers'`
# there), and `__call__` *applies* it with `nnx.scan`, whose `in_axes` names
# the same axis for the layer and `nnx.Carry` for the hidden state. The
# layer's axis is an `nnx.StateAxes` listing the parameters first, then the
# rest (fp8 scaling state), as Linen's `variable_axes` does: the loop then
# carries the arrays in Linen's order, which XLA's scheduler starts from
# (without it, the fp8 step took 32 KiB more on a GPU, same numbers).
# Rematerialised layers keep Linen's order too: `nn.remat` takes a layer's
# collections in name order (fp8's `_overwrite_with_gradient` before
# `params`), so NNX's `_remat_layer` splits the layer that way before
# `jax.checkpoint` (split by path, fp8 under remat was another program):

# %%
show_source(nnx_decoder.Decoder.__init__, 'if cfg.scan_layers:', 'else:')
print('    ...')
show_source(nnx_decoder.Decoder.__call__, 'layer_axes = ', 'else:')

# %% [markdown]
# **Check.** Shapes and logical axes of both sides' parameters, from
# `jax.eval_shape` / `nnx.eval_shape` (nothing is allocated). The stacked MLP
# kernel is `[embed, layers, mlp]` on both sides, with `'layers'` at axis
# `param_scan_axis`.

# %%
linen, nnx_side = make_sides(model_cfg, train_cfg)  # made once per process (section 9)
linen_abstract = linen.abstract_variables      # boxed ShapeDtypeStructs
nnx_abstract = nnx_side.abstract_params        # nnx.State of Params (ShapeDtypeStructs + metadata)

WI_0 = 'decoder/layers/mlp/wi_0/kernel'
linen_axes = specs.linen_logical_specs(linen_abstract)
nnx_axes = specs.nnx_logical_specs(nnx_abstract)
linen_shapes = {p[len('params/'):]: x.shape for p, x in paths.flatten(nn.unbox(linen_abstract)).items()}
nnx_shapes = {p: x.shape for p, x in paths.flatten(nnx_abstract).items()}
print('Linen', WI_0, linen_shapes[WI_0], linen_axes[WI_0])
print('NNX  ', WI_0, nnx_shapes[WI_0], nnx_axes[WI_0])
for axes, shapes in ((linen_axes, linen_shapes), (nnx_axes, nnx_shapes)):
    assert axes[WI_0][model_cfg.param_scan_axis] == 'layers'
    assert shapes[WI_0][model_cfg.param_scan_axis] == model_cfg.num_layers
assert linen_shapes == nnx_shapes
specs.check_no_drift(linen_axes, nnx_axes, 'logical')

# %% [markdown]
# **When the stacking axes differ.** A port does not have to keep Linen's
# layout: scenario `10_scan_axis0` stacks the NNX layers on axis 0. Then the
# trees are not equal any more, and the bridge needs a **layout rule**: an
# `AxisMove` that moves the array axis *and* its logical name together, for
# every parameter under a path prefix. With the rule, the two tables agree;
# without it, every stacked parameter is reported.

# %%
axis0_model_cfg, axis0_train_cfg = get_configs('tiny', '10_scan_axis0')
axis0_linen, axis0_nnx = make_sides(axis0_model_cfg, axis0_train_cfg)
axis0_layout = layout_for(axis0_model_cfg)
print(axis0_layout)
axis0_linen_rows, axis0_nnx_rows = tables.linen_rows(axis0_linen), tables.nnx_rows(axis0_nnx)
print('NNX:', tables.format_row(next(r for r in axis0_nnx_rows if r['path'].endswith(WI_0))))
assert tables.drift(axis0_linen_rows, axis0_nnx_rows, axis0_layout) == []
without_rule = tables.drift(axis0_linen_rows, axis0_nnx_rows, IDENTITY)
print(f'without the layout rule, {len(without_rule)} differences, e.g.\n  ' + '\n  '.join(without_rule[:2]))
assert len(without_rule) > 0

# %% [markdown]
# ## 3. Moving parameters with the bridge
#
# Linen and NNX derive initialisation keys differently, so the same seed gives
# different weights. To compare the two implementations, **one side
# initialises and the bridge carries the state to the other.** The bridge
# (`bridge/train_state.py`) is a set of pure functions between the two trees;
# each takes a *template* of the target (its structure, shapes, dtypes and, for
# NNX, the variables' metadata) and fills it strictly: a missing or extra path,
# or a shape or dtype mismatch, raises `TreeMismatchError` naming each path.
#
# | from | to | function |
# |---|---|---|
# | Linen variables `{'params': ...}` | NNX `nnx.State` of `Param`s | `linen_params_to_nnx(variables, nnx_params, layout)` |
# | NNX `Param` state | Linen variables | `nnx_params_to_linen(nnx_params, variables, layout)` |
# | Linen `TrainState` | NNX state of `(model, optimizer)` | `linen_to_nnx(linen_state, nnx_state, layout)` |
# | NNX state of `(model, optimizer)` | Linen `TrainState` | `nnx_to_linen(nnx_state, linen_state, layout)` |
#
# In this project both sides also sit behind one small interface
# (`bridge.sides`): `init(seed)`, `train_step`, `forward`, `to_checkpoint`,
# `from_checkpoint`, ... The sides were made in section 2.

# %%
linen_state = linen.init(0)     # a flax TrainState (params, opt_state, step)
linen_params = linen_state.params
nnx_params = bridge.linen_params_to_nnx(linen_params, nnx_side.abstract_params)
print(type(nnx_params).__name__, 'with', len(paths.flatten(nnx_params)), 'parameters')

# Both round trips are the identity, bit for bit.
assert_bitwise_equal(linen_params, bridge.nnx_params_to_linen(nnx_params, linen_params), 'Linen -> NNX -> Linen')
assert_bitwise_equal(nnx_params, bridge.linen_params_to_nnx(
    bridge.nnx_params_to_linen(nnx_params, linen_params), nnx_params), 'NNX -> Linen -> NNX')

# A tree that does not fit is refused, naming the path, expected and got.
broken = jax.tree.map(lambda x: x, linen_params)
broken['params']['decoder']['decoder_norm']['scale'] = jnp.ones((3,))
try:
    bridge.linen_params_to_nnx(broken, nnx_side.abstract_params)
    raise AssertionError('a wrong shape was accepted')
except TreeMismatchError as e:
    print(e)

# %% [markdown]
# **Both parameter tables.** `bridge.tables` reads every parameter's path,
# shape, dtype and logical axes from each side (through `eval_shape`, so this
# works for the 1.1-billion-parameter `default` preset too). The tables must
# be equal row for row.

# %%
linen_rows, nnx_rows = tables.linen_rows(linen), tables.nnx_rows(nnx_side)
show_table(
    ('path', 'shape', 'dtype', 'Linen logical axes', 'NNX logical axes'),
    [(l['path'], l['shape'], l['dtype'], tables.format_names(l['logical']), tables.format_names(n['logical']))
     for l, n in zip(linen_rows, nnx_rows)],
)
assert linen_rows == nnx_rows
assert tables.param_count(linen_rows) == model_cfg.param_count()
print(f'{tables.param_count(linen_rows):,} parameters on both sides')

# %% [markdown]
# An interactive view of the NNX parameter state (expand the nodes), where
# `treescope` is installed (`pip install treescope`, part of the `notebook`
# extra):

# %%
try:
    import treescope
except ImportError:
    print('treescope is not installed: skipping the interactive view (pip install treescope)')
else:
    treescope.display(nnx_params, autovisualize=False)

# %% [markdown]
# ## 4. Logical and physical specs on a mesh
#
# Parameters carry *logical* axis names (`'embed'`, `'mlp'`, ...). **Rules**
# map each logical name to a mesh axis (`'fsdp'`, `'tensor'`, ...), giving the
# *physical* `PartitionSpec`. The rules are data, shared by both sides
# (`parity.core.specs.DEFAULT_RULES`); the resolution is flax's own
# (`nn.logical_to_mesh_axes`: first matching rule wins, a mesh axis is used at
# most once per array). Here is the parameter part of the rules:

# %%
print('\n'.join(f'{name:12} -> {axes}' for name, axes in specs.DEFAULT_RULES if not name.startswith('activation_')))

# %% [markdown]
# On a mesh of the 8 CPU devices, `fsdp=4, tensor=2`, both tables get a physical
# column (mesh axes of size 1 are left out of the printed spec, as in MaxText's
# logs):

# %%
MESH = 'fsdp=4,tensor=2'
mesh_sizes = specs.parse_mesh_spec(MESH)
linen_mesh_rows = tables.linen_rows(linen, mesh_sizes=mesh_sizes)
nnx_mesh_rows = tables.nnx_rows(nnx_side, mesh_sizes=mesh_sizes)
show_table(
    ('path', 'logical', 'Linen physical', 'NNX physical'),
    [(l['path'].removeprefix('params/params/'), tables.format_names(l['logical']),
      tables.format_names(l['physical']), tables.format_names(n['physical']))
     for l, n in zip(linen_mesh_rows, nnx_mesh_rows)],
)
assert tables.drift(linen_mesh_rows, nnx_mesh_rows, nnx_side.layout) == []

# %% [markdown]
# The table is computed from names. The real test is the `NamedSharding` each
# side derives *in its own idiom* for every leaf of its train state, optimizer
# moments included (Linen: `nn.get_partition_spec` of the boxed abstract
# state; NNX: `nnx.get_partition_spec` of the state's metadata). Keyed by
# checkpoint path, they must be identical:

# %%
mesh = specs.make_mesh(MESH)
mesh_linen, mesh_nnx = make_sides(model_cfg, train_cfg, mesh)
linen_shardings, nnx_shardings = mesh_linen.checkpoint_shardings(), mesh_nnx.checkpoint_shardings()
ndims = {p: len(x.shape) for p, x in mesh_linen.abstract_checkpoint().items()}
for path in ('params/params/decoder/logits_dense/kernel', 'opt_state/1/0/mu/params/decoder/logits_dense/kernel'):
    print(f'{path}\n  Linen {specs.describe_sharding(linen_shardings[path])}'
          f'\n  NNX   {specs.describe_sharding(nnx_shardings[path])}')
specs.check_same_shardings(linen_shardings, nnx_shardings, ndims)
print(f'{len(ndims)} leaves, same sharding on both sides')

# %% [markdown]
# **What drift looks like.** The migration this project comes from had exactly
# this bug: the NNX `logits_dense` kernel said `('embed', 'vocab')` where Linen
# says `('embed_vocab', 'vocab')`. We reproduce it on a *copy* of the NNX
# table. Note that with the default rules both names map to `fsdp`, so the
# physical specs still agree on this mesh: only the logical comparison sees the
# bug, until someone changes the rule for one name and the two sides silently
# shard differently. That is why both columns are compared.

# %%
LOGITS = 'params/params/decoder/logits_dense/kernel'
drifted = [dict(row) for row in nnx_mesh_rows]
for row in drifted:
    if row['path'] == LOGITS:
        row['logical'] = ['embed', 'vocab']
        row['physical'] = list(specs.physical_spec(row['logical'], specs.DEFAULT_RULES, mesh_sizes))
report = tables.drift(linen_mesh_rows, drifted, nnx_side.layout)
print('\n'.join(report))
assert report == [f"{LOGITS}: logical Linen ('embed_vocab','vocab') vs NNX ('embed','vocab')"]

# %% [markdown]
# The same bug through the checking helper, which raises with every offending
# path and both values (what a test would print):

# %%
nnx_axes_drifted = dict(nnx_axes, **{'decoder/logits_dense/kernel': ('embed', 'vocab')})
try:
    specs.check_no_drift(linen_axes, nnx_axes_drifted, 'logical')
    raise AssertionError('the drift was not reported')
except TreeMismatchError as e:
    print(e)

# %% [markdown]
# **Activations have logical names too.** Each side constrains its
# activations by logical name (`nn.with_logical_constraint` in Linen, a small
# helper over `jax.lax.with_sharding_constraint` in NNX). Only the physical
# spec reaches the compiled program, so two names the rules send to one mesh
# axis look the same there. `parity.compare.activations` traces each side's train
# step (nothing compiled) under a mesh whose axes are the logical names
# themselves, which keeps every constraint's names in the traced program: one
# row per constraint, in program order, with the model method that applied it
# (`parity specs --activations` prints the same tables).

# %%
activation_batch, activation_key = abstract_step_inputs(model_cfg, train_cfg)  # shapes only
linen_acts, nnx_acts = (
    activations.rows(side, side.template, activation_batch, activation_key, mesh_sizes=mesh_sizes)
    for side in (linen, nnx_side)
)
print(activations.format_table(linen_acts[:10]), end='')
print(f'... {len(linen_acts)} constraints (forward and backward)')
assert activations.drift(linen_acts, nnx_acts) == []

# %% [markdown]
# Renaming the residual stream's `activation_embed` to `activation_mlp` on one
# side changes no number and, under these rules (both go to `tensor`), no
# physical spec; the logical comparison names the site and both names:

# %%
renamed = [dict(row) for row in nnx_acts]
renamed[1]['logical'] = ['activation_mlp' if n == 'activation_embed' else n for n in renamed[1]['logical']]
renamed[1]['physical'] = list(specs.physical_spec(renamed[1]['logical'], specs.DEFAULT_RULES, mesh_sizes))
act_report = activations.drift(linen_acts, renamed)
print('\n'.join(act_report))
assert len(act_report) == 1 and 'vs NNX' in act_report[0] and "'activation_mlp'" in act_report[0]

# %% [markdown]
# ## 5. Logits, loss and gradients: bit for bit
#
# With the same parameters, the same batch and the same program, the two
# sides must produce the same bits. That is the standard here: **no
# tolerance.** A tolerance answers "are these close?", and close is what a
# subtle migration bug looks like: a missing `astype`, a constraint dropped on
# one side, a dropout mask that does not change, a reduction in another order.
# `parity.core.bitwise` compares shape, dtype and raw bits (the arrays viewed as
# unsigned integers, so even `-0.0` vs `+0.0` and NaN payloads count).
#
# (A comparison that cannot be bitwise, such as the same model on two different
# meshes, whose reductions run in different orders, states its bound and why.
# Linen against NNX on the same devices is compared bitwise, in every scenario
# and on every mesh the test suite runs.)
#
# The NNX side gets the whole Linen-initialised train state (parameters,
# optimizer state, step) through the bridge. `linen_to_nnx` goes through the
# checkpoint layout of section 6, so it is the same as
# `nnx_side.from_checkpoint(linen.to_checkpoint(...))`.

# %%
nnx_state = bridge.linen_to_nnx(linen_state, nnx_side.template, nnx_side.layout)
assert_bitwise_equal(nnx_state, nnx_side.from_checkpoint(linen.to_checkpoint(linen_state)), 'NNX state')
batch = as_jax_batch(data.make_batch(model_cfg, train_cfg, step=0))
dropout_base = rng.base_key(train_cfg.seed)
print({k: v.shape for k, v in batch.items()})

linen_logits = linen.forward(linen_state, batch, dropout_base)
nnx_logits = nnx_side.forward(nnx_state, batch, dropout_base)
assert_bitwise_equal(linen_logits, nnx_logits, 'logits')

(linen_loss_sum, (_, tokens)), linen_grads = linen.loss_and_grad(linen_state, batch, dropout_base)
(nnx_loss_sum, _), nnx_grads = nnx_side.loss_and_grad(nnx_state, batch, dropout_base)
assert_bitwise_equal(linen_loss_sum, nnx_loss_sum, 'loss')
# NNX gradients come as an nnx.State of Params: map them into the Linen tree to compare.
assert_bitwise_equal(linen_grads, bridge.nnx_params_to_linen(nnx_grads, linen_params, nnx_side.layout), 'gradients')
print(f'logits {linen_logits.dtype}{list(linen_logits.shape)}, mean loss {float(linen_loss_sum / tokens):.6f}:'
      f' logits, loss and {len(paths.flatten(linen_grads))} gradients bit-identical')

# %% [markdown]
# **Why bits and not `allclose`.** Nudge one weight of the NNX copy by the
# smallest step the computation can see (one bfloat16 unit in the last place:
# the model computes in bfloat16) and compare again. The loss barely moves, if
# at all, so matching loss curves would not reveal it; `np.allclose` with a
# tolerance loose enough for bfloat16 logits (1e-2) calls the logits equal. The
# bitwise comparison reports the difference, where it is and how large.

# %%
def next_bfloat16(x):
    """The next larger bfloat16 value of float32 `x`, as float32."""
    return jnp.nextafter(x.astype(jnp.bfloat16), jnp.bfloat16(jnp.inf)).astype(x.dtype)


nudged_flat = nnx_side.to_checkpoint(nnx_state)
nudged_flat[LOGITS] = nudged_flat[LOGITS].at[0, 0].set(next_bfloat16(nudged_flat[LOGITS][0, 0]))
nudged_state = nnx_side.from_checkpoint(nudged_flat)
(nudged_loss_sum, _), _ = nnx_side.loss_and_grad(nudged_state, batch, dropout_base)
print(f'loss sum {float(linen_loss_sum)!r}, nudged {float(nudged_loss_sum)!r}')
nudged_logits = nnx_side.forward(nudged_state, batch, dropout_base)
assert np.allclose(np.asarray(linen_logits, np.float32), np.asarray(nudged_logits, np.float32), rtol=1e-2, atol=1e-2)
diffs = compare_trees({'logits': linen_logits}, {'logits': nudged_logits})
print('\n'.join(map(str, diffs)))
assert diffs, 'a one-ULP change went unnoticed'

# %% [markdown]
# ## 6. The train state: `TrainState` vs `nnx.Optimizer`
#
# **Linen** keeps everything in one immutable pytree,
# `flax.training.train_state.TrainState`: `step`, `params` (the variables dict,
# so parameter paths read `params/params/...`), `opt_state` (optax's state,
# mirroring `params`), plus `tx` and `apply_fn`. A step returns a new state
# from `state.apply_gradients(grads=grads)`.
#
# **NNX** keeps the optimizer as an object next to the model:
# `nnx.Optimizer(model, tx, wrt=nnx.Param)` holds `step` and `opt_state` as
# variables and updates the model in place with `optimizer.update(model, grads)`.
# To jit a step without re-walking the Python object graph on every call, the
# pair `(model, optimizer)` is split **once** into a static `graphdef` and a pure
# `state` (a pytree); the jitted step merges them, updates, and returns the new
# pure state:

# %%
show_source(nnx_train.create_train_state)
print()
show_source(nnx_train.make_train_step, '  def train_step(', 'if accum == 1')
print('    ...')
show_source(nnx_train.make_train_step, '    optimizer.update(model, grads)', 'return jax.jit')

# %% [markdown]
# **Optimizer state mapping.** Both sides use the same optax chain
# (`clip_by_global_norm`, then AdamW on a warmup-cosine schedule), so their
# optimizer states have the same leaves at different paths. The **checkpoint
# layout** is the Linen one, and the NNX side converts to and from it exactly:
#
# * NNX `0/<param>` (the model's parameters) is Linen `params/params/<param>`;
# * NNX `1/opt_state/<...>/<param>` is Linen `opt_state/<...>/params/<param>`
#   (Adam's `mu` and `nu`); leaves that mirror no parameter keep their path
#   (Adam's `count`: NNX `1/opt_state/1/0/count` is Linen `opt_state/1/0/count`);
# * NNX `1/step` is Linen `step`. The step counter is the one leaf whose
#   dtype differs by design (`nnx.Optimizer` uint32, Linen int32); the bridge
#   converts it exactly.

# %%
linen_ckpt = linen.to_checkpoint(linen_state)
nnx_ckpt = nnx_side.to_checkpoint(nnx_state)
examples = [f'0/{WI_0}', f'1/opt_state/1/0/mu/{WI_0}', f'1/opt_state/1/0/nu/{WI_0}', '1/opt_state/1/0/count', '1/step']
checkpoint_paths = [f'params/params/{WI_0}', f'opt_state/1/0/mu/params/{WI_0}', f'opt_state/1/0/nu/params/{WI_0}',
                    'opt_state/1/0/count', 'step']
flat_nnx_state = paths.flatten(nnx_state)
show_table(('NNX state path', 'checkpoint (Linen) path', 'NNX dtype', 'Linen dtype'),
           [(a, b, flat_nnx_state[a].dtype, linen_ckpt[b].dtype) for a, b in zip(examples, checkpoint_paths)])
assert sorted(linen_ckpt) == sorted(nnx_ckpt)
assert_bitwise_equal(linen_ckpt, nnx_ckpt, 'train state in checkpoint layout')
print(f'{len(linen_ckpt)} leaves, the same bits in the same layout')

# %% [markdown]
# **Training, bit for bit.** Both sides train five steps on the same
# deterministic batches (`models.data.make_batch` depends only on the seed and
# the step). Each step's loss must have the same bits; after the last step the
# whole state must be equal, and must have moved (a step that does nothing
# would also "match"). We keep the Linen state after step 3 for section 8.

# %%
STEPS = 5
linen_losses, nnx_losses = [], []
ls, ns = linen_state, nnx_state
for step in range(STEPS):
    step_batch = as_jax_batch(data.make_batch(model_cfg, train_cfg, step))
    ls, linen_metrics = linen.train_step(ls, step_batch, dropout_base)
    ns, nnx_metrics = nnx_side.train_step(ns, step_batch, dropout_base)
    linen_losses.append(float(linen_metrics['loss']))
    nnx_losses.append(float(nnx_metrics['loss']))
    assert_bitwise_equal(linen_metrics, nnx_metrics, f'step {step} metrics')
    print(f'step {step}: Linen {linen_losses[-1]!r:22} NNX {nnx_losses[-1]!r:22} (hex {linen_losses[-1].hex()})')
    if step == 2:
        linen_state_at_3 = ls  # trained 3 steps; its step counter is 3
linen_final, nnx_final = ls, ns
assert_bitwise_equal(linen.to_checkpoint(linen_final), nnx_side.to_checkpoint(nnx_final), 'final train state')
assert int(linen_final.step) == STEPS and len(set(linen_losses)) == STEPS
assert compare_trees(linen_final.params, linen_state.params), 'training did not move the parameters'

# %%
import matplotlib.pyplot as plt

fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(9, 3))
ax_loss.plot(range(STEPS), linen_losses, 'o-', label='Linen', linewidth=3)
ax_loss.plot(range(STEPS), nnx_losses, 'x--', label='NNX', color='black')
ax_loss.set(xlabel='step', ylabel='loss', title='training loss')
ax_loss.legend()
ax_diff.plot(range(STEPS), np.subtract(nnx_losses, linen_losses), 'o-')
ax_diff.set(xlabel='step', ylabel='NNX - Linen', title='difference (exactly 0)')
fig.tight_layout()
plt.show()
assert np.subtract(nnx_losses, linen_losses).tolist() == [0.0] * STEPS

# %% [markdown]
# ## 7. Dropout with explicit keys
#
# Linen draws a dropout mask from `self.make_rng('dropout')`; NNX from an
# `nnx.Rngs` stream (`rngs.dropout()`). The frameworks fold keys differently, so
# masks drawn that way can never match across a migration, and a test could not
# tell "same mask" from "wrong mask".
#
# Here neither is used. `models/rng.py` derives every mask's key from
# `(base key, step, microbatch, layer, site)` with `jax.random.fold_in`, in that
# order; both sides receive the per-layer keys as an argument (scanned layers
# get them as scan inputs) and fold in the site. The train step passes
# `rng.step_key(dropout_base, step, microbatch)` as the model's dropout key. The
# dropout module takes its key as an argument on both sides:

# %%
show_source(rng.step_key)
show_source(rng.layer_keys)
show_source(rng.site_key)
print('\n# Linen')
show_source(linen_layers.Dropout)
print('\n# NNX')
show_source(nnx_layers.Dropout)

# %% [markdown]
# **Check.** Scenario `03_dropout` (rate 0.1) has the same parameter tree, so
# it can start from the state above. With the key of step 0, both sides must
# give the same logits; with the key of step 1, different ones (new masks);
# and both must differ from the logits without dropout. Were one side to draw
# its masks from its own stream, the first assertion would fail.

# %%
drop_model_cfg, drop_train_cfg = get_configs('tiny', '03_dropout')
drop_linen, drop_nnx = make_sides(drop_model_cfg, drop_train_cfg)
drop_linen_state = drop_linen.from_checkpoint(linen.to_checkpoint(linen_state))
drop_nnx_state = drop_nnx.from_checkpoint(linen.to_checkpoint(linen_state))

key_step0 = rng.step_key(dropout_base, 0, 0)   # what the train step passes at step 0, microbatch 0
key_step1 = rng.step_key(dropout_base, 1, 0)
linen_drop0 = drop_linen.forward(drop_linen_state, batch, key_step0)
assert_bitwise_equal(linen_drop0, drop_nnx.forward(drop_nnx_state, batch, key_step0), 'logits with dropout')
assert compare_trees(linen_drop0, drop_nnx.forward(drop_nnx_state, batch, key_step1)), 'the mask did not change'
assert compare_trees(linen_drop0, linen_logits), 'dropout had no effect'
print('dropout: same masks on both sides for one key, new masks for the next step')

# %% [markdown]
# ## 8. A Linen checkpoint restored into NNX, and resuming
#
# Checkpoints are written with Orbax (`parity.store.checkpoints`, a thin layer over
# `orbax.checkpoint.CheckpointManager`). Both sides write the **Linen layout**
# (`step`, `params/params/...`, `opt_state/...`), plus the dropout base key, so a
# resumed run continues the same key stream. One checkpoint restores into
# either side; each array is read directly in the restoring side's target
# sharding.
#
# **Check.** Save the Linen state after 3 steps, restore it into NNX, and train
# steps 3 and 4 there. The restored state must equal what was saved, and the
# resumed NNX run must reproduce the uninterrupted Linen run of section 6: same
# loss bits at steps 3 and 4, same final state. (The first resumed step
# compiles the NNX step again: restored arrays are placed on a device
# explicitly, and jit compiles once per placement of its arguments. A real
# resume restores before its first step, so it compiles once.)

# %%
with tempfile.TemporaryDirectory() as checkpoint_dir:
    manager = checkpoints.open_manager(checkpoint_dir)
    checkpoints.save(manager, 3, linen, linen_state_at_3, dropout_base)  # asynchronous
    manager.wait_until_finished()
    step_dir = os.path.join(checkpoint_dir, '3')
    print('saved steps:', list(manager.all_steps()), '| step 3 holds the items',
          sorted(name for name in os.listdir(step_dir) if os.path.isdir(os.path.join(step_dir, name))))
    restored, restored_base = checkpoints.restore(manager, 3, nnx_side)
    manager.close()

assert_bitwise_equal(linen.to_checkpoint(linen_state_at_3), nnx_side.to_checkpoint(restored), 'restored state')
assert_bitwise_equal(dropout_base, restored_base, 'dropout base key')

resumed_losses = []
for step in range(3, STEPS):
    restored, metrics = nnx_side.train_step(restored, as_jax_batch(data.make_batch(model_cfg, train_cfg, step)), restored_base)
    resumed_losses.append(float(metrics['loss']))
print('resumed NNX losses:', resumed_losses, '\nLinen, uninterrupted:', linen_losses[3:])
assert [x.hex() for x in resumed_losses] == [x.hex() for x in linen_losses[3:]]
assert_bitwise_equal(linen.to_checkpoint(linen_final), nnx_side.to_checkpoint(restored), 'resumed final state')

# %% [markdown]
# ## 9. `parity compare`: the side-by-side report
#
# Everything above, as one command. `parity compare` initialises one side,
# carries the state to the other, trains both on the same batches (their
# steps interleaved, so machine noise hits both alike), and prints:
#
# * a summary table in the style of a benchmark comparison: Linen | NNX |
#   difference, with the final loss, throughput, step and compile times,
#   memory, versions, and two verdicts of **the same program**: XLA's memory
#   analysis of both compiled train steps (equal to the byte, or which field
#   differs by how much) and the canonical train-step programs (arguments
#   named by state path; identical except the one allowed difference, the
#   step counter's dtype: int32 in Linen's `TrainState`, uint32 in
#   `nnx.Optimizer`);
# * one row per step: both losses and whether the bits of every train metric
#   (loss, z-loss, token count) are equal;
# * the verdict. The exit status is 0 when bit-identical with the same
#   memory and program, 1 when not (`--numbers-only` judges the numbers
#   alone), 2 on bad input.
#
# From a shell: `parity compare --steps 3` (or `python -m parity compare ...`;
# `--scenario 03_dropout`, `--mesh fsdp=4,tensor=2`, `--init nnx`,
# `--json report.json`, `--plot losses.png`). Here we call the same entry
# point. `make_sides` makes each configuration's sides once per process, and
# this guide took its sides from there too, so the train steps compiled above
# are not compiled again (hence a compile time near zero in the table).

# %%
with tempfile.TemporaryDirectory() as report_dir:
    report_json = os.path.join(report_dir, 'report.json')
    status = cli.main(['compare', '--preset', 'tiny', '--steps', '3', '--json', report_json])
    with open(report_json) as f:
        compare_report = json.load(f)
assert status == 0, f'parity compare exited {status}'
assert compare_report['bitwise_equal'] and compare_report['first_divergent_step'] is None
assert [float.fromhex(h) for h in compare_report['linen']['loss_hex']] == linen_losses[:3]
assert compare_report['memory_verdict'] == 'equal to the byte'
assert compare_report['program_verdict'] == 'identical except: step counter dtype'
print(compare_report['memory_verdict'], '|', compare_report['program_verdict'])

# %% [markdown]
# Reading it: the `equal bits` column (every train metric, bit for bit) and
# the verdict are the proof; a divergence names the first step whose train
# metrics differ and every final state
# leaf that is not bit-identical (with its path, the number of differing
# elements and the largest ULP distance). The speed and memory rows are for
# judging the port's cost, not its correctness. The same run with the report as
# JSON (`--json`) gives the per-step loss bits as hex floats, which is what the
# cell above checked against section 6.

# %% [markdown]
# ## 10. Applying the kit to your own model
#
# The pieces that are not specific to this decoder:
#
# | piece | what you write | where |
# |---|---|---|
# | **path rules** | nothing if NNX attributes are named as the Linen submodules; otherwise a rename of paths | `parity.core.paths.map_paths`, `paths.flatten`, `paths.fill` |
# | **layout rules** | an `AxisMove(prefix, linen_axis, nnx_axis)` per difference in stacking or axis order | `bridge.layout.Layout` |
# | **spec rules** | your logical-name to mesh-axis rules, as a tuple of pairs | `parity.core.specs.DEFAULT_RULES` is the template |
# | **checks** | bitwise comparisons and drift reports in your tests | `parity.core.bitwise`, `parity.core.specs`, `bridge.tables` |
#
# **Path rules.** Take a small Linen model that relies on auto-names
# (`Dense_0`, `Dense_1`) and its NNX port with descriptive attributes (`up`,
# `down`). The paths differ, so the parameters move through a rename. `fill`
# is strict: a wrong rename (here, the two layers swapped) is refused with
# every offending path.

# %%
class LinenToy(nn.Module):
    @nn.compact
    def __call__(self, x):
        hidden = nn.Dense(32)(x)  # auto-named Dense_0: names follow creation order
        return nn.Dense(8)(jax.nn.gelu(hidden))  # Dense_1


class NnxToy(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(8, 32, rngs=rngs)
        self.down = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def rename(mapping):
    """'params/Dense_0/kernel' -> 'up/kernel' for mapping {'Dense_0': 'up', ...}."""
    def to_nnx(path):
        module, _, rest = path.removeprefix('params/').partition('/')
        return f'{mapping[module]}/{rest}'
    return to_nnx


toy_x = jax.random.normal(jax.random.PRNGKey(2), (4, 8))
toy_linen_vars = LinenToy().init(jax.random.PRNGKey(0), toy_x)
toy = NnxToy(rngs=nnx.Rngs(0))
toy_flat = paths.map_paths(paths.flatten(toy_linen_vars), rename({'Dense_0': 'up', 'Dense_1': 'down'}))
nnx.update(toy, paths.fill('Linen -> NNX toy parameters', nnx.state(toy, nnx.Param), toy_flat))
assert_bitwise_equal(LinenToy().apply(toy_linen_vars, toy_x), toy(toy_x), 'toy outputs')
print('toy model: bit-identical after the rename')

swapped = paths.map_paths(paths.flatten(toy_linen_vars), rename({'Dense_0': 'down', 'Dense_1': 'up'}))
try:
    paths.fill('Linen -> NNX toy parameters', nnx.state(toy, nnx.Param), swapped)
    raise AssertionError('a wrong rename was accepted')
except TreeMismatchError as e:
    print(e)

# %% [markdown]
# **Layout rules.** When your NNX port stores an array with its axes in
# another order (as `10_scan_axis0` in section 2 does), declare it once; the
# rule moves the array axis and its logical name together, in both directions:

# %%
my_layout = Layout((AxisMove('decoder/layers/', linen_axis=1, nnx_axis=0),))
kernel = jnp.arange(2 * 3 * 4.0).reshape(2, 3, 4)  # [embed, layers, mlp] in Linen
moved = my_layout.array_to_nnx(WI_0, kernel)
print(kernel.shape, '->', moved.shape, '|', my_layout.names_to_nnx(WI_0, ('embed', 'layers', 'mlp')))
assert_bitwise_equal(kernel, my_layout.array_to_linen(WI_0, moved), 'layout round trip')
assert my_layout.array_to_nnx('token_embedder/embedding', kernel) is kernel  # other prefixes untouched

# %% [markdown]
# **Spec rules.** Rules are data: pass your own to `make_sides(..., rules=...)`,
# and both sides resolve them the same way. For
# instance, keeping the vocabulary-side embedding axis unsharded changes the
# physical spec of `logits_dense` only, which is also the rule change that
# would turn section 4's logical drift into a real sharding difference:

# %%
my_rules = tuple((name, None) if name == 'embed_vocab' else (name, axes) for name, axes in specs.DEFAULT_RULES)
for names in (('embed_vocab', 'vocab'), ('embed', 'vocab')):
    print(names, 'default ->', specs.physical_spec(names, specs.DEFAULT_RULES, mesh_sizes),
          '| mine ->', specs.physical_spec(names, my_rules, mesh_sizes))
assert specs.physical_spec(('embed_vocab', 'vocab'), my_rules, mesh_sizes) != \
    specs.physical_spec(('embed', 'vocab'), my_rules, mesh_sizes)

# %% [markdown]
# **The whole battery for your pair: the pytest plugin.** Installing this
# project registers a pytest plugin. Declare your two sides once, at module
# level of a test file, and pytest generates every check of this guide for
# them: structure and logical specs, loss and gradients bitwise, training from
# each side's init, eval, Orbax checkpoints in four directions, resume across
# sides, sharded training on meshes of the CPU devices (data parallel, or by
# your parameters' logical axes with `rules=`), memory and program
# parity, and the divergence localizer, whose finding is appended to a failing
# gradient or training test (which module, forward or backward). Stock train
# states need only your own functions:
#
# ```python
# import parity
#
# def make_sides(mesh):
#     return (parity.StockLinen(my_linen.create_train_state, my_linen.train_step,
#                               my_linen.eval_step, my_linen.loss_fn, mesh=mesh),
#             parity.StockNnx(my_nnx.create_train_state, my_nnx.train_step, my_nnx.eval_step,
#                             my_nnx.loss_fn,
#                             renames=parity.Renames((('Dense_0', 'up'), ('Dense_1', 'down'))),
#                             mesh=mesh))
#
# my_model = parity.Pair('my_model', make_sides, batch=my_batch)  # batch(step, split) -> numpy dict
# ```
#
# An NNX model that keeps RNG streams (a layer made with `rngs=`, such as
# `nnx.Dropout(rate, rngs=rngs)`) needs no change either: `StockNnx` leaves the
# streams, which a Linen `TrainState` does not have, out of every comparison of
# numbers, and the memory, program and mesh parts show the state they add to the
# NNX step (docs/plugin.md).
#
# Two NNX habits do give another program, and the battery says which: NNX
# attributes that sort otherwise than the Linen modules they replace change
# the order in which `optax.clip_by_global_norm` adds the leaves (the localizer
# names the first parameter out of order), and `nnx.remat` over a module
# returns the module's state, so a scanned stack carries its parameters out of
# the loop again (the memory and program parts name the loop and the fix,
# `jax.checkpoint` over the state `nnx.split` gives, as this decoder's
# `_remat_layer` does).
#
# The plugin docs (docs/plugin.md) list what each function takes,
# the generated tests and the options; `tests/test_family_classifier.py` and
# `tests/test_family_encoder.py` are two worked examples built from flax's
# stock layers (batch norm and dropout; attention, with a difference inherent
# to the stock layers declared and bounded, and tensor parallel by its
# parameters' logical axes). The reference decoder itself is
# declared the same way, per scenario, in `tests/test_decoder_pairs.py`.
#
# **Lower-level helpers** for checks of your own:
#
# | helper | use |
# |---|---|
# | `parity.core.bitwise.assert_bitwise_equal(a, b, what)` | any two pytrees (dicts, `nnx.State`, optax states): shape, dtype and raw bits of every leaf |
# | `parity.core.bitwise.compare_trees(a, b)` | the same, returning the list of differing leaves (empty: equal) |
# | `parity.core.specs.check_no_drift(linen, nnx, what)` | `{path: spec}` dicts of the two sides: raises naming each parameter whose spec differs |
# | `parity.core.specs.check_same_shardings(linen, nnx, ndims)` | `{path: NamedSharding}` dicts: mesh, devices and partition spec |
# | `parity.core.specs.linen_logical_specs`, `nnx_logical_specs` | read the logical axes from a boxed Linen tree or an NNX `Param` state |
# | `bridge.tables.drift(linen_rows, nnx_rows, layout)` | human-readable lines for every parameter whose shape, dtype or spec differs |
# | `parity.core.paths.flatten`, `map_paths`, `fill` | `{path: array}` views, renames, strict refilling of a template |

# %% [markdown]
# ## 11. Your own model pair, proven through the model-level API
#
# Most repositories keep their models apart from the train loop, and have no
# train step to hand the plugin. Then `parity.model_pair` writes both sides:
# given the two models, how a batch becomes their inputs, a loss and an
# optimizer, it writes each side's train state, jitted train and eval steps
# and forward pass, as a user would write them in each framework
# (docs/first-pair.md walks through it). Here it takes section 10's toy
# pair as it is. Nothing maps `Dense_0` to `up`: the kit infers the module
# correspondences from one traced train-mode loss per side. The toy's call takes
# no `train` keyword and has no dropout, so `mode=None` (no mode keyword is
# passed) and `dropout=None` (no dropout key).
#
# `batch(step, split)` gives the same arrays for the same `(step, split)`,
# `split` being `'train'` (the training steps) or `'eval'` (the eval part):
# the kit asks for them many times, from both sides.
#
# In a test file, a pair at module level becomes one pytest test per part
# of the battery. Here the cell runs the parts through
# `parity.battery.checks`, the functions those tests call: each raises
# `AssertionError` naming every path that differs, so a port that diverged
# stops the guide at this cell.

# %%
import optax

import parity
from parity.battery import checks
from parity.pairs import adapter


def toy_batch(step: int, split: str) -> dict[str, np.ndarray]:
    """8 rows of 8 features, each labelled by its largest: a pure function of (step, split)."""
    rows = np.random.default_rng([step, {'train': 0, 'eval': 1}[split]]).normal(size=(8, 8)).astype(np.float32)
    return {'x': rows, 'label': rows.argmax(-1).astype(np.int32)}


def toy_loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch['label']).mean()


def toy_model_pair(name, nnx_model):
    return parity.model_pair(name, linen=LinenToy(), nnx=nnx_model, inputs=lambda batch: batch['x'],
                             loss=toy_loss, optimizer=optax.adam(1e-3), batch=toy_batch, mode=None, dropout=None)


toy_pair = toy_model_pair('toy', NnxToy)
_, toy_nnx_side = adapter.make_pair_sides(toy_pair, None)
print('inferred correspondences (Linen, NNX):', toy_nnx_side.renames.rules)
assert toy_nnx_side.renames.rules == (('Dense_0', 'up'), ('Dense_1', 'down'))

toy_parts = {
    'structure': lambda: checks.check_structure(toy_pair),  # one state tree, in Linen's paths
    'init': lambda: checks.check_init(toy_pair),  # each side's own initialisers, in distribution
    'grads': lambda: checks.check_grads(toy_pair),  # loss and gradients from one state
    'train[linen]': lambda: checks.check_train(toy_pair, 'linen'),  # 4 steps from the Linen init
    'train[nnx]': lambda: checks.check_train(toy_pair, 'nnx'),  # and from the NNX init
    'eval': lambda: checks.check_eval(toy_pair),  # eval outputs and metrics
    'memory': lambda: checks.check_memory(toy_pair),  # XLA's memory analysis of the train steps
    'program': lambda: checks.check_program(toy_pair),  # the canonical train-step programs
}
for part, check in toy_parts.items():
    notes = check()  # raises AssertionError on any difference
    assert not notes, (part, notes)  # nothing declared, nothing to note: every value bit for bit
    print(f'{part}: bit for bit')

# %% [markdown]
# **When the port slips.** The same pair with the NNX toy's activation
# changed, `relu` where Linen has `gelu`: the gradients part fails, and its
# message starts with the divergence localizer's finding, which names where
# the two forward passes part (every earlier module call agrees; the input
# of the second `Dense` differs), then every differing path.

# %%
class NnxToySlipped(NnxToy):
    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


try:
    checks.check_grads(toy_model_pair('toy_slipped', NnxToySlipped))
    raise RuntimeError('a slipped port passed the gradients part')
except AssertionError as e:
    slipped_report = str(e)
print('\n'.join(line[:160] for line in slipped_report.splitlines()[:4]))
forward_finding = next(line for line in slipped_report.splitlines() if 'forward pass' in line)
assert 'the input of Dense_1' in forward_finding, slipped_report  # the second Dense: `down` in NNX

# %% [markdown]
# ## What you have now
#
# Each step of the migration has a check that fails when the step is wrong:
# the same parameter paths and logical axes, a bridge whose round trips are the
# identity, identical shardings on a mesh, bit-identical logits, loss,
# gradients and training, dropout masks that match and move, checkpoints that
# cross between the frameworks and resume exactly, and one command that shows
# it all side by side. The full battery (`make test-all`) runs the same checks on
# every scenario and on several meshes, and your own pair gets them from ten
# lines: section 11, or a test file (docs/first-pair.md).
