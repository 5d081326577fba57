"""The reference model instrumented from outside: :func:`instrument_reference` puts the exec layer's hooks on the
modules :data:`~reference_trainer.model.OP_MAP` names (the model itself imports nothing of ``bagualu2.exec``).

    model = GLMMoEModel(config, ep_group=group)
    instrument_reference(model)                       # hooks on its op modules; or on a module holding its layers
    executor = apply_plan(build_graph(...), plan, exclude=[model])
    with executor.micro_batch("mb0"):
        out = model.forward_layers(x)                 # savings named by op, plan applied, gates reported

The gate callback reports, after every router, the routed copies this rank's experts receive, the EP group and
the most copies any rank of the group receives (:meth:`~reference_trainer.model.MoE.routing_counts`: the one
all-gather the forward uses too), so the deferred planner decides as the ranks agree.
"""

from __future__ import annotations

import fnmatch

import torch

from bagualu2.exec import InstrumentedModel, instrument, overlap_point

from .model import OP_MAP, MoE


def reference_op_map(module: torch.nn.Module) -> dict[str, str]:
    """:data:`OP_MAP` restricted to the patterns that match a module of ``module`` (a pipeline stage may hold only
    dense or only MoE layers)."""
    paths = [path for path, _ in module.named_modules() if path]
    return {pattern: label for pattern, label in OP_MAP.items()
            if any(fnmatch.fnmatchcase(path, pattern) for path in paths)}


def instrument_reference(module: torch.nn.Module, *, gate: bool = True) -> InstrumentedModel:
    """Instrument a :class:`~reference_trainer.model.GLMMoEModel` (or a module holding some of its layers as
    ``layers.<global index>``, such as a pipeline chunk) with its op map and the deferred planner's gate
    callback (``gate=False``: a model that never reports its gates). Instrument each module once (hooks add
    up)."""
    owners = {moe.gate: moe for moe in module.modules() if isinstance(moe, MoE)}
    for moe in owners.values():  # fused points overlap the exchanges with the other micro-batch's compute
        moe.dispatch.layout.overlap_point = overlap_point

    def report(router: torch.nn.Module, inputs, output):
        moe = owners[router]
        _, _, recv, most = moe.routing_counts(output[1])
        return int(recv.sum()), moe.ep_group, most

    return instrument(module, reference_op_map(module), gate=report if gate else None)
