// The tokenizer.json pipeline, in Hugging Face's order for one text:
// 1. Added tokens with normalized == false are cut out of the raw text.
// 2. Each remaining part is normalized, and added tokens with normalized == true are cut out of
//    the normalized text.
// 3. Each remaining part is pre-tokenized into pieces, and each piece is encoded by the model.
// 4. With special tokens asked for, the post-processor's ids go around the result.
// Input that is not well-formed UTF-8 is first made so (each maximal ill-formed subsequence
// becomes U+FFFD), which is what a caller of Hugging Face's tokenizers gets from any decoder of
// bytes to text; GPT-2's own files keep raw bytes instead (see LoadVocabAndMerges).
// Decode maps ids to tokens (added tokens first), drops special ones when asked, and runs the
// decoder; an id that is no token is an error here (Hugging Face skips it silently).
#include "common/tokenizer/hf_tokenizer.h"

#include <fstream>
#include <sstream>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/bounded_json.h"
#include "common/status_macros.h"
#include "common/tokenizer/added_tokens.h"
#include "common/tokenizer/bpe.h"
#include "common/tokenizer/byte_alphabet.h"
#include "common/tokenizer/decoder.h"
#include "common/tokenizer/json_fields.h"
#include "common/tokenizer/normalizer.h"
#include "common/tokenizer/post_processor.h"
#include "common/tokenizer/pre_tokenizer.h"
#include "common/utf8.h"

