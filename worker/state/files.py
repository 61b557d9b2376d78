"""An nvme copy of a job's trainer state: its file written, and read back verified.

``write_copy`` writes a ``JobStateCopy``'s data section (its tensors back to back, page-aligned,
padded with zeros to a whole page) as one file and returns an ``NvmeCopy``: the file's path and
everything else about the copy (LoRA config, seed, optimizer hyper-parameters, layout, an xxh3-64
checksum per 8 MiB chunk), which the state store keeps in memory; ``read_copy`` reads it back
into a pool buffer, verified, or raises a one-line ``CorruptCopyError``.

Invariants: a host copy is one flat page-aligned pool buffer laid out exactly as its file, so a
swap neither allocates nor faults in fresh pages; files are written and read with O_DIRECT where
the filesystem takes it, else buffered (reads too, ``READ_DIRECT``: no page-cache copy is kept of
a file that is not read again), up to ``IO_DEPTH`` chunk requests in flight on the copy-I/O
threads, each chunk checksummed as it lands, in whatever order; a copy costs one ``fdatasync``, of
its file, so a demoted copy really left host memory (the directory is not synced: the copy is
scratch).

It does not decide which copies go to nvme (``worker.state.store`` does), nor name their files or
keep those to reuse (``worker.state.dirs`` does). How it moves fast, with the measurements:
docs/state.md, "How a copy moves fast".
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import os
import queue
import threading
import uuid
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import xxhash

from plexctl.common.spec import LoraSpec
from worker.checkpoint_files import NO_SPACE_ERRNOS
from worker.errors import CorruptCopyError
from worker.state.job_copy import (
    PAGE_BYTES,
    BufferPool,
    JobStateCopy,
    SpecBuffers,
    StateSpec,
    TensorViews,
    aligned_host_buffer,
    host_view,
    spec_of,
)

IO_CHUNK_BYTES = 8 << 20  # one file request, and one checksummed chunk of a copy's data section
IO_DEPTH = 8  # requests in flight (the copy-I/O threads); a write's checksum holds its slot
WRITE_BOUNCES = 4  # page-aligned chunk buffers a copy over other memory is written through (<= 4 in flight)
DIRECT_ALIGN = PAGE_BYTES  # O_DIRECT offsets, lengths and buffer addresses are multiples of this
READ_DIRECT = True  # reads: O_DIRECT where the filesystem takes it (see the module docstring), else buffered


_ZERO_PAGE = bytes(DIRECT_ALIGN)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


_io_pool: ThreadPoolExecutor | None = None
_bounces: queue.Queue[torch.Tensor] | None = None
_direct_ok: dict[int, bool] = {}  # st_dev -> O_DIRECT works there
_direct_dirs: dict[str, bool] = {}  # directory -> the same, without a stat per copy
_io_lock = threading.Lock()


def _io_threads() -> ThreadPoolExecutor:
    """The process's copy-I/O threads (shared by all stores), started on first use."""
    global _io_pool
    with _io_lock:
        if _io_pool is None:
            _io_pool = ThreadPoolExecutor(max_workers=IO_DEPTH, thread_name_prefix="plexrl-copy-io")
        return _io_pool


_sum_pool: ThreadPoolExecutor | None = None


SUM_ASIDE_MIN_BYTES = 1 << 20  # smaller spans are summed where they are, not on the checksum thread


def _checksum(data: Any) -> int:
    """The chunk checksum of a copy's file: xxh3-64 of ``data`` (a buffer)."""
    return xxhash.xxh3_64_intdigest(data)


def _sum_thread() -> ThreadPoolExecutor:
    """One thread that checksums what a sequential reader has read (one, so the reader keeps a core)."""
    global _sum_pool
    with _io_lock:
        if _sum_pool is None:
            _sum_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plexrl-checksum")
        return _sum_pool


def _bounce_buffers() -> queue.Queue[torch.Tensor]:
    """WRITE_BOUNCES page-aligned chunk buffers that writes stream through (O_DIRECT needs
    aligned memory; a copy's own buffers are not), reused by every write in the process."""
    global _bounces
    with _io_lock:
        if _bounces is None:
            _bounces = queue.Queue()
            for _ in range(WRITE_BOUNCES):
                _bounces.put(aligned_host_buffer(IO_CHUNK_BYTES))
        return _bounces


