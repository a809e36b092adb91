"""One fork server of engine hosts per node: the host forker.

Why: importing vLLM and the engine adapter costs an engine host 5 CPU-s. Each worker used to
run its own fork server that imported them once (stdlib `multiprocessing` forkserver, which
only the process that started it can use), so a node of G devices imported vLLM G times at
the job's start, all at once: on a 2-core machine a 2 x 4 job spent ~15 s of its start-up on
six of those eight imports. The forker is one process per node, shared by every worker there.

- Address: an abstract unix socket (no file to clean), `node_address`: the job's uid, job,
  node and a per-job random token (drawn by the controller's rank, sent to every rank over
  MPI), in PIVOTRL_HOST_FORKER, set by the launcher per worker. Unset (tests, benchmarks), a
  process has a private forker of its own, named with its pid and a random token.
- Trust (issue 35, N1/N2): both ends check the other's SO_PEERCRED before they send anything:
  the forker serves only the job's uid; a worker talks only to a forker of its own uid (the
  one that started it: to the listener it bound itself) and otherwise raises
  `ForkerRefused` naming the holder. Requests are typed (`FORKER_WIRE`, JSON: never pickle),
  the fds go by SCM_RIGHTS. See docs/security.md.
- Start: the first worker that binds the address starts the forker (a fresh interpreter, not a
  fork of an MPI rank) and hands it the bound socket; the others find the address in use and
  connect. Connections queue while it imports; it answers once it has.
- A worker holds a session (one connection) for its life; the forker leaves when no session
  is open and every host it forked is gone, and closes its listener first, so the name is
  free at once for a new forker; a session that reached it meanwhile is reset unanswered,
  and its worker starts a new forker (`server_pid`, issue 47). While it imports it dies with
  its starter (parent death signal). SIGTERM / SIGHUP / SIGINT are ignored (Slurm signals
  every process of the step; the workers decide when hosts stop). The server side is
  `host_forker_server`.
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
import pwd
import secrets
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

from pivotrl_hpc import envs
from pivotrl_hpc.protocol.wire import Codec
from pivotrl_hpc.runtime.peer import peer

log = logging.getLogger(__name__)

ADDRESS_ENV = envs.HOST_FORKER.name
PID = struct.Struct("q")
REQUEST_LEN = struct.Struct("I")
MAX_REQUEST = 1 << 20      # a fork request (the host's environment) is far smaller
SESSION, FORK = b"S", b"F"
CONNECT_TIMEOUT_S = 30.0   # another worker bound the address and is starting the forker
ORPHAN_S = 120.0           # a forker no session ever reached, its starter alive, leaves
UNKNOWN_EXIT = 255         # the forker died before it could report a host's exit
LEAVING_RETRIES = 5        # sessions a leaving forker closed unanswered, before giving up
_PRIVATE_TOKEN = secrets.token_hex(8)


@dataclass(frozen=True)
class ForkRequest:
    """Fork an engine host: `engine_host_child.run(conn, worker_pid, name, env)`."""
    worker_pid: int
    name: str
    env: dict[str, str]

    def __post_init__(self) -> None:
        if not (isinstance(self.worker_pid, int) and isinstance(self.name, str)
                and isinstance(self.env, dict)
                and all(isinstance(k, str) and isinstance(v, str)
                        for k, v in self.env.items())):
            raise ValueError("a fork request is (int pid, str name, dict of str to str)")


FORKER_WIRE = Codec(ForkRequest)


class ForkerRefused(RuntimeError):
    """The forker's address is held by a process this worker does not trust."""
    exit_code = 2   # a refusal, not a crash: the launchers end the job with 2 (launch/entry.py)


def node_address(job: str, node: str, token: str) -> str:
    """The node's forker of a job: the uid (two users' jobs of one name never meet) and
    the job's random token (another account cannot bind it first: it cannot guess it)."""
    return f"pivotrl-u{os.geteuid()}-{job}-{node}-{token}-hosts"


