// qcompile's block-scaled fake-quant kernel (CPU): torch.ops.qcompile.block_fake_quant.
//
// block_fake_quant(x, fmt, block): x's elements in memory order (row-major) cut into
// consecutive blocks of `block`, each fake-quantized with its own scale, bit-identical to
// qcompile.runtime.block_formats.fake_quant_eager (float32 math, the result rounded back
// to x's dtype):
//   MX (mxfp8_e4m3, mxfp8_e5m2, mxfp6_e3m2, mxfp6_e2m3, mxfp4; OCP MX v1.0, FLOOR scale):
//     e = clamp(floor_log2(amax) - emax, -127, 127); out = round_elem(x * 2^-e) * 2^e;
//     a block holding NaN or inf gives NaN throughout.
//   nvfp4: pts = tensor_amax / 2688; s8 = e4m3(clamp(block_amax / 6 / pts, 2^-6, 448));
//     out = round_fp4(clamp(x * ((1 / pts) / s8), -6, 6)) * (pts * s8); NaN throughout
//     when x holds NaN or inf; signed zeros when pts is 0 or 1 / pts overflows.
//   nf4: out = level[nearest(x / absmax)] * absmax (the first of equally near levels);
//     all-zero blocks give zeros, blocks holding NaN or inf NaN.
//   llama.cpp's grids (q8_0, q4_0, q4_1: blocks of 32; q4_k, q6_k, q8_k: 256): the fp16
//     (q8_k: float32) block scales and codes of block_formats.py's _ggml_grid, dequantized
//     as llama.cpp does (Q4_0: (q - 8) * d16; Q4_K: d16 * sc * q - dmin16 * m; ...), scalar
//     code (the compiler vectorises the loops); blocks holding NaN or inf give NaN.
// round_elem(v): step = 2^(max(floor_log2|v|, emin) - mbits); q = min(rint(|v| / step) *
// step, max) with v's sign (round half to even, saturating). floor_log2 reads the float32
// exponent bits, so every power of two here is built exactly from bits.
// Backward: identity (straight-through), one C++ autograd node that hands the gradient on.
//
// Built without fast-math and with -ffp-contract=off: true division, IEEE rounding. The
// kernel bodies (the #else branch at the end) are compiled for AVX-512, AVX2 and the
// baseline ISA and picked at run time like fake_quant.cpp's (QCOMPILE_FQ_ISA overrides);
// every variant does the same IEEE operations, so results do not depend on the machine.
// (Multiplying by an exact power of two or dividing by its inverse round the same exact
// value once: the same bits.)

