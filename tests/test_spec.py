"""The job spec: what a user sees when a YAML file is right, and every way it can be wrong."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from plexctl.common.spec import EMPTY_LORA_REFUSED, JobSpec, SpecError, SpecIssue, spec_from_wire, spec_to_wire
from plexctl.spec_files import load_spec

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"

VALID = """\
name: t
model:
  path: model
lora:
  rank: 4
data:
  path: data/train.jsonl
reward:
  name: arith
"""


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A directory with a fake model (config.json, tokenizer and weights files) and small JSONL datasets."""
    (tmp_path / "model").mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (tmp_path / "model" / name).write_text("{}")
    (tmp_path / "model" / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"]}')
    (tmp_path / "data").mkdir()
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "data" / "eval.jsonl").write_text(json.dumps(rows[0]) + "\n")
    return tmp_path


@pytest.fixture
def clean_imports():
    """Undo what importing a user's reward module does to sys.path and sys.modules."""
    path, modules = list(sys.path), set(sys.modules)
    yield
    sys.path[:] = path
    for name in set(sys.modules) - modules:
        del sys.modules[name]


def write(directory: Path, text: str, name: str = "job.yaml") -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return path


def issues_of(path: Path, **kwargs) -> list[SpecIssue]:
    with pytest.raises(SpecError) as info:
        load_spec(path, **kwargs)
    assert str(info.value) == "\n".join(str(i) for i in info.value.issues)
    return info.value.issues


def only_issue(path: Path, **kwargs) -> SpecIssue:
    issues = issues_of(path, **kwargs)
    assert len(issues) == 1, issues
    return issues[0]


# ---------------------------------------------------------------- valid specs


def test_valid_spec_gets_defaults_and_absolute_paths(workdir: Path) -> None:
    (workdir / "cfg").mkdir()
    spec_path = write(
        workdir / "cfg",
        """\
        name: t
        model: {path: ../model}
        lora: {rank: 4}
        data: {path: ../data/train.jsonl, eval_path: ../data/eval.jsonl}
        reward: {name: arith}
        """,
    )
    spec = load_spec(spec_path)
    assert spec.model.path == str(workdir / "model")
    assert spec.data.path == str(workdir / "data" / "train.jsonl")
    assert spec.data.eval_path == str(workdir / "data" / "eval.jsonl")
    assert spec.lora is not None and spec.lora.rank == 4 and spec.lora.alpha == 16
    assert spec.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert spec.algo.group_size == 8 and spec.algo.lr == 1e-4 and spec.algo.loss_agg == "token-mean"
    assert spec.sampling.max_tokens == 8 and spec.checkpoint.every == 10 and spec.seed == 0


def test_paths_resolve_against_the_yaml_directory_not_the_cwd(workdir: Path, monkeypatch) -> None:
    spec_path = write(workdir, VALID)
    monkeypatch.chdir("/")
    assert load_spec(spec_path).model.path == str(workdir / "model")


def test_float_written_without_a_dot_is_accepted(workdir: Path) -> None:
    # YAML reads `1e-4` as a string; users write learning rates that way.
    spec = load_spec(write(workdir, VALID + "algo:\n  lr: 1e-4\n  clip_range_high: 3e-1\n"))
    assert spec.algo.lr == pytest.approx(1e-4)
    assert spec.algo.clip_range_high == pytest.approx(0.3)


def test_wire_round_trip(workdir: Path) -> None:
    spec = load_spec(write(workdir, VALID))
    wire = spec_to_wire(spec)
    assert json.loads(json.dumps(wire)) == wire
    assert spec_from_wire(wire) == spec


def test_spec_from_wire_refuses_bad_values() -> None:
    good = spec_to_wire(load_spec(CONFIGS / "tiny-arith.yaml", check_files=False))
    with pytest.raises(SpecError) as info:
        spec_from_wire({**good, "algo": {"lr": -1.0}})
    assert info.value.issues[0].path == "algo.lr"


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_example_configs_validate(config: str) -> None:
    spec = load_spec(CONFIGS / config, check_files=False)
    assert isinstance(spec, JobSpec)
    assert (spec.lora is None) == config.endswith("-full.yaml")  # the full fine-tuning examples say so
    assert Path(spec.model.path).is_absolute() and Path(spec.data.path).is_absolute()


