"""Per-rank main: `python -m pivotrl_hpc.launch.entry CONFIG_JSON` on every rank (mpirun from
`pivotrl run`; srun in issue 10); layout.py says what the rank is.

Rank 0 = controller + node 0's GPS agent: Debian's Open MPI 4.1.4 provides MPI_THREAD_MULTIPLE
(`MPI.Query_thread() == 3`, mpi4py's default request), so every agent rank runs
`NodeAgent(cfg, agents_comm).serve_forever()` in a thread (agents_comm = COMM_WORLD.Split of
the agents) and keeps its main thread for the controller (rank 0) or for waiting; the main
thread keeps the signal handlers (Python runs them there only) and the end-of-job barriers,
while the agent's loop sits mostly in `select` with the GIL released. Measured on 2 shared
cores: a 2 x 2 job starts, answers a QueryState on every worker and stops in ~10 s (load 10)
to ~33 s (load 17); an orderly SIGTERM stop takes ~1 s. Rejected: a controller-only extra rank
(breaks the "G+1 tasks per node" srun relies on), the agent as a child process (its
communicator to the other agents would need a second MPI world).

Start-up: node and agents communicators; agents start (sweep, load v0, publish) while workers
take `runtime.spec.worker_env` (before torch is imported), start their node's engine host
forker (its vLLM import, the longest, runs from then on) and import; barrier on the node
communicator; workers build a GPSClient and their DeviceWorker, take their CPU cap (cgroup.py)
and `serve(COMM_WORLD, worker, controller=0)`; rank 0 runs `controller.live.run_job` (or
PIVOTRL_CONTROLLER=module:function). Finish: world barrier -> each agent rank stops its agent
(the agents exchange `bye`; segments swept) and the groups go -> world barrier -> exit.

Signals (SIGTERM/SIGINT/SIGHUP on any rank, as scancel sends them): the first interrupts the
controller (`Interrupted` raised in rank 0's main thread; the controller closes the trace and
sends Shutdown on its way out); the other ranks go on until that Shutdown; all finish as above
and exit 0 (the launcher, which sent the signal, returns 128+signal; Slurm keeps its own
state). A watchdog (stop.py) ends any rank not done PIVOTRL_STOP_GRACE_S (20) s after the
signal, after its own cleanup; ranks also stop if `pivotrl run` dies. A rank failing outside
the controller writes rank-N.error.json and calls MPI Abort: mpirun/srun end the whole job.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import secrets
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from pivotrl_hpc import envs
from pivotrl_hpc.checkpoint.folders import create_at, file_mode, open_folder, write_text
from pivotrl_hpc.runtime import cgroup
from pivotrl_hpc.launch import mpi_private
from pivotrl_hpc.launch.layout import (AGENT, CONTROLLER_RANK, LaunchError, RankInfo,
                                       RankLayout, RunPaths, check_placement, host_name, job_id,
                                       port_base)
from pivotrl_hpc.launch.stop import Interrupted, Stopper, wait_barrier, watch_launcher
from pivotrl_hpc.protocol import mpi
from pivotrl_hpc.protocol.wire import PLAIN
from pivotrl_hpc.terminal import SafeLogs

log = logging.getLogger("pivotrl_hpc.launch")

CONTROLLER_ENV = envs.CONTROLLER.name
DEFAULT_CONTROLLER = envs.CONTROLLER.default


# ---- the GPS agent thread ---------------------------------------------------------------------
class AgentThread:
    def __init__(self, cfg, comm, job: str, node: str, resumed: dict | None = None):
        from pivotrl_hpc.gps.agent import AgentConfig, NodeAgent
        from pivotrl_hpc.gps.plan import LinkModel

        budget = int(cfg.gps.memory_budget_gb * 2**30) or None
        models = {"policy": cfg.models.policy.path, "genrm": cfg.models.genrm.path}
        first = {}
        if resumed is not None:  # the policy comes back from the checkpoint, at its version
            models["policy"] = str(Path(resumed["path"]) / "policy")
            first["policy"] = resumed["version"]
        self.job, self.node = job, node
        links = LinkModel(**vars(cfg.gps.links))   # defaults, or `pivotrl profile links`
        self.agent = NodeAgent(AgentConfig(job=job, node=node, models=models,
                                           budget_bytes=budget, transport=cfg.gps.transport,
                                           links=links, first_versions=first), comm)
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"gps-agent-{node}", daemon=True)

    def _run(self) -> None:
        try:
            self.agent.start()
            self.ready.set()
            self.agent.serve_forever()
        except BaseException as e:  # reported by the main thread
            self.error = e
            log.exception("GPS agent on %s failed", self.node)
            self.agent.close()
        finally:
            self.ready.set()

    def start(self) -> None:
        self.thread.start()
        while not self.ready.wait(0.05):
            pass
        if self.error is not None:
            raise RuntimeError(f"GPS agent on {self.node} did not start: "
                               f"{type(self.error).__name__}: {self.error}") from self.error
        log.info("GPS agent of %s ready", self.node)

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the agent to leave its loop (it waits for every node's `bye`), then make sure
        no segment of the node is left."""
        if self.thread.is_alive():
            from pivotrl_hpc.gps.client import GPSClient
            client = GPSClient(self.job, self.node, wait_s=5.0)
            try:
                client.shutdown_agent()
            finally:
                client.close()
            self.thread.join(timeout)
            if self.thread.is_alive():
                log.error("GPS agent on %s did not stop within %.0f s", self.node, timeout)
        self.close()

    def close(self) -> None:
        from pivotrl_hpc.gps.segment import sweep

        self.agent.close()   # idempotent; removes every segment of (job, node), ctl included
        left = sweep(self.job, self.node)
        if left:
            log.warning("GPS agent on %s left %d segment(s) behind (removed now): %s",
                        self.node, len(left), left)


