// lollm's one hand-written CPU kernel: a linear layer over int8 weights kept in
// blocks, with int8 activations and integer dot products. The same library holds
// its sibling for Q5_0 weights kept in their 5-bit codes (block_q5_linear), further down.
//
// Read it next to docs/native-kernel.md. What it computes, for an Int8Linear
// (lollm/load/packed_linear.py) whose weights are w[n, k] = codes[g, n, k % gs] * scale[g, n]:
//
//   1. each row of x is cut into blocks of 32 values; a block becomes int8
//      codes xq and one float scale xd = max|x| / 127 ("Q8_0 activations", the
//      form llama.cpp multiplies in);
//   2. for every output channel n and every block b of 32 weights, the 32
//      products codes * xq are summed as integers: isum_b, exact, in int32;
//   3. those sums are scaled and added in float32, in ONE fixed order, the
//      "canonical order":
//          acc = 0
//          for b = 0, 1, 2, ...:  acc = fmaf(float(isum_b), xd_b * ws_b, acc)
//          y[m, n] = acc
//      where ws_b is the weight scale of channel n's block b (scale[g, n] of the
//      group holding the block) and xd_b * ws_b is rounded to float32 before the
//      fused multiply-add. scale is float32, or float16 where every scale is a
//      float16 value (a Q8_0 file's block scales, kept as the file has them);
//      either is read as float32 (exactly), so step 3 is the same for both.
//
// Why one order: integer sums do not depend on the order they are added in, but
// float32 sums do. Every version below (AMX tiles, AVX-512 VNNI, AVX2, plain C++)
// computes the same exact isum_b and then exactly the float32 operations above, in
// that order, so every version gives the same bits as every other one, and a row
// gives the same bits alone as inside a call of any number of rows: an engine
// step's output for a request does not depend on what else shares the step
// ("batch invariance", docs/native-kernel.md, section 3).
//
// Why it is faster than torch's _weight_int8pack_mm: a decode step is a
// matrix-vector product whose cost is reading the weights. Step 2 reads each
// weight byte once and needs one instruction per 64 of them on a CPU with
// AVX-512 VNNI (vpdpbusd). A task's 16 channels, once read, stay in the L1 and L2
// caches while every row of x (the tokens of a prefill chunk, of a speculative
// verify, the sequences of an engine step) takes its turn: the weights are read
// from memory once per call, and each extra row pays only its own arithmetic.
//
// Three versions of steps 2 and 3, chosen when this file is compiled
// (-march=native on the machine that runs it, or a narrower set for the test
// builds and LOLLM_ISA, lollm/native/__init__.py): AVX-512 VNNI, AVX2, and plain
// C++ for every other CPU. Where the CPU also has AMX tiles, a call of 8 rows or
// more takes them instead (16 channels by 16 rows per instruction; the section
// after the AVX-512 loops, and docs/native-kernel.md, section 9).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "blocks.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define LOLLM_AVX512 1  // the AVX-512 VNNI loops (and, where the CPU has them, the AMX tiles)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define LOLLM_AVX2 1  // the AVX2 loops
#include <immintrin.h>
#endif

namespace {

// The small helpers of the inner loops must be inlined for their vectors to stay in registers
// (the compiler gives up inlining on its own past a size budget).
#define LOLLM_INLINE inline __attribute__((always_inline))

constexpr int64_t kBlock = 32;      // values per activation block (and per weight group, at least)
constexpr int64_t kChannels = 16;   // output channels one task computes (a task's share of the work)
constexpr int64_t kChunkRows = 64;  // rows of x one pass over a task's weights serves (their float32 sums: 4 KB)

// Step 1 (x -> int8 codes and scales per block of 32) is in blocks.h, shared with block_kquants.cpp.
using lollm_blocks::quantize_rows;

// Q5_0 weights kept as the file's 5-bit codes (block_q5_linear, Q5Linear in lollm/quantized.py).
// A Q5_0 block holds 32 weights w = (u - 16) * d, u a 5-bit code (0..31), d a float16
// scale. Channel n's blocks are held in pairs (2p, 2p + 1), 64 weights in 40 bytes:
//   nibbles (N, K / 2):  32 bytes a pair; byte j = low 4 bits of u[2p][j] | those of u[2p + 1][j] << 4
//   high    (N, K / 8):   8 bytes a pair, one little-endian 64-bit word: bit j = the 5th bit
//                        of u[2p][j], bit 32 + j that of u[2p + 1][j] (the file's two qh words)
//   scale   (N, K / 32): float16, the file's d.
// Unpacked: 64 signed codes u - 16, block 2p then block 2p + 1.
inline void unpack_q5_pair(const uint8_t* nibbles, const uint8_t* high, int8_t* codes) {
  uint64_t bits;
  std::memcpy(&bits, high, 8);  // little-endian, as on x86 and arm64
  for (int j = 0; j < 32; ++j) {
    codes[j] = int8_t(((nibbles[j] & 15) | ((bits >> j) & 1) << 4) - 16);
    codes[32 + j] = int8_t(((nibbles[j] >> 4) | ((bits >> (32 + j)) & 1) << 4) - 16);
  }
}

#if defined(LOLLM_AVX2)
// (The fifth bits become bytes of 16 with lollm_blocks::fifth_bits, blocks.h.)
// unpack_q5_pair with vectors: the same 64 signed codes u - 16, bit for bit.
LOLLM_INLINE void unpack_q5_pair_avx2(const uint8_t* nibbles, const uint8_t* high, int8_t* codes) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles));
  const __m256i low4 = _mm256_set1_epi8(15), sixteen = _mm256_set1_epi8(16);
  uint32_t words[2];
  std::memcpy(words, high, 8);  // little-endian: words[0] = block 2p's fifth bits, words[1] = block 2p + 1's
  const __m256i first = _mm256_or_si256(_mm256_and_si256(v, low4), lollm_blocks::fifth_bits(words[0]));
  const __m256i second = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), lollm_blocks::fifth_bits(words[1]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), _mm256_sub_epi8(first, sixteen));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 32), _mm256_sub_epi8(second, sixteen));
}
#endif

