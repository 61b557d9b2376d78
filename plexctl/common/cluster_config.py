"""The cluster's settings: one typed ``ClusterConfig``, written once by ``plexctl up``, read by every process.

This module owns every setting of a cluster (placement, engines, state tiers, drain, ports, the
Slurm allocation), each declared once with its type, its constraints, its default and its meaning
(the ``msgspec.Meta`` description, which is also ``up --help``'s text and the generated
``docs/cluster-reference.md``). ``plexctl up`` builds one from its options, checks it
(``config_problems``: one line per bad value, naming the option) and writes it into the state
directory (``cluster.json``, atomically); the daemon, the Slurm node tasks and the workers read it
(``read_config``), their command lines carry only what differs per process (state directory,
worker id, its engines, the endpoint). A setting whose default depends on where the cluster runs
has ``None`` for "derived", and one function here says how (``drain_timeout_s``,
``min_lora_rank``); defaults that depend on the engines' platform (GPU or CPU) are declared once in
``plexctl.common.engine_defaults`` (the worker resolves them from there, the memory plan assumes a
GPU's), and the descriptions quote them from there.

``python -m plexctl.common.cluster_config FILE KEY=VALUE ...`` writes a config from its defaults
and the given values (each parsed as YAML): what ``slurm/plexrl.sbatch`` runs for those who submit
it with plain ``sbatch``.

It deliberately does not start, size or place anything, and imports nothing of the daemon or
the workers (the CLI reads it on a login node).
"""

from __future__ import annotations

import functools
import re
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin

import msgspec
from msgspec import Meta

from plexctl.common.atomic import write_bytes_atomic
from plexctl.common.engine_defaults import ENGINE_DEFAULTS, by_platform
from plexctl.common.errors import UsageError
from plexctl.common.scheduling import POLICIES
from plexctl.common.sizes import parse_bytes

if TYPE_CHECKING:
    PolicyName = str
else:
    PolicyName = Literal[POLICIES]  # the registry's names (plexctl.common.scheduling)

CONFIG_FILE = "cluster.json"  # in the cluster's state directory
LOCAL_DRAIN_TIMEOUT_S = 30.0  # a local cluster: nothing ends it but `down`, so jobs are asked to be quick
DRAIN_MARGIN = (15.0, 0.2)  # on Slurm the drain leaves this much of the signal grace (s, share: the larger) ...
MIN_SLURM_DRAIN_S = 10.0  # ... but jobs get at least this long
LOCAL, SLURM = "local", "slurm"  # where a setting applies (``scope``); unmarked settings apply to both

# The up options whose name is not the setting's (``--`` + the name with dashes otherwise).
_OPTION_NAMES = {
    "models": "--model",
    "trusted_users": "--trust-user-code",
    "job_limits": "--job-limit",
    "time_limit": "--time",
}


def _doc(description: str, scope: str | None = None, **constraints: Any) -> Meta:
    return Meta(description=description, extra={"scope": scope} if scope else None, **constraints)


SDK_DEFAULT_RANK = 32  # the Tinker SDK's LoRA rank when its client names none (create_lora_training_client)


class ClusterConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The settings of one cluster: `plexctl up`'s options, kept in the state directory's `cluster.json`.

    Every process of the cluster reads them from there: the daemon, each Slurm node's task and each
    worker. `null` means the default is derived where the value is needed (from the platform, the
    model or where the cluster runs), as each row says.
    """

    # ---- what the engines serve, and where jobs go
    models: Annotated[
        list[str],
        _doc(
            "Base models the engines serve (Hugging Face directories), each in an engine of each kind "
            "(empty: .plexrl/models/tiny-arith under the directory `up` runs in)"
        ),
    ] = msgspec.field(default_factory=list)
    policy: Annotated[
        PolicyName,
        _doc("Placement of jobs on engines: " + " | ".join(POLICIES)),
    ] = "spread+backfill"
    jobs_per_engine: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        _doc(
            "Cap on the jobs one engine is home to; more wait (null: as many as the engines' memory holds: "
            "a rollout engine's adapter slots, a trainer's host and NVMe tiers)",
            LOCAL,
        ),
    ] = None
    train_grouping: Annotated[
        bool,
        _doc(
            "Train the steps of several LoRA jobs of one base in shared passes (each job's update equal to "
            "alone within float rounding, not to the bit; bench/train_batching.py)",
            LOCAL,
        ),
    ] = False
    group_window_ms: Annotated[
        float,
        _doc(
            "How long a trainer waits at most for more jobs' steps to share a pass (with train_grouping)", LOCAL, ge=0
        ),
    ] = 5.0
    workers: Annotated[int, _doc("Local workers (1: both engines in one)", LOCAL, ge=1, le=8)] = 2

    # ---- the engines (every worker)
    device: Annotated[
        Literal["auto", "cpu", "cuda"], _doc("Where engines run: auto (a GPU when the worker sees one) | cpu | cuda")
    ] = "auto"
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        _doc(f"Weight dtype of the engines: auto ({by_platform('dtype')}) | float32 | bfloat16 | float16"),
    ] = "auto"
    max_loras: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        _doc(
            "Adapter slots in the rollout engine (null: one per job it is home to, jobs_per_engine or else "
            f"{by_platform('max_cached_loras')}, at most {by_platform('max_lora_slots')})"
        ),
    ] = None
    max_lora_rank: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        _doc(
            f"Highest LoRA rank the rollout engines load (null: {by_platform('max_lora_rank')}; with tinker_port "
            f"at least {SDK_DEFAULT_RANK}, the Tinker SDK's default rank)",
        ),
    ] = None
    gpu_memory_utilization: Annotated[
        Annotated[float, Meta(ge=0.05, le=1.0)] | None,
        _doc(
            "Share of its GPUs' memory a rollout engine takes "
            f"(null: {ENGINE_DEFAULTS['cuda'].gpu_memory_utilization}; ignored on CPU)"
        ),
    ] = None
    micro_batch_tokens: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        _doc(f"Padded tokens of one trainer micro-batch (null: {by_platform('micro_batch_tokens')})"),
    ] = None
    max_model_len: Annotated[
        Annotated[int, Meta(ge=16)] | None,
        _doc(
            "Tokens of a sequence (prompt and completion) the rollout engine holds "
            "(null: the model's context, at most 4096)",
        ),
    ] = None
    gradient_checkpointing: Annotated[
        Literal["auto", "on", "off"],
        _doc("Recompute activations in the trainer's backward: auto (where the memory plan says it pays) | on | off"),
    ] = "auto"

    # ---- the state tiers (every trainer)
    device_slots: Annotated[int, _doc("Jobs whose state the trainer keeps on device", ge=1)] = 4
    host_mem: Annotated[
        str,
        _doc(
            "Host-memory tier for swapped-out job state; each trainer makes one arena (pinned on CUDA) of "
            "this plus its spill, write-behind and transit allowances, 13/8 of it by default"
        ),
    ] = "8G"
    nvme_dir: Annotated[str | None, _doc("Node-local NVMe tier (null: the worker's scratch directory)")] = None
    nvme_bytes: Annotated[str, _doc("Capacity of the NVMe tier")] = "64G"
    write_behind: Annotated[
        str | None,
        _doc(
            "Host memory beyond host_mem for job state on its way to NVMe, written while the trainer goes on "
            "(null: a quarter of host_mem, at least 1G; 0: written first)"
        ),
    ] = None

    # ---- the daemon
    drain_timeout: Annotated[
        Annotated[float, Meta(gt=0)] | None,
        _doc(
            "Seconds running jobs get to checkpoint when the cluster stops (null: 30 on a local cluster; "
            "on Slurm the signal grace less a margin: drain_timeout_s)",
        ),
    ] = None
    worker_grace: Annotated[
        float,
        _doc(
            "Seconds a worker that misses heartbeats (suspect: no new calls, its jobs kept) may stay silent "
            "before it is lost (a 30 s stall survives); a worker whose process exits is lost at once",
            ge=1.0,
        ),
    ] = 60.0
    trusted_users: Annotated[
        list[str],
        _doc(
            "Users whose code runs with the owner's rights (algo.loss_fn in the trainer, loops and "
            "environments unjailed)"
        ),
    ] = msgspec.field(default_factory=list)
    job_limits: Annotated[
        list[str],
        _doc(
            "What each jailed job may take, NAME=VALUE: memory=8G, processes=256, job-dir=2G, tmp=1G, cpu=0, and "
            "what a user's Tinker saves may take together: tinker-disk=20G, tinker-saves=1000 (the defaults; cpu "
            "in CPU seconds; 0: no limit); per user: `plexctl share USER --limit`"
        ),
    ] = msgspec.field(default_factory=list)
    metrics_port: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        _doc("Serve Prometheus metrics on this port (0: a free one; null: off)"),
    ] = None
    tinker_port: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        _doc(
            "Serve the Tinker API on this port (0: a free one, the same at each `up` while it is free; null: off): "
            "Tinker SDK code runs here with "
            "base_url and the API key `up` prints the path of",
        ),
    ] = None
    openai_port: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        _doc(
            "Serve the OpenAI API (/v1/models, /v1/completions, /v1/chat/completions) on this port (0: a free one; "
            "null: off): the `openai` SDK samples your jobs' policies and the base models with the API key `up` "
            "prints the path of",
        ),
    ] = None

    openai_idle: Annotated[
        float,
        _doc(
            "Seconds a user's OpenAI sampler job (the job their OpenAI requests sample through) may go without a "
            "request before it ends; their next request starts it again",
            ge=1,
        ),
    ] = 600.0

    # ---- the Slurm allocation
    nodes: Annotated[int, _doc("Nodes, one task each", SLURM, ge=1)] = 1
    max_nodes: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        _doc(
            "Nodes the cluster may grow to: when jobs wait for engines longer than grow_after, the daemon "
            "submits joining allocations of one node each, and gives back one whose engines held no job for "
            "shrink_after, never below nodes (null: the allocation stays as `up` made it)",
            SLURM,
        ),
    ] = None
    grow_after: Annotated[
        float, _doc("Seconds jobs wait for engines before the cluster grows (with max_nodes)", SLURM, ge=0)
    ] = 300.0
    shrink_after: Annotated[
        float, _doc("Seconds a joined node's engines hold no job before it is given back (with max_nodes)", SLURM, ge=0)
    ] = 600.0
    gpus_per_node: Annotated[int, _doc("GPUs per node", SLURM, ge=0)] = 0
    engines: Annotated[
        list[str],
        _doc("Engines of node i: the (i mod n)-th entry, e.g. rollout,trainer", SLURM, min_length=1),
    ] = msgspec.field(default_factory=lambda: ["rollout,trainer"])
    rollout_gpus: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        _doc("GPUs of each node given to rollout engines (null: 3/4 of them)", SLURM),
    ] = None
    trainer_gpus: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        _doc("GPUs of each node given to trainer engines, one each (null: 1/4 of them)", SLURM),
    ] = None
    tp: Annotated[int, _doc("GPUs of one rollout engine (tensor parallel)", SLURM, ge=1)] = 1
    trainer_width: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        _doc(
            "GPUs of one trainer engine (its ranks), the base model's weights sharded across them (FSDP2): "
            "a LoRA job's adapter replicated, a full fine-tuning job's weights and moments sharded (null: 1 on "
            "a worker; plexctl plan shows the smallest width whose per-rank step fits one trainer GPU). It "
            "divides a node's trainer GPUs, or, wider, is a multiple of them: whole nodes, rank 0 on the first, "
            "whose worker speaks for the engine"
        ),
    ] = None
    scratch: Annotated[
        str | None, _doc("Node-local directory for the NVMe tier (null: $SLURM_TMPDIR, $TMPDIR)", SLURM)
    ] = None
    time_limit: Annotated[str, _doc("Time limit (minutes, HH:MM:SS, D-HH:MM:SS)", SLURM)] = "24:00:00"
    partition: Annotated[str | None, _doc("Partition", SLURM)] = None
    account: Annotated[str | None, _doc("Account", SLURM)] = None
    qos: Annotated[str | None, _doc("Quality of service", SLURM)] = None
    constraint: Annotated[str | None, _doc("Node features", SLURM)] = None
    exclusive: Annotated[bool, _doc("Whole nodes", SLURM)] = False
    cpus_per_task: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        _doc("CPUs per node's task (null: 8 per GPU, none asked without GPUs)", SLURM),
    ] = None
    mem: Annotated[
        str | None, _doc("Memory per node, e.g. 200G (null: all of it with GPUs, none asked without)", SLURM)
    ] = None
    signal_grace: Annotated[
        int, _doc("Seconds between the drain signal and the end of the allocation", SLURM, ge=10)
    ] = 300


DEFAULTS = ClusterConfig()


class ConfigError(UsageError):
    """A cluster config that cannot be read or holds a bad value: one line saying which."""


# ---------------------------------------------------------------- the settings, described


def settings() -> tuple[str, ...]:
    """Every setting's name, in declaration order."""
    return ClusterConfig.__struct_fields__


