"""Several base models on one worker: engine ids, which rollout engine is awake, and the
commands that carry every model to the workers (pure parts; the real engines run in
test_multi_base_e2e.py)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from daemon.node import worker_command
from plexctl.common import calls as C
from plexctl.common import protocol as P
from plexctl.common.cluster_config import ClusterConfig, config_path, read_config, write_config
from plexctl.common.layout import WorkerPlacement
from plexctl.common.slurm import SlurmSpec, node_command
from worker.engine_args import EngineArgsError, rollout_engine_args, sleep_between_models
from worker.main import engine_id
from worker.servers import Rollouts, Trainers, next_awake


class Recorded:
    """Results as an ``Outbox`` would send them."""

    def __init__(self) -> None:
        self.results: list[tuple[int, bool, str]] = []
        self.switched: dict[int, float] = {}  # task -> the switch reported with it

    def result(
        self, task_id: int, ok: bool, value=None, error: str = "", seconds: float = 0.0, info=None, switch_seconds=0.0
    ) -> None:
        self.results.append((task_id, ok, error))
        if switch_seconds:
            self.switched[task_id] = switch_seconds


class Engine:
    """A rollout engine that finishes each request at its next step and records what it did."""

    def __init__(self, name: str, log: list[str], awake: bool = True) -> None:
        self.name, self.log, self.awake, self.pending = name, log, awake, []

    def start(self, key, request) -> None:
        assert self.awake, f"{self.name} started a request asleep"
        self.pending.append(key)

    def step(self):
        assert self.awake, f"{self.name} stepped asleep"
        done, self.pending = self.pending, []
        self.log.append(f"{self.name}:step{sorted(done)}")
        return [(key, []) for key in done]

    def sleep(self) -> None:
        self.log.append(f"{self.name}:sleep")
        self.awake = False

    def wake(self) -> None:
        self.log.append(f"{self.name}:wake")
        time.sleep(0.01)  # what the scheduler learns a wake costs
        self.awake = True

    def in_flight_of(self, job_id):
        return []

    def take_partials(self):
        return []

    def drop_job(self, job_id) -> None:
        self.log.append(f"{self.name}:drop {job_id}")


def generate(task_id: int, engine: str, job: str = "j") -> P.TaskBody:
    request = C.GenRequest(job_id=job, prompts=["1+1="], sampling=C.Sampling())
    return P.TaskBody(task_id=task_id, job_id=job, engine_id=engine, task=C.GenerateTask(request=request))


A, B = engine_id("w0", "rollout", 0), engine_id("w0", "rollout", 1)


def test_engine_ids_keep_the_first_models_and_end_in_their_kind():
    assert (A, B) == ("w0/rollout", "w0/m1/rollout")
    assert engine_id("n1-g2", "trainer", 2) == "n1-g2/m2/trainer"
    assert all(e.endswith("/rollout") for e in (A, B))  # what the shared loop sorts by


def test_engines_that_take_turns_serve_each_waiting_group_after_one_wake():
    log: list[str] = []
    engines = {A: Engine("a", log, awake=False), B: Engine("b", log)}  # b, built last, is awake
    rollouts, out = Rollouts(engines, one_awake=True), Recorded()
    rollouts.serve([generate(1, A), generate(2, B), generate(3, A), generate(4, B), generate(5, A)], out)
    assert sorted(t for t, ok, _ in out.results if ok) == [1, 2, 3, 4, 5]
    assert log == ["b:step[2, 4]", "b:sleep", "a:wake", "a:step[1, 3, 5]"]  # one switch for the whole group
    assert list(out.switched) == [1] and out.switched[1] >= 0.01  # the wake, reported with its group's first
    rollouts.serve([generate(6, A)], out)  # the awake engine serves at once
    assert log[-1] == "a:step[6]" and log.count("a:wake") == 1


def test_resident_engines_serve_every_model_without_sleeping():
    log: list[str] = []
    rollouts, out = Rollouts({A: Engine("a", log), B: Engine("b", log)}), Recorded()
    rollouts.serve([generate(1, A), generate(2, B)], out)
    assert sorted(log) == ["a:step[1]", "b:step[2]"]
    assert [ok for _, ok, _ in out.results] == [True, True]


def test_a_task_for_an_engine_the_worker_has_not_fails_alone():
    log: list[str] = []
    rollouts, out = Rollouts({A: Engine("a", log)}), Recorded()
    rollouts.serve([generate(1, "w0/m7/rollout"), generate(2, A)], out)
    assert out.results[0][:2] == (1, False) and "w0/m7/rollout" in out.results[0][2]
    assert (2, True, "") in out.results
    store = SimpleNamespace(trainer=None)
    trainers = Trainers({"w0/trainer": store, "w0/m1/trainer": store})
    trainers.serve(P.TaskBody(task_id=3, job_id="j", engine_id="w0/m5/trainer", task=None), out)  # type: ignore[arg-type]
    assert out.results[-1][:2] == (3, False)


def test_the_next_engine_to_wake_is_the_oldest_waiting_tasks():
    assert next_awake(A, []) == A
    assert next_awake(A, [B, A, B]) == B


def test_rollout_engines_sleep_between_models_on_cuda_only():
    assert sleep_between_models("cuda", 2) and not sleep_between_models("cuda", 1)
    assert not sleep_between_models("cpu", 3)
    assert rollout_engine_args("cuda", "/m", sleep_mode=True).llm_kwargs["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in rollout_engine_args("cuda", "/m").llm_kwargs
    with pytest.raises(EngineArgsError, match="sleep_mode"):
        rollout_engine_args("cpu", "/m", sleep_mode=True)


def test_every_model_reaches_the_workers_and_the_daemon(tmp_path):
    placement = WorkerPlacement("n1-g0", ["rollout"], ["0"], "n1-g0")
    argv = worker_command(placement, "tcp://n0:5555", "n1", ["/m/a", "/m/b"], Path("/s"), 1, None, Path("/s/c.json"))
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--model"] == ["/m/a", "/m/b"]
    spec = SlurmSpec(name="c", state_dir=str(tmp_path), config=ClusterConfig(models=["/m/a", "/m/b"]))
    write_config(config_path(tmp_path), spec.config)  # as `up --slurm` does before it submits
    assert node_command(spec)[2:] == ["daemon.node", "--state-dir", str(tmp_path)]  # the node reads the rest
    assert read_config(config_path(tmp_path)).models == ["/m/a", "/m/b"]


def test_the_daemon_keeps_each_job_on_the_engines_of_its_own_model(core, tiny_model, tmp_path):
    """One worker with an engine of each kind per model: a job on the second model has its calls
    on that model's engines, and stays there when the worker reports where its state lives."""
    from test_daemon_core import BATCH, GENERATE, call, running, tasks

    second = tmp_path / "second-model"
    shutil.copytree(tiny_model, second)
    d = core
    engines = [
        P.EngineDecl(engine_id("w0", kind, m), kind, str(model), 4 if kind == "rollout" else 1)
        for m, model in enumerate((tiny_model, second))
        for kind in ("rollout", "trainer")
    ]
    d.send(b"w0", P.Op.REGISTER, P.RegisterReq("w0", "node", 1, engines, True, resident={}))
    job = running(d, second, "b")
    for msg_id in (1, 2):  # the second step comes after the worker said where the state lives
        call(d, job, C.TrainStepReq(BATCH, publish=True), msg_id)
        d.place()
        (step,) = tasks(d)
        assert step.engine_id == "w0/m1/trainer"
        inventory = {"device": {"jobs": [job]}, "host": {"jobs": []}, "nvme": {"jobs": []}}
        info = {"engine": "w0/m1/trainer", "inventory": inventory}
        d.send(b"w0", P.Op.RESULT, P.ResultBody(step.task_id, True, C.TrainStepResult({"loss": 0.5}), info=info))
        assert d.sched.home_of(job, "trainer") == "w0/m1/trainer"
    call(d, job, GENERATE, 3)
    d.place()
    (gen,) = tasks(d)
    assert gen.engine_id == "w0/m1/rollout" and gen.task.request.adapter.version == 2


