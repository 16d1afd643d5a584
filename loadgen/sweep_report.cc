// The run folder: results.csv, results.json, summary.md and gnuplot PNGs.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/bounded_json.h"
#include "common/status_macros.h"
#include "loadgen/sweep.h"
#include "nlohmann/json.hpp"

namespace tandem::loadgen {
namespace {

namespace fs = std::filesystem;

absl::Status WriteFile(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write ", path.string()));
  return absl::OkStatus();
}

double Load(const ConfigResult& c) { return c.mode == "closed" ? c.batch : c.rate; }

std::string Shares(const ConfigResult& c) {
  std::vector<std::string> parts;
  for (const auto& [stage, s] : c.stage_share) {
    const double total = s.compute_s + s.transfer_s;
    parts.push_back(absl::StrFormat("s%d:%.2f", stage, total > 0 ? s.compute_s / total : 0));
  }
  return absl::StrJoin(parts, " ");
}

std::string Csv(const SweepResult& r) {
  std::string out =
      "nodes,stages,replicas,mode,batch,rate,prompt_len,output_len,requests,errors,wall_s,"
      "tokens,tokens_per_s,requests_per_s,ttft_p50_s,ttft_p90_s,ttft_p99_s,itl_p50_s,itl_p90_s,"
      "itl_p99_s,e2e_p50_s,e2e_p90_s,e2e_p99_s,speedup,efficiency,energy_j,power_w,"
      "tokens_per_joule,peak_gpu_memory_bytes,compute_share_by_stage,correct,prefill_nodes,"
      "workload\n";
  for (const ConfigResult& c : r.configs) {
    absl::StrAppend(
        &out,
        absl::StrFormat(
            "%d,%d,%d,%s,%d,%g,%d,%d,%d,%d,%.4f,%.0f,%.3f,%.4f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6f,"
            "%.6f,%.6f,%.4f,%.4f,%.3f,%.2f,%.4f,%.0f,%s,%s,%d,%s\n",
            c.nodes, c.stages, c.replicas, c.mode, c.batch, c.rate, c.prompt_len, c.output_len,
            c.requests, c.errors, c.wall_s, c.tokens, c.tokens_per_s, c.requests_per_s, c.ttft_p50,
            c.ttft_p90, c.ttft_p99, c.itl_p50, c.itl_p90, c.itl_p99, c.e2e_p50, c.e2e_p90,
            c.e2e_p99, c.speedup, c.efficiency, c.energy_j, c.power_w, c.tokens_per_joule,
            c.peak_gpu_memory_bytes, Shares(c), c.correct ? "true" : "false", c.prefill_nodes,
            c.workload));
  }
  return out;
}

nlohmann::json DifferencesJson(const ConfigResult& c) {
  nlohmann::json out = nlohmann::json::array();
  for (const Difference& d : c.differences) {
    const Verdict& v = d.verdict;
    out.push_back(
        {{"prompt", d.prompt},
         {"requests", d.requests},
         {"verdict", AgreementName(v.agreement)},
         {"position", v.position},
         {"reference_top2_gap", std::isnan(v.gap) ? nlohmann::json() : nlohmann::json(v.gap)},
         {"reference_token", v.reference_token},
         {"token", v.token}});
  }
  return out;
}

nlohmann::json Json(const SweepResult& r) {
  const SweepOptions& o = r.options;
  nlohmann::json j;
  j["options"] = {{"api", o.api},
                  {"coordinator", o.coordinator},
                  {"worker_metrics", o.worker_metrics},
                  {"nodes", o.nodes},
                  {"data_parallel", o.data_parallel},
                  {"tensor_nodes", o.tensor_nodes},
                  {"tensor_parallel", o.tensor_parallel},
                  {"prefill_nodes", o.prefill_nodes},
                  {"mode", o.mode},
                  {"batch", o.batch},
                  {"rates", o.rates},
                  {"prompt_lens", o.prompt_lens},
                  {"output_lens", o.output_lens},
                  {"requests", o.requests},
                  {"scaling", o.weak_scaling ? "weak" : "strong"},
                  {"warmup", o.warmup},
                  {"prompt_pool", o.prompt_pool},
                  {"workload", o.workload.kind},
                  {"length_sigma", o.workload.length_sigma},
                  {"shared_prefix_len", o.workload.shared_prefix_len},
                  {"seed", o.seed},
                  {"tie_tolerance", o.tie_tolerance},
                  {"check", o.check}};
  const ServedModel& m = r.server;
  j["server"] = {{"model", m.name},
                 {"model_dir", m.model_dir},
                 {"architecture", m.architecture},
                 {"dtype", m.dtype},
                 {"kv_cache_dtype", m.kv_cache_dtype},
                 {"num_layers", m.num_layers},
                 {"context_length", m.context_length},
                 {"vocab_size", m.vocab_size},
                 {"max_slots", m.max_slots},
                 {"max_batch", m.max_batch},
                 {"stages", m.stages},
                 {"replicas", m.replicas}};
  j["warnings"] = r.warnings;
  j["all_correct"] = r.all_correct;
  j["correctness"] = CorrectnessWord(r);
  j["reference_has_gaps"] = r.reference_has_gaps;
  j["configs"] = nlohmann::json::array();
  for (const ConfigResult& c : r.configs) {
    nlohmann::json s = nlohmann::json::object();
    for (const auto& [stage, sh] : c.stage_share) {
      s[std::to_string(stage)] = {
          {"compute_s", sh.compute_s}, {"transfer_s", sh.transfer_s}, {"transfer_bytes", sh.bytes}};
    }
    j["configs"].push_back(
        {{"nodes", c.nodes},
         {"stages", c.stages},
         {"replicas", c.replicas},
         {"prefill_nodes", c.prefill_nodes},
         {"mode", c.mode},
         {"batch", c.batch},
         {"rate", c.rate},
         {"workload", c.workload},
         {"prompt_len", c.prompt_len},
         {"output_len", c.output_len},
         {"requests", c.requests},
         {"errors", c.errors},
         {"wall_s", c.wall_s},
         {"tokens", c.tokens},
         {"tokens_per_s", c.tokens_per_s},
         {"requests_per_s", c.requests_per_s},
         {"ttft_s", {{"p50", c.ttft_p50}, {"p90", c.ttft_p90}, {"p99", c.ttft_p99}}},
         {"itl_s", {{"p50", c.itl_p50}, {"p90", c.itl_p90}, {"p99", c.itl_p99}}},
         {"e2e_s", {{"p50", c.e2e_p50}, {"p90", c.e2e_p90}, {"p99", c.e2e_p99}}},
         {"pause_s", {{"p50", c.pause_p50}, {"p99", c.pause_p99}, {"max", c.pause_max}}},
         {"speedup", c.speedup},
         {"efficiency", c.efficiency},
         {"has_gpu", c.has_gpu},
         {"energy_j", c.energy_j},
         {"power_w", c.power_w},
         {"tokens_per_joule", c.tokens_per_joule},
         {"peak_gpu_memory_bytes", c.peak_gpu_memory_bytes},
         {"precision", c.precision},
         {"tensor_parallel", c.tensor_parallel},
         {"stages_time", s},
         {"correct", c.correct},
         {"mismatches", c.mismatches},
         {"near_ties", c.near_ties},
         {"unchecked", c.unchecked},
         {"differences", DifferencesJson(c)}});
  }
  return j;
}

// What the server said of itself; "" when it said nothing.
std::string ServerLine(const ServedModel& m) {
  std::vector<std::string> about;  // in the parentheses after the name
  if (!m.model_dir.empty()) about.push_back(m.model_dir);
  if (!m.architecture.empty()) about.push_back(m.architecture);
  if (m.num_layers > 0) about.push_back(absl::StrCat(m.num_layers, " layers"));
  if (!m.dtype.empty()) about.push_back(absl::StrCat("weights ", m.dtype));
  if (!m.kv_cache_dtype.empty()) about.push_back(absl::StrCat("KV-cache ", m.kv_cache_dtype));
  if (m.context_length > 0) about.push_back(absl::StrCat("context ", m.context_length, " tokens"));
  if (m.vocab_size > 0) about.push_back(absl::StrCat("vocabulary ", m.vocab_size));
  std::vector<std::string> parts;
  if (!m.name.empty() || !about.empty()) {
    parts.push_back(
        absl::StrCat("model ", m.name.empty() ? "(unnamed)" : m.name,
                     about.empty() ? "" : absl::StrCat(" (", absl::StrJoin(about, ", "), ")")));
  }
  if (m.max_slots > 0) parts.push_back(absl::StrCat(m.max_slots, " KV slots per pipeline"));
  if (m.max_batch > 0) parts.push_back(absl::StrCat("steps of up to ", m.max_batch, " sequences"));
  if (parts.empty()) return "";
  std::string line = absl::StrCat("Server: ", absl::StrJoin(parts, ", "));
  if (m.stages > 0 && m.replicas > 0) {
    absl::StrAppend(&line, absl::StrFormat("; %d stage(s) x %d replica(s) when the sweep began",
                                           m.stages, m.replicas));
  }
  return line + ".";
}

// How the outputs were judged, in words.
std::string CheckRule(const SweepResult& r) {
  const SweepOptions& o = r.options;
  const std::string word = CorrectnessWord(r);
  std::string md = absl::StrFormat("Correctness: **%s**. ", word);
  if (word == "not checked" && !o.check) {
    return md + "Outputs were not compared with reference runs (`--check=false`).\n\n";
  }
  if (word == "not checked") {
    return md +
           "The API named no generated token (its streamed text is empty, as over the OpenAI API "
           "for a model without a tokenizer), so outputs could not be compared; `--api grpc` "
           "compares token ids.\n\n";
  }
  absl::StrAppend(
      &md,
      "Each greedy output is compared with a reference run of its prompt: the prompt generated "
      "alone (one request at a time) with top-2 logprobs on the first layout (",
      o.nodes.front(), " node(s)), before the measured runs. ");
  if (o.tie_tolerance <= 0) {
    md += "Every output must equal its reference (`--tie_tolerance 0`).";
  } else {
    absl::StrAppend(
        &md,
        absl::StrFormat(
            "By the agreement rule, outputs must be identical wherever the reference's top-2 "
            "logprob gap is at least %g nats (`--tie_tolerance`; two fp16 runs' logits differ by "
            "up to about 0.04); an output whose first differing token is at a smaller gap is a "
            "near-tie (in fp16 the reduction order, so the rounding, changes with the batch a "
            "sequence shares), listed below and not failed. A difference at a larger gap, or "
            "where the reference has no logprobs, fails.",
            o.tie_tolerance));
    if (!r.reference_has_gaps)
      md += " The server returned no top-2 logprobs: any difference fails.";
  }
  if (o.api == "openai") md += " Over the OpenAI API tokens are compared by their streamed text.";
  int unchecked = 0, outputs = 0;
  for (const ConfigResult& c : r.configs) {
    unchecked += c.unchecked;
    outputs += c.requests - c.errors;
  }
  if (unchecked > 0) {
    absl::StrAppend(&md, " ", unchecked, " of ", outputs,
                    " outputs could not be judged (their first visible difference follows a "
                    "token the API named by no text) and are listed as unchecked.");
  }
  return md + "\n\n";
}

// The configurations' precisions, distinct ones in order joined by "; " ("" where none said).
std::string Precisions(const SweepResult& r) {
  std::vector<std::string> seen;
  for (const ConfigResult& c : r.configs) {
    if (!c.precision.empty() && std::find(seen.begin(), seen.end(), c.precision) == seen.end()) {
      seen.push_back(c.precision);
    }
  }
  return absl::StrJoin(seen, "; ");
}

// The table's "correct" cell.
std::string CorrectCell(const ConfigResult& c) {
  if (!c.correct) return absl::StrCat("NO (", c.mismatches, " differ, ", c.errors, " failed)");
  if (c.unchecked > 0 && c.unchecked == c.requests - c.errors) return "not checked";
  if (c.near_ties > 0) return absl::StrCat("yes (", c.near_ties, " near-ties)");
  return "yes";
}

std::string ConfigName(const ConfigResult& c) {
  return absl::StrFormat(
      "%snodes %d%s, %s %g, prompt %d, output %d",
      c.workload == "fixed" ? "" : absl::StrCat(c.workload, ", "), c.nodes,
      c.prefill_nodes > 0 ? absl::StrFormat(" (%d prefill)", c.prefill_nodes) : "",
      c.mode == "closed" ? "batch" : "rate", Load(c), c.prompt_len, c.output_len);
}

// Each configuration's differing outputs, with the reference's gap at the first difference.
std::string DifferencesSection(const SweepResult& r) {
  std::string md;
  for (const ConfigResult& c : r.configs) {
    if (c.differences.empty()) continue;
    absl::StrAppend(&md, "- ", ConfigName(c), ": ", c.near_ties + c.mismatches, " of ", c.requests,
                    " differ (", c.near_ties, " at near-ties).");
    for (const Difference& d : c.differences) {
      const Verdict& v = d.verdict;
      absl::StrAppend(
          &md, absl::StrFormat(
                   " %s: prompt %d%s, token %d, gap %s (`%s` -> `%s`);", AgreementName(v.agreement),
                   d.prompt, d.requests > 1 ? absl::StrFormat(" (x%d)", d.requests) : "",
                   v.position, std::isnan(v.gap) ? "unknown" : absl::StrFormat("%.4g", v.gap),
                   v.reference_token, v.token));
    }
    md += "\n";
  }
  if (md.empty()) return "";
  return "Differing outputs (the first differing token, the reference's top-2 logprob gap there, "
         "the reference's token and this output's):\n\n" +
         md + "\n";
}

std::string Markdown(const SweepResult& r) {
  const SweepOptions& o = r.options;
  std::string md = "# tandem sweep\n\n";
  absl::StrAppend(
      &md, absl::StrFormat(
               "Mode: %s loop, %s scaling, %d measured requests per configuration (%d warm-up), "
               "nodes %s as %s%s.\n\n",
               o.mode, o.weak_scaling ? "weak" : "strong", o.requests, o.warmup,
               absl::StrJoin(o.nodes, ","),
               o.data_parallel  ? "replicas"
               : o.tensor_nodes ? "ranks of one stage (tensor parallel)"
               : o.tensor_parallel > 0
                   ? absl::StrFormat("pipeline stages of %d rank(s) each", o.tensor_parallel)
                   : std::string("pipeline stages"),
               o.prefill_nodes.size() > 1 || o.prefill_nodes.front() > 0
                   ? absl::StrFormat(", of them %s running prompts only (disaggregated prefill; "
                                     "\"nodes\" below says how many)",
                                     absl::StrJoin(o.prefill_nodes, " or "))
                   : ""));
  absl::StrAppend(&md, "Workload: ", DescribeWorkload(o.workload), ".\n\n");
  md += CheckRule(r);
  if (const std::string server = ServerLine(r.server); !server.empty()) {
    absl::StrAppend(&md, server, "\n\n");
  }
  if (const std::string precision = Precisions(r); !precision.empty()) {
    absl::StrAppend(&md, "Precision (the workers' `tandem_worker_precision_info`): ", precision,
                    ".\n\n");
  }
  for (const std::string& w : r.warnings) absl::StrAppend(&md, "**Warning:** ", w, ".\n\n");
  bool gpu = false, near_ties = false;
  for (const ConfigResult& c : r.configs) {
    gpu |= c.has_gpu;
    near_ties |= c.near_ties > 0;
  }
  if (near_ties && gpu) {
    md +=
        "Workers started with `--batch_invariant` make a sequence's logits independent of the "
        "batch it shares, so that their outputs equal the reference's everywhere.\n\n";
  }
  absl::StrAppend(
      &md, absl::StrFormat(
               "| nodes | %s | prompt | output | tokens/s | req/s | TTFT p50/p90/p99 (ms) | "
               "ITL p50/p90/p99 (ms) | E2E p50/p90/p99 (s) | speedup | efficiency | power (W) | "
               "tokens/J | peak GPU mem (GiB) | compute share by stage | correct |\n",
               o.mode == "closed" ? "batch" : "rate (req/s)"));
  md += "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const ConfigResult& c : r.configs) {
    const std::string power = c.has_gpu ? absl::StrFormat("%.1f", c.power_w) : "n/a";
    const std::string tpj = c.has_gpu ? absl::StrFormat("%.2f", c.tokens_per_joule) : "n/a";
    const std::string mem =
        c.has_gpu ? absl::StrFormat("%.2f", c.peak_gpu_memory_bytes / (1024.0 * 1024 * 1024))
                  : "n/a";
    const std::string nodes = c.prefill_nodes > 0
                                  ? absl::StrFormat("%d (%d prefill)", c.nodes, c.prefill_nodes)
                                  : absl::StrCat(c.nodes);
    absl::StrAppend(
        &md, absl::StrFormat(
                 "| %s | %g | %d | %d | %.1f | %.2f | %.1f / %.1f / %.1f | %.1f / %.1f / %.1f | "
                 "%.2f / %.2f / %.2f | %.2f | %.2f | %s | %s | %s | %s | %s |\n",
                 nodes, Load(c), c.prompt_len, c.output_len, c.tokens_per_s, c.requests_per_s,
                 c.ttft_p50 * 1e3, c.ttft_p90 * 1e3, c.ttft_p99 * 1e3, c.itl_p50 * 1e3,
                 c.itl_p90 * 1e3, c.itl_p99 * 1e3, c.e2e_p50, c.e2e_p90, c.e2e_p99, c.speedup,
                 c.efficiency, power, tpj, mem, Shares(c), CorrectCell(c)));
  }
  md +=
      "\nLongest pause within a request's stream (its largest gap between two tokens), over the "
      "requests, p50 / p99 / max (ms):";
  for (const ConfigResult& c : r.configs) {
    absl::StrAppend(
        &md, absl::StrFormat(" %s %g: %.1f / %.1f / %.1f;", o.mode == "closed" ? "batch" : "rate",
                             Load(c), c.pause_p50 * 1e3, c.pause_p99 * 1e3, c.pause_max * 1e3));
  }
  md += "\n\n";
  md += DifferencesSection(r);
  md +=
      "Compute share = compute / (compute + transfer) seconds per stage, from the workers' "
      "`tandem_stage_compute_seconds` and `tandem_stage_transfer_seconds` (receive time includes "
      "waiting for the previous stage).\n\n";
  md +=
      "![throughput](throughput_vs_batch.png) ![latency](latency_vs_batch.png)\n\n"
      "![speedup](speedup_vs_nodes.png) ![efficiency](efficiency_vs_nodes.png)\n\n"
      "![compute vs communication](compute_comm.png)\n";
  return md;
}

// pngcairo where gnuplot has it (gnuplot-nox usually does), else the libgd png terminal.
std::string Terminal() {
  static const std::string t =
      std::system("gnuplot -e 'set terminal pngcairo' >/dev/null 2>&1") == 0
          ? "pngcairo size 900,600 font 'Sans,10'"
          : "png size 900,600";
  return t;
}

absl::Status Plot(const fs::path& dir, const std::string& name, const std::string& script) {
  const fs::path gp = dir / "plots" / (name + ".gp");
  if (absl::Status s = WriteFile(gp, absl::StrCat("set terminal ", Terminal(), "\nset output '",
                                                  (dir / (name + ".png")).string(), "'\n", script));
      !s.ok()) {
    return s;
  }
  const std::string cmd = absl::StrCat("gnuplot '", gp.string(), "' 2>'",
                                       (dir / "plots" / (name + ".log")).string(), "'");
  if (std::system(cmd.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("gnuplot failed on ", gp.string(), "; see ",
                                            (dir / "plots" / (name + ".log")).string()));
  }
  return absl::OkStatus();
}

std::optional<Agreement> AgreementNamed(const std::string& name) {
  for (Agreement a : {Agreement::kIdentical, Agreement::kNearTie, Agreement::kDiffers,
                      Agreement::kNoGap, Agreement::kUnchecked}) {
    if (name == AgreementName(a)) return a;
  }
  return std::nullopt;
}

// Reads results.json's fields with their names in the errors.
class JsonReader {
 public:
  explicit JsonReader(std::string where) : where_(std::move(where)) {}
  template <typename T>
  bool Get(const nlohmann::json& j, const char* key, T* out) {
    if (!status_.ok()) return false;
    auto it = j.find(key);
    if (it == j.end()) {
      status_ = absl::InvalidArgumentError(absl::StrCat(where_, ": field '", key, "' is missing"));
      return false;
    }
    try {
      *out = it->template get<T>();
    } catch (const nlohmann::json::exception& e) {
      status_ = absl::InvalidArgumentError(
          absl::StrCat(where_, ": field '", key, "' has the wrong type (", e.what(), ")"));
      return false;
    }
    return true;
  }
  const nlohmann::json* Object(const nlohmann::json& j, const char* key) {
    if (!status_.ok()) return nullptr;
    auto it = j.find(key);
    if (it == j.end() || !it->is_object()) {
      status_ = absl::InvalidArgumentError(
          absl::StrCat(where_, ": field '", key, "' is missing or not an object"));
      return nullptr;
    }
    return &*it;
  }
  const absl::Status& status() const { return status_; }

