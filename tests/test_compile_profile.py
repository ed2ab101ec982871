"""benchmarks/compile_profile.py: jax's events sorted into traces, lowerings, compiles and cache loads."""
import importlib.util
import pathlib

import jax
import pytest

PATH = pathlib.Path(__file__).resolve().parent.parent / 'benchmarks' / 'compile_profile.py'


@pytest.fixture
def profile(monkeypatch):
  spec = importlib.util.spec_from_file_location('compile_profile_under_test', PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  monkeypatch.setattr(module, '_current', ['tests/test_x.py::test_y'])
  return module


def test_a_compile_after_a_cache_retrieval_is_a_load(profile):
  listen = profile._listener
  listen('/jax/core/compile/jaxpr_trace_duration', 0.5, fun_name='train_step')
  listen('/jax/core/compile/jaxpr_to_mlir_module_duration', 0.25, fun_name='jit(train_step)')
  listen('/jax/core/compile/backend_compile_duration', 4.0, fun_name='jit(train_step)')
  listen(profile.RETRIEVAL, 0.01)
  listen('/jax/core/compile/backend_compile_duration', 0.04, fun_name='jit(eval_step)')
  listen('/jax/core/compile/backend_compile_duration', 2.0, fun_name='jit(eval_step)')
  listen('/jax/some/other_event', 9.0)
  assert profile._records == [
      ('tests/test_x.py::test_y', 'trace', 'train_step', 0.5),
      ('tests/test_x.py::test_y', 'lower', 'train_step', 0.25),
      ('tests/test_x.py::test_y', 'compile', 'train_step', 4.0),
      ('tests/test_x.py::test_y', 'load', 'eval_step', 0.04),
      ('tests/test_x.py::test_y', 'compile', 'eval_step', 2.0),
  ]
  summary = profile.summarise(profile._records)
  assert '1 trace, 1 lower, 2 compile, 1 load' in summary
  assert 'eval_step (1 compiled, 1 loaded)' in summary
  assert '6.8' in summary.splitlines()[2]  # the total of every kind


def test_the_events_it_listens_to_are_the_ones_jax_sends(profile):
  """A renamed event in a jax release would make the profile silently empty."""
  seen = set()
  listener = lambda event, duration, **kwargs: seen.add(event)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    # Two jitted functions of one program: the second at least is loaded from
    # the suite's persistent cache (conftest.py).
    for _ in range(2):
      jax.jit(lambda x: x * 5 + 2)(3.0).block_until_ready()
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  for event in (*profile.EVENTS, profile.RETRIEVAL):
    assert event in seen, (event, sorted(seen))


def test_the_floor_keeps_each_groups_two_costliest_compiles(profile):
  """A pair's three groups count as one (its own-programs and mesh groups fold into it); a test without a
  group counts by its file; loads cost nothing here."""
  from parity.battery import parts

  assert profile.OWN_PROGRAMS == parts.OWN_PROGRAM_GROUP and profile.MESH == parts.MESH_GROUP
  records = [
      ('tests/a.py::lm::test_train[linen]@parity-lm', 'compile', 'train_step', 15.0),
      ('tests/a.py::lm::test_train[linen]@parity-lm', 'compile', '_train_fn', 16.0),
      ('tests/a.py::lm::test_grads@parity-lm/own-programs', 'compile', 'fn', 12.0),
      ('tests/a.py::lm::test_eval@parity-lm', 'compile', 'forward', 3.0),
      ('tests/a.py::lm::test_mesh[data=8]@parity-lm/mesh', 'compile', 'train_step', 1.0),
      ('tests/a.py::lm::test_eval@parity-lm', 'load', 'forward', 0.5),
      ('tests/b.py::test_x', 'compile', 'f', 2.0),
      ('tests/b.py::test_y', 'compile', 'g', 1.0),
      ('tests/b.py::test_z', 'compile', 'h', 4.0),
  ]
  floor, groups = profile.compile_floor(records)
  assert floor == 31.0 + 6.0
  assert groups == [('parity-lm', (31.0, 47.0)), ('tests/b.py', (6.0, 7.0))]
  assert '      37.0  of 54.0 s compiling, in 2 groups' in profile.summarise(records)