# ---- one rank ---------------------------------------------------------------------------------
class _RoleLog:
    """The worker as `serve` sees it, logging each change of role (the launcher names the
    role of a rank that dies from its log)."""

    def __init__(self, worker):
        self.worker, self.role = worker, None

    def handle(self, cmd):
        reply = self.worker.handle(cmd)
        if reply.role != self.role:
            self.role = reply.role
            log.info("role %s (replica %d)", reply.role.value, reply.replica)
        return reply


def controller_callable() -> Callable:
    spec = envs.CONTROLLER.get()
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


class Rank:
    def __init__(self, cfg, layout: RankLayout, info: RankInfo, paths: RunPaths, world):
        self.cfg, self.layout, self.info, self.paths, self.world = cfg, layout, info, paths, world
        self.job = job_id(os.environ)
        from pivotrl_hpc.launch.resume import stop_grace
        self.stopper = Stopper(stop_grace(envs.STOP_GRACE_S.get(),
                                          cfg.rl.preempt_grace_s, 10.0), self._expired)
        self.agent: AgentThread | None = None
        self.failed = False
        self.error_written = False
        self.resumed: dict | None = None   # the checkpoint this job starts from

    def run(self) -> int:
        from mpi4py import MPI

        self.stopper.install()
        if envs.LAUNCHER_PID.is_set():
            threading.Thread(target=watch_launcher, args=(envs.LAUNCHER_PID.get(),),
                             name="launcher-watch", daemon=True).start()
        self._write_log_file(self.paths.rank_pid(self.info.rank),
                             f"{os.getpid()} {host_name()}\n")
        check_placement(self.layout, self.info.rank, os.environ)
        # the node forkers' names carry a token of the job's (issue 35: unguessable by
        # another account, which could otherwise bind a name first and take the job's env)
        ports, self.forker_token = mpi.bcast(
            self.world, PLAIN, (port_base(self.job, os.environ), secrets.token_hex(8)),
            CONTROLLER_RANK)
        from pivotrl_hpc.launch.resume import resolve_everywhere
        self.resumed = resolve_everywhere(self.world, self.cfg, self.info.controller)
        hosts = mpi.allgather(self.world, PLAIN,
                              envs.SLURMD_NODENAME.raw() or host_name())
        self.layout = replace(self.layout, hosts=tuple(hosts))
        node_comm = self.world.Split(self.info.node, self.info.rank)
        agents = self.world.Split(0 if self.info.kind == AGENT else MPI.UNDEFINED, self.info.rank)
        if self.info.kind == AGENT:
            self._start_agent(agents, node_comm)
            if self.info.controller:
                self._control()
        else:
            self._work(node_comm, ports)
        self._finish()
        if self.stopper.signum is not None:
            log.warning("stopped in order after %s", signal.Signals(self.stopper.signum).name)
        # 0 after an orderly stop too: a non-zero exit makes mpirun kill the ranks still in
        # MPI_Finalize (5 s more); the launcher knows it sent the signal, Slurm its own state
        return 1 if self.failed else 0

    # ---- agent ranks --------------------------------------------------------------------------
    def _start_agent(self, agents, node_comm) -> None:
        from mpi4py import MPI

        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise LaunchError("the GPS agent runs in a thread beside the controller and needs "
                              "MPI_THREAD_MULTIPLE; this MPI gives level "
                              f"{MPI.Query_thread()}: use an Open MPI built with threads")
        self.agent = AgentThread(self.cfg, agents, self.job, self.info.node_name, self.resumed)
        self.stopper.cleanups.append(self.agent.close)
        self.agent.start()
        wait_barrier(node_comm, "GPS agent start-up")

    def _control(self) -> None:
        if self.stopper.signum is not None:      # stopped during start-up
            self._shutdown_workers()
            return
        run_job = controller_callable()
        try:
            self.stopper.interruptible = True
            from pivotrl_hpc.checkpoint.layout import segment_trace
            from pivotrl_hpc.launch.resume import forget_segments
            # a resumed job writes a new trace segment beside the old ones (kept intact)
            trace = segment_trace(self.paths.trace) if self.resumed else self.paths.trace
            if not self.resumed:
                forget_segments(self.paths.trace)
            summary = run_job(self.cfg, self.world, self.layout, str(trace),
                              stopper=self.stopper)
        except Interrupted as e:
            log.warning("controller %s", e)
            summary = getattr(e, "summary", None)   # what it did until then (controller.loop)
            if summary is None:
                return
        except Exception as e:  # the job still stops in order
            self.failed = True
            self._write_error(e)
            log.exception("controller failed")
            return
        finally:
            self.stopper.interruptible = False
        write_text(self.paths.trace.parent, self.paths.summary_json.name,
                   json.dumps(summary, indent=1, default=str) + "\n", self.cfg.trace.group_shared)
        log.info("summary written to %s", self.paths.summary_json)

    def _shutdown_workers(self) -> None:
        from pivotrl_hpc.protocol.messages import Shutdown
        from pivotrl_hpc.runtime.serve import WorkerClient

        for rank in self.layout.worker_ranks:
            WorkerClient(self.world, rank).call(Shutdown())

    # ---- worker ranks -------------------------------------------------------------------------
    def _work(self, node_comm, ports: int) -> None:
        device, node = self.info.device, self.info.node_name
        from pivotrl_hpc.runtime.spec import worker_env, worker_spec
        os.environ.update(worker_env(self.cfg, device))   # before torch is imported
        from pivotrl_hpc.runtime import host_forker

        os.environ[host_forker.ADDRESS_ENV] = host_forker.node_address(self.job, node,
                                                                       self.forker_token)
        # The node's forker imports vLLM (the longest start-up task) from here on, beside
        # this worker's imports and the agents' start-up, not after them.
        host_forker.ensure_running()
        from pivotrl_hpc.gps.client import GPSClient              # imports overlap the
        from pivotrl_hpc.runtime.serve import serve               # agents' start-up
        from pivotrl_hpc.runtime.worker import DeviceWorker

        wait_barrier(node_comm, "GPS agent start-up")
        client = GPSClient(self.job, node)
        try:
            worker = DeviceWorker(worker_spec(self.cfg, device, self.job, node, ports), client)
            # Engine hosts spawn and import vLLM now, uncapped (host work, like the imports
            # above); then they join the device's cap with the worker.
            hosts = worker.prewarm()
            log.info("engine hosts preloaded: pids %s", hosts)
            self._cap(hosts)
            log.info("worker of device %d serving", device)
            n = serve(self.world, _RoleLog(worker), controller=CONTROLLER_RANK)
            log.info("worker of device %d done after %d commands", device, n)
        finally:
            host_forker.leave()
            client.close()

    def _cap(self, children: list[int] = ()) -> None:
        """The device's CPU quota, from its first command on: start-up (imports) is host
        work, not device work; the process's threads and later children follow it, and
        `children` started before the cap (preloaded engine hosts) are moved in too."""
        if cgroup.caps_enabled(self.cfg, os.environ):
            cap = cgroup.cap_process(os.getpid(), self.job,
                                     f"{self.info.node_name}-d{self.info.device}",
                                     self.cfg.cluster.cpu_share)
            for pid in children:
                cgroup.add_process(cap, pid)
            self.stopper.cleanups.append(lambda: cgroup.release(cap))

    # ---- the end --------------------------------------------------------------------------
    def _finish(self) -> None:
        timeout = envs.SHUTDOWN_TIMEOUT_S.get()
        # only the controller's rank knows the job is over; the others wait as long as it runs
        wait_barrier(self.world, "end of the job (every worker shut down)",
                     timeout if self.info.controller else None)
        if self.agent is not None:
            self.stopper.cleanups.remove(self.agent.close)
            self.agent.stop()
        self.stopper.run_cleanups()
        wait_barrier(self.world, "end of the job (every agent stopped)", timeout)
        if self.info.kind == AGENT and cgroup.caps_enabled(self.cfg, os.environ):
            cgroup.remove_job(self.job)   # the job's group, once its device groups are gone
        log.info("done")

    def _expired(self, signum: int) -> None:
        self._write_error(TimeoutError(f"not done {self.stopper.grace_s:.0f} s after "
                                       f"{signal.Signals(signum).name}"))

    def _write_error(self, e: BaseException) -> None:
        """rank-N.error.json: the rank's first error, which the launcher names on the console
        (a later one, such as the end-of-job barrier's time-out that follows a controller's
        failure, goes to the rank's log only)."""
        if self.error_written:
            return
        self.error_written = True
        info = self.info
        self._write_log_file(self.paths.rank_error(info.rank), json.dumps({
            "rank": info.rank, "host": host_name(), "node": info.node_name, "kind": info.kind,
            "device": info.device, "controller": info.controller,
            "error": f"{type(e).__name__}: {e}", "exit_code": failure_code(e),
            "traceback": traceback.format_exc(limit=8)}, indent=1) + "\n")

    def _write_log_file(self, path: Path, text: str) -> None:
        """A run file of the logs folder, made fresh under its checked descriptor with the run
        files' mode (a planted link of its name replaced, never followed)."""
        write_text(path.parent, path.name, text, self.cfg.trace.group_shared, own=2)

    def abort(self, e: BaseException) -> None:
        """A failure outside the controller: record it, clean up here, end the whole job."""
        self._write_error(e)
        log.critical("%s failed: %s: %s", self.info.describe(), type(e).__name__, e,
                     exc_info=True)
        self.stopper.run_cleanups()
        logging.shutdown()
        self.world.Abort(failure_code(e))