def option_name(setting: str) -> str:
    """``plexctl up``'s option for a setting: ``--host-mem`` for ``host_mem``."""
    return _OPTION_NAMES.get(setting, "--" + setting.replace("_", "-"))


def _unwrap(tp: Any, metas: list[Meta] | None = None) -> Any:
    """A field's type without ``Annotated`` and ``None``; its ``Meta`` go into ``metas``."""
    while True:
        if get_origin(tp) is Annotated:
            tp, *extra = get_args(tp)
            if metas is not None:
                metas += [m for m in extra if isinstance(m, Meta)]
        elif get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp):
            tp = next(a for a in get_args(tp) if a is not type(None))
        else:
            return tp


@functools.cache
def _fields() -> dict[str, msgspec.structs.FieldInfo]:
    """``ClusterConfig``'s fields by name, read once (each read evaluates every annotation)."""
    return {f.name: f for f in msgspec.structs.fields(ClusterConfig)}


@functools.cache
def _metas(setting: str) -> tuple[Meta, ...]:
    metas: list[Meta] = []
    _unwrap(_fields()[setting].type, metas)
    return tuple(metas)


def _described(setting: str) -> Meta:
    return next(m for m in _metas(setting) if m.description)


def scope(setting: str) -> str | None:
    """``LOCAL`` or ``SLURM`` for a setting that applies to one kind of cluster only, else None."""
    extra = _described(setting).extra
    return extra.get("scope") if extra else None


