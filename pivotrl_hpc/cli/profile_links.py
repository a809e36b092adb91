"""`pivotrl profile links --out FILE.yaml`: the link bandwidths the GPS plan assumes, measured.

- `local_bps`: a GPS Read on this node (shared memory into preallocated tensors, as an engine
  reloads its parameters), best of `--repeats`;
- `remote_bps`, `overhead_s`: a replication node -> node through two real agents under mpirun
  (`--transport`), timed for a small and a large model: the slope is the bandwidth, the
  intercept the fixed cost of one replication (its transfer set-up and completion).

Writes `gps: {links: {local_bps, remote_bps, overhead_s}}`, a fragment to merge into a run
config (the agents' replication plans then weigh links by it), and prints one JSON line.
Emulated "nodes" on one machine measure this machine's memory, not a network.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path


def add_arguments(sub) -> None:
    p = sub.add_parser("links", help="GPS Read and node-to-node bandwidths -> gps.links",
                       description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="YAML file to write")
    p.add_argument("--size-mb", type=int, default=512, help="the large model's size")
    p.add_argument("--repeats", type=int, default=3, help="timed Reads (best kept)")
    p.add_argument("--transport", choices=("nixl", "mpi"), default="nixl")
    p.add_argument("--no-remote", action="store_true",
                   help="measure the local Read only (remote_bps, overhead_s: defaults)")


def local_bps(folder: Path, nbytes: int, repeats: int) -> float:
    import torch

    from pivotrl_hpc.gps.local import local_agent
    with local_agent({"bench": str(folder)}) as agent:
        client = agent.client()
        out = {n: torch.empty_like(t) for n, t in client.read("bench").items()}
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            client.read("bench", out=out)
            best = min(best, time.perf_counter() - t0)
        client.close()
    return nbytes / best


def remote_fit(small: tuple[Path, int], large: tuple[Path, int],
               transport: str) -> tuple[float, float]:
    """(bandwidth, intercept) of t(bytes) through two replications of different sizes."""
    from pivotrl_hpc.cli.bench_gps import _bench_replicate
    (fs, bs), (fl, bl) = small, large
    ts = bs / (_bench_replicate(fs, transport) * 1e9)
    tl = bl / (_bench_replicate(fl, transport) * 1e9)
    if tl <= ts:   # noise swamped the size difference: keep the large run's rate
        return bl / tl, 0.0
    bandwidth = (bl - bs) / (tl - ts)
    return bandwidth, max(ts - bs / bandwidth, 0.0)


def write_links_yaml(path: Path, links: dict[str, float], header: str) -> None:
    import yaml
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_text(f"# {header}\n" + yaml.safe_dump({"gps": {"links": links}}))


def main(args: argparse.Namespace) -> int:
    from pivotrl_hpc.cli.bench_gps import synthetic_model
    from pivotrl_hpc.config.schema import GPSLinksConfig

    links = dict(vars(GPSLinksConfig()))
    with tempfile.TemporaryDirectory() as d:
        large = Path(d) / "large"
        nbytes = synthetic_model(large, args.size_mb)
        links["local_bps"] = local_bps(large, nbytes, args.repeats)
        if not args.no_remote:
            small = Path(d) / "small"
            small_bytes = synthetic_model(small, 1)
            if small_bytes >= nbytes:
                print(f"pivotrl profile links: --size-mb {args.size_mb} is no larger than "
                      f"the smallest synthetic model ({small_bytes >> 20} MB)", file=sys.stderr)
                return 2
            links["remote_bps"], links["overhead_s"] = remote_fit(
                (small, small_bytes), (large, nbytes), args.transport)
    links = {k: float(f"{v:.4g}") for k, v in links.items()}
    header = (f"pivotrl profile links on {socket.gethostname()}: {nbytes >> 20} MB, "
              f"transport {args.transport}{', local only' if args.no_remote else ''}")
    write_links_yaml(args.out, links, header)
    json.dump({"out": str(args.out), "model_bytes": nbytes, "remote": not args.no_remote,
               **links}, sys.stdout)
    print()
    return 0
