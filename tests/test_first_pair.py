"""The tutorial's pair (docs/first-pair.md), as the page shows it: a small Linen model, its NNX port,
and the model-level API's declaration. The page copies the block between the markers verbatim
(tests/test_docs.py checks it), and the plugin generates the battery for it here.
"""
# --- first pair ---
import flax.linen as nn
import numpy as np
import optax
from flax import nnx

import parity


class LinenMLP(nn.Module):
  hidden: int = 32
  classes: int = 4

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = nn.relu(nn.Dense(self.hidden)(x))
    x = nn.Dropout(0.1)(x, deterministic=not train)  # draws make_rng('dropout')
    return nn.Dense(self.classes)(x)


class NnxMLP(nnx.Module):
  def __init__(self, features: int = 8, hidden: int = 32, classes: int = 4, *, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(features, hidden, rngs=rngs)
    self.dropout = nnx.Dropout(0.1)
    self.out = nnx.Linear(hidden, classes, rngs=rngs)

  def __call__(self, x, train: bool = False, rngs: nnx.Rngs | None = None):
    x = nnx.relu(self.hidden(x))
    x = self.dropout(x, deterministic=not train, rngs=rngs)  # draws from the Rngs given at the call
    return self.out(x)


def batch(step: int, split: str) -> dict[str, np.ndarray]:
  """8 rows of 8 features, labelled by the sign of their sum: a pure function of (step, split)."""
  rng = np.random.default_rng([step, {'train': 0, 'eval': 1}[split]])
  x = rng.normal(size=(8, 8)).astype(np.float32)
  return {'x': x, 'label': (x.sum(-1) > 0).astype(np.int32)}


def loss(logits, batch):
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch['label']).mean()


mlp = parity.model_pair('mlp', linen=LinenMLP(), nnx=NnxMLP, inputs=lambda batch: batch['x'], loss=loss,
                        optimizer=optax.adam(1e-3), batch=batch)
# --- end of first pair ---

import jax  # noqa: E402
import pytest  # noqa: E402


def test_an_nnx_module_given_as_it_is_is_copied_by_each_create():
  """`nnx=` a module instead of its constructor: every state starts from a copy of it, which training leaves."""
  module = NnxMLP(rngs=nnx.Rngs(7))
  side = parity.nnx_side(module, inputs=lambda batch: batch['x'], loss=loss, optimizer=optax.adam(1e-3))
  first, second = side.create(0)[0], side.create(1)[0]
  assert first is not module and second is not module
  for copy in (first, second):
    assert all((a == b).all() for a, b in zip(jax.tree.leaves(nnx.state(copy)), jax.tree.leaves(nnx.state(module))))


def test_a_keyword_the_model_does_not_take_is_named_at_create():
  """A mode or a dropout keyword the model's call lacks: one message naming it and the option to change."""
  side = parity.nnx_side(NnxMLP, inputs=lambda batch: batch['x'], loss=loss, optimizer=optax.adam(1e-3),
                         mode='deterministic')
  with pytest.raises(TypeError, match=r"NnxMLP.__call__ takes no `deterministic`, which the train or eval mode"
                                      r" passes: give the model's own \(mode='train'"):
    side.create(0)
  # NNX's own idiom is named too: a new user's port that switches by model.eval() met this message.
  with pytest.raises(TypeError, match=r"model.train\(\)/model.eval\(\), as NNX ports do: mode=parity.Modes\(linen='train',"
                                      r" nnx='eval\(\)'\)"):
    side.create(0)
  side = parity.linen_side(LinenMLP(), inputs=lambda batch: batch['x'], loss=loss, optimizer=optax.adam(1e-3),
                           batch=batch, dropout='dropout_key')
  with pytest.raises(TypeError, match=r"LinenMLP.__call__ takes no `dropout_key`, which dropout='dropout_key'"
                                      r" passes the step's dropout key by: give dropout=None"):
    side.create(0)
