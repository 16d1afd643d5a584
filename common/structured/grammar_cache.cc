#include "common/structured/grammar_cache.h"

#include <list>
#include <unordered_map>
#include <utility>

#include "absl/synchronization/mutex.h"

namespace tandem::structured {
namespace {

class GrammarCache {
 public:
  std::shared_ptr<const Grammar> Find(const std::string& key) {
    absl::MutexLock lock(&mu_);
    auto it = index_.find(key);
    if (it == index_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second);
    return it->second->second;
  }
  void Insert(const std::string& key, std::shared_ptr<const Grammar> g) {
    absl::MutexLock lock(&mu_);
    if (index_.count(key) > 0) return;
    order_.emplace_front(key, std::move(g));
    index_[key] = order_.begin();
    if (order_.size() > kGrammarCacheEntries) {
      index_.erase(order_.back().first);
      order_.pop_back();
    }
  }

 private:
  using Entry = std::pair<std::string, std::shared_ptr<const Grammar>>;
  absl::Mutex mu_;
  std::list<Entry> order_ ABSL_GUARDED_BY(mu_);  // most recently used first
  std::unordered_map<std::string, std::list<Entry>::iterator> index_ ABSL_GUARDED_BY(mu_);
};

std::string Key(const Constraint& c) {
  std::string key(1, static_cast<char>('0' + c.kind));
  key += c.text;
  for (const std::string& o : c.options) {
    key += '\0';
    key += o;
  }
  return key;
}

absl::StatusOr<std::shared_ptr<const Grammar>> Compile(const Constraint& c) {
  switch (c.kind) {
    case Constraint::kJsonObject: return JsonObjectGrammar();
    case Constraint::kJsonSchema: return CompileJsonSchema(c.text);
    case Constraint::kRegex: return CompileRegex(c.text);
    case Constraint::kChoice: return CompileChoice(c.options);
    case Constraint::kNone: break;
  }
  return absl::InvalidArgumentError("no constraint to compile");
}

}  // namespace

absl::StatusOr<std::shared_ptr<const Grammar>> CompileCached(const Constraint& c) {
  static GrammarCache* const cache = new GrammarCache();  // never destroyed: threads may outlive main
  const std::string key = Key(c);
  if (auto g = cache->Find(key)) return g;
  auto g = Compile(c);
  if (!g.ok()) return g.status();
  cache->Insert(key, *g);
  return g;
}

}  // namespace tandem::structured
