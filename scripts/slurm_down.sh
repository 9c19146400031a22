#!/usr/bin/env bash
# Stop daemons that scripts/slurm_up.sh started, by name:
#
#   slurm_down.sh [slurmd] [slurmctld] [munged]   stop those named (slurmd first, munged last)
#   slurm_down.sh --list                          print the ones running, one a line
#
# A daemon is found through its pid file in the scratch directory
# ($DISTCACHE_SLURM_DIR/<daemon>.pid, default /tmp/distcache-slurm) and counts only if
# that pid still runs the named program, so a recycled pid or a daemon this machine runs
# for other reasons is never touched. slurm_up.sh writes munged.pid there only when it
# started munged itself. Each daemon gets SIGTERM, then SIGKILL after 10 s.
set -uo pipefail

dir=${DISTCACHE_SLURM_DIR:-/tmp/distcache-slurm}
order=(slurmd slurmctld munged)

say() { echo "slurm_down: $*" >&2; }

# pid_of DAEMON: print the daemon's pid if its pid file names a live process of that
# name. A zombie (exited, not yet reaped: a container's pid 1 may never reap) is gone.
pid_of() {
  local file=$dir/$1.pid pid stat
  [ -s "$file" ] || return 1
  pid=$(tr -dc 0-9 < "$file")
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ] || return 1
  stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [ "${stat:0:1}" != Z ] || return 1
  echo "$pid"
}

if [ "${1:-}" = --list ]; then
  for daemon in "${order[@]}"; do
    if pid_of "$daemon" >/dev/null; then echo "$daemon"; fi
  done
  exit 0
fi

for arg in "$@"; do
  case " ${order[*]} " in
    *" $arg "*) ;;
    *) say "unknown daemon '$arg' (expected: ${order[*]} or --list)"; exit 2 ;;
  esac
done

status=0
for daemon in "${order[@]}"; do
  case " $* " in *" $daemon "*) ;; *) continue ;; esac
  pid=$(pid_of "$daemon") || { rm -f "$dir/$daemon.pid"; continue; }
  say "stopping $daemon (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 100); do
    pid_of "$daemon" >/dev/null || break
    sleep 0.1
  done
  if pid_of "$daemon" >/dev/null; then
    say "$daemon (pid $pid) ignored SIGTERM for 10 s; killing it"
    kill -KILL "$pid" 2>/dev/null || true
    sleep 0.5
  fi
  if pid_of "$daemon" >/dev/null; then
    say "$daemon (pid $pid) is still running"
    status=1
  else
    rm -f "$dir/$daemon.pid"
  fi
done
exit "$status"
