#include "bisect/external.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "dumps/base/errors.h"

namespace llmdiff::bisect {

namespace fs = std::filesystem;

namespace {

std::string join(const std::vector<int64_t>& v) {
  std::string out;
  for (size_t k = 0; k < v.size(); ++k) out += (k ? "," : "") + std::to_string(v[k]);
  return out;
}

std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789,._/-=:+") ==
                        std::string::npos)
    return s;
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string tail_lines(const std::string& path, size_t lines) {
  std::ifstream in(path);
  std::vector<std::string> all;
  for (std::string l; std::getline(in, l);) all.push_back(l);
  std::string out;
  for (size_t k = all.size() > lines ? all.size() - lines : 0; k < all.size(); ++k)
    out += (out.empty() ? "" : " | ") + all[k];
  return out;
}

// Runs `command` with /bin/sh, stdout and stderr to `log`; kills its process
// group after `timeout_s`. The exit status, or -SIGNAL.
int run_shell(const std::string& command, const std::string& log, int timeout_s, bool& timed_out) {
  const pid_t pid = fork();
  if (pid < 0) throw IoError(log, "cannot start the engine command (fork failed)");
  if (pid == 0) {
    setpgid(0, 0);
    FILE* f = std::fopen(log.c_str(), "w");
    if (f) {
      dup2(fileno(f), 1);
      dup2(fileno(f), 2);
    }
    execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  setpgid(pid, pid);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  int status = 0;
  timed_out = false;
  for (;;) {
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) break;
    if (r < 0) throw IoError(log, "lost the engine command");
    if (std::chrono::steady_clock::now() > deadline) {
      timed_out = true;
      kill(-pid, SIGKILL);
      waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return WIFSIGNALED(status) ? -WTERMSIG(status) : -1;
}

}  // namespace

std::map<std::string, std::string> scenario_placeholders(const Scenario& sc) {
  const int prompt_steps = sc.emit_generated ? sc.first_generating_step + 1 : int(sc.steps.size());
  std::vector<int64_t> tokens, chunks;
  for (int s = 0; s < prompt_steps; ++s) {
    tokens.insert(tokens.end(), sc.steps[size_t(s)].begin(), sc.steps[size_t(s)].end());
    chunks.push_back(int64_t(sc.steps[size_t(s)].size()));
  }
  for (size_t s = size_t(prompt_steps); s < sc.steps.size(); ++s)
    if (sc.steps[s].size() != 1)
      throw UsageError("scenario '" + sc.name + "': forward call " + std::to_string(s) + " after the prompt has " +
                       std::to_string(sc.steps[s].size()) + " tokens, not one greedy decode token");
  return {{"tokens", join(tokens)},
          {"chunks", join(chunks)},
          {"decode", std::to_string(sc.steps.size() - size_t(prompt_steps))}};
}

std::string expand_command(const std::string& templ, const std::map<std::string, std::string>& values) {
  std::string out;
  for (size_t p = 0; p < templ.size();) {
    if (templ[p] != '{') {
      out += templ[p++];
      continue;
    }
    const size_t e = templ.find('}', p);
    if (e == std::string::npos) throw UsageError("--engine-cmd: unclosed '{' in \"" + templ + "\"");
    const std::string key = templ.substr(p + 1, e - p - 1);
    auto it = values.find(key);
    if (it == values.end()) {
      std::string known;
      for (const auto& [k, v] : values) known += (known.empty() ? "{" : ", {") + k + "}";
      throw UsageError("--engine-cmd: unknown placeholder {" + key + "} (known: " + known + ")");
    }
    out += shell_quote(it->second);
    p = e + 1;
  }
  return out;
}

std::string external_dump(const ExternalEngine& e, const std::string& model_dir, const std::string& id,
                          const Scenario& sc) {
  if (!e.dumps_dir.empty()) {
    const std::string path = (fs::path(e.dumps_dir) / (id + ".safetensors")).string();
    if (!fs::exists(path)) throw IoError(path, "no dump of " + id + " from engine " + e.name);
    return path;
  }
  const fs::path out = fs::path(e.work_dir) / (id + ".safetensors");
  const fs::path log = fs::path(e.work_dir) / (id + ".log");
  fs::create_directories(out.parent_path());
  fs::remove(out);
  std::map<std::string, std::string> values = scenario_placeholders(sc);
  values["model"] = model_dir;
  values["out"] = out.string();
  values["name"] = id;
  const std::string command = expand_command(e.command, values);
  bool timed_out = false;
  const int rc = run_shell(command, log.string(), e.timeout_s, timed_out);
  if (timed_out)
    throw Error(e.name + " on " + id + ": killed after " + std::to_string(e.timeout_s) + " s: " + command);
  if (rc != 0)
    throw Error(e.name + " on " + id + ": exited with " + std::to_string(rc) + ": " + command + "; its last output: " +
                tail_lines(log.string(), 6) + " (whole log: " + log.string() + ")");
  if (!fs::exists(out))
    throw Error(e.name + " on " + id + ": exited 0 but wrote no " + out.string() + ": " + command);
  return out.string();
}

}  // namespace llmdiff::bisect
