"""The suite's two tiers: the core proof that `make test` runs, and the exhaustive rest.

The core tier proves each model family end to end, quickly, and every
decoder feature at least once. The decoder runs as two composite scenarios
(models/config.py), which between them hold every feature that composes,
since fp8 and gradient accumulation cannot share a scenario (both models
refuse the pair):

* `11_composite_accum`, in place of the baseline: gradient accumulation
  over 4 microbatches, dropout 0.1, rematerialisation saving dots, eval
  between train steps, bfloat16 weights, tied logits. It gets what the
  baseline got, but for the battery's grads part (EXHAUSTIVE_PARTS): the
  rest of the plugin's battery, the side-by-side run with its loss and eval
  records, the spec tables, logits and eval steps, memory and program
  parity on one device and on the 3-axis mesh, and its training there
  (shardings, annotations).
* `12_composite_fp8`: fp8 with delayed scaling, unrolled layers, dropout
  0.1, full rematerialisation, float32 weights, logits through
  logits_dense (and eval between train steps, which the exhaustive tier
  runs). The core tier keeps only its side-by-side run on one device, with
  its loss record and programs, and its spec tables
  (CORE_SCENARIO_TESTS); its battery and the rest are the exhaustive
  tier's, and it trains on no mesh by default (tests/runs.py).

Together they fail on a migration bug in the NNX side's dropout keys (that
ignore the step), step counter (not incremented, or of another dtype),
gradient accumulation (microbatch means averaged instead of every token
weighing the same), fp8 state (not updated) or remat policy (saving
everything: another program and other temporaries). Then the convolutional
classifier (on `data=8` too), the encoder (stock attention's declared
difference named by the localizer), the language model, the recurrent
model's inferred pairing and its recurrent dropout's training, the
production-shaped pair and
the half-migrated steps; the localizer's own tests on small
planted breaks; the bridge, comparison, report, converter, launcher and
plugin tests that compile little (a pair declared in a fresh directory
among them). Decoding runs with dropout configured (tests/test_decode.py), so a
decoder left in train mode fails it. On a 2-core machine it takes about 7 minutes
cold and 2 warm (an AMD EPYC), most of it XLA compiling (docs/development.md,
"Times").

The exhaustive tier adds everything else the suite has: every other decoder
scenario (the baseline, unscanned, dropout, rematerialisation, fp8, gradient
accumulation, eval, bf16 weights, tied logits, and scan axis 0: the NNX
layout that differs by design, whose programs differ on purpose and so is in
no composite) with its records and decoding (the baseline's and unscanned's
decode part), the composites' tests that the core tier leaves out, the
decoder's other three meshes, checkpoints across placements, the
multi-process runs, the CLI end to end, the migration guide notebook, the
hardware tier on the CPU devices, the planted bugs in the decoder and the
encoder that the localizer names, the train-state extras carried across (an
EMA of the parameters, a dynamic loss scale) and the tests that break a pair
on purpose to check what the plugin's failures say (a new pair each, so new
programs to compile). `pytest --exhaustive` (`make test-all`) runs both
tiers; CI runs `make test` and then `make test-all`. A run that names paths
or test ids (`pytest tests/test_multihost.py`), or selects by `-m` or `-k`
(`pytest -m hardware`), runs what it names, whatever the tier.

A test joins the exhaustive tier by its decoder scenario (for a scenario of
CORE_SCENARIO_TESTS, by its test function too) or mesh, by the part of a
declared pair's battery it is (below), or by the `exhaustive` marker. Its
scenario is its `scenario` parameter, or else its xdist group when that
names a scenario: the tests that key on `01_baseline` so (the compile-once
tests, the CLI's bit-identical compare) are the exhaustive tier's with it.
Nothing here imports jax.
"""
from __future__ import annotations

import pytest

from parity.battery.parts import MESH_GROUP, OWN_PROGRAM_GROUP

