"""The distributed reference trainer: GLM-MoE on torch.distributed, PP x DP (EP carved from DP), per-micro-batch
activation provisioning on every stage (BaGuaLu-2 §III–§V end to end).

    torchrun --nproc_per_node=4 -m reference_trainer.train --recipe glm_moe_debug --steps 50
    python -m reference_trainer.train --recipe glm_moe_debug --pp 1 --dp 1 --ep 1     # one process

Flags override the recipe's fields (``--help``; docs/trainer.md). User errors — bad flags, bad layouts, a cap
below full recompute, unreadable data — are one line on stderr from rank 0 with exit code 2, on every rank before
any collective; the other ranks exit quietly.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
import traceback
from typing import Any, NoReturn, Sequence


def _quiet_interrupt(kind, value, tb) -> None:
    """Ctrl-C (or the launcher's SIGINT) while the trainer starts (its imports, the flags' agreement): the launcher
    reports the stop in one line, so the interrupted rank prints no traceback (it still exits by SIGINT)."""
    if not issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)


def _quiet_unraisable(info) -> None:
    if not issubclass(info.exc_type, KeyboardInterrupt):  # "Exception ignored in ..." of an interrupted import
        sys.__unraisablehook__(info)


def _exit_on_interrupt(signum, _frame) -> NoReturn:
    """Ctrl-C while the modules below import: exit at once, quietly. A KeyboardInterrupt raised there can land in a
    C++ callback of torch's import, which then aborts the process ("terminate called after throwing an instance of
    'pybind11::error_already_set'", SIGABRT) instead of exiting by the signal."""
    os._exit(128 + signum)


if __name__ == "__main__":  # before the imports below, which take seconds (torch)
    sys.excepthook, sys.unraisablehook = _quiet_interrupt, _quiet_unraisable
    signal.signal(signal.SIGINT, _exit_on_interrupt)  # until main() starts: the imports are done then
    # ``bagualu2 train``'s agent starts the ranks with SIGINT blocked (a Ctrl-C in the interpreter's own start-up
    # would print its fatal error): one that came meanwhile is delivered now, to the handler above
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

from . import startup
from .policies import POLICIES
from .recipes import NONFINITE, RECIPES, SCHEDULES, TrainConfig, parse_bytes, recipe
from bagualu2.costmodel.validate import parse_float, parse_int

CHOICES = {"--schedule": SCHEDULES, "--policy": POLICIES, "--on-nonfinite": NONFINITE}


def integer(text: str) -> int:
    """An integer flag: decimal digits with an optional sign."""
    return parse_int(text)


def number(text: str) -> float:
    """A number flag: ``float`` without Python's digit separators (``1_0``) and non-ASCII digits."""
    return parse_float(text)


FLAGS = {  # flag -> (TrainConfig field, type)
    "--steps": ("steps", integer), "--pp": ("pp", integer), "--dp": ("dp", integer), "--ep": ("ep", integer),
    "--vp": ("vp", integer),
    "--num-microbatches": ("num_microbatches", integer), "--lr": ("lr", number), "--seed": ("seed", integer),
    "--schedule": ("schedule", str), "--policy": ("policy", str), "--downgrade": ("downgrade", str),
    "--memory-cap": ("memory_cap_bytes", parse_bytes), "--memory-cap-fraction": ("memory_cap_fraction", number),
    "--memory-cap-imbalance": ("memory_cap_imbalance", number),
    "--spike-rate": ("spike_rate", number), "--spike-max": ("spike_max", number), "--device": ("device", str),
    "--hardware": ("hardware", str), "--data": ("data", str), "--metrics-file": ("metrics_file", str),
    "--checkpoint-dir": ("checkpoint_dir", str), "--checkpoint-every": ("checkpoint_every", integer),
    "--bias-update-rate": ("bias_update_rate", number), "--warmup-steps": ("warmup_steps", integer),
    "--prediction-scale": ("prediction_scale", number), "--collective-timeout": ("collective_timeout_s", number),
    "--on-nonfinite": ("on_nonfinite", str),
}
# TrainConfig field -> the flag that sets it (the fields no flag sets come from the recipe)
FLAG_NAMES = {**{field: flag for flag, (field, _) in FLAGS.items()},
              "resume": "--resume", "paired": "--paired", "model": "--recipe", "extra": "--recipe"}


def _process_groups() -> bool:
    """Are torch.distributed's process groups up? Never imports torch: an interrupt can land in its import, which
    is then half done."""
    dist = sys.modules.get("torch.distributed")
    try:
        return dist is not None and dist.is_available() and dist.is_initialized()
    except Exception:  # a module left half-imported by the interrupt: no group was made with it
        return False


def _leave(code: int) -> NoReturn:
    """Exit with ``code`` without interpreter teardown: process groups destroyed during finalization can abort the
    process in gloo's worker threads ("terminate called without an active exception", SIGABRT) instead of exiting
    with the code."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _usage_error(message: str) -> NoReturn:
    """argparse's error: a user error like any other (``main`` reports it, after the ranks agree). A flag whose
    value starts with ``-`` (``--memory-cap -5MiB``) reads to argparse as a flag without a value: say how to give
    one."""
    missing = re.fullmatch(r"argument (--[\w-]+): expected one argument", message)
    if missing:
        flag = missing[1]
        message = f"{flag} needs a value (a value that starts with '-' is given as {flag}=VALUE)"
    raise ValueError(message)


def _with_flag(message: str) -> str:
    """A config field's error (``num_microbatches must be ...``) led by the flag that sets it."""
    field = message.split(" ", 1)[0]
    flag = FLAG_NAMES.get(field)
    return f"{flag}: {message}" if flag is not None and message.startswith(f"{field} must") else message


