#!/usr/bin/env python3
"""Host test of step 06's work order (and of 07's and 08's forwards, which carry it), with the
kernel's own text: every blockIdx.x of the grid must decode to a distinct (q_block, pair) in range.

Cuts two pieces out of each kernel.cu: launch()'s order planning (from `int64_t group_pairs =
1` to the end of `if (args.causal) { ... }`) and the kernel's block decode (from
`num_q_blocks`, or 08's `pack`, to `pair`), pastes them unchanged into a C++ program with stand-ins for the
CUDA calls (SM count, blocks per SM and L2 size chosen per case), compiles it with $CXX (or
g++) under UBSan and runs it. Cases: a sweep of B, H, H_kv, N_q, N_k (ragged, N_q != N_k,
1-row), causal on and off, on five device stand-ins (H200, one block per SM, A100-like, and
two tiny ones that make the two-phase order fire on small grids), plus the bench shapes,
whose plan it prints. The GPU test SafetyEdgeCases.CausalGridOfManyPairsWritesEveryRow checks
the same on the real GPU for the bench-like shapes. (06_causal_skip/NOTES.md, eighth session.)

  python3 common/tests/host/work_order_check.py [kernel.cu ...]   # default: 06's, 07's, 08's
"""
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DEFAULT = ["06_causal_skip/kernel.cu", "07_backward/kernel.cu", "08_split_kv/kernel.cu"]


def cut(text, first, last):
    lines = text.splitlines()
    i = next(k for k, l in enumerate(lines) if first in l)
    j = next(k for k in range(i, len(lines)) if last(lines[k]))
    return "\n".join(lines[i:j + 1])


