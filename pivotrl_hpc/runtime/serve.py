"""The worker's command loop over MPI, and the controller's handle on one worker.

Commands and replies are pickled dataclasses (`comm.send` / `comm.recv`) on a dedicated tag,
so other traffic on the communicator (GPS, the trainer's collectives) never mixes in.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from pivotrl_hpc.protocol.messages import Command, Reply, Shutdown
from pivotrl_hpc.runtime.worker import DeviceWorker

log = logging.getLogger(__name__)

TAG_COMMAND = 71
TAG_REPLY = 72


def serve(comm, worker: DeviceWorker, controller: int = 0) -> int:
    """Answer commands from `controller` until Shutdown; return the number handled."""
    handled = 0
    while True:
        cmd = comm.recv(source=controller, tag=TAG_COMMAND)
        reply = worker.handle(cmd)
        comm.send(reply, dest=controller, tag=TAG_REPLY)
        handled += 1
        if isinstance(cmd, Shutdown):
            log.info("worker rank %d: shutdown after %d commands", comm.Get_rank(), handled)
            return handled


@dataclass
class WorkerClient:
    """A blocking client of one worker rank's `serve` loop (launch's shutdown, test programs);
    the controller's never-blocking one is `controller.handles.WorkerHandle`."""

    comm: object
    rank: int

    def submit(self, cmd: Command):
        return self.comm.isend(cmd, dest=self.rank, tag=TAG_COMMAND)

    def result(self) -> Reply:
        return self.comm.recv(source=self.rank, tag=TAG_REPLY)

    def call(self, cmd: Command) -> Reply:
        self.submit(cmd).wait()
        return self.result()
