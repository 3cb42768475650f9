// The JavaScript side of bench/tokenize.sh: @lenml/tokenizers (the
// tokenizers of transformers.js) encoding the same JSON-lines documents, one
// thread, timed after loading. Prints one JSON line: documents, tokens,
// bytes, seconds, MB/s and a digest of the ids to compare with ours.
//   node bench/tokenize_js.cjs NPM_PREFIX TOKENIZER_DIR CORPUS.jsonl
"use strict";
const fs = require("fs");
const path = require("path");
const [prefix, dir, corpus] = process.argv.slice(2);
const { TokenizerLoader } = require(path.resolve(prefix, "node_modules/@lenml/tokenizers"));
const tokenizer = TokenizerLoader.fromPreTrained({
  tokenizerJSON: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8")),
  tokenizerConfig: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"), "utf8")),
});
const docs = fs.readFileSync(corpus, "utf8").split("\n").filter((l) => l.length > 0).map((l) => JSON.parse(l).text);
const bytes = docs.reduce((n, d) => n + Buffer.byteLength(d, "utf8"), 0);
const t0 = process.hrtime.bigint();
let tokens = 0;
let digest = 0;
for (const d of docs) {
  const ids = tokenizer.encode(d, { add_special_tokens: false });
  tokens += ids.length;
  for (const id of ids) digest = (digest * 31 + id) % 1000000007;
}
const seconds = Number(process.hrtime.bigint() - t0) / 1e9;
console.log(JSON.stringify({ documents: docs.length, tokens, bytes, seconds, mb_per_s: bytes / 1e6 / seconds, digest }));
