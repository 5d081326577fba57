"""Resumable, verified checkpoints of a PP x DP trainer on ``torch.distributed.checkpoint`` (DCP).

Every rank passes its own state dict (nested dicts/lists whose leaves are all tensors: anything else would be
pickled by DCP and unpickled with ``weights_only=False`` on load, so it is refused; encode it with
:func:`pack_json`). DCP merges the keys of all ranks into one namespace and keeps ONE copy of a key that several
ranks hold (``dedup_save_plans``): replicated tensors (DP replicas of a stage) may share a key, rank-specific
values need rank-specific keys (``stage1.layers.3.weight``, ``rank2.rng.torch``). :func:`save` checks this and
refuses a key whose value differs between ranks instead of silently keeping one of them.

A checkpoint ``step-<step:08d>/`` appears atomically (rename of a ``.tmp-*`` dir) with a ``manifest.json``
(sha256 and size of every file); :func:`find_latest` returns the newest one that verifies and names every one it
skips on stderr; :func:`load` checks the manifest (world size, file sizes) but leaves hashing to find_latest.
Without an initialised process group everything runs in a single process (DCP ``no_dist``). Rank 0 writes the
manifest and renames, so all ranks must see one shared file system (as DCP's FileSystemWriter already assumes).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

FORMAT = "bagualu2-checkpoint/1"
MANIFEST = "manifest.json"
RNG_JSON_BYTES = 8192  # fixed size of the packed python/numpy RNG states, so that they load in place
STEP_DIR = re.compile(r"step-(\d{8,})")


class CheckpointError(ValueError):
    """A checkpoint cannot be written, found or loaded; the message is one line naming the path."""


class LoadFailed(CheckpointError):
    """DCP could not read a checkpoint that verified (its shards agree with a manifest edited by hand, a file
    system that fails reads): every rank raises it alike. ``reason``: the message without the path."""

    reason = ""


class _Refused(Exception):
    """Internal: why a checkpoint directory does not verify."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without a process group DCP warns on every call that it assumes a single process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _on_rank0(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 only and broadcast its result or error: every rank returns or raises alike."""
    box: list[Any] = [None, None]
    if not _distributed() or dist.get_rank() == 0:
        try:
            box[0] = fn()
        except Exception as exc:  # noqa: BLE001 - a failure must reach the other ranks, not hang them
            box[1] = str(exc) if isinstance(exc, CheckpointError) else f"checkpoint: {type(exc).__name__}: {exc}"
    if _distributed():
        dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise CheckpointError(box[1])
    return box[0]


