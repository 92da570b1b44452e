// JUnit XML of a regress run, for CI dashboards: one <testsuite> per engine,
// one <testcase> per model/scenario.
#include <cstdio>
#include <map>

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

}  // namespace llmdiff::compare
