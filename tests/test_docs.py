"""The README and the pages under docs/: links that resolve, a short README, examples that run.

Nothing here compiles a jax program: the runnable snippets are the cheap ones
(imports, no training), each in a fresh interpreter.
"""
from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
README = REPO / 'README.md'
PAGES = sorted((REPO / 'docs').glob('*.md'))
DOCS = [README, *PAGES]
IDS = [str(p.relative_to(REPO)) for p in DOCS]

README_MAX_LINES = 250
# The line just before a ```python block in docs/*.md that the suite runs.
RUNNABLE = '<!-- runnable -->'
SHELL_LANGUAGES = ('', 'bash', 'sh', 'shell', 'console')


def _blocks(path: pathlib.Path) -> list[tuple[str, str, str, int]]:
  """Fenced code blocks: (language, text, the last non-blank line before the fence, line number)."""
  blocks, lines = [], path.read_text().splitlines()
  previous, i = '', 0
  while i < len(lines):
    stripped = lines[i].strip()
    if stripped.startswith('```'):
      indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
      language, start, body = stripped[3:].strip(), i + 1, []
      i += 1
      while i < len(lines) and not lines[i].strip().startswith('```'):
        body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
        i += 1
      assert i < len(lines), f'{path.name}:{start}: a code block that is never closed'
      blocks.append((language, '\n'.join(body) + '\n', previous, start))
      previous = ''
    elif stripped:
      previous = stripped
    i += 1
  return blocks


def _prose(path: pathlib.Path) -> str:
  """The file without its fenced code blocks and inline code spans."""
  text = re.sub(r'^[ \t]*```.*?^[ \t]*```[^\n]*$', '', path.read_text(), flags=re.M | re.S)
  return re.sub(r'(`+)(?:(?!\1).)+?\1', '', text, flags=re.S)


def _links(path: pathlib.Path) -> list[str]:
  return re.findall(r'!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)', _prose(path))


def _makefile_targets() -> set[str]:
  targets = set()
  for line in (REPO / 'Makefile').read_text().splitlines():
    match = re.match(r'^([A-Za-z0-9_.\-/ ]+?)\s*:(?!=)', line)
    if match:
      targets.update(name for name in match.group(1).split() if not name.startswith('.'))
  return targets


def test_there_are_docs_pages():
  names = {p.name for p in PAGES}
  assert {'README.md', 'plugin.md', 'cli.md', 'reference-sides.md', 'reference-tests.md', 'reference-dropout.md',
          'howto-stock-sides.md', 'howto-mesh.md', 'howto-cache.md', 'howto-differences.md'} <= names, names


KINDS = ('Tutorial', 'How-to', 'Reference', 'Explanation')


def test_the_docs_index_lists_every_page_once_under_its_kind():
  """docs/README.md is the index in four kinds, one line per page: every page under docs/ is there once."""
  text = (REPO / 'docs' / 'README.md').read_text()
  headings = re.findall(r'^## (.+)$', text, flags=re.M)
  assert tuple(headings) == KINDS, headings
  rows = [line for line in text.splitlines() if line.startswith('| [')]
  listed = [re.match(r'^\| \[[^\]]+\]\(([^)#]+)\)', row).group(1) for row in rows]
  pages = sorted(p.name for p in PAGES if p.name != 'README.md')
  assert sorted(listed) == pages, (sorted(listed), pages)


def test_the_plugin_page_is_a_map_of_at_most_150_lines():
  """docs/plugin.md is the overview and the map; the reference and the how-tos live on their own pages."""
  text = (REPO / 'docs' / 'plugin.md').read_text()
  assert text.count('\n') <= 150, text.count('\n')
  linked = set(_links(REPO / 'docs' / 'plugin.md'))
  for page in ('reference-sides.md', 'reference-tests.md', 'reference-dropout.md', 'howto-stock-sides.md',
               'howto-mesh.md', 'howto-cache.md', 'howto-differences.md', 'howto-modes.md', 'howto-rng-streams.md'):
    assert page in linked, page


@pytest.mark.parametrize('path', DOCS, ids=IDS)
def test_docs_relative_links_resolve(path):
  """Every relative link names a file or directory that exists (anchors and web links left out)."""
  missing = []
  for target in _links(path):
    if re.match(r'^[a-z][a-z0-9+.-]*:', target, flags=re.I) or target.startswith('#'):
      continue  # http(s), mailto, ...; an anchor in the same page
    file = target.split('#', 1)[0].split('?', 1)[0]
    if not (path.parent / file).exists():
      missing.append(target)
  assert not missing, f'{path.relative_to(REPO)} links to files that do not exist: {missing}'


def test_docs_link_checker_sees_links():
  """The checker above finds the README's links to the pages (so an empty find is not a pass)."""
  links = _links(README)
  assert 'docs/plugin.md' in links and 'docs/cli.md' in links, links


def test_readme_is_short():
  lines = len(README.read_text().splitlines())
  assert lines <= README_MAX_LINES, f'README.md has {lines} lines; at most {README_MAX_LINES}: move the rest to docs/'


