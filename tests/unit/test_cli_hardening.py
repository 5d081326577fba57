"""Every bad input to every command is ONE line ``error: --option: ...`` with exit code 2 and no traceback:
numbers beyond what the computation takes, hardware JSON out of its physical ranges or nested too deeply, output
paths that are not regular files, rich markup in names, typer's own parse errors; and the library's solver
options. A hypothesis test fuzzes the hardware JSON loader."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, strategies as st
from typer.testing import CliRunner

from bagualu2 import costmodel, fusion
from bagualu2.cli import app
from bagualu2.cli.common import CliError, atomic_write_bytes, load_hardware
from bagualu2.cli.files import atomic_write_many
from bagualu2.costmodel import Hardware
from bagualu2.costmodel.config import HARDWARE_RANGES
from bagualu2.mitigation import exact, greedy

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BASE_HW = json.loads(costmodel.presets.hardware("paper-gpu").to_json())
HW_FILES = {
    "flops1": {"peak_flops": 1.0}, "slowcopy": {"h2d_bytes_per_s": 1e-3}, "launch": {"kernel_launch_s": 1e300},
    "bigint": {"peak_flops": 10**400}, "noeff": {"matmul_efficiency": 1e-300},
    # every field in range, together too slow: the duration guard, not CP-SAT's "integer overflow"
    "slowok": {"peak_flops": 1e9, "matmul_efficiency": 0.01, "hbm_bytes_per_s": 1e6,
               "intra_node_bytes_per_s": 1e6, "inter_node_bytes_per_s": 1e6},
    "oops": {"name": "[/oops]"}, "red": {"name": "[red]x[/red]"}, "backslash": {"name": "gpu\\"},
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("inputs")
    for name, changes in HW_FILES.items():
        text = json.dumps({**BASE_HW, **changes}) if name != "bigint" else \
            json.dumps(BASE_HW).replace('"peak_flops": 480000000000000.0', '"peak_flops": ' + "9" * 400)
        (root / f"{name}.json").write_text(text)
    (root / "deep.json").write_text("[" * 100_000)
    tiny = json.loads(json.dumps({"model": costmodel.presets.model("tiny-moe")[0].__dict__,
                                  "parallel": costmodel.presets.model("tiny-moe")[1].__dict__}))
    for name, section, changes in (("layers", "model", {"num_layers": 10**7}), ("mbs", "parallel",
                                   {"num_microbatches": 10**9}), ("chunk", "model", {"num_layers": 1024})):
        (root / f"{name}.json").write_text(json.dumps({**tiny, section: {**tiny[section], **changes}}))
    (root / "digits.json").write_text(json.dumps(tiny).replace('"num_layers": 4', '"num_layers": ' + "9" * 5000))
    os.mkfifo(root / "fifo.jsonl")
    os.mkfifo(root / "fifo.json")
    os.mkfifo(root / "fifo.png")
    (root / "dir.png").mkdir()
    (root / "real.png").write_bytes(b"old")
    (root / "link.png").symlink_to(root / "real.png")
    return root


def run(*args: str):
    result = runner.invoke(app, list(args))
    assert "Traceback" not in result.stdout + result.stderr
    return result


def one_line_error(stderr: str, option: str | None) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    prefix = f"error: {option}: " if option else "error: "
    assert lines[0].startswith(prefix), stderr
    return lines[0]


# ---- the matrix: 40 bad inputs across the commands ----------------------------------------------------------
BAD = [
    (["schedule", "-r", "1e12"], "--imbalance"),
    (["demo", "--max-imbalance", "1e12"], "--max-imbalance"),
    (["memory", "-r", "1e298"], "--imbalance"),
    (["plan", "-b", "1", "-r", "4e9", "--solver", "exact"], "--imbalance"),
    (["memory", "-m", "tiny-moe", "-r", "1.5"], "--imbalance"),  # ep=1: max/mean load is 1
    (["plan", "-m", "glm-1041b-a35b", "-r", "43"], "--imbalance"),  # ep=128, but 256 experts / top-6: 42.67
    (["budget", "-m", "glm-423b-a30b", "--spike", "3=22"], "--spike"),  # 128 experts / top-6: 21.33
    (["simulate", "--plan-imbalance", "22", "-n", "1"], "--plan-imbalance"),
    (["plan", "-b", "1", "-H", "@flops1"], "--hardware"),
    (["schedule", "-H", "@slowcopy"], "--hardware"),
    (["memory", "-H", "@launch"], "--hardware"),
    (["memory", "-H", "@noeff"], "--hardware"),
    (["memory", "-H", "@bigint"], "--hardware"),
    (["plan", "-b", "1", "--solver", "exact", "-H", "@slowok"], "--hardware"),
    (["schedule", "--time-limit", "1", "-H", "@slowok"], "--hardware"),
    (["budget", "-H", "@slowok"], "--hardware"),
    (["simulate", "-n", "2", "-H", "@slowok"], "--hardware"),
    # too slow only at a high imbalance: the graph's own guard, before the command's, still names --hardware
    (["plan", "-m", "glm-1041b-a35b", "-H", "@slowok", "-r", "42"], "--hardware"),
    (["memory", "-m", "glm-1041b-a35b", "-H", "@slowok", "-r", "42"], "--hardware"),
    (["curve", "-m", "glm-1041b-a35b", "-H", "@slowok", "--spike", "0=42"], "--hardware"),
    (["memory", "-H", "@deep"], "--hardware"),
    (["memory", "-H", "@fifo.json"], "--hardware"),  # never read (it would block)
    (["memory", "-m", "@deep"], "--model"),
    (["budget", "--spike", "3"], "--spike"),
    (["budget", "--spike", "3=x"], "--spike"),
    (["budget", "--spike", "99=2"], "--spike"),
    (["budget", "--spike", "3=500"], "--spike"),
    (["budget", "--spike", "3=2", "--spike", "3=2.5"], "--spike"),
    (["budget", "--downgrade", "foo"], "--downgrade"),
    (["budget", "--seed", "-1"], "--seed"),
    (["budget", "--stage", "8"], "--stage"),
    (["budget", "--spike-rate", "2"], "--spike-rate"),
    (["budget", "--max-imbalance", "0.5"], "--max-imbalance"),
    (["curve", "--policy", "x"], "--policy"),
    (["curve", "--png", "@fifo.png"], "--png"),
    (["curve", "--png", "@dir.png"], "--png"),
    (["curve", "--png", "/dev/null"], "--png"),
    (["schedule", "--png", "@link.png"], "--png"),
    (["schedule", "--png", "@missing/x.png"], "--png"),
    (["curve", "--png", "@long"], "--png"),  # a 300-character name: longer than the file system allows
    (["compare", "--budgets", "0"], "--budgets"),
    (["compare", "-r", "200"], "--imbalance"),
    (["compare", "--time-limit", "0"], "--time-limit"),
    (["compare", "-m", "nope"], "--model"),
    (["demo", "--stage", "99"], "--stage"),
    (["demo", "-s", "abc"], "--stage"),        # typer's parse error, one line through the group's main
    (["memory", "--bogus"], "--bogus"),
    # sizes past any real model: one line at once, not a run that never ends
    (["memory", "-m", "@layers.json"], "--model"),
    (["budget", "-m", "@mbs.json"], "--model"),
    (["plan", "-m", "@chunk.json"], "--model"),  # 512 layers in one chunk
    (["memory", "-m", "@digits.json"], "--model"),
    (["simulate", "--trace", "@fifo.jsonl"], "--trace"),  # never read (it would block)
    (["simulate", "--restart-s", "1e300"], "--restart-s"),
    (["reproduce", "-n", "99999999999999999999"], "--iterations"),
    (["reproduce", "--seed", str(10**23)], "--seed"),
    (["reproduce", "-j", "100000"], "--jobs"),
    (["reproduce", "--docs", ""], "--docs"),
    (["schedule", "--png", "/proc/x.png"], "--png"),  # os.access says yes to root: a file is made there first
]


def expand(args: list[str], files: Path) -> list[str]:
    """``@name``: a file of the ``files`` fixture (``@flops1`` = flops1.json, ``@long``: a 300-character name)."""
    def path(key: str) -> str:
        if key in HW_FILES or key == "deep":
            return str(files / f"{key}.json")
        if key.endswith((".json", ".jsonl")):
            return str(files / key)
        return str(files / ("x" * 296 + ".png")) if key == "long" else str(files / key)
    return [path(a[1:]) if a.startswith("@") else a for a in args]


@pytest.mark.parametrize(("args", "option"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line(files: Path, args: list[str], option: str) -> None:
    result = run(*expand(args, files))
    assert result.exit_code == 2, result.stdout + result.stderr
    line = one_line_error(result.stderr, option)
    assert result.stdout == ""
    if option != "--time-limit":
        assert "--time-limit" not in line


@pytest.mark.slow
def test_special_files_are_left_alone(files: Path) -> None:
    for name in ("fifo.png", "dir.png", "link.png"):
        assert run("curve", "--policy", "static-over", "--png", str(files / name)).exit_code == 2
    assert stat.S_ISFIFO(os.lstat(files / "fifo.png").st_mode) and (files / "dir.png").is_dir()
    assert (files / "link.png").is_symlink() and (files / "real.png").read_bytes() == b"old"
    with pytest.raises(OSError, match="FIFO"):
        atomic_write_bytes(files / "fifo.png", b"x")
    with pytest.raises(OSError, match="not a regular file"):
        fusion.gantt.gantt_png(fusion.Timeline((), 0, {}, 0), files / "link.png")
    assert not [p for p in files.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.slow
def test_long_filename_works(tmp_path: Path) -> None:
    target = tmp_path / ("c" * 196 + ".png")
    result = run("curve", "--policy", "static-over", "--png", str(target))
    assert result.exit_code == 0, result.stderr
    assert target.read_bytes().startswith(PNG_MAGIC) and [p.name for p in tmp_path.iterdir()] == [target.name]
    gantt = tmp_path / ("g" * 250 + ".png")
    assert run("schedule", "--time-limit", "1", "--png", str(gantt)).exit_code == 0
    assert gantt.read_bytes().startswith(PNG_MAGIC)


def test_png_replaces_a_regular_file(tmp_path: Path) -> None:
    target = tmp_path / "old.png"
    target.write_bytes(b"old")
    assert run("curve", "--policy", "ideal", "--png", str(target)).exit_code == 0
    assert target.read_bytes().startswith(PNG_MAGIC)


# ---- markup in names is printed literally -------------------------------------------------------------------
@pytest.mark.parametrize("args", [["memory"], ["plan", "-b", "1"], ["schedule", "--time-limit", "1"],
                                  ["demo", "--train-steps", "0"],
                                  ["budget"], ["curve"], ["compare", "-m", "tiny-moe", "-r", "1", "--budgets", "1"]],
                         ids=lambda a: a[0])
@pytest.mark.parametrize("name", ["oops", "red", "backslash"])
def test_markup_in_hardware_name_is_literal(files: Path, args: list[str], name: str) -> None:
    result = run(*args, "-H", str(files / f"{name}.json"))
    assert result.exit_code == 0, result.stderr
    assert HW_FILES[name]["name"] in result.stdout
    assert HW_FILES[name]["name"] + "\\" not in result.stdout  # a trailing backslash printed once


# ---- typer's parse errors through the real entry point ------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(("args", "option"), [
    (["demo", "-s", "abc"], "--stage"),
    (["memory", "--bogus"], "--bogus"),
    (["presets", "extra"], None),
    (["no-such-command"], None),
    (["plan", "--budget-gib"], "--budget-gib"),
    (["budget", "--spike-rate", "x"], "--spike-rate"),
])
@pytest.mark.launch
def test_parse_errors_from_python_dash_m(args: list[str], option: str | None) -> None:
    done = subprocess.run([sys.executable, "-m", "bagualu2.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "NO_COLOR": "1"})
    assert done.returncode == 2 and "Traceback" not in done.stderr and done.stdout == ""
    line = one_line_error(done.stderr, option)
    assert "╭" not in line


@pytest.mark.launch
def test_help_still_works() -> None:
    done = subprocess.run([sys.executable, "-m", "bagualu2.cli", "budget", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "--spike" in done.stdout and done.stderr == ""


# ---- the library ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_graph() -> costmodel.OpGraph:
    model, parallel = costmodel.presets.model("tiny-moe")
    return costmodel.build_graph(model, parallel, costmodel.presets.hardware("cpu"))


@pytest.mark.parametrize(("options", "name"), [({"seed": 2**31}, "seed"), ({"seed": -1}, "seed"),
                                               ({"num_workers": 10**6}, "num_workers"),
                                               ({"time_limit_s": float("nan")}, "time_limit_s")])
def test_exact_solvers_reject_bad_options(tiny_graph, options: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        exact.solve(tiny_graph, -1, **options)  # options first, before the (also bad) budget
    plan = greedy.solve(tiny_graph, tiny_graph.floor_bytes).plan
    chains = fusion.build_chains(tiny_graph, plan, tiny_graph, plan)
    with pytest.raises(ValueError, match=name):
        fusion.exact.solve(chains, **options)


def test_deep_json_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="nested too deeply"):
        Hardware.from_json("[" * 100_000)


def test_a_hardware_name_with_a_control_character_is_refused() -> None:
    with pytest.raises(ValueError, match="name must be a non-empty string of at most 200 printable characters"):
        Hardware.from_json(json.dumps({**BASE_HW, "name": "a\nb"}))


def test_check_imbalance_ep_bound() -> None:
    assert costmodel.check_imbalance(128.0, ep=128) == 128.0
    with pytest.raises(ValueError, match="imbalance"):
        costmodel.check_imbalance(128.5, ep=128)
    assert costmodel.check_imbalance(1e6) == 1e6  # without ep: only >= 1, as before


# ---- fuzz: the hardware JSON loader -------------------------------------------------------------------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-10**400, max_value=10**400)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
    | st.sampled_from([0, 1, 1e9, 1e12, 1e15, 1e18, 1 << 30, 1 << 50, 0.5, 1e-300, "[/oops]", "[red]x[/red]"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6)


@given(changes=st.dictionaries(st.sampled_from(sorted(BASE_HW) + ["bogus"]), JSON_VALUES, max_size=4),
       drop=st.sets(st.sampled_from(sorted(BASE_HW)), max_size=2), whole=st.none() | JSON_VALUES)
def test_fuzz_hardware_json(changes: dict, drop: set, whole) -> None:
    data = {k: v for k, v in {**BASE_HW, **changes}.items() if k not in drop}
    text = json.dumps(data if whole is None else whole)
    try:
        hardware = Hardware.from_json(text)
    except ValueError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 600
        hardware = None
    if hardware is not None:
        for name, (low, high) in HARDWARE_RANGES.items():
            assert low <= getattr(hardware, name) <= high
        assert Hardware.from_json(hardware.to_json()) == hardware
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "hw.json"
        path.write_text(text)
        try:
            assert load_hardware(str(path)) == hardware
        except CliError as exc:
            assert hardware is None and exc.option == "--hardware" and "\n" not in str(exc)


def test_a_set_of_files_is_written_whole_or_not_at_all(tmp_path: Path) -> None:
    """``atomic_write_many`` (reproduce's report and plots): a target it cannot write leaves every other target as
    it was, and no temp file behind; the error names the target, not a temp file."""
    (tmp_path / "a.png").write_bytes(b"old")
    with pytest.raises(OSError) as caught:
        atomic_write_many([(tmp_path / "a.png", b"new"), (tmp_path / "b.md", b"new"),
                           (tmp_path / "gone" / "c.md", b"x")])
    assert caught.value.filename == str(tmp_path / "gone" / "c.md")
    assert (tmp_path / "a.png").read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["a.png"]
    atomic_write_many([(tmp_path / "a.png", b"new"), (tmp_path / "b.md", b"new")])
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.md").read_bytes() == b"new"


def test_an_image_to_standard_output_is_refused() -> None:
    result = run("curve", "--png", "-")
    assert result.exit_code == 2 and "standard output" in one_line_error(result.stderr, "--png")


def test_a_plan_kind_the_model_lacks_is_refused() -> None:
    result = run("memory", "-m", "tiny-dense", "-p", "expert_act=OFFLOAD")
    assert result.exit_code == 2
    assert "op kind(s) expert_act name no op of this model" in one_line_error(result.stderr, "--plan")
    assert run("memory", "-m", "tiny-dense", "-p", "mlp_act=OFFLOAD").exit_code == 0


@pytest.mark.parametrize("args, option", [
    (["memory", "-r", "1_0"], "--imbalance"),
    (["simulate", "--restart-s", "1_0"], "--restart-s"), (["simulate", "--plan-imbalance", "1_2"], "--plan-imbalance"),
    (["reproduce", "--restart-s", "2_84"], "--restart-s"), (["budget", "--spike-rate", "0_1"], "--spike-rate"),
    (["curve", "--max-imbalance", "1_5"], "--max-imbalance"), (["demo", "--max-imbalance", "2_0"], "--max-imbalance"),
    (["simulate", "-n", "1_0"], "--iterations"), (["reproduce", "--seed", "1_1"], "--seed"),
    (["plan", "--chunk", "0_1"], "--chunk"), (["memory", "-s", "0x1"], "--stage"),
    (["budget", "--seed", "1e3"], "--seed"),
    (["demo", "--train-steps", "\u0663"], "--train-steps"), (["train", "--master-port", "2_9500"], "--master-port"),
])
def test_numbers_with_underscores_are_refused(args, option) -> None:
    """Python reads ``1_0`` as ten; on a command line it is a typo, whether typer or the command parses the flag."""
    result = run(*args)
    assert result.exit_code == 2 and repr(args[-1]) in one_line_error(result.stderr, option)


@pytest.mark.parametrize("args, option, bounds", [
    (["demo", "--train-steps", "10001"], "--train-steps", "[0, 10000]"),
    (["train", "--nproc-per-node", "0"], "--nproc-per-node", "[1, 1024]"),
    (["train", "--master-port", "65536"], "--master-port", "[1, 65535]"),
    (["train", "--node-rank", "-1"], "--node-rank", ">= 0"),
])
def test_integer_options_keep_their_bounds(args, option, bounds) -> None:
    """An integer option's bounds hold although it has a parser of its own (typer drops ``min``/``max`` then)."""
    result = run(*args)
    assert result.exit_code == 2 and bounds in one_line_error(result.stderr, option)


# ---- an output path is never one of the command's inputs ----------------------------------------------------
@pytest.mark.parametrize("command, option", [("simulate", "--trace"), ("curve", "--model"),
                                             ("schedule", "--hardware")])
def test_png_never_overwrites_an_input(tmp_path: Path, command: str, option: str) -> None:
    source = tmp_path / ("trace.jsonl" if option == "--trace" else "input.json")
    if option == "--trace":
        source.write_text("".join(json.dumps({"iteration": 0, "microbatch": m, "imbalance": 1.0}) + "\n"
                                  for m in range(4)))
        args = ["simulate", "-m", "tiny-moe", "--trace", str(source)]
    elif option == "--model":
        model, parallel = costmodel.presets.model("tiny-moe")
        source.write_text(json.dumps({"model": dataclasses.asdict(model), "parallel": dataclasses.asdict(parallel)}))
        args = ["curve", "-m", str(source)]
    else:
        source.write_text(json.dumps(BASE_HW))
        args = ["schedule", "-m", "tiny-moe", "--time-limit", "1", "-H", str(source)]
    before = source.read_bytes()
    result = run(*args, "--png", str(source))
    assert result.exit_code == 2, result.stdout
    assert one_line_error(result.stderr, "--png").endswith(f"is the file {option} reads; write the output to "
                                                           "another path")
    assert source.read_bytes() == before


def test_a_path_with_a_newline_is_named_as_it_is() -> None:
    result = run("memory", "-m", "a\nb.json")
    assert result.exit_code == 2
    assert one_line_error(result.stderr, "--model") == ("error: --model: cannot access 'a\\nb.json': No such file "
                                                        "or directory")


def test_a_preset_name_is_never_taken_for_the_file_of_that_name(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("tiny-moe", "cpu"):
        (tmp_path / name).write_bytes(b"a file named like a preset")
    result = run("curve", "-m", "tiny-moe", "-H", "cpu", "--png", "tiny-moe")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "tiny-moe").read_bytes().startswith(PNG_MAGIC)


def test_a_cp_sat_time_out_leaves_the_exact_rows_out() -> None:
    schedule = run("schedule", "-m", "tiny-moe", "--time-limit", "1e-9")
    assert schedule.exit_code == 0, schedule.stderr
    assert "CP-SAT found no schedule within 1e-09 s" in schedule.stdout and "│ dp " in schedule.stdout
    compare = run("compare", "-m", "tiny-moe", "-r", "1", "--budgets", "1", "--time-limit", "1e-9", "--json")
    assert compare.exit_code == 0, compare.stderr
    point = json.loads(compare.stdout)["points"][0]
    assert point["fusion_ratio"] is None and point["exact_schedule"] == "none" and point["dp_makespan_s"] > 0


def test_reproduce_names_the_hardware_too_small_for_a_layout(tmp_path: Path) -> None:
    result = run("reproduce", "-H", "cpu", "-n", "10", "-m", "glm-188b-a20b", "-j", "1", "--docs",
                 str(tmp_path / "out"))
    assert result.exit_code == 2
    assert "nothing fits" in one_line_error(result.stderr, "--hardware") and not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, option", [(["memory", "-r"], "--imbalance"), (["plan", "-b"], "--budget-gib"),
                                          (["simulate", "-n"], "--iterations")])
