"""A cluster shared with a second Unix user, tried as that user would attack it.

The owner (root here, as on CI) runs a local cluster and shares it with ``eve``, a real account
the test makes. Eve's job runs her own loop, which tries to read the cluster's keys, its journal,
the owner's key and private files, the owner's job directory and staged files, to reach the
daemon over TCP and to act on the owner's job with the only key it holds; her client also
submits a job whose data is the owner's private file, skipping the CLI's checks. Each attempt
must be refused or find nothing, while her own files stay usable (the control that shows the
loop could have read what it was allowed to).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, Cluster, local_account

from daemon import jail
from plexctl import inputs
from plexctl.common import auth
from plexctl.common import protocol as P
from plexctl.common.client import Client
from plexctl.common.cluster import read_endpoint
from plexctl.common.errors import KeyRefused, RemoteError
from plexctl.common.jobdir import JobDir
from plexctl.common.spec import spec_to_wire
from plexctl.spec_files import load_spec

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="makes a second Unix user (needs root)")

TINY = REPO / "configs" / "tiny-arith.yaml"
CUSTOM_LOOP = REPO / "configs" / "examples" / "custom-loop.yaml"
EVE = "eve"
SECRET = "owner-secret-" + uuid.uuid4().hex
OWNER_TOKENS = {
    "HF_TOKEN": "owner-token-hf",
    "WANDB_API_KEY": "owner-token-wandb",
    "PLEXRL_X": "owner-token-x",
    "LC_IDENTIFICATION": "owner-token-locale",  # a locale variable of the owner's shell, as any other
}  # PLEXRL_DEBUG too (tests/test_jail.py): here it would turn the owner's own CLI errors into tracebacks

EVIL_LOOP = r"""
import json, os, socket

def attempt(what, fn):
    try:
        got = fn()
        return {"what": what, "ok": True, "got": repr(got)[:300]}
    except BaseException as e:
        return {"what": what, "ok": False, "error": type(e).__name__ + ": " + str(e)[:200]}

def run(job):
    targets = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets.json")))
    found = [attempt("read " + name, lambda p=path: open(p).read()) for name, path in targets["files"].items()]
    found.append(attempt("read own data", lambda: open(job.spec.data.path).read()))
    found += [attempt("list " + name, lambda p=path: os.listdir(p)) for name, path in targets["dirs"].items()]
    found.append(attempt("tcp to the daemon", lambda: socket.create_connection(tuple(targets["daemon"]), timeout=3)))
    found.append(attempt("cluster keys in the environment", lambda: os.environ["PLEXRL_CLUSTER_KEYS"]))
    found.append(attempt("uid", lambda: os.getuid()))

    def cancel_with_my_key():
        from plexctl.common import auth
        from plexctl.common.client import Client
        client = Client(job.client.endpoint, timeout=5.0, retries=0, keys=auth.internal_keys_from_env())
        return client.cancel(targets["owner_job"])
    found.append(attempt("cancel the owner's job", cancel_with_my_key))

    def call_for_the_owner_job():
        job.client.job_id = targets["owner_job"]
        return job.client.call("publish", {})
    found.append(attempt("call for the owner's job", call_for_the_owner_job))
    secrets = [name for name, value in os.environ.items() if "owner-token" in value]
    found.append(attempt("the owner's tokens in the environment", lambda: secrets or 1 / 0))
    found.append(attempt("write its keys directory", lambda: open("/mnt/keys/driver.key", "a").write("x")))
    kept = {name: open("/mnt/keys/" + name).read() for name in os.listdir("/mnt/keys")}
    print("KEYS " + json.dumps(kept), flush=True)  # what she keeps of them: her job's log is hers
    if os.path.lexists("/mnt/job/metrics.jsonl"):
        os.unlink("/mnt/job/metrics.jsonl")
    os.symlink("/etc/passwd", "/mnt/job/metrics.jsonl")  # the daemon must not follow it, nor say where it is
    print("FINDINGS " + json.dumps(found), flush=True)
"""

# A loop that, on its first run, swaps the key directory the daemon used to write into (and chown)
# for a link to a directory of root's, then exits so that the daemon starts it again.
KEYDIR_LOOP = r"""
import json, os, sys

def run(job):
    target = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "target.json")))["dir"]
    if not os.path.exists("/mnt/job/first-run-done"):
        open("/mnt/job/first-run-done", "w").close()
        for name in (".keys", "driver-keys", "kept-keys"):
            path = "/mnt/job/" + name
            if os.path.isdir(path) and not os.path.islink(path):
                import shutil
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.unlink(path)
            os.symlink(target, path)
        sys.exit(1)
    print("SECOND RUN", flush=True)
"""

# A loop that tries to take more than its limits allow (set low for its user by the owner).
GREEDY_LOOP = r"""
import json, os, signal, time

