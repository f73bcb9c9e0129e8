// lollm's one hand-written CPU kernel: a linear layer over int8 weights kept in
// blocks, with int8 activations and integer dot products. The same library holds
// its sibling for Q5_0 weights kept in their 5-bit codes (block_q5_linear, and
// block_q5_dequantize for the many-rows path), further down.
//
// Read it next to docs/native-kernel.md. What it computes, for an Int8Linear
// (lollm/quantized.py) whose weights are w[n, k] = codes[g, n, k % gs] * scale[g, n]:
//
//   1. each row of x is cut into blocks of 32 values; a block becomes int8
//      codes xq and one float scale xd = max|x| / 127 ("Q8_0 activations", the
//      form llama.cpp multiplies in);
//   2. for every output channel n and every block of 32 weights, the 32
//      products codes * xq are summed as integers (exact, int32);
//   3. that sum is scaled by the two float scales, xd * scale[g, n], and added
//      to the channel's float32 accumulator. scale is float32, or float16 where
//      every scale is a float16 value (a Q8_0 file's block scales, kept as the file
//      has them); either is read as float32 (exactly), so step 3's arithmetic is the
//      same for both.
//
// Why it is faster than torch's _weight_int8pack_mm: a decode step is a
// matrix-vector product whose cost is reading the weights. Step 2 reads each
// weight byte once and needs one instruction per 64 of them on a CPU with
// AVX-512 VNNI (vpdpbusd: 64 u8 x s8 products summed in groups of 4 into 16
// int32 lanes). Each row of codes, once read, stays in the L1 cache while every
// row of x (the tokens of a speculative verify, the sequences of an engine step)
// takes its turn: the weights are read from memory once, and each extra row pays
// only its own arithmetic (docs/native-kernel.md, section 4, measures it; section 6 is about the Q5_0 loop).
//
// Each row of x is computed alone, by the same instructions in the same order
// whatever rows are beside it, so a batch gives each row what it gives alone.
//
// Three versions of steps 2 and 3, chosen when this file is compiled
// (-march=native on the machine that runs it): AVX-512 VNNI (two blocks per
// vpdpbusd), AVX2 (one block per vpmaddubsw + vpmaddwd), and plain C++ for every
// other CPU. All three compute the same integer sums; only the order of the float
// additions differs. Where the CPU also has AMX tiles, a call of 8 rows or more
// takes them instead (16 channels by 16 rows per instruction; the section after the
// AVX-512 loops, and docs/native-kernel.md, section 9).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "blocks.h"

