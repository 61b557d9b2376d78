"""The rollout engine: one resident vLLM engine that serves many jobs' LoRA adapters at once,
and full fine-tuning jobs' own weights, loaded in place by turns.

``RolloutEngine`` owns one offline ``vllm.LLM`` (``enable_lora=True``, built by
``worker.engine_args.rollout_engine_args``), batching continuously: ``start(key, request)`` adds a
job's ``GenRequest`` to the running batch, ``step()`` runs one engine step over everything in
flight (any jobs, any adapters) and hands back each request once all its prompts finished;
``generate(requests)`` runs a fixed set to the end; ``abort`` drops requests.

Invariants: each ``(job_id, version)`` gets a stable, unique LoRA id; only a job's newest version
stays loaded (unless a request in flight uses an older one); vLLM reloads an evicted one on
demand. A full fine-tuning job's version (``AdapterRef.full``) is its weights, loaded in place
before its requests start, the base's put back before a LoRA or base request, only on a switch
(requests in flight finish on their weights first): no job samples from another's weights. A
``Completion``'s ``token_ids`` include EOS when the sample stopped on it, its ``text`` never; its
``logprobs`` are under the model's own distribution (before temperature and top-p). With
``Sampling.seed = s`` and ``n`` samples per prompt, prompt ``i``'s sample ``j`` gets the vLLM seed
``s + i * n + j``: samples do not depend on the rest of the batch.

On CPU the engine core runs in this process with the workarounds its ``EngineArgsPlan`` flags
(``docs/gpu.md``). Calls are serialized by a lock (a heartbeat thread may ask for ``stats()``
mid-generate). It does not queue requests (the daemon does), compute rewards, write adapters
(the trainer publishes them), or stream partial outputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from plexctl.common.calls import MAX_TOPK, TokenLogprob
from plexctl.common.cluster_config import DEFAULTS
from plexctl.common.engine_defaults import CPU_KV_CACHE_GIB
from plexctl.common.protocol import AdapterRef, Completion, GenRequest, SampleTokens, Sampling
from worker import cpu_lora_ops, engine_args, vllm_private
from worker.engine_args import EngineArgsPlan, Platform, rollout_engine_args

log = logging.getLogger("plexrl.worker.rollout")

ENGINE_THREADS = 1  # torch threads of engine calls on CPU: vLLM's own serving policy
WARMUP_PROMPT = "0+0="  # any short text: unknown characters still tokenize (to <unk>)
REQUEST_ID_PREFIX = "plexrl-"  # the engine's own vLLM request ids (LLM.generate numbers its own)

# The real setter, captured before any in-process vLLM CPU worker replaces the attribute.
_set_torch_threads = vllm_private.real_set_num_threads()


class RolloutError(RuntimeError):
    """A generate call could not be served."""


class AdapterError(RolloutError):
    """An adapter could not be loaded (missing files, rank above max_lora_rank, ...)."""


class RequestError(RolloutError, ValueError):
    """A request is malformed (bad sampling values, prompt too long, ...)."""


# ---------------------------------------------------------------- adapter bookkeeping


@dataclasses.dataclass(frozen=True)
class AdapterKey:
    job_id: str
    version: int

    @property
    def name(self) -> str:
        return f"{self.job_id}@v{self.version}"


class AdapterRegistry:
    """Stable LoRA ids per (job, version) and the newest version seen per job (no vLLM)."""

    def __init__(self) -> None:
        self._ids: dict[AdapterKey, int] = {}
        self._newest: dict[str, int] = {}
        self._next_id = 1  # vLLM reserves 0 for "no LoRA"

    def lora_id(self, ref: AdapterRef) -> tuple[int, bool]:
        """The id of ``ref`` and whether it is new to the registry."""
        key = AdapterKey(ref.job_id, ref.version)
        new = key not in self._ids
        if new:
            self._ids[key] = self._next_id
            self._next_id += 1
        self._newest[ref.job_id] = max(ref.version, self._newest.get(ref.job_id, ref.version))
        return self._ids[key], new

    def newest_version(self, job_id: str) -> int | None:
        return self._newest.get(job_id)

    def knows(self, key: AdapterKey) -> bool:
        return key in self._ids

    def forget_version(self, key: AdapterKey) -> None:
        self._ids.pop(key, None)
        versions = [k.version for k in self._ids if k.job_id == key.job_id]
        if versions:
            self._newest[key.job_id] = max(versions)
        else:
            self._newest.pop(key.job_id, None)

    def stale_ids(self, job_id: str) -> list[int]:
        """Ids of this job's versions older than its newest."""
        newest = self._newest.get(job_id)
        return [i for k, i in self._ids.items() if k.job_id == job_id and k.version != newest]

    def job_ids(self, job_id: str) -> list[int]:
        return [i for k, i in self._ids.items() if k.job_id == job_id]

    def forget_job(self, job_id: str) -> None:
        for key in [k for k in self._ids if k.job_id == job_id]:
            del self._ids[key]
        self._newest.pop(job_id, None)

    def jobs(self) -> list[str]:
        return sorted(self._newest)

    def key_of(self, lora_id: int) -> AdapterKey | None:
        for key, i in self._ids.items():
            if i == lora_id:
                return key
        return None

    def __len__(self) -> int:
        return len(self._ids)


