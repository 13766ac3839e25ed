// The out-of-the-box scripts: `./scripts/run.sh` with no model serves the built-in random-weights model and answers a
// chat completion; `./scripts/download-model.sh` against a local stand-in for Hugging Face (listing API with SHA-256,
// resolve URLs with Range support) resumes an interrupted download, rejects a corrupt file, checks free space first
// and links the result.
// Takes --root REPO --build BUILD_DIR --work DIR.
import assert from "node:assert/strict";
import { spawn, spawnSync } from "node:child_process";
import { createHash, randomBytes } from "node:crypto";
import { existsSync, mkdirSync, readFileSync, readlinkSync, rmSync, statSync } from "node:fs";
import { createServer } from "node:http";
import { createServer as createNetServer } from "node:net";
import { join } from "node:path";
import { test } from "node:test";

const opts = {};
for (let i = 2; i < process.argv.length; i += 2) opts[process.argv[i].replace(/^--/, "")] = process.argv[i + 1];
mkdirSync(opts.work, { recursive: true });
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function freePort() {
  const s = createNetServer();
  await new Promise((r) => s.listen(0, "127.0.0.1", r));
  const port = s.address().port;
  await new Promise((r) => s.close(r));
  return port;
}

test("./scripts/run.sh with no model serves the random-weights default and answers a chat completion", async () => {
  const port = await freePort();
  const kv = join(opts.work, "run-kv");
  rmSync(kv, { recursive: true, force: true });
  const p = spawn(join(opts.root, "scripts/run.sh"), ["--port", String(port)], {
    env: { ...process.env, DSV4_BUILD_DIR: opts.build, DSV4_NO_BUILD: "1", DSV4_KV_DIR: kv },
    stdio: ["ignore", "pipe", "pipe"],
  });
  let out = "";
  let err = "";
  p.stdout.on("data", (d) => (out += d));
  p.stderr.on("data", (d) => (err += d));
  const exit = new Promise((resolve) => p.on("exit", (code) => resolve(code)));
  const t0 = Date.now();
  while (!out.includes("Ctrl+C stops the server")) {
    assert.ok(Date.now() - t0 < 60000, `run.sh did not come up:\n${out}\n${err}`);
    await sleep(100);
  }
  const base = `http://127.0.0.1:${port}`;
  assert.match(out, /RANDOM WEIGHTS/);
  assert.ok(out.includes(`curl ${base}/v1/chat/completions`));
  assert.ok(out.includes(`OpenAI-compatible base URL:     ${base}/v1`));
  assert.ok(out.includes(`ANTHROPIC_BASE_URL=${base}`));
  assert.ok(out.includes('wire_api = "responses"'));
  assert.ok(out.includes("@ai-sdk/openai-compatible"));

  const r = await fetch(`${base}/v1/chat/completions`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ messages: [{ role: "user", content: "Hello!" }], max_tokens: 4 }),
  });
  assert.equal(r.status, 200);
  const body = await r.json();
  assert.equal(body.usage.completion_tokens, 4);
  assert.equal(body.model, "dsv4-random-weights");
  const props = await (await fetch(`${base}/props`)).json();
  assert.equal(props.random_weights, true);
  assert.equal(props.context_length, 32768);
  assert.match(props.kv_disk_cache.dir, /run-kv/);

  p.kill("SIGINT");  // what Ctrl+C sends: run.sh stops the server cleanly
  assert.equal(await exit, 0, err);
  assert.match(err, /stopped/);
});

// --- download-model.sh -----------------------------------------------------------------------------------------------

const kFile = "DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2-imatrix.gguf";
const kRepo = "antirez/deepseek-v4-gguf";

// A stand-in for the hub: GET /api/models/REPO/tree/main lists the file with its SHA-256; GET /REPO/resolve/main/FILE
// serves it, honouring Range. `cutAfter` makes the first full-body response stop early (a dropped connection);
// `corrupt` serves different bytes than the listing's hash; `size` overrides the listed size.
async function fakeHub(content, { cutAfter = 0, corrupt = false, size = null } = {}) {
  const sha = createHash("sha256").update(content).digest("hex");
  const log = [];
  let cut = false;
  const server = createServer((req, res) => {
    log.push(`${req.method} ${req.url} ${req.headers.range ?? ""}`);
    if (req.url.startsWith(`/api/models/${kRepo}/tree/main`)) {
      res.setHeader("content-type", "application/json");
      res.end(JSON.stringify([
        { type: "file", path: "README.md", size: 100, oid: "x" },
        { type: "file", path: kFile, size: size ?? content.length, lfs: { oid: sha, size: size ?? content.length } },
        { type: "file", path: "DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf", size: 10, lfs: { oid: "y", size: 10 } },
      ]));
      return;
    }
    if (req.url !== `/${kRepo}/resolve/main/${kFile}`) {
      res.statusCode = 404;
      res.end();
      return;
    }
    const body = corrupt ? Buffer.from(content).fill(7, 1000, 1010) : content;
    const m = /bytes=(\d+)-/.exec(req.headers.range ?? "");
    const start = m ? Number(m[1]) : 0;
    res.statusCode = m ? 206 : 200;
    if (m) res.setHeader("content-range", `bytes ${start}-${body.length - 1}/${body.length}`);
    res.setHeader("content-length", body.length - start);
    if (cutAfter && !cut && start === 0) {
      cut = true;
      res.write(body.subarray(0, cutAfter), () => setTimeout(() => res.socket.destroy(), 50));
      return;
    }
    res.end(body.subarray(start));
  });
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  return { server, log, sha, endpoint: `http://127.0.0.1:${server.address().port}` };
}