def _leaves(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of ``state`` by DCP's flattened key (``a.b.0``); CheckpointError for any other leaf."""
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else None
    if items is None or (isinstance(state, list) and not state):
        what = "an empty list" if items is not None else f"a {type(state).__name__}"
        raise CheckpointError(f"checkpoint state: {prefix or 'state'} is {what}, not a tensor (DCP would pickle "
                              "it; encode non-tensor values with pack_json)")
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        name = f"{prefix}.{key}" if prefix else str(key)
        found = {name: value} if isinstance(value, torch.Tensor) else _leaves(value, name)
        if clash := sorted(out.keys() & found.keys()):
            raise CheckpointError(f"checkpoint state: two values flatten to the key {clash[0]!r}")
        out.update(found)
    return out


def _fingerprint(t: torch.Tensor) -> tuple[str, tuple[int, ...], int] | None:
    """Dtype, shape and an exact integer sum of the 32-bit words of a plain tensor (None for DTensor & co)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return None
    raw = t.detach().reshape(-1).contiguous().view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    return str(t.dtype), tuple(t.shape), int(words.sum(dtype=torch.int64).item())


def _agree_on(state: dict[str, Any], step: int | None) -> None:
    """Collective check: every rank's state holds only tensors; when saving (``step`` given) the ranks agree on
    the step and a key held by several ranks has the same value on all of them."""
    try:
        leaves, error = _leaves(state), None
    except CheckpointError as exc:
        leaves, error = {}, str(exc)
    prints = {k: _fingerprint(v) for k, v in leaves.items()} if step is not None and _world() > 1 else {}
    gathered = [(error, step, prints)]
    if _distributed():
        gathered = [None] * _world()
        dist.all_gather_object(gathered, (error, step, prints))
    first: dict[str, tuple[int, Any]] = {}
    for rank, (err, other_step, rank_prints) in enumerate(gathered):
        if err is not None:
            raise CheckpointError(f"{err} (rank {rank})" if _world() > 1 else err)
        if other_step != step:
            raise CheckpointError(f"checkpoint save: ranks disagree on the step: {step} vs {other_step} (rank {rank})")
        for key, value in rank_prints.items():
            owner, seen = first.setdefault(key, (rank, value))
            if value is not None and seen is not None and value != seen:
                raise CheckpointError(f"checkpoint state: key {key!r} differs between ranks {owner} and {rank}; DCP "
                                      "keeps one copy of a shared key, so rank-specific values need rank-specific keys")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    if os.name == "posix":  # elsewhere directories cannot be opened
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _check(path: Path, step: int | None, hashes: bool) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` after checking its files; raises _Refused with the reason."""
    if not path.is_dir():
        raise _Refused("missing or not a directory")
    if (path / MANIFEST).exists() and not (path / MANIFEST).is_file():  # a FIFO would block the read
        raise _Refused(f"{MANIFEST} is not a regular file")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise _Refused(f"missing {MANIFEST} (partial checkpoint)") from None
    except (OSError, ValueError) as exc:
        raise _Refused(f"invalid {MANIFEST}: {exc}") from None
    except RecursionError:  # JSON nested deeper than the parser goes: garbage, not a manifest
        raise _Refused(f"invalid {MANIFEST}: nested too deeply") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise _Refused(f"invalid {MANIFEST}: format is not {FORMAT}")
    files = manifest.get("files")
    if not isinstance(files, dict) or ".metadata" not in files or not isinstance(manifest.get("world_size"), int):
        raise _Refused(f"invalid {MANIFEST}: no world size or no DCP .metadata listed")
    if step is not None and manifest.get("step") != step:
        raise _Refused(f"{MANIFEST} records step {manifest.get('step')!r}, not {step} (its folder's name)")
    for name, record in sorted(files.items()):
        if Path(name).is_absolute() or ".." in Path(name).parts or not isinstance(record, dict):
            raise _Refused(f"invalid {MANIFEST}: bad entry {name!r}")
        file = path / name
        if not file.is_file():
            raise _Refused(f"file {name}: missing")
        if file.stat().st_size != record.get("size"):
            raise _Refused(f"file {name}: size {file.stat().st_size} != recorded {record.get('size')}")
    for name, record in sorted(files.items()) if hashes else ():
        if _sha256(path / name) != record.get("sha256"):
            raise _Refused(f"file {name}: sha256 mismatch")
    return manifest


def _complete(path: Path, step: int) -> bool:
    """Whether ``path`` is a complete checkpoint of ``step`` (its manifest and file sizes check; what retention
    counts, so a corrupt newer directory never pushes a valid checkpoint out)."""
    try:
        _check(path, step, hashes=False)
    except _Refused:
        return False
    return True


def _dcp():
    """``torch.distributed.checkpoint``, imported on first use (a second of start-up every run without
    checkpoints would otherwise pay)."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _failing_writer(path: Path, error: OSError):
    """DCP's file-system writer whose writes end with ``error`` after writing (fault injection: a full disk)."""

    class FailingWriter(_dcp().FileSystemWriter):
        def write_data(self, plan, planner):
            super().write_data(plan, planner).wait()
            raise error

    return FailingWriter(path)


def _os_cause(exc: BaseException | None, where: Path) -> str:
    """Why a write failed, in words: the OSError behind ``exc`` (also inside DCP's gathered failures), else a full
    file system when that is what torch's zip writer's bare error means, else the error's first line."""
    seen, queue, first = set(), [exc], None
    while queue:
        item = queue.pop(0)
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        first = first or item
        if isinstance(item, OSError) and item.errno is not None:
            name = errno.errorcode.get(item.errno, str(item.errno))
            return f"{item.strerror or os.strerror(item.errno)} ({name})"
        if isinstance(item, _dcp().CheckpointException):
            queue.extend(inner for inner, _ in item.failures.values())
        queue.extend((item.__cause__, item.__context__))
    try:
        free = shutil.disk_usage(where if where.exists() else where.parent).free
    except OSError:
        free = None
    if free is not None and free < (64 << 20):
        return f"{os.strerror(errno.ENOSPC)} (ENOSPC: {free} bytes free)"
    text = (str(first).splitlines() or [""])[0] if first is not None else ""
    return f"{type(first).__name__}: {text}"


def save(directory: str | os.PathLike[str], step: int, state: dict[str, Any], *, keep: int = 2,
         write_error: OSError | None = None, after_write: Callable[[], None] | None = None,
         run: dict[str, Any] | None = None) -> Path:
    """Collective: write ``state`` (this rank's tensors) as checkpoint ``<directory>/step-<step:08d>``.

    DCP writes every rank's shards to ``.tmp-step-<step>-<random>``; after a barrier rank 0 writes and fsyncs the
    manifest, renames the directory into place, deletes all but the newest ``keep`` complete checkpoints and
    stale ``.tmp-*`` directories of earlier saves. Re-saving a step replaces its checkpoint; any other existing
    path of that name is refused. Returns the checkpoint's path.

    A write that fails on any rank (a full disk, a directory that cannot be written) raises
    :class:`CheckpointError` on every rank with one line naming the path and the cause; the temporary directory is
    removed and the earlier checkpoints are untouched. ``write_error`` makes this rank's write fail with it after
    writing (fault injection); ``after_write`` runs when this rank's shards are written, before the checkpoint is
    complete. ``run``: what the run's numbers depend on beyond ``state`` (JSON values by flag), kept in the
    manifest for :func:`load` to compare.
    """
    if not isinstance(step, int) or step < 0 or not isinstance(keep, int) or keep < 1:
        raise CheckpointError(f"checkpoint save: step must be an int >= 0 and keep >= 1, got {step!r}, {keep!r}")
    root = Path(directory)
    final = root / f"step-{step:08d}"
    _agree_on(state, step)

    def refuse_final() -> None:
        if final.is_symlink() or (final.exists() and not (final / MANIFEST).is_file()):
            raise CheckpointError(f"checkpoint {final}: exists and is not a checkpoint directory; not replacing it")

    def prepare() -> tuple[str, float]:
        if root.exists() and not root.is_dir():
            raise CheckpointError(f"checkpoint directory {root}: exists and is not a directory")
        refuse_final()
        tmp = root / f".tmp-step-{step:08d}-{secrets.token_hex(4)}"
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            probe = tmp / ".probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"checkpoint {final} not written: {root} cannot be written: "
                                  f"{_os_cause(exc, root)}; earlier checkpoints are kept") from None
        return str(tmp), tmp.stat().st_mtime

    tmp_name, started = _on_rank0(prepare)
    tmp = Path(tmp_name)
    dcp = _dcp()
    try:
        with _quiet():
            if write_error is not None:
                dcp.save(state, storage_writer=_failing_writer(tmp, write_error))
            else:
                dcp.save(state, checkpoint_id=tmp)
    except (Exception, dcp.CheckpointException) as exc:  # DCP gathers every rank's failure: all ranks are here
        cause = _os_cause(exc, tmp)
        _on_rank0(lambda: shutil.rmtree(tmp, ignore_errors=True))
        raise CheckpointError(f"checkpoint {final} not written: {cause} (writing {tmp}); earlier checkpoints "
                              "are kept") from None
    if after_write is not None:
        after_write()
    if _distributed():
        dist.barrier()

    def finalize() -> str:
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {"format": FORMAT, "step": step, "world_size": _world(), "torch_version": torch.__version__,
                    "files": {p.relative_to(tmp).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
                              for p in files}}
        if run is not None:
            manifest["run"] = run
        try:
            with open(tmp / MANIFEST, "w") as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"checkpoint {final} not written: {_os_cause(exc, tmp)} (writing {tmp / MANIFEST}); "
                                  "earlier checkpoints are kept") from None
        refuse_final()
        old = root / f"{tmp.name}-replaced"
        if final.exists():
            os.replace(final, old)  # a directory cannot be renamed onto a non-empty one
        os.replace(tmp, final)
        _fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
        others = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.fullmatch(p.name))
                        and p != final and not p.is_symlink() and _complete(p, int(m.group(1))))
        for _, p in others[:max(0, len(others) - keep + 1)]:  # the one just written always stays
            # renamed first: a kill mid-removal leaves a .tmp-* directory the next save sweeps, not a step-* one
            # that is neither complete nor ever removed
            doomed = root / f".tmp-{p.name}-{secrets.token_hex(4)}-removed"
            os.replace(p, doomed)
            shutil.rmtree(doomed)
        for p in root.glob(".tmp-*"):
            if p.is_dir() and not p.is_symlink() and p.stat().st_mtime < started:
                shutil.rmtree(p, ignore_errors=True)
        return str(final)

    return Path(_on_rank0(finalize))


