#!/usr/bin/env python3
"""Exhaustive check of kl.fast_exp (torch_kiln/kl/lowering.py, PRELUDE) on
every float32 bit pattern, 2^32 of them: the AVX-512 version gives the AVX2
version's bits, and both are within 5 ULP of exp computed in double and
rounded to float, with NaN for every NaN. It compiles the two versions as
they are in PRELUDE into one C++ program (needs g++ and a CPU with AVX-512F;
about 45 s on one core). Exit status 0 when both hold.

    python3 scripts/check_kl_fast_exp.py
"""

import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torch_kiln.kl import lowering  # noqa: E402

AVX512, AVX2 = "#if defined(CPU_CAPABILITY_AVX512)\n", "#elif defined(CPU_CAPABILITY_AVX2)\n"

MAIN = r"""
#include <cmath>
static int64_t ordered(uint32_t b) {
  int32_t i; std::memcpy(&i, &b, 4); return i < 0 ? -int64_t(i & 0x7fffffff) : i;
}
int main() {
  uint64_t differ = 0, nan_lost = 0; int64_t worst = 0; uint32_t worst_at = 0;
  alignas(64) uint32_t in[16], o512[16], o256[16];
  for (uint64_t base = 0; base < (1ull << 32); base += 16) {
    for (int l = 0; l < 16; ++l) in[l] = uint32_t(base + l);
    __m512 x; std::memcpy(&x, in, 64);
    __m512 r = a512::kl_fast_exp(a512::KlVec(x)); std::memcpy(o512, &r, 64);
    for (int h = 0; h < 2; ++h) {
      __m256 y; std::memcpy(&y, in + 8 * h, 32);
      __m256 q = a256::kl_fast_exp(a256::KlVec(y)); std::memcpy(o256 + 8 * h, &q, 32);
    }
    for (int l = 0; l < 16; ++l) {
      differ += o512[l] != o256[l];
      float xf, got; std::memcpy(&xf, &in[l], 4); std::memcpy(&got, &o512[l], 4);
      if (std::isnan(xf)) { nan_lost += !std::isnan(got); continue; }
      float ref = float(std::exp(double(xf))); uint32_t rb; std::memcpy(&rb, &ref, 4);
      int64_t d = ordered(o512[l]) - ordered(rb); if (d < 0) d = -d;
      if (d > worst) { worst = d; worst_at = in[l]; }
    }
  }
  std::printf("AVX-512 bits differing from AVX2's: %llu\n", (unsigned long long)differ);
  std::printf("largest error: %lld ULP (at float bits 0x%08x); NaN inputs without a NaN "
              "result: %llu\n", (long long)worst, worst_at, (unsigned long long)nan_lost);
  return (differ || nan_lost || worst > 5) ? 1 : 0;
}
"""


def main() -> int:
    prelude = lowering.PRELUDE
    start = prelude.index(AVX512 + "inline KlVec kl_fast_exp")
    block = prelude[start:prelude.index("#endif", start)]
    avx512 = block[len(AVX512):block.index(AVX2)]
    avx2 = block[block.index(AVX2) + len(AVX2):block.index("#else")]
    source = ("#include <immintrin.h>\n#include <cstdint>\n#include <cstdio>\n#include <cstring>\n"
              "namespace a512 { struct KlVec { __m512 v; KlVec(__m512 a) : v(a) {} "
              "operator __m512() const { return v; } };\n" + avx512 + "}\n"
              "namespace a256 { struct KlVec { __m256 v; KlVec(__m256 a) : v(a) {} "
              "operator __m256() const { return v; } };\n" + avx2 + "}\n" + MAIN)
    with tempfile.TemporaryDirectory() as tmp:
        cpp, exe = os.path.join(tmp, "check.cpp"), os.path.join(tmp, "check")
        with open(cpp, "w") as f:
            f.write(source)
        subprocess.run(["g++", "-O2", "-mavx512f", "-mavx2", "-mfma", "-o", exe, cpp], check=True)
        return subprocess.run([exe]).returncode


if __name__ == "__main__":
    sys.exit(main())