#ifndef QCOMPILE_BQ_KERNEL_BODY

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace qcompile_bq {

// An element format: mantissa bits, smallest normal exponent, largest finite value.
struct Elem {
  int mbits;
  int emin;
  float max;
};

enum Kind { kMX = 0, kNVFP4 = 1, kNF4 = 2, kGGML = 3 };

// llama.cpp's grids (kGGML), and the block each one fixes
enum Ggml { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ4_K = 3, kQ6_K = 4, kQ8_K = 5 };
struct GgmlName {
  const char* name;
  Ggml id;
  int64_t block;
};
constexpr GgmlName kGgml[] = {{"q8_0", kQ8_0, 32},  {"q4_0", kQ4_0, 32},  {"q4_1", kQ4_1, 32},
                              {"q4_k", kQ4_K, 256}, {"q6_k", kQ6_K, 256}, {"q8_k", kQ8_K, 256}};

// One call's work, as plain values: shared by every ISA variant.
struct Job {
  const void* x = nullptr;  // input (float or bfloat16 bits), contiguous
  void* y = nullptr;        // output, same dtype
  int64_t block = 1;
  bool bf16 = false;
  Kind kind = kMX;
  Elem el{};              // MX: the element format; nvfp4: e2m1
  int emax = 0;           // MX: exponent of the element format's largest power of two
  float pts = 0.f;        // nvfp4: the tensor scale, amax / 2688
  float inv_pts = 0.f;    // nvfp4: 1 / pts
  Ggml ggml = kQ8_0;      // kGGML: which grid
};

constexpr Elem kE4M3{3, -6, 448.0f};
constexpr Elem kE2M1{1, 0, 6.0f};

// QLoRA's NF4 levels (bitsandbytes), ascending.
constexpr float kLevels[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

struct KernelTable {
  const char* name;
  void (*blocks)(const Job&, int64_t, int64_t);           // blocks [b, e)
  uint32_t (*absmax_bits)(const Job&, int64_t, int64_t);  // max of |x| bits, elements [b, e)
};

}  // namespace qcompile_bq

#define QCOMPILE_BQ_KERNEL_BODY 1
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define QCOMPILE_BQ_X86 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2")
#define QCOMPILE_BQ_ISA_NAME "avx512"
#define QCOMPILE_BQ_AVX2 1  // GCC's target pragma does not define __AVX2__: our own flag
#define QCOMPILE_BQ_AVX512 1
namespace qcompile_bq::isa_avx512 {
#include __FILE__
}  // namespace qcompile_bq::isa_avx512
#undef QCOMPILE_BQ_AVX512
#undef QCOMPILE_BQ_AVX2
#undef QCOMPILE_BQ_ISA_NAME
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
#define QCOMPILE_BQ_ISA_NAME "avx2"
#define QCOMPILE_BQ_AVX2 1
namespace qcompile_bq::isa_avx2 {
#include __FILE__
}  // namespace qcompile_bq::isa_avx2
#undef QCOMPILE_BQ_AVX2
#undef QCOMPILE_BQ_ISA_NAME
#pragma GCC pop_options
#endif
#define QCOMPILE_BQ_ISA_NAME "base"
namespace qcompile_bq::isa_base {
#include __FILE__
}  // namespace qcompile_bq::isa_base
#undef QCOMPILE_BQ_ISA_NAME
#undef QCOMPILE_BQ_KERNEL_BODY

// From fake_quant.cpp, built into the same library: its output allocation (outputs of
// 1 MB and more come from its cache of freed blocks: a fresh large output's page faults
// cost more than the kernel) and its choice of instruction-set variant.
namespace qcompile_fq {
at::Tensor empty_out(at::IntArrayRef sizes, at::IntArrayRef strides, at::ScalarType dtype);
int isa_level(const std::string& want);
}  // namespace qcompile_fq

namespace qcompile_bq {

using at::Tensor;

constexpr int64_t kGrain = 32768;  // elements per parallel task, at least

// The variant fake_quant.cpp picks (its isa_level): the best the CPU supports, or
// QCOMPILE_FQ_ISA's (avx512, avx2, base), read at each call so tests can compare variants
// in one process.
static const KernelTable* pick(const std::string& want) {
  switch (qcompile_fq::isa_level(want)) {
#ifdef QCOMPILE_BQ_X86
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

// fmt -> the job's format fields
static void set_format(Job& j, const std::string& fmt) {
  struct Mx {
    const char* name;
    Elem el;
    int emax;
  };
  static constexpr Mx mx[] = {{"mxfp8_e4m3", {3, -6, 448.0f}, 8},
                              {"mxfp8_e5m2", {2, -14, 57344.0f}, 15},
                              {"mxfp6_e3m2", {2, -2, 28.0f}, 4},
                              {"mxfp6_e2m3", {3, 0, 7.5f}, 2},
                              {"mxfp4", {1, 0, 6.0f}, 2}};
  for (const Mx& m : mx) {
    if (fmt == m.name) {
      j.kind = kMX;
      j.el = m.el;
      j.emax = m.emax;
      return;
    }
  }
  if (fmt == "nvfp4") {
    j.kind = kNVFP4;
    j.el = kE2M1;
    return;
  }
  for (const GgmlName& g : kGgml) {
    if (fmt == g.name) {
      j.kind = kGGML;
      j.ggml = g.id;
      return;
    }
  }
  TORCH_CHECK(fmt == "nf4", "qcompile block_fake_quant: unknown format '", fmt,
              "'; expected one of mxfp8_e4m3, mxfp8_e5m2, mxfp6_e3m2, mxfp6_e2m3, mxfp4, "
              "nvfp4, nf4, q8_0, q4_0, q4_1, q4_k, q6_k, q8_k");
  j.kind = kNF4;
}

static inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// max |x| of the whole tensor, as float32 bits (> 0x7f800000: a NaN; 0x7f800000: inf)
static uint32_t tensor_absmax_bits(const Job& j, int64_t n) {
  const auto& k = kernels();
  const int64_t nchunk = std::max<int64_t>(1, (n + kGrain - 1) / kGrain);
  std::vector<uint32_t> part(nchunk, 0);
  at::parallel_for(0, nchunk, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      part[c] = k.absmax_bits(j, c * kGrain, std::min(n, (c + 1) * kGrain));
    }
  });
  return *std::max_element(part.begin(), part.end());  // exact: max is order-free
}

static Tensor block_fake_quant_cpu(const Tensor& x_in, c10::string_view fmt_in, int64_t block) {
  const std::string fmt(fmt_in);
  Job j;
  set_format(j, fmt);
  TORCH_CHECK(block > 0, "qcompile block_fake_quant: block must be positive, got ", block);
  if (j.kind == kGGML) {
    for (const GgmlName& g : kGgml) {
      TORCH_CHECK(g.id != j.ggml || block == g.block, "qcompile block_fake_quant: ", fmt,
                  " blocks are ", g.block, " elements, got ", block);
    }
  }
  TORCH_CHECK(x_in.numel() % block == 0, "qcompile block_fake_quant: ", fmt, " takes blocks of ",
              block, " consecutive elements, but x ", x_in.sizes(), " has ", x_in.numel(),
              " elements (not a multiple of ", block, ")");
  const auto dtype = x_in.scalar_type();
  if (dtype == at::kHalf) {  // float32 math, rounded back (as the eager reference)
    return block_fake_quant_cpu(x_in.to(at::kFloat), fmt_in, block).to(at::kHalf);
  }
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "qcompile block_fake_quant: expects a float32, bfloat16 or float16 tensor, got ",
              dtype);
  const Tensor x = x_in.contiguous();
  Tensor out = qcompile_fq::empty_out(x.sizes(), x.strides(), dtype);
  const int64_t n = x.numel();
  if (n == 0) return out;
  j.x = x.const_data_ptr();
  j.y = out.mutable_data_ptr();
  j.block = block;
  j.bf16 = dtype == at::kBFloat16;
  if (j.kind == kNVFP4) {
    // NaN or inf anywhere makes every element NaN (pts NaN or inf, then 0 * inf). A tensor
    // scale of 0 or one whose inverse overflows (all zeros, or amax < 2688 * 2^-128) gives
    // zeros with x's signs (both scales taken as 0)
    const uint32_t amax = tensor_absmax_bits(j, n);
    if (amax >= 0x7f800000u) {
      out.fill_(NAN);
      return out;
    }
    j.pts = from_bits(amax) / 2688.0f;
    j.inv_pts = 1.0f / j.pts;
    if (std::isinf(j.inv_pts)) j.pts = 0.0f;  // (pts == 0 too)
  }
  const auto& k = kernels();
  at::parallel_for(0, n / block, std::max<int64_t>(1, kGrain / block),
                   [&](int64_t b, int64_t e) { k.blocks(j, b, e); });
  return out;
}

static Tensor block_fake_quant_meta(const Tensor& x, c10::string_view, int64_t) {
  return at::empty_symint(x.sym_sizes(), x.options());
}

// -- autograd: identity (straight-through), no Python, no saved tensors ------------------
struct BlockFakeQuantBackward final : public torch::autograd::Node {
  std::string name() const override { return "BlockFakeQuantBackward"; }
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    torch::autograd::variable_list out(num_outputs());
    if (grads[0].defined() && should_compute_output(0)) out[0] = std::move(grads[0]);
    return out;
  }
};

static Tensor block_fake_quant_autograd(const Tensor& x, c10::string_view fmt, int64_t block) {
  static const auto below = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("qcompile::block_fake_quant", "")
                                .typed<Tensor(const Tensor&, c10::string_view, int64_t)>();
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = below.call(x, fmt, block);
  }
  if (at::GradMode::is_enabled() && x.requires_grad()) {
    auto node = c10::make_intrusive<BlockFakeQuantBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(x));
    torch::autograd::set_history(out, node);
  }
  return out;
}

}  // namespace qcompile_bq

