"""Typer's own parse errors (a bad ``-s abc``, an unknown option or command, an extra argument) as ONE line.

The app's group class runs click in non-standalone mode and turns every ``click.ClickException`` into
``error: --option: message`` on stderr with exit code 2, like the commands' own errors, and refuses an option
given twice (:func:`repeated_option`; click would keep the last value); ``--help`` and a bare ``bagualu2`` (which
prints the help) are unchanged. It covers ``bagualu2``, ``python -m bagualu2.cli`` and
``typer.testing.CliRunner`` alike, since they all call the group's ``main``. Typer vendors click, so the exception
classes are recognised by name (``ClickException``, ``UsageError``, ...), never imported from a private module.
"""

from __future__ import annotations

import sys
from typing import Any

import typer
from typer.core import TyperGroup

from .common import EXIT_USAGE, MAX_LINE_CHARS


def kinds(exc: BaseException) -> set[str]:
    """The names of ``exc``'s classes (``{"NoSuchOption", "UsageError", "ClickException", ...}``)."""
    return {cls.__name__ for cls in type(exc).__mro__}


def _option_name(param: Any) -> str | None:
    if param is None:
        return None
    opts = [o for o in getattr(param, "opts", ()) if o.startswith("--")] or list(getattr(param, "opts", ()))
    return max(opts, key=len) if opts else param.human_readable_name


def _long_name(ctx: Any, name: str, command: Any = None) -> str:
    """The longest spelling (``--imbalance``) of the option ``name`` (``-r``) of ``ctx``'s command (or of
    ``command``, when the parser raised without a context)."""
    params = ctx.command.get_params(ctx) if ctx is not None else getattr(command, "params", ())
    for param in params:
        if name in getattr(param, "opts", ()):
            return _option_name(param) or name
    return name


def _allowed_options(ctx: Any) -> str:
    if ctx is None:
        return ""
    names = sorted(o for p in ctx.command.get_params(ctx) for o in getattr(p, "opts", ()) if o.startswith("--"))
    return f"; allowed: {', '.join(names)}" if names else ""


def usage_line(exc: Exception, command: Any = None) -> str:
    """One line ``error: [--option: ]message`` for a click/typer parse error (``command``: the subcommand the
    arguments named, for an error raised without a context)."""
    ctx, names = getattr(exc, "ctx", None), kinds(exc)
    if "NoSuchOption" in names:
        text = f"{exc.option_name}: no such option"  # type: ignore[attr-defined]
        possibilities = getattr(exc, "possibilities", None)
        if possibilities:
            text += f" (did you mean {', '.join(sorted(possibilities))}?)"
        text += _allowed_options(ctx)
    elif "BadParameter" in names:  # also MissingParameter
        option = _option_name(getattr(exc, "param", None)) or getattr(exc, "param_hint", None)
        message = getattr(exc, "message", "") or exc.format_message()  # type: ignore[attr-defined]
        text = f"{option}: {message}" if option else message
    elif "BadOptionUsage" in names:
        text = f"{_long_name(ctx, exc.option_name, command)}: {exc.message}"  # type: ignore[attr-defined]
    else:
        text = exc.format_message()  # type: ignore[attr-defined]
        commands = getattr(getattr(ctx, "command", None), "list_commands", None)
        if "No such command" in text and commands is not None:
            text += f" Commands: {', '.join(commands(ctx))}."
        elif "UsageError" in names and ctx is not None:
            text += f" (see '{ctx.command_path} --help')"
    line = "error: " + " ".join(text.split())
    return line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS - 3] + "..."


class OneLineErrors(TyperGroup):
    """The ``bagualu2`` group: parse errors become one line and exit code 2 (see the module docstring)."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        try:
            repeated = repeated_option(*self._split(args))
            if repeated is not None:
                typer.echo(repeated, err=True)
                code = EXIT_USAGE
            else:
                code = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                                    standalone_mode=False, **extra)
        except typer.Abort:
            typer.echo("error: aborted", err=True)
            code = 1
        except OSError as exc:  # e.g. the help (printed while parsing) could not be written: a full disk
            where = "the output" if exc.filename is None else repr(exc.filename)
            typer.echo(" ".join(f"error: input/output error on {where}: {exc.strerror or exc}".split()), err=True)
            code = EXIT_USAGE
        except Exception as exc:
            names = kinds(exc)
            if "ClickException" not in names:
                raise
            if "NoArgsIsHelpError" in names:  # bare ``bagualu2``: the help, as before
                exc.show()  # type: ignore[attr-defined]
                code = exc.exit_code  # type: ignore[attr-defined]
            else:
                typer.echo(usage_line(exc, self._named_command(args)), err=True)
                code = EXIT_USAGE if "UsageError" in names else exc.exit_code  # type: ignore[attr-defined]
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code

    def _named_command(self, args: Any) -> Any:
        """The subcommand the first word of ``args`` (default: the command line) names, or None."""
        return self._split(args)[0]

    def _split(self, args: Any) -> tuple[Any, list[str]]:
        """The subcommand the first word of ``args`` (default: the command line) that is no option names (or
        None), and the words after it."""
        words = [str(word) for word in (sys.argv[1:] if args is None else args)]
        first = next((i for i, word in enumerate(words) if not word.startswith("-")), None)
        return (None, []) if first is None else (self.commands.get(words[first]), words[first + 1:])


def repeated_option(command: Any, words: list[str]) -> str | None:
    """The one-line error for an option of ``command`` given twice in ``words`` (click would keep the last value
    silently; an option that takes several, like ``--spike``, may repeat), else None. The words after ``--`` (the
    trainer's, for ``train``) and the options ``command`` does not know are not looked at."""
    if command is None:
        return None
    single = {}
    for param in getattr(command, "params", ()):
        if getattr(param, "multiple", False) or not hasattr(param, "opts"):
            continue
        for spelling in (*param.opts, *getattr(param, "secondary_opts", ())):
            single[spelling] = param
    seen: dict[str, str] = {}
    index = 0
    while index < len(words):
        word = words[index]
        if word == "--":
            break
        spelling = word.partition("=")[0] if word.startswith("--") else word[:2] if word.startswith("-") else ""
        param = single.get(spelling)
        index += 1
        if param is None:
            continue
        if not getattr(param, "is_flag", False) and word == spelling:  # its value is the next word
            index += 1
        if param.name in seen:
            first = seen[param.name]
            also = f" (as {first} and {spelling})" if first != spelling else ""
            return f"error: {_option_name(param)}: given more than once{also}; give it once"
        seen[param.name] = spelling
    return None
