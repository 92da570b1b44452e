// dumps/import*: the layout transforms on golden tensors, name patterns,
// mapping validation (JSON and TOML), and NumPy's .npy/.npz as numpy itself
// writes them.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "dumps/model/config.h"
#include "dumps/base/errors.h"
#include "dumps/formats/npy.h"
#include "dumps/import/foreign.h"
#include "dumps/import/import.h"
#include "dumps/import/import_ops.h"
#include "dumps/import/import_pattern.h"
#include "support.h"
#include "test_dumps_helpers.h"

namespace llmdiff {
namespace {

using namespace import;

TensorData golden(const std::string& name, const std::string& scenario = "decode") {
  return DumpFile(testing::golden_dump("llama-gqa", scenario)).get(name);
}

// Each transform undone by its inverse, or checked against the golden
// tensor that the spec's layout relates it to.
TEST(ImportOps, TransformsRelateGoldenTensors) {
  const TensorData k_rope = golden("step0.layers.0.attn.k_rope");  // [Hkv, T, Dh]
  const TensorData k_cache = golden("step0.layers.0.attn.k_cache");
  // permute, then back: the same values.
  const TensorData tm = permute(k_rope, {1, 0, 2});  // [T, Hkv, Dh]
  EXPECT_EQ(tm.shape, (Shape{5, 2, 16}));
  EXPECT_EQ(permute(tm, {1, 0, 2}).f, k_rope.f);
  // reshape of the token-major one to [T, Hkv*Dh] and back.
  EXPECT_EQ(reshape(reshape(tm, {5, -1}), {5, 2, 16}).f, tm.f);
  // interleave / deinterleave are inverses and move channels as GGUF's permute does.
  const TensorData il = interleave(k_rope, 16);
  EXPECT_EQ(il.f[1], k_rope.f[8]);  // channel 1 of llama.cpp's head = HF channel Dh/2
  EXPECT_EQ(il.f[2], k_rope.f[1]);
  EXPECT_EQ(deinterleave(il, 16).f, k_rope.f);
  // At step 0 the K cache is this call's k_rope: a slice of a padded copy.
  EXPECT_EQ(slice(k_cache, 1, 0, 5).f, k_rope.f);
  // select: the last row of final_norm is last_hidden.
  EXPECT_EQ(select(golden("step0.final_norm"), 0, -1).f, golden("step0.last_hidden").f);
  // split of a fused QKV [T, (Hq + 2 Hkv) Dh] in k, q, v order.
  const TensorData q = golden("step0.layers.0.attn.q"), k = golden("step0.layers.0.attn.k"),
                   v = golden("step0.layers.0.attn.v");
  TensorData fused;
  fused.shape = {5, 128};
  for (int64_t t = 0; t < 5; ++t) {
    fused.f.insert(fused.f.end(), k.f.begin() + t * 32, k.f.begin() + (t + 1) * 32);
    fused.f.insert(fused.f.end(), q.f.begin() + t * 64, q.f.begin() + (t + 1) * 64);
    fused.f.insert(fused.f.end(), v.f.begin() + t * 32, v.f.begin() + (t + 1) * 32);
  }
  const auto parts = split(fused, -1, {32, 64, 32});
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_EQ(parts[0].f, k.f);
  EXPECT_EQ(parts[1].f, q.f);
  EXPECT_EQ(parts[2].f, v.f);
  // A [T, Dh/2] table duplicated is the rotate-half one; interleaved pairs deinterleave to it.
  const TensorData cos = golden("step0.rope.cos");  // [T, Dh]
  const TensorData half = slice(cos, 1, 0, 8);
  EXPECT_EQ(duplicate_halves(half).f, cos.f);
  EXPECT_EQ(deinterleave(interleave(cos, 16), 16).f, cos.f);
  // bf16 bits.
  TensorData bits;
  bits.is_int = true;
  bits.shape = {2};
  bits.i = {0x3F80, 0xC000};  // 1.0, -2.0
  EXPECT_EQ(from_bits(bits, "bf16").f, (std::vector<float>{1.0f, -2.0f}));
  bits.i = {0x3C00, 0xC000};  // 1.0, -2.0 in float16
  EXPECT_EQ(from_bits(bits, "f16").f, (std::vector<float>{1.0f, -2.0f}));
}

// A paged pool (blocks of 2 slots, scattered) gathered through its block
// table is the contiguous cache.
TEST(ImportOps, GatherPagedRebuildsTheCache) {
  const TensorData kc = golden("step3.layers.1.attn.k_cache");  // [Hkv=2, S=8, Dh=16]
  const int64_t S = kc.shape[1], bs = 2, blocks = 6;
  const std::vector<int64_t> table = {4, 0, 5, 2};
  for (const std::string layout : {"block,slot,head,dim", "block,head,slot,dim"}) {
    TensorData pool;
    pool.shape = layout[6] == 's' ? Shape{blocks, bs, 2, 16} : Shape{blocks, 2, bs, 16};
    pool.f.assign(size_t(numel(pool.shape)), 99.f);
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t d = 0; d < 16; ++d) {
          const int64_t b = table[size_t(s / bs)], slot = s % bs;
          const int64_t at = layout[6] == 's' ? ((b * bs + slot) * 2 + h) * 16 + d : ((b * 2 + h) * bs + slot) * 16 + d;
          pool.f[size_t(at)] = kc.f[size_t((h * S + s) * 16 + d)];
        }
    EXPECT_EQ(gather_paged(pool, table, layout, S).f, kc.f) << layout;
    EXPECT_THROW(gather_paged(pool, {4, 0, 9, 2}, layout, S), UsageError);  // block outside the pool
    EXPECT_THROW(gather_paged(pool, {4, 0}, layout, S), UsageError);        // table too short
  }
}

TEST(ImportOps, ShapeErrorsSayWhatDoesNotFit) {
  const TensorData q = golden("step0.layers.0.attn.q");  // [5, 64]
  EXPECT_THROW(reshape(q, {7, -1}), UsageError);
  EXPECT_THROW(reshape(q, {-1, -1}), UsageError);
  EXPECT_THROW(permute(q, {0, 0}), UsageError);
  EXPECT_THROW(permute(q, {0}), UsageError);
  EXPECT_THROW(slice(q, 1, 0, 65), UsageError);
  EXPECT_THROW(select(q, 2, 0), UsageError);
  EXPECT_THROW(split(q, 1, {32, 16}), UsageError);
  EXPECT_THROW(deinterleave(q, 6), UsageError);
  EXPECT_THROW(from_bits(q, "bf16"), UsageError);
  try {
    split(q, 1, {32, 16});
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("32 + 16 = 48"), std::string::npos) << e.what();
  }
}

