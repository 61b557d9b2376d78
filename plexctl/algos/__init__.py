"""Built-in RL algorithms, each written on the public library ``plexctl.rl`` and nothing else.

``run_algorithm(job)`` is what a job's driver calls: the built-in named by ``algo.name``, or
the user's own ``algo.loop`` (``module:function(job)``, imported from ``algo.path``).
"""

from __future__ import annotations

from plexctl.algos.dapo import DAPO
from plexctl.algos.dr_grpo import DrGRPO
from plexctl.algos.group_loop import GroupLoop
from plexctl.algos.grpo import GRPO
from plexctl.algos.rloo import RLOO
from plexctl.rl import Job
from plexctl.user_code import import_object

ALGORITHMS: dict[str, type[GroupLoop]] = {"grpo": GRPO, "dr_grpo": DrGRPO, "dapo": DAPO, "rloo": RLOO}


class LoopLoadError(Exception):
    """The job's ``algo.loop`` cannot be imported."""


def run_algorithm(job: Job) -> None:
    a = job.spec.algo
    if a.loop:
        import_object(a.loop, a.path, "algo loop", LoopLoadError)(job)
    else:
        ALGORITHMS[a.name](job).run()
