"""Orders: how the stages of the four chains are interleaved at one scheduling point.

An order is a sequence of *groups*. With ``barriers=True`` (the DP and the baselines) the stages of a group start
together, at most one per chain, and the next group starts when all of them are done. With ``barriers=False``
(the exact CP-SAT schedule) every group is one stage and the sequence is only the issue order: a stage starts as
soon as its resource is free and its chain predecessor is done. Text form: groups separated by ``|``, stages
of a group by ``+``, a stage written as chain kind and index (``F0+B3|O0``); ``>`` instead of ``|`` marks an
order without barriers.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from ..costmodel.validate import require_int, shown
from .chains import CHAIN_KINDS

StageRef = tuple[str, int]
MAX_STAGE_INDEX = 2**31 - 1  # a chain of more stages is no point's (its ops would not fit int64 nanoseconds)
EMPTY = "empty"  # the order of a point with no stages


def _parse_ref(text: str) -> StageRef:
    text = text.strip()
    if (len(text) < 2 or text[0] not in CHAIN_KINDS or not (text[1:].isascii() and text[1:].isdigit())
            or len(text) > 2 + len(str(MAX_STAGE_INDEX))):
        raise ValueError(f"stage {shown(text)} must be a chain kind ({', '.join(CHAIN_KINDS)}) and an index in "
                         f"[0, {MAX_STAGE_INDEX}], e.g. F0")
    return text[0], int(text[1:])


@dataclass(frozen=True)
class Order:
    groups: tuple[tuple[StageRef, ...], ...]
    barriers: bool = True
    makespan_ns: int = 0
    solver: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.groups, (tuple, list)) or not all(isinstance(g, (tuple, list)) for g in self.groups):
            raise ValueError(f"order groups must be a tuple of groups of (chain kind, index) stages, got "
                             f"{self.groups!r:.80}")
        if not isinstance(self.barriers, bool):
            raise ValueError(f"barriers must be True or False, got {self.barriers!r}")
        object.__setattr__(self, "makespan_ns", require_int("makespan_ns", self.makespan_ns, 0))
        for group in self.groups:
            for ref in group:
                if not (isinstance(ref, (tuple, list)) and len(ref) == 2 and isinstance(ref[1], numbers.Integral)
                        and not isinstance(ref[1], bool)):
                    raise ValueError(f"a stage is (chain kind, integer index), got {ref!r}")
        if not isinstance(self.solver, str) or any(c in ",='\"" or not c.isprintable() for c in self.solver):
            raise ValueError(f"solver must be a name without ',', '=', quotes or control characters (its text form "
                             f"reads it back), got {self.solver!r}")
        if not self.groups:  # the empty order has one text form: with barriers
            object.__setattr__(self, "barriers", True)
        groups = tuple(tuple((str(k), int(i)) for k, i in group) for group in self.groups)
        for group in groups:
            if not group:
                raise ValueError("an order group must not be empty")
            kinds = [k for k, _ in group]
            if self.barriers and len(set(kinds)) != len(kinds):
                raise ValueError(f"a barrier group holds at most one stage per chain, got {group}")
            if not self.barriers and len(group) != 1:
                raise ValueError("an order without barriers lists one stage per group")
            for kind, index in group:
                if kind not in CHAIN_KINDS or not 0 <= index <= MAX_STAGE_INDEX:
                    raise ValueError(f"unknown stage {shown(kind)} {shown(index)}: a stage is a chain kind "
                                     f"({', '.join(CHAIN_KINDS)}) and an index in [0, {MAX_STAGE_INDEX}]")
        stages = [ref for group in groups for ref in group]
        if len(set(stages)) != len(stages):
            twice = next(f"{k}{i}" for k, i in stages if stages.count((k, i)) > 1)
            raise ValueError(f"stage {twice} appears twice in the order; each stage runs once")
        object.__setattr__(self, "groups", groups)

    @property
    def makespan_s(self) -> float:
        return self.makespan_ns * 1e-9

    def __str__(self) -> str:
        if not self.groups:
            return EMPTY
        if self.barriers:
            return "|".join("+".join(f"{k}{i}" for k, i in group) for group in self.groups)
        return ">".join(f"{k}{i}" for (k, i), in self.groups) + (">" if len(self.groups) == 1 else "")

    def __repr__(self) -> str:
        return f"Order('{self}', makespan_ns={self.makespan_ns}, solver='{self.solver}')"

    @classmethod
    def from_str(cls, text: str) -> "Order":
        """Parse ``str(order)`` or ``repr(order)``."""
        if not isinstance(text, str):
            raise ValueError(f"order text must be a string, got {type(text).__name__}")
        body, makespan, solver = text.strip(), 0, ""
        if body.startswith("Order(") and body.endswith(")"):
            inner = body[6:-1]
            parts = [p.strip() for p in inner.split(",")]
            body = parts[0].strip("'\"")
            seen = set()
            for part in parts[1:]:
                key, _, value = part.partition("=")
                key = key.strip()
                if key in seen:
                    raise ValueError(f"order field {key!r} is given twice")
                seen.add(key)
                if key == "makespan_ns":
                    value = value.strip()
                    if not (value.isascii() and value.isdigit()):
                        raise ValueError(f"makespan_ns must be an integer >= 0, got {value!r}")
                    makespan = int(value)
                elif key == "solver":
                    solver = value.strip().strip("'\"")
                else:
                    raise ValueError(f"unknown order field {key!r}")
        if not body:
            raise ValueError("order text is empty")
        if body == EMPTY:
            return cls((), makespan_ns=makespan, solver=solver)
        barriers = ">" not in body
        if not barriers and "|" in body:
            raise ValueError("an order uses either '|' (barriers) or '>' (issue order), not both")
        parts = body.split("|" if barriers else ">")
        if not barriers and len(parts) == 2 and not parts[1].strip():
            parts = parts[:1]  # "F0>": an issue order of one stage
        if not all(part.strip() for part in parts):
            raise ValueError(f"order text has an empty group: {body!r:.80}")
        groups = tuple(tuple(_parse_ref(ref) for ref in group.split("+")) for group in parts)
        return cls(groups, barriers=barriers, makespan_ns=makespan, solver=solver)
