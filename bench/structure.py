"""How the code is put together, as numbers: the largest class, the state each part touches, and
the forms each cluster setting is declared in.

Read from the source with ``ast`` (nothing is imported or run), so it measures any checkout:
``python bench/structure.py --repo DIR`` (default: this one). The figures:

- largest class: lines of one class body, and lines of a class together with the project classes
  it inherits from (a mixin chain counts whole);
- state per part: for each class of ``daemon/core/`` and of the trainer (``worker/trainer*.py``),
  the distinct ``self.X`` names its own methods read or write, mixins' included;
- forms per setting: for every field of ``ClusterConfig``, the places that declare it again: an
  ``add_argument("--name")`` flag, a typed command-line option (an ``Annotated`` parameter), or a
  parameter or class field named after it with a literal default of its own; the config's own
  declaration counts as the first form.

A table on stdout, JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

PACKAGES = ("daemon", "worker", "plexctl")
CONFIG = Path("plexctl/common/cluster_config.py")
SETTING_HOMES = {CONFIG, Path("plexctl/common/engine_defaults.py")}  # where a setting's one form lives


def _files(repo: Path) -> dict[Path, ast.Module]:
    return {
        path.relative_to(repo): ast.parse(path.read_text(), filename=str(path))
        for package in PACKAGES
        for path in sorted((repo / package).rglob("*.py"))
    }


def _classes(trees: dict[Path, ast.Module]) -> dict[str, tuple[Path, ast.ClassDef]]:
    found: dict[str, tuple[Path, ast.ClassDef]] = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, (path, node))
    return found


def _lines(node: ast.ClassDef) -> int:
    return (node.end_lineno or node.lineno) - node.lineno + 1


def _bases(name: str, classes: dict[str, tuple[Path, ast.ClassDef]], seen: set[str] | None = None) -> set[str]:
    """``name`` and every project class it inherits from."""
    seen = set() if seen is None else seen
    if name in seen or name not in classes:
        return seen
    seen.add(name)
    for base in classes[name][1].bases:
        if isinstance(base, ast.Name):
            _bases(base.id, classes, seen)
        elif isinstance(base, ast.Attribute):
            _bases(base.attr, classes, seen)
    return seen


def _self_names(node: ast.ClassDef) -> set[str]:
    """The ``self.X`` names the class's own methods use, methods and properties left out."""
    own = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    used = {
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
    }
    return used - own


def largest_classes(trees: dict[Path, ast.Module]) -> dict[str, object]:
    classes = _classes(trees)
    body = max(classes.items(), key=lambda kv: _lines(kv[1][1]))
    whole = {name: sum(_lines(classes[b][1]) for b in _bases(name, classes)) for name in classes}
    composed = max(whole.items(), key=lambda kv: kv[1])
    return {
        "largest_class": {"name": body[0], "file": str(body[1][0]), "lines": _lines(body[1][1])},
        "largest_class_with_bases": {
            "name": composed[0],
            "file": str(classes[composed[0]][0]),
            "lines": composed[1],
            "bases": sorted(_bases(composed[0], classes) - {composed[0]}),
        },
    }


def state_per_part(trees: dict[Path, ast.Module]) -> dict[str, int]:
    parts: dict[str, int] = {}
    for path, tree in trees.items():
        trainer = path.parts[0] == "worker" and path.stem.startswith("trainer")
        if not (path.parts[:2] == ("daemon", "core") or trainer):
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and any(
                isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body
            ):
                names = _self_names(node)
                if names:
                    parts[f"{path}:{node.name}"] = len(names)
    return dict(sorted(parts.items(), key=lambda kv: -kv[1]))


def _settings(trees: dict[Path, ast.Module]) -> list[str]:
    for node in ast.walk(trees[CONFIG]):
        if isinstance(node, ast.ClassDef) and node.name == "ClusterConfig":
            return [n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    raise SystemExit(f"no ClusterConfig in {CONFIG}")


def _literal(node: ast.expr | None) -> bool:
    """A default written out as a value of its own (not None, not taken from elsewhere)."""
    if isinstance(node, ast.UnaryOp):
        node = node.operand
    return isinstance(node, ast.Constant) and node.value is not None


def forms_per_setting(trees: dict[Path, ast.Module]) -> dict[str, list[str]]:
    settings = _settings(trees)
    forms: dict[str, list[str]] = {s: [f"{CONFIG}:ClusterConfig"] for s in settings}
    for path, tree in trees.items():
        if path in SETTING_HOMES:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("--"):
                        name = arg.value[2:].replace("-", "_")
                        if name in forms:
                            forms[name].append(f"{path}:{node.lineno} flag")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                positional = args.posonlyargs + args.args
                defaulted = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
                defaulted += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
                for a, default in defaulted:
                    option = isinstance(a.annotation, ast.Subscript) and "Annotated" in ast.unparse(a.annotation)
                    if a.arg in forms and (option or _literal(default)):
                        what = "option" if option else "default"
                        forms[a.arg].append(f"{path}:{node.lineno} {what} of {node.name}")
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and _literal(item.value):
                        if item.target.id in forms:
                            forms[item.target.id].append(f"{path}:{item.lineno} field of {node.name}")
    return forms


def measure(repo: Path) -> dict[str, object]:
    trees = _files(repo)
    parts = state_per_part(trees)
    forms = forms_per_setting(trees)
    counts = [len(v) for v in forms.values()]
    return {
        **largest_classes(trees),
        "state_per_part": parts,
        "state_per_part_max": max(parts.values(), default=0),
        "settings": len(forms),
        "forms_per_setting_max": max(counts),
        "forms_per_setting_mean": round(sum(counts) / len(counts), 2),
        "settings_in_more_than_one_form": {k: v for k, v in forms.items() if len(v) > 1},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--out", type=Path, help="write the figures here as JSON")
    ap.add_argument("--quick", action="store_true", help="the same (it reads source only); for the test suite")
    args = ap.parse_args(argv)
    m = measure(args.repo.resolve())
    big, whole = m["largest_class"], m["largest_class_with_bases"]
    assert isinstance(big, dict) and isinstance(whole, dict)
    rows = [
        ("largest class body", f"{big['name']} ({big['file']}): {big['lines']} lines"),
        ("largest class with its bases", f"{whole['name']} ({whole['file']}): {whole['lines']} lines"),
        ("most state one part touches", f"{m['state_per_part_max']} attributes"),
        ("settings", str(m["settings"])),
        ("forms per setting", f"max {m['forms_per_setting_max']}, mean {m['forms_per_setting_mean']}"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  value")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    extra = m["settings_in_more_than_one_form"]
    assert isinstance(extra, dict)
    for name, places in sorted(extra.items(), key=lambda kv: -len(kv[1])):
        print(f"  {name}: {len(places)} forms: " + "; ".join(places[1:]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(m, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
