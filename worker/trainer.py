"""The trainer engine: one resident base model, many jobs' LoRA adapters or full weights, with
their AdamW states.

``TrainerEngine`` loads a base model once (transformers) and serves any number of jobs on it:
its slots (``worker.trainer_slots``: each job's adapter, AdamW and RNG state in one flat buffer,
created, released, exported and imported), its math (``worker.trainer_math``: ``train_step``,
``loss_gradients``, ``logprobs``) and, here, its files: adapters in the exact PEFT layout that
vLLM's ``LoRARequest`` and ``peft.PeftModel.from_pretrained`` load (in the engine's dtype), and
durable checkpoints (adapter + optimizer + RNG + the driver's ``extra``, float32, with a sha256
manifest; ``worker.checkpoint_files``), written atomically and verified before a restore. A
full fine-tuning job publishes ``model.safetensors`` (every weight, the engine's dtype, the
model's parameter names: what the rollout engine reloads) and checkpoints the same files as an
adapter job, its float32 weights where the adapter would be.

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
from typing import Any, cast

import torch
from safetensors.torch import save as safetensors_bytes
from transformers import AutoModelForCausalLM

from plexctl.common.spec import LoraSpec
from worker.checkpoint_files import (
    ADAPTER_CONFIG,
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
from worker.decoder_layers import CHECKPOINT_SCOPES, checkpoint_submodules, decoder_layers
from worker.decoder_layers import compile_layers as compile_decoder_layers
from worker.engine_options import trainer_attention
from worker.errors import CheckpointError
from worker.state.arena import HostArena, HostMemoryError
from worker.state.job_copy import POOL_KEEP, packed_layout, tensors_to_device, tensors_to_host
from worker.token_logprobs import DEFAULT_LOGPROB_CHUNK_TOKENS, check_plain_head
from worker.train_batches import micro_batch_bounds
from worker.trainer_math import TrainingMath
from worker.trainer_slots import PARKED_ADAPTERS_MAX, JobState, SlabCounts, lora_signature, peft_config, store_rng
from worker.trainer_tokens import TokenLossMath

__all__ = ["DTYPES", "FULL_WEIGHTS_FILE", "PARKED_ADAPTERS_MAX", "TrainerEngine", "lora_signature"]

log = logging.getLogger(__name__)

FULL_WEIGHTS_FILE = "model.safetensors"  # a full fine-tuning job's published weights (model parameter names)
LENGTH_BUCKETS = False  # ``TrainerEngine(length_buckets=...)``: off while a GPU A/B is pending (docs/gpu.md)
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


# ---------------------------------------------------------------- the engine


class TrainerEngine(TokenLossMath, TrainingMath):
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
        if threads is not None:
            torch.set_num_threads(threads)
        self.model_path = model_path
        self.dtype = dtype
        self.device = torch.device(device)
        self.micro_batch_rows = micro_batch_rows
        self.micro_batch_tokens = micro_batch_tokens
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.length_buckets = length_buckets
        self.fuse_lora = fuse_lora
        if logprob_vocab_block is not None and logprob_vocab_block < 1:
            raise ValueError(f"logprob_vocab_block must be at least 1, got {logprob_vocab_block}")
        self.logprob_vocab_block = logprob_vocab_block
        self._torch_dtype = DTYPES[dtype]
        self._base = _load_base_model(model_path, self._torch_dtype, self.device)
        self._base_params = dict(self._base.named_parameters())  # before any adapter: the model's own names
        self.set_pack_rows(pack_rows)
        self.gradient_checkpointing, self.checkpoint_scope, self.compile_layers = False, "layer", None
        self._checkpointed_layers: list[torch.nn.Module] = []
        self._layers_rewired = False  # a scope's wrappers or compiled layers are in place (not undone)
        self.set_layer_options(gradient_checkpointing, checkpoint_scope, compile_layers)
        self._peft = None  # created with the first job's adapter
        self._jobs = {}
        self._cuda = self.device.type == "cuda"
        self._side_stream = None  # torch.cuda.Stream for state copies, made on first use
        # parked slots that keep their device buffer for the next import_state (on CUDA the caching allocator does)
        self._parked_memory = POOL_KEEP if self.device.type == "cpu" else 0
        self.slabs = SlabCounts()
        self._rng_shapes = {name: tuple(t.shape) for name, t in self._capture_rng().items()}
        self._adapters_made = 0
        self._parked = []  # oldest first
        self._user_losses = {}
        self.awake = True  # the base's weights on the engine's device (see ``sleep``)
        self.host_arena: HostArena | None = None  # where the base sleeps (made on the first sleep if unset)
        self.step_info: dict[str, Any] = {}  # the memory plan's step, as ``status`` shows it (the worker sets it)

    def set_pack_rows(self, on: bool) -> None:
        """Pack a micro-batch's rows (``pack_rows``), with the attention kernel that makes it pay
        where there is one (``worker.engine_options.trainer_attention``)."""
        self.pack_rows = on
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
        self.compile_layers = compile_layers or self.compile_layers
        # HF checkpoints a decoder layer only while the layer is in training mode (``_forward_context``)
        self._checkpointed_layers = [m for m in decoder_layers(self._base) if whole]

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

    def load_checkpoint(
        self, job_id: str, ckpt_dir: str, lora: LoraSpec | None, seed: int, weights_only: bool = False
    ) -> dict:
        """Verify a checkpoint, restore the job's adapter and optimizer exactly (``weights_only``:
        the optimizer as before its first step); return ``extra``."""
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
            if weights_only:
                with torch.no_grad():
                    for views in self._jobs[job_id].slot.moments.values():
                        for view in views.values():
                            view.zero_()
        except BaseException:
            if created:
                self.release(job_id)
            raise
        return extra

    # ------------------------------------------------------------ internals: files

    @staticmethod
    def _adapter_weights(job: JobState, dtype: torch.dtype | None = None) -> bytes:
        """The adapter's safetensors file, in memory (written by ``write_file``, whose errors
        keep their errno, unlike safetensors' own writer); in ``dtype``, else as held."""
        tensors = {key: param.detach().to("cpu", dtype=dtype, copy=True) for key, param in job.params.items()}
        return safetensors_bytes(tensors, metadata={"format": "pt"})

    def _write_adapter_files(self, job: JobState, directory: Path, weights: bytes) -> None:
        if job.lora is None:  # full fine-tuning: the weights alone, what the rollout engine reloads
            write_file(directory / FULL_WEIGHTS_FILE, weights)
            return
        config = peft_config(job.lora, self.model_path)
        config.inference_mode = True
        config.save_pretrained(str(directory))
        write_file(directory / ADAPTER_WEIGHTS, weights)

    def _checkpoint_payload(self, job: JobState, extra: dict) -> dict[str, bytes]:
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

    def _write_checkpoint_files(self, job: JobState, directory: Path, payload: dict[str, bytes]) -> dict:
        if job.lora is None:  # the same files: the weights in ADAPTER_WEIGHTS, a config that says so
            write_file(directory / ADAPTER_CONFIG, json.dumps(lora_signature(None)).encode())
            write_file(directory / ADAPTER_WEIGHTS, payload[ADAPTER_WEIGHTS])
        else:
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
