#!/usr/bin/env bash
# Installs every Debian package dsv4 needs (apt only; idempotent) and builds Release into build/.
#   DSV4_CUDA_ARCHITECTURES  CUDA targets (default "90a;120;121"; CI uses "90a")
#   DSV4_BUILD_DIR           build folder (default build)
#   DSV4_SKIP_APT=1          skip the package step (already installed)
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake ninja-build pkg-config git
  libgtest-dev libgmock-dev libbenchmark-dev
  libfmt-dev nlohmann-json3-dev libcli11-dev libpcre2-dev libxxhash-dev libcpp-httplib-dev
  clang libclang-rt-dev
  nodejs npm gnuplot-nox curl
)

if [[ "${DSV4_SKIP_APT:-0}" != 1 ]]; then
  missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  # node and npm may come from outside Debian on some machines: accept a working node 18+ instead.
  if command -v node >/dev/null && command -v npm >/dev/null; then
    missing=("${missing[@]/nodejs}"); missing=("${missing[@]/npm}")
  fi
  read -r -a missing <<<"${missing[*]}"
  if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}"
    sudo_cmd=(); [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
fi

build_dir=${DSV4_BUILD_DIR:-build}
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  ${DSV4_CUDA_ARCHITECTURES:+-DDSV4_CUDA_ARCHITECTURES="$DSV4_CUDA_ARCHITECTURES"}
cmake --build "$build_dir" -j "$(nproc)"
echo "setup: built into $build_dir/bin"
