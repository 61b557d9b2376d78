"""Job traces for the simulator: a seeded generator of cluster-scale RL job mixes, and their files.

A ``Trace`` is a list of ``TraceJob`` records, one per RL fine-tuning job: when it arrives, its
base model class and base, how many GPUs it gets when it runs isolated, how many training steps
it runs, the sizes of its trainer state and weights, and the *shape* of one step:

    [generate (longest chunk) -> tool stall] x (turns - 1), generate, reward stall, train_step+publish

``generate_trace`` draws the jobs of one scenario (``SCENARIOS``: ``classic``, ``mixed``) over
``days`` of bursty, diurnal arrivals (``arrival_times``), with step counts scaled so that the
jobs' isolated GPU-time is ``load`` times the cluster's GPU-time over the arrival window.

Files: ``.jsonl`` holds one ``TraceJob`` per line, any other name the whole ``Trace``; writes
are atomic. It deliberately does not model per-token or per-request timing (a step's phases are
its unit), failures and restarts, changes of shape during a job, or asynchronous (off-policy)
overlap of a job's own phases. The fields, the scenarios and the bubble ratio they imply:
docs/state.md, "The trace".
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import msgspec

from plexctl.common.atomic import write_bytes_atomic
from plexctl.common.model_shapes import known_shape
from plexctl.common.spec import DEFAULT_TARGET_MODULES
from plexctl.common.state_size import dtype_bytes, full_state_bytes, job_state_bytes, parameter_count

DAY_S = 86_400.0
GPUS_PER_SHARD = 16  # one 8-GPU rollout engine + one 8-GPU trainer engine (see daemon/simulator.py)
FULL_FT_BYTES_PER_PARAM = 14  # bf16 weights + fp32 master copy + two fp32 AdamW moments
LORA_TARGETS = DEFAULT_TARGET_MODULES


class TraceJob(msgspec.Struct, frozen=True, kw_only=True):
    job_id: str
    model: str  # model class: the engines that can serve it (7B | 30B | 235B | any name)
    base: str = ""  # base model within the class (its weights differ from the others'); "": the class's one
    gpus: int  # GPUs held when isolated: a multiple of GPUS_PER_SHARD
    arrival_s: float  # seconds from the trace's start
    steps: int  # training steps to run
    generate_s: float  # per step: wall time of the rollout phase (the longest chunk of each turn)
    tail_share: float  # mean / longest rollout chunk: the busy share of the rollout phase (1: no tail)
    tool_s: float  # per step: tool stalls between turns (all GPUs of the job idle)
    reward_s: float  # per step: reward / verifier stall after the last turn
    train_s: float  # per step: train_step + publish on the trainer
    turns: int = 1
    state_bytes: int = 0  # trainer state: LoRA adapter + optimizer, or full weights + optimizer
    full_weights: bool = False
    weights_bytes: int = 0  # the base's weights as engines serve them (0: switches between bases not modelled)
    user: str = ""
    priority: int = 0
    jitter: float = 0.1  # lognormal sigma of per-step durations
    seed: int = 0  # seeds the per-step durations

    @property
    def shards(self) -> int:
        """Engine pairs the job occupies when isolated (one rollout + one trainer engine each)."""
        return max(1, self.gpus // GPUS_PER_SHARD)

    @property
    def step_s(self) -> float:
        return self.generate_s + self.tool_s + self.reward_s + self.train_s

    @property
    def bubble_ratio(self) -> float:
        """Idle share of the job's GPU time when it runs isolated (rollout and trainer halves)."""
        return 1.0 - (self.generate_s * self.tail_share + self.train_s) / (2.0 * self.step_s)

    @property
    def isolated_gpu_s(self) -> float:
        return self.gpus * self.steps * self.step_s


class Trace(msgspec.Struct, kw_only=True):
    jobs: list[TraceJob]
    gpus: int = 0  # the cluster it was drawn for (0: unknown)
    days: float = 0.0
    seed: int = 0
    load: float = 0.0  # isolated GPU-time demand / (gpus x days)
    name: str = ""

    @property
    def steps(self) -> int:
        return sum(j.steps for j in self.jobs)


class ModelClass(msgspec.Struct, frozen=True):
    name: str
    params: float
    config: dict[str, int]  # Llama/Qwen-style shapes for LoRA state size (dense equivalent of MoE)
    weight: float  # share of jobs
    gpus: tuple[int, ...]  # GPU counts drawn from (uniformly: repeats weight a choice)
    step_s: tuple[float, float]  # log-uniform range of one step's wall time when isolated
    steps: tuple[float, float]  # log-uniform range of training steps (before scaling to the load)
    full_ft: float  # share of full fine-tunes
    bases: tuple[str, ...] = ()  # known shapes (model_shapes) of its base models, drawn uniformly; (): one, ``config``