TEST(ImportOps, Expressions) {
  const Symbols s = {{"Dh", 16}, {"Hkv", 2}, {"T", 5}, {"D", 64}, {"numel", 320}};
  EXPECT_DOUBLE_EQ(eval_expr("1/sqrt(Dh)", s), 0.25);
  EXPECT_EQ(eval_int("Hkv*Dh", s), 32);
  EXPECT_EQ(eval_int("(T + 3) * 2 - -1", s), 17);
  EXPECT_EQ(eval_int("numel == T*D", s), 1);
  EXPECT_EQ(eval_int("numel != T*D", s), 0);
  EXPECT_THROW(eval_expr("Hq*Dh", s), UsageError);  // unknown symbol, listed in the message
  EXPECT_THROW(eval_expr("Dh/(T-5)", s), UsageError);
  EXPECT_THROW(eval_expr("2 +", s), UsageError);
  EXPECT_THROW(eval_int("Dh/3", s), UsageError);
  // Numbers: a lone '.' and one past double's range are the expression's errors.
  EXPECT_DOUBLE_EQ(eval_expr(".5 + 1e-3", s), 0.501);
  EXPECT_THROW(eval_expr(".", s), UsageError);
  EXPECT_THROW(eval_expr("T > .x", s), UsageError);
  EXPECT_THROW(eval_expr("1e999", s), UsageError);
}

