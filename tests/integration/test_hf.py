"""Stock transformers MoE models (tiny random configs with their defaults, ``use_cache`` included; FP32, CPU;
every family of ``tests/hf_models.py``) instrumented by ``bagualu2.integrations.hf``: greedy plans from the floor to the unmitigated bytes keep exactly
``evaluate(traced graph, plan)`` and give the plain run's loss and gradients bitwise (replays verified); random
per-tensor plans likewise; a hand-written op map on a model with a KV cache is refused, never silently wrong."""

from __future__ import annotations

import functools
import importlib
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bagualu2.costmodel import Plan, Strategy, evaluate, presets  # noqa: E402
from bagualu2.exec import apply_plan  # noqa: E402
from bagualu2.exec import instrument as instrument_ops  # noqa: E402
from bagualu2.integrations import hf  # noqa: E402
from bagualu2.mitigation import greedy  # noqa: E402
from hf_models import FAMILIES, run_plan, tiny  # noqa: E402

pytest.importorskip("transformers")
HW = presets.hardware("cpu")
NAMED = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")  # attention projections checked too
NESTED_NORMS = ("qwen4_exp_text",)  # its layer norms sit inside its gated residuals: part of no op of their own
QUANTIZE_LOSS_RTOL = 0.02   # FP8 (e4m3) copies of the saved activations: relative error of the loss
QUANTIZE_GRAD_COS = 0.98    # and cosine similarity of the whole gradient with the plain run's


@functools.lru_cache(maxsize=None)
def traced(family: str):
    torch.set_num_threads(1)
    model, ids = tiny(family)
    instrumented = hf.instrument(model)
    graph = instrumented.trace_graph(input_ids=ids, labels=ids, hardware=HW, loss=lambda out: out.loss)
    return model, ids, instrumented, graph, run_plan(model, ids, instrumented, None)


def check(family: str, plan: Plan, *, exact: bool = True) -> None:
    model, ids, instrumented, graph, (loss0, grads0, _, _) = traced(family)
    loss, grads, device_bytes, host_bytes = run_plan(model, ids, instrumented, plan)
    cost = evaluate(graph, plan)
    assert (device_bytes, host_bytes) == (cost.activation_bytes, cost.host_bytes), plan
    if exact:
        assert torch.equal(loss, loss0) and all(torch.equal(a, b) for a, b in zip(grads, grads0)), plan
    else:
        assert abs(float(loss - loss0)) <= QUANTIZE_LOSS_RTOL * abs(float(loss0))
        flat, flat0 = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in grads0])
        assert torch.nn.functional.cosine_similarity(flat, flat0, dim=0) >= QUANTIZE_GRAD_COS


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_plans_keep_their_bytes_and_the_gradients_bitwise(family):
    _, _, instrumented, graph, (_, _, plain_bytes, _) = traced(family)
    assert plain_bytes == graph.unmitigated_bytes == instrumented.trace.saved_bytes
    kinds = {op.kind for op in graph.ops}
    required = {"norm", "core_attn", "router", "dispatch", "expert_fc1", "expert_act", "expert_fc2"}
    if family in NESTED_NORMS:
        required.discard("norm")
    assert required <= kinds, kinds
    if family in NAMED:
        assert {"qkv", "attn_out"} <= kinds, kinds
    for step in range(4):
        budget = graph.floor_bytes + (graph.unmitigated_bytes - graph.floor_bytes) * step // 3
        solution = greedy.solve(graph, budget)
        assert solution.ok and solution.cost.activation_bytes <= budget
        exact = not any(strategy is Strategy.QUANTIZE for _, strategy in solution.plan.entries)
        check(family, solution.plan, exact=exact)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "deepseek_v32"])  # v3.2 saves -inf attention masks
def test_quantized_activations_stay_within_the_stated_tolerance(family):
    graph = traced(family)[3]
    entries = [(f"{op.name}/{s.tensor}", Strategy.QUANTIZE) for op, s in graph.savings
               if (op.name, s.tensor) not in graph.pinned and graph.quantizable(s)]
    assert entries
    check(family, Plan(tuple(entries)), exact=False)


