"""Which workers a node runs, and on which of its GPUs (pure: no torch, no Slurm needed).

A node without GPUs runs one worker holding all of the node's engines, named after the node.
A node with GPUs runs one worker per engine, each on GPUs of its own: a trainer on one GPU, a
rollout engine on ``tp`` GPUs (its tensor-parallel size); only a node with a single GPU and
both kinds puts both engines in one worker on that GPU. Rollout engines take the first GPUs of
the node's list, trainers the next ones. A worker is named ``NODE-gI``, ``I`` the index in the
node's list of its first GPU, so ids are distinct on a node and stable across restarts.

Invariants of what ``place_workers`` returns: no GPU belongs to two workers; every engine kind
of the node has at least one worker; a GPU id is one of the node's, spelled as Slurm gave it
(``CUDA_VISIBLE_DEVICES`` values: indices, UUIDs or MIG names). Bad options raise
``LayoutError`` with one line naming the option and the numbers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from plexctl.common.errors import UsageError

KINDS = ("rollout", "trainer")  # the order of a worker's engines, and of the node's GPUs
GPU_ENV = ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "GPU_DEVICE_ORDINAL")  # first set wins
TRAINER_SHARE = 4  # default split on a node with both kinds: one trainer GPU per this many GPUs (at least one)


class LayoutError(UsageError):
    """The GPU options do not fit a node: too many GPUs asked, a kind left without one, ..."""


class WorkerPlacement(msgspec.Struct, frozen=True):
    """One worker of a node: its id, its engines, its GPUs, and its scratch directory's name
    under the node's scratch ("" = the node's scratch itself, for the single worker of a
    node without GPUs)."""

    worker_id: str
    engines: list[str]
    devices: list[str]
    scratch_name: str


def node_gpus(env: Mapping[str, str]) -> list[str]:
    """The GPU ids a Slurm task may use, as ``CUDA_VISIBLE_DEVICES`` values.

    The first variable of ``GPU_ENV`` that is set decides (empty: no GPUs). Slurm sets
    ``CUDA_VISIBLE_DEVICES`` for a task of a job that asked for GPUs; the others are
    fallbacks (``SLURM_*_GPUS`` hold global indices, the same thing unless device cgroups
    renumber them). ``NoDevFiles`` (a GRES without device files) means none.
    """
    for name in GPU_ENV:
        if name in env:
            value = env[name].strip()
            if value == "NoDevFiles":
                return []
            return [g.strip() for g in value.split(",") if g.strip()]
    return []


def check_gpus(node: str, gpus: list[str], gpus_per_node: int) -> list[str]:
    """The GPUs a node's workers use: the first ``gpus_per_node`` of those Slurm gave (all of
    them when 0 were asked). Raises ``LayoutError`` when the node has fewer than asked."""
    if gpus_per_node < 0:
        raise LayoutError(f"--gpus-per-node {gpus_per_node}: must be 0 or more")
    if gpus_per_node == 0:
        return list(gpus)
    if len(gpus) < gpus_per_node:
        seen = ",".join(gpus) or "none"
        raise LayoutError(
            f"--gpus-per-node {gpus_per_node}: node {node} has {len(gpus)} GPU"
            f"{'s' * (len(gpus) != 1)} (CUDA_VISIBLE_DEVICES={seen})"
        )
    return list(gpus[:gpus_per_node])


def engine_kinds(text: str) -> list[str]:
    """``rollout,trainer`` (a node's ``--engines`` value) as a list in ``KINDS`` order."""
    kinds = {k.strip() for k in text.split(",") if k.strip()}
    unknown = sorted(kinds - set(KINDS))
    if unknown or not kinds:
        raise LayoutError(f"--engines {text!r}: use rollout, trainer or rollout,trainer")
    return [k for k in KINDS if k in kinds]


def place_workers(
    node: str,
    gpus: list[str],
    kinds: Iterable[str],
    *,
    rollout_gpus: int | None = None,
    trainer_gpus: int | None = None,
    tp: int,
    trainer_width: int,
) -> list[WorkerPlacement]:
    """The workers of ``node`` (its name, or the base of its worker ids) on ``gpus``.

    ``kinds``: the node's engine kinds. ``rollout_gpus``/``trainer_gpus``: GPUs per kind
    (None: the default split, ``TRAINER_SHARE``; a count for a kind the node does not run is
    ignored, as the options apply to all nodes; explicit counts below the node's GPUs leave
    the rest unused). ``tp``: GPUs per rollout engine. ``trainer_width``: GPUs per trainer engine
    (its ranks), a worker's; an engine wider than the node's trainer GPUs takes them all in one
    worker, its part of the engine (``trainer_span``).
    """
    wanted = set(kinds)
    if not wanted or wanted - set(KINDS):
        raise LayoutError(f"--engines {','.join(sorted(wanted))!r}: use rollout, trainer or rollout,trainer")
    node_kinds = [k for k in KINDS if k in wanted]
    if tp < 1:
        raise LayoutError(f"--tp {tp}: must be 1 or more")
    counts = {"rollout": rollout_gpus, "trainer": trainer_gpus}
    for kind, n in counts.items():
        if n is not None and n < 0:
            raise LayoutError(f"--{kind}-gpus {n}: must be 0 or more")
    if not gpus:
        if tp > 1 and "rollout" in wanted:
            raise LayoutError(f"--tp {tp}: node {node} has no GPUs (tensor parallelism needs {tp})")
        for kind in node_kinds:
            if counts[kind]:
                raise LayoutError(f"--{kind}-gpus {counts[kind]}: node {node} has no GPUs (ask --gpus-per-node)")
        return [WorkerPlacement(node, node_kinds, [], "")]
    if (
        node_kinds == list(KINDS)
        and len(gpus) == 1
        and rollout_gpus is None
        and trainer_gpus is None
        and tp == 1
        and trainer_width == 1  # a trainer of several ranks forms a process group vLLM's may not share
    ):
        return [WorkerPlacement(f"{node}-g0", node_kinds, [gpus[0]], f"{node}-g0")]  # both engines share it
    split = _split(node, len(gpus), node_kinds, rollout_gpus, trainer_gpus, tp)
    workers, first = [], 0
    for kind in node_kinds:
        size = tp if kind == "rollout" else max(1, min(trainer_width, split[kind]))
        for _ in range(split[kind] // size):
            worker_id = f"{node}-g{first}"
            workers.append(WorkerPlacement(worker_id, [kind], list(gpus[first : first + size]), worker_id))
            first += size
    return workers


def _split(
    node: str, total: int, kinds: list[str], rollout: int | None, trainer: int | None, tp: int
) -> dict[str, int]:
    """GPUs per kind on a node of ``total`` GPUs; raises ``LayoutError`` where they do not fit."""
    has = f"node {node} has {total} GPU" + "s" * (total != 1)
    if kinds == ["trainer"]:
        n = total if trainer is None else trainer
        _check_kind(node, "trainer", n, total)
        return {"trainer": n}
    if kinds == ["rollout"]:
        n = total if rollout is None else rollout
        _check_kind(node, "rollout", n, total)
        _check_tp(node, n, tp, named=rollout is not None)
        return {"rollout": n}
    if rollout is None and trainer is None:
        trainer = max(1, total // TRAINER_SHARE)
        rollout = (total - trainer) // tp * tp  # whole engines; the GPUs left over train
        if rollout == 0:
            raise LayoutError(
                f"--tp {tp}: {has}; after {trainer} for training, too few for one rollout "
                "engine (set --rollout-gpus and --trainer-gpus)"
            )
        return {"rollout": rollout, "trainer": total - rollout}
    if rollout is not None and trainer is not None and rollout + trainer > total:
        raise LayoutError(
            f"--rollout-gpus {rollout} + --trainer-gpus {trainer} = {rollout + trainer}: "
            f"more than the {total} GPU{'s' * (total != 1)} of node {node}"
        )
    for kind, count in (("rollout", rollout), ("trainer", trainer)):
        if count is not None:
            _check_kind(node, kind, count, total)
    if rollout is None or trainer is None:  # the other kind takes the rest
        given, count = ("rollout", rollout) if trainer is None else ("trainer", trainer)
        assert count is not None  # neither given returned above
        other = "trainer" if given == "rollout" else "rollout"
        if count == total:
            raise LayoutError(
                f"--{given}-gpus {count}: leaves none of the {total} GPUs of node {node} for its "
                f"{other} engines (set --{other}-gpus, or fewer --{given}-gpus)"
            )
        rollout, trainer = (count, total - count) if given == "rollout" else (total - count, count)
        _check_tp(node, rollout, tp, named=given == "rollout")
    else:
        _check_tp(node, rollout, tp, named=True)
    return {"rollout": rollout, "trainer": trainer}


def _check_kind(node: str, kind: str, n: int, total: int) -> None:
    if n <= 0:
        raise LayoutError(
            f"--{kind}-gpus {n}: node {node} runs {kind} engines, they need at least 1 of its "
            f"{total} GPU{'s' * (total != 1)}"
        )
    if n > total:
        raise LayoutError(f"--{kind}-gpus {n}: more than the {total} GPU{'s' * (total != 1)} of node {node}")


def _check_tp(node: str, rollout: int, tp: int, *, named: bool) -> None:
    """``named``: the count is ``--rollout-gpus``'s (else what the node had left for rollout)."""
    if rollout % tp:
        what = f"--rollout-gpus {rollout}" if named else f"the {rollout} rollout GPUs of node {node}"
        raise LayoutError(f"--tp {tp} does not divide {what} into whole rollout engines")


class TrainerSpan(msgspec.Struct, frozen=True):
    """A node's part of a trainer engine wider than a node: the engine's index in the allocation,
    this node's place in it (0: the node whose worker is rank 0 and speaks for the engine), and
    the ranks it hosts."""

    engine: int
    part: int
    ranks: list[int]


def trainer_span(width: int, node_trainer_gpus: int, node_index: int) -> TrainerSpan | None:
    """Where node ``node_index`` of an allocation sits in a trainer engine of ``width`` ranks when
    that is wider than the node's ``node_trainer_gpus`` (whole nodes in order, each its GPUs' ranks);
    None when an engine fits a node (or the node has no GPUs: its engine's ranks are processes there)."""
    if node_trainer_gpus <= 0 or width <= node_trainer_gpus:
        return None
    nodes = width // node_trainer_gpus
    part = node_index % nodes
    first = part * node_trainer_gpus
    return TrainerSpan(node_index // nodes, part, list(range(first, first + node_trainer_gpus)))


def placement_span(placement: WorkerPlacement, width: int, node_index: int) -> TrainerSpan | None:
    """The span of ``placement``'s trainer engine (None: it holds none, or its engine fits the node)."""
    trainers = len(placement.devices) if "trainer" in placement.engines else 0
    return trainer_span(width, trainers, node_index)


def registers(placement: WorkerPlacement, span: TrainerSpan | None) -> bool:
    """Whether the node starts ``placement`` as a worker the daemon sees: not where its only
    engine is another node's wide trainer (its ranks then run under ``python -m worker.ranks``)."""
    return span is None or span.part == 0 or any(kind != "trainer" for kind in placement.engines)
