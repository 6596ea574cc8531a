// The sampler's exponential race over a row's whole vocabulary in one pass: per token the
// counter-based noise (the same 32-bit hash of (row key, token id) as
// `sluice.actors.executor.sampler.exponential_noise`), its logs, the temperature, the min_p
// cut and the running argmax, with nothing written to memory but the winner. Built with the
// CPU paged attention op (`sluice.kernels.cpu_paged`) into one library; the torch code in the
// sampler stays its definition.
//
// Token for token it equals the torch definition. Everything but the logs is exact IEEE
// arithmetic done the same way (a float32 division, additions, comparisons), but torch's log
// on CPU is its own vectorised routine (MKL's where torch has it) whose last bit differs from
// SLEEF's or libm's on some inputs. So the pass races with SLEEF's logs and keeps every token
// whose race comes within a margin of the best (the logs differ by an ulp or two, the margin
// allows hundreds); those few are raced again with torch's own log, which decides. A token
// the exact race would pick is always among them, and the margin costs a handful of tokens a
// row.
//
// Work items are (row, chunk of the vocabulary), so one long row keeps every core busy too.
//
// `race_full` races token j at position j of each row; `race_masked` races the candidates a
// caller lists (their ids and a keep mask: the sampler's top-k and top-p rows).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

constexpr int64_t kChunk = 4096;  // tokens per work item
constexpr int64_t kTile = 256;    // tokens hashed, logged and raced at a time, on the stack
// how far below the best approximate race a token is still raced exactly: the two logs'
// rounding moves a race by a few 1e-6 at most, and each ulp of the race itself by 2^-23
// relatively; the margin is 25 and 100 times those
constexpr float kMarginAbs = 1e-4f;
constexpr float kMarginRel = 1.0f / 65536.0f;
constexpr float kInf = std::numeric_limits<float>::infinity();

