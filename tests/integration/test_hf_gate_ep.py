"""The gate's re-plan on traced graphs under transformers' expert parallelism (two ranks, gloo, torchrun): a
router biased toward rank 0's experts sends them every routed copy (imbalance 2) and rank 1's none. On two
families (their own load-balancing bias, ``e_score_correction_bias``), with a budget the balanced micro-batch
meets unmitigated:

* rank 0's gate sees imbalance 2, where the plan in force would overrun the budget, and the ranks agree on the
  re-plan (the module's full downgrade on both, so their re-run collectives match);
* every rank keeps at most its budget, rank 0 exactly ``evaluate`` of its final plan on the traced graph at the
  realised imbalance; with unbiased routing (a third family) every rank keeps exactly ``evaluate`` of its final
  plan with each layer at the copies its experts received;
* the loss and every gradient (each rank's expert shards too) are the plain run's, bitwise, every re-run
  verified.

One launch (``hf_gate_ep.py``) runs both families; the tests read what each rank reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("hf_gate_ep.py")
FAMILIES = ("deepseek_v3", "glm4_moe")  # biased: their routers have an e_score_correction_bias
UNBIASED = "qwen3_moe"  # no bias: each rank's experts receive what its random routing sends
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def reports():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(SCRIPT), *FAMILIES, UNBIASED], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = sorted((json.loads(line[len("REPORT "):]) for line in proc.stdout.splitlines()
                    if line.startswith("REPORT ")), key=lambda r: r["rank"])
    assert [r["rank"] for r in found] == [0, 1], proc.stdout
    return {(r["rank"], f["family"]): f for r in found for f in r["families"]}


@pytest.mark.launch
@pytest.mark.parametrize("family", FAMILIES)
def test_the_biased_rank_replans_within_budget(reports, family):
    spike, idle = reports[(0, family)], reports[(1, family)]
    assert spike["moe_layers"] == spike["biased_routers"] >= 1 and spike["plan_in_force_fits_balanced"]
    assert set(spike["received"].values()) == {2 * spike["mean_routed_tokens"]}  # imbalance 2
    assert set(idle["received"].values()) == {0}
    assert spike["plan_in_force_at_imbalance_bytes"] > spike["budget_bytes"]  # keeping the plan would overrun
    assert [d[1] for d in spike["decisions"]] == [2.0] * len(spike["decisions"])
    assert any(d[3] for d in spike["decisions"])  # the gate changed the plan
    layers = [int(layer) for layer in spike["received"]]
    assert spike["downgraded"] == idle["downgraded"] == layers  # the ranks agree, layer by layer
    assert spike["device_bytes"] == spike["predicted_bytes"] == spike["received_predicted_bytes"]
    assert spike["device_bytes"] <= spike["budget_bytes"]
    assert idle["device_bytes"] <= idle["budget_bytes"]


@pytest.mark.launch
@pytest.mark.parametrize("rank", [0, 1])
def test_unbiased_routing_keeps_exactly_the_bytes_of_each_layers_copies(reports, rank):
    """Layers route differently on each rank: the bytes kept are ``evaluate`` of the final plan with each MoE
    layer at the copies its experts received."""
    report = reports[(rank, UNBIASED)]
    assert report["biased_routers"] == 0 and report["moe_layers"] == 2
    assert report["device_bytes"] == report["received_predicted_bytes"]


@pytest.mark.launch
@pytest.mark.parametrize("family", [*FAMILIES, UNBIASED])
@pytest.mark.parametrize("rank", [0, 1])
def test_loss_and_gradients_are_the_plain_runs_bitwise(reports, family, rank):
    report = reports[(rank, family)]
    assert report["loss_equal"] and report["grads_equal"]
