// Tests of writers/c/llmdump.h against llmdiff's own writer (dumps/): byte
// identity on golden dumps and on awkward manifests, exact dtype widening,
// atomicity and errors of malformed calls.
//   test_c_writer WORKDIR GOLDEN...
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <dirent.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"
#include "llmdump.h"

namespace {

int failures = 0;
#define CHECK(cond, what)                                                        \
  do {                                                                           \
    if (!(cond)) {                                                               \
      std::cerr << __FILE__ << ":" << __LINE__ << ": FAILED: " << what << "\n"; \
      ++failures;                                                                \
    }                                                                            \
  } while (0)

std::string slurp(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}
bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}
std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d))
      if (std::strcmp(e->d_name, ".") && std::strcmp(e->d_name, "..")) out.push_back(e->d_name);
    ::closedir(d);
  }
  return out;
}

struct CManifest {
  std::vector<std::string> keys, values;
  std::vector<const char*> kp, vp;
  llmdump_manifest m{};
  explicit CManifest(const llmdiff::Manifest& src) {
    m.producer = src.producer.c_str();
    m.model = src.model.c_str();
    m.config = src.config.c_str();
    m.scenario = src.scenario.c_str();
    m.dtype = src.dtype.c_str();
    m.steps = src.steps;
    for (const auto& [k, v] : src.extra) keys.push_back(k), values.push_back(v);
    for (size_t i = 0; i < keys.size(); ++i) kp.push_back(keys[i].c_str()), vp.push_back(values[i].c_str());
    m.n_extra = keys.size();
    m.extra_keys = kp.data();
    m.extra_values = vp.data();
  }
};

// Writes `in`'s tensors in file order through llmdump (C) and through llmdiff's
// DumpWriter with `manifest`; the two files must be identical.
void compare_rewrite(const llmdiff::DumpFile& in, const llmdiff::Manifest& manifest, const std::string& dir,
                     const std::string& tag) {
  const std::string got = dir + "/" + tag + ".c.safetensors", want = dir + "/" + tag + ".ref.safetensors";
  CManifest cm(manifest);
  char err[512] = "";
  llmdump_writer* w = llmdump_open(got.c_str(), &cm.m, err, sizeof err);
  CHECK(w, "llmdump_open: " << err);
  if (!w) return;
  llmdiff::DumpWriter ref(want);
  ref.mutable_manifest() = manifest;
  for (const auto& info : in.file().tensors()) {
    const llmdiff::TensorData t = in.get(info.name);
    const int nd = int(t.shape.size());
    int rc;
    if (t.is_int) {
      rc = llmdump_add_i64(w, t.name.c_str(), nd, t.shape.data(), t.i.data());
      ref.on_i64(t.name, t.shape, t.i.data());
    } else if (info.dtype == llmdiff::DType::BF16 || info.dtype == llmdiff::DType::F16) {
      // Stored narrow: hand the writer the raw narrow bytes; it must widen exactly.
      rc = llmdump_add(w, t.name.c_str(), info.dtype == llmdiff::DType::BF16 ? LLMDUMP_BF16 : LLMDUMP_F16, nd,
                       t.shape.data(), in.file().data(info), info.nbytes());
      ref.on_f32(t.name, t.shape, t.f.data());
    } else {
      rc = llmdump_add_f32(w, t.name.c_str(), nd, t.shape.data(), t.f.data());
      ref.on_f32(t.name, t.shape, t.f.data());
    }
    CHECK(rc == 0, "llmdump_add " << t.name << ": " << llmdump_error(w));
  }
  CHECK(llmdump_finish(w) == 0, "llmdump_finish: " << llmdump_error(w));
  llmdump_free(w);
  ref.finish();
  const std::string a = slurp(got), b = slurp(want);
  CHECK(!a.empty() && a == b, tag << ": llmdump output (" << a.size() << " bytes) differs from llmdiff's writer ("
                                  << b.size() << " bytes): " << got << " vs " << want);
  if (a == b) std::remove(got.c_str()), std::remove(want.c_str());
}

