#!/usr/bin/env python3
"""No function in src/ is over 80 lines, and none in the trainer's own files
(src/train/trainer.cpp, src/train/step.cpp) is over 40 (issue 46): a longer
one is split into named helpers, one concept each.

A function is measured from the first line of its signature (a `template`
line included) to its closing brace, both included; comments and blank lines
inside count like code. Found by matching braces in the code with comments,
string and character literals and preprocessor lines blanked: a `{` at
namespace or class scope whose declaration ends in `)` (or a qualifier such
as `const` or `override`, a trailing return type, or a constructor's
initializer list) opens a function. Functions defined inside a class count
as well; lambdas and local classes count as part of the function around them.

Exempt, as tables rather than code: the key tables of src/config/schema.cpp,
the functions whose names start with `declare_` (one `.key(...)` entry per
config key, each with its rule and its doc line).

Before the tree is scanned, the detector is run on a built-in sample with
functions of known lengths (81 and 79 lines, among others): it must flag the
81-line one and nothing else, so that a checker that misses long functions
fails here even when src/ is clean.

  function_length.py SOURCE_DIR

Prints `path:line: NAME is N lines (limit L)` for each function over its
limit and exits 1 if there is any.
"""
import os
import re
import sys

import cxx_text  # beside this script

DEFAULT_LIMIT = 80
# Stricter limits, by file.
LIMITS = {
    "src/train/trainer.cpp": 40,
    "src/train/step.cpp": 40,
}
# (file, name prefix): functions that are tables, not code.
EXEMPT = [
    ("src/config/schema.cpp", "declare_"),
]

EXTENSIONS = (".cpp", ".cc", ".h", ".hpp")

# Qualifiers that may stand between a function's `)` and its body.
QUALIFIERS = {"const", "override", "final", "noexcept", "mutable", "try", "volatile", "&", "&&"}


def strip(code):
    """Comments, string and character literals (raw strings too) and
    preprocessor lines blanked; line breaks kept, so line numbers stay."""
    return cxx_text.blank(code, "all")


def strip_template(head):
    """The head without a leading `template <...>` (nested angles included)."""
    m = re.match(r"\s*template\s*<", head)
    if not m:
        return head
    depth, i = 1, m.end()
    while i < len(head) and depth > 0:
        depth += {"<": 1, ">": -1}.get(head[i], 0)
        i += 1
    return strip_template(head[i:])


def opens_function(head):
    """Whether a `{` after `head` (at namespace or class scope) opens a
    function body."""
    h = strip_template(head).strip()
    if "(" not in h:
        return False
    last = re.findall(r"\w+|&&|->|\S", h)
    if not last:
        return False
    if last[-1] == ")" or last[-1] in QUALIFIERS:
        return True
    # A constructor's initializer list ending in a braced member: x_{...}.
    if last[-1] == "}" and re.search(r"\)\s*:(?!:)", h):
        return True
    # A trailing return type: `auto f(...) -> T {`.
    close = h.rfind(")")
    return "->" in h[close:]


def function_name(head):
    h = strip_template(head)
    m = re.search(r"([\w:~]*operator\s*(?:\(\)|[^\s\w(]+|\s\w[\w:<>]*))\s*\(", h)
    if m:
        return re.sub(r"\s+", " ", m.group(1)).strip()
    m = re.search(r"((?:\w+(?:<[\w\s,:]*(?:<[\w\s,:]*>[\w\s,:]*)*>)?::)*~?\w+)\s*\(", h)
    return m.group(1) if m else "(lambda)"