def test_example_configs_are_what_the_brief_says() -> None:
    a = load_spec(CONFIGS / "tiny-arith.yaml", check_files=False)
    b = load_spec(CONFIGS / "tiny-arith-b.yaml", check_files=False)
    assert a.model.path == str(REPO / ".plexrl" / "models" / "tiny-arith")
    assert a.data.path == str(REPO / ".plexrl" / "data" / "arith" / "train.jsonl")
    assert a.data.eval_path == str(REPO / ".plexrl" / "data" / "arith" / "eval.jsonl")
    assert (a.name, a.seed, a.algo.lr, a.algo.steps, a.sampling.max_tokens) == ("tiny-arith", 0, 2e-3, 200, 4)
    assert (b.name, b.seed, b.algo.lr, b.algo.steps) == ("tiny-arith-b", 1, 1.5e-3, 200)
    assert a.reward.name == b.reward.name == "arith"
    small = load_spec(CONFIGS / "qwen2.5-0.5b-gsm8k.yaml", check_files=False)
    large = load_spec(CONFIGS / "qwen2.5-7b-math.yaml", check_files=False)
    assert small.data.path == "/data/gsm8k/train.jsonl" and small.data.prompt_field == "question"
    for spec, rank, max_tokens, group in ((small, 16, 512, 8), (large, 32, 1024, 16)):
        assert spec.reward.name == "math" and spec.model.dtype == "bfloat16"
        assert spec.lora is not None and spec.lora.rank == rank
        assert (spec.sampling.max_tokens, spec.algo.group_size) == (max_tokens, group)
        assert (spec.algo.kl_coef, spec.algo.steps) == (0.001, 200)


def test_tiny_configs_validate_with_files(tiny_model: Path) -> None:
    load_spec(CONFIGS / "tiny-arith.yaml")
    load_spec(CONFIGS / "tiny-arith-b.yaml")


# ---------------------------------------------------------------- one error class at a time


def test_unknown_key_names_the_closest_valid_key(workdir: Path) -> None:
    issue = only_issue(write(workdir, VALID + "algo:\n  lrr: 0.1\n"))
    assert (issue.path, issue.line) == ("algo.lrr", 11)
    assert issue.message == "unknown key `lrr` (did you mean `lr`?)"
    assert str(issue) == f"{workdir / 'job.yaml'}:11: algo.lrr: unknown key `lrr` (did you mean `lr`?)"


def test_unknown_key_without_a_close_match_lists_valid_keys(workdir: Path) -> None:
    issue = only_issue(write(workdir, VALID + "sampling:\n  zzzzzz: 1\n"))
    assert issue.path == "sampling.zzzzzz" and "valid keys: temperature, top_p, max_tokens" in issue.message


def test_wrong_type(workdir: Path) -> None:
    issue = only_issue(write(workdir, VALID + "algo:\n  lr: abc\n"))
    assert (issue.path, issue.line, issue.message) == ("algo.lr", 11, "expected a float, got 'abc'")


def test_wrong_type_in_a_list_item_names_the_index(workdir: Path) -> None:
    text = VALID.replace("  rank: 4\n", "  rank: 4\n  target_modules:\n    - q_proj\n    - 7\n")
    issue = only_issue(write(workdir, text))
    assert (issue.path, issue.line, issue.message) == ("lora.target_modules[1]", 8, "expected a string, got 7")


def test_boolean_is_not_an_integer(workdir: Path) -> None:
    issue = only_issue(write(workdir, VALID + "seed: true\n"))
    assert (issue.path, issue.message) == ("seed", "expected an integer, got true")


def test_out_of_range(workdir: Path) -> None:
    issue = only_issue(write(workdir, VALID + "algo:\n  lr: -1\n"))
    assert (issue.path, issue.line, issue.message) == ("algo.lr", 11, "must be > 0, got -1")


