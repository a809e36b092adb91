#!/bin/bash
# Slurm Epilog for PivotRL (slurm.conf: Epilog=/path/to/pivotrl/slurm/epilog.sh).
# Runs as root on every node of a job once the job has ended. It removes what only a
# SIGKILLed rank can leave behind (an orderly stop leaves nothing):
#   - /dev/shm/pivotrl-u<uid>-<suffix>/pivotrl-<job id>-* (or /run/user/<uid>/pivotrl/...):
#     GPS segments, control block and staging files, in the job user's own 0700 folder
#     (found by its owner: the suffix is private to the user). Only files that user owns
#     are removed, and the folder once it is empty and no live agent of the user's other
#     jobs holds it.
#   - <PIVOTRL_SHM_DIR or /dev/shm>/pivotrl-mpi-<job id>-<16 hex>/: the job's 0700 folder for
#     Open MPI's segments and session files (launch/mpi_private.py), if it is that user's.
#   - pivotrl-<job id> CPU cgroups (CPU-emulated devices only).
# Slurm gives the Epilog SLURM_JOB_ID and SLURM_JOB_UID. PIVOTRL_SHM_DIR moves the shm folder.
# The shm part is pivotrl_hpc/gps/epilog.py (standard library only, the system Python): it
# works through one O_NOFOLLOW|O_DIRECTORY descriptor of the folder, because the job's user
# can swap the folder for a symlink at any moment, and creates nothing.
set -u
job=${SLURM_JOB_ID:?not run by Slurm (SLURM_JOB_ID unset)}
uid=${SLURM_JOB_UID:?not run by Slurm (SLURM_JOB_UID unset)}
case "$job" in *[!A-Za-z0-9_.]*) exit 0 ;; esac   # never a pattern from odd input
case "$uid" in *[!0-9]*) exit 0 ;; esac
here=$(dirname "$(readlink -f "$0")")
py=/usr/bin/python3
[ -x "$py" ] || py=$(command -v python3)
"$py" -I "$here/../pivotrl_hpc/gps/epilog.py" "$job" "$uid" 2>/dev/null || true
# find -P never follows a link; rm -rf removes a link, never what it points to
find -P "${PIVOTRL_SHM_DIR:-/dev/shm}" -mindepth 1 -maxdepth 1 -type d -user "$uid" \
  -regextype posix-extended -regex ".*/pivotrl-mpi-${job}-[0-9a-f]{16}" \
  -exec rm -rf --one-file-system {} + \
  2>/dev/null || true
for root in /sys/fs/cgroup/cpu /sys/fs/cgroup/cpu,cpuacct /sys/fs/cgroup; do
  [ -d "$root/pivotrl-${job}" ] || continue
  find "$root/pivotrl-${job}" -depth -type d -exec rmdir {} \; 2>/dev/null || true
done
exit 0