# ---------------------------------------------------------------- request translation


def validate_sampling(s: Sampling) -> None:
    if s.n < 1:
        raise RequestError(f"sampling.n must be >= 1, got {s.n}")
    if s.max_tokens < 1:
        raise RequestError(f"sampling.max_tokens must be >= 1, got {s.max_tokens}")
    if s.temperature < 0:
        raise RequestError(f"sampling.temperature must be >= 0, got {s.temperature}")
    if not 0 < s.top_p <= 1:
        raise RequestError(f"sampling.top_p must be in (0, 1], got {s.top_p}")
    if s.temperature == 0 and s.n > 1:
        raise RequestError(f"greedy sampling (temperature 0) gives one sample, got n={s.n}")
    for name in ("topk_prompt_logprobs", "topk_logprobs"):
        if not 0 <= getattr(s, name) <= MAX_TOPK:
            raise RequestError(f"sampling.{name} must be in [0, {MAX_TOPK}], got {getattr(s, name)}")
    if s.stream and (s.n > 1 or s.prompt_logprobs or s.topk_prompt_logprobs):
        raise RequestError("a streamed sampling takes one sample per prompt and no prompt log-probs")


def prompt_seed(s: Sampling, prompt_index: int) -> int | None:
    """Seed of one prompt: samples of a request never share a seed (vLLM adds j < n)."""
    return None if s.seed is None else s.seed + prompt_index * s.n