 private:
  std::string where_;
  absl::Status status_;
};

// One results.json difference list (`where` names it in errors).
absl::Status ReadDifferences(const nlohmann::json& list, const std::string& where,
                             std::vector<Difference>* out) {
  for (size_t k = 0; list.is_array() && k < list.size(); ++k) {
    JsonReader rd(absl::StrCat(where, ".differences[", k, "]"));
    Difference d;
    std::string verdict;
    rd.Get(list[k], "prompt", &d.prompt);
    rd.Get(list[k], "requests", &d.requests);
    rd.Get(list[k], "verdict", &verdict);
    rd.Get(list[k], "position", &d.verdict.position);
    rd.Get(list[k], "reference_token", &d.verdict.reference_token);
    rd.Get(list[k], "token", &d.verdict.token);
    if (!rd.status().ok()) return rd.status();
    const nlohmann::json& gap = list[k]["reference_top2_gap"];
    if (gap.is_number()) d.verdict.gap = gap.get<double>();
    std::optional<Agreement> a = AgreementNamed(verdict);
    if (!a.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".differences[", k, "]: verdict '", verdict,
                       "' is not one of near-tie, differs, no logprobs"));
    }
    d.verdict.agreement = *a;
    out->push_back(std::move(d));
  }
  return absl::OkStatus();
}

