"""The package layering (docs/architecture.md), enforced: import-linter's contracts (pyproject.toml), no import
cycle between any two modules (grimp's graph), no module importing another module's private name, the pure packages
without torch."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

PURE = ["bagualu2.costmodel", "bagualu2.budget", "bagualu2.mitigation", "bagualu2.fusion", "bagualu2.runtime",
        "bagualu2.sim", "bagualu2.cli"]

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bagualu2", "reference_trainer")


@pytest.mark.launch
def test_import_linter_contracts_hold():
    linter = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(linter)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "0 broken" in result.stdout, result.stdout[-3000:] + result.stderr[-2000:]


def import_cycles(*packages: str) -> list[tuple[str, str]]:
    """Pairs ``(a, b)``: ``a`` imports ``b`` and ``b`` reaches ``a`` back through imports."""
    graph = grimp.build_graph(*packages)
    return [(module, imported) for module in sorted(graph.modules)
            for imported in graph.find_modules_directly_imported_by(module)
            if imported != module and graph.chain_exists(imported=module, importer=imported)]


def test_no_import_cycle_between_modules():
    assert import_cycles(*PACKAGES) == []


def test_the_reference_model_is_architecture_only():
    """``reference_trainer/model.py`` reaches nothing of ``bagualu2.exec``: the trainer instruments it from outside."""
    graph = grimp.build_graph(*PACKAGES)
    assert not graph.chain_exists(importer="reference_trainer.model", imported="bagualu2.exec", as_packages=True)


def test_the_cycle_check_finds_a_cycle(tmp_path, monkeypatch):
    package = tmp_path / "cyclic_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("from .a import x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert ("cyclic_pkg.a", "cyclic_pkg.b") in import_cycles("cyclic_pkg")


def _sources():
    for package in PACKAGES:
        base = ROOT / "src" / package if (ROOT / "src" / package).exists() else ROOT / package
        yield from sorted(base.rglob("*.py"))


@pytest.mark.slow
def test_no_module_imports_a_private_name_of_another():
    offenders = []
    for path in _sources():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        offenders.append(f"{path.relative_to(ROOT)}: from {node.module} import {alias.name}")
    assert offenders == []


# torch's private pipelining APIs the runtime schedule builds on (the torch range is pinned for them)
PRIVATE_ALLOWED = {("reference_trainer/pipeline.py", "torch.distributed.pipelining.schedules")}
PUBLIC_DESPITE_UNDERSCORE = {("os", "_exit")}  # documented public API


def _module_bindings(tree: ast.AST, path: Path) -> dict[str, str]:
    """``{local name: module}`` for the names a module binds to other modules by ``import`` / ``from ... import``."""
    package = ".".join(path.relative_to(ROOT / "src" if "src" in path.parts else ROOT).with_suffix("").parts[:-1])
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                    alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, node.module] if node.module else parts)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                try:
                    found = importlib.util.find_spec(full) is not None
                except Exception:  # a package that fails to import here (torchtitan without triton) binds nothing
                    found = False
                if found:
                    bound[alias.asname or alias.name] = full
    return bound


def private_attribute_uses(path: Path) -> list[str]:
    """``module._name`` reads of another module's private names through a module alias (``S._Action``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bound = _module_bindings(tree, path)
    where = path.relative_to(ROOT).as_posix()
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and node.attr.startswith("_") and not node.attr.startswith("__")
                and (where, bound[node.value.id]) not in PRIVATE_ALLOWED
                and (bound[node.value.id], node.attr) not in PUBLIC_DESPITE_UNDERSCORE):
            found.append(f"{where}:{node.lineno}: {node.value.id}.{node.attr} ({bound[node.value.id]})")
    return found


@pytest.mark.slow
def test_no_module_reads_a_private_name_of_another_through_its_module():
    offenders = [use for path in _sources() for use in private_attribute_uses(path)]
    assert offenders == []


def test_the_private_attribute_rule_finds_one(tmp_path):
    source = ROOT / "reference_trainer" / "zz_private_probe.py"
    try:
        source.write_text("from . import checkpoint\nimport torch.distributed as dist\n"
                          "x = checkpoint._sha256\ny = dist._coalescing_manager\n")
        assert [use.split(": ", 1)[1] for use in private_attribute_uses(source)] == [
            "checkpoint._sha256 (reference_trainer.checkpoint)", "dist._coalescing_manager (torch.distributed)"]
    finally:
        source.unlink()


@pytest.mark.launch
def test_the_pure_packages_import_with_torch_blocked():
    """One process with torch blocked: the data module imports neither torch nor bagualu2; the Gantt module no
    matplotlib; every pure package imports and Algorithm 1 runs."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "import reference_trainer.data\n"
            "assert not [m for m in sys.modules if m.startswith('bagualu2')]\n"
            "import bagualu2.fusion.gantt\n"
            "assert 'matplotlib' not in sys.modules\n"
            "import importlib\n"
            f"for name in {PURE!r}:\n"
            "    importlib.import_module(name)\n"
            "from bagualu2.budget import BudgetAssigner\n"
            "assert BudgetAssigner(m_max_bytes=4, m0_bytes=1, num_microbatches=2, num_warmup=2)"
            ".next_forward_budget() == 2\n"
            "assert sys.modules['torch'] is None\n")
    run_clean(code)


@pytest.mark.launch
def test_the_command_line_loads_or_tools_and_its_commands_only_when_used():
    """``python -m bagualu2.cli.launch`` (the agent of ``bagualu2 train``) imports no command module, and the
    command line imports neither OR-Tools nor torch before a command asks for them: a Ctrl-C while OR-Tools'
    extension initialises surfaces as an ``ImportError`` no handler can tell from a broken install."""
    code = ("import sys\n"
            "import bagualu2.cli.launch\n"
            "assert not [m for m in sys.modules if m.endswith('_cmd') or m == 'bagualu2.cli.commands'], sys.modules\n"
            "import bagualu2.cli.commands\n"
            "assert not [m for m in sys.modules if m.startswith(('ortools', 'torch'))]\n"
            "from bagualu2.cli import app, main\n"
            "assert app is bagualu2.cli.commands.app and callable(main)\n")
    run_clean(code)


def run_clean(code: str) -> None:
    """``code`` in a fresh interpreter (nothing this test process imported): it must exit 0."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