def run(job):
    found = {}
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file over the limit: EFBIG, not death
    children = []
    try:
        for _ in range(300):
            pid = os.fork()
            if pid == 0:
                time.sleep(20)
                os._exit(0)
            children.append(pid)
    except OSError as e:
        found["fork refused"] = type(e).__name__
    found["forked"] = len(children)
    for pid in children:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    try:
        block = bytearray(1536 << 20)
        found["allocated"] = len(block)
        del block
    except MemoryError:
        found["allocated"] = 0
    written = 0
    try:
        with open("/tmp/fill", "wb") as f:
            for _ in range(256):
                f.write(b"x" * (1 << 20))
                written += 1 << 20
    except OSError as e:
        found["tmp refused"] = type(e).__name__
    found["tmp written"] = written
    print("GREEDY " + json.dumps(found), flush=True)
    filled = 0
    try:
        for i in range(8):  # each file within the file-size limit, together over the directory's
            with open("/mnt/job/fill-%d" % i, "wb") as f:
                f.write(b"x" * (40 << 20))
                filled += 40 << 20
    except OSError as e:
        print("DISK refused %s after %d bytes" % (type(e).__name__, filled), flush=True)
    time.sleep(60)  # the daemon ends it before this is over
"""


@pytest.fixture(scope="module")
def eve() -> Iterator[tuple[int, int, Path]]:
    with local_account(EVE) as account:
        yield account


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, eve):
    c = Cluster(tmp_path_factory.mktemp("owner-home"), env={"TINKER_TELEMETRY": "0", **OWNER_TOKENS}).up(
        tiny_model, "--workers", "1", "--tinker-port", "0"
    )
    yield c
    c.run("down", timeout=120)


@pytest.fixture(scope="module")
def owner_files():
    """A private file of the owner's outside /tmp: 0600 in a 0700 directory."""
    base = Path("/var/tmp") / f"plexrl-owner-{uuid.uuid4().hex[:8]}"
    base.mkdir(mode=0o700)
    secret = base / "secret.jsonl"
    secret.write_text(json.dumps({"prompt": SECRET, "answer": "1"}) + "\n")
    secret.chmod(0o600)
    yield secret
    shutil.rmtree(base, ignore_errors=True)


def eve_client(cluster: Cluster, eve_home: Path, user: str = EVE) -> Client:
    """Eve's own key, granted by the owner; her client is the library's (no CLI checks)."""
    home = eve_home / ".plexrl"
    public = auth.ensure_user_keys(home, user)
    cluster.run("share", user, "--key", str(public), check=True)
    endpoint = read_endpoint(cluster.state_dir)
    return Client(
        endpoint.address, timeout=10.0, retries=0, keys=auth.user_keys(home, user, endpoint.server_key.encode())
    )


def spec(tiny_model: Path, *overrides: str, base: Path = TINY) -> dict:
    return spec_to_wire(
        load_spec(base, [f"model.path={tiny_model}", "data.eval_path=null", "checkpoint.every=0", *overrides], None)
    )


def own(path: Path, uid: int, gid: int) -> None:
    for p in (path, *path.rglob("*")):
        os.chown(p, uid, gid)


def wait_ended(client: Client, job_id: str, timeout: float = 300) -> str:

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = client.status(job_id).jobs[0].state
        if state in ("succeeded", "failed", "cancelled"):
            return state
        time.sleep(1.0)
    raise AssertionError(f"job {job_id} did not end")


def full_log(client: Client, job_id: str) -> str:
    text, offset = "", 0
    while True:
        rep = client.logs(job_id, "log", offset)
        text += rep.data
        if not rep.data:
            return text
        offset = rep.offset


