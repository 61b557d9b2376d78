"""Errors a user can cause, as the user meets them: one line naming the YAML path (and the data
line or the job), a distinct exit code, nothing queued or left running.

* `validate` and `submit` check what the engines need of the model directory, every data record
  (streamed: a dataset is never held), and that `sampling.max_tokens` with the longest prompt fits
  the model's context; the daemon refuses a `max_tokens` its rollout engines cannot hold. A failed
  `up` stops what it started (exit 11).
* A job name that a queued or running job of the same user holds is refused (exit 2) unless
  `submit --replace`, by the daemon itself (a client that skips the CLI is held to it); a retried
  submit still gets its job.
* A job's driver fails a record no check caught before it reaches `generate`, and a custom loop
  that runs no step fails the job with that reason.

No engines here except in one `up` test (slow); the driver tests run a real driver against a
real daemon server whose messages the test dispatches.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest

from daemon.main import Daemon
from plexctl.common import auth
from plexctl.common import protocol as P
from plexctl.common.client import Client, current_user
from plexctl.common.cluster import read_endpoint
from plexctl.common.errors import ExitCode, RemoteError
from plexctl.common.frames import NOBLOCK, recv_frames
from plexctl.common.spec import spec_to_wire
from plexctl.data import scan_records
from plexctl.spec_files import load_spec
from tests.test_logs_follow import BareCluster
from tests.test_robustness import TINY

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def plexctl(*args: str, home: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **({"PLEXRL_HOME": str(home)} if home else {})}
    return subprocess.run(
        [sys.executable, "-m", "plexctl.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def one_error(proc: subprocess.CompletedProcess, code: int) -> str:
    """The one line a failed command printed, after checking its exit code."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def spec_file(directory: Path, model: Path, data: Path, **sections: str) -> Path:
    """A job spec on ``model`` and ``data``; ``sections`` replace or add top-level sections (YAML text)."""
    parts = {
        "name": "mine",
        "model": f"{{path: {model}}}",
        "lora": "{rank: 4}",
        "data": f"{{path: {data}}}",
        "reward": "{name: arith}",
        "algo": "{steps: 2, group_size: 2, prompts_per_step: 2}",
        **sections,
    }
    path = directory / "job.yaml"
    path.write_text("".join(f"{key}: {value}\n" for key, value in parts.items()))
    return path


def jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def good_rows(n: int) -> list[dict]:
    return [{"prompt": f"{i % 9}+{i % 7}=", "answer": str(i % 9 + i % 7)} for i in range(n)]


def model_copy(tiny_model: Path, tmp_path: Path, *missing: str) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    for name in missing:
        (model / name).unlink()
    return model


# ---------------------------------------------------------------- validate / submit, no cluster


@pytest.mark.parametrize(
    "missing, phrase", [(TOKENIZER_FILES, "no tokenizer in"), (("model.safetensors",), "no weights in")]
)
def test_validate_and_submit_refuse_a_model_directory_the_engines_cannot_load(
    tiny_model: Path, tmp_path: Path, missing: tuple[str, ...], phrase: str
) -> None:
    model = model_copy(tiny_model, tmp_path, *missing)
    spec = spec_file(tmp_path, model, jsonl(tmp_path / "d.jsonl", good_rows(4)))
    line = one_error(plexctl("validate", str(spec)), ExitCode.USAGE)
    assert line.startswith(f"{spec}:2: model.path: {phrase} {model}"), line
    line = one_error(plexctl("--state-dir", str(tmp_path / "none"), "submit", str(spec)), ExitCode.USAGE)
    assert "model.path" in line and phrase in line  # before any daemon is asked


def test_every_data_record_is_checked_and_each_bad_one_named_by_its_line(tiny_model: Path, tmp_path: Path) -> None:
    rows: list[object] = good_rows(60)
    rows[36] = {"prompt": 37, "answer": "1"}  # line 37
    rows[44] = {"prompt": ["a"], "answer": "1"}  # line 45
    rows[50] = {"question": "1+1=", "answer": "2"}  # line 51
    data = jsonl(tmp_path / "d.jsonl", rows)
    spec = spec_file(tmp_path, tiny_model, data)
    proc = plexctl("validate", str(spec))
    assert proc.returncode == ExitCode.USAGE
    assert proc.stderr.strip().splitlines() == [
        f"{spec}:4: data.path: {data}: record 37 (line 37): `prompt` must be a string, got an integer (37)",
        f'{spec}:4: data.path: {data}: record 45 (line 45): `prompt` must be a string, got a list (["a"])',
        f"{spec}:4: data.path: {data}: record 51 (line 51): missing field `prompt` (fields present: `question`, "
        "`answer`)",
    ]
    proc = plexctl("--state-dir", str(tmp_path / "none"), "submit", str(spec))
    assert proc.returncode == ExitCode.USAGE and "record 37 (line 37)" in proc.stderr


