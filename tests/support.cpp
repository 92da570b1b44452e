#include "tests/support.h"

#include <dirent.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "dumps/contract/names.h"

namespace llmdiff::testing {

std::string source_dir() { return LLMDIFF_SOURCE_DIR; }
std::string golden_dir() { return source_dir() + "/tests/golden"; }

std::vector<std::string> golden_models() {
  std::vector<std::string> out;
  DIR* d = ::opendir(golden_dir().c_str());
  if (!d) throw std::runtime_error("cannot open " + golden_dir());
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    struct stat st {};
    if (name[0] != '.' && ::stat((golden_dir() + "/" + name + "/config.json").c_str(), &st) == 0) out.push_back(name);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

std::string golden_model(const std::string& name) { return golden_dir() + "/" + name; }
std::string golden_dump(const std::string& model, const std::string& scenario) {
  return golden_model(model) + "/" + scenario + ".safetensors";
}

std::string temp_path(const std::string& stem) {
  // One directory per test process, removed with everything in it at exit.
  static const std::string dir = [] {
    std::string base = "/tmp/llmdiff-test-" + std::to_string(::getpid());
    ::mkdir(base.c_str(), 0700);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all("/tmp/llmdiff-test-" + std::to_string(::getpid()), ec);
    });
    return base;
  }();
  return dir + "/" + stem;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

int run_command(const std::string& cmd, std::string* output) {
  output->clear();
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return -1;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) output->append(buf, n);
  const int status = ::pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

int run_binary(const std::string& args, std::string* output, const std::string& env) {
  return run_command(
      (env.empty() ? "" : "env " + env + " ") + std::string(LLMDIFF_BINARY_DIR) + "/llmdiff " + args + " 2>&1", output);
}

std::string first_difference(const TensorSource& a, const TensorSource& b) {
  if (a.names() != b.names()) return "the names differ";
  for (const std::string& n : a.names()) {
    const TensorData x = a.get(n), y = b.get(n);
    if (x.shape != y.shape) return n + ": shape " + shape_str(x.shape) + " vs " + shape_str(y.shape);
    if (x.i != y.i) return n + ": integers differ";
    if (x.f.size() != y.f.size() ||
        (!x.f.empty() && std::memcmp(x.f.data(), y.f.data(), x.f.size() * sizeof(float)) != 0))
      return n + ": values differ";
  }
  return "";
}

static void check_same_shape(const TensorData& a, const TensorData& b) {
  if (a.shape != b.shape) throw std::runtime_error(a.name + ": shape " + shape_str(a.shape) + " vs " + shape_str(b.shape));
  if (a.is_int != b.is_int) throw std::runtime_error(a.name + ": integer vs float tensor");
}

double max_abs_diff(const TensorData& a, const TensorData& b) {
  check_same_shape(a, b);
  double m = 0;
  if (a.is_int) {
    for (size_t k = 0; k < a.i.size(); ++k) m = std::max(m, std::fabs(double(a.i[k] - b.i[k])));
    return m;
  }
  for (size_t k = 0; k < a.f.size(); ++k) {
    double d = std::fabs(double(a.f[k]) - double(b.f[k]));
    if (std::isnan(d)) return INFINITY;
    m = std::max(m, d);
  }
  return m;
}

double max_abs(const TensorData& a) {
  double m = 0;
  for (float v : a.f) m = std::max(m, std::fabs(double(v)));
  for (int64_t v : a.i) m = std::max(m, std::fabs(double(v)));
  return m;
}

double nmse(const TensorData& a, const TensorData& b) {
  check_same_shape(a, b);
  double num = 0, den = 0;
  for (size_t k = 0; k < a.f.size(); ++k) {
    double d = double(a.f[k]) - double(b.f[k]);
    num += d * d;
    den += double(b.f[k]) * double(b.f[k]);
  }
  return den > 0 ? num / den : (num > 0 ? INFINITY : 0.0);
}

nlohmann::json embedded_json(const std::string& page, const std::string& id) {
  const std::string open = "<script type=\"application/json\" id=\"" + id + "\">";
  const size_t a = page.find(open);
  if (a == std::string::npos) return nullptr;
  const size_t b = page.find("</script>", a);
  return nlohmann::json::parse(page.substr(a + open.size(), b - a - open.size()));
}

std::string changed_golden(const std::string& model, const std::string& scenario, const std::string& stem,
                           const std::function<void(MemoryDump&)>& change) {
  DumpFile golden(golden_dump(model, scenario));
  MemoryDump d("changed");
  d.mutable_manifest() = golden.manifest();
  for (const auto& n : golden.names()) d.put(golden.get(n));
  change(d);
  const std::string path = temp_path(stem) + ".safetensors";
  d.save(path);
  return path;
}

namespace {

// Every token fed through step `step` (generate's input_ids at that step).
std::vector<int64_t> fed_through(const TensorSource& d, int step) {
  std::vector<int64_t> h;
  for (int s = 0; s <= step; ++s) {
    const TensorData t = d.get(step_name(s, "tokens"));
    h.insert(h.end(), t.i.begin(), t.i.end());
  }
  return h;
}

}  // namespace

std::string resampled_dump(const std::string& path, const SamplerPipeline& pipeline, const std::string& stem,
                           bool* departs) {
  const DumpFile in(path);
  const SamplingParams p = *manifest_sampling(in.manifest(), path);
  MemoryDump out("resampled");
  out.mutable_manifest() = in.manifest();
  *departs = false;
  for (const std::string& name : in.names()) {
    TensorData t = in.get(name);
    const CanonName c = parse_name(name);
    if (c.site == "sample.scores" || c.site == "sample.probs" || c.site == "sample.token") {
      const std::vector<float> logits = in.get(step_name(c.step, "next_logits")).f;
      const std::vector<int64_t> history = fed_through(in, c.step);
      const std::vector<float> scores = process_scores(p, logits, history, pipeline);
      const std::vector<float> probs = sample_probs(p, scores, logits, history, pipeline);
      if (c.site == "sample.token") {
        if (in.has(step_name(c.step, "sample.u"))) {
          t.i[0] = pick_inverse_cdf(probs, in.get(step_name(c.step, "sample.u")).f[0]);
        } else if (probs[size_t(t.i[0])] == 0.0f) {
          t.i[0] = int64_t(std::max_element(probs.begin(), probs.end()) - probs.begin());
        }
      } else {
        const std::vector<float>& v = c.site == "sample.scores" ? scores : probs;
        if (v.size() != t.f.size() || std::memcmp(v.data(), t.f.data(), v.size() * sizeof(float)) != 0) *departs = true;
        t.f = v;
      }
    }
    out.put(t);
  }
  const std::string out_path = temp_path(stem) + ".safetensors";
  out.save(out_path);
  return out_path;
}

}  // namespace llmdiff::testing
