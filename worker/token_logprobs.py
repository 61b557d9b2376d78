"""Token log-probs and entropies of a causal LM without the batch's full logits.

What it owns. ``token_logprobs`` runs the model's decoder to its last hidden states, then the
lm_head, an fp32 log-softmax, the gather of each target token and the entropy (no gradient),
``chunk_tokens`` positions at a time, and only at the positions asked for. Under a gradient,
a chunk through a frozen linear lm_head (LoRA's case) takes its gradient with respect to the
hidden states in the forward, from its softmax, and frees its logits; any other head is
checkpointed (non-reentrant ``torch.utils.checkpoint``: its logits are made again in the
backward). Either way a step holds one chunk's logits at a time, never ``[rows, length,
vocab]``. The results and their gradients equal the plain forward's
``log_softmax(model(ids).logits.float())`` up to float rounding.

Invariants: column t of the results refers to token t + 1, predicted by the hidden state at
position t (as in ``worker.train_batches.Rows``); positions not asked for hold 0.

What it deliberately does not do: models whose logits are post-processed after the lm_head
(soft-capping, logit scaling) are refused by ``check_plain_head``, not approximated.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_LOGPROB_CHUNK_TOKENS = 1024  # 1024 x 152k vocab: 0.6 GB per fp32 copy of a chunk's logits
_POST_PROCESSED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling")  # config fields


def causal_lm_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(decoder, lm_head) of a transformers CausalLM, or of the one a ``PeftModel`` wraps (its
    LoRA layers stay in place: ``disable_adapter`` and ``set_adapter`` still apply)."""
    causal_lm: Any = cast(Any, model).get_base_model() if hasattr(model, "get_base_model") else model
    head = causal_lm.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(causal_lm).__name__} has no lm_head")
    return causal_lm.get_decoder(), head


def check_plain_head(config: Any) -> None:
    """Refuse a model whose logits are more than its lm_head's output (Gemma 2's soft-capping,
    Cohere's and Granite's logit scaling): the chunked head would not reproduce them."""
    for name in _POST_PROCESSED_LOGITS:
        value = getattr(config, name, None)
        if value is not None and value != 1:
            raise ValueError(
                f"{type(config).__name__} post-processes its logits ({name}={value}); "
                "the trainer's chunked log-probs do not support that"
            )


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS,
    entropy: bool = False,
    packed: bool = False,
    vocab_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(token t+1 | tokens <= t) at the ``positions`` ([B, L-1] bool) of right-padded
    ``input_ids`` ([B, L]), and the predictive entropy there if asked: two fp32 [B, L-1]
    tensors, 0 elsewhere. The log-probs carry the gradient when grad mode is on; the entropy
    never does. ``packed``: the decoder runs the rows' tokens one after another in one sequence,
    no padding, each row's positions from 0 (transformers then masks attention to each row's
    own tokens: block-diagonal and causal; a varlen kernel where the model's attention has one)."""
    decoder, head = causal_lm_parts(model)
    if not packed:
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return head_logprobs(hidden, head, input_ids, positions, chunk_tokens, entropy, vocab_block)
    lengths = attention_mask.sum(dim=1)
    real = attention_mask.bool()
    starts = torch.cumsum(lengths, 0) - lengths  # each row's first token in the packed sequence
    columns = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    hidden = decoder(input_ids=input_ids[real][None], position_ids=columns[real][None], use_cache=False)
    rows, wanted = positions.nonzero(as_tuple=True)
    states = hidden.last_hidden_state[0, starts[rows] + wanted]
    return _head_at(states, head, input_ids, positions, (rows, wanted), chunk_tokens, entropy, vocab_block)


def head_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    chunk_tokens: int,
    entropy: bool = False,
    vocab_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``token_logprobs`` from the decoder's last hidden states ([B, L, H])."""
    rows, columns = positions.nonzero(as_tuple=True)
    states = hidden[rows, columns]  # [N, H]: the states that predict a wanted token
    return _head_at(states, head, input_ids, positions, (rows, columns), chunk_tokens, entropy, vocab_block)