#if defined(LOLLM_AVX512)
// A pair of Q5_0 blocks as 64 unsigned codes u (0..31): the low 4 bits of block 2p in bytes
// 0-31, of block 2p + 1 in bytes 32-63, then 16 added where the high bit is set.
LOLLM_INLINE __m512i q5_codes(const uint8_t* nibbles, const uint8_t* high) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles));
  const __m256i low4 = _mm256_set1_epi8(15);
  const __m256i first = _mm256_and_si256(v, low4), second = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
  uint64_t bits;
  std::memcpy(&bits, high, 8);
  return _mm512_mask_add_epi8(u, _cvtu64_mask64(bits), u, _mm512_set1_epi8(16));
}
#endif

// x after step 1, as every version reads it (rows m, blocks b of 32):
//   q   (rows, K)      int8: the codes xq
//   d   (rows, K / 32) float32: the block scales xd
//   sum (rows, K / 32) int32: each block's sum of codes (the VNNI loops undo their bias with it)
struct Rows {
  int64_t rows, k, blocks;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum;
  // Each row on its own, so the rows are shared out over torch's threads (chunks of at least
  // 32768 values: a decode step's few rows stay on one); a row's codes are the same on any thread.
  Rows(const float* x, int64_t rows, int64_t k)
      : rows(rows), k(k), blocks(k / kBlock), q(rows * k), d(rows * blocks), sum(rows * blocks, 0) {
    at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / k), [&](int64_t first, int64_t last) {
      quantize_rows(x + first * k, last - first, k, q.data() + first * k, d.data() + first * blocks);
      for (int64_t i = first * blocks; i < last * blocks; ++i)
        for (int64_t j = 0; j < kBlock; ++j) sum[i] += q[i * kBlock + j];
    });
  }
  const int8_t* block(int64_t m, int64_t b) const { return q.data() + m * k + b * kBlock; }
};

// ---------------------------------------------------------------------------
// The weights as the loops read them: channel c's blocks a pair (2p, 2p + 1) at a
// time, and each block's scale as float32. Two layouts, one interface:
//   with_signed_pair(n0, n1, p, body)  (AVX2, plain C++) calls body(codes), where codes(c, i)
//                           points to channel n0 + c's 32 signed codes of block 2p + i (int8: the
//                           weights themselves; Q5_0: the pair unpacked once for the 16 channels)
//   with_pair(n0, n1, p, body)  (AVX-512) calls body(load), where load(c) gives channel n0 + c's
//                           64 codes plus kBias, as unsigned bytes (c past n1 - n0: the last channel
//                           again, never stored). The layout's choices are made once per pair,
//                           outside the loops over channels.
//   scale_of(c, b)          the float32 ws of channel c's block b
//   pair_scales(n0, n1, p, ws)  (AVX-512) ws[i] lane c = scale_of(n0 + c, 2p + i), zeros past n1
//                           or past the last block
// ---------------------------------------------------------------------------

// Int8Linear: codes (groups, N, group_size), scale (groups, N) of type S (float or at::Half).
// Block b of channel c lies in group g = 32b / group_size: per channel (one group) a channel's
// blocks follow each other; in groups of 32 (the head) block b of 16 channels is 512 bytes.
// Where each block of channel 0 starts is worked out once (no division in the loops):
// channel c's block b is at codes + code_at[b] + c * group_size, its scale at scale[scale_at[b] + c].
template <class S>
struct Int8Weights {
  static constexpr int32_t kBias = 128;  // w + 128 (0..255): one xor with 0x80
  const int8_t* codes;
  const S* scale;
  int64_t n, group_size, blocks;
  std::vector<int64_t> code_at, scale_at;
  Int8Weights(const int8_t* codes, const S* scale, int64_t n, int64_t group_size, int64_t blocks)
      : codes(codes), scale(scale), n(n), group_size(group_size), blocks(blocks), code_at(blocks), scale_at(blocks) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t g = b * kBlock / group_size;
      code_at[b] = g * n * group_size + b * kBlock % group_size;
      scale_at[b] = g * n;
    }
  }
  const int8_t* block(int64_t c, int64_t b) const { return codes + code_at[b] + c * group_size; }
  float scale_of(int64_t c, int64_t b) const { return float(scale[scale_at[b] + c]); }
  template <class Body>
  void with_signed_pair(int64_t n0, int64_t n1, int64_t p, Body body) const {
    body([&](int64_t c, int64_t i) { return block(std::min(n0 + c, n1 - 1), 2 * p + i); });
  }
#if defined(LOLLM_AVX512)
  template <class Body>
  void with_pair(int64_t n0, int64_t n1, int64_t p, Body body) const {
    const int8_t* first = block(n0, 2 * p);
    const int64_t stride = group_size, last = n1 - n0 - 1;
    const __m512i flip = _mm512_set1_epi8(char(0x80));
    if (2 * p + 1 >= blocks) {  // a lone last block: zeros above
      body([=](int64_t c) { return _mm512_xor_si512(_mm512_maskz_loadu_epi8(0xFFFFFFFFULL, first + std::min(c, last) * stride), flip); });
    } else if (code_at[2 * p + 1] == code_at[2 * p] + kBlock) {  // both in one group: 64 bytes in a row
      body([=](int64_t c) { return _mm512_xor_si512(_mm512_loadu_si512(first + std::min(c, last) * stride), flip); });
    } else {  // groups of 32: the second block lies N * 32 bytes further
      const int8_t* second = block(n0, 2 * p + 1);
      body([=](int64_t c) {
        const int64_t at = std::min(c, last) * stride;
        const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + at));
        const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second + at));
        return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1), flip);
      });
    }
  }
  void prefetch(int64_t c, int64_t p) const { _mm_prefetch(reinterpret_cast<const char*>(block(c, 2 * p)), _MM_HINT_T1); }
  void pair_scales(int64_t n0, int64_t n1, int64_t p, __m512* ws) const {  // 16 channels' scales lie side by side
    const __mmask16 present = static_cast<__mmask16>((1u << (n1 - n0)) - 1);
    for (int64_t i = 0; i < 2; ++i) {
      if (2 * p + i >= blocks) {
        ws[i] = _mm512_setzero_ps();
        continue;
      }
      const S* first = scale + scale_at[2 * p + i] + n0;
      if constexpr (std::is_same_v<S, float>)
        ws[i] = _mm512_maskz_loadu_ps(present, first);
      else
        ws[i] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(present, first));
    }
  }
