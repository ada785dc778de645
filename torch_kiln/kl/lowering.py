"""Lowering a traced kl kernel (ir.Trace) to C++ on kiln/kernel.h.

The generated source is one ``KILN_KERNEL``: it views the tensor arguments
(``ctx.tensor<T, N>``), reads the scalar arguments and the grid, and runs
the programs of the grid with ``ctx.parallel_for`` (the device's intra-op
threads), each program one loop nest per operation in program order. Part
1 (torch_kiln/kernels) compiles, caches and launches it: see jit.py.

Storage: every tile with storage (tracer.needs_storage) gets a buffer in a
per-thread arena allocated once per parallel_for chunk (heap, 64-byte
aligned), pointers declared ``__restrict``; scalars are C++ locals. Index
tiles with an affine form (ir.Value.affine) are computed where they are
used, aliases (``t[:, None]``) read their base's buffer.

Arithmetic: bfloat16 and float16 values compute in float and round to their
type at each op (as PyTorch's CPU kernels do); float32 in float; integers in
their type; integer ``//`` and ``%`` floor (torch) and fail on a zero
divisor; maximum/minimum propagate NaN. Sums accumulate in float32 (int64
for integers) over 8 interleaved partial sums. Loads and stores check every
unmasked index against the tensor's size; a failure throws kiln::Error
("kl kernel '<name>' at <file>:<line>: kl.load from 'x' ...: index i is out
of bounds for dimension d of size n"), the stream's sticky error at the next
synchronization.
"""

from __future__ import annotations

import math

import torch

from torch_kiln.kl import ir
from torch_kiln.kl.tracer import needs_storage

CTYPE = {torch.float32: "float", torch.bfloat16: "kiln::bfloat16", torch.float16: "kiln::half",
         torch.int32: "int32_t", torch.int64: "int64_t", torch.bool: "bool"}
SIG_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
             torch.int32: "int32", torch.int64: "int64", torch.bool: "bool"}
_HALF = (torch.bfloat16, torch.float16)
FUSE_ELEMENTWISE = True  # Note [kl elementwise fusion]; off only to measure it
INTERVAL_MASKS = True  # Note [kl interval masks]; off only to measure it
HOIST_INVARIANT = True  # Note [kl program-invariant ops]; off only to measure it
GEMM = True  # float32 kl.matmul through kl_gemm (oneDNN brgemm); off only to measure it
TRANSPOSE_BLOCKS = True  # float32 kl.transpose through kl_transpose_f32; off only to measure it

PRELUDE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <memory>
#include <string>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <kiln/kernel.h>

namespace {
using KlVec = at::vec::Vectorized<float>;
// c (m x n) = a (m x k) @ b (k x n), all row-major and contiguous
// (kiln::gemm_f32: oneDNN's brgemm through ATen, kiln/kernel.h).
inline void kl_gemm(int64_t m, int64_t n, int64_t k, const float* a, const float* b, float* c) {
  kiln::gemm_f32(m, n, k, a, k, b, n, c, n, /*accumulate=*/false);
}
// kl.fast_exp. On AVX2: ATen's exp_u20 (Vectorized<float>::exp_u20: x = n ln2
// + r, a degree-5 polynomial for exp(r)) with two changes that make it right
// on every float: the clamps are NaN-propagating (exp_u20 gives inf for NaN)
// and span [-104, 89] (below -104 exp rounds to 0, above 89 to inf), and
// 2^n is applied as two exact power-of-two factors 2^(n>>1) * 2^(n-(n>>1)),
// so n = 128 does not overflow a factor and results below FLT_MIN round
// into denormals (exp_u20 flushes them, and is off by millions of ULP on
// [-87.34, -86]). Checked on all 2^32 floats against double exp: at most 5
// ULP, NaN for NaN, exp(+-inf) = inf, 0. On AVX-512 the same operations on
// 16 lanes (floor as roundscale toward -inf): checked on all 2^32 floats to
// give the AVX2 version's bits (scripts/check_kl_fast_exp.py runs both
// checks). Elsewhere: exp_u20 with the wrong lanes (NaN,
// x < -86, x > 88) through Sleef's exp, as kl.exp.
#if defined(CPU_CAPABILITY_AVX512)
inline KlVec kl_fast_exp(const KlVec& xv) {
  const __m512 x = xv;
  __m512 s = _mm512_min_ps(_mm512_set1_ps(89.0f), x);  // NaN x: min_ps returns x
  s = _mm512_max_ps(_mm512_set1_ps(-104.0f), s);       // and max_ps keeps it
  const __m512 log2e = _mm512_castsi512_ps(_mm512_set1_epi32(0x3fb8aa3b));
  const __m512 ln2 = _mm512_castsi512_ps(_mm512_set1_epi32(0x3f317218));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(s, log2e, _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, ln2, s);  // |r| <= ln2 / 2
  __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(0.00828929059f), _mm512_set1_ps(0.0418978221f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.166676521f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.499991506f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.999999701f));
  p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(1.0f));
  const __m512i ni = _mm512_cvtps_epi32(n);  // in [-150, 128]
  const __m512i n1 = _mm512_srai_epi32(ni, 1), n2 = _mm512_sub_epi32(ni, n1);
  const __m512i bias = _mm512_set1_epi32(127);
  const __m512 f1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23));
  const __m512 f2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23));
  return KlVec(_mm512_mul_ps(_mm512_mul_ps(p, f1), f2));
}
#elif defined(CPU_CAPABILITY_AVX2)
inline KlVec kl_fast_exp(const KlVec& xv) {
  const __m256 x = xv;
  __m256 s = _mm256_min_ps(_mm256_set1_ps(89.0f), x);  // NaN x: min_ps returns x
  s = _mm256_max_ps(_mm256_set1_ps(-104.0f), s);       // and max_ps keeps it
  const __m256 log2e = _mm256_castsi256_ps(_mm256_set1_epi32(0x3fb8aa3b));
  const __m256 ln2 = _mm256_castsi256_ps(_mm256_set1_epi32(0x3f317218));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(s, log2e, _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_fnmadd_ps(n, ln2, s);  // |r| <= ln2 / 2
  __m256 p = _mm256_fmadd_ps(r, _mm256_set1_ps(0.00828929059f), _mm256_set1_ps(0.0418978221f));
  p = _mm256_fmadd_ps(r, p, _mm256_set1_ps(0.166676521f));
  p = _mm256_fmadd_ps(r, p, _mm256_set1_ps(0.499991506f));
  p = _mm256_fmadd_ps(r, p, _mm256_set1_ps(0.999999701f));
  p = _mm256_fmadd_ps(r, p, _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_cvtps_epi32(n);  // in [-150, 128]
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return KlVec(_mm256_mul_ps(_mm256_mul_ps(p, f1), f2));
}
#else
inline KlVec kl_fast_exp(const KlVec& x) {
  const KlVec r = x.exp_u20();
  const KlVec slow = x.isnan() | (x < KlVec(-86.0f)) | (x > KlVec(88.0f));
  if (slow.zero_mask() == (1 << KlVec::size()) - 1) return r;  // no lane is slow
  return KlVec::blendv(r, x.exp(), slow);
}
#endif
// kl.erf on float32 vectors: Sleef's erf with a 1-ULP bound (the Sleef
// build inside libtorch_cpu, which Vectorized<float>::exp also calls). Not
// Vectorized<float>::erf: that is Abramowitz and Stegun's 7.1.26 polynomial,
// accurate to 1.5e-7 absolute only (erf(1e-7) gave 0, erf(1e-6) 5.6% high).
#if defined(CPU_CAPABILITY_AVX512)
inline KlVec kl_erf(const KlVec& x) { return KlVec(Sleef_erff16_u10(x)); }
#elif defined(CPU_CAPABILITY_AVX2)
inline KlVec kl_erf(const KlVec& x) { return KlVec(Sleef_erff8_u10(x)); }
#else
inline KlVec kl_erf(const KlVec& x) { return x.map(std::erf); }
#endif
// dst (n x m) = the transpose of src (m x n), both row-major and contiguous:
// ATen's SIMD transposes (at::vec::transpose_mxn, what Inductor's C++
// kernels call) on blocks, plain copies at the edges; only data moves, so
// every path gives the same bits.
inline void kl_transpose_f32(const float* __restrict src, int64_t m, int64_t n,
                             float* __restrict dst) {
#if defined(CPU_CAPABILITY_AVX512)
  constexpr int64_t B = 16;  // transpose_mxn<float> takes up to 16 x 16 per call
#elif defined(CPU_CAPABILITY_AVX2)
  constexpr int64_t B = 8;   // transpose_mxn<float, 8, 8>
#else
  constexpr int64_t B = 1;
#endif
  int64_t i = 0;
  if constexpr (B > 1) {
    for (; i + B <= m; i += B) {
      int64_t j = 0;
      for (; j + B <= n; j += B) {
#if defined(CPU_CAPABILITY_AVX512)
        at::vec::transpose_mxn<float>(src + i * n + j, n, dst + j * m + i, m, B, B);
#elif defined(CPU_CAPABILITY_AVX2)
        at::vec::transpose_mxn<float, 8, 8>(src + i * n + j, n, dst + j * m + i, m);
#endif
      }
      for (; j < n; ++j)
        for (int64_t r = i; r < i + B; ++r) dst[j * m + r] = src[r * n + j];
    }
  }
  for (; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) dst[j * m + i] = src[i * n + j];
}
// A vector accumulator's lanes combined into one float by a tree of
// shuffles (at::vec::vec_reduce_all, as ATen's CPU reductions finish): four
// dependent steps on AVX-512 where a loop over the stored lanes takes 15
// (and, for max/min, a NaN test each). maximum/minimum propagate NaN.
inline float kl_lanes_sum(const KlVec& v) {
  return at::vec::vec_reduce_all<float>([](const KlVec& a, const KlVec& b) { return a + b; }, v);
}
inline float kl_lanes_max(const KlVec& v) {
  return at::vec::vec_reduce_all<float>(
      [](const KlVec& a, const KlVec& b) { return at::vec::maximum(a, b); }, v);
}
inline float kl_lanes_min(const KlVec& v) {
  return at::vec::vec_reduce_all<float>(
      [](const KlVec& a, const KlVec& b) { return at::vec::minimum(a, b); }, v);
}
template <typename T> inline T kl_maximum(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) { if (a != a) return a; if (b != b) return b; }
  return a > b ? a : b;
}
template <typename T> inline T kl_minimum(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) { if (a != a) return a; if (b != b) return b; }
  return a < b ? a : b;
}
// b == -1 is done apart: the minimum value divided by -1 overflows, which
// x86 traps (SIGFPE); PyTorch's result wraps (min // -1 == min, min % -1 == 0).
template <typename T> inline T kl_floordiv(T a, T b, const char* where) {
  KILN_KERNEL_CHECK(b != 0, where, ": integer division by zero");
  if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) {
    if (b == -1) return static_cast<T>(std::make_unsigned_t<T>(0) - static_cast<std::make_unsigned_t<T>>(a));
  }
  T q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
