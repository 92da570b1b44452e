// A left-padded sequence of a batch (HF's generate on a padded batch): the
// engine runs the pad tokens in front of the prompt, as the batch row holds
// them, and reports the sequence in single-sequence canonical form
// (docs/DUMP_FORMAT.md "Several sequences": padding rows and columns removed).
// LeftPadStripper is the observer in between: at step 0 it drops the first
// `pad` rows of every per-token site, at every step the first `pad` entries
// of every key axis (mask, scores, probs, the caches and their repeat_kv).
// With no padding it passes every report through as it is.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "dumps/contract/dump.h"
#include "dumps/contract/observer.h"

namespace llmdiff {

// The manifest's `padding` key (docs/DUMP_FORMAT.md): {"left": N,
// "pad_token": ID}, a sequence of a left-padded batch; per sequence of a
// several-sequence dump `padding.seq{b}` (seq >= 0: that one, else the
// dump-wide key). Nothing when absent; FormatError naming `where` when
// malformed.
struct LeftPadding {
  int64_t left = 0;
  int64_t pad_token = 0;
};
std::optional<LeftPadding> manifest_padding(const Manifest& m, const std::string& where, int seq = -1);
void set_manifest_padding(Manifest& m, const LeftPadding& p, int seq = -1);

// The axis of a site that runs over the S cached positions (the keys):
// mask 1, attn.scores / attn.probs 2, attn.k_cache / v_cache / k_rep / v_rep 1,
// attn.latent_cache / k_pe_cache 0; nullopt for the others.
std::optional<int> key_axis(const std::string& site);

class LeftPadStripper final : public Observer {
 public:
  LeftPadStripper(Observer& inner, int64_t pad) : inner_(inner), pad_(pad) {}
  bool wants(const std::string& name) const override { return inner_.wants(name); }
  void on_f32(const std::string& name, const Shape& shape, const float* data) override;
  void on_i64(const std::string& name, const Shape& shape, const int64_t* data) override;

 private:
  // The leading entries to drop along each axis of `name` (empty: none).
  std::vector<int64_t> drops(const std::string& name, const Shape& shape) const;
  Observer& inner_;
  int64_t pad_;
};

}  // namespace llmdiff