def attack(cluster: Cluster, eve, owner_files: Path, tiny_model: Path) -> dict[str, dict]:
    """Eve's loop, run as her job beside a running job of the owner's: what it found, by attempt
    (the owner's job is checked untouched and then cancelled)."""
    uid, gid, home = eve
    owner_job = cluster.run(
        "submit",
        str(TINY),
        "--set",
        "algo.steps=400",
        "--set",
        "checkpoint.every=0",
        "--name",
        f"owner-job-{uuid.uuid4().hex[:4]}",
        "-q",
        check=True,
    ).stdout.strip()
    cluster.wait_for(owner_job, lambda j: j["state"] == "running", what="the owner's job runs")
    state = cluster.state_dir
    owner_key = Path(cluster.env["PLEXRL_HOME"]) / "keys"
    code = home / f"evil-{uuid.uuid4().hex[:6]}"
    code.mkdir()
    (code / "evil_loop.py").write_text(EVIL_LOOP)
    (code / "train.jsonl").write_text((REPO / ".plexrl" / "data" / "arith" / "train.jsonl").read_text())
    endpoint = read_endpoint(state)
    host, port = endpoint.address.removeprefix("tcp://").rsplit(":", 1)
    (code / "targets.json").write_text(
        json.dumps(
            {
                "files": {
                    "server secret": str(state / "keys" / "server.key_secret"),
                    "internal secret": str(state / "keys" / "internal.key_secret"),
                    "owner's client secret": str(next(owner_key.glob("*.key_secret"))),
                    "journal": str(state / "journal.db"),
                    "owner's private file": str(owner_files),
                    "owner job's spec": str(state / "jobs" / owner_job / "spec.json"),
                    "her own file outside the job's inputs": str(code / "train.jsonl"),
                },
                "dirs": {
                    "state dir": str(state),
                    "owner job's dir": str(state / "jobs" / owner_job),
                    "owner's home keys": str(owner_key),
                    "homes": "/home",
                    "root's home": "/root",
                },
                "daemon": [host, int(port)],
                "owner_job": owner_job,
            }
        )
    )
    own(code, uid, gid)
    client = eve_client(cluster, home)
    job = inputs.submit(
        client,
        spec(
            tiny_model,
            "algo.loop=evil_loop:run",
            f"algo.path={code}",
            f"data.path={code / 'train.jsonl'}",
            base=CUSTOM_LOOP,
        ),
    ).job_id
    wait_ended(client, job)
    log = full_log(client, job)
    line = next((ln for ln in log.splitlines() if ln.startswith("FINDINGS ")), None)
    assert line is not None, log[-3000:]
    assert cluster.job(owner_job)["state"] == "running"  # untouched
    cluster.run("cancel", owner_job, check=True)
    kept = home / f"kept-keys-{job}-{uuid.uuid4().hex[:6]}"
    kept.mkdir()
    keys_line = next(ln for ln in log.splitlines() if ln.startswith("KEYS "))
    for name, text in json.loads(keys_line.removeprefix("KEYS ")).items():
        (kept / name).write_text(text)
    assert_key_revoked(cluster, job, kept)
    assert_link_not_followed(cluster, client, job)
    return {f["what"]: f for f in json.loads(line.removeprefix("FINDINGS "))}


def assert_key_revoked(cluster: Cluster, job: str, kept: Path) -> None:
    """The key a jailed driver held is let in no more once its job ended (its copy kept by the job)."""
    (kept / f"{auth.DRIVER}.key_secret").chmod(0o600)
    keys = auth.CurveKeys(*auth.load_pair(kept, auth.DRIVER), auth.load_public(kept / f"{auth.SERVER}.key"))
    stale = Client(read_endpoint(cluster.state_dir).address, timeout=3.0, retries=0, keys=keys)
    with pytest.raises(KeyRefused):
        stale.status()
    assert not (auth.keys_dir(cluster.state_dir) / "jobs" / f"{job}.key").exists()
    assert not (cluster.state_dir / "jobs" / job / JobDir.DRIVER_KEYS).exists()


def assert_link_not_followed(cluster: Cluster, client: Client, job: str) -> None:
    """`logs --metrics` on a metrics file the job made a link to /etc/passwd: nothing of that file,
    at most one line that names no host path, and no traceback in the daemon's log."""
    before = (cluster.state_dir / "daemon.log").read_text()
    try:
        got = client.logs(job, "metrics", 0).data
    except RemoteError as refused:
        assert "not a regular file" in str(refused) and str(cluster.state_dir) not in str(refused)
    else:
        assert "root:" not in got, got[:200]
    assert "Traceback" not in (cluster.state_dir / "daemon.log").read_text()[len(before) :]


def reached(found: dict[str, dict]) -> list[str]:
    """What the loop got at beyond its own data and its uid (the interpreter, bound at its own
    path, is all there is of a home directory)."""
    interpreter = Path(os.path.realpath(sys.base_prefix))
    shown = {
        "list root's home": repr([interpreter.relative_to("/root").parts[0]])
        if interpreter.is_relative_to("/root")
        else None
    }
    assert found["read own data"]["ok"], found["read own data"]  # the control: what is hers, she reads
    assert (
        "forbidden" in found["call for the owner's job"]["error"]
        or "not this driver's" in found["call for the owner's job"]["error"]
    ), found["call for the owner's job"]
    return sorted(
        what
        for what, f in found.items()
        if f["ok"] and what not in ("read own data", "uid") and f["got"] != shown.get(what)
    )


def test_a_shared_users_loop_reaches_nothing_of_the_owner_or_the_cluster(cluster, eve, owner_files, tiny_model):
    found = attack(cluster, eve, owner_files, tiny_model)
    ran_as = int(found["uid"]["got"])  # a uid of the job's own: neither the owner's nor even hers
    assert ran_as >= jail.JOB_UID_BASE and ran_as != eve[0]
    assert reached(found) == [], {what: found[what] for what in reached(found)}


