"""`pivotrl gps serve|clean|ls`: run a node agent by hand, remove or list GPS segments."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="gps_cmd", metavar="ACTION", required=True)
    serve = sub.add_parser("serve", help="run this node's GPS agent until shutdown or SIGTERM")
    serve.add_argument("--model", action="append", required=True, metavar="NAME=DIR",
                       help="model name and HF safetensors folder (repeat)")
    serve.add_argument("--job", default=None,
                       help="job id (default: $SLURM_JOB_ID or $PIVOTRL_RUN_ID, else a new one)")
    serve.add_argument("--node", default=None, help="node name (default: $SLURMD_NODENAME)")
    serve.add_argument("--budget-mb", type=float, default=None,
                       help="per-node GPS memory budget; below the models' size -> hybrid layout")
    serve.add_argument("--transport", choices=["nixl", "mpi"], default="nixl")
    serve.add_argument("--mpi", action="store_true",
                       help="one agent per MPI rank (srun -N<n> --ntasks-per-node=1)")
    clean = sub.add_parser("clean", help="remove GPS segments of a job (operator cleanup)")
    clean.add_argument("--job", default=None,
                       help="job id (default: $SLURM_JOB_ID or $PIVOTRL_RUN_ID)")
    clean.add_argument("--node", default=None, help="only this node's segments")
    clean.add_argument("--all", action="store_true", help="every pivotrl-* segment of this user")
    ls = sub.add_parser("ls", help="list GPS segments in /dev/shm")
    ls.add_argument("--job", default=None)


def main(args: argparse.Namespace) -> int:
    from pivotrl_hpc.gps import shmdir
    from pivotrl_hpc.gps.segment import (SHM_DIR, AgentAliveError, SegmentError, default_job,
                                         default_node, sweep)

    if args.gps_cmd == "clean":
        if args.all:
            removed = []
            for p in SHM_DIR.glob("pivotrl-*"):
                if p.stat().st_uid == os.getuid():
                    p.unlink(missing_ok=True)
                    removed.append(p.name)
        else:
            job = args.job or default_job()
            if job is None:
                print("pivotrl gps clean: which job? give --job ID (or --all for every segment "
                      "of this user)", file=sys.stderr)
                return 2
            try:
                removed = sweep(job, args.node)
            except AgentAliveError as e:
                print(f"pivotrl gps clean: {e}", file=sys.stderr)
                return 1
        shmdir.remove_if_unused()   # the folder too, once empty and held by no agent
        print(f"removed {len(removed)} segment(s)")
        return 0
    if args.gps_cmd == "ls":
        prefix = f"pivotrl-{args.job}-" if args.job else "pivotrl-"
        for p in sorted(SHM_DIR.glob(prefix + "*")):
            st = p.stat()
            print(f"{p.name}\t{st.st_size}\t{st.st_blocks * 512}")
        return 0
    from pivotrl_hpc.gps.agent import AgentConfig, NodeAgent

    models = dict(m.split("=", 1) for m in args.model)
    comm = None
    if args.mpi:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    job = args.job or default_job() or f"local{uuid.uuid4().hex[:8]}"   # never a shared name
    cfg = AgentConfig(job=job, node=args.node or default_node(),
                      models=models, transport=args.transport,
                      budget_bytes=int(args.budget_mb * 2**20) if args.budget_mb else None)
    agent = NodeAgent(cfg, comm)
    try:
        agent.start()
    except (PermissionError, MemoryError, AgentAliveError, SegmentError) as e:
        agent.close()
        print(f"pivotrl gps serve: {e}", file=sys.stderr)
        return 2
    log.info("GPS agent %s/%s ready", cfg.job, cfg.node)
    agent.serve_forever()
    return 0
