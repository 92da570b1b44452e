// Toy tokenizers for synthetic checkpoints, so that the ecosystem's own tools
// (HF tokenizers, llama.cpp's HF-to-GGUF converter) run unmodified on them.
// The vocabulary has exactly the config's vocab_size entries, its special
// tokens at the config's bos/eos ids; it is made of byte tokens, printable
// ASCII characters and their concatenations (each a merge of a shorter piece
// and one character), deterministic for a config.
//
//  - SentencePiece: tokenizer.model (SentencePiece's own protobuf, BPE model
//    with byte fallback, as Llama 2 ships it) and the equivalent HF
//    tokenizer.json, plus tokenizer_config.json and special_tokens_map.json.
//    llama.cpp's converter reads tokenizer.model (llama, mistral, mixtral,
//    qwen2, qwen3).
//  - Byte-level: a GPT-2 / Llama 3 / Qwen style byte-level BPE
//    tokenizer.json, tokenizer_config.json and special_tokens_map.json.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace llmdiff::synth {

enum class TokenizerKind { SentencePiece, ByteLevel };
// "sentencepiece" / "spm", "byte-level" / "bpe". Throws UsageError.
TokenizerKind parse_tokenizer_kind(const std::string& text);

struct ToyVocab {
  enum class Type { Normal = 1, Unknown = 2, Control = 3, Byte = 6 };  // SentencePiece's piece types
  std::vector<std::string> pieces;  // by id
  std::vector<Type> types;
  std::vector<float> scores;
  // Merges in rank order: (left, right), their concatenation a piece.
  std::vector<std::pair<std::string, std::string>> merges;
  int unk = -1;
  std::vector<int> bos, eos;
};

// The vocabulary for `config` (config.json as JSON): vocab_size entries,
// bos_token_id / eos_token_id (a number or a list) as control tokens.
// Throws ConfigError when the vocabulary is too small for the bytes and the
// special tokens.
ToyVocab make_toy_vocab(const nlohmann::json& config, TokenizerKind kind);

// Writes the tokenizer files into `dir` (each atomically); their names.
std::vector<std::string> write_toy_tokenizer(const std::string& dir, const nlohmann::json& config, TokenizerKind kind);

// SentencePiece's model file (ModelProto) for a SentencePiece-kind vocabulary.
std::string sentencepiece_model_proto(const ToyVocab& v);

}  // namespace llmdiff::synth
