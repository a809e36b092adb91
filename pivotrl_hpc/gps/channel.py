"""A GPSClient's connection to its node agent: who the agent is, deadlines, notices.

The listener must be the job's user and the agent the control file names (SO_PEERCRED uid and
pid; the pid still the agent's own process by its pidfd and start time, control.AgentWatch).
Every request has a deadline (`request_s`, PIVOTRL_GPS_REQUEST_S) and, while it waits, the
agent is checked every _SLICE_S: a dead, zombie or stopped agent, a lost connection or a missed
deadline is a GPSUnavailable naming the cause (a stopped agent after STOPPED_S; a full listen
backlog is retried until the deadline). Requests are answered in order; `replicated` and
`write_failed` notices of Writes arrive unasked and are kept until their handle asks.
"""
from __future__ import annotations

import json
import os
import socket
import time

from pivotrl_hpc import envs
from pivotrl_hpc.gps import control
from pivotrl_hpc.gps.agent import socket_address
from pivotrl_hpc.gps.conns import peer_credentials
from pivotrl_hpc.gps.control import GPSUnavailable

REQUEST_S = envs.GPS_REQUEST_S.get()
NOTICES = ("replicated", "write_failed")   # a Write's end, sent to its writers unasked
_SLICE_S = 0.05   # how often a waiting request checks that the agent still lives
STOPPED_S = 5.0   # an agent stopped this long fails the requests waiting on it


class AgentChannel:
    def __init__(self, job: str, node: str, ctl: control.ControlBlock, request_s: float):
        self.job, self.node, self.ctl, self.request_s = job, node, ctl, request_s
        self._sock: socket.socket | None = None
        self._buf = b""
        self._stopped_since: float | None = None
        self.notices: dict[tuple[str, int], dict] = {}   # (model, version) -> replicated

    def connect(self) -> socket.socket:
        if self._sock is None:
            self.ctl.check_agent()
            s = self._connect(time.monotonic() + self.request_s)
            self._sock, self._buf = s, b""
            self.request({"op": "hello", "token": self.ctl.token}, "hello")
        return self._sock

    def _connect(self, deadline: float) -> socket.socket:
        """A connection to the agent. A full listen backlog (EAGAIN: a unix socket does not
        queue a non-blocking connect) is retried until `deadline` while the agent lives and
        runs: other processes churning connections must not fail the job's (issue 46)."""
        pause = 0.001
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.settimeout(max(deadline - time.monotonic(), 0.01))
                s.connect(socket_address(self.job, self.node, self.ctl.token))
                self._authenticate(s)
                return s
            except GPSUnavailable:
                s.close()
                raise
            except BlockingIOError as e:   # EAGAIN: the backlog is full for now
                s.close()
                if time.monotonic() > deadline:
                    raise self._unavailable(f"cannot connect: the agent's listen backlog "
                                            f"stayed full for {self.request_s:.0f} s "
                                            f"({e})") from None
                self.check_running()
                time.sleep(pause)
                pause = min(pause * 2, _SLICE_S)
            except OSError as e:
                s.close()
                raise self._unavailable(f"cannot connect: {type(e).__name__}: {e}") from None

    def check_running(self) -> None:
        """`ctl.check_agent` (alive), and not stopped (SIGSTOP, a debugger) for over
        STOPPED_S: a stopped agent answers nothing, and a request would otherwise hold its
        caller for the whole deadline (issue 46)."""
        self.ctl.check_agent()
        state = control.process_state(self.ctl.agent_pid)
        if state[:1] not in ("T", "t"):
            self._stopped_since = None
            return
        now = time.monotonic()
        if self._stopped_since is None:
            self._stopped_since = now
        elif now - self._stopped_since > STOPPED_S:
            raise GPSUnavailable(f"the GPS agent of {self.job} on {self.node} (pid "
                                 f"{self.ctl.agent_pid}) is {state} for over {STOPPED_S:.0f} "
                                 "s: it cannot answer (SIGCONT it, or stop the job)")

    def _authenticate(self, s: socket.socket) -> None:
        """The listener must be the job's user and the agent the control file names."""
        pid, uid, _ = peer_credentials(s)
        want = self.ctl.agent_pid
        if uid != os.getuid() or pid != want:
            raise GPSUnavailable(f"the process at the GPS agent's socket of {self.job} on "
                                 f"{self.node} is pid {pid}, uid {uid}, not the agent (pid "
                                 f"{want}, uid {os.getuid()}): refused")
        self.ctl.check_agent()   # that pid is still the agent's own process (pidfd)

    def _unavailable(self, what: str) -> GPSUnavailable:
        """GPSUnavailable for a failed request, naming why the agent failed if it did."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        try:
            self.ctl.check_agent()
        except GPSUnavailable as e:
            return GPSUnavailable(f"{e} ({what})")
        return GPSUnavailable(f"GPS agent of {self.job} on {self.node} (pid "
                              f"{self.ctl.agent_pid}, {self.ctl.agent_state()}): {what}")

    def recv(self, timeout: float) -> dict | None:
        """The next message, or None after `timeout`; checks the agent every _SLICE_S."""
        sock = self.connect()
        end = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = end - time.monotonic()
            if left <= 0:
                return None
            sock.settimeout(min(left, _SLICE_S))
            try:
                data = sock.recv(1 << 16)
            except (socket.timeout, BlockingIOError):
                try:
                    self.check_running()
                except GPSUnavailable as e:
                    raise self._unavailable(str(e)) from None
                continue
            except OSError as e:
                raise self._unavailable(f"connection lost: {type(e).__name__}: {e}") from None
            if not data:
                raise self._unavailable("the agent closed the connection")
            self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def request(self, msg: dict, expect: str, timeout: float | None = None) -> dict:
        sock = self.connect()
        limit = self.request_s if timeout is None else timeout
        deadline = time.monotonic() + limit
        try:
            sock.settimeout(limit)
            sock.sendall(json.dumps(msg).encode() + b"\n")
        except OSError as e:
            raise self._unavailable(f"{msg['op']} not sent: {type(e).__name__}: {e}") from None
        while True:
            reply = self.recv(deadline - time.monotonic())
            if reply is None:
                raise self._unavailable(f"no answer to {msg['op']} within {limit:g} s")
            if reply["op"] in NOTICES:
                self._notice(reply)
            elif reply["op"] == "error":
                raise RuntimeError(f"GPS agent: {reply['error']}")
            elif reply["op"] == expect:
                return reply

    def take_replicated(self, model: str, version: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while (model, version) not in self.notices:
            left = deadline - time.monotonic()
            reply = self.recv(max(left, 1e-4) if timeout else 1e-4)
            if reply is None:
                if left <= 0:
                    return False
                continue
            if reply["op"] in NOTICES:
                self._notice(reply)
        return True  # notices stay: several handles of one client may share a version

    def _notice(self, reply: dict) -> None:
        self.notices[reply["model"], reply["version"]] = reply

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
