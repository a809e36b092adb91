#!/bin/bash
# Local two-node Slurm cluster for tests: slurmctld, slurmd n1 + n2 (16 CPUs, 8 fake GPUs each)
# and accounting (slurmdbd + a private MariaDB), all on this host, all state under .run/slurm/.
#
# usage: slurm/local/cluster.sh start|stop|status|env      (as root; no systemd needed)
#   start   idempotent: returns at once if our cluster is up with the same config; else wipes
#           the run folder's state (job ids restart at 1) and waits until both nodes are idle
#   stop    cancels all jobs, stops our daemons by pid file, munged only if we started it
#   status  sinfo + squeue; exit 0 if up, 3 if not
#   env     export lines for `eval "$(slurm/local/cluster.sh env)"`
# Ports (override by env): PIVOT_SLURM_CTLD_PORT=16817 PIVOT_SLURM_DBD_PORT=16819
#   PIVOT_SLURM_DB_PORT=16806 PIVOT_SLURM_N1_PORT=16821 PIVOT_SLURM_N2_PORT=16822
# Run folder: PIVOT_SLURM_RUN_DIR (default <repo>/.run/slurm).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
R=${PIVOT_SLURM_RUN_DIR:-$REPO/.run/slurm}
CTLD_PORT=${PIVOT_SLURM_CTLD_PORT:-16817}
DBD_PORT=${PIVOT_SLURM_DBD_PORT:-16819}
DB_PORT=${PIVOT_SLURM_DB_PORT:-16806}
N1_PORT=${PIVOT_SLURM_N1_PORT:-16821}
N2_PORT=${PIVOT_SLURM_N2_PORT:-16822}
NODES="n1 n2"
UP_TIMEOUT_S=${PIVOT_SLURM_UP_TIMEOUT_S:-30}
export SLURM_CONF=$R/slurm.conf

die() { echo "cluster.sh: $*" >&2; exit 1; }
log() { echo "cluster.sh: $*"; }

# pid from a pid file, only if that process is alive and has the expected name (pids get reused)
live_pid() { # file comm
  local p; [ -f "$1" ] && p=$(cat "$1" 2>/dev/null) && [ -n "$p" ] \
    && [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$2" ] && echo "$p"
}
wait_gone() { # pid...
  local p; for p in "$@"; do
    for _ in $(seq 1 80); do kill -0 "$p" 2>/dev/null || continue 2; sleep 0.1; done
    kill -9 "$p" 2>/dev/null || true; echo "cluster.sh: pid $p ignored SIGTERM, killed" >&2
  done
}
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

# daemon pid files and the /proc comm each must match
DAEMONS="slurmd-n1.pid:slurmd slurmd-n2.pid:slurmd slurmctld.pid:slurmctld slurmdbd.pid:slurmdbd mariadbd.pid:mariadbd"
all_daemons_live() {
  local d; for d in $DAEMONS; do live_pid "$R/${d%%:*}" "${d#*:}" >/dev/null || return 1; done
}
nodes_ready() { # both nodes registered and responding (idle or busy; '*' = not responding)
  local s; s=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u) || return 1
  [ "$(echo "$s" | grep -cE '^n[12] ')" = 2 ] && ! echo "$s" | grep -qE ' (down|drain|drng|fail|unk|boot|npc)|\*$'
}
is_up() { all_daemons_live && munge_ok && nodes_ready; }

render() { # template -> stdout
  sed -e "s#@RUN_DIR@#$R#g" -e "s#@REPO@#$REPO#g" -e "s#@CTLD_PORT@#$CTLD_PORT#g" \
      -e "s#@DBD_PORT@#$DBD_PORT#g" -e "s#@DB_PORT@#$DB_PORT#g" \
      -e "s#@N1_PORT@#$N1_PORT#g" -e "s#@N2_PORT@#$N2_PORT#g" "$HERE/$1"
}
config_fingerprint() {
  { render slurm.conf.in; render gres.conf.in; render slurmdbd.conf.in; cat "$HERE/task-prolog.sh"; } | sha1sum
}

