#include "cli/common.h"

#include <sys/resource.h>

#include <chrono>
#include <cstdio>

#include <fmt/core.h>


#include "bench/support.h"
#include "compare/report.h"
#include "dumps/base/files.h"
#include "dumps/base/blas_core.h"
#include "dumps/base/errors.h"
#include "dumps/contract/ranks.h"
#include "synth/synth.h"

namespace llmdiff::cli {

int64_t parse_memory_budget(const std::string& text) {
  if (text.empty()) return 0;
  try {
    return int64_t(synth::parse_byte_size(text));
  } catch (const Error& e) {
    throw UsageError(std::string("--memory-budget: ") + e.what());
  }
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    if (comma == std::string::npos) comma = text.size();
    std::string item = text.substr(start, comma - start);
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    if (!item.empty()) out.push_back(item);
    start = comma + 1;
  }
  return out;
}

std::vector<int64_t> parse_int_list(const std::string& text, const std::string& option) {
  std::vector<int64_t> out;
  for (const auto& item : split_list(text)) {
    try {
      size_t used = 0;
      long long v = std::stoll(item, &used);
      if (used != item.size()) throw std::invalid_argument(item);
      out.push_back(v);
    } catch (const std::exception&) {
      throw UsageError(option + ": '" + item + "' is not an integer");
    }
  }
  if (out.empty()) throw UsageError(option + ": empty list");
  return out;
}

Scenario scenario_from_options(const std::string& tokens, const std::string& replay, const std::string& chunks,
                               int decode) {
  if (tokens.empty() == replay.empty()) throw UsageError("give exactly one of --tokens or --replay");
  if (!replay.empty()) {
    if (!chunks.empty()) throw UsageError("--chunks cannot be combined with --replay (the dump's own steps are used)");
    const DumpFile file(replay);
    const std::unique_ptr<RankView> ranks = unsharded(file);  // a tensor-parallel dump's calls
    Scenario sc = replay_scenario(ranks ? static_cast<const TensorSource&>(*ranks) : file);
    if (decode > 0) {
      sc.decode = decode;
      sc.emit_generated = true;
    }
    return sc;
  }
  return make_scenario(parse_int_list(tokens, "--tokens"), chunks.empty() ? std::vector<int64_t>{}
                                                                          : parse_int_list(chunks, "--chunks"),
                       decode);
}

void write_side_output(const std::string& path, const std::string& text, const std::string& what, bool json) {
  write_file_atomic(path, text);
  fmt::print(json ? stderr : stdout, "wrote {} {}\n", what, path);
}

namespace {
double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

PhaseLog::PhaseLog(bool enabled)
    : enabled_(enabled),
      start_(now_seconds()),
      read_(bench::proc_io_bytes("read_bytes")),
      written_(bench::proc_io_bytes("write_bytes")) {
  if (!enabled_) return;
  const std::string note = forced_blas_core_note();
  if (!note.empty()) std::fprintf(stderr, "note: %s\n", note.c_str());
}

// Each phase with the disk traffic it made: a model larger than the page
// cache leaves reads its weights from disk in every pass over it.
void PhaseLog::operator()(const std::string& what) const {
  if (!enabled_) return;
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  const int64_t read = bench::proc_io_bytes("read_bytes"), written = bench::proc_io_bytes("write_bytes");
  std::fprintf(stderr,
               "[%7.1f s, peak %5.1f GB, now %5.1f GB anonymous + %5.1f GB mapped files; disk read %5.1f GB, "
               "written %5.1f GB] %s\n",
               now_seconds() - start_, double(ru.ru_maxrss) * 1024.0 / 1e9,
               double(bench::proc_status_bytes("RssAnon")) / 1e9, double(bench::proc_status_bytes("RssFile")) / 1e9,
               double(read - read_) / 1e9, double(written - written_) / 1e9, what.c_str());
  read_ = read;
  written_ = written;
  std::fflush(stderr);
}


void add_scenario_options(CLI::App& sub, ScenarioCliOptions& o) {
  sub.add_option("--tokens", o.tokens, "prompt token ids, comma separated");
  sub.add_option("--replay", o.replay, "re-run exactly the forward calls of this dump");
  sub.add_option("--decode", o.decode, "greedy decode steps after the prompt")->check(CLI::NonNegativeNumber);
  sub.add_option("--chunks", o.chunks, "chunked prefill: chunk sizes, comma separated");
}

}  // namespace llmdiff::cli
