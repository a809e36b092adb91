"""Segment cleanup: the agent's own graceful shutdown, SIGTERM, stale segments at start."""
from __future__ import annotations

import signal
import threading
import uuid

from safetensors.torch import load_file

from pivotrl_hpc.gps.agent import AgentConfig, NodeAgent
from pivotrl_hpc.gps.client import GPSClient
from pivotrl_hpc.gps.convert import hf_to_megatron
from pivotrl_hpc.gps.layout import ParallelPlace
from pivotrl_hpc.gps.local import local_agent
from pivotrl_hpc.gps import shmdir
from pivotrl_hpc.gps.segment import SHM_DIR, sweep
from pivotrl_hpc.gps.shapes import ModelShape


def _names(prefix: str) -> set[str]:
    return {p.name[len(prefix):] for p in SHM_DIR.glob(prefix + "*")}


def test_graceful_shutdown_removes_every_segment_itself(tiny_models):
    """No helper sweeps here: the agent (in a thread of this process) is asked to stop while
    it holds a pinned old version, a recycling spare and a half-done Write."""
    job = f"close{uuid.uuid4().hex[:8]}"
    models = {m: str(tiny_models / m) for m in ("policy", "genrm")}
    agent = NodeAgent(AgentConfig(job, "n0", models))
    thread = threading.Thread(target=lambda: (agent.start(), agent.serve_forever()),
                              daemon=True)  # a failed test leaves no thread behind
    thread.start()  # start() off the main thread: no signal handlers in pytest
    try:
        _shut_down_while_busy(GPSClient(job, "n0"), agent, thread, tiny_models)
    finally:
        sweep(job)  # only after the checks: a failed run leaves nothing either


def _shut_down_while_busy(c, agent, thread, tiny_models):
    hf = load_file(str(tiny_models / "policy" / "model.safetensors"))
    old = c.pin("policy")
    for v in (1, 2):
        c.write("policy", {k: t + v for k, t in hf.items()}, ParallelPlace(),
                layout="hf").wait(30)
    genrm = load_file(str(tiny_models / "genrm" / "model.safetensors"))
    shard = hf_to_megatron(genrm, ModelShape.from_hf_config(tiny_models / "genrm"), 0, 2)
    assert not c.write("genrm", shard, ParallelPlace(2, 0)).done()  # TP rank 1 never writes
    c.sync()
    prefix = f"pivotrl-{agent.cfg.job}-n0-"
    assert _names(prefix) == {"ctl", "policy-v0", "policy-v1.spare", "policy-v2",
                              "genrm-v0", "genrm-v1"}
    c.shutdown_agent()
    thread.join(30)
    assert not thread.is_alive() and agent.closed
    assert _names(prefix) == set()  # even the pinned version's file
    old.release()
    c.close()


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
    shmdir.ensure()   # a killed agent leaves its files and the folder
    for p in (stale, other_node):
        p.write_bytes(b"left by a killed agent")
    try:
        with local_agent({"policy": str(tiny_models / "policy")}, job="stalejob", node="n0"):
            assert not stale.exists()
            assert other_node.exists()  # another node's segments are that node's business
    finally:
        other_node.unlink(missing_ok=True)
        stale.unlink(missing_ok=True)
        shmdir.remove_if_unused()
