// kiln/kernel.h — writing custom kernels for the kiln device.
//
// A kernel is a C++ function over kiln device memory, declared with
// KILN_KERNEL and loaded with torch_kiln.kernels.load_inline / load, which
// compile it, check every call's arguments on the calling thread against the
// kernel's signature (dtypes, ranks, devices), and launch it as a task on the
// current kiln stream, in order with eager kiln ops (docs/kernels.md):
//
//   #include <kiln/kernel.h>
//
//   // signature, given to load_inline:
//   //   "scale(float32[*]! out, float32[*] x, float alpha)"
//   KILN_KERNEL(scale) {
//     auto out = ctx.tensor<float, 1>(0);
//     auto x = ctx.tensor<const float, 1>(1);
//     const double alpha = ctx.scalar(2);
//     ctx.parallel_for(0, x.size(0), 4096, [&](int64_t begin, int64_t end) {
//       for (int64_t i = begin; i < end; ++i) out(i) = float(alpha * x(i));
//     });
//   }
//
// What a kernel may do: read and write the memory of its tensor arguments
// (kiln device memory is host-addressable on the reference device), in any
// order, from any thread parallel_for runs; allocate host scratch memory. It
// must not call PyTorch (this header needs no PyTorch headers, so kernels
// compile in about a second) and must not keep pointers past its return.
//
// Arguments are positional, in the order of the signature. ctx.tensor<T, N>(i)
// views argument i as a rank-N tensor of element type T (const T for one the
// signature does not mark `!` written); ctx.scalar(i) and ctx.integer(i) read
// float and int arguments. A request that does not match the argument (wrong
// kind, dtype, rank, or a write view of a read-only tensor) throws
// kiln::Error, which kiln reports like any failure inside a kernel: the
// stream's sticky error, "<library>::<kernel>: <message>", raised at the next
// synchronization; the outputs are marked as holding no result and later work
// runs. KILN_KERNEL_CHECK(condition, message parts...) raises the same way.
//
// Element types: float (float32), double (float64), kiln::half (float16),
// kiln::bfloat16, int64_t, int32_t, int16_t, int8_t, uint8_t, bool.
// Sizes and strides are in elements, as Tensor.size() / Tensor.stride().
//
// Thread-safety: a kernel runs on one stream worker at a time per launch;
// parallel_for splits a range over the device's intra-op threads (the
// launching thread's torch.get_num_threads(), as for eager kiln kernels).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

// From ATen/native/CPUBlas.h (PyTorch 2.13), for kiln::gemm_f32 below,
// declared here: including that header adds 2-3 s to every kernel's build.
// libtorch_cpu exports both; a signature that no longer matches fails the
// link (kernels link with -Wl,--no-undefined: the error names the symbol).
namespace at::native::cpublas {
void brgemm(int64_t M, int64_t N, int64_t K, int64_t ld_a, int64_t ld_b, int64_t ld_c,
            const bool add_C, const float* A, const float* B, float* C, bool is_vnni);
void brgemm_release(bool is_vnni);
}  // namespace at::native::cpublas

namespace kiln {

// Codes of element types in the launch ABI (torch_kiln/kernels/signature.py
// writes the same numbers).
enum class ScalarType : int64_t {
  Float32 = 0,
  Float64 = 1,
  Float16 = 2,
  BFloat16 = 3,
  Int64 = 4,
  Int32 = 5,
  Int16 = 6,
  Int8 = 7,
  UInt8 = 8,
  Bool = 9,
};

inline const char* toString(ScalarType t) {
  switch (t) {
    case ScalarType::Float32: return "float32";
    case ScalarType::Float64: return "float64";
    case ScalarType::Float16: return "float16";
    case ScalarType::BFloat16: return "bfloat16";
    case ScalarType::Int64: return "int64";
    case ScalarType::Int32: return "int32";
    case ScalarType::Int16: return "int16";
    case ScalarType::Int8: return "int8";
    case ScalarType::UInt8: return "uint8";
    case ScalarType::Bool: return "bool";
  }
  return "unknown";
}

// An error raised inside a kernel (see the header comment).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}
} // namespace detail

