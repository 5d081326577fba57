"""The prepared GPU check (benchmarks/gpu/gpu_checks.py) runs end to end on CPU with --dry-run, so a session lent a
GPU does not spend device time on the script's own bugs."""

import pytest
import json
import subprocess
import sys
from pathlib import Path

pytestmark = pytest.mark.launch

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_checks_dry_run(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/gpu/gpu_checks.py", "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_checks.json").read_text())
    for row in result["memory"]:
        assert row["tracker_bytes"] == row["predicted_bytes"]
        if "QUANTIZE" not in row["plan"]:
            assert row["grads_bitwise_equal_plain"], row["plan"]
    assert result["overlap"]["host_bytes"] > 0