inline uint32_t mix32(uint32_t x) {  // lowbias32, as `_mix32`
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// the top 24 bits of the hash `exponential_noise` draws its uniform from
inline int32_t noise_bits(uint32_t token, uint32_t lo, uint32_t hi) {
  uint32_t x = mix32(token * 0x9E3779B1u + lo);
  x = mix32(x ^ hi);
  x = mix32(x + lo);
  return static_cast<int32_t>(x >> 8);
}

// ((bits).float() + 0.5) * 2^-24 in float32, as the torch code rounds it (a bits value past
// 2^23 rounds its half to even, and the largest gives exactly 1)
inline float uniform_of(int32_t bits) {
  return (static_cast<float>(bits) + 0.5f) * (1.0f / 16777216.0f);
}

// the lowest race still raced exactly when the best approximate race is `best`; increasing
// in `best`, so a token kept against an earlier, lower best is kept against the final one
inline float floor_of(float best) {
  if (std::isinf(best)) return best;
  return best - (kMarginAbs + std::fabs(best) * kMarginRel);
}

struct Candidate {
  int64_t position;  // in the row (the token id itself unless the row has its own ids)
  float scaled;
  float race;  // approximate
};

struct ItemResult {
  float best = -kInf;       // the best approximate race in the item
  bool unbounded = false;   // a scaled logit is NaN or +inf (only looked for without min_p)
  std::vector<Candidate> candidates;
};

struct RowSetting {
  const float* scores;
  const int64_t* ids;  // the token at each position, or null: the position is the token
  const bool* keep;    // whether each position may race at all, or null: every one may
  float temperature;
  float threshold;     // a token races if its scaled logit is >= this (min_p)
  bool check_bounded;  // no min_p: the threshold is -inf unless the row max is NaN or +inf
  uint32_t lo, hi;
};

void race_item(const RowSetting& row, int64_t begin, int64_t end, ItemResult& result) {
  alignas(64) float scaled[kTile];
  alignas(64) float uniform[kTile];
  alignas(64) float race[kTile];
  const Vec threshold(row.threshold);
  const Vec minus_inf(-kInf);
  int unbounded = 0;
  for (int64_t base = begin; base < end; base += kTile) {
    const int64_t n = std::min(kTile, end - base);
    const int64_t padded = (n + Vec::size() - 1) / Vec::size() * Vec::size();
    if (row.ids == nullptr) {
      for (int64_t i = 0; i < n; ++i) {
        const float s = row.scores[base + i] / row.temperature;
        unbounded += !(s < kInf);  // NaN or +inf
        scaled[i] = s;
        uniform[i] = uniform_of(noise_bits(static_cast<uint32_t>(base + i), row.lo, row.hi));
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        // a position the mask leaves out races as a masked token does: never
        scaled[i] = row.keep[base + i] ? row.scores[base + i] / row.temperature : -kInf;
        uniform[i] = uniform_of(
            noise_bits(static_cast<uint32_t>(row.ids[base + i]), row.lo, row.hi));
      }
    }
    for (int64_t i = n; i < padded; ++i) {
      scaled[i] = -kInf;  // never races
      uniform[i] = 0.5f;
    }
    Vec tile_best(-kInf);
    for (int64_t i = 0; i < padded; i += Vec::size()) {
      const Vec s = Vec::loadu(scaled + i);
      // race = scaled - log(-log(u)), only for tokens that are kept
      const Vec noise = Vec::loadu(uniform + i).log().neg();
      const Vec keep = (s >= threshold) & (s > minus_inf);
      const Vec r = Vec::blendv(minus_inf, s - noise.log(), keep);
      r.store(race + i);
      tile_best = at::vec::maximum(tile_best, r);
    }
    const float tile_max = at::vec::vec_reduce_all<float>(
        [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, tile_best);
    if (tile_max == -kInf || tile_max < floor_of(result.best)) continue;
    for (int64_t i = 0; i < n; ++i) {
      const float r = race[i];
      if (r == -kInf) continue;  // not kept: an exact race of a kept token is never -inf
      if (r > result.best) result.best = r;
      if (r >= floor_of(result.best)) result.candidates.push_back({base + i, scaled[i], r});
    }
  }
  result.unbounded = row.check_bounded && unbounded > 0;
}

// the row max of the scaled logits, NaN if any is NaN, as torch's max gives it; dividing the
// raw max is the same, rounding being monotonic
float row_max(const float* scores, int64_t vocab, float temperature) {
  float best = at::vec::reduce_all<float>(
      [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, scores, vocab);
  return best / temperature;
}

// the race of every row; `ids` and `keep` (both [rows, vocab], contiguous) or neither
at::Tensor race(const at::Tensor& scores, const at::Tensor& temperature, const at::Tensor& keys,
                const at::Tensor& log_min_p, const at::Tensor* ids, const at::Tensor* keep) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat && scores.stride(1) == 1,
              "scores must be float32 [rows, vocab] with unit stride along vocab");
  const int64_t rows = scores.size(0);
  const int64_t vocab = scores.size(1);
  TORCH_CHECK(vocab > 0, "scores must have at least one token");
  if (ids != nullptr) {
    TORCH_CHECK(ids->sizes() == scores.sizes() && ids->scalar_type() == at::kLong &&
                    ids->is_contiguous(),
                "ids must be contiguous int64 shaped as scores");
    TORCH_CHECK(keep->sizes() == scores.sizes() && keep->scalar_type() == at::kBool &&
                    keep->is_contiguous(),
                "keep must be contiguous bool shaped as scores");
  }
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == rows &&
                  temperature.scalar_type() == at::kFloat,
              "temperature must be float32 [rows]");
  TORCH_CHECK(log_min_p.dim() == 1 && log_min_p.size(0) == rows &&
                  log_min_p.scalar_type() == at::kFloat,
              "log_min_p must be float32 [rows]");
  TORCH_CHECK(keys.dim() == 2 && keys.size(0) == rows && keys.size(1) == 2 &&
                  keys.scalar_type() == at::kLong,
              "keys must be int64 [rows, 2]");
  TORCH_CHECK(vocab <= (int64_t{1} << 32), "vocab ids must fit 32 bits");
  const auto temp = temperature.contiguous();
  const auto key = keys.contiguous();
  const auto min_p = log_min_p.contiguous();
  const float* t = temp.data_ptr<float>();
  const int64_t* k = key.data_ptr<int64_t>();
  const float* lmp = min_p.data_ptr<float>();
  const float* base = scores.data_ptr<float>();

  std::vector<RowSetting> settings(rows);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      RowSetting& s = settings[r];
      s.scores = base + r * scores.stride(0);
      s.ids = ids == nullptr ? nullptr : ids->data_ptr<int64_t>() + r * vocab;
      s.keep = keep == nullptr ? nullptr : keep->data_ptr<bool>() + r * vocab;
      s.temperature = t[r];
      s.lo = static_cast<uint32_t>(k[2 * r]);
      s.hi = static_cast<uint32_t>(k[2 * r + 1]);
      // keep = scaled >= row max + log(min_p); log(0) = -inf keeps every token, unless the
      // max is NaN or +inf: then the sum is NaN and nothing races
      s.check_bounded = lmp[r] == -kInf;
      s.threshold = s.check_bounded ? -kInf : row_max(s.scores, vocab, s.temperature) + lmp[r];
    }
  });

  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  std::vector<ItemResult> items(rows * chunks);
  at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / chunks;
      const int64_t first = (item % chunks) * kChunk;
      race_item(settings[r], first, std::min(vocab, first + kChunk), items[item]);
    }
  });

  // the tokens to race exactly, all rows together: one call of torch's own log. A row where
  // nothing races gives its first position's token, as argmax over all -inf picks
  auto out = ids == nullptr ? at::zeros({rows}, scores.options().dtype(at::kLong))
                            : ids->select(1, 0).contiguous();
  int64_t* chosen = out.data_ptr<int64_t>();
  std::vector<int64_t> owner;
  std::vector<Candidate> finalists;
  for (int64_t r = 0; r < rows; ++r) {
    float best = -kInf;
    bool unbounded = false;
    for (int64_t c = 0; c < chunks; ++c) {
      best = std::max(best, items[r * chunks + c].best);
      unbounded |= items[r * chunks + c].unbounded;
    }
    // no token races (all masked, or a NaN/+inf max without min_p)
    if (unbounded || best == -kInf) continue;
    const float floor = floor_of(best);
    for (int64_t c = 0; c < chunks; ++c) {
      for (const Candidate& cand : items[r * chunks + c].candidates) {
        if (cand.race >= floor) {
          finalists.push_back(cand);
          owner.push_back(r);
        }
      }
    }
  }
  if (finalists.empty()) return out;
  const int64_t n = static_cast<int64_t>(finalists.size());
  auto uniform = at::empty({n}, scores.options());
  float* u = uniform.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = owner[i];
    const int64_t position = finalists[i].position;
    const int64_t token = ids == nullptr ? position : settings[r].ids[position];
    u[i] = uniform_of(noise_bits(static_cast<uint32_t>(token), settings[r].lo, settings[r].hi));
  }
  // noise = -log(uniform); race = scaled - log(noise), as the torch code computes them
  const auto log_noise = at::log(at::neg(at::log(uniform))).contiguous();
  const float* ln = log_noise.data_ptr<float>();
  std::vector<float> best(rows, -kInf);
  std::vector<int64_t> winner(rows, -1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = owner[i];
    const float race = finalists[i].scaled - ln[i];
    const int64_t position = finalists[i].position;
    // the first of equal races wins, as argmax picks
    if (winner[r] < 0 || race > best[r] || (race == best[r] && position < winner[r])) {
      best[r] = race;
      winner[r] = position;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (winner[r] >= 0) chosen[r] = ids == nullptr ? winner[r] : settings[r].ids[winner[r]];
  }
  return out;
}

