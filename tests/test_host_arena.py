"""Tests of the host arena (worker/state/arena.py), the buffer pool over it, and the state store's
host memory.

They assert what a user sizing a worker's memory relies on: the arena's accounting is exact
(in use + free = capacity, blocks of exactly their pages, page-aligned, never overlapping,
freed neighbours merged); a request no free block takes fails with a typed one-line error and
takes nothing; a big arena costs nothing up front on CPU; and a state store holds its host
copies inside an arena of exactly ``host_bytes`` plus its documented allowances, however many
jobs of different sizes swap through it, demoting host copies to nvme when the arena is short.
"""

from __future__ import annotations

import random
import resource
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plexctl.common.protocol import LoraSpec
from tests.test_state_store import HP_SEQ, assert_like_alone, config_json, engine, job_state, tiny_qwen2
from tests.test_trainer import make_batch
from worker.errors import TierFullError
from worker.state.arena import PAGE_BYTES, ArenaStats, HostArena, HostMemoryError, page_round
from worker.state.job_copy import PACK_ALIGN, BufferPool, packed_layout, tensors_to_device, tensors_to_host
from worker.state.store import TRANSIT_MIN_BYTES, StateStore
from worker.trainer import TrainerEngine

MIB = 1 << 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


def free_runs(used: list[bool]) -> list[int]:
    """Lengths (in pages) of the runs of free pages."""
    runs, run = [], 0
    for page_used in [*used, True]:
        if page_used:
            if run:
                runs.append(run)
            run = 0
        else:
            run += 1
    return runs


def check_arena(arena: HostArena, blocks: list[tuple[torch.Tensor, int]]) -> list[bool]:
    """The arena's accounting against the blocks in use ((tensor, bytes asked)); returns the pages used."""
    pages = arena.capacity // PAGE_BYTES
    used = [False] * pages
    for tensor, asked in blocks:
        assert tensor.dtype == torch.uint8 and tensor.dim() == 1
        assert tensor.numel() == page_round(asked)  # exactly its pages
        offset = tensor.data_ptr() - arena.address
        assert offset % PAGE_BYTES == 0 and 0 <= offset and offset + tensor.numel() <= arena.capacity
        for page in range(offset // PAGE_BYTES, (offset + tensor.numel()) // PAGE_BYTES):
            assert not used[page], "two blocks overlap"
            used[page] = True
    stats = arena.stats()
    assert stats.capacity == arena.capacity
    assert stats.in_use + stats.free == stats.capacity
    assert stats.in_use == sum(t.numel() for t, _ in blocks) and stats.blocks == len(blocks)
    assert stats.largest_free == max(free_runs(used), default=0) * PAGE_BYTES  # free neighbours are one extent
    return used


# ---------------------------------------------------------------- the arena


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12 * PAGE_BYTES), st.integers(0, 1000)), max_size=60))
def test_accounting_is_exact_through_any_sequence_of_takes_and_gives(ops: list[tuple[bool, int, int]]) -> None:
    arena = HostArena(32 * PAGE_BYTES)
    blocks: list[tuple[torch.Tensor, int]] = []
    used = check_arena(arena, blocks)
    for take, nbytes, pick in ops:
        if take or not blocks:
            fits = max(free_runs(used), default=0) * PAGE_BYTES >= page_round(nbytes)
            try:
                blocks.append((arena.allocate(nbytes), nbytes))
                assert fits
            except HostMemoryError as error:
                assert not fits and error.nbytes == page_round(nbytes)
        else:
            tensor, _ = blocks.pop(pick % len(blocks))
            arena.free(tensor)
        used = check_arena(arena, blocks)
    for tensor, _ in blocks:
        arena.free(tensor)
    assert arena.stats().largest_free == arena.capacity == 32 * PAGE_BYTES


def test_freed_neighbours_merge_into_one_block() -> None:
    arena = HostArena(10 * PAGE_BYTES)
    a, b, c = arena.allocate(3 * PAGE_BYTES), arena.allocate(4 * PAGE_BYTES), arena.allocate(3 * PAGE_BYTES - 5)
    assert arena.stats().free == 0
    arena.free(a)
    arena.free(c)
    assert (arena.stats().free, arena.stats().largest_free) == (6 * PAGE_BYTES, 3 * PAGE_BYTES)
    with pytest.raises(HostMemoryError):  # six pages free, but not in one piece
        arena.allocate(4 * PAGE_BYTES)
    arena.free(b)
    assert arena.stats() == ArenaStats(10 * PAGE_BYTES, 0, 10 * PAGE_BYTES, 10 * PAGE_BYTES, 0)
    assert arena.allocate(10 * PAGE_BYTES).data_ptr() == arena.address


