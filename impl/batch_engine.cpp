// The continuous-batching engine (batch_engine.h): a scheduler, a block
// allocator, and one forward function over the packed rows of an iteration.
#include "impl/batch_engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <sstream>

#include "dumps/contract/engine.h"
#include "dumps/base/errors.h"
#include "dumps/contract/names.h"
#include "dumps/contract/sequences.h"
#include "impl/cache_views.h"
#include "impl/kernels.h"
#include "impl/rope.h"
#include "impl/thread_pool.h"

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
  int64_t cached = 0;               // positions in the cache (P)
  int steps = 0;                    // forward calls that included it so far
  std::vector<int64_t> blocks;      // block table: logical block i -> pool block
  size_t released = 0;              // blocks at the table's front already given back (block-reuse-early)
  std::vector<int64_t> history;     // every token fed so far (generate's input_ids, for the sampler)
  std::optional<SamplingParams> sampling;
  UniformStream draws{0};
  std::vector<int64_t> generated;
  bool finished = false;
};

// One sequence's part of an iteration: its rows of the packed batch.
struct Member {
  Sequence* seq = nullptr;
  int step = 0;                     // the sequence's step number in this call
  std::vector<int64_t> tokens;      // [T]
  int64_t row0 = 0, T = 0, P = 0;   // rows [row0, row0+T) of the packed batch; P cached before
  int64_t context = 0;              // positions its attention reads (S, unless a bug says otherwise)
  std::vector<int64_t> positions;   // [T]
  std::vector<int64_t> slots;       // [T] pool slot each new key/value is written to
  std::vector<float> mask;          // [T, context]
};

