"""The worker's engine servers and the loops that run them.

The rollout engine serves ``generate`` by continuous batching (tasks join the running batch
between steps, whatever their job); the trainer serves one task at a time from its handler table
(one handler per trainer ``Method`` of ``plexctl.common.calls``), after its store made the job's
state resident, or several jobs' train steps in one shared pass. Whichever way a task ran, one
hook follows its work (``TrainerServer._after_step``: the adapter saved where the task
publishes). A repeated trainer call (same ``call_key``) gets the last result, unapplied (its
publish made again where the repeat names). A task sent ahead of the task it follows
(``TaskBody.after``) waits in ``Followers`` and starts the moment that task ends (fails, if it
failed). Engines that take turns on one GPU keep one awake (``Rollouts``, ``Trainers``).
"""

from __future__ import annotations

import logging
import queue
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, cast

from plexctl.common import calls as C
from plexctl.common import protocol as P
from worker.io import Followers, Outbox, _error_text
from worker.trainer_group import GroupCall, GroupRank, TrainerGroupError

log = logging.getLogger("plexw")


class RolloutServer:
    """Serves generate tasks by continuous batching: a task's prompts join the engine's running
    batch at its next step, whatever jobs are in it (one adapter per job), and each task is
    answered as soon as its own prompts finished."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.started: dict[int, float] = {}  # task id -> start time, for the tasks in flight
        self.switched: dict[int, float] = {}  # task id -> seconds its engine switched weights (or woke) for it

    @property
    def busy(self) -> bool:
        return bool(self.started)

    def admit(self, batch: list[P.TaskBody | P.TaskPassBody | P.ReleaseBody], out: Outbox, woke_s: float = 0.0) -> None:
        """Start the generate tasks of ``batch``; carry out a release (after failing that job's
        tasks in flight) and refuse other methods. A bad request fails its own task only.
        ``woke_s``: the engine just woke for this batch (reported with its first task)."""
        for t in batch:
            if isinstance(t, P.ReleaseBody):
                for key in self.engine.in_flight_of(t.job_id):
                    self.started.pop(key, None)
                    self.switched.pop(key, None)
                    out.result(key, False, error="the job was released")
                self.engine.drop_job(t.job_id)
            elif isinstance(t, P.TaskPassBody):
                for member in t.tasks:
                    out.result(member.task_id, False, error=f"rollout engine cannot {member.method!r}")
            elif not isinstance(t.task, C.GenerateTask):
                out.result(t.task_id, False, error=f"rollout engine cannot {t.method!r}")
            elif t.task_id not in self.started:  # a repeat of a task in flight is answered once
                loads, t0 = getattr(self.engine, "weight_loads", 0), time.perf_counter()
                try:
                    self.engine.start(t.task_id, t.task.request)
                except Exception as exc:  # noqa: BLE001 - reported to its job, the engine stays up
                    log.warning("generate task %s refused: %s", t.task_id, _error_text(exc))
                    out.result(t.task_id, False, error=_error_text(exc))
                    continue
                self.started[t.task_id] = time.perf_counter()
                loaded = self.started[t.task_id] - t0 if getattr(self.engine, "weight_loads", 0) != loads else 0.0
                if loaded or woke_s:
                    self.switched[t.task_id] = loaded + woke_s
                    woke_s = 0.0

    def step(self, out: Outbox) -> None:
        """One engine step; answer the tasks it finished. A failed step fails every task in flight."""
        try:
            finished = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - reported to each job, the engine stays up
            log.error("generate failed: %s", traceback.format_exc())
            keys = list(self.started)
            self.engine.abort(keys)
            self.started.clear()
            self.switched.clear()
            for key in keys:
                out.result(key, False, error=_error_text(exc))
            return
        for key, samples in self.engine.take_partials():  # a streamed task's tokens, before its result
            if key in self.started:
                out.partial(key, samples)
        now = time.perf_counter()
        for key, completions in finished:
            t0 = self.started.pop(key, now)
            switched = self.switched.pop(key, 0.0)
            out.result(key, True, C.GenerateResult(completions), seconds=now - t0, switch_seconds=switched)

    def serve(self, batch: list[P.TaskBody | P.TaskPassBody | P.ReleaseBody], out: Outbox) -> None:
        """A fixed batch, run to the end."""
        self.admit(batch, out)
        while self.busy:
            self.step(out)


class TrainerServer:
    """Serves trainer tasks one at a time; before each, the store makes the job's state resident
    (swapping another job's state out to host or NVMe when the device tier is full).

    A task that carries the ``call_key`` of the job's last stateful call is a repeat (a driver
    sent its calls again after its daemon restarted): it gets that call's result, unapplied."""

    def __init__(self, store: Any, engine_id: str = "", writes: bool = True) -> None:
        self.store = store
        self.engine_id = engine_id  # named in what it reports: a worker may host a trainer per model
        # it writes the files tasks name (a trainer's other ranks do not: rank 0 does, the others
        # taking part where a job's state is sharded and gathered to be written)
        self.writes = writes
        engine = store.trainer
        # a task's own work; what it publishes is saved after it, by ``_after_step``
        self.handlers: dict[str, Callable[[str, Any], C.AnyResult]] = {
            "train_step": lambda job, t: C.TrainStepResult(engine.train_step(job, t.batch, t.hp)),
            "publish": lambda job, t: C.PublishResult(),
            "checkpoint": lambda job, t: C.CheckpointResult(
                engine.save_checkpoint(job, t.out_dir, t.extra, write=writes)
            ),
            "restore": lambda job, t: C.RestoreResult(
                engine.load_checkpoint(job, t.ckpt_dir, t.trainer.lora, t.trainer.seed, t.weights_only)
            ),
            "forward_backward": lambda job, t: engine.forward_backward(job, t.call),
            "optim_step": lambda job, t: engine.optim_step(job, t.calls, t.adam),
        }
        assert set(self.handlers) == {m.name for m in C.METHODS.values() if m.kind == "trainer"}
        self.done: dict[str, tuple[str, C.AnyResult]] = {}  # job -> (call key, result) of its last stateful call
        self._moves_sent = 0  # the store's background moves already reported

    def _info(self) -> dict[str, Any]:
        """What every result carries for the daemon: the store's tier inventory and the moves
        made off this thread (prefetches and their demotions, writes left behind by evictions)
        since the last result."""
        self._moves_sent, moves = self.store.background_moves(self._moves_sent)
        info: dict[str, Any] = {"inventory": self.store.inventory()}
        if self.engine_id:
            info["engine"] = self.engine_id
        if moves:
            info["moves"] = [list(move) for move in moves]
        return info

    def _after_step(self, engine: Any, job_id: str, task: C.AnyTask) -> None:
        """What follows a task's work, whichever way it ran (alone, in a shared pass, or as a
        repeat): the job's adapter saved where the task publishes, if it does."""
        out_dir = publish_dir(task)
        if out_dir:
            engine.save_adapter(job_id, out_dir, write=self.writes)

    def _publish_again(self, job_id: str, task: C.AnyTask) -> None:
        """A repeated call that publishes: the job's adapter is as that call left it (it was the
        job's last stateful call), so it is saved again where the repeat names, if not there yet."""
        out_dir = publish_dir(task)
        if not out_dir or (Path(out_dir) / "adapter_config.json").exists():
            return
        assert not isinstance(task, C.GenerateTask)
        if not self.writes and task.trainer.lora is not None:  # a replicated adapter: rank 0 writes it
            return
        self.store.ensure_resident(job_id, task.trainer.lora, task.trainer.seed)
        self._after_step(self.store.trainer, job_id, task)

    def serve_pass(self, p: P.TaskPassBody, out: Outbox) -> None:
        """Several jobs' train steps in shared passes (``TrainingMath.train_group``), at most as
        many jobs at once as the device tier holds, each step reported on its own with the
        pass's seconds. A repeat, or a step that cannot share (no LoRA, LoRA dropout), runs
        alone as ``serve`` runs it; a pass that fails before its steps runs them one by one."""
        members: list[P.TaskBody] = []
        for t in p.tasks:
            task = t.task
            if not isinstance(task, C.TrainStepTask):
                self.serve(t, out)
                continue
            key, lora = task.trainer.call_key, task.trainer.lora
            if (key and self.done.get(t.job_id, ("", None))[0] == key) or lora is None or lora.dropout > 0:
                self.serve(t, out)
            else:
                members.append(t)
        size = max(1, int(getattr(self.store, "device_slots", len(members)) or 1))
        for i in range(0, len(members), size):
            chunk = members[i : i + size]
            if len(chunk) == 1:
                self.serve(chunk[0], out)
            else:
                self._serve_shared(chunk, out)

    def _serve_shared(self, chunk: list[P.TaskBody], out: Outbox) -> None:
        """One shared pass: the members' states made resident together (they come first in the
        store's order, so none evicts another), one ``train_group``, a result each."""
        store, engine, t0 = self.store, self.store.trainer, time.perf_counter()
        tasks = [cast(C.TrainStepTask, t.task) for t in chunk]
        ids = [t.job_id for t in chunk]
        try:
            store.set_upcoming(ids + [j for j in tasks[0].trainer.upcoming if j not in ids])
            moved = [store.ensure_resident(j, t.trainer.lora, t.trainer.seed) for j, t in zip(ids, tasks)]
            if not set(ids) <= set(engine.jobs()):
                raise RuntimeError(f"the device tier did not hold {', '.join(ids)} at once")
            metrics = engine.train_group([(j, t.batch, t.hp) for j, t in zip(ids, tasks)])
        except Exception:  # noqa: BLE001 - each step runs again alone, and reports its own error
            log.warning("shared pass of %s failed; each runs alone: %s", ", ".join(ids), traceback.format_exc())
            for t in chunk:
                self.serve(t, out)
            return
        seconds = time.perf_counter() - t0
        for t, task, m, mv in zip(chunk, tasks, metrics, moved):
            try:
                self._after_step(engine, t.job_id, task)
            except Exception as exc:  # noqa: BLE001 - reported to the job, the engine stays up
                log.error("publish for %s failed: %s", t.job_id, traceback.format_exc())
                out.result(t.task_id, False, error=_error_text(exc), seconds=seconds, info=self._info())
                continue
            m.update(
                swap_bytes=float(mv.get("bytes", 0)),
                swap_seconds=float(mv.get("seconds", 0.0)),
                swap_evicted=float(len(mv.get("evicted", []))),
            )
            value = C.TrainStepResult(m)
            if task.trainer.call_key:
                self.done[t.job_id] = (task.trainer.call_key, value)
            out.result(t.task_id, True, value, seconds=seconds, info=self._info())

    def release(self, t: P.ReleaseBody, out: Outbox) -> None:
        """Drop the job's state; the daemon hears of the inventory it leaves."""
        try:
            self.store.drop(t.job_id)
        except Exception:  # noqa: BLE001 - the engine stays up
            log.error("release of %s failed: %s", t.job_id, traceback.format_exc())
        self.done.pop(t.job_id, None)
        out.inventory(self._info())

    def serve(self, t: P.TaskBody | P.ReleaseBody, out: Outbox) -> None:
        if isinstance(t, P.ReleaseBody):
            self.release(t, out)
            return
        store, task = self.store, t.task
        t0 = time.perf_counter()
        if isinstance(task, C.GenerateTask):
            out.result(t.task_id, False, error="trainer engine cannot 'generate'", info=self._info())
            return
        key = task.trainer.call_key
        if key and self.done.get(t.job_id, ("", None))[0] == key:
            try:  # a restarted daemon may name another directory for the adapter the call published
                self._publish_again(t.job_id, task)
            except Exception as exc:  # noqa: BLE001 - reported to the job, the engine stays up
                log.error("%s for %s failed: %s", t.method, t.job_id, traceback.format_exc())
                out.result(t.task_id, False, error=_error_text(exc), seconds=0.0, info=self._info())
                return
            out.result(t.task_id, True, self.done[t.job_id][1], seconds=0.0, info=self._info())
            return
        try:
            store.set_upcoming(list(task.trainer.upcoming))
            moved = store.ensure_resident(t.job_id, task.trainer.lora, task.trainer.seed)
            value = self.handlers[t.method](t.job_id, task)
            self._after_step(store.trainer, t.job_id, task)
            if isinstance(value, C.TrainStepResult):
                value.metrics.update(
                    swap_bytes=float(moved.get("bytes", 0)),
                    swap_seconds=float(moved.get("seconds", 0.0)),
                    swap_evicted=float(len(moved.get("evicted", []))),
                )
        except Exception as exc:  # noqa: BLE001 - reported to the job, the engine stays up
            log.error("%s for %s failed: %s", t.method, t.job_id, traceback.format_exc())
            out.result(t.task_id, False, error=_error_text(exc), seconds=time.perf_counter() - t0, info=self._info())
            return
        if key:
            self.done[t.job_id] = (key, value)
        out.result(t.task_id, True, value, seconds=time.perf_counter() - t0, info=self._info())


