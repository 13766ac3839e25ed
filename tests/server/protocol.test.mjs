// The server's four generation APIs through the real npm clients (openai 6, @anthropic-ai/sdk 1.x): plain and
// streamed replies, tool calls and thinking blocks (scripted generations, so the SDKs parse known DSML), stop
// sequences, log-probabilities, prefix reuse across turns, every class of bad input, API keys and CORS.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import {
  DSML,
  anthropic,
  dsmlCall,
  metrics,
  openai,
  postJson,
  readSse,
  script,
  startServer,
} from "./lib.mjs";

const weatherTool = {
  type: "function",
  function: {
    name: "get_weather",
    description: "Weather forecast for a city",
    parameters: {
      type: "object",
      properties: { city: { type: "string" }, days: { type: "integer" } },
      required: ["city"],
    },
  },
};
const anthropicWeather = {
  name: "get_weather",
  description: "Weather forecast for a city",
  input_schema: weatherTool.function.parameters,
};

let server;
before(async () => {
  server = await startServer(["--max-body-mb", "1"]);
});
after(async () => {
  const status = await server.stop();
  assert.equal(status.code, 0, server.log());
});

describe("information routes", () => {
  test("health, models, props and metrics; random weights are labelled", async () => {
    const health = await fetch(`${server.base}/health`);
    assert.equal(health.status, 200);
    assert.deepEqual(await health.json(), { status: "ok" });

    const models = await openai(server).models.list();
    assert.equal(models.data.length, 1);
    const m = models.data[0];
    assert.equal(m.id, "dsv4-random-weights");
    assert.equal(m.random_weights, true);
    assert.match(m.display_name, /RANDOM WEIGHTS/);
    assert.equal(m.context_length, 4096);
    const one = await openai(server).models.retrieve(m.id);
    assert.equal(one.id, m.id);
    await assert.rejects(openai(server).models.retrieve("gpt-4"), (e) => e.status === 404);

    const props = await (await fetch(`${server.base}/props`)).json();
    assert.equal(props.random_weights, true);
    assert.match(props.description, /random weights/);
    assert.equal(props.context_length, 4096);
    assert.match(props.backend, /cpu/);
    assert.equal(props.sessions, 2);
    assert.equal(props.batched_decode, true);  // the CPU steps concurrent requests as one pass
    assert.equal(props.prefill_slice_ms, 500);
    assert.ok(props.build.version && props.build.commit);
    assert.deepEqual(props.sampling_defaults, { temperature: 1, top_p: 1, top_k: 0, min_p: 0.05 });

    const mt = await metrics(server);
    assert.equal(mt.dsv4_model_loaded, 1);
    assert.equal(mt.dsv4_context_length, 4096);
    assert.ok(mt.process_threads > 0 && mt.process_resident_memory_bytes > 0);
  });
});

