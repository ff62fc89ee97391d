// qcompile's table-lookup dequantization (CPU): what a frozen base (qcompile.runtime.frozen)
// runs in each forward and again in the backward, so it has to cost about a copy.
//
// dequant_lut4(packed, lut, scale, block): packed is uint8 [rows, cols / 2], two 4-bit codes
//   per byte, the first in the low nibble; lut float32 [16]; scale float32 [rows, cols / block].
//   out[r, c] = lut[code(r, c)] * scale[r, c / block]   (float32 [rows, cols])
// dequant_lut8(codes, lut, scale, block): codes uint8 [rows, cols], lut float32 [256]; the same.
//
// One IEEE multiply per element (built with -ffp-contract=off, no fast-math): the same bits
// as the eager torch formula it replaces (a table value, exact, times the block's scale).
// A non-finite scale gives non-finite outputs, as the eager formula does.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

namespace qcompile_dq {

using at::Tensor;

static void check(const Tensor& codes, const Tensor& lut, const Tensor& scale, int64_t block,
                  int64_t per_byte, int64_t table) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2,
              "qcompile dequant: codes must be a 2-D uint8 tensor, got ", codes.scalar_type(),
              " ", codes.sizes());
  TORCH_CHECK(lut.scalar_type() == at::kFloat && lut.numel() == table,
              "qcompile dequant: the table must be ", table, " float32 values");
  TORCH_CHECK(scale.scalar_type() == at::kFloat, "qcompile dequant: scales must be float32");
  const int64_t cols = codes.size(1) * per_byte;
  TORCH_CHECK(block > 0 && cols % block == 0 && scale.numel() == codes.size(0) * (cols / block),
              "qcompile dequant: ", codes.size(0), " rows of ", cols, " codes need ",
              cols / (block > 0 ? block : 1), " scales of blocks of ", block, " per row, got ",
              scale.sizes());
}

static Tensor lut4_cpu(const Tensor& packed_in, const Tensor& lut_in, const Tensor& scale_in,
                       int64_t block) {
  check(packed_in, lut_in, scale_in, block, 2, 16);
  const Tensor packed = packed_in.contiguous();
  const Tensor lut = lut_in.contiguous();
  const Tensor scale = scale_in.contiguous();
  const int64_t rows = packed.size(0), half = packed.size(1), cols = half * 2;
  Tensor out = at::empty({rows, cols}, packed.options().dtype(at::kFloat));
  const uint8_t* p = packed.const_data_ptr<uint8_t>();
  const float* s = scale.const_data_ptr<float>();
  float* y = out.mutable_data_ptr<float>();
  float table[16];
  for (int i = 0; i < 16; ++i) table[i] = lut.const_data_ptr<float>()[i];
  const int64_t blocks = cols / block;
  const int64_t half_block = block / 2;  // block is even for packed codes (checked by caller)
  at::parallel_for(0, rows * blocks, std::max<int64_t>(1, 16384 / block), [&](int64_t b,
                                                                               int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const float sc = s[k];
      const uint8_t* src = p + k * half_block;
      float* dst = y + k * block;
      for (int64_t i = 0; i < half_block; ++i) {
        const uint8_t v = src[i];
        dst[2 * i] = table[v & 15] * sc;
        dst[2 * i + 1] = table[v >> 4] * sc;
      }
    }
  });
  return out;
}

static Tensor lut8_cpu(const Tensor& codes_in, const Tensor& lut_in, const Tensor& scale_in,
                       int64_t block) {
  check(codes_in, lut_in, scale_in, block, 1, 256);
  const Tensor codes = codes_in.contiguous();
  const Tensor lut = lut_in.contiguous();
  const Tensor scale = scale_in.contiguous();
  const int64_t rows = codes.size(0), cols = codes.size(1);
  Tensor out = at::empty({rows, cols}, codes.options().dtype(at::kFloat));
  const uint8_t* c = codes.const_data_ptr<uint8_t>();
  const float* s = scale.const_data_ptr<float>();
  const float* table = lut.const_data_ptr<float>();
  float* y = out.mutable_data_ptr<float>();
  const int64_t blocks = cols / block;
  at::parallel_for(0, rows * blocks, std::max<int64_t>(1, 16384 / block), [&](int64_t b,
                                                                               int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const float sc = s[k];
      const uint8_t* src = c + k * block;
      float* dst = y + k * block;
      for (int64_t i = 0; i < block; ++i) dst[i] = table[src[i]] * sc;
    }
  });
  return out;
}

static Tensor lut4_meta(const Tensor& packed, const Tensor&, const Tensor&, int64_t) {
  return at::empty({packed.size(0), packed.size(1) * 2}, packed.options().dtype(at::kFloat));
}

static Tensor lut8_meta(const Tensor& codes, const Tensor&, const Tensor&, int64_t) {
  return at::empty({codes.size(0), codes.size(1)}, codes.options().dtype(at::kFloat));
}

}  // namespace qcompile_dq

// fake_quant.cpp defines the library (TORCH_LIBRARY); this file adds a fragment.
TORCH_LIBRARY_FRAGMENT(qcompile, m) {
  m.def("dequant_lut4(Tensor packed, Tensor lut, Tensor scale, int block) -> Tensor");
  m.def("dequant_lut8(Tensor codes, Tensor lut, Tensor scale, int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(qcompile, CPU, m) {
  m.impl("dequant_lut4", &qcompile_dq::lut4_cpu);
  m.impl("dequant_lut8", &qcompile_dq::lut8_cpu);
}

TORCH_LIBRARY_IMPL(qcompile, Meta, m) {
  m.impl("dequant_lut4", &qcompile_dq::lut4_meta);
  m.impl("dequant_lut8", &qcompile_dq::lut8_meta);
}