class Rollouts:
    """The worker's rollout engines, one per model, behind ``RolloutServer``'s interface: a task
    goes to the engine its ``engine_id`` names. Resident engines (CPU) step in turn. Engines
    that take turns (``one_awake``: several models on a GPU) keep one awake: a task for a
    sleeping engine waits until the awake one has nothing in flight, then the longest-waiting
    model's engine wakes (the other sleeps) and takes every task waiting for it, so one wake
    serves a whole group."""

    def __init__(self, engines: dict[str, Any], one_awake: bool = False) -> None:
        self.servers = {engine_id: RolloutServer(engine) for engine_id, engine in engines.items()}
        self.one_awake = one_awake and len(engines) > 1
        self.waiting: list[P.TaskBody | P.TaskPassBody | P.ReleaseBody] = []  # for an engine asleep, oldest first
        awake = [engine_id for engine_id, engine in engines.items() if getattr(engine, "awake", True)]
        self.awake = awake[-1] if awake else next(iter(engines))

    @property
    def started(self) -> dict[int, float]:
        return {key: t0 for server in self.servers.values() for key, t0 in server.started.items()}

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(server.busy for server in self.servers.values())

    def admit(self, batch: list[P.TaskBody | P.TaskPassBody | P.ReleaseBody], out: Outbox) -> None:
        by_engine: dict[str, list[P.TaskBody | P.TaskPassBody | P.ReleaseBody]] = {}
        for t in batch:
            if t.engine_id not in self.servers:
                if isinstance(t, P.TaskBody):
                    out.result(t.task_id, False, error=f"no engine {t.engine_id!r} on this worker")
            elif self.one_awake and t.engine_id != self.awake and not isinstance(t, P.ReleaseBody):
                self.waiting.append(t)
            else:
                by_engine.setdefault(t.engine_id, []).append(t)
        for engine_id, tasks in by_engine.items():
            self.servers[engine_id].admit(tasks, out)

    def step(self, out: Outbox) -> None:
        for server in self.servers.values():
            if server.busy:
                server.step(out)
        if self.waiting and not self.servers[self.awake].busy:
            self._switch(out)

    def _switch(self, out: Outbox) -> None:
        """Wake the engine of the oldest waiting task, sleeping the awake one; admit its group."""
        to = next_awake(self.awake, [t.engine_id for t in self.waiting])
        woke_s = 0.0
        if to != self.awake:
            t0 = time.perf_counter()
            self.servers[self.awake].engine.sleep()
            self.servers[to].engine.wake()
            woke_s = time.perf_counter() - t0
            log.info("rollout engine %s awake (%s asleep) in %.2f s", to, self.awake, woke_s)
            self.awake = to
        group = [t for t in self.waiting if t.engine_id == to]
        self.waiting = [t for t in self.waiting if t.engine_id != to]
        self.servers[to].admit(group, out, woke_s)

    def serve(self, batch: list[P.TaskBody | P.TaskPassBody | P.ReleaseBody], out: Outbox) -> None:
        self.admit(batch, out)
        while self.busy:
            self.step(out)