def help_text(setting: str, scoped: bool = True) -> str:
    """The setting's description as ``up --help`` says it: its scope first (``scoped``), null as "default"."""
    text = _described(setting).description or ""
    for word in ("(null: ", "(empty: ", "; null: "):
        text = text.replace(word, word[0] + "default: ")
    text = re.sub(r"\b[a-z]+_[a-z_]+\b", lambda m: option_name(m[0]) if m[0] in settings() else m[0], text)
    if text[1:2].islower():  # "Nodes, ..." -> "nodes, ..."; "GPUs per node" stays
        text = text[0].lower() + text[1:]
    where = scope(setting) if scoped else None
    return f"--{where}: {text}" if where else text


def bounds(setting: str) -> dict[str, float]:
    """The typer ``min``/``max`` of a numeric setting (its ``ge``/``le``)."""
    metas = _metas(setting)
    low = next((m.ge for m in metas if m.ge is not None), None)
    high = next((m.le for m in metas if m.le is not None), None)
    return {k: v for k, v in (("min", low), ("max", high)) if v is not None}


def default(setting: str) -> Any:
    return getattr(DEFAULTS, setting)


def value_type(setting: str) -> Any:
    """The setting's type without its constraints and without ``None``: ``int`` for ``jobs_per_engine``,
    ``Literal[...]`` for ``policy``, ``list[str]`` for ``models``."""
    return _unwrap(_fields()[setting].type)


