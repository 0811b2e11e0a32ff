// The Team page's Webhooks section in a real browser (issue 36), at 1280
// and 375 px: an admin adds an endpoint with the events it wants and sees
// its secret once; a device's status change and a test delivery reach a
// receiver on 127.0.0.1 (devicehub runs with -webhook-allow-private),
// signed with that secret, and show in the endpoint's recent deliveries
// with their status; the endpoint is disabled, enabled and deleted. Run it
// with `cd e2e && npm ci && node --test webhooks.test.mjs`.
//
// After each step, any console error, page error, request that left the
// server's origin or unexpected dialog fails it.

import { after, afterEach, before, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { createHmac } from 'node:crypto';
import http from 'node:http';
import path from 'node:path';
import { Rig, boxOf, root, waitFor } from './fixture.mjs';

const EMAIL = 'ada@example.com';
const PASSWORD = 'webhooks wake people up';

const rig = new Rig();
const s = { received: [] }; // the receiver's requests, the device's uid, the API token
const page = () => rig.page;
const shows = (selector, hasText, timeout = 15000) => page().locator(selector, { hasText }).first().waitFor({ timeout });
const button = name => page().getByRole('button', { name, exact: true });

// receive is the endpoint: it answers 200 to each POST and keeps what it
// got. While s.holdPings is set, a ping is answered only once it settles:
// the page lists the deliveries before the ping's, and must then show the
// ping's without being told.
function receive(req, res) {
  const chunks = [];
  req.on('data', c => chunks.push(c));
  req.on('end', async () => {
    s.received.push({ path: req.url, headers: req.headers, body: Buffer.concat(chunks) });
    if (req.headers['x-devicehub-event'] === 'ping') await s.holdPings;
    res.writeHead(200).end();
  });
}

// delivered waits for the receiver to get an event of type at urlPath,
// and checks its headers and signature against secret.
async function delivered(urlPath, type, secret) {
  const got = () => s.received.find(r => r.path === urlPath && r.headers['x-devicehub-event'] === type);
  await waitFor(`${type} delivered to ${urlPath}`, got, 15000);
  const r = got();
  assert.equal(r.headers['content-type'], 'application/json');
  assert.match(r.headers['x-devicehub-delivery'], /^[A-Za-z0-9]{20}$/);
  assert.equal(r.headers['x-devicehub-signature-256'], 'sha256=' + createHmac('sha256', secret).update(r.body).digest('hex'));
  assert.equal(JSON.parse(r.body).type, type);
}

// unlabelled lists the form controls on screen without an accessible name.
const unlabelled = () => page().evaluate(() => [...document.querySelectorAll('#view input, #view select, #view textarea, #view button')]
  .filter(el => !(el.labels && el.labels.length) && !el.getAttribute('aria-label') && !(el.tagName === 'BUTTON' && el.textContent.trim()))
  .map(el => el.outerHTML));

// offScreen lists the page's elements and text that reach past the
// screen's right edge.
const offScreen = () => page().evaluate(() => {
  const right = document.documentElement.clientWidth + 0.5;
  const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_ELEMENT | NodeFilter.SHOW_TEXT);
  const found = [];
  const clipped = el => el && (getComputedStyle(el).clipPath !== 'none' || clipped(el.parentElement)); // .sr-only, say
  for (let n = walk.nextNode(); n; n = walk.nextNode()) {
    if (clipped(n.parentElement)) continue;
    const range = document.createRange();
    range.selectNodeContents(n);
    const rects = [...(n.nodeType === Node.TEXT_NODE ? range : n).getClientRects()];
    if (rects.some(r => r.width && r.right > right)) found.push((n.outerHTML || n.parentElement.outerHTML).slice(0, 160));
  }
  return found;
});

async function openTeam() {
  await page().evaluate(() => { location.hash = '#/team'; });
  await page().getByRole('heading', { level: 3, name: 'Webhooks' }).waitFor();
}