// One entry of results.json's "configs" (`where` names it in errors).
absl::StatusOr<ConfigResult> ReadConfig(const nlohmann::json& cj, const std::string& where) {
  JsonReader rc(where);
  ConfigResult c;
  rc.Get(cj, "nodes", &c.nodes);
  rc.Get(cj, "stages", &c.stages);
  rc.Get(cj, "replicas", &c.replicas);
  if (cj.contains("prefill_nodes")) rc.Get(cj, "prefill_nodes", &c.prefill_nodes);
  rc.Get(cj, "mode", &c.mode);
  rc.Get(cj, "batch", &c.batch);
  rc.Get(cj, "rate", &c.rate);
  if (cj.contains("workload")) rc.Get(cj, "workload", &c.workload);
  rc.Get(cj, "prompt_len", &c.prompt_len);
  rc.Get(cj, "output_len", &c.output_len);
  rc.Get(cj, "requests", &c.requests);
  rc.Get(cj, "errors", &c.errors);
  rc.Get(cj, "wall_s", &c.wall_s);
  rc.Get(cj, "tokens", &c.tokens);
  rc.Get(cj, "tokens_per_s", &c.tokens_per_s);
  rc.Get(cj, "requests_per_s", &c.requests_per_s);
  for (auto [key, p50, p90, p99] : {std::tuple{"ttft_s", &c.ttft_p50, &c.ttft_p90, &c.ttft_p99},
                                    std::tuple{"itl_s", &c.itl_p50, &c.itl_p90, &c.itl_p99},
                                    std::tuple{"e2e_s", &c.e2e_p50, &c.e2e_p90, &c.e2e_p99}}) {
    if (const nlohmann::json* q = rc.Object(cj, key)) {
      rc.Get(*q, "p50", p50);
      rc.Get(*q, "p90", p90);
      rc.Get(*q, "p99", p99);
    }
  }
  if (cj.contains("pause_s")) {  // absent from results written before it was recorded
    if (const nlohmann::json* q = rc.Object(cj, "pause_s")) {
      rc.Get(*q, "p50", &c.pause_p50);
      rc.Get(*q, "p99", &c.pause_p99);
      rc.Get(*q, "max", &c.pause_max);
    }
  }
  rc.Get(cj, "speedup", &c.speedup);
  rc.Get(cj, "efficiency", &c.efficiency);
  rc.Get(cj, "has_gpu", &c.has_gpu);
  rc.Get(cj, "energy_j", &c.energy_j);
  rc.Get(cj, "power_w", &c.power_w);
  rc.Get(cj, "tokens_per_joule", &c.tokens_per_joule);
  rc.Get(cj, "peak_gpu_memory_bytes", &c.peak_gpu_memory_bytes);
  if (cj.contains("precision")) rc.Get(cj, "precision", &c.precision);  // recorded since 2026-11
  if (cj.contains("tensor_parallel")) rc.Get(cj, "tensor_parallel", &c.tensor_parallel);
  rc.Get(cj, "correct", &c.correct);
  rc.Get(cj, "mismatches", &c.mismatches);
  // Absent from results written before outputs were judged by the agreement rule.
  if (cj.contains("near_ties")) rc.Get(cj, "near_ties", &c.near_ties);
  if (cj.contains("unchecked")) rc.Get(cj, "unchecked", &c.unchecked);
  if (cj.contains("differences")) {
    nlohmann::json list;
    rc.Get(cj, "differences", &list);
    if (absl::Status st = ReadDifferences(list, where, &c.differences); !st.ok()) return st;
  }
  if (const nlohmann::json* st = rc.Object(cj, "stages_time")) {
    for (const auto& [stage, v] : st->items()) {
      int index = -1;
      if (!absl::SimpleAtoi(stage, &index) || index < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": stage '", stage, "' is not a stage index"));
      }
      StageShare& share = c.stage_share[index];
      rc.Get(v, "compute_s", &share.compute_s);
      rc.Get(v, "transfer_s", &share.transfer_s);
      rc.Get(v, "transfer_bytes", &share.bytes);
    }
  }
  if (!rc.status().ok()) return rc.status();
  return c;
}

