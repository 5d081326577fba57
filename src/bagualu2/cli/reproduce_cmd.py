"""``bagualu2 reproduce``: regenerate docs/reproduction.md and its plots (the paper's §VI from the simulator)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Optional

import typer

from bagualu2.costmodel import presets
from bagualu2.sim.figures import figures
from bagualu2.sim.report import headline, markdown
from bagualu2.sim.reproduce import ReproduceConfig, WorkerDied, reproduce, steps, table_ii

from .common import (JSON_HELP, CliError, blame, check_device_room, check_output_path, console, echo_json,
                     handle_errors, integer_option, literal, number_in, progress_bar)
from .files import atomic_write_many
from .signals import unwinding

# config field -> option
OPTIONS = {"iterations": "--iterations", "seed": "--seed", "restart_s": "--restart-s", "models": "--model",
           "jobs": "--jobs"}


@handle_errors
def reproduce_cmd(
    iterations: Annotated[int, typer.Option("--iterations", "-n", parser=integer_option(),
                                            help="Paper-trace iterations per run (in [10, "
                                            "10**7]).")] = 1000,
    seed: Annotated[int, typer.Option(parser=integer_option(),
                                      help="Seed of the paper trace (an integer in [0, 2**63)).")] = 0,
    restart_s: Annotated[float, typer.Option("--restart-s", parser=number_in("in [0, 1e9] (seconds)"),
                                              help="Seconds one OOM restart costs (in [0, 1e9]).")
                         ] = 284.0,
    hardware: Annotated[str, typer.Option("--hardware", "-H", help="Hardware preset name.")] = "paper-gpu",
    model: Annotated[Optional[list[str]], typer.Option("--model", "-m", help="Fig. 8's Table II presets; "
                                                       "repeatable; default: all of them.")] = None,
    docs: Annotated[str, typer.Option("--docs", metavar="DIR", help="Folder to write reproduction.md into, made "
                                      "when missing (its plots go to DIR/img).")] = "docs",
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout, after writing "
                                              "the files: the report's ratios beside the paper's.")] = False,
    jobs: Annotated[Optional[int], typer.Option("--jobs", "-j", parser=integer_option(),
                                                help="Worker processes for the simulations (in "
                                                "[1, 1024]; default: the CPUs this process may use, at most one per "
                                                "4 GiB of available memory). The report is the same for any value.")
                                 ] = None,
) -> None:
    """Run the paper's evaluation (§VI: Fig. 8-11, decision overhead) in the simulator and write
    DIR/reproduction.md with its PNG plots (written as one set, atomically); a progress bar runs on stderr."""
    for name in model or ():
        if name.lower() not in table_ii():
            raise CliError(f"unknown Table II preset {name!r}; valid: {', '.join(table_ii())}", "--model")
    with blame("--hardware"):
        hw = presets.hardware(hardware)
    try:
        config = ReproduceConfig(iterations=iterations, seed=seed, restart_s=restart_s, hardware=hardware,
                                 jobs=jobs, **({"models": tuple(dict.fromkeys(model))} if model else {}))
    except ValueError as exc:
        raise CliError(str(exc), next((o for f, o in OPTIONS.items() if str(exc).startswith(f)), None)) from None
    for name in dict.fromkeys((config.focus, *config.models)):  # a device too small: refused before any simulation
        check_device_room(*presets.model(name), hw)
    if not docs:
        raise CliError("must be a folder, got ''", "--docs")
    folder = Path(docs)
    images = folder / "img"
    names = ("repro-fig8.png", "repro-fig9.png", "repro-fig10.png", "repro-fig11.png")
    with blame("--docs"):
        make_folder = not folder.exists() and not folder.is_symlink()  # made after the run, when missing
        if make_folder:
            check_output_path(str(folder), "docs")  # its parent exists and takes a new entry
            report_path = folder / "reproduction.md"
        else:
            report_path = check_output_path(str(folder / "reproduction.md"), "reproduction.md")
        make_images = make_folder or (not images.exists() and not images.is_symlink())
        if not make_images and (images.is_symlink() or not images.is_dir()):  # the plots go into DIR/img itself
            raise ValueError(f"{str(images)!r} is " + ("a symbolic link" if images.is_symlink() else "not a folder")
                             + "; the plots are written only into a folder of that name")
        image_paths = {name: (images / name) if make_images else check_output_path(str(images / name))
                       for name in names}
    progress = progress_bar()
    with progress:
        task = progress.add_task("reproducing", total=steps(config))

        started: list[str] = []

        def advance(label: str) -> None:  # called before each step: the ones started before it are done
            progress.update(task, description=literal(label), completed=len(started))
            started.append(label)

        try:
            with unwinding():  # SIGTERM and SIGHUP unwind too: the simulation workers are stopped, as on Ctrl-C
                report = reproduce(config, progress=advance)
        except WorkerDied as exc:
            raise CliError(str(exc), "--jobs") from None
        progress.update(task, completed=len(started))
    files = [(image_paths[name], data) for name, data in figures(report).items()]
    with blame("--docs"):
        made = []  # the folders this run made: removed again if the write fails
        for path, wanted in ((folder, make_folder), (images, make_images)):
            if wanted and _made(path):
                made.append(path)
        try:  # the report and its plots as one set: on a failure (a full disk) every file stays as it was
            atomic_write_many([*files, (report_path, markdown(report).encode())])
        except BaseException:
            for path in reversed(made):
                with contextlib.suppress(OSError):
                    path.rmdir()
            raise
    if json_output:
        echo_json(headline(report))
        return
    console().print(f"wrote {literal(str(report_path))} and {len(image_paths)} plots in "
                    f"{literal(str(folder / 'img'))}", soft_wrap=True)


def _made(path: Path) -> bool:
    """Make folder ``path``; False when it was made meanwhile (a run takes minutes): used, never removed."""
    try:
        path.mkdir()
    except FileExistsError:
        if not path.is_dir():
            raise
        return False
    return True
