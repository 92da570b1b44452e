// JUnit XML for CI dashboards: of a regress run (one <testsuite> per
// engine, one <testcase> per model/scenario) and of a bisection (one
// <testcase> for the forward pass, per sequence of a batch, and for the
// sampler), each failure's message the verdict's headline.
#include <cstdio>
#include <map>

#include "compare/batch_report.h"
#include "compare/bisect_report.h"
#include "compare/report.h"

namespace llmdiff::compare {

namespace {
std::string secs(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", s);
  return buf;
}
}  // namespace

std::string render_regress_junit(const RegressionReport& r) {
  std::map<std::string, std::vector<const RegressionCase*>> by_engine;
  for (const auto& c : r.cases) by_engine[c.engine_label()].push_back(&c);
  size_t failures = 0, errors = 0;
  double total = 0;
  for (const auto& c : r.cases) {
    total += c.seconds;
    if (!c.error.empty())
      ++errors;
    else if (!c.pass)
      ++failures;
  }
  std::string out = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  out += "<testsuites name=\"llmdiff regress\" tests=\"" + std::to_string(r.cases.size()) + "\" failures=\"" +
         std::to_string(failures) + "\" errors=\"" + std::to_string(errors) + "\" time=\"" + secs(total) + "\">\n";
  for (const auto& [engine, cases] : by_engine) {
    size_t f = 0, e = 0;
    double t = 0;
    for (const RegressionCase* c : cases) {
      t += c->seconds;
      if (!c->error.empty())
        ++e;
      else if (!c->pass)
        ++f;
    }
    const std::string& name = engine;
    out += "  <testsuite name=\"" + xml_escape(name) + "\" tests=\"" + std::to_string(cases.size()) + "\" failures=\"" +
           std::to_string(f) + "\" errors=\"" + std::to_string(e) + "\" skipped=\"0\" time=\"" + secs(t) + "\">\n";
    for (const RegressionCase* c : cases) {
      out += "    <testcase classname=\"" + xml_escape(name + "." + c->model) + "\" name=\"" + xml_escape(c->id()) +
             "\" time=\"" + secs(c->seconds) + "\">\n";
      out += "      <properties>\n";
      out += "        <property name=\"dump\" value=\"" + xml_escape(c->dump) + "\"/>\n";
      out += "        <property name=\"rule\" value=\"" + xml_escape(c->rule) + "\"/>\n";
      if (!c->worst_name.empty()) {
        out += "        <property name=\"worst\" value=\"" +
               xml_escape(c->worst_name + " " + c->worst_metric + " " + fmt_num(c->worst_value) + " (threshold " +
                          fmt_num(c->worst_threshold) + ")") +
               "\"/>\n";
      }
      out += "      </properties>\n";
      std::string body;
      for (const auto& line : c->failures) body += line + "\n";
      if (!c->error.empty()) {
        out += "      <error message=\"" + xml_escape(c->error) + "\" type=\"engine error\">" + xml_escape(body) +
               "</error>\n";
      } else if (!c->pass) {
        std::string msg = c->failures.empty() ? "failed" : c->failures.front();
        if (c->failures.size() > 1) msg += " (+" + std::to_string(c->failures.size() - 1) + " more)";
        out += "      <failure message=\"" + xml_escape(msg) + "\" type=\"regression\">" + xml_escape(body) +
               "</failure>\n";
      }
      out += "    </testcase>\n";
    }
    out += "  </testsuite>\n";
  }
  out += "</testsuites>\n";
  return out;
}

namespace {

std::string property(const std::string& name, const std::string& value) {
  return "        <property name=\"" + xml_escape(name) + "\" value=\"" + xml_escape(value) + "\"/>\n";
}

// A bisection's forward pass as one <testcase>: its finding as properties,
// a <failure> with the headline, the explanation and the error signatures
// when it diverges.
std::string forward_case(const BisectResult& r, const std::string& name) {
  const Finding& f = r.finding;
  std::string o = "    <testcase classname=\"" + xml_escape("llmdiff.bisect." + (r.model.empty() ? "model" : r.model)) +
                  "\" name=\"" + xml_escape(name) + "\" time=\"0\">\n      <properties>\n";
  o += property("finding", headline(f));
  o += property("kind", kind_name(f.kind));
  o += property("first_divergence", r.first_divergence().value_or("none"));
  o += property("first_local_failure", r.first_local_failure().value_or("none"));
  o += "      </properties>\n";
  if (!r.ok()) {
    std::string body = explanation(f);
    if (!r.diagnosis.signatures.empty()) body += "\nError signatures:";
    for (const ErrorSignature& g : r.diagnosis.signatures) body += "\n  " + signature_line(g);
    o += "      <failure message=\"" + xml_escape(headline(r)) + "\" type=\"" + xml_escape(kind_name(f.kind)) + "\">" +
         xml_escape(body) + "</failure>\n";
  }
  return o + "    </testcase>\n";
}

std::string sampler_case(const SamplingCheck& c, const std::string& classname) {
  std::string o = "    <testcase classname=\"" + xml_escape(classname) + "\" name=\"sampler\" time=\"0\">\n";
  if (c.verdict == SamplingCheck::Verdict::Fail) {
    std::string msg = "the sampler fails at " + std::to_string(c.failing_steps()) + " of " +
                      std::to_string(c.checked_steps()) + " steps";
    if (const std::string finding = sampling_finding(c); !finding.empty()) msg += "; " + finding;
    o += "      <failure message=\"" + xml_escape(msg) + "\" type=\"sampler\">" + xml_escape(render_sampling_check(c)) +
         "</failure>\n";
  }
  return o + "    </testcase>\n";
}

std::string suite(const std::string& name, const std::string& cases, size_t tests, size_t failures) {
  return "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites name=\"llmdiff bisect\" tests=\"" +
         std::to_string(tests) + "\" failures=\"" + std::to_string(failures) + "\" errors=\"0\">\n" +
         "  <testsuite name=\"" + xml_escape(name) + "\" tests=\"" + std::to_string(tests) + "\" failures=\"" +
         std::to_string(failures) + "\" errors=\"0\" skipped=\"0\">\n" + cases + "  </testsuite>\n</testsuites>\n";
}

}  // namespace

std::string render_bisect_junit(const BisectResult& r) {
  std::string cases = forward_case(r, r.candidate_label);
  size_t tests = 1, failures = r.ok() ? 0 : 1;
  if (r.sampling) {
    cases += sampler_case(*r.sampling, "llmdiff.bisect." + (r.model.empty() ? "model" : r.model));
    ++tests;
    failures += r.sampler_fails();
  }
  return suite("llmdiff bisect " + r.candidate_label, cases, tests, failures);
}

std::string render_batch_junit(const BatchBisect& b) {
  std::string cases;
  size_t tests = 0, failures = 0;
  for (const SequenceBisect& s : b.sequences) {
    cases += forward_case(s.result, b.candidate_label + " seq" + std::to_string(s.seq));
    ++tests;
    failures += !s.result.ok();
  }
  if (b.sampling) {
    cases += sampler_case(*b.sampling, "llmdiff.bisect");
    ++tests;
    failures += b.sampling->verdict == SamplingCheck::Verdict::Fail;
  }
  return suite("llmdiff bisect " + b.candidate_label, cases, tests, failures);
}

}  // namespace llmdiff::compare
