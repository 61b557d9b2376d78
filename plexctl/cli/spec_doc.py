"""The job spec reference, generated from the one schema in ``plexctl.common.spec``.

This module owns the reading of the ``JobSpec`` structs as documentation: every key with its
type as a user reads it (``float > 0``, ``one of token-mean, seq-mean-token-mean``), its
default and its meaning (the ``msgspec.Meta`` description). It renders two things from that
one walk: ``render_reference()``, the Markdown page committed as ``docs/spec-reference.md``
(one table per section, in the order a spec file is written), and ``explain(key)``, the text
of ``plexctl validate --explain KEY``.

Regenerate the page:   python -m plexctl.cli.spec_doc > docs/spec-reference.md
Check it is current:   python -m plexctl.cli.spec_doc --check docs/spec-reference.md  (exit 1 if stale)

The same walk over ``plexctl.common.cluster_config.ClusterConfig`` renders the cluster settings'
page, ``docs/cluster-reference.md`` (``render_cluster_reference``; ``--cluster`` with either command).

It deliberately does not validate specs (``plexctl.common.spec`` does), does not document the rules
that span several fields beyond what the docstrings say, and never imports torch or vLLM.
"""

from __future__ import annotations

import argparse
import builtins
import difflib
import inspect
import math
import sys
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import msgspec
import yaml
from msgspec import Meta

from plexctl.common.errors import UsageError
from plexctl.common.spec import JobSpec, unwrap_type

REGENERATE = "python -m plexctl.cli.spec_doc > docs/spec-reference.md"
CHECK = "python -m plexctl.cli.spec_doc --check docs/spec-reference.md"
CLUSTER_REGENERATE = "python -m plexctl.cli.spec_doc --cluster > docs/cluster-reference.md"
CLUSTER_CHECK = "python -m plexctl.cli.spec_doc --cluster --check docs/cluster-reference.md"
REQUIRED = "required"  # the default column of a key without a default
ALL_DEFAULTS = "all defaults"  # the default column of a section built from its own defaults

_KIND = {int: "int", float: "float", str: "string", bool: "boolean"}
_PLURAL = {int: "ints", float: "floats", str: "strings", bool: "booleans"}
_LOWER = (("ge", ">="), ("gt", ">"))
_UPPER = (("le", "<="), ("lt", "<"))


class UnknownSpecKey(UsageError):
    """``explain`` was asked about a key the schema does not have; ``suggestion`` is the closest one."""

    def __init__(self, key: str, suggestion: str | None) -> None:
        self.key, self.suggestion = key, suggestion
        hint = f"did you mean `{suggestion}`?" if suggestion else "see docs/spec-reference.md"
        super().__init__(f"unknown spec key `{key}` ({hint})")


# ---------------------------------------------------------------- the schema, read as documentation


@dataclass(frozen=True)
class FieldDoc:
    """One key of the spec, as the reference shows it."""

    key: str  # dotted: ``algo.lr``; a top-level key has no dot
    type: str  # as a user reads it: ``null or float > 0``
    default: str  # as YAML: ``0.0001``, ``null``, ``[q_proj, v_proj]``; ``required`` when there is none
    meaning: str
    constraints: tuple[str, ...]  # one phrase each: ``> 0``, ``one of arith, math``, ``may be null``
    section: builtins.type[msgspec.Struct] | None  # the struct of a section key, else None


@dataclass(frozen=True)
class SectionDoc:
    """One table of the reference: a section (or the top level) and its keys."""

    key: str  # dotted, "" for the top level
    intro: str  # the struct's docstring, in Markdown
    fields: tuple[FieldDoc, ...]


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _merged(metas: list[Meta], attr: str) -> Any:
    return next((getattr(m, attr) for m in metas if getattr(m, attr) is not None), None)


def _number(value: float) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _bounds(kind: str, metas: list[Meta]) -> str:
    """``float > 0``, ``int >= 1``, ``1 <= int <= 256``, ``0 <= float < 1``."""
    lower = next(((sym, _merged(metas, a)) for a, sym in _LOWER if _merged(metas, a) is not None), None)
    upper = next(((sym, _merged(metas, a)) for a, sym in _UPPER if _merged(metas, a) is not None), None)
    if lower and upper:
        flipped = {">=": "<=", ">": "<"}[lower[0]]
        return f"{_number(lower[1])} {flipped} {kind} {upper[0]} {_number(upper[1])}"
    bound = lower or upper
    return f"{kind} {bound[0]} {_number(bound[1])}" if bound else kind


