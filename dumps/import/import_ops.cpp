#include "dumps/import/import_ops.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "dumps/base/dtype.h"
#include "dumps/base/errors.h"

namespace llmdiff::import {

namespace {

// Recursive descent over "expr := term (+|- term)*, term := unary (*|/ unary)*,
// unary := -unary | atom, atom := number | name | name(expr) | (expr)", with
// one optional comparison on top.
class Parser {
 public:
  Parser(const std::string& text, const Symbols& s) : t_(text), s_(s) {}
  double parse() {
    const double v = compare();
    skip();
    if (p_ != t_.size()) fail("unexpected '" + t_.substr(p_, 1) + "'");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    throw UsageError("expression \"" + t_ + "\": " + why);
  }
  void skip() {
    while (p_ < t_.size() && std::isspace(static_cast<unsigned char>(t_[p_]))) ++p_;
  }
  bool eat(char c) {
    skip();
    if (p_ < t_.size() && t_[p_] == c) {
      ++p_;
      return true;
    }
    return false;
  }
  // expr (== | != | <= | >= | < | >) expr: 1 or 0.
  double compare() {
    const double a = expr();
    skip();
    for (const char* op : {"==", "!=", "<=", ">=", "<", ">"}) {
      const size_t n = std::strlen(op);
      if (t_.compare(p_, n, op) != 0) continue;
      p_ += n;
      const double b = expr();
      const std::string o(op);
      if (o == "==") return a == b;
      if (o == "!=") return a != b;
      if (o == "<=") return a <= b;
      if (o == ">=") return a >= b;
      if (o == "<") return a < b;
      return a > b;
    }
    return a;
  }
  double expr() {
    double v = term();
    for (;;) {
      if (eat('+')) v += term();
      else if (eat('-')) v -= term();
      else return v;
    }
  }
  double term() {
    double v = unary();
    for (;;) {
      if (eat('*')) {
        v *= unary();
      } else if (eat('/')) {
        const double d = unary();
        if (d == 0) fail("division by zero");
        v /= d;
      } else {
        return v;
      }
    }
  }
  double unary() {
    if (eat('-')) return -unary();
    return atom();
  }
  double atom() {
    skip();
    if (eat('(')) {
      const double v = expr();
      if (!eat(')')) fail("missing ')'");
      return v;
    }
    if (p_ < t_.size() && (std::isdigit(static_cast<unsigned char>(t_[p_])) || t_[p_] == '.')) {
      // strtod, not stod: a lone '.' or a number past double's range is the
      // expression's error, not an exception of the standard library.
      const std::string rest = t_.substr(p_);
      char* end = nullptr;
      errno = 0;
      const double v = std::strtod(rest.c_str(), &end);
      if (end == rest.c_str()) fail("a number expected at '" + rest.substr(0, 8) + "'");
      if (errno == ERANGE && std::isinf(v)) fail("number out of range: '" + rest.substr(0, size_t(end - rest.c_str())) + "'");
      p_ += size_t(end - rest.c_str());
      return v;
    }
    size_t e = p_;
    while (e < t_.size() && (std::isalnum(static_cast<unsigned char>(t_[e])) || t_[e] == '_')) ++e;
    if (e == p_) fail(p_ < t_.size() ? "unexpected '" + t_.substr(p_, 1) + "'" : "ends too early");
    const std::string name = t_.substr(p_, e - p_);
    p_ = e;
    if (name == "sqrt") {
      if (!eat('(')) fail("sqrt needs parentheses");
      const double v = expr();
      if (!eat(')')) fail("missing ')'");
      if (v < 0) fail("sqrt of a negative value");
      return std::sqrt(v);
    }
    auto it = s_.find(name);
    if (it == s_.end()) {
      std::string known;
      for (const auto& [k, v] : s_) known += (known.empty() ? "" : ", ") + k;
      fail("unknown symbol '" + name + "' (known here: " + known + ")");
    }
    return it->second;
  }
  const std::string& t_;
  const Symbols& s_;
  size_t p_ = 0;
};

int norm_axis(int axis, size_t rank) {
  const int r = int(rank);
  if (axis < -r || axis >= r)
    throw UsageError("axis " + std::to_string(axis) + " is outside a rank-" + std::to_string(r) + " tensor");
  return axis < 0 ? axis + r : axis;
}

// Visits `t`'s values (float or int) with one generic function.
template <typename F>
void with_values(TensorData& t, F&& f) {
  if (t.is_int)
    f(t.i);
  else
    f(t.f);
}

TensorData like(const TensorData& t, Shape shape) {
  TensorData o;
  o.name = t.name;
  o.is_int = t.is_int;
  o.stored = t.stored;
  o.shape = std::move(shape);
  return o;
}

// [outer, n, inner] view of t around `axis`; copies rows [a, b) of the middle.
template <typename V>
void copy_range(const V& src, V& dst, int64_t outer, int64_t n, int64_t inner, int64_t a, int64_t b) {
  for (int64_t o = 0; o < outer; ++o)
    dst.insert(dst.end(), src.begin() + (o * n + a) * inner, src.begin() + (o * n + b) * inner);
}

TensorData take_range(const TensorData& t, int axis, int64_t a, int64_t b, bool drop_axis) {
  int64_t outer = 1, inner = 1;
  for (int k = 0; k < axis; ++k) outer *= t.shape[size_t(k)];
  for (size_t k = size_t(axis) + 1; k < t.shape.size(); ++k) inner *= t.shape[k];
  Shape s = t.shape;
  if (drop_axis)
    s.erase(s.begin() + axis);
  else
    s[size_t(axis)] = b - a;
  TensorData o = like(t, s);
  const int64_t n = t.shape[size_t(axis)];
  if (t.is_int)
    copy_range(t.i, o.i, outer, n, inner, a, b);
  else
    copy_range(t.f, o.f, outer, n, inner, a, b);
  return o;
}

template <typename V>
V permute_values(const V& src, const Shape& in, const std::vector<int>& axes) {
  const size_t rank = in.size();
  std::vector<int64_t> stride(rank, 1);
  for (size_t k = rank; k-- > 1;) stride[k - 1] = stride[k] * in[k];
  Shape out(rank);
  std::vector<int64_t> ostride(rank);
  for (size_t k = 0; k < rank; ++k) {
    out[k] = in[size_t(axes[k])];
    ostride[k] = stride[size_t(axes[k])];
  }
  V dst(src.size());
  std::vector<int64_t> idx(rank, 0);
  int64_t from = 0;
  for (size_t flat = 0; flat < dst.size(); ++flat) {
    dst[flat] = src[size_t(from)];
    for (size_t k = rank; k-- > 0;) {
      from += ostride[k];
      if (++idx[k] < out[k]) break;
      from -= ostride[k] * out[k];
      idx[k] = 0;
    }
  }
  return dst;
}

template <typename V, typename Index>
V regroup_last(const V& src, int64_t group, Index&& index) {
  V dst(src.size());
  for (size_t base = 0; base < src.size(); base += size_t(group))
    for (int64_t j = 0; j < group; ++j) dst[base + size_t(j)] = src[base + size_t(index(j))];
  return dst;
}

void check_group(const TensorData& t, int64_t group, const char* what) {
  if (t.shape.empty()) throw UsageError(std::string(what) + " of a scalar");
  if (group <= 0 || group % 2 != 0 || t.shape.back() % group != 0)
    throw UsageError(std::string(what) + ": the last axis (" + std::to_string(t.shape.back()) +
                     ") is not made of even groups of " + std::to_string(group));
}

}  // namespace

double eval_expr(const std::string& text, const Symbols& symbols) { return Parser(text, symbols).parse(); }

int64_t eval_int(const std::string& text, const Symbols& symbols) {
  const double v = eval_expr(text, symbols);
  if (!std::isfinite(v) || v != std::floor(v) || std::fabs(v) > 9e15)
    throw UsageError("expression \"" + text + "\" is " + std::to_string(v) + ", not a whole number");
  return int64_t(v);
}

TensorData reshape(TensorData t, Shape shape) {
  int64_t known = 1, infer = -1;
  for (size_t k = 0; k < shape.size(); ++k) {
    if (shape[k] == -1) {
      if (infer >= 0) throw UsageError("reshape to " + shape_str(shape) + ": two dimensions are -1");
      infer = int64_t(k);
    } else if (shape[k] < 0) {
      throw UsageError("reshape to " + shape_str(shape) + ": negative dimension");
    } else {
      known *= shape[k];
    }
  }
  if (infer >= 0) {
    if (known == 0 || t.numel() % known != 0)
      throw UsageError("reshape of " + shape_str(t.shape) + " to " + shape_str(shape) + ": sizes do not divide");
    shape[size_t(infer)] = t.numel() / known;
  }
  if (numel(shape) != t.numel())
    throw UsageError("reshape of " + shape_str(t.shape) + " (" + std::to_string(t.numel()) + " values) to " +
                     shape_str(shape) + " (" + std::to_string(numel(shape)) + ")");
  t.shape = std::move(shape);
  return t;
}

TensorData reverse_dims(TensorData t) {
  std::reverse(t.shape.begin(), t.shape.end());
  return t;
}

TensorData permute(const TensorData& t, const std::vector<int>& axes) {
  if (axes.size() != t.shape.size())
    throw UsageError("permute with " + std::to_string(axes.size()) + " axes of a tensor of shape " +
                     shape_str(t.shape));
  std::vector<bool> seen(axes.size(), false);
  std::vector<int> a(axes.size());
  for (size_t k = 0; k < axes.size(); ++k) {
    a[k] = norm_axis(axes[k], axes.size());
    if (seen[size_t(a[k])]) throw UsageError("permute: axis " + std::to_string(axes[k]) + " named twice");
    seen[size_t(a[k])] = true;
  }
  Shape out(axes.size());
  for (size_t k = 0; k < a.size(); ++k) out[k] = t.shape[size_t(a[k])];
  TensorData o = like(t, out);
  if (t.is_int)
    o.i = permute_values(t.i, t.shape, a);
  else
    o.f = permute_values(t.f, t.shape, a);
  return o;
}

TensorData slice(const TensorData& t, int axis, int64_t start, int64_t end) {
  const int ax = norm_axis(axis, t.shape.size());
  const int64_t n = t.shape[size_t(ax)];
  if (start < 0 || end < start || end > n)
    throw UsageError("slice [" + std::to_string(start) + ", " + std::to_string(end) + ") of axis " +
                     std::to_string(axis) + " of shape " + shape_str(t.shape));
  return take_range(t, ax, start, end, false);
}

TensorData select(const TensorData& t, int axis, int64_t index) {
  const int ax = norm_axis(axis, t.shape.size());
  const int64_t n = t.shape[size_t(ax)];
  const int64_t i = index < 0 ? index + n : index;
  if (i < 0 || i >= n)
    throw UsageError("index " + std::to_string(index) + " of axis " + std::to_string(axis) + " of shape " +
                     shape_str(t.shape));
  return take_range(t, ax, i, i + 1, true);
}

std::vector<TensorData> split(const TensorData& t, int axis, const std::vector<int64_t>& sizes) {
  const int ax = norm_axis(axis, t.shape.size());
  int64_t total = 0;
  for (int64_t s : sizes) {
    if (s < 0) throw UsageError("split into a negative size");
    total += s;
  }
  if (total != t.shape[size_t(ax)]) {
    std::string list;
    for (int64_t s : sizes) list += (list.empty() ? "" : " + ") + std::to_string(s);
    throw UsageError("split of axis " + std::to_string(axis) + " of shape " + shape_str(t.shape) + " into " + list +
                     " = " + std::to_string(total));
  }
  std::vector<TensorData> out;
  int64_t a = 0;
  for (int64_t s : sizes) {
    out.push_back(take_range(t, ax, a, a + s, false));
    a += s;
  }
  return out;
}

TensorData deinterleave(const TensorData& t, int64_t group) {
  check_group(t, group, "deinterleave");
  TensorData o = like(t, t.shape);
  const int64_t half = group / 2;
  auto from = [half](int64_t j) { return j < half ? 2 * j : 2 * (j - half) + 1; };
  if (t.is_int)
    o.i = regroup_last(t.i, group, from);
  else
    o.f = regroup_last(t.f, group, from);
  return o;
}

TensorData interleave(const TensorData& t, int64_t group) {
  check_group(t, group, "interleave");
  TensorData o = like(t, t.shape);
  const int64_t half = group / 2;
  auto from = [half](int64_t j) { return j % 2 == 0 ? j / 2 : half + j / 2; };
  if (t.is_int)
    o.i = regroup_last(t.i, group, from);
  else
    o.f = regroup_last(t.f, group, from);
  return o;
}

TensorData duplicate_halves(const TensorData& t) {
  if (t.shape.empty()) throw UsageError("duplicate_halves of a scalar");
  Shape s = t.shape;
  const int64_t n = s.back();
  s.back() = 2 * n;
  TensorData o = like(t, s);
  auto dup = [n](const auto& src, auto& dst) {
    for (size_t base = 0; base < src.size(); base += size_t(n))
      for (int rep = 0; rep < 2; ++rep) dst.insert(dst.end(), src.begin() + long(base), src.begin() + long(base + n));
  };
  if (t.is_int)
    dup(t.i, o.i);
  else
    dup(t.f, o.f);
  return o;
}

TensorData scale(TensorData t, double factor) {
  if (t.is_int) throw UsageError("scale of an integer tensor");
  for (float& v : t.f) v = float(double(v) * factor);
  return t;
}

TensorData from_bits(const TensorData& t, const std::string& format) {
  if (!t.is_int) throw UsageError("bits: the tensor holds floats, not 16-bit integers");
  if (format != "bf16" && format != "f16") throw UsageError("bits: \"" + format + "\" is not bf16 or f16");
  TensorData o = like(t, t.shape);
  o.is_int = false;
  o.stored = format == "bf16" ? DType::BF16 : DType::F16;
  std::vector<uint16_t> raw(t.i.size());
  for (size_t k = 0; k < raw.size(); ++k) {
    if (t.i[k] < -32768 || t.i[k] > 65535)
      throw UsageError("bits: value " + std::to_string(t.i[k]) + " is not a 16-bit pattern");
    raw[k] = uint16_t(t.i[k] & 0xFFFF);
  }
  o.f.resize(raw.size());
  convert_to_f32(raw.data(), o.stored, raw.size(), o.f.data());
  return o;
}

TensorData gather_paged(const TensorData& pool, const std::vector<int64_t>& block_table, const std::string& layout,
                        int64_t length) {
  if (pool.shape.size() != 4)
    throw UsageError("gather_paged: the pool is " + shape_str(pool.shape) + ", not [blocks, ., ., Dh]");
  const bool slot_major = layout == "block,slot,head,dim";
  if (!slot_major && layout != "block,head,slot,dim")
    throw UsageError("gather_paged: layout \"" + layout + "\" is not block,slot,head,dim or block,head,slot,dim");
  const int64_t blocks = pool.shape[0], bs = slot_major ? pool.shape[1] : pool.shape[2];
  const int64_t heads = slot_major ? pool.shape[2] : pool.shape[1], dh = pool.shape[3];
  if (length < 0 || length > int64_t(block_table.size()) * bs)
    throw UsageError("gather_paged: " + std::to_string(length) + " positions need " +
                     std::to_string((length + bs - 1) / bs) + " blocks of " + std::to_string(bs) +
                     ", the block table has " + std::to_string(block_table.size()));
  TensorData o = like(pool, {heads, length, dh});
  auto gather = [&](const auto& src, auto& dst) {
    dst.resize(size_t(heads * length * dh));
    for (int64_t s = 0; s < length; ++s) {
      const int64_t b = block_table[size_t(s / bs)], slot = s % bs;
      if (b < 0 || b >= blocks)
        throw UsageError("gather_paged: block " + std::to_string(b) + " (table entry " + std::to_string(s / bs) +
                         ") is outside the pool of " + std::to_string(blocks));
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t at = slot_major ? ((b * bs + slot) * heads + h) * dh : ((b * heads + h) * bs + slot) * dh;
        std::copy(src.begin() + at, src.begin() + at + dh, dst.begin() + (h * length + s) * dh);
      }
    }
  };
  if (pool.is_int)
    gather(pool.i, o.i);
  else
    gather(pool.f, o.f);
  return o;
}

}  // namespace llmdiff::import
