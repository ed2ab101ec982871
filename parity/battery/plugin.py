"""The pytest plugin: the equivalence battery for any declared Linen/NNX pair.

Installed as a `pytest11` entry point, so it is active wherever this
package is installed. Declare a pair at module level of a test file:

    import parity
    classifier = parity.Pair('classifier', make_sides, batch)

and the module gets a test class `classifier` with one test per part of the
battery (parity/battery/checks/, a module per part): structure, logical specs, each side's own
initialisers (in distribution), loss and gradients,
training from each side's init, eval, checkpoints in four directions,
resume across sides, sharded training per mesh, memory and program parity,
and the divergence localizer. A pair's tests form three xdist groups (parts
that train on one device, parts on a mesh, parts with programs of their own:
parity/battery/parts.py), so under `pytest -n auto --dist loadgroup` one pair
uses up to three workers and no program is compiled by two.

Options: `--parity-parts=grads,train` runs only those parts; `--parity-programs` prints every
XLA program each test asked for, repeats marked (parity/battery/program_count.py);
`--parity-mesh=data=2,tensor=4` replaces every pair's meshes.

When it collects the session's first pair, before jax starts, the plugin
sets the XLA flags the battery needs unless XLA_FLAGS already sets them: as
many CPU devices as that pair's first mesh takes (8 for the default `data=8`;
a mesh spans every device, so a pair's meshes are all of one size), or `--parity-mesh`'s, and deterministic GPU kernels
(parity/env/xla_env.py). A session that declares no pair is left as it is.

After each test of the session (a pair's or not), a process holding more
than half of Linux's memory-map limit drops jax's in-memory caches
(parity/env/map_limit.py): a long test process otherwise crashes in XLA.
"""
from __future__ import annotations

import importlib
import math
import sys

import pytest

from parity.env import map_limit  # imports no jax
from parity.battery.parts import DIRECTIONS, ONE_DEVICE, PARTS, group_suffix  # neither

# Nothing here imports jax when pytest loads the plugin: a project's conftest
# sets XLA flags and jax's environment (compilation cache, platforms) first.


class _Lazy:
  def __init__(self, name):
    self._name = name

  def __getattr__(self, attr):
    return getattr(importlib.import_module(self._name), attr)


battery = _Lazy('parity.battery.checks')


def pytest_addoption(parser):
  group = parser.getgroup('parity', 'Linen/NNX equivalence battery')
  group.addoption(
      '--parity-parts', default=None,
      help='comma-separated parts of the battery to run (default: all): ' + ', '.join(PARTS),
  )
  group.addoption(
      '--parity-programs', action='store_true', default=False,
      help='record every XLA program each test asks for and print them, with repeats marked, at the end'
           ' (parity/battery/program_count.py)',
  )
  group.addoption(
      '--parity-mesh', action='append', default=None,
      help="mesh spec for the sharded part, e.g. 'data=8' (repeatable; default: each pair's own)",
  )


def _dist_given(config) -> bool:
  """Whether the run names xdist's distribution itself (command line, PYTEST_ADDOPTS, ini addopts)."""
  import os
  import shlex

  args = [*config.invocation_params.args, *shlex.split(os.environ.get('PYTEST_ADDOPTS', '')),
          *config.getini('addopts')]
  return any(a in ('--dist', '-d', '--distload') or a.startswith('--dist=') for a in args)


def _apply_loadgroup(config) -> None:
  """Under `-n`, xdist distributes by `load`, which spreads a pair's tests over the workers,
  each compiling the pair's functions; `loadgroup` keeps each pair's group on one worker.
  Applied unless the run names a distribution itself."""
  worker_input = getattr(config, 'workerinput', None)
  if worker_input is not None:  # a worker: its options are parsed from the command line again
    if worker_input.get(_LOADGROUP_INPUT):
      config.option.loadgroup = True  # xdist's worker-side switch (the `@group` id suffix)
    return
  if getattr(config.option, 'numprocesses', None) and getattr(config.option, 'dist', None) == 'load' \
      and not _dist_given(config):
    config.option.dist = 'loadgroup'
    config.stash[_LOADGROUP_APPLIED] = True


