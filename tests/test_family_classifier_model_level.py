"""The convolutional classifier through the model-level API: the two model classes
(models/linen/classifier.py, models/nnx/classifier.py), a loss with a metric and an optimizer; the kit
writes both sides' create, train, eval and forward (`parity.model_pair`), none of the family's steps.

Linen's `batch_stats` collection (a field of the kit's TrainState, mutable in the train step)
against `nnx.BatchStat` (updated in place), train and eval mode by `train=`, and dropout on, its key
passed at the call on both sides (`dropout='dropout_key'`: the models hand it to the stock
dropout). The one declared difference is flax's stock batch norm's lowering, as for the family's
own pair (tests/test_family_classifier.py). The glue is the block between the markers.
"""
# --- glue ---
import optax
import parity
from models.families import ClassifierConfig, classifier_batch
from models.linen import classifier as linen_classifier
from models.nnx import classifier as nnx_classifier

CFG = ClassifierConfig()


def loss(logits, batch):
  """Cross entropy, and the accuracy as a metric of the train and eval steps."""
  labels = batch['labels']
  accuracy = (logits.argmax(-1) == labels).mean()
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), {'accuracy': accuracy}


BATCH_NORMS = parity.KnownDifference(('BatchNorm_0', 'BatchNorm_1'), ('program',), "flax's stock batch norm lowers"
                                     ' otherwise in Linen and NNX (same numbers)', max_changed_lines=520)
classifier_model_level = parity.model_pair(
    'classifier_model_level', linen=linen_classifier.Classifier(CFG),
    nnx=lambda rngs: nnx_classifier.Classifier(CFG, rngs=rngs), inputs=lambda batch: batch['images'], loss=loss,
    optimizer=optax.sgd(CFG.learning_rate, momentum=0.9), batch=lambda step, split: classifier_batch(CFG, step, split),
    dropout='dropout_key', known_differences=(BATCH_NORMS,))
# --- end of glue ---

import jax  # noqa: E402
import pytest  # noqa: E402

from parity.pairs import adapter, model_level, stock_layout  # noqa: E402


def test_the_linen_state_holds_the_batch_statistics_as_a_train_state_field():
  """`init`'s `batch_stats` is a field of the kit's TrainState, in the family's own checkpoint layout."""
  linen, nnx_side = adapter.make_pair_sides(classifier_model_level, None)  # the renames inferred
  state = linen.create(0)
  assert type(state).collections == ('batch_stats',) and isinstance(state, model_level.TrainState)
  family = linen_classifier.create_train_state(CFG, 0)
  assert jax.tree.structure(state.batch_stats) == jax.tree.structure(family.batch_stats)
  assert sorted(linen.to_checkpoint(linen.init(0))) == sorted(stock_layout.linen_to_checkpoint(family))
  assert sorted(linen.abstract_checkpoint()) == sorted(nnx_side.abstract_checkpoint())


@pytest.mark.xdist_group('parity-classifier_model_level')
def test_the_losss_metric_comes_back_from_both_steps_and_training_moves_the_statistics():
  """The loss's metric (accuracy) comes back from the train and eval steps; training moves the statistics."""
  from parity.battery import checks

  runs = checks._runs(classifier_model_level)
  metrics, final, _ = runs.trajectory('nnx', 'linen')
  assert all(sorted(m) == ['accuracy', 'loss'] for m in metrics), metrics
  for side in runs.sides():
    assert sorted(side.eval_step(side.from_checkpoint(final), runs.batch(0, 'eval'))) == ['accuracy', 'loss']
  start = runs.start('linen')
  moved = [p for p in start if p.startswith('batch_stats/') and not (start[p] == final[p]).all()]
  assert moved, 'the train steps left the batch statistics as they were'
