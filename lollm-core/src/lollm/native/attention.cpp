// Paged attention on the CPU for an engine step, with every query computed alone.
//
// Read it next to docs/batch-invariance.md, "Batch invariance in attention". The engine runs the new tokens of B
// sequences as one step (lollm/batch.py); each sequence's keys and values sit in
// blocks of a shared pool, found through its block table (lollm/engine/cache.py).
// torch's scaled_dot_product_attention gives a query's row different last bits
// depending on how many queries and keys share its call (it tiles the sums by the
// call's shape), so the same request, batched with others or chunked by another
// token budget, drifts in its last bits, and int8 activations downstream can turn
// that into another token. This kernel computes each (query, head) by one fixed
// sequence of float32 operations that depends on nothing but that query and the
// keys and values it sees ("the canonical order"):
//
//   query i of sequence b sits at position p = starts[b] + i and sees the keys
//   j = first .. p, first = max(0, p - W + 1) with a sliding window W, else 0;
//   query head h reads key/value head g = h / R (GQA: R = H / K heads share one);
//
//   1. s_j = dot(q, k_j): d = 0, 1, .., D-1 in order, s = fma(q[d], k_j[d], s) from s = 0;
//      then s_j = s_j * scale, and with a soft-cap s_j = cap * tanh(s_j / cap);
//   2. m = max_j s_j (a maximum is exact: its order does not matter);
//   3. e_j = exp(s_j - m), by exp_nonpositive below (the same float operations for every j);
//   4. l = e_first + e_first+1 + ... + e_p, added in ascending j;
//      o[d] = fma(e_j, v_j[d], o[d]) in ascending j, from o = 0;
//   5. out[d] = o[d] / l.
//
// Nothing in it depends on how many queries, sequences or threads share the call:
// there is no padding, no tile of keys whose size follows the call's shape, and no
// sum shared between threads. Each task is one query row and one key/value head (its R
// query heads together, so that each key is read once for all of them), and a task
// runs on one thread from start to end.
//
// How it is fast without breaking that order: every sum above is a chain over j (or d)
// for ONE head, so the vector lanes hold different heads (steps 1, 2, 4's l) or
// different d (step 4's o), never pieces of one sum. A lane computes exactly what a
// scalar loop computes, so the plain C++ below gives the same bits whether the compiler
// makes vectors of 16 lanes (AVX-512), of 8 (AVX2) or none: no intrinsics are needed,
// and the AVX2 and portable builds agree with the AVX-512 one bit for bit. Every
// multiply-add is written as std::fma and no product feeds an addition otherwise, so
// the compiler's contraction of a * b + c into an fma cannot change a result either.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

// The vector versions of steps 1 and 4 need AVX2 and FMA (8 floats a vector; an AVX-512 CPU has
// both); every other CPU runs the plain C++ versions, which give the same bits.
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LOLLM_ATTENTION_VECTORS 1
#endif

namespace {

constexpr int64_t kLanes = 8;    // query heads a task computes side by side (one vector of 8 floats)
constexpr int64_t kKeyTile = 8;  // keys whose dot products run side by side (8 independent chains)

// Step 3's e^x for x <= 0 (a score minus its row's maximum), by float32 operations only
// (no library call, whose vector and scalar versions may differ in the last bit):
//   a. x = n ln2 + r with n = round(x / ln2), |r| <= ln2 / 2 (ln2 in two parts, so r is exact);
//   b. e^r by a polynomial of degree 7 (the coefficients of the Cephes library's expf,
//      within about 1 ulp of e^r on that interval);
//   c. e^x = e^r * 2^n, 2^n built from its exponent bits.
// Below x = -87, e^x < 2^-125: it is flushed to 0 (a key that far below the maximum adds
// nothing a float32 sum of at least 1 could hold). A NaN stays NaN.
inline float exp_nonpositive(float x) {
  const float xc = x >= -87.f ? x : -87.f;  // NaN compares false: clamped here, returned as NaN below
  const float n = std::nearbyint(xc * 1.44269504088896341f);
  float r = std::fma(n, -0.693359375f, xc);
  r = std::fma(n, 2.12194440e-4f, r);
  float poly = 1.9875691500e-4f;
  poly = std::fma(poly, r, 1.3981999507e-3f);
  poly = std::fma(poly, r, 8.3334519073e-3f);
  poly = std::fma(poly, r, 4.1665795894e-2f);
  poly = std::fma(poly, r, 1.6666665459e-1f);
  poly = std::fma(poly, r, 5.0000001201e-1f);
  poly = std::fma(poly, r * r, r);
  poly = poly + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // n in [-126, 0]: a normal 2^n
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  const float e = poly * two_n;
  return x >= -87.f ? e : (x < -87.f ? 0.f : x);
}

// Where a task's keys and values lie: the n rows of key/value head g from its first visible
// position on, as float32 pointers. A float32 pool is read in place; a bfloat16 or float16
// one is widened (exactly) into `scratch` (2 n D floats) first.
inline const float* widen(const float* row, int64_t, float*) { return row; }
template <typename T>
inline const float* widen(const T* row, int64_t dim, float* into) {
  for (int64_t d = 0; d < dim; ++d) into[d] = static_cast<float>(row[d]);
  return into;
}

template <typename T>
struct Pool {
  const T* k;
  const T* v;
  int64_t block_size, kv_heads, dim;

