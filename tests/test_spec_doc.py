"""The generated spec reference: in sync with the schema, complete, and `--explain` for one key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from plexctl.cli.spec_doc import REGENERATE, UnknownSpecKey, explain, render_reference
from plexctl.common.errors import ExitCode, UsageError
from plexctl.common.spec import JobSpec

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "docs" / "spec-reference.md"


def _spec_doc(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "plexctl.cli.spec_doc", *args],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _schema_keys(cls: type[msgspec.Struct] = JobSpec, prefix: str = "") -> list[str]:
    """Every dotted key of the schema, walked independently of plexctl.cli.spec_doc."""
    keys = []
    for field in msgspec.structs.fields(cls):
        key = f"{prefix}.{field.encode_name}" if prefix else field.encode_name
        keys.append(key)
        sections = [
            t for t in (field.type, *_all_args(field.type)) if isinstance(t, type) and issubclass(t, msgspec.Struct)
        ]
        for section in sections:
            keys += _schema_keys(section, key)
    return keys


def _all_args(tp: object) -> list[object]:
    args = list(getattr(tp, "__args__", ()))
    return args + [a for arg in args for a in _all_args(arg)]


def test_committed_reference_matches_the_schema() -> None:
    assert REFERENCE.read_text(encoding="utf-8") == render_reference(), (
        f"docs/spec-reference.md is stale; regenerate it: {REGENERATE}"
    )


def test_every_schema_key_has_a_row() -> None:
    text = render_reference()
    keys = _schema_keys()
    assert {"name", "lora.rank", "algo.lr", "env.step_timeout_s", "checkpoint.every"} <= set(keys)
    for key in keys:
        assert f"| `{key}` |" in text, key
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) == len(keys)


def test_reference_reads_as_a_user_would_write_it() -> None:
    text = render_reference()
    assert "python -m plexctl.cli.spec_doc > docs/spec-reference.md" in text
    assert "| `algo.lr` | float > 0 | `0.0001` | Adam learning rate of the adapter |" in text
    assert (
        "| `algo.loss_agg` | one of token-mean, seq-mean-token-mean, seq-mean-token-sum, "
        "seq-mean-token-sum-norm | `token-mean` |"
    ) in text
    assert "| `lora.rank` | 1 <= int <= 256 | `8` |" in text
    assert "| `lora.target_modules` | non-empty list of strings | `[q_proj, k_proj," in text
    assert "| `env.step_timeout_s` | null or float > 0 | `null` |" in text
    assert "| `model.path` | string | *required* |" in text
    # sections in the order a spec is written, each opened by its docstring
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == [
        "## Top level",
        "## `model`",
        "## `lora`",
        "## `data`",
        "## `reward`",
        "## `env`",
        "## `algo`",
        "## `sampling`",
        "## `checkpoint`",
    ]
    assert "## `lora`\n\nThe LoRA adapter that is trained (the base model stays frozen)." in text


def test_explain_a_leaf() -> None:
    text = explain("algo.lr")
    assert text.splitlines()[0] == "algo.lr"
    assert "type:        float > 0" in text
    assert "default:     0.0001" in text
    assert "meaning:     Adam learning rate of the adapter" in text
    assert "constraints: > 0" in text
    assert "may be null" in explain("algo.clip_range_high")


def test_explain_a_section_lists_its_keys() -> None:
    text = explain("lora")
    assert "LoRA adapter, the base model frozen; left out: full fine-tuning" in text
    assert "The LoRA adapter that is trained" in text
    for key in ("lora.rank", "lora.alpha", "lora.target_modules", "lora.dropout"):
        assert key in text
    assert "1 <= int <= 256" in text


@pytest.mark.parametrize(
    ("key", "suggestion"),
    [("algo.lrr", "algo.lr"), ("lr", "algo.lr"), ("lora.rnak", "lora.rank"), ("samplng", "sampling")],
)
def test_explain_an_unknown_key_suggests_the_closest(key: str, suggestion: str) -> None:
    with pytest.raises(UnknownSpecKey) as err:
        explain(key)
    assert err.value.suggestion == suggestion
    assert str(err.value) == f"unknown spec key `{key}` (did you mean `{suggestion}`?)"
    assert isinstance(err.value, UsageError) and err.value.exit_code == ExitCode.USAGE


def test_check_mode_passes_on_the_committed_file_and_fails_on_a_stale_copy(tmp_path: Path) -> None:
    ok = _spec_doc("--check", str(REFERENCE))
    assert ok.returncode == 0, ok.stderr
    stale = tmp_path / "spec-reference.md"
    stale.write_text(REFERENCE.read_text(encoding="utf-8").replace("Adam learning rate", "SGD learning rate"))
    bad = _spec_doc("--check", str(stale))
    assert bad.returncode == 1
    hint = bad.stderr.strip()
    assert len(hint.splitlines()) == 1
    assert "is stale" in hint and "SGD learning rate" in hint and REGENERATE in hint


def test_print_mode_writes_the_reference_without_torch() -> None:
    probe = (
        "import sys, plexctl.cli.spec_doc; "
        "heavy = [m for m in ('torch', 'vllm', 'transformers') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    assert subprocess.run([sys.executable, "-c", probe], check=False, cwd=REPO, timeout=60).returncode == 0
    out = _spec_doc()
    assert out.returncode == 0, out.stderr
    assert out.stdout == render_reference()


def test_validate_explain_through_the_cli() -> None:
    import subprocess
    import sys

    ok = subprocess.run(
        [sys.executable, "-m", "plexctl.cli", "validate", "--explain", "algo.lr"], capture_output=True, text=True
    )
    assert ok.returncode == 0 and "float > 0" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "plexctl.cli", "validate", "--explain", "algo.lrr"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "did you mean `algo.lr`" in bad.stderr