void ReadOptions(JsonReader& read, const nlohmann::json& oj, SweepOptions& o) {
  std::string scaling;
  read.Get(oj, "coordinator", &o.coordinator);
  read.Get(oj, "worker_metrics", &o.worker_metrics);
  read.Get(oj, "nodes", &o.nodes);
  read.Get(oj, "data_parallel", &o.data_parallel);
  if (oj.contains("tensor_nodes")) read.Get(oj, "tensor_nodes", &o.tensor_nodes);
  if (oj.contains("tensor_parallel")) read.Get(oj, "tensor_parallel", &o.tensor_parallel);
  if (oj.contains("prefill_nodes")) read.Get(oj, "prefill_nodes", &o.prefill_nodes);
  if (o.prefill_nodes.empty()) o.prefill_nodes = {0};
  read.Get(oj, "mode", &o.mode);
  read.Get(oj, "batch", &o.batch);
  read.Get(oj, "rates", &o.rates);
  read.Get(oj, "prompt_lens", &o.prompt_lens);
  read.Get(oj, "output_lens", &o.output_lens);
  read.Get(oj, "requests", &o.requests);
  read.Get(oj, "scaling", &scaling);
  read.Get(oj, "warmup", &o.warmup);
  read.Get(oj, "prompt_pool", &o.prompt_pool);
  // Run folders from before workloads were recorded sent fixed lengths.
  if (oj.contains("workload")) {
    read.Get(oj, "workload", &o.workload.kind);
    read.Get(oj, "length_sigma", &o.workload.length_sigma);
    read.Get(oj, "shared_prefix_len", &o.workload.shared_prefix_len);
  }
  read.Get(oj, "seed", &o.seed);
  if (oj.contains("tie_tolerance")) read.Get(oj, "tie_tolerance", &o.tie_tolerance);
  if (oj.contains("check")) read.Get(oj, "check", &o.check);
  o.weak_scaling = scaling == "weak";
}

