#include "dumps/contract/dump.h"
#include "dumps/contract/rows.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <cstdlib>
#include <cstring>
#include <set>
#include <system_error>

#include "dumps/base/errors.h"
#include "dumps/contract/sites.h"

namespace llmdiff {

// ------------------------------------------------------------------ Manifest

std::map<std::string, std::string> Manifest::to_map() const {
  std::map<std::string, std::string> m = extra;
  m["format"] = format;
  m["producer"] = producer;
  m["model"] = model;
  m["config"] = config;
  m["scenario"] = scenario;
  m["steps"] = std::to_string(steps);
  m["dtype"] = dtype;
  return m;
}

Manifest Manifest::from_map(const std::map<std::string, std::string>& m) {
  Manifest out;
  out.format.clear();
  for (const auto& [k, v] : m) {
    if (k == "format") out.format = v;
    else if (k == "producer") out.producer = v;
    else if (k == "model") out.model = v;
    else if (k == "config") out.config = v;
    else if (k == "scenario") out.scenario = v;
    else if (k == "dtype") out.dtype = v;
    else if (k == "steps") {
      try {
        size_t used = 0;
        out.steps = std::stoi(v, &used);
        if (used != v.size() || out.steps < 0) out.steps = 0;
      } catch (const std::exception&) {
        out.steps = 0;
      }
    } else {
      out.extra[k] = v;
    }
  }
  return out;
}

// --------------------------------------------------------------- TensorData

std::vector<float> TensorData::floats() const {
  if (!is_int) return f;
  return std::vector<float>(i.begin(), i.end());
}

// ------------------------------------------------------------- TensorSource

int TensorSource::num_steps() const {
  int steps = 0;
  for (const auto& n : names()) {
    CanonName c = parse_name(n);
    if (c.step >= 0) steps = std::max(steps, c.step + 1);
  }
  return std::max(steps, manifest().steps);
}

std::vector<std::vector<int64_t>> TensorSource::step_tokens() const {
  std::vector<std::vector<int64_t>> out;
  const int steps = num_steps();  // every name parsed: once, not per step
  for (int s = 0; s < steps; ++s) {
    const std::string name = step_name(s, Site::Tokens);
    if (!has(name)) throw MissingTensorError(label(), name);
    TensorData t = get(name);
    if (!t.is_int || t.shape.size() != 1)
      throw FormatError(label(), name, "expected an integer tensor of shape [T], got " + shape_str(t.shape));
    out.push_back(t.i);
  }
  return out;
}

// ------------------------------------------------------------------ DumpFile

DumpFile::DumpFile(const std::string& path) : file_(path) {
  const auto& meta = file_.metadata();
  auto f = meta.find("format");
  is_dump_ = f != meta.end() && f->second == kDumpFormat;
  manifest_ = Manifest::from_map(meta);
}

std::vector<std::string> DumpFile::names() const {
  std::vector<std::string> v;
  v.reserve(file_.tensors().size());
  for (const auto& t : file_.tensors()) v.push_back(t.name);
  sort_canonical(v);
  return v;
}

bool DumpFile::has(const std::string& name) const { return file_.find(name) != nullptr; }

Shape DumpFile::shape(const std::string& name) const { return file_.at(name).shape; }

TensorData DumpFile::get(const std::string& name) const {
  const TensorInfo& info = file_.at(name);
  TensorData t;
  t.name = name;
  t.shape = info.shape;
  t.stored = info.dtype;
  t.is_int = !dtype_is_float(info.dtype);
  if (t.is_int) t.i = file_.to_i64(info);
  else t.f = file_.to_f32(info);
  // Read once into the copy: the mapped pages need not stay resident (a dump
  // of a large model is read tensor by tensor, more than once).
  release_pages(file_.data(info), size_t(info.end - info.begin));
  attach_rows(*this, t);
  return t;
}

// ------------------------------------------------------------------- globs

bool glob_match(const std::string& p, const std::string& s) {
  size_t pi = 0, si = 0, star = std::string::npos, mark = 0;
  while (si < s.size()) {
    if (pi < p.size() && (p[pi] == '?' || p[pi] == s[si])) {
      ++pi, ++si;
    } else if (pi < p.size() && p[pi] == '*') {
      star = pi++;
      mark = si;
    } else if (star != std::string::npos) {
      pi = star + 1;
      si = ++mark;
    } else {
      return false;
    }
  }
  while (pi < p.size() && p[pi] == '*') ++pi;
  return pi == p.size();
}

bool any_glob_match(const std::vector<std::string>& patterns, const std::string& text) {
  for (const auto& p : patterns)
    if (glob_match(p, text)) return true;
  return false;
}

// ---------------------------------------------------------------- MemoryDump

MemoryDump::MemoryDump(std::string label) : label_(std::move(label)) {}

bool MemoryDump::wants(const std::string& name) const { return globs_.empty() || any_glob_match(globs_, name); }

// An unnamed temporary file (unlinked at once: nothing is left behind, even
// on a crash) that tensors are appended to and read back from.
//
// Appends are written by a thread of the file's own: the recording thread
// copies the values into a buffer (recycled, no fresh pages) and goes on
// computing, while the writer does the system call and its copy into the
// page cache, on a core that an engine's BLAS would otherwise spin on between
// its products. At most kInFlight bytes wait (one larger tensor alone); a
// read first waits for every queued write (and hands the recycled buffers
// back). A write error is thrown by the next append or read.
struct MemoryDump::SpillFile {
  static constexpr size_t kInFlight = size_t(64) << 20;
  int fd = -1;
  uint64_t end = 0;
  std::string where;

