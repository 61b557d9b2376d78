"""Built-in RL algorithms, each written on the public library ``plexctl.rl`` and nothing else.

``run_algorithm(job)`` is what a job's driver calls: the built-in named by ``algo.name``, or
the user's own ``algo.loop`` (``module:function(job)``, imported from ``algo.path``). A loop
that returns without a single training step fails the job (``LoopRanNoStep``): it learned
nothing, and "succeeded" would say otherwise.
"""

from __future__ import annotations

from plexctl.algos.dapo import DAPO
from plexctl.algos.dr_grpo import DrGRPO
from plexctl.algos.group_loop import GroupLoop
from plexctl.algos.grpo import GRPO
from plexctl.algos.rloo import RLOO
from plexctl.common.user_code import import_object
from plexctl.rl import Job

ALGORITHMS: dict[str, type[GroupLoop]] = {"grpo": GRPO, "dr_grpo": DrGRPO, "dapo": DAPO, "rloo": RLOO}


class LoopLoadError(Exception):
    """The job's ``algo.loop`` cannot be imported."""


class LoopRanNoStep(Exception):
    """The job's ``algo.loop`` returned without sending a single training step."""


def run_algorithm(job: Job) -> None:
    a = job.spec.algo
    if a.loop:
        import_object(a.loop, a.path, "algo loop", LoopLoadError)(job)
        if not job.client.train_calls and job.checkpoint_step < a.steps:  # (resumed past its last step: done)
            raise LoopRanNoStep(
                f"algo.loop {a.loop} returned without running a training step "
                f"(no train or train_step call; algo.steps is {a.steps})"
            )
    else:
        ALGORITHMS[a.name](job).run()
