"""The process boundaries, as imports: nothing under ``plexctl/`` (the CLI, the job library, the
wire and common modules) imports the daemon's or the workers' modules, torch or vLLM; what needs
them runs in a child process (``python -m daemon.simulate``, ``python -m plexctl.tiny_models``).
Inside ``worker/`` and ``daemon/``, the layers (``WORKER_LAYERS``, ``DAEMON_LAYERS``): a module
imports only from its own layer or lower ones. Read from the source with ``ast``, so an import
inside a function or under ``if TYPE_CHECKING:`` counts as much as one at the top. And the packages
a wheel ships are every package folder of the three."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = ("daemon", "worker", "torch", "vllm")


def imported_modules(path: Path, root: Path = REPO) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, relative ones resolved against its package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.append((node.lineno, ".".join([*base, *([node.module] if node.module else [])])))
            else:
                found.append((node.lineno, node.module or ""))
    return found


# The one plexctl/ module that imports torch (and transformers): it builds the tiny models the demo
# and the tests run, with the job library's task data, and runs only as a child process
# (``python -m plexctl.tiny_models``, from ``plexctl demo`` and the tests); nothing imports it in
# the CLI's process. It imports nothing of the daemon, the workers or vLLM either.
CHILD_PROCESS_BUILDERS = {"plexctl/tiny_models.py": frozenset({"torch"})}


def test_plexctl_imports_no_daemon_worker_torch_or_vllm() -> None:
    bad = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in sorted((REPO / "plexctl").rglob("*.py"))
        for line, module in imported_modules(path)
        if module.split(".")[0] in FORBIDDEN
        and module.split(".")[0] not in CHILD_PROCESS_BUILDERS.get(str(path.relative_to(REPO)), ())
    ]
    assert not bad, "plexctl/ must not import these (run them in a child process):\n" + "\n".join(bad)


def test_no_plexctl_module_imports_the_child_process_builders() -> None:
    """The exempt builders stay out of every process but their own: no module imports them."""
    builders = {".".join(Path(path).with_suffix("").parts) for path in CHILD_PROCESS_BUILDERS}
    bad = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for top in ("plexctl", "daemon", "worker")
        for path in sorted((REPO / top).rglob("*.py"))
        for line, module in layer_imports(path)  # ``from plexctl import tiny_models`` too
        if module in builders
    ]
    assert not bad, "run these as child processes, never import them:\n" + "\n".join(bad)


JOB_LIBRARY_ALLOWED = ("plexctl.common",)  # the wire and common modules every process may import


def _job_library_imports(folder: str, skip: frozenset[str] = frozenset()) -> list[str]:
    return [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in sorted((REPO / folder).rglob("*.py"))
        if str(path.relative_to(REPO)) not in skip
        for line, module in imported_modules(path)
        if (module == "plexctl" or module.startswith("plexctl.")) and not module.startswith(JOB_LIBRARY_ALLOWED)
    ]


def test_common_and_the_worker_import_nothing_of_the_job_library() -> None:
    """``plexctl.common`` sits below the job library (``plexctl.rl``, data, rewards, envs, the
    spec's file checks in ``plexctl.spec_files``), and the engines use the common modules alone."""
    bad = _job_library_imports("plexctl/common") + _job_library_imports("worker")
    assert not bad, "imports of the job library from plexctl/common or worker/:\n" + "\n".join(bad)


# the daemon's processes that host the job library by design: a job's driver, the in-process client
JOB_LIBRARY_HOSTS = frozenset({"daemon/driver.py", "daemon/inproc.py"})


def test_the_daemon_imports_nothing_of_the_job_library() -> None:
    """The broker, core, scheduler and jail rest on the common modules alone (the rules they share
    with the CLI live there: ``plexctl.common.context_fit``, ``uploads``, ``datasets``)."""
    bad = _job_library_imports("daemon", JOB_LIBRARY_HOSTS)
    assert not bad, "imports of the job library from daemon/:\n" + "\n".join(bad)


# The layers inside a process's package, lowest first: a module imports only from its own layer or
# lower ones, so each layer can be read, tested and replaced without those above it. A name
# ending in ``.*`` is every module of that package (and the package itself). Every module is in
# one layer. A lower layer that needs something of a higher one declares it (a ``typing.Protocol``,
# such as ``worker.state.engine.StateEngine``) and is handed the object; ``TYPE_CHECKING`` imports
# count as imports.
WORKER_LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation",
        (
            "errors",
            "vllm_private",
            "host_heap",
            "io",
            "checkpoint_files",
            "checkpoint_shards",
            "engine_options",
            "engine_args",
            "shards",
        ),
    ),
    ("state copies and the store", ("state.*",)),
    (
        "the math",
        (
            "token_logprobs",
            "loss_terms",
            "tinker_losses",
            "train_batches",
            "decoder_layers",
            "fused_lora",
            "cpu_lora_ops",
        ),
    ),
    ("the trainer's parts", ("trainer_slots", "trainer_math", "trainer_tokens")),
    ("the engines", ("trainer", "rollout", "trainer_group")),
    ("the process", ("servers", "main", "ranks")),
]
DAEMON_LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "records and rules",
        ("policies", "elastic", "journal", "blobs", "auth", "throttle", "quotas", "trace", "procs", "sched_records"),
    ),
    ("the scheduler's parts", ("task_order", "engine_time", "switches", "passes", "homes", "queues")),
    ("scheduler", ("scheduler", "metrics")),
    ("jailed processes", ("driver", "jail_boot", "jail", "confine")),
    ("core", ("core.*",)),  # one layer: its modules may import one another
    ("elastic allocations", ("allocations",)),
    ("server and simulator", ("main", "simulator")),
    ("entry points", ("inproc", "node", "simulate")),
]


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer_index(top: str, layers: list[tuple[str, tuple[str, ...]]], root: Path) -> dict[str, int]:
    """Every module of the package ``top`` -> its layer's position (a module in no layer is left out)."""
    index: dict[str, int] = {}
    for path in sorted((root / top).rglob("*.py")):
        module = _module_name(path, root)
        if module == top:
            continue
        name = module[len(top) + 1 :]
        for position, (_, members) in enumerate(layers):
            for member in members:
                if name == member or (member.endswith(".*") and (name + ".").startswith(member[:-1])):
                    index[module] = position
    return index


