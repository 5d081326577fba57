"""docs/hf.md runs: its ```python blocks (a plan, then the gate's re-plan) are executed in order in one namespace."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_docs_examples import python_blocks

ROOT = Path(__file__).resolve().parents[2]
HF = ROOT / "docs" / "hf.md"


@pytest.mark.slow
def test_hf_example_runs(capsys):
    pytest.importorskip("transformers")
    blocks = python_blocks(HF)
    assert blocks
    namespace = {"__name__": "__main__"}
    for line, code in blocks:
        exec(compile("\n" * (line - 1) + code, str(HF.relative_to(ROOT)), "exec"), namespace)
    out = capsys.readouterr().out
    assert "exactly as predicted" in out and "re-planned" in out
