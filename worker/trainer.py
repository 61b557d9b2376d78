"""The trainer engine: one resident base model, many jobs' LoRA adapters or full weights, with
their AdamW states.

``TrainerEngine`` loads a base model once (transformers) and serves any number of jobs on it,
composed of parts that each own their state and get what they need when made: ``slots``
(``worker.trainer_slots.JobSlots``: each job's adapter, AdamW and RNG state in one flat buffer,
created, released, parked, exported and imported), ``math`` (``worker.trainer_math.TrainingMath``:
``train_step``, ``train_group``, ``loss_gradients``, ``logprobs``) and ``token_losses``
(``worker.trainer_tokens.TokenLosses``: Tinker's ``forward_backward`` and ``optim_step``); its
public methods hand each call to its part. It owns the base model, how its layers run, its sleep
and, here, its files: adapters in the exact PEFT layout that
vLLM's ``LoRARequest`` and ``peft.PeftModel.from_pretrained`` load (in the engine's dtype), and
durable checkpoints (adapter + optimizer + RNG + the driver's ``extra``, float32, with a sha256
manifest; ``worker.checkpoint_files``), written atomically and verified before a restore. A
full fine-tuning job publishes ``model.safetensors`` (every weight, the engine's dtype, the
model's parameter names: what the rollout engine reloads) and checkpoints the same files as an
adapter job, its float32 weights where the adapter would be; on a sharded base, each rank writes
its shards of the weights and moments instead (``worker.checkpoint_shards``), and any width reads them.

Invariants. A write that runs out of disk space or quota removes its temp dir, leaves the
previous checkpoint as it was and raises ``NoSpaceError`` (one line: the directory, the bytes it
needed, the bytes free). A restored job trains on exactly as it would have. Models whose logits
are post-processed after the lm_head (soft-capping, scaling) are refused.

Not here: scheduling, deciding which job lives on which memory tier or writing copies to disk
(``worker.state.store``), sockets, rollout. Rows of different jobs are not
mixed in one forward. The engine is not thread-safe: the worker calls it from one thread.
Bit-exactness is a CPU guarantee; on GPU it additionally needs deterministic kernels.
"""

from __future__ import annotations

import importlib.util
import io
import json
import logging
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

import torch
from safetensors.torch import save as safetensors_bytes
from transformers import AutoModelForCausalLM

from plexctl.common.calls import AdamStep, ForwardBackwardResult, LossCall, OptimStepResult
from plexctl.common.engine_defaults import ENGINE_DEFAULTS
from plexctl.common.protocol import TrainBatch, TrainHParams
from plexctl.common.spec import LoraSpec
from worker.checkpoint_files import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    CHECKPOINT_FILES,
    CHECKPOINT_FORMAT,
    EXTRA,
    MANIFEST,
    SHARDED_FILES,
    TRAINER_STATE,
    file_record,
    is_sharded,
    read_checkpoint_payload,
    read_manifest,
    verify_checksums,
    write_dir_atomically,
    write_file,
)
from worker.checkpoint_shards import read_shards, shared_dir, verify_shared, write_shards
from worker.decoder_layers import CHECKPOINT_SCOPES, checkpoint_submodules, decoder_layers
from worker.decoder_layers import compile_layers as compile_decoder_layers
from worker.engine_options import trainer_attention
from worker.errors import CheckpointError
from worker.shards import ShardedBase, as_shard, gather, is_shard, local, shard_of
from worker.state.arena import HostArena, HostMemoryError
from worker.state.job_copy import BufferPool, JobStateCopy, packed_layout, tensors_to_device, tensors_to_host
from worker.token_logprobs import DEFAULT_LOGPROB_CHUNK_TOKENS, causal_lm_parts, check_plain_head
from worker.train_batches import micro_batch_bounds
from worker.trainer_math import PassOptions, TrainingMath
from worker.trainer_slots import (
    PARKED_ADAPTERS_MAX,
    JobSlots,
    JobState,
    SlabCounts,
    lora_signature,
    peft_config,
    store_rng,
)
from worker.trainer_tokens import TokenLosses

