// llmdiff merge PART.json... [--json] [--out FILE.json]
// The JSON results of shards of one bisection (bisect --layers A:B --json)
// joined into the result of the whole run (compare/merge.h).
#include "cli/commands.h"

#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>

#include "compare/merge.h"
#include "dumps/base/errors.h"
#include "dumps/base/files.h"

namespace llmdiff::cli {

struct MergeOptions {
  std::vector<std::string> parts;
  bool json = false;  // print the merged JSON instead of the summary
  std::string out;    // also write the merged JSON here
};

namespace {

compare::ShardResult read_part(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(path, "cannot open");
  std::stringstream text;
  text << in.rdbuf();
  compare::ShardResult p;
  p.file = path;
  try {
    p.result = nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::parse_error& e) {  // the offset only: the input's bytes stay out of the message
    throw FormatError(path, "", "not JSON (syntax error at byte " + std::to_string(e.byte) + ")");
  }
  return p;
}

int run_merge(const MergeOptions& o) {
  std::vector<compare::ShardResult> parts;
  for (const std::string& p : o.parts) parts.push_back(read_part(p));
  nlohmann::json merged;
  try {
    merged = compare::merge_bisect_shards(std::move(parts));
  } catch (const nlohmann::json::exception& e) {  // a key of the wrong type or missing
    throw UsageError("merge: the parts are not bisect --layers A:B --json results (" + std::string(e.what()) + ")");
  }
  const std::string doc = merged.dump(2) + "\n";
  if (!o.out.empty()) write_file_atomic(o.out, doc);
  const std::string text = o.json ? doc : compare::render_merged_summary(merged);
  std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
  return merged.value("exit_code", 1);
}

}  // namespace

void setup_merge(CLI::App& app, Action& action) {
  auto o = std::make_shared<MergeOptions>();
  CLI::App* sub = app.add_subcommand(
      "merge", "Join the JSON results of shards of one bisection (bisect --layers A:B --json) into the whole run's: "
               "verdict, first divergence, first local failure and diagnosis");
  sub->add_option("parts", o->parts, "each shard's bisect --json output, in any order")->required();
  sub->add_flag("--json", o->json, "print the merged result as JSON (schema llmdiff.bisect/1, with \"shards\")");
  sub->add_option("--out", o->out, "also write the merged JSON to this file");
  sub->callback([o, &action] { action = [o] { return run_merge(*o); }; });
}

}  // namespace llmdiff::cli