#define KILN_KERNEL_CHECK(condition, ...)                                  \
  do {                                                                     \
    if (!(condition)) {                                                    \
      throw ::kiln::Error(::kiln::detail::concat(__VA_ARGS__));            \
    }                                                                      \
  } while (0)

// bfloat16: the upper 16 bits of a float32; conversion rounds to nearest
// even, as PyTorch's c10::BFloat16 does.
struct bfloat16 {
  uint16_t bits = 0;
  bfloat16() = default;
  bfloat16(float value) { // NOLINT(google-explicit-constructor): like c10::BFloat16
    uint32_t u;
    std::memcpy(&u, &value, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = 0x7fc0; // NaN
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      bits = static_cast<uint16_t>(u >> 16);
    }
  }
  operator float() const { // NOLINT(google-explicit-constructor)
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float value;
    std::memcpy(&value, &u, sizeof(value));
    return value;
  }
};

// half: IEEE binary16, converted through the compiler's _Float16.
struct half {
  uint16_t bits = 0;
  half() = default;
  half(float value) { // NOLINT(google-explicit-constructor)
    const _Float16 h = static_cast<_Float16>(value);
    std::memcpy(&bits, &h, sizeof(bits));
  }
  operator float() const { // NOLINT(google-explicit-constructor)
    _Float16 h;
    std::memcpy(&h, &bits, sizeof(h));
    return static_cast<float>(h);
  }
};

template <typename T>
struct ScalarTypeOf;
#define KILN_SCALAR_TYPE_OF(cpp, code) \
  template <>                          \
  struct ScalarTypeOf<cpp> {           \
    static constexpr ScalarType value = ScalarType::code; \
  };
KILN_SCALAR_TYPE_OF(float, Float32)
KILN_SCALAR_TYPE_OF(double, Float64)
KILN_SCALAR_TYPE_OF(half, Float16)
KILN_SCALAR_TYPE_OF(bfloat16, BFloat16)
KILN_SCALAR_TYPE_OF(int64_t, Int64)
KILN_SCALAR_TYPE_OF(int32_t, Int32)
KILN_SCALAR_TYPE_OF(int16_t, Int16)
KILN_SCALAR_TYPE_OF(int8_t, Int8)
KILN_SCALAR_TYPE_OF(uint8_t, UInt8)
KILN_SCALAR_TYPE_OF(bool, Bool)
#undef KILN_SCALAR_TYPE_OF

constexpr int kMaxDims = 8;   // dimensions of a tensor argument
constexpr int kMaxArgs = 64;  // arguments of a kernel (tensors and scalars)

// A typed, strided view of a kernel's tensor argument. T is the element type
// (const for read-only access); N the rank. Copyable; does not own memory.
template <typename T, int N>
class TensorView {
 public:
  TensorView(T* data, const int64_t* sizes, const int64_t* strides) : data_(data) {
    for (int d = 0; d < N; ++d) {
      sizes_[d] = sizes[d];
      strides_[d] = strides[d];
    }
  }

  T* data() const { return data_; }
  int64_t size(int d) const { return sizes_[d]; }
  int64_t stride(int d) const { return strides_[d]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int d = 0; d < N; ++d) n *= sizes_[d];
    return n;
  }
  // Row-major contiguous (strides of a fresh torch.empty).
  bool is_contiguous() const {
    int64_t expected = 1;
    for (int d = N - 1; d >= 0; --d) {
      if (sizes_[d] != 1 && strides_[d] != expected) return false;
      expected *= sizes_[d];
    }
    return true;
  }

  // The element at the given indices (no bounds checks).
  template <typename... Index>
  T& operator()(Index... index) const {
    static_assert(sizeof...(Index) == N, "kiln::TensorView: one index per dimension");
    const int64_t indices[] = {static_cast<int64_t>(index)...};
    int64_t offset = 0;
    for (int d = 0; d < N; ++d) offset += indices[d] * strides_[d];
    return data_[offset];
  }

 private:
  T* data_;
  int64_t sizes_[N > 0 ? N : 1] = {};
  int64_t strides_[N > 0 ? N : 1] = {};
};

