#!/usr/bin/env bash
# The telemetry burst of issue 35: REPORTS four-series reports (rssi,
# heap_free, uptime_s, two metrics) from each of N devices over one
# connection, QoS 1, to a Mosquitto with its default settings. Each run
# sends the burst three times on the same fleet: to a bare subscriber
# (bench/mqttload -bare), to devicehub with history, and to devicehub
# with -history-days 0.
#   bash bench/burst.sh            # 3 runs, 1,000 devices × 60 reports
#   RUNS=5 N=1000 REPORTS=60 bash bench/burst.sh
#   RATE=1000 N=10000 REPORTS=6 bash bench/burst.sh   # 10,000 devices every 10 s, for a minute: CPU only
# For each burst to devicehub: messages/s from the first publish until the
# device list shows every device's last report (bench/mqttload), the
# devices stale 30 s after the burst was sent, and the bytes devicehub
# passed to write() per message (/proc/PID/io wchar: WAL frames,
# checkpoints' copies into the database, its log, and its answers to the
# polling, which dominate when devices stay stale); for the bare
# subscriber, messages/s from the first publish to the last it received,
# and the devices whose last report it did not receive. Prints a Markdown
# table, a row per run with the 1-minute load average when it began, and
# the medians. With RATE (messages/s, evenly spread) there is no bare
# subscriber and no polling of the API: devicehub's CPU time over the
# run, as a share of one core, and its bytes passed to write() per
# message (WAL frames, checkpoints, log: no HTTP answers). Needs: go, mosquitto, curl, python3.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
N=${N:-1000}
REPORTS=${REPORTS:-60}
for tool in go curl python3; do command -v $tool >/dev/null || { echo "need $tool" >&2; exit 1; }; done
MOSQ=$(command -v mosquitto || echo /usr/sbin/mosquitto)
[ -x "$MOSQ" ] || { echo "need mosquitto (apt-get install -y mosquitto)" >&2; exit 1; }

work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
BPORT=$(freeport); HPORT=$(freeport)
API=http://127.0.0.1:$HPORT
BROKER=tcp://127.0.0.1:$BPORT

echo "building" >&2
go build -o "$work/devicehub" .
go build -o "$work/mqttload" ./bench/mqttload
DH="$work/devicehub"; DATA="$work/data"; LOG="$work/devicehub.log"

# Mosquitto as 'apt-get install mosquitto' runs it: its default queues.
printf 'listener %s 127.0.0.1\nallow_anonymous true\nuser %s\n' "$BPORT" "$(id -un)" > "$work/mosquitto.conf"
"$MOSQ" -c "$work/mosquitto.conf" 2>"$work/mosquitto.log" & pids+=($!)

printf 'burst-password\n' | "$DH" user add -data "$DATA" -email burst@example.com -name Burst >/dev/null
TOKEN=$("$DH" token create -data "$DATA" -email burst@example.com -name burst)
awk -v n="$N" 'BEGIN { print "uid,name,platform,board"; for (i = 0; i < n; i++) printf "esp32_b%d,,esp32,devkitc\n", i }' > "$work/fleet.csv"
awk -v n="$N" 'BEGIN { for (i = 0; i < n; i++) printf "esp32_b%d\n", i }' > "$work/uids.txt"
"$DH" device import -data "$DATA" -owner burst@example.com < "$work/fleet.csv" >/dev/null
: > "$LOG"

# start_hub FLAGS…: serve, and wait until the link has subscribed.
start_hub() {
  local subscribed
  subscribed=$(grep -c 'msg="mqtt subscribed"' "$LOG" || true)
  DEVICEHUB_ACCESS_LOG=false "$DH" serve -data "$DATA" -addr "127.0.0.1:$HPORT" -mqtt "$BROKER" "$@" 2>>"$LOG" & HUB=$!
  until [ "$(grep -c 'msg="mqtt subscribed"' "$LOG" || true)" -gt "$subscribed" ]; do sleep 0.05; done
}
stop_hub() { kill -TERM "$HUB"; wait "$HUB" || true; }
wchar() { awk '/^wchar/ {print $2}' "/proc/$1/io"; }
cputicks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# hub_burst ROUND FLAGS…: "rate stale bytes/msg" of one burst to devicehub.
hub_burst() {
  local round=$1; shift
  start_hub "$@"
  local w0 out
  w0=$(wchar "$HUB")
  out=$("$work/mqttload" -broker "$BROKER" -mode telemetry -uids "$work/uids.txt" -reports "$REPORTS" -clients 1 \
    -round "$round" -api "$API" -token "$TOKEN")
  echo "$out" >&2
  local w1
  w1=$(wchar "$HUB")
  stop_hub
  awk -v out="$out" -v w=$((w1 - w0)) -v n=$((N * REPORTS)) 'BEGIN {
    match(out, /\([0-9]+ msg\/s applied\)/); rate = substr(out, RSTART + 1, RLENGTH - 16) + 0
    match(out, /[0-9]+ devices stale/); stale = substr(out, RSTART, RLENGTH - 14) + 0
    printf "%d %d %.0f\n", rate, stale, w / n }'
}