def choices(setting: str) -> tuple[str, ...]:
    """The values a ``Literal`` setting takes (empty for any other)."""
    base = value_type(setting)
    return get_args(base) if get_origin(base) is Literal else ()


def value_problem(setting: str, value: Any) -> str | None:
    """The line ``config_problems`` says of ``value`` for ``setting`` (its type, choices and bounds), or None."""
    try:
        msgspec.convert({setting: value}, ClusterConfig)
    except msgspec.ValidationError as exc:
        return f"{option_name(setting)} {value!r}: {_reason(setting, exc)}"
    return None


# ---------------------------------------------------------------- derived defaults


def drain_timeout_s(config: ClusterConfig, slurm: bool) -> float:
    """Seconds jobs get to checkpoint when the cluster stops: the setting, else 30 on a local cluster,
    else (Slurm) what the signal grace leaves after a margin for the requeue (300 s: 240)."""
    if config.drain_timeout is not None:
        return config.drain_timeout
    if not slurm:
        return LOCAL_DRAIN_TIMEOUT_S
    margin_s, share = DRAIN_MARGIN
    return max(MIN_SLURM_DRAIN_S, config.signal_grace - max(margin_s, config.signal_grace * share))


def min_lora_rank(config: ClusterConfig) -> int:
    """The lowest rank the rollout engines' default ``max_lora_rank`` must cover: the Tinker SDK's
    default rank where the cluster serves the Tinker API, else none (0)."""
    if config.tinker_port is None:
        return 0
    return SDK_DEFAULT_RANK


# ---------------------------------------------------------------- checking


def config_problems(config: ClusterConfig) -> list[str]:
    """One line per bad value, naming ``up``'s option (empty when the config is good). The types,
    choices and bounds of every field, then what the types do not say (sizes, job limits)."""
    problems: list[str] = []
    raw = msgspec.to_builtins(config)
    problems += filter(None, (value_problem(setting, raw[setting]) for setting in settings()))
    for setting in ("host_mem", "nvme_bytes", "write_behind"):
        value = getattr(config, setting)
        if value is not None:
            try:
                parse_bytes(value)
            except ValueError as exc:
                problems.append(f"{option_name(setting)}: {exc}")
    problems += trainer_width_problems(config)
    if config.max_nodes is not None and config.max_nodes < config.nodes:
        problems.append(
            f"{option_name('max_nodes')} {config.max_nodes}: fewer than {option_name('nodes')} {config.nodes}, "
            "the nodes the cluster never goes below"
        )
    if config.job_limits:
        from plexctl.common.limits import parse_limits

        try:
            parse_limits(config.job_limits)
        except UsageError as exc:
            problems.append(str(exc).replace("--limit", option_name("job_limits"), 1))
    return problems


def node_trainer_gpus(config: ClusterConfig) -> list[int]:
    """The trainer GPUs of each kind of node of the Slurm allocation (its ``engines`` entries that
    run a trainer), as ``plexctl.common.layout`` places them; [] without GPUs per node or where
    the layout itself is refused (``up`` says why)."""
    from plexctl.common.layout import LayoutError, place_workers

    if config.gpus_per_node <= 0:
        return []
    counts = []
    for entry in dict.fromkeys(config.engines):
        kinds = [k.strip() for k in entry.split(",") if k.strip()]
        if "trainer" not in kinds:
            continue
        try:
            workers = place_workers(
                "(config)",
                [str(i) for i in range(config.gpus_per_node)],
                kinds,
                rollout_gpus=config.rollout_gpus,
                trainer_gpus=config.trainer_gpus,
                tp=config.tp,
                trainer_width=1,  # the node's trainer GPUs, whatever the engines' width
            )
        except LayoutError:
            return []
        counts.append(sum(len(w.devices) for w in workers if "trainer" in w.engines))
    return counts


