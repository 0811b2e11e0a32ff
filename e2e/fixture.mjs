// What a browser test of the dashboard needs around it: the devicehub
// binary built from this tree, Mosquitto with its dynamic security plugin
// (devicehub makes each added device's broker login), devicehub serving,
// and Debian's Chromium driven by playwright-core, with every console
// error, page error, request to another origin and unexpected dialog
// collected for the test to check after each step.

import assert from 'node:assert/strict';
import { execFileSync, spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import fs from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';

export const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const CHROMIUM = process.env.CHROMIUM || '/usr/bin/chromium';

export const sleep = ms => new Promise(resolve => setTimeout(resolve, ms));

export async function waitFor(what, check, timeout = 30000) {
  const deadline = Date.now() + timeout;
  for (;;) {
    try {
      if (await check()) return;
    } catch { /* not yet */ }
    if (Date.now() > deadline) throw new Error('timed out waiting for ' + what);
    await sleep(200);
  }
}

// boxOf is the box of the element the CSS selector finds on page, as
// locator.boundingBox() gives it (x and y on the screen), with bottom, its
// lower edge on the page (for a screenshot's clip), once it is there with
// a size. The element is found and measured in one evaluation: a redraw
// (the dashboard's charts are redrawn each minute, on a device's news and
// on a resize) between boundingBox() finding it and measuring it answers
// null.
export async function boxOf(page, selector, timeout = 15000) {
  const found = await page.waitForFunction(sel => {
    const r = document.querySelector(sel)?.getBoundingClientRect();
    return r && r.width > 0 && r.height > 0 && { x: r.x, y: r.y, width: r.width, height: r.height, bottom: r.bottom + window.scrollY };
  }, selector, { timeout });
  return found.jsonValue();
}

export function freePort() {
  return new Promise((resolve, reject) => {
    const srv = net.createServer().listen(0, '127.0.0.1', () => {
      const { port } = srv.address();
      srv.close(() => resolve(port));
    });
    srv.on('error', reject);
  });
}

const canConnect = port => new Promise(resolve => {
  const c = net.connect(port, '127.0.0.1', () => { c.end(); resolve(true); });
  c.on('error', () => resolve(false));
});

// espImage is a small firmware file that looks like an ESP application
// image (first byte 0xE9), as docs/ota.md says for esp platforms.
export function espImage(size) {
  const b = randomBytes(size);
  b[0] = 0xe9;
  return b;
}

// Rig is one test's world: a directory, the processes it started, the
// browser, and what went wrong on its pages.
export class Rig {
  constructor() {
    this.dir = fs.mkdtempSync(path.join(os.tmpdir(), 'devicehub-e2e-'));
    this.bin = path.join(this.dir, 'devicehub');
    this.data = path.join(this.dir, 'data');
    this.children = [];
    this.problems = [];
    this.expected = new Set(); // HTTP statuses a step provokes on purpose
    process.on('exit', () => { for (const c of this.children) c.kill('SIGKILL'); });
  }

  build() {
    execFileSync('go', ['build', '-o', this.bin, '.'], { cwd: root, stdio: 'inherit' });
  }

  // cli runs `devicehub command subcommand -data … flags…` and returns its output.
  cli(command, subcommand, ...flags) {
    return execFileSync(this.bin, [command, subcommand, '-data', this.data, ...flags]).toString().trim();
  }

  start(name, bin, args, env = {}) {
    const log = fs.openSync(path.join(this.dir, name + '.log'), 'a');
    const child = spawn(bin, args, { stdio: ['ignore', log, log], env: { ...process.env, ...env } });
    child.exited = new Promise(resolve => child.on('exit', code => resolve(code)));
    this.children.push(child);
    return child;
  }

  async stop(child) {
    if (child.exitCode === null && child.signalCode === null) child.kill('SIGTERM');
    await Promise.race([child.exited, sleep(10000).then(() => child.kill('SIGKILL'))]);
  }

  // startBroker starts Mosquitto with its dynamic security plugin, set up
  // as the README says: devicehub's login has the plugin's admin role.
  // Anonymous clients (the test's own mosquitto_pub, standing in for a
  // device) may use the device topics.
  async startBroker() {
    this.brokerPort = await freePort();
    const plugin = fs.readdirSync('/usr/lib').map(d => path.join('/usr/lib', d, 'mosquitto_dynamic_security.so')).find(f => fs.existsSync(f));
    const file = path.join(this.dir, 'dynamic-security.json');
    const admin = randomBytes(12).toString('hex');
    execFileSync('mosquitto_ctrl', ['dynsec', 'init', file, 'admin', admin]);
    const conf = path.join(this.dir, 'mosquitto.conf');
    fs.writeFileSync(conf, `listener ${this.brokerPort} 127.0.0.1\nallow_anonymous true\nuser ${os.userInfo().username}\n` +
      `plugin ${plugin}\nplugin_opt_config_file ${file}\n`);
    const binary = ['/usr/sbin/mosquitto', '/usr/bin/mosquitto'].find(p => fs.existsSync(p)) || 'mosquitto';
    this.broker = this.start('mosquitto', binary, ['-c', conf]);
    await waitFor('mosquitto', () => canConnect(this.brokerPort));
    const ctrl = this.ctrl = (...args) => execFileSync('mosquitto_ctrl', ['-p', String(this.brokerPort), '-u', 'admin', '-P', admin, 'dynsec', ...args]);
    this.mqttPassword = randomBytes(12).toString('hex');
    ctrl('createClient', 'devicehub', '-p', this.mqttPassword);
    ctrl('addClientRole', 'devicehub', 'admin');
    ctrl('createRole', 'devicehub-commands');
    ctrl('addRoleACL', 'devicehub-commands', 'publishClientSend', 'devices/+/cmd/#', 'allow');
    ctrl('addClientRole', 'devicehub', 'devicehub-commands');
    ctrl('createRole', 'open-devices');
    ctrl('addRoleACL', 'open-devices', 'publishClientSend', 'devices/#', 'allow');
    ctrl('addRoleACL', 'open-devices', 'subscribePattern', 'devices/#', 'allow');
    ctrl('createGroup', 'anonymous-devices');
    ctrl('addGroupRole', 'anonymous-devices', 'open-devices');
    ctrl('setAnonymousGroup', 'anonymous-devices');
  }

  // publish sends message on topic as an anonymous client, as a device would.
  publish(topic, message, ...flags) {
    execFileSync('mosquitto_pub', ['-h', '127.0.0.1', '-p', String(this.brokerPort), '-q', '1', ...flags, '-t', topic,
      '-m', typeof message === 'string' ? message : JSON.stringify(message)]);
  }

  // startServer starts devicehub, managing the broker's logins.
  async startServer(...flags) {
    this.origin ||= 'http://127.0.0.1:' + await freePort();
    this.server = this.start('serve', this.bin, ['serve', '-addr', new URL(this.origin).host, '-data', this.data, '-public-url', this.origin,
      '-mqtt', 'tcp://127.0.0.1:' + this.brokerPort, '-mqtt-user', 'devicehub', '-mqtt-dynsec', ...flags],
    { DEVICEHUB_MQTT_PASSWORD: this.mqttPassword });
    await waitFor('the server connected to the broker', async () => (await this.http('GET', '/healthz')).body.mqtt === 'connected');
  }

  // simulate gives each of uids a broker login (one password for all:
  // `devicehub simulate` logs each device in with its uid and that
  // password) and runs `devicehub simulate` on the owner's devices.
  async simulate(owner, uids, ...flags) {
    const password = randomBytes(12).toString('hex');
    this.ctrl('createRole', 'simulated-devices');
    this.ctrl('addRoleACL', 'simulated-devices', 'publishClientSend', 'devices/#', 'allow');
    this.ctrl('addRoleACL', 'simulated-devices', 'subscribePattern', 'devices/#', 'allow');
    for (const uid of uids) {
      this.ctrl('createClient', uid, '-p', password);
      this.ctrl('addClientRole', uid, 'simulated-devices');
    }
    this.fleet = this.start('simulate', this.bin, ['simulate', '-data', this.data, '-mqtt', 'tcp://127.0.0.1:' + this.brokerPort,
      '-owner', owner, '-n', String(uids.length), ...flags], { DEVICEHUB_MQTT_PASSWORD: password });
    const code = await Promise.race([this.fleet.exited, sleep(2000).then(() => 'running')]);
    assert.equal(code, 'running', 'devicehub simulate exited; see ' + path.join(this.dir, 'simulate.log'));
  }

  async http(method, urlPath, token, body) {
    const headers = { Accept: 'application/json' };
    if (token) headers.Authorization = 'Bearer ' + token;
    if (body && !(body instanceof FormData)) headers['Content-Type'] = 'application/json';
    const res = await fetch(this.origin + urlPath, { method, headers, body: body instanceof FormData ? body : body && JSON.stringify(body) });
    return { status: res.status, body: await res.json() };
  }

  async openBrowser() {
    this.browser = await chromium.launch({
      executablePath: CHROMIUM,
      headless: true,
      args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
        '--disable-component-update', '--disable-sync'],
    });
    const context = await this.browser.newContext({ viewport: { width: 1280, height: 900 }, hasTouch: true });
    await context.route('**/*', route => {
      const url = route.request().url();
      if (new URL(url).origin === this.origin) return route.continue();
      this.problems.push('request to another origin: ' + url);
      return route.abort();
    });
    const page = this.page = await context.newPage();
    page.on('pageerror', err => this.problems.push('page error: ' + err.message));
    page.on('console', msg => {
      if (msg.type() !== 'error') return;
      const text = msg.text();
      // Chromium logs every 4xx/5xx answer; those a step provokes on
      // purpose (expectFailure) are not errors of the page.
      const status = Number((text.match(/^Failed to load resource: the server responded with a status of (\d+)/) || [])[1]);
      if (!this.expected.has(status)) this.problems.push(text);
    });
    page.on('dialog', dialog => {
      this.dialogs.push(dialog.message());
      return this.answers.length ? (this.answers.shift() ? dialog.accept() : dialog.dismiss())
        : (this.problems.push('unexpected dialog: ' + dialog.message()), dialog.dismiss());
    });
    this.dialogs = [];
    this.answers = [];
  }

  // answerDialogs queues the answers (true: OK) to the next dialogs.
  answerDialogs(...answers) { this.answers.push(...answers); }

  expectFailure(status) { this.expected.add(status); }

  // checkStep asserts that the step just run left no problem behind.
  checkStep() {
    const problems = this.problems.splice(0);
    const unanswered = this.answers.splice(0);
    this.expected.clear();
    assert.deepEqual(problems, [], 'console errors, page errors, requests to other origins, unexpected dialogs');
    assert.deepEqual(unanswered, [], 'confirmations that never came');
  }

  // atWidths runs check(width) with the page 1280 px wide, then 375 px
  // (a phone), then puts it back to 1280.
  async atWidths(check) {
    for (const [width, height] of [[1280, 900], [375, 812]]) {
      await this.page.setViewportSize({ width, height });
      await check(width);
    }
    await this.page.setViewportSize({ width: 1280, height: 900 });
  }

  // overflow is how many px the page is wider than the screen.
  overflow() {
    return this.page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
  }

  async close() {
    if (this.browser) await this.browser.close();
    for (const c of [this.fleet, this.server, this.broker].filter(Boolean)) await this.stop(c);
    if (process.env.E2E_KEEP) console.log('logs and data kept in', this.dir);
    else fs.rmSync(this.dir, { recursive: true, force: true });
  }
}