at::Tensor race_full(const at::Tensor& scores, const at::Tensor& temperature,
                     const at::Tensor& keys, const at::Tensor& log_min_p) {
  return race(scores, temperature, keys, log_min_p, nullptr, nullptr);
}

// candidates given by the caller: position j of row r is token ids[r, j] with scaled logit
// values[r, j] and races only where keep[r, j] (the sampler's top-k/top-p rows, their cuts
// already made); the winner's token id, or ids[r, 0] where nothing races
at::Tensor race_masked(const at::Tensor& values, const at::Tensor& ids, const at::Tensor& keys,
                       const at::Tensor& keep) {
  const int64_t rows = values.size(0);
  const auto ones = at::ones({rows}, values.options());
  const auto no_min_p = at::full({rows}, -kInf, values.options());
  // dividing by 1 changes no value; no min_p and a mask: the NaN/+inf check stays off
  return race(values, ones, keys, no_min_p, &ids, &keep);
}

// int64 [rows]: each row's greedy token, the index of its first largest score, as
// torch.argmax picks it (a NaN counts as largest). One vectorised max over the row, then a
// scan for its first index: torch's CPU argmax tracks an index beside every lane and ran
// about 9x slower than its max here.
at::Tensor argmax_rows(const at::Tensor& scores) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat && scores.stride(1) == 1,
              "argmax_rows: float32 scores [rows, vocab] with unit stride along vocab");
  const int64_t rows = scores.size(0), vocab = scores.size(1);
  TORCH_CHECK(vocab > 0, "argmax_rows: an empty row has no argmax");
  at::Tensor chosen = at::empty({rows}, scores.options().dtype(at::kLong));
  const float* base = scores.data_ptr<float>();
  const int64_t stride = scores.stride(0);
  int64_t* out = chosen.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = base + r * stride;
      Vec best(-std::numeric_limits<float>::infinity());
      bool nan = false;
      int64_t i = 0;
      for (; i + Vec::size() <= vocab; i += Vec::size()) {
        const Vec v = Vec::loadu(row + i);
        best = at::vec::maximum(best, v);  // NaN propagates
      }
      float top = -std::numeric_limits<float>::infinity();
      alignas(64) float lanes[Vec::size()];
      best.store(lanes);
      for (int64_t k = 0; k < Vec::size(); ++k) {
        nan = nan || std::isnan(lanes[k]);
        top = std::max(top, lanes[k]);
      }
      for (; i < vocab; ++i) {
        nan = nan || std::isnan(row[i]);
        top = std::max(top, row[i]);
      }
      int64_t pick = 0, j = 0;
      if (!nan) {  // whole vectors first: a lane equal to the max stops the scan
        const Vec wanted(top);
        for (; j + Vec::size() <= vocab; j += Vec::size()) {
          const int differ = (Vec::loadu(row + j) != wanted).zero_mask();  // bit: lane equal
          if (differ != 0) {
            pick = j + __builtin_ctz(static_cast<unsigned>(differ));
            break;
          }
        }
        if (j + Vec::size() > vocab) {
          for (; j < vocab && row[j] != top; ++j) {
          }
          pick = j;
        }
      } else {
        for (; j < vocab && !std::isnan(row[j]); ++j) {
        }
        pick = j;
      }
      out[r] = pick;
    }
  });
  return chosen;
}

