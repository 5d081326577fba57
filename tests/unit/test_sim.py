"""The paper-scale simulator (``bagualu2.sim``): traces, policies, OOM + restart, MFU ordering, the CLI."""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache

import pytest
from typer.testing import CliRunner

from bagualu2.cli import app
from bagualu2.costmodel import presets
from bagualu2.sim import POLICIES, PaperTrace, SimConfig, load_trace, paper_trace, simulate

MODEL = "glm-188b-a20b"  # pp=4, vp=2: the smallest Table II layout
HARDWARE = presets.hardware("paper-gpu")
runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})

NO_SPIKES = paper_trace(12, seed=1, spike_share=0.0)
WITH_SPIKES = (1.1, 2.6, 1.05, 2.4, 1.2, 1.0)


@lru_cache(maxsize=None)
def run(policy: str, trace: tuple, restart_s: float = 284.0):
    model, parallel = presets.model(MODEL)
    return simulate(model, parallel, HARDWARE, policy, trace, restart_s=restart_s)


# ---- traces ------------------------------------------------------------------------------------------------
def test_paper_trace_is_seeded_and_has_the_papers_shares():
    trace = paper_trace(10_000, seed=7)
    assert trace == paper_trace(10_000, seed=7) and trace != paper_trace(10_000, seed=8)
    spikes = [r for r in trace if r > 1.2]
    assert len(spikes) == 290  # exactly 2.9%
    assert all(1.2 < r <= 2.6 for r in spikes)
    assert all(1.0 <= r <= 1.2 for r in trace if r <= 1.2)
    assert max(spikes) > 2.4 and min(spikes) < 1.4  # spread over the spike range
    assert paper_trace(50, spike_share=0.0) == tuple(r for r in paper_trace(50, spike_share=0.0) if r <= 1.2)


def test_a_spike_hits_a_few_micro_batches_of_its_iteration():
    plain = paper_trace(2000, seed=3)
    for kwargs, hit in (({}, 1), ({"spike_microbatches": 3}, 3), ({"spike_microbatch_share": 0.25}, 4),
                        ({"spike_microbatch_share": 0.01}, 1)):
        trace = paper_trace(2000, seed=3, num_microbatches=16, **kwargs)
        assert trace == paper_trace(2000, seed=3, num_microbatches=16, **kwargs)
        for rate, entry in zip(plain, trace):
            if rate <= 1.2:
                assert entry == rate  # ordinary iterations: one rate, as without micro-batches
                continue
            assert len(entry) == 16 and max(entry) == rate and entry.count(rate) == hit
            assert all(1.0 <= r <= 1.2 for r in entry if r != rate)


@pytest.mark.parametrize("kwargs, field", [({"num_iterations": 0}, "num_iterations"),
                                           ({"num_iterations": 5, "num_microbatches": 4, "spike_microbatches": 5},
                                            "spike_microbatches"),
                                           ({"num_iterations": 5, "spike_microbatch_share": 0.0},
                                            "spike_microbatch_share"),
                                           ({"num_iterations": 5, "spike_microbatch_share": 0.5},
                                            "need num_microbatches"),
                                           ({"num_iterations": 5, "spike_microbatches": 3}, "need num_microbatches"),
                                           ({"num_iterations": 5, "spike_share": 1.5}, "spike_share"),
                                           ({"num_iterations": 5, "base_low": 0.5}, "base_low"),
                                           ({"num_iterations": 5, "base_high": 0.9}, "base_high"),
                                           ({"num_iterations": 5, "spike_max": 1.1}, "spike_max"),
                                           ({"num_iterations": 5, "base_high": 1.25, "spike_max": 1.255},
                                            "spike_max"),  # no rate above base_high at 2 decimals
                                           ({"num_iterations": 5, "seed": -1}, "seed")])