def test_a_short_option_without_its_value_is_named_by_its_long_name(args: list[str], option: str) -> None:
    result = run(*args)
    assert result.exit_code == 2
    assert one_line_error(result.stderr, option).endswith(f"Option '{args[-1]}' requires an argument.")


@pytest.mark.parametrize("command, shown", [("budget", "trace: [imbalance per micro-batch]"),
                                            ("curve", "in_flight_bytes: [bytes after each")])
def test_json_formats_in_help_keep_their_brackets(command, shown):
    """rich reads ``[...]`` as markup: the JSON formats are escaped so that help shows them."""
    result = CliRunner().invoke(app, [command, "--help"], terminal_width=400)
    assert result.exit_code == 0 and shown in " ".join(result.output.split())


def test_reproduce_lists_the_table_ii_presets_it_takes():
    result = CliRunner().invoke(app, ["reproduce", "-m", "tiny-moe", "-n", "10"])
    assert result.exit_code == 2 and "unknown Table II preset 'tiny-moe'; valid: glm-188b-a20b" in result.output
    assert "tiny" not in result.output.split("valid:")[1]


def test_a_printed_plan_with_one_stages_ops_names_that_stage() -> None:
    """``plan`` prints op-level entries of one stage; given to ``memory`` without ``--stage`` the line says which."""
    printed = [line for line in run("plan").stdout.splitlines() if line.startswith("plan ")][0][5:]
    result = run("memory", "-p", printed)
    assert result.exit_code == 2
    assert "name ops of stage 0 only" in one_line_error(result.stderr, "--plan") and "give --stage 0" in result.stderr
    assert run("memory", "-p", printed, "-s", "0").exit_code == 0
    assert "ops this model does not have (L99.qkv)" in one_line_error(
        run("memory", "-p", "L99.qkv/out=RECOMPUTE", "-s", "0").stderr, "--plan")
    spread = run("memory", "-p", "L0.qkv/out=RECOMPUTE,L31.qkv/out=RECOMPUTE")
    assert "no single stage" in one_line_error(spread.stderr, "--plan")


