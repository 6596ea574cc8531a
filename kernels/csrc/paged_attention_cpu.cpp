// Paged attention on CPU that reads K/V straight out of the paged pool: no per-step gather of
// a sequence's context. Built at first use by `sluice.kernels.cpu_paged` with torch's
// extension tooling; the torch reference (`sluice.kernels.reference`) is its definition.
//
// One work item is (sequence, kv head, tile of query tokens). Its rows are the tile's tokens
// times the query heads that share the kv head (GQA), so each K/V block is read once for all
// of them. Blocks are visited in table order with an online softmax in fp32; a row stops at
// its own position (causal), so a prefill chunk attends to cached context and to the chunk
// tokens before it. With a sliding window a row starts at its window's first key, and blocks
// before the item's earliest window are never visited: a windowed decode costs O(window), not
// O(context). A soft cap bends each block's scores before the softmax. Work items are handed
// out dynamically from an atomic counter, largest first, because decodes and long chunks
// differ in cost by orders of magnitude.
//
// With AVX-512, an item of few rows (a decode's GQA group, a short chunk) takes each block 16
// keys at a time with the keys in the vector lanes (see `score_tile`); items of many rows
// transpose each K block once and score 16 keys per FMA; other builds score one key at a time.
//
// Each row's result depends only on its own query and the keys it sees, whatever else is in
// the call: blocks are visited in the same order and split at the same positions for every
// row. The one exception is how its scores are summed (per 16-key tile, one horizontal sum
// per key, or K transposed with one FMA per dimension), which by default follows the item's
// row count; `fixed_order` always takes the transposed sum, so a row's bits no longer depend
// on how its sequence was chunked or on its GQA group's size (the engine's deterministic
// mode).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// query tokens per work item of a prefill chunk: enough rows to reuse each K/V block, few
// enough items left over to keep both cores busy on one long chunk
constexpr int64_t kQueryTile = 16;
// rows of a work item from which transposing each K block pays for itself (a decode has only
// its GQA group of rows and reads K rows as they lie)
constexpr int64_t kTransposeRows = 16;

struct WorkItem {
  int64_t seq;
  int64_t kv_head;
  int64_t first_token;  // offset inside the sequence's query tokens
  int64_t num_tokens;
  int64_t cost;
};

struct Layout {
  int64_t block_size, kv_heads, head_dim, group, num_heads, table_width;
};

template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    at::vec::convert(src, dst, n);
  }
}

template <typename scalar_t>
inline void from_float(const float* src, scalar_t* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    at::vec::convert(src, dst, n);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t d = 0;
  Vec sum(0.0f);
  for (; d + Vec::size() <= n; d += Vec::size()) {
    sum = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), sum);
  }
  float total = sum.reduce_add();
  for (; d < n; ++d) total += a[d] * b[d];
  return total;
}

// scores[j] = q . K[j] for j < visible, K given transposed as kt[d * padded + j]
inline void transposed_scores(const float* q, const float* kt, int64_t padded, int64_t visible,
                              int64_t D, float* scores) {
  for (int64_t j = 0; j < visible; j += Vec::size()) {
    Vec sum(0.0f);
    for (int64_t d = 0; d < D; ++d) {
      sum = at::vec::fmadd(Vec(q[d]), Vec::loadu(kt + d * padded + j), sum);
    }
    sum.store(scores + j);  // lanes past `visible` land in the padding and are never read
  }
}

// scores[j] = cap * tanh(scores[j] / cap) for j < n
inline void soft_cap(float* scores, int64_t n, float cap) {
  const float inverse = 1.0f / cap;
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    ((Vec::loadu(scores + j) * Vec(inverse)).tanh() * Vec(cap)).store(scores + j);
  }
  for (; j < n; ++j) scores[j] = cap * std::tanh(scores[j] * inverse);
}

// scores[j] = exp(scores[j] - shift) for j < visible; returns their sum
inline float exp_shifted(float* scores, int64_t visible, float shift) {
  int64_t j = 0;
  for (; j + Vec::size() <= visible; j += Vec::size()) {
    (Vec::loadu(scores + j) - Vec(shift)).exp_u20().store(scores + j);
  }
  for (; j < visible; ++j) scores[j] = std::exp(scores[j] - shift);
  float sum = 0.0f;
  for (j = 0; j < visible; ++j) sum += scores[j];
  return sum;
}