def _head_at(
    states: torch.Tensor,
    head: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    where: tuple[torch.Tensor, torch.Tensor],
    chunk_tokens: int,
    entropy: bool,
    vocab_block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The log-probs (and entropies) of the states ([N, H]) that predict the tokens after
    ``where`` (``positions``' nonzero rows and columns), in ``positions``' shape."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    rows, columns = where
    targets = input_ids[rows, columns + 1]
    head_trains = any(p.requires_grad for p in head.parameters())
    needs_grad = torch.is_grad_enabled() and (states.requires_grad or head_trains)
    frozen_linear = type(head) is torch.nn.Linear and not head_trains
    logps: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    for start in range(0, targets.numel(), chunk_tokens):
        chunk = (states[start : start + chunk_tokens], targets[start : start + chunk_tokens])
        if needs_grad and frozen_linear:
            logp, ent = _FrozenLinearHeadLogprobs.apply(*chunk, head.weight, head.bias, entropy, vocab_block)
        elif needs_grad:
            logp, ent = checkpoint(_chunk_logprobs, head, *chunk, entropy, use_reentrant=False)
        else:
            logp, ent = _chunk_logprobs(head, *chunk, entropy)
        logps.append(logp)
        if ent is not None:
            entropies.append(ent)
    zeros = torch.zeros(positions.shape, dtype=torch.float32, device=states.device)
    logp_all = zeros.index_put((rows, columns), _cat(logps, states.device))
    entropy_all = zeros.index_put((rows, columns), _cat(entropies, states.device)) if entropy else None
    return logp_all, entropy_all


def _chunk_logprobs(
    head: torch.nn.Module, states: torch.Tensor, targets: torch.Tensor, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk: lm_head, fp32 log-softmax, the targets' log-probs and (no grad) the entropy."""
    logp = torch.log_softmax(head(states).float(), dim=-1)
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return chosen, None
    with torch.no_grad():
        return chosen, _entropy(logp.exp(), logp)


def _entropy(probs: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """-sum p log p of each row, as batched fp32 dot products (no [rows, vocab] temporary)."""
    with torch.autocast(probs.device.type, enabled=False):
        return -torch.bmm(probs.unsqueeze(1), logp.unsqueeze(2)).view(-1)


class _FrozenLinearHeadLogprobs(torch.autograd.Function):
    """One chunk through a frozen linear lm_head, its gradient taken in the forward.

    d log p(t | h) / dh = W[t] - sum_v p_v W[v]: a [chunk, H] tensor, made from the chunk's
    softmax while it exists; the backward only scales it by the incoming gradient, so no
    chunk's logits are kept or made again (half the passes over [chunk, vocab] of a
    checkpointed chunk). With ``vocab_block`` the chunk's logits stay in the head's dtype and
    its softmax is taken block by block (``_blockwise_head``): no [chunk, vocab] fp32 tensor."""

    @staticmethod
    def forward(
        ctx: Any,
        states: torch.Tensor,
        targets: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        entropy: bool,
        vocab_block: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if vocab_block is not None and vocab_block < weight.shape[0]:
            chosen, ent, direction = _blockwise_head(states, targets, weight, bias, entropy, vocab_block)
            ctx.save_for_backward(direction)
            ctx.states_dtype = states.dtype
            if ent is not None:
                ctx.mark_non_differentiable(ent)
            return chosen, ent
        logp = torch.log_softmax(torch.nn.functional.linear(states, weight, bias).float(), dim=-1)
        chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        probs = logp.exp()
        ent = _entropy(probs, logp) if entropy else None
        del logp
        direction = weight[targets].float() - torch.mm(probs.to(weight.dtype), weight).float()
        ctx.save_for_backward(direction)
        ctx.states_dtype = states.dtype
        if ent is not None:
            ctx.mark_non_differentiable(ent)
        return chosen, ent

    @staticmethod
    def backward(
        ctx: Any, grad_chosen: torch.Tensor, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, None, None, None, None, None]:
        (direction,) = ctx.saved_tensors
        return (grad_chosen.unsqueeze(-1) * direction).to(ctx.states_dtype), None, None, None, None, None


def _blockwise_head(
    states: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    entropy: bool,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``_FrozenLinearHeadLogprobs``' forward with the vocabulary in blocks of ``block``: the
    chunk's logits stay in the head's dtype and only one block at a time exists in fp32 (the
    log-sum-exp taken online over the blocks, then each block's softmax written over its logits,
    in the head's dtype as the whole-vocabulary path casts them, for the gradient's direction).
    The same matmuls; the log-softmax's sums in another order."""
    logits = torch.nn.functional.linear(states, weight, bias)  # [chunk, vocab], the head's dtype
    vocab = logits.shape[-1]
    top = torch.full(targets.shape, -torch.inf, dtype=torch.float32, device=states.device)
    total = torch.zeros(targets.shape, dtype=torch.float32, device=states.device)
    for start in range(0, vocab, block):
        part = logits[:, start : start + block].float()
        peak = torch.maximum(top, part.amax(dim=-1))
        total = total * torch.exp(top - peak) + torch.exp(part - peak[:, None]).sum(dim=-1)
        top = peak
    lse = top + torch.log(total)
    chosen = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1).float() - lse
    mean_logit = torch.zeros_like(lse)  # sum_v p_v logit_v: entropy = lse - this
    for start in range(0, vocab, block):  # each block's logits become its probabilities, in place
        part = logits[:, start : start + block].float()
        probs = torch.exp(part - lse[:, None])
        if entropy:
            mean_logit += (probs * part).sum(dim=-1)
        logits[:, start : start + block] = probs.to(logits.dtype)
    direction = weight[targets].float() - torch.mm(logits.to(weight.dtype), weight).float()
    return chosen, (lse - mean_logit) if entropy else None, direction


def _cat(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32, device=device)
