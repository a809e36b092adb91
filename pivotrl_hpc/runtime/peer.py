"""Who is at the other end of one of the job's unix sockets (`peer`): the host forker and
the engine host check it before they send anything (issue 35)."""
from __future__ import annotations

import dataclasses
import os
import socket
import struct

_UCRED = struct.Struct("3i")


@dataclasses.dataclass(frozen=True)
class Peer:
    """SO_PEERCRED of a unix socket: the process that connected (seen by the listener), or
    the one that called listen() (seen by the connector), or the socketpair's creator."""
    pid: int
    uid: int
    gid: int


def peer(fd: int) -> Peer:
    """The kernel's word on who is at the other end of the unix socket `fd`."""
    with socket.socket(fileno=os.dup(fd)) as sock:
        return Peer(*_UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                   _UCRED.size)))
