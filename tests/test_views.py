"""What users watch: `plexctl top` (text and JSON), Prometheus metrics, TensorBoard events, completion.

Pure renderings are checked on a made-up status; the rest on the session's real cluster (one
small job of this module's own) and on a bare daemon started with ``--metrics-port``.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import json_file

from daemon.metrics import Telemetry, hidden_by_other_jobs
from plexctl.cli.top import JobHistory, TopFrame, eta, plain_top, top_json, top_view
from plexctl.cli.views import plain_jobs, sparkline
from plexctl.common.protocol import TRAINS_ADAPTER, TRAINS_ALL, BusySpan, EngineInfo, JobInfo, MoveSpan, StatusRep
from plexctl.metric_sinks import MetricSinks

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny-arith.yaml")
METRIC_NAMES = (
    "plexrl_jobs",
    "plexrl_engine_utilization",
    "plexrl_bubble_ratio",
    "plexrl_interactive_share",
    "plexrl_interactive_queued",
    "plexrl_swap_bytes_total",
    "plexrl_swap_seconds_total",
    "plexrl_task_seconds",
    "plexrl_call_latency_seconds",
)


def test_swap_time_hidden_counts_other_jobs_busy_time_on_any_engine_once():
    """The multiplex benchmark's hidden share: a background move is hidden while another job's
    task runs on some engine; its own job's tasks do not hide it, overlaps count once."""
    spans = [
        BusySpan("w0/rollout", "b", "generate", 0.0, 4.0),
        BusySpan("w1/trainer", "c", "train_step", 3.0, 6.0),  # overlaps b's: 3..4 counted once
        BusySpan("w0/rollout", "a", "generate", 6.0, 9.0),  # the moved job's own: hides nothing
        BusySpan("w1/trainer", "b", "train_step", 8.5, 20.0),
    ]
    moves = [
        MoveSpan("w1/trainer", "a", "nvme->host", 2.0, 10.0),  # hidden 2..6 and 8.5..10
        MoveSpan("w1/trainer", "b", "host->nvme", 1.0, 2.0),  # only b busy then: 0
        MoveSpan("w1/trainer", "a", "nvme->host", 30.0, 31.0),
    ]  # nothing runs: 0
    assert hidden_by_other_jobs(moves, spans) == pytest.approx(4.0 + 1.5)
    assert hidden_by_other_jobs([], spans) == 0 and hidden_by_other_jobs(moves, []) == 0
    telemetry = Telemetry()
    telemetry.moved("w1/trainer", [["nvme->host", "a", 2.0, 10.0]])
    assert telemetry.moves_since(0.0) == [moves[0]] and telemetry.moves_since(5.0) == []


def made_up_frame() -> TopFrame:
    now = 1000.0
    job = JobInfo(
        "j0001",
        "arith",
        "alice",
        "running",
        30,
        40,
        0.41,
        0.37,
        None,
        30,
        "w0/rollout,w1/trainer",
        900.0,
        910.0,
        None,
        "",
        0,
        state_tier="w1/trainer:host",
    )
    engine = EngineInfo(
        "w1/trainer",
        "w1",
        "trainer",
        "m",
        True,
        ["j0001"],
        ["j0001"],
        45.0,
        120,
        tiers={
            "device": {"unit": "slots", "capacity": 1, "jobs": []},
            "host": {"unit": "bytes", "used_bytes": 4096, "jobs": ["j0001"]},
        },
        swaps={"host->device": {"count": 3, "bytes": 3 << 20, "seconds": 0.1}},
    )
    hist = JobHistory()
    for step in range(21, 31):
        hist.add({"time": 900.0 + 3 * step, "step": step, "reward_mean": step / 40, "staleness": 1, "train/loss": 0.01})
    rep = StatusRep(
        jobs=[job], engines=[engine], now=now, policy="spread+backfill", bubble_ratio=0.25, started_at=now - 90.0
    )
    return TopFrame(rep, {"j0001": hist}, uptime=90.0, busy_delta={"w1/trainer": 0.5})


def test_sparkline_scales_between_min_and_max():
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([0.3, 0.3]) == "▄▄"
    assert sparkline([]) == ""
    assert len(sparkline(list(range(100)), width=24)) == 24


def test_top_renders_progress_eta_sparkline_staleness_and_tiers():
    frame = made_up_frame()
    job = frame.rep.jobs[0]
    # 3 s per step over the last 10 steps, 10 steps left, the last step 10 s ago: 20 s left
    assert eta(job, frame.history["j0001"], frame.rep.now) == pytest.approx(20.0)
    text = plain_top(frame)
    assert "30/40" in text and "75%" in text and "20s" in text and "v30" in text
    assert sparkline(frame.history["j0001"].rewards) in text
    assert "w1/trainer:host" in text and "50%" in text  # where the state lives; utilization (45 s of 90)
    assert "3 (3.0 MiB, 0.10 s)" in text and "host 1 (4.0 KiB)" in text
    data = top_json(frame)
    assert json.loads(json.dumps(data)) == data
    j = data["jobs"][0]
    assert j["eta_s"] == pytest.approx(20.0) and j["progress"] == 0.75 and j["staleness"] == 1
    assert len(j["recent_rewards"]) == 10
    assert data["engines"][0]["utilization"] == 0.5 and data["engines"][0]["utilization_now"] == 0.5
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(top_view(frame))
    rendered = console.export_text()
    assert "RECENT STEPS" in rendered and "STATE TIERS" in rendered and "w1/trainer:host" in rendered