def functions(code):
    """(name, first line, number of lines) of each function in C++ source
    text, in order."""
    text = strip(code)
    line_of = lambda pos: text.count("\n", 0, pos) + 1
    found = []
    # Scopes: "ns" (namespace or file), "class", "function", "other".
    stack = []  # (kind, head start, name)
    head_start = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        kind = stack[-1][0] if stack else "ns"
        if c == ";" and kind in ("ns", "class"):
            head_start = i + 1
        elif c == ":" and kind == "class" and re.search(
                r"\b(public|private|protected)\s*$", text[head_start:i]) and text[i + 1:i + 2] != ":":
            head_start = i + 1  # an access label
        elif c == "{":
            if kind not in ("ns", "class"):
                stack.append(("other", i, None))
            else:
                head = text[head_start:i]
                bare = strip_template(head).strip()
                if re.match(r"(inline\s+)?namespace\b|extern\b", bare):
                    stack.append(("ns", i, None))
                    head_start = i + 1
                elif re.match(r"(typedef\s+)?enum\b", bare):
                    stack.append(("other", i, None))
                elif re.search(r"\b(class|struct|union)\b", bare.split("(")[0]) and "=" not in bare.split("(")[0]:
                    stack.append(("class", i, None))
                    head_start = i + 1
                elif opens_function(head):
                    start = head_start + (len(head) - len(head.lstrip()))
                    stack.append(("function", start, function_name(head)))
                elif re.search(r"\)\s*:(?!:)", bare) and re.search(r"[\w>]\s*$", bare):
                    # A braced member in a constructor's initializer list.
                    stack.append(("init", i, None))
                else:
                    stack.append(("other", i, None))
        elif c == "}":
            if stack:
                kind, start, name = stack.pop()
                if kind == "function":
                    found.append((name, line_of(start), line_of(i) - line_of(start) + 1))
                if kind in ("function", "ns", "class"):
                    head_start = i + 1
        i += 1
    return found


def limit_for(rel):
    return LIMITS.get(rel, DEFAULT_LIMIT)


def exempt(rel, name):
    base = name.split("::")[-1]
    return any(rel == path and base.startswith(prefix) for path, prefix in EXEMPT)


def offenders(rel, code):
    """(line, name, lines, limit) of each function of `code` over its limit."""
    limit = limit_for(rel)
    return [(line, name, length, limit) for name, line, length in functions(code)
            if length > limit and not exempt(rel, name)]


def sample_function(name, lines):
    """A function of exactly `lines` lines, with what the detector must see
    through: comments and strings holding braces, a lambda, a local struct."""
    assert lines >= 8
    body = [
        "  // a comment with a brace {",
        '  const char* s = "}{ not code";',
        "  auto f = [](int x) { return x + 1; };",
        "  struct Local { int y = 0; };",
        "  char c = '{';",
    ]
    signature = ["int %s(int a," % name, "    int b) {"]
    body += ["  a += f(%d);" % k for k in range(lines - len(signature) - len(body) - 1)]
    return signature + body + ["}"]


def self_check():
    """The detector on a sample with known lengths: a function of 81 lines
    is flagged, one of 79 is not, nor are functions in a namespace or a class
    of 80 lines or fewer."""
    lines = ["// sample", "#include <string>", "namespace sample {", ""]
    lines += sample_function("long_one", 81)
    lines += [""]
    lines += sample_function("short_one", 79)
    lines += ["", "struct Holder {", " public:"]
    lines += ["  " + line if line else line for line in sample_function("member", 80)]
    lines += ["};", "", "}  // namespace sample", ""]
    got = offenders("src/sample.cpp", "\n".join(lines))
    want = [(5, "long_one", 81, DEFAULT_LIMIT)]
    if got != want:
        print(f"self-check FAILED: on a sample with functions of 81, 79 and 80 lines the detector "
              f"flagged {got}, expected {want}")
        return False
    return True


def check(root):
    problems = []
    for dirpath, dirs, files in os.walk(os.path.join(root, "src")):
        dirs.sort()
        for name in sorted(files):
            if not name.endswith(EXTENSIONS):
                continue
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            with open(full, encoding="utf-8", errors="replace") as f:
                code = f.read()
            for line, fn, length, limit in offenders(rel, code):
                problems.append(f"{rel}:{line}: {fn} is {length} lines (limit {limit})")
    return problems


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    if not self_check():
        return 1
    problems = check(root)
    for p in problems:
        print(p)
    if problems:
        print(f"FAIL: {len(problems)} function(s) over their limit ({DEFAULT_LIMIT} lines in src/, "
              + ", ".join(f"{limit} in {path}" for path, limit in sorted(LIMITS.items()))
              + "); split them into named helpers")
        return 1
    print(f"no function in src/ over {DEFAULT_LIMIT} lines (" +
          ", ".join(f"{limit} in {path}" for path, limit in sorted(LIMITS.items())) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
