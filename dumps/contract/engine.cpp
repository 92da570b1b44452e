#include "dumps/contract/engine.h"
#include "dumps/contract/padding.h"
#include "dumps/contract/calls.h"

#include <algorithm>
#include <numeric>

#include "dumps/base/errors.h"
#include "dumps/contract/sites.h"

namespace llmdiff {

int64_t argmax_first(const std::vector<float>& v) {
  int64_t best = 0;
  for (size_t i = 1; i < v.size(); ++i)
    if (v[i] > v[size_t(best)]) best = int64_t(i);
  return best;
}

Scenario make_scenario(const std::vector<int64_t>& tokens, const std::vector<int64_t>& chunks, int decode) {
  if (tokens.empty()) throw UsageError("no input tokens");
  if (decode < 0) throw UsageError("--decode must be >= 0");
  Scenario sc;
  if (chunks.empty()) {
    sc.steps.push_back(tokens);
  } else {
    int64_t total = 0;
    for (int64_t c : chunks) {
      if (c <= 0) throw UsageError("chunk sizes must be positive");
      total += c;
    }
    if (total != int64_t(tokens.size()))
      throw UsageError("chunk sizes add up to " + std::to_string(total) + " but there are " +
                       std::to_string(tokens.size()) + " tokens");
    size_t at = 0;
    for (int64_t c : chunks) {
      sc.steps.emplace_back(tokens.begin() + long(at), tokens.begin() + long(at + size_t(c)));
      at += size_t(c);
    }
  }
  sc.decode = decode;
  sc.first_generating_step = int(sc.steps.size()) - 1;
  sc.emit_generated = decode > 0;
  sc.name = decode > 0 ? "decode" : (sc.steps.size() > 1 ? "chunked" : "prefill");
  return sc;
}

Scenario replay_scenario(const TensorSource& dump) {
  Scenario sc;
  sc.steps = dump.step_tokens();
  if (sc.steps.empty()) throw FormatError(dump.label(), "step0.tokens", "dump holds no forward calls to replay");
  for (size_t s = 0; s < sc.steps.size(); ++s)
    if (sc.steps[s].empty())
      throw FormatError(dump.label(), step_name(int(s), Site::Tokens), "a forward call with no tokens");
  sc.emit_generated = dump.has("generated");
  if (sc.emit_generated) {
    const int64_t m = numel(dump.shape("generated"));
    sc.first_generating_step = int(std::max<int64_t>(0, int64_t(sc.steps.size()) - m));
  } else {
    sc.first_generating_step = int(sc.steps.size()) - 1;
  }
  sc.name = dump.manifest().scenario.empty() ? "replay" : dump.manifest().scenario;
  // Sampled tokens are not the argmax a replay would emit: the sampler's own
  // check (compare/sampling_check.h) judges them.
  const std::optional<SamplingParams> sampling = manifest_sampling(dump.manifest(), dump.label());
  if (sampling && sampling->do_sample) sc.emit_generated = false;
  // A row of a left-padded batch runs behind its pads again.
  if (const std::optional<LeftPadding> pad = manifest_padding(dump.manifest(), dump.label())) {
    sc.left_pad = pad->left;
    sc.pad_token = pad->pad_token;
  }
  // A prefix-cache hit runs in front of step 0; verify calls roll back their
  // rejected drafts. A verify call generates several tokens, not the argmax
  // of its last row: the speculative check judges them.
  sc.cached_prefix = cached_prefix(dump);
  sc.rollback = spec_rollbacks(dump);
  if (speculative(dump)) sc.emit_generated = false;
  return sc;
}

Scenario replay_with_sampling(const TensorSource& dump) {
  Scenario sc = replay_scenario(dump);
  sc.sampling = manifest_sampling(dump.manifest(), dump.label());
  if (!sc.sampling) return sc;
  sc.emit_generated = dump.has("generated");
  for (int s = 0; s < int(sc.steps.size()); ++s) {
    const std::string name = step_name(s, Site::SampleToken);
    if (!dump.has(name)) continue;
    const TensorData t = dump.get(name);
    if (!t.is_int || t.i.size() != 1) throw FormatError(dump.label(), name, "expected one integer token");
    sc.drawn[s] = t.i[0];
  }
  return sc;
}

bool StepShift::wants(const std::string& name) const {
  const std::string n = rename(name);
  return !n.empty() && inner_.wants(n);
}

void StepShift::on_f32(const std::string& name, const Shape& shape, const float* data) {
  const std::string n = rename(name);
  if (!n.empty()) inner_.on_f32(n, shape, data);
}

void StepShift::on_i64(const std::string& name, const Shape& shape, const int64_t* data) {
  const std::string n = rename(name);
  if (!n.empty()) inner_.on_i64(n, shape, data);
}

std::string StepShift::rename(const std::string& name) const {
  if (shift_ == 0) return name;
  CanonName c = parse_name(name);
  if (c.kind != CanonName::Kind::Step && c.kind != CanonName::Kind::Layer) return name;
  if (c.step < shift_) return "";
  c.step -= shift_;
  return c.str();
}

std::vector<int64_t> run_scenario(Engine& engine, const Scenario& sc, Observer& obs) {
  if (sc.steps.empty()) throw UsageError("scenario '" + sc.name + "' has no forward calls");
  if (sc.decode > 0 && sc.first_generating_step >= int(sc.steps.size()))
    throw UsageError("scenario '" + sc.name + "' decodes but its first generating step " +
                     std::to_string(sc.first_generating_step) + " is not one of its " +
                     std::to_string(sc.steps.size()) + " prompt calls");
  engine.reset();
  if (sc.left_pad < 0) throw UsageError("scenario '" + sc.name + "': left padding must be >= 0");
  if (sc.left_pad > 0) engine.set_left_padding(sc.left_pad);
  if (!sc.layers.whole()) {
    if (sc.left_pad > 0 || sc.decode > 0)
      throw UsageError("scenario '" + sc.name + "': a shard of the layers replays a dump's forward calls, without "
                       "left padding or decoding of its own");
    engine.set_layer_window(sc.layers);
  }
  LeftPadStripper stripped(obs, sc.left_pad);  // the sequence's own rows and keys
  // A prefix-cache hit: the engine's call 0 runs the hit's tokens, reported
  // by no name; the engine's call k + 1 is the scenario's step k.
  const int shift = sc.cached_prefix.empty() ? 0 : 1;
  if (shift && sc.left_pad > 0)
    throw UsageError("scenario '" + sc.name + "': a prefix-cache hit in a row of a left-padded batch");
  StepShift out(stripped, shift);
  if (shift) engine.forward(sc.cached_prefix, 0, out);
  std::vector<int64_t> generated;
  std::vector<int64_t> history;  // every token fed so far (generate's input_ids)
  UniformStream draws(sc.sampling && sc.sampling->seed ? *sc.sampling->seed : 0);
  // The token of step `step` from its next_logits: the argmax, or a draw.
  auto pick = [&](const std::vector<float>& logits, int step) {
    if (!sc.sampling) return argmax_first(logits);
    SampledStep s = sample_step(*sc.sampling, logits, history, draws, sc.sampler_faults);
    const auto forced = sc.drawn.find(step);
    if (forced != sc.drawn.end()) {
      s.token = forced->second;
      s.u.reset();
    }
    report_sample(obs, step, s);
    return s.token;
  };
  int step = 0;
  if (sc.resume.step > 0) {
    if (!sc.resume.dump || sc.resume.step >= int(sc.steps.size()) || sc.left_pad > 0 || shift ||
        !sc.layers.whole() || !sc.rollback.empty() || sc.sampling)
      throw UsageError("scenario '" + sc.name + "': resumes at call " + std::to_string(sc.resume.step) +
                       " only as a plain run of its given calls, with the dump that recorded the ones before");
    engine.resume(*sc.resume.dump, sc.resume.step);
    step = sc.resume.step;
  }
  for (; step < int(sc.steps.size()); ++step) {
    const std::vector<int64_t> tokens = fed_tokens(sc, step);
    std::vector<float> logits = engine.forward(tokens, step + shift, out);
    const auto rolled = sc.rollback.find(step);
    if (rolled != sc.rollback.end() && rolled->second > 0) engine.rollback(rolled->second);
    history.insert(history.end(), tokens.begin(), tokens.end());
    // A shard ending before the last layer has no logits to pick from.
    if (step >= sc.first_generating_step && !logits.empty()) generated.push_back(pick(logits, step));
  }
  for (int d = 0; d < sc.decode; ++d) {
    std::vector<float> logits = engine.forward({generated.back()}, step + shift, out);
    history.push_back(generated[generated.size() - 1]);
    generated.push_back(pick(logits, step));
    ++step;
  }
  if (sc.emit_generated && sc.resume.step == 0 && obs.wants("generated"))
    obs.on_i64("generated", {int64_t(generated.size())}, generated.data());
  return generated;
}

std::vector<int64_t> fed_tokens(const Scenario& sc, int step) {
  std::vector<int64_t> tokens = sc.steps[size_t(step)];
  if (step == 0 && sc.left_pad > 0) tokens.insert(tokens.begin(), size_t(sc.left_pad), sc.pad_token);
  return tokens;
}

void Engine::rollback(int64_t positions) {
  throw UsageError(producer() + ": does not roll back its KV cache (a speculative verify call's " +
                   std::to_string(positions) + " rejected positions)");
}

void Engine::resume(const TensorSource& dump, int step) {
  throw UsageError(producer() + ": does not resume " + dump.label() + " at call " + std::to_string(step) +
                   " from its caches");
}

void Engine::set_left_padding(int64_t pad) {
  if (pad != 0) throw UsageError(producer() + ": runs no left-padded batch rows");
}

void Engine::set_layer_window(const LayerWindow& w) {
  if (!w.whole()) throw UsageError(producer() + ": runs no shard of the layers (" + w.str() + ")");
}

}  // namespace llmdiff