@pytest.mark.parametrize(
    "yaml_text, path, message",
    [
        ("algo:\n  group_size: 1\n", "algo.group_size", "must be >= 2, got 1"),
        ("sampling:\n  top_p: 1.5\n", "sampling.top_p", "must be <= 1, got 1.5"),
        ("algo:\n  kl_coef: .nan\n", "algo.kl_coef", "must be a finite number"),
        ("name: has space\n", "name", "must match"),
        ("seed: -1\n", "seed", "must be >= 0, got -1"),
        ("priority: 100000000000000000000000000000\n", "priority", "must fit in 64 bits"),
        ("algo:\n  steps: 99999999999999999999999\n", "algo.steps", "must fit in 64 bits"),
        ("algo:\n  loss: pg-tis\n  loss_params:\n    cap: -5\n", "algo.loss_params.cap", "must be > 0, got -5"),
        (
            "algo:\n  loss: pg-tis\n  loss_params:\n    cap: abc\n",
            "algo.loss_params.cap",
            "expected a float, got 'abc'",
        ),
        ("algo:\n  loss_params: [1]\n", "algo.loss_params", "expected a mapping, got [1]"),
    ],
)
def test_more_ranges(workdir: Path, yaml_text: str, path: str, message: str) -> None:
    text = VALID.replace("name: t\n", yaml_text) if yaml_text.startswith("name") else VALID + yaml_text
    issue = only_issue(write(workdir, text))
    assert issue.path == path and message in issue.message


def test_lora_dropout_and_rank_bounds(workdir: Path) -> None:
    text = VALID.replace("  rank: 4\n", "  rank: 257\n  dropout: 1.0\n")
    issues = issues_of(write(workdir, text))
    assert [(i.path, i.line, i.message) for i in issues] == [
        ("lora.rank", 5, "must be <= 256, got 257"),
        ("lora.dropout", 6, "must be < 1, got 1.0"),
    ]


def test_bad_enum_lists_the_choices(workdir: Path) -> None:
    issue = only_issue(write(workdir, VALID.replace("  path: model\n", "  path: model\n  dtype: fp32\n")))
    assert (issue.path, issue.line) == ("model.dtype", 4)
    assert issue.message == "must be one of float32, bfloat16, float16; got 'fp32'"


def test_missing_required_key_points_at_its_section(workdir: Path) -> None:
    issue = only_issue(write(workdir, VALID.replace("  path: data/train.jsonl\n", "  prompt_field: q\n")))
    assert (issue.path, issue.line, issue.message) == ("data.path", 6, "missing required key `path`")


def test_missing_top_level_key(workdir: Path) -> None:
    issue = only_issue(write(workdir, VALID.replace("name: t\n", "")))
    assert (issue.path, issue.line, issue.message) == ("name", None, "missing required key `name`")


def test_section_that_is_not_a_mapping(workdir: Path) -> None:
    issue = only_issue(write(workdir, VALID + "algo: fast\n"))
    assert (issue.path, issue.line, issue.message) == ("algo", 10, "expected a mapping, got 'fast'")


def test_yaml_syntax_error_has_its_line(workdir: Path) -> None:
    issue = only_issue(write(workdir, "name: t\nmodel:\n  path: model\n   dtype: x\n"))
    assert issue.line == 4 and issue.message.startswith("YAML syntax error:")
    assert str(issue).startswith(f"{workdir / 'job.yaml'}:4: YAML syntax error")


def test_spec_file_not_found(tmp_path: Path) -> None:
    issue = only_issue(tmp_path / "nope.yaml")
    assert issue.line is None and "not found" in issue.message
    assert str(issue) == f"{tmp_path / 'nope.yaml'}: spec file not found"


def test_top_level_must_be_a_mapping(workdir: Path) -> None:
    issue = only_issue(write(workdir, "- a\n- b\n"))
    assert "expected a mapping at the top level" in issue.message


def test_spec_without_lora_trains_every_weight(workdir: Path) -> None:
    spec = load_spec(write(workdir, VALID.replace("lora:\n  rank: 4\n", "")))
    assert spec.lora is None and spec.full_finetune


def test_empty_lora_is_refused_with_both_choices(workdir: Path) -> None:
    issue = only_issue(write(workdir, VALID.replace("lora:\n  rank: 4\n", "lora: null\n")))
    assert (issue.path, issue.line) == ("lora", 4)
    assert issue.message == EMPTY_LORA_REFUSED
    assert "lora: {}" in issue.message and "leave `lora` out" in issue.message


def test_empty_lora_mapping_means_defaults(workdir: Path) -> None:
    spec = load_spec(write(workdir, VALID.replace("lora:\n  rank: 4\n", "lora: {}\n")))
    assert spec.lora is not None and (spec.lora.rank, spec.lora.alpha) == (8, 16)


