// The continuous-batching engine (batch_engine.h): a scheduler over the one
// forward (impl/forward.h) and a paged KV cache (impl/kv_store.h).
#include "impl/batch_engine.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <sstream>

#include "dumps/contract/engine.h"
#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sequences.h"
#include "dumps/contract/sites.h"
#include "dumps/contract/sites.h"
#include "impl/forward.h"
#include "impl/impl_engine.h"
#include "impl/kv_store.h"

namespace llmdiff::impl {

namespace {

std::vector<int64_t> parse_ints(const std::string& text, const std::string& what) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (item.empty() || used != item.size()) throw UsageError(what + ": '" + item + "' is not an integer");
    out.push_back(v);
  }
  return out;
}

int parse_count(const std::string& text, const std::string& what) {
  const std::vector<int64_t> v = parse_ints(text, what);
  if (v.size() != 1 || v[0] < 0 || v[0] > 1000000) throw UsageError(what + ": '" + text + "' is not a count");
  return int(v[0]);
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A sequence being served.
struct Sequence {
  int id = 0;
  int64_t prompt_len = 0;           // positions before the first generated token
  int64_t fed = 0;                  // prompt tokens served so far (fed, or a prefix-cache hit)
  int64_t cached = 0;               // positions in the cache (P)
  int steps = 0;                    // forward calls that included it so far
  size_t released = 0;              // blocks at the table's front already given back (block-reuse-early)
  std::vector<int64_t> history;     // every token fed so far (generate's input_ids, for the sampler)
  std::vector<int64_t> by_position; // the token at each cached position (the prefix cache's index)
  std::vector<int64_t> cached_prefix;  // its prefix-cache hit
  int64_t stale = 0;                // rolled-back positions its next call still reads (spec-context-rejected)
  std::optional<SamplingParams> sampling;
  UniformStream draws{0};
  std::vector<int64_t> generated;
  bool finished = false;
  std::unique_ptr<Engine> draft;    // its draft model (speculative "draft")
  int64_t draft_fed = 0;            // positions the draft model holds
  int draft_calls = 0;
};

// The continuation of the latest n-gram (n = `ngram` down to 1) of
// `tokens` seen earlier in them: up to k tokens (prompt-lookup decoding).
std::vector<int64_t> ngram_drafts(const std::vector<int64_t>& tokens, int ngram, int k) {
  const int64_t L = int64_t(tokens.size());
  for (int64_t n = std::min<int64_t>(ngram, L - 1); n >= 1; --n)
    for (int64_t i = L - n - 1; i >= 0; --i)
      if (std::equal(tokens.end() - n, tokens.end(), tokens.begin() + i)) {
        const int64_t from = i + n, to = std::min(L, from + k);
        if (from < to) return std::vector<int64_t>(tokens.begin() + from, tokens.begin() + to);
      }
  return {};
}

}  // namespace

std::vector<BatchRequest> parse_batch_requests(const std::string& text, int decode) {
  std::vector<BatchRequest> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ';')) {
    const std::string what = "batch request " + std::to_string(out.size()) + " ('" + item + "')";
    BatchRequest r;
    r.decode = decode;
    std::string prompt = item;
    const size_t colon = prompt.find(':');
    if (colon != std::string::npos) {
      r.decode = parse_count(prompt.substr(colon + 1), what + ", decode calls");
      prompt = prompt.substr(0, colon);
    }
    const size_t at = prompt.find('@');
    if (at != std::string::npos) {
      r.join = parse_count(prompt.substr(at + 1), what + ", joining iteration");
      prompt = prompt.substr(0, at);
    }
    r.prompt = parse_ints(prompt, what);
    if (r.prompt.empty()) throw UsageError(what + ": an empty prompt");
    out.push_back(std::move(r));
  }
  if (out.empty()) throw UsageError("batch: no requests given");
  return out;
}

