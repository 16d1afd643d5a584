// BPE as Hugging Face's tokenizers runs it on one piece:
// 1. With ignore_merges, a piece that is a vocabulary token is that token.
// 2. Each character becomes a symbol: its token (with continuing_subword_prefix when not first,
//    end_of_word_suffix when last); else with byte_fallback its bytes' <0xXX> tokens when all
//    exist; else unk_token (runs fused when fuse_unk); else nothing.
// 3. Pairs merge by rank, one merge at a time, lowest rank first and leftmost among equals; a
//    merge creates new candidate pairs with its neighbours. (GPT-2's files: every occurrence of
//    the best rank first.)
// A merge listed twice keeps its last rank, as Hugging Face's and GPT-2's maps do.
#include "common/tokenizer/bpe.h"

#include <algorithm>
#include <mutex>
#include <queue>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "common/tokenizer/json_fields.h"
#include "common/utf8.h"

namespace tandem::tokenizer {
namespace {

// Ids beyond this are taken as a corrupt file rather than allocated for (id -> token is dense).
constexpr int64_t kMaxId = (int64_t{1} << 24) - 1;
// The cache of merged pieces is dropped when it grows past this many pieces, bounding memory for
// a server that sees unbounded text; pieces longer than kMaxCachedBytes are not cached.
constexpr size_t kMaxCachedPieces = size_t{1} << 17;
constexpr size_t kMaxCachedBytes = 128;

std::string Quote(std::string_view s) {
  constexpr size_t kMax = 60;
  std::string out = "'";
  out.append(s.substr(0, kMax));
  if (s.size() > kMax) out.append("...");
  out.append("'");
  return out;
}

absl::StatusOr<int32_t> ParseId(const nlohmann::json& value, const std::string& file,
                                const std::string& what) {
  if (!value.is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": ", what, " has id ", value.dump(), ", which is not an integer"));
  }
  if (value.is_number_unsigned() ? value.get<uint64_t>() > static_cast<uint64_t>(kMaxId)
                                 : (value.get<int64_t>() < 0 || value.get<int64_t>() > kMaxId)) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": ", what, " has id ", value.dump(), ", outside 0..", kMaxId));
  }
  return static_cast<int32_t>(value.get<int64_t>());
}

uint64_t PairKey(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

}  // namespace

absl::StatusOr<std::vector<VocabEntry>> ParseVocabObject(const nlohmann::json& vocab,
                                                         const std::string& file,
                                                         const std::string& field) {
  if (!vocab.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        file, ": ", field, " must be an object of token -> id, got ", vocab.type_name()));
  }
  std::vector<VocabEntry> entries;
  entries.reserve(vocab.size());
  for (const auto& [text, id_json] : vocab.items()) {
    ASSIGN_OR_RETURN(int32_t id, ParseId(id_json, file, absl::StrCat("token ", Quote(text))));
    entries.push_back({text, id});
  }
  return entries;
}

absl::StatusOr<std::unique_ptr<BpeModel>> BpeModel::FromJson(const nlohmann::json& model,
                                                             const std::string& file) {
  const std::string where = absl::StrCat(file, ": model");
  RETURN_IF_ERROR(CheckKeys(model,
                            {"type", "dropout", "unk_token", "continuing_subword_prefix",
                             "end_of_word_suffix", "fuse_unk", "byte_fallback", "ignore_merges",
                             "vocab", "merges"},
                            where));
  if (auto type = model.find("type"); type != model.end() && *type != "BPE") {
    return absl::UnimplementedError(absl::StrCat(where, ": model type ", type->dump(),
                                                 " is not supported (only \"BPE\")"));
  }
  if (auto d = model.find("dropout");
      d != model.end() && !d->is_null() && !(d->is_number() && d->get<double>() == 0.0)) {
    return absl::UnimplementedError(
        absl::StrCat(where, ": dropout ", d->dump(), " is not supported (only null)"));
  }
  BpeOptions options;
  ASSIGN_OR_RETURN(std::string unk, StringField(model, "unk_token", where, ""));
  if (model.contains("unk_token") && !model["unk_token"].is_null()) options.unk_token = unk;
  ASSIGN_OR_RETURN(options.fuse_unk, BoolField(model, "fuse_unk", where, false));
  ASSIGN_OR_RETURN(options.byte_fallback, BoolField(model, "byte_fallback", where, false));
  ASSIGN_OR_RETURN(options.ignore_merges, BoolField(model, "ignore_merges", where, false));
  ASSIGN_OR_RETURN(options.continuing_subword_prefix,
                   StringField(model, "continuing_subword_prefix", where, ""));
  ASSIGN_OR_RETURN(options.end_of_word_suffix, StringField(model, "end_of_word_suffix", where, ""));

  auto vocab_it = model.find("vocab");
  if (vocab_it == model.end()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": no model.vocab"));
  }
  ASSIGN_OR_RETURN(std::vector<VocabEntry> vocab, ParseVocabObject(*vocab_it, file, "model.vocab"));

  auto merges_it = model.find("merges");
  if (merges_it == model.end() || !merges_it->is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": no model.merges array"));
  }
  std::vector<MergeEntry> merges;
  merges.reserve(merges_it->size());
  for (size_t i = 0; i < merges_it->size(); ++i) {
    const nlohmann::json& m = (*merges_it)[i];
    std::string at = absl::StrCat("model.merges[", i, "]");
    // Older files write "left right"; newer ones ["left", "right"] (which allows spaces).
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || space == 0 || space + 1 == s.size() ||
          s.find(' ', space + 1) != std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat(file, ": ", at, " is ", Quote(s),
                                                       ", not two tokens separated by one space"));
      }
      merges.push_back({s.substr(0, space), s.substr(space + 1), std::move(at)});
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string() &&
               !m[0].get_ref<const std::string&>().empty() &&
               !m[1].get_ref<const std::string&>().empty()) {
      merges.push_back({m[0].get<std::string>(), m[1].get<std::string>(), std::move(at)});
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": ", at, " is ", m.dump().substr(0, 60),
                       ", neither \"left right\" nor [\"left\", \"right\"] with non-empty tokens"));
    }
  }
  return Build(file, vocab, file, merges, std::move(options));
}

