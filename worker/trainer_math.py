"""A trainer engine's math: the loss, its gradient and the optimizer step on one job's adapter
(or, for a full fine-tuning job, on all its weights), and current-policy log-probs.

``train_step`` runs one policy-gradient step with the loss the call names (``TrainHParams``):
``pg-clip`` (PPO's clipped surrogate, asymmetric clip) or ``pg-tis`` (truncated importance
sampling), optional k3 KL to the base, token-, sequence- or constant-length aggregation, gradient
clipping; or a trusted user's own per-token loss (``loss_fn``), imported only for a job the daemon
marked as a trusted user's. Loss terms: ``worker.loss_terms``; chunked log-probs:
``worker.token_logprobs``; batch checks and micro-batches: ``worker.train_batches``.

Invariants. A step runs in micro-batches (``micro_batch_rows``, ``micro_batch_tokens``) whose loss
weights are computed over the whole batch first, so their gradients add up to the batch's; with
``length_buckets`` rows are cut in length order and every per-row result put back in the batch's
order (only the summation order changes); no batch's full logits ever exist. Only the job's
adapter is active and trainable during its call; LoRA dropout runs on the job's own saved RNG
stream, each micro-batch's masks seeded from the step's draw of it and the micro-batch's index
(``job_rng``): a job's update is bit-for-bit (on CPU) the one it would get alone, and its masks
the same at any width. bfloat16 / float16 engines run under autocast; adapters and AdamW stay
float32.

``train_group`` steps several ``groupable`` LoRA jobs of the base (no dropout) in one pass: rows
in shared micro-batches, each row through its own job's adapter (``_segment_adapters``), each
job's loss weights, clipping and AdamW step its own (the token terms of jobs with one loss
function taken over all their rows at once; clipping and AdamW in one multi-tensor pass, bit for
bit each job's own); gradients equal to each job alone up to float rounding, not bit-for-bit
(``tests/test_trainer_grouped.py`` measures it).

On a rank of an engine of several (``split``, a ``RankSplit``), ``train_step`` and ``train_group``
run this rank's share of the step's micro-batches and sum the gradients and metric sums over the
ranks before clipping and AdamW; every rank runs as many passes. A full fine-tuning job on a
sharded base (``sharded``) holds this rank's shard of each weight: FSDP2's reduce-scatter sums its
gradients within each backward, only its whole parameters (the lm_head) are all-reduced after, and
its clipping norm is the whole gradient's.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from peft import PeftModel
from peft.helpers import disable_input_dtype_casting
from peft.tuners.lora import LoraLayer
from torch.optim.adam import adam

from plexctl.common.engine_defaults import ENGINE_DEFAULTS
from plexctl.common.protocol import TrainBatch, TrainHParams
from plexctl.common.scheduling import can_share_pass
from plexctl.common.user_code import import_object
from worker.decoder_layers import keep_adapters_eager
from worker.errors import BatchError, LossLoadError, UntrustedCodeError
from worker.fused_lora import fused_lora_a
from worker.loss_terms import (
    MetricSums,
    TokenTerms,
    aggregation_weights,
    user_token_terms,
)
from worker.shards import ShardedBase, gather, is_shard, local, shard_of
from worker.tinker_losses import loss_function
from worker.token_logprobs import DEFAULT_LOGPROB_CHUNK_TOKENS, causal_lm_parts, token_logprobs
from worker.train_batches import (
    Rows,
    check_batch,
    check_hparams,
    check_token_rows,
    length_order,
    micro_batch_bounds,
    pad_old_logprobs,
    pad_rows,
    permute_rows,
    quantile_passes,
    slice_rows,
)
from worker.trainer_slots import JobSlots, JobState, capture_rng, forked_rng, store_rng


@dataclass
class PassOptions:
    """How a job's forward/backward runs on the engine (``TrainerEngine``'s options of these
    names, which it reads and sets here; every part reads them at each call)."""

    micro_batch_rows: int | None = None  # rows a forward/backward takes at most (None: no limit)
    micro_batch_tokens: int | None = None  # padded tokens a forward/backward takes at most
    logprob_chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS  # positions whose logits exist at once
    length_buckets: bool = False  # a batch's rows cut in length order
    fuse_lora: bool = False  # the LoRA A matmuls of q/k/v and of gate/up as one each
    pack_rows: bool = False  # a micro-batch's rows packed into one sequence
    logprob_vocab_block: int | None = None  # the log-softmax over the vocabulary in blocks of so many
    compile_layers: str | None = None  # the torch.compile backend of the decoder layers (None: eager)
    checkpointed_layers: list[torch.nn.Module] = field(default_factory=list)  # put in training mode for a backward


@dataclass(frozen=True)
class RankSplit:
    """This process's place in a trainer engine of several ranks, for the steps it serves: of a
    step's micro-batches (the same cut on every rank), rank r runs those whose index is r modulo
    ``width``, and a null pass where it has none left in a round, so every rank runs as many
    forwards and backwards (FSDP's collectives need that); the gradients and the metrics' sums
    are then summed over the ranks (``all_reduce``, in place) before the step."""

    rank: int
    width: int
    all_reduce: Callable[[torch.Tensor], torch.Tensor]

    def passes(self, count: int) -> list[int | None]:
        """The micro-batch indices this rank runs of ``count``, in order; None: a null pass."""
        rounds = -(-count // self.width)
        return [i if (i := r * self.width + self.rank) < count else None for r in range(rounds)]


class TrainingMath:
    """Steps, gradients and log-probs on the resident jobs of ``slots``, and the pieces of a job's
    pass the token losses share (``activate``, ``job_weights``, ``forward_context``, ``job_rng``,
    ``clip_gradients``). It owns the trusted users' imported loss functions."""

    def __init__(
        self,
        slots: JobSlots,
        base: torch.nn.Module,
        base_params: dict[str, torch.nn.Parameter],
        options: PassOptions,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """``base``: the model the slots' adapters wrap; ``base_params``: its own parameters (a
        full fine-tuning job's weights go in their place); ``dtype``: the base weights' (autocast
        when not float32)."""
        self.slots = slots
        self.options = options
        self.device = device
        self._base = base
        self._base_params = base_params
        self._torch_dtype = dtype
        self._user_losses: dict[tuple[str, str], Callable[..., torch.Tensor]] = {}
        self.split: RankSplit | None = None  # set on each rank of an engine of several
        self.sharded: ShardedBase | None = None  # the base's FSDP2 units, on an engine of several ranks

    # ------------------------------------------------------------ training

    def train_step(self, job_id: str, batch: TrainBatch, hp: TrainHParams) -> dict[str, float]:
        """One GRPO optimizer step on the job's adapter; returns the step's metrics.

        The AdamW ``lr`` and ``weight_decay`` are taken from ``hp`` on every step. A
        non-finite gradient norm skips the update (``skipped`` = 1.0) instead of poisoning it.
        """
        started = time.perf_counter()
        job = self.slots.job(job_id)
        split = self.split
        metrics = self._forward_backward(job, batch, hp, split)
        if split is not None:
            _reduce_gradients(self.replicated([job]), split)
        grad_norm, skipped = self.apply_gradients(job, hp)
        metrics.update(grad_norm=grad_norm, skipped=float(skipped), seconds=time.perf_counter() - started)
        return metrics

    def apply_gradients(self, job: JobState, hp: TrainHParams) -> tuple[float, bool]:
        """The job's gradients clipped, then one AdamW step with ``hp``'s lr and weight decay
        (skipped on a non-finite norm), the gradients cleared: (the norm, whether it skipped)."""
        grad_norm = self.clip_gradients(job, hp.max_grad_norm)
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            _set_optimizer_hparams(job.optimizer, hp)
            job.optimizer.step()
        job.optimizer.zero_grad(set_to_none=True)
        return grad_norm, skipped

    def loss_gradients(
        self, job_id: str, batch: TrainBatch, hp: TrainHParams
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The loss gradient (before clipping) under PEFT-file keys, without stepping.

        For diagnostics and tests; the adapter and optimizer are left untouched.
        """
        job = self.slots.job(job_id)
        metrics = self._forward_backward(job, batch, hp)
        grads = {key: _grad_or_zeros(param) for key, param in job.params.items()}
        job.optimizer.zero_grad(set_to_none=True)
        return grads, metrics

    def logprobs(self, job_id: str, input_ids: list[list[int]], loss_mask: list[list[int]]) -> list[list[float]]:
        """Current-policy log-prob of every token (eval mode, no dropout); 0 where masked."""
        job = self.slots.job(job_id)
        check_token_rows(input_ids, loss_mask)
        rows = pad_rows(input_ids, loss_mask, self.device)
        order = self._length_order(rows.lengths)
        if order is not None:
            rows = permute_rows(rows, order)
        model = self.activate(job, train=False)
        columns: list[torch.Tensor] = []
        with torch.no_grad(), self.job_weights(job, grad=False), self.forward_context():
            for _, _, part in self._micro_batches(rows):
                logp, _ = self._token_logprobs(model, part)
                columns.extend(logp.cpu())
        out = [[0.0] + col[: n - 1].tolist() for col, n in zip(columns, rows.lengths)]
        if order is None:
            return out
        in_order: list[list[float]] = [[] for _ in out]
        for at, row in zip(order, out):
            in_order[at] = row
        return in_order

    def activate(self, job: JobState, train: bool) -> torch.nn.Module:
        """Make the job's adapter the only active (and trainable) one; set train/eval mode. A
        full fine-tuning job's weights go in with ``job_weights`` around its forward."""
        peft = self.slots.peft
        if job.lora is None:
            model = peft if peft is not None else self._base
            model.train(train)
            return model
        assert peft is not None
        peft.set_adapter(job.adapter_name)
        peft.train(train)
        return peft

    @contextlib.contextmanager
    def job_weights(self, job: JobState, grad: bool, summed: bool = False) -> Iterator[None]:
        """A full fine-tuning job's weights in the model for the block, every adapter off (a LoRA
        job: nothing to do). The model's parameters point at the job's float32 masters (cast
        copies on a bfloat16 / float16 engine); with ``grad`` their gradients, added to the
        masters' (micro-batches accumulate), are moved onto the masters after the block. The
        base's own weights are back in the model, untouched, when the block ends.

        On a sharded base the job's shards are copied into the base's shards (the base's kept
        aside), every unit resharded before and after, and each backward's gradients reduced over
        the ranks: ``summed`` where each rank ran its share of the rows, else averaged."""
        if job.lora is not None:
            yield
            return
        pairs = [(self._base_params[key], master) for key, master in job.params.items()]
        held = [local(base).clone() if is_shard(base) else base.data for base, _ in pairs]
        tied = self._tied_head(job)
        held_head = tied[0].data if tied is not None else None
        peft = self.slots.peft
        adapters_off = peft.disable_adapter() if peft is not None else contextlib.nullcontext()
        if self.sharded is not None:
            self.sharded.reshard()
            self.sharded.reduce(summed)
        try:
            with torch.no_grad():
                for base, master in pairs:
                    if is_shard(base):
                        local(base).copy_(master)
                    else:
                        base.data = master.data if master.dtype == base.dtype else master.detach().to(base.dtype)
                    base.requires_grad_(grad)
                if tied is not None:  # the head reads the job's embedding, gathered whole
                    head, key = tied
                    head.data = gather(job.params[key].detach(), self._base_params[key]).to(head.dtype)
                    head.requires_grad_(grad)
            with adapters_off:
                yield
            for base, master in pairs if grad else ():
                if base.grad is None:
                    continue
                _add_gradient(master, local(base.grad))
            if tied is not None and grad:
                self._fold_head_gradient(job, tied, summed)
        finally:
            if self.sharded is not None:
                self.sharded.reshard()
            with torch.no_grad():
                for (base, _), data in zip(pairs, held):
                    if is_shard(base):
                        local(base).copy_(data)
                    else:
                        base.data = data
                    base.grad = None
                    base.requires_grad_(False)
                if tied is not None and held_head is not None:
                    tied[0].data, tied[0].grad = held_head, None
                    tied[0].requires_grad_(False)

    def _tied_head(self, job: JobState) -> tuple[torch.nn.Parameter, str] | None:
        """A full job's lm_head tied to its embedding on a sharded base (the head whole on every
        rank, the embedding split): the head's weight and the embedding's key; else None."""
        if job.lora is not None or self.sharded is None or not getattr(self._base.config, "tie_word_embeddings", False):
            return None
        embedding = cast(Any, self._base).get_input_embeddings().weight
        key = next(k for k, param in self._base_params.items() if param is embedding)
        _, head = causal_lm_parts(self._base)
        return cast(torch.nn.Parameter, head.weight), key

    def _fold_head_gradient(self, job: JobState, tied: tuple[torch.nn.Parameter, str], summed: bool) -> None:
        """The tied head's whole gradient added to the job's embedding shard, as one rank adds the
        two uses of the one weight: summed over the ranks first where each ran its share of the
        rows (every rank calls it: one all-reduce), this rank's own where each ran them all."""
        head, key = tied
        master = job.params[key]
        whole = head.grad.to(master.dtype) if head.grad is not None else torch.zeros_like(head, dtype=master.dtype)
        if summed:
            assert self.split is not None
            self.split.all_reduce(whole)
        _add_gradient(master, shard_of(whole, self._base_params[key]))

    def replicated(self, jobs: Sequence[JobState]) -> list[torch.nn.Parameter]:
        """The jobs' parameters every rank holds whole (a LoRA adapter's; a full job's on a
        sharded base: those of the base's parameters left whole, the lm_head), in order."""
        return [
            param
            for job in jobs
            for key, param in job.params.items()
            if job.lora is not None or not is_shard(self._base_params[key])
        ]

    def _length_order(self, lengths: list[int], spans: list[tuple[int, int]] | None = None) -> list[int] | None:
        """The order the batch's rows are cut in (``length_order``); None: as they come."""
        if not self.options.length_buckets:
            return None
        return length_order(lengths, self.options.micro_batch_rows, self.options.micro_batch_tokens, spans)

    def _micro_batches(
        self, rows: Rows, bounds: list[tuple[int, int]] | None = None
    ) -> Iterator[tuple[int, int, Rows]]:
        """(start, stop, rows[start:stop] trimmed to their longest row) of each micro-batch (as the
        budget cuts them, or at ``bounds``)."""
        if bounds is None:
            bounds = micro_batch_bounds(rows.lengths, self.options.micro_batch_rows, self.options.micro_batch_tokens)
        for start, stop in bounds:
            yield start, stop, slice_rows(rows, start, stop)

    def _passes(
        self, rows: Rows, bounds: list[tuple[int, int]] | None, split: RankSplit | None, jobs: list[JobState]
    ) -> Iterator[tuple[int, int, int, Rows, bool]]:
        """(index, start, stop, rows, null) of each pass this process runs: every micro-batch with a
        trainable token; with ``split``, this rank's of them, then null passes (the first
        micro-batch again, its gradients into the jobs' whole parameters undone, its loss counted
        zero by the caller, so a sharded job's reduce-scatter adds nothing: ``null`` True) until it has run
        as many as every rank."""
        if bounds is None:
            bounds = micro_batch_bounds(rows.lengths, self.options.micro_batch_rows, self.options.micro_batch_tokens)
        kept = [(start, stop) for start, stop in bounds if rows.loss_mask[start:stop].any()]
        for index, null in self.rank_passes(len(kept), split, jobs):
            start, stop = kept[index]
            yield index, start, stop, slice_rows(rows, start, stop), null

    def rank_passes(self, count: int, split: RankSplit | None, jobs: list[JobState]) -> Iterator[tuple[int, bool]]:
        """(index, null) of each of ``count`` micro-batches this process runs: all of them, or with
        ``split`` this rank's share, then null passes (the first micro-batch again, its gradients
        into the jobs' whole parameters undone once the caller resumes, its loss counted zero by
        the caller, so a sharded job's reduce-scatter adds nothing: ``null`` True) until it has
        run as many as every rank."""
        if split is None:
            yield from ((index, False) for index in range(count))
            return
        for index in split.passes(count):
            if index is not None:
                yield index, False
                continue
            held = [(p, p.grad) for p in self.replicated(jobs)]  # a shard's: the other ranks' passes
            for param, grad in held:
                param.grad = None if grad is None else grad.clone()
            yield 0, True
            for param, grad in held:  # the null pass's gradients undone, bit for bit
                param.grad = grad

    def reduce_gradients(self, job: JobState, split: RankSplit | None) -> None:
        """The job's whole parameters' gradients summed over the ranks that split its rows (a
        sharded job's shards were reduced in each backward); nothing without ``split``."""
        if split is not None:
            _reduce_gradients(self.replicated([job]), split)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Autocast to the engine's dtype (bfloat16 / float16 engines); with gradient checkpointing
        and a gradient, the decoder layers themselves (not their submodules: no dropout changes)
        in training mode, which is when transformers checkpoints them."""
        cast = (
            torch.autocast(self.device.type, dtype=self._torch_dtype)
            if self._torch_dtype != torch.float32
            else contextlib.nullcontext()
        )
        if self.options.compile_layers is not None:
            peft = self.slots.peft
            keep_adapters_eager(peft if peft is not None else self._base)
        layers = self.options.checkpointed_layers if torch.is_grad_enabled() else []
        modes = [layer.training for layer in layers]
        for layer in layers:
            layer.training = True
        try:
            with cast:
                yield
        finally:
            for layer, mode in zip(layers, modes):
                layer.training = mode

    def _token_logprobs(
        self, model: torch.nn.Module, part: Rows, entropy: bool = False, packable: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropies) at the micro-batch's loss-mask positions, 0 elsewhere (the
        rows packed with ``pack_rows``, unless the forward is a shared pass's, whose adapters
        take rows, not tokens)."""
        return token_logprobs(
            model,
            part.input_ids,
            part.attention_mask,
            part.loss_mask,
            self.options.logprob_chunk_tokens,
            entropy,
            packed=self.options.pack_rows and packable,
            vocab_block=self.options.logprob_vocab_block,
        )

    # ------------------------------------------------------------ several jobs in one pass

    def groupable(self, job_id: str) -> bool:
        """Whether the job's steps may share a pass with others' (``can_share_pass``)."""
        return can_share_pass(self.slots.job(job_id).lora)

    def train_group(self, steps: list[tuple[str, TrainBatch, TrainHParams]]) -> list[dict[str, float]]:
        """One optimizer step for each (job, batch, hparams), the jobs' rows in shared
        micro-batches; each job's metrics, in order (``seconds``: the group's time). Every job
        must be ``groupable`` and appear once; a single step is ``train_step``'s."""
        started = time.perf_counter()
        if len(steps) == 1:
            return [self.train_step(*steps[0])]
        jobs = [self.slots.job(job_id) for job_id, _, _ in steps]
        if len({job.job_id for job in jobs}) != len(jobs):
            raise BatchError("a group trains each job once")
        for job in jobs:
            if not self.groupable(job.job_id):
                raise BatchError(f"job {job.job_id!r} cannot share a pass (full fine-tuning or LoRA dropout)")
        split = self.split
        metrics = self._group_forward_backward(jobs, [(batch, hp) for _, batch, hp in steps], split)
        if split is not None:
            _reduce_gradients(self.replicated(jobs), split)
        norms = _clip_together([list(job.params.values()) for job in jobs], [hp.max_grad_norm for _, _, hp in steps])
        stepping = []
        for job, (_, _, hp), m, grad_norm in zip(jobs, steps, metrics, norms):
            skipped = not math.isfinite(grad_norm)
            if not skipped:
                _set_optimizer_hparams(job.optimizer, hp)
                stepping.append(job.optimizer)
            m.update(grad_norm=grad_norm, skipped=float(skipped), group=float(len(steps)))
        _step_together(stepping)
        for job in jobs:
            job.optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - started
        for m in metrics:
            m["seconds"] = seconds
        return metrics

    def group_gradients(
        self, steps: list[tuple[str, TrainBatch, TrainHParams]]
    ) -> list[tuple[dict[str, torch.Tensor], dict[str, float]]]:
        """``loss_gradients`` of each job, its rows in a shared pass (for tests and diagnostics)."""
        jobs = [self.slots.job(job_id) for job_id, _, _ in steps]
        metrics = self._group_forward_backward(jobs, [(batch, hp) for _, batch, hp in steps])
        out = []
        for job, m in zip(jobs, metrics):
            out.append(({key: _grad_or_zeros(param) for key, param in job.params.items()}, m))
            job.optimizer.zero_grad(set_to_none=True)
        return out

    def _group_forward_backward(
        self, jobs: list[JobState], work: list[tuple[TrainBatch, TrainHParams]], split: RankSplit | None = None
    ) -> list[dict[str, float]]:
        """Accumulate each job's loss gradient of its batch into its parameters, the rows of all
        in shared micro-batches. Each job's loss weights are its own batch's; a micro-batch's
        backward is of the sum of its jobs' losses, whose gradients reach each job's adapter
        only from its own rows."""
        for batch, hp in work:
            check_batch(batch)
            check_hparams(hp)
        user_losses = [self._user_loss(hp) if hp.loss_fn else None for _, hp in work]
        rows = pad_rows(
            [r for batch, _ in work for r in batch.input_ids],
            [r for batch, _ in work for r in batch.loss_mask],
            self.device,
        )
        spans: list[tuple[int, int]] = []  # each job's rows in the group
        olds, weights, tokens = [], [], []
        at = 0
        for batch, hp in work:
            n = len(batch.input_ids)
            own = Rows(rows.input_ids[at : at + n], rows.attention_mask[at : at + n], rows.loss_mask[at : at + n], [])
            olds.append(pad_old_logprobs(batch.old_logprobs, own))
            weights.append(aggregation_weights(own.loss_mask, hp.loss_agg, hp.loss_agg_len))
            tokens.append(int(own.loss_mask.sum().item()))
            spans.append((at, at + n))
            at += n
        for job, count in zip(jobs, tokens):
            if count == 0:
                raise BatchError(f"job {job.job_id!r}: batch has no trainable token (loss_mask is all 0)")
        old_all, weight_all = torch.cat(olds), torch.cat(weights)
        advantages = torch.tensor(
            [a for batch, _ in work for a in batch.advantages], dtype=torch.float32, device=self.device
        )
        order = self._length_order(rows.lengths, spans)  # each job's rows stay within its span
        bounds = None
        if order is None:
            pass_cost = pass_cost_tokens(self.device.type)
            budget = (self.options.micro_batch_rows, self.options.micro_batch_tokens)
            cut = quantile_passes([rows.lengths[a:b] for a, b in spans], *budget, pass_cost)
            order, bounds = cut if cut is not None else (None, None)
        owners = [i for i, (a, b) in enumerate(spans) for _ in range(a, b)]  # each row's job
        if order is not None:
            owners = [owners[j] for j in order]
            rows = permute_rows(rows, order)
            old_all, weight_all, advantages = (t[order] for t in (old_all, weight_all, advantages))
        kept = [MetricSums() for _ in jobs]
        peft = self.slots.peft
        assert peft is not None
        for job in jobs:
            job.optimizer.zero_grad(set_to_none=True)
        peft.train(False)
        any_kl = any(hp.kl_coef > 0 for _, hp in work)
        one_loss = all(u is None for u in user_losses) and len({_loss_key(hp) for _, hp in work}) == 1
        shared = (old_all, weight_all, advantages)
        for _, start, stop, part, null in self._passes(rows, bounds, split, jobs):
            sums = [MetricSums() for _ in jobs] if null else kept  # metrics of a null pass go nowhere
            width = part.loss_mask.shape[1]
            ref = self._base_logprobs(part) if any_kl else None
            runs = _runs(owners, start, stop)  # (job, lo, hi): its rows in the micro-batch
            segments = [(jobs[i].adapter_name, hi - lo) for i, lo, hi in runs]
            with _segment_adapters(peft, segments):
                for job in jobs:  # trainable (after the layers' set_adapter, which turns every adapter off)
                    for param in job.params.values():
                        param.requires_grad_(True)
                with self.forward_context():
                    logp, entropy = self._token_logprobs(peft, part, entropy=True, packable=False)
                assert entropy is not None
                if one_loss:  # every job's token loss is the same function: one over all the rows
                    whole = self._shared_loss(work[0][1], logp, entropy, ref, part, owners, (start, stop), sums, shared)
                    whole.backward()
                    continue
                total: torch.Tensor | None = None
                for i, lo, hi in runs:
                    seg, hp = slice(lo - start, hi - start), work[i][1]
                    mask, w = part.loss_mask[seg], weight_all[lo:hi, :width]
                    old, adv = old_all[lo:hi, :width], advantages[lo:hi]
                    seg_ref = ref[seg] if ref is not None and hp.kl_coef > 0 else None
                    terms = _token_terms(user_losses[i], hp, logp[seg], old, seg_ref, adv, mask)
                    loss = (terms.loss * w).sum()
                    sums[i].add(mask, w, terms, loss, entropy[seg])
                    total = loss if total is None else total + loss
                assert total is not None
                total.backward()
        if split is not None:
            for s in kept:
                s.all_reduce(split.all_reduce, self.device)
        return [s.metrics(n) for s, n in zip(kept, tokens)]

    def _shared_loss(
        self,
        hp: TrainHParams,
        logp: torch.Tensor,
        entropy: torch.Tensor,
        ref: torch.Tensor | None,
        part: Rows,
        owners: list[int],
        bounds: tuple[int, int],
        sums: list[MetricSums],
        shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """The micro-batch's loss (rows ``bounds`` of the group) when every job's token loss is
        the same function of its rows: the token terms of all rows at once, weighted by each row's
        own job's weights, so each job's gradient is the one its own rows give; each job's metrics
        are sums over its rows."""
        (start, stop), width = bounds, part.loss_mask.shape[1]
        old_all, weight_all, advantages = shared
        mask, w = part.loss_mask, weight_all[start:stop, :width]
        ref = ref if hp.kl_coef > 0 else None
        terms = _token_terms(None, hp, logp, old_all[start:stop, :width], ref, advantages[start:stop], mask)
        weighted = terms.loss * w
        owner = torch.tensor(owners[start:stop], dtype=torch.long, device=logp.device)  # each row's job
        with torch.no_grad():
            zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
            per_row = torch.stack(
                [
                    weighted.sum(1),
                    (terms.pg * w).sum(1),
                    torch.where(mask, terms.kl, zero).sum(1),
                    (terms.clipped & mask).sum(1).to(logp.dtype),
                    torch.where(mask, terms.ratio, zero).sum(1),
                    torch.where(mask, entropy, zero).sum(1),
                ]
            )
            per_job = per_row.new_zeros((per_row.shape[0], len(sums))).index_add_(1, owner, per_row)
        for job_sums, values in zip(sums, per_job.t().tolist()):  # one device sync per micro-batch
            job_sums.add_values(values)
        return weighted.sum()

    def _base_logprobs(self, part: Rows) -> torch.Tensor:
        """Log-probs of the micro-batch under the base model (every adapter off), no gradient."""
        peft = self.slots.peft
        assert peft is not None
        with torch.no_grad(), peft.disable_adapter(), self.forward_context():
            return self._token_logprobs(peft, part)[0]

    # ------------------------------------------------------------ internals: the loss

    def _forward_backward(
        self, job: JobState, batch: TrainBatch, hp: TrainHParams, split: RankSplit | None = None
    ) -> dict[str, float]:
        """Accumulate the GRPO loss gradient of ``batch`` into the job's parameters (``split``:
        this rank's micro-batches of it, the metrics summed over the ranks)."""
        check_batch(batch)
        check_hparams(hp)
        user_loss = self._user_loss(hp) if hp.loss_fn else None
        rows = pad_rows(batch.input_ids, batch.loss_mask, self.device)
        old_logprobs = pad_old_logprobs(batch.old_logprobs, rows)
        advantages = torch.tensor(batch.advantages, dtype=torch.float32, device=self.device)
        weights = aggregation_weights(rows.loss_mask, hp.loss_agg, hp.loss_agg_len)
        tokens = int(rows.loss_mask.sum().item())
        if tokens == 0:
            raise BatchError("batch has no trainable token (loss_mask is all 0 after the first column)")
        order = self._length_order(rows.lengths)  # after the weights: they are the batch's, row for row
        if order is not None:
            rows = permute_rows(rows, order)
            old_logprobs, advantages, weights = (t[order] for t in (old_logprobs, advantages, weights))
        job.optimizer.zero_grad(set_to_none=True)
        sums = MetricSums()
        with self.job_rng(job) as masks:
            for index, start, stop, part, null in self._passes(rows, None, split, [job]):
                masks(index)
                width = part.loss_mask.shape[1]
                self._accumulate_micro_batch(
                    job,
                    part,
                    old_logprobs[start:stop, :width],
                    advantages[start:stop],
                    weights[start:stop, :width],
                    hp,
                    MetricSums() if null else sums,  # metrics of a null pass go nowhere
                    user_loss,
                    summed=split is not None,
                    null=null,
                )
        if split is not None:
            sums.all_reduce(split.all_reduce, self.device)
        return sums.metrics(tokens)

    def _accumulate_micro_batch(
        self,
        job: JobState,
        part: Rows,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        weights: torch.Tensor,
        hp: TrainHParams,
        sums: MetricSums,
        user_loss: Callable[..., torch.Tensor] | None = None,
        summed: bool = False,
        null: bool = False,
    ) -> None:
        """The micro-batch's loss gradient into the job's parameters (``summed``: over the ranks
        that split the step; ``null``: a null pass, whose loss counts zero: the reduce-scatter of a
        sharded job's gradients then adds nothing to the other ranks')."""
        ref_logprobs = self._reference_logprobs(job, part) if hp.kl_coef > 0 else None
        model = self.activate(job, train=job.lora is not None and job.lora.dropout > 0)
        fused = fused_lora_a(model, job.adapter_name) if self.options.fuse_lora and job.lora is not None else None
        with (
            self.job_weights(job, grad=True, summed=summed),  # the backward too: gradients reach the job's weights
            fused or contextlib.nullcontext(),
            self._low_precision_inputs(model, job),
        ):
            with self.forward_context():
                logp, entropy = self._token_logprobs(model, part, entropy=True)
            assert entropy is not None
            terms = _token_terms(user_loss, hp, logp, old_logprobs, ref_logprobs, advantages, part.loss_mask)
            loss = (terms.loss * weights).sum()
            (loss * 0.0 if null else loss).backward()
        sums.add(part.loss_mask, weights, terms, loss, entropy)

    def _low_precision_inputs(self, model: torch.nn.Module, job: JobState) -> contextlib.AbstractContextManager[Any]:
        """On a bfloat16 / float16 engine, the job's LoRA layers take their input as it comes
        instead of an fp32 copy for their fp32 masters (autocast runs their matmuls in the
        engine's dtype either way: the same bits, one copy of each input less). Not with LoRA
        dropout, whose mask would then scale the input in the lower precision."""
        if self._torch_dtype == torch.float32 or job.lora is None or job.lora.dropout > 0:
            return contextlib.nullcontext()
        return disable_input_dtype_casting(model)

    def _user_loss(self, hp: TrainHParams) -> Callable[..., torch.Tensor]:
        """The trusted user's ``loss_fn``, imported once per (target, path)."""
        if not hp.user_code_trusted:
            raise UntrustedCodeError(
                f"custom loss `{hp.loss_fn}` refused: this cluster does not trust the job's submitter with "
                "code in the trainer (plexctl up --trust-user-code USER)"
            )
        key = (hp.loss_fn, hp.loss_path)
        if key not in self._user_losses:
            self._user_losses[key] = import_object(hp.loss_fn, hp.loss_path or None, "loss fn", LossLoadError)
        return self._user_losses[key]

    def _reference_logprobs(self, job: JobState, part: Rows) -> torch.Tensor:
        """Log-probs under the base model (every adapter disabled), no gradient."""
        model = self.activate(job, train=False)
        adapters_off = model.disable_adapter() if isinstance(model, PeftModel) else contextlib.nullcontext()
        with torch.no_grad(), adapters_off, self.forward_context():
            return self._token_logprobs(model, part)[0]

    def clip_gradients(self, job: JobState, max_grad_norm: float) -> float:
        """The job's gradients scaled to a norm of at most ``max_grad_norm`` (<= 0: no limit); the
        norm before. A full job on a sharded base: the norm of the whole gradient, its shards'
        squares summed over the ranks."""
        max_norm = max_grad_norm if max_grad_norm > 0 else math.inf
        params = list(job.params.values())
        shards = [p for key, p in job.params.items() if job.lora is None and is_shard(self._base_params[key])]
        if not shards:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm).item())
        assert self.split is not None
        cut = {id(p) for p in shards}
        whole = [p for p in params if id(p) not in cut]
        squares = torch.stack([_grad_or_zeros(p).double().square().sum() for p in shards]).sum().reshape(1)
        self.split.all_reduce(squares)
        squares += sum((_grad_or_zeros(p).double().square().sum() for p in whole), torch.zeros((), dtype=torch.float64))
        norm = float(squares.sqrt().item())
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for param in params:
                if param.grad is not None:
                    param.grad.mul_(coef)
        return norm

    # ------------------------------------------------------------ internals: randomness

    @contextlib.contextmanager
    def job_rng(self, job: JobState) -> Iterator[Callable[..., None]]:
        """A step of the job on its own RNG stream (only LoRA dropout consumes it): the stream
        gives the step one seed, and the block's ``masks(*where)`` seeds the global RNG for one
        micro-batch (``where``: its index, within the step's call if it has several) from that seed
        and ``where`` alone. So a micro-batch draws the same dropout masks whichever rank runs it,
        at any width, and the stream moves on by one draw a step."""
        if job.lora is None or job.lora.dropout <= 0:
            yield _no_masks
            return
        with forked_rng(self.device):
            torch.set_rng_state(job.rng_state["cpu"].clone())  # a view into the slot would not do
            if "cuda" in job.rng_state:
                torch.cuda.set_rng_state(job.rng_state["cuda"].clone(), self.device)
            step_seed = int(torch.randint(0, 1 << 62, (1,)).item())
            store_rng(job.rng_state, capture_rng(self.device))
            device = self.device

            def masks(*where: int) -> None:
                seed = step_seed
                for k in where:
                    seed = (seed * 1_000_003 + k + 1) % (1 << 63)
                torch.random.default_generator.manual_seed(seed)
                if device.type == "cuda":
                    torch.cuda.default_generators[device.index or 0].manual_seed(seed)

            yield masks


def _no_masks(*where: int) -> None:
    """A job without dropout draws no masks."""


def _add_gradient(master: torch.Tensor, part: torch.Tensor) -> None:
    """``part`` added to ``master``'s gradient (micro-batches accumulate), in its dtype."""
    part = part if part.dtype == master.dtype else part.to(master.dtype)
    if master.grad is None:
        master.grad = part
    else:
        master.grad += part


def _token_terms(
    user_loss: Callable[..., torch.Tensor] | None,
    hp: TrainHParams,
    logp: torch.Tensor,
    old: torch.Tensor,
    ref: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
) -> TokenTerms:
    """The per-token loss terms the call names: its user's loss, else its named loss's function
    (``plexctl.common.losses.LOSS_REGISTRY``)."""
    if user_loss is not None:
        return user_token_terms(user_loss, hp, logp, old, ref, advantages, mask)
    terms: TokenTerms = loss_function(hp.loss)(logp, old, ref, advantages, hp)
    return terms


@contextlib.contextmanager
def _segment_adapters(model: torch.nn.Module, segments: list[tuple[str, int]]) -> Iterator[None]:
    """The forwards in the block (and their recomputation in a checkpointed backward) take each
    segment of rows, in order (``(adapter, rows)``), through its own adapter: every LoRA layer
    runs its base layer alone over all rows, and a hook adds the segments' low-rank products.
    Where the segments are of one size and their adapters of one shape in a layer, their
    weights are stacked and two batched matmuls serve every segment (a few ops per layer
    whatever the number of jobs); else each segment's product over its rows (one split and one
    cat). Linear LoRA layers only. Each layer's own active adapter is off meanwhile;
    ``activate`` sets it again."""
    sizes = [rows for _, rows in segments]
    names = [name for name, _ in segments]
    even = len(set(sizes)) == 1 and len(sizes) > 1

    def add_segments(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
        if even and all(name in module.lora_A for name in names):
            a_weights = [module.lora_A[name].weight for name in names]
            b_weights = [module.lora_B[name].weight for name in names]
            if len({w.shape for w in a_weights}) == 1 and len({w.shape for w in b_weights}) == 1:
                x = args[0].to(a_weights[0].dtype)
                scale = torch.tensor([module.scaling[name] for name in names], dtype=x.dtype, device=x.device)
                per_job = x.reshape(len(names), -1, x.shape[-1])  # [jobs, their rows x tokens, in]
                low = torch.bmm(per_job, torch.stack(a_weights).transpose(1, 2))
                up = torch.bmm(low, (torch.stack(b_weights) * scale[:, None, None]).transpose(1, 2))  # scaled weights
                return output + up.reshape(output.shape).to(output.dtype)
        deltas = []
        for name, part in zip(names, args[0].split(sizes)):
            if name not in module.lora_A:
                if name in getattr(module, "lora_embedding_A", {}):
                    raise BatchError(f"adapter {name!r} has an embedding layer: it cannot share a pass")
                deltas.append(output.new_zeros((part.shape[0], *output.shape[1:])))
                continue
            lora_a, lora_b = module.lora_A[name], module.lora_B[name]
            x = module.lora_dropout[name](part.to(lora_a.weight.dtype))
            deltas.append(lora_b(lora_a(x)) * module.scaling[name])
        return output + torch.cat(deltas).to(output.dtype)

    layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    handles = []
    try:
        for layer in layers:
            layer.set_adapter([])  # the base layer's output alone; the hook adds the segments'
            handles.append(layer.register_forward_hook(add_segments))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _clip_together(groups: list[list[torch.nn.Parameter]], max_norms: list[float]) -> list[float]:
    """``clip_grad_norm_`` of each group of parameters to its own max norm (0: no clipping), in
    one pass of multi-tensor kernels over all of them: each group's total 2-norm before clipping,
    and its gradients scaled by ``min(1, max / (norm + 1e-6))``, as ``clip_grad_norm_`` does."""
    grads = [[p.grad for p in group if p.grad is not None] for group in groups]
    flat = [g for group in grads for g in group]
    if not flat:
        return [0.0] * len(groups)
    norms = torch._foreach_norm(flat, 2.0)
    zero = torch.zeros((), dtype=norms[0].dtype, device=norms[0].device)
    totals, at = [], 0
    for group in grads:
        own = norms[at : at + len(group)]
        totals.append(torch.linalg.vector_norm(torch.stack(own), 2.0) if own else zero)
        at += len(group)
    total = torch.stack(totals)
    limits = torch.tensor([m if m > 0 else math.inf for m in max_norms], dtype=total.dtype, device=total.device)
    coefs = torch.clamp(limits / (total + 1e-6), max=1.0)
    torch._foreach_mul_(flat, [coefs[i] for i, group in enumerate(grads) for _ in group])
    return [float(n) for n in total.tolist()]


def _step_together(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """``step()`` of each optimizer; AdamWs of one parameter group each and equal settings in one
    multi-tensor pass over all their parameters. Each tensor gets the update its own optimizer's
    ``step()`` gives (the same kernels, tensor by tensor, its own step count): bit for bit."""
    batches: dict[tuple[Any, ...], list[torch.optim.Optimizer]] = {}
    for opt in optimizers:
        group = opt.param_groups[0]
        plain = (
            type(opt) is torch.optim.AdamW
            and len(opt.param_groups) == 1
            and group.get("foreach")
            and not any(group.get(k) for k in ("amsgrad", "maximize", "capturable", "differentiable", "fused"))
            and all("exp_avg" in opt.state.get(p, {}) for p in group["params"])  # its state made already
        )
        if not plain:
            opt.step()
            continue
        key = tuple(sorted((k, repr(v)) for k, v in group.items() if k != "params"))
        batches.setdefault(key, []).append(opt)
    for same in batches.values():
        params, grads, avgs, squares, counts = [], [], [], [], []
        for opt in same:
            for p in opt.param_groups[0]["params"]:
                if p.grad is not None:
                    state = opt.state[p]
                    params.append(p)
                    grads.append(p.grad)
                    avgs.append(state["exp_avg"])
                    squares.append(state["exp_avg_sq"])
                    counts.append(state["step"])
        group = same[0].param_groups[0]
        with torch.no_grad():
            adam(
                params,
                grads,
                avgs,
                squares,
                [],
                counts,
                foreach=True,
                decoupled_weight_decay=True,
                amsgrad=False,
                beta1=group["betas"][0],
                beta2=group["betas"][1],
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )


def pass_cost_tokens(device_type: str) -> int:
    """What one more forward/backward costs on this device, in padded tokens (``quantile_passes``)."""
    return ENGINE_DEFAULTS["cuda" if device_type == "cuda" else "cpu"].pass_cost_tokens


def _runs(owners: list[int], start: int, stop: int) -> list[tuple[int, int, int]]:
    """``(owner, lo, hi)`` of each run of rows of one owner in ``owners[start:stop]``."""
    runs: list[tuple[int, int, int]] = []
    for at in range(start, stop):
        if runs and runs[-1][0] == owners[at]:
            runs[-1] = (owners[at], runs[-1][1], at + 1)
        else:
            runs.append((owners[at], at, at + 1))
    return runs


def _loss_key(hp: TrainHParams) -> tuple[Any, ...]:
    """What a job's token loss depends on (its optimizer settings and aggregation aside)."""
    return (hp.loss, hp.clip_low, hp.clip_high, hp.kl_coef, tuple(sorted(hp.loss_params.items())), hp.loss_fn)


def _reduce_gradients(params: Sequence[torch.nn.Parameter], split: RankSplit) -> None:
    """The parameters' gradients summed over the ranks, in one collective; a parameter no pass
    of this rank reached counts zeros."""
    if not params:
        return
    flat = torch.cat([_grad_or_zeros(param).reshape(-1) for param in params])
    split.all_reduce(flat)
    at = 0
    for param in params:
        param.grad = flat[at : at + param.numel()].view_as(param).clone()
        at += param.numel()


def _grad_or_zeros(param: torch.nn.Parameter) -> torch.Tensor:
    return param.grad.detach().clone() if param.grad is not None else torch.zeros_like(param)


def _set_optimizer_hparams(optimizer: torch.optim.Optimizer, hp: TrainHParams) -> None:
    for group in optimizer.param_groups:
        group["lr"] = hp.lr
        group["weight_decay"] = hp.weight_decay
