#include "dumps/base/threads.h"

#include <algorithm>
#include <thread>

namespace llmdiff {

int default_threads() { return std::max(1, int(std::thread::hardware_concurrency())); }

int resolve_threads(int threads) { return threads > 0 ? threads : default_threads(); }

}  // namespace llmdiff
