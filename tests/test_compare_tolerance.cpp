// compare/tolerance: dtype defaults, --tol parsing (valid and malformed),
// glob matching with and without the step prefix, resolution order.
#include <gtest/gtest.h>

#include "compare/tolerance.h"
#include "dumps/base/errors.h"

using namespace llmdiff;
using namespace llmdiff::compare;

TEST(CompareTolerance, TorchTestingDefaults) {
  EXPECT_DOUBLE_EQ(default_tolerance(ComputeDType::Float32).rtol, 1.3e-6);
  EXPECT_DOUBLE_EQ(default_tolerance(ComputeDType::Float32).atol, 1e-5);
  EXPECT_DOUBLE_EQ(default_tolerance(ComputeDType::BFloat16).rtol, 1.6e-2);
  EXPECT_DOUBLE_EQ(default_tolerance(ComputeDType::BFloat16).atol, 1e-5);
  EXPECT_DOUBLE_EQ(default_tolerance(ComputeDType::Float16).rtol, 1e-3);
  EXPECT_DOUBLE_EQ(default_tolerance(ComputeDType::Float16).atol, 1e-5);
  EXPECT_DOUBLE_EQ(default_tolerance(ComputeDType::Float64).rtol, 1e-7);
  EXPECT_DOUBLE_EQ(default_tolerance(ComputeDType::Float64).atol, 1e-7);
}

TEST(CompareTolerance, CoarserDtypeAndManifestDtype) {
  EXPECT_EQ(coarser_dtype(ComputeDType::Float32, ComputeDType::BFloat16), ComputeDType::BFloat16);
  EXPECT_EQ(coarser_dtype(ComputeDType::BFloat16, ComputeDType::Float16), ComputeDType::BFloat16);
  EXPECT_EQ(coarser_dtype(ComputeDType::Float64, ComputeDType::Float32), ComputeDType::Float32);
  EXPECT_EQ(coarser_dtype(ComputeDType::Float16, ComputeDType::Float32), ComputeDType::Float16);
  Manifest m;
  EXPECT_FALSE(manifest_dtype(m).has_value());
  m.dtype = "bfloat16";
  EXPECT_EQ(manifest_dtype(m), ComputeDType::BFloat16);
  m.dtype = "complex128";
  EXPECT_FALSE(manifest_dtype(m).has_value());
}

TEST(CompareTolerance, ParsesValidOverrides) {
  ToleranceOverride a = parse_tolerance_override("layers.*.attn.probs=atol:1e-4");
  EXPECT_EQ(a.glob, "layers.*.attn.probs");
  EXPECT_DOUBLE_EQ(*a.atol, 1e-4);
  EXPECT_FALSE(a.rtol.has_value());
  ToleranceOverride b = parse_tolerance_override("*.logits=rtol:0.01");
  EXPECT_DOUBLE_EQ(*b.rtol, 0.01);
  EXPECT_FALSE(b.atol.has_value());
  ToleranceOverride c = parse_tolerance_override("step1.*=atol:1e-4,rtol:1e-3");
  EXPECT_EQ(c.glob, "step1.*");
  EXPECT_DOUBLE_EQ(*c.atol, 1e-4);
  EXPECT_DOUBLE_EQ(*c.rtol, 1e-3);
  EXPECT_EQ(c.text, "step1.*=atol:1e-4,rtol:1e-3");
  EXPECT_DOUBLE_EQ(*parse_tolerance_override("x=atol:0").atol, 0.0);
}

TEST(CompareTolerance, RejectsMalformedOverrides) {
  for (const char* bad : {"layers.*", "=atol:1e-4", "x=", "x=atol", "x=atol:", "x=atol:abc", "x=atol:1e-4x",
                          "x=btol:1", "x=atol:-1", "x=atol:1,", "x=,atol:1", "x=atol:inf", "x=rtol:nan",
                          "x=atol:1e999"}) {
    EXPECT_THROW(parse_tolerance_override(bad), UsageError) << bad;
  }
}

TEST(CompareTolerance, GlobsMatchWithOrWithoutStepPrefix) {
  EXPECT_TRUE(site_glob_match("layers.*.attn.probs", "step3.layers.1.attn.probs"));
  EXPECT_TRUE(site_glob_match("step3.layers.*.attn.probs", "step3.layers.1.attn.probs"));
  EXPECT_FALSE(site_glob_match("step2.layers.*.attn.probs", "step3.layers.1.attn.probs"));
  EXPECT_TRUE(site_glob_match("mask", "step1.mask"));
  EXPECT_TRUE(site_glob_match("*logits", "step0.next_logits"));
  EXPECT_FALSE(site_glob_match("layers.1.*", "step0.layers.10.attn.q"));
  EXPECT_TRUE(site_glob_match("layers.1?.*", "step0.layers.10.attn.q"));
  EXPECT_TRUE(site_glob_match("rope.inv_freq", "rope.inv_freq"));
  EXPECT_TRUE(site_glob_match("generated", "generated"));
  EXPECT_FALSE(site_glob_match("attn.q", "step0.layers.0.attn.q"));  // the layer prefix is not optional
  EXPECT_EQ(strip_step_prefix("step12.layers.3.mlp.up"), "layers.3.mlp.up");
  EXPECT_EQ(strip_step_prefix("step0.embed"), "embed");
  EXPECT_EQ(strip_step_prefix("generated"), "generated");
  EXPECT_TRUE(any_site_glob_match({"embed", "*.out"}, "step0.layers.1.out"));
  EXPECT_EQ(split_list("a,,b,"), (std::vector<std::string>{"a", "b"}));
}

TEST(CompareTolerance, PolicyResolvesDefaultsGlobalsAndLastMatchingOverride) {
  TolerancePolicy bf16(ComputeDType::BFloat16, std::nullopt, std::nullopt, {});
  std::string src;
  Tolerance t = bf16.resolve("step0.embed", &src);
  EXPECT_DOUBLE_EQ(t.rtol, 1.6e-2);
  EXPECT_EQ(src, "bfloat16 default");

  TolerancePolicy p(ComputeDType::Float32, 1e-4, std::nullopt,
                    {parse_tolerance_override("layers.*=atol:1e-3"),
                     parse_tolerance_override("layers.*.attn.probs=atol:1e-2,rtol:0"),
                     parse_tolerance_override("step1.*=rtol:0.5")});
  t = p.resolve("step0.embed", &src);
  EXPECT_DOUBLE_EQ(t.rtol, 1e-4);  // --rtol
  EXPECT_DOUBLE_EQ(t.atol, 1e-5);  // float32 default atol
  EXPECT_EQ(src, "--rtol/--atol");
  t = p.resolve("step0.layers.0.attn.q", &src);
  EXPECT_DOUBLE_EQ(t.atol, 1e-3);
  EXPECT_DOUBLE_EQ(t.rtol, 1e-4);
  EXPECT_EQ(src, "--tol layers.*=atol:1e-3");
  t = p.resolve("step0.layers.0.attn.probs", &src);
  EXPECT_DOUBLE_EQ(t.atol, 1e-2);
  EXPECT_DOUBLE_EQ(t.rtol, 0.0);
  // The last matching override sets rtol; atol stays from the earlier one.
  t = p.resolve("step1.layers.0.attn.probs", &src);
  EXPECT_DOUBLE_EQ(t.atol, 1e-2);
  EXPECT_DOUBLE_EQ(t.rtol, 0.5);
  EXPECT_EQ(src, "--tol step1.*=rtol:0.5");
}