namespace {

constexpr int64_t kBlock = 32;     // values per activation block (and per weight group, at least)
constexpr int64_t kChannels = 16;  // output channels one task computes (a task's share of the work)

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

// ---------------------------------------------------------------------------
// Steps 2 and 3 on CPUs with AVX-512 VNNI: two blocks of 32 per instruction.
//
// vpdpbusd multiplies an *unsigned* byte by a signed one and sums each 4
// products into an int32 lane. The weights are made unsigned as they are read
// (w + 128, one xor), and the extra 128 * sum(x) that this adds to each lane
// depends on the activations only, so it is computed once per call: for layers
// in groups of 32 it is each lane's starting value (PairedRows::offset), so the
// instruction leaves exactly sum(w * x); for per-channel layers it is taken off once
// per row and group, after the scaling (row_surplus), and the inner loop reads
// nothing but codes, activations and block scales.
// ---------------------------------------------------------------------------
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define LOLLM_AVX512 1
#include <immintrin.h>

// Per-channel layers: per row and group, sum_b d[b] * 128 * sum(xq in b), the amount
// the unsigned weights add to every channel's scaled sum (rows, K / group_size).
std::vector<float> row_surplus(const int8_t* xq, const float* xd, int64_t rows, int64_t k, int64_t group_size) {
  std::vector<float> surplus(rows * (k / group_size), 0.f);
  for (int64_t b = 0; b < rows * k / kBlock; ++b) {
    int32_t total = 0;
    for (int64_t j = 0; j < kBlock; ++j) total += xq[b * kBlock + j];
    surplus[b * kBlock / group_size] += xd[b] * 128.f * float(total);
  }
  return surplus;
}

// Layers in groups of 32: x in the form their loop reads, every block repeated twice
// (their one instruction takes two channels against the same block): codes (2K bytes
// a row), each int32 lane's -128 * (sum of its 4 codes) and each lane's block scale
// (K / 2 each).
struct PairedRows {
  std::vector<int8_t> q;
  std::vector<int32_t> offset;
  std::vector<float> d;
  PairedRows(const int8_t* xq, const float* xd, int64_t rows, int64_t k) : q(2 * rows * k), offset(rows * k / 2), d(rows * k / 2) {
    for (int64_t b = 0; b < rows * k / kBlock; ++b)
      for (int64_t copy = 0; copy < 2; ++copy) {
        const int64_t at = (2 * b + copy) * kBlock;
        std::copy(xq + b * kBlock, xq + (b + 1) * kBlock, q.begin() + at);
        for (int64_t lane = 0; lane < 8; ++lane) {
          const int8_t* four = xq + b * kBlock + 4 * lane;
          offset[at / 4 + lane] = -128 * (four[0] + four[1] + four[2] + four[3]);
          d[at / 4 + lane] = xd[b];
        }
      }
  }
};

// 64 bytes of codes made unsigned (w + 128), or the first 32 (lanes above zero) when
// only one block is left.
inline __m512i unsigned_codes(const int8_t* w, bool two) {
  return _mm512_xor_si512(_mm512_maskz_loadu_epi8(two ? ~0ULL : 0xFFFFFFFFULL, w), _mm512_set1_epi8(char(0x80)));
}

// Layers with one scale per channel (group_size = K, or another multiple of 32 above it):
// a channel's codes are contiguous; one instruction takes two neighbouring blocks, and
// each piece of codes, once read, meets up to 4 rows of x.
template <int R>
void channel_rows(const int8_t* w, int64_t group_size, const int8_t* xq, const float* xd, int64_t k, int64_t row,
                  int64_t col, float* sums) {
  const int8_t* q[R];
  const float* d[R];
  __m512 acc[R];
  for (int i = 0; i < R; ++i) {
    const int64_t at = (row + i) * k + col;  // the first of this row's codes in this group
    q[i] = xq + at, d[i] = xd + at / kBlock;
    acc[i] = _mm512_setzero_ps();
  }
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);  // lanes 0-7: block 0
  int64_t p = 0;
  for (; 64 * p + 64 <= group_size; ++p) {  // whole pairs of blocks
    const __m512i wu = _mm512_xor_si512(_mm512_loadu_si512(w + 64 * p), flip);
    for (int i = 0; i < R; ++i) {
      const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, _mm512_loadu_si512(q[i] + 64 * p));
      const __m512 two_d = _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(d[i] + 2 * p))));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_permutexvar_ps(halves, two_d), acc[i]);
    }
  }
  if (64 * p < group_size) {  // a last lone block: lanes 0-7, zeros above
    const __m512i wu = unsigned_codes(w + 64 * p, false);
    for (int i = 0; i < R; ++i) {
      const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, _mm512_maskz_loadu_epi8(0xFFFFFFFFULL, q[i] + 64 * p));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_maskz_mov_ps(0x00FF, _mm512_set1_ps(d[i][2 * p])), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) sums[i] = _mm512_reduce_add_ps(acc[i]);
}

// Here the 128 * sum(xq) that the unsigned weights add is taken off after the scaling:
// summed over a group, sum_b d[b] * 128 * sum(xq in b) is the same for every channel, so
// it is computed once per row and group (row_surplus), and the loop reads no offsets.
// S, the weight scales' type: float, or at::Half (a Q8_0 file's d; float(s) is exact, one
// F16C instruction where the CPU has it).
template <class S>
void channels_wide(const int8_t* codes, const S* ws, int64_t groups, int64_t n, int64_t group_size, const int8_t* xq,
                   const float* xd, const std::vector<float>& surplus, int64_t rows, int64_t n0, int64_t n1, float* out) {
  const int64_t k = groups * group_size;
  float sums[4];
  for (int64_t c = n0; c < n1; ++c) {
    for (int64_t r = 0; r < rows; ++r) out[r * n + c] = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* w = codes + (g * n + c) * group_size;
      for (int64_t r = 0; r < rows; r += 4) {
        const int64_t take = std::min<int64_t>(4, rows - r), col = g * group_size;
        if (take == 4) channel_rows<4>(w, group_size, xq, xd, k, r, col, sums);
        if (take == 3) channel_rows<3>(w, group_size, xq, xd, k, r, col, sums);
        if (take == 2) channel_rows<2>(w, group_size, xq, xd, k, r, col, sums);
        if (take == 1) channel_rows<1>(w, group_size, xq, xd, k, r, col, sums);
        for (int64_t i = 0; i < take; ++i) out[(r + i) * n + c] += (sums[i] - surplus[(r + i) * groups + g]) * float(ws[g * n + c]);
      }
    }
  }
}

