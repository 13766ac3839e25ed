// Shared helpers of the server tests: start dsv4-server(-test) on a free port of 127.0.0.1 with the tiny
// real-vocabulary model, the pinned npm clients from tests/node, scripted generations, /metrics and /proc readings.
//
// Every test file takes: --server BIN (dsv4-server-test) --model GGUF --work DIR [--prod-server BIN].
import { spawn } from "node:child_process";
import { existsSync, mkdirSync, readFileSync, rmSync } from "node:fs";
import { createRequire } from "node:module";
import { join } from "node:path";

const nodeDir = new URL("../node/", import.meta.url);
if (!existsSync(new URL("node_modules/openai/package.json", nodeDir)) ||
    !existsSync(new URL("node_modules/@anthropic-ai/sdk/package.json", nodeDir))) {
  console.error("tests/node/node_modules lacks the npm clients: run `npm ci --prefix tests/node` in the repository");
  process.exit(1);
}
const require = createRequire(new URL("package.json", nodeDir));
const openaiModule = require("openai");
const anthropicModule = require("@anthropic-ai/sdk");
export const OpenAI = openaiModule.OpenAI ?? openaiModule.default;
export const Anthropic = anthropicModule.Anthropic ?? anthropicModule.default;

export const opts = (() => {
  const o = {};
  const argv = process.argv.slice(2);
  for (let i = 0; i < argv.length; i += 2) o[argv[i].replace(/^--/, "")] = argv[i + 1];
  for (const k of ["server", "model", "work"]) {
    if (!o[k]) {
      console.error(`missing --${k}`);
      process.exit(2);
    }
  }
  mkdirSync(o.work, { recursive: true });
  return o;
})();

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// A fresh folder under the work dir, named for this process too: two runs of one test file on the same build tree
// (a `ctest -R` beside a full run) would otherwise share a KV cache folder, and one run's snapshots, whose names
// hash their text, would be found by the other's servers. The folders of a run that passes are removed at exit.
const workDirs = [];
process.on("exit", (code) => {
  if (code === 0) for (const d of workDirs) rmSync(d, { recursive: true, force: true });
});
export function workDir(name) {
  const dir = join(opts.work, `${name}.${process.pid}`);
  rmSync(dir, { recursive: true, force: true });
  mkdirSync(dir, { recursive: true });
  workDirs.push(dir);
  return dir;
}

// Starts a server; resolves once /health answers 200 (or as soon as it listens, with waitReady: false).
export async function startServer(extra = [], { bin = opts.server, waitReady = true, ctx = "4096" } = {}) {
  const args = ["-m", opts.model, "--port", "0", "-c", ctx, "--threads", "2", ...extra];
  const proc = spawn(bin, args, { stdio: ["ignore", "ignore", "pipe"] });
  let log = "";
  let exited = null;
  const exitPromise = new Promise((resolve) => proc.on("exit", (code, signal) => resolve((exited = { code, signal }))));
  const port = await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`server did not start:\n${log}`)), 30000);
    proc.stderr.on("data", (d) => {
      log += d.toString();
      const m = log.match(/listening on http:\/\/127\.0\.0\.1:(\d+)/);
      if (m) {
        clearTimeout(timer);
        resolve(Number(m[1]));
      }
    });
    exitPromise.then(() => {
      clearTimeout(timer);
      reject(new Error(`server exited before listening:\n${log}`));
    });
  });
  const base = `http://127.0.0.1:${port}`;
  const server = {
    proc,
    pid: proc.pid,
    port,
    base,
    log: () => log,
    exited: () => exited,
    // Sends a signal and resolves with the exit status.
    async stop(signal = "SIGTERM") {
      if (!exited) proc.kill(signal);
      return exitPromise;
    },
    wait: () => exitPromise,
  };
  if (waitReady) {
    const t0 = Date.now();
    for (;;) {
      const r = await fetch(`${base}/health`).catch(() => null);
      if (r && r.status === 200) break;
      if (Date.now() - t0 > 30000) throw new Error(`server not ready:\n${log}`);
      await sleep(50);
    }
  }
  return server;
}

export function openai(server, extra = {}) {
  return new OpenAI({ baseURL: `${server.base}/v1`, apiKey: "unused", maxRetries: 0, ...extra });
}
export function anthropic(server, extra = {}) {
  return new Anthropic({ baseURL: server.base, apiKey: "unused", maxRetries: 0, ...extra });
}

// dsv4-server-test generates exactly this text (tokenized with special tokens recognised) instead of sampling.
export function script(text, delayMs) {
  const headers = { "x-dsv4-test-script": Buffer.from(text, "utf8").toString("base64") };
  if (delayMs) headers["x-dsv4-test-delay-ms"] = String(delayMs);
  return { headers };
}

export const DSML = "｜DSML｜";
export const EOS = "<｜end▁of▁sentence｜>";
// The canonical DSML block for one call.
export function dsmlCall(name, params) {
  let s = `\n\n<${DSML}tool_calls>\n<${DSML}invoke name="${name}">\n`;
  for (const [k, v] of Object.entries(params)) {
    const isString = typeof v === "string";
    s += `<${DSML}parameter name="${k}" string="${isString}">${isString ? v : JSON.stringify(v)}</${DSML}parameter>\n`;
  }
  return s + `</${DSML}invoke>\n</${DSML}tool_calls>`;
}

export async function postJson(server, path, body, headers = {}) {
  const r = await fetch(`${server.base}${path}`, {
    method: "POST",
    headers: { "content-type": "application/json", ...headers },
    body: typeof body === "string" ? body : JSON.stringify(body),
  });
  const text = await r.text();
  let json = null;
  try {
    json = JSON.parse(text);
  } catch {}
  return { status: r.status, headers: r.headers, text, json };
}

// Prometheus text → { "name{labels}": value }.
export async function metrics(server) {
  const text = await (await fetch(`${server.base}/metrics`)).text();
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const i = line.lastIndexOf(" ");
    out[line.slice(0, i)] = Number(line.slice(i + 1));
  }
  return out;
}

// Resident memory (bytes) and thread count of a process, from /proc.
export function procStatus(pid) {
  const text = readFileSync(`/proc/${pid}/status`, "utf8");
  const field = (k) => Number(text.match(new RegExp(`^${k}:\\s+(\\d+)`, "m"))[1]);
  return { rss: field("VmRSS") * 1024, threads: field("Threads") };
}

// Reads an SSE response body into events [{event, data}] (data parsed when JSON).
export async function readSse(response, { onEvent, limit } = {}) {
  const events = [];
  const decoder = new TextDecoder();
  let buf = "";
  let comments = 0;
  for await (const chunk of response.body) {
    buf += decoder.decode(chunk, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      let event = null;
      let data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith(":")) comments++;
        else if (line.startsWith("event: ")) event = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      if (!data) continue;
      let parsed = data;
      try {
        parsed = JSON.parse(data);
      } catch {}
      events.push({ event, data: parsed });
      if (onEvent) onEvent(events[events.length - 1]);
      if (limit && events.length >= limit) return { events, comments, truncated: true };
    }
  }
  return { events, comments };
}
