"""The §VI reproduction (``bagualu2.sim.reproduce``, ``bagualu2 reproduce``), the ablation levels and the
``on_oom`` restart rule of the simulator, on small configurations (the full report is docs/reproduction.md)."""

from __future__ import annotations

import dataclasses

import json
import os
from functools import lru_cache
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bagualu2.cli import app
from bagualu2.costmodel import Strategy, evaluate, presets
from bagualu2.sim import ABLATION, SimConfig, make_policy, simulate
from bagualu2.sim.figures import figures
from bagualu2.sim.report import markdown
from bagualu2.sim.reproduce import ReproduceConfig, on_oom, reproduce, spike_mfu, steps
from bagualu2.sim.stage import StageContext

MODEL = "glm-188b-a20b"
HARDWARE = presets.hardware("paper-gpu")
SMALL = dict(iterations=40, seed=3, models=(MODEL,), focus=MODEL, top_ks=(4,), seq_lengths=(4096,),
             overhead_iterations=2, jobs=1)
runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})
PNG = b"\x89PNG\r\n\x1a\n"


@lru_cache(maxsize=None)
def small_report():
    labels = []
    report = reproduce(ReproduceConfig(**SMALL), progress=labels.append)
    return report, tuple(labels)


def test_tokens_held_scales_the_microbatches_to_counts_the_schedule_takes():
    from bagualu2.sim.reproduce import tokens_held

    _, parallel = presets.model("glm-423b-a30b")  # pp 8, vp 2, 64 micro-batches
    assert [tokens_held(parallel, 4096, n).num_microbatches for n in (2048, 4096, 8192, 16384, 65536)] == [
        128, 64, 32, 16, 8]  # never below pp
    plain = dataclasses.replace(parallel, vp=1, pp=4, num_microbatches=10)
    assert tokens_held(plain, 4096, 12288).num_microbatches == 4  # 3.3 rounds to 3, below pp = 4
    assert tokens_held(plain, 4096, 6144).num_microbatches == 7  # not interleaved: any count >= pp
    interleaved = dataclasses.replace(parallel, pp=4, num_microbatches=24)
    assert tokens_held(interleaved, 4096, 6144).num_microbatches == 16  # exactly 16
    assert tokens_held(interleaved, 4096, 5120).num_microbatches == 20  # 19.2: the multiple of 4 nearest


def test_layer_level_plan_recomputes_whole_layers_until_the_chunk_fits():
    model, parallel = presets.model(MODEL)
    ctx = StageContext(model, parallel, HARDWARE, 0)
    policy = make_policy("L1", ctx, plan_imbalance=1.2)
    for chunk, plan in enumerate(policy.plans):
        graph = ctx.graph(chunk, 1.2)
        recomputed = {key.split("/", 1)[0].split(".")[0] for key, s in plan.entries if s is Strategy.RECOMPUTE}
        layers = sorted(int(name[1:]) for name in recomputed)
        assert layers == list(range(graph.layers[0], graph.layers[0] + len(layers)))  # the first k, whole
        for layer in layers:  # every mitigable saving of the layer
            keys = {f"{op}/{t}" for op, t in graph.decisions if op.startswith(f"L{layer}.")}
            assert keys <= dict(plan.entries).keys()
        fits = evaluate(graph, plan).activation_bytes <= ctx.per_chunk_bytes
        assert fits or len(layers) == len(graph.layers)
        if layers:  # one layer fewer would not fit
            fewer = type(plan)(tuple((k, s) for k, s in plan.entries if not k.startswith(f"L{layers[-1]}.")))
            assert evaluate(graph, fewer).activation_bytes > ctx.per_chunk_bytes


@pytest.mark.slow
def test_ablation_levels_build_on_each_other():
    trace = (1.1, 2.4, 1.0, 1.15)
    model, parallel = presets.model(MODEL)
    results = {level: simulate(model, parallel, HARDWARE, level, trace, on_oom="replan") for level in ABLATION}
    assert results["L3"].oom_events == results["L4"].oom_events == 0
    flexible = simulate(model, parallel, HARDWARE, "flexible", trace).iterations
    assert [(it.time_s, it.peak_bytes) for it in results["L4"].iterations] == [(it.time_s, it.peak_bytes)
                                                                              for it in flexible]
    assert results["L4"].mean_mfu >= results["L3"].mean_mfu >= results["L2"].mean_mfu
    l2 = make_policy("L2", StageContext(model, parallel, HARDWARE, 0))
    under = make_policy("static-under", StageContext(model, parallel, HARDWARE, 0))
    assert l2.plans == under.plans


