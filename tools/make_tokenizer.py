#!/usr/bin/env python3
"""Train a small byte-level BPE tokenizer on data/corpus.txt.

Writes data/tokenizer/tokenizer.json (Hugging Face `tokenizers` layout) and
data/tokenizer/tokenizer_config.json. Standard library only; deterministic:
the same corpus gives byte-identical files on every run.

    python3 tools/make_tokenizer.py            # train and write both files
    python3 tools/make_tokenizer.py --check    # round trip and compression of the written file

The model:
  * pre-tokenizer: the Llama-3 word split (a `Split` regex, behavior
    Isolated) followed by `ByteLevel` (GPT-2's byte-to-unicode alphabet, no
    prefix space, no second regex);
  * 256 byte symbols (ids 0-255, in the order of GPT-2's byte table:
    the printable bytes '!'..'~', '\xa1'..'\xac', '\xae'..'\xff' first, then
    the remaining bytes as U+0100 onwards), then BPE merges learned on the
    word counts of the corpus until the vocabulary holds 2048 entries;
  * five special tokens after the merges (ids 2048-2052), the markers of the
    llama3 chat template: 2053 ids in all;
  * a TemplateProcessing post-processor that puts <|begin_of_text|> in front.

The regex: tokenizer.json carries the real pattern with Unicode property
classes (\\p{L}, \\p{N}), which PCRE2 (the C++ side) and JavaScript engines
understand. Python's `re` has no \\p{...} (and the `regex` module is not
assumed), so training splits the corpus with an approximation: \\p{L} is
[^\\W\\d_] (word characters that are neither digits nor '_'), \\p{N} is \\d.
On this mostly-ASCII corpus the two agree on nearly every character, and the
training split only needs to be close: it decides which merges are learned,
not how the written tokenizer encodes. The --check encoder uses the same
approximation, so its ids equal those of the real pattern wherever the text
has no letters or digits outside what `re` classifies the same way (e.g. all
ASCII text).
"""

import argparse
import hashlib
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "data", "corpus.txt")
OUT_DIR = os.path.join(ROOT, "data", "tokenizer")

VOCAB_SIZE = 2048  # byte symbols + merged tokens; the special tokens come on top

BOS = "<|begin_of_text|>"
EOT_TEXT = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOT_TEXT, START_HEADER, END_HEADER, EOT]

# The Llama-3 word split as written into tokenizer.json: contractions (any
# case), letters with one optional leading non-letter/non-digit (not a line
# break), digits in groups of up to three, punctuation runs with an optional
# leading space and trailing line breaks, line-break runs, and the remaining
# whitespace (a run that is followed by a non-space leaves its last space to
# the next word).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

# The same split for Python's `re` (see the module docstring).
_L = r"[^\W\d_]"
_N = r"\d"
_NOT_LN_NOT_CRLF = r"(?:[^\w\r\n]|_)"  # neither letter nor digit nor \r \n
_NOT_LN_NOT_SPACE = r"(?:[^\w\s]|_)"  # neither letter nor digit nor space
TRAINING_SPLIT = re.compile(
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    + r"|" + _NOT_LN_NOT_CRLF + r"?" + _L + r"+"
    + r"|" + _N + r"{1,3}"
    + r"| ?" + _NOT_LN_NOT_SPACE + r"+[\r\n]*"
    + r"|\s*[\r\n]+"
    + r"|\s+(?!\S)"
    + r"|\s+"
)


def byte_alphabet():
    """GPT-2's byte table: a list of (byte, char) in table order.

    Bytes that are printable Latin-1 characters stand for themselves; the
    others (controls, space, DEL, NBSP, soft hyphen, ...) take the code
    points 256, 257, ... in byte order.
    """
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
                 + list(range(0xAE, 0xFF + 1)))
    table = [(b, chr(b)) for b in printable]
    extra = 0
    for b in range(256):
        if b not in printable:
            table.append((b, chr(256 + extra)))
            extra += 1
    return table


BYTE_TABLE = byte_alphabet()
BYTE_TO_CHAR = {b: c for b, c in BYTE_TABLE}
CHAR_TO_BYTE = {c: b for b, c in BYTE_TABLE}


def to_byte_level(word):
    return "".join(BYTE_TO_CHAR[b] for b in word.encode("utf-8"))


def from_byte_level(chars):
    return bytes(CHAR_TO_BYTE[c] for c in chars)


# ---------------------------------------------------------------- training


def word_counts(text):
    counts = {}
    for w in TRAINING_SPLIT.findall(text):
        counts[w] = counts.get(w, 0) + 1
    return counts