def test_a_cache_updating_attention_under_a_hand_written_op_map_is_refused():
    model, ids = tiny("mixtral")
    assert model.config.use_cache  # the default: every attention updates the KV cache
    instrumented = instrument_ops(model, {"model.layers.*.self_attn": "core_attn", "model.layers.*.mlp": "moe"})
    graph = instrumented.trace_graph(input_ids=ids, labels=ids, hardware=HW, loss=lambda out: out.loss)
    attention = next(op for op in graph.ops if op.kind == "core_attn")
    plan = Plan(tuple((f"{attention.name}/{s.tensor}", Strategy.RECOMPUTE) for s in attention.saves
                      if s.tensor.startswith(f"{attention.name}.")))  # what the attention made: it is never re-run
    assert plan.entries
    with pytest.raises(ValueError, match="DynamicCache"):
        apply_plan(instrumented, plan)
    hf_model = hf.instrument(tiny("mixtral")[0])  # the integration turns the cache off: the same plan is exact
    assert not hf_model.model.config.use_cache
    # traced without a cache, run with one: the re-run is refused when the forward meets it, not silently wrong
    model, ids, instrumented, graph, _ = traced("mixtral")
    attention = next(op for op in graph.ops if op.kind == "core_attn")
    executor = apply_plan(instrumented, ",".join(f"{attention.name}/{s.tensor}=RECOMPUTE" for s in attention.saves
                                                 if graph.tensors[s.tensor].producer == attention.name))
    with pytest.raises(ValueError, match="takes a DynamicCache object"):
        with executor.micro_batch("cached"):
            model(input_ids=ids, labels=ids, use_cache=True)


def test_op_map_names_the_unsupported_class():
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM has no routed-experts module .*\(its layers are all "
                                         r"dense\); supported: the \d+ families of hf.SUPPORTED_FAMILIES \(mixtral, "):
        hf.op_map(dense)
    with pytest.raises(ValueError, match="torch.nn.Module"):
        hf.op_map("mixtral")
    nested, _ = tiny("mixtral")  # experts one level deeper than a MoE block's child (modality-split MoE blocks)
    for layer in nested.model.layers:
        inner = torch.nn.Module()
        inner.experts = layer.mlp.experts
        del layer.mlp.experts
        layer.mlp.text = inner
    with pytest.raises(ValueError, match=r"keeps its routed experts at model\.layers\.0\.mlp\.text\.experts and 1 "
                                         "more, deeper than op_map reads them"):
        hf.op_map(nested)
    with pytest.raises(ValueError, match="gate must be True or False"):
        hf.instrument(dense, gate="yes")
    with pytest.raises(ValueError, match="model must be a torch.nn.Module"):
        hf.instrument("mixtral")