void test_goldens(const std::string& dir, const std::vector<std::string>& goldens) {
  for (size_t g = 0; g < goldens.size(); ++g) {
    llmdiff::DumpFile in(goldens[g]);
    CHECK(in.is_llm_dump(), goldens[g] << " is not an llm-dump/1 file");
    compare_rewrite(in, in.manifest(), dir, "golden" + std::to_string(g));
    // The same tensors under an awkward manifest: escapes, unicode, extra keys
    // sorting around the standard ones, an extra key overridden by a standard one.
    llmdiff::Manifest m = in.manifest();
    m.producer = "eng \"quoted\" \\ back\tslash\x01\x1f\x7f / \xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80";
    m.steps = 12345;
    m.extra["AAA first"] = "line\nbreak\r\b\f";
    m.extra["zz_last"] = "";
    m.extra["dtype"] = "overridden";
    m.extra["m\xc3\xa9ta"] = "x";
    compare_rewrite(in, m, dir, "awkward" + std::to_string(g));
  }
}

void test_widening() {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float a = llmdump_bf16_to_f32(uint16_t(h)), b = llmdiff::bf16_to_f32(uint16_t(h));
    const float c = llmdump_f16_to_f32(uint16_t(h)), d = llmdiff::f16_to_f32(uint16_t(h));
    CHECK(std::memcmp(&a, &b, 4) == 0, "bf16 widening of " << h);
    CHECK(std::memcmp(&c, &d, 4) == 0, "f16 widening of " << h);
  }
}

void test_small_and_helpers(const std::string& dir) {
  char name[128];
  llmdump_layer_name(name, sizeof name, 2, 7, "attn.q_rope");
  CHECK(std::string(name) == "step2.layers.7.attn.q_rope", name);
  llmdump_step_name(name, sizeof name, 0, "logits");
  CHECK(std::string(name) == "step0.logits", name);
  llmdump_seq_name(name, sizeof name, 1, "generated");
  CHECK(std::string(name) == "seq1.generated", name);
  // [T=2, H=3, Dh=2] -> [H, T, Dh]
  float src[12], dst[12];
  for (int i = 0; i < 12; ++i) src[i] = float(i);
  llmdump_head_major_f32(src, dst, 2, 3, 2);
  const float want[12] = {0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11};
  CHECK(std::memcmp(dst, want, sizeof want) == 0, "head-major transpose");
  // Scalars, empty tensors, F16/BF16 widening through add, against the reference.
  const std::string got = dir + "/small.c.safetensors", ref_path = dir + "/small.ref.safetensors";
  llmdump_manifest m{};
  m.steps = 1;  // other fields NULL: written as ""
  char err[256];
  llmdump_writer* w = llmdump_open(got.c_str(), &m, err, sizeof err);
  CHECK(w, err);
  llmdiff::DumpWriter ref(ref_path);
  ref.mutable_manifest().steps = 1;
  const float one = 1.5f;
  CHECK(llmdump_add_f32(w, "scalar", 0, nullptr, &one) == 0, llmdump_error(w));
  ref.on_f32("scalar", {}, &one);
  const int64_t zero_shape[2] = {0, 4};
  CHECK(llmdump_add_f32(w, "empty", 2, zero_shape, nullptr) == 0, llmdump_error(w));
  ref.on_f32("empty", {0, 4}, nullptr);
  const uint16_t halves[4] = {0x3c00, 0x8001, 0x7c00, 0x7e01};
  const int64_t four[1] = {4};
  CHECK(llmdump_add(w, "f16", LLMDUMP_F16, 1, four, halves, 8) == 0, llmdump_error(w));
  CHECK(llmdump_add(w, "bf16", LLMDUMP_BF16, 1, four, halves, 8) == 0, llmdump_error(w));
  float wf[4], wb[4];
  for (int i = 0; i < 4; ++i) wf[i] = llmdiff::f16_to_f32(halves[i]), wb[i] = llmdiff::bf16_to_f32(halves[i]);
  ref.on_f32("f16", {4}, wf);
  ref.on_f32("bf16", {4}, wb);
  CHECK(llmdump_finish(w) == 0, llmdump_error(w));
  CHECK(llmdump_add_f32(w, "late", 0, nullptr, &one) != 0 && std::strstr(llmdump_error(w), "after finish"),
        "add after finish must fail");
  llmdump_free(w);
  ref.finish();
  CHECK(slurp(got) == slurp(ref_path), "small dump differs from llmdiff's writer");
}

