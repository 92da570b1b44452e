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
#include "impl/forward.h"
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
  int64_t fed = 0;                  // tokens fed so far (the prompt's progress)
  int64_t cached = 0;               // positions in the cache (P; fed, unless a bug says otherwise)
  int steps = 0;                    // forward calls that included it so far
  size_t released = 0;              // blocks at the table's front already given back (block-reuse-early)
  std::vector<int64_t> history;     // every token fed so far (generate's input_ids, for the sampler)
  std::optional<SamplingParams> sampling;
  UniformStream draws{0};
  std::vector<int64_t> generated;
  bool finished = false;
};

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
    // Prompt: every call up to the one that generated the first token.
    for (int k = 0; k <= seqs[b].first_generating_step; ++k)
      sc.prompt_len[size_t(b)] += int64_t(seqs[b].steps[size_t(k)].size());
  }
  auto call = [&](int b, int step) {
    auto it = seqs.find(b);
    if (it == seqs.end() || step < 0 || step >= int(it->second.steps.size()))
      throw FormatError(dump.label(), sequence_prefix(b) + step_name(step, Site::Tokens),
                        "a step of the batch without its tokens");
    return BatchCall{b, it->second.steps[size_t(step)]};
  };
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
      : opt(o), fwd(model, forward_options(o)), sampler_faults(zoo::sampler_faults(o.bugs)) {}
  BatchEngineOptions opt;
  Forward fwd;
  zoo::SamplerFaults sampler_faults;
  std::unique_ptr<PagedKv> kv;  // the paged cache of the current run
  std::vector<Sequence> seqs;

  // An empty pool and one new sequence per entry of `positions`, the
  // positions each reaches (the pool sized for them when the options give
  // no size).
  void start(const std::vector<int64_t>& positions);
  // Gives blocks [from, to) of s's table back to the pool.
  void release(const Sequence& s, size_t from, size_t to) { kv->release(s.id, from, to); }
  // One engine iteration over the sequences' calls (their tokens set): cache
  // bookkeeping, the forward call, each sequence's new token, the sequences
  // that are done giving their blocks back, the iter{N}.* names.
  void iterate(ForwardCall& call, Observer& obs, const std::function<bool(const Sequence&)>& finished_after);
  BatchOutcome finish(Observer& obs);
  std::vector<int64_t> iteration_rows;
  std::vector<double> iteration_seconds;
};

BatchEngine::BatchEngine(const Model& model, const BatchEngineOptions& opt)
    : s_(std::make_unique<State>(model, opt)) {
  if (opt.block_size <= 0) throw UsageError("batch: block size must be > 0");
  if (opt.num_blocks < 0 || opt.chunk < 0) throw UsageError("batch: blocks and chunk must be >= 0");
  if (zoo::sampler_faults(opt.bugs).any() && !opt.sampling)
    throw UsageError("batch: the sampler's bugs act only when the run samples: give sampling parameters");
  if (opt.sampling) opt.sampling->validate();
}

SamplingParams sampling_for(const BatchEngineOptions& o, int b) {
  SamplingParams p = o.sampling.value_or(SamplingParams{});
  p.seed = p.seed.value_or(0) + uint64_t(b);
  return p;
}

BatchEngine::~BatchEngine() = default;

std::string BatchEngine::producer() const {
  std::string p = "llmdiff impl continuous batching (" + s_->fwd.describe() + ", paged KV cache, block size " +
                  std::to_string(s_->opt.block_size) + ")";
  for (size_t i = 0; i < s_->opt.bugs.size(); ++i) p += (i == 0 ? " with bugs: " : ", ") + s_->opt.bugs[i].str();
  return p;
}

PrecisionProfile BatchEngine::precision() const { return s_->opt.precision; }

std::string BatchEngine::kv_cache_json(const std::vector<BatchRequest>& requests) const {
  const int64_t B = s_->opt.block_size;
  const int64_t n = s_->opt.num_blocks > 0 ? s_->opt.num_blocks : default_blocks(reached(requests), B);
  return "{\"kind\": \"paged\", \"block_size\": " + std::to_string(B) + ", \"num_blocks\": " + std::to_string(n) +
         "}";
}