#endif
};

// Q5Linear: channel c's pair p is 32 bytes of nibbles and 8 of high bits (layout above
// unpack_q5_pair); scale (N, K / 32) float16, the file's d.
struct Q5Weights {
  static constexpr int32_t kBias = 16;  // u = w + 16 (0..31): the file's own code
  const uint8_t* nibbles;  // channel c's pair p: nibbles + c * K / 2 + 32p, high + c * K / 8 + 8p
  const uint8_t* high;
  const at::Half* scale;
  int64_t k, blocks;
  float scale_of(int64_t c, int64_t b) const { return float(scale[c * blocks + b]); }
  template <class Body>
  void with_signed_pair(int64_t n0, int64_t n1, int64_t p, Body body) const {
    int8_t codes[kChannels][64];
    for (int64_t c = 0; c < n1 - n0; ++c) {
#if defined(LOLLM_AVX2)
      unpack_q5_pair_avx2(nibbles + (n0 + c) * (k / 2) + 32 * p, high + (n0 + c) * (k / 8) + 8 * p, codes[c]);
#else
      unpack_q5_pair(nibbles + (n0 + c) * (k / 2) + 32 * p, high + (n0 + c) * (k / 8) + 8 * p, codes[c]);
#endif
    }
    body([&](int64_t c, int64_t i) -> const int8_t* { return codes[std::min(c, n1 - n0 - 1)] + kBlock * i; });
  }
#if defined(LOLLM_AVX512)
  template <class Body>
  void with_pair(int64_t n0, int64_t n1, int64_t p, Body body) const {
    const uint8_t* nib = nibbles + n0 * (k / 2) + 32 * p;
    const uint8_t* hb = high + n0 * (k / 8) + 8 * p;
    const int64_t nib_stride = k / 2, high_stride = k / 8, last = n1 - n0 - 1;
    body([=](int64_t c) {
      const int64_t at = std::min(c, last);
      return q5_codes(nib + at * nib_stride, hb + at * high_stride);
    });
  }
  void prefetch(int64_t c, int64_t p) const {
    _mm_prefetch(reinterpret_cast<const char*>(nibbles + c * (k / 2) + 32 * p), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(high + c * (k / 8) + 8 * p), _MM_HINT_T1);
  }
  void pair_scales(int64_t n0, int64_t n1, int64_t p, __m512* ws) const {  // channel c's d[2p], d[2p + 1]: 4 bytes
    alignas(64) uint32_t two[kChannels] = {};  // copied one by one: a gather instruction costs more here
    for (int64_t c = 0; c < n1 - n0; ++c) std::memcpy(&two[c], scale + (n0 + c) * blocks + 2 * p, 4);
    const __m512i both = _mm512_load_si512(two);
    ws[0] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(both));
    ws[1] = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(both, 16)));
  }
#endif
};

// A task: output channels n0 .. n1 (at most 16) of rows r0 .. r0 + count. Its float32
// accumulators acc[r][c] (row r0 + r, channel n0 + c) are shared by every version;
// pair_step (one per version, below) adds blocks 2p and 2p + 1 of every row into acc,
// block 2p first.
struct Task {
  int64_t n0, n1, n, r0, count;
  float (*acc)[kChannels];
};

#if defined(LOLLM_AVX512)
// ---------------------------------------------------------------------------
// Steps 2 and 3 on CPUs with AVX-512 VNNI.
//
// vpdpbusd multiplies 64 *unsigned* bytes by 64 signed ones and adds each 4 products
// into one of 16 int32 lanes. To get one exact sum per (channel, block) without adding
// lanes together afterwards, the weights are turned on their side once per task and
// pair of blocks: column[j] holds, in lane c, bytes 4j .. 4j + 3 of channel c's pair
// (a 16 x 16 transpose of 4-byte pieces). Then 8 instructions, each against the same 4
// bytes of x in every lane (a broadcast), leave in lane c channel c's whole block sum:
//     isum[c] = sum_j vpdpbusd(column[j], x[4j .. 4j + 3])      j = 0..7: block 2p; 8..15: 2p + 1
// and one fused multiply-add scales 16 channels at once, in the canonical order. The
// transpose is paid once per task and pair, and every row of the chunk reuses it.
//
// The sign problem: the weights are made unsigned, u = w + kBias (int8: xor 0x80, so
// kBias = 128; Q5_0's codes are unsigned already, kBias = 16). That adds kBias * sum(xq)
// to each block's sum, the same for every channel; the lanes start from -kBias * sum(xq)
// (Rows::sum), so the instructions leave exactly sum(w * xq).
// ---------------------------------------------------------------------------

// 16 vectors of 16 int32 transposed in place: afterwards r[j] lane c = r[c] lane j before.
LOLLM_INLINE void transpose16(__m512i* r) {
  __m512i a[16], b[16];
  for (int i = 0; i < 16; i += 2) {  // 4-byte pieces of rows 2i, 2i + 1 interleaved, within each 128 bits
    a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // b[i + m], 128 bits L: piece 4L + m of rows i .. i + 3
    b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
    b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
    b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
    b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // the 128-bit pieces: r[4L + m], 128 bits i = b[4i + m], 128 bits L
    const __m512i t0 = _mm512_shuffle_i32x4(b[m], b[4 + m], 0x44), t1 = _mm512_shuffle_i32x4(b[m], b[4 + m], 0xEE);
    const __m512i t2 = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0x44), t3 = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0xEE);
    r[m] = _mm512_shuffle_i32x4(t0, t2, 0x88);
    r[4 + m] = _mm512_shuffle_i32x4(t0, t2, 0xDD);
    r[8 + m] = _mm512_shuffle_i32x4(t1, t3, 0x88);
    r[12 + m] = _mm512_shuffle_i32x4(t1, t3, 0xDD);
  }
}

constexpr int64_t kTurnRows = 2;  // from this many rows a chunk turns the weights (measured: bench_int8_rows.py)

LOLLM_INLINE __m512i four_bytes(const int8_t* x) {  // x[0..3] in every lane
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}