// acc = acc * keep + sum_j weights[j] * values[j], one vector of acc in registers at a time
inline void accumulate(float* acc, float keep, const float* weights, const float* values,
                       int64_t stride, int64_t visible, int64_t D) {
  int64_t d = 0;
  for (; d + Vec::size() <= D; d += Vec::size()) {
    Vec sum = Vec::loadu(acc + d) * Vec(keep);
    for (int64_t j = 0; j < visible; ++j) {
      sum = at::vec::fmadd(Vec(weights[j]), Vec::loadu(values + j * stride + d), sum);
    }
    sum.store(acc + d);
  }
  for (; d < D; ++d) {
    float sum = acc[d] * keep;
    for (int64_t j = 0; j < visible; ++j) sum += weights[j] * values[j * stride + d];
    acc[d] = sum;
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// A decode's few rows against 16 keys at a time, with the key axis in the vector lanes: the
// 16 dot products come out as one vector (their partial sums folded together in 45 shuffles
// and adds, where 16 separate horizontal sums take ~160), the softmax of the 16 runs in
// vector registers, and PV runs up to four rows at once on each value vector loaded. Used
// where no transposed K pays (few rows), the block holds whole tiles of 16 keys and head_dim
// is whole vectors.
constexpr int64_t kTileKeys = 16;
// rows of an item that the tiles take (more take the transposed K)
constexpr int64_t kMaxTileRows = kTransposeRows;

// lane j = the sum of v[j]'s 16 lanes
inline __m512 sum_lanes_16(__m512 v[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: (v2i, v2i+1, v2i, v2i+1) partials
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: one partial of each of v4i..v4i+3
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i) {  // 128-bit lanes pairwise: two per input left
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  }
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// acc_r[0, 16 * NC) = acc_r * keep[r] + sum_{j in [begin, end)} w[r][j] * values[j] for NR rows
// at once: each value vector is loaded once for all of them, and NR * NC independent FMA chains
// keep the FMA units busy
template <int NR, int NC>
inline void accumulate_rows(float* const* acc, const float* keep, const float (*w)[kTileKeys],
                            const float* values, int64_t stride, int64_t begin, int64_t end) {
  __m512 sum[NR][NC];
  for (int r = 0; r < NR; ++r) {
    const __m512 k = _mm512_set1_ps(keep[r]);
    for (int n = 0; n < NC; ++n) sum[r][n] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + 16 * n), k);
  }
  for (int64_t j = begin; j < end; ++j) {
    __m512 v[NC];
    for (int n = 0; n < NC; ++n) v[n] = _mm512_loadu_ps(values + j * stride + 16 * n);
    for (int r = 0; r < NR; ++r) {
      const __m512 weight = _mm512_set1_ps(w[r][j]);
      for (int n = 0; n < NC; ++n) sum[r][n] = _mm512_fmadd_ps(weight, v[n], sum[r][n]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int n = 0; n < NC; ++n) _mm512_storeu_ps(acc[r] + 16 * n, sum[r][n]);
  }
}

template <int NC>
inline void accumulate_rows(int rows, float* const* acc, const float* keep,
                            const float (*w)[kTileKeys], const float* values, int64_t stride,
                            int64_t begin, int64_t end) {
  switch (rows) {
    case 4: return accumulate_rows<4, NC>(acc, keep, w, values, stride, begin, end);
    case 3: return accumulate_rows<3, NC>(acc, keep, w, values, stride, begin, end);
    case 2: return accumulate_rows<2, NC>(acc, keep, w, values, stride, begin, end);
    default: return accumulate_rows<1, NC>(acc, keep, w, values, stride, begin, end);
  }
}

// One row's scores against keys [begin, end) of a tile of 16 (keys at `stride` floats apart,
// all 16 readable): its online softmax's running max and sum move on, and `w` gets the tile's
// weights (0 outside the row's keys) and `keep` what its output so far is scaled by.
inline void score_tile(const float* q, const float* keys, int64_t stride, int64_t begin,
                       int64_t end, int64_t D, float softcap, float& row_max, float& row_sum,
                       float* w, float& keep) {
  __m512 dots[kTileKeys];
  for (int j = 0; j < kTileKeys; ++j) dots[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __m512 qd = _mm512_loadu_ps(q + d);
    for (int j = 0; j < kTileKeys; ++j) {
      dots[j] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(keys + j * stride + d), dots[j]);
    }
  }
  __m512 scores = sum_lanes_16(dots);
  if (softcap > 0.0f) {
    scores = (Vec(scores) * Vec(1.0f / softcap)).tanh() * Vec(softcap);
  }
  const __mmask16 seen = static_cast<__mmask16>(((1u << end) - 1) & ~((1u << begin) - 1));
  const float tile_max = _mm512_mask_reduce_max_ps(seen, scores);
  const float new_max = std::max(row_max, tile_max);
  keep = std::exp(row_max - new_max);  // exp(-inf) = 0 on the first tile
  const __m512 shifted = _mm512_sub_ps(scores, _mm512_set1_ps(new_max));
  // lanes outside the row's keys (another row's, or not written yet) weigh nothing
  const __m512 weights = _mm512_maskz_mov_ps(seen, Vec(shifted).exp_u20());
  _mm512_storeu_ps(w, weights);
  row_sum = row_sum * keep + _mm512_reduce_add_ps(weights);
  row_max = new_max;
}
#endif

struct Scratch {
  std::vector<float> query, acc, row_max, row_sum, scores, keys, values, keys_t;
  int64_t padded_block = 0;  // block size rounded up to whole vectors
  void reserve(int64_t rows, const Layout& l) {
    padded_block = (l.block_size + Vec::size() - 1) / Vec::size() * Vec::size();
    query.resize(rows * l.head_dim);
    acc.resize(rows * l.head_dim);
    row_max.resize(rows);
    row_sum.resize(rows);
    scores.resize(padded_block);
    // zero-filled once: padding lanes stay finite; one vector more, for a row whose window
    // starts inside the block and whose last vector of scores reads past the last row of K^T
    keys_t.resize(l.head_dim * padded_block + Vec::size());
    keys.resize(l.block_size * l.head_dim);
    values.resize(l.block_size * l.head_dim);
  }
};

// kWindowOrCap: compiled with the window and soft-cap code; without it the item runs exactly
// the unwindowed, uncapped loop (its speed is not to pay for options it does not use)
template <typename scalar_t, bool kWindowOrCap>
void attend_item(const WorkItem& item, const Layout& l, const scalar_t* query,
                 const scalar_t* key_cache, const scalar_t* value_cache, const int32_t* tables,
                 const int32_t* query_start, const int32_t* seq_lens, float scale,
                 int64_t window, float softcap, bool fixed_order, scalar_t* out, Scratch& s) {
  const int64_t D = l.head_dim, B = l.block_size;
  const int64_t q_len = query_start[item.seq + 1] - query_start[item.seq];
  const int64_t ctx_len = seq_lens[item.seq];
  const int64_t first_pos = ctx_len - q_len;  // position of the sequence's first query token
  const int64_t rows = item.num_tokens * l.group;
  s.reserve(rows, l);
  // row r is token first_token + r / group, query head kv_head * group + r % group
  auto token_of = [&](int64_t r) { return query_start[item.seq] + item.first_token + r / l.group; };
  auto head_of = [&](int64_t r) { return item.kv_head * l.group + r % l.group; };
  for (int64_t r = 0; r < rows; ++r) {
    float* q = s.query.data() + r * D;
    to_float(query + (token_of(r) * l.num_heads + head_of(r)) * D, q, D);
    for (int64_t d = 0; d < D; ++d) q[d] *= scale;
  }
  std::fill(s.acc.begin(), s.acc.begin() + rows * D, 0.0f);
  std::fill(s.row_max.begin(), s.row_max.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(s.row_sum.begin(), s.row_sum.begin() + rows, 0.0f);

  const int64_t last_pos = first_pos + item.first_token + item.num_tokens - 1;
  const int64_t num_keys = last_pos + 1;  // the tile's last token sees keys [0, last_pos]
  // and its first token, the earliest row, sees none before its window
  const int64_t lowest_key =
      kWindowOrCap && window > 0
          ? std::max<int64_t>(0, first_pos + item.first_token - window + 1)
          : 0;
  const int32_t* table = tables + item.seq * l.table_width;
  const int64_t token_stride = l.kv_heads * D;  // between two keys of one block and head
  for (int64_t first_key = lowest_key / B * B; first_key < num_keys; first_key += B) {
    const int64_t block = table[first_key / B];
    const int64_t keys_here = std::min(B, num_keys - first_key);
    const int64_t first_needed =  // in the block
        kWindowOrCap ? std::max<int64_t>(0, lowest_key - first_key) : 0;
    const int64_t base = (block * B * l.kv_heads + item.kv_head) * D;
    const float* keys;
    const float* values;
    int64_t stride;
    if constexpr (std::is_same_v<scalar_t, float>) {
      keys = key_cache + base;  // in place: no copy at all in fp32
      values = value_cache + base;
      stride = token_stride;
    } else {
      for (int64_t j = first_needed; j < keys_here; ++j) {
        to_float(key_cache + base + j * token_stride, s.keys.data() + j * D, D);
        to_float(value_cache + base + j * token_stride, s.values.data() + j * D, D);
      }
      keys = s.keys.data();
      values = s.values.data();
      stride = D;
    }
    // with many rows per block, scores come from K transposed to [D, B]: one vector of B
    // scores per row is D broadcast FMAs, with no horizontal sum per key
    const bool transposed = fixed_order || rows >= kTransposeRows;
#if defined(CPU_CAPABILITY_AVX512)
    if (!transposed && B % kTileKeys == 0 && D % 16 == 0 && rows <= kMaxTileRows) {
      const float cap = kWindowOrCap ? softcap : 0.0f;
      alignas(64) float w[kMaxTileRows][kTileKeys];
      float keep[kMaxTileRows];
      float* acc[kMaxTileRows];
      for (int64_t tile = first_needed / kTileKeys * kTileKeys; tile < keys_here;
           tile += kTileKeys) {
        int64_t lo = kTileKeys, hi = 0;  // the keys of the tile any row sees
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t pos = first_pos + item.first_token + r / l.group;
          const int64_t end = std::min<int64_t>(std::min(keys_here, pos - first_key + 1) - tile,
                                                kTileKeys);
          const int64_t begin = std::max<int64_t>(
              (kWindowOrCap && window > 0 ? pos - window + 1 - first_key : 0) - tile, 0);
          acc[r] = s.acc.data() + r * D;
          if (end <= begin) {  // none of this tile's keys: the row stays as it is
            keep[r] = 1.0f;
            std::fill(w[r], w[r] + kTileKeys, 0.0f);
            continue;
          }
          score_tile(s.query.data() + r * D, keys + tile * stride, stride, begin, end, D, cap,
                     s.row_max[r], s.row_sum[r], w[r], keep[r]);
          lo = std::min(lo, begin);
          hi = std::max(hi, end);
        }
        if (hi <= lo) continue;
        const float* tile_values = values + tile * stride;
        for (int64_t r = 0; r < rows; r += 4) {
          const int n = static_cast<int>(std::min<int64_t>(4, rows - r));
          int64_t d = 0;
          float* at[4];
          for (; d + 64 <= D; d += 64) {
            for (int i = 0; i < n; ++i) at[i] = acc[r + i] + d;
            accumulate_rows<4>(n, at, keep + r, w + r, tile_values + d, stride, lo, hi);
          }
          for (; d < D; d += 16) {
            for (int i = 0; i < n; ++i) at[i] = acc[r + i] + d;
            accumulate_rows<1>(n, at, keep + r, w + r, tile_values + d, stride, lo, hi);
          }
        }
      }
      continue;
    }
#endif
    if (transposed) {
      for (int64_t j = first_needed; j < keys_here; ++j) {
        for (int64_t d = 0; d < D; ++d) s.keys_t[d * s.padded_block + j] = keys[j * stride + d];
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + item.first_token + r / l.group;
      const int64_t end = std::min(keys_here, pos - first_key + 1);
      // the row sees keys [begin, end) of this block: from its window's first key on
      const int64_t begin =
          kWindowOrCap && window > 0 ? std::max<int64_t>(0, pos - window + 1 - first_key) : 0;
      const int64_t visible = end - begin;
      if (visible <= 0) continue;  // the whole block lies after the row's token, or before
      const float* q = s.query.data() + r * D;
      const float* row_values = values + begin * stride;
      float* scores = s.scores.data();
      if (transposed) {
        transposed_scores(q, s.keys_t.data() + begin, s.padded_block, visible, D, scores);
      } else {
        for (int64_t j = 0; j < visible; ++j) scores[j] = dot(q, keys + (begin + j) * stride, D);
      }
      if (kWindowOrCap && softcap > 0.0f) soft_cap(scores, visible, softcap);
      const float block_max = *std::max_element(scores, scores + visible);
      const float new_max = std::max(s.row_max[r], block_max);
      const float keep = std::exp(s.row_max[r] - new_max);  // exp(-inf) = 0 on the first block
      const float block_sum = exp_shifted(scores, visible, new_max);
      accumulate(s.acc.data() + r * D, keep, scores, row_values, stride, visible, D);
      s.row_sum[r] = s.row_sum[r] * keep + block_sum;
      s.row_max[r] = new_max;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* acc = s.acc.data() + r * D;
    const float inverse = 1.0f / s.row_sum[r];
    for (int64_t d = 0; d < D; ++d) acc[d] *= inverse;
    from_float(acc, out + (token_of(r) * l.num_heads + head_of(r)) * D, D);
  }
}

// Writes into `out` (the query's shape) the attention of every sequence with at most
// `max_query_len` query tokens; the rows of longer chunks are left for the caller.
void paged_attention_into(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& block_tables,
                          const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                          double scale, int64_t window, double softcap,
                          int64_t max_query_len, bool fixed_order) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [T,H,D], caches [N,B,KVH,D]");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && block_tables.is_contiguous(),
              "paged_attention_cpu needs contiguous tensors");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key and value caches differ in shape");
  TORCH_CHECK(out.sizes() == query.sizes(), "out must have the query's shape");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() &&
                  key_cache.scalar_type() == value_cache.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "query, caches and out must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt,
              "block tables, query starts and sequence lengths must be int32");
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no window), got ", window);
  TORCH_CHECK(std::isfinite(softcap) && softcap >= 0.0, "softcap must be finite and >= 0, got ",
              softcap);
  const Layout l{key_cache.size(1), key_cache.size(2), key_cache.size(3), 0, query.size(1),
                 block_tables.size(1)};
  TORCH_CHECK(query.size(2) == l.head_dim, "query and cache head_dim differ");
  TORCH_CHECK(l.num_heads % l.kv_heads == 0, "num_heads must be a multiple of kv_heads");
  const Layout layout{l.block_size, l.kv_heads, l.head_dim, l.num_heads / l.kv_heads,
                      l.num_heads, l.table_width};
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) >= num_seqs,
              "one query start per sequence plus one, one block table row per sequence");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lengths = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();

  std::vector<WorkItem> items;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t q_len = starts[seq + 1] - starts[seq];
    const int64_t ctx_len = lengths[seq];
    TORCH_CHECK(q_len >= 0 && q_len <= ctx_len && starts[seq + 1] <= query.size(0),
                "sequence ", seq, ": query length ", q_len, " does not fit its context ", ctx_len);
    TORCH_CHECK((ctx_len + layout.block_size - 1) / layout.block_size <= layout.table_width,
                "sequence ", seq, ": context ", ctx_len, " exceeds its block table");
    for (int64_t b = 0; b * layout.block_size < ctx_len; ++b) {
      const int32_t block = tables[seq * layout.table_width + b];
      TORCH_CHECK(block >= 0 && block < key_cache.size(0), "sequence ", seq, ": block id ",
                  block, " outside the pool");
    }
    if (q_len == 0 || q_len > max_query_len) continue;
    for (int64_t first = 0; first < q_len; first += kQueryTile) {
      const int64_t tokens = std::min(kQueryTile, q_len - first);
      const int64_t seen = ctx_len - q_len + first + tokens;  // keys the last token sees
      const int64_t keys = window > 0 ? std::min(seen, window + tokens - 1) : seen;
      for (int64_t h = 0; h < layout.kv_heads; ++h) {
        items.push_back({seq, h, first, tokens, tokens * keys});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), items.size());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(),
                                  "paged_attention_cpu", [&] {
    const scalar_t* q = query.data_ptr<scalar_t>();
    const scalar_t* k = key_cache.data_ptr<scalar_t>();
    const scalar_t* v = value_cache.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const bool window_or_cap = window > 0 || softcap > 0.0;
    at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch;
      for (int64_t w = begin; w < end; ++w) {
        for (int64_t i = next++; i < static_cast<int64_t>(items.size()); i = next++) {
          if (window_or_cap) {
            attend_item<scalar_t, true>(items[i], layout, q, k, v, tables, starts, lengths,
                                        static_cast<float>(scale), window,
                                        static_cast<float>(softcap), fixed_order, o, scratch);
          } else {
            attend_item<scalar_t, false>(items[i], layout, q, k, v, tables, starts, lengths,
                                         static_cast<float>(scale), 0, 0.0f, fixed_order, o,
                                         scratch);
          }
        }
      }
    });
  });
}

