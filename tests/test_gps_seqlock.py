"""The control block's seqlock under a real concurrent writer (another process): a reader
that races thousands of writes never gets a half-written slot."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from pivotrl_hpc.gps import control

WRITER = str(Path(__file__).parent / "programs" / "gps_seqlock_writer.py")
ROOT = str(Path(__file__).resolve().parents[1])
# What the test claims is about races: at least RACES reads met a write in progress (torn,
# were they not retried) and none came back torn. READS only makes the run long enough to
# meet the writer often; it is not a speed figure (a loaded 2-core machine managed 4,500
# reads/s against a spinning writer, an idle one ~200,000).
READS = 20_000
RACES = 20


def _whole(st: control.ModelState) -> bool:
    return st.current is not None and st.live == tuple(
        range(st.current - control.MAX_LIVE + 1, st.current + 1))


def test_concurrent_reader_never_sees_a_torn_slot(tmp_path):
    _race(tmp_path, {}, races=RACES)


def test_the_locked_path_for_cpus_without_store_order_never_tears(tmp_path, monkeypatch):
    """What aarch64 runs (control.LOCKED): the slot under an flock; forced here on x86."""
    monkeypatch.setattr(control, "LOCKED", True)
    _race(tmp_path, {"PIVOTRL_GPS_SEQLOCK": "lock"}, races=0, want=20_000)


def _race(tmp_path, env: dict, races: int, want: int = READS) -> None:
    """A writer process publishing as fast as it can, this process reading `want` times."""
    ctl = control.ControlBlock(tmp_path / "ctl", create=True)
    first = control.MAX_LIVE - 1
    ctl.publish("m", first, tuple(range(first + 1)))
    stop = tmp_path / "stop"
    writer = subprocess.Popen([sys.executable, WRITER, str(ctl.path), str(stop)],
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": ROOT, **env})
    reads = torn = backwards = 0
    last, last_seq = first, 0
    deadline = time.monotonic() + 60
    try:
        while (reads < want or ctl.raced_reads < races) and not (torn or backwards) \
                and time.monotonic() < deadline:
            seq = ctl.sequence("m")  # one 8-byte load: it must never go back (e.g. via 0)
            st = ctl.state("m")
            torn += not _whole(st)
            backwards += st.current < last or seq < last_seq
            last, last_seq = st.current, seq
            reads += 1
    finally:
        stop.touch()
        try:
            final = int(writer.communicate(timeout=60)[0])
        finally:
            writer.kill()
    assert writer.returncode == 0
    assert (torn, backwards) == (0, 0), (reads, ctl.raced_reads)
    assert ctl.raced_reads >= races and reads >= want, reads  # it did race the writer
    assert final > last and ctl.state("m") == control.ModelState(
        final, tuple(range(final - control.MAX_LIVE + 1, final + 1)))
