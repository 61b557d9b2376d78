"""A node's workers and their GPUs, as pure functions (no GPU, no Slurm needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.node import worker_command
from plexctl.common.errors import UsageError
from plexctl.common.layout import (
    LayoutError,
    TrainerSpan,
    WorkerPlacement,
    check_gpus,
    engine_kinds,
    node_gpus,
    place_workers,
    trainer_span,
)

BOTH = ["rollout", "trainer"]
EIGHT = [str(i) for i in range(8)]


def table(workers: list[WorkerPlacement]) -> list[tuple[str, str, str]]:
    """What a user reads off a layout: worker id, its engines, its GPUs."""
    return [(w.worker_id, ",".join(w.engines), ",".join(w.devices)) for w in workers]


def test_eight_gpus_default_to_six_rollout_engines_and_two_trainers() -> None:
    workers = place_workers("n1", EIGHT, BOTH, tp=1, trainer_width=1)
    assert table(workers) == [(f"n1-g{i}", "rollout", str(i)) for i in range(6)] + [
        ("n1-g6", "trainer", "6"),
        ("n1-g7", "trainer", "7"),
    ]
    assert [w.scratch_name for w in workers] == [w.worker_id for w in workers]  # one scratch each


def test_tensor_parallel_rollout_engines_own_several_gpus() -> None:
    assert table(place_workers("n1", EIGHT, BOTH, tp=2, trainer_width=1)) == [
        ("n1-g0", "rollout", "0,1"),
        ("n1-g2", "rollout", "2,3"),
        ("n1-g4", "rollout", "4,5"),
        ("n1-g6", "trainer", "6"),
        ("n1-g7", "trainer", "7"),
    ]


def test_the_default_split_gives_leftover_gpus_to_trainers_when_tp_does_not_divide_them() -> None:
    # 2 trainers leave 6: one engine of 4, 2 more trainers
    workers = place_workers("n1", EIGHT, BOTH, tp=4, trainer_width=1)
    assert table(workers) == [
        ("n1-g0", "rollout", "0,1,2,3"),
        ("n1-g4", "trainer", "4"),
        ("n1-g5", "trainer", "5"),
        ("n1-g6", "trainer", "6"),
        ("n1-g7", "trainer", "7"),
    ]


def test_explicit_split_of_six_and_two() -> None:
    assert table(place_workers("n1", EIGHT, BOTH, rollout_gpus=6, trainer_gpus=2, tp=1, trainer_width=1)) == table(
        place_workers("n1", EIGHT, BOTH, tp=1, trainer_width=1)
    )
    assert table(place_workers("n1", EIGHT, BOTH, trainer_gpus=4, tp=1, trainer_width=1))[-5:] == [
        ("n1-g3", "rollout", "3"),
        ("n1-g4", "trainer", "4"),
        ("n1-g5", "trainer", "5"),
        ("n1-g6", "trainer", "6"),
        ("n1-g7", "trainer", "7"),
    ]
    kinds = [w.engines for w in place_workers("n1", EIGHT, BOTH, rollout_gpus=2, tp=1, trainer_width=1)]
    assert kinds == [["rollout"]] * 2 + [["trainer"]] * 6  # the trainers take the rest


def test_explicit_counts_below_the_node_leave_the_rest_unused() -> None:
    assert table(place_workers("n1", EIGHT, BOTH, rollout_gpus=2, trainer_gpus=1, tp=1, trainer_width=1)) == [
        ("n1-g0", "rollout", "0"),
        ("n1-g1", "rollout", "1"),
        ("n1-g2", "trainer", "2"),
    ]


def test_gpu_ids_are_used_as_slurm_gave_them() -> None:
    workers = place_workers("n3", ["4", "5", "GPU-9f2c", "7"], BOTH, tp=1, trainer_width=1)
    assert table(workers) == [
        ("n3-g0", "rollout", "4"),
        ("n3-g1", "rollout", "5"),
        ("n3-g2", "rollout", "GPU-9f2c"),
        ("n3-g3", "trainer", "7"),
    ]


def test_a_node_of_one_kind_gives_it_every_gpu() -> None:
    assert table(place_workers("n1", ["0", "1"], ["rollout"], tp=1, trainer_width=1)) == [
        ("n1-g0", "rollout", "0"),
        ("n1-g1", "rollout", "1"),
    ]
    assert table(place_workers("n2", ["0", "1"], ["trainer"], tp=2, trainer_width=1)) == [
        ("n2-g0", "trainer", "0"),
        ("n2-g1", "trainer", "1"),
    ]
    # the other kind's count applies to the nodes that run it
    assert len(place_workers("n2", ["0", "1"], ["trainer"], rollout_gpus=7, tp=1, trainer_width=1)) == 2
    assert table(place_workers("n1", EIGHT, ["rollout"], tp=4, trainer_width=1)) == [
        ("n1-g0", "rollout", "0,1,2,3"),
        ("n1-g4", "rollout", "4,5,6,7"),
    ]


def test_one_gpu_with_both_kinds_is_one_worker_holding_both_engines() -> None:
    assert place_workers("n1", ["0"], {"trainer", "rollout"}, tp=1, trainer_width=1) == [
        WorkerPlacement("n1-g0", ["rollout", "trainer"], ["0"], "n1-g0")
    ]


def test_a_node_without_gpus_runs_one_worker_named_after_it_as_before() -> None:
    assert place_workers("n1", [], BOTH, tp=1, trainer_width=1) == [WorkerPlacement("n1", BOTH, [], "")]
    alone = place_workers("n2-4242", [], ["trainer"], tp=1, trainer_width=1)
    assert alone == [WorkerPlacement("n2-4242", ["trainer"], [], "")]
    assert place_workers("n2", [], ["trainer"], tp=2, trainer_width=1) == [WorkerPlacement("n2", ["trainer"], [], "")]


def test_a_joining_allocations_ids_keep_its_suffix() -> None:
    assert [w.worker_id for w in place_workers("n1-4242", ["0", "1"], ["trainer"], tp=1, trainer_width=1)] == [
        "n1-4242-g0",
        "n1-4242-g1",
    ]


@pytest.mark.parametrize(
    "gpus, kinds, options, message",
    [
        (
            EIGHT,
            BOTH,
            dict(rollout_gpus=6, trainer_gpus=3),
            "--rollout-gpus 6 + --trainer-gpus 3 = 9: more than the 8 GPUs of node n1",
        ),
        (EIGHT, BOTH, dict(rollout_gpus=6, tp=4), "--tp 4 does not divide --rollout-gpus 6 into whole rollout engines"),
        (EIGHT, BOTH, dict(trainer_gpus=3, tp=2), "--tp 2 does not divide the 5 rollout GPUs of node n1"),
        (["0", "1", "2"], ["rollout"], dict(tp=2), "--tp 2 does not divide the 3 rollout GPUs of node n1"),
        (EIGHT, BOTH, dict(rollout_gpus=0), "--rollout-gpus 0: node n1 runs rollout engines, they need at least 1"),
        (EIGHT, BOTH, dict(trainer_gpus=0, rollout_gpus=8), "--trainer-gpus 0: node n1 runs trainer engines"),
        (EIGHT, BOTH, dict(rollout_gpus=8), "--rollout-gpus 8: leaves none of the 8 GPUs of node n1 for its trainer"),
        (EIGHT, BOTH, dict(trainer_gpus=8), "--trainer-gpus 8: leaves none of the 8 GPUs of node n1 for its rollout"),
        (EIGHT, BOTH, dict(rollout_gpus=9), "--rollout-gpus 9: more than the 8 GPUs of node n1"),
        (EIGHT, ["trainer"], dict(trainer_gpus=9), "--trainer-gpus 9: more than the 8 GPUs of node n1"),
        (["0"], BOTH, dict(tp=2), "--tp 2: node n1 has 1 GPU; after 1 for training, too few for one rollout engine"),
        (["0", "1", "2", "3"], BOTH, dict(tp=4), "--tp 4: node n1 has 4 GPUs; after 1 for training"),
        (["0"], BOTH, dict(rollout_gpus=1), "--rollout-gpus 1: leaves none of the 1 GPUs of node n1"),
        ([], BOTH, dict(tp=2), "--tp 2: node n1 has no GPUs"),
        ([], BOTH, dict(rollout_gpus=2), "--rollout-gpus 2: node n1 has no GPUs"),
        ([], ["trainer"], dict(trainer_gpus=1), "--trainer-gpus 1: node n1 has no GPUs"),
        (EIGHT, BOTH, dict(tp=0), "--tp 0: must be 1 or more"),
        (EIGHT, BOTH, dict(trainer_gpus=-1), "--trainer-gpus -1: must be 0 or more"),
        (EIGHT, ["decoder"], {}, "--engines 'decoder'"),
        (EIGHT, [], {}, "--engines ''"),
    ],
)
def test_options_that_do_not_fit_the_node_are_one_line_usage_errors(gpus, kinds, options, message) -> None:
    with pytest.raises(LayoutError) as err:
        place_workers("n1", gpus, kinds, **{"tp": 1, **options}, trainer_width=1)
    assert isinstance(err.value, UsageError) and err.value.exit_code == 2
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "env, gpus",
    [
        ({"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_JOB_GPUS": "4,5"}, ["0", "1"]),  # what the task may use wins
        ({"CUDA_VISIBLE_DEVICES": ""}, []),  # set empty: GPUs hidden on purpose
        ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, []),
        ({"CUDA_VISIBLE_DEVICES": "GPU-aa, GPU-bb"}, ["GPU-aa", "GPU-bb"]),
        ({"SLURM_STEP_GPUS": "2,3", "SLURM_JOB_GPUS": "0,1,2,3"}, ["2", "3"]),
        ({"SLURM_JOB_GPUS": "6"}, ["6"]),
        ({"GPU_DEVICE_ORDINAL": "0,1"}, ["0", "1"]),
        ({"PATH": "/usr/bin"}, []),
    ],
)
def test_node_gpus_reads_what_slurm_gives_a_task(env, gpus) -> None:
    assert node_gpus(env) == gpus


def test_gpus_per_node_must_not_exceed_what_the_node_has() -> None:
    assert check_gpus("n1", ["0", "1"], 2) == ["0", "1"]
    assert check_gpus("n1", ["0", "1", "2"], 2) == ["0", "1"]  # the first ones asked for
    assert check_gpus("n1", ["0", "1"], 0) == ["0", "1"]  # none asked: what the node has
    with pytest.raises(LayoutError, match=r"^--gpus-per-node 8: node n1 has 2 GPUs \(CUDA_VISIBLE_DEVICES=0,1\)$"):
        check_gpus("n1", ["0", "1"], 8)
    with pytest.raises(LayoutError, match=r"^--gpus-per-node 1: node n1 has 0 GPUs \(CUDA_VISIBLE_DEVICES=none\)$"):
        check_gpus("n1", [], 1)


def test_engine_kinds_reads_a_nodes_engines_value() -> None:
    assert engine_kinds("trainer, rollout") == BOTH
    assert engine_kinds("rollout") == ["rollout"]
    with pytest.raises(LayoutError, match="--engines 'rollout,critic'"):
        engine_kinds("rollout,critic")


def test_a_worker_is_told_its_id_engines_scratch_and_tensor_parallel_size() -> None:
    rollout, trainer = place_workers("n1", EIGHT[:4], BOTH, rollout_gpus=2, tp=2, trainer_width=1)[:2]
    config = Path("/s/cluster.json")
    argv = worker_command(rollout, "tcp://n0:5555", "n1", "/m", Path("/scratch/n1-g0"), 2, 4, config)
    assert argv[argv.index("--worker-id") + 1] == "n1-g0" and argv[argv.index("--engines") + 1] == "rollout"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and argv[argv.index("--threads") + 1] == "4"
    assert argv[argv.index("--scratch") + 1] == "/scratch/n1-g0"
    assert argv[argv.index("--cluster-config") + 1] == "/s/cluster.json"  # its settings
    argv = worker_command(trainer, "tcp://n0:5555", "n1", "/m", Path("/scratch/n1-g2"), 2, None, config)
    assert "--tensor-parallel-size" not in argv and "--threads" not in argv  # a trainer has no tp; default threads
    single = place_workers("n1", EIGHT[:2], ["rollout"], tp=1, trainer_width=1)[0]
    assert "--tensor-parallel-size" not in worker_command(
        single, "tcp://n0:5555", "n1", "/m", Path("/s"), 1, None, config
    )


def test_a_trainer_engine_of_several_gpus_is_one_worker_holding_them() -> None:
    workers = place_workers("n1", [str(i) for i in range(8)], ["trainer"], tp=1, trainer_width=4)
    assert [(w.worker_id, w.devices) for w in workers] == [
        ("n1-g0", ["0", "1", "2", "3"]),
        ("n1-g4", ["4", "5", "6", "7"]),
    ]
    wider = place_workers("n1", [str(i) for i in range(8)], ["trainer"], tp=1, trainer_width=16)
    assert [w.devices for w in wider] == [[str(i) for i in range(8)]]  # the node's part of a wider engine


def test_an_engine_wider_than_a_node_spans_whole_nodes_in_order() -> None:
    assert trainer_span(8, 8, 0) is None and trainer_span(2, 0, 1) is None  # fits a node; no GPUs: one node
    assert trainer_span(16, 8, 0) == TrainerSpan(0, 0, list(range(8)))  # rank 0 here: its worker speaks
    assert trainer_span(16, 8, 1) == TrainerSpan(0, 1, list(range(8, 16)))
    assert trainer_span(16, 8, 2) == TrainerSpan(1, 0, list(range(8)))  # the next engine's first node
    assert trainer_span(2, 1, 1) == TrainerSpan(0, 1, [1])  # the two-node test cluster: one rank on each


def test_a_wide_trainer_never_shares_a_process_with_a_rollout_engine() -> None:
    with pytest.raises(LayoutError, match="too few for one rollout engine"):
        place_workers("n1", ["0"], BOTH, tp=1, trainer_width=2)
    assert table(place_workers("n1", ["0", "1"], BOTH, tp=1, trainer_width=2)) == [
        ("n1-g0", "rollout", "0"),
        ("n1-g1", "trainer", "1"),
    ]