  void rows(const int64_t* table, int64_t g, int64_t first, int64_t n, const float** krow, const float** vrow,
            float* scratch) const {
    for (int64_t j = 0; j < n;) {  // a block at a time: one division per block, not per key
      const int64_t position = first + j, block = table[position / block_size];
      for (int64_t slot = position % block_size; slot < block_size && j < n; ++slot, ++j) {
        const int64_t at = ((block * block_size + slot) * kv_heads + g) * dim;
        krow[j] = widen(k + at, dim, scratch + 2 * j * dim);
        vrow[j] = widen(v + at, dim, scratch + (2 * j + 1) * dim);
      }
    }
  }
};

// Step 1: s (n, kLanes) = the dot products of the task's queries with its n keys.
// q_t (D, kLanes): the queries transposed, zero in the lanes past its heads. Every lane of
// every key runs the chain s = fma(q[d], k[d], s), d = 0 .. D-1, whatever key shares its tile.
#if defined(LOLLM_ATTENTION_VECTORS)
void dot_products(const float* q_t, const float* const* krow, int64_t n, int64_t dim, float* s) {
  for (int64_t j0 = 0; j0 < n; j0 += kKeyTile) {
    const float* k[kKeyTile];
    for (int64_t t = 0; t < kKeyTile; ++t) k[t] = krow[std::min(j0 + t, n - 1)];  // a short tile repeats its last key
    __m256 acc[kKeyTile];
    for (int64_t t = 0; t < kKeyTile; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
      const __m256 qd = _mm256_loadu_ps(q_t + d * kLanes);  // the heads' q[d], one per lane
      for (int64_t t = 0; t < kKeyTile; ++t) acc[t] = _mm256_fmadd_ps(qd, _mm256_set1_ps(k[t][d]), acc[t]);
    }
    for (int64_t t = 0; t < std::min(kKeyTile, n - j0); ++t) _mm256_storeu_ps(s + (j0 + t) * kLanes, acc[t]);
  }
}
#else
void dot_products(const float* q_t, const float* const* krow, int64_t n, int64_t dim, float* s) {
  for (int64_t j = 0; j < n; ++j) {
    float acc[kLanes] = {};
    for (int64_t d = 0; d < dim; ++d)
      for (int64_t h = 0; h < kLanes; ++h) acc[h] = std::fma(q_t[d * kLanes + h], krow[j][d], acc[h]);
    std::memcpy(s + j * kLanes, acc, sizeof acc);
  }
}
#endif

// Steps 1 (the factors), 2 and 3 over s (n, kLanes): s = s * scale, the soft-cap, the
// maximum m per head, then e = exp(s - m) in place.
void softmax_numerators(float* s, int64_t n, float scale, std::optional<double> softcap) {
  for (int64_t i = 0; i < n * kLanes; ++i) s[i] = s[i] * scale;
  if (softcap) {
    const float cap = static_cast<float>(*softcap);
    for (int64_t i = 0; i < n * kLanes; ++i) s[i] = cap * std::tanh(s[i] / cap);
  }
  float m[kLanes];
  std::fill(m, m + kLanes, -INFINITY);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t h = 0; h < kLanes; ++h) m[h] = s[j * kLanes + h] > m[h] ? s[j * kLanes + h] : m[h];
  for (int64_t j = 0; j < n; ++j)
    for (int64_t h = 0; h < kLanes; ++h) s[j * kLanes + h] = exp_nonpositive(s[j * kLanes + h] - m[h]);
}

