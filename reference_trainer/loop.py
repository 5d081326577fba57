"""The training loop: set-up (everything that can fail on user input comes first), steps, metrics, checkpoints.

Per step: every rank draws its micro-batches (``DomainBatches.micro_batch(step, dp_rank * m + i)``: the same
data for any layout), runs them through its pipeline schedule (``pp > 1``) or the cost model's 1F1B order
(``pp = 1``: F, B alternate; under EP with ``--schedule runtime`` each F_(i+1) fused with B_i), each forward
provisioned by the rank's :class:`~.provision.Provisioner`; then the
gradients are reduced (dense over dp, experts over their replicas), AdamW steps, the routers' expert biases move
towards balance (aux-loss-free, from the routing counts summed over dp), rank 0 gathers the stages' records and
writes one JSONL line. Gradients are scaled by 1/m after the backwards, as the pipelining schedules do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .recipes import TrainConfig, default_cap, minimum_cap


def prepare(config: TrainConfig, *, dry_run: bool = False) -> "Run":
    """Validate everything that depends on user input and load the data; no collective yet. ``dry_run``: the same
    checks but the device's (a launch may be prepared on a machine without the GPUs it runs on), and no folder is
    made (a missing state folder must be one its nearest existing parent can hold)."""
    from bagualu2.costmodel import presets

    from .data import DomainBatches, TokenCorpus, load_tokenizer

    if config.device == "cuda" and not dry_run:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda needs a CUDA device; use --device cpu")
    if config.checkpoint_dir and os.path.exists(config.checkpoint_dir) and not os.path.isdir(config.checkpoint_dir):
        raise ValueError(f"--checkpoint-dir {config.checkpoint_dir} exists and is not a directory")
    if config.checkpoint_dir and config.metrics_file and (
            os.path.abspath(config.metrics_file) == os.path.abspath(config.checkpoint_dir)):
        raise ValueError(f"--metrics-file {config.metrics_file} is the --checkpoint-dir: the metrics are a file in "
                         "or beside that folder")
    if config.metrics_file:  # before the data is read: the data may hold an earlier run's metrics
        from .metrics import check_path, check_writable

        try:
            check_path(config.metrics_file)
            check_writable(config.metrics_file)
        except ValueError as exc:
            raise ValueError(f"--metrics-file: {exc}") from None
        check_metrics_clashes(config)
    tokenizer = load_tokenizer()
    try:
        corpus = TokenCorpus.from_path(config.data, tokenizer) if config.data else TokenCorpus.bundled(tokenizer)
    except ValueError as error:  # the line names the flag that chose the data
        raise ValueError(f"--data: {error}" if config.data else str(error)) from None
    if corpus.vocab_size > config.model.vocab_size:
        raise ValueError(f"the tokenizer's {corpus.vocab_size} tokens exceed the model's vocab_size "
                         f"{config.model.vocab_size}")
    try:
        batches = DomainBatches(corpus, seq_length=config.model.seq_length,
                                micro_batch_size=config.model.micro_batch_size, seed=config.seed)
    except ValueError as error:  # a domain shorter than one of the recipe's sequences
        raise ValueError(f"--data: {error}" if config.data else str(error)) from None
    floor = minimum_cap(config)
    cap = config.memory_cap_bytes if config.memory_cap_bytes is not None else default_cap(config)
    if cap < floor:
        raise ValueError(f"--memory-cap must be at least {floor} bytes ({floor / 2**20:.2f} MiB: full recompute of "
                         f"every in-flight chunk on the busiest stage), got {cap}")
    from .faults import ENV, parse

    parse(os.environ.get(ENV, ""))  # fault injections (tests, chaos runs): a bad spec is a user error
    check_state_dir(config, make=not dry_run)
    return Run(config=config, batches=batches, cap_bytes=cap, hardware=presets.hardware(config.hardware))


def _same_file(a: str, b: str) -> bool:
    """Do ``a`` and ``b`` both exist and name one file (one device and inode: a hard link too)?"""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def check_metrics_clashes(config: TrainConfig) -> None:
    """The metrics file is none of the files the run reads or keeps its state in: not the ``--data`` file, not a
    ``.txt`` / ``.jsonl`` file of the ``--data`` folder (read as data at the next start, a restart's too) — by path,
    or by inode for a hard link —, not a name the run's state takes in its folder (``run_state.json``, the markers,
    the lock) nor, in the checkpoint directory, a checkpoint's (``step-<8+ digits>``)."""
    import fnmatch

    from .checkpoint import STEP_DIR
    from .data import DATA_SUFFIXES, data_files
    from .restarts import LOCK, MARKERS, STATE

    metrics = os.path.realpath(config.metrics_file)
    if config.data:
        data = os.path.realpath(config.data)
        if metrics == data or _same_file(metrics, data):  # the same path, or a hard link to the data file
            raise ValueError(f"--metrics-file {config.metrics_file} is the --data file: the metrics would replace "
                             "the training data")
        if os.path.isdir(data) and ((os.path.dirname(metrics) == data
                                     and os.path.splitext(metrics)[1].lower() in DATA_SUFFIXES)
                                    or any(_same_file(metrics, str(file)) for file in data_files(data))):
            raise ValueError(f"--metrics-file {config.metrics_file} lies in the --data folder, whose .txt and .jsonl "
                             "files are read as training data; put the metrics elsewhere")
    folder, name = os.path.split(metrics)
    in_state = folder == os.path.realpath(config.checkpoint_dir or folder)  # the state folder: the checkpoints'
    reserved = (STATE, LOCK, *MARKERS, f".{STATE}.*")
    if in_state and (any(fnmatch.fnmatchcase(name, pattern) for pattern in reserved)
                     or (config.checkpoint_dir and STEP_DIR.fullmatch(name))):
        raise ValueError(f"--metrics-file {config.metrics_file}: {name} is a name the run keeps its own state under "
                         f"in {folder} ({', '.join(reserved[:-1])}, and checkpoints' step-NNNNNNNN); choose another "
                         "name")


