"""Shared train passes in the simulator (``SimConfig.train_grouping``): the cost model against
the benchmark it is fitted to, the trainer time grouping saves for small LoRA jobs on one base,
the steps that never share a pass (full fine-tuning, another base), and the command's option."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from daemon.simulate import main as simulate_main
from daemon.simulator import SimConfig, TrainPassCost, simulate
from daemon.trace import Trace, TraceJob, write_trace

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "results" / "train_batching.json"


def bench_result() -> dict:
    """The committed benchmark result, or one of the same shape (8 jobs, 8 and 32 rows)."""
    if BENCH.exists():
        return json.loads(BENCH.read_text())
    figures = {8: (0.01446, 0.00941), 32: (0.03415, 0.02782)}
    return {
        "results": [
            {"rows": r, "jobs": 8, "alone_s_per_job_step": a, "grouped_s_per_job_step": g}
            for r, (a, g) in figures.items()
        ]
    }


def test_the_cost_model_defaults_are_the_fit_of_the_benchmark_and_reproduce_it():
    data = bench_result()
    fit = TrainPassCost.fit(data)
    default = TrainPassCost()
    for name in ("pass_s", "job_s", "token_s", "crowding"):
        assert getattr(default, name) == pytest.approx(getattr(fit, name), rel=0.01), name
    for r in (r for r in data["results"] if r["jobs"] == 8):  # the measured speedup at 8 jobs, both row counts
        tokens = r["rows"] * 28
        alone = fit.alone_s(tokens)
        grouped = fit.pass_seconds([(alone, tokens)] * 8) / 8
        assert alone / grouped == pytest.approx(r["alone_s_per_job_step"] / r["grouped_s_per_job_step"], rel=1e-6)
    # a pass of one step takes its seconds alone; a pass of small steps takes less than they do alone
    assert default.pass_seconds([(30.0, 224)]) == pytest.approx(30.0)
    assert default.pass_seconds([(30.0, 224), (10.0, 224)]) < 40.0
    with pytest.raises(ValueError, match="needs two"):
        TrainPassCost.fit({"results": data["results"][:1]})


def lora_jobs(n: int = 8, full: tuple[int, ...] = (), bases: tuple[str, ...] = ("qwen2.5-7b",), weights: int = 0):
    """n one-pair 7B-class jobs sharing one engine pair, trainer-bound: their train steps queue."""
    jobs = [
        TraceJob(
            job_id=f"s{i}",
            model="7B",
            base=bases[i % len(bases)],
            gpus=16,
            arrival_s=float(i),
            steps=8,
            generate_s=5.0,
            tail_share=0.8,
            tool_s=0.0,
            reward_s=2.0,
            train_s=10.0,
            state_bytes=(40 << 30) if i in full else 1 << 28,
            full_weights=i in full,
            weights_bytes=weights,
            seed=i,
        )
        for i in range(n)
    ]
    return Trace(jobs=jobs, gpus=16)


def test_grouping_small_lora_jobs_on_one_base_takes_fewer_trainer_seconds():
    trace = lora_jobs()
    alone = simulate(trace, "spread+backfill", jobs_per_engine=8, config=SimConfig(device_slots=8))
    grouped = simulate(
        trace, "spread+backfill", jobs_per_engine=8, config=SimConfig(device_slots=8, train_grouping=True)
    )
    assert grouped.train_grouping and grouped.steps == alone.steps == trace.steps
    assert grouped.passes.passes > 0 and grouped.passes.largest > 1
    assert grouped.trainer_busy_s < alone.trainer_busy_s
    # the same steps (durations are drawn per job in a fixed order), no swaps: the difference is the passes'
    assert alone.trainer_busy_s - grouped.trainer_busy_s == pytest.approx(grouped.passes.saved_s, rel=1e-9)
    assert grouped.makespan_s <= alone.makespan_s
    # the worker runs a pass in chunks of what its device holds
    chunked = simulate(
        trace, "spread+backfill", jobs_per_engine=8, config=SimConfig(device_slots=2, train_grouping=True)
    )
    assert chunked.passes.largest == 2 and chunked.steps == trace.steps
    # a longer window waits for more steps: larger passes
    waiting = simulate(
        trace,
        "spread+backfill",
        jobs_per_engine=8,
        config=SimConfig(device_slots=8, train_grouping=True, group_window_s=30.0),
    )
    assert waiting.passes.largest == 8 and waiting.steps == trace.steps
    # isolated, a trainer holds one job: nothing to share
    assert simulate(trace, "isolated", config=SimConfig(train_grouping=True)).passes.passes == 0


@pytest.mark.parametrize("weights", [0, 16 * 10**9], ids=["weights-unsized", "weights-sized"])
def test_full_fine_tuning_and_other_bases_never_share_a_pass(weights):
    trace = lora_jobs(8, full=(0, 5), bases=("qwen2.5-7b", "llama-3.1-8b"), weights=weights)
    by_id = {j.job_id: j for j in trace.jobs}
    r = simulate(
        trace,
        "spread+backfill",
        jobs_per_engine=8,
        config=SimConfig(device_slots=8, train_grouping=True),
        record_intervals=True,
    )
    assert r.steps == trace.steps
    passes = defaultdict(list)  # a trainer runs one thing at a time: steps with one span shared a pass
    for engine, job, start, end in r.intervals:
        if engine.endswith("/t"):
            passes[(engine, start, end)].append(by_id[job])
    shared = [members for members in passes.values() if len(members) > 1]
    assert len(shared) == r.passes.passes > 0
    assert sum(len(m) for m in shared) == r.passes.steps
    for members in shared:
        assert not any(j.full_weights for j in members), [j.job_id for j in members]
        assert len({j.base for j in members}) == 1, [j.job_id for j in members]
    assert {j.base for m in shared for j in m} == {"qwen2.5-7b", "llama-3.1-8b"}


def test_the_command_runs_every_policy_with_train_grouping(tmp_path):
    write_trace(tmp_path / "trace.jsonl", lora_jobs())
    out = tmp_path / "out.json"
    argv = [
        str(tmp_path / "trace.jsonl"),
        "--gpus",
        "16",
        "--workers",
        "1",
        "--train-grouping",
        "--group-window-ms",
        "2",
    ]
    assert simulate_main([*argv, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["config"]["train_grouping"] is True and data["config"]["group_window_s"] == 0.002
    assert data["config"]["train_cost"]["pass_s"] == TrainPassCost().pass_s
    shared = data["policies"]["spread+backfill"]  # 4 jobs a trainer
    assert shared["train_grouping"] and shared["passes"]["passes"] > 0 and shared["trainer_busy_s"] > 0
    assert data["policies"]["isolated"]["passes"]["passes"] == 0
    assert simulate_main([*argv, "--train-tokens", "0", "--out", str(out)]) == 2