BatchSchedule schedule_of(const TensorSource& dump) {
  BatchSchedule sc;
  std::map<int, Scenario> seqs;  // each sequence's own calls, read once
  for (int b : dump_sequences(dump)) {
    seqs[b] = replay_scenario(SequenceView(dump, b));
    if (size_t(b) >= sc.prompt_len.size()) sc.prompt_len.resize(size_t(b) + 1, 0);
    // Prompt: its prefix-cache hit and every call up to the one that
    // generated the first token.
    sc.prompt_len[size_t(b)] = int64_t(seqs[b].cached_prefix.size());
    for (int k = 0; k <= seqs[b].first_generating_step; ++k)
      sc.prompt_len[size_t(b)] += int64_t(seqs[b].steps[size_t(k)].size());
  }
  auto call = [&](int b, int step) {
    auto it = seqs.find(b);
    if (it == seqs.end() || step < 0 || step >= int(it->second.steps.size()))
      throw FormatError(dump.label(), sequence_prefix(b) + step_name(step, Site::Tokens),
                        "a step of the batch without its tokens");
    const Scenario& own = it->second;
    BatchCall c{b, own.steps[size_t(step)], {}, 0, false};
    if (step == 0) c.cached_prefix = own.cached_prefix;
    const auto r = own.rollback.find(step);
    if (r != own.rollback.end()) c.rollback = r->second, c.verify = true;
    return c;
  };
  for (int n = 0; dump.has("iter" + std::to_string(n) + ".padded_rows"); ++n) {
    const TensorData p = dump.get("iter" + std::to_string(n) + ".padded_rows");
    if (!p.is_int || p.i.size() != 1 || p.i[0] < 0)
      throw FormatError(dump.label(), "iter" + std::to_string(n) + ".padded_rows", "expected [1] I64 >= 0");
    sc.padded_rows.push_back(p.i[0]);
  }
  if (dump.has("iter0.seqs")) {
    for (int n = 0; dump.has("iter" + std::to_string(n) + ".seqs"); ++n) {
      std::vector<BatchCall> calls;
      for (const auto& [b, step] : iteration_members(dump, n)) calls.push_back(call(b, step));
      sc.iterations.push_back(std::move(calls));
    }
  } else {
    for (const auto& [b, scenario] : seqs)
      for (int step = 0; step < int(scenario.steps.size()); ++step) sc.iterations.push_back({call(b, step)});
  }
  return sc;
}

namespace {

ForwardOptions forward_options(const BatchEngineOptions& o) {
  ForwardOptions f;
  f.threads = o.threads;
  f.bugs = o.bugs;
  f.release_weights = o.release_weights;
  f.mla = o.mla;
  f.precision = o.precision;
  f.tensor_parallel = o.tensor_parallel;
  return f;
}

// Blocks for every sequence at once, each reaching `positions` (+1 for a
// context one too long), and one spare.
int64_t default_blocks(const std::vector<int64_t>& positions, int64_t B) {
  int64_t n = 1;
  for (int64_t p : positions) n += ceil_div(p + 1, B);
  return n;
}

// The positions each request reaches: every token fed (its prompt and a
// token per decode call), and the one generated last.
std::vector<int64_t> reached(const std::vector<BatchRequest>& requests) {
  std::vector<int64_t> out;
  for (const BatchRequest& r : requests) out.push_back(int64_t(r.prompt.size()) + r.decode + 1);
  return out;
}

}  // namespace

struct BatchEngine::State {
  State(const Model& model, const BatchEngineOptions& o)
      : opt(o), model(model), fwd(model, forward_options(o)), sampler_faults(zoo::sampler_faults(o.bugs)) {}
  BatchEngineOptions opt;
  const Model& model;
  Forward fwd;
  zoo::SamplerFaults sampler_faults;
  std::unique_ptr<PagedKv> kv;  // the paged cache of the current run
  std::vector<Sequence> seqs;
  std::vector<int64_t> iteration_rows;
  std::vector<double> iteration_seconds;
  std::vector<int64_t> iteration_generated;
  BatchOutcome counts;  // the serving features' counts of the current run