def test_readme_keeps_the_plugin_example():
  """tests/test_plugin.py runs the ```python block after this marker; it imports the kit by `import parity`."""
  text = README.read_text()
  assert '<!-- plugin-example -->' in text
  example = text.split('<!-- plugin-example -->', 1)[1].split('```python\n', 1)[1].split('```', 1)[0]
  assert 'import parity\n' in example
  assert not re.search(r'^\s*(from|import) parity\.', example, flags=re.M), example


def _runnable() -> list[tuple[str, str]]:
  found = []
  for path in PAGES:
    for language, text, previous, line in _blocks(path):
      if previous == RUNNABLE:
        assert language == 'python', f'{path.name}:{line}: {RUNNABLE} marks a ```{language} block'
        found.append((f'{path.name}:{line}', text))
  return found


def test_docs_have_runnable_snippets():
  snippets = _runnable()
  assert any('import parity' in text and 'parity.Pair' in text for _, text in snippets), snippets


@pytest.mark.parametrize('where,code', _runnable(), ids=[where for where, _ in _runnable()])
def test_docs_runnable_snippets_run(where, code, tmp_path):
  """A snippet marked runnable runs in a fresh interpreter, outside the repository."""
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  env.pop('PYTHONPATH', None)
  result = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, f'{where}:\n{code}\n{result.stderr}'


@pytest.mark.parametrize('path', DOCS, ids=IDS)
def test_docs_make_commands_name_makefile_targets(path):
  """Every `make ...` line in a shell block names targets the Makefile has."""
  targets = _makefile_targets()
  assert {'test', 'test-all'} <= targets, targets
  for language, text, _, line in _blocks(path):
    if language not in SHELL_LANGUAGES:
      continue
    for command in text.splitlines():
      command = command.strip()
      if not command.startswith('make '):
        continue
      words = shlex.split(command.split('#', 1)[0])[1:]
      named = [w for w in words if '=' not in w and not w.startswith('-')]
      assert named, f'{path.name}:{line}: {command!r} names no target'
      unknown = [w for w in named if w not in targets]
      assert not unknown, f'{path.name}:{line}: {command!r}: no Makefile target {unknown}; targets: {sorted(targets)}'


def test_the_worked_example_page_shows_the_language_models_glue_as_it_is():
  """docs/howto-stock-sides.md copies the worked example's glue: it must be the file's, verbatim."""
  source = (REPO / 'tests' / 'test_family_lm.py').read_text()
  glue = source.split('# --- glue ---\n', 1)[1].split('# --- end of glue ---', 1)[0].strip()
  assert glue in (REPO / 'docs' / 'howto-stock-sides.md').read_text()


def _block(path: pathlib.Path, start: str, end: str) -> str:
  source = path.read_text()
  return source.split(start + '\n', 1)[1].split(end, 1)[0].strip()


def test_the_first_pair_page_shows_the_tutorials_pair_and_the_language_models_glue_as_they_are():
  """docs/first-pair.md copies tests/test_first_pair.py's pair and the model-level glue, verbatim."""
  page = (REPO / 'docs' / 'first-pair.md').read_text()
  pair = _block(REPO / 'tests' / 'test_first_pair.py', '# --- first pair ---', '# --- end of first pair ---')
  shown = page.split('<!-- first-pair -->', 1)[1].split('```python\n', 1)[1].split('```', 1)[0].strip()
  assert shown == pair
  glue = _block(REPO / 'tests' / 'test_family_lm_model_level.py', '# --- glue ---', '# --- end of glue ---')
  assert glue in (REPO / 'docs' / 'model-level.md').read_text()


def test_the_first_pair_page_is_a_tutorial_of_at_most_200_lines():
  """The tutorial stays short: the reference and the how-tos live on their own pages."""
  lines = (REPO / 'docs' / 'first-pair.md').read_text().count('\n')
  assert lines <= 200, f'docs/first-pair.md is {lines} lines'


def test_the_own_steps_page_shows_the_side_template_as_it_is():
  """docs/howto-own-steps.md copies tests/test_side_template.py's template verbatim: the suite runs its battery."""
  page = (REPO / 'docs' / 'howto-own-steps.md').read_text()
  template = _block(REPO / 'tests' / 'test_side_template.py', '# --- side template ---', '# --- end of side template ---')
  shown = page.split('<!-- side-template -->', 1)[1].split('```python\n', 1)[1].split('```', 1)[0].strip()
  assert shown == template


VERBATIM = re.compile(r'^<!-- verbatim: (\S+) -->$')


def test_docs_code_shown_as_a_files_is_in_that_file_verbatim():
  """A ```python block after `<!-- verbatim: PATH -->` shows code of PATH: each of its top-level
  pieces (separated by two blank lines) is in the file as it is, so the page cannot drift from it."""
  shown = 0
  for path in DOCS:
    for language, text, previous, line in _blocks(path):
      match = VERBATIM.match(previous)
      if not match:
        continue
      assert language == 'python', f'{path.name}:{line}: {previous} marks a ```{language} block'
      source = (REPO / match.group(1)).read_text()
      for piece in text.strip().split('\n\n\n'):
        assert piece.strip() in source, f'{path.name}:{line}: not in {match.group(1)} as shown:\n{piece}'
        shown += 1
  assert shown >= 8, shown  # docs/howto-stock-sides.md shows the language model's steps, both sides'
