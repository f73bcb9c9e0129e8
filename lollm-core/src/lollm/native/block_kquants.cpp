// lollm's kernels for the GGUF formats that Q4_K_M files are made of: Q4_0, Q5_0, Q4_K and Q6_K
// weights multiplied from their own bits by int8 activations, and Q8_0 on the same footing
// (Q4_0Linear, Q5_0Linear, Q4_KLinear, Q6_KLinear, Q8_0Linear in lollm/load/packed_kquants.py).
// Read it next to docs/native-kernel.md, sections 10 to 15 (a worked block for each layout).
//
// What every operator here computes, for row m of x and output channel n (the
// "canonical order"):
//
//   1. the row is cut into blocks of 32 values; each becomes 32 int8 codes xq and one
//      float32 scale xd (blocks.h, the same step 1 as block_int8.cpp);
//   2. for every block b: isum_b = the exact int32 sum of the 32 products code * xq
//      (Q6_K: sc_lo * (the sum of the first 16) + sc_hi * (the sum of the last 16),
//      its two sub-blocks' scales; still an exact int32, |isum_b| < 2^24);
//   3. acc = 0; then for b = 0, 1, 2, ... in this order:
//        acc = fma(float(isum_b), xd_b * ws_b, acc)      (xd_b * ws_b rounded to float32 first)
//        Q4_K only: acc = fma(float(xsum_b), xd_b * wo_b, acc), xsum_b the sum of the block's xq
//      and y[m, n] = acc.
//      ws_b, the block's weight scale: Q4_0, Q5_0 and Q8_0 the file's d; Q4_K d * sc_j; Q6_K the
//      super-block's d.
//      wo_b, Q4_K's block offset: -(dmin * m_j). Both products are exact in float32.
//
// Integer sums do not depend on the order they are added in, and step 3 is the same float32
// operations in the same order in all three versions below (AVX-512 VNNI, AVX2, plain C++)
// and at every row count. So a row's output is the same bits alone or in any batch, on every
// route: batch invariance (docs/batching.md).
//
// How the work is laid out: "panels" of 16 output channels. One vpdpbusd multiplies 64
// unsigned bytes by 64 signed ones and adds each 4 neighbouring products into one of 16
// int32 lanes. If lane c holds 4 codes of channel c and every lane meets the same 4
// activations (one broadcast), the instruction advances 16 channels' dot products by 4
// inputs, and after 8 of them each lane holds its channel's block sum: no lane ever has to
// be added across (a horizontal sum), and step 3 runs on 16 channels at once, lane c being
// channel c's accumulator, operation for operation the scalar step 3. So the layers keep
// the file's bits rearranged once at load into panels (nothing lost, the same bits a weight):
//
//   nibbles (P, K / 32, 256) uint8, P = ceil(N / 16), channels past N all zero.
//     Panel p, block b: 4 chunks of 64 bytes; in chunk h, byte 4c + j holds
//     channel 16p + c's code for input 32b + 8h + j in its low 4 bits and the one for
//     input 32b + 8h + 4 + j in its high 4 bits. "& 15" of a chunk gives the 16 lanes of
//     4 codes for inputs 8h .. 8h + 3; ">> 4" those for 8h + 4 .. 8h + 7.
//   high (Q6_K only) (P, K / 32, 128) uint8: the codes' top 2 bits. In chunk h (0, 1),
//     bits 2s and 2s + 1 of byte 4c + j are those of channel c's code for input
//     32b + 16h + 4s + j.
//   fifth (Q5_0 only) (P, K / 32, 64) uint8: the codes' fifth bits, 8 bytes for each group of 4
//     inputs 4v .. 4v + 3: bit 4c + j of little-endian word v is channel c's, input 32b + 4v + j.
//   codes (Q8_0 only) (P, K / 32, 512) int8, the file's codes: in chunk v (0..7) of 64 bytes,
//     byte 4c + j holds channel 16p + c's code for input 32b + 4v + j. No unpacking: a chunk
//     is the 16 lanes of 4 codes for inputs 4v .. 4v + 3 as they are.
//   scales, one per channel and block (or sub-block, or super-block): (P, count, 16),
//     the 16 channels of a panel side by side, as a vector loads them.
//
// Each block of weights, once unpacked into registers, meets a tile of rows of x (AVX-512: 16
// rows at once, or 8 and the rest; AVX2: pieces of 4); a panel's weights stay in the L1 cache
// while the next tiles of rows take their turn. Threads take whole panels (at::parallel_for): no sum is ever split between threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "blocks.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define LOLLM_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LOLLM_AVX2 1
#include <immintrin.h>
#endif

// The small per-format helpers below are called once a block inside the hot loops: always
// inlined, so that their vectors stay in registers (a call would pass them through memory).
#define LOLLM_INLINE inline __attribute__((always_inline))

namespace {

using lollm_blocks::kBlock;
using lollm_blocks::quantize_rows;

constexpr int64_t kPanel = 16;     // output channels a panel holds (the 16 int32 lanes of a 512-bit vector)
constexpr int64_t kSuper = 8;      // blocks of 32 in a K-quant super-block of 256
constexpr int64_t kRowTile = 16;   // rows of x that meet each unpacked block of weights

// ---------------------------------------------------------------------------
// Step 1, and the sums of x's codes that the formats' offsets need.
// ---------------------------------------------------------------------------

// x (M, K) as int8 codes q (M, K) and scales d (M, K / 32) (step 1), and sum16 (M, K / 16):
// the sum of each 16 codes. A code offset (Q4_0's q - 8, Q6_K's q - 32) is taken off as
// offset * sum16, and Q4_K's min term multiplies the sum of a block's 32 codes.
struct Rows {
  int64_t rows, k, blocks;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum16;
  // Each row on its own, so the rows are shared out over torch's threads (chunks of at least
  // 32768 values: a decode step's few rows stay on one); a row's codes are the same on any thread.
  explicit Rows(const at::Tensor& x)
      : rows(x.size(0)), k(x.size(1)), blocks(k / kBlock), q(rows * k), d(rows * blocks), sum16(rows * k / 16) {
    const float* values = x.data_ptr<float>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / k), [&](int64_t first, int64_t last) {
      quantize_rows(values + first * k, last - first, k, q.data() + first * k, d.data() + first * blocks);
      for (int64_t i = first * k / 16; i < last * k / 16; ++i) {
        int32_t total = 0;
        for (int64_t j = 0; j < 16; ++j) total += q[16 * i + j];
        sum16[i] = total;
      }
    });
  }
  const int8_t* codes(int64_t row, int64_t b) const { return q.data() + row * k + b * kBlock; }
  float scale(int64_t row, int64_t b) const { return d[row * blocks + b]; }
  const int32_t* sums(int64_t row, int64_t b) const { return sum16.data() + row * 2 * blocks + 2 * b; }  // the block's two
};

