#include "synth/tokenizer.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

#include "dumps/base/errors.h"
#include "dumps/base/files.h"

namespace llmdiff::synth {

using nlohmann::json;
using nlohmann::ordered_json;

namespace {

const char* const kSpace = "\xe2\x96\x81";  // U+2581, SentencePiece's space

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xE0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

// GPT-2's bytes_to_unicode: the printable bytes stand for themselves, the
// others for U+0100 onwards, in byte order.
std::vector<std::string> byte_level_alphabet() {
  std::vector<std::string> out(256);
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    out[b] = utf8(printable ? b : next++);
  }
  return out;
}

// Characters merged into longer pieces, roughly by English frequency.
std::vector<std::string> merge_alphabet() {
  const std::string order =
      "etaoinshrdlcumwfgypbvkjxqzETAOINSHRDLCUMWFGYPBVKJXQZ0123456789.,'\"-:;!?()[]{}<>/\\|_=+*&^%$#@~`";
  std::vector<std::string> out;
  for (char c : order) out.emplace_back(1, c);
  return out;
}

std::vector<int64_t> ids_of(const json& config, const char* key) {
  std::vector<int64_t> out;
  if (!config.contains(key)) return out;
  const json& v = config[key];
  if (v.is_number_integer()) out.push_back(v.get<int64_t>());
  if (v.is_array())
    for (const json& x : v)
      if (x.is_number_integer()) out.push_back(x.get<int64_t>());
  return out;
}

// Protocol buffer encoding, the few wire types ModelProto needs.
struct Proto {
  std::string b;
  void varint(uint64_t v) {
    while (v >= 0x80) {
      b += char(0x80 | (v & 0x7F));
      v >>= 7;
    }
    b += char(v);
  }
  void tag(int field, int wire) { varint(uint64_t(field) << 3 | uint64_t(wire)); }
  void int_field(int field, int64_t v) {
    tag(field, 0);
    varint(uint64_t(v));  // negative int32: ten bytes, as protobuf writes them
  }
  void bytes_field(int field, const std::string& s) {
    tag(field, 2);
    varint(s.size());
    b += s;
  }
  void float_field(int field, float f) {
    tag(field, 5);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    for (int k = 0; k < 4; ++k) b += char((u >> (8 * k)) & 0xFF);
  }
};

json token_entry(const std::string& content) {
  return {{"content", content}, {"lstrip", false}, {"normalized", false}, {"rstrip", false},
          {"single_word", false}, {"special", true}};
}

}  // namespace

TokenizerKind parse_tokenizer_kind(const std::string& text) {
  if (text == "sentencepiece" || text == "spm") return TokenizerKind::SentencePiece;
  if (text == "byte-level" || text == "bpe") return TokenizerKind::ByteLevel;
  throw UsageError("--tokenizer " + text + ": sentencepiece or byte-level");
}

