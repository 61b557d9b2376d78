"""Benchmark: tinker-cookbook's own recipes, unchanged, against a local cluster's Tinker API.

Installs ``tinker-cookbook`` (``COOKBOOK``, with its ``math-rl`` extra) into a virtual environment
of its own (``--venv``; it pins an older ``transformers`` than PlexRL's), starts a local cluster on
tiny-arith with ``--tinker-port``, and runs two of the cookbook's entry points pointed at it, with
options on their command lines only (no code of theirs changed, nothing from the Hugging Face hub):

- supervised: ``tinker_cookbook.recipes.chat_sl.train`` on a conversation file made from the tiny
  arithmetic task ("12+7=" -> "19");
- RL: ``tinker_cookbook.recipes.rl_basic`` with the cookbook's own arithmetic environment
  (``math_rl.arithmetic_env``), without its few-shot prefix (the tiny model's context is 64 tokens).

Both use the cookbook's ``role_colon`` renderer: the cookbook maps only hub model ids to renderers.
The tiny model's vocabulary has no capitals or newlines, so the renderer's "User:" / "Assistant:"
and the RL environment's questions ("What is 3 + 4?") reach it partly as unknown tokens: the RL
recipe runs end to end, but its reward says nothing about learning (the cookbook-style loop in
``tests/test_tinker_e2e.py`` does). Reported: each recipe's exit, steps, wall time, and its own
metrics (supervised: ``train_mean_nll`` first and last; RL: reward and accuracy per step), and the
jobs the cluster ran for them. Usage: ``python bench/tinker_cookbook.py [--quick] [--venv DIR]``;
writes ``bench/results/tinker_cookbook.json`` (``tinker_cookbook-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.hostinfo import describe  # noqa: E402
from plexctl.common.atomic import write_json_atomic  # noqa: E402
from plexctl.tiny_models import train_problems  # noqa: E402

MODEL = REPO / ".plexrl" / "models" / "tiny-arith"
COOKBOOK = ["tinker-cookbook[math-rl]==0.5.8", "tinker==0.38.0"]  # 0.5.8: the newest this SDK's pin allows
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
console = Console() if sys.stdout.isatty() else Console(width=120)


def ensure_venv(venv: Path) -> Path:
    """The cookbook's interpreter, installing it into ``venv`` if it is not there yet."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", "import tinker_cookbook.recipes.rl_basic, tinker_cookbook.recipes.chat_sl.train"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    console.print(f"installing {' '.join(COOKBOOK)} into {venv} (once)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *COOKBOOK], check=True)
    return python


