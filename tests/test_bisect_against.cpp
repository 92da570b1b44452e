// bisect/against.h's pieces on the golden models: the float64 logits that
// settle a greedy flip are HF's next_logits up to float32 rounding, and each
// view that replays a serving feature (prefix hit, verify calls, tensor
// parallel ranks) presents a plain run's calls as the reference makes them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "bisect/against.h"
#include "dumps/base/errors.h"
#include "dumps/contract/dump.h"
#include "dumps/contract/names.h"
#include "dumps/model/config.h"
#include "tests/support.h"
#include "tests/test_compare_helpers.h"

using namespace llmdiff;
using namespace llmdiff::testing;

TEST(BisectAgainst, Float64LogitsAreHfsNextLogitsUpToFloat32Rounding) {
  for (const std::string model : {"llama-gqa", "qwen3-moe", "deepseek-v3-mla"}) {
    SCOPED_TRACE(model);
    DumpFile hf(golden_dump(model, "decode"));
    const bisect::ModelOracles m(golden_model(model), 1);
    // The prompt and the first decoded token, fed in one call: step 1's logits.
    std::vector<int64_t> tokens = hf.get("step0.tokens").i;
    tokens.push_back(hf.get("step1.tokens").i[0]);
    const std::vector<float> truth = bisect::float64_logits(m)(tokens);
    const std::vector<float> want = hf.get("step1.next_logits").f;
    ASSERT_EQ(truth.size(), want.size());
    double worst = 0, scale = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      worst = std::max(worst, std::fabs(double(truth[i]) - want[i]));
      scale = std::max(scale, std::fabs(double(want[i])));
    }
    EXPECT_LT(worst, 1e-5 * std::max(1.0, scale));
  }
}

