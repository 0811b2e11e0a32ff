// Fleet health in a real browser (issue 29): a device's charts, presence
// and boots; the Fleet health page's firmware comparison; a rollout's
// health gate, set in the form, and the rollout page saying why it halted,
// for its devices' health (its Health section giving the banner's figures)
// and for failures; the devices it never reached keeping their target; a
// halted rollout resumed, then cancelled, then reverted with its Revert
// button (issue 36); the batch a rollout watches. Each at 1280 and 375 px. A
// greenhouse fleet of three simulated ESP32s with a month of history
// (seed.mjs), a fourth device with none. Run it with
// `cd e2e && npm ci && node --test`.
//
// After each step, any console error, page error, request that left the
// server's origin or unexpected dialog fails it.

import { after, afterEach, before, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import path from 'node:path';
import { Rig, boxOf, espImage, root, waitFor } from './fixture.mjs';
import { seedHistory } from './seed.mjs';

const EMAIL = 'gil@example.com';
const PASSWORD = 'a greenhouse full of sensors';
const FLEET = ['Greenhouse 1', 'Greenhouse 2', 'Greenhouse 3'];
const md5 = bytes => createHash('md5').update(bytes).digest('hex');

const rig = new Rig();
const s = {}; // what the steps learn: uids, firmwares, the API token
const page = () => rig.page;
const shows = (selector, hasText, timeout = 15000) => page().locator(selector, { hasText }).first().waitFor({ timeout });
const fact = label => page().locator('dl.facts dt', { hasText: new RegExp('^' + label + '$') }).locator('xpath=following-sibling::dd[1]');
const docs = name => path.join(root, 'docs', name);

// firmware is an image and what the API knows it by.
function firmware(version, size) {
  const bytes = espImage(size);
  return { bytes, version, md5: md5(bytes) };
}

// upload uploads f to the device uid as "greenhouse" f.version.
async function upload(uid, f) {
  const form = new FormData();
  form.append('name', 'greenhouse');
  form.append('version', f.version);
  form.append('file', new Blob([f.bytes], { type: 'application/octet-stream' }), 'greenhouse.bin');
  const res = await rig.http('POST', `/v1/user/devices/${uid}/firmwares`, s.token, form);
  assert.equal(res.status, 201, JSON.stringify(res.body));
}

// telemetry publishes a device's telemetry, as its firmware would.
const telemetry = (uid, message) => rig.publish(`devices/${uid}/telemetry`, message);

async function openDevice(name) {
  await page().evaluate(uid => { location.hash = '#/devices/' + encodeURIComponent(uid); }, s.uids[name]);
  await page().getByRole('heading', { level: 2, name }).waitFor();
}

// range picks a time range of the device page and waits for its charts
// to be drawn from a history asked for that range.
async function range(label, hours) {
  const asked = page().waitForRequest(req => {
    const url = new URL(req.url());
    return url.pathname.endsWith('/history') && Math.abs(Date.now() - hours * 3600e3 - Date.parse(url.searchParams.get('from'))) < 60e3;
  }, { timeout: 5000 });
  await page().getByLabel(label, { exact: true }).check();
  await asked;
  await shows('#hx-span', { 24: 'The last 24 hours', 168: 'The last 7 days', 720: 'The last 30 days' }[hours]);
}

// plotted is what the chart of a series draws: the x of the mean line's
// first point, as a share of the plot's width, and its number of runs.
// The plot is found and measured in one evaluation: a plot that a redraw
// has just replaced has no width.
const plotted = async name => (await page().waitForFunction(sel => {
  const svg = document.querySelector(sel), d = svg?.querySelector('path.mean')?.getAttribute('d');
  if (!d || !svg.clientWidth) return null;
  const x = Number(d.match(/^M([\d.]+)/)[1]);
  return { start: (x - CHART.left) / (svg.clientWidth - CHART.left - CHART.right), runs: d.split('M').length - 1, bands: svg.querySelectorAll('path.band').length };
}, `#hx-charts [data-series="${name}"] svg`)).jsonValue();

// drawnToWidth waits until each chart is drawn at its figure's width: a
// resize redraws them once the page has its new width.
const drawnToWidth = () => page().waitForFunction(() => [...document.querySelectorAll('#hx-charts figure')]
  .every(fig => Number(fig.querySelector('svg')?.getAttribute('width')) === fig.clientWidth));

// unlabelled lists the form controls on screen without an accessible name.
const unlabelled = () => page().evaluate(() => [...document.querySelectorAll('#view input, #view select, #view textarea, #view button')]
  .filter(el => !(el.labels && el.labels.length) && !el.getAttribute('aria-label') && !(el.tagName === 'BUTTON' && el.textContent.trim()))
  .map(el => el.outerHTML));

// agreesWithBanner checks that a halted rollout's Health section shows
// the figures its banner says it halted on, at once.
async function agreesWithBanner() {
  const banner = await page().locator('#ro-halt').textContent();
  const health = await page().locator('#ro-health').textContent();
  const [, crashes, time, rate] = banner.match(/crashed (\d+) times? in ([\d.]+ device-\w+) on the new firmware, ([\d,.]+) crash/);
  assert.match(health, new RegExp(`^${crashes} crash(es)? in ${time.replace('.', '\\.')}, ${rate.replace('.', '\\.')} crash(es)? per device-day on the new firmware, across the devices this rollout updated: the figures it halted on\\.$`));
}

// screenshot saves the page from its top to the bottom of selector.
async function screenshot(file, selector) {
  const { bottom } = await boxOf(page(), selector);
  await page().screenshot({ path: docs(file), fullPage: true, clip: { x: 0, y: 0, width: page().viewportSize().width, height: Math.ceil(bottom + 16) } });
}

describe('fleet health', { timeout: 600000 }, () => {
  before(async () => {
    rig.build();
    await rig.startBroker();
    rig.cli('user', 'add', '-email', EMAIL, '-name', 'Gil', '-password', PASSWORD, '-role', 'admin');
    s.uids = Object.fromEntries(FLEET.map(name => [name, rig.cli('device', 'add', '-owner', EMAIL, '-platform', 'esp32', '-board', 'devkit', '-name', name)]));
    s.stable = firmware('1.2.0', 40 * 1024);
    s.leaky = firmware('1.3.0', 41 * 1024);
    s.next = firmware('1.4.0', 42 * 1024);
    seedHistory(path.join(rig.data, 'devicehub.db'), Object.values(s.uids), Date.now(), { stable: s.stable, leaky: s.leaky });
    await rig.startServer();
    s.token = (await rig.http('POST', '/v1/auth/login', '', { email: EMAIL, password: PASSWORD, token_name: 'e2e' })).body.token;
    // 1.4.0 is a bad build: a device running it panics every 5 to 15 s.
    await rig.simulate(EMAIL, Object.values(s.uids), '-interval', '2s', '-crash-md5', s.next.md5, '-crash-every', '10s');
    for (const f of [s.stable, s.leaky]) await upload(s.uids['Greenhouse 1'], f); // they get a name on the Fleet health page
    await rig.openBrowser();
  });

  after(() => rig.close());
  afterEach(() => rig.checkStep());

  it('logs in', async () => {
    await page().goto(rig.origin + '/');
    await page().getByLabel('Email').fill(EMAIL);
    await page().getByLabel('Password').fill(PASSWORD);
    await page().getByRole('button', { name: 'Log in' }).click();
    await page().getByRole('heading', { level: 2, name: 'Devices' }).waitFor();
    await shows('#dev-summary', '3 of 3 devices online', 30000);
  });

  it('says so when a device has no history yet, at 1280 and 375 px', async () => {
    const res = await rig.http('POST', '/v1/user/devices', s.token, { platform: 'esp32', board: 'devkit', name: 'Spare sensor' });
    s.uids['Spare sensor'] = res.body.data.uid;
    await openDevice('Spare sensor');
    await rig.atWidths(async width => {
      await shows('#hx-empty', 'No readings yet');
      await shows('#hx-presence', 'No online or offline times recorded in this range yet.');
      await shows('#hx-boots-empty', 'No boots reported yet');
      assert.equal(await page().locator('#hx-charts figure').count(), 0);
      assert.equal(await page().locator('#hx-boots tr').count(), 0);
      assert.ok(await rig.overflow() <= 0, `wider than ${width} px`);
    });
    assert.deepEqual(await unlabelled(), [], 'controls without a label');
  });

  it('charts RSSI, free heap and each metric over 24 h, 7 d and 30 d, at 1280 and 375 px', async () => {
    await openDevice('Greenhouse 1');
    const figures = page().locator('#hx-charts figure');
    await figures.nth(2).locator('svg path.mean').waitFor();
    assert.deepEqual(await figures.evaluateAll(fs => fs.map(f => f.dataset.series)), ['rssi', 'heap_free', 'metrics.temp_c']);
    assert.deepEqual(await page().locator('#hx-charts figcaption').evaluateAll(cs => cs.map(c => c.firstChild.textContent)),
      ['Wi-Fi signal (RSSI)', 'Free heap', 'temp_c']);
    await shows('#hx-charts [data-series="rssi"] figcaption', /latest -\d+ dBm/);
    await shows('#hx-charts [data-series="heap_free"] figcaption', /latest [\d.]+ KiB/);
    await rig.atWidths(async width => {
      for (const [label, hours] of [['7 d', 168], ['30 d', 720], ['24 h', 24]]) {
        await range(label, hours);
        for (const series of ['rssi', 'heap_free', 'metrics.temp_c']) {
          const p = await plotted(series);
          assert.ok(p.start < 0.02, `${series} over ${label} at ${width} px starts ${p.start} of the way in: the month is drawn from the range's start`);
          assert.ok(p.bands >= 1, `${series} over ${label} has a min–max band`);
        }
      }
      // Time labels are local times of day over 24 h.
      assert.match(await page().locator('#hx-charts [data-series="rssi"] svg text').last().textContent(), /^\d{1,2}:\d{2}|^\d{1,2} \w{3}$|^\w{3} \d{1,2}$/);
      assert.ok(await rig.overflow() <= 0, `wider than ${width} px`);
      // The smallest text on the charts stays readable.
      assert.ok(await page().evaluate(() => parseFloat(getComputedStyle(document.querySelector('#hx-charts svg text')).fontSize)) >= 12);
    });
    // The power cut of six hours five days ago breaks the line.
    for (const [label, hours] of [['7 d', 168], ['30 d', 720]]) {
      await range(label, hours);
      assert.ok((await plotted('rssi')).runs >= 2, `over ${label}, an outage breaks the line`);
    }
    await range('24 h', 24);
  });

  it('shows the value and local time under the pointer, the mouse at 1280 px and a finger at 375 px', async () => {
    const plot = page().locator('#hx-charts [data-series="heap_free"] svg');
    const tip = page().locator('#hx-charts [data-series="heap_free"] .tip');
    const box = await boxOf(page(), '#hx-charts [data-series="heap_free"] svg');
    await plot.hover({ position: { x: box.width * 0.5, y: box.height / 2 } });
    await tip.waitFor();
    assert.match(await tip.textContent(), /^[\d.,]+ KiB.*\w{3}, .*\d{1,2}:\d{2}/);
    await page().mouse.move(0, 0);
    await tip.waitFor({ state: 'hidden' });
    // By keyboard: the plot takes focus, the arrows move along it.
    await plot.focus();
    const newest = await tip.textContent();
    await page().keyboard.press('ArrowLeft');
    assert.notEqual(await tip.textContent(), newest);
    await plot.blur();

    await page().setViewportSize({ width: 375, height: 812 });
    await range('30 d', 720);
    const small = await boxOf(page(), '#hx-charts [data-series="heap_free"] svg');
    await plot.tap({ position: { x: small.width * 0.9, y: small.height / 2 } });
    await tip.waitFor();
    assert.match(await tip.textContent(), /^[\d.,]+ KiB mean \([\d.,]+ KiB to [\d.,]+ KiB\)/);
    const t = await boxOf(page(), '#hx-charts [data-series="heap_free"] .tip');
    assert.ok(t.x >= 0 && t.x + t.width <= 375, `the tip (${t.x}–${t.x + t.width}) leaves the screen`);
    await page().waitForTimeout(300); // a finger's reading stays once lifted
    assert.ok(await tip.isVisible());
    // A redraw (here for a narrower screen) keeps the reading.
    const reading = await tip.textContent(), drawn = await plot.elementHandle();
    await page().setViewportSize({ width: 360, height: 812 });
    await page().waitForFunction(svg => !svg.isConnected, drawn);
    assert.ok(await tip.isVisible(), 'the reading is gone after a redraw');
    assert.equal(await tip.textContent(), reading);
    await page().setViewportSize({ width: 1280, height: 900 });
    await range('24 h', 24);
  });

  it('shows when the device was online and offline, with its crashes marked', async () => {
    await range('30 d', 720);
    const strip = page().locator('#hx-presence');
    assert.ok(await strip.locator('rect.off').count() >= 2, 'the outages of the month');
    assert.ok(await strip.locator('path.crash').count() >= 5, 'the panics of the last three days');
    await shows('#hx-presence p', /^Online [\d.]+% of the recorded time; offline \d+ times\./);
    await shows('#hx-presence p', /▼ \d+ crashes/);
    await range('24 h', 24);
  });

  it('lists the boots with their reasons, crashes marked, and a new one arrives at once', async () => {
    const rows = page().locator('#hx-boots tr');
    await rows.first().waitFor();
    const crash = rows.filter({ hasText: 'panic' }).first();
    await crash.locator('.badge', { hasText: 'crash' }).waitFor();
    assert.match(await crash.textContent(), /panic \(an exception or abort\)1\.3\.0 \(md5 /);
    await rows.filter({ hasText: 'poweron' }).first().locator('.badge').waitFor({ state: 'detached' });
    // The device is restarted by its software: the page hears of it.
    telemetry(s.uids['Greenhouse 1'], { reset_reason: 'sw', uptime_s: 3, heap_free: 184000, metrics: { temp_c: 24.5 } });
    await rows.first().filter({ hasText: 'restarted by its software' }).waitFor({ timeout: 10000 });
    assert.equal(await rows.first().locator('.badge').count(), 0, 'no crash');
    await rig.atWidths(async width => {
      await shows('#hx-boots tr td[data-label="Reason"]', 'restarted by its software');
      assert.ok(await rig.overflow() <= 0, `wider than ${width} px`);
    });
  });

  it('takes screenshots of the device history at 1280 and 375 px', async () => {
    await range('7 d', 168);
    const plot = page().locator('#hx-charts [data-series="heap_free"] svg');
    const box = await boxOf(page(), '#hx-charts [data-series="heap_free"] svg');
    await plot.hover({ position: { x: box.width * 0.8, y: box.height / 2 } });
    await page().locator('#hx-charts [data-series="heap_free"] .tip').waitFor();
    await screenshot('device-health-1280.png', '#hx-boots');
    await page().mouse.move(0, 0);
    await page().setViewportSize({ width: 375, height: 812 });
    await drawnToWidth();
    await screenshot('device-health-375.png', '#hx-charts');
    await page().setViewportSize({ width: 1280, height: 900 });
    await range('24 h', 24);
  });

  it('compares the firmwares on the Fleet health page, worst first and the bad one marked, at 1280 and 375 px', async () => {
    await page().getByRole('link', { name: 'Fleet health' }).click();
    await page().getByRole('heading', { level: 2, name: 'Fleet health' }).waitFor();
    const rows = page().locator('#fh-rows tr');
    await rows.filter({ hasText: 'greenhouse 1.2.0' }).waitFor();
    const worst = rows.first();
    assert.match(await worst.locator('td[data-label="Firmware"]').textContent(), /^greenhouse 1\.3\.0/);
    assert.ok(await worst.evaluate(tr => tr.classList.contains('bad')), 'the crashing release is highlighted');
    await worst.locator('.badge', { hasText: 'crashes often' }).waitFor();
    assert.equal(await worst.locator('td[data-label="Devices"]').textContent(), '2');
    assert.match(await worst.locator('td[data-label="Median free heap"]').textContent(), /^[\d.]+ KiB$/);
    assert.match(await worst.locator('td[data-label="Median RSSI"]').textContent(), /^-\d+ dBm$/);
    const stable = rows.filter({ hasText: 'greenhouse 1.2.0' });
    assert.ok(!(await stable.evaluate(tr => tr.classList.contains('bad'))), 'the stable release is not');
    assert.deepEqual(await unlabelled(), [], 'controls without a label');
    const asked = page().waitForRequest(req => req.url().endsWith('/v1/user/firmware-health?hours=168'));
    await page().getByLabel('Last 7 d').check();
    await asked;
    // Over a week, 1.2.0 ran on all three devices.
    await stable.locator('td[data-label="Devices"]', { hasText: /^3$/ }).waitFor();
    await rig.atWidths(async width => {
      await worst.locator('.badge', { hasText: 'crashes often' }).waitFor();
      assert.ok(await rig.overflow() <= 0, `wider than ${width} px`);
      if (width < 640) { // each label at the row's left edge, the md5 under the firmware's name
        const [indent, misaligned] = await worst.locator('td[data-label="Firmware"]').evaluate(td => {
          const style = getComputedStyle(td), label = getComputedStyle(td, '::before');
          const text = document.createRange();
          text.selectNodeContents(td.firstChild);
          return [parseFloat(style.paddingLeft) + parseFloat(label.marginLeft),
            Math.abs(td.querySelector('small').getBoundingClientRect().left - text.getBoundingClientRect().left)];
        });
        assert.ok(Math.abs(indent) < 1, `the labels are indented ${indent} px`);
        assert.ok(misaligned < 1, `the md5 is ${misaligned} px off the firmware's name`);
      }
      await screenshot(`fleet-health-${width}.png`, '#fh-table + p + p');
    });
  });

  it('sets a health gate in the rollout form; a bad value is refused beside its field', async () => {
    await upload(s.uids['Greenhouse 1'], s.next);
    await page().evaluate(q => { location.hash = '#/rollouts?' + q; }, new URLSearchParams({ md5: s.next.md5, label: 'greenhouse 1.4.0' }).toString());
    await page().getByRole('heading', { level: 2, name: 'Rollouts' }).waitFor();
    await page().getByLabel('Name or uid contains').fill('Greenhouse');
    await shows('#r-matches', '3 devices match now.');
    await page().getByLabel('Batch size').fill('1');
    await page().getByLabel('Name (optional)').fill('greenhouse 1.4.0');
    assert.deepEqual(await unlabelled(), [], 'controls without a label');
    assert.equal(await page().getByLabel('When it halts').inputValue(), 'stop', 'a rollout stops when it halts, unless asked');
    // A gate without its rate is refused before it is sent.
    await page().getByLabel('Crashes needed before it can halt').fill('1');
    await page().getByRole('button', { name: 'Start rollout…' }).click();
    await shows('#r-crash-rate-err', 'Set the crash rate that halts the rollout');
    // A rate of 0 the server refuses, beside the field.
    await page().getByLabel('Halt above this many crashes per device-day').fill('0');
    rig.expectFailure(422);
    rig.answerDialogs(true);
    await page().getByRole('button', { name: 'Start rollout…' }).click();
    await shows('#r-crash-rate-err', 'must be a number above 0');
  });

  it('halts the rollout when the updated devices crash, and says why in words and figures, at 1280 and 375 px', async () => {
    // The greenhouses target 1.2.0 before the rollout.
    for (const name of FLEET) {
      if (name !== 'Greenhouse 1') await upload(s.uids[name], s.stable); // Greenhouse 1 has it
      const res = await rig.http('POST', `/v1/user/devices/${s.uids[name]}/firmwares/set-target`, s.token, { md5: s.stable.md5 });
      assert.equal(res.status, 200, JSON.stringify(res.body));
    }
    await page().getByLabel('Halt above this many crashes per device-day').fill('1');
    await page().getByLabel('Minutes to watch each batch before the next').fill('10');
    rig.answerDialogs(true);
    await page().getByRole('button', { name: 'Start rollout…' }).click();
    await page().getByRole('heading', { level: 2, name: 'greenhouse 1.4.0' }).waitFor();
    await fact('Health gate').filter({ hasText: 'halts above 1 crash per device-day on the new firmware, once its devices have crashed at least 1 time; each batch is watched for 10 minutes before the next' }).waitFor();
    // The first batch's device takes 1.4.0, and soon panics.
    await page().locator('#ro-devices tr', { hasText: 'succeeded' }).first().waitFor({ timeout: 90000 });
    await fact('State').filter({ hasText: 'halted' }).waitFor({ timeout: 60000 });
    s.rollout = await page().evaluate(() => location.hash);
    await rig.atWidths(async width => {
      await shows('#ro-halt', /^Halted for its devices' health: the devices it updated crashed \d+ times? in [\d.]+ device-(second|minute)s? on the new firmware, [\d,.]+ crashes per device-day, above the limit of 1\. Nothing more is sent/);
      await agreesWithBanner();
      assert.ok(await rig.overflow() <= 0, `wider than ${width} px`);
      await page().getByRole('button', { name: 'Resume' }).waitFor();
      await page().getByRole('button', { name: 'Cancel…' }).waitFor();
      await page().screenshot({ path: docs(`rollout-halted-${width}.png`), fullPage: true });
    });
    assert.equal(await page().locator('#ro-devices tr', { hasText: 'pending' }).count(), 2, 'the other batches got nothing');
  });

  it('leaves the devices a halted rollout never reached with the target they had, at 1280 and 375 px', async () => {
    const pending = s.neverReached = await page().locator('#ro-devices tr', { hasText: 'pending' }).locator('td[data-label="Device"]').allTextContents();
    assert.equal(pending.length, 2);
    for (const name of pending) {
      await openDevice(name);
      await rig.atWidths(async width => {
        await fact('Target firmware').filter({ hasText: /^greenhouse 1\.2\.0$/ }).waitFor();
        assert.ok(await rig.overflow() <= 0, `wider than ${width} px`);
      });
    }
    await page().evaluate(hash => { location.hash = hash; }, s.rollout);
    await page().getByRole('heading', { level: 2, name: 'greenhouse 1.4.0' }).waitFor();
  });

  it('resumes the halted rollout, which halts again on the crashes after the resume, then cancels it, at 1280 and 375 px', async () => {
    await fact('State').filter({ hasText: 'halted' }).waitFor();
    rig.answerDialogs(true);
    const resumed = page().waitForResponse(res => res.url().endsWith('/resume') && res.request().method() === 'POST');
    await page().getByRole('button', { name: 'Resume' }).click();
    assert.equal((await resumed).status(), 200);
    assert.match(rig.dialogs.at(-1), /^Resume this halted rollout\? It goes on anyway/);
    await shows('#status', 'Rollout running.');
    // The device it updated still runs 1.4.0 and panics: the gate,
    // counting from the resume, halts the rollout again, and the page
    // agrees.
    await fact('State').filter({ hasText: 'halted' }).waitFor({ timeout: 150000 });
    await rig.atWidths(async width => {
      await agreesWithBanner();
      assert.ok(await rig.overflow() <= 0, `wider than ${width} px`);
    });
    rig.answerDialogs(true);
    await page().getByRole('button', { name: 'Cancel…' }).click();
    await fact('State').filter({ hasText: 'cancelled' }).waitFor();
    await shows('#status', 'Rollout cancelled.');
    await rig.atWidths(async width => {
      assert.equal(await page().locator('#ro-devices tr', { hasText: 'skipped' }).count(), 2, 'the devices it never reached are skipped');
      for (const move of ['pause', 'resume', 'cancel']) assert.ok(await page().locator('#ro-' + move).isHidden(), 'no more ' + move);
      await page().getByRole('button', { name: 'Revert…' }).waitFor();
      assert.ok(await rig.overflow() <= 0, `wider than ${width} px`);
    });
    for (const name of s.neverReached) {
      const d = (await rig.http('GET', `/v1/user/devices/${s.uids[name]}`, s.token)).body.data;
      assert.equal(d.target_firmware && d.target_firmware.md5, s.stable.md5, name + ' keeps its target');
    }
  });

  it('reverts the cancelled rollout with its Revert button, each naming the other, at 1280 and 375 px', async () => {
    rig.answerDialogs(true);
    await page().getByRole('button', { name: 'Revert…' }).click();
    await page().getByRole('heading', { level: 2, name: 'Revert of greenhouse 1.4.0' }).waitFor();
    assert.match(rig.dialogs.at(-1), /^Revert this rollout\? Each device it updated is sent the firmware it ran before/);
    // The simulator started that device on its own image (sim-1.0), which
    // the team does not hold: the revert skips it, and says why.
    await rig.atWidths(async width => {
      await fact('Reverts').filter({ hasText: /^rollout \d+$/ }).waitFor();
      await page().locator('#ro-devices tr', { hasText: /skipped.*Your team no longer holds its earlier firmware \(md5 [0-9a-f]{32}\)\./ }).waitFor();
      assert.equal(await page().locator('#ro-devices tr').count(), 1, 'the one device the bad build reached');
      assert.ok(await rig.overflow() <= 0, `wider than ${width} px`);
    });
    await page().evaluate(hash => { location.hash = hash; }, s.rollout);
    await page().getByRole('heading', { level: 2, name: 'greenhouse 1.4.0' }).waitFor();
    await rig.atWidths(async width => {
      await fact('Reverted by').filter({ hasText: /^rollout \d+$/ }).waitFor();
      assert.ok(await page().locator('#ro-actions').isHidden(), 'reverted once: no more moves');
      assert.ok(await rig.overflow() <= 0, `wider than ${width} px`);
    });
  });

  it('says which batch a running rollout watches, and until when, at 1280 and 375 px', async () => {
    const good = firmware('1.4.1', 43 * 1024);
    const uids = s.neverReached.map(name => s.uids[name]);
    await upload(uids[0], good);
    const res = await rig.http('POST', '/v1/user/rollouts', s.token, { md5: good.md5, name: 'greenhouse 1.4.1', batch_size: 1,
      device_uids: uids, health: { max_crash_rate: 1000, min_crashes: 100, watch_minutes: 10 } });
    assert.equal(res.status, 201, JSON.stringify(res.body));
    await page().evaluate(id => { location.hash = '#/rollouts/' + id; }, res.body.data.id);
    await page().locator('#ro-devices tr', { hasText: 'succeeded' }).first().waitFor({ timeout: 90000 });
    await rig.atWidths(async width => {
      await shows('#ro-counts', /^1 of 2 devices done: .*Watching batch 1 until \d{1,2}:\d{2}( [AP]M)? before going on\.$/);
      await shows('#ro-health', /^0 crashes in [\d.]+ device-\w+, 0 crashes per device-day on the new firmware, across the devices this rollout updated since .*Watching batch 1 until/);
      await fact('State').filter({ hasText: 'running' }).waitFor();
      assert.ok(await rig.overflow() <= 0, `wider than ${width} px`);
    });
  });

  it('says why a rollout halted for failures', async () => {
    const uid = s.uids['Spare sensor'];
    rig.publish(`devices/${uid}/status`, 'online', '-r');
    await upload(uid, firmware('0.9.0', 8 * 1024));
    const spare = (await rig.http('GET', `/v1/user/devices/${uid}/firmwares`, s.token)).body.data[0];
    const res = await rig.http('POST', '/v1/user/rollouts', s.token, { md5: spare.md5, select: { q: 'Spare' }, name: 'spare 0.9.0', max_failures: 0 });
    assert.equal(res.status, 201, JSON.stringify(res.body));
    await page().evaluate(id => { location.hash = '#/rollouts/' + id; }, res.body.data.id);
    // The device answers the update it was sent: it failed.
    let ota;
    await waitFor('the OTA command', async () => (ota = (await rig.http('GET', `/v1/user/devices/${uid}/commands`, s.token)).body.data.find(c => c.kind === 'ota')));
    rig.publish(`devices/${uid}/result/${ota.id}`, { ok: false, error: 'flash write failed' });
    await fact('State').filter({ hasText: 'halted' }).waitFor({ timeout: 30000 });
    await shows('#ro-halt', 'Halted for failures: 1 device failed to update, more than the 0 allowed.');
    await fact('Health gate').filter({ hasText: /^none$/ }).waitFor();
  });
});

