"""What the benchmark renderers share: result lines (JSON, one per line),
the number formats, and writing one marked section of BENCHMARKS.md."""
import json
import os
import sys

HEADER = """# Benchmarks

Every figure here comes from the command shown with its section, run on the
machine described there. These are shared 2-core build machines, so absolute
numbers move from run to run; the ratios within one run (shardtrain against
PyTorch, against memcpy) are what to read.
"""


def load_jsonl(path, who):
    """The JSON objects of `path`, one per non-empty line; exits naming the
    line that is not JSON."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"{who}: {path}:{i}: not JSON: {e}")
    return rows


def append_jsonl(path, row):
    """Prints `row` as one JSON line and appends it to `path`."""
    line = json.dumps(row)
    print(line)
    with open(path, "a") as f:
        f.write(line + "\n")


def human_params(n):
    return f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.0f} K"


def write_section(out, begin, end, section, who, before="", after=""):
    """Puts `section` (which starts with `begin` and ends with `end`) in
    place of the marked section of `out`; when `out` has none, appends it
    between `before` (e.g. a heading) and `after` (e.g. a placeholder for the
    hand-written reading); a new file starts with HEADER. Text outside the
    markers (the readings) is kept. Exits when only one marker is there."""
    text = open(out).read() if os.path.exists(out) else HEADER
    b, e = text.find(begin), text.find(end)
    if b != -1 and e > b:
        text = text[:b] + section + text[e + len(end):]
    elif b == -1 and e == -1:
        text = text.rstrip("\n") + "\n\n" + before + section + "\n" + after
    else:
        sys.exit(f"{who}: {out} has {begin} or {end} without the other; fix it by hand")
    with open(out + ".tmp", "w") as f:
        f.write(text)
    os.replace(out + ".tmp", out)