absl::StatusOr<std::unique_ptr<BpeModel>> BpeModel::Build(const std::string& vocab_file,
                                                          const std::vector<VocabEntry>& vocab,
                                                          const std::string& merges_file,
                                                          const std::vector<MergeEntry>& merges,
                                                          BpeOptions options) {
  auto m = std::unique_ptr<BpeModel>(new BpeModel());
  int32_t max_id = -1;
  for (const VocabEntry& e : vocab) max_id = std::max(max_id, e.id);
  m->id_to_token_.resize(static_cast<size_t>(max_id + 1));
  m->vocab_.reserve(vocab.size());
  for (const VocabEntry& e : vocab) {
    if (m->id_to_token_[e.id].has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(vocab_file, ": tokens ",
                                                     Quote(*m->id_to_token_[e.id]), " and ",
                                                     Quote(e.text), " share id ", e.id));
    }
    m->id_to_token_[e.id] = e.text;
    m->vocab_.emplace(e.text, e.id);
  }
  if (options.unk_token.has_value()) {
    auto it = m->vocab_.find(*options.unk_token);
    if (it == m->vocab_.end()) {
      return absl::InvalidArgumentError(absl::StrCat(vocab_file, ": unk_token ",
                                                     Quote(*options.unk_token),
                                                     " is not in the vocabulary"));
    }
    m->unk_id_ = it->second;
  }
  for (int b = 0; b < 256; ++b) {
    auto it = m->vocab_.find(absl::StrFormat("<0x%02X>", b));
    m->byte_fallback_id_[b] = it == m->vocab_.end() ? -1 : it->second;
  }

  const size_t prefix_len = options.continuing_subword_prefix.size();
  m->merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const MergeEntry& e = merges[rank];
    auto lookup = [&](const std::string& text) -> absl::StatusOr<int32_t> {
      auto it = m->vocab_.find(text);
      if (it == m->vocab_.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat(merges_file, ": ", e.where, ": merge ", Quote(e.left + " " + e.right),
                         " names ", Quote(text), ", which is not in the vocabulary"));
      }
      return it->second;
    };
    ASSIGN_OR_RETURN(int32_t left, lookup(e.left));
    ASSIGN_OR_RETURN(int32_t right, lookup(e.right));
    // The right part loses its continuing_subword_prefix in the merged token.
    const std::string merged_text =
        e.left + (e.right.size() >= prefix_len ? e.right.substr(prefix_len) : std::string());
    auto merged = m->vocab_.find(merged_text);
    if (merged == m->vocab_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(merges_file, ": ", e.where, ": merge ", Quote(e.left + " " + e.right),
                       " makes ", Quote(merged_text), ", which is not in the vocabulary"));
    }
    m->merges_[PairKey(left, right)] = {static_cast<int32_t>(rank), merged->second};
  }
  m->options_ = std::move(options);
  return m;
}

const BpeModel::MergeResult* BpeModel::FindMerge(int32_t left, int32_t right) const {
  auto it = merges_.find(PairKey(left, right));
  return it == merges_.end() ? nullptr : &it->second;
}