void test_malformed(const std::string& dir) {
  const std::string path = dir + "/malformed.safetensors";
  llmdump_manifest m{};
  char err[256];
  llmdump_writer* w = llmdump_open(path.c_str(), &m, err, sizeof err);
  CHECK(w, err);
  const int64_t shape[2] = {2, 3};
  float data[6] = {0};
  CHECK(llmdump_add(w, "x", LLMDUMP_F32, 2, shape, data, 20) == -1, "size mismatch accepted");
  const std::string e = llmdump_error(w);
  CHECK(e.find("'x'") != std::string::npos && e.find("byte count 20 does not match shape [2, 3] of F32") !=
                                                   std::string::npos && e.find("expected 24") != std::string::npos,
        "unclear error: " << e);
  CHECK(llmdump_add(w, "x", LLMDUMP_F32, 2, shape, data, 24) == 0, "writer unusable after a rejected call");
  CHECK(llmdump_add(w, "x", LLMDUMP_F32, 2, shape, data, 24) == -1 &&
            std::strstr(llmdump_error(w), "duplicate tensor name"),
        "duplicate accepted: " << llmdump_error(w));
  const int64_t neg[1] = {-1};
  CHECK(llmdump_add(w, "n", LLMDUMP_F32, 1, neg, data, 0) == -1 && std::strstr(llmdump_error(w), "negative"),
        "negative dimension accepted: " << llmdump_error(w));
  CHECK(llmdump_add(w, "__metadata__", LLMDUMP_F32, 2, shape, data, 24) == -1, "reserved name accepted");
  CHECK(llmdump_add(w, "bad\xff", LLMDUMP_F32, 2, shape, data, 24) == -1, "invalid UTF-8 name accepted");
  llmdump_free(w);
  CHECK(!exists(path), "unfinished writer left a file at the final path");
  const char* k[1] = {"bad\xc0\xaf"};
  const char* v[1] = {"x"};
  m.n_extra = 1, m.extra_keys = k, m.extra_values = v;
  CHECK(!llmdump_open(path.c_str(), &m, err, sizeof err) && std::strstr(err, "UTF-8"), "overlong UTF-8 accepted");
}