// ---------------------------------------------------------------------------
// The four layouts: pointers into the layers' tensors, and each weight read one at a time
// (the plain C++ version reads them so; the vector versions below unpack 16 channels at once).
// Codes are unsigned (0..15, 0..31, 0..63, Q8_0's 0..255); kCodeOffset is what the format subtracts from them.
// ---------------------------------------------------------------------------

// Channel c's code for input i (0..31) of a block of nibbles (256 bytes, the layout above).
inline int nibble_code(const uint8_t* block, int c, int i) {
  const uint8_t byte = block[64 * (i / 8) + 4 * c + i % 4];
  return (i % 8) < 4 ? byte & 15 : byte >> 4;
}

// Q4_0: w = (q - 8) * d, 32 weights a block, d float16.
struct Q4_0Panels {
  static constexpr int kCodeOffset = 8;
  static constexpr bool kBlockOffset = false;
  const uint8_t* nibbles;  // (P, K / 32, 256)
  const at::Half* d;       // (P, K / 32, 16)
  int64_t blocks;          // K / 32
  int code(int64_t p, int64_t b, int c, int i) const { return nibble_code(nibbles + (p * blocks + b) * 256, c, i); }
  int32_t isum(int64_t, int64_t, int, int32_t lo, int32_t hi) const { return lo + hi; }
  float ws(int64_t p, int64_t b, int c) const { return float(d[(p * blocks + b) * kPanel + c]); }
  float wo(int64_t, int64_t, int) const { return 0.f; }
};

// Q5_0: w = (q - 16) * d, q a 5-bit code (0..31): its low 4 bits in the nibbles, its fifth bit in
// `fifth` (P, K / 32, 64): for each of the 8 vectors u[v] of a block (inputs 4v .. 4v + 3), one
// little-endian 64-bit word whose bit 4c + j is the fifth bit of channel c's code for input 4v + j,
// the byte of u[v] it belongs to. d float16 per block of 32, the file's.
struct Q5_0Panels {
  static constexpr int kCodeOffset = 16;
  static constexpr bool kBlockOffset = false;
  const uint8_t* nibbles;  // (P, K / 32, 256)
  const uint8_t* fifth;    // (P, K / 32, 64)
  const at::Half* d;       // (P, K / 32, 16)
  int64_t blocks;
  int code(int64_t p, int64_t b, int c, int i) const {
    const int bit = 4 * c + i % 4;
    const uint8_t byte = fifth[(p * blocks + b) * 64 + 8 * (i / 4) + bit / 8];
    return nibble_code(nibbles + (p * blocks + b) * 256, c, i) | ((byte >> (bit % 8)) & 1) << 4;
  }
  int32_t isum(int64_t, int64_t, int, int32_t lo, int32_t hi) const { return lo + hi; }
  float ws(int64_t p, int64_t b, int c) const { return float(d[(p * blocks + b) * kPanel + c]); }
  float wo(int64_t, int64_t, int) const { return 0.f; }
};

// Q4_K: w = (d * sc_j) * q - (dmin * m_j), 8 blocks of 32 a super-block; sc_j, m_j 6-bit (kept
// as uint8), d and dmin float16 per super-block. ws = d * sc_j and wo = -(dmin * m_j), exact.
struct Q4_KPanels {
  static constexpr int kCodeOffset = 0;
  static constexpr bool kBlockOffset = true;
  const uint8_t* nibbles;    // (P, K / 32, 256)
  const uint8_t* sc;         // (P, K / 32, 16)
  const uint8_t* m;          // (P, K / 32, 16)
  const at::Half* d;         // (P, K / 256, 16)
  const at::Half* dmin;      // (P, K / 256, 16)
  int64_t blocks;
  int code(int64_t p, int64_t b, int c, int i) const { return nibble_code(nibbles + (p * blocks + b) * 256, c, i); }
  int32_t isum(int64_t, int64_t, int, int32_t lo, int32_t hi) const { return lo + hi; }
  float ws(int64_t p, int64_t b, int c) const {
    return float(d[(p * blocks / kSuper + b / kSuper) * kPanel + c]) * float(sc[(p * blocks + b) * kPanel + c]);
  }
  float wo(int64_t p, int64_t b, int c) const {
    return -(float(dmin[(p * blocks / kSuper + b / kSuper) * kPanel + c]) * float(m[(p * blocks + b) * kPanel + c]));
  }
};

// Q6_K: w = (d * sc_j) * (q - 32), 16 sub-blocks of 16 a super-block of 256; q 6-bit (4 low
// bits in the nibbles, 2 high bits in `high`), sc_j int8, d float16 per super-block. A block of
// 32 holds two sub-blocks: isum = sc_lo * (sum of the first 16) + sc_hi * (sum of the last 16).
struct Q6_KPanels {
  static constexpr int kCodeOffset = 32;
  static constexpr bool kBlockOffset = false;
  const uint8_t* nibbles;  // (P, K / 32, 256)
  const uint8_t* high;     // (P, K / 32, 128)
  const int8_t* sc;        // (P, K / 16, 16)
  const at::Half* d;       // (P, K / 256, 16)
  int64_t blocks;
  int code(int64_t p, int64_t b, int c, int i) const {
    const uint8_t byte = high[(p * blocks + b) * 128 + 64 * (i / 16) + 4 * c + i % 4];
    return nibble_code(nibbles + (p * blocks + b) * 256, c, i) | ((byte >> (2 * ((i % 16) / 4))) & 3) << 4;
  }
  int32_t isum(int64_t p, int64_t b, int c, int32_t lo, int32_t hi) const {
    const int8_t* s = sc + (p * 2 * blocks + 2 * b) * kPanel + c;
    return int32_t(s[0]) * lo + int32_t(s[kPanel]) * hi;
  }
  float ws(int64_t p, int64_t b, int c) const { return float(d[(p * blocks / kSuper + b / kSuper) * kPanel + c]); }
  float wo(int64_t, int64_t, int) const { return 0.f; }
};