def test_a_rate_above_one_of_several_models_limits_names_that_model() -> None:
    result = run("compare", "-m", "tiny-dense", "-m", "glm-188b-a20b", "-r", "2")
    assert result.exit_code == 2 and "for tiny-dense: must be" in one_line_error(result.stderr, "--imbalance")


@pytest.mark.parametrize("args, option, text", [
    (["reproduce", "--restart-s", "-1"], "--restart-s", "must be a finite number in [0, 1e+09], got -1.0"),
    (["reproduce", "-n", "9"], "--iterations", "must be an integer in [10, 10000000], got 9"),
    (["budget", "--seed", "-1"], "--seed", "must be an integer in [0, 2**63), got -1"),
    (["compare", "--budgets", "0"], "--budgets", "must be an integer in [1, 50], got 0"),
])
def test_a_config_fields_check_reads_as_the_options(tmp_path: Path, args, option, text) -> None:
    """The option names the field once, and a bound is written as a person reads it (2**63, not 19 digits)."""
    result = run(*args, *(["--docs", str(tmp_path)] if args[0] == "reproduce" else []))
    assert result.exit_code == 2 and one_line_error(result.stderr, option) == f"error: {option}: {text}"


def test_a_model_file_takes_whole_number_floats_as_a_hardware_file_does() -> None:
    model, parallel = costmodel.presets.model("tiny-moe")
    data = {"model": dataclasses.asdict(model), "parallel": dataclasses.asdict(parallel)}
    data["model"]["hidden_size"] = float(model.hidden_size)
    data["parallel"]["num_microbatches"] = 4e0
    loaded = costmodel.presets.model_from_json(json.dumps(data))
    assert loaded == (model, parallel.replace(num_microbatches=4))
    assert type(loaded[0].hidden_size) is int
    data["parallel"]["num_microbatches"] = 4.5
    with pytest.raises(ValueError, match=r"num_microbatches must be an integer in \[1, 16384\], got 4.5"):
        costmodel.presets.model_from_json(json.dumps(data))


