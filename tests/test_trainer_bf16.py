"""Training in bf16 on the device worker: bf16 params, fp32 main params (Megatron's
mixed-precision optimizer); a re-shift-up keeps the fp32 master weights from host and
never refreshes them from the bf16 params (tests/programs/trainer_bf16.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROGRAM = Path(__file__).parent / "programs" / "trainer_bf16.py"


@pytest.fixture(scope="module")
def report(tiny_models, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bf16") / "report.json"
    env = dict(os.environ, UCX_MODULES="^ib,rdmacm", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(PROGRAM), str(tiny_models / "policy"), str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(out.read_text())


def test_bf16_params_are_the_rounded_fp32_main_params(report):
    assert report["param_dtypes"] == ["torch.bfloat16"]
    assert report["main_dtypes"] == ["torch.float32"]
    assert report["main_from_first_load"] is True  # the first load sets the master weights
    steps = report["steps"]
    assert [s["gps_version"] for s in steps] == [1, 2] and report["version"] == 2
    assert all(s["update_applied"] == 1.0 and s["tokens"] > 0 for s in steps)
    assert report["params_are_rounded_main"] is True
    assert report["main_finer_than_bf16"] is True  # so a rounding of them would show


def test_shift_moves_fp32_main_params_to_host_and_discards_bf16_params(report):
    p = report["param_bytes"]
    assert report["freed"]["params"] == p > 0 and report["host"]["params"] == 0
    assert report["host"]["main_params"] == report["freed"]["main_params"] == 2 * p
    assert 0 <= report["host"]["optimizer_state"] - 4 * p < 4096  # fp32 exp_avg, exp_avg_sq


def test_reshift_up_reads_params_and_keeps_fp32_master_weights(report):
    assert report["up_result"] == {"version": 2, "read": 2}
    assert "parameters.read" in report["up_phases"]
    assert report["params_bitwise_after_up"] is True
    assert report["main_bitwise_after_up"] is True  # not refreshed from the bf16 params
    assert report["step_after_up"]["update_applied"] == 1.0


def test_checkpoint_restores_fp32_master_weights_not_the_rounded_bf16(report):
    """A resumed trainer loads bf16 params from the checkpoint's policy (which rounds the
    master weights), then its optimizer file: master weights and Adam state come back bit for
    bit, and the next step equals the one taken without the interruption."""
    assert report["ckpt_result"]["rank"] == 0 and report["ckpt_result"]["optim_bytes"] > 0
    assert report["ckpt_result"]["policy_bytes"] > 0
    assert report["ckpt_params_bitwise"] is True
    assert report["ckpt_refresh_rounds_main"] is True   # what the optimizer file undoes
    assert report["ckpt_main_bitwise"] is True
    assert report["ckpt_next_step_bitwise"] is True


def test_a_resumed_trainer_shifts_down_and_up_bit_for_bit(report):
    """A restarted job's first training shift up restores the checkpoint (torch.load of the
    optimizer file); the next shift down must be able to free that state (it failed with
    "Trying to resize storage that is not resizable": the file's storages), and the shift up
    gives back parameters, fp32 master weights and Adam state bit for bit."""
    assert report["resume_state_bitwise"] is True
    assert report["resume_shift_down_error"] is None
    freed = report["resume_freed"]
    assert freed["optimizer_state"] > 0 and freed["main_params"] == 2 * report["param_bytes"]
    assert report["resume_shift_bitwise"] is True
    assert report["resume_next_step_bitwise"] is True
