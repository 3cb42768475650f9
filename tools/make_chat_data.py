#!/usr/bin/env python3
"""Derive a small chat data set from the Jargon File's lexicon.

Reads data/corpus.txt and writes data/chat.jsonl: one JSON object a line,
{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}, some with
a system message first. The user asks what a lexicon term means; the
assistant answers with the start of the entry's definition. Standard library
only; deterministic: the same corpus gives a byte-identical file every run.

    python3 tools/make_chat_data.py

Lexicon entries in corpus.txt start with a header line `:TERM: ...` (the
rest of the line is the pronunciation and part of speech, e.g.
`:ABEND: /a´bend/, /@·bend´/, n.`), followed by paragraphs up to the next
header. A definition may open with a bracketed note on origin or usage
(`[from the Unix null device, used as a data sink]`) and may be split into
numbered senses (`1. ...`). The answer is taken from the first sense: the
notes and part-of-speech tags in front are dropped, cross-references
`{term}` lose their braces, and whitespace is collapsed. The answer is the
first sentence, plus the second when both fit in MAX_TWO characters; a first
sentence longer than MAX_ANSWER characters is cut at a word and ends in
"...". Entries whose answer would only point elsewhere ("See foo.",
"Syn. bar.") are left out, so are repeated terms. The records are shuffled
with a fixed seed (a SplitMix64 generator written out here, independent of
Python's `random`), which also picks the question wording (one of four), and
whether a system message (one of three) comes first, for about a third.
"""

import json
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "data", "corpus.txt")
OUT = os.path.join(ROOT, "data", "chat.jsonl")

SEED = 20031229  # the date of Jargon File 4.4.7
MAX_ANSWER = 300  # a single sentence longer than this is cut
MAX_TWO = 220  # a second sentence is added only while the answer stays this short
MIN_ANSWER = 12

QUESTIONS = [
    'What does "{}" mean?',
    'What is "{}" in hacker slang?',
    'Define the jargon term "{}".',
    'Explain "{}" briefly.',
]
SYSTEMS = [
    "You explain hacker slang briefly.",
    "You are a concise guide to the Jargon File.",
    "Answer questions about hacker jargon in a sentence or two.",
]

HEADER = re.compile(r"^:(.+?):(?:\s.*)?$")
SENSE = re.compile(r"^\d+\.\s+")
# Part-of-speech and usage tags that may open a sense: "n.", "vt.", "n.,v.", "obs." ...
POS_TAG = re.compile(r"^(?:(?:n|v|vi|vt|adj|adv|interj|excl|obs|pref|suff|prov|conj|prep|pron|pl)\.,?\s*)+(?=\S)")
# A paragraph that only lists variants or spellings: not a definition.
VARIANTS = re.compile(r"^(?:alt|var|also)\.?:")
# An answer that only points elsewhere ("See foo.", "Syn. bar."): the entry is left out.
REDIRECT = re.compile(r"^(?:See|Syn\b|Same as|Compare|Var\.|Variant of)")
# What a definition starts with once cleaned.
GOOD_START = re.compile(r"^[A-Z0-9“‘\"'(]")
# Words that end in a period without ending a sentence.
ABBREVIATIONS = {
    "e.g.", "i.e.", "esp.", "etc.", "cf.", "vs.", "viz.", "approx.", "obs.", "var.",
    "Mr.", "Mrs.", "Dr.", "St.", "Jr.", "Sr.", "Inc.", "Ltd.", "Co.", "Corp.", "No.",
    "vol.", "ed.", "Syn.", "U.S.", "U.K.", "A.I.", "n.", "v.", "vt.", "vi.", "adj.", "adv.",
}
SENTENCE_END = re.compile(r"[.!?][”’\"')\]]*(?=\s+[A-Z0-9“‘\"'(\[{])")


def lexicon(text):
    """(term, body) pairs in file order, from the lexicon part of the corpus."""
    lines = text.split("\n")
    start = lines.index("Glossary") + 1
    # The lexicon ends where "Part III. Appendices" begins (its spaces may be
    # no-break spaces).
    end = next(i for i, line in enumerate(lines) if re.fullmatch(r"\s*Part\s+III\.\s+Appendices\s*", line))
    entries = []
    term, body = None, []
    for line in lines[start:end]:
        m = HEADER.match(line)
        if m:
            if term is not None:
                entries.append((term, "\n".join(body)))
            term, body = m.group(1).strip(), []
        elif term is not None:
            body.append(line)
    if term is not None:
        entries.append((term, "\n".join(body)))
    return entries


