"""Shared CLI helpers: one-line errors (exit 2), option parsing, rich/JSON output, atomic file writes.

Every user-facing error is ONE line on stderr, ``error: --option: message``, with exit code 2 and never a
traceback. Wrap a command with :func:`handle_errors` and the library calls that consume an option in
``with blame("--option"):`` so a ``ValueError`` / ``OSError`` raised inside names that option. Numbers are checked
against what the computation can take where they enter (an imbalance is at most the expert-parallel degree ``ep``;
op durations stay within the integer solvers' range, :func:`check_graph`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import stat
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bagualu2.costmodel import Hardware, ModelConfig, OpGraph, ParallelConfig, Plan, build_graph, presets, stage_memory
from bagualu2.costmodel.build import check_imbalance, imbalance_limit, limit_text
from bagualu2.costmodel.graph import GraphTooSlowError
from bagualu2.costmodel.validate import parse_float, parse_int, require_int

from .files import atomic_write_bytes, atomic_write_text, check_output_path  # noqa: F401 (re-exported)

GIB = float(1 << 30)
MIB = float(1 << 20)
EXIT_USAGE = 2
MAX_LINE_CHARS = 400          # an error line longer than this is cut
MAX_JSON_FILE_BYTES = 1 << 20  # a hardware JSON file is a few hundred bytes
MAX_CHUNK_NS = 10**15          # one micro-batch's forward + backward of one chunk (~11.6 days): int64-safe
MAX_CHUNK_BYTES = 1 << 50      # activation bytes of one micro-batch of one chunk

F = TypeVar("F", bound=Callable[..., Any])


# ---- errors ------------------------------------------------------------------------------------------------
class CliError(Exception):
    """A user error to report as one line; ``option`` is the flag it concerns (or None)."""

    def __init__(self, message: str, option: str | None = None) -> None:
        field = (option or "").lstrip("-").replace("-", "_")
        if field and message.startswith(f"{field} must "):  # a config field's own check: the option names it
            message = message[len(field) + 1:]
        super().__init__(message)
        self.option = option


EXTRAS = {"torch": ("torch",), "trainer": ("torch", "tokenizers")}  # what each optional extra installs


def one_thread_env() -> dict[str, str]:
    """The environment for a trainer process: one intra-op thread unless ``OMP_NUM_THREADS`` says otherwise
    (torchrun's default; the tiny CPU models run about three times faster than on every core)."""
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def require_extra(extra: str, option: str | None = None) -> None:
    """A :class:`CliError` naming the extra to install when a module it provides is missing."""
    import importlib.util

    missing = [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]
    if missing:
        raise CliError(f"this needs the '{extra}' extra: pip install 'bagualu2[{extra}]' (missing: "
                       f"{', '.join(missing)}; on CPU install torch==2.13.0 first)", option)


WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EIO, errno.EFBIG, errno.EDQUOT})


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        name = exc.filename
        if not (isinstance(name, str) and name and name.isprintable()):
            name = repr(name)  # an empty path shows as '', a newline in one as \n (one line names one path)
        if exc.filename is not None:
            text = f"cannot access {name}: {exc.strerror}"
        elif exc.errno in WRITE_ERRNOS:  # no file named: a write to an open stream, the command's output
            text = f"input/output error on the output: {exc.strerror}"
        else:
            text = exc.strerror
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def fail(message: str, option: str | None = None) -> NoReturn:
    """Print ``error: [option: ]message`` as one line on stderr and exit with code 2."""
    prefix = f"{option}: " if option else ""
    line = f"error: {prefix}{' '.join(message.split())}"
    if len(line) > MAX_LINE_CHARS:
        line = line[:MAX_LINE_CHARS - 3] + "..."
    typer.echo(line, err=True)
    raise typer.Exit(code=EXIT_USAGE)


@contextlib.contextmanager
def blame(option: str) -> Iterator[None]:
    """Turn a ``ValueError`` / ``OSError`` raised inside into a :class:`CliError` naming ``option`` (a graph too
    slow to time is always ``--hardware``'s: a faster profile, or a smaller ``--model``)."""
    try:
        yield
    except CliError:
        raise
    except GraphTooSlowError as exc:
        raise CliError(_one_line(exc), "--hardware") from None
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
        except GraphTooSlowError as exc:
            fail(_one_line(exc), "--hardware")
        except (ValueError, OSError) as exc:
            fail(_one_line(exc))
        except RecursionError:
            fail("input nested too deeply")
        except OverflowError as exc:  # a number that passed its check but not the arithmetic: a missing check
            fail(f"a number is out of range ({exc}); use realistic values")

    return wrapper  # type: ignore[return-value]


