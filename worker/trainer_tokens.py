"""A trainer engine's token-level loss calls, as the Tinker API defines them: ``forward_backward``
(each datum's log-probs of its target tokens and its loss, nothing changed) and ``optim_step``
(the summed gradient of the loss calls since the last step, then one AdamW step). The losses
and the checks of a call live in ``worker.tinker_losses``.

How a call runs: as ``train_step`` does (``worker.trainer_math``), on the job's adapter (or a
full fine-tuning job's weights) alone, in micro-batches of at most ``micro_batch_rows`` rows and
``micro_batch_tokens`` padded tokens, under the engine's forward context (autocast on a
bfloat16 / float16 engine), the lm_head's log-softmax ``logprob_chunk_tokens`` positions at a
time; an ``optim_step`` of a job with LoRA dropout on the job's own RNG stream, a
``forward_backward`` in eval mode (no dropout, no RNG drawn). On an engine of several ranks a
call's micro-batches split among them as a step's do (``TrainingMath.rank_passes``), each
datum's results gathered from the rank that computed them.

Invariants. A datum's log-probs and loss are a function of the datum and the job's weights
alone, bit for bit on CPU, whichever other data share its call or micro-batch: each datum is
right-padded to a width fixed by its own length (``padded_width``), always with at least one pad
column (so attention always takes the padding-mask path), a micro-batch holds data of one width
only, and the lm_head runs on each datum's own positions. What the other data change is only
the order in which the gradient's float sum adds the data's parts. So a
job learns exactly what it learns alone, as with ``train_step``; on GPU this additionally needs
kernels that do not depend on the batch size. ``forward_backward`` leaves no gradient and no
state change; ``optim_step``'s AdamW settings apply to its own step only (the job's AdamW keeps
its own hyper-parameters for ``train_step``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch

from plexctl.common.calls import (
    AdamStep,
    ForwardBackwardResult,
    LossCall,
    OptimStepResult,
    TokenDatum,
)
from worker.errors import BatchError
from worker.tinker_losses import LossInputs, check_call, loss_config, token_loss, token_loss_entry
from worker.token_logprobs import causal_lm_parts, head_logprobs
from worker.train_batches import PAD_ID, micro_batch_bounds
from worker.trainer_math import PassOptions, RankSplit, TrainingMath
from worker.trainer_slots import JobSlots, JobState

MIN_PADDED_WIDTH = 16  # the narrowest padded datum; wider ones grow by an eighth of a power of two


def padded_width(length: int, max_tokens: int | None = None, max_positions: int | None = None) -> int:
    """The width a datum of ``length`` tokens is padded to: at least ``length + 1`` (one pad
    column), rounded up to a multiple of 16 or of an eighth of the next power of two (at most a
    quarter more), but not beyond ``max_tokens`` (a micro-batch's budget) or ``max_positions``
    (the model's) where the datum itself fits them."""
    needed = length + 1
    step = max(MIN_PADDED_WIDTH, 1 << max(0, (needed - 1).bit_length() - 3))
    width = -(-needed // step) * step
    if max_tokens is not None:
        width = min(width, max(needed, max_tokens))
    if max_positions is not None:
        width = min(width, max(length, max_positions))
    return width


@dataclass(frozen=True)
class TokenRows:
    """Data of one padded width, right-padded: ``targets`` column t + 1 holds the target of
    position t (how ``head_logprobs`` reads its targets), ``inputs`` the loss inputs the call's
    loss reads, ``[B, width]`` each (0 past a datum's length)."""

    indices: list[int]  # of the data in their call
    lengths: list[int]
    input_ids: torch.Tensor  # [B, W] long
    attention_mask: torch.Tensor  # [B, W] long
    targets: torch.Tensor  # [B, W + 1] long
    inputs: LossInputs

    def row_inputs(self, row: int) -> LossInputs:
        n = self.lengths[row]

        return self.inputs.map(lambda tensor: tensor[row, :n])


def token_micro_batches(
    data: list[TokenDatum],
    loss_fn: str,
    device: torch.device,
    max_rows: int | None = None,
    max_tokens: int | None = None,
    max_positions: int | None = None,
) -> Iterator[TokenRows]:
    """The call's data in micro-batches: grouped by padded width (narrowest first, in call order
    within a width), each group cut as ``micro_batch_bounds`` cuts a batch."""
    widths = [padded_width(len(d.tokens), max_tokens, max_positions) for d in data]
    groups: dict[int, list[int]] = {}
    for i in sorted(range(len(data)), key=lambda i: (widths[i], i)):
        groups.setdefault(widths[i], []).append(i)
    needs = token_loss_entry(loss_fn).reads
    for width, members in groups.items():
        for start, stop in micro_batch_bounds([width] * len(members), max_rows, max_tokens):
            yield _pad_data(data, members[start:stop], width, needs, device)


def _pad_data(
    data: list[TokenDatum], indices: list[int], width: int, needs: tuple[str, ...], device: torch.device
) -> TokenRows:
    rows = len(indices)
    ids = torch.full((rows, width), PAD_ID, dtype=torch.long)
    attention = torch.zeros((rows, width), dtype=torch.long)
    targets = torch.full((rows, width + 1), PAD_ID, dtype=torch.long)
    floats = {name: torch.zeros((rows, width), dtype=torch.float32) for name in needs}
    lengths = []
    for row, i in enumerate(indices):
        datum = data[i]
        n = len(datum.tokens)
        lengths.append(n)
        ids[row, :n] = torch.tensor(datum.tokens, dtype=torch.long)
        attention[row, :n] = 1
        targets[row, 1 : n + 1] = torch.tensor(datum.target_tokens, dtype=torch.long)
        for name, tensor in floats.items():
            tensor[row, :n] = torch.tensor(getattr(datum, name), dtype=torch.float32)
    inputs = LossInputs(**floats).map(lambda tensor: tensor.to(device))
    return TokenRows(indices, lengths, ids.to(device), attention.to(device), targets.to(device), inputs)


def check_adam(adam: AdamStep) -> None:
    """Refuse AdamW settings torch would refuse or that make NaNs (``BatchError``, one line)."""
    limits = (
        ("learning_rate", adam.learning_rate, adam.learning_rate >= 0),
        ("beta1", adam.beta1, 0 <= adam.beta1 < 1),
        ("beta2", adam.beta2, 0 <= adam.beta2 < 1),
        ("eps", adam.eps, adam.eps > 0),
        ("weight_decay", adam.weight_decay, adam.weight_decay >= 0),
        ("grad_clip_norm", adam.grad_clip_norm, adam.grad_clip_norm >= 0),
    )
    for name, value, ok in limits:
        if not (ok and math.isfinite(value)):
            wanted = {"beta1": "in [0, 1)", "beta2": "in [0, 1)", "eps": "> 0"}.get(name, ">= 0")
            raise BatchError(f"adam.{name} must be finite and {wanted}, got {value}")


class TokenLosses:
    """``forward_backward`` and ``optim_step`` on the resident jobs of ``slots`` (the Tinker API's
    token-level losses), each job's pass run as ``math`` runs it (``TrainingMath.activate``,
    ``job_weights``, ``forward_context``, ``job_rng``); it owns no state of its own."""

    def __init__(
        self, slots: JobSlots, math: TrainingMath, base: torch.nn.Module, options: PassOptions, device: torch.device
    ) -> None:
        """``base``: the model (its vocabulary and positions bound a call's tokens)."""
        self.slots = slots
        self.math = math
        self.options = options
        self.device = device
        self._base = base

    def forward_backward(self, job_id: str, call: LossCall) -> ForwardBackwardResult:
        """Each datum's log-probs of its ``target_tokens`` (position i given ``tokens[: i + 1]``)
        and the loss's sum over tokens and data, in eval mode; nothing changes (no gradient, no
        RNG drawn, no optimizer state)."""
        job = self.slots.job(job_id)
        check_call(call, self._vocab_size())
        config = loss_config(call.loss_fn, call.loss_fn_config)
        model = self.math.activate(job, train=False)
        split = self.math.split
        parts = list(self._token_micro_batches(call))
        found = _DataSums(call, self.device)
        with torch.no_grad(), self.math.job_weights(job, grad=False):
            for index, null in self.math.rank_passes(len(parts), split, [job]):
                part = parts[index]
                with self.math.forward_context():
                    logps = self._target_logprobs(model, part)
                if not null:
                    terms = [token_loss(call.loss_fn, config, lp, part.row_inputs(row)) for row, lp in enumerate(logps)]
                    found.put(part.indices, logps, torch.stack(terms))
        logprobs, losses = found.gathered(split)
        return ForwardBackwardResult(logprobs=logprobs, loss=sum(losses))

    def optim_step(self, job_id: str, calls: list[LossCall], adam: AdamStep) -> OptimStepResult:
        """The gradient of the sum of ``calls``' losses (in order), its global norm clipped to
        ``adam.grad_clip_norm`` (0: not clipped), then one AdamW step with ``adam``'s settings.
        A non-finite gradient norm skips the update (``skipped:max`` 1). Every call is checked
        before anything changes."""
        started = time.perf_counter()
        job = self.slots.job(job_id)
        check_adam(adam)
        if not calls:
            raise BatchError("optim_step has no loss calls (the forward_backward calls since the last step)")
        vocab_size = self._vocab_size()
        for k, call in enumerate(calls):
            try:
                check_call(call, vocab_size)
            except BatchError as exc:
                raise BatchError(f"calls[{k}]: {exc}") from None
        job.optimizer.zero_grad(set_to_none=True)
        try:
            losses: list[float] = []
            with self.math.job_rng(job) as masks:
                for k, call in enumerate(calls):
                    losses.extend(self._accumulate_call(job, call, functools.partial(masks, k)))
            self.math.reduce_gradients(job, self.math.split)
            grad_norm = self.math.clip_gradients(job, adam.grad_clip_norm)
            skipped = not math.isfinite(grad_norm)
            if not skipped:
                with _adam_settings(job.optimizer, adam):
                    job.optimizer.step()
        finally:
            job.optimizer.zero_grad(set_to_none=True)
        return OptimStepResult(
            metrics={
                "loss:sum": sum(losses),
                "tokens:sum": float(sum(len(d.tokens) for call in calls for d in call.data)),
                "data:sum": float(len(losses)),
                "grad_norm:mean": grad_norm,
                "skipped:max": float(skipped),
                "seconds:sum": time.perf_counter() - started,
            }
        )

    # ------------------------------------------------------------ internals

    def _accumulate_call(self, job: JobState, call: LossCall, masks: Callable[[int], None]) -> list[float]:
        """Add the gradient of the call's loss to the job's parameters (on several ranks, this
        rank's share of its micro-batches: ``optim_step`` sums the gradients); each datum's loss.
        ``masks(index)`` seeds a micro-batch's dropout (``TrainingMath.job_rng``)."""
        config = loss_config(call.loss_fn, call.loss_fn_config)
        model = self.math.activate(job, train=job.lora is not None and job.lora.dropout > 0)
        split = self.math.split
        parts = list(self._token_micro_batches(call))
        found = _DataSums(call, self.device)
        for index, null in self.math.rank_passes(len(parts), split, [job]):
            part = parts[index]
            masks(index)
            # the backward too: gradients reach the job's weights (a shard's summed over the ranks that split)
            with self.math.job_weights(job, grad=True, summed=split is not None):
                with self.math.forward_context():
                    logps = self._target_logprobs(model, part)
                terms = torch.stack(
                    [token_loss(call.loss_fn, config, logp, part.row_inputs(row)) for row, logp in enumerate(logps)]
                )
                (terms.sum() * 0.0 if null else terms.sum()).backward()
            if not null:
                found.put(part.indices, [], terms.detach())
        return found.gathered(split)[1]

    def _token_micro_batches(self, call: LossCall) -> Iterator[TokenRows]:
        max_positions = getattr(cast(Any, self._base).config, "max_position_embeddings", None)
        budget = (self.options.micro_batch_rows, self.options.micro_batch_tokens)
        return token_micro_batches(call.data, call.loss_fn, self.device, *budget, max_positions)

    def _target_logprobs(self, model: torch.nn.Module, part: TokenRows) -> list[torch.Tensor]:
        """Each datum's log p(target of position t | tokens <= t), float32 ``[len(tokens)]``, with
        the gradient when grad mode is on. The decoder runs on the micro-batch, the lm_head on
        each datum's own positions: a matrix product's rows can depend on how many rows it has
        (small ones take other kernels), and a datum's own count is the one fixed by itself."""
        decoder, head = causal_lm_parts(model)
        hidden = decoder(
            input_ids=part.input_ids, attention_mask=part.attention_mask, use_cache=False
        ).last_hidden_state
        logps = []
        for row, n in enumerate(part.lengths):
            positions = torch.ones((1, n), dtype=torch.bool, device=hidden.device)
            targets = part.targets[row : row + 1, : n + 1]
            chunk = self.options.logprob_chunk_tokens
            logp, _ = head_logprobs(hidden[row : row + 1, :n], head, targets, positions, chunk)
            logps.append(logp[0])
        return logps

    def _vocab_size(self) -> int:
        """Token ids the model takes in and predicts: the smaller of its embedding's and lm_head's."""
        base = cast(Any, self._base)
        return min(int(base.get_input_embeddings().weight.shape[0]), int(base.get_output_embeddings().weight.shape[0]))


class _DataSums:
    """A call's per-datum results as its passes find them, each rank its own data's (zeros
    elsewhere), then every rank's summed (``gathered``): a sum with zeros adds nothing, so each
    value is the one rank's that computed it, bit for bit."""

    def __init__(self, call: LossCall, device: torch.device) -> None:
        self.lengths = [len(d.tokens) for d in call.data]
        self.starts = [0, *itertools.accumulate(self.lengths)][:-1]
        self.logprobs = torch.zeros(sum(self.lengths), dtype=torch.float32, device=device)
        self.losses = torch.zeros(len(call.data), dtype=torch.float64, device=device)

    def put(self, indices: list[int], logprobs: list[torch.Tensor], losses: torch.Tensor) -> None:
        for i, logp in zip(indices, logprobs):
            self.logprobs[self.starts[i] : self.starts[i] + self.lengths[i]] = logp.detach().float()
        self.losses[indices] = losses.detach().double()

    def gathered(self, split: RankSplit | None) -> tuple[list[list[float]], list[float]]:
        if split is not None:
            split.all_reduce(self.logprobs)
            split.all_reduce(self.losses)
        flat = self.logprobs.cpu().split(self.lengths)
        return [part.tolist() for part in flat], self.losses.cpu().tolist()


@contextlib.contextmanager
def _adam_settings(optimizer: torch.optim.Optimizer, adam: AdamStep) -> Iterator[None]:
    """The optimizer's param groups set to ``adam``'s settings for the block, then back."""
    keys = ("lr", "betas", "eps", "weight_decay")
    kept = [{key: group[key] for key in keys} for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group.update(
            lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps, weight_decay=adam.weight_decay
        )
    try:
        yield
    finally:
        for group, values in zip(optimizer.param_groups, kept):
            group.update(values)
