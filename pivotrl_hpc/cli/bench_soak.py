"""`pivotrl bench soak --steps 200`: a long tiny job, watched for leaks; one JSON object.

Runs a real `pivotrl run` and, once the trace shows step `--early` (20) and again at the last
step, samples every rank and its engine hosts: RSS (VmRSS), open file descriptors, and the
job's bytes in /dev/shm (its GPS folder files, by allocated blocks); each the least of five
readings a second apart, as a reading taken inside a shift sees a half-built engine. Prints,
per process and in total, both samples and the ratio late / early, and `within` (every
ratio <= 1 + the tolerance, 5 %). Progress on stderr.

`--contention N` is another soak: the tiny job under every paradigm, `--runs` times each,
while N CPU spinners compete (`bench_contention`: races show under load).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None,
                   help="configs/tiny-cpu.yaml (with --contention: configs/learn-cpu.yaml)")
    p.add_argument("--steps", type=int, default=None, help="200 (with --contention: 2)")
    p.add_argument("--early", type=int, default=20, help="the step of the first sample")
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--out", default=".run/bench-soak", help="trace and logs of the run")
    p.add_argument("--contention", type=int, default=None, metavar="N",
                   help="instead: each paradigm's tiny job --runs times beside N CPU spinners")
    p.add_argument("--runs", type=int, default=10, help="with --contention: runs per paradigm")
    p.add_argument("--paradigms", default="colocated,disaggregated,rr_colocated,shiftable",
                   help="with --contention: comma-separated")
    p.add_argument("--models", default=".run/models",
                   help="with --contention: the folder of `pivotrl init-models`")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="with --contention: seconds a run may take")
    p.add_argument("overrides", nargs="*", help="dotted overrides")


def _children(pid: int) -> list[int]:
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [int(k) for k in kids]


def _proc(pid: int) -> dict[str, int] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    rss = [int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")]
    return {"rss_kb": rss[0], "fds": fds} if rss else None   # none: a zombie


def sample(logs: Path, job: str, times: int = 5) -> dict:
    """The least of `times` readings a second apart (a shift in progress holds an engine's
    build for a moment: a reading inside one is not what stays)."""
    got = []
    for i in range(times):
        if i:
            time.sleep(1.0)
        got.append(_sample_once(logs, job))
    procs = {}
    for name in got[0]["procs"]:
        seen = [g["procs"][name] for g in got if name in g["procs"]]
        procs[name] = {k: min(s[k] for s in seen) for k in seen[0]}
    return {"procs": procs, "shm_bytes": min(g["shm_bytes"] for g in got)}


def _sample_once(logs: Path, job: str) -> dict:
    """RSS and fds of every rank (rank-N.pid) and its engine hosts; the job's shm bytes."""
    from pivotrl_hpc.gps.shmdir import job_files

    procs = {}
    for f in sorted(logs.glob("rank-*.pid")):
        pid = int(f.read_text().split()[0])
        rank = f.name.removesuffix(".pid")
        for i, p in enumerate([pid, *_children(pid)]):
            got = _proc(p)
            if got is not None:
                procs[rank if i == 0 else f"{rank}.host{i}"] = got
    shm = sum(p.stat().st_blocks * 512 for p in job_files(job) if p.exists())
    return {"procs": procs, "shm_bytes": shm}


def steps_done(trace: Path) -> int:
    from pivotrl_hpc.trace import open_trace

    try:
        with open_trace(str(trace)) as t:
            return t.rows("steps")
    except (OSError, KeyError):
        return 0


def compare(early: dict, late: dict, tolerance: float) -> dict:
    ratios = {}
    for name, a in early["procs"].items():
        b = late["procs"].get(name)
        if b is not None:
            ratios[name] = {k: round(b[k] / a[k], 4) if a[k] else None for k in a}
    shm = late["shm_bytes"] / early["shm_bytes"] if early["shm_bytes"] else None
    worst = max([v for r in ratios.values() for v in r.values() if v is not None]
                + ([shm] if shm is not None else []), default=1.0)
    return {"ratios": ratios, "shm_ratio": shm, "worst_ratio": worst,
            "within": worst <= 1 + tolerance}


def main(args: argparse.Namespace) -> int:
    if args.contention is not None:
        from pivotrl_hpc.cli.bench_contention import main as contention
        return contention(args)
    args.config = args.config or "configs/tiny-cpu.yaml"
    args.steps = args.steps or 200
    if not 0 < args.early < args.steps:
        print("pivotrl bench soak: need 0 < --early < --steps", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    trace = out / "soak.h5"
    cmd = [sys.executable, "-m", "pivotrl_hpc.cli.main", "run", args.config,
           f"rl.steps={args.steps}", f"trace.path={trace}", "resume=fresh_aside", *args.overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    logs, samples, t0 = trace.with_suffix(".logs"), {}, time.monotonic()
    job = None
    while proc.poll() is None and len(samples) < 2:
        done = steps_done(trace)
        job = job or _job_of(logs)
        # late: a few steps before the end, so that the five readings end before the job does
        for name, at in (("early", args.early), ("late", max(args.early + 1, args.steps - 3))):
            if name not in samples and done >= at and job:
                samples[name] = {"step": done, "t": time.monotonic() - t0, **sample(logs, job)}
                print(f"bench soak: sampled at step {done}", file=sys.stderr, flush=True)
        time.sleep(1.0)
    err = proc.communicate()[1]
    if proc.returncode != 0 or len(samples) < 2:
        print(f"pivotrl bench soak: the run failed (exit {proc.returncode}): "
              f"{' | '.join(err.splitlines()[-3:])}", file=sys.stderr)
        return 1
    result = {"steps": args.steps, "early": samples["early"], "late": samples["late"],
              **compare(samples["early"], samples["late"], args.tolerance),
              "tolerance": args.tolerance, "trace": str(trace)}
    print(json.dumps(result))
    return 0


def _job_of(logs: Path) -> str | None:
    marker = logs / "job"
    return marker.read_text().strip() if marker.is_file() else None
