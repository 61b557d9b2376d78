"""The tier policy (plexctl/common/state_policy.py): its invariants as properties over random tiers and
orders, the simulator's tiers (daemon.simulator.NodeTiers) kept within their budgets by it, and
the worker's real store and the simulator making the same moves on the same events."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.simulator import NodeTiers, TierFullError
from plexctl.common import state_policy
from plexctl.common.state_policy import DEVICE, HOST, NVME, Held, Placement, Room, Tiers, Upcoming

JOB_IDS = [f"j{i}" for i in range(8)]


# ---------------------------------------------------------------- strategies


@st.composite
def held_jobs(draw: st.DrawFn, min_size: int = 0, max_size: int = 6) -> list[Held]:
    """Distinct jobs with distinct last-use ticks (as a store's counter gives them)."""
    ids = draw(st.lists(st.sampled_from(JOB_IDS), min_size=min_size, max_size=max_size, unique=True))
    ticks = draw(st.lists(st.integers(0, 1000), min_size=len(ids), max_size=len(ids), unique=True))
    sizes = draw(st.lists(st.integers(1, 100), min_size=len(ids), max_size=len(ids)))
    return [Held(job_id, nbytes, tick) for job_id, nbytes, tick in zip(ids, sizes, ticks)]


upcoming_orders = st.lists(st.sampled_from(JOB_IDS), max_size=10).map(Upcoming)


@st.composite
def tiers(draw: st.DrawFn, host_copies: list[Held]) -> Tiers:
    host_used = sum(h.nbytes for h in host_copies) + draw(st.integers(0, 50))  # plus copies in flight
    full = draw(st.booleans())
    host = Room(HOST, draw(st.integers(0, 300)), host_used, spill_bytes=draw(st.integers(0, 80)))
    nvme_bytes = draw(st.one_of(st.none(), st.integers(0, 400)))
    room = draw(st.integers(0, 400)) if full else 0
    return Tiers((host, Room(NVME, nvme_bytes, draw(st.integers(0, 200)), full=full, room=room)))


@st.composite
def placements(draw: st.DrawFn) -> tuple[Held, Tiers, list[Held], Upcoming, int, bool]:
    jobs = draw(held_jobs(min_size=1, max_size=7))
    leaving, host_copies = jobs[0], jobs[1:]
    return (
        leaving,
        draw(tiers(host_copies)),
        host_copies,
        draw(upcoming_orders),
        draw(st.integers(0, 60)),
        draw(st.booleans()),
    )


# ---------------------------------------------------------------- eviction


@given(held_jobs(min_size=1), upcoming_orders)
def test_the_victim_is_needed_least_soon_then_least_recently_used(resident: list[Held], upcoming: Upcoming) -> None:
    victim = state_policy.victim(resident, upcoming)
    assert victim in resident
    for other in resident:
        assert upcoming.rank(other.job_id) <= upcoming.rank(victim.job_id)
        if upcoming.rank(other.job_id) == upcoming.rank(victim.job_id):
            assert other.last_used >= victim.last_used
    assert state_policy.victim(list(reversed(resident)), upcoming) == victim  # the order given does not matter


@given(held_jobs(), st.integers(1, 100), st.integers(1, 6), st.one_of(st.none(), st.integers(0, 500)))
def test_room_is_needed_only_when_a_slot_or_the_byte_budget_is_short(
    resident: list[Held], incoming: int, slots: int, device_bytes: int | None
) -> None:
    needs = state_policy.needs_room(resident, incoming, slots, device_bytes)
    over_bytes = device_bytes is not None and sum(h.nbytes for h in resident) + incoming > device_bytes
    assert needs == (bool(resident) and (len(resident) >= slots or over_bytes))


# ---------------------------------------------------------------- placement


@given(placements())
@settings(max_examples=400)
def test_a_placement_keeps_every_budget_and_demotes_only_copies_needed_later(
    case: tuple[Held, Tiers, list[Held], Upcoming, int, bool],
) -> None:
    leaving, tier_state, host_copies, upcoming, credit, spill = case
    host, nvme = tier_state.rooms
    placement = state_policy.place(leaving, tier_state, {HOST: host_copies}, upcoming, {HOST: credit}, spill)
    assert host.budget is not None
    free_host = host.budget - host.used + credit
    if leaving.nbytes <= free_host:  # room on host: nothing else moves
        assert placement == Placement(HOST)
        return
    if placement is None:
        assert not nvme.takes(leaving.nbytes)
        assert not (spill and nvme.full and host.spill_fits(leaving.nbytes, credit))
        return
    by_id = {h.job_id: h for h in host_copies}
    demoted = [by_id[job_id] for job_id in placement.demote]
    assert len(set(placement.demote)) == len(demoted) and leaving.job_id not in placement.demote
    for copy in demoted:  # each is needed later than the leaving job (or as late and used longer ago)
        assert upcoming.least_soon_key(copy) < upcoming.least_soon_key(leaving)
    assert demoted == sorted(demoted, key=upcoming.least_soon_key)  # least soon first
    moved_down = sum(h.nbytes for h in demoted)
    if placement.tier == NVME:
        assert not demoted and nvme.takes(leaving.nbytes)
    elif demoted:
        assert leaving.nbytes <= free_host + moved_down and nvme.takes(moved_down)
        assert leaving.nbytes > free_host + moved_down - demoted[-1].nbytes  # no copy more than needed
    else:  # host, over its budget: only while nvme is out of space, within the spill allowance
        assert spill and nvme.full and host.spill_fits(leaving.nbytes, credit)
        assert not nvme.takes(leaving.nbytes)


@given(placements())
def test_a_placement_does_not_depend_on_the_order_of_the_host_copies(
    case: tuple[Held, Tiers, list[Held], Upcoming, int, bool],
) -> None:
    leaving, tier_state, host_copies, upcoming, credit, spill = case
    shuffled = random.Random(len(host_copies)).sample(host_copies, len(host_copies))
    assert state_policy.place(
        leaving, tier_state, {HOST: host_copies}, upcoming, {HOST: credit}, spill
    ) == state_policy.place(leaving, tier_state, {HOST: shuffled}, upcoming, {HOST: credit}, spill)


@given(placements())
def test_a_prefetch_lands_on_host_within_its_budget(case: tuple[Held, Tiers, list[Held], Upcoming, int, bool]) -> None:
    job, tier_state, host_copies, upcoming, _, _ = case
    placement = state_policy.prefetch_placement(job, tier_state, {HOST: host_copies}, upcoming)
    if placement is not None:
        freed = sum(h.nbytes for h in host_copies if h.job_id in placement.demote)
        host = tier_state.room(HOST)
        assert placement.tier == HOST and host.budget is not None
        assert host.used - freed + job.nbytes <= host.budget


@given(
    st.lists(st.sampled_from(JOB_IDS), max_size=8),
    st.dictionaries(st.sampled_from(JOB_IDS), st.sampled_from([DEVICE, HOST, NVME])),
)
def test_the_prefetch_choice_is_the_first_expected_job_on_nvme(expected: list[str], tier_of: dict[str, str]) -> None:
    choice = state_policy.prefetch_choice(expected, tier_of)
    on_nvme = [j for j in expected if tier_of.get(j) == NVME]
    assert choice == (on_nvme[0] if on_nvme else None)


@given(held_jobs(), upcoming_orders, st.integers(0, 300), st.integers(0, 300))
def test_under_memory_pressure_the_copy_needed_least_soon_goes_down_first(
    host_copies: list[Held], upcoming: Upcoming, nvme_bytes: int, nvme_used: int
) -> None:
    tier_state = Tiers((Room(HOST, 1000, 0), Room(NVME, nvme_bytes, nvme_used)))
    first = state_policy.first_to_demote(HOST, host_copies, tier_state, upcoming)
    fitting = [h for h in host_copies if nvme_used + h.nbytes <= nvme_bytes]
    assert (first is None) == (not fitting)
    if first is not None:
        assert all(upcoming.least_soon_key(first) <= upcoming.least_soon_key(h) for h in fitting)


# ---------------------------------------------------------------- the simulator's tiers


events = st.lists(
    st.tuples(
        st.sampled_from(["swap_in", "swap_in", "swap_in", "prefetch", "drop"]),
        st.sampled_from(JOB_IDS),
        st.permutations(JOB_IDS).flatmap(lambda order: st.integers(0, len(order)).map(lambda n: order[:n])),
    ),
    max_size=60,
)


@given(events, st.integers(1, 3), st.integers(0, 4), st.integers(0, 5))
@settings(max_examples=150)
def test_simulated_tiers_keep_every_job_on_one_tier_within_its_budget(
    sequence: list[tuple[str, str, list[str]]], slots: int, host_states: int, nvme_states: int
) -> None:
    size = 10
    node = NodeTiers(slots, None, {HOST: host_states * size, NVME: nvme_states * size})
    for action, job_id, order in sequence:
        if action == "swap_in":
            try:
                node.swap_in(job_id, size, lambda order=order: order)
            except TierFullError:
                continue
            assert node.where(job_id) == DEVICE
        elif action == "prefetch":
            was = node.where(job_id)
            moved = node.prefetch(job_id, order)
            if moved is not None:
                assert was == NVME and node.where(job_id) == HOST
        else:
            node.drop(job_id)
            assert node.where(job_id) is None
        counts = {tier: sum(1 for t in node.tier.values() if t == tier) for tier in (DEVICE, HOST, NVME)}
        assert counts[DEVICE] <= slots
        assert node.used == {tier: counts[tier] * size for tier in counts}
        assert node.used[HOST] <= host_states * size and node.used[NVME] <= nvme_states * size


# ---------------------------------------------------------------- a tier added later

ARCHIVE = "archive"  # a tier slower than nvme, as a later entry of STATE_TIERS would be


def test_a_third_storage_tier_takes_what_the_others_cannot_and_their_demotions() -> None:
    """The policy decides over the list of tiers it is given: a state host and nvme cannot take
    goes to the tier below them, and nvme makes room by demoting there, as host does to nvme."""
    full = (Room(HOST, 100, 100), Room(NVME, 100, 100))
    three = Tiers((*full, Room(ARCHIVE, 1000, 0)))
    leaving = Held("soon", 50, 9)
    assert state_policy.place(leaving, Tiers(full), {}, Upcoming()) is None
    assert state_policy.place(leaving, three, {}, Upcoming()) == Placement(ARCHIVE)
    copies = {HOST: [Held("h", 100, 1)], NVME: [Held("n", 100, 2)]}  # both needed later than "soon"
    upcoming = Upcoming(["soon", "n", "h"])
    # host cannot demote "h" (nvme is full), nvme can demote "n" to the archive
    assert state_policy.place(leaving, three, copies, upcoming) == Placement(NVME, ("n",))
    assert state_policy.first_to_demote(NVME, copies[NVME], three, upcoming) == copies[NVME][0]
    assert state_policy.first_to_demote(ARCHIVE, [], three, upcoming) is None  # the last tier demotes nowhere
    assert state_policy.prefetch_choice(["a", "b"], {"a": HOST, "b": ARCHIVE}, slow=(NVME, ARCHIVE)) == "b"
    with pytest.MonkeyPatch.context() as patch:  # the simulator's node, given the third tier's budget
        patch.setattr(state_policy, "TIER_ORDER", (*state_policy.TIER_ORDER, ARCHIVE))
        node = NodeTiers(1, None, {HOST: 10, NVME: 10, ARCHIVE: 30})
        for job in JOB_IDS[:5]:
            node.swap_in(job, 10, lambda: JOB_IDS)  # needed in this order: the soonest keeps the fastest tier
        assert [node.where(job) for job in JOB_IDS[:5]] == [HOST, NVME, ARCHIVE, ARCHIVE, DEVICE]
        node.drop(JOB_IDS[0])
        assert node.prefetch(JOB_IDS[3], JOB_IDS[3:]) == ()  # from the archive up to host, now free
        assert node.where(JOB_IDS[3]) == HOST and node.used == {DEVICE: 10, HOST: 10, NVME: 10, ARCHIVE: 10}


@given(events, st.integers(1, 2))
@settings(max_examples=80)
def test_simulated_tiers_take_a_third_tier_from_its_entry_alone(
    sequence: list[tuple[str, str, list[str]]], slots: int
) -> None:
    """NodeTiers built with a third budget (its name added to TIER_ORDER) keeps every job on one
    tier within every budget; a swap-in fails only when every storage tier is full."""
    size = 10
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(state_policy, "TIER_ORDER", (*state_policy.TIER_ORDER, ARCHIVE))
        node = NodeTiers(slots, None, {ARCHIVE: 4 * size, HOST: size, NVME: size})
        assert list(node.budgets) == [HOST, NVME, ARCHIVE]
        for action, job_id, order in sequence:
            if action == "swap_in":
                try:
                    node.swap_in(job_id, size, lambda order=order: order)
                except TierFullError:
                    assert all(node.used[name] + size > budget for name, budget in node.budgets.items())
                    continue
            elif action == "prefetch":
                was = node.where(job_id)
                if node.prefetch(job_id, order) is not None:
                    assert was in (NVME, ARCHIVE) and node.where(job_id) == HOST
            else:
                node.drop(job_id)
            tiers = [DEVICE, *node.budgets]
            counts = {tier: sum(1 for t in node.tier.values() if t == tier) for tier in tiers}
            assert counts[DEVICE] <= slots and sum(counts.values()) == len(node.tier)
            assert all(node.used[tier] == counts[tier] * size for tier in tiers)
            assert all(node.used[name] <= budget for name, budget in node.budgets.items())


# ---------------------------------------------------------------- the store and the simulator agree


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from conftest import random_tiny_qwen2

    return random_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


def random_events(seed: int, n: int = 45) -> list[tuple[str, str, list[str]]]:
    """(action, job, upcoming order): trainer calls ("ensure"), prefetches (of the job the
    daemon would choose: its job is ignored) and job ends ("drop")."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        order = rng.sample(JOB_IDS, rng.randint(0, len(JOB_IDS)))
        action = rng.choices(["ensure", "prefetch", "drop"], weights=[6, 3, 1])[0]
        out.append((action, rng.choice(JOB_IDS), order))
    return out


@pytest.mark.parametrize("seed", [4, 7])  # between them: every move, prefetches that demote, full tiers
def test_the_store_and_the_simulator_move_the_same_states_on_the_same_events(
    tiny_model: str, tmp_path: Path, seed: int
) -> None:
    """Eight jobs on two device slots, host for two states, nvme for three: a random sequence of
    trainer calls (with the upcoming order the daemon would send), prefetches and job ends, fed
    to the worker's StateStore (real torch, files on disk) and to the simulator's NodeTiers."""
    from plexctl.common.protocol import LoraSpec
    from worker.errors import TierFullError as StoreTierFullError
    from worker.state.store import StateStore
    from worker.trainer import TrainerEngine

    trainer = TrainerEngine(tiny_model, threads=1)
    lora = LoraSpec(rank=2)
    trainer.ensure_job("probe", lora, seed=1)
    size = trainer.export_state("probe").nbytes
    trainer.release("probe")
    store = StateStore(trainer, device_slots=2, host_bytes=2 * size, nvme_dir=tmp_path / "nvme", nvme_bytes=3 * size)
    node = NodeTiers(2, None, {HOST: 2 * size, NVME: 3 * size})
    for step, (action, job_id, order) in enumerate(random_events(seed)):
        what = f"event {step}: {action} {job_id} with upcoming {order}"
        store.set_upcoming(order)
        if action == "ensure":
            try:
                report = store.ensure_resident(job_id, lora, seed=7)
            except StoreTierFullError:
                with pytest.raises(TierFullError):
                    node.swap_in(job_id, size, lambda order=order: order)
                continue
            moved = node.swap_in(job_id, size, lambda order=order: order)
            assert report["swap_in"] == (None if moved.source == DEVICE else moved.source), what
            assert report["evicted"] == [job for job, _ in moved.evicted], what
            assert report["demoted"] == list(moved.demoted), what
        elif action == "prefetch":
            job_id = state_policy.prefetch_choice(order, {j: node.where(j) or "" for j in JOB_IDS}) or job_id
            assert store.prefetch(job_id) == (node.prefetch(job_id, order) is not None), what
        else:
            store.drop(job_id)
            node.drop(job_id)
        assert {j: store.where(j) for j in JOB_IDS} == {j: node.where(j) for j in JOB_IDS}, what


def test_tier_order_puts_tier_names_fastest_first_and_refuses_unknown_ones() -> None:
    assert state_policy.tier_order([NVME, DEVICE, HOST]) == [DEVICE, HOST, NVME] == list(state_policy.TIER_ORDER)
    assert state_policy.tier_order([NVME, HOST]) == [HOST, NVME]  # a node without a tier
    with pytest.raises(ValueError, match="tape"):
        state_policy.tier_order([HOST, "tape"])