MODEL_CLASSES: tuple[ModelClass, ...] = (
    ModelClass(
        "7B",
        7.6e9,
        {
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "head_dim": 128,
        },
        0.55,
        (16, 16, 16, 32, 32, 48, 64),
        (90.0, 300.0),
        (200.0, 1000.0),
        0.2,
    ),
    ModelClass(
        "30B",
        32.8e9,
        {
            "hidden_size": 5120,
            "intermediate_size": 27648,
            "num_hidden_layers": 64,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "head_dim": 128,
        },
        0.30,
        (32, 32, 48, 64, 64, 96, 128),
        (180.0, 600.0),
        (150.0, 600.0),
        0.1,
    ),
    # 235B-A22B MoE: attention plus the 8 active experts as a dense-equivalent MLP
    ModelClass(
        "235B",
        235e9,
        {
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 94,
            "num_attention_heads": 64,
            "num_key_value_heads": 4,
            "head_dim": 128,
        },
        0.15,
        (64, 96, 128, 128, 192, 192),
        (400.0, 1200.0),
        (100.0, 300.0),
        0.0,
    ),
)
BUBBLE_RANGE = (0.70, 0.81)
MAX_STATE_PER_SHARD = 320e9  # a full fine-tune gets enough shards that each holds at most this


def _mixed_class(
    name: str,
    bases: tuple[str, ...],
    weight: float,
    gpus: tuple[int, ...],
    step_s: tuple[float, float],
    steps: tuple[float, float],
    full_ft: float,
) -> ModelClass:
    shape = known_shape(bases[0]) or {}
    return ModelClass(
        name, float(parameter_count(shape)), dict(shape), weight, gpus, step_s, steps, full_ft, bases=bases
    )


# Jobs on several base models of 7B to 70B class, many of them full fine-tuning (the usual RLVR
# recipe): each class's engines serve every base of the class, one at a time.
MIXED_CLASSES: tuple[ModelClass, ...] = (
    _mixed_class(
        "7B", ("qwen2.5-7b", "llama-3.1-8b"), 0.45, (16, 16, 16, 32, 32, 48, 64), (90.0, 300.0), (200.0, 1000.0), 0.4
    ),
    _mixed_class("14B", ("qwen2.5-14b",), 0.2, (16, 32, 32, 48, 64), (150.0, 450.0), (150.0, 800.0), 0.35),
    _mixed_class("32B", ("qwen2.5-32b",), 0.2, (32, 32, 48, 64, 64, 96, 128), (180.0, 600.0), (150.0, 600.0), 0.3),
    _mixed_class(
        "70B", ("llama-3.1-70b", "qwen2.5-72b"), 0.15, (64, 96, 128, 128, 192), (300.0, 900.0), (100.0, 400.0), 0.25
    ),
)
SCENARIOS: dict[str, tuple[ModelClass, ...]] = {"classic": MODEL_CLASSES, "mixed": MIXED_CLASSES}
SERVE_DTYPE = "bfloat16"  # the engines' weights, and a full fine-tuning job's training dtype


