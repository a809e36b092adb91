"""The live `WorkerHandle`: commands over MPI to a device worker rank, never blocking.

Commands go out as `WORKER_WIRE` bytes (`Isend`) on the worker protocol's tag. Replies are
picked up by one `MPIInbox` shared by every handle: one `Improbe(ANY_SOURCE)` drains the
replies of all workers, at most once per `min_interval_s`. Probing each worker on every
loop turn kept rank 0 at ~95 % of a core (Iprobe drives Open MPI's progress engine under
its thread lock, which the GPS agent thread on the same rank contends for): CPU the capped
devices then lacked.
"""
from __future__ import annotations

import time
from collections import defaultdict

from pivotrl_hpc.protocol import mpi
from pivotrl_hpc.protocol.messages import TAG_COMMAND, TAG_REPLY, WORKER_WIRE, Command, Reply


class MPIInbox:
    def __init__(self, comm, min_interval_s: float = 0.001) -> None:
        self.comm, self.min_interval_s = comm, min_interval_s
        self._boxes: dict[int, list[Reply]] = defaultdict(list)
        self._last = -1.0

    def take(self, rank: int) -> list[Reply]:
        if not self._boxes.get(rank) and time.monotonic() - self._last >= self.min_interval_s:
            self._drain()
        return self._boxes.pop(rank, [])

    def _drain(self) -> None:
        from mpi4py import MPI

        status = MPI.Status()
        while True:
            got, reply = mpi.try_recv(self.comm, WORKER_WIRE, MPI.ANY_SOURCE, TAG_REPLY, status,
                                      expect=Reply)
            if not got:
                break
            self._boxes[status.Get_source()].append(reply)
        self._last = time.monotonic()


class MPIWorkerHandle:
    def __init__(self, comm, rank: int, device: int, inbox: MPIInbox | None = None) -> None:
        self.comm, self.rank, self.device = comm, rank, device
        self.inbox = inbox or MPIInbox(comm)
        self._sends: list = []

    def submit(self, cmd: Command) -> None:
        self._sends.append(mpi.isend(self.comm, WORKER_WIRE, cmd, self.rank, TAG_COMMAND))

    def poll(self) -> list[Reply]:
        out = self.inbox.take(self.rank)
        if self._sends:
            self._sends = [r for r in self._sends if not r.Test()]
        return out

    def next_reply_time(self) -> float | None:
        return None  # live: replies come when they come
