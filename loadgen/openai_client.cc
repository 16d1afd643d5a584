// The sweep's client of an OpenAI-compatible server: streamed /v1/completions read as
// server-sent events, each chunk with text or not counted as one token (as OpenAI, vLLM and
// tandem send them), the count checked against the usage the stream ends with.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/httplib.h"
#include "loadgen/load_client.h"
#include "nlohmann/json.hpp"

namespace tandem::loadgen {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double Since(Clock::time_point t0, Clock::time_point t) {
  return std::chrono::duration<double>(t - t0).count();
}

// The most likely token's logprob minus the second's, from a completions chunk's
// `logprobs.top_logprobs[0]` ({token text: logprob}); NaN with fewer than two (also where two
// tokens have the same text, which the object's keys cannot tell apart).
double Top2Gap(const json& choice) {
  const json* lp = choice.contains("logprobs") ? &choice["logprobs"] : nullptr;
  if (lp == nullptr || !lp->is_object() || !lp->contains("top_logprobs")) return std::nan("");
  const json& top = (*lp)["top_logprobs"];
  if (!top.is_array() || top.empty() || !top[0].is_object()) return std::nan("");
  std::vector<double> values;
  for (const auto& [token, logprob] : top[0].items()) {
    if (logprob.is_number()) values.push_back(logprob.get<double>());
  }
  if (values.size() < 2) return std::nan("");
  std::partial_sort(values.begin(), values.begin() + 2, values.end(), std::greater<>());
  return values[0] - values[1];
}

// A completions chunk's `logprobs.tokens[0]`: the token's own text ("" where absent).
std::string TokenText(const json& choice) {
  auto lp = choice.find("logprobs");
  if (lp == choice.end() || !lp->is_object()) return "";
  auto tokens = lp->find("tokens");
  if (tokens == lp->end() || !tokens->is_array() || tokens->empty()) return "";
  return (*tokens)[0].is_string() ? (*tokens)[0].get<std::string>() : "";
}

// A chunk's `token_ids` (vLLM's return_token_ids) as "id,id,...", as the gRPC client names
// tokens; nullopt when the server sent none.
std::optional<std::string> TokenIds(const json& choice) {
  auto ids = choice.find("token_ids");
  if (ids == choice.end() || !ids->is_array() || ids->empty()) return std::nullopt;
  std::vector<int64_t> values;
  for (const json& id : *ids) {
    if (!id.is_number_integer()) return std::nullopt;
    values.push_back(id.get<int64_t>());
  }
  return absl::StrJoin(values, ",");
}

class OpenAiClient final : public LoadClient {
 public:
  OpenAiClient(std::string base_url, std::string model, std::unique_ptr<LoadClient> admin,
               double timeout_s, std::string api_key, std::string ca_file)
      : base_url_(std::move(base_url)), model_(std::move(model)), admin_(std::move(admin)),
        timeout_s_(timeout_s), api_key_(std::move(api_key)), ca_file_(std::move(ca_file)) {}

  absl::StatusOr<ServedModel> Info() override {
    httplib::Client http(base_url_);
    Authorize(http);
    http.set_connection_timeout(10);
    http.set_read_timeout(10);
    httplib::Result res = http.Get("/v1/models");
    if (!res) {
      return absl::UnavailableError(absl::StrCat(base_url_, "/v1/models: ",
                                                 httplib::to_string(res.error())));
    }
    if (res->status != 200) {
      return absl::UnavailableError(
          absl::StrCat(base_url_, "/v1/models: HTTP ", res->status, ": ", res->body));
    }
    json models = json::parse(res->body, nullptr, false);
    if (models.is_discarded() || !models.contains("data") || !models["data"].is_array() ||
        models["data"].empty()) {
      return absl::UnavailableError(absl::StrCat(base_url_, "/v1/models: no models listed"));
    }
    const json* entry = &models["data"][0];
    for (const json& m : models["data"]) {
      if (m.value("id", "") == model_) entry = &m;
    }
    if (model_.empty()) model_ = entry->value("id", "");
    ServedModel out;
    // vLLM's and tandem's fields; 0 where the server does not say.
    auto integer = [&](const char* key) {
      auto it = entry->find(key);
      return it != entry->end() && it->is_number_integer() ? it->get<int>() : 0;
    };
    out.context_length = integer("max_model_len");
    out.vocab_size = integer("vocab_size");
    if (admin_ != nullptr) {
      absl::StatusOr<ServedModel> grpc = admin_->Info();
      if (!grpc.ok()) return grpc.status();
      out = *grpc;
    }
    out.name = model_;
    return out;
  }

  absl::StatusOr<Layout> GetLayout() override {
    if (admin_ != nullptr) return admin_->GetLayout();
    return absl::UnimplementedError("an OpenAI server's layout is read through --admin only");
  }