def test_prometheus_text_has_every_family():
    t = Telemetry()
    t.task_done("generate", True, 0.2, 0.3)
    t.task_done("train_step", False, 1.5, None)
    text = t.render()
    for name in METRIC_NAMES:
        assert f"# TYPE {name} " in text
    assert 'plexrl_task_seconds_bucket{method="generate",outcome="ok",le="0.25"} 1' in text
    assert 'plexrl_task_seconds_count{method="train_step",outcome="error"} 1' in text


def test_tensorboard_events_mirror_the_metrics_rows(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    sinks = MetricSinks(tmp_path / "j9", "x", log=lambda line: None)
    for step in (1, 2, 3):
        sinks.write({"time": 100.0 + step, "step": step, "reward_mean": step / 10, "train/loss": 1.0 / step})
    sinks.close()
    ea = event_accumulator.EventAccumulator(str(tmp_path / "j9" / "tb"))
    ea.Reload()
    assert set(ea.Tags()["scalars"]) == {"reward_mean", "train/loss"}
    assert [(e.step, round(e.value, 4)) for e in ea.Scalars("reward_mean")] == [(1, 0.1), (2, 0.2), (3, 0.3)]


@pytest.fixture(scope="module")
def small_job(cluster) -> str:
    job = cluster.run(
        "submit", TINY, "--set", "algo.steps=6", "--set", "algo.eval_every=0", "--name", "top-me", "-q", check=True
    ).stdout.strip()
    cluster.run("wait", job, "--timeout", "300", check=True)
    return job


def test_top_plain_and_json_on_a_real_cluster(cluster, small_job):
    text = cluster.run("top", small_job, check=True).stdout  # not a TTY: one plain frame
    line = next(ln for ln in text.splitlines() if ln.startswith(small_job))
    assert "succeeded" in line and "6/6" in line and "100%" in line
    assert any(ch in line for ch in "▁▂▃▄▅▆▇█")  # the reward sparkline
    assert "ENGINE" in text and "rollout" in text and "trainer" in text and "bubble" in text
    data = json.loads(cluster.run("top", small_job, "--json", check=True).stdout)
    job = data["jobs"][0]
    assert job["job_id"] == small_job and job["progress"] == 1.0 and job["eta_s"] is None
    assert len(job["recent_rewards"]) == 6 and job["staleness"] == 0
    kinds = {e["kind"] for e in data["engines"]}
    assert kinds == {"rollout", "trainer"}
    assert all(0.0 <= e["utilization"] <= 1.0 for e in data["engines"])


def test_tensorboard_events_are_written_by_the_driver(cluster, small_job):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    tb = cluster.state_dir / "jobs" / small_job / "tb"
    assert list(tb.glob("events.out.tfevents.*")), f"no event file in {tb}"
    ea = event_accumulator.EventAccumulator(str(tb))
    ea.Reload()
    assert {"reward_mean", "train/loss", "staleness"} <= set(ea.Tags()["scalars"])
    assert [e.step for e in ea.Scalars("reward_mean")] == [1, 2, 3, 4, 5, 6]


def test_daemon_serves_prometheus_metrics(tmp_path):
    """A bare daemon (no workers) with metrics_port 0 writes its URL and serves every family."""
    from plexctl.common.cluster_config import ClusterConfig, config_path, write_config

    state = tmp_path / "state"
    write_config(config_path(state), ClusterConfig(metrics_port=0))
    env = {**os.environ, "PLEXRL_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "daemon.main", "--state-dir", str(state)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while (served := json_file(state / "metrics.json")) is None:
            assert proc.poll() is None and time.monotonic() < deadline, "daemon did not start"
            time.sleep(0.2)
        url = served["url"]
        time.sleep(2.5)  # one gauge snapshot
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            text = r.read().decode()
        for name in METRIC_NAMES:
            assert f"# TYPE {name} " in text
        assert 'plexrl_jobs{state="running"} 0' in text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert not (state / "metrics.json").exists()


def test_shell_completion_script():
    plexctl = Path(sys.executable).with_name("plexctl")
    if not plexctl.exists():
        pytest.skip("the plexctl entry point is not installed in this environment")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # the script `--show-completion` prints in bash (which detects the shell from the parent process:
    # under `sh` it refuses), asked for by name
    proc = subprocess.run(
        [str(plexctl)], capture_output=True, text=True, timeout=60, env={**env, "_PLEXCTL_COMPLETE": "source_bash"}
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "_plexctl_completion()" in proc.stdout and "complete -o default -F _plexctl_completion plexctl" in proc.stdout
    )
    # what bash then asks for: the commands that start with "to"
    proc = subprocess.run(
        [str(plexctl)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "_PLEXCTL_COMPLETE": "complete_bash", "COMP_WORDS": "plexctl to", "COMP_CWORD": "1"},
    )
    assert "top" in proc.stdout.split()


def test_status_and_top_say_whether_a_job_trains_an_adapter_or_all_weights():
    frame = made_up_frame()
    full = msgspec.structs.replace(frame.rep.jobs[0], job_id="j0002", name="full", trains=TRAINS_ALL)
    lora = msgspec.structs.replace(frame.rep.jobs[0], trains=TRAINS_ADAPTER)
    frame.rep.jobs[:] = [lora, full]
    for text in (plain_top(frame), plain_jobs(frame.rep.jobs, frame.rep.now)):
        rows = {line.split()[0]: line for line in text.splitlines() if line.startswith("j000")}
        assert "all weights" in rows["j0002"] and "adapter" not in rows["j0002"]
        assert "adapter" in rows["j0001"] and "all weights" not in rows["j0001"]


def test_swaps_say_how_much_was_whole_models_and_engines_their_switches():
    from plexctl.cli.views import plain_engines, swaps_text

    engine = made_up_frame().rep.engines[0]
    assert swaps_text(engine) == "3 (3.0 MiB, 0.10 s)"  # adapters only: as before
    engine.swaps_by_kind = {
        "adapter": {"count": 1, "bytes": 1 << 20, "seconds": 0.05},
        "model": {"count": 2, "bytes": 2 << 20, "seconds": 0.05},
    }
    assert swaps_text(engine) == "3 (3.0 MiB, 0.10 s): 1 adapter (1.0 MiB), 2 whole-model (2.0 MiB)"
    engine.switches = 4
    assert "switches: 4" in plain_engines([engine], uptime=90.0)


def _cells(table: Any) -> dict[str, list[str]]:
    """A rich table's cells as the terminal shows them, by header ("" for a bar: its header is empty)."""
    from rich.console import Console

    def shown(cell: Any) -> str:
        console = Console(width=80, record=True, file=io.StringIO())
        console.print(cell)
        return console.export_text().strip()

    return {str(col.header): [shown(c) for c in col.cells] for col in table.columns}


def test_status_and_top_show_the_same_value_in_each_column_they_share():
    from plexctl.cli.views import engines_table, jobs_table, plain_engines

    frame = made_up_frame()
    failed = msgspec.structs.replace(
        frame.rep.jobs[0],
        job_id="j0002",
        name="a-name-longer-than-twenty",
        state="failed",
        error="boom",
        ended_at=990.0,
        eval_last=0.42,
    )
    frame.rep.jobs.append(failed)
    suspect = msgspec.structs.replace(
        frame.rep.engines[0], engine_id="w0/rollout", kind="rollout", suspect=True, silent_s=12.0, switches=2
    )
    frame.rep.engines.append(suspect)
    top_jobs, top_engines = top_view(frame).renderables[:2]
    for status, top, must_share in (
        (_cells(jobs_table(frame.rep.jobs, frame.rep.now)), _cells(top_jobs), {"STATE", "EVAL first→last", "ENGINE"}),
        (_cells(engines_table(frame.rep.engines, frame.uptime)), _cells(top_engines), {"READY", "BUSY", "SWAPS"}),
    ):
        shared = status.keys() & top.keys()
        assert must_share <= shared
        for header in shared:
            assert status[header] == top[header], header
    # plain text: the same cells, each formatted the same, in both lines
    status_text = plain_jobs(frame.rep.jobs, frame.rep.now) + "\n" + plain_engines(frame.rep.engines, frame.uptime)
    top_text = plain_top(frame)
    expected = {
        "j0001": ("arith", " running ", "30/40", "0.410", "0.370 → -", "  v30 ", "w1/trainer:host"),
        "j0002": ("a-name-longer-than-t ", " failed ", "0.370 → 0.420", "error: boom"),
        "w1/trainer": ("trainer", " yes ", "  50% ", "  120  j0001 / j0001", "tiers: device 0/1", "swaps: 3 (3.0 MiB"),
        "w0/rollout": ("rollout", "suspect (12 s silent)", "switches: 2"),
    }
    for key, cells in expected.items():
        (in_status,) = [ln for ln in status_text.splitlines() if ln.startswith(key)]
        (in_top,) = [ln for ln in top_text.splitlines() if ln.startswith(key)]
        for cell in cells:
            assert cell in in_status and cell in in_top, (cell, in_status, in_top)