// Asynchronous: the fake hub runs on this process's event loop.
function downloadAsync(hub, dir, env = {}) {
  return new Promise((resolve) => {
    const p = spawn(join(opts.root, "scripts/download-model.sh"), ["q2", "--dir", dir], {
      env: { ...process.env, DSV4_HF_ENDPOINT: hub.endpoint, HF_TOKEN: "", HOME: opts.work, ...env },
    });
    let out = "";
    p.stdout.on("data", (d) => (out += d));
    p.stderr.on("data", (d) => (out += d));
    p.on("exit", (code) => resolve({ code, out }));
  });
}

test("download-model.sh: an interrupted download resumes; the file is verified and linked", async () => {
  const content = randomBytes(3 << 20);
  const hub = await fakeHub(content, { cutAfter: 1 << 20 });
  const dir = join(opts.work, "models-resume");
  rmSync(dir, { recursive: true, force: true });
  try {
    // One attempt: the dropped connection leaves a partial file and a failure.
    const first = await downloadAsync(hub, dir, { DSV4_DOWNLOAD_ATTEMPTS: "1" });
    assert.notEqual(first.code, 0, first.out);
    assert.match(first.out, /run the same command again to resume/);
    const part = join(dir, `${kFile}.part`);
    assert.ok(existsSync(part));
    const partial = statSync(part).size;
    assert.ok(partial > 0 && partial < content.length);
    // The same command again continues from there.
    const second = await downloadAsync(hub, dir);
    assert.equal(second.code, 0, second.out);
    assert.ok(hub.log.some((l) => l.endsWith(`bytes=${partial}-`)), hub.log.join("\n"));
    assert.ok(readFileSync(join(dir, kFile)).equals(content));
    assert.ok(!existsSync(part));
    assert.equal(readlinkSync(join(dir, "deepseek-v4-flash.gguf")), kFile);
    assert.equal(readFileSync(join(dir, `${kFile}.sha256`), "utf8").trim(), hub.sha);
    // Once done, a rerun downloads nothing.
    const before = hub.log.length;
    const third = await downloadAsync(hub, dir);
    assert.equal(third.code, 0);
    assert.match(third.out, /already downloaded/);
    assert.ok(hub.log.slice(before).every((l) => l.includes("/api/models/")));
  } finally {
    hub.server.close();
  }
});

test("download-model.sh: retries within one run resume too", async () => {
  const content = randomBytes(2 << 20);
  const hub = await fakeHub(content, { cutAfter: 700000 });
  const dir = join(opts.work, "models-retry");
  rmSync(dir, { recursive: true, force: true });
  try {
    const r = await downloadAsync(hub, dir);
    assert.equal(r.code, 0, r.out);
    assert.ok(readFileSync(join(dir, kFile)).equals(content));
    assert.ok(hub.log.some((l) => /bytes=\d+-$/.test(l)));
  } finally {
    hub.server.close();
  }
});

test("download-model.sh: a corrupt file is rejected, deleted and not linked", async () => {
  const content = randomBytes(1 << 20);
  const hub = await fakeHub(content, { corrupt: true });
  const dir = join(opts.work, "models-corrupt");
  rmSync(dir, { recursive: true, force: true });
  try {
    const r = await downloadAsync(hub, dir);
    assert.notEqual(r.code, 0);
    assert.match(r.out, /is corrupt: SHA-256/);
    assert.ok(!existsSync(join(dir, kFile)));
    assert.ok(!existsSync(join(dir, `${kFile}.part`)));
    assert.ok(!existsSync(join(dir, "deepseek-v4-flash.gguf")));
  } finally {
    hub.server.close();
  }
});

test("download-model.sh: not enough free space is refused before downloading", async () => {
  const hub = await fakeHub(randomBytes(1000), { size: 2 ** 52 });
  const dir = join(opts.work, "models-space");
  rmSync(dir, { recursive: true, force: true });
  try {
    const r = await downloadAsync(hub, dir);
    assert.notEqual(r.code, 0);
    assert.match(r.out, /not enough space/);
    assert.ok(!hub.log.some((l) => l.includes("/resolve/")));
  } finally {
    hub.server.close();
  }
});

test("download-model.sh: unknown targets and options fail with usage", () => {
  const r = spawnSync(join(opts.root, "scripts/download-model.sh"), ["q7"], { encoding: "utf8" });
  assert.notEqual(r.status, 0);
  assert.match(r.stderr, /unknown target 'q7'/);
  assert.match(r.stderr, /Targets/);
});