// Steps 4 and 5: l = sum of e_j, o = sum of e_j v_j, both in ascending j, and out (heads, D)
// = o / l. e (n, kLanes) from softmax_numerators; vrow the n value rows.
#if defined(LOLLM_ATTENTION_VECTORS)
void weighted_values(const float* e, const float* const* vrow, int64_t n, int64_t heads, int64_t dim, float* out) {
  __m256 l = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) l = _mm256_add_ps(l, _mm256_loadu_ps(e + j * kLanes));
  float total[kLanes];
  _mm256_storeu_ps(total, l);
  for (int64_t h = 0; h < heads; ++h) {
    int64_t d0 = 0;
    for (; d0 + 32 <= dim; d0 += 32) {  // 32 of the D outputs at a time, four vectors held over the j loop
      __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
      for (int64_t j = 0; j < n; ++j) {
        const __m256 w = _mm256_set1_ps(e[j * kLanes + h]);
        const float* v = vrow[j] + d0;
        o0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), o0);
        o1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), o1);
        o2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), o2);
        o3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), o3);
      }
      const __m256 lh = _mm256_set1_ps(total[h]);
      _mm256_storeu_ps(out + h * dim + d0, _mm256_div_ps(o0, lh));
      _mm256_storeu_ps(out + h * dim + d0 + 8, _mm256_div_ps(o1, lh));
      _mm256_storeu_ps(out + h * dim + d0 + 16, _mm256_div_ps(o2, lh));
      _mm256_storeu_ps(out + h * dim + d0 + 24, _mm256_div_ps(o3, lh));
    }
    for (; d0 < dim; d0 += 8) {  // D a multiple of 8 (run_tasks checks): the rest, a vector at a time
      __m256 o = _mm256_setzero_ps();
      for (int64_t j = 0; j < n; ++j) o = _mm256_fmadd_ps(_mm256_set1_ps(e[j * kLanes + h]), _mm256_loadu_ps(vrow[j] + d0), o);
      _mm256_storeu_ps(out + h * dim + d0, _mm256_div_ps(o, _mm256_set1_ps(total[h])));
    }
  }
}
#endif

// The same in plain C++ (the build without AVX2, and head widths that are no multiple of 8).
void weighted_values_plain(const float* e, const float* const* vrow, int64_t n, int64_t heads, int64_t dim,
                           float* out) {
  float l[kLanes] = {};
  for (int64_t j = 0; j < n; ++j)
    for (int64_t h = 0; h < kLanes; ++h) l[h] = l[h] + e[j * kLanes + h];
  std::fill(out, out + heads * dim, 0.f);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < dim; ++d) out[h * dim + d] = std::fma(e[j * kLanes + h], vrow[j][d], out[h * dim + d]);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < dim; ++d) out[h * dim + d] = out[h * dim + d] / l[h];
}

// The call's layout: which sequence each query row belongs to, and where it sits.
struct Layout {
  std::vector<int64_t> seq;       // (N,) the sequence of each query row
  std::vector<int64_t> position;  // (N,) its position in that sequence
  int64_t longest = 0;            // the most keys one query sees
};

