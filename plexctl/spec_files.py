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
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from plexctl.common.spec import (
    SPECIAL_TOKENS_BOUND,
    Issues,
    JobSpec,
    Key,
    RewardSpec,
    SamplingSpec,
    model_dir_problem,
    read_spec,
)
from plexctl.data import DataError, scan_records
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
            fit = _ContextFit.of(Path(model["path"]), doc, issues)
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
    for key in ("loop", "loss_fn"):
        if isinstance(algo, dict) and isinstance(algo.get(key), str):
            _check_module_file(algo[key], algo.get("path"), ("algo", key), issues)


class _ContextFit:
    """Whether ``sampling.max_tokens`` and the longest prompt fit the model's context
    (``max_position_embeddings``). Prompts are counted with the model's tokenizer when the
    ``tokenizers`` library can load it; only a prompt whose UTF-8 bytes (an upper bound on its
    tokens) with the special tokens and max_tokens could overflow is tokenized at all."""

    def __init__(self, model_dir: Path, context: int, max_tokens: int) -> None:
        self.model_dir, self.context, self.max_tokens = model_dir, context, max_tokens
        self.tokenizer: Any = None  # False: it cannot be loaded here
        self.longest = (0, "")  # (tokens, where) of the longest prompt counted

    @classmethod
    def of(cls, model_dir: Path, doc: dict[str, Any], issues: Issues) -> _ContextFit | None:
        if any(i.path == "sampling.max_tokens" for i in issues.found):
            return None
        try:
            context = int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # no context said: the engines judge
        sampling = doc.get("sampling")
        if not isinstance(sampling, dict):
            sampling = {}
        return cls(model_dir, context, sampling.get("max_tokens", SamplingSpec().max_tokens))

    def measure(self, path: str) -> Callable[[list[tuple[str, str]]], None]:
        """What counts the prompts of data file ``path`` (``scan_records``' ``on_prompts``)."""

        def count(prompts: list[tuple[str, str]]) -> None:
            room = self.context - self.max_tokens
            long = [(where, p) for where, p in prompts if len(p.encode()) + SPECIAL_TOKENS_BOUND > room]
            if not long or not self._load_tokenizer():
                return
            for (where, _), enc in zip(long, self.tokenizer.encode_batch([p for _, p in long])):
                if len(enc.ids) > self.longest[0]:
                    self.longest = (len(enc.ids), f"{Path(path).name} {where}")

        return count

    def _load_tokenizer(self) -> bool:
        if self.tokenizer is None:
            try:
                from tokenizers import Tokenizer

                self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
            except Exception:  # noqa: BLE001 - no library, no tokenizer.json: the engines judge the prompts
                self.tokenizer = False
        return bool(self.tokenizer)

    def check(self, issues: Issues) -> None:
        tokens, where = self.longest
        source = f"the context of {self.model_dir.name}, {self.context} tokens (max_position_embeddings in config.json)"
        if tokens and self.max_tokens + tokens > self.context:
            issues.add(
                ("sampling", "max_tokens"),
                f"{self.max_tokens} and the longest prompt ({tokens} tokens, {where}) exceed {source}",
            )
        elif self.max_tokens >= self.context:
            issues.add(("sampling", "max_tokens"), f"{self.max_tokens} leaves no room for a prompt in {source}")


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


def context_problems(spec: JobSpec, data_files: dict[str, Path]) -> list[str]:
    """Whether ``sampling.max_tokens`` and the longest prompt of ``data_files`` (each file's name
    as its user wrote it -> where its content is: a shared user's uploaded copy) fit the model's
    context: ``load_spec``'s check, for a spec that came over the wire. One line each; the records
    are judged only for their prompts' length here."""
    import os
    import tempfile

    issues = Issues("<submit>", {}, {})
    fit = _ContextFit.of(Path(spec.model.path), msgspec.to_builtins(spec), issues)
    data = spec.data
    if fit is None or data is None:
        return []
    with tempfile.TemporaryDirectory(prefix="plexrl-fit-") as tmp:
        for name, content in data_files.items():
            named = Path(tmp) / Path(name).name  # the format follows the name (.jsonl, .parquet)
            os.symlink(content, named)
            try:
                scan_records(named, data.prompt_field, data.answer_field, on_prompts=fit.measure(name))
            except DataError:
                continue  # unreadable: the job's driver says so, naming its line
    fit.check(issues)
    return [f"{i.path}: {i.message}" for i in issues.found]
