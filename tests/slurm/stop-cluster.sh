#!/usr/bin/env bash
# Stop the test cluster started by tests/slurm/start-cluster.sh: cancel all
# jobs, stop both slurmd and slurmctld.  munged is left running.  Idempotent.
set -uo pipefail

RUN_DIR=/run/plexrl-slurm
NODES=(n1 n2)

log() { echo "stop-cluster: $*" >&2; }

proc_alive() { # pid: running, not a zombie (PID 1 here may reap late)
  kill -0 "$1" 2>/dev/null &&
    [ "$(sed -E 's/^.*\) (.).*/\1/' "/proc/$1/stat" 2>/dev/null)" != Z ]
}
pid_alive() { # pidfile [expected command name]
  local pid
  [ -s "$1" ] || return 1
  pid="$(cat "$1")"
  proc_alive "$pid" || return 1
  [ -z "${2:-}" ] || [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ]
}

stop_pidfile() { # pidfile name comm
  local f="$1" pid
  pid_alive "$f" "$3" || { rm -f "$f"; return 0; }
  pid="$(cat "$f")"
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 100); do proc_alive "$pid" || break; sleep 0.1; done
  if proc_alive "$pid"; then
    log "$2 (pid $pid) did not stop in 10 s: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

if pid_alive "$RUN_DIR/slurmctld.pid" slurmctld && command -v scancel >/dev/null 2>&1; then
  if [ -n "$(squeue -h -o %i 2>/dev/null)" ]; then
    # all jobs of all users (scancel needs ids or a filter)
    squeue -h -o %i 2>/dev/null | sort -u | xargs -r scancel --quiet 2>/dev/null || true
    # give slurmd/slurmstepd a moment to kill the tasks (KillWait=5)
    for _ in $(seq 80); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.25; done
  fi
fi

for n in "${NODES[@]}"; do stop_pidfile "$RUN_DIR/slurmd-$n.pid" "slurmd -N $n" slurmd; done
stop_pidfile "$RUN_DIR/slurmctld.pid" slurmctld slurmctld
echo "plexrl-ci slurm cluster stopped (munged left running)"
