#!/usr/bin/env bash
# A real single-host Slurm cluster for development and tests: munge, MariaDB, slurmdbd (accounting),
# slurmctld and two slurmd "nodes" on this machine, all state in one directory, no systemd. Run as root.
#
#   slurm/dev-cluster.sh start          start what is not running; wait until both nodes are idle
#                                       (idempotent: ~0.3 s when all is up; repairs partial states)
#   slurm/dev-cluster.sh stop [--wipe]  stop every daemon of this state dir and the jobs' processes;
#                                       --wipe also deletes the state dir (jobs, accounting, logs)
#   slurm/dev-cluster.sh status         daemons + sinfo; exit 0 up and idle, 3 all stopped, 1 otherwise
#   slurm/dev-cluster.sh env            `export SLURM_CONF=...`: use as  eval "$(slurm/dev-cluster.sh env)"
#
# Cluster `dev`: partition `cpu` (node cpunode, CPUs=8, the default) and `gpu` (node gpunode, CPUs=4,
# Gres=gpu:2 on fake devices: mknod'ed copies of /dev/null, so CUDA_VISIBLE_DEVICES is set but there
# is no GPU). Both nodes are 127.0.0.1. MpiDefault=none: use `srun --mpi=pmix` for MPI programs
# (Debian's Open MPI has no PMI2). Accounting: account `mrl` with this user in it.
#
# Environment:
#   MRL_SLURM_STATE      state dir            (default /tmp/megatron-rl-slurm)
#   MRL_SLURM_PORT_BASE  first of 4 TCP ports (default 6817: slurmctld, gpunode, slurmdbd, cpunode)
#   MRL_SLURM_CLUSTER    ClusterName          (default dev)
#   MRL_SLURM_TIMEOUT    seconds to wait for each daemon and for idle nodes (default 60)
#
# How it fits together (and the gotchas met on the way):
#   - Config: templates slurm/{slurm,slurmdbd,gres}.conf.in rendered into <state>/etc. Every client and
#     daemon finds it through SLURM_CONF=<state>/etc/slurm.conf; slurmdbd.conf, gres.conf and
#     plugstack.conf are read from the same directory. /etc/slurm is not touched and not needed: a
#     shell without SLURM_CONF gets "Could not establish a configuration source" -- eval `env` first.
#     `start` re-renders the templates and restarts the daemons whose config changed.
#   - munge: our own munged, key and socket under <state>/munge (a system munged is irrelevant).
#     Slurm is pointed at the socket twice: AuthInfo=socket= for ordinary RPCs, and
#     AccountingStoragePass=<socket> for RPCs to slurmdbd (sacctmgr/sacct otherwise try /run/munge).
#     munged refuses a socket whose directories are not all o+x, so <state> is 755.
#   - MariaDB: a datadir under <state>/mysql owned by the mysql user (MariaDB segfaults when it cannot
#     write its pid-file directory), networking off; slurmdbd finds the unix socket through
#     MYSQL_UNIX_PORT and logs in as root by unix_socket auth (no password anywhere).
#   - Process tracking: every daemon starts with MRL_SLURM_DAEMON_OF=<state> in its environment, job
#     processes carry SLURM_CONF=<state>/... and SLURM_JOB_ID. `stop` and `start` find them by that
#     (so also daemons whose pid files are stale or gone, e.g. after the state dir was deleted under
#     them); nothing is ever killed by name. `start` refuses when our ports belong to another cluster.
#   - `stop` cancels jobs, then TERMs all of this cluster's processes at once (KILL after 20 s) and
#     rescans until none is left. Daemons never inherit our stdout/stderr (logs in <state>/log), so a
#     caller capturing our output does not hang.
#   - /etc/hosts gets `127.0.0.1 gpunode cpunode` once: torch.distributed and submitit use the node
#     name as MASTER_ADDR.
#   - Job ids: slurmctld keeps them in <state>/ctld, so `stop` + `start` continues the sequence. A
#     fresh state (first start, or after `stop --wipe`) starts at a FirstJobId taken from the clock,
#     so ids usually differ from the previous cluster's, but that is not guaranteed: Slurm itself
#     would restart at 1. Use a fresh submitit folder per test/cluster lifetime, or an old folder can
#     serve an old result file to a new job that got the same id.
#   - start/stop take a lock (<state>.lock) so concurrent callers serialise.
#   - Timings on this 2-core machine: cold start ~4.5 s idle (11-16 s with the machine loaded), warm
#     restart ~2 s, `start` when up ~0.3 s, stop ~3 s.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STATE=${MRL_SLURM_STATE:-/tmp/megatron-rl-slurm}
STATE=${STATE%/}
PORT_BASE=${MRL_SLURM_PORT_BASE:-6817}
CLUSTER=${MRL_SLURM_CLUSTER:-dev}
TIMEOUT=${MRL_SLURM_TIMEOUT:-60}
NODES=(gpunode cpunode)
CONF=$STATE/etc/slurm.conf
MYSQL_SOCK=$STATE/mysql/mysqld.sock
MUNGE_SOCK=$STATE/munge/munge.socket
TAG=MRL_SLURM_DAEMON_OF=$STATE
export SLURM_CONF=$CONF

