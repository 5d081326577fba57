"""One prepared GPU check of the exec layer, for a machine with a CUDA device.

    PYTHONPATH=src:. PYTHONUNBUFFERED=1 python3 benchmarks/gpu/gpu_checks.py --out "$OUT"
    python benchmarks/gpu/gpu_checks.py --dry-run     # on CPU, a tiny config: checks the script's own logic

Installs nothing (the device image has torch; OR-Tools is not needed: only costmodel, budget and exec are imported).
Writes ``gpu_checks.json`` under ``--out`` and prints a summary. Two parts, on a mid-size BF16 GLM-MoE layer stack:

1. Memory: for plans with each strategy, one micro-batch's forward under ``apply_plan``: the tracker's bytes
   (storages) vs ``costmodel.evaluate``, and the allocator's view — ``torch.cuda.memory_allocated`` after the
   forward minus before (the layer output excluded) and ``torch.cuda.max_memory_allocated`` during it — relative to
   the prediction (target: within 3 %). Gradients of OFFLOAD / RECOMPUTE plans are compared bitwise with the plain
   run.
2. Offload overlap: forward + backward time of the plain run (t0) and of an OFFLOAD plan with prefetch before
   backward (t1), CUDA events, median of repeats after warm-up; the plan's copy time alone (tc: the same host copies
   through the same copy engine, synchronised). Hidden fraction = 1 - (t1 - t0) / tc (target: >= 0.8).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bagualu2.costmodel import ModelConfig, ParallelConfig, build_graph, evaluate, presets
from bagualu2.exec import apply_plan
from bagualu2.exec.packing import CopyEngine, flat_storage
from reference_trainer.instrumented import instrument_reference
from reference_trainer.model import GLMMoEModel

CONFIG = ModelConfig(num_layers=4, hidden_size=2048, num_attention_heads=16, num_query_groups=4, head_dim=128,
                     ffn_hidden_size=8192, moe_ffn_hidden_size=1024, num_experts=8, top_k=2, num_shared_experts=1,
                     num_dense_layers=1, vocab_size=32000, seq_length=4096, micro_batch_size=1, dtype="bf16")
PLANS = ["none", "core_attn=OFFLOAD", "expert_act=RECOMPUTE,core_attn=RECOMPUTE", "expert_fc1=QUANTIZE",
         "norm=RECOMPUTE,core_attn=OFFLOAD,expert_fc1=QUANTIZE"]
OVERLAP_PLAN = "expert_fc1=OFFLOAD,shared_fc1=OFFLOAD"


DEVICE = "cuda"


def _setup(config: ModelConfig):
    graph = build_graph(config, ParallelConfig(), presets.hardware("h100"))
    torch.manual_seed(0)
    model = GLMMoEModel(config).to(DEVICE)
    instrument_reference(model)
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(config.micro_batch_size, config.seq_length, config.hidden_size, device=DEVICE,
                    dtype=next(model.parameters()).dtype, generator=generator)
    return graph, model, x


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if DEVICE == "cuda" else 0


def memory_check(graph, model, x) -> list[dict]:
    rows, reference = [], None
    for plan in PLANS:
        model.zero_grad(set_to_none=True)
        inp = x.clone().requires_grad_()
        executor = apply_plan(graph, plan, exclude=[model])
        _sync()
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        before = _allocated()
        with executor.micro_batch("mb") as record:
            out = model.forward_layers(inp)
        _sync()
        after = _allocated() - (out.untyped_storage().nbytes() if DEVICE == "cuda" else 0)
        peak = torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0
        predicted = evaluate(graph, plan).activation_bytes
        executor.prefetch("mb")
        out.float().pow(2).mean().backward()
        executor.release("mb")
        grads = [inp.grad] + [p.grad for p in model.parameters() if p.grad is not None]
        if reference is None:
            reference = [g.clone() for g in grads]
        bitwise = all(torch.equal(a, b) for a, b in zip(reference, grads))
        rows.append({"plan": plan, "predicted_bytes": predicted, "tracker_bytes": record.device_bytes,
                     "allocated_delta_bytes": after - before, "peak_delta_bytes": peak - before,
                     "allocated_rel_error": (after - before - predicted) / predicted if DEVICE == "cuda" else None,
                     "peak_rel_error": (peak - before - predicted) / predicted if DEVICE == "cuda" else None,
                     "host_bytes": record.host_bytes, "grads_bitwise_equal_plain": bitwise})
        del out, inp, grads
    return rows


def _time(fn, repeats: int = 5) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if DEVICE != "cuda":
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def overlap_check(graph, model, x) -> dict:
    def step(plan):
        executor = apply_plan(graph, plan, exclude=[model])

        def run():
            inp = x.clone().requires_grad_()
            with executor.micro_batch("mb"):
                out = model.forward_layers(inp)
            executor.prefetch("mb")
            out.float().pow(2).mean().backward()
            executor.release("mb")
        return run

    t0, t1 = _time(step("none")), _time(step(OVERLAP_PLAN))
    executor = apply_plan(graph, OVERLAP_PLAN, exclude=[model])
    inp = x.clone().requires_grad_()
    with executor.micro_batch("mb") as record:
        out = model.forward_layers(inp)
    copies = [c for c in record.host_copies]
    engine = CopyEngine()

    def copies_alone():
        for copy in copies:
            device = copy.to_device(engine, torch.device(DEVICE))  # h2d
            engine.offload(flat_storage(device))                    # d2h
    tc = _time(copies_alone)
    out.float().pow(2).mean().backward()
    executor.release("mb")
    hidden = 1 - (t1 - t0) / tc if tc > 0 else float("nan")
    return {"plan": OVERLAP_PLAN, "plain_s": t0, "offload_s": t1, "copies_alone_s": tc,
            "host_bytes": sum(c.host.numel() * c.host.element_size() for c in copies), "hidden_fraction": hidden}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--dry-run", action="store_true", help="run on CPU with a tiny config (no GPU numbers)")
    args = parser.parse_args()
    global DEVICE
    config = CONFIG
    if args.dry_run:
        DEVICE, config = "cpu", presets.model("tiny-moe")[0].replace(seq_length=32, dtype="bf16")
    elif not torch.cuda.is_available():
        print("error: no CUDA device (this script is for a session lent a GPU; --dry-run runs it on CPU)",
              file=sys.stderr)
        return 2
    graph, model, x = _setup(config)
    result = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)",
              "torch": torch.__version__, "config": repr(config),
              "memory": memory_check(graph, model, x), "overlap": overlap_check(graph, model, x)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_checks.json").write_text(json.dumps(result, indent=1))
    for row in result["memory"]:
        allocator = "" if row["allocated_rel_error"] is None else \
            f"allocated {100 * row['allocated_rel_error']:+.2f}% peak {100 * row['peak_rel_error']:+.2f}% "
        print(f"{row['plan']:55s} predicted {row['predicted_bytes']:>13,} tracker {row['tracker_bytes']:>13,} "
              f"{allocator}bitwise={row['grads_bitwise_equal_plain']}")
    o = result["overlap"]
    print(f"overlap: plain {o['plain_s'] * 1e3:.2f} ms, offload {o['offload_s'] * 1e3:.2f} ms, copies alone "
          f"{o['copies_alone_s'] * 1e3:.2f} ms -> hidden {100 * o['hidden_fraction']:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