TEST(ImportPattern, CapturesDigits) {
  const Pattern p = Pattern::compile("step{step}/Qcur-{layer}");
  Captures c;
  ASSERT_TRUE(p.match("step12/Qcur-3", c));
  EXPECT_EQ(c["step"], 12);
  EXPECT_EQ(c["layer"], 3);
  EXPECT_FALSE(p.match("step1/Qcur-x", c));
  EXPECT_FALSE(p.match("step1/Qcur-3 (reshaped)", c));
  EXPECT_EQ(substitute("layers.{layer}.attn.q", c), "layers.3.attn.q");
  // A literal digit after a capture: the capture gives it back.
  Captures d;
  ASSERT_TRUE(Pattern::compile("blk.{layer}0").match("blk.120", d));
  EXPECT_EQ(d["layer"], 12);
  EXPECT_THROW(Pattern::compile("a{layer"), UsageError);
  EXPECT_THROW(Pattern::compile("a{layer}{step}"), UsageError);
  EXPECT_THROW(Pattern::compile("{x}-{x}"), UsageError);
  EXPECT_THROW(p.check_template("layers.{expert}.x"), UsageError);
}

// Every malformed mapping is a ConfigError naming the file, the rule and
// what is wrong.
TEST(ImportMapping, MalformedMappingsNameTheRule) {
  struct Bad {
    const char* text;
    const char* says;
  };
  for (const Bad& b : {
           Bad{R"({"rules": []})", "no \"rules\""},
           Bad{R"({"rules": [{"to": "embed"}]})", "rule 1: needs \"from\""},
           Bad{R"({"rules": [{"from": "x"}]})", "needs \"to\""},
           Bad{R"({"rules": [{"from": "x", "to": "embed", "transfroms": []}]})", "unknown key \"transfroms\""},
           Bad{R"({"rules": [{"from": "x", "to": "embed", "transforms": ["reshap"]}]})", "\"reshap\" is not a transform"},
           Bad{R"({"rules": [{"from": "x", "to": "embed", "transforms": [{"reshape": 3}]}]})", "transform 1: \"reshape\" takes"},
           Bad{R"({"rules": [{"from": "x", "to": "embed", "transforms": [{"slice": {"axis": 0}}]}]})", "needs \"end\""},
           Bad{R"({"rules": [{"from": "x", "to": "embed", "transforms": [{"bits": "fp8"}]}]})", "\"bf16\" or \"f16\""},
           Bad{R"({"rules": [{"from": "x", "to": ["a", "b"]}]})", "give 1 tensor(s), \"to\" names 2"},
           Bad{R"({"rules": [{"from": "qkv", "to": ["a", "b"], "transforms": [{"split": {"axis": 0, "sizes": [1, 2, 3]}}]}]})",
               "give 3 tensor(s)"},
           Bad{R"({"rules": [{"from": "Qcur-{layer}", "to": "layers.{lyr}.attn.q"}]})", "uses {lyr}"},
           Bad{R"({"rules": [{"from": "x", "to": "embed", "occurrence": "middle"}]})", "\"occurrence\""},
           Bad{R"({"dims": "column", "rules": [{"from": "x", "to": "embed"}]})", "\"dims\""},
           Bad{R"({"format": "other/2", "rules": [{"from": "x", "to": "embed"}]})", "not llmdiff-mapping/1"},
           Bad{R"({"rules": [{"from": "x", "to": "embed"})", "malformed JSON"},
           Bad{"[[rules]]\nfrom = \"x\"\nto = \n", "malformed TOML"},
           Bad{"dims = \"row_major\"\nig\xe3\x80\x84 = 1\n", "line 2, column 3: byte 0xe3: a TOML mapping is plain ASCII"},
       }) {
    try {
      Mapping::parse(b.text, "m.json");
      ADD_FAILURE() << "accepted: " << b.text;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(b.says), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).rfind("m.json: ", 0), 0u) << e.what();
    }
  }
}

