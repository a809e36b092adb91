"""`python engine_host_orphan.py MODEL_DIR`: start an engine host, print its pid, wait to be
killed (tests/test_engine_host.py checks that the host then leaves by itself)."""
import sys
import time

from pivotrl_hpc.runtime.engine_host import EngineHost


def main() -> None:
    host = EngineHost(sys.argv[1], wait=False)
    print(host.pid, flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