def test_a_model_under_transformers_activation_checkpointing_is_refused():
    model, ids = tiny("mixtral")
    model.activation_checkpointing_enable()
    with pytest.raises(ValueError, match="activation checkpointing on.*activation_checkpointing_disable"):
        hf.instrument(model)
    model.activation_checkpointing_disable()
    instrumented = hf.instrument(model)
    instrumented.trace_graph(input_ids=ids, labels=ids, hardware=HW, loss=lambda out: out.loss)
    model.activation_checkpointing_enable()  # after instrument: a plan would silently name nothing
    with pytest.raises(ValueError, match="activation checkpointing is on"):
        instrumented.trace_graph(input_ids=ids, labels=ids, hardware=HW, loss=lambda out: out.loss)
    executor = apply_plan(instrumented, "expert_act=RECOMPUTE")
    with pytest.raises(ValueError, match="activation checkpointing is on"):
        with executor.micro_batch("mb"):
            pass
    model.activation_checkpointing_disable()
    instrumented.remove()
    wrapper = torch.nn.ModuleDict({"lm": model})  # a model inside another: its layers' flags are read too
    inner = instrument_ops(wrapper, {"lm.model.layers.*.input_layernorm": "norm1"})
    model.activation_checkpointing_enable()
    with pytest.raises(ValueError, match="activation checkpointing is on"):
        inner.trace_graph(input_ids=ids, hardware=HW, loss=lambda out: out.logits.sum())


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v3"])
@pytest.mark.parametrize("autocast", [False, True])
def test_the_instrumented_model_computes_as_transformers_grouped_mm_does(family, autocast):
    """Against transformers' own experts implementation, bitwise: also under bf16 autocast with fp32 weights, where
    ``grouped_mm`` (not autocast-enabled) multiplies in the weight's dtype."""
    model, ids = tiny(family)

    def step(instrumented=None):
        torch.manual_seed(0)
        model.zero_grad(set_to_none=True)
        executor = apply_plan(instrumented, None) if instrumented is not None else None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if executor is None:
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            else:
                with executor.micro_batch("mb"):
                    loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if executor is not None:
            executor.release("mb")
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    loss0, grads0 = step()
    instrumented = hf.instrument(model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        instrumented.trace_graph(input_ids=ids, labels=ids, hardware=HW, loss=lambda out: out.loss)
    loss, grads = step(instrumented)
    instrumented.remove()
    assert torch.equal(loss, loss0) and len(grads) == len(grads0)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads0))


