"""One live job stopped twice and started three times (learn-cpu, disaggregated, greedy,
staleness 0: a deterministic setting), against an uninterrupted run of the same config that
runs beside it:

1. SIGKILL of every rank (and the launcher) once the checkpoint of step 2 is whole: the next
   start removes what the killed job left in /dev/shm and resumes from its newest whole
   checkpoint;
2. a preemption's SIGTERM to the launcher (which passes it to every rank, as Slurm signals
   every task) with `rl.preempt_grace_s` once the resumed start has trained 3 steps: it
   checkpoints after the step it was running, stops as stopped by SIGTERM, and the third
   start resumes from exactly there;
3. the third start finishes: data order, policy versions, losses and the final weights are
   bitwise equal to the uninterrupted run's; `pivotrl export` of it loads in transformers
   and vLLM.

The two stops were two jobs (one of them colocated); folded into one job for suite time.
A restored trainer shifting down (colocated, issue 36) after a grace-time checkpoint is
asserted by test_slurm_requeue's preempted job, the same controller path under Slurm."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from live_util import ROOT, assert_trace_ok, model_overrides, run_job, shm_entries

pytestmark = pytest.mark.slow

STEPS = 8
# disaggregated on the learn-cpu node: training stays up, so the only thing that differs
# between the runs is the stops; temperature 0 and staleness 0 make the run deterministic.
# The grace time changes nothing until a SIGTERM comes.
# Three devices of 0.53 cores (one each for rollout, reward and training), not learn-cpu's
# four of 0.4: the same 1.6 cores, one worker and one engine fewer at each of the 4 starts.
OVERRIDES = ["paradigm.name=disaggregated", f"rl.steps={STEPS}", "rl.batch_size=4",
             "rl.temperature=0", "rl.staleness=0", "rl.checkpoint_every=2",
             "rl.preempt_grace_s=90", "cluster.devices_per_node=3", "cluster.cpu_share=0.53",
             "paradigm.initial_rollout_devices=1"]


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


def _wait_for(proc: subprocess.Popen, what: str, check) -> None:
    deadline = time.monotonic() + 600
    while not check():
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, f"no {what} within 600 s"
        time.sleep(0.2)


def _kill_every_rank(proc: subprocess.Popen, trace: Path, after: Path) -> None:
    _wait_for(proc, f"checkpoint {after.name}", (after / "COMPLETE").exists)
    logs = trace.with_suffix(".logs")
    pids = [int(p.read_text().split()[0]) for p in logs.glob("rank-*.pid")]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    proc.kill()                       # and the launcher: nobody is left to clean up
    proc.communicate()
    while any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.2)


def _rows(trace: Path) -> int:
    from pivotrl_hpc.trace import open_trace

    try:
        with open_trace(str(trace)) as t:
            return t.rows("steps")
    except (OSError, KeyError):
        return 0


def _job_shm(trace: Path) -> set[Path]:
    """This job's GPS segments in /dev/shm now (another job may run beside it)."""
    job = (trace.with_suffix(".logs") / "job").read_text().strip()
    return {p for p in shm_entries() if f"-{job}-" in p.name}


@pytest.fixture(scope="module")
def stopped_twice(tiny_models, tmp_path_factory) -> dict:
    from pivotrl_hpc.checkpoint.layout import latest, root_for

    tmp = tmp_path_factory.mktemp("resume")
    trace = tmp / "killed" / "run.h5"
    out: dict = {"trace": trace}
    with ThreadPoolExecutor(1) as pool:   # the uninterrupted run, beside the stopped one
        full = pool.submit(run_job, "learn-cpu.yaml", tiny_models, tmp / "full" / "run.h5",
                           OVERRIDES)
        # 1. SIGKILL once step 2's checkpoint is whole
        _kill_every_rank(_start(tiny_models, trace), trace, root_for(trace) / "step-000002")
        out["left_by_kill"] = _job_shm(trace)
        # 2. the second start resumes; SIGTERM (grace time) once it trained 3 steps: two
        # step intervals, so the controller can time a step
        proc = _start(tiny_models, trace)
        seg1 = trace.with_name("run.seg1.h5")
        _wait_for(proc, "3 steps trained after the resume", lambda: _rows(seg1) >= 3)
        proc.send_signal(signal.SIGTERM)
        out["sigterm"] = {"output": proc.communicate(timeout=300)[0],
                          "returncode": proc.returncode, "checkpoint": latest(root_for(trace)),
                          "summary": json.loads(trace.with_suffix(".summary.json").read_text())}
        # 3. the third start resumes from the grace-time checkpoint and finishes
        out["resumed"] = run_job("learn-cpu.yaml", tiny_models, trace, OVERRIDES)
        out["full"] = full.result()
    return out