_LOADGROUP_APPLIED = pytest.StashKey[bool]()
_LOADGROUP_INPUT = 'parity_loadgroup'


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
  """xdist's hook as it starts a worker: tell it that loadgroup was applied."""
  node.workerinput[_LOADGROUP_INPUT] = node.config.stash.get(_LOADGROUP_APPLIED, False)


def pytest_report_header(config):
  if config.stash.get(_LOADGROUP_APPLIED, False):
    return ['parity: --dist loadgroup (a pair\'s parts that train on one device on one worker, its mesh parts'
            ' on another, those with programs of their own on a third; a worker fails them if the grouping did'
            ' not take effect; give --dist to choose another)']
  return None


def pytest_configure(config):
  _CONFIG[:] = [config]
  # Known to pytest-xdist; registered here too so runs without it stay strict-marker clean.
  config.addinivalue_line('markers', 'xdist_group(name): tests that share one xdist worker')
  _apply_loadgroup(config)
  if config.getoption('parity_programs', False):
    from parity.battery import program_count  # imports no jax

    config.stash[_PROGRAMS] = program_count.Recorder()
  parts = config.getoption('parity_parts')
  if parts is not None:
    if not _part_names(parts):
      raise pytest.UsageError(f'--parity-parts: no part named; parts: {", ".join(PARTS)}')
    unknown = sorted(_part_names(parts) - set(PARTS))
    if unknown:
      raise pytest.UsageError(f'--parity-parts: unknown part(s) {unknown}; parts: {", ".join(PARTS)}')
  meshes = config.getoption('parity_mesh')
  if meshes:
    try:
      counts = {_device_count(spec) for spec in meshes}
    except ValueError as e:
      raise pytest.UsageError(f'--parity-mesh: {e}') from None
    if len(counts) > 1:
      raise pytest.UsageError(
          f'--parity-mesh: {meshes} take {sorted(counts)} devices; a mesh spans every device,'
          ' so one run takes meshes of one size')


def _part_names(option: str) -> set[str]:
  """The parts an option value such as 'grads,train' names (spaces and empty names dropped)."""
  return {p.strip() for p in option.split(',') if p.strip()}


def _device_count(spec: str) -> int:
  """The devices a mesh spec such as 'data=2,tensor=4' spans (ValueError if malformed)."""
  from parity.core import specs  # imports jax, which starts no backend

  return math.prod(specs.parse_mesh_spec(spec).values())


_XLA_PREPARED: list[bool] = []


def _prepare_xla(config, pair) -> list[str]:
  """The XLA flags the battery needs, added once per session before jax starts (returns those added)."""
  from parity.env import xla_env  # imports no jax

  if _XLA_PREPARED:
    return []
  _XLA_PREPARED.append(True)
  _use_compile_cache(config)
  meshes = config.getoption('parity_mesh') or list(pair.meshes)
  if not meshes or xla_env.backends_started():  # too late: jax reads XLA_FLAGS once
    return []
  try:
    count = _device_count(meshes[0])
  except ValueError:
    return []  # reported by the mesh test, which parses it
  return xla_env.add_flags((xla_env.host_device_count_flag(count),) + xla_env.GPU_DETERMINISTIC_FLAGS)


def _use_compile_cache(config) -> None:
  """jax's persistent compilation cache in the project's pytest cache (`.pytest_cache`, shared by
  the xdist workers), unless one is set: a second run of a pair loads its programs. Not with
  `-p no:cacheprovider`, or where JAX_COMPILATION_CACHE_DIR or jax's config names one already;
  a cache the user names gets the kit's settings (every program cached) either way."""
  from parity.env import compile_cache  # imports no jax

  cache = getattr(config, 'cache', None)
  if cache is not None:
    compile_cache.enable(str(cache.mkdir('parity-jax-compilation-cache')))
  else:
    compile_cache.settle_given()


