"""An inference engine in a long-lived child process of the device worker: the engine host.

Why: vLLM builds its process groups over torch's whole default world (collectively), so it
cannot live in a worker whose world is the trainer's (it hangs; see the emulation notes).
The host owns one `VLLMEngine` with a torch world of its own: none shared for TP = 1 (vLLM
makes a private 1-rank one), and for TP > 1 exactly the replica's hosts (RANK = TP rank,
`external_launcher`), built once and preserved across shifts. Shift down and shift up stay
inside the host (sleep / wake: vLLM's on GPU, `cpu_sleep` on CPU), so a shift pays no
process start and no engine build. The host Reads its parameters from GPS shared memory
itself (`GPSRead`).

Protocol: [method, args] over a socketpair that only the worker and its host hold, in the
typed format of `wire` (`HOST_WIRE`: JSON of the engine's dataclasses, never pickle: bytes
that came from anywhere else cannot run code on either side); every reply carries the
engine's `awake`, running count and the GPS version last read. A dead child or a call past
its timeout raises `EngineHostError` naming the host, never hangs; the child exits when its
worker dies (pipe EOF, or a watchdog on the worker's pidfd). Hosts fork from their node's
host forker, which imported vLLM once for every worker there (`host_forker`), not each from a
fresh interpreter. TP > 1 hosts are driven SPMD: each gets the same command stream (`spmd`
drives several from one process).
"""
from __future__ import annotations

import builtins
import contextlib
import logging
import os
import signal
import time
from multiprocessing import Pipe
from pathlib import Path
from typing import Any, Sequence

from pivotrl_hpc import envs
from pivotrl_hpc.protocol.engine import (AbortedSequence, EngineOptions, EngineState, Sampling,
                                         StepOutput)
from pivotrl_hpc.runtime import host_forker
# The host's vocabulary lives below both ends of the pipe; re-exported for callers.
from pivotrl_hpc.runtime.host_wire import (HOST_WIRE, GPSRead, TPWorld,  # noqa: F401
                                           remove_shm, shm_prefix, world_free)
from pivotrl_hpc.protocol.wire import WireError

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]


class EngineHostError(RuntimeError):
    """The host process died, timed out or is closed."""