@pytest.fixture(scope="module")
def userns_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, eve):
    """The jail a daemon of an ordinary user makes (user namespace, the owner's uid kept), forced
    on a root daemon: its driver then holds uid 0 itself, the hardest case for the empty root."""
    c = Cluster(tmp_path_factory.mktemp("userns-owner"), env={jail.MODE_ENV: "userns", **OWNER_TOKENS})
    c.up(tiny_model, "--workers", "1")
    yield c
    c.run("down", timeout=120)


def test_in_a_user_namespace_the_owners_uid_finds_nothing_of_the_owners(userns_cluster, eve, owner_files, tiny_model):
    found = attack(userns_cluster, eve, owner_files, tiny_model)
    assert found["uid"]["got"] == repr(os.getuid())  # the owner's uid: only the empty root holds it back
    assert reached(found) == [], {what: found[what] for what in reached(found)}


def test_a_forged_submit_cannot_make_the_cluster_read_the_owners_file(cluster, eve, owner_files, tiny_model):
    """The CLI refuses a data.path its user cannot read; a client that skips that check is refused
    by the daemon, which never opens a shared user's paths (their client uploads the files), and
    an upload whose content does not match its sha256 is refused too. Nothing is queued."""
    _, _, home = eve
    client = eve_client(cluster, home)
    before = cluster.run("ls", "-q", check=True).stdout.split()
    with pytest.raises(RemoteError) as refused:
        client.submit(spec(tiny_model, f"data.path={owner_files}"), uuid.uuid4().hex)
    assert refused.value.code == "bad_request" and "data.path" in str(refused.value)
    forged = P.InputFile("data.path", "file", "secret.jsonl", hashlib.sha256(SECRET.encode()).hexdigest(), 64)
    with pytest.raises(RemoteError) as refused:
        client.submit(spec(tiny_model, f"data.path={owner_files}"), uuid.uuid4().hex, inputs=[forged])
    assert refused.value.code == "bad_request" and "not uploaded" in str(refused.value)
    with pytest.raises(RemoteError) as refused:
        client.blob(P.BlobReq(forged.sha256, 6, 0, b"eve's!"))
    assert "does not match" in str(refused.value)
    assert cluster.run("ls", "-q", check=True).stdout.split() == before
    leaked = subprocess.run(
        ["grep", "-rlsF", SECRET, "/tmp", "/var/tmp", "--exclude-dir=" + owner_files.parent.name],
        capture_output=True,
        text=True,
    )
    assert leaked.stdout.strip() == "", f"the secret was copied to {leaked.stdout}"


def test_a_user_without_an_account_runs_under_a_uid_of_the_job_from_uploaded_files(
    cluster, tiny_model, tmp_path: Path
) -> None:
    """A shared user the daemon's node does not know: their client uploads the job's files
    (content-addressed: the second job's upload sends nothing), the job trains under a uid of
    its own, and its data is read from the uploaded copy."""
    user = "zoe-" + uuid.uuid4().hex[:6]
    home = tmp_path / user
    public = auth.ensure_user_keys(home, user)
    cluster.run("share", user, "--key", str(public), check=True)
    endpoint = read_endpoint(cluster.state_dir)
    client = Client(
        endpoint.address, timeout=10.0, retries=0, keys=auth.user_keys(home, user, endpoint.server_key.encode())
    )
    assert client.ping().upload_inputs
    data = tmp_path / "zoe-data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text((REPO / ".plexrl" / "data" / "arith" / "train.jsonl").read_text())
    job_spec = spec(tiny_model, f"data.path={data}", "algo.steps=1", "name=zoe-1")
    files, local = inputs.collect(job_spec)
    assert inputs.upload(client, files, local) == data.stat().st_size
    assert inputs.upload(client, files, local) == 0  # held already: nothing sent again
    job = client.submit(job_spec, uuid.uuid4().hex, inputs=files).job_id
    assert wait_ended(client, job) == "succeeded", full_log(client, job)[-3000:]
    log = full_log(client, job)
    assert str(data) not in log
    staged = cluster.state_dir / "jobs" / job / JobDir.DRIVER_IN / "inputs" / "data.path" / "train.jsonl"
    assert staged.read_bytes() == data.read_bytes()
    for path in (staged, *staged.parents[:3]):  # the daemon's own files, which the job's uid only reads
        assert path.stat().st_uid == 0 and stat.S_IMODE(path.stat().st_mode) & 0o022 == 0, path


