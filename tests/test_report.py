"""`plexctl report`: PNG curves of two real jobs overlaid and the cluster's engine timeline.

Two small jobs of this module's own on the session's cluster; the images are opened with
Pillow (valid PNG, plausible size) rather than compared pixel by pixel.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from plexctl.common.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny-arith.yaml")

pytest.importorskip("matplotlib")


def assert_png(path: Path, min_size: tuple[int, int]) -> None:
    from PIL import Image

    assert path.exists(), path
    assert 5_000 < path.stat().st_size < 400_000, path.stat().st_size
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        assert img.format == "PNG" and img.size[0] >= min_size[0] and img.size[1] >= min_size[1], img.size
        colors = img.convert("RGB").getcolors(maxcolors=1 << 16)
        assert colors is None or len(colors) > 10, "a blank image"


@pytest.fixture(scope="module")
def two_jobs(cluster) -> list[str]:
    jobs = [
        cluster.run(
            "submit", TINY, "--set", "algo.steps=6", "--set", f"seed={seed}", "--name", f"rep{seed}", "-q", check=True
        ).stdout.strip()
        for seed in (0, 1)
    ]
    for job in jobs:
        cluster.run("wait", job, "--timeout", "300", check=True)
    return jobs


def test_report_overlays_two_jobs(cluster, two_jobs, tmp_path):
    a, b = two_jobs
    out = cluster.run("report", a, "--vs", "rep1", "--out", str(tmp_path), check=True).stdout.split()
    assert out == [str(tmp_path / f"{a}-vs-{b}-reward.png"), str(tmp_path / f"{a}-vs-{b}-loss.png")]
    for path in out:
        assert_png(Path(path), (600, 350))
    single = cluster.run("report", a, "--out", str(tmp_path), check=True).stdout.split()
    assert [Path(p).name for p in single] == [f"{a}-reward.png", f"{a}-loss.png"]


def test_report_cluster_timeline(cluster, two_jobs, tmp_path):
    out = cluster.run("report", "--cluster", "--out", str(tmp_path), check=True).stdout.split()
    assert out == [str(tmp_path / "cluster-timeline.png")]
    assert_png(Path(out[0]), (900, 300))


def test_timeline_data_comes_with_status(cluster, two_jobs, monkeypatch):
    from plexctl.common.client import Client
    from plexctl.common.cluster import read_endpoint

    monkeypatch.setenv("PLEXRL_HOME", str(cluster.home))  # this client's own key lives there
    rep = Client(read_endpoint(cluster.state_dir).address).status(timeline=True)
    mine = [s for s in rep.timeline if s.job_id in two_jobs]
    assert {s.method for s in mine} >= {"generate", "train_step"}  # a step publishes in its train_step call
    assert all(s.end >= s.start >= rep.started_at for s in mine)
    engines = {e.engine_id for e in rep.engines}
    assert {s.engine_id for s in mine} <= engines
    assert Client(read_endpoint(cluster.state_dir).address).status().timeline == []  # only when asked


def test_report_without_arguments_is_a_usage_error(cluster):
    proc = cluster.run("report")
    assert proc.returncode == 2 and "--cluster" in proc.stderr


def test_missing_matplotlib_is_one_line_with_the_pip_command(monkeypatch):
    from plexctl.cli import report

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(UsageError, match=r"pip install 'plexrl\[plots\]'"):
        report.pyplot()


def test_timeline_draws_background_moves_under_the_trainer_row(tmp_path):
    """A made-up status: the trainer's background moves in the window are drawn (and counted in
    the legend), those outside it are not; the image is a valid PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from plexctl.cli import report
    from plexctl.common.protocol import BusySpan, EngineInfo, JobInfo, MoveSpan, StatusRep, SwapMark

    engines = [
        EngineInfo("w0/rollout", "w0", "rollout", "m", True, [], [], 0.0, 0),
        EngineInfo("w1/trainer", "w1", "trainer", "m", True, [], [], 0.0, 0),
    ]
    jobs = [JobInfo(j, j, "u", "running", 1, 2, None, None, None, 0, "", 0.0, 0.0, None, "", 0) for j in ("a", "b")]
    spans = [
        BusySpan("w0/rollout", "a", "generate", 0.0, 2.0),
        BusySpan("w1/trainer", "b", "train_step", 1.0, 3.0),
        BusySpan("w0/rollout", "b", "generate", 3.0, 5.0),
        BusySpan("w1/trainer", "a", "train_step", 5.0, 6.0),
    ]
    moves = [MoveSpan("w1/trainer", "a", "nvme->host", 1.5, 2.5), MoveSpan("w1/trainer", "b", "host->nvme", 9.0, 9.5)]
    rep = StatusRep(
        jobs=jobs,
        engines=engines,
        now=10.0,
        timeline=spans,
        moves=moves,
        swap_marks=[SwapMark("w1/trainer", "a", 5.0, 1024, 0.01)],
    )
    fig, ax = plt.subplots()
    try:
        color = {"a": "red", "b": "blue"}
        assert report._timeline_axis(ax, rep, ["w0/rollout", "w1/trainer"], color, 0.0, 6.0, 0.0) == (1, 1)
        assert report._timeline_axis(ax, rep, ["w0/rollout", "w1/trainer"], color, 0.0, 1.0, 0.0) == (0, 0)
    finally:
        plt.close(fig)
    assert_png(report.cluster_timeline(rep, tmp_path / "t.png"), (900, 300))
