"""The CPU training loop of the reference model: the loss falls and every micro-batch keeps exactly the predicted
activation bytes."""

import subprocess
import sys

from reference_trainer.train import train


def test_training_reduces_loss_and_matches_the_cost_model():
    result = train("tiny-moe", steps=12, seed=1)
    assert result["last_loss"] < 0.5 * result["first_loss"]
    assert result["max_rel_error"] == 0.0
    for entry in result["log"]:
        assert all(kept <= budget for kept, budget in zip(entry["kept_bytes"], entry["budget_bytes"]))


def test_train_cli_rejects_bad_steps_in_one_line():
    result = subprocess.run([sys.executable, "-m", "reference_trainer.train", "--steps", "0"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--steps" in result.stderr and "Traceback" not in result.stderr