def test_a_loss_of_its_own_traced_with_the_model_keeps_the_predicted_bytes():
    """A z-loss computed on the logits inside the micro-batch saves tensors of its own: traced with ``loss=``, they
    are in the graph (outside every op), so the micro-batch keeps exactly the prediction and does not warn."""
    model, ids = tiny("mixtral")

    def z_loss(out):
        logits = out.logits.float()
        cross_entropy = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        return cross_entropy + 1e-2 * logits.logsumexp(-1).pow(2).mean()

    instrumented = hf.instrument(model)
    graph = instrumented.trace_graph(input_ids=ids, hardware=HW, loss=z_loss)
    plan = greedy.solve(graph, graph.floor_bytes).plan
    executor = apply_plan(instrumented, plan, verify=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with executor.micro_batch("mb") as record:
            loss = z_loss(model(input_ids=ids))
    loss.backward()
    executor.release("mb")
    instrumented.remove()
    assert record.device_bytes == evaluate(graph, plan).activation_bytes


def test_without_a_loss_the_trace_differentiates_every_tensor_a_model_output_holds():
    """A transformers model returns a ``ModelOutput`` (a dict): the default loss sums its tensors (logits, the loss
    given labels), so ``trace_graph`` needs no ``loss=``, and the ops are those a loss on the logits traces."""
    model, ids = tiny("mixtral")
    instrumented = hf.instrument(model)
    default = instrumented.trace_graph(input_ids=ids, labels=ids, hardware=HW)
    on_logits = instrumented.trace_graph(input_ids=ids, hardware=HW, loss=lambda out: out.logits.float().sum())
    instrumented.remove()
    assert [op.name for op in default.ops] == [op.name for op in on_logits.ops]
    assert default.floor_bytes > 0


def test_a_budget_below_the_floor_gets_a_floor_plan_that_runs(family="mixtral"):
    """Below M0 the solvers return the floor plan (a value, not an exception): on a traced graph the tensors made
    outside every op cannot be recomputed, so it offloads those, and the micro-batch keeps M0 exactly."""
    from bagualu2.mitigation import check_conflicts, floor_plan

    model, ids = tiny(family)
    instrumented = hf.instrument(model)
    graph = instrumented.trace_graph(input_ids=ids, labels=ids, hardware=HW, loss=lambda out: out.loss)
    low = greedy.solve(graph, graph.floor_bytes - 1)
    assert low.status.value == "INFEASIBLE" and low.plan == floor_plan(graph)
    assert not check_conflicts(graph, low.plan) and low.cost.activation_bytes == graph.floor_bytes
    assert Strategy.OFFLOAD in {strategy for _, strategy in low.plan.entries}
    executor = apply_plan(instrumented, low.plan, verify=True)
    with executor.micro_batch("mb") as record:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    executor.release("mb")
    instrumented.remove()
    assert record.device_bytes == graph.floor_bytes


def test_remove_puts_the_model_back_and_a_refused_instrument_changes_nothing():
    model, ids = tiny("qwen3_moe")
    experts = model.model.layers[0].mlp.experts

    def state():
        return (model.config.use_cache, model.config._experts_implementation,
                [name for name, _ in experts.named_children()], sorted(vars(experts)))

    before = state()
    with torch.no_grad():
        plain = model(input_ids=ids)
    assert type(plain.past_key_values).__name__ == "DynamicCache"
    layer = model.model.layers[0]
    for part in (layer, layer.mlp, layer.mlp.experts):  # refused after the experts implementation was installed
        with pytest.raises(ValueError, match=f"^{type(part).__name__} holds routed experts but no decoder layers .*"
                                             "instrument the whole transformers model"):
            hf.instrument(part)
    assert state() == before
    instrumented = hf.instrument(model)
    assert state() != before  # the cache off, the experts split
    instrumented.remove()
    assert state() == before
    with torch.no_grad():
        again = model(input_ids=ids)
    assert torch.equal(again.logits, plain.logits) and type(again.past_key_values) is type(plain.past_key_values)
    hf.instrument(model).remove()  # instrumented again after remove
    assert state() == before



def test_a_copy_of_an_instrumented_model_runs_unhooked_and_is_refused_by_instrument():
    """``copy.deepcopy`` of an instrumented model (a teacher, an EMA) copies its hooks, which no ``remove()`` takes
    off the copy: the copy runs as a plain model, inside the original's micro-batch too (the step stays bitwise),
    and instrumenting it is refused in one line."""
    import copy

    model, ids = tiny("mixtral")
    instrumented = hf.instrument(model)
    graph = instrumented.trace_graph(input_ids=ids, labels=ids, hardware=HW, loss=lambda out: out.loss)
    plan = greedy.solve(graph, graph.floor_bytes).plan  # re-runs most ops
    assert Strategy.RECOMPUTE in {strategy for _, strategy in plan.entries}
    loss0, grads0, _, _ = run_plan(model, ids, instrumented, None)
    teacher = copy.deepcopy(model)
    with torch.no_grad():
        alone = teacher(input_ids=ids).logits
    torch.manual_seed(0)
    executor = apply_plan(instrumented, plan, verify=True)
    model.zero_grad(set_to_none=True)
    with executor.micro_batch("kd") as record:
        out = model(input_ids=ids, labels=ids)
        with torch.no_grad():
            inside = teacher(input_ids=ids).logits
    out.loss.backward()
    executor.release("kd")
    assert record.device_bytes == evaluate(graph, plan).activation_bytes and torch.equal(inside, alone)
    assert torch.equal(out.loss.detach(), loss0)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads0) if p.grad is not None)
    with pytest.raises(ValueError, match="^module 'model.layers.0.self_attn' carries the op hooks of another "
                                         "instrumented model .* copy the model before instrument\\(\\) or after "
                                         "remove\\(\\)$"):
        hf.instrument(teacher)


def test_remove_while_a_micro_batch_awaits_its_backward_names_it_when_the_backward_re_runs():
    model, ids = tiny("mixtral")
    instrumented = hf.instrument(model)
    graph = instrumented.trace_graph(input_ids=ids, labels=ids, hardware=HW, loss=lambda out: out.loss)
    plan = greedy.solve(graph, graph.floor_bytes).plan  # re-runs most ops
    assert Strategy.RECOMPUTE in {strategy for _, strategy in plan.entries}
    executor = apply_plan(instrumented, plan)
    with executor.micro_batch("mb"):
        loss = model(input_ids=ids, labels=ids).loss
    instrumented.remove()
    with pytest.raises(RuntimeError, match=r"^cannot re-run \S+ for its backward: InstrumentedModel.remove\(\) "
                                           "took the hooks off while its micro-batch awaited the backward"):
        loss.backward()

