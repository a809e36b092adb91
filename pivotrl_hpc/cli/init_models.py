"""`pivotrl init-models DIR`: tiny policy, tiny GenRM (of a chosen architecture), their
byte-level BPE tokenizer with a chat template, and the synthetic math set as a DAPO-schema
train.parquet and an AIME-schema aime-style.parquet (data/). Both models then get a short
supervised warm start on the training set (assets/warmstart.py), so that the CPU demo's
rewards vary and GRPO has something to learn; `--random` keeps the random weights."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pivotrl_hpc.assets.models import GENRM_ARCHS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=Path, help="output folder (policy/, genrm/, data/)")
    p.add_argument("--seed", type=int, default=0, help="dataset seed")
    p.add_argument("--train", type=int, default=16,
                   help="training problems (the warm start learns their answers: a small set, "
                        "so that the tiny policy knows them after a CPU minute)")
    p.add_argument("--validation", type=int, default=64, help="validation problems")
    p.add_argument("--genrm-arch", default="qwen2", choices=GENRM_ARCHS,
                   help="architecture of the tiny GenRM: dense Qwen2 (default) or one of the "
                        "paper's GenRMs: glm4 (GLM-Z1), qwen3_moe (Qwen3-30B-A3B), "
                        "qwen3_5_moe (Qwen3.5-122B-A10B)")
    p.add_argument("--random", action="store_true",
                   help="no warm start: random weights (the policy never answers)")
    p.add_argument("--with-100m", action="store_true",
                   help="also write policy-100m/ (~100M parameters, for shift benchmarks)")


def main(args: argparse.Namespace) -> int:
    summary = init_models(args.dir, args.seed, args.train, args.validation, args.genrm_arch,
                          args.with_100m, warm=not args.random)
    json.dump(summary, sys.stdout, indent=2)
    print()
    return 0


def init_models(out: Path, seed: int = 0, train: int = 16, validation: int = 64,
                genrm_arch: str = "qwen2", with_100m: bool = False, warm: bool = True) -> dict:
    """Write the models and the data under `out`; warm-start the policy and a Qwen2 GenRM
    (the other architectures serve the architecture tests, with random weights)."""
    from pivotrl_hpc.task.synthetic import write_dataset
    from pivotrl_hpc.assets.models import SPECS, create_model
    from pivotrl_hpc.assets.warmstart import warm_start

    names = ["policy", "genrm"] + (["policy-100m"] if with_100m else [])
    summary: dict = {}
    for name in names:
        arch = genrm_arch if name == "genrm" else "qwen2"
        summary[name] = {"path": str(out / name), "architecture": arch,
                         "parameters": create_model(out / name, SPECS[name], arch)}
    data = write_dataset(out / "data", seed, train, validation)
    summary["data"] = {k: str(v) for k, v in data.items()}
    if warm:
        t0 = time.perf_counter()
        losses = warm_start(out, seed, train, genrm=genrm_arch == "qwen2")
        summary["warm_start"] = {"last_loss": losses, "seconds": time.perf_counter() - t0}
    return summary