  // One sequence's part of the next call: its tokens, the drafts it
  // verifies (speculative decoding), the positions it rolls back after it
  // (a replayed verify call; -1: the engine decides), a prefix-cache hit to
  // serve first (a replayed sequence's first call).
  struct Part {
    int seq = 0;
    std::vector<int64_t> tokens;
    std::vector<int64_t> drafts;
    int64_t rollback = -1;
    std::vector<int64_t> cached_prefix;
  };

  // An empty pool and one new sequence per entry of `positions`, the
  // positions each reaches (the pool sized for them when the options give
  // no size).
  void start(const std::vector<int64_t>& positions);
  // Gives blocks [from, to) of s's table back to the pool.
  void release(const Sequence& s, size_t from, size_t to) { kv->release(s.id, from, to); }
  // One engine iteration over the parts (`padding` rows added, or the
  // bucket's): cache bookkeeping, the forward call, each sequence's new
  // tokens, the sequences that are done giving their blocks back, the
  // iter{N}.* names.
  void iterate(std::vector<Part>& parts, int64_t padding, Observer& obs,
               const std::function<bool(const Sequence&)>& finished_after);
  BatchOutcome finish(Observer& obs);

 private:
  // Rows for `s` writing `tokens` at its next positions: planned, blocks
  // allocated (its own: a shared block copied first), slots taken.
  SequenceRows plan(Sequence& s, const std::vector<int64_t>& tokens, int64_t row0, int it, bool hidden);
  // A prefix-cache hit served before a replayed sequence's first call: as
  // much of `prefix` as the cache holds, the rest computed in this call by
  // rows reported by no name.
  void serve_prefix(Sequence& s, const std::vector<int64_t>& prefix, ForwardCall& call, int64_t& rows, int it);
  // The verify call's outcome: drafts accepted as the target's argmax
  // agrees (or as a replay says), tokens generated, rejected positions
  // rolled back.
  void verify(Sequence& s, const SequenceRows& m, const Part& part, const float* logits, Observer& obs);
  int64_t padding_rows(int64_t rows) const;
};

BatchEngine::BatchEngine(const Model& model, const BatchEngineOptions& opt)
    : s_(std::make_unique<State>(model, opt)) {
  if (opt.block_size <= 0) throw UsageError("batch: block size must be > 0");
  if (opt.num_blocks < 0 || opt.chunk < 0 || opt.bucket < 0) throw UsageError("batch: blocks, chunk and bucket must be >= 0");
  if (zoo::sampler_faults(opt.bugs).any() && !opt.sampling)
    throw UsageError("batch: the sampler's bugs act only when the run samples: give sampling parameters");
  if (opt.sampling) opt.sampling->validate();
  if (!opt.speculative.empty()) {
    if (opt.speculative != "ngram" && opt.speculative != "draft")
      throw UsageError("batch: unknown speculative proposer '" + opt.speculative + "' (supported: ngram, draft)");
    if (opt.spec_k < 1 || opt.ngram < 1) throw UsageError("batch: speculative k and n-gram must be >= 1");
    if (opt.speculative == "draft" && (opt.draft_layers < 1 || opt.draft_layers > model.config.num_hidden_layers))
      throw UsageError("batch: the draft model's layers must be 1 .. " +
                       std::to_string(model.config.num_hidden_layers));
    if (opt.sampling) throw UsageError("batch: speculative decoding here is greedy: no sampling parameters");
  }
  // A serving feature's bug acts only when the feature is on.
  for (const zoo::BugSpec& b : opt.bugs) {
    const zoo::Feature f = zoo::bug_info(b.bug).feature;
    const bool on = f == zoo::Feature::None || (f == zoo::Feature::PrefixCache && opt.prefix_cache) ||
                    (f == zoo::Feature::Speculative && !opt.speculative.empty()) ||
                    (f == zoo::Feature::BucketPadding && opt.bucket > 0);
    if (!on)
      throw UsageError(std::string("batch: '") + zoo::bug_name(b.bug) + "' acts only with " + zoo::feature_name(f) +
                       " on");
  }
}

SamplingParams sampling_for(const BatchEngineOptions& o, int b) {
  SamplingParams p = o.sampling.value_or(SamplingParams{});
  p.seed = p.seed.value_or(0) + uint64_t(b);
  return p;
}

