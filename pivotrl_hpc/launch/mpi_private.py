"""Open MPI's shared files inside a 0700 folder of the job's user, never in a shared folder.

Left to its defaults, Open MPI 4.1 puts each rank's shared-memory segment (btl vader) in
/dev/shm as `vader_segment.<host>.<euid>.<jobid>.<local rank>`, opened `O_CREAT|O_RDWR`
(no `O_EXCL`, no `O_NOFOLLOW`; the jobid is a 16-bit hash of the host name and mpirun's pid,
in /proc before the ranks reach MPI_Init), and mpirun's session folder (`contact.txt`
`O_TRUNC` through links, hwloc's topology, PMIx's shared-memory store) in
/tmp/ompi.<host>.<uid>/pid.<pid>/. Another account that makes those names first reads and
writes every message between the ranks, or writes through a link into the user's files.

So every job gets a fresh folder `<PIVOTRL_SHM_DIR or /dev/shm>/pivotrl-mpi-<job>-<16 hex>`,
0700, the user's, and Open MPI is told to keep everything there (`mca_env`):

- `btl_vader_backing_directory`: the ranks' segments;
- `orte_tmpdir_base`: mpirun's session folder (and with it PMIx's store and hwloc's file);
- `shmem=mmap`: no `open_mpi.NNNN` probe segments in /dev/shm (the posix component's);
- `UCX_POSIX_DIR`: UCX's (NIXL's) `ucx_shm_posix_*` files.

`pivotrl run` makes the folder before mpirun starts; under Slurm the batch step names it and
each node's first rank makes it (`ensure`), every rank before MPI_Init: /dev/shm is per node.
A rank refuses to start (`check`, one line, exit 2) unless each of these settings names a
0700 folder of its user; the folder's random part keeps anyone from making it first. The
launcher removes it after the job (`remove`; a killed job's by `sweep` at the next start in
the run folder, and the Slurm epilog on every node).

Torch- and MPI-free: the ranks run it before they import mpi4py.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path

from pivotrl_hpc import envs
from pivotrl_hpc.checkpoint.folders import open_folder
from pivotrl_hpc.gps.shmdir import valid_job

# Open MPI's settings that name a folder it creates files in (defaults /dev/shm and /tmp)
FOLDER_PARAMS = (envs.OMPI_VADER_DIR, envs.OMPI_TMPDIR)
_TOKEN = re.compile(r"[0-9a-f]{16}")
STORE_PREFIX = "train-"   # <logs>/train-<16 hex>/: the training world's FileStore


class MPIFolderError(RuntimeError):
    """Open MPI would put its shared files where another account can reach them."""
    exit_code = 2


def folder_name(job: str) -> Path:
    """A fresh name for the job's MPI folder (not made yet)."""
    return Path(envs.SHM_DIR.get()) / f"pivotrl-mpi-{job}-{secrets.token_hex(8)}"


def job_env(job: str, logs: Path) -> dict[str, str]:
    """The job's private places, named (made by `make`): Open MPI's folder (`mca_env`) and
    the training world's FileStore, `<logs>/train-<16 hex>/store` (the run folder is on a
    file system every node sees)."""
    store = logs / f"{STORE_PREFIX}{secrets.token_hex(8)}" / "store"
    return {**mca_env(folder_name(job)), envs.TRAIN_STORE.name: str(store)}


