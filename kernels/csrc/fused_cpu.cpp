// The decoder's elementwise steps fused for reduced-precision (bf16, fp16) models on CPU, one
// pass over each row where torch makes two to six (each with a tensor of its own): the
// residual add with RMSNorm, rotary over q and k, and SwiGLU's silu(gate) * up. Built into
// the library of the paged attention op; the torch expressions in the model are their
// definition, and every rounding to the model dtype happens where torch's does: the residual
// sum, the normed row before the weight multiplies it, the product, the rotated value, silu's
// output.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// rows a thread takes at least: a decode's few rows stay on the calling thread
inline int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elements));
}

// out[i] = float(scalar_t(in[i])): a float rounded to the model dtype, as a float again
template <typename scalar_t>
inline void round_through(const float* in, float* out, scalar_t* rounded, int64_t n) {
  at::vec::convert(in, rounded, n);
  at::vec::convert(rounded, out, n);
}

// normed = scalar_t(scalar_t(rms_norm(float(summed))) * weight), summed = scalar_t(x + residual)
// (summed is x itself without a residual), row by row
template <typename scalar_t>
void add_rms_norm_rows(scalar_t* normed, scalar_t* summed, const scalar_t* x,
                       const scalar_t* residual, const scalar_t* weight, int64_t rows,
                       int64_t H, float eps) {
  at::parallel_for(0, rows, grain_rows(H), [&](int64_t begin, int64_t end) {
    std::vector<float> row(H), other(H), w(H);
    std::vector<scalar_t> rounded(H);
    at::vec::convert(weight, w.data(), H);
    for (int64_t r = begin; r < end; ++r) {
      at::vec::convert(x + r * H, row.data(), H);
      if (residual != nullptr) {
        at::vec::convert(residual + r * H, other.data(), H);
        int64_t i = 0;
        for (; i + Vec::size() <= H; i += Vec::size()) {
          (Vec::loadu(row.data() + i) + Vec::loadu(other.data() + i)).store(row.data() + i);
        }
        for (; i < H; ++i) row[i] += other[i];
        at::vec::convert(row.data(), summed + r * H, H);
        at::vec::convert(summed + r * H, row.data(), H);
      }
      Vec squares(0.0f);
      int64_t i = 0;
      for (; i + Vec::size() <= H; i += Vec::size()) {
        const Vec v = Vec::loadu(row.data() + i);
        squares = squares + v * v;
      }
      float total = squares.reduce_add();
      for (; i < H; ++i) total += row[i] * row[i];
      const float inverse = 1.0f / std::sqrt(total / static_cast<float>(H) + eps);
      for (i = 0; i + Vec::size() <= H; i += Vec::size()) {
        (Vec::loadu(row.data() + i) * Vec(inverse)).store(row.data() + i);
      }
      for (; i < H; ++i) row[i] *= inverse;
      round_through(row.data(), row.data(), rounded.data(), H);
      for (i = 0; i + Vec::size() <= H; i += Vec::size()) {
        (Vec::loadu(row.data() + i) * Vec::loadu(w.data() + i)).store(row.data() + i);
      }
      for (; i < H; ++i) row[i] *= w[i];
      at::vec::convert(row.data(), normed + r * H, H);
    }
  });
}

void add_rms_norm_into(at::Tensor normed, at::Tensor summed, const at::Tensor& x,
                       const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                       double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && normed.is_contiguous() &&
                  summed.is_contiguous() && weight.is_contiguous(),
              "add_rms_norm: contiguous x [rows, hidden], outputs and weight");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1), "add_rms_norm: weight [hidden]");
  TORCH_CHECK(normed.sizes() == x.sizes(), "add_rms_norm: normed of x's shape");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && normed.scalar_type() == x.scalar_type(),
              "add_rms_norm: one dtype for x, weight and normed");
  // without a residual, x is the sum and `summed` is not written
  const bool add = residual.has_value() && residual->defined();
  if (add) {
    TORCH_CHECK(summed.sizes() == x.sizes() && summed.scalar_type() == x.scalar_type(),
                "add_rms_norm: summed of x's shape and dtype");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == x.scalar_type(),
                "add_rms_norm: a contiguous residual of x's shape and dtype");
  }
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(normed.data_ptr<scalar_t>(), summed.data_ptr<scalar_t>(),
                                x.data_ptr<scalar_t>(),
                                add ? residual->data_ptr<scalar_t>() : nullptr,
                                weight.data_ptr<scalar_t>(), x.size(0), x.size(1),
                                static_cast<float>(eps));
  });
}

