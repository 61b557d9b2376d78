"""plexw: one worker per node. Its command line (the cluster's ``cluster.json``; flags only for
this worker's identity), its engines built once from the configuration and the memory plan, and
its threads started: the I/O thread (``worker.io``) and the engine loops (``worker.servers``): the
rollout engine (vLLM) on the main thread (vLLM installs signal handlers), the trainer (torch +
peft) on its own thread or, on CPU, on the main thread too (``shared_loop``: one OpenMP team, not
two on the same cores). Engines stay resident; only jobs' state moves.

``WORKER_SPINCOUNT``: torch's OpenMP threads spin this long after each parallel region before
they sleep (unless the environment sets ``GOMP_SPINCOUNT``): long enough for the engines, short
enough that the I/O thread, the daemon and the drivers get the cores when a step ends.
"""

from __future__ import annotations

import os

WORKER_SPINCOUNT = "30000"
os.environ.setdefault(
    "GOMP_SPINCOUNT", WORKER_SPINCOUNT
)  # read once, when torch loads libgomp: before any import of it

import argparse
import functools
import logging
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import msgspec

from plexctl.common import protocol as P
from plexctl.common.cluster_config import ClusterConfig, ConfigError, checked, min_lora_rank, read_config
from plexctl.common.engine_defaults import ENGINE_DEFAULTS
from plexctl.common.frames import send_frames
from plexctl.common.memplan import WorkerStep, worker_step
from plexctl.common.sizes import parse_bytes
from plexctl.common.state_policy import tier_budgets
from worker.engine_args import (
    Platform,
    adapter_slots,
    default_max_lora_rank,
    sleep_between_models,
)
from worker.engine_options import (
    EngineOptions,
    OptionError,
    engine_options,
    visible_device_ids,
)
from worker.host_heap import keep_freed_memory
from worker.io import PREFETCH, Followers, Outbox, WorkerIO, _error_text
from worker.servers import (
    Discard,
    GroupTrainers,
    RankTrainer,
    Rollouts,
    Trainers,
    prefetch_loop,
    rollout_loop,
    shared_loop,
    trainer_loop,
)

log = logging.getLogger("plexw")


