#!/usr/bin/env python3
"""tools/lint/check_sizes.py finds long functions and files in small trees
it is given (and not in comments, strings or lambdas' neighbours)."""
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "lint"))
import check_sizes  # noqa: E402


def lengths(source):
    return {name: count for name, _, count in check_sizes.functions(check_sizes.strip_code(source))}


def main():
    body = "\n".join(f"  x += {i};" for i in range(130))
    src = f"""namespace a {{
// int commented_out() {{
struct S {{
  int Member(int y) const {{ return y; }}
}};
int Long(int x) {{
{body}
  auto f = [&](int z) {{ return z; }};
  return f(x);
}}
const char* kText = "int NotAFunction() {{";
}}  // namespace a
"""
    got = lengths(src)
    assert got.get("Long") == 134, got
    assert got.get("Member") == 1, got
    assert "commented_out" not in got and "NotAFunction" not in got, got
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        (root / "long.cc").write_text(src)
        (root / "short.h").write_text("int F() { return 1; }\n")
        run = subprocess.run([sys.executable, str(ROOT / "tools/lint/check_sizes.py"), "--root", tmp],
                             capture_output=True, text=True)
        assert run.returncode == 1, run.stdout
        assert "long.cc:6: function Long is 134 lines" in run.stdout, run.stdout
        (root / "long.cc").write_text("int F() { return 2; }\n" * 901)
        run = subprocess.run([sys.executable, str(ROOT / "tools/lint/check_sizes.py"), "--root", tmp],
                             capture_output=True, text=True)
        assert "long.cc: 901 lines" in run.stdout, run.stdout
        (root / "long.cc").write_text("// size-limit: table (generated)\n" + "int F() { return 2; }\n" * 901)
        run = subprocess.run([sys.executable, str(ROOT / "tools/lint/check_sizes.py"), "--root", tmp],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stdout
    print("check_sizes_test: ok")


if __name__ == "__main__":
    main()
