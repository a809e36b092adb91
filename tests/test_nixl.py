"""A NIXL transfer between two processes over UCX (metadata exchanged over MPI)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROGRAM = Path(__file__).parent / "programs" / "nixl_pair.py"


def test_nixl_read_and_write_between_two_processes():
    env = dict(os.environ, UCX_MODULES="^ib,rdmacm")  # bundled UCX segfaults at exit otherwise
    p = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2",
                        sys.executable, str(PROGRAM), "16"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["read_state"] == "DONE" and r["write_state"] == "DONE"
    assert r["read_equal"] is True and r["write_equal"] is True
    assert r["read_gbps"] > 0
