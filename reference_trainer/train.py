"""Train the reference GLM-MoE model on CPU for a few steps under per-micro-batch activation plans.

    python -m reference_trainer.train [--preset tiny-moe] [--steps 20] [--memory-fraction 0.6] [--lr 1e-2]
                                      [--seed 0] [--json]

One process (EP=1, no pipeline): each step runs the preset's ``num_microbatches`` micro-batches with gradient
accumulation — every forward first, then every backward, so all micro-batches are in flight at once (the worst case
of one accumulation window) — and one AdamW update. The data is a synthetic counting task (the next token is the
current one plus one), so the loss visibly falls.

The activation memory of the transformer layers is capped at ``memory_fraction`` x what the micro-batches would
keep unmitigated (``ActivationTracker(cap_bytes=...)``, which raises an out-of-memory error past it). Per
micro-batch: Algorithm 1 (:class:`bagualu2.budget.BudgetAssigner`) gives its budget, the greedy solver (through the
plan cache) a plan for that budget, :func:`bagualu2.exec.apply_plan` applies it (recompute / offload / FP8 hooks)
with the deferred planner after each MoE gate, and the bytes it really keeps are fed back to Algorithm 1 and
compared with the cost model's prediction for that plan. ``--memory-fraction 1`` trains unmitigated.
User errors are one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, NoReturn, Sequence


def _fail(message: str) -> NoReturn:
    """One line on stderr and exit code 2; under torchrun only rank 0 reports, the others exit quietly."""
    if os.environ.get("RANK", "0") == "0":
        sys.stderr.write(f"error: {' '.join(message.split())}\n")
    raise SystemExit(2)


def _batch(generator, vocab: int, batch: int, seq: int):
    """Counting sequences from random starts: the next token is always the current one plus one (mod vocab)."""
    import torch

    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    tokens = (start + torch.arange(seq)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def train(preset: str = "tiny-moe", *, steps: int = 20, lr: float = 1e-2, seed: int = 0,
          memory_fraction: float = 0.6) -> dict[str, Any]:
    """Train and return a JSON-able record; ``ValueError`` on a bad request."""
    import torch

    from bagualu2.budget import BudgetAssigner
    from bagualu2.costmodel import ParallelConfig, build_graph, evaluate, presets
    from bagualu2.exec import ActivationTracker, DeferredPlanner, apply_plan
    from bagualu2.runtime import PlanCache

    from .measure import check_host_memory
    from .model import GLMMoEModel

    from bagualu2.costmodel.validate import require_int, require_number

    require_int("--steps", steps, 1)
    require_int("--seed", seed, 0, 2**63)  # torch.manual_seed takes a 64-bit seed
    require_number("--lr", lr, 0, 3.0e38, low_open=True)  # the optimizer casts it to the parameters' float32
    model_config, parallel = presets.model(preset)
    micro = parallel.num_microbatches
    hardware, layout = presets.hardware("cpu"), ParallelConfig()
    graph = build_graph(model_config, layout, hardware)
    floor = micro * graph.floor_bytes
    if not 0 < memory_fraction <= 1 or memory_fraction * micro * graph.unmitigated_bytes < floor:
        raise ValueError(f"--memory-fraction must lie in [{floor / (micro * graph.unmitigated_bytes):.3f}, 1] "
                         f"(full recompute of every micro-batch must fit), got {memory_fraction!r}")
    limit = int(memory_fraction * micro * graph.unmitigated_bytes)
    check_host_memory(model_config, micro * graph.unmitigated_bytes)
    torch.manual_seed(seed)
    model = GLMMoEModel(model_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    tracker = ActivationTracker(cap_bytes=limit, exclude=[model])
    plans = PlanCache(budget_quantum_bytes=max(graph.unmitigated_bytes // 64, 1))
    executors: dict = {}
    generator = torch.Generator().manual_seed(seed)
    log = []
    started = time.perf_counter()
    for step in range(steps):
        assigner = BudgetAssigner(m_max_bytes=limit, m0_bytes=graph.floor_bytes, num_microbatches=micro,
                                  num_warmup=micro)
        optimizer.zero_grad(set_to_none=True)
        losses, kept, budgets, predicted, used_plans, pending = [], [], [], [], [], []
        for index in range(micro):  # every forward of the window first: all micro-batches in flight
            inputs, targets = _batch(generator, model_config.vocab_size, model_config.micro_batch_size,
                                     model_config.seq_length + 1)
            budget = assigner.next_forward_budget()
            plan = plans.get(budget, 1.0, 0, lambda _: graph).plan
            key = (plan.entries, budget)
            if key not in executors:
                executors[key] = apply_plan(graph, plan, tracker=tracker, deferred=DeferredPlanner(
                    model_config, layout, hardware, budget_bytes=budget))
            executor, name = executors[key], f"{step}.{index}"
            embedded = model.embedding(inputs)  # the cost model covers the transformer layers only
            with executor.micro_batch(name) as record:
                hidden = model.forward_layers(embedded)
            logits = model.output(model.final_norm(hidden)) if model.output is not None else \
                model.final_norm(hidden) @ model.embedding.weight.t()
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                     targets.reshape(-1)) / micro
            assigner.record_forward(index, record.device_bytes)
            budgets.append(budget)
            kept.append(record.device_bytes)
            predicted.append(evaluate(graph, record.plan).activation_bytes)
            used_plans.append(str(record.plan))
            pending.append((executor, name, loss))
        for index, (executor, name, loss) in enumerate(pending):
            loss.backward()
            executor.release(name)
            assigner.record_backward(index)
            losses.append(loss.item() * micro)
        optimizer.step()
        log.append({"step": step, "loss": sum(losses) / micro, "kept_bytes": kept, "predicted_bytes": predicted,
                    "budget_bytes": budgets, "plans": used_plans})
    errors = [abs(k - p) / p for entry in log for k, p in zip(entry["kept_bytes"], entry["predicted_bytes"])]
    return {"preset": preset, "steps": steps, "num_microbatches": micro, "memory_limit_bytes": limit,
            "unmitigated_bytes": graph.unmitigated_bytes, "peak_bytes": tracker.peak_bytes,
            "max_rel_error": max(errors), "first_loss": log[0]["loss"], "last_loss": log[-1]["loss"],
            "distinct_plans": len({p for entry in log for p in entry["plans"]}),
            "seconds": time.perf_counter() - started, "log": log}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m reference_trainer.train", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-moe")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--memory-fraction", type=float, default=0.6,
                        help="activation memory cap as a fraction of the unmitigated micro-batches in flight")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.error = lambda message: _fail(message)  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    try:
        result = train(args.preset, steps=args.steps, lr=args.lr, seed=args.seed,
                       memory_fraction=args.memory_fraction)
    except ValueError as exc:
        _fail(str(exc))
    if args.json:
        print(json.dumps(result))
        return
    mib = 2**20
    for entry in result["log"]:
        kept = " ".join(f"{k / mib:.2f}" for k in entry["kept_bytes"])
        budgets = " ".join(f"{b / mib:.2f}" for b in entry["budget_bytes"])
        print(f"step {entry['step']:3d}  loss {entry['loss']:.4f}  kept MiB [{kept}]  budgets MiB [{budgets}]")
    print(f"{result['preset']}: loss {result['first_loss']:.3f} -> {result['last_loss']:.3f} in {result['steps']} "
          f"steps ({result['seconds']:.1f} s) under a {result['memory_limit_bytes'] / mib:.2f} MiB activation cap "
          f"(unmitigated: {result['num_microbatches']} x {result['unmitigated_bytes'] / mib:.2f} MiB; peak "
          f"{result['peak_bytes'] / mib:.2f} MiB; {result['distinct_plans']} distinct plans); measured bytes vs "
          f"cost model: max error {result['max_rel_error']:.2%}")


if __name__ == "__main__":
    main()