def address() -> str:
    return (envs.HOST_FORKER.raw()
            or f"pivotrl-u{os.geteuid()}-pid{os.getpid()}-{_PRIVATE_TOKEN}-hosts")


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
    has; returns at once (the forker may still be importing). `ForkerRefused` if another
    account holds the address."""
    name = address()
    if _Session.sock is not None and _Session.name == name:
        return
    leave()
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    started = False
    while True:
        try:
            sock = _connect(name, os.getpid() if started else None)
            break
        except ConnectionRefusedError:
            started = _start(name)
            if not started and time.monotonic() > deadline:
                raise RuntimeError(f"no engine host forker at {name!r} after "
                                   f"{CONNECT_TIMEOUT_S:.0f} s (the name is bound but "
                                   "nobody listens: another process may hold it)") from None
            time.sleep(0 if started else 0.05)
    sock.sendall(SESSION)
    _Session.sock, _Session.name, _Session.pid = sock, name, None


def server_pid() -> int:
    """The forker's pid (waits until it has imported vLLM and taken this session). A forker
    that was leaving when the session reached it closes its listener and the session with
    it, unanswered (issue 47): then this process starts (or finds) a new one. From here on
    the forker stays while the session is open."""
    for attempt in range(LEAVING_RETRIES + 1):
        ensure_running()
        if _Session.pid is not None:
            break
        try:
            _Session.pid = PID.unpack(recv_exact(_Session.sock, PID.size))[0]
        except ConnectionError as e:
            if attempt == LEAVING_RETRIES:
                raise ConnectionError(f"engine host forker {_Session.name!r} closed the "
                                      f"session unanswered {attempt + 1} times: {e}") from None
            log.info("engine host forker %s was leaving (%s): asking a new one",
                     _Session.name, e)
            leave()
    return _Session.pid


def leave() -> None:
    """Close this process's session (a worker's end): the forker leaves once no session is
    open and its hosts are gone."""
    if _Session.sock is not None:
        _Session.sock.close()
    _Session.sock = _Session.name = _Session.pid = None
    if _Session.child is not None and _Session.child.poll() is not None:
        _Session.child = None   # reaped


def _connect(name: str, binder: int | None = None) -> socket.socket:
    """A connection to the forker of `name`, once the kernel says who listens there: this
    account (and `binder`, the process that bound it, when this one did)."""
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.connect(_abstract(name))
        _check_forker(sock, name, binder)
    except BaseException:
        sock.close()
        raise
    return sock


def _check_forker(sock: socket.socket, name: str, binder: int | None) -> None:
    holder = peer(sock.fileno())   # the process that called listen() on the name
    if holder.uid != os.geteuid():
        raise ForkerRefused(
            f"the engine host forker's address {name!r} is held by another account: "
            f"{_user(holder.uid)} (uid {holder.uid}), pid {holder.pid}; this worker runs as "
            f"{_user(os.geteuid())} and sends it nothing (its environment, pipes and "
            "files stay here). Ask an administrator to stop that process.")
    if binder is not None and holder.pid != binder:
        raise ForkerRefused(f"the engine host forker's address {name!r} is held by pid "
                            f"{holder.pid}, not by this process ({binder}) that bound it")


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _start(name: str) -> bool:
    """Bind the address and start the forker on it; False if another process holds it."""
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(_abstract(name))
    except OSError:
        listener.close()
        return False
    from pivotrl_hpc.runtime.host_wire import world_free

    with listener:
        listener.listen(64)
        env = {k: v for k, v in os.environ.items() if world_free(k)}
        # the starting thread's end kills it while it imports (PR_SET_PDEATHSIG): the
        # callers start it from the worker's main thread
        _Session.child = subprocess.Popen(
            [sys.executable, "-m", "pivotrl_hpc.runtime.host_forker_server",
             str(listener.fileno()), str(os.getpid())],
            pass_fds=[listener.fileno()], env=env, stdin=subprocess.DEVNULL)
    from pivotrl_hpc.runtime import cgroup

    cgroup.leave_caps(_Session.child.pid)   # a restart by a capped worker: not its device
    log.info("engine host forker %s: pid %d", name, _Session.child.pid)
    return True


def fork_host(worker_pid: int, name: str, env: dict[str, str], conn_fd: int) -> ForkedHost:
    """Fork an engine host (`engine_host_child.run(conn, worker_pid, name, env)`) from this
    node's forker; `conn_fd` is the host's end of its pipe (the caller closes its copy)."""
    status_r, status_w = os.pipe()
    try:
        with _fork_connection() as sock:
            payload = FORKER_WIRE.encode(ForkRequest(worker_pid, name, env))
            socket.send_fds(sock, [FORK + REQUEST_LEN.pack(len(payload)) + payload],
                            [conn_fd, status_w, sys.stderr.fileno()])
            pid = PID.unpack(recv_exact(sock, PID.size))[0]
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
    host = ForkedHost(pid, status_r)
    from pivotrl_hpc.runtime import cgroup

    cgroup.follow(pid)
    return host


def _fork_connection() -> socket.socket:
    """A connection to the forker of this process's session. A forker that took the session
    stays until it ends, so no reset can come after this; one that is gone (killed: the
    connection is refused, nothing was sent) is replaced by a new one."""
    server_pid()
    try:
        return _connect(_Session.name)
    except ConnectionRefusedError:
        log.warning("engine host forker %s (pid %s) is gone: starting a new one",
                    _Session.name, _Session.pid)
        leave()
        server_pid()
        return _connect(_Session.name)


def recv_exact(sock: socket.socket, n: int) -> bytes:
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
            if not readable(self._status, timeout):
                return
            data = os.read(self._status, PID.size)
            os.close(self._status)
            self._status = None
            if len(data) == PID.size:
                self._exitcode = PID.unpack(data)[0]
                self._close()
                return
            log.warning("engine host forker gone before host %d ended", self.pid)
        if self._pidfd is None or readable(self._pidfd, timeout):
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


def readable(fd: int, timeout: float | None = 0.0) -> bool:
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        return bool(sel.select(timeout))