describe("OpenAI chat completions", () => {
  test("plain reply: shape, usage, length limit, seed reproducibility", async () => {
    const client = openai(server);
    const req = { model: "x", messages: [{ role: "user", content: "Say something." }], max_tokens: 8, seed: 42 };
    const a = await client.chat.completions.create(req);
    assert.equal(a.object, "chat.completion");
    assert.equal(a.model, "dsv4-random-weights");
    assert.equal(a.choices[0].finish_reason, "length");
    assert.equal(a.usage.completion_tokens, 8);
    assert.ok(a.usage.prompt_tokens > 3);
    assert.equal(a.usage.total_tokens, a.usage.prompt_tokens + 8);
    // Thinking is the default: the random model never closes it, so everything is reasoning.
    assert.equal(a.usage.completion_tokens_details.reasoning_tokens, 8);
    assert.ok(a.choices[0].message.reasoning_content.length > 0);
    const b = await client.chat.completions.create(req);
    assert.equal(b.choices[0].message.reasoning_content, a.choices[0].message.reasoning_content);
    const c = await client.chat.completions.create({ ...req, seed: 43 });
    assert.notEqual(c.choices[0].message.reasoning_content, a.choices[0].message.reasoning_content);
    const greedy1 = await client.chat.completions.create({ ...req, seed: undefined, temperature: 0 });
    const greedy2 = await client.chat.completions.create({ ...req, seed: undefined, temperature: 0 });
    assert.equal(greedy1.choices[0].message.reasoning_content, greedy2.choices[0].message.reasoning_content);
  });

  test("streamed reply with reasoning, content and usage", async () => {
    const client = openai(server);
    const stream = await client.chat.completions.create(
      {
        model: "x",
        messages: [{ role: "user", content: "Hi" }],
        stream: true,
        stream_options: { include_usage: true },
      },
      script("Thinking about it.</think>Hello there, friend!"),
    );
    let reasoning = "";
    let content = "";
    let finish = null;
    let usage = null;
    let chunks = 0;
    for await (const chunk of stream) {
      chunks++;
      if (chunk.usage) usage = chunk.usage;
      const ch = chunk.choices[0];
      if (!ch) continue;
      reasoning += ch.delta.reasoning_content ?? "";
      content += ch.delta.content ?? "";
      if (ch.finish_reason) finish = ch.finish_reason;
    }
    assert.equal(reasoning, "Thinking about it.");
    assert.equal(content, "Hello there, friend!");
    assert.equal(finish, "stop");
    assert.ok(chunks > 5, "deltas arrive token by token");
    assert.ok(usage.completion_tokens > 5);
    assert.ok(usage.completion_tokens_details.reasoning_tokens >= 4);
  });

  test("tool calls parsed by the SDK, plain and streamed", async () => {
    const client = openai(server);
    const text = "The user wants weather.</think>Let me look." + dsmlCall("get_weather", { city: "Paris", days: 3 });
    const req = { model: "x", messages: [{ role: "user", content: "Weather in Paris?" }], tools: [weatherTool] };
    const r = await client.chat.completions.create(req, script(text));
    const msg = r.choices[0].message;
    assert.equal(r.choices[0].finish_reason, "tool_calls");
    assert.equal(msg.content, "Let me look.");
    assert.equal(msg.reasoning_content, "The user wants weather.");
    assert.equal(msg.tool_calls.length, 1);
    assert.equal(msg.tool_calls[0].type, "function");
    assert.equal(msg.tool_calls[0].function.name, "get_weather");
    assert.deepEqual(JSON.parse(msg.tool_calls[0].function.arguments), { city: "Paris", days: 3 });
    assert.match(msg.tool_calls[0].id, /^call_/);

    // The SDK's stream helper accumulates tool-call deltas itself.
    const stream = client.chat.completions.stream({ ...req, stream: true }, script(text));
    const names = [];
    stream.on("tool_calls.function.arguments.done", (e) => names.push(e.name));
    const final = await stream.finalChatCompletion();
    const call = final.choices[0].message.tool_calls[0];
    assert.equal(call.function.name, "get_weather");
    assert.deepEqual(JSON.parse(call.function.arguments), { city: "Paris", days: 3 });
    assert.deepEqual(names, ["get_weather"]);
    assert.equal(final.choices[0].finish_reason, "tool_calls");
  });

  test("two calls in one block", async () => {
    const block =
      `\n\n<${DSML}tool_calls>\n<${DSML}invoke name="get_weather">\n<${DSML}parameter name="city" string="true">Oslo` +
      `</${DSML}parameter>\n</${DSML}invoke>\n<${DSML}invoke name="get_weather">\n<${DSML}parameter name="city" ` +
      `string="true">Rome</${DSML}parameter>\n</${DSML}invoke>\n</${DSML}tool_calls>`;
    const r = await openai(server).chat.completions.create(
      { model: "x", messages: [{ role: "user", content: "Both" }], tools: [weatherTool], reasoning_effort: "none" },
      script(block),
    );
    const calls = r.choices[0].message.tool_calls;
    assert.deepEqual(calls.map((c) => JSON.parse(c.function.arguments).city), ["Oslo", "Rome"]);
    assert.notEqual(calls[0].id, calls[1].id);
  });

  test("a forced tool choice starts the reply as that call", async () => {
    const rest =
      `<${DSML}parameter name="city" string="true">Lima</${DSML}parameter>\n</${DSML}invoke>\n</${DSML}tool_calls>`;
    const r = await openai(server).chat.completions.create(
      {
        model: "x",
        messages: [{ role: "user", content: "anything" }],
        tools: [weatherTool],
        tool_choice: { type: "function", function: { name: "get_weather" } },
      },
      script(rest),
    );
    const calls = r.choices[0].message.tool_calls;
    assert.equal(calls.length, 1);
    assert.equal(calls[0].function.name, "get_weather");
    assert.deepEqual(JSON.parse(calls[0].function.arguments), { city: "Lima" });
  });

  test("tool round trip reuses the live KV: the sampled DSML re-renders byte for byte", async () => {
    const client = openai(server);
    const messages = [
      { role: "system", content: "You are a weather bot." },
      { role: "user", content: "Weather in Paris for 2 days?" },
    ];
    const text = "Need the tool.</think>" + dsmlCall("get_weather", { city: "Paris", days: 2 });
    const r1 = await client.chat.completions.create({ model: "x", messages, tools: [weatherTool] }, script(text));
    const msg = r1.choices[0].message;
    // The client sends back the assistant message (ids, reasoning) and the tool result.
    const r2 = await client.chat.completions.create(
      {
        model: "x",
        messages: [
          ...messages,
          msg,
          { role: "tool", tool_call_id: msg.tool_calls[0].id, content: "sunny, 21°C" },
        ],
        tools: [weatherTool],
        max_tokens: 2,
      },
    );
    // Everything the session held is reused: the first prompt and every generated token but EOS.
    assert.equal(r2.usage.prompt_tokens_details.cached_tokens, r1.usage.prompt_tokens + r1.usage.completion_tokens);
  });

  test("thinking mode: the next turn reuses the state although the template drops the reasoning", async () => {
    const client = openai(server);
    const first = [{ role: "user", content: "What is two plus two? Think first." }];
    const r1 = await client.chat.completions.create(
      { model: "x", messages: first },
      script("Two and two make four.</think>It is 4."),
    );
    assert.equal(r1.choices[0].message.content, "It is 4.");
    const r2 = await client.chat.completions.create({
      model: "x",
      messages: [...first, { role: "assistant", content: "It is 4." }, { role: "user", content: "And 3+3?" }],
      max_tokens: 2,
    });
    assert.equal(r2.usage.prompt_tokens_details.cached_tokens, r1.usage.prompt_tokens + r1.usage.completion_tokens);
  });

  test("stop sequences end the reply before the match", async () => {
    const r = await openai(server).chat.completions.create(
      { model: "x", messages: [{ role: "user", content: "x" }], stop: ["STOP", "never"], reasoning_effort: "none" },
      script("Hello STOP world"),
    );
    assert.equal(r.choices[0].message.content, "Hello ");
    assert.equal(r.choices[0].finish_reason, "stop");
  });

  test("log-probabilities", async () => {
    const r = await openai(server).chat.completions.create({
      model: "x",
      messages: [{ role: "user", content: "x" }],
      max_tokens: 4,
      logprobs: true,
      top_logprobs: 3,
    });
    const lp = r.choices[0].logprobs.content;
    assert.equal(lp.length, 4);
    for (const t of lp) {
      assert.ok(t.logprob <= 0);
      assert.equal(t.top_logprobs.length, 3);
      assert.ok(t.top_logprobs[0].logprob >= t.top_logprobs[2].logprob);
      assert.ok(Array.isArray(t.bytes));
    }
  });
});

