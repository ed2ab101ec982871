"""A model whose constructor needs the mesh (`Transformer(config, mesh)`, as production models are
built), declared through `parity.per_mesh`: each mesh's sides get the model made for that mesh,
made once, and one device gets `make(None)`."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parity
from parity.battery import checks

pytestmark = pytest.mark.xdist_group('parity-per-mesh')


def _constrained(x, mesh):
  """The hidden activation split over the mesh's batch axis, as a mesh-built model places it."""
  if mesh is None:
    return x
  return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data')))


class LinenNet(nn.Module):
  mesh: jax.sharding.Mesh | None = None

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(_constrained(nn.relu(nn.Dense(8)(x)), self.mesh))


class NnxNet(nnx.Module):
  def __init__(self, mesh, *, rngs: nnx.Rngs):
    self.mesh = mesh
    self.hidden = nnx.Linear(3, 8, rngs=rngs)
    self.out = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.out(_constrained(nnx.relu(self.hidden(x)), self.mesh))


def batch(step, split='train'):
  rng = np.random.default_rng(2 * step + (split == 'eval'))
  return {'x': rng.standard_normal((8, 3)).astype(np.float32), 'y': rng.standard_normal((8, 2)).astype(np.float32)}


MADE: list[tuple[str, object]] = []


def _linen(mesh):
  MADE.append(('linen', mesh))
  return LinenNet(mesh)


def _nnx(mesh):
  MADE.append(('nnx', mesh))
  return lambda rngs: NnxNet(mesh, rngs=rngs)


def _pair():
  return parity.model_pair('per_mesh', linen=parity.per_mesh(_linen), nnx=parity.per_mesh(_nnx),
                           inputs=lambda b: b['x'], loss=lambda y, b: jnp.mean((y - b['y']) ** 2),
                           optimizer=optax.adam(1e-2), batch=batch, mode=None, dropout=None, steps=2,
                           meshes=('data=8',))


def test_each_mesh_gets_the_model_made_for_it_once():
  """make_sides(None) and make_sides(mesh) each build their models from `make(mesh)`, once per mesh."""
  MADE.clear()
  pair = _pair()
  assert MADE == []  # nothing is made before a side is asked for
  mesh = pair.mesh('data=8')
  for _ in range(2):
    linen, nnx_side = pair.make_sides(None)
    linen_mesh, nnx_mesh = pair.make_sides(mesh)
  assert MADE == [('linen', None), ('nnx', None), ('linen', mesh), ('nnx', mesh)], MADE
  assert linen.template is not None and nnx_mesh.mesh is mesh


def test_a_mesh_built_pair_passes_its_train_and_mesh_parts():
  """The battery's train part (one device) and mesh part (data=8) on the mesh-built models."""
  pair = _pair()
  assert checks.check_train(pair, 'linen') == []
  assert checks.check_mesh(pair, 'data=8') == []


def test_per_mesh_takes_a_function_of_the_mesh():
  with pytest.raises(TypeError, match='parity.per_mesh takes a function of the mesh'):
    parity.per_mesh(LinenNet())


def test_an_nnx_model_that_ignores_its_mesh_fails_the_mesh_part_naming_the_placement():
  """Planted: the NNX side's models all made as for one device (the mesh dropped): the mesh part
  fails, naming the intermediates Linen places on the mesh and NNX does not."""
  pair = parity.model_pair('per_mesh_dropped', linen=parity.per_mesh(_linen),
                           nnx=parity.per_mesh(lambda mesh: _nnx(None)),
                           inputs=lambda b: b['x'], loss=lambda y, b: jnp.mean((y - b['y']) ** 2),
                           optimizer=optax.adam(1e-2), batch=batch, mode=None, dropout=None, steps=2,
                           meshes=('data=8',))
  with pytest.raises(AssertionError) as failure:
    checks.check_mesh(pair, 'data=8')
  assert 'sharding annotations of the train steps differ on data=8' in str(failure.value), str(failure.value)
  assert 'places its intermediates otherwise' in str(failure.value)
