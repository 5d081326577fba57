"""The ``bagualu2`` command line: presets, memory, one-line errors with exit code 2, atomic writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bagualu2 import costmodel
from bagualu2.cli import app
from bagualu2.cli.common import atomic_write_bytes, atomic_write_text

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})  # deterministic table layout


def run(*args: str):
    result = runner.invoke(app, list(args))
    assert "Traceback" not in result.stdout + result.stderr
    return result


# ---- presets -----------------------------------------------------------------------------------------------
def test_presets_table() -> None:
    result = run("presets")
    assert result.exit_code == 0, result.stderr
    for name in costmodel.presets.model_names() + costmodel.presets.hardware_names():
        assert name in result.stdout
    total, active = costmodel.num_parameters(costmodel.presets.model("glm-423b-a30b")[0])
    assert f"{total / 1e9:.1f}" in result.stdout and f"{active / 1e9:.1f}" in result.stdout  # billions


def test_presets_json() -> None:
    result = run("presets", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert [m["name"] for m in data["models"]] == list(costmodel.presets.model_names())
    assert [h["name"] for h in data["hardware"]] == list(costmodel.presets.hardware_names())
    glm = next(m for m in data["models"] if m["name"] == "glm-423b-a30b")
    model, parallel = costmodel.presets.model("glm-423b-a30b")
    assert (glm["total_params"], glm["active_params"]) == costmodel.num_parameters(model)
    assert glm["world_size"] == parallel.world_size == 512
    assert glm["parallel"]["pp"] == parallel.pp and glm["model"]["num_experts"] == model.num_experts
    assert data["hardware"][0]["hbm_bytes"] == costmodel.presets.hardware("paper-gpu").hbm_bytes


# ---- memory ------------------------------------------------------------------------------------------------
def test_memory_default_table() -> None:
    result = run("memory")
    assert result.exit_code == 0, result.stderr
    assert "glm-423b-a30b" in result.stdout and "paper-gpu" in result.stdout and "imbalance 1" in result.stdout
    model, parallel = costmodel.presets.model("glm-423b-a30b")
    hardware = costmodel.presets.hardware("paper-gpu")
    fits = [costmodel.stage_memory(model, parallel, hardware, stage=s).fits for s in range(parallel.pp)]
    assert result.stdout.count(" OOM ") == fits.count(False)
    assert result.stdout.count(" OK ") == fits.count(True)


@pytest.mark.parametrize(("preset", "hw", "imbalance", "plan"), [
    ("tiny-moe", "cpu", 1.0, None),
    ("tiny-moe", "cpu", 1.0, "expert_act=RECOMPUTE,core_attn=OFFLOAD"),  # ep=1: imbalance 1 only
    ("glm-188b-a20b", "h100", 2.0, "expert_fc1=R"),
])
def test_memory_json_matches_costmodel(preset: str, hw: str, imbalance: float, plan: str | None) -> None:
    args = ["memory", "--model", preset, "--hardware", hw, "--imbalance", str(imbalance), "--json"]
    result = run(*args, *(["--plan", plan] if plan else []))
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    model, parallel = costmodel.presets.model(preset)
    hardware = costmodel.presets.hardware(hw)
    parsed = costmodel.Plan.from_str(plan) if plan else None
    assert (data["model"], data["hardware"], data["imbalance"]) == (preset, hw, imbalance)
    assert data["plan"] == str(parsed or costmodel.Plan())
    assert len(data["stages"]) == parallel.pp
    for row in data["stages"]:
        mem = costmodel.stage_memory(model, parallel, hardware, plan=parsed, stage=row["stage"],
                                     imbalance=imbalance)
        for field in ("static_bytes", "activation_peak_bytes", "peak_bytes", "capacity_bytes", "m_max_bytes",
                      "m0_bytes", "inflight_chunks"):
            assert row[field] == getattr(mem, field) and isinstance(row[field], int), field
        assert row["inflight_microbatches"] == mem.inflight_microbatches
        assert row["fits"] is mem.fits and row["headroom_bytes"] == mem.headroom_bytes
        assert row["static_bytes"] == costmodel.static_bytes(model, parallel, stage=row["stage"])


def test_memory_hardware_json_file_and_single_stage(tmp_path: Path) -> None:
    custom = costmodel.presets.hardware("cpu").replace(name="tiny-box", hbm_bytes=3 << 20)
    path = tmp_path / "box.json"
    path.write_text(custom.to_json())
    result = run("memory", "-m", "tiny-moe", "-H", str(path), "--stage", "1", "--json",
                 "--plan", "L2.qkv/L2.norm1_out=OFFLOAD")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["hardware"] == "tiny-box" and [row["stage"] for row in data["stages"]] == [1]
    assert data["stages"][0]["capacity_bytes"] == 3 << 20
    table = run("memory", "-m", "tiny-moe", "-H", str(path))
    assert table.exit_code == 0 and "OOM" in table.stdout  # 3 MiB holds stage 1 but not stage 0


# ---- errors: one line on stderr, exit code 2, never a traceback ---------------------------------------------
@pytest.mark.parametrize(("args", "option"), [
    (["--model", "nope"], "--model"),
    (["--hardware", "nope"], "--hardware"),
    (["--imbalance", "0.5"], "--imbalance"),
    (["--imbalance", "abc"], "--imbalance"),
    (["--imbalance", "inf"], "--imbalance"),
    (["--plan", "foo=BAR"], "--plan"),
    (["--plan", "expert_act"], "--plan"),
    (["--plan", "L99.qkv/L99.x=OFFLOAD"], "--plan"),
    (["--hardware", "missing.json"], "--hardware"),
    (["--stage", "8"], "--stage"),
])
def test_memory_bad_input_is_one_line(args: list[str], option: str) -> None:
    result = run("memory", *args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {option}: "), result.stderr
    assert result.stdout == ""


def test_unknown_model_lists_valid_names() -> None:
    line = run("memory", "--model", "x").stderr.strip()
    assert "unknown model preset 'x'" in line and "tiny-moe" in line


@pytest.mark.parametrize("text", ["{not json", '{"name": "x"}', '{"bogus": 1}', "[1, 2]"])
def test_bad_hardware_json(tmp_path: Path, text: str) -> None:
    path = tmp_path / "hw.json"
    path.write_text(text)
    result = run("memory", "--hardware", str(path))
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("error: --hardware: ")


def test_typer_usage_errors_keep_exit_code_2() -> None:
    assert run("memory", "--no-such-flag").exit_code == 2
    assert run("no-such-command").exit_code == 2


@pytest.mark.launch
def test_subprocess_console_script() -> None:
    script = Path(sys.executable).with_name("bagualu2")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "bagualu2.cli"]
    env = {**os.environ, "NO_COLOR": "1"}
    ok = subprocess.run([*cmd, "memory", "--model", "tiny-moe", "--hardware", "cpu", "--json"],
                        capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0 and "Traceback" not in ok.stderr, ok.stderr
    assert len(json.loads(ok.stdout)["stages"]) == 2
    bad = subprocess.run([*cmd, "memory", "--imbalance", "abc"], capture_output=True, text=True, timeout=120,
                         env=env)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == ["error: --imbalance: must be a number >= 1 (max/mean device load), "
                                               "got 'abc'"]


@pytest.mark.launch
@pytest.mark.parametrize("module", ["bagualu2.cli", "bagualu2"])
def test_python_dash_m(module: str) -> None:
    done = subprocess.run([sys.executable, "-m", module, "presets", "--json"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr
    assert set(json.loads(done.stdout)) == {"models", "hardware"}


# ---- atomic writes -----------------------------------------------------------------------------------------
def test_atomic_write(tmp_path: Path) -> None:
    target = tmp_path / "out.txt"
    atomic_write_text(target, "one")
    atomic_write_bytes(target, b"two")
    assert target.read_bytes() == b"two"
    assert os.stat(target).st_mode & 0o777 == 0o666 & ~_umask()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]  # no temp file left behind
    with pytest.raises(FileNotFoundError):
        atomic_write_text(tmp_path / "missing-dir" / "x.txt", "x")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_json_output_is_strict_json_with_nan_as_null(capsys):
    from bagualu2.cli.common import echo_json

    echo_json({"ratio": float("nan"), "rows": [1.0, float("inf")], "pair": (2, 3)})
    text = capsys.readouterr().out
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}")) == {
        "ratio": None, "rows": [1.0, None], "pair": [2, 3]}
