"""One fork server of engine hosts per node: the host forker.

Why: importing vLLM and the engine adapter costs an engine host 5 CPU-s. Each worker used to
run its own fork server that imported them once (stdlib `multiprocessing` forkserver, which
only the process that started it can use), so a node of G devices imported vLLM G times at
the job's start, all at once: on a 2-core machine a 2 x 4 job spent ~15 s of its start-up on
six of those eight imports. The forker is one process per node, shared by every worker there.

- Address: an abstract unix socket (no file to clean), named by job and node
  (`node_address`) in PIVOTRL_HOST_FORKER, set by the launcher per worker. Unset (tests,
  benchmarks), a process has a private forker of its own.
- Start: the first worker that binds the address starts the forker (a fresh interpreter, not a
  fork of an MPI rank) and hands it the bound socket; the others find the address in use and
  connect. Connections queue while it imports; it answers once it has.
- A worker holds a session (one connection) for its life; the forker leaves when no session
  is open and every host it forked is gone. SIGTERM / SIGHUP / SIGINT are ignored (Slurm
  signals every process of the step; the workers decide when hosts stop).
- Fork: a request carries the host's end of its pipe to the worker, a status pipe and the
  worker's stderr; the forker forks the host with them, answers its pid, and writes its exit
  code to the status pipe when it reaps it. `ForkedHost` is the worker's handle: pid, exit
  code, kill (through a pidfd: never a reused pid), join.
- CPU caps: the forker stays out of the devices' groups; a host forked after its worker was
  capped joins the worker's group (`cgroup.follow`), one forked before is moved with the
  worker at its cap.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any

log = logging.getLogger(__name__)

ADDRESS_ENV = "PIVOTRL_HOST_FORKER"
_PID = struct.Struct("q")
_LEN = struct.Struct("I")
SESSION, FORK = b"S", b"F"
CONNECT_TIMEOUT_S = 30.0   # another worker bound the address and is starting the forker
ORPHAN_S = 120.0           # a forker no session ever reached leaves after this
UNKNOWN_EXIT = 255         # the forker died before it could report a host's exit


def node_address(job: str, node: str) -> str:
    return f"pivotrl-{job}-{node}-hosts"


def address() -> str:
    return os.environ.get(ADDRESS_ENV) or f"pivotrl-pid{os.getpid()}-hosts"


def _abstract(name: str) -> str:
    return "\0" + name


# ---------------------------------------------------------------------------------- client
class _Session:
    """This process's connection to its node's forker (one per process)."""
    sock: socket.socket | None = None
    name: str | None = None
    pid: int | None = None
    child: subprocess.Popen | None = None   # the forker, when this process started it


def ensure_running() -> None:
    """Open this process's session with the forker of `address()`, starting it if no one
    has; returns at once (the forker may still be importing)."""
    name = address()
    if _Session.sock is not None and _Session.name == name:
        return
    leave()
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            sock = _connect(name)
            break
        except ConnectionRefusedError:
            if not _start(name) and time.monotonic() > deadline:
                raise RuntimeError(f"no engine host forker at {name!r} after "
                                   f"{CONNECT_TIMEOUT_S:.0f} s") from None
            time.sleep(0.05)
    sock.sendall(SESSION)
    _Session.sock, _Session.name, _Session.pid = sock, name, None


def server_pid() -> int:
    """The forker's pid (waits until it has imported vLLM and answered)."""
    ensure_running()
    if _Session.pid is None:
        _Session.pid = _PID.unpack(_recv_exact(_Session.sock, _PID.size))[0]
    return _Session.pid


def leave() -> None:
    """Close this process's session (a worker's end): the forker leaves once no session is
    open and its hosts are gone."""
    if _Session.sock is not None:
        _Session.sock.close()
    _Session.sock = _Session.name = _Session.pid = None
    if _Session.child is not None and _Session.child.poll() is not None:
        _Session.child = None   # reaped


