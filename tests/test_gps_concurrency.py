"""Readers Reading in a loop while versions are written; kill -9 of readers."""
from __future__ import annotations

import json
import os
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


def version_weights(hf: dict, v: int) -> dict:
    return {k: t * (1.0 + v) + 0.25 * v for k, t in hf.items()}


def _reader(agent, model_dir, stop, *extra):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, READER, agent.job, agent.node, str(model_dir),
                             str(stop), *extra], stdout=subprocess.PIPE, text=True, env=env)


def _write(client, hf, shape, v):
    w = version_weights(hf, v)
    handles = [client.write("policy", hf_to_megatron(w, shape, r, 2), ParallelPlace(2, r))
               for r in range(2)]
    return {h.wait(60) for h in handles}


@pytest.mark.slow
def test_four_readers_see_whole_versions_in_order(tiny_models, tmp_path):
    model_dir = tiny_models / "policy"
    hf = load_file(str(model_dir / "model.safetensors"))
    shape = ModelShape.from_hf_config(model_dir)
    stop = tmp_path / "stop"
    with local_agent({"policy": str(model_dir)}) as agent:
        client = agent.client()
        readers = [_reader(agent, model_dir, stop) for _ in range(4)]
        victim = _reader(agent, model_dir, stop)  # killed with -9 in the middle
        time.sleep(4.0)  # imports
        written = []
        for v in range(1, 9):
            assert _write(client, hf, shape, v) == {v}
            written.append(v)
            if v == 4:
                victim.send_signal(signal.SIGKILL)
            time.sleep(0.3)
        stop.touch()
        outs = [json.loads(r.communicate(timeout=60)[0].strip().splitlines()[-1]) for r in readers]
        assert victim.wait(10) == -signal.SIGKILL
        final = client.read("policy")
        assert all(torch.equal(final[k], version_weights(hf, 8)[k]) for k in hf)
        client.close()
    for o in outs:
        assert o["mismatches"] == 0 and o["reads"] > 5, o
        assert o["versions"] == sorted(o["versions"]), o  # never backwards
        assert len(o["versions"]) >= 2, o  # they did read while versions were written
    assert max(o["versions"][-1] for o in outs) == 8


def test_kill9_of_a_pinning_reader_frees_its_version(tiny_models, tmp_path):
    model_dir = tiny_models / "policy"
    hf = load_file(str(model_dir / "model.safetensors"))
    shape = ModelShape.from_hf_config(model_dir)
    with local_agent({"policy": str(model_dir)}) as agent:
        client = agent.client()
        holder = _reader(agent, model_dir, tmp_path / "unused", "--hold")
        pinned = json.loads(holder.stdout.readline())["pinned"]
        assert _write(client, hf, shape, pinned + 1) == {pinned + 1}
        time.sleep(0.3)
        assert pinned in client.state("policy").live  # held by the reader's pin
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        deadline = time.monotonic() + 10
        while pinned in client.state("policy").live and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.state("policy").live == (pinned + 1,)
        got = client.read("policy")
        assert all(torch.equal(got[k], version_weights(hf, pinned + 1)[k]) for k in hf)
        # the freed version's file is gone (or kept as the one recycling spare)
        name = f"pivotrl-{agent.job}-{agent.node}-policy-v{pinned}"
        assert not (SHM_DIR / name).exists()
        client.close()
    assert not list(SHM_DIR.glob(f"pivotrl-{agent.job}-*"))  # clean exit removes everything
