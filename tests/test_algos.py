"""The algorithms' arithmetic against hand-computed values, and the trainer's named losses.

Advantages (GRPO, Dr. GRPO, RLOO), DAPO's group filter, refill and overlong penalty, the
``Rollout`` plumbing of ``plexctl.rl``, each algorithm's loss settings, the trainer's loss
names and aggregations on tiny tensors and on a tiny real model, the trust gate of a user's
loss, and the spec rules of the ``algo`` section.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from conftest import random_tiny_qwen2

from plexctl.algos.dapo import DAPO, informative_groups, overlong_penalty
from plexctl.algos.dr_grpo import DrGRPO, centred_advantages
from plexctl.algos.grpo import GRPO, group_advantages
from plexctl.algos.rloo import RLOO, leave_one_out_advantages
from plexctl.common.protocol import Completion, LoraSpec, TrainBatch, TrainHParams
from plexctl.common.spec import SpecError
from plexctl.rl import Job, JobClient, Rollout
from plexctl.spec_files import load_spec
from worker.errors import BatchError, UntrustedCodeError
from worker.loss_terms import aggregation_weights, grpo_token_terms, tis_token_terms
from worker.trainer import TrainerEngine

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny-arith.yaml"

# ---------------------------------------------------------------- advantages


def test_grpo_normalises_within_each_group_and_an_all_equal_group_gives_zero() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0], group_size=4)
    std = math.sqrt(0.75 * 0.25)  # rewards 1,0,0,0: mean 0.25
    assert adv[:4] == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], rel=1e-5)
    assert adv[4:] == [0.0] * 4


def test_dr_grpo_only_centres_no_std_normalisation() -> None:
    assert centred_advantages([1.0, 0.0, 0.0, 0.0], 4) == [0.75, -0.25, -0.25, -0.25]
    assert centred_advantages([3.0, 1.0], 2) == [1.0, -1.0]  # std 1 would give the same; std 2 would not:
    assert centred_advantages([4.0, 0.0], 2) == [2.0, -2.0]  # GRPO gives +-1 here
    assert group_advantages([4.0, 0.0], 2) == pytest.approx([1.0, -1.0], rel=1e-5)


def test_rloo_baseline_is_the_mean_of_the_other_samples() -> None:
    adv = leave_one_out_advantages([1.0, 0.0, 0.0, 0.0, 2.0, 4.0], group_size=3)
    # group 1 (1, 0, 0): 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5
    # group 2 (0, 2, 4): 0 - 3 = -3; 2 - 2 = 0; 4 - 1 = 3
    assert adv == [1.0, -0.5, -0.5, -3.0, 0.0, 3.0]
    rewards = [0.3, 0.9, 0.1, 0.5]
    k, mean = 4, sum(rewards) / 4
    assert leave_one_out_advantages(rewards, 4) == pytest.approx([k / (k - 1) * (r - mean) for r in rewards])
    assert leave_one_out_advantages([1.0] * 4, 4) == [0.0] * 4


def test_dapo_drops_all_equal_groups_and_penalises_overlong_softly() -> None:
    assert informative_groups([1, 1, 0, 1, 0, 0, 0.5, 0.5], group_size=2) == [1]
    assert informative_groups([1, 1, 1], group_size=3) == []
    # L_max 20, L_cache 4: free up to 16 tokens, then -1/4 per token, -1 at 20
    assert [overlong_penalty(n, 20, 4) for n in (3, 16, 17, 18, 20)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(19, 20, 4, penalty=0.5) == -0.375
    assert overlong_penalty(20, 20, 0) == 0.0  # buffer 0: off


# ---------------------------------------------------------------- the library's Rollout and the loops


def completion(prompt: list[int], tokens: list[int]) -> Completion:
    return Completion(0, "x", prompt, tokens, [-0.5] * len(tokens), "stop")


def rollout_of(rewards: list[float], n: int, lengths: list[int] | None = None, version: int = 3) -> Rollout:
    lengths = lengths or [2] * len(rewards)
    records = [{"prompt": f"p{g}", "answer": "1"} for g in range(len(rewards) // n)]
    samples = [completion([7, 8], list(range(1, k + 1))) for k in lengths]
    return Rollout(records, n, samples, rewards, version, errors=1, generate_s=0.5)


def test_rollout_keeps_groups_joins_and_builds_the_batch() -> None:
    r = rollout_of([1, 0, 1, 1, 0, 1], n=2, lengths=[1, 2, 3, 1, 2, 3])
    kept = r.keep([2, 0])
    assert kept.records == [r.records[2], r.records[0]] and kept.rewards == [0, 1, 1, 0]
    assert kept.lengths == [2, 3, 1, 2]
    both = kept + rollout_of([0, 1], n=2, version=1)
    assert both.policy_version == 1 and both.errors == 2 and both.generate_s == 1.0 and len(both.samples) == 6
    batch = kept.batch([0.5, -0.5, 1.0, -1.0])
    assert batch.input_ids[0] == [7, 8, 1, 2] and batch.loss_mask[0] == [0, 0, 1, 1]
    assert batch.old_logprobs[0] == [0.0, 0.0, -0.5, -0.5] and batch.advantages == [0.5, -0.5, 1.0, -1.0]
    with pytest.raises(ValueError):
        kept.batch([1.0])


@pytest.fixture(scope="module")
def tiny_spec(tiny_model: Path):
    return lambda *overrides: load_spec(TINY, list(overrides))


def job_for(spec, tmp_path: Path, cls: type[Job] = Job) -> Job:
    """A real ``Job`` (data, reward) whose client is never called by these tests."""
    return cls(JobClient("tcp://127.0.0.1:9", "unit"), spec, tmp_path)


def test_each_algorithm_asks_the_trainer_for_its_loss(tiny_spec, tmp_path: Path) -> None:
    grpo = GRPO(job_for(tiny_spec(), tmp_path))
    # exactly the settings GRPO always sent: a job's update is unchanged by the library
    assert grpo.hp == TrainHParams(lr=2e-3, clip_low=0.2, clip_high=0.2, kl_coef=0.0, loss_agg="token-mean")
    dr = DrGRPO(job_for(tiny_spec("algo.name=dr_grpo"), tmp_path))
    assert (dr.hp.loss_agg, dr.hp.loss_agg_len, dr.hp.loss) == ("seq-mean-token-sum-norm", 4, "pg-clip")
    dapo = DAPO(job_for(tiny_spec("algo.name=dapo"), tmp_path))
    assert (dapo.hp.clip_low, dapo.hp.clip_high, dapo.hp.loss_agg) == (0.2, 0.28, "token-mean")
    assert dapo.buffer == 0  # max_tokens 4 // 5
    # a multi-turn episode spans turns of max_tokens each: no single-turn length to punish against
    tool = tiny_spec("algo.name=dapo", "sampling.max_tokens=20", "env.name=python_tool", "env.max_turns=3")
    assert DAPO(job_for(tool, tmp_path)).shaped_rewards(rollout_of([1.0, 0.0], 2, lengths=[40, 3])) == [1.0, 0.0]
    assert DAPO(job_for(tiny_spec("algo.name=dapo", "sampling.max_tokens=20"), tmp_path)).buffer == 4
    tis = RLOO(job_for(tiny_spec("algo.name=rloo", "algo.loss=pg-tis", "algo.loss_params={cap: 3}"), tmp_path))
    assert (tis.hp.loss, tis.hp.loss_params) == ("pg-tis", {"cap": 3.0})
    assert RLOO(job_for(tiny_spec("algo.name=rloo"), tmp_path)).advantages(rollout_of([1, 0, 0], 3)) == [1, -0.5, -0.5]


class ScriptedJob(Job):
    """A Job whose refills come from a script instead of the engines (the filter logic alone)."""

    script: list[Rollout]

    def rollout(self, records, n, sampling):
        self.seeds.append(sampling.seed)
        return self.script.pop(0)


def test_dapo_refills_up_to_max_gen_batches_and_trims_to_the_batch(tiny_spec, tmp_path: Path) -> None:
    spec = tiny_spec(
        "algo.name=dapo",
        "algo.prompts_per_step=3",
        "algo.group_size=2",
        "algo.max_gen_batches=3",
        "algo.overlong_buffer=1",
    )
    job = job_for(spec, tmp_path, ScriptedJob)
    job.seeds = []
    job.script = [rollout_of([0, 0, 1, 0, 1, 1], 2), rollout_of([0, 1, 1, 0, 1, 1], 2)]
    dapo = DAPO(job)
    first = rollout_of([1, 1, 0, 0, 1, 0], 2)  # one informative group of three
    trained, seen = dapo.collect(0, first)
    assert len(trained.records) == 3 and dapo.rounds == 3  # 1 + 1 + (2, trimmed to 1)
    assert trained.rewards == [1, 0, 1, 0, 0, 1]
    assert len(seen.rewards) == 18 and seen.errors == 3
    assert len(set(job.seeds)) == 2  # each refill samples with a fresh seed from the job's RNG
    # the same step with a full first round needs no refill
    trained, seen = dapo.collect(1, rollout_of([1, 0, 0, 1, 1, 0], 2))
    assert dapo.rounds == 1 and seen is not trained and len(trained.records) == 3
    # overlong: max_tokens 4, buffer 1: a 4-token completion loses 1 before the group normalisation
    shaped = dapo.shaped_rewards(rollout_of([1, 1], 2, lengths=[3, 4]))
    assert shaped == [1.0, 0.0]
    assert dapo.advantages(rollout_of([1, 1], 2, lengths=[3, 4])) == pytest.approx([1.0, -1.0], rel=1e-5)


def test_dapo_without_informative_groups_trains_on_nothing(tiny_spec, tmp_path: Path) -> None:
    job = job_for(
        tiny_spec("algo.name=dapo", "algo.prompts_per_step=2", "algo.group_size=2", "algo.max_gen_batches=2"),
        tmp_path,
        ScriptedJob,
    )
    job.seeds, job.script = [], [rollout_of([0, 0, 1, 1], 2)]
    trained, seen = DAPO(job).collect(0, rollout_of([1, 1, 0, 0], 2))
    assert trained.samples == [] and len(seen.rewards) == 8


# ---------------------------------------------------------------- the trainer's losses on tiny tensors


MASK = torch.tensor([[True, True, False], [True, False, False]])


@pytest.mark.parametrize(
    "agg, norm_len, expected",
    [
        ("token-mean", 0, [[1 / 3, 1 / 3, 0], [1 / 3, 0, 0]]),
        ("seq-mean-token-mean", 0, [[1 / 4, 1 / 4, 0], [1 / 2, 0, 0]]),
        ("seq-mean-token-sum", 0, [[1 / 2, 1 / 2, 0], [1 / 2, 0, 0]]),
        ("seq-mean-token-sum-norm", 4, [[1 / 8, 1 / 8, 0], [1 / 8, 0, 0]]),  # Dr. GRPO: sum / L_max, mean over rows
        ("seq-mean-token-sum-norm", 0, [[1 / 4, 1 / 4, 0], [1 / 4, 0, 0]]),  # no L_max: the longest row (2)
    ],
)
def test_aggregation_weights(agg: str, norm_len: int, expected: list[list[float]]) -> None:
    torch.testing.assert_close(aggregation_weights(MASK, agg, norm_len), torch.tensor(expected))


def test_clipped_and_truncated_is_losses_by_hand() -> None:
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[3.0, 0.5, 1.0]])).requires_grad_()  # ratios 3, 0.5, 1
    adv = torch.tensor([2.0])
    hp = TrainHParams(clip_low=0.2, clip_high=0.28, loss="pg-clip")
    clipped = grpo_token_terms(logp, old, None, adv, hp)
    # A > 0: min(r A, clip(r) A) = 1.28 A at r 3 (clipped), 0.5 A at r 0.5, A at r 1
    torch.testing.assert_close(clipped.loss, torch.tensor([[-2.56, -1.0, -2.0]]))
    assert clipped.clipped.tolist() == [[True, False, False]]
    tis = tis_token_terms(logp, old, None, adv, TrainHParams(loss="pg-tis", loss_params={"cap": 2.0}))
    # -A min(r, cap): weights 2 (truncated), 0.5, 1; the gradient is -A w d(log p)
    torch.testing.assert_close(tis.loss, torch.tensor([[-4.0, -1.0, -2.0]]))
    assert tis.clipped.tolist() == [[True, False, False]] and tis.ratio[0, 0].item() == pytest.approx(3.0)
    tis.loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-4.0, -1.0, -2.0]]))


# ---------------------------------------------------------------- the trainer's losses on a tiny model

VOCAB = 64
LOSS_MODULE = '''
import torch

def reinforce(logp, old_logprobs, advantages, mask, params):
    """-A * ratio per token: pg-clip's gradient when on-policy, without the clip."""
    return -params.get("scale", 1.0) * advantages.unsqueeze(1) * torch.exp(logp - old_logprobs)
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-qwen2-algos")
    random_tiny_qwen2(path, vocab_size=VOCAB)
    return str(path)