def step_dirs(directory: str | os.PathLike[str]) -> list[str]:
    """Collective: the names of the ``step-*`` entries in ``directory`` (complete or not), oldest first, as rank 0
    sees them."""
    root = Path(directory)

    def scan() -> list[str]:
        if not root.is_dir():
            return []
        steps = sorted((int(m.group(1)), p.name) for p in root.iterdir() if (m := STEP_DIR.fullmatch(p.name)))
        return [name for _, name in steps]

    return _on_rank0(scan)


def find_latest(directory: str | os.PathLike[str], *, below: int | None = None) -> tuple[Path, int] | None:
    """The newest complete, verified checkpoint in ``directory`` as ``(path, step)``, or None (no ``step-*``
    checkpoint there); ``CheckpointError`` when there are some and none verifies. ``below``: only checkpoints of
    an earlier step (the one after a checkpoint that failed to load).

    Rank 0 verifies (every file of the manifest with its size and sha256) and broadcasts its choice; it prints
    one ``warning: checkpoint ... refused: <reason>; using ...`` line per skipped ``step-*`` or ``.tmp-*`` dir.
    """
    root = Path(directory)

    def scan() -> tuple[str, int] | None:
        if not root.exists():
            return None
        if not root.is_dir():
            raise CheckpointError(f"checkpoint directory {root}: exists and is not a directory")
        refused = [] if below is not None else [  # said already by the search that found the one that failed
            (p, "partial (temporary directory of an interrupted save)") for p in sorted(root.glob(".tmp-*"))]
        chosen = None
        for step, path in sorted(((int(m.group(1)), p) for p in root.iterdir()
                                  if (m := STEP_DIR.fullmatch(p.name)) and (below is None or int(m.group(1)) < below)),
                                 reverse=True):
            try:
                _check(path, step, hashes=True)
            except _Refused as exc:
                refused.append((path, str(exc)))
                continue
            chosen = (str(path), step)
            break
        for path, reason in refused:
            print(f"warning: checkpoint {path} refused: {reason}; using {chosen[0] if chosen else 'none'}",
                  file=sys.stderr, flush=True)
        failed = [path.name for path, _ in refused if STEP_DIR.fullmatch(path.name)]
        if chosen is None and failed:  # starting over would retrain and overwrite them: the operator decides
            raise CheckpointError(f"every checkpoint in {root} failed verification ({', '.join(failed[:3])}"
                                  f"{', ...' if len(failed) > 3 else ''}; the warnings above say why): none can be "
                                  "resumed; move them away to start from step 0, or give another --checkpoint-dir")
        return chosen

    found = _on_rank0(scan)
    return None if found is None else (Path(found[0]), found[1])


