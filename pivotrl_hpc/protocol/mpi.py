"""Messages over MPI as `Codec` bytes: mpi4py's buffer calls (`Send`, `Isend`, `Mprobe` +
`Recv`, `Bcast`, `Allgatherv`), never its pickling lower-case ones (`send`, `recv`,
`bcast`, `allgather`, ...), whose receive unpickles whatever arrives (tests/test_no_pickle.py
fails on any of them in the package).

`comm` is any mpi4py communicator; mpi4py is imported only when a message moves, so the
protocol package itself stays free of MPI.
"""
from __future__ import annotations

from typing import Any

from pivotrl_hpc.protocol.wire import Codec


def send(comm, codec: Codec, message: Any, dest: int, tag: int) -> None:
    send_bytes(comm, codec.encode(message), dest, tag)


def send_bytes(comm, data: bytes, dest: int, tag: int) -> None:
    """Send a message already encoded (`Codec.encode`)."""
    from mpi4py import MPI

    comm.Send([data, MPI.BYTE], dest=dest, tag=tag)


def isend(comm, codec: Codec, message: Any, dest: int, tag: int):
    """Start a send; the request holds the encoded bytes until it completes."""
    from mpi4py import MPI

    return comm.Isend([codec.encode(message), MPI.BYTE], dest=dest, tag=tag)


def recv(comm, codec: Codec, source: int, tag: int, status=None, expect: Any = None) -> Any:
    """Block for the next message from `source` (or MPI.ANY_SOURCE) on `tag`; `status`, if
    given, gets its source. `expect`: the type (or union) it must be (`Codec.decode`)."""
    from mpi4py import MPI

    status = MPI.Status() if status is None else status
    return _receive(comm.Mprobe(source=source, tag=tag, status=status), codec, status, expect)


def try_recv(comm, codec: Codec, source: int, tag: int, status=None,
             expect: Any = None) -> tuple[bool, Any]:
    """(True, message) when one is waiting, else (False, None): never blocks."""
    from mpi4py import MPI

    status = MPI.Status() if status is None else status
    handle = comm.Improbe(source=source, tag=tag, status=status)
    if handle is None:
        return False, None
    return True, _receive(handle, codec, status, expect)


def _receive(handle, codec: Codec, status, expect: Any = None) -> Any:
    """Receive the message a matched probe found: no other receive of this rank (another
    thread's) can take it in between."""
    from mpi4py import MPI

    buf = bytearray(status.Get_count(MPI.BYTE))
    handle.Recv([buf, MPI.BYTE])
    return codec.decode(buf, expect)


def bcast(comm, codec: Codec, message: Any, root: int) -> Any:
    """`message` of rank `root`, on every rank (the others pass anything, e.g. None)."""
    import numpy as np
    from mpi4py import MPI

    data = codec.encode(message) if comm.Get_rank() == root else b""
    size = np.array([len(data)], dtype=np.int64)
    comm.Bcast([size, MPI.INT64_T], root=root)
    buf = bytearray(data) if comm.Get_rank() == root else bytearray(int(size[0]))
    comm.Bcast([buf, MPI.BYTE], root=root)
    return codec.decode(buf)


def allgather(comm, codec: Codec, message: Any) -> list[Any]:
    """Every rank's `message`, in rank order, on every rank."""
    import numpy as np
    from mpi4py import MPI

    data = codec.encode(message)
    sizes = np.zeros(comm.Get_size(), dtype=np.int64)
    comm.Allgather([np.array([len(data)], dtype=np.int64), MPI.INT64_T], [sizes, MPI.INT64_T])
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    buf = bytearray(int(sizes.sum()))
    comm.Allgatherv([data, MPI.BYTE], [buf, (sizes.tolist(), offsets.tolist()), MPI.BYTE])
    view = memoryview(buf)
    return [codec.decode(view[o: o + n]) for o, n in zip(offsets.tolist(), sizes.tolist())]