template <typename T> inline T kl_mod(T a, T b, const char* where) {
  KILN_KERNEL_CHECK(b != 0, where, ": integer division by zero");
  if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) {
    if (b == -1) return T(0);
  }
  T r = a % b;
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}
// m ? a : b without a branch (bitwise, so loops of it vectorise).
template <typename T> inline T kl_select(bool m, T a, T b) {
  using U = std::conditional_t<sizeof(T) == 8, uint64_t, std::conditional_t<sizeof(T) == 4,
      uint32_t, std::conditional_t<sizeof(T) == 2, uint16_t, uint8_t>>>;
  U ua, ub;
  std::memcpy(&ua, &a, sizeof(T));
  std::memcpy(&ub, &b, sizeof(T));
  const U mask = U(0) - U(m);
  const U r = (ua & mask) | (ub & ~mask);
  T out;
  std::memcpy(&out, &r, sizeof(T));
  return out;
}
// One row of a load linear in its inner index: out[i] = row[i * step] for
// i in [lo, hi) where enabled (mask == nullptr: all; else mask[i]), other
// elsewhere. [lo, hi) is in bounds (checked by the caller), so reads there
// are unconditional and the loops vectorise.
template <typename T>
void kl_load_row(T* __restrict out, const T* row, int64_t step, int64_t lo, int64_t hi,
                 int64_t n, const bool* mask, bool enabled, T other) {
  if (!enabled) lo = hi = n;
  for (int64_t i = 0; i < lo; ++i) out[i] = other;
  for (int64_t i = hi; i < n; ++i) out[i] = other;
  const bool every = mask == nullptr || hi <= lo ||
                     std::memchr(mask + lo, 0, static_cast<size_t>(hi - lo)) == nullptr;
  if (every) {
    if (step == 1) {
      for (int64_t i = lo; i < hi; ++i) out[i] = row[i];
    } else {
      for (int64_t i = lo; i < hi; ++i) out[i] = row[i * step];
    }
  } else if (step == 1) {
    for (int64_t i = lo; i < hi; ++i) { const T t = row[i]; out[i] = kl_select<T>(mask[i], t, other); }
  } else {
    for (int64_t i = lo; i < hi; ++i) { const T t = row[i * step]; out[i] = kl_select<T>(mask[i], t, other); }
  }
}
// One row of a store: row[i * step] = values ? values[i] : value for the
// enabled i in [lo, hi) (in bounds, checked by the caller).
template <typename T>
void kl_store_row(T* row, int64_t step, int64_t lo, int64_t hi, const bool* mask, bool enabled,
                  const T* __restrict values, T value) {
  if (!enabled || hi <= lo) return;
  const bool every = mask == nullptr ||
                     std::memchr(mask + lo, 0, static_cast<size_t>(hi - lo)) == nullptr;
  if (every) {
    if (step == 1) {
      if (values) { for (int64_t i = lo; i < hi; ++i) row[i] = values[i]; }
      else { for (int64_t i = lo; i < hi; ++i) row[i] = value; }
    } else {
      for (int64_t i = lo; i < hi; ++i) row[i * step] = values ? values[i] : value;
    }
  } else {
    for (int64_t i = lo; i < hi; ++i) if (mask[i]) row[i * step] = values ? values[i] : value;
  }
}
// Narrows [*lo, *hi) to the i in [0, n) where 0 <= j0 + c * i < size.
// Exact (__int128): an index expression near the ends of int64 (-j0 or
// size - j0 would wrap in int64) is judged out of bounds, never let through.
inline void kl_in_bounds(int64_t j0_, int64_t c_, int64_t size, int64_t n, int64_t* lo,
                         int64_t* hi) {
  using I = __int128;
  const I j0 = j0_, c = c_;
  I a = 0, b = n;  // the i with j0 + c * i in [0, size)
  if (c == 0) {
    if (j0 < 0 || j0 >= size) b = 0;
  } else if (c > 0) {
    a = j0 >= 0 ? 0 : (-j0 + c - 1) / c;
    b = size - j0 <= 0 ? 0 : (size - j0 + c - 1) / c;
  } else {
    const I m = -c;  // j0 - m * i in [0, size)  <=>  i in ((j0 - size) / m, j0 / m]
    a = j0 - size < 0 ? 0 : (j0 - size) / m + 1;
    b = j0 < 0 ? 0 : j0 / m + 1;
  }
  *lo = static_cast<int64_t>(std::max<I>(*lo, std::min<I>(a, n)));
  *hi = static_cast<int64_t>(std::min<I>(*hi, std::max<I>(std::min<I>(b, n), 0)));
  if (*hi < *lo) *hi = *lo;
}
// Narrows [*lo, *hi) to the i in [0, n) with a(i) < b(i) (a(i) <= b(i)
// when or_equal), a(i) = la + lc * i and b(i) = ra + rc * i, n >= 1: an
// interval, as the condition is monotonic in i. Note [kl interval masks].
// Called on [0, n) first; afterwards either 0 <= *lo < *hi <= n or *lo ==
// *hi == 0 (empty), so loops over [0, lo) and [hi, n) stay inside the row.
// Exact (__int128). The operands are int64 tiles, which wrap on overflow
// (-fwrapv, as PyTorch's int64 does in the simulator): a(i) and b(i) are
// what the kernel compares only while they stay inside int64, and then a
// wrapped mask need not be an interval at all. An operand outside int64 at
// either end of the row (affine: then nowhere between) is an error naming
// the kernel and the comparison's line, never a silently different mask.
inline __int128 kl_floor_div(__int128 a, __int128 b) {  // b > 0
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}
// The first i in [0, n) where x0 + c * i leaves int64, or n if none.
inline int64_t kl_first_outside_int64(int64_t x0, int64_t c, int64_t n) {
  using I = __int128;
  const I min = std::numeric_limits<int64_t>::min(), max = std::numeric_limits<int64_t>::max();
  const I last = I(x0) + I(c) * (n - 1);
  if (last >= min && last <= max) return n;  // x0 itself is an int64
  const I first = c > 0 ? kl_floor_div(max - x0, c) + 1 : kl_floor_div(I(x0) - min, -I(c)) + 1;
  return static_cast<int64_t>(first);
}
[[noreturn]] __attribute__((noinline, cold)) void kl_mask_overflow(const char* where, int64_t i) {
  throw kiln::Error(std::string(where) + ": an operand of the mask's comparison leaves int64 "
                    "at element " + std::to_string(i) + " of a row (it would wrap); kl "
                    "compares index expressions only inside int64");
}
inline void kl_compare_interval(int64_t la, int64_t lc, int64_t ra, int64_t rc, bool or_equal,
                                int64_t n, const char* where, int64_t* lo, int64_t* hi) {
  using I = __int128;
  const int64_t outside = std::min(kl_first_outside_int64(la, lc, n),
                                   kl_first_outside_int64(ra, rc, n));
  if (outside < n) kl_mask_overflow(where, outside);
  // a - b < 0;  a - b <= 0  <=>  a - b - 1 < 0
  const I j0 = I(la) - I(ra) - (or_equal ? 1 : 0), c = I(lc) - I(rc);
  I l = *lo, h = *hi;
  if (c == 0) {
    if (j0 >= 0) h = l;
  } else if (c > 0) {  // i < -j0 / c  <=>  i <= floor((-j0 - 1) / c)
    h = std::min(h, kl_floor_div(-j0 - 1, c) + 1);
  } else {  // i * (-c) > j0  <=>  i >= floor(j0 / -c) + 1
    l = std::max(l, kl_floor_div(j0, -c) + 1);
  }
  if (h <= l) l = h = 0;
  *lo = static_cast<int64_t>(l);  // both inside [0, n) by now
  *hi = static_cast<int64_t>(h);
}
[[noreturn]] __attribute__((noinline, cold)) void kl_out_of_bounds(
    const char* where, int64_t index, int dim, int64_t size) {
  throw kiln::Error(std::string(where) + ": index " + std::to_string(index) +
                    " is out of bounds for dimension " + std::to_string(dim) + " of size " +
                    std::to_string(size) + "; mask the ragged edge with mask=");
}
} // namespace
"""


def compute_type(dtype) -> str:
    return "float" if dtype in _HALF else CTYPE[dtype]


def convert(expr: str, src, dst) -> str:
    """C++ converting ``expr`` (of C++ type compute_type(src) or CTYPE[src])
    to CTYPE[dst] (or its compute type: the same for non-half types)."""
    if src == dst:
        return expr
    if src in _HALF:
        expr = f"static_cast<float>({expr})"
        src = torch.float32
        if src == dst:
            return expr
    if dst in _HALF:
        return f"{CTYPE[dst]}(static_cast<float>({expr}))"
    return f"static_cast<{CTYPE[dst]}>({expr})"


def to_compute(expr: str, src, dst) -> str:
    """``expr`` of dtype src as the compute type of dst (float for halves)."""
    target = torch.float32 if dst in _HALF else dst
    return convert(expr, src, target)


def literal(value, dtype) -> str:
    ct = compute_type(dtype)
    if isinstance(value, bool):
        v = "true" if value else "false"
    elif isinstance(value, float):
        if math.isnan(value):
            return f"std::numeric_limits<{ct}>::quiet_NaN()"
        if math.isinf(value):
            return f"{'-' if value < 0 else ''}std::numeric_limits<{ct}>::infinity()"
        v = repr(value)
    else:
        v = f"INT64_C({value})"
    return f"static_cast<{ct}>({v})"


def cstring(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif 32 <= ord(ch) < 127:
            out.append(ch)
        else:
            out.append(f"\\x{ord(ch):02x}\"\"")
    return '"' + "".join(out) + '"'


def _strides(shape):
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return list(reversed(strides))


class _Emitter:
    def __init__(self, trace: ir.Trace, kernel_name: str):
        self.trace = trace
        self.kernel_name = kernel_name
        self.lines: list[str] = []
        self.indent = 0
        self.buffers: dict[int, tuple[ir.Value, int]] = {}
        self.arena = 0
        self.scalars: list[ir.Value] = []
        self.counter = 0
        self.skip: set[int] = set()  # id()s of ops not to emit in the program body
        self.streams = False  # whether some store may be a streaming one
        self.gemm = False  # whether some kl.matmul calls kl_gemm
        for op in ir.walk(trace.block):
            v = op.result
            if v is None:
                continue
            if v.shape == ():
                self.scalars.append(v)
            elif needs_storage(v):
                self.buffers[v.id] = (v, self.arena)
        self.defs = {op.result.id: op for op in ir.walk(trace.block) if op.result is not None}
        self.accumulated: set[int] = set()  # reductions computed in their operand's loop
        self.accumulated_by: dict[int, list] = {}  # operand id -> those reductions
        self.inlined, self.deferred = self._choose_inlined() if FUSE_ELEMENTWISE else (set(), set())
        for vid in self.inlined:
            del self.buffers[vid]
        self.intervals, self.unused = self._interval_masks() if INTERVAL_MASKS else ({}, set())
        for vid in self.unused:
            self.buffers.pop(vid, None)
        for vid, (v, _) in list(self.buffers.items()):
            self.buffers[vid] = (v, self.arena)
            self.arena += (v.numel * v.dtype.itemsize + 63) // 64 * 64

    def _choose_inlined(self) -> tuple[set[int], set[int]]:
        """Note [kl elementwise fusion]: a vectorisable float32 elementwise
        tile used once, later in the same block with no kl.range loop in
        between, is not computed on its own:

        - consumed by a vectorisable elementwise op of the same shape, or by
          a float32 sum/max/min over the last axis, it is not stored: its
          expression is computed inside the consumer's vector loop (one pass
          instead of two; "inlined");
        - stored by kl.store to a float32 tensor, it is computed straight
          into the tensor's row when the row is contiguous, in bounds and
          enabled throughout, else into its buffer and then stored as before
          ("deferred": it keeps its buffer for that case).

        And a stored tile read by last-axis float32 reductions later in its
        block computes them in its own vector loop, storing each vector and
        adding it to the reductions' accumulators ("accumulated": softmax's
        exp and its row sum in one pass).

        All are bit-identical to the unfused code: each element goes
        through the same vector instructions (the tail through the same
        partial loads), and a reduction combines the same values in the same
        order. Loop-carried tiles and tiles viewed by an alias keep their
        buffers. Returns (inlined ids, deferred ids)."""
        uses: dict[int, int] = {}
        consumer: dict[int, tuple] = {}
        keep: set[int] = set()
        placed: list[tuple] = []

        def visit(block):
            for pos, op in enumerate(block.ops):
                for o in op.operands:
                    if isinstance(o, ir.Value):
                        uses[o.id] = uses.get(o.id, 0) + 1
                        consumer[o.id] = (op, block, pos)
                        if o.alias_of is not None:
                            keep.add(o.alias_of.id)
                if op.result is not None:
                    placed.append((op, block, pos))
                    if op.result.alias_of is not None:
                        keep.add(op.result.alias_of.id)
                if op.kind == "for":
                    loop = op.attrs["loop"]
                    for outer, inner in loop.carried:
                        keep.update((outer.id, inner.id, (outer.alias_of or outer).id,
                                     (inner.alias_of or inner).id))
                    visit(loop.body)
        visit(self.trace.block)
        inlined: set[int] = set()
        deferred: set[int] = set()
        for op, block, pos in placed:
            v = op.result
            if v.id not in self.buffers or v.id in keep or uses.get(v.id) != 1:
                continue
            if not self._vectorisable(op):
                continue
            cop, cblock, cpos = consumer[v.id]
            if cblock is not block or any(o.kind == "for" for o in block.ops[pos + 1:cpos]):
                continue
            if cop.kind == "store":
                if (cop.operands[2] is v and tuple(cop.attrs["shape"]) == v.shape
                        and self.trace.tensor_specs[cop.operands[0]][0] == torch.float32):
                    deferred.add(v.id)
            elif cop.kind in ("sum", "max", "min"):
                if self._vector_reduction(cop):
                    inlined.add(v.id)
            elif (cop.result is not None and cop.result.shape == v.shape
                  and self._vectorisable(cop)):
                inlined.add(v.id)
        # a stored tile read by later last-axis reductions of the same block
        # (no loop in between) computes them in its own loop: one pass less
        for op, block, pos in placed:
            v = op.result
            if (v.id not in self.buffers or v.id in inlined or v.id in deferred
                    or v.id in keep or not self._vectorisable(op)):
                continue
            for cpos in range(pos + 1, len(block.ops)):
                cop = block.ops[cpos]
                if cop.kind == "for":
                    break
                # (not a loop-carried one: it must stay where it is, in every
                # program, even where its operand is hoisted)
                if (cop.kind in ("sum", "max", "min") and cop.operands[0] is v
                        and self._vector_reduction(cop) and cop.result.dtype == torch.float32
                        and cop.result.id not in keep):
                    self.accumulated.add(cop.result.id)
                    self.accumulated_by.setdefault(v.id, []).append(cop)
        return inlined, deferred

    _CONDITIONS = ("lt", "le", "gt", "ge")

    def _interval_masks(self) -> tuple[dict, set[int]]:
        """Note [kl interval masks]: a bool mask made only of ``&`` of
        comparisons (< <= > >=) between int64 index expressions (affine
        index tiles, broadcast tiles, scalars, numbers), as ragged-edge masks
        are (``(rows[:, None] < n_rows) & (cols[None, :] < n_cols)``), is
        along any row of a load or store one interval of the row's inner
        index: each comparison is monotonic in it. A row load/store given such
        a mask computes that interval from the comparisons' operands
        (kl_compare_interval) instead of reading a bool tile. A mask tile (and the
        comparisons under it) used by nothing else is then never computed.

        Returns ({mask id: [(kind, lhs, rhs, comparison op), ...]}, ids of
        values that need not be computed)."""
        conditions: dict[int, list] = {}
        carried: set[int] = set()  # values a loop rewrites: not constant where the mask is used
        for op in ir.walk(self.trace.block):
            if op.kind == "for":
                for outer, inner in op.attrs["loop"].carried:
                    carried.update((outer.id, inner.id))

        def index_like(o):
            if isinstance(o, bool):
                return False
            if isinstance(o, int):
                return True
            return (isinstance(o, ir.Value) and o.dtype == torch.int64 and o.id not in carried
                    and (o.alias_of is None or o.alias_of.id not in carried)
                    and (o.shape == () or o.affine is not None or
                         (o.alias_of is not None and o.alias_of.shape == ())))

        for op in ir.walk(self.trace.block):
            v = op.result
            if v is None or v.dtype != torch.bool or v.shape == ():
                continue
            if op.kind in self._CONDITIONS and op.attrs.get("common") == torch.int64:
                a, b = op.operands
                if index_like(a) and index_like(b):
                    conditions[v.id] = [(op.kind, a, b, op)]
            elif op.kind == "and" and op.attrs.get("common") == torch.bool:
                a, b = op.operands
                if (isinstance(a, ir.Value) and isinstance(b, ir.Value) and a.id in conditions
                        and b.id in conditions):
                    conditions[v.id] = conditions[a.id] + conditions[b.id]
        # which masks every use of is a row access's mask (or an unused mask above)
        uses: dict[int, list] = {}
        for op in ir.walk(self.trace.block):
            for pos, o in enumerate(op.operands):
                if isinstance(o, ir.Value):
                    uses.setdefault(o.id, []).append((op, pos))
            if op.kind == "for":
                for outer, inner in op.attrs["loop"].carried:
                    uses.setdefault(inner.id, []).append((op, -1))
                    uses.setdefault(outer.id, []).append((op, -1))
        unused: set[int] = set()
        for op in reversed(list(ir.walk(self.trace.block))):
            v = op.result
            if v is None or v.id not in conditions or v.id in self.inlined:
                continue
            if all((u.kind in ("load", "store") and pos == 1 and self._row_access(u))
                   or (u.kind == "where" and pos == 0 and u.result.id in self.buffers)
                   or (u.result is not None and u.result.id in unused)
                   for u, pos in uses.get(v.id, [])):
                unused.add(v.id)
        return conditions, unused

    def _row_access(self, op) -> bool:
        """Whether load/store ``op`` takes the row path (_access_rows)."""
        shape = op.result.shape if op.result is not None else op.attrs["shape"]
        if not shape:
            return False
        outer = [f"o{k}" for k in range(len(shape) - 1)]
        return all(self._linear(ix, outer, "c") is not None for ix in op.operands[3:])

    @staticmethod
    def _vector_reduction(op) -> bool:
        """Whether sum/max/min ``op`` takes the vectorised float32 last-axis path."""
        x = op.operands[0]
        return (x.dtype == torch.float32 and op.attrs["axis"] == len(x.shape) - 1
                and x.affine is None and not (x.alias_of is not None and x.alias_of.shape == ()))

    def line(self, text: str) -> None:
        self.lines.append("  " * self.indent + text)

    def fresh(self, prefix="i") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def where(self, op: ir.Op, what: str) -> str:
        filename, lineno = op.loc
        return cstring(f"kl kernel {self.trace.name!r} at {filename}:{lineno}: {what}")

    # ------------------------------------------------------------ elements
    def elem(self, v, idx: list[str]) -> str:
        """C++ for element ``idx`` (index expressions of the consumer's dims,
        right-aligned) of operand ``v``, in CTYPE[v.dtype]."""
        if not isinstance(v, ir.Value):
            raise AssertionError(v)
        if v.shape == ():
            return v.name
        pad = len(idx) - len(v.shape)
        assert pad >= 0, (v.shape, idx)
        if v.affine is not None:
            base, coeffs = v.affine
            terms = [base]
            for d, (c, size) in enumerate(zip(coeffs, v.shape)):
                if size == 1 or c == "0":
                    continue
                terms.append(idx[pad + d] if c == "1" else f"{c} * {idx[pad + d]}")
            return "(" + " + ".join(terms) + ")"
        base = v.alias_of or v
        if base.shape == ():
            return base.name
        offset = []
        for d, (size, stride) in enumerate(zip(v.shape, _strides(v.shape))):
            if size == 1:
                continue
            offset.append(idx[pad + d] if stride == 1 else f"{idx[pad + d]} * {stride}")
        return f"{base.name}[{' + '.join(offset) or '0'}]"

    def operand(self, o, idx, dtype_of_compute) -> str:
        """Operand ``o`` (Value or number) at idx, in the compute type of
        ``dtype_of_compute``."""
        if isinstance(o, ir.Value):
            return to_compute(self.elem(o, idx), o.dtype, dtype_of_compute)
        return literal(o, dtype_of_compute)

    def loops(self, shape, body) -> None:
        """Nested loops over ``shape``; ``body(idx, flat)`` emits the inner lines."""
        idx = []
        for size in shape:
            i = self.fresh()
            self.line(f"for (int64_t {i} = 0; {i} < {size}; ++{i}) {{")
            self.indent += 1
            idx.append(i)
        strides = _strides(shape)
        flat = " + ".join(i if s == 1 else f"{i} * {s}" for i, s in zip(idx, strides)) or "0"
        body(idx, flat)
        for _ in shape:
            self.indent -= 1
            self.line("}")

    def assign(self, v: ir.Value, expr_fn, compute_dtype) -> None:
        """v = expr elementwise; expr_fn(idx) gives C++ in compute_dtype's compute type."""
        if v.shape == ():
            self.line(f"{v.name} = {convert(expr_fn([]), compute_dtype, v.dtype)};")
            return
        if v.id not in self.buffers:
            return  # computed where used (affine) or an alias
        self.loops(v.shape, lambda idx, flat: self.line(
            f"{v.name}[{flat}] = {convert(expr_fn(idx), compute_dtype, v.dtype)};"))

    # ----------------------------------------------------------------- ops
    def program_invariant(self) -> list[ir.Op]:
        """Note [kl program-invariant ops]: the top-level ops whose results
        are the same in every program (no program_id in their operands, no
        load from a tensor the kernel writes, no store or loop): the
        lowering runs them once per parallel_for chunk, before the program
        loop, instead of once per program (RMSNorm's weight row, say).
        Loop-carried tiles (and what reads them) are not invariant: a loop
        rewrites them in each program. Nor is a load that comes after a
        store in program order: it may read what the store wrote (a tensor
        passed under two names). A hoisted load sees what other programs
        stored before its chunk began; programs are unordered, as Triton's
        and CUDA's blocks are, so a kernel must not depend on that either
        way."""
        variant: set[int] = set()
        for op in ir.walk(self.trace.block):  # loop-carried tiles change in each program
            if op.kind == "for":
                for outer, _ in op.attrs["loop"].carried:
                    variant.update((outer.id, (outer.alias_of or outer).id))
        hoisted: list[ir.Op] = []
        stored = False  # a store came before, in program order
        for op in self.trace.block.ops:
            if op.kind == "store" or (op.kind == "for" and any(
                    o.kind == "store" for o in ir.walk(op.attrs["loop"].body))):
                stored = True
            if op.result is not None and op.result.id in variant:
                continue
            if op.kind == "load" and stored:
                # it may read what the store wrote (the same tensor under
                # two names): it stays where it is
                variant.add(op.result.id)
                continue
            depends = any(isinstance(o, ir.Value) and (o.alias_of or o).id in variant
                          for o in op.operands)
            if op.kind == "load" and op.operands[0] in self.trace.written:
                depends = True
            if op.result is None or op.kind in ("for", "program_id") or depends:
                if op.result is not None:
                    variant.add(op.result.id)
                continue
            hoisted.append(op)
        return hoisted if HOIST_INVARIANT else []

    def emit_block(self, block: ir.Block) -> None:
        for op in block.ops:
            if op.result is not None and op.result.id in self.unused:
                continue  # a mask no one reads (Note [kl interval masks])
            if id(op) in self.skip:
                continue  # emitted before the program loop (Note [kl program-invariant ops])
            handler = getattr(self, "op_" + op.kind, None)
            if handler is not None:
                handler(op)
            else:
                self.op_elementwise(op)

    def op_tensor_size(self, op):
        self.line(f"{op.result.name} = {op.operands[0]}_sizes[{op.attrs['dim']}];")

    def op_tensor_stride(self, op):
        self.line(f"{op.result.name} = {op.operands[0]}_strides[{op.attrs['dim']}];")

    def op_scalar_arg(self, op):
        self.line(f"{op.result.name} = s_{op.operands[0]};")

    def op_program_id(self, op):
        self.line(f"{op.result.name} = kl_pid{op.attrs['axis']};")

    def op_num_programs(self, op):
        self.line(f"{op.result.name} = kl_grid{op.attrs['axis']};")

    def op_arange(self, op):
        v = op.result
        self.assign(v, lambda idx: f"(INT64_C({op.attrs['start']}) + {idx[0]})", torch.int64)

    def op_full(self, op):
        v = op.result
        self.assign(v, lambda idx: literal(op.attrs["value"], v.dtype), v.dtype)

    def op_expand_dims(self, op):
        v, src = op.result, op.operands[0]
        inserted = op.attrs["inserted"]
        self.assign(v, lambda idx: self.elem(src, [i for d, i in enumerate(idx)
                                                   if d not in inserted]), src.dtype)

    def op_broadcast(self, op):
        v, src = op.result, op.operands[0]
        self.assign(v, lambda idx: self.elem(src, idx), src.dtype)

    def op_cast(self, op):
        v, src = op.result, op.operands[0]
        self.assign(v, lambda idx: self.elem(src, idx), src.dtype)

    def _where_interval(self, op):
        """kl.where whose condition is an interval mask (Note [kl interval
        masks]): per row, b before the interval, a in it, b after it, in
        three loops without a select."""
        v, (c, a, b) = op.result, op.operands
        n = v.shape[-1]

        def body(idx, flat):
            inner = self.fresh("c")
            mlo, mhi = self._interval_bounds(self.intervals[c.id], idx, inner, n)
            row = f"({flat}) * {n} + " if len(v.shape) > 1 else ""
            compute = torch.float32 if v.dtype in _HALF else v.dtype
            for lo, hi, src in (("0", mlo, b), (mlo, mhi, a), (mhi, str(n), b)):
                value = convert(self.operand(src, idx + [inner], v.dtype), compute, v.dtype)
                self.line(f"for (int64_t {inner} = {lo}; {inner} < {hi}; ++{inner}) "
                          f"{v.name}[{row}{inner}] = {value};")
        self.loops(list(v.shape[:-1]), body)

    def _interval_bounds(self, interval, idx, inner, n) -> tuple[str, str]:
        """Emits the row's interval [mlo, mhi) of an interval mask (its
        comparisons' conjunction) at outer index ``idx``; returns the names."""
        mlo, mhi = self.fresh("mlo"), self.fresh("mhi")
        self.line(f"int64_t {mlo} = 0, {mhi} = {n};")
        for cmp, lhs, rhs, op in interval:
            (la, lc), (ra, rc) = (self._linear(t, idx, inner) for t in (lhs, rhs))
            if cmp in ("gt", "ge"):  # a > b  <=>  b < a
                (la, lc), (ra, rc) = (ra, rc), (la, lc)
            or_equal = "true" if cmp in ("le", "ge") else "false"
            where = self.where(op, f"kl.{cmp}")
            self.line(f"kl_compare_interval({la}, {lc}, {ra}, {rc}, {or_equal}, {n}, {where}, "
                      f"&{mlo}, &{mhi});")
        return mlo, mhi

    def op_transpose(self, op):
        v, src = op.result, op.operands[0]
        base = src.alias_of or src
        if (TRANSPOSE_BLOCKS and v.id in self.buffers and v.dtype == torch.float32
                and src.affine is None and base.shape != () and base.id in self.buffers):
            # both in buffers, row-major and contiguous: blocked SIMD transposes
            m, n = src.shape
            self.line(f"kl_transpose_f32({base.name}, {m}, {n}, {v.name});")
            return
        self.assign(v, lambda idx: self.elem(src, [idx[1], idx[0]]), src.dtype)

    # Vectorised float32 elementwise ops (at::vec::Vectorized<float>, the
    # SIMD math PyTorch's CPU kernels use): the innermost dim runs in vector
    # steps when every operand is a float32 tile with storage whose innermost
    # dim matches the result's or is broadcast (size 1), a float32 scalar or
    # a number.
    _VEC_BINARY = {"add": "({a} + {b})", "sub": "({a} - {b})", "mul": "({a} * {b})",
                   "div": "({a} / {b})", "maximum": "at::vec::maximum({a}, {b})",
                   "minimum": "at::vec::minimum({a}, {b})"}
    _VEC_UNARY = {"exp": "{a}.exp()", "fast_exp": "kl_fast_exp({a})", "log": "{a}.log()",
                  "sqrt": "{a}.sqrt()", "rsqrt": "{a}.rsqrt()", "tanh": "{a}.tanh()", "erf": "kl_erf({a})",
                  "floor": "{a}.floor()", "abs": "{a}.abs()", "neg": "{a}.neg()",
                  "sigmoid": "(KlVec(1.0f) / (KlVec(1.0f) + {a}.neg().exp()))"}

    def _vectorisable(self, op) -> bool:
        v = op.result
        if v.dtype != torch.float32 or v.shape == () or v.id not in self.buffers:
            return False
        if op.kind in self._VEC_BINARY:
            if op.attrs.get("common") != torch.float32:
                return False
        elif op.kind not in self._VEC_UNARY:
            return False
        for o in op.operands:
            if isinstance(o, ir.Value):
                if o.dtype != torch.float32 or o.affine is not None:
                    return False
                if o.shape == () or (o.alias_of is not None and o.alias_of.shape == ()):
                    continue
                if len(o.shape) > len(v.shape):
                    return False
            elif isinstance(o, bool) or not isinstance(o, (int, float)):
                return False
        return True

    def _vec_expr(self, op, full, count) -> str:
        """The at::vec expression of vectorisable ``op`` at index ``full``
        (the last index a vector step); ``count``: the elements left in a
        tail step (partial loads), or None."""
        def operand(o):
            if not isinstance(o, ir.Value):
                return f"KlVec({literal(o, torch.float32)})"
            if o.id in self.inlined:  # Note [kl elementwise fusion]
                return self._vec_expr(self.defs[o.id], full, count)
            if o.shape == () or o.shape[-1] == 1 or (o.alias_of is not None and
                                                     o.alias_of.shape == ()):
                return f"KlVec({self.elem(o, full)})"
            if count is not None:
                return f"KlVec::loadu(&{self.elem(o, full)}, {count})"
            return f"KlVec::loadu(&{self.elem(o, full)})"
        if op.kind in self._VEC_BINARY:
            a, b = op.operands
            return self._VEC_BINARY[op.kind].format(a=operand(a), b=operand(b))
        return self._VEC_UNARY[op.kind].format(a=operand(op.operands[0]))

    def _vec_row(self, op, idx, dest, n, streaming=False, flat=None) -> None:
        """Emits row ``idx`` (outer indices; ``flat`` their flat offset) of
        vectorisable ``op``, ``n`` elements, stored from the pointer
        expression ``dest`` on (whole vectors with kiln::store_streaming if
        ``streaming``: dest aligned); and the row's value of each reduction
        accumulated into this op's loop (Note [kl elementwise fusion])."""
        ii = self.fresh("c")
        full = idx + [ii]
        count = f"({n} - {ii})"
        self.line(f"int64_t {ii} = 0;")
        expr = self._vec_expr(op, full, None)
        reductions = list(self.accumulated_by.get(op.result.id, ())) if flat is not None else []
        if reductions:
            accs = []
            for r in reductions:
                _, init, _ = self._reduction_parts(r)
                acc = self.fresh("vacc")
                self.line(f"KlVec {acc}({init});")
                accs.append(acc)
            t = self.fresh("t")
            steps = " ".join(f"{acc} = {self._VEC_COMBINE[r.kind].format(a=acc, b=t)};"
                             for acc, r in zip(accs, reductions))
            self.line(f"for (; {ii} + KlVec::size() <= {n}; {ii} += KlVec::size()) {{ "
                      f"const KlVec {t} = {expr}; {t}.store({dest} + {ii}); {steps} }}")
            tail_start = self.fresh("tail")
            self.line(f"const int64_t {tail_start} = {ii};")
        else:
            store = (f"kiln::store_streaming({dest} + {ii}, {expr});" if streaming
                     else f"{expr}.store({dest} + {ii});")
            self.line(f"for (; {ii} + KlVec::size() <= {n}; {ii} += KlVec::size()) {store}")
        # the tail: partial loads and stores (KlVec::loadu(p, count)), so
        # it rounds like the body
        self.line(f"if ({ii} < {n}) {self._vec_expr(op, full, count)}.store({dest} + {ii}, "
                  f"{count});")
        for acc, r in (zip(accs, reductions) if reductions else ()):
            # as reduce() does: the lanes (kl_lanes_*), then the tail
            # elements (read back from the row just stored) one by one
            acc_dtype, _, combine = self._reduction_parts(r)
            total = self.fresh("total")
            self.line(f"float {total} = kl_lanes_{r.kind}({acc});")
            self.line(f"for (int64_t l = {tail_start}; l < {n}; ++l) {total} = "
                      + combine.format(a=total, b=f"({dest})[l]") + ";")
            rv = r.result
            target = rv.name if rv.shape == () else f"{rv.name}[{flat}]"
            self.line(f"{target} = {convert(total, acc_dtype, rv.dtype)};")

    def op_vector(self, op):
        v = op.result
        n = v.shape[-1]
        outer = list(v.shape[:-1])

        def body(idx, flat):
            row_flat = f"({flat}) * {n}" if outer else "0"
            self._vec_row(op, idx, f"{v.name} + {row_flat}", n, flat=flat if outer else "0")
        self.loops(outer, body)

    def op_elementwise(self, op):
        v, kind = op.result, op.kind
        ops = op.operands
        if v is not None and (v.id in self.inlined or v.id in self.deferred):
            return  # computed in its consumer (Note [kl elementwise fusion])
        if self._vectorisable(op):
            self.op_vector(op)
            return
        if kind == "where":
            c, a, b = ops
            if isinstance(c, ir.Value) and c.id in self.intervals and v.id in self.buffers:
                self._where_interval(op)
                return
            self.assign(v, lambda idx: f"({self.elem(c, idx)} ? {self.operand(a, idx, v.dtype)} "
                                       f": {self.operand(b, idx, v.dtype)})", v.dtype)
            return
        if kind in ("exp", "fast_exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "erf", "floor",
                    "abs", "invert", "neg"):
            x = ops[0]
            ct = compute_type(v.dtype)

            def unary(idx):
                a = self.operand(x, idx, v.dtype)
                if kind == "rsqrt":
                    return f"({ct}(1) / std::sqrt({a}))"
                if kind == "sigmoid":
                    return f"({ct}(1) / ({ct}(1) + std::exp(-{a})))"
                if kind == "abs":
                    return f"std::abs({a})" if v.dtype.is_floating_point else \
                        f"({a} < 0 ? -{a} : {a})"
                if kind == "invert":
                    return f"(!{a})" if v.dtype == torch.bool else f"(~{a})"
                if kind == "neg":  # floats only: the sign bit, as torch.neg
                    return f"(-{a})"
                if kind == "fast_exp":
                    return f"std::exp({a})"
                return f"std::{kind}({a})"
            self.assign(v, unary, v.dtype)
            return
        common = op.attrs["common"]
        a, b = ops
        sym = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">",
               "ge": ">=", "eq": "==", "ne": "!="}
        bool_sym = {"and": "&", "or": "|", "xor": "!="}  # no short-circuit: vectorises
        int_sym = {"and": "&", "or": "|", "xor": "^"}
        where = self.where(op, "kl '" + kind + "'")

        def binary(idx):
            x, y = self.operand(a, idx, common), self.operand(b, idx, common)
            if kind in sym:
                return f"({x} {sym[kind]} {y})"
            if kind in bool_sym:
                return f"({x} {(bool_sym if common == torch.bool else int_sym)[kind]} {y})"
            if kind in ("maximum", "minimum"):
                return f"kl_{kind}<{compute_type(common)}>({x}, {y})"
            return f"kl_{kind}<{compute_type(common)}>({x}, {y}, {where})"
        result_compute = torch.bool if kind in ("lt", "le", "gt", "ge", "eq", "ne") else common
        self.assign(v, binary, result_compute)

    def op_sum(self, op):
        self.reduce(op)

    op_max = op_min = op_sum

    @staticmethod
    def _reduction_parts(op):
        """(accumulator dtype, C++ init, scalar combine format) of sum/max/min ``op``."""
        x, kind = op.operands[0], op.kind
        if kind == "sum":
            acc_dtype = torch.float32 if x.dtype.is_floating_point else torch.int64
        else:
            acc_dtype = torch.float32 if x.dtype in _HALF else x.dtype
        at = CTYPE[acc_dtype]
        if kind == "sum":
            init = f"{at}(0)"
            combine = "({a} + {b})"
        else:
            if acc_dtype.is_floating_point:
                init = f"{'-' if kind == 'max' else ''}std::numeric_limits<{at}>::infinity()"
            else:
                init = f"std::numeric_limits<{at}>::{'lowest' if kind == 'max' else 'max'}()"
            combine = "kl_" + ("maximum" if kind == "max" else "minimum") + f"<{at}>({{a}}, {{b}})"
        return acc_dtype, init, combine

    _VEC_COMBINE = {"sum": "({a} + {b})", "max": "at::vec::maximum({a}, {b})",
                    "min": "at::vec::minimum({a}, {b})"}

    def reduce(self, op):
        v, x = op.result, op.operands[0]
        axis, kind = op.attrs["axis"], op.kind
        if v.id in self.accumulated:
            return  # computed in its operand's loop (Note [kl elementwise fusion])
        acc_dtype, init, combine = self._reduction_parts(op)
        at = CTYPE[acc_dtype]
        outer = [d for d in range(len(x.shape)) if d != axis]
        n = x.shape[axis]
        out_shape = [x.shape[d] for d in outer]

        if self._vector_reduction(op):
            vcombine = self._VEC_COMBINE[kind]
            fused = self.defs[x.id] if x.id in self.inlined else None  # Note [kl elementwise fusion]

            def vbody(idx, flat):
                r = self.fresh("r")
                vacc, total = self.fresh("vacc"), self.fresh("total")
                step = (self._vec_expr(fused, idx + [r], None) if fused is not None
                        else f"KlVec::loadu(&{self.elem(x, idx + [r])})")
                self.line(f"KlVec {vacc}({init});")
                self.line(f"int64_t {r} = 0;")
                self.line(f"for (; {r} + KlVec::size() <= {n}; {r} += KlVec::size()) {vacc} = "
                          + vcombine.format(a=vacc, b=step) + ";")
                self.line(f"float {total} = kl_lanes_{kind}({vacc});")
                if fused is None:
                    self.line(f"for (; {r} < {n}; ++{r}) {total} = "
                              + combine.format(a=total, b=self.elem(x, idx + [r])) + ";")
                else:
                    # the tail as the unfused producer computes it (partial
                    # loads), then combined element by element in order
                    tail, count = self.fresh("tail"), f"({n} - {r})"
                    self.line(f"if ({r} < {n}) {{")
                    self.line(f"  float {tail}[KlVec::size()];")
                    self.line(f"  {self._vec_expr(fused, idx + [r], count)}.store({tail}, {count});")
                    self.line(f"  for (int l = 0; l < {count}; ++l) {total} = "
                              + combine.format(a=total, b=f"{tail}[l]") + ";")
                    self.line("}")
                target = v.name if v.shape == () else f"{v.name}[{flat}]"
                self.line(f"{target} = {convert(total, acc_dtype, v.dtype)};")
            self.loops(out_shape, vbody)
            return

        def body(idx, flat):
            def at_index(r):
                full = list(idx)
                full.insert(axis, r)
                return to_compute(self.elem(x, full), x.dtype, acc_dtype)
            lanes = self.fresh("lanes")
            r = self.fresh("r")
            self.line(f"{at} {lanes}[8];")
            self.line(f"for (int l = 0; l < 8; ++l) {lanes}[l] = {init};")
            self.line(f"int64_t {r} = 0;")
            self.line(f"for (; {r} + 8 <= {n}; {r} += 8) {{")
            self.line(f"  for (int l = 0; l < 8; ++l) {lanes}[l] = "
                      + combine.format(a=f"{lanes}[l]", b=at_index(f"({r} + l)")) + ";")
            self.line("}")
            total = self.fresh("total")
            self.line(f"{at} {total} = {lanes}[0];")
            self.line(f"for (int l = 1; l < 8; ++l) {total} = "
                      + combine.format(a=total, b=f"{lanes}[l]") + ";")
            self.line(f"for (; {r} < {n}; ++{r}) {total} = "
                      + combine.format(a=total, b=at_index(r)) + ";")
            if v.shape == ():
                self.line(f"{v.name} = {convert(total, acc_dtype, v.dtype)};")
            else:
                # keepdims only inserts a size-1 dim: the flat offset is the same
                self.line(f"{v.name}[{flat}] = {convert(total, acc_dtype, v.dtype)};")
        self.loops(out_shape, body)

    def op_matmul(self, op):
        v, (a, b) = op.result, op.operands
        m, k = a.shape
        n = b.shape[1]
        if GEMM and all(t.dtype == torch.float32 and t.id in self.buffers for t in (a, b)):
            # float32 tiles in buffers (row-major, contiguous): kl_gemm
            self.gemm = True
            self.line(f"kl_gemm({m}, {n}, {k}, {a.name}, {b.name}, {v.name});")
            return
        i, j, kk = self.fresh(), self.fresh(), self.fresh()
        self.line(f"for (int64_t {i} = 0; {i} < {m}; ++{i}) {{")
        self.line(f"  float* __restrict kl_row = {v.name} + {i} * {n};")
        self.line(f"  for (int64_t {j} = 0; {j} < {n}; ++{j}) kl_row[{j}] = 0.0f;")
        self.line(f"  for (int64_t {kk} = 0; {kk} < {k}; ++{kk}) {{")
        self.line(f"    const float kl_a = {to_compute(self.elem(a, [i, kk]), a.dtype, torch.float32)};")
        self.line(f"    for (int64_t {j} = 0; {j} < {n}; ++{j}) kl_row[{j}] += kl_a * "
                  f"{to_compute(self.elem(b, [kk, j]), b.dtype, torch.float32)};")
        self.line("  }")
        self.line("}")

    @staticmethod
    def _element_literal(value, dtype) -> str:
        """A number (None: the fill of uninitialised elements, NaN or 0) as a
        C++ value of CTYPE[dtype]."""
        if value is None:
            value = float("nan") if dtype.is_floating_point else 0
        return convert(literal(value, dtype), torch.float32 if dtype in _HALF else dtype, dtype)

    def _access(self, op, kind):
        x, mask, third, *index = op.operands
        shape = op.result.shape if op.result is not None else op.attrs["shape"]
        spec_dtype = self.trace.tensor_specs[x][0]
        ct = CTYPE[spec_dtype]

        def body(idx, flat):
            cond = self.elem(mask, idx) if mask is not None else None
            if kind == "load":
                r = self.fresh("x")
                other = self.elem(third, idx) if isinstance(third, ir.Value) else \
                    self._element_literal(third, spec_dtype)
                self.line(f"{ct} {r} = {other};")
            if cond is not None:
                self.line(f"if ({cond}) {{")
                self.indent += 1
            offs = []
            for d, ix in enumerate(index):
                j = self.fresh("j")
                e = self.elem(ix, idx) if isinstance(ix, ir.Value) else f"INT64_C({ix})"
                if isinstance(ix, ir.Value) and ix.dtype != torch.int64:
                    e = f"static_cast<int64_t>({e})"
                self.line(f"const int64_t {j} = {e};")
                what = f"kl.{kind} {'from' if kind == 'load' else 'to'} '{x}'"
                self.line(f"if (__builtin_expect({j} < 0 || {j} >= {x}_sizes[{d}], 0)) "
                          f"kl_out_of_bounds({self.where(op, what)}, {j}, {d}, {x}_sizes[{d}]);")
                offs.append(f"{j} * {x}_strides[{d}]")
            address = f"{x}_data[{' + '.join(offs) or '0'}]"
            if kind == "load":
                self.line(f"{r} = {address};")
            else:
                value = self.elem(third, idx) if isinstance(third, ir.Value) else \
                    self._element_literal(third, spec_dtype)
                self.line(f"{address} = {value};")
            if cond is not None:
                self.indent -= 1
                self.line("}")
            if kind == "load":
                v = op.result
                self.line(f"{v.name} = {r};" if v.shape == () else f"{v.name}[{flat}] = {r};")
        self.loops(shape, body)

    def _linear(self, ix, idx, inner):
        """(index at inner = 0, coefficient of the inner loop variable) of
        index operand ``ix`` at ``idx + [inner]``, or None if it is not
        linear in the inner dim (a gathered index tile)."""
        if not isinstance(ix, ir.Value):
            return f"INT64_C({ix})", "0"
        if ix.shape == () or ix.shape[-1] == 1:
            return (self.elem(ix, idx + ["0"]) if ix.shape else ix.name), "0"
        if ix.affine is None:
            return None
        base, coeffs = ix.affine
        pad = len(idx) + 1 - len(ix.shape)
        terms, inner_coeff = [base], "0"
        for d, (c, size) in enumerate(zip(coeffs, ix.shape)):
            if size == 1 or c == "0":
                continue
            if pad + d == len(idx):
                inner_coeff = c
            else:
                terms.append(f"{c} * {idx[pad + d]}")
        return "(" + " + ".join(terms) + ")", inner_coeff

    def _access_rows(self, op, kind) -> bool:
        """Loads/stores whose indices are linear in the innermost dim: per
        row, the bounds are checked first (both ends without a mask, each
        enabled element with one, in a loop without branches), then a loop
        reads or writes ``row[i * step]`` (unit-step specialised), which
        the compiler vectorises (masked with AVX-512)."""
        x, mask, third, *index = op.operands
        shape = op.result.shape if op.result is not None else op.attrs["shape"]
        if not shape:
            return False
        # Note [kl interval masks]: the enabled elements of a row as [lo, hi)
        interval = self.intervals.get(mask.id) if isinstance(mask, ir.Value) else None
        if interval is not None:
            mask = None
        spec_dtype = self.trace.tensor_specs[x][0]
        ct = CTYPE[spec_dtype]
        n = shape[-1]
        what = f"kl.{kind} {'from' if kind == 'load' else 'to'} '{x}'"
        where = self.where(op, what)
        written = kind == "store"

        def probe():
            i = self.fresh("c")
            return [self._linear(ix, [f"o{k}" for k in range(len(shape) - 1)], i) for ix in index]
        if any(p is None for p in probe()):
            return False

        def body(idx, flat):
            inner = self.fresh("c")
            parts = [self._linear(ix, idx, inner) for ix in index]
            js, cs = [], []
            for d, (j0, c) in enumerate(parts):
                j = self.fresh("j")
                self.line(f"const int64_t {j} = {j0};")
                js.append(j)
                cs.append(c)
            off = " + ".join(f"{j} * {x}_strides[{d}]" for d, j in enumerate(js)) or "0"
            step = " + ".join(f"{c} * {x}_strides[{d}]" for d, c in enumerate(cs) if c != "0") \
                or "0"
            row = self.fresh("row")
            stp = self.fresh("step")
            self.line(f"const int64_t {stp} = {step};")
            # bounds: the elements in [lo, hi) are inside x along every dim;
            # an enabled element outside is an error (reported for the
            # first one, with its index).
            lo, hi = self.fresh("lo"), self.fresh("hi")
            self.line(f"int64_t {lo} = 0, {hi} = {n};")
            for d, (j, c) in enumerate(zip(js, cs)):
                self.line(f"kl_in_bounds({j}, {c}, {x}_sizes[{d}], {n}, &{lo}, &{hi});")
            enabled = "true" if mask is None else self.elem(mask, idx + [inner])
            if interval is not None:
                mlo, mhi = self._interval_bounds(interval, idx, inner, n)
                enabled = f"({inner} >= {mlo} && {inner} < {mhi})"
                out_of = f"({mlo} < {lo} || {mhi} > {hi})"
                self.line(f"if (__builtin_expect({mlo} < {mhi} && {out_of}, 0)) {{")
            else:
                self.line(f"if (__builtin_expect({lo} > 0 || {hi} < {n}, 0)) {{")
            self.line(f"  for (int64_t {inner} = 0; {inner} < {n}; ++{inner}) {{")
            self.line(f"    if (({inner} >= {lo} && {inner} < {hi}) || !{enabled}) continue;")
            for d, (j, c) in enumerate(zip(js, cs)):
                e = f"({j} + {c} * {inner})"
                self.line(f"    if (static_cast<uint64_t>{e} >= static_cast<uint64_t>"
                          f"({x}_sizes[{d}])) kl_out_of_bounds({where}, {e}, {d}, "
                          f"{x}_sizes[{d}]);")
            self.line("  }")
            self.line("}")
            if interval is not None:  # only [mlo, mhi) is accessed; it is in bounds
                self.line(f"{lo} = {mlo}; {hi} = std::max({mlo}, {mhi});")
            const = "" if written else "const "
            self.line(f"{const}{ct}* __restrict {row} = {x}_data + ({off});")

            def finish():
                target = None
                if kind == "load":
                    v = op.result
                    target = f"{v.name}[({flat}) * {n} + {inner}]" if len(shape) > 1 else \
                        f"{v.name}[{inner}]"
                    other = self.elem(third, idx + [inner]) if isinstance(third, ir.Value) else \
                        self._element_literal(third, spec_dtype)
                else:
                    value = self.elem(third, idx + [inner]) if isinstance(third, ir.Value) else \
                        self._element_literal(third, spec_dtype)
                if kind == "load":
                    if third is None or not isinstance(third, ir.Value):
                        scalar_other = other
                    elif self._broadcast_row(third):
                        scalar_other = self.elem(third, idx + ["0"])
                    else:
                        scalar_other = None
                    if scalar_other is not None and self._row_helper(
                            op, mask, kind, idx, flat, inner, row, stp, lo, hi, n, ct,
                            scalar_other):
                        return
                elif self._row_helper(op, mask, kind, idx, flat, inner, row, stp, lo, hi, n, ct,
                                      value):
                    return
                if kind == "load":
                    # outside [lo, hi) every element is masked off (checked above)
                    self.line(f"for (int64_t {inner} = 0; {inner} < {lo}; ++{inner}) "
                              f"{target} = {other};")
                    self.line(f"for (int64_t {inner} = {hi}; {inner} < {n}; ++{inner}) "
                              f"{target} = {other};")
                every = None
                if mask is not None:
                    # a row whose enabled elements are all of [lo, hi) (inside a
                    # ragged tile) takes the loop without the mask
                    every = self.fresh("every")
                    mshape = mask.shape
                    if not mshape or mshape[-1] == 1:
                        self.line(f"const bool {every} = {self.elem(mask, idx + ['0'])};")
                    elif mask.affine is None and not (mask.alias_of is not None and
                                                      mask.alias_of.shape == ()):
                        # the row's mask bytes are contiguous: all true = no 0 byte
                        self.line(f"const bool {every} = {hi} <= {lo} || std::memchr("
                                  f"&{self.elem(mask, idx + [lo])}, 0, {hi} - {lo}) == nullptr;")
                    else:
                        count = self.fresh("enabled")
                        self.line(f"int64_t {count} = 0;")
                        self.line(f"for (int64_t {inner} = {lo}; {inner} < {hi}; ++{inner}) "
                                  f"{count} += {self.elem(mask, idx + [inner])};")
                        self.line(f"const bool {every} = {count} == {hi} - {lo};")
                for unit in (True, False):
                    address = f"{row}[{inner}]" if unit else f"{row}[{inner} * {stp}]"
                    for masked in ((False,) if mask is None else (False, True)):
                        conds = ([f"{stp} == 1"] if unit else [f"{stp} != 1"])
                        if mask is not None:
                            conds.append(f"!{every}" if masked else every)
                        self.line(f"if ({' && '.join(conds)}) {{")
                        self.indent += 1
                        self.line(f"for (int64_t {inner} = {lo}; {inner} < {hi}; ++{inner}) {{")
                        self.indent += 1
                        if kind == "load":
                            if not masked:
                                self.line(f"{target} = {address};")
                            else:
                                # in bounds: read unconditionally, then select
                                t = self.fresh("t")
                                self.line(f"const {ct} {t} = {address};")
                                self.line(f"{target} = kl_select<{ct}>("
                                          f"{self.elem(mask, idx + [inner])}, {t}, {other});")
                        else:
                            if not masked:
                                self.line(f"{address} = {value};")
                            else:
                                self.line(f"if ({self.elem(mask, idx + [inner])}) {address} = "
                                          f"{value};")
                        self.indent -= 1
                        self.line("}")
                        self.indent -= 1
                        self.line("}")

            deferred = self.defs[third.id] if (kind == "store" and isinstance(third, ir.Value)
                                               and third.id in self.deferred) else None
            if deferred is None:
                finish()
                return
            # Note [kl elementwise fusion]: the stored value is computed
            # straight into a contiguous, in-bounds, enabled row; otherwise
            # into its buffer, then stored as usual.
            fast = [f"{stp} == 1", f"{lo} == 0", f"{hi} == {n}"]
            if mask is None:
                pass
            elif self._contiguous_row(mask, n):
                fast.append(f"std::memchr(&{self.elem(mask, idx + ['0'])}, 0, {n}) == nullptr")
            elif self._broadcast_row(mask):
                fast.append(self.elem(mask, idx + ["0"]))
            else:
                fast = None
            if fast is not None:
                self.streams = True
                self.line(f"if ({' && '.join(fast)}) {{")
                self.indent += 1
                # a large output: streaming stores (kiln/kernel.h)
                self.line(f"if ({x}_streaming && reinterpret_cast<uintptr_t>({row}) % "
                          f"sizeof(KlVec) == 0) {{")
                self.indent += 1
                self._vec_row(deferred, idx, row, n, streaming=True)
                self.indent -= 1
                self.line("} else {")
                self.indent += 1
                self._vec_row(deferred, idx, row, n)
                self.indent -= 1
                self.line("}")
                self.indent -= 1
                self.line("} else {")
                self.indent += 1
            self._vec_row(deferred, idx, f"{third.name} + ({flat}) * {n}" if len(shape) > 1
                          else third.name, n)
            finish()
            if fast is not None:
                self.indent -= 1
                self.line("}")
        self.loops(list(shape[:-1]), body)
        return True

    @staticmethod
    def _contiguous_row(v, n) -> bool:
        """Whether tile ``v``'s innermost dim is a contiguous row of ``n`` in a buffer."""
        return (isinstance(v, ir.Value) and bool(v.shape) and v.shape[-1] == n
                and v.affine is None and not (v.alias_of is not None and v.alias_of.shape == ()))

    @staticmethod
    def _broadcast_row(v) -> bool:
        return isinstance(v, ir.Value) and (not v.shape or v.shape[-1] == 1)

    def _row_helper(self, op, mask, kind, idx, flat, inner, row, stp, lo, hi, n, ct,
                    third) -> bool:
        """A row through kl_load_row / kl_store_row when the mask (None: all
        of [lo, hi) enabled) and the stored value are contiguous rows or
        broadcast along the row."""
        value = op.operands[2]
        if mask is None:
            mask_ptr, enabled = "nullptr", "true"
        elif self._contiguous_row(mask, n):
            mask_ptr, enabled = f"&{self.elem(mask, idx + ['0'])}", "true"
        elif self._broadcast_row(mask):
            mask_ptr, enabled = "nullptr", self.elem(mask, idx + ["0"])
        else:
            return False
        if kind == "load":
            v = op.result
            out = f"{v.name} + ({flat}) * {n}" if len(v.shape) > 1 else v.name
            self.line(f"kl_load_row<{ct}>({out}, {row}, {stp}, {lo}, {hi}, {n}, {mask_ptr}, "
                      f"{enabled}, {third});")
            return True
        if self._contiguous_row(value, n):
            values, scalar = f"&{self.elem(value, idx + ['0'])}", f"{ct}()"
        elif self._broadcast_row(value):
            values, scalar = "nullptr", self.elem(value, idx + ["0"])
        elif not isinstance(value, ir.Value):
            values, scalar = "nullptr", third
        else:
            return False
        self.line(f"kl_store_row<{ct}>({row}, {stp}, {lo}, {hi}, {mask_ptr}, {enabled}, "
                  f"{values}, {scalar});")
        return True

    def op_load(self, op):
        if self._access_rows(op, "load"):
            return
        self._access(op, "load")

    def op_store(self, op):
        if self._access_rows(op, "store"):
            return
        value = op.operands[2]
        if isinstance(value, ir.Value) and value.id in self.deferred:
            self.op_vector(self.defs[value.id])  # not a row store: computed into its buffer
        self._access(op, "store")

    def op_for(self, op):
        loop: ir.Loop = op.attrs["loop"]
        start, end = op.operands
        s = start.name if isinstance(start, ir.Value) else f"INT64_C({start})"
        e = end.name if isinstance(end, ir.Value) else f"INT64_C({end})"
        var = loop.var.name
        # the bounds are read once, as Python's range reads them: a carried
        # scalar bound (n = n - 1 in the body) must not move the end
        # Counted in uint64 trips, not by stepping var past end: near the
        # int64 maximum var += step wraps (-fwrapv) and `var < end` would hold
        # for ever; Python's range (the simulator) has no such edge.
        first, bound, trips = self.fresh("kl_first"), self.fresh("kl_end"), self.fresh("kl_trips")
        step = op.attrs["step"]
        t = self.fresh("kl_trip")
        self.line(f"const int64_t {first} = {s};")
        self.line(f"const int64_t {bound} = {e};")
        self.line(f"const uint64_t {trips} = {bound} > {first} ? (static_cast<uint64_t>({bound}) - "
                  f"static_cast<uint64_t>({first}) - 1) / {step}u + 1 : 0;")
        self.line(f"for (uint64_t {t} = 0; {t} < {trips}; ++{t}) {{")
        self.indent += 1
        self.line(f"int64_t {var} = static_cast<int64_t>(static_cast<uint64_t>({first}) + "
                  f"{t} * {step}u);")
        self.line(f"(void){var};")
        self.emit_block(loop.body)
        for outer, inner in loop.carried:
            if outer.shape == ():
                self.line(f"{outer.name} = {self.elem(inner, [])};")
            else:
                self.loops(outer.shape, lambda idx, flat: self.line(
                    f"{(outer.alias_of or outer).name}[{flat}] = {self.elem(inner, idx)};"))
        self.indent -= 1
        self.line("}")