def test_replan_restarts_the_same_policy_for_the_imbalance_that_crashed_it_then_returns_to_its_plans():
    model, parallel = presets.model(MODEL)
    trace = (1.0, 2.0, 1.5, 2.0, 2.4, 1.0)
    result = simulate(model, parallel, HARDWARE, "kwai", trace, on_oom="replan", restart_s=100.0)
    crashes = [simulate(model, parallel, HARDWARE, "kwai", (rate,)).oom_events == 1 for rate in trace]
    assert [it.restarted for it in result.iterations] == crashes and any(crashes) and not crashes[0]
    assert all(it.policy == "kwai" for it in result.iterations)
    assert result.iterations[-1] == simulate(model, parallel, HARDWARE, "kwai", trace[-1:]).iterations[0]
    fallback = simulate(model, parallel, HARDWARE, "kwai", trace, restart_s=100.0)
    assert fallback.restarts == 1 and fallback.iterations[-1].policy == "static-over"
    assert result.time_lost_s >= 100.0 * sum(crashes)
    with pytest.raises(ValueError, match="on_oom must be one of fallback, replan"):
        SimConfig(on_oom="retry")
    assert on_oom("static-under") == "fallback" and on_oom("kwai") == on_oom("L1") == "replan"
    assert on_oom("flexible") == "fallback"


@pytest.mark.slow
def test_reproduce_reports_every_figure():
    report, labels = small_report()
    assert len(labels) == steps(report.config) and labels[0] == MODEL
    text = markdown(report)
    for heading in ("## Fig. 8", "## §II-B", "## Fig. 9", "## Fig. 10", "(a) sparsity", "(b) sequence length", "## Fig. 11",
                    "## The baselines' overlap: a range", "## Runtime decision overhead", "## Where ours differ"):
        assert heading in text
    # the command that makes this report, its non-default options included; one scale is not "the scales"
    assert f"`bagualu2 reproduce --iterations {SMALL['iterations']} --seed {SMALL['seed']} --model {MODEL}`" in text
    assert "across one Table II scale" in text and "across the Table II scales" not in text
    focus = report.focus
    assert focus.results["flexible"].oom_events == 0
    assert focus.mfu("flexible") >= max(focus.mfu(p) for p in ("kwai", "adapipe", "static-under", "static-over"))
    assert focus.mfu("flexible") >= 0.95 * focus.mfu("ideal")
    assert focus.mfu("ideal") >= focus.mfu("oracle") >= focus.mfu("flexible")
    inside, outside = spike_mfu(focus.results["ideal"], range(len(report.trace)))
    assert inside == pytest.approx(focus.mfu("ideal"), rel=0.2) and outside != outside  # all spikes: no others
    for name, data in figures(report).items():
        assert name.startswith("repro-fig") and data.startswith(PNG)
    # without Megatron-Core's all-to-all pairing no baseline, static policy or level runs faster
    for policy, result in report.released.results.items():
        real = report.ablation if policy in ABLATION else focus
        assert result.mean_mfu <= real.mfu(policy) + 1e-12, policy


@pytest.mark.slow
def test_the_recorded_command_makes_the_same_report():
    from bagualu2.sim.report import command

    assert command(ReproduceConfig()) == "bagualu2 reproduce --iterations 1000 --seed 0"
    odd = ReproduceConfig(iterations=12, seed=5, restart_s=284.1234567, hardware="h200", models=("glm-188b-a20b",))
    assert command(odd) == ("bagualu2 reproduce --iterations 12 --seed 5 --restart-s 284.1234567 --hardware h200 "
                            "--model glm-188b-a20b")


def test_a_trace_without_spikes_reports_dashes_not_nan():
    report = reproduce(ReproduceConfig(**{**SMALL, "iterations": 10, "overhead_iterations": 1}))
    assert not report.spikes()
    text = markdown(report)
    assert "nan" not in text.lower() and "No iteration of this 10-iteration trace is a spike" in text
    assert all(data.startswith(PNG) for data in figures(report).values())