// fake_quant.cpp defines the library (TORCH_LIBRARY); this file adds a fragment.
TORCH_LIBRARY_FRAGMENT(qcompile, m) {
  m.def("block_fake_quant(Tensor x, str fmt, int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(qcompile, CPU, m) {
  m.impl("block_fake_quant", &qcompile_bq::block_fake_quant_cpu);
}

TORCH_LIBRARY_IMPL(qcompile, Meta, m) {
  m.impl("block_fake_quant", &qcompile_bq::block_fake_quant_meta);
}

TORCH_LIBRARY_IMPL(qcompile, Autograd, m) {
  m.impl("block_fake_quant", &qcompile_bq::block_fake_quant_autograd);
}

#else  // QCOMPILE_BQ_KERNEL_BODY: compiled once per instruction set, inside its namespace

static inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
static inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
static inline float load_f(const float* p, int64_t i) { return p[i]; }
static inline float load_f(const uint16_t* p, int64_t i) {  // bfloat16 bits
  return float_of(static_cast<uint32_t>(p[i]) << 16);
}
static inline void store_f(float* p, int64_t i, float v) { p[i] = v; }
static inline void store_f(uint16_t* p, int64_t i, float v) {  // round to nearest even
  const uint32_t u = bits_of(v);
  p[i] = v != v ? static_cast<uint16_t>(0x7FC0)
                : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// 2^k for k in [-127, 127], exact (2^-127 is a subnormal)
static inline float pow2(int k) {
  return k >= -126 ? float_of(static_cast<uint32_t>(k + 127) << 23) : float_of(0x00400000u);
}

// round_elem: the element format's nearest value (half to even), saturating, v's sign;
// NaN stays NaN
static inline float round_elem(float v, const Elem& el) {
  const uint32_t u = bits_of(v), a = u & 0x7FFFFFFFu;
  const int ex = std::min(std::max(static_cast<int>(a >> 23) - 127, el.emin), 127);
  const float inv = float_of(static_cast<uint32_t>(el.mbits - ex + 127) << 23);  // 1 / step
  const float step = float_of(static_cast<uint32_t>(ex - el.mbits + 127) << 23);
  float q = std::nearbyint(float_of(a) * inv) * step;
  q = q > el.max ? el.max : q;
  return float_of(bits_of(q) | (u & 0x80000000u));
}

static inline float clamp_nan(float v, float lo, float hi) {  // NaN passes, like torch.clamp
  v = v < lo ? lo : v;
  return v > hi ? hi : v;
}

template <typename T>
static void fill(T* y, int64_t n, float v) {
  for (int64_t i = 0; i < n; ++i) store_f(y, i, v);
}

template <typename T>
static uint32_t absmax_scalar(const T* x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, bits_of(load_f(x, i)) & 0x7FFFFFFFu);
  return m;
}

// NF4: the first of the nearest levels to v in [-1, 1]: the nearest level below or at v
// (lo) or the one above (lo + 1), ties to lo. Distances to the other levels are larger by
// at least 0.079, far beyond float32 rounding, so no other level can tie.
static inline float nf4_level(float v) {
  int lo = 0;
  for (int i = 1; i < 16; ++i) lo += v >= kLevels[i] ? 1 : 0;
  const int hi = std::min(lo + 1, 15);
  return std::fabs(v - kLevels[hi]) < std::fabs(v - kLevels[lo]) ? kLevels[hi] : kLevels[lo];
}

// -- one block, scalar ------------------------------------------------------------------
template <typename T>
static void mx_block_scalar(const Job& j, const T* x, T* y, uint32_t amax) {
  const int64_t n = j.block;
  if (amax >= 0x7F800000u) return fill(y, n, NAN);
  const int e = std::min(std::max(static_cast<int>(amax >> 23) - 127 - j.emax, -127), 127);
  const float dn = pow2(-e), up = pow2(e);
  for (int64_t i = 0; i < n; ++i) store_f(y, i, round_elem(load_f(x, i) * dn, j.el) * up);
}

// the block's multiplier (1 / pts) / s8 and its output scale pts * s8
static inline void nvfp4_scales(const Job& j, uint32_t amax, float* recip, float* sc) {
  const float bs = float_of(amax) / 6.0f;
  const float s8 = round_elem(clamp_nan(bs / j.pts, 0.015625f, 448.0f), kE4M3);
  *recip = j.inv_pts / s8;
  *sc = j.pts * s8;
}

template <typename T>
static void nvfp4_block_scalar(const Job& j, const T* x, T* y, uint32_t amax) {
  float recip, sc;
  nvfp4_scales(j, amax, &recip, &sc);
  for (int64_t i = 0; i < j.block; ++i) {
    store_f(y, i, round_elem(clamp_nan(load_f(x, i) * recip, -6.0f, 6.0f), kE2M1) * sc);
  }
}

// -- llama.cpp's grids: block_formats.py's _ggml_grid / BlockGrid.codes / values, the same
// float32 operations in the same order (no contraction: -ffp-contract=off) -------------
static inline float f16r(float v) { return static_cast<float>(c10::Half(v)); }  // RNE
// 1 / d; 0 for d == 0 (llama.cpp's id) and where 1 / d overflows (subnormal d: its fp16
// scale is 0, and an infinite id would make 0 * inf NaN)
static inline float recip0(float d) {
  const float r = d == 0.0f ? 0.0f : 1.0f / d;
  return std::isinf(r) ? 0.0f : r;
}
// llama.cpp's iscale = code / lead (Q6_K, Q8_K); 0 for a zero lead or an overflow
static inline float inverse_scale(float lead, float code) {
  const float r = lead == 0.0f ? 0.0f : code / lead;
  return std::isinf(r) ? 0.0f : r;
}
static inline float plus0(float v) { return v == 0.0f ? 0.0f : v; }
static inline float clampf(float v, float lo, float hi) { return std::min(std::max(v, lo), hi); }
// trunc and C's roundf from nearbyint (round half to even, which the compiler inlines and
// vectorises; std::trunc / std::floor / float-to-int conversions stay per-element calls
// or scalar code under the default -ftrapping-math). Both exact: |v - nearbyint(v)| <= 0.5
// is computed exactly (Sterbenz), so the corrections below see the true difference.
static inline float trunc_exact(float v) {
  const float r = std::nearbyint(v);
  return std::fabs(r) > std::fabs(v) ? r - std::copysign(1.0f, v) : r;
}
// halves away from zero, without the v + 0.5 rounding; +0.0 for a zero result
static inline float roundf_exact(float v) {
  const float a = std::fabs(v), r = std::nearbyint(a);
  const float b = a - r == 0.5f ? r + 1.0f : r;
  return v < 0.0f ? 0.0f - b : b;
}

// the first element whose magnitude's bits are amax (the block's largest magnitude, found
// by absmax_scalar: integer maxima vectorise), with its sign. Its index is an integer
// minimum over the block, which vectorises; a loop that returns at the first match does
// not, and its exit is a branch mispredicted once per block.
template <typename T>
static inline float lead_of(const T* x, int64_t n, uint32_t amax) {
  const int32_t none = static_cast<int32_t>(n);
  int32_t first = none;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t hit =
        (bits_of(load_f(x, i)) & 0x7FFFFFFFu) == amax ? static_cast<int32_t>(i) : none;
    first = hit < first ? hit : first;
  }
  return first < none ? load_f(x, first) : 0.0f;  // (a match is always there)
}
static inline float lead_of(const float* v, int64_t n) {
  return lead_of(v, n, absmax_scalar(v, n));
}

