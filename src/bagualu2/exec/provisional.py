"""What a MoE gate may still change after its op ran, held until the gate settles it (graded deferred planning).

Under graded planning (``bagualu2.runtime.after_gate``) the gate may re-plan the whole MoE module, including what
the norm feeding the router and the router itself made before the gate was known. So, while a micro-batch is
recorded, those two ops run as *standby replays* (recorded like a re-run op, but taking no holds), and the router's
savings of those tensors are packed as :class:`Provisional` handles that hold the tensor, uncharged, until the
layer's gate. The full downgrade (both modes) may re-run them too: the module's re-run reads the router's outputs,
which no op may store (a traced model whose experts save only what they gather from them), so they run as standby
replays under ``downgrade="paper"`` as well. :func:`settle` then packs each under the plan in force, exactly as the pack hook would have, and
activates each standby replay if the plan re-runs it or a handle packed before the gate already reads it (it
then takes its holds), else forgets it. Under graded planning these ops always run as standby replays, also when
the plan in force before the gate re-runs them: the gate may drop them from the re-run set.
"""

from __future__ import annotations

from typing import Callable

import torch

from bagualu2.costmodel.graph import OpGraph
from bagualu2.costmodel.strategy import Strategy
from bagualu2.runtime import after_router_tensors, gate_free_tensors, unmade_after_router

from .packing import unpack
from .record import MicroBatchRecord


class Provisional:
    """A saving held as it is until its MoE layer's gate settles it (then packed as the plan in force says)."""

    __slots__ = ("tensor", "op", "name", "entry", "replay", "index", "inner")

    def __init__(self, tensor, op, name, entry, replay, index):
        self.tensor, self.op, self.name, self.entry, self.replay, self.index = tensor, op, name, entry, replay, index
        self.inner = None

    def unpack(self) -> torch.Tensor:
        if self.tensor is not None:
            raise RuntimeError(f"saving {self.op}/{self.name} was never settled by its MoE gate")
        return unpack(self.inner)


def standby_ops(graph: OpGraph, deferred) -> tuple[frozenset[str], frozenset[str]]:
    """With a deferred planner: the ops that run before a MoE gate and that a plan the gate switches to may
    re-run (the router and the norm feeding it: a re-run of the module reads the router's outputs, which no op
    may store), and, under graded planning, the tensors they make, which the gate may re-plan (held
    provisionally; with ``downgrade="paper"`` the gate changes only what is made after the router). Empty
    without a deferred planner."""
    if deferred is None:
        return frozenset(), frozenset()
    free = gate_free_tensors(graph) - unmade_after_router(graph)  # what no op makes is stored after the gate
    ops = frozenset(graph.tensors[t].producer for t in free - after_router_tensors(graph))
    if getattr(deferred, "mode", "paper") != "graded":
        return ops, frozenset()
    return ops, frozenset(t for t in free if graph.tensors[t].producer in ops)


def settle(record: MicroBatchRecord, graph: OpGraph, layer: int | None, apply: Callable) -> None:
    """Apply the plan in force to what ``layer`` (None: every layer) held for its gate: standby replays are
    activated if the plan re-runs them, else forgotten; provisional savings are packed by ``apply(record, tensor,
    entry, name, strategy, replay, index)`` (the executor's pack path)."""
    mine = (lambda op: True) if layer is None else (lambda op: graph.op(op).layer == layer)
    for replay in [r for r in record.standby if mine(r.op)]:
        record.standby.remove(replay)
        if replay.op in record.rerun or replay.pending > 0:  # re-run by the plan, or read by a handle already
            for stored, hold_name, dtype in replay.inactive:
                if stored.producer is not None:
                    stored.producer[0].pending += 1
                stored.hold()
                record.hold_name(hold_name, dtype)
            replay.inactive = None
        else:
            for entry in record.storages.values():
                if entry.producer is not None and entry.producer[0] is replay:
                    entry.producer = None
            for name in [n for n, made in record.producers.items() if made[0] is replay]:
                del record.producers[name]
            record.replays.remove(replay)
            replay.drop()
    for held in [h for h in record.provisional if mine(h.op)]:
        record.provisional.remove(held)
        strategy = record.strategies.get((held.op, held.name), Strategy.KEEP)
        record.applied[(held.op, held.name)] = strategy
        active = held.replay if held.replay is not None and held.replay.inactive is None \
            and held.replay in record.replays else None
        held.inner = apply(record, held.tensor, held.entry, held.name, strategy, active, held.index)
        held.tensor = None
    if layer is not None:
        record.gated.add(layer)
