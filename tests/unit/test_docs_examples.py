"""The documentation's examples run: every ```python block of docs/api.md and the README's "Library" block is
executed in a fresh namespace, so an example cannot silently rot when an API changes, and what it prints is what
its ``# ->`` comments show (whitespace aside: the docs wrap long lines; ``...`` / ``…`` elide a part).

A failing block reports its file and line (the block is compiled at its own line numbers in the Markdown file).
The blocks use only small inputs (preset graphs, the tiny-moe reference model on CPU): a few seconds in all.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def python_blocks(path: Path, *, section: str | None = None) -> list[tuple[int, str]]:
    """``(first line number, code)`` of every ```python block of ``path`` (only those under the ``## section``
    heading when given)."""
    text = path.read_text(encoding="utf-8")
    low, high = 0, len(text)
    if section is not None:
        heading = re.search(rf"^## {re.escape(section)}[ \t]*$", text, re.M)
        assert heading, f"{path.name} has no '## {section}' section"
        following = re.compile(r"^## ", re.M).search(text, heading.end())
        low, high = heading.end(), following.start() if following else len(text)
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)
            if low <= m.start() < high]


API = ROOT / "docs" / "api.md"
README = ROOT / "README.md"
BLOCKS = [(API, line, code) for line, code in python_blocks(API)] + \
         [(README, line, code) for line, code in python_blocks(README, section="Library")]


def test_the_documents_have_their_examples():
    assert len([b for b in BLOCKS if b[0] == API]) >= 6  # one per package at least: costmodel ... exec
    assert len([b for b in BLOCKS if b[0] == README]) == 1


@pytest.mark.slow
@pytest.mark.parametrize(("path", "line", "code"), BLOCKS,
                         ids=[f"{path.name}:{line}" for path, line, _ in BLOCKS])
def test_example_runs(path: Path, line: int, code: str, capsys):
    # pad with newlines so tracebacks point at the Markdown file's own line numbers
    compiled = compile("\n" * (line - 1) + code, str(path.relative_to(ROOT)), "exec")
    namespace = {"__name__": "__main__"}
    exec(compiled, namespace)  # a fresh namespace per block: each example is a complete program
    printed = capsys.readouterr().out
    assert printed  # every example shows something
    got, position = _squash(printed), 0
    for shown in shown_outputs(code):
        for fragment in filter(None, re.split(r"…|\.\.\.", _squash(shown))):
            found = got.find(fragment, position)
            assert found >= 0, f"{path.name}:{line}: the example no longer prints {shown!r}"
            position = found + len(fragment)


def shown_outputs(code: str) -> list[str]:
    """What a block's comments say it prints: each ``# -> text`` with its ``#    more`` continuation lines."""
    lines, shown = code.splitlines(), []
    for k, text in enumerate(lines):
        first = re.match(r"\s*# -> (.*)$", text)
        if first:
            following = (re.match(r"\s*#    (.*)$", t) for t in lines[k + 1:])
            more = [m.group(1) for m in itertools.takewhile(bool, following)]
            shown.append(" ".join([first.group(1), *more]))
    return shown


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def test_shown_outputs_are_read_with_their_continuations():
    code = "x = 1\nprint(x)\n# -> 1 2\n#    3\ny = 2  # -> not a comment line\n#    4\n"
    assert shown_outputs(code) == ["1 2 3"]
