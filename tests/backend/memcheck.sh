#!/bin/sh
# Runs a test binary under compute-sanitizer's memcheck, which the GPU machine may have where the build machine does
# not (scripts/gpu-check.sh runs packages built elsewhere): exit 77 (skipped) when neither PATH nor the toolkit has it.
#   memcheck.sh TOOLKIT_BIN_DIR BINARY [ARGS...]
toolkit_bin=$1
shift
sanitizer=$(command -v compute-sanitizer || true)
[ -n "$sanitizer" ] || sanitizer=$toolkit_bin/compute-sanitizer
[ -x "$sanitizer" ] || { echo "memcheck: no compute-sanitizer on PATH or in $toolkit_bin: skipped"; exit 77; }
exec "$sanitizer" --tool memcheck --error-exitcode 1 "$@"