@pytest.mark.parametrize("reward, got", [("  name: arith\n  fn: m:f\n", "both"), ("  failure_reward: 0\n", "neither")])
def test_reward_needs_exactly_one_of_name_and_fn(workdir: Path, reward: str, got: str) -> None:
    issue = only_issue(write(workdir, VALID.replace("  name: arith\n", reward)))
    assert (issue.path, issue.line) == ("reward", 8)
    assert "exactly one of `name`" in issue.message and issue.message.endswith(f"got {got}")


def test_reward_fn_must_look_like_module_function(workdir: Path) -> None:
    issue = only_issue(write(workdir, VALID.replace("  name: arith\n", "  fn: just_a_module\n")), check_files=False)
    assert issue.path == "reward.fn" and "must match" in issue.message


# ---------------------------------------------------------------- files


def test_model_directory_not_found(workdir: Path) -> None:
    issue = only_issue(write(workdir, VALID.replace("path: model", "path: nomodel")))
    assert (issue.path, issue.line) == ("model.path", 3)
    assert issue.message == f"model directory not found: {workdir / 'nomodel'}"


def test_model_directory_without_config_json(workdir: Path) -> None:
    (workdir / "empty_model").mkdir()
    issue = only_issue(write(workdir, VALID.replace("path: model", "path: empty_model")))
    assert issue.path == "model.path" and "no config.json" in issue.message


def test_a_model_that_is_not_a_causal_lm_is_refused_with_its_architecture(workdir: Path) -> None:
    (workdir / "model" / "config.json").write_text('{"architectures": ["BertForMaskedLM"]}')
    issue = only_issue(write(workdir, VALID))
    assert issue.path == "model.path" and "BertForMaskedLM" in issue.message and "ForCausalLM" in issue.message


def test_data_file_not_found(workdir: Path) -> None:
    text = VALID.replace("  path: data/train.jsonl\n", "  path: data/train.jsonl\n  eval_path: data/missing.jsonl\n")
    issue = only_issue(write(workdir, text))
    assert (issue.path, issue.line) == ("data.eval_path", 8)
    assert issue.message == f"data file not found: {workdir / 'data' / 'missing.jsonl'}"


def test_data_file_without_the_prompt_field(workdir: Path) -> None:
    (workdir / "data" / "q.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    issue = only_issue(write(workdir, VALID.replace("data/train.jsonl", "data/q.jsonl")))
    assert (issue.path, issue.line) == ("data.path", 7)
    assert "record 1 (line 1): missing field `prompt`" in issue.message and "`question`" in issue.message


def test_data_fields_can_be_renamed(workdir: Path) -> None:
    (workdir / "data" / "q.jsonl").write_text('{"question": "1+1", "solution": "2"}\n')
    text = VALID.replace("data/train.jsonl", "data/q.jsonl\n  prompt_field: question\n  answer_field: solution")
    assert load_spec(write(workdir, text)).data.prompt_field == "question"


def test_data_file_that_is_not_json(workdir: Path) -> None:
    (workdir / "data" / "bad.jsonl").write_text("not json\n")
    issue = only_issue(write(workdir, VALID.replace("data/train.jsonl", "data/bad.jsonl")))
    assert issue.path == "data.path" and "record 1 (line 1): not valid JSON" in issue.message


def test_data_file_that_is_not_utf8_names_its_line(workdir: Path) -> None:
    from plexctl.data import DataError, load_records

    (workdir / "data" / "train.jsonl").write_bytes(b'\xff\xfe{"prompt": "1+1=", "answer": "2"}\n')
    issues = issues_of(write(workdir, VALID))
    assert [i.path for i in issues] == ["data.path"]
    assert "line 1 is not UTF-8 text" in issues[0].message and "train.jsonl" in issues[0].message
    (workdir / "data" / "train.jsonl").write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n\xff\xfe{}\n')
    with pytest.raises(DataError, match="line 2 is not UTF-8 text"):  # what the driver meets past the first
        load_records(workdir / "data" / "train.jsonl", "prompt", "answer")


@pytest.mark.parametrize(
    "tail, phrase",
    [
        ("extra: &x [*x]\n", "refers to a node that contains it"),
        ("".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 7)), "more than 100,000 values"),
    ],
)
def test_yaml_aliases_that_contain_themselves_or_explode_are_refused(workdir: Path, tail: str, phrase: str) -> None:
    text = VALID + ("l0: &l0 [1]\n" if "l1" in tail else "") + tail
    issue = only_issue(write(workdir, text))
    assert phrase in issue.message


