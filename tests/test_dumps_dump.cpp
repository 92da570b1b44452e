// llm-dump/1 on the golden dumps (manifest, spec shapes, internal
// consistency) and the dump containers: DumpFile, MemoryDump, DumpWriter,
// globs, TeeObserver, Manifest.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <csignal>

#include <cstring>
#include <filesystem>
#include <numeric>
#include <thread>

#include "dumps/model/config.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/engine.h"
#include "dumps/base/errors.h"
#include "dumps/base/files.h"
#include "dumps/contract/sites.h"
#include "dumps/model/weights.h"
#include "tests/support.h"
#include "tests/test_dumps_helpers.h"

namespace llmdiff {
namespace {

using namespace llmdiff::testing;

const std::vector<std::string> kScenarios = {"prefill", "decode", "chunked"};

// Every name the spec defines for one step of a model (all sites, all layers).
std::vector<std::string> spec_step_names(int step, const ModelConfig& m) {
  std::vector<std::string> out;
  for (const auto& s : step_sites_before_layers()) out.push_back(step_name(step, s));
  for (int64_t l = 0; l < m.num_hidden_layers; ++l)
    for (const auto& s : layer_sites())
      if (model_has_layer_site(m, l, s)) out.push_back(layer_name(step, int(l), s));
  for (const auto& s : step_sites_after_layers()) out.push_back(step_name(step, s));
  return out;
}

TEST(GoldenDumps, ManifestDescribesTheRun) {
  for (const auto& model : golden_models()) {
    const ModelConfig cfg = load_config(golden_model(model));
    for (const auto& sc : kScenarios) {
      SCOPED_TRACE(model + "/" + sc);
      DumpFile d(golden_dump(model, sc));
      EXPECT_TRUE(d.is_llm_dump());
      const Manifest& m = d.manifest();
      EXPECT_EQ(m.format, "llm-dump/1");
      EXPECT_EQ(m.model, model);
      EXPECT_EQ(m.scenario, sc);
      EXPECT_EQ(m.steps, sc == "prefill" ? 1 : sc == "decode" ? 4 : 2);
      EXPECT_EQ(d.num_steps(), m.steps);
      EXPECT_EQ(m.dtype, cfg.torch_dtype);
      EXPECT_NE(m.producer.find("hf-transformers 4.51.3"), std::string::npos);
      EXPECT_TRUE(m.extra.empty());
      // The embedded config is the model's config.json.
      const ModelConfig embedded = parse_config(m.config, d.label() + " (manifest config)");
      EXPECT_EQ(embedded.model_type, cfg.model_type);
      EXPECT_EQ(embedded.hidden_size, cfg.hidden_size);
      EXPECT_EQ(embedded.num_key_value_heads, cfg.num_key_value_heads);
      EXPECT_EQ(embedded.rope_scaling.type, cfg.rope_scaling.type);
      EXPECT_EQ(embedded.vocab_size, cfg.vocab_size);
      // to_map/from_map round trip on real metadata.
      EXPECT_EQ(m.to_map(), d.file().metadata());
    }
  }
}

TEST(GoldenDumps, EveryNameOfTheSpecIsPresentWithItsShapeAndDtype) {
  for (const auto& model : golden_models()) {
    const ModelConfig cfg = load_config(golden_model(model));
    for (const auto& sc : kScenarios) {
      SCOPED_TRACE(model + "/" + sc);
      DumpFile d(golden_dump(model, sc));
      const auto tokens = d.step_tokens();
      std::vector<std::string> expected = {"rope.inv_freq"};
      for (int s = 0; s < d.num_steps(); ++s)
        for (const auto& n : spec_step_names(s, cfg)) expected.push_back(n);
      const int64_t generated = d.has("generated") ? numel(d.shape("generated")) : 0;
      if (sc == "decode") expected.push_back("generated");
      EXPECT_EQ(d.names(), expected);  // complete, nothing else, canonical order

      int64_t P = 0;
      std::vector<int64_t> past(size_t(d.num_steps()));
      for (int s = 0; s < d.num_steps(); ++s) past[size_t(s)] = P, P += int64_t(tokens[size_t(s)].size());
      for (const auto& n : d.names()) {
        const CanonName c = parse_name(n);
        int64_t T = 0, S = 0;
        if (c.step >= 0) {
          T = int64_t(tokens[size_t(c.step)].size());
          S = past[size_t(c.step)] + T;
        }
        EXPECT_EQ(std::optional<Shape>(d.shape(n)), spec_shape(c, cfg, T, S, generated)) << n;
        const TensorInfo& info = d.file().at(n);
        const bool integer = integer_site(c.site);
        EXPECT_EQ(info.dtype, integer ? DType::I64 : DType::F32) << n;
      }
    }
  }
}

TEST(GoldenDumps, ValuesAreInternallyConsistent) {
  for (const auto& model : golden_models()) {
    DumpFile prefill(golden_dump(model, "prefill")), decode(golden_dump(model, "decode")),
        chunked(golden_dump(model, "chunked"));
    SCOPED_TRACE(model);
    const auto pt = prefill.step_tokens(), dt = decode.step_tokens(), ct = chunked.step_tokens();
    // chunked = the prompt in two calls (4 + 3); decode = a 5-token prefill
    // then one generated token per call.
    ASSERT_EQ(pt.size(), 1u);
    ASSERT_EQ(ct.size(), 2u);
    ASSERT_EQ(dt.size(), 4u);
    EXPECT_EQ(pt[0].size(), 7u);
    std::vector<int64_t> joined = ct[0];
    joined.insert(joined.end(), ct[1].begin(), ct[1].end());
    EXPECT_EQ(joined, pt[0]);
    EXPECT_EQ(ct[0].size(), 4u);
    EXPECT_EQ(dt[0], std::vector<int64_t>(pt[0].begin(), pt[0].begin() + 5));
    const TensorData gen = decode.get("generated");
    ASSERT_TRUE(gen.is_int);
    ASSERT_EQ(gen.i.size(), 4u);
    for (int s = 0; s < 4; ++s) {
      if (s > 0) {
        EXPECT_EQ(dt[size_t(s)], std::vector<int64_t>{gen.i[size_t(s - 1)]});
      }
      EXPECT_EQ(gen.i[size_t(s)], argmax_first(decode.get(step_name(s, "next_logits")).f)) << s;
    }
    for (const TensorSource* src : std::vector<const TensorSource*>{&prefill, &decode, &chunked}) {
      int64_t P = 0;
      for (int s = 0; s < src->num_steps(); ++s) {
        const TensorData pos = src->get(step_name(s, "positions"));
        const int64_t T = pos.numel();
        std::vector<int64_t> want(static_cast<size_t>(T));
        std::iota(want.begin(), want.end(), P);
        EXPECT_EQ(pos.i, want) << src->label() << " step " << s;
        // Row T-1 extractions and the causal mask with offset P.
        const TensorData logits = src->get(step_name(s, "logits")), next = src->get(step_name(s, "next_logits"));
        const int64_t V = next.numel();
        EXPECT_TRUE(std::equal(next.f.begin(), next.f.end(), logits.f.begin() + (T - 1) * V));
        const TensorData fin = src->get(step_name(s, "final_norm")), last = src->get(step_name(s, "last_hidden"));
        EXPECT_TRUE(std::equal(last.f.begin(), last.f.end(), fin.f.begin() + (T - 1) * last.numel()));
        const TensorData mask = src->get(step_name(s, "mask"));
        const int64_t S = P + T;
        for (int64_t t = 0; t < T; ++t)
          for (int64_t k = 0; k < S; ++k) ASSERT_EQ(mask.f[size_t(t * S + k)], k <= P + t ? 1.0f : 0.0f);
        P += T;
      }
      EXPECT_EQ(src->get("rope.inv_freq").f, prefill.get("rope.inv_freq").f);
    }
  }
}

TEST(GoldenDumps, WeightsFileReadsAsAnUntaggedSource) {
  DumpFile w(golden_model("llama-mha-bf16") + "/model.safetensors");
  EXPECT_FALSE(w.is_llm_dump());
  EXPECT_EQ(w.manifest().format, "pt");
  EXPECT_EQ(w.num_steps(), 0);
  const auto names = w.names();
  ASSERT_EQ(names.size(), 21u);
  // Unknown names in natural order.
  EXPECT_EQ(names.front(), "lm_head.weight");
  EXPECT_LT(std::find(names.begin(), names.end(), "model.layers.0.mlp.up_proj.weight"),
            std::find(names.begin(), names.end(), "model.layers.1.input_layernorm.weight"));
  const TensorData e = w.get("model.embed_tokens.weight");
  EXPECT_FALSE(e.is_int);
  EXPECT_EQ(e.stored, DType::BF16);
  EXPECT_EQ(e.shape, (Shape{256, 64}));
  // BF16 values widen exactly: narrowing gives the stored bits back.
  const auto* raw = static_cast<const uint8_t*>(w.file().data(w.file().at("model.embed_tokens.weight")));
  for (size_t i = 0; i < e.f.size(); i += 97) EXPECT_EQ(f32_to_bf16(e.f[i]), uint16_t(raw[2 * i] | raw[2 * i + 1] << 8));
  expect_error<MissingTensorError>([&] { w.get("step0.embed"); }, {w.label(), "step0.embed"});
  expect_error<MissingTensorError>([&] { w.shape("nope"); }, {w.label(), "nope"});
  EXPECT_TRUE(w.step_tokens().empty());
}

// ------------------------------------------------------------------ Manifest

TEST(Manifest, RoundTripsAndKeepsExtraKeys) {
  Manifest m;
  m.producer = "llmdiff impl";
  m.model = "tiny";
  m.config = "{\"model_type\": \"llama\"}";
  m.scenario = "decode";
  m.steps = 4;
  m.dtype = "bfloat16";
  m.extra["bug"] = "rope-neox";
  const auto map = m.to_map();
  EXPECT_EQ(map.at("format"), "llm-dump/1");
  EXPECT_EQ(map.at("steps"), "4");
  EXPECT_EQ(map.at("bug"), "rope-neox");
  EXPECT_EQ(map.size(), 8u);
  const Manifest back = Manifest::from_map(map);
  EXPECT_EQ(back.to_map(), map);
  EXPECT_EQ(back.steps, 4);
  EXPECT_EQ(back.extra.at("bug"), "rope-neox");
  for (const std::string bad : {"", "x", "-2", "4x", "99999999999999999999"})
    EXPECT_EQ(Manifest::from_map({{"steps", bad}}).steps, 0) << bad;
  EXPECT_EQ(Manifest::from_map({}).format, "");  // an untagged file is not llm-dump/1
}

// --------------------------------------------------------------------- globs

TEST(Globs, MatchFullNames) {
  EXPECT_TRUE(glob_match("*", "step0.layers.1.attn.q"));
  EXPECT_TRUE(glob_match("*", ""));
  EXPECT_TRUE(glob_match("step0.*", "step0.embed"));
  EXPECT_FALSE(glob_match("step0.*", "step1.embed"));
  EXPECT_TRUE(glob_match("*.attn.q", "step3.layers.10.attn.q"));
  EXPECT_FALSE(glob_match("*.attn.q", "step3.layers.10.attn.q_rope"));
  EXPECT_TRUE(glob_match("step?.embed", "step7.embed"));
  EXPECT_FALSE(glob_match("step?.embed", "step17.embed"));
  EXPECT_TRUE(glob_match("step*.layers.1.*", "step12.layers.1.mlp.up"));
  EXPECT_FALSE(glob_match("step*.layers.1.*", "step12.layers.11.mlp.up"));
  EXPECT_TRUE(glob_match("**a**", "xxaxx"));
  EXPECT_TRUE(glob_match("", ""));
  EXPECT_FALSE(glob_match("", "x"));
  EXPECT_FALSE(glob_match("embed", "step0.embed"));  // whole-name match
  EXPECT_TRUE(glob_match("*embed", "step0.embed"));
  EXPECT_TRUE(any_glob_match({"x", "*.mask"}, "step0.mask"));
  EXPECT_FALSE(any_glob_match({}, "step0.mask"));
  EXPECT_FALSE(any_glob_match({"x", "y"}, "step0.mask"));
}

// ------------------------------------------------------- MemoryDump / writer

TEST(MemoryDump, RecordsFiltersAndReadsBack) {
  MemoryDump m("probe");
  EXPECT_EQ(m.label(), "probe");
  EXPECT_TRUE(m.wants("anything"));
  m.set_filter({"step0.layers.*.attn.q", "generated", "step*.tokens"});
  EXPECT_TRUE(m.wants("step0.layers.1.attn.q"));
  EXPECT_FALSE(m.wants("step0.layers.1.attn.k"));
  EXPECT_TRUE(m.wants("step1.tokens"));
  const std::vector<float> q = {1, 2, 3, 4, 5, 6};
  const std::vector<int64_t> ids = {5, 6, 7};
  m.on_f32("step0.layers.1.attn.q", {3, 2}, q.data());
  m.on_f32("step0.layers.0.attn.q", {3, 2}, q.data());
  m.on_i64("step0.tokens", {3}, ids.data());
  m.on_i64("generated", {1}, ids.data());
  EXPECT_EQ(m.names(), (std::vector<std::string>{"step0.tokens", "step0.layers.0.attn.q", "step0.layers.1.attn.q",
                                                  "generated"}));
  EXPECT_TRUE(m.has("step0.tokens"));
  EXPECT_EQ(m.shape("step0.layers.1.attn.q"), (Shape{3, 2}));
  const TensorData t = m.get("step0.tokens");
  EXPECT_TRUE(t.is_int);
  EXPECT_EQ(t.stored, DType::I64);
  EXPECT_EQ(t.i, ids);
  EXPECT_EQ(m.get("step0.layers.0.attn.q").f, q);
  EXPECT_EQ(m.step_tokens(), (std::vector<std::vector<int64_t>>{ids}));
  EXPECT_EQ(m.num_steps(), 1);
  // put replaces, erase removes.
  TensorData r = m.get("step0.layers.0.attn.q");
  r.f[0] = 100;
  m.put(r);
  EXPECT_EQ(m.find("step0.layers.0.attn.q")->f[0], 100);
  m.erase("step0.layers.0.attn.q");
  EXPECT_EQ(m.find("step0.layers.0.attn.q"), nullptr);
  expect_error<MissingTensorError>([&] { m.get("step0.layers.0.attn.q"); }, {"probe", "step0.layers.0.attn.q"});
  expect_error<MissingTensorError>([&] { m.shape("nope"); }, {"probe", "nope"});
}

TEST(MemoryDump, StepTokensNeedsEveryStepsIntegerTokens) {
  MemoryDump m;
  const std::vector<int64_t> ids = {1, 2};
  const std::vector<float> x = {1, 2};
  m.on_i64("step0.tokens", {2}, ids.data());
  m.on_f32("step1.embed", {1, 2}, x.data());
  EXPECT_EQ(m.num_steps(), 2);
  expect_error<MissingTensorError>([&] { m.step_tokens(); }, {"step1.tokens"});
  m.on_f32("step1.tokens", {2}, x.data());
  expect_error<FormatError>([&] { m.step_tokens(); }, {"step1.tokens"});
  // The manifest's step count wins when it is larger.
  MemoryDump n;
  n.mutable_manifest().steps = 3;
  EXPECT_EQ(n.num_steps(), 3);
}

TEST(TensorData, FloatsWidensIntegersAndKeepsFloats) {
  const DumpFile golden(golden_dump("llama-gqa", "decode"));
  const TensorData tokens = golden.get("step0.tokens");
  ASSERT_TRUE(tokens.is_int);
  const std::vector<float> tf = tokens.floats();
  ASSERT_EQ(tf.size(), tokens.i.size());
  for (size_t k = 0; k < tf.size(); ++k) EXPECT_EQ(tf[k], float(tokens.i[k])) << k;
  const TensorData embed = golden.get("step0.embed");
  ASSERT_FALSE(embed.is_int);
  EXPECT_EQ(embed.floats(), embed.f);
}

TEST(MemoryDump, GoldenDumpSurvivesSaveAndReload) {
  DumpFile golden(golden_dump("qwen2-bias", "decode"));
  MemoryDump m(golden.label());
  m.mutable_manifest() = golden.manifest();
  for (const auto& n : golden.names()) m.put(golden.get(n));
  const std::string a = temp_path("mem-a.safetensors"), b = temp_path("mem-b.safetensors");
  m.save(a);
  m.save(b);
  EXPECT_EQ(read_bytes(a), read_bytes(b));
  DumpFile back(a);
  EXPECT_TRUE(back.is_llm_dump());
  EXPECT_EQ(back.manifest().to_map(), golden.manifest().to_map());
  EXPECT_EQ(back.names(), golden.names());
  // Saved in canonical order (generated last), unlike the golden file.
  EXPECT_EQ(back.file().tensors().back().name, "generated");
  for (const auto& n : golden.names()) {
    const TensorData x = golden.get(n), y = back.get(n);
    EXPECT_EQ(x.shape, y.shape) << n;
    EXPECT_EQ(x.is_int, y.is_int) << n;
    EXPECT_EQ(x.i, y.i) << n;
    ASSERT_EQ(x.f.size(), y.f.size()) << n;
    if (!x.f.empty()) {
      EXPECT_EQ(std::memcmp(x.f.data(), y.f.data(), x.f.size() * 4), 0) << n;
    }
  }
}

// An AtomicFile abandoned before commit() leaves neither the target nor its
// temporary; a committed one replaces the target whole.
TEST(AtomicFile, NothingHalfWrittenIsLeft) {
  namespace fs = std::filesystem;
  const std::string dir = temp_path("atomic-dir");
  fs::create_directories(dir);
  const std::string path = dir + "/out.txt";
  {
    AtomicFile f(path);
    f.write("partial", 7);
  }  // abandoned (as when an exception unwinds)
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(fs::is_empty(dir));
  write_file_atomic(path, "old");
  AtomicFile f(path);
  f.write("new contents", 12);
  EXPECT_EQ(read_text(path), "old");  // the target is untouched until commit
  f.commit();
  EXPECT_EQ(read_text(path), "new contents");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);
  EXPECT_THROW(f.commit(), IoError);
  EXPECT_THROW(AtomicFile(dir + "/no/such/dir/x"), IoError);
}

// A spilled dump keeps its values in an unnamed temporary file: the same
// names, shapes and values read back, nothing in memory, nothing left on disk.
TEST(MemoryDump, SpilledTensorsReadBackAndLeaveNoFile) {
  namespace fs = std::filesystem;
  const std::string dir = temp_path("spill-dir");
  fs::create_directories(dir);
  DumpFile golden(golden_dump("llama-gqa", "decode"));
  MemoryDump m("spilled");
  m.spill(dir);
  EXPECT_TRUE(m.spilling());
  for (const auto& n : golden.names()) {
    const TensorData t = golden.get(n);
    if (t.is_int) m.on_i64(n, t.shape, t.i.data());
    else m.on_f32(n, t.shape, t.f.data());
  }
  EXPECT_TRUE(fs::is_empty(dir)) << "the spill file has no name";
  EXPECT_EQ(m.names(), golden.names());
  for (const auto& n : golden.names()) {
    EXPECT_EQ(m.find(n), nullptr) << n << " is held in memory";
    EXPECT_EQ(m.shape(n), golden.shape(n)) << n;
    const TensorData x = golden.get(n), y = m.get(n);
    EXPECT_EQ(x.is_int, y.is_int) << n;
    EXPECT_EQ(x.i, y.i) << n;
    EXPECT_EQ(x.f, y.f) << n;
  }
  // put() and erase() work over spilled names; save() writes what get() reads.
  TensorData replaced = golden.get("step0.embed");
  for (float& v : replaced.f) v += 1.0f;
  m.put(replaced);
  EXPECT_NE(m.find("step0.embed"), nullptr);
  EXPECT_EQ(m.get("step0.embed").f, replaced.f);
  m.erase("step0.mask");
  EXPECT_FALSE(m.has("step0.mask"));
  const std::string path = temp_path("spilled.safetensors");
  m.save(path);
  DumpFile back(path);
  EXPECT_EQ(back.get("step1.logits").f, golden.get("step1.logits").f);
  EXPECT_EQ(back.get("step0.embed").f, replaced.f);
  EXPECT_THROW(m.get("step0.mask"), MissingTensorError);
  EXPECT_THROW(MemoryDump("x").spill(dir + "/no/such/dir"), IoError);
}

// The spill file's writer runs beside the recording thread: more than its
// in-flight bytes queued (one tensor larger than all of them), reads right
// after appends and from several threads at once give back every value; a
// write that fails (the file size limit) is an IoError at the next read and
// append, not values that were never written.
TEST(MemoryDump, SpilledWritesQueuedBesideTheRecorderReadBack) {
  DumpFile golden(golden_dump("llama-gqa", "decode"));
  MemoryDump m("spilled");
  m.spill();
  std::vector<std::string> names;
  for (int copy = 0; copy < 40; ++copy)
    for (const auto& n : golden.names()) {
      const TensorData t = golden.get(n);
      const std::string name = "c" + std::to_string(copy) + "." + n;
      if (t.is_int) {
        m.on_i64(name, t.shape, t.i.data());
      } else {
        m.on_f32(name, t.shape, t.f.data());
      }
      names.push_back(name);
      if (copy == 3) {
        EXPECT_EQ(m.get(name).f, t.f) << name;  // read at once
      }
    }
  std::vector<float> big(size_t(24) << 20);  // 96 MB: more than the writer queues
  for (size_t k = 0; k < big.size(); ++k) big[k] = float(k % 1000003);
  m.on_f32("big", {int64_t(big.size())}, big.data());
  EXPECT_EQ(m.get("big").f, big);
  std::vector<std::thread> readers;
  std::vector<int> wrong(4, 0);
  for (int r = 0; r < 4; ++r)
    readers.emplace_back([&, r] {
      for (size_t k = size_t(r); k < names.size(); k += 4) {
        const std::string n = names[k].substr(names[k].find('.') + 1);
        const TensorData x = golden.get(n), y = m.get(names[k]);
        if (x.f != y.f || x.i != y.i) ++wrong[size_t(r)];
      }
    });
  for (auto& t : readers) t.join();
  EXPECT_EQ(wrong, std::vector<int>(4, 0));

  // A write past the file size limit fails in the writer.
  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 1 << 20;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  MemoryDump limited("limited");
  limited.spill();
  const std::vector<float> two_mb(size_t(1) << 19, 1.0f);
  limited.on_f32("a", {int64_t(two_mb.size())}, two_mb.data());
  try {
    limited.get("a");
    ADD_FAILURE() << "a write past the size limit read back";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot write a spilled tensor"), std::string::npos) << e.what();
  }
  EXPECT_THROW(limited.on_f32("b", {1}, two_mb.data()), IoError);
  ::setrlimit(RLIMIT_FSIZE, &old);
}

// Pages handed back to the kernel read again as the same bytes.
TEST(ReleasePages, ValuesSurviveTheRelease) {
  DumpFile golden(golden_dump("llama-gqa", "prefill"));
  const TensorData before = golden.get("step0.logits");
  const Model model = Model::load(golden_model("llama-gqa"));
  const std::vector<uint8_t> q(static_cast<const uint8_t*>(model.weights->layers[0].q.data),
                               static_cast<const uint8_t*>(model.weights->layers[0].q.data) +
                                   model.weights->layers[0].q.bytes());
  model.weights->release_all();
  EXPECT_EQ(std::memcmp(q.data(), model.weights->layers[0].q.data, q.size()), 0);
  EXPECT_EQ(golden.get("step0.logits").f, before.f);  // get() released them already once
  release_pages(nullptr, 0);                          // nothing to do
}

TEST(DumpWriter, StreamsWantedSitesAndWritesTheManifest) {
  const std::string dir = fresh_dir("dumpwriter");
  const std::string path = dir + "/run.safetensors";
  {
    DumpWriter w(path);
    w.set_filter({"step0.*", "generated"});
    EXPECT_TRUE(w.wants("step0.embed"));
    EXPECT_FALSE(w.wants("step1.embed"));
    w.mutable_manifest().producer = "test";
    w.mutable_manifest().scenario = "decode";
    w.mutable_manifest().steps = 1;
    w.mutable_manifest().extra["note"] = "x";
    const std::vector<int64_t> ids = {3, 1};
    const std::vector<float> e = {0.5f, -0.25f, 1e-30f, 7};
    w.on_i64("step0.tokens", {2}, ids.data());
    w.on_f32("step0.embed", {2, 2}, e.data());
    w.on_i64("generated", {1}, ids.data());
    EXPECT_FALSE(path_exists(path));
    w.finish();
  }
  DumpFile d(path);
  EXPECT_TRUE(d.is_llm_dump());
  EXPECT_EQ(d.manifest().producer, "test");
  EXPECT_EQ(d.manifest().steps, 1);
  EXPECT_EQ(d.manifest().extra.at("note"), "x");
  EXPECT_EQ(d.get("step0.embed").f, (std::vector<float>{0.5f, -0.25f, 1e-30f, 7}));
  EXPECT_EQ(d.file().at("step0.embed").dtype, DType::F32);
  EXPECT_EQ(d.file().at("step0.tokens").dtype, DType::I64);
  EXPECT_EQ(d.get("generated").i, std::vector<int64_t>{3});
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"run.safetensors"});
  // An unfinished writer leaves nothing behind.
  {
    DumpWriter w(dir + "/abandoned.safetensors");
    const float v = 1;
    w.on_f32("step0.embed", {1}, &v);
  }
  EXPECT_EQ(list_dir(dir), std::vector<std::string>{"run.safetensors"});
}

TEST(TeeObserver, ForwardsToWhoeverWantsTheName) {
  MemoryDump a, b;
  a.set_filter({"step0.*"});
  b.set_filter({"*.logits"});
  TeeObserver tee(a, b);
  EXPECT_TRUE(tee.wants("step0.embed"));
  EXPECT_TRUE(tee.wants("step3.logits"));
  EXPECT_FALSE(tee.wants("step3.embed"));
  const float v[2] = {1, 2};
  const int64_t t[1] = {9};
  tee.on_f32("step0.logits", {2}, v);
  tee.on_f32("step1.logits", {2}, v);
  tee.on_f32("step0.embed", {2}, v);
  tee.on_i64("step0.tokens", {1}, t);
  EXPECT_EQ(a.names(), (std::vector<std::string>{"step0.tokens", "step0.embed", "step0.logits"}));
  EXPECT_EQ(b.names(), (std::vector<std::string>{"step0.logits", "step1.logits"}));
  NullObserver null;
  EXPECT_FALSE(null.wants("step0.embed"));
}

}  // namespace
}  // namespace llmdiff