# The decoder's scenarios in the core tier: the two composites (models/config.py) in place of
# the baseline.
CORE_SCENARIOS = ('11_composite_accum', '12_composite_fp8')
# Core scenarios of which the core tier keeps only some tests (by test function), with why.
CORE_SCENARIO_TESTS = {
    '12_composite_fp8': (
        ('test_scenario_trains_bit_identically', 'test_program_identical_on_one_device',
         'test_scenario_specs_agree'),
        "its side-by-side run (one compile of each side's step) with its loss record, its programs"
        ' and its spec tables: they fail on fp8 state that a step does not update (and on'
        ' dropout keys, step counter and remat policy bugs); 11_composite_accum runs the battery,'
        " the mesh, logits and eval, and the core tier's time has no room for a second set",
    ),
}
# The xdist group of the core tier's tests that run the tiny preset's baseline programs outside
# the scenario matrix (decoding, the bridge, native init, a 3-step run, the CLI's compare): its
# inits and train steps compile once, in one worker (a scenario's name would put them in that
# scenario's tier).
TINY_PRESET_GROUP = 'tiny-preset'
# The decoder's mesh matrix in the core tier (tests/runs.py MESHES): the mesh of all three axes.
CORE_MESHES = ('data=2,fsdp=2,tensor=2',)
# Tests the plugin generates, by pair (its name) and part (None: every part), with why the
# core tier can leave them out.
EXHAUSTIVE_PARTS = {
    ('linen_to_nnx', None):
        "the bridge migration's two ends, a plain pair as the other families are: the core tier"
        ' proves the half-migrated steps, which the kit sees through the wrappers for',
    **{(pair, part): "a half-migrated step's training, eval, mesh, specs, checkpoints and resume:"
       ' parts that cross no wrapper the others do not (the core tier runs those that do: the'
       " layout, which init and grads carry the Linen state across, the localizer, memory and program)"
       for pair in ('linen_to_half', 'half_to_nnx')
       for part in ('train', 'eval', 'mesh', 'specs', 'checkpoints', 'resume', 'convert')},
    ('classifier_without_batch_norm', None):
        "batch norm's program isolated: the classifier pair has batch norm and its declared difference",
    ('encoder', 'mesh'):
        'tensor parallel on a mesh: the decoder trains on the 3-axis mesh, the classifier on data=8',
    ('encoder', 'localize'):
        'the localizer on equal sides: the stock-attention pair localizes a real difference',
    **{('production', part): "the production-shaped pair's numbers (its scanned, rematerialised"
       ' stacks train as the other families do): the core tier keeps what is its own, the 75'
       ' rules (specs), the 5-axis mesh factory (mesh), its RNG state accounted (memory) and the'
       ' scan and remat implementations as one program (program)'
       for part in ('init', 'grads', 'train', 'eval', 'checkpoints', 'resume', 'convert', 'localize')},
    **{('production_save_dots', part): "the production pair under the other remat policy: the core"
       ' tier keeps what the policy changes, the program and memory of each step (and the structure)'
       for part in ('specs', 'init', 'grads', 'train', 'eval', 'checkpoints', 'resume', 'convert', 'mesh',
                    'localize')},
    **{('rnn', part): "the recurrent pair's numbers, checkpoints, placements and programs: stock layers"
       ' as the language model proves them; the core tier keeps the inferred pairing (structure), its'
       ' recurrent dropout bit for bit over the steps (train: a key per step in the loop, as Linen splits'
       " it), and a declared module's own loop on a small program (tests/test_program_parity.py)"
       for part in ('specs', 'init', 'grads', 'eval', 'checkpoints', 'resume', 'convert', 'mesh',
                    'memory', 'program', 'localize')},
    **{('lm_model_level', part): "the model-level language model's layout, placements and localizer: the"
       " family's own pair proves them on the same models; the core tier keeps what the kit writes, its"
       ' train steps (gradients with both dropouts, training, memory and program) and its decoding'
       for part in ('specs', 'init', 'eval', 'checkpoints', 'resume', 'convert', 'mesh', 'localize')},
    **{('classifier_model_level', part): "the model-level classifier's layout, placements and localizer: the"
       " family's own pair proves them; the core tier keeps what the kit writes (batch statistics in"
       ' its train step, the loss\'s metrics in eval, memory and program)'
       for part in ('specs', 'init', 'checkpoints', 'resume', 'convert', 'mesh', 'localize')},
    **{('mlp', part): "the tutorial's pair (docs/first-pair.md): the core tier keeps its layout, gradients"
       ' and training; the page shows its whole battery passing'
       for part in ('specs', 'init', 'eval', 'checkpoints', 'resume', 'convert', 'mesh', 'memory', 'program',
                    'localize')},
    **{('mlp_own_steps', part): "the side template's pair (docs/howto-own-steps.md, tests/test_side_template.py): the"
       ' core tier keeps what the template writes itself, its loss and steps (gradients, training, eval, memory'
       " and program); its other parts move its state through the stock sides' code, as every stock pair's do"
       for part in ('specs', 'init', 'checkpoints', 'resume', 'convert', 'mesh', 'localize')},
    **{('attention_substituted', part): "the in-place attention substitution's layout, placements and"
       ' checkpoints: the core tier keeps the parts that run its numbers (gradients, training, eval, memory,'
       ' program, the localizer and the substitution part), each with the stand-in given'
       for part in ('specs', 'init', 'checkpoints', 'resume', 'convert', 'mesh')},
    ('attention_dropout_substituted', None):
        "the in-place attention substitution with the attention's own dropout on, whose stock NNX formula is"
        " Linen's already: attention_substituted proves the substitution in every part in the core tier",
    ('lm', 'checkpoints'): 'checkpoints in four directions: the classifier and encoder pairs run them',
    ('lm', 'resume'): 'resume across sides: the classifier and encoder pairs run it',
    ('decoder_11_composite_accum', 'grads'):
        "one step's gradients (another program to compile per side): the train part compares ten"
        " steps of them bit for bit through the optimizer; the other families' grads parts run",
}
MARKER = 'exhaustive'  # and the option, --exhaustive (root conftest.py)
# How the main process tells pytest-xdist's workers its choice (root conftest.py).
WORKER_INPUT = 'parity_core_only'


