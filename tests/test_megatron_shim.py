"""The Megatron CPU shim is applied only without CUDA, once, and its global-behaviour patches
stay inside their scope.

The first three tests monkeypatch `torch.cuda.is_available` (and `apply_cpu_shim` with a
recorder), so that this pytest process itself is never patched. The last one applies the real
shim in a fresh subprocess.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pivotrl_hpc.engines.megatron import cpu_shim, parallel

ROOT = Path(__file__).resolve().parents[1]


def test_shim_not_invoked_when_cuda_is_available(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_shim, "apply_cpu_shim", lambda: calls.append("applied"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert parallel.ensure_device_support() == torch.device("cuda", 0)
    assert calls == []
    assert isinstance(parallel.device_scope(), contextlib.nullcontext)


def test_shim_invoked_when_cuda_is_absent(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_shim, "apply_cpu_shim", lambda: calls.append("applied"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert parallel.ensure_device_support() == torch.device("cpu")
    assert calls == ["applied"]


def test_apply_refuses_on_a_cuda_host(monkeypatch):
    monkeypatch.setattr(cpu_shim, "_APPLIED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA host"):
        cpu_shim.apply_cpu_shim()
    assert cpu_shim.is_applied() is False


PROBE = textwrap.dedent("""
    import torch
    from pivotrl_hpc.engines.megatron import cpu_shim
    from megatron.core.tensor_parallel import random as mrandom
    import megatron.core.optimizer.optimizer as mopt

    assert not cpu_shim.is_applied()
    cpu_shim.apply_cpu_shim()
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    clip = mopt.clip_grad_by_total_norm_fp32
    cpu_shim.apply_cpu_shim()  # idempotent: nothing is replaced twice
    assert mrandom._CUDA_RNG_STATE_TRACKER is tracker and mopt.clip_grad_by_total_norm_fp32 is clip
    x = torch.ones(2)
    assert x.type() == "torch.FloatTensor"
    try:
        torch.zeros(1, device="cuda")
        raise SystemExit("device='cuda' worked outside the scope")
    except (AssertionError, RuntimeError):
        pass
    with cpu_shim.cpu_device_scope():
        assert x.type() == "torch.cuda.FloatTensor"
        assert torch.zeros(1, device="cuda").device.type == "cpu"
        assert x.cuda() is x
    assert x.type() == "torch.FloatTensor"
    # the RNG tracker forks a named CPU stream and restores the default one
    tracker.add("model-parallel-rng", 42)
    torch.manual_seed(0); expected = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("model-parallel-rng"):
        inside = torch.rand(3)
    assert torch.equal(torch.rand(3), expected)
    torch.manual_seed(42)
    assert torch.equal(inside, torch.rand(3))
    # the clip replacement scales grads by max_norm / total_norm
    p = torch.nn.Parameter(torch.ones(4)); p.grad = torch.full((4,), 2.0)
    clip([p], max_norm=1.0, total_norm=4.0)
    assert torch.allclose(p.grad, torch.full((4,), 0.5), atol=1e-6)
    print("PROBE-OK")
""")


def test_real_shim_is_idempotent_and_scoped():
    pytest.importorskip("megatron.core")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "PROBE-OK" in out.stdout