  explicit SpillFile(const std::string& dir) {
    std::string d = dir;
    if (d.empty()) {
      const char* env = std::getenv("TMPDIR");
      d = env && *env ? env : "/tmp";
    }
    std::string templ = d + "/llmdiff-spill-XXXXXX";
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back('\0');
    fd = ::mkstemp(buf.data());
    if (fd < 0) throw IoError(d, std::string("cannot create a temporary file: ") + std::strerror(errno));
    ::unlink(buf.data());
    where = buf.data();
    try {
      writer_ = std::thread([this] { write_loop(); });
    } catch (const std::system_error& e) {
      ::close(fd);
      throw IoError(where, std::string("cannot start the spill file's writer: ") + e.what());
    }
  }
  ~SpillFile() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_.notify_all();
    writer_.join();
    if (fd >= 0) ::close(fd);
  }
  uint64_t append(const void* data, size_t bytes) {
    std::vector<char> buf;
    uint64_t at = 0;
    {
      std::unique_lock<std::mutex> lock(mu_);
      done_.wait(lock, [&] { return !error_.empty() || queued_ == 0 || queued_ + bytes <= kInFlight; });
      if (!error_.empty()) throw IoError(where, error_);
      at = end;
      end += bytes;
      queued_ += bytes;  // counted now: a read waits for it from here on
      // A recycled buffer large enough, else a new one.
      for (auto it = free_.begin(); it != free_.end(); ++it)
        if (it->capacity() >= bytes) {
          buf = std::move(*it);
          free_.erase(it);
          break;
        }
    }
    try {
      buf.resize(bytes);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      queued_ -= bytes;
      done_.notify_all();
      throw;
    }
    if (bytes) std::memcpy(buf.data(), data, bytes);
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back({at, std::move(buf)});
    }
    work_.notify_one();
    return at;
  }
  void read(uint64_t at, void* data, size_t bytes) const {
    {
      std::unique_lock<std::mutex> lock(mu_);
      done_.wait(lock, [&] { return !error_.empty() || queued_ == 0; });
      if (!error_.empty()) throw IoError(where, error_);
      std::vector<std::vector<char>>().swap(free_);  // recording is over: its buffers go back
    }
    char* p = static_cast<char*>(data);
    size_t done = 0;
    while (done < bytes) {
      const ssize_t n = ::pread(fd, p + done, bytes - done, off_t(at + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw IoError(where, std::string("cannot read a spilled tensor back: ") + std::strerror(errno));
      done += size_t(n);
    }
  }

 private:
  struct Pending {
    uint64_t at;
    std::vector<char> data;
  };
  void write_loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;  // the file goes: what is queued is not needed
      Pending w = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      std::string failed;
      size_t done = 0;
      while (done < w.data.size()) {
        const ssize_t n = ::pwrite(fd, w.data.data() + done, w.data.size() - done, off_t(w.at + done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          failed = std::string("cannot write a spilled tensor: ") + std::strerror(n < 0 ? errno : ENOSPC);
          break;
        }
        done += size_t(n);
      }
      lock.lock();
      if (!failed.empty() && error_.empty()) error_ = failed;
      queued_ -= w.data.size();
      size_t kept = 0;
      for (const auto& b : free_) kept += b.capacity();
      if (kept + w.data.capacity() <= kInFlight) free_.push_back(std::move(w.data));
      done_.notify_all();
    }
  }
  mutable std::mutex mu_;
  mutable std::condition_variable work_, done_;
  std::deque<Pending> queue_;
  mutable std::vector<std::vector<char>> free_;
  size_t queued_ = 0;
  std::string error_;
  bool stop_ = false;
  std::thread writer_;
};

