#!/usr/bin/env bash
# Start a real two-node Slurm cluster on this one host, for integration tests
# and for use by hand.  Debian 12, run as root, no systemd needed: the daemons
# are started directly.
#
#   tests/slurm/start-cluster.sh      # idempotent; exits 0 quickly when up
#   tests/slurm/stop-cluster.sh       # cancels jobs, stops slurmd x2 + slurmctld
#
# Layout: virtual nodes n1, n2 (slurmd -N n1 / -N n2 on ports 17001/17002),
# slurmctld on 127.0.0.1:6817, config in /etc/slurm/slurm.conf (so sbatch,
# srun, squeue, scontrol work from a plain shell), state and spool under
# /var/lib/plexrl-slurm and /var/spool/slurmd/<node>, logs in /var/log/slurm.
# Each node has fake GPUs: a GRES "gpu" (gres.conf, AutoDetect=off) whose
# device files are character devices aliasing /dev/null (1:3), made with
# mknod under /run/plexrl-slurm/dev (slurmd refuses regular files: "is not a
# valid character or block device").  A job asking --gpus-per-node=N gets
# CUDA_VISIBLE_DEVICES=0,..,N-1 in its tasks, as on a GPU node; nothing can
# compute on them.
#
# Knobs (environment):
#   PLEXRL_SLURM_CPUS      CPUs declared per virtual node (default 2; may exceed
#                          the real core count: SlurmdParameters=config_overrides)
#   PLEXRL_SLURM_MEM_MB    RealMemory per virtual node (default 4096)
#   PLEXRL_SLURM_GPUS      fake GPUs per virtual node (default 2; 0: no GRES)
#   PLEXRL_SLURM_TIMEOUT   seconds to wait for both nodes to be idle (default 90)
#   PLEXRL_SLURM_CRED_EXPIRE  AuthInfo=cred_expire (default 10, min 5): a requeued
#                          job becomes eligible again this many seconds + 1 later;
#                          also the window for a step launch to reach slurmd
set -euo pipefail

CPUS="${PLEXRL_SLURM_CPUS:-2}"
MEM_MB="${PLEXRL_SLURM_MEM_MB:-4096}"
GPUS="${PLEXRL_SLURM_GPUS:-2}"
[ "$GPUS" -ge 0 ] 2>/dev/null || { echo "start-cluster: PLEXRL_SLURM_GPUS must be a number >= 0" >&2; exit 2; }
WAIT_S="${PLEXRL_SLURM_TIMEOUT:-90}"
CRED_EXPIRE="${PLEXRL_SLURM_CRED_EXPIRE:-10}"
[ "$CRED_EXPIRE" -ge 5 ] 2>/dev/null || { echo "start-cluster: PLEXRL_SLURM_CRED_EXPIRE must be >= 5 (Slurm ignores smaller values and uses 120)" >&2; exit 2; }
NODES=(n1 n2)
declare -A PORT=([n1]=17001 [n2]=17002)

CONF_DIR=/etc/slurm
CONF="$CONF_DIR/slurm.conf"
GRES_CONF="$CONF_DIR/gres.conf"
STATE_DIR=/var/lib/plexrl-slurm/state
SPOOL_BASE=/var/spool/slurmd
LOG_DIR=/var/log/slurm
RUN_DIR=/run/plexrl-slurm
GPU_DEV_DIR="$RUN_DIR/dev"
HOST="$(hostname -s)"

log() { echo "start-cluster: $*" >&2; }
die() {
  log "ERROR: $*"
  for f in "$LOG_DIR/slurmctld.log" "$LOG_DIR"/slurmd-n1.log "$LOG_DIR"/slurmd-n2.log /var/log/munge/munged.log; do
    [ -f "$f" ] && { echo "----- tail $f" >&2; tail -n 25 "$f" >&2; }
  done
  command -v sinfo >/dev/null 2>&1 && { echo "----- sinfo" >&2; sinfo -N -o '%N %T %E' >&2 || true; }
  exit 1
}

[ "$(id -u)" = 0 ] || { log "must run as root"; exit 1; }