// The same mapping written in TOML parses to the same rules.
TEST(ImportMapping, TomlAndJsonAgree) {
  const Mapping t = Mapping::parse(R"(
description = "an engine"
dims = "row_major"
ignore = ["tmp_*"]

[[rules]]
from = "blk.{layer}.q"
to = "layers.{layer}.attn.q"
occurrence = "first"
transforms = [ { reshape = ["T", "Hq*Dh"] }, "deinterleave" ]

[[rules]]
from = "blk.{layer}.qkv"
to = ["layers.{layer}.attn.q", "layers.{layer}.attn.k", "layers.{layer}.attn.v"]
transforms = [ { split = { axis = -1, sizes = ["Hq*Dh", "Hkv*Dh", "Hkv*Dh"] } } ]
)", "m.toml");
  const Mapping j = Mapping::parse(R"({"description": "an engine", "dims": "row_major", "ignore": ["tmp_*"],
    "rules": [{"from": "blk.{layer}.q", "to": "layers.{layer}.attn.q", "occurrence": "first",
               "transforms": [{"reshape": ["T", "Hq*Dh"]}, "deinterleave"]},
              {"from": "blk.{layer}.qkv", "to": ["layers.{layer}.attn.q", "layers.{layer}.attn.k", "layers.{layer}.attn.v"],
               "transforms": [{"split": {"axis": -1, "sizes": ["Hq*Dh", "Hkv*Dh", "Hkv*Dh"]}}]}]})",
                                   "m.json");
  ASSERT_EQ(t.rules.size(), j.rules.size());
  for (size_t r = 0; r < t.rules.size(); ++r) {
    EXPECT_EQ(t.rules[r].from, j.rules[r].from);
    EXPECT_EQ(t.rules[r].to, j.rules[r].to);
    EXPECT_EQ(t.rules[r].occurrence, j.rules[r].occurrence);
    ASSERT_EQ(t.rules[r].transforms.size(), j.rules[r].transforms.size());
    for (size_t k = 0; k < t.rules[r].transforms.size(); ++k) {
      EXPECT_EQ(t.rules[r].transforms[k].op, j.rules[r].transforms[k].op);
      EXPECT_EQ(t.rules[r].transforms[k].arg, j.rules[r].transforms[k].arg);
    }
  }
  EXPECT_EQ(t.ignore, j.ignore);
  // The bundled one loads by name.
  EXPECT_GT(Mapping::load("llama.cpp").rules.size(), 20u);
  EXPECT_THROW(Mapping::load("no-such-mapping.json"), IoError);
}

