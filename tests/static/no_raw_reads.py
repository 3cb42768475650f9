#!/usr/bin/env python3
"""Every file the project reads goes through the one guarded reader,
src/core/file.cpp (regular files only, capped, typed errors naming the file).

This check fails when a raw read appears anywhere else in src/, tools/ or
include/: a std::ifstream (or fstream, basic_ifstream), fopen/freopen, or a
raw open()/openat() call. A raw open() that cannot read (O_WRONLY) is a
writer and passes; the few other raw opens are listed below, each with why.

  no_raw_reads.py SOURCE_DIR
"""
import os
import re
import sys

import cxx_text  # beside this script

# The one reader.
READER = "src/core/file.cpp"

# Raw opens that are not reads of a file a user named: (path, the call's
# text as a regular expression). Matched against the whole call, so a new
# raw read added to one of these files is still caught.
ALLOWED = [
    # The run directory's lock file: O_RDWR|O_CREAT|O_NOFOLLOW, locked with
    # flock and never read.
    ("src/train/run_dir.cpp", r"::open\(lock\.c_str\(\), O_RDWR \| O_CREAT \| O_CLOEXEC \| O_NOFOLLOW"),
    # A directory opened to fsync it after a rename (O_DIRECTORY: never read).
    ("src/checkpoint/io.cpp", r"::open\(dir\.c_str\(\), O_RDONLY \| O_DIRECTORY"),
    # /dev/null as the ranks' standard input (the launcher and its fork server).
    ("src/launch/fork_server.cpp", r'::open\("/dev/null", O_RDONLY'),
    ("src/launch/rank_group.cpp", r'::open\("/dev/null", O_RDONLY'),
]

EXTENSIONS = (".cpp", ".cc", ".c", ".h", ".hpp")

# What a raw read looks like, in code with comments and strings removed.
STREAM = re.compile(r"\b(i?fstream|basic_i?fstream)\b")
FOPEN = re.compile(r"\b(fopen|freopen|fopen64)\s*\(")
# open()/openat() called as the C function: global-qualified (::open),
# or unqualified after an operator, a paren, a comma or `return`. A member or
# a class's own open (x.open, Type::open, a declaration `T open(`) is not.
RAW_OPEN = re.compile(r"(?:(?<![\w:>.])::\s*|(?:[=(,!]|\breturn)\s*)(open|openat|open64)\s*\(")


def strip(code):
    """Comments and string literals blanked (lengths kept), so that prose
    mentioning open() or ifstream is not flagged; #include lines too (<fstream>
    is included for writers). Every offset stays that of the file."""
    return cxx_text.blank(code, "include")


def call_text(code, start):
    """The call from `start` to its closing parenthesis (several lines)."""
    depth, i = 0, code.index("(", start)
    while i < len(code):
        depth += {"(": 1, ")": -1}.get(code[i], 0)
        if depth == 0:
            return code[start:i + 1]
        i += 1
    return code[start:]


def check(root):
    problems = []
    for top in ("src", "tools", "include"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                if not name.endswith(EXTENSIONS):
                    continue
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, root)
                if rel == READER:
                    continue
                with open(full, encoding="utf-8", errors="replace") as f:
                    raw = f.read()
                code = strip(raw)
                line_of = lambda pos: code.count("\n", 0, pos) + 1
                for m in STREAM.finditer(code):
                    problems.append((rel, line_of(m.start()), m.group(1)))
                for m in FOPEN.finditer(code):
                    problems.append((rel, line_of(m.start()), m.group(1) + "("))
                for m in RAW_OPEN.finditer(code):
                    start = m.start(1)
                    start = code.rfind("::", 0, start) if code[:start].rstrip().endswith("::") else start
                    # The call's own text, strings restored, to match the allow-list.
                    text = call_text(raw, start)
                    if "O_WRONLY" in text:
                        continue  # a writer: it cannot read
                    if any(rel == path and re.match(pattern, text) for path, pattern in ALLOWED):
                        continue
                    problems.append((rel, line_of(m.start(1)), " ".join(text.split())[:80]))
    return problems


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    problems = check(root)
    for rel, line, what in problems:
        print(f"{rel}:{line}: raw read `{what}`: read files through src/core/file.h "
              "(open_regular_for_reading, read_regular_file, LineReader)")
    if problems:
        print(f"FAIL: {len(problems)} raw read(s) outside {READER}")
        return 1
    print(f"no raw reads outside {READER}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