namespace tandem::tokenizer {
namespace {

absl::StatusOr<std::string> ReadFile(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return absl::NotFoundError(absl::StrCat(path.string(), ": no such file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path.string(), ": cannot open"));
  std::ostringstream buf;
  buf << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path.string(), ": read failed"));
  return std::move(buf).str();
}

absl::StatusOr<nlohmann::json> ParseJson(const std::filesystem::path& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  return ParseBoundedJson(text, path.string());
}

std::string Quote(std::string_view s) {
  constexpr size_t kMax = 60;
  std::string out = "'";
  out.append(s.substr(0, kMax));
  if (s.size() > kMax) out.append("...");
  out.append("'");
  return out;
}

class HfTokenizer : public Backend {
 public:
  std::unique_ptr<Normalizer> normalizer;      // may be null
  std::unique_ptr<PreTokenizer> pre_tokenizer;  // may be null
  std::unique_ptr<BpeModel> model;
  AddedVocabulary added;
  PostProcessor post;
  std::unique_ptr<Decoder> decoder;  // may be null: tokens joined with ' '
  bool keep_raw_bytes = false;       // GPT-2's own files

  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                              bool add_special_tokens) const override {
    std::string valid;
    if (!keep_raw_bytes && !IsValidUtf8(text)) {
      valid = ToValidUtf8(text);
      text = valid;
    }
    RegexBudget budget = RegexBudget::ForText(text.size());
    std::vector<int32_t> ids;
    if (add_special_tokens) ids = post.prefix;
    ids.reserve(text.size() / 3 + 4);
    std::vector<Piece> pieces;
    for (const Segment& raw : added.Split(text, /*normalized=*/false)) {
      if (raw.id) {
        ids.push_back(*raw.id);
        continue;
      }
      std::string normalized(raw.text);
      if (normalizer != nullptr) RETURN_IF_ERROR(normalizer->Apply(normalized, budget));
      if (normalized.empty()) continue;
      for (const Segment& part : added.Split(normalized, /*normalized=*/true)) {
        if (part.id) {
          ids.push_back(*part.id);
          continue;
        }
        if (part.text.empty()) continue;
        pieces.clear();
        pieces.push_back({std::string(part.text), raw.begin == 0 && part.begin == 0});
        if (pre_tokenizer != nullptr) RETURN_IF_ERROR(pre_tokenizer->Apply(pieces, budget));
        for (const Piece& piece : pieces) model->Tokenize(piece.text, ids);
      }
    }
    if (add_special_tokens) ids.insert(ids.end(), post.suffix.begin(), post.suffix.end());
    return ids;
  }

  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids,
                                     bool skip_special_tokens) const override {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      const std::string* token = added.IdToText(ids[i]);
      if (token == nullptr) token = model->IdToToken(ids[i]);
      if (token == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("token id ", ids[i], " (at position ", i,
                                                       ") is not in the vocabulary of ",
                                                       vocab_size(), " ids"));
      }
      if (skip_special_tokens && added.IsSpecialText(*token)) continue;
      tokens.push_back(*token);
    }
    if (decoder == nullptr) {
      std::string text;
      for (size_t i = 0; i < tokens.size(); ++i) {
        if (i > 0) text.push_back(' ');
        text += tokens[i];
      }
      return text;
    }
    return decoder->Decode(std::move(tokens));
  }

  std::optional<int32_t> TokenToId(std::string_view token) const override {
    if (auto id = added.TokenToId(token)) return id;
    return model->TokenToId(token);
  }

  std::optional<std::string> IdToToken(int32_t id) const override {
    if (const std::string* t = added.IdToText(id)) return *t;
    if (const std::string* t = model->IdToToken(id)) return *t;
    return std::nullopt;
  }

  int vocab_size() const override {
    int32_t n = model->size();
    for (const AddedToken& t : added.tokens()) n = std::max(n, t.id + 1);
    return n;
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> LoadTokenizerJson(const std::filesystem::path& path) {
  const std::string file = path.string();
  ASSIGN_OR_RETURN(nlohmann::json root, ParseJson(path));
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": top level must be an object, got ", root.type_name()));
  }
  RETURN_IF_ERROR(CheckKeys(root,
                            {"version", "truncation", "padding", "added_tokens", "normalizer",
                             "pre_tokenizer", "model", "post_processor", "decoder"},
                            file));
  for (const char* key : {"truncation", "padding"}) {
    if (auto it = root.find(key); it != root.end() && !it->is_null()) {
      return absl::UnimplementedError(
          absl::StrCat(file, ": ", key, " ", it->dump().substr(0, 80),
                       " is not supported (only null: it would change the ids)"));
    }
  }
  auto model_it = root.find("model");
  if (model_it == root.end() || !model_it->is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": no \"model\" object"));
  }
  auto tok = std::make_unique<HfTokenizer>();
  ASSIGN_OR_RETURN(tok->model, BpeModel::FromJson(*model_it, file));
  if (auto n = root.find("normalizer"); n != root.end() && !n->is_null()) {
    ASSIGN_OR_RETURN(tok->normalizer, Normalizer::FromJson(*n, absl::StrCat(file, ": normalizer")));
  }
  if (auto p = root.find("pre_tokenizer"); p != root.end() && !p->is_null()) {
    ASSIGN_OR_RETURN(tok->pre_tokenizer,
                     PreTokenizer::FromJson(*p, absl::StrCat(file, ": pre_tokenizer")));
  }
  if (auto p = root.find("post_processor"); p != root.end() && !p->is_null()) {
    ASSIGN_OR_RETURN(tok->post,
                     PostProcessor::FromJson(*p, absl::StrCat(file, ": post_processor")));
  }
  if (auto d = root.find("decoder"); d != root.end() && !d->is_null()) {
    ASSIGN_OR_RETURN(tok->decoder, Decoder::FromJson(*d, absl::StrCat(file, ": decoder")));
  }
  if (auto a = root.find("added_tokens"); a != root.end()) {
    ASSIGN_OR_RETURN(tok->added, AddedVocabulary::FromJson(*a, file, tok->normalizer.get()));
  }
  for (const AddedToken& t : tok->added.tokens()) {
    if (const std::string* other = tok->model->IdToToken(t.id); other != nullptr && *other != t.content) {
      return absl::InvalidArgumentError(absl::StrCat(file, ": id ", t.id, " is token ",
                                                     Quote(*other), " in the vocabulary but added token ",
                                                     Quote(t.content)));
    }
    if (auto id = tok->model->TokenToId(t.content); id.has_value() && *id != t.id) {
      return absl::InvalidArgumentError(absl::StrCat(file, ": added token ", Quote(t.content),
                                                     " has id ", t.id,
                                                     " but the vocabulary gives it id ", *id));
    }
  }
  const int vocab = tok->vocab_size();
  for (const std::vector<int32_t>* ids : {&tok->post.prefix, &tok->post.suffix}) {
    for (int32_t id : *ids) {
      if (id >= vocab) {
        return absl::InvalidArgumentError(absl::StrCat(
            file, ": post_processor adds id ", id, ", outside the vocabulary of ", vocab));
      }
    }
  }
  return std::unique_ptr<Backend>(std::move(tok));
}