def test_the_state_directory_is_the_owners_alone(cluster, eve):
    """Another user may open endpoint.json and tinker.json by name and nothing else of the state directory."""
    state = cluster.state_dir
    assert stat.S_IMODE(state.stat().st_mode) == 0o711
    for entry in state.iterdir():  # nothing others may read or write; the socket's directory they may pass
        if entry.name not in ("endpoint.json", "tinker.json") and not entry.is_symlink():
            assert stat.S_IMODE(entry.stat().st_mode) & 0o066 == 0, entry
    parents = [p for p in state.parents if p != Path("/") and stat.S_IMODE(p.stat().st_mode) & 0o001 == 0]
    modes = {p: stat.S_IMODE(p.stat().st_mode) for p in parents}
    for p in parents:  # as a state directory under a home others may pass through
        p.chmod(modes[p] | 0o001)
    try:
        as_eve = {"user": EVE, "group": eve[1], "capture_output": True, "text": True}
        assert subprocess.run(["cat", str(state / "endpoint.json")], **as_eve).returncode == 0
        for path in ("journal.db", "keys/server.key_secret", "jobs", "daemon.log"):
            assert subprocess.run(["cat" if "." in path else "ls", str(state / path)], **as_eve).returncode != 0, path
        assert subprocess.run(["ls", str(state)], **as_eve).returncode != 0
    finally:
        for p, mode in modes.items():
            p.chmod(mode)


def test_a_staged_reward_copy_is_private_and_still_imports_in_the_sandbox(eve, tmp_path: Path) -> None:
    """A driver's staged copy of a reward directory: another user cannot read it (it was 0644 in
    /tmp), and the sandbox, running as a uid of its own, still imports it."""
    from plexctl.rewards import stage_user_dir
    from plexctl.sandbox import isolation, run_python

    src = tmp_path / "reward"
    src.mkdir()
    (src / "my_private_reward.py").write_text("def score(completion, answer):\n    return 0.25\n")
    staged = stage_user_dir(str(src))
    try:
        as_eve = {"user": EVE, "group": eve[1], "capture_output": True, "text": True}
        assert subprocess.run(["cat", str(staged / "my_private_reward.py")], **as_eve).returncode != 0
        result = run_python("import my_private_reward\nprint(my_private_reward.score('', ''))", paths=(str(staged),))
        assert result.ok and result.stdout.strip() == "0.25", (isolation().mode, result)
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def test_a_shared_users_job_trains_jailed_and_they_get_its_files_through_the_cli(
    cluster, eve, tiny_model, tmp_path: Path
) -> None:
    """The jail takes nothing a job needs: eve's job trains and checkpoints; its adapter and
    checkpoint come out through `plexctl export` byte for byte (never by reading the state
    directory), and nobody but eve and the owner can ask for them."""
    uid, gid, home = eve
    data = home / f"data-{uuid.uuid4().hex[:6]}"
    data.mkdir()
    (data / "train.jsonl").write_text((REPO / ".plexrl" / "data" / "arith" / "train.jsonl").read_text())
    (data / "reward").mkdir()
    (data / "reward" / "eves_reward.py").write_text(  # her own reward: the sandbox runs it inside her jail
        "def score(completion, answer, record):\n    return 1.0 if completion.strip() == answer.strip() else 0.0\n"
    )
    own(data, uid, gid)
    client = eve_client(cluster, home)
    job = inputs.submit(
        client,
        spec(
            tiny_model,
            f"data.path={data / 'train.jsonl'}",
            "algo.steps=2",
            "checkpoint.every=1",
            "name=eve-trains",
            "reward.name=null",
            "reward.fn=eves_reward:score",
            f"reward.path={data / 'reward'}",
        ),
    ).job_id
    assert wait_ended(client, job) == "succeeded", full_log(client, job)[-3000:]
    rows = [json.loads(line) for line in client.logs(job, "metrics").data.splitlines() if '"reward_mean"' in line]
    assert [row["step"] for row in rows] == [1, 2]
    assert rows[-1]["reward_errors"] == 0, rows[-1]  # her reward ran, in the sandbox in her jail

    listing = client.export(job, "checkpoint")
    assert "manifest.json" in {f.path for f in listing.files}
    for what, flag in (("adapter", []), ("checkpoint", ["--checkpoint"])):
        out = cluster.run("export", job, *flag, "--to", str(tmp_path / what), check=True)
        (exported,) = (tmp_path / what).iterdir()
        assert what in out.stdout and exported.name.startswith(f"{job}-{what}-")
        source = client.export(job, what)
        version = source.source.split()[-1]
        original = cluster.state_dir / "jobs" / job / ("ckpt" if what == "checkpoint" else "adapters") / version
        for f in source.files:
            assert (exported / f.path).read_bytes() == (original / f.path).read_bytes(), f.path
    again = cluster.run("export", job, "--to", str(tmp_path / "adapter"))
    assert again.returncode == 2 and "exists" in again.stderr  # nothing overwritten

    other = cluster.run(
        "submit", str(TINY), "--set", "algo.steps=1", "--name", "owner-small", "-q", check=True
    ).stdout.strip()
    with pytest.raises(Exception) as refused:  # the owner's job is not eve's to see
        client.export(other, "adapter")
    assert getattr(refused.value, "code", "") == "not_found"
    cluster.run("cancel", other)


