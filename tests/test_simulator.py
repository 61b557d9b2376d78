"""The trace generator and the simulator that replays traces through the daemon's scheduler core:
trace shapes and files, conservation of work, isolation, sharing, swaps, calibration, and the
benchmark's quick mode."""

from __future__ import annotations

import importlib.util
import json
from collections import defaultdict
from pathlib import Path

import msgspec
import pytest

from daemon.simulator import PhaseJob, PhaseModel, SimConfig, calibrate_from, partition, predict, simulate
from daemon.trace import (
    DAY_S,
    GPUS_PER_SHARD,
    MAX_STATE_PER_SHARD,
    Trace,
    TraceJob,
    generate_trace,
    read_trace,
    write_trace,
)
from plexctl.common.model_shapes import known_shape
from plexctl.common.scheduling import POLICIES
from plexctl.common.state_policy import DIRECTIONS
from plexctl.common.state_size import full_state_bytes, parameter_count

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(n_jobs=40, gpus=256, days=10.0, seed=5)


@pytest.fixture(scope="module")
def small() -> Trace:
    return generate_trace(**SMALL)


def test_trace_is_deterministic_and_has_the_published_shapes():
    a, b = generate_trace(300, 2048, seed=3), generate_trace(300, 2048, seed=3)
    assert msgspec.json.encode(a) == msgspec.json.encode(b)
    assert msgspec.json.encode(generate_trace(300, 2048, seed=4)) != msgspec.json.encode(a)
    jobs = a.jobs
    assert len(jobs) == 300 and len({j.job_id for j in jobs}) == 300
    assert {j.model for j in jobs} == {"7B", "30B", "235B"}
    for j in jobs:
        assert 0.70 <= j.bubble_ratio <= 0.81, j
        assert 16 <= j.gpus <= 192 and j.gpus % GPUS_PER_SHARD == 0
        assert 0.0 <= j.arrival_s <= 90 * DAY_S
        assert j.steps >= 10 and j.state_bytes > 0 and 0 < j.tail_share <= 1
        assert min(j.generate_s, j.reward_s, j.train_s) > 0 and (j.tool_s > 0) == (j.turns > 1)
    assert [j.arrival_s for j in jobs] == sorted(j.arrival_s for j in jobs)
    assert max(j.gpus for j in jobs) == 192 and min(j.gpus for j in jobs) == 16
    # full fine-tunes carry weights + optimizer: far more state than any LoRA job of their class
    for model in ("7B", "30B"):
        full = [j.state_bytes for j in jobs if j.model == model and j.full_weights]
        lora = [j.state_bytes for j in jobs if j.model == model and not j.full_weights]
        assert full and lora and min(full) > 10 * max(lora)
    # step counts are scaled so that isolated demand is `load` x the cluster over the window
    demand = sum(j.isolated_gpu_s for j in jobs)
    assert demand == pytest.approx(a.load * 2048 * 90 * DAY_S, rel=0.02)
    # arrivals are bursty: the busiest day sees several times the mean
    per_day = defaultdict(int)
    for j in jobs:
        per_day[int(j.arrival_s // DAY_S)] += 1
    assert max(per_day.values()) > 3 * len(jobs) / 90


def test_a_small_cluster_caps_job_size():
    trace = generate_trace(50, 128, seed=1)
    assert max(j.gpus for j in trace.jobs) <= 32
    assert sum(partition(trace, 128).values()) == 128 // GPUS_PER_SHARD


def test_trace_files_round_trip(tmp_path, small):
    for name in ("t.json", "t.jsonl"):
        write_trace(tmp_path / name, small)
        back = read_trace(tmp_path / name)
        assert back.jobs == small.jobs
    assert read_trace(tmp_path / "t.json") == small  # the whole document keeps the cluster fields
    (tmp_path / "bad.json").write_text('{"jobs": [{"job_id": 3}]}')
    with pytest.raises(ValueError, match="not a trace"):
        read_trace(tmp_path / "bad.json")


def test_partition_gives_every_model_class_room_for_its_largest_job(small):
    pools = partition(small, 256)
    assert sum(pools.values()) == 256 // GPUS_PER_SHARD
    for model in pools:
        assert pools[model] >= max(j.shards for j in small.jobs if j.model == model)
    with pytest.raises(ValueError, match="cannot hold"):
        partition(small, 64)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_job_runs_all_its_steps_and_engines_never_exceed_capacity(small, policy):
    r = simulate(small, policy, jobs_per_engine=3)
    assert r.jobs == len(small.jobs) and r.steps == small.steps
    by_id = {j.job_id: j for j in small.jobs}
    for o in r.outcomes:
        assert o.steps == by_id[o.job_id].steps
        assert o.arrival_s <= o.admitted_s < o.finished_s
        assert o.finished_s - o.admitted_s >= by_id[o.job_id].steps * by_id[o.job_id].step_s * 0.7  # jitter aside
    assert r.engines == 2 * sum(r.pools.values())
    for engine, busy in r.engine_busy_s.items():  # slot-weighted: at most one engine's worth at a time
        assert 0.0 <= busy <= r.makespan_s * (1 + 1e-9), engine
    assert sum(r.engine_busy_s.values()) <= r.engines * r.makespan_s
    assert 0.0 < r.busy_gpu_hours <= r.gpu_hours
    assert 0.0 < r.bubble_ratio < 1.0
    assert r.ticks > 0 and r.tick_p50_us <= r.tick_p99_us <= r.tick_max_us


def test_the_work_done_is_the_same_under_every_policy(small):
    """Durations are drawn per job in a fixed order, so only swap time differs between policies."""
    work = {}
    for policy in POLICIES:
        r = simulate(small, policy, jobs_per_engine=3)
        work[policy] = r.busy_gpu_hours - r.swaps.seconds * 8 / 3600
    assert max(work.values()) == pytest.approx(min(work.values()), rel=1e-9)


def test_isolated_never_runs_two_jobs_on_one_engine_at_once(small):
    r = simulate(small, "isolated", record_intervals=True)
    assert r.swaps.swap_ins == 0 and r.swaps.total_bytes == 0
    by_engine = defaultdict(list)
    for engine, job, start, end in r.intervals:
        by_engine[engine].append((start, end, job))
    for engine, spans in by_engine.items():
        spans.sort()
        ends: dict[str, float] = {}
        for start, end, job in spans:
            assert all(start >= e - 1e-9 for other, e in ends.items() if other != job), (engine, job, start)
            ends[job] = max(end, ends.get(job, 0.0))
    # and isolated holds exactly each job's GPUs for its run time
    by_id = {j.job_id: j for j in small.jobs}
    held = sum(by_id[o.job_id].gpus * (o.finished_s - o.admitted_s) for o in r.outcomes) / 3600
    assert r.gpu_hours == pytest.approx(held, rel=1e-9)


def burst(n: int = 16) -> Trace:
    """n two-pair jobs arriving within an hour: isolated, they queue for the 4 pairs."""
    jobs = [
        TraceJob(
            job_id=f"b{i}",
            model="7B",
            gpus=32,
            arrival_s=i * 200.0,
            steps=40,
            generate_s=60.0,
            tail_share=0.6,
            tool_s=30.0 if i % 2 else 0.0,
            reward_s=40.0,
            train_s=30.0,
            turns=2 if i % 2 else 1,
            state_bytes=2 << 30,
            user=f"u{i % 3}",
            seed=i,
        )
        for i in range(n)
    ]
    return Trace(jobs=jobs, gpus=128)


@pytest.mark.parametrize("trace", [burst(), generate_trace(**SMALL)], ids=["burst", "generated"])
def test_sharing_finishes_a_bursty_trace_no_later_than_isolated(trace):
    iso = simulate(trace, "isolated")
    assert iso.queue_p99_s > 0  # the burst really queues
    for policy in ("pack", "spread", "spread+backfill"):
        shared = simulate(trace, policy, jobs_per_engine=4)
        assert shared.makespan_s <= iso.makespan_s, policy
        assert shared.queue_p50_s <= iso.queue_p50_s
        assert shared.bubble_ratio < iso.bubble_ratio
    best = simulate(trace, "spread+backfill", jobs_per_engine=4)
    assert best.gpu_hours_per_step < iso.gpu_hours_per_step


def test_more_tenants_than_device_slots_swap_state_and_count_it():
    trace = burst(16)  # 32 shards on 8 trainers: 4 tenants each
    cfg = SimConfig(device_slots=1, host_gb=2.5)  # one state on the device, one in host memory
    r = simulate(trace, "spread", jobs_per_engine=4, config=cfg)
    assert r.swaps.swap_ins > 0 and r.swaps.seconds > 0
    assert r.swaps.bytes["device->host"] > 0 and r.swaps.bytes["host->device"] > 0
    # each swap-in moves one 2 GiB state; a swap-in costs at least its host -> device copy
    assert r.swaps.seconds >= r.swaps.swap_ins * (2 << 30) / (cfg.h2d_gbps * 1e9) * 0.999
    # packed 8 to a trainer, host memory (two states) overflows to NVMe, and states come back
    # up ahead of need (prefetch) or straight from NVMe
    packed = simulate(trace, "pack", jobs_per_engine=8, config=SimConfig(device_slots=1, host_gb=4.5))
    for direction in ("device->host", "host->nvme", "device->nvme", "nvme->host", "host->device", "nvme->device"):
        assert packed.swaps.bytes.get(direction, 0) > 0, direction
    roomy = simulate(trace, "spread", jobs_per_engine=4, config=SimConfig(device_slots=4))
    assert roomy.swaps.swap_ins == 0
    # backfill leaves a trainer task on the trainer holding its job's state, even when that
    # state was evicted (the simulation stops with an error otherwise): states never cross nodes
    backfill = simulate(trace, "spread+backfill", jobs_per_engine=4, config=cfg)
    assert backfill.swaps.swap_ins > 0
    assert set(backfill.swaps.bytes) <= set(DIRECTIONS)


def multiplex_json(model: PhaseModel, with_phases: bool) -> dict:
    """What bench/multiplex.py would measure if the real engines behaved like the simulator."""
    cfg = model.config()
    iso = simulate(model.trace(), "isolated", config=cfg)
    shared = simulate(model.trace(), "spread+backfill", jobs_per_engine=8, config=cfg)
    jobs = {}
    for o, j in zip(sorted(iso.outcomes, key=lambda o: o.arrival_s), model.jobs):
        jobs[j.name] = {"run_s": o.finished_s - o.admitted_s, "reward": [0.0] * j.steps}
        if with_phases:
            jobs[j.name].update(generate_s=j.generate_s, train_s=j.train_s)
    eps = lambda r: r.gpu_hours_per_step * 3600 / cfg.gpus_per_engine  # noqa: E731
    return {
        "steps": model.jobs[0].steps,
        "modes": {
            "isolated": {
                "engines": 2,
                "bubble_ratio": iso.bubble_ratio,
                "makespan_s": iso.makespan_s,
                "engine_s_per_step": eps(iso),
                "steps": sum(j.steps for j in model.jobs),
                "jobs": jobs,
            },
            "spread+backfill": {
                "engines": 2,
                "bubble_ratio": shared.bubble_ratio,
                "makespan_s": shared.makespan_s,
                "engine_s_per_step": eps(shared),
                "jobs": {},
            },
        },
    }


def test_calibration_round_trip():
    # every job busy 60 % of its step, a third of that on the trainer: the fallback's assumptions hold
    truth = PhaseModel(
        jobs=[PhaseJob("a", 12, 0.4, 0.4, 0.2), PhaseJob("b", 12, 0.8, 0.8, 0.4), PhaseJob("c", 12, 0.2, 0.2, 0.1)],
        busy_share=0.6,
        train_share=1 / 3,
    )
    for with_phases in (True, False):
        data = multiplex_json(truth, with_phases)
        model = calibrate_from(data, train_share=1 / 3)
        assert model.busy_share == pytest.approx(0.6, rel=1e-3)
        for got, want in zip(model.jobs, truth.jobs):
            assert (got.name, got.steps) == (want.name, want.steps)
            assert (got.generate_s, got.stall_s, got.train_s) == pytest.approx(
                (want.generate_s, want.stall_s, want.train_s), rel=1e-3, abs=1e-6
            )
        out = predict(model)
        assert out["measured_ratio"] == pytest.approx(
            data["modes"]["spread+backfill"]["engine_s_per_step"] / data["modes"]["isolated"]["engine_s_per_step"]
        )
        assert abs(out["error"]) < 0.01
        assert out["isolated_bubble_ratio"] == pytest.approx(0.7, abs=0.01)


def test_calibration_holds_the_shared_run_to_the_cores_bound():
    # the benchmark's engines, rewards and drivers share the machine's cores: the CPU seconds of
    # the isolated run over the cores bound the shared makespan, whatever the schedule allows
    truth = PhaseModel(
        jobs=[PhaseJob("a", 12, 0.4, 0.4, 0.2), PhaseJob("b", 12, 0.8, 0.8, 0.4)], busy_share=0.6, train_share=1 / 3
    )
    data = multiplex_json(truth, with_phases=True)
    iso = data["modes"]["isolated"]
    assert "cpu" not in iso and "cpu_bound_ratio" not in predict(calibrate_from(data))
    scheduling = predict(calibrate_from(data))["ratio"]
    iso_eps = iso["engine_s_per_step"]
    steps = sum(j.steps for j in truth.jobs)
    for cpu_s, cores in ((1.0, 2), (iso["makespan_s"] * 2, 2), (iso["makespan_s"] * 3, 4)):
        iso["cpu"] = {"seconds": cpu_s, "cores": cores, "by_process": {"rest": cpu_s}}
        out = predict(calibrate_from(data))
        assert out["scheduling_ratio"] == pytest.approx(scheduling)
        # 2 engines busy for cpu_s / cores seconds at least, over the same steps
        assert out["cpu_bound_ratio"] == pytest.approx(2 * cpu_s / cores / steps / iso_eps, rel=0.02)
        assert out["ratio"] == pytest.approx(max(scheduling, out["cpu_bound_ratio"]))
    assert out["ratio"] > scheduling  # 3 x the isolated makespan of CPU on 4 cores: 0.75 of isolated
    assert out["ratio"] == pytest.approx(0.75, rel=0.02)


def test_calibrates_from_the_benchmark_file(tmp_path):
    path = REPO / "bench" / "results" / "multiplex.json"
    if not path.exists():
        truth = PhaseModel(jobs=[PhaseJob("a", 6, 0.4, 0.4, 0.2)], busy_share=0.6, train_share=1 / 3)
        path = tmp_path / "multiplex.json"
        path.write_text(json.dumps(multiplex_json(truth, with_phases=False)))
    model = calibrate_from(path)
    iso = json.loads(path.read_text())["modes"]["isolated"]
    assert [j.name for j in model.jobs] == list(iso["jobs"])
    assert 0.0 < model.busy_share <= 1.0
    for j in model.jobs:  # the phases add up to the measured step time
        assert j.generate_s + j.stall_s + j.train_s == pytest.approx(iso["jobs"][j.name]["run_s"] / j.steps)
    out = predict(model)
    # per-job generate/train times measured by the benchmark (when recorded) drive the phases,
    # so the measured isolated bubble ratio is reproduced, not fitted: within 3 points
    assert out["isolated_bubble_ratio"] == pytest.approx(iso["bubble_ratio"], abs=0.03)
    assert 0.0 < out["ratio"] < 1.0


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_simulate", REPO / "bench" / "simulate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_benchmark_writes_its_json(tmp_path):
    truth = PhaseModel(
        jobs=[PhaseJob("a", 5, 0.4, 0.4, 0.2), PhaseJob("b", 5, 0.8, 0.8, 0.4)], busy_share=0.6, train_share=1 / 3
    )
    mux = tmp_path / "multiplex.json"
    mux.write_text(json.dumps(multiplex_json(truth, with_phases=True)))
    out = tmp_path / "simulate.json"
    bench = load_bench()
    assert (
        bench.main(
            [
                "--quick",
                "--workers",
                "1",
                "--multiplex",
                str(mux),
                "--out",
                str(out),
                "--save-trace",
                str(tmp_path / "trace.jsonl"),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    labels = set(data["policies"])
    assert {*POLICIES, data["best"]["label"]} == labels
    best = data["best"]
    assert best["label"] == f"best: {best['policy']} jpe={best['jobs_per_engine']}"
    assert best["policy"] in ("spread+backfill", "pack+backfill") and best["allocation"] == "elastic"
    # the three figures: what the allocation held >= what engines held >= what they were busy
    assert 0 < best["saved_allocation"] <= best["saved_engine"] <= best["saved_busy"] < 1
    assert best["makespan_vs_isolated"] == data["policies"][best["label"]]["makespan_vs_isolated"]
    iso = data["policies"]["isolated"]
    assert iso["makespan_vs_isolated"] == 1.0 and iso["saved_allocation"] == iso["saved_engine"] == 0.0
    for row in data["policies"].values():
        assert row["jobs"] == 50 and row["gpus"] == 128 and row["tick_p99_us"] > 0
        assert {
            "makespan_s",
            "gpu_hours_per_step",
            "queue_p50_s",
            "queue_p99_s",
            "swap_bytes",
            "bubble_ratio",
            "tick_p50_us",
        } <= set(row)
    assert data["calibration"]["phases"].startswith("measured") and abs(data["calibration"]["error"]) < 0.01
    assert {t["policy"] for t in data["tuning"]} == {"spread+backfill", "pack+backfill"}
    # the saved trace replays through the same entry point (`plexctl simulate TRACE`)
    out2 = tmp_path / "replay.json"
    assert (
        bench.main(
            [
                str(tmp_path / "trace.jsonl"),
                "--gpus",
                "128",
                "--workers",
                "1",
                "--macro-steps",
                "4",
                "--multiplex",
                str(tmp_path / "absent.json"),
                "--out",
                str(out2),
            ]
        )
        == 0
    )
    replay = json.loads(out2.read_text())
    assert replay["trace"]["jobs"] == 50 and replay["calibration"] is None


# ---------------------------------------------------------------- the mixed case: several bases, full fine-tuning


def test_mixed_trace_has_full_fine_tuning_jobs_of_7b_to_70b_with_their_real_state_sizes():
    trace = generate_trace(400, 2048, seed=3, scenario="mixed")
    assert msgspec.json.encode(trace) == msgspec.json.encode(generate_trace(400, 2048, seed=3, scenario="mixed"))
    assert {j.model for j in trace.jobs} == {"7B", "14B", "32B", "70B"}
    assert {j.base for j in trace.jobs} == {
        "qwen2.5-7b",
        "llama-3.1-8b",
        "qwen2.5-14b",
        "qwen2.5-32b",
        "llama-3.1-70b",
        "qwen2.5-72b",
    }
    for model in ("7B", "14B", "32B", "70B"):
        assert any(j.full_weights for j in trace.jobs if j.model == model), model
    for j in trace.jobs:
        shape = known_shape(j.base)
        assert j.weights_bytes == 2 * parameter_count(shape)  # bf16 weights
        if j.full_weights:  # bf16 weights + fp32 masters + two fp32 moments, and enough shards to hold them
            assert j.state_bytes == full_state_bytes(shape, "bfloat16", cuda=True)
            assert j.state_bytes / j.shards <= MAX_STATE_PER_SHARD
    full_70b = [j.state_bytes for j in trace.jobs if j.base == "llama-3.1-70b" and j.full_weights]
    assert full_70b and full_70b[0] / 1e9 == pytest.approx(987.8, abs=0.1)
    # the classic trace is what it was: one base per class, no weights to switch
    classic = generate_trace(300, 2048, seed=3)
    assert {j.base for j in classic.jobs} == {""} and {j.weights_bytes for j in classic.jobs} == {0}


def two_bases(full: bool = False) -> Trace:
    """Two one-pair jobs of 7B class on different bases (the second a full fine-tune if ``full``)."""
    jobs = [
        TraceJob(
            job_id=f"j{i}",
            model="7B",
            base=("qwen2.5-7b", "llama-3.1-8b")[i],
            gpus=16,
            arrival_s=float(i),
            steps=4,
            generate_s=60.0,
            tail_share=1.0,
            tool_s=0.0,
            reward_s=30.0,
            train_s=30.0,
            state_bytes=1 << 30,
            full_weights=full and i == 1,
            weights_bytes=16 * 10**9,
            jitter=0.0,
            seed=i,
        )
        for i in range(2)
    ]
    return Trace(jobs=jobs, gpus=16)


def test_jobs_of_two_bases_on_one_engine_pay_for_each_switch():
    cfg = SimConfig(macro_steps=4, rollout_slots=1)
    load_s = cfg.switch_s + 16e9 / (cfg.gpus_per_engine * cfg.h2d_gbps * 1e9)
    iso = simulate(two_bases(), "isolated", config=cfg)  # one after the other: each base loaded once per engine
    assert iso.switches.count == {"rollout base": 2, "trainer base": 2}
    assert iso.switches.seconds["rollout base"] == pytest.approx(2 * load_s)
    shared = simulate(two_bases(), "spread", jobs_per_engine=2, config=cfg)  # interleaved steps: a switch each
    assert shared.switches.count["rollout base"] > 2 and shared.switches.count["trainer base"] > 2
    assert shared.switches.bytes["rollout base"] == shared.switches.count["rollout base"] * 16 * 10**9
    assert shared.makespan_s < iso.makespan_s  # sharing still wins at this cost
    # switches are charged as time, not counted as work done
    free = simulate(
        msgspec.structs.replace(
            two_bases(), jobs=[msgspec.structs.replace(j, weights_bytes=0) for j in two_bases().jobs]
        ),
        "spread",
        jobs_per_engine=2,
        config=cfg,
    )
    assert free.switches.count == {} and free.busy_gpu_hours == pytest.approx(shared.busy_gpu_hours)
    assert shared.gpu_hours > free.gpu_hours


def test_a_full_fine_tuning_job_loads_its_own_weights_before_generating_once_others_ran():
    cfg = SimConfig(macro_steps=4, rollout_slots=1)
    iso = simulate(two_bases(full=True), "isolated", config=cfg)
    # alone on its engines its weights stay loaded from step to step (its publish updates them in place)
    assert iso.switches.count == {"rollout base": 1, "rollout full weights": 1, "trainer base": 1}
    shared = simulate(two_bases(full=True), "spread", jobs_per_engine=2, config=cfg)
    assert shared.switches.count["rollout full weights"] > 1
    assert "trainer full weights" not in shared.switches.count  # on the trainer they move with its state


@pytest.mark.parametrize(
    "case, expected",
    [
        ("spread+backfill", (9948.539531341687, 318.9793625537873, 188.17326802221504, 1792, 0, 127325.57364514476)),
        ("pack, swaps", (16896.025795972382, 247.79194187953502, 188.23988773716198, 1792, 221, 210573.05953808618)),
    ],
)
def test_without_train_grouping_a_replay_is_what_it_was_before_the_option(case, expected):
    """The figures of these replays before shared passes came to the simulator: with the option
    off (the default) nothing in a replay changes."""
    if case == "pack, swaps":
        r = simulate(burst(), "pack", jobs_per_engine=8, config=SimConfig(device_slots=1, host_gb=4.5))
    else:
        r = simulate(burst(), "spread+backfill", jobs_per_engine=4)
    got = (
        r.makespan_s,
        r.gpu_hours,
        r.busy_gpu_hours,
        r.tasks,
        r.swaps.swap_ins,
        sum(o.finished_s for o in r.outcomes),
    )
    assert got == pytest.approx(expected, rel=1e-12)
    assert not r.train_grouping and r.passes.passes == 0
    full = simulate(two_bases(full=True), "spread", jobs_per_engine=2, config=SimConfig(macro_steps=4, rollout_slots=1))
    assert (full.makespan_s, full.switches.count) == (
        pytest.approx(556.64, rel=1e-12),
        {"rollout base": 4, "rollout full weights": 4, "trainer base": 1},
    )


def test_planned_trainer_widths_come_from_the_memory_plan_and_are_off_by_default() -> None:
    from daemon.simulator import planned_trainer_gpus
    from daemon.trace import generate_trace

    trace = generate_trace(30, 128, 10.0, 1, 1.6, scenario="mixed")
    widths = planned_trainer_gpus(trace, SimConfig())
    assert widths["7B"] == 4 and all(1 <= w <= 8 for w in widths.values())
    old = simulate(trace, "spread+backfill", 128, config=SimConfig(macro_steps=4))
    new = simulate(trace, "spread+backfill", 128, config=SimConfig(macro_steps=4, planned_trainer_widths=True))
    assert new.makespan_s == old.makespan_s and new.gpu_hours < old.gpu_hours  # narrower trainers, same schedule


def test_an_elastic_allocation_charges_what_it_held_and_gives_idle_pairs_back(small):
    """The allocation-level charge: a fixed allocation holds every GPU from the first arrival to
    the last finish; an elastic one (``daemon.elastic``'s rule) holds its base pairs, grows while
    jobs wait and gives idle pairs back, so it is charged less, never less than its engines held."""
    fixed = simulate(small, "pack+backfill", jobs_per_engine=4)
    assert fixed.allocation.gpu_hours == pytest.approx(small.gpus * fixed.makespan_s / 3600)
    assert fixed.allocation.joins == 0 and fixed.allocation.peak_gpus == small.gpus
    cfg = SimConfig(elastic=True, join_wait_s=600.0, engine_start_s=300.0)
    elastic = simulate(small, "pack+backfill", jobs_per_engine=4, config=cfg)
    a = elastic.allocation
    assert elastic.jobs == len(small.jobs) and elastic.steps == small.steps  # nothing lost
    assert a.joins > 0 and 0 < a.releases <= a.joins and a.peak_gpus <= small.gpus
    assert elastic.gpu_hours <= a.gpu_hours < fixed.allocation.gpu_hours
    assert elastic.busy_gpu_hours < elastic.gpu_hours
    # the base allocation: one pair of every class from the first arrival to the last finish
    base = sum(2 * 8 for _ in partition(small, small.gpus))
    assert a.gpu_hours >= base * elastic.makespan_s / 3600
    # isolated jobs are allocations of their own: charged what their engines held, elastic or not
    iso = simulate(small, "isolated", config=cfg)
    assert iso.allocation.gpu_hours == iso.gpu_hours and iso.allocation.joins == 0
    # a pair joins only after the rule's wait, Slurm's queue and the engines' start: slower to
    # join, never faster to finish
    slow = simulate(small, "pack+backfill", jobs_per_engine=4, config=SimConfig(elastic=True, join_wait_s=86_400.0))
    assert slow.makespan_s > elastic.makespan_s