log() { printf '[dev-cluster] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# ---------------------------------------------------------------- processes ----
pid_alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }

read_pidfile() { [ -s "$1" ] && tr -dc '0-9' < "$1" || true; }

# pid_is_ours PID: the process carries our tag (daemons) or is a job process of this cluster.
pid_is_ours() {
  local f=/proc/$1/environ
  grep -qzxF "$TAG" "$f" 2>/dev/null && return 0
  grep -qzxF "SLURM_CONF=$CONF" "$f" 2>/dev/null && grep -qz '^SLURM_JOB_ID=' "$f" 2>/dev/null
}

# tagged_environs: /proc/PID/environ of every process pid_is_ours would accept, in two or three
# grep runs over all processes (one grep per process is seconds on a loaded 2-core machine).
tagged_environs() {
  local jobs
  grep -lzxF "$TAG" /proc/[0-9]*/environ 2>/dev/null || true
  jobs=$(grep -lzxF "SLURM_CONF=$CONF" /proc/[0-9]*/environ 2>/dev/null || true)
  # shellcheck disable=SC2086
  [ -z "$jobs" ] || grep -lz '^SLURM_JOB_ID=' $jobs 2>/dev/null || true
}

# our_pids NAME...: pids of processes named NAME (comm; '*' for any) that belong to this state dir,
# never this shell or its ancestors.
our_pids() {
  local f pid comm n anc
  anc=" $(ancestors) "
  for f in $(tagged_environs | sort -u); do
    pid=${f#/proc/}; pid=${pid%/environ}
    [[ "$anc" == *" $pid "* ]] && continue
    { read -r comm < "/proc/$pid/comm"; } 2>/dev/null || continue
    for n in "$@"; do
      if [ "$n" = '*' ] || [ "$comm" = "$n" ]; then echo "$pid"; break; fi
    done
  done
}

ancestors() {
  local p=$$ out="" k v
  while [ -n "$p" ] && [ "$p" != 0 ]; do
    out="$out $p"
    k=""
    while read -r k v; do [ "$k" = PPid: ] && break; done < "/proc/$p/status" 2>/dev/null || true
    [ "$k" = PPid: ] && p=$v || p=""
  done
  echo "$out"
}

# daemon_pid NAME PIDFILE: the running pid of an (our) daemon, from its pid file or by scan.
daemon_pid() {
  local comm=$1 pidfile=$2 pid
  pid=$(read_pidfile "$pidfile")
  if pid_alive "$pid" && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$comm" ] && pid_is_ours "$pid"; then
    echo "$pid"; return
  fi
  return 1
}

# kill_wait SECONDS PID...: TERM, wait up to SECONDS, then KILL what is left.
kill_wait() {
  local secs=$1; shift
  local pids=("$@") p left i
  [ ${#pids[@]} -eq 0 ] && return 0
  kill -TERM "${pids[@]}" 2>/dev/null || true
  for ((i = 0; i < secs * 20; i++)); do
    left=()
    for p in "${pids[@]}"; do pid_alive "$p" && left+=("$p"); done
    if [ ${#left[@]} -eq 0 ]; then
      [ -n "${MRL_SLURM_DEBUG:-}" ] && log "$(date +%T.%N | cut -c1-12) TERM ${pids[*]}: gone after ${i}x50ms"
      return 0
    fi
    sleep 0.05
  done
  log "still running after ${secs}s, sending KILL: ${left[*]}"
  kill -KILL "${left[@]}" 2>/dev/null || true
  sleep 0.2
}

# wait_for DESCRIPTION COMMAND...: poll COMMAND until it succeeds or TIMEOUT passes. With
# WATCH="NAME:PIDFILE ..." set, give up early (after a 3 s grace for daemonising) when one of those
# daemons is gone, e.g. slurmctld exited on a bad config (WATCH_BG: the pid we launched; while it lives, a pid
# file not yet written means slow to start under load, not gone).
wait_for() {
  local what=$1; shift
  local start=$SECONDS deadline=$((SECONDS + TIMEOUT)) w out
  until out=$("$@" 2>&1); do
    if [ $SECONDS -ge $deadline ]; then
      log "timed out after ${TIMEOUT}s waiting for $what; last try ($*) said:"
      printf '%s\n' "$out" | tail -n 5 >&2
      show_logs
      exit 1
    fi
    if [ $((SECONDS - start)) -ge 3 ]; then
      for w in ${WATCH:-}; do
        daemon_pid "${w%%:*}" "${w#*:}" >/dev/null && continue
        # not yet written its pid file, but the process we launched is alive: slow to start (load), not gone
        [ ! -s "${w#*:}" ] && [ -n "${WATCH_BG:-}" ] && pid_alive "$WATCH_BG" && continue
        log "${w%%:*} ($(basename "${w#*:}" .pid)) exited while waiting for $what"
        show_logs
        exit 1
      done
    fi
    sleep 0.1
  done
}

show_logs() {
  local f
  for f in "$STATE"/munge/munged.log "$STATE"/mysql/mysqld.log "$STATE"/log/*.log; do
    [ -f "$f" ] || continue
    printf '\n===== tail %s =====\n' "$f" >&2
    tail -n 25 "$f" >&2
  done
}


# ------------------------------------------------------------------- config ----
render() {  # render TEMPLATE OUT
  sed -e "s|@STATE@|$STATE|g" -e "s|@CLUSTER@|$CLUSTER|g" \
      -e "s|@PORT_CTLD@|$PORT_BASE|g" -e "s|@PORT_GPUNODE@|$((PORT_BASE + 1))|g" \
      -e "s|@PORT_DBD@|$((PORT_BASE + 2))|g" -e "s|@PORT_CPUNODE@|$((PORT_BASE + 3))|g" \
      -e "s|@FIRST_JOB_ID@|$FIRST_JOB_ID|g" "$HERE/$1" > "$2.new"
  if cmp -s "$2.new" "$2"; then rm -f "$2.new"; return 1; fi
  mv -f "$2.new" "$2"
}

# write_config: (re)render the config files; sets CHANGED_SLURM / CHANGED_DBD when running daemons
# would hold an outdated slurm.conf+gres.conf / slurmdbd.conf.
write_config() {
  mkdir -p "$STATE"/{etc,run,log,ctld,dev,munge,mysql} "${NODES[@]/#/$STATE/spool/}"
  chmod 755 "$STATE" "$STATE/munge"   # munged wants every directory above its socket o+x
  if [ ! -s "$STATE/etc/first_job_id" ]; then
    # A new state: job ids start at a clock-derived base (below MaxJobId=67043328).
    echo $(( ( $(date +%s) % 60000 + 1 ) * 1000 + 1 )) > "$STATE/etc/first_job_id"
  fi
  FIRST_JOB_ID=$(cat "$STATE/etc/first_job_id")
  CHANGED_SLURM=0 CHANGED_DBD=0
  render slurm.conf.in "$CONF" && CHANGED_SLURM=1
  render gres.conf.in "$STATE/etc/gres.conf" && CHANGED_SLURM=1
  render slurmdbd.conf.in "$STATE/etc/slurmdbd.conf" && CHANGED_DBD=1
  chmod 600 "$STATE/etc/slurmdbd.conf"
  : > "$STATE/etc/plugstack.conf"
  local i
  for i in 0 1; do
    [ -c "$STATE/dev/nvidia$i" ] || { rm -f "$STATE/dev/nvidia$i"; mknod "$STATE/dev/nvidia$i" c 1 3; }
  done
}

ensure_hosts() {
  local n missing=()
  for n in "${NODES[@]}"; do
    getent hosts "$n" >/dev/null 2>&1 || missing+=("$n")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ -w /etc/hosts ] || die "/etc/hosts needs '127.0.0.1 ${missing[*]}' (run once as root)"
  echo "127.0.0.1 ${missing[*]}  # megatron-rl slurm/dev-cluster.sh" >> /etc/hosts
  log "added '127.0.0.1 ${missing[*]}' to /etc/hosts"
}

# ------------------------------------------------------------------ daemons ----
# Every daemon carries the tag in its environment; none inherits our stdio (a caller reading our
# output would wait for the daemons to exit) or the lock's file descriptor.
launch() { env "$TAG" "$@" </dev/null >>"$STATE/log/launch.out" 2>&1 9>&-; }
launch_bg() { env "$TAG" setsid "$@" </dev/null >>"$STATE/log/launch.out" 2>&1 9>&- & }

start_munge() {
  daemon_pid munged "$STATE/munge/munged.pid" >/dev/null && return 0
  if [ ! -s "$STATE/munge/munge.key" ]; then
    (umask 077; head -c 128 /dev/urandom > "$STATE/munge/munge.key")
  fi
  rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
  launch munged --socket="$MUNGE_SOCK" --key-file="$STATE/munge/munge.key" \
    --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/munge/munged.log" \
    --seed-file="$STATE/munge/munged.seed" || { show_logs; die "munged did not start"; }
  wait_for "munged" munge -n -S "$MUNGE_SOCK"
}

# Small and fast: a test database, not a durable one (a crash may lose the last second of accounting).
MYSQL_OPTS=(--skip-log-bin --innodb-buffer-pool-size=64M --innodb-log-file-size=16M
  --innodb-flush-log-at-trx-commit=0 --innodb-doublewrite=0 --innodb-lock-wait-timeout=900)

start_mysql() {
  daemon_pid mariadbd "$STATE/mysql/mysqld.pid" >/dev/null && return 0
  local data=$STATE/mysql/data
  # MariaDB segfaults when it cannot write its pid-file directory: everything under mysql/ is its own.
  chown mysql:mysql "$STATE/mysql"
  if [ ! -d "$data/mysql" ]; then
    rm -rf "$data"
    mariadb-install-db --no-defaults --datadir="$data" --user=mysql \
      --auth-root-authentication-method=socket --skip-test-db "${MYSQL_OPTS[@]}" \
      > "$STATE/mysql/install.log" 2>&1 || { cat "$STATE/mysql/install.log" >&2; die "mariadb-install-db failed"; }
  fi
  chown -R mysql:mysql "$STATE/mysql"
  rm -f "$MYSQL_SOCK"
  launch_bg mariadbd --no-defaults --user=mysql --datadir="$data" --socket="$MYSQL_SOCK" \
    --pid-file="$STATE/mysql/mysqld.pid" --log-error="$STATE/mysql/mysqld.log" --skip-networking \
    --max-connections=50 "${MYSQL_OPTS[@]}"
  WATCH="mariadbd:$STATE/mysql/mysqld.pid" WATCH_BG=$! wait_for "MariaDB socket $MYSQL_SOCK" test -S "$MYSQL_SOCK"
}

sacctmgr_q() { sacctmgr -n -P "$@"; }

start_slurmdbd() {
  local marker=$STATE/run/associations.ok
  if daemon_pid slurmdbd "$STATE/run/slurmdbd.pid" >/dev/null; then
    [ -f "$marker" ] && return 0
  else
    rm -f "$marker"
    MYSQL_UNIX_PORT=$MYSQL_SOCK launch slurmdbd || { show_logs; die "slurmdbd did not start"; }
  fi
  WATCH="slurmdbd:$STATE/run/slurmdbd.pid mariadbd:$STATE/mysql/mysqld.pid" \
    wait_for "slurmdbd on port $((PORT_BASE + 2))" sacctmgr_q show cluster format=cluster
  # Cluster, account `mrl` and this user's association in it, each added only when missing, in one
  # sacctmgr session (commands on stdin), then checked.
  local user cmds=""
  user=$(id -un)
  assoc_missing() {
    local assoc
    assoc=$(sacctmgr_q show assoc format=cluster,account,user 2>/dev/null)
    grep -q "^$CLUSTER|" <<<"$assoc" || echo "add cluster $CLUSTER"
    grep -q "^$CLUSTER|mrl|" <<<"$assoc" \
      || echo "add account mrl Cluster=$CLUSTER Description=megatron-rl Organization=dev"
    grep -qxF "$CLUSTER|mrl|$user" <<<"$assoc" || echo "add user $user Account=mrl Cluster=$CLUSTER"
  }
  cmds=$(assoc_missing)
  if [ -n "$cmds" ]; then
    sacctmgr -i <<<"$cmds" > "$STATE/log/sacctmgr.out" 2>&1 || true
    cmds=$(assoc_missing)
    [ -z "$cmds" ] || { cat "$STATE/log/sacctmgr.out" >&2; die "sacctmgr could not: $cmds"; }
  fi
  : > "$marker"
}

start_slurmctld() {
  daemon_pid slurmctld "$STATE/run/slurmctld.pid" >/dev/null && return 0
  launch slurmctld -f "$CONF" || { show_logs; die "slurmctld did not start"; }
  WATCH="slurmctld:$STATE/run/slurmctld.pid" wait_for "slurmctld on port $PORT_BASE" scontrol ping
}

start_slurmd() {
  local n=$1
  daemon_pid slurmd "$STATE/run/slurmd-$n.pid" >/dev/null && return 0
  launch slurmd -f "$CONF" -N "$n" || { show_logs; die "slurmd -N $n did not start"; }
}

nodes_idle() {
  local out
  out=$(sinfo -h -N -o '%N %T' 2>/dev/null) || return 1
  local n
  for n in "${NODES[@]}"; do
    grep -Eq "^$n (idle|mixed|allocated)\$" <<<"$out" || return 1
  done
}

check_ports() {  # a listener on our ports that is not ours is someone else's cluster: refuse
  local listening p line pid comm
  listening=$(ss -Hltnp 2>/dev/null || true)
  for p in "$PORT_BASE" $((PORT_BASE + 1)) $((PORT_BASE + 2)) $((PORT_BASE + 3)); do
    line=$(grep -m1 -E "[:.]$p[[:space:]].*users:" <<<"$listening" || true)
    [ -z "$line" ] && continue
    pid=$(sed -n 's/.*users:(("[^"]*",pid=\([0-9]*\).*/\1/p' <<<"$line")
    comm=$(sed -n 's/.*users:(("\([^"]*\)".*/\1/p' <<<"$line")
    [ -n "$pid" ] && pid_is_ours "$pid" && continue
    die "port $p is taken by pid ${pid:-?} (${comm:-?}), not by this cluster ($STATE): stop it or set MRL_SLURM_PORT_BASE"
  done
}

# Leftovers: our daemons without a (valid) pid file, e.g. after the state dir was deleted under them.
reap_strays() {
  local known=() p name file stray=()
  for file in "$STATE"/munge/munged.pid "$STATE"/mysql/mysqld.pid "$STATE"/run/*.pid; do
    p=$(read_pidfile "$file" 2>/dev/null)
    [ -n "$p" ] && known+=("$p")
  done
  for name in munged mariadbd slurmdbd slurmctld slurmd; do
    for p in $(our_pids "$name"); do
      [[ " ${known[*]} " == *" $p "* ]] || stray+=("$p")
    done
  done
  if [ ${#stray[@]} -gt 0 ]; then
    log "stopping stale daemons of $STATE without a pid file: ${stray[*]}"
    kill_wait 10 "${stray[@]}"
  fi
}

cmd_start() {
  local t0=$SECONDS
  [ "$(id -u)" = 0 ] || die "run as root (daemons run as root/mysql; mknod, /etc/hosts)"
  local b
  for b in munged mariadbd mariadb-install-db slurmdbd slurmctld slurmd sacctmgr sinfo ss; do
    command -v "$b" >/dev/null || die "$b not found: run scripts/setup.sh (Debian packages)"
  done
  check_ports
  write_config
  reap_strays
  # Changed config files: running daemons would keep the old ones, so restart those.
  local old=() restart=() pid
  [ $CHANGED_SLURM = 1 ] && restart+=(slurmctld slurmd-gpunode slurmd-cpunode)
  [ $CHANGED_DBD = 1 ] && restart+=(slurmdbd)
  for b in "${restart[@]}"; do
    pid=$(read_pidfile "$STATE/run/$b.pid")
    if pid_alive "$pid" && pid_is_ours "$pid"; then old+=("$pid"); fi
  done
  if [ ${#old[@]} -gt 0 ]; then log "config changed: restarting daemons ${old[*]}"; kill_wait 10 "${old[@]}"; fi
  ensure_hosts
  start_munge
  start_mysql
  start_slurmdbd
  start_slurmctld
  local n
  for n in "${NODES[@]}"; do start_slurmd "$n"; done
  WATCH="slurmctld:$STATE/run/slurmctld.pid slurmd:$STATE/run/slurmd-gpunode.pid"
  WATCH="$WATCH slurmd:$STATE/run/slurmd-cpunode.pid" wait_for "nodes ${NODES[*]} to be idle" nodes_idle
  log "up in $((SECONDS - t0))s: $(sinfo -h -o '%P=%D:%T' | tr '\n' ' ')(SLURM_CONF=$CONF)"
}

# Until a scan finds none: a daemon may fork (slurmd starting a slurmstepd, say) after a scan.
kill_all_ours() {
  local round pids
  for round in 1 2 3 4; do
    pids=$(our_pids '*')
    [ -z "$pids" ] && return 0
    # shellcheck disable=SC2086
    kill_wait 20 $pids
  done
  pids=$(our_pids '*')
  [ -z "$pids" ] || die "could not stop: $pids"
}

cmd_stop() {
  local wipe=0
  [ "${1:-}" = --wipe ] && wipe=1
  if [ -d "$STATE" ]; then
    # Cancel jobs while slurmctld can still record it; do not wait for them.
    if daemon_pid slurmctld "$STATE/run/slurmctld.pid" >/dev/null; then
      local jobs
      jobs=$(timeout 5 squeue -h -o %A 2>/dev/null | tr '\n' ' ' || true)
      [ -n "${jobs// /}" ] && timeout 5 scancel $jobs 2>/dev/null || true
    fi
    # Everything at once (TERM, then KILL after 20 s): slurmctld saves its state on TERM and keeps
    # accounting records it could not deliver in its state dir for the next start. Ordered shutdown
    # (Slurm, then slurmdbd, then MariaDB and munge) costs ~2 s more and bought nothing measurable.
    kill_all_ours
    rm -f "$STATE"/run/* "$STATE/munge/munged.pid"  # pid files and markers (see tests/slurm_fixtures.py)
  else
    kill_all_ours  # state dir gone (wiped under running daemons): found by their tag alone
  fi
  if [ $wipe = 1 ]; then
    rm -rf "$STATE"
    log "stopped; removed $STATE"
  else
    log "stopped"
  fi
}

cmd_status() {
  local up=0 down=0 p name file
  for name in munged:"$STATE/munge/munged.pid" mariadbd:"$STATE/mysql/mysqld.pid" \
      slurmdbd:"$STATE/run/slurmdbd.pid" slurmctld:"$STATE/run/slurmctld.pid" \
      slurmd:"$STATE/run/slurmd-gpunode.pid" slurmd:"$STATE/run/slurmd-cpunode.pid"; do
    file=${name#*:}; name=${name%%:*}
    if p=$(daemon_pid "$name" "$file"); then
      printf '%-10s running  pid %s  (%s)\n' "$name" "$p" "$(basename "$file" .pid)"; up=$((up + 1))
    else
      printf '%-10s stopped           (%s)\n' "$name" "$(basename "$file" .pid)"; down=$((down + 1))
    fi
  done
  echo "SLURM_CONF=$CONF"
  if [ $up -gt 0 ]; then sinfo -N -o '%N %P %T %c %G' 2>/dev/null || true; fi
  [ $down -eq 0 ] && nodes_idle && return 0
  [ $up -eq 0 ] && return 3
  return 1
}

cmd_env() {
  printf 'export SLURM_CONF=%q\n' "$CONF"
  printf 'export MRL_SLURM_STATE=%q\n' "$STATE"
}

with_lock() {
  mkdir -p "$(dirname "$STATE")"
  exec 9>"$STATE.lock"
  flock -w "$((TIMEOUT * 3))" 9 || die "another dev-cluster.sh holds $STATE.lock"
  "$@"
}

case "${1:-}" in
  start) with_lock cmd_start ;;
  stop) shift; with_lock cmd_stop "$@" ;;
  status) cmd_status ;;
  env) cmd_env ;;
  *) echo "usage: $0 {start|stop [--wipe]|status|env}" >&2; exit 2 ;;
esac
