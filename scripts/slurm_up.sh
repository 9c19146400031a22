#!/usr/bin/env bash
# Start a one-node Slurm cluster on this machine, for the srun launcher tests.
#
# Idempotent: when sinfo already answers with our configuration, it does nothing.
# Otherwise it installs slurm-wlm and munge (only when missing), writes a munge key
# (only when missing), starts munged, then slurmctld and slurmd with a configuration
# kept in a scratch directory. The node advertises 8 CPUs whatever the core count
# (SlurmdParameters=config_overrides) and the partition oversubscribes, so that
# `srun -n 4` runs on a 2-core machine. Non-default ports keep clear of any real Slurm.
#
# Prints `STARTED <daemon>` for each daemon it starts (munged, slurmctld, slurmd), as
# soon as it has started it, and the SLURM_CONF to export on its last line:
# `SLURM_CONF=<path>`. Whoever ran it stops what it started with
# `scripts/slurm_down.sh <daemon>...`; daemons that were already running are not listed.
# Environment: DISTCACHE_SLURM_DIR (scratch directory, default /tmp/distcache-slurm),
# DISTCACHE_SLURM_PORT (slurmctld port, default 16817; slurmd uses the next one).
# Needs root.
set -euo pipefail

dir=${DISTCACHE_SLURM_DIR:-/tmp/distcache-slurm}
port=${DISTCACHE_SLURM_PORT:-16817}
host=$(hostname -s)
conf=$dir/slurm.conf
export SLURM_CONF=$conf

say() { echo "slurm_up: $*" >&2; }

node_ready() {
  local state
  state=$(timeout 10 sinfo -h -n "$host" -o %T 2>/dev/null | head -1) || return 1
  case $state in idle*|mixed*|allocated*|completing*) return 0 ;; *) return 1 ;; esac
}

if [ -f "$conf" ] && command -v sinfo >/dev/null && node_ready; then
  say "already running ($conf)"
  echo "SLURM_CONF=$conf"
  exit 0
fi

if [ "$(id -u)" != 0 ]; then
  say "must run as root to start munged/slurmctld/slurmd"
  exit 1
fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
   || ! command -v srun >/dev/null || ! command -v munged >/dev/null; then
  say "installing slurm-wlm and munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >&2
  apt-get install -y -q slurm-wlm munge >&2
fi

# munge: Slurm authenticates every RPC with it.
key=/etc/munge/munge.key
if [ ! -s "$key" ]; then
  install -d -o munge -g munge -m 0700 /etc/munge
  head -c 1024 /dev/urandom > "$key"
fi
chown munge:munge "$key"
chmod 0400 "$key"
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
mkdir -p "$dir"
if ! timeout 5 munge -n 2>/dev/null | timeout 5 unmunge >/dev/null 2>&1; then
  say "starting munged"
  # Its pid file in our directory marks it as ours for slurm_down.sh.
  munged --force --pid-file="$dir/munged.pid"
  echo "STARTED munged"
  for _ in $(seq 50); do
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then break; fi
    sleep 0.1
  done
fi

# Stop daemons a previous run of this script left behind (only ours: our pid files).
bash "$(dirname "$0")/slurm_down.sh" slurmd slurmctld

mkdir -p "$dir/state" "$dir/spool"
cat > "$conf" <<CONF
# One-node test cluster written by scripts/slurm_up.sh.
ClusterName=distcache
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$port
SlurmdPort=$((port + 1))
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$host CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF

say "starting slurmctld and slurmd ($conf)"
# -c: start from a clean state, so jobs of an earlier run are not resurrected.
slurmctld -c -f "$conf"
echo "STARTED slurmctld"
slurmd -f "$conf"
echo "STARTED slurmd"

for i in $(seq 60); do
  if node_ready; then
    say "ready"
    echo "SLURM_CONF=$conf"
    exit 0
  fi
  if [ "$i" = 20 ]; then
    scontrol update nodename="$host" state=resume 2>/dev/null || true
  fi
  sleep 0.5
done

say "Slurm did not become ready; sinfo says:"
sinfo -N -l >&2 || true
for log in "$dir/slurmctld.log" "$dir/slurmd.log"; do
  echo "--- $log" >&2
  tail -n 40 "$log" >&2 2>/dev/null || true
done
exit 1
