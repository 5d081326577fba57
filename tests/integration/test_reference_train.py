"""The CPU training loop of the reference model under a memory cap: per-micro-batch budgets (Algorithm 1), plans
(greedy) applied through the exec hooks; the loss falls exactly as without the cap, and every micro-batch keeps
exactly the bytes the cost model predicts for its plan, within its budget."""

import subprocess
import sys

from reference_trainer.train import train


def test_training_reduces_loss_and_matches_the_cost_model():
    result = train("tiny-moe", steps=8, seed=1, memory_fraction=0.6)
    assert result["last_loss"] < 0.7 * result["first_loss"]
    assert result["max_rel_error"] == 0.0
    assert result["peak_bytes"] <= result["memory_limit_bytes"] < 4 * result["unmitigated_bytes"]
    assert result["distinct_plans"] >= 1 and result["log"][0]["plans"][0] != "none"
    for entry in result["log"]:
        assert all(kept <= budget for kept, budget in zip(entry["kept_bytes"], entry["budget_bytes"]))
    plain = train("tiny-moe", steps=8, seed=1, memory_fraction=1.0)
    assert plain["log"][0]["plans"][0] == "none"
    if not any("QUANTIZE" in p for entry in result["log"] for p in entry["plans"]):  # bitwise: recompute/offload
        assert [e["loss"] for e in result["log"]] == [e["loss"] for e in plain["log"]]


def test_train_cli_rejects_bad_steps_in_one_line():
    result = subprocess.run([sys.executable, "-m", "reference_trainer.train", "--steps", "0"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--steps" in result.stderr and "Traceback" not in result.stderr
    low = subprocess.run([sys.executable, "-m", "reference_trainer.train", "--memory-fraction", "0.01"],
                         capture_output=True, text=True)
    assert low.returncode == 2 and low.stderr.startswith("error: --memory-fraction")
