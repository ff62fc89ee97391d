// qcompile's fused fake-quant kernels (CPU), registered as torch.ops.qcompile.*.
//
// Numerics (bit-identical to qcompile.quant_math's eager formulation, float32 math):
//   q   = clamp(nearbyint(x / scale) + zero_point, quant_min, quant_max)
//   out = (q - zero_point) * scale
//   STE: grad_x = grad * (nearbyint(x / scale) + zero_point in [quant_min, quant_max])
//   LSQ: grad_scale = sum(grad * (inside ? q - zp - x/scale : q - zp)) * grad_factor
// Built without fast-math and with -ffp-contract=off: true division, IEEE rounding.
//
// Layout: x (made non-overlapping and dense) is walked in memory order as a flat array
// viewed as [outer, C, inner], the scale/zero point indexed by C, so one kernel serves
// per-tensor (C = 1), per-channel, per-group and per-token scales. Rows of >= kRowMin
// elements use one scale per row ("row mode"); shorter rows use per-element parameter
// arrays of one [C * inner] period ("column mode").
//
// The kernel bodies (the #else branch at the end) are compiled three times, for AVX-512,
// AVX2 and the baseline ISA, and picked at run time (the best the CPU has, or
// QCOMPILE_FQ_ISA): every variant does the same IEEE operations in the same order, so
// results do not depend on the machine.

#ifndef QCOMPILE_FQ_KERNEL_BODY

#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty_strided.h>
#include <c10/util/strides.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <sys/mman.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cfenv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

namespace qcompile_fq {

// One call's work, as plain pointers: shared by every ISA variant.
struct Job {
  const void* x = nullptr;   // input (float or bfloat16 bits)
  void* y = nullptr;         // forward output
  uint8_t* m = nullptr;      // STE mask, 1 byte per element (1 inside the range)
  uint8_t* bits = nullptr;   // STE mask, 1 bit per element (bit i % 8 of byte i / 8)
  const void* g = nullptr;   // upstream gradient
  void* gx = nullptr;        // gradient w.r.t. x
  const float* s = nullptr;  // scales: [C] (row mode) or [row] (column mode)
  const float* z = nullptr;  // zero points, same shape, as float
  double* part = nullptr;    // LSQ partial sums
  int64_t n = 0;             // elements
  int64_t row = 1;           // row length: inner (row mode) or C * inner (column mode)
  int64_t C = 1;             // scales per period (row mode)
  int64_t rows = 1;          // n / row
  int64_t chunk = 1, nchunk = 1;    // LSQ row mode: chunk length, chunks per row
  int64_t col_block = 1, ncb = 1;   // LSQ column mode: columns per task, tasks per row block
  int64_t row_block = 1;            // LSQ column mode: rows per task
  bool col = false;
  bool bf16 = false;
  bool stream = false;       // y written with non-temporal stores (float32, vector code)
  float lo = 0.f, hi = 0.f;
};

constexpr int64_t kTile = 1024;     // elements per tile of the bit mask (a multiple of 64)
constexpr int64_t kRowLong = 256;   // shorter rows of 16k elements: 16 at a time

struct KernelTable {
  const char* name;
  void (*fwd)(const Job&, int64_t, int64_t);            // elements [b, e)
  void (*bwd_mask)(const Job&, int64_t, int64_t);       // elements [b, e)
  void (*bwd_bits)(const Job&, int64_t, int64_t);       // elements [b, e), b % 64 == 0
  void (*lsq_bwd)(const Job&, int64_t, int64_t);        // tasks [b, e)
  void (*minmax)(const float*, int64_t, float*, float*);  // n floats -> min, max
  // fwd over elements [b, e) (b % 64 == 0), folding them into running minima / maxima
  void (*fwd_minmax)(const Job&, int64_t, int64_t, float*, float*);
};

}  // namespace qcompile_fq

#define QCOMPILE_FQ_KERNEL_BODY 1
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define QCOMPILE_FQ_X86 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
#define QCOMPILE_FQ_ISA_NAME "avx512"
#define QCOMPILE_FQ_AVX2 1  // GCC's target pragma does not define __AVX2__: our own flag
#define QCOMPILE_FQ_AVX512 1
namespace qcompile_fq::isa_avx512 {
#include __FILE__
}  // namespace qcompile_fq::isa_avx512
#undef QCOMPILE_FQ_AVX512
#undef QCOMPILE_FQ_AVX2
#undef QCOMPILE_FQ_ISA_NAME
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
#define QCOMPILE_FQ_ISA_NAME "avx2"
#define QCOMPILE_FQ_AVX2 1
namespace qcompile_fq::isa_avx2 {
#include __FILE__
}  // namespace qcompile_fq::isa_avx2
#undef QCOMPILE_FQ_AVX2
#undef QCOMPILE_FQ_ISA_NAME
#pragma GCC pop_options
#endif
#define QCOMPILE_FQ_ISA_NAME "base"
namespace qcompile_fq::isa_base {
#include __FILE__
}  // namespace qcompile_fq::isa_base
#undef QCOMPILE_FQ_ISA_NAME
#undef QCOMPILE_FQ_KERNEL_BODY

namespace qcompile_fq {

using at::Tensor;

constexpr int64_t kRowMin = 16;       // shorter rows run in column mode
constexpr int64_t kGrain = 32768;     // elements per parallel task, at least
constexpr int64_t kStreamMin = int64_t(2) << 20;  // observe_fwd: bytes for streaming stores
constexpr int64_t kChunk = 8192;      // LSQ row mode: elements per partial sum
constexpr int64_t kColBlock = 8192;   // LSQ column mode: columns per task
constexpr int64_t kColTask = 262144;  // LSQ column mode: elements per task, about

// The variant to run: 2 (avx512), 1 (avx2) or 0 (base): the best the CPU supports, or the
// one QCOMPILE_FQ_ISA asks for (``want``; never above what the CPU has). Not static:
// block_quant.cpp's kernels choose their variant with it too, so both always agree.
int isa_level(const std::string& want) {
#ifdef QCOMPILE_FQ_X86
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2");
  if (avx512 && (want.empty() || want == "avx512")) return 2;
  if (avx2 && (want.empty() || want == "avx512" || want == "avx2")) return 1;
#endif
  return 0;
}

// The best variant the CPU supports, or the one QCOMPILE_FQ_ISA (avx512, avx2, base) asks
// for, read at each call so tests can compare variants in one process.
static const KernelTable* pick(const std::string& want) {
  switch (isa_level(want)) {
#ifdef QCOMPILE_FQ_X86
    case 2: return &isa_avx512::table;
    case 1: return &isa_avx2::table;
#endif
    default: return &isa_base::table;
  }
}

static const KernelTable& kernels() {
  static const KernelTable* best = pick("");
  const char* want = std::getenv("QCOMPILE_FQ_ISA");
  return want && *want ? *pick(want) : *best;
}

// -- output buffers ----------------------------------------------------------------------
// A fresh output costs more than the kernel writing it: glibc maps every block of 32 MB
// and more (and, after the heap is trimmed, smaller ones too) in new pages, and the first
// touch of each faults and zeroes it (a 64 MB output: 16K faults, ~5x the time of copying
// into an existing buffer). A QAT step frees and re-allocates the same sizes every step
// (weight gradients at zero_grad, activation outputs after backward), so outputs of
// kPoolMin bytes and more come from a small cache of freed blocks, exact size, most
// recently freed first, at most QCOMPILE_FQ_POOL_MB (default 256) held; 0 turns it off.
// Blocks are 2 MB aligned and, from 32 MB, advised into transparent huge pages where the
// kernel offers them madvise-only (QCOMPILE_FQ_THP=0 turns that off): 512x fewer faults
// the first time. fake_quant_release_cache() frees what is held.
constexpr size_t kPoolMin = size_t(1) << 20;
constexpr size_t kHugeMin = size_t(32) << 20;
constexpr size_t kHugeAlign = size_t(2) << 20;

static size_t env_mb(const char* name, size_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? static_cast<size_t>(std::strtoull(v, nullptr, 10)) : fallback;
}

class OutputPool final : public c10::Allocator {
 public:
  // Never destroyed: tensors freed during interpreter exit still return their blocks here.
  static OutputPool& get() {
    static OutputPool* pool = new OutputPool();
    return *pool;
  }

  c10::DataPtr allocate(size_t n) override {
    Block* b = take(n);
    if (b == nullptr) {
      void* p = nullptr;
      TORCH_CHECK(posix_memalign(&p, kHugeAlign, std::max<size_t>(n, 1)) == 0,
                  "qcompile fake_quant: out of memory allocating ", n, " bytes");
#ifdef MADV_HUGEPAGE
      if (thp_ && n >= kHugeMin) madvise(p, n & ~(kHugeAlign - 1), MADV_HUGEPAGE);  // a hint
#endif
      b = new Block{p, n};
    }
    return {b->p, b, &OutputPool::release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  bool enabled() const { return cap_ > 0; }

  // Free every held block; returns the bytes freed.
  int64_t clear() {
    std::vector<Block*> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      drop.swap(free_);
      held_ = 0;
    }
    int64_t bytes = 0;
    for (Block* b : drop) {
      bytes += static_cast<int64_t>(b->n);
      destroy(b);
    }
    return bytes;
  }

 private:
  struct Block {
    void* p;
    size_t n;
  };

  OutputPool()
      : cap_(env_mb("QCOMPILE_FQ_POOL_MB", 256) << 20),
        thp_(!(std::getenv("QCOMPILE_FQ_THP") && std::string(std::getenv("QCOMPILE_FQ_THP")) == "0")) {}

  static void destroy(Block* b) {
    std::free(b->p);
    delete b;
  }

  Block* take(size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
      if ((*it)->n == n) {
        Block* b = *it;
        free_.erase(std::next(it).base());
        held_ -= n;
        return b;
      }
    }
    return nullptr;
  }

  static void release(void* ctx) { get().put(static_cast<Block*>(ctx)); }

  void put(Block* b) {
    std::vector<Block*> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (b->n <= cap_) {
        size_t k = 0;  // evict the oldest until it fits
        while (held_ + b->n > cap_ && k < free_.size()) held_ -= free_[k++]->n;
        drop.assign(free_.begin(), free_.begin() + k);
        free_.erase(free_.begin(), free_.begin() + k);
        free_.push_back(b);
        held_ += b->n;
        b = nullptr;
      }
    }
    for (Block* d : drop) destroy(d);  // outside the lock
    if (b != nullptr) destroy(b);
  }

  const size_t cap_;
  const bool thp_;
  std::mutex mu_;
  std::vector<Block*> free_;  // oldest first
  size_t held_ = 0;
};

// An uninitialised CPU tensor of the given sizes and strides, from the pool when large.
// Not static: block_quant.cpp's kernels take their outputs from the same pool.
Tensor empty_out(at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype) {
  OutputPool& pool = OutputPool::get();
  const int64_t n = c10::multiply_integers(sizes);
  if (!pool.enabled() || static_cast<size_t>(n) * c10::elementSize(dtype) < kPoolMin) {
    return at::empty_strided(sizes, strides, at::TensorOptions().dtype(dtype));
  }
  return at::detail::empty_strided_generic(sizes, strides, &pool,
                                           c10::DispatchKeySet(c10::DispatchKey::CPU), dtype);
}

// like at::empty_like(t) for a non-overlapping and dense t (same strides)
static Tensor empty_out_like(const Tensor& t, at::ScalarType dtype) {
  return empty_out(t.sizes(), t.strides(), dtype);
}

int64_t release_cache() { return OutputPool::get().clear(); }

static bool native(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16;
}

// -- layout ------------------------------------------------------------------------------
struct Layout {
  Tensor x;  // non-overlapping and dense
  int64_t n = 0, outer = 1, C = 1, inner = 1;
  bool col = false;
  const float* s = nullptr;  // [C] (row mode) or [C * inner] (column mode)
  const float* z = nullptr;
  std::vector<float> s_buf, z_buf;  // when scale / zero_point are not used in place
  // grad_scale: element c of the period adds to scale's element scale_index[c] (row-major
  // over scale's shape); empty when that is c itself
  std::vector<int64_t> scale_index;
  Tensor scale, zero_point;  // float / readable versions of the parameters, kept alive
};

static Tensor dense(const Tensor& t) {
  if (t.is_non_overlapping_and_dense()) return t;
  Tensor d = empty_out(t.sizes(), c10::contiguous_strides(t.sizes()), t.scalar_type());
  d.copy_(t);
  return d;
}

static bool readable(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kInt || t == at::kLong ||
         t == at::kShort || t == at::kChar || t == at::kByte;
}

static float read_float(const void* base, at::ScalarType t, int64_t i) {
  switch (t) {
    case at::kFloat: return static_cast<const float*>(base)[i];
    case at::kDouble: return static_cast<float>(static_cast<const double*>(base)[i]);
    case at::kInt: return static_cast<float>(static_cast<const int32_t*>(base)[i]);
    case at::kLong: return static_cast<float>(static_cast<const int64_t*>(base)[i]);
    case at::kShort: return static_cast<float>(static_cast<const int16_t*>(base)[i]);
    case at::kChar: return static_cast<float>(static_cast<const int8_t*>(base)[i]);
    default: return static_cast<float>(static_cast<const uint8_t*>(base)[i]);
  }
}

// One parameter tensor (scale or zero point) broadcast against x's nd dims: its element
// stride along each of x's dims (0 where it broadcasts).
static std::vector<int64_t> bstrides(const Tensor& t, const Tensor& x, const char* what) {
  const int64_t nd = x.dim(), off = nd - t.dim();
  TORCH_CHECK(off >= 0, "qcompile fake_quant: ", what, " ", t.sizes(),
              " must broadcast to x's shape ", x.sizes());
  std::vector<int64_t> st(nd, 0);
  for (int64_t d = off; d < nd; ++d) {
    const int64_t sz = t.size(d - off);
    TORCH_CHECK(sz == 1 || sz == x.size(d), "qcompile fake_quant: ", what, " ", t.sizes(),
                " must broadcast to x's shape ", x.sizes());
    st[d] = sz == 1 ? 0 : t.stride(d - off);
  }
  return st;
}

