#!/usr/bin/env bash
# Install (CPU torch first) and run the main job on the embedded default.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
bagualu2 presets
bagualu2 memory --model glm-423b-a30b --hardware paper-gpu --imbalance 2.6