def load(path: str | os.PathLike[str], state: dict[str, Any], *, run: dict[str, Any] | None = None) -> int:
    """Collective: load the checkpoint at ``path`` into ``state`` in place and return its step.

    ``state`` must have the keys, shapes and dtypes this rank saved. Rank 0 checks the manifest (world size,
    files present with their sizes; :func:`find_latest` checks the hashes) before DCP reads anything, and that
    each entry of ``run`` equals what the checkpoint's :func:`save` recorded under that flag (one
    :class:`CheckpointError` naming the first that differs; a checkpoint that recorded none is not compared).
    """
    ckpt = Path(path)
    _agree_on(state, None)

    def check() -> int:
        try:
            manifest = _check(ckpt, None, hashes=False)
        except _Refused as exc:
            raise CheckpointError(f"checkpoint {ckpt} refused: {exc}") from None
        if manifest["world_size"] != _world():
            raise CheckpointError(f"checkpoint {ckpt}: saved by {manifest['world_size']} ranks, "
                                  f"this job has {_world()}")
        saved = manifest.get("run")
        if isinstance(saved, dict) and run is not None:
            for flag, mine in json.loads(json.dumps(run)).items():  # as JSON stores it: tuples become lists
                difference = _difference(flag, saved.get(flag, mine), mine)
                if difference is not None:
                    raise CheckpointError(f"checkpoint {ckpt} was trained with {difference}: a resume continues "
                                          "the same training; give the checkpoint's value, or start a new run "
                                          "in another directory")
        return int(manifest["step"])

    step = _on_rank0(check)
    dcp = _dcp()
    try:
        with _quiet():
            dcp.load(state, checkpoint_id=ckpt)
    except dcp.CheckpointException as exc:
        reason = f"DCP load failed: {_failure(exc)}"
        failed = LoadFailed(f"checkpoint {ckpt}: {reason}")
        failed.reason = reason
        raise failed from exc
    return step