def trainer_width_problems(config: ClusterConfig) -> list[str]:
    """What ``trainer_width`` must be on the allocation's nodes (nothing to check without GPUs per
    node, a local cluster's: ``plexctl plan`` checks it against its node), by a node's trainer GPUs
    (as ``plexctl.common.layout`` places them): within a node it divides them (each trainer GPU in
    an engine of that width); wider, it spans whole nodes' trainer GPUs, a multiple of them, at most
    the allocation's."""
    width, per_node = config.trainer_width, config.gpus_per_node
    if width is None or width == 1 or per_node <= 0:
        return []
    option = option_name("trainer_width")
    entries = [[k.strip() for k in entry.split(",")] for entry in config.engines] or [["rollout", "trainer"]]
    training_nodes = sum(1 for i in range(config.nodes) if "trainer" in entries[i % len(entries)])
    for trainers in node_trainer_gpus(config):
        if width > trainers:
            if width % trainers:
                return [
                    f"{option} {width}: wider than a node's {trainers} trainer GPUs, so it spans whole nodes: "
                    f"a multiple of {trainers}"
                ]
            if width > trainers * training_nodes:
                return [
                    f"{option} {width}: more than the allocation's {training_nodes} x {trainers} trainer GPUs "
                    f"({option_name('nodes')})"
                ]
        elif trainers % width:
            return [
                f"{option} {width}: does not divide the {trainers} trainer GPUs of a node "
                f"({option_name('trainer_gpus')}); widths that do: {', '.join(map(str, _divisors(trainers)))}"
            ]
    return []


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _reason(setting: str, exc: msgspec.ValidationError) -> str:
    """The choices of a setting that has some, else msgspec's message without its path."""
    if choices(setting):
        return f"choose one of {', '.join(choices(setting))}"
    text = str(exc).split(" - at ", 1)[0]
    return text[0].lower() + text[1:] if text else "not a valid value"


def checked(config: ClusterConfig) -> ClusterConfig:
    """``config``, or ``ConfigError`` with one line per bad value."""
    problems = config_problems(config)
    if problems:
        raise ConfigError("\n".join(problems))
    return config


# ---------------------------------------------------------------- the file


def config_path(state_dir: Path) -> Path:
    return state_dir / CONFIG_FILE


def write_config(path: Path, config: ClusterConfig) -> None:
    """Write ``config`` atomically (the file is the owner's alone, as the state directory is)."""
    write_bytes_atomic(path, msgspec.json.format(msgspec.json.encode(config), indent=2) + b"\n")


def read_config(path: Path | None) -> ClusterConfig:
    """The config in ``path``; every default when there is no file (a daemon started by hand, a
    test's bare daemon). A file that is not a good config is a ``ConfigError`` naming it."""
    if path is None:
        return ClusterConfig()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return ClusterConfig()
    try:
        return msgspec.json.decode(data, type=ClusterConfig)
    except msgspec.DecodeError as exc:  # ValidationError is one
        raise ConfigError(f"{path}: not a cluster config: {exc}") from None


def with_settings(config: ClusterConfig, items: Sequence[str]) -> ClusterConfig:
    """``config`` with ``KEY=VALUE`` items applied (each value parsed as YAML: ``tp=2``,
    ``engines=[rollout, trainer]``); one line per bad item."""
    from plexctl.common.scalars import parse_value

    values = msgspec.to_builtins(config)
    problems = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or key not in values:
            problems.append(f"{item!r}: expected KEY=VALUE with KEY a setting (docs/cluster-reference.md)")
            continue
        try:
            values[key] = parse_value(key, raw) if raw.strip() else None
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError("\n".join(problems))
    try:
        return checked(msgspec.convert(values, ClusterConfig))
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0].startswith("-"):
        print("usage: python -m plexctl.common.cluster_config FILE [KEY=VALUE ...]", file=sys.stderr)
        return 2
    try:
        write_config(Path(args[0]), with_settings(ClusterConfig(), args[1:]))
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
