#!/bin/bash
# Slurm Epilog for PivotRL (slurm.conf: Epilog=/path/to/pivotrl/slurm/epilog.sh).
# Runs as root on every node of a job once the job has ended. It removes what only a
# SIGKILLed rank can leave behind (an orderly stop leaves nothing):
#   - /dev/shm/pivotrl-u<uid>/pivotrl-<job id>-*: GPS segments, control block and staging
#     files, in the job user's own 0700 folder. Only files that user owns are removed, and
#     the folder once it is empty and no live agent of the user's other jobs holds it.
#   - pivotrl-<job id> CPU cgroups (CPU-emulated devices only).
# Slurm gives the Epilog SLURM_JOB_ID and SLURM_JOB_UID. PIVOTRL_SHM_DIR moves the shm folder.
set -u
job=${SLURM_JOB_ID:?not run by Slurm (SLURM_JOB_ID unset)}
uid=${SLURM_JOB_UID:?not run by Slurm (SLURM_JOB_UID unset)}
case "$job" in *[!A-Za-z0-9_.]*) exit 0 ;; esac   # never a pattern from odd input
shm=${PIVOTRL_SHM_DIR:-/dev/shm}/pivotrl-u${uid}
case "$uid" in *[!0-9]*) exit 0 ;; esac
# -P (the default): a symlink planted as the folder is not followed
find "$shm" -maxdepth 1 -name "pivotrl-${job}-*" -user "$uid" \( -type f -o -type l \) \
  -print -delete 2>/dev/null || true
# the folder too once empty, unless a live agent of the user's other jobs holds it (flock)
[ -d "$shm" ] && [ ! -L "$shm" ] && flock -n -x "$shm" rmdir "$shm" 2>/dev/null || true
for root in /sys/fs/cgroup/cpu /sys/fs/cgroup/cpu,cpuacct /sys/fs/cgroup; do
  [ -d "$root/pivotrl-${job}" ] || continue
  find "$root/pivotrl-${job}" -depth -type d -exec rmdir {} \; 2>/dev/null || true
done
exit 0
