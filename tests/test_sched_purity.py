"""sched and plan stay pure: importing them pulls in no heavy or I/O-bound dependency."""
from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "mpi4py", "h5py", "vllm", "megatron", "numpy", "nixl", "yaml")


def _loaded(imports: list[str], watch: tuple[str, ...]) -> list[str]:
    """Top-level packages of `watch` present in sys.modules after importing `imports`
    in a fresh interpreter."""
    code = (f"import json, sys\nfor m in {imports!r}: __import__(m)\n"
            f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({watch!r}))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_importing_sched_and_plan_loads_no_heavy_module():
    assert _loaded(["pivotrl_hpc.sched", "pivotrl_hpc.plan"], HEAVY) == []


def test_the_probe_sees_an_imported_module():
    """The probe is not vacuous: a module that is imported does show up."""
    assert _loaded(["pivotrl_hpc.plan", "decimal"], HEAVY + ("decimal",)) == ["decimal"]