# hub_steady ROUND FLAGS…: devicehub's CPU time over a burst sent at
# RATE, as a percentage of one core, the seconds the burst took, and the
# bytes written per message.
hub_steady() {
  local round=$1; shift
  start_hub "$@"
  local c0 c1 t0 t1 w0 w1
  c0=$(cputicks "$HUB"); t0=$(date +%s%N); w0=$(wchar "$HUB")
  "$work/mqttload" -broker "$BROKER" -mode telemetry -uids "$work/uids.txt" -reports "$REPORTS" -clients 1 \
    -round "$round" -rate "$RATE" -stale-after 0 >/dev/null
  c1=$(cputicks "$HUB"); t1=$(date +%s%N); w1=$(wchar "$HUB")
  stop_hub
  awk -v c=$((c1 - c0)) -v hz="$(getconf CLK_TCK)" -v ns=$((t1 - t0)) -v w=$((w1 - w0)) -v n=$((N * REPORTS)) \
    'BEGIN {printf "%.1f %.1f %.0f\n", 100 * c / hz / (ns / 1e9), ns / 1e9, w / n}'
}

if [ -n "${RATE:-}" ]; then
  echo "| run | load (1 min) | history: CPU % of a core (s), B written/msg | -history-days 0: CPU % of a core (s), B written/msg |"
  echo "|---|---|---|---|"
  for run in $(seq "$RUNS"); do
    load=$(cut -d' ' -f1 /proc/loadavg)
    read -r hcpu hs hw < <(hub_steady $((2 * run)))
    read -r ocpu os ow < <(hub_steady $((2 * run + 1)) -history-days 0)
    echo "| $run | $load | $hcpu ($hs), $hw | $ocpu ($os), $ow |"
  done
  exit
fi

echo "| run | load (1 min) | bare subscriber: msg/s, stale (received) | history: msg/s, stale, B written/msg | -history-days 0: msg/s, stale, B written/msg | history / bare | history / no history |"
echo "|---|---|---|---|---|---|---|"
: > "$work/ratios"
for run in $(seq "$RUNS"); do
  load=$(cut -d' ' -f1 /proc/loadavg)
  bare=$("$work/mqttload" -broker "$BROKER" -mode telemetry -uids "$work/uids.txt" -reports "$REPORTS" -clients 1 -round $((2 * run)) -bare)
  echo "$bare" >&2
  brate=$(sed -n 's/.*(\([0-9]*\) msg\/s).*/\1/p' <<< "$bare")
  read -r hrate hstale hbytes < <(hub_burst $((2 * run)))
  read -r orate ostale obytes < <(hub_burst $((2 * run + 1)) -history-days 0)
  rb=$(awk -v a="$hrate" -v b="$brate" 'BEGIN{printf "%.2f", a / b}')
  ro=$(awk -v a="$hrate" -v b="$orate" 'BEGIN{printf "%.2f", a / b}')
  echo "$rb $ro $(awk -v a="$orate" -v b="$brate" 'BEGIN{printf "%.2f", a / b}')" >> "$work/ratios"
  echo "| $run | $load | $brate, $(sed -n 's/.*; \([0-9]*\) devices stale/\1/p' <<< "$bare") ($(sed -n 's/.*: \([0-9]* of [0-9]*\) messages.*/\1/p' <<< "$bare")) | $hrate, $hstale, $hbytes | $orate, $ostale, $obytes | $rb | $ro |"
done
median() { sort -n | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
echo
echo "medians: history / bare $(cut -d' ' -f1 "$work/ratios" | median), no history / bare $(cut -d' ' -f3 "$work/ratios" | median), history / no history $(cut -d' ' -f2 "$work/ratios" | median)"
echo "broker log lines 'Outgoing messages are being dropped': $(grep -c 'Outgoing messages are being dropped' "$work/mosquitto.log" || true)"
