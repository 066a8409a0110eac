#!/usr/bin/env python3
"""The size limits of docs/contributing.md: no source file over 900 lines and
no function over 120 lines, outside tests and generated code.

Files: every tracked C++/CUDA source (.h .cc .cu .cuh) outside tests/, bench/
and third-party trees. A file may opt out of the file limit with a comment
line containing "size-limit: table" and a reason (a generated or table file).
Functions: a body is a brace block opened at namespace or class scope right
after a parameter list (')' then optional qualifiers, an initializer list, a
trailing return type); its length counts the lines from its opening to its
closing brace. Lambdas, nested classes and control blocks inside count with
their function. Comments, string and character literals are skipped.

Usage: check_sizes.py [--root DIR] [--max-file N] [--max-function N] [--list]
Exit 0 when within the limits, 1 otherwise (each offender on a line).
"""
import argparse
import pathlib
import re
import subprocess
import sys

SOURCES = (".h", ".cc", ".cu", ".cuh")
EXCLUDED_DIRS = ("tests/", "bench/", "build/", "shared/")
TABLE_MARK = "size-limit: table"


def strip_code(text):
    """The text with comments and string/char literals blanked (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j = min(n, j + 1)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


# What may sit between a parameter list's ')' and a function body's '{'.
FUNCTION_TAIL = re.compile(
    r"\)\s*(const|override|final|noexcept(\([^)]*\))?|mutable|&|&&|\s)*"
    r"(->\s*[\w:<>,\s*&]+)?\s*(:\s*[^;{}]*)?$", re.S)
SCOPE_HEAD = re.compile(r"\b(namespace|class|struct|union|enum)\b[^;{}()]*$|extern\s*$", re.S)


def functions(code):
    """(name-ish, first line, line count) of every function body in `code`."""
    found, stack = [], []  # stack of (kind, start offset) for open braces
    last_end = 0  # end of the last statement/brace at this level
    line_of = lambda pos: code.count("\n", 0, pos) + 1
    for pos, c in enumerate(code):
        if c in ";}":
            if c == "}" and stack:
                kind, start = stack.pop()
                if kind == "function":
                    found.append((head_name(code[last_start(code, start):start]), line_of(start),
                                  line_of(pos) - line_of(start) + 1))
            last_end = pos + 1
        elif c == "{":
            enclosing = stack[-1][0] if stack else "scope"
            head = code[last_end:pos]
            if enclosing != "scope":
                kind = "inner"
            elif SCOPE_HEAD.search(head.strip() + " ") or head.strip().endswith("extern \"C\""):
                kind = "scope"
            elif FUNCTION_TAIL.search(head.rstrip()) and "(" in head and not head.rstrip().endswith("="):
                kind = "function"
            else:
                kind = "inner"  # an initializer, a lambda at namespace scope, an enum body
            stack.append((kind, pos))
            last_end = pos + 1
    return found


def last_start(code, brace):
    return max(code.rfind(";", 0, brace), code.rfind("}", 0, brace), code.rfind("{", 0, brace)) + 1


NOT_NAMES = {"__launch_bounds__", "alignas", "decltype", "noexcept", "template", "__attribute__"}


def head_name(head):
    names = [m for m in re.findall(r"([~\w:]+)\s*\(", head) if m not in NOT_NAMES]
    return names[0] if names else head.strip()[:40]


def tracked_sources(root):
    """The tracked sources (git ls-files), or every file under root when it is
    not a git checkout."""
    files = subprocess.run(["git", "-C", str(root), "ls-files"], capture_output=True, text=True)
    if files.returncode == 0:
        names = files.stdout.split()
    else:
        names = [str(p.relative_to(root)) for p in pathlib.Path(root).rglob("*") if p.is_file()]
    for name in sorted(names):
        if name.endswith(SOURCES) and not name.startswith(EXCLUDED_DIRS):
            yield name


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=pathlib.Path(__file__).resolve().parents[2])
    ap.add_argument("--max-file", type=int, default=900)
    ap.add_argument("--max-function", type=int, default=120)
    ap.add_argument("--list", action="store_true", help="print the 20 longest functions too")
    args = ap.parse_args(argv)
    root = pathlib.Path(args.root)
    offenders, longest = [], []
    for name in tracked_sources(root):
        text = (root / name).read_text(errors="replace")
        lines = text.count("\n") + (0 if text.endswith("\n") else 1)
        if lines > args.max_file and TABLE_MARK not in text:
            offenders.append(f"{name}: {lines} lines (limit {args.max_file})")
        for fn, line, count in functions(strip_code(text)):
            longest.append((count, f"{name}:{line} {fn}"))
            if count > args.max_function:
                offenders.append(f"{name}:{line}: function {fn} is {count} lines (limit {args.max_function})")
    if args.list:
        for count, where in sorted(longest, reverse=True)[:20]:
            print(f"{count:5d} {where}")
    for o in offenders:
        print(o)
    print(f"check_sizes: {len(offenders)} over the limits")
    return 1 if offenders else 0


if __name__ == "__main__":
    sys.exit(main())
