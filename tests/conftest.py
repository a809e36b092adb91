"""Shared fixtures. Each block belongs to one area; keep blocks small and delimited."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("UCX_MODULES", "^ib,rdmacm")  # NIXL segfaults at exit without it


# --- each pytest process its own shm root and GPS folder ------------------------------------
def _own_shm_root() -> Path | None:
    """A 0700 folder in /dev/shm of this pytest process (an xdist worker, or the one process
    of a live phase) as PIVOTRL_SHM_DIR, set before any module imports gps.shmdir: the GPS
    folder `<root>/pivotrl-u<uid>-<suffix>` is then this process's alone, and everything it
    starts (agents, mpirun and Slurm jobs) inherits it. Without it two workers, or a second
    pytest of the user, share one folder: a test that asserts the folder goes with the last
    agent saw the other's agent hold it. A root given from outside is kept; one inherited
    from the pytest that started this one (xdist's controller) is not."""
    import tempfile

    from pivotrl_hpc import envs

    given = envs.SHM_DIR.raw()
    inherited = given is not None and Path(given).name.startswith(TEST_ROOT_PREFIX)
    if (given and not inherited) or envs.GPS_DIR.is_set() or not os.path.isdir("/dev/shm"):
        return None
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    root = Path(tempfile.mkdtemp(prefix=f"{TEST_ROOT_PREFIX}{worker}-", dir="/dev/shm"))
    os.environ[envs.SHM_DIR.name] = str(root)
    return root


TEST_ROOT_PREFIX = "pytest-pivotrl-"   # not `pivotrl-<job>-`: no job sweep matches it
OWN_SHM_ROOT = _own_shm_root()


def pytest_unconfigure(config):
    """The root goes with its process (agents have stopped: their fixtures are torn down)."""
    if OWN_SHM_ROOT is not None:
        import shutil

        shutil.rmtree(OWN_SHM_ROOT, ignore_errors=True)
# --- end each pytest process its own shm root ------------------------------------------------


# --- tiny models and data ------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> Path:
    """Folder with policy/, genrm/ (HF Qwen2, random weights) and data/ (JSONL)."""
    from pivotrl_hpc.task.synthetic import write_dataset
    from pivotrl_hpc.assets.models import SPECS, create_model

    out = tmp_path_factory.mktemp("tiny")
    for name in ("policy", "genrm"):
        create_model(out / name, SPECS[name])
    write_dataset(out / "data", seed=0, train=64, validation=16)
    return out


WARM_START = ("import sys; from pathlib import Path; "
              "from pivotrl_hpc.cli.init_models import init_models; "
              "init_models(Path(sys.argv[1]), train=16, validation=16)")


@pytest.fixture(scope="session", autouse=True)
def _warm_start_early(request, tmp_path_factory):
    """When a collected test uses `warm_models`, its warm start (~90 s of CPU training) begins
    with the session, niced, in a process of its own: it takes the CPU the tests before leave
    idle instead of holding up the first test that needs it. Yields (process, folder)."""
    if not any("warm_models" in getattr(item, "fixturenames", ())
               for item in request.session.items):
        yield None
        return
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("warm")
    log = open(out.with_name("warm-start.log"), "w")
    proc = subprocess.Popen([sys.executable, "-c", WARM_START, str(out)], stdout=log,
                            stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(19))
    yield proc, out
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    log.close()


@pytest.fixture(scope="session")
def warm_models(_warm_start_early, tmp_path_factory) -> Path:
    """As `pivotrl init-models` writes them: the same folders and data (16 training
    problems, its default), the policy and the GenRM warm-started on the training set."""
    if _warm_start_early is None:   # asked for by name only (getfixturevalue): build it now
        from pivotrl_hpc.cli.init_models import init_models

        out = tmp_path_factory.mktemp("warm")
        init_models(out, train=16, validation=16)
        return out
    proc, out = _warm_start_early
    rc = proc.wait()
    assert rc == 0, out.with_name("warm-start.log").read_text()[-4000:]
    return out


@pytest.fixture(scope="session")
def genrm_archs(tmp_path_factory) -> dict[str, Path]:
    """Tiny GenRMs of the paper's architectures (GenRM sizes), as `init-models --genrm-arch`
    writes them: arch -> folder."""
    from pivotrl_hpc.assets.models import GENRM_ARCHS, SPECS, create_model

    out = tmp_path_factory.mktemp("archs")
    for arch in GENRM_ARCHS[1:]:
        create_model(out / arch, SPECS["genrm"], arch)
    return {arch: out / arch for arch in GENRM_ARCHS[1:]}
# --- end tiny models and data --------------------------------------------------------


# --- slurm_cluster (local two-node Slurm; helpers in tests/slurm_util.py) --------------
@pytest.fixture(scope="session")
def slurm_cluster():
    """The local cluster of slurm/local/cluster.sh: `.env` (for subprocess), `.run_dir`,
    `.run(...)`, `.sbatch(...)`. Started if down; stopped at the end only if a pytest
    session started it and no other session still uses it."""
    from slurm_util import acquire_cluster, release_cluster

    cluster = acquire_cluster()
    yield cluster
    release_cluster(cluster)
# --- end slurm_cluster -----------------------------------------------------------------


# --- the suite's two phases (`make test`) ----------------------------------------------
# These modules start live jobs (mpirun or Slurm worlds: 1.5-2 busy cores each, and timings
# that a second test beside them would perturb) or need the warm-started models. `make test`
# runs the rest first on two xdist workers (one core each, mostly: side by side they take
# half the time), then these alone (`-m live`). docs/design.md, "Tests and the suite".
LIVE_MODULES = frozenset({
    "test_launch", "test_learning", "test_long_batch", "test_resume_live", "test_run_paradigms",
    "test_security_planted", "test_slurm_job", "test_slurm_requeue", "test_slurm_stop",
    "test_warmstart", "test_run_folder_live", "test_security_mpi", "test_security_checkpoint",
})


@pytest.hookimpl(tryfirst=True)   # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.path)).stem in LIVE_MODULES:
            item.add_marker(pytest.mark.live)
    # Modules that need the warm-started models run last (whole, so module fixtures stay
    # set up once): the niced warm start (_warm_start_early) takes the CPU the tests
    # before them leave idle, and they wait for it less or not at all.
    warm = {item.path for item in items if "warm_models" in item.fixturenames}
    items.sort(key=lambda item: item.path in warm)
# --- end the suite's two phases --------------------------------------------------------
