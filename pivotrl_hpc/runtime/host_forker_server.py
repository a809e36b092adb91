"""The engine host forker's own side (`python -m pivotrl_hpc.runtime.host_forker_server FD
STARTER_PID`): see `host_forker` for the design; this is what runs in the forker.

Who may ask: only processes of the job's user (SO_PEERCRED uid, checked when a connection is
accepted, before a byte of it is read), and a FORK only for the asking process itself (the
request's worker pid is the peer's). Requests are typed (`FORKER_WIRE`: JSON, never pickle);
the host's three fds come with the request by SCM_RIGHTS. Anything else is closed unread.

Its life (issue 36 point 8: a cancelled job's forker must not outlive it by its orphan
timeout): while it imports vLLM it dies with the worker that started it (PR_SET_PDEATHSIG);
from then on it leaves when no session is open and no host is left, once a session has been
seen or its starter is gone (a pidfd), or after ORPHAN_S if neither ever happens. Connections
queued while it imported are all accepted before it decides that no session is open.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import selectors
import signal
import socket
import sys
import time

from pivotrl_hpc.runtime.host_forker import (FORK, FORKER_WIRE, MAX_REQUEST, ORPHAN_S, PID,
                                             REQUEST_LEN, SESSION, ForkRequest, readable,
                                             recv_exact)
from pivotrl_hpc.protocol.wire import WireError
from pivotrl_hpc.terminal import safe_logs
from pivotrl_hpc.runtime.peer import peer

log = logging.getLogger("pivotrl_hpc.runtime.host_forker")

PR_SET_PDEATHSIG = 1
REFUSAL_LOG_S = 10.0   # one warning per refusing interval, with the count (floods)


def serve(listener: socket.socket, starter: int) -> None:
    """The forker's life: import vLLM, then fork hosts until no session and no host is left.
    `starter` is a pidfd of the worker that started it."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    from pivotrl_hpc.runtime.engine_host_child import preload

    try:
        log.info("preloaded in %.2f s", preload())
    except Exception as e:  # noqa: BLE001 - the forker must come up; hosts import again
        log.warning("preload failed (each host imports vLLM itself): %s", e)
    _parent_death_signal(0)   # sessions rule from now on: the starter may leave before others
    listener.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    server = _Server(listener, sel, starter)
    t0 = time.monotonic()
    while True:
        for key, _ in sel.select(0.1):
            if key.fileobj is listener:
                server.accept_all()
            else:   # a session's only traffic is its end
                server.end_session(key.fileobj)
        server.reap()
        if server.idle() and (server.seen or readable(starter)
                              or time.monotonic() - t0 > ORPHAN_S):
            server.close()
            return


class _Server:
    def __init__(self, listener: socket.socket, sel, starter: int):
        self.listener, self.sel, self.starter = listener, sel, starter
        self.sessions: set[socket.socket] = set()
        self.children: dict[int, int] = {}   # host pid -> its status pipe
        self.seen = False
        self.refused, self.refusal_logged = 0, 0.0

    def idle(self) -> bool:
        return not self.sessions and not self.children

    def close(self) -> None:
        """Leaving: give up the name before anything else (the interpreter's teardown after
        vLLM's import takes seconds, and a name still bound meanwhile let workers queue on a
        forker that never answers, and kept a new one from starting: issue 47). Connections
        still queued are reset; their workers start a new forker."""
        self.sel.unregister(self.listener)
        self.listener.close()

    def accept_all(self) -> None:
        """Every queued connection (a worker that asked while the forker imported is not
        left in the queue while the forker decides whether anyone is still there)."""
        while True:
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:
                return
            self._one(conn)

    def end_session(self, conn: socket.socket) -> None:
        self.sel.unregister(conn)
        self.sessions.discard(conn)
        conn.close()

    def _one(self, conn: socket.socket) -> None:
        """One connection: a session or a fork request, from the job's user only."""
        conn.settimeout(10.0)
        fds: list[int] = []
        try:
            asker = peer(conn.fileno())
            if asker.uid != os.geteuid():
                self._refuse(f"uid {asker.uid} (pid {asker.pid}) is not the job's user")
                return
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            if msg[:1] == SESSION and not fds:
                conn.sendall(PID.pack(os.getpid()))
                conn.settimeout(None)
                self.sessions.add(conn)
                self.sel.register(conn, selectors.EVENT_READ)
                self.seen = True
                return
            request = _request(conn, msg, fds, asker.pid)
            pid = _fork(request, fds, (self.listener, conn, *self.sessions, self.sel),
                        (*self.children.values(), self.starter))
            self.children[pid] = fds[1]
            fds = [fds[0], fds[2]]
            conn.sendall(PID.pack(pid))
        except (OSError, ValueError) as e:   # WireError is a ValueError
            self._refuse(f"bad request: {e}")
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            if conn not in self.sessions:
                conn.close()

    def _refuse(self, why: str) -> None:
        """Log refusals at most once an interval, with their count: a flood of connections
        from another account costs it a close each, not the node's log."""
        self.refused += 1
        now = time.monotonic()
        if now - self.refusal_logged >= REFUSAL_LOG_S:
            log.warning("engine host forker refused %d connection(s); the last: %s",
                        self.refused, why)
            self.refused, self.refusal_logged = 0, now

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if not pid:
                return
            fd = self.children.pop(pid, None)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.write(fd, PID.pack(os.waitstatus_to_exitcode(status)))
                os.close(fd)


