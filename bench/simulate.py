"""Benchmark: a cluster-scale trace replayed through the daemon's own scheduler core, per policy.

The program is ``daemon/simulate.py`` (``plexctl simulate``); this runs it with the benchmark's
defaults: it calibrates against ``bench/results/multiplex.json`` (the real-engine benchmark on
this machine: the simulator predicts the shared / isolated engine-seconds-per-step ratio that
run measured, and the table shows both), names the machine as the other benchmarks do, and
writes ``bench/results/simulate.json`` (``simulate-quick.json`` with ``--quick``) for the default
``mixed`` trace, ``simulate-classic.json`` (``simulate-classic-quick.json``) for ``--scenario
classic``, the trace of the figures before the mixed case.

Usage: ``python bench/simulate.py [--quick] [--scenario mixed|classic] [--jobs N] [--gpus G] [--trace FILE]
[--out FILE]``;
``--help`` lists the rest. The method and the history are in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.hostinfo import describe  # noqa: E402
from daemon.simulate import Defaults  # noqa: E402
from daemon.simulate import main as simulate_main  # noqa: E402

MULTIPLEX_JSON = REPO / "bench" / "results" / "multiplex.json"
BENCH = Defaults(
    command="python bench/simulate.py",
    multiplex=MULTIPLEX_JSON,
    out=lambda quick, scenario: (
        REPO
        / "bench"
        / "results"
        / ("simulate" + ("-classic" if scenario == "classic" else "") + ("-quick" if quick else "") + ".json")
    ),
    machine=describe,
)


def main(argv: list[str] | None = None) -> int:
    return simulate_main(argv, BENCH)


if __name__ == "__main__":
    sys.exit(main())
