"""`pivotrl simulate CONFIG [--paradigms all] [--json]`: the job of CONFIG under each paradigm
on modeled devices and virtual time (pivotrl_hpc/sim/run.py), side by side, in seconds of
wall time instead of minutes.

The same controller as a live run decides; only the devices are modeled. Costs come from the
GPU's datasheet and the models' dimensions (`--hardware h20`, the default for a GPU config:
sim/profile.py), from the config (throughput constants, tau_shift, `--train-seconds`; the
default for a CPU config) or, with `--from-trace`, from what a live run measured.
`all`: the paper's four and rr_colocated_pooled (rr_colocated's stronger variant, beside it).
Every paradigm but colocated gets its best training width (and disaggregated
its rollout/reward split) from the same search as `pivotrl bench e2e` (`--no-search`: the
config's); a paper group runs its config's (Table 4's) splits for `sim/measure.RUN_STEPS`
steps (an `rl.steps=` override wins), as `pivotrl reproduce` and its calibration do.
Prints one JSON object shaped like bench e2e's:
{"<paradigm>": {"processed_tokens_per_s" (Figure 9's protocol, sim/measure.py: generated
 tokens over the steady window), "window", "tokens_per_s" (trained tokens over the run),
 "seconds", "shifts", "idle_fraction", "split"}, "speedup_vs" (over
 processed_tokens_per_s), "trained_speedup_vs", "paper_speedup_vs" (a paper group's),
 "constants": {...}}; `--out DIR` keeps every run's trace. A profile's constants are derived
per run, from that run's training width (colocated: every device); "constants" shows the
base config's.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pivotrl_hpc.cli.bench_e2e import PARADIGMS, candidates, speedups, unsearched

SHOWN = ("processed_tokens_per_s", "tokens_per_s", "steady_tokens_per_s", "seconds",
         "shifts", "idle_fraction", "shifts_by_kind", "max_lag", "staleness_held_s",
         "train_step_s", "train_s_per_token", "window")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config")
    p.add_argument("--paradigms", default="all",
                   help="comma separated, or all (bench e2e's PARADIGMS: the paper's four "
                        "and rr_colocated_pooled)")
    p.add_argument("--from-trace", default=None,
                   help="take shift, training and throughput constants from a live trace")
    p.add_argument("--train-seconds", type=float, default=1.0,
                   help="seconds of one training step (with --hardware config)")
    p.add_argument("--hardware", default=None, choices=("h20", "config"),
                   help="derive the constants from this GPU's datasheet and the models' "
                        "dimensions (sim/profile.py; default for device_kind gpu: h20), "
                        "scaled by the config's calibration section when it has one (the "
                        "paper configs include configs/calibration/<group>.yaml), or take "
                        "them from the config (default for cpu)")
    p.add_argument("--out", default=None, help="write each run's trace here")
    p.add_argument("--no-search", action="store_true",
                   help="the config's training width (disaggregated: the middle "
                        "rollout/reward split of its pool), one run a paradigm")
    p.add_argument("--json", action="store_true", help="(always JSON; kept for symmetry)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, as for pivotrl run")


def _load(args, overrides: list[str]):
    """The config as the simulator runs it: no weights needed, absent model folders and data
    stood in for (sim/standin.py) under the run's scratch folder."""
    from pivotrl_hpc.config import load_config
    from pivotrl_hpc.launch.preflight import check_kv_capacity
    from pivotrl_hpc.sim.standin import stand_in

    cfg, notes = stand_in(load_config(args.config, overrides, check_files=False), args.scratch)
    check_kv_capacity(cfg)
    return cfg, notes