tail_logs() {
  local f; for f in "$R"/log/slurm*.log "$R"/log/mariadbd.err; do
    [ -f "$f" ] && { echo "--- $f (last 15 lines)"; tail -n 15 "$f"; }
  done >&2
}

start_munge() {
  command -v munged >/dev/null || die "munged not found: run scripts/setup.sh (Debian package munge)"
  if munge_ok; then  # running: ours only if it is still the munged we started
    if [ -f "$R/munged.ours" ] && [ "$(cat "$R/munged.ours")" != "$(cat /run/munge/munged.pid 2>/dev/null)" ]; then
      rm -f "$R/munged.ours"
    fi
    return 0
  fi
  [ -f /etc/munge/munge.key ] || die "/etc/munge/munge.key missing (reinstall the munge package)"
  # munged refuses to run as root; Debian's package owns /run/munge by the munge user.
  mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
  runuser -u munge -- /usr/sbin/munged 9>&-
  for _ in $(seq 1 50); do munge_ok && break; sleep 0.1; done
  munge_ok || die "munged did not answer within 5 s"
  # remember that munged is ours, so that stop stops it and nothing else's
  cat /run/munge/munged.pid > "$R/munged.ours"
}

start_db() { # private MariaDB for slurmdbd, fresh each start (job ids restart with the state)
  command -v mariadbd >/dev/null && command -v mariadb-install-db >/dev/null \
    || die "mariadbd not found: run scripts/setup.sh (Debian packages mariadb-server slurmdbd)"
  mariadb-install-db --no-defaults --user=root --datadir="$R/db" --skip-test-db \
    --auth-root-authentication-method=normal >"$R/log/mariadb-install.log" 2>&1 \
    || { cat "$R/log/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
  # TCP on loopback only (slurmdbd has no socket option); root@127.0.0.1 has no password.
  # setsid + nohup: the daemon must outlive this script and the caller's session.
  setsid nohup /usr/sbin/mariadbd --no-defaults --user=root --datadir="$R/db" \
    --socket="$R/mariadb.sock" --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
    --pid-file="$R/mariadbd.pid" --log-error="$R/log/mariadbd.err" \
    --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 9>&- &
  for _ in $(seq 1 100); do port_busy "$DB_PORT" && return 0; sleep 0.1; done
  tail_logs; die "MariaDB did not listen on 127.0.0.1:$DB_PORT within 10 s"
}

do_start() {
  [ "$(id -u)" = 0 ] || die "must run as root (slurmd and munged need it)"
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v slurmdbd >/dev/null \
    || die "slurmctld/slurmd/slurmdbd not found: run scripts/setup.sh"
  local fp; fp=$(config_fingerprint)
  if [ -f "$R/config.sha1" ] && [ "$(cat "$R/config.sha1")" = "$fp" ] && is_up; then
    log "already up ($R)"; return 0
  fi
  # partly up, or up with an older config: clean slate
  if [ -f "$R/slurmctld.pid" ] || [ -f "$R/mariadbd.pid" ]; then do_stop >/dev/null; fi
  local port; for port in "$CTLD_PORT" "$DBD_PORT" "$DB_PORT" "$N1_PORT" "$N2_PORT"; do
    port_busy "$port" && die "port $port is in use by another program; set PIVOT_SLURM_*_PORT (see $0 header)"
  done
  # a failed start stops what it started (logs stay in $R/log)
  trap '[ "${START_OK:-0}" = 1 ] || { do_stop >/dev/null 2>&1; echo "cluster.sh: start failed; stopped the partial cluster" >&2; }' EXIT
  mkdir -p "$R"
  # fresh state: job ids restart at 1; stale pmix sockets in spool/TmpFS would collide
  rm -rf "$R/state" "$R/spool" "$R/tmp" "$R/log" "$R/db" "$R/fakedev" "$R/pytest.started"
  mkdir -p "$R/state" "$R/log" "$R/db" "$R/fakedev"
  for n in $NODES; do mkdir -p "$R/spool/$n" "$R/tmp/$n"; done
  for i in 0 1 2 3 4 5 6 7; do ln -s /dev/null "$R/fakedev/gpu$i"; done
  render slurm.conf.in > "$R/slurm.conf"
  render gres.conf.in > "$R/gres.conf"
  ( umask 077; render slurmdbd.conf.in > "$R/slurmdbd.conf" )
  start_munge
  start_db
  # 9>&-: daemons must not inherit the start/stop lock
  /usr/sbin/slurmdbd 9>&- || { tail_logs; die "slurmdbd failed to start"; }
  for _ in $(seq 1 100); do port_busy "$DBD_PORT" && break; sleep 0.1; done
  port_busy "$DBD_PORT" || { tail_logs; die "slurmdbd did not listen on port $DBD_PORT within 10 s"; }
  /usr/sbin/slurmctld 9>&- || { tail_logs; die "slurmctld failed to start"; }
  for n in $NODES; do /usr/sbin/slurmd -N "$n" 9>&- || { tail_logs; die "slurmd -N $n failed to start"; }; done
  local t_end=$((SECONDS + UP_TIMEOUT_S))
  until [ "$(sinfo -h -t idle -o %D 2>/dev/null)" = 2 ]; do
    if [ $SECONDS -ge $t_end ]; then
      sinfo -N -o '%N %T %E' >&2 || true; tail_logs
      die "nodes n1, n2 not idle within ${UP_TIMEOUT_S} s (logs above)"
    fi
    sleep 0.2
  done
  echo "$fp" > "$R/config.sha1"
  START_OK=1
  log "up: $(sinfo -h -N -o '%N %T cpus=%c %G' | paste -sd ';')  SLURM_CONF=$SLURM_CONF"
}

do_stop() {
  local p pids="" d
  # cancel jobs first so that slurmstepd and job processes go away with them
  if live_pid "$R/slurmctld.pid" slurmctld >/dev/null; then
    squeue -h -o %i 2>/dev/null | xargs -r scancel 2>/dev/null || true
    for _ in $(seq 1 50); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
  fi
  # slurmd and slurmctld first, then accounting, then its database: they exit in parallel
  for d in slurmd-n1.pid:slurmd slurmd-n2.pid:slurmd slurmctld.pid:slurmctld slurmdbd.pid:slurmdbd; do
    p=$(live_pid "$R/${d%%:*}" "${d#*:}") && kill "$p" && pids="$pids $p"
  done
  # shellcheck disable=SC2086
  wait_gone $pids  # ~2-3 s: each daemon polls for the signal
  # then the database and munged (if ours), together: Slurm daemons used both until they exited
  pids=""
  if p=$(live_pid "$R/mariadbd.pid" mariadbd); then kill "$p"; pids="$p"; fi
  if [ -f "$R/munged.ours" ]; then
    p=$(cat "$R/munged.ours"); [ "$(cat "/proc/$p/comm" 2>/dev/null)" = munged ] && kill "$p" && pids="$pids $p"
    rm -f "$R/munged.ours"
  fi
  # shellcheck disable=SC2086
  wait_gone $pids
  rm -f "$R"/slurmd-n1.pid "$R"/slurmd-n2.pid "$R"/slurmctld.pid "$R"/slurmdbd.pid "$R"/mariadbd.pid "$R/config.sha1" \
    "$R/pytest.started"  # tests/slurm_util.py: a pytest session started the cluster
  log "stopped"
}

do_status() {
  if ! [ -f "$SLURM_CONF" ] || ! is_up; then
    echo "cluster.sh: local cluster is not up ($R); start it with: $0 start" >&2
    return 3
  fi
  sinfo -N -o '%N %T %c %G %E'; squeue
}

do_env() {
  # OMPI_MCA_btl/UCX_MODULES: also exported for jobs by task-prolog.sh; here for clients too
  printf 'export SLURM_CONF=%q\n' "$SLURM_CONF"
  echo "export OMPI_MCA_btl=self,tcp"
  echo "export UCX_MODULES='^ib,rdmacm'"
}

case "${1:-}" in
  start|stop)
    # one start/stop at a time (Makefile and pytest sessions may race)
    mkdir -p "$R"; exec 9>"$R/.lock"; flock 9
    "do_$1" ;;
  status) do_status ;;
  env) do_env ;;
  *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
