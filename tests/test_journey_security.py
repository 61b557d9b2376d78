"""docs/security.md's (and README's) steps for a second user, run as they are typed.

The owner (root here, as on CI) starts a local cluster of its own; ``dana``, a real Unix account
the test makes, runs the CLI in subprocesses under her own uid, with her own HOME, through a
``plexctl`` of her own on her PATH: ``keygen``; the owner ``share``s her key; she reaches the
cluster with ``--state-dir`` (its directory is 0711: only ``endpoint.json`` is readable to her),
submits a spec of hers (her data, uploaded by her client), follows it with ``status``, ``logs``
and ``wait``, and ``export``s its adapter into a directory of hers. Each step checks its exit
code and what she would look for in its output; the owner's job is never shown to her.
A last test keeps docs/security.md's fenced commands in step with the CLI (``doc_commands``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, Cluster, local_account
from doc_commands import check_command, shell_commands

USER = "dana"
SECURITY_MD = REPO / "docs" / "security.md"
TINY = REPO / "configs" / "tiny-arith.yaml"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="makes a second Unix user (needs root)")

Account = tuple[int, int, Path]


@pytest.fixture(scope="module")
def dana() -> Iterator[Account]:
    """Her account, with a HOME that holds nothing of PlexRL yet."""
    with local_account(USER) as (uid, gid, home):
        for leftover in (home / ".plexrl", home / "tiny-job", home / "adapters"):
            shutil.rmtree(leftover, ignore_errors=True)
        yield uid, gid, home


def as_user(account: Account, bin_dir: Path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``argv`` run as the account, from its HOME, with an environment of its own."""
    uid, gid, home = account
    env = {"HOME": str(home), "USER": USER, "LOGNAME": USER, "PATH": f"{bin_dir}:/usr/bin:/bin", "LANG": "C.UTF-8"}
    return subprocess.run(
        list(argv),
        user=uid,
        group=gid,
        extra_groups=[],
        env=env,
        cwd=home,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def her_bin(dana: Account) -> Iterator[Path]:
    """A directory with her ``plexctl``: this checkout, on an interpreter she may run. The test's
    own when its path is open to her; else a system Python of the same version reading this
    environment's packages (a pyenv interpreter under root's 0700 home is not open to her)."""
    base = Path("/var/tmp") / f"plexrl-journey-{uuid.uuid4().hex[:8]}"
    (base / "bin").mkdir(parents=True)
    base.chmod(0o755)
    (base / "bin").chmod(0o755)
    packages = dict.fromkeys([str(REPO), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    candidates = [(sys.executable, str(REPO)), (shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin"), "")]
    for python, path in candidates:
        path = path or ":".join(packages)
        check = f"import sys, plexctl.cli.app; assert sys.version_info[:2] == {tuple(sys.version_info[:2])}"
        if python and as_user(dana, base / "bin", "env", f"PYTHONPATH={path}", python, "-c", check).returncode == 0:
            plexctl = base / "bin" / "plexctl"
            plexctl.write_text(f'#!/bin/sh\nPYTHONPATH={path} exec {python} -m plexctl.cli "$@"\n')
            plexctl.chmod(0o755)
            break
    else:
        shutil.rmtree(base)
        pytest.skip("no interpreter the second user may run with this environment's packages")
    yield base / "bin"
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def shared(tiny_model: Path) -> Iterator[Cluster]:
    """The owner's cluster, kept as docs/security.md asks: other users may pass through every
    directory above its state directory (o+x, no listing). Its own, not the session's: that one
    lies under pytest's 0700 base directory, which each pytest run closes again."""
    base = Path("/var/tmp") / f"plexrl-owner-{uuid.uuid4().hex[:8]}"
    base.mkdir(mode=0o711)
    base.chmod(0o711)
    (base / "home").mkdir(mode=0o711)
    (base / "home").chmod(0o711)
    c = Cluster(base / "home").up(tiny_model, "--workers", "1", "--openai-port", "0")
    yield c
    c.run("down", timeout=120)
    shutil.rmtree(base, ignore_errors=True)


def her_job_dir(account: Account, tiny_model: Path, name: str) -> Path:
    """A directory of hers in her HOME: the tiny spec, her own data beside it."""
    uid, gid, home = account
    job_dir = home / name
    shutil.rmtree(job_dir, ignore_errors=True)
    job_dir.mkdir()
    spec = TINY.read_text().replace("../.plexrl/models/tiny-arith", str(tiny_model))
    spec = spec.replace("../.plexrl/data/arith/", "")
    (job_dir / "job.yaml").write_text(spec)
    for data in ("train.jsonl", "eval.jsonl"):
        shutil.copy(REPO / ".plexrl" / "data" / "arith" / data, job_dir / data)
    for p in (job_dir, *job_dir.iterdir()):
        os.chown(p, uid, gid)
    return job_dir


def one_line(proc: subprocess.CompletedProcess) -> str:
    """A refused command's error: exactly one line on stderr."""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def option_shape(argv: list[str]) -> tuple[str, ...]:
    """A command line's verb and option names, placeholders and values dropped."""
    verb = next(a for a in argv[2:] if not a.startswith("-"))  # after `--state-dir DIR`
    return (verb, *sorted(a.split("=")[0] for a in argv[argv.index(verb) :] if a.startswith("-")))


@needs_root
def test_a_shared_user_keygen_share_submit_follow_and_export_through_the_cli(
    shared: Cluster, dana: Account, her_bin: Path, tiny_model: Path
) -> None:
    uid, gid, home = dana
    ran: list[list[str]] = []

    def plexctl(*args: str, expect: int = 0, timeout: float = 300) -> subprocess.CompletedProcess:
        proc = as_user(dana, her_bin, "plexctl", *args, timeout=timeout)
        ran.append(list(args))
        assert proc.returncode == expect, (
            f"plexctl {shlex.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        )
        return proc

    # she: her key pair, in her own ~/.plexrl/keys
    keygen = plexctl("keygen")
    public = Path(keygen.stdout.splitlines()[0])
    assert public == home / ".plexrl" / "keys" / f"{USER}.key", keygen.stdout
    secret = public.with_suffix(".key_secret")
    assert public.stat().st_uid == uid and secret.stat().st_uid == uid
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert f"plexctl share {USER} --key {public}" in keygen.stdout

    state = shared.state_dir
    assert as_user(dana, her_bin, "ls", str(state)).returncode != 0  # the state directory: not hers to list
    before = plexctl("--state-dir", str(state), "status", expect=10)  # reached, but her key is not let in yet
    assert "refused this client's key" in one_line(before) and f"plexctl share {USER}" in before.stderr

    # the owner: let her key in; `share` prints the line she reaches the cluster with
    share = shared.run("share", USER, "--key", str(public), check=True)
    told = next(line for line in share.stdout.splitlines() if line.startswith("they reach it with: "))
    reach = shlex.split(told.removeprefix("they reach it with: "))
    assert reach[:3] == ["plexctl", "--state-dir", str(state.absolute())], share.stdout
    assert "note:" not in share.stdout, share.stdout  # every directory above it lets her pass
    at = reach[1:3]
    plexctl(*reach[1:])  # the line as `share` printed it
    assert plexctl(*at, "ls", "-q").stdout.strip() == ""  # no job of hers yet, and nobody else's shown

    # a job of the owner's, which she must never see
    owners = shared.run(
        "submit", str(TINY), "--set", "algo.steps=1", "--name", f"owner-{uuid.uuid4().hex[:6]}", "-q", check=True
    ).stdout.strip()

    # she: a copy of the tiny spec, her own data beside it (her client uploads it at submit)
    job_dir = her_job_dir(dana, tiny_model, "tiny-job")
    job = plexctl(*at, "submit", str(job_dir / "job.yaml"), "--set", "algo.steps=2", "-q").stdout.strip()
    assert job and job != owners

    listed = json.loads(plexctl(*at, "status", "--json").stdout)["jobs"]
    assert [(j["job_id"], j["user"], j["name"]) for j in listed] == [(job, USER, "tiny-arith")], listed
    assert plexctl(*at, "ls", "-q").stdout.split() == [job]
    assert job in plexctl(*at, "status").stdout
    for verb in ("logs", "cancel", "export"):  # not hers: as if it did not exist
        assert one_line(plexctl(*at, verb, owners, expect=4)) == f"error: no job {owners!r}", verb
    assert {owners, job} <= set(shared.run("ls", "-q", check=True).stdout.split())  # the owner sees both
    shared.run("cancel", owners, check=True)

    waited = plexctl(*at, "wait", job, "--timeout", "600", timeout=660)
    assert waited.stdout.strip() == f"{job}: succeeded", waited.stdout
    final = json.loads(plexctl(*at, "status", job, "--json").stdout)["jobs"][0]
    assert (final["state"], final["step"], final["user"]) == ("succeeded", 2, USER), final
    log = plexctl(*at, "logs", job).stdout
    assert "eval at step 2: reward" in log, log[-2000:]  # her data's eval set, read by her job
    metrics = [json.loads(line) for line in plexctl(*at, "logs", job, "--metrics").stdout.splitlines() if line]
    assert [m["step"] for m in metrics if "reward_mean" in m] == [1, 2], metrics

    # she: the adapter, into a directory of hers, written with her rights
    out = home / "adapters"
    exported = plexctl(*at, "export", job, "--to", str(out))
    (adapter,) = out.iterdir()
    assert adapter.name.startswith(f"{job}-adapter-") and str(adapter) in exported.stdout, exported.stdout
    files = {p.name for p in adapter.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files, files
    for p in (out, adapter, *adapter.rglob("*")):
        assert (p.stat().st_uid, p.stat().st_gid) == (uid, gid), p

    # what the docs show a shared user typing is what she typed (verbs and options)
    shown = [argv for argv in shell_commands(SECURITY_MD.read_text()) if argv[:1] == ["--state-dir"]]
    assert shown, "docs/security.md shows no `plexctl --state-dir STATE_DIR ...` line"
    typed = {option_shape(argv) for argv in ran if argv[:1] == ["--state-dir"]}
    assert {option_shape(argv) for argv in shown} <= typed, sorted({option_shape(a) for a in shown} - typed)


OPENAI_AS_HER = """
import json, sys
import openai
url, key_file, mine, owners = sys.argv[1:]
api = openai.OpenAI(base_url=url, api_key=open(key_file).read().strip(), max_retries=0)
out = {"models": sorted(m.id for m in api.models.list().data)}
chat = api.chat.completions.create(
    model=mine, messages=[{"role": "user", "content": "3+4="}], temperature=0.0, max_tokens=3, seed=1
)
out["mine"] = [chat.model, chat.choices[0].finish_reason]
for name in (owners, owners + "@1"):
    try:
        api.chat.completions.create(model=name, messages=[{"role": "user", "content": "3+4="}], max_tokens=2)
        out[name] = "answered"
    except openai.NotFoundError as exc:
        out[name] = exc.status_code
print(json.dumps(out))
"""


@needs_root
def test_a_shared_users_api_key_reaches_her_jobs_policy_and_nothing_of_the_owners(
    shared: Cluster, dana: Account, her_bin: Path, tiny_model: Path
) -> None:
    """docs/openai.md's "Keys and users", lived by a second Unix account: her `keygen` makes her
    API key, the owner lets it in with the `share` line keygen prints, her `status` names the
    OpenAI base_url, and the real `openai` SDK, run under her uid with her key, lists and chats
    with her job's policy while the owner's job is a 404 to her; hers is a 404 to the owner."""
    openai = pytest.importorskip("openai")
    uid, gid, home = dana
    at = ("--state-dir", str(shared.state_dir))

    def plexctl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        proc = as_user(dana, her_bin, "plexctl", *args, timeout=timeout)
        assert proc.returncode == 0, f"plexctl {shlex.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc

    keygen = plexctl("keygen")
    asked = next(line for line in keygen.stdout.splitlines() if "plexctl share" in line)
    share = shlex.split(asked.split("run: ", 1)[1])
    assert share[:3] == ["plexctl", "share", USER] and "--tinker-key-sha256" in share, keygen.stdout
    shared.run(*share[1:], check=True)
    key_file = home / ".plexrl" / "tinker-api-key"
    assert key_file.stat().st_uid == uid and stat.S_IMODE(key_file.stat().st_mode) == 0o600

    url = json.loads(plexctl(*at, "status", "--json").stdout)["openai_url"]  # tinker.json: hers to read
    assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
    assert f"OpenAI API: base_url={url}" in plexctl(*at, "status").stdout.replace("\n", "")

    owners = shared.run("submit", str(TINY), "--set", "algo.steps=2", "--name", "owners-policy", "-q", check=True)
    owners_job = owners.stdout.strip()
    job_dir = her_job_dir(dana, tiny_model, "tiny-api-job")
    mine = plexctl(*at, "submit", str(job_dir / "job.yaml"), "--set", "algo.steps=2", "-q").stdout.strip()
    for job in (owners_job, mine):
        assert shared.run("wait", job, "--timeout", "600", timeout=660).returncode == 0, job
        assert shared.job(job)["policy_version"] >= 1

    python, path = re.search(r"PYTHONPATH=(\S+) exec (\S+) -m", (her_bin / "plexctl").read_text()).group(2, 1)
    ran = as_user(
        dana, her_bin, "env", f"PYTHONPATH={path}", python, "-c", OPENAI_AS_HER, url, str(key_file), mine, owners_job
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    seen = json.loads(ran.stdout.strip().splitlines()[-1])
    assert mine in seen["models"] and owners_job not in seen["models"], seen
    assert seen["mine"][0] == mine and seen["mine"][1] in ("stop", "length")
    assert seen[owners_job] == seen[f"{owners_job}@1"] == 404

    owner = openai.OpenAI(base_url=url, api_key=(shared.home / "tinker-api-key").read_text().strip(), max_retries=0)
    assert mine not in {m.id for m in owner.models.list().data}
    with pytest.raises(openai.NotFoundError):
        owner.chat.completions.create(model=mine, messages=[{"role": "user", "content": "3+4="}], max_tokens=2)


@needs_root
def test_an_endpoint_the_user_cannot_reach_is_one_line_naming_what_to_open(dana: Account, her_bin: Path) -> None:
    """A state directory whose mode lets others nowhere (a cluster of an older release, or one
    made by hand): the line names the directory to open; a closed endpoint.json names itself."""
    state = Path("/var/tmp") / f"plexrl-closed-{uuid.uuid4().hex[:8]}"
    state.mkdir(mode=0o700)
    endpoint = state / "endpoint.json"
    endpoint.write_text(json.dumps({"address": "tcp://127.0.0.1:9", "pid": 1, "started_at": 0.0, "mode": "local"}))
    try:
        closed = as_user(dana, her_bin, "plexctl", "--state-dir", str(state), "status")
        assert closed.returncode == 3, closed
        assert one_line(closed) == (
            f"error: cannot read {endpoint}: permission denied "
            f"(ask the cluster's owner to let others pass through {state}: chmod o+x {state})"
        )
        state.chmod(0o711)
        endpoint.chmod(0o600)
        closed = as_user(dana, her_bin, "plexctl", "--state-dir", str(state), "ls")
        assert closed.returncode == 3 and f"chmod o+r {endpoint})" in one_line(closed), closed
    finally:
        shutil.rmtree(state)


def test_the_commands_docs_security_shows_exist() -> None:
    """Every `plexctl` line of docs/security.md's shell blocks names a verb and options the CLI has."""
    commands = shell_commands(SECURITY_MD.read_text())
    assert len(commands) >= 5, commands
    problems = [problem for argv in commands for problem in check_command(argv)]
    assert problems == [], problems
