"""The trace simulator: the daemon's own scheduler core and the workers' own tier policy on a
simulated clock, fed by a job trace.

``simulate(trace, policy, gpus)`` replays a ``Trace`` (``daemon/trace.py``) on ``gpus`` GPUs
through ``daemon.scheduler.Scheduler`` (the code the daemon runs), with a discrete-event heap
instead of sleeps, and returns a ``SimResult``: makespan, GPU-hours per training step, queueing
delay, bubble ratio, swap traffic, model switches, and the wall time of every ``tick``.

What it owns is the model around the core: engines as 8-GPU nodes in rollout + trainer pairs
(``planned_trainer_widths``: trainers of the memory plan's width per model class, for GPU-hours),
jobs as shards with a home pair each, a step's phases with barriers across a job's shards
(``macro_steps`` coarsens them), swap-ins charged by tier bandwidth, model switches by the
weights' size, and shared train passes timed by ``TrainPassCost``. GPU-hours are counted three
ways: what the allocation held (``SimConfig.elastic``: engine pairs join and leave by
``daemon.elastic``'s rule, the daemon's; else every GPU throughout), what engines held while home
to a job or running a task, and what they were busy.

Invariants: every placement and order is the core's and every state move the policy's
(``plexctl.common.state_policy`` moves each trainer node's ``NodeTiers`` as ``worker.state.store``
moves the real tiers; a test holds the two to the same moves); the core hears of every move
through ``state_location`` and of each switch's cost through ``Scheduler.set_switch_estimate``;
evictions and demotions overlap the next task (counted, not charged); a pass runs as the worker
runs one (``worker/servers.py``, ``serve_pass``).

Not modelled: two sets of weights resident on one engine at once, gang scheduling of trainer
shards, interference beyond slots, dispatch overhead, failures, checkpoints. The model in full:
docs/state.md, "The simulator's model".
"""

from __future__ import annotations

import heapq
import json
import math
import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from daemon.core import PASS_WINDOW_S
from daemon.elastic import ElasticRule, Unit, decide
from daemon.policies import placement_policy
from daemon.scheduler import Engine, Placement, Scheduler, Task
from daemon.trace import GPUS_PER_SHARD, Trace, TraceJob
from plexctl.common import state_policy
from plexctl.common.cluster_config import DEFAULTS
from plexctl.common.memplan import JobShape, needed_trainer_width
from plexctl.common.model_shapes import known_shape
from plexctl.common.state_policy import DEVICE, HOST, NVME, STORAGE_TIERS, Held, Room, Tiers, Upcoming

GB = 1e9
ROLLOUT, TRAINER = "rollout", "trainer"
_ARRIVE, _DONE, _PHASE, _WAKE, _JOINED, _CHECK, _CHARGE = 0, 1, 2, 3, 4, 5, 6
BENCH_ROW_TOKENS = 28  # bench/train_batching.py's rows (10-30 tokens) padded to the longest: 26.6 of 8, 28.7 of 32
# A trace's model class -> the known shape (plexctl.common.model_shapes) whose plan gives its trainers'
# width when its jobs name no base of their own; a class not listed keeps gpus_per_engine (235B: an MoE
# the memory plan has no shape for).
CLASS_SHAPES = {
    "7B": "qwen2.5-7b",
    "14B": "qwen2.5-14b",
    "30B": "qwen2.5-32b",
    "32B": "qwen2.5-32b",
    "70B": "llama-3.1-70b",
}
PLANNED_LORA_RANK = 64  # a LoRA job's rank when the plan sizes a class's trainers (the trace draws 16-64)


class TrainPassCost(msgspec.Struct, frozen=True, kw_only=True):
    """What a shared train pass costs, from its steps' tokens: a step alone takes
    ``pass_s + job_s + token_s * tokens``; a pass of steps with tokens ``t_i`` (``T`` in all)
    takes ``pass_s + sum(job_s + token_s * t_i * max(1/2, 1 + crowding * (T - t_i)))``.

    ``pass_s`` is the work a pass does once whatever it holds (the forward and backward's
    launch, Python and per-op overhead): what grouping saves. ``job_s`` is what each step still
    does on its own (its adapter switched in, its loss, clipping and AdamW step). ``token_s`` is
    the base's matmuls over a step's rows; ``crowding`` (per token of the other steps in the
    pass) is how much slower they run beside more rows (activations that leave the caches), or,
    negative, faster (larger matmuls), never below half their time alone. The
    figures are seconds of ``bench/train_batching.py``'s tiny model on one CPU thread: the
    simulator uses their ratios, scaled to each step's seconds in the trace (``pass_seconds``).
    The defaults are ``fit`` of ``bench/results/train_batching.json`` (8 jobs of 8 and 32 rows):
    1.54x less time grouped at 8 rows, 1.23x at 32. What a GPU's figures would be is not measured.
    """

    pass_s: float = 5.66e-3
    job_s: float = 2.23e-3
    token_s: float = 2.93e-5
    crowding: float = -8.38e-6

    def alone_s(self, tokens: int) -> float:
        """A step of ``tokens`` alone, in the model's own seconds."""
        return self.pass_s + self.job_s + self.token_s * tokens

    def pass_seconds(self, steps: Sequence[tuple[float, int]]) -> float:
        """Seconds of one pass of ``steps``, each ``(seconds alone, tokens)``: each step's parts
        scaled to its seconds alone, the per-pass part paid once (the largest of the steps'),
        so that a pass of one step takes its seconds alone."""
        total = sum(t for _, t in steps)
        once, own = 0.0, 0.0
        for seconds, tokens in steps:
            scale = seconds / self.alone_s(tokens)
            once = max(once, scale * self.pass_s)
            beside = max(0.5, 1.0 + self.crowding * (total - tokens))
            own += scale * (self.job_s + self.token_s * tokens * beside)
        return once + own

    @classmethod
    def fit(
        cls, train_batching: str | Path | dict[str, Any], jobs: int = 8, row_tokens: float = BENCH_ROW_TOKENS
    ) -> TrainPassCost:
        """The model that reproduces ``bench/train_batching.py``'s result (a path or its loaded
        dict) at ``jobs`` jobs a pass, for its two smallest row counts: the alone figures give
        ``token_s`` and ``pass_s + job_s`` (a line through them), the grouped ones ``pass_s``
        and ``crowding`` (what a pass saves, less what it loses beside the others' tokens)."""
        data = json.loads(Path(train_batching).read_text()) if not isinstance(train_batching, dict) else train_batching
        by_rows = {r["rows"]: r for r in data["results"] if r["jobs"] == jobs}
        if len(by_rows) < 2:
            raise ValueError(f"the result holds {len(by_rows)} row count(s) at {jobs} jobs: the fit needs two")
        small, large = (by_rows[r] for r in sorted(by_rows)[:2])
        t1, t2 = small["rows"] * row_tokens, large["rows"] * row_tokens
        a1, a2 = small["alone_s_per_job_step"], large["alone_s_per_job_step"]
        d1, d2 = a1 - small["grouped_s_per_job_step"], a2 - large["grouped_s_per_job_step"]
        token_s = (a2 - a1) / (t2 - t1)
        fixed = a1 - token_s * t1
        # a job-step saves pass_s * (1 - 1/n) and loses token_s * t * crowding * (n - 1) * t
        crowding = (d1 - d2) / (token_s * (jobs - 1) * (t2 * t2 - t1 * t1))
        pass_s = (d1 + crowding * token_s * (jobs - 1) * t1 * t1) / (1 - 1 / jobs)
        pass_s = min(max(0.0, pass_s), fixed)
        return cls(pass_s=pass_s, job_s=fixed - pass_s, token_s=token_s, crowding=crowding)


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    gpus_per_engine: int = 8
    # trainer engines of the memory plan's width per model class (``planned_trainer_gpus``), at most
    # gpus_per_engine; off: every engine has gpus_per_engine GPUs (the benchmark's figures)
    planned_trainer_widths: bool = False
    trainer_gpu_gb: float = 80.0  # memory of one trainer GPU, for the plan's width
    rollout_slots: int = 4  # concurrent generate chunks per rollout engine = chunks per shard and turn
    macro_steps: int = 8  # at most this many simulated steps per job (coarsening)
    device_slots: int = DEFAULTS.device_slots  # shard states resident on one trainer's device
    device_state_gb: float = 320.0  # and at most this many GB of them
    host_gb: float = 1000.0  # pinned host memory for states, per trainer node
    nvme_gb: float = 15000.0  # node-local NVMe for states, per trainer node
    h2d_gbps: float = 25.0  # pinned host <-> device, as a swap benchmark measures on a PCIe GPU node
    nvme_gbps: float = 5.0  # NVMe sequential
    switch_s: float = 2.0  # fixed part of a model switch: waking a sleeping engine, its KV cache made again
    max_group: int = 16  # the core's bound on calls for the weights an engine holds in a row (Scheduler)
    train_grouping: bool = DEFAULTS.train_grouping  # shared train passes of several LoRA jobs' steps
    group_window_s: float = PASS_WINDOW_S  # a trainer waits at most this long for more steps to share a pass
    train_tokens: int = 224  # padded tokens of one LoRA train step: 8 rows of 28, the benchmark's small job
    pass_tokens: int = 0  # a trainer's micro-batch budget, the tokens one pass holds (0: the core's default)
    train_cost: TrainPassCost = TrainPassCost()
    # an elastic allocation (``daemon.elastic``'s rule, per model class, in engine pairs): the base
    # allocation holds ``base_pairs`` of each class, the rest join when jobs wait and leave when idle
    elastic: bool = False
    base_pairs: int = 1
    grow_after_s: float = DEFAULTS.grow_after
    shrink_after_s: float = DEFAULTS.shrink_after
    join_wait_s: float = 600.0  # Slurm's queue wait for a joining allocation (charged from its end)
    engine_start_s: float = 300.0  # from the joined nodes' start to their engines taking work


