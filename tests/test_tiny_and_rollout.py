"""The tiny model and the rollout engine, run for real: transformers, peft and vLLM on CPU.

One tiny build per session (in a temp dir) and one rollout engine per module (start-up is
the slow part). The engine is made with ``max_loras=2`` and ``max_cpu_loras=2`` so that
serving three or more adapters in one call forces vLLM's LRU to evict and reload.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from plexctl.common.protocol import AdapterRef, Completion, GenRequest, Sampling
from plexctl.tiny_models import BOS_ID, EOS_ID, TinyPaths, all_problems, build_tiny
from worker.rollout import AdapterError, AdapterKey, AdapterRegistry, RolloutEngine

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [p.prompt for p in all_problems()]


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyPaths:
    return build_tiny(tmp_path_factory.mktemp("plexrl"))


def make_adapter(base: Path, out: Path, seed: int, rank: int = 8) -> Path:
    """A peft LoRA (rank 8 by default) with random non-zero B (so it changes the model), saved as safetensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0)
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    peft_model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def adapters(tiny: TinyPaths, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("adapters")
    return [make_adapter(tiny.model_dir, root / f"a{k}", seed=100 + k) for k in range(5)]


@pytest.fixture(scope="module")
def engine(tiny: TinyPaths) -> Iterator[RolloutEngine]:
    eng = RolloutEngine(str(tiny.model_dir), max_loras=2, max_cpu_loras=2, max_model_len=64)
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def tokenizer(tiny: TinyPaths):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny.model_dir)


