"""C++ source text with comments and string and character literals (raw
strings too) blanked, for the checks of the source tree: every character
keeps its offset and every line break its line, so a position found in the
result is that of the file. Digit separators (1'000'000) are not quotes.
"""
import re


def blank(code, directives):
    """`directives`: "all" blanks every preprocessor line (with its
    backslash-continued lines), "include" only the #include ones; the other
    directives are read as code."""
    out = []
    i, n = 0, len(code)
    at_line_start = True
    while i < n:
        c = code[i]
        if at_line_start and c == "#":
            # A directive, with its backslash-continued lines.
            j = i
            while True:
                k = code.find("\n", j)
                k = n if k < 0 else k
                if k > j and code[k - 1] == "\\" and k < n:
                    j = k + 1
                    continue
                break
            if directives == "all" or re.match(r"#[ \t]*include", code[i:k]):
                out.append(re.sub(r"[^\n]", " ", code[i:k]))
                i = k
                continue
        if c == "\n":
            at_line_start = True
        elif not c.isspace():
            at_line_start = False
        if code.startswith("//", i):
            j = code.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif code.startswith("/*", i):
            j = code.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", code[i:j]))
            i = j
        elif c == '"' and re.search(r"(?:^|[^\w])(?:u8|u|U|L)?R$", code[max(0, i - 3):i]):
            # A raw string: R"delim( ... )delim".
            paren = code.find("(", i)
            delim = code[i + 1:paren]
            j = code.find(")" + delim + '"', paren)
            j = n if j < 0 else j + len(delim) + 2
            out.append('"' + re.sub(r"[^\n]", " ", code[i + 1:j - 1]) + '"')
            i = j
        elif c == "'" and re.search(r"(?:^|[^\w'])\d[\w']*$", code[max(0, i - 40):i]):
            out.append(c)  # a digit separator: 1'000'000
            i += 1
        elif c == '"' or c == "'":
            j = i + 1
            while j < n and code[j] != c and code[j] != "\n":
                j += 2 if code[j] == "\\" else 1
            out.append(c + " " * (j - i - 1) + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


