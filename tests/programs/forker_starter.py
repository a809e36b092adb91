"""`python forker_starter.py`: a worker that starts the node's forker (PIVOTRL_HOST_FORKER),
prints {"forker": pid} and holds its session until a line on stdin or its death
(tests/test_security_forker.py: the forker must not outlive a killed starter)."""
import json
import sys

from pivotrl_hpc.runtime import host_forker


def main() -> None:
    host_forker.ensure_running()
    print(json.dumps({"forker": host_forker._Session.child.pid}), flush=True)
    sys.stdin.readline()
    host_forker.leave()


if __name__ == "__main__":
    main()
