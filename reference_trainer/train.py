"""Train the reference GLM-MoE model on CPU for a few steps, measuring what every micro-batch keeps.

    python -m reference_trainer.train [--preset tiny-moe] [--steps 20] [--lr 1e-2] [--seed 0] [--json]

One process (EP=1, no pipeline): each step runs the preset's ``num_microbatches`` micro-batches with gradient
accumulation and one AdamW update. The data is a synthetic counting task (the next token is the current one plus
one), so the loss visibly falls. Every micro-batch runs under :class:`bagualu2.exec.ActivationTracker`; the bytes it
keeps are compared with the cost model's prediction for the same layers, and Algorithm 1's budget for it is
reported. Applying mitigation plans inside the model (offload / FP8 / recompute hooks) is the open part of #5:
this loop trains unmitigated. User errors are one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, NoReturn, Sequence


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    raise SystemExit(2)


def _batch(generator, vocab: int, batch: int, seq: int):
    """Counting sequences from random starts: the next token is always the current one plus one (mod vocab)."""
    import torch

    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    tokens = (start + torch.arange(seq)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def train(preset: str = "tiny-moe", *, steps: int = 20, lr: float = 1e-2, seed: int = 0) -> dict[str, Any]:
    """Train and return a JSON-able record; ``ValueError`` on a bad request."""
    import torch

    from bagualu2.budget import BudgetAssigner
    from bagualu2.costmodel import ParallelConfig, build_graph, evaluate, presets
    from bagualu2.exec import ActivationTracker

    from .model import GLMMoEModel

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--steps must be an integer >= 1, got {steps!r}")
    if not lr > 0:
        raise ValueError(f"--lr must be > 0, got {lr!r}")
    model_config, parallel = presets.model(preset)
    torch.manual_seed(seed)
    model = GLMMoEModel(model_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    tracker = ActivationTracker(exclude=[model])
    predicted = evaluate(build_graph(model_config, ParallelConfig(), presets.hardware("cpu")), None).activation_bytes
    generator = torch.Generator().manual_seed(seed)
    micro = parallel.num_microbatches
    log = []
    started = time.perf_counter()
    for step in range(steps):
        # one accumulation window: all micro-batches in flight at once is the worst case Algorithm 1 budgets for
        assigner = BudgetAssigner(m_max_bytes=micro * predicted, m0_bytes=0, num_microbatches=micro,
                                  num_warmup=micro)
        optimizer.zero_grad(set_to_none=True)
        losses, kept, budgets = [], [], []
        for index in range(micro):
            inputs, targets = _batch(generator, model_config.vocab_size, model_config.micro_batch_size,
                                     model_config.seq_length + 1)
            budgets.append(assigner.next_forward_budget())
            embedded = model.embedding(inputs)  # the cost model covers the transformer layers only
            with tracker.micro_batch(f"{step}.{index}"):
                hidden = model.forward_layers(embedded)
            logits = model.output(model.final_norm(hidden)) if model.output is not None else \
                model.final_norm(hidden) @ model.embedding.weight.t()
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                     targets.reshape(-1)) / micro
            assigner.record_forward(index, tracker.kept_bytes(f"{step}.{index}"))
            loss.backward()
            kept.append(tracker.release(f"{step}.{index}"))
            assigner.record_backward(index)
            losses.append(loss.item() * micro)
        optimizer.step()
        log.append({"step": step, "loss": sum(losses) / micro, "kept_bytes": kept, "budget_bytes": budgets})
    return {"preset": preset, "steps": steps, "num_microbatches": micro, "predicted_bytes": predicted,
            "max_rel_error": max(abs(k - predicted) / predicted for entry in log for k in entry["kept_bytes"]),
            "first_loss": log[0]["loss"], "last_loss": log[-1]["loss"], "seconds": time.perf_counter() - started,
            "log": log}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m reference_trainer.train", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-moe")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.error = lambda message: _fail(message)  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    try:
        result = train(args.preset, steps=args.steps, lr=args.lr, seed=args.seed)
    except ValueError as exc:
        _fail(str(exc))
    if args.json:
        print(json.dumps(result))
        return
    for entry in result["log"]:
        print(f"step {entry['step']:3d}  loss {entry['loss']:.4f}  kept per micro-batch "
              f"{entry['kept_bytes'][0] / 2**20:.2f} MiB (budget {entry['budget_bytes'][0] / 2**20:.2f} MiB)")
    print(f"{result['preset']}: loss {result['first_loss']:.3f} -> {result['last_loss']:.3f} in {result['steps']} "
          f"steps ({result['seconds']:.1f} s); measured activation bytes vs cost model: max error "
          f"{result['max_rel_error']:.2%} (predicted {result['predicted_bytes'] / 2**20:.2f} MiB per micro-batch)")


if __name__ == "__main__":
    main()