def publish_dir(task: C.AnyTask) -> str:
    """Where the task saves the job's adapter after its work ("": it does not): a publish's
    ``out_dir``, a train or optim step's ``publish_dir``."""
    if isinstance(task, C.PublishTask):
        return task.out_dir
    if isinstance(task, (C.TrainStepTask, C.OptimStepTask)):
        return task.publish_dir
    return ""


def next_awake(awake: str, waiting: list[str]) -> str:
    """The engine to wake when the awake one is idle: that of the oldest waiting task (``waiting``
    holds the engine of each waiting task, oldest first); the awake one if nothing waits."""
    return waiting[0] if waiting else awake


class Trainers:
    """The worker's trainer engines, one per model, each behind its ``TrainerServer``: a task
    goes to the one its ``engine_id`` names; one task at a time, whichever model (one device).
    ``stores``: engine id -> store, or one store, which serves every task. Engines that take
    turns (``one_awake``: several bases on a GPU) keep one base on the device: before a task of
    another model's engine, the awake one's base sleeps to host memory and the task's wakes,
    the seconds reported with that task (``switch_seconds``)."""

    def __init__(self, stores: dict[str, Any] | Any, one_awake: bool = False, writes: bool = True) -> None:
        stores = stores if isinstance(stores, dict) else {"": stores}
        self.servers = {engine_id: TrainerServer(store, engine_id, writes) for engine_id, store in stores.items()}
        self.one_awake = one_awake and len(self.servers) > 1
        self.awake = next(reversed(self.servers))  # the one built last, until a task names another
        if self.one_awake:
            for engine_id, server in self.servers.items():
                if engine_id != self.awake:
                    server.store.trainer.sleep()

    def serve(self, t: P.TaskBody | P.TaskPassBody | P.ReleaseBody, out: Outbox) -> None:
        one = next(iter(self.servers.values())) if len(self.servers) == 1 else None
        server = one or self.servers.get(t.engine_id)
        if server is None:
            for task in t.tasks if isinstance(t, P.TaskPassBody) else [t] if isinstance(t, P.TaskBody) else []:
                out.result(task.task_id, False, error=f"no engine {t.engine_id!r} on this worker")
            return
        if self.one_awake and t.engine_id != self.awake and not isinstance(t, P.ReleaseBody):
            t0 = time.perf_counter()
            self.servers[self.awake].store.trainer.sleep()
            server.store.trainer.wake()
            switched = time.perf_counter() - t0
            log.info("trainer %s awake (%s asleep) in %.2f s", t.engine_id, self.awake, switched)
            self.awake = t.engine_id
            first = t.tasks[0].task_id if isinstance(t, P.TaskPassBody) else t.task_id
            out = _WithSwitch(out, first, switched)  # type: ignore[assignment]
        if isinstance(t, P.TaskPassBody):
            server.serve_pass(t, out)
        else:
            server.serve(t, out)