def _direct_io_works(directory: Path | str) -> bool:
    """Whether O_DIRECT reads and writes work on ``directory``'s filesystem (probed once per
    filesystem: tmpfs refuses the flag, some filesystems accept it but fail the I/O)."""
    key = str(directory)
    known = _direct_dirs.get(key)
    if known is not None:
        return known
    directory = Path(directory)
    device = os.stat(directory).st_dev
    if device in _direct_ok:
        _direct_dirs[key] = _direct_ok[device]
        return _direct_ok[device]
    probe = directory / f".direct-probe-{uuid.uuid4().hex[:8]}"
    block = aligned_host_buffer(DIRECT_ALIGN).fill_(0)
    works = hasattr(os, "O_DIRECT")
    try:
        if works:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
            try:
                view = memoryview(block.numpy())  # type: ignore[arg-type]  # numpy types __buffer__ for 3.12+ only
                works = os.pwrite(fd, view, 0) == DIRECT_ALIGN and os.preadv(fd, [view], 0) == DIRECT_ALIGN
            finally:
                os.close(fd)
    except OSError as exc:
        if exc.errno in NO_SPACE_ERRNOS:  # a full disk says nothing about O_DIRECT: ask again next time
            raise
        works = False
    finally:
        probe.unlink(missing_ok=True)
    _direct_ok[device] = _direct_dirs[key] = works
    return works


def _open_copy_file(path: Path, write: bool, create: bool = True) -> tuple[int, bool]:
    """An fd for a copy's file and whether it is O_DIRECT: to read, or to write a new file
    (``create``: ``O_EXCL``) or an existing one."""
    flags = os.O_WRONLY | (os.O_CREAT | os.O_EXCL if create else 0) if write else os.O_RDONLY
    # its directory, as the path up to its last "/" (os.path.dirname costs a small copy's write a few percent)
    text = os.fspath(path)
    direct = _direct_io_works(text[: text.rfind("/") + 1] or ".")
    if direct:
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            flags &= ~os.O_EXCL  # the refused open may have made it
    return os.open(path, flags, 0o644), False


def _finish(futures: list[Future[Any]]) -> list[Any]:
    """Every request's result in order, after all have ended (so none still uses the fd)."""
    wait_all(futures)
    return [future.result() for future in futures]


@dataclass(eq=False)
class NvmeCopy:
    """One copy on nvme: its file, which holds only the data section, and everything else about
    the copy, kept here in memory (see the module docstring)."""

    path: Path
    nbytes: int  # of the data section; the file is this rounded up to whole pages (``file_bytes``)
    chunk_bytes: int  # the checksummed chunks' size when it was written
    sums: list[int]  # checksum of each chunk of the data section
    job_id: str
    lora: LoraSpec | None  # None: full fine-tuning
    seed: int
    weight_decay: float
    param_keys: list[str]
    layout: dict[str, list[str]]
    param_groups: list[dict[str, Any]]
    state_values: dict[str, Any]
    spec: StateSpec
    buffers: list[tuple[str, torch.dtype, int, int]]  # buffer name, dtype, [begin, end) in the data section
    standalone: list[tuple[str, torch.dtype, tuple[int, ...], int, int]]  # name, dtype, shape, [begin, end)
    laid_out: bool  # the buffers lie where ``spec`` puts them: the copy read back gets SpecBuffers
    direct: bool = False  # written with O_DIRECT: its filesystem takes it, so it is read so too

    @property
    def file_bytes(self) -> int:
        return round_up(self.nbytes, DIRECT_ALIGN)