// Run folders from before the server's settings were recorded have no "server".
void ReadServer(JsonReader& read, const nlohmann::json& sj, ServedModel& m) {
  read.Get(sj, "model", &m.name);
  read.Get(sj, "model_dir", &m.model_dir);
  read.Get(sj, "architecture", &m.architecture);
  read.Get(sj, "dtype", &m.dtype);
  // Runs from before the KV-cache's dtype was recorded have none.
  if (sj.contains("kv_cache_dtype")) read.Get(sj, "kv_cache_dtype", &m.kv_cache_dtype);
  read.Get(sj, "num_layers", &m.num_layers);
  read.Get(sj, "context_length", &m.context_length);
  read.Get(sj, "vocab_size", &m.vocab_size);
  read.Get(sj, "max_slots", &m.max_slots);
  read.Get(sj, "max_batch", &m.max_batch);
  read.Get(sj, "stages", &m.stages);
  read.Get(sj, "replicas", &m.replicas);
}

// The sweep's configurations along the plots' axes (first prompt/output length pair).
struct PlotAxes {
  std::set<int> nodes;
  std::set<double> loads;
};

// Data files for gnuplot under `data`: one block per node count (vs load) and per load (vs
// nodes), and the per-stage compute/transfer bars, for the first prompt/output length pair.
absl::StatusOr<PlotAxes> WritePlotData(const SweepResult& r, const fs::path& data) {
  const SweepOptions& o = r.options;
  const int p0 = o.prompt_lens.front(), g0 = o.output_lens.front();
  PlotAxes axes;
  std::set<int>& nodes = axes.nodes;
  std::set<double>& loads = axes.loads;
  for (const ConfigResult& c : r.configs) {
    if (c.prompt_len != p0 || c.output_len != g0) continue;
    nodes.insert(c.nodes);
    loads.insert(Load(c));
  }
  std::ostringstream by_load, by_nodes, shares;
  for (int n : nodes) {
    by_load << "# nodes " << n << "\n";
    for (const ConfigResult& c : r.configs) {
      if (c.nodes != n || c.prompt_len != p0 || c.output_len != g0) continue;
      by_load << Load(c) << ' ' << c.tokens_per_s << ' ' << c.ttft_p50 * 1e3 << ' '
              << c.itl_p50 * 1e3 << ' ' << c.e2e_p50 << ' ' << c.e2e_p99 << '\n';
    }
    by_load << "\n\n";
  }
  for (double l : loads) {
    by_nodes << "# load " << l << "\n";
    for (const ConfigResult& c : r.configs) {
      if (Load(c) != l || c.prompt_len != p0 || c.output_len != g0) continue;
      by_nodes << c.nodes << ' ' << c.speedup << ' ' << c.efficiency << '\n';
    }
    by_nodes << "\n\n";
  }
  // One bar group per configuration and stage: compute and transfer seconds.
  int row = 0;
  for (const ConfigResult& c : r.configs) {
    if (c.prompt_len != p0 || c.output_len != g0) continue;
    for (const auto& [stage, s] : c.stage_share) {
      shares << row++ << " \"n" << c.nodes << (c.mode == "closed" ? " b" : " r") << Load(c) << " s"
             << stage << "\" " << s.compute_s << ' ' << s.transfer_s << '\n';
    }
  }
  if (row == 0) shares << "0 \"none\" 0 0\n";
  if (absl::Status s = WriteFile(data / "by_load.dat", by_load.str()); !s.ok()) return s;
  if (absl::Status s = WriteFile(data / "by_nodes.dat", by_nodes.str()); !s.ok()) return s;
  if (absl::Status s = WriteFile(data / "stage_time.dat", shares.str()); !s.ok()) return s;
  return axes;
}

