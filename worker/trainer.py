"""The trainer engine: one resident base model, many jobs' LoRA adapters and AdamW states.

What it owns. ``TrainerEngine`` loads a base model once (transformers) and keeps, per job, a
LoRA adapter, an AdamW optimizer and the job's own RNG state. ``train_step`` runs one
policy-gradient optimizer step on the adapter of the job it names, with the loss the call
names (``TrainHParams``): PPO's clipped surrogate with asymmetric clip (``pg-clip``) or
truncated importance sampling for stale samples (``pg-tis``), optional k3 KL to the base model,
token-, sequence- or Dr. GRPO constant-length aggregation, gradient clipping. A trusted user's
own per-token loss (``loss_fn``, ``module:function``) is imported here, and only when the
daemon has marked the call's job as submitted by a user it trusts. It also computes
current-policy log-probs, writes adapters in the exact PEFT layout that vLLM's ``LoRARequest``
and ``peft.PeftModel.from_pretrained`` load, and
writes / verifies / restores durable checkpoints (adapter + optimizer + the driver's
``extra``, with a sha256 manifest), atomically. A write that runs out of disk space or quota
(ENOSPC, EDQUOT) removes its temp dir, leaves the previous checkpoint as it was and raises
``NoSpaceError``, one line with the directory, the bytes it needed and the bytes free. The
loss terms live in ``worker.loss_terms``, the chunked log-probs in ``worker.token_logprobs``,
the state's layout, host copies and buffer pool in ``worker.state_copy``, checkpoint files in
``worker.checkpoint_files``, errors in ``worker.errors``.

Memory and precision. A step runs in micro-batches of at most ``micro_batch_rows`` rows and
``micro_batch_tokens`` padded tokens (rows in order, each padded to its own longest row; the
loss weights are computed over the whole batch first, so the micro-batches' gradients add up
to the batch's). Each micro-batch runs the decoder to hidden states, then the lm_head and an
fp32 log-softmax ``logprob_chunk_tokens`` loss-mask positions at a time: no batch's full
logits ever exist. A bfloat16 / float16 engine holds the base weights in that dtype and runs
under autocast; adapters and AdamW's state stay float32 (peft upcasts adapters), so a job's
state and its size (``plexctl.state_size``) do not depend on the engine's dtype; published
adapters are written in the engine's dtype, checkpoints in float32. With
``gradient_checkpointing`` the decoder layers recompute their activations in the backward.

How jobs share it. One ``peft.PeftModel`` holds every resident job's adapter side by side
(``add_adapter`` once per job, under an engine-unique name). A call activates the
job's adapter with ``set_adapter``: inactive adapters are skipped by peft's LoRA forward and
marked ``requires_grad=False``, so they take no part in the computation graph; each job's
AdamW only ever sees that job's parameters. Randomness is per job too: an adapter is
initialised under ``torch.manual_seed(seed)`` inside ``torch.random.fork_rng`` (so its
initial weights depend on the seed only, never on which jobs already exist), and a job with
LoRA dropout trains under its own saved RNG state. The result, asserted by the tests: the
update a job gets is bit-for-bit (on CPU) the update it would get alone on the engine,
whatever other jobs' steps are interleaved.

Moving a job off the device. Each job's trainable state (adapter parameters, AdamW moments and
step counts, RNG state) lives in one flat buffer, its slot, laid out exactly as a host copy is;
parameters and moments are views into it. ``export_state`` fills a ``JobStateCopy`` in a buffer
of the caller's ``BufferPool`` (on CUDA from pinned memory, on a side stream) with one ``copy_``
per run; ``release`` parks the adapter modules with their slot, and ``import_state`` reuses a
parked adapter of the same LoRA shape and copies the state back: nothing is done per tensor,
and training goes on bit-for-bit as if the job had never left.

What it deliberately does not do. No scheduling, no deciding which job lives on which memory
tier or writing copies to disk (``worker.state_store`` does that with ``export_state`` /
``import_state``), no sockets, no rollout. Rows of different jobs are not mixed in
one forward yet (peft's per-row ``adapter_names`` routing is the road to that). Rows are not
split or reordered to fit a micro-batch; models whose logits are post-processed after the
lm_head (soft-capping, scaling) are refused. Full fine-tunes are not handled here. The engine
is not thread-safe: the worker calls it from one thread. Bit-exactness is a CPU guarantee; on
GPU it additionally needs deterministic kernels.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from safetensors.torch import save as safetensors_bytes
from transformers import AutoModelForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer

from plexctl.protocol import (
    LoraConfig,
    TrainBatch,
    TrainHParams,
)
from plexctl.user_code import import_object
from worker.checkpoint_files import (
    ADAPTER_WEIGHTS,
    CHECKPOINT_FILES,
    CHECKPOINT_FORMAT,
    EXTRA,
    MANIFEST,
    TRAINER_STATE,
    file_record,
    read_checkpoint_payload,
    read_manifest,
    verify_checksums,
    write_dir_atomically,
    write_file,
)
from worker.errors import (
    BatchError,
    CheckpointError,
    JobConfigError,
    LossLoadError,
    StateCopyError,
    UnknownJobError,
    UntrustedCodeError,
)
from worker.loss_terms import (
    MetricSums,
    aggregation_weights,
    grpo_token_terms,
    tis_token_terms,
    user_token_terms,
)
from worker.state_copy import (
    ADAPTER_PREFIX,
    OPTIM_PREFIX,
    PAGE_BYTES,
    POOL_KEEP,
    RNG_PREFIX,
    BufferPool,
    JobStateCopy,
    SpecBuffers,
    StateSpec,
    TensorViews,
    aligned_host_buffer,
    check_copy_fits,
    dtype_name,
    state_spec,
)
from worker.token_logprobs import DEFAULT_LOGPROB_CHUNK_TOKENS, check_plain_head, token_logprobs
from worker.train_batches import (
    Rows,
    check_batch,
    check_hparams,
    check_token_rows,
    micro_batch_bounds,
    pad_old_logprobs,
    pad_rows,
    slice_rows,
    wants_gradient_checkpointing,  # noqa: F401 - the worker imports its sizing rule from here
)

PARKED_ADAPTERS_MAX = 4  # released adapters kept (with their slots) for import_state to reuse

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


# ---------------------------------------------------------------- per-job state


@dataclass(eq=False, slots=True)
class _Slot:
    """An adapter's trainable state in one flat buffer on the engine's device: its parameters
    (``param.data`` are views), AdamW's moments and step counts (``optimizer.state`` holds views,
    made before the first step, so AdamW updates them in place and never allocates them) and the
    job's RNG state. On a CUDA engine the step counts and RNG state, which torch keeps on the
    host, are views into a small ``host`` buffer instead. ``runs``: (bytes of ``device`` or
    ``host``, their start and end in a copy's memory), contiguous on both sides: one copy each
    (one in all on CPU) moves the whole state to or from a copy laid out by ``spec``."""

    spec: StateSpec
    device: torch.Tensor  # uint8
    host: torch.Tensor | None  # uint8, CUDA engines only
    spans: dict[str, torch.Tensor]  # group name -> its flat typed view in ``device`` or ``host``
    runs: list[tuple[torch.Tensor, int, int]]
    params: dict[str, torch.nn.Parameter]  # PEFT-file key -> parameter, in module order
    optimizer: torch.optim.AdamW
    moments: dict[torch.Tensor, dict[str, torch.Tensor]]  # parameter -> AdamW's state: views
    rng: dict[str, torch.Tensor]  # the job's RNG state: views
    # one run from the first byte and ``device`` a whole number of pages (CPU): the state moves to
    # or from memory of ``numel`` bytes laid out by ``spec`` (a pool's buffer of its pages) as one
    # copy of the two tensors as they are, no view made (with the caches cold, making one costs a
    # third of a 0.4 MB copy); ``export_state`` and ``import_state`` do that themselves
    whole: bool = False
    numel: int = 0  # of ``device``
    allocated: bool = True  # ``device`` has its memory (``free`` / ``reallocate``)
    # a small state's last export: its memory (a pool's buffer, which the next export is likely
    # to get again) and the views over it; kept for states under VIEWS_KEEP_BYTES only, as it
    # keeps that buffer alive
    views: tuple[torch.Tensor, SpecBuffers, TensorViews] | None = None

    def free(self) -> None:
        """Free the device buffer; every view stays, over no memory, until ``reallocate``."""
        self.device.untyped_storage().resize_(0)
        self.allocated = False

    def reallocate(self) -> None:
        self.device.untyped_storage().resize_(self.device.numel())
        self.allocated = True

    def copy_to(self, memory: torch.Tensor, stream: Any) -> None:
        """The whole state into ``memory`` (host, laid out by ``spec``); on CUDA on ``stream``
        (non-blocking into pinned memory); complete on return."""
        if stream is None:
            for span, start, end in self.runs:
                memory[start:end].copy_(span)
            return
        stream.wait_stream(torch.cuda.current_stream(self.device.device))
        with torch.cuda.stream(stream):
            for span, start, end in self.runs:
                memory[start:end].copy_(span, non_blocking=span.is_cuda)
        stream.synchronize()

    def copy_from(self, copy: JobStateCopy, stream: Any) -> None:
        """The whole state from a copy of the same spec: one copy per run when its buffers lie
        in its memory as ``spec`` lays them out, else one per buffer; on CUDA on ``stream``
        (from pinned memory without blocking); complete on return."""
        memory = copy.memory
        if memory is not None and (
            isinstance(copy.buffers, SpecBuffers)
            and copy.buffers.memory is memory
            or all(copy.buffers[g.name].data_ptr() == memory.data_ptr() + g.offset for g in self.spec.groups)
        ):
            pairs = [(span, memory[start:end]) for span, start, end in self.runs]
        else:
            pairs = [(self.spans[g.name], copy.buffers[g.name]) for g in self.spec.groups]
        if stream is None:
            for target, source in pairs:
                target.copy_(source)
            return
        stream.wait_stream(torch.cuda.current_stream(self.device.device))
        with torch.cuda.stream(stream):
            for target, source in pairs:
                target.copy_(source, non_blocking=source.is_pinned())
        stream.synchronize()


@dataclass(slots=True)
class _JobState:
    job_id: str
    adapter_name: str  # the adapter's key inside the shared PeftModel
    lora: LoraConfig
    seed: int
    homes: dict[str, _Home]  # PEFT-file key -> where the parameter lives
    slot: _Slot

    @property
    def params(self) -> dict[str, torch.nn.Parameter]:
        return self.slot.params

    @property
    def optimizer(self) -> torch.optim.AdamW:
        return self.slot.optimizer

    @property
    def rng_state(self) -> dict[str, torch.Tensor]:
        """The job's own RNG (only consumed by LoRA dropout): views, set with ``_store_rng``."""
        return self.slot.rng


VIEWS_KEEP_BYTES = 1 << 20  # below this a slot keeps its last export's views (_Slot.views)
_Home = tuple[torch.nn.Module, str]  # (module, attribute) holding one adapter parameter


@dataclass
class _ParkedAdapter:
    """A released job's adapter modules with its slot (whose memory may have been freed)."""

    adapter_name: str
    lora: LoraConfig  # of the job it was made for
    signature: dict[str, Any]  # its lora_signature
    homes: dict[str, _Home]
    slot: _Slot


@dataclass
class SlabCounts:
    """Device buffers the engine's slots allocated (new, or again after being freed) and the
    imports that found a parked slot's buffer still allocated."""

    allocated: int = 0
    allocated_bytes: int = 0
    reused: int = 0


# ---------------------------------------------------------------- the engine


class TrainerEngine:
    """One resident base model; per-job LoRA adapters and AdamW states; GRPO steps on demand."""

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        device: str = "cpu",
        threads: int | None = None,
        micro_batch_rows: int | None = None,
        micro_batch_tokens: int | None = None,
        logprob_chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS,
        gradient_checkpointing: bool = False,
    ) -> None:
        """``dtype``: the base weights' (bfloat16 / float16 engines also compute under autocast;
        adapters and AdamW stay float32). ``micro_batch_rows`` / ``micro_batch_tokens``: a
        forward/backward takes at most so many rows / padded tokens (None: no limit).
        ``logprob_chunk_tokens``: positions whose logits exist at once. ``gradient_checkpointing``:
        the decoder layers recompute their activations in the backward."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        micro_batch_bounds([1], micro_batch_rows, micro_batch_tokens)  # refuses limits under 1
        if logprob_chunk_tokens < 1:
            raise ValueError(f"logprob_chunk_tokens must be at least 1, got {logprob_chunk_tokens}")
        if threads is not None:
            torch.set_num_threads(threads)
        self.model_path = model_path
        self.dtype = dtype
        self.device = torch.device(device)
        self.micro_batch_rows = micro_batch_rows
        self.micro_batch_tokens = micro_batch_tokens
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.gradient_checkpointing = gradient_checkpointing
        self._torch_dtype = DTYPES[dtype]
        self._base = _load_base_model(model_path, self._torch_dtype, self.device, gradient_checkpointing)
        # HF checkpoints a decoder layer only while the layer is in training mode (``_forward_context``)
        self._checkpointed_layers = [
            m for m in self._base.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
        ]
        self._peft: PeftModel | None = None  # created with the first job's adapter
        self._jobs: dict[str, _JobState] = {}
        self._cuda = self.device.type == "cuda"
        self._side_stream: Any = None  # torch.cuda.Stream for state copies, made on first use
        # parked slots that keep their device buffer for the next import_state (on CUDA the caching allocator does)
        self._parked_memory = POOL_KEEP if self.device.type == "cpu" else 0
        self.slabs = SlabCounts()
        self._rng_shapes = {name: tuple(t.shape) for name, t in self._capture_rng().items()}
        self._adapters_made = 0
        self._parked: list[_ParkedAdapter] = []  # oldest first
        self._user_losses: dict[tuple[str, str], Callable[..., torch.Tensor]] = {}

    # ------------------------------------------------------------ job lifecycle

    def ensure_job(self, job_id: str, lora: LoraConfig, seed: int, weight_decay: float = 0.0) -> None:
        """Create the job's adapter (a function of ``seed`` only) and its AdamW. Idempotent."""
        existing = self._jobs.get(job_id)
        if existing is not None:
            if lora_signature(existing.lora) != lora_signature(lora):
                raise JobConfigError(
                    f"job {job_id!r} is resident with LoRA {lora_signature(existing.lora)}, not {lora_signature(lora)}"
                )
            return
        adapter_name = self._new_adapter_name()
        with self._forked_rng():
            torch.manual_seed(seed)
            self._attach_adapter(adapter_name, _peft_config(lora, self.model_path))
            rng_state = self._capture_rng()
        homes = self._adapter_homes(adapter_name)
        slot = self._make_slot(homes, weight_decay)
        _store_rng(slot.rng, rng_state)
        self._register_job(job_id, adapter_name, lora, seed, homes, slot)

    def release(self, job_id: str) -> None:
        """Drop the job's adapter and optimizer state (their device memory is freed).

        The adapter's modules are parked with their slot (parameters and AdamW still views into
        it) for a later ``import_state`` of the same LoRA shape to reuse; at most
        ``PARKED_ADAPTERS_MAX`` are kept, the oldest are deleted. On CPU the ``POOL_KEEP`` largest
        parked slots keep their buffer, for the next import to copy into (on CUDA every parked
        slot's buffer is freed: the caching allocator keeps it). Live tensors taken from the job
        (``adapter_state_dict``) are not to be used after this.
        """
        job = self._job(job_id)
        del self._jobs[job_id]
        job.optimizer.zero_grad(set_to_none=True)
        self._parked.append(_ParkedAdapter(job.adapter_name, job.lora, lora_signature(job.lora), job.homes, job.slot))
        while len(self._parked) > PARKED_ADAPTERS_MAX:
            self._delete_adapter(self._parked.pop(0).adapter_name)
        holding = [parked.slot for parked in reversed(self._parked) if parked.slot.allocated]
        holding.sort(key=lambda slot: -slot.device.numel())  # the largest, then the latest, keep theirs
        for slot in holding[self._parked_memory :]:
            slot.free()

    def jobs(self) -> list[str]:
        """Resident jobs, in the order they were created."""
        return list(self._jobs)

    def state_bytes(self, job_id: str) -> int:
        """Bytes of the job's adapter plus its optimizer moments and step counts (all there from
        the job's creation on)."""
        spec = self._job(job_id).slot.spec
        return spec.nbytes - spec.rng_bytes

    def adapter_state_dict(self, job_id: str) -> dict[str, torch.Tensor]:
        """The job's adapter weights under their PEFT-file keys: live tensors, not copies."""
        return {key: param.detach() for key, param in self._job(job_id).params.items()}

    def optimizer_state_dict(self, job_id: str) -> dict[str, Any]:
        """The job's AdamW ``state_dict()`` (its tensors are live, not copies)."""
        return self._job(job_id).optimizer.state_dict()

    # ------------------------------------------------------------ moving state off and back

    def export_state(self, job_id: str, pool: BufferPool | None = None) -> JobStateCopy:
        """A detached host copy of the job's adapter, optimizer and RNG; the job stays resident.

        The copy lives in one flat host buffer (``JobStateCopy.memory``): ``pool`` gives it
        (whose pages are already mapped), else it is allocated (pinned on CUDA); whoever holds
        the copy gives it back to the pool once it is done with it. The job's slot is laid out
        as the copy is, so filling it is one ``copy_`` on CPU (on CUDA: one from the device, on a
        side stream, and one of the step counts and RNG state); the copy's tensors are views
        made on first use. Complete when this returns. Follow it with ``release`` to free the
        device copy.

        A small state's move costs about as much in calls as in bytes (with the caches cold, as
        they are after a training step, each Python call costs a few microseconds): the common
        path here makes as few as it can.
        """
        job = self._jobs.get(job_id) or self._job(job_id)
        slot = job.slot
        spec = slot.spec
        if pool is not None:  # a 1-D uint8 host buffer of whole pages, at least spec.nbytes
            memory = pool.take(slot.numel if slot.whole else spec.nbytes)
        else:  # whole pages: room for O_DIRECT's padding when the store writes it
            memory = aligned_host_buffer(-(-spec.nbytes // PAGE_BYTES) * PAGE_BYTES, self.device.type == "cuda")
        if slot.whole and memory.numel() == slot.numel:  # the slot's bytes need no autograd
            memory.copy_(slot.device)
        else:
            slot.copy_to(memory, self._copy_stream())
        views = slot.views
        if views is None or views[0] is not memory:  # the pool's buffer of the last export: its views serve
            buffers = SpecBuffers(spec, memory)
            views = (memory, buffers, TensorViews(spec, buffers))
            slot.views = views if spec.nbytes < VIEWS_KEEP_BYTES else None
        group = slot.optimizer.param_groups[0]
        # by position, in the field order (job_id, lora, seed, weight_decay, param_keys, tensors,
        # buffers, layout, param_groups, state_values, memory, spec): with cold caches, keywords
        # cost a fifth of the copy; the spec's lists are read-only, as a copy's are
        return JobStateCopy(
            job.job_id,
            job.lora,
            job.seed,
            float(group["weight_decay"]),
            spec.param_keys,
            views[2],
            views[1],
            spec.layout,
            [{**group, "params": spec.param_indices}],
            {},
            memory,
            spec,
        )

    def import_state(self, job_id: str, copy: JobStateCopy) -> None:
        """Recreate the job's adapter, AdamW state and RNG exactly from ``copy``.

        The job must not be resident. A parked adapter of the same LoRA shape is reused with its
        slot (a fresh one is attached empty otherwise: peft's meta-device path, no random init),
        and the copy goes into the slot's buffer with one ``copy_`` per run (one on CPU; on CUDA
        from pinned memory, on a side stream): nothing is done per tensor. The engine keeps no
        reference to the copy's memory.
        """
        if job_id in self._jobs:
            raise JobConfigError(f"job {job_id!r} is already resident; release it before import_state")
        parked = self._unpark_adapter(copy.lora)
        adapter = parked or self._attach_empty_adapter(copy.lora)
        try:
            slot = adapter.slot
            check_copy_fits(copy, slot.spec)
            if not slot.allocated:
                slot.reallocate()
                self._count_slab(slot)
            elif parked is not None:
                self.slabs.reused += 1
            memory = copy.memory
            if (
                slot.whole
                and memory is not None
                and type(copy.buffers) is SpecBuffers
                and copy.buffers.memory is memory
                and memory.numel() == slot.numel
            ):
                slot.device.copy_(memory)  # the pages' tail beyond the state is padding on both sides
            else:
                slot.copy_from(copy, self._copy_stream())
            group = slot.optimizer.param_groups[0]  # the copy's hyper-parameters, not its "params"
            params = group["params"]
            group.update(copy.param_groups[0])
            group["params"] = params
            self._jobs[job_id] = _JobState(job_id, adapter.adapter_name, copy.lora, copy.seed, adapter.homes, slot)
        except BaseException:
            self._jobs.pop(job_id, None)
            self._delete_adapter(adapter.adapter_name)
            raise

    def _copy_stream(self) -> Any:
        """The side CUDA stream state copies run on (``None`` for a CPU engine)."""
        if not self._cuda:
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=self.device)
        return self._side_stream

    # ------------------------------------------------------------ training

    def train_step(self, job_id: str, batch: TrainBatch, hp: TrainHParams) -> dict[str, float]:
        """One GRPO optimizer step on the job's adapter; returns the step's metrics.

        The AdamW ``lr`` and ``weight_decay`` are taken from ``hp`` on every step (the
        ``weight_decay`` given to ``ensure_job`` is only the param group's initial value). A
        non-finite gradient norm skips the update (``skipped`` = 1.0) instead of poisoning it.
        """
        started = time.perf_counter()
        job = self._job(job_id)
        metrics = self._forward_backward(job, batch, hp)
        grad_norm = self._clip_gradients(job, hp.max_grad_norm)
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            _set_optimizer_hparams(job.optimizer, hp)
            job.optimizer.step()
        job.optimizer.zero_grad(set_to_none=True)
        metrics.update(grad_norm=grad_norm, skipped=float(skipped), seconds=time.perf_counter() - started)
        return metrics

    def loss_gradients(
        self, job_id: str, batch: TrainBatch, hp: TrainHParams
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The loss gradient (before clipping) under PEFT-file keys, without stepping.

        For diagnostics and tests; the adapter and optimizer are left untouched.
        """
        job = self._job(job_id)
        metrics = self._forward_backward(job, batch, hp)
        grads = {key: _grad_or_zeros(param) for key, param in job.params.items()}
        job.optimizer.zero_grad(set_to_none=True)
        return grads, metrics

    def logprobs(self, job_id: str, input_ids: list[list[int]], loss_mask: list[list[int]]) -> list[list[float]]:
        """Current-policy log-prob of every token (eval mode, no dropout); 0 where masked."""
        job = self._job(job_id)
        check_token_rows(input_ids, loss_mask)
        rows = pad_rows(input_ids, loss_mask, self.device)
        model = self._activate(job, train=False)
        columns: list[torch.Tensor] = []
        with torch.no_grad(), self._forward_context():
            for _, _, part in self._micro_batches(rows):
                logp, _ = self._token_logprobs(model, part)
                columns.extend(logp.cpu())
        return [[0.0] + col[: n - 1].tolist() for col, n in zip(columns, rows.lengths)]

    # ------------------------------------------------------------ adapters and checkpoints

    def save_adapter(self, job_id: str, out_dir: str) -> None:
        """Write the job's adapter in PEFT layout at the top level of ``out_dir``, atomically
        (``NoSpaceError`` when its filesystem is full), its weights in the engine's dtype (what
        the rollout engine serves in); a checkpoint keeps them as trained, in float32."""
        job = self._job(job_id)
        weights = self._adapter_weights(job, self._torch_dtype)
        write_dir_atomically(
            Path(out_dir),
            lambda tmp: self._write_adapter_files(job, tmp, weights),
            what=f"adapter of job {job_id!r}",
            nbytes=len(weights),
        )

    def save_checkpoint(self, job_id: str, out_dir: str, extra: dict) -> dict:
        """Write adapter + optimizer + RNG + ``extra`` + a sha256 manifest, atomically.

        Everything is serialised before the first byte is written; ``NoSpaceError`` when the
        filesystem is full (the temp dir is removed, an earlier checkpoint is untouched)."""
        job = self._job(job_id)
        payload = self._checkpoint_payload(job, extra)
        step = extra.get("step") if isinstance(extra, dict) else None
        what = f"checkpoint step {step}" if isinstance(step, int) else "checkpoint"
        return write_dir_atomically(
            Path(out_dir),
            lambda tmp: self._write_checkpoint_files(job, tmp, payload),
            what=what,
            nbytes=sum(len(data) for data in payload.values()),
        )

    def load_checkpoint(self, job_id: str, ckpt_dir: str, lora: LoraConfig, seed: int) -> dict:
        """Verify a checkpoint, restore the job's adapter and optimizer exactly; return ``extra``."""
        directory = Path(ckpt_dir)
        manifest = read_manifest(directory)
        verify_checksums(directory, manifest)
        if manifest.get("lora") != lora_signature(lora):
            raise CheckpointError(
                f"checkpoint {directory} was written for LoRA {manifest.get('lora')}, not {lora_signature(lora)}"
            )
        tensors, trainer_state, extra = read_checkpoint_payload(directory)
        created = job_id not in self._jobs
        self.ensure_job(job_id, lora, seed)
        try:
            _restore_job_state(self._jobs[job_id], tensors, trainer_state, directory)
        except BaseException:
            if created:
                self.release(job_id)
            raise
        return extra

    # ------------------------------------------------------------ internals: model and adapters

    def _job(self, job_id: str) -> _JobState:
        job = self._jobs.get(job_id)
        if job is None:
            raise UnknownJobError(f"job {job_id!r} is not resident on this trainer engine")
        return job

    def _attach_adapter(self, adapter_name: str, config: PeftLoraConfig, empty: bool = False) -> None:
        """Add an adapter to the PeftModel; ``empty``: parameters on the meta device, no init."""
        if self._peft is None:
            self._peft = get_peft_model(self._base, config, adapter_name=adapter_name, low_cpu_mem_usage=empty)
        else:
            self._peft.add_adapter(adapter_name, config, low_cpu_mem_usage=empty)

    def _new_adapter_name(self) -> str:
        """A fresh peft-safe adapter key (no dots, never the 'lora_' prefix), never reused."""
        self._adapters_made += 1
        return f"adapter_{self._adapters_made}"

    def _unpark_adapter(self, lora: LoraConfig) -> _ParkedAdapter | None:
        """A parked adapter of the same LoRA shape (the latest whose slot kept its buffer, if
        any), taken off the parked list, or None."""
        parked = self._parked
        latest = None
        for i in range(len(parked) - 1, -1, -1):  # one loop, no list made: this is on every swap-in
            if parked[i].lora == lora:
                if parked[i].slot.allocated:
                    return parked.pop(i)
                if latest is None:
                    latest = i
        if latest is None:  # the same shape written another way (target modules in another order)
            signature = lora_signature(lora)
            matches = [i for i, one in enumerate(parked) if one.signature == signature]
            if not matches:
                return None
            holding = [i for i in matches if parked[i].slot.allocated]
            latest = (holding or matches)[-1]
        return parked.pop(latest)

    def _attach_empty_adapter(self, lora: LoraConfig) -> _ParkedAdapter:
        """A new adapter whose slot's memory is uninitialised (peft's low_cpu_mem_usage path
        puts meta placeholders where its parameters go: no init)."""
        adapter_name = self._new_adapter_name()
        self._attach_adapter(adapter_name, _peft_config(lora, self.model_path), empty=True)
        homes = self._adapter_homes(adapter_name)
        return _ParkedAdapter(adapter_name, lora, lora_signature(lora), homes, self._make_slot(homes))

    @property
    def attached_adapters(self) -> int:
        """Adapters in the PeftModel: the resident jobs' plus the parked ones."""
        return len(self._peft.peft_config) if self._peft is not None else 0

    def _delete_adapter(self, adapter_name: str) -> None:
        assert self._peft is not None
        with warnings.catch_warnings():  # "adapter was active ... setting active adapter to ..."
            warnings.simplefilter("ignore", UserWarning)
            self._peft.delete_adapter(adapter_name)

    def _register_job(
        self, job_id: str, adapter_name: str, lora: LoraConfig, seed: int, homes: dict[str, _Home], slot: _Slot
    ) -> _JobState:
        job = _JobState(job_id, adapter_name, lora, seed, homes, slot)
        self._jobs[job_id] = job
        return job

    def _make_slot(self, homes: dict[str, _Home], weight_decay: float = 0.0) -> _Slot:
        """A slot for an attached adapter: one new device buffer laid out as the job's copies
        are. Its parameters become views into it, keeping their values (``param.data``: the
        ``nn.Parameter`` objects peft holds stay), or, for meta placeholders, new parameters
        over its uninitialised memory; AdamW's moments and step counts are zeros in it."""
        params = {key: getattr(module, attribute) for key, (module, attribute) in homes.items()}
        spec = self._state_spec(params)
        on_host = {g.name for g in spec.groups if self.device.type != "cpu" and g.name.startswith(("step.", "rng."))}
        sizes = {False: 0, True: 0}
        for group in spec.groups:
            sizes[group.name in on_host] += group.nbytes
        # on CPU whole pages, as a copy's host buffer has: a swap then copies one tensor into the other
        padded = sizes[False] if on_host else -(-sizes[False] // PAGE_BYTES) * PAGE_BYTES
        device = torch.empty(padded, dtype=torch.uint8, device=self.device)
        host = torch.empty(sizes[True], dtype=torch.uint8) if on_host else None
        spans: dict[str, torch.Tensor] = {}
        runs: list[list[Any]] = []  # [slab, start in it, offset in a copy's memory, bytes]
        at = {False: 0, True: 0}
        for group in sorted(spec.groups, key=lambda g: g.offset):
            slab = host if group.name in on_host else device
            assert slab is not None
            start = at[group.name in on_host]
            at[group.name in on_host] += group.nbytes
            spans[group.name] = slab[start : start + group.nbytes].view(group.dtype)
            if runs and runs[-1][0] is slab and runs[-1][2] + runs[-1][3] == group.offset:
                runs[-1][3] += group.nbytes
            else:
                runs.append([slab, start, group.offset, group.nbytes])
        views: dict[str, torch.Tensor] = {}
        for group in spec.groups:
            parts = spans[group.name].split(group.numels)
            views.update(zip(group.names, [part.view(shape) for part, shape in zip(parts, group.shapes)]))
        with torch.no_grad():
            for key, (module, attribute) in homes.items():
                param, view = params[key], views[ADAPTER_PREFIX + key]
                if param.is_meta:
                    params[key] = torch.nn.Parameter(view, requires_grad=param.requires_grad)
                    setattr(module, attribute, params[key])
                else:
                    view.copy_(param)
                    param.data = view
            for group in spec.groups:
                if group.name.startswith(("optim.", "step.")):
                    spans[group.name].zero_()
        optimizer = torch.optim.AdamW(list(params.values()), lr=0.0, weight_decay=weight_decay)
        moments: dict[torch.Tensor, dict[str, torch.Tensor]] = {
            param: {name: views[f"{OPTIM_PREFIX}{key}/{name}"] for name in ("step", "exp_avg", "exp_avg_sq")}
            for key, param in params.items()
        }
        optimizer.state.update(moments)
        rng = {name: views[RNG_PREFIX + name] for name in self._rng_shapes}
        copy_runs = [(slab[start : start + n], offset, offset + n) for slab, start, offset, n in runs]
        whole = host is None and len(runs) == 1 and runs[0][1] == 0 and runs[0][2] == 0 and runs[0][3] == spec.nbytes
        slot = _Slot(spec, device, host, spans, copy_runs, params, optimizer, moments, rng, whole, padded)
        self._count_slab(slot)
        return slot

    def _state_spec(self, params: dict[str, torch.nn.Parameter]) -> StateSpec:
        """The layout of a job with these parameters: adapter, AdamW moments, step counts, RNG."""
        adapter: dict[torch.dtype, list[tuple[str, tuple[int, ...]]]] = {}
        optim: dict[torch.dtype, list[tuple[str, tuple[int, ...]]]] = {}
        for key, param in params.items():
            shape = tuple(param.shape)
            adapter.setdefault(param.dtype, []).append((ADAPTER_PREFIX + key, shape))
            optim.setdefault(param.dtype, []).extend(
                (f"{OPTIM_PREFIX}{key}/{name}", shape) for name in ("exp_avg", "exp_avg_sq")
            )
        step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # AdamW's
        groups = [(f"adapter.{dtype_name(d)}", d, members) for d, members in adapter.items()]
        groups += [(f"optim.{dtype_name(d)}", d, members) for d, members in optim.items()]
        steps: list[tuple[str, tuple[int, ...]]] = [(f"{OPTIM_PREFIX}{key}/step", ()) for key in params]
        groups.append((f"step.{dtype_name(step_dtype)}", step_dtype, steps))
        groups.append(("rng.uint8", torch.uint8, [(RNG_PREFIX + name, s) for name, s in self._rng_shapes.items()]))
        return state_spec(groups)

    def _count_slab(self, slot: _Slot) -> None:
        self.slabs.allocated += 1
        self.slabs.allocated_bytes += slot.device.numel()

    def _adapter_homes(self, adapter_name: str) -> dict[str, _Home]:
        """PEFT-file key -> (module, attribute) of each adapter parameter, in module order."""
        assert self._peft is not None
        homes: dict[str, _Home] = {}
        for name, _ in self._peft.named_parameters():
            if _belongs_to_adapter(name, adapter_name):
                module_name, attribute = name.rsplit(".", 1)
                homes[_peft_file_key(name, adapter_name)] = (self._peft.get_submodule(module_name), attribute)
        if not homes:
            raise JobConfigError(f"adapter {adapter_name!r} has no parameters (do target_modules match the model?)")
        return homes

    def _activate(self, job: _JobState, train: bool) -> PeftModel:
        """Make the job's adapter the only active (and trainable) one; set train/eval mode."""
        assert self._peft is not None
        self._peft.set_adapter(job.adapter_name)
        self._peft.train(train)
        return self._peft

    def _micro_batches(self, rows: Rows) -> Iterator[tuple[int, int, Rows]]:
        """(start, stop, rows[start:stop] trimmed to their longest row) of each micro-batch."""
        for start, stop in micro_batch_bounds(rows.lengths, self.micro_batch_rows, self.micro_batch_tokens):
            yield start, stop, slice_rows(rows, start, stop)

    @contextlib.contextmanager
    def _forward_context(self) -> Iterator[None]:
        """Autocast to the engine's dtype (bfloat16 / float16 engines); with gradient checkpointing
        and a gradient, the decoder layers themselves (not their submodules: no dropout changes)
        in training mode, which is when transformers checkpoints them."""
        cast = (
            torch.autocast(self.device.type, dtype=self._torch_dtype)
            if self._torch_dtype != torch.float32
            else contextlib.nullcontext()
        )
        layers = self._checkpointed_layers if torch.is_grad_enabled() else []
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
        self, model: torch.nn.Module, part: Rows, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropies) at the micro-batch's loss-mask positions, 0 elsewhere."""
        return token_logprobs(
            model, part.input_ids, part.attention_mask, part.loss_mask, self.logprob_chunk_tokens, entropy
        )

    # ------------------------------------------------------------ internals: the loss

    def _forward_backward(self, job: _JobState, batch: TrainBatch, hp: TrainHParams) -> dict[str, float]:
        """Accumulate the GRPO loss gradient of ``batch`` into the job's parameters."""
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
        job.optimizer.zero_grad(set_to_none=True)
        sums = MetricSums()
        with self._job_rng(job):
            for start, stop, part in self._micro_batches(rows):
                if not part.loss_mask.any():  # all its weights are 0: nothing to add
                    continue
                width = part.loss_mask.shape[1]
                self._accumulate_micro_batch(
                    job,
                    part,
                    old_logprobs[start:stop, :width],
                    advantages[start:stop],
                    weights[start:stop, :width],
                    hp,
                    sums,
                    user_loss,
                )
        return sums.metrics(tokens)

    def _accumulate_micro_batch(
        self,
        job: _JobState,
        part: Rows,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        weights: torch.Tensor,
        hp: TrainHParams,
        sums: MetricSums,
        user_loss: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        ref_logprobs = self._reference_logprobs(job, part) if hp.kl_coef > 0 else None
        model = self._activate(job, train=job.lora.dropout > 0)
        with self._forward_context():
            logp, entropy = self._token_logprobs(model, part, entropy=True)
        assert entropy is not None
        if user_loss is not None:
            terms = user_token_terms(user_loss, hp, logp, old_logprobs, ref_logprobs, advantages, part.loss_mask)
        elif hp.loss == "pg-tis":
            terms = tis_token_terms(logp, old_logprobs, ref_logprobs, advantages, hp)
        else:
            terms = grpo_token_terms(logp, old_logprobs, ref_logprobs, advantages, hp)
        loss = (terms.loss * weights).sum()
        loss.backward()
        sums.add(part.loss_mask, weights, terms, loss, entropy)

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

    def _reference_logprobs(self, job: _JobState, part: Rows) -> torch.Tensor:
        """Log-probs under the base model (every adapter disabled), no gradient."""
        model = self._activate(job, train=False)
        with torch.no_grad(), model.disable_adapter(), self._forward_context():
            return self._token_logprobs(model, part)[0]

    def _clip_gradients(self, job: _JobState, max_grad_norm: float) -> float:
        max_norm = max_grad_norm if max_grad_norm > 0 else math.inf
        params = list(job.params.values())
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm).item())

    # ------------------------------------------------------------ internals: randomness

    @contextlib.contextmanager
    def _forked_rng(self) -> Iterator[None]:
        """Global RNG changes inside the block are undone after it."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            yield

    @contextlib.contextmanager
    def _job_rng(self, job: _JobState) -> Iterator[None]:
        """Run the block on the job's own RNG stream (only LoRA dropout consumes it)."""
        if job.lora.dropout <= 0:
            yield
            return
        with self._forked_rng():
            torch.set_rng_state(job.rng_state["cpu"].clone())  # a view into the slot would not do
            if "cuda" in job.rng_state:
                torch.cuda.set_rng_state(job.rng_state["cuda"].clone(), self.device)
            yield
            _store_rng(job.rng_state, self._capture_rng())

    def _capture_rng(self) -> dict[str, torch.Tensor]:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    # ------------------------------------------------------------ internals: files

    @staticmethod
    def _adapter_weights(job: _JobState, dtype: torch.dtype | None = None) -> bytes:
        """The adapter's safetensors file, in memory (written by ``write_file``, whose errors
        keep their errno, unlike safetensors' own writer); in ``dtype``, else as held."""
        tensors = {key: param.detach().to("cpu", dtype=dtype, copy=True) for key, param in job.params.items()}
        return safetensors_bytes(tensors, metadata={"format": "pt"})

    def _write_adapter_files(self, job: _JobState, directory: Path, weights: bytes) -> None:
        config = _peft_config(job.lora, self.model_path)
        config.inference_mode = True
        config.save_pretrained(str(directory))
        write_file(directory / ADAPTER_WEIGHTS, weights)

    def _checkpoint_payload(self, job: _JobState, extra: dict) -> dict[str, bytes]:
        """The checkpoint's files but the adapter config, serialised in memory: nothing is written
        for an ``extra`` that is not JSON, and the bytes a checkpoint needs are known up front."""
        optimizer = job.optimizer.state_dict()  # cloned: views would save the whole slot
        optimizer["state"] = {i: {k: v.clone() for k, v in state.items()} for i, state in optimizer["state"].items()}
        trainer_state = {
            "optimizer": optimizer,
            "rng": {name: t.clone() for name, t in job.rng_state.items()},
            "param_keys": list(job.params),
        }
        buffer = io.BytesIO()
        torch.save(trainer_state, buffer)  # into memory: torch's own file writer loses the errno
        return {
            ADAPTER_WEIGHTS: self._adapter_weights(job),
            TRAINER_STATE: buffer.getvalue(),
            EXTRA: json.dumps(extra, sort_keys=True).encode(),
        }

    def _write_checkpoint_files(self, job: _JobState, directory: Path, payload: dict[str, bytes]) -> dict:
        self._write_adapter_files(job, directory, payload[ADAPTER_WEIGHTS])
        for name in (TRAINER_STATE, EXTRA):
            write_file(directory / name, payload[name])
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "job_id": job.job_id,
            "seed": job.seed,
            "lora": lora_signature(job.lora),
            "base_model": self.model_path,
            "files": {name: file_record(directory / name) for name in CHECKPOINT_FILES},
        }
        with open(directory / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
        return manifest


# ---------------------------------------------------------------- model helpers


def _load_base_model(
    model_path: str, dtype: torch.dtype, device: torch.device, gradient_checkpointing: bool
) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    check_plain_head(model.config)
    model.to(device)  # type: ignore[arg-type]  # transformers' functools.wraps on .to
    model.eval()
    model.requires_grad_(False)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # non-reentrant checkpoints reach the adapters inside a layer without a grad-requiring
        # input: the embeddings' hook transformers adds would only extend the backward
        model.disable_input_require_grads()
    return model


def _peft_config(lora: LoraConfig, base_model_path: str) -> PeftLoraConfig:
    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=list(lora.target_modules),
        lora_dropout=lora.dropout,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_path,
    )


