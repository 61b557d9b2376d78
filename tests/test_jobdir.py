"""A job directory's layout (``plexctl.common.jobdir``): the names on disk, their parsing, and
what reads them back (``latest.json``, the published adapters, a checkpoint of the job)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from daemon import jail
from plexctl.common.jobdir import JobDir, LatestCheckpoint


def test_the_layout_on_disk(tmp_path: Path) -> None:
    job = JobDir(tmp_path)
    assert job.adapter(12) == tmp_path / "adapters" / "v000012"
    assert job.adapter(1_234_567) == tmp_path / "adapters" / "v1234567"
    assert job.checkpoint(40) == tmp_path / "ckpt" / "step-000040"
    assert job.checkpoint(0) == tmp_path / "ckpt" / "step-000000"
    assert (job.adapters, job.checkpoints, job.latest_file) == (
        tmp_path / "adapters",
        tmp_path / "ckpt",
        tmp_path / "ckpt" / "latest.json",
    )
    files = (job.spec, job.inputs, job.driver_log, job.driver_pid, job.driver_exit, job.metrics)
    names = ("spec.json", "inputs.json", "driver.log", "driver.pid", "driver.exit", "metrics.jsonl")
    assert files == tuple(tmp_path / name for name in names)
    assert (job.driver_out, job.driver_keys) == (tmp_path / "driver", tmp_path / "driver-keys")
    assert (job.driver_in, job.driver_image) == (tmp_path / "driver-in", tmp_path / "driver.img")


def test_the_jail_uses_the_same_names(tmp_path: Path) -> None:
    assert jail.OUT_DIR == JobDir.DRIVER_OUT
    given = jail.given_dir(tmp_path)  # the daemon's directory of what a jailed job is given
    assert given == JobDir(tmp_path).driver_in and oct(given.stat().st_mode & 0o777) == "0o755"
    assert f"{jail.JAIL_ROOT}/in/{JobDir.SPEC}" in jail.driver_args("j0001")


@pytest.mark.parametrize("n", [0, 1, 12, 999_999, 1_000_000, 12_345_678])
def test_names_parse_back(n: int) -> None:
    assert JobDir.parse_version(JobDir.adapter_name(n)) == n
    assert JobDir.parse_step(JobDir.checkpoint_name(n)) == n


@pytest.mark.parametrize(
    "name",
    [
        "v12",  # not six digits
        "v0000012",  # a leading zero too many
        "v-00001",
        "v",
        "V000012",
        "v000012 ",
        "v00001a",
        "v\u0660\u0660\u0660\u0660\u0661\u0662",  # Arabic-Indic digits: int() reads them, the layout does not
        ".v000012.tmp",
        "step-000012",  # a checkpoint's name is not a version
        "latest",
        "latest.json",
        "",
    ],
)
def test_names_that_are_not_a_version_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="is not an adapter version"):
        JobDir.parse_version(name)


@pytest.mark.parametrize(
    "name", ["step-12", "step-0000012", "step--00001", "step000012", ".step-000012.tmp", "v000012", "latest", ""]
)
def test_names_that_are_not_a_step_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="is not a checkpoint step"):
        JobDir.parse_step(name)


def test_negative_versions_and_steps_have_no_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        JobDir(tmp_path).adapter(-1)
    with pytest.raises(ValueError):
        JobDir(tmp_path).checkpoint(-1)


def test_latest_checkpoint_round_trips(tmp_path: Path) -> None:
    job = JobDir(tmp_path)
    assert job.latest_checkpoint() is None  # none yet
    job.checkpoints.mkdir()
    job.write_latest(LatestCheckpoint(dir=str(job.checkpoint(3)), step=3, policy_version=2))
    assert json.loads(job.latest_file.read_text()) == {"dir": str(job.checkpoint(3)), "step": 3, "policy_version": 2}
    manifest = {"format": 1, "files": {"a": "b"}}
    job.write_latest(LatestCheckpoint(dir=str(job.checkpoint(4)), step=4, policy_version=3, manifest=manifest))
    assert job.latest_checkpoint() == LatestCheckpoint(
        dir=str(job.checkpoint(4)), step=4, policy_version=3, manifest=manifest
    )
    assert [p.name for p in job.checkpoints.iterdir()] == ["latest.json"]  # written atomically: no temp file left


def test_a_malformed_latest_is_a_value_error(tmp_path: Path) -> None:
    job = JobDir(tmp_path)
    job.checkpoints.mkdir()
    for text in ("not json", "[]", '{"step": 1}'):
        job.latest_file.write_text(text)
        with pytest.raises(ValueError):
            job.latest_checkpoint()


def test_published_adapters_are_the_versions_with_files_in_order(tmp_path: Path) -> None:
    job = JobDir(tmp_path)
    assert job.published_adapters() == []  # no adapters directory yet
    for version in (2, 10, 1_000_000, 999_999):
        job.adapter(version).mkdir(parents=True)
        (job.adapter(version) / "adapter_model.safetensors").write_bytes(b"x")
    job.adapter(11).mkdir()  # being written: empty
    for stray in (".v000012.tmp", "v12", "notes"):
        (job.adapters / stray).mkdir()
        (job.adapters / stray / "f").write_bytes(b"x")
    (job.adapters / "v000013").write_bytes(b"a file, not a directory")
    assert job.published_adapters() == [job.adapter(v) for v in (2, 10, 999_999, 1_000_000)]


def test_is_checkpoint(tmp_path: Path) -> None:
    job, other = JobDir(tmp_path / "a"), JobDir(tmp_path / "b")
    for d in (job.checkpoint(1), other.checkpoint(1), job.checkpoints / "latest", job.adapter(1)):
        d.mkdir(parents=True)
    assert job.is_checkpoint(job.checkpoint(1))
    assert not job.is_checkpoint(job.checkpoint(2))  # not there
    assert not job.is_checkpoint(other.checkpoint(1))  # another job's
    assert not job.is_checkpoint(job.checkpoints / "latest")  # not a step's name
    assert not job.is_checkpoint(job.adapter(1))
    assert not job.is_checkpoint(job.checkpoints)
