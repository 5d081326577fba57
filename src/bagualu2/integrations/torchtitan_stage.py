"""One pipeline stage's provisioning inside torchtitan (see :mod:`.torchtitan`): what its part of the model keeps
per micro-batch.

A :class:`StageProvisioner` is made at the first micro-batch the schedule runs on the part. It instruments the part
(``exec.instrument`` with :func:`~.torchtitan.op_map`; routers report to the gate), traces its graph on that
micro-batch (one extra forward and backward: gradients computed, not accumulated; the MoE modules' load counters
and the random state restored), and applies plans through ``exec.apply_plan``. Per micro-batch:

1. **budget** — Algorithm 1 (``budget.BudgetAssigner``): ``M_max`` the stage's cap, ``M0`` the least a micro-batch
   can keep whatever the routing (``graph.floor_bytes`` at the most rows a rank's experts can receive), the
   in-flight count of the stage under 1F1B (``pp - stage``, at most the number of micro-batches); a new assigner
   every step;
2. **plan** — ``flexible``: greedy on the traced graph at balanced routing for the budget; the gate then re-plans
   the MoE modules for the routing it measured (``exec.DeferredPlanner.for_graph``, the runtime's one after-gate
   decision). ``static-under`` / ``static-over``: one plan for ``cap / in-flight`` at balanced routing / at the
   most a rank's experts can receive, kept whatever the routing; ``off``: no plan;
3. **kept bytes** — what the activation tracker measured (it raises ``ActivationOutOfMemoryError`` past the cap)
   goes back into the budget (re-basing); the prediction ``evaluate`` gives for the plan that ran, at the routed
   copies each layer received, is recorded beside it;
4. **release** — an identity at the input of the part's first layer reports the end of its backward.

The micro-batch is the schedule's (``PipelineStage.forward_one_chunk``'s chunk id, read from the caller's frame):
a forward outside the schedule (torch's shape inference) is not provisioned and not counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import inspect
import json
import os
import tempfile
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from bagualu2.budget import BudgetAssigner
from bagualu2.costmodel import OpGraph, Plan, Resource, evaluate, presets
from bagualu2.costmodel.validate import probe_folder, refuse_non_file, replacement_mode
from bagualu2.exec import (ActivationOutOfMemoryError, ActivationTracker, DeferredPlanner, apply_plan, instrument,
                           on_backward)
from bagualu2.mitigation import greedy
from bagualu2.runtime import TracedStage

from .torchtitan_config import Bagualu2Config, gate_of, mark_routed_rows, op_map

#: The provisioner whose micro-batch forward is running (set between the part's forward hooks).
ACTIVE_FORWARD: ContextVar["StageProvisioner | None"] = ContextVar("bagualu2_torchtitan_forward", default=None)
FRAMES = 16  # how far up the stack the schedule's forward is looked for
BUDGET_GRID = 64  # pre-gate plans are memoised per 1/64 of the unmitigated bytes (budget floored: still fits)


@dataclass(frozen=True)
class ScheduleInfo:
    pipelined: bool
    num_microbatches: int


def scheduled_forward(schedule: ScheduleInfo) -> tuple[int, int, int | None] | None:
    """``(stage index, number of stages, micro-batch)`` of the forward running now, when the pipeline schedule
    runs it (``forward_one_chunk`` of a pipeline stage up the stack); None for any other forward. Without a
    pipeline every forward with grad enabled is a micro-batch of stage 0 (numbered by the provisioner)."""
    if not torch.is_grad_enabled():
        return None
    if not schedule.pipelined:
        return 0, 1, None
    frame = inspect.currentframe()
    for _ in range(FRAMES):
        if frame is None:
            return None
        if frame.f_code.co_name == "forward_one_chunk":
            stage, microbatch = frame.f_locals.get("self"), frame.f_locals.get("fwd_chunk_id")
            if isinstance(microbatch, int) and hasattr(stage, "stage_index") and hasattr(stage, "num_stages"):
                return int(stage.stage_index), int(stage.num_stages), microbatch
        frame = frame.f_back
    return None


class _Preserved:
    """The part's buffers (a MoE module's load counters) and the random state (CPU, and the part's CUDA device),
    restored on exit."""

    def __init__(self, part: torch.nn.Module, device: torch.device):
        self.part = part
        self.rng = torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else [])

    def __enter__(self):
        self.buffers = [(b, b.detach().clone()) for b in self.part.buffers()]
        self.rng.__enter__()
        return self

    def __exit__(self, *exc):
        self.rng.__exit__(*exc)
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
        return False


def planned_graph(graph: OpGraph, *, quantize: bool = True, expert_parallel: bool = False) -> OpGraph:
    """The traced graph the plans are made on. Without expert parallelism torchtitan runs a layer's experts in one
    call (a loop over the experts, or one grouped GEMM on rows padded per expert) whose tensors change size with
    the routing while their sum does not: what that call saves is kept (pinned: no plan names a tensor whose size
    it cannot know). Under expert parallelism the grouped GEMMs run on the dispatched rows, which the gate counts
    exactly (:func:`~.torchtitan_config.padded_rows`): the experts are planned, and a re-run of them runs their
    forward on the rows they kept. What an op whose call issued a collective saves (the MoE module around the
    experts: its re-run would dispatch again) is kept, so no re-run in backward issues a collective, whatever
    plan each rank of the group runs. ``quantize=False``: no FP8 storage (exact plans)."""
    def kept(op) -> bool:
        if not expert_parallel:
            return op.kind == "dispatch"
        # "dispatch" (the experts op) is a communication kind of the cost model, but its call is the module's
        # forward on the dispatched rows: the all-to-alls run in torchtitan's hooks, outside it
        return op.resource is Resource.COMM and op.kind != "dispatch"

    pinned = frozenset((op.name, saving.tensor) for op in graph.ops if kept(op) for saving in op.saves)
    return dataclasses.replace(graph, pinned=graph.pinned | pinned, quantize=quantize)


class StageProvisioner:
    """Budgets, plans and kept bytes of one pipeline stage's part (module docstring). ``rows`` holds this step's
    micro-batches; ``last_rows`` the last finished step's."""

    def __init__(self, part: torch.nn.Module, args: tuple, kwargs: dict | None = None, *, config: Bagualu2Config,
                 stage_index: int, num_stages: int, num_microbatches: int, expert_parallel_degree: int = 1,
                 step: int = 0):
        self.config, self.stage_index, self.num_microbatches = config, stage_index, num_microbatches
        self.in_flight = min(num_stages - stage_index, num_microbatches)
        labels = op_map(part)
        has_router = "router" in labels.values()
        self.instrumented = instrument(part, labels, gate=gate_of(part, labels) if has_router else None)
        self.handles = mark_routed_rows(part, labels)
        device = next(part.parameters()).device
        hardware = presets.hardware("cpu" if device.type == "cpu" else "paper-gpu")
        with _Preserved(part, device):
            graph = self.instrumented.trace_graph(*args, hardware=hardware, **(kwargs or {}))
        self.graph: OpGraph = planned_graph(graph, quantize=config.quantize,
                                            expert_parallel=expert_parallel_degree > 1)
        self.cap_bytes = cap = config.cap_bytes
        routed = bool(self.graph.mean_routed_tokens)
        self.engine = TracedStage(self.graph) if routed else None
        # the least a micro-batch keeps (M0) grows with the rows its experts receive where what the module around
        # them saves is kept (under expert parallelism): M0 at the most rows a rank can receive, for every routing
        most = float(expert_parallel_degree) if routed else 1.0
        self.floor_bytes = floor = self.engine.graph(0, most).floor_bytes if routed else self.graph.floor_bytes
        if cap is not None and cap < self.in_flight * floor:
            where = f"pipeline stage {stage_index}" if num_stages > 1 else "the model (no pipeline)"
            raise ValueError(f"bagualu2.memory_cap_mib={config.memory_cap_mib} is below what {where} "
                             f"needs: {self.in_flight} micro-batch(es) in flight x {floor} bytes each "
                             f"at least (full recompute, whatever the routing) = "
                             f"{self.in_flight * floor / 2**20:.4f} MiB")
        policy = config.policy if cap is not None else "off"
        self.policy = policy
        self.planner = None
        self.fixed = Plan()
        if policy == "flexible" and routed:
            self.planner = DeferredPlanner.for_graph(self.graph, budget_bytes=0, downgrade=config.downgrade,
                                                     engine=self.engine)
        elif policy in ("static-under", "static-over"):
            # without expert parallelism a rank's experts receive every copy its router sends; under it at most
            # every rank's copies (the rows padded for them: fewer than the degree times the mean's)
            rate = 1.0 if policy == "static-under" else float(expert_parallel_degree)
            graph = self.engine.graph(0, rate) if routed else self.graph
            self.fixed = self._solve(graph, cap // self.in_flight)
        # a fixed plan runs out of memory when its micro-batches overflow the cap (the tracker raises mid-forward);
        # flexible is checked after each forward, once its gates have settled what the micro-batch keeps
        tracker = ActivationTracker(cap_bytes=cap if policy in ("static-under", "static-over") else None)
        self.executor = apply_plan(self.instrumented, self.fixed, deferred=self.planner, tracker=tracker)
        self._pre: dict[int, Plan] = {}
        first = next(layer for layer in part.layers.values() if layer is not None)
        first.register_forward_pre_hook(self._first_layer)
        self.last_rows: list[dict] = []  # the last finished step's (the report file has every step's)
        self._report_started = False
        self._begin_step(step)

    # ---- plans ------------------------------------------------------------------------------------------------
    @staticmethod
    def _solve(graph: OpGraph, budget_bytes: int) -> Plan:
        solution = greedy.solve(graph, budget_bytes)
        return solution.plan if solution.ok else greedy.solve(graph, graph.floor_bytes).plan

    def _pre_gate(self, budget_bytes: int) -> Plan:
        """The plan a flexible micro-batch starts with: greedy at balanced routing for the budget (floored to the
        grid, memoised)."""
        graph = self.engine.graph(0, 1.0) if self.engine is not None else self.graph
        if budget_bytes >= graph.unmitigated_bytes:
            return Plan()
        quantum = max(graph.unmitigated_bytes // BUDGET_GRID, 1)
        key = budget_bytes // quantum
        found = self._pre.get(key)
        if found is None:
            found = self._pre[key] = self._solve(graph, key * quantum)
        return found

    # ---- one step ---------------------------------------------------------------------------------------------
    def _begin_step(self, step: int) -> None:
        self.step = step
        self.rows: list[dict] = []
        self._forwards = 0  # forwards this step
        self._current = None
        self._begin_round()

    def _begin_round(self) -> None:
        """A run of the pipeline schedule (one per step, or one per gradient-accumulation micro-step)."""
        self.assigner = (BudgetAssigner(m_max_bytes=self.cap_bytes, m0_bytes=self.floor_bytes,
                                        num_microbatches=self.num_microbatches, num_warmup=self.in_flight)
                         if self.policy == "flexible" else None)
        self._names: dict[int, str] = {}
        self._awaiting: set[str] = set()  # micro-batches whose backward has not reached the first layer yet

    def begin(self, microbatch: int | None) -> None:
        """The part's forward of ``microbatch`` starts (None: without a pipeline schedule, where each forward's
        backward runs before the next forward: every forward is micro-batch 0 of a round of its own)."""
        if microbatch is None:
            microbatch = 0
            if self._awaiting:
                raise ValueError("without a pipeline each forward's backward must run before the next forward (the "
                                 "converter numbers them as one micro-batch each); the previous forward's backward "
                                 "has not run")
        if microbatch in self._names:  # the schedule runs again within the step (gradient accumulation)
            self._release_all()
            self._begin_round()
        name = f"s{self.stage_index}.m{microbatch}"
        if self.assigner is not None:
            budget, _ = self.assigner.next_forward()
            plan = self._pre_gate(budget)
        else:
            budget = None if self.cap_bytes is None else self.cap_bytes // self.in_flight
            plan = self.fixed
        context = self.executor.micro_batch(name, plan=plan, budget_bytes=budget)
        record = context.__enter__()
        self._current = (microbatch, name, budget, plan, context, record, ACTIVE_FORWARD.set(self))

    def _first_layer(self, layer, args):
        current = self._current
        if current is None or not args or not isinstance(args[0], torch.Tensor):
            return None
        microbatch, name = current[0], current[1]
        if args[0].requires_grad:  # its backward will report: the next forward without a pipeline must wait for it
            self._awaiting.add(name)
        return (on_backward(args[0], lambda: self.release(microbatch, name)), *args[1:])

    def end(self, *, failed: bool) -> None:
        """The part's forward ended (``failed``: it raised): settle the micro-batch's bytes."""
        microbatch, name, budget, plan, context, record, token = self._current
        self._current = None
        ACTIVE_FORWARD.reset(token)
        if failed:
            self._awaiting.discard(name)  # no backward will come for it
            context.__exit__(RuntimeError, RuntimeError("forward failed"), None)
            return
        context.__exit__(None, None, None)
        kept = record.device_bytes
        received = dict(record.received_tokens)
        cost = evaluate(self.graph, record.plan)
        predicted = cost.activation_bytes_received(self.graph, received) if received else cost.activation_bytes
        if self.assigner is not None:
            held = self.assigner.record_forward(microbatch, kept)
            if held > self.cap_bytes:
                self._awaiting.discard(name)  # the step is lost: no backward will come for it
                raise ActivationOutOfMemoryError(
                    f"pipeline stage {self.stage_index}: activations in flight reach {held} bytes after micro-batch "
                    f"{microbatch} (budget {budget}, kept {kept}, predicted {predicted}), over the cap of "
                    f"{self.cap_bytes} bytes")
        self._names[microbatch] = name
        self._forwards += 1
        self.rows.append({"step": self.step + 1, "stage": self.stage_index, "forward": self._forwards - 1,
                          "microbatch": microbatch,
                          "policy": self.policy, "budget_bytes": budget, "kept_bytes": kept,
                          "predicted_bytes": predicted, "plan_before_gate": str(plan), "plan": str(record.plan),
                          "downgraded_layers": list(record.downgraded),
                          "received": {str(k): v for k, v in received.items()},
                          "imbalance": max((v / self.graph.built_routed_tokens(k) for k, v in received.items()
                                            if self.graph.built_routed_tokens(k)), default=1.0)})

    def release(self, microbatch: int, name: str) -> None:
        """The backward of the part's first layer ran for ``microbatch``: its activations are free."""
        self._awaiting.discard(name)
        if name in self.executor:
            self.executor.release(name)
            if self.assigner is not None:
                self.assigner.record_backward(microbatch)

    def _release_all(self) -> None:
        for name in self._names.values():
            if name in self.executor:  # a backward that never reached the first layer (nothing to release to)
                self.executor.release(name)

    def end_step(self, step: int) -> None:
        """After the optimizer step: log and report the step's micro-batches, start the next step's budgets."""
        self._release_all()
        rows = self.last_rows = sorted(self.rows, key=lambda row: row["forward"])
        _log(self.stage_index, step, rows)
        if self.config.report_path:
            self._report_started = write_report(self.config.report_path, self.stage_index, step, rows,
                                                 fresh=not self._report_started)
        self._begin_step(step)


def _log(stage: int, step: int, rows: list[dict]) -> None:
    try:
        from torchtitan.tools.logging import logger
    except ImportError:
        import logging

        logger = logging.getLogger("bagualu2")
    kept = ", ".join(f"{row['kept_bytes'] / 2**20:.2f}" for row in rows)
    budgets = ", ".join("-" if row["budget_bytes"] is None else f"{row['budget_bytes'] / 2**20:.2f}" for row in rows)
    changed = sum(bool(row["downgraded_layers"]) for row in rows)
    logger.info(f"bagualu2 step {step} stage {stage}: kept MiB per micro-batch [{kept}], budgets [{budgets}], "
                f"{changed} re-planned at the gate")


def report_file(pattern: str, stage: int) -> str:
    """This rank's report path for ``stage`` (``~`` expanded, ``{rank}`` and ``{stage}`` replaced)."""
    return os.path.expanduser(pattern).replace("{rank}", os.environ.get("RANK", "0")).replace("{stage}", str(stage))


def check_report_path(pattern: str, world_size: int, *, stages: int = 1) -> None:
    """Before training: ``ValueError`` (one line) unless this rank can write its report of each of the pipeline's
    ``stages`` (the one it runs among them: ``{stage}`` names it): ``{rank}`` in the path when several ranks run,
    its folder there and writable or the nearest existing folder above it writable (the report's folder is made by
    its first write: a run refused before it leaves nothing behind), and the file, if it exists, a regular file
    that is not read-only."""
    if not pattern:
        return
    if "\0" in pattern:
        raise ValueError("bagualu2.report_path must be a path without NUL characters")
    if world_size > 1 and "{rank}" not in pattern:
        raise ValueError(f"bagualu2.report_path must contain {{rank}} when {world_size} ranks run (each writes its "
                         f"own report), got {pattern!r}")
    for stage in range(stages if "{stage}" in pattern else 1):
        _check_report_file(pattern, report_file(pattern, stage))


def _check_report_file(pattern: str, path: str) -> None:
    if pattern.endswith(("/", os.sep)) or os.path.basename(path).strip() in ("", ".", ".."):
        raise ValueError(f"bagualu2.report_path must name a file, got {pattern!r}")
    _refuse_non_file(path)
    if os.path.isfile(path) and not _mode(path) & 0o222:  # root may write it; no one is meant to
        raise ValueError(f"bagualu2.report_path {path!r} is read-only (not replaced)")
    directory = os.path.dirname(os.path.abspath(path))
    existing = directory
    while not os.path.lexists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(errno.ENOTDIR, f"{existing} is not a folder")
        probe_folder(existing, make=False)
    except OSError as exc:
        raise ValueError(f"bagualu2.report_path {path!r}: cannot write in {directory} ({exc.strerror or exc})"
                         ) from None


def _refuse_non_file(path: str) -> None:
    try:
        refuse_non_file(path)
    except OSError as exc:  # not a regular file, or a name the system refuses (too long, a loop of links)
        raise ValueError(f"bagualu2.report_path {path!r}: {exc.strerror or exc}") from None


def write_report(pattern: str, stage: int, step: int, rows: list[dict], *, fresh: bool) -> bool:
    """One JSON line ``{"stage", "step", "rows"}`` for the finished ``step``: appended, or (``fresh``: the launch's
    first) as a new file written to a temporary file and renamed over any earlier one, keeping its lines of the
    steps before ``step`` (a run resumed from a checkpoint continues its report). Returns True."""
    path = report_file(pattern, stage)
    _refuse_non_file(path)
    line = json.dumps({"stage": stage, "step": step, "rows": rows}) + "\n"
    if fresh and step > 1 and os.path.isfile(path):
        line = "".join(_lines_before(path, stage, step)) + line
    directory = os.path.dirname(os.path.abspath(path))
    temporary = None
    try:
        if not fresh:
            with open(path, "a") as out:
                out.write(line)
            return True
        os.makedirs(directory, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=directory, prefix=".bagualu2-report-")
        with os.fdopen(handle, "w") as out:
            os.fchmod(out.fileno(), _mode(path))
            out.write(line)
            out.flush()
            os.fsync(out.fileno())
        _refuse_non_file(path)  # made meanwhile? leave it alone
        os.replace(temporary, path)
        with contextlib.suppress(OSError):  # the rename itself on disk too
            folder = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(folder)
            finally:
                os.close(folder)
        return True
    except BaseException as exc:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        if isinstance(exc, OSError):
            raise ValueError(f"bagualu2.report_path {path!r}: cannot write it ({exc.strerror or exc})") from None
        raise


def _lines_before(path: str, stage: int, step: int) -> list[str]:
    """The lines of the report file ``path`` of ``stage``'s steps before ``step`` (an unreadable line, or one of
    another stage, which an earlier launch of another layout wrote, is dropped)."""
    kept = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            with contextlib.suppress(ValueError, TypeError, AttributeError, RecursionError):
                entry = json.loads(line)
                number = entry.get("step")
                if type(number) is int and number < step and entry.get("stage") == stage:
                    kept.append(line if line.endswith("\n") else line + "\n")
    return kept


def read_report(path: str | os.PathLike[str]) -> dict:
    """A report file as ``{"stage", "steps": [rows of each step], "step_numbers"}``; a last line cut short (a run
    stopped mid-write) is left out, any other malformed line is a ``ValueError`` naming it (and so is a path that
    is no readable file)."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a report file's path, got {type(path).__name__}")
    try:
        with open(path) as handle:
            lines = [line for line in handle.read().split("\n") if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"report {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    stage, steps, numbers = None, [], []
    for index, line in enumerate(lines, 1):
        try:
            entry = json.loads(line)
            stage = entry["stage"] if stage is None else stage
            if entry["stage"] != stage:
                raise ValueError(f"stage {entry['stage']} after stage {stage}")
            steps.append(entry["rows"])
            numbers.append(entry["step"])
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            if index == len(lines) and isinstance(exc, json.JSONDecodeError):
                break
            why = "nested too deeply" if isinstance(exc, RecursionError) else exc
            raise ValueError(f"{path}: line {index}: not a report line ({why})") from None
    return {"stage": stage, "steps": steps, "step_numbers": numbers}


def _umask() -> int:
    mask = os.umask(0o022)  # read it: set and restored at import, before torchtitan's trainer starts threads
    os.umask(mask)
    return mask


UMASK = _umask()  # the process's umask: a new report's mode follows it, as a file opened for writing would


def _mode(path: str) -> int:
    """The permission bits a report written in place of ``path`` gets (``replacement_mode`` with the umask read at
    import: no umask call while threads run), never setuid / setgid / sticky."""
    return replacement_mode(path, umask=UMASK) & 0o777


__all__ = ["ACTIVE_FORWARD", "ScheduleInfo", "StageProvisioner", "check_report_path", "read_report", "report_file",
           "scheduled_forward", "write_report"]
