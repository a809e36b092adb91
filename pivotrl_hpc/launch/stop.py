"""Stopping a rank in order: stop signals, the watchdog, the launcher watch, polled barriers.

Used by entry.py on every rank (mpirun and srun alike).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("pivotrl_hpc.launch")

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
LOST_S = 1.0   # a stop signal this old that has not reached the controller's loop was lost


class Interrupted(KeyboardInterrupt):
    """Raised in the controller's thread by a stop signal (not an Exception: a controller's
    `except Exception` must not swallow it)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class Stopper:
    """Remembers the first stop signal, interrupts the controller once, arms the watchdog.

    Python runs signal handlers in the main thread only, between bytecodes: a worker blocked
    in MPI recv would never run one. The C-level handler also writes the signal number to the
    wakeup fd at once, so a watcher thread arms the watchdog whatever the main thread does.

    The controller's loop also calls `check` between iterations: the handler's exception can
    be lost (raised while the main thread runs a finalizer or a C callback, Python only prints
    it) and the handler can be kept from running at all; the loop then stops itself, LOST_S
    late, instead of running to its end. A stop the controller deferred (a grace-time
    checkpoint, controller.live) sets `deferred` and is not lost."""

    def __init__(self, grace_s: float, on_expire: Callable[[int], None] | None = None):
        self.grace_s = grace_s
        self.signum: int | None = None
        self.noticed_at = 0.0               # monotonic seconds of the first stop signal
        self.handled = False                # the Python handler ran (not only the wakeup fd)
        self.deferred = False               # the controller takes the stop in its own time
        self.interruptible = False          # True while the controller runs
        self.cleanups: list[Callable[[], None]] = []
        self._on_expire = on_expire
        self._lock = threading.Lock()

    def install(self) -> None:
        for sig in SIGNALS:
            signal.signal(sig, self._on_signal)
        # USR1 / USR2 are for rank 0 (a checkpoint, controller.live) and the batch step
        # (the time limit, launch.slurm; submitit): on any other rank they must not kill it,
        # as they would by default when a user signals every task (`scancel --signal`).
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_IGN)
        r, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(r,), name="signal-watch", daemon=True).start()

    def _watch(self, fd: int) -> None:
        while True:
            for signum in os.read(fd, 64):
                if signum in SIGNALS:
                    self._notice(signum)

    def _notice(self, signum: int) -> None:
        with self._lock:
            if self.signum is not None:
                return
            self.signum, self.noticed_at = signum, time.monotonic()
        log.warning("got %s: stopping the job (grace %.0f s)", signal.Signals(signum).name,
                    self.grace_s)
        t = threading.Timer(self.grace_s, self._expire)
        t.daemon = True
        t.start()

    def _on_signal(self, signum, _frame) -> None:
        self._notice(signum)
        self.handled = True
        if self.interruptible:
            self.interruptible = False
            raise Interrupted(signum)

    def check(self) -> None:
        """Between the controller's iterations: raise the stop signal's `Interrupted` if the
        signal came LOST_S ago and the loop still runs (see the class)."""
        if self.signum is None or self.deferred or time.monotonic() - self.noticed_at < LOST_S:
            return
        log.error("%s came %.1f s ago and the controller still runs (%s): stopping it now",
                  signal.Signals(self.signum).name, time.monotonic() - self.noticed_at,
                  "its interrupt was lost" if self.handled else "its handler never ran")
        self.interruptible = False
        raise Interrupted(self.signum)

    def run_cleanups(self) -> None:
        while self.cleanups:
            fn = self.cleanups.pop()
            try:
                fn()
            except Exception:  # every cleanup gets its turn
                log.exception("cleanup %r failed", fn)

    def _expire(self) -> None:
        signum = self.signum or signal.SIGTERM
        log.error("still running %.0f s after %s: exiting now", self.grace_s,
                  signal.Signals(signum).name)
        if self._on_expire is not None:
            self._on_expire(signum)
        self.run_cleanups()
        logging.shutdown()
        os._exit(128 + signum)


def wait_barrier(comm, what: str, timeout: float | None = None) -> None:
    """A barrier that keeps signal handlers running (polled, not blocking in C)."""
    req = comm.Ibarrier()
    deadline = None if timeout is None else time.monotonic() + timeout
    while not req.Test():
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not every rank arrived within {timeout:.0f} s")
        time.sleep(0.05)  # a whole job's wait on the agent ranks: Test drives MPI progress


def watch_launcher(pid: int) -> None:
    """`pivotrl run` died (even by SIGKILL, which it cannot forward): stop as on SIGTERM,
    rather than leave mpirun and the ranks orphaned."""
    while True:
        time.sleep(1.0)
        try:
            alive = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (FileNotFoundError, IndexError):
            alive = False
        if not alive:
            log.warning("the launcher (pid %d) is gone: stopping", pid)
            os.kill(os.getpid(), signal.SIGTERM)
            return