class Discard:
    """An outbox that sends nothing: where a trainer's other ranks report (rank 0 reports)."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


@dataclass
class RankTrainer:
    """One rank of a trainer engine of several: its store and server, and where its results go
    (rank 0: the worker's outbox, set before each call; the others: ``Discard``)."""

    store: Any
    server: Trainers
    out: Any


@dataclass(frozen=True)
class Serve(GroupCall[None]):
    """One body for every rank of a trainer engine: each serves it on its own store."""

    body: P.TaskBody | P.TaskPassBody | P.ReleaseBody

    def run(self, rank: GroupRank) -> None:
        target: RankTrainer = rank.target
        target.server.serve(self.body, target.out)


class GroupTrainers:
    """``Trainers`` for a trainer engine of several ranks (``TrainerGroup``, whose ranks each hold
    a ``RankTrainer``): rank 0 sends every body to the others, the way vLLM's executor drives its
    tensor-parallel workers, then every rank serves it, its base sharded and its jobs' adapters
    replicated, and rank 0's results are the engine's. A rank that fails, dies or times out takes
    the worker down (``on_failure``), so the engine restarts whole and its jobs go on from their
    checkpoints; a task's own error is each rank's, reported as on one rank. Rank 0's results are
    held until the body is done: a task that failed is reported only once every rank answers a
    ``Ping`` (a collective that failed on a dead peer is the peer's death, not the task's error),
    and a body the group failed on reports nothing (its jobs roll back when the worker is lost; a
    failed result would reach their drivers first, as their own error)."""

    def __init__(self, group: Any, on_failure: Callable[[str], None]) -> None:
        self.group, self.on_failure = group, on_failure

    def serve(self, t: P.TaskBody | P.TaskPassBody | P.ReleaseBody, out: Outbox) -> None:
        target: RankTrainer = self.group.target
        held = _HeldResults(out)
        target.out = held
        try:
            self.group.call(Serve(t))
            if held.failed:
                self.group.call(Ping())
        except TrainerGroupError as exc:  # no result: the body's tasks are the daemon's to run again
            log.error("trainer engine of %d ranks failed: %s", self.group.width, exc)
            self.on_failure(str(exc))
            return
        held.flush()


@dataclass(frozen=True)
class Ping(GroupCall[None]):
    """Every rank answers (one small collective): a dead or hung rank fails it."""

    def run(self, rank: GroupRank) -> None:
        rank.gather_objects(None)


class _HeldResults:
    """An outbox that holds the results it is given until ``flush``; everything else goes through."""

    def __init__(self, out: Outbox) -> None:
        self.out = out
        self.held: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    @property
    def failed(self) -> bool:
        """Whether a held result is a failure."""
        return any(not (args[1] if len(args) > 1 else kwargs.get("ok", True)) for args, kwargs in self.held)

    def result(self, *args: Any, **kwargs: Any) -> None:
        self.held.append((args, kwargs))

    def flush(self) -> None:
        for args, kwargs in self.held:
            self.out.result(*args, **kwargs)
        self.held.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.out, name)


