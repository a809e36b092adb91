"""Segment cleanup: SIGTERM to the agent, stale segments of the same job at start."""
from __future__ import annotations

import signal

from pivotrl_hpc.gps.local import local_agent
from pivotrl_hpc.gps.segment import SHM_DIR


def test_sigterm_removes_every_segment(tiny_models):
    with local_agent({"policy": str(tiny_models / "policy")}) as agent:
        c = agent.client()
        with c.pin("policy"):  # a reader's pin does not keep a dying agent's segments
            assert len(list(SHM_DIR.glob(f"pivotrl-{agent.job}-*"))) == 2  # ctl + policy v0
            agent.proc.send_signal(signal.SIGTERM)
            assert agent.proc.wait(20) == 128 + signal.SIGTERM
            assert list(SHM_DIR.glob(f"pivotrl-{agent.job}-*")) == []
        c.close()


def test_stale_segments_of_the_job_are_swept_at_start(tiny_models):
    stale = SHM_DIR / "pivotrl-stalejob-n0-policy-v7"
    other_node = SHM_DIR / "pivotrl-stalejob-n1-policy-v7"
    for p in (stale, other_node):
        p.write_bytes(b"left by a killed agent")
    try:
        with local_agent({"policy": str(tiny_models / "policy")}, job="stalejob", node="n0"):
            assert not stale.exists()
            assert other_node.exists()  # another node's segments are that node's business
    finally:
        other_node.unlink(missing_ok=True)
        stale.unlink(missing_ok=True)
