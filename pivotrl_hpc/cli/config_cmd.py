"""`pivotrl config CONFIG [key=value ...]`: validate and print the resolved configuration;
`--explain`: where each value that is not the default comes from."""
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
    p.add_argument("--explain", action="store_true",
                   help="print each value that is not the default or that is set, with "
                        "the file (or the command line) that set it")


def explain(cfg, origins: dict[str, str]) -> list[str]:
    """`key: value  # source` for every value that differs from the schema's default or
    that a file or the command line sets (the default's value, maybe over an include's)."""
    from pivotrl_hpc.config import Config, to_dict
    from pivotrl_hpc.config.load import leaves

    default = leaves(to_dict(Config()))
    rows = [(k, v) for k, v in leaves(to_dict(cfg)).items()
            if default.get(k) != v or k in origins]
    width = max((len(f"{k}: {json.dumps(v)}") for k, v in rows), default=0)
    return [f"{k}: {json.dumps(v)}".ljust(width) + f"  # {_origin(k, origins)}"
            for k, v in rows]


def _origin(key: str, origins: dict[str, str]) -> str:
    """The source of `key`, or of the section a list or mapping override set whole."""
    while key:
        if key in origins:
            return origins[key]
        key = key.rpartition(".")[0]
    return "derived"


def main(args: argparse.Namespace) -> int:
    from pivotrl_hpc.config import ConfigError, to_dict
    from pivotrl_hpc.config.load import load_explained
    from pivotrl_hpc.config.run_checks import check_length_mode
    from pivotrl_hpc.launch.preflight import preflight

    try:
        cfg, origins = load_explained(args.config, args.overrides,
                                      check_files=not args.no_check_files)
        if not args.no_check_files:
            preflight(cfg)
    except ConfigError as e:
        print(f"pivotrl config: {e}", file=sys.stderr)
        return 2
    check_length_mode(cfg)   # with --no-check-files too (warns once)
    if args.explain:
        print(f"# {args.config}: the values set or off the defaults, and where from")
        print("\n".join(explain(cfg, origins)))
        return 0
    data = to_dict(cfg)
    if args.json:
        json.dump(data, sys.stdout, indent=2)
        print()
    else:
        yaml.safe_dump(data, sys.stdout, sort_keys=False)
    return 0