def test_paper_trace_rejects_bad_fields(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PaperTrace(**kwargs)


def write(tmp_path, lines):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_load_trace_reads_the_trainers_log(tmp_path):
    rows = [json.dumps({"iteration": i, "microbatch": m, "imbalance": 1.0 + i + m / 10})
            for i in range(2) for m in range(3)]
    assert load_trace(write(tmp_path, rows[::-1])) == ((1.0, 1.1, 1.2), (2.0, 2.1, 2.2))


def test_a_trace_and_a_model_file_saved_with_a_byte_order_mark_read_as_without(tmp_path):
    trace = tmp_path / "bom.jsonl"
    trace.write_text("".join(json.dumps({"iteration": 0, "microbatch": m, "imbalance": 1.5}) + "\n"
                             for m in range(4)), encoding="utf-8-sig")
    assert load_trace(trace) == ((1.5,) * 4,)
    model = tmp_path / "model.json"
    config, parallel = presets.model(MODEL)
    parallel = dataclasses.replace(parallel, num_microbatches=4)
    model.write_text(json.dumps({"model": dataclasses.asdict(config), "parallel": dataclasses.asdict(parallel)}),
                     encoding="utf-8-sig")
    result = runner.invoke(app, ["simulate", "-m", str(model), "--trace", str(trace), "-p", "ideal", "--json"])
    assert result.exit_code == 0, result.stderr


@pytest.mark.parametrize("lines, match", [
    (['{"iteration": 0, "microbatch": 0, "imbalance": 1.0}', "not json"], "line 2: not valid JSON"),
    (['{"iteration": 0, "microbatch": 0}'], "line 1: expected"),
    (['{"iteration": 0, "microbatch": 0, "imbalance": 0.5}'], "line 1: imbalance"),
    (['{"iteration": 0, "microbatch": 0, "imbalance": 1}', '{"iteration": 0, "microbatch": 0, "imbalance": 1}'],
     "line 2: .*twice"),
    (['{"iteration": 1, "microbatch": 0, "imbalance": 1}'], "iteration 0 is missing .* the next is 1, line 1"),
    ([""], "no trace rows"),
])
def test_load_trace_names_the_bad_line(tmp_path, lines, match):
    with pytest.raises(ValueError, match=match):
        load_trace(write(tmp_path, lines))


# ---- policies --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_without_spikes_flexible_beats_the_static_plans():
    flexible, over, under = (run(p, NO_SPIKES) for p in ("flexible", "static-over", "static-under"))
    assert flexible.oom_events == 0
    for fast, slow in zip(flexible.iterations, over.iterations):
        assert fast.time_s <= slow.time_s
    assert flexible.mean_mfu >= under.mean_mfu
    assert flexible.mean_mfu >= over.mean_mfu


def test_static_under_pays_one_restart_per_oom_then_runs_static_over():
    under, over = run("static-under", WITH_SPIKES), run("static-over", WITH_SPIKES)
    assert under.oom_events == under.restarts == 1
    first = next(i for i, it in enumerate(under.iterations) if it.oom)
    assert under.iterations[first].restarted and under.iterations[first].policy == "static-over"
    assert all(it.policy == "static-under" for it in under.iterations[:first])
    assert all(it.policy == "static-over" and not it.oom for it in under.iterations[first + 1:])
    lost = under.iterations[first].lost_s
    assert lost > 284.0 and under.time_lost_s == lost
    assert under.iterations[first].time_s == pytest.approx(lost + over.iterations[first].time_s)
    assert under.total_time_s > over.total_time_s
    assert run("static-under", WITH_SPIKES, 0.0).time_lost_s == pytest.approx(lost - 284.0)


@pytest.mark.slow
def test_flexible_never_exceeds_any_stages_capacity():
    result = run("flexible", WITH_SPIKES)
    assert result.oom_events == 0
    for it in result.iterations:
        assert all(peak <= cap for peak, cap in zip(it.peak_bytes, result.m_max_bytes))
    assert max(run("ideal", WITH_SPIKES).iterations[1].peak_bytes) > max(result.iterations[1].peak_bytes)


@pytest.mark.slow
def test_ideal_oracle_flexible_order():
    trace = WITH_SPIKES + NO_SPIKES[:4]
    ideal, oracle, flexible = (run(p, trace).mean_mfu for p in ("ideal", "oracle", "flexible"))
    assert ideal >= oracle >= flexible > 0


@pytest.mark.slow
def test_every_policy_runs_and_summarises():
    for policy in POLICIES:
        result = run(policy, WITH_SPIKES)
        summary = result.summary()
        assert summary["policy"] == policy and summary["iterations"] == len(WITH_SPIKES)
        assert 0 < summary["mfu"] < 1 and summary["tokens_per_s"] > 0
        assert result.tokens_per_iteration == 4096 * 1 * 64 * 16
    assert run("ideal", WITH_SPIKES).oom_events == 0


@pytest.mark.slow
def test_per_microbatch_trace_equals_the_uniform_one():
    model, parallel = presets.model(MODEL)
    per = ((1.1,) * parallel.num_microbatches,)
    assert simulate(model, parallel, HARDWARE, "static-over", per).iterations == \
        simulate(model, parallel, HARDWARE, "static-over", (1.1,)).iterations


@pytest.mark.parametrize("kwargs, match", [({"policy": "megatron"}, "policy must be one of"),
                                           ({"trace": (1.0, 0.5)}, r"trace\[1\] \(iteration 1\): imbalance"),
                                           ({"trace": ((1.0, 1.1),)},
                                            r"trace\[0\] \(iteration 0\): must be a rate or a sequence of 64"),
                                           ({"trace": ()}, "1 to 10,000,000 iterations, got 0"),
                                           ({"restart_s": -1.0}, "restart_s"),
                                           ({"plan_imbalance": 0.9}, "imbalance")])
def test_simulate_rejects_bad_inputs(kwargs, match):
    model, parallel = presets.model(MODEL)
    args = {"policy": "static-over", "trace": (1.0,), **kwargs}
    policy, trace = args.pop("policy"), args.pop("trace")
    with pytest.raises(ValueError, match=match):
        simulate(model, parallel, HARDWARE, policy, trace, **args)
    with pytest.raises(ValueError, match="restart_s"):
        SimConfig(restart_s=float("nan"))


# ---- CLI ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_json_fields():
    result = runner.invoke(app, ["simulate", "-m", MODEL, "-n", "6", "--seed", "1", "-p", "static-over",
                                 "-p", "flexible", "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert [d["policy"] for d in data] == ["static-over", "flexible"]
    for d in data:
        assert {"policy", "mfu", "oom_events", "restarts", "tokens_per_s", "time_lost_s"} <= set(d)
    assert data[0]["mfu"] == pytest.approx(run("static-over", paper_trace(6, seed=1)).mean_mfu)


def test_cli_table_and_trace_file(tmp_path):
    rows = [json.dumps({"iteration": i, "microbatch": m, "imbalance": 1.1}) for i in range(2) for m in range(64)]
    result = runner.invoke(app, ["simulate", "-m", MODEL, "--trace", str(write(tmp_path, rows)), "-p", "ideal"])
    assert result.exit_code == 0, result.stderr
    assert "ideal" in result.stdout and "mean MFU" in result.stdout


@pytest.mark.parametrize("args, option", [(["-p", "nope"], "--policy"), (["-n", "-1"], "--iterations"),
                                          (["--restart-s", "-2"], "--restart-s"), (["--seed", "-1"], "--seed"),
                                          (["--model", "nope"], "--model"),
                                          (["--model", "tiny-moe"], "--model")])  # ep=1: no paper trace
def test_cli_errors_are_one_line(args, option):
    result = runner.invoke(app, ["simulate", *args])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {option}:"), result.stderr


@pytest.mark.parametrize("flag", [["-n", "5"], ["--seed", "3"], ["--spike-microbatches", "2"]])
def test_cli_paper_trace_flags_are_refused_with_a_trace_file(tmp_path, flag):
    rows = [json.dumps({"iteration": 0, "microbatch": m, "imbalance": 1.1}) for m in range(64)]
    result = runner.invoke(app, ["simulate", "-m", MODEL, "--trace", str(write(tmp_path, rows)), *flag])
    assert result.exit_code == 2
    option = {"-n": "--iterations"}.get(flag[0], flag[0])
    assert result.stderr.strip().startswith(f"error: {option}: shapes the paper trace only"), result.stderr


def test_cli_trace_rate_above_ep_names_the_file_iteration_and_micro_batch(tmp_path):
    rows = [json.dumps({"iteration": 0, "microbatch": m, "imbalance": 1000.0 if m == 3 else 1.1}) for m in range(64)]
    path = write(tmp_path, rows)
    result = runner.invoke(app, ["simulate", "-m", MODEL, "--trace", str(path), "-p", "ideal"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"error: --trace: {path}: iteration 0, micro-batch 3: imbalance 1000 above "
                                     f"what {MODEL} takes: must be in [1, 16] (max/mean device load: a token reaches "
                                     "at most top_k=4 of num_experts=64 experts, so one of ep=32 ranks receives at "
                                     "most num_experts / top_k times the mean)")
    rows = [json.dumps({"iteration": 0, "microbatch": m, "imbalance": 16.0000001 if m == 3 else 1.1})
            for m in range(64)]
    just_above = runner.invoke(app, ["simulate", "-m", MODEL, "--trace", str(write(tmp_path, rows)), "-p", "ideal"])
    assert just_above.exit_code == 2 and "imbalance 16.0000001 above" in just_above.stderr  # never shown as 16


def test_cli_malformed_trace(tmp_path):
    result = runner.invoke(app, ["simulate", "-m", MODEL, "--trace", str(write(tmp_path, ["{"]))])
    assert result.exit_code == 2
    assert result.stderr.strip().startswith("error: --trace:") and "line 1" in result.stderr


@pytest.mark.slow
def test_simulate_png_is_written_atomically_and_refuses_non_files(tmp_path):
    import os

    from typer.testing import CliRunner

    from bagualu2.cli import app

    target = tmp_path / "mfu.png"
    result = CliRunner().invoke(app, ["simulate", "-m", "glm-188b-a20b", "-n", "20", "-p", "flexible", "-p",
                                      "static-over", "--png", str(target)])
    assert result.exit_code == 0, result.output
    assert target.read_bytes().startswith(b"\x89PNG") and not list(tmp_path.glob(".*tmp"))
    fifo = tmp_path / "fifo.png"
    os.mkfifo(fifo)
    bad = CliRunner().invoke(app, ["simulate", "-n", "5", "--png", str(fifo)])
    assert bad.exit_code == 2 and bad.output.startswith("error: --png:") and fifo.exists()


@pytest.mark.slow
def test_a_memory_cap_replaces_every_stages_capacity():
    """``m_max_bytes`` (the trainer's --memory-cap): budgets, fixed plans and OOMs use it on every stage."""
    model, parallel = presets.model(MODEL)
    free = simulate(model, parallel, HARDWARE, "flexible", WITH_SPIKES)
    cap = min(free.m_max_bytes) // 2
    capped = simulate(model, parallel, HARDWARE, "flexible", WITH_SPIKES, m_max_bytes=cap)
    assert capped.m_max_bytes == (cap,) * parallel.pp and capped.oom_events == 0
    assert all(peak <= cap for it in capped.iterations for peak in it.peak_bytes)
    assert capped.total_time_s > free.total_time_s  # mitigation costs time
    assert simulate(model, parallel, HARDWARE, "ideal", WITH_SPIKES, m_max_bytes=cap).oom_events == 0
    with pytest.raises(ValueError, match="m_max_bytes"):
        SimConfig(m_max_bytes=0)


def test_a_forward_is_never_paired_with_its_own_backward():
    """At pp=1 without pairing every step is F_i then B_i: each is priced alone, under every execution."""
    import dataclasses

    from bagualu2.sim.policies import make_policy
    from bagualu2.sim.simulate import stage_time
    from bagualu2.sim.stage import StageContext

    model, parallel = presets.model("glm-423b-a30b")
    model = model.replace(num_layers=2)
    parallel = dataclasses.replace(parallel, pp=1, vp=1, dp=256, num_microbatches=4, paired=False)
    ctx = StageContext(model, parallel, presets.hardware("h200"), 0)
    rates = (1.1,) * parallel.num_microbatches
    ideal = stage_time(make_policy("ideal", ctx), rates).busy_s
    for name in ("static-under", "kwai", "L3", "flexible"):
        policy = make_policy(name, ctx, plan_imbalance=1.2) if name in ("static-under", "kwai") else \
            make_policy(name, ctx)
        choice = policy.forward(0, 1.1, "steady", 1 << 62)
        assert stage_time(policy, rates).busy_s == pytest.approx(4 * (choice.forward_s + choice.backward_s))
        assert stage_time(policy, rates).busy_s >= ideal * (1 - 1e-9)


def test_the_gradient_reduction_hides_behind_the_last_backward_on_every_stage():
    """The last micro-batch's backward counts whether it runs alone or inside the last steady pair."""
    from bagualu2.sim.policies import make_policy
    from bagualu2.sim.simulate import stage_time
    from bagualu2.sim.stage import StageContext

    model, parallel = presets.model(MODEL)
    rates = (1.1,) * parallel.num_microbatches
    spans = [stage_time(make_policy("ideal", StageContext(model, parallel, HARDWARE, s)), rates).last_backward_s
             for s in range(parallel.pp)]
    assert min(spans) > 0
    assert spans == pytest.approx([spans[0]] * parallel.pp)


def test_a_layout_with_no_room_for_activations_is_one_line_before_any_iteration():
    model, parallel = presets.model(MODEL)
    with pytest.raises(ValueError, match=r"hardware 'cpu' leaves 0\.00 GiB for activations on stage 0") as caught:
        simulate(model, parallel, presets.hardware("cpu"), "flexible", (1.0,))
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match=r"the activation cap m_max_bytes=1048576 on stage 0, below the .* GiB its"):
        simulate(model, parallel, HARDWARE, "static-over", (1.0,), m_max_bytes=1 << 20)
    result = runner.invoke(app, ["simulate", "-m", MODEL, "-H", "cpu", "-n", "5"])
    assert result.exit_code == 2 and "nothing fits" in result.output and "--hardware" in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_the_no_room_line_names_the_last_stages_logits():
    """What the last stage's logits take is named beside the weights, so the line's numbers add up."""
    import dataclasses

    from bagualu2.costmodel import stage_memory
    from bagualu2.costmodel.memory import logits_bytes

    model, parallel = presets.model("tiny-moe")
    model = dataclasses.replace(model, seq_length=1 << 24)
    last = parallel.pp - 1
    memory = stage_memory(model, parallel, HARDWARE, stage=last)
    assert memory.logits_bytes == logits_bytes(model, parallel) > 0 and memory.m_max_bytes == 0
    with pytest.raises(ValueError, match=rf"on stage {last} \(64\.0 GiB less 4\.0 reserved, 0\.00 of weights, "
                                         r"gradients and optimizer states and [0-9.]+ of logits\)"):
        memory.check_room(HARDWARE, last)
    assert stage_memory(model, parallel, HARDWARE, stage=0).logits_bytes == 0


def test_a_tuple_of_equal_rates_is_the_scalar_iteration():
    """One iteration, two spellings: the memo keys them alike, so flexible's history cannot tell them apart."""
    model, parallel = presets.model("glm-423b-a30b")
    spelled = simulate(model, parallel, HARDWARE, "flexible", [1.1, (1.1,) * parallel.num_microbatches, 1.1])
    assert spelled == simulate(model, parallel, HARDWARE, "flexible", [1.1, 1.1, 1.1])


def test_simulate_takes_names_in_any_case():
    args = ["simulate", "-m", MODEL, "-n", "2", "--json", "--on-oom", "REPLAN", "--overlap", "Real"]
    result = runner.invoke(app, [*args, "-p", "Static-Over", "-p", "l1", "-p", "static-over"])
    assert result.exit_code == 0, result.output
    assert [r["policy"] for r in json.loads(result.stdout)] == ["static-over", "L1"]


def test_a_stage_without_steady_pairs_times_each_pass_with_its_own_copies():
    """One micro-batch at pp = 1: paired or not, F0 then B0 run alone, so the copies F0 offloads wait for it to make
    them and the iteration takes the same time (the paired layout ran them beside F0 from its start before)."""
    model, base = presets.model("glm-188b-a20b")
    hardware = presets.hardware("h200")
    times = {}
    for paired in (True, False):
        parallel = dataclasses.replace(base, pp=1, vp=1, num_microbatches=1, paired=paired)
        for policy in ("flexible", "oracle", "ideal"):
            result = simulate(model, parallel, hardware, policy, [1.0, 2.0, 2.6], plan_imbalance=1.2)
            times[paired, policy] = [it.time_s for it in result.iterations]
    for policy in ("flexible", "oracle", "ideal"):
        assert times[True, policy] == pytest.approx(times[False, policy], rel=1e-12), policy
