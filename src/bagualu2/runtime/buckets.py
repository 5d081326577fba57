"""Imbalance buckets: a measured imbalance rounds *up* to its bucket (a decision made on the bucket's graph fits
every imbalance in it); a planned imbalance rounds *down* (what is committed before the gate stays a low
estimate)."""

from __future__ import annotations

import math
import numbers

from ..costmodel.validate import require_number


def _check_step(step) -> None:
    if isinstance(step, bool) or not isinstance(step, numbers.Real) or not 0 < step < math.inf:
        raise ValueError(f"step must be a finite number > 0, got {step!r}")


def ceil_bucket(imbalance: float, step: float, ceiling: float | None = None) -> float:
    """``imbalance`` rounded up to a multiple of ``step`` (at least 1.0), and not above ``ceiling`` (the largest
    imbalance there is: ``costmodel.imbalance_limit``, the most routed copies one rank can receive); an imbalance
    above ``ceiling`` is returned as it is, for the graph builder to refuse."""
    _check_step(step)
    imbalance = require_number("imbalance", imbalance, 1)
    if ceiling is not None and (isinstance(ceiling, bool) or not isinstance(ceiling, numbers.Real)
                                or not ceiling >= 1):
        raise ValueError(f"ceiling must be a number >= 1 (infinite: none) or None, got {ceiling!r:.40}")
    bucket = max(round(_steps(imbalance, step, math.ceil, -1e-9) * step, 9), 1.0)
    if bucket < imbalance:  # within the float tolerance above a multiple: never below what was measured
        bucket = float(imbalance)
    return bucket if ceiling is None else min(bucket, max(imbalance, ceiling))


def floor_bucket(imbalance: float, step: float) -> float:
    """``imbalance`` rounded down to a multiple of ``step`` (at least 1.0)."""
    _check_step(step)
    imbalance = require_number("imbalance", imbalance, 1)
    return max(round(_steps(imbalance, step, math.floor, 1e-9) * step, 9), 1.0)


def _steps(imbalance: float, step: float, rounding, nudge: float) -> int:
    """``imbalance / step`` rounded (a float tolerance ``nudge`` first); one line when the ratio is no number."""
    ratio = imbalance / step + nudge
    if not math.isfinite(ratio):
        raise ValueError(f"imbalance / step must be a finite number, got {imbalance!r} / {step!r}")
    return rounding(ratio)
