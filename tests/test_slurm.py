"""The whole system on a real Slurm cluster: two virtual nodes on this host (slurmctld, two
slurmd, munge; tests/slurm/start-cluster.sh), each with two fake GPUs (a GRES whose device
files alias /dev/null), real sbatch/srun through submitit.

One allocation serves the module, asked with ``--gpus-per-node 2``: each node runs a worker
per GPU (rollout engines on n1, trainers on n2), each seeing only its own GPU and keeping its
own scratch directory; two jobs finish on workers of both nodes; a job survives
the allocation's preemption signal (drain, checkpoint, requeue, resume) without losing or
repeating a step, learning exactly what the uninterrupted job learned; ``down`` leaves no
process and no Slurm job behind.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from conftest import Cluster

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny-arith.yaml")
STEPS = 24
WORKERS = {"n1-g0": "0", "n1-g1": "1", "n2-g0": "0", "n2-g1": "1"}  # worker id: its CUDA_VISIBLE_DEVICES
ENGINES = {"n1-g0/rollout", "n1-g1/rollout", "n2-g0/trainer", "n2-g1/trainer"}
JOB_ARGS = ("--set", f"algo.steps={STEPS}", "--set", "checkpoint.every=1000", "--set", "algo.eval_every=0")


def slurm(*args: str) -> str:
    return subprocess.run(list(args), capture_output=True, text=True, check=True).stdout


def squeue_state(job_id: str) -> str:
    """The Slurm job's state, "" once it has left the queue."""
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