// Q8_0: w = q * d, q an int8 code (-128..127), d float16 per block of 32. The instructions
// below multiply unsigned bytes by signed ones, so a code is read as the unsigned q + 128
// (q xor 0x80: the same bits with the top one flipped) and kCodeOffset = 128 takes
// 128 * sum(xq) back off: sum((q + 128) * xq) - 128 * sum(xq) = sum(q * xq), exactly.
struct Q8_0Panels {
  static constexpr int kCodeOffset = 128;
  static constexpr bool kBlockOffset = false;
  const int8_t* codes;  // (P, K / 32, 512)
  const at::Half* d;    // (P, K / 32, 16)
  int64_t blocks;
  int code(int64_t p, int64_t b, int c, int i) const { return codes[(p * blocks + b) * 512 + 64 * (i / 4) + 4 * c + i % 4] + 128; }
  int32_t isum(int64_t, int64_t, int, int32_t lo, int32_t hi) const { return lo + hi; }
  float ws(int64_t p, int64_t b, int c) const { return float(d[(p * blocks + b) * kPanel + c]); }
  float wo(int64_t, int64_t, int) const { return 0.f; }
};

// Software prefetch: ask for the weights of the block kAhead blocks further on while this one
// is multiplied. The panels are one stream ((p, b) in order), so the address past a panel's
// last block is the next panel's first; a prefetch never faults, even past the tensor's end.
// Without it a many-row call of a large matrix (the output head) waits on memory half the time.
constexpr int64_t kAhead = 4;          // blocks ahead (2 KB of Q8_0, 1.4 KB of Q5_0)
constexpr int kPrefetchMinRows = 2;    // a lone row streams at the memory's pace without it
// The address is made as an integer: a pointer past the tensor's end would be undefined C++.
inline void prefetch_lines(const void* base, int64_t offset, int lines) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(base) + uintptr_t(offset);
  for (int line = 0; line < lines; ++line) __builtin_prefetch(reinterpret_cast<const void*>(at + 64 * line), 0, 3);
}
inline int64_t ahead(int64_t blocks, int64_t p, int64_t b) { return p * blocks + b + kAhead; }
inline void prefetch(const Q4_0Panels& w, int64_t p, int64_t b) { prefetch_lines(w.nibbles, ahead(w.blocks, p, b) * 256, 4); }
inline void prefetch(const Q4_KPanels& w, int64_t p, int64_t b) { prefetch_lines(w.nibbles, ahead(w.blocks, p, b) * 256, 4); }
inline void prefetch(const Q5_0Panels& w, int64_t p, int64_t b) {
  prefetch_lines(w.nibbles, ahead(w.blocks, p, b) * 256, 4);
  prefetch_lines(w.fifth, ahead(w.blocks, p, b) * 64, 1);
}
inline void prefetch(const Q6_KPanels& w, int64_t p, int64_t b) {
  prefetch_lines(w.nibbles, ahead(w.blocks, p, b) * 256, 4);
  prefetch_lines(w.high, ahead(w.blocks, p, b) * 128, 2);
}
inline void prefetch(const Q8_0Panels& w, int64_t p, int64_t b) { prefetch_lines(w.codes, ahead(w.blocks, p, b) * 512, 8); }

#if defined(LOLLM_AVX512)
// ---------------------------------------------------------------------------
// Steps 2 and 3 with AVX-512 VNNI: a panel's 16 channels in the 16 lanes of each vector.
// ---------------------------------------------------------------------------

// 4 activation codes as one int32, to be broadcast to every lane.
LOLLM_INLINE __m512i four(const int8_t* xq) {
  int32_t word;
  std::memcpy(&word, xq, 4);
  return _mm512_set1_epi32(word);
}

// A block of nibbles (256 bytes) -> u[v], v = 0..7: lane c holds channel c's codes for inputs 4v .. 4v + 3.
LOLLM_INLINE void unpack_nibbles(const uint8_t* block, __m512i* u) {
  const __m512i low4 = _mm512_set1_epi8(15);
  for (int h = 0; h < 4; ++h) {
    const __m512i v = _mm512_loadu_si512(block + 64 * h);
    u[2 * h] = _mm512_and_si512(v, low4);
    u[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  }
}

// 16 float16 values (one per channel) as float32: exact.
LOLLM_INLINE __m512 halves(const at::Half* h) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}
// 16 unsigned bytes as float32.
LOLLM_INLINE __m512 bytes_as_float(const uint8_t* v) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v))));
}

