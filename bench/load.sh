#!/usr/bin/env bash
# Load run of the real binary against a real Mosquitto, with the ceiling
# server (bench/ceiling: bare net/http writing the same bytes) measured the
# same way in the same run. Needs: go, mosquitto, wrk, curl, python3.
#   bash bench/load.sh            # 10 s per wrk run
#   DUR=30s bash bench/load.sh
#   BIN=/path/to/devicehub bash bench/load.sh   # measure that binary (an older build, to pair runs)
#   PROFILE=1 bash bench/load.sh  # also CPU and allocation profiles of the service (pprof)
# Prints a Markdown table with a verdict (met or MISSED) for every goal of
# BENCHMARKS.md, and exits 1 when any goal is missed. The table and the
# service's log are also kept in bench/out/ (ignored by git); BENCHMARKS.md
# keeps the figures.
set -euo pipefail
cd "$(dirname "$0")/.."
DUR=${DUR:-10s}
THREADS=${THREADS:-2}
CONNS=${CONNS:-32}
OUT=${OUT:-bench/out}
for tool in go wrk curl python3; do command -v $tool >/dev/null || { echo "need $tool" >&2; exit 1; }; done
MOSQ=$(command -v mosquitto || echo /usr/sbin/mosquitto)
[ -x "$MOSQ" ] || { echo "need mosquitto (apt-get install -y mosquitto)" >&2; exit 1; }

work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
BPORT=$(freeport); HPORT=$(freeport); CPORT=$(freeport); PPORT=$(freeport)
API=http://127.0.0.1:$HPORT
CEIL=http://127.0.0.1:$CPORT
BROKER=tcp://127.0.0.1:$BPORT

echo "building" >&2
# PROFILE=1: a build with pprof.go, which serves net/http/pprof on
# $DEVICEHUB_PPROF_ADDR; the device page and command rows are profiled.
if [ -n "${BIN:-}" ]; then cp "$BIN" "$work/devicehub"; else go build ${PROFILE:+-tags pprof} -o "$work/devicehub" .; fi
go build -o "$work/ceiling" ./bench/ceiling
go build -o "$work/mqttload" ./bench/mqttload
DH="$work/devicehub"; DATA="$work/data"

printf 'listener %s 127.0.0.1\nallow_anonymous true\nmax_queued_messages 100000\nuser %s\n' "$BPORT" "$(id -un)" > "$work/mosquitto.conf"
"$MOSQ" -c "$work/mosquitto.conf" 2>"$work/mosquitto.log" & pids+=($!)

echo "provisioning 1 user with 25 devices and 1 with 1000" >&2
printf "load-password\n" | "$DH" user add -data "$DATA" -email load@example.com -name Load >/dev/null
printf "fleet-password\n" | "$DH" user add -data "$DATA" -email fleet@example.com -name Fleet >/dev/null
# The login flood logs in as a user of its own: every login makes a token,
# and at -max-tokens the least recently used one goes, which would be the
# token the other runs use.
printf "flood-password\n" | "$DH" user add -data "$DATA" -email flood@example.com -name Flood >/dev/null
for i in $(seq 25); do "$DH" device add -data "$DATA" -owner load@example.com -platform esp32 -board devkit; done > "$work/mine.txt"
for i in $(seq 1000); do "$DH" device add -data "$DATA" -owner fleet@example.com -platform esp8266 -board d1mini; done > "$work/fleet.txt"
TOKEN=$("$DH" token create -data "$DATA" -email load@example.com -name load)
FLEET_TOKEN=$("$DH" token create -data "$DATA" -email fleet@example.com -name load)
UID1=$(sed -n 1p "$work/mine.txt")

