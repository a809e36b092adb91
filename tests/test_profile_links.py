"""`pivotrl profile links`: a measured `gps.links` fragment that a run config takes and that
reaches the node agents' replication plans."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from live_util import model_overrides

from pivotrl_hpc.cli.main import main as pivotrl
from pivotrl_hpc.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


def overrides_of(fragment: dict) -> list[str]:
    return [f"gps.links.{k}={v}" for k, v in fragment["gps"]["links"].items()]


@pytest.mark.slow
def test_measured_links_go_into_the_config_and_the_agent(tiny_models, tmp_path, capsys):
    from pivotrl_hpc.launch.entry import AgentThread
    out = tmp_path / "links.yaml"
    assert pivotrl(["profile", "links", "--out", str(out), "--size-mb", "160",
                    "--repeats", "2"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    fragment = yaml.safe_load(out.read_text())
    links = fragment["gps"]["links"]
    assert summary["remote"] and {k: summary[k] for k in links} == links
    assert links["local_bps"] > 1e8 and links["remote_bps"] > 1e7 and links["overhead_s"] >= 0
    assert links != {"local_bps": 10e9, "remote_bps": 2e9, "overhead_s": 20e-6}  # measured
    cfg = load_config(ROOT / "configs" / "tiny-cpu.yaml",
                      [*model_overrides(tiny_models), *overrides_of(fragment)])
    agent = AgentThread(cfg, None, "linkstest", "n0").agent
    assert (agent.cfg.links.local_bps, agent.cfg.links.remote_bps,
            agent.cfg.links.overhead_s) == (links["local_bps"], links["remote_bps"],
                                            links["overhead_s"])


def test_links_must_be_positive(tiny_models):
    base = [*model_overrides(tiny_models)]
    for key, value in (("remote_bps", 0), ("local_bps", -1.0), ("overhead_s", -1e-6)):
        with pytest.raises(ConfigError) as e:
            load_config(ROOT / "configs" / "tiny-cpu.yaml", [*base, f"gps.links.{key}={value}"])
        assert e.value.key == f"gps.links.{key}"
