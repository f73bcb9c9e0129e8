// What every kernel of lollm's native library shares: step 1, the activations in int8.
//
// block_int8.cpp (int8 and Q5_0 weights) and block_kquants.cpp (Q4_0, Q5_0, Q4_K, Q6_K, Q8_0 panels)
// both multiply int8 weights by int8 activations, and both make those activations here,
// the same way, so that a row of x becomes the same codes and scales in every kernel and
// every build (docs/native-kernel.md, section 1).
//
// The functions have internal linkage (static): each build of the library (the native one
// and the test builds of the other instruction sets, lollm.native.build_variant) keeps its
// own copy, and no library can call another's.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace lollm_blocks {

constexpr int64_t kBlock = 32;  // values per activation block (and per weight group, at least)

// Step 1: x (M, K) float32 -> codes (M, K) int8 and scales (M, K / 32) float32.
// Each block: d = max|x| / 127, q = round(x / d) (ties to even); a block of zeros
// gets d = 0 and q = 0; a block holding a NaN or an infinity gets d = NaN, so that
// the outputs it touches are NaN (as a float product's would be), never a number.
static inline void quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* q, float* d) {
  const int64_t blocks = k / kBlock;
  for (int64_t i = 0; i < rows * blocks; ++i) {
    const float* xb = x + i * kBlock;
    float amax = 0.f;
    bool finite = true;
    for (int64_t j = 0; j < kBlock; ++j) {
      amax = std::max(amax, std::fabs(xb[j]));
      finite = finite && std::isfinite(xb[j]);
    }
    const float scale = finite ? amax / 127.f : NAN;
    if (!finite) amax = 0.f;
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    d[i] = scale;
    for (int64_t j = 0; j < kBlock; ++j) q[i * kBlock + j] = static_cast<int8_t>(std::nearbyint(xb[j] * inverse));
  }
}

#if defined(__AVX2__)
// 32 fifth bits of Q5_0 codes (a little-endian word: bit j for byte j) -> 32 bytes, byte j = 16
// where bit j is set, else 0: what is added to the low 4 bits to make the 5-bit code. The AVX2
// loops of both kernels unpack Q5_0 so (a scalar loop over the bits costs a decode step most
// of its time). vpshufb copies byte j / 8 of the word into byte j (within each 128-bit half,
// which holds the word four times), and each byte keeps only its own bit, 1 << (j % 8).
static inline __attribute__((always_inline)) __m256i fifth_bits(uint32_t word) {
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(int32_t(word)),
                                             _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                              2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ULL));  // byte j: 1 << (j % 8)
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}
#endif

}  // namespace lollm_blocks