def train(text, vocab_size, log):
    """Returns (tokens, merges): tokens[i] is id i's string, merges the
    (left, right) string pairs in rank order."""
    tokens = [c for _, c in BYTE_TABLE]
    token_id = {t: i for i, t in enumerate(tokens)}

    counts = word_counts(text)
    # Words in a fixed order (sorted), each as a list of symbol ids.
    words = []
    freqs = []
    for w in sorted(counts):
        words.append([token_id[c] for c in to_byte_level(w)])
        freqs.append(counts[w])
    log(f"{sum(freqs)} words, {len(words)} distinct")

    pair_count = {}
    pair_words = {}  # pair -> ids of words that held it (may be stale)
    for wi, (sym, f) in enumerate(zip(words, freqs)):
        for p in zip(sym, sym[1:]):
            pair_count[p] = pair_count.get(p, 0) + f
            pair_words.setdefault(p, set()).add(wi)

    merges = []
    while len(tokens) < vocab_size and pair_count:
        top = max(pair_count.values())
        # Ties: the pair whose strings sort first.
        best = min((p for p, c in pair_count.items() if c == top),
                   key=lambda p: (tokens[p[0]], tokens[p[1]]))
        a, b = best
        joined = tokens[a] + tokens[b]
        if joined in token_id:  # reached before by another split: same token
            new = token_id[joined]
        else:
            new = len(tokens)
            tokens.append(joined)
            token_id[joined] = new
        merges.append((tokens[a], tokens[b]))

        for wi in sorted(pair_words.pop(best, ())):
            sym = words[wi]
            f = freqs[wi]
            if len(sym) < 2:
                continue
            out = []
            i = 0
            changed = False
            while i < len(sym):
                if i + 1 < len(sym) and sym[i] == a and sym[i + 1] == b:
                    out.append(new)
                    i += 2
                    changed = True
                else:
                    out.append(sym[i])
                    i += 1
            if not changed:
                continue
            for p in zip(sym, sym[1:]):
                c = pair_count[p] - f
                if c:
                    pair_count[p] = c
                else:
                    del pair_count[p]
            for p in zip(out, out[1:]):
                pair_count[p] = pair_count.get(p, 0) + f
                if p != best:
                    pair_words.setdefault(p, set()).add(wi)
            words[wi] = out
        pair_count.pop(best, None)
    return tokens, merges


# ---------------------------------------------------------------- writing


def tokenizer_json(tokens, merges):
    n = len(tokens)
    added = [{"id": n + k, "content": t, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True}
             for k, t in enumerate(SPECIAL_TOKENS)]
    bos_id = n + SPECIAL_TOKENS.index(BOS)
    bos_item = {"SpecialToken": {"id": BOS, "type_id": 0}}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": SPLIT_PATTERN},
                 "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                 "use_regex": False},
            ],
        },
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos_item, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [bos_item, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": BOS, "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": [f"{x} {y}" for x, y in merges],
        },
    }


# A Llama-3-style chat template, in Jinja: BOS once, then for every message a
# header with its role, a blank line, the trimmed content and <|eot_id|>; with
# add_generation_prompt, an open assistant header. shardtrain recognises it as
# llama3 by <|start_header_id|> and <|eot_id|>.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' -}}"
    "{{- m['content'] | trim -}}"
    "{{- '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)


def tokenizer_config(n_base):
    decoder = {}
    for k, t in enumerate(SPECIAL_TOKENS):
        decoder[str(n_base + k)] = {"content": t, "lstrip": False, "normalized": False,
                                    "rstrip": False, "single_word": False, "special": True}
    return {
        "added_tokens_decoder": decoder,
        "bos_token": BOS,
        # The end of an assistant turn in the llama3 template: the token a
        # chat model must learn to emit and generation stops at.
        "eos_token": EOT,
        "pad_token": EOT_TEXT,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 1024,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }


def dump(obj, path):
    text = json.dumps(obj, ensure_ascii=False, indent=2) + "\n"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    os.replace(tmp, path)
    return text.encode("utf-8")


# ---------------------------------------------------------------- checking


class Encoder:
    """A small encoder/decoder for the written tokenizer.json (enough for it:
    added tokens, the training split, ByteLevel, BPE with ignore_merges,
    TemplateProcessing's BOS)."""

    def __init__(self, path):
        with open(path, encoding="utf-8") as f:
            j = json.load(f)
        model = j["model"]
        self.vocab = model["vocab"]
        self.ignore_merges = model.get("ignore_merges", False)
        self.ranks = {}
        for r, m in enumerate(model["merges"]):
            a, b = m.split(" ") if isinstance(m, str) else m
            self.ranks.setdefault((a, b), r)
        self.added = {t["content"]: t["id"] for t in j["added_tokens"]}
        self.id_to_token = {i: t for t, i in self.vocab.items()}
        self.id_to_added = {i: t for t, i in self.added.items()}
        single = j["post_processor"]["single"]
        specials = j["post_processor"]["special_tokens"]
        self.prefix = []
        for item in single:
            if "Sequence" in item:
                break
            self.prefix += specials[item["SpecialToken"]["id"]]["ids"]
        longest_first = sorted(self.added, key=lambda t: (-len(t), t))
        self.added_re = re.compile("|".join(re.escape(t) for t in longest_first))
        self.cache = {}

    def bpe(self, word):
        hit = self.cache.get(word)
        if hit is not None:
            return hit
        if self.ignore_merges and word in self.vocab:
            ids = [self.vocab[word]]
        else:
            parts = list(word)
            while len(parts) > 1:
                best = None
                for i in range(len(parts) - 1):
                    r = self.ranks.get((parts[i], parts[i + 1]))
                    if r is not None and (best is None or r < best[0]):
                        best = (r, i)
                if best is None:
                    break
                i = best[1]
                parts[i:i + 2] = [parts[i] + parts[i + 1]]
            ids = [self.vocab[p] for p in parts]
        self.cache[word] = ids
        return ids

    def encode(self, text, add_special_tokens=False):
        ids = list(self.prefix) if add_special_tokens else []
        at = 0
        for m in self.added_re.finditer(text):
            self._encode_plain(text[at:m.start()], ids)
            ids.append(self.added[m.group(0)])
            at = m.end()
        self._encode_plain(text[at:], ids)
        return ids

    def _encode_plain(self, text, ids):
        for w in TRAINING_SPLIT.findall(text):
            ids += self.bpe(to_byte_level(w))

    def decode(self, ids):
        out = []
        run = []
        for i in ids:
            if i in self.id_to_added:
                out.append(from_byte_level("".join(run)).decode("utf-8", "replace"))
                run = []
                out.append(self.id_to_added[i])
            else:
                run.append(self.id_to_token[i])
        out.append(from_byte_level("".join(run)).decode("utf-8", "replace"))
        return "".join(out)


