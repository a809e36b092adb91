"""The node's control segment: per model the current version and the live versions, behind a
seqlock; and version pins as `flock` shared locks on the segment files.

Layout of `pivotrl-<job>-<node>-ctl` (4 KiB): a 64-byte head (magic, agent pid, group size
k, closed flag, the agent's start time in clock ticks, its socket token: 16 bytes), then one
256-byte slot per model: name (64 B), seq (u64), current+1 (u64), 16 live
versions+1 (u64 each; 0 = empty). Only the node agent writes; it bumps `seq` to odd, writes,
bumps to even (a seqlock). Readers retry while `seq` is odd or changed under them, so they never
act on a half-updated slot. x86 keeps stores in program order, and CPython performs the
`struct.pack_into` stores in order, which is all a single-writer seqlock needs. But
`struct.pack_into` zeroes its target before packing, so the counter itself is stored and loaded
as one 8-byte word (a u64 memoryview): through `pack_into` it would pass through 0, an even
value a reader could match before and after a whole write (a torn read).

Other CPUs (aarch64: Grace Hopper nodes) may reorder stores and loads, and CPython gives no
fences, so there the slot is read and written under an flock of the control file instead
(`LOCKED`: shared for readers, exclusive for the agent; microseconds, never held across a
call). PIVOTRL_GPS_SEQLOCK=lock forces that path on x86 (tested), =seqlock the lock-free one.

Pin protocol (why readers never see a mix of versions, and freed memory is never read):
reader: read (current, live) -> open the segment file of `current` -> flock(LOCK_SH) ->
re-read live -> if the version is still live it is pinned, else unlock and retry. Agent, to
free or recycle a version: flock(LOCK_EX | LOCK_NB) on its own descriptor -> mark it not live
-> unlink or rename the file -> unlock. The kernel drops a dead reader's lock, so `kill -9` of
a reader leaves nothing pinned and nothing corrupt (readers map read-only).

Who the agent is (issue 35): its pid *and* start time are in the head, so a client checks
liveness through a pidfd of exactly that process (`AgentWatch`): a zombie counts as dead, and a
pid recycled by another process after the agent died is never taken for the agent.
"""
from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import platform
import secrets
import select
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from pivotrl_hpc import envs
from pivotrl_hpc.gps.shmdir import reserve_file

MAGIC = 0x5350474C52544F56  # "VOTRLGPS"
SIZE = 4096
_HEAD = 64
_SLOT = 256
MAX_MODELS = (SIZE - _HEAD) // _SLOT
MAX_LIVE = 16
_NAME = 64
_TOKEN = 16


_MODE = envs.GPS_SEQLOCK.get()
LOCKED = _MODE == "lock" or (_MODE == "auto" and platform.machine().lower() not in
                             ("x86_64", "amd64", "i386", "i686"))
STALL_S = 5.0        # a seqlock odd this long: its writer died mid-publish
CHECK_EVERY_S = 0.05  # how often a waiting client checks that the agent is alive


class GPSUnavailable(ConnectionError):
    """The node's GPS agent is gone (killed, or shut down): nothing more will be published."""


@dataclass(frozen=True)
class ModelState:
    current: int | None
    live: tuple[int, ...]


class ControlNotReady(RuntimeError):
    """The control file is shorter than a control segment: not whole yet (or left so by a
    crash). Clients retry until their deadline (gps.client retries RuntimeError)."""