def tiny_batch(engine: TrainerEngine) -> TrainBatch:
    ids = [[3, 4, 5, 6, 7], [3, 9, 10], [8, 2, 11, 12, 13, 14]]
    mask = [[0, 0, 1, 1, 1], [0, 1, 1], [0, 0, 0, 1, 1, 1]]
    old = engine.logprobs("A", ids, mask)  # on-policy: ratio 1
    return TrainBatch(ids, mask, old, [1.0, -0.5, 0.25])


def test_trainer_losses_by_name_and_dr_grpo_aggregation(model_dir: str) -> None:
    engine = TrainerEngine(model_dir, threads=2)
    engine.ensure_job("A", LoraSpec(rank=4, alpha=8), seed=3)
    engine.train_step("A", TrainBatch([[1, 2, 3]], [[0, 1, 1]], [[0.0, -4.0, -4.0]], [1.0]), TrainHParams(lr=1e-2))
    batch = tiny_batch(engine)
    tokens, rows, max_len = 3 + 2 + 3, 3, 4
    token_mean, _ = engine.loss_gradients("A", batch, TrainHParams(loss_agg="token-mean"))
    dr, _ = engine.loss_gradients("A", batch, TrainHParams(loss_agg="seq-mean-token-sum-norm", loss_agg_len=max_len))
    for key in token_mean:  # sum / (L_max x rows) is token-mean rescaled by tokens / (L_max x rows)
        torch.testing.assert_close(dr[key], token_mean[key] * tokens / (max_len * rows), rtol=1e-4, atol=1e-7)
    tis, metrics = engine.loss_gradients("A", batch, TrainHParams(loss="pg-tis"))
    for key in token_mean:  # on-policy the IS weight is 1: the same gradient as pg-clip
        torch.testing.assert_close(tis[key], token_mean[key], rtol=1e-4, atol=1e-7)
    assert metrics["clip_frac"] == 0.0
    for bad, match in (
        (TrainHParams(loss="ppo"), "loss must be one of"),
        (TrainHParams(loss="pg-clip", loss_params={"cap": 2.0}), "takes no parameters"),
        (TrainHParams(loss_agg="seq-sum"), "loss_agg"),
    ):
        with pytest.raises(BatchError, match=match):
            engine.train_step("A", batch, bad)


