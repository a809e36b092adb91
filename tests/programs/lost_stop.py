"""A stop signal whose handler runs inside a finalizer: Python prints the handler's exception
("Exception ignored in") and goes on. Run by tests/test_launch.py; prints what stopped the
loop: `check` (Stopper.check caught the lost stop), `handler` (the signal's own interrupt),
or `end` (nothing did)."""
import os
import signal
import sys
import time

from pivotrl_hpc.launch.stop import Interrupted, Stopper

stopper = Stopper(grace_s=60.0)
stopper.install()
stopper.interruptible = True
stopper.deferred = sys.argv[1] == "deferred"
use_check = sys.argv[1] != "no-check"


class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        t = time.monotonic() + 0.2
        while time.monotonic() < t:   # bytecodes: the handler runs here, in __del__
            pass


try:
    Finalized()   # dropped at once: __del__ runs now
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        if use_check:
            stopper.check()
        time.sleep(0.01)
    print("end", flush=True)
except Interrupted as e:
    where = "check" if stopper.handled and time.monotonic() - stopper.noticed_at >= 1.0 \
        else "handler"
    print(where, e, flush=True)