// minimum and maximum of n (a multiple of 8) finite values, in 8 lanes the compiler
// vectorises (a float min / max reduction is not vectorised under IEEE semantics); a zero
// result's sign is not defined (callers take +0.0)
template <typename T>
static inline void minmax8(const T* x, int64_t n, float* lo, float* hi) {
  float l[8], h[8];
  for (int k = 0; k < 8; ++k) l[k] = h[k] = load_f(x, k);
  for (int64_t i = 8; i < n; i += 8) {
    for (int k = 0; k < 8; ++k) {
      const float v = load_f(x, i + k);
      l[k] = v < l[k] ? v : l[k];
      h[k] = v > h[k] ? v : h[k];
    }
  }
  float a = l[0], b = h[0];
  for (int k = 1; k < 8; ++k) {
    a = l[k] < a ? l[k] : a;
    b = h[k] > b ? h[k] : b;
  }
  *lo = a;
  *hi = b;
}

// minmax8 of exactly 32 values: two 16-lane halves, then a halving tree (what the compiler
// turns into a few full-width vector instructions; minmax8's 8-lane form became 4-lane code)
template <typename T>
static inline void minmax32(const T* x, float* lo, float* hi) {
  float l[16], h[16];
  for (int k = 0; k < 16; ++k) {
    const float a = load_f(x, k), b = load_f(x, 16 + k);
    l[k] = b < a ? b : a;
    h[k] = b > a ? b : a;
  }
  for (int w = 8; w > 0; w /= 2) {
    for (int k = 0; k < w; ++k) {
      l[k] = l[k + w] < l[k] ? l[k + w] : l[k];
      h[k] = h[k + w] > h[k] ? h[k + w] : h[k];
    }
  }
  *lo = l[0];
  *hi = h[0];
}

#ifdef QCOMPILE_BQ_AVX2
// The two-level grids, a whole super-block of 256 eight lanes at a time in both x86
// variants (defined with the other eight-lane code below): their sub-block scales are
// computed for all sub-blocks in one vector (one division for eight, not eight), where
// the scalar code's per-sub-block reductions and divisions cost more than its elements.
template <typename T>
static void q4_k_block8(const T* x, T* y);
template <typename T>
static void q6_k_block8(const T* x, T* y);
// Q8_0 / Q4_0 / Q4_1: eight blocks of 32 together, their scales in one vector; false
// (nothing written) when a block holds NaN or inf
template <typename T>
static bool ggml32_group8(const Job& j, const T* x, T* y);
#endif

#ifdef QCOMPILE_BQ_AVX2
// The element loops of the 32-element grids, eight lanes at a time (defined with the other
// eight-lane code below); each returns how many elements it did.
template <typename T>
static int64_t q8_0_elements8(const T* x, T* y, int64_t n, float id, float d16);
template <typename T>
static int64_t q4_0_elements8(const T* x, T* y, int64_t n, float id, float d16);
template <typename T>
static int64_t q4_1_elements8(const T* x, T* y, int64_t n, float lo, float id, float d16,
                              float m16);
#define QCOMPILE_BQ_GGML8 1
#endif

template <typename T>
static void ggml_block_scalar(const Job& j, const T* x, T* y, uint32_t amax) {
  const int64_t n = j.block;
  if (amax >= 0x7F800000u) return fill(y, n, NAN);
  switch (j.ggml) {
    case kQ8_0: {
      const float d = float_of(amax) / 127.0f, id = recip0(d), d16 = f16r(d);
      int64_t i = 0;
#ifdef QCOMPILE_BQ_GGML8
      i = q8_0_elements8(x, y, n, id, d16);
#endif
      for (; i < n; ++i) {
        store_f(y, i, d16 * clampf(roundf_exact(load_f(x, i) * id), -127.0f, 127.0f));
      }
      return;
    }
    case kQ4_0: {
      const float d = lead_of(x, n, amax) / -8.0f, id = recip0(d), d16 = f16r(d);
      int64_t i = 0;
#ifdef QCOMPILE_BQ_GGML8
      i = q4_0_elements8(x, y, n, id, d16);
#endif
      for (; i < n; ++i) {
        const float q = clampf(trunc_exact(load_f(x, i) * id + 8.5f), 0.0f, 15.0f);
        store_f(y, i, (q - 8.0f) * d16);
      }
      return;
    }
    case kQ4_1: {
      float hi, lo;
      minmax32(x, &lo, &hi);  // n == 32
      hi = plus0(hi);
      lo = plus0(lo);
      const float d = (hi - lo) / 15.0f, id = recip0(d), d16 = f16r(d), m16 = f16r(lo);
      int64_t i = 0;
#ifdef QCOMPILE_BQ_GGML8
      i = q4_1_elements8(x, y, n, lo, id, d16, m16);
#endif
      for (; i < n; ++i) {
        const float q = clampf(trunc_exact((load_f(x, i) - lo) * id + 0.5f), 0.0f, 15.0f);
        store_f(y, i, d16 * q + m16);
      }
      return;
    }
    case kQ4_K: {  // 8 sub-blocks of 32
#ifdef QCOMPILE_BQ_AVX2
      return q4_k_block8(x, y);
#endif
      float scale[8], mins[8], top_s = 0.0f, top_m = 0.0f;
      for (int s = 0; s < 8; ++s) {
        float hi, lo;
        minmax8(x + 32 * s, 32, &lo, &hi);
        lo = plus0(std::min(lo, 0.0f));
        scale[s] = (plus0(hi) - lo) / 15.0f;
        mins[s] = 0.0f - lo;
        top_s = std::max(top_s, scale[s]);
        top_m = std::max(top_m, mins[s]);
      }
      const float d = top_s / 63.0f, dmin = top_m / 63.0f;
      const float d16 = f16r(d), m16 = f16r(dmin), id = recip0(d), im = recip0(dmin);
      for (int s = 0; s < 8; ++s) {
        const float sc = plus0(clampf(std::nearbyint(scale[s] * id), 0.0f, 63.0f));
        const float m = plus0(clampf(std::nearbyint(mins[s] * im), 0.0f, 63.0f));
        const float big_d = d16 * sc, big_m = m16 * m, inv = recip0(big_d);
        for (int i = 32 * s; i < 32 * s + 32; ++i) {
          const float q =
              plus0(clampf(std::nearbyint((load_f(x, i) + big_m) * inv), 0.0f, 15.0f));
          store_f(y, i, big_d * q - big_m);
        }
      }
      return;
    }
    case kQ6_K: {  // 16 sub-blocks of 16; the scale of largest magnitude gets code -128
#ifdef QCOMPILE_BQ_AVX2
      return q6_k_block8(x, y);
#endif
      float scale[16];
      for (int s = 0; s < 16; ++s) {
        scale[s] = lead_of(x + 16 * s, 16, absmax_scalar(x + 16 * s, 16)) / -32.0f;
      }
      const float top = lead_of(scale, 16);
      const float iscale = inverse_scale(top, -128.0f), d16 = f16r(recip0(iscale));
      for (int s = 0; s < 16; ++s) {
        const float sc = plus0(clampf(std::nearbyint(iscale * scale[s]), -128.0f, 127.0f));
        const float big_d = d16 * sc, inv = recip0(big_d);
        for (int i = 16 * s; i < 16 * s + 16; ++i) {
          const float q =
              plus0(clampf(std::nearbyint(load_f(x, i) * inv), -32.0f, 31.0f));
          store_f(y, i, big_d * q);
        }
      }
      return;
    }
    case kQ8_K: {  // llama.cpp's activation blocks for K-type weights: float32 d
      const float lead = lead_of(x, n, amax);
      const float iscale = inverse_scale(lead, -127.0f), d = recip0(iscale);
      for (int64_t i = 0; i < n; ++i) {
        store_f(y, i,
                d * plus0(clampf(std::nearbyint(load_f(x, i) * iscale), -128.0f, 127.0f)));
      }
      return;
    }
  }
}

