#!/usr/bin/env bash
# launch/local.sh NPROC CONFIG [section.key=value ...]
#
# Starts NPROC jaxptd training processes on this machine, joined by jax.distributed (for
# development and tests). CONFIG is a YAML file, or "-" for the defaults. Unless given,
# runtime.cpu_devices is derived as (data x pipe x tensor) / NPROC.
#
# Output: process 0 prints as usual; other processes' lines (errors, mostly: only process 0
# reports progress) are prefixed "[rank] ".
# Exit status: 0 when every process exits 0. When one fails, the others are killed and
# this script exits with that process's status, naming it. SIGTERM / SIGUSR1 sent to this
# script are forwarded to every process (a preemption: they agree on a step, save it and
# exit 0); so is SIGINT (Ctrl-C: they save and exit 130, and this script with them; a
# second Ctrl-C ends them at once). Each process runs in its own session, so a terminal's
# Ctrl-C reaches them once, through this script, not twice.
#
# Environment: PYTHON (default: python3), JAXPTD_PORT (default: a free port).
set -u
if [ $# -lt 2 ]; then
  echo "usage: launch/local.sh NPROC CONFIG|- [section.key=value ...]" >&2
  exit 2
fi
nproc=$1 config=$2
shift 2
python=${PYTHON:-python3}
case $nproc in ''|*[!0-9]*|0) echo "error: NPROC=$nproc: must be a positive integer" >&2; exit 2;; esac
config_args=()
[ "$config" != "-" ] && config_args=(--config "$config")

# Devices per process from the mesh, unless runtime.cpu_devices is given.
overrides=("$@")
case " $* " in
  *" runtime.cpu_devices="*) ;;
  *) per=$("$python" - "$nproc" "${config_args[@]}" "$@" <<'PY'
import sys
from jaxptd.config import ConfigError, load_config
nproc, args = int(sys.argv[1]), sys.argv[2:]
path = args[1] if args[:1] == ["--config"] else None
try:
    config = load_config(path, args[2:] if path else args)
except ConfigError as e:
    sys.exit(f"error: {e}")
if config.num_devices % nproc:
    sys.exit(f"error: data x pipe x tensor = {config.num_devices}: must be divisible by "
             f"NPROC={nproc}")
print(config.num_devices // nproc)
PY
) || exit 2
     overrides+=("runtime.cpu_devices=$per");;
esac

# The coordinator port P and the roll-call port P - 1 (jaxptd/runtime/distributed.py) must be free.
port=${JAXPTD_PORT:-$("$python" -c '
import random, socket
while True:
    port = random.randint(20000, 60000)
    try:
        for p in (port, port - 1):
            socket.create_server(("", p)).close()
        break
    except OSError:
        pass
print(port)')}

pids=()
for ((rank = 0; rank < nproc; rank++)); do
  if [ "$rank" -eq 0 ]; then
    JAXPTD_COORDINATOR=localhost:$port JAXPTD_NUM_PROCESSES=$nproc JAXPTD_PROCESS_ID=$rank \
      setsid "$python" -u -m jaxptd.train "${config_args[@]}" "${overrides[@]}" &
  else
    JAXPTD_COORDINATOR=localhost:$port JAXPTD_NUM_PROCESSES=$nproc JAXPTD_PROCESS_ID=$rank \
      setsid "$python" -u -m jaxptd.train "${config_args[@]}" "${overrides[@]}" \
      > >(sed -u "s/^/[$rank] /") 2> >(sed -u "s/^/[$rank] /" >&2) &
  fi
  pids+=($!)
done

interrupted=0
forward() {
  echo "local.sh: forwarding SIG$1 to all processes" >&2
  [ "$1" = INT ] && interrupted=1
  kill -"$1" "${pids[@]}" 2>/dev/null
}
for sig in TERM INT USR1; do trap "forward $sig" "$sig"; done

alive=("${pids[@]}")
while [ "${#alive[@]}" -gt 0 ]; do
  done_pid=
  wait -n -p done_pid "${alive[@]}"
  code=$?
  if [ -z "${done_pid:-}" ]; then  # a trapped signal interrupted wait, or none is left
    [ "$code" -eq 127 ] && break
    continue
  fi
  alive=($(printf '%s\n' "${alive[@]}" | grep -vx "$done_pid"))
  if [ "$interrupted" -eq 1 ] && [ "$code" -eq 130 ]; then  # saved after Ctrl-C: wait for all
    final=130
    continue
  fi
  if [ "$code" -ne 0 ]; then
    for rank in "${!pids[@]}"; do [ "${pids[$rank]}" = "$done_pid" ] && failed=$rank; done
    echo "local.sh: process $failed (pid $done_pid) exited with status $code; killing the others" >&2
    kill -KILL "${alive[@]}" 2>/dev/null
    wait 2>/dev/null
    exit "$code"
  fi
done
exit "${final:-0}"