def test_negative_zero_reads_as_zero_and_huge_integers_read_short():
    from bagualu2.costmodel.validate import parse_float, require_int

    assert str(parse_float("-0")) == "0.0" and str(parse_float("-0.0e3")) == "0.0"
    with pytest.raises(ValueError, match=r"got an integer of 301 digits, about 1e\+300$"):
        require_int("num_layers", int(1e300), 1, 1024)  # an integer, never shown as if a float
    with pytest.raises(ValueError, match=r"got an integer of about 5001 digits$"):
        require_int("num_layers", 10**5000, 1, 1024)


def test_trainer_recipes_and_reproduce_hardware_take_any_case():
    from bagualu2.sim.reproduce import ReproduceConfig
    from bagualu2.sim.report import command
    from reference_trainer.recipes import recipe

    assert recipe("GLM_MOE_DEBUG") == recipe("glm_moe_debug")
    assert ReproduceConfig(hardware="PAPER-GPU").hardware == "paper-gpu"
    assert "--hardware" not in command(ReproduceConfig(hardware="Paper-GPU"))


def test_a_dense_model_on_the_paper_trace_is_told_to_use_a_trace_of_rates_1(tmp_path: Path) -> None:
    model, parallel = costmodel.presets.model("tiny-moe")
    dense = dataclasses.replace(model, num_experts=0, top_k=0, moe_ffn_hidden_size=0, num_shared_experts=0,
                                num_dense_layers=0)
    source = tmp_path / "dense.json"
    source.write_text(json.dumps({"model": dataclasses.asdict(dense),
                                  "parallel": dataclasses.asdict(dataclasses.replace(parallel, ep=1))}))
    result = run("simulate", "-m", str(source), "-n", "3")
    assert result.exit_code == 2, result.stdout
    assert one_line_error(result.stderr, "--model").endswith("is a dense model (no experts, imbalance 1 only): the "
                                                             "paper trace's spikes need a MoE model; use --trace "
                                                             "with rates of 1")
    trace = tmp_path / "ones.jsonl"
    trace.write_text("".join(json.dumps({"iteration": 0, "microbatch": m, "imbalance": 1}) + "\n"
                             for m in range(parallel.num_microbatches)))
    assert run("simulate", "-m", str(source), "--trace", str(trace), "-p", "flexible").exit_code == 0