// Layers in groups of 32 (the output head: codes (K / 32, N, 32)): block b of channels
// c and c + 1 lie side by side, so one instruction takes both channels against the
// same block of x (`paired`); lanes 0-7 sum channel c, lanes 8-15 channel c + 1.
template <class S>
void pairs_wide(const int8_t* codes, const S* ws, int64_t blocks, int64_t n, const PairedRows& x,
                int64_t rows, int64_t n0, int64_t n1, float* out) {
  const int64_t pairs = (n1 - n0 + 1) / 2;
  std::vector<__m512> acc(rows * pairs, _mm512_setzero_ps());
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t c = n0 + 2 * p;
      const bool two = c + 1 < n1;
      const __m512i wu = unsigned_codes(codes + (b * n + c) * kBlock, two);
      const __m512 w_scale = _mm512_insertf32x8(_mm512_set1_ps(float(ws[b * n + c])), _mm256_set1_ps(two ? float(ws[b * n + c + 1]) : 0.f), 1);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t at = (r * blocks + b) * 64;  // this row's copy of block b, twice
        const __m512i s = _mm512_dpbusd_epi32(_mm512_loadu_si512(x.offset.data() + at / 4), wu, _mm512_loadu_si512(x.q.data() + at));
        const __m512 scale = _mm512_mul_ps(w_scale, _mm512_loadu_ps(x.d.data() + at / 4));
        acc[r * pairs + p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r * pairs + p]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512 a = acc[r * pairs + p];
      const int64_t c = n0 + 2 * p;
      out[r * n + c] = _mm512_mask_reduce_add_ps(0x00FF, a);
      if (c + 1 < n1) out[r * n + c + 1] = _mm512_mask_reduce_add_ps(0xFF00, a);
    }
}

// Q5_0 layers: x in the form their loop reads: each int32 lane's -16 * (sum of its 4 codes),
// so that vpdpbusd over the unsigned codes u leaves sum((u - 16) * x), and each lane's block
// scale (K / 4 of each a row).
struct LaneRows {
  std::vector<int32_t> offset;
  std::vector<float> d;
  LaneRows(const int8_t* xq, const float* xd, int64_t rows, int64_t k) : offset(rows * k / 4), d(rows * k / 4) {
    for (int64_t i = 0; i < rows * k / 4; ++i) {
      const int8_t* four = xq + 4 * i;
      offset[i] = -16 * (four[0] + four[1] + four[2] + four[3]);
      d[i] = xd[i / 8];
    }
  }
};

// A pair of Q5_0 blocks as 64 unsigned codes u (0..31): the low 4 bits of block 2p in bytes
// 0-31, of block 2p + 1 in bytes 32-63, then 16 added where the high bit is set.
inline __m512i q5_codes(const uint8_t* nibbles, const uint8_t* high) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles));
  const __m256i low4 = _mm256_set1_epi8(15);
  const __m256i first = _mm256_and_si256(v, low4), second = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
  uint64_t bits;
  std::memcpy(&bits, high, 8);
  return _mm512_mask_add_epi8(u, _cvtu64_mask64(bits), u, _mm512_set1_epi8(16));
}

