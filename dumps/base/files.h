// The one home of atomic writes. Files that are never seen half-written: everything is written to a
// temporary next to the target, flushed to disk (fsync) and renamed into
// place; a failure or an exception before commit() removes the temporary.
#pragma once
#include <cstdio>
#include <string>

namespace llmdiff {

class AtomicFile {
 public:
  // Creates the temporary (PATH.tmp.PID.N). Throws IoError naming `path`.
  explicit AtomicFile(std::string path);
  ~AtomicFile();  // removes the temporary unless committed
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  FILE* file() { return f_; }
  const std::string& path() const { return path_; }
  // Appends bytes; throws IoError on a short write.
  void write(const void* data, size_t bytes);
  // Flushes, fsyncs, closes and renames into place. Throws IoError.
  void commit();

 private:
  std::string path_, tmp_;
  FILE* f_ = nullptr;
  bool committed_ = false;
};

// `text` to `path` through an AtomicFile.
void write_file_atomic(const std::string& path, const std::string& text);

}  // namespace llmdiff