class ControlBlock:
    """Attach to (or, for the agent, create) the node's control segment."""

    def __init__(self, path: Path, create: bool = False, group_size: int = 1,
                 token: str = "", dir_fd: int | None = None):
        """`dir_fd`: the GPS folder's descriptor; `path.name` is then opened in it."""
        self.path = Path(path)
        tmp = None
        if create:
            fd, tmp = _create(self.path, dir_fd)
        else:
            fd = os.open(self.path.name if dir_fd is not None else self.path,
                         os.O_RDWR | os.O_NOFOLLOW, dir_fd=dir_fd)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                raise PermissionError(f"{self.path} is not a GPS control segment of uid "
                                      f"{os.getuid()} (uid {st.st_uid}, {st.st_size} bytes)")
            if st.st_size < SIZE:
                raise ControlNotReady(f"{self.path} holds {st.st_size} of a control "
                                      f"segment's {SIZE} bytes")
            self.mm = mmap.mmap(fd, SIZE)
        except BaseException:
            os.close(fd)
            if tmp is not None:
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        self._fd = fd   # kept: the flock of the LOCKED path
        self._words = memoryview(self.mm).cast("Q")  # single 8-byte loads and stores
        self.raced_reads = 0  # state() calls that met a write in progress and retried
        self._slots: dict[str, int] = {}
        self._watch: AgentWatch | None = None
        if create:
            tok = token.encode()[:_TOKEN].ljust(_TOKEN, b"\0")
            struct.pack_into(f"<QQQQQ{_TOKEN}s", self.mm, 0, MAGIC, os.getpid(), group_size,
                             0, start_time(os.getpid()) or 0, tok)
            try:   # whole now: only from here on can another process open it by its name
                _link_into_place(self.path, tmp, dir_fd)
            except BaseException:
                self.close()
                raise
        elif struct.unpack_from("<Q", self.mm, 0)[0] != MAGIC:
            self.close()
            raise RuntimeError(f"{self.path} is not a GPS control segment")

    @property
    def agent_pid(self) -> int:
        return struct.unpack_from("<Q", self.mm, 8)[0]

    @property
    def group_size(self) -> int:
        return struct.unpack_from("<Q", self.mm, 16)[0]

    @property
    def token(self) -> str:
        """The random part of the agent's socket name (agent.socket_address)."""
        return bytes(self.mm[40:40 + _TOKEN]).rstrip(b"\0").decode("ascii", "replace")

    def mark_closed(self) -> None:
        """Agent only, before it deletes anything: clients stop waiting at once."""
        self._words[3] = 1

    def check_agent(self) -> None:
        """Raise GPSUnavailable when the agent has shut down or its process is gone."""
        if self._words[3]:
            raise GPSUnavailable(f"the GPS agent of {self.path.name} has shut down")
        pid, born = self.agent_pid, self._words[4]
        if self._watch is None or self._watch.pid != pid:
            if self._watch is not None:
                self._watch.close()
            self._watch = AgentWatch.open(pid, born)
        if self._watch is None or not self._watch.alive():
            raise GPSUnavailable(f"the GPS agent of {self.path.name} (pid {pid}) is gone")

    def agent_state(self) -> str:
        """The agent process's state letter and meaning, for error messages."""
        return process_state(self.agent_pid)

    def models(self) -> list[str]:
        out = []
        for i in range(MAX_MODELS):
            raw = bytes(self.mm[_HEAD + i * _SLOT: _HEAD + i * _SLOT + _NAME]).rstrip(b"\0")
            if raw:
                out.append(raw.decode())
        return out

    def _slot(self, model: str, create: bool = False) -> int:
        """The model's slot offset; slots never move or go, so found ones are cached."""
        off = self._slots.get(model)
        if off is None:
            off = self._slots[model] = self._find_slot(model, create)
        return off

    def _find_slot(self, model: str, create: bool) -> int:
        key = model.encode()
        for i in range(MAX_MODELS):
            off = _HEAD + i * _SLOT
            raw = bytes(self.mm[off: off + _NAME]).rstrip(b"\0")
            if raw == key:
                return off
            if not raw and create:
                self.mm[off: off + _NAME] = key.ljust(_NAME, b"\0")
                return off
        raise KeyError(f"model {model!r} is not in the GPS control segment {self.path}")

    @contextlib.contextmanager
    def _locked(self, how: int):
        if not LOCKED:
            yield
            return
        fcntl.flock(self._fd, how)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def state(self, model: str) -> ModelState:
        """Consistent snapshot of a model's versions (seqlock read)."""
        if not LOCKED:   # the hot path (every pin and wait): no context manager
            return self._state(model)
        with self._locked(fcntl.LOCK_SH):
            return self._state(model)

    def _state(self, model: str) -> ModelState:
        off = self._slot(model) + _NAME
        raced, start, checked = False, time.monotonic(), 0.0
        while True:
            seq = self._words[off // 8]
            if not seq & 1:
                vals = struct.unpack_from(f"<Q{MAX_LIVE}Q", self.mm, off + 8)
                if self._words[off // 8] == seq:
                    self.raced_reads += raced
                    cur = vals[0] - 1 if vals[0] else None
                    return ModelState(cur, tuple(sorted(v - 1 for v in vals[1:] if v)))
            raced = True
            # a writer holds the lock for microseconds; longer means it may be dead: back off
            # from yielding to sleeping, check the agent, and give up after STALL_S
            waited = time.monotonic() - start
            if waited > 0.001:
                if waited - checked > CHECK_EVERY_S:
                    checked = waited
                    self.check_agent()
                if waited > STALL_S:
                    raise GPSUnavailable(f"{model}'s slot in {self.path.name} stayed locked "
                                         f"for {STALL_S:.0f} s: its writer died mid-publish")
                time.sleep(0.001)
            else:
                time.sleep(0)

    def sequence(self, model: str) -> int:
        """The slot's seqlock counter: odd while the agent writes it."""
        return self._words[(self._slot(model) + _NAME) // 8]

    def publish(self, model: str, current: int | None, live: tuple[int, ...]) -> None:
        """Agent only: set the current version and the live set in one seqlock write."""
        if len(live) > MAX_LIVE:
            raise RuntimeError(f"more than {MAX_LIVE} live versions of {model}")
        i = (self._slot(model, create=True) + _NAME) // 8
        padded = [v + 1 for v in live] + [0] * (MAX_LIVE - len(live))
        with self._locked(fcntl.LOCK_EX):
            seq = self._words[i]
            self._words[i] = seq + 1
            struct.pack_into(f"<Q{MAX_LIVE}Q", self.mm, i * 8 + 8,
                             0 if current is None else current + 1, *padded)
            self._words[i] = seq + 2

    def close(self) -> None:
        if self._fd < 0:
            return
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        self._words.release()
        self.mm.close()
        os.close(self._fd)
        self._fd = -1


def _create(path: Path, dir_fd: int | None) -> tuple[int, str]:
    """The control file made whole under a temporary name in the folder (`<name>.tmp-<hex>`,
    a job file the epilog sweeps): created and allocated (not ftruncated: a full shm is an
    error here, no SIGBUS later); its fd and that name. `_link_into_place` names it once it
    is initialised (issue 47: a client that opened the name between a create and a size saw
    0 bytes and gave up)."""
    tmp = f"{path.name}.tmp-{secrets.token_hex(4)}"
    where = tmp if dir_fd is not None else str(path.with_name(tmp))
    fd = os.open(where, os.O_RDWR | os.O_NOFOLLOW | os.O_CREAT | os.O_EXCL, 0o600,
                 dir_fd=dir_fd)
    try:
        reserve_file(fd, path, 0, SIZE)
    except BaseException:
        os.close(fd)
        os.unlink(where, dir_fd=dir_fd)
        raise
    return fd, where


def _link_into_place(path: Path, tmp: str, dir_fd: int | None) -> None:
    """Give the whole file its name (EEXIST if the name is taken: the O_EXCL of before) and
    drop the temporary one."""
    name = path.name if dir_fd is not None else str(path)
    try:
        os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    finally:
        os.unlink(tmp, dir_fd=dir_fd)


def live_agent(path: Path) -> int | None:
    """The pid of a live agent serving the control segment at `path` (another process than
    this one, not marked closed), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        head = os.pread(fd, 40, 0)
    finally:
        os.close(fd)
    if len(head) < 40:
        return None
    magic, pid, _, closed, born = struct.unpack("<QQQQQ", head)
    if magic != MAGIC or closed or pid == os.getpid():
        return None
    watch = AgentWatch.open(pid, born)
    if watch is None:
        return None
    try:
        return pid if watch.alive() else None
    finally:
        watch.close()


def _stat(pid: int) -> list[bytes] | None:
    """/proc/<pid>/stat from field 3 (the state) on; None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rindex(b")") + 2:].split()   # after the name, which may hold anything


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): with
    the pid, a name for one process that a recycled pid does not match; None if gone."""
    fields = _stat(pid)
    return None if fields is None else int(fields[19])


_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped",
           "t": "stopped by a debugger", "Z": "a zombie", "X": "dead"}


def process_state(pid: int) -> str:
    fields = _stat(pid)
    if fields is None:
        return "gone"
    st = fields[0].decode()
    return f"{st} ({_STATES.get(st, 'unknown state')})"


class AgentWatch:
    """A pidfd on the agent: readable once the process has exited (a zombie included), and
    bound to that process, so a recycled pid can never pass for it."""

    def __init__(self, pid: int, fd: int):
        self.pid, self.fd = pid, fd
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    @classmethod
    def open(cls, pid: int, born: int) -> "AgentWatch | None":
        """A watch on `pid` if it is the process started at `born` (0: unknown, not checked)
        and still runs; else None."""
        try:
            fd = os.pidfd_open(pid)
        except (ProcessLookupError, ValueError, OverflowError):
            return None
        # after the pidfd: a start time that matches now names the process the fd holds
        if born and start_time(pid) != born:
            os.close(fd)
            return None
        return cls(pid, fd)

    def alive(self) -> bool:
        return self.fd >= 0 and not self._poll.poll(0)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def lock_shared(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_SH)


def try_lock_exclusive(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def unlock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