template <typename T>
static void nf4_block_scalar(const Job& j, const T* x, T* y, uint32_t amax) {
  const int64_t n = j.block;
  if (amax >= 0x7F800000u) return fill(y, n, NAN);
  if (amax == 0) return fill(y, n, 0.0f);
  const float s = float_of(amax);
  for (int64_t i = 0; i < n; ++i) store_f(y, i, nf4_level(load_f(x, i) / s) * s);
}

#ifdef QCOMPILE_BQ_AVX2
// -- eight lanes at a time: the scalar code's IEEE operations, lane for lane -------------
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline void store8(uint16_t* p, __m256 v) {  // round to nearest even, NaN -> 0x7FC0
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  r = _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)),
                       nan));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

static inline __m256i abs_bits8(__m256 v) {
  return _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7FFFFFFF));
}
static inline uint32_t hmax(__m256i v) {  // of non-negative int32 lanes
  __m128i m = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0x4E));
  m = _mm_max_epi32(m, _mm_shuffle_epi32(m, 0xB1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
}

static inline uint32_t absmax8(const float* x, int64_t n) {  // n % 8 == 0
  __m256i m = _mm256_setzero_si256();
  for (int64_t i = 0; i < n; i += 8) m = _mm256_max_epi32(m, abs_bits8(load8(x + i)));
  return hmax(m);
}
static inline uint32_t absmax8(const uint16_t* x, int64_t n) {  // n % 8 == 0
  // bfloat16 bits are the top half of the float32 ones: compare them as they are, 16 at a
  // time
  const __m256i abs16 = _mm256_set1_epi16(0x7FFF);
  __m256i m = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    m = _mm256_max_epu16(m, _mm256_and_si256(v, abs16));
  }
  __m128i h = _mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  if (i < n) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    h = _mm_max_epu16(h, _mm_and_si128(v, _mm256_castsi256_si128(abs16)));
  }
  h = _mm_max_epu16(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_max_epu16(h, _mm_shuffle_epi32(h, 0xB1));
  h = _mm_max_epu16(h, _mm_srli_epi32(h, 16));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(h) & 0xFFFF) << 16;
}

struct Elem8 {
  __m256i emin, hi_exp, inv_base, step_base;
  __m256 max;
  explicit Elem8(const Elem& el)
      : emin(_mm256_set1_epi32(el.emin)),
        hi_exp(_mm256_set1_epi32(127)),
        inv_base(_mm256_set1_epi32(el.mbits + 127)),
        step_base(_mm256_set1_epi32(127 - el.mbits)),
        max(_mm256_set1_ps(el.max)) {}
};

static inline __m256 round_elem8(__m256 v, const Elem8& c) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i sign = _mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
  __m256i ex = _mm256_sub_epi32(_mm256_srli_epi32(a, 23), _mm256_set1_epi32(127));
  ex = _mm256_min_epi32(_mm256_max_epi32(ex, c.emin), c.hi_exp);
  const __m256 inv = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(c.inv_base, ex), 23));
  const __m256 step =
      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(ex, c.step_base), 23));
  const __m256 t = _mm256_mul_ps(_mm256_castsi256_ps(a), inv);
  __m256 q = _mm256_mul_ps(_mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                           step);
  q = _mm256_min_ps(c.max, q);  // the second operand when NaN: NaN passes
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(q), sign));
}

static inline __m256 clamp8(__m256 v, __m256 lo, __m256 hi) {  // NaN passes
  return _mm256_min_ps(hi, _mm256_max_ps(lo, v));
}

template <typename T>
static void mx_blocks8(const Job& j, const T* x, T* y, int64_t nblocks) {
  const Elem8 c(j.el);
  const int64_t n = j.block;
  for (int64_t b = 0; b < nblocks; ++b, x += n, y += n) {
    const uint32_t amax = absmax8(x, n);
    if (amax >= 0x7F800000u) {
      fill(y, n, NAN);
      continue;
    }
    const int e = std::min(std::max(static_cast<int>(amax >> 23) - 127 - j.emax, -127), 127);
    const __m256 dn = _mm256_set1_ps(pow2(-e)), up = _mm256_set1_ps(pow2(e));
    for (int64_t i = 0; i < n; i += 8) {
      store8(y + i, _mm256_mul_ps(round_elem8(_mm256_mul_ps(load8(x + i), dn), c), up));
    }
  }
}

template <typename T>
static void nvfp4_blocks8(const Job& j, const T* x, T* y, int64_t nblocks) {
  const Elem8 c(kE2M1), c8(kE4M3);
  const __m256 lo = _mm256_set1_ps(-6.0f), hi = _mm256_set1_ps(6.0f);
  const int64_t n = j.block;
  alignas(32) uint32_t amax[8];
  alignas(32) float recip[8], sc[8];
  for (int64_t b0 = 0; b0 < nblocks; b0 += 8) {
    const int k = static_cast<int>(std::min<int64_t>(8, nblocks - b0));
    for (int b = 0; b < k; ++b) amax[b] = absmax8(x + b * n, n);
    if (k == 8) {  // the scales of 8 blocks at once: nvfp4_scales, lane for lane
      const __m256 bs = _mm256_div_ps(_mm256_load_ps(reinterpret_cast<const float*>(amax)),
                                      _mm256_set1_ps(6.0f));
      const __m256 r = clamp8(_mm256_div_ps(bs, _mm256_set1_ps(j.pts)),
                              _mm256_set1_ps(0.015625f), _mm256_set1_ps(448.0f));
      const __m256 s8 = round_elem8(r, c8);
      _mm256_store_ps(recip, _mm256_div_ps(_mm256_set1_ps(j.inv_pts), s8));
      _mm256_store_ps(sc, _mm256_mul_ps(_mm256_set1_ps(j.pts), s8));
    } else {
      for (int b = 0; b < k; ++b) nvfp4_scales(j, amax[b], &recip[b], &sc[b]);
    }
    for (int b = 0; b < k; ++b, x += n, y += n) {
      const __m256 rb = _mm256_set1_ps(recip[b]), sb = _mm256_set1_ps(sc[b]);
      for (int64_t i = 0; i < n; i += 8) {
        const __m256 t = clamp8(_mm256_mul_ps(load8(x + i), rb), lo, hi);
        store8(y + i, _mm256_mul_ps(round_elem8(t, c), sb));
      }
    }
  }
}

