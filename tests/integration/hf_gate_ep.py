"""Run under torchrun (2 ranks, gloo): transformers' expert parallelism (all-to-all dispatch, experts carved in
two) on tiny random models of the families named on the command line, instrumented by ``integrations.hf``.

Per family: trace a balanced micro-batch; pick the plan for a budget that every rank's unmitigated micro-batch
fits at imbalance 1; then bias every router that has an ``e_score_correction_bias`` (the families' own
load-balancing bias) toward rank 0's experts, so rank 0's experts receive every routed copy (imbalance 2) and
rank 1's none (a family without one routes as it does). Run the
plain model and the planned one (the deferred planner on the traced graph, every re-run verified); report losses,
gradient equality, the gates' decisions and the bytes kept, one ``REPORT`` JSON line per rank.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bagualu2.costmodel import evaluate, presets  # noqa: E402
from bagualu2.costmodel.rescale import at_imbalance  # noqa: E402
from bagualu2.exec import DeferredPlanner, apply_plan  # noqa: E402
from bagualu2.integrations import hf  # noqa: E402
from bagualu2.mitigation import greedy  # noqa: E402
from hf_models import tiny  # noqa: E402

BIAS = 1.0  # above every sigmoid score: the biased experts win every top-k pick


def expert_parallel(model, mesh) -> None:
    """transformers' own expert parallelism on ``model``'s inner model, as ``from_pretrained`` applies it."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    inner = model.model
    names = [n for n, _ in inner.named_modules()] + [n for n, _ in inner.named_parameters()]
    plan = {}
    for pattern, style in model.config.base_model_ep_plan.items():
        regex = re.escape(pattern).replace(r"\*", r"\d+")
        plan.update({name: style for name in names if re.fullmatch(regex, name)})
    apply_expert_parallelism(inner, mesh["ep"], mesh["tp"], plan, ep_implementation="all_to_all")


def grads(model) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        g = p.grad
        if g is not None and hasattr(g, "to_local"):
            g = g.to_local()
        out.append(torch.zeros(()) if g is None else g.clone())
    return out


def step(model, ids, instrumented=None, plan=None, planner=None):
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    if instrumented is None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), grads(model), None
    executor = apply_plan(instrumented, plan, deferred=planner, verify=True)
    with executor.micro_batch("mb") as record:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    executor.release("mb")
    return loss.detach(), grads(model), record


def family_report(family: str, rank: int, mesh) -> dict:
    model, ids = tiny(family, seed=0, batch=4)
    ids = ids[2 * rank:2 * rank + 2]  # each rank its own micro-batch
    expert_parallel(model, mesh)
    instrumented = hf.instrument(model)
    graph = instrumented.trace_graph(input_ids=ids, labels=ids, hardware=presets.hardware("cpu"),
                                     loss=lambda out: out.loss)
    balanced = at_imbalance(graph, 1.0)
    budget = balanced.unmitigated_bytes
    plan = greedy.solve(balanced, budget).plan
    routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    for router in routers:
        with torch.no_grad():
            router.e_score_correction_bias[: router.e_score_correction_bias.numel() // 2] += BIAS
    plain_loss, plain_grads, _ = step(model, ids)
    planner = DeferredPlanner.for_graph(graph, budget_bytes=budget)
    loss, planned_grads, record = step(model, ids, instrumented, plan, planner)
    received = dict(record.received_tokens)
    imbalance = max(received.values()) / graph.mean_routed_tokens
    predicted = (evaluate(at_imbalance(graph, imbalance), record.plan).activation_bytes
                 if imbalance >= 1 else None)
    return {
        "family": family,
        "moe_layers": len(graph.layer_routed_tokens),
        "biased_routers": len(routers),
        "budget_bytes": budget,
        "mean_routed_tokens": graph.mean_routed_tokens,
        "received": {str(k): v for k, v in received.items()},
        "imbalance": imbalance,
        "plan_in_force_fits_balanced": evaluate(balanced, plan).activation_bytes <= budget,
        "plan_in_force_at_imbalance_bytes": (evaluate(at_imbalance(graph, imbalance), plan).activation_bytes
                                             if imbalance >= 1 else None),
        "downgraded": list(record.downgraded),
        "decisions": [list(d) for d in planner.decisions],
        "device_bytes": record.device_bytes,
        # per layer, the copies it received: exact for every layer whose experts received any
        "received_predicted_bytes": evaluate(graph, record.plan).activation_bytes_received(graph, received),
        "predicted_bytes": predicted,
        "loss_equal": bool(torch.equal(loss, plain_loss)),
        "grads_equal": all(torch.equal(a, b) for a, b in zip(planned_grads, plain_grads)),
    }


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("tp", "ep"))
    reports = [family_report(family, rank, mesh) for family in sys.argv[1:]]
    dist.barrier()
    sys.stdout.write("REPORT " + json.dumps({"rank": rank, "families": reports}) + "\n")
    sys.stdout.flush()
    os._exit(0)  # the report is out: skip interpreter teardown, whose gloo thread destructors can abort under load


if __name__ == "__main__":
    main()
