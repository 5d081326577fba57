"""Shared test set-up.

* Hypothesis profiles ``dev`` (fast, random), ``ci`` (derandomized) and ``stress``. A costly property test names
  its example count under ``ci`` with ``scaled(n)``, which the active profile scales (``dev``: half, ``stress``: 6x),
  so every test follows the profile.
* Tiers: a test that launches a process (``subprocess``, ``multiprocessing``, torchrun) must be marked ``launch``
  (which makes it ``slow`` too); an unmarked one that tries fails at once with the reason. A test of a second or
  more is marked ``slow``. The quick tier is ``pytest -m "not slow"``; ``scripts/test.sh`` runs the tests that
  launch nothing, then the launches, each on two workers.
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


def pytest_sessionstart(session):
    """matplotlib builds its font cache on first use by running ``fc-list``: build it before any test runs, so a
    test drawing a PNG on a fresh machine launches nothing."""
    try:
        import matplotlib.font_manager  # noqa: F401  (importing it loads or builds the cache)
    except ImportError:
        pass


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("launch") is not None and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """An unmarked test may not launch a process, in its own body or in a fixture it sets up (of any scope)."""
    if item.get_closest_marker("launch") is not None:
        yield
        return

    def refuse(*_args, **_kwargs):
        raise AssertionError(f"{item.nodeid} launches a process: mark it @pytest.mark.launch")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", refuse)
        patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        yield
