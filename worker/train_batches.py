"""A training batch's checks and its tensors: the token rows a ``train_step`` (or ``logprobs``)
gets, checked one by one with a one-line ``BatchError`` naming the row, right-padded into
tensors with the loss mask shifted onto the logits that predict each token, and cut into
micro-batches trimmed to their own longest row.

``micro_batch_bounds`` cuts a batch, rows in order, into micro-batches of at most so many rows
and so many padded tokens (rows x the micro-batch's longest row); pure, tested without a model.
``length_order`` is the order that buckets rows by length before the cut (longest first,
stable, within each span of rows that must stay together), so a micro-batch pads only to its
own longest row; ``permute_rows`` applies it, and the caller puts per-row results back.
Whether a micro-batch's activations are checkpointed is the memory plan's decision
(``plexctl.common.memplan.worker_step``), not this module's."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from plexctl.common.losses import LossConfigError, loss_of
from plexctl.common.protocol import LOSS_AGGREGATIONS, LOSSES, TrainBatch, TrainHParams
from worker.errors import BatchError

PAD_ID = 0


@dataclass(frozen=True)
class Rows:
    """Rows right-padded to one length, with targets aligned to the logits that predict them.

    ``loss_mask`` / ``old_logprobs`` have one column less than ``input_ids``: column t refers
    to token t + 1, predicted by the logits at position t.
    """

    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    loss_mask: torch.Tensor  # [B, L-1] bool
    lengths: list[int]


def check_token_rows(input_ids: list[list[int]], loss_mask: list[list[int]]) -> None:
    if not input_ids:
        raise BatchError("batch has no rows")
    if len(loss_mask) != len(input_ids):
        raise BatchError(f"loss_mask has {len(loss_mask)} rows, input_ids {len(input_ids)}")
    for i, (ids, mask) in enumerate(zip(input_ids, loss_mask)):
        if not ids:
            raise BatchError(f"row {i} is empty")
        if len(mask) != len(ids):
            raise BatchError(f"row {i}: loss_mask has {len(mask)} entries, input_ids {len(ids)}")
        if mask[0]:
            raise BatchError(f"row {i}: the first token cannot be trained (no logits predict it)")


def check_batch(batch: TrainBatch) -> None:
    check_token_rows(batch.input_ids, batch.loss_mask)
    if len(batch.old_logprobs) != len(batch.input_ids) or len(batch.advantages) != len(batch.input_ids):
        raise BatchError(
            f"batch has {len(batch.input_ids)} rows but {len(batch.old_logprobs)} old_logprobs rows "
            f"and {len(batch.advantages)} advantages"
        )
    for i, (ids, old) in enumerate(zip(batch.input_ids, batch.old_logprobs)):
        if len(old) != len(ids):
            raise BatchError(f"row {i}: old_logprobs has {len(old)} entries, input_ids {len(ids)}")
    if not all(math.isfinite(a) for a in batch.advantages):
        raise BatchError("advantages must be finite")


def check_hparams(hp: TrainHParams) -> None:
    if hp.loss_agg not in LOSS_AGGREGATIONS:
        raise BatchError(f"loss_agg must be one of {LOSS_AGGREGATIONS}, got {hp.loss_agg!r}")
    if hp.loss_agg_len < 0:
        raise BatchError(f"loss_agg_len must be >= 0, got {hp.loss_agg_len}")
    if hp.loss_fn:
        return  # a user's loss takes whatever loss_params it documents
    loss = loss_of(hp.loss, "rl")
    if loss is None:
        raise BatchError(f"loss must be one of {LOSSES} (or a trusted loss_fn), got {hp.loss!r}")
    unknown = loss.unknown(hp.loss_params)
    if unknown:
        takes = ", ".join(loss.takes()) or "no parameters"
        raise BatchError(f"loss {hp.loss} takes {takes}; got loss_params {', '.join(unknown)}")
    try:
        loss.settings(hp.loss_params)
    except LossConfigError as e:
        raise BatchError(f"loss {hp.loss}: loss_params {e}") from None


def pad_rows(input_ids: list[list[int]], loss_mask: list[list[int]], device: torch.device) -> Rows:
    """Right-pad rows with PAD_ID; shift the mask so column t refers to token t + 1."""
    lengths = [len(row) for row in input_ids]
    width = max(lengths)
    pads = [width - n for n in lengths]  # rows built as lists, one tensor each: no per-row tensor ops
    ids = torch.tensor([[*row, *[PAD_ID] * pad] for row, pad in zip(input_ids, pads)], dtype=torch.long)
    attention = torch.tensor([[1] * n + [0] * pad for n, pad in zip(lengths, pads)], dtype=torch.long)
    mask = torch.tensor([[*row, *[0] * pad] for row, pad in zip(loss_mask, pads)], dtype=torch.bool)
    return Rows(ids.to(device), attention.to(device), mask[:, 1:].to(device), lengths)


def pad_old_logprobs(old_logprobs: list[list[float]], rows: Rows) -> torch.Tensor:
    """Old log-probs aligned with ``rows.loss_mask``; masked entries are forced to 0."""
    width = rows.input_ids.shape[1]
    old = torch.tensor([[*row, *[0.0] * (width - len(row))] for row in old_logprobs], dtype=torch.float32)
    old = old[:, 1:].to(rows.loss_mask.device)
    old = torch.where(rows.loss_mask, old, 0.0)
    if not torch.isfinite(old).all():
        raise BatchError("old_logprobs must be finite where loss_mask is 1")
    return old


def micro_batch_bounds(lengths: list[int], max_rows: int | None, max_tokens: int | None) -> list[tuple[int, int]]:
    """[start, stop) of each micro-batch: consecutive rows, as many as fit both ``max_rows`` and
    ``max_tokens`` padded tokens (None: no limit). A row longer than ``max_tokens`` is a
    micro-batch of its own: rows are never split."""
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be at least 1, got {max_rows}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    bounds: list[tuple[int, int]] = []
    start, width = 0, 0
    for i, length in enumerate(lengths):
        rows = i - start + 1
        grown = max(width, length)
        full = (max_rows is not None and rows > max_rows) or (max_tokens is not None and rows * grown > max_tokens)
        if full and i > start:
            bounds.append((start, i))
            start, grown = i, length
        width = grown
    if lengths:
        bounds.append((start, len(lengths)))
    return bounds


def length_order(
    lengths: list[int],
    max_rows: int | None,
    max_tokens: int | None,
    spans: list[tuple[int, int]] | None = None,
) -> list[int] | None:
    """The rows' order for micro-batches of like lengths: longest first (rows of one length keep
    their order), each of ``spans`` ([start, stop), covering the batch; None: one span) sorted
    within itself and kept in place. None where bucketing would change nothing: the batch is
    one micro-batch as it stands, or already in that order."""
    if len(micro_batch_bounds(lengths, max_rows, max_tokens)) <= 1:
        return None
    order = []
    for start, stop in spans or [(0, len(lengths))]:
        order.extend(sorted(range(start, stop), key=lambda i: -lengths[i]))
    return None if order == list(range(len(lengths))) else order


def quantile_passes(
    job_lengths: list[list[int]], max_rows: int | None, max_tokens: int | None, pass_cost_tokens: int
) -> tuple[list[int], list[tuple[int, int]]] | None:
    """A group's rows cut into K micro-batches of like lengths, the k-th of each job's rows by
    length in the k-th (each job's rows contiguous and of one count in every micro-batch, so its
    jobs still share batched matmuls); K (1, 2, 4, ... dividing the jobs' row count) the fewest
    padded tokens plus ``pass_cost_tokens`` a micro-batch. ``(order, bounds)``: the rows' order
    (indices into the group, jobs' rows one after another) and each micro-batch's [start, stop).
    None where one micro-batch is best, the jobs' row counts differ, or the budget (``max_rows``,
    ``max_tokens``) cuts the group already."""
    counts = {len(lengths) for lengths in job_lengths}
    flat = [length for lengths in job_lengths for length in lengths]
    if len(counts) != 1 or not flat or len(micro_batch_bounds(flat, max_rows, max_tokens)) > 1:
        return None
    n, jobs = counts.pop(), len(job_lengths)
    by_length = [sorted(range(j * n, (j + 1) * n), key=lambda i: flat[i]) for j in range(jobs)]

    def chunks(k: int) -> list[list[int]]:
        m = n // k
        return [[i for rows in by_length for i in rows[c * m : (c + 1) * m]] for c in range(k)]

    best, best_cost = 1, len(flat) * max(flat) + pass_cost_tokens
    k = 2
    while k <= n and n % k == 0:
        cost = sum(len(chunk) * max(flat[i] for i in chunk) for chunk in chunks(k)) + k * pass_cost_tokens
        if cost < best_cost:
            best, best_cost = k, cost
        k *= 2
    if best == 1:
        return None
    order = [i for chunk in chunks(best) for i in chunk]
    size = len(flat) // best
    return order, [(c * size, (c + 1) * size) for c in range(best)]


def permute_rows(rows: Rows, order: list[int]) -> Rows:
    """``rows`` in ``order`` (row i of the result is row ``order[i]``), still padded to the
    batch's longest row."""
    index = torch.tensor(order, dtype=torch.long, device=rows.input_ids.device)
    return Rows(
        rows.input_ids[index],
        rows.attention_mask[index],
        rows.loss_mask[index],
        [rows.lengths[i] for i in order],
    )


def slice_rows(rows: Rows, start: int, stop: int) -> Rows:
    """Rows [start, stop), trimmed to their own longest row."""
    lengths = rows.lengths[start:stop]
    width = max(lengths)
    return Rows(
        rows.input_ids[start:stop, :width],
        rows.attention_mask[start:stop, :width],
        rows.loss_mask[start:stop, : width - 1],
        lengths,
    )
