"""Megatron-Core trainer on CPU (gloo): real GPTModel, DDP, Megatron optimizer, GRPO steps.

Three layouts run once per module, concurrently, each as its own process group
(tests/programs/megatron_scenarios.py): TP=1 in one process, TP=2 over two processes, and
TP=1 x DP=2 over two processes with Megatron's DistributedOptimizer (sharded Adam state and
fp32 main shards). The tests below assert on the numbers they measured.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "tests" / "programs" / "megatron_scenarios.py"
# name -> (world size, TP, extra program args)
LAYOUTS = {"tp1": (1, 1, []), "tp2": (2, 2, []), "dp2": (2, 1, ["distopt"])}
LOGIT_TOL = 1e-4      # float32 Megatron vs transformers, same weights
LAYOUT_LOSS_TOL = 1e-5  # same math, different reduction order across TP/DP layouts


def _program(name: str):
    spec = importlib.util.spec_from_file_location(name, PROGRAM.parent / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _launch(name: str, model_dir: Path, out: Path, rdv: dict) -> list[subprocess.Popen]:
    """Start the layout's ranks; `rdv` points them at a store bound here (no port race)."""
    world, tp, extra = LAYOUTS[name]
    out.mkdir(parents=True)
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **rdv)
        log = open(out / f"log{rank}.txt", "w")
        procs.append(subprocess.Popen([sys.executable, str(PROGRAM), str(model_dir), str(out),
                                       str(tp), *extra], env=env, stdout=log,
                                      stderr=subprocess.STDOUT))
    return procs


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory) -> dict[str, list[dict]]:
    base = tmp_path_factory.mktemp("megatron")
    started = time.monotonic()
    rendezvous = _program("rendezvous")
    stores = {name: rendezvous.bound_store(LAYOUTS[name][0]) for name in LAYOUTS}
    procs = {name: _launch(name, tiny_models / "policy", base / name,
                           rendezvous.agent_store_env(stores[name])) for name in LAYOUTS}
    results = {}
    for name, group in procs.items():
        for rank, p in enumerate(group):
            try:
                rc = p.wait(timeout=max(1.0, 240 - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                for q in group:
                    q.kill()
                rc = "timeout"
            if rc != 0:
                tail = (base / name / f"log{rank}.txt").read_text()[-3000:]
                pytest.fail(f"{name} rank {rank} failed ({rc}):\n{tail}")
        results[name] = [json.loads((base / name / f"rank{r}.json").read_text())
                         for r in range(len(group))]
    return results


def _fixed_batch():
    return _program("megatron_scenarios").fixed_batch()


def _all(runs):
    return [(name, r) for name, ranks in runs.items() for r in ranks]


def test_layouts_and_shim_applied_without_cuda(runs):
    assert runs["tp2"][0]["layout"]["tp_size"] == 2 and runs["tp2"][1]["layout"]["tp_rank"] == 1
    assert runs["dp2"][1]["layout"]["dp_size"] == 2 and runs["dp2"][1]["layout"]["dp_rank"] == 1
    assert runs["dp2"][0]["distopt"] is True and runs["tp1"][0]["distopt"] is False
    for name, r in _all(runs):
        assert r["cuda_available"] is False, name
        assert r["shim_applied"] is True, name


def test_hf_load_matches_transformers_logits(runs):
    for name, r in _all(runs):
        assert r["hf_logits_absmax"] > 0.1  # the comparison is not between two near-zero outputs
        assert r["hf_logits_maxdiff"] < LOGIT_TOL, (name, r["hf_logits_maxdiff"])
        # vocab-parallel log-softmax (TP=2: each rank holds half the vocabulary)
        assert r["hf_logprobs_maxdiff"] < LOGIT_TOL, (name, r["hf_logprobs_maxdiff"])


def test_training_steps_lower_the_loss(runs):
    batch = _fixed_batch()
    for name, r in _all(runs):
        m = r["metrics"]
        losses = [x["loss"] for x in m]
        assert all(b < a for a, b in zip(losses, losses[1:])), (name, losses)
        assert losses[0] - losses[-1] > 0.1, (name, losses)
        assert all(x["tokens"] == batch.num_response_tokens for x in m)
        assert all(x["update_applied"] == 1.0 and x["grad_norm"] > 0 for x in m)
        # First step is on-policy: every ratio is 1 and nothing is clipped; later steps move
        # the policy away from the behaviour logprobs until the clip range binds.
        assert abs(m[0]["mean_ratio"] - 1.0) < 1e-6 and m[0]["clip_fraction"] == 0.0
        assert m[-1]["mean_ratio"] > 1.0 and m[-1]["clip_fraction"] > 0.0


def test_recomputed_old_logprobs_start_a_stale_step_on_policy(runs):
    for name, r in _all(runs):
        b, rc = r["stale_behaviour"], r["stale_recompute"]
        assert b["clip_fraction"] > 0.3 and abs(b["mean_ratio"] - 2.718) < 0.01, (name, b)
        assert abs(rc["mean_ratio"] - 1.0) < 1e-6 and rc["clip_fraction"] == 0.0, (name, rc)
        assert abs(rc["behaviour_log_ratio"] - 1.0) < 0.05, (name, rc)


def test_tp2_and_dp2_losses_equal_tp1(runs):
    ref = runs["tp1"][0]["metrics"]
    for name in ("tp2", "dp2"):
        for r in runs[name]:
            for a, b in zip(ref, r["metrics"]):
                assert abs(a["loss"] - b["loss"]) < LAYOUT_LOSS_TOL, (name, a["loss"], b["loss"])
                assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * a["grad_norm"], name
                assert abs(a["clip_fraction"] - b["clip_fraction"]) < 1e-9, name


def test_offload_reload_is_bitwise_and_step_unchanged(runs):
    for name, r in _all(runs):
        b = r["offload_bytes"]
        dp = r["layout"]["dp_size"]
        # Adam keeps exp_avg and exp_avg_sq per param (sharded over DP by the distributed
        # optimizer), plus a few bytes of step counters.
        assert 0 <= b["optimizer_state"] - 2 * b["params"] / dp < 4096, (name, b)
        assert b["grads"] == b["params"] > 0, (name, b)  # fp32 grad buffer, one slot per param
        # fp32 training: the main params are the model params (or views of their buffer).
        assert b["main_params"] == 0, (name, b)
        partial = r["partial_offload_bytes"]
        assert partial["params"] == 0 and r["params_resident_bytes"] == b["params"], name
        assert partial["optimizer_state"] == b["optimizer_state"], name
        assert r["freed_storage_bytes_while_offloaded"] == 0, name
        # the trainer's own check, not torch's error on a freed parameter
        assert r["step_while_offloaded_error"] == \
            "trainer state is offloaded; call reload() first", name
        assert r["state_bitwise_after_reload"] is True, name
        assert r["params_bitwise_after_reload"] is True, name
        assert r["loss_shifted"] == r["loss_plain"], name
        assert r["params_after_step_bitwise"] is True, name
        for phases in (r["offload_seconds"], r["reload_seconds"]):
            assert set(phases) >= {"optimizer_state", "grads", "params", "total"}
    # TP=2 splits every matrix: each rank offloads about half of what TP=1 does.
    half = runs["tp2"][0]["offload_bytes"]["params"] / runs["tp1"][0]["offload_bytes"]["params"]
    assert 0.45 < half < 0.55


def test_export_hf_after_training_matches_megatron_forward(runs):
    for name, r in _all(runs):
        assert r["export_missing"] == [] and r["export_unexpected"] == [], name
        assert r["export_max_weight_change"] > 1e-4, name  # training really changed weights
        assert r["export_logits_maxdiff"] < LOGIT_TOL, (name, r["export_logits_maxdiff"])
        assert r["export_slices_match_full"] is True, name
        assert r["export_slice_names"] == 27, name  # every HF tensor of the tiny policy
