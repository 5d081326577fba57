"""The ``bagualu2`` typer app. Register each command here, one line each, from its own ``*_cmd`` module."""

from __future__ import annotations

import contextlib
import sys
from typing import Annotated, Optional

import typer

from bagualu2 import __version__

from . import budget_cmd, compare_cmd, curve_cmd, demo_cmd, memory_cmd, plan_cmd, presets_cmd
from . import reproduce_cmd, schedule_cmd, simulate_cmd, train_cmd
from .common import EXIT_USAGE
from .usage import OneLineErrors

app = typer.Typer(
    name="bagualu2",
    help="BaGuaLu-2: inspect activation-memory plans, budgets, memory curves and schedules of MoE training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=OneLineErrors,  # typer's parse errors as one line, exit code 2
)

# ---- commands (one line each) ----------------------------------------
app.command("presets")(presets_cmd.presets)
app.command("memory")(memory_cmd.memory)
app.command("plan")(plan_cmd.plan)
app.command("schedule")(schedule_cmd.schedule)
app.command("demo")(demo_cmd.demo)
app.command("budget")(budget_cmd.budget)
app.command("curve")(curve_cmd.curve)
app.command("compare")(compare_cmd.compare)
app.command("simulate")(simulate_cmd.simulate_cmd)
app.command("reproduce")(reproduce_cmd.reproduce_cmd)
app.command("train", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
            options_metavar="[OPTIONS] [-- TRAINER FLAGS]")(train_cmd.train)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"bagualu2 {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
) -> None:
    """BaGuaLu-2: inspect activation-memory plans, budgets, memory curves and schedules of MoE training."""


def main() -> None:
    """Console-script entry point (``bagualu2``). Started with standard output closed (``>&-``), where no result
    could be delivered, it says so in one line and exits with code 2."""
    if sys.stdout is None:
        if sys.stderr is not None:
            sys.stderr.write("error: standard output is closed; redirect it to a file or to /dev/null\n")
        sys.exit(EXIT_USAGE)
    for stream in (sys.stdout, sys.stderr):  # a character the stream's encoding lacks (µ under ASCII) is escaped
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(errors="backslashreplace")
    app()
