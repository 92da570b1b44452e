#include "dumps/base/files.h"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "dumps/base/errors.h"

namespace llmdiff {

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  static std::atomic<unsigned> counter{0};
  tmp_ = path_ + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  f_ = std::fopen(tmp_.c_str(), "wb");
  if (!f_) throw IoError(path_, std::string("cannot create a temporary file: ") + std::strerror(errno));
}

AtomicFile::~AtomicFile() {
  if (f_) std::fclose(f_);
  if (!committed_) std::remove(tmp_.c_str());
}

void AtomicFile::write(const void* data, size_t bytes) {
  if (bytes == 0) return;
  if (!f_ || std::fwrite(data, 1, bytes, f_) != bytes)
    throw IoError(path_, std::string("cannot write: ") + std::strerror(errno));
}

void AtomicFile::commit() {
  if (!f_) throw IoError(path_, "already committed");
  bool ok = std::fflush(f_) == 0;
  ok = ::fsync(::fileno(f_)) == 0 && ok;
  const int err = errno;
  ok = std::fclose(f_) == 0 && ok;
  f_ = nullptr;
  if (!ok) throw IoError(path_, std::string("cannot write: ") + std::strerror(err));
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0)
    throw IoError(path_, std::string("cannot rename the temporary file into place: ") + std::strerror(errno));
  committed_ = true;
}

void write_file_atomic(const std::string& path, const std::string& text) {
  AtomicFile f(path);
  f.write(text.data(), text.size());
  f.commit();
}

}  // namespace llmdiff
