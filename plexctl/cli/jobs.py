"""`plexctl status`, `top`, `report`, `ls`, `logs`, `export`, `cancel`, `wait`: what jobs do, and ending them."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from plexctl.cli.context import TERMINAL, WAIT_EXIT, Ctx, console
from plexctl.common.errors import PlexError, Timeout, UsageError

if TYPE_CHECKING:
    from plexctl.common.client import Client
    from plexctl.common.protocol import JobInfo


def status(
    ctx: typer.Context,
    job: Annotated[Optional[str], typer.Argument(help="job id or name (default: all)")] = None,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="live view until interrupted")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JSON output")] = False,
    interval: Annotated[float, typer.Option(min=0.1, help="refresh seconds with --watch")] = 1.0,
) -> None:
    """Jobs (state, step, reward, policy version, engine) and engines."""
    import msgspec

    from plexctl.cli import views
    from plexctl.cli.start_stop import ping_or_none, slurm_note
    from plexctl.common.cluster import front_end_state, tinker_state
    from plexctl.common.errors import DaemonUnreachable
    from plexctl.common.slurm import SLURM_FILE, allocation_line, allocation_rows, read_allocations

    c: Ctx = ctx.obj
    try:
        slurm = (c.state_dir / SLURM_FILE).exists()
    except PermissionError:  # a directory on the way others may not pass: `c.client()` says which
        slurm = False

    def slurm_says() -> bool:
        """What Slurm says of the allocation, shown where its daemon does not answer."""
        note = slurm_note(c.state_dir) if slurm else None
        if note is not None:
            print(json.dumps({"jobs": [], "engines": [], "slurm": note}, indent=2) if as_json else note, flush=True)
        return note is not None

    if slurm and ping_or_none(c.state_dir) is None and slurm_says():
        return
    # a Slurm cluster's daemon may stop at any time (a requeue): then Slurm is asked at once
    client = c.client(timeout=3.0, retries=0) if slurm else c.client()
    if watch and not as_json and console().is_terminal:
        live(c, client, job, interval, until_done=False)
        return
    while True:
        try:
            rep = client.status(job)
        except DaemonUnreachable:
            if not slurm_says():
                raise
            if not watch:
                return
            time.sleep(interval)
            continue
        tinker, tinker_note = tinker_state(c.state_dir)
        openai = front_end_state(c.state_dir, "openai")
        allocations = allocation_rows(read_allocations(c.state_dir), time.time()) if slurm else []
        if as_json:
            print(
                json.dumps(
                    {
                        "jobs": [views.job_row(j, rep.now) for j in rep.jobs],
                        "engines": msgspec.to_builtins(rep.engines),
                        **({"tinker_url": tinker} if tinker else {}),
                        **({"tinker_note": tinker_note} if tinker_note else {}),
                        **({"openai_url": openai[0]} if openai[0] else {}),
                        **({"openai_note": openai[1]} if openai[1] else {}),
                        **({"allocations": allocations} if allocations else {}),
                    },
                    indent=2,
                )
            )
        elif console().is_terminal:
            console().print(views.status_view(rep, c.uptime(), tinker, tinker_note, openai))
            for row in allocations:
                console().print(allocation_line(row), markup=False, highlight=False)
        else:
            print(views.plain_status(rep, c.uptime(), tinker, tinker_note, openai), flush=True)
            for row in allocations:
                print(allocation_line(row), flush=True)
        if not watch:
            return
        time.sleep(interval)


def live(
    c: Ctx, client: Client, job: str | None, interval: float, until_done: bool, job_ids: list[str] | None = None
) -> list[JobInfo]:
    """The status view, redrawn every ``interval`` seconds (until ``job_ids`` all end, with ``until_done``)."""
    import msgspec
    from rich.live import Live

    from plexctl.cli import views
    from plexctl.common.cluster import tinker_url

    with Live(console=console(), refresh_per_second=4) as live:
        while True:
            rep = client.status(job)
            jobs = [j for j in rep.jobs if job_ids is None or j.job_id in job_ids]
            view = views.status_view(msgspec.structs.replace(rep, jobs=jobs), c.uptime(), tinker_url(c.state_dir))
            live.update(view)
            if until_done and all(j.state in TERMINAL for j in jobs):
                return jobs
            time.sleep(interval)


def top(
    ctx: typer.Context,
    job: Annotated[Optional[str], typer.Argument(help="job id or name (default: all)")] = None,
    interval: Annotated[
        Optional[float],
        typer.Option(min=0.1, help="refresh seconds (live view: default 2; plain text: one frame unless given)"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON frame")] = False,
) -> None:
    """Live view: jobs (progress, ETA, reward sparkline, staleness) and engines (utilization, swaps, tiers)."""
    from rich.live import Live

    from plexctl.cli import top as T

    c: Ctx = ctx.obj
    feed = T.Top(c.client(), job, uptime_fallback=c.uptime())
    if as_json:
        print(json.dumps(T.top_json(feed.frame()), indent=2))
    elif console().is_terminal:
        with Live(console=console(), refresh_per_second=4, screen=False) as live:
            while True:
                live.update(T.top_view(feed.frame()))
                time.sleep(interval or 2.0)
    else:
        T.watch_plain(feed, interval)


def report(
    ctx: typer.Context,
    job: Annotated[Optional[str], typer.Argument(help="job id or name")] = None,
    vs: Annotated[Optional[str], typer.Option("--vs", help="a second job, overlaid")] = None,
    cluster: Annotated[bool, typer.Option("--cluster", help="the engine timeline")] = False,
    out: Annotated[Path, typer.Option(help="directory for the PNG files")] = Path("plexrl-report"),
    last: Annotated[Optional[float], typer.Option(min=0, help="--cluster: only the last SECONDS")] = None,
) -> None:
    """PNG plots: a job's reward and loss curves (--vs: two jobs overlaid), or the engine timeline (--cluster)."""
    from plexctl.cli import report as R

    if job is None and not cluster:
        raise UsageError("give a JOB (and --vs OTHER) or --cluster")
    R.pyplot()  # a missing matplotlib fails here, before any request
    client = ctx.obj.client()
    paths = []
    if job is not None:
        runs, ids = {}, []
        for ref in [job] + ([vs] if vs else []):
            info = client.status(ref).jobs[0]
            text, offset = "", 0
            while True:
                rep = client.logs(info.job_id, "metrics", offset)
                text, offset = text + rep.data, rep.offset
                if not rep.data:
                    break
            runs[f"{info.job_id} {info.name}"] = R.parse_metrics(text)
            ids.append(info.job_id)
        paths += R.job_plots(runs, out, "-vs-".join(ids))
    if cluster:
        paths.append(R.cluster_timeline(client.status(timeline=True), out / "cluster-timeline.png", last))
    for path in paths:
        print(path)