def lora_signature(lora: LoraConfig) -> dict[str, Any]:
    """The LoRA fields that fix the adapter's shape and behaviour, comparable and JSON-able."""
    fields = msgspec.to_builtins(lora)
    fields["target_modules"] = sorted(fields["target_modules"])
    return fields


def _belongs_to_adapter(param_name: str, adapter_name: str) -> bool:
    return f".{adapter_name}." in param_name or param_name.endswith(f".{adapter_name}")


def _peft_file_key(param_name: str, adapter_name: str) -> str:
    """``...q_proj.lora_A.<adapter>.weight`` -> ``...q_proj.lora_A.weight`` (the saved-file key)."""
    if param_name.endswith(f".{adapter_name}"):
        return param_name[: -len(adapter_name) - 1]
    return param_name.replace(f".{adapter_name}.", ".")


def _grad_or_zeros(param: torch.nn.Parameter) -> torch.Tensor:
    return param.grad.detach().clone() if param.grad is not None else torch.zeros_like(param)


def _set_optimizer_hparams(optimizer: torch.optim.Optimizer, hp: TrainHParams) -> None:
    for group in optimizer.param_groups:
        group["lr"] = hp.lr
        group["weight_decay"] = hp.weight_decay


# ---------------------------------------------------------------- state copies