// Checks the tables against the pool and lays the rows out; a TORCH_CHECK names what is wrong.
Layout lay_out(const at::Tensor& tables, const at::Tensor& starts, const at::Tensor& counts, int64_t rows,
               int64_t blocks, int64_t block_size, std::optional<int64_t> window) {
  const int64_t batch = tables.size(0), width = tables.size(1);
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* count = counts.data_ptr<int64_t>();
  Layout layout;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(start[b] >= 0 && count[b] >= 1, "paged_attention: sequence ", b, " has start ", start[b],
                " and count ", count[b], " (want start >= 0, count >= 1)");
    const int64_t last = start[b] + count[b] - 1;
    const int64_t first = window ? std::max<int64_t>(0, start[b] - *window + 1) : 0;  // its first query's first key
    TORCH_CHECK(last / block_size < width, "paged_attention: sequence ", b, " reaches position ", last,
                " but its row of tables holds ", width, " blocks of ", block_size);
    for (int64_t i = first / block_size; i <= last / block_size; ++i) {
      const int64_t block = table[b * width + i];
      TORCH_CHECK(block >= 0 && block < blocks, "paged_attention: tables[", b, ", ", i, "] = ", block,
                  " is no block of a pool of ", blocks, ", and sequence ", b, " reads positions ",
                  i * block_size, ".. of it");
    }
    for (int64_t p = start[b]; p <= last; ++p) {
      layout.seq.push_back(b);
      layout.position.push_back(p);
      layout.longest = std::max(layout.longest, p + 1 - (window ? std::max<int64_t>(0, p - *window + 1) : 0));
    }
  }
  TORCH_CHECK(static_cast<int64_t>(layout.seq.size()) == rows, "paged_attention: counts add up to ",
              layout.seq.size(), " queries, q holds ", rows);
  return layout;
}

// Every task of the call: task (row, g) for each query row and key/value head, spread over
// the threads. The tasks are dealt like cards into up to kDeal hands, hand l holding tasks
// l, l + hands, l + 2 hands, ..., and the threads share out the hands: each thread's share
// holds short and long rows alike (a prefill's late queries see more keys than its early
// ones), and a decode step's few tasks still reach every thread. Which thread runs a task
// changes nothing in its result.
constexpr int64_t kDeal = 64;

template <typename T>
void run_tasks(const Pool<T>& pool, const at::Tensor& q, const at::Tensor& tables, const Layout& layout,
               std::optional<int64_t> window, std::optional<double> softcap, float scale, float* out) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = pool.dim, group = heads / pool.kv_heads;
  const int64_t tasks = rows * pool.kv_heads, width = tables.size(1);
  const int64_t hands = std::min(tasks, kDeal);
  const float* qs = q.data_ptr<float>();
  const int64_t* table = tables.data_ptr<int64_t>();
  const bool widened = !std::is_same_v<T, float>;
  at::parallel_for(0, hands, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_t(dim * kLanes), s(layout.longest * kLanes), results(kLanes * dim);
    std::vector<float> scratch(widened ? 2 * layout.longest * dim : 0);
    std::vector<const float*> krow(layout.longest), vrow(layout.longest);
    for (int64_t hand = begin; hand < end; ++hand)
      for (int64_t index = hand; index < tasks; index += hands) {
        const int64_t row = index / pool.kv_heads, g = index % pool.kv_heads;  // task (row, g)
        const int64_t b = layout.seq[row], p = layout.position[row];
        const int64_t first = window ? std::max<int64_t>(0, p - *window + 1) : 0, n = p + 1 - first;
        pool.rows(table + b * width, g, first, n, krow.data(), vrow.data(), scratch.data());
        for (int64_t h0 = 0; h0 < group; h0 += kLanes) {  // more than 8 query heads per K/V head: 8 at a time
          const int64_t lanes = std::min(kLanes, group - h0);
          const float* qh = qs + (row * heads + g * group + h0) * dim;  // (lanes, D)
          std::fill(q_t.begin(), q_t.end(), 0.f);
          for (int64_t h = 0; h < lanes; ++h)
            for (int64_t d = 0; d < dim; ++d) q_t[d * kLanes + h] = qh[h * dim + d];
          dot_products(q_t.data(), krow.data(), n, dim, s.data());
          softmax_numerators(s.data(), n, scale, softcap);
#if defined(LOLLM_ATTENTION_VECTORS)
          if (dim % 8 == 0)
            weighted_values(s.data(), vrow.data(), n, lanes, dim, results.data());
          else
#endif
            weighted_values_plain(s.data(), vrow.data(), n, lanes, dim, results.data());
          std::memcpy(out + (row * heads + g * group + h0) * dim, results.data(), lanes * dim * sizeof(float));
        }
      }
  });
}

}  // namespace

