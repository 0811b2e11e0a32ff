#!/usr/bin/env bash
# The memory an event ring can hold (issue 28, finding 3), on the real
# binary and a real Mosquitto: a stream of the team is opened and closed
# (so the team has a ring), then N commands (2,000 by default) of 62 KiB
# go to one online device that never answers, and time out. Prints the
# service's heap (go_memstats_heap_alloc_bytes) and RSS at start, after
# the commands, and after their time-outs. Needs: go, mosquitto, curl,
# python3.
#   bash bench/eventmem.sh
#   BIN=/path/to/devicehub bash bench/eventmem.sh   # another build (pair old and new)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-2000}
MOSQ=$(command -v mosquitto || echo /usr/sbin/mosquitto)
[ -x "$MOSQ" ] || { echo "need mosquitto (apt-get install -y mosquitto)" >&2; exit 1; }

work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
BPORT=$(freeport); HPORT=$(freeport); MPORT=$(freeport)
API=http://127.0.0.1:$HPORT

if [ -n "${BIN:-}" ]; then cp "$BIN" "$work/devicehub"; else go build -o "$work/devicehub" .; fi
go build -o "$work/mqttload" ./bench/mqttload
DH="$work/devicehub"; DATA="$work/data"
printf 'listener %s 127.0.0.1\nallow_anonymous true\nuser %s\n' "$BPORT" "$(id -un)" > "$work/mosquitto.conf"
"$MOSQ" -c "$work/mosquitto.conf" 2>"$work/mosquitto.log" & pids+=($!)

printf "mem-password\n" | "$DH" user add -data "$DATA" -email mem@example.com -name Mem >/dev/null
"$DH" device add -data "$DATA" -owner mem@example.com -platform esp32 -board devkit > "$work/uids.txt"
TOKEN=$("$DH" token create -data "$DATA" -email mem@example.com -name mem)
UID1=$(sed -n 1p "$work/uids.txt")
DEVICEHUB_ACCESS_LOG=false "$DH" serve -data "$DATA" -addr "127.0.0.1:$HPORT" -metrics-addr "127.0.0.1:$MPORT" \
  -mqtt "tcp://127.0.0.1:$BPORT" -command-timeout 10s 2>"$work/devicehub.log" & HUB=$!; pids+=($HUB)
until curl -sf "$API/healthz" >/dev/null 2>&1; do sleep 0.01; done
"$work/mqttload" -broker "tcp://127.0.0.1:$BPORT" -mode online -uids "$work/uids.txt"

mem() {
  local heap rss
  heap=$(curl -s "http://127.0.0.1:$MPORT/metrics" | awk '$1 == "go_memstats_heap_alloc_bytes" {printf "%.1f", $2 / 1048576}')
  rss=$(awk '/^VmRSS/ {printf "%.0f", $2 / 1024}' "/proc/$HUB/status")
  printf '| %s | %s MB | %s MB |\n' "$1" "$heap" "$rss"
}
echo "| when | heap | RSS |"
echo "|---|---|---|"
mem "start"
timeout 1 curl -sN "$API/v1/user/events" -H "Authorization: Bearer $TOKEN" >/dev/null || true # opened and closed
python3 - "$HPORT" "$TOKEN" "$UID1" "$N" <<'PY'
import http.client, json, sys
port, token, uid, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
body = json.dumps({"payload": {"cmd": "x" * (62 << 10)}})
c = http.client.HTTPConnection("127.0.0.1", int(port))
for i in range(n):
    c.request("POST", f"/v1/user/devices/{uid}/commands", body,
              {"Authorization": "Bearer " + token, "Content-Type": "application/json"})
    r = c.getresponse(); r.read()
    if r.status != 200:
        sys.exit(f"command {i}: {r.status}")
PY
sleep 2
mem "after $N commands of 62 KiB"
sleep 15 # past -command-timeout and a sweep
mem "after their time-outs"
