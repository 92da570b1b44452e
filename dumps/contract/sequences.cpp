#include "dumps/contract/sequences.h"

#include <algorithm>
#include <map>
#include <set>

#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/contract/padding.h"
#include "dumps/sampling/sampling.h"

namespace llmdiff {

int sequence_of(const std::string& name, size_t* rest) {
  if (name.compare(0, 3, "seq") != 0) return -1;
  size_t i = 3;
  int b = 0;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9' && i < 12) b = b * 10 + (name[i++] - '0');
  if (i == 3 || i >= name.size() || name[i] != '.') return -1;
  if (rest) *rest = i + 1;
  return b;
}

namespace {

bool is_iteration_name(const std::string& name) { return name.compare(0, 4, "iter") == 0; }

std::vector<int64_t> ints(const TensorSource& d, const std::string& name) {
  const TensorData t = d.get(name);
  if (!t.is_int || t.shape.size() != 1)
    throw FormatError(d.label(), name, "expected an integer tensor of shape [n], got " + shape_str(t.shape));
  return t.i;
}

}  // namespace

std::string sequence_prefix(int b) { return "seq" + std::to_string(b) + "."; }

std::vector<int> dump_sequences(const TensorSource& d) {
  std::set<int> seqs;
  for (const std::string& n : d.names()) {
    const int b = sequence_of(n);
    if (b >= 0) seqs.insert(b);
  }
  return {seqs.begin(), seqs.end()};
}

SequenceView::SequenceView(const TensorSource& source, int b) : src_(source), b_(b) {
  label_ = source.label() + " [seq" + std::to_string(b) + "]";
  bool own = false;
  for (const std::string& n : source.names()) {
    size_t rest = 0;
    const int s = sequence_of(n, &rest);
    if (s == b) {
      names_.push_back(n.substr(rest));
      own = true;
    } else if (s < 0 && !is_iteration_name(n)) {
      names_.push_back(n);  // model-wide (rope.inv_freq)
    }
  }
  if (!own) throw MissingTensorError(source.label(), sequence_prefix(b) + "step0.tokens");
  sort_canonical(names_);
  manifest_ = source.manifest();
  manifest_.steps = 0;
  for (const std::string& n : names_) {
    const CanonName c = parse_name(n);
    if (c.step >= 0) manifest_.steps = std::max(manifest_.steps, c.step + 1);
  }
  // Its own sampling parameters become the dump-wide ones; the others go.
  const std::optional<SamplingParams> sampling = manifest_sampling(source.manifest(), source.label(), b);
  for (auto it = manifest_.extra.begin(); it != manifest_.extra.end();)
    it = it->first.compare(0, 9, "sampling.") == 0 ? manifest_.extra.erase(it) : std::next(it);
  manifest_.extra.erase(sampling_manifest_key());
  if (sampling) set_manifest_sampling(manifest_, *sampling);
  // Likewise its own left padding.
  const std::optional<LeftPadding> padding = manifest_padding(source.manifest(), source.label(), b);
  for (auto it = manifest_.extra.begin(); it != manifest_.extra.end();)
    it = it->first.compare(0, 7, "padding") == 0 ? manifest_.extra.erase(it) : std::next(it);
  if (padding) set_manifest_padding(manifest_, *padding);
}

std::string SequenceView::full(const std::string& name) const {
  const std::string prefixed = sequence_prefix(b_) + name;
  if (src_.has(prefixed)) return prefixed;
  if (sequence_of(name) < 0 && !is_iteration_name(name) && src_.has(name)) return name;
  return "";
}

bool SequenceView::has(const std::string& name) const { return !full(name).empty(); }

Shape SequenceView::shape(const std::string& name) const {
  const std::string f = full(name);
  if (f.empty()) throw MissingTensorError(label_, name);
  return src_.shape(f);
}

TensorData SequenceView::get(const std::string& name) const {
  const std::string f = full(name);
  if (f.empty()) throw MissingTensorError(label_, name);
  TensorData t = src_.get(f);
  t.name = name;
  return t;
}

std::vector<std::pair<int, int>> iteration_members(const TensorSource& d, int iteration) {
  const std::string prefix = "iter" + std::to_string(iteration) + ".";
  if (!d.has(prefix + "seqs")) return {};
  const std::vector<int64_t> seqs = ints(d, prefix + "seqs");
  const std::vector<int64_t> steps = d.has(prefix + "seq_steps") ? ints(d, prefix + "seq_steps")
                                                                  : std::vector<int64_t>(seqs.size(), -1);
  if (steps.size() != seqs.size())
    throw FormatError(d.label(), prefix + "seq_steps",
                      "has " + std::to_string(steps.size()) + " entries, " + prefix + "seqs " +
                          std::to_string(seqs.size()));
  std::vector<std::pair<int, int>> out;
  for (size_t i = 0; i < seqs.size(); ++i) out.emplace_back(int(seqs[i]), int(steps[i]));
  return out;
}

std::optional<int> engine_iteration(const TensorSource& d, int b, int step) {
  for (int n = 0; d.has("iter" + std::to_string(n) + ".seqs"); ++n)
    for (const auto& [seq, s] : iteration_members(d, n))
      if (seq == b && s == step) return n;
  return std::nullopt;
}

void validate_iterations(const TensorSource& d) {
  std::map<int, int> last_step;  // sequence -> its step in the latest iteration seen
  for (int n = 0; d.has("iter" + std::to_string(n) + ".seqs"); ++n) {
    const std::string it = "iter" + std::to_string(n) + ".";
    const std::vector<std::pair<int, int>> members = iteration_members(d, n);
    std::vector<int64_t> tokens;
    if (d.has(it + "num_tokens")) {
      tokens = ints(d, it + "num_tokens");
      if (tokens.size() != members.size())
        throw FormatError(d.label(), it + "num_tokens",
                          "has " + std::to_string(tokens.size()) + " entries, " + it + "seqs " +
                              std::to_string(members.size()));
    }
    std::set<int> seen;
    for (size_t i = 0; i < members.size(); ++i) {
      const auto [b, step] = members[i];
      const std::string where = it + (step < 0 ? "seqs" : "seq_steps");
      if (!seen.insert(b).second)
        throw FormatError(d.label(), it + "seqs", "lists seq" + std::to_string(b) + " twice");
      if (step < 0) continue;  // no seq_steps: nothing more to check
      const std::string tok = sequence_prefix(b) + "step" + std::to_string(step) + ".tokens";
      if (!d.has(tok))
        throw FormatError(d.label(), where,
                          "names step " + std::to_string(step) + " of seq" + std::to_string(b) + ", which the dump "
                          "does not hold (no " + tok + ")");
      if (!tokens.empty() && numel(d.shape(tok)) != tokens[i])
        throw FormatError(d.label(), it + "num_tokens",
                          "gives seq" + std::to_string(b) + " " + std::to_string(tokens[i]) + " tokens at its step " +
                              std::to_string(step) + ", " + tok + " holds " + std::to_string(numel(d.shape(tok))));
      auto prev = last_step.find(b);
      if (prev != last_step.end() && step <= prev->second)
        throw FormatError(d.label(), where,
                          "runs step " + std::to_string(step) + " of seq" + std::to_string(b) +
                              " after its step " + std::to_string(prev->second) + " (steps must follow each other)");
      last_step[b] = step;
    }
  }
}

}  // namespace llmdiff
