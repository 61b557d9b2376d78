"""The memory plan: model sizes against published totals, the shipped real-scale examples on an
8x80G node, and what a user is told when something does not fit (pure arithmetic, no torch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from plexctl.common.cluster_config import ClusterConfig
from plexctl.common.errors import ExitCode
from plexctl.common.memplan import (
    DoesNotFit,
    EngineShape,
    FullJob,
    GiB,
    JobShape,
    NodeShape,
    check_full_state_fits,
    default_engines,
    full_job_problems,
    job_problems,
    kv_bytes_per_token,
    parameter_count,
    parse_gpus,
    plan_for_specs,
    plan_memory,
    plans_for_specs,
    render_plan,
    weights_bytes,
)
from plexctl.common.model_shapes import UnknownModelShape, known_shape, model_config_for
from plexctl.common.spec import LoraSpec
from plexctl.common.state_policy import HOST
from plexctl.common.state_size import job_state_bytes
from plexctl.spec_files import load_spec

REPO = Path(__file__).resolve().parents[1]
QWEN_7B = "/models/Qwen2.5-7B-Instruct"
NODE_8X80 = NodeShape.parse("8x80G")
TINY = {
    "model_type": "qwen2",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def qwen_7b() -> dict:
    return model_config_for(QWEN_7B)


@pytest.mark.parametrize(
    "name, published",
    [
        ("Qwen2.5-7B-Instruct", 7.62e9),
        ("Qwen2.5-0.5B-Instruct", 0.49e9),
        ("Llama-3.1-8B", 8.03e9),
        ("Llama-3.1-70B", 70.6e9),
    ],
)
def test_parameter_counts_match_the_published_totals(name: str, published: float) -> None:
    shape = known_shape(name)
    assert shape is not None
    assert parameter_count(shape) == pytest.approx(published, rel=0.01)


def test_7b_rank_32_state_is_the_design_docs_0_9_gib() -> None:
    state = job_state_bytes(
        32, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], qwen_7b(), cuda=True
    )
    assert state / GiB == pytest.approx(0.9, abs=0.05)


@pytest.mark.parametrize("example", ["qwen2.5-7b-math.yaml", "qwen2.5-0.5b-gsm8k.yaml"])
def test_shipped_examples_fit_the_default_layout_of_an_8x80g_node(example: str) -> None:
    spec = load_spec(REPO / "configs" / example, check_files=False)
    plan = plan_for_specs([spec], NODE_8X80)

    assert plan.problems == ()
    assert [r.gpus for r in plan.rollouts] == [1] * 6 and [t.gpus for t in plan.trainers] == [1] * 2
    assert all(r.kv_tokens >= plan.max_model_len for r in plan.rollouts)
    assert plan.trainers[0].tier_jobs(HOST) >= 8
    text = render_plan(plan)
    assert "Rollout engines 0-5" in text and "Trainer engines 0-1" in text
    assert "Everything fits." in text and spec.name in text


def test_the_7b_plan_shows_weights_kv_tokens_and_tiers() -> None:
    plan = plan_for_specs([load_spec(REPO / "configs" / "qwen2.5-7b-math.yaml", check_files=False)], NODE_8X80)
    rollout, trainer = plan.rollouts[0], plan.trainers[0]
    assert rollout.weights_bytes / GiB == pytest.approx(14.2, abs=0.05)  # 7.62e9 x 2 bytes
    assert rollout.budget_bytes == int(0.9 * 80 * GiB)
    assert kv_bytes_per_token(plan.config, "bfloat16", 1) == 2 * 28 * 4 * 128 * 2
    assert rollout.kv_tokens > 500_000
    assert trainer.job_state_bytes / GiB == pytest.approx(0.9, abs=0.05)
    text = render_plan(plan)
    assert f"{rollout.kv_tokens:,} tokens" in text
    assert "14.2 GiB" in text and "8 jobs" in text


def test_32_jobs_fit_a_trainer_gpu_beside_bf16_weights_and_too_many_are_refused() -> None:
    job = JobShape("math", rank=32, max_seq_len=1536)
    fits = plan_memory(qwen_7b(), NODE_8X80, cluster=ClusterConfig(device_slots=32), jobs=[job])
    assert fits.problems == ()

    crowded = plan_memory(qwen_7b(), NODE_8X80, cluster=ClusterConfig(device_slots=80), jobs=[job])
    trainer = crowded.trainers[0]
    assert trainer.free_bytes < 0
    problem = next(p for p in crowded.problems if p.startswith("trainer engine 0"))
    assert "80 jobs' state on device need 72." in problem
    assert f"at most {trainer.room_for_state // trainer.job_state_bytes} fit" in problem


def test_70b_on_one_80g_gpu_does_not_fit_and_says_the_numbers() -> None:
    plan = plan_memory(model_config_for("/models/Llama-3.1-70B-Instruct"), NodeShape.parse("1x80G"))
    assert not plan.fits
    assert any("weights 131.4 GiB exceed the GPU's 80.0 GiB" in p for p in plan.problems)
    assert any(p.startswith("rollout engine 0 on 1 GPU: weights 131.4 GiB") for p in plan.problems)
    assert "Does not fit (" in render_plan(plan)


def test_tensor_parallel_rollout_engines_hold_a_shard() -> None:
    config = model_config_for("/models/Llama-3.1-70B")
    plan = plan_memory(config, NodeShape.parse("8x80G"), engines=[EngineShape("rollout", 4)] * 2)
    rollout = plan.rollouts[0]
    assert rollout.weights_bytes == -(-weights_bytes(config, "bfloat16") // 4)
    assert rollout.kv_bytes_per_token == 2 * 80 * 2 * 128 * 2  # 8 KV heads over 4 GPUs
    assert rollout.kv_tokens >= plan.max_model_len
    assert plan.problems == ("no trainer engine: jobs cannot train",)


def test_rank_above_max_lora_rank_is_refused_with_the_numbers() -> None:
    plan = plan_memory(qwen_7b(), NODE_8X80)
    problems = job_problems(plan, JobShape("big", rank=128, max_seq_len=1024))
    assert problems == ["job big: LoRA rank 128 is above the rollout engines' max_lora_rank 64"]
    assert job_problems(plan, JobShape("ok", rank=64, max_seq_len=1024)) == []


def test_a_sequence_longer_than_max_model_len_is_refused() -> None:
    plan = plan_memory(qwen_7b(), NODE_8X80, cluster=ClusterConfig(max_model_len=4096))
    problems = job_problems(plan, JobShape("long", rank=16, max_seq_len=5000))
    assert problems == ["job long: sequences of up to 5,000 tokens exceed max_model_len 4,096"]


def test_jobs_that_can_never_fit_are_refused() -> None:
    plan = plan_memory(
        qwen_7b(),
        NODE_8X80,
        cluster=ClusterConfig(max_lora_rank=256, host_mem="1G", nvme_bytes="2G"),
    )
    wrong_dtype = job_problems(plan, JobShape("f32", rank=8, max_seq_len=1024, dtype="float32"))
    assert wrong_dtype == ["job f32: model.dtype float32, but the engines run bfloat16"]
    huge = job_problems(plan, JobShape("huge", rank=256, max_seq_len=1024))
    assert huge == ["job huge: its state 7.2 GiB exceeds the largest tier (host tier 1.0 GiB, NVMe tier 2.0 GiB)"]
    bad_module = job_problems(plan, JobShape("odd", rank=8, max_seq_len=1024, target_modules=("qkv_proj",)))
    assert bad_module and "qkv_proj" in bad_module[0]


def test_a_job_in_the_plan_lists_its_problems_in_the_plans() -> None:
    plan = plan_memory(qwen_7b(), NODE_8X80, jobs=[JobShape("big", rank=128, max_seq_len=1024)])
    assert plan.problems == ("job big: LoRA rank 128 is above the rollout engines' max_lora_rank 64",)
    assert "refused" in render_plan(plan)


def test_a_small_kv_cache_is_reported_against_max_model_len() -> None:
    config = model_config_for("/models/Qwen2.5-0.5B-Instruct")
    # 5 GB: beside the weights, reserve and a GPU worker's 16 adapter slots, room for a small KV cache
    plan = plan_memory(config, NodeShape.parse("2x5G"), cluster=ClusterConfig(max_model_len=32768))
    rollout = plan.rollouts[0]
    assert 0 < rollout.kv_tokens < 32768
    assert (
        f"rollout engine 0: the KV cache holds {rollout.kv_tokens:,} tokens, below max_model_len 32,768"
        in plan.problems
    )


def test_max_model_len_beyond_the_models_context_and_unknown_vllm_ranks_are_problems() -> None:
    plan = plan_memory(qwen_7b(), NODE_8X80, cluster=ClusterConfig(max_model_len=65536, max_lora_rank=48))
    assert "max_model_len 65,536 exceeds the model's context 32,768 (max_position_embeddings)" in plan.problems
    assert any(p.startswith("max_lora_rank 48: vLLM accepts") for p in plan.problems)


def test_one_gpu_shares_it_rollout_gets_its_share_of_what_the_trainer_leaves() -> None:
    plan = plan_memory(qwen_7b(), NodeShape.parse("1x80G"))
    rollout, trainer = plan.rollouts[0], plan.trainers[0]
    assert rollout.shared and trainer.shared
    assert rollout.budget_bytes == int(0.9 * (80 * GiB - trainer.used_bytes))
    assert trainer.free_bytes == 80 * GiB - trainer.used_bytes - rollout.budget_bytes > 0
    assert rollout.vllm_utilization == pytest.approx(rollout.budget_bytes / (80 * GiB))
    assert plan.problems == ()


def test_engines_asking_for_more_gpus_than_the_node_has() -> None:
    plan = plan_memory(
        qwen_7b(), NodeShape.parse("2x80G"), engines=[EngineShape("rollout", 2), EngineShape("trainer", 1)]
    )
    assert any(p.startswith("the engines ask for 3 GPUs, the node has 2") for p in plan.problems)
    cpu_node = plan_memory(TINY, NodeShape.parse("0"), engines=[EngineShape("rollout", 1), EngineShape("trainer", 0)])
    assert "the engines ask for 1 GPU, the node has none" in cpu_node.problems


def test_host_and_nvme_tiers_beyond_the_node_are_problems() -> None:
    node = NodeShape.parse("8x80G", host="12G", nvme="100G")
    plan = plan_memory(qwen_7b(), node)
    assert "host memory: 2 host tier(s) of 8.0 GiB = 16.0 GiB exceed the node's 12.0 GiB" in plan.problems
    assert "NVMe: 2 NVMe tier(s) of 64.0 GiB = 128.0 GiB exceed the node's 100.0 GiB" in plan.problems


def test_a_tiny_cpu_node_plans_in_host_memory() -> None:
    job = JobShape("tiny-arith", rank=8, max_seq_len=48, dtype="float32", micro_batch_tokens=1024)
    plan = plan_memory(TINY, NodeShape.parse("0", host="16G", nvme="64G"), jobs=[job], model="tiny-arith")
    assert plan.dtype == "float32"
    assert [(r.gpus, t.gpus) for r, t in zip(plan.rollouts, plan.trainers)] == [(0, 0)]
    assert plan.max_model_len == 64
    assert plan.rollouts[0].kv_tokens >= 64
    assert plan.problems == ()
    trainer = plan.trainers[0]
    assert trainer.capacity_bytes == 16 * GiB - 8 * GiB - plan.rollouts[0].budget_bytes
    text = render_plan(plan)
    assert "Rollout engine 0: on the CPU" in text and "Trainer engine 0: on the CPU" in text
    assert "Everything fits." in text


def test_default_engines() -> None:
    assert default_engines(0) == [EngineShape("rollout", 0), EngineShape("trainer", 0)]
    assert default_engines(1) == [EngineShape("rollout", 1), EngineShape("trainer", 1)]
    assert default_engines(2) == [EngineShape("rollout", 1), EngineShape("trainer", 1)]
    eight = default_engines(8)
    assert (sum(e.kind == "rollout" for e in eight), sum(e.kind == "trainer" for e in eight)) == (6, 2)
    assert default_engines(8, tp=2) == [EngineShape("rollout", 2)] * 3 + [EngineShape("trainer", 1)] * 2
    with pytest.raises(ValueError, match="tp 4"):
        default_engines(4, tp=4)


def test_node_shapes_parse_from_text() -> None:
    assert parse_gpus("8x80G") == (8, 80 * GiB)
    assert parse_gpus("1 x 141GiB") == (1, 141 * GiB)
    assert parse_gpus("cpu") == (0, 0)
    assert NodeShape.parse("4x80G", host="1T", nvme="3T") == NodeShape(4, 80 * GiB, 1 << 40, 3 << 40)
    with pytest.raises(ValueError, match="8y80"):
        parse_gpus("8y80")


def test_model_config_prefers_config_json_and_falls_back_to_known_shapes(tmp_path: Path) -> None:
    present = tmp_path / "Qwen2.5-7B-Instruct"
    present.mkdir()
    (present / "config.json").write_text(json.dumps(TINY))
    assert model_config_for(present)["hidden_size"] == 128  # the model's own file wins
    assert model_config_for("/nowhere/qwen2.5-7b-instruct/")["hidden_size"] == 3584
    with pytest.raises(UnknownModelShape, match="no config.json in /nowhere/Mystery-1B .*known: "):
        model_config_for("/nowhere/Mystery-1B")


def test_the_plan_does_not_import_torch() -> None:
    code = (
        "import sys, plexctl.common.memplan, plexctl.common.model_shapes;"
        " print('torch' in sys.modules or 'vllm' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.stdout.strip() == "False", out.stderr


# ---------------------------------------------------------------- plexctl plan


def _plan_cli(*args: str):
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-m", "plexctl.cli", "plan", *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def test_plan_command_prints_the_plan_of_a_shipped_example_on_its_node() -> None:
    proc = _plan_cli(str(REPO / "configs" / "qwen2.5-7b-math.yaml"), "--gpus", "8x80G")
    assert proc.returncode == 0, proc.stderr
    assert "Rollout engines 0-5" in proc.stdout and "Trainer engines 0-1" in proc.stdout
    assert "KV cache" in proc.stdout and "Everything fits." in proc.stdout


def test_plan_command_says_what_does_not_fit_and_exits_7() -> None:
    proc = _plan_cli(str(REPO / "configs" / "qwen2.5-7b-math.yaml"), "--gpus", "1x24G", "--set", "lora.rank=128")
    assert proc.returncode == 7
    assert "LoRA rank 128 is above the rollout engines' max_lora_rank 64" in proc.stdout
    assert "exceed the GPU's 24.0 GiB" in proc.stdout


def test_plan_command_refuses_a_node_shape_it_cannot_read() -> None:
    proc = _plan_cli(str(REPO / "configs" / "qwen2.5-7b-math.yaml"), "--gpus", "8xlots")
    assert proc.returncode == 2 and "8xlots" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------- full fine-tuning and other models


def full_job(name: str, model: str, full: bool = True, spec_file: str = "") -> FullJob:
    return FullJob(name, f"/models/{model}", model_config_for(f"/models/{model}"), full=full, spec_file=spec_file)


def test_a_small_full_fine_tuning_job_fits_an_8x80g_node() -> None:
    plan = plan_memory(qwen_7b(), NODE_8X80)
    assert full_job_problems(plan, full_job("small", "Qwen2.5-0.5B-Instruct")) == []
    check_full_state_fits(full_job("small", "Qwen2.5-0.5B-Instruct"), plan)  # returns: it fits


def test_a_7b_full_fine_tuning_state_fits_no_tier_and_is_refused_with_its_numbers() -> None:
    plan = plan_memory(qwen_7b(), NODE_8X80)  # host tier 8 GiB, NVMe tier 64 GiB, 80 GB trainer GPUs
    job = full_job("big", "Qwen2.5-7B-Instruct", spec_file="jobs/big.yaml")
    with pytest.raises(DoesNotFit) as refused:
        check_full_state_fits(job, plan)
    message = str(refused.value)
    assert refused.value.exit_code == ExitCode.REFUSED == 7
    assert "\n" not in message
    assert message.startswith("jobs/big.yaml: model.path: full fine-tuning of Qwen2.5-7B-Instruct (no `lora:`)")
    assert "state 99.3 GiB (weights 14.2 GiB bfloat16 + fp32 masters 28.4 GiB + AdamW moments 56.7 GiB)" in message
    assert "fits no tier (device " in message and "host tier 8.0 GiB, NVMe tier 64.0 GiB)" in message


def test_a_full_state_that_fits_nvme_but_not_the_trainer_beside_its_gradients_is_refused() -> None:
    plan = plan_memory(qwen_7b(), NODE_8X80, cluster=ClusterConfig(nvme_bytes="200G"))
    problems = full_job_problems(plan, full_job("big", "Qwen2.5-7B-Instruct"))
    assert len(problems) == 1
    assert "+ fp32 gradients 28.4 GiB" in problems[0] and "exceed the largest trainer's 80.0 GiB" in problems[0]


def test_the_same_model_as_a_lora_job_is_not_refused() -> None:
    plan = plan_memory(qwen_7b(), NODE_8X80)
    assert full_job_problems(plan, full_job("adapter", "Qwen2.5-7B-Instruct", full=False)) == []


def test_a_model_whose_weights_fit_no_engine_is_refused_even_for_lora() -> None:
    plan = plan_memory(qwen_7b(), NodeShape.parse("1x80G"))
    problems = full_job_problems(plan, full_job("huge", "Llama-3.1-70B", full=False))
    assert problems[0].startswith("job huge: model.path: Llama-3.1-70B's bfloat16 weights 131.4 GiB")
    assert "fit no rollout engine" in problems[0]
    assert any("fit no trainer (largest 80.0 GiB)" in p for p in problems)


def test_a_job_spec_without_lora_is_checked_as_full_fine_tuning() -> None:
    spec = msgspec.structs.replace(load_spec(REPO / "configs" / "qwen2.5-7b-math.yaml", check_files=False), lora=None)
    plan = plan_for_specs([msgspec.structs.replace(spec, lora=LoraSpec())], NODE_8X80)
    with pytest.raises(DoesNotFit, match=r"^x\.yaml: model\.path: full fine-tuning of Qwen2\.5-7B-Instruct"):
        check_full_state_fits(spec, plan, spec_file="x.yaml")


def test_plexctl_plan_of_a_full_fine_tuning_spec_shows_all_weights_and_refuses_what_fits_no_tier() -> None:
    spec = msgspec.structs.replace(load_spec(REPO / "configs" / "qwen2.5-7b-math.yaml", check_files=False), lora=None)
    plan = plan_for_specs([spec], NODE_8X80)
    assert plan.jobs[0].full and plan.jobs[0].rank == 0
    text = render_plan(plan)
    assert "all weights   state 99.3 GiB" in text and "refused" in text
    assert any("its state 99.3 GiB exceeds the largest tier" in p for p in plan.problems)


def test_jobs_on_two_bases_get_a_plan_each_that_counts_the_other_models_weights() -> None:
    lora = load_spec(REPO / "configs" / "qwen2.5-7b-math.yaml", check_files=False)
    full = load_spec(REPO / "configs" / "qwen2.5-3b-full.yaml", check_files=False)
    cluster = ClusterConfig(device_slots=1, host_mem="64G", nvme_bytes="400G")
    node = NodeShape.parse("8x141G")
    small, large = plans_for_specs([lora, full], node, cluster=cluster)  # sorted by model path
    assert (small.model, large.model) == ("Qwen2.5-3B-Instruct", "Qwen2.5-7B-Instruct")
    assert small.fits and large.fits, small.problems + large.problems
    # on a GPU each engine holds its own base; the other model's weights sleep in pinned host memory,
    # once per rollout engine and once per trainer (engines of one kind take turns on their GPUs)
    assert small.trainers[0].other_bases_bytes == 0 and large.trainers[0].other_bases_bytes == 0
    (alone,) = plans_for_specs([lora], node, cluster=cluster)
    assert alone.trainers[0].free_bytes == large.trainers[0].free_bytes
    other = small.trainers[0].weights_bytes
    assert large.cpu_engine_bytes - alone.cpu_engine_bytes == (len(large.rollouts) + len(large.trainers)) * other
    # a node whose host memory cannot hold the sleeping weights beside the tiers: said, with the numbers
    tight = plans_for_specs([lora, full], NodeShape.parse("8x141G", host="160G"), cluster=cluster)
    problems = [p for plan in tight for p in plan.problems]
    assert any(p.startswith("host memory:") and "sleeping models" in p for p in problems), problems


# ---------------------------------------------------------------- the step's peak, held to the H200's


def _measured_runs() -> list[Path]:
    return sorted((REPO / "bench" / "results").glob("gpu-h200-*.json"))


def _trainer_runs() -> list[tuple[str, dict]]:
    runs = []
    for path in _measured_runs():
        d = json.loads(path.read_text())
        trainer = d.get("parts", {}).get("trainer", {})
        if "peak_gpu_gib" in trainer:
            runs.append((path.name, d))
    return runs


def test_the_measured_h200_runs_are_committed() -> None:
    names = [name for name, _ in _trainer_runs()]
    assert names == [
        "gpu-h200-gpu_check-0.5b.json",
        "gpu-h200-gpu_check-3b.json",
        "gpu-h200-trainer-ckpt-on-0.5b.json",
        "gpu-h200-trainer-ckpt-on-3b.json",
    ]


@pytest.mark.parametrize("name", [name for name, _ in _trainer_runs()])
def test_step_peak_holds_to_the_measured_peak_within_1_0_to_1_3(name: str) -> None:
    """The plan's step peak against torch's max_memory_allocated on an H200 (bench/gpu_check.py at
    ccc52d9, docs/gpu.md): the run's shape, rank-32 LoRA on 7 modules, one job's state resident."""
    from plexctl.common.memplan import ALL_PROJECTIONS, trainer_step

    d = dict(_trainer_runs())[name]
    t, config = d["parts"]["trainer"], d["model_shape"]
    job = JobShape("gpu_check", t["lora_rank"], t["seq"], micro_batch_tokens=t["micro_batch_tokens"])
    assert job.target_modules == ALL_PROJECTIONS
    state = job_state_bytes(job.rank, list(ALL_PROJECTIONS), config, cuda=True)
    asked = "on" if t["gradient_checkpointing"] else "off"
    step = trainer_step(config, t["dtype"], t["micro_batch_tokens"], asked, 0, states=state, job=job)
    measured = t["peak_gpu_gib"] * GiB
    assert step.checkpointing == t["gradient_checkpointing"]
    assert step.weights == pytest.approx(t["base_weights_gib"] * GiB, rel=0.08)  # the plan counts the tied head once
    assert 1.0 <= step.total / measured <= 1.3, (step.total / GiB, t["peak_gpu_gib"])


def _grpo_3b_job() -> JobShape:
    return JobShape("grpo-3b", 32, 1024, micro_batch_tokens=16384)  # 64 x 1,024 tokens, micro-batches of 16,384


@pytest.mark.parametrize(("gpus", "checkpointing"), [("8x80G", True), ("8x141G", False)])
def test_auto_checkpoints_the_3b_job_on_80g_and_not_where_it_fits(gpus: str, checkpointing: bool) -> None:
    plan = plan_memory(model_config_for("Qwen/Qwen2.5-3B"), NodeShape.parse(gpus), jobs=[_grpo_3b_job()])
    assert plan.fits, plan.problems
    assert all(t.gradient_checkpointing is checkpointing for t in plan.trainers)
    assert all(t.step_peak_bytes <= t.room_bytes for t in plan.trainers)


def test_checkpointing_as_asked_overrides_auto() -> None:
    config = model_config_for("Qwen/Qwen2.5-3B")
    on = plan_memory(config, NodeShape.parse("8x141G"), cluster=ClusterConfig(gradient_checkpointing="on"))
    off = plan_memory(config, NodeShape.parse("8x80G"), cluster=ClusterConfig(gradient_checkpointing="off"))
    assert all(t.gradient_checkpointing for t in on.trainers)
    assert not any(t.gradient_checkpointing for t in off.trainers)
    assert off.trainers[0].step_peak_bytes > 5 * on.trainers[0].step_peak_bytes


def test_the_worker_decides_as_the_plan_does_on_cuda() -> None:
    """``worker_step`` is what plexw runs at start on a GPU: the same decision as the plan's, and a
    memory fraction only where a rollout engine shares the GPU."""
    from plexctl.common.memplan import worker_step

    config = model_config_for("Qwen/Qwen2.5-3B")
    h200 = int(139.8 * GiB)  # what torch reports of an H200's 141 GB
    on_80 = worker_step(config, "bfloat16", 16384, "auto", 80 * GiB, None, 4, 64, cuda=True)
    on_h200 = worker_step(config, "bfloat16", 16384, "auto", h200, None, 4, 64, cuda=True)
    shared = worker_step(config, "bfloat16", 16384, "auto", h200, 0.5, 4, 64, cuda=True)
    assert on_80.gradient_checkpointing and on_80.memory_fraction is None
    assert not on_h200.gradient_checkpointing and on_h200.step_peak_bytes <= on_h200.room_bytes
    assert shared.gradient_checkpointing and shared.memory_fraction == pytest.approx(0.5)
    assert shared.step_peak_bytes <= shared.room_bytes < h200 // 2
    cpu = worker_step(config, "float32", 16384, "auto", 0, None, 4, 16, cuda=False)
    assert not cpu.gradient_checkpointing and cpu.memory_fraction is None


def test_memory_fraction_is_the_share_a_rollout_engine_leaves() -> None:
    from plexctl.common.step_memory import memory_fraction, trainer_share_bytes

    assert trainer_share_bytes(80 * GiB, None) == 80 * GiB
    assert trainer_share_bytes(80 * GiB, 0.25) == 60 * GiB
    assert memory_fraction(60 * GiB, 80 * GiB, shared=True) == pytest.approx(0.75)
    assert memory_fraction(80 * GiB, 80 * GiB, shared=False) is None
    with pytest.raises(ValueError):
        trainer_share_bytes(80 * GiB, 1.0)


def test_a_job_whose_step_fits_no_trainer_is_told_the_numbers() -> None:
    from plexctl.common.memplan import TrainerRoom, step_problem

    config = model_config_for("Qwen/Qwen2.5-3B")
    job = JobShape("long", 32, 65536)  # one row is a 65,536-token micro-batch
    small = [TrainerRoom("trainer w0/trainer", 30 * GiB, False, 16384)]
    problem = step_problem(config, job, "bfloat16", small)
    assert problem.startswith("a step needs ") and "65,536-token micro-batch, checkpointing off" in problem
    assert "more than trainer w0/trainer has for a step (30.0 GiB)" in problem
    assert step_problem(config, _grpo_3b_job(), "bfloat16", [TrainerRoom("t", 30 * GiB, True, 16384)]) == ""
    assert step_problem(config, job, "bfloat16", []) == ""


def test_plan_command_json_has_each_trainers_step() -> None:
    proc = _plan_cli(
        str(REPO / "configs" / "qwen2.5-7b-math.yaml"), "--gpus", "8x80G", "--gradient-checkpointing", "off", "--json"
    )
    assert proc.returncode == 7, proc.stderr  # a 7B step without checkpointing does not fit 80 GB
    plans = json.loads(proc.stdout)["plans"]
    trainers = plans[0]["trainers"]
    assert len(trainers) == 2 and all(t["gradient_checkpointing"] is False for t in trainers)
    assert all(t["step_peak_bytes"] > t["room_bytes"] for t in trainers)
    assert any("checkpointing off" in p and "has for a step" in p for p in plans[0]["problems"])
    auto = _plan_cli(str(REPO / "configs" / "qwen2.5-7b-math.yaml"), "--json")
    assert auto.returncode == 0, auto.stdout
    step = json.loads(auto.stdout)["plans"][0]["trainers"][0]
    assert (
        step["gradient_checkpointing"] is True and step["weights_bytes"] < step["step_peak_bytes"] <= step["room_bytes"]
    )
    bad = _plan_cli(str(REPO / "configs" / "qwen2.5-7b-math.yaml"), "--gradient-checkpointing", "sometimes")
    assert bad.returncode == 2 and "sometimes" in bad.stderr


def test_submit_refuses_a_spec_whose_step_fits_no_registered_trainer() -> None:
    """What daemon.core's submit check calls with the trainers' registered steps."""
    from plexctl.common.memplan import TrainerRoom, spec_step_problem

    spec = load_spec(REPO / "configs" / "qwen2.5-7b-math.yaml", [], check_files=False)
    tight = [TrainerRoom("w0/trainer", 20 * GiB, True, 16384)]
    roomy = [TrainerRoom("w1/trainer", 70 * GiB, True, 16384)]
    assert "more than w0/trainer has for a step (20.0 GiB)" in spec_step_problem(spec, tight, "bfloat16")
    assert spec_step_problem(spec, tight + roomy, "bfloat16") == ""
