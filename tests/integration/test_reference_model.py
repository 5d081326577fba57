"""Reference GLM-MoE model: custom autograd functions, measured vs predicted activation bytes, the measure CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from forkrun import forked

from bagualu2.costmodel import ParallelConfig, build_graph, evaluate, presets
from bagualu2.exec import ActivationTracker, apply_plan
from bagualu2.runtime import downgrade_plan
from reference_trainer.experiments.measure import main as measure_main
from reference_trainer.experiments.measure import measure
from reference_trainer.instrumented import instrument_reference
from reference_trainer.routing import bias_router_towards, record_routing, routing_stats
from reference_trainer.functions import (PermuteFunction, RMSNormFunction, RouterFunction, SwiGLUFunction,
                                         UnpermuteFunction)
from reference_trainer.model import GLMMoEModel, RoPE

ROOT = Path(__file__).resolve().parents[2]
f64 = torch.float64


def _r(*shape, grad=True):
    return torch.randn(*shape, dtype=f64, requires_grad=grad)


# ---- gradients of the custom functions ------------------------------------------------------------------------
def test_gradcheck_rmsnorm():
    torch.manual_seed(0)
    assert torch.autograd.gradcheck(lambda x, w: RMSNormFunction.apply(x, w, 1e-6), (_r(2, 3, 8), _r(8)))


@pytest.mark.slow
def test_gradcheck_rope():
    """Stock autograd (no custom function: it keeps only the cos/sin constants)."""
    torch.manual_seed(0)
    s, d = 5, 8
    angles = torch.arange(s, dtype=f64)[:, None] * torch.rand(d // 2, dtype=f64)[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    assert torch.autograd.gradcheck(lambda q, k: RoPE()(q, k, cos, sin), (_r(2, s, 4, d), _r(2, s, 2, d)))


def test_gradcheck_swiglu():
    torch.manual_seed(0)
    assert torch.autograd.gradcheck(SwiGLUFunction.apply, (_r(6, 10),))


def test_gradcheck_router():
    torch.manual_seed(0)
    bias = torch.randn(6, dtype=f64) * 0.1
    fn = lambda x, w: RouterFunction.apply(x, w, bias, 2)[0]  # noqa: E731
    assert torch.autograd.gradcheck(fn, (_r(7, 5), _r(6, 5)))


def test_gradcheck_permute_unpermute():
    torch.manual_seed(0)
    T, K, E, h = 6, 2, 4, 3
    routing = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(torch.int32)
    assert torch.autograd.gradcheck(lambda x: PermuteFunction.apply(x, routing), (_r(T, h),))
    probs = torch.rand(T, K, dtype=f64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda c, p: UnpermuteFunction.apply(c, p, routing), (_r(T * K, h), probs))
    # permute then unpermute with weights 1 sums each token's K copies
    x = torch.randn(T, h, dtype=f64)
    out = UnpermuteFunction.apply(PermuteFunction.apply(x, routing), torch.ones(T, K, dtype=f64), routing)
    torch.testing.assert_close(out, K * x)


# ---- predicted vs measured activation bytes -------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
@pytest.mark.parametrize("seq_length", [32, 64])
def test_measured_matches_cost_model(preset, seq_length):
    record = measure(preset, seq_length=seq_length)
    assert record["layers"] == [0, 1, 2, 3]
    assert abs(record["rel_error"]) <= 0.01, record
    assert record["measured_bytes"] == record["predicted_bytes"]  # exact today; keep it that way


def test_routed_tokens_are_t_times_k():
    config, _ = presets.model("tiny-moe")
    config = config.replace(seq_length=32)
    torch.manual_seed(1)
    model = GLMMoEModel(config)
    record_routing(model)
    x = torch.randn(config.micro_batch_size, config.seq_length, config.hidden_size, requires_grad=True)
    model.forward_layers(x)
    T = config.micro_batch_size * config.seq_length
    graph = build_graph(config, ParallelConfig(), presets.hardware("cpu"))
    for layer in model.layers:
        if layer.is_moe:
            counts = routing_stats(layer.mlp).received
            assert int(counts.sum()) == T * config.top_k
            assert graph.tensors[f"L{layer.index}.dispatched"].numel == T * config.top_k * config.hidden_size


def test_tracker_excludes_parameters_and_sees_block_input():
    config, _ = presets.model("tiny-dense")
    config = config.replace(num_layers=1, seq_length=16)
    model = GLMMoEModel(config)
    x = torch.randn(2, 16, config.hidden_size, requires_grad=True)
    tracker = ActivationTracker(exclude=[model])
    with tracker.micro_batch("a"):
        model.forward_layers(x)
    predicted = evaluate(build_graph(config, ParallelConfig(), presets.hardware("cpu"))).activation_bytes
    assert tracker.kept_bytes("a") == predicted


# ---- training step --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_backward_gives_finite_gradients(preset):
    config, _ = presets.model(preset)
    config = config.replace(seq_length=32)
    torch.manual_seed(0)
    model = GLMMoEModel(config)
    tokens = torch.randint(0, config.vocab_size, (config.micro_batch_size, config.seq_length))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, config.vocab_size),
                                             tokens[:, 1:].reshape(-1))
    loss.backward()
    assert torch.isfinite(loss)
    for name, param in model.named_parameters():
        if param.grad is not None:
            assert torch.isfinite(param.grad).all(), name
    assert model.layers[0].attention.qkv.weight.grad.abs().sum() > 0
    if config.is_moe:
        moe = model.layers[-1].mlp
        assert moe.router.grad is not None and moe.router.grad.abs().sum() > 0
        assert moe.shared.fc1.weight.grad.abs().sum() > 0


# ---- the measure CLI ------------------------------------------------------------------------------------------
def _cli(*args):
    return forked("-m", "reference_trainer.experiments.measure", *args, cwd=ROOT, env=dict(os.environ), timeout=300)


@pytest.mark.launch
def test_cli_prints_json():
    proc = _cli("--preset", "tiny-moe", "--imbalance", "1", "--plan", "none", "--seq-length", "32", "--json")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    for key in ("predicted_bytes", "measured_bytes", "rel_error"):
        assert key in record
    assert abs(record["rel_error"]) <= 0.01


@pytest.mark.parametrize("args", [("--imbalance", "2"), ("--plan", "expert_act=SOMETIMES"),
                                  ("--imbalance", "0.5"), ("--preset", "nope"),
                                  ("--preset", "glm-188b-a20b"),  # far too large for this machine: refused
                                  ("--budget-bytes", "-1"), ("--dtype", "fp64")])
def test_cli_errors_are_one_line_exit_2(args, capsys):
    """In-process (``test_cli_prints_json`` runs the command as a process)."""
    base = {"--preset": "tiny-dense", "--imbalance": "1", "--plan": "none"}
    base[args[0]] = args[1]
    try:
        code = measure_main([item for pair in base.items() for item in pair] + ["--json"])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err


def test_routing_statistics_count_each_forward_once_whatever_the_plan_replays():
    """The statistics are recorded from outside (a hook on each dispatch): a plan that re-runs the MoE module's ops
    in backward does not count them again, and forced routing puts the picks where they were asked."""
    config = presets.model("tiny-moe")[0].replace(seq_length=32)
    torch.manual_seed(2)
    model = GLMMoEModel(config)
    instrument_reference(model)
    record_routing(model)
    graph = build_graph(config, ParallelConfig(), presets.hardware("cpu"))
    plan = downgrade_plan(graph)  # every MoE tensor made after the router re-run in backward
    executor = apply_plan(graph, plan, exclude=[model])
    x = torch.randn(config.micro_batch_size, config.seq_length, config.hidden_size, requires_grad=True)
    with executor.micro_batch("mb0") as record:
        out = model.forward_layers(x)
    out.pow(2).mean().backward()
    assert record.replays and any(replay.runs for replay in record.replays)
    for moe in model.moe_layers():
        stats = routing_stats(moe)
        assert torch.equal(stats.load, stats.last) and int(stats.last.sum()) == x.shape[0] * x.shape[1] * config.top_k
    bias_router_towards(model, 0, config.top_k)  # every pick on "rank 0": at EP=1, every expert
    with pytest.raises(ValueError, match="rank"):
        bias_router_towards(model, 1, 1)
    with pytest.raises(ValueError, match="not recorded"):
        routing_stats(GLMMoEModel(config).moe_layers()[0])