// x's elements in memory order form [outer, C, inner], C spanning the (memory-order
// adjacent) dims where scale or zero point vary; scattered dims give C = numel.
static Layout make_layout(const Tensor& x_in, const Tensor& scale_in, const Tensor& zp_in) {
  Layout L;
  L.x = dense(x_in);
  const Tensor& x = L.x;
  const int64_t nd = x.dim();
  L.n = x.numel();
  L.scale = scale_in.scalar_type() == at::kFloat ? scale_in : scale_in.to(at::kFloat);
  L.zero_point = readable(zp_in.scalar_type()) ? zp_in : zp_in.to(at::kFloat);
  const Tensor& scale = L.scale;
  const Tensor& zp = L.zero_point;
  const auto ss = bstrides(scale, x, "scale"), zs = bstrides(zp, x, "zero_point");
  // scale's row-major (contiguous) strides, for grad_scale
  std::vector<int64_t> sl(nd, 0);
  for (int64_t d = nd - 1, acc = 1; d >= nd - scale.dim(); --d) {
    const int64_t sz = scale.size(d - (nd - scale.dim()));
    sl[d] = sz == 1 ? 0 : acc;
    acc *= sz;
  }
  std::vector<int64_t> perm(nd);  // x's dims in memory order, outermost first
  std::iota(perm.begin(), perm.end(), 0);
  if (!x.is_contiguous()) {
    std::stable_sort(perm.begin(), perm.end(),
                     [&](int64_t a, int64_t b) { return x.stride(a) > x.stride(b); });
  }
  auto varies = [&](int64_t d) { return x.size(d) > 1 && (ss[d] != 0 || zs[d] != 0); };
  int64_t first = -1, last = -1;
  for (int64_t k = 0; k < nd; ++k) {
    if (varies(perm[k])) {
      if (first < 0) first = k;
      last = k;
    }
  }
  bool run = true;
  for (int64_t k = first; first >= 0 && k <= last; ++k) {
    run = run && (x.size(perm[k]) == 1 || varies(perm[k]));
  }
  if (first < 0) {  // one scale: a single row
    first = 0;
    last = -1;
  } else if (!run) {  // scattered: one parameter per element
    first = 0;
    last = nd - 1;
  }
  for (int64_t k = 0; k < first; ++k) L.outer *= x.size(perm[k]);
  for (int64_t k = first; k <= last; ++k) L.C *= x.size(perm[k]);
  L.inner = L.n / (L.outer * L.C);
  if (L.C == 1) {
    L.outer = 1;
    L.inner = L.n;
  }
  // Gather the C values of the period in memory order, in place when possible.
  const int64_t nrun = last - first + 1;
  std::vector<int64_t> dims(perm.begin() + first, perm.begin() + first + nrun);
  auto in_place = [&](const std::vector<int64_t>& st) {
    int64_t expect = 1;
    for (int64_t k = nrun - 1; k >= 0; --k) {
      const int64_t sz = x.size(dims[k]);
      if (sz > 1 && st[dims[k]] != expect) return false;
      expect *= sz;
    }
    return true;
  };
  const bool s_here = in_place(ss);
  const bool z_here = zp.scalar_type() == at::kFloat && in_place(zs);
  const bool s_linear = in_place(sl);
  if (!s_here) L.s_buf.resize(L.C);
  if (!z_here) L.z_buf.resize(L.C);
  if (!s_linear) L.scale_index.resize(L.C);
  if (!s_here || !z_here || !s_linear) {
    const float* sp = scale.const_data_ptr<float>();
    const void* zpp = zp.const_data_ptr();
    const auto zt = zp.scalar_type();
    std::vector<int64_t> idx(nrun, 0);
    int64_t so = 0, zo = 0, lo = 0;
    for (int64_t c = 0; c < L.C; ++c) {
      if (!s_here) L.s_buf[c] = sp[so];
      if (!z_here) L.z_buf[c] = read_float(zpp, zt, zo);
      if (!s_linear) L.scale_index[c] = lo;
      for (int64_t k = nrun - 1; k >= 0; --k) {  // odometer, innermost dim fastest
        const int64_t d = dims[k];
        if (++idx[k] < x.size(d)) {
          so += ss[d];
          zo += zs[d];
          lo += sl[d];
          break;
        }
        so -= ss[d] * (x.size(d) - 1);
        zo -= zs[d] * (x.size(d) - 1);
        lo -= sl[d] * (x.size(d) - 1);
        idx[k] = 0;
      }
    }
  }
  L.s = s_here ? scale.const_data_ptr<float>() : L.s_buf.data();
  L.z = z_here ? zp.const_data_ptr<float>() : L.z_buf.data();
  L.col = L.C > 1 && L.inner < kRowMin;
  if (L.col && L.inner > 1) {  // per-element parameters over one period
    std::vector<float> se(L.C * L.inner), ze(L.C * L.inner);
    for (int64_t c = 0; c < L.C; ++c) {
      std::fill_n(se.begin() + c * L.inner, L.inner, L.s[c]);
      std::fill_n(ze.begin() + c * L.inner, L.inner, L.z[c]);
    }
    L.s_buf = std::move(se);
    L.z_buf = std::move(ze);
    L.s = L.s_buf.data();
    L.z = L.z_buf.data();
  }
  return L;
}

static Job make_job(const Layout& L, int64_t qmin, int64_t qmax) {
  Job j;
  j.x = L.x.const_data_ptr();
  j.s = L.s;
  j.z = L.z;
  j.n = L.n;
  j.col = L.col;
  j.row = L.col ? L.C * L.inner : L.inner;
  j.C = L.C;
  j.rows = L.n / j.row;
  j.bf16 = L.x.scalar_type() == at::kBFloat16;
  j.lo = static_cast<float>(qmin);
  j.hi = static_cast<float>(qmax);
  return j;
}

// grad aligned with x's (dense) layout and dtype
static Tensor like_x(const Tensor& grad, const Tensor& x) {
  if (grad.scalar_type() == x.scalar_type() && grad.strides() == x.strides()) return grad;
  Tensor g = empty_out_like(x, x.scalar_type());
  g.copy_(grad);
  return g;
}

// -- CPU kernels -------------------------------------------------------------------------
// Threads take whole 64-element blocks: each writes whole bytes of a bit mask.
template <typename F>
static void parallel_blocks(int64_t n, F&& f) {
  at::parallel_for(0, (n + 63) / 64, kGrain / 64,
                   [&](int64_t b, int64_t e) { f(b * 64, std::min(n, e * 64)); });
}

static void run_fwd(const Layout& L, const Tensor& out, const Tensor& bits, int64_t qmin,
                    int64_t qmax) {
  Job j = make_job(L, qmin, qmax);
  j.y = out.mutable_data_ptr();
  j.bits = bits.defined() ? static_cast<uint8_t*>(bits.mutable_data_ptr()) : nullptr;
  const auto& k = kernels();
  parallel_blocks(L.n, [&](int64_t b, int64_t e) { k.fwd(j, b, e); });
}

static int64_t packed_bytes(int64_t n) { return (n + 7) / 8; }

Tensor fake_quant_cpu(const Tensor& x, const Tensor& scale, const Tensor& zero_point,
                      int64_t quant_min, int64_t quant_max) {
  if (!native(x.scalar_type())) {
    return fake_quant_cpu(x.to(at::kFloat), scale, zero_point, quant_min, quant_max)
        .to(x.scalar_type());
  }
  if (x.numel() == 0) return at::empty_like(x);
  Layout L = make_layout(x, scale, zero_point);
  Tensor out = empty_out_like(L.x, L.x.scalar_type());
  run_fwd(L, out, Tensor(), quant_min, quant_max);
  return out;
}

std::tuple<Tensor, Tensor> fake_quant_ste_fwd_cpu(const Tensor& x, const Tensor& scale,
                                                  const Tensor& zero_point, int64_t quant_min,
                                                  int64_t quant_max) {
  if (!native(x.scalar_type())) {
    auto [out, mask] =
        fake_quant_ste_fwd_cpu(x.to(at::kFloat), scale, zero_point, quant_min, quant_max);
    return {out.to(x.scalar_type()), mask};
  }
  Tensor bits = at::empty({packed_bytes(x.numel())}, x.options().dtype(at::kByte));
  if (x.numel() == 0) return {at::empty_like(x), bits};
  Layout L = make_layout(x, scale, zero_point);
  Tensor out = empty_out_like(L.x, L.x.scalar_type());
  run_fwd(L, out, bits, quant_min, quant_max);
  return {out, bits};
}

// grad * mask for a bool mask of grad's shape
Tensor fake_quant_bwd_cpu(const Tensor& grad, const Tensor& mask_in) {
  TORCH_CHECK(mask_in.scalar_type() == at::kBool && mask_in.sizes() == grad.sizes(),
              "qcompile fake_quant_bwd: expects a bool mask of the gradient's shape ",
              grad.sizes(), ", got ", mask_in.scalar_type(), " ", mask_in.sizes());
  if (!native(grad.scalar_type())) {
    return fake_quant_bwd_cpu(grad.to(at::kFloat), mask_in).to(grad.scalar_type());
  }
  const Tensor mask = dense(mask_in);
  Tensor gx = empty_out_like(mask, grad.scalar_type());
  if (mask.numel() == 0) return gx;
  Tensor g = like_x(grad, gx);
  Job j;
  j.g = g.const_data_ptr();
  j.gx = gx.mutable_data_ptr();
  j.m = static_cast<uint8_t*>(const_cast<void*>(mask.const_data_ptr()));
  j.n = mask.numel();
  j.bf16 = grad.scalar_type() == at::kBFloat16;
  const auto& k = kernels();
  at::parallel_for(0, j.n, kGrain, [&](int64_t b, int64_t e) { k.bwd_mask(j, b, e); });
  return gx;
}

// grad * mask for fake_quant_ste_fwd's bit mask, in the forward output's layout (stride);
// into gx when given (grad itself: FakeQuantSTEBackward), else a new tensor
static Tensor ste_bwd(const Tensor& grad, const Tensor& mask, at::IntArrayRef stride,
                      Tensor gx) {
  if (!gx.defined()) gx = empty_out(grad.sizes(), stride, grad.scalar_type());
  if (gx.numel() == 0) return gx;
  TORCH_CHECK(gx.is_non_overlapping_and_dense() && mask.scalar_type() == at::kByte &&
                  mask.is_contiguous() && mask.numel() == packed_bytes(gx.numel()),
              "qcompile fake_quant_ste_bwd: expects the mask and the output stride of "
              "fake_quant_ste_fwd");
  Tensor g = like_x(grad, gx);
  Job j;
  j.g = g.const_data_ptr();
  j.gx = gx.mutable_data_ptr();
  j.bits = static_cast<uint8_t*>(const_cast<void*>(mask.const_data_ptr()));
  j.n = gx.numel();
  j.bf16 = grad.scalar_type() == at::kBFloat16;
  const auto& k = kernels();
  parallel_blocks(j.n, [&](int64_t b, int64_t e) { k.bwd_bits(j, b, e); });
  return gx;
}

Tensor fake_quant_ste_bwd_cpu(const Tensor& grad, const Tensor& mask,
                              c10::SymIntArrayRef stride_sym) {
  const auto stride = C10_AS_INTARRAYREF_SLOW(stride_sym);
  if (!native(grad.scalar_type())) {
    return fake_quant_ste_bwd_cpu(grad.to(at::kFloat), mask, stride_sym)
        .to(grad.scalar_type());
  }
  return ste_bwd(grad, mask, stride, Tensor());
}