def test_a_user_loss_runs_only_when_the_daemon_marks_the_job_trusted(model_dir: str, tmp_path: Path) -> None:
    (tmp_path / "my_losses_algos.py").write_text(LOSS_MODULE)
    engine = TrainerEngine(model_dir, threads=2)
    engine.ensure_job("A", LoraSpec(rank=4, alpha=8), seed=3)
    engine.train_step("A", TrainBatch([[1, 2, 3]], [[0, 1, 1]], [[0.0, -4.0, -4.0]], [1.0]), TrainHParams(lr=1e-2))
    batch = tiny_batch(engine)
    user = TrainHParams(loss_fn="my_losses_algos:reinforce", loss_path=str(tmp_path), loss_params={"scale": 2.0})
    with pytest.raises(UntrustedCodeError, match="--trust-user-code"):
        engine.train_step("A", batch, user)
    assert "my_losses_algos" not in sys.modules  # refused before importing anything
    builtin, _ = engine.loss_gradients("A", batch, TrainHParams())
    trusted = msgspec.structs.replace(user, user_code_trusted=True)  # what the daemon stamps
    mine, metrics = engine.loss_gradients("A", batch, trusted)
    for key in builtin:  # scale 2: twice pg-clip's on-policy gradient
        torch.testing.assert_close(mine[key], 2 * builtin[key], rtol=1e-4, atol=1e-7)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)


