// llm-dump/1: a safetensors file of canonical intermediates plus a manifest.
// Readers see any dump through TensorSource (file or memory alike); writers
// are Observers that stream to disk (DumpWriter) or keep tensors in memory
// (MemoryDump).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dumps/contract/names.h"
#include "dumps/contract/observer.h"
#include "dumps/formats/safetensors.h"

namespace llmdiff {

inline constexpr const char* kDumpFormat = "llm-dump/1";

// Manifest keys of the spec (all values strings in the file).
struct Manifest {
  std::string format = kDumpFormat;
  std::string producer, model, config, scenario, dtype;
  int steps = 0;
  std::map<std::string, std::string> extra;  // any other keys, kept verbatim
  std::map<std::string, std::string> to_map() const;
  static Manifest from_map(const std::map<std::string, std::string>& m);
};

// One tensor's values, widened: floats to float32, integers to int64.
struct TensorData {
  std::string name;
  Shape shape;
  bool is_int = false;
  DType stored = DType::F32;  // dtype in the file
  std::vector<float> f;       // when !is_int
  std::vector<int64_t> i;     // when is_int
  // The step's token rows this tensor holds when it holds only some of them
  // (dumps/contract/rows.h, step{N}.rows); empty: every row.
  std::vector<int64_t> rows;
  int64_t numel() const { return llmdiff::numel(shape); }
  // The values as float32: `f` itself, or the integers converted.
  std::vector<float> floats() const;
};

// Read access to a dump, independent of where it lives.
class TensorSource {
 public:
  virtual ~TensorSource() = default;
  virtual const std::string& label() const = 0;    // file path or a description
  virtual const Manifest& manifest() const = 0;
  virtual std::vector<std::string> names() const = 0;  // canonical order
  virtual bool has(const std::string& name) const = 0;
  virtual Shape shape(const std::string& name) const = 0;
  // Throws MissingTensorError when absent.
  virtual TensorData get(const std::string& name) const = 0;

  // Number of steps: the manifest's, else derived from the names present.
  int num_steps() const;
  // Tokens of each step, from step{N}.tokens (throws if a step lacks them).
  std::vector<std::vector<int64_t>> step_tokens() const;
};

// A dump file on disk (mmap). Validates the safetensors container; a manifest
// whose format is not llm-dump/1 is accepted with an empty manifest so that any
// safetensors file can be inspected.
class DumpFile : public TensorSource {
 public:
  explicit DumpFile(const std::string& path);
  const std::string& label() const override { return file_.path(); }
  const Manifest& manifest() const override { return manifest_; }
  std::vector<std::string> names() const override;
  bool has(const std::string& name) const override;
  Shape shape(const std::string& name) const override;
  TensorData get(const std::string& name) const override;
  const SafetensorsFile& file() const { return file_; }
  bool is_llm_dump() const { return is_dump_; }

 private:
  SafetensorsFile file_;
  Manifest manifest_;
  bool is_dump_ = false;
};

// A dump held in memory: an Observer that records (a filtered subset of) the
// sites and a TensorSource that reads them back.
class MemoryDump : public Observer, public TensorSource {
 public:
  explicit MemoryDump(std::string label = "memory");
  // Glob filter on full names ("*" matches any run, "?" one char); empty = all.
  void set_filter(std::vector<std::string> globs) { globs_ = std::move(globs); }
  Manifest& mutable_manifest() { return manifest_; }

  bool wants(const std::string& name) const override;
  void on_f32(const std::string& name, const Shape& shape, const float* data) override;
  void on_i64(const std::string& name, const Shape& shape, const int64_t* data) override;

  const std::string& label() const override { return label_; }
  void set_label(std::string label) { label_ = std::move(label); }
  const Manifest& manifest() const override { return manifest_; }
  std::vector<std::string> names() const override;
  bool has(const std::string& name) const override;
  Shape shape(const std::string& name) const override;
  TensorData get(const std::string& name) const override;
  const TensorData* find(const std::string& name) const;
  void put(TensorData t);                // add or replace
  void erase(const std::string& name);
  // Writes every tensor (canonical order) with the manifest to `path`, atomically.
  void save(const std::string& path) const;
  // Tensors recorded from now on go to an unnamed temporary file in `dir`
  // (empty: $TMPDIR, else /tmp) instead of memory: a whole model's
  // activations then sit in the page cache, not in the process. get() reads
  // them back; find() sees only tensors held in memory. Throws IoError when
  // no temporary file can be made.
  void spill(const std::string& dir = "");
  bool spilling() const { return spill_ != nullptr; }

 private:
  struct SpillFile;
  std::string label_;
  Manifest manifest_;
  std::vector<std::string> globs_;
  std::map<std::string, TensorData> tensors_;  // spilled ones hold no values
  std::map<std::string, uint64_t> spilled_;    // name -> byte offset in the spill file
  std::shared_ptr<SpillFile> spill_;
};

// Streams each recorded tensor to disk as it arrives (floats as F32, ints as
// I64), then writes the manifest on finish(). Atomic like SafetensorsWriter.
class DumpWriter : public Observer {
 public:
  explicit DumpWriter(const std::string& path);
  void set_filter(std::vector<std::string> globs) { globs_ = std::move(globs); }
  Manifest& mutable_manifest() { return manifest_; }
  bool wants(const std::string& name) const override;
  void on_f32(const std::string& name, const Shape& shape, const float* data) override;
  void on_i64(const std::string& name, const Shape& shape, const int64_t* data) override;
  void finish();

 private:
  SafetensorsWriter writer_;
  Manifest manifest_;
  std::vector<std::string> globs_;
};

// Glob match of a full name against comma-free patterns ("*" any run, "?" one char).
bool glob_match(const std::string& pattern, const std::string& text);
bool any_glob_match(const std::vector<std::string>& patterns, const std::string& text);

// Forwards to several observers (e.g. a file writer and an in-memory recorder).
class TeeObserver : public Observer {
 public:
  TeeObserver(Observer& a, Observer& b) : a_(a), b_(b) {}
  bool wants(const std::string& n) const override { return a_.wants(n) || b_.wants(n); }
  void on_f32(const std::string& n, const Shape& s, const float* d) override {
    if (a_.wants(n)) a_.on_f32(n, s, d);
    if (b_.wants(n)) b_.on_f32(n, s, d);
  }
  void on_i64(const std::string& n, const Shape& s, const int64_t* d) override {
    if (a_.wants(n)) a_.on_i64(n, s, d);
    if (b_.wants(n)) b_.on_i64(n, s, d);
  }

 private:
  Observer& a_;
  Observer& b_;
};

}  // namespace llmdiff