__all__ = ["DTYPES", "FULL_WEIGHTS_FILE", "PARKED_ADAPTERS_MAX", "TrainerEngine", "lora_signature"]

log = logging.getLogger(__name__)

FULL_WEIGHTS_FILE = "model.safetensors"  # a full fine-tuning job's published weights (model parameter names)
LENGTH_BUCKETS = False  # ``TrainerEngine(length_buckets=...)``: off while a GPU A/B is pending (docs/gpu.md)
T = TypeVar("T")
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


# ---------------------------------------------------------------- the engine


class _Option(Generic[T]):
    """An engine attribute that is the field of that name of its ``options`` (read and set), so
    the parts that read the options see a change at their next call."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, engine: TrainerEngine | None, owner: type | None = None) -> T:
        if engine is None:  # on the class: the descriptor itself
            return cast(T, self)
        return cast(T, getattr(engine.options, self.name))

    def __set__(self, engine: TrainerEngine, value: T) -> None:
        setattr(engine.options, self.name, value)


class TrainerEngine:
    """One resident base model; per-job LoRA adapters and AdamW states; GRPO steps on demand.

    Its parts, each owning its state: ``slots`` (``JobSlots``: the jobs' adapters and states on
    the device, parking, swapping), ``math`` (``TrainingMath``: steps, gradients, log-probs over
    batches) and ``token_losses`` (``TokenLosses``: Tinker's ``forward_backward`` and
    ``optim_step``); they share ``options`` (``PassOptions``). The engine owns the base model,
    its layer options, its sleep and its files, and answers every call, handing it to its part."""

    micro_batch_rows: _Option[int | None] = _Option()
    micro_batch_tokens: _Option[int | None] = _Option()
    logprob_chunk_tokens: _Option[int] = _Option()
    length_buckets: _Option[bool] = _Option()
    fuse_lora: _Option[bool] = _Option()
    pack_rows: _Option[bool] = _Option()
    logprob_vocab_block: _Option[int | None] = _Option()
    compile_layers: _Option[str | None] = _Option()

    def __init__(
        self,
        model_path: str,
        dtype: str = ENGINE_DEFAULTS["cpu"].dtype,
        device: str = "cpu",
        threads: int | None = None,
        micro_batch_rows: int | None = None,
        micro_batch_tokens: int | None = None,
        logprob_chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS,
        gradient_checkpointing: bool = False,
        checkpoint_scope: str = "layer",
        compile_layers: str | None = None,
        length_buckets: bool = LENGTH_BUCKETS,
        fuse_lora: bool = False,
        pack_rows: bool = False,
        logprob_vocab_block: int | None = None,
    ) -> None:
        """``dtype``: the base weights' (bfloat16 / float16 engines also compute under autocast;
        adapters and AdamW stay float32). ``micro_batch_rows`` / ``micro_batch_tokens``: a
        forward/backward takes at most so many rows / padded tokens (None: no limit).
        ``logprob_chunk_tokens``: positions whose logits exist at once. ``gradient_checkpointing``:
        the decoder layers recompute their activations in the backward; ``checkpoint_scope``
        which: ``"layer"`` (whole layers), ``"mlp"`` or ``"attn"`` (that part of each layer,
        ``worker.decoder_layers``). ``compile_layers``: the ``torch.compile`` backend the decoder
        layers run under (``"inductor"``; None: eager). ``length_buckets``: a batch of several
        micro-batches is cut with its rows ordered by length (``worker.train_batches.length_order``).
        ``fuse_lora``: a job's step runs the LoRA A matmuls of q/k/v and of gate/up as one each
        (``worker.fused_lora``; LoRA without dropout). ``pack_rows``: a micro-batch's rows run
        through the decoder packed into one sequence, without padding (``token_logprobs``).
        ``logprob_vocab_block``: a chunk's log-softmax taken over the vocabulary in blocks of so
        many tokens, its logits kept in the head's dtype (None: the whole vocabulary in fp32)."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        micro_batch_bounds([1], micro_batch_rows, micro_batch_tokens)  # refuses limits under 1
        if logprob_chunk_tokens < 1:
            raise ValueError(f"logprob_chunk_tokens must be at least 1, got {logprob_chunk_tokens}")
        if logprob_vocab_block is not None and logprob_vocab_block < 1:
            raise ValueError(f"logprob_vocab_block must be at least 1, got {logprob_vocab_block}")
        if threads is not None:
            torch.set_num_threads(threads)
        self.model_path = model_path
        self.dtype = dtype
        self.device = torch.device(device)
        self.options = PassOptions(
            micro_batch_rows=micro_batch_rows,
            micro_batch_tokens=micro_batch_tokens,
            logprob_chunk_tokens=logprob_chunk_tokens,
            length_buckets=length_buckets,
            fuse_lora=fuse_lora,
            logprob_vocab_block=logprob_vocab_block,
        )
        self._torch_dtype = DTYPES[dtype]
        self._base = _load_base_model(model_path, self._torch_dtype, self.device)
        self._base_params = dict(self._base.named_parameters())  # before any adapter: the model's own names
        self.set_pack_rows(pack_rows)
        self.gradient_checkpointing, self.checkpoint_scope = False, "layer"
        self._layers_rewired = False  # a scope's wrappers or compiled layers are in place (not undone)
        self.set_layer_options(gradient_checkpointing, checkpoint_scope, compile_layers)
        self._cuda = self.device.type == "cuda"
        self.slots = JobSlots(self._base, self._base_params, model_path, self.device)
        self.math = TrainingMath(
            self.slots, self._base, self._base_params, self.options, self._torch_dtype, self.device
        )
        self.token_losses = TokenLosses(self.slots, self.math, self._base, self.options, self.device)
        self.awake = True  # the base's weights on the engine's device (see ``sleep``)
        self.host_arena: HostArena | None = None  # where the base sleeps (made on the first sleep if unset)
        self.ranks = 1  # the ranks its base is sharded over (``shard_base``), and their mesh
        self._mesh: Any = None
        self.step_info: dict[str, Any] = {}  # the memory plan's step, as ``status`` shows it (the worker sets it)

    # ------------------------------------------------------------ the parts' calls

    def ensure_job(self, job_id: str, lora: LoraSpec | None, seed: int) -> None:
        """``JobSlots.ensure_job``: the job's adapter (a function of ``seed``) and AdamW, if not there."""
        self.slots.ensure_job(job_id, lora, seed)

    def shard_base(self, mesh: Any) -> None:
        """Shard the base model's weights over ``mesh`` (torch's FSDP2, ``fully_shard``): one unit
        per decoder layer and the decoder (embeddings, final norm) as the root; the lm_head stays
        whole, as the chunked log-probs read its weight outside a forward. Done before any job
        exists, so jobs' adapters stay plain tensors and a full fine-tuning job's weights are
        made as shards; the parts' table of base parameters then names the shards (the whole
        weights are freed). Every rank must then run the same forwards."""
        from torch.distributed.fsdp import fully_shard

        if self.slots.jobs():
            raise RuntimeError("the base is sharded before any job is made")
        decoder, _ = causal_lm_parts(self._base)
        units = [fully_shard(layer, mesh=mesh) for layer in decoder_layers(self._base)]
        units.append(fully_shard(decoder, mesh=mesh))
        own = dict(self._base.named_parameters())
        for name in self._base_params:
            self._base_params[name] = own[name]
        self.ranks, self._mesh = int(mesh.size()), mesh
        self.math.sharded = ShardedBase(units, self.ranks)

    def base_bytes(self) -> int:
        """Bytes of the base's weights this process holds (a sharded base: its shards, the whole
        lm_head, which with tied embeddings is then a whole copy of the split embedding)."""
        _, head = causal_lm_parts(self._base)
        held: dict[int, torch.Tensor] = {id(param): param for param in self._base_params.values()}
        held.setdefault(id(head.weight), cast(torch.Tensor, head.weight))
        total = 0
        for param in held.values():
            local = param.to_local() if hasattr(param, "to_local") else param
            total += local.numel() * local.element_size()
        return total

    def release(self, job_id: str) -> None:
        """``JobSlots.release``: the job's state leaves the device (its adapter parked)."""
        self.slots.release(job_id)

    def jobs(self) -> list[str]:
        """Resident jobs, in the order they were created."""
        return self.slots.jobs()

    def state_bytes(self, job_id: str) -> int:
        """``JobSlots.state_bytes``: bytes of the job's adapter, moments and step counts."""
        return self.slots.state_bytes(job_id)

    def adapter_state_dict(self, job_id: str) -> dict[str, torch.Tensor]:
        """The job's adapter weights under their PEFT-file keys: live tensors, not copies."""
        return self.slots.adapter_state_dict(job_id)

    def optimizer_state_dict(self, job_id: str) -> dict[str, Any]:
        """The job's AdamW ``state_dict()`` (its tensors are live, not copies)."""
        return self.slots.optimizer_state_dict(job_id)

    def export_state(self, job_id: str, pool: BufferPool | None = None) -> JobStateCopy:
        """``JobSlots.export_state``: a host copy of the job's state; the job stays resident."""
        return self.slots.export_state(job_id, pool)

    def import_state(self, job_id: str, copy: JobStateCopy) -> None:
        """``JobSlots.import_state``: the job's state recreated exactly from ``copy``."""
        self.slots.import_state(job_id, copy)

    @property
    def slabs(self) -> SlabCounts:
        return self.slots.slabs

    @property
    def attached_adapters(self) -> int:
        """Adapters in the PeftModel: the resident jobs' plus the parked ones."""
        return self.slots.attached_adapters

    def _job(self, job_id: str) -> JobState:
        """The resident job's state (``UnknownJobError`` if not resident): for tests and benches."""
        return self.slots.job(job_id)

    def train_step(self, job_id: str, batch: TrainBatch, hp: TrainHParams) -> dict[str, float]:
        """``TrainingMath.train_step``: one optimizer step on the job; its metrics."""
        return self.math.train_step(job_id, batch, hp)

    def loss_gradients(
        self, job_id: str, batch: TrainBatch, hp: TrainHParams
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """``TrainingMath.loss_gradients``: the loss gradient without stepping (tests, diagnostics)."""
        return self.math.loss_gradients(job_id, batch, hp)

    def logprobs(self, job_id: str, input_ids: list[list[int]], loss_mask: list[list[int]]) -> list[list[float]]:
        """``TrainingMath.logprobs``: current-policy log-probs of every token; 0 where masked."""
        return self.math.logprobs(job_id, input_ids, loss_mask)

    def groupable(self, job_id: str) -> bool:
        """``TrainingMath.groupable``: whether the job's steps may share a pass with others'."""
        return self.math.groupable(job_id)

    def train_group(self, steps: list[tuple[str, TrainBatch, TrainHParams]]) -> list[dict[str, float]]:
        """``TrainingMath.train_group``: one step for each job, their rows in shared micro-batches."""
        return self.math.train_group(steps)

    def group_gradients(
        self, steps: list[tuple[str, TrainBatch, TrainHParams]]
    ) -> list[tuple[dict[str, torch.Tensor], dict[str, float]]]:
        """``TrainingMath.group_gradients``: each job's loss gradient from a shared pass."""
        return self.math.group_gradients(steps)

    def forward_backward(self, job_id: str, call: LossCall) -> ForwardBackwardResult:
        """``TokenLosses.forward_backward``: log-probs and loss of a Tinker loss call; nothing changes."""
        return self.token_losses.forward_backward(job_id, call)

    def optim_step(self, job_id: str, calls: list[LossCall], adam: AdamStep) -> OptimStepResult:
        """``TokenLosses.optim_step``: the calls' summed gradient, then one AdamW step."""
        return self.token_losses.optim_step(job_id, calls, adam)

    # ------------------------------------------------------------ how the layers run

    def set_pack_rows(self, on: bool) -> None:
        """Pack a micro-batch's rows (``pack_rows``), with the attention kernel that makes it pay
        where there is one (``worker.engine_options.trainer_attention``)."""
        self.options.pack_rows = on
        kernel = trainer_attention(self.device.type, self.dtype, on, importlib.util.find_spec("flash_attn") is not None)
        if kernel is not None:
            cast(Any, self._base).set_attn_implementation(kernel)

    def set_layer_options(
        self, gradient_checkpointing: bool, checkpoint_scope: str = "layer", compile_layers: str | None = None
    ) -> None:
        """How the decoder layers run (the constructor's options of those names). Whole-layer
        checkpointing may be switched on and off; a part's checkpointing or compiled layers are
        set once (``RuntimeError`` after that), before or after the first job."""
        if checkpoint_scope not in CHECKPOINT_SCOPES:
            raise ValueError(f"checkpoint_scope must be one of {CHECKPOINT_SCOPES}, got {checkpoint_scope!r}")
        selective = gradient_checkpointing and checkpoint_scope != "layer"
        if self._layers_rewired and (selective or compile_layers is not None):
            raise RuntimeError("a trainer's checkpoint scope and compiled layers are set once")
        whole = gradient_checkpointing and checkpoint_scope == "layer"
        model: Any = self._base  # a transformers PreTrainedModel
        if whole:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            # non-reentrant checkpoints reach the adapters inside a layer without a grad-requiring
            # input: the embeddings' hook transformers adds would only extend the backward
            model.disable_input_require_grads()
        elif model.is_gradient_checkpointing:
            model.gradient_checkpointing_disable()
        if selective:
            checkpoint_submodules(self._base, checkpoint_scope)
        if compile_layers is not None:
            compile_decoder_layers(self._base, compile_layers)
        self._layers_rewired = self._layers_rewired or selective or compile_layers is not None
        self.gradient_checkpointing, self.checkpoint_scope = gradient_checkpointing, checkpoint_scope
        self.options.compile_layers = compile_layers or self.options.compile_layers
        # HF checkpoints a decoder layer only while the layer is in training mode (``forward_context``)
        self.options.checkpointed_layers = [m for m in decoder_layers(self._base) if whole]

    # ------------------------------------------------------------ taking turns with other bases

    def sleep(self) -> None:
        """Give the device to another base's trainer: the base model's own weights (the params it
        had before any adapter; a full fine-tuning job's weights while it is resident) move to
        one block of ``host_arena`` (pinned on CUDA), a non-blocking copy per weight and one
        synchronize; what the adapters, AdamW states and the store's tiers hold stays where it
        is. ``wake`` brings them back, the same bits, and gives the block back; no step may run
        asleep. An arena with no block for the base: a host tensor per weight, logged."""
        if not self.awake:
            return
        if self.ranks > 1:
            raise RuntimeError("a sharded base does not sleep (one model per trainer engine of several ranks)")
        params = list(self._base_params.values())
        arena = self._sleep_arena()
        with torch.no_grad():
            try:
                _, views = tensors_to_host([p.data for p in params], arena)
            except HostMemoryError as exc:
                log.warning("trainer %s: the base sleeps outside its host arena, slowly (%s)", self.model_path, exc)
                views = [torch.empty(p.shape, dtype=p.dtype, pin_memory=self._cuda).copy_(p.data) for p in params]
            for p, view in zip(params, views):
                p.data = view
        if self._cuda:
            torch.cuda.empty_cache()
        self.awake = False

    def wake(self) -> None:
        """The base's weights back on the engine's device (``sleep`` undone; its arena block,
        held by the weights alone, goes back to the arena as they leave it)."""
        if self.awake:
            return
        params = list(self._base_params.values())
        with torch.no_grad():
            for p, on_device in zip(params, tensors_to_device([p.data for p in params], self.device)):
                p.data = on_device
        self.awake = True

    def _sleep_arena(self) -> HostArena:
        """``host_arena``; on the first sleep without one, an arena of the base's packed size
        (pinned on CUDA), kept for the next sleeps."""
        if self.host_arena is None:
            _, nbytes = packed_layout([p.data for p in self._base_params.values()])
            self.host_arena = HostArena(nbytes, pinned=self._cuda)
            log.info("trainer %s: a host arena of %.2f GiB for its base's sleeps", self.model_path, nbytes / 2**30)
        return self.host_arena

    # ------------------------------------------------------------ adapters and checkpoints

    def save_adapter(self, job_id: str, out_dir: str, write: bool = True) -> None:
        """Write the job's adapter in PEFT layout at the top level of ``out_dir``, atomically
        (``NoSpaceError`` when its filesystem is full), its weights in the engine's dtype (what
        the rollout engine serves in); a checkpoint keeps them as trained, in float32.

        On a sharded base every rank calls it for a full fine-tuning job (its weights are
        gathered, one at a time, cast as they come) and only a rank that ``write``s writes."""
        job = self.slots.job(job_id)
        if not write and not self._gathered(job):
            return
        weights = self._adapter_weights(job, self._torch_dtype, keep=write)
        if not write:
            return
        write_dir_atomically(
            Path(out_dir),
            lambda tmp: self._write_adapter_files(job, tmp, weights),
            what=f"adapter of job {job_id!r}",
            nbytes=len(weights),
        )

    def save_checkpoint(self, job_id: str, out_dir: str, extra: dict, write: bool = True) -> dict:
        """Write adapter + optimizer + RNG + ``extra`` + a sha256 manifest, atomically.

        Everything is serialised before the first byte is written; ``NoSpaceError`` when the
        filesystem is full (the temp dir is removed, an earlier checkpoint is untouched). A job
        sharded over the ranks writes its shards, each rank its own (every rank calls it; one that
        does not ``write`` returns ``{}``; ``worker.checkpoint_shards``); any width restores it."""
        job = self.slots.job(job_id)
        if self._gathered(job):
            return self._save_shards(job, Path(out_dir), extra, write)
        if not write:
            return {}
        payload = self._checkpoint_payload(job, extra)
        return write_dir_atomically(
            Path(out_dir),
            lambda tmp: self._write_checkpoint_files(job, tmp, payload),
            what=_checkpoint_what(extra),
            nbytes=sum(len(data) for data in payload.values()),
        )

    def _save_shards(self, job: JobState, out_dir: Path, extra: dict, write: bool) -> dict:
        """Rank 0 (``write``) makes the temp dir and tells the others; every rank writes its shards
        of the weights and moments there; rank 0 then the small files and the manifest, and renames it."""
        group = self._mesh.get_group()
        state = self._shard_state(job)
        if not write:
            tmp = shared_dir(None, group)
            if tmp is not None:
                write_shards(state, tmp, group)
            return {}
        told = False

        def write_files(tmp: Path) -> dict:
            nonlocal told
            told = True
            shared_dir(tmp, group)
            shards = write_shards(state, tmp, group)
            return self._write_checkpoint_files(job, tmp, payload, shards)

        try:
            payload = self._checkpoint_payload(job, extra, moments=False)
            nbytes = self.ranks * sum(t.numel() * t.element_size() for t in state.values() if is_shard(t))
            return write_dir_atomically(out_dir, write_files, what=_checkpoint_what(extra), nbytes=nbytes)
        except BaseException:
            if not told:  # the others wait for the temp dir's name: none, so they stop too
                shared_dir(None, group)
            raise

    def _shard_state(self, job: JobState) -> dict[str, torch.Tensor]:
        """The job's weights and AdamW moments as DCP saves and loads them: this rank's shards as
        DTensors of the base's mesh (the lm_head whole), by parameter name."""
        state: dict[str, torch.Tensor] = {}
        moments = job.optimizer.state_dict()["state"]
        for index, (key, param) in enumerate(job.params.items()):
            like = self._base_params[key]
            state[f"weight/{key}"] = as_shard(param.detach(), like)
            for name, view in moments.get(index, {}).items():
                if name != "step":
                    state[f"moment/{key}/{name}"] = as_shard(view, like)
        return state

    def load_checkpoint(
        self, job_id: str, ckpt_dir: str, lora: LoraSpec | None, seed: int, weights_only: bool = False
    ) -> dict:
        """Verify a checkpoint, restore the job's adapter and optimizer exactly (``weights_only``:
        the optimizer as before its first step); return ``extra``."""
        directory = Path(ckpt_dir)
        manifest = read_manifest(directory)
        sharded = is_sharded(manifest)
        if sharded and self.ranks > 1:  # the ranks read the files together, each its share
            verify_shared(directory, manifest, self._mesh.get_group())
        else:
            verify_checksums(directory, manifest)
        if manifest.get("lora") != lora_signature(lora):
            raise CheckpointError(
                f"checkpoint {directory} was written for LoRA {manifest.get('lora')}, not {lora_signature(lora)}"
            )
        tensors, trainer_state, extra = read_checkpoint_payload(directory, sharded)
        created = job_id not in self.slots.jobs()
        self.slots.ensure_job(job_id, lora, seed)
        job = self.slots.job(job_id)
        try:
            if sharded:
                tensors = self._read_shards(job, directory, trainer_state)
            elif self._gathered(job):
                tensors, trainer_state = self._shards_of(job, tensors, trainer_state)
            _restore_job_state(job, tensors, trainer_state, directory)
            if weights_only:
                with torch.no_grad():
                    for views in job.slot.moments.values():
                        for view in views.values():
                            view.zero_()
        except BaseException:
            if created:
                self.slots.release(job_id)
            raise
        return extra

    # ------------------------------------------------------------ internals: files

    def _gathered(self, job: JobState) -> bool:
        """Whether the job's state is sharded over the ranks (a full fine-tuning job on a sharded base)."""
        return job.lora is None and self.ranks > 1

    def _whole(self, job: JobState, key: str, part: torch.Tensor) -> torch.Tensor:
        """The whole of the job's ``part`` of parameter ``key`` (its weight, a moment or a
        gradient): gathered from every rank's shard where the job is sharded, else ``part``."""
        return gather(part.detach(), self._base_params[key]) if self._gathered(job) else part.detach()

    def _adapter_weights(self, job: JobState, dtype: torch.dtype | None = None, keep: bool = True) -> bytes:
        """The adapter's safetensors file, in memory (written by ``write_file``, whose errors
        keep their errno, unlike safetensors' own writer); in ``dtype``, else as held. A sharded
        job's weights are gathered one at a time (every rank; ``keep`` False: none kept, b"")."""
        tensors = {}
        for key, param in job.params.items():
            whole = self._whole(job, key, param)
            if keep:
                tensors[key] = whole.to("cpu", dtype=dtype, copy=True)
        return safetensors_bytes(tensors, metadata={"format": "pt"}) if keep else b""

    def _shards_of(
        self, job: JobState, tensors: dict[str, torch.Tensor], trainer_state: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """A checkpoint's whole weights and moments cut to this rank's shards (as ``load_checkpoint``
        reads them: under the job's parameter keys, the optimizer's state by parameter index)."""
        keys = trainer_state.get("param_keys")
        if not isinstance(keys, list) or set(keys) != set(tensors) or set(keys) != set(job.params):
            return tensors, trainer_state  # ``_restore_job_state`` says what does not fit
        shards = {key: shard_of(tensors[key], self._base_params[key]) for key in keys}
        optimizer = dict(trainer_state.get("optimizer", {}))
        state = {}
        for index, moments in dict(optimizer.get("state", {})).items():
            like = self._base_params[keys[index]] if isinstance(index, int) and 0 <= index < len(keys) else None
            state[index] = {
                name: shard_of(value, like) if like is not None and name != "step" else value
                for name, value in moments.items()
            }
        optimizer["state"] = state
        return shards, {**trainer_state, "optimizer": optimizer}

    def _read_shards(self, job: JobState, directory: Path, trainer_state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """A sharded checkpoint's weights (returned) and moments (into ``trainer_state``'s optimizer
        state), as this engine holds them: each rank its shards, one rank the whole tensors."""
        keys = list(job.params)
        if trainer_state.get("param_keys") != keys:
            raise CheckpointError(f"checkpoint {directory}: adapter keys do not match the job's adapter")
        targets = {f"weight/{key}": as_shard(torch.empty_like(job.params[key]), self._base_params[key]) for key in keys}
        state = trainer_state.get("optimizer", {}).get("state", {})
        names = trainer_state.get("moments", {})
        for index, moments in names.items():
            key = keys[index]
            for name in moments:
                like = self._base_params[key]
                targets[f"moment/{key}/{name}"] = as_shard(torch.empty_like(job.params[key]), like)
        read_shards(targets, directory, self._mesh.get_group() if self.ranks > 1 else None)
        for index, moments in names.items():
            state.setdefault(index, {}).update({n: local(targets[f"moment/{keys[index]}/{n}"]) for n in moments})
        return {key: local(targets[f"weight/{key}"]) for key in keys}

    def _write_adapter_files(self, job: JobState, directory: Path, weights: bytes) -> None:
        if job.lora is None:  # full fine-tuning: the weights alone, what the rollout engine reloads
            write_file(directory / FULL_WEIGHTS_FILE, weights)
            return
        config = peft_config(job.lora, self.model_path)
        config.inference_mode = True
        config.save_pretrained(str(directory))
        write_file(directory / ADAPTER_WEIGHTS, weights)

    def _checkpoint_payload(self, job: JobState, extra: dict, moments: bool = True) -> dict[str, bytes]:
        """The checkpoint's files but the adapter config, serialised in memory: nothing is written
        for an ``extra`` that is not JSON, and the bytes a checkpoint needs are known up front.
        ``moments`` False (a sharded job, whose shards DCP writes): no weights, and the optimizer's
        state holds its step counts, the moments' names under ``moments``."""
        optimizer = job.optimizer.state_dict()  # cloned: views would save the whole slot
        optimizer["state"] = {
            i: {k: v.clone() for k, v in state.items() if moments or k == "step"}
            for i, state in optimizer["state"].items()
        }
        trainer_state = {
            "optimizer": optimizer,
            "rng": {name: t.clone() for name, t in job.rng_state.items()},
            "param_keys": list(job.params),
        }
        if not moments:
            named = job.optimizer.state_dict()["state"]
            trainer_state["moments"] = {i: [k for k in state if k != "step"] for i, state in named.items()}
        buffer = io.BytesIO()
        torch.save(trainer_state, buffer)  # into memory: torch's own file writer loses the errno
        payload = {TRAINER_STATE: buffer.getvalue(), EXTRA: json.dumps(extra, sort_keys=True).encode()}
        if moments:
            payload[ADAPTER_WEIGHTS] = self._adapter_weights(job)
        return payload

    def _write_checkpoint_files(
        self, job: JobState, directory: Path, payload: dict[str, bytes], shards: dict[str, Any] | None = None
    ) -> dict:
        """The payload's files and the manifest; ``shards``: the files every rank wrote (a sharded
        checkpoint: the weights and moments are there, not in ``ADAPTER_WEIGHTS``)."""
        if job.lora is None:  # the same files: the weights in ADAPTER_WEIGHTS, a config that says so
            write_file(directory / ADAPTER_CONFIG, json.dumps(lora_signature(None)).encode())
            if shards is None:
                write_file(directory / ADAPTER_WEIGHTS, payload[ADAPTER_WEIGHTS])
        else:
            self._write_adapter_files(job, directory, payload[ADAPTER_WEIGHTS])
        for name in (TRAINER_STATE, EXTRA):
            write_file(directory / name, payload[name])
        names = CHECKPOINT_FILES if shards is None else SHARDED_FILES
        manifest = {
            "format": CHECKPOINT_FORMAT,
            "job_id": job.job_id,
            "seed": job.seed,
            "lora": lora_signature(job.lora),
            "base_model": self.model_path,
            "files": {name: file_record(directory / name) for name in names} | (shards or {}),
        }
        if shards is not None:
            manifest |= {"layout": "sharded", "width": self.ranks}
        with open(directory / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
        return manifest


def _checkpoint_what(extra: Any) -> str:
    """``checkpoint step 12``, as an error names what it was writing."""
    step = extra.get("step") if isinstance(extra, dict) else None
    return f"checkpoint step {step}" if isinstance(step, int) else "checkpoint"


# ---------------------------------------------------------------- model helpers


def _load_base_model(model_path: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    check_plain_head(model.config)
    model.to(device)  # type: ignore[arg-type]  # transformers' functools.wraps on .to
    model.eval()
    model.requires_grad_(False)
    return model


# ---------------------------------------------------------------- restoring a checkpoint


def _restore_job_state(
    job: JobState, tensors: dict[str, torch.Tensor], trainer_state: dict[str, Any], directory: Path
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
        store_rng(job.rng_state, rng)
