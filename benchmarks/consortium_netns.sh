#!/usr/bin/env bash
# A consortium rehearsal on one machine (SuperLink and SuperNodes in their own network namespaces, TLS, node auth,
# a roster, 0 ms then 50 ms RTT / 100 Mbit/s): see benchmarks/consortium_netns.py. Root only; prints
# "skipped: <reason>" and exits 0 where namespaces cannot be made.
#   benchmarks/consortium_netns.sh [--clients 3] [--rounds 3] [--out runs/consortium-netns] [--json FILE]
# The trap deletes this run's namespaces (and ends the processes in them) however the script ends.
set -u
cd "${0%/*}/.."
prefix="fdg$(( $$ % 100000 ))"
python="${PYTHON:-.venv/bin/python}"

cleanup() {
  command -v ip >/dev/null 2>&1 || return 0
  for ns in $(ip netns list 2>/dev/null | awk -v p="$prefix-" 'index($1, p) == 1 {print $1}'); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null; done
    ip netns del "$ns" 2>/dev/null
  done
}
trap cleanup EXIT
trap 'kill -TERM "$child" 2>/dev/null' TERM INT

OMP_NUM_THREADS=1 "$python" benchmarks/consortium_netns.py --prefix "$prefix" "$@" &
child=$!
wait "$child"; rc=$?
if [ "$rc" -gt 128 ] && kill -0 "$child" 2>/dev/null; then wait "$child"; rc=$?; fi  # a signal interrupted the wait: let the child clean up
exit "$rc"
