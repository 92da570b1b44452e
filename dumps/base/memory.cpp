#include "dumps/base/memory.h"

#include <fstream>
#include <sstream>
#include <string>

namespace llmdiff {

int64_t available_memory_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream in(line.substr(13));
    int64_t kib = 0;
    in >> kib;
    return kib * 1024;
  }
  return 0;
}

int64_t default_memory_budget() {
  const int64_t available = available_memory_bytes();
  return available > 0 ? available / 2 : int64_t(4) << 30;
}

}  // namespace llmdiff