def hf_logprobs(model, completion: Completion) -> list[float]:
    """Log-probs of the completion's tokens under a transformers forward pass."""
    ids = torch.tensor([completion.prompt_token_ids + completion.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    start = len(completion.prompt_token_ids)
    positions = range(start - 1, start - 1 + len(completion.token_ids))
    return [float(logp[t, tok]) for t, tok in zip(positions, completion.token_ids)]


# ---------------------------------------------------------------- tiny build


def test_build_writes_model_data_and_is_cached(tiny: TinyPaths) -> None:
    for name in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]:
        assert (tiny.model_dir / name).is_file(), name
    config = json.loads((tiny.model_dir / "config.json").read_text())
    gen_config = json.loads((tiny.model_dir / "generation_config.json").read_text())
    assert config["eos_token_id"] == gen_config["eos_token_id"] == EOS_ID
    assert config["hidden_size"] // config["num_attention_heads"] >= 32  # vLLM CPU attention

    eval_rows = [json.loads(line) for line in tiny.eval_path.read_text().splitlines()]
    train_rows = [json.loads(line) for line in tiny.train_path.read_text().splitlines()]
    assert len(eval_rows) == 100 and eval_rows[0] == {"prompt": "0+0=", "answer": "0"}
    assert eval_rows[-1] == {"prompt": "9+9=", "answer": "18"}
    assert sorted(map(json.dumps, train_rows)) == sorted(map(json.dumps, eval_rows))
    assert train_rows != eval_rows  # shuffled

    assert 0.25 <= tiny.warm_start_accuracy <= 0.5  # partial: RL has room to improve
    t0 = time.perf_counter()
    again = build_tiny(tiny.root)
    assert time.perf_counter() - t0 < 1.0 and again == tiny  # cached


def test_transformers_loads_model_and_tokenizer_round_trips(tiny: TinyPaths, tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    ids = tokenizer("3+5=8")["input_ids"]
    assert ids[0] == BOS_ID and len(ids) == 6  # <bos> + one token per character
    assert tokenizer.decode(ids, skip_special_tokens=True) == "3+5=8"
    assert tokenizer.eos_token_id == EOS_ID
    model = AutoModelForCausalLM.from_pretrained(tiny.model_dir)
    assert model.config.eos_token_id == EOS_ID
    logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, 6, len(tokenizer))


# ---------------------------------------------------------------- vLLM base model


def test_vllm_generates_and_stops_on_eos(engine: RolloutEngine, tokenizer) -> None:
    sampling = Sampling(temperature=1.0, max_tokens=8, n=4, seed=1)
    [completions] = engine.generate([GenRequest("base", PROMPTS, sampling)])
    assert len(completions) == 400
    assert [c.prompt_index for c in completions] == [i for i in range(100) for _ in range(4)]
    stopped = [c for c in completions if c.finish_reason == "stop"]
    assert len(stopped) >= 0.9 * len(completions)
    for c in stopped:
        assert c.token_ids[-1] == EOS_ID  # EOS is kept in token_ids ...
        assert "<eos>" not in c.text  # ... and left out of text
        assert tokenizer.decode(c.token_ids, skip_special_tokens=True) == c.text
    for c in completions[::37]:  # vLLM and transformers tokenize prompts alike (<bos> first)
        assert c.prompt_token_ids == tokenizer(PROMPTS[c.prompt_index])["input_ids"]


def test_a_stop_string_ends_a_sample_its_tokens_kept(engine: RolloutEngine, tokenizer) -> None:
    free = Sampling(temperature=1.0, max_tokens=8, n=8, seed=3, ignore_eos=True)
    [unstopped] = engine.generate([GenRequest("base", PROMPTS[:20], free)])
    written = collections.Counter(ch for a in unstopped for ch in set(tokenizer.decode(a.token_ids[:-1])))
    stop = max("0123456789", key=written.__getitem__)  # the digit most samples write before their last token
    [stopped] = engine.generate([GenRequest("base", PROMPTS[:20], msgspec.structs.replace(free, stop=[stop]))])
    cut = 0
    for a, b in zip(unstopped, stopped):  # the same seeds: the same tokens up to the stop string
        assert a.token_ids[: len(b.token_ids)] == b.token_ids
        if stop in tokenizer.decode(a.token_ids[:-1]):
            cut += 1
            assert b.finish_reason == "stop" and len(b.token_ids) < len(a.token_ids)
            assert tokenizer.decode(b.token_ids).endswith(stop)  # its tokens end with the stop string's
            assert stop not in tokenizer.decode(b.token_ids[:-1])
    assert cut >= 10, cut


def test_logprobs_are_the_sampled_tokens_and_match_transformers(tiny: TinyPaths, engine: RolloutEngine) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny.model_dir, dtype=torch.float32).eval()
    [completions] = engine.generate([GenRequest("base", PROMPTS[::7], Sampling(max_tokens=6, n=3, seed=5))])
    worst = 0.0
    for c in completions:
        assert len(c.logprobs) == len(c.token_ids) >= 1
        assert all(lp <= 0.0 for lp in c.logprobs)
        worst = max(worst, max(abs(a - b) for a, b in zip(c.logprobs, hf_logprobs(model, c))))
    assert worst < 1e-3, worst