LOLLM_INLINE void unpack(const Q4_0Panels& w, int64_t p, int64_t b, __m512i* u) { unpack_nibbles(w.nibbles + (p * w.blocks + b) * 256, u); }
LOLLM_INLINE void unpack(const Q4_KPanels& w, int64_t p, int64_t b, __m512i* u) { unpack_nibbles(w.nibbles + (p * w.blocks + b) * 256, u); }
// Q5_0: the nibbles, then 16 added to each byte whose fifth bit is set: the block's 8 words of
// `fifth` are the masks, one per vector, bit 4c + j for byte 4c + j (one masked add each).
LOLLM_INLINE void unpack(const Q5_0Panels& w, int64_t p, int64_t b, __m512i* u) {
  unpack_nibbles(w.nibbles + (p * w.blocks + b) * 256, u);
  const uint8_t* block = w.fifth + (p * w.blocks + b) * 64;
  const __m512i sixteen = _mm512_set1_epi8(16);
  for (int v = 0; v < 8; ++v) {
    uint64_t bits;
    std::memcpy(&bits, block + 8 * v, 8);
    u[v] = _mm512_mask_add_epi8(u[v], __mmask64(bits), u[v], sixteen);
  }
}
// Q8_0: the 8 chunks as they are, each code made unsigned (xor 0x80 = q + 128, kCodeOffset).
LOLLM_INLINE void unpack(const Q8_0Panels& w, int64_t p, int64_t b, __m512i* u) {
  const __m512i top = _mm512_set1_epi8(char(0x80));
  const int8_t* block = w.codes + (p * w.blocks + b) * 512;
  for (int v = 0; v < 8; ++v) u[v] = _mm512_xor_si512(_mm512_loadu_si512(block + 64 * v), top);
}
// Q6_K: the nibbles, then each code's 2 high bits moved to bits 4 and 5 and added in: crumb s of
// chunk h belongs to u[4h + s] (inputs 16h + 4s ..). Shifting 16-bit lanes and keeping bits 4-5
// of each byte (0x30) leaves nothing of the neighbouring byte.
LOLLM_INLINE void unpack(const Q6_KPanels& w, int64_t p, int64_t b, __m512i* u) {
  unpack_nibbles(w.nibbles + (p * w.blocks + b) * 256, u);
  const __m512i bits45 = _mm512_set1_epi8(0x30);
  const uint8_t* block = w.high + (p * w.blocks + b) * 128;
  for (int h = 0; h < 2; ++h) {
    const __m512i v = _mm512_loadu_si512(block + 64 * h);
    // u | (shifted & 0x30) in one instruction: vpternlogd's truth table 0xF8 is A | (B & C).
    u[4 * h + 0] = _mm512_ternarylogic_epi32(u[4 * h + 0], _mm512_slli_epi16(v, 4), bits45, 0xF8);
    u[4 * h + 1] = _mm512_ternarylogic_epi32(u[4 * h + 1], _mm512_slli_epi16(v, 2), bits45, 0xF8);
    u[4 * h + 2] = _mm512_ternarylogic_epi32(u[4 * h + 2], v, bits45, 0xF8);
    u[4 * h + 3] = _mm512_ternarylogic_epi32(u[4 * h + 3], _mm512_srli_epi16(v, 2), bits45, 0xF8);
  }
}

LOLLM_INLINE __m512 ws(const Q4_0Panels& w, int64_t p, int64_t b) { return halves(w.d + (p * w.blocks + b) * kPanel); }
LOLLM_INLINE __m512 ws(const Q8_0Panels& w, int64_t p, int64_t b) { return halves(w.d + (p * w.blocks + b) * kPanel); }
LOLLM_INLINE __m512 ws(const Q5_0Panels& w, int64_t p, int64_t b) { return halves(w.d + (p * w.blocks + b) * kPanel); }
LOLLM_INLINE __m512 ws(const Q4_KPanels& w, int64_t p, int64_t b) {
  return _mm512_mul_ps(halves(w.d + (p * w.blocks / kSuper + b / kSuper) * kPanel), bytes_as_float(w.sc + (p * w.blocks + b) * kPanel));
}
LOLLM_INLINE __m512 ws(const Q6_KPanels& w, int64_t p, int64_t b) { return halves(w.d + (p * w.blocks / kSuper + b / kSuper) * kPanel); }

// Q4_K's -(dmin * m_j): the product, its sign flipped (as the scalar unary minus does).
LOLLM_INLINE __m512 wo(const Q4_KPanels& w, int64_t p, int64_t b) {
  const __m512 product = _mm512_mul_ps(halves(w.dmin + (p * w.blocks / kSuper + b / kSuper) * kPanel), bytes_as_float(w.m + (p * w.blocks + b) * kPanel));
  return _mm512_xor_ps(product, _mm512_set1_ps(-0.f));
}
template <class F>
LOLLM_INLINE __m512 wo(const F&, int64_t, int64_t) { return _mm512_setzero_ps(); }

LOLLM_INLINE __m512i isum(const Q4_0Panels&, int64_t, int64_t, __m512i lo, __m512i hi) { return _mm512_add_epi32(lo, hi); }
LOLLM_INLINE __m512i isum(const Q8_0Panels&, int64_t, int64_t, __m512i lo, __m512i hi) { return _mm512_add_epi32(lo, hi); }
LOLLM_INLINE __m512i isum(const Q5_0Panels&, int64_t, int64_t, __m512i lo, __m512i hi) { return _mm512_add_epi32(lo, hi); }
LOLLM_INLINE __m512i isum(const Q4_KPanels&, int64_t, int64_t, __m512i lo, __m512i hi) { return _mm512_add_epi32(lo, hi); }
LOLLM_INLINE __m512i isum(const Q6_KPanels& w, int64_t p, int64_t b, __m512i lo, __m512i hi) {
  const int8_t* s = w.sc + (p * 2 * w.blocks + 2 * b) * kPanel;
  const __m512i sc_lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  const __m512i sc_hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + kPanel)));
  return _mm512_add_epi32(_mm512_mullo_epi32(sc_lo, lo), _mm512_mullo_epi32(sc_hi, hi));
}

// Panel p against rows r0 .. r0 + R - 1: out[row, 16p + c] for the channels below n.
// Each block: unpacked once (8 vectors of 16 channels x 4 codes), then for every row two
// chains of 4 vpdpbusd (the block's halves, started at -offset * their code sums), the
// format's isum, and step 3 in each lane.
template <class F, int R>
void panel_rows(const F& w, int64_t p, const Rows& x, int64_t r0, int64_t n, float* out) {
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    __m512i u[8];
    if (R >= kPrefetchMinRows) prefetch(w, p, b);
    unpack(w, p, b, u);
    const __m512 w_scale = ws(w, p, b), w_offset = wo(w, p, b);
    for (int i = 0; i < R; ++i) {
      const int8_t* xq = x.codes(r0 + i, b);
      const int32_t* xs = x.sums(r0 + i, b);
      __m512i lo = _mm512_set1_epi32(-F::kCodeOffset * xs[0]), hi = _mm512_set1_epi32(-F::kCodeOffset * xs[1]);
      for (int v = 0; v < 4; ++v) {
        lo = _mm512_dpbusd_epi32(lo, u[v], four(xq + 4 * v));
        hi = _mm512_dpbusd_epi32(hi, u[4 + v], four(xq + 16 + 4 * v));
      }
      const __m512 xd = _mm512_set1_ps(x.scale(r0 + i, b));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum(w, p, b, lo, hi)), _mm512_mul_ps(xd, w_scale), acc[i]);
      if (F::kBlockOffset)
        acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(float(xs[0] + xs[1])), _mm512_mul_ps(xd, w_offset), acc[i]);
    }
  }
  const int64_t c0 = p * kPanel, present = std::min(kPanel, n - c0);
  for (int i = 0; i < R; ++i) _mm512_mask_storeu_ps(out + (r0 + i) * n + c0, __mmask16((1u << present) - 1), acc[i]);
}