void MemoryDump::spill(const std::string& dir) {
  if (!spill_) spill_ = std::make_shared<SpillFile>(dir);
}

void MemoryDump::on_f32(const std::string& name, const Shape& shape, const float* data) {
  TensorData t;
  t.name = name;
  t.shape = shape;
  t.stored = DType::F32;
  if (spill_) {
    spilled_[name] = spill_->append(data, size_t(numel(shape)) * sizeof(float));
    tensors_[name] = std::move(t);
    return;
  }
  t.f.assign(data, data + numel(shape));
  put(std::move(t));
}

void MemoryDump::on_i64(const std::string& name, const Shape& shape, const int64_t* data) {
  TensorData t;
  t.name = name;
  t.shape = shape;
  t.is_int = true;
  t.stored = DType::I64;
  if (spill_) {
    spilled_[name] = spill_->append(data, size_t(numel(shape)) * sizeof(int64_t));
    tensors_[name] = std::move(t);
    return;
  }
  t.i.assign(data, data + numel(shape));
  put(std::move(t));
}

std::vector<std::string> MemoryDump::names() const {
  std::vector<std::string> v;
  v.reserve(tensors_.size());
  for (const auto& kv : tensors_) v.push_back(kv.first);
  sort_canonical(v);
  return v;
}

bool MemoryDump::has(const std::string& name) const { return tensors_.count(name) != 0; }

Shape MemoryDump::shape(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) throw MissingTensorError(label_, name);
  return it->second.shape;
}

TensorData MemoryDump::get(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) throw MissingTensorError(label_, name);
  TensorData t = it->second;
  auto sp = spilled_.find(name);
  if (sp != spilled_.end()) {
    if (t.is_int) {
      t.i.resize(size_t(t.numel()));
      spill_->read(sp->second, t.i.data(), t.i.size() * sizeof(int64_t));
    } else {
      t.f.resize(size_t(t.numel()));
      spill_->read(sp->second, t.f.data(), t.f.size() * sizeof(float));
    }
  }
  attach_rows(*this, t);
  return t;
}

const TensorData* MemoryDump::find(const std::string& name) const {
  if (spilled_.count(name)) return nullptr;
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

void MemoryDump::put(TensorData t) {
  std::string name = t.name;
  spilled_.erase(name);
  tensors_[name] = std::move(t);
}

void MemoryDump::erase(const std::string& name) {
  spilled_.erase(name);
  tensors_.erase(name);
}

void MemoryDump::save(const std::string& path) const {
  SafetensorsWriter w(path);
  for (const auto& [k, v] : manifest_.to_map()) w.set_metadata(k, v);
  for (const auto& name : names()) {
    const TensorData t = get(name);
    if (t.is_int) w.add_i64(name, t.shape, t.i.data());
    else w.add_f32(name, t.shape, t.f.data());
  }
  w.finish();
}

// ---------------------------------------------------------------- DumpWriter

DumpWriter::DumpWriter(const std::string& path) : writer_(path) {}

bool DumpWriter::wants(const std::string& name) const { return globs_.empty() || any_glob_match(globs_, name); }

void DumpWriter::on_f32(const std::string& name, const Shape& shape, const float* data) {
  writer_.add_f32(name, shape, data);
}

void DumpWriter::on_i64(const std::string& name, const Shape& shape, const int64_t* data) {
  writer_.add_i64(name, shape, data);
}

void DumpWriter::finish() {
  for (const auto& [k, v] : manifest_.to_map()) writer_.set_metadata(k, v);
  writer_.finish();
}

}  // namespace llmdiff
