// The server's life: /health while loading, a client that disconnects mid-stream (decoding stops), requests running
// side by side up to --sessions (the next one queued), graceful
// SIGTERM (streams end cleanly, the KV state is saved, exit 0), a restart that restores the disk KV cache (cached
// tokens in usage), a corrupt cache file, and the production binary lacking the test hooks.
import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { existsSync, readdirSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { describe, test } from "node:test";

import { metrics, openai, opts, postJson, readSse, script, sleep, startServer, workDir } from "./lib.mjs";

describe("loading", () => {
  test("/health is 503 with progress until the model is ready; requests meanwhile get 503", async () => {
    const s = await startServer(["--test-load-delay-ms", "1500"], { waitReady: false });
    try {
      const h = await fetch(`${s.base}/health`);
      assert.equal(h.status, 503);
      const body = await h.json();
      assert.equal(body.status, "loading");
      assert.ok(body.progress >= 0 && body.progress <= 1);
      assert.ok(body.loaded_bytes >= 0 && body.load_gb_per_s >= 0);
      const r = await postJson(s, "/v1/chat/completions", { messages: [{ role: "user", content: "x" }] });
      assert.equal(r.status, 503);
      assert.match(r.json.error.message, /loading/);
      const a = await postJson(s, "/v1/messages", { max_tokens: 1, messages: [{ role: "user", content: "x" }] });
      assert.equal(a.status, 503);
      assert.equal(a.json.error.type, "overloaded_error");
      let ready = false;
      for (let i = 0; i < 200 && !ready; i++) {
        ready = (await fetch(`${s.base}/health`)).status === 200;
        if (!ready) await sleep(50);
      }
      assert.ok(ready);
    } finally {
      assert.equal((await s.stop()).code, 0);
    }
  });

  test("a context that cannot fit is refused at start, naming the largest that would", () => {
    const r = spawnSync(opts.server, ["-m", opts.model, "--port", "0", "-c", "1099511627776"], {
      encoding: "utf8",
      timeout: 30000,
    });
    assert.equal(r.status, 1, r.stderr);
    assert.match(r.stderr, /cannot load the model: a context of 1099511627776 tokens .* the largest context that fits is \d+/);
  });
});

describe("cancellation", () => {
  test("a client that disconnects mid-stream stops decoding", async () => {
    const s = await startServer();
    try {
      const controller = new AbortController();
      const r = await fetch(`${s.base}/v1/chat/completions`, {
        method: "POST",
        signal: controller.signal,
        headers: { "content-type": "application/json", ...script("x ".repeat(3000), 20).headers },
        body: JSON.stringify({ messages: [{ role: "user", content: "go" }], stream: true, reasoning_effort: "none" }),
      });
      let seen = 0;
      await readSse(r, { limit: 6, onEvent: () => seen++ });
      controller.abort();
      let m;
      for (let i = 0; i < 40; i++) {
        m = await metrics(s);
        if (m.dsv4_generations_cancelled_total === 1 && m.dsv4_running === 0) break;
        await sleep(50);
      }
      assert.equal(m.dsv4_generations_cancelled_total, 1, s.log());
      assert.equal(m.dsv4_running, 0);
      const generated = m.dsv4_generated_tokens_total;
      assert.ok(generated < 100, `generated ${generated} of 3000 scripted tokens`);
      await sleep(300);
      assert.equal((await metrics(s)).dsv4_generated_tokens_total, generated, "nothing is generated after the cancel");
      assert.match(s.log(), /client went away; generation cancelled/);

      // A non-streaming client that gives up is noticed too (the server polls the socket while it works).
      const c2 = new AbortController();
      const pending = fetch(`${s.base}/v1/chat/completions`, {
        method: "POST",
        signal: c2.signal,
        headers: { "content-type": "application/json", ...script("y ".repeat(3000), 20).headers },
        body: JSON.stringify({ messages: [{ role: "user", content: "go" }] }),
      }).catch(() => null);
      await sleep(400);
      c2.abort();
      await pending;
      for (let i = 0; i < 40; i++) {
        m = await metrics(s);
        if (m.dsv4_generations_cancelled_total === 2) break;
        await sleep(50);
      }
      assert.equal(m.dsv4_generations_cancelled_total, 2);
      // And the server carries on.
      const ok = await openai(s).chat.completions.create({
        model: "x",
        messages: [{ role: "user", content: "hi" }],
        max_tokens: 2,
      });
      assert.equal(ok.usage.completion_tokens, 2);
    } finally {
      assert.equal((await s.stop()).code, 0);
    }
  });
});

describe("concurrency", () => {
  test("requests run side by side up to --sessions; the next one waits for a session", async () => {
    const s = await startServer(["--sessions", "2"]);
    try {
      // A long scripted stream; its client reads the first events, then goes on reading in the background until
      // it aborts (readSse's early return would close the connection, which cancels the generation).
      const stream = async (text) => {
        const controller = new AbortController();
        const r = await fetch(`${s.base}/v1/chat/completions`, {
          method: "POST",
          signal: controller.signal,
          headers: { "content-type": "application/json", ...script(text.repeat(3000), 20).headers },
          body: JSON.stringify({ messages: [{ role: "user", content: text }], stream: true, reasoning_effort: "none" }),
        });
        const reader = r.body.getReader();
        const decoder = new TextDecoder();
        let seen = "";
        while (seen.split("\n\n").length <= 3) {
          const { value, done } = await reader.read();
          assert.ok(!done, `the stream ended early: ${seen}`);
          seen += decoder.decode(value, { stream: true });
        }
        (async () => {
          try {
            while (!(await reader.read()).done) {}
          } catch {}  // aborted
        })();
        return controller;
      };
      const ask = (max_tokens) =>
        openai(s).chat.completions.create({ model: "x", messages: [{ role: "user", content: "hi" }], max_tokens });
      const a = await stream("a ");
      // Answered in full while the stream goes on (before, it waited for the stream's 3000 tokens: a minute).
      const t0 = Date.now();
      const b = await ask(4);
      assert.equal(b.usage.completion_tokens, 4);
      assert.ok(Date.now() - t0 < 20000, `took ${Date.now() - t0} ms`);
      let m = await metrics(s);
      assert.equal(m.dsv4_running, 1, "the stream still runs");
      // Two streams hold both sessions: a third request waits in the queue until one ends.
      const c = await stream("c ");
      const pending = ask(2);
      for (let i = 0; i < 40 && m.dsv4_queue_length !== 1; i++) {
        await sleep(50);
        m = await metrics(s);
      }
      assert.equal(m.dsv4_queue_length, 1, s.log());
      assert.equal(m.dsv4_running, 2);
      a.abort();
      assert.equal((await pending).usage.completion_tokens, 2);
      c.abort();
      for (let i = 0; i < 40 && m.dsv4_running !== 0; i++) {
        await sleep(50);
        m = await metrics(s);
      }
      assert.equal(m.dsv4_running, 0);
      assert.equal(m.dsv4_generations_cancelled_total, 2);
      // The streams decoded together: more tokens than steps.
      assert.ok(m.dsv4_decode_step_tokens_total > m.dsv4_decode_steps_total, JSON.stringify(m));
    } finally {
      assert.equal((await s.stop()).code, 0);
    }
  });
});

describe("shutdown and the disk KV cache", () => {
  const system = "You are a careful assistant. " + "Answer with precision and cite the rules. ".repeat(40);
  const turn1 = [
    { role: "system", content: system },
    { role: "user", content: "First question?" },
  ];

  test("SIGTERM: a stream finishes in the grace, the state is saved, exit 0; a restart hits the cache", async () => {
    const dir = workDir("kv-restart");
    const flags = ["--kv-disk-dir", dir, "--kv-cache-min-tokens", "64", "--shutdown-grace", "10"];
    const a = await startServer(flags);
    let r1;
    try {
      r1 = await openai(a).chat.completions.create(
        { model: "x", messages: turn1, reasoning_effort: "none" },
        script("The first answer."),
      );
      // A stream is running when SIGTERM arrives: it completes normally.
      const r = await fetch(`${a.base}/v1/chat/completions`, {
        method: "POST",
        headers: { "content-type": "application/json", ...script("one two three four five six", 60).headers },
        body: JSON.stringify({ messages: [{ role: "user", content: "other" }], stream: true, thinking: false }),
      });
      let signalled = false;
      const { events } = await readSse(r, {
        onEvent: () => {
          if (!signalled) {
            signalled = true;
            a.proc.kill("SIGTERM");
          }
        },
      });
      assert.equal(events.at(-1).data, "[DONE]");
      assert.equal(events.at(-2).data.choices[0].finish_reason, "stop");
      const text = events.map((e) => e.data?.choices?.[0]?.delta?.content ?? "").join("");
      assert.equal(text, "one two three four five six");
    } finally {
      const status = await a.stop();
      assert.equal(status.code, 0, a.log());
    }
    assert.match(a.log(), /kv cache: saved .* \((cold|shutdown) snapshot/);
    assert.ok(readdirSync(dir).some((f) => f.endsWith(".kv")));
    assert.ok(existsSync(join(dir, "tool-calls.json")));

    const b = await startServer(flags);
    try {
      const r2 = await openai(b).chat.completions.create({
        model: "x",
        messages: [...turn1, { role: "assistant", content: "The first answer." }, { role: "user", content: "Second?" }],
        max_tokens: 2,
        reasoning_effort: "none",
      });
      // The whole first exchange comes back from disk.
      assert.equal(r2.usage.prompt_tokens_details.cached_tokens, r1.usage.prompt_tokens + r1.usage.completion_tokens,
                   `first server:\n${a.log()}\nsecond server:\n${b.log()}`);
      const m = await metrics(b);
      assert.equal(m['dsv4_cache_hits_total{source="disk"}'], 1);
    } finally {
      assert.equal((await b.stop()).code, 0);
    }
  });

  test("a corrupt snapshot is skipped with a warning and the request still succeeds", async () => {
    const dir = workDir("kv-corrupt");
    const flags = ["--kv-disk-dir", dir, "--kv-cache-min-tokens", "64"];
    const a = await startServer(flags);
    await openai(a).chat.completions.create({ model: "x", messages: turn1, reasoning_effort: "none" }, script("Fine."));
    assert.equal((await a.stop()).code, 0);
    const files = readdirSync(dir).filter((f) => f.endsWith(".kv"));
    assert.ok(files.length >= 1);
    for (const f of files) {
      const bytes = readFileSync(join(dir, f));
      bytes[bytes.length - 100] ^= 0xff;  // inside the payload
      writeFileSync(join(dir, f), bytes);
    }
    const b = await startServer(flags);
    try {
      const r = await openai(b).chat.completions.create({
        model: "x",
        messages: [...turn1, { role: "assistant", content: "Fine." }, { role: "user", content: "Again?" }],
        max_tokens: 2,
        reasoning_effort: "none",
      });
      assert.equal(r.usage.prompt_tokens_details.cached_tokens, 0);
      assert.match(b.log(), /is corrupt .* deleting it/);
      assert.equal((await metrics(b)).dsv4_kv_disk_rejected_total, files.length,
                   `files ${files.join(" ")}\nfirst server:\n${a.log()}\nsecond server:\n${b.log()}`);
    } finally {
      assert.equal((await b.stop()).code, 0);
    }
  });

  test("SIGTERM past the grace ends a stream with an error event, not a cut connection", async () => {
    const s = await startServer(["--shutdown-grace", "0.3"]);
    const r = await fetch(`${s.base}/v1/chat/completions`, {
      method: "POST",
      headers: { "content-type": "application/json", ...script("z ".repeat(2000), 30).headers },
      body: JSON.stringify({ messages: [{ role: "user", content: "long" }], stream: true, reasoning_effort: "none" }),
    });
    let signalled = false;
    const { events } = await readSse(r, {
      onEvent: () => {
        if (!signalled) {
          signalled = true;
          s.proc.kill("SIGTERM");
        }
      },
    });
    assert.equal(events.at(-1).data, "[DONE]");
    assert.match(events.at(-2).data.error.message, /shutting down/);
    assert.equal((await s.wait()).code, 0, s.log());
  });
});

describe("production build", () => {
  test("dsv4-server carries no test hooks", async () => {
    if (!opts["prod-server"]) return;
    const bin = readFileSync(opts["prod-server"]);
    assert.equal(bin.indexOf("x-dsv4-test-script"), -1);
    assert.equal(bin.indexOf("test-load-delay"), -1);
    const test = readFileSync(opts.server);
    assert.notEqual(test.indexOf("x-dsv4-test-script"), -1, "the check looks for the right string");
    // And a scripted request to it samples normally.
    const s = await startServer([], { bin: opts["prod-server"] });
    try {
      const r = await openai(s).chat.completions.create(
        { model: "x", messages: [{ role: "user", content: "x" }], max_tokens: 6, reasoning_effort: "none" },
        script("scripted text"),
      );
      assert.notEqual(r.choices[0].message.content, "scripted text");
      assert.equal(r.usage.completion_tokens, 6);
    } finally {
      assert.equal((await s.stop()).code, 0);
    }
  });
});