def failure_code(e: BaseException) -> int:
    """2 for a refusal (an exception class with `exit_code = 2`: a squatted socket name or
    GPS folder, ...), which the user fixes like bad input; 1 for any other failure."""
    code = getattr(type(e), "exit_code", 1)
    return code if isinstance(code, int) and code in (1, 2) else 1


# ---- process set-up ---------------------------------------------------------------------------
def setup_logging(info: RankInfo, paths: RunPaths, group_shared: bool = False) -> None:
    """Everything of the rank (logging, stray stdout and stderr) goes to rank-N.log (made
    fresh in the checked logs folder, O_EXCL | O_NOFOLLOW, 0600 or 0640 `group_shared`);
    errors also to mpirun's stderr; rank 0's controller lines to mpirun's stdout."""
    dir_fd = open_folder(paths.logs, own=2, create=True, group_shared=group_shared)
    try:
        fd = create_at(dir_fd, paths.rank_log(info.rank).name, file_mode(group_shared))
    finally:
        os.close(dir_fd)
    fmt = logging.Formatter(f"%(asctime)s {info.tag} {host_name()} %(levelname)s "
                            f"%(name)s: %(message)s")
    console = os.fdopen(os.dup(2), "w", buffering=1)
    stdout = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(fd, 2)
    os.dup2(fd, 1)   # libraries print to stdout (NIXL does): the user's stdout stays clean
    os.close(fd)
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(envs.LOG_LEVEL.get().upper())
    for stream, level in ((sys.stderr, logging.NOTSET), (console, logging.ERROR)):
        h = logging.StreamHandler(stream)
        h.setLevel(level)
        h.setFormatter(fmt)
        h.addFilter(SafeLogs())   # data's control characters escaped (terminal.py)
        root.addHandler(h)
    if info.controller:
        progress = logging.StreamHandler(stdout)
        progress.setLevel(logging.INFO)
        progress.setFormatter(logging.Formatter("%(message)s"))
        progress.addFilter(SafeLogs())
        logging.getLogger("pivotrl_hpc.controller").addHandler(progress)


