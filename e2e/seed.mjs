// A month of a greenhouse fleet's past, written into devicehub's database
// before the server starts, as a month of telemetry would have left it
// (docs/api.md, "Fleet health"): history_rows of rssi, heap_free and
// metrics.temp_c in internal/history/slab.go's encoding (5-minute slots
// for the last 7 days, hourly ones before), online and offline
// intervals, boots numbered per device with their reasons, the runs of
// each firmware, and the rows of fleet_hours that the service writes with
// them (internal/history/write.go, rollup.go). Times are Unix seconds. A
// test cannot wait a month for its charts; live telemetry adds to this
// once the server runs.
//
// The story: every device ran firmware 1.2.0; three days ago two of them
// took 1.3.0, whose heap leaks until it panics every few hours.

import { execFileSync } from 'node:child_process';

const MIN = 60e3;
const HOUR = 60 * MIN;
const DAY = 24 * HOUR;
const BUCKET = 5 * MIN;

// random is a seeded generator (mulberry32): the same month every run,
// so screenshots differ only by what the test itself changes.
function random(seed) {
  return () => {
    seed = (seed + 0x6d2b79f5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

// stamp is a text time as devicehub stores devices' (microseconds, UTC);
// unix is a time as history stores it (seconds).
const stamp = ms => new Date(ms).toISOString().replace(/\.(\d{3})Z$/, '.$1000Z');
const unix = ms => Math.floor(ms / 1000);
const quote = v => v === null ? 'NULL' : Buffer.isBuffer(v) ? `X'${v.toString('hex')}'`
  : typeof v === 'string' ? `'${v.replace(/'/g, "''")}'` : String(v);
const insert = (table, rows) => rows.length ? `INSERT INTO ${table} VALUES ${rows.map(r => '(' + r.map(quote).join(',') + ')').join(',\n')};\n` : '';

// uvarint, varint, float32 and float64 are encoding/binary's
// AppendUvarint, AppendVarint and little-endian floats.
function uvarint(n) {
  const out = [];
  for (; n >= 0x80; n = Math.floor(n / 0x80)) out.push((n % 0x80) | 0x80);
  out.push(n);
  return Buffer.from(out);
}
const varint = n => uvarint(n < 0 ? -2 * n - 1 : 2 * n);
const float32 = v => { const b = Buffer.alloc(4); b.writeFloatLE(v); return b; };
const float64 = v => { const b = Buffer.alloc(8); b.writeDoubleLE(v); return b; };
const round = v => Math.sign(v) * Math.round(Math.abs(v)); // Go's math.Round: halves away from zero

// encodeRow is slab.go's encodeRow: samples ({series, t, min, max, sum,
// count, last}, t in seconds) of the row that starts at start, slots of
// step seconds, series by name, slots in order.
function encodeRow(samples, start, step) {
  const parts = [];
  for (const name of [...new Set(samples.map(x => x.series))].sort()) {
    const slots = samples.filter(x => x.series === name).sort((x, y) => x.t - y.t);
    parts.push(Buffer.from([name.length]), Buffer.from(name), uvarint(slots.reduce((mask, x) => mask + 2 ** ((x.t - start) / step), 0)));
    for (const x of slots) parts.push(uvarint(x.count), ...[x.min, x.max, x.sum / x.count, x.last].map(float32));
  }
  return Buffer.concat(parts);
}

// binOf is rollup.go's: 1 dBm of rssi, 1 % of heap_free.
const binOf = (series, v) => series === 'rssi' ? round(v) : round(Math.log(Math.max(v, 1)) / Math.log(1.01));

// encodeHistogram is rollup.go's histogram.encode: per bin ({count, sum}
// by number), in order, its number, count and sum.
const encodeHistogram = bins => Buffer.concat([...bins.keys()].sort((x, y) => x - y)
  .flatMap(bin => [varint(bin), uvarint(bins.get(bin).count), float64(bins.get(bin).sum)]));

// FleetHours are the rows of fleet_hours a seed adds up, by team,
// firmware and hour, as write.go and rollup.go count them.
class FleetHours {
  rows = new Map();
  row(team, md5, t) {
    const hour = unix(t) - unix(t) % 3600;
    const key = `${team} ${md5} ${hour}`;
    if (!this.rows.has(key)) this.rows.set(key, { team, md5, hour, boots: 0, crashes: 0, offline: 0, rssi: new Map(), heap_free: new Map() });
    return this.rows.get(key);
  }
  boot(team, md5, t, crash) { const r = this.row(team, md5, t); r.boots++; r.crashes += crash; }
  offline(team, md5, t) { this.row(team, md5, t).offline++; }
  mean(team, md5, t, series, mean) {
    const bins = this.row(team, md5, t)[series];
    const bin = binOf(series, mean);
    const b = bins.get(bin) || { count: 0, sum: 0 };
    bins.set(bin, { count: b.count + 1, sum: b.sum + mean });
  }
  sql() {
    return insert('fleet_hours (team_id, md5, hour, boots, crashes, offline, rssi, heap)', [...this.rows.values()].map(r =>
      [r.team, r.md5, r.hour, r.boots, r.crashes, r.offline, r.rssi.size ? encodeHistogram(r.rssi) : null, r.heap_free.size ? encodeHistogram(r.heap_free) : null]));
  }
}

// deviceMonth is one device's month up to end: its firmware runs, its
// outages and boots, and its readings every 5 minutes while it was online.
function deviceMonth(index, end, firmwares) {
  const rnd = random(index + 1);
  const start = end - 30 * DAY;
  const upgraded = index < 2 ? end - 3 * DAY + index * 2 * HOUR : null; // when it took 1.3.0
  const runs = [[firmwares.stable, start, upgraded || end]];
  if (upgraded) runs.push([firmwares.leaky, upgraded, end]);
  const outages = [[start + (24.5 - index * 9) * DAY, 6 * HOUR, 'poweron'], [start + (12 + index * 3) * DAY, 45 * MIN, 'poweron']];
  const boots = [[start, 'poweron', firmwares.stable]];
  if (index === 2) boots.push([start + 17.2 * DAY, 'brownout', firmwares.stable]);
  if (upgraded) {
    boots.push([upgraded, 'sw', firmwares.leaky]); // the OTA's restart
    for (let t = upgraded + 5 * HOUR; t < end - HOUR; t += (5 + 4 * rnd()) * HOUR) {
      boots.push([t, rnd() < 0.7 ? 'panic' : 'task_wdt', firmwares.leaky]);
      outages.push([t - 2 * MIN, 2 * MIN, null]); // its broker session dropped while it restarted
    }
  }
  for (const [at, length, reason] of outages) if (reason) boots.push([at + length, reason, runs.find(r => at >= r[1] && at < r[2])[0]]);
  outages.sort((a, b) => a[0] - b[0]);
  boots.sort((a, b) => a[0] - b[0]); // numbered in the order of time, as they would have come
  const offline = t => outages.some(([at, length]) => t >= at && t < at + length);
  const firmwareAt = t => runs.find(r => t >= r[1] && t < r[2])[0];
  const lastBoot = t => Math.max(...boots.map(b => b[0]).filter(at => at <= t));
  const buckets = { rssi: [], heap_free: [], 'metrics.temp_c': [] };
  for (let t = Math.ceil(start / BUCKET) * BUCKET; t < end - end % BUCKET; t += BUCKET) {
    if (offline(t)) continue;
    const day = (t % DAY) / DAY;
    const rssi = -60 - 4 * index + 5 * Math.sin(2 * Math.PI * day + index) + 3 * (rnd() - 0.5);
    const leak = firmwareAt(t) === firmwares.leaky ? (t - lastBoot(t)) / HOUR * 2600 : 0;
    const heap = 186000 - 1500 * index - leak + 1200 * (rnd() - 0.5);
    const temp = 23 + 7 * Math.sin(2 * Math.PI * (day - 0.3)) + 0.8 * (rnd() - 0.5);
    buckets.rssi.push([t, rssi, 2 + 4 * rnd(), 1 + 3 * rnd()]);
    buckets.heap_free.push([t, heap, 800 + 1200 * rnd(), 600 + 900 * rnd()]);
    buckets['metrics.temp_c'].push([t, temp, 0.2 + 0.3 * rnd(), 0.2 + 0.3 * rnd()]);
  }
  return { runs, outages, boots, buckets, start };
}

const CRASHES = ['panic', 'task_wdt', 'int_wdt', 'wdt', 'brownout'];

// historyRows are a device's rows of history_rows for its buckets
// ({series: [[t, mean, below, above]]}, t in ms) up to end: a row per hour
// of 5-minute slots for the last 7 days, and before, as the retention
// pass merges them (prune.go's rollup), a row per day of hourly slots.
function historyRows(buckets, end) {
  const cutoff = unix(end) - 7 * 86400;
  const hours = new Map(); // by start: the samples of the row
  for (const [series, rows] of Object.entries(buckets)) {
    for (const [ms, mean, below, above] of rows) {
      const t = unix(ms);
      const start = t - t % 3600;
      if (!hours.has(start)) hours.set(start, []);
      hours.get(start).push({ series, t, min: mean - below, max: mean + above, sum: mean * 10, count: 10, last: mean });
    }
  }
  const rows = [];
  const days = new Map();
  for (const [start, samples] of hours) {
    if (start > cutoff - 3600) {
      rows.push([300, start, encodeRow(samples, start, 300)]);
      continue;
    }
    const day = start - start % 86400;
    if (!days.has(day)) days.set(day, new Map());
    for (const x of samples.sort((x, y) => x.t - y.t)) { // toHours: the hour's slots merged, the newest last
      const key = `${x.series} ${start}`;
      const h = days.get(day).get(key);
      days.get(day).set(key, h ? { ...h, min: Math.min(h.min, x.min), max: Math.max(h.max, x.max), sum: h.sum + x.sum, count: h.count + x.count, last: x.last }
        : { ...x, t: start });
    }
  }
  for (const [day, slots] of days) rows.push([3600, day, encodeRow([...slots.values()], day, 3600)]);
  return rows.sort((x, y) => x[0] - y[0] || x[1] - y[1]);
}

// seedHistory writes a month up to end for the devices uids (at least
// three) into the database at file; firmwares holds the md5 and version
// of the stable and the leaky release.
export function seedHistory(file, uids, end, firmwares) {
  const devices = new Map(execFileSync('sqlite3', ['-separator', ' ', file, 'SELECT uid, id, team_id FROM devices'])
    .toString().trim().split('\n').map(line => line.split(' ')).map(([uid, id, team]) => [uid, { id: Number(id), team: Number(team) }]));
  const fleet = new FleetHours();
  let sql = 'BEGIN;\n';
  uids.forEach((uid, index) => {
    const { id, team } = devices.get(uid);
    const m = deviceMonth(index, end, firmwares);
    const firmwareAt = t => m.runs.find(r => t >= r[1] && t < r[2])[0];
    sql += `UPDATE devices SET first_seen_at = ${quote(stamp(m.start))} WHERE id = ${id};\n`;
    sql += insert('firmware_runs (device_id, md5, version, from_at, to_at)', m.runs.map(([f, from, to]) => [id, f.md5, f.version, unix(from), unix(to)]));
    sql += insert('boots (device_id, number, at, reason, crash, fw_md5, fw_version)', m.boots.map(([at, reason, f], i) =>
      [id, i + 1, unix(at), reason, CRASHES.includes(reason) ? 1 : 0, f.md5, f.version]));
    for (const [at, reason, f] of m.boots) fleet.boot(team, f.md5, at, CRASHES.includes(reason) ? 1 : 0);
    const presence = [];
    let from = m.start;
    for (const [at, length] of m.outages) {
      presence.push([id, 1, unix(from), unix(at)], [id, 0, unix(at), unix(at + length)]);
      fleet.offline(team, firmwareAt(at).md5, at);
      from = at + length;
    }
    presence.push([id, 1, unix(from), unix(end)]);
    sql += insert('presence (device_id, online, from_at, to_at)', presence);
    for (const series of ['rssi', 'heap_free']) {
      for (const [t, mean] of m.buckets[series]) fleet.mean(team, firmwareAt(t).md5, t, series, mean);
    }
    const rows = historyRows(m.buckets, end);
    for (let i = 0; i < rows.length; i += 200) sql += insert('history_rows (device_id, step, start, slots)', rows.slice(i, i + 200).map(r => [id, ...r]));
  });
  sql += fleet.sql();
  execFileSync('sqlite3', [file], { input: sql + 'COMMIT;\n', maxBuffer: 1 << 28 });
}
