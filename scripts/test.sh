#!/usr/bin/env bash
# Install (torch==2.13.0 first, pinned, so the project's range never pulls another; the build is the configured
# index's) and run the whole test suite on two workers, one intra-op thread per process (torchrun's default;
# tiny CPU models run faster so): the tests that launch nothing, then the tests that launch processes (torchrun,
# the CLI, a fresh install), which also wait on timeouts and restarts.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[trainer,torchtitan,dev]"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-$([ "${CI:-}" = "true" ] && echo ci || echo dev)}"
python -m pytest -q -n 2 --dist loadfile -m "not launch" tests
python -m pytest -q -n 2 --dist loadfile -m launch tests
