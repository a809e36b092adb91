"""configs/genrm-heavy-cpu.yaml, the live job in the paper's regime (issue 40): it loads and
validates with its task (judge prompts fit), and its drawn lengths have the paper's shape.
The live figures are `pivotrl bench e2e --config configs/genrm-heavy-cpu.yaml` (docs/design.md)."""
from __future__ import annotations

import argparse
import random
import statistics
from pathlib import Path

import yaml

from pivotrl_hpc.config import load_config
from pivotrl_hpc.controller.live import lengths

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ROOT / "configs" / "genrm-heavy-cpu.yaml"


def paths(models: Path) -> list[str]:
    return [f"models.policy.path={models / 'policy'}", f"models.genrm.path={models / 'genrm'}",
            f"data.train={models / 'data' / 'train.parquet'}",
            f"data.validation={models / 'data' / 'aime-style.parquet'}"]


def test_genrm_heavy_config_validates_and_has_the_papers_shape(tiny_models):
    cfg = load_config(HEAVY, paths(tiny_models))   # check_files: the task is built
    assert cfg.cluster.cpu_share * cfg.total_devices <= 0.8 * 2   # under the 80 % rule here
    L, rng = lengths(cfg), random.Random(0)
    responses = [L.draw(rng, L.rollout_median, L.rollout_sigma, L.rollout_cap)
                 for _ in range(4000)]
    judgements = sorted(L.draw(rng, L.genrm_median, L.genrm_sigma, L.genrm_cap)
                        for _ in range(4000))
    # judgements several times longer than responses (the issue's ~5,000 against ~650)...
    assert statistics.fmean(judgements) >= 5 * statistics.fmean(responses)
    # ... and long-tailed: a step of 16 samples usually holds one near the cap
    assert judgements[int(0.95 * len(judgements))] >= 3 * statistics.median(judgements)
    assert L.mode == "budget" and judgements[int(0.9 * len(judgements))] < L.genrm_cap
    # training short: one TP group, the narrowest width, DP splits every candidate's batch
    assert cfg.roles.train_devices == cfg.roles.train_tensor_parallel == 1


def test_genrm_heavy_bench_searches_every_paradigm(tiny_models):
    """What `bench e2e` runs on it: training widths 1 and 2; disaggregated every split."""
    from pivotrl_hpc.cli import bench_e2e

    args = argparse.Namespace(config=str(HEAVY), overrides=paths(tiny_models),
                              no_search=False, steps=0, repeats=3)
    dis = bench_e2e.candidates(args, "disaggregated")
    assert [[x.rsplit("=", 1)[1] for x in c] for c in dis] == [
        ["1", "2", "1"], ["1", "1", "2"], ["2", "1", "1"]]
    assert bench_e2e.candidates(args, "shiftable") == [["roles.train_devices=1"],
                                                       ["roles.train_devices=2"]]
    w = bench_e2e.workload(args)
    assert w["steps"] == yaml.safe_load(HEAVY.read_text())["rl"]["steps"]   # --steps 0


def test_a_train_steps_work_row_carries_the_trainers_own_seconds():
    """bench e2e's training-step comparison reads `work.engine_s` of TrainSteps: the
    trainer's own seconds (metrics["seconds"]), beside the controller's round trip."""
    from types import SimpleNamespace

    from pivotrl_hpc.controller.report import Reporter
    from pivotrl_hpc.controller.rl import Sample
    from pivotrl_hpc.protocol.engine import Sampling
    from pivotrl_hpc.task.types import PromptData, Score

    rows: list[tuple[str, dict]] = []
    trace = SimpleNamespace(append=lambda table, **row: rows.append((table, row)),
                            flush=lambda: None)
    ctl = SimpleNamespace(clock=SimpleNamespace(now=lambda: 5.0),
                          training=SimpleNamespace(devices=(0,)),
                          cfg=SimpleNamespace(samples="none"),   # no texts: no task needed
                          flows={r: SimpleNamespace(tokens_total=0) for r in ("rollout", "reward")})
    samples = []
    for sid in range(2):
        s = Sample(sid, PromptData(0, (1, 2, 3), "p", "1"), 0, 4, Sampling(), response=[7, 8],
                   version=0, score=Score(1.0, 0.0, True))
        samples.append(s)
    Reporter(ctl, trace).step(0, {"loss": 0.1, "seconds": 0.42}, samples, 0.5)
    work = [row for table, row in rows if table == "work"]
    assert len(work) == 1 and work[0]["seconds"] == 0.5 and work[0]["engine_s"] == 0.42
    assert work[0]["role"] == "training" and work[0]["tokens"] == 10
