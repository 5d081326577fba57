"""The ``--worker OUT -- TRAINER FLAGS`` entry shared by the benchmarks that run the trainer under torchrun with
their own instrumentation (``a2a_overlap.py``, ``compute_share.py``): torchrun starts the benchmark's own file, which
hands the trainer's flags to its worker."""

from __future__ import annotations


def worker_argv(argv: list[str]) -> tuple[str, list[str]] | None:
    """``(OUT, trainer flags)`` when ``argv`` (``sys.argv``) is a worker's, else None (the benchmark's own run)."""
    if len(argv) > 2 and argv[1] == "--worker":
        rest = argv[3:]
        return argv[2], rest[1:] if rest[:1] == ["--"] else rest
    return None
