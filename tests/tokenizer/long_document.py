#!/usr/bin/env python3
"""`shardtrain tokenize` on one document of 24 MiB on a single line: the
tokens must be right (counted here from the text, not by the tokenizer) and
the peak memory must stay near the bytes the document and its ids take.
Pre-tokenizing the whole line into millions of pieces before encoding any
of them peaked at about 30 times the input.

    long_document.py SHARDTRAIN_CLI
"""
import json
import os
import resource
import struct
import subprocess
import sys
import tempfile

cli = sys.argv[1]
WORDS = 8 * 1024 * 1024  # "ab" then " ab" again and again: 24 MiB, one line
# Peak resident memory above a one-word run, per input byte. At most the
# document (1), its normalized copy (1), one transient copy while ByteLevel
# prepends a space (1) and 4-byte ids, one per 3 bytes (1.3); measured 3.0.
# Holding every piece before encoding took 30.
BOUND = 6.0

# ByteLevel (GPT-2's split and byte alphabet) and a BPE that merges each word
# into one token: "ab" is id 5, " ab" (Ġab) id 6.
TOKENIZER = {
    "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
    "normalizer": None,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    "post_processor": None, "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "\u0120": 2, "\u0120a": 3, "x": 4, "ab": 5, "\u0120ab": 6},
              "merges": ["\u0120 a", "a b", "\u0120a b"]},
}


def tokenize(tmp, name, text):
    src = os.path.join(tmp, name + ".txt")
    with open(src, "w") as f:
        f.write(text)
    out = os.path.join(tmp, name + ".bin")
    run = subprocess.run([cli, "tokenize", "--quiet", "--threads", "1", "--tokenizer",
                          os.path.join(tmp, "tokenizer.json"), "--out", out, src],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    if run.returncode != 0:
        sys.exit(f"FAIL: tokenize {name} exited {run.returncode}: {run.stderr.strip()}")
    # Children are waited for one at a time: the high-water mark so far.
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    with open(out, "rb") as f:
        header = struct.unpack("<256i", f.read(1024))
        body = f.read()
    return peak, header, body


with tempfile.TemporaryDirectory() as tmp:
    with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
        json.dump(TOKENIZER, f)
    small_peak, _, _ = tokenize(tmp, "small", "ab")
    text = "ab" + " ab" * (WORDS - 1)
    peak, header, body = tokenize(tmp, "long", text)
    if header[:4] != (20240520, 1, WORDS, 0) or len(body) != 2 * WORDS:
        sys.exit(f"FAIL: header {header[:4]} and {len(body)} bytes of tokens; want {(20240520, 1, WORDS, 0)} "
                 f"and {2 * WORDS} bytes")
    ids = struct.unpack(f"<{WORDS}H", body)
    if ids[0] != 5 or ids.count(6) != WORDS - 1:
        sys.exit(f"FAIL: tokens {ids[:4]}...; want 5 and then {WORDS - 1} times 6")
    per_byte = (peak - small_peak) / len(text)
    print(f"one line of {len(text) / 2**20:.0f} MiB: peak RSS {peak / 2**20:.0f} MiB, "
          f"{small_peak / 2**20:.0f} MiB for one word: {per_byte:.1f} bytes per input byte (bound {BOUND})")
    if per_byte > BOUND:
        sys.exit(f"FAIL: {per_byte:.1f} bytes of memory per input byte; bound {BOUND}")
    print("long document: right tokens within the memory bound")
