"""A trainer engine's per-job slots: each resident job's adapter, AdamW state and RNG in one
flat device buffer, and their lifecycle (create, release and park, export, import). A full
fine-tuning job (``lora`` None) has a slot of the same layout whose "adapter" is every weight of
the base model in float32 (its masters) beside their AdamW moments; ``worker.trainer_math``
puts those weights into the model for the job's calls only, the base's own weights stay apart.

One ``peft.PeftModel`` holds every resident job's adapter side by side (``add_adapter`` once per
job, under an engine-unique name). A job's trainable state (adapter parameters, AdamW moments
and step counts, RNG state) lives in one flat buffer, its ``Slot``, laid out exactly as a host
copy is (``worker.state.job_copy``); parameters and moments are views into it. ``export_state``
fills a ``JobStateCopy`` in a buffer of the caller's ``BufferPool`` (on CUDA from pinned memory,
on a side stream) with one ``copy_`` per run; ``release`` parks the adapter modules with their
slot, and ``import_state`` reuses a parked adapter of the same LoRA shape and copies the state
back: nothing is done per tensor.

Invariants. An adapter's initial weights are a function of its seed only (made under
``torch.manual_seed(seed)`` inside ``fork_rng``, whatever jobs exist); each job's AdamW sees only
that job's parameters; a job that leaves and comes back trains on bit-for-bit as if it had never
left (on CPU); at most ``PARKED_ADAPTERS_MAX`` released adapters are kept. ``JobSlots`` does
this, a part of ``TrainerEngine`` (``worker.trainer``) that owns its tables; not thread-safe.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model

from plexctl.common.spec import LoraSpec
from worker.errors import JobConfigError, StateCopyError, UnknownJobError
from worker.shards import local
from worker.state.job_copy import (
    ADAPTER_PREFIX,
    OPTIM_PREFIX,
    PAGE_BYTES,
    POOL_KEEP,
    RNG_PREFIX,
    BufferPool,
    JobStateCopy,
    SpecBuffers,
    StateSpec,
    TensorViews,
    aligned_host_buffer,
    check_copy_fits,
    dtype_name,
    lora_signature,
    state_spec,
)

FULL_WEIGHTS_PREFIX = "full_"  # the name of a full fine-tuning job's weights (never a peft adapter's)
PARKED_ADAPTERS_MAX = 4  # released adapters kept (with their slots) for import_state to reuse

# ---------------------------------------------------------------- per-job state


@dataclass(eq=False, slots=True)
class Slot:
    """An adapter's trainable state in one flat buffer on the engine's device: its parameters
    (``param.data`` are views), AdamW's moments and step counts (``optimizer.state`` holds views,
    made before the first step, so AdamW updates them in place and never allocates them) and the
    job's RNG state. On a CUDA engine the step counts and RNG state, which torch keeps on the
    host, are views into a small ``host`` buffer instead. ``runs``: (bytes of ``device`` or
    ``host``, their start and end in a copy's memory), contiguous on both sides: one copy each
    (one in all on CPU) moves the whole state to or from a copy laid out by ``spec``."""

    spec: StateSpec
    device: torch.Tensor  # uint8
    host: torch.Tensor | None  # uint8, CUDA engines only
    spans: dict[str, torch.Tensor]  # group name -> its flat typed view in ``device`` or ``host``
    runs: list[tuple[torch.Tensor, int, int]]
    params: dict[str, torch.nn.Parameter]  # PEFT-file key -> parameter, in module order
    optimizer: torch.optim.AdamW
    moments: dict[torch.Tensor, dict[str, torch.Tensor]]  # parameter -> AdamW's state: views
    rng: dict[str, torch.Tensor]  # the job's RNG state: views
    # one run from the first byte and ``device`` a whole number of pages (CPU): the state moves to
    # or from memory of ``numel`` bytes laid out by ``spec`` (a pool's buffer of its pages) as one
    # copy of the two tensors as they are, no view made (with the caches cold, making one costs a
    # third of a 0.4 MB copy); ``export_state`` and ``import_state`` do that themselves
    whole: bool = False
    numel: int = 0  # of ``device``
    allocated: bool = True  # ``device`` has its memory (``free`` / ``reallocate``)
    # a small state's last export: its memory (a pool's buffer, which the next export is likely
    # to get again) and the views over it; kept for states under VIEWS_KEEP_BYTES only, as it
    # keeps that buffer alive
    views: tuple[torch.Tensor, SpecBuffers, TensorViews] | None = None

    def free(self) -> None:
        """Free the device buffer; every view stays, over no memory, until ``reallocate``."""
        self.device.untyped_storage().resize_(0)
        self.allocated = False

    def reallocate(self) -> None:
        self.device.untyped_storage().resize_(self.device.numel())
        self.allocated = True

    def copy_to(self, memory: torch.Tensor, stream: Any) -> None:
        """The whole state into ``memory`` (host, laid out by ``spec``); on CUDA on ``stream``
        (non-blocking into pinned memory); complete on return."""
        if stream is None:
            for span, start, end in self.runs:
                memory[start:end].copy_(span)
            return
        stream.wait_stream(torch.cuda.current_stream(self.device.device))
        with torch.cuda.stream(stream):
            for span, start, end in self.runs:
                memory[start:end].copy_(span, non_blocking=span.is_cuda)
        stream.synchronize()

    def copy_from(self, copy: JobStateCopy, stream: Any) -> None:
        """The whole state from a copy of the same spec: one copy per run when its buffers lie
        in its memory as ``spec`` lays them out, else one per buffer; on CUDA on ``stream``
        (from pinned memory without blocking); complete on return."""
        memory = copy.memory
        if memory is not None and (
            isinstance(copy.buffers, SpecBuffers)
            and copy.buffers.memory is memory
            or all(copy.buffers[g.name].data_ptr() == memory.data_ptr() + g.offset for g in self.spec.groups)
        ):
            pairs = [(span, memory[start:end]) for span, start, end in self.runs]
        else:
            pairs = [(self.spans[g.name], copy.buffers[g.name]) for g in self.spec.groups]
        if stream is None:
            for target, source in pairs:
                target.copy_(source)
            return
        stream.wait_stream(torch.cuda.current_stream(self.device.device))
        with torch.cuda.stream(stream):
            for target, source in pairs:
                target.copy_(source, non_blocking=source.is_pinned())
        stream.synchronize()


@dataclass(slots=True)
class JobState:
    job_id: str
    adapter_name: str  # the adapter's key inside the shared PeftModel
    lora: LoraSpec | None  # None: full fine-tuning (the slot holds every weight)
    seed: int
    homes: dict[str, Home]  # PEFT-file key (full: the model's parameter name) -> where the parameter lives
    slot: Slot

    @property
    def params(self) -> dict[str, torch.nn.Parameter]:
        return self.slot.params

    @property
    def optimizer(self) -> torch.optim.AdamW:
        return self.slot.optimizer

    @property
    def rng_state(self) -> dict[str, torch.Tensor]:
        """The job's own RNG (only consumed by LoRA dropout): views, set with ``store_rng``."""
        return self.slot.rng


VIEWS_KEEP_BYTES = 1 << 20  # below this a slot keeps its last export's views (Slot.views)
Home = tuple[torch.nn.Module, str]  # (module, attribute) holding one adapter parameter


@dataclass
class ParkedAdapter:
    """A released job's adapter modules with its slot (whose memory may have been freed)."""

    adapter_name: str
    lora: LoraSpec | None  # of the job it was made for (None: full fine-tuning)
    signature: dict[str, Any]  # its lora_signature
    homes: dict[str, Home]
    slot: Slot


@dataclass
class SlabCounts:
    """Device buffers the engine's slots allocated (new, or again after being freed) and the
    imports that found a parked slot's buffer still allocated."""

    allocated: int = 0
    allocated_bytes: int = 0
    reused: int = 0


# ---------------------------------------------------------------- the slots of an engine


class JobSlots:
    """The resident jobs' adapters and slots, the parked ones, and the moves of a job's state
    off the engine and back. It owns the ``PeftModel`` it wraps around the base (made with the
    first LoRA job) and every job's ``JobState``; the base model itself is the engine's."""

    def __init__(
        self, base: torch.nn.Module, base_params: dict[str, torch.nn.Parameter], model_path: str, device: torch.device
    ) -> None:
        """``base_params``: the base model's own parameters (tied ones once), by name, taken
        before any adapter; ``model_path`` is what a PEFT adapter config names as its base."""
        self.model_path = model_path
        self.device = device
        self.slabs = SlabCounts()
        self._base = base
        self._base_params = base_params
        self._peft: PeftModel | None = None  # created with the first job's adapter
        self._jobs: dict[str, JobState] = {}
        self._cuda = device.type == "cuda"
        self._side_stream: Any = None  # torch.cuda.Stream for state copies, made on first use
        # parked slots that keep their device buffer for the next import_state (on CUDA the caching allocator does)
        self._parked_memory = POOL_KEEP if device.type == "cpu" else 0
        self._rng_shapes = {name: tuple(t.shape) for name, t in capture_rng(device).items()}
        self._adapters_made = 0
        self._parked: list[ParkedAdapter] = []  # oldest first

    @property
    def peft(self) -> PeftModel | None:
        """The PeftModel holding every resident and parked adapter (None before the first)."""
        return self._peft

    def job(self, job_id: str) -> JobState:
        """The resident job's state (``UnknownJobError`` if it is not resident)."""
        job = self._jobs.get(job_id)
        if job is None:
            raise UnknownJobError(f"job {job_id!r} is not resident on this trainer engine")
        return job

    # ------------------------------------------------------------ job lifecycle

    def ensure_job(self, job_id: str, lora: LoraSpec | None, seed: int) -> None:
        """Create the job's adapter (a function of ``seed`` only) and its AdamW. Idempotent.
        ``lora`` None: a full fine-tuning job, its weights starting as the base's."""
        existing = self._jobs.get(job_id)
        if existing is not None:
            if lora_signature(existing.lora) != lora_signature(lora):
                raise JobConfigError(
                    f"job {job_id!r} is resident with LoRA {lora_signature(existing.lora)}, not {lora_signature(lora)}"
                )
            return
        if lora is None:
            name, homes = self._full_weights(empty=False)
            slot = self._make_slot(homes)
            store_rng(slot.rng, capture_rng(self.device))  # nothing consumes it: no dropout in a full job
            self._register_job(job_id, name, None, seed, homes, slot)
            return
        adapter_name = self._new_adapter_name()
        with forked_rng(self.device):
            torch.manual_seed(seed)
            self._attach_adapter(adapter_name, peft_config(lora, self.model_path))
            rng_state = capture_rng(self.device)
        homes = self._adapter_homes(adapter_name)
        slot = self._make_slot(homes)
        store_rng(slot.rng, rng_state)
        self._register_job(job_id, adapter_name, lora, seed, homes, slot)

    def release(self, job_id: str) -> None:
        """Drop the job's adapter and optimizer state (their device memory is freed).

        The adapter's modules are parked with their slot (parameters and AdamW still views into
        it) for a later ``import_state`` of the same LoRA shape to reuse; at most
        ``PARKED_ADAPTERS_MAX`` are kept, the oldest are deleted. On CPU the ``POOL_KEEP`` largest
        parked slots keep their buffer, for the next import to copy into (on CUDA every parked
        slot's buffer is freed: the caching allocator keeps it). Live tensors taken from the job
        (``adapter_state_dict``) are not to be used after this.
        """
        job = self.job(job_id)
        del self._jobs[job_id]
        job.optimizer.zero_grad(set_to_none=True)
        self._parked.append(ParkedAdapter(job.adapter_name, job.lora, lora_signature(job.lora), job.homes, job.slot))
        while len(self._parked) > PARKED_ADAPTERS_MAX:
            self._delete_adapter(self._parked.pop(0).adapter_name)
        holding = [parked.slot for parked in reversed(self._parked) if parked.slot.allocated]
        holding.sort(key=lambda slot: -slot.device.numel())  # the largest, then the latest, keep theirs
        for slot in holding[self._parked_memory :]:
            slot.free()

    def jobs(self) -> list[str]:
        """Resident jobs, in the order they were created."""
        return list(self._jobs)

    def state_bytes(self, job_id: str) -> int:
        """Bytes of the job's adapter plus its optimizer moments and step counts (all there from
        the job's creation on)."""
        spec = self.job(job_id).slot.spec
        return spec.nbytes - spec.rng_bytes

    def adapter_state_dict(self, job_id: str) -> dict[str, torch.Tensor]:
        """The job's adapter weights under their PEFT-file keys: live tensors, not copies."""
        return {key: param.detach() for key, param in self.job(job_id).params.items()}

    def optimizer_state_dict(self, job_id: str) -> dict[str, Any]:
        """The job's AdamW ``state_dict()`` (its tensors are live, not copies)."""
        return self.job(job_id).optimizer.state_dict()

    # ------------------------------------------------------------ moving state off and back

    def export_state(self, job_id: str, pool: BufferPool | None = None) -> JobStateCopy:
        """A detached host copy of the job's adapter, optimizer and RNG; the job stays resident.

        The copy lives in one flat host buffer (``JobStateCopy.memory``): ``pool`` gives it
        (whose pages are already mapped), else it is allocated (pinned on CUDA); whoever holds
        the copy gives it back to the pool once it is done with it. The job's slot is laid out
        as the copy is, so filling it is one ``copy_`` on CPU (on CUDA: one from the device, on a
        side stream, and one of the step counts and RNG state); the copy's tensors are views
        made on first use. Complete when this returns. Follow it with ``release`` to free the
        device copy.

        A small state's move costs about as much in calls as in bytes (with the caches cold, as
        they are after a training step, each Python call costs a few microseconds): the common
        path here makes as few as it can.
        """
        job = self._jobs.get(job_id) or self.job(job_id)
        slot = job.slot
        spec = slot.spec
        if pool is not None:  # a 1-D uint8 host buffer of whole pages, at least spec.nbytes
            memory = pool.take(slot.numel if slot.whole else spec.nbytes)
        else:  # whole pages: room for O_DIRECT's padding when the store writes it
            memory = aligned_host_buffer(-(-spec.nbytes // PAGE_BYTES) * PAGE_BYTES, self.device.type == "cuda")
        if slot.whole and memory.numel() == slot.numel:  # the slot's bytes need no autograd
            memory.copy_(slot.device)
        else:
            slot.copy_to(memory, self._copy_stream())
        views = slot.views
        if views is None or views[0] is not memory:  # the pool's buffer of the last export: its views serve
            buffers = SpecBuffers(spec, memory)
            views = (memory, buffers, TensorViews(spec, buffers))
            slot.views = views if spec.nbytes < VIEWS_KEEP_BYTES else None
        group = slot.optimizer.param_groups[0]
        # by position, in the field order (job_id, lora, seed, weight_decay, param_keys, tensors,
        # buffers, layout, param_groups, state_values, memory, spec): with cold caches, keywords
        # cost a fifth of the copy; the spec's lists are read-only, as a copy's are
        return JobStateCopy(
            job.job_id,
            job.lora,
            job.seed,
            float(group["weight_decay"]),
            spec.param_keys,
            views[2],
            views[1],
            spec.layout,
            [{**group, "params": spec.param_indices}],
            {},
            memory,
            spec,
        )

    def import_state(self, job_id: str, copy: JobStateCopy) -> None:
        """Recreate the job's adapter, AdamW state and RNG exactly from ``copy``.

        The job must not be resident. A parked adapter of the same LoRA shape is reused with its
        slot (a fresh one is attached empty otherwise: peft's meta-device path, no random init),
        and the copy goes into the slot's buffer with one ``copy_`` per run (one on CPU; on CUDA
        from pinned memory, on a side stream): nothing is done per tensor. The engine keeps no
        reference to the copy's memory.
        """
        if job_id in self._jobs:
            raise JobConfigError(f"job {job_id!r} is already resident; release it before import_state")
        parked = self._unpark_adapter(copy.lora)
        adapter = parked or (
            self._attach_empty_adapter(copy.lora) if copy.lora is not None else self._attach_empty_full_weights()
        )
        try:
            slot = adapter.slot
            check_copy_fits(copy, slot.spec)
            if not slot.allocated:
                slot.reallocate()
                self._count_slab(slot)
            elif parked is not None:
                self.slabs.reused += 1
            memory = copy.memory
            if (
                slot.whole
                and memory is not None
                and type(copy.buffers) is SpecBuffers
                and copy.buffers.memory is memory
                and memory.numel() == slot.numel
            ):
                slot.device.copy_(memory)  # the pages' tail beyond the state is padding on both sides
            else:
                slot.copy_from(copy, self._copy_stream())
            group = slot.optimizer.param_groups[0]  # the copy's hyper-parameters, not its "params"
            params = group["params"]
            group.update(copy.param_groups[0])
            group["params"] = params
            self._jobs[job_id] = JobState(job_id, adapter.adapter_name, copy.lora, copy.seed, adapter.homes, slot)
        except BaseException:
            self._jobs.pop(job_id, None)
            self._delete_adapter(adapter.adapter_name)
            raise

    def _copy_stream(self) -> Any:
        """The side CUDA stream state copies run on (``None`` for a CPU engine)."""
        if not self._cuda:
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=self.device)
        return self._side_stream

    # ------------------------------------------------------------ adapters and slots

    def _attach_adapter(self, adapter_name: str, config: PeftLoraConfig, empty: bool = False) -> None:
        """Add an adapter to the PeftModel; ``empty``: parameters on the meta device, no init."""
        if self._peft is None:
            self._peft = get_peft_model(self._base, config, adapter_name=adapter_name, low_cpu_mem_usage=empty)
        else:
            self._peft.add_adapter(adapter_name, config, low_cpu_mem_usage=empty)

    def _new_adapter_name(self) -> str:
        """A fresh peft-safe adapter key (no dots, never the 'lora_' prefix), never reused."""
        self._adapters_made += 1
        return f"adapter_{self._adapters_made}"

    def _unpark_adapter(self, lora: LoraSpec | None) -> ParkedAdapter | None:
        """A parked adapter of the same LoRA shape (the latest whose slot kept its buffer, if
        any), taken off the parked list, or None."""
        parked = self._parked
        latest = None
        for i in range(len(parked) - 1, -1, -1):  # one loop, no list made: this is on every swap-in
            if parked[i].lora == lora:
                if parked[i].slot.allocated:
                    return parked.pop(i)
                if latest is None:
                    latest = i
        if latest is None:  # the same shape written another way (target modules in another order)
            signature = lora_signature(lora)
            matches = [i for i, one in enumerate(parked) if one.signature == signature]
            if not matches:
                return None
            holding = [i for i in matches if parked[i].slot.allocated]
            latest = (holding or matches)[-1]
        return parked.pop(latest)

    def _attach_empty_adapter(self, lora: LoraSpec) -> ParkedAdapter:
        """A new adapter whose slot's memory is uninitialised (peft's low_cpu_mem_usage path
        puts meta placeholders where its parameters go: no init)."""
        adapter_name = self._new_adapter_name()
        self._attach_adapter(adapter_name, peft_config(lora, self.model_path), empty=True)
        homes = self._adapter_homes(adapter_name)
        return ParkedAdapter(adapter_name, lora, lora_signature(lora), homes, self._make_slot(homes))

    def _full_weights(self, empty: bool) -> tuple[str, dict[str, Home]]:
        """A name and parameters for a full fine-tuning job, one per base parameter, float32 (its
        masters), held apart from the model: the base's values, or (``empty``) meta placeholders
        that ``_make_slot`` replaces with views over uninitialised memory. On a sharded base each
        is this rank's shard of the weight (``worker.shards.local``)."""
        holder = torch.nn.Module()
        homes: dict[str, Home] = {}
        for i, (name, param) in enumerate(self._base_params.items()):
            base = local(param)
            if empty:
                weight = torch.empty(base.shape, dtype=torch.float32, device="meta")
            else:
                weight = base.detach().to(torch.float32, copy=True)
            holder.register_parameter(f"w{i}", torch.nn.Parameter(weight, requires_grad=True))
            homes[name] = (holder, f"w{i}")
        self._adapters_made += 1
        return f"{FULL_WEIGHTS_PREFIX}{self._adapters_made}", homes

    def _attach_empty_full_weights(self) -> ParkedAdapter:
        name, homes = self._full_weights(empty=True)
        return ParkedAdapter(name, None, lora_signature(None), homes, self._make_slot(homes))

    @property
    def attached_adapters(self) -> int:
        """Adapters in the PeftModel: the resident jobs' plus the parked ones."""
        return len(self._peft.peft_config) if self._peft is not None else 0

    def _delete_adapter(self, adapter_name: str) -> None:
        if adapter_name.startswith(FULL_WEIGHTS_PREFIX):  # held apart from the model: dropped with its slot
            return
        assert self._peft is not None
        with warnings.catch_warnings():  # "adapter was active ... setting active adapter to ..."
            warnings.simplefilter("ignore", UserWarning)
            self._peft.delete_adapter(adapter_name)

    def _register_job(
        self, job_id: str, adapter_name: str, lora: LoraSpec | None, seed: int, homes: dict[str, Home], slot: Slot
    ) -> JobState:
        job = JobState(job_id, adapter_name, lora, seed, homes, slot)
        self._jobs[job_id] = job
        return job

    def _make_slot(self, homes: dict[str, Home]) -> Slot:
        """A slot for an attached adapter: one new device buffer laid out as the job's copies
        are. Its parameters become views into it, keeping their values (``param.data``: the
        ``nn.Parameter`` objects peft holds stay), or, for meta placeholders, new parameters
        over its uninitialised memory; AdamW's moments and step counts are zeros in it."""
        params = {key: getattr(module, attribute) for key, (module, attribute) in homes.items()}
        spec = self._state_spec(params)
        on_host = {g.name for g in spec.groups if self.device.type != "cpu" and g.name.startswith(("step.", "rng."))}
        sizes = {False: 0, True: 0}
        for group in spec.groups:
            sizes[group.name in on_host] += group.nbytes
        # on CPU whole pages, as a copy's host buffer has: a swap then copies one tensor into the other
        padded = sizes[False] if on_host else -(-sizes[False] // PAGE_BYTES) * PAGE_BYTES
        device = torch.empty(padded, dtype=torch.uint8, device=self.device)
        host = torch.empty(sizes[True], dtype=torch.uint8) if on_host else None
        spans: dict[str, torch.Tensor] = {}
        runs: list[list[Any]] = []  # [slab, start in it, offset in a copy's memory, bytes]
        at = {False: 0, True: 0}
        for group in sorted(spec.groups, key=lambda g: g.offset):
            slab = host if group.name in on_host else device
            assert slab is not None
            start = at[group.name in on_host]
            at[group.name in on_host] += group.nbytes
            spans[group.name] = slab[start : start + group.nbytes].view(group.dtype)
            if runs and runs[-1][0] is slab and runs[-1][2] + runs[-1][3] == group.offset:
                runs[-1][3] += group.nbytes
            else:
                runs.append([slab, start, group.offset, group.nbytes])
        views: dict[str, torch.Tensor] = {}
        for group in spec.groups:
            parts = spans[group.name].split(group.numels)
            views.update(zip(group.names, [part.view(shape) for part, shape in zip(parts, group.shapes)]))
        with torch.no_grad():
            for key, (module, attribute) in homes.items():
                param, view = params[key], views[ADAPTER_PREFIX + key]
                if param.is_meta:
                    params[key] = torch.nn.Parameter(view, requires_grad=param.requires_grad)
                    setattr(module, attribute, params[key])
                else:
                    view.copy_(param)
                    param.data = view
            for group in spec.groups:
                if group.name.startswith(("optim.", "step.")):
                    spans[group.name].zero_()
        # lr and weight decay as a step sets them (``train_step``: its hparams; ``optim_step``: its AdamStep)
        optimizer = torch.optim.AdamW(list(params.values()), lr=0.0, weight_decay=0.0, foreach=True)
        moments: dict[torch.Tensor, dict[str, torch.Tensor]] = {
            param: {name: views[f"{OPTIM_PREFIX}{key}/{name}"] for name in ("step", "exp_avg", "exp_avg_sq")}
            for key, param in params.items()
        }
        optimizer.state.update(moments)
        rng = {name: views[RNG_PREFIX + name] for name in self._rng_shapes}
        copy_runs = [(slab[start : start + n], offset, offset + n) for slab, start, offset, n in runs]
        whole = host is None and len(runs) == 1 and runs[0][1] == 0 and runs[0][2] == 0 and runs[0][3] == spec.nbytes
        slot = Slot(spec, device, host, spans, copy_runs, params, optimizer, moments, rng, whole, padded)
        self._count_slab(slot)
        return slot

    def _state_spec(self, params: dict[str, torch.nn.Parameter]) -> StateSpec:
        """The layout of a job with these parameters: adapter, AdamW moments, step counts, RNG."""
        adapter: dict[torch.dtype, list[tuple[str, tuple[int, ...]]]] = {}
        optim: dict[torch.dtype, list[tuple[str, tuple[int, ...]]]] = {}
        for key, param in params.items():
            shape = tuple(param.shape)
            adapter.setdefault(param.dtype, []).append((ADAPTER_PREFIX + key, shape))
            optim.setdefault(param.dtype, []).extend(
                (f"{OPTIM_PREFIX}{key}/{name}", shape) for name in ("exp_avg", "exp_avg_sq")
            )
        step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # AdamW's
        groups = [(f"adapter.{dtype_name(d)}", d, members) for d, members in adapter.items()]
        groups += [(f"optim.{dtype_name(d)}", d, members) for d, members in optim.items()]
        steps: list[tuple[str, tuple[int, ...]]] = [(f"{OPTIM_PREFIX}{key}/step", ()) for key in params]
        groups.append((f"step.{dtype_name(step_dtype)}", step_dtype, steps))
        groups.append(("rng.uint8", torch.uint8, [(RNG_PREFIX + name, s) for name, s in self._rng_shapes.items()]))
        return state_spec(groups)

    def _count_slab(self, slot: Slot) -> None:
        self.slabs.allocated += 1
        self.slabs.allocated_bytes += slot.device.numel()

    def _adapter_homes(self, adapter_name: str) -> dict[str, Home]:
        """PEFT-file key -> (module, attribute) of each adapter parameter, in module order."""
        assert self._peft is not None
        homes: dict[str, Home] = {}
        for name, _ in self._peft.named_parameters():
            if _belongs_to_adapter(name, adapter_name):
                module_name, attribute = name.rsplit(".", 1)
                homes[_peft_file_key(name, adapter_name)] = (self._peft.get_submodule(module_name), attribute)
        if not homes:
            raise JobConfigError(f"adapter {adapter_name!r} has no parameters (do target_modules match the model?)")
        return homes


# ---------------------------------------------------------------- helpers


def peft_config(lora: LoraSpec, base_model_path: str) -> PeftLoraConfig:
    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=list(lora.target_modules),
        lora_dropout=lora.dropout,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_path,
    )


def _belongs_to_adapter(param_name: str, adapter_name: str) -> bool:
    return f".{adapter_name}." in param_name or param_name.endswith(f".{adapter_name}")


def _peft_file_key(param_name: str, adapter_name: str) -> str:
    """``...q_proj.lora_A.<adapter>.weight`` -> ``...q_proj.lora_A.weight`` (the saved-file key)."""
    if param_name.endswith(f".{adapter_name}"):
        return param_name[: -len(adapter_name) - 1]
    return param_name.replace(f".{adapter_name}.", ".")


@contextlib.contextmanager
def forked_rng(device: torch.device) -> Iterator[None]:
    """Global RNG changes inside the block are undone after it (the CPU's and ``device``'s)."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield


def capture_rng(device: torch.device) -> dict[str, torch.Tensor]:
    """The global RNG states a job keeps its own copy of: the CPU's, and ``device``'s on CUDA."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def store_rng(views: dict[str, torch.Tensor], states: dict[str, torch.Tensor]) -> None:
    """RNG states into the job's views of them."""
    if set(states) != set(views) or any(states[n].shape != views[n].shape for n in views):
        raise StateCopyError(f"RNG state {sorted(states)} does not fit the job's ({sorted(views)})")
    for name, view in views.items():
        view.copy_(states[name])
