"""`pivotrl config CONFIG [key=value ...]`: validate and print the resolved configuration."""
from __future__ import annotations

import argparse
import json
import sys

import yaml


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML file, e.g. configs/tiny-cpu.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rl.steps=3")
    p.add_argument("--json", action="store_true", help="print JSON instead of YAML")
    p.add_argument("--no-check-files", action="store_true",
                   help="skip checks that need the model folders and data on disk")


def main(args: argparse.Namespace) -> int:
    from pivotrl_hpc.config import ConfigError, load_config, to_dict

    try:
        cfg = load_config(args.config, args.overrides, check_files=not args.no_check_files)
    except ConfigError as e:
        print(f"pivotrl config: {e}", file=sys.stderr)
        return 2
    data = to_dict(cfg)
    if args.json:
        json.dump(data, sys.stdout, indent=2)
        print()
    else:
        yaml.safe_dump(data, sys.stdout, sort_keys=False)
    return 0