ToyVocab make_toy_vocab(const json& config, TokenizerKind kind) {
  const int64_t V = config.value("vocab_size", int64_t(0));
  const std::string type = config.value("model_type", std::string());
  const bool spm = kind == TokenizerKind::SentencePiece;
  ToyVocab v;
  v.pieces.assign(size_t(V), "");
  v.types.assign(size_t(V), ToyVocab::Type::Normal);
  v.scores.assign(size_t(V), 0.f);
  std::vector<bool> used(size_t(V), false);
  std::set<std::string> seen;
  auto place = [&](int64_t id, const std::string& piece, ToyVocab::Type t) {
    v.pieces[size_t(id)] = piece;
    v.types[size_t(id)] = t;
    used[size_t(id)] = true;
    seen.insert(piece);
  };
  // Special tokens at the config's ids.
  const std::vector<int64_t> bos = ids_of(config, "bos_token_id"), eos = ids_of(config, "eos_token_id");
  const bool llama3 = !spm && type == "llama";
  auto special_name = [&](bool is_bos, size_t k) -> std::string {
    if (spm) return k == 0 ? (is_bos ? "<s>" : "</s>") : (is_bos ? "<s" : "</s") + std::to_string(k) + ">";
    if (llama3) return k == 0 ? (is_bos ? "<|begin_of_text|>" : "<|end_of_text|>")
                              : "<|reserved_special_token_" + std::to_string(k) + (is_bos ? "b" : "e") + "|>";
    return k == 0 ? (is_bos ? "<|im_start|>" : "<|endoftext|>")
                  : "<|special_" + std::to_string(k) + (is_bos ? "b" : "e") + "|>";
  };
  for (int pass = 0; pass < 2; ++pass) {
    const std::vector<int64_t>& ids = pass == 0 ? bos : eos;
    for (size_t k = 0; k < ids.size(); ++k) {
      if (ids[k] < 0 || ids[k] >= V || used[size_t(ids[k])]) continue;
      place(ids[k], special_name(pass == 0, k), ToyVocab::Type::Control);
      (pass == 0 ? v.bos : v.eos).push_back(int(ids[k]));
    }
  }
  int64_t next = 0;
  auto next_free = [&]() -> int64_t {
    while (next < V && used[size_t(next)]) ++next;
    if (next >= V)
      throw ConfigError("config.json", "vocab_size " + std::to_string(V) + " is too small for a toy " +
                                           (spm ? "SentencePiece" : "byte-level") + " vocabulary (bytes, special tokens)");
    return next;
  };
  float score = 0.f;
  if (spm) {
    v.unk = int(next_free());
    place(v.unk, "<unk>", ToyVocab::Type::Unknown);
    for (int b = 0; b < 256; ++b) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "<0x%02X>", b);
      place(next_free(), hex, ToyVocab::Type::Byte);
    }
  }
  // The characters, then their concatenations level by level: a piece of
  // length n+1 is a piece of length n (its prefix) merged with a character.
  const std::string space = spm ? std::string(kSpace) : byte_level_alphabet()[' '];
  std::vector<std::string> level;
  if (spm) {
    level.push_back(space);
    for (const std::string& c : merge_alphabet()) level.push_back(c);
    for (const std::string& p : level) {
      const int64_t id = next_free();
      place(id, p, ToyVocab::Type::Normal);
      v.scores[size_t(id)] = score -= 1.f;
    }
  } else {
    const std::vector<std::string> alphabet = byte_level_alphabet();
    for (const std::string& c : alphabet) place(next_free(), c, ToyVocab::Type::Normal);
    level.push_back(space);
    for (const std::string& c : merge_alphabet()) level.push_back(alphabet[uint8_t(c[0])]);
  }
  std::vector<std::string> chars = level;
  chars.erase(chars.begin());  // the space starts pieces only
  for (;;) {
    std::vector<std::string> longer;
    for (const std::string& prefix : level)
      for (const std::string& c : chars) {
        const std::string piece = prefix + c;
        if (seen.count(piece)) continue;
        while (next < V && used[size_t(next)]) ++next;
        if (next >= V) return v;
        place(next, piece, ToyVocab::Type::Normal);
        v.scores[size_t(next)] = score -= 1.f;
        v.merges.emplace_back(prefix, c);
        longer.push_back(piece);
      }
    level = std::move(longer);
  }
}

std::string sentencepiece_model_proto(const ToyVocab& v) {
  Proto model;
  for (size_t id = 0; id < v.pieces.size(); ++id) {
    Proto p;
    p.bytes_field(1, v.pieces[id]);
    p.float_field(2, v.scores[id]);
    p.int_field(3, int64_t(v.types[id]));
    model.bytes_field(1, p.b);
  }
  Proto trainer;
  trainer.int_field(3, 2);  // model_type: BPE
  trainer.int_field(4, int64_t(v.pieces.size()));
  trainer.int_field(35, 1);  // byte_fallback
  trainer.int_field(40, v.unk);
  trainer.int_field(41, v.bos.empty() ? -1 : v.bos[0]);
  trainer.int_field(42, v.eos.empty() ? -1 : v.eos[0]);
  trainer.int_field(43, -1);  // pad_id
  trainer.bytes_field(45, "<unk>");
  if (!v.bos.empty()) trainer.bytes_field(46, v.pieces[size_t(v.bos[0])]);
  if (!v.eos.empty()) trainer.bytes_field(47, v.pieces[size_t(v.eos[0])]);
  model.bytes_field(2, trainer.b);
  Proto norm;
  norm.bytes_field(1, "identity");
  norm.int_field(3, 1);  // add_dummy_prefix
  norm.int_field(4, 0);  // remove_extra_whitespaces
  norm.int_field(5, 1);  // escape_whitespaces
  model.bytes_field(3, norm.b);
  return model.b;
}

