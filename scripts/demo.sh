#!/usr/bin/env bash
# Install (torch==2.13.0 first, pinned, so the project's range never pulls another; the build is the configured
# index's) and run the main job on its embedded default: plan one iteration of a GLM-1041B-A35B pipeline stage
# with MoE imbalance spikes (budget, plan, fused order per micro-batch), then train the tiny reference GLM-MoE
# model on CPU, measuring what every micro-batch keeps.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[trainer,dev]"
bagualu2 memory --model glm-1041b-a35b --hardware paper-gpu --imbalance 2.6
bagualu2 demo  # plans one iteration with spikes, then trains the tiny model on CPU for 20 steps
