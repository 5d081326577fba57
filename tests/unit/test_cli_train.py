"""``bagualu2 train``: torchrun around the reference trainer, its flags passed through; clear one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from bagualu2.cli import app
from bagualu2.cli import train_cmd


@pytest.mark.launch
def test_dry_run_builds_the_torchrun_command():
    result = CliRunner().invoke(app, ["train", "--nproc-per-node", "2", "--dry-run", "--json", "--", "--steps", "3",
                                      "--pp", "1", "--dp", "2"])
    assert result.exit_code == 0, result.output
    command = json.loads(result.stdout)["command"]
    assert command[:4] == ["torchrun", "--nnodes=1", "--nproc-per-node=2", "--standalone"]
    assert command[-7:] == ["reference_trainer.train", "--steps", "3", "--pp", "1", "--dp", "2"]
    wrong = CliRunner().invoke(app, ["train", "--nproc-per-node", "3", "--dry-run", "--", "--pp", "1", "--dp", "2"])
    assert wrong.exit_code == 2
    assert wrong.stderr.strip() == ("error: --nproc-per-node: the trainer's flags need 2 ranks (--pp x --dp), not "
                                    "3 per node x 1 node(s)")
    # a real launch is refused alike, before torchrun starts (it would fail on every rank, naming no flag)
    launched = CliRunner().invoke(app, ["train", "--nproc-per-node", "3", "--", "--pp", "1", "--dp", "2"])
    assert launched.exit_code == 2 and launched.stderr == wrong.stderr
    nodes = CliRunner().invoke(app, ["train", "--nnodes", "2", "--node-rank", "1", "--master-port", "29511",
                                     "--master-addr", "127.0.0.1", "--dry-run", "--json"])
    assert "--rdzv-endpoint=127.0.0.1:29511" in json.loads(nodes.stdout)["command"]
    alone = CliRunner().invoke(app, ["train", "--nnodes", "2", "--node-rank", "1", "--dry-run"])
    assert alone.exit_code == 2 and alone.stderr.strip() == (
        "error: --master-addr: --nnodes=2 needs the rendezvous host every node reaches (node 0's address)")
    restarting = CliRunner().invoke(app, ["train", "--max-restarts", "3", "--dry-run", "--json"])
    assert json.loads(restarting.stdout)["command"][:4] == ["torchrun", "--nnodes=1", "--nproc-per-node=4",
                                                            "--max-restarts=3"]


@pytest.mark.parametrize("args, option", [(["--node-rank", "2"], "--node-rank"),
                                          (["--nproc-per-node", "0"], "--nproc-per-node"),
                                          (["--master-port", "70000"], "--master-port"),
                                          (["--max-restarts", "-1"], "--max-restarts"),
                                          (["--nnodes", "2", "--master-addr", "a b"], "--master-addr"),
                                          (["--nnodes", "2", "--master-addr", ""], "--master-addr"),
                                          (["--nnodes", "2", "--master-addr", "host:1234"], "--master-addr"),
                                          (["--nnodes", "2", "--master-addr", "a/b"], "--master-addr"),
                                          (["--nnodes", "2", "--master-addr", "999.1.1.1"], "--master-addr")])
def test_bad_launcher_options_are_one_line(args, option):
    result = CliRunner().invoke(app, ["train", *args, "--dry-run"])
    assert result.exit_code == 2 and option in result.output and "Traceback" not in result.output


def test_the_trainers_probe_flags_are_refused_where_they_would_launch_nothing():
    """``--check`` is the dry run's probe (ranks launched with it would only refuse it); ``--world-size`` with
    ``--dry-run`` prints a command that launches nothing."""
    for args, option in [(["--dry-run", "--", "--check"], "--check"), (["--", "--check", "--steps", "1"], "--check"),
                         (["--dry-run", "--", "--world-size"], "--world-size")]:
        result = CliRunner().invoke(app, ["train", *args])
        assert result.exit_code == 2 and result.stderr.startswith(f"error: {option}: "), result.output
        assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.launch
def test_the_trainers_help_is_shown_once():
    result = subprocess.run([sys.executable, "-m", "bagualu2.cli", "train", "--nproc-per-node", "2", "--", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("usage: python -m reference_trainer.train") == 1
    sized = subprocess.run([sys.executable, "-m", "bagualu2.cli", "train", "--", "--pp", "2", "--dp", "2",
                            "--world-size"], capture_output=True, text=True, timeout=120)
    assert (sized.returncode, sized.stdout) == (0, "4\n"), sized.stderr  # the trainer's answer, not a launch


def test_missing_torch_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    result = CliRunner().invoke(app, ["train", "--dry-run"])
    assert result.exit_code == 2 and result.output.startswith(
        "error: this needs the 'trainer' extra: pip install 'bagualu2[trainer]' (missing: torch, tokenizers")
    demo = CliRunner().invoke(app, ["demo", "--train-steps", "2"])
    assert demo.exit_code == 2 and "--train-steps" in demo.output and "bagualu2[trainer]" in demo.output


@pytest.mark.launch
def test_a_dry_run_checks_the_data_and_the_output_paths_and_writes_nothing(tmp_path):
    (tmp_path / "short.txt").write_text("x")
    for flags, message in [(["--data", str(tmp_path / "none")], "no such file or directory"),
                           (["--data", str(tmp_path)], "fewer than one sequence"),
                           (["--metrics-file", str(tmp_path / "no" / "m.jsonl")], "--metrics-file: metrics path"),
                           (["--nproc_per_node", "4"], "python -m reference_trainer.train --help the trainer's"),
                           (["--world"], "unrecognized arguments: --world (")]:  # no abbreviation of a flag
        for launcher in ([], ["--nproc-per-node", "4"]):
            result = CliRunner().invoke(app, ["train", *launcher, "--dry-run", "--", *flags])
            assert result.exit_code == 2, (flags, result.output)
            assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
            assert len(result.stderr.strip().splitlines()) == 1
    fresh = tmp_path / "new" / "checkpoints"
    result = CliRunner().invoke(app, ["train", "--dry-run", "--", "--checkpoint-dir", str(fresh)])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "new").exists()
    # a GPU launch is prepared on a machine without its GPUs: the device is not checked
    gpus = CliRunner().invoke(app, ["train", "--dry-run", "--nnodes", "2", "--nproc-per-node", "4", "--master-addr",
                                    "10.0.0.1", "--", "--recipe", "glm_moe_multi"])
    assert gpus.exit_code == 0, gpus.output


@pytest.mark.launch
@pytest.mark.integration
def test_train_runs_the_trainer_under_torchrun(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bagualu2.cli", "train", "--json", "--", "--steps", "1"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert record["steps"] == 1 and record["max_prediction_error"] == 0.0  # 4 ranks: glm_moe_debug's PP=2 x DP=2
    left = [path.name for path in tmp_path.iterdir() if "torchelastic" in path.name or "bagualu2" in path.name]
    assert not left  # neither torchrun's log folder nor the run's state folder is left


@pytest.mark.launch
@pytest.mark.integration
def test_under_torchrun_only_rank_0_reports_one_line():
    # --max-restarts: a user error ends the launch at once; a restart would only fail and report it again
    proc = subprocess.run([sys.executable, "-m", "bagualu2.cli", "train", "--nproc-per-node", "2", "--max-restarts",
                           "2", "--", "--lr", "inf"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --lr must be a finite number in (0, 10000], got inf"]


def test_the_launcher_restarts_only_failures_a_restart_can_mend():
    from bagualu2.cli.launch import FINAL_EXIT_CODES
    from reference_trainer.collectives import DIVERGENCE_EXIT_CODE
    from reference_trainer.policies import OOM_EXIT_CODE
    from reference_trainer.resilience import NONFINITE_EXIT_CODE
    from reference_trainer.watchdog import STALL_EXIT_CODE

    assert FINAL_EXIT_CODES == {2, NONFINITE_EXIT_CODE, DIVERGENCE_EXIT_CODE}
    assert not FINAL_EXIT_CODES & {OOM_EXIT_CODE, STALL_EXIT_CODE}


@pytest.mark.parametrize("module, args, message", [
    ("measure", ["--preset", "tiny-moe", "--seed", str(10**30)], "error: --seed:"),
    ("measure", ["--preset", "tiny-moe", "--seed", "-1"], "error: --seed:"),
    ("train", ["--seed", "-3", "--steps", "1"], "error: --seed"),
    ("train", ["--lr", "1e300"], "error: --lr"),
    ("train", ["--lr", "inf", "--json"], "error: --lr"),
    ("train", ["--steps", "x"], "error: --steps must be an integer >= 1, got 'x'"),
    ("train", ["--pp", "4", "--dp", "1", "--ep", "1"], "error: the world size 2 must equal --pp x --dp"),
    ("train", ["--pp", "2", "--dp", "1", "--ep", "2"], "error: --ep=2 must divide --dp=1"),
    ("train", ["--checkpoint-every", "1"], "error: --checkpoint-every needs --checkpoint-dir"),
    ("train", ["--metrics-file", ""], "error: --metrics-file must be a path"),
    ("train", ["--pp", "1", "--dp", "2", "--ep", "2", "--metrics-file", "same.jsonl", "--checkpoint-dir", "same.jsonl"],
     "error: --metrics-file same.jsonl is the --checkpoint-dir"),
    ("train", ["--num-microbatches", "20000", "--world-size"], "error: --num-microbatches: num_microbatches must"),
])
def test_reference_trainer_modules_reject_bad_flags_in_one_line(module, args, message, monkeypatch, capsys):
    """In-process (the behaviour under torchrun: tests/integration/test_trainer.py): one line, exit code 2."""
    from reference_trainer import train
    from reference_trainer.experiments import measure

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exited:
        (train.main if module == "train" else measure.main)(args)
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == ""
    assert err.startswith(message) and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args, message", [
    (["--data", "text.txt", "--metrics-file", "text.txt"], "--metrics-file text.txt is the --data file"),
    (["--data", "text.txt", "--metrics-file", "d/../text.txt"], "--metrics-file d/../text.txt is the --data file"),
    (["--data", "d", "--metrics-file", "d/m.jsonl"], "--metrics-file d/m.jsonl lies in the --data folder"),
    (["--data", "d", "--metrics-file", "d/old.jsonl"], "--metrics-file d/old.jsonl lies in the --data folder"),
    (["--checkpoint-dir", "ck", "--metrics-file", "ck/run_state.json"],
     "--metrics-file ck/run_state.json: run_state.json is a name the run keeps its own state under"),
    (["--metrics-file", "oom-rank1.json"], "--metrics-file oom-rank1.json: oom-rank1.json is a name the run keeps"),
    (["--checkpoint-dir", "ck", "--metrics-file", "ck/step-00000004"],
     "--metrics-file ck/step-00000004: step-00000004 is a name"),
    (["--data", "short.txt"], "--data: short.txt: domain 'short' has 2 tokens, fewer than one sequence"),
])
def test_the_metrics_file_is_no_file_the_run_reads_or_keeps_its_state_in(args, message, tmp_path, monkeypatch,
                                                                          capsys):
    """A metrics file that would replace the data, be read as data by a restart, or overwrite the run's state is
    refused in one line before anything is written; a short domain names --data."""
    from reference_trainer import train

    monkeypatch.chdir(tmp_path)
    text = " ".join(f"word{i}" for i in range(400))
    (tmp_path / "text.txt").write_text(text)
    (tmp_path / "short.txt").write_text("x")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text(text)
    (tmp_path / "d" / "old.jsonl").write_text('{"step": 0}\n')  # an earlier run's metrics: refused before it is read
    (tmp_path / "ck").mkdir()
    with pytest.raises(SystemExit) as exited:
        train.main(["--pp", "1", "--dp", "1", "--ep", "1", "--world-size", "--check", *args])
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == ""
    assert err.startswith(f"error: {message}") and len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "text.txt").read_text() == text and sorted(p.name for p in (tmp_path / "ck").iterdir()) == []
    for fine in (["--data", "text.txt", "--metrics-file", "d/m.log"], ["--checkpoint-dir", "ck", "--metrics-file",
                                                                       "ck/metrics.jsonl"],
                 ["--checkpoint-dir", "ck", "--metrics-file", "ck/step-times.jsonl"],
                 ["--metrics-file", "step-00000004"]):  # no checkpoint is written beside it
        train.main(["--pp", "1", "--dp", "1", "--ep", "1", "--world-size", "--check", *fine])
        assert capsys.readouterr().out.strip() == "1"


def test_a_metrics_file_hard_linked_to_the_data_or_in_a_folder_that_takes_no_files_is_refused(tmp_path,
                                                                                              monkeypatch, capsys):
    """A hard link is the data file under another name (refused like the path itself); a metrics folder the run
    cannot write in is refused before any collective, also by --check and beside --checkpoint-dir."""
    import os

    from reference_trainer import train

    monkeypatch.chdir(tmp_path)
    text = " ".join(f"word{i}" for i in range(400))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text(text)
    os.link(tmp_path / "d" / "a.txt", tmp_path / "link.jsonl")
    os.link(tmp_path / "d" / "a.txt", tmp_path / "link2.log")
    (tmp_path / "ck").mkdir()
    cases = [(["--data", "d/a.txt", "--metrics-file", "link.jsonl"], "--metrics-file link.jsonl is the --data file"),
             (["--data", "d", "--metrics-file", "link2.log"], "--metrics-file link2.log lies in the --data folder")]
    if os.path.isdir("/proc"):  # a folder that takes no new files, for root too
        cases.append((["--checkpoint-dir", "ck", "--metrics-file", "/proc/bagualu2-metrics.jsonl"],
                      "--metrics-file: metrics path /proc/bagualu2-metrics.jsonl: cannot write it"))
    for args, message in cases:
        with pytest.raises(SystemExit) as exited:
            train.main(["--pp", "1", "--dp", "1", "--ep", "1", "--world-size", "--check", *args])
        out, err = capsys.readouterr()
        assert exited.value.code == 2 and out == ""
        assert err.startswith(f"error: {message}") and len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "d" / "a.txt").read_text() == text


@pytest.mark.launch
@pytest.mark.slow
def test_a_stopped_launch_stops_its_workers(tmp_path):
    """SIGTERM to ``bagualu2 train`` goes on to torchrun's agent, which stops the workers: none keeps training."""
    import signal
    import time

    metrics = tmp_path / "run.jsonl"  # a unique path: how this launch's workers are found
    launch = subprocess.Popen([sys.executable, "-m", "bagualu2.cli", "train", "--", "--pp", "1", "--dp", "2",
                               "--ep", "2", "--steps", "200", "--metrics-file", str(metrics)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text()) and time.monotonic() < deadline:
        time.sleep(0.5)  # until the first step is logged: the workers are training
    launch.send_signal(signal.SIGTERM)
    _, stderr = launch.communicate(timeout=120)
    assert launch.returncode == 128 + signal.SIGTERM, stderr
    assert stderr.strip().splitlines() == ["stopped by signal 15; the workers were stopped"], stderr
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", str(metrics)], capture_output=True, text=True).stdout.split()
    assert not left, left


@pytest.mark.launch
@pytest.mark.slow
def test_a_running_launchs_checkpoints_are_its_own_and_a_killed_launcher_leaves_no_worker(tmp_path):
    """A second launch into the checkpoint directory of a running one is refused in one line (exit 2); SIGKILL of
    ``bagualu2 train`` (which cannot forward it) still stops the agent and its workers."""
    import signal
    import time

    metrics, ckpt = tmp_path / "run.jsonl", tmp_path / "ckpt"
    launch = subprocess.Popen([sys.executable, "-m", "bagualu2.cli", "train", "--", "--pp", "1", "--dp", "2",
                               "--ep", "2", "--steps", "300", "--metrics-file", str(metrics), "--checkpoint-dir",
                               str(ckpt), "--checkpoint-every", "100"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text()) and time.monotonic() < deadline:
        time.sleep(0.5)  # until the first step is logged: the workers are training
    second = subprocess.run([sys.executable, "-m", "reference_trainer.train", "--pp", "1", "--dp", "1", "--ep", "1",
                             "--steps", "2", "--checkpoint-dir", str(ckpt), "--resume"],
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 2, second.stderr
    assert second.stderr.strip().splitlines() == [
        f"error: --checkpoint-dir {ckpt}: it is in use by a launch that is still running "
        f"{second.stderr.split('still running ', 1)[1].split(')', 1)[0]}); give another directory"]
    assert not list(ckpt.glob("step-*"))  # the refused launch wrote nothing
    launch.send_signal(signal.SIGKILL)
    launch.wait(timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        left = subprocess.run(["pgrep", "-f", str(metrics)], capture_output=True, text=True).stdout.split()
        if not left:
            break
        time.sleep(0.5)
    assert not left, left


@pytest.mark.launch
def test_an_agent_killed_from_outside_is_one_line_and_128_plus_the_signal(capsys):
    from bagualu2.cli.train_cmd import _run_agent

    code = _run_agent([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 137 and len(err) == 1, err
    assert err[0].startswith("error: torchrun's agent (pid ") and "was stopped by SIGKILL from outside" in err[0]
    assert _run_agent([sys.executable, "-c", "raise SystemExit(3)"]) == 3 and capsys.readouterr().err == ""
    assert _run_agent([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]) == 139
    assert "crashed with SIGSEGV (its output above says where); its workers stopped with it" in capsys.readouterr().err


@pytest.mark.launch
def test_a_rank_killed_from_outside_with_no_restart_left_is_one_line_from_the_launcher(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bagualu2.cli", "train", "--", "--steps", "3"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "BAGUALU2_FAULTS": "kill@1:rank=1",
                                                       "TMPDIR": str(tmp_path)})
    assert not list(tmp_path.glob("*torchelastic*"))  # the workers' error files went with the launch
    assert proc.returncode == 128 + 9, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "error: rank 1 was stopped by SIGKILL (from outside the trainer: kill, the host's out-of-memory killer) and "
        "no restart is left (--max-restarts)"], proc.stderr[-3000:]


def test_a_worker_ended_by_a_signal_is_named_as_killed_or_crashed(capsys):
    import signal
    from types import SimpleNamespace

    from bagualu2.cli.launch import report_killed, signal_of

    assert [signal_of(code) for code in (-9, 137, 143, 2, 76, 255)] == [9, 9, 15, None, None, None]
    assert report_killed(1, SimpleNamespace(exitcode=-signal.SIGKILL)) == 137
    assert report_killed(2, SimpleNamespace(exitcode=-signal.SIGABRT)) == 134
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("error: rank 1 was stopped by SIGKILL (from outside the trainer")
    assert lines[1] == ("error: rank 2 crashed with SIGABRT (its output above says where) and no restart is left "
                        "(--max-restarts)")


@pytest.mark.launch
def test_ctrl_c_while_the_trainer_starts_prints_no_traceback():
    import signal
    import time

    # far more steps than run before the signal: a one-step run can end first (about 3 s here), and a Ctrl-C that
    # lands in the interpreter's shutdown after the summary is rightly ignored
    proc = subprocess.Popen([sys.executable, "-m", "reference_trainer.train", "--pp", "1", "--dp", "1", "--ep", "1",
                             "--steps", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)  # importing torch (about 3 s here), well after the interpreter started
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode in (130, -signal.SIGINT) and "Traceback" not in stderr, stderr


@pytest.mark.launch
def test_the_agent_of_bagualu2_train_forks_its_workers_with_sigint_held_and_keeps_its_own():
    """A Ctrl-C in a worker's first milliseconds (the interpreter's start-up, before any handler) printed Python's
    fatal error: ``bagualu2 train``'s agent forks the workers with SIGINT blocked, and its own mask is restored."""
    import signal

    from bagualu2.cli.launch import workers_start_with_sigint_held

    class Agent:
        def _start_workers(self, worker_group):
            status = subprocess.run([sys.executable, "-c", "print(open('/proc/self/status').read())"],
                                    capture_output=True, text=True, check=True).stdout
            return int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)

    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    assert not Agent()._start_workers(None) >> (signal.SIGINT - 1) & 1  # as torchrun forks them: not held
    workers_start_with_sigint_held(Agent)
    workers_start_with_sigint_held(Agent)  # wrapped once
    assert Agent()._start_workers(None) >> (signal.SIGINT - 1) & 1
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before


@pytest.mark.launch
def test_a_sigint_held_since_the_trainer_was_forked_ends_it_quietly():
    """The trainer unblocks SIGINT once its handler stands: one sent while it was held (the worker's first
    milliseconds) ends it then, with exit code 130 and no traceback."""
    import signal

    def held() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    proc = subprocess.Popen([sys.executable, "-m", "reference_trainer.train", "--pp", "1", "--dp", "1", "--ep", "1",
                             "--steps", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=held)
    try:
        proc.send_signal(signal.SIGINT)  # at once: the interpreter is starting
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and stderr == "", stderr


@pytest.mark.parametrize("given, endpoint", [("::1", "[::1]"), ("[fe80::1]", "[fe80::1]"), ("10.0.0.7", "10.0.0.7"),
                                             ("node-01.cluster", "node-01.cluster"), ("my_host", "my_host")])
def test_the_rendezvous_host_is_a_name_or_an_address(given, endpoint):
    assert train_cmd.rendezvous_host(given) == endpoint


def test_state_and_metrics_paths_that_are_not_regular_files_are_refused(tmp_path, monkeypatch, capsys):
    from reference_trainer import train
    from reference_trainer.metrics import check_path
    from reference_trainer.restarts import marker_files

    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere.jsonl")
    for path, message in ((tmp_path / "dangling", "exists and is not a regular file"),
                          (f"{tmp_path}/new/", "a file name is needed"),
                          (tmp_path / ("m" * 300 + ".jsonl"), "too long")):
        with pytest.raises(ValueError, match=message):
            check_path(str(path))
    (tmp_path / "oom-rank0.json").mkdir()  # a folder named like a restart marker: never removed, refused
    (tmp_path / "fault-rank1.json").write_text("{}")
    assert marker_files(tmp_path) == [tmp_path / "fault-rank1.json"]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as exited:
        train.main(["--pp", "1", "--dp", "1", "--ep", "1", "--steps", "1", "--checkpoint-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "oom-rank0.json exists and is not a regular file" in err
    assert (tmp_path / "oom-rank0.json").is_dir()


@pytest.mark.launch
def test_a_demo_stopped_by_sigterm_stops_its_trainer_and_removes_its_folder(tmp_path):
    """SIGTERM to ``bagualu2 demo`` alone (not its process group): the trainer it started stops too, and its
    temporary folder (under this test's TMPDIR) is removed."""
    import os
    import signal
    import time

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    demo = subprocess.Popen([sys.executable, "-m", "bagualu2.cli", "demo", "--train-steps", "500"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("bagualu2-demo-*/metrics.jsonl")) and time.monotonic() < deadline:
        time.sleep(0.2)  # until the trainer logs a step
    demo.send_signal(signal.SIGTERM)
    _, stderr = demo.communicate(timeout=60)
    assert demo.returncode == 128 + signal.SIGTERM and "Traceback" not in stderr, stderr
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not left and not list(tmp_path.glob("bagualu2-demo-*"))


@pytest.mark.parametrize("codes, restarted", [
    ({0: 2}, False), ({0: 2, 1: -15}, False), ({0: 2, 1: 143}, False), ({0: 78, 1: -6}, False), ({0: 65}, False),
    ({0: 75, 1: 2}, True), ({0: -9}, True), ({0: 65, 1: 76}, True), ({0: 76, 1: 143}, True), ({0: 1}, True)])
def test_the_agent_restarts_unless_every_failure_is_final_or_a_stopped_peer(codes, restarted):
    """torch's own RunResult through the launcher's wrapper of the agent's monitor (a stand-in agent class)."""
    import types

    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    from bagualu2.cli.launch import no_restart_after_final_failures

    class Agent:
        def _monitor_workers(self, worker_group):
            return self.result

    no_restart_after_final_failures(Agent)
    agent = Agent()
    agent._remaining_restarts = 3
    agent.result = RunResult(state=WorkerState.FAILED,
                             failures={rank: types.SimpleNamespace(exitcode=code) for rank, code in codes.items()})
    assert agent._monitor_workers(None) is agent.result
    assert (agent._remaining_restarts == 3) is restarted


def test_measure_refuses_an_imbalance_no_routing_gives_before_any_collective():
    """tiny-moe at --ep 8: 8 experts, top-2: rank 0 receives at most 4x the mean, not 8x."""
    from reference_trainer.experiments.measure import measure

    with pytest.raises(ValueError, match=r"^--imbalance: with --ep 8, 8 experts and top-2 routing, rank 0 receives "
                                         r"at most 4 x the mean routed tokens; got 5$"):
        measure("tiny-moe", imbalance=5.0, ep=8)