def test_a_scan_holds_one_record_at_a_time(tmp_path: Path) -> None:
    data = tmp_path / "big.jsonl"
    with open(data, "w") as f:
        for i in range(60_000):
            f.write(json.dumps({"prompt": f"{i}+{i}=" * 4, "answer": str(2 * i)}) + "\n")
        f.write('{"prompt": null, "answer": "0"}\n')
    counted = []
    tracemalloc.start()
    try:
        scan = scan_records(data, "prompt", "answer", on_prompts=lambda chunk: counted.append(len(chunk)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (scan.records, scan.bad, sum(counted)) == (60_001, 1, 60_000)
    assert str(scan.problems[0]).endswith("record 60001 (line 60001): `prompt` must be a string, got null")
    assert peak < 1 << 20, peak  # the file is 2.6 MB


def test_max_tokens_and_the_longest_prompt_must_fit_the_models_context(tiny_model: Path, tmp_path: Path) -> None:
    rows = good_rows(20)
    rows[11] = {"prompt": "1+2+3+4+5+6+7+8=", "answer": "36"}  # 17 tokens with <bos>
    spec = spec_file(tmp_path, tiny_model, jsonl(tmp_path / "d.jsonl", rows), sampling="{max_tokens: 47}")
    assert plexctl("validate", str(spec)).returncode == 0  # 47 + 17 = 64: the tiny model's whole context
    spec = spec_file(tmp_path, tiny_model, jsonl(tmp_path / "d.jsonl", rows), sampling="{max_tokens: 50}")
    line = one_error(plexctl("validate", str(spec)), ExitCode.USAGE)
    assert line == (
        f"{spec}:7: sampling.max_tokens: 50 and the longest prompt (17 tokens, d.jsonl line 12) "
        "exceed the context of tiny-arith, 64 tokens (max_position_embeddings in config.json)"
    )
    line = one_error(plexctl("validate", str(spec), "--set", "sampling.max_tokens=64"), ExitCode.USAGE)
    assert line.startswith("--set: sampling.max_tokens: 64 "), line


def test_the_daemon_refuses_max_tokens_its_rollout_engines_cannot_hold(core, tiny_model: Path) -> None:
    """What a client that skips the CLI, or a cluster started with `up --max-model-len`, meets."""
    engines = [
        P.EngineDecl("w0/rollout", "rollout", str(tiny_model), 4, max_model_len=32),
        P.EngineDecl("w0/trainer", "trainer", str(tiny_model)),
    ]
    core.send(b"w0", P.Op.REGISTER, P.RegisterReq("w0", "node", 1, engines, True))
    spec = spec_to_wire(load_spec(TINY, [f"model.path={tiny_model}", "sampling.max_tokens=32"]))
    core.send(b"cli", P.Op.SUBMIT, P.SubmitReq("s1", spec, current_user()), msg_id=2, user=current_user())
    (error,) = [body for _, op, body in core.sent if op == P.Op.ERROR]
    assert RemoteError(error.code, error.message).exit_code == ExitCode.REFUSED
    assert error.message.startswith("sampling.max_tokens 32: the rollout engines of ")
    assert "hold sequences of 32 tokens, prompt included (`plexctl up --max-model-len`)" in error.message
    assert core.journal.jobs() == []


# ---------------------------------------------------------------- up


def processes_of(marker: str) -> list[str]:
    """Command lines of the processes that name ``marker`` (a cluster's state directory)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline:
                found.append(f"{proc.name}: {cmdline}")
    return found


def test_up_on_a_model_without_a_tokenizer_fails_at_once_with_exit_11(tiny_model: Path, tmp_path: Path) -> None:
    model = model_copy(tiny_model, tmp_path, *TOKENIZER_FILES)
    home = tmp_path / "home"
    line = one_error(plexctl("up", "--local", "--model", str(model), home=home), ExitCode.START_FAILED)
    assert line.startswith(f"error: --model: no tokenizer in {model}"), line
    assert processes_of(str(home)) == []


@pytest.mark.slow
def test_up_whose_engines_fail_stops_every_process_it_started(tiny_model: Path, tmp_path: Path) -> None:
    model = model_copy(tiny_model, tmp_path)
    (model / "tokenizer.json").write_text("{not json")  # there, but the engines cannot load it
    home = tmp_path / "home"
    line = one_error(plexctl("up", "--local", "--model", str(model), home=home, timeout=600), ExitCode.START_FAILED)
    assert line.startswith("error: cluster failed to start, stopped: worker w"), line
    assert processes_of(str(home)) == []  # the daemon, both workers, their engines
    status = plexctl("status", home=home)
    assert status.returncode == ExitCode.UNREACHABLE, status.stderr


# ---------------------------------------------------------------- job names


@pytest.fixture(scope="module")
def bare(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    c = BareCluster(tmp_path_factory.mktemp("names"), tiny_model)
    yield c
    c.daemon.stop()


def test_a_name_a_queued_job_holds_is_refused_unless_replace(bare: BareCluster) -> None:
    first = bare.run("submit", str(TINY), "--name", "held", "-q")
    assert first.returncode == 0, first.stderr
    first_id = first.stdout.decode().strip()
    again = bare.run("submit", str(TINY), "--name", "held")
    assert again.returncode == ExitCode.USAGE
    assert again.stderr.decode().strip() == (
        f"error: name: your job {first_id} (queued) is named 'held'; cancel it, "
        "choose another name (--name), or replace it (`plexctl submit --replace`)"
    )
    replaced = bare.run("submit", str(TINY), "--name", "held", "--replace")
    assert replaced.returncode == 0, replaced.stderr
    out = replaced.stdout.decode().strip()
    assert out.startswith("submitted j") and out.endswith(f"(held), replacing {first_id} (cancelled)"), out
    new_id = out.split()[1]
    jobs = {j.job_id: j for j in bare.client().status().jobs}
    assert jobs[first_id].state == "cancelled" and jobs[new_id].state == "queued"
    assert bare.client().status("held").jobs[0].job_id == new_id
    bare.client().cancel(new_id)
    assert bare.run("submit", str(TINY), "--name", "held", "-q").returncode == 0  # ended jobs hold no name


def test_a_client_that_skips_the_cli_is_held_to_names_and_a_retried_submit_gets_its_job(
    bare: BareCluster, tiny_model: Path
) -> None:
    home = Path(bare.env["PLEXRL_HOME"])
    server = read_endpoint(bare.state_dir).server_key.encode()
    client = Client(bare.daemon.address, keys=auth.user_keys(home, current_user(), server))
    spec = spec_to_wire(load_spec(TINY, [f"model.path={tiny_model}"], "forged", check_files=False))
    first = client.submit(spec, "sid-forged-1")
    assert first.created
    retried = client.submit(spec, "sid-forged-1")  # a lost reply, the same submit again
    assert (retried.job_id, retried.created) == (first.job_id, False)
    with pytest.raises(RemoteError) as refused:
        client.submit(spec, "sid-forged-2")
    assert refused.value.exit_code == ExitCode.USAGE and f"your job {first.job_id} (queued)" in str(refused.value)
    assert [j.job_id for j in client.status().jobs if j.name == "forged"] == [first.job_id]


# ---------------------------------------------------------------- the job's driver


def serve_driver(d: Daemon, job_id: str, timeout: float = 90) -> P.JobInfo:
    """Start the job's real driver and serve it (its messages dispatched here, the replies sent)
    until it exits or asks for a generate; then judge it as the daemon's loop does."""
    d._carry_out(d.core.chores(time.time()))  # admitted: its driver starts
    proc = d.drivers[job_id]
    deadline, exited_at = time.monotonic() + timeout, None
    while time.monotonic() < deadline and not asked_to_generate(d):
        if d.sock.poll(50):
            parts = recv_frames(d.sock, NOBLOCK)
            d.dispatch([p.bytes for p in parts], parts[1].get("User-Id") if len(parts) > 1 else "")
        if proc.poll() is not None:
            exited_at = exited_at or time.monotonic()
            if time.monotonic() - exited_at > 1.0:  # what it sent before exiting has arrived
                break
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    d.reap_drivers(time.time())
    return d.journal.job(job_id)


def asked_to_generate(d: Daemon) -> bool:
    return any(c.method == "generate" for c in d.core.calls.values())


def submit_here(d: Daemon, spec: Path, check_files: bool = True) -> str:
    model = str(load_spec(spec, check_files=False).model.path)
    engines = [P.EngineDecl("w0/rollout", "rollout", model, 4), P.EngineDecl("w0/trainer", "trainer", model)]
    now = time.time()
    d.core.handle(
        b"w0", auth.INTERNAL_USER, P.Op.REGISTER, P.Header(1), P.RegisterReq("w0", "node", 1, engines, True), now
    )
    req = P.SubmitReq("s1", spec_to_wire(load_spec(spec, check_files=check_files)), current_user())
    d.core.handle(b"cli", current_user(), P.Op.SUBMIT, P.Header(2), req, now)
    (job,) = d.journal.jobs()
    return job.job_id


def test_a_custom_loop_that_runs_no_step_fails_the_job_with_that_reason(
    daemon: Daemon, tiny_model: Path, tmp_path: Path
) -> None:
    (tmp_path / "lazy.py").write_text(
        textwrap.dedent("""
        def loop(job):
            job.log("nothing to do")
    """)
    )
    data = jsonl(tmp_path / "d.jsonl", good_rows(4))
    spec = spec_file(tmp_path, tiny_model, data, algo=f"{{loop: 'lazy:loop', path: {tmp_path}, steps: 2}}")
    info = serve_driver(daemon, submit_here(daemon, spec))
    assert info.state == "failed", info
    assert "algo.loop lazy:loop returned without running a training step" in info.error, info.error


def test_a_record_no_check_caught_fails_the_job_naming_its_line_before_any_generate(
    daemon: Daemon, tiny_model: Path, tmp_path: Path
) -> None:
    rows: list[object] = good_rows(5)
    rows[2] = {"prompt": 5, "answer": "5"}
    spec = spec_file(tmp_path, tiny_model, jsonl(tmp_path / "d.jsonl", rows))
    info = serve_driver(daemon, submit_here(daemon, spec, check_files=False))  # a forged submit: no CLI checks
    assert not asked_to_generate(daemon)
    assert info.state == "failed", info
    assert "record 3 (line 3): `prompt` must be a string, got an integer (5)" in info.error, info.error