class _WithSwitch:
    """An outbox that reports ``seconds`` of switching with the result of ``task_id``."""

    def __init__(self, out: Outbox, task_id: int, seconds: float) -> None:
        self.out, self.task_id, self.seconds = out, task_id, seconds

    def result(self, task_id: int, ok: bool, *args: Any, **kwargs: Any) -> None:
        if task_id == self.task_id:
            kwargs["switch_seconds"] = self.seconds
        self.out.result(task_id, ok, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.out, name)


def _take(
    tasks: "queue.Queue[P.TaskBody | P.TaskPassBody | P.ReleaseBody]", limit: int
) -> list[P.TaskBody | P.TaskPassBody | P.ReleaseBody]:
    """The next task (waiting for it) and those already queued behind it, up to ``limit``."""
    first = tasks.get()
    return [first, *_take_waiting(tasks, limit - 1)]


def rollout_loop(
    server: Rollouts,
    tasks: "queue.Queue[P.TaskBody | P.TaskPassBody | P.ReleaseBody]",
    capacity: int,
    followers: Followers | None = None,
) -> None:
    """Continuous batching: between engine steps, tasks that arrived join the running batch
    (up to ``capacity`` generate tasks in flight); with nothing in flight, wait for one."""
    out = Outbox(followers)
    while True:
        if not server.busy:
            server.admit(_take(tasks, capacity), out)
        room = capacity - len(server.started)
        if room > 0:
            server.admit(_take_waiting(tasks, room), out)
        server.step(out)


