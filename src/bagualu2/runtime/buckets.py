"""Imbalance buckets: a measured imbalance rounds *up* to its bucket (a decision made on the bucket's graph fits
every imbalance in it); a planned imbalance rounds *down* (what is committed before the gate stays a low
estimate)."""

from __future__ import annotations

import math


def ceil_bucket(imbalance: float, step: float, ceiling: float | None = None) -> float:
    """``imbalance`` rounded up to a multiple of ``step`` (at least 1.0), and not above ``ceiling`` (the largest
    imbalance there is: the expert-parallel degree, all the load on one rank); an imbalance above ``ceiling`` is
    returned as it is, for the graph builder to refuse."""
    bucket = max(round(math.ceil(imbalance / step - 1e-9) * step, 9), 1.0)
    return bucket if ceiling is None else min(bucket, max(imbalance, ceiling))


def floor_bucket(imbalance: float, step: float) -> float:
    """``imbalance`` rounded down to a multiple of ``step`` (at least 1.0)."""
    return max(round(math.floor(imbalance / step + 1e-9) * step, 9), 1.0)