// Launch ABI: one int64 slot per value, written by torch_kiln/kernels/
// launch.py. Slots: device, stream id (torch.kiln.Stream.stream_id of the
// stream the kernel runs on), kernel-name pointer, argument count; then per
// argument a kind (0 tensor, 1 float, 2 int) and its value: for a tensor,
// data pointer, dtype code, written flag, rank, sizes, strides; for a float
// the bits of a double; for an int the int.
class KernelContext {
 public:
  explicit KernelContext(const int64_t* packed) : packed_(packed) {
    device_ = static_cast<int>(packed[0]);
    stream_id_ = packed[1];
    name_ = reinterpret_cast<const char*>(packed[2]);
    num_args_ = static_cast<int>(packed[3]);
    KILN_KERNEL_CHECK(num_args_ >= 0 && num_args_ <= kMaxArgs, "kiln kernel ", name_,
                      ": bad argument count ", num_args_);
    int64_t slot = 4;
    for (int i = 0; i < num_args_; ++i) {
      offsets_[i] = slot;
      const int64_t kind = packed[slot];
      slot += kind == kTensor ? 5 + 2 * packed[slot + 4] : 2;
    }
  }

  // The kiln device index the kernel runs on (kiln:N).
  int device() const { return device_; }
  // The stream it runs on, as torch.kiln.Stream.stream_id reports it.
  int64_t stream_id() const { return stream_id_; }
  const char* name() const { return name_; }
  int num_args() const { return num_args_; }

  template <typename T, int N>
  TensorView<T, N> tensor(int i) const {
    using Element = std::remove_const_t<T>;
    const int64_t* a = argument(i, kTensor, "a tensor");
    const auto dtype = static_cast<ScalarType>(a[2]);
    KILN_KERNEL_CHECK(dtype == ScalarTypeOf<Element>::value, "argument ", i, " is a ",
                      toString(dtype), " tensor; the kernel viewed it as ",
                      toString(ScalarTypeOf<Element>::value));
    KILN_KERNEL_CHECK(a[4] == N, "argument ", i, " has ", a[4],
                      " dimensions; the kernel viewed it with ", N);
    KILN_KERNEL_CHECK(std::is_const_v<T> || a[3] != 0, "argument ", i,
                      " is read-only (not marked ! in the signature); view it as const");
    return TensorView<T, N>(reinterpret_cast<T*>(a[1]), a + 5, a + 5 + N);
  }

  double scalar(int i) const {
    const int64_t* a = argument(i, kFloat, "a float");
    double value;
    std::memcpy(&value, &a[1], sizeof(value));
    return value;
  }

  int64_t integer(int i) const {
    return argument(i, kInt, "an int")[1];
  }

  // Runs body(chunk_begin, chunk_end) over [begin, end) split into at most
  // one chunk per intra-op thread, each at least `grain` long. An exception
  // from any chunk is raised here after all chunks finished.
  template <typename F>
  void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& body) const {
    if (end <= begin) return;
    grain = std::max<int64_t>(grain, 1);
    const int64_t n = end - begin;
#ifdef _OPENMP
    const int64_t most = (n + grain - 1) / grain;
    const int chunks = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), most));
    if (chunks > 1 && !omp_in_parallel()) {
      std::exception_ptr error;
      std::atomic<bool> failed{false};
      const int64_t chunk = (n + chunks - 1) / chunks;
#pragma omp parallel num_threads(chunks)
      {
        const int64_t b = begin + omp_get_thread_num() * chunk;
        const int64_t e = std::min(end, b + chunk);
        if (b < e) {
          try {
            body(b, e);
          } catch (...) {
            if (!failed.exchange(true)) error = std::current_exception();
          }
        }
      }
      if (error) std::rethrow_exception(error);
      return;
    }
