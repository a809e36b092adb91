"""`pivotrl bench shift --json`: shift up / shift down seconds per role, with phases.

One device worker (its GPS node agent in a thread) moves rollout -> reward -> training,
`--repeat` times, its engines in engine hosts as in a job (`--in-process`: in the worker,
one at a time, so rollout <-> reward closes one engine and builds the other). The first
cycle, which builds engines and imports code (preserved context afterwards), is reported
apart from the median warm cycle (its phases add up to its total).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROLES = ("rollout", "reward", "training")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="tiny,100m", help="model sets: tiny, 100m (comma list)")
    p.add_argument("--repeat", type=int, default=3, help="warm cycles per role")
    p.add_argument("--models-dir", type=Path, default=None,
                   help="reuse models made by `pivotrl init-models --with-100m`")
    p.add_argument("--json", action="store_true", help="print one JSON object (default)")
    p.add_argument("--in-process", action="store_true",
                   help="inference engines in the worker process, not in engine hosts")


def _models(size: str, base: Path) -> dict[str, str]:
    from pivotrl_hpc.assets.models import SPECS, create_model

    names = {"tiny": {"policy": "policy", "genrm": "genrm"},
             "100m": {"policy": "policy-100m", "genrm": "policy-100m"}}[size]
    for spec_name in set(names.values()):
        if not (base / spec_name / "config.json").is_file():
            create_model(base / spec_name, SPECS[spec_name])
    return {model: str(base / spec_name) for model, spec_name in names.items()}


def _median_phases(runs: list[dict[str, float]]) -> dict[str, float]:
    """The phases of the median warm cycle (by total, the lower one of an even count). Not
    per-phase medians: those do not add up to their total."""
    run = sorted(runs, key=lambda r: r["total"])[(len(runs) - 1) // 2]
    return {k: round(v, 4) for k, v in sorted(run.items())}


def bench_size(size: str, base: Path, repeat: int, engine_process: bool = True) -> dict:
    from pivotrl_hpc.engines.megatron.trainer import TrainerConfig
    from pivotrl_hpc.protocol.engine import EngineOptions
    from pivotrl_hpc.runtime.local import local_worker
    from pivotrl_hpc.protocol.messages import RoleKind, ShiftDown, ShiftUp
    from pivotrl_hpc.runtime.worker import WorkerSpec

    dirs = _models(size, base)
    if engine_process:  # no vLLM world in this process for the trainer to join: its own
        from pivotrl_hpc.engines.megatron.parallel import single_process_world
        single_process_world()
    opts = EngineOptions(max_model_len=256, kv_cache_memory_bytes=64 * 2**20)
    spec = WorkerSpec(model_dirs=dirs, engine_options={"policy": opts, "genrm": opts},
                      trainer_config=TrainerConfig(), engine_process=engine_process)
    runs: dict[str, dict[str, list]] = {r: {"up": [], "down": []} for r in ROLES}
    with local_worker(spec, job=f"bench{size}") as worker:
        for cycle in range(repeat + 1):
            for role in ROLES:
                up = worker.handle(ShiftUp(RoleKind(role)))
                down = worker.handle(ShiftDown())
                for r in (up, down):
                    if not r.ok:
                        raise RuntimeError(f"{role} {r.command}: {r.error}")
                runs[role]["up"].append(up.phases)
                runs[role]["down"].append(down.phases)
            print(f"bench shift [{size}] cycle {cycle + 1}/{repeat + 1} done", file=sys.stderr)
    out = {}
    for role, r in runs.items():
        warm_up, warm_down = r["up"][1:], r["down"][1:]
        out[role] = {"shift_up_s": _median_phases(warm_up)["total"],
                     "shift_down_s": _median_phases(warm_down)["total"],
                     "first_shift_up_s": round(r["up"][0]["total"], 4),
                     "up_phases": _median_phases(warm_up),
                     "down_phases": _median_phases(warm_down)}
    return out


def main(args: argparse.Namespace) -> int:
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in ("tiny", "100m")]
    if bad or args.repeat < 1:
        print(f"pivotrl bench shift: sizes must be tiny and/or 100m (got {bad}) and "
              f"--repeat >= 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pivotrl-bench-") as tmp:
        base = args.models_dir or Path(tmp)
        hosts = not args.in_process
        result = {"repeat": args.repeat, "device": "cpu", "engine_process": hosts,
                  "sizes": {s: bench_size(s, base, args.repeat, hosts)
                            for s in sizes}}
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0
