"""The plan type: a mitigation strategy per (op, saved tensor), plus whole-kind policies.

A plan is printable data. Its text form is a comma-separated list of ``KEY=STRATEGY`` entries where ``KEY`` is
either an op kind (``expert_act=RECOMPUTE``: every saving of every op of that kind) or ``OP/TENSOR``
(``L0.qkv/L0.norm1_out=OFFLOAD``: one saving). The empty plan prints as ``none``. A saving's strategy is its
explicit entry if any, else its op kind's policy, else ``KEEP``. Kind policies skip savings where the strategy
does not apply (pinned block inputs, QUANTIZE of masks and indices); an explicit entry that does not apply is an
error of the plan, reported by :func:`~bagualu2.costmodel.evaluate.evaluate`. A RECOMPUTE kind policy re-runs
the ops of that kind (their inputs stay; see :func:`~bagualu2.costmodel.evaluate.resolve`).
"""

from __future__ import annotations

import csv
import functools
import io
import json
from dataclasses import dataclass
from typing import Iterable, Mapping

from .graph import OP_KINDS
from .strategy import Strategy
from .validate import shown

NONE_TEXT = "none"
KEY_RULE = ("plan key must be an op kind or OP/TENSOR without ',', '=', quotes, whitespace or control characters (so "
            "that every text form reads it back), got ")


def _check_key(key: str) -> str:
    if not isinstance(key, str):
        raise ValueError(KEY_RULE + shown(key))
    return _checked_key(key)


@functools.lru_cache(maxsize=1 << 16)  # plans are made again and again from the same graphs' names
def _checked_key(key: str) -> str:
    if not key or any(c in ",='\"" or c.isspace() or not c.isprintable() for c in key):
        raise ValueError(KEY_RULE + shown(key))
    if "/" in key:
        op, _, tensor = key.partition("/")
        if not op or not tensor or "/" in tensor:
            raise ValueError(f"plan key {shown(key)} must be OP/TENSOR with both parts non-empty")
    elif key not in OP_KINDS:
        raise ValueError(f"plan key {shown(key)} is neither OP/TENSOR nor an op kind; kinds: {', '.join(OP_KINDS)}")
    return key