def load_resolved(path: str | Path):
    from pivotrl_hpc.config.load import build
    from pivotrl_hpc.config.schema import Config
    from pivotrl_hpc.config.validate import validate

    cfg = build(Config, json.loads(Path(path).read_text()))
    validate(cfg, check_files=False)
    return cfg


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m pivotrl_hpc.launch.entry RESOLVED_CONFIG.json", file=sys.stderr)
        return 2
    try:   # before MPI_Init: Open MPI's shared files only in the job's 0700 folder
        mpi_private.check(create=True)
    except mpi_private.MPIFolderError as e:
        print(f"entry: {e}", file=sys.stderr)
        return 2
    from mpi4py import MPI

    cfg = load_resolved(argv[0])
    world = MPI.COMM_WORLD
    layout = RankLayout.from_config(cfg, os.environ)
    if world.Get_size() != layout.world_size:
        print(f"entry: the MPI world has {world.Get_size()} ranks but the layout needs "
              f"{layout.world_size}", file=sys.stderr)
        world.Abort(2)
    info = layout.info(world.Get_rank())
    paths = RunPaths.for_config(cfg)
    setup_logging(info, paths, cfg.trace.group_shared)
    rank = Rank(cfg, layout, info, paths, world)
    try:
        code = rank.run()
    except BaseException as e:  # noqa: BLE001 - any failure ends the whole job, named
        rank.abort(e)
        return 1
    _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """Everything is cleaned up and every rank passed the last barrier: finalize MPI and
    skip the interpreter's teardown of torch, vLLM and NIXL (seconds per rank on a busy
    machine, and nothing left to do)."""
    from mpi4py import MPI

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if not MPI.Is_finalized():
        MPI.Finalize()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