BatchEngine::~BatchEngine() = default;

std::string BatchEngine::producer() const {
  const BatchEngineOptions& o = s_->opt;
  std::string p = "llmdiff impl continuous batching (" + s_->fwd.describe() + ", paged KV cache, block size " +
                  std::to_string(o.block_size);
  if (o.prefix_cache) p += ", prefix cache";
  if (!o.speculative.empty()) p += ", speculative " + o.speculative + " k=" + std::to_string(o.spec_k);
  if (o.bucket > 0) p += ", rows padded to multiples of " + std::to_string(o.bucket);
  p += ")";
  for (size_t i = 0; i < o.bugs.size(); ++i) p += (i == 0 ? " with bugs: " : ", ") + o.bugs[i].str();
  return p;
}

PrecisionProfile BatchEngine::precision() const { return s_->opt.precision; }

std::string BatchEngine::kv_cache_json(const std::vector<BatchRequest>& requests) const {
  const int64_t B = s_->opt.block_size;
  const int64_t n = s_->opt.num_blocks > 0 ? s_->opt.num_blocks : default_blocks(reached(requests), B);
  return "{\"kind\": \"paged\", \"block_size\": " + std::to_string(B) + ", \"num_blocks\": " + std::to_string(n) +
         (s_->opt.prefix_cache ? ", \"prefix_cache\": true" : "") + "}";
}

std::string BatchEngine::speculative_json() const {
  const BatchEngineOptions& o = s_->opt;
  if (o.speculative.empty()) return "";
  std::string j = std::string("{\"proposer\": \"") + (o.speculative == "draft" ? "draft-model" : "ngram") +
                  "\", \"k\": " + std::to_string(o.spec_k);
  if (o.speculative == "draft") j += ", \"draft_layers\": " + std::to_string(o.draft_layers);
  return j + "}";
}

void BatchEngine::State::start(const std::vector<int64_t>& positions) {
  const ModelConfig& c = fwd.config();
  const int64_t B = opt.block_size;
  // Room for every sequence at once, a bucket's padding rows, and the
  // drafts a verify call writes past the positions kept.
  std::vector<int64_t> reach = positions;
  for (int64_t& p : reach) p += opt.speculative.empty() ? 0 : opt.spec_k * p;  // even without a rollback
  if (opt.bucket > 0) reach.push_back(opt.bucket);
  const int64_t num_blocks = opt.num_blocks > 0 ? opt.num_blocks : default_blocks(reach, B);
  kv = std::make_unique<PagedKv>(int(c.num_hidden_layers), fwd.kv_widths(), opt.precision.kv_cache, B, num_blocks);
  kv->gather_swapped(fwd.batch_faults().blocks_swapped);
  kv->prefix_cache({opt.prefix_cache, fwd.batch_faults().prefix_hash_last_block,
                    fwd.batch_faults().prefix_shared_write});
  seqs.clear();
  seqs.resize(positions.size());
  for (size_t b = 0; b < positions.size(); ++b) {
    seqs[b].id = int(b);
    if (opt.sampling) {
      seqs[b].sampling = sampling_for(opt, int(b));
      seqs[b].draws = UniformStream(*seqs[b].sampling->seed);
    }
  }
  iteration_rows.clear();
  iteration_seconds.clear();
  iteration_generated.clear();
  counts = BatchOutcome();
}

int64_t BatchEngine::State::padding_rows(int64_t rows) const {
  return opt.bucket > 0 && rows % opt.bucket != 0 ? opt.bucket - rows % opt.bucket : 0;
}

