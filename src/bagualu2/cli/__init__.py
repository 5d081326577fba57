"""The ``bagualu2`` command line (typer + rich). Commands live in ``*_cmd`` modules, registered in ``app.py``."""

try:
    from .app import app, main
except KeyboardInterrupt:  # Ctrl-C while the command line imports its modules: exit code 130, no traceback
    raise SystemExit(130) from None

__all__ = ["app", "main"]
