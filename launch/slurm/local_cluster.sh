#!/usr/bin/env bash
# launch/slurm/local_cluster.sh start DIR | stop DIR
#
# A single-node SLURM cluster on localhost, for CI and development (Debian packages slurmctld,
# slurmd, slurm-client, munge). `start` writes DIR/slurm.conf, starts munged, slurmctld and
# slurmd, waits until the node is idle and prints `export SLURM_CONF=DIR/slurm.conf`;
# `stop` ends exactly the daemons it started (PIDs in DIR/*.pid).
# Settings that work in an unprivileged-cgroup VM: proctrack/linuxproc and task/none (the
# cgroup plugins fail), CPUs=4 declared with config_overrides so 4 tasks fit on 2 cores,
# SlurmUser=root, KillWait=5 so a failed task ends the job in seconds.
set -eu
cmd=${1:?usage: local_cluster.sh start|stop DIR} dir=${2:?usage: local_cluster.sh start|stop DIR}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

stop() {
  for name in slurmd slurmctld munged; do
    [ -f "$dir/$name.pid" ] && kill "$(cat "$dir/$name.pid")" 2>/dev/null || true
    rm -f "$dir/$name.pid"
  done
}

start() {
  host=$(hostname -s)
  mkdir -p "$dir/state" "$dir/spool" "$dir/munge" /run/munge
  cat > "$dir/slurm.conf" <<CONF
ClusterName=jaxptd-ci
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
MpiDefault=none
SchedulerType=sched/builtin
NodeName=$host CPUs=4 State=UNKNOWN
PartitionName=ci Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
  export SLURM_CONF=$dir/slurm.conf
  [ -f /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null;
    chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
  chown munge:munge /run/munge
  su -s /bin/sh munge -c "/usr/sbin/munged --pid-file=/run/munge/jaxptd-ci.pid"
  cp /run/munge/jaxptd-ci.pid "$dir/munged.pid"
  slurmctld -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF"
  for _ in $(seq 60); do
    sinfo -h -o %T 2>/dev/null | grep -qx idle && { echo "export SLURM_CONF=$SLURM_CONF"; return 0; }
    sleep 0.5
  done
  echo "error: the local SLURM node did not become idle; see $dir/slurmctld.log, $dir/slurmd.log" >&2
  stop
  return 1
}

case $cmd in
  start) start ;;
  stop) stop ;;
  *) echo "usage: local_cluster.sh start|stop DIR" >&2; exit 2 ;;
esac
