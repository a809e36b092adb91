"""Readers Reading in a loop while versions are written; kill -9 of readers."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pivotrl_hpc.gps.convert import hf_to_megatron
from pivotrl_hpc.gps.layout import ParallelPlace
from pivotrl_hpc.gps.local import local_agent
from pivotrl_hpc.gps.segment import SHM_DIR
from pivotrl_hpc.gps.shapes import ModelShape

READER = str(Path(__file__).parent / "programs" / "gps_reader.py")
ROOT = str(Path(__file__).resolve().parents[1])
LAST = 8


def version_weights(hf: dict, v: int) -> dict:
    return {k: t * (1.0 + v) + 0.25 * v for k, t in hf.items()}


class Reader:
    """A gps_reader.py process and its JSON lines, read with a deadline."""

    def __init__(self, agent, model_dir, *args):
        env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, READER, agent.job, agent.node,
                                      str(model_dir), *args], stdout=subprocess.PIPE, env=env)
        self._buf = b""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def line(self, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            assert left > 0, "reader printed nothing in time"
            if select.select([fd], [], [], left)[0]:
                data = os.read(fd, 1 << 16)
                assert data, f"reader exited with {self.proc.wait()}"
                self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)


def _write(client, hf, shape, v):
    w = version_weights(hf, v)
    handles = [client.write("policy", hf_to_megatron(w, shape, r, 2), ParallelPlace(2, r))
               for r in range(2)]
    return {h.wait(60) for h in handles}


@pytest.mark.slow
def test_four_readers_see_whole_versions_in_order(tiny_models):
    """Each version is written once every live reader has read the previous one, so every
    reader Reads every version, while the next is being written."""
    model_dir = tiny_models / "policy"
    hf = load_file(str(model_dir / "model.safetensors"))
    shape = ModelShape.from_hf_config(model_dir)
    with local_agent({"policy": str(model_dir)}) as agent:
        client = agent.client()
        readers = [Reader(agent, model_dir, "--until", str(LAST)) for _ in range(4)]
        victim = Reader(agent, model_dir, "--until", str(LAST))  # killed with -9 at v4
        try:
            for r in readers + [victim]:
                assert r.line() == {"seen": 0}  # ready: imported, connected, read v0
            for v in range(1, LAST + 1):
                assert _write(client, hf, shape, v) == {v}
                for r in readers + ([victim] if v <= 4 else []):
                    assert r.line() == {"seen": v}
                if v == 4:
                    victim.proc.send_signal(signal.SIGKILL)
            outs = [r.line() for r in readers]
            assert all(r.proc.wait(60) == 0 for r in readers)
            assert victim.proc.wait(10) == -signal.SIGKILL
        finally:
            for r in readers + [victim]:
                r.kill()
        final = client.read("policy")
        assert all(torch.equal(final[k], version_weights(hf, LAST)[k]) for k in hf)
        client.close()
    assert agent.leftover == []  # the agent's own shutdown removed everything
    for o in outs:
        assert o["mismatches"] == 0 and o["versions"] == list(range(LAST + 1)), o
        assert o["reads"] >= LAST + 1, o


def _kill9_while_pinned(client, holder, hf, shape, pinned):
    assert _write(client, hf, shape, pinned + 1) == {pinned + 1}
    client.sync()  # the agent has tried to collect since
    assert client.state("policy").live == (pinned, pinned + 1)  # held by the reader's pin
    holder.proc.send_signal(signal.SIGKILL)
    assert holder.proc.wait(10) == -signal.SIGKILL
    client.sync()


def test_kill9_of_a_pinning_reader_frees_its_version(tiny_models):
    model_dir = tiny_models / "policy"
    hf = load_file(str(model_dir / "model.safetensors"))
    shape = ModelShape.from_hf_config(model_dir)
    with local_agent({"policy": str(model_dir)}) as agent:
        client = agent.client()
        holder = Reader(agent, model_dir, "--hold")
        try:
            pinned = holder.line()["pinned"]
            _kill9_while_pinned(client, holder, hf, shape, pinned)
        finally:
            holder.kill()
        assert client.state("policy").live == (pinned + 1,)
        got = client.read("policy")
        assert all(torch.equal(got[k], version_weights(hf, pinned + 1)[k]) for k in hf)
        # the freed version is the recycling spare now, not a version any more
        prefix = f"pivotrl-{agent.job}-{agent.node}-"
        assert {p.name for p in SHM_DIR.glob(prefix + "*")} == {
            prefix + "ctl", f"{prefix}policy-v{pinned + 1}", f"{prefix}policy-v{pinned}.spare"}
        client.close()
    assert agent.leftover == []  # the agent's own shutdown removed everything