// An engine's fused QKV and token-major caches saved by numpy (savez,
// savez_compressed, a directory of .npy, Fortran order, float16), imported
// by a TOML mapping: equal to the golden names.
TEST(ImportNumpy, ArraysSavedByNumpyImportThroughAMapping) {
  const std::string dir = testing::temp_path("npy");
  std::filesystem::create_directories(dir + "/dir/blk0");
  const std::string golden = testing::golden_dump("llama-gqa", "prefill");
  // The engine: fused qkv [T, q|k|v], K cache token-major [S, Hkv, Dh] in
  // float16, attention output saved in Fortran order.
  const std::string py = R"(
import json, struct, sys, numpy as np
path, out = sys.argv[1], sys.argv[2]
raw = open(path, 'rb').read()
n = struct.unpack('<Q', raw[:8])[0]
hdr = json.loads(raw[8:8 + n]); base = 8 + n
def get(name):
    h = hdr[name]; a, b = h['data_offsets']
    return np.frombuffer(raw[base + a: base + b], dtype=np.float32).reshape(h['shape'])
q, k, v = (get('step0.layers.0.attn.' + x) for x in 'qkv')
qkv = np.concatenate([q, k, v], axis=1)
kc = get('step0.layers.0.attn.k_cache').transpose(1, 0, 2).astype(np.float16)
out_f = np.asfortranarray(get('step0.layers.0.attn.out'))
np.savez(out + '/stored.npz', **{'blk.0.qkv': qkv, 'blk.0.kcache': kc})
np.savez_compressed(out + '/deflated.npz', **{'blk.0.qkv': qkv, 'blk.0.kcache': kc})
np.save(out + '/dir/blk0/qkv.npy', qkv)
np.save(out + '/dir/blk0/kcache.npy', kc)
np.save(out + '/dir/blk0/attn_out.npy', out_f)
h = hdr['step0.tokens']; a, b = h['data_offsets']
np.save(out + '/dir/tokens.npy', np.frombuffer(raw[base + a: base + b], dtype=np.int64).astype(np.int32))
)";
  testing::write_text(dir + "/make.py", py);
  // Debian's python3-numpy is for /usr/bin/python3, whatever python3 comes first on PATH.
  const std::string python = std::filesystem::exists("/usr/bin/python3") ? "/usr/bin/python3" : "python3";
  ASSERT_EQ(std::system((python + " " + dir + "/make.py " + golden + " " + dir).c_str()), 0)
      << "python3 with numpy (scripts/setup.sh installs it)";
  const Mapping m = Mapping::parse(R"(
[[rules]]
from = "blk.{layer}.qkv"
to = ["layers.{layer}.attn.q", "layers.{layer}.attn.k", "layers.{layer}.attn.v"]
transforms = [ { split = { axis = 1, sizes = ["Hq*Dh", "Hkv*Dh", "Hkv*Dh"] } } ]
[[rules]]
from = "blk.{layer}.kcache"
to = "layers.{layer}.attn.k_cache"
transforms = [ { permute = [1, 0, 2] } ]
[[rules]]
from = "blk{layer}/qkv"
to = ["layers.{layer}.attn.q", "layers.{layer}.attn.k", "layers.{layer}.attn.v"]
transforms = [ { split = { axis = 1, sizes = ["Hq*Dh", "Hkv*Dh", "Hkv*Dh"] } } ]
[[rules]]
from = "blk{layer}/kcache"
to = "layers.{layer}.attn.k_cache"
transforms = [ { transpose = [0, 1] } ]
[[rules]]
from = "blk{layer}/attn_out"
to = "layers.{layer}.attn.out"
[[rules]]
from = "tokens"
to = "tokens"
)", "engine.toml");
  const ModelConfig cfg = load_config(testing::golden_model("llama-gqa"));
  const DumpFile want(golden);
  for (const std::string in : {"stored.npz", "deflated.npz", "dir"}) {
    SCOPED_TRACE(in);
    MemoryDump out;
    ImportOptions o;
    if (in != "dir") o.tokens = {want.get("step0.tokens").i};
    const ImportSummary s = import_tensors({dir + "/" + in}, m, cfg, o, out);
    EXPECT_TRUE(s.unmapped.empty());
    for (const std::string site : {"attn.q", "attn.k", "attn.v", "attn.k_cache"}) {
      const std::string n = "step0.layers.0." + site;
      ASSERT_TRUE(out.has(n)) << n;
      const double tol = site == "attn.k_cache" ? 4e-3 : 0;  // float16 storage
      EXPECT_LE(testing::max_abs_diff(out.get(n), want.get(n)), tol * testing::max_abs(want.get(n))) << n;
    }
    if (in == "dir") {
      EXPECT_EQ(out.get("step0.layers.0.attn.out").f, want.get("step0.layers.0.attn.out").f);  // Fortran order
      EXPECT_EQ(out.get("step0.tokens").i, want.get("step0.tokens").i);
    }
  }
  // A corrupt archive: an error naming the file.
  testing::Bytes b = testing::read_bytes(dir + "/deflated.npz");
  b[b.size() / 3] ^= 0x5a;
  testing::write_bytes(dir + "/corrupt.npz", b);
  MemoryDump out;
  ImportOptions o;
  o.tokens = {want.get("step0.tokens").i};
  try {
    import_tensors({dir + "/corrupt.npz"}, m, cfg, o, out);
    ADD_FAILURE() << "a corrupt archive was read";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("corrupt.npz"), std::string::npos) << e.what();
  }
}

