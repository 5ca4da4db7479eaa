"""The settings table's flags on a command: :func:`setting_flags` adds one option per setting to a Typer
command, generated from :data:`localllm.config.settings.SETTINGS` (its flag, short form, type, default and
description), so that ``serve`` and ``chat`` take the same flags, written once; :func:`flags_argv` is the
inverse, the command line that gives a command the same flags (``serve --detach`` starts its child with it).

An option left out is ``None``: :func:`~localllm.config.settings.load_settings` then keeps what config.toml or
the environment set. A bool setting's flag turns it from its default, and its opposite is there too
(``--fast-math`` / ``--no-fast-math``), so that a flag can undo what config.toml set.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import typer

from localllm.config.settings import BY_NAME, Setting, flag_for

SETTING_FLAGS = "setting_flags"  # the parameter that receives the flags, as {setting name: value or None}


def _bool_flags(setting: Setting) -> tuple[str, str]:
    """A bool setting's two flags: (sets it True, sets it False)."""
    flag = setting.flag or flag_for(setting.name)
    if flag.startswith("--no-"):
        return f"--{flag[5:]}", flag
    return flag, f"--no-{flag[2:]}"


def _parameter(setting: Setting) -> inspect.Parameter:
    if setting.name == "model":
        default = typer.Argument(None, metavar="MODEL", help=setting.description, show_default=False)
        return inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default,
                                 annotation=str | None)
    if setting.type is bool:
        on, off = _bool_flags(setting)
        option = typer.Option(None, f"{on}/{off}", help=setting.description, show_default=False)
    else:
        declarations = [setting.flag, *([setting.short] if setting.short else [])]
        shown = False if setting.default is None else str(setting.default)
        option = typer.Option(None, *declarations, help=setting.description, show_default=shown)
    return inspect.Parameter(setting.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                             annotation=setting.type | None)


def setting_flags(names: Iterable[str]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give the decorated command an option for each setting in ``names`` (``model`` as its argument);
    it receives them in its ``setting_flags`` parameter, a dict for
    :func:`~localllm.config.settings.load_settings`."""
    settings = [BY_NAME[name] for name in names]

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != SETTING_FLAGS]
        generated = [_parameter(s) for s in settings]
        arguments = [p for p in generated if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        options = [p for p in generated if p.kind is inspect.Parameter.KEYWORD_ONLY]

        @functools.wraps(command)
        def with_flags(*args: Any, **kwargs: Any) -> Any:
            flags = {s.name: kwargs.pop(s.name) for s in settings}
            return command(*args, **kwargs, **{SETTING_FLAGS: flags})

        keyword_only = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        with_flags.__signature__ = inspect.Signature(arguments + keyword_only + options)  # type: ignore[attr-defined]
        return with_flags

    return decorate


def flags_argv(flags: dict[str, Any], verbose: bool = False) -> list[str]:
    """The command line that gives a command ``flags`` (None: not given): settings by their flags (the
    ``model`` first, as the argument), any other option as ``--name value``. Never the API key: ``ps``
    shows a command line to every user (``serve --detach`` passes the key in the environment)."""
    argv = [str(flags["model"])] if flags.get("model") else []
    for name, value in flags.items():
        if name in ("model", "api_key") or value is None:
            continue
        setting = BY_NAME.get(name)
        if setting is not None and setting.type is bool:
            on, off = _bool_flags(setting)
            argv.append(on if value else off)
        else:
            flag = setting.flag if setting is not None else flag_for(name)
            argv += [flag, str(value)]
    return argv + ["--verbose"] * verbose
