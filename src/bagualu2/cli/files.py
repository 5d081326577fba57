"""Output files of the CLI (``--png``): checked before any work, written atomically, never onto a non-file.

:func:`check_output_path` refuses, with one line naming the option, a path whose folder is missing or not
writable, whose name is too long, that exists and is not a regular file (a directory, symlink, FIFO or device
node is never replaced) or that is read-only. :func:`atomic_write_bytes` writes a temp file in the same folder
(short name, so any legal target name works) with the old file's permissions, fsyncs it and ``os.replace``-s it
onto the target: the target is the old file or the new one; :func:`atomic_write_many` does that for a set of
files, renaming only once every temp file is written.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from bagualu2.costmodel.validate import probe_folder, refuse_non_file, replacement_mode

TEMP_NAME_CHARS = 32  # of the target's name in the temp file's name


def check_output_path(value: str, what: str = "file.png") -> Path:
    """``value`` as the :class:`Path` of a file that :func:`atomic_write_bytes` can write; ``OSError`` or
    ``ValueError`` (one line) otherwise."""
    if not value or value.endswith(("/", os.sep)) or "\0" in value:
        raise ValueError(f"must be a file path such as {what}, got {value!r}")
    target = Path(value)
    folder = target.parent
    if not folder.is_dir():
        raise ValueError(f"folder {str(folder)!r} " + ("is not a folder" if folder.exists() else "does not exist"))
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"folder {str(folder)!r} is not writable")
    limit = None
    with contextlib.suppress(OSError, ValueError):  # no such limit on this file system: the OS will say
        limit = os.pathconf(folder, "PC_NAME_MAX")
    if limit is not None and len(os.fsencode(target.name)) > limit:
        raise ValueError(f"file name is {len(os.fsencode(target.name))} bytes long; at most {limit} allowed")
    refuse_non_file(target)
    if target.exists() and (not os.access(target, os.W_OK) or not replacement_mode(target) & 0o222):
        raise ValueError(f"file {value!r} is read-only (not replaced)")  # root may write it; no one is meant to
    try:  # os.access says yes to root everywhere: make (and remove) a file there before any work
        probe_folder(folder, make=False)
    except OSError as exc:
        raise ValueError(f"folder {str(folder)!r} is not writable ({exc.strerror or exc})") from None
    return target


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temp file in the same directory + ``os.replace`` (never half-written);
    ``OSError`` (naming ``path``, not the temp file) when it cannot, or when ``path`` exists and is not a regular
    file."""
    return atomic_write_many([(path, data)])[0]


def atomic_write_many(items) -> list[Path]:
    """Write each ``(path, data)`` of ``items`` like :func:`atomic_write_bytes`, as a set: every temp file is
    written and fsynced before the first is renamed onto its target, so a failure (a full disk) leaves every target
    as it was."""
    temps: list[tuple[str, Path]] = []
    try:
        for path, data in items:
            target = Path(path)
            refuse_non_file(target)
            try:
                temps.append((_write_temp(target, data), target))
            except OSError as exc:  # name the user's path, not the temp file's
                raise OSError(exc.errno, exc.strerror, str(target)) from None
        for tmp, target in temps:
            refuse_non_file(target)  # made meanwhile? leave it alone
            os.replace(tmp, target)
    except BaseException:
        for tmp, _ in temps:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise
    return [target for _, target in temps]


def _write_temp(target: Path, data: bytes) -> str:
    """A fsynced temp file holding ``data`` beside ``target`` (short name, so any legal target name works)."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name[:TEMP_NAME_CHARS]}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), replacement_mode(target))
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def atomic_write_text(path: str | os.PathLike[str], text: str, *, encoding: str = "utf-8") -> Path:
    """Text version of :func:`atomic_write_bytes`."""
    return atomic_write_bytes(path, text.encode(encoding))
