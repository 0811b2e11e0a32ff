#!/usr/bin/env bash
# The fleet-scale run: N devices of one user, N retained statuses, a restart.
#   bash bench/scale.sh 100000
#   STOCK=1 bash bench/scale.sh 100000     # a Mosquitto without the README's large-fleet settings
#   FLAGS='-history-days 0' bash bench/scale.sh 100000   # serve with these flags too
#   LISTS=0 bash bench/scale.sh 1000000   # the restarts only: no full list, no pages
# Needs: go, mosquitto, curl, python3. It builds the binary, starts a
# Mosquitto configured as the README's section "Large fleets" says (or a
# stock one), imports N devices (device import), publishes a retained
# "online" status for each while the service is stopped, starts the service
# and reports:
#   - seconds from start until every status is applied, devicehub's dropped
#     count, the broker's dropped count, and the service's peak RSS;
#   - the full list (GET /v1/user/devices): seconds, bytes, the RSS it took;
#   - page 1 and page N/limit of the paged list (docs/api.md, "The device list, a page at a time": ?limit=&after=):
#     latency p50/p99 over REPS requests each;
# with a verdict for every goal of BENCHMARKS.md ("Fleet scale"). Exits 1
# when a goal is missed. The service's and the broker's logs stay in
# bench/out/ (ignored by git).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:?usage: bench/scale.sh N}
LIMIT=${LIMIT:-100}
REPS=${REPS:-200}
APPLY_TIMEOUT=${APPLY_TIMEOUT:-180}
OUT=${OUT:-bench/out}
for tool in go curl python3; do command -v $tool >/dev/null || { echo "need $tool" >&2; exit 1; }; done
MOSQ=$(command -v mosquitto || echo /usr/sbin/mosquitto)
[ -x "$MOSQ" ] || { echo "need mosquitto (apt-get install -y mosquitto)" >&2; exit 1; }
mkdir -p "$OUT"

work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
BPORT=$(freeport); HPORT=$(freeport); MPORT=$(freeport)
API=http://127.0.0.1:$HPORT
BROKER=tcp://127.0.0.1:$BPORT

echo "building" >&2
go build -o "$work/devicehub" .
go build -o "$work/mqttload" ./bench/mqttload
DH="$work/devicehub"; DATA="$work/data"

# The README's large-fleet settings: a queue that holds every device's
# retained status for the service's one subscription.
{
  printf 'listener %s 127.0.0.1\nallow_anonymous true\nuser %s\n' "$BPORT" "$(id -un)"
  [ -n "${STOCK:-}" ] || printf 'max_queued_messages %s\n' $((N + N / 10 + 1000))
} > "$work/mosquitto.conf"
"$MOSQ" -c "$work/mosquitto.conf" 2>"$OUT/scale-mosquitto.log" & MOSQ_PID=$!; pids+=($MOSQ_PID)

