"""The trainer's metrics: the JSONL log (:class:`MetricsWriter`), FLOP accounting (MFU / HFU), a progress bar
(:class:`Progress`) and the end-of-run summary table (:func:`summary_table`). Pure Python + rich; no torch.

JSONL schema (one JSON object a line, written by rank 0; the trainer fills the fields):

* one record per step, ``STEP_FIELDS``: ``step`` (0-based index of the step), ``loss``, ``tokens_per_s``, ``mfu``,
  ``hfu`` (fractions of peak), ``oom`` (bool), ``peak_activation_bytes`` (max over all pipeline stages; with the
  safety net it includes the overflowing attempt of a re-run micro-batch), ``microbatches`` (a list of
  ``MICROBATCH_FIELDS`` objects: ``stage``, ``chunk``, ``microbatch``, ``phase``, ``budget_bytes`` (Algorithm 1's
  budget), ``kept_bytes`` (measured), ``predicted_bytes`` (cost model, at the token counts each MoE layer
  received), ``imbalance`` (per MoE layer of the chunk: routed copies this rank received / the mean ``T*K``, the
  cost model's device imbalance), ``expert_imbalance`` (per MoE layer: max / mean tokens per expert of this
  rank's tokens), ``plan`` (summary: mitigated savings per strategy), ``action`` (``keep``, ``changed`` (a gate
  re-planned or downgraded), ``rerun`` (the safety net re-ran it with full recompute))), ``order`` (the fused
  orders of the steps' OVERLAP_F_B points), ``planning_s`` (the slowest rank's budget + plan + order seconds),
  ``planning_s_all_ranks``, ``agree_s`` (the EP group's after-forward all-reduce, communication), ``step_s`` (the slowest
  rank), ``recompute_flops``, ``reruns``, ``policy``. After an out-of-memory restart one extra record
  ``{"step", "oom": true, "policy", "restart", "resumed_from_step", "continues_as", "message",
  "peak_activation_bytes"}`` (the most the failed launch's completed steps held: the steps the restart re-runs lose
  their records);
* one final record, ``SUMMARY_FIELDS``: ``"summary": true``, ``recipe``, ``steps`` (configured), ``steps_run``
  (this launch), ``first_loss``, ``final_loss``, ``max_prediction_error``, ``seconds``, ``oom_events``,
  ``restarts``, ``restart_s`` (from each error to the first step completed after it), ``steps_lost``,
  ``reruns``, ``policy``, ``policies`` (the sequence across restarts), ``tokens_per_s`` (effective: the run's
  tokens over the time since its first launch, restarts and lost steps included), ``mfu``, ``hfu``,
  ``peak_activation_bytes``, ``memory_cap_bytes``, ``planning_fraction`` (sum of ``planning_s`` / sum of
  ``step_s``), ``setup_s`` (planning before the first step), ``schedule``, ``layout``.

Non-finite floats (NaN, +-inf: a diverged loss, an MFU over zero seconds) are written as ``null``: the lines are
strict JSON (``json.dumps(allow_nan=False)``). numpy / torch scalars are written as their ``.item()``.

FLOPs follow the simulator (``bagualu2.sim.stage.StageContext.model_flops``): 3 x (forward + 2 x forward for the
backward) the matrix-product and attention FLOPs (``costmodel.graph.MATMUL_KINDS``) of the cost model's op graph at
balanced load, so the trainer's MFU and the simulator's count the same work; see :func:`model_flops_per_token`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import sys
import tempfile
from typing import IO, Any, Iterable, Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

from bagualu2.costmodel import ModelConfig, ParallelConfig, build_graph, presets
from bagualu2.costmodel.graph import MATMUL_KINDS
from bagualu2.costmodel.validate import require_int, require_number

STEP_FIELDS = ("step", "loss", "tokens_per_s", "mfu", "hfu", "oom", "peak_activation_bytes", "microbatches",
               "order", "planning_s", "step_s")
MICROBATCH_FIELDS = ("stage", "chunk", "microbatch", "phase", "budget_bytes", "kept_bytes", "predicted_bytes",
                     "imbalance", "expert_imbalance", "plan", "action")
SUMMARY_FIELDS = ("summary", "steps", "final_loss", "oom_events", "restarts", "restart_s", "tokens_per_s", "mfu",
                  "hfu", "peak_activation_bytes", "planning_fraction")


# ---- FLOPs -------------------------------------------------------------------------------------------------
def layer_flops_per_token(config: ModelConfig) -> float:
    """Training FLOPs per token of the transformer layers: exactly the simulator's model FLOPs (``StageContext.
    model_flops`` summed over the stages, divided by the tokens), computed from the same op graph.

    Per token and layer (forward; h hidden, a heads, g groups, d head dim, s sequence, f dense FFN, fe expert FFN,
    E experts, K top-k, S shared experts, w = 2 for SwiGLU else 1): ``2h(a+2g)d`` (QKV) + ``2sad`` (``QK^T`` and
    ``PV``, the causal half of ``4sad``) + ``2adh`` (output projection), then a dense layer ``2hfw + 2fh`` or an MoE
    layer ``2hE`` (router) + ``K(2h fe w + 2 fe h)`` (top-k routed experts) + ``S(2h fe w + 2 fe h)`` (shared).
    Elementwise ops (norms, activations, RoPE, the weighted combine) are not counted; the total is 3 x forward."""
    graph = build_graph(config, ParallelConfig(), presets.hardware("cpu"))  # FLOPs do not depend on the hardware
    forward = sum(op.flops for op in graph.ops if op.kind in MATMUL_KINDS)
    return 3.0 * forward / (config.seq_length * config.micro_batch_size)


def model_flops_per_token(config: ModelConfig) -> float:
    """Training FLOPs per token of the active parameters: :func:`layer_flops_per_token` plus the output layer,
    3 x ``2hV`` (tied or not: the embedding lookup is no matrix product). The simulator's MFU leaves the output
    layer out; ``model_flops_per_token - layer_flops_per_token`` is that difference."""
    return layer_flops_per_token(config) + 3.0 * 2 * config.hidden_size * config.vocab_size


def recompute_flops_per_token(config: ModelConfig, recompute_fraction: float) -> float:
    """Forward FLOPs re-run per token when ``recompute_fraction`` (in [0, 1]) of the layers' forward matrix
    products is recomputed in the backward (1: full recompute; the output layer is never recomputed)."""
    fraction = require_number("recompute_fraction", recompute_fraction, 0, 1)
    return fraction * layer_flops_per_token(config) / 3.0


def plan_recompute_flops_per_token(recompute_flops: Iterable[float], *, tokens: int) -> float:
    """Recompute FLOPs per token from the plans that ran: ``recompute_flops`` holds ``PlanCost.recompute_flops``
    of every (rank, chunk, micro-batch) of the step, ``tokens`` the step's global tokens. ``recompute_flops`` is
    per rank (tensor-parallel sharded), so when the ``dp*tp*cp`` ranks of a stage run the same plans, pass one
    rank's values times ``dp*tp*cp``. HFU = :func:`mfu` of (model + recompute) FLOPs per token x tokens."""
    require_int("tokens", tokens, 1)
    return math.fsum(require_number("recompute_flops", value, 0) for value in recompute_flops) / tokens


