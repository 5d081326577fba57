"""Shared CLI helpers: one-line errors (exit 2), option parsing, rich/JSON output, atomic file writes.

Every user-facing error is ONE line on stderr, ``error: --option: message``, with exit code 2 and never a
traceback. Wrap a command with :func:`handle_errors` and the library calls that consume an option in
``with blame("--option"):`` so a ``ValueError`` / ``OSError`` raised inside names that option.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, TypeVar

import typer
from rich.console import Console

from bagualu2.costmodel import Hardware, ModelConfig, ParallelConfig, Plan, presets
from bagualu2.costmodel.build import check_imbalance

GIB = float(1 << 30)
MIB = float(1 << 20)
EXIT_USAGE = 2

F = TypeVar("F", bound=Callable[..., Any])


# ---- errors ------------------------------------------------------------------------------------------------
class CliError(Exception):
    """A user error to report as one line; ``option`` is the flag it concerns (or None)."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        where = f"{exc.filename}: " if exc.filename is not None else ""
        text = f"cannot access {where}{exc.strerror}"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def fail(message: str, option: str | None = None) -> NoReturn:
    """Print ``error: [option: ]message`` as one line on stderr and exit with code 2."""
    prefix = f"{option}: " if option else ""
    typer.echo(f"error: {prefix}{' '.join(message.split())}", err=True)
    raise typer.Exit(code=EXIT_USAGE)


@contextlib.contextmanager
def blame(option: str) -> Iterator[None]:
    """Turn a ``ValueError`` / ``OSError`` raised inside into a :class:`CliError` naming ``option``."""
    try:
        yield
    except CliError:
        raise
    except (ValueError, OSError) as exc:
        raise CliError(_one_line(exc), option) from None


def handle_errors(func: F) -> F:
    """Decorator for commands: :class:`CliError`, ``ValueError`` and ``OSError`` become one line + exit 2."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except CliError as exc:
            fail(str(exc), exc.option)
        except (ValueError, OSError) as exc:
            fail(_one_line(exc))

    return wrapper  # type: ignore[return-value]


# ---- option parsing ----------------------------------------------------------------------------------------
def load_model(name: str) -> tuple[str, ModelConfig, ParallelConfig]:
    """``(preset name, ModelConfig, ParallelConfig)`` of ``--model``."""
    with blame("--model"):
        model, parallel = presets.model(name)
    return name.lower(), model, parallel


def load_hardware(value: str) -> Hardware:
    """``--hardware``: a preset name, or a path ending in ``.json`` read with ``Hardware.from_json``."""
    if value.lower().endswith(".json"):
        with blame("--hardware"):
            return Hardware.from_json(Path(value).read_text(encoding="utf-8"))
    try:
        return presets.hardware(value)
    except ValueError as exc:
        raise CliError(f"{exc} (or a path to a .json file)", "--hardware") from None


def parse_imbalance(text: str) -> float:
    """``--imbalance``: a finite number >= 1 (max/mean device load)."""
    try:
        value = float(text)
    except ValueError:
        raise CliError(f"must be a number >= 1 (max/mean device load), got {text!r}", "--imbalance") from None
    with blame("--imbalance"):
        return check_imbalance(value)


def parse_number(text: str, option: str, *, minimum: float, strict: bool = False, what: str = "",
                 maximum: float = 1e15) -> float:
    """A finite number ``>= minimum`` (``> minimum`` if ``strict``) and ``<= maximum`` from ``option``'s text."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < minimum or (strict and value == minimum) or value > maximum:
        bound = f"{'>' if strict else '>='} {minimum:g} and <= {maximum:g}"
        raise CliError(f"must be a finite number {bound}{what}, got {text!r}", option)
    return value


def parse_plan(text: str) -> Plan:
    """``--plan``: the plan text form, e.g. ``expert_act=RECOMPUTE,core_attn=OFFLOAD`` (``none`` = empty)."""
    with blame("--plan"):
        return Plan.from_str(text)


# ---- shared option declarations (reuse in every command that takes these inputs) ----------------------------
MODEL_HELP = "Model preset (see `bagualu2 presets`)."
HARDWARE_HELP = "Hardware preset name, or a path to a Hardware JSON file (*.json)."
IMBALANCE_HELP = "Imbalance rate r = max/mean device load of routed tokens; a number >= 1."
PLAN_HELP = ("Mitigation plan, e.g. expert_act=RECOMPUTE,core_attn=OFFLOAD; 'none' keeps everything. "
             "OP/TENSOR entries name ops of one stage: combine them with --stage.")
JSON_HELP = "Print one JSON object on stdout instead of tables."


# ---- output ------------------------------------------------------------------------------------------------
def console() -> Console:
    """A stdout console; wide (160 columns) when stdout is not a terminal and COLUMNS is unset."""
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(width=160 if wide else None, highlight=False)


def echo_json(obj: Any) -> None:
    """Print ``obj`` as indented JSON on stdout (plain text, no markup)."""
    typer.echo(json.dumps(obj, indent=2))


# ---- files -------------------------------------------------------------------------------------------------
def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temp file in the same directory + ``os.replace`` (never half-written)."""
    target = Path(path)
    directory = target.parent
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(handle.fileno(), 0o666 & ~umask)
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def atomic_write_text(path: str | os.PathLike[str], text: str, *, encoding: str = "utf-8") -> Path:
    """Text version of :func:`atomic_write_bytes`."""
    return atomic_write_bytes(path, text.encode(encoding))
