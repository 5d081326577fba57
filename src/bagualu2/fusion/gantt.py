"""Gantt charts of a simulated order: a text chart (one row per resource) and a PNG (matplotlib, Agg).

Pure and deterministic; matplotlib is imported lazily inside :func:`gantt_png` only, so importing this module
costs nothing. Both charts take the :class:`~bagualu2.fusion.simulate.Timeline` of ``simulate(order, chains)``.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import tempfile
import warnings
from pathlib import Path

from ..costmodel import Resource
from ..costmodel.validate import replacement_mode, require_int
from .chains import CHAIN_KINDS, Chains
from .simulate import Timeline

CHAIN_NAMES = {"F": "forward", "B": "backward", "O": "offload", "R": "recovery"}
CHAIN_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "O": "#55A868", "R": "#C44E52"}
IDLE = "."
_LABEL = max(len(r.value) for r in Resource) + 1  # width of the row-name column


def _cells(timeline: Timeline, resource: Resource, width: int) -> str:
    """Cell c covers [c, c+1) * makespan / width; it shows the chain with the largest overlap ('.' for none).

    Times are scaled by ``width`` so the arithmetic stays in exact integers; ties go to the earlier chain/stage.
    """
    total = timeline.makespan_ns
    events = sorted((e for e in timeline.events if e.resource is resource and e.end_ns > e.start_ns),
                    key=lambda e: (e.start_ns, CHAIN_KINDS.index(e.chain), e.index))
    row = []
    for cell in range(width):
        lo, hi = cell * total, (cell + 1) * total
        best, letter = 0, IDLE
        for event in events:
            overlap = min(event.end_ns * width, hi) - max(event.start_ns * width, lo)
            if overlap > best:
                best, letter = overlap, event.chain
        row.append(letter)
    return "".join(row)


def _axis(makespan_ms: float, width: int, ticks: int = 4) -> str:
    """Time labels (ms) at 0, 1/ticks, ..., 1 of the chart width; the end label first, colliding ones dropped."""
    line = [" "] * (width + 1)
    for tick in (ticks, *range(ticks)):
        text = f"{makespan_ms * tick / ticks:.4g}"
        start = max(0, min(tick * width // ticks, width + 1 - len(text)))
        span = range(max(0, start - 1), min(width + 1, start + len(text) + 1))
        if start + len(text) <= width + 1 and all(line[c] == " " for c in span):
            line[start:start + len(text)] = text
    return "".join(line).rstrip()


MAX_WIDTH = 10_000  # cells a text chart's row may have


def _check_timeline(timeline) -> None:
    if not isinstance(timeline, Timeline):
        raise ValueError(f"timeline must be a fusion Timeline (fusion.simulate), got {type(timeline).__name__}")


def gantt_text(timeline: Timeline, chains: Chains | None = None, *, width: int = 100) -> str:
    """A text Gantt chart: a header, one ``|...|`` row per resource (compute, comm, d2h, h2d) of ``width`` cells
    holding the chain letter (F, B, O, R) of the stage that fills most of the cell or '.' when idle, a time axis
    in ms and a legend (stage counts from ``chains`` when given, else from the timeline's events)."""
    _check_timeline(timeline)
    require_int("width", width, 1, MAX_WIDTH, high_open=False)
    makespan_ms = timeline.makespan_ns * 1e-6
    lines = [f"makespan {makespan_ms:.3f} ms, exposed mitigation {timeline.exposed_mitigation_ns * 1e-6:.3f} ms "
             f"({width} columns of {makespan_ms / width:.4g} ms)"]
    for resource in Resource:
        lines.append(f"{resource.value:<{_LABEL}}|{_cells(timeline, resource, width)}|")
    lines.append(f"{'ms':<{_LABEL}} " + _axis(makespan_ms, width))
    if chains is not None:
        counts = dict(zip(CHAIN_KINDS, chains.counts()))
    else:
        counts = {kind: sum(e.chain == kind for e in timeline.events) for kind in CHAIN_KINDS}
    legend = ", ".join(f"{kind} {CHAIN_NAMES[kind]} ({counts[kind]} stage{'' if counts[kind] == 1 else 's'})"
                       for kind in CHAIN_KINDS)
    lines.append(f"{'':<{_LABEL}} {legend}; {IDLE} idle")
    return "\n".join(lines)


def _write_atomic(target: Path, data: bytes) -> None:
    """Temp file in the same folder + ``os.replace``: the target is either the old file or the complete new one.

    Refuses to replace anything but a regular file (a directory, symlink, FIFO or device node stays as it is); the
    temp name is short, so any legal target name works."""
    with contextlib.suppress(FileNotFoundError):
        mode = os.lstat(target).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EEXIST, "exists and is not a regular file; refusing to replace it", str(target))
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name[:32]}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, replacement_mode(target))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def gantt_png_bytes(timeline: Timeline, *, title: str = "") -> bytes:
    """The PNG Gantt chart of ``timeline`` as bytes (no file is touched).

    One row per resource, one ``broken_barh`` per chain and resource, a colour per chain, a legend, x in ms.
    """
    _check_timeline(timeline)
    if not isinstance(title, str):
        raise ValueError(f"title must be a string, got {type(title).__name__}")
    from matplotlib.figure import Figure  # lazy: no pyplot, no global backend state (Agg canvas by default)

    resources = list(Resource)
    figure = Figure(figsize=(10, 1.0 + 0.6 * len(resources)), dpi=100)
    axes = figure.add_subplot()
    for row, resource in enumerate(resources):
        y = len(resources) - 1 - row  # compute on top
        for kind in CHAIN_KINDS:
            bars = [(e.start_ns * 1e-6, (e.end_ns - e.start_ns) * 1e-6) for e in timeline.events
                    if e.resource is resource and e.chain == kind]
            if bars:
                axes.broken_barh(bars, (y - 0.4, 0.8), facecolors=CHAIN_COLOURS[kind], edgecolor="white",
                                 linewidth=0.5)
    handles = [axes.bar(0, 0, color=CHAIN_COLOURS[k], label=f"{k} {CHAIN_NAMES[k]}") for k in CHAIN_KINDS]
    axes.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=len(CHAIN_KINDS),
                frameon=False)
    axes.set_yticks(range(len(resources)), [r.value for r in reversed(resources)])
    axes.set_ylim(-0.6, len(resources) - 0.4)
    axes.set_xlim(0, max(timeline.makespan_ns * 1e-6, 1e-9))
    axes.set_xlabel("time (ms)")
    # the title as written: a '$' would start matplotlib's math text (and an unbalanced one fail to render)
    axes.set_title(title.replace("$", r"\$") or f"makespan {timeline.makespan_ns * 1e-6:.3f} ms")
    return png_bytes(figure, bbox_inches="tight")


def png_bytes(figure, **savefig) -> bytes:
    """``figure`` (matplotlib) laid out and rendered as PNG bytes; a character its font lacks (a title in another
    script) is drawn as a box, without a warning on stderr."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing from font", category=UserWarning)
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", **savefig)
    return buffer.getvalue()


def gantt_png(timeline: Timeline, path: str | os.PathLike[str], *, title: str = "") -> Path:
    """Write :func:`gantt_png_bytes` of ``timeline`` to ``path`` (atomically) and return the path.

    ``ValueError`` for a ``path`` that is no file path (empty, not a string); ``OSError`` (e.g.
    ``FileNotFoundError``) when the folder does not exist, or ``path`` exists and is not a
    regular file (a folder, symlink, FIFO or device node is never replaced).
    """
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"path must be a non-empty file path (str or os.PathLike), got {path!r:.60}")
    target = Path(path)
    if not target.parent.is_dir():
        raise FileNotFoundError(errno.ENOENT, "no such directory", str(target.parent))
    if target.is_dir():
        raise IsADirectoryError(errno.EISDIR, "is a directory", str(target))
    _write_atomic(target, gantt_png_bytes(timeline, title=title))
    return target