# ---------------------------------------------------------------- the algo section of the spec


def spec_error(*overrides: str) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(TINY, list(overrides))
    return str(info.value)


def test_algo_keys_are_checked_against_the_algorithm(tiny_model: Path) -> None:
    assert "--set: algo.max_gen_batches: only applies to algo.name dapo (this job runs grpo)" in spec_error(
        "algo.max_gen_batches=2"
    )
    assert "algo.loss_agg: dr_grpo aggregates with seq-mean-token-sum-norm" in spec_error(
        "algo.name=dr_grpo", "algo.loss_agg=token-mean"
    )
    assert load_spec(TINY, ["algo.name=dr_grpo"]).algo.loss_agg == "seq-mean-token-sum-norm"
    assert "algo.loss_params.x: loss pg-tis takes cap" in spec_error("algo.loss=pg-tis", "algo.loss_params={x: 1}")
    assert "algo.loop: set either `name`" in spec_error(
        "algo.loop=custom_loop:loop", f"algo.path={REPO}/configs/examples"
    )
    assert "algo.loss_fn: no module `nope`" in spec_error("algo.loss_fn=nope:f", f"algo.path={REPO}")
    assert "algo.overlong_buffer: must be < sampling.max_tokens (4)" in spec_error(
        "algo.name=dapo", "algo.overlong_buffer=4"
    )
    assert "algo.name: must be one of grpo, dr_grpo, dapo, rloo" in spec_error("algo.name=ppo")


def test_the_algorithm_guide_shows_the_whole_example_loop_in_under_60_lines() -> None:
    source = (REPO / "configs" / "examples" / "custom_loop.py").read_text()
    assert len(source.splitlines()) < 60
    code = source[source.index("from plexctl.rl import Job") :]
    assert code in (REPO / "docs" / "algorithms.md").read_text()
