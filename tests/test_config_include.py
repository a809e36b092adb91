"""Issue 48, point 3: a user's edit of a copied paper config sticks (a file's own keys win
over its `include`), `pivotrl config --explain` says where each value comes from,
`length_mode: budget` on a real job warns naming eos, and configs/my-job.yaml passes
`pivotrl config` once its paths exist."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from pivotrl_hpc.config import load_config
from pivotrl_hpc.config import run_checks
from pivotrl_hpc.config.schema import Config

ROOT = Path(__file__).resolve().parents[1]
G7 = "qwen2.5-7b_qwen3-30b-a3b"


def _copy_paper_config(tmp_path: Path) -> Path:
    """configs/<G7>.yaml copied with its calibration, with rl.batch_size: 8 (the calibration
    sets 32) and workload.length_mode: eos, as a user edits it."""
    (tmp_path / "calibration").mkdir()
    shutil.copy(ROOT / "configs" / "calibration" / f"{G7}.yaml", tmp_path / "calibration")
    text = (ROOT / "configs" / f"{G7}.yaml").read_text()
    assert text.count("group_size: 16,") == 1 and "batch_size" not in text
    text = text.replace("group_size: 16,", "group_size: 16, batch_size: 8,") + \
        "workload: {length_mode: eos}\n"
    out = tmp_path / "mine.yaml"
    out.write_text(text)
    return out


def test_a_copy_of_a_paper_config_keeps_the_users_edits(tmp_path, caplog):
    mine = _copy_paper_config(tmp_path)
    with caplog.at_level(logging.INFO, logger="pivotrl_hpc.config.load"):
        cfg = load_config(mine, check_files=False)
    assert cfg.rl.batch_size == 8 and cfg.workload.length_mode == "eos"
    # what the edit left alone still comes from the calibration
    cal = load_config(ROOT / "configs" / f"{G7}.yaml", check_files=False)
    assert cfg.calibration == cal.calibration and cfg.calibration.policy_scale != 1.0
    assert cfg.workload.genrm_median == cal.workload.genrm_median
    # and the load says which of the user's values replaced the calibration's
    assert f"rl.batch_size: 8 of {mine} wins over 32 of " in caplog.text
    assert "workload.length_mode: 'eos'" in caplog.text


def test_explain_names_the_source_of_every_value_off_its_default(tmp_path, capsys):
    from pivotrl_hpc.cli.main import main

    mine = _copy_paper_config(tmp_path)
    assert main(["config", str(mine), "--no-check-files", "--explain", "rl.steps=2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    source = {ln.split(":")[0]: ln.rsplit("# ", 1)[1] for ln in lines if "  # " in ln}
    assert source["rl.batch_size"] == str(mine)
    assert source["workload.length_mode"] == str(mine)
    assert source["rl.steps"] == "command line"
    assert source["calibration.policy_scale"] == \
        f"{tmp_path / 'calibration' / (G7 + '.yaml')} (included)"
    assert source["rl.seed"] == str(mine)   # set to the default: listed, it is set
    assert "trace.samples" not in source and "rl.temperature" not in source   # defaults


@pytest.fixture
def fresh_warnings():
    run_checks._warned.clear()
    yield
    run_checks._warned.clear()


def _hf_config(folder: Path, vocab: int) -> str:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(f'{{"vocab_size": {vocab}}}')
    return str(folder)


def test_budget_on_a_real_job_warns_once_naming_eos(tmp_path, caplog, fresh_warnings):
    cfg = Config()
    cfg.models.policy.path = _hf_config(tmp_path / "tiny", 512)
    assert run_checks.check_length_mode(cfg) is None            # a tiny stand-in: fine
    cfg.models.genrm.path = _hf_config(tmp_path / "qwen3", 151936)
    with caplog.at_level(logging.WARNING, logger="pivotrl_hpc.config.run_checks"):
        msg = run_checks.check_length_mode(cfg)
        run_checks.check_length_mode(cfg)
    assert "models.genrm.path holds a real model" in msg and "length_mode: eos" in msg
    assert caplog.text.count("length_mode is budget") == 1        # once
    gpu = Config()
    gpu.cluster.device_kind = "gpu"
    assert "cluster.device_kind is gpu" in run_checks.check_length_mode(gpu)
    gpu.workload.length_mode = "eos"
    assert run_checks.check_length_mode(gpu) is None


def test_pivotrl_config_warns_about_budget_on_a_gpu_config(capsys, caplog, fresh_warnings):
    from pivotrl_hpc.cli.main import main

    with caplog.at_level(logging.WARNING):
        assert main(["config", str(ROOT / "configs" / f"{G7}.yaml"), "--no-check-files"]) == 0
    assert "a real job wants workload.length_mode: eos" in caplog.text


def test_my_job_template_passes_pivotrl_config_once_its_paths_exist(tmp_path, caplog,
                                                                     fresh_warnings):
    from pivotrl_hpc.task.synthetic import write_dataset
    from pivotrl_hpc.assets.models import SPECS, create_model
    from pivotrl_hpc.cli.main import main

    text = (ROOT / "configs" / "my-job.yaml").read_text()
    paths = {"/path/to/Qwen2.5-7B-Instruct": "policy", "/path/to/Qwen3-30B-A3B": "genrm",
             "/path/to/dapo-math-17k.parquet": "data/train.parquet",
             "/path/to/aime-2024.parquet": "data/aime-style.parquet",
             "/path/to/runs/my-job.h5": "runs/my-job.h5"}
    for placeholder, real in paths.items():
        assert placeholder in text, placeholder
        text = text.replace(placeholder, str(tmp_path / real))
    assert not [ln for ln in text.splitlines()                      # every path replaced
                if "/path/to/" in ln and not ln.lstrip().startswith("#")]
    job = tmp_path / "my-job.yaml"
    job.write_text(text)
    with caplog.at_level(logging.INFO):
        assert main(["config", str(job), "--no-check-files"]) == 0
    assert "length_mode is budget" not in caplog.text
    assert main(["config", str(job)]) == 2       # the folders are not there yet
    from dataclasses import replace
    for name in ("policy", "genrm"):   # long enough a context for the template's lengths
        create_model(tmp_path / name, replace(SPECS[name], max_position_embeddings=32768))
    write_dataset(tmp_path / "data", seed=0, train=64, validation=32)
    assert main(["config", str(job)]) == 0
    cfg = load_config(job)
    assert cfg.workload.length_mode == "eos" and cfg.rl.eval_every == 10
    assert cfg.rl.eval_before_train and cfg.rl.checkpoint_every == 20
    assert cfg.trace.loggers == ["console", "tensorboard"]