def plexctl(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PLEXRL_HOME": str(home), "PYTHONPATH": str(REPO), **OFFLINE}
    return subprocess.run(
        [sys.executable, "-m", "plexctl.cli", *args], cwd=REPO, env=env, text=True, capture_output=True, timeout=900
    )


def metrics(log_path: Path) -> list[dict[str, Any]]:
    path = log_path / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def recipe(python: Path, module: str, options: list[str], env: dict[str, str], log_path: Path) -> dict[str, Any]:
    """Run one cookbook entry point; its exit, wall time, the tail of its output, its metrics."""
    t0 = time.monotonic()
    cmd = [str(python), "-m", module, *options, f"log_path={log_path}"]
    proc = subprocess.run(cmd, cwd=log_path.parent, env=env, text=True, capture_output=True, timeout=3600)
    shown = [o if "=/" not in o else o.split("=/")[0] + "=..." for o in options]
    return {
        "command": f"python -m {module} {' '.join(shown)}",
        "returncode": proc.returncode,
        "wall_s": time.monotonic() - t0,
        "output_tail": (proc.stdout + proc.stderr)[-2000:] if proc.returncode else "",
        "metrics": metrics(log_path),
    }


def run(python: Path, quick: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="plexrl-cookbook-") as tmp:
        home, work = Path(tmp) / "home", Path(tmp) / "runs"
        work.mkdir()
        up = plexctl(home, "up", "--local", "--model", str(MODEL), "--tinker-port", "0")
        if up.returncode != 0:
            raise SystemExit(f"plexctl up failed: {up.stderr}")
        try:
            state = home / "clusters" / "default"
            url = json.loads((state / "tinker.json").read_text())["url"]
            env = {**os.environ, **OFFLINE, "TINKER_API_KEY": (home / "tinker-api-key").read_text().strip()}
            env.pop("PYTHONPATH", None)
            data = work / "arith.jsonl"
            problems = train_problems()[: 64 if quick else 256]
            data.write_text(
                "".join(
                    json.dumps(
                        {
                            "messages": [
                                {"role": "user", "content": p.prompt},
                                {"role": "assistant", "content": p.answer},
                            ]
                        }
                    )
                    + "\n"
                    for p in problems
                )
            )
            common = [f"model_name={MODEL}", "renderer_name=role_colon", "lora_rank=8", f"base_url={url}"]
            sl = recipe(
                python,
                "tinker_cookbook.recipes.chat_sl.train",
                [
                    *common,
                    f"dataset={data}",
                    "max_length=64",
                    "batch_size=16",
                    f"num_epochs={1 if quick else 3}",
                    "learning_rate=0.003",
                    "lr_schedule=constant",
                    "save_every=0",
                    "eval_every=0",
                    "infrequent_eval_every=0",
                    "behavior_if_log_dir_exists=delete",
                ],
                env,
                work / "sl",
            )
            rl = recipe(
                python,
                "tinker_cookbook.recipes.rl_basic",
                [
                    f"...model_name={MODEL}",  # chz's wildcard: the dataset builder's too
                    "renderer_name=role_colon",
                    "lora_rank=8",
                    f"base_url={url}",
                    "dataset_builder=tinker_cookbook.recipes.math_rl.arithmetic_env:ArithmeticDatasetBuilder",
                    "dataset_builder.include_fewshot=False",
                    "dataset_builder.batch_size=4",
                    "dataset_builder.group_size=4",
                    f"dataset_builder.n_batches={2 if quick else 8}",
                    "dataset_builder.renderer_name=role_colon",
                    f"dataset_builder.model_name_for_tokenizer={MODEL}",
                    "max_tokens=5",
                ],
                env,
                work / "rl",
            )
            status = json.loads(plexctl(home, "status", "--json").stdout)
            jobs = [
                {k: j[k] for k in ("name", "user", "state", "step")}
                for j in status["jobs"]
                if j["name"].startswith("tinker-")
            ]
        finally:
            plexctl(home, "down")
    return {"sl": sl, "rl": rl, "jobs": jobs}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    sl = [m["train_mean_nll"] for m in result["sl"]["metrics"] if "train_mean_nll" in m]
    rl = result["rl"]["metrics"]
    return {
        "sl_ok": result["sl"]["returncode"] == 0,
        "sl_steps": len(sl),
        "sl_nll_first": sl[0] if sl else None,
        "sl_nll_last": sl[-1] if sl else None,
        "rl_ok": result["rl"]["returncode"] == 0,
        "rl_steps": len(rl),
        "rl_reward": [m.get("env/all/reward/total") for m in rl],
        "rl_correct": [m.get("env/all/correct") for m in rl],
    }


def print_report(result: dict[str, Any], s: dict[str, Any]) -> None:
    table = Table(title="tinker-cookbook recipes against the cluster")
    for col in ("recipe", "exit", "steps", "wall s", "its metrics"):
        table.add_column(col)
    nll = f"train_mean_nll {s['sl_nll_first']:.3f} -> {s['sl_nll_last']:.3f}" if s["sl_steps"] else "no metrics"
    rewards = ", ".join(f"{r:.2f}" for r in s["rl_reward"] if r is not None)
    table.add_row(
        "chat_sl.train", str(result["sl"]["returncode"]), str(s["sl_steps"]), f"{result['sl']['wall_s']:.0f}", nll
    )
    table.add_row(
        "rl_basic",
        str(result["rl"]["returncode"]),
        str(s["rl_steps"]),
        f"{result['rl']['wall_s']:.0f}",
        f"reward {rewards}",
    )
    console.print(table)
    for name in ("sl", "rl"):
        if result[name]["returncode"]:
            console.print(f"[red]{name} failed[/red]:\n{result[name]['output_tail']}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps: keeps the benchmark working")
    ap.add_argument("--venv", type=Path, default=REPO / ".plexrl" / "cookbook-venv", help="the cookbook's venv")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    python = ensure_venv(args.venv)
    started = time.time()
    result = run(python, args.quick)
    s = summarize(result)
    print_report(result, s)
    version = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('tinker-cookbook'))"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    doc = {
        "command": "python bench/tinker_cookbook.py" + (" --quick" if args.quick else ""),
        "machine": describe(),
        "when": time.strftime("%Y-%m-%d", time.gmtime(started)),
        "cookbook": version,
        "summary": s,
        **result,
    }
    out = args.out or REPO / "bench" / "results" / (
        "tinker_cookbook-quick.json" if args.quick else "tinker_cookbook.json"
    )
    write_json_atomic(out, doc)
    console.print(f"wrote {out}")
    if not (s["sl_ok"] and s["rl_ok"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
