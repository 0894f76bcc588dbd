#!/usr/bin/env bash
# launch/slurm/install.sh: installs Debian's SLURM and munge packages when missing (needs
# root and apt). .ci/run calls it so tests/test_multihost.py can start a single-node cluster
# on localhost (launch/slurm/local_cluster.sh) and run a real sbatch job; without SLURM that
# test skips with its reason.
set -eu
if command -v slurmctld >/dev/null && command -v munged >/dev/null; then
  exit 0
fi
timeout 300 apt-get update -qq
DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq --no-install-recommends \
  slurmctld slurmd slurm-client munge >/dev/null
