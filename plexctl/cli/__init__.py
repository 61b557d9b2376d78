"""plexctl: the command line of a PlexRL cluster (the ``plexctl`` console script is ``main``).

One module per noun, each verb a function that imports what it needs when it runs, so a verb
typed many times a day starts in about the time of typer itself (``bench/cli_startup.py``):
``start_stop`` (``up``, ``down``), ``keys`` (``keygen``, ``share``), ``specs`` (``validate``,
``plan``, ``submit``), ``jobs`` (``status``, ``top``, ``report``, ``ls``, ``logs``, ``export``,
``cancel``, ``wait``), ``demo`` (``demo``, ``simulate``); ``app`` registers them and turns known
errors into one line and an exit code. What they render or submit: ``views`` (tables, plain
text, JSON rows), ``top``, ``report`` (PNG plots), ``spec_doc`` (the spec reference), ``slurm``
(allocations). Nothing here imports torch, vLLM or the daemon's and workers' modules: what
needs them runs in a child process (``python -m daemon.simulate``, ``python -m plexctl.tiny_models``).
"""

from __future__ import annotations


def main() -> None:
    """The ``plexctl`` console script."""
    from plexctl.cli.app import main as run

    run()
