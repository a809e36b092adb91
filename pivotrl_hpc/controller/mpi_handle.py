"""The live `WorkerHandle`: commands over MPI to a device worker rank, never blocking.

Commands go out with `isend` on the worker protocol's tag (runtime.serve), replies are
picked up with `Iprobe`, so the loop keeps dispatching while workers compute.
"""
from __future__ import annotations

from pivotrl_hpc.runtime.messages import Command, Reply
from pivotrl_hpc.runtime.serve import TAG_COMMAND, TAG_REPLY


class MPIWorkerHandle:
    def __init__(self, comm, rank: int, device: int) -> None:
        self.comm, self.rank, self.device = comm, rank, device
        self._sends: list = []

    def submit(self, cmd: Command) -> None:
        self._sends.append(self.comm.isend(cmd, dest=self.rank, tag=TAG_COMMAND))

    def poll(self) -> list[Reply]:
        out = []
        while self.comm.Iprobe(source=self.rank, tag=TAG_REPLY):
            out.append(self.comm.recv(source=self.rank, tag=TAG_REPLY))
        self._sends = [r for r in self._sends if not r.Test()]
        return out

    def next_reply_time(self) -> float | None:
        return None  # live: replies come when they come
