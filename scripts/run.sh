#!/usr/bin/env bash
# Serves a model with dsv4-server on 127.0.0.1:8000 and prints how to connect clients to it.
#
#   ./scripts/run.sh [MODEL.gguf] [dsv4-server flags...]
#
# First use installs and builds (./scripts/setup.sh). With a model, the context length comes from the memory plan
# (--ctx auto) unless a --ctx flag is given. Without one, it serves the built-in default: a tiny model with DeepSeek
# V4's structure, real tokenizer and chat format and RANDOM WEIGHTS, made by dsv4-synth during the build, so that the
# whole path (chat, streaming, tool calls, the disk KV cache) works before the real model is downloaded
# (./scripts/download-model.sh q2). Its replies are gibberish.
#
# The disk KV cache is on: ${DSV4_KV_DIR:-~/.cache/dsv4/kv}/<model name>, 4096 MiB unless --kv-disk-* flags say
# otherwise. Ctrl+C stops the server cleanly (the KV state is saved). Flags after the model go to dsv4-server
# (docs/server.md), e.g. --port 8080, --api-key KEY, --host 0.0.0.0.
#
# Environment: DSV4_BUILD_DIR (default build), DSV4_NO_BUILD=1 (use the build as it is), DSV4_KV_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=${DSV4_BUILD_DIR:-build}

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
  sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi

model=""
if [[ $# -gt 0 && ${1:0:1} != - ]]; then
  model=$1
  shift
  if [[ ! -e $model ]]; then
    echo "run: $model does not exist (./scripts/download-model.sh fetches the real model)" >&2
    exit 1
  fi
fi

# Build on first use; afterwards bring the server up to date (a no-op when nothing changed).
if [[ ! -x $build_dir/bin/dsv4-server ]]; then
  echo "run: first use: installing and building (./scripts/setup.sh)"
  DSV4_BUILD_DIR=$build_dir ./scripts/setup.sh
elif [[ ${DSV4_NO_BUILD:-0} != 1 ]]; then
  cmake --build "$build_dir" --target dsv4-server dsv4-default-model >/dev/null
fi
default_model=$build_dir/share/dsv4/dsv4-mini-random.gguf

# What the user asked for, so the banner names the right address.
host=127.0.0.1 port=8000 api_key="" has_ctx=0 has_kv=0
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[i]} in
    --host) host=${args[i + 1]:-$host} ;;
    --port) port=${args[i + 1]:-$port} ;;
    --api-key) api_key=${args[i + 1]:-} ;;
    -c|--ctx) has_ctx=1 ;;
    --kv-disk-dir) has_kv=1 ;;
  esac
done
[[ -z $api_key ]] && api_key=${DSV4_API_KEY:-}

flags=()
if [[ -z $model ]]; then
  model=$default_model
  (( has_ctx )) || flags+=(--ctx 32768)
else
  (( has_ctx )) || flags+=(--ctx auto)
fi
if (( ! has_kv )); then
  kv_dir=${DSV4_KV_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/dsv4/kv}/$(basename "$(readlink -f "$model")" .gguf)
  flags+=(--kv-disk-dir "$kv_dir")
fi

"$build_dir/bin/dsv4-server" -m "$model" "${flags[@]}" "$@" &
pid=$!
trap 'kill -TERM $pid 2>/dev/null || true' INT TERM

# Wait for the model, then say how to connect.
url_host=$host; [[ $host == 0.0.0.0 ]] && url_host=127.0.0.1
base="http://$url_host:$port"
auth=(); [[ -n $api_key ]] && auth=(-H "Authorization: Bearer $api_key")
until curl -fs "$base/health" >/dev/null 2>&1; do
  kill -0 $pid 2>/dev/null || { wait $pid; exit $?; }
  sleep 0.2
done
models=$(curl -fs "${auth[@]}" "$base/v1/models" || true)
id=$(sed -n 's/.*"id":"\([^"]*\)".*/\1/p' <<<"$models" | head -1)
id=${id:-deepseek-v4-flash}
key=${api_key:-dsv4}
cat <<EOF

================================================================================================
 dsv4-server is ready at $base   (model: $id)
EOF
if grep -q '"random_weights":true' <<<"$models"; then
  cat <<EOF
 This is the built-in model with RANDOM WEIGHTS: it runs every feature but answers gibberish.
 For the real model: ./scripts/download-model.sh q2 && ./scripts/run.sh models/deepseek-v4-flash.gguf
EOF
fi
cat <<EOF
------------------------------------------------------------------------------------------------
 Try it:
   curl $base/v1/chat/completions -H 'Content-Type: application/json' ${api_key:+-H 'Authorization: Bearer $api_key' }\\
     -d '{"messages": [{"role": "user", "content": "Hello!"}]}'

 OpenAI-compatible base URL:     $base/v1
 Anthropic-compatible base URL:  $base

 Claude Code:
   ANTHROPIC_BASE_URL=$base ANTHROPIC_AUTH_TOKEN=$key ANTHROPIC_MODEL=$id claude

 Codex (~/.codex/config.toml):
   model = "$id"
   model_provider = "dsv4"
   [model_providers.dsv4]
   name = "dsv4"
   base_url = "$base/v1"
   wire_api = "responses"${api_key:+
   env_key = "DSV4_API_KEY"   # export DSV4_API_KEY=$api_key}

 opencode (opencode.json):
   {"provider": {"dsv4": {"npm": "@ai-sdk/openai-compatible", "name": "dsv4",
     "options": {"baseURL": "$base/v1"${api_key:+, "apiKey": "$api_key"}}, "models": {"$id": {}}}},
    "model": "dsv4/$id"}

 Ctrl+C stops the server (the KV cache is saved).
================================================================================================
EOF

status=0
wait $pid || status=$?
# A signal to this script interrupts the wait (status 128 + N) while the server finishes its shutdown: wait again for
# the server's own exit status.
if (( status > 128 )); then
  status=0
  wait $pid || status=$?
fi
exit $status
