"""MPI probe for the tests (run as a script or `python -m mpi_report`): every rank prints one
JSON line with its rank, the world size, an allreduce of all ranks, its COMM_TYPE_SHARED group
(the world ranks sharing its node), its Slurm ids and its arguments."""
import json
import os
import socket
import sys

from mpi4py import MPI

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
total = world.allreduce(rank, op=MPI.SUM)
shared = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
group = sorted(shared.allgather(rank))
# one write per line: mpirun forwards each write as it comes, so a separate "\n" can interleave
sys.stdout.write(json.dumps({
    "rank": rank,
    "size": size,
    "sum": total,
    "shared_group": group,
    "shared_rank": shared.Get_rank(),
    "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
    "slurm_procid": os.environ.get("SLURM_PROCID"),
    "slurm_localid": os.environ.get("SLURM_LOCALID"),
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "argv": sys.argv[1:],
}) + "\n")
sys.stdout.flush()
shared.Free()