  absl::Status SetTopology(const Layout& l) override {
    if (admin_ != nullptr) return admin_->SetTopology(l);
    if (l.stages == 1 && l.replicas == 1 && l.tensor_parallel.value_or(0) == 0) {
      return absl::OkStatus();  // what serves is measured
    }
    return absl::FailedPreconditionError(
        "--nodes above 1 needs tandem's gRPC Admin (--admin HOST:PORT) to re-partition");
  }

  RequestRecord Generate(const std::vector<int32_t>& prompt, int output_len, int /*connection*/,
                         int top_logprobs) override {
    RequestRecord rec;
    httplib::Client http(base_url_);
    Authorize(http);
    const auto timeout = static_cast<time_t>(timeout_s_ + 1);
    http.set_connection_timeout(10);
    http.set_read_timeout(timeout);
    http.set_write_timeout(timeout);
    json body = {{"model", model_},
                 {"prompt", prompt},
                 {"max_tokens", output_len},
                 {"ignore_eos", true},
                 {"temperature", 0},
                 {"stream", true},
                 {"stream_options", {{"include_usage", true}}}};
    // vLLM's extensions, which tandem serves too: each chunk's token ids, and logprobs that name
    // tokens by id, so that tokens without text (or with the same text) stay apart. A server
    // without them leaves them out, and the text is compared instead.
    body["return_token_ids"] = true;
    if (top_logprobs > 0) {
      body["logprobs"] = top_logprobs;
      body["return_tokens_as_token_ids"] = true;
    }
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/completions";
    req.set_header("Content-Type", "application/json");
    req.set_header("Accept", "text/event-stream");
    req.body = body.dump();
    std::string buffer;
    int chunks = 0;
    int usage_tokens = -1;
    std::string error;
    const auto t0 = Clock::now();
    auto last = t0;
    // One event at a time from the bytes received so far.
    auto take_events = [&] {
      size_t end;
      while ((end = buffer.find("\n\n")) != std::string::npos) {
        std::string event = buffer.substr(0, end);
        buffer.erase(0, end + 2);
        absl::string_view data(event);
        if (!absl::ConsumePrefix(&data, "data: ")) continue;  // comments, other fields
        if (data == "[DONE]") continue;
        const json chunk = json::parse(data.begin(), data.end(), nullptr, false);
        if (chunk.is_discarded()) {
          error = absl::StrCat("not JSON: ", event);
          continue;
        }
        if (chunk.contains("error")) error = chunk["error"].dump();
        if (chunk.contains("usage") && chunk["usage"].is_object()) {
          usage_tokens = chunk["usage"].value("completion_tokens", -1);
        }
        if (!chunk.contains("choices") || !chunk["choices"].is_array()) continue;
        for (const json& c : chunk["choices"]) {
          const auto now = Clock::now();
          if (chunks == 0) {
            rec.ttft = Since(t0, now);
          } else {
            rec.gaps.push_back(Since(last, now));
          }
          last = now;
          ++chunks;
          rec.tokens.push_back(TokenIds(c).value_or(
              c.contains("text") && c["text"].is_string() ? c["text"].get<std::string>() : ""));
          if (top_logprobs > 0) {
            rec.top2_gaps.push_back(Top2Gap(c));
            rec.unnamed.push_back(TokenText(c).empty());
          }
        }
      }
    };
    req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
      buffer.append(data, len);
      take_events();
      return true;
    };
    httplib::Response res;
    httplib::Error err = httplib::Error::Success;
    const bool sent = http.send(req, res, err);
    rec.e2e = Since(t0, Clock::now());
    if (!sent) {
      rec.error = httplib::to_string(err);
      return rec;
    }
    if (res.status != 200) {
      rec.error = absl::StrCat("HTTP ", res.status, ": ", buffer);
      return rec;
    }
    rec.num_tokens = usage_tokens >= 0 ? usage_tokens : chunks;
    rec.ok = error.empty();
    rec.error = error;
    return rec;
  }

 private:
  const std::string base_url_;
  std::string model_;
  const std::unique_ptr<LoadClient> admin_;
  const double timeout_s_;
  const std::string api_key_;  // the Bearer token; empty: none
  const std::string ca_file_;  // https: the roots to verify the server by; empty: the system's

  // The key and, for https, the trust roots of every request.
  void Authorize(httplib::Client& http) const {
    if (!api_key_.empty()) http.set_bearer_token_auth(api_key_);
    if (!ca_file_.empty()) http.set_ca_cert_path(ca_file_.c_str());
  }
};

}  // namespace

std::unique_ptr<LoadClient> NewOpenAiClient(const std::string& base_url, const std::string& model,
                                            const std::string& admin, double timeout_s,
                                            const ClientAuth& inference,
                                            const ClientAuth& admin_auth,
                                            const std::string& ca_file) {
  return std::make_unique<OpenAiClient>(
      base_url, model,
      admin.empty() ? nullptr : NewGrpcClient(admin, timeout_s, inference, admin_auth), timeout_s,
      inference.key, ca_file);
}

}  // namespace tandem::loadgen