class AllocationStats(msgspec.Struct, kw_only=True):
    """What the allocation held: GPU-hours charged by nodes held (as Slurm charges), and its changes."""

    gpu_hours: float = 0.0
    joins: int = 0  # engine pairs joined
    releases: int = 0  # engine pairs given back
    peak_gpus: int = 0


class SwapStats(msgspec.Struct, kw_only=True):
    swap_ins: int = 0
    seconds: float = 0.0  # charged to trainer tasks
    bytes: dict[str, int] = msgspec.field(default_factory=dict)  # direction -> bytes

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


class SwitchStats(msgspec.Struct, kw_only=True):
    """Model switches on the engines: weights loaded because the engine held others."""

    count: dict[str, int] = msgspec.field(default_factory=dict)  # kind -> switches
    seconds: dict[str, float] = msgspec.field(default_factory=dict)  # kind -> seconds charged (waits included)
    bytes: dict[str, int] = msgspec.field(default_factory=dict)  # kind -> bytes loaded

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def add(self, kind: str, nbytes: int, seconds: float, load: bool) -> None:
        if load:
            self.count[kind] = self.count.get(kind, 0) + 1
            self.bytes[kind] = self.bytes.get(kind, 0) + nbytes
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds


SWITCH_KINDS = ("rollout base", "rollout full weights", "trainer base")


class PassStats(msgspec.Struct, kw_only=True):
    """Shared train passes run (chunks of two steps or more, as the worker runs them)."""

    passes: int = 0
    steps: int = 0  # train steps in them
    largest: int = 0
    saved_s: float = 0.0  # trainer seconds their steps would have taken alone, less what the passes took


class JobOutcome(msgspec.Struct, array_like=True):
    job_id: str
    arrival_s: float
    admitted_s: float
    finished_s: float
    steps: int


class SimResult(msgspec.Struct, kw_only=True):
    policy: str
    jobs_per_engine: int
    max_switches: int
    gpus: int
    engines: int
    pools: dict[str, int]  # model class -> engine pairs
    jobs: int
    steps: int  # real training steps run
    makespan_s: float  # first arrival to last finish
    gpu_hours: float  # held
    busy_gpu_hours: float
    gpu_hours_per_step: float
    bubble_ratio: float  # idle share of held GPU time
    queue_p50_s: float
    queue_p99_s: float
    queue_mean_s: float
    swaps: SwapStats
    ticks: int
    tick_p50_us: float
    tick_p99_us: float
    tick_p999_us: float
    tick_max_us: float  # on a shared machine, dominated by the OS descheduling the process
    tasks: int
    wall_s: float
    engine_busy_s: dict[str, float]  # slot-weighted busy seconds per engine
    outcomes: list[JobOutcome]
    intervals: list[tuple[str, str, float, float]] = []  # (engine, job, start, end) when recorded
    switches: SwitchStats = msgspec.field(default_factory=SwitchStats)
    train_grouping: bool = DEFAULTS.train_grouping
    trainer_busy_s: float = 0.0  # busy seconds of the trainer engines (swap-ins included)
    passes: PassStats = msgspec.field(default_factory=PassStats)
    allocation: AllocationStats = msgspec.field(default_factory=AllocationStats)

    @property
    def allocation_gpu_hours_per_step(self) -> float:
        return self.allocation.gpu_hours / self.steps if self.steps else 0.0

    def summary(self) -> dict[str, Any]:
        """The headline numbers, without per-engine and per-job detail."""
        out = msgspec.to_builtins(self)
        for k in ("engine_busy_s", "outcomes", "intervals"):
            out.pop(k)
        out["swap_bytes"] = self.swaps.total_bytes
        return out


@dataclass(eq=False)
class _Shard:
    core_id: str
    job: "_Job"
    state_bytes: int
    rollout: str = ""
    trainer: str = ""  # home trainer as last seen (moves with a trainer backfill)
    node: str | None = None  # the trainer engine whose node holds its state (None: no state yet)
    ready_at: float = 0.0  # a host copy being prefetched is complete at


@dataclass(eq=False)
class _Job:
    tj: TraceJob
    rng: random.Random
    plan: list[int]  # real steps per simulated step
    shards: list[_Shard] = field(default_factory=list)
    step: int = 0
    turn: int = 0
    outstanding: int = 0
    admitted_at: float = -1.0
    finished_at: float = -1.0


@dataclass(eq=False)
class _Pair:
    """A rollout + trainer engine pair of one model class: the elastic allocation's unit."""

    model: str
    engines: tuple[Engine, Engine]  # rollout, trainer
    base: bool = False  # in the base allocation: never released
    ready: bool = False  # up (its engines take work)
    idle_since: float | None = None
    gpus: int = 0