def _describe_type(tp: Any) -> tuple[str, list[str]]:
    """How a user reads a field type, and its constraints one phrase each."""
    base, metas, nullable = unwrap_type(tp)
    text, constraints = _describe_base(base, metas)
    if nullable:
        return f"null or {text}", constraints + ["may be null"]
    return text, constraints


def _describe_base(base: Any, metas: list[Meta]) -> tuple[str, list[str]]:
    constraints = [f"{sym} {_number(_merged(metas, a))}" for a, sym in _LOWER + _UPPER if _merged(metas, a) is not None]
    pattern, min_length = _merged(metas, "pattern"), _merged(metas, "min_length")
    max_length = _merged(metas, "max_length")
    if _is_struct(base):
        return "section", constraints
    if get_origin(base) is Literal:
        choices = ", ".join(map(str, get_args(base)))
        if len(get_args(base)) == 1:
            return f"`{choices}`", [f"must be {choices}"]
        return f"one of {choices}", [f"one of {choices}"]
    if get_origin(base) is list:
        item, item_constraints = _describe_type(get_args(base)[0])
        item_base = unwrap_type(get_args(base)[0])[0]
        items = _PLURAL.get(item_base, item) if not item_constraints else f"({item})"
        text = f"list of {items}"
        constraints += [f"items: {c}" for c in item_constraints]
    elif get_origin(base) is dict or base is dict:
        text = "mapping"
    elif get_origin(base) in (Union, types.UnionType):
        text = " or ".join(_describe_type(a)[0] for a in get_args(base))
    else:
        text = _bounds(_KIND.get(base, getattr(base, "__name__", str(base))), metas)
    if min_length == 1 and max_length is None:
        text = f"non-empty {text}"
    if min_length is not None:
        constraints.append(f"at least {min_length} {'item' if get_origin(base) is list else 'character'}(s)")
    if max_length is not None:
        text += f" of at most {max_length}"
        constraints.append(f"at most {max_length} {'item' if get_origin(base) is list else 'character'}(s)")
    if pattern is not None:
        text = f"{text} matching `{pattern}`"
        constraints.append(f"matches `{pattern}`")
    return text, constraints


