"""`pivotrl reproduce [--out DIR] [--only fig9,...] [--quick]`: the paper's evaluation
regenerated on the simulator, each figure as JSON and PNG beside the paper's values.

Figures 9, 3, 11 and 14 simulate the paper configs (configs/qwen*.yaml) with constants
derived from the H20's datasheet and the models' dimensions (sim/profile.py); Figure 13
computes shift seconds and the GPS Write's replication plan by GPU count; Table 2 times
the planner itself (reproduce/experiments.py says what each one runs). At the paper's
lengths a run takes 20-60 s of wall time and the whole set a few hundred runs: `--jobs`
spreads them over processes, `--quick` cuts the responses to ~1 % of the paper's lengths
(minutes in all). Writes DIR/<figure>.json and .png, DIR/reproduce.json with everything and
the settings, and prints a summary.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

FIGURES = ("fig9", "fig3", "fig11", "fig13", "fig14", "table2")
ROOT = Path(__file__).resolve().parents[2]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="out/reproduce", help="folder for the JSON and PNGs")
    p.add_argument("--only", default=",".join(FIGURES),
                   help=f"comma separated, of {', '.join(FIGURES)}")
    p.add_argument("--quick", action="store_true",
                   help="~1 %% of the paper's lengths, 1 step, 2 seeds, fewer points")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run")
    p.add_argument("--seeds", type=int, default=None, help="seeds per point (mean +- std)")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="simulations at once (processes)")
    p.add_argument("--configs", default=str(ROOT / "configs"),
                   help="folder of the paper configs")
    p.add_argument("--json", action="store_true", help="print reproduce.json, not a summary")


def scale_of(args):
    from dataclasses import replace

    from pivotrl_hpc.reproduce.experiments import QUICK, Scale

    s = QUICK if args.quick else Scale()
    changes = {k: v for k, v in (("steps", args.steps), ("seeds", args.seeds)) if v is not None}
    return replace(s, jobs=max(1, args.jobs), **changes)


def main(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from pivotrl_hpc.reproduce import paper
    from pivotrl_hpc.reproduce.experiments import Lab
    from pivotrl_hpc.reproduce.plots import PLOTS

    only = [f.strip() for f in args.only.split(",") if f.strip()]
    unknown = [f for f in only if f not in FIGURES]
    if unknown:
        print(f"pivotrl reproduce: unknown figure(s) {', '.join(unknown)} "
              f"(known: {', '.join(FIGURES)})", file=sys.stderr)
        return 2
    configs = Path(args.configs)
    absent = [g for g in paper.GROUPS if not (configs / f"{g}.yaml").is_file()]
    if absent:
        print(f"pivotrl reproduce: {configs} lacks {', '.join(g + '.yaml' for g in absent)}",
              file=sys.stderr)
        return 2
    scale = scale_of(args)
    for name in ("pivotrl_hpc.controller", "pivotrl_hpc.sim"):   # one line a run, below
        logging.getLogger(name).setLevel(logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def progress(o, done: int, total: int) -> None:
        r = o.run
        print(f"reproduce: [{done}/{total}] {r.tag} {r.paradigm} seed {r.seed} "
              f"{' '.join(x for x in r.overrides if not x.startswith(('workload.', 'rl.steps')))}"
              f" -> {o.figures['tokens_per_s']:.0f} tokens/s "
              f"({time.monotonic() - t0:.0f} s)", file=sys.stderr)

    lab = Lab(configs, scale, progress)
    results: dict = {}
    for name in FIGURES:   # fig9 first: fig3 and fig11 use its splits and baselines
        if name in only:
            results[name] = getattr(lab, name)()
            (out / f"{name}.json").write_text(json.dumps(results[name], indent=1))
            PLOTS[name](results[name], out / f"{name}.png")
    everything = {"settings": asdict(scale) | {"hardware": "H20 profile (sim/profile.py)"},
                  "wall_s": round(time.monotonic() - t0, 1), **results}
    (out / "reproduce.json").write_text(json.dumps(everything, indent=1))
    print(json.dumps(everything, indent=1) if args.json else summary(results, out))
    return 0


def summary(results: dict, out: Path) -> str:
    lines = [f"pivotrl reproduce: figures in {out}"]
    for g in results.get("fig9", {}).values():
        ours = ", ".join(f"{p} {v:.2f}x (paper {g['paper_speedup_vs'][p]:.2f}x)"
                         for p, v in g["speedup_vs"].items())
        lines.append(f"  Figure 9, {g['title']}: shiftable over {ours}")
    for g in results.get("fig11", {}).values():
        ours = ", ".join(f"{p} {v:.2f}x" for p, v in g["over_disaggregated"].items())
        lines.append(f"  Figure 11, {g['title']} (over disaggregated): {ours}; orders as "
                     f"the paper: strategies {g['strategy_order_as_paper']}, components "
                     f"{g['component_order_as_paper']}")
    if "fig3" in results:
        lines.append("  Figure 3 (fraction below 20 % of peak): " + "; ".join(
            f"{p} " + " ".join(f"{r} {'-' if v is None else f'{v:.2f}'}" for r, v in f.items())
            for p, f in results["fig3"]["fraction_below_low"].items()))
    if "fig14" in results:
        lines.append("  Figure 14 (H: tokens/s, shifts/step): " + ", ".join(
            f"{p['H']:g}: {p['tokens_per_s']:.0f}, {p['shifts_per_step']:.1f}"
            for p in results["fig14"]["points"]))
    if "fig13" in results:
        lines.append("  Figure 13 (GPUs: rollout up s, Write replication s): " + ", ".join(
            f"{r['gpus']}: {r['rollout'][0]:.2f}, {r['write_replication_s']:.2f}"
            for r in results["fig13"]["rows"]))
    if "table2" in results:
        lines.append("  Table 2 (GPUs: planner s): " + ", ".join(
            f"{r['gpus']}: {r['total_s']:.3f}" for r in results["table2"]["rows"]))
    return "\n".join(lines)