std::tuple<Tensor, Tensor> fake_quant_lsq_bwd_cpu(const Tensor& grad, const Tensor& x,
                                                  const Tensor& scale, const Tensor& zero_point,
                                                  int64_t quant_min, int64_t quant_max,
                                                  double grad_factor) {
  if (!native(x.scalar_type())) {
    auto [gx, gs] = fake_quant_lsq_bwd_cpu(grad.to(at::kFloat), x.to(at::kFloat), scale,
                                           zero_point, quant_min, quant_max, grad_factor);
    return {gx.to(grad.scalar_type()), gs};
  }
  Tensor grad_scale = at::empty(scale.sizes(), scale.options());
  if (x.numel() == 0) return {at::empty_like(x, grad.options()), grad_scale.zero_()};
  Layout L = make_layout(x, scale, zero_point);
  Tensor g = like_x(grad, L.x);
  Tensor gx = empty_out_like(L.x, L.x.scalar_type());
  Job j = make_job(L, quant_min, quant_max);
  j.g = g.const_data_ptr();
  j.gx = gx.mutable_data_ptr();
  int64_t tasks, grain;
  std::vector<double> part;
  if (!L.col && j.row < kRowLong && j.row % 16 == 0) {  // tasks: tiles of short rows
    tasks = (j.rows + kTile / j.row - 1) / (kTile / j.row);
    grain = std::max<int64_t>(1, kGrain / kTile);
    part.resize(j.rows);
  } else if (!L.col) {  // tasks: chunks of long rows
    j.chunk = std::min(j.row, kChunk);
    j.nchunk = (j.row + j.chunk - 1) / j.chunk;
    tasks = j.rows * j.nchunk;
    grain = std::max<int64_t>(1, kGrain / j.chunk);
    part.resize(tasks);
  } else {
    j.col_block = std::min(j.row, kColBlock);
    j.ncb = (j.row + j.col_block - 1) / j.col_block;
    j.row_block = std::max<int64_t>(1, kColTask / j.col_block);
    const int64_t nrb = (j.rows + j.row_block - 1) / j.row_block;
    tasks = nrb * j.ncb;
    grain = 1;
    part.resize(nrb * j.row);
  }
  j.part = part.data();
  const auto& k = kernels();
  at::parallel_for(0, tasks, grain, [&](int64_t b, int64_t e) { k.lsq_bwd(j, b, e); });
  // Reduce the partial sums in a fixed order: the same bits whatever the thread count.
  std::vector<double> per_c(L.C, 0.0);
  if (!L.col) {
    for (int64_t r = 0; r < j.rows; ++r) {
      double acc = 0.0;
      for (int64_t c = 0; c < j.nchunk; ++c) acc += part[r * j.nchunk + c];
      per_c[r % L.C] += acc;
    }
  } else {
    const int64_t nrb = static_cast<int64_t>(part.size()) / j.row;
    for (int64_t c = 0; c < L.C; ++c) {
      double acc = 0.0;
      for (int64_t i = 0; i < L.inner; ++i) {
        double col = 0.0;
        for (int64_t rb = 0; rb < nrb; ++rb) col += part[rb * j.row + c * L.inner + i];
        acc += col;
      }
      per_c[c] = acc;
    }
  }
  // float32 rounding once per scale, then the factor in float32 (as the eager formula)
  const float factor = static_cast<float>(grad_factor);
  if (L.scale_index.empty() && grad_scale.scalar_type() == at::kFloat &&
      grad_scale.is_contiguous()) {
    float* gp = grad_scale.mutable_data_ptr<float>();
    for (int64_t c = 0; c < L.C; ++c) gp[c] = static_cast<float>(per_c[c]) * factor;
  } else {
    std::vector<double> acc(scale.numel(), 0.0);
    for (int64_t c = 0; c < L.C; ++c) acc[L.scale_index.empty() ? c : L.scale_index[c]] += per_c[c];
    Tensor gs = at::empty(scale.sizes(), scale.options().dtype(at::kFloat));
    float* gp = gs.mutable_data_ptr<float>();
    for (size_t i = 0; i < acc.size(); ++i) gp[i] = static_cast<float>(acc[i]) * factor;
    grad_scale.copy_(gs);
  }
  return {gx, grad_scale};
}

// -- meta (shape) kernels: the same strides as the CPU kernels ----------------------------
Tensor fake_quant_meta(const Tensor& x, const Tensor&, const Tensor&, int64_t, int64_t) {
  return at::empty_like(x);
}
std::tuple<Tensor, Tensor> fake_quant_ste_fwd_meta(const Tensor& x, const Tensor&,
                                                   const Tensor&, int64_t, int64_t) {
  return {at::empty_like(x),
          at::empty_symint({(x.sym_numel() + 7) / 8}, x.options().dtype(at::kByte))};
}
Tensor fake_quant_ste_bwd_meta(const Tensor& grad, const Tensor&, c10::SymIntArrayRef stride) {
  return at::empty_strided_symint(grad.sym_sizes(), stride, grad.options());
}
Tensor fake_quant_bwd_meta(const Tensor& grad, const Tensor& mask) {
  return at::empty_like(mask, grad.options());
}
std::tuple<Tensor, Tensor> fake_quant_lsq_bwd_meta(const Tensor& grad, const Tensor& x,
                                                   const Tensor& scale, const Tensor&, int64_t,
                                                   int64_t, double) {
  return {at::empty_like(x, grad.options()), at::empty_symint(scale.sym_sizes(), scale.options())};
}

// -- autograd ----------------------------------------------------------------------------
template <typename Sig>
static c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}
using FqSig = Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t);
using FwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, int64_t,
                                          int64_t);
using BwdSig = Tensor(const Tensor&, const Tensor&, c10::SymIntArrayRef);
using LsqBwdSig = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                             const Tensor&, int64_t, int64_t, double);

// One autograd node per call, built as torch's generated nodes are (a Node subclass
// holding SavedVariables; set_history on the output), not with torch::autograd::Function:
// its generic machinery (a context of IValue maps, per-output bookkeeping, wrapping) cost
// more per call than a small tensor's kernels, forward and backward. An undefined
// incoming gradient (output unused) gives undefined gradients, as generated nodes do.
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

struct FakeQuantSTEBackward final : public Node {
  SavedVariable mask;              // 1 bit per element (not kept when all are set)
  std::vector<c10::SymInt> stride;  // of the forward output (the gradient's layout)
  bool all_in = false;             // no element was clamped: the gradient passes as is

  std::string name() const override { return "FakeQuantSTEBackward"; }
  void release_variables() override { mask.reset_data(); }
  variable_list apply(variable_list&& grads) override {
    static const auto bwd = op<BwdSig>("qcompile::fake_quant_ste_bwd");
    variable_list out(num_outputs());  // x, scale (the scale gets none: straight-through)
    if (grads[0].defined() && should_compute_output(0)) {
      // grad * 1 is grad, bit for bit: hand it on (as an identity's backward does)
      // instead of reading it and writing a copy
      if (all_in) {
        out[0] = std::move(grads[0]);
      } else if (own_grad(grads[0])) {
        // nothing else holds the incoming gradient (as AccumulateGrad steals one): mask
        // it where it is instead of writing a new tensor
        const Tensor m = mask.unpack();
        out[0] = ste_bwd(grads[0], m, grads[0].strides(), grads[0]);
      } else {
        out[0] = bwd.call(grads[0], mask.unpack(), stride);
      }
    }
    return out;
  }

  // The gradient is this node's alone (no other reference, no view of it: a sum's
  // backward hands one tensor to both its inputs, each a reference) and lies in the
  // forward output's layout, in a dtype the kernel takes; not under create_graph.
  bool own_grad(const Tensor& g) const {
    if (at::GradMode::is_enabled() || g.use_count() != 1 || g.is_view() ||
        !native(g.scalar_type()) || !g.has_storage() || g.storage().use_count() != 1) {
      return false;
    }
    const auto keys = g.key_set();
    if (!keys.has(c10::DispatchKey::CPU) || keys.has(c10::DispatchKey::Python) ||
        g.storage().data() == nullptr || g.sym_strides().vec() != stride) {
      return false;
    }
    return g.is_non_overlapping_and_dense();
  }
};

// A CPU tensor whose bytes can be read here (not a fake, functional or other Python
// subclass tensor being traced: their storage has no data).
static bool plain_cpu(const Tensor& t) {
  const auto keys = t.key_set();
  return keys.has(c10::DispatchKey::CPU) && !keys.has(c10::DispatchKey::Python) &&
         !keys.has(c10::DispatchKey::Functionalize) && t.has_storage() &&
         t.storage().data() != nullptr;
}

// n bytes all 0xFF (8 at a time)
static bool all_ones(const uint8_t* p, int64_t n) {
  uint64_t acc = ~uint64_t(0);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, sizeof w);
    acc &= w;
  }
  for (; i < n; ++i) acc &= 0xFFFFFFFFFFFFFF00ULL | p[i];
  return acc == ~uint64_t(0);
}

// Whether the first n bits of a packed mask are all set (the bits past n are zero).
static bool all_set(const Tensor& bits, int64_t n) {
  const uint8_t* p = bits.const_data_ptr<uint8_t>();
  const int64_t full = n / 8;
  int64_t i = 0;
  uint64_t acc = ~uint64_t(0);
  for (; i + 8 <= full; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, sizeof w);
    acc &= w;
  }
  for (; i < full; ++i) acc &= 0xFFFFFFFFFFFFFF00ULL | p[i];
  if (acc != ~uint64_t(0)) return false;
  return n % 8 == 0 || p[full] == static_cast<uint8_t>((1u << (n % 8)) - 1);
}

struct FakeQuantLSQBackward final : public Node {
  SavedVariable x, scale, zero_point;  // zero_point as float, as of the forward
  int64_t quant_min = 0, quant_max = 0;
  double grad_factor = 0.0;

  std::string name() const override { return "FakeQuantLSQBackward"; }
  void release_variables() override {
    x.reset_data();
    scale.reset_data();
    zero_point.reset_data();
  }
  variable_list apply(variable_list&& grads) override {
    static const auto bwd = op<LsqBwdSig>("qcompile::fake_quant_lsq_bwd");
    variable_list out(num_outputs());  // x, scale
    if (!grads[0].defined() || !(should_compute_output(0) || should_compute_output(1))) {
      return out;
    }
    auto [gx, gs] = bwd.call(grads[0], x.unpack(), scale.unpack(), zero_point.unpack(),
                             quant_min, quant_max, grad_factor);
    if (should_compute_output(0)) out[0] = std::move(gx);
    if (should_compute_output(1)) out[1] = std::move(gs);
    return out;
  }
};

template <typename N>
static c10::intrusive_ptr<N> new_node(const Tensor& x, const Tensor& scale) {
  auto node = c10::make_intrusive<N>();
  node->set_next_edges(torch::autograd::collect_next_edges(x, scale));
  return node;
}

// The straight-through node as out's history, keeping the mask unless every element was
// inside the range (all_in: the backward hands the gradient on as is).
static Tensor with_history(Tensor out, const c10::intrusive_ptr<FakeQuantSTEBackward>& node,
                           const Tensor& mask, bool all_in) {
  node->all_in = all_in;
  if (!all_in) node->mask = SavedVariable(mask, false);
  node->stride = out.sym_strides().vec();
  torch::autograd::set_history(out, node);
  return out;
}

static bool needs_grad(const Tensor& x, const Tensor& scale) {
  return at::GradMode::is_enabled() && (x.requires_grad() || scale.requires_grad());
}

Tensor fake_quant_autograd(const Tensor& x, const Tensor& scale, const Tensor& zero_point,
                           int64_t quant_min, int64_t quant_max) {
  static const auto fq = op<FqSig>("qcompile::fake_quant");
  static const auto fwd = op<FwdSig>("qcompile::fake_quant_ste_fwd");
  if (!needs_grad(x, scale)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return fq.call(x, scale, zero_point, quant_min, quant_max);
  }
  auto node = new_node<FakeQuantSTEBackward>(x, scale);
  Tensor out, mask;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::tie(out, mask) = fwd.call(x, scale, zero_point, quant_min, quant_max);
  }
  // Weights under a min-max observer are never clamped (the range covers them): their
  // backward is then free. The check reads the n / 8 mask bytes just written.
  return with_history(out, node, mask, plain_cpu(mask) && all_set(mask, x.numel()));
}

Tensor fake_quant_lsq_autograd(const Tensor& x, const Tensor& scale, const Tensor& zero_point,
                               int64_t quant_min, int64_t quant_max, double grad_factor) {
  static const auto fq = op<FqSig>("qcompile::fake_quant");
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = fq.call(x, scale, zero_point, quant_min, quant_max);
  }
  if (!needs_grad(x, scale)) return out;
  auto node = new_node<FakeQuantLSQBackward>(x, scale);
  node->x = SavedVariable(x, false);
  node->scale = SavedVariable(scale, false);
  node->zero_point = SavedVariable(zero_point.to(at::kFloat), false);
  node->quant_min = quant_min;
  node->quant_max = quant_max;
  node->grad_factor = grad_factor;
  torch::autograd::set_history(out, node);
  return out;
}

Tensor fake_quant_lsq_cpu(const Tensor& x, const Tensor& scale, const Tensor& zero_point,
                          int64_t quant_min, int64_t quant_max, double) {
  return fake_quant_cpu(x, scale, zero_point, quant_min, quant_max);
}
Tensor fake_quant_lsq_meta(const Tensor& x, const Tensor&, const Tensor&, int64_t, int64_t,
                           double) {
  return at::empty_like(x);
}

// -- observation ---------------------------------------------------------------------------
// A min-max observer's update and the qparams it gives, per row of x (per-channel along
// dim 0, or one row: per-tensor), in one pass and one call: the Python path reads the
// weight twice (amin, amax) and runs ~15 small ops per quantizer. Bit-identical to
// MinMaxObserver.update (momentum < 0) or MovingAverageObserver.update (momentum >= 0)
// + quant_math.qparams_from_minmax (float32, the same operations in the same order; NaN
// propagates as in torch.minimum / maximum / clamp).
static inline float nan_min(float a, float b) { return (a != a || b != b) ? NAN : (b < a ? b : a); }
static inline float nan_max(float a, float b) { return (a != a || b != b) ? NAN : (b > a ? b : a); }
static inline float clamp_lo(float v, float lo) { return v != v ? v : (v < lo ? lo : v); }
static inline float clamp_hi(float v, float hi) { return v != v ? v : (v > hi ? hi : v); }

// An observer's state and the qparams it gives, as pointers (one value per row of x).
struct Observation {
  float* mn;
  float* mx;
  float* s;
  int32_t* z;
  float lo, hi, steps, levels, eps, m, m1;  // m1: 1 - momentum
  int64_t zsym;
  bool symmetric, average, low_m;            // low_m: momentum < 0.5 (lerp's two formulas)

  // Fold row r's batch min / max in and compute its qparams; returns the zero point as
  // the forward reads it (a float).
  float update(int64_t r, float bmn, float bmx) const {
    float a = bmn, b = bmx;
    if (!average) {  // MinMaxObserver: running extremes
      a = nan_min(mn[r], bmn);
      b = nan_max(mx[r], bmx);
    } else if (!std::isinf(mn[r])) {  // MovingAverageObserver; a fresh entry takes the batch's
      a = low_m ? mn[r] + (bmn - mn[r]) * m : bmn - (bmn - mn[r]) * m1;
      b = low_m ? mx[r] + (bmx - mx[r]) * m : bmx - (bmx - mx[r]) * m1;
    }
    mn[r] = a;
    mx[r] = b;
    const float min_neg = clamp_hi(a, 0.0f), max_pos = clamp_lo(b, 0.0f);
    float sc, zf;
    if (symmetric) {
      sc = clamp_lo(nan_max(-min_neg, max_pos) / steps, eps);
      zf = static_cast<float>(zsym);
    } else {
      sc = clamp_lo((max_pos - min_neg) / levels, eps);
      zf = clamp_hi(clamp_lo(lo - std::nearbyint(min_neg / sc), lo), hi);
    }
    s[r] = sc;
    z[r] = zf != zf ? std::numeric_limits<int32_t>::min() : static_cast<int32_t>(zf);
    return static_cast<float>(z[r]);
  }
};