def _yaml(value: Any) -> str:
    """A default as the user would write it in YAML (flow style, one line)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, msgspec.Struct):
        return ALL_DEFAULTS
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf, sort_keys=False).strip()
    return text.removesuffix("...").strip()


def _default(field: msgspec.structs.FieldInfo) -> str:
    if field.default is not msgspec.NODEFAULT:
        return _yaml(field.default)
    if field.default_factory is not msgspec.NODEFAULT:
        return _yaml(field.default_factory())
    return REQUIRED


def _markdown(doc: str | None) -> str:
    """A docstring as Markdown: dedented, rst double backticks made single."""
    return inspect.cleandoc(doc or "").replace("``", "`")


def _field_doc(prefix: str, field: msgspec.structs.FieldInfo) -> FieldDoc:
    type_text, constraints = _describe_type(field.type)
    base, metas, _ = unwrap_type(field.type)
    meaning = _merged(metas, "description") or ""
    if _is_struct(base) and not meaning:
        meaning = _markdown(base.__doc__).split("\n\n")[0].replace("\n", " ")
    key = f"{prefix}.{field.encode_name}" if prefix else field.encode_name
    return FieldDoc(key, type_text, _default(field), meaning, tuple(constraints), base if _is_struct(base) else None)


def sections(root: type[msgspec.Struct] = JobSpec, prefix: str = "") -> Iterator[SectionDoc]:
    """Every section of the schema, the top level first, then each section in field order."""
    fields = tuple(_field_doc(prefix, f) for f in msgspec.structs.fields(root))
    yield SectionDoc(prefix, _markdown(root.__doc__), fields)
    for field in fields:
        if field.section is not None:
            yield from sections(field.section, field.key)


def all_fields() -> dict[str, FieldDoc]:
    """Every key of the schema (sections included) by dotted name, in document order."""
    return {f.key: f for section in sections() for f in section.fields}


# ---------------------------------------------------------------- the Markdown page


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _code(default: str) -> str:
    return {REQUIRED: f"*{REQUIRED}*", ALL_DEFAULTS: ALL_DEFAULTS}.get(default, f"`{default}`")


def _section_markdown(section: SectionDoc, parent: FieldDoc | None) -> list[str]:
    title = f"`{section.key}`" if section.key else "Top level"
    lines = [f"## {title}", "", section.intro, ""]
    if parent is not None:
        status = {REQUIRED: "Required.", ALL_DEFAULTS: "Optional; when absent, every key below takes its default."}.get(
            parent.default, f"Default: {_code(parent.default)}."
        )
        said = parent.meaning and not section.intro.startswith(parent.meaning)  # not just the docstring again
        lines += [status + (f" {parent.meaning.rstrip('.')}." if said else ""), ""]
    lines += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in section.fields:
        type_text = f"section, see [`{f.key}`](#{f.key.replace('.', '')})" if f.section else f.type
        if f.section and f.type.startswith("null or"):
            type_text = f"null or {type_text}"
        lines.append(f"| `{f.key}` | {_cell(type_text)} | {_cell(_code(f.default))} | {_cell(f.meaning)} |")
    return lines + [""]


def render_reference() -> str:
    """The whole Markdown reference of the job spec (what ``docs/spec-reference.md`` holds)."""
    fields = all_fields()
    lines = [
        "<!-- Generated from plexctl/common/spec.py by plexctl/cli/spec_doc.py; do not edit by hand. -->",
        "",
        "# Job spec reference",
        "",
        "Generated from the schema in `plexctl/common/spec.py`; do not edit by hand. After changing the schema,",
        "regenerate it and commit the result:",
        "",
        f"    {REGENERATE}",
        "",
        f"`{CHECK}` exits 1 when this file is stale; `tests/test_spec_doc.py` checks the same.",
        "The same text, one key at a time: `plexctl validate --explain KEY` (e.g. `algo.lr`, `lora`).",
        "",
        "A key is written in YAML under its section (`algo: {lr: 3e-4}`) or overridden on the command",
        "line with `--set algo.lr=3e-4`. Relative paths are resolved against the YAML file's directory.",
        "",
    ]
    for section in sections():
        lines += _section_markdown(section, fields.get(section.key))
    return "\n".join(lines).rstrip("\n") + "\n"


def render_cluster_reference() -> str:
    """The Markdown reference of the cluster settings (what ``docs/cluster-reference.md`` holds)."""
    from plexctl.common import cluster_config as K

    (section,) = list(sections(K.ClusterConfig))
    lines = [
        "<!-- Generated from plexctl/common/cluster_config.py by plexctl/cli/spec_doc.py; do not edit by hand. -->",
        "",
        "# Cluster settings reference",
        "",
        "Generated from `ClusterConfig` in `plexctl/common/cluster_config.py`; do not edit by hand. After",
        "changing a setting, regenerate it and commit the result:",
        "",
        f"    {CLUSTER_REGENERATE}",
        "",
        f"`{CLUSTER_CHECK}` exits 1 when this file is stale; `tests/test_cluster_config.py` checks the same.",
        "",
        section.intro,
        "",
        "`plexctl up` takes each setting as the option the second column names (the same help, the same",
        "default); it writes them to `cluster.json` in the state directory. Those marked *local* or *Slurm*",
        "apply to that kind of cluster only. `slurm/plexrl.sbatch` takes them as `KEY=VALUE` in",
        "`PLEXRL_SETTINGS`; `python -m plexctl.common.cluster_config FILE KEY=VALUE ...` writes a config file.",
        "",
        "| setting | `up` option | type | default | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for f in section.fields:
        where = {K.LOCAL: " *(local)*", K.SLURM: " *(Slurm)*"}.get(K.scope(f.key) or "", "")
        row = [
            f"`{f.key}`",
            f"`{K.option_name(f.key)}`{where}",
            _cell(f.type),
            _cell(_code(f.default)),
            _cell(f.meaning),
        ]
        lines.append("| " + " | ".join(row) + " |")
    derived = (
        "Derived defaults (one function each in `plexctl/common/cluster_config.py`): `drain_timeout_s` (30 s on a "
        "local cluster; on Slurm the signal grace less max(15 s, 20 %), at least 10 s: 240 s for the default 300 s) "
        "and `min_lora_rank` (the Tinker SDK's default rank when `tinker_port` is set). What the engines' platform "
        "decides (null engine settings) is declared once in `plexctl/common/engine_defaults.py` (`ENGINE_DEFAULTS`, "
        "and `adapter_slots` for `max_loras`): the workers resolve it from there and `plexctl plan` assumes a GPU's."
    )
    return "\n".join([*lines, "", derived]) + "\n"


# ---------------------------------------------------------------- one key: plexctl validate --explain


def _suggest(key: str, valid: Sequence[str]) -> str | None:
    leaf = key.rsplit(".", 1)[-1]
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in reversed(valid)}  # the first key with that leaf wins
    if leaf in by_leaf:  # `lr` -> `algo.lr`
        return by_leaf[leaf]
    close = difflib.get_close_matches(key, valid, n=1)  # `algo.lrr` -> `algo.lr`
    if close:
        return close[0]
    close = difflib.get_close_matches(leaf, list(by_leaf), n=1)  # `rnak` -> `lora.rank`
    return by_leaf[close[0]] if close else None


def explain(key: str) -> str:
    """Type, default, meaning and constraints of one dotted key (``algo.lr``) or a section (``lora``).

    Raises ``UnknownSpecKey`` (a usage error) naming the closest valid key.
    """
    fields = all_fields()
    wanted = key.strip()
    if wanted not in fields:
        raise UnknownSpecKey(wanted, _suggest(wanted, list(fields)))
    field = fields[wanted]
    lines = [
        f"{field.key}",
        f"  type:        {field.type.replace('section', 'section (mapping)') if field.section else field.type}",
        f"  default:     {field.default}",
        f"  meaning:     {field.meaning or '-'}",
        f"  constraints: {'; '.join(field.constraints) if field.constraints else 'none'}",
    ]
    if field.section is not None:
        section = next(s for s in sections() if s.key == field.key)
        lines += ["", *("  " + line for line in section.intro.splitlines()), "", "  keys:"]
        width = max(len(f.key) for f in section.fields)
        for f in section.fields:
            lines.append(f"    {f.key:<{width}}  {f.type}  (default {f.default})  {f.meaning}")
    return "\n".join(lines)


# ---------------------------------------------------------------- python -m plexctl.cli.spec_doc


def check(path: Path, cluster: bool = False) -> str | None:
    """None when ``path`` holds the current reference (the cluster settings' with ``cluster``), else a
    one-line hint saying what differs."""
    expected = render_cluster_reference() if cluster else render_reference()
    regenerate = CLUSTER_REGENERATE if cluster else REGENERATE
    try:
        actual = path.read_text(encoding="utf-8")
    except OSError as e:
        return f"{path}: cannot read ({e.strerror or e}); generate it with: {regenerate}"
    if actual == expected:
        return None
    old, new = actual.splitlines(), expected.splitlines()
    line = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
    got = old[line] if line < len(old) else "<end of file>"
    want = new[line] if line < len(new) else "<end of file>"
    return (
        f"{path} is stale: line {line + 1} is {got[:80]!r}, the schema gives {want[:80]!r}; "
        f"regenerate it with: {regenerate}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m plexctl.cli.spec_doc",
        description="Print the job spec reference (Markdown) generated from the schema.",
    )
    parser.add_argument(
        "--check",
        metavar="FILE",
        type=Path,
        help="exit 1 (with a one-line hint) if FILE differs from the generated reference",
    )
    parser.add_argument("--cluster", action="store_true", help="the cluster settings' reference instead")
    args = parser.parse_args(argv)
    if args.check is None:
        sys.stdout.write(render_cluster_reference() if args.cluster else render_reference())
        return 0
    problem = check(args.check, args.cluster)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    print(f"{args.check}: up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