pid_alive() { # pidfile [expected command name]: a live process of that name
  local pid
  [ -s "$1" ] || return 1
  pid="$(cat "$1")"
  kill -0 "$pid" 2>/dev/null || return 1
  # a zombie (PID 1 here may reap late) is dead
  [ "$(sed -E 's/^.*\) (.).*/\1/' "/proc/$pid/stat" 2>/dev/null)" != Z ] || return 1
  [ -z "${2:-}" ] || [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}

# ---------------------------------------------------------------- packages
need_pkgs=()
for p in slurmctld slurmd slurm-client munge; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need_pkgs+=("$p")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
  log "installing ${need_pkgs[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  # Keep package scripts from trying to start services (no init system here;
  # we start the daemons ourselves below).  Only add our policy if none exists.
  added_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    added_policy=1
  fi
  trap '[ "$added_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d' EXIT
  apt_log="$(mktemp)"
  apt-get update -qq >"$apt_log" 2>&1 || { cat "$apt_log" >&2; die "apt-get update failed"; }
  apt-get install -y -qq --no-install-recommends \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
    "${need_pkgs[@]}" >>"$apt_log" 2>&1 || { tail -n 30 "$apt_log" >&2; die "apt-get install ${need_pkgs[*]} failed"; }
  rm -f "$apt_log"
  [ "$added_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
  trap - EXIT
fi

# ---------------------------------------------------------------- munge
if [ ! -s /etc/munge/munge.key ]; then
  log "creating munge key"
  install -d -o munge -g munge -m 700 /etc/munge
  if command -v mungekey >/dev/null 2>&1; then
    mungekey --create --keyfile=/etc/munge/munge.key --force
  else
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 400 /etc/munge/munge.key
fi
install -d -o munge -g munge -m 755 /run/munge
install -d -o munge -g munge -m 700 /var/lib/munge /var/log/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  if pid_alive /run/munge/munged.pid munged; then
    kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
    sleep 1
  fi
  rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
  log "starting munged"
  runuser -u munge -- /usr/sbin/munged --force ||
    die "munged failed to start"
  for _ in $(seq 50); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break
    sleep 0.1
  done
  munge -n | unmunge >/dev/null || die "munge does not work"
fi

# ---------------------------------------------------------------- sacct shim
# No accounting here, so the real sacct cannot answer; submitit needs it to see
# job states.  Put our squeue/scontrol-based stand-in first on PATH, unless the
# admin put something else there.  PLEXRL_SLURM_SACCT_SHIM=0 skips this.
SHIM_SRC="$(cd "$(dirname "$0")" && pwd)/bin/sacct"
if [ "${PLEXRL_SLURM_SACCT_SHIM:-1}" = 1 ] && [ -f "$SHIM_SRC" ]; then
  if [ ! -e /usr/local/bin/sacct ] || grep -q plexrl-sacct-shim /usr/local/bin/sacct 2>/dev/null; then
    cmp -s "$SHIM_SRC" /usr/local/bin/sacct || install -m 755 "$SHIM_SRC" /usr/local/bin/sacct
  fi
fi

# ---------------------------------------------------------------- slurm.conf
install -d -m 755 "$CONF_DIR" "$LOG_DIR" "$RUN_DIR" /var/lib/plexrl-slurm
install -d -m 700 "$STATE_DIR"
for n in "${NODES[@]}"; do install -d -m 755 "$SPOOL_BASE/$n"; done

# fake GPUs: /run/plexrl-slurm/dev/<node>-gpu<i>, character devices (1:3, like /dev/null)
gres_node=""
if [ "$GPUS" -gt 0 ]; then
  install -d -m 755 "$GPU_DEV_DIR"
  for n in "${NODES[@]}"; do
    for i in $(seq 0 $((GPUS - 1))); do
      dev="$GPU_DEV_DIR/$n-gpu$i"
      [ -c "$dev" ] || { rm -f "$dev"; mknod -m 666 "$dev" c 1 3 || die "mknod $dev failed (fake GPUs need CAP_MKNOD; PLEXRL_SLURM_GPUS=0 skips them)"; }
    done
  done
  gres_node=" Gres=gpu:$GPUS"
fi

new_conf="$(mktemp)"
cat >"$new_conf" <<EOF
# Written by tests/slurm/start-cluster.sh (PlexRL test cluster); rewritten on each start.
ClusterName=plexrl-ci
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=6817
AuthType=auth/munge
CredType=cred/munge
# A requeued job may only start again cred_expire+1 s after the requeue
# (default 120 -> ~2 min).  Keep it short for tests.  Do NOT work around the
# delay with 'scontrol update jobid=X starttime=now': the job then fails with
# "Job credential revoked".
AuthInfo=cred_expire=$CRED_EXPIRE
SlurmUser=root
SlurmdUser=root

StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SPOOL_BASE/%n
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info

ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
GresTypes=gpu
SchedulerType=sched/backfill
# Periodic passes often enough that jobs whose BeginTime passed (requeued
# jobs) start within a couple of seconds (defaults: 60 s / 30 s).
SchedulerParameters=sched_interval=2,bf_interval=2
PreemptType=preempt/none
# Trust the node lines below even where they exceed the real hardware.
SlurmdParameters=config_overrides

AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none

ReturnToService=2
JobRequeue=1
KillWait=5
MessageTimeout=10
SlurmdTimeout=30
SlurmctldTimeout=30
InactiveLimit=0
MinJobAge=5
Waittime=0
UnkillableStepTimeout=30
MailProg=/bin/true

NodeName=n1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=${PORT[n1]} CPUs=$CPUS RealMemory=$MEM_MB$gres_node State=UNKNOWN
NodeName=n2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=${PORT[n2]} CPUs=$CPUS RealMemory=$MEM_MB$gres_node State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF

new_gres="$(mktemp)"
{
  echo "# Written by tests/slurm/start-cluster.sh: fake GPUs (device files aliasing /dev/null)."
  echo "AutoDetect=off"
  if [ "$GPUS" -gt 0 ]; then
    for n in "${NODES[@]}"; do
      echo "NodeName=$n Name=gpu File=$GPU_DEV_DIR/$n-gpu[0-$((GPUS - 1))]"
    done
  fi
} >"$new_gres"

conf_changed=0
if ! cmp -s "$new_conf" "$CONF"; then
  conf_changed=1
  install -m 644 "$new_conf" "$CONF"
fi
if ! cmp -s "$new_gres" "$GRES_CONF"; then
  conf_changed=1
  install -m 644 "$new_gres" "$GRES_CONF"
fi
rm -f "$new_conf" "$new_gres"

# ---------------------------------------------------------------- health
nodes_ready() { # both nodes responding and schedulable (idle / allocated / mixed)
  local out
  out="$(sinfo -h -N -p debug -o '%N %t' 2>/dev/null)" || return 1
  for n in "${NODES[@]}"; do
    echo "$out" | grep -Eq "^$n (idle|alloc|mix|comp)$" || return 1
  done
}
all_alive() {
  pid_alive "$RUN_DIR/slurmctld.pid" slurmctld || return 1
  for n in "${NODES[@]}"; do pid_alive "$RUN_DIR/slurmd-$n.pid" slurmd || return 1; done
}

summary() {
  local st
  st="$(sinfo -h -N -p debug -o '%N:%t' | sort -u | tr '\n' ' ')"
  echo "plexrl-ci slurm cluster up: controller $HOST(127.0.0.1):6817, nodes ${st% } (CPUs=$CPUS RealMemory=$MEM_MB GPUs=$GPUS each), partition debug, conf $CONF ($1)"
}

if [ "$conf_changed" = 0 ] && all_alive && nodes_ready; then
  summary "already running"
  exit 0
fi

# ---------------------------------------------------------------- (re)start daemons
if [ "$conf_changed" = 1 ] && { pid_alive "$RUN_DIR/slurmctld.pid" slurmctld ||
     pid_alive "$RUN_DIR/slurmd-n1.pid" slurmd || pid_alive "$RUN_DIR/slurmd-n2.pid" slurmd; }; then
  log "slurm.conf changed: restarting daemons (running jobs are cancelled)"
  "$(dirname "$0")/stop-cluster.sh" >/dev/null 2>&1 || true
fi

if ! pid_alive "$RUN_DIR/slurmctld.pid" slurmctld; then
  log "starting slurmctld"
  /usr/sbin/slurmctld || die "slurmctld failed to start"
fi
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q 'is UP' && break; sleep 0.2; done
scontrol ping 2>/dev/null | grep -q 'is UP' || die "slurmctld does not answer (scontrol ping)"

for n in "${NODES[@]}"; do
  if ! pid_alive "$RUN_DIR/slurmd-$n.pid" slurmd; then
    log "starting slurmd -N $n"
    /usr/sbin/slurmd -N "$n" || die "slurmd -N $n failed to start"
  fi
done

deadline=$((SECONDS + WAIT_S))
resumed_at=-100
until nodes_ready; do
  [ "$SECONDS" -lt "$deadline" ] || die "nodes not idle after ${WAIT_S}s"
  # Nodes left down/drained from an earlier run (or "unexpectedly rebooted"):
  # resume them once they respond.  At most every 5 s.
  if [ $((SECONDS - resumed_at)) -ge 5 ]; then
    bad="$(sinfo -h -N -p debug -o '%N %t' 2>/dev/null | awk '$2 ~ /^(down|drain|drng|drained|fail)/ && $2 !~ /\*$/ {print $1}' | sort -u | paste -sd, -)"
    if [ -n "$bad" ]; then
      scontrol update nodename="$bad" state=resume 2>/dev/null || true
      resumed_at=$SECONDS
    fi
  fi
  sleep 0.5
done

summary "started"
