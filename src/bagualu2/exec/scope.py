"""The op scope an instrumented module opens while its forward runs (shared by the hooks, the tracer and the
executor's slot naming): the innermost mapped module's :class:`Frame`, and the flags that silence the hooks."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

#: The innermost mapped module whose forward is running (None outside every mapped module).
FRAME: ContextVar["Frame | None"] = ContextVar("bagualu2_frame", default=None)
#: True while a replay re-runs a module's forward in backward: the hooks stay silent (no frames, no gates).
REPLAYING: ContextVar[bool] = ContextVar("bagualu2_replaying", default=False)
#: True while the model makes the rows of its routed experts (:func:`bagualu2.exec.routed`): the tensors first seen
#: then hold one row per routed token copy the experts received (a traced graph rescales them with the imbalance).
ROUTED: ContextVar[bool] = ContextVar("bagualu2_routed", default=False)
#: The trace recorder of :meth:`InstrumentedModel.trace_graph` while it runs (None otherwise).
TRACER: ContextVar[Any] = ContextVar("bagualu2_tracer", default=None)


@dataclass(frozen=True)
class OpBinding:
    """One mapped module: its ``named_modules()`` path, the op-map pattern that matched it, the op label and
    cost-model kind, the layer (first integer in the path; 0 without one) and the graph op name."""

    path: str
    pattern: str
    label: str
    kind: str
    layer: int
    op: str


class Frame:
    """One call of a mapped module: ``call`` counts the module's calls in this micro-batch (or trace), ``slot``
    the savings made so far while it is the innermost mapped module; ``replay`` is set while it is recorded as a
    replay."""

    __slots__ = ("binding", "parent", "call", "slot", "tokens", "replay", "state", "inputs")

    def __init__(self, binding: OpBinding, parent: "Frame | None", call: int = 0):
        self.binding, self.parent, self.call = binding, parent, call
        self.slot = 0
        self.tokens = None
        self.replay = None
        self.state = None  # the tracer's per-call record
        self.inputs: frozenset = frozenset()  # storage keys of the call's tensor arguments (a micro-batch's)