def write_behind_bytes(asked: int | None, host_mem: int) -> int:
    """The trainer's write-behind allowance: as asked, else a quarter of its host tier, at least 1 GiB."""
    return asked if asked is not None else max(host_mem // 4, 1 << 30)


def build_parser() -> argparse.ArgumentParser:
    """The worker's command line: what identifies it (endpoint, id, node, its engines and models,
    scratch, threads, the tensor-parallel size of its rollout engines) and where the cluster's
    settings are (``--cluster-config``); the settings themselves only from there."""
    ap = argparse.ArgumentParser(prog="plexw", description="PlexRL worker (started by the daemon or srun).")
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--worker-id", default=socket.gethostname())
    ap.add_argument("--node", default=socket.gethostname(), help="node name shown in status")
    ap.add_argument("--engines", default="rollout,trainer")
    ap.add_argument(
        "--model",
        action="append",
        required=True,
        help="a base model the engines serve; repeat for several (an engine of each kind per model)",
    )
    ap.add_argument(
        "--cluster-config",
        type=Path,
        default=None,
        help="the cluster's settings (cluster.json, docs/cluster-reference.md; none: every default)",
    )
    ap.add_argument("--scratch", type=Path, default=None, help="node-local directory for state")
    ap.add_argument("--rollout-capacity", type=int, default=16, help="generate calls batched together")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the trainer")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs of one rollout engine")
    ap.add_argument(
        "--exit-with-parent",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="exit when the daemon that started this worker is gone and no other adopts it",
    )
    ap.add_argument(
        "--engine-threads",
        choices=["auto", "one", "own"],
        default="auto",
        help="a worker with both engines serves them from one thread or each from its own "
        "(auto: one on CPU, own with CUDA)",
    )
    ap.add_argument(
        "--endpoint-file", type=Path, default=None, help="the cluster's endpoint.json: where a restarted daemon is"
    )
    ap.add_argument(
        "--trainer-rendezvous",
        type=Path,
        default=None,
        help="a trainer engine wider than this node: the file (shared filesystem) where its other nodes' ranks "
        "(worker.ranks) find it",
    )
    ap.add_argument("--local-ranks", type=int, default=None, help="the trainer engine's ranks on this node")
    ap.add_argument("--group-host", default="127.0.0.1", help="this node's address the other nodes' ranks reach")
    return ap


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, ClusterConfig]:
    """The worker's arguments and the cluster's settings (its ``--cluster-config``)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return args, checked(read_config(args.cluster_config))
    except ConfigError as exc:
        ap.error(str(exc))


def nvme_tier_dir(args: argparse.Namespace, config: ClusterConfig) -> Path:
    """The NVMe tier's directory: the setting, else ``nvme`` under the worker's scratch directory."""
    if config.nvme_dir is not None:
        return Path(config.nvme_dir)
    return (args.scratch or Path(tempfile.gettempdir()) / "plexw") / "nvme"


def build_engines(
    args: argparse.Namespace,
    config: ClusterConfig,
    kinds: list[str],
    options: EngineOptions,
    model: str,
    sleep_mode: bool = False,
    nvme_dir: Path | None = None,
    eid: str = "",
) -> dict[str, Any]:
    """One model's resident engines, as the worker's arguments and the cluster's settings say:
    ``trainer`` (a ``StateStore`` around the ``TrainerEngine``; with ``trainer_width`` N > 1, rank
    0's store of a ``TrainerGroup`` of N ranks, the group as ``group``) and/or ``rollout`` (a
    ``RolloutEngine``; ``sleep_mode``: it takes turns with other models' engines). ``eid``: the
    trainer engine's id."""
    engines: dict[str, Any] = {}
    if "trainer" in kinds:
        from worker.trainer import TrainerEngine

        step = trainer_step(config, kinds, options, model)
        cap_memory(step.memory_fraction, options.device)
        width = config.trainer_width or 1
        nvme = nvme_dir or nvme_tier_dir(args, config)
        info = step_info(step, options.micro_batch_tokens)
        if width > 1:
            from worker.trainer_group import TrainerGroup

            group = TrainerGroup(
                model,
                width,
                dict(
                    dtype=options.dtype,
                    threads=max(1, (args.threads or os.cpu_count() or width) // (args.local_ranks or width)),
                    micro_batch_tokens=options.micro_batch_tokens,
                    gradient_checkpointing=step.gradient_checkpointing,
                ),
                host=args.group_host,
                attach=functools.partial(attach_rank, config=config, nvme_dir=nvme, info=info, eid=eid),
                local_ranks=args.local_ranks,
                rendezvous=args.trainer_rendezvous,
                extra={"info": info, "eid": eid},
            )
            engines["trainer"], engines["group"] = group.target.store, group
        else:
            trainer = TrainerEngine(
                model,
                dtype=options.dtype,
                device=options.device,
                threads=args.threads,
                micro_batch_tokens=options.micro_batch_tokens,
                gradient_checkpointing=step.gradient_checkpointing,
            )
            engines["trainer"] = trainer_store(trainer, config, nvme, info)
    if "rollout" in kinds:
        from worker.engine_args import default_max_model_len
        from worker.rollout import RolloutEngine

        max_loras, max_cpu_loras = _adapter_slots(config, options.device)
        engines["rollout"] = RolloutEngine(
            model,
            dtype=options.dtype,
            max_lora_rank=_max_lora_rank(config, options.device),
            max_loras=max_loras,
            max_cpu_loras=max_cpu_loras,
            max_model_len=config.max_model_len or default_max_model_len(model),
            platform=options.device,
            tensor_parallel_size=args.tensor_parallel_size,
            sleep_mode=sleep_mode,
            gpu_memory_utilization=config.gpu_memory_utilization,
        )
    return engines


def trainer_store(trainer: Any, config: ClusterConfig, nvme_dir: Path, info: dict[str, Any]) -> Any:
    """The ``StateStore`` around a trainer engine, its tiers as the cluster's settings size them."""
    from worker.state.store import StateStore

    trainer.step_info = info
    host_bytes = parse_bytes(config.host_mem)
    asked_write_behind = None if config.write_behind is None else parse_bytes(config.write_behind)
    return StateStore(
        trainer,
        device_slots=config.device_slots,
        host_bytes=host_bytes,
        nvme_dir=nvme_dir,
        nvme_bytes=parse_bytes(config.nvme_bytes),
        write_behind_bytes=write_behind_bytes(asked_write_behind, host_bytes),
    )


def attach_rank(
    engine: Any, rank: int, *, config: ClusterConfig, nvme_dir: Path, info: dict[str, Any], eid: str
) -> RankTrainer:
    """What each rank of a trainer engine of several builds around its engine: a store of its own
    (its NVMe files under ``rank<N>`` for ranks past 0) and a server; only rank 0 writes the
    files tasks name, and only its results go out."""
    store = trainer_store(engine, config, nvme_dir if rank == 0 else nvme_dir / f"rank{rank}", info)
    return RankTrainer(store, Trainers({eid: store}, writes=rank == 0), Discard())


def _max_lora_rank(config: ClusterConfig, device: Platform) -> int:
    """``max_lora_rank``, else the platform's default raised to cover ``min_lora_rank`` (the Tinker SDK's)."""
    least = min_lora_rank(config)
    return int(config.max_lora_rank or default_max_lora_rank(device, [least] if least else []))


def main(argv: list[str] | None = None) -> None:
    args, config = parse_args(argv)
    os.umask(0o077)  # checkpoints, adapters and scratch copies are the cluster owner's alone
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for sig in (signal.SIGUSR1, signal.SIGUSR2):  # an allocation's drain signal is the daemon's to act on
        signal.signal(sig, signal.SIG_IGN)

    kinds = [k.strip() for k in args.engines.split(",") if k.strip()]
    unknown = set(kinds) - {"rollout", "trainer"}
    if unknown or not kinds:
        build_parser().error(f"--engines: unknown engine kinds {sorted(unknown)}")
    models = list(dict.fromkeys(os.path.realpath(m) for m in args.model))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        options = engine_options(config.device, config.dtype, config.micro_batch_tokens, _cuda(), visible)
    except OptionError as exc:
        options, option_error = None, str(exc)
    else:
        option_error = ""
    device = options.device if options else "cpu"
    if "trainer" in kinds:
        keep_freed_memory(device)  # a CPU trainer's step reuses the heap blocks of the one before
    max_lora_rank = _max_lora_rank(config, device)
    budgets = tier_budgets(config)
    sleep_mode = sleep_between_models(device, len(models))
    ranks = config.trainer_width or 1
    decls = [
        P.EngineDecl(
            engine_id(args.worker_id, k, m),
            k,
            model,
            args.rollout_capacity if k == "rollout" else 1,
            state_capacity_bytes=max(budgets.values()) if k == "trainer" else 0,  # the largest tier
            state_room_bytes=sum(budgets.values()) if k == "trainer" else 0,
            adapter_slots=_adapter_slots(config, device)[1] if k == "rollout" else 0,
            dtype=options.dtype if options else "",
            device=device,
            max_lora_rank=max_lora_rank if k == "rollout" else 0,
            sleeps=sleep_mode,  # its worker's engines of its kind take turns on the GPU
            ranks=ranks if k == "trainer" else 1,
        )
        for m, model in enumerate(models)
        for k in kinds
    ]
    register = P.RegisterReq(
        worker_id=args.worker_id,
        node=args.node,
        pid=os.getpid(),
        engines=decls,
        ready=False,
        mem_bytes=_mem_bytes(),
        devices=visible_device_ids(visible),
    )
    log.info(
        "worker %s on %s: engines %s of %s, device %s, CUDA_VISIBLE_DEVICES=%s, scratch %s",
        args.worker_id,
        args.node,
        ",".join(kinds),
        ", ".join(models),
        device,
        visible if visible is not None else "(unset)",
        args.scratch,
    )
    shared = args.engine_threads == "one" or (args.engine_threads == "auto" and device != "cuda")
    per_thread: dict[str, queue.Queue] = {}  # one queue per engine thread: all engines (shared), else per kind
    queues = {d.engine_id: per_thread.setdefault("all" if shared else d.kind, queue.Queue()) for d in decls}
    queues[PREFETCH] = queue.Queue()
    followers = Followers()
    io = WorkerIO(
        args.endpoint,
        args.worker_id,
        register,
        queues,
        os.getppid() if args.exit_with_parent else None,
        args.endpoint_file,
        followers,
    )
    io.start()
    io.bound.wait()
    outbox = Outbox()

    t0 = time.perf_counter()
    rollouts: dict[str, Any] = {}
    stores: dict[str, Any] = {}
    group: Any = None  # a trainer engine of several ranks (``trainer_width``)
    try:
        if options is None:
            raise OptionError(option_error)
        if ranks > 1 and len(models) > 1:
            raise OptionError(f"a trainer engine of {ranks} ranks serves one model; this worker has {len(models)}")
        for m, model in enumerate(models):
            if sleep_mode and rollouts:  # the engine built last is awake; the others sleep
                list(rollouts.values())[-1].sleep()
            nvme = nvme_tier_dir(args, config)
            nvme = nvme if m == 0 else nvme / f"m{m}"  # each model's store has its own files
            built = build_engines(
                args,
                config,
                kinds,
                options,
                model,
                sleep_mode=sleep_mode,
                nvme_dir=nvme,
                eid=engine_id(args.worker_id, "trainer", m),
            )
            if "rollout" in built:
                rollouts[engine_id(args.worker_id, "rollout", m)] = built["rollout"]
            if "trainer" in built:
                stores[engine_id(args.worker_id, "trainer", m)] = built["trainer"]
            group = built.get("group", group)
    except Exception as exc:  # noqa: BLE001 - told to the daemon, then exit
        log.error("engine start failed: %s", traceback.format_exc())
        outbox.register(msgspec.structs.replace(register, error=f"engine start failed: {_error_text(exc)}"))
        time.sleep(1.0)
        sys.exit(1)
    log.info("engines %s ready in %.1f s", ",".join(kinds), time.perf_counter() - t0)
    if stores:
        io.resident = lambda: {
            job: trainer_engine
            for trainer_engine, store in stores.items()
            for tier in ("device", "host", "nvme")
            for job in store.inventory().get(tier, {}).get("jobs", [])
        }
    if rollouts:  # the sequences each holds: the daemon refuses jobs whose max_tokens cannot fit
        held = {eid: int(engine.plan.llm_kwargs["max_model_len"]) for eid, engine in rollouts.items()}
        register = msgspec.structs.replace(
            register,
            engines=[
                msgspec.structs.replace(d, max_model_len=held[d.engine_id]) if d.engine_id in held else d
                for d in register.engines
            ],
        )
    if stores:  # the step each trainer runs: the daemon refuses jobs whose step fits none
        steps = {eid: store.trainer.step_info for eid, store in stores.items()}
        register = msgspec.structs.replace(
            register,
            engines=[
                msgspec.structs.replace(
                    d,
                    gradient_checkpointing="on" if steps[d.engine_id]["gradient_checkpointing"] else "off",
                    micro_batch_tokens=steps[d.engine_id]["micro_batch_tokens"],
                    step_room_bytes=steps[d.engine_id]["room_bytes"],
                )
                if d.engine_id in steps and steps[d.engine_id]
                else d
                for d in register.engines
            ],
        )
    io.register = msgspec.structs.replace(register, ready=True)
    outbox.register(io.register)

    signal.signal(signal.SIGTERM, lambda *_: _leave(args.worker_id))
    if stores:
        threading.Thread(
            target=prefetch_loop, args=(stores, queues[PREFETCH]), name="plexw-prefetch", daemon=True
        ).start()
    rollout = Rollouts(rollouts, one_awake=sleep_mode) if rollouts else None
    trainers = GroupTrainers(group, _engine_failed) if group is not None else None
    if rollout is not None and stores and shared:
        shared_loop(rollout, stores, queues[decls[0].engine_id], args.rollout_capacity, followers, sleep_mode, trainers)
    elif rollout is not None:
        if stores:
            threading.Thread(
                target=trainer_loop,
                args=(stores, queues[next(iter(stores))], followers, sleep_mode, trainers),
                name="plexw-trainer",
                daemon=True,
            ).start()
        rollout_loop(rollout, queues[next(iter(rollouts))], args.rollout_capacity, followers)
    else:
        trainer_loop(stores, queues[next(iter(stores))], followers, sleep_mode, trainers)


def _engine_failed(reason: str) -> None:
    """A rank of this worker's trainer engine failed: the worker exits, and is started again whole."""
    log.error("exiting: the trainer engine's ranks failed (%s)", reason)
    logging.shutdown()
    os._exit(3)


def engine_id(worker_id: str, kind: str, model_index: int) -> str:
    """``w0/rollout`` for the first model's engines, ``w0/m1/rollout`` for the second's."""
    return f"{worker_id}/{kind}" if model_index == 0 else f"{worker_id}/m{model_index}/{kind}"


def _leave(worker_id: str) -> None:
    """SIGTERM: tell the daemon this worker leaves (its calls run again elsewhere), then exit."""
    log.info("leaving the cluster")
    try:
        send_frames(Outbox().sock, P.encode(P.Op.LEAVE, P.HeartbeatBody(worker_id))[0])
        time.sleep(0.5)  # the I/O thread forwards it
    finally:
        logging.shutdown()
        os._exit(0)


def _adapter_slots(config: ClusterConfig, device: Platform) -> tuple[int, int]:
    """(GPU slots, host-cached adapters) of the rollout engine: as asked, else sized for the jobs.
    The cached adapters are the jobs it holds at once (``EngineDecl.adapter_slots``)."""
    expected_jobs = config.jobs_per_engine or ENGINE_DEFAULTS[device].max_cached_loras  # no cap: what the cache holds
    if config.max_loras is not None:
        return config.max_loras, max(2 * config.max_loras, expected_jobs)
    return adapter_slots(expected_jobs, device)


def trainer_step(config: ClusterConfig, kinds: list[str], options: EngineOptions, model: str) -> WorkerStep:
    """The memory plan's decision for this worker's trainer (``memplan.worker_step``): its GPU's
    memory, the rollout engine beside it on the same GPU and its share, its device slots. On the
    CPU: checkpointing only when asked (``on``)."""
    if options.device != "cuda":
        return WorkerStep(config.gradient_checkpointing == "on", 0, 0, None)
    import torch

    from plexctl.common.state_size import model_config

    shared = "rollout" in kinds
    utilization = config.gpu_memory_utilization or ENGINE_DEFAULTS["cuda"].gpu_memory_utilization
    return worker_step(
        model_config(model),
        options.dtype,
        options.micro_batch_tokens,
        config.gradient_checkpointing,
        int(torch.cuda.mem_get_info()[1]),
        utilization if shared else None,
        config.device_slots,
        _max_lora_rank(config, options.device),
        cuda=True,
    )


def cap_memory(fraction: float | None, device: str) -> None:
    """Hold the process to the trainer's share of a GPU it shares (CUDA only; None: no cap)."""
    if fraction is None or device != "cuda":
        return
    import torch

    torch.cuda.set_per_process_memory_fraction(fraction)


def step_info(step: WorkerStep, micro_batch_tokens: int) -> dict[str, Any]:
    """What ``status`` shows of a trainer's step (the device tier's ``step``)."""
    return {
        "gradient_checkpointing": step.gradient_checkpointing,
        "micro_batch_tokens": micro_batch_tokens,
        "peak_bytes": step.step_peak_bytes,
        "room_bytes": step.room_bytes,
        "memory_fraction": step.memory_fraction,
    }


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _mem_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


if __name__ == "__main__":
    main()