SequenceRows BatchEngine::State::plan(Sequence& s, const std::vector<int64_t>& tokens, int64_t row0, int it,
                                      bool hidden) {
  const ModelConfig& c = fwd.config();
  const int64_t V = c.vocab_size, pool_slots = kv->num_blocks() * opt.block_size;
  for (int64_t t : tokens)
    if (t < 0 || t >= V)
      throw UsageError("batch: token id " + std::to_string(t) + " of seq" + std::to_string(s.id) +
                       " is outside the vocabulary [0, " + std::to_string(V) + ")");
  SequenceRows m;
  m.seq = s.id;
  m.step = s.steps;
  m.tokens = tokens;
  m.row0 = row0;
  m.hidden = hidden;
  plan_rows(fwd, m, s.cached, 0, 0, hidden ? 0 : s.stale);
  if (m.kv.write_at + m.T > c.max_position_embeddings)
    throw UsageError("batch: seq" + std::to_string(s.id) + " reaches " + std::to_string(m.kv.write_at + m.T) +
                     " positions, beyond max_position_embeddings " + std::to_string(c.max_position_embeddings));
  // Cache bookkeeping: its own blocks for the positions it writes, blocks
  // for the positions it reads, the slot of each new token.
  m.kv.seq = s.id;
  kv->own_for_write(s.id, m.kv.write_at, m.kv.write_at + m.T, it);
  kv->allocate(s.id, std::max(m.kv.context, m.kv.write_at + m.T), it);
  for (int64_t t = 0; t < m.T; ++t) {
    const int64_t slot = kv->slot_of(s.id, m.kv.write_at + t);
    m.kv.slots.push_back(fwd.batch_faults().slot_mapping_shift ? (slot + 1) % pool_slots : slot);
  }
  s.cached = m.kv.write_at + m.T;  // rolled back after the call where a verify call says so
  s.by_position.resize(size_t(m.kv.write_at));
  s.by_position.insert(s.by_position.end(), tokens.begin(), tokens.end());
  return m;
}

void BatchEngine::State::serve_prefix(Sequence& s, const std::vector<int64_t>& prefix, ForwardCall& call,
                                      int64_t& rows, int it) {
  const int64_t hit = kv->lookup(s.id, prefix, int64_t(prefix.size()));
  counts.prefix_hit_tokens += hit;
  s.cached = hit;
  s.by_position.assign(prefix.begin(), prefix.begin() + hit);
  if (hit < int64_t(prefix.size())) {
    SequenceRows h = plan(s, std::vector<int64_t>(prefix.begin() + hit, prefix.end()), rows, it, true);
    rows += h.T;
    call.seqs.push_back(std::move(h));
  }
  s.cached_prefix = prefix;
  s.fed = int64_t(prefix.size());
}

void BatchEngine::State::verify(Sequence& s, const SequenceRows& m, const Part& part, const float* logits,
                                Observer& obs) {
  const zoo::BatchFaults& bug = fwd.batch_faults();
  const int64_t V = fwd.config().vocab_size, k = int64_t(part.drafts.size());
  auto argmax_row = [&](int64_t r) { return argmax_first(std::vector<float>(logits + r * V, logits + (r + 1) * V)); };
  int64_t accepted = 0;
  if (part.rollback >= 0) {  // a replayed verify call: as the schedule says
    accepted = std::max<int64_t>(0, k - part.rollback);
  } else {
    // Greedy: draft i is kept while the target's argmax after the token
    // before it agrees; then one more token from the row after the last kept.
    while (accepted < k && argmax_row(accepted) == part.drafts[size_t(accepted)]) ++accepted;
    if (bug.spec_accept_off_by_one && accepted < k) ++accepted;
  }
  counts.drafts_proposed += k;
  counts.drafts_accepted += accepted;
  for (int64_t i = 0; i < accepted; ++i) s.generated.push_back(part.drafts[size_t(i)]);
  s.generated.push_back(argmax_row(accepted));
  const int64_t kept = m.kv.write_at + 1 + accepted, rejected = k - accepted;
  s.cached = bug.spec_rollback_missing ? m.kv.write_at + m.T : kept;
  s.stale = bug.spec_context_rejected ? rejected : 0;
  s.by_position.resize(size_t(s.cached));
  const std::string prefix = sequence_prefix(s.id);
  const std::string draft = prefix + step_name(m.step, Site::SpecDraft), acc = prefix + step_name(m.step, Site::SpecAccepted);
  if (obs.wants(draft)) obs.on_i64(draft, {k}, part.drafts.data());
  if (obs.wants(acc)) obs.on_i64(acc, {1}, &accepted);
  // The draft model keeps the positions whose tokens the target kept.
  if (s.draft) {
    const int64_t keep = m.kv.write_at + 1 + std::min(accepted, k - 1);
    if (s.draft_fed > keep) s.draft->rollback(s.draft_fed - keep);
    s.draft_fed = std::min(s.draft_fed, keep);
  }
}

