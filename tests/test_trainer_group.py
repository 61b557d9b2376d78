"""A trainer engine of several ranks (worker/trainer_group.py), on CPU: real processes, gloo, FSDP2.

A 2-rank group's step gives the loss and the updated adapter of a 1-rank ``TrainerEngine`` on the
same batch and seed (float32, up to summation order), every rank's adapter stays bit-identical, the
base's weights are sharded, and a rank that dies or hangs makes rank 0's call fail with a
``TrainerGroupError`` within the collective timeout instead of hanging. The pure pieces (backend
choice, row shares, share scales) are checked without processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import socket
import time
from pathlib import Path

import pytest
import torch
from conftest import random_tiny_qwen2

from plexctl.common.memplan import JobShape, job_sizes, rank_job_bytes, rank_weights_bytes, weights_bytes
from plexctl.common.protocol import LoraSpec, TrainBatch, TrainHParams
from plexctl.common.state_size import full_state_size
from worker.errors import BatchError, CheckpointError
from worker.loss_terms import aggregation_weights
from worker.train_batches import pad_rows
from worker.trainer import TrainerEngine
from worker.trainer_group import (
    GroupCall,
    GroupRank,
    TrainerGroup,
    TrainerGroupError,
    adapter_digest,
    batch_rows,
    collective_backend,
    row_shares,
    share_scale,
)

VOCAB = 64  # random_tiny_qwen2's: every token id below it
LORA = LoraSpec(rank=4, alpha=8)
OPTIONS = {"threads": 1}  # two ranks on two cores


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return random_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"), vocab_size=VOCAB)


def make_batch(seed: int, rows: int) -> TrainBatch:
    """Ragged rows: a 2-5 token prompt (mask 0), then a 2-12 token completion (mask 1); ids in the vocab."""
    rng = random.Random(seed)
    input_ids, loss_mask, old = [], [], []
    for _ in range(rows):
        prompt, completion = rng.randint(2, 5), rng.randint(2, 12)
        input_ids.append([rng.randrange(1, VOCAB) for _ in range(prompt + completion)])
        loss_mask.append([0] * prompt + [1] * completion)
        old.append([(-4.2 + rng.uniform(-0.3, 0.3)) * m for m in loss_mask[-1]])
    return TrainBatch(input_ids, loss_mask, old, [rng.gauss(0.0, 1.0) for _ in range(rows)])


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# ---------------------------------------------------------------- pure pieces


@pytest.mark.unit
def test_backend_follows_the_device() -> None:
    assert collective_backend(cuda_available=True) == "nccl"
    assert collective_backend(cuda_available=False) == "gloo"


@pytest.mark.unit
def test_collectives_across_nodes_bind_to_the_interface_that_reaches_rank_0() -> None:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME: unset, gloo binds to the address the host name
    resolves to, a loopback one on Debian-style hosts (this one among them), which no other node
    reaches. A group whose rank 0 is on another host binds to the interface that routes there;
    one on this host alone, or one the user configured, is left as it is."""
    import psutil

    from worker.trainer_group import socket_env, socket_ifname

    table = {"lo": ["127.0.0.1", "::1"], "eth0": ["192.168.0.5"], "ib0": ["10.1.2.3", "fe80::1"]}
    assert socket_ifname("10.1.2.3", table) == "ib0" and socket_ifname("192.168.0.5", table) == "eth0"
    assert socket_ifname("127.0.0.1", table) is None and socket_ifname("10.9.9.9", table) is None
    assert socket_env("127.0.0.1", {}) == {}  # every rank on this host
    both = {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    assert socket_env("192.0.2.1", both) == {}  # the user's choice stands
    mine = {
        name: a.address
        for name, addresses in psutil.net_if_addrs().items()
        for a in addresses
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    }
    if not mine:
        pytest.skip("this host has no IPv4 address but loopback")
    name, address = next(iter(mine.items()))
    assert socket_env(address, {"NCCL_SOCKET_IFNAME": "ib0"}) == {"GLOO_SOCKET_IFNAME": name}


def test_row_shares_cover_the_batch_in_order() -> None:
    for rows in range(1, 12):
        for width in range(1, 5):
            shares = row_shares(rows, width)
            assert [i for share in shares for i in share] == list(range(rows))
            assert max(map(len, shares)) - min(map(len, shares)) <= 1


@pytest.mark.unit
@pytest.mark.parametrize(
    "loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_scaled_share_weights_are_the_batch_weights(loss_agg: str) -> None:
    """Every aggregation: a share's own weights times its scale are the whole batch's on its rows."""
    batch, hp = make_batch(3, rows=7), TrainHParams(loss_agg=loss_agg)
    whole = aggregation_weights(pad_rows(batch.input_ids, batch.loss_mask, torch.device("cpu")).loss_mask, loss_agg)
    for share in row_shares(7, 3):
        part = batch_rows(batch, share)
        own = aggregation_weights(pad_rows(part.input_ids, part.loss_mask, torch.device("cpu")).loss_mask, loss_agg)
        expected = whole[share.start : share.stop, : own.shape[1]]
        torch.testing.assert_close(own * share_scale(batch, share, hp), expected, rtol=1e-6, atol=0.0)


# ---------------------------------------------------------------- a real group


def relative_difference(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """|got - expected| / |expected|, all tensors as one vector."""
    assert set(got) == set(expected)
    difference = torch.cat([(got[k] - expected[k]).flatten() for k in expected]).norm()
    return float(difference / torch.cat([t.flatten() for t in expected.values()]).norm())


def adapter_after_steps(engine: TrainerEngine | TrainerGroup, batches: list[TrainBatch], hp: TrainHParams) -> list:
    """(metrics, adapter copy) after each step of job "A" on ``batches``."""
    out = []
    for batch in batches:
        metrics = engine.train_step("A", batch, hp)
        out.append((metrics, {k: v.detach().clone() for k, v in engine.adapter_state_dict("A").items()}))
    return out


@pytest.mark.slow
@pytest.mark.e2e
def test_two_ranks_step_as_one_engine(model_dir: str) -> None:
    """A 2-rank group, each rank half of every batch, against a 1-rank engine (same seed, same
    batches): the same gradient and loss (1e-6 relative) and, after one step, the same adapter
    (1e-5); after three steps AdamW has amplified float rounding in near-zero gradient entries
    (its update is lr * g / (|g| + eps)), as the engine's own two micro-batches do against one,
    so the adapters agree to 1e-4, and 2e-5 as one vector. Every rank's adapter and moments
    stay bit-identical, and each rank holds a part of the base."""
    hp = TrainHParams(lr=1e-2, max_grad_norm=1.0)
    batches = [make_batch(11, rows=6), make_batch(12, rows=5), make_batch(14, rows=8)]
    alone = TrainerEngine(model_dir, **OPTIONS)  # type: ignore[arg-type]
    alone.ensure_job("A", LORA, seed=5)
    gradients, gradient_metrics = alone.loss_gradients("A", batches[0], hp)
    expected = adapter_after_steps(alone, batches, hp)
    full_bytes = sum(p.numel() * p.element_size() for p in alone._base_params.values())
    halves = TrainerEngine(model_dir, micro_batch_rows=3, **OPTIONS)  # type: ignore[arg-type]
    halves.ensure_job("A", LORA, seed=5)
    rounding = [
        max_difference(adapter, want)
        for (_, adapter), (_, want) in zip(adapter_after_steps(halves, batches, hp), expected)
    ]

    started = time.monotonic()
    with TrainerGroup(model_dir, width=2, engine_options=OPTIONS, timeout_s=60) as group:
        group.ensure_job("A", LORA, seed=5)
        got_gradients, got_metrics = group.loss_gradients("A", batches[0], hp)
        gradient_error = relative_difference(got_gradients, gradients)
        print(f"gradient relative difference {gradient_error:.3g}")
        assert gradient_error <= 1e-6
        assert got_metrics["loss"] == pytest.approx(gradient_metrics["loss"], rel=1e-6)
        for step, ((got, adapter), (want, want_adapter)) in enumerate(
            zip(adapter_after_steps(group, batches, hp), expected)
        ):
            assert got["tokens"] == want["tokens"]
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
            for key in ("pg_loss", "kl", "clip_frac", "ratio_mean", "entropy", "grad_norm"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
            difference, relative = max_difference(adapter, want_adapter), relative_difference(adapter, want_adapter)
            print(
                f"step {step}: loss {want['loss']:.9g} vs {got['loss']:.9g}; adapter max |diff| {difference:.3g}, "
                f"relative {relative:.3g} (the engine's two micro-batches: {rounding[step]:.3g})"
            )
            assert difference <= (1e-5 if step == 0 else 1e-4)
            assert relative <= 2e-5
        digests = group.adapter_digests("A")
        assert len(digests) == 2 and digests[0] == digests[1]
        shares, states = group.base_bytes(), group.rank_state_bytes("A")
        print(f"base bytes per rank {shares} of {full_bytes}; job state bytes per rank {states}")
        assert_plan_per_rank(model_dir, 2, shares, states, alone.export_state("A").nbytes)
        with pytest.raises(BatchError, match=r"rank 0 of 2 would get no trainable token \(no row of 1\)"):
            group.train_step("A", make_batch(13, rows=1), hp)  # refused before any rank moves
        group.train_step("A", batches[0], hp)  # and the group goes on
    print(f"2-rank group: {time.monotonic() - started:.1f} s")


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("width", [1, 4])
def test_other_widths_step_as_one_engine(model_dir: str, width: int) -> None:
    """A 1-rank and a 4-rank group (ranks of one or two rows): one step's loss, gradient and adapter
    are a 1-rank engine's; each rank holds what the plan says."""
    hp, batch = TrainHParams(lr=1e-2, max_grad_norm=1.0), make_batch(11, rows=6)
    alone = TrainerEngine(model_dir, **OPTIONS)  # type: ignore[arg-type]
    alone.ensure_job("A", LORA, seed=5)
    gradients, _ = alone.loss_gradients("A", batch, hp)
    [(want, want_adapter)] = adapter_after_steps(alone, [batch], hp)
    with TrainerGroup(model_dir, width=width, engine_options=OPTIONS, timeout_s=60) as group:
        group.ensure_job("A", LORA, seed=5)
        got_gradients, _ = group.loss_gradients("A", batch, hp)
        [(got, adapter)] = adapter_after_steps(group, [batch], hp)
        digests = group.adapter_digests("A")
        assert_plan_per_rank(
            model_dir, width, group.base_bytes(), group.rank_state_bytes("A"), alone.export_state("A").nbytes
        )
    print(
        f"width {width}: gradient relative difference {relative_difference(got_gradients, gradients):.3g}, "
        f"loss {want['loss']:.9g} vs {got['loss']:.9g}, adapter max |diff| {max_difference(adapter, want_adapter):.3g}"
    )
    assert relative_difference(got_gradients, gradients) <= 1e-6
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert max_difference(adapter, want_adapter) <= 1e-5
    assert len(set(digests)) == 1 and len(digests) == width


def assert_plan_per_rank(model_dir: str, width: int, base: list[int], states: list[int], state_alone: int) -> None:
    """What each rank of a group holds is what ``plexctl plan`` counts per rank (float32 weights,
    the tiny model's shapes divide evenly): its share of the base with the whole lm_head, and a
    LoRA job's whole state, which is also the plan's estimate of it."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    job = JobShape("A", LORA.rank, 0, target_modules=tuple(LORA.target_modules))
    assert base == [rank_weights_bytes(config, "float32", width)] * width
    assert states == [state_alone] * width == [rank_job_bytes(config, state_alone, job, width)] * width
    assert job_sizes(config, job, "float32", cuda=False)[0] == state_alone


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("width", [2, 4])
def test_a_full_jobs_state_per_rank_is_the_plans(model_dir: str, width: int) -> None:
    """A full fine-tuning job on 2 and 4 ranks: each rank holds its shard of every weight and its
    moments, the lm_head's whole, exactly the plan's per-rank figure."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    size = full_state_size(config, "float32")
    job = JobShape("F", 0, 0, full=True)
    with TrainerGroup(model_dir, width=width, engine_options=OPTIONS, timeout_s=60) as group:
        group.ensure_job("F", None, seed=5)
        states = group.rank_state_bytes("F")
    assert states == [rank_job_bytes(config, size.total, job, width, fixed=size.extra)] * width
    head = config["vocab_size"] * config["hidden_size"] * 12  # fp32 weight and two moments, whole
    assert states[0] == (size.total - size.extra - head) // width + head + size.extra


@pytest.mark.slow
@pytest.mark.e2e
def test_a_tied_embedding_is_split_and_its_lm_head_kept_whole(tmp_path: Path) -> None:
    """With tied embeddings, each of 2 ranks holds half the base and a whole copy of the lm_head,
    as the plan counts it; a full fine-tuning job's state, whose one embedding is its head, is
    split in two, all of it, as the plan counts it too (how it trains: ``test_wide_trainer``)."""
    model_dir = random_tiny_qwen2(tmp_path / "tied", vocab_size=VOCAB, tie_word_embeddings=True)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    size = full_state_size(config, "float32")
    with TrainerGroup(model_dir, width=2, engine_options=OPTIONS, timeout_s=60) as group:
        group.ensure_job("F", None, seed=5)
        shares, states = group.base_bytes(), group.rank_state_bytes("F")
    head = VOCAB * config["hidden_size"] * 4
    assert (
        shares == [rank_weights_bytes(config, "float32", 2)] * 2 == [weights_bytes(config, "float32") // 2 + head] * 2
    )
    full = JobShape("F", 0, 0, full=True)
    assert states == [rank_job_bytes(config, size.total, full, 2, fixed=size.extra)] * 2
    assert states[0] == (size.total - size.extra) // 2 + size.extra


@pytest.mark.slow
@pytest.mark.e2e
def test_a_checkpoint_saved_at_width_2_restores_at_widths_1_and_4(model_dir: str, tmp_path: Path) -> None:
    """A job trained two steps on 2 ranks and checkpointed resumes on a 1-rank engine and on a
    4-rank group with its adapter and AdamW moments bit-identical, and steps on as one engine;
    a checkpoint of another LoRA is refused on rank 0 before any rank moves."""
    hp, ckpt = TrainHParams(lr=1e-2, max_grad_norm=1.0), str(tmp_path / "ckpt")
    with TrainerGroup(model_dir, width=2, engine_options=OPTIONS, timeout_s=60) as two:
        two.ensure_job("A", LORA, seed=5)
        for batch in (make_batch(21, rows=6), make_batch(22, rows=8)):
            two.train_step("A", batch, hp)
        two.save_checkpoint("A", ckpt, {"step": 2})
        [saved, also] = two.adapter_digests("A")
    assert saved == also
    one = TrainerEngine(model_dir, **OPTIONS)  # type: ignore[arg-type]
    assert one.load_checkpoint("A", ckpt, LORA, seed=5) == {"step": 2}
    assert adapter_digest(one, "A") == saved
    following = make_batch(23, rows=8)
    with TrainerGroup(model_dir, width=4, engine_options=OPTIONS, timeout_s=60) as four:
        with pytest.raises(CheckpointError, match="written for LoRA"):
            four.load_checkpoint("B", ckpt, LoraSpec(rank=8), seed=5)
        assert four.load_checkpoint("A", ckpt, LORA, seed=5) == {"step": 2}
        assert four.adapter_digests("A") == [saved] * 4
        got = four.train_step("A", following, hp)
    want = one.train_step("A", following, hp)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)


@dataclasses.dataclass(frozen=True)
class SumOfRanks(GroupCall[float]):
    """A collective in which rank ``fails`` dies (``how="die"``) or hangs (``how="hang"``) first."""

    fails: int
    how: str

    def run(self, rank: GroupRank) -> float:
        if rank.rank == self.fails and self.how == "die":
            os._exit(3)
        if rank.rank == self.fails:
            time.sleep(3600)
        return float(rank.all_reduce_sum(torch.ones(1) * rank.rank).item())


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("how", ["die", "hang"])
def test_a_failing_rank_fails_the_call_within_the_timeout(model_dir: str, how: str) -> None:
    timeout_s = 8.0
    with TrainerGroup(model_dir, width=2, engine_options=OPTIONS, timeout_s=timeout_s) as group:
        assert group.call(SumOfRanks(fails=-1, how=how)) == 1.0  # no rank fails: 0 + 1
        started = time.monotonic()
        with pytest.raises(TrainerGroupError, match="trainer group of 2 ranks failed running SumOfRanks") as caught:
            group.call(SumOfRanks(fails=1, how=how))
        waited = time.monotonic() - started
        print(f"{how}: failed after {waited:.1f} s: {caught.value}")
        assert waited < timeout_s + 10
        assert ("rank 1 exited with status 3" if how == "die" else "rank 1 still running") in str(caught.value)
        with pytest.raises(TrainerGroupError, match="closed"):
            group.call(SumOfRanks(fails=-1, how=how))
    assert not any(Path(f"/proc/{pid}").exists() for pid in group.pids)


@dataclasses.dataclass(frozen=True)
class RanksWithEnv(GroupCall[float]):
    """How many ranks have ``name`` set to ``value`` in their environment."""

    name: str
    value: str

    def run(self, rank: GroupRank) -> float:
        return float(rank.all_reduce_sum(torch.tensor([float(os.environ.get(self.name) == self.value)])).item())


@pytest.mark.e2e
def test_ranks_fork_from_one_server_and_have_their_starters_environment(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each group's ranks are forked from the one server this process started, which imported
    the trainer once, and each rank has the environment its group's starter had when the group
    started (a variable set after the server started included), not the server's."""
    from bench.faults import process_table

    servers = set()
    for value in ("first", "second"):
        monkeypatch.setenv("PLEXRL_TEST_RANK_ENV", value)
        with TrainerGroup(model_dir, width=3, engine_options=OPTIONS, timeout_s=60) as group:
            assert group.call(RanksWithEnv("PLEXRL_TEST_RANK_ENV", value)) == 3.0
            procs = process_table()
            servers |= {procs[pid][0] for pid in group.pids}
    [server] = servers
    parent, argv = procs[server]
    assert parent == os.getpid() and "forkserver" in argv and "worker.main" in argv


def test_a_ranks_passes_are_its_share_of_the_micro_batches_then_null_passes() -> None:
    from worker.trainer_math import RankSplit

    def passes(rank: int, width: int, count: int) -> list[int | None]:
        return RankSplit(rank, width, lambda t: t).passes(count)

    assert [passes(r, 2, 4) for r in range(2)] == [[0, 2], [1, 3]]
    assert [passes(r, 2, 3) for r in range(2)] == [[0, 2], [1, None]]  # as many passes on every rank
    assert [passes(r, 4, 1) for r in range(4)] == [[0], [None], [None], [None]]
    for width, count in ((2, 7), (4, 9), (3, 3)):
        runs = [passes(r, width, count) for r in range(width)]
        assert len({len(p) for p in runs}) == 1  # every rank runs as many passes
        assert sorted(i for p in runs for i in p if i is not None) == list(range(count))  # each micro-batch once
