#include "dumps/import/foreign.h"

#include <algorithm>
#include <filesystem>

#include "dumps/base/dtype.h"
#include "dumps/base/errors.h"
#include "dumps/formats/npy.h"

namespace llmdiff {

namespace fs = std::filesystem;

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

struct ForeignTensors::Impl {
  enum class Kind { Safetensors, Npz, NpyDir, Npy } kind = Kind::Safetensors;
  std::unique_ptr<SafetensorsFile> st;
  std::unique_ptr<MappedFile> zip;              // .npz, or the one .npy
  std::vector<ZipMember> members;               // .npz, in names_ order
  std::vector<std::string> files;               // .npy directory, in names_ order
};

ForeignTensors::ForeignTensors(const std::string& path) : path_(path), impl_(std::make_unique<Impl>()) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    impl_->kind = Impl::Kind::NpyDir;
    std::vector<std::pair<std::string, std::string>> found;
    for (auto it = fs::recursive_directory_iterator(path, ec); !ec && it != fs::recursive_directory_iterator();
         it.increment(ec)) {
      const std::string p = it->path().string();
      if (!it->is_regular_file() || !ends_with(p, ".npy")) continue;
      std::string rel = fs::relative(it->path(), path).generic_string();
      found.emplace_back(rel.substr(0, rel.size() - 4), p);
    }
    if (ec) throw IoError(path, "cannot list the directory: " + ec.message());
    if (found.empty()) throw IoError(path, "no .npy files in the directory");
    std::sort(found.begin(), found.end());
    for (auto& [name, file] : found) {
      index_[name] = names_.size();
      names_.push_back(name);
      impl_->files.push_back(file);
    }
    return;
  }
  auto mapped = std::make_unique<MappedFile>(path);
  const uint8_t* d = mapped->data();
  const size_t n = mapped->size();
  if (n >= 6 && d[0] == 0x93 && d[1] == 'N' && d[2] == 'U' && d[3] == 'M' && d[4] == 'P' && d[5] == 'Y') {
    impl_->kind = Impl::Kind::Npy;
    std::string stem = fs::path(path).filename().string();
    if (ends_with(stem, ".npy")) stem.resize(stem.size() - 4);
    names_.push_back(stem);
    index_[stem] = 0;
    impl_->zip = std::move(mapped);
    return;
  }
  if (n >= 4 && d[0] == 'P' && d[1] == 'K') {
    impl_->kind = Impl::Kind::Npz;
    for (ZipMember& m : zip_members(d, n, path)) {
      if (!ends_with(m.name, ".npy")) continue;  // numpy writes only .npy members
      std::string name = m.name.substr(0, m.name.size() - 4);
      if (index_.count(name)) throw FormatError(path, name, "two members of the archive have this name");
      index_[name] = names_.size();
      names_.push_back(name);
      impl_->members.push_back(std::move(m));
    }
    if (names_.empty()) throw FormatError(path, "", "the .npz archive holds no .npy arrays");
    impl_->zip = std::move(mapped);
    return;
  }
  mapped.reset();
  impl_->kind = Impl::Kind::Safetensors;
  impl_->st = std::make_unique<SafetensorsFile>(path);
  for (const TensorInfo& t : impl_->st->tensors()) {
    index_[t.name] = names_.size();
    names_.push_back(t.name);
  }
}

ForeignTensors::~ForeignTensors() = default;

std::string ForeignTensors::file_of(const std::string& name) const {
  auto it = index_.find(name);
  if (impl_->kind == Impl::Kind::NpyDir && it != index_.end()) return impl_->files[it->second];
  return path_;
}

Shape ForeignTensors::shape(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) throw MissingTensorError(path_, name);
  switch (impl_->kind) {
    case Impl::Kind::Safetensors: return impl_->st->at(name).shape;
    case Impl::Kind::Npy: return npy_shape_of(impl_->zip->data(), impl_->zip->size(), path_, name);
    case Impl::Kind::NpyDir: {
      const MappedFile f(impl_->files[it->second]);
      return npy_shape_of(f.data(), f.size(), f.path(), name);
    }
    case Impl::Kind::Npz: {
      const std::vector<uint8_t> bytes =
          zip_extract(impl_->zip->data(), impl_->zip->size(), impl_->members[it->second], path_);
      return npy_shape_of(bytes.data(), bytes.size(), path_, name);
    }
  }
  return {};
}

TensorData ForeignTensors::get(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) throw MissingTensorError(path_, name);
  switch (impl_->kind) {
    case Impl::Kind::Safetensors: {
      const TensorInfo& t = impl_->st->at(name);
      TensorData td;
      td.name = name;
      td.shape = t.shape;
      td.stored = t.dtype;
      td.is_int = !dtype_is_float(t.dtype);
      if (td.is_int)
        td.i = impl_->st->to_i64(t);
      else
        td.f = impl_->st->to_f32(t);
      return td;
    }
    case Impl::Kind::Npy: return parse_npy(impl_->zip->data(), impl_->zip->size(), path_, name);
    case Impl::Kind::NpyDir: {
      const MappedFile f(impl_->files[it->second]);
      return parse_npy(f.data(), f.size(), f.path(), name);
    }
    case Impl::Kind::Npz: {
      const std::vector<uint8_t> bytes =
          zip_extract(impl_->zip->data(), impl_->zip->size(), impl_->members[it->second], path_);
      return parse_npy(bytes.data(), bytes.size(), path_, name);
    }
  }
  return {};
}

}  // namespace llmdiff