describe("OpenAI completions", () => {
  test("raw prompt, plain and streamed", async () => {
    const client = openai(server);
    const r = await client.completions.create({ model: "x", prompt: "Once upon a time", max_tokens: 5, logprobs: 2 });
    assert.equal(r.object, "text_completion");
    assert.equal(r.usage.completion_tokens, 5);
    assert.equal(r.choices[0].finish_reason, "length");
    assert.equal(r.choices[0].logprobs.tokens.length, 5);
    // Raw prompts recognise special tokens written in the text; a BOS is added when missing.
    const s = await client.completions.create(
      {
        model: "x",
        prompt: "<｜User｜>Hi<｜Assistant｜></think>",
        stream: true,
        stream_options: { include_usage: true },
      },
      script("Hi back!"),
    );
    let text = "";
    let usage = null;
    for await (const chunk of s) {
      text += chunk.choices[0]?.text ?? "";
      if (chunk.usage) {
        assert.equal(chunk.choices.length, 0, "the usage chunk carries no choices");
        usage = chunk.usage;
      }
    }
    assert.equal(text, "Hi back!");
    assert.ok(usage.completion_tokens > 0);
  });
});

describe("OpenAI Responses", () => {
  const text = "Checking the tool.</think>One moment." + dsmlCall("get_weather", { city: "Kyoto" });
  const tools = [{ type: "function", ...weatherTool.function }];

  test("plain: reasoning, message and function call items", async () => {
    const r = await openai(server).responses.create(
      { model: "x", instructions: "Be brief.", input: "Weather in Kyoto?", tools },
      script(text),
    );
    assert.equal(r.status, "completed");
    assert.deepEqual(r.output.map((o) => o.type), ["reasoning", "message", "function_call"]);
    assert.equal(r.output[0].content[0].text, "Checking the tool.");
    assert.equal(r.output_text, "One moment.");
    const fc = r.output[2];
    assert.equal(fc.name, "get_weather");
    assert.deepEqual(JSON.parse(fc.arguments), { city: "Kyoto" });
    assert.match(fc.call_id, /^call_/);
    assert.ok(r.usage.input_tokens > 0 && r.usage.output_tokens > 0);
  });

  test("streamed: the event lifecycle, accumulated by the SDK", async () => {
    const stream = openai(server).responses.stream(
      { model: "x", input: [{ role: "user", content: "Weather in Kyoto?" }], tools },
      script(text),
    );
    const types = [];
    stream.on("event", (e) => types.push(e.type));
    const final = await stream.finalResponse();
    assert.equal(types[0], "response.created");
    assert.equal(types.at(-1), "response.completed");
    for (const t of [
      "response.output_item.added",
      "response.reasoning_text.delta",
      "response.output_text.delta",
      "response.function_call_arguments.delta",
      "response.function_call_arguments.done",
      "response.output_item.done",
    ])
      assert.ok(types.includes(t), t);
    const fc = final.output.find((o) => o.type === "function_call");
    assert.deepEqual(JSON.parse(fc.arguments), { city: "Kyoto" });
    assert.equal(final.output.find((o) => o.type === "message").content[0].text, "One moment.");
    assert.equal(final.output.find((o) => o.type === "reasoning").content[0].text, "Checking the tool.");

    // A length limit ends as incomplete.
    const cut = await openai(server).responses.create({ model: "x", input: "hi", max_output_tokens: 3 });
    assert.equal(cut.status, "incomplete");
    assert.equal(cut.incomplete_details.reason, "max_output_tokens");
  });

  test("function_call_output continues the conversation", async () => {
    const first = await openai(server).responses.create(
      { model: "x", input: "Weather in Kyoto?", tools },
      script(text),
    );
    const fc = first.output.find((o) => o.type === "function_call");
    const r = await openai(server).responses.create({
      model: "x",
      input: [
        { role: "user", content: "Weather in Kyoto?" },
        ...first.output,
        { type: "function_call_output", call_id: fc.call_id, output: "rain" },
      ],
      tools,
      max_output_tokens: 2,
    });
    assert.equal(r.status, "incomplete");
    assert.ok(r.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens);
  });
});

