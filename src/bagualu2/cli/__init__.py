"""The ``bagualu2`` command line (typer + rich). Commands live in ``*_cmd`` modules, registered in ``commands.py``.

The package itself imports nothing heavy: ``python -m bagualu2.cli.launch`` (the torchrun agent of
``bagualu2 train``) starts without the commands, and ``app`` is imported on first use."""

from __future__ import annotations

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point (``bagualu2``): Ctrl-C while the commands import, or before a command's own
    handling stands, ends with exit code 130 and no traceback."""
    try:
        from .commands import main as run

        run()
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def __getattr__(name: str):
    if name == "app":
        from .commands import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