// nf4_level, 8 lanes: lo = the number of levels 1..15 at most v, by binary search over the
// sorted levels (bit 3 from level 8, bit 2 from level 4 or 12, bit 1 from level i + 2, bit 0
// from level i + 1), then the nearer of levels lo and lo + 1 (one of them is the last
// level compared, the other level i or i + 2)
template <typename T>
static void nf4_blocks8(const Job& j, const T* x, T* y, int64_t nblocks) {
  const float* L = kLevels;
  const __m256 l8 = _mm256_set1_ps(L[8]), l4 = _mm256_set1_ps(L[4]), l12 = _mm256_set1_ps(L[12]);
  // indexed by i / 2 (permutevar reads an index's low 3 bits)
  const __m256 t2 = _mm256_setr_ps(L[2], 0.f, L[6], 0.f, L[10], 0.f, L[14], 0.f);  // i % 4 == 0
  const __m256 t1 = _mm256_setr_ps(L[1], L[3], L[5], L[7], L[9], L[11], L[13], L[15]);
  const __m256 e0 = _mm256_setr_ps(L[0], L[2], L[4], L[6], L[8], L[10], L[12], L[14]);
  const __m256 e2 = _mm256_setr_ps(L[2], L[4], L[6], L[8], L[10], L[12], L[14], L[15]);
  const __m256i b8 = _mm256_set1_epi32(8), b4 = _mm256_set1_epi32(4);
  const __m256i b2 = _mm256_set1_epi32(2);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const int64_t n = j.block;
  for (int64_t b = 0; b < nblocks; ++b, x += n, y += n) {
    const uint32_t amax = absmax8(x, n);
    if (amax >= 0x7F800000u || amax == 0) {
      fill(y, n, amax == 0 ? 0.0f : NAN);
      continue;
    }
    const __m256 s = _mm256_set1_ps(float_of(amax));
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 v = _mm256_div_ps(load8(x + i), s);
      const __m256 m8 = _mm256_cmp_ps(v, l8, _CMP_GE_OQ);
      __m256i k = _mm256_and_si256(_mm256_castps_si256(m8), b8);
      const __m256 m4 = _mm256_cmp_ps(v, _mm256_blendv_ps(l4, l12, m8), _CMP_GE_OQ);
      k = _mm256_or_si256(k, _mm256_and_si256(_mm256_castps_si256(m4), b4));
      const __m256 m2 = _mm256_cmp_ps(v, _mm256_permutevar8x32_ps(t2, _mm256_srli_epi32(k, 1)),
                                      _CMP_GE_OQ);
      k = _mm256_srli_epi32(_mm256_or_si256(k, _mm256_and_si256(_mm256_castps_si256(m2), b2)), 1);
      const __m256 l1 = _mm256_permutevar8x32_ps(t1, k);  // level i + 1
      const __m256 m1 = _mm256_cmp_ps(v, l1, _CMP_GE_OQ);
      const __m256 llo = _mm256_blendv_ps(_mm256_permutevar8x32_ps(e0, k), l1, m1);
      const __m256 lhi = _mm256_blendv_ps(l1, _mm256_permutevar8x32_ps(e2, k), m1);
      const __m256 dlo = _mm256_and_ps(_mm256_sub_ps(v, llo), absmask);
      const __m256 dhi = _mm256_and_ps(_mm256_sub_ps(v, lhi), absmask);
      const __m256 l = _mm256_blendv_ps(llo, lhi, _mm256_cmp_ps(dhi, dlo, _CMP_LT_OQ));
      store8(y + i, _mm256_mul_ps(l, s));
    }
  }
}
#ifdef QCOMPILE_BQ_GGML8
// llama.cpp's 32-element grids, eight lanes at a time: ggml_block_scalar's element loops,
// operation for operation (nearbyint under the current rounding mode, the same corrections,
// clampf as max then min: NaN passes through both, as through std::max / std::min). GCC
// vectorises the scalar loops for AVX-512 but not for AVX2 (their selects stay branches):
// there they ran at a twelfth of the AVX-512 speed, no faster than the baseline ISA.
static inline __m256 clamp8(__m256 v, float lo, float hi) {
  return _mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(lo), v));
}
static inline __m256 abs8(__m256 v) { return _mm256_castsi256_ps(abs_bits8(v)); }
static inline __m256 trunc_exact8(__m256 v) {  // trunc_exact
  const __m256 r = _mm256_round_ps(v, _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
  const __m256 one = _mm256_or_ps(_mm256_and_ps(v, _mm256_set1_ps(-0.0f)),
                                  _mm256_set1_ps(1.0f));  // copysign(1, v)
  return _mm256_blendv_ps(r, _mm256_sub_ps(r, one), _mm256_cmp_ps(abs8(r), abs8(v), _CMP_GT_OQ));
}
static inline __m256 roundf_exact8(__m256 v) {  // roundf_exact
  const __m256 a = abs8(v);
  const __m256 r = _mm256_round_ps(a, _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
  const __m256 half = _mm256_cmp_ps(_mm256_sub_ps(a, r), _mm256_set1_ps(0.5f), _CMP_EQ_OQ);
  const __m256 b = _mm256_blendv_ps(r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)), half);
  const __m256 neg = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ);
  return _mm256_blendv_ps(b, _mm256_sub_ps(_mm256_setzero_ps(), b), neg);
}

template <typename T>
static int64_t q8_0_elements8(const T* x, T* y, int64_t n, float id, float d16) {
  const __m256 vid = _mm256_set1_ps(id), vd = _mm256_set1_ps(d16);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 q = clamp8(roundf_exact8(_mm256_mul_ps(load8(x + i), vid)), -127.0f, 127.0f);
    store8(y + i, _mm256_mul_ps(vd, q));
  }
  return i;
}
template <typename T>
static int64_t q4_0_elements8(const T* x, T* y, int64_t n, float id, float d16) {
  const __m256 vid = _mm256_set1_ps(id), vd = _mm256_set1_ps(d16);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 t = _mm256_add_ps(_mm256_mul_ps(load8(x + i), vid), _mm256_set1_ps(8.5f));
    const __m256 q = clamp8(trunc_exact8(t), 0.0f, 15.0f);
    store8(y + i, _mm256_mul_ps(_mm256_sub_ps(q, _mm256_set1_ps(8.0f)), vd));
  }
  return i;
}
template <typename T>
static int64_t q4_1_elements8(const T* x, T* y, int64_t n, float lo, float id, float d16,
                              float m16) {
  const __m256 vlo = _mm256_set1_ps(lo), vid = _mm256_set1_ps(id);
  const __m256 vd = _mm256_set1_ps(d16), vm = _mm256_set1_ps(m16);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 t = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(load8(x + i), vlo), vid),
                                   _mm256_set1_ps(0.5f));
    const __m256 q = clamp8(trunc_exact8(t), 0.0f, 15.0f);
    store8(y + i, _mm256_add_ps(_mm256_mul_ps(vd, q), vm));
  }
  return i;
}
#undef QCOMPILE_BQ_GGML8
#endif

