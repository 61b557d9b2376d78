"""Loading a user's ``module:attribute`` from their repository (rewards, environments, loops).

One loader so every kind of user code fails the same way: a typed error with one line that
names the target, the directory and the cause. The directory is put first on ``sys.path``;
a module of the same name already imported from elsewhere is refused rather than reused.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any


def one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def import_object(target: str, path: str | None, what: str, error: type[Exception]) -> Any:
    """Import ``module:attr`` (``attr`` may be dotted) and check it is callable.

    ``what`` names the kind for messages ("reward fn", "env cls"); ``error`` is raised.
    """
    kind, _, field = what.partition(" ")
    module_name, sep, attr_path = target.partition(":")
    if not sep or not module_name or not attr_path:
        raise error(f"{what} must look like `module:{'Class' if field == 'cls' else 'function'}`, got {target!r}")
    if path is not None:
        if not Path(path).is_dir():
            raise error(f"{kind} path {path} is not a directory")
        _refuse_shadowed_module(module_name, path, kind, error)
        if path not in sys.path:
            sys.path.insert(0, path)
    where = f" from {path}" if path else ""
    try:
        obj: Any = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's module may raise anything (or exit) while importing
        raise error(f"cannot import `{module_name}`{where}: {type(e).__name__}: {one_line(e)}") from None
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise error(f"`{module_name}`{where} has no attribute `{attr_path}`")
        obj = getattr(obj, part)
    if not callable(obj):
        raise error(f"{kind} `{target}` is not callable (it is a {type(obj).__name__})")
    return obj


def _refuse_shadowed_module(module_name: str, path: str, kind: str, error: type[Exception]) -> None:
    top = module_name.split(".")[0]
    loaded = sys.modules.get(top)
    candidate = Path(path) / top
    if loaded is None or not (candidate.is_dir() or candidate.with_suffix(".py").is_file()):
        return
    loaded_file = getattr(loaded, "__file__", None) or ""
    if not Path(loaded_file).resolve().is_relative_to(Path(path).resolve()):
        raise error(
            f"a different module `{top}` is already imported (from {loaded_file or 'a built-in'}); "
            f"give the {kind} module a unique name"
        )