def test_sigkill_after_a_checkpoint_the_next_start_cleans_up_and_resumes(stopped_twice):
    from pivotrl_hpc.checkpoint.layout import segments
    from pivotrl_hpc.trace import open_trace

    trace, sigterm = stopped_twice["trace"], stopped_twice["sigterm"]
    out = sigterm["output"]
    assert "removed" in out and "segment(s) the killed job" in out, out[-3000:]
    assert stopped_twice["left_by_kill"], "the killed job left no segment: nothing was tested"
    assert not (stopped_twice["left_by_kill"] & shm_entries())  # the killed job's are gone
    assert stopped_twice["resumed"]["left"] == set()
    parts = segments(trace)
    with open_trace(str(parts[1])) as t:
        start = json.loads(json.dumps(t.meta))["resumed_from"]
    assert Path(start).name in ("step-000002", "step-000004")
    with open_trace(str(parts[0])) as t:      # the killed segment: intact, readable
        assert t.summary is None and t.rows("steps") >= 2


def test_sigterm_with_a_grace_time_checkpoints_the_running_step_and_resumes(stopped_twice):
    """No periodic checkpoint is due, yet the job writes one after the step it was running,
    stops as stopped by SIGTERM, and the next start resumes from exactly there: none of the
    steps after the first resume is lost or trained twice."""
    from pivotrl_hpc.checkpoint.layout import segments
    from pivotrl_hpc.trace import open_trace

    trace, sigterm = stopped_twice["trace"], stopped_twice["sigterm"]
    out, ckpt = sigterm["output"], sigterm["checkpoint"]
    assert sigterm["returncode"] == 128 + signal.SIGTERM, out[-3000:]
    assert ckpt is not None, out[-3000:]
    step = json.loads((ckpt / "state.json").read_text())["step"]
    assert sigterm["summary"]["stopped"] == f"checkpointed at step {step} after a stop " \
        "signal", out[-3000:]
    resumed = stopped_twice["resumed"]["output"]
    assert f"resumed from {ckpt}" in resumed, resumed[-3000:]
    parts = segments(trace)
    assert [p.name for p in parts] == ["run.h5", "run.seg1.h5", "run.seg2.h5"]
    with open_trace(str(parts[1])) as t:
        first = int(Path(t.meta["resumed_from"]).name.split("-")[1])
    with open_trace(str(parts[2])) as t:
        assert Path(t.meta["resumed_from"]) == ckpt
    rows = _steps(parts[1:])
    assert [r["step"] for r in rows] == list(range(first, STEPS)), rows
    assert step - first >= 3                  # the second start trained 3 steps before it


def test_the_twice_stopped_run_ends_bitwise_equal_to_an_uninterrupted_one(stopped_twice):
    from pivotrl_hpc.checkpoint.layout import segments

    full, trace = stopped_twice["full"], stopped_twice["trace"]
    parts = segments(trace)
    assert_trace_ok(full["trace"], *parts)    # the killed and the stopped segments too
    want = {r["step"]: r for r in _steps([full["trace"]])}
    got = _steps(parts)
    assert {r["step"] for r in got} == set(range(STEPS))
    for r in got:                             # redone steps too: the same data, version, loss
        assert r == want[r["step"]], r["step"]
    a, b = _final_weights(full["trace"]), _final_weights(trace)
    assert a.keys() == b.keys()
    assert all(bool((a[n] == b[n]).all()) for n in a), "final weights differ"


def test_export_of_the_resumed_run_loads_in_transformers_and_vllm(stopped_twice, tmp_path):
    trace = stopped_twice["trace"]
    _check_export(trace, tmp_path / "export", _final_weights(trace))


def _final_weights(trace: Path) -> dict:
    from safetensors.torch import load_file

    from pivotrl_hpc.checkpoint.layout import latest, root_for
    ckpt = latest(root_for(trace))
    assert ckpt.name == f"step-{STEPS:06d}"
    return load_file(str(ckpt / "policy" / "model.safetensors"))


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
