"""The experiments' command lines: one ``error:`` line and exit code 2 for a bad flag, as the trainer's."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn

from bagualu2.costmodel.validate import probe_folder, refuse_non_file

EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """``argparse`` whose errors are one line, ``error: <message>``, exit code 2 (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"error: {' '.join(message.split())}\n")


def check_output_file(parser: argparse.ArgumentParser, flag: str, path: Path | None) -> None:
    """Before any run: ``path`` must name a file that can be written (an existing path is a regular file, its
    folder exists and takes new files), else one line naming ``flag``."""
    if path is None:
        return
    try:
        refuse_non_file(path)
    except OSError as exc:
        parser.error(f"{flag} {path}: not a regular file; it {exc.strerror}")
    if not path.parent.is_dir():
        parser.error(f"{flag} {path}: its folder {path.parent} does not exist")
    try:
        probe_folder(path.parent, make=False)
    except OSError as exc:
        parser.error(f"{flag} {path}: cannot write files in {path.parent} ({exc.strerror or exc})")


def error_line(stderr: str) -> str:
    """The last ``error:`` line of a run's stderr (the trainer's own), else its last line."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["no output"])[-1]
