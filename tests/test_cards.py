"""Model cards of the paper's models (assets/cards.py) and `pivotrl simulate` on a paper model
group whose folders are not here (sim/standin.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pivotrl_hpc.assets.cards import CARDS, card_for
from pivotrl_hpc.gps.shapes import ModelShape

ROOT = Path(__file__).resolve().parents[1]
GROUPS = sorted(p.name for p in (ROOT / "configs").glob("qwen*.yaml"))
# the parameter counts the models' hub pages state (total, and active for the MoE ones)
PUBLISHED = {"Qwen2.5-1.5B": (1.54e9, None), "Qwen2.5-7B": (7.61e9, None),
             "Qwen2.5-32B": (32.5e9, None), "Qwen2.5-72B": (72.7e9, None),
             "GLM-Z1-9B": (9.4e9, None), "Qwen3-30B-A3B": (30.5e9, 3.3e9),
             "Qwen3.5-122B-A10B": (122e9, 10e9)}


@pytest.mark.parametrize("name", sorted(CARDS))
def test_each_card_has_its_models_published_parameter_count(name):
    shape = ModelShape.from_hf_config(CARDS[name])
    total, active = PUBLISHED[name]
    assert abs(shape.num_params() / total - 1) < 0.02, shape.num_params()
    if active is not None:
        assert abs(shape.num_active_params() / active - 1) < 0.05


def test_hybrid_attention_keeps_kv_in_its_full_attention_layers_only():
    q35 = ModelShape.from_hf_config(CARDS["Qwen3.5-122B-A10B"])
    assert q35.kv_bytes_per_token(2) == 2 * 12 * 2 * 256 * 2   # 12 of 48 layers, 2 KV heads
    dense = ModelShape.from_hf_config(CARDS["Qwen2.5-7B"])
    assert dense.kv_bytes_per_token(2) == 2 * 28 * 4 * 128 * 2


def test_a_folder_name_finds_its_card():
    assert card_for("/models/Qwen2.5-7B")[0] == "Qwen2.5-7B"
    assert card_for("/models/Qwen2.5-7B-Instruct/")[0] == "Qwen2.5-7B"
    assert card_for("/m/Qwen2.5-72B")[0] == "Qwen2.5-72B"       # not Qwen2.5-7B
    assert card_for("/models/GLM-Z1-9B-0414")[0] == "GLM-Z1-9B"
    assert card_for("/models/Mixtral-8x7B") is None


@pytest.mark.parametrize("group", GROUPS)
def test_the_paper_configs_name_their_cards_architectures(group):
    from pivotrl_hpc.config import load_config
    cfg = load_config(ROOT / "configs" / group, check_files=False)
    for m in (cfg.models.policy, cfg.models.genrm):
        name, card = card_for(m.path)
        assert card["architectures"] == [m.architecture], name


@pytest.mark.parametrize("group", GROUPS)
def test_simulate_runs_a_paper_group_without_its_folders(group):
    """With constants derived from the H20 and the group's models (sim/profile.py); the
    responses are cut to ~1 % of the paper's lengths to keep the suite fast (a paper-length
    step takes minutes of wall time: docs/design.md, "Simulator")."""
    p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "simulate",
                        str(ROOT / "configs" / group), "--paradigms", "shiftable", "--no-search",
                        "rl.steps=1", "workload.rollout_median=25",
                        "workload.genrm_median=15"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["shiftable"]["tokens_per_s"] > 0
    # the paper configs include their calibration (configs/calibration/), which scales it
    assert out["constants"]["source"] == "profile H20-96GB, calibrated"
    assert out["constants"]["train_s_per_token"] > 0
    from pivotrl_hpc.reproduce.paper import PAPER_SHIFT_RATIOS
    assert out["paper_speedup_vs"] == {p: pytest.approx(r[Path(group).stem], abs=1e-3)
                                       for p, r in PAPER_SHIFT_RATIOS.items()}
    notes = " ".join(out["stood_in"])
    assert "models.policy.path" in notes and "models.genrm.path" in notes
    assert "model card" in notes and "synthetic arithmetic dataset" in notes


def test_simulate_refuses_an_unknown_absent_model_and_a_too_small_kv_cache():
    group = str(ROOT / "configs" / GROUPS[0])
    for extra, words in ((["models.genrm.path=/nowhere/Mixtral-8x7B"], "names no model card"),
                         (["roles.kv_cache_mb=16"], "raise it to at least")):
        p = subprocess.run([sys.executable, "-m", "pivotrl_hpc.cli.main", "simulate", group,
                            *extra], capture_output=True, text=True, timeout=300)
        assert p.returncode == 2 and words in p.stderr, p.stderr[-2000:]
