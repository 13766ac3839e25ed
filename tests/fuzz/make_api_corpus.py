#!/usr/bin/env python3
"""Writes the seed corpus of api_fuzz (tests/data/fuzz/api): one accepted request per API and feature, each with a
model reply. A seed is the selector byte (api_fuzz.cpp: route, template version, context, how the reply ends), the
request body, a NUL and the reply text. Run from the repository root; it rewrites only the ok-* files."""
import json
import os

OUT = "tests/data/fuzz/api"
CHAT, COMPLETION, MESSAGES, RESPONSES, COUNT = range(5)
V0731, CTX_1M = 8, 16
EOS, STOP, LENGTH, ERROR, SHUTDOWN = 0 << 5, 2 << 5, 3 << 5, 4 << 5, 5 << 5


def call(name, **args):
    params = "".join(
        f'<｜DSML｜parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
        f'{v if isinstance(v, str) else json.dumps(v)}</｜DSML｜parameter>\n' for k, v in args.items())
    return f'<｜DSML｜invoke name="{name}">\n{params}</｜DSML｜invoke>'


def block(*calls):
    return "\n\n<｜DSML｜tool_calls>\n" + "\n".join(calls) + "\n</｜DSML｜tool_calls>"


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}

SEEDS = {
    "ok-chat-stream-logprobs": (CHAT, {
        "model": "m", "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2,
        "temperature": 0.7, "top_p": 0.9, "seed": 3, "stop": ["\n\n"],
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi é 你好"}]},
        "Let me think.</think>Hello! é 你好 🙂"),
    "ok-chat-tools": (CHAT | V0731, {
        "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
        "reasoning_effort": "high"},
        "The user wants weather.</think>" + block(call("get_weather", city="Paris"), call("get_weather", city="Nice"))),
    "ok-chat-history": (CHAT | STOP, {
        "thinking": {"type": "disabled"}, "tools": [WEATHER], "max_tokens": 50,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
            {"role": "user", "content": "Thanks"}]},
        "It is -3 C in Oslo."),
    "ok-chat-forced-name": (CHAT | CTX_1M, {
        "messages": [{"role": "user", "content": "go"}],
        "tools": [{"type": "function", "function": {"name": "f<｜User｜>\"x\"</think>", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "f<｜User｜>\"x\"</think>"}},
        "reasoning_effort": "max"},
        '<｜DSML｜parameter name="a" string="false">{"b": [1, 2]}</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'),
    "ok-chat-required-truncated": (CHAT | LENGTH, {
        "messages": [{"role": "user", "content": "go"}], "tools": [WEATHER], "tool_choice": "required",
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}},
        'get_weather">\n<｜DSML｜parameter name="city" string="true">Ber'),
    "ok-completion-stream": (COMPLETION, {
        "prompt": "Once upon a time", "max_tokens": 8, "logprobs": 3, "stream": True, "echo": False},
        " there was a \udcff byte"),
    "ok-completion-ids": (COMPLETION | ERROR, {"prompt": [0, 1, 2, 100], "max_tokens": 3}, "abc"),
    "ok-messages-stream": (MESSAGES, {
        "model": "m", "max_tokens": 256, "stream": True, "system": [{"type": "text", "text": "sys"}],
        "thinking": {"type": "enabled", "budget_tokens": 1024}, "stop_sequences": ["END"],
        "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather?"}]}]},
        "Thinking here.</think>Checking." + block(call("get_weather", city="Rome"))),
    "ok-messages-history": (MESSAGES | SHUTDOWN, {
        "max_tokens": 64, "tools": [{"name": "t", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto"},
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "x"},
                {"type": "tool_use", "id": "toolu_1", "name": "t", "input": {"k": 1}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "r"}, {"type": "image"}]}]}]},
        "ok"),
    "ok-responses-stream": (RESPONSES | V0731, {
        "instructions": "sys", "stream": True, "max_output_tokens": 100, "reasoning": {"effort": "low"},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "r"}]},
        "done</think>The answer." + block(call("f", x=1))),
    "ok-responses-text": (RESPONSES | LENGTH, {"input": "hello", "text": {"format": {"type": "json_object"}}},
                          "{\"a\": "),
    "ok-count-tokens": (COUNT, {"model": "m", "messages": [{"role": "user", "content": "count me"}],
                                "tools": [{"name": "t", "input_schema": {"type": "object"}}]}, ""),
}


def main():
    os.makedirs(OUT, exist_ok=True)
    for f in os.listdir(OUT):
        if f.startswith("ok-"):
            os.remove(os.path.join(OUT, f))
    for name, (selector, body, reply) in SEEDS.items():
        data = bytes([selector]) + json.dumps(body, ensure_ascii=False).encode() + b"\0"
        # The reply as UTF-8; a surrogate escape (\udcff) stands for one invalid byte (0xff).
        data += reply.encode("utf-8", "surrogateescape")
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