def lower(trace: ir.Trace, kernel_name: str) -> tuple[str, str]:
    """(C++ source, part-1 signature) of the kernel ``kernel_name``."""
    e = _Emitter(trace, kernel_name)
    hoisted = e.program_invariant()
    e.indent = 2
    e.emit_block(ir.Block(hoisted))
    invariant_lines, e.lines = e.lines, []
    e.skip = {id(op) for op in hoisted}
    hoisted_scalars = {op.result.id for op in hoisted if op.result.shape == ()}
    e.indent = 3
    e.emit_block(trace.block)
    program_lines = e.lines
    out = [PRELUDE, f"// kl kernel {trace.name!r}: generated by torch_kiln.kl (lowering.py)",
           f"KILN_KERNEL({kernel_name}) {{"]
    sig = []
    index = 0
    for p in trace.params:
        if p.kind == "tensor":
            dtype, ndim = trace.tensor_specs[p.name]
            written = p.name in trace.written
            const = "" if written else "const "
            out.append(f"  const auto {p.name}_view = ctx.tensor<{const}{CTYPE[dtype]}, {ndim}>"
                       f"({index});")
            out.append(f"  {const}{CTYPE[dtype]}* const {p.name}_data = {p.name}_view.data();")
            out.append(f"  int64_t {p.name}_sizes[{max(ndim, 1)}] = {{0}};")
            out.append(f"  int64_t {p.name}_strides[{max(ndim, 1)}] = {{0}};")
            out.append(f"  for (int d = 0; d < {ndim}; ++d) {{ {p.name}_sizes[d] = "
                       f"{p.name}_view.size(d); {p.name}_strides[d] = {p.name}_view.stride(d); }}")
            if written:
                out.append(f"  int64_t {p.name}_bytes = {dtype.itemsize};")
                out.append(f"  for (int d = 0; d < {ndim}; ++d) {p.name}_bytes *= "
                           f"{p.name}_sizes[d];")
                out.append(f"  const bool {p.name}_streaming = {p.name}_bytes >= "
                           f"kiln::kStreamingBytes;")
                out.append(f"  (void){p.name}_streaming;")
            sig.append(f"{SIG_DTYPE[dtype]}[{','.join('*' * ndim)}]{'!' if written else ''} "
                       f"{p.name}")
            index += 1
        elif p.kind == "scalar":
            if trace.scalar_kinds[p.name] == "int":
                out.append(f"  const int64_t s_{p.name} = ctx.integer({index});")
                sig.append(f"int {p.name}")
            else:
                out.append(f"  const float s_{p.name} = static_cast<float>(ctx.scalar({index}));")
                sig.append(f"float {p.name}")
            index += 1
    for axis in range(3):
        out.append(f"  const int64_t kl_grid{axis} = ctx.integer({index});")
        sig.append(f"int kl_grid{axis}")
        index += 1
    out.append("  const int64_t kl_programs = kl_grid0 * kl_grid1 * kl_grid2;")
    out.append("  ctx.parallel_for(0, kl_programs, 1, [&](int64_t kl_begin, int64_t kl_end) {")
    if e.arena:
        out.append(f"    std::unique_ptr<unsigned char[]> kl_arena_owner(new unsigned char"
                   f"[{e.arena + 64}]);")
        out.append("    unsigned char* kl_arena = reinterpret_cast<unsigned char*>((reinterpret_cast"
                   "<uintptr_t>(kl_arena_owner.get()) + 63) & ~uintptr_t(63));")
    for v, offset in e.buffers.values():
        out.append(f"    {CTYPE[v.dtype]}* __restrict {v.name} = reinterpret_cast<"
                   f"{CTYPE[v.dtype]}*>(kl_arena + {offset});")
    for v in e.scalars:
        if v.id in hoisted_scalars:
            out.append(f"    {CTYPE[v.dtype]} {v.name}{{}};")
    out += invariant_lines
    out.append("    for (int64_t kl_program = kl_begin; kl_program < kl_end; ++kl_program) {")
    out.append("      const int64_t kl_pid0 = kl_program % kl_grid0;")
    out.append("      const int64_t kl_pid1 = (kl_program / kl_grid0) % kl_grid1;")
    out.append("      const int64_t kl_pid2 = kl_program / (kl_grid0 * kl_grid1);")
    out.append("      (void)kl_pid0; (void)kl_pid1; (void)kl_pid2;")
    for v in e.scalars:
        if v.id in e.buffers or v.id in hoisted_scalars:
            continue
        out.append(f"      {CTYPE[v.dtype]} {v.name}{{}};")
    out += program_lines
    out.append("    }")
    if e.streams:
        out.append("    kiln::fence_streaming();")
    if e.gemm:
        out.append("    kiln::gemm_release();")
    out.append("  });")
    out.append("}")
    signature = f"{kernel_name}({', '.join(sig)})"
    return "\n".join(out) + "\n", signature
