"""Several LoRA jobs trained in one pass (``TrainingMath.train_group``) learn what each learns alone.

On a tiny random Qwen2 in fp32 on CPU: each job's gradients from a grouped pass equal its
gradients alone within ``ATOL`` / ``RTOL``, and after several grouped steps each job's adapter
equals the one trained alone within ``STEP_ATOL`` / ``STEP_RTOL``. Measured here (torch 2.13 CPU,
``-s`` prints them): gradients bit-identical when each layer adds each job's product over its
own rows (adapters of other shapes); 9.3e-9 when same-shaped adapters share two batched matmuls
with their scaling folded into the weights (jobs a and e), 8e-6 in their adapters after 3 AdamW
steps; 4.5e-8 when the group's micro-batches split the jobs' rows otherwise than their own.
Bit-identity is not promised: the rows share the base's matmuls, padded to the group's longest
row, and a kernel (on a GPU, most) may sum in another order for another batch shape. Jobs of one
token loss (b, d, f; a, g) take it over all their rows at once; a group's clipping and AdamW steps
are each job's own bit for bit. Jobs that cannot share a pass (LoRA dropout, full fine-tuning) are
refused.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from conftest import random_tiny_qwen2

from plexctl.common.protocol import LoraSpec, TrainBatch, TrainHParams
from worker.errors import BatchError
from worker.trainer import TrainerEngine

VOCAB = 64
ATOL, RTOL = 1e-6, 1e-5  # one pass's gradients, grouped vs alone
STEP_ATOL, STEP_RTOL = 1e-4, 1e-3  # adapters after STEPS AdamW steps (lr 1e-3..5e-3; AdamW scales tiny diffs up)
STEPS = 3

JOBS = {  # job -> (LoRA, seed, hparams, rows in its batch)
    "a": (LoraSpec(rank=8, alpha=16), 1, TrainHParams(lr=2e-3, kl_coef=0.05, weight_decay=0.01), 5),
    "b": (
        LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]),
        2,
        TrainHParams(lr=5e-3, loss_agg="seq-mean-token-mean", max_grad_norm=0.5),
        3,
    ),
    "c": (LoraSpec(rank=8, alpha=8), 3, TrainHParams(lr=1e-3, loss="pg-tis"), 7),
    "d": (LoraSpec(rank=2, alpha=4), 4, TrainHParams(lr=3e-3, loss_agg="seq-mean-token-sum"), 2),
    # a's shape and row count: a pass of a and e stacks their weights (two batched matmuls per layer)
    "e": (LoraSpec(rank=8, alpha=12), 5, TrainHParams(lr=4e-3, clip_high=0.28), 5),
    # the same token loss as b and d (their aggregations and optimizers differ): b, d and f's pass
    # takes the loss terms of all their rows at once; g's is a's (KL included), and of a's shape
    "f": (LoraSpec(rank=4, alpha=4), 6, TrainHParams(lr=2e-3, max_grad_norm=0.1), 4),
    "g": (LoraSpec(rank=8, alpha=16), 7, TrainHParams(lr=1e-3, kl_coef=0.05), 5),
    # f's shape and row count (4, even): with a pass costing nothing, f and h's group is cut into
    # micro-batches of like lengths, each holding every job's k-th rows by length
    "h": (LoraSpec(rank=4, alpha=4), 8, TrainHParams(lr=1e-3, loss_agg="seq-mean-token-mean"), 4),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-qwen2-grouped")
    random_tiny_qwen2(path, vocab_size=VOCAB)
    return str(path)


def make_batch(seed: int, rows: int) -> TrainBatch:
    """Ragged rows (a 2-4 token prompt, a 2-9 token completion), old log-probs near the policy's."""
    rng = random.Random(seed)
    ids, masks, olds, advantages = [], [], [], []
    for _ in range(rows):
        prompt, completion = rng.randint(2, 4), rng.randint(2, 9)
        ids.append([rng.randrange(1, VOCAB) for _ in range(prompt + completion)])
        masks.append([0] * prompt + [1] * completion)
        olds.append([(-4.2 + rng.uniform(-0.3, 0.3)) * m for m in masks[-1]])
        advantages.append(rng.gauss(0.0, 1.0))
    return TrainBatch(ids, masks, olds, advantages)


def engine_with(model_dir: str, jobs: list[str], **kw) -> TrainerEngine:
    engine = TrainerEngine(model_dir, threads=2, **kw)
    for job in jobs:
        lora, seed, hp, _ = JOBS[job]
        engine.ensure_job(job, lora, seed)
    return engine


