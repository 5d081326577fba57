"""Shared test set-up.

* Hypothesis profiles ``dev`` (fast, random), ``ci`` (derandomized) and ``stress``; tests set no ``max_examples``
  of their own (a test may scale the profile down with ``examples(fraction)``), so the profile scales them all.
* Tiers: a test that launches a process (``subprocess``, ``multiprocessing``, torchrun) must be marked ``slow``;
  an unmarked one that tries fails at once with the reason. The quick tier is ``pytest -m "not slow"``.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile("ci", max_examples=100, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("stress", max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def examples(fraction: float) -> int:
    """``fraction`` of the active profile's ``max_examples`` (at least 1): a costly property test's share."""
    return max(1, int(settings.default.max_examples * fraction))


@pytest.fixture(autouse=True)
def _process_launches_are_marked_slow(request, monkeypatch):
    if request.node.get_closest_marker("slow") is not None:
        return

    def refuse(*_args, **_kwargs):
        raise AssertionError(f"{request.node.nodeid} launches a process: mark it @pytest.mark.slow")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
