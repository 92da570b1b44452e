// Error heatmap of one tensor: max |candidate - reference| over the cells of
// a small grid laid over the tensor viewed as a matrix (heads x positions for
// [H, T, X] attention sites, positions x features for [T, X] sites, rows x
// columns otherwise), downsampled so that a large tensor fits a picture.
// Plain data, computed from the two dumps' values; the HTML report draws it.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"

namespace llmdiff::compare {

struct HeatmapLimits {
  int64_t rows = 64, cols = 128;  // at most this many cells each way
};

struct ErrorHeatmap {
  std::string name;                  // the tensor
  Shape shape;                       // its shape
  std::string row_label, col_label;  // what the matrix's rows / columns are ("head", "position", "row", ...)
  int64_t src_rows = 1, src_cols = 1;  // the tensor viewed as a matrix
  int64_t inner = 1;                   // elements folded into each matrix entry (the trailing axes of a 3+-D tensor)
  int64_t row_step = 1, col_step = 1;  // downsample factors: matrix rows / columns per cell
  int64_t rows = 0, cols = 0;          // the grid: ceil(src_rows / row_step) x ceil(src_cols / col_step)
  // rows x cols, row-major: max |cand - ref| over each cell; +inf where a
  // value is non-finite on one side only (or both, differently).
  std::vector<float> values;
  double max = 0;                      // the largest finite cell
  int64_t max_row = 0, max_col = 0;    // the cell holding it
  int64_t nonfinite = 0;               // cells that are +inf
};

// The heatmap of one pair of values (same shape, float or integer);
// nullopt when the shapes differ or the tensor is empty.
std::optional<ErrorHeatmap> error_heatmap(const TensorData& ref, const TensorData& cand,
                                          const HeatmapLimits& lim = {});
// The same for a name both sources hold; nullopt when either lacks it.
std::optional<ErrorHeatmap> error_heatmap(const std::string& name, const TensorSource& ref, const TensorSource& cand,
                                          const HeatmapLimits& lim = {});

}  // namespace llmdiff::compare