def test_models_that_share_a_config_keep_their_own_instrumentation():
    """Two models from one config object (a teacher beside a student): the one not instrumented runs as it did,
    and taking one model's instrumentation off leaves the other's in force, its plan exact, until the last is off."""
    from transformers import AutoModelForCausalLM

    student, ids = tiny("mixtral")
    config = student.config
    teacher = AutoModelForCausalLM.from_config(config).float().train()
    assert teacher.config is config
    with torch.no_grad():
        plain = teacher(input_ids=ids).logits
    first = hf.instrument(student)
    with torch.no_grad():
        assert torch.equal(teacher(input_ids=ids).logits, plain)  # the teacher's experts are not split
    second = hf.instrument(teacher)
    graph = second.trace_graph(input_ids=ids, labels=ids, hardware=HW, loss=lambda out: out.loss)
    plan = Plan(tuple((f"{op}/{tensor}", Strategy.OFFLOAD) for op, tensor in graph.decisions
                      if (op, tensor) not in graph.pinned))
    first.remove()
    assert config.use_cache is False  # the teacher still holds the cache off
    executor = apply_plan(second, plan, verify=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with executor.micro_batch("teacher") as record:
            loss = teacher(input_ids=ids, labels=ids).loss
        loss.backward()
        executor.release("teacher")
    assert record.device_bytes == evaluate(graph, plan).activation_bytes
    second.remove()
    assert config.use_cache is True and config._experts_implementation != "bagualu2"
    with torch.no_grad():
        assert torch.equal(teacher(input_ids=ids).logits, plain)


def test_savings_outside_the_modules_beyond_the_traced_ones_warn():
    """Traced with transformers' loss, trained with another one (or the instrumented module called inside a
    model around it): what the micro-batch saves outside every mapped module exceeds the trace's, kept beyond the
    plan's bytes, and it says so once."""
    from bagualu2.exec import UntracedSavingsWarning

    model, ids = tiny("mixtral")
    instrumented = hf.instrument(model)
    graph = instrumented.trace_graph(input_ids=ids, labels=ids, hardware=HW, loss=lambda out: out.loss)
    plan = greedy.solve(graph, graph.floor_bytes).plan
    executor = apply_plan(instrumented, plan, verify=True)
    outside = "keeps [0-9,]+ B saved outside every mapped module, its traced forward [0-9,]+ B"
    with pytest.warns(UntracedSavingsWarning, match=outside):
        with executor.micro_batch("z-loss") as record:
            logits = model(input_ids=ids).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            loss = loss + 1e-2 * logits.logsumexp(-1).pow(2).mean()
    loss.backward()
    executor.release("z-loss")
    assert record.device_bytes > evaluate(graph, plan).activation_bytes


def test_a_batch_that_saves_what_the_trace_did_not_warns():
    """A padded attention mask on a model traced without one takes another attention path, saving tensors no plan
    names: they are kept beyond the plan's bytes, and the micro-batch says so."""
    from bagualu2.exec import UntracedSavingsWarning

    model, ids = tiny("mixtral")
    instrumented = hf.instrument(model)
    graph = instrumented.trace_graph(input_ids=ids, labels=ids, hardware=HW, loss=lambda out: out.loss)
    plan = greedy.solve(graph, graph.floor_bytes).plan
    executor = apply_plan(instrumented, plan, verify=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with executor.micro_batch("traced") as record:  # as traced: nothing unnamed, no warning
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        executor.release("traced")
    assert record.device_bytes == evaluate(graph, plan).activation_bytes
    mask = torch.ones_like(ids)
    mask[-1, :2] = 0
    untraced = "keeps savings its traced forward did not make .L0.core_attn [0-9,]+ B"
    with pytest.warns(UntracedSavingsWarning, match=untraced):
        with executor.micro_batch("padded") as record:
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    executor.release("padded")
    assert record.unknown_bytes > 0
    with warnings.catch_warnings():  # said once per trace: a second such micro-batch is quiet
        warnings.simplefilter("error")
        with executor.micro_batch("padded again"):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        executor.release("padded again")


def test_a_batch_routed_otherwise_than_the_traced_one_keeps_the_predicted_bytes():
    """Experts the traced batch left empty run on their empty rows too, so every batch of the traced shape saves
    the same tensors in the same order: offloaded, nothing of theirs stays on the device."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                           num_experts_per_tok=2)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).float().train()
    instrumented = hf.instrument(model)
    same = torch.tensor([[5, 5, 5, 5]])  # one token four times: two of the four experts get every route
    graph = instrumented.trace_graph(input_ids=same, labels=same, hardware=HW, loss=lambda out: out.loss)
    plan = Plan(tuple((f"{op}/{tensor}", Strategy.OFFLOAD) for op, tensor in graph.decisions
                      if (op, tensor) not in set(graph.pinned)))
    cost = evaluate(graph, plan)
    for ids in (same, torch.tensor([[5, 17, 60, 99]]), torch.tensor([[99, 60, 17, 5]])):
        executor = apply_plan(instrumented, plan, verify=True)
        with executor.micro_batch("mb") as record:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        executor.release("mb")
        assert (record.device_bytes, record.host_bytes) == (cost.activation_bytes, cost.host_bytes)


def test_the_integration_imports_without_transformers(monkeypatch):
    for name in [n for n in sys.modules if n.startswith("bagualu2.integrations")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ModuleNotFoundError
    module = importlib.import_module("bagualu2.integrations.hf")
    with pytest.raises(ValueError, match=r"needs transformers: pip install 'bagualu2\[hf\]'"):
        module.instrument(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_routes_to_another_ranks_experts_are_skipped_or_refused_with_the_gate():
    """transformers' all-reduce expert parallelism hands every rank the routes to other ranks' experts as ids past
    its own (weight 0): the experts implementation skips them (the same output as routing them to a local expert
    with weight 0, up to the GEMMs' rounding), and, when the gate counts copies, refuses them while a micro-batch
    records (its count assumes each rank its own batch)."""
    from bagualu2.integrations.hf_experts import GATE_ATTRIBUTE, experts_forward

    model, ids = tiny("qwen3_moe")
    instrumented = hf.instrument(model, gate=False)
    instrumented.trace_graph(input_ids=ids, labels=ids, hardware=HW, loss=lambda out: out.loss)
    experts = model.model.layers[0].mlp.experts
    torch.manual_seed(0)
    hidden = torch.randn(6, 64)
    index = torch.tensor([[0, 4], [1, 0], [4, 4], [2, 3], [3, 4], [1, 2]])  # 4: another rank's expert
    weights = torch.rand(6, 2) * (index < 4)
    experts._is_expert_parallel = True
    try:
        skipped = experts_forward(experts, hidden, index, weights)
        local = experts_forward(experts, hidden, index.clamp(max=3), weights)
        torch.testing.assert_close(skipped, local)  # the same sums; the GEMMs run on other row sets
        setattr(experts, GATE_ATTRIBUTE, True)
        torch.testing.assert_close(experts_forward(experts, hidden, index, weights), local)  # nothing records
        executor = apply_plan(instrumented, None)
        with pytest.raises(ValueError, match="all-reduce expert parallelism.*gate=False"):
            with executor.micro_batch("mb"):
                experts_forward(experts, hidden, index, weights)
    finally:
        experts._is_expert_parallel = False
    with pytest.raises(ValueError, match="identity or skip experts"):
        experts_forward(experts, hidden, index, weights)


@pytest.mark.slow
@pytest.mark.parametrize("family, field", [("mixtral", "router_jitter_noise"), ("phimoe", "input_jitter_noise")])
def test_a_tensor_changed_in_place_after_its_op_is_never_recomputed(family, field):
    """Router jitter (``hidden *= noise`` inside the MoE block) changes the norm's output in place after the norm
    made it: re-running the norm would remake it without the noise, so the trace leaves it no producer (kept,
    offloaded or quantised only) and every plan gives the plain run's gradients bitwise."""
    from transformers import AutoModelForCausalLM

    from hf_models import tiny_config

    torch.set_num_threads(1)
    config = tiny_config(family)
    setattr(config, field, 0.1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().train()
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    instrumented = hf.instrument(model)
    graph = instrumented.trace_graph(input_ids=ids, labels=ids, hardware=HW, loss=lambda out: out.loss)
    noised = {t for op in graph.ops if op.kind == "router" for t in op.inputs}
    assert noised and all(graph.tensors[t].producer is None for t in noised)  # no re-run may remake them
    loss0, grads0, _, _ = run_plan(model, ids, instrumented, None)
    for step in range(4):
        budget = graph.floor_bytes + (graph.unmitigated_bytes - graph.floor_bytes) * step // 3
        plan = Plan(tuple(e for e in greedy.solve(graph, budget).plan.entries if e[1] is not Strategy.QUANTIZE))
        loss, grads, device_bytes, host_bytes = run_plan(model, ids, instrumented, plan)
        cost = evaluate(graph, plan)
        assert (device_bytes, host_bytes) == (cost.activation_bytes, cost.host_bytes), plan
        assert torch.equal(loss, loss0) and all(torch.equal(a, b) for a, b in zip(grads, grads0)), plan


@pytest.mark.parametrize("family", ["olmoe", "phimoe"])
def test_graded_gate_replans_on_a_graph_without_fp8_keep_the_predicted_bytes_and_the_gradients_bitwise(family):
    """A plan in force that overruns its budget, re-planned at every gate on the traced graph without FP8 storage
    (``quantize=False``: the re-plan otherwise may quantise, olmoe's did): the bytes kept are ``evaluate``'s of the
    final plan, within budget, and the gradients the plain run's bit for bit. phimoe's router draws random numbers
    (its jitter), so it is never re-run and the gate leaves what it saved as the plan in force said (it re-planned
    the router's saving, which exec had stored already: 8,192 bytes more than predicted, over budget)."""
    import dataclasses

    from bagualu2.exec import DeferredPlanner

    model, ids, instrumented, graph, (loss0, grads0, _, _) = traced(family)
    budget = graph.floor_bytes + (graph.unmitigated_bytes - graph.floor_bytes) // 2
    planner = DeferredPlanner.for_graph(dataclasses.replace(graph, quantize=False), budget_bytes=budget)
    torch.manual_seed(0)
    executor = apply_plan(instrumented, Plan(), deferred=planner, verify=True)
    model.zero_grad(set_to_none=True)
    with executor.micro_batch("mb") as record:
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    executor.release("mb")
    cost = evaluate(graph, record.plan)
    assert record.downgraded and Strategy.QUANTIZE not in {strategy for _, strategy in record.plan.entries}
    assert (record.device_bytes, record.host_bytes) == (cost.activation_bytes, cost.host_bytes)
    assert record.device_bytes <= budget
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    assert torch.equal(out.loss.detach(), loss0) and all(torch.equal(a, b) for a, b in zip(grads, grads0))


def test_the_same_tokens_in_another_shape_warn_that_the_bytes_are_not_the_plans():
    """4 x 8 tokens after a trace on 2 x 16: only the savings that follow the sequence length (the rotary tables)
    change size, too few to refuse the micro-batch as another shape is; it warns instead, once per trace."""
    model, ids = tiny("olmoe")
    instrumented = hf.instrument(model)
    instrumented.trace_graph(input_ids=ids, labels=ids, hardware=HW, loss=lambda out: out.loss)
    executor = apply_plan(instrumented, None)
    reshaped = ids.reshape(2 * ids.shape[0], ids.shape[1] // 2)
    for name in ("first", "second"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with executor.micro_batch(name) as record:
                loss = model(input_ids=reshaped, labels=reshaped).loss
        loss.backward()
        sizes = [str(w.message) for w in caught if "sizes than traced" in str(w.message)]
        assert record.slot_size_misses and 2 * len(record.slot_size_misses) <= record.slot_fixed
        assert len(sizes) == (name == "first") and all("another batch size and sequence length" in m for m in sizes)
        executor.release(name)