def test_a_request_larger_than_the_largest_free_block_fails_clearly_and_takes_nothing() -> None:
    arena = HostArena(8 * PAGE_BYTES)
    held = arena.allocate(5 * PAGE_BYTES)
    before = arena.stats()
    with pytest.raises(HostMemoryError) as error:
        arena.allocate(3 * PAGE_BYTES + 1)
    assert isinstance(error.value, TierFullError)  # the store's "no room" family: callers already handle it
    message = str(error.value)
    assert "\n" not in message
    assert message == (
        f"no host memory for a block ({4 * PAGE_BYTES} bytes): {5 * PAGE_BYTES} of {8 * PAGE_BYTES} "
        f"bytes in use, the largest free block {3 * PAGE_BYTES} bytes"
    )
    assert arena.stats() == before
    assert arena.allocate(3 * PAGE_BYTES).numel() == 3 * PAGE_BYTES  # what is free is still served
    del held


def test_only_a_block_in_use_can_be_freed() -> None:
    arena, other = HostArena(4 * PAGE_BYTES), HostArena(4 * PAGE_BYTES)
    block = arena.allocate(PAGE_BYTES)
    for stranger in (block[:100], other.allocate(PAGE_BYTES), torch.empty(PAGE_BYTES, dtype=torch.uint8)):
        assert not arena.owns(stranger)
        with pytest.raises(ValueError, match="not a block in use"):
            arena.free(stranger)
    assert arena.owns(block)
    arena.free(block)
    with pytest.raises(ValueError, match="not a block in use"):  # twice
        arena.free(block)
    again = arena.allocate(PAGE_BYTES)  # the same memory, a new block: the old tensor is not it
    assert again.data_ptr() == block.data_ptr() and not arena.owns(block) and arena.owns(again)


def test_a_block_never_freed_comes_back_when_its_last_view_dies() -> None:
    arena = HostArena(4 * PAGE_BYTES)
    block = arena.allocate(2 * PAGE_BYTES)
    view = block[PAGE_BYTES:].view(torch.int32)
    del block
    assert arena.stats().in_use == 2 * PAGE_BYTES  # the view keeps it
    view.fill_(7)
    del view
    assert arena.stats().in_use == 0 and arena.stats().largest_free == 4 * PAGE_BYTES


def test_a_freed_block_outlived_by_a_tensor_is_not_freed_again() -> None:
    arena = HostArena(2 * PAGE_BYTES)
    stale = arena.allocate(PAGE_BYTES)
    arena.free(stale)  # the caller's promise: nothing uses it any more, though the tensor lives
    fresh = arena.allocate(PAGE_BYTES)
    assert fresh.data_ptr() == stale.data_ptr()
    del stale
    assert arena.stats().in_use == PAGE_BYTES and arena.owns(fresh)


def test_blocks_hold_what_is_written_to_them_apart() -> None:
    arena = HostArena(16 * PAGE_BYTES)
    blocks = [arena.allocate((i + 1) * PAGE_BYTES - i) for i in range(5)]
    for i, block in enumerate(blocks):
        block.fill_(i + 1)
    for i, block in enumerate(blocks):
        assert bool((block == i + 1).all())


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads /proc")
def test_a_big_arena_costs_nothing_up_front_on_cpu() -> None:
    before, started = resident_bytes(), time.perf_counter()
    arena = HostArena(8 << 30)  # the default --host-mem
    block = arena.allocate(1 << 30)
    seconds = time.perf_counter() - started
    assert seconds < 1.0 and resident_bytes() - before < 64 * MIB
    assert not arena.pinned and arena.stats().in_use == 1 << 30
    block[: 4 * MIB].fill_(1)  # pages come as they are touched
    assert resident_bytes() - before >= 4 * MIB


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_pinned_arena_is_pinned_memory_of_exactly_its_capacity() -> None:
    """One registration of the whole mapping (not torch's pinned allocator, which would round
    it up to a power of two): its blocks are pinned, and copies to and from the device through
    them without blocking land exactly."""
    arena = HostArena(96 * MIB + 1, pinned=True)
    assert arena.pinned and arena.capacity == 96 * MIB + PAGE_BYTES
    block = arena.allocate(3 * MIB)
    assert block.is_pinned() and block[MIB:].is_pinned()
    source = torch.randint(0, 256, (3 * MIB,), dtype=torch.uint8, device="cuda")
    block.copy_(source, non_blocking=True)
    back = torch.empty_like(source)
    back.copy_(block, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, source) and torch.equal(block, source.cpu())
    arena.free(block)
    assert arena.stats().in_use == 0