void BatchEngine::State::iterate(std::vector<Part>& parts, int64_t padding, Observer& obs,
                                 const std::function<bool(const Sequence&)>& finished_after) {
  const zoo::BatchFaults& bug = fwd.batch_faults();
  const int64_t B = opt.block_size, V = fwd.config().vocab_size;
  const int it = int(iteration_rows.size());
  ForwardCall call;
  call.iteration = it;
  call.batched = true;
  int64_t rows = 0;
  std::vector<size_t> own;  // parts[j]'s rows in call.seqs
  for (Part& part : parts) {
    Sequence& s = seqs[size_t(part.seq)];
    if (!part.cached_prefix.empty()) serve_prefix(s, part.cached_prefix, call, rows, it);
    SequenceRows m = plan(s, part.tokens, rows, it, false);
    m.all_logits = !part.drafts.empty();
    rows += m.T;
    own.push_back(call.seqs.size());
    call.seqs.push_back(std::move(m));
  }
  // Rows of no sequence up to the bucket's shape, with a cache of their own.
  if (padding < 0) padding = padding_rows(rows);
  counts.padded_rows += padding;
  if (padding > 0) {
    Sequence pad;
    pad.id = int(seqs.size());
    SequenceRows p = plan(pad, std::vector<int64_t>(size_t(padding), 0), rows, it, false);
    p.padding = true;
    rows += p.T;
    call.seqs.push_back(std::move(p));
  }

  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<float> logits = fwd.run(call, *kv, obs);  // each part's rows of logits, in row order
  iteration_seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  iteration_rows.push_back(rows);

  std::vector<int64_t> seq_ids, seq_steps, num_tokens;
  int64_t generated = 0;
  std::vector<size_t> offset(call.seqs.size());  // each rows' first logits row
  for (size_t i = 0, at = 0; i < call.seqs.size(); ++i) {
    offset[i] = at;
    at += call.seqs[i].all_logits ? size_t(call.seqs[i].T) : 1;
  }
  for (size_t j = 0; j < parts.size(); ++j) {
    const Part& part = parts[j];
    const SequenceRows& m = call.seqs[own[j]];
    Sequence& s = seqs[size_t(part.seq)];
    const float* lg = &logits[offset[own[j]] * size_t(V)];
    seq_ids.push_back(s.id), seq_steps.push_back(m.step), num_tokens.push_back(m.T);
    if (s.steps == 0 && !s.cached_prefix.empty()) {
      const std::string name = sequence_prefix(s.id) + step_name(0, Site::KvCachedPrefix);
      if (obs.wants(name)) obs.on_i64(name, {int64_t(s.cached_prefix.size())}, s.cached_prefix.data());
    }
    const bool was_prefill = s.fed < s.prompt_len;
    const size_t before = s.generated.size();
    s.fed += m.T;
    s.steps += 1;
    s.history.insert(s.history.end(), m.tokens.begin(), m.tokens.end());
    if (!part.drafts.empty()) {
      verify(s, m, part, lg, obs);
    } else if (s.fed >= s.prompt_len) {
      const std::vector<float> next(lg, lg + V);
      if (s.sampling) {  // HF's processors on this sequence's logits and history, its own draws
        const SampledStep drawn = sample_step(*s.sampling, next, s.history, s.draws, sampler_faults);
        report_sample(obs, m.step, drawn, sequence_prefix(s.id));
        s.generated.push_back(drawn.token);
      } else {
        s.generated.push_back(argmax_first(next));
      }
    }
    generated += int64_t(s.generated.size() - before);
    kv->index_full_blocks(s.id, s.by_position, s.cached);
    if (was_prefill && s.fed >= s.prompt_len && bug.free_after_prefill) {
      // block-reuse-early: the prompt's full blocks go back to the pool
      // while the sequence still reads them through its table.
      s.released = size_t(s.cached / B);
      release(s, 0, s.released);
    }
    if (finished_after(s)) {  // done: its blocks back to the pool
      s.finished = true;
      release(s, s.released, kv->table(s.id).size());
    }
  }
  iteration_generated.push_back(generated);
  if (padding > 0) kv->truncate(int(seqs.size()), 0);  // the padding rows' blocks back
  const std::string iter = "iter" + std::to_string(it) + ".";
  const Shape n{int64_t(parts.size())};
  if (obs.wants(iter + "seqs")) obs.on_i64(iter + "seqs", n, seq_ids.data());
  if (obs.wants(iter + "seq_steps")) obs.on_i64(iter + "seq_steps", n, seq_steps.data());
  if (obs.wants(iter + "num_tokens")) obs.on_i64(iter + "num_tokens", n, num_tokens.data());
  if (opt.bucket > 0 && obs.wants(iter + "padded_rows")) obs.on_i64(iter + "padded_rows", {1}, &padding);
}