// Archives shorter than the records they point at: a zip64 locator in a
// 52-byte file, and a zip64 extra field claiming past its central entry. Each
// is an error naming the archive, read without touching bytes outside it.
TEST(ImportNumpy, ZipRecordsPointingPastTheArchiveAreErrors) {
  auto le = [](std::vector<uint8_t>& b, size_t at, uint64_t v, int n) {
    for (int k = 0; k < n; ++k) b[at + k] = uint8_t(v >> (8 * k));
  };
  // A locator whose zip64 record would start beyond a file this short.
  std::vector<uint8_t> tiny(52, 0);
  le(tiny, 52 - 22 - 20, 0x07064b50, 4);  // zip64 locator
  le(tiny, 52 - 22 - 20 + 8, 1ull << 40, 8);  // record a TiB past the start
  le(tiny, 52 - 22, 0x06054b50, 4);       // end of central directory
  le(tiny, 52 - 22 + 10, 0xFFFF, 2);      // count saturated: read zip64
  EXPECT_THROW(zip_members(tiny.data(), tiny.size(), "tiny.npz"), FormatError);
  // One central entry whose zip64 extra field says 0xFFFF bytes but the entry
  // holds its 4-byte header and 2 more: the 64-bit size is not there to read
  // (the bytes after it are the end-of-directory record).
  std::vector<uint8_t> cd(46 + 1 + 6, 0);
  le(cd, 0, 0x02014b50, 4);
  le(cd, 24, 0xFFFFFFFFu, 4);  // size saturated
  le(cd, 28, 1, 2);            // name length
  le(cd, 30, 6, 2);            // extra length
  cd[46] = 'a';
  le(cd, 47, 0x0001, 2);
  le(cd, 49, 0xFFFF, 2);
  std::vector<uint8_t> eocd(22, 0);
  le(eocd, 0, 0x06054b50, 4);
  le(eocd, 10, 1, 2);
  le(eocd, 12, cd.size(), 4);
  le(eocd, 16, 0, 4);
  std::vector<uint8_t> zip = cd;
  zip.insert(zip.end(), eocd.begin(), eocd.end());
  const std::vector<ZipMember> ms = zip_members(zip.data(), zip.size(), "extra.npz");
  ASSERT_EQ(ms.size(), 1u);
  EXPECT_EQ(ms[0].size, 0xFFFFFFFFu);  // left saturated: no 8 bytes of it inside the entry
  try {
    zip_extract(zip.data(), zip.size(), ms[0], "extra.npz");
    ADD_FAILURE() << "a member without a local header was read";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("extra.npz"), std::string::npos) << e.what();
  }
}