@dataclass(frozen=True)
class Plan:
    """Immutable mapping ``key -> Strategy``; ``key`` is an op kind or ``"op/tensor"``. Sorted, KEEP entries kept."""

    entries: tuple[tuple[str, Strategy], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.entries, (tuple, list)):
            raise ValueError("plan entries must be a tuple of (key, Strategy) pairs, got "
                             f"{type(self.entries).__name__}")
        seen: dict[str, Strategy] = {}
        for item in self.entries:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Strategy)):
                raise ValueError(f"plan entries must be (key, Strategy) pairs, got {item!r}")
            key = _check_key(item[0])
            if key in seen and seen[key] is not item[1]:
                raise ValueError(f"plan key {key!r} has two strategies: {seen[key].value} and {item[1].value}")
            seen[key] = item[1]
        object.__setattr__(self, "entries", tuple(sorted(seen.items())))

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def uniform(cls, policy: Mapping[str, Strategy | str]) -> "Plan":
        """Whole-kind policies, e.g. ``Plan.uniform({"core_attn": Strategy.RECOMPUTE})``."""
        if not isinstance(policy, Mapping):
            raise ValueError(f"Plan.uniform takes a mapping of op kinds to strategies, got {type(policy).__name__}")
        for kind in policy:
            if isinstance(kind, str) and "/" in kind:
                raise ValueError(f"Plan.uniform takes op kinds, got {kind!r}; use Plan.of for single savings")
        return cls.of(policy)

    @classmethod
    def of(cls, decisions: Mapping[str, Strategy | str] | Iterable[tuple[str, Strategy | str]]) -> "Plan":
        if isinstance(decisions, Mapping):
            items = list(decisions.items())
        elif isinstance(decisions, Iterable) and not isinstance(decisions, (str, bytes)):
            items = list(decisions)
        else:
            raise ValueError("plan decisions must be a mapping or an iterable of (key, strategy) pairs, got "
                             f"{type(decisions).__name__}")
        for item in items:
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise ValueError(f"plan decisions must be (key, strategy) pairs, got {item!r:.80}")
        return cls(tuple((key, s if isinstance(s, Strategy) else Strategy.parse(s)) for key, s in items))

    @classmethod
    def from_decisions(cls, decisions: Mapping[tuple[str, str], Strategy]) -> "Plan":
        """Plan from ``{(op, tensor): Strategy}``; KEEP decisions are dropped."""
        if not isinstance(decisions, Mapping):
            raise ValueError(f"decisions must map (op, tensor) to a Strategy, got {type(decisions).__name__}")
        for key, strategy in decisions.items():
            if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and isinstance(key[1], str)
                    and isinstance(strategy, Strategy)):
                raise ValueError(f"decisions must map (op, tensor) to a Strategy, got {key!r}: {strategy!r}")
            _check_key(f"{key[0]}/{key[1]}")
        plan = object.__new__(cls)  # keys are validated and unique: skip the generic checks of __init__
        object.__setattr__(plan, "entries", tuple(sorted(
            (f"{op}/{tensor}", s) for (op, tensor), s in decisions.items() if s is not Strategy.KEEP)))
        return plan

    @classmethod
    def coerce(cls, plan: "Plan | str | None") -> "Plan | None":
        """``plan`` as a :class:`Plan` (its text form parsed; None stays None); ``ValueError`` for anything else."""
        if plan is None or isinstance(plan, Plan):
            return plan
        if isinstance(plan, str):
            return cls.from_str(plan)
        raise ValueError(f"plan must be a Plan, its text form or None, got {type(plan).__name__}")

    @classmethod
    def from_str(cls, text: str) -> "Plan":
        """Parse the text form (see module docstring); strategies may be full names or first letters."""
        if not isinstance(text, str):
            raise ValueError(f"plan text must be a string, got {type(text).__name__}")
        body = text.strip()
        if body.startswith("Plan(") and body.endswith(")"):
            body = body[5:-1].strip().strip("'\"")
        if body.lower() in ("", NONE_TEXT):
            return cls()
        items = []
        for part in body.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep:
                raise ValueError(f"plan entry {part.strip()!r} must be KEY=STRATEGY")
            items.append((key.strip(), Strategy.parse(value)))
        return cls.of(items)

    def to_json(self) -> str:
        """``{"plan": [{"key": ..., "strategy": ...}, ...]}``."""
        return json.dumps({"plan": [{"key": k, "strategy": s.value} for k, s in self.entries]}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        shape = 'plan JSON must be {"plan": [{"key": ..., "strategy": ...}]}'
        try:
            data = json.loads(text)
            rows = data["plan"]
            pairs = [(row["key"], row["strategy"]) for row in rows]
        except KeyError as exc:
            raise ValueError(f"{shape}: missing field {shown(exc.args[0])}") from None
        except RecursionError:
            raise ValueError(f"{shape}: nested too deeply") from None
        except (json.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"{shape}: {exc!s:.200}") from None
        except UnicodeDecodeError:
            raise ValueError(f"{shape}: it is not UTF-8 text") from None
        except ValueError:  # an integer literal longer than Python converts
            raise ValueError(f"{shape}: it holds a number of over 4300 digits") from None
        try:
            return cls.of(pairs)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{shape}: {exc!s:.200}") from None

    def to_csv(self) -> str:
        """Two columns with a header: ``key,strategy``."""
        return "key,strategy\n" + "".join(f"{k},{s.value}\n" for k, s in self.entries)

    @classmethod
    def from_csv(cls, text: str) -> "Plan":
        if not isinstance(text, str):
            raise ValueError(f"plan CSV must be a string, got {type(text).__name__}")
        try:
            rows = list(csv.reader(io.StringIO(text)))
        except csv.Error as exc:  # a field over the csv module's limit, a NUL byte
            raise ValueError(f"plan CSV is malformed: {exc}") from None
        if not rows or [c.strip() for c in rows[0]] != ["key", "strategy"]:
            raise ValueError("plan CSV must start with the header 'key,strategy'")
        items = []
        for number, row in enumerate(rows[1:], start=2):
            if not row:
                continue
            if len(row) != 2:
                raise ValueError(f"plan CSV line {number} must have 2 columns (key,strategy), got {len(row)}")
            items.append((row[0].strip(), row[1].strip()))
        return cls.of(items)

    # ---- queries ------------------------------------------------------------------------------------------
    def as_dict(self) -> dict[str, Strategy]:
        return dict(self.entries)

    def explicit(self) -> dict[tuple[str, str], Strategy]:
        return {tuple(k.split("/", 1)): s for k, s in self.entries if "/" in k}  # type: ignore[misc]

    def kind_policies(self) -> dict[str, Strategy]:
        return {k: s for k, s in self.entries if "/" not in k}

    def with_decision(self, op: str, tensor: str, strategy: Strategy) -> "Plan":
        """This plan with ``op`` saving ``tensor`` under ``strategy`` (the key ``op/tensor``)."""
        for field, name in (("op", op), ("tensor", tensor)):
            if not isinstance(name, str) or not name.strip():
                raise ValueError(f"{field} must be a non-empty name, got {name!r}")
        if "/" in op:
            raise ValueError(f"op must be an op's name (no '/'), got {op!r}")
        if not isinstance(strategy, Strategy):
            raise ValueError(f"strategy must be a Strategy, got {strategy!r}")
        entries = dict(self.entries)
        entries[f"{op}/{tensor}"] = strategy
        return Plan(tuple(entries.items()))

    def __str__(self) -> str:
        if not self.entries:
            return NONE_TEXT
        return ",".join(f"{k}={s.value}" for k, s in self.entries)

    def __repr__(self) -> str:
        return f"Plan('{self}')"

    def __len__(self) -> int:
        return len(self.entries)