absl::StatusOr<std::unique_ptr<Backend>> LoadVocabAndMerges(
    const std::filesystem::path& vocab_json, const std::filesystem::path& merges_txt) {
  const std::string vocab_file = vocab_json.string();
  const std::string merges_file = merges_txt.string();
  ASSIGN_OR_RETURN(nlohmann::json root, ParseJson(vocab_json));
  ASSIGN_OR_RETURN(std::vector<VocabEntry> vocab,
                   ParseVocabObject(root, vocab_file, "the top level"));
  // GPT-2's files spell every token in the byte alphabet and hold every byte.
  const ByteAlphabet& alphabet = GetByteAlphabet();
  for (const VocabEntry& e : vocab) {
    if (e.text.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(vocab_file, ": the empty string is a token (id ", e.id, ")"));
    }
    for (size_t i = 0; i < e.text.size();) {
      const auto [cp, len] = DecodeUtf8(std::string_view(e.text).substr(i));
      if (cp == kInvalidCodePoint || cp >= alphabet.cp_to_byte.size() ||
          alphabet.cp_to_byte[cp] < 0) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "%s: token %s (id %d) has character U+%04X, which is not in GPT-2's byte alphabet "
            "(not a byte-level BPE vocabulary?)",
            vocab_file, Quote(e.text), e.id,
            static_cast<uint32_t>(cp == kInvalidCodePoint ? 0xFFFD : cp)));
      }
      i += len;
    }
  }

  ASSIGN_OR_RETURN(std::string text, ReadFile(merges_txt));
  std::vector<MergeEntry> merges;
  size_t line_no = 0;
  for (size_t begin = 0; begin < text.size();) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + begin, end - begin);
    begin = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line_no == 1 && line.starts_with("#version")) continue;
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
    // Fields separated by runs of spaces or tabs, as Python's str.split() reads them.
    std::vector<std::string_view> fields;
    for (size_t i = 0; i < line.size();) {
      const size_t start = line.find_first_not_of(" \t", i);
      if (start == std::string_view::npos) break;
      size_t stop = line.find_first_of(" \t", start);
      if (stop == std::string_view::npos) stop = line.size();
      fields.push_back(line.substr(start, stop - start));
      i = stop;
    }
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(merges_file, ": line ", line_no, " is ", Quote(line), ", not two tokens"));
    }
    merges.push_back(
        {std::string(fields[0]), std::string(fields[1]), absl::StrCat("line ", line_no)});
  }
  BpeOptions options;
  options.merge_rank_at_once = true;
  auto tok = std::make_unique<HfTokenizer>();
  ASSIGN_OR_RETURN(tok->model, BpeModel::Build(vocab_file, vocab, merges_file, merges, options));
  for (int b = 0; b < 256; ++b) {
    if (!tok->model->TokenToId(alphabet.byte_to_utf8[b]).has_value()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: no token for byte 0x%02X (spelled %s); a byte-level BPE vocabulary has all 256",
          vocab_file, b, Quote(alphabet.byte_to_utf8[b])));
    }
  }
  tok->pre_tokenizer = PreTokenizer::Gpt2JavaScript();
  tok->decoder = Decoder::RawByteLevel();
  tok->keep_raw_bytes = true;
  return std::unique_ptr<Backend>(std::move(tok));
}

}  // namespace tandem::tokenizer