// A rule mapping to a name outside the format, or two rules to one name.
TEST(ImportMapping, BadTargetsAreErrors) {
  const std::string golden = testing::golden_dump("llama-gqa", "prefill");
  const ModelConfig cfg = load_config(testing::golden_model("llama-gqa"));
  ImportOptions o;
  o.tokens = {DumpFile(golden).get("step0.tokens").i};
  MemoryDump out;
  const Mapping typo = Mapping::parse(R"({"rules": [{"from": "step0.embed", "to": "embedding"}]})", "m.json");
  try {
    import_tensors({golden}, typo, cfg, o, out);
    ADD_FAILURE();
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("\"step0.embedding\" is not a name of llm-dump/1"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("m.json rule 1"), std::string::npos) << e.what();
  }
  MemoryDump out2;
  const Mapping twice = Mapping::parse(R"({"rules": [{"from": "step0.embed", "to": "embed"},
                                                     {"from": "step0.attn_norm_x", "to": "embed"},
                                                     {"from": "step0.layers.0.attn_norm", "to": "embed"}]})",
                                       "m.json");
  try {
    import_tensors({golden}, twice, cfg, o, out2);
    ADD_FAILURE();
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("made twice (also by rule 1"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace llmdiff

namespace llmdiff {
namespace {

// One file holding every forward call ({step} captures), the tokens mapped by
// a rule, a paged K cache gathered through each call's block table, and a
// `when` that keeps only whole tensors.
TEST(ImportMapping, StepCapturesTokensRulePagedCacheAndWhen) {
  const DumpFile g(testing::golden_dump("llama-gqa", "decode"));  // T = 5, 1, 1, 1
  const ModelConfig cfg = load_config(testing::golden_model("llama-gqa"));
  const std::string path = testing::temp_path("paged-engine.safetensors");
  {
    SafetensorsWriter w(path);
    const int64_t bs = 2, blocks = 8;
    for (int s = 0; s < g.num_steps(); ++s) {
      const std::string p = "s" + std::to_string(s) + "/";
      const TensorData tok = g.get("step" + std::to_string(s) + ".tokens");
      w.add_i64(p + "ids", tok.shape, tok.i.data());
      const TensorData kc = g.get("step" + std::to_string(s) + ".layers.1.attn.k_cache");  // [2, S, 16]
      const int64_t S = kc.shape[1], used = (S + bs - 1) / bs;
      std::vector<int64_t> table;
      for (int64_t b = 0; b < used; ++b) table.push_back(blocks - 1 - b);  // blocks in reverse order
      std::vector<float> pool(size_t(blocks * bs * 2 * 16), -7.f);
      for (int64_t t = 0; t < S; ++t)
        for (int64_t h = 0; h < 2; ++h)
          for (int64_t d = 0; d < 16; ++d)
            pool[size_t(((table[size_t(t / bs)] * bs + t % bs) * 2 + h) * 16 + d)] = kc.f[size_t((h * S + t) * 16 + d)];
      w.add_f32(p + "blk1/kpool", {blocks, bs, 2, 16}, pool.data());
      w.add_i64(p + "table", {used}, table.data());
      const TensorData out = g.get("step" + std::to_string(s) + ".layers.0.out");
      w.add_f32(p + "blk0/out", out.shape, out.f.data());
      w.add_f32(p + "blk0/out_last", {1, 64}, out.f.data() + (out.shape[0] - 1) * 64);  // one row: `when` skips it
    }
    w.finish();
  }
  const Mapping m = Mapping::parse(R"(
ignore = ["s*/table"]
[[rules]]
from = "s{step}/ids"
to = "tokens"
[[rules]]
from = "s{step}/blk{layer}/kpool"
to = "layers.{layer}.attn.k_cache"
transforms = [ { gather_paged = { block_table = "s{step}/table" } } ]
[[rules]]
from = "s{step}/blk{layer}/out"
to = "layers.{layer}.out"
[[rules]]
from = "s{step}/blk{layer}/out_last"
to = "layers.{layer}.attn_residual"
when = "numel == T*D"
)", "paged.toml");
  MemoryDump out;
  const ImportSummary s = import_tensors({path}, m, cfg, {}, out);
  EXPECT_EQ(s.steps, 4);
  EXPECT_TRUE(s.unmapped.empty());
  EXPECT_EQ(s.skipped.size(), 1u);  // step 0 (T = 5); steps 1..3 have T = 1: their one row is whole
  for (int step = 0; step < 4; ++step) {
    const std::string p = "step" + std::to_string(step) + ".";
    EXPECT_EQ(out.get(p + "tokens").i, g.get(p + "tokens").i);
    EXPECT_EQ(out.get(p + "layers.1.attn.k_cache").f, g.get(p + "layers.1.attn.k_cache").f) << step;
    EXPECT_EQ(out.get(p + "layers.0.out").f, g.get(p + "layers.0.out").f);
  }
  EXPECT_FALSE(out.has("step0.layers.0.attn_residual"));
  EXPECT_TRUE(out.has("step1.layers.0.attn_residual"));
  EXPECT_EQ(out.manifest().scenario, "decode");
  EXPECT_EQ(out.manifest().steps, 4);
}

}  // namespace
}  // namespace llmdiff