static Observation observation(const Tensor& x, const Tensor& min_val, const Tensor& max_val,
                               const Tensor& scale, const Tensor& zero_point,
                               int64_t quant_min, int64_t quant_max, bool symmetric,
                               double momentum, const char* who) {
  const int64_t rows = min_val.numel();
  auto ok = [&](const Tensor& t, at::ScalarType dt) {
    return t.scalar_type() == dt && t.is_contiguous() && t.numel() == rows && t.is_cpu();
  };
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && rows > 0 &&
                  x.numel() % rows == 0 && ok(min_val, at::kFloat) && ok(max_val, at::kFloat) &&
                  ok(scale, at::kFloat) && ok(zero_point, at::kInt),
              "qcompile ", who, ": expects contiguous float32 x, float32 min / max / "
              "scale and int32 zero point of one value per row of x");
  Observation o;
  o.mn = min_val.mutable_data_ptr<float>();
  o.mx = max_val.mutable_data_ptr<float>();
  o.s = scale.mutable_data_ptr<float>();
  o.z = zero_point.mutable_data_ptr<int32_t>();
  o.eps = std::numeric_limits<float>::epsilon();
  o.lo = static_cast<float>(quant_min);
  o.hi = static_cast<float>(quant_max);
  o.zsym = quant_min < 0 ? 0 : (quant_min + quant_max + 1) / 2;
  o.steps = static_cast<float>(std::min(quant_max - o.zsym, o.zsym - quant_min));
  o.levels = static_cast<float>(quant_max - quant_min);
  o.symmetric = symmetric;
  o.average = momentum >= 0.0;
  o.m = static_cast<float>(momentum);  // as torch multiplies a float32 tensor by it
  o.m1 = static_cast<float>(1.0 - momentum);
  o.low_m = momentum < 0.5;
  return o;
}

// written through pointers: bump the version counters as copy_ does (the weight cache and
// autograd's saved-tensor checks read them)
static void bump(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts) {
    if (!t->is_inference()) torch::autograd::impl::bump_version(*t);
  }
}

// min and max of each row of x viewed as [rows, len]: threads over rows, or over chunks
// of the row when there are fewer rows than threads (a per-tensor activation)
static void row_minmax(const float* xp, int64_t rows, int64_t len, float* mn, float* mx) {
  const auto& k = kernels();
  if (rows >= at::get_num_threads() || len < 2 * kGrain) {
    at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(len, 1)),
                     [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) k.minmax(xp + r * len, len, mn + r, mx + r);
    });
    return;
  }
  const int64_t nchunk = (len + kGrain - 1) / kGrain;
  std::vector<float> cmn(rows * nchunk), cmx(rows * nchunk);
  at::parallel_for(0, rows * nchunk, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t r = t / nchunk, at = (t % nchunk) * kGrain;
      k.minmax(xp + r * len + at, std::min(kGrain, len - at), &cmn[t], &cmx[t]);
    }
  });
  for (int64_t r = 0; r < rows; ++r) {  // exact: min / max do not depend on the order
    float a = INFINITY, b = -INFINITY;
    for (int64_t c = 0; c < nchunk; ++c) {
      a = nan_min(a, cmn[r * nchunk + c]);
      b = nan_max(b, cmx[r * nchunk + c]);
    }
    mn[r] = a;
    mx[r] = b;
  }
}

void observe_minmax_cpu(const Tensor& x, const Tensor& min_val, const Tensor& max_val,
                        const Tensor& scale, const Tensor& zero_point, int64_t quant_min,
                        int64_t quant_max, bool symmetric, double momentum) {
  const Observation o = observation(x, min_val, max_val, scale, zero_point, quant_min,
                                    quant_max, symmetric, momentum, "observe_minmax");
  const int64_t rows = min_val.numel(), len = x.numel() / rows;
  std::vector<float> bmn(rows), bmx(rows);
  row_minmax(x.const_data_ptr<float>(), rows, len, bmn.data(), bmx.data());
  for (int64_t r = 0; r < rows; ++r) o.update(r, bmn[r], bmx[r]);
  bump({&min_val, &max_val, &scale, &zero_point});
}

// Observe x, then fake-quantize it with the qparams just computed (observe_minmax, then
// fake_quant_ste_fwd when with_mask, else fake_quant: the same bits). Rows of a multiple
// of 8 elements (a weight's output channels) go in one pass: each row's min / max, its
// qparams, then its forward while the row is still in cache, instead of reading the
// weight twice. x as observe_minmax takes it; scale / zero_point broadcast along dim 0.
static std::tuple<Tensor, Tensor> observe_fwd(const Tensor& x, const Tensor& min_val,
                                              const Tensor& max_val, const Tensor& scale,
                                              const Tensor& zero_point, int64_t quant_min,
                                              int64_t quant_max, bool symmetric,
                                              double momentum, bool with_mask) {
  const Observation o = observation(x, min_val, max_val, scale, zero_point, quant_min,
                                    quant_max, symmetric, momentum, "fake_quant_observe");
  const int64_t rows = min_val.numel(), len = x.numel() / rows;
  Tensor bits = with_mask ? at::empty({packed_bytes(x.numel())}, x.options().dtype(at::kByte))
                          : Tensor();
  if (x.numel() == 0) {
    bump({&min_val, &max_val, &scale, &zero_point});
    return {at::empty_like(x), bits};
  }
  if (rows == 1 || len % 8 != 0 || x.dim() < 1 || x.size(0) != rows) {
    observe_minmax_cpu(x, min_val, max_val, scale, zero_point, quant_min, quant_max, symmetric,
                       momentum);
    std::vector<int64_t> shape(std::max<int64_t>(x.dim(), 1), 1);
    shape[0] = rows;
    const Tensor s = rows == 1 ? scale : scale.view(shape);
    const Tensor z = rows == 1 ? zero_point : zero_point.view(shape);
    Layout L = make_layout(x, s, z);
    Tensor out = empty_out_like(L.x, at::kFloat);
    run_fwd(L, out, bits, quant_min, quant_max);
    return {out, bits};
  }
  Tensor out = empty_out_like(x, at::kFloat);
  std::vector<float> zf(rows);  // zero points as the forward reads them
  Job j;
  j.x = x.const_data_ptr();
  j.y = out.mutable_data_ptr();
  j.s = o.s;
  j.z = zf.data();
  j.n = x.numel();
  j.row = len;
  j.C = rows;
  j.rows = rows;
  j.lo = o.lo;
  j.hi = o.hi;
  // A weight's fake-quantized copy of kStreamMin bytes or more is written with streaming
  // stores: it outgrows a core's cache before its layer reads it anyway, and a normal
  // store first reads each line of the (cold) output block. On the MLP benchmark's 4 MB
  // weights, with other models' steps in between (caches cold, as in training a model
  // larger than them), its QAT step went from 1.48-1.50x to 1.21-1.29x the fp32 step.
  j.stream = x.numel() * 4 >= kStreamMin;
  const auto& k = kernels();
  const float* xp = x.const_data_ptr<float>();
  float* yp = out.mutable_data_ptr<float>();
  // With a mask, each row's bits go to a small buffer first and into the mask only for a
  // row with an element outside the range: a weight under its own min-max range has
  // none, and then no mask is written or read at all (nor kept).
  uint8_t* bp = with_mask ? static_cast<uint8_t*>(bits.mutable_data_ptr()) : nullptr;
  std::vector<uint8_t> clamped(with_mask ? rows : 0, 0);
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / len), [&](int64_t b, int64_t e) {
    std::vector<uint8_t> row_bits(with_mask ? len / 8 : 0);
    Job one = j;  // one row: its own pointers, one scale
    one.n = one.row = len;
    one.C = one.rows = 1;
    one.bits = row_bits.data();
    for (int64_t r = b; r < e; ++r) {
      float mn, mx;
      // the next row on its way from memory while this one is reduced and quantized from
      // cache (rows up to 16 KB: a weight's; 4% of the call on a 4 MB weight)
      if (r + 1 < e && len <= 4096) {
        const char* next = reinterpret_cast<const char*>(xp + (r + 1) * len);
        for (int64_t o = 0; o < len * 4; o += 64) __builtin_prefetch(next + o, 0, 3);
      }
      k.minmax(xp + r * len, len, &mn, &mx);
      zf[r] = o.update(r, mn, mx);
      // x -> nearbyint(x / s) + z is monotonic, so the row's extremes tell whether any
      // element leaves the range (a NaN extreme: maybe); a weight under its own min-max
      // range never does, and its row needs no mask bits at all
      if (!with_mask || (std::nearbyint(mn / o.s[r]) + zf[r] >= o.lo &&
                         std::nearbyint(mx / o.s[r]) + zf[r] <= o.hi)) {
        k.fwd(j, r * len, (r + 1) * len);
        continue;
      }
      one.x = xp + r * len;
      one.y = yp + r * len;
      one.s = o.s + r;
      one.z = zf.data() + r;
      k.fwd(one, 0, len);  // whole mask bytes: len % 8 == 0
      if (!all_ones(row_bits.data(), len / 8)) {
        clamped[r] = 1;
        std::memcpy(bp + r * (len / 8), row_bits.data(), len / 8);
      }
    }
#ifdef __SSE2__
    if (j.stream) _mm_sfence();  // the streaming stores visible before the task ends
#endif
  });
  bump({&min_val, &max_val, &scale, &zero_point});
  if (with_mask) {
    if (std::none_of(clamped.begin(), clamped.end(), [](uint8_t c) { return c != 0; })) {
      return {out, Tensor()};  // everything inside: no mask
    }
    for (int64_t r = 0; r < rows; ++r) {
      if (!clamped[r]) std::memset(bp + r * (len / 8), 0xFF, len / 8);
    }
  }
  return {out, bits};
}

Tensor fake_quant_observe_cpu(const Tensor& x, const Tensor& min_val, const Tensor& max_val,
                              const Tensor& scale, const Tensor& zero_point, int64_t quant_min,
                              int64_t quant_max, bool symmetric, double momentum) {
  return std::get<0>(observe_fwd(x, min_val, max_val, scale, zero_point, quant_min,
                                 quant_max, symmetric, momentum, false));
}

Tensor fake_quant_observe_meta(const Tensor& x, const Tensor&, const Tensor&, const Tensor&,
                               const Tensor&, int64_t, int64_t, bool, double) {
  return at::empty_like(x);
}

// With gradients: the straight-through node of fake_quant, its mask from the same pass.
Tensor fake_quant_observe_autograd(const Tensor& x, const Tensor& min_val,
                                   const Tensor& max_val, const Tensor& scale,
                                   const Tensor& zero_point, int64_t quant_min,
                                   int64_t quant_max, bool symmetric, double momentum) {
  using ObsSig = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        const Tensor&, int64_t, int64_t, bool, double);
  static const auto below = op<ObsSig>("qcompile::fake_quant_observe");
  if (!needs_grad(x, scale)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return below.call(x, min_val, max_val, scale, zero_point, quant_min, quant_max, symmetric,
                      momentum);
  }
  TORCH_CHECK(plain_cpu(x), "qcompile fake_quant_observe: gradients need a plain CPU tensor; "
              "elsewhere call observe_minmax, then fake_quant");
  auto node = new_node<FakeQuantSTEBackward>(x, scale);
  Tensor out, mask;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::tie(out, mask) = observe_fwd(x.detach(), min_val, max_val, scale, zero_point,
                                      quant_min, quant_max, symmetric, momentum, true);
  }
  return with_history(out, node, mask, !mask.defined() || all_set(mask, x.numel()));
}