start_hub() {
  local t0 t1
  t0=$(date +%s%N)
  # No access log (a line per request) where it is a switch: it would measure the log.
  DEVICEHUB_PPROF_ADDR=127.0.0.1:$PPORT DEVICEHUB_ACCESS_LOG=false "$DH" serve -data "$DATA" -addr "127.0.0.1:$HPORT" -mqtt "$BROKER" 2>>"$work/devicehub.log" & HUB=$!
  until curl -sf "$API/healthz" >/dev/null 2>&1; do sleep 0.002; done
  t1=$(date +%s%N)
  STARTUP_MS=$(( (t1 - t0) / 1000000 ))
}
rss() { awk '/^VmRSS/ {print int($2/1024)}' "/proc/$1/status"; }
cputicks() { awk '{print $14 + $15}' "/proc/$1/stat"; } # user + system, in clock ticks
hwm() { awk '/^VmHWM/ {print int($2/1024)}' "/proc/$1/status"; }

start_hub; FIRST_START=$STARTUP_MS
kill -TERM $HUB; wait $HUB || true
start_hub; pids+=($HUB)   # start-up on an existing database
"$work/mqttload" -broker "$BROKER" -mode online -uids "$work/mine.txt"
sleep 2
IDLE_RSS=$(rss $HUB)

H="Authorization: Bearer $TOKEN"
curl -s "$API/v1/auth/me" -H "$H" > "$work/me.json"
curl -s "$API/v1/user/devices" -H "$H" > "$work/devices.json"
curl -s "$API/v1/user/devices/$UID1" -H "$H" > "$work/device.json"
printf '{"message":"Command sent.","device_uid":"%s"}\n' "$UID1" > "$work/command.json"
"$work/ceiling" -addr "127.0.0.1:$CPORT" /v1/auth/me="$work/me.json" /v1/user/devices="$work/devices.json" \
  "/v1/user/devices/$UID1=$work/device.json" "/v1/user/devices/$UID1/commands=$work/command.json" >/dev/null & pids+=($!)
until curl -sf "$CEIL/v1/auth/me" >/dev/null 2>&1; do sleep 0.01; done

cat > "$work/post.lua" <<'LUA'
wrk.method = "POST"
wrk.body = '{"payload":{"cmd":"led","on":true}}'
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  io.stderr:write(string.format("WRK requests=%d non2xx=%d errors=%d\n", summary.requests, summary.errors.status,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout))
end
LUA

# wrkrun URL [args…] → prints requests/s, p99 latency, and the number of
# answers that were not 2xx plus socket errors (a run with any is not a
# measurement of the API).
wrkrun() {
  local url=$1; shift
  wrk -t"$THREADS" -c"$CONNS" -d"$DUR" --latency -H "$H" -H 'Accept: application/json' "$@" "$url" > "$work/wrk.out" 2> "$work/wrk.err"
  local rps p99 bad
  rps=$(awk '/^Requests\/sec/ {printf "%.0f", $2}' "$work/wrk.out")
  p99=$(awk '$1=="99%" {print $2}' "$work/wrk.out")
  bad=$(awk '/Non-2xx/ {n += $NF} /Socket errors/ {gsub(/[^0-9 ]/, " "); for (i = 1; i <= NF; i++) n += $i} END {print n + 0}' "$work/wrk.out")
  if [ "$bad" != 0 ]; then echo "$url: $(grep -E 'Non-2xx|Socket errors' "$work/wrk.out" | tr '\n' ' ')" >&2; fi
  echo "$rps $p99 $bad"
}

# profiled NAME COMMAND… runs the command; with PROFILE=1 and a NAME it keeps a CPU
# profile of the service taken while it runs, and the allocations it
# made, as $result-NAME.{cpu,allocs-before,allocs}.pprof (compare the
# last two with go tool pprof -diff_base).
profiled() {
  local name=$1; shift
  if [ -z "${PROFILE:-}" ] || [ -z "$name" ]; then "$@"; return; fi
  local pp=http://127.0.0.1:$PPORT/debug/pprof
  curl -sf -o "$result-$name.allocs-before.pprof" "$pp/allocs"
  curl -sf -o "$result-$name.cpu.pprof" "$pp/profile?seconds=$(( ${DUR%s} - 2 ))" & local cpu=$!
  "$@"
  wait $cpu
  curl -sf -o "$result-$name.allocs.pprof" "$pp/allocs"
}