// Block b (its 8 columns) of R rows from row m: 16 channels' exact sums, then acc[i] =
// fma(float(isum), xd * ws, acc[i]). Two chains of 4 instructions a row (columns 0-3 and
// 4-7), so that the multiply-adds of R rows overlap.
template <int R>
LOLLM_INLINE void block_rows(const __m512i* column, int32_t bias, const Rows& x, int64_t m, int64_t b, __m512 ws, float (*acc)[kChannels]) {
  __m512i lo[R], hi[R];
  for (int i = 0; i < R; ++i) {
    lo[i] = _mm512_set1_epi32(-bias * x.sum[(m + i) * x.blocks + b]);
    hi[i] = _mm512_setzero_si512();
  }
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < R; ++i) {
      const int8_t* xb = x.block(m + i, b);
      lo[i] = _mm512_dpbusd_epi32(lo[i], column[j], four_bytes(xb + 4 * j));
      hi[i] = _mm512_dpbusd_epi32(hi[i], column[4 + j], four_bytes(xb + 16 + 4 * j));
    }
  for (int i = 0; i < R; ++i) {
    const __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(lo[i], hi[i]));  // exact: |isum| < 2^24
    const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(x.d[(m + i) * x.blocks + b]), ws);  // xd * ws, rounded
    _mm512_store_ps(acc[i], _mm512_fmadd_ps(isum, scale, _mm512_load_ps(acc[i])));
  }
}

// Few rows (a decode step): the transpose would cost more than it saves. Each channel's pair
// meets the row's 64 bytes of x in one instruction (lanes 0-7: block 2p, 8-15: block 2p + 1),
// and the 16 channels' lanes are added up by a network of shuffles into isum[0] (block 2p,
// lane c: channel c) and isum[1] (block 2p + 1): the same exact sums as the columns give.
LOLLM_INLINE void lane_sums(const __m512i* s, __m512i* isum) {
  __m512i a[8], b[4], e[2];
  for (int i = 0; i < 8; ++i)  // a[i], 128 bits L: channels 2i, 2i + 1, two partial sums each
    a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(s[2 * i], s[2 * i + 1]), _mm512_unpackhi_epi32(s[2 * i], s[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // b[i], 128 bits L: channels 4i .. 4i + 3, the sum of lanes 4L .. 4L + 3
    b[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // e[i]: block 2p of channels 8i .. 8i + 3, block 2p + 1 of them, the same for 8i + 4 .. 8i + 7
    e[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_i32x4(b[2 * i], b[2 * i + 1], 0xDD));
  isum[0] = _mm512_shuffle_i32x4(e[0], e[1], 0x88);
  isum[1] = _mm512_shuffle_i32x4(e[0], e[1], 0xDD);
}

template <class Load>
LOLLM_INLINE void one_row(Load load, int32_t bias, const Task& t, const Rows& x, int64_t r, int64_t p, const __m512* ws) {
  const int64_t blocks = std::min<int64_t>(2, x.blocks - 2 * p), m = t.r0 + r;
  const __m512i xv = _mm512_maskz_loadu_epi8(blocks == 2 ? ~0ULL : 0xFFFFFFFFULL, x.block(m, 2 * p));
  __m512i s[16], isum[2];
#pragma GCC unroll 16
  for (int64_t c = 0; c < kChannels; ++c) s[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), load(c), xv);
  lane_sums(s, isum);
  float* acc = t.acc[r];
  __m512 a = _mm512_load_ps(acc);
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t b = 2 * p + i;
    const __m512i exact = _mm512_sub_epi32(isum[i], _mm512_set1_epi32(bias * x.sum[m * x.blocks + b]));
    a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_mul_ps(_mm512_set1_ps(x.d[m * x.blocks + b]), ws[i]), a);
  }
  _mm512_store_ps(acc, a);
}

template <class W>
void pair_step(const W& w, const Rows& x, int64_t p, const Task& t) {
  for (int64_t c = t.n1; c < std::min(t.n1 + kChannels, t.n); ++c) w.prefetch(c, p);  // the next task's pair, on its way meanwhile
  __m512 ws[2];
  w.pair_scales(t.n0, t.n1, p, ws);
  w.with_pair(t.n0, t.n1, p, [&](auto load) {
    if (t.count < kTurnRows) {
      for (int64_t r = 0; r < t.count; ++r) one_row(load, W::kBias, t, x, r, p, ws);
      return;
    }
    __m512i u[16];  // channel c's pair, unsigned; then turned: u[j] lane c = its bytes 4j .. 4j + 3
#pragma GCC unroll 16
    for (int64_t c = 0; c < kChannels; ++c) u[c] = load(c);
    transpose16(u);
    for (int64_t b = 2 * p; b < std::min(2 * p + 2, x.blocks); ++b) {
      const __m512i* columns = u + 8 * (b - 2 * p);
      int64_t r = 0;
      for (; r + 4 <= t.count; r += 4) block_rows<4>(columns, W::kBias, x, t.r0 + r, b, ws[b - 2 * p], t.acc + r);
      for (; r < t.count; ++r) block_rows<1>(columns, W::kBias, x, t.r0 + r, b, ws[b - 2 * p], t.acc + r);
    }
  });
}

// ---------------------------------------------------------------------------
// Steps 2 and 3 with AMX tiles (Intel Xeon since Sapphire Rapids): 16 channels
// against 16 rows of x in one instruction.
//
// A tile is a two-dimensional register of up to 16 rows of 64 bytes. tdpbssd C, A, B
// multiplies A, one block of 32 int8 codes for each of 16 channels (16 x 32 bytes), by
// B, the same block of 32 int8 activations for each of 16 rows of x, and adds each
// channel's 32 products with each row into C, 16 x 16 int32: 8,192 multiply-adds in
// one instruction, where vpdpbusd does 64. B is stored four bytes at a time:
// B[i][4m + j] = xq[m][4i + j] (TileRows). The int32 sums are exact, as in the loops
// above; each block's sums are then scaled, d[m, b] * scale[n, b], and added in
// float32 to one 16-lane vector per channel (lane m: row m): the canonical order,
// block after block (scale_blocks), so the tiles give the loops' bits exactly.
//
// Rows never mix: a row's outputs come from the same instructions in the same order
// whatever rows are beside it (rows past the last are zeros). The tiles take calls of
// kTileMinRows rows or more; fewer rows (a lone decode step) take the loops above.
// Linux lends the tile registers to a process that asks (arch_prctl); where it
// refuses, the loops above run.
// ---------------------------------------------------------------------------
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define LOLLM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