describe("Anthropic messages", () => {
  const text = "I should call the tool.</think>Looking it up." + dsmlCall("get_weather", { city: "Cairo", days: 1 });
  const cairo = {
    model: "claude-x",
    max_tokens: 200,
    messages: [{ role: "user", content: "Cairo?" }],
    tools: [anthropicWeather],
  };

  test("plain: thinking, text and tool_use blocks", async () => {
    const r = await anthropic(server).messages.create(cairo, script(text));
    assert.equal(r.type, "message");
    assert.deepEqual(r.content.map((b) => b.type), ["thinking", "text", "tool_use"]);
    assert.equal(r.content[0].thinking, "I should call the tool.");
    assert.equal(r.content[1].text, "Looking it up.");
    assert.equal(r.content[2].name, "get_weather");
    assert.deepEqual(r.content[2].input, { city: "Cairo", days: 1 });
    assert.match(r.content[2].id, /^toolu_/);
    assert.equal(r.stop_reason, "tool_use");
    assert.ok(r.usage.input_tokens > 0 && r.usage.output_tokens > 0);
  });

  test("streamed: the full event sequence, accumulated by the SDK", async () => {
    const stream = anthropic(server).messages.stream(cairo, script(text));
    const events = [];
    stream.on("streamEvent", (e) => events.push(e.type));
    const final = await stream.finalMessage();
    assert.equal(events[0], "message_start");
    assert.deepEqual(events.slice(-2), ["message_delta", "message_stop"]);
    assert.deepEqual(final.content.map((b) => b.type), ["thinking", "text", "tool_use"]);
    assert.deepEqual(final.content[2].input, { city: "Cairo", days: 1 });
    assert.equal(final.stop_reason, "tool_use");

    // Tool result round trip with the tool_use id: the state is reused.
    const next = await anthropic(server).messages.create({
      model: "claude-x",
      max_tokens: 2,
      tools: [anthropicWeather],
      messages: [
        { role: "user", content: "Cairo?" },
        { role: "assistant", content: final.content },
        { role: "user", content: [{ type: "tool_result", tool_use_id: final.content[2].id, content: "hot" }] },
      ],
    });
    assert.equal(next.stop_reason, "max_tokens");
    assert.equal(next.usage.cache_read_input_tokens, final.usage.input_tokens + final.usage.cache_read_input_tokens +
                                                       final.usage.output_tokens);
  });

  test("system prompt, stop sequences, thinking disabled, count_tokens", async () => {
    const client = anthropic(server);
    const r = await client.messages.create(
      {
        model: "claude-x",
        max_tokens: 50,
        system: "You are terse.",
        thinking: { type: "disabled" },
        stop_sequences: ["END"],
        messages: [{ role: "user", content: "Go" }],
      },
      script("Alpha beta END gamma"),
    );
    assert.equal(r.content[0].text, "Alpha beta ");
    assert.equal(r.stop_reason, "stop_sequence");
    assert.equal(r.stop_sequence, "END");
    const count = await client.messages.countTokens({
      model: "claude-x",
      system: "You are terse.",
      messages: [{ role: "user", content: "Go" }],
    });
    assert.ok(count.input_tokens > 3 && count.input_tokens < 40);
  });
});

