"""A cluster setting has one default, declared in ``ClusterConfig`` (or, where the platform decides,
``plexctl.common.engine_defaults``): no function parameter, dataclass or struct field of the same name
(or one of its known aliases) in the daemon, the workers or the CLI declares a literal default of its
own; and every setting is an option of `up` (a new setting is one field)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path

from typer.testing import CliRunner

from plexctl.cli import app as A
from plexctl.common import cluster_config as K

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("daemon", "worker", "plexctl")
DECLARED_IN = {"plexctl/common/cluster_config.py", "plexctl/common/engine_defaults.py"}
# wire structs: a field's zero value means a peer did not say it, not a default of the setting
WIRE = {"plexctl/common/protocol.py"}
ALIASES = {  # other names a setting goes by in the code that takes it
    "tp": {"tensor_parallel_size"},
    "host_mem": {"host_bytes"},
    "write_behind": {"write_behind_bytes"},
    "max_loras": {"max_cpu_loras"},
    "group_window_ms": {"group_window_s"},
    "worker_grace": {"worker_grace_s"},
}
# each entry: a default someone else's module still declares (to remove), or a name that means
# something else there; the test fails when an entry no longer matches anything
ALLOWED = {
    # the store on its own writes before ensure_resident returns (what tests that count moves
    # need); the worker passes the config's rule (worker.main.write_behind_bytes)
    "worker/state/store.py: __init__(write_behind_bytes=0)",
    # the same name, another meaning
    # the simulator's engines have no memory to derive the config's cap from (null): it is told one
    "daemon/simulator.py: simulate(jobs_per_engine=4)",
    "daemon/simulator.py: predict(jobs_per_engine=8)",
    "daemon/simulator.py: __init__(jobs_per_engine=4)",
    "daemon/sched_records.py: Engine.device=''",  # the engine's device as it registered ('' unsaid)
    "worker/state/job_copy.py: __init__(device='cpu')",  # a torch device
    "worker/tinker_losses.py: of(device='cpu')",  # a torch device
    "worker/trainer.py: __init__(device='cpu')",  # a torch device
    "worker/trainer.py: __init__(gradient_checkpointing=False)",  # the decision (a bool), not the setting
    "plexctl/common/memplan.py: TrainerPlan.gradient_checkpointing=True",  # the plan's decision (a bool)
    "plexctl/common/spec.py: EnvSpec.workers=4",  # an environment's worker processes
    "plexctl/common/state_size.py: full_state_size(dtype='bfloat16')",  # a job's model dtype
    "plexctl/common/state_size.py: full_state_bytes(dtype='bfloat16')",  # a job's model dtype
}


def _names() -> dict[str, str]:
    """Every name that stands for a setting, and the setting it stands for."""
    return {s: s for s in K.settings()} | {alias: s for s, aliases in ALIASES.items() for alias in aliases}


def _literal(node: ast.expr | None) -> bool:
    """A constant other than None (``DEFAULTS.x``, ``ENGINE_DEFAULTS[...]``, ``None`` are not)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and node.value is not None


def _declared_defaults(text: str, where: str) -> Iterator[str]:
    """``WHERE: function(name=value)`` / ``WHERE: Class.name=value`` for each literal default of a setting."""
    names = _names()
    for node in ast.walk(ast.parse(text, where)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs: list[tuple[ast.arg, ast.expr | None]] = [
                *zip(positional[len(positional) - len(a.defaults) :], a.defaults),
                *zip(a.kwonlyargs, a.kw_defaults),
            ]
            for arg, value in pairs:
                if arg.arg in names and value is not None and _literal(value):
                    yield f"{where}: {node.name}({arg.arg}={ast.literal_eval(value)!r})"
        elif isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if (
                    isinstance(stmt, ast.AnnAssign)
                    and isinstance(stmt.target, ast.Name)
                    and stmt.target.id in names
                    and stmt.value is not None
                    and _literal(stmt.value)
                ):
                    yield f"{where}: {node.name}.{stmt.target.id}={ast.literal_eval(stmt.value)!r}"


def _all_declared() -> list[str]:
    found: list[str] = []
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel not in DECLARED_IN | WIRE:
                found += _declared_defaults(path.read_text(), rel)
    return found


def test_no_setting_has_a_literal_default_outside_the_config() -> None:
    found = _all_declared()
    unlisted = [d for d in found if not any(fnmatch(d, entry) for entry in ALLOWED)]
    assert unlisted == [], "take the default from the config (DEFAULTS.x) or declare none"
    stale = [entry for entry in ALLOWED if not any(fnmatch(d, entry) for d in found)]
    assert stale == [], "allow-list entries that no longer match anything: remove them"


def test_the_scan_sees_a_duplicated_default() -> None:
    text = "class S:\n    device_slots: int = 4\n\n\n"
    text += "def f(host_bytes=8, tp=None, max_loras=-1, *, nodes=DEFAULTS.nodes):\n    pass\n"
    assert sorted(_declared_defaults(text, "w.py")) == [
        "w.py: S.device_slots=4",
        "w.py: f(host_bytes=8)",
        "w.py: f(max_loras=-1)",
    ]


def test_up_has_an_option_for_every_setting() -> None:
    help_text = CliRunner().invoke(A.build(["up"]), ["up", "--help"], terminal_width=200).output
    missing = [s for s in K.settings() if f"{K.option_name(s)} " not in help_text]
    assert missing == [], f"settings without an `up` option: {missing}"
