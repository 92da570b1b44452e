#include "dumps/base/memory.h"

#include <malloc.h>

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

void release_free_heap(int64_t at_least_bytes) {
  // glibc sets its heap up on the first call into it and marks it ready
  // before it is: a second thread's call meanwhile walks an empty arena.
  // That first call is made once, alone. (Where malloc is replaced, by a
  // sanitizer for one, these calls are the heap's first.)
  static const bool ready = (mallinfo2(), true);
  (void)ready;
  if (at_least_bytes > 0 && mallinfo2().fordblks < size_t(at_least_bytes)) return;
  malloc_trim(0);
}

}  // namespace llmdiff
