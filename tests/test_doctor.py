"""`pivotrl doctor`: every failure is produced for real and its fix hint is asserted.

Python packages are broken by shadowing them on PYTHONPATH (the doctor imports each in a
subprocess that inherits the environment), binaries by a PATH that lacks them or holds a
failing stand-in, Slurm by a SLURM_CONF that is missing or names a dead controller.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pivotrl_hpc.launch import doctor
from pivotrl_hpc.launch.doctor import PY_CHECKS, mpirun_check, python_check, shm_check, slurm_check

# component -> top-level module its snippet imports first
SHADOWED = {"torch": "torch", "vllm": "vllm", "transformers_qwen2": "transformers",
            "megatron-core": "megatron", "nixl": "nixl", "mpi4py": "mpi4py",
            "submitit": "submitit", "h5py": "h5py"}
LOCAL_HINT = "slurm/local/cluster.sh start"


def _shadow(root: Path, body: str) -> Path:
    """A PYTHONPATH folder whose packages replace every checked one with `body`."""
    for module in SHADOWED.values():
        (root / module).mkdir(parents=True, exist_ok=True)
        (root / module / "__init__.py").write_text(body)
    return root


def _bin(folder: Path, name: str, script: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(0o755)
    return folder


def test_shadow_table_covers_every_python_check():
    assert set(SHADOWED) == set(PY_CHECKS)


@pytest.mark.parametrize("name", sorted(PY_CHECKS))
def test_broken_import_reports_error_and_fix(name, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(_shadow(tmp_path, "raise ImportError('shadowed')")))
    snippet, hint = PY_CHECKS[name]
    check = python_check(snippet, hint)
    assert (check.ok, check.version) == (False, None)
    assert check.detail == f"ImportError: shadowed; fix: {hint}"


def test_hanging_import_times_out_with_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(_shadow(tmp_path, "import time; time.sleep(60)")))
    snippet, hint = PY_CHECKS["h5py"]
    check = python_check(snippet, hint, timeout=1.0)
    assert not check.ok and check.detail == f"import timed out after 1 s; {hint}"


def test_python_check_reports_version_when_it_imports(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(_shadow(tmp_path, "__version__ = '9.8.7'")))
    check = python_check(PY_CHECKS["h5py"][0], PY_CHECKS["h5py"][1])
    assert (check.ok, check.version, check.detail) == (True, "9.8.7", "imports")


def test_mpirun_missing_from_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    check = mpirun_check()
    assert not check.ok and check.detail == "mpirun not on PATH; fix: apt-get install openmpi-bin"


def test_mpirun_that_fails(tmp_path, monkeypatch):
    real_path = os.environ["PATH"]
    # A stand-in mpirun that exits 3: injects a broken installation, which cannot be
    # produced otherwise without breaking the machine's real Open MPI.
    monkeypatch.setenv("PATH", str(_bin(tmp_path, "mpirun", "exit 3")))
    check = mpirun_check()
    assert not check.ok and "`mpirun --version` fails" in check.detail
    assert check.detail.endswith("fix: apt-get install --reinstall openmpi-bin")
    monkeypatch.setenv("PATH", real_path)   # the real one: its version is parsed
    real = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
    check = mpirun_check()
    assert check.ok and re.fullmatch(r"\d+\.\d+\.\d+", check.version)
    assert f"(Open MPI) {check.version}" in real


def test_sinfo_missing_from_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    check = slurm_check()
    assert not check.ok and check.detail == "Slurm client missing; fix: apt-get install slurm-wlm"


def test_slurm_conf_that_does_not_exist(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere" / "slurm.conf"
    monkeypatch.setenv("SLURM_CONF", str(missing))
    check = slurm_check()   # real sinfo would retry this for 60 s
    assert not check.ok
    assert check.detail.startswith(f"SLURM_CONF={missing} does not exist; fix: point "
                                   "SLURM_CONF at the cluster's slurm.conf")
    assert LOCAL_HINT in check.detail


def test_slurm_conf_with_dead_controller(tmp_path, monkeypatch):
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=doctortest\nSlurmctldHost=localhost\nSlurmctldPort=1\n"
                    "MessageTimeout=1\nTCPTimeout=1\nNodeName=n1 CPUs=1 State=UNKNOWN\n"
                    "PartitionName=p Nodes=n1 Default=YES\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    check = slurm_check()
    assert not check.ok and check.version      # the client itself works
    assert check.detail.startswith("no reachable slurmctld (")
    assert "Unable to contact slurm controller" in check.detail and LOCAL_HINT in check.detail


def test_sinfo_that_hangs(tmp_path, monkeypatch):
    script = (f'if [ "$1" = --version ]; then echo "slurm 22.05.8"; '
              f'else exec {shutil.which("sleep")} 30; fi')
    monkeypatch.setenv("PATH", str(_bin(tmp_path / "bin", "sinfo", script)))
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    check = slurm_check(timeout=1.0)
    assert (check.ok, check.version) == (False, "22.05.8")
    assert check.detail.startswith(f"sinfo timed out after 1 s: controller unreachable "
                                   f"(config {conf})") and LOCAL_HINT in check.detail


def test_reachable_controller_reports_nodes(tmp_path, monkeypatch):
    script = 'if [ "$1" = --version ]; then echo "slurm 22.05.8"; else echo "2 idle"; fi'
    monkeypatch.setenv("PATH", str(_bin(tmp_path / "bin", "sinfo", script)))
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    check = slurm_check()
    assert check.ok and check.detail == "controller reachable (SLURM_CONF): nodes 2 idle"


def test_shm_too_small_and_missing(tmp_path):
    small = shm_check(1e9)
    assert not small.ok and "GiB free of" in small.detail
    assert small.detail.endswith("fix: mount -o remount,size=<bytes> /dev/shm "
                                 "(need 1000000000.0 GiB)")
    gone = shm_check(1.0, str(tmp_path / "no-shm"))
    assert not gone.ok and gone.detail.startswith(f"{tmp_path / 'no-shm'} unusable: ")
    assert gone.detail.endswith(f"fix: mount -t tmpfs tmpfs {tmp_path / 'no-shm'}")
    assert shm_check(0.0).ok and "fix" not in shm_check(0.0).detail


def test_cli_reports_every_failure_and_exits_1(tmp_path):
    """The whole doctor with everything broken: exit 1, each component's hint in --json,
    and the text form names what to fix."""
    env = dict(os.environ, PYTHONPATH=str(_shadow(tmp_path / "py", "raise ImportError('x')")),
               PATH=str(tmp_path / "empty"), UCX_MODULES="^ib,rdmacm")
    env.pop("SLURM_CONF", None)
    cmd = [sys.executable, "-m", "pivotrl_hpc.cli.main", "doctor", "--shm-min-gb", "1e9"]
    p = subprocess.run(cmd + ["--json"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 1, p.stderr
    report = json.loads(p.stdout)
    assert set(report) == set(PY_CHECKS) | {"mpirun", "slurm", "shm"}
    assert not any(r["ok"] for r in report.values())
    for name, (_, hint) in PY_CHECKS.items():
        assert report[name]["detail"].endswith(f"fix: {hint}"), name
    assert "fix: apt-get install openmpi-bin" in report["mpirun"]["detail"]
    assert "fix: apt-get install slurm-wlm" in report["slurm"]["detail"]
    assert "fix: mount -o remount" in report["shm"]["detail"]
    text = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert text.returncode == 1
    last = text.stdout.strip().splitlines()[-1]
    assert last == "0/11 components ok; fix: " + ", ".join(report)
    assert all(line.startswith("FAIL ") for line in text.stdout.splitlines()[:11])


def test_run_checks_runs_every_check(monkeypatch):
    """run_checks wires each check in, in report order (checks replaced by stand-ins)."""
    seen = []
    monkeypatch.setattr(doctor, "python_check",
                        lambda snippet, hint: seen.append(hint) or doctor.Check(True, "1", "x"))
    monkeypatch.setattr(doctor, "mpirun_check", lambda: doctor.Check(False, None, "m"))
    monkeypatch.setattr(doctor, "slurm_check", lambda: doctor.Check(True, None, "s"))
    monkeypatch.setattr(doctor, "shm_check", lambda gb: doctor.Check(gb == 2.5, None, "shm"))
    results = doctor.run_checks(shm_min_gb=2.5)
    assert list(results) == list(PY_CHECKS) + ["mpirun", "slurm", "shm"]
    assert seen == [hint for _, hint in PY_CHECKS.values()]
    assert [r.ok for r in results.values()][-3:] == [False, True, True]