// -- llama.cpp's two-level grids (Q4_K, Q6_K), eight lanes at a time, both x86 variants:
// ggml_block_scalar's IEEE operations lane for lane, with each step over the sub-blocks
// (their scales, codes, 1 / scale) done for eight sub-blocks in one vector. Minima and
// maxima of finite values agree in every order up to a zero's sign, which plus0 drops as
// the scalar code does.
static inline __m256 nearbyint8(__m256 v) {  // std::nearbyint: the current rounding mode
  return _mm256_round_ps(v, _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
}
static inline __m256 plus0_8(__m256 v) {  // plus0: +0.0 for either zero
  return _mm256_andnot_ps(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_EQ_OQ), v);
}
static inline __m256 recip0_8(__m256 d) {  // recip0: 1 / d, 0 where that is infinite
  const __m256 r = _mm256_div_ps(_mm256_set1_ps(1.0f), d);
  const __m256 inf = _mm256_castsi256_ps(_mm256_set1_epi32(0x7F800000));
  return _mm256_andnot_ps(_mm256_cmp_ps(_mm256_castsi256_ps(abs_bits8(r)), inf, _CMP_EQ_OQ),
                          r);
}
static inline __m256 clamp8k(__m256 v, float lo, float hi) {  // clampf: NaN passes
  return clamp8(v, _mm256_set1_ps(lo), _mm256_set1_ps(hi));
}
static inline float hmin8(__m256 v) {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_min_ss(m, _mm_shuffle_ps(m, m, 1)));
}
static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
// the lanes of a and b (16 lanes: a's first) whose bits are m, as a bit mask
static inline unsigned hits16(__m256i a, __m256i b, __m256i m) {
  return static_cast<unsigned>(
      _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a, m))) |
      (_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(b, m))) << 8));
}
// lead_of for 16 values: the first of largest magnitude, with its sign
template <typename T>
static inline float lead16(const T* x) {
  const __m256i a = abs_bits8(load8(x)), b = abs_bits8(load8(x + 8));
  const __m256i m = _mm256_set1_epi32(static_cast<int>(hmax(_mm256_max_epi32(a, b))));
  return load_f(x, __builtin_ctz(hits16(a, b, m)));  // (a match is always there)
}

template <typename T>
static void q4_k_block8(const T* x, T* y) {  // 8 sub-blocks of 32
  alignas(32) float lo[8], hi[8], big_d[8], big_m[8], inv[8];
  for (int s = 0; s < 8; ++s) {
    __m256 l = load8(x + 32 * s), h = l;
    for (int i = 8; i < 32; i += 8) {
      const __m256 v = load8(x + 32 * s + i);
      l = _mm256_min_ps(v, l);
      h = _mm256_max_ps(v, h);
    }
    lo[s] = hmin8(l);
    hi[s] = hmax8(h);
  }
  const __m256 zero = _mm256_setzero_ps();
  const __m256 l8 = plus0_8(_mm256_min_ps(zero, _mm256_load_ps(lo)));  // min(lo, 0)
  const __m256 scale = _mm256_div_ps(_mm256_sub_ps(plus0_8(_mm256_load_ps(hi)), l8),
                                     _mm256_set1_ps(15.0f));
  const __m256 mins = _mm256_sub_ps(zero, l8);
  // (scales and mins are >= +0: their maximum is the scalar loop's from 0.0f)
  const float d = std::max(hmax8(scale), 0.0f) / 63.0f;
  const float dmin = std::max(hmax8(mins), 0.0f) / 63.0f;
  const float d16 = f16r(d), m16 = f16r(dmin), id = recip0(d), im = recip0(dmin);
  const __m256 sc = plus0_8(clamp8k(nearbyint8(_mm256_mul_ps(scale, _mm256_set1_ps(id))),
                                    0.0f, 63.0f));
  const __m256 m = plus0_8(clamp8k(nearbyint8(_mm256_mul_ps(mins, _mm256_set1_ps(im))),
                                   0.0f, 63.0f));
  const __m256 bd = _mm256_mul_ps(_mm256_set1_ps(d16), sc);
  _mm256_store_ps(big_d, bd);
  _mm256_store_ps(big_m, _mm256_mul_ps(_mm256_set1_ps(m16), m));
  _mm256_store_ps(inv, recip0_8(bd));
  for (int s = 0; s < 8; ++s) {
    const __m256 vd = _mm256_set1_ps(big_d[s]), vm = _mm256_set1_ps(big_m[s]);
    const __m256 vi = _mm256_set1_ps(inv[s]);
    for (int i = 32 * s; i < 32 * s + 32; i += 8) {
      const __m256 q = plus0_8(
          clamp8k(nearbyint8(_mm256_mul_ps(_mm256_add_ps(load8(x + i), vm), vi)), 0.0f, 15.0f));
      store8(y + i, _mm256_sub_ps(_mm256_mul_ps(vd, q), vm));
    }
  }
}

template <typename T>
static void q6_k_block8(const T* x, T* y) {  // 16 sub-blocks of 16
  alignas(32) float scale[16], big_d[16], inv[16];
  for (int s = 0; s < 16; ++s) scale[s] = lead16(x + 16 * s);
  const __m256 minus32 = _mm256_set1_ps(-32.0f);
  const __m256 s0 = _mm256_div_ps(_mm256_load_ps(scale), minus32);
  const __m256 s1 = _mm256_div_ps(_mm256_load_ps(scale + 8), minus32);
  _mm256_store_ps(scale, s0);
  _mm256_store_ps(scale + 8, s1);
  const float top = lead16(scale);
  const float iscale = inverse_scale(top, -128.0f), d16 = f16r(recip0(iscale));
  for (int h = 0; h < 2; ++h) {
    const __m256 sc = plus0_8(clamp8k(
        nearbyint8(_mm256_mul_ps(_mm256_set1_ps(iscale), h ? s1 : s0)), -128.0f, 127.0f));
    const __m256 bd = _mm256_mul_ps(_mm256_set1_ps(d16), sc);
    _mm256_store_ps(big_d + 8 * h, bd);
    _mm256_store_ps(inv + 8 * h, recip0_8(bd));
  }
  for (int s = 0; s < 16; ++s) {
    const __m256 vd = _mm256_set1_ps(big_d[s]), vi = _mm256_set1_ps(inv[s]);
    for (int i = 16 * s; i < 16 * s + 16; i += 8) {
      const __m256 q =
          plus0_8(clamp8k(nearbyint8(_mm256_mul_ps(load8(x + i), vi)), -32.0f, 31.0f));
      store8(y + i, _mm256_mul_ps(vd, q));
    }
  }
}