def check(path):
    """Builds and runs the check for one kernel.cu; returns the program's exit code."""
    src = open(path).read()
    plan = cut(src, "int64_t group_pairs = 1", lambda l: l == "  }")
    # 08 packs query heads (its decode starts at `pack`; 1 here, its prefill tile's).
    first = next(m for m in ("const int pack = Tr::kPackHeads", "const int num_q_blocks = (args.seqlen_q")
                 if m in src)
    decode = cut(src, first, lambda l: "const int pair =" in l)
    prog = r'''
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>
using std::max;
using std::min;
struct Args { int batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim; bool causal; };
struct Tr {
  static constexpr int kBlockM = 128, kNumThreads = 128, kSmemBytes = 0;
  static constexpr bool kPackHeads = false;
};
struct Split { int pack; };
struct Dim { unsigned x; };
enum { cudaDevAttrMultiProcessorCount, cudaDevAttrL2CacheSize };
static int g_sms, g_bps, g_l2;
#define FA_CUDA_TRY(x) (void)(x)
[[maybe_unused]] static int cudaGetDevice(int* d) { *d = 0; return 0; }
[[maybe_unused]] static int cudaDeviceGetAttribute(int* v, int attr, int) {
  *v = attr == cudaDevAttrL2CacheSize ? g_l2 : g_sms; return 0; }
[[maybe_unused]] static int cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* v, int, int, int) {
  *v = g_bps; return 0; }

static void plan(const Args& args, int64_t num_q_blocks, int64_t num_pairs, int64_t* gp,
                 int64_t* tr) {
  [[maybe_unused]] const int kernel = 0;
  // 08 asks once per device (kernel_facts) and computes `resident` before its plan
  [[maybe_unused]] const struct { int num_sms, blocks_per_sm, l2_bytes; } facts{g_sms, g_bps, g_l2};
  [[maybe_unused]] const int64_t resident = int64_t(g_sms) * std::max(g_bps, 1);
''' + plan + r'''
  *gp = group_pairs;
  *tr = tail_rows;
}

static void decode(const Args& args, const Dim blockIdx, const int group_pairs,
                   const int tail_rows, int* qb, int* pr) {
  [[maybe_unused]] const Split split{1};
''' + decode + r'''
  *qb = q_block;
  *pr = pair;
}

static long checked = 0, two_phase = 0, failed = 0;
static bool run(const Args& a, int sms, int bps, int l2, bool print) {
  g_sms = sms; g_bps = bps; g_l2 = l2;
  const int64_t nqb = (a.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  const int64_t pairs = int64_t(a.batch) * a.heads;
  int64_t gp = 0, tr = 0;
  plan(a, nqb, pairs, &gp, &tr);
  if (print)
    std::printf("d=%3d N=%5d B=%2d H=%2d: group_pairs %4lld tail_rows %2lld (%s)\n", a.head_dim,
                a.seqlen_q, a.batch, a.heads, (long long)gp, (long long)tr,
                tr ? "two phases" : "06's order");
  ++checked;
  two_phase += tr > 0;
  bool ok = gp >= 1 && gp <= INT32_MAX && tr >= 0 && tr <= nqb;
  ok = ok && (a.causal || (gp == 1 && tr == 0));  // 06's order without the mask
  std::vector<char> seen(nqb * pairs, 0);
  for (int64_t b = 0; ok && b < nqb * pairs; ++b) {
    int qb = -1, pr = -1;
    decode(a, Dim{unsigned(b)}, int(gp), int(tr), &qb, &pr);
    ok = qb >= 0 && qb < nqb && pr >= 0 && pr < pairs && !seen[pr * nqb + qb];
    if (ok) seen[pr * nqb + qb] = 1;
  }
  if (!ok) {
    ++failed;
    std::printf("FAILED: B=%d H=%d Hkv=%d Nq=%d Nk=%d d=%d causal=%d sms=%d bps=%d l2=%d\n",
                a.batch, a.heads, a.heads_kv, a.seqlen_q, a.seqlen_k, a.head_dim, a.causal, sms,
                bps, l2);
  }
  return ok;
}

int main() {
  const int dev[5][3] = {{132, 2, 50 << 20}, {132, 1, 50 << 20}, {108, 2, 40 << 20},
                         {2, 1, 1 << 20}, {1, 1, 0}};
  for (int d : {64, 128})
    for (int n = 512; n <= 16384; n *= 2)
      run(Args{16384 / n, 2048 / d, 2048 / d, n, n, d, true}, 132, 2, 50 << 20, true);
  const int bs[] = {1, 2, 3, 5, 17}, hs[] = {1, 2, 3, 8, 16, 32}, gq[] = {1, 2, 4};
  const int ns[] = {1, 2, 63, 127, 128, 129, 255, 300, 1000, 1024, 2049, 4097, 8191};
  for (const auto& dv : dev)
    for (int d : {64, 128})
      for (int c = 0; c < 2; ++c)
        for (int b : bs)
          for (int h : hs)
            for (int g : gq)
              if (h % g == 0)
                for (int nq : ns)
                  for (int nk : ns)
                    run(Args{b, h, h / g, nq, nk, d, c == 1}, dv[0], dv[1], dv[2], false);
  // large grids on the H200 stand-in: many pairs, long N
  for (int n : {512, 1024, 2048, 3000, 4096, 16384, 32768, 65536, 131072})
    for (int b : {1, 4, 16, 64})
      for (int h : {16, 32, 64})
        if (int64_t(b) * h * ((n + 127) / 128) <= (int64_t(1) << 24))
          for (int d : {64, 128}) run(Args{b, h, h, n, n, d, true}, 132, 2, 50 << 20, false);
  std::printf("bijection: %ld launches (%ld in two phases)\n", checked, two_phase);
  std::printf("%ld passed, %ld failed\n", checked - failed, failed);
  return failed != 0;
}
'''
    with tempfile.TemporaryDirectory() as tmp:
        cpp, exe = os.path.join(tmp, "check.cpp"), os.path.join(tmp, "check")
        open(cpp, "w").write(prog)
        flags = ["-std=c++17", "-O2", "-Wall", "-Wno-unused-variable", "-Wno-sign-compare",
                 "-fsanitize=undefined", "-fno-sanitize-recover=all"]
        subprocess.run([os.environ.get("CXX") or "g++", *flags, "-o", exe, cpp], check=True)
        return subprocess.run([exe]).returncode


def main():
    # 07 and 08 are checked where present (a course pack may stop before them).
    paths = sys.argv[1:] or [os.path.join(ROOT, p) for p in DEFAULT
                             if p == DEFAULT[0] or os.path.exists(os.path.join(ROOT, p))]
    failed = 0
    for path in paths:
        print("== %s" % os.path.relpath(path, ROOT), flush=True)
        failed += check(path) != 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