// Channel c of a Q5_0 layer against R rows of x: each pair of blocks, unpacked once, meets
// every row; lanes 0-7 hold block 2p's sums, lanes 8-15 block 2p + 1's.
template <int R>
void q5_channel_rows(const uint8_t* nibbles, const uint8_t* high, const at::Half* scale, int64_t k, const int8_t* xq,
                     const LaneRows& x, int64_t row, float* sums) {
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t p = 0; p < k / 64; ++p) {
    const __m512i u = q5_codes(nibbles + 32 * p, high + 8 * p);
    int32_t two;  // the pair's two float16 scales
    std::memcpy(&two, scale + 2 * p, 4);
    const __m512 w_scale = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(two))));
    for (int i = 0; i < R; ++i) {
      const int64_t at = (row + i) * k + 64 * p;
      const __m512i s = _mm512_dpbusd_epi32(_mm512_loadu_si512(x.offset.data() + at / 4), u, _mm512_loadu_si512(xq + at));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(w_scale, _mm512_loadu_ps(x.d.data() + at / 4)), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) sums[i] = _mm512_reduce_add_ps(acc[i]);
}

void q5_channels(const uint8_t* nibbles, const uint8_t* high, const at::Half* scale, int64_t n, int64_t k,
                 const int8_t* xq, const float* xd, const LaneRows& x, int64_t rows, int64_t n0, int64_t n1, float* out) {
  float sums[4];
  for (int64_t c = n0; c < n1; ++c) {
    const uint8_t* nib = nibbles + c * k / 2;
    const uint8_t* hb = high + c * k / 8;
    const at::Half* sc = scale + c * k / 32;
    for (int64_t r = 0; r < rows; r += 4) {
      const int64_t take = std::min<int64_t>(4, rows - r);
      if (take == 4) q5_channel_rows<4>(nib, hb, sc, k, xq, x, r, sums);
      if (take == 3) q5_channel_rows<3>(nib, hb, sc, k, xq, x, r, sums);
      if (take == 2) q5_channel_rows<2>(nib, hb, sc, k, xq, x, r, sums);
      if (take == 1) q5_channel_rows<1>(nib, hb, sc, k, xq, x, r, sums);
      for (int64_t i = 0; i < take; ++i) out[(r + i) * n + c] = sums[i];
    }
  }
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
// float32 to one 16-lane vector per channel (lane m: row m).
//
// Rows never mix: a row's outputs come from the same instructions in the same order
// whatever rows are beside it (rows past the last are zeros). The tiles take calls of
// kTileMinRows rows or more; fewer rows (a lone decode step) take the loops above, which
// add the same exact int32 sums in another float32 order, so a row there and here may
// differ in the last bits. Linux lends the tile registers to a process that asks
// (arch_prctl); where it refuses, the loops above run.
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
// ---------------------------------------------------------------------------
// Steps 2 and 3 elsewhere: one block at a time (AVX2), or plain C++.
// ---------------------------------------------------------------------------
#if defined(__AVX2__)
#include <immintrin.h>

// One block: 8 int32 lanes whose sum is sum_j w[j] * x[j]. vpmaddubsw multiplies an
// unsigned byte by a signed one, so the signs move onto x: |w| * (x * sign(w)) = w * x
// (|-128| = 128 fits an unsigned byte; x is never -128, so x * sign(w) fits a signed one).
inline __m256i block_dot(const int8_t* w, const int8_t* x) {
  const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i aw = _mm256_abs_epi8(wv);       // |w| as unsigned bytes
  const __m256i sx = _mm256_sign_epi8(xv, wv);  // x * sign(w), 0 where w = 0
  const __m256i pairs = _mm256_maddubs_epi16(aw, sx);  // 16 sums of 2, at most 2 * 128 * 127: no saturation
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

inline float group_dot(const int8_t* w, const int8_t* xq, const float* xd, int64_t blocks, float w_scale) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b)
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(w + b * kBlock, xq + b * kBlock)), _mm256_set1_ps(xd[b] * w_scale), acc);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
inline float group_dot(const int8_t* w, const int8_t* xq, const float* xd, int64_t blocks, float w_scale) {
  float acc = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) sum += int32_t(w[b * kBlock + j]) * int32_t(xq[b * kBlock + j]);
    acc += float(sum) * (xd[b] * w_scale);
  }
  return acc;
}
#endif

// Output channels n0 .. n1 for every row: each channel's group of codes, once read, stays
// in L1 while every row of x takes its turn.
template <class S>
void channels_narrow(const int8_t* codes, const S* ws, int64_t groups, int64_t n, int64_t group_size,
                     const int8_t* xq, const float* xd, int64_t rows, int64_t k, int64_t n0, int64_t n1, float* out) {
  const int64_t group_blocks = group_size / kBlock;
  for (int64_t c = n0; c < n1; ++c)
    for (int64_t r = 0; r < rows; ++r) out[r * n + c] = 0.f;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = n0; c < n1; ++c)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t first = (r * k + g * group_size) / kBlock;
        out[r * n + c] += group_dot(codes + (g * n + c) * group_size, xq + first * kBlock, xd + first, group_blocks, float(ws[g * n + c]));
      }
}
#endif