// Reports the members' rows of packed tensors under seq{b}.step{n}.*.
class MemberSites {
 public:
  MemberSites(Observer& obs, const std::vector<Member>& members) : obs_(obs), members_(members) {}
  std::string name(const Member& m, const std::string& site) const {
    return sequence_prefix(m.seq->id) + step_name(m.step, site);
  }
  std::string name(const Member& m, int layer, const std::string& site) const {
    return sequence_prefix(m.seq->id) + layer_name(m.step, layer, site);
  }
  bool wants(const Member& m, int layer, const std::string& site) const { return obs_.wants(name(m, layer, site)); }
  // packed [R, width]: each member's [T, width]
  void rows(const std::string& site, int64_t width, const float* packed) {
    for (const Member& m : members_) emit(name(m, site), {m.T, width}, packed + m.row0 * width);
  }
  void rows(int layer, const std::string& site, int64_t width, const float* packed) {
    for (const Member& m : members_) emit(name(m, layer, site), {m.T, width}, packed + m.row0 * width);
  }
  // packed [R, H*Dh]: each member's [H, T, Dh]
  void head_major(int layer, const std::string& site, const float* packed, int64_t H, int64_t Dh) {
    for (const Member& m : members_) {
      const std::string n = name(m, layer, site);
      if (!obs_.wants(n)) continue;
      std::vector<float> out(size_t(H * m.T * Dh));
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < m.T; ++t)
          std::memcpy(&out[size_t((h * m.T + t) * Dh)], packed + ((m.row0 + t) * H + h) * Dh,
                      size_t(Dh) * sizeof(float));
      obs_.on_f32(n, {H, m.T, Dh}, out.data());
    }
  }
  void f32(const Member& m, int layer, const std::string& site, const Shape& shape, const float* data) {
    emit(name(m, layer, site), shape, data);
  }
  void f32(const Member& m, const std::string& site, const Shape& shape, const float* data) {
    emit(name(m, site), shape, data);
  }
  void i64(const Member& m, const std::string& site, const Shape& shape, const int64_t* data) {
    const std::string n = name(m, site);
    if (obs_.wants(n)) obs_.on_i64(n, shape, data);
  }

 private:
  void emit(const std::string& n, const Shape& shape, const float* data) {
    if (obs_.wants(n)) obs_.on_f32(n, shape, data);
  }
  Observer& obs_;
  const std::vector<Member>& members_;
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
      throw FormatError(dump.label(), sequence_prefix(b) + step_name(step, "tokens"),
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
      : cfg(model.config), weights(model.weights), opt(o), faults(zoo::batch_faults(o.bugs)),
        sampler_faults(zoo::sampler_faults(o.bugs)), pool(o.threads) {}
  ModelConfig cfg;
  std::shared_ptr<ModelWeights> weights;
  BatchEngineOptions opt;
  zoo::BatchFaults faults;
  zoo::SamplerFaults sampler_faults;
  ThreadPool pool;
  MatmulScratch mm;
  std::vector<std::vector<float>> attn_rows;
  std::vector<int> kv_head;            // [Hq]: kv head each query head reads
  int64_t num_blocks = 0;
  std::deque<int64_t> free_blocks;     // the allocator: taken from the front, given back to the front
  std::vector<std::vector<float>> k_pool, v_pool;  // per layer [num_blocks*B, Hkv*Dh], slot-major

  int64_t slot_of(const Sequence& s, int64_t p) const {
    const int64_t B = opt.block_size;
    return s.blocks[size_t(p / B)] * B + p % B;
  }
  void allocate(Sequence& s, int64_t positions, int iteration) {
    while (int64_t(s.blocks.size()) < ceil_div(positions, opt.block_size)) {
      if (free_blocks.empty())
        throw UsageError("batch: the paged KV cache's " + std::to_string(num_blocks) + " blocks of " +
                         std::to_string(opt.block_size) + " are all in use at engine iteration " +
                         std::to_string(iteration) + " (seq" + std::to_string(s.id) + " needs one more); give "
                         "more blocks");
      s.blocks.push_back(free_blocks.front());
      free_blocks.pop_front();
    }
  }
  void release(const std::vector<int64_t>& blocks) {
    for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) free_blocks.push_front(*it);
  }
  std::vector<Sequence> seqs;

  // An empty pool and one new sequence per entry of `positions`, the
  // positions each reaches (the pool sized for them when the options give
  // no size).
  void start(const std::vector<int64_t>& positions);
  // One engine iteration over the members (their tokens set): cache
  // bookkeeping, the forward call, each member's new token, the sequences
  // that are done giving their blocks back, the iter{N}.* names.
  void iterate(std::vector<Member>& members, int it, Observer& obs,
               const std::function<bool(const Sequence&)>& finished_after);
  BatchOutcome finish(Observer& obs);
  std::vector<int64_t> iteration_rows;
  std::vector<double> iteration_seconds;
  // The forward call over the members' packed rows: next-token logits of
  // each member [M, V].
  std::vector<float> forward(std::vector<Member>& members, int iteration, Observer& obs);
};

BatchEngine::BatchEngine(const Model& model, const BatchEngineOptions& opt)
    : s_(std::make_unique<State>(model, opt)) {
  const ModelConfig& c = s_->cfg;
  if (!s_->weights) throw UsageError("batch: model '" + c.source + "' has no weights loaded");
  if (c.mla.enabled || c.moe.enabled())
    throw UsageError("batch: the continuous-batching engine runs dense GQA models; " + c.source + " has " +
                     (c.mla.enabled ? "multi-head latent attention" : "mixture-of-experts layers"));
  if (opt.block_size <= 0) throw UsageError("batch: block size must be > 0");
  if (opt.num_blocks < 0 || opt.chunk < 0) throw UsageError("batch: blocks and chunk must be >= 0");
  for (const zoo::BugSpec& b : opt.bugs)
    if (!zoo::bug_info(b.bug).is_batch() && !zoo::bug_info(b.bug).is_sampler())
      throw UsageError(std::string("batch: '") + zoo::bug_name(b.bug) + "' is not a batch bug (the batched engine "
                       "takes the sampler's and: " + [] {
                         std::string l;
                         for (const zoo::BugInfo* i : zoo::batch_bugs())
                           l += (l.empty() ? "" : ", ") + std::string(i->name);
                         return l;
                       }() + ")");
  if (zoo::sampler_faults(opt.bugs).any() && !opt.sampling)
    throw UsageError("batch: the sampler's bugs act only when the run samples: give sampling parameters");
  if (opt.sampling) opt.sampling->validate();
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads;
  for (int64_t h = 0; h < Hq; ++h) s_->kv_head.push_back(int(h / (Hq / Hkv)));
}