def test_prompt_logprobs_are_each_prompt_tokens_and_match_transformers(tiny: TinyPaths, engine: RolloutEngine) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny.model_dir, dtype=torch.float32).eval()
    [completions] = engine.generate(
        [GenRequest("base", PROMPTS[:5], Sampling(max_tokens=1, n=2, seed=1, prompt_logprobs=True))]
    )
    [plain] = engine.generate([GenRequest("base", PROMPTS[:1], Sampling(max_tokens=1, seed=1))])
    assert plain[0].prompt_logprobs == []  # only when asked for
    worst = 0.0
    for c in completions:
        ids = torch.tensor([c.prompt_token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        expected = [float(logp[t - 1, tok]) for t, tok in enumerate(c.prompt_token_ids) if t > 0]
        assert len(c.prompt_logprobs) == len(c.prompt_token_ids) >= 2 and c.prompt_logprobs[0] is None
        got = [float(x) for x in c.prompt_logprobs[1:] if x is not None]
        assert len(got) == len(expected)
        worst = max(worst, max(abs(a - b) for a, b in zip(got, expected)))
    assert worst < 1e-3, worst


def test_completions_equal_vllms_own_detokenized_output(engine: RolloutEngine) -> None:
    """The engine decodes each completion once and reads flat log-probs; what it hands back
    equals vLLM's own per-token detokenizer and log-prob dicts for the same seeds."""
    from vllm import SamplingParams

    from worker.rollout import ENGINE_THREADS, prompt_seed, torch_threads

    sampling = Sampling(temperature=1.2, max_tokens=6, n=3, seed=21)
    prompts = PROMPTS[::9]
    [ours] = engine.generate([GenRequest("base", prompts, sampling)])
    params = [
        SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            max_tokens=sampling.max_tokens,
            seed=prompt_seed(sampling, i),
            logprobs=0,
            skip_special_tokens=True,
        )
        for i in range(len(prompts))
    ]
    with torch_threads(ENGINE_THREADS):
        outputs = engine._llm.generate(prompts, params, use_tqdm=False)
    theirs = [(i, c) for i, out in enumerate(outputs) for c in sorted(out.outputs, key=lambda c: c.index)]
    assert len(ours) == len(theirs) == 3 * len(prompts)
    assert len({c.text for c in ours}) > 5  # varied samples, not one answer
    for mine, (i, c) in zip(ours, theirs):
        assert mine.prompt_index == i
        assert mine.token_ids == list(c.token_ids)
        assert mine.text == c.text
        assert mine.logprobs == [step[tok].logprob for tok, step in zip(c.token_ids, c.logprobs)]


def test_seeded_sampling_is_reproducible(engine: RolloutEngine) -> None:
    request = GenRequest("base", PROMPTS[:10], Sampling(max_tokens=4, n=4, seed=11))
    first, second = engine.generate([request]), engine.generate([request])
    assert [c.token_ids for c in first[0]] == [c.token_ids for c in second[0]]
    [uncertain] = engine.generate([GenRequest("base", ["9+8="], Sampling(max_tokens=4, n=16, seed=11))])
    assert len({c.text for c in uncertain}) >= 3  # the n samples of a prompt have their own seeds


# ---------------------------------------------------------------- multi-LoRA


def test_mixed_adapters_in_one_call_equal_each_adapter_alone(
    engine: RolloutEngine, adapters: list[Path], tiny: TinyPaths
) -> None:
    sampling = Sampling(temperature=1.0, max_tokens=4, n=2, seed=3)
    requests = [
        GenRequest(f"mix{k}", PROMPTS[k::9], sampling, AdapterRef(f"mix{k}", 1, str(adapters[k]))) for k in range(3)
    ]
    requests.append(GenRequest("base", PROMPTS[5::9], sampling))
    mixed = engine.generate(requests)  # 3 adapters, max_loras=2, max_cpu_loras=2: evictions
    alone = [engine.generate([r])[0] for r in requests]
    for m, a in zip(mixed, alone):
        assert [c.token_ids for c in m] == [c.token_ids for c in a]
        for cm, ca in zip(m, a):
            assert max(abs(x - y) for x, y in zip(cm.logprobs, ca.logprobs)) < 1e-4

    # The adapters are really applied, and differently: the same prompts give other log-probs.
    same_prompts = [
        GenRequest(f"mix{k}", PROMPTS[:20], Sampling(max_tokens=1, n=1, seed=0), requests[k].adapter) for k in range(3)
    ] + [GenRequest("base", PROMPTS[:20], Sampling(max_tokens=1, n=1, seed=0))]
    firsts = [[(c.token_ids[0], round(c.logprobs[0], 4)) for c in cs] for cs in engine.generate(same_prompts)]
    assert len({tuple(f) for f in firsts}) == 4


def test_lora_logprobs_match_peft(engine: RolloutEngine, adapters: list[Path], tiny: TinyPaths) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny.model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapters[1]).eval()
    ref = AdapterRef("peftcheck", 1, str(adapters[1]))
    [completions] = engine.generate([GenRequest("peftcheck", PROMPTS[::11], Sampling(max_tokens=4, n=2, seed=9), ref)])
    worst = max(max(abs(a - b) for a, b in zip(c.logprobs, hf_logprobs(model, c))) for c in completions)
    assert worst < 1e-3, worst
    engine.drop_job("peftcheck")


