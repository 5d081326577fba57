"""docs/byom.md runs: its ```python blocks are executed in order in one namespace (a step-by-step example on the
stock-module MoE decoder of ``tests/byom_model.py``), so the walkthrough cannot silently rot."""

from __future__ import annotations

import pytest
import sys
from pathlib import Path

from test_docs_examples import python_blocks

ROOT = Path(__file__).resolve().parents[2]
BYOM = ROOT / "docs" / "byom.md"


@pytest.mark.slow
def test_byom_walkthrough_runs(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    blocks = python_blocks(BYOM)
    assert len(blocks) >= 4
    namespace = {"__name__": "__main__"}
    for line, code in blocks:
        exec(compile("\n" * (line - 1) + code, str(BYOM.relative_to(ROOT)), "exec"), namespace)
    out = capsys.readouterr().out
    assert "gradients bitwise equal" in out and "analytic" in out
    assert sys.modules.get("byom_model") is not None