// float32 [rows]: the lowest scaled logit of each row's top-p nucleus, the tokens whose mass
// before them (sorted best first) is below top_p, so that `values >= floor` is the nucleus
// (all of a tie at the floor kept); -inf where the row's mass never reaches top_p. A
// selection by mass (three-way quickselect, each probability exp(value - normalizer) in
// float, summed in double as torch's cumsum does): expected a few passes over the row, where
// the sampler's definition sorts it (25 ms for 16 rows of 49k here).
at::Tensor nucleus_floor(const at::Tensor& values, const at::Tensor& normalizer,
                         const at::Tensor& top_p) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == at::kFloat && values.stride(1) == 1,
              "nucleus_floor: float32 values [rows, vocab] with unit stride along vocab");
  const int64_t rows = values.size(0), vocab = values.size(1);
  TORCH_CHECK(normalizer.scalar_type() == at::kFloat && normalizer.numel() == rows &&
                  top_p.scalar_type() == at::kFloat && top_p.numel() == rows,
              "nucleus_floor: float32 normalizer and top_p, one per row");
  const auto norms = normalizer.contiguous(), cuts = top_p.contiguous();
  at::Tensor floors = at::empty({rows}, values.options());
  const float* base = values.data_ptr<float>();
  const int64_t stride = values.stride(0);
  const float* norm = norms.data_ptr<float>();
  const float* cut = cuts.data_ptr<float>();
  float* out = floors.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(vocab);
    for (int64_t r = begin; r < end; ++r) {
      std::copy(base + r * stride, base + r * stride + vocab, buf.begin());
      const float n = norm[r];
      const double p = cut[r];
      double above = 0.0;  // the mass of the tokens known to rank above [lo, hi)
      int64_t lo = 0, hi = vocab;
      float floor = -kInf;
      while (lo < hi) {
        const float a = buf[lo], b = buf[lo + (hi - lo) / 2], c = buf[hi - 1];
        const float pivot = std::max(std::min(a, b), std::min(std::max(a, b), c));
        // [lo, gt): above the pivot; [gt, i): equal; [lt, hi): below
        int64_t gt = lo, i = lo, lt = hi;
        while (i < lt) {
          if (buf[i] > pivot) {
            std::swap(buf[i++], buf[gt++]);
          } else if (buf[i] < pivot) {
            std::swap(buf[i], buf[--lt]);
          } else {
            ++i;
          }
        }
        double greater = 0.0;
        for (int64_t k = lo; k < gt; ++k) greater += static_cast<double>(std::exp(buf[k] - n));
        if (above + greater >= p) {  // the nucleus ends above the pivot
          hi = gt;
          continue;
        }
        const double equal = static_cast<double>(i - gt) * std::exp(pivot - n);
        if (above + greater + equal >= p) {  // it ends at the pivot: the first equal token
          floor = pivot;
          break;
        }
        above += greater + equal;
        lo = lt;
      }
      out[r] = floor;
    }
  });
  return floors;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sluice_cpu, m) {
  m.def("race_full(Tensor scores, Tensor temperature, Tensor keys, Tensor log_min_p) -> Tensor");
  m.def("race_masked(Tensor values, Tensor ids, Tensor keys, Tensor keep) -> Tensor");
  m.def("argmax_rows(Tensor scores) -> Tensor");
  m.def("nucleus_floor(Tensor values, Tensor normalizer, Tensor top_p) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice_cpu, CPU, m) {
  m.impl("race_full", &race_full);
  m.impl("race_masked", &race_masked);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("nucleus_floor", &nucleus_floor);
}