def test_a_closed_standard_output_is_one_line_and_exit_code_2(monkeypatch, capsys):
    """``bagualu2 presets >&-``: Python starts with ``sys.stdout`` None, where rich's console would fail."""
    from bagualu2.cli import commands

    monkeypatch.setattr(sys, "stdout", None)
    monkeypatch.setattr(sys, "argv", ["bagualu2", "presets"])
    with pytest.raises(SystemExit) as exit_:
        commands.main()
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "error: standard output is closed; redirect it to a file or to /dev/null\n"


def test_a_help_that_cannot_be_written_is_one_line_and_exit_code_2(monkeypatch, capsys):
    """``bagualu2 --help > /dev/full``: the help is printed while the arguments are parsed, outside every
    command's own error handling."""
    import errno
    import io

    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(sys, "stdout", Full())
    for args in (["plan", "--help"], ["presets"], ["memory", "-m", "tiny-moe", "--json"]):  # a command's output too
        with pytest.raises(SystemExit) as exit_:
            app(args, prog_name="bagualu2")
        assert exit_.value.code == 2
        assert capsys.readouterr().err == "error: input/output error on the output: No space left on device\n"


@pytest.mark.parametrize(("args", "expected"), [
    (["budget", "--spike-rate", ""], "error: --spike-rate: must be a number in [0, 1], got ''"),
    (["curve", "--max-imbalance", "x"], "error: --max-imbalance: must be a number >= 1, got 'x'"),
    (["simulate", "--restart-s", ""], "error: --restart-s: must be a number in [0, 1e9] (seconds), got ''"),
])
def test_a_number_that_does_not_parse_names_what_is_allowed(args: list[str], expected: str) -> None:
    result = run(*args)
    assert result.exit_code == 2 and result.stderr.strip() == expected


