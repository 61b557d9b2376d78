"""A trainer engine of N ranks: N processes, one ``TrainerEngine`` each, one torch.distributed group.

What it owns. ``TrainerGroup`` is rank 0, in the caller's process: it starts ranks 1..N-1
(``rank_processes``: forked from a server that imported the trainer once), meets them at a
``TCPStore`` it serves on a free port, and speaks for the group. Every call is a ``GroupCall``:
rank 0 checks it (``check``: a user's error is raised there, before any rank moves), sends it to
the others with ``broadcast_object_list`` over a gloo control group, then every rank runs it
(``run``) and rank 0 returns its own result, as vLLM's executor drives its tensor-parallel workers.
The work group's backend is ``collective_backend``'s (NCCL with CUDA, gloo on CPU); its collectives
time out after ``timeout_s``, so no call waits forever on a dead or hung peer. Ranks 1..N-1 wait
for the next call on the control group, whose timeout is long (``IDLE_TIMEOUT``): an idle engine
is not a dead one. They die with rank 0's process (a parent-death signal; the fork server they
come from ends with rank 0's process), however it ends.

Layout. Each rank's base model is sharded with FSDP2 (``TrainerEngine.shard_base``); a LoRA job's
adapter and AdamW moments are replicated, a full fine-tuning job's weights and moments sharded as
the base is (each rank its shard of every weight, the lm_head whole; ``worker.shards``), so each
rank's store swaps its own shard. ``attach`` builds what each rank serves around its
engine: the worker's ranks each hold a state store and a server (``worker.main.attach_rank``), and
every task goes to every rank (``worker.servers.GroupTrainers``). A step splits its micro-batches
among the ranks (``trainer_math.RankSplit``: the same cut on every rank, rank r taking those whose
index is r modulo N, null passes evening out the count; a replicated job's gradients and metrics
then summed in one all-reduce each, a sharded job's gradients reduce-scattered within each
backward), data parallel: equal to a one-rank engine's up to summation order, and a job's
step is bit for bit the same alone or in a shared pass at a given width. Tinker's forward_backward
and optim_step split their micro-batches the same way (each datum's results gathered from the rank
that computed it); a LoRA job's dropout masks are its micro-batch's, whichever rank runs it
(``TrainingMath.job_rng``). The log-prob calls run whole on every rank.
A LoRA job's checkpoint is written by rank 0; a sharded job's by every rank, each its own shards
(``torch.distributed.checkpoint``; ``worker.checkpoint_shards``), rank 0 the small files and the
manifest. Either restores at any width. ``TrainStep`` and ``LossGradients``, the group's own
API, split a batch's rows instead (``row_shares``; each share's gradient scaled by ``share_scale``,
then one all-reduce), take no micro-batch budget (shares could take unequal numbers of passes) and
take LoRA jobs.

Invariants. Every rank holds bit-identical adapters and moments (a LoRA job's) after every call
(``adapter_digests`` checks it). Every rank runs the same forwards and backwards per call (FSDP's
all-gathers pair up). A rank that fails or dies takes the group down: rank 0's call raises
``TrainerGroupError`` naming it (its exit code and, where it could say, its error) within
``timeout_s``, and the group takes no more calls.

A rank of a group across nodes binds its collectives to the interface that reaches rank 0's
node (``socket_env``). Not here yet: sleep.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from plexctl.common.atomic import write_json_atomic
from plexctl.common.isolation import Libc
from plexctl.common.protocol import TrainBatch, TrainHParams
from plexctl.common.spec import LoraSpec
from worker.checkpoint_files import read_manifest, verify_checksums
from worker.errors import BatchError, CheckpointError, JobConfigError, TrainerError
from worker.loss_terms import aggregation_weights
from worker.state.job_copy import lora_signature
from worker.train_batches import check_batch, check_hparams, pad_rows
from worker.trainer import TrainerEngine
from worker.trainer_math import RankSplit

__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "GroupCall",
    "GroupRank",
    "TrainerGroup",
    "TrainerGroupError",
    "collective_backend",
    "row_shares",
    "share_scale",
]

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 600.0  # a work collective waits at most this long for a peer (a step's longest pass)
START_TIMEOUT_S = 300.0  # ranks 1..N-1 started (forked; a process's first group: its fork server's imports too)
RANK_PRELOAD = ["worker.main"]  # what a rank's process needs imported: torch, transformers, peft, the trainer


def rank_processes() -> Any:
    """The multiprocessing context that starts ranks: forked from a server process (one per
    process that starts ranks, made at its first group) that imported ``RANK_PRELOAD`` once, so
    a rank starts in a fraction of a second instead of importing torch, transformers and peft
    again; the server only imports, so nothing is forked from a process whose threads (ZeroMQ,
    gloo, OpenMP) run. A rank takes its starter's environment as it is when it starts
    (``follow``'s ``environ``), as a spawned process would, not the server's."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(RANK_PRELOAD)
    return context


IDLE_TIMEOUT = timedelta(days=7)  # ranks 1..N-1 wait this long for the next call (the control group)
STOP_WAIT_S = 30.0  # ranks 1..N-1 get this long to leave after ``close`` before they are killed
_ERROR_KEY = "plexrl/rank-error/{rank}"  # where a failing rank leaves its one-line error in the store
_UNSHARDABLE_OPTIONS = ("micro_batch_rows", "micro_batch_tokens")  # shares could get unequal numbers of passes

T = TypeVar("T")


class TrainerGroupError(TrainerError):
    """A rank of the group failed, died or timed out: the group takes no more calls."""


# ---------------------------------------------------------------- pure pieces


def collective_backend(cuda_available: bool) -> str:
    """The work group's backend: NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if cuda_available else "gloo"


SOCKET_IFNAME_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # where gloo and NCCL bind their sockets


def socket_ifname(source: str, interfaces: Mapping[str, list[str]]) -> str | None:
    """The network interface a rank's collectives bind to: the one holding ``source``, the address
    this node sends from towards rank 0's (None: a loopback source, all ranks on this host, or an
    address no interface holds). Unset, gloo binds to the address the host name resolves to: a
    loopback one on hosts that map their name to 127.0.1.1 (Debian's default), which no other
    node reaches."""
    if not source or source.startswith("127.") or source == "::1":
        return None
    return next((name for name, addresses in interfaces.items() if source in addresses), None)


def socket_env(rendezvous_host: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The socket interface variables to set for a group whose rank 0 is at ``rendezvous_host``:
    those the user left unset, naming the interface that routes there (``socket_ifname``)."""
    missing = [name for name in SOCKET_IFNAME_ENV if not environ.get(name)]
    if not missing:
        return {}
    ifname = socket_ifname(_source_address(rendezvous_host), _interface_addresses())
    return {name: ifname for name in missing} if ifname else {}


def _source_address(host: str) -> str:
    """The address this host sends from towards ``host`` ("" where there is no route)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # no packet is sent: the kernel picks the route's source address
            return str(probe.getsockname()[0])
    except OSError:
        return ""


def _interface_addresses() -> dict[str, list[str]]:
    import psutil

    return {name: [a.address for a in addresses] for name, addresses in psutil.net_if_addrs().items()}


def row_shares(rows: int, width: int) -> list[range]:
    """Each rank's rows of a batch of ``rows``: contiguous, in rank order, sizes differing by at most one."""
    return [range(rows * rank // width, rows * (rank + 1) // width) for rank in range(width)]


def share_scale(batch: TrainBatch, share: range, hp: TrainHParams) -> float:
    """c such that the batch's loss weights (``aggregation_weights``) on the share's rows are c times
    the weights the share alone gets: scaled by c, the shares' loss gradients add up to the batch's.
    The share must have a trainable token."""
    mask = pad_rows(batch.input_ids, batch.loss_mask, torch.device("cpu")).loss_mask
    whole = aggregation_weights(mask, hp.loss_agg, hp.loss_agg_len)[share.start : share.stop]
    own = aggregation_weights(mask[share.start : share.stop], hp.loss_agg, hp.loss_agg_len)
    return float(whole.double().sum() / own.double().sum())


def batch_rows(batch: TrainBatch, share: range) -> TrainBatch:
    """The batch's rows ``share``."""
    rows = slice(share.start, share.stop)
    return TrainBatch(batch.input_ids[rows], batch.loss_mask[rows], batch.old_logprobs[rows], batch.advantages[rows])


def adapter_digest(engine: TrainerEngine, job_id: str) -> str:
    """sha256 of the job's adapter weights and AdamW moments on ``engine``."""
    job = engine.slots.job(job_id)
    digest = hashlib.sha256()
    for key, param in job.params.items():
        digest.update(key.encode())
        digest.update(param.detach().cpu().contiguous().numpy().tobytes())
        for name, value in sorted(job.optimizer.state.get(param, {}).items()):
            digest.update(name.encode())
            digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _trainable_tokens(batch: TrainBatch) -> int:
    return sum(sum(mask[1:]) for mask in batch.loss_mask)  # the first token is never predicted


# ---------------------------------------------------------------- one rank


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """What every rank needs to join the group and build its engine."""

    model_path: str
    width: int
    host: str
    port: int
    engine_options: dict[str, Any]
    timeout_s: float
    backend: str
    attach: Callable[[TrainerEngine, int], Any] | None = None  # what a rank builds around its engine
    local_ranks: int = 0  # ranks per node (0: all on one): a rank's device is its index on its node


def rendezvous_record(spec: GroupSpec) -> dict[str, Any]:
    """What a rank started on another node needs of the group (``rendezvous_spec`` reads it back);
    ``generation`` tells one forming of the group from the next."""
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "attach"}
    return {**fields, "generation": f"{os.getpid()}-{time.time_ns()}"}


def rendezvous_spec(record: Mapping[str, Any], attach: Callable[[TrainerEngine, int], Any] | None) -> GroupSpec:
    """The ``GroupSpec`` a rendezvous file names, with this node's ``attach``."""
    names = [f.name for f in dataclasses.fields(GroupSpec) if f.name != "attach"]
    return GroupSpec(**{name: record[name] for name in names}, attach=attach)


class GroupRank:
    """One rank: its engine (base sharded), its place in the group, and the collectives of a call."""

    def __init__(self, spec: GroupSpec, rank: int, store: dist.Store) -> None:
        """Join the group (``init_process_group`` on ``store``), build the engine, shard its base."""
        self.spec, self.rank, self.width, self.store = spec, rank, spec.width, store
        device = f"cuda:{rank % (spec.local_ranks or spec.width)}" if spec.backend == "nccl" else "cpu"
        if spec.backend == "nccl":
            torch.cuda.set_device(device)  # NCCL's object collectives use the current device
        timeout = timedelta(seconds=spec.timeout_s)
        os.environ.update(socket_env(spec.host, os.environ))  # a group across nodes: the interface that reaches them
        dist.init_process_group(spec.backend, store=store, rank=rank, world_size=spec.width, timeout=timeout)
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)  # calls; idle ranks wait here
        self.engine = TrainerEngine(spec.model_path, device=device, **spec.engine_options)
        self.mesh = init_device_mesh(torch.device(device).type, (spec.width,))
        if spec.width > 1:  # a group of one rank is the engine of one GPU, its base whole
            self.engine.shard_base(self.mesh)
            # the steps it serves split their micro-batches among the ranks (data parallel)
            self.engine.math.split = RankSplit(rank, spec.width, self.all_reduce_sum)
        self.target: Any = spec.attach(self.engine, rank) if spec.attach else None  # what calls may serve

    def base_bytes(self) -> int:
        """Bytes of the base's weights this rank holds (its shards, and the unsharded lm_head)."""
        return self.engine.base_bytes()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks, in place (the work group, its timeout)."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def loss_gradients(
        self, job_id: str, batch: TrainBatch, hp: TrainHParams
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The whole batch's loss gradient (``TrainingMath.loss_gradients``'), every rank taking its
        share: the share's gradient scaled by ``share_scale``, summed over the ranks; the batch's metrics."""
        share = row_shares(len(batch.input_ids), self.width)[self.rank]
        scale = share_scale(batch, share, hp)
        grads, metrics = self.engine.loss_gradients(job_id, batch_rows(batch, share), hp)
        flat = torch.cat([grad.reshape(-1) for grad in grads.values()]) * scale
        self.all_reduce_sum(flat)
        summed, at = {}, 0
        for key, grad in grads.items():
            summed[key] = flat[at : at + grad.numel()].view_as(grad)
            at += grad.numel()
        return summed, self._group_metrics(metrics, scale)

    def train_step(self, job_id: str, batch: TrainBatch, hp: TrainHParams) -> dict[str, float]:
        """This rank's part of one optimizer step of the job (``TrainingMath.train_step``'s metrics,
        the group's): the batch's gradient (``loss_gradients``), then clip and AdamW, as every rank does."""
        started = time.perf_counter()
        grads, metrics = self.loss_gradients(job_id, batch, hp)
        job = self.engine.slots.job(job_id)
        for key, param in job.params.items():
            param.grad = grads[key]
        grad_norm, skipped = self.engine.math.apply_gradients(job, hp)
        metrics.update(grad_norm=grad_norm, skipped=float(skipped), seconds=time.perf_counter() - started)
        return metrics

    def _group_metrics(self, own: dict[str, float], scale: float) -> dict[str, float]:
        """The whole batch's metrics from each share's: the weighted losses summed (scaled as the
        gradients are), the token means weighted by the shares' tokens."""
        tokens = own["tokens"]
        means = ("kl", "clip_frac", "ratio_mean", "entropy")
        values = [own["loss"] * scale, own["pg_loss"] * scale, *(own[k] * tokens for k in means), tokens]
        summed = self.all_reduce_sum(torch.tensor(values, dtype=torch.float64)).tolist()
        total = summed[-1]
        out = {"loss": summed[0], "pg_loss": summed[1], "tokens": total}
        out.update({k: v / total for k, v in zip(means, summed[2:-1])})
        return out

    def adapter_digest(self, job_id: str) -> str:
        """sha256 of the job's adapter weights and AdamW moments on this rank."""
        return adapter_digest(self.engine, job_id)

    def gather_objects(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (small objects; the work group, its timeout)."""
        out: list[Any] = [None] * self.width
        dist.all_gather_object(out, value)
        return out


# ---------------------------------------------------------------- calls


class GroupCall(ABC, Generic[T]):
    """A call every rank runs: ``check`` on rank 0 first (a user's error, raised before any rank
    moves), then ``run`` on each rank, in step; rank 0's result is the group's. It travels pickled
    (``broadcast_object_list``), so its class is defined at a module's top level."""

    def check(self, rank: GroupRank) -> None:
        return None

    @abstractmethod
    def run(self, rank: GroupRank) -> T: ...


@dataclasses.dataclass(frozen=True)
class EnsureJob(GroupCall[None]):
    job_id: str
    lora: LoraSpec | None
    seed: int

    def check(self, rank: GroupRank) -> None:
        if self.lora is not None and self.lora.dropout > 0:
            raise JobConfigError(f"job {self.job_id!r}: LoRA dropout does not run on a group of ranks yet")

    def run(self, rank: GroupRank) -> None:
        rank.engine.ensure_job(self.job_id, self.lora, self.seed)


def _check_step(rank: GroupRank, job_id: str, batch: TrainBatch, hp: TrainHParams) -> None:
    """What a step on the group needs, checked on rank 0: the job, a valid batch and hparams,
    and a trainable token in every rank's share; a LoRA job (a full fine-tuning job's sharded
    gradients are reduced within its backwards: it steps as the worker serves it, ``RankSplit``)."""
    if rank.engine.slots.job(job_id).lora is None:  # UnknownJobError
        raise JobConfigError(f"job {job_id!r}: a step split by rows takes a LoRA job, not full fine-tuning")
    for name in _UNSHARDABLE_OPTIONS:
        if rank.spec.engine_options.get(name) is not None:
            raise BatchError(f"a step split by rows takes no {name} (the shares could take unequal passes)")
    check_batch(batch)
    check_hparams(hp)
    for i, share in enumerate(row_shares(len(batch.input_ids), rank.width)):
        if _trainable_tokens(batch_rows(batch, share)) == 0:
            rows = f"rows {share.start}-{share.stop - 1}" if len(share) else "no row"
            raise BatchError(
                f"rank {i} of {rank.width} would get no trainable token ({rows} of {len(batch.input_ids)}): "
                "a batch needs a row with a trainable token per rank"
            )


@dataclasses.dataclass(frozen=True)
class TrainStep(GroupCall[dict[str, float]]):
    job_id: str
    batch: TrainBatch
    hp: TrainHParams

    def check(self, rank: GroupRank) -> None:
        _check_step(rank, self.job_id, self.batch, self.hp)

    def run(self, rank: GroupRank) -> dict[str, float]:
        return rank.train_step(self.job_id, self.batch, self.hp)


@dataclasses.dataclass(frozen=True)
class LossGradients(GroupCall[tuple[dict[str, torch.Tensor], dict[str, float]]]):
    job_id: str
    batch: TrainBatch
    hp: TrainHParams

    def check(self, rank: GroupRank) -> None:
        _check_step(rank, self.job_id, self.batch, self.hp)

    def run(self, rank: GroupRank) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        return rank.loss_gradients(self.job_id, self.batch, self.hp)


@dataclasses.dataclass(frozen=True)
class AdapterDigests(GroupCall[list[str]]):
    job_id: str

    def check(self, rank: GroupRank) -> None:
        rank.engine.slots.job(self.job_id)

    def run(self, rank: GroupRank) -> list[str]:
        return rank.gather_objects(rank.adapter_digest(self.job_id))


@dataclasses.dataclass(frozen=True)
class BaseBytes(GroupCall[list[int]]):
    def run(self, rank: GroupRank) -> list[int]:
        return rank.gather_objects(rank.base_bytes())


@dataclasses.dataclass(frozen=True)
class SaveCheckpoint(GroupCall[dict]):
    """Rank 0 writes the job's checkpoint (a LoRA job's adapter and moments are every rank's); a
    full fine-tuning job's shards are written by every rank, each its own, in the same directory."""

    job_id: str
    out_dir: str
    extra: dict

    def check(self, rank: GroupRank) -> None:
        rank.engine.slots.job(self.job_id)

    def run(self, rank: GroupRank) -> dict:
        return rank.engine.save_checkpoint(self.job_id, self.out_dir, self.extra, write=rank.rank == 0)


@dataclasses.dataclass(frozen=True)
class LoadCheckpoint(GroupCall[dict]):
    """Every rank restores the job from a checkpoint written at any width, verified on rank 0
    first (its files, their checksums, the LoRA it was written for)."""

    job_id: str
    ckpt_dir: str
    lora: LoraSpec | None
    seed: int

    def check(self, rank: GroupRank) -> None:
        directory = Path(self.ckpt_dir)
        manifest = read_manifest(directory)
        verify_checksums(directory, manifest)
        if manifest.get("lora") != lora_signature(self.lora):
            raise CheckpointError(
                f"checkpoint {directory} was written for LoRA {manifest.get('lora')}, not {lora_signature(self.lora)}"
            )

    def run(self, rank: GroupRank) -> dict:
        return rank.engine.load_checkpoint(self.job_id, self.ckpt_dir, self.lora, self.seed)


@dataclasses.dataclass(frozen=True)
class MemoryPeaks(GroupCall[list[int | None]]):
    """Each rank's peak of allocated device memory since the last reset (None on CPU); ``reset``
    starts a new peak after reading it."""

    reset: bool = False

    def run(self, rank: GroupRank) -> list[int | None]:
        device = rank.engine.device
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        if self.reset and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        return rank.gather_objects(peak)


@dataclasses.dataclass(frozen=True)
class StateBytes(GroupCall[list[int]]):
    job_id: str

    def check(self, rank: GroupRank) -> None:
        rank.engine.slots.job(self.job_id)

    def run(self, rank: GroupRank) -> list[int]:
        return rank.gather_objects(rank.engine.export_state(self.job_id).nbytes)


@dataclasses.dataclass(frozen=True)
class Stop(GroupCall[None]):
    def run(self, rank: GroupRank) -> None:
        return None


# ---------------------------------------------------------------- ranks 1..N-1


def follow(spec: GroupSpec, rank: int, environ: Mapping[str, str] | None = None) -> None:
    """Rank ``rank`` (> 0): join the group, then run every call rank 0 sends until ``Stop``. On
    an error the rank leaves its one-line error in the store and exits with status 1.
    ``environ``: its starter's environment (``rank_processes``)."""
    Libc().die_with_parent()  # its parent (rank 0's, or rank 0's fork server, which ends with it) gone: it goes too
    if os.getppid() == 1:
        os._exit(1)
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    store = dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timedelta(seconds=spec.timeout_s))
    try:
        store.set(f"started/{rank}", "1")  # rank 0 forms the group once every rank is this far
        group_rank = GroupRank(spec, rank, store)
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=group_rank.control)
            call = box[0]
            call.run(group_rank)
            if isinstance(call, Stop):
                break
    except BaseException as exc:  # noqa: BLE001 - any failure ends the rank; rank 0 reports it
        line = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        log.error("trainer group rank %d: %s\n%s", rank, line, traceback.format_exc())
        try:
            store.set(_ERROR_KEY.format(rank=rank), line)
        finally:
            os._exit(1)  # no collective teardown with peers that may be gone
    dist.destroy_process_group()


