"""Two ranks carry every worker-protocol message of tests/test_protocol.py over MPI as
`protocol.mpi` bytes: rank 0 sends each with `isend` and reads rank 1's echo through
`try_recv` on ANY_SOURCE (the controller's inbox); rank 1 answers with `recv` + `send` (the
worker's loop). Then `bcast` and `allgather` of plain values. Prints rank 0's report."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_protocol import COMMANDS, REPLIES, _same

from pivotrl_hpc.protocol import mpi
from pivotrl_hpc.protocol.messages import WORKER_WIRE
from pivotrl_hpc.protocol.wire import PLAIN

TAG_OUT, TAG_BACK = 71, 72


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, messages = comm.Get_rank(), COMMANDS + REPLIES
    report = {"rank": rank}
    if rank == 0:
        sends = [mpi.isend(comm, WORKER_WIRE, x, 1, TAG_OUT) for x in messages]
        back, status, deadline = [], MPI.Status(), time.monotonic() + 60
        while len(back) < len(messages) and time.monotonic() < deadline:
            got, x = mpi.try_recv(comm, WORKER_WIRE, MPI.ANY_SOURCE, TAG_BACK, status)
            if got:
                assert status.Get_source() == 1
                back.append(x)
        MPI.Request.Waitall(sends)
        report["echoed"] = len(back)
        report["mismatch"] = [repr(a) for a, b in zip(messages, back) if not _same(a, b)]
    else:
        for _ in messages:
            mpi.send(comm, WORKER_WIRE, mpi.recv(comm, WORKER_WIRE, 0, TAG_OUT), 0, TAG_BACK)
    report["bcast"] = mpi.bcast(comm, PLAIN, {"ports": 41000, "token": "ab12"} if rank == 0
                                else None, 0)
    got = mpi.allgather(comm, PLAIN, [f"node{rank}", rank, bytes([rank])])
    report["allgather"] = [[a, b, c.hex()] for a, b, c in got]
    if rank == 0:   # one printer: two ranks' lines can interleave on mpirun's stdout
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
