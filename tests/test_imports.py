"""The process boundaries, as imports: nothing under ``plexctl/`` (the CLI, the job library, the
wire and common modules) imports the daemon's or the workers' modules, torch or vLLM; what needs
them runs in a child process (``python -m daemon.simulate``, ``python -m worker.tiny_models``).
Read from the source with ``ast``, so an import inside a function counts as much as one at the top.
And the packages a wheel ships are every package folder of the three."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = ("daemon", "worker", "torch", "vllm")


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, relative ones resolved against its package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
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


def test_plexctl_imports_no_daemon_worker_torch_or_vllm() -> None:
    bad = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in sorted((REPO / "plexctl").rglob("*.py"))
        for line, module in imported_modules(path)
        if module.split(".")[0] in FORBIDDEN
    ]
    assert not bad, "plexctl/ must not import these (run them in a child process):\n" + "\n".join(bad)


JOB_LIBRARY_ALLOWED = ("plexctl.common",)  # the wire and common modules every process may import
FIXTURE_BUILDERS = frozenset({"worker/tiny_models.py"})  # builds the tiny models with the job library's task data


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
    bad = _job_library_imports("plexctl/common") + _job_library_imports("worker", FIXTURE_BUILDERS)
    assert not bad, "imports of the job library from plexctl/common or worker/:\n" + "\n".join(bad)


# the daemon's processes that host the job library by design: a job's driver, the in-process client
JOB_LIBRARY_HOSTS = frozenset({"daemon/driver.py", "daemon/inproc.py"})


def test_the_daemon_imports_nothing_of_the_job_library() -> None:
    """The broker, core, scheduler and jail rest on the common modules alone (the rules they share
    with the CLI live there: ``plexctl.common.context_fit``, ``uploads``, ``datasets``)."""
    bad = _job_library_imports("daemon", JOB_LIBRARY_HOSTS)
    assert not bad, "imports of the job library from daemon/:\n" + "\n".join(bad)


def test_the_check_sees_imports_inside_functions() -> None:
    probe = REPO / "plexctl" / "cli" / "slurm.py"
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
