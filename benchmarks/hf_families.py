"""The table of docs/hf.md: every tested transformers MoE family, tiny random config (``tests/hf_models.py``),
instrumented by ``bagualu2.integrations.hf`` and traced for one micro-batch of 2 x 16 tokens (FP32, CPU).

    python benchmarks/hf_families.py            # a markdown table on stdout, the first ten families
    python benchmarks/hf_families.py --all      # every family of hf.SUPPORTED_FAMILIES
    python benchmarks/hf_families.py mixtral    # the families named

Columns: the op kinds found in an MoE layer; the bytes that layer saves per token (traced), of which the routed
experts' (fc1, activation, fc2, dispatch); the bytes saved outside every op (embedding, final norm, output layer,
loss: pinned, kept) per token; the greedy's fraction of the unmitigated bytes at the floor; and what the analytic
``build_graph`` predicts per token for a GLM-style MoE layer of the same sizes (hidden, heads, expert width,
experts, top-k; its own attention and norm layout), for scale; and whether greedy plans at four budgets keep
exactly their predicted bytes with the plain run's loss and gradients (every re-run verified).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hf_models import FAMILIES, run_plan, tiny  # noqa: E402

from bagualu2.costmodel import ModelConfig, ParallelConfig, build_graph, presets  # noqa: E402
from bagualu2.integrations import hf  # noqa: E402
from bagualu2.mitigation import greedy  # noqa: E402

HW = presets.hardware("cpu")
BATCH, SEQ = 2, 16
ROUTED = ("dispatch", "expert_fc1", "expert_act", "expert_fc2")


def analytic_bytes_per_token(config) -> float:
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    experts = next(getattr(text, k) for k in ("num_experts", "n_routed_experts", "num_local_experts",
                                              "moe_num_experts") if getattr(text, k, None))
    top_k = next(getattr(text, k) for k in ("num_experts_per_tok", "moe_topk", "top_k_experts", "moe_k")
                 if getattr(text, k, None))
    width = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
    dense = getattr(text, "intermediate_size", None) or width
    groups = getattr(text, "num_key_value_heads", None) or heads
    groups = groups if groups <= heads and heads % groups == 0 else heads  # MLA families: no KV groups
    model = ModelConfig(num_layers=1, hidden_size=text.hidden_size, num_attention_heads=heads,
                        num_query_groups=groups, head_dim=head_dim,
                        ffn_hidden_size=dense, moe_ffn_hidden_size=width, num_experts=experts,
                        top_k=top_k, num_shared_experts=0, num_dense_layers=0,
                        vocab_size=text.vocab_size, seq_length=SEQ, micro_batch_size=BATCH, dtype="fp32",
                        flash_attention=False)
    graph = build_graph(model, ParallelConfig(num_microbatches=1), HW)
    return graph.unmitigated_bytes / (BATCH * SEQ)


def row(family: str) -> str:
    torch.set_num_threads(1)
    model, ids = tiny(family, batch=BATCH, seq=SEQ)
    instrumented = hf.instrument(model)
    graph = instrumented.trace_graph(input_ids=ids, labels=ids, hardware=HW, loss=lambda out: out.loss)
    tokens = BATCH * SEQ
    moe_layer = max(op.layer for op in graph.ops if op.kind == "expert_fc1")
    layer_ops = [op for op in graph.ops if op.layer == moe_layer and op.name != "unmapped"]
    kinds = sorted({op.kind for op in layer_ops})

    def saved(ops) -> int:
        return graph.copies_bytes({(s.tensor, s.dtype) for op in ops for s in op.saves})

    routed = saved([op for op in layer_ops if op.kind in ROUTED])
    unmapped = saved([graph.op("unmapped")]) if any(op.name == "unmapped" for op in graph.ops) else 0
    floor = greedy.solve(graph, graph.floor_bytes).cost.activation_bytes / graph.unmitigated_bytes
    return (f"| {family} | {len(kinds)}: {', '.join(kinds)} | {saved(layer_ops) / tokens:.0f} | "
            f"{routed / tokens:.0f} | {unmapped / tokens:.0f} | {floor:.2f} | "
            f"{_analytic(model.config)} | {exact(model, ids, instrumented, graph)} |")


def _analytic(config) -> str:
    try:
        return f"{analytic_bytes_per_token(config):.0f}"
    except RuntimeError as error:  # per-layer sizes (transformers' AmbiguousGlobalPerLayerAttributeError): no one
        if "per-layer" not in str(error):  # GLM-style layer to compare with
            raise
        return "n/a"


def exact(model, ids, instrumented, graph) -> str:
    """Greedy plans at four budgets from the floor to the unmitigated bytes, every re-run verified: do they keep
    the predicted bytes, within budget, with the plain run's loss and gradients (bitwise without QUANTIZE)?"""
    loss0, grads0, _, _ = run_plan(model, ids, instrumented, None)
    results = []
    for step in range(4):
        budget = graph.floor_bytes + (graph.unmitigated_bytes - graph.floor_bytes) * step // 3
        solution = greedy.solve(graph, budget)
        loss, grads, kept, _ = run_plan(model, ids, instrumented, solution.plan)
        same = torch.equal(loss, loss0) and all(torch.equal(a, b) for a, b in zip(grads, grads0))
        quantized = any(strategy.value == "QUANTIZE" for _, strategy in solution.plan.entries)
        results.append(kept == solution.cost.activation_bytes <= budget and (same or quantized))
    return "yes" if all(results) else f"NO ({results})"


def main(families: list[str], every: bool) -> None:
    print("| family | op kinds of an MoE layer | saved B/token/layer | routed experts' | outside the ops, "
          "B/token | floor / unmitigated | analytic GLM-style layer, B/token | exact |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for family in families or (FAMILIES if every else FAMILIES[:10]):
        try:
            print(row(family), flush=True)
        except Exception as error:  # noqa: BLE001 (a row per family: what failed, in one line)
            first = (str(error).splitlines() or [""])[0][:120]
            print(f"| {family} | failed: {type(error).__name__}: {first} |", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("families", nargs="*", help="families to run (default: the first 10; --all: every one)")
    parser.add_argument("--all", action="store_true", help="every tested family")
    args = parser.parse_args()
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families: {', '.join(unknown)}")
    main(args.families, args.all)
