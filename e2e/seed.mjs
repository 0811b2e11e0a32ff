// A month of a greenhouse fleet's past, written into devicehub's database
// before the server starts, as a month of telemetry would have left it
// (CONTRACT §14): 5-minute buckets of rssi, heap_free and metrics.temp_c,
// online and offline intervals, boots with their reasons, and the runs of
// each firmware. A test cannot wait a month for its charts; live
// telemetry adds to this once the server runs.
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

// stamp is a time as devicehub stores it (microseconds, UTC).
const stamp = ms => new Date(ms).toISOString().replace(/\.(\d{3})Z$/, '.$1000Z');
const quote = v => v === null ? 'NULL' : typeof v === 'string' ? `'${v.replace(/'/g, "''")}'` : String(v);
const insert = (table, rows) => rows.length ? `INSERT INTO ${table} VALUES ${rows.map(r => '(' + r.map(quote).join(',') + ')').join(',\n')};\n` : '';

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
  boots.sort((a, b) => a[0] - b[0]); // ids in the order of time, as they would have come
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

// seedHistory writes a month up to end for the devices uids (at least
// three) into the database at file; firmwares holds the md5 and version
// of the stable and the leaky release.
export function seedHistory(file, uids, end, firmwares) {
  const ids = new Map(execFileSync('sqlite3', ['-separator', ' ', file, 'SELECT uid, id FROM devices'])
    .toString().trim().split('\n').map(line => line.split(' ')).map(([uid, id]) => [uid, Number(id)]));
  let sql = 'BEGIN;\n';
  let seriesId = Number(execFileSync('sqlite3', [file, 'SELECT COALESCE(max(id), 0) FROM series']).toString());
  uids.forEach((uid, index) => {
    const id = ids.get(uid);
    const m = deviceMonth(index, end, firmwares);
    sql += `UPDATE devices SET first_seen_at = ${quote(stamp(m.start))} WHERE id = ${id};\n`;
    sql += insert('firmware_runs (device_id, md5, version, from_at, to_at)', m.runs.map(([f, from, to]) => [id, f.md5, f.version, stamp(from), stamp(to)]));
    sql += insert('boots (device_id, number, at, reason, crash, fw_md5, fw_version)', m.boots.map(([at, reason, f], i) =>
      [id, i + 1, stamp(at), reason, ['panic', 'task_wdt', 'int_wdt', 'wdt', 'brownout'].includes(reason) ? 1 : 0, f.md5, f.version]));
    const presence = [];
    let from = m.start;
    for (const [at, length] of m.outages) {
      presence.push([id, 1, stamp(from), stamp(at)], [id, 0, stamp(at), stamp(at + length)]);
      from = at + length;
    }
    presence.push([id, 1, stamp(from), stamp(end)]);
    sql += insert('presence (device_id, online, from_at, to_at)', presence);
    for (const [name, rows] of Object.entries(m.buckets)) {
      seriesId++;
      sql += insert('series (id, device_id, name)', [[seriesId, id, name]]);
      for (let i = 0; i < rows.length; i += 2000) {
        sql += insert('buckets (series_id, t, min, max, sum, count, last)', rows.slice(i, i + 2000).map(([t, mean, below, above]) =>
          [seriesId, t / 1000, +(mean - below).toFixed(2), +(mean + above).toFixed(2), +(mean * 10).toFixed(2), 10, +mean.toFixed(2)]));
      }
    }
  });
  execFileSync('sqlite3', [file], { input: sql + 'COMMIT;\n', maxBuffer: 1 << 28 });
}