// The gnuplot charts of the data files WritePlotData wrote under dir/plots.
absl::Status DrawPlots(const SweepResult& r, const PlotAxes& axes) {
  const SweepOptions& o = r.options;
  const fs::path dir = o.out, data = dir / "plots";
  const std::set<int>& nodes = axes.nodes;
  const std::set<double>& loads = axes.loads;
  const std::string xload =
      o.mode == "closed" ? "batch size (requests in flight)" : "offered load (requests/s)";
  const std::string log_x = o.mode == "closed" ? "set logscale x 2\n" : "";
  auto per_block = [](const fs::path& file, const std::string& cols, const std::string& prefix,
                      int blocks, const std::vector<std::string>& titles) {
    std::string s = "plot ";
    for (int b = 0; b < blocks; ++b) {
      absl::StrAppend(&s, b ? ", " : "", "'", file.string(), "' index ", b, " using ", cols,
                      " with linespoints lw 2 pt 7 title '", prefix, titles[b], "'");
    }
    return s + "\n";
  };
  std::vector<std::string> node_titles, load_titles;
  for (int n : nodes) node_titles.push_back(absl::StrCat(n));
  for (double l : loads) load_titles.push_back(absl::StrFormat("%g", l));
  const int nb = static_cast<int>(nodes.size()), lb = static_cast<int>(loads.size());
  if (nb == 0) return absl::OkStatus();
  const fs::path bl = data / "by_load.dat", bn = data / "by_nodes.dat";
  if (absl::Status s =
          Plot(dir, "throughput_vs_batch",
               absl::StrCat("set title 'Throughput'\nset xlabel '", xload,
                            "'\nset ylabel 'generated tokens/s'\nset grid\n", log_x,
                            "set key top left\n", per_block(bl, "1:2", "nodes=", nb, node_titles)));
      !s.ok()) {
    return s;
  }
  std::string lat =
      absl::StrCat("set title 'Latency (p50)'\nset xlabel '", xload,
                   "'\nset ylabel 'milliseconds'\nset grid\n", log_x, "set key top left\nplot ");
  {
    int b = 0;
    for (int n : nodes) {
      absl::StrAppend(&lat, b ? ", " : "", "'", bl.string(), "' index ", b,
                      " using 1:3 with linespoints lw 2 pt 7 title 'TTFT nodes=", n, "', '",
                      bl.string(), "' index ", b,
                      " using 1:4 with linespoints lw 2 pt 5 dt 2 title 'ITL nodes=", n, "'");
      ++b;
    }
    lat += "\n";
  }
  if (absl::Status s = Plot(dir, "latency_vs_batch", lat); !s.ok()) return s;
  if (absl::Status s = Plot(dir, "speedup_vs_nodes",
                            absl::StrCat("set title 'Speedup over ", o.nodes.front(),
                                         " node(s)'\nset xlabel 'nodes'\nset ylabel 'speedup'\n"
                                         "set grid\nset key top left\nset xtics 1\n",
                                         per_block(bn, "1:2", "load=", lb, load_titles)));
      !s.ok()) {
    return s;
  }
  if (absl::Status s = Plot(dir, "efficiency_vs_nodes",
                            absl::StrCat("set title 'Parallel efficiency'\nset xlabel 'nodes'\n"
                                         "set ylabel 'efficiency'\nset yrange [0:*]\nset grid\n"
                                         "set key bottom left\nset xtics 1\n",
                                         per_block(bn, "1:3", "load=", lb, load_titles)));
      !s.ok()) {
    return s;
  }
  return Plot(dir, "compute_comm",
              absl::StrCat("set title 'Per-stage time: compute vs communication'\n"
                           "set style data histograms\nset style histogram rowstacked\n"
                           "set style fill solid 0.8 border -1\nset boxwidth 0.8\n"
                           "set ylabel 'seconds'\nset xtics rotate by -45\nset key top left\n"
                           "plot '",
                           (data / "stage_time.dat").string(),
                           "' using 3:xtic(2) title 'compute', '' using 4 title 'transfer'\n"));
}

