"""The fork server's preload (`multiprocessing.set_forkserver_preload`): importing this module
imports vLLM and the engine adapter once per worker, and every engine host forks with them
loaded. The fork server ignores a failed preload, so a failure here only costs the hosts
their own imports (each reports its error at its start)."""
import logging

from pivotrl_hpc.runtime.engine_host_child import preload

try:
    preload()
except Exception as e:  # noqa: BLE001 - the server must come up; hosts import again
    logging.getLogger(__name__).warning("fork server preload failed: %s", e)