# ---- option parsing ----------------------------------------------------------------------------------------
def load_model(name: str) -> tuple[str, ModelConfig, ParallelConfig]:
    """``(name, ModelConfig, ParallelConfig)`` of ``--model``: a preset name, or a path ending in ``.json`` read
    with ``presets.model_from_json`` (``{"model": {...}, "parallel": {...}}``)."""
    if name.lower().endswith(".json"):
        text = read_json_file(name, "--model")
        with blame("--model"):
            model, parallel = presets.model_from_json(text)
        stem = Path(name).stem  # the run's name in headers and JSON: one printable line whatever the file's name
        return (stem if stem.isprintable() else stem.encode("unicode_escape").decode("ascii")), model, parallel
    try:
        model, parallel = presets.model(name)
    except ValueError as exc:
        raise CliError(f"{exc} (or a path to a .json file)", "--model") from None
    return name.lower(), model, parallel


def read_json_file(value: str, option: str) -> str:
    """The text of the JSON file ``value`` of ``option``: a regular file (never a FIFO or device) of at most
    ``MAX_JSON_FILE_BYTES``."""
    with blame(option):
        info = os.stat(value)
        if not stat.S_ISREG(info.st_mode):
            raise CliError(f"{value!r} is not a regular file", option)
        if info.st_size > MAX_JSON_FILE_BYTES:
            raise CliError(f"{value!r} is {info.st_size} bytes; a JSON file of at most {MAX_JSON_FILE_BYTES} "
                           "bytes is allowed", option)
        try:
            return Path(value).read_text(encoding="utf-8-sig")
        except UnicodeDecodeError:
            raise CliError(f"{value!r} is not UTF-8 text (a JSON file is expected)", option) from None


def load_hardware(value: str) -> Hardware:
    """``--hardware``: a preset name, or a path ending in ``.json`` read with ``Hardware.from_json``."""
    if value.lower().endswith(".json"):
        text = read_json_file(value, "--hardware")
        with blame("--hardware"):
            try:
                return Hardware.from_json(text)
            except (TypeError, RecursionError, OverflowError) as exc:  # never expected: keep it one line
                raise ValueError(f"invalid hardware JSON: {exc}") from None
    try:
        return presets.hardware(value)
    except ValueError as exc:
        raise CliError(f"{exc} (or a path to a .json file)", "--hardware") from None


def rate_range(model: ModelConfig | None, parallel: ParallelConfig | None) -> str:
    """The imbalances a layout takes, for messages: ``in [1, 21.33] (max/mean device load: ...)``."""
    if parallel is None:
        return ">= 1 (max/mean device load)"
    limit = parallel.ep if model is None else imbalance_limit(model, parallel)
    if limit == parallel.ep:
        return f"in [1, {parallel.ep}] (max/mean device load: at most the expert-parallel degree ep={parallel.ep})"
    return (f"in [1, {limit_text(limit)}] (max/mean device load: a token reaches at most top_k={model.top_k} of "
            f"num_experts={model.num_experts} experts, so one of ep={parallel.ep} ranks receives at most "
            "num_experts / top_k times the mean)")


def check_rate(value: float, parallel: ParallelConfig | None, option: str = "--imbalance",
               model: ModelConfig | None = None) -> float:
    """An imbalance (max/mean device load) from ``option``: finite, >= 1 and, for ``parallel``, <= its ``ep``
    (with ``model``: <= ``imbalance_limit``, ``min(ep, num_experts / top_k)``)."""
    ep = None if parallel is None else parallel.ep
    try:
        return check_imbalance(value, ep=ep, model=model)
    except (ValueError, OverflowError):
        raise CliError(f"must be a finite number {rate_range(model, parallel)}, got {value!r}", option) from None


