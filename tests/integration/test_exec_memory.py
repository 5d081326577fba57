"""The executor does not keep a micro-batch's tensors alive longer than autograd would.

Saved activations (kept tensors, FP8 copies) are freed by autograd as backward proceeds, not held by the executor's
record; after ``release`` the record refers to none of them; re-run caches are dropped once used (also for ops that
are identities at EP=1); an offloaded storage is copied back once, however many consumers read it. Found by review.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from bagualu2.costmodel import ParallelConfig, build_graph, presets
from bagualu2.exec import apply_plan
from bagualu2.exec.flops import _attention_formula
from reference_trainer.instrumented import instrument_reference
from reference_trainer.model import GLMMoEModel

CONFIG = presets.model("tiny-moe")[0].replace(seq_length=16)
GRAPH = build_graph(CONFIG, ParallelConfig(), presets.hardware("cpu"))
FULL = ",".join(f"{op}/{tensor}=RECOMPUTE" for op, tensor in GRAPH.decisions)


def _forward(plan):
    torch.manual_seed(0)
    model = GLMMoEModel(CONFIG)
    instrument_reference(model)
    executor = apply_plan(GRAPH, plan, exclude=[model])
    x = torch.randn(CONFIG.micro_batch_size, CONFIG.seq_length, CONFIG.hidden_size, requires_grad=True)
    saved = []
    original = executor._keep

    def keep(record, tensor, entry):  # watch every storage the plan keeps
        saved.append(StorageWeakRef(tensor.untyped_storage()))
        return original(record, tensor, entry)

    executor._keep = keep
    with executor.micro_batch("mb") as record:
        out = model.forward_layers(x)
    return executor, record, out, saved


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["none", "expert_fc1=QUANTIZE,core_attn=RECOMPUTE", FULL])
def test_saved_tensors_are_freed_by_backward_not_held_by_the_record(plan):
    executor, record, out, saved = _forward(plan)
    assert any(not ref.expired() for ref in saved)
    out.pow(2).mean().backward()
    del out
    gc.collect()
    alive = [ref for ref in saved if not ref.expired()]
    assert not alive, f"{len(alive)} kept storages outlive backward"
    assert all(replay._outputs is None and replay._saves is None for replay in record.replays)
    executor.release("mb")
    assert not record.named and not record.replays and not record.producers


def test_an_offloaded_storage_is_copied_back_once():
    plan = ",".join(f"{op}/{tensor}=OFFLOAD" for op, tensor in GRAPH.decisions)
    executor, record, out, _ = _forward(plan)
    copies = len(record.host_copies)
    consumers = sum(copy.users for copy in record.host_copies)
    assert consumers > copies  # some storages are offloaded by several consumers
    out.pow(2).mean().backward()
    assert executor.engine.num_offloads == copies
    assert executor.engine.num_reloads == copies
    executor.release("mb")


def test_attention_flop_formula_reads_is_causal_per_kernel():
    shape = (1, 2, 8, 4)
    full = 4 * 2 * 8 * 8 * 4
    flash = _attention_formula(1)  # (dropout_p, is_causal)
    efficient = _attention_formula(3)  # (attn_bias, compute_log_sumexp, dropout_p, is_causal)
    assert flash(shape, shape, shape, 0.0, True) == full // 2
    assert flash(shape, shape, shape, 0.0, False) == full
    assert efficient(shape, shape, shape, None, True, 0.0, False) == full  # compute_lse is not is_causal
    assert efficient(shape, shape, shape, None, False, 0.0, True) == full // 2
    assert efficient(shape, shape, shape, None, True, 0.0, is_causal=True) == full // 2


@pytest.mark.parametrize("plan", ["none", "expert_act=RECOMPUTE", "core_attn=OFFLOAD,expert_fc1=QUANTIZE"])
def test_an_abandoned_forward_frees_everything(plan):
    """No backward (e.g. the forward hit the memory cap): dropping the output frees every saved tensor."""
    executor, record, out, saved = _forward(plan)
    executor.release("mb")
    del out, record
    gc.collect()
    assert saved and all(ref.expired() for ref in saved)


def test_the_cap_error_leaves_nothing_alive():
    from bagualu2.exec import ActivationOutOfMemoryError, ActivationTracker

    torch.manual_seed(0)
    model = GLMMoEModel(CONFIG)
    instrument_reference(model)
    tracker = ActivationTracker(cap_bytes=GRAPH.unmitigated_bytes // 2, exclude=[model])
    executor = apply_plan(GRAPH, "none", tracker=tracker)
    saved = []
    original = executor._keep
    executor._keep = lambda record, tensor, entry: (saved.append(StorageWeakRef(tensor.untyped_storage())),
                                                    original(record, tensor, entry))[1]
    x = torch.randn(CONFIG.micro_batch_size, CONFIG.seq_length, CONFIG.hidden_size, requires_grad=True)
    raised = False
    try:
        with executor.micro_batch("mb"):
            model.forward_layers(x)
    except ActivationOutOfMemoryError:  # (the exception's traceback holds the frames' tensors until it is gone)
        raised = True
    assert raised
    del x  # the block input is the caller's
    gc.collect()
    assert saved and all(ref.expired() for ref in saved)
    assert tracker.in_flight_bytes == 0