SamplingParams sampling_for(const BatchEngineOptions& o, int b) {
  SamplingParams p = o.sampling.value_or(SamplingParams{});
  p.seed = p.seed.value_or(0) + uint64_t(b);
  return p;
}

BatchEngine::~BatchEngine() = default;

std::string BatchEngine::producer() const {
  std::string p = "llmdiff impl continuous batching (plain C++, float32 activations, paged KV cache, block size " +
                  std::to_string(s_->opt.block_size) + ")";
  for (size_t i = 0; i < s_->opt.bugs.size(); ++i) p += (i == 0 ? " with bugs: " : ", ") + s_->opt.bugs[i].str();
  return p;
}

std::string BatchEngine::kv_cache_json(const std::vector<BatchRequest>& requests) const {
  const int64_t B = s_->opt.block_size;
  const int64_t n = s_->opt.num_blocks > 0 ? s_->opt.num_blocks : default_blocks(reached(requests), B);
  return "{\"kind\": \"paged\", \"block_size\": " + std::to_string(s_->opt.block_size) +
         ", \"num_blocks\": " + std::to_string(n) + "}";
}

void BatchEngine::State::start(const std::vector<int64_t>& positions) {
  const ModelConfig& c = cfg;
  const int64_t B = opt.block_size, k_dim = c.num_key_value_heads * c.head_dim;
  const size_t sequences = positions.size();
  num_blocks = opt.num_blocks > 0 ? opt.num_blocks : default_blocks(positions, B);
  free_blocks.clear();
  for (int64_t i = 0; i < num_blocks; ++i) free_blocks.push_back(i);
  k_pool.assign(size_t(c.num_hidden_layers), std::vector<float>(size_t(num_blocks * B * k_dim), 0.0f));
  v_pool.assign(size_t(c.num_hidden_layers), std::vector<float>(size_t(num_blocks * B * k_dim), 0.0f));
  seqs.assign(sequences, Sequence{});
  for (size_t b = 0; b < sequences; ++b) {
    seqs[b].id = int(b);
    if (opt.sampling) {
      seqs[b].sampling = sampling_for(opt, int(b));
      seqs[b].draws = UniformStream(*seqs[b].sampling->seed);
    }
  }
  iteration_rows.clear();
  iteration_seconds.clear();
}