def test_status_says_which_model_a_worker_s_rollout_engines_have_awake(core, tiny_model, tmp_path):
    """Engines that take turns (on a GPU): the one that served last is awake, the others asleep;
    before any served, the one built last. Resident engines say so."""
    from test_daemon_core import GENERATE, call, running, tasks

    second = tmp_path / "second-model"
    shutil.copytree(tiny_model, second)
    d = core
    engines = [
        P.EngineDecl(engine_id("w0", k, m), k, str(model), 4 if k == "rollout" else 1, sleeps=k == "rollout")
        for m, model in enumerate((tiny_model, second))
        for k in ("rollout", "trainer")
    ]
    d.send(b"w0", P.Op.REGISTER, P.RegisterReq("w0", "node", 1, engines, True, resident={}))

    def weights() -> dict[str, str]:
        d.sent.clear()
        d.send(b"cli", P.Op.STATUS, P.StatusReq())
        (rep,) = [body for _, op, body in d.sent if op == P.Op.REPLY]
        d.sent.clear()
        return {e.engine_id: e.weights for e in rep.engines if e.kind == "rollout"}

    assert weights() == {"w0/rollout": "asleep", "w0/m1/rollout": "awake"}
    job = running(d, tiny_model, "a")
    call(d, job, GENERATE, 1)
    d.place()
    sent = tasks(d)
    assert [t.engine_id for t in sent] == ["w0/rollout"], sent
    gen = sent[0]
    d.send(b"w0", P.Op.RESULT, P.ResultBody(gen.task_id, True, C.GenerateResult([])))
    assert weights() == {"w0/rollout": "awake", "w0/m1/rollout": "asleep"}
    resident = [msgspec.structs.replace(e, engine_id=f"w1/{e.kind}", sleeps=False) for e in engines[:2]]
    d.send(b"w1", P.Op.REGISTER, P.RegisterReq("w1", "node", 2, resident, True, resident={}))
    assert weights()["w1/rollout"] == "resident"