def _connect(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.connect(_abstract(name))
    except OSError:
        sock.close()
        raise
    return sock


def _start(name: str) -> bool:
    """Bind the address and start the forker on it; False if another process holds it."""
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(_abstract(name))
    except OSError:
        listener.close()
        return False
    from pivotrl_hpc.runtime.engine_host import world_free

    with listener:
        listener.listen(64)
        env = {k: v for k, v in os.environ.items() if world_free(k)}
        _Session.child = subprocess.Popen(
            [sys.executable, "-m", __name__, str(listener.fileno())],
            pass_fds=[listener.fileno()], env=env, stdin=subprocess.DEVNULL)
    from pivotrl_hpc.launch import cgroup

    cgroup.leave_caps(_Session.child.pid)   # a restart by a capped worker: not its device
    log.info("engine host forker %s: pid %d", name, _Session.child.pid)
    return True


def fork_host(worker_pid: int, name: str, env: dict[str, str], conn_fd: int) -> ForkedHost:
    """Fork an engine host (`engine_host_child.run(conn, worker_pid, name, env)`) from this
    node's forker; `conn_fd` is the host's end of its pipe (the caller closes its copy)."""
    ensure_running()
    status_r, status_w = os.pipe()
    try:
        with _connect(_Session.name) as sock:
            payload = pickle.dumps((worker_pid, name, env))
            socket.send_fds(sock, [FORK + _LEN.pack(len(payload)) + payload],
                            [conn_fd, status_w, sys.stderr.fileno()])
            pid = _PID.unpack(_recv_exact(sock, _PID.size))[0]
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    host = ForkedHost(pid, status_r)
    from pivotrl_hpc.launch import cgroup

    cgroup.follow(pid)
    return host


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("engine host forker closed the connection")
        data += chunk
    return data


class ForkedHost:
    """A host forked by the forker: the subset of `multiprocessing.Process` a handle uses."""

    def __init__(self, pid: int, status_fd: int):
        self.pid = pid
        self._status = status_fd
        self._exitcode: int | None = None
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self._pidfd = None   # gone already: its exit code is in the status pipe

    @property
    def exitcode(self) -> int | None:
        self._poll(0.0)
        return self._exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        self._poll(timeout)

    def kill(self) -> None:
        if self.exitcode is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def _poll(self, timeout: float | None) -> None:
        """The exit code from the status pipe; if the forker died first (EOF, no code), the
        host's pidfd says whether it still lives (its code is then unknown)."""
        if self._exitcode is not None:
            return
        if self._status is not None:
            if not _readable(self._status, timeout):
                return
            data = os.read(self._status, _PID.size)
            os.close(self._status)
            self._status = None
            if len(data) == _PID.size:
                self._exitcode = _PID.unpack(data)[0]
                self._close()
                return
            log.warning("engine host forker gone before host %d ended", self.pid)
        if self._pidfd is None or _readable(self._pidfd, timeout):
            self._exitcode = UNKNOWN_EXIT
            self._close()

    def _close(self) -> None:
        for fd in (self._status, self._pidfd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._status = self._pidfd = None

    def __del__(self) -> None:
        if hasattr(self, "_pidfd"):   # both fds: the pidfd outlives the status pipe when
            self._close()             # the forker died before the host


def _readable(fd: int, timeout: float | None = 0.0) -> bool:
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        return bool(sel.select(timeout))


# ---------------------------------------------------------------------------------- server
def serve(listener: socket.socket) -> None:
    """The forker's life: import vLLM, then fork hosts until no session and no host is left."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    from pivotrl_hpc.runtime.engine_host_child import preload

    try:
        log.info("preloaded in %.2f s", preload())
    except Exception as e:  # noqa: BLE001 - the forker must come up; hosts import again
        log.warning("preload failed (each host imports vLLM itself): %s", e)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sessions: set[socket.socket] = set()
    children: dict[int, int] = {}   # host pid -> its status pipe
    seen, t0 = False, time.monotonic()
    while True:
        for key, _ in sel.select(0.1):
            if key.fileobj is listener:
                seen |= _accept(listener, sel, sessions, children)
            else:   # a session's only traffic is its end
                sel.unregister(key.fileobj)
                sessions.discard(key.fileobj)
                key.fileobj.close()
        _reap(children)
        if not sessions and not children and (seen or time.monotonic() - t0 > ORPHAN_S):
            return


def _accept(listener, sel, sessions, children) -> bool:
    """One connection: a session (True) or a fork request."""
    conn, _ = listener.accept()
    conn.settimeout(10.0)
    try:
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        if msg[:1] == SESSION:
            conn.sendall(_PID.pack(os.getpid()))
            conn.settimeout(None)
            sessions.add(conn)
            sel.register(conn, selectors.EVENT_READ)
            return True
        size = _LEN.unpack(msg[1:1 + _LEN.size])[0]
        payload = msg[1 + _LEN.size:]
        payload += _recv_exact(conn, size - len(payload))
        pid = _fork(pickle.loads(payload), fds, (listener, conn, *sessions, sel), children)
        children[pid] = fds[1]
        os.close(fds[0])
        os.close(fds[2])
        conn.sendall(_PID.pack(pid))
    except (OSError, ValueError, pickle.PickleError, struct.error) as e:
        log.warning("bad request to the engine host forker: %s", e)
    finally:
        if conn not in sessions:
            conn.close()
    return False


def _fork(request: tuple, fds: list[int], mine: tuple, children: dict[int, int]) -> int:
    conn_fd, status_w, stderr_fd = fds
    pid = os.fork()
    if pid:
        return pid
    try:   # the host: none of the forker's files, the worker's stderr, default signals
        for obj in mine:
            obj.close()
        for fd in (*children.values(), status_w):
            os.close(fd)
        os.dup2(stderr_fd, 2)
        os.close(stderr_fd)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        from multiprocessing.connection import Connection

        from pivotrl_hpc.runtime import engine_host_child

        engine_host_child.run(Connection(conn_fd), *request)
    finally:
        os._exit(1)


def _reap(children: dict[int, int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        fd = children.pop(pid, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.write(fd, _PID.pack(os.waitstatus_to_exitcode(status)))
            os.close(fd)


def main(argv: list[str]) -> None:
    os.dup2(2, 1)   # vLLM logs to stdout; a worker's stdout is data
    logging.basicConfig(level=logging.WARNING, force=True,
                        format="%(asctime)s [engine host forker] %(levelname)s: %(message)s")
    serve(socket.socket(fileno=int(argv[0])))


if __name__ == "__main__":
    main(sys.argv[1:])
