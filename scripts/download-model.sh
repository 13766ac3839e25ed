#!/usr/bin/env bash
# Downloads published DeepSeek V4 Flash GGUF files from Hugging Face, with resume, a free-space check before starting,
# SHA-256 verification against the hub's listing, and a stable link to the chosen file.
#
#   ./scripts/download-model.sh TARGET [--dir DIR] [--token TOKEN]
#
# Targets (antirez/deepseek-v4-gguf, the files ds4 publishes; sizes approximate):
#   q2            2-bit routed experts, imatrix (81 GB): for 96-128 GB of memory (DGX Spark, one H200)
#   q4            4-bit routed experts, imatrix (153 GB): for 192 GB and more (two H200, large CPU machines)
#   q2-legacy     the same without imatrix
#   q4-legacy     the same without imatrix
#   mtp           ds4's separate MTP file (3.6 GB, optional: dsv4-server --mtp FILE)
# unsloth/DeepSeek-V4-Flash-0731-GGUF (the 0731 weights; split into parts, all of them are fetched):
#   0731-q2 0731-q3 0731-q4 0731-q8   the UD-Q2_K_XL / UD-Q3_K_XL / UD-Q4_K_XL / UD-Q8_K_XL folders
#   0731:FOLDER                       any other quantization folder of that repository
#
# Files land in DIR (default ./models, or $DSV4_MODEL_DIR). After a model download, DIR/deepseek-v4-flash.gguf links to
# it (the first part of a split file); after mtp, DIR/deepseek-v4-flash-mtp.gguf. Run the same command again to resume
# an interrupted download. A file whose SHA-256 differs from the hub's is deleted and the command fails.
#
# Environment: HF_TOKEN (or ~/.cache/huggingface/token) for gated or rate-limited downloads; DSV4_HF_ENDPOINT
# (default https://huggingface.co; the tests point it at a local server); DSV4_DOWNLOAD_ATTEMPTS (default 5).
set -euo pipefail

die() { echo "download-model: $*" >&2; exit 1; }

usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; }

[[ $# -ge 1 ]] || { usage >&2; exit 2; }
[[ $1 == -h || $1 == --help ]] && { usage; exit 0; }
target=$1; shift
dir=${DSV4_MODEL_DIR:-models}
token=${HF_TOKEN:-}
while [[ $# -gt 0 ]]; do
  case $1 in
    --dir) dir=${2:?--dir needs a folder}; shift 2 ;;
    --token) token=${2:?--token needs a value}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option $1" ;;
  esac
done
if [[ -z $token && -s $HOME/.cache/huggingface/token ]]; then token=$(<"$HOME/.cache/huggingface/token"); fi
endpoint=${DSV4_HF_ENDPOINT:-https://huggingface.co}
attempts=${DSV4_DOWNLOAD_ATTEMPTS:-5}

ds4_repo=antirez/deepseek-v4-gguf
unsloth_repo=unsloth/DeepSeek-V4-Flash-0731-GGUF
link=deepseek-v4-flash.gguf
q2_name=DeepSeek-V4-Flash-IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8-chat-v2
q4_name=DeepSeek-V4-Flash-Q4KExperts-F16HC-F16Compressor-F16Indexer-Q8Attn-Q8Shared-Q8Out-chat-v2
case $target in
  q2) repo=$ds4_repo; select="$q2_name-imatrix.gguf" ;;
  q4) repo=$ds4_repo; select="$q4_name-imatrix.gguf" ;;
  q2-legacy) repo=$ds4_repo; select="$q2_name.gguf" ;;
  q4-legacy) repo=$ds4_repo; select="$q4_name.gguf" ;;
  mtp) repo=$ds4_repo; select="DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf"; link=deepseek-v4-flash-mtp.gguf ;;
  0731-q2) repo=$unsloth_repo; select="UD-Q2_K_XL/" ;;
  0731-q3) repo=$unsloth_repo; select="UD-Q3_K_XL/" ;;
  0731-q4) repo=$unsloth_repo; select="UD-Q4_K_XL/" ;;
  0731-q8) repo=$unsloth_repo; select="UD-Q8_K_XL/" ;;
  0731:*) repo=$unsloth_repo; select="${target#0731:}/" ;;
  *) usage >&2; die "unknown target '$target'" ;;
esac

command -v curl >/dev/null || die "curl is needed (apt-get install curl)"
command -v sha256sum >/dev/null || die "sha256sum is needed (coreutils)"
if command -v node >/dev/null; then json_tool=node
elif command -v python3 >/dev/null; then json_tool=python3
else die "node or python3 is needed to read the hub's file listing"; fi