def _fail(message: str) -> NoReturn:
    """One line on stderr and exit code 2; under torchrun only rank 0 reports, the others exit quietly."""
    if _rank() == 0:
        sys.stderr.write(f"error: {' '.join(str(message).split())}\n")
        sys.stderr.flush()
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # let rank 0 report first: torchrun stops the other workers as soon as one exits with an error
        time.sleep(5.0)
    raise SystemExit(2)


def parse_args(argv: Sequence[str] | None = None) -> tuple[TrainConfig, argparse.Namespace]:
    """The run's config: the recipe with the given flags applied (ValueError / SystemExit(2) on bad input)."""
    parser = argparse.ArgumentParser(prog="python -m reference_trainer.train", allow_abbrev=False,
                                     description="The distributed reference trainer (docs/trainer.md): GLM-MoE, PP x "
                                     "DP (EP carved from DP), per-micro-batch activation provisioning.")
    parser.add_argument("--recipe", default="glm_moe_debug", help=f"one of {', '.join(RECIPES)}")
    for flag, (field, kind) in FLAGS.items():  # values parsed below: the config names what a bad one may be
        parser.add_argument(flag, dest=field, default=None, choices=CHOICES.get(flag),
                            help=f"TrainConfig.{field} (default: the recipe's)")
    parser.add_argument("--resume", action="store_true", default=None, help="from the latest complete checkpoint")
    parser.add_argument("--paired", action=argparse.BooleanOptionalAction, default=None,
                        help="TrainConfig.paired: combined 1F1B, one more warmup forward per stage (default: on for "
                        "--schedule runtime at --pp 1 under expert parallelism)")
    parser.add_argument("--json", action="store_true", help="print the summary record on stdout (rank 0)")
    parser.add_argument("--world-size", action="store_true",
                        help="print the world size (--pp x --dp) the flags need, and exit")
    parser.add_argument("--check", action="store_true",
                        help="with --world-size: first check the data and the output paths as a launch does "
                        "(not the CUDA device), leaving nothing on disk")
    parser.error = _usage_error  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    config = recipe(args.recipe)
    changes: dict[str, Any] = {}
    for flag, (field, kind) in FLAGS.items():
        value = getattr(args, field)
        if value is None:
            continue
        if kind is parse_bytes:
            changes[field] = kind(value, flag)
        elif kind is str:
            changes[field] = value
        else:
            try:
                changes[field] = kind(value)
            except ValueError:  # not a number: the config refuses it, naming the range (--steps must be ...)
                changes[field] = value
    if "memory_cap_fraction" in changes and "memory_cap_imbalance" not in changes:
        changes["memory_cap_imbalance"] = None  # the fraction given on the command line decides the default cap
    if args.resume:
        changes["resume"] = True
    if args.paired is not None:
        changes["paired"] = args.paired
    changes["extra"] = {**config.extra, "recipe": args.recipe}
    return config.with_overrides(**changes), args


def main(argv: Sequence[str] | None = None) -> None:
    if signal.getsignal(signal.SIGINT) is _exit_on_interrupt:  # the imports are done: Ctrl-C is a KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    startup.die_with_launcher()
    config = None
    try:
        config, args = parse_args(argv)
        if args.check and not args.world_size:
            raise ValueError("--check needs --world-size")
        if args.world_size:
            if args.check:
                from .loop import prepare

                prepare(config, dry_run=True)  # everything a launch checks before its first collective
            else:
                from .recipes import minimum_cap

                minimum_cap(config)  # the layout's checks (the model and parallel configs, the floor)
            print(config.world_size)
            return
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != config.world_size:
            raise ValueError(f"the world size {world} must equal --pp x --dp = {config.pp} x {config.dp} "
                             f"(launch with torchrun --nproc_per_node={config.world_size})")
        from .loop import prepare

        startup.one_thread_unless_told()
        run = prepare(config)  # everything that can fail on user input, before any collective
        report = {"config": startup.fingerprint(config)}
    except ValueError as exc:
        message = _with_flag(str(exc))
        if not startup.launched():
            _fail(message)
        report = {"error": " ".join(message.split())}
    if startup.launched():  # every rank's flags are good and the same, or one line from rank 0 and exit code 2
        startup.agree(report, FLAG_NAMES, config.collective_timeout_s if config is not None else None)
    try:
        summary = run.train()
        run.close()  # its final barrier is a collective too
    except KeyboardInterrupt:
        if not _process_groups():
            raise SystemExit(130) from None
        _leave(130)  # with process groups alive: no interpreter teardown (see _leave)
    except Exception as exc:  # a collective that failed outside the step loop (set-up, resume): one line
        from .watchdog import STALL_EXIT_CODE, collective_failure, exit_after_failure, termination_signal

        signum = termination_signal(exc)
        if signum is not None:  # the launcher stops this rank (a peer failed first and reported it): exit quietly
            _leave(128 + signum)
        failed = collective_failure(exc)
        if failed is None:
            if not _process_groups():
                raise
            traceback.print_exc()  # a defect, not a user error: its traceback, then exit 1
            _leave(1)
        guard = getattr(run.session, "guard", None)
        if guard is not None:  # the session is set up: its line names the phase and the ranks that went silent
            guard.fatal(exc, guard.watchdog.step)  # exits (a failed collective); step -1 before the first step
        else:
            exit_after_failure(failed, f"error: rank {_rank()}: a collective failed ({type(failed).__name__}: "
                                       f"{' '.join(str(failed).split())[:300]}); exit code {STALL_EXIT_CODE}")
    if args.json and _rank() == 0:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
    _leave(0)  # a finished run, its process groups (the model's and the session's sub-groups) still referenced