// Writes key and value [tokens, kv_heads, head_dim] (rows may lie apart, as views into the
// fused qkv projection) into the pools' slots `slot_mapping` (block * block_size + offset):
// one copy per token, every slot checked against the pool before anything is written.
void reshape_and_cache_into(at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& key,
                            const at::Tensor& value, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes(),
              "reshape_and_cache: contiguous caches [blocks, block_size, kv_heads, head_dim]");
  const int64_t slots = key_cache.size(0) * key_cache.size(1);
  const int64_t row = key_cache.size(2) * key_cache.size(3);
  const int64_t tokens = key.size(0);
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(1) == key_cache.size(2) &&
                    t->size(2) == key_cache.size(3) && t->stride(2) == 1 &&
                    t->stride(1) == t->size(2),
                "reshape_and_cache: key and value [tokens, kv_heads, head_dim], whole rows");
    TORCH_CHECK(t->scalar_type() == key_cache.scalar_type() &&
                    value_cache.scalar_type() == key_cache.scalar_type(),
                "reshape_and_cache: key, value and caches of one dtype");
  }
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens &&
                  slot_mapping.scalar_type() == at::kLong,
              "reshape_and_cache: one int64 slot per token");
  const at::Tensor mapping = slot_mapping.contiguous();
  const int64_t* slot = mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "reshape_and_cache: slot ", slot[t],
                " of token ", t, " outside the pool of ", slots, " slots");
  }
  const size_t bytes = row * key_cache.element_size();
  auto* keys = static_cast<char*>(key_cache.data_ptr());
  auto* values = static_cast<char*>(value_cache.data_ptr());
  const auto* k = static_cast<const char*>(key.data_ptr());
  const auto* v = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size();
  const int64_t v_stride = value.stride(0) * value.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(keys + slot[t] * bytes, k + t * k_stride, bytes);
    std::memcpy(values + slot[t] * bytes, v + t * v_stride, bytes);
  }
}