def strip_leading_group(s, open_ch, close_ch):
    """`s` without a leading balanced (open_ch ... close_ch) group, or None."""
    if not s.startswith(open_ch):
        return None
    depth = 0
    for i, c in enumerate(s):
        if c == open_ch:
            depth += 1
        elif c == close_ch:
            depth -= 1
            if depth == 0:
                return s[i + 1:].lstrip()
    return None


def clean(paragraph):
    s = " ".join(paragraph.split())
    while True:  # notes, sense numbers and part-of-speech tags in front, in any order
        before = s
        s = SENSE.sub("", s)
        s = POS_TAG.sub("", s)
        for open_ch, close_ch in (("[", "]"), ("(", ")")):
            rest = strip_leading_group(s, open_ch, close_ch)
            if rest is not None:
                s = rest
        s = s.lstrip(" .,;:")
        if s == before:
            break
    s = s.replace("{", "").replace("}", "").strip()
    if s[:1].islower():
        s = s[0].upper() + s[1:]
    return s


def sentences(s):
    out = []
    at = 0
    for m in SENTENCE_END.finditer(s):
        end = m.end()
        word = s[:m.start() + 1].rsplit(" ", 1)[-1]
        if word in ABBREVIATIONS or re.fullmatch(r"(?:[A-Za-z]\.)+", word):
            continue  # "e.g.", "U.S.", an initial
        out.append(s[at:end].strip())
        at = end
    if s[at:].strip():
        out.append(s[at:].strip())
    return out


def answer(body):
    for paragraph in re.split(r"\n\s*\n", body):
        s = clean(paragraph)
        if len(s) < MIN_ANSWER or VARIANTS.match(s):
            continue
        if not GOOD_START.match(s):
            return None  # e.g. an unbalanced bracket in front
        parts = sentences(s)
        text = parts[0]
        if len(text) > MAX_ANSWER:
            cut = text[:MAX_ANSWER - 3]
            cut = cut[:cut.rfind(" ")] if " " in cut else cut
            return cut.rstrip(" ,;:—-") + "..."
        if len(parts) > 1 and len(text) + 1 + len(parts[1]) <= MAX_TWO:
            text += " " + parts[1]
        if REDIRECT.match(text) and len(text) <= 60:
            return None
        return text
    return None


class SplitMix64:
    """A tiny seeded generator, so the order does not depend on Python's `random`."""

    def __init__(self, seed):
        self.state = seed & 0xFFFFFFFFFFFFFFFF

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return z ^ (z >> 31)

    def below(self, n):
        return self.next() % n  # the bias is negligible for small n


def main():
    with open(CORPUS, encoding="utf-8") as f:
        text = f.read()
    entries = lexicon(text)
    seen = set()
    pairs = []
    skipped = 0
    for term, body in entries:
        a = answer(body)
        if a is None or term in seen:
            skipped += 1
            continue
        seen.add(term)
        pairs.append((term, a))

    rng = SplitMix64(SEED)
    for i in range(len(pairs) - 1, 0, -1):  # Fisher-Yates
        j = rng.below(i + 1)
        pairs[i], pairs[j] = pairs[j], pairs[i]

    lines = []
    n_system = 0
    for term, a in pairs:
        messages = []
        if rng.below(3) == 0:
            messages.append({"role": "system", "content": SYSTEMS[rng.below(len(SYSTEMS))]})
            n_system += 1
        q = QUESTIONS[rng.below(len(QUESTIONS))].format(term)
        messages.append({"role": "user", "content": q})
        messages.append({"role": "assistant", "content": a})
        lines.append(json.dumps({"messages": messages}, ensure_ascii=False, separators=(",", ":")))
    data = ("\n".join(lines) + "\n").encode("utf-8")
    tmp = OUT + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, OUT)
    print(f"{len(entries)} lexicon entries, {skipped} skipped (no usable definition, a bare cross-reference, or a repeated term)")
    print(f"wrote {os.path.relpath(OUT, ROOT)}: {len(lines)} records ({n_system} with a system message), "
          f"{len(data)} bytes")


if __name__ == "__main__":
    main()