_MAP_GUARD = map_limit.Guard()


_GROUPING_ERROR = pytest.StashKey[str]()


def pytest_collection_finish(session):
  """In an xdist worker, fail every test if `--dist loadgroup` is not grouping.

  xdist sends a group to one worker by suffixing the test id with `@group`.
  Where that does not take effect (pytest-dev/pytest-xdist#1386: pytest 9.2
  with xdist 3.8), workers would repeat each other's compilations and runs
  and the suite would silently take longer.
  """
  if not getattr(session.config.option, 'loadgroup', False):
    return
  lost = [
      item.nodeid for item in session.items
      if item.get_closest_marker('xdist_group') and '@' not in item.nodeid.rsplit(']', 1)[-1]
  ]
  if lost:
    session.config.stash[_GROUPING_ERROR] = (
        f'--dist loadgroup is not grouping tests here ({len(lost)} grouped tests lack their'
        f' @group suffix): pytest {pytest.__version__} with this pytest-xdist is'
        " pytest-dev/pytest-xdist#1386. Install a pytest below 9.2 (this kit's `test` extra pins"
        ' one), or run without -n.'
    )


def pytest_runtest_setup(item):
  error = item.config.stash.get(_GROUPING_ERROR, None)
  if error:
    pytest.fail(error, pytrace=False)


_PROGRAMS = pytest.StashKey['object']()
_PROGRAM_RECORDS = 'parity_programs'  # the workers' records, sent to the controller (xdist workeroutput)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
  recorder = item.config.stash.get(_PROGRAMS, None)
  if recorder is None:
    return (yield)
  recorder.start()
  with recorder.recording(item.nodeid):
    return (yield)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
  del error
  recorder = node.config.stash.get(_PROGRAMS, None)
  records = getattr(node, 'workeroutput', {}).get(_PROGRAM_RECORDS)
  if recorder is not None and records:
    from parity.battery import program_count

    recorder.programs += [program_count.Program(**r) for r in records['programs']]
    recorder.askers += records['askers']


def pytest_sessionfinish(session):
  recorder = session.config.stash.get(_PROGRAMS, None)
  if recorder is None:
    return
  recorder.stop()
  worker_output = getattr(session.config, 'workeroutput', None)
  if worker_output is not None:
    worker_output[_PROGRAM_RECORDS] = {'programs': [p.as_dict() for p in recorder.programs],
                                       'askers': recorder.askers}


# What a passing part could not prove by values (its `not proven by values` lines), by test: kept
# from each test's report, under xdist the controller's, and printed at the end of the run.
_UNPROVEN = pytest.StashKey['list']()
UNPROVEN_PREFIX = 'not proven by values'


def pytest_runtest_logreport(report):
  if report.when != 'call' or not report.passed:
    return
  lines = [line for name, value in getattr(report, 'user_properties', ()) if name == 'declared_differences'
           for line in (value if isinstance(value, (list, tuple)) else [value])
           if isinstance(line, str) and line.startswith(UNPROVEN_PREFIX)]
  if lines and _CONFIG:
    nodeid = report.nodeid.split('@', 1)[0]  # without xdist's group mark
    _CONFIG[0].stash.setdefault(_UNPROVEN, []).extend((nodeid, line) for line in lines)


_CONFIG: list = []  # the session's config, for the report hook (which is given none)


def pytest_terminal_summary(terminalreporter, config):
  unproven = config.stash.get(_UNPROVEN, [])
  if unproven and getattr(config, 'workeroutput', None) is None:
    terminalreporter.section('parity: passed, but not proven by values')
    for nodeid, line in unproven:
      terminalreporter.write_line(f'{nodeid}: {line}')
  recorder = config.stash.get(_PROGRAMS, None)
  if recorder is None or getattr(config, 'workeroutput', None) is not None:
    return
  from parity.battery import program_count

  terminalreporter.section('parity: XLA programs asked for, by test')
  for line in program_count.table(sorted(recorder.programs, key=lambda p: p.asker) if _xdist(config)
                                  else recorder.programs, recorder.askers):
    terminalreporter.write_line(line)