std::vector<int32_t> BpeModel::MergeWord(std::string_view word) const {
  // Symbols in order; merged-away ones get id -1. next/prev link the live ones.
  std::vector<int32_t> id;
  id.reserve(word.size());
  std::optional<int32_t> pending_unk;
  std::string symbol;
  for (size_t i = 0; i < word.size();) {
    auto [cp, len] = DecodeUtf8(word.substr(i));
    const bool first = i == 0;
    const bool last = i + len >= word.size();
    symbol.clear();
    if (!first) symbol.append(options_.continuing_subword_prefix);
    symbol.append(word.substr(i, len));
    if (last) symbol.append(options_.end_of_word_suffix);
    i += len;
    if (auto it = vocab_.find(symbol); it != vocab_.end()) {
      if (pending_unk) id.push_back(*std::exchange(pending_unk, std::nullopt));
      id.push_back(it->second);
      continue;
    }
    if (options_.byte_fallback) {
      const bool all = std::all_of(symbol.begin(), symbol.end(), [&](char b) {
        return byte_fallback_id_[static_cast<uint8_t>(b)] >= 0;
      });
      if (all) {
        // As Hugging Face: a pending unknown run is not flushed first.
        for (char b : symbol) id.push_back(byte_fallback_id_[static_cast<uint8_t>(b)]);
        continue;
      }
    }
    if (unk_id_) {
      if (pending_unk && !options_.fuse_unk) id.push_back(*pending_unk);
      pending_unk = *unk_id_;
    }
  }
  if (pending_unk) id.push_back(*pending_unk);

  const int n = static_cast<int>(id.size());
  std::vector<int32_t> next(n), prev(n);
  for (int p = 0; p < n; ++p) {
    next[p] = p + 1;
    prev[p] = p - 1;
  }
  struct Candidate {
    int32_t rank, pos, merged;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
  auto consider = [&](int p) {
    if (p < 0 || next[p] >= n) return;
    if (const MergeResult* r = FindMerge(id[p], id[next[p]])) heap.push({r->rank, p, r->merged_id});
  };
  for (int p = 0; p + 1 < n; ++p) consider(p);
  // A candidate is still valid when its position is live, has a right neighbour, and that pair
  // still merges into the same token.
  auto apply = [&](const Candidate& c) {
    if (id[c.pos] < 0 || next[c.pos] >= n) return;
    const MergeResult* r = FindMerge(id[c.pos], id[next[c.pos]]);
    if (r == nullptr || r->merged_id != c.merged || r->rank != c.rank) return;
    const int q = next[c.pos];
    id[c.pos] = c.merged;
    id[q] = -1;
    next[c.pos] = next[q];
    if (next[q] < n) prev[next[q]] = c.pos;
    consider(prev[c.pos]);
    consider(c.pos);
  };
  if (options_.merge_rank_at_once) {
    std::vector<Candidate> batch;
    while (!heap.empty()) {
      batch.clear();
      const int32_t rank = heap.top().rank;
      while (!heap.empty() && heap.top().rank == rank) {
        batch.push_back(heap.top());
        heap.pop();
      }
      for (const Candidate& c : batch) apply(c);
    }
  } else {
    while (!heap.empty()) {
      const Candidate c = heap.top();
      heap.pop();
      apply(c);
    }
  }
  std::vector<int32_t> out;
  for (int p = 0; p < n; p = next[p]) out.push_back(id[p]);
  return out;
}

void BpeModel::Tokenize(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.empty()) return;
  if (options_.ignore_merges) {
    if (auto it = vocab_.find(piece); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = piece.size() <= kMaxCachedBytes;
  if (cacheable) {
    std::shared_lock lock(cache_mutex_);
    if (auto it = cache_index_.find(piece); it != cache_index_.end()) {
      const std::vector<int32_t>& ids = cache_values_[it->second];
      out.insert(out.end(), ids.begin(), ids.end());
      return;
    }
  }
  std::vector<int32_t> ids = MergeWord(piece);
  out.insert(out.end(), ids.begin(), ids.end());
  if (cacheable) {
    std::unique_lock lock(cache_mutex_);
    if (cache_values_.size() >= kMaxCachedPieces) {
      cache_index_.clear();
      cache_values_.clear();
    }
    if (cache_index_.emplace(std::string(piece), static_cast<int32_t>(cache_values_.size())).second) {
      cache_values_.push_back(std::move(ids));
    }
  }
}

std::optional<int32_t> BpeModel::TokenToId(std::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::IdToToken(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size() || !id_to_token_[id].has_value()) {
    return nullptr;
  }
  return &*id_to_token_[id];
}

}  // namespace tandem::tokenizer