void BatchEngine::State::start(const std::vector<int64_t>& positions) {
  const ModelConfig& c = fwd.config();
  const int64_t B = opt.block_size;
  const int64_t num_blocks = opt.num_blocks > 0 ? opt.num_blocks : default_blocks(positions, B);
  kv = std::make_unique<PagedKv>(int(c.num_hidden_layers), fwd.kv_widths(), opt.precision.kv_cache, B, num_blocks);
  kv->gather_swapped(fwd.batch_faults().blocks_swapped);
  seqs.assign(positions.size(), Sequence{});
  for (size_t b = 0; b < positions.size(); ++b) {
    seqs[b].id = int(b);
    if (opt.sampling) {
      seqs[b].sampling = sampling_for(opt, int(b));
      seqs[b].draws = UniformStream(*seqs[b].sampling->seed);
    }
  }
  iteration_rows.clear();
  iteration_seconds.clear();
}

void BatchEngine::State::iterate(ForwardCall& call, Observer& obs,
                                 const std::function<bool(const Sequence&)>& finished_after) {
  const ModelConfig& c = fwd.config();
  const zoo::BatchFaults& bug = fwd.batch_faults();
  const int64_t B = opt.block_size, V = c.vocab_size, pool_slots = kv->num_blocks() * B;
  const int it = int(iteration_rows.size());
  call.iteration = it;
  call.batched = true;
  int64_t rows = 0;
  for (SequenceRows& m : call.seqs) {
    Sequence& s = seqs[size_t(m.seq)];
    for (int64_t t : m.tokens)
      if (t < 0 || t >= V)
        throw UsageError("batch: token id " + std::to_string(t) + " of seq" + std::to_string(s.id) +
                         " is outside the vocabulary [0, " + std::to_string(V) + ")");
    m.step = s.steps;
    m.row0 = rows;
    plan_rows(fwd, m, s.cached);
    rows += m.T;
    // Cache bookkeeping: blocks for the positions this call reads, the slot
    // of each new token.
    if (m.kv.write_at + m.T > c.max_position_embeddings)
      throw UsageError("batch: seq" + std::to_string(s.id) + " reaches " + std::to_string(m.kv.write_at + m.T) +
                       " positions, beyond max_position_embeddings " + std::to_string(c.max_position_embeddings));
    m.kv.seq = s.id;
    kv->allocate(s.id, m.kv.context, it);
    m.kv.slots.clear();
    for (int64_t t = 0; t < m.T; ++t) {
      const int64_t slot = kv->slot_of(s.id, m.kv.write_at + t);
      m.kv.slots.push_back(bug.slot_mapping_shift ? (slot + 1) % pool_slots : slot);
    }
  }

  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<float> next = fwd.run(call, *kv, obs);  // [M, V]
  iteration_seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  iteration_rows.push_back(rows);

  std::vector<int64_t> seq_ids, seq_steps, num_tokens;
  for (size_t j = 0; j < call.seqs.size(); ++j) {
    const SequenceRows& m = call.seqs[j];
    Sequence& s = seqs[size_t(m.seq)];
    seq_ids.push_back(s.id), seq_steps.push_back(m.step), num_tokens.push_back(m.T);
    const bool was_prefill = s.fed < s.prompt_len;
    s.fed += m.T;
    s.cached = m.kv.write_at + m.T;
    s.steps += 1;
    s.history.insert(s.history.end(), m.tokens.begin(), m.tokens.end());
    if (s.fed >= s.prompt_len) {
      const std::vector<float> logits(next.begin() + int64_t(j) * V, next.begin() + int64_t(j + 1) * V);
      if (s.sampling) {  // HF's processors on this sequence's logits and history, its own draws
        const SampledStep drawn = sample_step(*s.sampling, logits, s.history, s.draws, sampler_faults);
        report_sample(obs, m.step, drawn, sequence_prefix(s.id));
        s.generated.push_back(drawn.token);
      } else {
        s.generated.push_back(argmax_first(logits));
      }
    }
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
  const std::string iter = "iter" + std::to_string(it) + ".";
  const Shape n{int64_t(call.seqs.size())};
  if (obs.wants(iter + "seqs")) obs.on_i64(iter + "seqs", n, seq_ids.data());
  if (obs.wants(iter + "seq_steps")) obs.on_i64(iter + "seq_steps", n, seq_steps.data());
  if (obs.wants(iter + "num_tokens")) obs.on_i64(iter + "num_tokens", n, num_tokens.data());
}

BatchOutcome BatchEngine::State::finish(Observer& obs) {
  BatchOutcome out;
  out.iterations = int(iteration_rows.size());
  for (int64_t r : iteration_rows) out.rows += r;
  out.iteration_rows = iteration_rows;
  out.iteration_seconds = iteration_seconds;
  for (const Sequence& s : seqs) {
    const std::string name = sequence_prefix(s.id) + "generated";
    if (!s.generated.empty() && obs.wants(name)) obs.on_i64(name, {int64_t(s.generated.size())}, s.generated.data());
    out.generated.push_back(s.generated);
  }
  return out;
}

BatchOutcome BatchEngine::run(const std::vector<BatchRequest>& requests, Observer& obs) {
  State& st = *s_;
  if (requests.empty()) throw UsageError("batch: no requests given");
  for (size_t b = 0; b < requests.size(); ++b)
    if (requests[b].prompt.empty()) throw UsageError("batch: request " + std::to_string(b) + " has no prompt");
  st.start(reached(requests));
  for (size_t b = 0; b < requests.size(); ++b) st.seqs[b].prompt_len = int64_t(requests[b].prompt.size());
  auto done = [&](const Sequence& s) { return int(s.generated.size()) == requests[size_t(s.id)].decode + 1; };
  for (int tick = 0;; ++tick) {
    // Admit every unfinished sequence whose request has arrived, in request
    // order: the rest of its prompt (a chunk of it), or its last token.
    ForwardCall call;
    bool waiting = false;
    for (Sequence& s : st.seqs) {
      const BatchRequest& r = requests[size_t(s.id)];
      if (s.finished) continue;
      if (r.join > tick) {
        waiting = true;
        continue;
      }
      SequenceRows m;
      m.seq = s.id;
      if (s.fed < s.prompt_len) {
        const int64_t left = s.prompt_len - s.fed;
        const int64_t n = st.opt.chunk > 0 ? std::min(st.opt.chunk, left) : left;
        m.tokens.assign(r.prompt.begin() + s.fed, r.prompt.begin() + s.fed + n);
      } else {
        m.tokens = {s.generated.back()};
      }
      call.seqs.push_back(std::move(m));
    }
    if (call.seqs.empty()) {
      if (!waiting) break;
      continue;
    }
    st.iterate(call, obs, done);
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
      total[size_t(call.seq)] += int64_t(call.tokens.size());
    }
  if (sequences == 0) throw UsageError("batch replay: an empty schedule");
  std::vector<int64_t> reach = total;  // every token fed, and the one generated last
  for (int64_t& p : reach) p += 1;
  st.start(reach);
  for (size_t b = 0; b < sequences; ++b)
    st.seqs[b].prompt_len = b < schedule.prompt_len.size() ? schedule.prompt_len[b] : total[b];
  for (size_t it = 0; it < schedule.iterations.size(); ++it) {
    ForwardCall fc;
    for (const BatchCall& call : schedule.iterations[it]) {
      for (const SequenceRows& other : fc.seqs)
        if (other.seq == call.seq)
          throw UsageError("batch replay: seq" + std::to_string(call.seq) + " twice in iteration " +
                           std::to_string(it));
      SequenceRows m;
      m.seq = call.seq;
      m.tokens = call.tokens;
      fc.seqs.push_back(std::move(m));
    }
    const int iteration = int(it);
    st.iterate(fc, obs, [&](const Sequence& s) { return last_call[size_t(s.id)] == iteration; });
  }
  return st.finish(obs);
}

}  // namespace llmdiff::impl