// `bytes` as "N MiB" where it is a whole number of MiB, else as "N bytes".
std::string ByteCount(uintmax_t bytes) {
  constexpr uintmax_t kMiB = uintmax_t{1} << 20;
  if (bytes > 0 && bytes % kMiB == 0) return absl::StrCat(bytes / kMiB, " MiB");
  return absl::StrCat(bytes, " bytes");
}

}  // namespace

// A JSON file of a run folder: NOT_FOUND where it cannot be read; INVALID_ARGUMENT naming it when
// it is larger than `max_bytes` (naming the limit), nests deeper than kMaxJsonDepth, or is not
// JSON.
absl::StatusOr<nlohmann::json> ReadJsonFile(const fs::path& path, uintmax_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path.string()));
  std::error_code ec;
  const uintmax_t size = fs::file_size(path, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat(path.string(), ": ", ec.message()));
  if (size > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        path.string(), " is ", size, " bytes, larger than the limit of ", ByteCount(max_bytes)));
  }
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  RETURN_IF_ERROR(CheckJsonDepth(text, path.string()));
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), " is not JSON: ", e.what()));
  }
}

// The run folder's accuracy.json, where there is one (nullopt where not): {"agreement":
// {"kl_mean", "top1_agreement", ...}} as tandem-bench --agreement --json writes it, and/or
// {"perplexity": number}. At most kMaxAccuracyJsonBytes.
absl::StatusOr<std::optional<RunAccuracy>> ReadAccuracy(const fs::path& dir) {
  const fs::path path = dir / "accuracy.json";
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::optional<RunAccuracy>();
  ASSIGN_OR_RETURN(const nlohmann::json j, ReadJsonFile(path, kMaxAccuracyJsonBytes));
  if (!j.is_object() || (!j.contains("agreement") && !j.contains("perplexity"))) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(),
                     ": expected an object with \"agreement\" (tandem-bench --agreement --json) "
                     "or \"perplexity\""));
  }
  RunAccuracy a;
  JsonReader read(path.string());
  if (j.contains("agreement")) {
    if (const nlohmann::json* ag = read.Object(j, "agreement")) {
      read.Get(*ag, "kl_mean", &a.kl_mean);
      read.Get(*ag, "top1_agreement", &a.top1_agreement);
    }
  }
  if (j.contains("perplexity")) read.Get(j, "perplexity", &a.perplexity);
  if (!read.status().ok()) return read.status();
  return std::optional<RunAccuracy>(a);
}