// -- fake-quant with fixed qparams, gathering statistics (step observer updates) -------------
// fake_quant_ste_fwd (with_mask) or fake_quant with the given qparams, and x's minimum and
// maximum per scale folded into min_val / max_val (running extremes, in place, NaN
// propagating: torch.minimum(min_val, x.amin(...)) and the maximum alike), in one pass over
// x: what a training forward of FakeQuantize with step observer updates runs (the qparams
// stay those of the step; the statistics are the step's pending ones). Bit-identical to
// fake_quant (output, mask) and to the min / max reductions. The threads each fold their
// share into their own statistics, reduced in a fixed order at the end (min / max are
// exact in any order).
// ``into``: where the output goes (x's own memory, fake_quant_minmax_overwrite), else a new
// tensor.
static std::tuple<Tensor, Tensor> fwd_minmax(const Tensor& x, const Tensor& scale,
                                             const Tensor& zero_point, int64_t quant_min,
                                             int64_t quant_max, const Tensor& min_val,
                                             const Tensor& max_val, bool with_mask,
                                             const Tensor& into = Tensor()) {
  auto ok = [&](const Tensor& t) {
    return t.scalar_type() == at::kFloat && t.is_contiguous() && t.is_cpu() &&
           t.numel() == min_val.numel();
  };
  TORCH_CHECK(ok(min_val) && ok(max_val), "qcompile fake_quant_minmax: expects float32 "
              "contiguous CPU min_val / max_val of one value per scale");
  if (!native(x.scalar_type())) {  // float16: through float32, as fake_quant (exact)
    auto [out, bits] = fwd_minmax(x.to(at::kFloat), scale, zero_point, quant_min, quant_max,
                                  min_val, max_val, with_mask);
    return {out.to(x.scalar_type()), bits};
  }
  Tensor bits = with_mask ? at::empty({packed_bytes(x.numel())}, x.options().dtype(at::kByte))
                          : Tensor();
  if (x.numel() == 0) return {at::empty_like(x), bits};  // nothing to fold in
  Layout L = make_layout(x, scale, zero_point);
  TORCH_CHECK(min_val.numel() == L.C && L.scale_index.empty(),
              "qcompile fake_quant_minmax: min_val / max_val must hold one value per scale "
              "along one dim of x (", L.C, " here), got ", min_val.numel());
  Tensor out = into.defined() ? into : empty_out_like(L.x, L.x.scalar_type());
  Job j = make_job(L, quant_min, quant_max);
  j.y = out.mutable_data_ptr();
  j.bits = with_mask ? static_cast<uint8_t*>(bits.mutable_data_ptr()) : nullptr;
  // the tasks of parallel_blocks (kGrain elements at least), at most one per thread, each
  // with its own statistics: per channel (row mode) or per element of a period (column)
  const int64_t blocks = (L.n + 63) / 64, grain = kGrain / 64;
  const int64_t tasks = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), (blocks + grain - 1) / grain));
  const int64_t per = (blocks + tasks - 1) / tasks;
  const int64_t width = j.col ? j.row : L.C;
  std::vector<float> tmn(tasks * width, INFINITY), tmx(tasks * width, -INFINITY);
  const auto& k = kernels();
  at::parallel_for(0, tasks, 1, [&](int64_t tb, int64_t te) {
    for (int64_t t = tb; t < te; ++t) {
      const int64_t b = t * per * 64, e = std::min(L.n, (t + 1) * per * 64);
      if (b < e) k.fwd_minmax(j, b, e, tmn.data() + t * width, tmx.data() + t * width);
    }
  });
  float* mn = min_val.mutable_data_ptr<float>();
  float* mx = max_val.mutable_data_ptr<float>();
  const int64_t inner = j.col ? L.inner : 1;  // entries per channel in a task's statistics
  for (int64_t c = 0; c < L.C; ++c) {
    float a = mn[c], z = mx[c];
    for (int64_t t = 0; t < tasks; ++t) {
      for (int64_t i = 0; i < inner; ++i) {
        a = nan_min(a, tmn[t * width + c * inner + i]);
        z = nan_max(z, tmx[t * width + c * inner + i]);
      }
    }
    mn[c] = a;
    mx[c] = z;
  }
  bump({&min_val, &max_val});
  return {out, bits};
}

Tensor fake_quant_minmax_cpu(const Tensor& x, const Tensor& scale, const Tensor& zero_point,
                             int64_t quant_min, int64_t quant_max, const Tensor& min_val,
                             const Tensor& max_val) {
  return std::get<0>(fwd_minmax(x, scale, zero_point, quant_min, quant_max, min_val, max_val,
                                false));
}

Tensor fake_quant_minmax_meta(const Tensor& x, const Tensor&, const Tensor&, int64_t, int64_t,
                              const Tensor&, const Tensor&) {
  return at::empty_like(x);
}

// With gradients: fake_quant's straight-through node, its mask from the same pass.
Tensor fake_quant_minmax_autograd(const Tensor& x, const Tensor& scale,
                                  const Tensor& zero_point, int64_t quant_min,
                                  int64_t quant_max, const Tensor& min_val,
                                  const Tensor& max_val) {
  using MmSig = Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t,
                       const Tensor&, const Tensor&);
  static const auto below = op<MmSig>("qcompile::fake_quant_minmax");
  if (!needs_grad(x, scale)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return below.call(x, scale, zero_point, quant_min, quant_max, min_val, max_val);
  }
  TORCH_CHECK(plain_cpu(x), "qcompile fake_quant_minmax: gradients need a plain CPU tensor; "
              "elsewhere take the min / max, then call fake_quant");
  auto node = new_node<FakeQuantSTEBackward>(x, scale);
  Tensor out, mask;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::tie(out, mask) = fwd_minmax(x.detach(), scale, zero_point, quant_min, quant_max,
                                     min_val, max_val, true);
  }
  return with_history(out, node, mask, all_set(mask, x.numel()));
}

// -- writing over the input ------------------------------------------------------------
// Whether x's memory may take the output of an elementwise op on x: a plain contiguous
// float32 / bfloat16 CPU tensor that is not a leaf needing a gradient, whose memory
// nothing else holds. Nothing: x is the only tensor on its storage or, for a view, the
// only one besides its base, which nothing but x holds (a Linear's output on a 3-D input
// is a view of its 2-D result). Another view of x, a tensor autograd saved as its
// operator's output, x's storage taken from Python: each holds the storage too. What
// holds x itself (a Python reference, an operator that saved x as its input, a
// saved-tensor hook) is the caller's to rule out: passes.overwrite_inputs marks only
// inputs that an operator whose backward does not read its output made for no other
// reader.
// The forward kernels then get y == x: each reads an element before it writes that
// element, and no other, so in place they compute what they compute into a new tensor
// (the tests compare the two bit for bit on every instruction set).
static bool overwritable(const Tensor& x) {
  if (!plain_cpu(x) || !native(x.scalar_type()) || !x.is_contiguous() || x.numel() == 0 ||
      x.is_inference() || (x.is_leaf() && x.requires_grad())) {
    return false;
  }
  const auto holders = x.storage().use_count();
  if (!x.is_view()) return holders == 1;
  const at::TensorBase& base = x._base();
  return holders == 2 && base.use_count() == 1 && base.storage().is_alias_of(x.storage());
}

Tensor fake_quant_minmax_overwrite_cpu(const Tensor& x, const Tensor& scale,
                                       const Tensor& zero_point, int64_t quant_min,
                                       int64_t quant_max, const Tensor& min_val,
                                       const Tensor& max_val) {
  const Tensor into = overwritable(x) ? x.variable_data() : Tensor();
  Tensor out = std::get<0>(fwd_minmax(x, scale, zero_point, quant_min, quant_max, min_val,
                                      max_val, false, into));
  if (into.defined()) bump({&x});
  return out;
}

// fake_quant_minmax_autograd, its output written over x when x is overwritable: a tensor
// of its own (x's memory, not a view of x) whose history is the straight-through node
// (x's history before it: the node's next edge). x's version moves on, so anything that
// kept x despite the checks fails in backward instead of reading the new values.
Tensor fake_quant_minmax_overwrite_autograd(const Tensor& x, const Tensor& scale,
                                            const Tensor& zero_point, int64_t quant_min,
                                            int64_t quant_max, const Tensor& min_val,
                                            const Tensor& max_val) {
  if (!overwritable(x)) {
    return fake_quant_minmax_autograd(x, scale, zero_point, quant_min, quant_max, min_val,
                                      max_val);
  }
  const bool grad = needs_grad(x, scale);
  c10::intrusive_ptr<FakeQuantSTEBackward> node;
  if (grad) node = new_node<FakeQuantSTEBackward>(x, scale);  // before x changes
  Tensor out = x.variable_data(), mask;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::tie(out, mask) = fwd_minmax(x.detach(), scale, zero_point, quant_min, quant_max,
                                     min_val, max_val, grad, out);
  }
  bump({&x});
  if (!grad) return out;
  return with_history(out, node, mask, all_set(mask, x.numel()));
}

// fake_quant (a quantizer with fixed qparams: frozen, calibrated) writing over x alike.
Tensor fake_quant_overwrite_cpu(const Tensor& x, const Tensor& scale, const Tensor& zero_point,
                                int64_t quant_min, int64_t quant_max) {
  if (!overwritable(x)) return fake_quant_cpu(x, scale, zero_point, quant_min, quant_max);
  Tensor out = x.variable_data();
  run_fwd(make_layout(x, scale, zero_point), out, Tensor(), quant_min, quant_max);
  bump({&x});
  return out;
}

Tensor fake_quant_overwrite_autograd(const Tensor& x, const Tensor& scale,
                                     const Tensor& zero_point, int64_t quant_min,
                                     int64_t quant_max) {
  if (!overwritable(x)) return fake_quant_autograd(x, scale, zero_point, quant_min, quant_max);
  if (!needs_grad(x, scale)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return fake_quant_overwrite_cpu(x, scale, zero_point, quant_min, quant_max);
  }
  auto node = new_node<FakeQuantSTEBackward>(x, scale);  // before x changes
  Tensor out = x.variable_data();
  Tensor mask = at::empty({packed_bytes(x.numel())}, x.options().dtype(at::kByte));
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    run_fwd(make_layout(x.detach(), scale, zero_point), out, mask, quant_min, quant_max);
  }
  bump({&x});
  return with_history(out, node, mask, all_set(mask, x.numel()));
}

std::string isa() { return kernels().name; }

}  // namespace qcompile_fq

// torch.compile's caches (FX graph, AOTAutograd) know these operators by name and schema
// only: a change of what an operator computes, or of the autograd formula behind
// fake_quant / fake_quant_lsq, leaves stale compiled graphs in them (clear
// /tmp/torchinductor_$USER, or rename the operator).
TORCH_LIBRARY(qcompile, m) {
  m.def("fake_quant(Tensor x, Tensor scale, Tensor zero_point, int quant_min, int quant_max)"
        " -> Tensor");
  m.def("fake_quant_lsq(Tensor x, Tensor scale, Tensor zero_point, int quant_min, "
        "int quant_max, float grad_factor) -> Tensor");
  m.def("fake_quant_ste_fwd(Tensor x, Tensor scale, Tensor zero_point, int quant_min, "
        "int quant_max) -> (Tensor, Tensor)");
  m.def("fake_quant_bwd(Tensor grad, Tensor mask) -> Tensor");
  m.def("fake_quant_ste_bwd(Tensor grad, Tensor mask, SymInt[] stride) -> Tensor");
  m.def("fake_quant_lsq_bwd(Tensor grad, Tensor x, Tensor scale, Tensor zero_point, "
        "int quant_min, int quant_max, float grad_factor) -> (Tensor, Tensor)");
  m.def("fake_quant_isa() -> str", &qcompile_fq::isa);
  m.def("fake_quant_release_cache() -> int", &qcompile_fq::release_cache);
  m.def("observe_minmax(Tensor x, Tensor(a!) min_val, Tensor(b!) max_val, Tensor(c!) scale, "
        "Tensor(d!) zero_point, int quant_min, int quant_max, bool symmetric, "
        "float momentum=-1.0) -> ()");
  m.def("fake_quant_observe(Tensor x, Tensor(a!) min_val, Tensor(b!) max_val, "
        "Tensor(c!) scale, Tensor(d!) zero_point, int quant_min, int quant_max, "
        "bool symmetric, float momentum=-1.0) -> Tensor");
  m.def("fake_quant_minmax(Tensor x, Tensor scale, Tensor zero_point, int quant_min, "
        "int quant_max, Tensor(a!) min_val, Tensor(b!) max_val) -> Tensor");
  m.def("fake_quant_minmax_overwrite(Tensor(c!) x, Tensor scale, Tensor zero_point, "
        "int quant_min, int quant_max, Tensor(a!) min_val, Tensor(b!) max_val) -> Tensor");
  m.def("fake_quant_overwrite(Tensor(a!) x, Tensor scale, Tensor zero_point, int quant_min, "
        "int quant_max) -> Tensor");
}

TORCH_LIBRARY_IMPL(qcompile, CPU, m) {
  m.impl("fake_quant", &qcompile_fq::fake_quant_cpu);
  m.impl("fake_quant_lsq", &qcompile_fq::fake_quant_lsq_cpu);
  m.impl("fake_quant_ste_fwd", &qcompile_fq::fake_quant_ste_fwd_cpu);
  m.impl("fake_quant_bwd", &qcompile_fq::fake_quant_bwd_cpu);
  m.impl("fake_quant_ste_bwd", &qcompile_fq::fake_quant_ste_bwd_cpu);
  m.impl("fake_quant_lsq_bwd", &qcompile_fq::fake_quant_lsq_bwd_cpu);
  m.impl("observe_minmax", &qcompile_fq::observe_minmax_cpu);
  m.impl("fake_quant_observe", &qcompile_fq::fake_quant_observe_cpu);
  m.impl("fake_quant_minmax", &qcompile_fq::fake_quant_minmax_cpu);
  m.impl("fake_quant_minmax_overwrite", &qcompile_fq::fake_quant_minmax_overwrite_cpu);
  m.impl("fake_quant_overwrite", &qcompile_fq::fake_quant_overwrite_cpu);
}

TORCH_LIBRARY_IMPL(qcompile, Meta, m) {
  m.impl("fake_quant", &qcompile_fq::fake_quant_meta);
  m.impl("fake_quant_lsq", &qcompile_fq::fake_quant_lsq_meta);
  m.impl("fake_quant_ste_fwd", &qcompile_fq::fake_quant_ste_fwd_meta);
  m.impl("fake_quant_bwd", &qcompile_fq::fake_quant_bwd_meta);
  m.impl("fake_quant_ste_bwd", &qcompile_fq::fake_quant_ste_bwd_meta);
  m.impl("fake_quant_lsq_bwd", &qcompile_fq::fake_quant_lsq_bwd_meta);
  m.impl("fake_quant_observe", &qcompile_fq::fake_quant_observe_meta);
  m.impl("fake_quant_minmax", &qcompile_fq::fake_quant_minmax_meta);
  m.impl("fake_quant_minmax_overwrite", &qcompile_fq::fake_quant_minmax_meta);
  m.impl("fake_quant_overwrite", &qcompile_fq::fake_quant_meta);
}

