"""The worker's command loop over MPI, and the controller's handle on one worker.

Commands and replies cross MPI as typed bytes (`protocol.messages.WORKER_WIRE`, never
pickle) on the worker protocol's tags.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pivotrl_hpc.protocol import mpi
from pivotrl_hpc.protocol.messages import (TAG_COMMAND, TAG_REPLY, WORKER_WIRE, Command,
                                           Reply, Shutdown)
from pivotrl_hpc.protocol.wire import WireError
from pivotrl_hpc.runtime.worker import DeviceWorker

log = logging.getLogger(__name__)


def serve(comm, worker: DeviceWorker, controller: int = 0) -> int:
    """Answer commands from `controller` until Shutdown; return the number handled."""
    handled = 0
    while True:
        cmd = mpi.recv(comm, WORKER_WIRE, controller, TAG_COMMAND, expect=Command)
        send_reply(comm, worker.handle(cmd), controller)
        handled += 1
        if isinstance(cmd, Shutdown):
            log.info("worker rank %d: shutdown after %d commands", comm.Get_rank(), handled)
            return handled


def send_reply(comm, reply: Reply, controller: int) -> None:
    """A result the wire cannot carry still gets its reply: a failed one that says why."""
    try:
        data = WORKER_WIRE.encode(reply)
    except WireError as e:
        log.error("worker: the reply to %s cannot be sent: %s", reply.command, e)
        data = WORKER_WIRE.encode(Reply(reply.command, False, reply.role, reply.replica,
                                        error=f"reply not sendable: {e}",
                                        seq_ids=reply.seq_ids))
    mpi.send_bytes(comm, data, controller, TAG_REPLY)


REPLY_NAP_S = 0.005   # between polls of a WorkerClient's reply


@dataclass
class WorkerClient:
    """A blocking client of one worker rank's `serve` loop (launch's shutdown, test programs);
    the controller's never-blocking one is `controller.handles.WorkerHandle`."""

    comm: object
    rank: int

    def submit(self, cmd: Command):
        return mpi.isend(self.comm, WORKER_WIRE, cmd, self.rank, TAG_COMMAND)

    def result(self) -> Reply:
        # polled with naps, as the controller's handles wait: Open MPI busy-polls a blocking
        # receive on a core (~9 CPU-s while a killed worker's job waits for mpirun's SIGKILL)
        while True:
            got, reply = mpi.try_recv(self.comm, WORKER_WIRE, self.rank, TAG_REPLY,
                                      expect=Reply)
            if got:
                return reply
            time.sleep(REPLY_NAP_S)

    def call(self, cmd: Command) -> Reply:
        self.submit(cmd).wait()
        return self.result()
