#include "impl/rope.h"

#include <algorithm>
#include <cmath>

namespace llmdiff::impl {

namespace {

constexpr double kPi = 3.14159265358979323846;

// float32 power, correctly rounded (HF evaluates `base ** exponent` on a
// float32 tensor).
float powf32(float base, float exponent) { return float(std::pow(double(base), double(exponent))); }

// exponent[i] = float32(2i) / float32(dim), as `arange(0, dim, 2).float() / dim`.
std::vector<float> even_exponents(int64_t dim) {
  std::vector<float> e(size_t(dim / 2));
  for (int64_t i = 0; i < dim / 2; ++i) e[size_t(i)] = float(2 * i) / float(dim);
  return e;
}

// _compute_default_rope_parameters: 1 / base^(2i/dim).
std::vector<float> default_inv_freq(float base, int64_t dim) {
  std::vector<float> inv = even_exponents(dim);
  for (float& x : inv) x = 1.0f / powf32(base, x);
  return inv;
}

// _compute_llama3_parameters: low frequencies divided by `factor`, high ones
// kept, a smooth blend in between.
std::vector<float> llama3_inv_freq(const ModelConfig& cfg, int64_t dim) {
  const RopeScaling& rs = cfg.rope_scaling;
  std::vector<float> inv = default_inv_freq(float(cfg.rope_theta), dim);
  const double old_ctx = double(rs.original_max_position_embeddings);
  const float low_freq_wavelen = float(old_ctx / rs.low_freq_factor);
  const float high_freq_wavelen = float(old_ctx / rs.high_freq_factor);
  const float factor = float(rs.factor);
  for (float& f : inv) {
    const float wavelen = (1.0f / f) * float(2 * kPi);  // 2π / inv_freq
    const float scaled = wavelen > low_freq_wavelen ? f / factor : f;
    const float smooth = ((1.0f / wavelen) * float(old_ctx) - float(rs.low_freq_factor)) /
                         float(rs.high_freq_factor - rs.low_freq_factor);
    const float smoothed = (1.0f - smooth) * scaled / factor + smooth * scaled;
    const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
    f = medium ? smoothed : scaled;
  }
  return inv;
}

// _compute_dynamic_ntk_parameters with the call's sequence length (a tensor
// in HF, hence float32 arithmetic for the rescaled base).
std::vector<float> dynamic_inv_freq(const ModelConfig& cfg, int64_t dim, int64_t seq_len) {
  const int64_t max_pos = cfg.max_position_embeddings;
  if (seq_len <= max_pos) return default_inv_freq(float(cfg.rope_theta), dim);
  const double factor = cfg.rope_scaling.factor;
  const float ratio = float(factor) * float(seq_len) / float(max_pos) - float(factor - 1.0);
  const float base = float(cfg.rope_theta) * powf32(ratio, float(double(dim) / double(dim - 2)));
  return default_inv_freq(base, dim);
}

double yarn_mscale(double scale, double mscale) { return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

// _compute_yarn_parameters: interpolated and extrapolated frequencies blended
// by a linear ramp over the dimensions between the beta_fast/beta_slow
// correction range; returns the attention factor through `attention_factor`.
std::vector<float> yarn_inv_freq(const ModelConfig& cfg, int64_t dim, double* attention_factor) {
  const RopeScaling& rs = cfg.rope_scaling;
  const double base = cfg.rope_theta;
  double factor = rs.factor;
  double original_max_pos = double(cfg.max_position_embeddings);
  if (rs.original_max_position_embeddings > 0) {
    original_max_pos = double(rs.original_max_position_embeddings);
    factor = double(cfg.max_position_embeddings) / original_max_pos;
  }
  if (rs.has_attention_factor)
    *attention_factor = rs.attention_factor;
  else if (rs.mscale != 0.0 && rs.mscale_all_dim != 0.0)
    *attention_factor = yarn_mscale(factor, rs.mscale) / yarn_mscale(factor, rs.mscale_all_dim);
  else
    *attention_factor = yarn_mscale(factor, 1.0);

  const double beta_fast = rs.beta_fast != 0.0 ? rs.beta_fast : 32.0;
  const double beta_slow = rs.beta_slow != 0.0 ? rs.beta_slow : 1.0;
  auto correction_dim = [&](double rotations) {
    return (double(dim) * std::log(original_max_pos / (rotations * 2 * kPi))) / (2 * std::log(base));
  };
  const double low = std::max(std::floor(correction_dim(beta_fast)), 0.0);
  const double high = std::min(std::ceil(correction_dim(beta_slow)), double(dim - 1));
  const float ramp_span = float(low == high ? high + 0.001 - low : high - low);

  const std::vector<float> e = even_exponents(dim);
  std::vector<float> inv(e.size());
  for (size_t i = 0; i < e.size(); ++i) {
    const float pos_freq = powf32(float(base), e[i]);
    const float extrapolation = 1.0f / pos_freq;
    const float interpolation = 1.0f / (float(factor) * pos_freq);
    const float ramp = std::clamp((float(i) - float(low)) / ramp_span, 0.0f, 1.0f);
    const float extrapolation_factor = 1.0f - ramp;
    inv[i] = interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor;
  }
  return inv;
}

}  // namespace

RopeFrequencies rope_frequencies(const ModelConfig& cfg, int64_t seq_len) {
  const int64_t dim = cfg.head_dim;
  RopeFrequencies out;
  switch (cfg.rope_scaling.type) {
    case RopeScaling::Type::Default:
      out.inv_freq = default_inv_freq(float(cfg.rope_theta), dim);
      break;
    case RopeScaling::Type::Linear:
      out.inv_freq = default_inv_freq(float(cfg.rope_theta), dim);
      for (float& f : out.inv_freq) f /= float(cfg.rope_scaling.factor);
      break;
    case RopeScaling::Type::Dynamic:
      out.inv_freq = dynamic_inv_freq(cfg, dim, seq_len);
      break;
    case RopeScaling::Type::Llama3:
      out.inv_freq = llama3_inv_freq(cfg, dim);
      break;
    case RopeScaling::Type::Yarn:
      out.inv_freq = yarn_inv_freq(cfg, dim, &out.attention_scaling);
      break;
  }
  return out;
}

void rope_tables(const RopeFrequencies& f, const std::vector<int64_t>& positions, int64_t head_dim,
                 float* cos, float* sin) {
  const int64_t half = head_dim / 2;
  const float scaling = float(f.attention_scaling);
  for (size_t t = 0; t < positions.size(); ++t) {
    const float pos = float(positions[t]);
    float* c = cos + int64_t(t) * head_dim;
    float* s = sin + int64_t(t) * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float angle = f.inv_freq[size_t(i)] * pos;  // [Dh/2] · [T] in float32
      c[i] = c[i + half] = float(std::cos(double(angle))) * scaling;
      s[i] = s[i + half] = float(std::sin(double(angle))) * scaling;
    }
  }
}

namespace {

// x·cos + rotate_half(x)·sin on every head of x [T, H*Dh], each product
// rounded: the first element of pair i (frequency i) reads cos/sin at i, the
// second at i + Dh/2 (rotate-half pairing: element i with i + Dh/2) or at i
// (interleaved pairing: element 2i with 2i+1).
template <bool Interleaved>
void rotate_pairs(float* x, int64_t T, int64_t H, int64_t head_dim, const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos + t * head_dim;
    const float* s = sin + t * head_dim;
    for (int64_t h = 0; h < H; ++h) {
      float* v = x + (t * H + h) * head_dim;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t j1 = Interleaved ? 2 * i : i;             // first element of the pair
        const int64_t j2 = Interleaved ? 2 * i + 1 : i + half;  // second element
        const int64_t k2 = Interleaved ? i : i + half;          // cos/sin entry of the second
        const float x1 = v[j1], x2 = v[j2];
        // rotate_half(x) = (-x2, x1)
        const float a1 = x1 * c[i], b1 = -x2 * s[i];
        const float a2 = x2 * c[k2], b2 = x1 * s[k2];
        v[j1] = a1 + b1;
        v[j2] = a2 + b2;
      }
    }
  }
}

}  // namespace

void apply_rope(float* x, int64_t T, int64_t H, int64_t head_dim, const float* cos, const float* sin) {
  rotate_pairs<false>(x, T, H, head_dim, cos, sin);
}

void apply_rope_interleaved(float* x, int64_t T, int64_t H, int64_t head_dim, const float* cos, const float* sin) {
  rotate_pairs<true>(x, T, H, head_dim, cos, sin);
}

void pairs_to_halves(float* x, int64_t rows, int64_t dim) {
  const int64_t half = dim / 2;
  std::vector<float> row(static_cast<size_t>(dim));
  for (int64_t r = 0; r < rows; ++r) {
    float* v = x + r * dim;
    for (int64_t i = 0; i < half; ++i) {
      row[size_t(i)] = v[2 * i];
      row[size_t(half + i)] = v[2 * i + 1];
    }
    std::copy(row.begin(), row.end(), v);
  }
}

}  // namespace llmdiff::impl
