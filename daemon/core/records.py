"""The daemon core's vocabulary: the effects it returns and the records it keeps in memory.

An effect (``Send``, ``StartDriver``, ``StopDriver``, ``Prune``) is what the server
(``daemon.main``) carries out; the core only returns it. ``WorkerState``, ``JobRuntime`` and
``PendingCall`` hold a worker's, a running job's and a pending call's state; the constants are
the timings and limits the core's concerns and the server share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daemon.scheduler import Task
from plexctl.common import calls as C
from plexctl.common import protocol as P
from plexctl.common.cluster_config import DEFAULTS, drain_timeout_s
from plexctl.common.jobdir import JobDir
from plexctl.common.spec import JobSpec

if TYPE_CHECKING:
    from daemon.core.job_kinds import JobDriver

VERSION = "0.1.0"
HEARTBEAT_S = 1.0
WORKER_GRACE_S = DEFAULTS.worker_grace  # silent this long, a worker is lost even if its process may live
CANCEL_GRACE_S = 30.0
DRAIN_TIMEOUT_S = drain_timeout_s(DEFAULTS, slurm=False)  # a core built without a config: a local cluster's
PASS_WINDOW_S = DEFAULTS.group_window_ms / 1000  # a trainer waits this long at most for more steps to share a pass
MAX_RUNNING = 64  # job drivers at once (processes beside the daemon); the engines' room admits within it
ADOPT_TIMEOUT_S = 60.0  # an adopted job whose engines are not back by then restarts from its checkpoint
DRIVER_START_TRIES = 5  # a driver that cannot start is tried this often, waiting 1, 2, 4, 8 s; then its job fails


# ---------------------------------------------------------------- effects


@dataclass(frozen=True)
class Send:
    """Send ``body`` under ``op`` to the peer ``identity`` (a reply names the request's id)."""

    identity: bytes
    op: bytes
    body: Any
    in_reply_to: int = 0


@dataclass(frozen=True)
class StartDriver:
    """Start the job's driver; tell the core ``driver_started`` or ``driver_not_started``."""

    job_id: str


@dataclass(frozen=True)
class StopDriver:
    """Stop the job's driver: SIGTERM, or SIGKILL when ``kill``."""

    job_id: str
    kill: bool = False


@dataclass(frozen=True)
class Prune:
    """Remove all but the newest ``keep`` directories of ``parent`` (off the loop's thread)."""

    parent: Path
    keep: int


Effect = Send | StartDriver | StopDriver | Prune


@dataclass
class WorkerState:
    worker_id: str
    identity: bytes
    node: str
    last_seen: float
    engines: list[P.EngineDecl]
    ready: bool
    error: str = ""
    devices: list[str] = field(default_factory=list)  # its CUDA_VISIBLE_DEVICES ids
    pid: int = 0  # its process, on its node
    suspect_since: float | None = None  # when it was found silent (``_suspect``); None while it answers


@dataclass
class JobRuntime:
    """What the daemon keeps in memory for a running job."""

    job_id: str
    spec: JobSpec
    job_dir: JobDir
    pid: int = 0  # its driver's process (0: not started yet)
    policy_version: int = 0
    adapter: P.AdapterRef | None = None
    cancel_requested_at: float | None = None
    ended_by_client: bool = False  # a Tinker job whose client's session finished: it succeeded
    rolled_back: str = ""  # why the job's state was lost: its driver is stopped and the job resumes from its checkpoint
    failure: str = ""
    engines: set[str] = field(default_factory=set)
    user: str = ""  # who submitted it
    # its drivers' latest calls, oldest first, by (sender epoch, call id): a driver that reconnected
    # sends its calls again, while another process driving the job (a restarted Tinker front end)
    # numbers its calls afresh
    calls_seen: dict[tuple[int, int], None] = field(default_factory=dict)
    # calls held until the call they follow (``CallReq.after``, the key) has its result
    held_calls: dict[int, list[tuple[bytes, P.Header, P.CallReq]]] = field(default_factory=dict)
    # of those, the tasks sent ahead to the worker (``_send_ahead``), with their engine
    sent_ahead: dict[int, list[tuple[Task, str]]] = field(default_factory=dict)
    model: str = ""  # the model's resolved path, as its engines declare it
    driver: JobDriver = field(kw_only=True)  # how the job is driven (its kind's strategy)


@dataclass
class PendingCall:
    """A service call whose task is queued or running: who to answer, and what the reply adds."""

    job_id: str
    identity: bytes
    msg_id: int
    method: str
    task: C.AnyTask | None = None  # what its engine is sent (set once made)
    version: int = 0  # generate: the policy it samples from; a publish: the version it makes
    publishes: bool = False  # a publish, or a train_step that publishes
    out_dir: str = ""  # where a publish or a checkpoint writes
    step: int = 0  # a checkpoint's


def _kept_adapter(rt: JobRuntime, version: int) -> P.AdapterRef | None:
    """The job's published ``version`` if its directory is still there (0: the base, None)."""
    if version <= 0:
        return None
    path = rt.job_dir.adapter(version)
    if not path.is_dir():
        return None
    return P.AdapterRef(rt.job_id, version, str(path), full=rt.spec.lora is None)