class EngineHost:
    """A `VLLMEngine` in a child process; the worker's interface on an in-process engine."""

    def __init__(self, model_dir: str | Path, options: EngineOptions | None = None,
                 read: GPSRead | None = None, *, world: TPWorld | None = None,
                 name: str | None = None, timeout_s: float = 120.0,
                 start_timeout_s: float = 600.0, wait: bool = True, start: bool = True):
        """`start=False`: only spawn the process and import vLLM (a job's start-up, before
        the device's CPU cap); `start(read)` builds the engine on first use."""
        self.model_dir = Path(model_dir)
        self.options = engine_options_for(options or EngineOptions(), world)
        self.world = world
        self.name = name or self.model_dir.name
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self.version: int | None = None   # GPS version of the parameters loaded last
        self._awake, self._running = False, 0
        self._pending: str | None = None
        self._closed = False
        self._t_spawn = time.perf_counter()
        self._proc, self._conn = self._spawn()
        self._start_phases: dict[str, float] | None = None
        self.started = start
        if not start:
            self.submit("preload")
            return
        self.submit("start", self.model_dir, self.options, read, world)
        if wait:
            self.wait_started()

    def start(self, read: GPSRead | None = None) -> dict[str, float]:
        """Build the engine of a preloaded host (waits for the preload first)."""
        if self.started:
            raise EngineHostError(f"engine host {self.name} is already started")
        preload_s = self.result() if self._pending == "preload" else 0.0
        self.started = True
        phases = self.call("start", self.model_dir, self.options, read, self.world)
        self._start_phases = {"host_preload": preload_s, **phases}
        return self._start_phases

    def preloaded(self) -> float:
        """Wait for the preload (imports) to finish; its seconds."""
        return self.result() if self._pending == "preload" else 0.0

    def wait_started(self) -> dict[str, float]:
        """Wait for the engine to be up; a failed start closes the host and raises."""
        try:
            return self.start_phases
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ process
    def _spawn(self):
        parent, child = Pipe(duplex=True)
        try:
            proc = host_forker.fork_host(os.getpid(), self.name,
                                         child_env(self.options, self.world), child.fileno())
        finally:
            child.close()
        log.info("engine host %s: pid %d (TP %s)", self.name, proc.pid,
                 f"{self.world.rank}/{self.world.size}" if self.world else "1")
        return proc, parent

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _died(self, method: str) -> EngineHostError:
        self._kill()  # a broken pipe to a live child: take it down, its state is unknown
        rc = self._proc.exitcode
        how = f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        self._closed = True
        return EngineHostError(f"engine host {self.name} (pid {self._proc.pid}) died ({how}) "
                               f"during {method}")

    def _kill(self) -> None:
        if self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join(10)
        remove_shm(self.world)

    # ------------------------------------------------------------------ calls
    def submit(self, method: str, *args: Any) -> None:
        """Send one command; `result()` collects its reply (lets callers drive hosts SPMD)."""
        if self._closed:
            raise EngineHostError(f"engine host {self.name} is closed")
        if self._pending is not None:
            raise EngineHostError(f"engine host {self.name}: {self._pending} still pending")
        try:
            self._conn.send_bytes(HOST_WIRE.encode([method, list(args)]))
        except (BrokenPipeError, ConnectionError, EOFError, OSError):
            raise self._died(method) from None
        self._pending = method

    def result(self, timeout_s: float | None = None) -> Any:
        method, self._pending = self._pending, None
        if method is None:
            raise EngineHostError(f"engine host {self.name}: no command pending")
        if timeout_s is None:
            slow = method in ("start", "preload", "shift_up", "shift_down", "close")
            timeout_s = self.start_timeout_s if slow else self.timeout_s
        reply = self._wait_reply(method, timeout_s)
        status, value, self._awake, self._running, version = reply
        if version is not None:
            self.version = version
        if status == "ok":
            return value
        raise _remote_error(self.name, method, *value)

    def _wait_reply(self, method: str, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self._conn.poll(0.05):
                    reply = HOST_WIRE.decode(self._conn.recv_bytes())
                    if not (isinstance(reply, list) and len(reply) == 5):
                        raise WireError(f"a reply has 5 items, not {reply!r:.80}")
                    return reply
            except (EOFError, ConnectionError, OSError):
                raise self._died(method) from None
            except WireError as e:   # not our host's: whoever wrote it, stop talking to it
                self._kill()
                self._closed = True
                raise EngineHostError(f"engine host {self.name} (pid {self._proc.pid}): "
                                      f"bad reply to {method}: {e}; host killed") from None
            if self._proc.exitcode is not None and not self._conn.poll(0):
                raise self._died(method)
            if time.monotonic() > deadline:
                self._kill()
                self._closed = True
                raise EngineHostError(f"engine host {self.name} (pid {self._proc.pid}): "
                                      f"{method} took over {timeout_s:.0f} s; host killed")

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        self.submit(method, *args)
        return self.result(timeout_s)

    # ------------------------------------------------------------------ engine interface
    @property
    def start_phases(self) -> dict[str, float]:
        """The first start's phases, `host_start` = process start + imports (waits for it)."""
        if self._start_phases is None:
            phases = self.result()
            spent = time.perf_counter() - self._t_spawn
            self._start_phases = {"host_start": max(0.0, spent - sum(phases.values())),
                                  **phases}
        return self._start_phases

    def shift_up(self, read: GPSRead | None = None) -> dict[str, float]:
        return self.call("shift_up", read)

    def shift_down(self) -> dict[str, float]:
        return self.call("shift_down")

    def load_weights(self, read: GPSRead | None = None) -> float:
        return self.call("load_weights", read)

    def add(self, seq_id: str, prompt_ids: Sequence[int], generated_ids: Sequence[int],
            max_new_tokens_remaining: int, sampling: Sampling | None = None,
            generated_logprobs: Sequence[float] | None = None) -> None:
        self.call("add", seq_id, list(prompt_ids), list(generated_ids),
                  max_new_tokens_remaining, sampling,
                  None if generated_logprobs is None else list(generated_logprobs))

    def step(self) -> StepOutput:
        return self.call("step")

    def steps(self, n: int) -> list[StepOutput]:
        return self.call("steps", n)

    def abort(self, seq_ids: Sequence[str] | None = None) -> list[AbortedSequence]:
        return self.call("abort", None if seq_ids is None else list(seq_ids))

    def state(self) -> EngineState:
        return self.call("state")

    @property
    def awake(self) -> bool:
        return self._awake and not self._closed

    @property
    def num_running(self) -> int:
        return self._running

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the engine and the process (running sequences are dropped)."""
        if self._closed:
            self._kill()
            return
        try:
            if self._pending is not None:
                with contextlib.suppress(Exception):  # a start or step nobody collected
                    self.result()
            self.call("close", timeout_s=timeout_s)
            self._proc.join(timeout_s)
        except Exception as e:  # noqa: BLE001 - closing must end the process whatever happened
            log.warning("engine host %s did not close cleanly: %s", self.name, e)
        finally:
            self._closed = True
            self._kill()
            self._conn.close()

    def __enter__(self) -> EngineHost:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.exitcode is None:
            proc.kill()
            proc.join(10)
            remove_shm(self.world)


def spmd(hosts: Sequence[EngineHost], method: str, *args: Any) -> list[Any]:
    """The same command to every host of a TP replica, then every reply (they run it
    together: a collective inside waits for all)."""
    for host in hosts:
        host.submit(method, *args)
    return [host.result() for host in hosts]


def engine_options_for(options: EngineOptions, world: TPWorld | None) -> EngineOptions:
    """TP > 1 runs one rank per host: vLLM's `external_launcher` over the host's world."""
    from dataclasses import replace

    size = world.size if world else 1
    if options.tensor_parallel_size != size:
        raise ValueError(f"engine TP {options.tensor_parallel_size} != world size {size}")
    if size > 1:
        return replace(options, distributed_executor_backend="external_launcher")
    return options


def child_env(options: EngineOptions, world: TPWorld | None) -> dict[str, str]:
    """The host's environment: the parent's, less any torch/MPI world identity, plus its
    CPU share and (TP > 1) its replica world."""
    env = {k: v for k, v in os.environ.items() if world_free(k)}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=str(options.omp_threads))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault(envs.ENGINE_HOST_LOG.name,
                   logging.getLevelName(logging.getLogger().getEffectiveLevel()))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if world is not None and world.size > 1:
        env.update(RANK=str(world.rank), WORLD_SIZE=str(world.size),
                   LOCAL_RANK=str(world.local_rank), MASTER_ADDR=world.master_addr,
                   MASTER_PORT=str(world.master_port))
    return env


def _remote_error(name: str, method: str, kind: str, message: str, tb: str) -> Exception:
    """Re-raise a builtin exception type as itself (ValueError stays ValueError)."""
    cls = getattr(builtins, kind, None)
    text = f"{message} [engine host {name}, {method}]"
    log.debug("engine host %s: remote traceback of %s:\n%s", name, method, tb)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(text)
        except TypeError:
            pass
    return EngineHostError(f"{kind}: {text}\n{tb}")