class TierFullError(RuntimeError):
    """A simulated trainer node has no tier left for a state leaving its device."""


@dataclass(frozen=True)
class SwapIn:
    """What one ``NodeTiers.swap_in`` moved: where the state came from (None: made fresh;
    ``device``: it was resident), the states evicted with their new tier, in order, and the
    host copies demoted to nvme (before the eviction that needed their room)."""

    source: str | None
    evicted: tuple[tuple[str, str], ...] = ()
    demoted: tuple[str, ...] = ()


class NodeTiers:
    """One trainer node's state tiers (the device, then ``budgets``' storage tiers in
    ``state_policy.TIER_ORDER``), moved as ``worker.state.store`` moves them: every decision is
    ``plexctl.common.state_policy``'s. Copies move at once; what a move costs is the caller's to
    charge. ``budgets``: bytes per storage tier (None: the node has none of it)."""

    def __init__(self, device_slots: int, device_bytes: int | None, budgets: Mapping[str, int | None]) -> None:
        self.device_slots, self.device_bytes = device_slots, device_bytes
        self.budgets = {name: budgets[name] for name in state_policy.tier_order(budgets)}
        self.tier: dict[str, str] = {}  # job -> its tier
        self.nbytes: dict[str, int] = {}
        self.last_used: dict[str, int] = {}
        self.used = dict.fromkeys([DEVICE, *self.budgets], 0)
        self._tick = 0

    def where(self, job_id: str) -> str | None:
        return self.tier.get(job_id)

    def swap_in(self, job_id: str, nbytes: int, expected: Callable[[], Sequence[str]]) -> SwapIn:
        """Make ``job_id``'s state (``nbytes``) resident, evicting as the policy says;
        ``expected()``, the jobs in the order they will next need this trainer, is asked for
        once, if a job must leave the device."""
        source = self.tier.get(job_id)
        if source == DEVICE:
            self._touch(job_id)
            return SwapIn(DEVICE)
        credit = {source: self.nbytes[job_id]} if source == STORAGE_TIERS[0] else {}  # its buffer is reused
        evicted: list[tuple[str, str]] = []
        demoted: list[str] = []
        upcoming: Upcoming | None = None
        while True:
            resident = [self._held(j) for j, t in self.tier.items() if t == DEVICE]
            if not state_policy.needs_room(resident, nbytes, self.device_slots, self.device_bytes):
                break
            upcoming = upcoming or Upcoming(expected())
            victim = state_policy.victim(resident, upcoming)
            tiers = self._tiers()
            placement = state_policy.place(victim, tiers, self._copies(job_id), upcoming, credit)
            if placement is None:
                used = ", ".join(f"{name} {self.used[name]}/{budget}" for name, budget in self.budgets.items())
                raise TierFullError(f"no tier takes {victim.job_id}'s state ({victim.nbytes} bytes): {used} bytes used")
            self._demote(placement, tiers)
            self._move(victim.job_id, placement.tier)
            evicted.append((victim.job_id, placement.tier))
            demoted += placement.demote
            credit = {}
        if source is None:
            self.nbytes[job_id] = nbytes
            self.tier[job_id] = DEVICE
            self.used[DEVICE] += nbytes
        else:
            self._move(job_id, DEVICE)
        self._touch(job_id)
        return SwapIn(source, tuple(evicted), tuple(demoted))

    def prefetch(self, job_id: str, expected: Sequence[str]) -> tuple[str, ...] | None:
        """Bring a state below the first storage tier up to it if the policy lets it; the copies
        demoted to make room, or None if it stays where it is."""
        if self.tier.get(job_id) not in list(self.budgets)[1:]:
            return None
        tiers = self._tiers()
        placement = state_policy.prefetch_placement(self._held(job_id), tiers, self._copies(job_id), Upcoming(expected))
        if placement is None:
            return None
        self._demote(placement, tiers)
        self._move(job_id, placement.tier)
        return placement.demote

    def drop(self, job_id: str) -> None:
        """Forget the job's state (its job ended)."""
        tier = self.tier.pop(job_id, None)
        if tier is not None:
            self.used[tier] -= self.nbytes.pop(job_id)
            self.last_used.pop(job_id, None)

    def above(self, tier: str) -> str:
        """The tier whose copies are demoted to ``tier``."""
        names = list(self.budgets)
        return names[names.index(tier) - 1]

    def _demote(self, placement: state_policy.Placement, tiers: Tiers) -> None:
        below = tiers.below(placement.tier)
        for job in placement.demote:
            assert below is not None  # the policy demotes only where a tier lies below
            self._move(job, below.name)

    def _move(self, job_id: str, tier: str) -> None:
        nbytes = self.nbytes[job_id]
        self.used[self.tier[job_id]] -= nbytes
        self.used[tier] += nbytes
        self.tier[job_id] = tier

    def _touch(self, job_id: str) -> None:
        self._tick += 1
        self.last_used[job_id] = self._tick

    def _held(self, job_id: str) -> Held:
        return Held(job_id, self.nbytes[job_id], self.last_used.get(job_id, 0))

    def _copies(self, beside: str) -> dict[str, list[Held]]:
        copies: dict[str, list[Held]] = {name: [] for name in self.budgets}
        for j, t in self.tier.items():
            if t != DEVICE and j != beside:
                copies[t].append(self._held(j))
        return copies

    def _tiers(self) -> Tiers:
        return Tiers(tuple(Room(name, budget, self.used[name]) for name, budget in self.budgets.items()))


def partition(trace: Trace, gpus: int) -> dict[str, int]:
    """Engine pairs per model class: proportional to isolated GPU-time, at least the largest job."""
    pairs = gpus // GPUS_PER_SHARD
    demand: dict[str, float] = {}
    need: dict[str, int] = {}
    for j in trace.jobs:
        demand[j.model] = demand.get(j.model, 0.0) + j.isolated_gpu_s
        need[j.model] = max(need.get(j.model, 0), j.shards)
    if sum(need.values()) > pairs:
        raise ValueError(
            f"{gpus} GPUs ({pairs} engine pairs) cannot hold the largest job of every model class at once ({need})"
        )
    total = sum(demand.values()) or 1.0
    share = {m: max(need[m], pairs * demand[m] / total) for m in demand}
    alloc = {m: max(need[m], int(share[m])) for m in demand}
    while sum(alloc.values()) > pairs:  # the minimums pushed it over: take from the largest surplus
        m = max(alloc, key=lambda k: alloc[k] - need[k])
        alloc[m] -= 1
    for m in sorted(demand, key=lambda k: share[k] - int(share[k]), reverse=True):
        if sum(alloc.values()) >= pairs:
            break
        alloc[m] += 1
    while sum(alloc.values()) < pairs:
        alloc[max(alloc, key=lambda k: share[k] - alloc[k])] += 1
    return alloc