BatchOutcome BatchEngine::State::finish(Observer& obs) {
  BatchOutcome out = counts;
  out.iterations = int(iteration_rows.size());
  for (int64_t r : iteration_rows) out.rows += r;
  out.iteration_rows = iteration_rows;
  out.iteration_seconds = iteration_seconds;
  out.iteration_generated = iteration_generated;
  for (const Sequence& s : seqs) out.prompt_tokens += s.prompt_len;
  for (const Sequence& s : seqs) {
    const std::string name = sequence_prefix(s.id) + "generated";
    if (!s.generated.empty() && obs.wants(name)) obs.on_i64(name, {int64_t(s.generated.size())}, s.generated.data());
    out.generated.push_back(s.generated);
  }
  return out;
}

namespace {

// Up to k drafts for sequence s, whose next token is `last`: the n-gram
// proposer on its own tokens, or its draft model (the checkpoint's first
// layers, run on the tokens it has not seen, then on its own drafts).
std::vector<int64_t> propose(Sequence& s, int64_t last, int64_t k, const BatchEngineOptions& o, const Model& model) {
  std::vector<int64_t> tokens = s.by_position;
  tokens.push_back(last);
  if (o.speculative == "ngram") return ngram_drafts(tokens, o.ngram, int(k));
  if (!s.draft) {
    Model draft = model;
    draft.config.num_hidden_layers = o.draft_layers;
    ImplOptions io;
    io.threads = o.threads;
    io.precision = o.precision;
    s.draft = make_impl_engine(draft, io);
  }
  NullObserver none;
  std::vector<int64_t> out;
  std::vector<int64_t> feed(tokens.begin() + s.draft_fed, tokens.end());
  for (int64_t i = 0; i < k; ++i) {
    const std::vector<float> logits = s.draft->forward(feed, s.draft_calls++, none);
    s.draft_fed += int64_t(feed.size());
    out.push_back(argmax_first(logits));
    feed = {out.back()};
  }
  return out;
}

}  // namespace

