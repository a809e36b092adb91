"""The device worker moves through rollout, reward, training and rollout in one process,
with real vLLM, Megatron-Core and a GPS node agent (tests/programs/worker_roles.py); and one
controller loop drives two workers over MPI (tests/programs/worker_mpi.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pivotrl_hpc.gps.shmdir import job_files

PROGRAMS = Path(__file__).parent / "programs"
ENV = dict(os.environ, UCX_MODULES="^ib,rdmacm", OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def report(tiny_models, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("worker") / "report.json"
    p = subprocess.run([sys.executable, str(PROGRAMS / "worker_roles.py"), str(tiny_models),
                        str(out)], capture_output=True, text=True, env=ENV, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(out.read_text())


def test_shift_down_requeues_running_sequences_and_they_resume_exactly(report):
    assert report["held_before_down"] == 3
    assert report["requeued"] == ["b0", "b1", "b2"]
    assert all(n > 0 for n in report["resumed_partial"])  # they had made progress
    assert report["resume_equal"] is True  # tokens equal an uninterrupted greedy run


def test_rollout_and_reward_serve_their_own_models(report):
    # greedy output equals transformers' own greedy decoding of each folder
    assert report["rollout_tokens_match_hf"] is True
    assert report["reward_tokens"] == report["genrm_hf_greedy"]
    assert report["genrm_hf_greedy"] != report["policy_hf_greedy"]  # the check tells them apart


def test_abort_one_then_all_and_resume_exactly(report):
    a = report["abort"]
    assert a["one"] == ["x1"] and a["rest"] == ["x0", "x2"] and a["running_after"] == 0
    assert all(n > 0 for n in a["partial"].values())
    assert a["resume_equal"] is True


ROLE_ERRORS = {  # command sent -> (role it was sent in, RoleError message)
    "step_idle": ("idle", "worker is idle, not an inference replica"),
    "abort_idle": ("idle", "worker is idle, not an inference replica"),
    "train_idle": ("idle", "train step while idle"),
    "wait_write_idle": ("idle", "no published policy version to wait for"),
    "up_to_idle": ("idle", "shift up needs a role"),
    "down_idle": ("idle", "shift down while idle"),
    "up_while_rollout": ("rollout", "shift up to reward while rollout: shift down first"),
    "train_while_rollout": ("rollout", "train step while rollout"),
    "add_while_training": ("training", "worker is training, not an inference replica"),
    "step_while_training": ("training", "worker is training, not an inference replica"),
}


def test_every_role_error_is_refused_and_leaves_the_role(report):
    got = report["role_errors"]
    assert set(got) == set(ROLE_ERRORS)
    for name, (role, message) in ROLE_ERRORS.items():
        assert got[name]["ok"] is False and got[name]["role"] == role, name
        assert got[name]["error"].startswith(f"RoleError: {message}"), (name, got[name])
    # the refused rollout commands touched nothing: the held sequences resumed exactly
    assert report["held_before_down"] == 3 and report["resume_equal"] is True


def test_rollout_and_training_logprobs_agree(report):
    # vLLM's sampling logprobs vs Megatron's on the same weights (float32): within 1e-4
    assert report["logprob_max_abs_diff"] < 1e-4
    assert report["logprob_max_abs_diff_trained"] < 1e-4


def test_training_shift_keeps_optimizer_state_bitwise(report):
    assert report["optimizer_bitwise_equal"] is True
    assert report["version_after_step"] == 1
    off = report["offload_published"]
    p = off["param_bytes"]
    # Adam's exp_avg and exp_avg_sq (2 x params) plus step counters go to host; so do the
    # fp32 grads; all of it comes back on shift up
    assert 0 <= off["host"]["optimizer_state"] - 2 * p < 4096
    assert off["host"]["grads"] == p and off["freed"]["main_params"] == 0  # fp32 training
    assert report["reload_bytes"] == off["freed"]


def test_training_params_are_discarded_and_read_back_from_gps(report):
    off = report["offload_published"]
    assert off["freed"]["params"] == off["param_bytes"] > 0 and off["storage_left"] == 0
    assert off["host"]["params"] == 0  # stateless: freed without a host copy
    assert report["training_first_read"] == 0
    # shift up Reads exactly the version the trainer published, through GPS
    assert report["training_up_reads"] == [["policy", 1]]
    assert report["training_up_result"] == {"version": 1, "read": 1}
    assert "parameters.read" in report["phases"]["training_up"]
    assert report["params_bitwise_equal"] is True  # GPS Read gives them back exactly


def test_unpublished_training_step_survives_a_shift(report):
    assert report["unpublished_step_changed_params"] is True  # the step did train
    off = report["offload_unpublished"]
    assert off["host"]["params"] == off["freed"]["params"] == off["param_bytes"]  # kept
    up = report["unpublished_up"]
    assert up["reads"] == [] and up["result"]["read"] is None  # no GPS Read over them
    assert "parameters.read" not in up["phases"]
    assert report["unpublished_step_kept"] is True


def test_shift_down_waits_for_a_published_write_in_flight(report):
    f = report["in_flight"]
    assert f["pending"] is True and f["gps_version"] == 2  # not waited for before the shift
    assert "gps_replicate_wait" in f["down_phases"]
    assert f["reads"] == [["policy", 2]] and f["params_equal"] is True
    assert report["version_after_second_publish"] == 2


def test_rollout_after_training_reads_the_new_policy(report):
    assert report["rollout_version"] == 2 and report["rollout_reads"] == [["policy", 2]]
    assert report["tokens_changed"] is True  # greedy tokens, not only their logprobs


def test_failed_command_names_the_sequences_held(report):
    f = report["failure"]
    assert f["ok"] is False and f["command"] == "AddSequences"
    assert f["seq_ids"] == ["h0", "h1"] and "max_model_len" in f["error"]
    assert report["shutdown_requeued"] == ["h0", "h1"]  # nothing lost at shutdown either


def test_no_shared_memory_left_behind(report):
    # The agent's own shutdown is checked before any sweep: gps.local.local_agent raises
    # AgentLeakError (the program then writes no report) if it left a segment.
    assert not job_files(report["job"])


def test_shift_phases_are_named_by_context_kind(report):
    ph = report["phases"]
    assert {"parameters.read", "parameters.load", "total"} <= set(ph["rollout_up"])
    assert report["rollout_up_read"] == 0
    assert any(k.startswith("offloadable.offload.optimizer_state") for k in ph["training_down"])
    assert any(k.startswith("offloadable.reload.") for k in ph["training_up"])


# Baseline: RSS after the rollout shift down, in the same run. While up, the GenRM engine
# holds its 128 MiB KV cache (measured +265 MiB in all); after its shift down RSS must be
# within RSS_MARGIN_MIB of the baseline. Measured +32 MiB (code and allocator pages of the
# process's first GenRM engine); a kept KV cache (128 MiB) exceeds the margin.
GENRM_KV_MIB = 128
RSS_MARGIN_MIB = 64


def test_memory_returns_after_inference_shift_down(report):
    base = report["rss_after_rollout_down_mib"]
    assert report["rss_after_reward_up_mib"] - base >= GENRM_KV_MIB
    assert report["rss_after_reward_down_mib"] - base <= RSS_MARGIN_MIB


def test_one_controller_loop_drives_two_workers_over_mpi(tiny_models, tmp_path):
    out = tmp_path / "mpi.json"
    p = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "3",
                        sys.executable, str(PROGRAMS / "worker_mpi.py"), str(tiny_models),
                        str(out)], capture_output=True, text=True, env=ENV, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["idle_shift_down"]["ok"] is False
    assert r["idle_shift_down"]["error"] == ["RoleError: shift down while idle"]
    # both shifted up at once; each reply came from its own worker
    assert [(u["ok"], u["role"], u["result"]) for u in r["up"]] == [
        (True, "rollout", {"version": 0, "read": 0}), (True, "training", {"version": 0, "read": 0})]
    assert sorted(r["finished"]) == ["q0", "q1", "q2"]
    assert all(len(t) == 8 for t in r["finished"].values())
    # while training stepped and published, the rollout worker kept serving version 0
    assert r["train"]["ok"] and r["train"]["role"] == "training"
    assert r["train"]["result"]["gps_version"] == 1 and r["wait_write"]["result"]["version"] == 1
    assert list(r["during_training"].values()) == list(r["finished"].values())
    # after a shift the rollout worker Reads the published version: its greedy tokens change
    assert r["up_new"]["ok"] and r["up_new"]["result"] == {"version": 1, "read": 1}
    assert r["after_training"] != r["finished"]
    # Shutdown while training, a Write in flight: it waits for it, GPS holds it whole
    assert r["train2"]["result"]["gps_version"] == 2
    sd = r["train_shutdown"]
    assert sd["ok"] and sd["role"] == "idle" and sd["result"] == []
    assert "gps_replicate_wait" in sd["phases"] and r["gps_current"] == 2
    assert r["shutdown"]["ok"] and r["shutdown"]["result"] == []
