"""What a plan may ask of a model instrumented from outside, checked before it runs (one ``ValueError`` each)."""

from __future__ import annotations

from bagualu2.costmodel.evaluate import evaluate, mitigation_ops, resolve
from bagualu2.costmodel.plan import Plan
from bagualu2.costmodel.strategy import Strategy

from .instrument import InstrumentedModel
from .record import MicroBatchRecord
from .recompute import Source


def check_replayable(instrumented: InstrumentedModel, plan: Plan | str | None) -> None:
    """``ValueError`` unless ``plan`` on the instrumented model's traced graph can run: every tensor it must
    regenerate has a producer, and every op it re-runs is deterministic (drew no random numbers in the trace) and
    takes no object with state of its own (a KV cache)."""
    trace = instrumented.trace
    cost = evaluate(trace.graph, plan)
    graph = trace.graph
    rerun = mitigation_ops(graph, plan).rerun
    makers = [name.rsplit(".", 1)[0] for name in cost.unavailable]  # a traced tensor is named after its maker
    for op in [*rerun, *makers]:
        if op in trace.random_ops:
            raise ValueError(f"plan: RECOMPUTE re-runs {op} (module {trace.modules[op][0]}), which draws random "
                             "numbers; RECOMPUTE needs a deterministic module (e.g. no dropout in training)")
        if op in trace.mutating_ops:
            raise ValueError(f"plan: RECOMPUTE re-runs {op} (module {trace.modules[op][0]}), which changes its input "
                             "in place or replaces one of its buffers: a re-run would not see what the forward saw; "
                             "keep, offload or quantize its savings")
        if op in trace.stateful_ops:
            raise ValueError(f"plan: RECOMPUTE re-runs {op} (module {trace.modules[op][0]}), whose call takes a "
                             f"{trace.stateful_ops[op]} object: a re-run could change or read its state (a KV cache "
                             "is updated again); keep, offload or quantize its savings, or run the model without "
                             "it (transformers: use_cache=False)")
    if cost.unavailable:
        raise ValueError(f"plan: RECOMPUTE would regenerate {', '.join(cost.unavailable[:3])}, which no re-run of a "
                         "mapped module makes (a graph input, or a tensor one module saves and another reads): "
                         "keep, offload or quantize it")
    # a re-run reads its inputs back from where they are stored: an FP8 copy (or what a re-run made from one) is
    # approximate, which an op whose shapes depend on values (routing) cannot take
    strategies = resolve(graph, plan)
    exact: dict[str, bool] = {}
    for op_name, tensor in strategies:
        strategy = strategies[(op_name, tensor)]
        if strategy in (Strategy.KEEP, Strategy.OFFLOAD):
            exact[tensor] = True
        elif strategy is Strategy.QUANTIZE:
            exact.setdefault(tensor, False)
    for op_name in rerun:  # graph order: inputs are settled before the ops that read them
        op = graph.op(op_name)
        approximate = [t for t in op.inputs if exact.get(t, True) is False]
        if approximate and op_name in trace.value_dependent_ops:
            raise ValueError(f"plan: RECOMPUTE re-runs {op_name} (module {trace.modules[op_name][0]}), whose shapes "
                             f"depend on values, from an FP8 copy of {approximate[0]}: keep or offload that input")
        for out in op.outputs:
            if out not in exact or not exact[out]:
                exact[out] = not approximate and exact.get(out, True)


def check_sources(record: MicroBatchRecord) -> None:
    """``ValueError`` at the end of a forward if a re-run the plan asks for could not find one of its inputs in
    backward: no op stored it and no re-run makes it. That happens when a module keeps other tensors than its
    cost-model op lists (its saved tensors are then *unknown*, kept but unnamed), so the tensor a replay reads
    was never saved: e.g. PyTorch's math attention, which keeps the attention probabilities and the expanded keys
    and values where flash attention keeps q, k, v, the output and the log-sum-exp (fp32 attention with grouped
    queries on CUDA, or ``SDPBackend.MATH``)."""
    if not record.pack_count:  # nothing saved (a forward under torch.no_grad): no backward runs a re-run
        return
    for replay in record.replays:
        for arg in replay.args:
            if not isinstance(arg, Source):
                continue
            if arg.stored.producer is not None or arg.stored.has_copy:
                continue
            name = arg.stored.name or arg.name
            if name is not None and any(entry.has_copy for entry in record.named.get(name, ())):
                continue
            ops = list(record.unknown_ops.items())
            unknown = ", ".join(f"{op or 'outside any op'} {nbytes:,} B" for op, nbytes in ops[:3])
            unknown += f" and {len(ops) - 3} more ops" if len(ops) > 3 else ""
            raise ValueError(
                f"plan: RECOMPUTE re-runs {replay.op}, whose input {name or 'tensor'} no op saved and no re-run "
                f"makes: the model saved other tensors than its cost-model ops list (unnamed: {unknown or 'none'}); "
                "keep that op's savings, or run the module as the graph assumes (attention: a flash or cuDNN kernel, "
                "not PyTorch's math path, which fp32 with grouped queries takes on CUDA)")