def load_latest(directory: str | os.PathLike[str], state: dict[str, Any], *, run: dict[str, Any] | None = None,
                found: tuple[Path, int] | None = None) -> tuple[Path, int] | None:
    """Collective: :func:`load` the newest verified checkpoint of ``directory`` (``found``, when
    :func:`find_latest` has said it) into ``state``; one that DCP cannot read is refused with a warning line
    (rank 0) and the one before it loaded instead, as :func:`find_latest` refuses one that does not verify.
    ``(path, step)``, or None when there is none; ``CheckpointError`` when the last one fails too."""
    found = find_latest(directory) if found is None else found
    while found is not None:
        try:
            return found[0], load(found[0], state, run=run)
        except LoadFailed as exc:
            older = find_latest(directory, below=found[1])
            if not _distributed() or dist.get_rank() == 0:
                print(f"warning: checkpoint {found[0]} refused: {exc.reason}; using {older[0] if older else 'none'}",
                      file=sys.stderr, flush=True)
            if older is None:
                raise CheckpointError(f"{exc}; no earlier checkpoint in {directory} verifies: none can be resumed; "
                                      "move it away to start from step 0, or give another --checkpoint-dir") from None
            found = older
    return None


def _difference(flag: str, saved: Any, mine: Any) -> str | None:
    """How a checkpoint's value of ``flag`` differs from this run's, as text; None when they are equal. A dict
    (the model a recipe makes) names its first differing field."""
    if saved == mine:
        return None
    if isinstance(saved, dict) and isinstance(mine, dict):
        key = next(k for k in sorted(set(saved) | set(mine)) if saved.get(k) != mine.get(k))
        return f"another {flag} ({key} {saved.get(key)!r}; this run's: {mine.get(key)!r})"
    return f"{flag} {saved!r}; this run has {flag} {mine!r}"


def _failure(exc) -> str:
    """The first rank's underlying error of a DCP exception, on one line."""
    rank, (inner, _) = min(exc.failures.items(), key=lambda item: item[0])
    return f"rank {rank}: {type(inner).__name__}: {(str(inner).splitlines() or [''])[0]}"


def pack_json(obj: Any, size: int | None = None) -> torch.Tensor:
    """``obj`` as strict JSON in a uint8 tensor; ``size`` pads it with spaces to a fixed length (to load in place)."""
    try:
        data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"pack_json: not JSON-serialisable: {exc}") from None
    if size is not None:
        if len(data) > size:
            raise CheckpointError(f"pack_json: {len(data)} bytes do not fit in size={size}")
        data += b" " * (size - len(data))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def unpack_json(t: torch.Tensor) -> Any:
    """The object packed by :func:`pack_json` (trailing padding ignored)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1:
        raise CheckpointError("unpack_json: expected a 1-d uint8 tensor")
    try:
        return json.loads(t.detach().cpu().numpy().tobytes().decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"unpack_json: not a JSON payload: {exc}") from None


def rng_state() -> dict[str, torch.Tensor]:
    """Torch CPU (``torch``), CUDA (``cuda<i>``), Python ``random`` and numpy global RNG states as tensors."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    state = {"torch": torch.get_rng_state(),
             "python": pack_json([version, list(internal), gauss], RNG_JSON_BYTES),
             "numpy": pack_json([name, keys.tolist(), pos, has_gauss, cached], RNG_JSON_BYTES)}
    if torch.cuda.is_available():
        state.update({f"cuda{i}": t for i, t in enumerate(torch.cuda.get_rng_state_all())})
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore the states of :func:`rng_state` (CUDA ones for the devices present)."""
    missing = {"torch", "python", "numpy"} - state.keys()
    if missing:
        raise CheckpointError(f"set_rng_state: missing {sorted(missing)}")
    torch.set_rng_state(state["torch"].detach().cpu())
    version, internal, gauss = unpack_json(state["python"])
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = unpack_json(state["numpy"])
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    for key, t in state.items():
        if key.startswith("cuda") and torch.cuda.is_available() and int(key[4:]) < torch.cuda.device_count():
            torch.cuda.set_rng_state(t.detach().cpu(), int(key[4:]))
