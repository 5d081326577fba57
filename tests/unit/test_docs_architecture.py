"""docs/architecture.md names only what exists: every dotted name in backticks that starts with ``bagualu2.`` or
``reference_trainer.`` and every ``*.py`` path in backticks is found in the source tree.

Nothing is imported: names are resolved against the files under the repository root (``src/bagualu2/...``,
``reference_trainer/...``), and a name below a module (``bagualu2.runtime.after_gate``) must be bound at the top
level of that module's source (a def, class, assignment, import or ``__all__`` entry, read with :mod:`ast`), or,
one level further, in the body of a class defined there (``DeferredPlanner.after_gate``).
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = {"bagualu2": ROOT / "src" / "bagualu2", "reference_trainer": ROOT / "reference_trainer"}

CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
PY_PATH = re.compile(r"(?<![\w./-])([\w./-]*\w\.py)(?:::(\w+))?(?![\w])")
DOTTED = re.compile(r"(?<![\w./])((?:bagualu2|reference_trainer)(?:\.[A-Za-z_]\w*)+)")


def spans(text: str) -> list[str]:
    """The text of every inline code span (fenced blocks are diagrams and commands, not names)."""
    return CODE_SPAN.findall(FENCE.sub("", text))


def references(text: str) -> tuple[list[tuple[str, str | None]], list[str]]:
    """``([(path, name after ::)], [dotted names])`` mentioned in code spans of ``text``."""
    paths, dotted = [], []
    for span in spans(text):
        for match in PY_PATH.finditer(span):
            paths.append((match.group(1), match.group(2)))
        dotted.extend(DOTTED.findall(PY_PATH.sub(" ", span)))
    return paths, dotted


def _module_file(parts: list[str]) -> Path | None:
    """The file of module ``parts`` (``__init__.py`` for a package), or None."""
    base = PACKAGES[parts[0]].joinpath(*parts[1:])
    if base.is_dir() and (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _bound(body: list[ast.stmt]) -> set[str]:
    """The names a module or class body binds (defs, classes, assignments, imports, ``__all__`` entries)."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                names.update(n.value for n in ast.walk(node.value)
                             if isinstance(n, ast.Constant) and isinstance(n.value, str))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try)):
            names |= _bound(node.body) | _bound(getattr(node, "orelse", []))
    return names


def _import_source(path: Path, name: str) -> tuple[Path, str] | None:
    """Where a ``from MODULE import name`` at the top of ``path`` takes ``name`` from, if MODULE is in the tree."""
    package = path.parent
    for node in _tree(path).body:
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias in node.names:
            if (alias.asname or alias.name) != name:
                continue
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.parent
                if node.module is None:  # from . import module: its attributes are the module's
                    return None
                target = base.joinpath(*node.module.split("."))
            elif node.module and node.module.split(".")[0] in PACKAGES:
                parts = node.module.split(".")
                target = PACKAGES[parts[0]].joinpath(*parts[1:])
            else:
                return None
            source = target / "__init__.py" if target.is_dir() else target.with_suffix(".py")
            return (source, alias.name) if source.is_file() else None
    return None


def _defined(path: Path, names: list[str], depth: int = 0) -> bool:
    """``names[0]`` is bound at the top level of ``path``; ``names[1]``, if any, in the class ``names[0]``, followed
    through ``from ... import`` re-exports within the tree (a name imported from outside is not followed)."""
    tree = _tree(path)
    if names[0] not in _bound(tree.body):
        return False
    if len(names) == 1:
        return True
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == names[0]]
    if classes:
        return len(names) == 2 and names[1] in _bound(classes[0].body)
    source = _import_source(path, names[0])
    if source is None or depth > 8:
        return True  # bound some other way (a module, a name from outside): its attributes are not followed
    return _defined(source[0], [source[1], *names[1:]], depth + 1)


def dotted_exists(name: str) -> bool:
    """``name`` is a module or package of the tree, or a name defined in the longest module prefix of it."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        path = _module_file(parts[:cut])
        if path is not None:
            return cut == len(parts) or _defined(path, parts[cut:])
    return False


def _all_py_files() -> list[Path]:
    """Every ``*.py`` of the project's own folders (not the virtual environment)."""
    return [p for folder in ("src", "reference_trainer", "tests", "benchmarks", "scripts")
            for p in (ROOT / folder).rglob("*.py")]


def path_exists(path: str, name: str | None) -> bool:
    """``path`` is a file of the repository, of ``src/bagualu2`` (``runtime/path.py``), of ``reference_trainer``
    (``experiments/chaos.py``), or, for a bare file name, anywhere in the tree; ``name`` (``file.py::name``) is
    defined in it."""
    if "/" in path:
        found = [base / path for base in (ROOT, PACKAGES["bagualu2"], ROOT / "reference_trainer")
                 if (base / path).is_file()]
    else:
        found = [p for p in _all_py_files() if p.name == path]
    return bool(found) and (name is None or any(_defined(p, [name]) for p in found))


def missing(text: str) -> list[str]:
    paths, dotted = references(text)
    gone = [f"{p}::{n}" if n else p for p, n in paths if not path_exists(p, n)]
    return gone + [d for d in dotted if not dotted_exists(d)]


def test_architecture_names_only_what_exists():
    text = DOC.read_text(encoding="utf-8")
    paths, dotted = references(text)
    assert len(dotted) >= 20 and len(paths) >= 20  # the page is parsed, not skipped
    assert missing(text) == []


@pytest.mark.parametrize("bogus", [
    "`bagualu2.sim.replay_iteration`",            # a name the package no longer re-exports
    "`bagualu2.budget.downgrade_needed`",
    "`reference_trainer.nonexistent`",
    "`bagualu2.runtime.DecisionPath.no_such_method`",
    "`reference_trainer/nonexistent.py`",
    "`src/bagualu2/runtime/nonexistent.py`",
    "`runtime/nonexistent.py`",
    "`mitigation/solution.py::no_such_function`",
    "`python -m reference_trainer.no_such_tool`",
])
def test_a_bogus_name_is_caught(bogus):
    assert missing(f"text {bogus} text") != []


@pytest.mark.parametrize("real", [
    "`bagualu2.runtime.after_gate`", "`bagualu2.exec.DualBatchExecutor`", "`reference_trainer.resilience.Guard`",
    "`python -m reference_trainer.experiments.chaos`", "`mitigation/solution.py::make_solution`", "`watchdog.py`",
    "`bagualu2.costmodel.evaluate`", "`bagualu2.cli | reference_trainer`",
])
def test_a_real_name_passes(real):
    assert missing(f"text {real} text") == []