void test_atomic(const std::string& dir) {
  // Freed before finish: no file, no temporaries.
  const std::string sub = dir + "/atomic";
  ::mkdir(sub.c_str(), 0755);
  const std::string path = sub + "/dump.safetensors";
  llmdump_manifest m{};
  char err[256];
  llmdump_writer* w = llmdump_open(path.c_str(), &m, err, sizeof err);
  const int64_t shape[1] = {1000};
  std::vector<float> data(1000, 1.0f);
  CHECK(llmdump_add_f32(w, "a", 1, shape, data.data()) == 0, llmdump_error(w));
  llmdump_free(w);
  CHECK(!exists(path) && entries(sub).empty(), "abandoned writer left files behind");
  // A process that dies mid-way (abort) never leaves a file at the final path.
  const pid_t pid = ::fork();
  if (pid == 0) {
    llmdump_writer* cw = llmdump_open(path.c_str(), &m, err, sizeof err);
    llmdump_add_f32(cw, "a", 1, shape, data.data());
    std::abort();
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  CHECK(WIFSIGNALED(status), "child did not abort");
  CHECK(!exists(path), "aborted writer left a file at the final path");
  // An existing file is replaced only by a complete one.
  { std::ofstream(path) << "old"; }
  w = llmdump_open(path.c_str(), &m, err, sizeof err);
  llmdump_add_f32(w, "a", 1, shape, data.data());
  CHECK(slurp(path) == "old", "final path touched before finish");
  CHECK(llmdump_finish(w) == 0, llmdump_error(w));
  llmdump_free(w);
  llmdiff::DumpFile back(path);
  CHECK(back.has("a") && back.manifest().format == "llm-dump/1", "finished dump unreadable");
  // (The aborted child's temporary data file stays: no process can clean up
  // after abort(); it never carries the final name.)
  const std::string mine = ".tmp." + std::to_string(::getpid()) + ".";
  for (const auto& e : entries(sub))
    CHECK(e == "dump.safetensors" || (e.find(".tmp.") != std::string::npos && e.find(mine) == std::string::npos),
          "temporary left after finish: " << e);
  for (const auto& e : entries(sub)) std::remove((sub + "/" + e).c_str());
  ::rmdir(sub.c_str());
}

// The batch helpers on a golden cache: a left-padded copy stripped back, a
// paged pool (blocks scattered, both layouts) gathered back.
void test_batch_helpers(const std::string& golden) {
  const llmdiff::DumpFile g(golden);
  const std::string name = "step" + std::to_string(g.num_steps() - 1) + ".layers.0.attn.k_cache";
  const llmdiff::TensorData kc = g.get(name);  // [Hkv, S, Dh]
  const int64_t H = kc.shape[0], S = kc.shape[1], Dh = kc.shape[2], pad = 3;
  std::vector<float> padded(size_t(H * (S + pad) * Dh), -9.f), back(kc.f.size());
  for (int64_t h = 0; h < H; ++h)
    std::copy_n(&kc.f[size_t(h * S * Dh)], S * Dh, &padded[size_t((h * (S + pad) + pad) * Dh)]);
  llmdump_take_rows_f32(padded.data(), back.data(), H, S + pad, Dh, pad, S);
  CHECK(back == kc.f, "take_rows does not strip the left padding of " << name);
  const int64_t bs = 2, blocks = 9, used = (S + bs - 1) / bs;
  std::vector<int64_t> table;
  for (int64_t b = 0; b < used; ++b) table.push_back((b * 5 + 3) % blocks);  // scattered, distinct
  for (int slot_major = 0; slot_major < 2; ++slot_major) {
    std::vector<float> pool(size_t(blocks * bs * H * Dh), 5.f), out(kc.f.size());
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t b = table[size_t(s / bs)], slot = s % bs;
        const int64_t at = slot_major ? ((b * bs + slot) * H + h) * Dh : ((b * H + h) * bs + slot) * Dh;
        std::copy_n(&kc.f[size_t((h * S + s) * Dh)], Dh, &pool[size_t(at)]);
      }
    CHECK(llmdump_gather_paged_f32(pool.data(), blocks, bs, H, Dh, slot_major, table.data(), used, S, out.data()) == 0,
          "gather_paged refused a valid table");
    CHECK(out == kc.f, "gather_paged (slot_major " << slot_major << ") does not rebuild " << name);
    std::vector<int64_t> bad = table;
    bad[0] = blocks;
    CHECK(llmdump_gather_paged_f32(pool.data(), blocks, bs, H, Dh, slot_major, bad.data(), used, S, out.data()) == -1,
          "gather_paged accepted a block outside the pool");
    CHECK(llmdump_gather_paged_f32(pool.data(), blocks, bs, H, Dh, slot_major, table.data(), used - 1, S,
                                   out.data()) == -1,
          "gather_paged accepted a table too short");
  }
}

