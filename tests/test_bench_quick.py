"""The swap, daemon, overhead, status-load, Tinker and train-batching benchmarks still run, in ``--quick`` mode, and
write JSON of the shape README's results table is generated from. Benchmarks are programs,
not tests: nothing here asserts on a time, a throughput figure or whether a target was met,
only that the numbers are there and sane."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
PATHS = {"device->host", "host->device", "host->nvme", "nvme->host"}


def run_quick(script: str, out: Path, timeout: float = 900) -> dict:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"bench/{script} --quick -> {proc.returncode}\n{tail}"
    return json.loads(out.read_text())


def test_swap_quick_reports_every_path_and_size_against_raw(tmp_path: Path) -> None:
    result = run_quick("swap.py", tmp_path / "swap.json")
    assert result["quick"] is True
    sizes = {s["size"]: s for s in result["sizes"]}
    assert list(sizes) == ["adapter", "optimizer", "full", "model-32m"]
    assert sizes["adapter"]["bytes"] < sizes["optimizer"]["bytes"] < sizes["full"]["bytes"]
    assert sizes["full"]["bytes"] == pytest.approx(64 << 20, rel=0.05)
    # a whole-model state: bf16 weights, fp32 masters and two fp32 moments, at most the size asked for
    whole = sizes["model-32m"]
    assert whole["kind"] == "whole model" and 16 << 20 < whole["bytes"] <= 32 << 20
    parts = whole["parts"]
    assert (
        parts["master.float32"] == 2 * parts["weights.bfloat16"]
        and parts["optim.float32"] == 2 * parts["master.float32"]
    )
    for size in sizes.values():
        paths = {p["path"]: p for p in size["paths"]}
        assert set(paths) == PATHS
        for row in paths.values():
            assert row["gbps"] > 0 and row["raw_gbps"] > 0 and row["raw_same_memory_gbps"] > 0, row
            assert row["raw_same_memory"].startswith("same.") and not row["raw"].startswith("same."), row
            assert row["pct_of_raw"] == pytest.approx(row["gbps"] / row["raw_gbps"])
            assert row["pct_of_raw_same_memory"] == pytest.approx(row["gbps"] / row["raw_same_memory_gbps"])
            assert row["meets_target"] == (row["pct_of_raw_same_memory"] >= result["target_pct_of_raw"])
            # every figure is the median of as many interleaved runs as the path's own
            runs = size["samples"][f"store.{row['path']}"]["seconds"]
            assert row["seconds"] == pytest.approx(statistics.median(runs))
            assert len(size["samples"][row["raw_same_memory"]]["seconds"]) == len(runs)
    summary = result["summary"]
    assert len(summary["meets_target"]) + len(summary["below_target"]) == 4 * len(PATHS)
    assert result["conditions"]  # the raw figures' conditions are stated beside them
    hidden = result["hidden_behind_compute"]
    assert hidden["available"] or hidden["missing"]  # a share per mode, or what the multiplex JSON lacks
    # the width axis: a full job's state on 1 and 2 ranks, each rank moving its own shard through every tier
    one, two = result["widths"]
    assert (one["width"], two["width"]) == (1, 2) and len(two["bytes_per_rank"]) == 2
    assert max(two["bytes_per_rank"]) < one["bytes_per_rank"][0] < two["bytes_total"]  # the lm_head is whole on each
    for row in (one, two):
        for move in row["directions"].values():
            assert len(move["rank_s"]) == row["width"] and move["slowest_s"] >= max(move["rank_s"]) > 0


def test_daemon_quick_reports_round_trip_and_throughput(tmp_path: Path) -> None:
    result = run_quick("daemon_rtt.py", tmp_path / "daemon.json")
    assert result["quick"] is True
    rtt = result["round_trip"]
    assert rtt["requests"] > 0
    assert 0 < rtt["p50_ms"] <= rtt["p90_ms"] <= rtt["p99_ms"] <= rtt["max_ms"]
    load = result["throughput"]
    assert load["clients"] == 100
    assert load["replies"] > 0 and load["msgs_per_s"] > 0
    assert load["errors"] == 0
    assert set(result["met"]) == {"p50", "msgs_per_s"}
    if result["profile"] is not None:  # only when a target was missed
        assert result["profile"]["top_by_self_time"]


def test_overhead_quick_runs_the_same_job_in_process_and_through_the_daemon(tmp_path: Path) -> None:
    result = run_quick("overhead.py", tmp_path / "overhead.json")
    assert result["quick"] is True and result["steps"] == 12
    assert result["turns"] >= 4  # the two jobs took turns
    for mode in ("in-process", "daemon"):
        assert result["phases_median"][mode]["steps_timed"] > 0
    assert result["in_process_step_s"] > 0 and result["daemon_step_s"] > 0
    assert result["overhead"] == pytest.approx(result["daemon_step_s"] / result["in_process_step_s"] - 1)
    assert result["same_rewards"] is True  # the same loop on the same engines learns the same


def test_status_load_quick_serves_status_calls_while_the_jobs_run(tmp_path: Path) -> None:
    result = run_quick("status_load.py", tmp_path / "status_load.json")
    assert result["quick"] is True and result["rounds"] == 1
    phases = result["phases"]
    assert [(p["phase"], p["status_load"]) for p in phases] == [
        ("baseline-1", False),
        ("load-1", True),
        ("baseline-2", False),
    ]
    for phase in phases:
        assert set(phase["jobs"]) == set(result["jobs"])
        for job in phase["jobs"].values():
            assert job["steps"] == result["steps"] and job["timed_steps"] == result["steps"] - result["warmup"]
            assert job["step_s_mean"] > 0
            assert 0 < job["generate_s_mean"] + job["train_s_mean"] < job["step_s_mean"]  # the parts of a step
    status = result["status"]
    assert status["reported_procs"] == status["procs"] == 8  # every client process reported
    assert status["ok"] > 0 and status["errors"] == 0 and status["timeouts"] == 0
    assert status["ok"] <= status["sent"] and status["missed"] == status["offered"] - status["ok"]
    lat = status["latency_ms"]
    assert lat["count"] == status["ok"] and 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert all(s["count"] > 0 for s in status["latency_ms_by_call"].values())  # status() and status(NAME)
    summary = result["summary"]
    assert summary["ratio"] > 0 and summary["control_ratio"] >= 1
    assert set(summary["parts_ratio"]) == {"generate", "train", "rest"} and all(summary["parts_ratio"].values())
    assert set(result["met"]) == {"rate", "no_errors", "bound", "fixed_bound"}
    assert result["met"]["no_errors"] is True
    assert summary["same_rewards"] is True  # the status load does not change what the jobs learn


def test_tinker_quick_times_both_paths_of_each_call_and_an_rl_step(tmp_path: Path) -> None:
    pytest.importorskip("tinker")
    result = run_quick("tinker_latency.py", tmp_path / "tinker.json")
    for call in ("fb", "sample"):
        for path in ("http", "native"):
            timing = result[f"{call}_{path}"]
            assert timing["n"] == result["calls"] and 0 < timing["p50_ms"] <= timing["p99_ms"]
        added = result[f"{call}_added"]
        assert added["p50_ms"] == pytest.approx(result[f"{call}_http"]["p50_ms"] - result[f"{call}_native"]["p50_ms"])
    rl = result["rl_step"]
    assert rl["http_median_s"] > 0 and rl["native_median_s"] > 0 and rl["steps"] == 2


def test_train_batching_quick_times_each_job_count_both_ways_and_compares_the_adapters(tmp_path: Path) -> None:
    result = run_quick("train_batching.py", tmp_path / "train_batching.json")
    assert [(r["rows"], r["jobs"]) for r in result["results"]] == [(8, 2), (8, 4)]
    for r in result["results"]:
        assert r["alone_s_per_job_step"] > 0 and r["grouped_s_per_job_step"] > 0
        assert r["speedup"] == pytest.approx(r["alone_s_per_job_step"] / r["grouped_s_per_job_step"])
        assert r["max_adapter_diff"] < 1e-3  # the same training, within float rounding
    assert result["met"] is None  # the target is at 8 jobs, which --quick does not run


def test_readme_results_table_is_the_one_generated_from_the_committed_json() -> None:
    """README's benchmark table comes from bench/results/*.json (bench/table.py): after a
    benchmark is run again, its figures reach README only through ``--write``."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "table.py"), "--check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def test_the_results_table_reads_each_benchmark_from_its_json(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import table
    finally:
        sys.path.remove(str(REPO / "bench"))
    overhead = json.loads((REPO / "bench" / "results" / "overhead.json").read_text())
    (tmp_path / "overhead.json").write_text(json.dumps({**overhead, "overhead": 0.2, "daemon_step_s": 0.5}))
    rows = {line.split(":", 1)[0].strip("| "): line for line in table.table(tmp_path).splitlines()[2:]}
    assert "+20.0 %" in rows["overhead"] and "0.500 vs" in rows["overhead"] and rows["overhead"].endswith("| **no** |")
    assert "not run" in rows["swap"]  # no swap.json in that directory


def test_gpu_check_runs_the_worker_wiring_end_to_end_in_quick_mode_on_cpu(tmp_path: Path) -> None:
    """The GPU acceptance script, shrunk and on CPU: every part runs through the worker's own
    engine wiring (so the script a lent GPU machine runs is not broken when it is lent)."""
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py"), "--quick", "--device", "cpu", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    parts = json.loads(out.read_text())["parts"]
    assert parts["trainer"]["vocab"] == 151936 and parts["trainer"]["tokens_per_second"] > 0
    assert parts["swap"]["swaps"] > 0 and parts["swap"]["swap_over_raw"] > 0
    assert parts["rollout"]["base_sequences"] == parts["rollout"]["adapter_sequences"] > 0
    # a whole-model weight load is timed beside a raw copy; sleep/wake needs CUDA and says so
    assert parts["weights"]["bytes"] > 0 and parts["weights"]["load_over_raw"] > 0
    assert parts["sleep_wake"]["skipped"].startswith("needs CUDA")
    # the base sleeps in its arena and wakes the same; the peer's step of the same shape is timed beside
    assert parts["trainer_sleep"]["same_logprobs_after_wake"] is True and parts["trainer_sleep"]["sleep_over_raw"] > 0
    assert parts["peer"]["rows"] == parts["trainer"]["rows"] and parts["peer"]["trainer_over_peer"] > 0
    assert parts["jobs"]["one_at_a_time"]["jobs"] == 8 and parts["jobs"]["one_at_a_time"]["tokens_per_second"] > 0
    assert parts["jobs"]["grouped"]["jobs"] == 8 and parts["jobs"]["grouped"]["tokens_per_second"] > 0
    assert parts["jobs"]["grouped_speedup"] > 0
    assert "mfu" not in parts["trainer"] and "mfu" not in parts["peer"]  # a CPU's peak is not in the table
    # a trainer engine of 2 ranks beside one of 1: the same step, each rank holding what the plan counts
    wide = parts["wide"]
    one, two = wide["widths"]["1"], wide["widths"]["2"]
    assert one["loss"] == pytest.approx(two["loss"], rel=1e-5)
    for row, ranks in ((one, 1), (two, 2)):  # the plan counts the model's parameters to within a norm's
        planned = pytest.approx(row["plan_base_bytes_per_rank"], rel=1e-4)
        assert len(row["base_bytes_per_rank"]) == ranks and all(b == planned for b in row["base_bytes_per_rank"])
    assert two["state_bytes_per_rank"] == one["state_bytes_per_rank"] * 2  # a LoRA job's state, whole on each rank
    assert wide["speedup"] > 0 and "says nothing of GPUs" in wide["note"]


def gpu_check_module() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_counts_model_flops_and_mfu_as_the_h200_figures_do() -> None:
    """The pure pieces behind gpu.json's MFU, held to /work/shared/gpu's H200 rows: 59,278 tokens/s
    at the 0.5B shape was 12.4 %, 19,911 at 3B 25.5 %, the peer's 15,151 at 3B 19.4 %."""
    check = gpu_check_module()
    peak = check.peak_tflops("NVIDIA H200")
    assert peak == 989.0 and check.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert check.peak_tflops("NVIDIA GeForce RTX 4090") is None and check.peak_tflops(None) is None
    for shape, tokens_per_second, expected in (("0.5b", 59_278, 0.124), ("3b", 19_911, 0.255), ("3b", 15_151, 0.194)):
        flops = check.model_flops_per_token(check.SHAPES[shape], 1024)
        assert check.mfu(tokens_per_second, flops, peak) == pytest.approx(expected, abs=0.0006)
    assert check.mfu(1000.0, 1e9, None) is None
    seven = check.SHAPES["7b"]  # Qwen2.5-7B: 7.07B matmul parameters in the decoder and head
    assert (seven["hidden_size"], seven["num_hidden_layers"], seven["vocab_size"]) == (3584, 28, 152064)
    assert check.micro_rows(16384, 1024) == 16 and check.micro_rows(16384, 32768) == 1


def test_structure_counts_every_setting_and_names_the_largest_class(tmp_path: Path) -> None:
    """``bench/structure.py`` reads the source only; its figures name real classes and every setting."""
    import msgspec

    from plexctl.common.cluster_config import ClusterConfig

    out = run_quick("structure.py", tmp_path / "structure.json", timeout=120)
    assert out["settings"] == len(msgspec.structs.fields(ClusterConfig))
    assert out["forms_per_setting_max"] >= 1 and out["forms_per_setting_mean"] >= 1
    big = out["largest_class"]
    assert f"class {big['name']}" in (REPO / big["file"]).read_text()
    assert out["largest_class_with_bases"]["lines"] >= big["lines"]
    assert out["state_per_part_max"] == max(out["state_per_part"].values())