#if !defined(LOLLM_AVX512)
// Q5_0 layers elsewhere: each pair of blocks is unpacked to 64 signed codes once, then
// every row takes its turn, one block at a time.
void q5_channels(const uint8_t* nibbles, const uint8_t* high, const at::Half* scale, int64_t n, int64_t k,
                 const int8_t* xq, const float* xd, int64_t rows, int64_t n0, int64_t n1, float* out) {
  int8_t codes[64];
  for (int64_t c = n0; c < n1; ++c) {
    for (int64_t r = 0; r < rows; ++r) out[r * n + c] = 0.f;
    for (int64_t p = 0; p < k / 64; ++p) {
      unpack_q5_pair(nibbles + c * k / 2 + 32 * p, high + c * k / 8 + 8 * p, codes);
      const float d0 = float(scale[c * k / 32 + 2 * p]), d1 = float(scale[c * k / 32 + 2 * p + 1]);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t first = (r * k + 64 * p) / kBlock;
        out[r * n + c] += group_dot(codes, xq + first * kBlock, xd + first, 1, d0) +
                          group_dot(codes + kBlock, xq + (first + 1) * kBlock, xd + first + 1, 1, d1);
      }
    }
  }
}
#endif

// Steps 2 and 3 of block_int8_linear: out (M, N) from x's codes xq and block scales xd (step 1)
// and the weights codes (groups, N, group_size) and scale (groups, N) of type S (float or at::Half).
template <class S>
void int8_steps(const std::vector<int8_t>& xq, const std::vector<float>& xd, int64_t rows, int64_t k, const int8_t* w,
                const S* ws, int64_t groups, int64_t n, int64_t group_size, float* out) {
  const int64_t tasks = (n + kChannels - 1) / kChannels;  // tasks of 16 channels, over torch's threads
#if defined(LOLLM_AMX)
  if (rows >= kTileMinRows && tiles_permitted()) {
    over_tile_tasks(xq, xd, rows, k, n, [&](const TileRows& x, int64_t n0, int64_t n1, std::vector<int8_t>& spare) {
      int8_tile_task(w, ws, groups, n, group_size, x, rows, n0, n1, spare, out);
    });
    return;
  }
#endif
#if defined(LOLLM_AVX512)
  const bool paired = group_size == kBlock;
  const PairedRows wide(xq.data(), xd.data(), paired ? rows : 0, k);  // only the grouped loop reads it
  const std::vector<float> surplus = paired ? std::vector<float>() : row_surplus(xq.data(), xd.data(), rows, k, group_size);
#endif
  at::parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t n0 = task * kChannels, n1 = std::min(n, n0 + kChannels);
#if defined(LOLLM_AVX512)
      if (paired)
        pairs_wide(w, ws, groups, n, wide, rows, n0, n1, out);
      else
        channels_wide(w, ws, groups, n, group_size, xq.data(), xd.data(), surplus, rows, n0, n1, out);
#else
      channels_narrow(w, ws, groups, n, group_size, xq.data(), xd.data(), rows, k, n0, n1, out);
#endif
    }
  });
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

  std::vector<int8_t> xq(rows * k);  // step 1
  std::vector<float> xd(rows * (k / kBlock));
  quantize_rows(x.data_ptr<float>(), rows, k, xq.data(), xd.data());

  at::Tensor y = at::empty({rows, n}, x.options());
  const int8_t* w = codes.data_ptr<int8_t>();
  if (half)
    int8_steps(xq, xd, rows, k, w, scale.data_ptr<at::Half>(), groups, n, group_size, y.data_ptr<float>());
  else
    int8_steps(xq, xd, rows, k, w, scale.data_ptr<float>(), groups, n, group_size, y.data_ptr<float>());
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

  std::vector<int8_t> xq(rows * k);  // step 1, as for int8 weights
  std::vector<float> xd(rows * (k / kBlock));
  quantize_rows(x.data_ptr<float>(), rows, k, xq.data(), xd.data());
  at::Tensor y = at::empty({rows, n}, x.options());
  float* out = y.data_ptr<float>();
  const uint8_t* nib = nibbles.data_ptr<uint8_t>();
  const uint8_t* hb = high.data_ptr<uint8_t>();
  const at::Half* sc = scale.data_ptr<at::Half>();