TORCH_LIBRARY_IMPL(qcompile, Autograd, m) {
  m.impl("fake_quant", &qcompile_fq::fake_quant_autograd);
  m.impl("fake_quant_lsq", &qcompile_fq::fake_quant_lsq_autograd);
  m.impl("fake_quant_observe", &qcompile_fq::fake_quant_observe_autograd);
  m.impl("fake_quant_minmax", &qcompile_fq::fake_quant_minmax_autograd);
  m.impl("fake_quant_minmax_overwrite", &qcompile_fq::fake_quant_minmax_overwrite_autograd);
  m.impl("fake_quant_overwrite", &qcompile_fq::fake_quant_overwrite_autograd);
}

#else  // QCOMPILE_FQ_KERNEL_BODY: compiled once per instruction set, inside its namespace

static inline float load_f(const float* p, int64_t i) { return p[i]; }
static inline float load_f(const uint16_t* p, int64_t i) {  // bfloat16 bits
  const uint32_t u = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
static inline void store_f(float* p, int64_t i, float v) { p[i] = v; }
static inline void store_f(uint16_t* p, int64_t i, float v) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  p[i] = v != v ? static_cast<uint16_t>(0x7FC0)
                : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

struct ScalarP {  // one scale for the whole segment
  float s, z;
  float S(int64_t) const { return s; }
  float Z(int64_t) const { return z; }
  ScalarP advanced(int64_t) const { return *this; }
};
struct ArrayP {  // one scale per element
  const float* __restrict s;
  const float* __restrict z;
  float S(int64_t i) const { return s[i]; }
  float Z(int64_t i) const { return z[i]; }
  ArrayP advanced(int64_t k) const { return {s + k, z + k}; }
};

// c ? a : b with both computed, as integer bit operations (vectorised; see lsq_block)
static inline float select(bool c, float a, float b) {
  uint32_t ua, ub;
  std::memcpy(&ua, &a, sizeof ua);
  std::memcpy(&ub, &b, sizeof ub);
  const uint32_t m = 0u - static_cast<uint32_t>(c), r = (ua & m) | (ub & ~m);
  float f;
  std::memcpy(&f, &r, sizeof f);
  return f;
}

static inline float clampf(float q, float lo, float hi) {  // NaN passes, like torch.clamp
  const float c = q < lo ? lo : q;
  return c > hi ? hi : c;
}

// 8 bits -> 8 bytes of 0 / 1 (bit k -> byte k)
static inline uint64_t spread_bits(uint32_t b) {
  uint64_t t = (static_cast<uint64_t>(b) * 0x0101010101010101ULL) & 0x8040201008040201ULL;
  return ((t + 0x7F7F7F7F7F7F7F7FULL) >> 7) & 0x0101010101010101ULL;
}

// What the forward writes besides the output: nothing, a mask byte per element (m + i), or
// the packed mask itself (byte m[i / 8]: the segment starts on a whole byte)
enum MaskOut { kNoMask = 0, kMaskBytes = 1, kMaskBits = 2 };

#ifdef QCOMPILE_FQ_AVX2
// nearbyint(x / s) from a product. With r = 1 / s rounded to a normal float, q0 = x * r is
// within 3 * 2^-24 |q0| (relative) of the IEEE quotient x / s, so where q0 is farther than
// 2^-21 |q0| from every half-integer (where nearbyint's result changes) both round to the
// same integer. The forward only needs that where it can matter: for |q0| <= Q + 2, Q the
// largest step from the zero point to a clamp edge; beyond, both integers lie beyond the
// same edge (the same clamped output, no gradient). So one bound serves every element,
// 2^-21 (Q + 2): nearbyint(q0) is taken where |q0 - nearbyint(q0)| < 0.5 - that bound,
// and the lanes of a vector with any other element (a tie within the bound, NaN, an
// infinity) take the true division. A multiplication instead of a division: with AVX-512
// the divider bounded the forward; the AVX2 variant divides (the check's extra operations
// cost more there than the division). Only under round-to-nearest (the bound is about
// half-integers), for one scale per segment (one reciprocal) of at least kRecipMin
// elements (a scalar division each), and ranges of at most 2^12 steps a side (wider ones,
// int16, would fall back too often).
constexpr int64_t kRecipMin = 32;
struct Recip {
  float r = 0.0f;    // 1 / s; 0: divide
  float below = 0.0f;  // 0.5 - 2^-21 (Q + 2): |q0 - nearbyint(q0)| below it is exact
};
static inline Recip usable_recip(float s, float z, float lo, float hi, int64_t n) {
  Recip out;
#ifdef QCOMPILE_FQ_AVX512
  const float q = std::max(std::fabs(lo - z), std::fabs(hi - z));  // z, lo, hi: integers
  if (n >= kRecipMin && q <= 4096.0f && std::fegetround() == FE_TONEAREST) {
    const float r = 1.0f / s;
    if (std::isnormal(r)) {
      out.r = r;
      out.below = 0.5f - (q + 2.0f) * 0x1p-21f;  // exact: q + 2 <= 4098
    }
  }
#else
  (void)s;
  (void)z;
  (void)lo;
  (void)hi;
  (void)n;
#endif
  return out;
}

static inline __m256 round_quot8(__m256 v, __m256 s, __m256 r, __m256 below) {
  const __m256 q0 = _mm256_mul_ps(v, r);
  const __m256 k = _mm256_round_ps(q0, _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
  const __m256 off = _mm256_and_ps(_mm256_sub_ps(q0, k),
                                   _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  if (_mm256_movemask_ps(_mm256_cmp_ps(off, below, _CMP_LT_OQ)) == 0xFF) return k;
  return _mm256_round_ps(_mm256_div_ps(v, s), _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
}

// Eight lanes of the forward from the rounded quotient k (nearbyint(x / s)): the scalar
// loop's IEEE operations, lane for lane. The clamp is max(lo, q), then min(hi, .): with
// the bound first, max_ps / min_ps return the second operand for a NaN, so NaN passes
// through as the scalar clamp lets it (and -0.0 stays). In range exactly where the clamp
// changed nothing (ordered: NaN is not); the bits come back from one movemask. GCC
// vectorises the scalar loop without the mask, but not with it (a byte store next to a
// float one): the mask doubled the forward's time.
static inline __m256 fq8(__m256 k, __m256 s, __m256 z, __m256 lo, __m256 hi, int* in) {
  const __m256 q = _mm256_add_ps(k, z);
  const __m256 c = _mm256_min_ps(hi, _mm256_max_ps(lo, q));
  *in = _mm256_movemask_ps(_mm256_cmp_ps(c, q, _CMP_EQ_OQ));
  return _mm256_mul_ps(_mm256_sub_ps(c, z), s);
}

// Running minima / maxima of 8 lanes, and whether a lane saw a NaN (min_ps / max_ps drop
// NaN: it is tracked apart).
// (Set by the caller: an implicit constructor would be compiled without the ISA target.)
struct MinMax8 {
  __m256 mn, mx, nan;
};

#ifdef QCOMPILE_FQ_AVX512
// The same sixteen lanes at a time (AVX-512: one instruction where AVX2 takes two).
static inline __m512 round_quot16(__m512 v, __m512 s, __m512 r, __m512 below) {
  const __m512 q0 = _mm512_mul_ps(v, r);
  const __m512 k = _mm512_roundscale_ps(q0, _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
  if (_mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(q0, k)), below, _CMP_LT_OQ) == 0xFFFF) {
    return k;
  }
  return _mm512_roundscale_ps(_mm512_div_ps(v, s), _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
}

static inline __m512 fq16(__m512 k, __m512 s, __m512 z, __m512 lo, __m512 hi,
                          __mmask16* in) {
  const __m512 q = _mm512_add_ps(k, z);
  const __m512 c = _mm512_min_ps(hi, _mm512_max_ps(lo, q));
  *in = _mm512_cmp_ps_mask(c, q, _CMP_EQ_OQ);
  return _mm512_mul_ps(_mm512_sub_ps(c, z), s);
}

// Sixteen outputs at y, and their in-range bits as the mask kind asks (element i's).
template <int kOut>
static inline void store16(float* __restrict y, uint8_t* __restrict m, int64_t i, __m512 out,
                           __mmask16 in, bool stream) {
  if (stream) {
    _mm512_stream_ps(y, out);
  } else {
    _mm512_storeu_ps(y, out);
  }
  if constexpr (kOut == kMaskBytes) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(m + i),
                     _mm_maskz_mov_epi8(in, _mm_set1_epi8(1)));
  } else if constexpr (kOut == kMaskBits) {
    std::memcpy(m + i / 8, &in, sizeof in);  // little-endian: element k is bit k
  }
}

// The forward with one scale and a usable reciprocal (round-to-nearest), in fewer
// operations than fq16 on round_quot16: no instruction rounds, and the zero point is
// folded into the clamp bounds.
// - k = (q0 + 1.5 * 2^23) - 1.5 * 2^23 is nearbyint(q0) for |q0| < 2^22 (the sum lands
//   where the float spacing is 1, so it rounds to an integer, ties to even: the constant
//   is even), and +0 for a zero result. Where |q0| >= 2^22 it may be off by one, beyond
//   every clamp edge (at most 2^12 steps from the zero point: usable_recip) as
//   nearbyint(q0) is: the same output, no mask bit. Lanes the exactness check doubts
//   take the division (rounded, +0 added: -0 becomes +0, as the sum gives).
// - (min(hi, max(lo, k + z)) - z) * s == min(hi - z, max(lo - z, k)) * s: integers below
//   2^24 add and subtract exactly, a huge k lands on the same edge either way, and the
//   zero's sign agrees (c - z is +0 where c == z; k is +0 there). In range where the
//   clamp changed nothing, NaN passing through as before.
template <int kOut, bool kStats>
static int64_t fwd_recip16(const float* __restrict x, float* __restrict y,
                           uint8_t* __restrict m, int64_t n, ScalarP p, Recip rc,
                           float lo_f, float hi_f, __m512* vmn, __m512* vmx, __mmask16* nan,
                           bool stream) {
  const __m512 lo = _mm512_set1_ps(lo_f - p.z), hi = _mm512_set1_ps(hi_f - p.z);
  const __m512 s = _mm512_set1_ps(p.s), r = _mm512_set1_ps(rc.r);
  const __m512 below = _mm512_set1_ps(rc.below), big = _mm512_set1_ps(0x1.8p23f);
  const __m512 zero = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    if constexpr (kStats) {
      *vmn = _mm512_min_ps(*vmn, v);
      *vmx = _mm512_max_ps(*vmx, v);
      *nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    const __m512 q0 = _mm512_mul_ps(v, r);
    __m512 k = _mm512_sub_ps(_mm512_add_ps(q0, big), big);
    if (_mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(q0, k)), below, _CMP_LT_OQ) != 0xFFFF) {
      k = _mm512_add_ps(_mm512_roundscale_ps(_mm512_div_ps(v, s),
                                             _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC),
                        zero);
    }
    const __m512 c = _mm512_min_ps(hi, _mm512_max_ps(lo, k));
    const __mmask16 in = _mm512_cmp_ps_mask(c, k, _CMP_EQ_OQ);
    const __m512 out = _mm512_mul_ps(c, s);
    store16<kOut>(y + i, m, i, out, in, stream);
  }
  return i;
}