ms() { date +%s%3N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.1f", (b - a) / 1000}'; }
hwm() { awk '/^VmHWM/ {print int($2/1024)}' "/proc/$1/status"; }
# cpu PID: seconds of CPU (user + system) the process has used
cpu() { awk -v hz="$(getconf CLK_TCK)" '{printf "%.1f", ($14 + $15) / hz}' "/proc/$1/stat"; }
verdict() { if [ "$1" = 1 ]; then echo met; else MISSED=1; echo MISSED; fi; }
MISSED=0

printf 'scale-password\n' | "$DH" user add -data "$DATA" -email scale@example.com -name Scale >/dev/null
TOKEN=$("$DH" token create -data "$DATA" -email scale@example.com -name scale)
awk -v n="$N" 'BEGIN { print "uid,name,platform,board"; for (i = 0; i < n; i++) printf "esp32_s%d,,esp32,devkitc\n", i }' > "$work/fleet.csv"
awk -v n="$N" 'BEGIN { for (i = 0; i < n; i++) printf "esp32_s%d\n", i }' > "$work/uids.txt"
t0=$(ms); "$DH" device import -data "$DATA" -owner scale@example.com < "$work/fleet.csv" >&2; t1=$(ms)
IMPORT_S=$(secs "$t0" "$t1")

start_hub() {
  DEVICEHUB_ACCESS_LOG=false "$DH" serve -data "$DATA" -addr "127.0.0.1:$HPORT" -mqtt "$BROKER" \
    -metrics-addr "127.0.0.1:$MPORT" ${FLAGS:-} 2>>"$OUT/scale-devicehub.log" & HUB=$!
  until curl -sf "$API/healthz" >/dev/null 2>&1; do sleep 0.01; done
}
# metric NAME: the sum of the samples whose line starts with NAME, as an
# integer (the metrics write 1000000 as 1e+06)
metric() { curl -s "http://127.0.0.1:$MPORT/metrics" | awk -v m="$1" 'index($0, m) == 1 {s += $NF} END {printf "%d\n", s}'; }

: > "$OUT/scale-devicehub.log"
start_hub; kill -TERM $HUB; wait $HUB || true   # a first start, on the imported fleet
t0=$(ms); "$work/mqttload" -broker "$BROKER" -mode online -uids "$work/uids.txt"; t1=$(ms)
PUBLISH_S=$(secs "$t0" "$t1")

echo "restarting with $N retained statuses" >&2
# Each scrape of the metrics counts the devices by status: at a million
# that is work enough to slow the restart it measures, so every 2 s.
t0=$(ms); start_hub; pids+=($HUB)
online=0
while :; do
  online=$(metric 'devicehub_devices{status="online"}')
  [ "$online" -ge "$N" ] && break
  [ $(( $(ms) - t0 )) -ge $((APPLY_TIMEOUT * 1000)) ] && break
  sleep 2
done
t1=$(ms)
APPLY_S=$(secs "$t0" "$t1"); APPLY_HWM=$(hwm $HUB); APPLY_CPU=$(cpu $HUB)
LOAD=$(cut -d' ' -f1 /proc/loadavg)
DROPPED=$(metric 'devicehub_mqtt_messages_dropped_total')
sleep 11 # Mosquitto publishes its counters every 10 s
BROKER_DROPPED=$(grep -c 'Outgoing messages are being dropped' "$OUT/scale-mosquitto.log" || true)
WARNED=$(grep -c 'Large fleets' "$OUT/scale-devicehub.log" || true)
MOSQ_HWM=$(hwm $MOSQ_PID)

LIST_S=- LIST_BYTES=- LIST_RSS=- PAGES=skipped
if [ "${LISTS:-1}" = 1 ]; then
# The full list, with the service's RSS sampled while it answers.
rss_max() { local m=0 r; while kill -0 "$1" 2>/dev/null && [ ! -e "$work/list.done" ]; do
  r=$(awk '/^VmRSS/ {print int($2/1024)}' "/proc/$2/status"); [ "$r" -gt "$m" ] && m=$r; sleep 0.05; done; echo "$m"; }
rm -f "$work/list.done"
( rss_max $$ $HUB > "$work/list.rss" ) &
RSS_PID=$!
read -r LIST_S LIST_BYTES < <(curl -s -o /dev/null -w '%{time_total} %{size_download}\n' -H "Authorization: Bearer $TOKEN" "$API/v1/user/devices")
touch "$work/list.done"; wait $RSS_PID
LIST_RSS=$(cat "$work/list.rss")

# Page 1 and page N/limit: walk the cursors once, then time each page.
PAGES=$(python3 - "$API" "$TOKEN" "$LIMIT" "$REPS" <<'PY'
import http.client, json, sys, time, urllib.parse
api, token, limit, reps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
u = urllib.parse.urlparse(api)
c = http.client.HTTPConnection(u.hostname, u.port)
h = {"Authorization": "Bearer " + token, "Accept": "application/json"}
def get(q):
    c.request("GET", "/v1/user/devices?" + q, headers=h)
    r = c.getresponse()
    return r.status, r.read()
status, body = get("limit=%d" % limit)
doc = json.loads(body)
if status != 200 or not isinstance(doc, dict) or "meta" not in doc:
    print("none"); sys.exit()
first, after = "limit=%d" % limit, None
nxt = doc["meta"]["next"]
while nxt:
    after = nxt
    nxt = json.loads(get("limit=%d&after=%s" % (limit, urllib.parse.quote(nxt)))[1])["meta"]["next"]
last = first if after is None else "limit=%d&after=%s" % (limit, urllib.parse.quote(after))
def pct(q):
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); get(q); ts.append((time.perf_counter() - t) * 1000)
    ts.sort()
    return "%.1f %.1f" % (ts[len(ts) // 2], ts[min(len(ts) - 1, int(len(ts) * 0.99))])
print(pct(first), pct(last))
PY
)
fi

# A second restart, as an ordinary one: every status is already applied
# and nothing changes, so no metric moves. The sign that the retained
# statuses are read is the service going idle: the time is until its CPU
# use stays under 10% for 2 s (those 2 s not counted).
kill -TERM $HUB; wait $HUB || true
subscribed=$(grep -c 'msg="mqtt subscribed"' "$OUT/scale-devicehub.log" || true)
t0=$(ms); start_hub; pids+=($HUB)
until [ "$(grep -c 'msg="mqtt subscribed"' "$OUT/scale-devicehub.log" || true)" -gt "$subscribed" ]; do sleep 0.1; done
idle=0; last=$(cpu $HUB)
while [ "$idle" -lt 4 ] && [ $(( $(ms) - t0 )) -lt $((APPLY_TIMEOUT * 1000)) ]; do
  sleep 0.5; now=$(cpu $HUB)
  if awk -v a="$last" -v b="$now" 'BEGIN{exit !(b - a < 0.05)}'; then idle=$((idle + 1)); else idle=0; fi
  last=$now
done
t1=$(ms)
AGAIN_S=$(secs "$t0" "$(( t1 - 2000 ))"); AGAIN_HWM=$(hwm $HUB); AGAIN_CPU=$(cpu $HUB)

le() { awk -v a="$1" -v b="$2" 'BEGIN{print (a <= b) ? 1 : 0}'; }
all=$([ "$online" -ge "$N" ] && echo 1 || echo 0)
echo
echo "| N = $N | figure | goal | verdict |"
echo "|---|---|---|---|"
echo "| import | ${IMPORT_S} s | < 60 s (1,000,000 rows included) | $(verdict "$(le "$IMPORT_S" 60)") |"
echo "| retained statuses published | ${PUBLISH_S} s | | |"
echo "| restart: statuses applied | $online of $N in ${APPLY_S} s ($APPLY_CPU s of CPU; 1-minute load $LOAD) | all, within 30 s (1,000,000 included) | $(verdict "$([ "$all" = 1 ] && le "$APPLY_S" 30 || echo 0)") |"
echo "| dropped: devicehub / broker log lines / warning logged | $DROPPED / $BROKER_DROPPED / $WARNED | 0 / 0 / - | $(verdict "$([ "$DROPPED" = 0 ] && [ "$BROKER_DROPPED" = 0 ] && echo 1 || echo 0)") |"
echo "| a second restart, every status unchanged: all read | ${AGAIN_S} s ($AGAIN_CPU s of CPU), peak RSS ${AGAIN_HWM} MiB | within 30 s | $(verdict "$(le "$AGAIN_S" 30)") |"
echo "| service peak RSS through the restart | ${APPLY_HWM} MiB | ≤ 256 MiB | $(verdict "$(le "$APPLY_HWM" 256)") |"
echo "| Mosquitto peak RSS | ${MOSQ_HWM} MiB | | |"
echo "| full list | ${LIST_S} s, $LIST_BYTES bytes, RSS ${LIST_RSS} MiB while answering | memory flat | |"
if [ "$PAGES" = none ] || [ "$PAGES" = skipped ]; then
  echo "| pages | $PAGES (the paged list is not in this build, or LISTS=0) | | not run |"
else
  read -r p1 p1x pl plx <<< "$PAGES"
  echo "| page 1 vs page N/$LIMIT, p50 / p99 | ${p1} / ${p1x} ms vs ${pl} / ${plx} ms | the last page costs what the first does | |"
fi
exit $MISSED
