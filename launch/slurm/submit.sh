#!/usr/bin/env bash
# launch/slurm/submit.sh CONFIG [section.key=value ...]
#
# Checks the config on the login node (so a typo fails here, not after queueing), then
# submits launch/slurm/train.sbatch with it. Extra sbatch options come from SBATCH_ARGS,
# e.g. SBATCH_ARGS="--nodes=4 --time=12:00:00"; sbatch's own SBATCH_* variables work too.
# Prints the job id (sbatch --parsable).
set -eu
if [ $# -lt 1 ]; then
  echo "usage: launch/slurm/submit.sh CONFIG|- [section.key=value ...]" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-python3}
config=$1
"$python" - "$@" <<'PY' || exit 2
import sys
from jaxptd.config import ConfigError, load_config
path = None if sys.argv[1] == "-" else sys.argv[1]
try:
    load_config(path, sys.argv[2:])
except ConfigError as e:
    sys.exit(f"error: {e}")
PY
exec sbatch --parsable ${SBATCH_ARGS:-} "$here/train.sbatch" "$@"