template <class F>
void panel_tile(const F& w, int64_t p, const Rows& x, int64_t r0, int64_t take, int64_t n, float* out) {
  if (take == 16) {
    panel_rows<F, 16>(w, p, x, r0, n, out);
    return;
  }
  if (take > 8) {  // 9 to 15 rows: the first 8, then the rest
    panel_rows<F, 8>(w, p, x, r0, n, out);
    panel_tile(w, p, x, r0 + 8, take - 8, n, out);
    return;
  }
  if (take == 8) panel_rows<F, 8>(w, p, x, r0, n, out);
  if (take == 7) panel_rows<F, 7>(w, p, x, r0, n, out);
  if (take == 6) panel_rows<F, 6>(w, p, x, r0, n, out);
  if (take == 5) panel_rows<F, 5>(w, p, x, r0, n, out);
  if (take == 4) panel_rows<F, 4>(w, p, x, r0, n, out);
  if (take == 3) panel_rows<F, 3>(w, p, x, r0, n, out);
  if (take == 2) panel_rows<F, 2>(w, p, x, r0, n, out);
  if (take == 1) panel_rows<F, 1>(w, p, x, r0, n, out);
}

#elif defined(LOLLM_AVX2)
// ---------------------------------------------------------------------------
// Steps 2 and 3 with AVX2: 8 lanes to a vector, so a panel is done in two halves of 8 channels
// (the first 32 bytes of each 64-byte chunk are channels 0-7, the last 32 channels 8-15).
// vpmaddubsw multiplies unsigned codes by signed activations and adds pairs into int16 (at
// most 2 * 63 * 127: no saturation), vpmaddwd adds those pairs into the int32 lanes.
// ---------------------------------------------------------------------------

LOLLM_INLINE __m256i four(const int8_t* xq) {
  int32_t word;
  std::memcpy(&word, xq, 4);
  return _mm256_set1_epi32(word);
}

LOLLM_INLINE __m256i dot4(__m256i u, __m256i x4) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x4), _mm256_set1_epi16(1));
}

// Q8_0 is the exception on this route: its unsigned codes q + 128 reach 255, and a pair of
// 255 * 127 does not fit vpmaddubsw's int16 (it would saturate). So here Q8_0 keeps its signed
// codes (unpack below leaves them as they are, and nothing is taken off: kAvx2Offset = 0), and
// each product q * x is made as |q| * (x with q's sign) (vpsignb): |q| <= 128 as an unsigned
// byte, |x| <= 127, a pair at most 32512. The same exact int32 sums as every other route.
template <class F>
constexpr int kAvx2Offset = F::kCodeOffset;
template <>
constexpr int kAvx2Offset<Q8_0Panels> = 0;

template <class F>
LOLLM_INLINE __m256i dot(const F&, __m256i u, __m256i x4) { return dot4(u, x4); }
LOLLM_INLINE __m256i dot(const Q8_0Panels&, __m256i q, __m256i x4) { return dot4(_mm256_abs_epi8(q), _mm256_sign_epi8(x4, q)); }

// Several rows are compute-bound on this route (two instructions a product where VNNI has one),
// so the pairs vpmaddubsw makes are first added in int16 as far as they cannot overflow, and only
// their total goes through vpmaddwd: a pair is at most 2 * 15 * 127 = 3810 (4-bit codes) or
// 2 * 31 * 127 = 7874 (Q5_0), so four of them fit an int16 (at most 31496 <= 32767); a 6-bit
// pair reaches 16002, so Q6_K adds two; Q8_0's 32512 none. The int32 sums are the same exact
// integers as before: an integer sum does not depend on the order it is added in.
template <class F>
constexpr int kInt16Pairs = 4;
template <>
constexpr int kInt16Pairs<Q6_KPanels> = 2;
template <>
constexpr int kInt16Pairs<Q8_0Panels> = 1;

// The exact int32 sum, per lane, of 4 vectors u[0..3] of codes (16 inputs) times x's codes xq.
template <class F>
LOLLM_INLINE __m256i dot16(const F& w, const __m256i* u, const int8_t* xq) {
  if constexpr (kInt16Pairs<F> == 1) {
    __m256i sum = dot(w, u[0], four(xq));
    for (int v = 1; v < 4; ++v) sum = _mm256_add_epi32(sum, dot(w, u[v], four(xq + 4 * v)));
    return sum;
  } else {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i first = _mm256_add_epi16(_mm256_maddubs_epi16(u[0], four(xq)), _mm256_maddubs_epi16(u[1], four(xq + 4)));
    const __m256i second = _mm256_add_epi16(_mm256_maddubs_epi16(u[2], four(xq + 8)), _mm256_maddubs_epi16(u[3], four(xq + 12)));
    if constexpr (kInt16Pairs<F> == 4) return _mm256_madd_epi16(_mm256_add_epi16(first, second), ones);
    return _mm256_add_epi32(_mm256_madd_epi16(first, ones), _mm256_madd_epi16(second, ones));
  }
}

LOLLM_INLINE void unpack_nibbles(const uint8_t* block, int half, __m256i* u) {
  const __m256i low4 = _mm256_set1_epi8(15);
  for (int h = 0; h < 4; ++h) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h + 32 * half));
    u[2 * h] = _mm256_and_si256(v, low4);
    u[2 * h + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  }
}

LOLLM_INLINE __m256 halves(const at::Half* h) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h))); }
LOLLM_INLINE __m256i bytes8(const uint8_t* v) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(v))); }

