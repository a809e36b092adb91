"""A checkpoint another account could change: a live job's checkpoint in a set-group-ID
project folder of group `nogroup`, written under umask 002 (as a shared project's users
have it), attacked by the real `nobody` (a member of that group: setpriv, the system Python,
the standard library only).

- every file and folder of the checkpoint is the user's alone (0600 / 0700) whatever the
  umask: `nobody` can open none of its files for writing (before: policy/ 2775 and
  model.safetensors, state.json, COMPLETE 0664; `nobody` zeroed all 27 tensors and the
  resume said "resumed from ... step-000001" and trained on them: loss 0.0000, exit 0);
- should the user open a file to the group (or a checkpoint of an older pivotrl be), a change
  is refused at resume by its manifest: `pivotrl run` exits 2 before any rank starts, one
  line naming the file and the tensor, even after the mode is closed again.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from live_util import ROOT, model_overrides, run_job

pytestmark = pytest.mark.slow

NOBODY = 65534
# one training step, checkpointed: the smallest live job that writes every kind of file
OVERRIDES = ["paradigm.name=disaggregated", "rl.steps=1", "rl.batch_size=4",
             "rl.temperature=0", "rl.staleness=0", "rl.checkpoint_every=1",
             "cluster.devices_per_node=3", "cluster.cpu_share=0.53",
             "paradigm.initial_rollout_devices=1"]

# nobody, standard library only: zero every tensor of a safetensors file it can open for
# writing, and say which of the checkpoint's files it could open so
POISON = r"""
import json, os, struct, sys
step, weights = sys.argv[1], sys.argv[2]
writable = []
for top, dirs, files in os.walk(step):
    for name in files:
        path = os.path.join(top, name)
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NOFOLLOW))
            writable.append(os.path.relpath(path, step))
        except OSError:
            pass
zeroed = 0
try:
    with open(weights, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                a, b = info["data_offsets"]
                f.seek(8 + n + a)
                f.write(bytes(b - a))
                zeroed += 1
except OSError as e:
    print("refused:", e.strerror)
print(json.dumps({"writable": sorted(writable), "zeroed": zeroed}))
"""


def _as_nobody(*args: str) -> dict:
    import json

    p = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--groups=65534",
                        "/usr/bin/python3", "-I", "-c", POISON, *args],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.splitlines()[-1])


@pytest.fixture
def project():
    """A set-group-ID project folder of group nogroup (nobody's), writable only by its owner."""
    if os.getuid() != 0 or not Path("/usr/bin/python3").exists():
        pytest.skip("running code as a second account needs root and the system Python")
    top = Path(tempfile.mkdtemp(prefix="pivotrl-project-", dir="/tmp"))
    os.chmod(top, 0o755)
    out = top / "out"
    out.mkdir()
    os.chown(out, 0, NOBODY)
    os.chmod(out, 0o2755)
    yield out
    shutil.rmtree(top, ignore_errors=True)


def test_a_group_member_cannot_poison_a_checkpoint_and_a_change_is_refused_at_resume(
        tiny_models, project):
    trace = project / "run.h5"
    old = os.umask(0o002)
    try:
        run_job("learn-cpu.yaml", tiny_models, trace, OVERRIDES)
    finally:
        os.umask(old)
    step = project / "run.checkpoints" / "step-000001"
    weights = step / "policy" / "model.safetensors"
    modes = {str(p.relative_to(step)): p.stat().st_mode & 0o777
             for p in [step, *step.rglob("*")]}
    assert {m for p, m in modes.items() if (step / p).is_dir()} == {0o700}, modes
    assert {m for p, m in modes.items() if (step / p).is_file()} == {0o600}, modes
    assert len(modes) >= 11 and "optim/rank-000.safetensors" in modes
    # the group member can write none of it, the weights included
    assert _as_nobody(str(step), str(weights)) == {"writable": [], "zeroed": 0}

    # the user opens the weights to the group; nobody zeroes them; the user closes them again
    path = (step.parent, step, step / "policy")
    for folder in path:
        os.chmod(folder, 0o750)
    os.chmod(weights, 0o660)
    got = _as_nobody(str(step), str(weights))
    assert got == {"writable": ["policy/model.safetensors"], "zeroed": 27}, got
    for f in (weights, *path):
        os.chmod(f, 0o700 if f.is_dir() else 0o600)
    cmd = [sys.executable, "-m", "pivotrl_hpc.cli.main", "run",
           str(ROOT / "configs" / "learn-cpu.yaml"), *model_overrides(tiny_models),
           f"trace.path={trace}", *OVERRIDES, "rl.steps=2"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"{weights} changed since the checkpoint was written: tensor " in p.stderr
    assert "(and 26 more of 27) differs" in p.stderr, p.stderr
    assert not trace.with_name("run.seg1.h5").exists()   # no rank started