def steps_of(jobs: list[str], step: int) -> list[tuple[str, TrainBatch, TrainHParams]]:
    return [(job, make_batch(100 * step + JOBS[job][1], JOBS[job][3]), JOBS[job][2]) for job in jobs]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize(
    "jobs,micro_batch_tokens",
    [
        (["a", "b"], None),
        (["a", "e"], None),
        (["a", "b", "c"], None),
        (["a", "b", "c", "d", "e"], None),
        (["a", "b", "c", "d"], 40),
        (["b", "d", "f"], None),
        (["b", "d", "f"], 40),
        (["a", "g"], None),
    ],
)
def test_each_jobs_gradients_in_a_group_equal_its_gradients_alone(model_dir: str, jobs, micro_batch_tokens):
    engine = engine_with(model_dir, jobs, micro_batch_tokens=micro_batch_tokens)
    steps = steps_of(jobs, 0)
    alone = [engine.loss_gradients(job, batch, hp) for job, batch, hp in steps]
    grouped = engine.group_gradients(steps)
    identical = True
    for (job, _, _), (grads, metrics), (own, own_metrics) in zip(steps, grouped, alone):
        assert set(grads) == set(own)
        for key in own:
            torch.testing.assert_close(grads[key], own[key], atol=ATOL, rtol=RTOL, msg=f"{job} {key}")
            identical = identical and torch.equal(grads[key], own[key])
        assert metrics.keys() == own_metrics.keys()
        for name, value in own_metrics.items():
            assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{job} {name}"
        assert any(float(g.abs().max()) > 0 for g in grads.values())  # a gradient reached the adapter
    worst = max(max_diff(g, o) for (g, _), (o, _) in zip(grouped, alone))
    print(
        f"\n{len(jobs)} jobs, micro_batch_tokens={micro_batch_tokens}: "
        f"max |grad diff| {worst:.2e}, bit-identical {identical}"
    )


@pytest.mark.parametrize("jobs", [["a", "b", "c", "d"], ["a", "e"], ["b", "d", "f"], ["a", "g"]])
def test_after_several_grouped_steps_each_adapter_equals_the_one_trained_alone(model_dir: str, jobs):
    alone = engine_with(model_dir, jobs)
    grouped = engine_with(model_dir, jobs)
    for step in range(STEPS):
        steps = steps_of(jobs, step)
        own = [alone.train_step(job, batch, hp) for job, batch, hp in steps]
        shared = grouped.train_group(steps)
        for m, o in zip(shared, own):
            assert m["group"] == len(jobs) and m["skipped"] == o["skipped"] == 0.0
            assert m["grad_norm"] == pytest.approx(o["grad_norm"], rel=1e-5)
    worst = 0.0
    for job in jobs:
        a, g = alone.adapter_state_dict(job), grouped.adapter_state_dict(job)
        for key in a:
            torch.testing.assert_close(g[key], a[key], atol=STEP_ATOL, rtol=STEP_RTOL, msg=f"{job} {key}")
        worst = max(worst, max_diff(g, a))
        oa, og = alone.optimizer_state_dict(job)["state"], grouped.optimizer_state_dict(job)["state"]
        for i in oa:
            assert float(og[i]["step"]) == float(oa[i]["step"]) == STEPS
    print(f"\nafter {STEPS} steps: max |adapter diff| {worst:.2e}")


def test_quantile_passes_cut_a_group_where_the_padding_saved_pays_for_the_pass():
    from worker.train_batches import quantile_passes

    jobs = [[3, 9, 4, 10], [10, 2, 9, 3]]  # rows 0-3 and 4-7
    order, bounds = quantile_passes(jobs, None, None, pass_cost_tokens=0)  # type: ignore[misc]
    assert bounds == [(0, 2), (2, 4), (4, 6), (6, 8)]  # 52 padded tokens, against 56 in two passes, 80 in one
    assert [sorted(order[a:b]) for a, b in bounds] == [[0, 5], [2, 7], [1, 6], [3, 4]]  # job 0's, then job 1's
    two = quantile_passes(jobs, None, None, pass_cost_tokens=20)
    assert two is not None and two[1] == [(0, 4), (4, 8)]  # 80 padded tokens -> 16 + 40, plus 2 x 20
    assert [order for order in two[0][:4]] == [0, 2, 5, 7]  # each job's two shortest first
    assert quantile_passes(jobs, None, None, pass_cost_tokens=40) is None  # a pass costs more than it saves
    assert quantile_passes([[3, 9], [10, 2, 9]], None, None, 0) is None  # row counts differ
    assert quantile_passes(jobs, None, 40, 0) is None  # the budget cuts it already


