"""The eval part: eval metrics and forward outputs in eval mode, bit for bit."""
from __future__ import annotations

from flax import nnx

from parity.battery.checks.messages import _is_dropout
from parity.battery.checks.shared import RefusedDeclaration, _Runs, _battery_frames_hidden, _runs, compare
from parity.pairs import adapter


def check_eval(pair: adapter.Pair) -> list[str]:
  """The eval steps, first from one state (the Linen run's, carried to NNX), so that a
  difference there is the eval steps' own; then each from its side's own training, which
  also reads what the checkpoint layout leaves out (state only NNX keeps)."""
  __tracebackhide__ = _battery_frames_hidden
  runs = _runs(pair)
  batch = runs.batch(0, 'eval')
  _, trained, linen_state = runs.trajectory('linen', 'linen')
  linen_side, nnx_side = runs.sides()

  def checked(side, metrics):
    return adapter.checked_metrics(pair.name, side, 'eval_step', metrics, need_loss=False)

  def evaluated(side, state):
    """(metrics, outputs): from one program where the side gives both at once (`eval_and_outputs`)."""
    both = getattr(side, 'eval_and_outputs', lambda *a: None)(state, batch)
    if both is not None:
      return checked(side, both[0]), both[1]
    return checked(side, side.eval_step(state, batch)), getattr(side, 'eval_outputs', lambda *a: None)(state, batch)

  def evaluate(side, state):
    return evaluated(side, state)[0]

  nnx_from_linen = nnx_side.from_checkpoint(trained)
  (linen_metrics, linen_outputs), (nnx_metrics, nnx_outputs) = (
      evaluated(side, state) for side, state in ((linen_side, linen_state), (nnx_side, nnx_from_linen)))
  outputs = [linen_outputs, nnx_outputs]
  if (outputs[0] is None) != (outputs[1] is None):
    raise AssertionError(f'{pair.name}: one side gives its eval-mode outputs (`forward`), the other does'
                         ' not: give both, so that the outputs are compared, or neither')
  notes = ['eval-mode outputs: not compared (give both sides `forward=`: a metric can round a'
           ' difference in the outputs away)'] if outputs[0] is None else []
  failures = []  # the outputs' and the metrics' from one state, both compared before either is reported

  def compared(*args) -> list[str]:
    try:
      return compare(pair, 'eval', *args)
    except RefusedDeclaration:  # nothing differs beyond the declarations: nothing to localize
      raise
    except AssertionError as e:
      failures.append(str(e))
      return []

  if outputs[0] is not None:
    notes = compared({'outputs': outputs[0]}, {'outputs': outputs[1]},
                     f'eval-mode outputs from one state (the Linen run\'s after {pair.steps} steps)')
  seen = notes + compared(linen_metrics, nnx_metrics,
                          f'eval metrics from one state (the Linen run\'s after {pair.steps} steps)')
  if failures:
    located = _eval_localized(runs, (linen_side, nnx_side), (linen_state, nnx_from_linen), batch)
    raise AssertionError('\n  '.join(['\n'.join(failures)] + located)) from None
  *_, nnx_state = runs.trajectory('nnx', 'linen')
  own = compare(pair, 'eval', linen_metrics, evaluate(nnx_side, nnx_state),
                'eval metrics after each side\'s own training (the eval steps agree from one state:'
                ' the trained states differ, see the train part)')
  return seen + [line for line in own if line not in seen]


def _eval_localized(runs: '_Runs', sides, states, batch) -> list[str]:
  """The eval localizer's finding, as lines for a failure message (parity.compare.eval_localize),
  with what a dropout that returned its input unchanged on one side only, or a batch norm,
  means in eval mode."""
  from parity.compare import eval_localize

  if not all(callable(getattr(s, 'eval_calls', None)) for s in sides):
    return ['eval localizer: not run (a side gives no `eval_calls`)']
  try:  # the eval part's own failure stays the message's first line, whatever the localizer meets
    result = eval_localize.localize_eval(*(side.eval_calls(state, batch) for side, state in zip(sides, states)))
  except Exception as e:  # noqa: BLE001
    return [f'eval localizer: could not run eagerly ({type(e).__name__}: {e})']
  lines = result.lines()
  found = result.first()
  if found is not None and found['unchanged'] is not None and _is_dropout(found['path']):
    on = 'NNX' if found['unchanged'] == 'Linen' else 'Linen'
    lines.append(f"{found['path']}: {on}'s dropout dropped in eval mode, {found['unchanged']}'s did not: {on}'s"
                 " eval step leaves it on. Give it the eval mode there (deterministic=True at the call,"
                 " model.eval() or nnx.view(model, deterministic=True) in an NNX eval step, train=False"
                 " in a Linen apply)")
  elif found is not None and found['unchanged'] is None and isinstance(runs.nnx_module_at(found['path']), nnx.BatchNorm):
    lines.append(f"{found['path']}: a batch norm: in eval mode both sides normalise with its running averages"
                 " (Linen: use_running_average=True, from train=False; NNX: model.eval() sets it, as"
                 " nnx.view(model, use_running_average=True) does: nnx.view(model, deterministic=True) sets"
                 " the dropouts' mode only). A side that normalises with the batch's statistics in its eval"
                 " step differs here")
  return lines