# ratio A C → A as a whole percentage of C
ratio() { awk -v a="$1" -v c="$2" 'BEGIN{printf "%.0f", 100*a/c}'; }
# verdict OK → "met" when OK is 1, else "MISSED" (the run then exits 1)
verdict() { if [ "$1" = 1 ]; then echo met; else echo MISSED; fi; }
ge() { awk -v a="$1" -v b="$2" 'BEGIN{print (a >= b) ? 1 : 0}'; }
le() { awk -v a="$1" -v b="$2" 'BEGIN{print (a <= b) ? 1 : 0}'; }
both() { [ "$1" = 1 ] && [ "$2" = 1 ] && echo 1 || echo 0; }

table() {
echo "| what | devicehub req/s (p99) | ceiling req/s (p99) | ratio | goal | verdict |"
echo "|---|---|---|---|---|---|"
row() { # name path goal-percent [profile name]; leaves devicehub's req/s in a
  local alat abad c clat cbad r
  read -r a alat abad < <(profiled "${4:-}" wrkrun "$API$2")
  read -r c clat cbad < <(wrkrun "$CEIL$2")
  r=$(ratio "$a" "$c")
  echo "| $1 | $a ($alat) | $c ($clat) | $r% | ≥ $3% of ceiling | $(verdict "$(both "$(ge "$r" "$3")" "$([ "$abad" = 0 ] && echo 1 || echo 0)")") |"
}
row 'GET /v1/auth/me' /v1/auth/me 50
ME=$a
row 'GET /v1/user/devices (25 devices)' /v1/user/devices 30
row 'GET /v1/user/devices/{uid}' "/v1/user/devices/$UID1" 40 device

# A burst of logins (correct password: each one hashes) must not starve the
# rest of the API: /v1/auth/me measured while 16 clients log in non-stop.
cat > "$work/login.lua" <<'LUA'
wrk.method = "POST"
wrk.body = '{"email":"flood@example.com","password":"flood-password","token_name":"flood"}'
wrk.headers["Content-Type"] = "application/json"
LUA
wrk -t1 -c16 -d"$DUR" -s "$work/login.lua" "$API/v1/auth/login" > "$work/login.out" 2>&1 & FLOOD=$!
sleep 1
read -r a alat abad < <(wrkrun "$API/v1/auth/me")
wait $FLOOD
logins=$(awk '/^Requests\/sec/ {printf "%.0f", $2}' "$work/login.out")
echo "| GET /v1/auth/me during a login flood ($logins logins/s) | $a ($alat) | | $(ratio "$a" "$ME")% of the undisturbed figure | API keeps serving: every answer 2xx | $(verdict "$(both "$(ge "$a" 1)" "$([ "$abad" = 0 ] && echo 1 || echo 0)")") |"

# Commands: every 2xx must reach the subscriber.
"$work/mqttload" -broker "$BROKER" -mode count -idle 3s > "$work/count.out" 2>"$work/count.err" & COUNTER=$!
until grep -q counting "$work/count.err" 2>/dev/null; do sleep 0.05; done
t0=$(cputicks $HUB)
read -r a alat abad < <(profiled commands wrkrun "$API/v1/user/devices/$UID1/commands" -s "$work/post.lua")
t1=$(cputicks $HUB)
sent=$(sed -n 's/.*requests=\([0-9]*\) non2xx=\([0-9]*\).*/\1 \2/p' "$work/wrk.err")
wait $COUNTER
delivered=$(cat "$work/count.out")
cpu=$(awk -v t=$((t1 - t0)) -v hz="$(getconf CLK_TCK)" -v n="$delivered" 'BEGIN{printf "%.0f", t * 1e6 / hz / n}')
read -r c clat cbad < <(wrkrun "$CEIL/v1/user/devices/$UID1/commands" -s "$work/post.lua")
read -r total non2xx <<< "$sent"
accepted=$((total - non2xx))
echo "| POST …/commands (QoS 1) | $a ($alat) | $c ($clat) | $(ratio "$a" "$c")% | ≥ 8,000/s, every accepted one delivered (accepted $accepted, delivered $delivered; devicehub CPU $cpu µs a command) | $(verdict "$(both "$(ge "$a" 8000)" "$(ge "$delivered" "$accepted")")") |"

PEAK1=$(hwm $HUB)

# Telemetry: 1,000 devices × 20 reports at QoS 1, each of four series
# (rssi, heap_free, two metrics) with uptime_s, as docs/devices.md describes.
tele=$("$work/mqttload" -broker "$BROKER" -mode telemetry -uids "$work/fleet.txt" -reports 20 -api "$API" -token "$FLEET_TOKEN")
applied=$(sed -n 's/.*(\([0-9]*\) msg\/s applied).*/\1/p' <<< "$tele")
echo "| telemetry | $tele | | | ≥ 20,000 msg/s applied | $(verdict "$(ge "${applied:-0}" 20000)") |"

# OTA: 100 concurrent downloads of a 4 MiB firmware.
{ printf '\351'; head -c 4194303 /dev/urandom; } > "$work/fw.bin" # an ESP image starts with 0xE9
MD5=$(md5sum "$work/fw.bin" | cut -c1-32)
curl -sf "$API/v1/user/devices/$UID1/firmwares" -H "$H" -F name=load -F "file=@$work/fw.bin" >/dev/null
curl -sf "$API/v1/user/devices/$UID1/firmwares/set-target" -H "$H" -H 'Content-Type: application/json' -d "{\"md5\":\"$MD5\"}" >/dev/null
"$work/mqttload" -broker "$BROKER" -mode capture > "$work/ota.json" 2>"$work/capture.err" & CAP=$!
until grep -q capturing "$work/capture.err" 2>/dev/null; do sleep 0.05; done
curl -sf -X POST "$API/v1/user/devices/$UID1/ota" -H "$H" >/dev/null
wait $CAP
URL=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["url"])' "$work/ota.json")
PEAK2=$(hwm $HUB)
sleep 1
echo 5 > "/proc/$HUB/clear_refs"   # reset VmHWM to the current RSS
BEFORE=$(rss $HUB)
t0=$(date +%s%N)
seq 100 | xargs -P 100 -I{} curl -sf -o "$work/dl" -w '%{http_code} %{size_download}\n' "$URL" > "$work/dl.out"
t1=$(date +%s%N)
OTA_PEAK=$(hwm $HUB)
ok=$(grep -c "^200 4194304$" "$work/dl.out" || true)
secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN{print (b-a)/1e9}')
growth=$((OTA_PEAK - BEFORE))
echo "| 100 × 4 MiB OTA downloads | $ok/100 complete in ${secs}s ($(awk -v s="$secs" 'BEGIN{printf "%.0f", 400/s}') MiB/s) | RSS $BEFORE → peak $OTA_PEAK MiB | growth $growth MiB | all complete, growth ≤ 16 MiB | $(verdict "$(both "$(ge "$ok" 100)" "$(le "$growth" 16)")") |"

