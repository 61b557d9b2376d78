#!/bin/bash
# PlexRL cluster 'research': the daemon on the first node, workers on every node.
# Written by `plexctl up --slurm`; see slurm/plexrl.sbatch to submit it with plain sbatch.
#SBATCH --job-name=plexrl-research
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --mem=0
#SBATCH --time=2-00:00:00
#SBATCH --partition=gpu
#SBATCH --account=rl-lab
#SBATCH --qos=high
#SBATCH --constraint=h100
#SBATCH --exclusive
#SBATCH --requeue
#SBATCH --signal=USR1@300
#SBATCH --open-mode=append
#SBATCH --output=/shared/alice/.plexrl/clusters/research/slurm/%j.out
set -euo pipefail
mkdir -p /shared/alice/.plexrl/clusters/research/slurm
# one task per node; the signal reaches every task, the first drains the daemon and requeues
srun --ntasks-per-node=1 --kill-on-bad-exit=0 /shared/alice/venv/bin/python -m daemon.node --state-dir /shared/alice/.plexrl/clusters/research