def planned_trainer_gpus(trace: Trace, cfg: SimConfig) -> dict[str, int]:
    """GPUs of each model class's trainer engines: the width the memory plan gives its widest job's
    step (``memplan.needed_trainer_width``, the smallest of 1, 2, 4, ... whose per-rank step fits
    one GPU, as ``memplan.trainer_width`` picks; a full fine-tune, else a LoRA job of
    ``PLANNED_LORA_RANK``) on ``trainer_gpu_gb`` GPUs with the cluster's defaults, at most
    ``gpus_per_engine`` (also where no width fits). The shape is each job's base where it names a
    known one, else ``CLASS_SHAPES``'s, else the class keeps ``gpus_per_engine``."""
    gpus: dict[str, int] = {}
    for tj in trace.jobs:
        config = known_shape(tj.base) if tj.base else None
        config = config or (known_shape(CLASS_SHAPES[tj.model]) if tj.model in CLASS_SHAPES else None)
        if config is None:
            gpus[tj.model] = cfg.gpus_per_engine
            continue
        job = (
            JobShape(tj.job_id, 0, 0, target_modules=(), full=True)
            if tj.full_weights
            else JobShape(tj.job_id, PLANNED_LORA_RANK, 0)
        )
        width = needed_trainer_width(config, job, "bfloat16", int(cfg.trainer_gpu_gb * (1 << 30)))
        gpus[tj.model] = max(gpus.get(tj.model, 1), min(width or cfg.gpus_per_engine, cfg.gpus_per_engine))
    return gpus


def _step_plan(steps: int, macro: int) -> list[int]:
    n = max(1, min(steps, macro))
    base, extra = divmod(steps, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def _quantile(sorted_xs: list[float], q: float) -> float:
    if not sorted_xs:
        return 0.0
    return sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))]