def mfu(flops: float, seconds: float, *, peak_flops: float, num_devices: int) -> float:
    """``flops / (seconds * peak_flops * num_devices)``: the fraction of the devices' peak that ``flops`` used.
    Pass model FLOPs for MFU, model + recompute FLOPs for HFU. ``ValueError`` unless seconds, peak > 0."""
    require_number("flops", flops, 0)
    require_number("seconds", seconds, 0, low_open=True)
    require_number("peak_flops", peak_flops, 0, low_open=True)
    return flops / (seconds * peak_flops * require_int("num_devices", num_devices, 1))


# ---- JSONL -------------------------------------------------------------------------------------------------
def jsonable(value: Any) -> Any:
    """``value`` with non-finite floats as ``None``, tuples as lists and scalars with ``.item()`` unwrapped."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if value is None or isinstance(value, (str, int)):
        return value
    item = getattr(value, "item", None)
    return jsonable(item()) if callable(item) else value  # anything else: json.dumps names its type


def check_path(path: str) -> None:
    """One-line ``ValueError`` unless ``path`` names a file (no trailing separator) that is a regular file if it
    exists (not a folder, a FIFO or a link) in an existing directory, with a name the file system takes."""
    if path.endswith(("/", os.sep)):
        raise ValueError(f"metrics path {path}: a file name is needed, not a folder")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(f"metrics path {path}: directory {directory} does not exist")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:  # a name too long, ...
        raise ValueError(f"metrics path {path[:120]}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"metrics path {path} exists and is not a regular file")


def check_writable(path: str) -> None:
    """One-line ``ValueError`` unless ``path``'s directory takes new files and ``path``, if it exists, opens for
    writing (without changing it): a read-only file system or a file without write permission is refused before
    the run starts, not when its first record is due."""
    from bagualu2.costmodel.validate import probe_folder

    directory = os.path.dirname(os.path.abspath(path))
    try:
        probe_folder(directory, make=False)
        if os.path.lexists(path):
            os.close(os.open(path, os.O_WRONLY | getattr(os, "O_NONBLOCK", 0)))
    except OSError as exc:
        raise ValueError(f"metrics path {path}: cannot write it ({exc.strerror or exc})") from None


def _kept(line: str, resume_step: int) -> bool:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # a line cut short by the crash
        return False
    if not isinstance(record, dict) or record.get("summary"):
        return False
    step = record.get("step")
    return type(step) is int and step < resume_step


def truncate_for_resume(path: str, resume_step: int) -> None:
    """Rewrite ``path`` atomically (a temp file in its directory, then ``os.replace``) with only the step records
    of steps ``< resume_step``: no summary, no record without an integer ``step``, no unreadable line."""
    target = os.path.realpath(path)
    with open(target, encoding="utf-8", errors="replace") as handle:
        kept = [line if line.endswith("\n") else line + "\n" for line in handle if _kept(line, resume_step)]
    fd, temp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=f".{os.path.basename(target)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.writelines(kept)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temp, stat.S_IMODE(os.stat(target).st_mode))
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


class MetricsWriter:
    """JSONL metrics, written by rank 0 only (on other ranks, or with ``path=None``, every method is a no-op and
    the path is not checked). A fresh run (``resume_step=None``) truncates ``path``; a resumed run (``resume_step``
    = the first step it will execute) keeps the records of steps ``< resume_step`` (:func:`truncate_for_resume`)
    and appends. ``ValueError`` (one line naming the path) when ``path`` exists and is not a regular file or its
    directory does not exist. Each :meth:`write` is one line, written through (unbuffered); a write the disk
    refuses (full) leaves the file at its last whole record, warns once and stops the log, not the run. On rank 0
    a write after :meth:`close` is a ``ValueError``. Usable as a context manager."""

    def __init__(self, path: str | os.PathLike | None, *, rank: int, resume_step: int | None = None):
        require_int("rank", rank, 0)
        self.path = None if path is None else os.fspath(path)
        self._file: IO[bytes] | None = None
        self._active = rank == 0 and self.path is not None
        if not self._active:
            return
        check_path(self.path)
        if resume_step is not None:
            require_int("resume_step", resume_step, 0)
            if os.path.exists(self.path):
                truncate_for_resume(self.path, resume_step)
        try:
            self._file = open(self.path, "wb" if resume_step is None else "ab", buffering=0)  # a record: one write
        except OSError as exc:
            raise ValueError(f"metrics path {self.path}: cannot write it ({exc.strerror or exc})") from None
        self._whole_bytes = self._file.seek(0, os.SEEK_END)  # the bytes of whole records

    def write(self, record: Mapping[str, Any]) -> None:
        if not self._active:
            return
        if self._file is None:
            raise ValueError(f"metrics writer for {self.path} is closed")
        if not isinstance(record, Mapping):
            raise TypeError(f"a metrics record must be a dict, got {type(record).__name__}")
        line = memoryview((json.dumps(jsonable(record), allow_nan=False) + "\n").encode("utf-8"))
        try:
            while line:  # an unbuffered write may take part of it
                line = line[self._file.write(line):]
            self._whole_bytes = self._file.tell()
        except OSError as exc:  # a full or failing disk: the log stops, a healthy run does not
            with contextlib.suppress(OSError):  # no half record: the file ends with the last whole one
                os.ftruncate(self._file.fileno(), self._whole_bytes)
            self._active = False
            print(f"warning: metrics file {self.path}: {exc.strerror or exc}; no more records are written, "
                  "training continues", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            with contextlib.suppress(OSError):  # what a full disk kept back was reported when it failed
                file.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- terminal ----------------------------------------------------------------------------------------------
def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class Progress:
    """A rich progress bar on stderr (stdout stays free for the trainer's JSON record), rank 0 only; silent (no
    output at all) when stderr is not a TTY or ``rank != 0``, unless a ``console`` is given (tests).
    ``update(step, ...)``: step ``step`` (0-based) has finished; ``start_step`` steps count as done (resume)."""

    def __init__(self, total_steps: int, *, rank: int, start_step: int = 0, console: Console | None = None):
        total = require_int("total_steps", total_steps, 0)
        start = require_int("start_step", start_step, 0, total, high_open=False)
        self._bar: Any = None
        if require_int("rank", rank, 0) != 0 or (console is None and not _is_tty(sys.stderr)):
            return
        self._bar = RichProgress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                 TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} tok/s"),
                                 TimeRemainingColumn(), console=console or Console(stderr=True),
                                 redirect_stdout=False)
        self._task = self._bar.add_task("train", total=total, completed=start, loss="-", rate="-")
        self._bar.start()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step + 1, loss=f"{loss:.4f}", rate=f"{tokens_per_s:,.0f}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def human_bytes(value: float | None) -> str:
    """``1536`` -> ``"1.50 KiB"`` (binary units); ``None`` -> ``"n/a"``."""
    if value is None or not math.isfinite(value):
        return "n/a"
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    size, unit = float(value), 0
    while abs(size) >= 1024 and unit < len(units) - 1:
        size, unit = size / 1024, unit + 1
    return f"{int(size)} B" if unit == 0 else f"{size:.2f} {units[unit]}"


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "n/a"
    if spec == "d" and isinstance(value, float) and value.is_integer():
        value = int(value)
    return format(value, spec)


def summary_table(summary: Mapping[str, Any]) -> Table:
    """The end-of-run table of a ``SUMMARY_FIELDS`` record; a missing or null field shows ``n/a``."""
    get = summary.get
    restarts = _fmt(get("restarts"), "d")
    if get("restart_s") is not None and restarts != "n/a":
        restarts += f" ({_fmt(get('restart_s'), '.1f')} s lost)"
    table = Table(title="training summary")
    table.add_column("metric")
    table.add_column("value", justify="right")
    steps = _fmt(get("steps"), "d")
    if get("steps_run") is not None and get("steps_run") != get("steps"):
        steps = f"{steps} ({_fmt(get('steps_run'), 'd')} in this launch)"
    for name, value in (("policy", str(get("policy") or "n/a")), ("steps", steps),
                        ("final loss", _fmt(get("final_loss"), ".4f")),
                        ("tokens/s (effective)", _fmt(get("tokens_per_s"), ",.1f")),
                        ("MFU", _fmt(get("mfu"), ".2%")), ("HFU", _fmt(get("hfu"), ".2%")),
                        ("peak activation", human_bytes(get("peak_activation_bytes"))),
                        ("OOM events", _fmt(get("oom_events"), "d")), ("restarts", restarts),
                        ("re-run micro-batches", _fmt(get("reruns"), "d")),
                        ("planning overhead", _fmt(get("planning_fraction"), ".2%"))):
        table.add_row(name, value)
    return table


def print_summary(summary: Mapping[str, Any], *, rank: int, console: Console | None = None) -> None:
    """Rank 0 prints :func:`summary_table` to stderr (stdout stays free for the JSON record); others nothing."""
    if require_int("rank", rank, 0) == 0:
        (console or Console(stderr=True)).print(summary_table(summary))