def ls(
    ctx: typer.Context,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="job ids only")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JSON output")] = False,
    state: Annotated[Optional[str], typer.Option(help="only jobs in this state")] = None,
) -> None:
    """List jobs."""
    from plexctl.cli import views
    from plexctl.common.protocol import JOB_STATES

    if state is not None and state not in JOB_STATES:
        raise UsageError(f"--state {state!r}: choose one of {', '.join(JOB_STATES)}")
    rep = ctx.obj.client().status()
    jobs = [j for j in rep.jobs if state is None or j.state == state]
    if quiet:
        for j in jobs:
            print(j.job_id)
    elif as_json:
        print(json.dumps([views.job_row(j, rep.now) for j in jobs], indent=2))
    elif console().is_terminal:
        console().print(views.jobs_table(jobs, rep.now))
    else:
        print(views.plain_jobs(jobs, rep.now))


def logs(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="job id or name")],
    metrics: Annotated[bool, typer.Option("--metrics", help="the metrics JSONL instead of the log")] = False,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing until the job ends")] = False,
) -> None:
    """A job's driver log (or its metrics), all of it; with -f, then what follows until the job ends."""
    client = ctx.obj.client()
    job_id = client.status(job).jobs[0].job_id  # a name may pass to a newer job (`submit --replace`) meanwhile
    offset = 0
    while True:  # each reply: a chunk from the offset asked, ending on a whole line where the file goes on
        rep = client.logs(job_id, "metrics" if metrics else "log", offset)
        sys.stdout.write(rep.data)
        sys.stdout.flush()
        offset = rep.offset
        if rep.finished or (not rep.data and not follow):
            return
        if not rep.data:
            time.sleep(0.5)


