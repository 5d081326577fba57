"""The one validation helper of the project: integers and finite numbers with a range, one-line ``ValueError``s
naming the field and what is allowed. ``bool`` is never a number here; numpy scalars are accepted and returned as
plain Python values. :func:`parse_int` / :func:`parse_float`: a number written on a command line;
:func:`probe_folder`: can a folder take new files (made first if missing); :func:`refuse_non_file`: a path that
exists is a regular file (never replace anything else)."""

from __future__ import annotations

import errno
import json
import math
import numbers
import os
import re
import stat
import tempfile
from typing import Any


def number_text(value: float) -> str:
    """A float as a person reads it, never rounded: ``1e+09`` for ``1000000000.0``, ``16`` for ``16.0``, but
    ``16.0000001`` in full (a rounded value could read as one it is not)."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


def _bound(value) -> str:
    """A range's bound as a person reads it: ``2**63`` rather than its 19 digits, floats by :func:`number_text`."""
    if isinstance(value, int) and value >= 1 << 20 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    if isinstance(value, float):
        return number_text(value)  # never a rounded bound the value contradicts
    return str(value)


def _range_text(low, high, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{_bound(low)}, {_bound(high)}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {_bound(low)}"
    if high is not None:
        return f" {'<' if high_open else '<='} {_bound(high)}"
    return ""


def require_int(name: str, value: Any, low: int | None = None, high: int | None = None, *,
                high_open: bool = True) -> int:
    """``value`` as an ``int`` if it is an integer in ``[low, high)`` (``[low, high]`` with ``high_open=False``);
    else ``ValueError("<name> must be an integer >= low, got ...")``."""
    if type(value) is not int:  # the hot path skips the generic checks
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name} must be an integer{_range_text(low, high, False, high_open)}, "
                             f"got {shown(value)}")
        value = int(value)
    if (low is not None and value < low) or (high is not None and (value >= high if high_open else value > high)):
        raise ValueError(f"{name} must be an integer{_range_text(low, high, False, high_open)}, got {shown(value)}")
    return value


def shown(value: Any) -> str:
    """``value`` for an error message: an integer of more than 21 digits by its digit count and magnitude
    (``an integer of 31 digits, about 1e+30``), anything else as ``repr`` cut to 80 characters."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**21:
        try:
            return f"an integer of {len(str(abs(value)))} digits, about {float(value):.6g}"
        except (OverflowError, ValueError):  # beyond a float, or more digits than str() converts
            return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_int(text: str) -> int:
    """``int(text)`` for decimal digits with an optional sign only; ``ValueError`` for what ``int`` would also read
    (``1_0``, non-ASCII digits) and everything else."""
    digits = text.strip()
    if not re.fullmatch(r"[+-]?[0-9]{1,4000}", digits):
        raise ValueError(f"not an integer: {text!r}")
    return int(digits)


def parse_float(text: str) -> float:
    """``float(text)``, but ``ValueError`` for Python's digit separators (``1_0``, ten, is no number on a command
    line) and non-ASCII digits."""
    if "_" in text or not text.isascii():
        raise ValueError(f"not a number: {text!r}")
    return float(text) + 0.0  # -0 is 0


def require_number(name: str, value: Any, low: float | None = None, high: float | None = None, *,
                   low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a ``float`` if it is a finite real number in the range (closed unless ``*_open``); else
    ``ValueError("<name> must be a finite number > 0, got ...")``."""
    allowed = _range_text(low, high, low_open, high_open)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a finite number{allowed}, got {shown(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer beyond the floats
        number = math.inf
    if not math.isfinite(number) or (low is not None and (number <= low if low_open else number < low)) \
            or (high is not None and (number >= high if high_open else number > high)):
        raise ValueError(f"{name} must be a finite number{allowed}, got {shown(value)}")
    return number


class _Twice(Exception):
    """A JSON object naming one key twice (raised from inside ``json.loads``)."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def load_json(text: Any, what: str, nested: str) -> Any:
    """``json.loads(text)``, or a one-line ``ValueError`` naming ``what`` ("hardware JSON"): text that is not str
    or bytes, not JSON, not UTF-8, an integer literal longer than Python converts (4300 digits), or nesting deeper
    than the interpreter's recursion limit (``nested`` says what was expected), or an object that names one key
    twice (which value is meant?)."""
    if not isinstance(text, (str, bytes, bytearray)):
        raise ValueError(f"{what} must be the text of a JSON document (str or bytes), got {type(text).__name__}")

    def unique(pairs: list) -> dict:
        found: dict = {}
        for key, value in pairs:
            if key in found:
                raise _Twice(key)
            found[key] = value
        return found

    try:
        return json.loads(text, object_pairs_hook=unique)
    except _Twice as exc:
        raise ValueError(f"{what} gives the key {shown(exc.key)} twice; give each field once") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{what} is not UTF-8 text") from None
    except ValueError:  # an integer literal longer than Python converts (4300 digits)
        raise ValueError(f"{what} holds a number too long to be a size (over 4300 digits)") from None
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply ({nested})") from None


def require_fields(label: str, given, fields: list[str]) -> None:
    """``ValueError("<label> has no field x; fields: ...")`` when ``given`` names a field not in ``fields``."""
    unknown = sorted(str(key) for key in given if key not in fields)
    if unknown:
        raise ValueError(f"{label} has no field {', '.join(unknown)}; fields: {', '.join(fields)}")


def check_solver_options(time_limit_s: Any, num_workers: Any, seed: Any) -> None:
    """Options of the CP-SAT solvers: a finite time limit > 0, workers in [1, 1024], a seed in [0, 2**31)
    (CP-SAT's ``random_seed`` is a 32-bit signed integer)."""
    require_number("time_limit_s", time_limit_s, 0, low_open=True)
    require_int("num_workers", num_workers, 1, 1024, high_open=False)
    require_int("seed", seed, 0, 2 ** 31)


def replacement_mode(target: str | os.PathLike[str], *, umask: int | None = None) -> int:
    """The permission bits a file written in place of ``target`` gets: the existing regular file's (a rewrite never
    widens them), else what a new file gets under the process's umask (``umask``: that umask, read before; reading
    it here sets it for a moment, which other threads creating files would see)."""
    try:
        found = os.stat(target)
    except OSError:
        found = None
    if found is not None and stat.S_ISREG(found.st_mode):
        return stat.S_IMODE(found.st_mode)
    if umask is None:
        umask = os.umask(0)
        os.umask(umask)
    return 0o666 & ~umask


def probe_folder(directory: str | os.PathLike[str], *, make: bool = True) -> None:
    """Make ``directory`` (with its parents, unless ``make`` is false) and create and remove a file in it: the only
    check that holds for root, to which ``os.access`` says yes everywhere. ``OSError`` when it cannot."""
    if make:
        os.makedirs(directory, exist_ok=True)
    fd, probe = tempfile.mkstemp(dir=directory, prefix=".bagualu2-probe-", suffix=".tmp")
    os.close(fd)
    os.unlink(probe)


def refuse_non_file(target: str | os.PathLike[str]) -> None:
    """``OSError`` if ``target`` exists (as a link or anything) and is not a regular file."""
    try:
        mode = os.lstat(target).st_mode
    except (FileNotFoundError, NotADirectoryError):  # not there (a parent may be a file: the writer will say)
        return
    if stat.S_ISREG(mode):
        return
    kind = ("a symlink" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode) else
            "a FIFO" if stat.S_ISFIFO(mode) else "a device node" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
    raise OSError(errno.EEXIST, f"exists and is {kind}; give the path of a regular file (never replaced otherwise)",
                  str(target))
