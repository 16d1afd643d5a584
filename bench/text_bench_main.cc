// tandem-text-bench: what the coordinator spends on the text of a generation, token by token, on
// one core: the whole list of ids decoded again for each new one (as the text streams and stop
// strings were once followed), against DecodeStream (common/decode_stream.h) and StopText
// (coordinator/stop_rules.h), which decode a few ids per token. Prints one row per length.
// usage: tandem-text-bench --tokenizer DIR_OR_TOKENIZER_JSON [--tokens 256,2000,8000]
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/flags_usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/decode_stream.h"
#include "common/tokenizer.h"
#include "coordinator/stop_rules.h"

ABSL_FLAG(std::string, tokenizer, "", "a model folder or a tokenizer.json");
ABSL_FLAG(std::string, tokens, "256,2000,8000", "generation lengths, comma-separated");

namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

}  // namespace

int main(int argc, char** argv) {
  tandem::ParseFlags(argc, argv);
  const std::filesystem::path path = absl::GetFlag(FLAGS_tokenizer);
  auto tok = std::filesystem::is_directory(path) ? tandem::Tokenizer::FromDir(path)
                                                 : tandem::Tokenizer::FromTokenizerJson(path);
  if (!tok.ok()) {
    std::fprintf(stderr, "tandem-text-bench: %s\n", tok.status().ToString().c_str());
    return 1;
  }
  std::vector<int> lengths;
  const std::vector<std::string> parts = absl::StrSplit(absl::GetFlag(FLAGS_tokens), ',');
  for (const std::string& v : parts) {
    int n = 0;
    if (!absl::SimpleAtoi(v, &n) || n < 1) {
      std::fprintf(stderr, "tandem-text-bench: --tokens: '%s' is not a positive count\n",
                   v.c_str());
      return 1;
    }
    lengths.push_back(n);
  }
  // English prose with numbers, punctuation and a few non-ASCII characters, repeated.
  std::string text;
  while (text.size() < 64 * 8000) {
    text += "In 2024 the café's 3 ovens baked 1,250 loaves — about 4.2 per minute; "
            "\"not bad,\" said Zoë, who'd counted them (twice). ";
  }
  const std::vector<int32_t> all = (*tok)->Encode(text, false).value();
  auto decode = [&](std::span<const int32_t> ids) { return (*tok)->Decode(ids); };
  std::printf("tokenizer %s\n\n", path.c_str());
  std::printf("| tokens | whole list per token: ms | DecodeStream: ms | StopText (stop string "
              "never matched): ms | whole / stream |\n|---|---|---|---|---|\n");
  for (int n : lengths) {
    const std::span<const int32_t> ids(all.data(), std::min<size_t>(n, all.size()));
    size_t sink = 0;
    auto t0 = Clock::now();
    for (size_t k = 1; k <= ids.size(); ++k) sink += decode(ids.first(k))->size();
    const double whole = Seconds(t0);
    tandem::DecodeStream stream(decode);
    t0 = Clock::now();
    for (size_t k = 1; k <= ids.size(); ++k) sink += stream.Text(ids.first(k))->size();
    const double streamed = Seconds(t0);
    tandem::StopText stop(decode);
    const std::vector<std::string> stops = {"<|never|>", "\n\n\n\n"};
    t0 = Clock::now();
    for (size_t k = 1; k <= ids.size(); ++k) sink += stop.EarliestMatch(stops, ids.first(k));
    const double stopped = Seconds(t0);
    std::printf("| %zu | %.1f | %.2f | %.2f | %.0f |\n", ids.size(), whole * 1e3, streamed * 1e3,
                stopped * 1e3, whole / streamed);
    if (sink == 0) std::printf("(nothing decoded)\n");
  }
  return 0;
}
