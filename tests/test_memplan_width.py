"""Wide trainer engines in the memory plan: the width a step needs (``memplan.trainer_width``), each
rank's share (1/width of the weights, states and gradients, FSDP's buffers added, a micro-batch's
activations not divided), and ``plexctl plan`` printing the width, run as a user types it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from plexctl.common.cluster_config import ClusterConfig
from plexctl.common.memplan import (
    GiB,
    JobShape,
    NodeShape,
    fsdp_buffer_bytes,
    job_sizes,
    layer_parameters,
    plan_for_specs,
    plan_memory,
    rank_job_bytes,
    rank_weights_bytes,
    render_plan,
    trainer_step,
    trainer_width,
    trainer_widths,
    weights_bytes,
)
from plexctl.common.model_shapes import model_config_for
from plexctl.common.state_policy import HOST
from plexctl.common.state_size import full_state_size, parameter_count
from plexctl.spec_files import load_spec

REPO = Path(__file__).resolve().parents[1]
NODE_8X80 = NodeShape.parse("8x80G")
FULL_3B = REPO / "configs" / "qwen2.5-3b-full.yaml"
LORA_7B = REPO / "configs" / "qwen2.5-7b-math.yaml"
AT_7B = "model.path=/models/Qwen2.5-7B-Instruct"
AT_32B = "model.path=/models/Qwen2.5-32B-Instruct"
AT_0_5B = "model.path=/models/Qwen2.5-0.5B-Instruct"
FULL_7B_ON_8X80 = ("--gpus", "8x80G", "--trainer-gpus", "4", "--device-slots", "1")  # the layout a 7B full job needs


def _plan_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "plexctl.cli", "plan", *args], capture_output=True, text=True, cwd=REPO, timeout=120
    )


def test_widths_are_powers_of_two_that_divide_the_trainer_gpus() -> None:
    assert trainer_widths(8, 8) == [1, 2, 4, 8]
    assert trainer_widths(6, 6) == [1, 2]
    assert trainer_widths(1, 1) == [1]
    assert trainer_widths(20) == [1, 2, 4, 8, 16]


def test_width_one_is_the_single_gpu_step_and_a_rank_holds_its_share() -> None:
    config = model_config_for("/models/Qwen2.5-7B-Instruct")
    job = JobShape("full", 0, 1536, target_modules=(), full=True)
    state = full_state_size(config, "bfloat16", cuda=True).total
    one = trainer_step(config, "bfloat16", 16384, "on", 0, states=state, job=job)
    assert trainer_step(config, "bfloat16", 16384, "on", 0, states=state, job=job, width=1) == one
    four = trainer_step(config, "bfloat16", 16384, "on", 0, states=state, job=job, width=4)
    head_params = config["vocab_size"] * config["hidden_size"]  # the lm_head stays whole on every rank
    head = head_params * 2
    assert four.weights == math.ceil((one.weights - head) / 4) + head
    head_state = state * head_params // parameter_count(config)  # a full job's lm_head: weight, master, moments
    assert four.states == math.ceil((state - head_state) / 4) + head_state
    split = math.ceil((parameter_count(config) - head_params) / 4) + head_params
    assert four.gradients == split * (4 + 2)
    assert four.kept == one.kept and four.transient == one.transient  # a rank's micro-batch is its own
    buffers = fsdp_buffer_bytes(config, "bfloat16", job, 4)
    assert buffers == 2 * layer_parameters(config) * 2 + layer_parameters(config) * 4
    assert four.workspace == one.workspace + buffers
    assert fsdp_buffer_bytes(config, "bfloat16", job, 1) == 0


def test_the_width_is_the_smallest_whose_step_fits_and_one_where_one_gpu_holds_it() -> None:
    seven, small = model_config_for("/models/Qwen2.5-7B-Instruct"), model_config_for("/models/Qwen2.5-0.5B-Instruct")
    full = JobShape("full", 0, 1536, target_modules=(), full=True)
    lora = JobShape("lora", 32, 1536)
    assert trainer_width(seven, full, "bfloat16", 80 * GiB, 8) == 4
    assert trainer_width(seven, full, "bfloat16", 80 * GiB, 2) == 1  # no width of 2 GPUs holds it: the plan says so
    assert trainer_width(small, lora, "bfloat16", 80 * GiB, 8) == 1
    assert trainer_width(seven, full, "bfloat16", 80 * GiB, 8, ClusterConfig(trainer_width=8)) == 8


def test_a_7b_full_fine_tuning_plan_shards_its_trainer_over_4_gpus() -> None:
    spec = load_spec(FULL_3B, [AT_7B], check_files=False)
    cluster = ClusterConfig(trainer_gpus=4, device_slots=1)
    from plexctl.cli.specs import plan_engines

    engines = plan_engines(8, None, 4, 1)
    plan = plan_for_specs([spec], NODE_8X80, engines, cluster)
    assert plan.fits, plan.problems
    assert plan.trainer_width == 4 and [t.gpus for t in plan.trainers] == [4]
    t = plan.trainers[0]
    state = full_state_size(plan.config, "bfloat16", cuda=True).total
    head_params = plan.config["vocab_size"] * plan.config["hidden_size"]
    head_state = state * head_params // parameter_count(plan.config)  # the lm_head's part, whole on each rank
    assert t.job_state_bytes == math.ceil((state - head_state) / 4) + head_state
    head = head_params * 2
    assert t.weights_bytes == math.ceil((weights_bytes(plan.config, "bfloat16") - head) / 4) + head
    assert t.step_peak_bytes <= t.room_bytes and t.fsdp_buffer_bytes > 0
    assert t.tier_jobs(HOST) == t.tier_bytes[HOST] // t.job_state_bytes  # each rank swaps its own shard
    text = render_plan(plan)
    assert "Trainer width: trainer engines of 4 GPUs" in text and "FSDP buffers" in text
    assert "Trainer engine 0: 4 GPUs (FSDP, data parallel), per GPU" in text


def test_a_plan_at_width_one_keeps_the_single_gpu_figures() -> None:
    spec = load_spec(LORA_7B, [], check_files=False)
    auto = plan_for_specs([spec], NODE_8X80)
    asked = plan_for_specs([spec], NODE_8X80, cluster=ClusterConfig(trainer_width=1))
    assert auto.trainer_width == 1 and auto.trainers == asked.trainers and auto.problems == asked.problems == ()
    assert all(t.fsdp_buffer_bytes == 0 for t in auto.trainers)


def test_a_shared_gpu_trainer_stays_single_and_says_so_when_asked_wider() -> None:
    config = model_config_for("/models/Qwen2.5-0.5B-Instruct")
    plan = plan_memory(config, NodeShape.parse("1x80G"), cluster=ClusterConfig(trainer_width=2))
    assert plan.trainer_width == 1
    assert any(p.startswith("--trainer-width 2: trainers here are of 1 GPU") for p in plan.problems)


# ---------------------------------------------------------------- plexctl plan, as a user types it


def test_plan_7b_full_fine_tuning_on_8x80g_fits_trainer_engines_of_4_gpus() -> None:
    proc = _plan_cli(str(FULL_3B), "--set", AT_7B, *FULL_7B_ON_8X80)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Trainer width: trainer engines of 4 GPUs (the smallest width whose per-rank step fits one GPU)" in (
        proc.stdout
    )
    assert "the runtime trains it on engines of one GPU for now, and refuses it on wider ones" in proc.stdout
    assert "Everything fits." in proc.stdout
    as_json = _plan_cli(str(FULL_3B), "--set", AT_7B, *FULL_7B_ON_8X80, "--json")
    plan = json.loads(as_json.stdout)["plans"][0]
    assert as_json.returncode == 0 and plan["trainer_width"] == 4 and plan["fits"]
    assert [t["gpus"] for t in plan["trainers"]] == [4]
    assert plan["trainers"][0]["step_peak_bytes"] <= plan["trainers"][0]["room_bytes"]


def test_plan_7b_full_on_the_default_layout_names_the_width_it_needs() -> None:
    proc = _plan_cli(str(FULL_3B), "--set", AT_7B, "--gpus", "8x80G")
    assert proc.returncode == 7
    assert "trainer engines: the step fits trainer engines of 4 GPUs (--trainer-width 4)" in proc.stdout


def test_plan_7b_full_at_trainer_width_1_is_refused_with_the_numbers() -> None:
    proc = _plan_cli(str(FULL_3B), "--set", AT_7B, *FULL_7B_ON_8X80, "--trainer-width", "1")
    assert proc.returncode == 7
    assert "Trainer width: trainer engines of 1 GPU (as asked)" in proc.stdout
    assert "a step needs 170.5 GiB (weights 14.2 GiB + its state 99.3 GiB" in proc.stdout
    assert "more than trainer engine 0 has for a step (78.0 GiB)" in proc.stdout


def test_plan_32b_with_the_7b_examples_rank_32_lora_fits_trainer_engines_of_2_gpus() -> None:
    proc = _plan_cli(str(LORA_7B), "--set", AT_32B, "--gpus", "8x80G", "--tp", "2", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = json.loads(proc.stdout)["plans"][0]
    assert plan["trainer_width"] == 2 and plan["fits"] and [t["gpus"] for t in plan["trainers"]] == [2]


def test_plan_0_5b_lora_keeps_width_1() -> None:
    proc = _plan_cli(str(LORA_7B), "--set", AT_0_5B, "--gpus", "8x80G")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Trainer width: trainer engines of 1 GPU (one GPU holds the step)" in proc.stdout
    assert "Trainer engines 0-1: 1 GPU each" in proc.stdout


def test_an_explicit_width_that_does_not_divide_the_trainer_gpus_is_a_problem() -> None:
    spec = load_spec(LORA_7B, [], check_files=False)
    plan = plan_for_specs([spec], NODE_8X80, cluster=ClusterConfig(trainer_width=4))
    assert "--trainer-width 4: does not divide the node's 2 GPUs for trainers; widths that do: 1, 2" in plan.problems


def test_a_wide_trainer_keeps_a_lora_jobs_state_whole_on_every_rank() -> None:
    """LoRA adapters and their moments are replicated on a wide engine's ranks (the runtime's
    layout): a rank holds the whole state and gradient, and only the base shrinks with the width.
    With tied embeddings the lm_head is a whole copy of the split embedding, and a full job's step
    gathers its own head."""
    config = model_config_for("/models/Qwen2.5-32B-Instruct")
    job = JobShape("lora", 32, 16384)
    state = job_sizes(config, job, "bfloat16", cuda=True)[0]
    one = trainer_step(config, "bfloat16", 16384, "on", 0, states=state, job=job)
    two = trainer_step(config, "bfloat16", 16384, "on", 0, states=state, job=job, width=2)
    assert two.states == one.states == state and two.gradients == one.gradients
    assert two.weights < one.weights and rank_job_bytes(config, state, job, 2) == state
    assert fsdp_buffer_bytes(config, "bfloat16", job, 2) == 2 * layer_parameters(config) * 2  # no reduce-scatter
    tied = model_config_for("/models/Qwen2.5-3B-Instruct")
    assert tied["tie_word_embeddings"]  # the embedding is split, the lm_head a whole copy of it
    head = tied["vocab_size"] * tied["hidden_size"] * 2
    assert rank_weights_bytes(tied, "bfloat16", 2) == math.ceil(weights_bytes(tied, "bfloat16") / 2) + head
    full = JobShape("full", 0, 16384, target_modules=(), full=True)  # its head gathered, its gradient, in fp32
    untied = {**tied, "tie_word_embeddings": False}
    assert fsdp_buffer_bytes(tied, "bfloat16", full, 2) == fsdp_buffer_bytes(untied, "bfloat16", full, 2) + head * 4
