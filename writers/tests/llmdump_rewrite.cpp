// llmdiff's own rewrite of a dump: the expected bytes for the writer libraries'
// tests. Reads IN (any llm-dump/1 file), writes every tensor in the file's order
// with the same manifest through llmdiff's DumpWriter to OUT.
//   llmdump_rewrite IN OUT [IN OUT ...]
#include <cstdio>
#include <exception>
#include <filesystem>

#include "dumps/contract/dump.h"

int main(int argc, char** argv) {
  if (argc < 3 || argc % 2 != 1) {
    std::fprintf(stderr, "usage: llmdump_rewrite IN OUT [IN OUT ...]\n");
    return 2;
  }
  try {
    for (int a = 1; a + 1 < argc; a += 2) {
      const std::filesystem::path parent = std::filesystem::path(argv[a + 1]).parent_path();
      if (!parent.empty()) std::filesystem::create_directories(parent);
      llmdiff::DumpFile in(argv[a]);
      llmdiff::DumpWriter out(argv[a + 1]);
      out.mutable_manifest() = in.manifest();
      for (const auto& info : in.file().tensors()) {
        const llmdiff::TensorData t = in.get(info.name);
        if (t.is_int) out.on_i64(t.name, t.shape, t.i.data());
        else out.on_f32(t.name, t.shape, t.f.data());
      }
      out.finish();
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "llmdump_rewrite: %s\n", e.what());
    return 1;
  }
  return 0;
}
