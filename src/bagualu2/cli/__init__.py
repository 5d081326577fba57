"""The ``bagualu2`` command line (typer + rich). Commands live in ``*_cmd`` modules, registered in ``app.py``."""

from .app import app, main

__all__ = ["app", "main"]