def test_a_key_written_twice_is_refused_at_its_second_line(workdir: Path) -> None:
    issue = only_issue(write(workdir, VALID + "seed: 5\nalgo:\n  lr: 1e-4\nseed: 7\n"))
    assert (issue.path, issue.line, issue.message) == ("seed", 13, "duplicate key (first on line 10)")


def test_a_directory_is_not_a_spec_file_and_a_date_shows_as_written(workdir: Path) -> None:
    assert only_issue(workdir).message == "is a directory, not a spec file"
    issue = only_issue(write(workdir, VALID + "priority: 2024-01-01\n"))
    assert issue.message == "expected an integer, got 2024-01-01"


def test_reward_path_not_found(workdir: Path) -> None:
    text = VALID.replace("  name: arith\n", "  fn: myreward:score\n  path: norewards\n")
    issue = only_issue(write(workdir, text))
    assert (issue.path, issue.line) == ("reward.path", 10)
    assert issue.message == f"reward directory not found: {workdir / 'norewards'}"


def test_check_files_false_checks_only_the_schema(workdir: Path) -> None:
    text = VALID.replace("path: model", "path: nomodel").replace("data/train.jsonl", "data/none.jsonl")
    spec = load_spec(write(workdir, text), check_files=False)
    assert spec.model.path == str(workdir / "nomodel")


def test_custom_reward_is_imported_from_reward_path(workdir: Path, clean_imports) -> None:
    (workdir / "rewards").mkdir()
    (workdir / "rewards" / "spec_ok_reward.py").write_text("def score(c, a, r):\n    return 1.0\n")
    text = VALID.replace("  name: arith\n", "  fn: spec_ok_reward:score\n  path: rewards\n")
    spec = load_spec(write(workdir, text))
    assert spec.reward.fn == "spec_ok_reward:score" and spec.reward.path == str(workdir / "rewards")


@pytest.mark.parametrize(
    "source, fn, phrase",
    [
        (None, "spec_absent_mod:score", "cannot import `spec_absent_mod`"),
        ("def other(c, a, r):\n    return 0.0\n", "spec_noattr_mod:score", "has no attribute `score`"),
        ("score = 3\n", "spec_notcall_mod:score", "is not callable"),
        ("raise RuntimeError('boom at import')\n", "spec_raises_mod:score", "RuntimeError: boom at import"),
        ("raise SystemExit(5)\n", "spec_exits_mod:score", "SystemExit: 5"),  # not the CLI's exit code
    ],
)
def test_unimportable_reward(workdir: Path, clean_imports, source: str | None, fn: str, phrase: str) -> None:
    (workdir / "rewards").mkdir()
    if source is not None:
        (workdir / "rewards" / (fn.split(":")[0] + ".py")).write_text(source)
    text = VALID.replace("  name: arith\n", f"  fn: {fn}\n  path: rewards\n")
    issue = only_issue(write(workdir, text))
    assert (issue.path, issue.line) == ("reward.fn", 9)
    assert phrase in issue.message and "\n" not in issue.message


# ---------------------------------------------------------------- all at once


def test_every_mistake_of_a_file_is_reported(workdir: Path) -> None:
    spec_path = write(
        workdir,
        """\
        name: t
        model:
          path: nomodel
          dtype: fp32
        lora:
          rank: 0
        data:
          path: data/train.jsonl
        reward:
          name: arith
        algo:
          lrr: 1e-4
          lr: abc
          group_size: 1
        sampling:
          top_p: 2
        colour: blue
        """,
    )
    found = [(i.path, i.line) for i in issues_of(spec_path)]
    assert sorted(found, key=lambda x: x[1]) == [
        ("model.path", 3),
        ("model.dtype", 4),
        ("lora.rank", 6),
        ("algo.lrr", 12),
        ("algo.lr", 13),
        ("algo.group_size", 14),
        ("sampling.top_p", 16),
        ("colour", 17),
    ]


# ---------------------------------------------------------------- --set and name