// out[r, h] = scalar_t(x * cos + rotated * sin) over each head of each row, in float32, with
// rotated = (-x[half:], x[:half]) (the half-split layout); products and sum each rounded to
// float as torch's three ops do (no fused multiply-add)
void rotary_into(at::Tensor out, const at::Tensor& x, const at::Tensor& cos,
                 const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary: x [rows, heads, head_dim] with whole heads side by side");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() &&
                  out.scalar_type() == x.scalar_type(),
              "rotary: a contiguous out of x's shape and dtype");
  const int64_t rows = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "rotary: an even head_dim");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.numel() == rows * D &&
                  sin.numel() == rows * D,
              "rotary: float32 cos and sin of [rows, head_dim]");
  const int64_t row_stride = x.stride(0);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(x.scalar_type(), "rotary", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    const float* c = cos.data_ptr<float>();
    const float* s = sin.data_ptr<float>();
    at::parallel_for(0, rows, grain_rows(heads * D), [&](int64_t begin, int64_t end) {
      std::vector<float> v(D), rotated(D), result(D);
      for (int64_t r = begin; r < end; ++r) {
        const float* cr = c + r * D;
        const float* sr = s + r * D;
        for (int64_t h = 0; h < heads; ++h) {
          at::vec::convert(in + r * row_stride + h * D, v.data(), D);
          for (int64_t i = 0; i < half; ++i) {
            rotated[i] = -v[half + i];
            rotated[half + i] = v[i];
          }
          int64_t i = 0;
          for (; i + Vec::size() <= D; i += Vec::size()) {
            const Vec a = Vec::loadu(v.data() + i) * Vec::loadu(cr + i);
            const Vec b = Vec::loadu(rotated.data() + i) * Vec::loadu(sr + i);
            (a + b).store(result.data() + i);
          }
          for (; i < D; ++i) {
            const float a = v[i] * cr[i];
            const float b = rotated[i] * sr[i];
            result[i] = a + b;
          }
          at::vec::convert(result.data(), o + (r * heads + h) * D, D);
        }
      }
    });
  });
}

// out[r, i] = scalar_t(scalar_t(silu(gate[r, i])) * up[r, i]) where gate_up[r] = (gate, up):
// SwiGLU's product, rounded where torch rounds F.silu(gate) * up, with torch's own vectorised
// silu expression (x / (1 + exp(-x)), Sleef's exp) over whole vectors and a partial last one
void silu_mul_into(at::Tensor out, const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: a contiguous gate_up [rows, 2 * intermediate]");
  const int64_t rows = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == rows && out.size(1) == I &&
                  out.scalar_type() == gate_up.scalar_type(),
              "silu_mul: a contiguous out [rows, intermediate] of gate_up's dtype");
  AT_DISPATCH_REDUCED_FLOATING_TYPES(gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(2 * I), [&](int64_t begin, int64_t end) {
      std::vector<float> gate(I), up(I);
      std::vector<scalar_t> rounded(I);
      for (int64_t r = begin; r < end; ++r) {
        at::vec::convert(in + r * 2 * I, gate.data(), I);
        at::vec::convert(in + r * 2 * I + I, up.data(), I);
        for (int64_t i = 0; i < I; i += Vec::size()) {
          const int64_t n = std::min<int64_t>(Vec::size(), I - i);
          const Vec x = Vec::loadu(gate.data() + i, n);
          (x / (Vec(1.0f) + x.neg().exp())).store(gate.data() + i, n);
        }
        round_through(gate.data(), gate.data(), rounded.data(), I);
        for (int64_t i = 0; i < I; i += Vec::size()) {
          const int64_t n = std::min<int64_t>(Vec::size(), I - i);
          (Vec::loadu(gate.data() + i, n) * Vec::loadu(up.data() + i, n)).store(gate.data() + i, n);
        }
        at::vec::convert(gate.data(), o + r * I, I);
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sluice_cpu, m) {
  m.def("add_rms_norm_into(Tensor(a!) normed, Tensor(b!) summed, Tensor x, Tensor? residual, "
        "Tensor weight, float eps) -> ()");
  m.def("rotary_into(Tensor(a!) out, Tensor x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul_into(Tensor(a!) out, Tensor gate_up) -> ()");
}

TORCH_LIBRARY_IMPL(sluice_cpu, CPU, m) {
  m.impl("add_rms_norm_into", &add_rms_norm_into);
  m.impl("rotary_into", &rotary_into);
  m.impl("silu_mul_into", &silu_mul_into);
}