def test_a_shared_users_tinker_client_trains_as_their_external_job_and_reaches_nothing_of_the_owners(
    cluster, eve, tiny_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eve's Tinker key, let in by the owner: her training client is an external job of hers (no
    driver process anywhere); it trains and samples; the owner's runs and saved states are not hers."""
    tinker = pytest.importorskip("tinker")
    from test_tinker_e2e import supervised_data

    from plexctl.tinker import keys as tinker_keys

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    _, _, home = eve
    key = tinker_keys.own_key(home / ".plexrl")
    public = auth.ensure_user_keys(home / ".plexrl", EVE)
    cluster.run("share", EVE, "--key", str(public), "--tinker-key-sha256", tinker_keys.digest(key), check=True)
    url = json.loads((cluster.state_dir / "tinker.json").read_text())["url"]
    owner = tinker.ServiceClient(base_url=url, api_key=(cluster.home / "tinker-api-key").read_text().strip())
    owners_run = owner.create_lora_training_client(base_model=tiny_model.name, rank=8).result()
    owners_state = owners_run.save_state("private").result().path

    service = tinker.ServiceClient(base_url=url, api_key=key)
    training = service.create_lora_training_client(base_model=tiny_model.name, rank=8).result()
    job = next(j for j in cluster.status()["jobs"] if j["name"].startswith("tinker-") and j["user"] == EVE)
    data = supervised_data(training.get_tokenizer(), 8)
    first = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    for _ in range(3):
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(tinker.AdamParams(learning_rate=3e-3)).result()
    assert training.forward(data, "cross_entropy").result().metrics["loss:sum"] < first
    sampler = training.save_weights_and_get_sampling_client().result()
    out = sampler.sample(data[0].model_input, num_samples=2, sampling_params=tinker.SamplingParams(max_tokens=3))
    assert len(out.result().sequences) == 2
    # an external job: no driver runs for it, under any uid; its calls come from the front end
    assert job["user"] == EVE and not [p for p in Path("/proc").glob("[0-9]*") if job["job_id"] in _cmdline(p)]

    with pytest.raises(Exception, match="another user|not yours|of yours|403"):
        service.create_training_client_from_state(owners_state).result()
    with pytest.raises(Exception, match="another user|of yours|403"):
        service.create_sampling_client(model_path=owners_state.replace("/weights/", "/sampler_weights/")).result()
    service.close("success").result()
    owner.close("success").result()


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def submit_loop(
    cluster: Cluster, eve, tiny_model: Path, loop: str, files: dict[str, str], *overrides: str, client=None
) -> str:
    """Eve's job (or ``client``'s) running ``loop`` (module ``hostile``), its directory holding
    ``files``, named after that directory."""
    uid, gid, home = eve
    code = home / f"loop-{uuid.uuid4().hex[:6]}"
    code.mkdir()
    (code / "hostile.py").write_text(loop)
    (code / "train.jsonl").write_text((REPO / ".plexrl" / "data" / "arith" / "train.jsonl").read_text())
    for name, text in files.items():
        (code / name).write_text(text)
    own(code, uid, gid)
    job_spec = spec(
        tiny_model,
        "algo.loop=hostile:run",
        f"algo.path={code}",
        f"data.path={code / 'train.jsonl'}",
        f"name={code.name}",
        *overrides,
        base=CUSTOM_LOOP,
    )
    return inputs.submit(client or eve_client(cluster, home), job_spec).job_id


@pytest.mark.parametrize("jail_mode", ["root", "userns"])
def test_a_job_that_links_its_key_directory_to_roots_files_gets_nothing_of_them(
    request, jail_mode: str, eve, owner_files: Path, tiny_model: Path
) -> None:
    """Between a job's two driver starts, its writable directory held links (where the daemon
    once wrote and chowned the driver's keys) to a directory of root's: the daemon follows none
    of them; root's files stay root's, unchanged, and the job still runs with a key of its own."""
    cluster = request.getfixturevalue("cluster" if jail_mode == "root" else "userns_cluster")
    roots = owner_files.parent / f"roots-{jail_mode}"
    roots.mkdir(mode=0o700)
    (roots / "precious").write_text("root's own")
    (roots / "precious").chmod(0o600)
    before = {p.name: (p.stat().st_uid, stat.S_IMODE(p.stat().st_mode), p.read_bytes()) for p in roots.iterdir()}
    target = {"target.json": json.dumps({"dir": str(roots)})}
    job = submit_loop(cluster, eve, tiny_model, KEYDIR_LOOP, target, "checkpoint.max_restarts=1")
    client = eve_client(cluster, eve[2])
    wait_ended(client, job)
    assert "SECOND RUN" in full_log(client, job), full_log(client, job)[-3000:]  # started again, links and all
    after = {p.name: (p.stat().st_uid, stat.S_IMODE(p.stat().st_mode), p.read_bytes()) for p in roots.iterdir()}
    assert after == before and stat.S_IMODE(roots.stat().st_mode) == 0o700 and roots.stat().st_uid == 0