std::vector<std::string> write_toy_tokenizer(const std::string& dir, const json& config, TokenizerKind kind) {
  const ToyVocab v = make_toy_vocab(config, kind);
  const bool spm = kind == TokenizerKind::SentencePiece;
  const std::filesystem::path root(dir);
  std::vector<std::string> files;
  // tokenizer.json (HF tokenizers): the same vocabulary and merges.
  ordered_json tj;
  tj["version"] = "1.0";
  tj["truncation"] = nullptr;
  tj["padding"] = nullptr;
  ordered_json added = ordered_json::array();
  std::vector<int> specials;
  if (v.unk >= 0) specials.push_back(v.unk);
  for (int id : v.bos) specials.push_back(id);
  for (int id : v.eos) specials.push_back(id);
  std::sort(specials.begin(), specials.end());
  for (int id : specials) {
    ordered_json e = {{"id", id}};
    const json entry = token_entry(v.pieces[size_t(id)]);
    for (const auto& [k, x] : entry.items()) e[k] = x;
    added.push_back(e);
  }
  tj["added_tokens"] = added;
  const std::string bos = v.bos.empty() ? "" : v.pieces[size_t(v.bos[0])];
  if (spm) {
    tj["normalizer"] = {{"type", "Sequence"},
                        {"normalizers",
                         {{{"type", "Prepend"}, {"prepend", kSpace}},
                          {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kSpace}}}}};
    tj["pre_tokenizer"] = nullptr;
    ordered_json single = ordered_json::array(), pair = ordered_json::array();
    if (!bos.empty()) single.push_back({{"SpecialToken", {{"id", bos}, {"type_id", 0}}}});
    single.push_back({{"Sequence", {{"id", "A"}, {"type_id", 0}}}});
    pair = single;
    if (!bos.empty()) pair.push_back({{"SpecialToken", {{"id", bos}, {"type_id", 1}}}});
    pair.push_back({{"Sequence", {{"id", "B"}, {"type_id", 1}}}});
    ordered_json st = ordered_json::object();
    if (!bos.empty()) st[bos] = {{"id", bos}, {"ids", {v.bos[0]}}, {"tokens", {bos}}};
    tj["post_processor"] = {{"type", "TemplateProcessing"}, {"single", single}, {"pair", pair}, {"special_tokens", st}};
    tj["decoder"] = {{"type", "Sequence"},
                     {"decoders",
                      {{{"type", "Replace"}, {"pattern", {{"String", kSpace}}}, {"content", " "}},
                       {{"type", "ByteFallback"}},
                       {{"type", "Fuse"}},
                       {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
  } else {
    tj["normalizer"] = nullptr;
    tj["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
                           {"use_regex", true}};
    tj["post_processor"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false},
                            {"use_regex", true}};
    tj["decoder"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}};
  }
  ordered_json vocab = ordered_json::object();
  for (size_t id = 0; id < v.pieces.size(); ++id) vocab[v.pieces[id]] = id;
  ordered_json merges = ordered_json::array();
  for (const auto& [a, b] : v.merges) merges.push_back(a + " " + b);
  tj["model"] = {{"type", "BPE"},        {"dropout", nullptr},          {"unk_token", spm ? json("<unk>") : json(nullptr)},
                 {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr}, {"fuse_unk", spm},
                 {"byte_fallback", spm}, {"ignore_merges", false},      {"vocab", vocab},
                 {"merges", merges}};
  write_file_atomic((root / "tokenizer.json").string(), tj.dump(1) + "\n");
  files.push_back("tokenizer.json");
  // tokenizer_config.json and special_tokens_map.json (transformers).
  ordered_json tc;
  tc["add_bos_token"] = spm && !v.bos.empty();
  tc["add_eos_token"] = false;
  ordered_json dec = ordered_json::object();
  for (int id : specials) dec[std::to_string(id)] = token_entry(v.pieces[size_t(id)]);
  tc["added_tokens_decoder"] = dec;
  ordered_json map = ordered_json::object();
  if (!bos.empty()) tc["bos_token"] = bos;
  tc["clean_up_tokenization_spaces"] = false;
  if (!v.eos.empty()) tc["eos_token"] = v.pieces[size_t(v.eos[0])];
  if (spm) tc["legacy"] = false;
  tc["model_max_length"] = config.value("max_position_embeddings", int64_t(2048));
  tc["pad_token"] = nullptr;
  if (spm) tc["sp_model_kwargs"] = ordered_json::object();
  tc["tokenizer_class"] = spm ? "LlamaTokenizer" : "PreTrainedTokenizerFast";
  if (spm) tc["unk_token"] = "<unk>";
  write_file_atomic((root / "tokenizer_config.json").string(), tc.dump(2) + "\n");
  files.push_back("tokenizer_config.json");
  if (!bos.empty()) map["bos_token"] = token_entry(bos);
  if (!v.eos.empty()) map["eos_token"] = token_entry(v.pieces[size_t(v.eos[0])]);
  if (spm) map["unk_token"] = token_entry("<unk>");
  for (auto& [k, x] : map.items()) x.erase("special");
  write_file_atomic((root / "special_tokens_map.json").string(), map.dump(2) + "\n");
  files.push_back("special_tokens_map.json");
  if (spm) {
    AtomicFile f((root / "tokenizer.model").string());
    const std::string proto = sentencepiece_model_proto(v);
    f.write(proto.data(), proto.size());
    f.commit();
    files.push_back("tokenizer.model");
  }
  return files;
}

}  // namespace llmdiff::synth
