// The layout transforms of `llmdiff import` (dumps/import/import.h), as pure
// functions of one tensor: what turns an engine's own layout into the
// llm-dump/1 one. Each throws UsageError saying what does not fit (the
// caller adds the file, the tensor and the mapping rule).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"

namespace llmdiff::import {

// Values of the symbols a mapping's expressions may use: T, P, S, D, F, V,
// Hq (or H), Hkv, Dh, and the captures of the rule's pattern (layer, ...).
using Symbols = std::map<std::string, double>;

// An arithmetic expression: numbers, symbols, + - * /, parentheses,
// sqrt(x), and one comparison (== != < <= > >=, 1 or 0) on top.
// "1/sqrt(Dh)", "Hkv*Dh", "S", "numel == T*D".
double eval_expr(const std::string& text, const Symbols& symbols);
// The same, required to be a whole number (a dimension or an index).
int64_t eval_int(const std::string& text, const Symbols& symbols);

// Same values, a new shape of the same element count (one dim may be -1).
TensorData reshape(TensorData t, Shape shape);
// The shape reversed without moving a value: ggml's ne[] order (fastest
// dimension first) read as row-major.
TensorData reverse_dims(TensorData t);
// Axes reordered: out.shape[k] = in.shape[axes[k]].
TensorData permute(const TensorData& t, const std::vector<int>& axes);
// [start, end) along `axis` (negative axis from the end).
TensorData slice(const TensorData& t, int axis, int64_t start, int64_t end);
// One index along `axis`, the axis dropped (negative index from the end).
TensorData select(const TensorData& t, int axis, int64_t index);
// Consecutive pieces of the given sizes along `axis` (they must add up).
std::vector<TensorData> split(const TensorData& t, int axis, const std::vector<int64_t>& sizes);
// Last axis in groups of `group` (a head's channels): interleaved pairs to
// halves, out[j] = in[2j], out[group/2 + j] = in[2j + 1]. Undoes the q/k row
// permutation GGUF converters apply for llama's interleaved RoPE, and turns
// an interleaved-pair cos/sin table into the rotate-half one.
TensorData deinterleave(const TensorData& t, int64_t group);
// The inverse: halves to interleaved pairs.
TensorData interleave(const TensorData& t, int64_t group);
// Last axis n -> 2n, [x, x]: a [T, Dh/2] cos/sin table as the [T, Dh] one.
TensorData duplicate_halves(const TensorData& t);
// Every value times `factor` (float tensors only).
TensorData scale(TensorData t, double factor);
// 16-bit integers holding bfloat16 or float16 bits ("bf16" or "f16") as
// their float values.
TensorData from_bits(const TensorData& t, const std::string& format);
// A paged KV cache gathered into one sequence's logical [Hkv, length, Dh]:
// `pool` is [blocks, block_size, Hkv, Dh] (layout "block,slot,head,dim") or
// [blocks, Hkv, block_size, Dh] ("block,head,slot,dim"); the sequence's
// positions 0..length-1 are the slots of the blocks of `block_table`, in
// order.
TensorData gather_paged(const TensorData& pool, const std::vector<int64_t>& block_table, const std::string& layout,
                        int64_t length);

}  // namespace llmdiff::import
