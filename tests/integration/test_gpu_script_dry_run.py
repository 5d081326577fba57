"""The prepared GPU checks (benchmarks/gpu/gpu_checks.py, kernel_constants.py) run end to end on CPU with --dry-run,
so a machine lent a GPU does not spend device time on the scripts' own bugs."""

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
        assert row["tracker_bytes"] == row["predicted_bytes"] and row["unknown_bytes"] == 0
        assert row["host_copies_exact"] and (row["host_bytes"] > 0) == ("OFFLOAD" in row["plan"])
        if "QUANTIZE" not in row["plan"]:  # on CPU the plain run is deterministic: exact means equal
            assert row["grads_max_rel_diff_plain"] == 0, row["plan"]
    overlap = result["overlap"]
    assert overlap["host_bytes_per_microbatch"] > 0
    assert {"plain_s", "offload_s", "hidden_fraction"} <= set(overlap["interleaved"])


def test_kernel_constants_dry_run(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/gpu/kernel_constants.py", "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "kernel_constants.json").read_text())
    assert {"qkv", "expert_fc1", "expert_fc2", "lm_head", "square"} <= set(result["gemm"])
    assert all(row["forward_flops_per_s"] > 0 for row in result["gemm"].values())
    assert result["copies"]["h2d_bytes_per_s"] > 0 and set(result["interference"]) == {"gemm", "elementwise"}