def _store_rng(views: dict[str, torch.Tensor], states: dict[str, torch.Tensor]) -> None:
    """RNG states into the job's views of them."""
    if set(states) != set(views) or any(states[n].shape != views[n].shape for n in views):
        raise StateCopyError(f"RNG state {sorted(states)} does not fit the job's ({sorted(views)})")
    for name, view in views.items():
        view.copy_(states[name])


# ---------------------------------------------------------------- restoring a checkpoint


def _restore_job_state(
    job: _JobState, tensors: dict[str, torch.Tensor], trainer_state: dict[str, Any], directory: Path
) -> None:
    """Checked against the job's adapter first, then copied into its slot: the optimizer's
    state stays the slot's views (``load_state_dict`` alone would replace them)."""
    if set(tensors) != set(job.params) or trainer_state.get("param_keys") != list(job.params):
        raise CheckpointError(f"checkpoint {directory}: adapter keys do not match the job's adapter")
    for key, weight in job.params.items():
        if tensors[key].shape != weight.shape:
            raise CheckpointError(f"checkpoint {directory}: {key} has shape {tuple(tensors[key].shape)}")
    rng = trainer_state.get("rng")
    if (
        not isinstance(rng, dict)
        or set(rng) != set(job.rng_state)
        or any(rng[n].shape != view.shape for n, view in job.rng_state.items())
    ):
        raise CheckpointError(f"checkpoint {directory}: RNG state does not fit")
    hparams = [{k: v for k, v in group.items() if k != "params"} for group in job.optimizer.param_groups]
    try:
        job.optimizer.load_state_dict(trainer_state["optimizer"])
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {directory}: optimizer state does not fit ({exc})") from None
    loaded, moments = dict(job.optimizer.state), job.slot.moments
    job.optimizer.state.clear()
    job.optimizer.state.update(moments)
    for param, views in moments.items():
        state = loaded.get(param, {})
        if set(state) - set(views) or any(state[n].shape != views[n].shape for n in state):
            for group, kept in zip(job.optimizer.param_groups, hparams):  # the job stays as it was
                group.update(kept)
            raise CheckpointError(f"checkpoint {directory}: optimizer state does not fit the job's AdamW")
    with torch.no_grad():
        for param, views in moments.items():
            for name, view in views.items():
                if name in loaded.get(param, {}):
                    view.copy_(loaded[param][name])
                else:  # saved before the first step
                    view.zero_()
        for key, param in job.params.items():
            param.copy_(tensors[key])
        _store_rng(job.rng_state, rng)