def _take_waiting(
    tasks: "queue.Queue[P.TaskBody | P.TaskPassBody | P.ReleaseBody]", limit: int
) -> list[P.TaskBody | P.TaskPassBody | P.ReleaseBody]:
    """The tasks already queued, up to ``limit``, without waiting."""
    batch: list[P.TaskBody | P.TaskPassBody | P.ReleaseBody] = []
    while len(batch) < limit:
        try:
            batch.append(tasks.get_nowait())
        except queue.Empty:
            break
    return batch


def trainer_loop(
    stores: dict[str, Any] | Any,
    tasks: "queue.Queue[P.TaskBody | P.TaskPassBody | P.ReleaseBody]",
    followers: Followers | None = None,
    one_awake: bool = False,
    trainers: Trainers | GroupTrainers | None = None,
) -> None:
    """Trainer tasks one at a time; ``stores`` and ``one_awake`` as ``Trainers`` takes them
    (``trainers``: served by these instead, a trainer engine of several ranks)."""
    server, out = trainers or Trainers(stores, one_awake), Outbox(followers)
    while True:
        server.serve(tasks.get(), out)


def shared_loop(
    rollout: Rollouts,
    stores: dict[str, Any],
    tasks: "queue.Queue[P.TaskBody | P.TaskPassBody | P.ReleaseBody]",
    capacity: int,
    followers: Followers | None = None,
    one_awake: bool = False,
    trainers: Trainers | GroupTrainers | None = None,
) -> None:
    """Both engines of this worker served from one thread, from one queue: the generates
    waiting are one batch, trainer tasks run in the order they came, whichever kind came first
    goes first. On CPU the engines share the cores anyway, and torch's OpenMP thread team is
    per calling thread: two engine threads mean two teams spinning on the same cores."""
    trainer, out = trainers or Trainers(stores, one_awake), Outbox(followers)
    while True:
        batch = _take(tasks, 1 << 10)
        gens = [t for t in batch if t.engine_id.endswith("/rollout")]
        train = [t for t in batch if not t.engine_id.endswith("/rollout")]
        first, then = (train, []) if train and batch[0] is train[0] else ([], train)
        for t in first:
            trainer.serve(t, out)
        for i in range(0, len(gens), capacity):
            rollout.serve(gens[i : i + capacity], out)
        for t in then:
            trainer.serve(t, out)


def prefetch_loop(stores: dict[str, Any] | Any, tasks: "queue.Queue[P.PrefetchBody]") -> None:
    """Bring jobs' state from NVMe to host memory ahead of need, overlapping other jobs' steps
    (``stores``: engine id -> store, or one store)."""
    while True:
        t = tasks.get()
        store = stores.get(t.engine_id) if isinstance(stores, dict) else stores
        if store is None:
            continue
        try:
            if t.upcoming:  # the daemon's newest order (the trainer's calls bring it too)
                store.set_upcoming(list(t.upcoming))
            store.prefetch(t.job_id)
        except Exception:  # noqa: BLE001 - a failed prefetch only means a slower swap-in later
            log.warning("prefetch of %s failed: %s", t.job_id, traceback.format_exc())
