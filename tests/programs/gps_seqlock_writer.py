"""The single writer of the seqlock test: `gps_seqlock_writer.py CTL_PATH STOP_FILE`.

Publishes version v as current with live = (v-15, ..., v) (all 16 slots) for v = 15, 16, ...
as fast as it can, until STOP_FILE exists; then prints the last version published.
"""
import os
import sys

from pivotrl_hpc.gps import control


def main() -> None:
    path, stop = sys.argv[1:3]
    ctl = control.ControlBlock(path)
    v = control.MAX_LIVE - 1
    while True:
        for _ in range(1000):
            v += 1
            ctl.publish("m", v, tuple(range(v - control.MAX_LIVE + 1, v + 1)))
        if os.path.exists(stop):
            break
    print(v, flush=True)


if __name__ == "__main__":
    main()