def test_threads_taking_and_giving_at_once_leave_the_accounting_exact() -> None:
    arena = HostArena(64 * PAGE_BYTES)
    failures = []

    def churn(seed: int) -> None:
        rng, mine = random.Random(seed), []
        try:
            for _ in range(300):
                if mine and rng.random() < 0.5:
                    arena.free(mine.pop(rng.randrange(len(mine))))
                else:
                    try:
                        block = arena.allocate(rng.randint(1, 6 * PAGE_BYTES))
                    except HostMemoryError:
                        continue
                    block[0] = seed  # nobody else's
                    mine.append(block)
                    assert all(int(b[0]) == seed for b in mine)
            for block in mine:
                arena.free(block)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=churn, args=(seed,)) for seed in range(1, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert arena.stats() == ArenaStats(64 * PAGE_BYTES, 0, 64 * PAGE_BYTES, 64 * PAGE_BYTES, 0)


# ---------------------------------------------------------------- the pool over it


def test_the_pool_keeps_its_free_buffers_inside_the_arena_and_gives_them_up_when_short() -> None:
    arena = HostArena(10 * PAGE_BYTES)
    pool = BufferPool(arena, keep=2, oversize=1.0)
    a, b = pool.take(3 * PAGE_BYTES), pool.take(3 * PAGE_BYTES)
    assert arena.owns(a) and arena.owns(b)
    pool.give(a)
    pool.give(b)
    assert pool.free_bytes() == 6 * PAGE_BYTES == arena.stats().in_use  # kept: counted in the arena
    assert pool.take(3 * PAGE_BYTES) is b  # the same size comes back
    pool.give(b)
    big = pool.take(8 * PAGE_BYTES)  # no room beside the kept ones: they go back first
    assert pool.free_bytes() == 0 and arena.stats().in_use == 8 * PAGE_BYTES and arena.owns(big)
    with pytest.raises(HostMemoryError):
        pool.take(3 * PAGE_BYTES)
    pool.give(big)
    with pytest.raises(ValueError, match="not a buffer of this pool"):
        pool.give(torch.empty(PAGE_BYTES, dtype=torch.uint8))
    assert pool.allocated_bytes == 14 * PAGE_BYTES > arena.capacity  # made over time, never at once


# ---------------------------------------------------------------- the state store's host memory


def host_buffers(store: StateStore) -> list[torch.Tensor]:
    """Every host buffer the store holds: its host copies' and its pool's free ones."""
    with store._cond:
        copies = [r.host_buffer for r in store._records.values() if r.host_buffer is not None]
    with store._pool._lock:
        kept = [b for buffers in store._pool._free.values() for b in buffers]
    return [*copies, *kept]


def check_host_memory(store: StateStore) -> None:
    """All of the store's host buffers are blocks of its arena, and the arena holds nothing else."""
    buffers = host_buffers(store)
    assert all(store.arena.owns(b) for b in buffers)
    stats = store.arena.stats()
    assert stats.in_use == sum(b.numel() for b in buffers) and stats.blocks == len(buffers)
    assert stats.in_use + stats.free == stats.capacity
    inventory = store.inventory()["host"]
    assert inventory["used_bytes"] <= store.host_bytes
    assert inventory["arena"] == {
        "capacity": stats.capacity,
        "in_use": stats.in_use,
        "largest_free": stats.largest_free,
        "pinned": False,
    }


def trained(trainer: TrainerEngine, job_id: str, step: int) -> dict[str, Any]:
    trainer.train_step(job_id, make_batch(step, rows=2), HP_SEQ)
    return job_state(trainer, job_id)


def test_the_arena_is_the_host_tier_and_its_documented_allowances(model_dir: str, tmp_path: Path) -> None:
    trainer = engine(model_dir)
    store = StateStore(
        trainer, host_bytes=100 * MIB, host_spill_bytes=7 * MIB, write_behind_bytes=3 * MIB, transit_bytes=5 * MIB + 1
    )
    assert store.arena.capacity == 115 * MIB + PAGE_BYTES and not store.arena.pinned  # whole pages, CPU engine
    default = StateStore(trainer, host_bytes=8 << 30)
    assert default.transit_bytes == 1 << 30 and default.host_spill_bytes == 2 << 30
    assert default.arena.capacity == (8 + 2 + 1) << 30
    assert StateStore(trainer, host_bytes=0).arena.capacity == TRANSIT_MIN_BYTES  # an nvme-only store still copies


def test_many_swaps_of_jobs_of_different_sizes_stay_inside_the_arena(model_dir: str, tmp_path: Path) -> None:
    """Five jobs of five sizes on one device slot, host room for the largest copy and transit
    for two: in random order, each job comes back from host or nvme exactly as it left; after
    every swap all the store's host buffers are blocks of its arena and the arena holds nothing
    else. Over the run the pool hands out more bytes than the arena holds (the old pool made
    each of those a fresh pinned allocation, which torch's caching allocator kept)."""
    loras = {
        "a": LoraSpec(rank=2),
        "b": LoraSpec(rank=4),
        "c": LoraSpec(rank=8),
        "d": LoraSpec(rank=16),
        "e": LoraSpec(rank=4, target_modules=["q_proj", "v_proj"]),
    }
    sizes = {job: StateStore.job_bytes(lora, config_json(model_dir)) for job, lora in loras.items()}
    largest = page_round(max(sizes.values()))
    trainer = engine(model_dir)
    store = StateStore(
        trainer,
        device_slots=1,
        host_bytes=largest,
        host_spill_bytes=0,
        nvme_dir=tmp_path / "nvme",
        transit_bytes=2 * largest,
    )
    assert store.arena.capacity == 3 * largest
    saved = {}
    for step, (job, lora) in enumerate(loras.items()):
        store.ensure_resident(job, lora, seed=step)
        saved[job] = trained(trainer, job, step)
        check_host_memory(store)
    rng = random.Random(3)
    for _ in range(40):
        order = rng.sample(list(loras), len(loras))
        store.set_upcoming(order)
        job = order[0]
        store.ensure_resident(job, loras[job], seed=list(loras).index(job))
        assert_like_alone(trainer, job, saved[job])
        check_host_memory(store)
    swaps = store.inventory()["swaps"]
    assert all(swaps[d]["count"] > 0 for d in ("device->host", "device->nvme", "host->device", "nvme->device"))
    assert store._pool.allocated_bytes > store.arena.capacity
    for job in loras:
        store.drop(job)
    store._pool.release_free()
    assert store.arena.stats().in_use == 0


def test_a_short_arena_sends_host_copies_to_nvme_to_make_room(model_dir: str, tmp_path: Path) -> None:
    """No transit allowance: the arena holds just the host tier's two copies, so a third copy
    (an eviction's, or a read from nvme) gets its block by demoting a host copy, the one
    needed least soon; every job still comes back exactly."""
    lora = LoraSpec(rank=4)
    one = page_round(StateStore.job_bytes(lora, config_json(model_dir)))
    trainer = engine(model_dir)
    store = StateStore(
        trainer, device_slots=1, host_bytes=2 * one, host_spill_bytes=0, transit_bytes=0, nvme_dir=tmp_path / "nvme"
    )
    assert store.arena.capacity == 2 * one
    saved = {}
    for step, job in enumerate("abc"):
        store.ensure_resident(job, lora, seed=step)
        saved[job] = trained(trainer, job, step)
    assert [store.where(j) for j in "abc"] == ["host", "host", "device"]
    store.set_upcoming(["d", "b", "a"])
    report = store.ensure_resident("d", lora, seed=3)  # c's copy needs a block: a goes down
    assert report["evicted"] == ["c"] and report["demoted"] == ["a"]
    assert [store.where(j) for j in "abcd"] == ["nvme", "host", "host", "device"]
    saved["d"] = trained(trainer, "d", 3)
    check_host_memory(store)
    store.set_upcoming(["a", "c", "d", "b"])
    report = store.ensure_resident("a", lora, seed=0)  # a's read needs a block (b goes), then d's copy (c goes)
    assert report["swap_in"] == "nvme" and report["evicted"] == ["d"] and sorted(report["demoted"]) == ["b", "c"]
    check_host_memory(store)
    for job in "abcd":
        store.ensure_resident(job, lora, seed="abcd".index(job))
        assert_like_alone(trainer, job, saved[job])
        check_host_memory(store)


def test_a_copy_the_arena_cannot_hold_leaves_the_job_where_it_was(model_dir: str) -> None:
    """No nvme to demote to: a copy that finds no block fails with one line naming the job,
    and the job stays on the device as it was, the store serving on."""
    lora = LoraSpec(rank=4)
    one = page_round(StateStore.job_bytes(lora, config_json(model_dir)))
    trainer = engine(model_dir)
    store = StateStore(trainer, device_slots=1, host_bytes=one, host_spill_bytes=0, transit_bytes=0)
    store.ensure_resident("a", lora, seed=0)
    trained(trainer, "a", 0)
    store.ensure_resident("b", lora, seed=1)  # a's copy takes the whole arena
    saved = trained(trainer, "b", 1)
    with pytest.raises(HostMemoryError) as error:
        store.ensure_resident("c", lora, seed=2)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"no host memory for job 'b''s state ({one} bytes): ")
    assert [store.where(j) for j in "abc"] == ["host", "device", None] and trainer.jobs() == ["b"]
    assert store.inventory()["in_flight"] == {}
    assert_like_alone(trainer, "b", saved)
    check_host_memory(store)
    store.drop("a")  # its block is free again: b's copy takes it
    assert store.ensure_resident("c", lora, seed=2)["evicted"] == ["b"] and store.where("b") == "host"
    check_host_memory(store)


