"""Text goldens: sorted, one line per item, diffable. PARITY_UPDATE_GOLDEN=1 rewrites them."""
from __future__ import annotations

import difflib
import os
import pathlib

GOLDEN_DIR = pathlib.Path(__file__).parent / 'golden'
UPDATE_ENV = 'PARITY_UPDATE_GOLDEN'


def check_golden(name: str, text: str) -> None:
  path = GOLDEN_DIR / name
  if os.environ.get(UPDATE_ENV) == '1':
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return
  if not path.exists():
    raise AssertionError(f'golden {name} missing; create it with {UPDATE_ENV}=1')
  expected = path.read_text()
  if expected != text:
    diff = ''.join(difflib.unified_diff(
        expected.splitlines(True), text.splitlines(True), f'golden/{name}', 'now'
    ))
    raise AssertionError(
        f'golden {name} changed (rerun with {UPDATE_ENV}=1 if intended):\n{diff}'
    )
