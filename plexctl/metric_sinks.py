"""Copies of a job's metrics rows for TensorBoard and Weights & Biases, each only when available.

``metrics.jsonl`` stays the record (``plexctl logs --metrics``, ``plexctl report``); this module
mirrors each row into
- TensorBoard event files in ``JOB_DIR/tb/`` when the ``tensorboard`` package can be imported
  (``pip install tensorboard``; its event writer and protobufs only, never torch or TensorFlow);
- a wandb run when ``wandb`` can be imported and ``WANDB_PROJECT`` is set in the environment the
  cluster was started with (run id = job id, so a restarted driver resumes the same run).

Neither is ever required: a missing package means no copy, and a sink that fails is turned
off with one line in the job's log. A restarted driver writes a TensorBoard session start at
its first step, so TensorBoard drops the rows recorded past the checkpoint, as the JSONL does.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numeric metrics of a row, without its ``time`` and ``step``."""
    return {
        k: float(v)
        for k, v in row.items()
        if k not in ("time", "step") and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class TensorBoardSink:
    def __init__(self, logdir: Path) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.Event, self.SessionLog, self.Summary = Event, SessionLog, Summary
        logdir.mkdir(parents=True, exist_ok=True)
        self.writer = EventFileWriter(str(logdir))
        self.started = False

    def write(self, step: int, wall_time: float, values: dict[str, float]) -> None:
        if not self.started:  # TensorBoard forgets events at or past this step from an earlier session
            self.started = True
            self.writer.add_event(
                self.Event(wall_time=wall_time, step=step, session_log=self.SessionLog(status=self.SessionLog.START))
            )
        summary = self.Summary(value=[self.Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self.writer.add_event(self.Event(wall_time=wall_time, step=step, summary=summary))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, project: str, job_id: str, name: str, job_dir: Path) -> None:
        import wandb

        self.run = wandb.init(project=project, id=job_id, name=f"{name}-{job_id}", resume="allow", dir=str(job_dir))

    def write(self, step: int, wall_time: float, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricSinks:
    """Opened on the first row, so a job that never records imports nothing."""

    def __init__(self, job_dir: Path, name: str, log: Callable[[str], None] = print) -> None:
        self.job_dir, self.name, self.log = job_dir, name, log
        self.sinks: list[Any] | None = None

    def _open(self) -> list[Any]:
        sinks: list[Any] = []
        try:
            sinks.append(TensorBoardSink(self.job_dir / "tb"))
        except ImportError:
            pass
        except Exception as exc:  # noqa: BLE001 - an optional copy never stops the job
            self.log(f"tensorboard events off: {exc}")
        project = os.environ.get("WANDB_PROJECT")
        if project:
            try:
                sinks.append(WandbSink(project, self.job_dir.name, self.name, self.job_dir))
            except ImportError:
                pass
            except Exception as exc:  # noqa: BLE001
                self.log(f"wandb off: {exc}")
        return sinks

    def write(self, row: dict[str, Any]) -> None:
        if self.sinks is None:
            self.sinks = self._open()
        values = scalars(row)
        if not values:
            return
        step, wall_time = int(row.get("step", 0)), float(row.get("time", time.time()))
        for sink in list(self.sinks):
            try:
                sink.write(step, wall_time, values)
            except Exception as exc:  # noqa: BLE001
                self.log(f"{type(sink).__name__} off: {exc}")
                self.sinks.remove(sink)

    def close(self) -> None:
        for sink in self.sinks or []:
            try:
                sink.close()
            except Exception:  # noqa: BLE001
                pass
        self.sinks = []