def test_a_group_cut_into_passes_of_like_lengths_gives_each_jobs_gradients_alone(model_dir: str, monkeypatch):
    import dataclasses

    import worker.trainer_math as tm

    free = {p: dataclasses.replace(d, pass_cost_tokens=0) for p, d in tm.ENGINE_DEFAULTS.items()}
    monkeypatch.setattr(tm, "ENGINE_DEFAULTS", free)
    cuts = []
    real = tm.quantile_passes
    monkeypatch.setattr(tm, "quantile_passes", lambda *a: cuts.append(real(*a)) or cuts[-1])
    jobs = ["f", "h"]
    engine = engine_with(model_dir, jobs)
    steps = steps_of(jobs, 0)
    alone = [engine.loss_gradients(job, batch, hp) for job, batch, hp in steps]
    grouped = engine.group_gradients(steps)
    assert cuts and cuts[0] is not None and len(cuts[0][1]) > 1  # the group was cut
    for (job, _, _), (grads, metrics), (own, own_metrics) in zip(steps, grouped, alone):
        for key in own:
            torch.testing.assert_close(grads[key], own[key], atol=ATOL, rtol=RTOL, msg=f"{job} {key}")
        for name, value in own_metrics.items():
            assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{job} {name}"


def test_a_groups_clipping_and_adamw_steps_are_each_jobs_own_bit_for_bit():
    """``train_group`` clips and steps all its jobs in one multi-tensor pass: each job's gradient
    norm, clipped gradients, weights and AdamW moments are exactly what ``clip_grad_norm_`` and its
    own ``step()`` give (max norms and learning rates differ per job; one job's gradient is inf)."""
    from worker.trainer_math import _clip_together, _step_together

    torch.manual_seed(0)
    shapes = [(8, 16), (4, 16), (16, 4)]
    own = [[torch.nn.Parameter(torch.randn(shape)) for shape in shapes] for _ in range(4)]
    together = [[torch.nn.Parameter(p.detach().clone()) for p in job] for job in own]
    settings = [(1e-3, 0.0, 1.0), (5e-3, 0.01, 0.5), (2e-3, 0.01, 0.0), (1e-3, 0.0, 1.0)]  # lr, decay, max norm
    optimizers = [
        [torch.optim.AdamW(job, lr=lr, weight_decay=wd, foreach=True) for job, (lr, wd, _) in zip(side, settings)]
        for side in (own, together)
    ]
    for step in range(3):
        for a_job, b_job in zip(own, together):
            for a, b in zip(a_job, b_job):
                a.grad = torch.randn_like(a) * 3
                b.grad = a.grad.clone()
        if step == 1:
            own[3][0].grad[0, 0] = together[3][0].grad[0, 0] = float("inf")
        norms = [
            float(torch.nn.utils.clip_grad_norm_(job, m if m > 0 else math.inf))
            for job, (_, _, m) in zip(own, settings)
        ]
        assert _clip_together(together, [m for _, _, m in settings]) == norms
        for a_job, b_job in zip(own, together):
            for a, b in zip(a_job, b_job):  # exactly, NaN where the norm was inf
                torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, equal_nan=True)
        stepping = [i for i, n in enumerate(norms) if math.isfinite(n)]
        for i in stepping:
            optimizers[0][i].step()
        _step_together([optimizers[1][i] for i in stepping])
    for i, (a_job, b_job) in enumerate(zip(own, together)):
        for a, b in zip(a_job, b_job):
            assert torch.equal(a, b)
            for name in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(optimizers[0][i].state[a][name], optimizers[1][i].state[b][name])
    assert float(optimizers[1][3].state[together[3][0]]["step"]) == 2  # the inf step was skipped


def test_a_job_alone_in_a_group_is_its_train_step_bit_for_bit(model_dir: str):
    alone, grouped = engine_with(model_dir, ["a"]), engine_with(model_dir, ["a"])
    ((job, batch, hp),) = steps_of(["a"], 0)
    alone.train_step(job, batch, hp)
    grouped.train_group([(job, batch, hp)])
    for key, value in alone.adapter_state_dict(job).items():
        assert torch.equal(grouped.adapter_state_dict(job)[key], value)


def test_jobs_with_lora_dropout_or_full_weights_or_twice_are_refused(model_dir: str, tmp_path: Path):
    engine = engine_with(model_dir, ["a", "b"])
    engine.ensure_job("dropout", LoraSpec(rank=4, alpha=8, dropout=0.1), 5)
    engine.ensure_job("full", None, 6)
    assert engine.groupable("a") and not engine.groupable("dropout") and not engine.groupable("full")
    (a, b) = steps_of(["a", "b"], 0)
    with pytest.raises(BatchError, match="cannot share a pass"):
        engine.train_group([a, ("dropout", a[1], a[2])])
    with pytest.raises(BatchError, match="cannot share a pass"):
        engine.train_group([("full", b[1], b[2]), a])
    with pytest.raises(BatchError, match="each job once"):
        engine.train_group([a, a])