constexpr int64_t kTileRows = 16;    // rows of x (and channels) one tile instruction takes
constexpr int64_t kTileMinRows = 8;  // from this many rows the tiles beat the vector loops (docs/native-kernel.md, section 9)
constexpr int64_t kStreamBytes = 4 << 20;  // outputs larger than this (beyond a core's L2) are written past the cache

// Whether the tiles run: not turned off by LOLLM_AMX=0 (read once, for benchmarks and
// comparisons), and lent to this process by Linux (asked once: ARCH_REQ_XCOMP_PERM for XTILEDATA).
bool tiles_permitted() {
  static const bool permitted = [] {
    std::string choice;  // LOLLM_AMX, trimmed and in lower case (lollm.native refuses other values than on/off)
    for (const char* c = std::getenv("LOLLM_AMX"); c != nullptr && *c != 0; ++c)
      if (!std::isspace(static_cast<unsigned char>(*c))) choice += static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
    if (choice == "0" || choice == "off" || choice == "false" || choice == "no") return false;
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return permitted;
}

// The shapes of the eight tiles, loaded into a thread before its first tile instruction
// (another library, oneDNN's matmul among them, may have changed them on this thread since).
struct alignas(64) TileShapes {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {64, 64, 64, 64, 32, 32, 64, 64};  // tiles 0-3: C (16 x 16 int32); 4, 5: A (16 x 32 codes); 6, 7: B (8 x 64)
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 8, 8};
};

// x in the form B tiles read, 16 rows to a group (zeros past the last row):
//   q (groups, blocks, 8, 64): q[g][b][i][4m + j] = xq[16g + m][32b + 4i + j]
//   d (groups, blocks, 16):    d[g][b][m] = xd[16g + m][b]
struct TileRows {
  int64_t groups, blocks;
  std::vector<int8_t> q;
  std::vector<float> d;
  TileRows(const int8_t* xq, const float* xd, int64_t rows, int64_t k)
      : groups((rows + kTileRows - 1) / kTileRows), blocks(k / kBlock), q(groups * k * kTileRows, 0), d(groups * blocks * kTileRows, 0.f) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t g = r / kTileRows, m = r % kTileRows, tile = g * blocks + b;
        d[tile * kTileRows + m] = xd[r * blocks + b];
        for (int64_t i = 0; i < kBlock / 4; ++i) std::memcpy(&q[(tile * 8 + i) * 64 + 4 * m], xq + r * k + b * kBlock + 4 * i, 4);
      }
  }
};

// One task's 16 channels as tiles read them: block b of channel c (0..15) at
// codes + c * stride + at(b), and the block's scales, ws[16 b + c].
struct TileChannels {
  const int8_t* codes;
  int64_t stride, group_size, group_stride;  // block b lies in group 32b / group_size, group_stride bytes apart
  std::vector<float> ws;
  bool stream = false;  // write the outputs past the cache (an output of many megabytes)
  int64_t at(int64_t b) const { return (b * kBlock / group_size) * group_stride + b * kBlock % group_size; }
};

// Blocks b .. b + 3 of one group of rows: their products go to tiles 0-3 (C), through
// A tiles 4, 5 and B tiles 6, 7. Tile numbers are part of the instruction, hence spelled out.
inline void four_blocks(const TileChannels& w, const int8_t* xq, int64_t b) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, w.codes + w.at(b), w.stride); _tile_loadd(6, xq + b * 512, 64);
  _tile_loadd(5, w.codes + w.at(b + 1), w.stride); _tile_loadd(7, xq + (b + 1) * 512, 64);
  _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 5, 7);
  _tile_loadd(4, w.codes + w.at(b + 2), w.stride); _tile_loadd(6, xq + (b + 2) * 512, 64);
  _tile_loadd(5, w.codes + w.at(b + 3), w.stride); _tile_loadd(7, xq + (b + 3) * 512, 64);
  _tile_dpbssd(2, 4, 6); _tile_dpbssd(3, 5, 7);
}

// Step 3 for `count` blocks from b whose int32 sums (channel, row) lie in `sums`, 256 a block.
inline void scale_blocks(const int32_t* sums, int64_t count, const TileChannels& w, const float* d, int64_t b, __m512* acc) {
  for (int64_t i = 0; i < count; ++i) {
    const __m512 row_scales = _mm512_loadu_ps(d + (b + i) * kTileRows);  // d[m, b + i] for the 16 rows
    const float* channel_scales = w.ws.data() + kTileRows * (b + i);
    for (int c = 0; c < kTileRows; ++c) {
      const __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(sums + kTileRows * (kTileRows * i + c)));
      acc[c] = _mm512_fmadd_ps(s, _mm512_mul_ps(row_scales, _mm512_set1_ps(channel_scales[c])), acc[c]);
    }
  }
}