def export(
    ctx: typer.Context,
    job: Annotated[str, typer.Argument(help="job id or name")],
    checkpoint: Annotated[
        bool,
        typer.Option(
            "--checkpoint", help="the latest checkpoint (adapter, optimizer, data cursor) instead of the latest adapter"
        ),
    ] = False,
    to: Annotated[Path, typer.Option("--to", help="directory to write it in (default: here)")] = Path("."),
) -> None:
    """Copy a job's latest adapter (or checkpoint) out of the cluster, through the daemon, into a
    directory of yours: written with your rights, never read from the owner's files by you."""
    from plexctl.common.sizes import fmt_bytes

    client = ctx.obj.client()
    what = "checkpoint" if checkpoint else "adapter"
    job_id = client.status(job).jobs[0].job_id
    listing = client.export(job_id, what)
    dest = to / f"{job_id}-{listing.source.replace(' ', '-')}"
    if dest.exists():
        raise UsageError(f"{dest} exists; remove it or choose another --to")
    to.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=to))
    try:
        for f in listing.files:
            target = tmp / f.path
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as out:
                while out.tell() < f.size:
                    chunk = client.export(job_id, what, f.path, out.tell()).data
                    if not chunk:
                        break
                    out.write(chunk)
            if target.stat().st_size != f.size:
                raise PlexError(f"{f.path}: got {target.stat().st_size} of {f.size} bytes (it changed on the cluster?)")
        _verify_manifest(tmp)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    console().print(
        f"{listing.source} of {job_id}: {len(listing.files)} files, "
        f"{fmt_bytes(sum(f.size for f in listing.files))} -> {dest}"
    )


def _verify_manifest(directory: Path) -> None:
    """A checkpoint's files against the sha256 its manifest records (an adapter has none)."""
    manifest = directory / "manifest.json"
    if not manifest.exists():
        return
    for name, record in json.loads(manifest.read_text()).get("files", {}).items():
        digest = hashlib.sha256((directory / name).read_bytes()).hexdigest()
        if digest != record.get("sha256"):
            raise PlexError(f"{name}: does not match the checkpoint's sha256 (corrupt copy)")


def cancel(ctx: typer.Context, jobs: Annotated[list[str], typer.Argument(help="job ids or names")]) -> None:
    """Cancel jobs: each stops at its next call boundary and keeps its last checkpoint."""
    client = ctx.obj.client()
    for job in jobs:
        info = client.cancel(job)
        console().print(f"{info.job_id}: {'cancelling' if info.state == 'running' else info.state}")


def wait(
    ctx: typer.Context,
    jobs: Annotated[list[str], typer.Argument(help="job ids or names")],
    timeout: Annotated[Optional[float], typer.Option(help="give up after this many seconds")] = None,
) -> None:
    """Wait until jobs end; the exit code says how (0 succeeded, 1 failed, 5 cancelled, 8 interrupted:
    stopped with the cluster, they resume at the next `up`)."""
    client = ctx.obj.client()
    deadline = None if timeout is None else time.monotonic() + timeout
    final: dict[str, JobInfo] = {}
    while len(final) < len(jobs):
        for job in jobs:
            if job in final:
                continue
            info = client.status(job).jobs[0]
            if info.state in TERMINAL:
                final[job] = info
        if len(final) < len(jobs):
            if deadline is not None and time.monotonic() > deadline:
                raise Timeout(f"still running after {timeout:.0f} s: {', '.join(j for j in jobs if j not in final)}")
            time.sleep(0.5)
    for info in final.values():
        console().print(f"{info.job_id}: {info.state}" + (f" ({info.error})" if info.error else ""))
    code = max(WAIT_EXIT[i.state] for i in final.values())
    if code:
        raise typer.Exit(code)