@pytest.mark.parametrize(("args", "expected"), [
    (["plan", "-m", "tiny-moe", "-m", "glm-188b-a20b"], "error: --model: given more than once; give it once"),
    (["plan", "-m", "tiny-moe", "--model=tiny-moe"],
     "error: --model: given more than once (as -m and --model); give it once"),
    (["simulate", "--hidden-copies", "--full-copies"],
     "error: --hidden-copies: given more than once (as --hidden-copies and --full-copies); give it once"),
    (["memory", "-mtiny-moe", "--json", "--json"], "error: --json: given more than once; give it once"),
])
def test_an_option_given_twice_is_refused_not_the_last_kept(args: list[str], expected: str) -> None:
    result = run(*args)
    assert result.exit_code == 2 and result.stderr.strip() == expected and result.stdout == ""


def test_options_that_take_several_values_and_the_words_after_a_double_dash_may_repeat() -> None:
    from typer.main import get_command

    from bagualu2.cli.usage import repeated_option

    group = get_command(app)
    budget, train = group.commands["budget"], group.commands["train"]
    assert repeated_option(budget, ["-m", "tiny-moe", "--spike", "1=2", "--spike", "2=2"]) is None
    assert repeated_option(budget, ["--seed", "--seed"]) is None  # the second is the first one's value
    assert repeated_option(train, ["--dry-run", "--", "--steps", "1", "--steps", "2"]) is None
    assert repeated_option(train, ["--steps", "1", "--steps", "2"]) is None  # the trainer's own flags


@pytest.mark.parametrize("command", ["plan", "memory", "schedule", "budget", "curve", "demo"])
def test_a_stage_out_of_range_reads_the_same_in_every_command(command: str) -> None:
    result = run(command, "-m", "glm-188b-a20b", "-s", "99")
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: --stage: must be in [0, 4) (pp=4 for glm-188b-a20b), got 99"