// fwd_seg8's first elements, sixteen at a time; returns how many it did (a multiple of
// 16). Its statistics are folded into *st's eight lanes at the end (min / max: exact).
template <typename P, int kOut, bool kStats>
static int64_t fwd_seg16(const float* __restrict x, float* __restrict y,
                         uint8_t* __restrict m, int64_t n, P p, Recip rc, float lo_f,
                         float hi_f, MinMax8* st, bool stream) {
  const __m512 lo = _mm512_set1_ps(lo_f), hi = _mm512_set1_ps(hi_f);
  const __m512 r = _mm512_set1_ps(rc.r), below = _mm512_set1_ps(rc.below);
  __m512 vmn = _mm512_set1_ps(INFINITY), vmx = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  int64_t i = 0;
  if constexpr (std::is_same_v<P, ScalarP>) {
    if (rc.r != 0.0f) {
      i = fwd_recip16<kOut, kStats>(x, y, m, n, p, rc, lo_f, hi_f, &vmn, &vmx, &nan, stream);
    }
  }
  for (; i + 16 <= n; i += 16) {
    __m512 s, z;
    if constexpr (std::is_same_v<P, ScalarP>) {
      s = _mm512_set1_ps(p.s);
      z = _mm512_set1_ps(p.z);
    } else {
      s = _mm512_loadu_ps(p.s + i);
      z = _mm512_loadu_ps(p.z + i);
    }
    const __m512 v = _mm512_loadu_ps(x + i);
    if constexpr (kStats) {
      vmn = _mm512_min_ps(vmn, v);
      vmx = _mm512_max_ps(vmx, v);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    const __m512 k =
        rc.r != 0.0f ? round_quot16(v, s, r, below)
                     : _mm512_roundscale_ps(_mm512_div_ps(v, s),
                                            _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
    __mmask16 in;
    const __m512 out = fq16(k, s, z, lo, hi, &in);
    store16<kOut>(y + i, m, i, out, in, stream);
  }
  if constexpr (kStats) {
    if (i > 0) {
      st->mn = _mm256_min_ps(st->mn, _mm256_min_ps(_mm512_castps512_ps256(vmn),
                                                   _mm512_extractf32x8_ps(vmn, 1)));
      st->mx = _mm256_max_ps(st->mx, _mm256_max_ps(_mm512_castps512_ps256(vmx),
                                                   _mm512_extractf32x8_ps(vmx, 1)));
      if (nan) st->nan = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    }
  }
  return i;
}
#endif

// float32, 8 at a time (16 with AVX-512); returns how many elements it did (the caller
// does the rest). With kStats, the elements it did are folded into *st too, in the same
// loop: the forward bounds the loop, the min / max chains hide under it.
template <typename P, int kOut, bool kStats = false>
static int64_t fwd_seg8(const float* __restrict x, float* __restrict y, uint8_t* __restrict m,
                        int64_t n, P p, float lo_f, float hi_f, MinMax8* st = nullptr,
                        bool stream = false) {
  Recip rc;
  if constexpr (std::is_same_v<P, ScalarP>) rc = usable_recip(p.s, p.z, lo_f, hi_f, n);
  int64_t i = 0;
#ifdef QCOMPILE_FQ_AVX512
  // streaming stores need aligned addresses: from the first one on, or not at all
  stream = stream && (reinterpret_cast<uintptr_t>(y) & 63) == 0;
  i = fwd_seg16<P, kOut, kStats>(x, y, m, n, p, rc, lo_f, hi_f, st, stream);
#endif
  const __m256 lo = _mm256_set1_ps(lo_f), hi = _mm256_set1_ps(hi_f);
  const __m256 r = _mm256_set1_ps(rc.r), below = _mm256_set1_ps(rc.below);
  __m256 vmn, vmx, vnan;
  if constexpr (kStats) {
    vmn = st->mn;
    vmx = st->mx;
    vnan = st->nan;
  }
  for (; i + 8 <= n; i += 8) {
    __m256 s, z;
    if constexpr (std::is_same_v<P, ScalarP>) {
      s = _mm256_set1_ps(p.s);
      z = _mm256_set1_ps(p.z);
    } else {
      s = _mm256_loadu_ps(p.s + i);
      z = _mm256_loadu_ps(p.z + i);
    }
    int in;
    const __m256 v = _mm256_loadu_ps(x + i);
    if constexpr (kStats) {
      vmn = _mm256_min_ps(vmn, v);
      vmx = _mm256_max_ps(vmx, v);
      vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    const __m256 k =
        rc.r != 0.0f ? round_quot8(v, s, r, below)
                     : _mm256_round_ps(_mm256_div_ps(v, s),
                                       _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
    const __m256 out = fq8(k, s, z, lo, hi, &in);
    if (stream && (reinterpret_cast<uintptr_t>(y + i) & 31) == 0) {
      _mm256_stream_ps(y + i, out);
    } else {
      _mm256_storeu_ps(y + i, out);
    }
    if constexpr (kOut == kMaskBytes) {
      const uint64_t bytes = spread_bits(static_cast<uint32_t>(in));
      std::memcpy(m + i, &bytes, sizeof bytes);
    } else if constexpr (kOut == kMaskBits) {
      m[i / 8] = static_cast<uint8_t>(in);
    }
  }
  if constexpr (kStats) {
    st->mn = vmn;
    st->mx = vmx;
    st->nan = vnan;
  }
  return i;
}
#endif

template <typename T, typename P, bool kMask>
static void fwd_seg(const T* __restrict x, T* __restrict y, uint8_t* __restrict m, int64_t n,
                    P p, float lo, float hi, bool stream = false) {
  int64_t i0 = 0;
#ifdef QCOMPILE_FQ_AVX2
  if constexpr (std::is_same_v<T, float>) {
    i0 = fwd_seg8<P, kMask ? kMaskBytes : kNoMask>(x, y, m, n, p, lo, hi, nullptr, stream);
  }
#endif
  for (int64_t i = i0; i < n; ++i) {
    const float s = p.S(i), z = p.Z(i);
    const float q = std::nearbyint(load_f(x, i) / s) + z;
    if (kMask) m[i] = static_cast<uint8_t>((q >= lo) & (q <= hi));
    store_f(y, i, (clampf(q, lo, hi) - z) * s);
  }
}

// Walk elements [b, e) segment by segment: a segment never crosses a row (divisions only
// at the start: rows can be short).
template <typename F>
static void for_segments(const Job& j, int64_t b, int64_t e, F&& f) {
  if (b >= e) return;
  const int64_t r = b / j.row;
  int64_t at = b, row_end = (r + 1) * j.row;
  if (j.col) {
    for (int64_t o = b - r * j.row; at < e; o = 0, row_end += j.row) {
      const int64_t len = std::min(e, row_end) - at;
      f(at, len, ArrayP{j.s + o, j.z + o});
      at += len;
    }
  } else {
    for (int64_t c = r % j.C; at < e; row_end += j.row, c = c + 1 == j.C ? 0 : c + 1) {
      const int64_t len = std::min(e, row_end) - at;
      f(at, len, ScalarP{j.s[c], j.z[c]});
      at += len;
    }
  }
}

// Bit masks: 8 mask bytes (0 / 1) <-> one byte, bit k for element k.
static inline void pack_bits(const uint8_t* __restrict m, uint8_t* __restrict out, int64_t n) {
  int64_t k = 0;
#ifdef QCOMPILE_FQ_AVX2
  // 32 mask bytes -> 4 bytes with one movemask (the multiply below needs 64-bit vector
  // products, which AVX2 lacks: packing cost as much as the rest of the forward)
  for (; k + 4 <= n; k += 4) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + 8 * k));
    const uint32_t bits = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(v, 7)));
    std::memcpy(out + k, &bits, sizeof bits);
  }
#endif
  for (; k < n; ++k) {
    uint64_t v;
    std::memcpy(&v, m + 8 * k, sizeof v);
    out[k] = static_cast<uint8_t>((v * 0x0102040810204080ULL) >> 56);
  }
}
static inline void unpack_bits(const uint8_t* __restrict in, uint8_t* __restrict m, int64_t n) {
  for (int64_t k = 0; k < n; ++k) {
    const uint64_t t = spread_bits(in[k]);
    std::memcpy(m + 8 * k, &t, sizeof t);
  }
}

// Short rows of a multiple of 16 elements: 16 elements at a time, each 16 with one scale
// (no per-row loop set-up). Element i of [b, e) is in row i / j.row; b % 16 == 0. With
// kOut == kMaskBits the packed mask goes straight to m (two whole bytes per 16).
template <typename T, int kOut>
static void fwd_rows16(const Job& j, int64_t b, int64_t e, const T* __restrict x,
                       T* __restrict y, uint8_t* __restrict m) {
  int64_t r = b / j.row, c = r % j.C, left = ((r + 1) * j.row - b) / 16;
  for (int64_t i = b; i < e; i += 16) {
    const float s = j.s[c], z = j.z[c];
    int64_t k0 = 0;
#ifdef QCOMPILE_FQ_AVX2
    if constexpr (std::is_same_v<T, float>) {
      k0 = fwd_seg8<ScalarP, kOut>(x + i, y + i, kOut == kMaskBits ? m + i / 8 : m, 16,
                                   ScalarP{s, z}, j.lo, j.hi);
    }
#endif
    uint32_t bits = 0;
    for (int64_t k = k0; k < 16; ++k) {
      const float q = std::nearbyint(load_f(x, i + k) / s) + z;
      bits |= static_cast<uint32_t>((q >= j.lo) & (q <= j.hi)) << k;
      store_f(y, i + k, (clampf(q, j.lo, j.hi) - z) * s);
    }
    if constexpr (kOut == kMaskBits) {
      if (k0 < 16) {  // the scalar loop ran: its 16 bits, two mask bytes
        m[i / 8] = static_cast<uint8_t>(bits);
        m[i / 8 + 1] = static_cast<uint8_t>(bits >> 8);
      }
    }
    if (--left == 0) {
      left = j.row / 16;
      c = c + 1 == j.C ? 0 : c + 1;
    }
  }
}

template <typename T>
static void fwd_t(const Job& j, int64_t b, int64_t e) {
  const T* x = static_cast<const T*>(j.x);
  T* y = static_cast<T*>(j.y);
  if (!j.col && j.row < kRowLong && j.row % 16 == 0) {  // b % 64 == 0: whole mask bytes
    if (j.bits) {
      fwd_rows16<T, kMaskBits>(j, b, e, x, y, j.bits);
    } else {
      fwd_rows16<T, kNoMask>(j, b, e, x, y, nullptr);
    }
    return;
  }
  if (!j.bits) {
    for_segments(j, b, e, [&](int64_t at, int64_t len, auto p) {
      fwd_seg<T, decltype(p), false>(x + at, y + at, nullptr, len, p, j.lo, j.hi, j.stream);
    });
    return;
  }
#ifdef QCOMPILE_FQ_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (j.row % 8 == 0) {  // every row, so every segment, starts on a whole mask byte
      for_segments(j, b, e, [&](int64_t at, int64_t n, auto p) {
        const int64_t done =
            fwd_seg8<decltype(p), kMaskBits>(x + at, y + at, j.bits + at / 8, n, p, j.lo, j.hi,
                                             nullptr, j.stream);
        if (done < n) {  // the tensor's last few elements
          alignas(8) uint8_t mb8[8] = {0};
          fwd_seg<T, decltype(p), true>(x + at + done, y + at + done, mb8, n - done,
                                        p.advanced(done), j.lo, j.hi);
          pack_bits(mb8, j.bits + (at + done) / 8, 1);
        }
      });
      return;
    }
  }
#endif
  alignas(64) uint8_t mb[kTile];
  for (int64_t t0 = b; t0 < e; t0 += kTile) {  // b % 64 == 0: whole mask bytes
    const int64_t t1 = std::min(e, t0 + kTile), len = t1 - t0, nbytes = (len + 7) / 8;
    for_segments(j, t0, t1, [&](int64_t at, int64_t n, auto p) {
      fwd_seg<T, decltype(p), true>(x + at, y + at, mb + (at - t0), n, p, j.lo, j.hi);
    });
    std::fill(mb + len, mb + nbytes * 8, static_cast<uint8_t>(0));
    pack_bits(mb, j.bits + t0 / 8, nbytes);
  }
}

template <typename T>
static void bwd_bits_t(const Job& j, int64_t b, int64_t e) {
  const T* __restrict g = static_cast<const T*>(j.g);
  T* __restrict gx = static_cast<T*>(j.gx);
#ifdef QCOMPILE_FQ_AVX2
  if constexpr (std::is_same_v<T, float>) {
    // grad * (0.0 or 1.0), as the scalar loop: a product, not a bitwise and (-0.0, and
    // NaN for an infinite gradient outside the range, as the eager formula gives)
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256 one = _mm256_set1_ps(1.0f);
    int64_t i = b;
    for (; i + 8 <= e; i += 8) {
      const __m256i bit = _mm256_and_si256(_mm256_set1_epi32(j.bits[i / 8]), sel);
      const __m256 f = _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(bit, sel)), one);
      _mm256_storeu_ps(gx + i, _mm256_mul_ps(_mm256_loadu_ps(g + i), f));
    }
    for (; i < e; ++i) {
      gx[i] = g[i] * static_cast<float>((j.bits[i / 8] >> (i % 8)) & 1);
    }
    return;
  }
#endif
  alignas(64) uint8_t mb[kTile];
  for (int64_t t0 = b; t0 < e; t0 += kTile) {
    const int64_t t1 = std::min(e, t0 + kTile), len = t1 - t0;
    unpack_bits(j.bits + t0 / 8, mb, (len + 7) / 8);
    for (int64_t i = 0; i < len; ++i) {
      store_f(gx, t0 + i, load_f(g, t0 + i) * static_cast<float>(mb[i]));
    }
  }
}

template <typename T>
static void bwd_mask_t(const Job& j, int64_t b, int64_t e) {
  const T* __restrict g = static_cast<const T*>(j.g);
  T* __restrict gx = static_cast<T*>(j.gx);
  const uint8_t* __restrict m = j.m;
  for (int64_t i = b; i < e; ++i) store_f(gx, i, load_f(g, i) * static_cast<float>(m[i]));
}

// LSQ over a block of elements: writes grad_x and t = grad * d out / d scale (float32, as
// the eager formula computes it) into a buffer for the caller to sum.
constexpr int64_t kBlock = 256;

template <typename T, typename P>
static void lsq_block(const T* __restrict x, const T* __restrict g, T* __restrict gx,
                      float* __restrict t, int64_t n, P p, float lo, float hi) {
  for (int64_t i = 0; i < n; ++i) {
    const float s = p.S(i), z = p.Z(i);
    const float xs = load_f(x, i) / s;
    const float q = std::nearbyint(xs) + z;
    const bool in = (q >= lo) & (q <= hi);
    const float cz = clampf(q, lo, hi) - z;
    const float gv = load_f(g, i);
    // Selected bitwise: GCC sinks the operands of a `?:` into its branches and, without
    // fast-math (they may trap), will not if-convert them back, which left this loop
    // scalar (13x the forward's time per element).
    store_f(gx, i, gv * select(in, 1.0f, 0.0f));
    t[i] = gv * select(in, cz - xs, cz);
  }
}

// Sums in 16 double lanes, element i (from the row's start; n % 16 == 0 but at the row's
// end) in lane i % 16, lanes added pairwise: a fixed order, the same bits for every ISA,
// thread count and tiling.
static inline void add16(double* __restrict acc, const float* __restrict t, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int k = 0; k < 16; ++k) acc[k] += static_cast<double>(t[i + k]);
  }
  for (int k = 0; i + k < n; ++k) acc[k] += static_cast<double>(t[i + k]);
}
static inline double reduce16(double* acc) {
  for (int w = 8; w >= 1; w /= 2) {
    for (int k = 0; k < w; ++k) acc[k] += acc[k + w];
  }
  return acc[0];
}

// Row mode: one scale for a (long) row's segment; returns the segment's sum.
template <typename T>
static double lsq_row_seg(const T* __restrict x, const T* __restrict g, T* __restrict gx,
                          int64_t n, float s, float z, float lo, float hi) {
  alignas(64) double acc[16] = {0.0};
  alignas(64) float t[kBlock];
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t len = std::min(kBlock, n - b);
    lsq_block<T, ScalarP>(x + b, g + b, gx + b, t, len, ScalarP{s, z}, lo, hi);
    add16(acc, t, len);
  }
  return reduce16(acc);
}