void BatchEngine::State::iterate(std::vector<Member>& members, int it, Observer& obs,
                                 const std::function<bool(const Sequence&)>& finished_after) {
  const ModelConfig& c = cfg;
  const zoo::BatchFaults& bug = faults;
  const int64_t B = opt.block_size, V = c.vocab_size;
  int64_t rows = 0;
  for (Member& m : members) {
    Sequence& s = *m.seq;
    for (int64_t t : m.tokens)
      if (t < 0 || t >= V)
        throw UsageError("batch: token id " + std::to_string(t) + " of seq" + std::to_string(s.id) +
                         " is outside the vocabulary [0, " + std::to_string(V) + ")");
    m.step = s.steps;
    m.P = s.cached;
    m.T = int64_t(m.tokens.size());
    m.row0 = rows;
    rows += m.T;
    // Cache bookkeeping: blocks for the positions this call holds, the slot
    // of each new token, the positions attention reads.
    const int64_t S = m.P + m.T;
    if (S > c.max_position_embeddings)
      throw UsageError("batch: seq" + std::to_string(s.id) + " reaches " + std::to_string(S) +
                       " positions, beyond max_position_embeddings " + std::to_string(c.max_position_embeddings));
    m.context = bug.context_one_long ? S + 1 : S;
    allocate(s, m.context, it);
    for (int64_t t = 0; t < m.T; ++t) {
      const int64_t slot = slot_of(s, m.P + t);
      m.slots.push_back(bug.slot_mapping_shift ? (slot + 1) % (num_blocks * B) : slot);
      m.positions.push_back(m.P + t + (bug.positions_from_batch_start ? m.row0 : 0));
    }
    // Causal over the positions read: the new tokens are the last T of them.
    m.mask = causal_mask(m.T, m.context, m.context - m.T, c.sliding_window);
  }

  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<float> next = forward(members, it, obs);  // [M, V]
  iteration_seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  iteration_rows.push_back(rows);

  std::vector<int64_t> seq_ids, seq_steps, num_tokens;
  for (size_t j = 0; j < members.size(); ++j) {
    Member& m = members[j];
    Sequence& s = *m.seq;
    seq_ids.push_back(s.id), seq_steps.push_back(m.step), num_tokens.push_back(m.T);
    const bool was_prefill = s.cached < s.prompt_len;
    s.cached += m.T;
    s.steps += 1;
    s.history.insert(s.history.end(), m.tokens.begin(), m.tokens.end());
    if (s.cached >= s.prompt_len) {
      const std::vector<float> logits(next.begin() + int64_t(j) * V, next.begin() + int64_t(j + 1) * V);
      if (s.sampling) {  // HF's processors on this sequence's logits and history, its own draws
        const SampledStep drawn = sample_step(*s.sampling, logits, s.history, s.draws, sampler_faults);
        report_sample(obs, m.step, drawn, sequence_prefix(s.id));
        s.generated.push_back(drawn.token);
      } else {
        s.generated.push_back(argmax_first(logits));
      }
    }
    if (was_prefill && s.cached >= s.prompt_len && bug.free_after_prefill) {
      // block-reuse-early: the prompt's full blocks go back to the pool
      // while the sequence still reads them through its table.
      s.released = size_t(s.cached / B);
      release(std::vector<int64_t>(s.blocks.begin(), s.blocks.begin() + int64_t(s.released)));
    }
    if (finished_after(s)) {  // done: its blocks back to the pool
      s.finished = true;
      release(std::vector<int64_t>(s.blocks.begin() + int64_t(s.released), s.blocks.end()));
    }
  }
  const std::string iter = "iter" + std::to_string(it) + ".";
  const Shape n{int64_t(members.size())};
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
    std::vector<Member> members;
    bool waiting = false;
    for (Sequence& s : st.seqs) {
      const BatchRequest& r = requests[size_t(s.id)];
      if (s.finished) continue;
      if (r.join > tick) {
        waiting = true;
        continue;
      }
      Member m;
      m.seq = &s;
      if (s.cached < s.prompt_len) {
        const int64_t left = s.prompt_len - s.cached;
        const int64_t n = st.opt.chunk > 0 ? std::min(st.opt.chunk, left) : left;
        m.tokens.assign(r.prompt.begin() + s.cached, r.prompt.begin() + s.cached + n);
      } else {
        m.tokens = {s.generated.back()};
      }
      members.push_back(std::move(m));
    }
    if (members.empty()) {
      if (!waiting) break;
      continue;
    }
    st.iterate(members, int(st.iteration_rows.size()), obs, done);
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
    std::vector<Member> members;
    for (const BatchCall& call : schedule.iterations[it]) {
      Member m;
      m.seq = &st.seqs[size_t(call.seq)];
      for (const Member& other : members)
        if (other.seq == m.seq)
          throw UsageError("batch replay: seq" + std::to_string(call.seq) + " twice in iteration " +
                           std::to_string(it));
      m.tokens = call.tokens;
      members.push_back(std::move(m));
    }
    const int iteration = int(it);
    st.iterate(members, iteration, obs, [&](const Sequence& s) { return last_call[size_t(s.id)] == iteration; });
  }
  return st.finish(obs);
}