def _one(args, paradigm: str, extra: list[str], tag: str) -> dict:
    from pivotrl_hpc.sim.measure import processed_tokens_per_s, window
    from pivotrl_hpc.sim.run import simulate

    cfg, _ = _load(args, [*args.overrides, f"paradigm.name={paradigm}", *extra])
    trace = Path(args.out) / f"{paradigm}-{tag}.h5" if args.out else None
    t0 = time.monotonic()
    # each run's own constants: a profile's training seconds and shifts follow the run's
    # training width (colocated: every device), not the base config's
    s = simulate(cfg, _constants(args, cfg), trace)
    # Figure 9's protocol, as `pivotrl reproduce` measures (sim/measure.py)
    w = window(s.get("step_marks") or [])
    s["processed_tokens_per_s"] = processed_tokens_per_s(s)
    s["window"] = w.to_dict() if w is not None else None
    print(f"simulate: {paradigm} {' '.join(extra)} -> {s['tokens_per_s']:.2f} tokens/s "
          f"({time.monotonic() - t0:.1f} s wall)", file=sys.stderr)
    return s


def _constants(args, cfg):
    from pivotrl_hpc.sim.profile import HARDWARE, calibrated
    from pivotrl_hpc.sim.run import SimConstants

    if args.from_trace:
        return SimConstants.from_trace(args.from_trace, cfg)
    hardware = args.hardware or ("h20" if cfg.cluster.device_kind == "gpu" else "config")
    if hardware == "config":
        return SimConstants.from_config(cfg, args.train_seconds)
    # the same constants `pivotrl reproduce` runs (reproduce/runs.py): a paper config's
    # calibration scales the datasheet's (an empty calibration changes nothing)
    return calibrated(SimConstants.from_profile(cfg, HARDWARE[hardware]), cfg.calibration)


def paper_speedups(config: str) -> dict[str, float] | None:
    """Figure 9's shiftable-over-baseline ratios if `config` is one of the paper groups."""
    from pivotrl_hpc.reproduce.paper import PAPER_SHIFT_RATIOS

    group = Path(config).stem
    return {p: round(r[group], 3) for p, r in PAPER_SHIFT_RATIOS.items()} \
        if group in PAPER_SHIFT_RATIOS["colocated"] else None


def main(args: argparse.Namespace) -> int:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pivotrl-sim-") as scratch:
        args.scratch = Path(scratch)
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    from pivotrl_hpc.config import ConfigError
    from pivotrl_hpc.plan.policies import POLICIES

    paper = paper_speedups(args.config)
    if paper:   # a paper group runs the protocol's steps (sim/measure.py), as reproduce
        from pivotrl_hpc.sim.measure import RUN_STEPS
        args.overrides = [f"rl.steps={RUN_STEPS}", *args.overrides]
    try:
        cfg, stood_in = _load(args, args.overrides)
    except ConfigError as e:
        print(f"pivotrl simulate: {e}", file=sys.stderr)
        return 2
    names = PARADIGMS if args.paradigms == "all" else tuple(args.paradigms.split(","))
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        print(f"pivotrl simulate: unknown paradigm(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    constants = _constants(args, cfg)
    if args.out:
        Path(args.out).mkdir(mode=0o700, parents=True, exist_ok=True)
    bench_args = argparse.Namespace(config=args.config, overrides=args.overrides)
    result: dict = {}
    for paradigm in names:
        best, best_run = [], None
        # a paper group: Table 4's splits in its config, as reproduce and its calibration
        options = [] if paper else candidates(bench_args, paradigm, check_files=False)
        if args.no_search and not paper:
            options = [unsearched(bench_args, paradigm, options, check_files=False)]
        for extra in options or [[]]:
            tag = "-".join(x.rsplit("=", 1)[1] for x in extra) or "run"
            run = _one(args, paradigm, extra, tag)
            if best_run is None or (run["processed_tokens_per_s"]
                                    > best_run["processed_tokens_per_s"]):
                best, best_run = extra, run
        result[paradigm] = {k: best_run.get(k) for k in SHOWN} | {"split": best}
    # Figure 9's ratios: generated tokens over the protocol's window (sim/measure.py)
    result["speedup_vs"] = speedups(result, "processed_tokens_per_s")
    result["trained_speedup_vs"] = speedups(result, "tokens_per_s")
    if paper:   # a paper group: its published ratios beside ours (reproduce/paper.py)
        result["paper_speedup_vs"] = paper
    result["constants"] = constants.to_dict()
    result["stood_in"] = stood_in   # what the run took the place of absent folders with
    print(json.dumps(result, indent=1))
    return 0
