#!/usr/bin/env python3
"""Checks that the C++ and CUDA sources follow the tree's .clang-format.

    tools/lint/check_format.py [--root DIR] [--fix] [FILE...]

Every tracked *.cc, *.h, *.cu and *.cuh (git ls-files under --root) unless
files are named. Prints each file clang-format would change with the first
differing lines, and exits 1 if any; --fix rewrites them in place. Exits 77
(ctest's skip code here) when clang-format is not installed:
scripts/setup.sh installs it (Debian's clang-format, 14 on bookworm).
"""
import argparse
import difflib
import pathlib
import shutil
import subprocess
import sys

SUFFIXES = (".cc", ".h", ".cu", ".cuh")
SKIP = 77


def tracked(root):
    out = subprocess.run(["git", "ls-files"], cwd=root, check=True, capture_output=True, text=True).stdout
    return [root / f for f in out.split() if f.endswith(SUFFIXES)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=pathlib.Path(__file__).resolve().parents[2], type=pathlib.Path)
    ap.add_argument("--fix", action="store_true")
    ap.add_argument("files", nargs="*", type=pathlib.Path)
    args = ap.parse_args(argv)
    tool = shutil.which("clang-format")
    if tool is None:
        print("check_format: clang-format not found (scripts/setup.sh installs it); skipped")
        return SKIP
    files = args.files or tracked(args.root)
    bad = 0
    for path in files:
        text = path.read_text()
        formatted = subprocess.run([tool, "--style=file", "--assume-filename=%s" % path], input=text,
                                   check=True, capture_output=True, text=True, cwd=args.root).stdout
        if formatted == text:
            continue
        bad += 1
        if args.fix:
            path.write_text(formatted)
            print("formatted %s" % path)
            continue
        diff = list(difflib.unified_diff(text.splitlines(), formatted.splitlines(), str(path), "clang-format",
                                         n=0, lineterm=""))
        print("\n".join(diff[:12]))
    if bad and not args.fix:
        print("check_format: %d of %d files differ from .clang-format; tools/lint/check_format.py --fix "
              "rewrites them" % (bad, len(files)))
        return 1
    print("check_format: %d files%s" % (len(files), ", %d rewritten" % bad if args.fix else " follow .clang-format"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
