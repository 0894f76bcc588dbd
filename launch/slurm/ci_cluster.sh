#!/usr/bin/env bash
# launch/slurm/ci_cluster.sh: CI entry for the multi-host tests with a real SLURM cluster.
#
# Installs Debian's slurmctld, slurmd, slurm-client and munge when missing (needs root and
# apt), then runs tests/test_multihost.py, whose SLURM test starts a single-node cluster on
# localhost (launch/slurm/local_cluster.sh), submits a 4-process x 2-CPU-device training job
# through launch/slurm/submit.sh / sbatch, checks it completes and that its losses equal the
# single-process run, and stops the daemons it started. Everything runs under `timeout`.
# Environment: PYTHON (default: /work/venv/bin/python if present, else python3).
set -eu
cd "$(dirname "$0")/../.."
python=${PYTHON:-$( [ -x /work/venv/bin/python ] && echo /work/venv/bin/python || echo python3)}
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  timeout 300 apt-get update -qq
  DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
fi
exec timeout 900 "$python" -m pytest -q tests/test_multihost.py "$@"