#endif
    body(begin, end);
  }

 private:
  static constexpr int64_t kTensor = 0, kFloat = 1, kInt = 2;

  const int64_t* argument(int i, int64_t kind, const char* what) const {
    KILN_KERNEL_CHECK(i >= 0 && i < num_args_, "argument ", i, " does not exist (the kernel has ",
                      num_args_, ")");
    const int64_t* a = packed_ + offsets_[i];
    KILN_KERNEL_CHECK(a[0] == kind, "argument ", i, " is not ", what);
    return a;
  }

  const int64_t* packed_;
  int device_ = 0;
  int64_t stream_id_ = 0;
  const char* name_ = "";
  int num_args_ = 0;
  int64_t offsets_[kMaxArgs] = {};
};

// ------------------------------------------------------- streaming stores
// Outputs of at least kStreamingBytes are best written with streaming
// (non-temporal) stores, which skip reading the output's cache lines before
// overwriting them (Intel SDM vol. 1, 10.4.6.2, "Caching of Temporal vs.
// Non-Temporal Data"): a third less memory traffic for a pass this size.
// 8 MiB is two of this machine's 4 MiB per-core L2 caches; smaller outputs,
// which the next op may still find in cache, take ordinary stores. Used by
// the bias + GELU example and by kl kernels' row stores (torch_kiln/kl).

constexpr int64_t kStreamingBytes = int64_t(8) << 20;

// Stores the float vector v (at::vec::Vectorized<float> of the build's
// CPU_CAPABILITY) at p, which must be aligned to sizeof(v), without reading
// p's cache line. Without AVX2/AVX-512 it is an ordinary store.
template <typename FloatVec>
inline void store_streaming(float* p, const FloatVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm512_stream_ps(p, v);
#elif defined(CPU_CAPABILITY_AVX2)
  _mm256_stream_ps(p, v);
#else
  v.store(p);
#endif
}

// Orders the calling thread's streaming stores before later stores and the
// task's end (they are weakly ordered); call it once after the last one.
inline void fence_streaming() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

// ------------------------------------------------------------------- GEMM
// c (m x n) = a (m x k) @ b (k x n), or c += a @ b when accumulate; float32,
// row-major, leading dimensions ld_a, ld_b, ld_c in elements. oneDNN's
// batch-reduce GEMM micro-kernel through ATen (at::native::cpublas::brgemm,
// what PyTorch's CPU flash attention calls): about twice BLAS sgemm's speed
// on attention's 64x64x64 blocks; ATen falls back to a reference GEMM where
// oneDNN's kernel is unavailable. For blocks that fit in cache (a kernel's
// tiles), not whole matrices. A thread that called it calls gemm_release()
// once at the end of its parallel_for chunk (frees the micro-kernel's
// per-thread state, as ATen's flash attention does). Used by kl.matmul
// (torch_kiln/kl) and examples/kernels/causal_attention.py.
inline void gemm_f32(int64_t m, int64_t n, int64_t k, const float* a, int64_t ld_a,
                     const float* b, int64_t ld_b, float* c, int64_t ld_c, bool accumulate) {
  at::native::cpublas::brgemm(m, n, k, ld_a, ld_b, ld_c, accumulate, a, b, c, /*is_vnni=*/false);
}

inline void gemm_release() { at::native::cpublas::brgemm_release(/*is_vnni=*/false); }

} // namespace kiln

// Defines kernel `name`: a body with `const kiln::KernelContext& ctx` in
// scope, and the entry point kiln launches, kiln_kernel_<name>.
#define KILN_KERNEL(name)                                                       \
  static void kiln_kernel_body_##name(const ::kiln::KernelContext& ctx);       \
  extern "C" __attribute__((visibility("default"))) void kiln_kernel_##name( \
      const int64_t* packed) {                                                  \
    const ::kiln::KernelContext ctx(packed);                                    \
    kiln_kernel_body_##name(ctx);                                               \
  }                                                                             \
  static void kiln_kernel_body_##name(const ::kiln::KernelContext& ctx)