describe("bad input: 4xx with the API's error shape, never a crash", () => {
  const chat = (body) => postJson(server, "/v1/chat/completions", body);
  const messages = (body) => postJson(server, "/v1/messages", body);
  const openaiError = (r, status, param) => {
    assert.equal(r.status, status, r.text);
    assert.equal(typeof r.json.error.message, "string");
    assert.equal(typeof r.json.error.type, "string");
    assert.ok("param" in r.json.error && "code" in r.json.error);
    if (param !== undefined) assert.equal(r.json.error.param, param);
  };
  const anthropicError = (r, status) => {
    assert.equal(r.status, status, r.text);
    assert.equal(r.json.type, "error");
    assert.equal(typeof r.json.error.type, "string");
    assert.equal(typeof r.json.error.message, "string");
  };

  test("malformed JSON", async () => {
    openaiError(await chat('{"messages": [ {"role": "user"'), 400);
    anthropicError(await messages("not json at all"), 400);
    openaiError(await postJson(server, "/v1/responses", "{,}"), 400);
    openaiError(await postJson(server, "/v1/completions", "[[["), 400);
    openaiError(await chat("[".repeat(5000) + "]".repeat(5000)), 400);  // too deep
  });

  test("wrong types", async () => {
    const user = [{ role: "user", content: "x" }];
    openaiError(await chat({ messages: "hello" }), 400, "messages");
    openaiError(await chat({ messages: user, max_tokens: "ten" }), 400, "max_tokens");
    openaiError(await chat({ messages: user, temperature: "hot" }), 400, "temperature");
    openaiError(await chat({ messages: user, stream: "yes" }), 400, "stream");
    openaiError(await chat({ messages: user, stop: [1, 2] }), 400, "stop[0]");
    openaiError(await chat({ messages: [{ role: "user", content: 5 }] }), 400, "messages[0].content");
    openaiError(await chat({ messages: user, tools: "all" }), 400, "tools");
    anthropicError(await messages({ max_tokens: 5, messages: [{ role: "user", content: [{ type: "image" }] }] }), 400);
  });

  test("unknown roles and empty messages", async () => {
    openaiError(await chat({ messages: [{ role: "robot", content: "x" }] }), 400, "messages[0].role");
    openaiError(await chat({ messages: [] }), 400, "messages");
    anthropicError(await messages({ max_tokens: 5, messages: [{ role: "system", content: "x" }] }), 400);
    anthropicError(await messages({ max_tokens: 5, messages: [] }), 400);
    anthropicError(await messages({ messages: [{ role: "user", content: "x" }] }), 400);  // max_tokens is required
  });

  test("a prompt longer than the context", async () => {
    const long = "word ".repeat(6000);
    const r = await chat({ messages: [{ role: "user", content: long }] });
    openaiError(r, 400);
    assert.equal(r.json.error.code, "context_length_exceeded");
    anthropicError(await messages({ max_tokens: 5, messages: [{ role: "user", content: long }] }), 400);
    // The SDK raises its typed error.
    await assert.rejects(
      openai(server).chat.completions.create({ model: "x", messages: [{ role: "user", content: long }] }),
      (e) => e.status === 400 && e.code === "context_length_exceeded",
    );
  });

  test("absurd max_tokens, n and sampling values", async () => {
    const user = [{ role: "user", content: "x" }];
    openaiError(await chat({ messages: user, max_tokens: -1 }), 400, "max_tokens");
    openaiError(await chat({ messages: user, max_tokens: 0 }), 400, "max_tokens");
    openaiError(await chat({ messages: user, max_tokens: 1e12 }), 400, "max_tokens");
    openaiError(await chat({ messages: user, max_completion_tokens: 2.5 }), 400, "max_completion_tokens");
    openaiError(await chat({ messages: user, n: 2 }), 400, "n");
    openaiError(await chat({ messages: user, temperature: -1 }), 400, "temperature");
    openaiError(await chat({ messages: user, top_p: 7 }), 400, "top_p");
    openaiError(await chat({ messages: user, logprobs: true, top_logprobs: 50 }), 400, "top_logprobs");
    openaiError(await chat({ messages: user, stream: true, stream_options: true }), 400, "stream_options");
    openaiError(
      await postJson(server, "/v1/completions", { prompt: "x", stream: true, stream_options: [1] }),
      400,
      "stream_options",
    );
    anthropicError(await messages({ max_tokens: 1e15, messages: user }), 400);
    // A max_tokens larger than the context is fine: the reply stops when the context is full.
    const ok = await chat({ messages: user, max_tokens: 1000000, stop: ["a", "e", "i", "o", "u"] });
    assert.equal(ok.status, 200, ok.text);
  });

  test("unknown routes, oversized bodies, unsupported features", async () => {
    const r404 = await fetch(`${server.base}/v2/chat`);
    assert.equal(r404.status, 404);
    assert.ok((await r404.json()).error.message.includes("/v2/chat"));
    const huge = { messages: [{ role: "user", content: "x".repeat(2 << 20) }] };
    const big = await postJson(server, "/v1/chat/completions", huge);
    assert.equal(big.status, 413);
    openaiError(
      await postJson(server, "/v1/responses", { input: "x", previous_response_id: "resp_1" }),
      400,
      "previous_response_id",
    );
  });

  test("the server is still healthy and serving", async () => {
    const r = await openai(server).chat.completions.create({
      model: "x",
      messages: [{ role: "user", content: "ok?" }],
      max_tokens: 2,
    });
    assert.equal(r.usage.completion_tokens, 2);
    const mt = await metrics(server);
    assert.ok(mt['dsv4_http_requests_total{path="/v1/chat/completions",status="400"}'] >= 10);
  });
});

