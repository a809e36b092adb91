"""The node agent's client socket: who may connect, and how one client cannot stop the rest.

- Access: the socket is in the abstract namespace (no file to chmod), so every connection's
  peer is checked with SO_PEERCRED; only processes of the agent's own user are served
  (root's agent serves root only). A refused peer is closed at once, unread. The name carries
  the uid and a random token (agent.socket_address); a name already bound is `NameTaken`,
  naming the process holding it.
- Registration: the job's clients say `hello` with the agent's token (from the control file
  in the user's 0700 folder) as they connect. At MAX_CLIENTS a new connection evicts the
  oldest one that never registered, so idle connections of another process of the same user
  cannot lock the job's own workers out; registered clients are served first in each turn.
- Accepting: at most ACCEPTS_PER_TURN connections per turn, so a backlog kept full by
  churning connections (refused ones included) never stops the loop serving the rest.
- Service: `selectors` (epoll); non-blocking sockets both ways. Per turn a connection gets at
  most READ_BYTES read and LINES_PER_TURN requests handled (round robin: a flood of tiny
  requests on one connection costs the others one slice per turn); while OUT_HIGH bytes of its
  replies are unsent, its requests wait (a client that never reads stops being served, and
  MAX_PENDING_BYTES of unsent replies drops it); a request line longer than
  MAX_REQUEST_BYTES drops the client. Warnings are rate limited: one line per peer and kind
  per WARN_EVERY_S, with the count of the ones held back.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import pwd
import selectors
import socket
import struct
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

MAX_CLIENTS = 512
MAX_REQUEST_BYTES = 1 << 20      # one JSON request line
MAX_PENDING_BYTES = 8 << 20      # unsent replies to one client: then it is dropped
OUT_HIGH = 256 << 10             # unsent replies above which a client's requests wait
READ_BYTES = 64 << 10            # read from one connection per turn
LINES_PER_TURN = 32              # requests handled for one connection per turn
ACCEPTS_PER_TURN = 64            # connections accepted per turn (a full backlog: 128)
WARN_EVERY_S = 10.0


class NameTaken(PermissionError):
    """The agent's socket name is already bound by another process."""
    exit_code = 2   # a refusal, not a crash: the launchers end the job with 2 (launch/entry.py)


class Conn:
    """One client connection: its socket, its unparsed input, its unsent replies."""
    __slots__ = ("sock", "fd", "pid", "inbuf", "outbuf", "registered", "pending")

    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid = sock, pid
        self.fd = sock.fileno()   # its key, also once closed
        self.inbuf, self.outbuf = bytearray(), bytearray()
        self.registered = False
        self.pending = False   # complete request lines wait in inbuf

    def fileno(self) -> int:
        return self.sock.fileno()


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    fmt = "3i"
    return struct.unpack(fmt, sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                              struct.calcsize(fmt)))


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no such user"


