"""`pivotrl bench sim --gpus N`: wall seconds of simulated RL steps at N devices.

The config (default tiny-cpu) scaled to N devices: N/8 nodes of 8, training on a quarter of
them, `batch_size` = max(4, N/16) prompts of `group_size` 8 per step, everything else as
configured. The simulator runs the live controller over modeled devices (sim/run.py), so
this measures the controller's own cost per RL step at that scale: the loop, the schedulers
and the planner's decisions, all in this one process. Prints
{"gpus", "steps", "wall_s", "wall_s_per_step", "virtual_s", "planner_rounds", "shifts", ...}.
"""
from __future__ import annotations

import argparse
import json
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, default=1024)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--config", default="configs/tiny-cpu.yaml")
    p.add_argument("--paradigm", default="shiftable")
    p.add_argument("--json", action="store_true", help="(always JSON; kept for symmetry)")
    p.add_argument("overrides", nargs="*", help="dotted overrides after the scaling")


def scaled(gpus: int, steps: int, paradigm: str) -> list[str]:
    if gpus < 8 or gpus % 8:
        raise SystemExit(f"pivotrl bench sim: --gpus must be a multiple of 8, got {gpus}")
    return [f"cluster.nodes={gpus // 8}", "cluster.devices_per_node=8",
            f"roles.train_devices={gpus // 4}", f"rl.batch_size={max(4, gpus // 16)}",
            "rl.group_size=8", f"rl.steps={steps}", f"paradigm.name={paradigm}",
            f"paradigm.initial_rollout_devices={gpus // 2}",
            f"paradigm.initial_reward_devices={gpus // 4}", "cluster.cpu_share=0.0001"]


def main(args: argparse.Namespace) -> int:
    from pivotrl_hpc.config import load_config
    from pivotrl_hpc.sim.run import SimConstants, simulate

    cfg = load_config(args.config, [*scaled(args.gpus, args.steps, args.paradigm),
                                    *args.overrides])
    t0 = time.perf_counter()
    s = simulate(cfg, SimConstants.from_config(cfg))
    wall = time.perf_counter() - t0
    print(json.dumps({"gpus": args.gpus, "paradigm": args.paradigm, "steps": s["steps"],
                      "wall_s": round(wall, 3),
                      "wall_s_per_step": round(wall / max(1, s["steps"]), 3),
                      "virtual_s": round(s["seconds"], 3), "shifts": s["shifts"],
                      "samples_per_step": cfg.rl.batch_size * cfg.rl.group_size,
                      "tokens_per_s": s["tokens_per_s"]}, indent=1))
    return 0
