#!/bin/bash
# Pipeline stages across two network namespaces on this machine (root): stage 1's worker in a
# namespace joined to this one by a veth pair. Measures the per-hop cost (`bench hop`) and the
# default model's TTFT/TPOT with PP-2 on one host (shared memory) and across the namespaces
# (relayed over Disco's SocketSession), in interleaved rounds. Writes OUT/hop_netns.json and
# OUT/tpot_netns.json.   Usage: bash scripts/pp_hosts_netns.sh [OUT] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/pipeline/hosts}; ROUNDS=${2:-3}
PY=${PY:-.venv/bin/python}
NS=sw-pp-hosts; NEAR=swpph0; FAR=swpph1; HERE=10.231.9.1; THERE=10.231.9.2; PORT=7700
PLAN=examples/plans/two-cpus-pp2.json
ip link del $NEAR 2>/dev/null || true; ip netns del $NS 2>/dev/null || true  # a run cut short
ip netns add $NS
cleanup() {
  [ -n "${WORKER:-}" ] && kill "$WORKER" 2>/dev/null; wait 2>/dev/null || true
  ip link del $NEAR 2>/dev/null || true; ip netns del $NS 2>/dev/null || true
}
trap cleanup EXIT
ip link add $NEAR type veth peer name $FAR
ip link set $FAR netns $NS
ip addr add $HERE/24 dev $NEAR && ip link set $NEAR up
ip -n $NS addr add $THERE/24 dev $FAR && ip -n $NS link set $FAR up && ip -n $NS link set lo up
ip netns exec $NS "$PY" -m sandwich_tvm.worker --listen $THERE:$PORT &
WORKER=$!
"$PY" - $THERE $PORT <<'PYEOF'
import socket, sys, time
for _ in range(300):  # until the worker listens (a connection that says nothing is refused, harmless)
    try:
        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()
        break
    except OSError:
        time.sleep(0.1)
else:
    sys.exit("the worker did not start listening")
PYEOF
mkdir -p "$OUT"
"$PY" -m sandwich_tvm.bench hop --hosts $THERE:$PORT --rounds 5 --json "$OUT/hop_netns.json"
ROWS=()
for r in $(seq "$ROUNDS"); do
  for system in shm hosts; do
    extra=(); [ $system = hosts ] && extra=(--hosts $THERE:$PORT)
    json=$("$PY" -m sandwich_tvm.generate --plan $PLAN "${extra[@]}" --prompt-len 128 --max-new-tokens 64 \
           --json 2>/dev/null)
    echo "round $r $system: $(echo "$json" | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print("ttft", d["ttft_ms"], "ms, tpot", d["tpot_ms"], "ms")')"
    ROWS+=("{\"round\": $r, \"system\": \"$system\", \"result\": $json}")
  done
done
CPU=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)
FAMILY=$(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2 | xargs); MODEL=$(grep -m1 '^model\s' /proc/cpuinfo | cut -d: -f2 | xargs)
ROWS_JSON=$(IFS=,; echo "${ROWS[*]}")
"$PY" - "$OUT/tpot_netns.json" "$CPU (family $FAMILY model $MODEL)" "$ROWS_JSON" <<'PYEOF'
import json, statistics, sys
path, cpu, rows = sys.argv[1], sys.argv[2], json.loads("[" + sys.argv[3] + "]")
for r in rows:
    r["result"].pop("tokens", None)
med = {s: {k: statistics.median(r["result"][k] for r in rows if r["system"] == s) for k in ("ttft_ms", "tpot_ms")}
       for s in ("shm", "hosts")}
out = {"command": "bash scripts/pp_hosts_netns.sh", "cpu": cpu, "threads": 2,
       "plan": "examples/plans/two-cpus-pp2.json (one core per stage)", "model": "default (SmolLM2-135M-Instruct Q4_1)",
       "prompt_tokens": 128, "new_tokens": 64, "rounds": rows, "median": med,
       "tpot_ratio_hosts_over_shm": med["hosts"]["tpot_ms"] / med["shm"]["tpot_ms"]}
tmp = path + ".tmp"
open(tmp, "w").write(json.dumps(out, indent=1))
import os; os.replace(tmp, path)
print(json.dumps(out["median"]), "tpot hosts/shm", round(out["tpot_ratio_hosts_over_shm"], 2))
PYEOF