def number_option(text, allowed: str = "") -> float:
    """typer's parser of the float options (``typer.Option(parser=number_option)``): :func:`parse_float`, one
    ``BadParameter`` line otherwise, naming ``allowed`` (the option's default comes in as a float)."""
    if isinstance(text, (int, float)):
        return float(text)
    try:
        return parse_float(text)
    except ValueError:
        raise typer.BadParameter(f"must be a number{' ' + allowed if allowed else ''}, got {text!r}") from None


def number_in(allowed: str) -> Callable[[Any], float]:
    """:func:`number_option` for an option whose values are ``allowed`` (e.g. ``"in [0, 1]"``; the command checks
    the range itself, after parsing, where it depends on other options)."""
    return lambda text: number_option(text, allowed)


def integer_option(*, minimum: int | None = None, maximum: int | None = None) -> Callable[[Any], int]:
    """typer's parser of an integer option (``typer.Option(parser=integer_option(minimum=0))``): decimal digits with
    an optional sign, within the bounds; one ``BadParameter`` line otherwise (``1_0``, ``0x10``, ``1e3`` and
    non-ASCII digits are no integers on a command line). typer ignores ``min``/``max`` beside a parser, so the bounds
    are checked here."""
    def parse(text: Any) -> int:
        try:
            value = text if isinstance(text, int) else parse_int(str(text))  # an int: the option's default
        except ValueError:
            raise typer.BadParameter(f"must be an integer, got {text!r}") from None
        try:
            return require_int("", value, minimum, maximum, high_open=False)
        except ValueError as exc:
            raise typer.BadParameter(str(exc).lstrip()) from None

    return parse


def parse_imbalance(text: str, parallel: ParallelConfig | None = None, option: str = "--imbalance",
                    model: ModelConfig | None = None) -> float:
    """``--imbalance``: a finite number >= 1 (max/mean device load), at most ``parallel.ep`` when given (with
    ``model``: at most ``imbalance_limit``)."""
    try:
        value = parse_float(text)
    except ValueError:
        raise CliError(f"must be a number >= 1 (max/mean device load), got {text!r}", option) from None
    return check_rate(value, parallel, option, model)


def check_index(value: int, count: int, option: str, what: str) -> int:
    """``value`` in ``[0, count)``, else one line naming ``option`` (``what``: e.g. ``"pp=8 for glm"``)."""
    if not 0 <= value < count:
        raise CliError(f"must be in [0, {count}) ({what}), got {value}", option)
    return value


def check_device_room(model: ModelConfig, parallel: ParallelConfig, hardware: Hardware) -> None:
    """One line blaming ``--hardware`` when some pipeline stage of the layout leaves no room for even fully
    recomputed activations (``StageMemory.check_room``): a device too small, refused before any work; or whose
    first and last stages' first chunk is beyond what :func:`check_graph` takes (a device too slow)."""
    with blame("--hardware"):
        for stage in range(parallel.pp):
            stage_memory(model, parallel, hardware, stage=stage).check_room(hardware, stage)
    for stage in sorted({0, parallel.pp - 1}):
        check_graph(build_graph(model, parallel, hardware, stage=stage, chunk=0))


def check_graph(graph: OpGraph) -> OpGraph:
    """``graph`` if its durations and bytes are within what the solvers take (int64 nanoseconds for CP-SAT and
    the DP); else one line blaming ``--hardware`` (too slow a device) or ``--model``."""
    total_ns = sum(op.forward_ns + op.backward_ns for op in graph.ops)
    if total_ns > MAX_CHUNK_NS:
        raise CliError(f"{graph.label} of one micro-batch would take {total_ns * 1e-9:.3g} s (at most "
                       f"{MAX_CHUNK_NS * 1e-9:g} s allowed): raise peak_flops x matmul_efficiency (and "
                       "attention_efficiency) or the bandwidths, or lower kernel_launch_s", "--hardware")
    if graph.unmitigated_bytes > MAX_CHUNK_BYTES:
        raise CliError(f"{graph.label} keeps {graph.unmitigated_bytes} bytes per micro-batch (at most "
                       f"{MAX_CHUNK_BYTES} allowed)", "--model")
    return graph


def parse_number(text: str, option: str, *, minimum: float, strict: bool = False, what: str = "",
                 maximum: float = 1e15) -> float:
    """A finite number ``>= minimum`` (``> minimum`` if ``strict``) and ``<= maximum`` from ``option``'s text."""
    try:
        value = parse_float(text)
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
MODEL_HELP = ("Model preset (see `bagualu2 presets`), or a path to a JSON file (*.json) "
              '{"model": {ModelConfig fields}, "parallel": {ParallelConfig fields}}.')