def test_more_jobs_than_lora_slots_never_fail(engine: RolloutEngine, adapters: list[Path]) -> None:
    sampling = Sampling(max_tokens=3, n=2, seed=1)
    requests = [
        GenRequest(f"many{k}", PROMPTS[k::5][:6], sampling, AdapterRef(f"many{k}", 1, str(adapters[k])))
        for k in range(5)
    ]
    for _ in range(2):  # the second round reloads what the first round evicted
        results = engine.generate(requests)
        assert [len(cs) for cs in results] == [12] * 5
    assert len(engine.loaded_adapters()) <= 2  # max_cpu_loras
    for k in range(5):
        engine.drop_job(f"many{k}")


def test_new_version_replaces_old(engine: RolloutEngine, adapters: list[Path]) -> None:
    sampling = Sampling(max_tokens=3, n=2, seed=4)
    v1 = AdapterRef("versioned", 1, str(adapters[0]))
    v2 = AdapterRef("versioned", 2, str(adapters[1]))
    engine.generate([GenRequest("versioned", PROMPTS[:8], sampling, v1)])
    assert "versioned@v1" in engine.loaded_adapters()
    on_v2 = engine.generate([GenRequest("versioned", PROMPTS[:8], sampling, v2)])
    loaded = engine.loaded_adapters()
    assert "versioned@v2" in loaded and "versioned@v1" not in loaded

    # a request for the retired version is still served; v1 is unloaded again afterwards
    [again] = engine.generate([GenRequest("versioned", PROMPTS[:8], sampling, v1)])
    assert len(again) == 16 and "versioned@v1" not in engine.loaded_adapters()

    # v2 behaves as its own adapter (not v1's weights under a new name)
    as_other_job = engine.generate(
        [GenRequest("other", PROMPTS[:8], sampling, AdapterRef("other", 7, str(adapters[1])))]
    )
    assert [c.token_ids for c in on_v2[0]] == [c.token_ids for c in as_other_job[0]]

    engine.drop_job("versioned")
    engine.drop_job("other")
    assert not any(name.startswith(("versioned@", "other@")) for name in engine.loaded_adapters())
    stats = engine.stats()
    assert "versioned" not in stats["jobs"] and stats["tokens_generated"] > 0


def test_bad_adapter_is_a_typed_error_and_engine_keeps_serving(
    engine: RolloutEngine, tiny: TinyPaths, tmp_path: Path
) -> None:
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        engine.generate([GenRequest("broken", ["1+1="], Sampling(), AdapterRef("broken", 1, str(tmp_path)))])

    too_big = make_adapter(tiny.model_dir, tmp_path / "big", seed=0, rank=2 * engine.max_lora_rank)  # > max_lora_rank
    with pytest.raises(AdapterError, match="failed to load"):
        engine.generate([GenRequest("broken", ["1+1="], Sampling(), AdapterRef("broken", 2, str(too_big)))])
    [completions] = engine.generate([GenRequest("base", ["1+1="], Sampling(max_tokens=3, seed=0))])
    assert len(completions) == 1
    assert "broken" not in engine.stats()["jobs"]


# ---------------------------------------------------------------- bookkeeping (no engine)


def test_adapter_registry_ids_are_stable_and_versions_retire() -> None:
    reg = AdapterRegistry()
    a1, new = reg.lora_id(AdapterRef("a", 1, "/a1"))
    assert new and a1 >= 1
    assert reg.lora_id(AdapterRef("a", 1, "/a1")) == (a1, False)
    b1, _ = reg.lora_id(AdapterRef("b", 1, "/b1"))
    a2, _ = reg.lora_id(AdapterRef("a", 2, "/a2"))
    assert len({a1, b1, a2}) == 3
    assert reg.stale_ids("a") == [a1] and reg.stale_ids("b") == []
    assert reg.key_of(a2) == AdapterKey("a", 2)
    reg.forget_job("a")
    assert reg.jobs() == ["b"] and reg.job_ids("a") == []