def test_a_forged_input_field_or_spec_is_refused_and_the_daemon_stays_up(cluster, eve, tiny_model) -> None:
    """Fields of uploaded inputs name spec paths only (never a path of the host), and the spec's
    rules across fields hold for a client that skips the CLI; the daemon answers and goes on."""
    _, _, home = eve
    client = eve_client(cluster, home)
    data = (REPO / ".plexrl" / "data" / "arith" / "train.jsonl").read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    for offset in range(0, len(data), 1 << 20):
        client.blob(P.BlobReq(sha, len(data), offset, data[offset : offset + (1 << 20)]))
    job_spec = spec(tiny_model)
    before = cluster.run("ls", "-q", check=True).stdout.split()
    for field in ("/tmp/plexrl-forged", "../../../../tmp/plexrl-forged", "data", "data.path.x", "algo.loss_fn"):
        forged = [P.InputFile("data.path", "file", "train.jsonl", sha, len(data))]
        forged.append(P.InputFile(field, "file", "train.jsonl", sha, len(data)))
        with pytest.raises(RemoteError) as refused:
            client.submit(job_spec, uuid.uuid4().hex, inputs=forged)
        assert refused.value.code == "bad_request" and "not a spec path" in str(refused.value), field
    assert not Path("/tmp/plexrl-forged").exists()
    files = [P.InputFile("data.path", "file", "train.jsonl", sha, len(data))]
    for rule, broken in (
        ("kind", {**job_spec, "kind": "external"}),
        ("reward", {**job_spec, "reward": {**job_spec["reward"], "fn": "mod:score"}}),
        ("algo.loop", {**job_spec, "algo": {**job_spec["algo"], "name": "dapo", "loop": "mod:run"}}),
    ):
        with pytest.raises(RemoteError) as refused:
            client.submit(broken, uuid.uuid4().hex, inputs=files)
        assert refused.value.code == "bad_request" and rule in str(refused.value), str(refused.value)
    context = json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"]
    too_long = {**job_spec, "sampling": {**job_spec["sampling"], "max_tokens": context - 2}}  # with its prompts
    with pytest.raises(RemoteError) as refused:
        client.submit(too_long, uuid.uuid4().hex, inputs=files)
    assert "sampling.max_tokens" in str(refused.value) and "longest prompt" in str(refused.value), refused.value
    assert str(cluster.state_dir) not in str(refused.value)  # her file's name, not where the daemon keeps it
    assert cluster.run("ls", "-q", check=True).stdout.split() == before  # nothing queued
    assert client.ping().version


def test_a_name_resolves_among_the_callers_own_jobs_through_the_cli(cluster, eve, tiny_model) -> None:
    """A shared user's job named like the owner's does not capture the owner's status, cancel or
    wait: those act on the owner's own job; eve's is `eve/NAME` or its id."""
    name = f"fault-{uuid.uuid4().hex[:4]}"
    mine = cluster.run("submit", str(TINY), "--set", "algo.steps=400", "--name", name, "-q", check=True).stdout.strip()
    client = eve_client(cluster, eve[2])
    files, local = inputs.collect(spec(tiny_model, f"name={name}", "algo.steps=400"))
    inputs.upload(client, files, local)
    hers = client.submit(spec(tiny_model, f"name={name}", "algo.steps=400"), uuid.uuid4().hex, inputs=files).job_id
    assert cluster.job(name)["job_id"] == mine
    assert cluster.job(f"{EVE}/{name}")["job_id"] == hers
    assert cluster.run("cancel", name, check=True).returncode == 0
    wait = cluster.run("wait", name, "--timeout", "120")
    assert wait.returncode == 5, wait.stdout + wait.stderr  # the owner's job, cancelled
    assert cluster.job(hers)["state"] in ("queued", "running")  # eve's untouched
    client.cancel(hers)


