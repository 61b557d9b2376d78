"""Whether a job's prompts and ``sampling.max_tokens`` fit its model's context: one check, run by
the CLI when it loads a spec (``plexctl.spec_files``) and by the daemon on every shared user's
submit, on their uploaded data (``context_problems``), so a client that skips the CLI meets the
same rule. It reads the model's ``config.json`` and, only for a prompt that could overflow, its
tokenizer; it never imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from plexctl.common.datasets import DataError, scan_records
from plexctl.common.spec import SPECIAL_TOKENS_BOUND, Issues, JobSpec, SamplingSpec


class ContextFit:
    """Whether ``sampling.max_tokens`` and the longest prompt fit the model's context
    (``max_position_embeddings``). Prompts are counted with the model's tokenizer when the
    ``tokenizers`` library can load it; only a prompt whose UTF-8 bytes (an upper bound on its
    tokens) with the special tokens and max_tokens could overflow is tokenized at all."""

    def __init__(self, model_dir: Path, context: int, max_tokens: int) -> None:
        self.model_dir, self.context, self.max_tokens = model_dir, context, max_tokens
        self.tokenizer: Any = None  # False: it cannot be loaded here
        self.longest = (0, "")  # (tokens, where) of the longest prompt counted

    @classmethod
    def of(cls, model_dir: Path, doc: dict[str, Any], issues: Issues) -> ContextFit | None:
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


def context_problems(spec: JobSpec, data_files: dict[str, Path]) -> list[str]:
    """Whether ``sampling.max_tokens`` and the longest prompt of ``data_files`` (each file's name
    as its user wrote it -> where its content is: a shared user's uploaded copy) fit the model's
    context: ``load_spec``'s check, for a spec that came over the wire. One line each; the records
    are judged only for their prompts' length here."""
    import os
    import tempfile

    issues = Issues("<submit>", {}, {})
    fit = ContextFit.of(Path(spec.model.path), msgspec.to_builtins(spec), issues)
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
