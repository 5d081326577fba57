"""Shared test set-up.

* Hypothesis profiles ``dev`` (fast, random), ``ci`` (derandomized) and ``stress``. A costly property test names
  its example count under ``ci`` with ``scaled(n)``, which the active profile scales (``dev``: half, ``stress``: 6x),
  so every test follows the profile.
* Tiers: a test that launches a process (``subprocess``, ``multiprocessing``, torchrun) must be marked ``slow``;
  an unmarked one that tries fails at once with the reason. The quick tier is ``pytest -m "not slow"``.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest
from hypothesis import HealthCheck, settings

CI_EXAMPLES = 100  # the ci profile's max_examples: scaled(n) is n under ci
settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile("ci", max_examples=CI_EXAMPLES, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("stress", max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def scaled(n: int) -> int:
    """``n`` examples under the ``ci`` profile, scaled by the active profile's ``max_examples`` (at least 1)."""
    return max(1, round(n * settings.default.max_examples / CI_EXAMPLES))


@pytest.fixture(autouse=True)
def _process_launches_are_marked_slow(request, monkeypatch):
    if request.node.get_closest_marker("slow") is not None:
        return

    def refuse(*_args, **_kwargs):
        raise AssertionError(f"{request.node.nodeid} launches a process: mark it @pytest.mark.slow")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