LOLLM_INLINE void unpack(const Q4_0Panels& w, int64_t p, int64_t b, int half, __m256i* u) { unpack_nibbles(w.nibbles + (p * w.blocks + b) * 256, half, u); }
LOLLM_INLINE void unpack(const Q4_KPanels& w, int64_t p, int64_t b, int half, __m256i* u) { unpack_nibbles(w.nibbles + (p * w.blocks + b) * 256, half, u); }
// Q5_0: the nibbles, then the fifth bits of this half's 8 channels (bytes 0-31 of each vector:
// the low 32 bits of each mask word, or the high 32 for channels 8-15) added in as 16.
LOLLM_INLINE void unpack(const Q5_0Panels& w, int64_t p, int64_t b, int half, __m256i* u) {
  unpack_nibbles(w.nibbles + (p * w.blocks + b) * 256, half, u);
  const uint8_t* block = w.fifth + (p * w.blocks + b) * 64;
  for (int v = 0; v < 8; ++v) {
    uint32_t bits;
    std::memcpy(&bits, block + 8 * v + 4 * half, 4);
    u[v] = _mm256_or_si256(u[v], lollm_blocks::fifth_bits(bits));
  }
}
// Q8_0: the signed codes as they are (see dot above), chunk v's half for 8 channels.
LOLLM_INLINE void unpack(const Q8_0Panels& w, int64_t p, int64_t b, int half, __m256i* u) {
  const int8_t* block = w.codes + (p * w.blocks + b) * 512;
  for (int v = 0; v < 8; ++v) u[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * v + 32 * half));
}
LOLLM_INLINE void unpack(const Q6_KPanels& w, int64_t p, int64_t b, int half, __m256i* u) {
  unpack_nibbles(w.nibbles + (p * w.blocks + b) * 256, half, u);
  const __m256i bits45 = _mm256_set1_epi8(0x30);
  const uint8_t* block = w.high + (p * w.blocks + b) * 128;
  for (int h = 0; h < 2; ++h) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h + 32 * half));
    u[4 * h + 0] = _mm256_or_si256(u[4 * h + 0], _mm256_and_si256(_mm256_slli_epi16(v, 4), bits45));
    u[4 * h + 1] = _mm256_or_si256(u[4 * h + 1], _mm256_and_si256(_mm256_slli_epi16(v, 2), bits45));
    u[4 * h + 2] = _mm256_or_si256(u[4 * h + 2], _mm256_and_si256(v, bits45));
    u[4 * h + 3] = _mm256_or_si256(u[4 * h + 3], _mm256_and_si256(_mm256_srli_epi16(v, 2), bits45));
  }
}

LOLLM_INLINE __m256 ws(const Q4_0Panels& w, int64_t p, int64_t b, int half) { return halves(w.d + (p * w.blocks + b) * kPanel + 8 * half); }
LOLLM_INLINE __m256 ws(const Q8_0Panels& w, int64_t p, int64_t b, int half) { return halves(w.d + (p * w.blocks + b) * kPanel + 8 * half); }
LOLLM_INLINE __m256 ws(const Q5_0Panels& w, int64_t p, int64_t b, int half) { return halves(w.d + (p * w.blocks + b) * kPanel + 8 * half); }
LOLLM_INLINE __m256 ws(const Q4_KPanels& w, int64_t p, int64_t b, int half) {
  return _mm256_mul_ps(halves(w.d + (p * w.blocks / kSuper + b / kSuper) * kPanel + 8 * half),
                       _mm256_cvtepi32_ps(bytes8(w.sc + (p * w.blocks + b) * kPanel + 8 * half)));
}
LOLLM_INLINE __m256 ws(const Q6_KPanels& w, int64_t p, int64_t b, int half) { return halves(w.d + (p * w.blocks / kSuper + b / kSuper) * kPanel + 8 * half); }

LOLLM_INLINE __m256 wo(const Q4_KPanels& w, int64_t p, int64_t b, int half) {
  const __m256 product = _mm256_mul_ps(halves(w.dmin + (p * w.blocks / kSuper + b / kSuper) * kPanel + 8 * half),
                                       _mm256_cvtepi32_ps(bytes8(w.m + (p * w.blocks + b) * kPanel + 8 * half)));
  return _mm256_xor_ps(product, _mm256_set1_ps(-0.f));
}
template <class F>
LOLLM_INLINE __m256 wo(const F&, int64_t, int64_t, int) { return _mm256_setzero_ps(); }

LOLLM_INLINE __m256i isum(const Q4_0Panels&, int64_t, int64_t, int, __m256i lo, __m256i hi) { return _mm256_add_epi32(lo, hi); }
LOLLM_INLINE __m256i isum(const Q8_0Panels&, int64_t, int64_t, int, __m256i lo, __m256i hi) { return _mm256_add_epi32(lo, hi); }
LOLLM_INLINE __m256i isum(const Q5_0Panels&, int64_t, int64_t, int, __m256i lo, __m256i hi) { return _mm256_add_epi32(lo, hi); }
LOLLM_INLINE __m256i isum(const Q4_KPanels&, int64_t, int64_t, int, __m256i lo, __m256i hi) { return _mm256_add_epi32(lo, hi); }
LOLLM_INLINE __m256i isum(const Q6_KPanels& w, int64_t p, int64_t b, int half, __m256i lo, __m256i hi) {
  const int8_t* s = w.sc + (p * 2 * w.blocks + 2 * b) * kPanel + 8 * half;
  const __m256i sc_lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)));
  const __m256i sc_hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + kPanel)));
  return _mm256_add_epi32(_mm256_mullo_epi32(sc_lo, lo), _mm256_mullo_epi32(sc_hi, hi));
}