def name_owner(address: str) -> str:
    """Who holds an abstract socket name, from its listener's credentials if it accepts."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(address)
        pid, uid, _ = peer_credentials(s)
        return f"pid {pid}, uid {uid} ({user_name(uid)})"
    except OSError:
        return "a process that does not accept connections on it"
    finally:
        s.close()


class RateLimitedLog:
    """At most one warning per key per `every_s`; the next one says how many were held back."""

    def __init__(self, every_s: float = WARN_EVERY_S):
        self.every_s = every_s
        self._last: dict[object, list] = {}   # key -> [time of the last line, held back]

    def warning(self, key: object, msg: str, *args) -> None:
        now = time.monotonic()
        seen = self._last.get(key)
        if seen is not None and now - seen[0] < self.every_s:
            seen[1] += 1
            return
        held = seen[1] if seen is not None else 0
        log.warning(msg + (f" (and {held} more in the last {self.every_s:.0f} s)" if held else ""),
                    *args)
        if len(self._last) > 4096:   # many peers come and go: forget the quiet ones
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self.every_s}
        self._last[key] = [now, 0]


class ClientListener:
    """The agent's listening server for its clients: accepts (peer uid checked), reads and
    writes their connections without blocking."""

    def __init__(self, address: str, uid: int | None = None, token: str = ""):
        self.uid = os.getuid() if uid is None else uid
        self.token = token
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(address)
        except OSError as e:
            self.sock.close()
            if e.errno != errno.EADDRINUSE:
                raise
            raise NameTaken(f"the GPS agent's socket name @{address.lstrip(chr(0))} is already "
                            f"bound by {name_owner(address)}: another agent of this job and "
                            f"node, or a process squatting the name") from None
        self.sock.listen(128)
        self.sock.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.sock, selectors.EVENT_READ, None)
        self.conns: dict[int, Conn] = {}
        self._unregistered: dict[int, Conn] = {}   # insertion order: oldest first
        self._ready: dict[int, Conn] = {}          # complete requests waiting, not blocked
        self.refused = 0
        self.warn = RateLimitedLog()

    # ---- the loop's turn --------------------------------------------------------------------
    def poll(self, timeout: float, handle: Callable[[Conn, dict], None]) -> bool:
        """Accept, read and write what is ready, then handle up to LINES_PER_TURN requests
        per connection (`handle(conn, request)`; an exception there is replied as an error).
        True when anything was ready or still waits."""
        events = self.sel.select(0 if self._ready else timeout)
        for key, mask in events:
            if key.data is None:
                self._accept()
                continue
            conn = key.data
            if mask & selectors.EVENT_WRITE:
                self._flush(conn)
            if mask & selectors.EVENT_READ and conn.fileno() >= 0:
                self._read(conn)
        served = self._serve(handle)
        return bool(events) or served

    def _accept(self) -> None:
        # at most ACCEPTS_PER_TURN: a process refilling the backlog as fast as it is accepted
        # (another account churning connections) kept this loop from ending, and the job's
        # open connections from being served (issue 51)
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            pid, uid, _ = peer_credentials(sock)
            if uid != self.uid:
                self._refuse(sock, pid, ("uid", uid), f"uid {uid}")
                continue
            if len(self.conns) >= MAX_CLIENTS:
                if not self._unregistered:
                    self._refuse(sock, pid, "full", f"{MAX_CLIENTS} registered clients")
                    continue
                oldest = next(iter(self._unregistered.values()))
                self.warn.warning("evict", "GPS agent at %d clients: closed the oldest "
                                  "unregistered connection (pid %d)", MAX_CLIENTS, oldest.pid)
                self.drop(oldest)
            sock.setblocking(False)
            conn = Conn(sock, pid)
            self.conns[sock.fileno()] = self._unregistered[sock.fileno()] = conn
            self.sel.register(sock, selectors.EVENT_READ, conn)

    def _refuse(self, sock: socket.socket, pid: int, key, why: str) -> None:
        self.refused += 1
        self.warn.warning(key, "GPS agent refused a connection from pid %d (%s); %d refused so "
                          "far", pid, why, self.refused)
        sock.close()

    def _read(self, conn: Conn) -> None:
        if conn.pending:
            return   # its requests are handled first: memory stays bounded
        try:
            data = conn.sock.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # a worker died mid-request: its connection just goes
            data = b""
        if not data:
            self.drop(conn)
            return
        conn.inbuf += data
        if b"\n" in data:
            conn.pending = True
            self._ready[conn.fd] = conn
        elif len(conn.inbuf) > MAX_REQUEST_BYTES:
            self.warn.warning(("long", conn.pid), "GPS client pid %d sent %d bytes without a "
                              "request end: dropped", conn.pid, len(conn.inbuf))
            self.drop(conn)

    def _serve(self, handle: Callable[[Conn, dict], None]) -> bool:
        """One slice per connection with requests waiting, registered clients first."""
        if not self._ready:
            return False
        for conn in sorted(self._ready.values(), key=lambda c: not c.registered):
            for _ in range(LINES_PER_TURN):
                if conn.fileno() < 0 or len(conn.outbuf) >= OUT_HIGH:
                    break
                end = conn.inbuf.find(b"\n")
                if end < 0:
                    conn.pending = False
                    break
                line = bytes(conn.inbuf[:end])
                del conn.inbuf[:end + 1]
                self._handle_line(conn, line, handle)
            if conn.fileno() < 0 or not conn.pending or len(conn.outbuf) >= OUT_HIGH:
                self._ready.pop(conn.fd, None)   # blocked ones come back in _flush
        return True

    def _handle_line(self, conn: Conn, line: bytes, handle) -> None:
        try:
            msg = json.loads(line)
            if not isinstance(msg, dict):
                raise ValueError("a request is a JSON object")
            if msg.get("op") == "hello":
                self._hello(conn, msg)
            else:
                handle(conn, msg)
        except Exception as e:  # noqa: BLE001 - a bad request must not stop the node
            self.warn.warning(("failed", conn.pid), "GPS request from pid %d failed: %s: %s",
                              conn.pid, type(e).__name__, e)
            self.reply(conn, {"op": "error", "error": f"{type(e).__name__}: {e}"})

    def _hello(self, conn: Conn, msg: dict) -> None:
        if msg.get("token") != self.token:
            raise PermissionError("hello with a wrong token")
        conn.registered = True
        self._unregistered.pop(conn.fd, None)
        self.reply(conn, {"op": "hello"})

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
            self.warn.warning(("unread", conn.pid), "GPS client pid %d does not read its "
                              "replies (%d bytes queued): dropped", conn.pid, len(conn.outbuf))
            self.drop(conn)
            return
        blocked = len(conn.outbuf) >= OUT_HIGH
        if conn.pending and not blocked:
            self._ready[conn.fd] = conn
        # blocked: no more reading until its replies drain (no busy loop on its input)
        events = selectors.EVENT_WRITE if blocked else \
            selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbuf else 0)
        self.sel.modify(conn.sock, events, conn)

    def drop(self, conn: Conn) -> None:
        if conn.fileno() < 0:
            return
        for d in (self.conns, self._unregistered, self._ready):
            d.pop(conn.fd, None)
        self.sel.unregister(conn.sock)
        conn.sock.close()

    def close(self) -> None:
        for conn in list(self.conns.values()):
            self.drop(conn)
        self.sel.close()
        self.sock.close()
