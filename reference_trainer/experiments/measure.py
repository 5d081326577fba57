"""Predicted vs measured activation bytes of one micro-batch.

    python -m reference_trainer.experiments.measure --preset NAME --imbalance R --plan SPEC [--seq-length N] [--seed S] --json

Single process (EP=1): builds :class:`~reference_trainer.model.GLMMoEModel` from the preset, runs the forward of
all its transformer layers on one micro-batch of random ``(b, s, h)`` hidden states under
:func:`bagualu2.exec.apply_plan` (model parameters and buffers excluded; embedding and loss are not part
of the measurement) and compares with ``costmodel.evaluate`` of the graph of the same layers (``ParallelConfig()``:
one stage holding every layer, EP=1). With EP=1 every expert is local, so the routed tokens are exactly ``T*K``
whatever the router picks: the imbalance rate is 1.0 by construction and other values are refused.
``--plan`` takes the plan text form (``none``, ``core_attn=OFFLOAD,expert_fc1=QUANTIZE``,
``L0.qkv/L0.norm1_out=OFFLOAD``); device bytes (kept storages + FP8 copies) are compared with
``evaluate(graph, plan).activation_bytes`` and host bytes with ``.host_bytes``. RECOMPUTE savings are not stored;
backward re-runs their producers (``replayed_ops``: the ops that ran again, ``predicted_recompute_flops``: the
cost model's FLOPs of the re-run closure). User errors are one line on stderr with exit code 2.

Expert parallelism::

    torchrun --nproc_per_node=N -m reference_trainer.experiments.measure --preset NAME --ep N --imbalance R --plan SPEC --json

With ``WORLD_SIZE > 1`` every rank joins a gloo process group (the EP group is the world; its size must equal
``--ep``) and holds ``E/N`` experts. The imbalance ``1 <= R <= N`` is realised on rank 0 by biasing every rank's
routers (:func:`reference_trainer.routing.imbalance_picks`): each token of source rank ``i`` puts exactly ``j_i`` of
its ``K`` picks on rank 0's experts with ``sum_i j_i = round(R*K)``, so rank 0 receives ``R*T*K`` routed copies
per MoE layer, exactly when ``R*K`` is an integer (else ``R`` is rounded to the nearest multiple of ``1/K``).
Rank 0 counts the copies it actually receives; ``realised_imbalance`` = received / ``(T*K)`` (the same in every
MoE layer, else an error). The prediction is ``evaluate`` of ``build_graph(model, ParallelConfig(dp=N, ep=N),
cpu, imbalance=realised)`` (``dp=N``: EP must divide ``dp*tp*cp``). Every rank runs forward and backward (the
backward all-to-alls need every rank); rank 0 measures and prints, the other ranks print nothing.
``grads_finite`` reports whether rank 0's input and parameter gradients are all finite.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn, Sequence

from .args import EXIT_USAGE, OneLineParser


def _fail(message: str, quiet: bool = False) -> NoReturn:
    if not quiet:
        sys.stderr.write(f"error: {' '.join(message.split())}\n")
    raise SystemExit(EXIT_USAGE)


def check_host_memory(model_config, activation_bytes: int, *, processes: int = 1, option: str = "--preset") -> None:
    """``ValueError`` (one line) when the model's weights, gradients and one micro-batch's activations, in every
    process, would not fit this machine's available memory: a clear error instead of the kernel's OOM killer."""
    import os

    from bagualu2.costmodel.graph import ITEM_BYTES
    from bagualu2.costmodel.memory import num_parameters

    total, _ = num_parameters(model_config)
    need = processes * (2 * total * ITEM_BYTES[model_config.dtype] + 2 * activation_bytes)
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not on Linux: no check
        return
    if need > 0.8 * available:
        raise ValueError(f"{option}: the reference model needs about {need / 2**30:.1f} GiB here ({total:,} "
                         f"parameters with gradients and activations, {processes} process(es)) but "
                         f"{available / 2**30:.1f} GiB are available; use tiny-moe / tiny-dense or a shorter "
                         "--seq-length")


def measure(preset: str, *, imbalance: float = 1.0, plan: str = "none", seq_length: int | None = None,
            seed: int = 0, ep: int = 1, budget_bytes: int | None = None, dtype: str | None = None) -> dict[str, Any]:
    """Run one micro-batch and return the JSON-able record (``ValueError`` on an unsupported request).

    ``ep > 1`` needs an initialised default process group of ``ep`` ranks (the EP group); call it on every rank.
    ``budget_bytes``: deferred planning with this budget (a :class:`~bagualu2.exec.DeferredPlanner` after every
    gate) and a tracker cap of the same size on rank 0 (``ActivationOutOfMemoryError`` when exceeded).
    """
    import hashlib

    import torch

    from bagualu2.costmodel import (ParallelConfig, Plan, build_graph, check_imbalance, evaluate, imbalance_limit,
                                    presets)
    from bagualu2.costmodel.build import limit_text
    from bagualu2.exec import ActivationTracker, DeferredPlanner, apply_plan

    from ..instrumented import instrument_reference
    from ..model import TORCH_DTYPES, GLMMoEModel
    from ..routing import bias_router_towards, imbalance_picks, record_routing, routing_stats

    try:
        imbalance = check_imbalance(imbalance)
    except ValueError as exc:
        raise ValueError(f"--imbalance: {exc}") from None
    requested = imbalance
    if ep == 1 and imbalance != 1.0:
        raise ValueError(f"--imbalance: a single process (EP=1) keeps every expert local, so the imbalance rate is "
                         f"1.0; got {imbalance:g} (use torchrun with --ep N for R > 1)")
    if imbalance > ep:
        raise ValueError(f"--imbalance: with --ep {ep} rank 0 receives at most {ep} x the mean routed tokens; "
                         f"got {imbalance:g}")
    try:
        plan_obj = Plan.from_str(plan)
    except ValueError as exc:
        raise ValueError(f"--plan: {exc}") from None
    model_config, _ = presets.model(preset)
    if seq_length is not None:
        model_config = model_config.replace(seq_length=seq_length)
    if dtype is not None:
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"--dtype: must be one of {', '.join(TORCH_DTYPES)}, got {dtype!r}")
        model_config = model_config.replace(dtype=dtype)
    rank, group = 0, None
    picks: list[int] = []
    if ep > 1:
        if not model_config.is_moe:
            raise ValueError(f"--ep: a dense model has no experts to distribute; got --ep {ep}")
        if model_config.num_experts % ep:
            raise ValueError(f"--ep: num_experts={model_config.num_experts} must be divisible by ep={ep}")
        limit = imbalance_limit(model_config, ParallelConfig(dp=ep, ep=ep))
        if imbalance > limit:
            raise ValueError(f"--imbalance: with --ep {ep}, {model_config.num_experts} experts and top-"
                             f"{model_config.top_k} routing, rank 0 receives at most {limit_text(limit)} x the mean "
                             f"routed tokens; got {imbalance:g}")
        picks = imbalance_picks(imbalance, ep, model_config.top_k)
        if max(picks) > model_config.num_experts // ep:
            raise ValueError(f"--imbalance: {imbalance:g} needs {max(picks)} picks per token on rank 0, which holds "
                             f"only {model_config.num_experts // ep} experts")
        imbalance = sum(picks) / model_config.top_k  # what the bias realises (R rounded to a multiple of 1/K)
        group = torch.distributed.group.WORLD
        rank = torch.distributed.get_rank()
    # one stage with every layer; EP must divide dp*tp*cp, so dp = ep
    parallel = ParallelConfig(dp=ep, ep=ep)
    hardware = presets.hardware("cpu")
    graph = build_graph(model_config, parallel, hardware, imbalance=imbalance)
    try:
        evaluate(graph, plan_obj)
    except ValueError as exc:
        raise ValueError(f"--plan: {exc}") from None
    check_host_memory(model_config, graph.unmitigated_bytes, processes=ep)

    torch.manual_seed(seed)
    model = GLMMoEModel(model_config, ep_group=group)  # the same weights on every rank (experts: its slice)
    instrument_reference(model)  # the exec layer's hooks on its op modules, the gates reported
    record_routing(model)  # the copies each local expert receives
    if ep > 1:
        bias_router_towards(model, 0, picks[rank])
        torch.manual_seed(seed + rank)  # rank 0 draws the same input as EP=1, the others their own
    dtype = TORCH_DTYPES[model_config.dtype]
    x = torch.randn(model_config.micro_batch_size, model_config.seq_length, model_config.hidden_size,
                    dtype=dtype, requires_grad=True)
    deferred = tracker = None
    if budget_bytes is not None:
        deferred = DeferredPlanner(model_config, parallel, hardware, budget_bytes=budget_bytes)
        tracker = ActivationTracker(cap_bytes=budget_bytes if rank == 0 else None, exclude=[model])
    executor = apply_plan(graph, plan_obj, exclude=[model], tracker=tracker, deferred=deferred)
    with executor.micro_batch("mb0") as record:
        out = model.forward_layers(x)
    measured = record.device_bytes
    received = [int(routing_stats(moe).received.sum()) for moe in model.moe_layers()]
    out.float().pow(2).mean().backward()  # the graph is complete and runs backward (unpacking every saving)
    replayed = sorted({replay.op for replay in record.replays if replay.runs})
    executor.release("mb0")
    grads = [x.grad] + [p.grad for p in model.parameters() if p.grad is not None]
    grads_finite = all(bool(torch.isfinite(g).all()) for g in grads)
    digest = hashlib.sha256()
    for g in grads:
        digest.update(g.detach().contiguous().view(torch.uint8).numpy().tobytes())
    effective = record.plan  # the plan in force at the end of the forward (after any deferred downgrade)
    if rank != 0:
        return {}  # measured and reported on rank 0
    record_fields: dict[str, Any] = {}
    if ep > 1:
        routed_mean = model_config.seq_length * model_config.micro_batch_size * model_config.top_k
        realised = sorted({r / routed_mean for r in received})
        if len(realised) != 1:
            raise RuntimeError(f"rank 0 received different routed tokens per MoE layer: {received}")
        if realised[0] != imbalance:  # predict what was realised
            graph = build_graph(model_config, parallel, hardware, imbalance=realised[0])
        record_fields = {"requested_imbalance": float(requested), "realised_imbalance": realised[0],
                         "picks_per_rank": picks}
    cost = evaluate(graph, effective)
    predicted = cost.activation_bytes
    if budget_bytes is not None:
        planned_bytes = evaluate(graph, plan_obj).activation_bytes  # what the plan made before the gate would keep
        record_fields.update(budget_bytes=budget_bytes, downgraded_layers=list(record.downgraded),
                             planned_bytes=int(planned_bytes), effective_plan=str(effective),
                             peak_bytes=int(executor.tracker.peak_bytes))
    return {
        "preset": preset, "seq_length": model_config.seq_length, "dtype": model_config.dtype,
        "micro_batch_size": model_config.micro_batch_size, "layers": list(graph.layers), "ep": ep,
        "imbalance": imbalance, "plan": str(plan_obj),
        "predicted_bytes": int(predicted), "measured_bytes": int(measured),
        "rel_error": (measured - predicted) / predicted, **record_fields,
        "received_tokens": received, "grads_finite": grads_finite, "grads_sha256": digest.hexdigest(),
        "predicted_host_bytes": int(cost.host_bytes), "measured_host_bytes": int(record.host_bytes),
        "unknown_bytes": int(record.unknown_bytes), "fp8_scale_bytes": int(record.scale_bytes),
        "predicted_recompute_flops": int(cost.recompute_flops), "replayed_ops": replayed,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m reference_trainer.experiments.measure", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True, help="model preset (bagualu2 presets list)")
    parser.add_argument("--imbalance", type=float, default=1.0,
                        help="max/mean device load R realised on rank 0 (1 <= R <= --ep; 1.0 in a single process)")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel size; > 1 under torchrun --nproc_per_node=EP (gloo)")
    parser.add_argument("--plan", default="none",
                        help="'none' or KEY=STRATEGY,... with KEY an op kind or OP/TENSOR and STRATEGY KEEP, "
                        "RECOMPUTE, OFFLOAD or QUANTIZE")
    parser.add_argument("--seq-length", type=int, default=None, help="override the preset's sequence length")
    parser.add_argument("--budget-bytes", type=int, default=None,
                        help="deferred planning: downgrade a MoE module to full recompute after its gate when the "
                        "plan would exceed this budget; rank 0's tracker is capped at it")
    parser.add_argument("--dtype", default=None, help="override the preset's dtype (fp32, bf16, fp16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    import os

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    quiet = rank != 0  # only rank 0 reports (errors too: every rank fails the same way)
    if args.seq_length is not None and args.seq_length < 1:
        _fail(f"--seq-length: must be an integer >= 1, got {args.seq_length}", quiet)
    if args.budget_bytes is not None and args.budget_bytes < 0:
        _fail(f"--budget-bytes: must be an integer >= 0, got {args.budget_bytes}", quiet)
    if args.ep < 1:
        _fail(f"--ep: must be an integer >= 1, got {args.ep}", quiet)
    if not 0 <= args.seed < 2**63 - 1024:  # torch.manual_seed takes a 64-bit seed; EP ranks add their rank
        _fail(f"--seed: must be an integer in [0, 2**63 - 1024), got {args.seed}", quiet)
    if world != args.ep:
        _fail(f"--ep: {args.ep} needs exactly {args.ep} processes (torchrun --nproc_per_node={args.ep}); "
              f"running {world}", quiet)
    import torch  # after the argument checks: a usage error does not wait for torch

    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    try:
        try:
            record = measure(args.preset, imbalance=args.imbalance, plan=args.plan, seq_length=args.seq_length,
                             seed=args.seed, ep=args.ep, budget_bytes=args.budget_bytes,
                             dtype=args.dtype)
            if world > 1:  # nobody tears gloo down while a peer still talks to it (a C++ terminate at exit)
                dist.barrier()
        except ValueError as exc:
            message = str(exc)
            if not message.startswith("--"):
                message = f"--preset: {message}"  # the only other library call that raises: presets.model
            _fail(message, quiet)
        except torch.OutOfMemoryError as exc:  # ActivationOutOfMemoryError over --budget-bytes
            if not quiet:
                sys.stderr.write(f"error: out of memory: {' '.join(str(exc).split())}\n")
            raise SystemExit(1) from None
    finally:
        if world > 1:
            dist.destroy_process_group()
    if quiet:
        return 0
    if args.json:
        print(json.dumps(record))
    else:
        print(f"{record['preset']} s={record['seq_length']}: predicted {record['predicted_bytes']} B, "
              f"measured {record['measured_bytes']} B, error {100 * record['rel_error']:+.3f}%; host: predicted "
              f"{record['predicted_host_bytes']} B, measured {record['measured_host_bytes']} B (plan {record['plan']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