def sampling_params(s: Sampling, prompt_index: int) -> Any:
    """vLLM's parameters for one prompt: token ids and flat log-probs only; the engine
    decodes each finished sample itself (``to_completions``), vLLM only where it must match
    ``stop`` strings."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    return SamplingParams(
        n=s.n,
        temperature=s.temperature,
        top_p=s.top_p,
        max_tokens=s.max_tokens,
        top_k=s.top_k,
        stop=list(s.stop) or None,
        stop_token_ids=list(s.stop_token_ids) or None,
        ignore_eos=s.ignore_eos,
        seed=prompt_seed(s, prompt_index),
        logprobs=s.topk_logprobs,  # the sampled token's log-prob first, then the k likeliest
        # 0: only the prompt token's own; k: with the k likeliest
        prompt_logprobs=s.topk_prompt_logprobs if s.prompt_logprobs or s.topk_prompt_logprobs else None,
        skip_special_tokens=True,
        detokenize=bool(s.stop),  # vLLM matches stop strings on the text it decodes
        flat_logprobs=True,
        # one output per prompt when it finished; streamed: every step's, each with all its tokens so far
        output_kind=RequestOutputKind.CUMULATIVE if s.stream else RequestOutputKind.FINAL_ONLY,
        # decoding held to the schema: vLLM masks every token the schema's grammar does not allow next
        structured_outputs=StructuredOutputsParams(json=s.json_schema) if s.json_schema is not None else None,
    )


def sampled_logprobs(token_ids: list[int], steps: Any, since: int = 0) -> list[float]:
    """The log-prob of each sampled token (from position ``since``), from vLLM's flat log-probs
    (``logprobs=0``: one entry per position, the sampled token's)."""
    if steps is None or len(steps) != len(token_ids):
        raise RolloutError("vLLM returned no or mismatched log-probs for a completion")
    ids, values = vllm_private.sampled_token_logprobs(steps, since)
    if ids != token_ids[since:]:
        raise RolloutError("vLLM's log-probs are not those of the sampled tokens")
    return values


def to_completions(output: Any, prompt_index: int, tokenizer: Any, s: Sampling) -> list[Completion]:
    """One vLLM ``RequestOutput`` (n samples of one prompt) as Completions, index order;
    each text is its tokens decoded at once (special tokens skipped, no clean-up of spaces:
    what vLLM's own detokenizer gives). The prompt's log-probs and top-k as ``s`` asks."""
    prompt_ids = list(output.prompt_token_ids or [])
    prompt_lps = getattr(output, "prompt_logprobs", None)
    own = prompt_lps is not None and s.prompt_logprobs
    prompt_logprobs = vllm_private.prompt_token_logprobs(prompt_ids, prompt_lps) if own else []
    k = s.topk_prompt_logprobs
    topk = vllm_private.prompt_topk_logprobs(prompt_ids, prompt_lps, k) if prompt_lps is not None and k else []
    samples = sorted(output.outputs, key=lambda c: c.index)
    token_ids = [list(c.token_ids) for c in samples]
    texts = tokenizer.batch_decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return [
        Completion(
            prompt_index=prompt_index,
            text=text,
            prompt_token_ids=prompt_ids,
            token_ids=ids,
            logprobs=sampled_logprobs(ids, c.logprobs),
            finish_reason=c.finish_reason or "unknown",
            prompt_logprobs=prompt_logprobs,
            topk_prompt_logprobs=[None if row is None else [TokenLogprob(t, lp) for t, lp in row] for row in topk],
            topk_logprobs=[
                [TokenLogprob(t, lp) for t, lp in row]
                for row in (vllm_private.sampled_topk_logprobs(c.logprobs, s.topk_logprobs) if s.topk_logprobs else [])
            ],
        )
        for c, ids, text in zip(samples, token_ids, texts)
    ]


def check_adapter_dir(ref: AdapterRef) -> None:
    """Fail early, with the job's name, when an adapter directory is not a peft adapter."""
    if not (Path(ref.path) / "adapter_config.json").is_file():
        raise AdapterError(f"adapter {ref.job_id}@v{ref.version}: no adapter_config.json in {ref.path}")


# ---------------------------------------------------------------- process-level settings


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch intra-op threads, then restore the caller's count."""
    previous = torch.get_num_threads()
    if previous != n:
        _set_torch_threads(n)
    try:
        yield
    finally:
        if previous != n:
            _set_torch_threads(previous)


@contextlib.contextmanager
def scoped_env(forced: dict[str, str], defaults: dict[str, str]) -> Iterator[None]:
    """For the block only: set ``forced`` variables, and ``defaults`` where unset."""
    previous = {k: os.environ.get(k) for k in [*forced, *defaults]}
    os.environ.update(forced)
    for k, v in defaults.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for name, value in previous.items():
            restore_env(name, value)


def restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


# ---------------------------------------------------------------- the engine


@dataclasses.dataclass
class _InFlight:
    request: GenRequest
    lora_id: int | None
    prompt_of: dict[str, int]  # vLLM request id -> prompt index
    outputs: dict[int, Any]  # prompt index -> finished RequestOutput
    sent: dict[int, int] = dataclasses.field(default_factory=dict)  # streamed: prompt index -> tokens told


class RolloutEngine:
    """One resident vLLM engine serving the base model and many jobs' LoRA adapters."""

    def __init__(
        self,
        model_path: str,
        dtype: str | None = None,
        max_lora_rank: int | None = None,
        max_loras: int | None = None,
        max_cpu_loras: int | None = None,
        max_model_len: int | None = None,
        seed: int = 0,
        kv_cache_gib: float = CPU_KV_CACHE_GIB,
        platform: Platform | None = None,
        gpu_memory_utilization: float | None = None,
        tensor_parallel_size: int = DEFAULTS.tp,
        sleep_mode: bool = False,
    ) -> None:
        """Start the engine and warm it up (logged). ``sleep_mode`` (CUDA): ``sleep()`` and
        ``wake()`` let it take turns with other models' engines on the same GPUs. ``platform``
        None: "cuda" when torch sees a GPU, else "cpu"; ``kv_cache_gib`` sizes the KV cache on
        CPU, ``gpu_memory_utilization`` on CUDA (see ``worker.engine_args``; bad values raise
        ``EngineArgsError``; what is None gets the platform's default, ``rollout_engine_args``).
        Adapters of rank above ``max_lora_rank`` are refused with ``AdapterError``."""
        self.model_path = str(model_path)
        self.plan: EngineArgsPlan = rollout_engine_args(
            platform or engine_args.platform(),
            self.model_path,
            dtype=dtype,
            max_lora_rank=max_lora_rank,
            max_loras=max_loras,
            max_cpu_loras=max_cpu_loras,
            max_model_len=max_model_len,
            seed=seed,
            kv_cache_gib=kv_cache_gib,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            sleep_mode=sleep_mode,
        )
        self.max_lora_rank: int = self.plan.llm_kwargs["max_lora_rank"]
        self._registry = AdapterRegistry()
        self._counters = {"requests": 0, "prompts": 0, "sequences": 0, "tokens_generated": 0}
        self._closed = False
        self._lock = threading.RLock()
        self._pending: dict[Any, _InFlight] = {}  # requests in flight, by the caller's key
        self._owner: dict[str, Any] = {}  # vLLM request id -> key
        self._finished: list[tuple[Any, list[Completion]]] = []  # done before any step (no prompts)
        self._partials: list[tuple[Any, list[SampleTokens]]] = []  # streamed requests' new tokens, not yet taken
        self._request_ids = itertools.count()
        self._weights: AdapterKey | None = None  # the full fine-tuning policy whose weights vLLM holds (None: the base)
        self.weight_loads = 0  # weights loaded in place (a switch between a full job's policy and the base)
        self.awake = True  # False while asleep (sleep mode): weights in pinned host memory, no KV cache
        self.wakes = 0
        t0 = time.perf_counter()
        self._llm = self._start(self.plan)
        self._engine = vllm_private.llm_engine(self._llm)
        self._tokenizer = self._llm.get_tokenizer()
        self.startup_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        self._warm_up()
        self._counters = dict.fromkeys(self._counters, 0)
        self.warmup_seconds = time.perf_counter() - t1
        log.info(
            "rollout engine for %s ready on %s (%s): start %.1f s, warm-up %.1f s",
            self.model_path,
            self.plan.platform,
            "in-process" if self.plan.in_process else "own process",
            self.startup_seconds,
            self.warmup_seconds,
        )

    # ------------------------------------------------------------ lifecycle

    @staticmethod
    def _start(plan: EngineArgsPlan) -> Any:
        from vllm import LLM

        if plan.install_cpu_lora_ops:
            cpu_lora_ops.install()
        if plan.eager_sampler_ops:
            vllm_private.eager_sampler_ops()
        for name in plan.env_defaults:
            if name in os.environ:
                log.info("%s=%s overrides the engine's default %s", name, os.environ[name], plan.env_defaults[name])
        keep_setter = torch.set_num_threads
        keep_preload = os.environ.get("LD_PRELOAD")
        try:
            with scoped_env(plan.env_forced, plan.env_defaults):
                return LLM(**plan.llm_kwargs)
        finally:
            if plan.undo_cpu_worker_patches:
                torch.set_num_threads = keep_setter  # undo the in-process CPU worker's no-op patch
                restore_env("LD_PRELOAD", keep_preload)  # meant for vLLM's own subprocesses only

    def _engine_threads(self) -> contextlib.AbstractContextManager[None]:
        """Around each engine call: ENGINE_THREADS torch threads on CPU, nothing on CUDA."""
        return torch_threads(ENGINE_THREADS) if self.plan.pin_threads else contextlib.nullcontext()

    def _warm_up(self) -> None:
        """One tiny generate so the first real call does not pay the one-time costs."""
        warm = GenRequest(job_id="_warmup", prompts=[WARMUP_PROMPT], sampling=Sampling(max_tokens=2, n=2, seed=0))
        self.generate([warm])

    def close(self) -> None:
        """Shut the engine down and release its memory and process-global state
        (torch.distributed group, vLLM's environment cache), so another engine can start."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(Exception):
                vllm_private.shutdown_engine(self._llm)
            del self._llm, self._engine
            vllm_private.release_process_state()
            gc.collect()

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ generation

    def generate(self, requests: list[GenRequest]) -> list[list[Completion]]:
        """Serve all requests together, to the end; result i holds request i's completions,
        prompt-major (prompt 0's n samples, then prompt 1's, ...). A request that fails to
        start (bad sampling, bad adapter, prompt too long) fails the call: nothing runs."""
        for r in requests:
            validate_sampling(r.sampling)
        with self._lock:
            self._check_open()
            if self.in_flight:
                raise RolloutError("generate() while continuous requests are in flight")
            keys = [("_batch", i) for i in range(len(requests))]
            try:
                for key, r in zip(keys, requests):
                    self.start(key, r)
            except Exception:
                self.abort(keys)
                raise
            done: dict[Any, list[Completion]] = {}
            while self.in_flight:  # a request without prompts is done at once, in the first step
                done.update(self.step())
            return [done[k] for k in keys]

    # ------------------------------------------------------------ continuous batching

    def start(self, key: Any, request: GenRequest) -> None:
        """Add a request to the running batch: its prompts join the next engine step, beside
        whatever other requests are in flight. ``step()`` hands back its completions under
        ``key`` once all its prompts finished. A bad request raises here (``RequestError``,
        ``AdapterError``) and leaves the others running."""
        from vllm.exceptions import VLLMClientError

        validate_sampling(request.sampling)
        with self._lock:
            self._check_open()
            if key in self._pending:
                raise RolloutError(f"request {key!r} is already in flight")
            self._ensure_weights(request.adapter)
            lora = self._lora_request(request.adapter)
            prompts: list[str | list[int]] = [*request.prompts, *request.prompt_tokens]
            if not prompts:
                self._finished.append((key, []))
                return
            ids = [f"{REQUEST_ID_PREFIX}{next(self._request_ids)}" for _ in prompts]
            added: list[str] = []
            try:
                with self._engine_threads():
                    inputs = vllm_private.render_prompts(self._llm, prompts)
                    for pi, (rid, prompt) in enumerate(zip(ids, inputs)):
                        self._engine.add_request(rid, prompt, sampling_params(request.sampling, pi), lora_request=lora)
                        added.append(rid)
            except Exception as e:
                if added:  # all of a request's prompts run, or none
                    self._engine.abort_request(added, internal=False)
                if isinstance(e, (ValueError, VLLMClientError)):
                    raise RequestError(str(e)) from e
                raise
            # vLLM's outputs carry these ids, and it aborts by them (with all n samples of a prompt)
            self._pending[key] = _InFlight(
                request, lora.lora_int_id if lora is not None else None, {rid: pi for pi, rid in enumerate(ids)}, {}
            )
            for rid in ids:
                self._owner[rid] = key

    def step(self) -> list[tuple[Any, list[Completion]]]:
        """One engine step over everything in flight; the requests it finished, as
        ``(key, completions)``. Nothing in flight: returns at once."""
        with self._lock:
            self._check_open()
            finished, self._finished = self._finished, []
            if not self._owner:
                return finished
            with self._engine_threads():
                outputs = self._engine.step()
            for output in outputs:
                if output.request_id not in self._owner:
                    continue
                if not output.finished:
                    self._tell_tokens(output)
                    continue
                key = self._owner.pop(output.request_id)
                flight = self._pending[key]
                flight.outputs[flight.prompt_of[output.request_id]] = output
                if len(flight.outputs) == len(flight.prompt_of):
                    del self._pending[key]
                    completions = [
                        c
                        for pi in range(len(flight.prompt_of))
                        for c in to_completions(flight.outputs[pi], pi, self._tokenizer, flight.request.sampling)
                    ]
                    self._count(flight.request, completions)
                    if flight.request.adapter is not None and not flight.request.adapter.full:
                        self._retire_stale_versions({flight.request.adapter.job_id})
                    finished.append((key, completions))
            if self._owner and not self._engine.has_unfinished_requests():
                lost = sorted({str(k) for k in self._owner.values()})
                self._owner.clear()
                self._pending.clear()
                raise RolloutError(f"vLLM finished without answering requests {lost}")
            return finished

    def _tell_tokens(self, output: Any) -> None:
        """A streamed request's sample's tokens since it last told them, kept for ``take_partials``."""
        key = self._owner[output.request_id]
        flight = self._pending[key]
        if not flight.request.sampling.stream or not output.outputs:
            return
        prompt, sample = flight.prompt_of[output.request_id], output.outputs[0]
        k = flight.request.sampling.topk_logprobs
        tokens = list(sample.token_ids)
        told = flight.sent.get(prompt, 0)
        if len(tokens) > told:
            flight.sent[prompt] = len(tokens)
            top = vllm_private.sampled_topk_logprobs(sample.logprobs, k, told) if k else []
            told_now = SampleTokens(
                prompt,
                tokens[told:],
                sampled_logprobs(tokens, sample.logprobs, told),
                [[TokenLogprob(t, lp) for t, lp in row] for row in top],
            )
            self._partials.append((key, [told_now]))

    def take_partials(self) -> list[tuple[Any, list[SampleTokens]]]:
        """The streamed requests' new tokens since the last take, as ``(key, samples)``, in order."""
        with self._lock:
            taken, self._partials = self._partials, []
        return taken

    def abort(self, keys: list[Any]) -> None:
        """Stop these requests (those in flight; others are ignored)."""
        with self._lock:
            gone = set(keys)
            ids = [rid for rid, key in self._owner.items() if key in gone]
            for rid in ids:
                del self._owner[rid]
            for key in keys:
                self._pending.pop(key, None)
            self._finished = [(k, c) for k, c in self._finished if k not in gone]
            if ids:
                self._engine.abort_request(ids, internal=False)

    @property
    def in_flight(self) -> int:
        """Requests started and not yet handed back by ``step()``."""
        return len(self._pending) + len(self._finished)

    def in_flight_of(self, job_id: str) -> list[Any]:
        """Keys of this job's requests in flight."""
        return [k for k, f in self._pending.items() if f.request.job_id == job_id]

    # ------------------------------------------------------------ adapters

    def _lora_request(self, ref: AdapterRef | None) -> Any:
        """The LoRARequest of an adapter version; a version new to the engine is loaded now,
        so a bad adapter fails here, before the batch starts."""
        if ref is None or ref.full:
            return None
        from vllm.lora.request import LoRARequest

        key = AdapterKey(ref.job_id, ref.version)
        if not self._registry.knows(key):
            check_adapter_dir(ref)
        lora_id, new = self._registry.lora_id(ref)
        request = LoRARequest(key.name, lora_id, str(Path(ref.path).resolve()))
        if new:
            try:
                with self._engine_threads():
                    self._engine.add_lora(request)
            except Exception as e:  # vLLM raises several types for a bad adapter
                self._registry.forget_version(key)
                raise AdapterError(f"adapter {key.name} failed to load: {e}") from e
        return request

    def _ensure_weights(self, ref: AdapterRef | None) -> None:
        """The weights ``ref`` samples from in the engine: a full fine-tuning job's published
        version, else the base model's (a LoRA job's adapter or no adapter), loaded in place
        (vLLM's worker ``reload_weights``: the checkpoint-format path, which the CPU backend
        supports) only on a switch. Requests in flight finish first on the weights they started
        with; their completions come back from the next ``step()``."""
        wanted = AdapterKey(ref.job_id, ref.version) if ref is not None and ref.full else None
        if wanted == self._weights:
            return
        path = self.model_path if ref is None or wanted is None else ref.path
        if wanted is not None and not any(Path(path).glob("*.safetensors")):
            raise AdapterError(f"weights {wanted.name}: no *.safetensors in {path}")
        done: list[tuple[Any, list[Completion]]] = []
        while self._owner:
            done.extend(self.step())
        self._finished.extend(done)
        self._weights = None  # until the load completes: a failed one leaves the base to reload
        try:
            with self._engine_threads():
                vllm_private.reload_weights(self._llm, path)
                self._llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        except Exception as e:
            if wanted is None:
                raise
            raise AdapterError(f"weights {wanted.name} failed to load: {e}") from e
        self._weights = wanted
        self.weight_loads += 1

    def sleep(self) -> None:
        """Give the GPU to another model's engine: weights to pinned host memory, KV cache
        dropped (vLLM sleep level 1). Requests in flight finish first."""
        with self._lock:
            self._check_open()
            if not self.awake:
                return
            while self._owner:
                self._finished.extend(self.step())
            self._llm.sleep(level=1)
            self.awake = False

    def wake(self) -> None:
        """Take the GPU back: weights from pinned host memory, a fresh KV cache."""
        with self._lock:
            self._check_open()
            if self.awake:
                return
            self._llm.wake_up()
            self._llm.reset_prefix_cache()
            self.awake = True
            self.wakes += 1

    @property
    def loaded_weights(self) -> str:
        """Whose weights the engine samples from: 'base', or a full fine-tuning job's 'job@vN'."""
        return self._weights.name if self._weights is not None else "base"

    def _retire_stale_versions(self, job_ids: set[str]) -> None:
        busy = {f.lora_id for f in self._pending.values()}  # versions a request in flight still uses
        for job_id in job_ids:
            for lora_id in self._registry.stale_ids(job_id):
                if lora_id not in busy:
                    self._engine.remove_lora(lora_id)

    def drop_job(self, job_id: str) -> None:
        """Stop the job's requests in flight, unload all its adapter versions and forget them."""
        with self._lock:
            self._check_open()
            self.abort(self.in_flight_of(job_id))
            for lora_id in self._registry.job_ids(job_id):
                self._engine.remove_lora(lora_id)
            self._registry.forget_job(job_id)

    def loaded_adapters(self) -> list[str]:
        """Adapter versions vLLM holds now (its CPU cache), as 'job@vN'."""
        with self._lock:
            self._check_open()
            names = []
            for lora_id in sorted(self._engine.list_loras()):
                key = self._registry.key_of(lora_id)
                names.append(key.name if key is not None else f"?{lora_id}")
            return names

    # ------------------------------------------------------------ stats

    def _count(self, request: GenRequest, completions: list[Completion]) -> None:
        c = self._counters
        c["requests"] += 1
        c["prompts"] += len(request.prompts) + len(request.prompt_tokens)
        c["sequences"] += len(completions)
        c["tokens_generated"] += sum(len(x.token_ids) for x in completions)

    def stats(self) -> dict[str, Any]:
        """Counters since start (warm-up excluded), loaded adapters, start-up timings."""
        with self._lock:
            return self._stats()

    def _stats(self) -> dict[str, Any]:
        self._check_open()
        return {
            **self._counters,
            "loaded_adapters": self.loaded_adapters(),
            "loaded_weights": self.loaded_weights,
            "weight_loads": self.weight_loads,
            "known_adapter_versions": len(self._registry),
            "jobs": self._registry.jobs(),
            "startup_seconds": round(self.startup_seconds, 3),
            "warmup_seconds": round(self.warmup_seconds, 3),
        }

    def _check_open(self) -> None:
        if self._closed:
            raise RolloutError("the rollout engine is closed")