def test_one_large_seeded_call_is_served_whole(engine: RolloutEngine) -> None:
    # 300 prompts of ~20 tokens (> vLLM's default 4,096-token step budget): a seeded call must not
    # have a prompt split across engine steps, which fails on CPU
    prompt = "12*7=call:12*7;=84;"
    req = GenRequest(job_id="big", prompts=[prompt] * 300, sampling=Sampling(max_tokens=3, n=1, seed=5))
    (out,) = engine.generate([req])
    assert len(out) == 300 and all(len(c.prompt_token_ids) >= 19 for c in out)


# ---------------------------------------------------------------- continuous batching


def test_a_request_joins_the_running_batch_and_returns_before_its_tail(
    engine: RolloutEngine, adapters: list[Path]
) -> None:
    long = GenRequest(
        "tail",
        PROMPTS[:24],
        Sampling(temperature=1.5, max_tokens=30, n=4, seed=11),
        AdapterRef("tail", 1, str(adapters[0])),
    )
    short = GenRequest(
        "quick", PROMPTS[30:34], Sampling(max_tokens=2, n=2, seed=12), AdapterRef("quick", 1, str(adapters[1]))
    )
    alone = {r.job_id: engine.generate([r])[0] for r in (long, short)}

    engine.start("tail", long)
    order: list[str] = []
    results = {key: comps for key, comps in engine.step()}  # the long request's prefill
    engine.start("quick", short)  # joins while "tail" decodes
    assert engine.in_flight == 2
    while engine.in_flight:
        for key, comps in engine.step():
            order.append(key)
            results[key] = comps
    assert order == ["quick", "tail"], "the short request waited for the long one's tail"
    for key in ("tail", "quick"):  # the same samples as each request alone, to the last bit
        assert [(c.token_ids, c.logprobs) for c in results[key]] == [(c.token_ids, c.logprobs) for c in alone[key]]


def test_a_bad_request_fails_alone_and_a_released_job_stops(engine: RolloutEngine, adapters: list[Path]) -> None:
    good = GenRequest("good", PROMPTS[:3], Sampling(max_tokens=3, n=1, seed=1))
    engine.start("good", good)
    with pytest.raises(AdapterError):
        engine.start("bad", GenRequest("bad", PROMPTS[:1], Sampling(), AdapterRef("bad", 1, "/nonexistent")))
    gone = GenRequest(
        "gone", PROMPTS[:3], Sampling(max_tokens=30, n=2, seed=2), AdapterRef("gone", 1, str(adapters[2]))
    )
    engine.start("gone", gone)
    engine.drop_job("gone")  # its request in flight is stopped with it
    done = {}
    while engine.in_flight:
        done.update(engine.step())
    assert set(done) == {"good"} and len(done["good"]) == 3


def test_a_request_without_prompts_is_answered_empty(engine: RolloutEngine) -> None:
    empty = GenRequest("none", [], Sampling(max_tokens=2, n=1, seed=0))
    assert engine.generate([empty]) == [[]]
    one = GenRequest("one", PROMPTS[:1], Sampling(max_tokens=2, n=1, seed=0))
    assert [len(cs) for cs in engine.generate([empty, one])] == [0, 1]


def test_the_rollout_engine_holds_the_models_context_up_to_a_cap(tmp_path: Path) -> None:
    from plexctl.common.memplan import CONTEXT_CAP as MAX_MODEL_LEN
    from worker.engine_args import default_max_model_len

    for context, expected in ((64, 64), (32768, MAX_MODEL_LEN)):
        (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": context}))
        assert default_max_model_len(str(tmp_path)) == expected
    assert default_max_model_len(str(tmp_path / "absent")) == MAX_MODEL_LEN