// Channels n0 .. n1 (at most 16) of every row: out[r * n + n0 + c]. Four blocks at a time,
// pipelined: while the tiles multiply blocks b .. b + 3, the vector units scale the four
// before them (the tile instructions run beside the vector ones).
void tile_channels(const TileChannels& w, const TileRows& x, int64_t rows, int64_t n, int64_t n0, int64_t n1, float* out) {
  alignas(64) int32_t sums[2][4 * kTileRows * kTileRows];  // two sets of four C tiles, one filling while one is scaled
  alignas(64) float done[kTileRows * kTileRows];
  const int64_t quads = x.blocks / 4;
  for (int64_t g = 0; g < x.groups; ++g) {
    const int8_t* xq = x.q.data() + g * x.blocks * 512;
    const float* d = x.d.data() + g * x.blocks * kTileRows;
    __m512 acc[kTileRows];
    for (int c = 0; c < kTileRows; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t q = 0; q < quads; ++q) {
      four_blocks(w, xq, 4 * q);
      if (q > 0) scale_blocks(sums[(q - 1) % 2], 4, w, d, 4 * (q - 1), acc);
      _tile_stored(0, sums[q % 2], 64); _tile_stored(1, sums[q % 2] + 256, 64);
      _tile_stored(2, sums[q % 2] + 512, 64); _tile_stored(3, sums[q % 2] + 768, 64);
    }
    if (quads > 0) scale_blocks(sums[(quads - 1) % 2], 4, w, d, 4 * (quads - 1), acc);
    for (int64_t b = 4 * quads; b < x.blocks; ++b) {  // the last one to three blocks, one at a time
      _tile_zero(0);
      _tile_loadd(4, w.codes + w.at(b), w.stride); _tile_loadd(6, xq + b * 512, 64);
      _tile_dpbssd(0, 4, 6);
      _tile_stored(0, sums[0], 64);
      scale_blocks(sums[0], 1, w, d, b, acc);
    }
    // acc holds (channel, row); out wants (row, channel): each row's 16 channels gathered from
    // done (16 floats apart), then written as one vector. A large output (the head's logits) is
    // streamed past the cache: a whole 64-byte line written needs no read of it first.
    for (int c = 0; c < kTileRows; ++c) _mm512_store_ps(done + kTileRows * c, acc[c]);
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(kTileRows));
    const __mmask16 present = static_cast<__mmask16>((1u << (n1 - n0)) - 1);
    for (int64_t m = 0; m < std::min(kTileRows, rows - g * kTileRows); ++m) {
      float* row = out + (g * kTileRows + m) * n + n0;
      const __m512 channels = _mm512_i32gather_ps(column, done + m, 4);
      if (w.stream && present == 0xFFFF && reinterpret_cast<uintptr_t>(row) % 64 == 0)
        _mm512_stream_ps(row, channels);
      else
        _mm512_mask_storeu_ps(row, present, channels);
    }
  }
}

// An Int8Linear's channels n0 .. n1 through tiles. A task of fewer than 16 channels (the
// last) copies its codes into a buffer padded with zeros, so that no tile reads past the matrix.
// The scales, float32 or float16 (S), become float32 in TileChannels::ws, once per task.
template <class S>
void int8_tile_task(const int8_t* codes, const S* ws, int64_t groups, int64_t n, int64_t group_size, const TileRows& x,
                    int64_t rows, int64_t n0, int64_t n1, std::vector<int8_t>& spare, float* out) {
  const int64_t k = groups * group_size;
  TileChannels w{codes + n0 * group_size, group_size, group_size, n * group_size, std::vector<float>(k / kBlock * kTileRows, 0.f),
                 rows * n * 4 > kStreamBytes};
  for (int64_t b = 0; b < k / kBlock; ++b)
    for (int64_t c = 0; c < n1 - n0; ++c) w.ws[kTileRows * b + c] = float(ws[(b * kBlock / group_size) * n + n0 + c]);
  if (n1 - n0 < kTileRows) {
    spare.assign(kTileRows * k, 0);
    for (int64_t c = 0; c < n1 - n0; ++c)
      for (int64_t b = 0; b < k / kBlock; ++b) std::memcpy(&spare[c * k + b * kBlock], w.codes + c * w.stride + w.at(b), kBlock);
    w.codes = spare.data(), w.stride = k, w.group_size = k, w.group_stride = 0;
  }
  tile_channels(w, x, rows, n, n0, n1, out);
}

// A Q5_0 layer's channels n0 .. n1 through tiles: the 16 channels' codes unpacked to signed
// bytes u - 16 once (16 x K bytes), then every group of rows meets them.
void q5_tile_task(const uint8_t* nibbles, const uint8_t* high, const at::Half* scale, int64_t k, const TileRows& x,
                  int64_t rows, int64_t n, int64_t n0, int64_t n1, std::vector<int8_t>& spare, float* out) {
  spare.assign(kTileRows * k, 0);
  TileChannels w{spare.data(), k, k, 0, std::vector<float>(k / kBlock * kTileRows, 0.f), rows * n * 4 > kStreamBytes};
  for (int64_t c = 0; c < n1 - n0; ++c) {
    const int64_t ch = n0 + c;
    for (int64_t p = 0; p < k / 64; ++p) {
      const __m512i u = q5_codes(nibbles + ch * k / 2 + 32 * p, high + ch * k / 8 + 8 * p);
      _mm512_storeu_si512(&spare[c * k + 64 * p], _mm512_sub_epi8(u, _mm512_set1_epi8(16)));
    }
    for (int64_t b = 0; b < k / kBlock; ++b) w.ws[kTileRows * b + c] = float(scale[ch * (k / kBlock) + b]);
  }
  tile_channels(w, x, rows, n, n0, n1, out);
}

// Steps 2 and 3 through tiles: x rearranged once (TileRows), then task(x, n0, n1, spare) for
// every task of 16 channels, over torch's threads. Each thread loads the tile shapes before
// its share (and hands the tiles back after); `spare` is its scratch buffer.
template <class Task>
void over_tile_tasks(const std::vector<int8_t>& xq, const std::vector<float>& xd, int64_t rows, int64_t k, int64_t n, Task task) {
  static const TileShapes shapes;
  const TileRows tiled(xq.data(), xd.data(), rows, k);
  at::parallel_for(0, (n + kChannels - 1) / kChannels, 1, [&](int64_t first, int64_t last) {
    std::vector<int8_t> spare;
    _tile_loadconfig(&shapes);
    for (int64_t t = first; t < last; ++t) task(tiled, t * kChannels, std::min(n, (t + 1) * kChannels), spare);
    _tile_release();
    _mm_sfence();  // the streamed outputs are in memory before this thread's share is done
  });
}
#endif

#else
// The pair's scales for the loops below: ws[i][c] = scale_of(n0 + c, 2p + i), zeros past n1 or past the last block.
template <class W>
void pair_scales(const W& w, const Task& t, int64_t p, float (*ws)[kChannels]) {
  for (int64_t i = 0; i < 2; ++i) {
    std::fill(ws[i], ws[i] + kChannels, 0.f);
    if (2 * p + i < w.blocks)  // int8's scales of one block lie side by side: the compiler vectorizes this
      for (int64_t c = 0; c < t.n1 - t.n0; ++c) ws[i][c] = w.scale_of(t.n0 + c, 2 * p + i);
  }
}
#endif