@pytest.fixture(scope="module")
def slurm_cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root (it installs and starts slurmctld/slurmd)")
    start = subprocess.run(
        ["bash", str(REPO / "tests" / "slurm" / "start-cluster.sh")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PLEXRL_SLURM_GPUS": "2"},
    )  # as WORKERS
    assert start.returncode == 0, start.stdout + start.stderr
    c = Cluster(tmp_path_factory.mktemp("plexrl-slurm-home"), env={"TINKER_TELEMETRY": "0"})
    c.state_dir = c.home / "clusters" / "ci"
    with socket.socket() as probe:  # a fixed Tinker port: a client's base_url outlives a requeue
        probe.bind(("", 0))
        c.tinker_port = probe.getsockname()[1]
    # one CPU per node's task (of the test nodes' two): a joining allocation needs the other
    up = c.run(
        "up",
        "--slurm",
        "--name",
        "ci",
        "--nodes",
        "2",
        "--engines",
        "rollout",
        "--engines",
        "trainer",
        "--gpus-per-node",
        "2",
        "--cpus-per-task",
        "1",
        "--time",
        "60",
        "--signal-grace",
        "60",
        "--model",
        str(tiny_model),
        "--tinker-port",
        str(c.tinker_port),
        timeout=900,
    )
    try:
        assert up.returncode == 0, f"plexctl up --slurm failed ({up.returncode}): {up.stdout}{up.stderr}\n{logs(c)}"
        c.slurm_job = json.loads((c.state_dir / "slurm.json").read_text())["allocations"][-1]["job_id"]
        deadline = time.monotonic() + 600  # `up` may count a worker a node: wait for all four engines
        while not (
            (engines := c.status()["engines"])
            and {e["engine_id"] for e in engines} == ENGINES
            and all(e["ready"] for e in engines)
        ):
            assert time.monotonic() < deadline, f"engines {engines}\n{logs(c)}"
            time.sleep(1.0)
    except BaseException:
        c.run("down", timeout=180)  # leave no allocation behind
        raise
    yield c
    c.run("down", timeout=180)
    if "(already running)" not in start.stdout:  # started here: leave no Slurm daemon behind
        subprocess.run(["bash", str(REPO / "tests" / "slurm" / "stop-cluster.sh")], capture_output=True, timeout=120)


def up_ci(c: Cluster, model: Path, *options: str) -> subprocess.CompletedProcess:
    """`plexctl up --slurm --name ci` with ``options``, for 30 minutes, on ``model``."""
    return c.run("up", "--slurm", "--name", "ci", *options, "--time", "30", "--model", str(model), timeout=900)


def logs(c: Cluster) -> str:
    return "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted(c.state_dir.rglob("*.log")))


def started_workers(c: Cluster) -> dict[str, dict[str, str]]:
    """What the node tasks say they started (the latest start of each worker): devices, scratch, pid."""
    found: dict[str, dict[str, str]] = {}
    line = re.compile(r"worker (\S+) \((\S+)\) devices (\S+) scratch (\S+) pid (\d+)")
    for path in sorted((c.state_dir / "slurm").rglob("*")):  # submitit's %j_%t_log.err, sbatch's %j.out
        if path.is_file() and path.suffix in (".err", ".out"):
            for m in line.finditer(path.read_text(errors="replace")):
                found[m[1]] = {"engines": m[2], "devices": m[3], "scratch": m[4], "pid": m[5]}
    return found


def process_env(pid: str) -> dict[str, str]:
    """A live process's environment (the virtual nodes are this host)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def process_args(pid: str) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")


def arg(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def metrics(c: Cluster, job: str) -> list[dict]:
    path = c.state_dir / "jobs" / job / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if "reward_mean" in r]


def events(c: Cluster, job: str) -> list[tuple[str, str]]:
    with sqlite3.connect(c.state_dir / "journal.db") as db:
        return db.execute("select kind, detail from events where job_id = ? order by id", (job,)).fetchall()


@pytest.fixture(scope="module")
def reference_job(slurm_cluster) -> str:
    """A job run without interruption, beside another one, on the allocation."""
    c = slurm_cluster
    a = c.run("submit", TINY, "--name", "ref", "-q", *JOB_ARGS, check=True).stdout.strip()
    b = c.run("submit", TINY, "--name", "other", "-q", *JOB_ARGS, "--set", "seed=7", check=True).stdout.strip()
    for job in (a, b):
        assert c.run("wait", job, "--timeout", "600").returncode == 0, c.run("logs", job).stdout[-2000:]
    c.other_job = b
    return a


def test_two_jobs_finish_on_workers_of_both_nodes(slurm_cluster, reference_job):
    c = slurm_cluster
    status = c.status()
    assert {e["engine_id"] for e in status["engines"]} == ENGINES
    for job in (reference_job, c.other_job):
        info = c.job(job)
        assert info["state"] == "succeeded" and info["step"] == STEPS
        served = set(info["engine"].split(","))
        assert served <= ENGINES and {e.split("/")[1] for e in served} == {"rollout", "trainer"}  # both nodes
    workers = {p.name for p in (c.state_dir / "workers").glob("*.log")}
    assert workers == {f"{w}.log" for w in WORKERS}
    assert "n[1-2]" in slurm("squeue", "-h", "-j", c.slurm_job, "-o", "%N")


def test_each_worker_sees_only_its_own_gpu_and_keeps_its_own_scratch(slurm_cluster):
    c = slurm_cluster
    started = started_workers(c)
    assert {w: s["devices"] for w, s in started.items()} == WORKERS
    assert {w: s["engines"] for w, s in started.items()} == dict(e.split("/") for e in ENGINES)
    for worker, said in started.items():  # what the worker process itself got
        env, argv = process_env(said["pid"]), process_args(said["pid"])
        assert env["CUDA_VISIBLE_DEVICES"] == WORKERS[worker], worker
        assert arg(argv, "--worker-id") == worker and arg(argv, "--scratch") == said["scratch"]
        node = worker.split("-")[0]
        assert Path(said["scratch"]).parent.name == f"plexrl-{c.slurm_job}-{node}"  # the node's, one each
        assert Path(said["scratch"]).name == worker
    reported = {e["worker_id"]: e.get("devices") for e in c.status()["engines"]}
    assert all(not d or d == [WORKERS[w]] for w, d in reported.items()), reported  # where the worker reports them


def test_preemption_drains_requeues_and_resumes_without_losing_or_repeating_a_step(
    slurm_cluster, reference_job, monkeypatch: pytest.MonkeyPatch
):
    c = slurm_cluster
    # a Tinker client, with a saved state: it goes on from that state once the allocation is back
    tinker = pytest.importorskip("tinker")
    from test_tinker_e2e import supervised_data

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    url = json.loads((c.state_dir / "tinker.json").read_text())["url"]
    service = tinker.ServiceClient(base_url=url, api_key=(c.home / "tinker-api-key").read_text().strip())
    training = service.create_lora_training_client(base_model="tiny-arith", rank=8, seed=2).result()
    data = supervised_data(training.get_tokenizer(), 8)
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(tinker.AdamParams(learning_rate=3e-3)).result()
    saved = training.save_state("before-preemption").result().path
    at_save = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    job = c.run("submit", TINY, "--name", "preempted", "-q", *JOB_ARGS, check=True).stdout.strip()
    c.wait_for(job, lambda j: j["step"] >= 8, timeout=300, what="8 steps")
    slurm("scancel", "--signal=USR1", c.slurm_job)  # what Slurm sends --signal-grace s before the end

    deadline = time.monotonic() + 300  # the daemon drains, the allocation is requeued and comes back
    said = set()
    while "recovered" not in [k for k, _ in events(c, job)]:
        assert time.monotonic() < deadline, events(c, job)
        shown = c.run("status")
        said.add((shown.stdout.strip().splitlines() or [f"(exit {shown.returncode}) {shown.stderr.strip()}"])[0])
        time.sleep(0.5)
    # while requeued, status says what Slurm says (requeued jobs wait for their BeginTime)
    assert any(line.startswith(f"cluster ci: pending in Slurm as job {c.slurm_job} (") for line in said), said
    assert c.run("wait", job, "--timeout", "600").returncode == 0, c.run("logs", job).stdout[-2000:]

    kinds = [k for k, _ in events(c, job)]
    drained = [m for k, m in events(c, job) if k == "interrupted"]
    assert kinds.index("draining") < kinds.index("interrupted") < kinds.index("recovered")
    assert len(drained) == 1 and "checkpointed at a step boundary" in drained[0]
    info = c.job(job)
    assert info["state"] == "succeeded" and info["restarts"] == 1
    assert "Restarts=1" in slurm("scontrol", "show", "job", c.slurm_job)

    # the Tinker client's next call found the front end of the new allocation: the requeue lost the
    # trainer's state, so that call fails, naming the saved state the run went back to; it goes on there
    with pytest.raises(
        tinker.RequestFailedError, match=f"went back to its last saved state {re.escape(saved)}, step 1"
    ):
        training.forward(data, "cross_entropy").result()
    assert training.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(at_save, rel=1e-6)
    assert saved in (c.state_dir / "tinker.log").read_text()  # what the requeue lost is said
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(tinker.AdamParams(learning_rate=3e-3)).result()
    service.close("success").result()

    rows = metrics(c, job)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # none lost, none applied twice
    ref = metrics(c, reference_job)  # the same spec and seed, never interrupted
    for key in ("reward_mean", "train/loss", "train/grad_norm"):
        assert [r[key] for r in rows] == [r[key] for r in ref], key


def test_a_killed_daemon_is_restarted_and_its_jobs_go_on(slurm_cluster):
    import signal

    c = slurm_cluster
    job = c.run(
        "submit", TINY, "--name", "daemon-killed", "-q", *JOB_ARGS, "--set", "checkpoint.every=4", check=True
    ).stdout.strip()
    c.wait_for(job, lambda j: j["step"] >= 6, timeout=300, what="6 steps")
    os.kill(json.loads((c.state_dir / "endpoint.json").read_text())["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 180  # the first node starts it again; the driver and workers reconnect
    while "reattached" not in [k for k, _ in events(c, job)]:
        assert time.monotonic() < deadline, (c.state_dir / "daemon.log").read_text()[-3000:]
        time.sleep(1.0)
    assert c.run("wait", job, "--timeout", "600").returncode == 0, c.run("logs", job).stdout[-2000:]
    assert c.job(job)["restarts"] == 0  # it went on where it was: no restart from its checkpoint
    assert "resumed from checkpoint" not in c.run("logs", job, check=True).stdout
    assert [r["step"] for r in metrics(c, job)] == list(range(1, STEPS + 1))  # none lost, none twice
    assert {e["engine_id"] for e in c.status()["engines"]} == ENGINES
    assert squeue_state(c.slurm_job) == "RUNNING"  # same allocation


def test_a_joining_allocation_adds_workers_that_leave_cleanly(slurm_cluster, tiny_model):
    c = slurm_cluster
    up = c.run(
        "up",
        "--slurm",
        "--join",
        "ci",
        "--nodes",
        "1",
        "--engines",
        "trainer",
        "--time",
        "30",
        "--model",
        str(tiny_model),
        timeout=600,
    )
    assert up.returncode == 0, up.stdout + up.stderr
    join_id = json.loads((c.state_dir / "slurm.json").read_text())["allocations"][-1]["job_id"]
    joined = {e["engine_id"] for e in c.status()["engines"]} - ENGINES
    assert len(joined) == 1 and re.fullmatch(rf"n[12]-{join_id}/trainer", joined.pop())  # no GPUs: one worker
    job = c.run("submit", TINY, "--name", "beside-join", "-q", *JOB_ARGS, check=True).stdout.strip()
    assert c.run("wait", job, "--timeout", "600").returncode == 0
    slurm("scancel", join_id)  # that allocation ends: its worker tells the daemon it leaves
    deadline = time.monotonic() + 60
    while {e["engine_id"] for e in c.status()["engines"]} != ENGINES:
        assert time.monotonic() < deadline, c.status()["engines"]
        time.sleep(0.5)
    assert "left the cluster" in (c.state_dir / "daemon.log").read_text()
    assert squeue_state(c.slurm_job) == "RUNNING"  # the first allocation goes on


def test_down_drains_and_leaves_no_process_or_slurm_job(slurm_cluster):
    c = slurm_cluster
    down = c.run("down", timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert squeue_state(c.slurm_job) in ("", "COMPLETED", "COMPLETING")
    left = subprocess.run(["pgrep", "-f", str(c.state_dir)], capture_output=True, text=True).stdout.split()
    assert left == [], subprocess.run(["ps", "-fp", ",".join(left)], capture_output=True, text=True).stdout
    assert c.run("status").returncode == 3  # the cluster is down: unreachable


def test_scancel_ends_the_allocation_without_requeueing_it(slurm_cluster, tiny_model):
    c = slurm_cluster
    up = c.run(
        "up",
        "--slurm",
        "--name",
        "ci",
        "--nodes",
        "2",
        "--engines",
        "rollout",
        "--engines",
        "trainer",
        "--time",
        "60",
        "--submit-with",
        "sbatch",
        "--model",
        str(tiny_model),
        "--tinker-port",
        str(c.tinker_port),
        timeout=900,
    )
    assert up.returncode == 0, up.stdout + up.stderr  # the plain sbatch path this time
    assert (c.state_dir / "slurm" / "plexrl.sbatch").read_text().startswith("#!/bin/bash")
    job_id = json.loads((c.state_dir / "slurm.json").read_text())["allocations"][-1]["job_id"]
    assert job_id != c.slurm_job
    slurm("scancel", job_id)  # SIGTERM: drain and end; only the allocation's own --signal requeues
    deadline = time.monotonic() + 120
    while (state := squeue_state(job_id)) not in ("", "COMPLETED"):
        assert state not in ("PENDING", "REQUEUED"), f"requeued after scancel ({state})"
        assert time.monotonic() < deadline, state
        time.sleep(1.0)


def test_an_elastic_allocation_grows_while_jobs_wait_and_gives_the_node_back_when_idle(
    slurm_cluster, reference_job, tiny_model
):
    """`up --slurm --nodes 1 --max-nodes 2`, each job alone on its engines (isolated): a long job
    holds the one engine pair, so the next two wait and the daemon asks Slurm for a joining
    allocation of one node (squeue shows it), whose engines take them one after the other; once
    no job is left there it is given back (squeue no longer shows it, status says so) while the
    long job runs on. The two learn what the same jobs learned on the fixed allocation, step by
    step."""
    c = slurm_cluster
    c.run("down", timeout=180)  # the module's allocation, if still up
    up = up_ci(
        c,
        tiny_model,
        *("--nodes", "1", "--max-nodes", "2", "--grow-after", "2", "--shrink-after", "5", "--policy", "isolated"),
        *("--engines", "rollout,trainer", "--cpus-per-task", "1"),
    )
    try:
        assert up.returncode == 0, up.stdout + up.stderr + logs(c)
        long_args = ("--set", "algo.steps=5000", "--set", "checkpoint.every=10000", "--set", "algo.eval_every=0")
        long = c.run("submit", TINY, "--name", "elastic-long", "-q", *long_args, check=True).stdout.strip()
        c.wait_for(long, lambda j: j["step"] >= 1, timeout=300, what="the long job's first step")
        a = c.run("submit", TINY, "--name", "elastic-a", "-q", *JOB_ARGS, check=True).stdout.strip()
        b = c.run("submit", TINY, "--name", "elastic-b", "-q", *JOB_ARGS, "--set", "seed=7", check=True).stdout.strip()
        join_id, seen_in_squeue, joined_tasks = "", False, 0
        deadline = time.monotonic() + 900
        while True:
            status = c.status()
            states = {j["job_id"]: j["state"] for j in status["jobs"]}
            joins = [r for r in status.get("allocations", []) if r["role"] == "joined"]
            if joins:
                join_id = join_id or joins[0]["job_id"]
                seen_in_squeue |= squeue_state(join_id) in ("PENDING", "CONFIGURING", "RUNNING")
            pattern = re.compile(rf"n[12]-{join_id}/")
            joined_tasks = max(
                joined_tasks,
                sum(e["tasks_done"] for e in status["engines"] if join_id and pattern.match(e["engine_id"])),
            )
            if all(states.get(j) in ("succeeded", "failed", "cancelled") for j in (a, b)):
                break
            assert time.monotonic() < deadline, f"{status}\n{logs(c)}"
            time.sleep(1.0)
        assert states[a] == states[b] == "succeeded", c.run("logs", b).stdout[-2000:] + logs(c)
        assert join_id and seen_in_squeue, f"no joining allocation was asked for\n{logs(c)}"
        assert joined_tasks > 0  # the joined node's engines ran the job that waited

        deadline = time.monotonic() + 180  # no job is left on it: given back after 5 s idle
        while squeue_state(join_id) not in ("", "COMPLETED"):
            assert time.monotonic() < deadline, f"{squeue_state(join_id)}\n{logs(c)}"
            time.sleep(1.0)
        while not [r for r in c.status().get("allocations", []) if r["state"] == "released"]:
            assert time.monotonic() < deadline, c.status().get("allocations")
            time.sleep(1.0)
        [row] = [r for r in c.status()["allocations"] if r["job_id"] == join_id]
        assert row["state"] == "released" and row["note"].startswith("given back: its engines held no job for")
        assert f"Slurm job {join_id}: joined, 1 node, released" in c.run("status", check=True).stdout
        base = [r for r in c.status()["allocations"] if r["role"] == "base"]
        assert len(base) == 1 and squeue_state(str(base[0]["job_id"])) == "RUNNING"  # never below --nodes
        assert c.job(long)["state"] == "running"  # the base allocation's job went on throughout
        c.run("cancel", long, check=True)

        for job, ref in ((a, reference_job), (b, c.other_job)):  # the same specs on the fixed allocation
            rows, want = metrics(c, job), metrics(c, ref)
            assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
            for key in ("reward_mean", "train/loss", "train/grad_norm"):
                assert [r[key] for r in rows] == [r[key] for r in want], (job, key)
    finally:
        down = c.run("down", timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    assert squeue_state(join_id) in ("", "COMPLETED")


def test_a_trainer_engine_spans_both_nodes_one_rank_on_each(slurm_cluster, tiny_model):
    """`up --slurm --nodes 2 --gpus-per-node 2 --trainer-width 2`: a rollout and a trainer GPU a
    node, so one trainer engine of two ranks: rank 0 in n1's trainer worker, rank 1 started on n2
    (``worker.ranks``), which finds the group through the rendezvous file rank 0 writes in the
    state directory; the tiny LoRA job and the tiny full fine-tuning job succeed on it; `down`
    ends it all."""
    c = slurm_cluster
    c.run("down", timeout=180)  # the module's allocation, if this test runs alone
    up = up_ci(
        c,
        tiny_model,
        *("--nodes", "2", "--engines", "rollout,trainer", "--gpus-per-node", "2", "--trainer-width", "2"),
        *("--cpus-per-task", "2"),
    )
    try:
        assert up.returncode == 0, up.stdout + up.stderr + logs(c)
        deadline = time.monotonic() + 600
        while not ((engines := c.status()["engines"]) and len(engines) == 3 and all(e["ready"] for e in engines)):
            assert time.monotonic() < deadline, f"engines {engines}\n{logs(c)}"
            time.sleep(1.0)
        [trainer] = [e for e in engines if e["kind"] == "trainer"]
        assert trainer["ranks"] == 2 and trainer["worker_id"] == "n1-g1", trainer
        assert {e["engine_id"] for e in engines if e["kind"] == "rollout"} == {"n1-g0/rollout", "n2-g0/rollout"}
        said = re.compile(r"trainer ranks 1 of engine 0 \(rank 0 on another node\) devices 1 on (\S+) pid (\d+)")
        found = [
            m
            for path in (c.state_dir / "slurm").rglob("*")
            if path.is_file()
            for m in said.finditer(path.read_text(errors="replace"))
        ]
        assert [m[1] for m in found][-1:] == ["n2"], logs(c)
        assert process_env(found[-1][2])["SLURMD_NODENAME"] == "n2"  # rank 1's host runs on n2
        lora = c.run("submit", TINY, "--name", "wide-lora", "-q", "--set", "algo.steps=3", check=True).stdout.strip()
        full = c.run(
            "submit", str(REPO / "configs" / "tiny-arith-full.yaml"), "-q", "--set", "algo.steps=3", check=True
        ).stdout.strip()
        for job in (lora, full):
            assert c.run("wait", job, "--timeout", "600").returncode == 0, c.run("logs", job).stdout[-2000:] + logs(c)
            assert c.job(job)["state"] == "succeeded"
    finally:
        down = c.run("down", timeout=180)
    assert down.returncode == 0, down.stdout + down.stderr
    deadline = time.monotonic() + 30  # n2's task stops its ranks (SIGTERM, SIGKILL after 15 s) as it ends
    while left := subprocess.run(["pgrep", "-f", "worker.ranks"], capture_output=True, text=True).stdout.split():
        assert time.monotonic() < deadline, left
        time.sleep(0.5)
