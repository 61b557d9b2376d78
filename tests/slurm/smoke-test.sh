#!/usr/bin/env bash
# Smoke test of the cluster from start-cluster.sh, and the reference recipe for
# "signal the job -> it drains -> it requeues itself -> it runs again":
#   1. srun -N2 reaches both virtual nodes;
#   2. an sbatch job (--nodes=2 --requeue --signal=B:USR1@...) runs a
#      long-lived `srun --ntasks-per-node=1` step on both nodes;
#   3. `scancel --signal=USR1 --batch JOB` (what Slurm itself sends at the
#      --signal time) -> the batch script's trap drains the tasks and calls
#      `scontrol requeue $SLURM_JOB_ID` -> the job runs again with
#      SLURM_RESTART_COUNT=1 about cred_expire+1 s (11 s by default) later.
# Takes ~20 s.  Exit 0 = all good.
set -euo pipefail
command -v sbatch >/dev/null || { echo "no slurm: run tests/slurm/start-cluster.sh" >&2; exit 1; }

WORK="$(mktemp -d /tmp/plexrl-slurm-smoke.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
fail() { echo "smoke-test: FAIL: $*" >&2; [ -f "$WORK/out" ] && cat "$WORK/out" >&2; [ -n "${JID:-}" ] && scancel "$JID" 2>/dev/null; exit 1; }

# 1 ---------------------------------------------------------------------------
got="$(timeout 30 srun -N2 --ntasks-per-node=1 bash -c 'echo $SLURMD_NODENAME $SLURM_NODEID' | sort | paste -sd' ')"
[ "$got" = "n1 0 n2 1" ] || fail "srun -N2 gave '$got'"
echo "smoke-test: srun -N2 ok ($got)"

# 2 + 3 -----------------------------------------------------------------------
cat >"$WORK/job.sh" <<'EOF'
#!/bin/bash
#SBATCH --nodes=2
#SBATCH --requeue
#SBATCH --signal=B:USR1@30
#SBATCH --time=10
#SBATCH --open-mode=append
R=${SLURM_RESTART_COUNT:-0}
echo "start restart=$R job=$SLURM_JOB_ID nodes=$SLURM_JOB_NODELIST"
if [ "$R" -ge 1 ]; then
  srun --ntasks-per-node=1 bash -c 'echo "rerun on $SLURMD_NODENAME restart=$SLURM_RESTART_COUNT"'
  exit 0
fi
drain() {
  echo "batch got USR1"
  # Signal only the steps' tasks (scancel without --batch/--full does not hit
  # this shell), let them finish, then requeue.  `scontrol requeue` kills this
  # script at some point after it returns: make it the last thing.
  scancel --signal=TERM "$SLURM_JOB_ID"
  wait "$SRUN_PID"
  echo "tasks drained rc=$?"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
}
trap drain USR1
# Run steps in the background and `wait`: bash runs a trap only between
# commands, and `wait` is interruptible.
srun --ntasks-per-node=1 bash -c 'trap "echo drained $SLURMD_NODENAME; exit 0" TERM; touch "$OUTDIR/up-$SLURMD_NODENAME"; while :; do sleep 0.2; done' &
SRUN_PID=$!
wait "$SRUN_PID"
EOF
JID="$(OUTDIR="$WORK" sbatch --parsable --output="$WORK/out" "$WORK/job.sh")"
for _ in $(seq 100); do [ -e "$WORK/up-n1" ] && [ -e "$WORK/up-n2" ] && break; sleep 0.2; done
[ -e "$WORK/up-n1" ] && [ -e "$WORK/up-n2" ] || fail "tasks did not start on both nodes"
[ "$(squeue -h -j "$JID" -o %T)" = RUNNING ] || fail "job $JID not RUNNING"
echo "smoke-test: job $JID RUNNING on $(squeue -h -j "$JID" -o %N)"

t0=$SECONDS
scancel --signal=USR1 --batch "$JID"
for _ in $(seq 150); do grep -q "^rerun on n2 restart=1" "$WORK/out" && grep -q "^rerun on n1 restart=1" "$WORK/out" && break; sleep 0.2; done
grep -q "^rerun on n1 restart=1" "$WORK/out" || fail "job did not rerun with SLURM_RESTART_COUNT=1 within 30 s"
grep -q "^drained n1" "$WORK/out" && grep -q "^drained n2" "$WORK/out" || fail "tasks did not drain"
echo "smoke-test: USR1 -> drain -> requeue -> rerun (restart=1) in $((SECONDS - t0)) s"
echo "smoke-test: OK"