template <typename T>
static bool ggml32_group8(const Job& j, const T* x, T* y) {
  alignas(32) float a[8], b[8], id[8], d16[8], m16[8];
  for (int k = 0; k < 8; ++k) {  // each block's statistic: amax, lead or minimum and maximum
    const T* p = x + 32 * k;
    const __m256i v0 = abs_bits8(load8(p)), v1 = abs_bits8(load8(p + 8));
    const __m256i v2 = abs_bits8(load8(p + 16)), v3 = abs_bits8(load8(p + 24));
    const uint32_t amax =
        hmax(_mm256_max_epi32(_mm256_max_epi32(v0, v1), _mm256_max_epi32(v2, v3)));
    if (amax >= 0x7F800000u) return false;
    if (j.ggml == kQ8_0) {
      a[k] = float_of(amax);
    } else if (j.ggml == kQ4_0) {  // the lead: the first element of largest magnitude
      const __m256i m = _mm256_set1_epi32(static_cast<int>(amax));
      const unsigned hits = hits16(v0, v1, m) | (hits16(v2, v3, m) << 16);
      a[k] = load_f(p, __builtin_ctz(hits));
    } else {
      __m256 l = _mm256_min_ps(load8(p + 8), load8(p));
      __m256 h = _mm256_max_ps(load8(p + 8), load8(p));
      l = _mm256_min_ps(_mm256_min_ps(load8(p + 16), l), load8(p + 24));
      h = _mm256_max_ps(_mm256_max_ps(load8(p + 16), h), load8(p + 24));
      a[k] = hmin8(l);
      b[k] = hmax8(h);
    }
  }
  // the scales of all eight blocks: ggml_block_scalar's operations, one vector each
  __m256 d;
  if (j.ggml == kQ8_0) {
    d = _mm256_div_ps(_mm256_load_ps(a), _mm256_set1_ps(127.0f));
  } else if (j.ggml == kQ4_0) {
    d = _mm256_div_ps(_mm256_load_ps(a), _mm256_set1_ps(-8.0f));
  } else {
    const __m256 lo = plus0_8(_mm256_load_ps(a)), hi = plus0_8(_mm256_load_ps(b));
    _mm256_store_ps(a, lo);
    d = _mm256_div_ps(_mm256_sub_ps(hi, lo), _mm256_set1_ps(15.0f));
    _mm256_store_ps(m16, _mm256_cvtph_ps(_mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT)));
  }
  _mm256_store_ps(id, recip0_8(d));
  // f16r: float32 -> fp16 (round to nearest even, overflow to inf) -> float32
  _mm256_store_ps(d16, _mm256_cvtph_ps(_mm256_cvtps_ph(d, _MM_FROUND_TO_NEAREST_INT)));
  for (int k = 0; k < 8; ++k) {
    const T* p = x + 32 * k;
    T* q = y + 32 * k;
    switch (j.ggml) {
      case kQ8_0: q8_0_elements8(p, q, 32, id[k], d16[k]); break;
      case kQ4_0: q4_0_elements8(p, q, 32, id[k], d16[k]); break;
      default: q4_1_elements8(p, q, 32, a[k], id[k], d16[k], m16[k]); break;
    }
  }
  return true;
}
#endif  // QCOMPILE_BQ_AVX2

template <typename T>
static void blocks_t(const Job& j, int64_t b0, int64_t b1) {
  const int64_t n = j.block;
  const T* x = static_cast<const T*>(j.x) + b0 * n;
  T* y = static_cast<T*>(j.y) + b0 * n;
  if (j.kind == kNVFP4 && j.pts == 0.0f) {  // both scales 0: signed zeros
    for (int64_t i = 0; i < (b1 - b0) * n; ++i) {
      store_f(y, i, float_of(bits_of(load_f(x, i)) & 0x80000000u));
    }
    return;
  }
#ifdef QCOMPILE_BQ_AVX2
  if (n % 8 == 0 && j.kind != kGGML) {
    switch (j.kind) {
      case kMX: return mx_blocks8(j, x, y, b1 - b0);
      case kNVFP4: return nvfp4_blocks8(j, x, y, b1 - b0);
      case kNF4: return nf4_blocks8(j, x, y, b1 - b0);
      case kGGML: break;  // (not reached)
    }
  }
  if (j.kind == kGGML && n == 32) {  // Q8_0, Q4_0, Q4_1: eight blocks at a time
    for (; b0 + 8 <= b1; b0 += 8, x += 256, y += 256) {
      if (!ggml32_group8(j, x, y)) {
        for (int k = 0; k < 8; ++k) {
          ggml_block_scalar(j, x + 32 * k, y + 32 * k, absmax_scalar(x + 32 * k, 32));
        }
      }
    }
  }
#endif
  for (int64_t b = b0; b < b1; ++b, x += n, y += n) {
    const uint32_t amax = absmax_scalar(x, n);
    switch (j.kind) {
      case kMX: mx_block_scalar(j, x, y, amax); break;
      case kNVFP4: nvfp4_block_scalar(j, x, y, amax); break;
      case kNF4: nf4_block_scalar(j, x, y, amax); break;
      case kGGML: ggml_block_scalar(j, x, y, amax); break;
    }
  }
}

template <typename T>
static uint32_t absmax_bits_t(const Job& j, int64_t b, int64_t e) {
  const T* x = static_cast<const T*>(j.x) + b;
  const int64_t n = e - b;
  uint32_t m = 0;
  int64_t i = 0;
#ifdef QCOMPILE_BQ_AVX2
  i = n / 8 * 8;
  m = absmax8(x, i);
#endif
  return std::max(m, absmax_scalar(x + i, n - i));
}

static void blocks(const Job& j, int64_t b, int64_t e) {
  j.bf16 ? blocks_t<uint16_t>(j, b, e) : blocks_t<float>(j, b, e);
}
static uint32_t absmax_bits(const Job& j, int64_t b, int64_t e) {
  return j.bf16 ? absmax_bits_t<uint16_t>(j, b, e) : absmax_bits_t<float>(j, b, e);
}

static const KernelTable table{QCOMPILE_BQ_ISA_NAME, blocks, absmax_bits};

#endif  // QCOMPILE_BQ_KERNEL_BODY