def test_a_greedy_job_is_held_to_its_users_limits_and_ends_alone(cluster, eve, tiny_model) -> None:
    """Limits the owner set for eve (`plexctl share --limit`): her job's forks, memory and /tmp are
    refused past them, and writing past its directory's limit ends it with one line; the owner's
    job beside it and the daemon go on."""
    public = auth.ensure_user_keys(eve[2] / ".plexrl", EVE)
    limits = ["memory=1G", "processes=64", "tmp=64M", "job-dir=128M"]
    shared = cluster.run("share", EVE, "--key", str(public), *[a for x in limits for a in ("--limit", x)], check=True)
    assert "processes 64" in shared.stdout
    owners = cluster.run("submit", str(TINY), "--set", "algo.steps=400", "-q", "--name", "beside", check=True)
    job = submit_loop(cluster, eve, tiny_model, GREEDY_LOOP, {})
    client = eve_client(cluster, eve[2])
    try:
        assert wait_ended(client, job) == "failed"
        info = client.status(job).jobs[0]
        assert "its limit of 128.0 MiB" in info.error, info.error
        log = full_log(client, job)
        refused = next((ln for ln in log.splitlines() if ln.startswith("DISK refused OSError")), None)
        assert refused is not None and int(refused.split()[-2]) <= 128 << 20, log[-2000:]  # at write time
        job_dir = cluster.state_dir / "jobs" / job
        assert not (job_dir / JobDir.DRIVER_IMAGE).exists() and not any((job_dir / JobDir.DRIVER_OUT).iterdir())
        line = next(ln for ln in log.splitlines() if ln.startswith("GREEDY "))
        found = json.loads(line.removeprefix("GREEDY "))
        assert found["forked"] < 64 and "fork refused" in found, found
        assert found["allocated"] == 0, found
        assert found["tmp written"] <= 64 << 20 and "tmp refused" in found, found
        assert cluster.job(owners.stdout.strip())["state"] == "running"
    finally:
        cluster.run("share", EVE, "--key", str(public), "--limit", "memory=8G", "--limit", "processes=256",
                    "--limit", "tmp=1G", "--limit", "job-dir=2G")  # fmt: skip
        cluster.run("cancel", owners.stdout.strip())


FUZZ_VALUES = ["../../../etc/passwd", "/etc/shadow", "eve/../root", "x" * 100_000, "\x00", "é/ü", -1, 2**62, None,
               [["nested"] * 3] * 3, {"a": {"b": {"c": {}}}}, 1.5, True, b"\xff\xfe"]  # fmt: skip


def test_every_client_request_with_hostile_fields_gets_an_error_and_the_daemon_stays_up(cluster, eve) -> None:
    """Each request a shared user may send, with each field set to hostile paths, names, sizes,
    types and nestings: an error reply each time (nothing of another user's), and the daemon up."""
    client = eve_client(cluster, eve[2])
    requests = {
        P.Op.STATUS: {"job_id": "x", "timeline": False},
        P.Op.CANCEL: {"job_id": "x"},
        P.Op.LOGS: {"job_id": "x", "kind": "log", "offset": 0},
        P.Op.EXPORT: {"job_id": "x", "what": "adapter", "path": "", "offset": 0},
        P.Op.BLOB: {"sha256": "0" * 64, "size": 1, "offset": 0, "data": b"x"},
        P.Op.SUBMIT: {"submit_id": "s", "spec": {"name": "x"}, "user": EVE, "inputs": []},
        P.Op.DOWN: {},
    }
    refused = 0
    for op, fields in requests.items():
        for field in [*fields, "unknown_field"]:
            for value in FUZZ_VALUES:
                try:
                    reply = client.request(op, {**fields, field: value}, timeout=10.0)
                except RemoteError as error:  # throttled: past 20 bad messages in 10 s, unheard a while
                    assert error.code in ("bad_request", "not_found", "forbidden", "refused", "throttled"), (
                        op,
                        field,
                        value,
                    )
                    refused += 1
                else:  # a request that means something (her own jobs' status, how much of her upload is
                    # held, which a chunk at another offset asks): nothing of anyone else's
                    if op == P.Op.BLOB:
                        assert set(reply) == {"have"} and reply["have"] == 0, (field, value, reply)
                    else:
                        assert op == P.Op.STATUS and all(j["user"] == EVE for j in reply["jobs"]), (op, field, value)
    assert refused > 300 and cluster.run("status", check=True).returncode == 0  # the owner is not held
    deadline = time.monotonic() + 30
    while True:  # her throttle ends by itself
        try:
            assert client.ping().version
            break
        except RemoteError as error:
            assert error.code == "throttled" and time.monotonic() < deadline, error


SPINNING_LOOP = r"""
def run(job):
    while True:  # CPU, and nothing else
        pass
"""


def test_a_job_past_its_cpu_time_limit_fails_with_one_line(cluster, eve, tiny_model) -> None:
    """`plexctl share --limit cpu=SECONDS`: a driver that spins past its CPU seconds is ended by
    the kernel (RLIMIT_CPU), and its job fails with that reason, not restarted as a crash."""
    public = auth.ensure_user_keys(eve[2] / ".plexrl", EVE)
    cluster.run("share", EVE, "--key", str(public), "--limit", "cpu=2", check=True)
    try:
        job = submit_loop(cluster, eve, tiny_model, SPINNING_LOOP, {}, "checkpoint.max_restarts=2")
        client = eve_client(cluster, eve[2])
        assert wait_ended(client, job, timeout=120) == "failed"
        info = client.status(job).jobs[0]
        assert "CPU-time limit" in info.error, info.error
        assert info.restarts == 0, info  # a limit, not a crash to restart from
    finally:
        cluster.run("share", EVE, "--key", str(public), "--limit", "cpu=0")