absl::StatusOr<SweepResult> ReadResults(const fs::path& dir, uintmax_t max_results_bytes) {
  const fs::path path = dir / "results.json";
  ASSIGN_OR_RETURN(const nlohmann::json j, ReadJsonFile(path, max_results_bytes));
  if (!j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), " is not a JSON object"));
  }
  SweepResult r;
  JsonReader read(path.string());
  SweepOptions& o = r.options;
  o.out = dir;
  if (const nlohmann::json* oj = read.Object(j, "options")) ReadOptions(read, *oj, o);
  if (j.contains("server")) {
    if (const nlohmann::json* sj = read.Object(j, "server")) ReadServer(read, *sj, r.server);
  }
  if (j.contains("warnings")) read.Get(j, "warnings", &r.warnings);
  read.Get(j, "all_correct", &r.all_correct);
  if (j.contains("reference_has_gaps")) read.Get(j, "reference_has_gaps", &r.reference_has_gaps);
  nlohmann::json configs;
  read.Get(j, "configs", &configs);
  if (!read.status().ok()) return read.status();
  if (!configs.is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": 'configs' is not an array"));
  }
  for (size_t i = 0; i < configs.size(); ++i) {
    absl::StatusOr<ConfigResult> c =
        ReadConfig(configs[i], absl::StrCat(path.string(), " configs[", i, "]"));
    if (!c.ok()) return c.status();
    r.configs.push_back(*std::move(c));
  }
  if (o.nodes.empty() || o.prompt_lens.empty() || o.output_lens.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(),
                     ": options need at least one node count, prompt and output "
                     "length"));
  }
  ASSIGN_OR_RETURN(r.accuracy, ReadAccuracy(dir));
  return r;
}

absl::Status WriteReport(const SweepResult& r) {
  const fs::path dir = r.options.out;
  std::error_code ec;
  fs::create_directories(dir / "plots", ec);
  if (ec)
    return absl::InternalError(absl::StrCat("cannot create ", dir.string(), ": ", ec.message()));
  if (absl::Status s = WriteFile(dir / "results.csv", Csv(r)); !s.ok()) return s;
  if (absl::Status s = WriteFile(dir / "results.json", Json(r).dump(2) + "\n"); !s.ok()) return s;
  if (absl::Status s = WriteFile(dir / "summary.md", Markdown(r)); !s.ok()) return s;

  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    std::fprintf(stderr, "warning: gnuplot is not installed; the run folder has no plots\n");
    return absl::OkStatus();
  }
  absl::StatusOr<PlotAxes> axes = WritePlotData(r, dir / "plots");
  if (!axes.ok()) return axes.status();
  return DrawPlots(r, *axes);
}

std::string CompareRuns(const std::vector<SweepResult>& runs) {
  std::string md =
      "| run | precision | KV-cache | nodes | layout | load | prompt | output | tokens/s | vs "
      "first run | "
      "TTFT p50 (ms) | ITL p50 (ms) | power (W) | tokens/J | peak GPU mem (GiB) | correct | "
      "KL vs fp16 (nats) | top-1 vs fp16 | perplexity |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  // The first run's configuration of the same nodes, load, workload and lengths.
  auto baseline = [&](const ConfigResult& c) -> const ConfigResult* {
    if (runs.empty()) return nullptr;
    for (const ConfigResult& b : runs.front().configs) {
      if (b.nodes == c.nodes && b.prefill_nodes == c.prefill_nodes && b.mode == c.mode &&
          Load(b) == Load(c) && b.workload == c.workload && b.prompt_len == c.prompt_len &&
          b.output_len == c.output_len) {
        return &b;
      }
    }
    return nullptr;
  };
  for (const SweepResult& r : runs) {
    const std::string name = r.options.out.filename().empty()
                                 ? r.options.out.parent_path().filename().string()
                                 : r.options.out.filename().string();
    const std::string kv = r.server.kv_cache_dtype.empty() ? "n/a" : r.server.kv_cache_dtype;
    const RunAccuracy acc = r.accuracy.value_or(RunAccuracy{});
    const std::string kl = std::isnan(acc.kl_mean) ? "n/a" : absl::StrFormat("%.3g", acc.kl_mean);
    const std::string top1 = std::isnan(acc.top1_agreement)
                                 ? "n/a"
                                 : absl::StrFormat("%.1f%%", 100 * acc.top1_agreement);
    const std::string perplexity =
        std::isnan(acc.perplexity) ? "n/a" : absl::StrFormat("%.4f", acc.perplexity);
    const std::string accuracy = absl::StrCat(kl, " | ", top1, " | ", perplexity);
    for (const ConfigResult& c : r.configs) {
      const ConfigResult* b = baseline(c);
      const std::string ratio = b != nullptr && b->tokens_per_s > 0
                                    ? absl::StrFormat("%.2fx", c.tokens_per_s / b->tokens_per_s)
                                    : "n/a";
      const std::string layout =
          absl::StrCat(c.stages, c.stages == 1 ? " stage x " : " stages x ", c.replicas,
                       c.replicas == 1 ? " replica" : " replicas",
                       c.tensor_parallel > 1 ? absl::StrCat(", TP", c.tensor_parallel) : "");
      const std::string load =
          absl::StrFormat("%s %g%s", c.mode == "closed" ? "batch" : "rate", Load(c),
                          c.workload == "fixed" ? "" : absl::StrCat(" (", c.workload, ")"));
      absl::StrAppend(
          &md,
          absl::StrFormat(
              "| %s | %s | %s | %d | %s | %s | %d | %d | %.1f | %s | %.1f | %.1f | %s | %s | %s | "
              "%s | %s |\n",
              name, c.precision.empty() ? "not reported" : c.precision, kv, c.nodes, layout, load,
              c.prompt_len, c.output_len, c.tokens_per_s, ratio, c.ttft_p50 * 1e3, c.itl_p50 * 1e3,
              c.has_gpu ? absl::StrFormat("%.1f", c.power_w) : "n/a",
              c.has_gpu ? absl::StrFormat("%.2f", c.tokens_per_joule) : "n/a",
              c.has_gpu ? absl::StrFormat("%.2f", c.peak_gpu_memory_bytes / (1024.0 * 1024 * 1024))
                        : "n/a",
              CorrectCell(c), accuracy));
    }
  }
  return md;
}

}  // namespace tandem::loadgen
