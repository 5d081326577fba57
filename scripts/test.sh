#!/usr/bin/env bash
# Install (CPU torch first, so pip never pulls a CUDA build) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[trainer,dev]"
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-$([ "${CI:-}" = "true" ] && echo ci || echo dev)}"
python -m pytest -q tests