std::vector<float> BatchEngine::State::forward(std::vector<Member>& members, int iteration, Observer& obs) {
  const ModelConfig& c = cfg;
  const ModelWeights& w = *weights;
  const zoo::BatchFaults& bug = faults;
  const int64_t D = c.hidden_size, F = c.intermediate_size, V = c.vocab_size;
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, Dh = c.head_dim;
  const int64_t q_dim = Hq * Dh, k_dim = Hkv * Dh;
  const int64_t B = opt.block_size, M = int64_t(members.size());
  const int64_t R = members.back().row0 + members.back().T;  // packed rows
  const float eps = float(c.rms_norm_eps);
  const float scale = float(c.attn_scaling());
  MemberSites site(obs, members);

  // Per member: its own RoPE tables (dynamic NTK follows each sequence's
  // largest position), packed [R, Dh]; tokens, positions, mask, bookkeeping.
  std::vector<float> cos(size_t(R * Dh)), sin(size_t(R * Dh));
  std::vector<int64_t> tokens;  // [R]
  for (const Member& m : members) {
    const RopeFrequencies freqs = rope_frequencies(c, m.positions.back() + 1);
    if (iteration == 0 && &m == &members.front() && obs.wants("rope.inv_freq"))
      obs.on_f32("rope.inv_freq", {Dh / 2}, freqs.inv_freq.data());
    rope_tables(freqs, m.positions, Dh, &cos[size_t(m.row0 * Dh)], &sin[size_t(m.row0 * Dh)]);
    tokens.insert(tokens.end(), m.tokens.begin(), m.tokens.end());
    site.i64(m, "tokens", {m.T}, m.tokens.data());
    site.i64(m, "positions", {m.T}, m.positions.data());
    site.f32(m, "mask", {m.T, m.context}, m.mask.data());
    site.i64(m, "kv.block_table", {int64_t(m.seq->blocks.size())}, m.seq->blocks.data());
    site.i64(m, "kv.slot_mapping", {m.T}, m.slots.data());
    site.i64(m, "kv.context_len", {1}, &m.context);
  }
  site.rows("rope.cos", Dh, cos.data());
  site.rows("rope.sin", Dh, sin.data());

  std::vector<float> x(size_t(R * D));  // [R, D] residual stream
  for (int64_t r = 0; r < R; ++r) load_row(wmat(w.embed), tokens[size_t(r)], 0, D, &x[size_t(r * D)]);
  site.rows("embed", D, x.data());

  std::vector<float> xn(size_t(R * D));                                 // [R, D]
  std::vector<float> q(size_t(R * q_dim)), k(size_t(R * k_dim)), v(size_t(R * k_dim));  // [R, H*Dh]
  std::vector<float> ctx(size_t(R * q_dim));                            // [R, Hq*Dh]
  std::vector<float> proj(size_t(R * D));                               // [R, D]
  std::vector<float> gate(size_t(R * F)), up(size_t(R * F)), act(size_t(R * F));  // [R, F]

  for (int l = 0; l < int(c.num_hidden_layers); ++l) {
    const LayerWeights& L = w.layers[size_t(l)];
    std::vector<float>& k_pool_l = k_pool[size_t(l)];
    std::vector<float>& v_pool_l = v_pool[size_t(l)];

    // ---- attention block: projections over every row at once
    rms_norm(pool, x.data(), R, D, wmat(L.input_norm), eps, xn.data());  // [R, D]
    site.rows(l, "attn_norm", D, xn.data());
    matmul(pool, mm, xn.data(), R, {{wmat(L.q), q.data()}, {wmat(L.k), k.data()}, {wmat(L.v), v.data()}});
    if (c.qkv_bias) {
      add_bias(wmat(L.q_bias), R, q.data());
      add_bias(wmat(L.k_bias), R, k.data());
      add_bias(wmat(L.v_bias), R, v.data());
    }
    site.rows(l, "attn.q", q_dim, q.data());
    site.rows(l, "attn.k", k_dim, k.data());
    site.rows(l, "attn.v", k_dim, v.data());
    if (c.qk_norm) {  // Qwen3: per-head RMSNorm of q and k before RoPE
      rms_norm(pool, q.data(), R * Hq, Dh, wmat(L.q_norm), eps, q.data());   // [R, Hq*Dh]
      rms_norm(pool, k.data(), R * Hkv, Dh, wmat(L.k_norm), eps, k.data());  // [R, Hkv*Dh]
      site.rows(l, "attn.q_norm", q_dim, q.data());
      site.rows(l, "attn.k_norm", k_dim, k.data());
    }
    apply_rope(q.data(), R, Hq, Dh, cos.data(), sin.data());   // [R, Hq*Dh]
    apply_rope(k.data(), R, Hkv, Dh, cos.data(), sin.data());  // [R, Hkv*Dh]
    site.head_major(l, "attn.q_rope", q.data(), Hq, Dh);
    site.head_major(l, "attn.k_rope", k.data(), Hkv, Dh);

    // Every new key/value into its slot of the pool.
    for (const Member& m : members)
      for (int64_t t = 0; t < m.T; ++t) {
        const size_t slot = size_t(m.slots[size_t(t)]);
        std::copy_n(&k[size_t((m.row0 + t) * k_dim)], k_dim, &k_pool_l[slot * size_t(k_dim)]);
        std::copy_n(&v[size_t((m.row0 + t) * k_dim)], k_dim, &v_pool_l[slot * size_t(k_dim)]);
      }

    // ---- attention per sequence, over its own keys gathered through its block table
    for (Member& m : members) {
      const Sequence& s = *m.seq;
      const int64_t S = m.context;
      // packed-cross-attention: the rows of the members before it in this call come first.
      const int64_t extra = bug.cross_attention ? m.row0 : 0;
      const int64_t Sx = extra + S;
      std::vector<float> kc(size_t(Sx * k_dim)), vc(size_t(Sx * k_dim));  // [Sx, Hkv*Dh] token-major
      std::copy_n(k.data(), extra * k_dim, kc.data());
      std::copy_n(v.data(), extra * k_dim, vc.data());
      for (int64_t p = 0; p < S; ++p) {
        int64_t blk = p / B;
        if (bug.blocks_swapped && S / B >= 2 && blk < 2) blk = 1 - blk;  // block-table-order: two full blocks swapped
        const size_t slot = size_t(s.blocks[size_t(blk)] * B + p % B);
        std::copy_n(&k_pool_l[slot * size_t(k_dim)], k_dim, &kc[size_t((extra + p) * k_dim)]);
        std::copy_n(&v_pool_l[slot * size_t(k_dim)], k_dim, &vc[size_t((extra + p) * k_dim)]);
      }
      std::vector<float> mask(size_t(m.T * Sx), 1.0f);  // [T, Sx]: every extra key allowed
      for (int64_t t = 0; t < m.T; ++t)
        std::copy_n(&m.mask[size_t(t * S)], S, &mask[size_t(t * Sx + extra)]);
      const bool want_scores = site.wants(m, l, "attn.scores"), want_probs = site.wants(m, l, "attn.probs");
      std::vector<float> scores(want_scores ? size_t(Hq * m.T * Sx) : 0), probs(want_probs ? size_t(Hq * m.T * Sx) : 0);
      AttentionArgs att;
      att.T = m.T, att.S = Sx, att.Hq = Hq, att.Hkv = Hkv, att.Dh = Dh;
      att.q = &q[size_t(m.row0 * q_dim)], att.k = kc.data(), att.v = vc.data();
      att.mask = mask.data(), att.kv_head = kv_head.data(), att.scale = scale;
      att.scores = want_scores ? scores.data() : nullptr;
      att.probs = want_probs ? probs.data() : nullptr;
      att.ctx = &ctx[size_t(m.row0 * q_dim)];
      attention(pool, attn_rows, att);  // ctx rows [T, Hq*Dh]

      // What this sequence's attention read, over its own S positions.
      const std::vector<float> own_k(kc.begin() + extra * k_dim, kc.end()), own_v(vc.begin() + extra * k_dim, vc.end());
      if (site.wants(m, l, "attn.k_cache"))
        site.f32(m, l, "attn.k_cache", {Hkv, S, Dh}, head_major_cache(own_k, S, Hkv, Dh).data());
      if (site.wants(m, l, "attn.v_cache"))
        site.f32(m, l, "attn.v_cache", {Hkv, S, Dh}, head_major_cache(own_v, S, Hkv, Dh).data());
      if (site.wants(m, l, "attn.k_rep"))
        site.f32(m, l, "attn.k_rep", {Hq, S, Dh}, repeat_kv(own_k, S, Hq, Hkv, Dh, kv_head).data());
      if (site.wants(m, l, "attn.v_rep"))
        site.f32(m, l, "attn.v_rep", {Hq, S, Dh}, repeat_kv(own_v, S, Hq, Hkv, Dh, kv_head).data());
      auto own_columns = [&](const std::vector<float>& a) {  // [Hq, T, Sx] -> [Hq, T, S]
        std::vector<float> o(size_t(Hq * m.T * S));
        for (int64_t r = 0; r < Hq * m.T; ++r) std::copy_n(&a[size_t(r * Sx + extra)], S, &o[size_t(r * S)]);
        return o;
      };
      if (want_scores) site.f32(m, l, "attn.scores", {Hq, m.T, S}, own_columns(scores).data());
      if (want_probs) site.f32(m, l, "attn.probs", {Hq, m.T, S}, own_columns(probs).data());
    }
    site.rows(l, "attn.ctx", q_dim, ctx.data());

    matmul(pool, mm, ctx.data(), R, wmat(L.o), proj.data());  // [R, D]
    if (c.o_bias) add_bias(wmat(L.o_bias), R, proj.data());
    site.rows(l, "attn.out", D, proj.data());
    add(x.data(), proj.data(), R * D, x.data());  // [R, D]
    site.rows(l, "attn_residual", D, x.data());

    // ---- feed-forward block: down(silu(gate(x)) * up(x)) over every row
    rms_norm(pool, x.data(), R, D, wmat(L.post_attn_norm), eps, xn.data());  // [R, D]
    site.rows(l, "mlp_norm", D, xn.data());
    matmul(pool, mm, xn.data(), R, {{wmat(L.mlp.gate), gate.data()}, {wmat(L.mlp.up), up.data()}});  // [R, F]
    silu_mul(pool, gate.data(), up.data(), R * F, act.data());  // [R, F]
    matmul(pool, mm, act.data(), R, wmat(L.mlp.down), proj.data());  // [R, D]
    site.rows(l, "mlp.gate", F, gate.data());
    site.rows(l, "mlp.up", F, up.data());
    site.rows(l, "mlp.act", F, act.data());
    site.rows(l, "mlp.down", D, proj.data());
    add(x.data(), proj.data(), R * D, x.data());  // [R, D]
    site.rows(l, "out", D, x.data());
    if (opt.release_weights) w.release_layer(l);
  }

  rms_norm(pool, x.data(), R, D, wmat(w.final_norm), eps, xn.data());  // [R, D]
  site.rows("final_norm", D, xn.data());
  // Each member's last row through the head, all together: next [M, V].
  std::vector<float> last(size_t(M * D));  // [M, D]
  for (int64_t j = 0; j < M; ++j) {
    const Member& m = members[size_t(j)];
    std::copy_n(&xn[size_t((m.row0 + m.T - 1) * D)], D, &last[size_t(j * D)]);
    site.f32(m, "last_hidden", {D}, &last[size_t(j * D)]);
  }
  const WMat head = wmat(w.lm_head);
  std::vector<float> next(size_t(M * V));
  matmul(pool, mm, last.data(), M, head, next.data());  // [M, V]
  for (int64_t j = 0; j < M; ++j) {
    const Member& m = members[size_t(j)];
    if (obs.wants(site.name(m, "logits"))) {
      std::vector<float> logits(size_t(m.T * V));  // [T, V]
      matmul(pool, mm, &xn[size_t(m.row0 * D)], m.T, head, logits.data());
      std::copy_n(&next[size_t(j * V)], V, &logits[size_t((m.T - 1) * V)]);
      site.f32(m, "logits", {m.T, V}, logits.data());
    }
    site.f32(m, "next_logits", {V}, &next[size_t(j * V)]);
  }
  if (opt.release_weights) w.release_head();
  return next;
}

}  // namespace llmdiff::impl
