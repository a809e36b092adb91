"""`pivotrl init-models DIR`: tiny policy, tiny GenRM, tokenizer and the math dataset."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=Path, help="output folder (policy/, genrm/, data/)")
    p.add_argument("--seed", type=int, default=0, help="dataset seed")
    p.add_argument("--train", type=int, default=512, help="training problems")
    p.add_argument("--validation", type=int, default=64, help="validation problems")
    p.add_argument("--with-100m", action="store_true",
                   help="also write policy-100m/ (~100M parameters, for shift benchmarks)")


def main(args: argparse.Namespace) -> int:
    from pivotrl_hpc.assets.dataset import write_dataset
    from pivotrl_hpc.assets.models import SPECS, create_model

    names = ["policy", "genrm"] + (["policy-100m"] if args.with_100m else [])
    summary = {name: {"path": str(args.dir / name),
                      "parameters": create_model(args.dir / name, SPECS[name])}
               for name in names}
    data = write_dataset(args.dir / "data", args.seed, args.train, args.validation)
    summary["data"] = {k: str(v) for k, v in data.items()}
    json.dump(summary, sys.stdout, indent=2)
    print()
    return 0