describe('webhooks', { timeout: 300000 }, () => {
  before(async () => {
    rig.build();
    await rig.startBroker();
    rig.cli('user', 'add', '-email', EMAIL, '-name', 'Ada', '-password', PASSWORD, '-role', 'admin');
    s.uid = rig.cli('device', 'add', '-owner', EMAIL, '-platform', 'esp32', '-board', 'devkit', '-name', 'Greenhouse 1');
    s.receiver = http.createServer(receive);
    await new Promise(resolve => s.receiver.listen(0, '127.0.0.1', resolve));
    s.endpoint = 'http://127.0.0.1:' + s.receiver.address().port;
    await rig.startServer('-webhook-allow-private');
    s.token = (await rig.http('POST', '/v1/auth/login', '', { email: EMAIL, password: PASSWORD, token_name: 'e2e' })).body.token;
    await rig.openBrowser();
  });

  after(async () => {
    await rig.close();
    s.receiver.close();
  });
  afterEach(() => rig.checkStep());

  it('logs in and opens the Team page, where there are no webhooks yet', async () => {
    await page().goto(rig.origin + '/');
    await page().getByLabel('Email').fill(EMAIL);
    await page().getByLabel('Password').fill(PASSWORD);
    await page().getByRole('button', { name: 'Log in' }).click();
    await page().getByRole('heading', { level: 2, name: 'Devices' }).waitFor();
    await openTeam();
    await shows('#view p.empty', 'No webhooks yet.');
    assert.deepEqual(await unlabelled(), [], 'controls without a label');
  });

  it('adds a webhook, shows its secret once, delivers an event and a test to it and lists them, at 1280 and 375 px', async () => {
    await rig.atWidths(async width => {
      // A long path, as a real receiver's often is: it must wrap at 375 px.
      const urlPath = `/hooks/devicehub/greenhouse-team/${width}/8f14e45fceea167a5a36dedd4bea2543`;
      const url = s.endpoint + urlPath;
      await openTeam();
      // No event chosen: the form says so, and nothing is added.
      await page().getByLabel('URL').fill(url);
      await button('Add webhook').click();
      await shows('#wh-add', 'Choose at least one event.');
      assert.equal(await page().locator('#wh-rows tr', { hasText: url }).count(), 0);

      await page().getByLabel('Events').selectOption(['device.status', 'rollout.progress']);
      await page().getByLabel('device.offline after (minutes)').fill('5');
      await button('Add webhook').click();
      await shows('#status', 'Webhook added.');
      await shows('#wh-secret', 'Copy the secret now: it is shown only once.');
      const secret = await page().getByLabel('Secret of ' + url).inputValue();
      assert.match(secret, /^[A-Za-z0-9]{40}$/);
      const row = page().locator('#wh-rows tr', { hasText: url });
      await row.waitFor();
      assert.equal(await row.locator('td[data-label="Events"]').textContent(), 'device.status, rollout.progress');
      await row.locator('td[data-label="State"] .badge', { hasText: 'enabled' }).waitFor();

      // The device changes state: the receiver gets device.status, signed.
      rig.publish(`devices/${s.uid}/status`, width === 1280 ? 'online' : 'offline', '-r');
      await delivered(urlPath, 'device.status', secret);
      // The test button: a ping, and both deliveries listed with their status.
      let answerPing;
      s.holdPings = new Promise(resolve => { answerPing = resolve; });
      await button('Send a test delivery to ' + url).click();
      await shows('#status', 'Ping queued.');
      await delivered(urlPath, 'ping', secret);
      const deliveries = page().locator('#wh-deliveries');
      await shows('#wh-deliveries h4', 'Recent deliveries to ' + url);
      await deliveries.locator('td[data-label="Event"]', { hasText: 'device.status' }).waitFor();
      assert.equal(await deliveries.locator('tbody tr').count(), 1, 'the ping listed before it was answered');
      answerPing();
      await deliveries.locator('tbody tr').nth(1).waitFor();
      const listed = await deliveries.locator('tbody tr').evaluateAll(trs => trs.map(tr =>
        ['Event', 'Attempt', 'Result'].map(c => tr.querySelector(`td[data-label="${c}"]`).textContent)));
      assert.deepEqual(listed, [['ping', '1', 'delivered 200'], ['device.status', '1', 'delivered 200']]);
      await row.locator('td[data-label="Last delivery"]', { hasText: /\S/ }).waitFor();

      const { bottom } = await boxOf(page(), '#wh-add');
      // The status area floats at the screen's foot, not the page's: it is
      // left out of the picture of the whole page.
      await page().locator('#status').evaluate(el => { el.style.visibility = 'hidden'; });
      await page().screenshot({ path: path.join(root, 'docs', `webhooks-${width}.png`), fullPage: true,
        clip: { x: 0, y: 0, width, height: Math.ceil(bottom + 16) } });
      await page().locator('#status').evaluate(el => { el.style.visibility = ''; });
      assert.deepEqual(await offScreen(), [], `off the screen at ${width} px`);
      assert.ok(await rig.overflow() <= 0, `wider than ${width} px`);

      // Shown once: back on the page, the secret is gone; the webhook stays.
      await page().evaluate(() => { location.hash = '#/devices'; });
      await page().getByRole('heading', { level: 2, name: 'Devices' }).waitFor();
      await openTeam();
      await row.waitFor();
      assert.equal(await page().locator('#wh-secret').textContent(), '');
      assert.ok(!(await page().content()).includes(secret), 'the secret is on the page again');
    });
  });

  it('disables a webhook (its test button with it), enables it again and deletes it, at 1280 and 375 px', async () => {
    await rig.atWidths(async width => {
      const url = `${s.endpoint}/hooks/devicehub/greenhouse-team/${width}/8f14e45fceea167a5a36dedd4bea2543`;
      const row = page().locator('#wh-rows tr', { hasText: url });
      await button('Disable ' + url).click();
      await shows('#status', `Disabled ${url}.`);
      await row.locator('td[data-label="State"] .badge', { hasText: 'disabled' }).waitFor();
      assert.ok(await button('Send a test delivery to ' + url).isDisabled());
      await button('Enable ' + url).click();
      await row.locator('td[data-label="State"] .badge', { hasText: 'enabled' }).waitFor();
      assert.ok(await button('Send a test delivery to ' + url).isEnabled());
      assert.deepEqual(await offScreen(), [], `off the screen at ${width} px`);
      assert.ok(await rig.overflow() <= 0, `wider than ${width} px`);

      rig.answerDialogs(false, true);
      await button('Delete the webhook to ' + url).click();
      await waitFor('the question', () => rig.dialogs.length === 1);
      assert.equal(await row.count(), 1, 'deleted though the question was answered no');
      await button('Delete the webhook to ' + url).click();
      await shows('#status', 'Webhook deleted.');
      await row.waitFor({ state: 'detached' });
      assert.deepEqual(rig.dialogs.splice(0), Array(2).fill(`Delete the webhook to ${url}? Its queued events and deliveries go with it.`));
      const left = await rig.http('GET', '/v1/user/team/webhooks', s.token);
      assert.ok(!left.body.data.some(w => w.url === url), 'the webhook is still in the API');
    });
    await shows('#view p.empty', 'No webhooks yet.');
  });
});
