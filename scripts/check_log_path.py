#!/usr/bin/env python3
"""Every message the library prints goes through src/base/log.cpp (levels, the
"[rank N] " prefix, warnings through TORCH_WARN; docs/api.md, "Progress and
logs"). Prints each direct write to stdout or stderr elsewhere in src/
(fprintf(stderr/stdout, std::cerr, std::cout, printf, puts, fputs to them,
TORCH_WARN outside the log path) as file:line and exits 1 if there is one.
Flushes (std::cout.flush(), fflush) are not writes.

  python3 scripts/check_log_path.py [source dir]
"""
import os
import re
import sys

ALLOWED = {os.path.join("base", "log.cpp")}

WRITES = re.compile(
    r"""\bstd::(cerr|cout|clog)\s*<<"""            # stream writes
    r"""|\b(std::)?v?fprintf\s*\(\s*(stderr|stdout)"""
    r"""|\b(std::)?(fputs|fputc|fwrite|putc)\s*\([^;]*\b(stderr|stdout)\s*\)"""
    r"""|(?<![\w:.>])(std::)?(v?printf|puts|putchar|perror)\s*\("""
    r"""|\bTORCH_WARN(_ONCE)?\s*\("""              # warnings go through detail::warn
    r"""|\bwrite\s*\(\s*(1|2|STDOUT_FILENO|STDERR_FILENO)\s*,"""
)


def strip_comments(line, in_block):
    """The code of one line (no // or /* */ comments, no string literals), and whether a block comment goes on."""
    out, i, quote = [], 0, None
    while i < len(line):
        c = line[i]
        if in_block:
            if line.startswith("*/", i):
                in_block, i = False, i + 2
            else:
                i += 1
            continue
        if quote:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = None
            out.append(" ")
            i += 1
            continue
        if line.startswith("//", i):
            break
        if line.startswith("/*", i):
            in_block, i = True, i + 2
            continue
        if c in "\"'":
            quote = c
        out.append(c)
        i += 1
    return "".join(out), in_block


def main():
    top = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    src = os.path.join(top, "src")
    problems, seen = [], 0
    for d, _, names in os.walk(src):
        for n in sorted(names):
            if not n.endswith((".h", ".cpp", ".hpp", ".cu", ".cuh")):
                continue
            path = os.path.join(d, n)
            rel = os.path.relpath(path, src)
            seen += 1
            if rel in ALLOWED:
                continue
            in_block = False
            with open(path, encoding="utf-8") as f:
                for no, line in enumerate(f, 1):
                    code, in_block = strip_comments(line, in_block)
                    if WRITES.search(code):
                        problems.append(f"src/{rel}:{no}: writes to stdout/stderr directly; use base/log.h "
                                        f"(detail::log, SHARDTORCH_WARN, SHARDTORCH_INFO, SHARDTORCH_DEBUG): "
                                        f"{line.strip()}")
    if seen == 0:
        print(f"check_log_path: no sources under {src}", file=sys.stderr)
        return 1
    for p in problems:
        print(p)
    if problems:
        print(f"check_log_path: {len(problems)} direct write(s) to stdout/stderr in src/", file=sys.stderr)
        return 1
    print(f"check_log_path: {seen} files, every message through src/base/log.cpp")
    return 0


if __name__ == "__main__":
    sys.exit(main())
