"""Measure the trainer's shift-down / shift-up (offload / reload) on a given HF policy.

Usage: python profiling/megatron_offload.py MODEL_DIR [--repeats 3] [--seq 64]
Single process, TP=1 (CPU: gloo + shim; GPU: NCCL, pinned host buffers). Prints one JSON
object: bytes per category, seconds per phase (median of the repeats), host GB/s, the step
time, and the process RSS before / during / after the offload.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


from pivotrl_hpc.engines.host import rss_bytes  # noqa: E402
from pivotrl_hpc.engines.megatron.batch import random_batch  # noqa: E402
from pivotrl_hpc.engines.megatron.model import ModelBuildConfig  # noqa: E402
from pivotrl_hpc.engines.megatron.parallel import (  # noqa: E402
    destroy_model_parallel, single_process_world)
from pivotrl_hpc.engines.megatron.trainer import (  # noqa: E402
    MegatronTrainer, OptimConfig, TrainerConfig)
from pivotrl_hpc.gps.shapes import ModelShape  # noqa: E402


def rss_mib() -> float:
    return rss_bytes() / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    single_process_world()
    shape = ModelShape.from_hf_config(args.model_dir)
    tr = MegatronTrainer(shape, TrainerConfig(model=ModelBuildConfig(tp_size=1),
                                              optim=OptimConfig(lr=1e-5)))
    tr.load_hf_folder(args.model_dir)
    b = random_batch(shape.vocab_size, 4, args.seq)
    step = tr.train_step(b)  # creates Adam state and fills the grad buffer
    offs, rels, rss = [], [], {}
    for i in range(args.repeats):
        rss_before = rss_mib()
        offs.append(tr.offload())
        rss_during = rss_mib()
        rels.append(tr.reload())
        if i == 0:
            rss = {"before": rss_before, "offloaded": rss_during, "after_reload": rss_mib()}
    total_bytes = sum(tr.last_offload_bytes.values())
    med = {k: statistics.median(o[k] for o in offs) for k in offs[0]}
    med_r = {k: statistics.median(r[k] for r in rels) for k in rels[0]}
    print(json.dumps({
        "device": str(tr.device), "params": shape.num_params(),
        "bytes": tr.last_offload_bytes, "total_mib": total_bytes / 2**20,
        "offload_seconds": med, "reload_seconds": med_r,
        "offload_gib_s": total_bytes / 2**30 / med["total"],
        "reload_gib_s": total_bytes / 2**30 / med_r["total"],
        "step_seconds": step["seconds"], "rss_mib": rss,
        "next_step_loss": tr.train_step(b)["loss"], "first_step_loss": step["loss"],
        "wall": time.strftime("%H:%M:%S"),
    }, indent=1))
    destroy_model_parallel()


if __name__ == "__main__":
    main()
