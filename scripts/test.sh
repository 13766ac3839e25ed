#!/usr/bin/env bash
# Runs the whole test suite: ctest (unit, model, server and, where a GPU exists, gpu labels).
# Exits non-zero on any failure. The last line is ctest's summary.
set -uo pipefail
cd "$(dirname "$0")/.."
build_dir=${DSV4_BUILD_DIR:-build}
if [[ ! -f "$build_dir/CTestTestfile.cmake" ]]; then
  echo "test: no build in $build_dir; run ./scripts/setup.sh first" >&2
  exit 2
fi
# The server and tokenizer tests drive the pinned npm clients (tests/node/package-lock.json).
if [[ ! -d tests/node/node_modules ]]; then
  npm ci --prefix tests/node --no-audit --no-fund || exit 1
fi
cmake --build "$build_dir" -j "$(nproc)" || exit 1
# ctest lists skipped tests (gpu tests without a GPU) after its summary; the summary line is repeated last.
log=$(mktemp)
trap 'rm -f "$log"' EXIT
(cd "$build_dir" && ctest --output-on-failure -j "$(nproc)" "$@") 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
grep -E '^[0-9]+% tests passed' "$log" | tail -n 1
exit "$rc"
