#!/usr/bin/env bash
# `make demo` as a newcomer runs it, on this machine's CPU: once alone, once beside a second CPU-heavy process (one
# busy Python loop per core). Prints wall and CPU time of each; setup (.venv) is done first and not counted. Each
# demo writes a new run under runs/, as `make demo` does.
# Usage (repo root): bash bench/demo_cpu.sh
set -euo pipefail
make setup >/dev/null
measure() {  # label
  /usr/bin/time -f "$1: wall %e s, CPU %U s user + %S s system" make demo >"/tmp/demo_cpu_$1.log" 2>/tmp/demo_cpu_time
  tail -n 1 /tmp/demo_cpu_time
}
measure alone
busy=()
for _ in $(seq "$(nproc)"); do
  python3 -c "while True: pass" &
  busy+=($!)
done
measure beside-busy-loops
kill "${busy[@]}"
echo "logs: /tmp/demo_cpu_alone.log /tmp/demo_cpu_beside-busy-loops.log"