# ---------------------------------------------------------------- rank 0


def _leave_group() -> None:
    """This process out of its torch.distributed group, if it is in one (best effort after a failure)."""
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - peers may be gone; the process must be free for a new group
        log.warning("trainer group: leaving the process group: %s", exc)


class TrainerGroup:
    """A trainer engine of ``width`` ranks; this process is rank 0 and speaks for the group.

    ``engine_options``: ``TrainerEngine``'s keyword options, the same on every rank (``threads``
    is per rank). One group per process (torch.distributed's default group is process-wide).

    ``local_ranks``: the ranks started here (0..local_ranks-1; default all). The others run on
    other nodes (``worker.ranks``), which find the group in ``rendezvous``, a file on the shared
    filesystem this writes once its store serves at ``host`` (an address they reach) and that
    names what they need to build their engines (``extra``: their ``attach``'s own settings)."""

    def __init__(
        self,
        model_path: str,
        width: int,
        engine_options: Mapping[str, Any] | None = None,
        timeout_s: float = COLLECTIVE_TIMEOUT_S,
        host: str = "127.0.0.1",
        attach: Callable[[TrainerEngine, int], Any] | None = None,
        local_ranks: int | None = None,
        rendezvous: Path | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        if width < 1:
            raise ValueError(f"a trainer group has at least one rank, got {width}")
        local_ranks = width if local_ranks is None else local_ranks
        if not 1 <= local_ranks <= width or (local_ranks < width and rendezvous is None):
            raise ValueError(f"{local_ranks} of {width} ranks here: the others need a rendezvous file")
        options = dict(engine_options or {})
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group")
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, 0, world_size=width, is_master=True, wait_for_workers=False, timeout=timeout)
        backend = collective_backend(torch.cuda.is_available())
        self.spec = GroupSpec(
            model_path,
            width,
            host,
            store.port,
            options,
            timeout_s,
            backend,
            attach,
            local_ranks if local_ranks < width else 0,
        )
        self._store = store
        self._closed = False
        context = rank_processes()
        self._followers: list[BaseProcess] = [
            context.Process(
                target=follow, args=(self.spec, rank, dict(os.environ)), name=f"trainer-rank-{rank}", daemon=True
            )
            for rank in range(1, local_ranks)
        ]
        for process in self._followers:
            process.start()
        if rendezvous is not None:
            write_json_atomic(
                rendezvous,
                {**rendezvous_record(self.spec), "extra": dict(extra or {})},
            )
        try:
            self._await_started(store)
            self._rank = GroupRank(self.spec, 0, store)
        except BaseException as exc:
            raise self._fail(exc, "forming the group") from exc

    def _await_started(self, store: dist.Store) -> None:
        """Wait, up to ``START_TIMEOUT_S``, until ranks 1..N-1 are running (a loaded machine takes
        its time to spawn them), so that forming the group is held to the collective timeout only;
        a rank that exits meanwhile ends the wait."""
        keys = [f"started/{rank}" for rank in range(1, self.spec.width)]
        deadline = time.monotonic() + max(START_TIMEOUT_S, self.spec.timeout_s)
        while keys and not store.check(keys):
            if self._dead_ranks():
                raise TrainerGroupError("a rank exited while starting")
            if time.monotonic() > deadline:
                missing = [key.split("/")[1] for key in keys if not store.check([key])]
                raise TrainerGroupError(f"ranks {', '.join(missing)} not started within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    @property
    def width(self) -> int:
        return self.spec.width

    @property
    def engine(self) -> TrainerEngine:
        """Rank 0's engine (its adapters are every rank's: replicated)."""
        return self._rank.engine

    @property
    def target(self) -> Any:
        """What rank 0 built around its engine (``attach``; None without one)."""
        return self._rank.target

    @property
    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [p.pid for p in self._followers if p.pid is not None]

    def call(self, call: GroupCall[T]) -> T:
        """Run ``call`` on every rank; rank 0's result. ``TrainerGroupError`` if a rank fails."""
        if self._closed:
            raise TrainerGroupError("the trainer group is closed")
        call.check(self._rank)
        dead = self._dead_ranks()
        if dead:
            raise self._fail(None, f"sending {type(call).__name__}")
        try:
            dist.broadcast_object_list([call], src=0, group=self._rank.control)
            return call.run(self._rank)
        except Exception as exc:
            raise self._fail(exc, f"running {type(call).__name__}") from exc

    def ensure_job(self, job_id: str, lora: LoraSpec | None, seed: int) -> None:
        self.call(EnsureJob(job_id, lora, seed))

    def train_step(self, job_id: str, batch: TrainBatch, hp: TrainHParams) -> dict[str, float]:
        """One optimizer step of the job on the whole batch, its rows shared by the ranks."""
        return self.call(TrainStep(job_id, batch, hp))

    def loss_gradients(
        self, job_id: str, batch: TrainBatch, hp: TrainHParams
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The whole batch's loss gradient under PEFT-file keys and its metrics, without stepping."""
        return self.call(LossGradients(job_id, batch, hp))

    def adapter_state_dict(self, job_id: str) -> dict[str, torch.Tensor]:
        """The job's adapter weights under their PEFT-file keys (rank 0's: every rank's)."""
        return self.engine.adapter_state_dict(job_id)

    def adapter_digests(self, job_id: str) -> list[str]:
        """Each rank's sha256 of the job's adapter and AdamW moments, in rank order."""
        return self.call(AdapterDigests(job_id))

    def base_bytes(self) -> list[int]:
        """Bytes of base weights each rank holds."""
        return self.call(BaseBytes())

    def save_checkpoint(self, job_id: str, out_dir: str, extra: dict) -> dict:
        """``TrainerEngine.save_checkpoint``, written once by rank 0."""
        return self.call(SaveCheckpoint(job_id, out_dir, extra))

    def load_checkpoint(self, job_id: str, ckpt_dir: str, lora: LoraSpec | None, seed: int) -> dict:
        """``TrainerEngine.load_checkpoint`` on every rank: a checkpoint of any width restores here."""
        return self.call(LoadCheckpoint(job_id, ckpt_dir, lora, seed))

    def memory_peaks(self, reset: bool = False) -> list[int | None]:
        """Each rank's peak allocated GPU memory (None on CPU); ``reset``: start new peaks."""
        return self.call(MemoryPeaks(reset))

    def rank_state_bytes(self, job_id: str) -> list[int]:
        """Bytes of the job's state copy each rank swaps (adapter, moments, step counts, RNG)."""
        return self.call(StateBytes(job_id))

    def close(self) -> None:
        """Stop the ranks and leave the group. Idempotent."""
        if self._closed:
            return
        try:
            if not self._dead_ranks():
                self.call(Stop())
        except TrainerGroupError:
            log.warning("trainer group: a rank failed while stopping")
        self._closed = True
        self._reap(STOP_WAIT_S)
        _leave_group()

    def __enter__(self) -> TrainerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ failures

    def _dead_ranks(self) -> list[int]:
        return [rank for rank, p in enumerate(self._followers, start=1) if p.exitcode is not None]

    def _fail(self, exc: BaseException | None, doing: str) -> TrainerGroupError:
        """The group's error after a failure while ``doing``: each dead rank with its exit code and
        its own error where it left one. The group is closed and its ranks killed."""
        deadline = time.monotonic() + 2.0  # a peer's death is often why the collective failed: let it show
        while not self._dead_ranks() and time.monotonic() < deadline:
            time.sleep(0.05)
        parts = []
        for rank in self._dead_ranks():
            code = self._followers[rank - 1].exitcode
            parts.append(f"rank {rank} exited with status {code}{self._rank_error(rank)}")
        running = [str(rank) for rank, p in enumerate(self._followers, start=1) if p.exitcode is None]
        if running:  # a hung rank, or rank 0's own failure
            parts.append(f"rank{'s' if len(running) > 1 else ''} {', '.join(running)} still running")
        if len(self._followers) + 1 < self.width:
            parts.append(f"ranks {len(self._followers) + 1}-{self.width - 1} on other nodes")
        if exc is not None:
            parts.append(f"rank 0: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        self._closed = True
        self._reap(0.0)
        _leave_group()
        return TrainerGroupError(f"trainer group of {self.width} ranks failed {doing}: " + "; ".join(parts))

    def _rank_error(self, rank: int) -> str:
        key = _ERROR_KEY.format(rank=rank)
        try:
            if self._store.check([key]):
                return f" ({self._store.get(key).decode()})"
        except Exception:  # noqa: BLE001 - the store is best effort while failing
            pass
        return ""

    def _reap(self, wait_s: float) -> None:
        """Ranks 1..N-1 gone: given ``wait_s`` to leave, then killed."""
        deadline = time.monotonic() + wait_s
        for process in self._followers:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                process.kill()
                process.join(5.0)