class Base:
    """A trainer engine's base that records its sleeps and wakes."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log, self.awake = name, log, True

    def sleep(self) -> None:
        self.log.append(f"{self.name}:sleep")
        self.awake = False

    def wake(self) -> None:
        self.log.append(f"{self.name}:wake")
        time.sleep(0.01)
        self.awake = True


def trainer_task(task_id: int, engine: str) -> P.TaskBody:
    return P.TaskBody(task_id=task_id, job_id="j", engine_id=engine, task=None)  # type: ignore[arg-type]


def test_trainers_that_take_turns_keep_one_base_on_the_device_and_report_each_switch():
    TA, TB = engine_id("w0", "trainer", 0), engine_id("w0", "trainer", 1)
    log: list[str] = []
    bases = {TA: Base("a", log), TB: Base("b", log)}
    trainers = Trainers({e: SimpleNamespace(trainer=b) for e, b in bases.items()}, one_awake=True)
    assert log == ["a:sleep"] and trainers.awake == TB  # the one built last stays awake
    ran: list[tuple[int, bool, bool]] = []  # task, a awake, b awake: what each task found
    for server in trainers.servers.values():
        server.serve = lambda t, out: (  # type: ignore[method-assign]
            ran.append((t.task_id, bases[TA].awake, bases[TB].awake)),
            out.result(t.task_id, True),
        )
    out = Recorded()
    for task_id, engine in enumerate([TB, TA, TA, TB], start=1):
        trainers.serve(trainer_task(task_id, engine), out)
    assert ran == [(1, False, True), (2, True, False), (3, True, False), (4, False, True)]
    assert log == ["a:sleep", "b:sleep", "a:wake", "a:sleep", "b:wake"]  # a switch only where the model changes
    assert sorted(out.switched) == [2, 4] and all(s >= 0.01 for s in out.switched.values())
    log.clear()
    resident = Trainers({e: SimpleNamespace(trainer=b) for e, b in bases.items()})  # on the CPU: all stay
    assert log == [] and not resident.one_awake


def test_a_trainer_base_that_slept_and_woke_trains_on_bit_for_bit(tmp_path: Path):
    import torch

    from tests.test_state_store import tiny_qwen2
    from tests.test_trainer import make_batch, without_seconds
    from worker.trainer import TrainerEngine

    model, steps = tiny_qwen2(tmp_path / "m"), {}
    for sleeps in (False, True):
        engine = TrainerEngine(model, threads=1)
        engine.ensure_job("j", P.LoraSpec(rank=4), seed=0)
        weights = {k: p.detach().clone() for k, p in engine._base_params.items()}
        if sleeps:
            engine.sleep()
            assert not engine.awake
            engine.wake()
        assert engine.awake and all(torch.equal(p, weights[k]) for k, p in engine._base_params.items())
        steps[sleeps] = without_seconds(engine.train_step("j", make_batch(7, rows=4), P.TrainHParams(lr=1e-2)))
    assert steps[True] == steps[False]  # the same step, to the last bit