BatchOutcome BatchEngine::run(const std::vector<BatchRequest>& requests, Observer& obs) {
  State& st = *s_;
  if (requests.empty()) throw UsageError("batch: no requests given");
  for (size_t b = 0; b < requests.size(); ++b)
    if (requests[b].prompt.empty()) throw UsageError("batch: request " + std::to_string(b) + " has no prompt");
  st.start(reached(requests));
  for (size_t b = 0; b < requests.size(); ++b) st.seqs[b].prompt_len = int64_t(requests[b].prompt.size());
  auto done = [&](const Sequence& s) { return int(s.generated.size()) >= requests[size_t(s.id)].decode + 1; };
  for (int tick = 0;; ++tick) {
    const auto t0 = std::chrono::steady_clock::now();
    // Admit every unfinished sequence whose request has arrived, in request
    // order: the rest of its prompt (a chunk of it, after a prefix-cache
    // hit), or its last token (and the drafts to verify).
    std::vector<State::Part> parts;
    bool waiting = false;
    for (Sequence& s : st.seqs) {
      const BatchRequest& r = requests[size_t(s.id)];
      if (s.finished) continue;
      if (r.join > tick) {
        waiting = true;
        continue;
      }
      State::Part part;
      part.seq = s.id;
      if (s.steps == 0 && st.opt.prefix_cache) {  // a hit leaves at least the prompt's last token to compute
        const int64_t hit = st.kv->lookup(s.id, r.prompt, int64_t(r.prompt.size()) - 1);
        st.counts.prefix_hit_tokens += hit;
        s.fed = s.cached = hit;
        s.by_position.assign(r.prompt.begin(), r.prompt.begin() + hit);
        s.cached_prefix = s.by_position;
      }
      if (s.fed < s.prompt_len) {
        const int64_t left = s.prompt_len - s.fed;
        const int64_t n = st.opt.chunk > 0 ? std::min(st.opt.chunk, left) : left;
        part.tokens.assign(r.prompt.begin() + s.fed, r.prompt.begin() + s.fed + n);
      } else {
        part.tokens = {s.generated.back()};
        const int64_t remaining = r.decode + 1 - int64_t(s.generated.size());
        const int64_t k = std::min<int64_t>(st.opt.spec_k, remaining - 1);
        if (!st.opt.speculative.empty() && k > 0) {
          part.drafts = propose(s, s.generated.back(), k, st.opt, st.model);
          part.tokens.insert(part.tokens.end(), part.drafts.begin(), part.drafts.end());
        }
      }
      parts.push_back(std::move(part));
    }
    if (parts.empty()) {
      if (!waiting) break;
      continue;
    }
    st.iterate(parts, -1, obs, done);
    st.iteration_seconds.back() = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return st.finish(obs);
}

BatchOutcome BatchEngine::replay(const BatchSchedule& schedule, Observer& obs) {
  State& st = *s_;
  size_t sequences = 0;
  std::vector<int> last_call;  // per sequence: the iteration of its last call
  std::vector<int64_t> total;  // per sequence: positions over all its calls
  for (size_t it = 0; it < schedule.iterations.size(); ++it)
    for (const BatchCall& call : schedule.iterations[it]) {
      if (call.seq < 0 || call.tokens.empty())
        throw UsageError("batch replay: iteration " + std::to_string(it) + " has an empty call or a negative seq");
      sequences = std::max(sequences, size_t(call.seq) + 1);
      last_call.resize(sequences, -1);
      total.resize(sequences, 0);
      last_call[size_t(call.seq)] = int(it);
      total[size_t(call.seq)] += int64_t(call.tokens.size() + call.cached_prefix.size());
    }
  if (sequences == 0) throw UsageError("batch replay: an empty schedule");
  std::vector<int64_t> reach = total;  // every token fed, and the one generated last
  for (int64_t& p : reach) p += 1;
  st.start(reach);
  for (size_t b = 0; b < sequences; ++b)
    st.seqs[b].prompt_len = b < schedule.prompt_len.size() ? schedule.prompt_len[b] : total[b];
  for (size_t it = 0; it < schedule.iterations.size(); ++it) {
    std::vector<State::Part> parts;
    for (const BatchCall& call : schedule.iterations[it]) {
      for (const State::Part& other : parts)
        if (other.seq == call.seq)
          throw UsageError("batch replay: seq" + std::to_string(call.seq) + " twice in iteration " +
                           std::to_string(it));
      State::Part part;
      part.seq = call.seq;
      part.tokens = call.tokens;
      part.rollback = call.rollback;
      part.cached_prefix = call.cached_prefix;
      if (call.verify) part.drafts.assign(call.tokens.begin() + 1, call.tokens.end());
      parts.push_back(std::move(part));
    }
    const int iteration = int(it);
    const int64_t padding = it < schedule.padded_rows.size() ? schedule.padded_rows[it] : 0;
    st.iterate(parts, padding, obs, [&](const Sequence& s) { return last_call[size_t(s.id)] == iteration; });
  }
  return st.finish(obs);
}

}  // namespace llmdiff::impl
