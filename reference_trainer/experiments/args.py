"""The experiments' command lines: one ``error:`` line and exit code 2 for a bad flag, as the trainer's."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import NoReturn

EXIT_USAGE = 2


class OneLineParser(argparse.ArgumentParser):
    """``argparse`` whose errors are one line, ``error: <message>``, exit code 2 (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"error: {' '.join(message.split())}\n")


def check_output_file(parser: argparse.ArgumentParser, flag: str, path: Path | None) -> None:
    """Before any run: ``path`` must name a file that can be written (its folder exists and takes new files; an
    existing path is a regular file), else one line naming ``flag``."""
    if path is None:
        return
    folder = path.parent if str(path.parent) else Path(".")
    if path.exists() and (path.is_dir() or not path.is_file() or path.is_symlink()):
        parser.error(f"{flag} {path}: not a regular file")
    if not folder.is_dir():
        parser.error(f"{flag} {path}: its folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        parser.error(f"{flag} {path}: its folder {folder} is not writable")


def error_line(stderr: str) -> str:
    """The last ``error:`` line of a run's stderr (the trainer's own), else its last line."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["no output"])[-1]
