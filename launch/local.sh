#!/usr/bin/env bash
# launch/local.sh NPROC CONFIG [section.key=value ...]
#
# Starts NPROC jaxptd training processes on this machine, joined by jax.distributed (for
# development and tests). CONFIG is a YAML file, or "-" for the defaults. Unless given,
# runtime.cpu_devices is derived as (data x pipe x tensor) / NPROC.
#
# Output: process 0 prints as usual; other processes' lines (errors, mostly: only process 0
# reports progress) are prefixed "[rank] ".
# Exit status: 0 when every process exits 0. When one fails, this script names it, gives
# the others JAXPTD_GRACE_S seconds (default 30) to end on their own (a process that dies
# or hangs ends the others within seconds, each with a line saying why and its threads'
# stacks: jaxptd/runtime/watchdog.py), names each as it ends, kills those still running
# (a stopped or frozen one) and exits with the first failed process's status (75 for a
# fault: relaunch the same command to resume from the newest checkpoint). SIGTERM / SIGUSR1 sent to this
# script are forwarded to every process (a preemption: they agree on a step, save it and
# exit 0); so is SIGINT (Ctrl-C: they save and exit 130, and this script with them; a
# second Ctrl-C ends them at once). Each process runs in its own session, so a terminal's
# Ctrl-C reaches them once, through this script, not twice.
#
# Environment: PYTHON (default: python3), JAXPTD_PORT (default: a free port),
# JAXPTD_GRACE_S (default 30).
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

rank_of() { for r in "${!pids[@]}"; do [ "${pids[$r]}" = "$1" ] && echo "$r"; done; }
ended() {  # the first of "$@" that has ended (a zombie or gone), or nothing
  for pid in "$@"; do
    state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)
    if [ -z "$state" ] || [ "$state" = Z ]; then echo "$pid"; return; fi
  done
}
grace=${JAXPTD_GRACE_S:-30}
alive=("${pids[@]}")
failed= deadline=
while [ "${#alive[@]}" -gt 0 ]; do
  done_pid=
  if [ -n "$failed" ]; then  # after a failure: look every 0.2 s until the deadline
    [ "$SECONDS" -ge "$deadline" ] && break
    done_pid=$(ended "${alive[@]}")
    if [ -z "$done_pid" ]; then sleep 0.2; continue; fi
    wait "$done_pid" 2>/dev/null
    code=$?
  else
    wait -n -p done_pid "${alive[@]}" 2>/dev/null  # not bash's "Killed" line: ours below
    code=$?
  fi
  if [ -z "${done_pid:-}" ]; then  # a trapped signal interrupted wait, or none is left
    [ "$code" -eq 127 ] && break
    continue
  fi
  alive=($(printf '%s\n' "${alive[@]}" | grep -vx "$done_pid"))
  if [ "$interrupted" -eq 1 ] && [ "$code" -eq 130 ]; then  # saved after Ctrl-C: wait for all
    final=130
    continue
  fi
  if [ -n "$failed" ]; then
    echo "local.sh: process $(rank_of "$done_pid") (pid $done_pid) exited with status $code" >&2
  elif [ "$code" -ne 0 ]; then
    failed=$(rank_of "$done_pid") final=$code deadline=$((SECONDS + grace))
    echo "local.sh: process $failed (pid $done_pid) exited with status $code; waiting up to" \
      "${grace} s for the others to end" >&2
  fi
done
for pid in "${alive[@]}"; do
  echo "local.sh: killing process $(rank_of "$pid") (pid $pid): still running ${grace} s after" \
    "process $failed failed" >&2
  kill -KILL "$pid" 2>/dev/null
done
wait 2>/dev/null
exit "${final:-0}"
