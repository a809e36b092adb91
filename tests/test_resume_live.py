"""Kill a live job with SIGKILL of every rank after step 4 of 8, start it again: it resumes
from its newest whole checkpoint and finishes with the data order, policy versions, losses
and (greedy rollout, staleness 0: a deterministic setting) the final weights bitwise equal to
an uninterrupted run's; then `pivotrl export` of it loads in transformers and vLLM."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from live_util import ROOT, assert_trace_ok, model_overrides, run_job, shm_entries

pytestmark = pytest.mark.slow

STEPS = 8
# disaggregated on the learn-cpu node: training stays up, so the only thing that differs
# between the runs is the kill; temperature 0 and staleness 0 make the run deterministic
OVERRIDES = ["paradigm.name=disaggregated", f"rl.steps={STEPS}", "rl.batch_size=4",
             "rl.temperature=0", "rl.staleness=0", "rl.checkpoint_every=2"]


def _steps(traces: list[Path]) -> list[dict]:
    from pivotrl_hpc.trace import open_trace

    rows = []
    for path in traces:
        with open_trace(str(path)) as t:
            st = t.table("steps")
            rows += [{"step": int(s), "version": int(v), "loss": float(loss), "prompts": p}
                     for s, v, loss, p in zip(st["step"], st["version"], st["loss"],
                                              st["prompts"])]
    return rows


def _start(models: Path, trace: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pivotrl_hpc.cli.main", "run",
           str(ROOT / "configs" / "learn-cpu.yaml"), *model_overrides(models),
           f"trace.path={trace}", *OVERRIDES]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "UCX_MODULES": "^ib,rdmacm"})


def _kill_every_rank(proc: subprocess.Popen, trace: Path, after: Path) -> None:
    deadline = time.monotonic() + 600
    while not (after / "COMPLETE").exists():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint of step 4 within 600 s"
        time.sleep(0.2)
    logs = trace.with_suffix(".logs")
    pids = [int(p.read_text().split()[0]) for p in logs.glob("rank-*.pid")]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    proc.kill()                       # and the launcher: nobody is left to clean up
    proc.communicate()
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.2)


def _final_weights(trace: Path) -> dict:
    from safetensors.torch import load_file

    from pivotrl_hpc.checkpoint.layout import latest, root_for
    ckpt = latest(root_for(trace))
    assert ckpt.name == f"step-{STEPS:06d}"
    return load_file(str(ckpt / "policy" / "model.safetensors"))


def test_sigkill_after_step_4_resumes_and_ends_bitwise_equal(tiny_models, tmp_path):
    from pivotrl_hpc.checkpoint.layout import root_for, segments

    full = run_job("learn-cpu.yaml", tiny_models, tmp_path / "full" / "run.h5", OVERRIDES)
    trace = tmp_path / "killed" / "run.h5"
    _kill_every_rank(_start(tiny_models, trace), trace, root_for(trace) / "step-000004")
    left = shm_entries()
    resumed = run_job("learn-cpu.yaml", tiny_models, trace, OVERRIDES)
    assert "removed" in resumed["output"] and "segment(s) the killed job" in resumed["output"]
    assert not (left & shm_entries())         # the killed job's segments are gone
    assert resumed["left"] == set()
    parts = segments(trace)
    assert [p.name for p in parts] == ["run.h5", "run.seg1.h5"]
    assert_trace_ok(full["trace"], *parts)    # the killed segment and the resumed one too
    from pivotrl_hpc.trace import open_trace
    with open_trace(str(parts[1])) as t:
        start = json.loads(json.dumps(t.meta))["resumed_from"]
    assert Path(start).name in ("step-000004", "step-000006")
    with open_trace(str(parts[0])) as t:      # the killed segment: intact, readable
        assert t.summary is None and t.rows("steps") >= 4
    want = {r["step"]: r for r in _steps([full["trace"]])}
    got = _steps(parts)
    assert {r["step"] for r in got} == set(range(STEPS))
    for r in got:                             # redone steps too: the same data, version, loss
        assert r == want[r["step"]], r["step"]
    a, b = _final_weights(full["trace"]), _final_weights(trace)
    assert a.keys() == b.keys()
    assert all(bool((a[n] == b[n]).all()) for n in a), "final weights differ"
    first = _final_weights(trace)
    _check_export(trace, tmp_path / "export", first)


def _check_export(trace: Path, out: Path, weights: dict) -> None:
    """`pivotrl export` -> a folder transformers loads with exactly the trained weights (the
    checkpoint's policy is GPS's own bytes), and vLLM serves with the same greedy tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "export", str(trace),
                        "--out", str(out), "--json"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    info = json.loads(p.stdout)
    assert info["step"] == STEPS and info["version"] == STEPS
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    state = model.state_dict()
    for name, t in weights.items():
        assert torch.equal(state[name], t), name
    prompt = [1, 5, 9, 13, 17, 21]
    with torch.no_grad():
        hf = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0]
    code = ("import json,sys; from vllm import LLM, SamplingParams; "
            "llm = LLM(sys.argv[1], dtype='float32', max_model_len=64, enforce_eager=True, "
            "kv_cache_memory_bytes=16 << 20); "
            "o = llm.generate({'prompt_token_ids': json.loads(sys.argv[2])}, "
            "SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)); "
            "print('TOKENS', json.dumps(list(o[0].outputs[0].token_ids)))")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    v = subprocess.run([sys.executable, "-c", code, str(out), json.dumps(prompt)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert v.returncode == 0, v.stderr[-3000:]
    tokens = json.loads(v.stdout.split("TOKENS", 1)[1])
    assert tokens == hf[len(prompt):].tolist()


def test_sigterm_with_a_grace_time_checkpoints_the_running_step_and_resumes(tiny_models,
                                                                              tmp_path):
    """A preemption's SIGTERM (here to the launcher, which passes it to every rank, as Slurm
    signals every task) with `rl.preempt_grace_s`: no periodic checkpoint, yet the job writes
    one after the step it was running, stops as stopped by SIGTERM, and the next start
    resumes from exactly there and finishes. Colocated: every step after the resume shifts
    the restored trainer down and up again (that crashed on the first one, issue 36)."""
    from pivotrl_hpc.checkpoint.layout import latest, root_for, segments
    from pivotrl_hpc.cli.bench_soak import steps_done

    trace = tmp_path / "run" / "run.h5"
    extra = ["rl.checkpoint_every=0", "rl.preempt_grace_s=90", "paradigm.name=colocated"]
    cmd = [sys.executable, "-m", "pivotrl_hpc.cli.main", "run",
           str(ROOT / "configs" / "learn-cpu.yaml"), *model_overrides(tiny_models),
           f"trace.path={trace}", *OVERRIDES, *extra]
    env = {**os.environ, "UCX_MODULES": "^ib,rdmacm"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    deadline = time.monotonic() + 600
    while steps_done(trace) < 3:       # two step intervals: the controller can time a step
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "3 steps not trained within 600 s"
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    ckpt = latest(root_for(trace))
    assert ckpt is not None, out[-3000:]
    step = json.loads((ckpt / "state.json").read_text())["step"]
    summary = json.loads(trace.with_suffix(".summary.json").read_text())
    assert step >= 3 and summary["stopped"] == f"checkpointed at step {step} after a stop " \
        "signal", out[-3000:]

    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    rows = _steps(segments(trace))
    assert [r["step"] for r in rows] == list(range(STEPS)), rows   # none lost or trained twice
    assert_trace_ok(*segments(trace))
    assert f"resumed from {ckpt}" in again.stdout + again.stderr
    from pivotrl_hpc.trace import open_trace
    with open_trace(str(segments(trace)[1])) as t:
        shifts = t.table("shifts")
        assert t.meta["paradigm"] == "colocated"
    downs = [r for r, d in zip(shifts["role"], shifts["direction"]) if d == "down"]
    assert "training" in downs, downs      # the restored trainer shifted down (and back up)
