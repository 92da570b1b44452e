// `llmdiff synth --tokenizer`: toy tokenizers of the config's vocabulary. The
// SentencePiece model is loaded by SentencePiece itself (Debian's
// python3-sentencepiece, what llama.cpp's HF-to-GGUF converter reads it with)
// and round-trips text; every tokenizer.json is checked for consistency
// (vocabulary size, ids, merges of existing pieces, special tokens at the
// config's ids).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "synth/tokenizer.h"
#include "tests/cli_runner.h"
#include "tests/support.h"

namespace llmdiff {
namespace {

using testing::run_cli;

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(testing::read_text(path)); }

// tokenizer.json is a vocabulary of exactly V ids, each merge joins two
// pieces into a third, the special tokens sit at the config's ids.
void check_tokenizer_json(const std::string& dir, int64_t V, int64_t bos, int64_t eos) {
  const nlohmann::json t = read_json(dir + "/tokenizer.json");
  const nlohmann::json& vocab = t["model"]["vocab"];
  ASSERT_EQ(int64_t(vocab.size()), V);
  std::vector<bool> id_seen(size_t(V), false);
  for (const auto& [piece, id] : vocab.items()) {
    ASSERT_TRUE(id.is_number_integer());
    ASSERT_LT(id.get<int64_t>(), V);
    EXPECT_FALSE(id_seen[size_t(id.get<int64_t>())]) << piece;
    id_seen[size_t(id.get<int64_t>())] = true;
  }
  ASSERT_FALSE(t["model"]["merges"].empty());
  for (const auto& m : t["model"]["merges"]) {
    const std::string s = m.get<std::string>();
    const size_t sp = s.find(' ');
    ASSERT_NE(sp, std::string::npos) << s;
    const std::string a = s.substr(0, sp), b = s.substr(sp + 1);
    EXPECT_TRUE(vocab.contains(a) && vocab.contains(b) && vocab.contains(a + b)) << s;
  }
  std::map<int64_t, std::string> added;
  for (const auto& a : t["added_tokens"]) added[a["id"].get<int64_t>()] = a["content"];
  ASSERT_TRUE(added.count(bos) && added.count(eos));
  EXPECT_EQ(vocab[added[bos]], bos);
  EXPECT_EQ(vocab[added[eos]], eos);
  const nlohmann::json tc = read_json(dir + "/tokenizer_config.json");
  EXPECT_EQ(tc["bos_token"], added[bos]);
  EXPECT_EQ(tc["eos_token"], added[eos]);
}

TEST(CliSynthTokenizer, SentencePieceModelLoadsInSentencePieceAndRoundTrips) {
  const std::string dir = testing::temp_path("tok-spm");
  const auto r = run_cli({"synth", "--preset", "tiny-llama", "--tokenizer", "sentencepiece", "--out", dir});
  ASSERT_EQ(r.code, 0) << r.error;
  EXPECT_NE(r.out.find("tokenizer (sentencepiece, 4096 tokens)"), std::string::npos) << r.out;
  check_tokenizer_json(dir, 4096, 1, 2);
  const std::string script = testing::temp_path("spm.py");
  std::ofstream(script) << R"(
import sys, sentencepiece as spm
sp = spm.SentencePieceProcessor()
sp.LoadFromFile(sys.argv[1] + '/tokenizer.model')
assert sp.vocab_size() == 4096, sp.vocab_size()
assert (sp.unk_id(), sp.bos_id(), sp.eos_id()) == (0, 1, 2), (sp.unk_id(), sp.bos_id(), sp.eos_id())
assert sp.IsControl(1) and sp.IsControl(2) and sp.IsUnknown(0) and sp.IsByte(3)
for text in ['Hello, world! 123', 'The quick brown fox jumps over the lazy dog.', 'na\u00efve caf\u00e9 \u2603']:
    ids = sp.EncodeAsIds(text)
    assert sp.DecodeIds(ids) == text, (text, ids)
    assert len(ids) < len(text.encode('utf-8')), (text, ids)  # merged pieces, not only bytes
print('ok')
)";
  const std::string python = std::filesystem::exists("/usr/bin/python3") ? "/usr/bin/python3" : "python3";
  ASSERT_EQ(std::system((python + " " + script + " " + dir).c_str()), 0)
      << "SentencePiece (python3-sentencepiece, installed by scripts/setup.sh) rejected the model";
  // Deterministic: the same files again.
  const std::string again = testing::temp_path("tok-spm-2");
  ASSERT_EQ(run_cli({"synth", "--preset", "tiny-llama", "--tokenizer", "spm", "--out", again}).code, 0);
  for (const char* f : {"tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"})
    EXPECT_EQ(testing::read_text(dir + "/" + f), testing::read_text(again + "/" + f)) << f;
}

TEST(CliSynthTokenizer, ByteLevelVocabularyIsConsistent) {
  const std::string dir = testing::temp_path("tok-bpe");
  const auto r = run_cli({"synth", "--preset", "tiny-qwen2", "--tokenizer", "byte-level", "--out", dir});
  ASSERT_EQ(r.code, 0) << r.error;
  check_tokenizer_json(dir, 4096, 1, 2);
  EXPECT_FALSE(std::filesystem::exists(dir + "/tokenizer.model"));
  const nlohmann::json t = read_json(dir + "/tokenizer.json");
  EXPECT_EQ(t["pre_tokenizer"]["type"], "ByteLevel");
  // Every byte has its token (GPT-2's byte-to-character table): space is "\u0120".
  EXPECT_TRUE(t["model"]["vocab"].contains("\xc4\xa0"));
  EXPECT_TRUE(t["model"]["vocab"].contains("\xc4\x80"));  // byte 0
}

TEST(CliSynthTokenizer, ErrorsAreUsageErrors) {
  EXPECT_EQ(run_cli({"synth", "--preset", "tiny-llama", "--tokenizer", "wordpiece", "--out", testing::temp_path("t1")}).code, 2);
  EXPECT_EQ(run_cli({"synth", "--preset", "tiny-llama", "--tokenizer", "spm", "--format", "gguf", "--out",
                     testing::temp_path("t2.gguf")})
                .code,
            2);
  nlohmann::json small = {{"vocab_size", 200}, {"bos_token_id", 1}, {"eos_token_id", 2}};
  EXPECT_THROW(synth::make_toy_vocab(small, synth::TokenizerKind::SentencePiece), Error);
}

}  // namespace
}  // namespace llmdiff
