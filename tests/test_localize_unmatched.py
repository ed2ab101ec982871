"""NNX module calls with no Linen counterpart in the localize part: a note, or named with the fix.

tests/small_pairs.py's NNX model applies its relu as a module of its own (`block/act`), which
Linen computes inline: nothing to compare that call with, and nothing to declare. Where every
compared output and gradient is bitwise the part passes and lists the call; where something
differs it fails naming the call, which may hold the difference, and the Renames entry that
pairs a call with a Linen module under another name.
"""
from __future__ import annotations

import pytest

from parity.battery import checks
from tests import small_pairs

UNMATCHED = 'block/act (Linen Block_0/act)'


def test_unmatched_nnx_calls_are_a_note_where_everything_compared_is_bitwise():
  lines = checks.check_localize(small_pairs.same)
  assert lines[:3] == [
      'NNX module calls with no Linen counterpart, not compared (a note: every compared output and'
      f' gradient is bitwise): {UNMATCHED}',
      'forward pass: every module output bitwise equal',
      'backward pass: every parameter gradient bitwise equal',
  ]


def test_unmatched_nnx_calls_are_named_with_the_fix_where_something_differs():
  """The NNX relu made leaky: the block's output differs, and the localizer cannot say whether in
  its Dense or in the call it cannot compare."""
  with pytest.raises(AssertionError) as failure:
    checks.check_localize(small_pairs.leaky_act)
  message = str(failure.value)
  assert message.startswith("leaky_act: the localizer finds undeclared differences: ['forward divergence"
                            " in undeclared module Block_0', "), message
  assert (f'NNX module calls with no Linen counterpart, not compared: {UNMATCHED}; the difference may start'
          ' in one of them') in message
  assert "StockNnx(renames=parity.Renames((('<Linen path>', 'block/act'),)))" in message