def generate_trace(
    n_jobs: int = 1000,
    gpus: int = 2048,
    days: float = 90.0,
    seed: int = 0,
    load: float = 1.6,
    n_users: int = 40,
    scenario: str = "classic",
) -> Trace:
    """Draw ``n_jobs`` jobs arriving over ``days`` for a cluster of ``gpus`` GPUs (see module doc)."""
    if n_jobs < 1 or gpus < GPUS_PER_SHARD or days <= 0 or load <= 0:
        raise ValueError(f"need n_jobs >= 1, gpus >= {GPUS_PER_SHARD}, days > 0, load > 0")
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}: one of {', '.join(SCENARIOS)}")
    classes = SCENARIOS[scenario]
    rng = random.Random(seed)
    # a job gets at most a quarter of the cluster, so every model class fits beside the others
    max_gpus = max(GPUS_PER_SHARD, (gpus // 4) // GPUS_PER_SHARD * GPUS_PER_SHARD)
    arrivals = arrival_times(n_jobs, days, rng)
    user_weights = [1.0 / (i + 1) for i in range(n_users)]
    drafts: list[dict[str, Any]] = []
    for i, arrival in enumerate(arrivals):
        mc = rng.choices(classes, weights=[m.weight for m in classes])[0]
        job_gpus = min(rng.choice(mc.gpus), max_gpus)
        shape = step_shape(rng, mc)
        full = rng.random() < mc.full_ft
        base, config, weights = "", mc.config, 0
        if mc.bases:  # a base of its own: its real shape, and the weights an engine loads for it
            base = rng.choice(mc.bases)
            config = known_shape(base) or {}
            weights = parameter_count(config) * dtype_bytes(SERVE_DTYPE)
        if full:
            state = (
                full_state_bytes(config, SERVE_DTYPE, cuda=True)
                if mc.bases
                else int(mc.params * FULL_FT_BYTES_PER_PARAM)
            )
            need = math.ceil(state / MAX_STATE_PER_SHARD) * GPUS_PER_SHARD
            job_gpus = max(job_gpus, min(need, max_gpus))
        else:
            state = job_state_bytes(rng.choice((16, 32, 64)), LORA_TARGETS, config, cuda=True)
        drafts.append(
            {
                "job_id": f"job{i:05d}",
                "model": mc.name,
                "gpus": job_gpus,
                "arrival_s": round(arrival, 3),
                "base_steps": math.exp(rng.uniform(math.log(mc.steps[0]), math.log(mc.steps[1]))),
                "state_bytes": state,
                "full_weights": full,
                **({"base": base, "weights_bytes": weights} if mc.bases else {}),
                "user": f"user{rng.choices(range(n_users), weights=user_weights)[0]:02d}",
                "priority": 1 if rng.random() < 0.1 else 0,
                "seed": rng.getrandbits(32),
                **shape,
            }
        )
    demand = sum(d["gpus"] * d["base_steps"] * _step(d) for d in drafts)
    scale = load * gpus * days * DAY_S / demand
    jobs = []
    for d in drafts:
        base = d.pop("base_steps")
        jobs.append(TraceJob(steps=max(10, round(base * scale)), **d))
    name = f"synthetic-{n_jobs}x{gpus}-s{seed}" + ("" if scenario == "classic" else f"-{scenario}")
    return Trace(jobs=jobs, gpus=gpus, days=days, seed=seed, load=load, name=name)


def _step(d: dict[str, Any]) -> float:
    return d["generate_s"] + d["tool_s"] + d["reward_s"] + d["train_s"]


def step_shape(rng: random.Random, mc: ModelClass) -> dict[str, Any]:
    """One job's step: phase durations hitting a bubble ratio drawn from ``BUBBLE_RANGE``."""
    step = math.exp(rng.uniform(math.log(mc.step_s[0]), math.log(mc.step_s[1])))
    turns = 1 if rng.random() < 0.5 else rng.choice((2, 3, 4))
    while True:
        bubble = rng.uniform(*BUBBLE_RANGE)
        train = rng.uniform(0.12, 0.30)  # shares of the step's wall time
        tail = rng.uniform(0.45, 0.85)
        generate = (2.0 * (1.0 - bubble) - train) / tail  # busy = generate * tail + train
        stall = 1.0 - generate - train
        if 0.05 <= stall <= 0.6 and generate > 0:
            break
    tool = stall * rng.uniform(0.5, 0.9) if turns > 1 else 0.0
    return {
        "generate_s": round(generate * step, 3),
        "tail_share": round(tail, 4),
        "tool_s": round(tool * step, 3),
        "reward_s": round((stall - tool) * step, 3),
        "train_s": round(train * step, 3),
        "turns": turns,
    }


def arrival_times(n: int, days: float, rng: random.Random) -> list[float]:
    """``n`` sorted arrival times (seconds) of a Poisson process with a bursty, diurnal rate.

    The rate per hour: a daily cycle peaking mid-afternoon (x0.3 at night), weekends at 40 %,
    and about one burst a week (6-48 h at 3-8x: deadlines, sweeps). Given ``n`` arrivals, a
    Poisson process places them independently by that rate, which is how they are drawn.
    """
    hours = max(1, int(days * 24))
    rate = []
    for h in range(hours):
        hour, day = h % 24, h // 24
        diurnal = 0.65 + 0.35 * math.cos(2 * math.pi * (hour - 15) / 24)
        weekly = 0.4 if day % 7 in (5, 6) else 1.0
        rate.append(diurnal * weekly)
    for _ in range(max(1, round(days / 7))):
        start, length, boost = rng.randrange(hours), rng.randint(6, 48), rng.uniform(3.0, 8.0)
        for h in range(start, min(hours, start + length)):
            rate[h] *= boost
    bins = rng.choices(range(hours), weights=rate, k=n)
    span = days * DAY_S / hours
    return sorted((b + rng.random()) * span for b in bins)


# -- files


def write_trace(path: str | Path, trace: Trace) -> None:
    """Write atomically: ``.jsonl`` as one job per line, anything else as one JSON document."""
    path = Path(path)
    if path.suffix == ".jsonl":
        data = b"".join(msgspec.json.encode(j) + b"\n" for j in trace.jobs)
    else:
        data = msgspec.json.format(msgspec.json.encode(trace), indent=1) + b"\n"
    write_bytes_atomic(path, data)


def read_trace(path: str | Path) -> Trace:
    """Read a trace file: a ``Trace`` JSON document, or JSONL of ``TraceJob`` records."""
    path = Path(path)
    raw = path.read_bytes()
    try:
        if path.suffix != ".jsonl":
            try:
                return msgspec.json.decode(raw, type=Trace)
            except msgspec.DecodeError:
                pass  # perhaps JSONL under another name
        jobs = [msgspec.json.decode(line, type=TraceJob) for line in raw.splitlines() if line.strip()]
        return Trace(jobs=jobs, name=path.stem)
    except msgspec.ValidationError as e:
        raise ValueError(f"{path}: not a trace: {e}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"{path}: not JSON: {e}") from None
