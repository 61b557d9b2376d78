"""Environments for multi-turn, tool-using episodes: the registry and the loader.

``ENVS`` maps the built-in names to their classes (``math``, ``code``, ``python_tool``,
``search``); ``load_env`` turns a job spec's ``env`` section (a built-in ``name`` or a custom
``cls: module:Class`` with ``path``, plus ``config``) into a factory that makes one fresh
``Env`` per episode, and raises a one-line ``EnvLoadError`` when the class cannot be imported,
is not an environment, or refuses its config (it builds one instance to check). The
interface itself and the episode runner live in ``plexctl.envs.base``.

It deliberately does not isolate two different modules that share a name: as for custom
rewards, the second one is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from plexctl.common.user_code import import_object, one_line
from plexctl.envs.base import (
    Env,
    Episode,
    MalformedCall,
    RewardEnv,
    StepResult,
    ToolCall,
    episode_batch,
    episode_metrics,
    parse_tool_call,
    run_episodes,
)
from plexctl.envs.code import CodeEnv
from plexctl.envs.math import MathEnv
from plexctl.envs.python_tool import PythonToolEnv, python_tool_tiny_dataset
from plexctl.envs.search import SearchEnv

EnvFactory = Callable[[], Env]

ENVS: dict[str, type] = {
    "math": MathEnv,
    "code": CodeEnv,
    "python_tool": PythonToolEnv,
    "search": SearchEnv,
}

__all__ = [
    "ENVS",
    "Env",
    "EnvFactory",
    "EnvLoadError",
    "Episode",
    "MalformedCall",
    "RewardEnv",
    "StepResult",
    "ToolCall",
    "episode_batch",
    "episode_metrics",
    "load_env",
    "parse_tool_call",
    "python_tool_tiny_dataset",
    "run_episodes",
]


class EnvLoadError(Exception):
    """An environment that cannot be loaded; ``str()`` is one line for the user."""


def load_env(
    name_or_spec: str | Mapping[str, Any] | Any, config: Mapping[str, Any] | None = None, path: str | None = None
) -> EnvFactory:
    """A factory of fresh environments for a built-in name, ``module:Class``, or an ``env`` section.

    An ``env`` section is a mapping (or an object with these attributes): ``name`` (built-in) or
    ``cls`` (``module:Class``) with ``path`` (the directory holding the module), and ``config``
    (keyword arguments of the class). Explicit ``config`` and ``path`` arguments take precedence.
    """
    name, target, spec_path, spec_config = _read_spec(name_or_spec)
    config = dict(spec_config if config is None else config)
    path = path if path is not None else spec_path
    if target is not None:
        cls = _import_class(target, path)
        what = f"env `{target}`"
    elif name in ENVS:
        if path is not None:
            raise EnvLoadError(f"`path` only applies to a custom `cls`, not to the built-in env {name!r}")
        cls, what = ENVS[name], f"env `{name}`"
    else:
        raise EnvLoadError(f"unknown built-in env {name!r} (choices: {', '.join(ENVS)}); or set `cls: module:Class`")
    factory = functools.partial(cls, **config)
    _check_instance(factory, what)
    return factory


def _read_spec(spec: Any) -> tuple[str | None, str | None, str | None, Mapping[str, Any]]:
    """(name, cls target, path, config) from a string, a mapping or an object."""
    if isinstance(spec, str):
        return (None, spec, None, {}) if ":" in spec else (spec, None, None, {})
    get = spec.get if isinstance(spec, Mapping) else lambda key, default=None: getattr(spec, key, default)
    name, target = get("name"), get("cls")
    if (name is None) == (target is None):
        raise EnvLoadError("set exactly one of `name` (built-in: " + ", ".join(ENVS) + ") or `cls` (module:Class)")
    config = get("config") or {}
    if not isinstance(config, Mapping):
        raise EnvLoadError(f"env `config` must be a mapping, got a {type(config).__name__}")
    return name, target, get("path"), config


def _import_class(target: str, path: str | None) -> type:
    """Import ``module:Class`` (``Class`` may be dotted) with ``path`` first on sys.path."""
    return import_object(target, path, "env cls", EnvLoadError)


def _check_instance(factory: EnvFactory, what: str) -> None:
    try:
        env = factory()
    except Exception as e:  # noqa: BLE001 - the user's environment class may raise anything
        raise EnvLoadError(f"{what} refused its config: {type(e).__name__}: {one_line(e)}") from None
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise EnvLoadError(f"{what} is not an environment: no {' or '.join(missing)} method")