#if defined(LOLLM_AVX2)
// ---------------------------------------------------------------------------
// Steps 2 and 3 on CPUs with AVX2 (and FMA): one block of 8 channels at a time.
//
// vpmaddubsw multiplies an unsigned byte by a signed one, so the signs move onto x:
// |w| * (x * sign(w)) = w * x (|-128| = 128 fits an unsigned byte; x is never -128, so
// x * sign(w) fits a signed one); pairs of products are summed into int16 (at most
// 2 * 128 * 127: no saturation), then pairs of those into int32 by vpmaddwd.
// ---------------------------------------------------------------------------

// One block of one channel: 8 int32 lanes whose sum is sum_j w[j] * x[j].
inline __m256i block_dot(const int8_t* w, __m256i xv) {
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// 8 channels' lanes added up: lane c of the result = the sum of d[c]'s 8 lanes (exact, int32).
inline __m256i lane_sums(const __m256i* d) {
  const __m256i d01 = _mm256_hadd_epi32(d[0], d[1]), d23 = _mm256_hadd_epi32(d[2], d[3]);
  const __m256i d45 = _mm256_hadd_epi32(d[4], d[5]), d67 = _mm256_hadd_epi32(d[6], d[7]);
  const __m256i low = _mm256_hadd_epi32(d01, d23), high = _mm256_hadd_epi32(d45, d67);  // per 128 bits: channels 0-3, 4-7
  return _mm256_add_epi32(_mm256_permute2x128_si256(low, high, 0x20), _mm256_permute2x128_si256(low, high, 0x31));
}

template <class W>
void pair_step(const W& w, const Rows& x, int64_t p, const Task& t) {
  float ws[2][kChannels];
  pair_scales(w, t, p, ws);
  w.with_signed_pair(t.n0, t.n1, p, [&](auto codes) {  // codes(c, i): channel n0 + c's block 2p + i, signed
    for (int64_t r = 0; r < t.count; ++r)
      for (int64_t b = 2 * p; b < std::min(2 * p + 2, x.blocks); ++b) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.block(t.r0 + r, b)));
        const __m256 xd = _mm256_set1_ps(x.d[(t.r0 + r) * x.blocks + b]);
        for (int64_t half = 0; half < kChannels && t.n0 + half < t.n1; half += 8) {  // channels half .. half + 7
          __m256i d[8];
          for (int c = 0; c < 8; ++c) d[c] = block_dot(codes(half + c, b - 2 * p), xv);
          const __m256 isum = _mm256_cvtepi32_ps(lane_sums(d));
          const __m256 scale = _mm256_mul_ps(xd, _mm256_loadu_ps(ws[b - 2 * p] + half));  // xd * ws, rounded
          _mm256_store_ps(t.acc[r] + half, _mm256_fmadd_ps(isum, scale, _mm256_load_ps(t.acc[r] + half)));
        }
      }
  });
}

#elif !defined(LOLLM_AVX512)
// ---------------------------------------------------------------------------
// Steps 2 and 3 in plain C++, for every other CPU: the canonical order as written.
// ---------------------------------------------------------------------------
template <class W>
void pair_step(const W& w, const Rows& x, int64_t p, const Task& t) {
  float ws[2][kChannels];
  pair_scales(w, t, p, ws);
  w.with_signed_pair(t.n0, t.n1, p, [&](auto codes) {  // codes(c, i): channel n0 + c's block 2p + i, signed
    for (int64_t r = 0; r < t.count; ++r)
      for (int64_t b = 2 * p; b < std::min(2 * p + 2, x.blocks); ++b) {
        const int8_t* xb = x.block(t.r0 + r, b);
        const float xd = x.d[(t.r0 + r) * x.blocks + b];
        for (int64_t c = 0; c < t.n1 - t.n0; ++c) {
          const int8_t* wb = codes(c, b - 2 * p);
          int32_t isum = 0;
          for (int64_t j = 0; j < kBlock; ++j) isum += int32_t(wb[j]) * int32_t(xb[j]);
          t.acc[r][c] = std::fmaf(float(isum), xd * ws[b - 2 * p][c], t.acc[r][c]);
        }
      }
  });
}
#endif

// One task of every version: channels n0 .. n1 of every row, kChunkRows rows at a time.
// For each chunk the accumulators start at zero and the pairs of blocks come in order,
// so each output is the canonical order's acc, whatever the chunk or the rows beside it.
template <class W>
void run_task(const W& w, const Rows& x, int64_t n, int64_t n0, int64_t n1, float* out) {
  alignas(64) float acc[kChunkRows][kChannels];
  for (int64_t r0 = 0; r0 < x.rows; r0 += kChunkRows) {
    const Task task{n0, n1, n, r0, std::min(kChunkRows, x.rows - r0), acc};
    std::fill(&acc[0][0], &acc[task.count][0], 0.f);
    for (int64_t p = 0; p < (x.blocks + 1) / 2; ++p) pair_step(w, x, p, task);
    for (int64_t r = 0; r < task.count; ++r) std::copy(acc[r], acc[r] + (n1 - n0), out + (r0 + r) * n + n0);
  }
}

// Steps 2 and 3 over torch's threads: tasks of 16 output channels.
template <class W>
void vector_tasks(const W& w, const Rows& x, int64_t n, float* out) {
  at::parallel_for(0, (n + kChannels - 1) / kChannels, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) run_task(w, x, n, t * kChannels, std::min(n, (t + 1) * kChannels), out);
  });
}

// Steps 2 and 3 of block_int8_linear: the tiles from kTileMinRows rows where they run, else the loops.
template <class S>
void int8_steps(const Rows& x, const int8_t* codes, const S* ws, int64_t groups, int64_t n, int64_t group_size, float* out) {
#if defined(LOLLM_AMX)
  if (x.rows >= kTileMinRows && tiles_permitted()) {
    over_tile_tasks(x.q, x.d, x.rows, x.k, n, [&](const TileRows& tiled, int64_t n0, int64_t n1, std::vector<int8_t>& spare) {
      int8_tile_task(codes, ws, groups, n, group_size, tiled, x.rows, n0, n1, spare, out);
    });
    return;
  }
#endif
  vector_tasks(Int8Weights<S>(codes, ws, n, group_size, x.blocks), x, n, out);
}

