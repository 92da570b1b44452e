#include "compare/batch_report.h"

#include <algorithm>
#include <sstream>
#include <tuple>

#include "compare/explain.h"
#include "compare/paged_kv.h"
#include "compare/prefix_blocks.h"
#include "dumps/zoo/bugs.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sequences.h"

namespace llmdiff::compare {

namespace {

std::optional<int> step_of(const std::optional<std::string>& name) {
  if (!name) return std::nullopt;
  const CanonName c = parse_name(*name);
  return c.step >= 0 ? std::optional<int>(c.step) : std::nullopt;
}

std::string seq_list(const std::vector<int>& seqs) {
  std::string s;
  for (int b : seqs) s += (s.empty() ? "seq" : ", seq") + std::to_string(b);
  return s;
}

// The zoo's fingerprint of a cross-sequence cache finding: a block in the
// tables of two live sequences (BlockShared), a block of another prefix
// served (PrefixBlockStale), a shared block written by another sequence
// (PrefixBlockOverwritten).
zoo::Signature signature_of(const std::string& kind) {
  if (kind == "prefix-stale") return zoo::Signature::PrefixBlockStale;
  if (kind == "prefix-overwritten") return zoo::Signature::PrefixBlockOverwritten;
  return zoo::Signature::BlockShared;
}

// A cache block shared wrongly between sequences at or before the iteration
// where the first divergent one goes wrong: the fault is the block's
// (reused too early, another prefix's served, written in place), whatever
// that sequence's own diagnosis could say from its values alone
// (compare/explain.h).
void block_reuse_evidence(SequenceBisect& s, const std::vector<PagedKvFinding>& shared) {
  if (!s.iteration) return;
  for (const PagedKvFinding& p : shared) {
    if ((p.seq != s.seq && p.other_seq != s.seq) || p.iteration > *s.iteration) continue;
    BlockReuse e;
    e.bug = zoo::bug_with_signature(signature_of(p.kind)).name;
    e.text = p.text;
    e.seq = s.seq;
    e.step = s.step.value_or(0);
    e.iteration = *s.iteration;
    s.result.evidence.block_reuse = e;
    s.result.diagnosis.fingerprints.push_back({e.bug, p.text, true});
    explain(s.result);
    return;
  }
}

// Attention beyond a sequence's own keys (the zoo's AttentionLeak) in an
// engine call where no sequence came before it: the keys it also read are
// the call's padding rows (PaddingLeak), not another sequence's.
void padding_leak_evidence(const TensorSource& cand, SequenceBisect& s) {
  if (!s.iteration) return;
  const std::string padded = "iter" + std::to_string(*s.iteration) + ".padded_rows";
  const auto members = iteration_members(cand, *s.iteration);
  if (!cand.has(padded) || members.empty() || members.front().first != s.seq) return;
  const TensorData p = cand.get(padded);
  if (!p.is_int || p.i.size() != 1 || p.i[0] <= 0) return;
  const std::string leak = zoo::bug_with_signature(zoo::Signature::AttentionLeak).name;
  bool changed = false;
  for (Fingerprint& f : s.result.diagnosis.fingerprints) {
    if (f.bug != leak) continue;
    f.bug = zoo::bug_with_signature(zoo::Signature::PaddingLeak).name;
    f.evidence += "; seq" + std::to_string(s.seq) + " is the first sequence of engine iteration " +
                  std::to_string(*s.iteration) + ", which holds " + std::to_string(p.i[0]) +
                  " padding rows: the keys it also attends are theirs";
    changed = true;
  }
  if (changed) explain(s.result);
}

}  // namespace

int BatchBisect::exit_code() const {
  int code = 0;
  for (const SequenceBisect& s : sequences) code = std::max(code, s.result.exit_code());
  if (sampling && sampling->verdict == SamplingCheck::Verdict::Fail) code = 1;
  return code;
}

BatchBisect summarise_batch(const TensorSource& cand, std::vector<SequenceBisect> sequences) {
  BatchBisect b;
  b.candidate_label = cand.label();
  std::sort(sequences.begin(), sequences.end(), [](const auto& x, const auto& y) { return x.seq < y.seq; });
  b.sequences = std::move(sequences);
  // Engine order of a sequence's first wrong step: (iteration, row in it),
  // else (sequence, step) when the dump names no iterations.
  std::optional<std::tuple<int, int, int>> best;
  for (size_t i = 0; i < b.sequences.size(); ++i) {
    SequenceBisect& s = b.sequences[i];
    if (s.result.ok()) continue;
    s.step = step_of(s.result.first_divergence());
    if (!s.step) s.step = step_of(s.result.first_local_failure());
    std::tuple<int, int, int> key{1 << 30, s.seq, 1 << 30};  // no step named: after the others
    if (s.step) s.iteration = engine_iteration(cand, s.seq, *s.step);
    if (s.iteration) {
      const auto members = iteration_members(cand, *s.iteration);
      int row = 0;
      while (row < int(members.size()) && members[size_t(row)].first != s.seq) ++row;
      key = {*s.iteration, row, 0};
    } else if (s.step) {
      key = {1 << 30, s.seq, *s.step};  // after every sequence that has an iteration
    }
    if (!best || key < *best) {
      best = key;
      b.first = i;
    }
  }
  std::vector<PagedKvFinding> shared = check_paged_blocks_shared(cand);
  for (PagedKvFinding& p : check_prefix_blocks(cand)) shared.push_back(std::move(p));
  for (const PagedKvFinding& p : shared) b.notes.push_back("paged KV cache (" + p.kind + "), " + p.text);
  if (b.first) block_reuse_evidence(b.sequences[*b.first], shared);
  for (SequenceBisect& s : b.sequences) padding_leak_evidence(cand, s);
  const SequenceBisect* f = b.first_divergent();
  if (f && f->iteration) {
    for (const auto& [seq, step] : iteration_members(cand, *f->iteration)) {
      if (seq == f->seq) continue;
      auto it = std::find_if(b.sequences.begin(), b.sequences.end(), [&](const auto& s) { return s.seq == seq; });
      if (it == b.sequences.end()) continue;
      const bool affected = it->step && step >= 0 && *it->step <= step;
      (affected ? b.iteration_affected : b.iteration_unaffected).push_back(seq);
    }
  }
  return b;
}

std::string render_batch_table(const BatchBisect& b, const BisectTableOptions& opt) {
  std::ostringstream o;
  o << "several sequences in " << b.candidate_label << ": " << b.sequences.size()
    << ", each bisected as its own forward calls against the reference running it alone\n";
  o << "seq     steps  verdict   first divergence                                step  iteration  localised at"
       "  finding\n";
  for (const SequenceBisect& s : b.sequences) {
    const auto first = s.result.first_divergence();
    const auto at = s.result.localised_at();
    char line[512];
    std::snprintf(line, sizeof line, "seq%-4d %5d  %-8s  %-46s  %4s  %9s  %s", s.seq,
                  int(s.result.scenario.steps.size()), s.result.ok() ? "ok" : "diverges",
                  first ? first->c_str() : "-", s.step ? std::to_string(*s.step).c_str() : "-",
                  s.iteration ? std::to_string(*s.iteration).c_str() : "-",
                  s.result.ok() ? "-" : at.value_or("-").c_str());
    o << line;
    if (!s.result.ok()) o << "  " << headline(s.result.finding);
    o << "\n";
  }
  if (const SequenceBisect* f = b.first_divergent()) {
    o << "first divergent sequence: seq" << f->seq;
    if (f->step) o << " at step " << *f->step;
    if (f->iteration) {
      o << " (engine iteration " << *f->iteration << ")";
      if (b.iteration_affected.empty() && b.iteration_unaffected.empty())
        o << "; it ran alone in that iteration";
      else if (b.iteration_affected.empty())
        o << "; the other sequences of that iteration are unaffected (" << seq_list(b.iteration_unaffected)
          << "): a fault of this sequence's own rows (its positions, mask, cache slots)";
      else
        o << "; sequences of the same iteration diverge with it (" << seq_list(b.iteration_affected)
          << (b.iteration_unaffected.empty() ? "" : "; unaffected: " + seq_list(b.iteration_unaffected))
          << "): a fault shared across the batch (one sequence reading another's keys, padding or packing)";
    }
    o << "\n";
  } else {
    o << "every sequence matches the reference\n";
  }
  for (const std::string& n : b.notes) o << "note: " << n << "\n";
  for (const SequenceBisect& s : b.sequences) {
    const bool show = opt.all || (b.first && &s == b.first_divergent());
    if (!show) continue;
    o << "\n== seq" << s.seq << "\n" << render_bisect_table(s.result, opt);
  }
  if (b.sampling) o << "\n" << render_sampling_check(*b.sampling);
  return o.str();
}

nlohmann::json batch_to_json(const BatchBisect& b) {
  nlohmann::json j = {{"schema", kBatchBisectSchema}, {"candidate", b.candidate_label}};
  nlohmann::json seqs = nlohmann::json::array();
  for (const SequenceBisect& s : b.sequences) {
    nlohmann::json e = {{"seq", s.seq}, {"ok", s.result.ok()}};
    e["step"] = s.step ? nlohmann::json(*s.step) : nlohmann::json(nullptr);
    e["iteration"] = s.iteration ? nlohmann::json(*s.iteration) : nlohmann::json(nullptr);
    e["bisect"] = bisect_to_json(s.result);
    seqs.push_back(e);
  }
  j["sequences"] = seqs;
  const SequenceBisect* f = b.first_divergent();
  j["first_divergent_sequence"] = f ? nlohmann::json(f->seq) : nlohmann::json(nullptr);
  j["iteration_affected"] = b.iteration_affected;
  j["iteration_unaffected"] = b.iteration_unaffected;
  j["notes"] = b.notes;
  if (b.sampling) j["sampling"] = sampling_check_to_json(*b.sampling);
  j["exit_code"] = b.exit_code();
  return j;
}

}  // namespace llmdiff::compare