def layer_imports(path: Path, root: Path = REPO) -> list[tuple[int, str]]:
    """``imported_modules``, with ``from package import module`` read as the module it names."""
    found = list(imported_modules(path, root))
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                if (root / Path(*name.split("."))).with_suffix(".py").exists():
                    found.append((node.lineno, name))
    return found


def _upward_imports(
    top: str, layers: list[tuple[str, tuple[str, ...]]], root: Path = REPO
) -> tuple[list[str], list[str]]:
    """(modules in no layer, imports of a higher layer's module) under ``root / top``."""
    index = _layer_index(top, layers, root)
    names = [layer for layer, _ in layers]
    unplaced, upward = [], []
    for path in sorted((root / top).rglob("*.py")):
        module = _module_name(path, root)
        if module == top:
            continue
        if module not in index:
            unplaced.append(module)
            continue
        for line, imported in layer_imports(path, root):
            if imported in index and index[imported] > index[module]:
                upward.append(
                    f"{path.relative_to(root)}:{line}: {imported} "
                    f"({names[index[module]]} imports {names[index[imported]]})"
                )
    return unplaced, upward


def test_worker_modules_import_only_their_layer_or_lower() -> None:
    unplaced, upward = _upward_imports("worker", WORKER_LAYERS)
    assert not unplaced, f"put these in a layer of WORKER_LAYERS: {unplaced}"
    assert not upward, "imports of a higher layer inside worker/:\n" + "\n".join(upward)


def test_daemon_modules_import_only_their_layer_or_lower() -> None:
    unplaced, upward = _upward_imports("daemon", DAEMON_LAYERS)
    assert not unplaced, f"put these in a layer of DAEMON_LAYERS: {unplaced}"
    assert not upward, "imports of a higher layer inside daemon/:\n" + "\n".join(upward)


def test_the_layer_check_sees_an_upward_import(tmp_path: Path) -> None:
    """A store that imports the trainer is caught, even under ``if TYPE_CHECKING:``; the trainer
    importing the store's copies is not; a module in no layer is named."""
    (tmp_path / "worker" / "state").mkdir(parents=True)
    (tmp_path / "worker" / "state" / "store.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from worker import trainer\n"
    )
    (tmp_path / "worker" / "trainer.py").write_text("from worker.state import store\n")
    (tmp_path / "worker" / "stray.py").write_text("")
    unplaced, upward = _upward_imports("worker", WORKER_LAYERS, tmp_path)
    assert unplaced == ["worker.stray"]
    assert upward == ["worker/state/store.py:3: worker.trainer (state copies and the store imports the engines)"]


def test_the_check_sees_imports_inside_functions() -> None:
    probe = REPO / "plexctl" / "common" / "slurm.py"
    modules = {module for _, module in imported_modules(probe)}
    assert "submitit" in modules  # imported inside submit_submitit only


def test_the_cli_starts_without_heavy_modules() -> None:
    import subprocess

    code = (
        "import sys; sys.argv = ['plexctl', '--help']\n"
        "from plexctl.cli.app import app\n"
        "try:\n    app(standalone_mode=False)\nexcept SystemExit:\n    pass\n"
        "heavy = ('torch', 'vllm', 'daemon', 'worker', 'yaml', 'zmq', 'rich', 'matplotlib')\n"
        "print('heavy:', *(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert "Usage:" in out.stdout and out.stdout.strip().splitlines()[-1] == "heavy:", out.stdout


def test_the_wheel_ships_every_package_folder() -> None:
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {
        ".".join(init.parent.relative_to(REPO).parts)
        for top in ("plexctl", "daemon", "worker")
        for init in (REPO / top).rglob("__init__.py")
    }
    assert folders <= listed, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(folders - listed)}"
    assert listed - folders == {"plexctl.examples"}  # configs/, mapped by package-dir