// q (N, H, D) float32; k_pool, v_pool (blocks, block_size, K, D) float32, bfloat16 or float16;
// tables (B, max_blocks) int64, -1 where a sequence has no block (past its end, or released
// before its window); starts, counts (B,) int64: the positions each sequence held before the
// step and the queries it brings (N = sum of counts, laid end to end in sequence order).
// window: W or None; softcap: cap or None; scale: the factor on q . k.
// Returns (N, H, D) float32.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& tables, const at::Tensor& starts, const at::Tensor& counts,
                           std::optional<int64_t> window, std::optional<double> softcap, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous() && q.device().is_cpu(),
              "paged_attention: q must be a contiguous float32 CPU tensor (N, H, D), got ", q.sizes(), " ", q.scalar_type());
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.sizes() == v_pool.sizes() && k_pool.scalar_type() == v_pool.scalar_type() &&
              k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.device().is_cpu() && v_pool.device().is_cpu(),
              "paged_attention: k_pool and v_pool must be contiguous CPU tensors of one shape (blocks, block_size, K, D), got ",
              k_pool.sizes(), " and ", v_pool.sizes());
  const int64_t blocks = k_pool.size(0), block_size = k_pool.size(1), kv_heads = k_pool.size(2), dim = k_pool.size(3);
  TORCH_CHECK(q.size(2) == dim && kv_heads >= 1 && q.size(1) % kv_heads == 0,
              "paged_attention: q ", q.sizes(), " does not fit pools of ", kv_heads, " heads of ", dim,
              " (H must be a multiple of K, D the same)");
  for (const at::Tensor* t : {&tables, &starts, &counts})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(),
                "paged_attention: tables, starts and counts must be contiguous int64 CPU tensors, got one of ",
                t->scalar_type(), " ", t->sizes(), t->is_contiguous() ? "" : " not contiguous", " on ", t->device());
  TORCH_CHECK(tables.dim() == 2 && starts.dim() == 1 && counts.dim() == 1 && starts.size(0) == tables.size(0) &&
              counts.size(0) == tables.size(0),
              "paged_attention: want tables (B, max_blocks), starts and counts (B,), got ", tables.sizes(), ", ",
              starts.sizes(), ", ", counts.sizes());
  TORCH_CHECK(!window || *window >= 1, "paged_attention: window ", *window, " (want >= 1, or None)");
  TORCH_CHECK(!softcap || *softcap > 0, "paged_attention: softcap ", *softcap, " (want > 0, or None)");
  const Layout layout = lay_out(tables, starts, counts, q.size(0), blocks, block_size, window);

  at::Tensor out = at::empty(q.sizes(), q.options());
  const float factor = static_cast<float>(scale);
  switch (k_pool.scalar_type()) {
    case at::kFloat:
      run_tasks(Pool<float>{k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), block_size, kv_heads, dim}, q, tables,
                layout, window, softcap, factor, out.data_ptr<float>());
      break;
    case at::kBFloat16:
      run_tasks(Pool<c10::BFloat16>{k_pool.data_ptr<c10::BFloat16>(), v_pool.data_ptr<c10::BFloat16>(), block_size,
                                    kv_heads, dim}, q, tables, layout, window, softcap, factor, out.data_ptr<float>());
      break;
    case at::kHalf:
      run_tasks(Pool<c10::Half>{k_pool.data_ptr<c10::Half>(), v_pool.data_ptr<c10::Half>(), block_size, kv_heads, dim},
                q, tables, layout, window, softcap, factor, out.data_ptr<float>());
      break;
    default:
      TORCH_CHECK(false, "paged_attention: pools of ", k_pool.scalar_type(), " (want float32, bfloat16 or float16)");
  }
  return out;
}

// The operators' namespace, as in block_int8.cpp (which holds the library's TORCH_LIBRARY):
// lollm_native, or another name for the test builds of the other versions.
#ifndef LOLLM_NATIVE_NAMESPACE
#define LOLLM_NATIVE_NAMESPACE lollm_native
#endif
#define LOLLM_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)

LOLLM_LIBRARY_FRAGMENT(LOLLM_NATIVE_NAMESPACE, m) {
  m.def("paged_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor starts, Tensor counts, "
        "int? window, float? softcap, float scale) -> Tensor",
        &paged_attention);
}
