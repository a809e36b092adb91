"""`pivotrl export RUN_OR_CHECKPOINT --out DIR`: the trained policy as a HuggingFace folder
that transformers and vLLM load as they are (pivotrl_hpc/checkpoint/export.py)."""
from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("where", metavar="RUN_OR_CHECKPOINT",
                   help="a checkpoint folder (step-N), a run's *.checkpoints folder, its trace "
                        ".h5 or its run folder: the newest whole checkpoint is taken")
    p.add_argument("--out", required=True, help="the model folder to write")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(args: argparse.Namespace) -> int:
    from pivotrl_hpc.checkpoint.export import export
    from pivotrl_hpc.checkpoint.layout import CheckpointError

    try:
        info = export(args.where, args.out, args.force)
    except CheckpointError as e:
        print(f"pivotrl export: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info))
    else:
        print(f"exported step {info['step']} (policy v{info['version']}, {info['tensors']} "
              f"tensors, {info['parameters'] / 1e6:.2f} M parameters) from "
              f"{info['checkpoint']} to {info['out']}")
    return 0