describe("API key and CORS", () => {
  test("--api-key: Bearer and x-api-key accepted, anything else 401, /health open", async () => {
    const s = await startServer(["--api-key", "s3cret"]);
    try {
      const body = { model: "x", messages: [{ role: "user", content: "hi" }], max_tokens: 1 };
      const none = await postJson(s, "/v1/chat/completions", body);
      assert.equal(none.status, 401);
      assert.equal(none.json.error.code, "invalid_api_key");
      const anth = await postJson(s, "/v1/messages", { ...body, max_tokens: 1 });
      assert.equal(anth.status, 401);
      assert.equal(anth.json.error.type, "authentication_error");
      assert.equal((await postJson(s, "/v1/chat/completions", body, { authorization: "Bearer s3cret" })).status, 200);
      assert.equal((await postJson(s, "/v1/chat/completions", body, { "x-api-key": "s3cret" })).status, 200);
      assert.equal((await postJson(s, "/v1/chat/completions", body, { authorization: "Bearer s3cre" })).status, 401);
      assert.equal((await fetch(`${s.base}/health`)).status, 200);
      assert.equal((await fetch(`${s.base}/metrics`)).status, 401);
      // Both SDKs with the key; and the typed error without it.
      const ok = await openai(s, { apiKey: "s3cret" }).chat.completions.create(body);
      assert.equal(ok.usage.completion_tokens, 1);
      const okA = await anthropic(s, { apiKey: "s3cret" }).messages.create({ ...body, model: "claude" });
      assert.equal(okA.usage.output_tokens, 1);
      await assert.rejects(openai(s, { apiKey: "wrong" }).chat.completions.create(body), (e) => e.status === 401);
      await assert.rejects(anthropic(s, { apiKey: "wrong" }).messages.create(body), (e) => e.status === 401);
    } finally {
      assert.equal((await s.stop()).code, 0);
    }
  });

  test("--cors answers preflights and labels responses", async () => {
    const s = await startServer(["--cors"]);
    try {
      const pre = await fetch(`${s.base}/v1/chat/completions`, {
        method: "OPTIONS",
        headers: { origin: "http://example.com", "access-control-request-headers": "authorization, x-stainless-os" },
      });
      assert.equal(pre.status, 204);
      assert.equal(pre.headers.get("access-control-allow-origin"), "*");
      assert.match(pre.headers.get("access-control-allow-headers"), /x-stainless-os/);
      const get = await fetch(`${s.base}/v1/models`, { headers: { origin: "http://example.com" } });
      assert.equal(get.headers.get("access-control-allow-origin"), "*");
    } finally {
      assert.equal((await s.stop()).code, 0);
    }
    const plain = await fetch(`${server.base}/v1/models`);
    assert.equal(plain.headers.get("access-control-allow-origin"), null);
  });
});