// How many threads an at::parallel_for over `items` work items ran on, as the ops here run
// theirs: a check that the library was built with the threading torch was asked for.
int64_t threads_used(int64_t items) {
  std::vector<char> seen(std::max(1, at::get_num_threads()), 0);  // each thread its own
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    const int thread = at::get_thread_num();
    if (begin < end && thread >= 0 && thread < static_cast<int>(seen.size())) seen[thread] = 1;
  });
  return std::count(seen.begin(), seen.end(), 1);
}

}  // namespace

TORCH_LIBRARY(sluice_cpu, m) {
  m.def("paged_attention_into(Tensor(a!) out, Tensor query, Tensor key_cache, "
        "Tensor value_cache, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, "
        "float scale, int window, float softcap, int max_query_len, bool fixed_order=False) -> ()");
  m.def("reshape_and_cache_into(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, "
        "Tensor value, Tensor slot_mapping) -> ()");
  m.def("threads_used(int items) -> int");
}

TORCH_LIBRARY_IMPL(sluice_cpu, CPU, m) {
  m.impl("paged_attention_into", &paged_attention_into);
  m.impl("reshape_and_cache_into", &reshape_and_cache_into);
}

TORCH_LIBRARY_IMPL(sluice_cpu, CompositeExplicitAutograd, m) {
  m.impl("threads_used", &threads_used);
}