def _xdist(config) -> bool:
  return bool(getattr(config.option, 'numprocesses', None))


@pytest.hookimpl(trylast=True)  # after the test's fixtures (and their patches) are torn down
def pytest_runtest_teardown(item, nextitem):
  del item, nextitem
  _MAP_GUARD.after_test()


_CRASHES: dict[tuple, str] = {}  # (pair, error type, message) -> the first test that raised it


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
  """A battery test that ends in the kit's answer to the pair as declared (modules it cannot
  pair), or in a run that already failed in an earlier part, fails with that answer alone:
  the kit's frames say nothing more to its user."""
  try:
    return (yield)
  except Exception as error:
    checks = sys.modules.get('parity.battery.checks')  # loaded by whatever raised these
    correspond = sys.modules.get('parity.pairs.correspond')
    if checks is not None and isinstance(error, checks.EarlierFailure):
      message = str(error)  # the first part that needed the run shows its traceback
    elif isinstance(pyfuncitem.instance, _Battery) and not isinstance(error, AssertionError):
      # A crash (not a finding) that an earlier part of the pair raised alike: one line.
      key = (pyfuncitem.instance.pair.name, type(error), str(error))
      first = _CRASHES.setdefault(key, pyfuncitem.nodeid)
      if first == pyfuncitem.nodeid:
        raise
      line = str(error).splitlines()[0] if str(error) else ''
      message = (f'{pyfuncitem.instance.pair.name}: raised as in {first}, whose report shows the'
                 f' traceback: {type(error).__name__}{": " + line if line else ""}')
    elif (correspond is not None and isinstance(error, correspond.CorrespondenceError)
          and isinstance(pyfuncitem.instance, _Battery)):
      message = f'{pyfuncitem.instance.pair.name}: {error}'
    else:
      raise
  pytest.fail(message, pytrace=False)  # outside the handler: the error is not printed twice


def _record(request, name: str, value) -> None:
  """A finding kept on the test's report (`user_properties`; junit XML shows them). Not
  `record_property`, which warns under junit_family=xunit2 (an error with -W error)."""
  request.node.user_properties.append((name, value))


def _part(name: str):
  """A test of part `name`: for a pair whose Linen side is a record (parity/records/), the part
  against the record instead, skipped with its reason where it needs the deleted side alive."""
  import functools

  def decorate(method):
    @functools.wraps(method)
    def test(self, **kwargs):
      recorded = _Lazy('parity.records.checks')
      if not recorded.recorded_pair(self.pair):
        return method(self, **kwargs)
      try:
        lines = recorded.check(self.pair, name, **{k: v for k, v in kwargs.items() if k != 'request'})
      except recorded.NotCheckable as e:
        pytest.skip(str(e))
      if 'request' in kwargs:
        _record(kwargs['request'], 'recorded', lines)
      return None
    return test
  return decorate


