"""A command's options for the cluster's settings, generated from ``ClusterConfig``.

``@config_options(...)`` gives a typer command one option per setting (all, or ``only`` these,
less ``exclude``), each from the setting's declaration alone: its name (``option_name``), its
type (a ``Literal``'s values as choices, ``X | None`` as an optional ``X``, a list as a repeated
option), its bounds, its help and its default. Typer reads a command's ``__signature__``: the
decorator adds the options there, and calls the command with the values given as one
``ClusterConfig`` (its ``config`` parameter; what was not given is the default). A new setting is
one field of ``ClusterConfig`` and becomes an option of ``up`` with no line here.

Parsing checks what the option's type says (a number's type and bounds; a choice, refused in the
one line ``config_problems`` says); the rest (sizes, job limits, cross-field rules) is
``cluster_config.config_problems``'s, which the command calls.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar, get_args, get_origin

import msgspec
import typer
from typer._types import TyperChoice

from plexctl.common import cluster_config as K
from plexctl.common.errors import UsageError

CONFIG_PARAM = "config"  # the command's parameter that receives the settings

R = TypeVar("R")


@dataclass(frozen=True)
class Style:
    """How one command shows a setting beyond its declaration."""

    help_extra: str = ""  # appended to the setting's help
    metavar: str | None = None
    path: bool = False  # a path (or paths) on this machine: typer's ``<path>``, handed on as ``str``


class SettingChoice(TyperChoice[str]):
    """A ``Literal`` setting's values as choices (listed by ``--help``, completed by the shell); a
    value outside them is refused in ``config_problems``'s one line (``UsageError``, exit 2)."""

    def __init__(self, setting: str) -> None:
        super().__init__(K.choices(setting))
        self.setting = setting

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        problem = K.value_problem(self.setting, value)
        if problem:
            raise UsageError(problem)
        return value


def setting_parameter(setting: str, scoped: bool = True, style: Style = Style()) -> inspect.Parameter:
    """The typer parameter of one setting: ``Annotated[type, typer.Option(...)]`` with its default."""
    base, default = K.value_type(setting), K.default(setting)
    listed = get_origin(base) is list
    item = get_args(base)[0] if listed else base
    option: dict[str, Any] = {"help": K.help_text(setting, scoped) + style.help_extra, **K.bounds(setting)}
    if style.metavar:
        option["metavar"] = style.metavar
    if K.choices(setting):
        item, option["click_type"] = str, SettingChoice(setting)
    elif style.path:
        item = Path
    annotation: Any = list[item] if listed else item  # type: ignore[valid-type]
    if listed or default is None:  # a repeated option given nowhere: None, then the setting's default
        annotation, default = Optional[annotation], None  # noqa: UP045 - typer reads Optional
    return inspect.Parameter(
        setting,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        default=default,
        annotation=Annotated[annotation, typer.Option(K.option_name(setting), **option)],
    )


def given_config(values: Mapping[str, Any]) -> K.ClusterConfig:
    """The settings as parsed (unchecked): each given one, the default of the others; paths as ``str``."""
    given = {
        s: [str(v) for v in value] if isinstance(value, list) else str(value) if isinstance(value, Path) else value
        for s, value in values.items()
        if value is not None or K.default(s) is None
    }
    return msgspec.structs.replace(K.DEFAULTS, **given)


def config_options(
    *,
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
    after: str | None = None,
    scoped: bool = True,
    styles: Mapping[str, Style] | None = None,
) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Give a typer command an option per setting (in declaration order, after its parameter
    ``after``, else last) and its ``config`` parameter the values as one ``ClusterConfig``.
    ``scoped``: help says ``--local:``/``--slurm:`` for settings of one kind of cluster."""
    unknown = {*(only or ()), *exclude, *(styles or {})} - set(K.settings())
    if unknown:
        raise ValueError(f"not settings: {', '.join(sorted(unknown))}")
    names = [s for s in K.settings() if (only is None or s in only) and s not in exclude]

    def decorate(command: Callable[..., R]) -> Callable[..., R]:
        own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != CONFIG_PARAM]
        at = len(own) if after is None else [p.name for p in own].index(after) + 1
        generated = [setting_parameter(s, scoped, (styles or {}).get(s, Style())) for s in names]
        parameters = own[:at] + generated + own[at:]

        @functools.wraps(command)
        def with_config(*args: Any, **kwargs: Any) -> R:
            values = {s: kwargs.pop(s, None) for s in names}  # not given (a call from code): the default
            return command(*args, **kwargs, **{CONFIG_PARAM: given_config(values)})

        with_config.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        with_config.__annotations__ = {p.name: p.annotation for p in parameters}
        return with_config

    return decorate