def unlink_all(paths: list[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def write_copy(path: Path, state: JobStateCopy, reuse: int | None = None) -> NvmeCopy:
    """Write the copy's data section (its segments back to back, in ``JobStateCopy.segments``
    order, then zeros up to a whole page) as the file ``path``, and fdatasync it: a new file
    (``O_EXCL``: it fails rather than reuse anything), or with ``reuse`` (its size) an existing
    file, overwritten in place and cut to size. Returns the copy's description, its checksums
    computed as it was written. On failure the file is left as it is: the caller deletes it."""
    spec, held = state.spec, state.buffers
    if (
        type(held) is SpecBuffers
        and held.memory is state.memory
        and held.spec is spec
        and state.layout is spec.layout
        and type(state.tensors) is TensorViews
        and not state.tensors.standalone
    ):
        section = held.file_image()
        if section is not None:  # an exported or read copy: its memory is the data section, its spec says where
            sums, direct = _write_stream(path, [], section, spec.nbytes, IO_CHUNK_BYTES, reuse)
            # by position (with the caches cold, keywords cost more than the checks above), in the
            # field order: path, nbytes, chunk_bytes, sums, job_id, lora, seed, weight_decay,
            # param_keys, layout, param_groups, state_values, spec, buffers, standalone, laid_out, direct
            return NvmeCopy(
                path,
                spec.nbytes,
                IO_CHUNK_BYTES,
                sums,
                state.job_id,
                state.lora,
                state.seed,
                state.weight_decay,
                spec.param_keys if state.param_keys is spec.param_keys else list(state.param_keys),
                spec.layout,
                list(map(dict, state.param_groups)),
                dict(state.state_values),
                spec,
                spec.file_buffers,
                [],
                True,
                direct,
            )
    pieces: list[tuple[str, bool, torch.Tensor]] = [(name, True, state.buffers[name]) for name in state.layout]
    pieces += [(name, False, tensor) for name, tensor in state.standalone().items()]
    pieces.sort(key=lambda piece: -piece[2].element_size())  # stable: JobStateCopy.segments' order
    spec = spec_of(state)
    buffers: list[tuple[str, torch.dtype, int, int]] = []
    standalone: list[tuple[str, torch.dtype, tuple[int, ...], int, int]] = []
    offset = 0
    for name, in_buffers, tensor in pieces:
        size = tensor.numel() * tensor.element_size()
        if in_buffers:
            buffers.append((name, tensor.dtype, offset, offset + size))
        else:
            standalone.append((name, tensor.dtype, tuple(tensor.shape), offset, offset + size))
        offset += size
    groups = {group.name: group for group in spec.groups}
    laid_out = len(buffers) == len(groups) and all(
        name in groups and groups[name].offset == begin and groups[name].nbytes == end - begin
        for name, _, begin, end in buffers
    )
    chunk_bytes = IO_CHUNK_BYTES
    image = _file_image(state, [(name, t) for name, _, t in pieces], offset)
    sums, direct = _write_stream(
        path, [t for _, _, t in pieces], host_view(image) if image is not None else None, offset, chunk_bytes, reuse
    )
    return NvmeCopy(
        path=path,
        nbytes=offset,
        chunk_bytes=chunk_bytes,
        sums=sums,
        job_id=state.job_id,
        lora=state.lora,
        seed=state.seed,
        weight_decay=state.weight_decay,
        param_keys=list(state.param_keys),
        layout={name: list(members) for name, members in state.layout.items()},
        param_groups=[dict(group) for group in state.param_groups],
        state_values=dict(state.state_values),
        spec=spec,
        buffers=buffers,
        standalone=standalone,
        laid_out=laid_out,
        direct=direct,
    )


def _byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view, without a copy (it is contiguous host memory)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _file_image(state: JobStateCopy, segments: list[tuple[Any, torch.Tensor]], nbytes: int) -> torch.Tensor | None:
    """The copy's memory when it holds the data section as it is (its segments back to back
    from its first byte, page-aligned, with room for the padding to a whole page), else None."""
    memory = state.memory
    if memory is None or memory.data_ptr() % DIRECT_ALIGN or memory.numel() < round_up(nbytes, DIRECT_ALIGN):
        return None
    at = memory.data_ptr()
    for _, segment in segments:
        if segment.data_ptr() != at:
            return None
        at += segment.numel() * segment.element_size()
    return memory


def _write_stream(
    path: Path,
    tensors: list[torch.Tensor],
    image_view: memoryview | None,
    total: int,
    chunk_bytes: int,
    reuse: int | None,
) -> tuple[list[int], bool]:
    """Write the concatenation of ``tensors`` (contiguous host tensors, ``total`` bytes), padded
    with zeros to a whole page, as the file ``path`` (new, or existing with ``reuse`` bytes), fdatasync it (and
    drop it from the page cache when written buffered, so it does not stay in host memory).
    The data goes in ``chunk_bytes`` requests straight from ``image_view`` (the pieces' own
    memory, see ``_file_image``) with IO_DEPTH in flight, or gathered into WRITE_BOUNCES bounce buffers
    in flight; the last one on this thread. Returns the checksum of each chunk of the data and
    whether the file was written with O_DIRECT."""
    pieces = [_byte_view(t) for t in tensors] if image_view is None else []  # flat uint8 views, to gather
    ends = [0]
    for piece in pieces:
        ends.append(ends[-1] + piece.numel())
    file_bytes = round_up(total, DIRECT_ALIGN)
    fd, direct = _open_copy_file(path, write=True, create=reuse is None)
    size = reuse or 0
    futures: list[Future[int]] = []
    try:
        if direct and size < file_bytes:
            os.ftruncate(fd, file_bytes)  # requests within the size run in parallel
            size = file_bytes
        if image_view is not None:
            image_view[total:file_bytes] = _ZERO_PAGE[: file_bytes - total]  # the last request's padding
        if image_view is not None and total < min(chunk_bytes, SUM_ASIDE_MIN_BYTES):  # a small state: one
            # request here, summed first (a larger chunk's sum runs on the checksum thread while it is written)
            sums = [_checksum(image_view[:total])]
            _pwrite_all(fd, [image_view[:file_bytes]], 0)
        else:
            starts = _chunk_starts(total, chunk_bytes)
            last: list[int] = []
            for start in starts:
                end = min(start + chunk_bytes, total)
                if image_view is not None:
                    write = partial(_write_span, fd, image_view[start:])
                else:  # a bounce buffer is freed by a request in flight: at most WRITE_BOUNCES at once
                    write = partial(
                        _write_chunk, fd, _bounce_buffers().get(), _pieces_between(pieces, ends, start, end)
                    )
                if start == starts[-1]:  # the last on this thread (a one-chunk copy needs no I/O thread)
                    last.append(write(start, end - start, sum_aside=True))
                else:
                    futures.append(_io_threads().submit(write, start, end - start))
            sums = _finish(futures) + last
        if size > file_bytes:  # a larger file overwritten
            os.ftruncate(fd, file_bytes)
        os.fdatasync(fd)
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        wait_all(futures)
        os.close(fd)
    return sums, direct


def _chunk_starts(nbytes: int, chunk_bytes: int) -> range:
    """Where the checksummed chunks of a data section of ``nbytes`` start (one, empty, if none)."""
    return range(0, max(nbytes, 1), chunk_bytes)


def _pieces_between(pieces: list[torch.Tensor], ends: list[int], start: int, end: int) -> list[torch.Tensor]:
    """Slices of ``pieces`` that make up bytes [start, end) of their concatenation."""
    parts = []
    index = bisect.bisect_right(ends, start) - 1
    while start < end:
        piece, piece_start = pieces[index], ends[index]
        take = min(end, ends[index + 1]) - start
        if take > 0:
            parts.append(piece[start - piece_start : start - piece_start + take])
            start += take
        index += 1
    return parts


def _write_chunk(
    fd: int, bounce: torch.Tensor, parts: list[torch.Tensor], offset: int, nbytes: int, sum_aside: bool = False
) -> int:
    """Gather ``parts`` into the bounce buffer (zeros after them up to a whole page), then
    ``_write_span`` it at ``offset``."""
    try:
        at = 0
        for part in parts:
            bounce[at : at + part.numel()].copy_(part)
            at += part.numel()
        bounce[at : round_up(at, DIRECT_ALIGN)].zero_()
        return _write_span(fd, memoryview(bounce.numpy()), offset, nbytes, sum_aside)  # type: ignore[arg-type]
    finally:
        _bounce_buffers().put(bounce)


def _write_span(fd: int, view: memoryview, offset: int, nbytes: int, sum_aside: bool = False) -> int:
    """Write the first ``nbytes`` of ``view`` at ``offset``, padded to whole pages (``view`` has
    the room: a file is whole pages, as O_DIRECT writes them); return their checksum.
    ``sum_aside``: the checksum runs on the checksum thread while this one writes (or here after
    all, if that thread has not started it by then)."""
    data = view[:nbytes]
    pending = _sum_thread().submit(_checksum, data) if sum_aside and nbytes >= SUM_ASIDE_MIN_BYTES else None
    try:
        digest = _checksum(data) if pending is None else 0
        _pwrite_all(fd, [view[: round_up(nbytes, DIRECT_ALIGN)]], offset)
        if pending is None:
            return digest
        return _checksum(data) if pending.cancel() else pending.result()
    finally:
        if pending is not None:
            wait_all([pending])  # it reads ``view``


def _pwrite_all(fd: int, buffers: list[memoryview], offset: int) -> None:
    """Write ``buffers`` back to back at ``offset`` (one request when the kernel takes it whole)."""
    while buffers:
        written = os.pwritev(fd, buffers, offset)
        offset += written
        while buffers and written >= len(buffers[0]):
            written -= len(buffers[0])
            buffers = buffers[1:]
        if buffers and written:
            buffers = [buffers[0][written:], *buffers[1:]]


def read_copy(copy: NvmeCopy, pool: BufferPool) -> tuple[JobStateCopy, torch.Tensor]:
    """The copy, verified, and the pool buffer that holds it (its data section, which becomes
    the copy's memory); every failure is a one-line CorruptCopyError (and the buffer goes back
    to the pool). Read with O_DIRECT where the filesystem takes it (READ_DIRECT): one request
    per chunk, the first by this thread while the others are in flight on the copy-I/O threads
    (IO_DEPTH at once); each chunk's checksum goes to the checksum thread as that chunk lands,
    in whatever order they land (a slow request holds up no other), and the last to land is
    summed here. The copy's tensors are laid over the buffer first; it is returned once every
    chunk's checksum matched."""
    try:
        if READ_DIRECT and copy.direct:  # its filesystem took O_DIRECT when it was written
            fd, direct = os.open(copy.path, os.O_RDONLY | os.O_DIRECT), True
        else:
            fd, direct = (
                _open_copy_file(copy.path, write=False) if READ_DIRECT else (os.open(copy.path, os.O_RDONLY), False)
            )
    except OSError as exc:
        raise CorruptCopyError(f"{_where(copy)}: cannot read it ({exc.strerror or exc})") from None
    buffer = checksums = None
    reads: dict[Future[None], int] = {}  # request in flight -> its chunk
    try:
        size = os.lseek(fd, 0, os.SEEK_END)  # (fstat's result costs a small copy's read a few percent)
        nbytes, chunk = copy.nbytes, copy.chunk_bytes
        if size != -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN:
            raise CorruptCopyError(
                f"{_where(copy)}: the file has {size} bytes, {copy.file_bytes} were written (truncated?)"
            )
        buffer = pool.take(nbytes)
        view = host_view(buffer)
        spans = (
            [(start, min(start + chunk, nbytes)) for start in _chunk_starts(nbytes, chunk)]
            if nbytes > chunk
            else [(0, nbytes)]
        )
        checksums = _Checksums(view, spans) if len(spans) > 1 else None
        try:
            state = _copy_over(buffer, copy)
        except Exception as exc:  # noqa: BLE001 - the writer's or the format's fault
            raise CorruptCopyError(
                f"{_where(copy)}: unreadable ({type(exc).__name__}: {exc})".replace("\n", " ")
            ) from None
        for index, (start, end) in enumerate(spans[1:], 1):
            request = round_up(end - start, DIRECT_ALIGN) if direct else end - start
            reads[_io_threads().submit(_read_into, fd, [view[start : start + request]], start, end - start)] = index
        first = spans[0][1]
        _read_into(fd, [view[: round_up(first, DIRECT_ALIGN) if direct else first]], 0, first)
        if checksums is None:  # one chunk
            sums = [_checksum(view[:first])]
        else:
            checksums.add_aside(0)
            for count, future in enumerate(as_completed(reads), 1):
                future.result()  # a failed request raises
                (checksums.add_here if count == len(reads) else checksums.add_aside)(reads[future])
            sums = checksums.result()
        if sums != copy.sums:
            raise CorruptCopyError(f"{_where(copy)}: does not match its checksums (corrupt)")
    except BaseException as exc:
        wait_all(list(reads))
        if checksums is not None:
            checksums.wait()  # no thread uses the buffer once it is back in the pool
        if buffer is not None:
            pool.give(buffer)
        if isinstance(exc, OSError):
            raise CorruptCopyError(f"{_where(copy)}: cannot read it ({exc.strerror or exc})") from None
        raise
    finally:
        os.close(fd)
    return state, buffer


def _where(copy: NvmeCopy) -> str:
    return f"nvme copy of job {copy.job_id!r} at {copy.path}"


class _Checksums:
    """The checksum of each chunk (``spans``, in order) of a buffer: computed on the checksum thread
    (``add_aside``) or here (``add_here``), when ``result`` is asked for."""

    def __init__(self, view: memoryview, spans: list[tuple[int, int]]) -> None:
        self.view = view
        self.spans = spans
        self._jobs: dict[int, Future[int] | None] = {}  # chunk -> pending on the checksum thread (None: here), as added

    def add_aside(self, index: int) -> None:
        start, end = self.spans[index]
        if end - start < SUM_ASIDE_MIN_BYTES:
            self.add_here(index)
            return
        self._jobs[index] = _sum_thread().submit(_checksum, self.view[start:end])

    def add_here(self, index: int) -> None:
        self._jobs[index] = None

    def wait(self) -> None:
        wait_all([future for future in self._jobs.values() if future is not None])

    def result(self) -> list[int]:
        """Every chunk's checksum, in chunk order. Those the checksum thread has not started yet are
        computed here, the last added first (it works from the first, so the two meet in between)."""
        sums: dict[int, int] = {}
        for index, future in reversed(self._jobs.items()):
            if future is None or future.cancel():
                start, end = self.spans[index]
                sums[index] = _checksum(self.view[start:end])
        for index, future in self._jobs.items():
            if index not in sums:
                assert future is not None
                sums[index] = future.result()
        return [sums[index] for index in range(len(self.spans))]


def _read_into(fd: int, buffers: list[memoryview], offset: int, nbytes: int) -> None:
    """Fill ``buffers`` back to back from the file at ``offset`` until ``nbytes`` came (they may
    hold more: O_DIRECT asks for whole pages)."""
    done = 0
    while done < nbytes:
        count = os.preadv(fd, buffers, offset + done)
        if not count:
            raise OSError(errno.EIO, "the file ended early")
        done += count
        while buffers and count >= len(buffers[0]):
            count -= len(buffers[0])
            buffers = buffers[1:]
        if count:
            buffers = [buffers[0][count:], *buffers[1:]]


def _copy_over(data: torch.Tensor, copy: NvmeCopy) -> JobStateCopy:
    """A JobStateCopy over ``data``, a buffer for the copy's data section (read now or later),
    laid out as it was written: its memory, its buffers over it (SpecBuffers when they lie where
    the spec puts them: imported with one copy_), its spec (its tensors are views made on first
    use). Its lists and dicts are its own (but for a laid-out copy's layout, and its param keys
    where they were its spec's: read-only, as an exported copy's are); the values in them are
    the written copy's."""
    buffers: Mapping[str, torch.Tensor]
    spec = copy.spec
    if copy.laid_out:
        buffers, layout = SpecBuffers(spec, data), spec.layout
    else:
        buffers = {name: data[begin:end].view(dtype) for name, dtype, begin, end in copy.buffers}
        layout = {name: list(members) for name, members in copy.layout.items()}
    standalone = (
        {name: data[begin:end].view(dtype).view(shape) for name, dtype, shape, begin, end in copy.standalone}
        if copy.standalone
        else None
    )
    # by position, in the field order (job_id, lora, seed, weight_decay, param_keys, tensors, buffers,
    # layout, param_groups, state_values, memory, spec): with the caches cold, keywords cost a small
    # copy's read a few percent
    return JobStateCopy(
        copy.job_id,
        copy.lora,
        copy.seed,
        copy.weight_decay,
        spec.param_keys if copy.param_keys is spec.param_keys else list(copy.param_keys),
        TensorViews(spec, buffers, standalone),
        buffers,
        layout,
        list(map(dict, copy.param_groups)),
        dict(copy.state_values),
        data,
        spec,
    )