def check_state_dir(config: TrainConfig, *, make: bool = True) -> None:
    """The directory of the run's state (``--checkpoint-dir``, else the metrics file's) exists or can be made,
    takes new files, and its ``run_state.json`` is a regular file if it exists. ``make=False``: a missing directory
    is not made; its nearest existing parent must take new files."""
    from bagualu2.costmodel.validate import probe_folder, refuse_non_file

    from .restarts import MARKERS, STATE

    if config.checkpoint_dir:
        flag, directory = "--checkpoint-dir", config.checkpoint_dir
    elif config.metrics_file:
        flag, directory = "--metrics-file", os.path.dirname(os.path.abspath(config.metrics_file))
    else:
        return
    probed = directory
    if not make:
        while not os.path.lexists(probed) and os.path.dirname(probed) != probed:  # a file on the way fails
            probed = os.path.dirname(probed)
    try:
        probe_folder(probed, make=make)
    except OSError as exc:
        raise ValueError(f"{flag}: cannot write files in {directory} ({exc.strerror or exc})") from None
    names = [os.path.join(directory, STATE)]
    names += [str(path) for pattern in MARKERS for path in Path(directory).glob(pattern)]
    for state in names:  # the run replaces or removes them: each must be a regular file
        try:
            refuse_non_file(state)
        except OSError:
            raise ValueError(f"{flag}: {state} exists and is not a regular file") from None


@dataclass
class Run:
    config: TrainConfig
    batches: Any
    cap_bytes: int
    hardware: Any

    session: Any = None

    def close(self) -> None:
        import torch.distributed as dist

        guard = self.session.guard if self.session is not None else None
        try:
            if dist.is_initialized():
                try:
                    if guard is not None:
                        guard.beat("the final barrier")
                    dist.barrier()
                except Exception as exc:  # a peer stopped or died after the last step: the step loop's one line
                    if guard is not None:
                        guard.fatal(exc, guard.step)
                    raise
                finally:
                    dist.destroy_process_group()
        finally:
            if guard is not None:
                guard.close()
                if self.session.directory_lock is not None:  # the checkpoint directory is free for the next run
                    self.session.directory_lock.close()

    def train(self) -> dict:
        from .session import Session

        self.session = Session(self)
        return self.session.train()