// The per-sequence helpers on HF's golden batch (batch.safetensors beside the
// first golden dump): each iteration's embed rows packed as a serving engine
// holds them (two padding rows after them) and split back by cu_seqlens; the
// iterations numbered from engine ids are HF's iter{N} tensors.
void test_packed_helpers(const std::string& dir, const std::string& golden) {
  const std::string batch = golden.substr(0, golden.rfind('/') + 1) + "batch.safetensors";
  const llmdiff::DumpFile g(batch);
  const std::string path = dir + "/iterations.safetensors";
  llmdump_manifest m{};
  char err[256];
  llmdump_writer* w = llmdump_open(path.c_str(), &m, err, sizeof err);
  CHECK(w, err);
  llmdump_iterations it;
  llmdump_iterations_init(&it);
  int N = 0;
  for (; g.has("iter" + std::to_string(N) + ".seqs"); ++N) {
    const std::string pre = "iter" + std::to_string(N) + ".";
    const std::vector<int64_t> seqs = g.get(pre + "seqs").i, steps = g.get(pre + "seq_steps").i,
                               tokens = g.get(pre + "num_tokens").i;
    const int64_t n = int64_t(seqs.size());
    std::vector<llmdiff::TensorData> rows;
    std::vector<int64_t> cu{0}, ids;
    std::vector<float> packed;
    for (int64_t j = 0; j < n; ++j) {
      rows.push_back(g.get("seq" + std::to_string(seqs[size_t(j)]) + ".step" + std::to_string(steps[size_t(j)]) + ".embed"));
      packed.insert(packed.end(), rows.back().f.begin(), rows.back().f.end());
      cu.push_back(cu.back() + rows.back().shape[0]);
      ids.push_back(1000 - 7 * seqs[size_t(j)]);  // the engine's own ids
    }
    const int64_t D = rows[0].shape[1], R = cu.back() + 2;
    packed.resize(size_t(R * D), -7.f);
    for (int64_t j = 0; j < n; ++j) {
      std::vector<float> out(rows[size_t(j)].f.size(), 0.f);
      CHECK(llmdump_split_rows(packed.data(), size_t(D) * sizeof(float), R, cu.data(), n, j, out.data()) ==
                    rows[size_t(j)].shape[0] && out == rows[size_t(j)].f,
            "split_rows does not give back " << pre << " member " << j);
    }
    std::vector<int64_t> b(static_cast<size_t>(n)), step(static_cast<size_t>(n));
    CHECK(llmdump_iterations_call(&it, w, ids.data(), tokens.data(), n, b.data(), step.data()) == 0, llmdump_error(w));
    CHECK(b == seqs && step == steps, "iterations numbering differs from HF's " << pre << "seqs/seq_steps");
    CHECK(llmdump_iterations_seq(&it, ids[0]) == seqs[0], "iterations_seq");
  }
  CHECK(N >= 2, "the golden batch has " << N << " iterations");
  const int64_t cu_bad[3][3] = {{1, 2, 3}, {0, 3, 2}, {0, 2, 9}};
  float row[8] = {0}, out[64];
  for (const auto& cu : cu_bad)
    CHECK(llmdump_split_rows(row, 4, 8, cu, 2, 0, out) == -1, "split_rows accepted cu_seqlens " << cu[0] << "," << cu[1] << "," << cu[2]);
  const int64_t cu_ok[3] = {0, 2, 3};
  CHECK(llmdump_split_rows(row, 4, 8, cu_ok, 2, 2, out) == -1, "split_rows accepted sequence 2 of 2");
  const int64_t twice[2] = {5, 5}, ones[2] = {1, 1};
  int64_t b2[2], s2[2];
  CHECK(llmdump_iterations_call(&it, nullptr, twice, ones, 2, b2, s2) == -1, "iterations accepted an id twice");
  CHECK(llmdump_finish(w) == 0, llmdump_error(w));
  llmdump_free(w);
  llmdump_iterations_free(&it);
  const llmdiff::DumpFile back(path);
  for (int k = 0; k < N; ++k)
    for (const char* what : {"seqs", "seq_steps", "num_tokens"}) {
      const std::string name = "iter" + std::to_string(k) + "." + what;
      CHECK(back.has(name) && back.get(name).i == g.get(name).i, "written " << name << " differs from the golden's");
    }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: test_c_writer WORKDIR GOLDEN...\n";
    return 2;
  }
  const std::string dir = argv[1];
  ::mkdir(dir.c_str(), 0755);
  try {
    test_goldens(dir, std::vector<std::string>(argv + 2, argv + argc));
    test_widening();
    test_small_and_helpers(dir);
    test_malformed(dir);
    test_atomic(dir);
    if (argc > 2) test_batch_helpers(argv[2]);
    if (argc > 2) test_packed_helpers(dir, argv[2]);
  } catch (const std::exception& e) {
    std::cerr << "exception: " << e.what() << "\n";
    return 1;
  }
  if (failures) {
    std::cerr << failures << " check(s) failed\n";
    return 1;
  }
  std::cout << "test_c_writer: all checks passed (" << argc - 2 << " golden dumps)\n";
  return 0;
}
