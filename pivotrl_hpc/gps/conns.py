"""The node agent's client socket: who may connect, and how one client cannot stop the rest.

- Access: the socket is in the abstract namespace (no file to chmod), so every connection's
  peer is checked with SO_PEERCRED; only processes of the agent's own user are served
  (root's agent serves root only). A refused peer is closed at once, unread, and logged.
- Service: `selectors` (epoll), not `select()` (which dies past 1024 descriptors);
  non-blocking sockets both ways, so a client that never reads its replies fills only its
  own queue (MAX_PENDING_BYTES, then it is dropped); a request line longer than
  MAX_REQUEST_BYTES drops the client; at most MAX_CLIENTS connections (a new one past that
  is closed at once, and the job's own workers hold a handful).
"""
from __future__ import annotations

import json
import logging
import os
import selectors
import socket
import struct
from collections.abc import Callable

log = logging.getLogger(__name__)

MAX_CLIENTS = 512
MAX_REQUEST_BYTES = 1 << 20      # one JSON request line
MAX_PENDING_BYTES = 8 << 20      # unsent replies to one client


class Conn:
    """One client connection: its socket, its unparsed input, its unsent replies."""
    __slots__ = ("sock", "inbuf", "outbuf", "pid")

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid = sock, pid
        self.inbuf, self.outbuf = bytearray(), bytearray()

    def fileno(self) -> int:
        return self.sock.fileno()


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    fmt = "3i"
    return struct.unpack(fmt, sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                              struct.calcsize(fmt)))


class ClientSocket:
    def __init__(self, address: str | bytes, uid: int | None = None):
        self.uid = os.getuid() if uid is None else uid
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(address)
        self.sock.listen(128)
        self.sock.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ, None)
        self.conns: dict[int, Conn] = {}
        self.refused = 0

    # ---- the loop's turn --------------------------------------------------------------------
    def poll(self, timeout: float, handle: Callable[[Conn, dict], None]) -> bool:
        """Accept, read and write what is ready; `handle(conn, request)` per request line (an
        exception there is replied as an error). True when anything was ready."""
        events = self.sel.select(timeout)
        for key, mask in events:
            if key.data is None:
                self._accept()
                continue
            conn = key.data
            if mask & selectors.EVENT_WRITE:
                self._flush(conn)
            if mask & selectors.EVENT_READ and conn.fileno() >= 0:
                self._read(conn, handle)
        return bool(events)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            pid, uid, _ = peer_credentials(sock)
            if uid != self.uid or len(self.conns) >= MAX_CLIENTS:
                self.refused += 1
                why = f"uid {uid}" if uid != self.uid else f"{MAX_CLIENTS} clients already"
                if self.refused & (self.refused - 1) == 0:   # the 1st, 2nd, 4th, 8th, ...
                    log.warning("GPS agent refused a connection from pid %d (%s); %d refused "
                                "so far", pid, why, self.refused)
                sock.close()
                continue
            sock.setblocking(False)
            conn = Conn(sock, pid)
            self.conns[sock.fileno()] = conn
            self.sel.register(sock, selectors.EVENT_READ, conn)

    def _read(self, conn: Conn, handle: Callable[[Conn, dict], None]) -> None:
        try:
            data = conn.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # a worker died mid-request: its connection just goes
            data = b""
        if not data:
            self.drop(conn)
            return
        conn.inbuf += data
        while b"\n" in conn.inbuf:
            line, _, rest = bytes(conn.inbuf).partition(b"\n")
            conn.inbuf[:] = rest
            try:
                handle(conn, json.loads(line))
            except Exception as e:  # noqa: BLE001 - a bad request must not stop the node
                log.warning("GPS request from pid %d failed: %s: %s", conn.pid,
                            type(e).__name__, e)
                self.reply(conn, {"op": "error", "error": f"{type(e).__name__}: {e}"})
            if conn.fileno() < 0:
                return
        if len(conn.inbuf) > MAX_REQUEST_BYTES:
            log.warning("GPS client pid %d sent %d bytes without a request end: dropped",
                        conn.pid, len(conn.inbuf))
            self.drop(conn)

    # ---- replies ------------------------------------------------------------------------------
    def reply(self, conn: Conn, msg: dict) -> None:
        """Queue one reply and send what the socket takes now; never blocks."""
        if conn.fileno() < 0:
            return  # the client went away before its reply
        conn.outbuf += json.dumps(msg).encode() + b"\n"
        self._flush(conn)

    def _flush(self, conn: Conn) -> None:
        try:
            while conn.outbuf:
                n = conn.sock.send(conn.outbuf)
                del conn.outbuf[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.drop(conn)
            return
        if len(conn.outbuf) > MAX_PENDING_BYTES:
            log.warning("GPS client pid %d does not read its replies (%d bytes queued): "
                        "dropped", conn.pid, len(conn.outbuf))
            self.drop(conn)
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        self.sel.modify(conn.sock, events, conn)

    def drop(self, conn: Conn) -> None:
        fd = conn.fileno()
        if fd < 0:
            return
        self.conns.pop(fd, None)
        self.sel.unregister(conn.sock)
        conn.sock.close()

    def close(self) -> None:
        for conn in list(self.conns.values()):
            self.drop(conn)
        self.sel.close()
        self.sock.close()
