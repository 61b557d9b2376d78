"""Benchmark: what the Tinker HTTP front end adds to a call, and to an RL step, against the native
client on the same cluster, in one run.

Starts a local cluster on tiny-arith with ``--tinker-port`` and makes two Tinker training clients
of the same seed (two jobs). One is driven through the real ``tinker`` SDK over HTTP; the other,
natively, through ``plexctl.rl.JobClient`` (ZeroMQ, with the cluster's internal key, as the front
end's own calls go). The two paths alternate call by call, so a drift of the machine falls on
both alike:

- ``forward_backward``: cross-entropy on ``--batch`` tiny supervised examples (an ``optim_step``,
  not timed, every ``OPTIM_EVERY`` calls keeps the kept calls few);
- ``sample``: ``--samples`` samples of a few tokens of one prompt, from the latest saved weights;
- an RL step as tinker-cookbook's minimal loop makes it: sample a group per prompt from the latest
  weights, score, importance-sampling ``forward_backward``, ``optim_step``, new sampling weights.

Reported: p50 and p99 per call of each path, the HTTP path's added latency (p50 and p99
differences) and the RL step's median time through each. Usage: ``python bench/tinker_latency.py
[--quick] [--calls N] [--rl-steps N]``; writes ``bench/results/tinker.json`` (``tinker-quick.json``
with ``--quick``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.hostinfo import describe  # noqa: E402
from plexctl.common import auth  # noqa: E402
from plexctl.common import calls as C  # noqa: E402
from plexctl.common.atomic import write_json_atomic  # noqa: E402
from plexctl.common.cluster import read_endpoint  # noqa: E402
from plexctl.rl import JobClient  # noqa: E402
from plexctl.tiny_models import train_problems  # noqa: E402

MODEL = REPO / ".plexrl" / "models" / "tiny-arith"
OPTIM_EVERY = 5
GROUP = 4  # samples per prompt in an RL step
RL_PROMPTS = 4
console = Console() if sys.stdout.isatty() else Console(width=120)


def plexctl(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PLEXRL_HOME": str(home), "PYTHONPATH": str(REPO), "TINKER_TELEMETRY": "0"}
    return subprocess.run(
        [sys.executable, "-m", "plexctl.cli", *args], cwd=REPO, env=env, text=True, capture_output=True, timeout=900
    )


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summary(samples: list[float]) -> dict[str, float]:
    return {"n": len(samples), "p50_ms": 1e3 * percentile(samples, 0.5), "p99_ms": 1e3 * percentile(samples, 0.99)}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


class Paths:
    """The same calls through the SDK (HTTP) and through JobClient (native), on two jobs."""

    def __init__(self, tinker: Any, service: Any, state_dir: Path, batch: int, samples: int) -> None:
        self.tinker = tinker
        self.http = service.create_lora_training_client(base_model="tiny-arith", rank=8, seed=3).result()
        other = service.create_lora_training_client(base_model="tiny-arith", rank=8, seed=3).result()
        runs = json.loads((state_dir / "tinker" / "runs.json").read_text())
        endpoint = read_endpoint(state_dir)
        keys = auth.internal_keys(auth.keys_dir(state_dir))
        self.native = JobClient(
            endpoint.address, runs[other.model_id]["job_id"], keys=keys, identity="bench:plexctl.rl"
        )
        self.tokenizer = self.http.get_tokenizer()
        self.data = self._supervised(batch)
        self.calls = C.LossCall([self._token_datum(d) for d in self.data], "cross_entropy")
        self.prompt = self.tokenizer("3+4=")["input_ids"]
        self.samples = samples
        self.sampler = self.http.save_weights_and_get_sampling_client().result()
        self.version = self.native.publish()
        self.kept: list[C.LossCall] = []

    def _supervised(self, n: int) -> list[Any]:
        tinker, out = self.tinker, []
        for p in train_problems()[:n]:
            prompt = self.tokenizer(p.prompt)["input_ids"]
            answer = self.tokenizer(p.answer, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            tokens = prompt + answer
            weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
            out.append(
                tinker.Datum(
                    model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
                )
            )
        return out

    @staticmethod
    def _token_datum(d: Any) -> C.TokenDatum:
        return C.TokenDatum(
            tokens=d.model_input.to_ints(),
            target_tokens=[int(x) for x in d.loss_fn_inputs["target_tokens"].tolist()],
            weights=[float(x) for x in d.loss_fn_inputs["weights"].tolist()],
        )

    def fb_http(self) -> None:
        self.http.forward_backward(self.data, "cross_entropy").result()

    def fb_native(self) -> None:
        self.native.forward_backward(self.calls)
        self.kept.append(self.calls)

    def optim(self) -> None:
        self.http.optim_step(self.tinker.AdamParams(learning_rate=1e-3)).result()
        self.native.optim_step(self.kept, C.AdamStep(learning_rate=1e-3))
        self.kept = []

    def sample_http(self) -> None:
        params = self.tinker.SamplingParams(max_tokens=3, seed=1)
        prompt = self.tinker.ModelInput.from_ints(self.prompt)
        self.sampler.sample(prompt, num_samples=self.samples, sampling_params=params).result()

    def sample_native(self) -> None:
        sampling = C.Sampling(max_tokens=3, n=self.samples, seed=1)
        self.native.call(C.GenerateReq([], sampling, prompt_tokens=[self.prompt], version=self.version))

    # -- an RL step, as tinker-cookbook's minimal loop writes it

    def rl_step_http(self, step: int) -> None:
        tinker, problems = self.tinker, train_problems()[step * RL_PROMPTS : (step + 1) * RL_PROMPTS]
        params = tinker.SamplingParams(max_tokens=4, seed=step, temperature=1.0)
        futures = [
            self.sampler.sample(tinker.ModelInput.from_ints(self.tokenizer(p.prompt)["input_ids"]), GROUP, params)
            for p in problems
        ]
        data = []
        for p, future in zip(problems, futures):
            prompt = self.tokenizer(p.prompt)["input_ids"]
            seqs = future.result().sequences
            rewards = [float(self.tokenizer.decode(s.tokens).strip().startswith(p.answer)) for s in seqs]
            mean = sum(rewards) / len(rewards)
            for seq, reward in zip(seqs, rewards):
                tokens = prompt + list(seq.tokens)
                n = len(seq.tokens)
                data.append(
                    tinker.Datum(
                        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": tokens[1:],
                            "logprobs": [0.0] * (len(prompt) - 1) + list(seq.logprobs),
                            "advantages": [0.0] * (len(prompt) - 1) + [reward - mean] * n,
                        },
                    )
                )
        self.http.forward_backward(data, "importance_sampling").result()
        self.http.optim_step(tinker.AdamParams(learning_rate=1e-3)).result()
        self.sampler = self.http.save_weights_and_get_sampling_client().result()

    def rl_step_native(self, step: int) -> None:
        problems = train_problems()[step * RL_PROMPTS : (step + 1) * RL_PROMPTS]
        prompts = [self.tokenizer(p.prompt)["input_ids"] for p in problems]
        sampling = C.Sampling(max_tokens=4, n=GROUP, seed=step, temperature=1.0)
        reply = self.native.call(C.GenerateReq([], sampling, prompt_tokens=prompts, version=self.version))
        data = []
        for i, (p, prompt) in enumerate(zip(problems, prompts)):
            comps = reply.completions[i * GROUP : (i + 1) * GROUP]
            rewards = [float(c.text.strip().startswith(p.answer)) for c in comps]
            mean = sum(rewards) / len(rewards)
            for comp, reward in zip(comps, rewards):
                tokens = prompt + list(comp.token_ids)
                n = len(comp.token_ids)
                data.append(
                    C.TokenDatum(
                        tokens=tokens[:-1],
                        target_tokens=tokens[1:],
                        logprobs=[0.0] * (len(prompt) - 1) + list(comp.logprobs),
                        advantages=[0.0] * (len(prompt) - 1) + [reward - mean] * n,
                    )
                )
        call = C.LossCall(data, "importance_sampling")
        self.native.forward_backward(call)
        self.version = self.native.optim_step([call], C.AdamStep(learning_rate=1e-3), publish=True).version


def run(calls: int, rl_steps: int, batch: int, samples: int) -> dict[str, Any]:
    import tinker

    home = Path(tempfile.mkdtemp(prefix="plexrl-bench-tinker-"))
    up = plexctl(home, "up", "--local", "--model", str(MODEL), "--tinker-port", "0")
    if up.returncode != 0:
        raise SystemExit(f"plexctl up --tinker-port failed: {up.stderr}")
    state_dir = home / "clusters" / "default"
    try:
        url = json.loads((state_dir / "tinker.json").read_text())["url"]
        key = (home / "tinker-api-key").read_text().strip()
        os.environ["TINKER_TELEMETRY"] = "0"
        paths = Paths(tinker, tinker.ServiceClient(base_url=url, api_key=key), state_dir, batch, samples)
        for warm in (paths.fb_http, paths.fb_native, paths.sample_http, paths.sample_native):
            warm()
        paths.optim()
        times: dict[str, list[float]] = {k: [] for k in ("fb_http", "fb_native", "sample_http", "sample_native")}
        with console.status("calls") as spinner:
            for i in range(calls):
                for name in times:
                    times[name].append(timed(getattr(paths, name))[0])
                if (i + 1) % OPTIM_EVERY == 0:
                    paths.optim()
                spinner.update(f"calls: {i + 1}/{calls} of each")
            rl: dict[str, list[float]] = {"http": [], "native": []}
            for step in range(rl_steps):
                rl["http"].append(timed(functools.partial(paths.rl_step_http, step))[0])
                rl["native"].append(timed(functools.partial(paths.rl_step_native, step))[0])
                spinner.update(f"RL steps: {step + 1}/{rl_steps} of each")
        paths.native.close()
    finally:
        plexctl(home, "down")
    out: dict[str, Any] = {name: summary(s) for name, s in times.items()}
    for call in ("fb", "sample"):
        h, n = out[f"{call}_http"], out[f"{call}_native"]
        out[f"{call}_added"] = {"p50_ms": h["p50_ms"] - n["p50_ms"], "p99_ms": h["p99_ms"] - n["p99_ms"]}
    out["rl_step"] = {
        "steps": rl_steps,
        "http_median_s": statistics.median(rl["http"]),
        "native_median_s": statistics.median(rl["native"]),
        "ratio": statistics.median(rl["http"]) / statistics.median(rl["native"]),
    }
    return out


def print_report(r: dict[str, Any]) -> None:
    t = Table(title="Tinker HTTP front end vs the native client, same cluster")
    for col in ("call", "HTTP p50 ms", "native p50 ms", "added p50 ms", "HTTP p99 ms", "native p99 ms", "added p99 ms"):
        t.add_column(col, justify="right")
    for call, name in (("fb", "forward_backward"), ("sample", "sample")):
        h, n, a = r[f"{call}_http"], r[f"{call}_native"], r[f"{call}_added"]
        t.add_row(
            name,
            *(f"{x:.1f}" for x in (h["p50_ms"], n["p50_ms"], a["p50_ms"], h["p99_ms"], n["p99_ms"], a["p99_ms"])),
        )
    console.print(t)
    s = r["rl_step"]
    console.print(
        f"RL step (median of {s['steps']}): HTTP {s['http_median_s']:.3f} s, native {s['native_median_s']:.3f} s, "
        f"ratio {s['ratio']:.2f}"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few calls: keeps the benchmark working")
    ap.add_argument("--calls", type=int, default=100, help="calls of each kind through each path")
    ap.add_argument("--rl-steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8, help="examples per forward_backward")
    ap.add_argument("--samples", type=int, default=8, help="samples per sample call")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    calls, rl_steps = (5, 2) if args.quick else (args.calls, args.rl_steps)
    started = time.time()
    result = run(calls, rl_steps, args.batch, args.samples)
    print_report(result)
    doc = {
        "command": "python bench/tinker_latency.py" + (" --quick" if args.quick else ""),
        "machine": describe(),
        "when": time.strftime("%Y-%m-%d", time.gmtime(started)),
        "calls": calls,
        "batch": args.batch,
        "samples": args.samples,
        **result,
    }
    out = args.out or REPO / "bench" / "results" / ("tinker-quick.json" if args.quick else "tinker.json")
    write_json_atomic(out, doc)
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