// y (M, N) = x (M, K) @ w.T, w[n, k] = codes[g, n, k % gs] * scale[g, n]. The scales are float32,
// or float16 (Int8Linear keeps scales that are all float16 values so: a Q8_0 file's d): either is
// read as float32, so the same values give the same y bit for bit in both dtypes.
at::Tensor block_int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "block_int8_linear: x must be a contiguous float32 CPU matrix (M, K)");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kChar && codes.is_contiguous() && codes.device().is_cpu(),
              "block_int8_linear: codes must be contiguous int8 (groups, N, group_size) on the CPU");
  const int64_t rows = x.size(0), k = x.size(1);
  const int64_t groups = codes.size(0), n = codes.size(1), group_size = codes.size(2);
  TORCH_CHECK(groups * group_size == k && group_size % kBlock == 0,
              "block_int8_linear: codes (", groups, ", ", n, ", ", group_size, ") do not fit x's ", k,
              " columns in groups that are a multiple of 32");
  const bool half = scale.scalar_type() == at::kHalf;
  TORCH_CHECK(half || scale.scalar_type() == at::kFloat,
              "block_int8_linear: scale must be float32 or float16, not ", scale.scalar_type());
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == groups && scale.size(1) == n && scale.is_contiguous() && scale.device().is_cpu(),
              "block_int8_linear: scale must be contiguous (groups, N) = (", groups, ", ", n, ") on the CPU");

  const Rows xr(x.data_ptr<float>(), rows, k);  // step 1
  at::Tensor y = at::empty({rows, n}, x.options());
  const int8_t* w = codes.data_ptr<int8_t>();
  if (half)
    int8_steps(xr, w, scale.data_ptr<at::Half>(), groups, n, group_size, y.data_ptr<float>());
  else
    int8_steps(xr, w, scale.data_ptr<float>(), groups, n, group_size, y.data_ptr<float>());
  return y;
}

// The three tensors of a Q5_0 matrix with K inputs (layout above unpack_q5_pair), checked for `op`.
void check_q5_weights(const char* op, const at::Tensor& nibbles, const at::Tensor& high, const at::Tensor& scale, int64_t k) {
  TORCH_CHECK(k > 0 && k % 64 == 0 && nibbles.dim() == 2 && nibbles.size(1) == k / 2 && nibbles.scalar_type() == at::kByte &&
                  nibbles.is_contiguous() && nibbles.device().is_cpu(),
              op, ": nibbles must be contiguous uint8 (N, K / 2) on the CPU, K a multiple of 64 (K = ", k, ")");
  const int64_t n = nibbles.size(0);
  TORCH_CHECK(high.dim() == 2 && high.size(0) == n && high.size(1) == k / 8 && high.scalar_type() == at::kByte &&
                  high.is_contiguous() && high.device().is_cpu(),
              op, ": high must be contiguous uint8 (N, K / 8) on the CPU, N = ", n, ", K = ", k);
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == n && scale.size(1) == k / kBlock && scale.scalar_type() == at::kHalf &&
                  scale.is_contiguous() && scale.device().is_cpu(),
              op, ": scale must be contiguous float16 (N, K / 32) on the CPU, N = ", n, ", K = ", k);
}

// y (M, N) = x (M, K) @ w.T for Q5_0 weights kept in their 5-bit codes (layout above unpack_q5_pair).
at::Tensor block_q5_linear(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& high, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "block_q5_linear: x must be a contiguous float32 CPU matrix (M, K)");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 64 == 0, "block_q5_linear: x's ", k, " columns are not whole pairs of 32-value blocks");
  check_q5_weights("block_q5_linear", nibbles, high, scale, k);
  const int64_t n = nibbles.size(0);

  const Rows xr(x.data_ptr<float>(), rows, k);  // step 1, as for int8 weights
  at::Tensor y = at::empty({rows, n}, x.options());
  float* out = y.data_ptr<float>();
  const Q5Weights w{nibbles.data_ptr<uint8_t>(), high.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(), k, k / kBlock};
#if defined(LOLLM_AMX)
  if (rows >= kTileMinRows && tiles_permitted()) {
    over_tile_tasks(xr.q, xr.d, rows, k, n, [&](const TileRows& tiled, int64_t n0, int64_t n1, std::vector<int8_t>& spare) {
      q5_tile_task(w.nibbles, w.high, w.scale, k, tiled, rows, n, n0, n1, spare, out);
    });
    return y;
  }
#endif
  vector_tasks(w, xr, n, out);
  return y;
}

// Which version of step 2 this build compiled (lollm.native.status names it).
std::string instruction_set() {
#if defined(LOLLM_AMX)
  if (tiles_permitted()) return "AVX-512 VNNI, AMX tiles from " + std::to_string(kTileMinRows) + " rows";
#endif
#if defined(LOLLM_AVX512)
  return "AVX-512 VNNI";
#elif defined(LOLLM_AVX2)
  return "AVX2";
#else
  return "portable C++";
#endif
}

// From how many rows the tiles take over (0: never, in this build on this machine).
int64_t tile_min_rows() {
#if defined(LOLLM_AMX)
  if (tiles_permitted()) return kTileMinRows;
#endif
  return 0;
}

}  // namespace

// The operators' namespace: lollm_native, or another name for the test builds of the
// other versions (lollm.native.build_variant), which load beside it.
#ifndef LOLLM_NATIVE_NAMESPACE
#define LOLLM_NATIVE_NAMESPACE lollm_native
#endif
#define LOLLM_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

LOLLM_LIBRARY(LOLLM_NATIVE_NAMESPACE, m) {
  m.def("block_int8_linear(Tensor x, Tensor codes, Tensor scale) -> Tensor", &block_int8_linear);
  m.def("block_q5_linear(Tensor x, Tensor nibbles, Tensor high, Tensor scale) -> Tensor", &block_q5_linear);
  m.def("instruction_set() -> str", &instruction_set);
  m.def("tile_min_rows() -> int", &tile_min_rows);
}
