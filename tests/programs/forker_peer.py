"""`python forker_peer.py MODEL_DIR [JOB]`: a second worker on the node. Forks an engine host
from the forker of PIVOTRL_HOST_FORKER (capped first to 0.5 cores in group `<JOB>/peer` when
JOB is given), prints {"host", "parent", "server", "quota"} as JSON, closes the host and
waits for a line on stdin before it leaves (tests/test_host_forker.py)."""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/: proc_util
from proc_util import ppid

from pivotrl_hpc.runtime import cgroup
from pivotrl_hpc.runtime import host_forker
from pivotrl_hpc.runtime.engine_host import EngineHost


def main() -> None:
    cap = cgroup.cap_process(os.getpid(), sys.argv[2], "peer", 0.5) if len(sys.argv) > 2 \
        else None
    host = EngineHost(sys.argv[1], start=False, name="peer host")
    try:
        host.preloaded()
        print(json.dumps({"host": host.pid, "parent": ppid(host.pid),
                          "server": host_forker.server_pid(),
                          "quota": cgroup.quota_of(host.pid) if cap else None}), flush=True)
    finally:
        host.close()
    sys.stdin.readline()
    host_forker.leave()
    if cap:
        cgroup.release(cap)


if __name__ == "__main__":
    main()