#if defined(LOLLM_AMX)
  if (rows >= kTileMinRows && tiles_permitted()) {
    over_tile_tasks(xq, xd, rows, k, n, [&](const TileRows& x, int64_t n0, int64_t n1, std::vector<int8_t>& spare) {
      q5_tile_task(nib, hb, sc, k, x, rows, n, n0, n1, spare, out);
    });
    return y;
  }
#endif
#if defined(LOLLM_AVX512)
  const LaneRows lanes(xq.data(), xd.data(), rows, k);
#endif
  at::parallel_for(0, (n + kChannels - 1) / kChannels, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t n0 = task * kChannels, n1 = std::min(n, n0 + kChannels);
#if defined(LOLLM_AVX512)
      q5_channels(nib, hb, sc, n, k, xq.data(), xd.data(), lanes, rows, n0, n1, out);
#else
      q5_channels(nib, hb, sc, n, k, xq.data(), xd.data(), rows, n0, n1, out);
#endif
    }
  });
  return y;
}

// The weights of a Q5_0 matrix as bfloat16 (N, K): (u - 16) * d, rounded once. The many-rows
// path (a prefill) multiplies these in one bfloat16 matmul, a slice of channels at a time.
at::Tensor block_q5_dequantize(const at::Tensor& nibbles, const at::Tensor& high, const at::Tensor& scale) {
  const int64_t k = nibbles.dim() == 2 ? 2 * nibbles.size(1) : 0;
  check_q5_weights("block_q5_dequantize", nibbles, high, scale, k);
  const int64_t n = nibbles.size(0);
  at::Tensor w = at::empty({n, k}, nibbles.options().dtype(at::kBFloat16));
  const uint8_t* nib = nibbles.data_ptr<uint8_t>();
  const uint8_t* hb = high.data_ptr<uint8_t>();
  const at::Half* sc = scale.data_ptr<at::Half>();
  c10::BFloat16* out = w.data_ptr<c10::BFloat16>();
  at::parallel_for(0, n * (k / 64), 64, [&](int64_t first, int64_t last) {
    for (int64_t pair = first; pair < last; ++pair) {  // pair = c * (K / 64) + p: 64 weights of channel c
#if defined(LOLLM_AVX512) && defined(__AVX512BF16__)
      const __m512i u = q5_codes(nib + 32 * pair, hb + 8 * pair);
      for (int b = 0; b < 2; ++b) {
        const __m512 d = _mm512_set1_ps(float(sc[2 * pair + b]));
        for (int quarter = 0; quarter < 2; ++quarter) {
          const __m128i bytes = _mm512_extracti32x4_epi32(u, 2 * b + quarter);
          const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(bytes), _mm512_set1_epi32(16)));
          const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(v, d));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * pair + 32 * b + 16 * quarter), reinterpret_cast<const __m256i&>(h));
        }
      }
#else
      int8_t codes[64];
      unpack_q5_pair(nib + 32 * pair, hb + 8 * pair, codes);
      for (int j = 0; j < 64; ++j) out[64 * pair + j] = c10::BFloat16(float(codes[j]) * float(sc[2 * pair + j / 32]));
#endif
    }
  });
  return w;
}

// Which version of step 2 this build compiled (lollm.native.status names it).
std::string instruction_set() {
#if defined(LOLLM_AMX)
  if (tiles_permitted()) return "AVX-512 VNNI, AMX tiles from " + std::to_string(kTileMinRows) + " rows";
#endif
#if defined(LOLLM_AVX512)
  return "AVX-512 VNNI";
#elif defined(__AVX2__)
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
  m.def("block_q5_dequantize(Tensor nibbles, Tensor high, Tensor scale) -> Tensor", &block_q5_dequantize);
  m.def("instruction_set() -> str", &instruction_set);
  m.def("tile_min_rows() -> int", &tile_min_rows);
}