def _request(conn: socket.socket, msg: bytes, fds: list[int], asker: int) -> ForkRequest:
    """A FORK: its three fds, a typed request of bounded size, for the asking process."""
    if msg[:1] != FORK or len(fds) != 3 or len(msg) < 1 + REQUEST_LEN.size:
        raise WireError(f"not a fork request ({len(msg)} bytes, {len(fds)} fds)")
    size = REQUEST_LEN.unpack(msg[1:1 + REQUEST_LEN.size])[0]
    if size > MAX_REQUEST:
        raise WireError(f"a fork request of {size} bytes (at most {MAX_REQUEST})")
    payload = msg[1 + REQUEST_LEN.size:]
    payload += recv_exact(conn, size - len(payload))
    request = FORKER_WIRE.decode(payload)
    if not isinstance(request, ForkRequest):
        raise WireError(f"not a fork request: {type(request).__name__}")
    if request.worker_pid != asker:
        raise WireError(f"pid {asker} asked for a host of worker {request.worker_pid}")
    return request


def _fork(request: ForkRequest, fds: list[int], mine: tuple, my_fds: tuple) -> int:
    conn_fd, status_w, stderr_fd = fds
    pid = os.fork()
    if pid:
        return pid
    try:   # the host: none of the forker's files, the worker's stderr, default signals
        for obj in mine:
            obj.close()
        for fd in (*my_fds, status_w):
            os.close(fd)
        os.dup2(stderr_fd, 2)
        os.close(stderr_fd)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        from multiprocessing.connection import Connection

        from pivotrl_hpc.runtime import engine_host_child

        engine_host_child.run(Connection(conn_fd), request.worker_pid, request.name,
                              request.env)
    finally:
        os._exit(1)


def _parent_death_signal(sig: int) -> None:
    """PR_SET_PDEATHSIG: `sig` when the thread that started this process ends (0: none)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def _follow_starter(starter_pid: int) -> int:
    """Die with the starting worker while importing (a job cancelled during its start-up
    leaves no forker behind); a pidfd of it for afterwards."""
    _parent_death_signal(signal.SIGKILL)
    if os.getppid() != starter_pid:   # it died before the signal was armed
        raise SystemExit(0)
    return os.pidfd_open(starter_pid)


def main(argv: list[str]) -> None:
    os.dup2(2, 1)   # vLLM logs to stdout; a worker's stdout is data
    logging.basicConfig(level=logging.WARNING, force=True,
                        format="%(asctime)s [engine host forker] %(levelname)s: %(message)s")
    safe_logs()
    starter = _follow_starter(int(argv[1]))
    serve(socket.socket(fileno=int(argv[0])), starter)
    # Left (its name already given up): skip the interpreter's teardown of vLLM and torch,
    # which took over 5 s on a loaded node; the hosts are processes of their own.
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
