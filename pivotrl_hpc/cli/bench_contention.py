"""`pivotrl bench soak --contention N`: the tiny job under every paradigm while N CPU
spinners compete, K runs each; one JSON object (issue 47).

Races between processes (a publish and a Reload, an agent and its clients, a forker and its
workers) hide on a quiet machine and show on a busy node; this finds them here first. Each
run is a real `pivotrl run` of `--config` (configs/learn-cpu.yaml: 1 node x 4 capped
devices, so every paradigm runs on one layout) for `--steps` steps, with N processes
spinning on the CPU meanwhile (uncapped, as another tenant's work would be). Reported per
paradigm: runs, failures, each run's seconds, and each failure's first error line; and what
any run left in /dev/shm (its job's GPS files, vLLM's `pivotrl-tp*` files), which must be
nothing. Progress on stderr. `spinners(n)` is what the live tests run their jobs under.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

PARADIGMS = ("colocated", "disaggregated", "rr_colocated", "shiftable")
ERROR = re.compile(r"\b(\w+Error|\w+Exception|Traceback|error|failed|FAILED)\b")
SPIN = "import os\nos.nice(0)\nwhile True:\n    pass\n"


@contextlib.contextmanager
def spinners(n: int) -> Iterator[list[int]]:
    """`n` processes burning a CPU each while the block runs; their pids. Ended (by pid)
    and reaped on the way out, whatever happened."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL)
             for _ in range(n)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def shm_entries() -> set[Path]:
    """pivotrl's entries in /dev/shm: vLLM's TP files and this user's GPS folder."""
    from pivotrl_hpc.gps.shmdir import SHM_DIR

    return set(Path("/dev/shm").glob("pivotrl-tp*")) | set(SHM_DIR.glob("pivotrl-*"))


def first_error(output: str) -> str:
    """The first line that names an error (else the last line): what a failure says."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for line in lines:
        if ERROR.search(line):
            return line[:300]
    return lines[-1][:300] if lines else ""


def run_once(config: Path, paradigm: str, steps: int, trace: Path, overrides: list[str],
             timeout_s: float) -> dict:
    """One `pivotrl run`; its exit, seconds, first error line and what it left in shm."""
    cmd = [sys.executable, "-m", "pivotrl_hpc.cli.main", "run", str(config),
           f"paradigm.name={paradigm}", f"rl.steps={steps}", f"trace.path={trace}",
           "resume=fresh_aside", *overrides]   # an earlier run of the name: to old-<time>/
    before, t0 = shm_entries(), time.monotonic()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout_s, env={**os.environ, "UCX_MODULES": "^ib,rdmacm"})
        rc, output = p.returncode, p.stdout
    except subprocess.TimeoutExpired as e:
        out = e.output.decode(errors="replace") if isinstance(e.output, bytes) else e.output
        rc, output = None, f"timed out after {timeout_s:.0f} s\n{out or ''}"
    seconds = time.monotonic() - t0
    marker = trace.with_suffix(".logs") / "job"
    job = marker.read_text().strip() if marker.is_file() else None
    left = sorted(p.name for p in shm_entries() - before
                  if p.name.startswith("pivotrl-tp") or (job and f"-{job}-" in p.name))
    ok = rc == 0 and not left
    return {"paradigm": paradigm, "ok": ok, "rc": rc, "seconds": round(seconds, 1),
            "left": left, "error": None if rc == 0 else first_error(output)}


def summarize(runs: list[dict], contention: int, config: str, steps: int) -> dict:
    per: dict[str, dict] = {}
    for r in runs:
        p = per.setdefault(r["paradigm"], {"runs": 0, "failures": 0, "seconds": [],
                                           "errors": [], "left": []})
        p["runs"] += 1
        p["failures"] += not r["ok"]
        p["seconds"].append(r["seconds"])
        if r["error"]:
            p["errors"].append(r["error"])
        p["left"] += r["left"]
    return {"contention": contention, "config": config, "steps": steps,
            "runs": len(runs), "failures": sum(not r["ok"] for r in runs),
            "left_in_shm": sorted({x for r in runs for x in r["left"]}), "paradigms": per}


def main(args) -> int:
    root = Path(__file__).resolve().parents[2]
    config = Path(args.config or root / "configs" / "learn-cpu.yaml").resolve()
    models = Path(args.models).resolve()
    paradigms = [p for p in args.paradigms.split(",") if p]
    bad = [p for p in paradigms if p not in PARADIGMS]
    problems = ([f"unknown paradigm(s) {bad} (of {', '.join(PARADIGMS)})"] if bad else []) + \
        ([f"--contention must be >= 0, not {args.contention}"] if args.contention < 0 else []) + \
        ([f"--runs must be >= 1, not {args.runs}"] if args.runs < 1 else []) + \
        ([f"no config {config}"] if not config.is_file() else []) + \
        ([f"no models in {models}: make them with `pivotrl init-models {models}`"]
         if not (models / "policy").is_dir() else [])
    if problems:
        print("pivotrl bench soak --contention: " + "; ".join(problems), file=sys.stderr)
        return 2
    steps = args.steps or 2
    out = Path(args.out).resolve() / "contention"
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    overrides = [f"models.policy.path={models / 'policy'}",
                 f"models.genrm.path={models / 'genrm'}",
                 f"data.train={models / 'data' / 'train.parquet'}",
                 f"data.validation={models / 'data' / 'aime-style.parquet'}", *args.overrides]
    runs: list[dict] = []
    with spinners(args.contention):
        for i in range(args.runs):
            for paradigm in paradigms:
                r = run_once(config, paradigm, steps, out / f"{paradigm}-{i}.h5", overrides,
                             args.timeout)
                runs.append(r)
                print(f"bench soak --contention {args.contention}: {paradigm} run {i + 1}: "
                      f"{'ok' if r['ok'] else 'FAILED'} in {r['seconds']:.0f} s"
                      + (f": {r['error']}" if r["error"] else "")
                      + (f", left {r['left']}" if r["left"] else ""),
                      file=sys.stderr, flush=True)
    result = summarize(runs, args.contention, str(config), steps)
    print(json.dumps(result))
    return 0 if result["failures"] == 0 else 1