// One half (8 channels) of panel p against rows r0 .. r0 + R - 1, as the AVX-512 version.
template <class F, int R>
void half_rows(const F& w, int64_t p, int half, const Rows& x, int64_t r0, int64_t n, float* out) {
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.blocks; ++b) {
    __m256i u[8];
    if (R >= kPrefetchMinRows) prefetch(w, p, b);
    unpack(w, p, b, half, u);
    const __m256 w_scale = ws(w, p, b, half), w_offset = wo(w, p, b, half);
    for (int i = 0; i < R; ++i) {
      const int8_t* xq = x.codes(r0 + i, b);
      const int32_t* xs = x.sums(r0 + i, b);
      const __m256i lo = _mm256_add_epi32(_mm256_set1_epi32(-kAvx2Offset<F> * xs[0]), dot16(w, u, xq));
      const __m256i hi = _mm256_add_epi32(_mm256_set1_epi32(-kAvx2Offset<F> * xs[1]), dot16(w, u + 4, xq + 16));
      const __m256 xd = _mm256_set1_ps(x.scale(r0 + i, b));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum(w, p, b, half, lo, hi)), _mm256_mul_ps(xd, w_scale), acc[i]);
      if (F::kBlockOffset)
        acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(float(xs[0] + xs[1])), _mm256_mul_ps(xd, w_offset), acc[i]);
    }
  }
  const int64_t c0 = p * kPanel + 8 * half, present = std::min<int64_t>(8, n - c0);
  if (present <= 0) return;
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(present)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int i = 0; i < R; ++i) _mm256_maskstore_ps(out + (r0 + i) * n + c0, mask, acc[i]);
}

// AVX2 has 16 vector registers: a tile of up to 16 rows is done in pieces of up to 4.
template <class F>
void panel_tile(const F& w, int64_t p, const Rows& x, int64_t r0, int64_t take, int64_t n, float* out) {
  for (int half = 0; half < 2; ++half)
    for (int64_t r = r0; r < r0 + take; r += 4) {
      const int64_t piece = std::min<int64_t>(4, r0 + take - r);
      if (piece == 4) half_rows<F, 4>(w, p, half, x, r, n, out);
      if (piece == 3) half_rows<F, 3>(w, p, half, x, r, n, out);
      if (piece == 2) half_rows<F, 2>(w, p, half, x, r, n, out);
      if (piece == 1) half_rows<F, 1>(w, p, half, x, r, n, out);
    }
}

#else
// ---------------------------------------------------------------------------
// Steps 2 and 3 in plain C++: each block unpacked to 16 x 32 codes, then every row of the
// tile and every channel in turn. The same integer sums and the same step 3 as the vector
// versions (std::fma is one rounding, as vfmadd is).
// ---------------------------------------------------------------------------
template <class F>
void panel_tile(const F& w, int64_t p, const Rows& x, int64_t r0, int64_t take, int64_t n, float* out) {
  float acc[kRowTile][kPanel] = {};
  uint8_t codes[kPanel][kBlock];
  for (int64_t b = 0; b < x.blocks; ++b) {
    for (int c = 0; c < kPanel; ++c)
      for (int i = 0; i < kBlock; ++i) codes[c][i] = uint8_t(w.code(p, b, c, i));
    for (int64_t r = 0; r < take; ++r) {
      const int8_t* xq = x.codes(r0 + r, b);
      const int32_t* xs = x.sums(r0 + r, b);
      const float xd = x.scale(r0 + r, b);
      for (int c = 0; c < kPanel; ++c) {
        int32_t lo = -F::kCodeOffset * xs[0], hi = -F::kCodeOffset * xs[1];
        for (int i = 0; i < 16; ++i) lo += int32_t(codes[c][i]) * xq[i];
        for (int i = 16; i < kBlock; ++i) hi += int32_t(codes[c][i]) * xq[i];
        acc[r][c] = std::fma(float(w.isum(p, b, c, lo, hi)), xd * w.ws(p, b, c), acc[r][c]);
        if (F::kBlockOffset) acc[r][c] = std::fma(float(xs[0] + xs[1]), xd * w.wo(p, b, c), acc[r][c]);
      }
    }
  }
  const int64_t c0 = p * kPanel, present = std::min(kPanel, n - c0);
  for (int64_t r = 0; r < take; ++r)
    for (int64_t c = 0; c < present; ++c) out[(r0 + r) * n + c0 + c] = acc[r][c];
}
#endif

// Steps 1 to 3 for a whole call: x quantized once, then every panel over torch's threads
// (whole panels to a thread), each panel meeting the rows a tile at a time.
template <class F>
at::Tensor run_panels(const F& w, const at::Tensor& x, int64_t panels, int64_t n) {
  const Rows rows(x);
  at::Tensor y = at::empty({rows.rows, n}, x.options());
  float* out = y.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p)
      for (int64_t r0 = 0; r0 < rows.rows; r0 += kRowTile) panel_tile(w, p, rows, r0, std::min(kRowTile, rows.rows - r0), n, out);
  });
  return y;
}

// ---------------------------------------------------------------------------
// The operators: every input checked, named in the error with its expected shape and dtype.
// ---------------------------------------------------------------------------

void check_x(const char* op, const at::Tensor& x, int64_t multiple) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              op, ": x must be a contiguous float32 CPU matrix (M, K), got ", x.scalar_type(), " ", x.sizes(),
              x.is_contiguous() ? "" : " (not contiguous)", x.device().is_cpu() ? "" : " (not on the CPU)");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) % multiple == 0, op, ": x has ", x.size(1), " columns, not a positive multiple of ", multiple);
}

// `name` must be a contiguous CPU tensor of `dtype` and shape (panels, count, width).
void check_part(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t panels, int64_t count, int64_t width) {
  TORCH_CHECK(t.scalar_type() == dtype && t.dim() == 3 && t.size(0) == panels && t.size(1) == count && t.size(2) == width &&
                  t.is_contiguous() && t.device().is_cpu(),
              op, ": ", name, " must be contiguous ", dtype, " (", panels, ", ", count, ", ", width, ") on the CPU, got ",
              t.scalar_type(), " ", t.sizes(), t.is_contiguous() ? "" : " (not contiguous)");
}

// The panels' count from the codes' tensor (`name`: the nibbles, or Q8_0's codes, `width` bytes a
// panel and block), and n checked against it: the last panel holds 1 to 16 channels.
int64_t check_panels(const char* op, const char* name, const at::Tensor& codes, at::ScalarType dtype, int64_t width,
                     int64_t k, int64_t n) {
  const int64_t panels = codes.dim() == 3 ? codes.size(0) : -1;
  check_part(op, name, codes, dtype, panels, k / kBlock, width);
  TORCH_CHECK(panels > 0 && n > kPanel * (panels - 1) && n <= kPanel * panels,
              op, ": ", n, " output channels do not fill ", panels, " panels of 16 (the last one 1 to 16 of them)");
  return panels;
}