auth=(); [[ -n $token ]] && auth=(-H "Authorization: Bearer $token")

# The hub's listing of the selected files: one "path size sha256" line each. A folder selection lists every .gguf in
# it (split files come as NAME-00001-of-0000N.gguf and sort in order).
listing_url="$endpoint/api/models/$repo/tree/main"
[[ $select == */ ]] && listing_url+="/${select%/}"
listing=$(curl -fsSL "${auth[@]}" "$listing_url?recursive=true") ||
  die "cannot list $repo on $endpoint (no network, a wrong folder, or the repository needs HF_TOKEN)"
if [[ $json_tool == node ]]; then
  files=$(SEL="$select" node -e '
    let input = "";
    process.stdin.on("data", (d) => (input += d)).on("end", () => {
      const sel = process.env.SEL;
      const out = [];
      for (const it of JSON.parse(input)) {
        if (it.type !== "file" || !it.path.endsWith(".gguf")) continue;
        if (!(sel.endsWith("/") ? it.path.startsWith(sel) : it.path === sel)) continue;
        const lfs = it.lfs || {};
        out.push(`${it.path} ${lfs.size ?? it.size} ${lfs.oid ?? ""}`);
      }
      console.log(out.sort().join("\n"));
    });' <<<"$listing")
else
  files=$(SEL="$select" python3 -c '
import json, os, sys
sel = os.environ["SEL"]
out = []
for it in json.load(sys.stdin):
    path = it.get("path", "")
    if it.get("type") != "file" or not path.endswith(".gguf"):
        continue
    if not (path.startswith(sel) if sel.endswith("/") else path == sel):
        continue
    lfs = it.get("lfs") or {}
    out.append("%s %s %s" % (path, lfs.get("size", it.get("size")), lfs.get("oid", "")))
print("\n".join(sorted(out)))' <<<"$listing")
fi
[[ -n $files ]] || die "$repo has no file matching '$select' (see $endpoint/$repo/tree/main)"

mkdir -p "$dir"
# Free space: what is still missing must fit, with 1 GiB to spare.
need=0
while read -r path size sha; do
  out="$dir/$(basename "$path")"
  [[ -f $out.sha256 && $(<"$out.sha256") == "$sha" && -f $out ]] && continue
  have=0; [[ -f $out.part ]] && have=$(stat -c %s "$out.part")
  need=$((need + size - have))
done <<<"$files"
avail=$(df -PB1 "$dir" | awk 'NR == 2 { print $4 }')
if (( need + (1 << 30) > avail )); then
  die "not enough space in $dir: $(( need >> 20 )) MiB to download, $(( avail >> 20 )) MiB free"
fi

first=""
while read -r path size sha; do
  name=$(basename "$path")
  out="$dir/$name"
  [[ -z $first ]] && first=$name
  if [[ -f $out && -f $out.sha256 && $(<"$out.sha256") == "$sha" ]]; then
    echo "already downloaded: $out"
    continue
  fi
  url="$endpoint/$repo/resolve/main/$path"
  echo "downloading $name ($(( size >> 20 )) MiB) from $endpoint/$repo"
  ok=0
  for ((attempt = 1; attempt <= attempts; attempt++)); do
    have=0; [[ -f $out.part ]] && have=$(stat -c %s "$out.part")
    (( have >= size )) && { ok=1; break; }
    # -C -: continue from what the .part file already holds.
    if curl -fL --progress-bar -C - "${auth[@]}" -o "$out.part" "$url"; then ok=1; break; fi
    echo "download-model: interrupted (attempt $attempt of $attempts); resuming" >&2
    sleep 1
  done
  if (( ! ok )); then
    die "could not download $name; run the same command again to resume"
  fi
  if [[ -n $sha ]]; then
    echo "verifying $name"
    got=$(sha256sum "$out.part" | cut -d' ' -f1)
    if [[ $got != "$sha" ]]; then
      rm -f "$out.part"
      die "$name is corrupt: SHA-256 $got, the hub lists $sha; deleted, run the command again"
    fi
  else
    echo "download-model: the hub lists no SHA-256 for $name; size checked only" >&2
    [[ $(stat -c %s "$out.part") == "$size" ]] || { rm -f "$out.part"; die "$name has the wrong size; deleted"; }
  fi
  mv -f "$out.part" "$out"
  echo "$sha" >"$out.sha256"
done <<<"$files"

ln -sfn "$first" "$dir/$link"
echo "linked $dir/$link -> $first"
if [[ $target == mtp ]]; then
  echo "serve it with: ./scripts/run.sh $dir/deepseek-v4-flash.gguf --mtp $dir/$link"
else
  echo "serve it with: ./scripts/run.sh $dir/$link"
fi
