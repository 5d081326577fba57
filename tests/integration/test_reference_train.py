"""The trainer in one process (PP=1, DP=1: the cost model's F/B order) on the bundled corpus under its activation
cap: the loss falls, every micro-batch keeps exactly the bytes the cost model predicts for the plan it ran, the
peak stays within the cap, and the mitigated run's losses equal an uncapped run's bitwise (recompute and offload
change no numbers)."""

import json

import pytest

from reference_trainer.train import main

ONE = ["--pp", "1", "--dp", "1", "--ep", "1"]


def _run(capsys, tmp_path, name, *args, steps=8):
    metrics = tmp_path / f"{name}.jsonl"
    main([*ONE, "--steps", str(steps), "--metrics-file", str(metrics), "--json", *args])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    steps = [json.loads(line) for line in metrics.read_text().splitlines()][:-1]
    return summary, steps


@pytest.mark.slow
def test_one_process_training_falls_and_matches_the_cost_model(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    summary, steps = _run(capsys, tmp_path, "capped")
    assert summary["final_loss"] < summary["first_loss"] - 0.3
    assert summary["max_prediction_error"] == 0.0
    assert summary["peak_activation_bytes"] <= summary["memory_cap_bytes"]
    micro = [mb for step in steps for mb in step["microbatches"]]
    assert all(mb["kept_bytes"] <= mb["budget_bytes"] for mb in micro)
    assert any(mb["plan"] != "none" for mb in micro)
    free, free_steps = _run(capsys, tmp_path, "free", "--memory-cap", "1GiB", steps=3)  # lr: not the step count's
    assert all(mb["plan"] == "none" for step in free_steps for mb in step["microbatches"])
    if not any("quantize" in mb["plan"] for mb in micro):
        assert [s["loss"] for s in steps[:3]] == [s["loss"] for s in free_steps]


@pytest.mark.slow
def test_user_data_txt_and_jsonl(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    text = "def f(x):\n    return x + 1\n" * 200
    prose = "The licence grants permission to use, copy and modify this software. " * 100
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "code.txt").write_text(text)
    (tmp_path / "data" / "docs.jsonl").write_text("\n".join(json.dumps({"text": prose, "domain": d})
                                                            for d in ("prose", "prose", "legal")) + "\n")
    main([*ONE, "--steps", "2", "--data", str(tmp_path / "data"), "--json"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps_run"] == 2 and summary["max_prediction_error"] == 0.0