def make(env: Mapping[str, str], group_shared: bool = False) -> None:
    """Make the folders `job_env` named, 0700, each new (a name taken first is refused):
    this node's MPI folder and the store's folder in the run's logs folder (opened level by
    level, checkpoint.folders.open_folder)."""
    folder = Path(envs.MPI_DIR.raw(env))
    try:
        os.mkdir(folder, mode=0o700)
    except OSError as e:
        raise MPIFolderError(f"MPI folder {folder}: cannot be made ({e.strerror})") from None
    os.chmod(folder, 0o700)
    check_folder(folder)
    store = Path(envs.TRAIN_STORE.raw(env)).parent
    fd = open_folder(store.parent, own=2, group_shared=group_shared)
    try:
        os.mkdir(store.name, mode=0o700, dir_fd=fd)
        sub = os.open(store.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        os.fchmod(sub, 0o700)
        os.close(sub)
    finally:
        os.close(fd)


def remove_all(env: Mapping[str, str]) -> None:
    """Remove what `make` made (and what killed ranks left in it)."""
    if (folder := envs.MPI_DIR.raw(env)) is not None:
        remove(Path(folder))
    if (store := envs.TRAIN_STORE.raw(env)) is not None:
        remove(Path(store).parent)


def mca_env(folder: Path) -> dict[str, str]:
    """The environment that keeps Open MPI's files in `folder` (for mpirun and every rank),
    and UCX's (NIXL's) shared-memory files too: they are made O_EXCL under random names and
    unlinked at once, but need not pass through /dev/shm at all."""
    return {envs.MPI_DIR.name: str(folder), envs.OMPI_VADER_DIR.name: str(folder),
            envs.OMPI_TMPDIR.name: str(folder), envs.OMPI_SHMEM.name: "mmap",
            "UCX_POSIX_DIR": str(folder)}


def ensure(folder: Path) -> Path:
    """Make `folder` (0700 whatever the umask) unless it is there; then `check_folder` it."""
    try:
        os.mkdir(folder, mode=0o700)
        os.chmod(folder, 0o700)   # the umask may have taken bits: exactly 0700
    except FileExistsError:
        pass   # another rank of the job made it first; checked below
    except OSError as e:
        raise MPIFolderError(f"MPI folder {folder}: cannot be made ({e.strerror})") from None
    return check_folder(folder)


def check_folder(folder: Path) -> Path:
    """`folder` if it is a real 0700 folder of this user; MPIFolderError naming it else."""
    try:
        st = os.lstat(folder)
    except OSError as e:
        raise MPIFolderError(f"MPI folder {folder}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else \
            "a folder" if stat.S_ISDIR(st.st_mode) else "a file"
        raise MPIFolderError(f"MPI folder {folder} is {kind} of uid {st.st_uid} with mode "
                             f"{stat.S_IMODE(st.st_mode):o}, not a 0700 folder of uid "
                             f"{os.getuid()}: another account could read or write the ranks' "
                             "shared memory there")
    return folder


def check(env: Mapping[str, str] | None = None, *, create: bool = False) -> Path:
    """Refuse (MPIFolderError, one line) unless every folder Open MPI puts shared files in is
    the job's MPI folder and that is a 0700 folder of this user (made first with `create`).
    Returns the folder."""
    folder = settings(env)
    return ensure(folder) if create else check_folder(folder)


def settings(env: Mapping[str, str] | None = None) -> Path:
    """The job's MPI folder, if every folder Open MPI puts shared files in is that one (and
    its shmem component mmap); else MPIFolderError, one line naming the setting."""
    env = os.environ if env is None else env
    folder = envs.MPI_DIR.raw(env)
    for var in FOLDER_PARAMS:
        where = var.get(env)
        if folder is None or os.path.abspath(where) != os.path.abspath(folder):
            raise MPIFolderError(
                f"Open MPI's shared memory would land in {where} ({var.name}), a folder other "
                "accounts can write: start the job with `pivotrl run` or slurm/pivot.sbatch, "
                "which give it a 0700 folder of its own")
    if envs.OMPI_SHMEM.raw(env) != "mmap":
        raise MPIFolderError(f"Open MPI's shmem segments would land in /dev/shm "
                             f"({envs.OMPI_SHMEM.name} is not mmap), a folder other "
                             "accounts can write")
    return Path(folder)


def remove(folder: Path) -> None:
    """Remove the job's MPI folder and what a killed rank left in it (only if it is ours)."""
    try:
        check_folder(folder)
    except MPIFolderError:
        return
    shutil.rmtree(folder, ignore_errors=True)


def sweep(job: str, logs: Path | None = None) -> list[str]:
    """What a killed job left: its MPI folders on this node, and (`logs`: its run's logs
    folder) the training stores' folders there; their names. Only 0700 folders of the user."""
    if not valid_job(job):
        raise ValueError(f"{job!r} is not a job id")
    found = list(Path(envs.SHM_DIR.get()).glob(f"pivotrl-mpi-{job}-*"))
    if logs is not None:
        found += logs.glob(f"{STORE_PREFIX}*")
    removed = []
    for path in found:
        if _TOKEN.fullmatch(path.name.rsplit("-", 1)[1]):
            remove(path)
            removed.append(path.name)
    return removed