def string_param(item, name: str) -> str | None:
  """The test's `name` parameter when it is a string."""
  callspec = getattr(item, 'callspec', None)
  value = callspec.params.get(name) if callspec else None
  return value if isinstance(value, str) else None


def _group(item) -> str | None:
  """The test's xdist group (a pair's, whichever of its three: parity/battery/parts.py)."""
  marker = item.get_closest_marker('xdist_group')
  if marker is None:
    return None
  group = marker.args[0] if marker.args else marker.kwargs.get('name')
  return group.removesuffix(OWN_PROGRAM_GROUP).removesuffix(MESH_GROUP) if isinstance(group, str) else group


def is_exhaustive(item, scenarios) -> bool:
  """Whether `item` belongs to the exhaustive tier only."""
  if item.get_closest_marker(MARKER):
    return True
  pair = getattr(getattr(item, 'cls', None), 'pair', None)  # a test the plugin generated
  if pair is not None:
    part = item.originalname[len('test_'):]
    if (pair.name, None) in EXHAUSTIVE_PARTS or (pair.name, part) in EXHAUSTIVE_PARTS:
      return True
  group = _group(item)
  # The decoder scenario it runs: its `scenario` parameter, or its group (a scenario's tests share one).
  scenario = string_param(item, 'scenario') or (group if group in scenarios else None)
  if scenario is not None and scenario not in CORE_SCENARIOS:
    return True
  if scenario in CORE_SCENARIO_TESTS and item.originalname not in CORE_SCENARIO_TESTS[scenario][0]:
    return True
  mesh = string_param(item, 'mesh')
  return mesh is not None and mesh not in CORE_MESHES


def core_only(config) -> bool:
  """True when this run leaves the exhaustive tier out: no `--exhaustive`, no path, `-m` or `-k`.

  Decided in the main process and handed to pytest-xdist's workers, which
  must collect the same tests (they see the paths the main process expanded).
  """
  worker_input = getattr(config, 'workerinput', None)
  if worker_input is not None:
    return bool(worker_input.get(WORKER_INPUT))
  return (not config.getoption('exhaustive')
          and config.args_source == pytest.Config.ArgsSource.TESTPATHS
          and not config.getoption('markexpr', '') and not config.getoption('keyword', ''))


def select(config, items, scenarios) -> int:
  """Deselects the exhaustive tier from `items` (in place) when `core_only`; returns how many."""
  if not core_only(config):
    return 0
  kept, dropped = [], []
  for item in items:
    (dropped if is_exhaustive(item, scenarios) else kept).append(item)
  if dropped:
    items[:] = kept
    config.hook.pytest_deselected(items=dropped)
  return len(dropped)
