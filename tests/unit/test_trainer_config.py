"""The trainer's flags and recipes: every bad input is one line naming the flag (exit code 2), before any
process group exists; the generated runtime action lists are valid 1F1B / interleaved schedules."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from bagualu2.costmodel import ParallelConfig, schedule
from reference_trainer.pipeline import runtime_actions
from reference_trainer.recipes import RECIPES, TrainConfig, default_cap, minimum_cap, parse_bytes, recipe
from reference_trainer.train import main, parse_args


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps"),
    (["--seed", "-1"], "--seed"),
    (["--lr", "inf"], "--lr"),
    (["--schedule", "fast"], "argument --schedule"),
    (["--recipe", "nope"], "--recipe must be one of glm_moe_debug"),
    (["--pp", "3"], "divisible by --pp x --vp"),
    (["--vp", "3", "--pp", "1"], "divisible by --pp x --vp"),
    (["--ep", "3"], "--ep=3 must divide --dp=2"),
    (["--memory-cap", "lots"], "--memory-cap must be a byte count"),
    (["--memory-cap=-5MiB"], "--memory-cap must be a byte count"),
    (["--memory-cap", "1.5"], "--memory-cap must be a whole number of bytes"),
    (["--policy", "kwai", "--prediction-scale", "0.6"], "--prediction-scale applies to --policy flexible only"),
    (["--spike-rate", "0.1", "--spike-max", "0.5"], "--spike-max"),
    (["--spike-rate", "0.1", "--ep", "1"], "--spike-rate 0.1 needs --ep >= 2"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--pp", "1", "--dp", "1", "--ep", "1"], None),  # fine: the world size check follows (WORLD_SIZE unset)
    (["--num-microbatches", "1"], "--num-microbatches=1 must be >= --pp=2"),
    (["--vp", "2", "--num-microbatches", "2"], "needs --num-microbatches > --pp=2"),
    (["--paired", "--schedule", "plain"], "--paired needs --schedule runtime"),
    (["--paired", "--ep", "1"], "--paired needs --ep >= 2"),
    (["--steps", "1_0"], "--steps must be an integer >= 1, got '1_0'"),
    (["--steps", "abc"], "--steps must be an integer >= 1, got 'abc'"),
    (["--pp", "\u0662"], "--pp must be an integer >= 1, got '\u0662'"),
    (["--lr", "1_0e-3"], "--lr must be a finite number in (0, 10000], got '1_0e-3'"),
    (["--collective-timeout", "soon"], "--collective-timeout must be a finite number in [0.1, 1e+07], got 'soon'"),
    (["--memory-cap", "-5MiB"], "--memory-cap needs a value (a value that starts with '-' is given as "
                                "--memory-cap=VALUE)"),
])
def test_bad_flags_fail_in_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    if message is None:
        config, _ = parse_args(argv)
        assert config.world_size == 1
        return
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--steps", "1"] if "--steps" not in argv else argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_world_size_and_data_errors_before_any_collective(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit):
        main(["--steps", "1"])
    assert "world size 3 must equal --pp x --dp = 2 x 2" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit):
        main(["--steps", "1", "--pp", "1", "--dp", "1", "--ep", "1", "--data", str(tmp_path / "missing.txt")])
    assert str(tmp_path / "missing.txt") in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--steps", "1", "--pp", "1", "--dp", "1", "--ep", "1", "--memory-cap", "1KiB"])
    assert "--memory-cap must be at least" in capsys.readouterr().err


def test_other_ranks_exit_quietly(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(SystemExit) as exit_info:
        main(["--steps", "0"])
    assert exit_info.value.code == 2 and capsys.readouterr().err == ""


@pytest.mark.parametrize("text, value", [("48MiB", 48 << 20), ("1.5GiB", 3 << 29), ("500000", 500000),
                                         ("2 kb", 2000), ("1e6", 10**6), ("0.1KiB", 102), ("1.5e3", 1500)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipes_are_valid_and_their_default_cap_runs(name):
    config = recipe(name)
    assert isinstance(config, TrainConfig)
    assert minimum_cap(config) <= default_cap(config)
    with pytest.raises(ValueError, match="--lr"):
        config.with_overrides(lr=-1.0)


def test_memory_cap_imbalance_is_validated_and_a_fraction_flag_replaces_it():
    with pytest.raises(ValueError, match="--memory-cap-imbalance"):
        recipe("glm_moe_bench").with_overrides(memory_cap_imbalance=0.5)
    bench = recipe("glm_moe_bench")
    config, _ = parse_args(["--recipe", "glm_moe_bench", "--memory-cap-fraction", "0.5"])
    assert config.memory_cap_imbalance is None and default_cap(config) < default_cap(bench)
    config, _ = parse_args(["--recipe", "glm_moe_bench", "--memory-cap-imbalance", "2"])
    assert config.memory_cap_imbalance == 2.0 and default_cap(config) > default_cap(bench)


def test_paired_defaults_to_combined_1f1b_without_a_pipeline_and_is_opt_in_with_one():
    """Unset, ``paired`` is on for the runtime schedule at pp = 1 under EP only; ``--paired`` turns it on at any
    pp (the cost model then counts one more chunk in flight), ``--no-paired`` off."""
    debug = recipe("glm_moe_debug")
    assert debug.paired is None and not debug.combined_1f1b and not debug.parallel.paired
    flat = debug.with_overrides(pp=1)
    assert flat.combined_1f1b and flat.with_overrides(schedule="plain").combined_1f1b is False
    assert not flat.with_overrides(ep=1, dp=1).combined_1f1b
    config, _ = parse_args(["--paired"])
    assert config.paired is True and config.parallel.paired and default_cap(config) > default_cap(debug)
    config, _ = parse_args(["--pp", "1", "--no-paired"])
    assert config.paired is False and not config.combined_1f1b
    with pytest.raises(ValueError, match="--paired must be true, false or unset"):
        debug.with_overrides(paired=1)


@given(pp=st.integers(1, 4), vp=st.integers(1, 3), rounds=st.integers(1, 3))
def test_runtime_actions_run_every_forward_and_backward_once_in_the_cost_model_order(pp, vp, rounds):
    m, vp = pp * rounds, vp if pp > 1 else 1
    parallel = ParallelConfig(pp=pp, vp=vp, num_microbatches=m)
    orders = runtime_actions(parallel)
    for rank, actions in orders.items():
        flat = []
        for action in actions:
            if action.sub_actions is not None:
                f, b = action.sub_actions
                assert f.microbatch_index != b.microbatch_index  # a fused pair never waits on itself
                flat += [f, b]
            else:
                flat.append(action)
        expected = [(s.kind, s.microbatch, s.chunk * pp + rank) for s in schedule(parallel, rank)]
        got = [(a.computation_type.value.replace("FULL_BACKWARD", "B").replace("FORWARD", "F")[:1],
                a.microbatch_index, a.stage_index) for a in flat]
        assert got == expected
    if vp == 1 or m > pp:  # torch lowers it (sends and receives): the runtime schedule can run it
        from torch.distributed.pipelining import schedules as S

        S._add_send_recv(orders, stage_to_rank=lambda s: s % pp, num_stages=pp * vp)


def test_a_layout_whose_experts_bound_the_imbalance_below_ep_plans_and_caps_within_it():
    """8 experts, top-4 at ep 4: one rank receives at most 2x the mean, not 4x. The flexible provisioner warms its
    graphs up to that limit (it built graphs up to ep, which the builder refuses) and a cap imbalance above it is
    clamped to it."""
    from bagualu2.costmodel import imbalance_limit, presets
    from reference_trainer.provision import Provisioner

    config = recipe("glm_moe_bench").with_overrides(pp=1, dp=4, ep=4)
    assert imbalance_limit(config.model, config.parallel) == 2.0
    provisioner = Provisioner(config.model, config.parallel, presets.hardware(config.hardware), stage=0,
                              cap_bytes=default_cap(config))
    assert provisioner.engine.max_imbalance == 2.0
    assert default_cap(config.with_overrides(memory_cap_imbalance=3.0)) == default_cap(
        config.with_overrides(memory_cap_imbalance=2.0))
