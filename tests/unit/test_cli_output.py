"""What the commands print and write, under the environments users run them in: a rewritten file keeps its
permissions, a read-only one is refused, an unusable COLUMNS or an ASCII-only stdout still gives the whole output,
a model file's name prints on one line, a plan prints as text that parses back, and a PNG of a title the font
cannot draw writes no warnings."""

from __future__ import annotations

import io
import json
import stat
import sys
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bagualu2.cli import app
from bagualu2.costmodel import Plan, presets

PNG_MAGIC = b"\x89PNG"


def run(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, list(args), env=env)


def test_a_rewritten_png_keeps_its_permissions_and_a_read_only_one_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "private.png"
    target.write_bytes(b"old")
    target.chmod(0o600)
    assert run("curve", "--policy", "ideal", "--png", str(target)).exit_code == 0
    assert target.read_bytes().startswith(PNG_MAGIC)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600  # never widened to the umask's 0o644
    target.chmod(0o400)  # refused by anyone, root included (who may write it, but no one is meant to)
    result = run("curve", "--policy", "ideal", "--png", str(target))
    assert result.exit_code == 2 and "--png" in result.output and "read-only" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and target.read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize("columns", ["0", "3", "wide"])
def test_an_unusable_columns_width_still_prints_everything(columns: str) -> None:
    plain = run("memory", env={"COLUMNS": None})  # unset: 160 columns off a terminal
    result = run("memory", env={"COLUMNS": columns})
    assert result.exit_code == 0 and result.output == plain.output and "status" in result.output


def test_an_ascii_only_stdout_gets_every_line_with_escapes(monkeypatch) -> None:
    from bagualu2.cli.commands import main

    monkeypatch.delenv("COLUMNS", raising=False)
    buffer = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(buffer, encoding="ascii", errors="strict"))
    monkeypatch.setattr(sys, "argv", ["bagualu2", "budget", "-m", "tiny-moe"])
    with pytest.raises(SystemExit) as exited:
        main()
    sys.stdout.flush()
    text = buffer.getvalue().decode("ascii")
    assert exited.value.code == 0
    assert "\\xb5" in text and "forwards" in text.splitlines()[-1]


def test_a_model_file_name_prints_on_one_line(tmp_path: Path) -> None:
    model, parallel = presets.model("tiny-moe")
    path = tmp_path / "two\nlines.json"
    path.write_text(json.dumps({"model": {f: getattr(model, f) for f in model.__dataclass_fields__}}))
    result = run("plan", "-m", str(path))
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0].startswith("plan: two\\nlines on ")
    assert json.loads(run("plan", "-m", str(path), "--json").output)["inputs"]["model"] == "two\\nlines"


@pytest.mark.parametrize("budget", ["0.5", "1000"])
def test_the_plan_prints_as_text_that_parses_back(budget: str) -> None:
    args = ("plan", "-m", "glm-1041b-a35b", "-r", "1.5", "-b", budget)
    text = run(*args).output.splitlines()[-1]
    assert text.startswith("plan ")
    assert Plan.from_str(text.removeprefix("plan ")) == Plan.from_str(json.loads(run(*args, "--json").output)["plan"])


def test_an_exact_solve_stopped_by_its_time_limit_says_so() -> None:
    result = run("plan", "-m", "glm-1041b-a35b", "-r", "2.6", "-b", "0.5", "--solver", "exact", "--time-limit",
                 "0.001")
    assert result.exit_code == 0, result.output  # the greedy plan CP-SAT started from fits
    assert "note: time limit reached before CP-SAT returned a solution" in result.output


def test_a_png_title_the_font_cannot_draw_writes_no_warning(tmp_path: Path) -> None:
    model, _ = presets.model("tiny-moe")
    path = tmp_path / "模型.json"
    path.write_text(json.dumps({"model": {f: getattr(model, f) for f in model.__dataclass_fields__}}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run("curve", "-m", str(path), "--policy", "ideal", "--png", str(tmp_path / "曲线.png"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "曲线.png").read_bytes().startswith(PNG_MAGIC)
    assert not [w for w in caught if "Glyph" in str(w.message)]