def test_overrides_are_parsed_as_yaml(workdir: Path) -> None:
    spec = load_spec(
        write(workdir, VALID),
        overrides=[
            "algo.lr=3e-4",
            "sampling.max_tokens=16",
            "lora.target_modules=[q_proj, v_proj]",
            "algo.clip_range_high=0.28",
            "data.eval_path=data/eval.jsonl",
            "priority=-2",
        ],
    )
    assert spec.algo.lr == pytest.approx(3e-4) and isinstance(spec.algo.lr, float)
    assert spec.sampling.max_tokens == 16
    assert spec.lora is not None and spec.lora.target_modules == ["q_proj", "v_proj"]
    assert spec.algo.clip_range_high == pytest.approx(0.28) and spec.priority == -2
    assert spec.data.eval_path == str(workdir / "data" / "eval.jsonl")


def test_override_can_add_the_lora_section(workdir: Path) -> None:
    spec = load_spec(write(workdir, VALID.replace("lora:\n  rank: 4\n", "")), overrides=["lora.rank=16"])
    assert spec.lora is not None and spec.lora.rank == 16


def test_override_on_unknown_key_is_an_error(workdir: Path) -> None:
    issue = only_issue(write(workdir, VALID), overrides=["algo.lrr=0.1"])
    assert (issue.file, issue.line, issue.path) == ("--set", None, "algo.lrr")
    assert issue.message == "unknown key `lrr` (did you mean `lr`?)"
    assert str(issue) == "--set: algo.lrr: unknown key `lrr` (did you mean `lr`?)"


def test_override_with_a_bad_value_is_located_at_set(workdir: Path) -> None:
    issues = issues_of(write(workdir, VALID + "algo:\n  steps: 0\n"), overrides=["sampling.top_p=abc", "oops"])
    found = {(i.file, i.line, i.path): i.message for i in issues}
    assert found[("--set", None, "sampling.top_p")] == "expected a float, got 'abc'"
    assert "expected KEY=VALUE" in found[("--set", None, "oops")]
    assert found[(str(workdir / "job.yaml"), 11, "algo.steps")] == "must be >= 1, got 0"


def test_an_override_with_a_leading_zero_is_refused_never_a_silent_octal(workdir: Path) -> None:
    issue = only_issue(write(workdir, VALID), overrides=["algo.steps=010"])
    assert (issue.file, issue.path) == ("--set", "algo.steps")
    assert (
        issue.message == "'010' has a leading zero; write 10 for the number, 0o10 for octal, or quote it for a string"
    )
    spec = load_spec(write(workdir, VALID), overrides=["algo.steps=0o10", "sampling.max_tokens=0x10", "algo.lr=1e-3"])
    assert (spec.algo.steps, spec.sampling.max_tokens, spec.algo.lr) == (8, 16, 1e-3)  # YAML 1.2's numbers


def test_name_argument_replaces_the_name(workdir: Path) -> None:
    assert load_spec(write(workdir, VALID), name="run-2").name == "run-2"
    issue = only_issue(write(workdir, VALID), name="bad name")
    assert issue.path == "name" and issue.file == "--name" and "must match" in issue.message


def test_issue_string_format() -> None:
    assert str(SpecIssue("a.yaml", 3, "algo.lr", "must be > 0, got -1")) == "a.yaml:3: algo.lr: must be > 0, got -1"
    assert str(SpecIssue("--set", None, "algo.lr", "m")) == "--set: algo.lr: m"


def test_an_agent_is_named_for_a_builtin_algorithm_and_refused_where_it_cannot_run(workdir: Path) -> None:
    (workdir / "agents.py").write_text("def agent(record, base_url, api_key):\n    return '1'\n")
    base = VALID + "algo:\n  agent: agents:agent\n  path: .\n"
    assert load_spec(write(workdir, base)).algo.agent == "agents:agent"
    for extra, path, message in (
        ("  loop: agents:agent\n", "algo.agent", "a `loop` of your own runs its agent itself"),
        ("  name: dapo\n", "algo.agent", "dapo refills its groups from the prompts"),
    ):
        issue = only_issue(write(workdir, base + extra))
        assert issue.path == path and issue.message.startswith(message), issue
    with_env = base + "env:\n  name: calculator\n"
    assert any(i.path == "algo.agent" and "drop `env`" in i.message for i in issues_of(write(workdir, with_env)))
    missing = only_issue(write(workdir, VALID + "algo:\n  agent: nowhere:agent\n  path: .\n"))
    assert missing.path == "algo.agent" and "nowhere" in missing.message
