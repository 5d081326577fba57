"""Shared by the exec tests: one micro-batch of the reference model's layers (instrumented from outside) under a
plan, then backward."""

from __future__ import annotations

import torch

from bagualu2.exec import apply_plan, flop_counter
from reference_trainer.instrumented import instrument_reference
from reference_trainer.model import GLMMoEModel


def run_plan(config, graph, plan, *, seed: int = 0, deferred=None, gate: bool = True):
    """``(record or None, loss, {name: grad} incl. "input", backward FLOPs)`` of one micro-batch (``plan=None``:
    no executor at all; ``deferred``: a DeferredPlanner consulted after every MoE gate; ``gate=False``: the
    instrumented model never reports its gates)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one reduction order for every run compared bitwise, whatever a test set before
    try:
        return _run(config, graph, plan, seed, deferred, gate)
    finally:
        torch.set_num_threads(threads)


def _run(config, graph, plan, seed, deferred, gate):
    torch.manual_seed(seed)
    model = GLMMoEModel(config)
    instrument_reference(model, gate=gate)
    x = torch.randn(config.micro_batch_size, config.seq_length, config.hidden_size,
                    dtype=next(model.parameters()).dtype, requires_grad=True)
    record = None
    if plan is None:
        out = model.forward_layers(x)
    else:
        executor = apply_plan(graph, plan, exclude=[model], deferred=deferred)
        with executor.micro_batch("mb0") as record:
            out = model.forward_layers(x)
    loss = out.float().pow(2).mean()
    with flop_counter() as counter:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads["input"] = x.grad.clone()
    return record, loss.detach(), grads, counter.get_total_flops()
