#!/usr/bin/env python3
"""Compiles every C++ snippet of README.md and docs/*.md against the library's
headers, so that the documentation shows code that compiles.

Each ```cpp block becomes part of one translation unit (one compiler run):
declarations (struct, class, TEST, functions such as main, SHARDTORCH_MODULE)
at namespace scope, one namespace per snippet, and the other lines in a
function body whose parameters are the names the documentation uses without
defining them (world, model, opt, ...: `Context` below). A snippet may
declare the same names again (it shadows them). #line directives make the
compiler's messages name the Markdown file and line.

A block that is not meant to compile is preceded by the line
`<!-- snippet: not compiled -->` (keep them rare).

The unit is compiled to an object (-O0), not only checked for syntax, so
that a compiler launcher such as ccache can reuse the result while neither
the documents nor the headers change: the headers alone take about 45 s to
parse on a 2-core machine.

usage: doc_snippets.py SOURCE_DIR OUT_DIR [--launcher PROGRAM] CXX [compiler flags...]
"""
import glob
import os
import re
import subprocess
import sys

SKIP = "<!-- snippet: not compiled -->"

PRELUDE = r'''
#include <torch/torch.h>
#include <gtest/gtest.h>
#include <shardtorch/shardtorch.h>
#include <shardtorch/checkpoint.h>
#include <shardtorch/deferred.h>
#include <shardtorch/ft.h>
#include <shardtorch/hf_checkpoint.h>
#include <shardtorch/plan.h>
#include <shardtorch/testing.h>
#include <shardtorch/optim/cpu_adam.h>
#include "examples/gpt.h"

#include <chrono>
#include <iostream>
#include <map>
#include <string>
#include <vector>

namespace docs {
// Names the snippets use without defining them.
struct NetImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x) { return x; }
};
SHARDTORCH_MODULE(Net);
using gpt::GPT;
using MyModel = Net;
inline torch::Tensor batch_for(int rank) { return torch::zeros({1}); }
inline torch::Tensor loss_of(const torch::Tensor& x) { return x.sum(); }
inline std::map<std::string, at::Tensor> train_single_process() { return {}; }
inline bool params_close(Net&, const std::map<std::string, at::Tensor>&) { return true; }
}  // namespace docs
#define SNIPPET_CONTEXT                                                                                      \
  std::shared_ptr<shardtorch::World> world, docs::Net model, std::shared_ptr<shardtorch::ShardedOptimizer> opt, \
      shardtorch::ShardedModel sharded, c10::intrusive_ptr<c10d::Store> store, int rank, int size,             \
      shardtorch::WorldOptions options, int local_rank, gpt::Config cfg, std::string path, std::string dir,     \
      int64_t step, int64_t epoch, int64_t seen, torch::Tensor loss, shardtorch::GradScaler& scaler,            \
      std::map<std::string, std::string> user_state, std::map<std::string, std::string> resume, int K,         \
      std::vector<torch::Tensor> micro, size_t group, std::vector<torch::Tensor> no_decay_params,               \
      torch::optim::AdamWOptions adamw, std::shared_ptr<shardtorch::DeviceMesh> mesh, torch::Tensor tokens,       \
      int steps, shardtorch::Pipeline& pipe
'''

DECL_START = re.compile(r'^(struct|class|TEST|TEST_F|TEST_P|int main|void |torch::Tensor \w+\(|SHARDTORCH_MODULE|TORCH_MODULE|using |namespace |template)')


def blocks(path):
    lines = open(path, encoding="utf-8").read().split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)```cpp\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent = len(m.group(1))
        prev = i - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        skip = prev >= 0 and lines[prev].strip() == SKIP
        j = i + 1
        while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        body = [l[indent:] if l[:indent].strip() == "" else l for l in lines[i + 1:j]]
        yield i + 2, body, skip  # the first code line, 1-based
        i = j + 1


def split(first_line, body):
    """(includes, declarations, statements): lists of (line number, text)."""
    includes, decls, stmts = [], [], []
    k = 0
    while k < len(body):
        line, no = body[k], first_line + k
        if line.startswith("#include"):
            includes.append((no, line))
            k += 1
        elif DECL_START.match(line):
            depth, chunk = 0, []
            while k < len(body):
                chunk.append((first_line + k, body[k]))
                depth += body[k].count("{") - body[k].count("}")
                k += 1
                if depth == 0 and chunk[-1][1].rstrip().endswith((";", "}", ")")):
                    break
            decls.extend(chunk)
        else:
            stmts.append((no, line))
            k += 1
    return includes, decls, stmts


def with_lines(path, numbered):
    out, expect = [], None
    for no, text in numbered:
        if no != expect:
            out.append(f'#line {no} "{path}"')
        out.append(text)
        expect = no + 1
    return out


def main():
    src, out_dir, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    launcher = []
    if rest[:1] == ["--launcher"]:
        launcher, rest = rest[1:2], rest[2:]
    cxx, flags = rest[0], rest[1:]
    docs = [os.path.join(src, "README.md")] + sorted(glob.glob(os.path.join(src, "docs", "*.md")))
    tu = [PRELUDE]
    count = skipped = 0
    for doc in docs:
        rel = os.path.relpath(doc, src)
        for first, body, skip in blocks(doc):
            if skip:
                skipped += 1
                continue
            count += 1
            includes, decls, stmts = split(first, body)
            tu += with_lines(rel, includes)
            tu.append(f"namespace docs::snippet_{count} {{")
            tu += with_lines(rel, decls)
            if any(t.strip() for _, t in stmts):
                tu.append("[[maybe_unused]] void body(SNIPPET_CONTEXT) { {")  # inner block: may shadow
                tu += with_lines(rel, stmts)
                tu.append("} }")
            tu.append("}")
    if count == 0:  # nothing compiled would pass: a moved docs/ or a changed fence must not
        print(f"doc_snippets: no C++ snippet found in {len(docs)} documents under {src}: FAILED")
        return 1
    os.makedirs(out_dir, exist_ok=True)
    tu_path = os.path.join(out_dir, "doc_snippets.cpp")
    with open(tu_path, "w", encoding="utf-8") as f:
        f.write("\n".join(tu) + "\n")
    obj = os.path.join(out_dir, "doc_snippets.o")
    cmd = launcher + [cxx, "-std=c++20", "-O0", "-I" + src, "-I" + os.path.join(src, "include")] + flags + [
        "-c", tu_path, "-o", obj]
    r = subprocess.run(cmd)
    print(f"doc_snippets: {count} snippets compiled together ({skipped} marked not compiled): "
          + ("ok" if r.returncode == 0 else "FAILED"))
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