// y (M, n) = x (M, K) @ w.T for a Q4_0 matrix in panels: w = (q - 8) * d.
at::Tensor block_q4_0_linear(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& d, int64_t n) {
  const char* op = "block_q4_0_linear";
  check_x(op, x, kBlock);
  const int64_t k = x.size(1), panels = check_panels(op, "nibbles", nibbles, at::kByte, 256, k, n);
  check_part(op, "d", d, at::kHalf, panels, k / kBlock, kPanel);
  const Q4_0Panels w{nibbles.data_ptr<uint8_t>(), d.data_ptr<at::Half>(), k / kBlock};
  return run_panels(w, x, panels, n);
}

// y (M, n) = x (M, K) @ w.T for a Q5_0 matrix in panels: w = (q - 16) * d.
at::Tensor block_q5_0_linear(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& fifth, const at::Tensor& d, int64_t n) {
  const char* op = "block_q5_0_linear";
  check_x(op, x, kBlock);
  const int64_t k = x.size(1), panels = check_panels(op, "nibbles", nibbles, at::kByte, 256, k, n);
  check_part(op, "fifth", fifth, at::kByte, panels, k / kBlock, 64);
  check_part(op, "d", d, at::kHalf, panels, k / kBlock, kPanel);
  const Q5_0Panels w{nibbles.data_ptr<uint8_t>(), fifth.data_ptr<uint8_t>(), d.data_ptr<at::Half>(), k / kBlock};
  return run_panels(w, x, panels, n);
}

// y (M, n) = x (M, K) @ w.T for a Q4_K matrix in panels: w = (d * sc) * q - (dmin * m).
at::Tensor block_q4_k_linear(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& sc, const at::Tensor& m,
                             const at::Tensor& d, const at::Tensor& dmin, int64_t n) {
  const char* op = "block_q4_k_linear";
  check_x(op, x, kBlock * kSuper);
  const int64_t k = x.size(1), panels = check_panels(op, "nibbles", nibbles, at::kByte, 256, k, n);
  check_part(op, "sc", sc, at::kByte, panels, k / kBlock, kPanel);
  check_part(op, "m", m, at::kByte, panels, k / kBlock, kPanel);
  check_part(op, "d", d, at::kHalf, panels, k / (kBlock * kSuper), kPanel);
  check_part(op, "dmin", dmin, at::kHalf, panels, k / (kBlock * kSuper), kPanel);
  const Q4_KPanels w{nibbles.data_ptr<uint8_t>(), sc.data_ptr<uint8_t>(), m.data_ptr<uint8_t>(),
                     d.data_ptr<at::Half>(), dmin.data_ptr<at::Half>(), k / kBlock};
  return run_panels(w, x, panels, n);
}

// y (M, n) = x (M, K) @ w.T for a Q6_K matrix in panels: w = (d * sc) * (q - 32).
at::Tensor block_q6_k_linear(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& high, const at::Tensor& sc,
                             const at::Tensor& d, int64_t n) {
  const char* op = "block_q6_k_linear";
  check_x(op, x, kBlock * kSuper);
  const int64_t k = x.size(1), panels = check_panels(op, "nibbles", nibbles, at::kByte, 256, k, n);
  check_part(op, "high", high, at::kByte, panels, k / kBlock, 128);
  check_part(op, "sc", sc, at::kChar, panels, k / 16, kPanel);
  check_part(op, "d", d, at::kHalf, panels, k / (kBlock * kSuper), kPanel);
  const Q6_KPanels w{nibbles.data_ptr<uint8_t>(), high.data_ptr<uint8_t>(), sc.data_ptr<int8_t>(), d.data_ptr<at::Half>(), k / kBlock};
  return run_panels(w, x, panels, n);
}

// y (M, n) = x (M, K) @ w.T for a Q8_0 matrix in panels: w = q * d.
at::Tensor block_q8_0_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, int64_t n) {
  const char* op = "block_q8_0_linear";
  check_x(op, x, kBlock);
  const int64_t k = x.size(1), panels = check_panels(op, "codes", codes, at::kChar, 512, k, n);
  check_part(op, "d", d, at::kHalf, panels, k / kBlock, kPanel);
  const Q8_0Panels w{codes.data_ptr<int8_t>(), d.data_ptr<at::Half>(), k / kBlock};
  return run_panels(w, x, panels, n);
}

// Which version of steps 2 and 3 this file was compiled with.
std::string kquants_instruction_set() {
#if defined(LOLLM_AVX512)
  return "AVX-512 VNNI";
#elif defined(LOLLM_AVX2)
  return "AVX2";
#else
  return "portable C++";
#endif
}

}  // namespace

// The operators join the library that block_int8.cpp declares (TORCH_LIBRARY there, a fragment
// here), in its namespace: lollm_native, or the test builds' (lollm.native.build_variant).
#ifndef LOLLM_NATIVE_NAMESPACE
#define LOLLM_NATIVE_NAMESPACE lollm_native
#endif
#define LOLLM_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)

LOLLM_FRAGMENT(LOLLM_NATIVE_NAMESPACE, m) {
  m.def("block_q4_0_linear(Tensor x, Tensor nibbles, Tensor d, int n) -> Tensor", &block_q4_0_linear);
  m.def("block_q5_0_linear(Tensor x, Tensor nibbles, Tensor fifth, Tensor d, int n) -> Tensor", &block_q5_0_linear);
  m.def("block_q4_k_linear(Tensor x, Tensor nibbles, Tensor sc, Tensor m, Tensor d, Tensor dmin, int n) -> Tensor", &block_q4_k_linear);
  m.def("block_q6_k_linear(Tensor x, Tensor nibbles, Tensor high, Tensor sc, Tensor d, int n) -> Tensor", &block_q6_k_linear);
  m.def("block_q8_0_linear(Tensor x, Tensor codes, Tensor d, int n) -> Tensor", &block_q8_0_linear);
  m.def("kquants_instruction_set() -> str", &kquants_instruction_set);
}