class _Battery:
  """Test methods; `pair` is set on the generated subclass."""

  pair: 'parity.pairs.adapter.Pair'

  @_part('structure')
  def test_structure(self):
    battery.check_structure(self.pair)

  @_part('specs')
  def test_specs(self, request):
    _record(request, 'activation_specs', battery.check_specs(self.pair))

  @_part('init')
  def test_init(self):
    battery.check_init(self.pair)

  @_part('grads')
  def test_grads(self, request):
    _record(request, 'declared_differences', battery.check_grads(self.pair))

  @pytest.mark.parametrize('init_side', ['linen', 'nnx'])
  @_part('train')
  def test_train(self, init_side, request):
    _record(request, 'declared_differences', battery.check_train(self.pair, init_side))

  @_part('eval')
  def test_eval(self, request):
    _record(request, 'eval', battery.check_eval(self.pair))

  @pytest.mark.parametrize('direction', DIRECTIONS)
  @_part('checkpoints')
  def test_checkpoints(self, direction):
    battery.check_checkpoint(self.pair, direction)

  @pytest.mark.parametrize('direction', ['linen->nnx', 'nnx->linen'])
  @_part('resume')
  def test_resume(self, direction):
    battery.check_resume(self.pair, direction)

  @pytest.mark.parametrize('direction', ['linen->nnx', 'nnx->linen'])
  @_part('convert')
  def test_convert(self, direction, request):
    _record(request, 'convert', battery.check_convert(self.pair, direction))

  @_part('mesh')
  def test_mesh(self, parity_mesh):
    battery.check_mesh(self.pair, parity_mesh)

  @_part('memory')
  def test_memory(self, request):
    _record(request, 'declared_differences', battery.check_memory(self.pair))

  @_part('program')
  def test_program(self, request):
    _record(request, 'declared_differences', battery.check_program(self.pair))

  @_part('localize')
  def test_localize(self, request):
    _record(request, 'localizer', battery.check_localize(self.pair))

  @_part('substitution')
  def test_substitution(self, request):
    _record(request, 'substitution', battery.check_substitution(self.pair))

  @_part('decode')
  def test_decode(self, decode_placement, request):
    _record(request, 'decode', battery.check_decode(self.pair, decode_placement))


class PairClass(pytest.Class):
  """The collector of one declared pair: a test class made from the battery."""

  def _getobj(self):
    pair = getattr(self.parent.obj, self.name)
    return type(self.name, (_Battery,), {'pair': pair, '__module__': self.parent.obj.__name__})

  def collect(self):
    parts = self.config.getoption('parity_parts')
    wanted = _part_names(parts) if parts is not None else set(PARTS)
    declared = self.obj.pair.parts
    if declared is not None:
      # A misspelt part would otherwise leave the pair with fewer tests, or none, silently.
      unknown = [declared] if isinstance(declared, str) else sorted(set(declared) - set(PARTS))
      if unknown:
        raise self.CollectError(  # the session fails, naming the pair (no traceback)
            f'Pair {self.obj.pair.name!r}: parts must be a sequence of part names, got unknown'
            f' {unknown}; parts: {", ".join(PARTS)}'
        )
      wanted &= set(declared)
    pair = self.obj.pair
    if not any(d.value_passes for d in pair.known_differences):
      wanted.discard('substitution')  # nothing to substitute
    if pair.decode is None:
      wanted.discard('decode')
    group = self.obj.pair.group or f'parity-{self.obj.pair.name}'
    for item in super().collect():
      part = item.name.split('[')[0][len('test_'):]
      if part in wanted:
        params = getattr(getattr(item, 'callspec', None), 'params', {})
        placement = params.get('decode_placement', params.get('parity_mesh'))
        item.add_marker(pytest.mark.xdist_group(group + group_suffix(part, placement)))
        yield item


def pytest_pycollect_makeitem(collector, name, obj):
  # A module that declares a pair has imported the adapter; others never load it.
  adapter = sys.modules.get('parity.pairs.adapter')
  if adapter is not None and isinstance(obj, adapter.Pair):
    _prepare_xla(collector.config, obj)
    return PairClass.from_parent(collector, name=name)
  return None


def pytest_generate_tests(metafunc):
  if 'parity_mesh' in metafunc.fixturenames and metafunc.cls is not None and issubclass(metafunc.cls, _Battery):
    meshes = metafunc.config.getoption('parity_mesh') or list(metafunc.cls.pair.meshes)
    metafunc.parametrize('parity_mesh', meshes)
  if 'decode_placement' in metafunc.fixturenames and metafunc.cls is not None and issubclass(metafunc.cls, _Battery):
    meshes = metafunc.config.getoption('parity_mesh') or list(metafunc.cls.pair.meshes)
    metafunc.parametrize('decode_placement', [ONE_DEVICE] + meshes)
