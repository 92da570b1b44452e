#include "compare/heatmap.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "dumps/contract/names.h"

namespace llmdiff::compare {

namespace {

// How the tensor is seen as a matrix: labels of its axes.
void axes(ErrorHeatmap& h) {
  const Shape& s = h.shape;
  const CanonName cn = parse_name(h.name);
  const bool in_step = cn.kind == CanonName::Kind::Step || cn.kind == CanonName::Kind::Layer;
  if (s.size() <= 1) {
    h.src_rows = 1;
    h.src_cols = s.empty() ? 1 : s[0];
    h.row_label = "-";
    h.col_label = "element";
    return;
  }
  h.src_rows = s[0];
  h.src_cols = s[1];
  for (size_t d = 2; d < s.size(); ++d) h.inner *= s[d];
  if (s.size() == 3 && cn.site.rfind("attn.", 0) == 0) {
    h.row_label = "head";
    h.col_label = "position";
  } else if (s.size() == 2 && in_step) {
    h.row_label = "position";
    h.col_label = "feature";
  } else {
    h.row_label = "row";
    h.col_label = "column";
  }
}

float abs_diff(double a, double b) {
  if (std::isfinite(a) && std::isfinite(b)) return float(std::fabs(a - b));
  if (std::isnan(a) && std::isnan(b)) return 0.0f;  // NaN on both sides agrees, as in the comparison
  if (a == b) return 0.0f;  // the same infinity on both sides
  return std::numeric_limits<float>::infinity();
}

}  // namespace

std::optional<ErrorHeatmap> error_heatmap(const TensorData& ref, const TensorData& cand, const HeatmapLimits& lim) {
  if (ref.shape != cand.shape || ref.is_int != cand.is_int) return std::nullopt;
  const int64_t n = ref.numel();
  if (n <= 0) return std::nullopt;
  ErrorHeatmap h;
  h.name = cand.name.empty() ? ref.name : cand.name;
  h.shape = ref.shape;
  axes(h);
  const int64_t max_rows = std::max<int64_t>(1, lim.rows), max_cols = std::max<int64_t>(1, lim.cols);
  h.row_step = (h.src_rows + max_rows - 1) / max_rows;
  h.col_step = (h.src_cols + max_cols - 1) / max_cols;
  h.rows = (h.src_rows + h.row_step - 1) / h.row_step;
  h.cols = (h.src_cols + h.col_step - 1) / h.col_step;
  h.values.assign(size_t(h.rows * h.cols), 0.0f);
  // Element e of the tensor is matrix entry (e / inner) -> row, column.
  for (int64_t e = 0; e < n; ++e) {
    const int64_t entry = e / h.inner;
    const int64_t r = entry / h.src_cols, c = entry % h.src_cols;
    const float d = ref.is_int ? abs_diff(double(ref.i[size_t(e)]), double(cand.i[size_t(e)]))
                               : abs_diff(ref.f[size_t(e)], cand.f[size_t(e)]);
    float& cell = h.values[size_t((r / h.row_step) * h.cols + c / h.col_step)];
    cell = std::max(cell, d);
  }
  h.max = 0;
  for (int64_t k = 0; k < h.rows * h.cols; ++k) {
    const float v = h.values[size_t(k)];
    if (!std::isfinite(v)) {
      ++h.nonfinite;
    } else if (v > h.max) {
      h.max = v;
      h.max_row = k / h.cols;
      h.max_col = k % h.cols;
    }
  }
  return h;
}

std::optional<ErrorHeatmap> error_heatmap(const std::string& name, const TensorSource& ref, const TensorSource& cand,
                                          const HeatmapLimits& lim) {
  if (!ref.has(name) || !cand.has(name) || ref.shape(name) != cand.shape(name)) return std::nullopt;
  TensorData a = ref.get(name), b = cand.get(name);
  a.name = b.name = name;
  return error_heatmap(a, b, lim);
}

}  // namespace llmdiff::compare
