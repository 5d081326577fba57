"""Imbalance buckets: a measured imbalance rounds *up* to its bucket (a decision made on the bucket's graph fits
every imbalance in it); a planned imbalance rounds *down* (what is committed before the gate stays a low
estimate)."""

from __future__ import annotations

import math


def ceil_bucket(imbalance: float, step: float) -> float:
    """``imbalance`` rounded up to a multiple of ``step`` (at least 1.0)."""
    return max(round(math.ceil(imbalance / step - 1e-9) * step, 9), 1.0)


def floor_bucket(imbalance: float, step: float) -> float:
    """``imbalance`` rounded down to a multiple of ``step`` (at least 1.0)."""
    return max(round(math.floor(imbalance / step + 1e-9) * step, 9), 1.0)