SAMPLES = [
    "Hello, world!",
    "A hacker is a person who enjoys exploring the details of programmable systems.",
    "  Leading spaces, trailing spaces.   \n\nTwo newlines, then tabs\t\tand digits 1234567.",
    "Don't PANIC: it's 42 -- we'll see, they've said, I'm sure, you'd agree.",
    "Unicode: “curly quotes”, ‘single’, naïve café, Ø, ™, 日本語, emoji 🙂.",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is a kludge?<|eot_id|>",
]


def check(path):
    with open(path, encoding="utf-8") as f:
        j = json.load(f)
    n_vocab = len(j["model"]["vocab"])
    n_total = n_vocab + len(j["added_tokens"])
    print(f"{os.path.relpath(path, ROOT)}: valid JSON, {n_vocab} model tokens + "
          f"{len(j['added_tokens'])} added = {n_total} ids, {len(j['model']['merges'])} merges")
    with open(os.path.join(os.path.dirname(path), "tokenizer_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    tpl = cfg["chat_template"]
    assert "<|start_header_id|>" in tpl and "<|eot_id|>" in tpl, "chat_template lacks the llama3 markers"
    enc = Encoder(path)
    assert cfg["bos_token"] in enc.added and cfg["eos_token"] in enc.added
    ok = True
    for s in SAMPLES:
        ids = enc.encode(s)
        back = enc.decode(ids)
        good = back == s
        ok &= good
        print(f"  {'ok ' if good else 'BAD'} {len(s.encode('utf-8')):3d} bytes -> {len(ids):3d} tokens: {s!r}")
        if not good:
            print(f"      decoded as {back!r}")
    hello = "Hello, world!"
    print(f"  ids of {hello!r}: {enc.encode(hello)}")
    print(f"  with add_special_tokens: {enc.encode(hello, True)}")
    print(f"  tokens: {[enc.id_to_token[i] for i in enc.encode(hello)]}")

    with open(CORPUS, encoding="utf-8") as f:
        corpus = f.read()
    t0 = time.time()
    ids = enc.encode(corpus)
    n_bytes = len(corpus.encode("utf-8"))
    good = enc.decode(ids) == corpus
    ok &= good
    print(f"  corpus.txt: {n_bytes} bytes -> {len(ids)} tokens, {n_bytes / len(ids):.3f} bytes/token, "
          f"round trip {'ok' if good else 'BAD'} ({time.time() - t0:.1f} s)")
    used = len(set(ids))
    print(f"  distinct ids used on the corpus: {used} of {n_total}")
    if not ok:
        sys.exit("round trip failed")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="check the written tokenizer.json instead of training")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE,
                    help="byte symbols + merged tokens (default %(default)s)")
    args = ap.parse_args()
    path = os.path.join(OUT_DIR, "tokenizer.json")
    if args.check:
        check(path)
        return

    t0 = time.time()

    def log(msg):
        print(f"[{time.time() - t0:6.1f} s] {msg}", flush=True)

    with open(CORPUS, encoding="utf-8") as f:
        text = f.read()
    log(f"read {os.path.relpath(CORPUS, ROOT)}: {len(text.encode('utf-8'))} bytes")
    tokens, merges = train(text, args.vocab_size, log)
    log(f"{len(tokens)} tokens ({len(merges)} merges) + {len(SPECIAL_TOKENS)} special = "
        f"{len(tokens) + len(SPECIAL_TOKENS)} ids")
    for name, obj in (("tokenizer.json", tokenizer_json(tokens, merges)),
                      ("tokenizer_config.json", tokenizer_config(len(tokens)))):
        data = dump(obj, os.path.join(OUT_DIR, name))
        log(f"wrote data/tokenizer/{name}: {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}")


if __name__ == "__main__":
    main()
