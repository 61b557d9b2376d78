"""A job's trainer state as one flat buffer: the layout, the host copy, the buffers it lives in.

A job's trainable state (its adapter's parameters, AdamW's moments and step counts, its RNG
state) is laid out by a ``StateSpec``: groups of tensors of one dtype back to back, widest
dtype first, so that every tensor stays aligned. The trainer's slot for the job on the device
and every copy of it are laid out the same way, so moving the state is one copy of its bytes
(two on CUDA), never one per tensor. ``JobStateCopy`` is such a copy in host memory, as
``TrainerEngine.export_state`` returns it and ``worker.state.store`` keeps it on host or
writes it to nvme; its tensors are views made on first use (``TensorViews``,
``SpecBuffers``). ``BufferPool`` gives the flat buffers copies live in: blocks of a
``HostArena`` (``worker.state.arena``), a few kept for the next copies. ``tensors_to_host`` /
``tensors_to_device`` move a set of tensors (a sleeping base's weights) into one arena block and
back: a non-blocking copy per tensor, one synchronize. ``lora_signature``: the LoRA fields a copy
and the job it is imported into must share.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import torch

from plexctl.common.spec import LoraSpec
from worker.errors import StateCopyError
from worker.state.arena import PAGE_BYTES, HostArena, HostMemoryError, page_round

ADAPTER_PREFIX = "adapter/"  # JobStateCopy tensor names
OPTIM_PREFIX = "optim/"
RNG_PREFIX = "rng/"
POOL_KEEP = 2  # free buffers a BufferPool keeps for the next copies; parked slots that keep theirs on CPU
POOL_ARENA_BYTES = 1 << 30  # the arena of a host pool made without one (mapped as used, never pinned)
PACK_ALIGN = 256  # bytes: where each tensor packed by ``packed_layout`` starts (cudaMalloc's alignment)


@dataclass(frozen=True, eq=False)
class StateGroup:
    """One flat buffer of a job's state: tensors of one dtype back to back, ``offset`` bytes
    into a copy's memory."""

    name: str  # "<kind>.<dtype>": kind adapter, optim (AdamW's moments), step (its step counts) or rng
    dtype: torch.dtype
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    numels: tuple[int, ...]
    offset: int
    nbytes: int


class StateSpec:
    """The layout of one job's state: its groups in storage order (widest dtype first, so that
    back to back every tensor stays aligned), ``nbytes`` in all. ``state_spec`` interns them:
    a copy and a job of one layout share one object, so checking that a copy fits a job costs
    an identity test, not a look at each tensor."""

    def __init__(self, key: tuple[tuple[str, torch.dtype, tuple[tuple[str, tuple[int, ...]], ...]], ...]) -> None:
        self.key = key
        offsets, self.nbytes = _packed_offsets(
            [sum(math.prod(shape) for _, shape in members) * dtype.itemsize for _, dtype, members in key],
            [dtype.itemsize for _, dtype, _ in key],
        )
        self.groups = tuple(
            StateGroup(
                name,
                dtype,
                tuple(n for n, _ in members),
                tuple(s for _, s in members),
                tuple(math.prod(s) for _, s in members),
                offset,
                sum(math.prod(s) for _, s in members) * dtype.itemsize,
            )
            for (name, dtype, members), offset in zip(key, offsets)
        )
        self.layout = {group.name: list(group.names) for group in self.groups}  # read-only
        self.entries = {n: (group.dtype, s) for group in self.groups for n, s in zip(group.names, group.shapes)}
        self.param_keys = [
            n[len(ADAPTER_PREFIX) :] for group in self.groups if group.name.startswith("adapter.") for n in group.names
        ]
        self.param_indices = list(range(len(self.param_keys)))  # a copy's param group "params" (read-only)
        self.rng_bytes = sum(group.nbytes for group in self.groups if group.name.startswith("rng."))
        # (name, dtype, begin, end) of each group in storage order: an nvme copy's buffers (read-only)
        self.file_buffers = [
            (g.name, g.dtype, g.offset, g.offset + g.nbytes) for g in sorted(self.groups, key=lambda g: g.offset)
        ]


_SPECS: dict[tuple, StateSpec] = {}  # interned, oldest first
_SPECS_MAX = 256
_SPECS_LOCK = threading.Lock()


def state_spec(groups: list[tuple[str, torch.dtype, list[tuple[str, tuple[int, ...]]]]]) -> StateSpec:
    """The (interned) spec of a state made of ``groups``: (name, dtype, [(tensor name, shape)])."""
    key = tuple((name, dtype, tuple((n, tuple(s)) for n, s in members)) for name, dtype, members in groups)
    with _SPECS_LOCK:
        spec = _SPECS.get(key)
        if spec is None:
            spec = _SPECS[key] = StateSpec(key)
            if len(_SPECS) > _SPECS_MAX:
                del _SPECS[next(iter(_SPECS))]
        return spec