PEAK=$(printf '%s\n' "$PEAK1" "$PEAK2" "$OTA_PEAK" | sort -n | tail -1)
echo "| idle memory | RSS with 1,025 devices: $IDLE_RSS MiB | | | ≤ 20 MiB | $(verdict "$(le "$IDLE_RSS" 20)") |"
echo "| peak memory | peak RSS of the run: $PEAK MiB | | | ≤ 64 MiB | $(verdict "$(le "$PEAK" 64)") |"
echo "| start-up to healthy /healthz | new database: $FIRST_START ms | existing database: $STARTUP_MS ms | | ≤ 100 ms | $(verdict "$(both "$(le "$FIRST_START" 100)" "$(le "$STARTUP_MS" 100)")") |"
}

mkdir -p "$OUT"
result=$OUT/load-$(date -u +%Y%m%dT%H%M%SZ)
table | tee "$result.md"
cp "$work/devicehub.log" "$result.devicehub.log"
missed=$(grep -c '| MISSED |$' "$result.md" || true)
if [ "$missed" = 0 ]; then summary="every goal met"; else summary="$missed goal(s) MISSED"; fi
printf '\n%s\n' "$summary" | tee -a "$result.md"
echo "kept in $result.md and $result.devicehub.log" >&2
[ "$missed" = 0 ]