def test_provisioning_is_measured_on_the_normal_iterations_even_after_an_early_fallback():
    """Seed 31's trace starts with a spike: static-under crashes on it and runs static-over from then on, so the
    normal iterations on its own plans come from the §II-B run over the normal iterations alone."""
    from bagualu2.sim.report import headline, provisioning_ratio

    config = ReproduceConfig(**{**SMALL, "seed": 31, "overhead_iterations": 1})
    report = reproduce(config)
    assert report.spikes() == (0,)
    assert report.focus.results["static-under"].iterations[0].oom
    assert {it.policy for it in report.focus.results["static-under"].iterations} == {"static-over"}
    under, over, ratio = provisioning_ratio(report)
    assert 0 < over < under and ratio == over / under
    assert len(report.provisioning[0].results["static-under"].iterations) == 39
    data = headline(report)
    assert data["sec2b"]["ratio"] == ratio and data["released"]["released"]["sec2b"] == provisioning_ratio(
        report, "released")[2]
    cli_doc = (Path(__file__).parents[2] / "docs" / "cli.md").read_text()
    documented = cli_doc[cli_doc.index("`--json` also prints the report's ratios"):]
    for key in (*data, *data["fig8"], *data["fig9"], *data["sec2b"]):  # docs/cli.md names every key
        assert f"`{key}`" in documented, key
    assert "nan" not in markdown(report).lower()


