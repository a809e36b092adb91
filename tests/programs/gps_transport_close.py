"""`mpirun -n 2 python gps_transport_close.py`: MPITransport.close() while a send is in
flight to a peer that never receives it (a peer agent that is gone or stuck).

Rank 1 asks rank 0 for 64 MiB over the agents' control channel and never posts its receive;
rank 0 serves the request (a rendezvous-size Isend that cannot complete) and closes its
transport (its default limit, 5 s). Each rank prints one JSON line; rank 0's has the seconds
close() took.
"""
import json
import sys
import time

import numpy as np
from mpi4py import MPI

from pivotrl_hpc.gps.transport import CTRL_TAG, MPITransport

SIZE = 64 << 20


def main() -> None:
    comm = MPI.COMM_WORLD
    if comm.rank == 1:
        comm.send({"op": "mpi_get", "key": ("m", 0), "asks": [(0, SIZE, 1001)]}, dest=0,
                  tag=CTRL_TAG)
        comm.recv(source=0, tag=7)   # rank 0 is done; the 64 MiB were never received
        sys.stdout.write(json.dumps({"rank": 1}) + "\n")
        sys.stdout.flush()
        return
    t = MPITransport(comm)
    t.expose(("m", 0), np.ones(SIZE, dtype=np.uint8))
    t.serve(1, comm.recv(source=1, tag=CTRL_TAG))
    t0 = time.monotonic()
    t.close()
    report = {"rank": 0, "close_s": round(time.monotonic() - t0, 3)}
    comm.send("done", dest=1, tag=7)
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
