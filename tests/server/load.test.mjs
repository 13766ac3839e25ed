// A bounded load test: 16 concurrent clients send 2 rounds of 120 requests across every API, streamed and not, with
// the real npm clients, after a warm-up round. No request may fail; the server's threads and resident memory must not
// grow with the number of requests served (the second round is compared with the first). Replies are short (the
// point is the server's plumbing, not the model's speed). Prints the numbers and writes them to
// WORK/load-report.json.
import assert from "node:assert/strict";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, test } from "node:test";

import { anthropic, dsmlCall, metrics, openai, opts, procStatus, script, sleep, startServer } from "./lib.mjs";

const kClients = 16;
const kRequests = 120;  // per measured round
const kWarmup = 32;
const kTokens = 2;

let server;
before(async () => {
  server = await startServer(["--http-threads", "64"]);
});
after(async () => {
  assert.equal((await server.stop()).code, 0, server.log());
});

const tool = { type: "function", function: { name: "f", parameters: { type: "object" } } };

// One request of kind i % 8; resolves to {ms, ttft} or throws.
async function one(i, client, aclient) {
  const t0 = performance.now();
  let ttft = null;
  const mark = () => {
    if (ttft === null) ttft = performance.now() - t0;
  };
  const user = [{ role: "user", content: `Question ${i}: ${i} squared?` }];
  switch (i % 8) {
    case 0: {
      const r = await client.chat.completions.create({ model: "x", messages: user, max_tokens: kTokens, think: false });
      assert.equal(r.usage.completion_tokens, kTokens);
      break;
    }
    case 1: {
      const s = await client.chat.completions.create({ model: "x", messages: user, max_tokens: kTokens, stream: true });
      let n = 0;
      for await (const c of s) if (c.choices[0]?.delta?.reasoning_content) mark(), n++;
      assert.ok(n > 0);
      break;
    }
    case 2: {
      const s = anthropic_stream(aclient, user);
      const m = await s.finalMessage();
      assert.equal(m.stop_reason, "max_tokens");
      break;
    }
    case 3: {
      const m = await aclient.messages.create({ model: "c", max_tokens: kTokens, messages: user });
      assert.equal(m.usage.output_tokens, kTokens);
      break;
    }
    case 4: {
      const r = await client.responses.create({ model: "x", input: user[0].content, max_output_tokens: kTokens });
      assert.equal(r.status, "incomplete");
      break;
    }
    case 5: {
      const s = client.responses.stream({ model: "x", input: user[0].content, max_output_tokens: kTokens });
      s.on("event", mark);
      const r = await s.finalResponse();
      assert.ok(r.output.length > 0);
      break;
    }
    case 6: {
      const r = await client.completions.create({ model: "x", prompt: user[0].content, max_tokens: kTokens });
      assert.equal(r.usage.completion_tokens, kTokens);
      break;
    }
    case 7: {
      const s = client.chat.completions.stream(
        { model: "x", messages: user, tools: [tool], stream: true },
        script("</think>" + dsmlCall("f", { q: `${i}` })),
      );
      s.on("chunk", mark);
      const f = await s.finalChatCompletion();
      assert.equal(JSON.parse(f.choices[0].message.tool_calls[0].function.arguments).q, `${i}`);
      break;
    }
  }
  return { kind: i % 8, ms: performance.now() - t0, ttft };
}

function anthropic_stream(aclient, user) {
  return aclient.messages.stream({ model: "c", max_tokens: kTokens, messages: user });
}

async function round(offset, count = kRequests) {
  const client = openai(server, { timeout: 120000 });
  const aclient = anthropic(server, { timeout: 120000 });
  let next = 0;
  const results = [];
  const failures = [];
  const t0 = performance.now();
  await Promise.all(
    Array.from({ length: kClients }, async () => {
      for (;;) {
        const i = next++;
        if (i >= count) return;
        try {
          results.push(await one(offset + i, client, aclient));
        } catch (e) {
          failures.push(`${i}: ${e.message}`);
        }
      }
    }),
  );
  return { results, failures, seconds: (performance.now() - t0) / 1000 };
}

const pct = (xs, p) => {
  const s = [...xs].sort((a, b) => a - b);
  return s.length ? s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))] : null;
};

test(`2 x ${kRequests} requests from ${kClients} clients: no failures, no growth`, { timeout: 600000 }, async () => {
  // Warm up: every worker thread and allocator arena in use once, the model's pages resident.
  await round(100000, kWarmup);
  await sleep(500);
  const base = procStatus(server.pid);
  const m0 = await metrics(server);
  const r1 = await round(0);
  await sleep(500);
  const mid = procStatus(server.pid);
  const m1 = await metrics(server);
  const r2 = await round(1000);
  await sleep(500);
  const end = procStatus(server.pid);
  const m = await metrics(server);
  // Server-side time per generation in each round: where a slower round spent it.
  const per = (a, b, key) => (b[key] - a[key]) / (b.dsv4_generations_total - a.dsv4_generations_total);
  const server_ms = (a, b) => ({
    prefill: 1000 * per(a, b, "dsv4_prefill_seconds_total"),
    decode: 1000 * per(a, b, "dsv4_decode_seconds_total"),
    prompt_tokens: per(a, b, "dsv4_prompt_tokens_total"),
    prefilled_tokens: per(a, b, "dsv4_prefill_tokens_total"),
  });

  const all = [...r1.results, ...r2.results];
  const ms = all.map((r) => r.ms);
  const ttft = all.filter((r) => r.ttft !== null).map((r) => r.ttft);
  const report = {
    clients: kClients,
    requests: 2 * kRequests,
    failures: r1.failures.length + r2.failures.length,
    seconds: [r1.seconds, r2.seconds],
    requests_per_second: (2 * kRequests) / (r1.seconds + r2.seconds),
    latency_ms: { p50: pct(ms, 50), p90: pct(ms, 90), p99: pct(ms, 99), max: pct(ms, 100) },
    ttft_ms: { p50: pct(ttft, 50), p90: pct(ttft, 90), max: pct(ttft, 100) },
    rss_mib: { before: base.rss / 2 ** 20, after_round1: mid.rss / 2 ** 20, after_round2: end.rss / 2 ** 20 },
    threads: { before: base.threads, after_round1: mid.threads, after_round2: end.threads },
    server_ms_per_generation: [server_ms(m0, m1), server_ms(m1, m)],
    generations: m.dsv4_generations_total,
    decode_tokens_per_second: m.dsv4_decode_tokens_per_second,
  };
  console.log("load report:", JSON.stringify(report, null, 1));
  writeFileSync(join(opts.work, "load-report.json"), JSON.stringify(report, null, 1));

  assert.deepEqual([...r1.failures, ...r2.failures], []);
  assert.equal(all.length, 2 * kRequests);
  assert.equal(m.dsv4_generations_failed_total, 0);
  assert.equal(m.dsv4_queue_length, 0);
  assert.equal(m.dsv4_running, 0);
  // Threads: a fixed pool; nothing per request survives it.
  assert.equal(mid.threads, base.threads);
  assert.equal(end.threads, base.threads);
  // Memory: the second round must not add what the first added (allocator noise aside).
  assert.ok(end.rss - mid.rss < 16 * 2 ** 20, `RSS grew ${(end.rss - mid.rss) / 2 ** 20} MiB in round 2`);
  assert.ok(end.rss - base.rss < 48 * 2 ** 20, `RSS grew ${(end.rss - base.rss) / 2 ** 20} MiB over both rounds`);
});