class TensorViews(Mapping[str, torch.Tensor]):
    """A copy's tensors by name: views into its buffers, made on first use (moving a copy does
    not pay for a view per tensor), then any standalone tensors."""

    __slots__ = ("spec", "buffers", "standalone", "_views")

    def __init__(
        self, spec: StateSpec, buffers: Mapping[str, torch.Tensor], standalone: dict[str, torch.Tensor] | None = None
    ) -> None:
        self.spec = spec
        self.buffers = buffers
        self.standalone = standalone or {}
        self._views: dict[str, torch.Tensor] | None = None

    def _all(self) -> dict[str, torch.Tensor]:
        if self._views is None:
            views: dict[str, torch.Tensor] = {}
            for group in self.spec.groups:
                parts = self.buffers[group.name].split(group.numels)
                views.update(zip(group.names, [p.view(s) for p, s in zip(parts, group.shapes)]))
            self._views = {**views, **self.standalone}
        return self._views

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        for group in self.spec.groups:
            yield from group.names
        yield from self.standalone

    def __len__(self) -> int:
        return len(self.spec.entries) + len(self.standalone)


def host_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 host tensor as a writable memoryview, made without a
    numpy array (with the caches cold that costs a 0.4 MB copy's file write a few percent). The
    view does not keep the tensor alive: the caller holds it while the view is in use."""
    return memoryview((ctypes.c_char * tensor.numel()).from_address(tensor.data_ptr())).cast("B")


class SpecBuffers(Mapping[str, torch.Tensor]):
    """A copy's buffers where ``spec`` lays them out in ``memory`` (an exported copy's): views
    made on first use."""

    __slots__ = ("spec", "memory", "_views", "_image")

    def __init__(self, spec: StateSpec, memory: torch.Tensor) -> None:
        self.spec = spec
        self.memory = memory
        self._views: dict[str, torch.Tensor] | None = None
        self._image: memoryview | None | Literal[False] = False  # not looked at yet

    def file_image(self) -> memoryview | None:
        """``memory`` as a writable byte view when it can go to a file as it is, O_DIRECT
        included (host memory from a page boundary, with room for the state's last page), else
        None; made once (a small state's exports share their buffers: see ``_Slot.views``)."""
        image = self._image
        if image is False:
            memory = self.memory
            image = self._image = (
                host_view(memory)
                if (
                    memory.device.type == "cpu"
                    and not memory.data_ptr() % PAGE_BYTES
                    and memory.numel() >= -(-self.spec.nbytes // PAGE_BYTES) * PAGE_BYTES
                )
                else None
            )
        return image

    def _all(self) -> dict[str, torch.Tensor]:
        if self._views is None:
            self._views = {g.name: self.memory[g.offset : g.offset + g.nbytes].view(g.dtype) for g in self.spec.groups}
        return self._views

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return (g.name for g in self.spec.groups)

    def __len__(self) -> int:
        return len(self.spec.groups)


@dataclass(slots=True)
class JobStateCopy:
    """A detached host copy of one job's trainer state, as ``export_state`` returns it.

    ``tensors`` names every tensor: ``adapter/<peft-file key>``, ``optim/<peft-file key>/<name>``
    (AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``) and ``rng/<device>``, in a fixed order. They
    are views into ``buffers``, flat 1-D tensors (one per kind and dtype, e.g.
    ``adapter.float32``) whose members ``layout`` lists in storage order, so that a copy moves
    in a few large transfers; a tensor not in a buffer stands alone. ``spec``: the layout with
    every tensor's shape (None for a copy built without one). The copy shares no memory with the
    engine. ``memory``: the one flat host buffer that holds all of them, back to back in
    ``segments`` order (whoever gave it may reuse it once the copy is gone); None for a copy
    built over other memory.
    """

    job_id: str
    lora: LoraSpec | None  # None: full fine-tuning (the "adapter" is every weight)
    seed: int
    weight_decay: float  # the AdamW param group's value when exported
    param_keys: list[str]  # the adapter's PEFT-file keys, in the optimizer's parameter order (read-only)
    tensors: Mapping[str, torch.Tensor]
    buffers: Mapping[str, torch.Tensor]
    layout: dict[str, list[str]]  # buffer name -> names of its members, in storage order (read-only lists)
    param_groups: list[dict[str, Any]]  # ``optimizer.state_dict()["param_groups"]``
    state_values: dict[str, Any]  # non-tensor optimizer state values, ``optim/<key>/<name>`` -> value
    memory: torch.Tensor | None = field(default=None, repr=False)
    spec: StateSpec | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes of all its tensors (buffers hold exactly their members' bytes)."""
        if isinstance(self.buffers, SpecBuffers):
            return self.buffers.spec.nbytes + sum(_tensor_bytes(t) for t in self.standalone().values())
        return sum(_tensor_bytes(b) for b in self.buffers.values()) + sum(
            _tensor_bytes(t) for t in self.standalone().values()
        )

    def adapter(self) -> dict[str, torch.Tensor]:
        """The adapter weights under their PEFT-file keys (views into the copy)."""
        return {key: self.tensors[ADAPTER_PREFIX + key] for key in self.param_keys}

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The AdamW ``state_dict()`` the copy was taken from (tensors are views into the copy)."""
        index = {key: i for i, key in enumerate(self.param_keys)}
        state: dict[int, dict[str, Any]] = {}
        for name, value in [*self.tensors.items(), *self.state_values.items()]:
            if name.startswith(OPTIM_PREFIX):
                key, state_name = name[len(OPTIM_PREFIX) :].rsplit("/", 1)
                state.setdefault(index[key], {})[state_name] = value
        return {"state": state, "param_groups": deepcopy(self.param_groups)}

    def __repr__(self) -> str:
        return f"JobStateCopy(job_id={self.job_id!r}, nbytes={self.nbytes}, buffers={list(self.buffers)})"

    def buffer_members(self) -> set[str]:
        """Names of the tensors that live in ``buffers`` (the others stand alone)."""
        return {name for members in self.layout.values() for name in members}

    def standalone(self) -> dict[str, torch.Tensor]:
        """The tensors not in ``buffers``."""
        if isinstance(self.tensors, TensorViews):
            return self.tensors.standalone
        in_buffers = self.buffer_members()
        return {name: t for name, t in self.tensors.items() if name not in in_buffers}

    def entry(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """A tensor's dtype and shape (from ``spec`` when it has them: no view is made)."""
        if self.spec is not None and name in self.spec.entries:
            return self.spec.entries[name]
        tensor = self.tensors[name]
        return tensor.dtype, tuple(tensor.shape)

    def segments(self) -> list[tuple[list[str], torch.Tensor]]:
        """The copy's pieces in storage order: each buffer (with the names of its members), then
        each standalone tensor; widest dtype first, so that back to back every tensor stays
        aligned. An exported copy's ``memory`` holds exactly these bytes from its first byte, as
        does the data section of its file on nvme."""
        segments = [(members, self.buffers[name]) for name, members in self.layout.items()]
        segments += [([name], t) for name, t in self.standalone().items()]
        return sorted(segments, key=lambda segment: -segment[1].element_size())


def lora_signature(lora: LoraSpec | None) -> dict[str, Any]:
    """The LoRA fields that fix the adapter's shape and behaviour, comparable and JSON-able
    (a full fine-tuning job's: ``{"full_finetune": True}``): a copy imports only into a job of
    the same signature."""
    if lora is None:
        return {"full_finetune": True}
    fields = msgspec.to_builtins(lora)
    fields["target_modules"] = sorted(fields["target_modules"])
    return fields


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _packed_offsets(sizes: list[int], widths: list[int]) -> tuple[list[int], int]:
    """Byte offsets that put pieces of ``sizes`` bytes (of elements ``widths`` bytes wide) back
    to back in one flat buffer, in storage order: widest elements first, else in the order
    given (``JobStateCopy.segments``), so every piece starts aligned. Also the buffer's size."""
    offsets, total = [0] * len(sizes), 0
    for i in sorted(range(len(sizes)), key=lambda i: -widths[i]):
        offsets[i] = total
        total += sizes[i]
    return offsets, total


class BufferPool:
    """Reusable flat uint8 buffers on one device, so that a state copy lands in memory that is
    already allocated and mapped (and pinned) instead of faulting in fresh pages on every swap.

    Host buffers are blocks of ``arena`` (a ``HostArena`` of its own, ``POOL_ARENA_BYTES``,
    when none is given): page-aligned (O_DIRECT reads and writes take them), whole pages,
    pinned when the arena is. ``take(n)`` returns a free buffer of at least ``n`` bytes (at
    most ``oversize`` times that, so a small copy does not sit on a big buffer) or a new block;
    ``give`` takes it back once nothing views it any more. It keeps at most ``keep`` free
    buffers (the largest), blocks of the arena too: when the arena cannot serve a take they go
    back to it first, then ``HostMemoryError`` (device buffers come from torch). Thread-safe.

    A buffer of exactly the asked-for pages (a state of the size that last used it: every swap
    of a job after its first) is taken without the lock, with one atomic ``list.pop``: with the
    caches cold, as they are after a training step, the lock alone costs a few microseconds,
    a good part of what a small state's swap adds to its copy.
    """

    def __init__(
        self,
        arena: HostArena | None = None,
        keep: int = POOL_KEEP,
        device: str | torch.device = "cpu",
        oversize: float = 2.0,
    ) -> None:
        self.device = torch.device(device)
        self.arena: HostArena | None = None  # device buffers come from torch
        if self.device.type == "cpu":
            self.arena = arena if arena is not None else HostArena(POOL_ARENA_BYTES)
        self.pinned = self.arena is not None and self.arena.pinned
        self.keep = keep
        self.oversize = oversize
        self._free: dict[int, list[torch.Tensor]] = {}  # bytes -> free buffers of that size
        self._lock = threading.Lock()  # give, and a take that is not of an exact size
        self.allocated = 0  # buffers made (and their bytes), for tests and benchmarks
        self.allocated_bytes = 0
        self._reuses = itertools.count()  # next() is atomic: the lock-free take counts with it
        self._reuse_reads = 0

    @property
    def reused(self) -> int:
        """Takes served by a free buffer."""
        with self._lock:
            value = next(self._reuses) - self._reuse_reads  # reading advances the count by one
            self._reuse_reads += 1
        return value

    def take(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 buffer of at least ``nbytes`` (host: a multiple of PAGE_BYTES, page-aligned);
        ``HostMemoryError`` when the arena has no block for it even with the free ones back."""
        same = self._free.get(nbytes)  # whole pages already, as a job slot's own size is
        if same:
            size = nbytes
        else:
            size = page_round(nbytes)
            same = self._free.get(size)
        if same:
            try:
                buffer = same.pop()
            except IndexError:  # another thread took the last one
                pass
            else:
                next(self._reuses)
                return buffer
        with self._lock:
            for free in sorted(self._free):  # the smallest that fits
                if size <= free <= self.oversize * size and self._free[free]:
                    next(self._reuses)
                    return self._free[free].pop()
            if self.arena is None:
                buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            else:
                try:
                    buffer = self.arena.allocate(size)
                except HostMemoryError:  # the free buffers first
                    self._release_free()
                    buffer = self.arena.allocate(size)
            self.allocated += 1
            self.allocated_bytes += size
            return buffer

    def give(self, buffer: torch.Tensor) -> None:
        """Take back a buffer that ``take`` gave (ValueError for a host buffer that is not a
        block of the arena in use); kept, or back to the arena."""
        with self._lock:
            if any(b is buffer for buffers in self._free.values() for b in buffers):
                return
            if self.arena is not None and not self.arena.owns(buffer):
                raise ValueError("not a buffer of this pool's host arena (given back twice?)")
            self._free.setdefault(buffer.numel(), []).append(buffer)
            count = sum(len(buffers) for buffers in self._free.values())
            for free in sorted(self._free):  # the smallest go first
                buffers = self._free[free]
                while count > self.keep and buffers:
                    try:
                        self._drop(buffers.pop(0))
                        count -= 1
                    except IndexError:  # a lock-free take emptied it
                        break
            for free in [free for free, buffers in self._free.items() if not buffers]:
                del self._free[free]

    def release_free(self) -> None:
        """Give every free buffer kept back to the arena."""
        with self._lock:
            self._release_free()

    def free_bytes(self) -> int:
        with self._lock:
            return sum(free * len(buffers) for free, buffers in self._free.items())

    def _release_free(self) -> None:
        for buffers in self._free.values():
            while buffers:
                try:
                    self._drop(buffers.pop())
                except IndexError:  # a lock-free take emptied it
                    break
        self._free.clear()

    def _drop(self, buffer: torch.Tensor) -> None:
        if self.arena is not None:
            self.arena.free(buffer)


def packed_layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offsets that put ``tensors`` back to back in one buffer, each starting on a
    ``PACK_ALIGN`` boundary, in the order given; also the buffer's size."""
    offsets, total = [], 0
    for t in tensors:
        total = -(-total // PACK_ALIGN) * PACK_ALIGN
        offsets.append(total)
        total += _tensor_bytes(t)
    return offsets, total


def tensors_to_host(tensors: Sequence[torch.Tensor], arena: HostArena) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Copies of ``tensors`` in one block of ``arena`` (``packed_layout``): the block and a view
    of it per tensor, of its shape and dtype. From a CUDA device each copy is non-blocking into
    the (pinned) block, and one synchronize ends them all. ``HostMemoryError`` when the arena
    has no block for them; nothing else is allocated on the host."""
    offsets, total = packed_layout(tensors)
    block = arena.allocate(total)
    views = [
        block[offset : offset + _tensor_bytes(t)].view(t.dtype).view(t.shape) for t, offset in zip(tensors, offsets)
    ]
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    for view, t in zip(views, tensors):
        view.copy_(t, non_blocking=bool(devices))
    for device in devices:
        torch.cuda.synchronize(device)
    return block, views


def tensors_to_device(views: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """New tensors on ``device`` with the bits of ``views`` (``tensors_to_host``'s): a
    non-blocking copy each from pinned memory, one synchronize. The views' block may go back
    to its arena once the caller drops them."""
    cuda = device.type == "cuda"
    out = [torch.empty(v.shape, dtype=v.dtype, device=device) for v in views]
    for dst, src in zip(out, views):
        dst.copy_(src, non_blocking=cuda)
    if cuda:
        torch.cuda.synchronize(device)
    return out


def aligned_host_buffer(nbytes: int, pinned: bool = False) -> torch.Tensor:
    """Uninitialised uint8 host memory whose first byte is PAGE_BYTES-aligned."""
    raw = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8, pin_memory=pinned)
    skip = -raw.data_ptr() % PAGE_BYTES
    return raw[skip : skip + nbytes]


def check_copy_fits(copy: JobStateCopy, spec: StateSpec) -> None:
    """A copy of the job's layout (the same spec: an identity test for an exported or read copy;
    else its buffers, members and shapes compared one by one), with one AdamW param group."""
    if copy.spec is not spec and (copy.spec is None or copy.spec.key != spec.key):
        _check_copy_layout(copy)
        if spec_of(copy).key != spec.key:
            raise StateCopyError(f"state copy of job {copy.job_id!r} does not fit the job's adapter (shapes, layout)")
    standalone = copy.tensors.standalone if type(copy.tensors) is TensorViews else copy.standalone()
    if standalone:
        raise StateCopyError(f"state copy of job {copy.job_id!r}: {sorted(standalone)} are not the job's")
    laid_out = isinstance(copy.buffers, SpecBuffers) and copy.buffers.spec is spec  # fits by construction
    for group in () if laid_out else spec.groups:
        buffer = copy.buffers.get(group.name)
        if buffer is None or buffer.dtype != group.dtype or buffer.numel() * group.dtype.itemsize != group.nbytes:
            raise StateCopyError(f"state copy of job {copy.job_id!r}: buffer {group.name!r} does not fit")
    if copy.param_keys is not spec.param_keys and copy.param_keys != spec.param_keys:
        raise StateCopyError(f"state copy of job {copy.job_id!r}: adapter keys do not match the job's adapter")
    if (
        copy.state_values
        or len(copy.param_groups) != 1
        or list(copy.param_groups[0].get("params", ())) != list(range(len(spec.param_keys)))
    ):
        raise StateCopyError(f"state copy of job {copy.job_id!r}: optimizer state does not fit")


def spec_of(copy: JobStateCopy) -> StateSpec:
    """The copy's spec: its own when it lays out the copy's buffers (an exported or read copy's),
    else one made from its buffers' members' shapes."""
    spec = copy.spec
    if spec is not None and list(spec.layout.items()) == list(copy.layout.items()):
        return spec
    return state_spec(
        [
            (name, copy.buffers[name].dtype, [(n, copy.entry(n)[1]) for n in members])
            for name, members in copy.layout.items()
        ]
    )


def _check_copy_layout(state: JobStateCopy) -> None:
    """Buffers hold exactly their members, in order: a copy read back from disk must too."""
    for buffer_name, members in state.layout.items():
        buffer = state.buffers.get(buffer_name)
        if buffer is None or buffer.dim() != 1:
            raise StateCopyError(f"state copy of job {state.job_id!r}: buffer {buffer_name!r} is missing")
        size = 0
        for name in members:
            tensor = state.tensors.get(name)
            if tensor is None or tensor.dtype != buffer.dtype:
                raise StateCopyError(
                    f"state copy of job {state.job_id!r}: {name!r} does not fit buffer {buffer_name!r}"
                )
            size += tensor.numel()
        if size != buffer.numel():
            raise StateCopyError(
                f"state copy of job {state.job_id!r}: buffer {buffer_name!r} has {buffer.numel()} elements, "
                f"its members {size}"
            )
