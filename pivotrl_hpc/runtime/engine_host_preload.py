"""The fork server's preload (`multiprocessing.set_forkserver_preload`): importing this module
imports vLLM and the engine adapter once per worker, and every engine host forks with them
loaded. The fork server ignores a failed preload, so a failure here only costs the hosts
their own imports (each reports its error at its start).

It also makes the fork server deaf to SIGTERM and SIGHUP (the stdlib's ignores only SIGINT).
Slurm's scancel, preemption and time limit signal every process of the step; a fork server
killed by one leaves its hosts running but unreported: the worker's handle then reads exit
code 255 for a live host and fails its next call. The worker ends the server itself
(`engine_host.stop_fork_server`), and the server leaves when the worker and its hosts are gone.
"""
import logging
import signal

from pivotrl_hpc.runtime.engine_host_child import preload

for _sig in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(_sig, signal.SIG_IGN)

try:
    preload()
except Exception as e:  # noqa: BLE001 - the server must come up; hosts import again
    logging.getLogger(__name__).warning("fork server preload failed: %s", e)
