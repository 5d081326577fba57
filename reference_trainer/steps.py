"""Per-step helpers of the training loop: the learning-rate schedule and the seeded spike draws."""

from __future__ import annotations

import math
import random

from bagualu2.costmodel.build import routing_limit

from .recipes import TrainConfig


def lr_at(config: TrainConfig, step: int) -> float:
    """Linear warm-up over ``warmup_steps``, then constant."""
    return config.lr * min(1.0, (step + 1) / max(config.warmup_steps, 1))


def spikes_of(config: TrainConfig, step: int, group_index: int, num_microbatches: int, ep: int,
              top_k: int) -> dict[int, tuple[int, list[int]]]:
    """Micro-batches forced to spike in this iteration for one EP group: ``{i: (target rank, picks per source
    rank)}``, a pure function of (seed, step, group); the imbalance is uniform in [1.2, min(spike_max, ep,
    num_experts / top_k)]."""
    from .routing import imbalance_picks

    if config.spike_rate <= 0:
        return {}
    rng = random.Random(f"{config.seed}:{step}:{group_index}")
    found = {}
    # one rank receives at most ep x the mean, and each token reaches at most top_k of the experts
    top = min(config.spike_max, float(ep), routing_limit(config.model))
    for index in range(num_microbatches):
        if rng.random() < config.spike_rate:
            rate = rng.uniform(min(1.2, top), top)
            found[index] = (rng.randrange(ep), imbalance_picks(rate, ep, top_k))
    return found


def flops_per_token(config: TrainConfig) -> float:
    from .metrics import model_flops_per_token

    return model_flops_per_token(config.model)


def finite(value: float) -> float | None:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None
