#include "dumps/contract/calls.h"

#include <algorithm>
#include <string>

#include "dumps/base/errors.h"
#include "dumps/contract/sites.h"

namespace llmdiff {

std::vector<CallSpan> call_spans(const std::vector<std::vector<int64_t>>& steps, int64_t prefix,
                                 const std::map<int, int64_t>& rollback) {
  std::vector<CallSpan> out;
  int64_t P = prefix;
  for (size_t s = 0; s < steps.size(); ++s) {
    CallSpan c;
    c.P = P;
    c.T = int64_t(steps[s].size());
    const auto r = rollback.find(int(s));
    c.rollback = r == rollback.end() ? 0 : std::min(r->second, c.T);
    out.push_back(c);
    P += c.T - c.rollback;
  }
  return out;
}

namespace {

// An integer tensor of the format's rank 1 (FormatError naming it otherwise).
std::vector<int64_t> ints(const TensorSource& d, const std::string& name) {
  const TensorData t = d.get(name);
  if (!t.is_int || t.shape.size() != 1) throw FormatError(d.label(), name, "expected a 1-D I64 tensor");
  return t.i;
}

}  // namespace

std::vector<int64_t> cached_prefix(const TensorSource& d) {
  const std::string name = step_name(0, Site::KvCachedPrefix);
  return d.has(name) ? ints(d, name) : std::vector<int64_t>{};
}

std::map<int, int64_t> spec_rollbacks(const TensorSource& d) {
  std::map<int, int64_t> out;
  const std::vector<std::vector<int64_t>> steps = d.step_tokens();
  for (int s = 0; s < int(steps.size()); ++s) {
    const std::string name = step_name(s, Site::SpecAccepted);
    if (!d.has(name)) continue;
    const std::vector<int64_t> a = ints(d, name);
    if (a.size() != 1) throw FormatError(d.label(), name, "expected [1], the drafts accepted");
    // Drafts the call rejected: its tokens after the first, less those accepted
    // (an accepted count outside 0..k is the candidate's own finding).
    const int64_t drafts = int64_t(steps[size_t(s)].size()) - 1;
    out[s] = std::max<int64_t>(0, drafts - std::max<int64_t>(0, a[0]));
  }
  return out;
}

bool speculative(const TensorSource& d) {
  for (int s = 0; d.has(step_name(s, Site::Tokens)); ++s)
    if (d.has(step_name(s, Site::SpecDraft)) || d.has(step_name(s, Site::SpecAccepted))) return true;
  return false;
}

std::vector<CallSpan> call_spans(const TensorSource& d) {
  return call_spans(d.step_tokens(), int64_t(cached_prefix(d).size()), spec_rollbacks(d));
}

}  // namespace llmdiff
