// What a sweep needs of the service it loads: the model's limits, the layout that serves and a
// change of it, and one streamed generation measured as it arrives. Two implementations: tandem's
// gRPC API (grpc_client.cc) and any OpenAI-compatible HTTP server (openai_client.cc).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/security/credentials.h"

namespace tandem::loadgen {

struct ServedModel {
  int vocab_size = 0;      // token ids of the generated prompts are below this (0: not said)
  int context_length = 0;  // prompt + output must fit (0: not said)
  // What the server says of itself, recorded with the results ("" or 0: it did not say).
  std::string name;  // the model's name (OpenAI's id; over gRPC, its folder's name)
  std::string model_dir;
  std::string architecture;
  std::string dtype;  // the checkpoint's weight type
  std::string kv_cache_dtype;  // --kv_cache_dtype: "auto" or "fp8_e4m3"
  int num_layers = 0;
  int max_slots = 0;  // KV-cache slots per pipeline: sequences one pipeline runs at once
  int max_batch = 0;  // sequences in one step
  int stages = 0;     // the topology that served when the sweep began
  int replicas = 0;
};

struct RequestRecord {
  bool ok = false;
  std::string error;
  int num_tokens = 0;         // generated
  // What the correctness check compares: each generated token as the API names it (its id over
  // gRPC; its streamed text over an OpenAI-compatible API, one chunk per token).
  std::vector<std::string> tokens;
  // With top_logprobs asked for: at each token, the top-2 logprob gap there (NaN where the
  // server gave fewer than two).
  std::vector<double> top2_gaps;
  // With top_logprobs asked for over an OpenAI-compatible API: at each token, whether it has no
  // text of its own (an id the model's tokenizer does not decode), so that a difference there
  // cannot be seen in the text.
  std::vector<bool> unnamed;
  double ttft = 0;            // seconds from sending to the first token
  double e2e = 0;             // seconds from sending to the end
  std::vector<double> gaps;   // between consecutive tokens, seconds (a message of k tokens: k)
};

// A layout of the service: stages x replicas, `prefill` of the replicas running prompts only.
struct Layout {
  int stages = 1;
  int replicas = 1;
  int prefill = 0;
  // Ranks per stage (0: each worker's own); unset: as the service has it (SetTopology leaves it).
  std::optional<int> tensor_parallel;
  bool operator==(const Layout&) const = default;
};

class LoadClient {
 public:
  virtual ~LoadClient() = default;
  virtual absl::StatusOr<ServedModel> Info() = 0;
  // The layout the service was asked for (Admin.GetTopology); UNIMPLEMENTED where the API has no
  // way to tell, as an OpenAI server without tandem's Admin.
  virtual absl::StatusOr<Layout> GetLayout() = 0;
  // Sets the layout and waits until exactly that serves. A service that cannot serve it (a
  // worker refused its stage, too few workers once they had time to register) fails at once with
  // the coordinator's reason.
  virtual absl::Status SetTopology(const Layout& layout) = 0;
  // Generates `output_len` tokens (EOS ignored, greedy) after the token-id `prompt`, streamed,
  // over the client's connection number `connection` (from 0): each number a connection of its
  // own, as separate users would have, where the API multiplexes requests over one (gRPC: a
  // channel of its own); over HTTP every request opens its own. `top_logprobs` > 0 asks for that
  // many most likely tokens at each position (RequestRecord.top2_gaps); 0: none.
  virtual RequestRecord Generate(const std::vector<int32_t>& prompt, int output_len, int connection,
                                 int top_logprobs) = 0;
};

// tandem's gRPC API at host:port; `inference` (TLS and the api key) for Inference calls, `admin`
// (TLS and the admin key) for Admin calls.
std::unique_ptr<LoadClient> NewGrpcClient(const std::string& address, double timeout_s,
                                          const ClientAuth& inference = {},
                                          const ClientAuth& admin = {});

// An OpenAI-compatible server at http://host:port: streamed /v1/completions with token-id
// prompts, ignore_eos (vLLM's and tandem's extension) and stream_options.include_usage. `model`:
// the model to name ("": the first /v1/models lists). `admin`: tandem's gRPC address for topology
// changes and the vocabulary ("": none; only the topology that serves can be measured).
// `inference.key`: the api key sent as the Bearer token; both auths also reach the gRPC admin.
// `ca_file`: for an https:// base_url, the PEM roots to verify the server by ("": the system's).
std::unique_ptr<LoadClient> NewOpenAiClient(const std::string& base_url, const std::string& model,
                                            const std::string& admin, double timeout_s,
                                            const ClientAuth& inference = {},
                                            const ClientAuth& admin_auth = {},
                                            const std::string& ca_file = "");

}  // namespace tandem::loadgen