// Column mode: per-element scales, one double accumulator per column.
template <typename T>
static void lsq_col_seg(const T* __restrict x, const T* __restrict g, T* __restrict gx,
                        int64_t n, const float* __restrict s, const float* __restrict z,
                        float lo, float hi, double* __restrict acc) {
  alignas(64) float t[kBlock];
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t len = std::min(kBlock, n - b);
    lsq_block<T, ArrayP>(x + b, g + b, gx + b, t, len, ArrayP{s + b, z + b}, lo, hi);
    for (int64_t i = 0; i < len; ++i) acc[b + i] += static_cast<double>(t[i]);
  }
}

template <typename T>
static void lsq_bwd_t(const Job& j, int64_t b, int64_t e) {
  const T* x = static_cast<const T*>(j.x);
  const T* g = static_cast<const T*>(j.g);
  T* gx = static_cast<T*>(j.gx);
  if (!j.col && j.row < kRowLong && j.row % 16 == 0) {  // task t: rows of tile t
    const int64_t per_tile = kTile / j.row;
    for (int64_t t = b; t < e; ++t) {
      const int64_t r0 = t * per_tile, r1 = std::min(j.rows, r0 + per_tile);
      for (int64_t r = r0, c = r0 % j.C; r < r1; ++r, c = c + 1 == j.C ? 0 : c + 1) {
        const float s = j.s[c], z = j.z[c];
        alignas(64) double acc[16] = {0.0};
        for (int64_t i = r * j.row; i < (r + 1) * j.row; i += 16) {
          alignas(64) float tt[16];
          lsq_block<T, ScalarP>(x + i, g + i, gx + i, tt, 16, ScalarP{s, z}, j.lo, j.hi);
          add16(acc, tt, 16);
        }
        j.part[r] = reduce16(acc);
      }
    }
    return;
  }
  if (!j.col) {  // task t: chunk t % nchunk of row t / nchunk
    int64_t r = b / j.nchunk, k = b - r * j.nchunk, c = r % j.C;
    for (int64_t t = b; t < e; ++t) {
      const int64_t at = r * j.row + k * j.chunk;
      const int64_t len = std::min(j.chunk, (r + 1) * j.row - at);
      j.part[t] = lsq_row_seg<T>(x + at, g + at, gx + at, len, j.s[c], j.z[c], j.lo, j.hi);
      if (++k == j.nchunk) {
        k = 0;
        ++r;
        c = c + 1 == j.C ? 0 : c + 1;
      }
    }
    return;
  }
  for (int64_t t = b; t < e; ++t) {  // task t: column block t % ncb of row block t / ncb
    const int64_t rb = t / j.ncb, cb = t % j.ncb;
    const int64_t c0 = cb * j.col_block;
    const int64_t len = std::min(j.col_block, j.row - c0);
    double* acc = j.part + rb * j.row + c0;
    std::fill(acc, acc + len, 0.0);
    const int64_t r1 = std::min(j.rows, (rb + 1) * j.row_block);
    for (int64_t r = rb * j.row_block; r < r1; ++r) {
      const int64_t at = r * j.row + c0;
      lsq_col_seg<T>(x + at, g + at, gx + at, len, j.s + c0, j.z + c0, j.lo, j.hi, acc);
    }
  }
}

static void fwd(const Job& j, int64_t b, int64_t e) {
  j.bf16 ? fwd_t<uint16_t>(j, b, e) : fwd_t<float>(j, b, e);
}
static void bwd_mask(const Job& j, int64_t b, int64_t e) {
  j.bf16 ? bwd_mask_t<uint16_t>(j, b, e) : bwd_mask_t<float>(j, b, e);
}
static void bwd_bits(const Job& j, int64_t b, int64_t e) {
  j.bf16 ? bwd_bits_t<uint16_t>(j, b, e) : bwd_bits_t<float>(j, b, e);
}
static void lsq_bwd(const Job& j, int64_t b, int64_t e) {
  j.bf16 ? lsq_bwd_t<uint16_t>(j, b, e) : lsq_bwd_t<float>(j, b, e);
}

// min and max of n floats, both NaN when one is (as torch.amin / torch.amax)
static void minmax(const float* __restrict x, int64_t n, float* mn_out, float* mx_out) {
  int64_t i = 0;
  float mn = INFINITY, mx = -INFINITY;
  bool nan = false;
#ifdef QCOMPILE_FQ_AVX2
  // a min/max reduction GCC does not vectorise without fast-math (signed zeros, NaN);
  // four chains of each, or the min / max latency bounds the loop, not memory
  __m256 vmn = _mm256_set1_ps(INFINITY), vmx = _mm256_set1_ps(-INFINITY);
  __m256 vnan = _mm256_setzero_ps();
#ifdef QCOMPILE_FQ_AVX512
  if (n >= 64) {
    __m512 a0 = _mm512_set1_ps(INFINITY), a1 = a0, a2 = a0, a3 = a0;
    __m512 b0 = _mm512_set1_ps(-INFINITY), b1 = b0, b2 = b0, b3 = b0;
    __mmask16 nan16 = 0;
    for (; i + 64 <= n; i += 64) {
      const __m512 v0 = _mm512_loadu_ps(x + i), v1 = _mm512_loadu_ps(x + i + 16);
      const __m512 v2 = _mm512_loadu_ps(x + i + 32), v3 = _mm512_loadu_ps(x + i + 48);
      a0 = _mm512_min_ps(a0, v0);
      a1 = _mm512_min_ps(a1, v1);
      a2 = _mm512_min_ps(a2, v2);
      a3 = _mm512_min_ps(a3, v3);
      b0 = _mm512_max_ps(b0, v0);
      b1 = _mm512_max_ps(b1, v1);
      b2 = _mm512_max_ps(b2, v2);
      b3 = _mm512_max_ps(b3, v3);
      nan16 |= _mm512_cmp_ps_mask(v0, v1, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v2, v3, _CMP_UNORD_Q);
    }
    a0 = _mm512_min_ps(_mm512_min_ps(a0, a1), _mm512_min_ps(a2, a3));
    b0 = _mm512_max_ps(_mm512_max_ps(b0, b1), _mm512_max_ps(b2, b3));
    vmn = _mm256_min_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1));
    vmx = _mm256_max_ps(_mm512_castps512_ps256(b0), _mm512_extractf32x8_ps(b0, 1));
    if (nan16) vnan = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  }
#else
  if (n >= 32) {
    __m256 a1 = vmn, a2 = vmn, a3 = vmn, b1 = vmx, b2 = vmx, b3 = vmx;
    for (; i + 32 <= n; i += 32) {
      const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
      const __m256 v2 = _mm256_loadu_ps(x + i + 16), v3 = _mm256_loadu_ps(x + i + 24);
      vmn = _mm256_min_ps(vmn, v0);
      a1 = _mm256_min_ps(a1, v1);
      a2 = _mm256_min_ps(a2, v2);
      a3 = _mm256_min_ps(a3, v3);
      vmx = _mm256_max_ps(vmx, v0);
      b1 = _mm256_max_ps(b1, v1);
      b2 = _mm256_max_ps(b2, v2);
      b3 = _mm256_max_ps(b3, v3);
      vnan = _mm256_or_ps(vnan, _mm256_or_ps(_mm256_cmp_ps(v0, v1, _CMP_UNORD_Q),
                                             _mm256_cmp_ps(v2, v3, _CMP_UNORD_Q)));
    }
    vmn = _mm256_min_ps(_mm256_min_ps(vmn, a1), _mm256_min_ps(a2, a3));
    vmx = _mm256_max_ps(_mm256_max_ps(vmx, b1), _mm256_max_ps(b2, b3));
  }
#endif
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    vmn = _mm256_min_ps(vmn, v);
    vmx = _mm256_max_ps(vmx, v);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float a[8], b[8];
  _mm256_store_ps(a, vmn);
  _mm256_store_ps(b, vmx);
  for (int k = 0; k < 8; ++k) {
    mn = a[k] < mn ? a[k] : mn;
    mx = b[k] > mx ? b[k] : mx;
  }
  nan = _mm256_movemask_ps(vnan) != 0;
#endif
  for (; i < n; ++i) {
    const float v = x[i];
    nan = nan || v != v;
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
  }
  *mn_out = nan ? NAN : mn;
  *mx_out = nan ? NAN : mx;
}

// NaN-propagating minimum / maximum (torch.minimum / maximum)
static inline float fold_min(float a, float b) { return (a != a || b != b) ? NAN : (b < a ? b : a); }
static inline float fold_max(float a, float b) { return (a != a || b != b) ? NAN : (b > a ? b : a); }

// The forward of elements [b, e) (fwd: output and mask, the same code, the same bits),
// tile by tile, each tile then folded into running statistics while it is still in cache,
// so x comes from memory once. Row mode: one minimum / maximum per channel (mn[c], mx[c];
// row r holds channel r % C); column mode: one per element of the period (mn[o], mx[o] for
// offset o of a row; the caller folds each channel's inner offsets). b % 64 == 0.
#ifdef QCOMPILE_FQ_AVX2
// fwd_minmax_t's float32 row-mode loop: each segment's forward (fwd_seg8, as fwd_t runs
// it; the mask bits straight to j.bits) with its min / max in the same loop; the tail of
// the tensor as fwd_t does it. Segments start on whole mask bytes.
template <int kOut>
static void fwd_minmax_rows(const Job& j, int64_t b, int64_t e, float* __restrict mn,
                            float* __restrict mx) {
  const float* x = static_cast<const float*>(j.x);
  float* y = static_cast<float*>(j.y);
  for_segments(j, b, e, [&](int64_t at, int64_t n, auto p) {
    MinMax8 st{_mm256_set1_ps(INFINITY), _mm256_set1_ps(-INFINITY), _mm256_setzero_ps()};
    const int64_t done = fwd_seg8<decltype(p), kOut, true>(
        x + at, y + at, kOut == kMaskBits ? j.bits + at / 8 : nullptr, n, p, j.lo, j.hi, &st);
    alignas(32) float lmn[8], lmx[8];
    _mm256_store_ps(lmn, st.mn);
    _mm256_store_ps(lmx, st.mx);
    float a = INFINITY, z = -INFINITY;
    for (int k = 0; k < 8; ++k) {
      a = lmn[k] < a ? lmn[k] : a;
      z = lmx[k] > z ? lmx[k] : z;
    }
    if (_mm256_movemask_ps(st.nan) != 0) a = z = NAN;
    if (done < n) {  // fewer than 8 left: the tensor's last elements
      // their statistics first: y may be x (fake_quant_minmax_overwrite)
      float ta, tz;
      minmax(x + at + done, n - done, &ta, &tz);
      a = fold_min(a, ta);
      z = fold_max(z, tz);
      if constexpr (kOut == kMaskBits) {
        alignas(8) uint8_t mb8[8] = {0};
        fwd_seg<float, decltype(p), true>(x + at + done, y + at + done, mb8, n - done,
                                          p.advanced(done), j.lo, j.hi);
        pack_bits(mb8, j.bits + (at + done) / 8, 1);
      } else {
        fwd_seg<float, decltype(p), false>(x + at + done, y + at + done, nullptr, n - done,
                                           p.advanced(done), j.lo, j.hi);
      }
    }
    const int64_t c = (at / j.row) % j.C;
    mn[c] = fold_min(mn[c], a);
    mx[c] = fold_max(mx[c], z);
  });
}
#endif

template <typename T>
static void fwd_minmax_t(const Job& j, int64_t b, int64_t e, float* __restrict mn,
                         float* __restrict mx) {
#ifdef QCOMPILE_FQ_AVX2
  if constexpr (std::is_same_v<T, float>) {
    if (!j.col && !j.bits) {
      fwd_minmax_rows<kNoMask>(j, b, e, mn, mx);
      return;
    }
    if (!j.col && (j.row % 8 == 0 || j.rows == 1)) {  // segments on whole mask bytes
      fwd_minmax_rows<kMaskBits>(j, b, e, mn, mx);
      return;
    }
  }
#endif
  // elsewhere: a tile's statistics, then its forward while it is in cache (in this order:
  // y may be x, fake_quant_minmax_overwrite)
  const T* x = static_cast<const T*>(j.x);
  alignas(64) float buf[kTile];  // a bfloat16 tile as float32 (exact), for minmax
  for (int64_t t0 = b; t0 < e; t0 += kTile) {
    const int64_t t1 = std::min(e, t0 + kTile), len = t1 - t0;
    const float* v;
    if constexpr (std::is_same_v<T, float>) {
      v = x + t0;
    } else {
      for (int64_t i = 0; i < len; ++i) buf[i] = load_f(x, t0 + i);
      v = buf;
    }
    if (j.col) {
      for (int64_t i = 0, o = t0 % j.row; i < len; ++i) {
        mn[o] = fold_min(mn[o], v[i]);
        mx[o] = fold_max(mx[o], v[i]);
        if (++o == j.row) o = 0;
      }
    } else {
      for (int64_t at = t0, r = t0 / j.row; at < t1; ++r) {  // segments within a row
        const int64_t end = std::min(t1, (r + 1) * j.row), c = r % j.C;
        float a, z;
        minmax(v + (at - t0), end - at, &a, &z);
        mn[c] = fold_min(mn[c], a);
        mx[c] = fold_max(mx[c], z);
        at = end;
      }
    }
    fwd_t<T>(j, t0, t1);
  }
}

static void fwd_minmax(const Job& j, int64_t b, int64_t e, float* mn, float* mx) {
  j.bf16 ? fwd_minmax_t<uint16_t>(j, b, e, mn, mx) : fwd_minmax_t<float>(j, b, e, mn, mx);
}

static const KernelTable table{QCOMPILE_FQ_ISA_NAME, fwd, bwd_mask, bwd_bits, lsq_bwd, minmax,
                               fwd_minmax};

#endif  // QCOMPILE_FQ_KERNEL_BODY