HARDWARE_HELP = "Hardware preset name, or a path to a Hardware JSON file (*.json)."
IMBALANCE_HELP = ("Imbalance rate r = max/mean device load of routed tokens; a number in [1, min(ep, num_experts "
                  "/ top_k)] (no expert-parallel rank receives more).")
PLAN_HELP = ("Mitigation plan, e.g. expert_act=RECOMPUTE,core_attn=OFFLOAD; 'none' keeps everything. "
             "OP/TENSOR entries name ops of one stage: combine them with --stage.")
JSON_HELP = "Print one JSON object on stdout instead of tables."


def literal(text: str) -> str:
    """``text`` for rich markup where no tag follows it (a name in a sentence or a cell): ``[`` escaped, a
    trailing backslash kept single (``rich.markup.escape`` doubles it, which only a following tag reads as one)."""
    from rich.markup import escape

    escaped = escape(text)
    return escaped[:-1] if text.endswith("\\") and escaped.endswith("\\\\") else escaped


def json_help(doc: str, *, lead: str = JSON_HELP) -> str:
    """The ``--json`` option's help: ``lead`` and the format ``doc`` (escaped: rich would read ``[...]`` as
    markup and drop it)."""
    from rich.markup import escape

    return f"{lead} {escape(doc)}"


# ---- output ------------------------------------------------------------------------------------------------
MIN_COLUMNS = 20  # a COLUMNS below it is ignored


def console() -> Console:
    """A stdout console: COLUMNS wide when it is a usable width, else the terminal's, or 160 columns when stdout is
    not a terminal."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) >= MIN_COLUMNS:
        width = int(columns)
    elif not sys.stdout.isatty():
        width = 160
    elif columns:  # unusable (COLUMNS=0 would print nothing), which rich would read: the terminal's own width
        try:
            width = max(os.get_terminal_size(sys.stdout.fileno()).columns, MIN_COLUMNS)
        except (OSError, ValueError):
            width = 80
    else:
        width = None  # rich asks the terminal
    return Console(width=width, highlight=False)


def progress_bar(*, disable: bool = False) -> Progress:
    """The commands' progress bar: on stderr (stdout stays the result), gone when done, off with ``disable`` and
    when stderr is not a terminal (where it would draw nothing but leave an empty line)."""
    stderr = Console(stderr=True)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=stderr, transient=True, disable=disable or not stderr.is_terminal)


def echo_json(obj: Any) -> None:
    """Print ``obj`` as indented, strict JSON on stdout (plain text, no markup): a NaN or infinite number (a
    ratio with nothing to measure) is null."""
    typer.echo(json.dumps(_finite(obj), indent=2, allow_nan=False))


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


# ---- files: see files.py (its atomic writes are re-exported here) ----------------------------------------------

def output_path(value: str | None, option: str = "--png", *, inputs: dict[str, str | None] | None = None
                ) -> Path | None:
    """Fail fast, before any work, when ``option``'s path cannot be written (see :func:`check_output_path`) or is
    one of the files the command reads (``inputs``: option -> its value; a value that names no file is skipped, as
    is a ``--model`` or ``--hardware`` preset name: only a ``*.json`` value is read as a file)."""
    if value is None:
        return None
    if value == "-":
        raise CliError("must be a file path (standard output is not supported for images)", option)
    with blame(option):
        target = check_output_path(value)
    for source, given in (inputs or {}).items():
        if source in ("--model", "--hardware") and given is not None and not given.lower().endswith(".json"):
            continue  # a preset name, even where a file of that name exists
        if given is not None and _same_file(target, given):
            raise CliError(f"{value!r} is the file {source} reads; write the output to another path", option)
    return target


def _same_file(target: Path, given: str) -> bool:
    """Whether ``target`` and the existing path ``given`` are one file (False when either does not exist)."""
    try:
        return os.path.samefile(target, given)
    except (OSError, ValueError):
        return False


def write_output(path: Path, data: bytes, option: str = "--png") -> Path:
    """Write ``data`` to ``path`` atomically; errors name ``option``."""
    with blame(option):
        return atomic_write_bytes(path, data)