class Simulation:
    """One replay; ``simulate`` is the entry point."""

    def __init__(
        self,
        trace: Trace,
        policy: str,
        gpus: int,
        jobs_per_engine: int = 4,
        max_switches: int = 4,
        config: SimConfig | None = None,
        record_intervals: bool = False,
    ) -> None:
        self.placement = placement = placement_policy(policy)  # ValueError for an unknown name
        self.cfg = cfg = config or SimConfig()
        self.trace, self.policy, self.gpus = trace, policy, gpus
        self.jpe, self.max_switches = jobs_per_engine, max_switches
        if cfg.train_grouping and cfg.train_tokens < 1:
            raise ValueError(f"train_tokens must be >= 1 with train grouping, not {cfg.train_tokens}")
        window = cfg.group_window_s if cfg.train_grouping else None
        self.sched = Scheduler(policy, jobs_per_engine, max_switches, cfg.max_group, window)
        self.record = record_intervals
        self.pools = partition(trace, gpus)
        trainer_gpus = planned_trainer_gpus(trace, cfg) if cfg.planned_trainer_widths else {}
        self.engine_gpus: dict[str, int] = {}  # engine -> its GPUs
        self.elastic = cfg.elastic and not placement.dedicates_engines()  # isolated jobs are allocations of their own
        self.pairs_up: dict[str, list[_Pair]] = {m: [] for m in self.pools}  # model -> its pairs up or joining
        self.pairs_down: dict[str, list[_Pair]] = {m: [] for m in self.pools}  # model -> pairs not held, next first
        self.pair_of: dict[str, _Pair] = {}  # engine -> its pair
        self.alloc = AllocationStats()
        self.alloc_held = 0  # GPUs the allocation holds now (elastic)
        self.alloc_s = 0.0
        self.alloc_since = 0.0
        self.checks: set[tuple[str, float]] = set()
        state_cap = int(max(cfg.host_gb, cfg.nvme_gb) * GB)
        self.nodes: dict[str, NodeTiers] = {}
        self._read_gbps = {HOST: cfg.h2d_gbps, NVME: cfg.nvme_gbps}  # a storage tier's copy up to the device
        for model, pairs in self.pools.items():
            for i in range(pairs):
                w = f"{model}/n{i}"
                rollout = Engine(f"{w}/r", w, ROLLOUT, model, cfg.rollout_slots)
                trainer = Engine(f"{w}/t", f"{w}t", TRAINER, model, 1, state_cap, pass_tokens=cfg.pass_tokens)
                pair = _Pair(model, (rollout, trainer), base=i < max(1, cfg.base_pairs))
                self.pair_of[rollout.engine_id] = self.pair_of[trainer.engine_id] = pair
                if self.elastic and not pair.base:
                    self.pairs_down[model].append(pair)
                else:
                    pair.ready = True
                    self.pairs_up[model].append(pair)
                    for engine in pair.engines:
                        self.sched.engine_up(engine, now=0.0)
                self.engine_gpus[f"{w}/r"] = cfg.gpus_per_engine
                self.engine_gpus[f"{w}/t"] = trainer_gpus.get(model, cfg.gpus_per_engine)
                self.nodes[f"{w}/t"] = NodeTiers(
                    cfg.device_slots,
                    int(cfg.device_state_gb * GB),
                    {HOST: int(cfg.host_gb * GB), NVME: int(cfg.nvme_gb * GB)},
                )
        self.limit = 1 if placement.dedicates_engines() else jobs_per_engine
        self.slots_free = {m: len(p) * self.limit for m, p in self.pairs_up.items()}  # tenant slots per kind
        for pair in self.pair_of.values():
            pair.gpus = sum(self.engine_gpus[e.engine_id] for e in pair.engines)
        self._charge(sum(p.gpus for ps in self.pairs_up.values() for p in ps), min(j.arrival_s for j in trace.jobs))
        self.rules = {
            m: ElasticRule(
                min_units=len(self.pairs_up[m]),
                max_units=pairs,
                grow_after_s=cfg.grow_after_s,
                shrink_after_s=cfg.shrink_after_s,
            )
            for m, pairs in self.pools.items()
        }
        self.waiting: dict[str, deque[_Job]] = {m: deque() for m in self.pools}
        self.shard_of: dict[str, _Shard] = {}
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.tid = 0
        self.tasks: dict[int, tuple[_Shard, str, float, float]] = {}  # running task -> shard, engine, start, switch s
        self.durations: dict[int, float] = {}  # queued task -> seconds of work (swap excluded)
        self.refs: dict[str, int] = {}  # engine -> shards homed + tasks running
        self.held = 0  # GPUs of the engines with a shard homed or a task running
        self.held_s = 0.0
        self.held_since = 0.0
        self.busy: dict[str, float] = dict.fromkeys(self.engine_gpus, 0.0)
        self.swaps = SwapStats()
        self.switches = SwitchStats()
        self.loaded: dict[str, str] = {}  # engine -> the weights it holds (a base, or a full fine-tuning job's)
        self.loaded_at: dict[str, float] = {}  # engine -> when those weights are in place
        self.latencies: list[float] = []
        self.intervals: list[tuple[str, str, float, float]] = []
        self.outcomes: list[JobOutcome] = []
        self.passes = PassStats()
        self.wakes: set[float] = set()  # when a trainer waiting for a pass's steps is looked at again
        self.n_tasks = 0
        self.jobs = []
        for tj in trace.jobs:
            if tj.model not in self.pools:
                raise ValueError(f"{tj.job_id}: no engines for model {tj.model!r}")
            job = _Job(tj, random.Random(tj.seed), _step_plan(tj.steps, cfg.macro_steps))
            per_shard = tj.state_bytes // tj.shards if tj.full_weights else tj.state_bytes
            job.shards = [_Shard(f"{tj.job_id}#{i}", job, per_shard) for i in range(tj.shards)]
            self.jobs.append(job)
            self._push(tj.arrival_s, _ARRIVE, job)

    # -- the event loop

    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        heap, sched, latencies = self.heap, self.sched, self.latencies
        perf = time.perf_counter
        now = 0.0
        while heap:
            now = heap[0][0]
            while heap and heap[0][0] == now:
                _, _, kind, what = heapq.heappop(heap)
                if kind == _DONE:
                    self._done(what, now)
                elif kind == _PHASE:
                    self._next_phase(what, now)
                elif kind == _WAKE:
                    self.wakes.discard(now)
                elif kind == _JOINED:
                    self._joined(what, now)
                elif kind == _CHECK:
                    self.checks.discard((what, now))
                    self._scale(what, now)
                elif kind == _CHARGE:
                    self._charge(what, now)
                else:
                    self._arrive(what, now)
            t0 = perf()
            placements = sched.tick(now)
            latencies.append(perf() - t0)
            self._start_all(placements, now)
            wake = sched.next_wake()
            if wake is not None and wake > now and wake not in self.wakes:
                self.wakes.add(wake)
                self._push(wake, _WAKE, None)
        return self._result(time.perf_counter() - wall0)

    def _push(self, at: float, kind: int, what: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (at, self.seq, kind, what))

    # -- admission

    def _arrive(self, job: _Job, now: float) -> None:
        self.waiting[job.tj.model].append(job)
        self._admit(job.tj.model, now)
        self._scale(job.tj.model, now)

    def _admit(self, model: str, now: float) -> None:
        queue = self.waiting[model]
        while queue and queue[0].tj.shards <= self.slots_free[model]:
            job = queue.popleft()
            tj = job.tj
            self.slots_free[model] -= tj.shards
            for shard in job.shards:
                a = self.sched.admit(shard.core_id, model, now, shard.state_bytes, tj.priority, tj.user)
                if not a.ok:  # the slot count above says it fits: the core disagrees
                    raise RuntimeError(f"admission of {shard.core_id} refused with free slots: {a.reason}")
                shard.rollout, shard.trainer = a.rollout or "", a.trainer or ""
                self.shard_of[shard.core_id] = shard
                self._hold(shard.rollout, +1, now)
                self._hold(shard.trainer, +1, now)
            job.admitted_at = now
            self._submit_rollout(job, now)

    def _hold(self, engine_id: str, delta: int, now: float) -> None:
        """Count a home or a running task on an engine; it is held while it has either."""
        before = self.refs.get(engine_id, 0)
        after = self.refs[engine_id] = before + delta
        if (before == 0) != (after == 0):
            self.held_s += self.held * (now - self.held_since)
            self.held_since = now
            self.held += self.engine_gpus[engine_id] if after else -self.engine_gpus[engine_id]
            if self.elastic:
                pair = self.pair_of[engine_id]
                idle = all(self.refs.get(e.engine_id, 0) == 0 for e in pair.engines)
                pair.idle_since = now if idle else None
                if idle and not pair.base:
                    self._check_at(pair.model, now + self.cfg.shrink_after_s)

    # -- the elastic allocation (daemon.elastic's rule, per model class, in engine pairs)

    def _charge(self, gpus: int, now: float) -> None:
        """The allocation holds ``gpus`` more (fewer, negative) GPUs from ``now``."""
        self.alloc_s += self.alloc_held * (now - self.alloc_since)
        self.alloc_since = now
        self.alloc_held += gpus
        self.alloc.peak_gpus = max(self.alloc.peak_gpus, self.alloc_held)

    def _check_at(self, model: str, at: float) -> None:
        if (model, at) not in self.checks:
            self.checks.add((model, at))
            self._push(at, _CHECK, model)

    def _scale(self, model: str, now: float) -> None:
        """Ask the rule what the class's pairs should do now, and do it."""
        if not self.elastic:
            return
        queue, pairs = self.waiting[model], self.pairs_up[model]
        wanted = -(-(queue[0].tj.shards - self.slots_free[model]) // self.limit) if queue else 0
        units = [Unit(unit_id=str(i), ready=p.ready, idle_since=p.idle_since, base=p.base) for i, p in enumerate(pairs)]
        d = decide(self.rules[model], now, queue[0].tj.arrival_s if queue else None, wanted, units)
        for pair in [pairs[int(i)] for i in d.release]:
            self._release(pair, now)
        for _ in range(min(d.grow, len(self.pairs_down[model]))):
            pair = self.pairs_down[model].pop(0)
            pairs.append(pair)
            self.alloc.joins += 1
            self._push(now + self.cfg.join_wait_s, _CHARGE, pair.gpus)
            self._push(now + self.cfg.join_wait_s + self.cfg.engine_start_s, _JOINED, pair)
        if d.recheck_at is not None:
            self._check_at(model, d.recheck_at)

    def _joined(self, pair: _Pair, now: float) -> None:
        pair.ready, pair.idle_since = True, now
        for engine in pair.engines:
            self.sched.engine_up(engine, now=now)
        self.slots_free[pair.model] += self.limit
        self._admit(pair.model, now)
        self._scale(pair.model, now)

    def _release(self, pair: _Pair, now: float) -> None:
        for engine in pair.engines:
            left = self.sched.engine_down(engine.engine_id)
            if left or self.nodes[pair.engines[1].engine_id].tier:
                raise RuntimeError(f"{engine.engine_id} released while it holds work or state")
        self.pairs_up[pair.model].remove(pair)
        self.pairs_down[pair.model].insert(0, pair)
        pair.ready, pair.idle_since = False, None
        self.slots_free[pair.model] -= self.limit
        self.alloc.releases += 1
        self._charge(-pair.gpus, now)

    # -- a job's phases

    def _noise(self, job: _Job) -> float:
        sigma = job.tj.jitter
        return math.exp(job.rng.gauss(-sigma * sigma / 2, sigma)) if sigma > 0 else 1.0

    def _submit_rollout(self, job: _Job, now: float) -> None:
        tj, slots = job.tj, self.cfg.rollout_slots
        longest = tj.generate_s / tj.turns * job.plan[job.step]
        # the other chunks are shorter, so that the mean chunk is tail_share of the longest
        rest = (slots * tj.tail_share - 1) / (slots - 1) if slots > 1 else 1.0
        rest = min(1.0, max(0.0, rest))
        for shard in job.shards:
            d = longest * self._noise(job)
            for c in range(slots):
                self._submit(shard, ROLLOUT, "generate", d if c == 0 else d * rest, now)
        job.outstanding = slots * len(job.shards)

    def _submit_train(self, job: _Job, now: float) -> None:
        seconds = job.tj.train_s * job.plan[job.step]
        for shard in job.shards:
            self._submit(shard, TRAINER, "train_step", seconds * self._noise(job), now)
        job.outstanding = len(job.shards)

    def _submit(self, shard: _Shard, kind: str, method: str, seconds: float, now: float) -> None:
        self.tid += 1
        self.durations[self.tid] = seconds
        tj = shard.job.tj
        weights = self._weights(tj, kind)
        if weights and weights not in self.sched.switch_estimates:  # the core knows what a switch costs
            self.sched.set_switch_estimate(weights, self._load_seconds(tj))
        shares = kind == TRAINER and self.cfg.train_grouping and not tj.full_weights
        tokens = self.cfg.train_tokens if shares else 0
        self.sched.submit(Task(self.tid, shard.core_id, kind, method, tj.model, now, tj.priority, weights, tokens))

    def _weights(self, tj: TraceJob, kind: str) -> str:
        """What an engine must hold for a task of this job: for rollouts its base, or a full
        fine-tuning job's own weights; for a LoRA job's training its base ("": not modelled; with
        train grouping always named, for a pass holds one base's steps)."""
        if kind == TRAINER and tj.full_weights:
            return ""
        if not tj.weights_bytes:
            return (tj.base or tj.model) if kind == TRAINER and self.cfg.train_grouping else ""
        return tj.job_id if kind != TRAINER and tj.full_weights else (tj.base or tj.model)

    def _load_seconds(self, tj: TraceJob) -> float:
        """A switch to this job's weights: the wake, then the weights from pinned host memory
        (none: weights of no size are not switched)."""
        cfg = self.cfg
        if not tj.weights_bytes:
            return 0.0
        return cfg.switch_s + tj.weights_bytes / (cfg.gpus_per_engine * cfg.h2d_gbps * GB)

    def _done(self, task_id: int, now: float) -> None:
        shard, engine_id, started, switched = self.tasks.pop(task_id)
        self.sched.done(task_id, now, now - started - switched, switch_seconds=switched)
        self._hold(engine_id, -1, now)
        job = shard.job
        job.outstanding -= 1
        if job.outstanding:
            return
        tj = job.tj
        if job.turn >= 0:  # a rollout turn ended: stall, then the next turn or training
            last = job.turn == tj.turns - 1
            stall = (tj.reward_s if last else tj.tool_s / max(1, tj.turns - 1)) * job.plan[job.step]
            job.turn = -1 if last else job.turn + 1  # -1: training next
            if stall > 0:
                self._push(now + stall * self._noise(job), _PHASE, job)
            else:
                self._next_phase(job, now)
            return
        job.step += 1  # a training phase ended
        job.turn = 0
        if job.step < len(job.plan):
            self._submit_rollout(job, now)
        else:
            self._finish(job, now)

    def _next_phase(self, job: _Job, now: float) -> None:
        if job.turn < 0:
            self._submit_train(job, now)
        else:
            self._submit_rollout(job, now)

    def _finish(self, job: _Job, now: float) -> None:
        job.finished_at = now
        model = job.tj.model
        for shard in job.shards:
            self.sched.release(shard.core_id)
            self._hold(shard.rollout, -1, now)
            self._hold(shard.trainer, -1, now)
            self._drop_state(shard)
            del self.shard_of[shard.core_id]
        self.slots_free[model] += job.tj.shards
        self.outcomes.append(JobOutcome(job.tj.job_id, job.tj.arrival_s, job.admitted_at, now, sum(job.plan)))
        self._admit(model, now)
        self._scale(model, now)

    # -- starting a task, with its swap

    def _start_all(self, placements: list[Placement], now: float) -> None:
        """Start the tick's placements in order; a shared pass's steps start with its lead."""
        members: dict[int, list[Task]] = {}
        for p in placements:
            if p.lead:
                members.setdefault(p.lead, []).append(p.task)
        for p in placements:
            if p.lead:
                continue
            if p.task.task_id in members:
                self._start_pass([p.task, *members[p.task.task_id]], p.engine_id, now)
            else:
                self._start(p.task, p.engine_id, now)

    def _start(self, task: Task, engine_id: str, now: float) -> None:
        shard = self.shard_of[task.job_id]
        seconds = self.durations.pop(task.task_id)
        took, switched = seconds, 0.0
        if task.kind == TRAINER:
            if engine_id != shard.trainer:  # a trainer backfill moved its home
                self._hold(shard.trainer, -1, now)
                self._hold(engine_id, +1, now)
                shard.trainer = engine_id
            took += self._swap_in(shard, engine_id, now)
            self._prefetch(engine_id, now)
            self.busy[engine_id] += took
            if not shard.job.tj.full_weights:
                switched = self._switch(engine_id, shard.job.tj, "trainer base", now)
        else:
            self.busy[engine_id] += took / self.cfg.rollout_slots
            full = shard.job.tj.full_weights
            switched = self._switch(engine_id, shard.job.tj, "rollout full weights" if full else "rollout base", now)
        took += switched
        self.tasks[task.task_id] = (shard, engine_id, now, switched)
        self._hold(engine_id, +1, now)
        self.n_tasks += 1
        if self.record:
            self.intervals.append((engine_id, shard.job.tj.job_id, now, now + took))
        self._push(now + took, _DONE, task.task_id)

    def _start_pass(self, tasks: list[Task], engine_id: str, now: float) -> None:
        """Start a shared pass (``tasks``, its lead first) as the worker runs one: after the
        lead's base is in place, in chunks of at most ``device_slots`` steps, one after another;
        a chunk's states are made resident together (none evicts another), then its steps run
        for ``TrainPassCost.pass_seconds`` and end together. Each step reports its chunk's
        seconds, the lead also the switch."""
        cfg, work = self.cfg, self.durations
        shards = [self.shard_of[t.job_id] for t in tasks]
        for shard in shards:
            if engine_id != shard.trainer:  # a trainer backfill moved its home
                self._hold(shard.trainer, -1, now)
                self._hold(engine_id, +1, now)
                shard.trainer = engine_id
        lead_tj = shards[0].job.tj
        switched = self._switch(engine_id, lead_tj, "trainer base", now) if not lead_tj.full_weights else 0.0
        at, size = now + switched, max(1, cfg.device_slots)
        for i in range(0, len(tasks), size):
            chunk, chunk_shards = tasks[i : i + size], shards[i : i + size]
            first = [s.core_id for s in chunk_shards]
            swap = sum(self._swap_in(s, engine_id, now, first) for s in chunk_shards)
            alone = [(work.pop(t.task_id), cfg.train_tokens) for t in chunk]
            seconds = cfg.train_cost.pass_seconds(alone)
            if len(chunk) > 1:
                self.passes.passes += 1
                self.passes.steps += len(chunk)
                self.passes.largest = max(self.passes.largest, len(chunk))
                self.passes.saved_s += sum(s for s, _ in alone) - seconds
            self.busy[engine_id] += swap + seconds
            end = at + swap + seconds
            for task, shard in zip(chunk, chunk_shards):
                lead = task is tasks[0]
                self.tasks[task.task_id] = (shard, engine_id, now if lead else at, switched if lead else 0.0)
                self._hold(engine_id, +1, now)
                self.n_tasks += 1
                if self.record:
                    self.intervals.append((engine_id, shard.job.tj.job_id, at, end))
                self._push(end, _DONE, task.task_id)
            at = end
        self._prefetch(engine_id, now)

    def _switch(self, engine_id: str, tj: TraceJob, kind: str, now: float) -> float:
        """Seconds before the task's weights are in place on the engine: the rest of a load under
        way, or a load of its base (a full fine-tuning job's rollouts: of its own weights)."""
        if not tj.weights_bytes:
            return 0.0
        wanted = tj.job_id if kind == "rollout full weights" else (tj.base or tj.model)
        if self.loaded.get(engine_id) == wanted:
            wait = max(0.0, self.loaded_at[engine_id] - now)
            if wait:
                self.switches.add(kind, 0, wait, load=False)
            return wait
        seconds = self._load_seconds(tj)
        self.loaded[engine_id], self.loaded_at[engine_id] = wanted, now + seconds
        self.switches.add(kind, tj.weights_bytes, seconds, load=True)
        return seconds

    def _count(self, direction: str, nbytes: int) -> None:
        self.swaps.bytes[direction] = self.swaps.bytes.get(direction, 0) + nbytes

    def _swap_in(self, shard: _Shard, engine_id: str, now: float, first: Sequence[str] = ()) -> float:
        """Make the shard's state resident on this trainer's device; the seconds it costs.
        ``first``: the jobs that need the device before any other (a shared pass's chunk).
        Evictions and demotions are copies that overlap the next task: counted, not charged."""
        if shard.node is not None and shard.node != engine_id:  # the core keeps a trainer task where its state is
            raise RuntimeError(f"{shard.core_id}: trainer task placed on {engine_id}, its state is on {shard.node}")
        n = shard.state_bytes

        def expected() -> list[str]:
            order = self.sched.expected(engine_id, now)
            return [*first, *(j for j in order if j not in first)] if first else order

        node = self.nodes[engine_id]
        moved = node.swap_in(shard.core_id, n, expected)
        for core_id in moved.demoted:
            self._demoted(node, core_id, engine_id)
        for core_id, tier in moved.evicted:
            victim = self.shard_of[core_id]
            victim.ready_at = 0.0
            self._count(f"{DEVICE}->{tier}", victim.state_bytes)
            self.sched.state_location(core_id, engine_id, tier)
        shard.node = engine_id
        seconds = 0.0
        if moved.source in STORAGE_TIERS:
            waited = (
                max(0.0, shard.ready_at - now) if moved.source == STORAGE_TIERS[0] else 0.0
            )  # a prefetch lands there
            seconds = waited + n / (self._read_gbps[moved.source] * GB)
            self._count(f"{moved.source}->{DEVICE}", n)
            self.swaps.swap_ins += 1
            self.swaps.seconds += seconds
        return seconds

    def _demoted(self, node: NodeTiers, core_id: str, engine_id: str) -> None:
        """Count a copy demoted one tier down, and tell the core where it is."""
        to = node.where(core_id)
        assert to is not None
        self._count(f"{node.above(to)}->{to}", self.shard_of[core_id].state_bytes)
        self.sched.state_location(core_id, engine_id, to)

    def _prefetch(self, engine_id: str, now: float) -> None:
        """Bring the first job expected at this trainer whose state sits below its first storage
        tier up to it while the current one runs (as the daemon asks its trainers to), if the
        policy lets it."""
        node = self.nodes[engine_id]
        expected = self.sched.expected(engine_id, now)
        core_id = state_policy.prefetch_choice(expected, node.tier, slow=list(node.budgets)[1:])
        source = node.where(core_id) if core_id is not None else None
        demoted = node.prefetch(core_id, expected) if core_id is not None else None
        if core_id is None or source is None or demoted is None:
            return
        for other in demoted:
            self._demoted(node, other, engine_id)
        shard, to = self.shard_of[core_id], node.where(core_id)
        assert to is not None
        shard.ready_at = now + shard.state_bytes / (self._read_gbps[source] * GB)
        self._count(f"{source}->{to}", shard.state_bytes)
        self.sched.state_location(core_id, engine_id, to)

    def _drop_state(self, shard: _Shard) -> None:
        """Forget the shard's state (its job ended)."""
        if shard.node is not None:
            self.nodes[shard.node].drop(shard.core_id)
        shard.node = None

    # -- results

    def _result(self, wall_s: float) -> SimResult:
        unfinished = [j.tj.job_id for j in self.jobs if j.finished_at < 0]
        if unfinished:
            raise RuntimeError(f"{len(unfinished)} jobs never finished (first: {unfinished[0]})")
        start = min((j.tj.arrival_s for j in self.jobs), default=0.0)
        end = max((j.finished_at for j in self.jobs), default=0.0)
        self._hold_flush(end)
        held_h = self.held_s / 3600
        self._charge(0, end)
        if self.placement.dedicates_engines():  # each job an allocation of its own engines, while it runs
            self.alloc.gpu_hours = held_h
        else:  # what the allocation held from the first arrival to the last finish
            self.alloc.gpu_hours = self.alloc_s / 3600
        busy_h = sum(b * self.engine_gpus[e] for e, b in self.busy.items()) / 3600
        steps = sum(o.steps for o in self.outcomes)
        delays = sorted(o.admitted_s - o.arrival_s for o in self.outcomes)
        lat = sorted(self.latencies)
        return SimResult(
            policy=self.policy,
            jobs_per_engine=self.jpe,
            max_switches=self.max_switches,
            gpus=self.gpus,
            engines=len(self.engine_gpus),
            pools=self.pools,
            jobs=len(self.outcomes),
            steps=steps,
            makespan_s=end - start,
            gpu_hours=held_h,
            busy_gpu_hours=busy_h,
            gpu_hours_per_step=held_h / steps if steps else 0.0,
            bubble_ratio=1.0 - busy_h / held_h if held_h > 0 else 0.0,
            queue_p50_s=_quantile(delays, 0.5),
            queue_p99_s=_quantile(delays, 0.99),
            queue_mean_s=sum(delays) / len(delays) if delays else 0.0,
            swaps=self.swaps,
            ticks=len(lat),
            tick_p50_us=_quantile(lat, 0.5) * 1e6,
            tick_p99_us=_quantile(lat, 0.99) * 1e6,
            tick_p999_us=_quantile(lat, 0.999) * 1e6,
            tick_max_us=(lat[-1] if lat else 0.0) * 1e6,
            tasks=self.n_tasks,
            wall_s=wall_s,
            engine_busy_s=self.busy,
            outcomes=sorted(self.outcomes, key=lambda o: o.job_id),
            intervals=self.intervals,
            switches=self.switches,
            train_grouping=self.cfg.train_grouping,
            trainer_busy_s=sum(b for e, b in self.busy.items() if self.pair_of[e].engines[1].engine_id == e),
            passes=self.passes,
            allocation=self.alloc,
        )

    def _hold_flush(self, now: float) -> None:
        self.held_s += self.held * (now - self.held_since)
        self.held_since = now


def simulate(
    trace: Trace,
    policy: str,
    gpus: int | None = None,
    *,
    jobs_per_engine: int = 4,
    max_switches: int = 4,
    config: SimConfig | None = None,
    record_intervals: bool = False,
) -> SimResult:
    """Replay ``trace`` under ``policy`` on ``gpus`` GPUs (default: the trace's) with the daemon's core."""
    gpus = gpus or trace.gpus
    if not gpus:
        raise ValueError("the trace names no cluster size: pass gpus")
    return Simulation(trace, policy, gpus, jobs_per_engine, max_switches, config, record_intervals).run()


# -- calibration against the real-engine benchmark (bench/multiplex.py)

TRAIN_SHARE = 0.34  # trainer share of busy engine time in bench/multiplex.py's isolated run (metrics)


class PhaseJob(msgspec.Struct, frozen=True):
    name: str
    steps: int
    generate_s: float  # per step, on the rollout engine
    stall_s: float  # per step, engines idle (reward, driver, dispatch)
    train_s: float  # per step, on the trainer (train_step + publish)


class PhaseModel(msgspec.Struct, kw_only=True):
    """Per-step phases of the benchmark's jobs on this machine, inferred from its isolated run.

    ``trace()`` turns them into a trace of the same jobs on the same engines (``pairs``
    rollout + trainer pairs, ``rollout_slots`` concurrent generate calls), so the simulator
    can predict what the shared run measured.
    """

    jobs: list[PhaseJob]
    pairs: int = 1
    rollout_slots: int = 1
    busy_share: float  # engine-busy share of an isolated step's wall time
    train_share: float  # trainer share of the busy time
    cpu_s: float | None = None  # CPU seconds the isolated run's processes spent (engines, rewards, drivers, daemon)
    cores: int | None = None  # the CPU cores they shared
    measured: dict[str, float] = {}  # the benchmark's own numbers

    def trace(self) -> Trace:
        jobs = [
            TraceJob(
                job_id=j.name,
                model="tiny",
                gpus=GPUS_PER_SHARD * self.pairs,
                arrival_s=i * 1e-3,
                steps=j.steps,
                generate_s=j.generate_s,
                tail_share=1.0,
                tool_s=0.0,
                reward_s=j.stall_s,
                train_s=j.train_s,
                state_bytes=1 << 20,
                jitter=0.0,
                seed=i,
            )
            for i, j in enumerate(self.jobs)
        ]
        return Trace(jobs=jobs, gpus=GPUS_PER_SHARD * self.pairs, name="multiplex-calibration")

    def config(self) -> SimConfig:
        return SimConfig(rollout_slots=self.rollout_slots, macro_steps=1 << 30)


def calibrate_from(
    multiplex_json: str | Path | dict[str, Any], train_share: float = TRAIN_SHARE, rollout_slots: int = 1
) -> PhaseModel:
    """A ``PhaseModel`` from ``bench/results/multiplex.json`` (a path or its loaded dict).

    Only the ``isolated`` mode is used (the shared one is what the model must predict):
    each job's step wall time is its run time / steps; the engines' busy share of it follows
    from the measured bubble ratio (busy engine-seconds = (1 - bubble) x engines x makespan,
    spread over the jobs in proportion to their run time, since an isolated job keeps at most
    one of its engines busy at a time); the rest of a step is a stall (reward, driver,
    dispatch). The benchmark's JSON does not record how busy time splits between generate
    and train, so ``train_share`` is an assumption (default: the share measured once from the
    per-step ``generate_s`` and ``train/seconds`` metrics of the run behind
    ``bench/results/multiplex.json``); if a job records per-step ``generate_s`` and
    ``train_s`` means they are used instead, job by job. ``rollout_slots=1``: on this machine's two cores
    concurrent generate calls share the same CPUs, so a call is taken to own the engine. The
    CPU seconds the isolated run's processes spent and the cores they had (its ``cpu``, when
    recorded) bound the shared run's makespan (see ``predict``).
    """
    data = json.loads(Path(multiplex_json).read_text()) if not isinstance(multiplex_json, dict) else multiplex_json
    modes = data["modes"]
    iso = modes["isolated"]
    engines = int(iso.get("engines", 2))
    pairs = max(1, engines // 2)
    run_total = sum(j["run_s"] for j in iso["jobs"].values())
    busy = (1.0 - iso["bubble_ratio"]) * engines * iso["makespan_s"]
    busy_share = min(1.0, busy / run_total) if run_total > 0 else 0.0
    default_steps = int(data.get("steps", 0)) or iso["steps"] // max(1, len(iso["jobs"]))
    jobs = []
    for name, j in iso["jobs"].items():
        steps = int(j.get("steps") or len(j.get("reward", ())) or default_steps)
        wall = j["run_s"] / steps
        if "generate_s" in j and "train_s" in j:
            gen, train = float(j["generate_s"]), float(j["train_s"])
        else:
            gen, train = wall * busy_share * (1 - train_share), wall * busy_share * train_share
        jobs.append(PhaseJob(name, steps, gen, max(0.0, wall - gen - train), train))
    measured = {"isolated_bubble_ratio": iso["bubble_ratio"], "isolated_engine_s_per_step": iso["engine_s_per_step"]}
    shared = next((m for p, m in modes.items() if p != "isolated"), None)
    if shared is not None:
        measured["shared_engine_s_per_step"] = shared["engine_s_per_step"]
        measured["shared_bubble_ratio"] = shared["bubble_ratio"]
        measured["ratio"] = shared["engine_s_per_step"] / iso["engine_s_per_step"]
    cpu = iso.get("cpu") or {}
    return PhaseModel(
        jobs=jobs,
        pairs=pairs,
        rollout_slots=rollout_slots,
        busy_share=busy_share,
        train_share=train_share,
        cpu_s=cpu.get("seconds"),
        cores=cpu.get("cores"),
        measured=measured,
    )


def predict(
    model: PhaseModel, policy: str = DEFAULTS.policy, jobs_per_engine: int = 8, max_switches: int = 4
) -> dict[str, float]:
    """Simulate the model's jobs isolated and shared; the predicted shared / isolated ratio of
    engine-seconds per step, beside the measured one (the daemon's defaults: 8 jobs per engine).

    The simulator gives every engine its own processors, as GPUs are; the benchmark's engines,
    reward code, drivers and daemon share ``cores`` CPU cores. So when the isolated run's CPU
    seconds are known, the shared makespan is also at least ``cpu_s / cores`` (the same work on
    the same cores, packed without a gap): the prediction is the larger of the two
    (``scheduling_ratio``: the simulator's alone; ``cpu_bound_ratio``: the cores' bound)."""
    trace, cfg = model.trace(), model.config()
    iso = simulate(trace, "isolated", config=cfg)
    shared = simulate(trace, policy, jobs_per_engine=jobs_per_engine, max_switches=max_switches, config=cfg)
    out = {
        "isolated_engine_s_per_step": iso.gpu_hours_per_step * 3600 / cfg.gpus_per_engine,
        "shared_engine_s_per_step": shared.gpu_hours_per_step * 3600 / cfg.gpus_per_engine,
        "isolated_bubble_ratio": iso.bubble_ratio,
        "shared_bubble_ratio": shared.bubble_ratio,
    }
    out["scheduling_ratio"] = out["shared_engine_s_per_step"] / out["isolated_engine_s_per_step"]
    if model.cpu_s is not None and model.cores:
        engines, steps = 2 * model.pairs, sum(j.steps for j in model.jobs)
        cpu_bound = engines * model.cpu_s / model.cores / steps
        out["cpu_bound_ratio"] = cpu_bound / out["isolated_engine_s_per_step"]
        out["shared_engine_s_per_step"] = max(out["shared_engine_s_per_step"], cpu_bound)
    out["ratio"] = out["shared_engine_s_per_step"] / out["isolated_engine_s_per_step"]
    if "ratio" in model.measured:
        out["measured_ratio"] = model.measured["ratio"]
        out["error"] = out["ratio"] - model.measured["ratio"]
    return out