describe("SSE details", () => {
  test("keepalive comments while a stream has nothing to say; the SDKs ignore them", async () => {
    const s = await startServer(["--sse-keepalive", "0.1"]);
    try {
      const r = await fetch(`${s.base}/v1/chat/completions`, {
        method: "POST",
        headers: { "content-type": "application/json", ...script("slow words here", 300).headers },
        body: JSON.stringify({ messages: [{ role: "user", content: "x" }], stream: true, reasoning_effort: "none" }),
      });
      assert.equal(r.headers.get("content-type"), "text/event-stream");
      const { events, comments } = await readSse(r);
      assert.ok(comments >= 3, `keepalives: ${comments}`);
      assert.equal(events.at(-1).data, "[DONE]");
      const stream = await anthropic(s).messages.create(
        {
          model: "c",
          max_tokens: 20,
          stream: true,
          thinking: { type: "disabled" },
          messages: [{ role: "user", content: "x" }],
        },
        script("a b c", 250),
      );
      let text = "";
      for await (const e of stream) if (e.type === "content_block_delta") text += e.delta.text;
      assert.equal(text, "a b c");
    } finally {
      assert.equal((await s.stop()).code, 0);
    }
  });

  test("UTF-8 split across tokens never reaches the client broken", async () => {
    const r = await openai(server).chat.completions.create(
      { model: "x", messages: [{ role: "user", content: "x" }], reasoning_effort: "none", stream: true },
      script("naïve 日本語 🙂 end"),
    );
    let content = "";
    for await (const c of r) content += c.choices[0]?.delta?.content ?? "";
    assert.equal(content, "naïve 日本語 🙂 end");
  });
});
