// The `dsv4` command line with the tiny model: one-shot answers, the interactive chat (piped lines, commands, prefix
// reuse across turns), Ctrl+C stopping a reply but not the program, and the --dump-logits contract.
// Takes --dsv4 BIN --model GGUF --work DIR.
import assert from "node:assert/strict";
import { spawn, spawnSync } from "node:child_process";
import { mkdirSync, statSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";

const opts = {};
for (let i = 2; i < process.argv.length; i += 2) opts[process.argv[i].replace(/^--/, "")] = process.argv[i + 1];
mkdirSync(opts.work, { recursive: true });
const base = ["-m", opts.model, "-t", "2"];

function run(args, input) {
  const r = spawnSync(opts.dsv4, [...base, "-c", "2048", ...args], { input, encoding: "utf8", timeout: 60000 });
  return { code: r.status, out: r.stdout, err: r.stderr };
}

test("one-shot: the answer on stdout, speeds on stderr, seeds reproduce", () => {
  const a = run(["-p", "Hello", "-n", "6", "--seed", "3", "--nothink"]);
  assert.equal(a.code, 0, a.err);
  assert.ok(a.out.trim().length > 0);
  assert.match(a.err, /prefill: \d+ tokens \(0 reused\) in [\d.]+ s, [\d.]+ t\/s; /);
  assert.match(a.err, /decode: 6 tokens in [\d.]+ s, [\d.]+ t\/s/);
  const b = run(["-p", "Hello", "-n", "6", "--seed", "3", "--nothink"]);
  assert.equal(b.out, a.out);
  const file = join(opts.work, "prompt.txt");
  writeFileSync(file, "Hello");
  const c = run(["--prompt-file", file, "-n", "6", "--seed", "3", "--nothink"]);
  assert.equal(c.out, a.out);
  // Thinking (the default) shows the reasoning on stderr only.
  const d = run(["-p", "Hello", "-n", "4", "--seed", "3"]);
  assert.equal(d.code, 0);
  assert.match(d.err, /\[thinking\]/);
});

test("interactive: turns reuse the conversation's KV; commands", () => {
  const file = join(opts.work, "question.txt");
  writeFileSync(file, "A question from a file.");
  const lines = ["Hello there", "Second question", "/think", `/read ${file}`, "/ctx 1024", "Fourth", "/nope", "/clear",
                 "Fifth", "/quit", "never sent"];
  // A fixed seed keeps the run reproducible. (Replies that end inside a UTF-8 character, 3 of the first 40 seeds,
  // reuse the session too since the scheduler compares the text as it streamed: scheduler_test covers that case.)
  const r = run(["-n", "4", "--nothink", "--seed", "1"], lines.join("\n") + "\n");
  assert.equal(r.code, 0, r.err);
  const turns = [...r.err.matchAll(/prefill: (\d+) tokens \((\d+) reused\)/g)].map((m) => [Number(m[1]), Number(m[2])]);
  assert.equal(turns.length, 5, r.err);
  assert.equal(turns[0][1], 0);
  assert.ok(turns[1][1] > turns[0][0], "the second turn extends the first exchange");
  assert.ok(turns[2][1] > turns[1][0], "the /read turn too");
  assert.equal(turns[3][1], 0, "/ctx makes a new context");
  assert.ok(turns[4][0] < turns[3][0], "/clear starts over");
  assert.match(r.err, /mode: thinking/);
  assert.match(r.err, /unknown command \/nope/);
  assert.match(r.err, /RANDOM WEIGHTS/);
});

test("Ctrl+C stops the reply, not the program", async () => {
  const p = spawn(opts.dsv4, [...base, "-c", "8192", "--nothink"], { stdio: ["pipe", "pipe", "pipe"] });
  let out = "";
  let err = "";
  p.stdout.on("data", (d) => (out += d));
  p.stderr.on("data", (d) => (err += d));
  const exit = new Promise((resolve) => p.on("exit", (code) => resolve(code)));
  p.stdin.write("Write forever\n");
  const started = Date.now();
  while (out.length < 20) {
    assert.ok(Date.now() - started < 20000, `no reply:\n${err}`);
    await new Promise((r) => setTimeout(r, 20));
  }
  p.kill("SIGINT");
  const t0 = Date.now();
  while (!/\[stopped\]/.test(err)) {
    assert.ok(Date.now() - t0 < 5000, `no stop after SIGINT:\n${err}`);
    await new Promise((r) => setTimeout(r, 20));
  }
  const m = err.match(/decode: (\d+) tokens/);
  assert.ok(Number(m[1]) < 8000, "stopped long before the context filled");
  p.stdin.write("/quit\n");
  assert.equal(await exit, 0, err);
});

test("--tokens-file / --dump-logits still writes every position's logits", () => {
  const tokens = join(opts.work, "tokens.json");
  const logits = join(opts.work, "logits.f32");
  writeFileSync(tokens, JSON.stringify([0, 100, 200, 300, 400]));
  const args = ["-m", opts.model, "--tokens-file", tokens, "--dump-logits", logits];
  const r = spawnSync(opts.dsv4, args, { encoding: "utf8" });
  assert.equal(r.status, 0, r.stderr);
  assert.equal(statSync(logits).size, 5 * 129280 * 4);
});

test("--plan prints the memory plan; a context that cannot fit is refused before loading", () => {
  const ok = spawnSync(opts.dsv4, ["-m", opts.model, "--plan", "--ctx", "8192"], { encoding: "utf8" });
  assert.equal(ok.status, 0, ok.stderr);
  assert.match(ok.stdout, /kv state +[\d.]+ GiB +\(1 session\(s\) of 8192 tokens: raw [\d.]+, compressed/);
  assert.match(ok.stdout, /fits +yes; largest context that fits: \d+/);
  const huge = ["-m", opts.model, "--ctx", "1099511627776"];
  const no = spawnSync(opts.dsv4, [...huge, "--plan"], { encoding: "utf8" });
  assert.equal(no.status, 1, no.stderr);
  assert.match(no.stdout, /fits +NO/);
  const chat = spawnSync(opts.dsv4, [...huge, "-p", "Hello", "-n", "2"], { encoding: "utf8", timeout: 60000 });
  assert.equal(chat.status, 1);
  assert.match(chat.stderr, /a context of 1099511627776 tokens .* the largest context that fits is \d+ \(--ctx \d+\)/);
});
