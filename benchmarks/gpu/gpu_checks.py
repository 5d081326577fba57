"""One prepared GPU check of the exec layer, for a machine with a CUDA device.

    PYTHONPATH=src:. PYTHONUNBUFFERED=1 python3 benchmarks/gpu/gpu_checks.py --out "$OUT"
    python benchmarks/gpu/gpu_checks.py --dry-run     # on CPU, a tiny config: checks the script's own logic

Installs nothing (the device image has torch; OR-Tools is not needed: only costmodel, budget and exec are imported).
Writes ``gpu_checks.json`` under ``--out`` and prints a summary. Two parts, on a mid-size BF16 GLM-MoE layer stack:

1. Memory: for plans with each strategy, one micro-batch's forward under ``apply_plan``: the tracker's bytes
   (storages) vs ``costmodel.evaluate``, and the allocator's view — ``torch.cuda.memory_allocated`` after the
   forward minus before (the layer output excluded) and ``torch.cuda.max_memory_allocated`` during it — relative to
   the prediction (target: within 3 %). Every host copy is compared bitwise with the storage it copied (read on the
   compute stream when it was saved), every re-run with its forward (``verify=True``); gradients by their largest
   relative difference from the plain run's, the plain run twice giving the device's own run-to-run difference
   (attention's backward accumulates with atomics).
2. Offload overlap: two micro-batches of four sequences, plain (t0) and with an OFFLOAD plan (t1), in two orders:
   sequential (each reload prefetched just before its backward) and interleaved as 1F1B runs them (a's reload
   beside b's forward);
   CUDA events over every stream, median of repeats after warm-up; the same copies alone (tc, synchronised).
   Hidden fraction = 1 - (t1 - t0) / tc (target: >= 0.8 interleaved).
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
from reference_trainer.instrumented import instrument_reference
from reference_trainer.model import GLMMoEModel

CONFIG = ModelConfig(num_layers=4, hidden_size=2048, num_attention_heads=16, num_query_groups=4, head_dim=128,
                     ffn_hidden_size=8192, moe_ffn_hidden_size=1024, num_experts=8, top_k=2, num_shared_experts=1,
                     num_dense_layers=1, vocab_size=32000, seq_length=4096, micro_batch_size=1, dtype="bf16")
PLANS = ["none", "none", "core_attn=OFFLOAD", "expert_act=RECOMPUTE,core_attn=RECOMPUTE", "expert_fc1=QUANTIZE",
         "norm=RECOMPUTE,core_attn=OFFLOAD,expert_fc1=QUANTIZE"]
OVERLAP_PLAN = "expert_fc1=OFFLOAD,shared_fc1=OFFLOAD"
OVERLAP_BATCH = 4


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
        executor = apply_plan(graph, plan, exclude=[model], verify=True)  # re-runs must match bitwise
        stash = []  # what each offload copies, read synchronously on the compute stream when it is saved
        offload = executor.engine.offload
        executor.engine.offload = lambda flat: (stash.append(flat.to("cpu", copy=True)), offload(flat))[1]
        _sync()
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        before = _allocated()
        with executor.micro_batch("mb") as record:
            out = model.forward_layers(inp)
        _sync()
        after = _allocated() - (out.untyped_storage().nbytes() if DEVICE == "cuda" else 0)
        peak = torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0
        exact = len(stash) == len(record.host_copies) and all(
            torch.equal(c.host, t) for c, t in zip(record.host_copies, stash))
        del stash
        predicted = evaluate(graph, plan).activation_bytes
        executor.prefetch("mb")
        out.float().pow(2).mean().backward()
        executor.release("mb")
        grads = [inp.grad] + [p.grad for p in model.parameters() if p.grad is not None]
        if reference is None:
            reference = [g.clone() for g in grads]
        rel = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                  for a, b in zip(grads, reference))
        rows.append({"plan": plan, "predicted_bytes": predicted, "tracker_bytes": record.device_bytes,
                     "unknown_bytes": record.unknown_bytes, "unknown_ops": sorted(map(str, record.unknown_ops)),
                     "allocated_delta_bytes": after - before, "peak_delta_bytes": peak - before,
                     "allocated_rel_error": (after - before - predicted) / predicted
                     if DEVICE == "cuda" else None,
                     "peak_rel_error": (peak - before - predicted) / predicted if DEVICE == "cuda" else None,
                     "host_bytes": record.host_bytes, "host_copies_exact": exact, "reruns_verified": True,
                     "grads_max_rel_diff_plain": rel})
        del out, inp, grads
    return rows


def _time(fn, repeats: int = 5) -> float:
    for _ in range(2):
        fn()
    _sync()
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
        _sync()  # every stream: the copy streams' work is part of the step
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def overlap_check(config, model, x) -> dict:
    """Two schedules of two micro-batches a, b, each timed plain (t0) and with ``OVERLAP_PLAN`` (t1):

    * ``sequential``: F(a) B(a) F(b) B(b), each reload prefetched just before its backward (nothing to hide it);
    * ``interleaved``: F(a), prefetch(a), F(b), B(a), prefetch(b), B(b) — 1F1B's order: a's reload runs beside
      b's forward.
    ``copies_alone_s``: the same device->host and host->device copies of both micro-batches, synchronised.
    Micro-batches of ``OVERLAP_BATCH`` sequences, so that the GPU, not the Python that launches its kernels, sets
    the pace."""
    config = config.replace(micro_batch_size=OVERLAP_BATCH)
    graph = build_graph(config, ParallelConfig(), presets.hardware("h100"))
    x = x.repeat(OVERLAP_BATCH, 1, 1)
    def step(plan, order):
        executor = apply_plan(graph, plan, exclude=[model])

        def run():
            outs = {}
            for action, name in order:
                if action == "F":
                    inp = x.clone().requires_grad_()
                    with executor.micro_batch(name):
                        outs[name] = model.forward_layers(inp)
                elif action == "P":
                    executor.prefetch(name)
                else:
                    outs.pop(name).float().pow(2).mean().backward()
                    executor.release(name)
        return run

    orders = {"sequential": [("F", "a"), ("P", "a"), ("B", "a"), ("F", "b"), ("P", "b"), ("B", "b")],
              "interleaved": [("F", "a"), ("P", "a"), ("F", "b"), ("B", "a"), ("P", "b"), ("B", "b")]}
    executor = apply_plan(graph, OVERLAP_PLAN, exclude=[model])
    inp = x.clone().requires_grad_()
    with executor.micro_batch("mb") as record:
        out = model.forward_layers(inp)
    _sync()
    hosts = [c.host for c in record.host_copies]
    devices = [torch.empty(h.numel(), dtype=h.dtype, device=DEVICE) for h in hosts]

    def copies_alone():  # both micro-batches: every storage down and back up once
        for _ in range(2):
            for host, device in zip(hosts, devices):
                host.copy_(device, non_blocking=True)
            for host, device in zip(hosts, devices):
                device.copy_(host, non_blocking=True)
    tc = _time(copies_alone)
    host_bytes = sum(h.numel() * h.element_size() for h in hosts)
    del out, devices
    executor.release("mb")
    rows = {"plan": OVERLAP_PLAN, "host_bytes_per_microbatch": host_bytes, "copies_alone_s": tc,
            "copy_bytes_per_s": 4 * host_bytes / tc if tc > 0 else None}
    for label, order in orders.items():
        t0, t1 = _time(step("none", order)), _time(step(OVERLAP_PLAN, order))
        rows[label] = {"plain_s": t0, "offload_s": t1, "exposed_s": t1 - t0,
                       "hidden_fraction": 1 - (t1 - t0) / tc if tc > 0 else None}
    return rows


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
              "memory": memory_check(graph, model, x), "overlap": overlap_check(config, model, x)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_checks.json").write_text(json.dumps(result, indent=1))
    for row in result["memory"]:
        allocator = "" if row["allocated_rel_error"] is None else \
            f"allocated {100 * row['allocated_rel_error']:+.2f}% peak {100 * row['peak_rel_error']:+.2f}% "
        print(f"{row['plan']:55s} predicted {row['predicted_bytes']:>13,} tracker {row['tracker_bytes']:>13,} "
              f"(unknown {row['unknown_bytes']}) {allocator}copies exact={row['host_copies_exact']} grads rel diff "
              f"{row['grads_max_rel_diff_plain']:.1e}")
    o = result["overlap"]
    print(f"overlap {o['plan']}: {o['host_bytes_per_microbatch']:,} bytes per micro-batch, copies alone "
          f"{o['copies_alone_s'] * 1e3:.2f} ms")
    for label in ("sequential", "interleaved"):
        row = o[label]
        print(f"  {label}: plain {row['plain_s'] * 1e3:.2f} ms, offload {row['offload_s'] * 1e3:.2f} ms -> hidden "
              f"{100 * row['hidden_fraction']:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