def test_packed_tensors_start_aligned_back_to_back_in_the_order_given() -> None:
    tensors = [torch.zeros(3, dtype=torch.bfloat16), torch.zeros(5), torch.zeros(0), torch.zeros(64, dtype=torch.int8)]
    offsets, total = packed_layout(tensors)
    assert offsets == [0, PACK_ALIGN, 2 * PACK_ALIGN, 2 * PACK_ALIGN] and total == 2 * PACK_ALIGN + 64
    arena = HostArena(4 * PAGE_BYTES)
    block, views = tensors_to_host([torch.arange(7.0), torch.ones(2, 3, dtype=torch.bfloat16)], arena)
    assert [v.data_ptr() - block.data_ptr() for v in views] == [0, PACK_ALIGN]
    assert torch.equal(views[1], torch.ones(2, 3, dtype=torch.bfloat16)) and arena.stats().in_use == PAGE_BYTES
    back = tensors_to_device(views, torch.device("cpu"))
    assert torch.equal(back[0], torch.arange(7.0)) and back[0].data_ptr() != views[0].data_ptr()
    del block, views
    assert arena.stats().in_use == 0  # the block goes back with its last view


def test_a_cuda_trainers_base_sleeps_in_an_arena_pinned_once_for_all_its_sleeps(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA case on a CPU: the arena the base sleeps in is registered (pinned) once, whole,
    on the first sleep, and the next sleeps reuse it."""
    import worker.state.arena as host_arena

    registered: list[tuple[int, int]] = []
    monkeypatch.setattr(host_arena, "_register", lambda address, nbytes: registered.append((address, nbytes)))
    monkeypatch.setattr(host_arena, "_unregister", lambda address, mapping: None)
    engine = TrainerEngine(model_dir, threads=1)
    engine._cuda = True  # what a CUDA engine decides; its weights stay on the CPU here
    for _ in range(3):
        engine.sleep()
        engine.wake()
    arena = engine.host_arena
    assert arena is not None and arena.pinned and registered == [(arena.address, arena.capacity)]
    assert arena.capacity == page_round(packed_layout(list(engine._base_params.values()))[1])
