"""`pivotrl init-models DIR`: tiny policy, tiny GenRM (of a chosen architecture), their
byte-level BPE tokenizer with a chat template, and the synthetic math set as a DAPO-schema
train.parquet and an AIME-schema aime-style.parquet (data/)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pivotrl_hpc.assets.models import GENRM_ARCHS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=Path, help="output folder (policy/, genrm/, data/)")
    p.add_argument("--seed", type=int, default=0, help="dataset seed")
    p.add_argument("--train", type=int, default=512, help="training problems")
    p.add_argument("--validation", type=int, default=64, help="validation problems")
    p.add_argument("--genrm-arch", default="qwen2", choices=GENRM_ARCHS,
                   help="architecture of the tiny GenRM: dense Qwen2 (default) or one of the "
                        "paper's GenRMs: glm4 (GLM-Z1), qwen3_moe (Qwen3-30B-A3B), "
                        "qwen3_5_moe (Qwen3.5-122B-A10B)")
    p.add_argument("--with-100m", action="store_true",
                   help="also write policy-100m/ (~100M parameters, for shift benchmarks)")


def main(args: argparse.Namespace) -> int:
    from pivotrl_hpc.assets.dataset import write_dataset
    from pivotrl_hpc.assets.models import SPECS, create_model

    names = ["policy", "genrm"] + (["policy-100m"] if args.with_100m else [])
    summary = {}
    for name in names:
        arch = args.genrm_arch if name == "genrm" else "qwen2"
        summary[name] = {"path": str(args.dir / name), "architecture": arch,
                         "parameters": create_model(args.dir / name, SPECS[name], arch)}
    data = write_dataset(args.dir / "data", args.seed, args.train, args.validation)
    summary["data"] = {k: str(v) for k, v in data.items()}
    json.dump(summary, sys.stdout, indent=2)
    print()
    return 0
