"""A job spec file as the client loads it: the schema's checks (``plexctl.common.spec``) and what
the spec points at: the model directory (what the engines load: ``model_dir_problem``), every
record of the data files (streamed), that ``sampling.max_tokens`` and the longest prompt fit the
model's context, the reward function and environment (imported), the loop's module (found).

It owns ``load_spec`` (the client's entry point) and ``check_files``; problems join the schema's
in one ``SpecError``, each with its file, line and YAML path. It never imports torch,
transformers or vLLM: prompts are counted with the ``tokenizers`` library when it is installed,
and only those long enough to matter.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from plexctl.common.context_fit import ContextFit
from plexctl.common.datasets import DataError, scan_records
from plexctl.common.spec import (
    Issues,
    JobSpec,
    Key,
    RewardSpec,
    model_dir_problem,
    read_spec,
)
from plexctl.rewards import RewardLoadError, load_reward


def load_spec(
    path: str | Path, overrides: Sequence[str] = (), name: str | None = None, check_files: bool = True
) -> JobSpec:
    """``plexctl.common.spec.read_spec``, and with ``check_files`` what the spec points at."""
    return read_spec(path, overrides, name, check=check_files_of if check_files else None)


def check_files_of(doc: dict[str, Any], issues: Issues) -> None:
    """The problems of what the (converted, resolved) spec ``doc`` points at, added to ``issues``."""
    model = doc.get("model") or {}
    fit = None
    if "path" in model:
        problem = model_dir_problem(Path(model["path"]))
        if problem:
            issues.add(("model", "path"), problem)
        else:
            fit = ContextFit.of(Path(model["path"]), doc, issues)
    data = doc.get("data") or {}
    for key in ("path", "eval_path"):
        if data.get(key) is not None:
            fields = (data.get("prompt_field", "prompt"), data.get("answer_field", "answer"))
            _check_data_file(data[key], fields, ("data", key), issues, fit.measure(data[key]) if fit else None)
    if fit is not None:
        fit.check(issues)
    _check_reward_import(doc.get("reward"), issues)
    _check_env_import(doc.get("env"), issues)
    algo = doc.get("algo") or {}
    for key in ("loop", "agent", "loss_fn"):
        if isinstance(algo, dict) and isinstance(algo.get(key), str):
            _check_module_file(algo[key], algo.get("path"), ("algo", key), issues)


def _check_module_file(target: str, path: str | None, where: Key, issues: Issues) -> None:
    """The module of ``target`` exists in ``path`` (not imported: a loss imports torch, and user
    code runs in the driver or the trainer, not in the CLI)."""
    module = target.partition(":")[0]
    if path is None:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            issues.add(where, f"cannot find module `{module}` (set algo.path to the directory that holds it)")
        return
    if not Path(path).is_dir():
        issues.add(("algo", "path"), f"directory not found: {path}")
        return
    base = Path(path).joinpath(*module.split("."))
    if not (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()):
        issues.add(where, f"no module `{module}` in {path}")


def _check_data_file(
    path: str,
    fields: tuple[str, str],
    where: Key,
    issues: Issues,
    on_prompts: Callable[[list[tuple[str, str]]], None] | None = None,
) -> None:
    """Every record of the file (streamed), each bad one an issue naming its line."""
    if not Path(path).exists():
        issues.add(where, f"data file not found: {path}")
        return
    try:
        scan = scan_records(path, *fields, on_prompts=on_prompts)
    except DataError as e:
        issues.add(where, str(e))
        return
    for problem in scan.problems:
        issues.add(where, str(problem))
    if scan.bad > len(scan.problems):
        issues.add(
            where, f"{path}: {scan.bad - len(scan.problems)} more bad records ({scan.bad} of {scan.records} in all)"
        )


def _check_reward_import(reward: Any, issues: Issues) -> None:
    if not isinstance(reward, dict) or reward.get("fn") is None or reward.get("name") is not None:
        return
    path = reward.get("path")
    if path is not None and not Path(path).is_dir():
        issues.add(("reward", "path"), f"reward directory not found: {path}")
        return
    try:
        load_reward(msgspec.convert(reward, RewardSpec))
    except RewardLoadError as e:
        issues.add(("reward", "fn"), str(e))


def _check_env_import(env: Any, issues: Issues) -> None:
    if not isinstance(env, dict):
        return
    from plexctl.envs import EnvLoadError, load_env  # only specs with an env pay for the import

    if any(issue.path.startswith("env.") for issue in issues.found):
        return  # the schema check already reported what is wrong with the section
    try:
        load_env({k: env.get(k) for k in ("name", "cls", "path", "config")})
    except EnvLoadError as e:
        issues.add(("env", "cls" if env.get("cls") else "name"), str(e))
