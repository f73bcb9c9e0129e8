// Paged attention on the CPU for an engine step, with every query computed alone.
//
// Read it next to docs/batching.md, section 9. The engine runs the new tokens of B
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
#include <vector>

namespace {

constexpr int64_t kLanes = 16;    // query heads a task computes side by side (one vector of 16 floats)
constexpr int64_t kKeyTile = 8;   // keys whose dot products run side by side (8 independent chains)

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

// What one task needs to know about the call: the pool's shape, the scores' factors, and
// where in the pool position j of a sequence lives.
template <typename T>
struct Pool {
  const T* k;
  const T* v;
  int64_t block_size, kv_heads, dim;
  // The D values of key/value head g at position j, for a sequence whose block table is `table`.
  const T* row(const T* base, const int64_t* table, int64_t j, int64_t g) const {
    const int64_t block = table[j / block_size];
    return base + ((block * block_size + j % block_size) * kv_heads + g) * dim;
  }
};

// A row of the pool as float32: float32 pools are read in place, bfloat16 and float16 ones
// are widened (exactly) into `scratch` first.
inline const float* as_float(const float* row, int64_t, float*) { return row; }
template <typename T>
inline const float* as_float(const T* row, int64_t dim, float* scratch) {
  for (int64_t d = 0; d < dim; ++d) scratch[d] = static_cast<float>(row[d]);
  return scratch;
}

// Step 1 for up to kKeyTile keys at once, every lane one query head:
// q_t (D, kLanes): the task's queries transposed, zero in the lanes past its R heads;
// keys[t] (D,): key t's values; scores (kKeyTile, kLanes) out. Key t's chain over d is
// the same whatever t is and whatever else shares the tile.
inline void dot_tile(const float* q_t, const float* const* keys, int64_t dim, float* scores) {
  float acc[kKeyTile][kLanes] = {};
  for (int64_t d = 0; d < dim; ++d) {
    const float* qd = q_t + d * kLanes;
    for (int64_t t = 0; t < kKeyTile; ++t) {
      const float kd = keys[t][d];
      for (int64_t h = 0; h < kLanes; ++h) acc[t][h] = std::fma(qd[h], kd, acc[t][h]);
    }
  }
  std::memcpy(scores, acc, sizeof acc);
}

// Steps 1 and 2 for one task: s (n, kLanes) the scores of its n keys, and their maximum
// m (kLanes,) per head. `first` is the task's first visible position.
template <typename T>
void scores_of(const Pool<T>& pool, const int64_t* table, int64_t g, int64_t first, int64_t n, const float* q_t,
               float scale, std::optional<double> softcap, float* s, float* m, std::vector<float>& scratch) {
  const int64_t dim = pool.dim;
  const float* keys[kKeyTile];
  float tile[kKeyTile * kLanes];
  for (int64_t j0 = 0; j0 < n; j0 += kKeyTile) {
    const int64_t count = std::min(kKeyTile, n - j0);
    for (int64_t t = 0; t < kKeyTile; ++t) {  // a short last tile repeats its last key; the copies are dropped
      const int64_t j = first + j0 + std::min(t, count - 1);
      keys[t] = as_float(pool.row(pool.k, table, j, g), dim, scratch.data() + t * dim);
    }
    dot_tile(q_t, keys, dim, tile);
    std::memcpy(s + j0 * kLanes, tile, count * kLanes * sizeof(float));
  }
  for (int64_t i = 0; i < n * kLanes; ++i) s[i] = s[i] * scale;
  if (softcap) {
    const float cap = static_cast<float>(*softcap);
    for (int64_t i = 0; i < n * kLanes; ++i) s[i] = cap * std::tanh(s[i] / cap);
  }
  std::fill(m, m + kLanes, -INFINITY);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t h = 0; h < kLanes; ++h) m[h] = std::max(m[h], s[j * kLanes + h]);
}

// Steps 3 to 5 for one task: e_j in place of s, then l and o summed in ascending j, then
// out (R, D) float32 = o / l for its `heads` = R query heads.
template <typename T>
void weigh_values(const Pool<T>& pool, const int64_t* table, int64_t g, int64_t first, int64_t n, int64_t heads,
                  float* s, const float* m, float* o, float* out, std::vector<float>& scratch) {
  const int64_t dim = pool.dim;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t h = 0; h < kLanes; ++h) s[j * kLanes + h] = exp_nonpositive(s[j * kLanes + h] - m[h]);
  float l[kLanes] = {};
  std::fill(o, o + heads * dim, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const float* e = s + j * kLanes;
    for (int64_t h = 0; h < kLanes; ++h) l[h] = l[h] + e[h];
    const float* v = as_float(pool.row(pool.v, table, first + j, g), dim, scratch.data());
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < dim; ++d) o[h * dim + d] = std::fma(e[h], v[d], o[h * dim + d]);
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = 0; d < dim; ++d) out[h * dim + d] = o[h * dim + d] / l[h];
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
// the threads. The tasks are dealt out in strides of kDeal, so that each thread's share
// holds short and long rows alike (a prefill's late queries see more keys than its early
// ones); which thread runs a task changes nothing in its result.
constexpr int64_t kDeal = 64;

template <typename T>
void run_tasks(const Pool<T>& pool, const at::Tensor& q, const at::Tensor& tables, const Layout& layout,
               std::optional<int64_t> window, std::optional<double> softcap, float scale, float* out) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = pool.dim, group = heads / pool.kv_heads;
  const int64_t tasks = rows * pool.kv_heads, width = tables.size(1);
  const int64_t per = (tasks + kDeal - 1) / kDeal;  // dealt task k is task (k % per) * kDeal + k / per
  const float* qs = q.data_ptr<float>();
  const int64_t* table = tables.data_ptr<int64_t>();
  at::parallel_for(0, per * kDeal, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_t(dim * kLanes), s(layout.longest * kLanes), m(kLanes), o(kLanes * dim);
    std::vector<float> scratch(kKeyTile * dim), results(kLanes * dim);
    for (int64_t k = begin; k < end; ++k) {
      const int64_t index = (k % per) * kDeal + k / per;
      if (index >= tasks) continue;
      const int64_t row = index / pool.kv_heads, g = index % pool.kv_heads;
      const int64_t b = layout.seq[row], p = layout.position[row];
      const int64_t first = window ? std::max<int64_t>(0, p - *window + 1) : 0, n = p + 1 - first;
      for (int64_t h0 = 0; h0 < group; h0 += kLanes) {  // R > 16 query heads per K/V head: 16 at a time
        const int64_t lanes = std::min(kLanes, group - h0);
        std::fill(q_t.begin(), q_t.end(), 0.f);
        for (int64_t h = 0; h < lanes; ++h)
          for (int64_t d = 0; d < dim; ++d) q_t[d * kLanes + h] = qs[(row * heads + g * group + h0 + h) * dim + d];
        scores_of(pool, table + b * width, g, first, n, q_t.data(), scale, softcap, s.data(), m.data(), scratch);
        weigh_values(pool, table + b * width, g, first, n, lanes, s.data(), m.data(), o.data(), results.data(), scratch);
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
                "paged_attention: tables, starts and counts must be contiguous int64 CPU tensors, got ", t->scalar_type());
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