def test_simulations_are_grouped_by_model_and_layout_in_even_shares():
    from bagualu2.sim import reproduce as module

    keys = [(model, layout, policy) for model in "ab" for layout in (1, 2) for policy in range(5)] + [("c", 1, 0)]
    for jobs in (1, 2, 3, 8, 100):
        groups = module._groups(keys, jobs)
        assert sorted(key for group in groups for key in group) == sorted(keys)  # each simulation once
        assert all(len({key[:2] for key in group}) == 1 for group in groups)  # one model and layout each
        assert max(map(len, groups)) <= max(1, -(-len(keys) // jobs))  # no worker holds more than its share
    assert len(module._groups(keys, 1)) == 5 and len(module._groups(keys, 100)) == len(keys)


@pytest.mark.launch
def test_worker_processes_change_nothing_but_the_wall_time():
    config = {**SMALL, "iterations": 35, "overhead_iterations": 1}  # one spike
    steps_seen: dict[int, list] = {1: [], 2: []}
    one, two = (reproduce(ReproduceConfig(**{**config, "jobs": jobs}), progress=steps_seen[jobs].append)
                for jobs in (1, 2))
    assert steps_seen[1] == steps_seen[2]  # the same progress steps, in the report's order
    assert len(one.spikes()) == 1
    for part in ("scales", "sparsity", "seq_length", "seq_length_tokens", "ablation", "released", "provisioning"):
        assert getattr(two, part) == getattr(one, part), part
    assert two.ablation.results["L4"].policy == "L4"
    assert two.ablation.results["L4"].iterations == two.focus.results["flexible"].iterations
    # the decision-overhead replays ran in the workers: every model's, beside the same simulated iteration
    assert [(name, s) for name, _, s in two.overhead] == [(name, s) for name, _, s in one.overhead]
    assert all(ms > 0 for _, ms, _ in two.overhead)


@pytest.mark.launch
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_a_stopped_reproduce_stops_its_simulation_workers_and_writes_nothing(tmp_path, signame):
    """SIGTERM or SIGHUP to ``bagualu2 reproduce`` (not its process group) stops its worker processes, as Ctrl-C
    does: none keeps simulating (and holding the caller's pipes open) after it exited with 128 + the signal."""
    import signal
    import subprocess
    import sys
    import time

    docs = tmp_path / "docs"
    proc = subprocess.Popen([sys.executable, "-m", "bagualu2.cli", "reproduce", "-n", "200000", "--docs", str(docs),
                             "-j", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def children() -> list[str]:
        return subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()

    deadline = time.monotonic() + 120
    while len(children()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)  # until the pool's workers run
    started = children()
    assert len(started) >= 2, started
    proc.send_signal(getattr(signal, signame))
    _, stderr = proc.communicate(timeout=60)  # returns: no worker holds the pipes open
    assert proc.returncode == 128 + getattr(signal, signame) and "Traceback" not in stderr, stderr
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in started if Path(f"/proc/{pid}").exists()]
    assert not docs.exists()


def test_cli_reproduce_reports_a_dead_worker_in_one_line(tmp_path, monkeypatch):
    import bagualu2.cli.reproduce_cmd as command
    from bagualu2.sim.reproduce import WorkerDied

    def dies(config, progress):
        raise WorkerDied("one of 2 simulation worker processes died (killed, or out of memory?); run with fewer jobs")

    monkeypatch.setattr(command, "reproduce", dies)
    result = runner.invoke(app, ["reproduce", "--docs", str(tmp_path)])
    assert result.exit_code == 2 and result.output.strip().startswith("error: --jobs: one of 2 simulation worker")
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "reproduction.md").exists()


def test_numpy_numbers_are_held_as_pythons_so_the_report_writes_as_json():
    import numpy as np

    config = ReproduceConfig(iterations=np.int64(10), seed=np.int64(3), jobs=np.int32(1),
                             overhead_iterations=np.int64(2), seq_lengths=(np.int64(4096),),
                             plan_imbalance=np.float64(1.2), restart_s=np.float32(3.0))
    fields = {name: getattr(config, name) for name in ("iterations", "seed", "jobs", "overhead_iterations",
                                                       "plan_imbalance", "restart_s")}
    assert [type(value) for value in fields.values()] == [int] * 4 + [float] * 2
    assert type(config.seq_lengths[0]) is int
    json.dumps(fields)


def test_default_workers_are_the_usable_cpus_within_the_available_memory(monkeypatch):
    import bagualu2.sim.reproduce as module

    monkeypatch.setattr(module.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    for available, jobs in ((64 << 30, 4), (9 << 30, 2), (1 << 30, 1), (None, 4)):
        monkeypatch.setattr(module, "available_bytes", lambda: available)
        assert module.default_jobs() == jobs


def test_available_memory_counts_the_page_cache_the_kernel_can_drop(tmp_path, monkeypatch):
    import bagualu2.sim.reproduce as module

    pages = {"SC_PAGE_SIZE": 4096, "SC_AVPHYS_PAGES": (1 << 30) // 4096}  # 1 GiB free: the rest is page cache

    def sysconf(name):
        if name not in pages:
            raise ValueError(f"unknown configuration name {name}")
        return pages[name]

    monkeypatch.setattr(module.os, "sysconf", sysconf)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1048576 kB\nMemAvailable:   20971520 kB\n")
    assert module.available_bytes(str(meminfo)) == 20 << 30
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1048576 kB\n")  # an old kernel: no estimate
    assert module.available_bytes(str(meminfo)) == 1 << 30
    assert module.available_bytes(str(tmp_path / "absent")) == 1 << 30  # not on Linux
    del pages["SC_AVPHYS_PAGES"]
    assert module.available_bytes(str(tmp_path / "absent")) is None


@pytest.mark.parametrize("kwargs, field", [({"iterations": 5}, "iterations"), ({"jobs": 0}, "jobs"), ({"restart_s": -1.0}, "restart_s"),
                                           ({"top_ks": (0,)}, "top_ks"), ({"models": ("glm-9t",)}, "glm-9t"),
                                           ({"plan_imbalance": 0.5}, "imbalance"),
                                           ({"seq_lengths": (0,)}, "seq_lengths"),
                                           ({"models": ("tiny-moe",)}, "models must take imbalances up to 2.6")])
def test_reproduce_config_rejects_bad_fields(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ReproduceConfig(**kwargs)


@pytest.mark.slow
def test_cli_reproduce_writes_the_report_and_plots_atomically(tmp_path, monkeypatch):
    import bagualu2.cli.reproduce_cmd as command

    report, _ = small_report()
    monkeypatch.setattr(command, "reproduce", lambda config, progress: report)  # the computation is tested above
    result = runner.invoke(app, ["reproduce", "--docs", str(tmp_path), "-n", "40"])  # makes DIR/img
    assert result.exit_code == 0, result.output
    assert (tmp_path / "reproduction.md").read_text() == markdown(report)
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == sorted(figures(report))
    data = json.loads(runner.invoke(app, ["reproduce", "--docs", str(tmp_path), "--json"]).output)
    assert data["fig8"]["per_model"][MODEL]["flexible_oom_events"] == 0 and len(data["fig11_steps"]) == 3
    policies = set(report.focus.results)
    assert set(data["fig8"]["mean_mfu"]) == policies and set(data["fig9"]["drops"]) == policies
    assert all(0 < mfu < 1 for mfu in data["fig8"]["mean_mfu"].values())
    for key, runs in (("fig10a_mfu", report.sparsity), ("fig10b_mfu", report.seq_length),
                      ("fig10b_tokens_mfu", report.seq_length_tokens)):
        assert data[key] == {run.label: {p: run.mfu(p) for p in run.results} for run in runs}
    assert data["sec2b"]["ratio"] == pytest.approx(data["sec2b"]["over_mfu"] / data["sec2b"]["under_mfu"])
    assert data["released"]["real"]["sec2b"] == pytest.approx(data["sec2b"]["ratio"])
    assert data["released"]["real"]["l3_l4"] == pytest.approx(data["fig11_steps"][2])
    assert set(data["released"]) == {"real", "released", "paper"}
    os.symlink(tmp_path / "reproduction.md", tmp_path / "img" / "repro-fig9.png.lnk")
    (tmp_path / "img" / "repro-fig9.png").unlink()
    os.symlink(tmp_path / "reproduction.md", tmp_path / "img" / "repro-fig9.png")
    refused = runner.invoke(app, ["reproduce", "--docs", str(tmp_path)])
    assert refused.exit_code == 2 and "symlink" in refused.output and "Traceback" not in refused.output
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "img").write_text("a file where the plots' folder goes")
    clash = runner.invoke(app, ["reproduce", "--docs", str(tmp_path / "other")])
    assert clash.exit_code == 2 and "is not a folder" in clash.output and len(clash.output.strip().splitlines()) == 1
    (tmp_path / "linked").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "linked" / "img").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    linked = runner.invoke(app, ["reproduce", "--docs", str(tmp_path / "linked")])  # not followed out of DIR
    assert linked.exit_code == 2 and "is a symbolic link" in linked.output
    assert not any((tmp_path / "elsewhere").iterdir())
    made = runner.invoke(app, ["reproduce", "--docs", str(tmp_path / "fresh")])  # a missing folder is made
    assert made.exit_code == 0, made.output
    assert (tmp_path / "fresh" / "reproduction.md").read_text() == markdown(report)
    assert sorted(p.name for p in (tmp_path / "fresh" / "img").iterdir()) == sorted(figures(report))


@pytest.mark.parametrize("args, option", [(["-n", "3"], "--iterations"), (["--restart-s", "-1"], "--restart-s"),
                                          (["--seed", "-2"], "--seed"), (["-m", "nope"], "--model"),
                                          (["-H", "tpu"], "--hardware"), (["--docs", "/nonexistent/x"], "--docs"),
                                          (["-m", "tiny-moe"], "--model"), (["-j", "0"], "--jobs")])
def test_cli_reproduce_bad_input_is_one_line(args, option):
    result = runner.invoke(app, ["reproduce", *args])
    assert result.exit_code == 2 and option in result.output and len(result.output.strip().splitlines()) == 1


def test_cli_simulate_takes_ablation_levels_and_the_restart_rule():
    result = runner.invoke(app, ["simulate", "-m", MODEL, "-n", "5", "-p", "L3", "-p", "kwai", "--on-oom", "replan",
                                 "--plan-imbalance", "1.2", "--json"])
    assert result.exit_code == 0, result.output
    bad = runner.invoke(app, ["simulate", "-m", MODEL, "-n", "5", "--on-oom", "never"])
    assert bad.exit_code == 2 and "--on-oom" in bad.output


@pytest.mark.parametrize("flag, hidden", [("--full-copies", False), ("--hidden-copies", True)])
def test_cli_simulate_prices_copies_as_asked(flag, hidden):
    from bagualu2.sim import paper_trace

    result = runner.invoke(app, ["simulate", "-m", MODEL, "-n", "3", "-p", "flexible", flag, "--json"])
    assert result.exit_code == 0, result.output
    model, parallel = presets.model(MODEL)
    trace = paper_trace(3, seed=0, num_microbatches=parallel.num_microbatches)
    expected = simulate(model, parallel, presets.hardware("paper-gpu"), "flexible", trace, hidden_copies=hidden)
    assert json.loads(result.output)[0]["mfu"] == pytest.approx(expected.mean_mfu, rel=1e-12)
