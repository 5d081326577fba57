"""Predicted vs measured activation bytes of one micro-batch.

    python -m reference_trainer.measure --preset NAME --imbalance R --plan SPEC [--seq-length N] [--seed S] --json

Single process (EP=1): builds :class:`~reference_trainer.model.GLMMoEModel` from the preset, runs the forward of
all its transformer layers on one micro-batch of random ``(b, s, h)`` hidden states under
:func:`bagualu2.exec.apply_plan` (model parameters and buffers excluded; embedding and loss are not part
of the measurement) and compares with ``costmodel.evaluate`` of the graph of the same layers (``ParallelConfig()``:
one stage holding every layer, EP=1). With EP=1 every expert is local, so the routed tokens are exactly ``T*K``
whatever the router picks: the imbalance rate is 1.0 by construction and other values are refused.
``--plan`` takes the plan text form (``none``, ``core_attn=OFFLOAD,expert_fc1=QUANTIZE``,
``L0.qkv/L0.norm1_out=OFFLOAD``); device bytes (kept storages + FP8 copies) are compared with
``evaluate(graph, plan).activation_bytes`` and host bytes with ``.host_bytes``. Plans that resolve any saving to
RECOMPUTE are refused (not implemented yet). User errors are one line on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, NoReturn, Sequence

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (argparse prints the usage too)
        self.exit(EXIT_USAGE, f"error: {' '.join(message.split())}\n")


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    raise SystemExit(EXIT_USAGE)


def measure(preset: str, *, imbalance: float = 1.0, plan: str = "none", seq_length: int | None = None,
            seed: int = 0) -> dict[str, Any]:
    """Run one micro-batch and return the JSON-able record (``ValueError`` on an unsupported request)."""
    import torch

    from bagualu2.costmodel import ParallelConfig, Plan, build_graph, check_imbalance, evaluate, presets
    from bagualu2.exec import apply_plan

    from .model import TORCH_DTYPES, GLMMoEModel

    try:
        imbalance = check_imbalance(imbalance)
    except ValueError as exc:
        raise ValueError(f"--imbalance: {exc}") from None
    if imbalance != 1.0:
        raise ValueError(f"--imbalance: a single process (EP=1) keeps every expert local, so the imbalance rate is "
                         f"1.0; got {imbalance:g} (use torchrun with --ep N for R > 1)")
    try:
        plan_obj = Plan.from_str(plan)
    except ValueError as exc:
        raise ValueError(f"--plan: {exc}") from None
    model_config, _ = presets.model(preset)
    if seq_length is not None:
        model_config = model_config.replace(seq_length=seq_length)
    parallel = ParallelConfig()  # one stage with every layer, EP=1
    graph = build_graph(model_config, parallel, presets.hardware("cpu"), imbalance=imbalance)
    try:
        cost = evaluate(graph, plan_obj)
        apply_plan(graph, plan_obj)  # refuses RECOMPUTE before anything runs
    except ValueError as exc:
        raise ValueError(f"--plan: {exc}") from None
    predicted = cost.activation_bytes

    torch.manual_seed(seed)
    model = GLMMoEModel(model_config)
    dtype = TORCH_DTYPES[model_config.dtype]
    x = torch.randn(model_config.micro_batch_size, model_config.seq_length, model_config.hidden_size,
                    dtype=dtype, requires_grad=True)
    executor = apply_plan(graph, plan_obj, exclude=[model])
    with executor.micro_batch("mb0") as record:
        out = model.forward_layers(x)
    measured = record.device_bytes
    out.float().pow(2).mean().backward()  # the graph is complete and runs backward (unpacking every saving)
    executor.release("mb0")
    return {
        "preset": preset, "seq_length": model_config.seq_length,
        "micro_batch_size": model_config.micro_batch_size, "layers": list(graph.layers), "ep": 1,
        "imbalance": imbalance, "plan": str(plan_obj),
        "predicted_bytes": int(predicted), "measured_bytes": int(measured),
        "rel_error": (measured - predicted) / predicted,
        "predicted_host_bytes": int(cost.host_bytes), "measured_host_bytes": int(record.host_bytes),
        "unknown_bytes": int(record.unknown_bytes), "fp8_scale_bytes": int(record.scale_bytes),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="python -m reference_trainer.measure", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True, help="model preset (bagualu2 presets list)")
    parser.add_argument("--imbalance", type=float, default=1.0, help="max/mean device load R (1.0 here)")
    parser.add_argument("--plan", default="none",
                        help="'none' or KEY=STRATEGY,... with KEY an op kind or OP/TENSOR and STRATEGY KEEP, OFFLOAD "
                        "or QUANTIZE (RECOMPUTE: not yet)")
    parser.add_argument("--seq-length", type=int, default=None, help="override the preset's sequence length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.seq_length is not None and args.seq_length < 1:
        _fail(f"--seq-length: must be an integer >= 1, got {args.seq_length}")
    try:
        record = measure(args.preset, imbalance=args.imbalance, plan=args.plan, seq_length=args.seq_length,
                         seed=args.seed)
    except ValueError as exc:
        message = str(exc)
        if not message.startswith("--"):
            message = f"--preset: {message}"  # the only other library call that raises: presets.model
        _fail(message)
    if args.json:
        print(json.dumps(record))
    else:
        print(f"{record['preset']} s={record['seq_length']}: predicted {record['predicted_bytes']} B, "
              f"measured {record['measured_bytes']} B, error {100 * record['rel_error']:+.3f}%; host: predicted "
              f"{record['predicted_host_bytes']} B, measured {record['measured_host_bytes']} B (plan {record['plan']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
