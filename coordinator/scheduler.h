// Continuous batching as a policy without plumbing: the waiting queue, admission into pipelines,
// KV-slot accounting, micro-batch step formation with chunked prefill, and what a step's result
// does to its sequences (tokens, logprobs, stop rules, the end). No threads, no locks, no gRPC: the
// coordinator (coordinator.h) holds it under its mutex, sends the steps it forms and hands it the
// results; the unit tests drive it directly.
//
// A pipeline here is a scheduling target only: an id, its number of stages and its slots. Which
// workers serve it and the link that carries its steps are the coordinator's.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/step.h"
#include "coordinator/kv_pages.h"
#include "coordinator/kv_slots.h"
#include "coordinator/request_state.h"
#include "coordinator/request_validation.h"
#include "coordinator/stop_rules.h"

namespace tandem {

struct CoordinatorMetrics;  // common/metrics.h

struct SchedulerOptions {
  // Requests the service holds beyond its KV slots (CheckRoom); -1: as many as the slots the
  // service is planned to have, at least kMinDefaultWaiting.
  int max_waiting = -1;
  int max_slots = 16;       // KV slots (concurrent sequences) per pipeline
  int max_batch = 16;       // sequences per step
  int prefill_chunk = 512;  // prompt tokens per sequence per step
  // Prompt tokens per step across all of its sequences; 0: no bound. Decodes always go; prompts
  // fill what is left, oldest first, the last one that fits in part fed in a chunk of that size.
  int prefill_budget = 0;
  int micro_batches = 0;    // steps in flight per pipeline; at least one per stage
  // A one-stage pipeline, or one whose first stage gets the last one's tokens over the link
  // (AddPipeline's fed_by_last), gets a sequence's next decode step while the step that samples its
  // input runs (the row feeds kPreviousSample), so that the first stage never waits for the round
  // trip to the coordinator between two steps. Outputs are the same: the step feeds the token the stage
  // sampled, with the RNG counter of that position; a sequence that ends drops the token sampled
  // ahead. Sequences with penalties or prompt logprobs (which need the token first) wait.
  bool decode_ahead = true;
  // How far ahead: as many steps as fit in this much of the pipeline's step time, measured
  // between results that came back to back (the stage never idle between them); at least one,
  // at most kMaxDecodeAhead. Covers a round trip that is long against the step (a small model,
  // a busy host) without queueing more than this much work before a new prompt's step.
  absl::Duration decode_ahead_time = absl::Milliseconds(1);
  // Times a running sequence whose pipeline is lost (a worker down, a layout retired before it
  // drained) goes back to the front of the queue, to continue on the next pipeline that takes it
  // after recomputing its KV-cache from its prompt and the tokens generated so far, before it
  // fails with the cause instead; 0: it fails at once.
  int max_resumes = 3;
  // New requests that arrive together (a client's batch, a closed loop's next round) share one
  // prompt step: Admit holds them back until neither has a request arrived nor a sequence ended
  // (freeing a slot, whose successor may be on its way) for `admission_quiet`, and while at least
  // a quarter of a pipeline's running sequences (two or more) reach their length within
  // kEndingSoonSteps steps (so that their successors' prompts join), and after a step's result
  // ended that many at once, until as many new requests have come (their successors, which
  // reach the service spread over some milliseconds) or `admission_wait` has passed since; at
  // most until the oldest has waited `admission_wait`, and never once they fill a step
  // (max_batch) or every free slot of the pipelines that take new sequences. Otherwise the first
  // to arrive
  // run their prompts alone, and the rest stall them and one another in later prompt steps.
  // Zero: admitted at once. Resumed sequences are never held back.
  absl::Duration admission_quiet = absl::ZeroDuration();
  absl::Duration admission_wait = absl::ZeroDuration();
  int vocab_size = 0;      // sampled tokens outside [0, vocab_size) fail the pipeline
  int context_length = 0;  // positions in the KV-cache, for the length rule
  TextDecoder decode;      // for stop strings; empty: none are matched
  // A paged KV-cache (docs/paged-kv.md): tokens per page; 0: each slot holds max_seq_len
  // positions. With pages, each pipeline's KvPageOwner (AddPipeline's kv_pages) decides which
  // pages a sequence uses: admission goes by free pages, a sequence that cannot grow preempts the
  // newest one (recomputed later), and max_slots bounds concurrent sequences only.
  int kv_page_size = 0;
  bool prefix_caching = true;  // with pages: prompts start at their cached full pages
  int kv_margin_tokens = 16;   // KvPagesConfig::margin_tokens
};

// The default waiting bound's floor: TGI's bound on requests (max_concurrent_requests), and the
// most sequences one request may have (the OpenAI API's prompts x n), so that a small deployment
// still admits every request that validation lets through.
inline constexpr int kMinDefaultWaiting = 128;
// The default waiting bound (SchedulerOptions::max_waiting -1) for `planned_slots`.
inline int DefaultMaxWaiting(int planned_slots) {
  return planned_slots > kMinDefaultWaiting ? planned_slots : kMinDefaultWaiting;
}

// The most steps a sequence goes ahead of the step that samples its input.
inline constexpr int kMaxDecodeAhead = 16;
// Admission (SchedulerOptions::admission_quiet): running sequences that reach their length within
// this many more tokens end soon.
inline constexpr int kEndingSoonSteps = 4;

// What a pipeline runs. With at least one prefill and one decode pipeline serving, a new sequence
// runs its prompt in a prefill pipeline (with a slot of a decode pipeline set aside for it); once
// its first token is sampled, its KV-cache is handed off to that decode pipeline, where it
// decodes. Otherwise every pipeline takes sequences as kBoth does.
enum class PipelineRole { kBoth, kPrefill, kDecode };

class Scheduler {
 public:
  // `metrics` (common/metrics.h) may be null: nothing is recorded.
  explicit Scheduler(SchedulerOptions options, CoordinatorMetrics* metrics = nullptr);

  void set_metrics(CoordinatorMetrics* metrics) { metrics_ = metrics; }

  // Room for a request of `sequences` sequences (its prompts x n, all submitted together). The
  // service holds at most its KV slots plus max_waiting requests, running or waiting, each
  // sequence counting one: a request waits only behind the slots that are taken, so that a
  // closed loop of as many clients as slots is never refused, whenever their requests end and
  // the next ones arrive. The slots are those of every pipeline (with prefill and decode
  // pipelines serving, the decode ones': a sequence holds one of them from its admission on).
  // `planned_slots`: those of the pipelines the service is planned to run (replicas that decode
  // x max_slots), which may not serve yet or any more. INVALID_ARGUMENT naming the limits when
  // the request has more sequences than the larger of the two slot counts and max_waiting (it
  // can never be admitted); RESOURCE_EXHAUSTED (retry later) when it does not fit now.
  absl::Status CheckRoom(int sequences, int planned_slots) const;
  // The slots CheckRoom counts as the service's now.
  int capacity() const;
  // Requests the service holds now: waiting, or admitted and not ended.
  int in_service() const { return static_cast<int>(waiting_.size() + seqs_.size()); }
  // Queues `request` (an empty request_id becomes "req-<n>"); no room check (CheckRoom).
  std::shared_ptr<RequestState> Enqueue(ValidatedRequest request, absl::Time now);
  // Ends every waiting request with `why`, the resumed sequences among them, and the sequences
  // in a prefill hand-off.
  void FailWaiting(const absl::Status& why, absl::Time now);
  // Requests not in a pipeline: new ones and resumed sequences.
  int waiting() const { return static_cast<int>(waiting_.size() + resumed_.size()); }

  // Pipelines. A new one takes sequences from the next Admit on.
  // `fed_by_last`: a pipeline of several stages whose first stage gets the last one's sampled
  // tokens over the link, so that its steps may go ahead of the tokens they feed as a single
  // stage's do.
  // `kv_pages`: with SchedulerOptions::kv_page_size, the pages each of its stages holds.
  void AddPipeline(int id, int stages, PipelineRole role = PipelineRole::kBoth,
                   bool fed_by_last = false, int kv_pages = 0);
  // With pages: OK when a request of `prompt_tokens` + `max_new_tokens` fits alone in some
  // pipeline's pool and context; otherwise the error of KvPageOwner::CheckFits (the tokens asked
  // and the capacity). OK without paged pipelines.
  absl::Status CheckFits(int prompt_tokens, int max_new_tokens) const;
  // The page counters of pipeline `id`; nothing without pages.
  std::optional<KvPageCounters> kv_page_counters(int id) const;
  // From the next Admit on; the sequences it runs go on there.
  void SetRole(int id, PipelineRole role);
  PipelineRole role(int id) const;  // kBoth for an unknown pipeline
  // Prefill/decode hand-offs (PipelineRole): a sequence whose prompt is done in a prefill
  // pipeline is taken out of it (neither waiting nor running, its steps all done) while its
  // KV-cache goes from the prefill pipeline's slot to the decode pipeline's. Both slots stay
  // taken until HandedOff, whatever happens to the sequence meanwhile.
  struct Handoff {
    uint64_t id = 0;
    uint64_t seq = 0;  // the sequence (its key while it moves)
    int from_pipeline = -1;
    int from_slot = -1;
    int positions = 0;  // positions its KV-cache holds
    int to_pipeline = -1;
    int to_slot = -1;
    // The step that ended its prompt and wrote its KV-cache out as it ran (kv_out_key); 0: none
    // (its KV-cache is exported from the prefill slot).
    uint64_t kv_out_step = 0;
    // Its KV-cache is in the decode slot already: a KV stream brought it while the prompt ran.
    bool streamed = false;
    // With pages: the prefill pipeline's pages that hold its positions, and those the decode
    // pipeline's owner gave it, in position order. With pages a hand-off exports the prefill
    // pages after the prompt (no write-out, no stream).
    std::vector<int32_t> from_table;
    std::vector<int32_t> to_table;
  };
  // The hand-offs that can start, oldest first: the sequence's prompt is done, and no step in
  // flight in the decode pipeline uses its decode slot any more (a sequence that ended there
  // frees its slot at once, while its last steps may still run: the KV-cache is written outside
  // the step order, so it waits for them).
  std::vector<Handoff> TakeHandoffs();
  bool handoffs_ready() const;
  // Ends hand-off `id`: frees the prefill slot; a sequence whose KV-cache arrived (`ok`) decodes
  // in the decode pipeline's slot from where it was; otherwise (or when the decode pipeline is
  // gone) its decode slot is freed and it goes back to the queue to be recomputed as
  // RemovePipeline(resume) does, failing with `why` past max_resumes.
  void HandedOff(uint64_t id, bool ok, const absl::Status& why, absl::Time now);
  // KV streams: the step that ends a prompt in a prefill pipeline writes the sequence's KV-cache
  // out layer by layer (SequenceStep.kv_out_key), and where its decode slot has no step in flight
  // when that step is formed, the decode pipeline imports it meanwhile, each layer fetched as
  // soon as it is written: by the time the first token comes back, the hand-off has nothing left
  // to move. The decode slot stays the stream's until it ended, whatever happens to the sequence.
  struct KvStream {
    uint64_t id = 0;
    uint64_t seq = 0;  // the sequence (the key of its write-out)
    int from_pipeline = -1;
    int to_pipeline = -1;
    int to_slot = -1;
    int positions = 0;  // positions its KV-cache will hold
    uint64_t step = 0;  // the prefill step that writes it out
  };
  // The streams formed since the last call, to start.
  std::vector<KvStream> TakeKvStreams();
  bool kv_streams_ready() const;
  // Stream `id` ended: OK, its KV-cache is in the decode slot.
  void KvStreamEnded(uint64_t id, const absl::Status& st);
  // Forgets pipeline `id` and its steps in flight (results for them are then refused). Its
  // running sequences end with `why`, or with `resume` go back to the queue ahead of every
  // waiting request, in admission order, to be fed their prompt and every token generated so far
  // (no token is lost or repeated; sampling continues at the same counter) by the next pipeline
  // that admits them, at most max_resumes times each. A sequence that asked for prompt logprobs
  // and has none of its tokens yet is not resumed (its prompt's logprobs would be sent twice).
  void RemovePipeline(int id, const absl::Status& why, absl::Time now, bool resume = false);
  // Moving sequences with their KV-cache (a layout change whose old stages are alive):
  // A paused pipeline forms no more steps and admits nothing; once none of its steps is in
  // flight, each sequence's KV-cache holds exactly the positions it was fed.
  void Pause(int id);
  int steps_in_flight(int id) const;
  struct Held {
    uint64_t seq = 0;   // the sequence (its key while it moves)
    int slot = -1;      // where its KV-cache is in the old pipeline
    int positions = 0;  // how many positions it holds
    // With pages: the old pipeline's pages that hold them, in position order.
    std::vector<int32_t> block_table;
  };
  // Takes the sequences out of paused pipeline `id`, whose steps are all done, and forgets the
  // pipeline; they are held aside (neither waiting nor running) until placed. Where each one's
  // KV-cache is, in admission order. A sequence not fed yet has none: it goes back to the front
  // of the queue instead.
  std::vector<Held> Detach(int id);
  struct Target {
    int pipeline = -1;
    int slot = -1;
    // With pages: the pages its new pipeline's owner gave the positions it holds, in order.
    std::vector<int32_t> block_table;
  };
  // Puts held sequence `seq` into the pipeline Admit would choose, at a free slot (with pages:
  // one whose owner admits its positions, on pages of its own), where it takes no step until
  // Moved. None when no pipeline has room or the sequence has ended meanwhile.
  std::optional<Target> PlaceHeld(uint64_t seq);
  // A held or placed sequence whose KV-cache is now in its slot (`ok`; with pages, its pages are
  // then published to the prefix cache) continues from where it was; otherwise (its pages are
  // freed) (its KV did not arrive, no pipeline had room) it goes back to the queue to be
  // recomputed as RemovePipeline(resume) does, failing with `why` past max_resumes. A sequence
  // that ended meanwhile is skipped.
  void Moved(uint64_t seq, bool ok, const absl::Status& why, absl::Time now);
  int held() const { return static_cast<int>(held_.size()); }

  // A draining pipeline admits nothing new; its running sequences go on.
  void SetDraining(int id);
  bool draining(int id) const;
  int running(int id) const;  // sequences admitted into pipeline `id` and not ended
  int used_slots(int id) const;
  int free_slots(int id) const;

  // Moves resumed sequences, then waiting requests (once admit_at() has come), oldest first, into the pipeline with the fewest
  // running sequences (the lowest id on ties) that is not draining and has a free slot, until none
  // is left. Nothing while sequences are held (they are placed first). With prefill and decode
  // pipelines serving, a sequence goes into a prefill pipeline so chosen and takes a slot of the
  // decode pipeline with the fewest slots in use as well; it waits until both have room.
  void Admit(absl::Time now);
  // When Admit next takes the new requests it holds back for others to arrive
  // (SchedulerOptions::admission_quiet); InfinitePast when it holds none back.
  absl::Time admit_at() const;

  // The steps pipeline `id` should run next: micro-batches of the sequences that are not in a
  // step already, at most max(micro_batches, stages) steps in flight, the ready sequences spread
  // evenly over the free ones and at most max_batch per step. With several in flight, a step takes
  // at most an even share of the pipeline's running sequences (a stage's step costs about as much
  // at 3 rows as at 32): the rest wait for the next free one, ahead of the others. A sequence feeds
  // its pending tokens, at most prefill_chunk of them: the prompt in chunks, then one token per
  // decode step, and samples after its last pending token. A step's prompt tokens stay within
  // prefill_budget: a prompt left out waits for the next step, ahead of the younger ones. Step ids
  // count from 1 per pipeline. With decode_ahead, a one-stage (or fed_by_last) pipeline may hold
  // (1 + ahead) times as many steps in flight, and a sequence whose steps in flight sample goes
  // into the next step as well (kPreviousSample), up to `ahead` steps beyond the first
  // (decode_ahead_ahead()), unless the tokens of the steps in flight are certain to end it (its
  // length).
  std::vector<StepDescriptor> FormSteps(int id);
  // The steps a sequence of pipeline `id` may go ahead now: decode_ahead_time over the measured
  // step time, in [1, kMaxDecodeAhead]; 1 until a step time is measured, 0 without decode_ahead
  // or with more than one stage unless the first is fed by the last.
  int decode_ahead(int id) const;

  // The result of step `step_id` of pipeline `id`: one sampled token per sequence that sampled,
  // in step order, and the logprobs that were asked for (SequenceLogprobs::seq indexes the
  // step's rows). Appends the tokens to their requests and applies the stop rules. A sequence
  // cancelled while its step ran is skipped. INTERNAL naming the pipeline when the step is
  // unknown, the count of tokens is wrong or a token is outside the vocabulary: the pipeline can
  // no longer be trusted, and the caller removes it.
  absl::Status OnStepResult(int id, uint64_t step_id, std::span<const int32_t> tokens,
                            std::span<const SequenceLogprobs> logprobs, absl::Time now);

  // Ends `request` now with `why`, wherever it is (waiting or running), and frees its KV slot at
  // once. Reusing the slot while a step that uses it is in flight is safe: every stage runs steps
  // in issue order, so the old step is done with the slot before a new prefill (position 0)
  // overwrites it.
  void Cancel(const std::shared_ptr<RequestState>& request, const absl::Status& why,
              absl::Time now);

 private:
  struct Sequence {
    uint64_t id = 0;
    std::shared_ptr<RequestState> request;
    int pipeline = -1;
    int slot = -1;
    int position = 0;               // tokens in the KV-cache once its steps in flight are done
    std::vector<int32_t> pending;   // tokens to feed: the prompt (rest), then the newest token
    std::vector<int32_t> generated;
    int in_flight = 0;  // steps in flight that hold the sequence
    int fed_ahead = 0;  // of them, steps that feed the token of the step before (kPreviousSample)
    bool left_out = false;  // ready when the last step was formed, but over its share: goes first
    uint64_t last_step = 0;  // the newest step that holds it
    // With a penalty set: every distinct token of the sequence the penalties look at (the prompt
    // only for repetition_penalty) -> {times generated, in the prompt}.
    absl::flat_hash_map<int32_t, std::pair<int32_t, bool>> seen;
    absl::Time last_token = absl::InfinitePast();  // for the inter-token latency
    int resumes = 0;  // times its pipeline was lost and it went back to the queue
    bool moving = false;  // held aside, or placed while its KV-cache is put in its slot
    // In a prefill pipeline: the decode pipeline's slot set aside for it; -1: none.
    int decode_pipeline = -1;
    int decode_slot = -1;
    uint64_t handoff = 0;  // the hand-off its KV-cache is on; 0: none
    uint64_t kv_out_step = 0;  // the prefill step that wrote its KV-cache out; 0: none
    uint64_t kv_stream = 0;    // the KV stream bringing it to its decode slot; 0: none
    std::unique_ptr<StopText> stop_text;  // with stop strings: the generated text as it grows
    // Bumped when it goes back to the queue: rows of its steps still in flight from before are
    // stale (a preempted sequence's pipeline runs on).
    uint64_t epoch = 0;
    // With pages: the leading tokens the page owner holds whose values are known (a row that
    // feeds kPreviousSample appends a placeholder), so only those are published as cached.
    int kv_known = 0;
  };
  // One sequence's row of a step in flight.
  struct StepEntry {
    uint64_t seq = 0;
    int slot = -1;
    bool sample = false;
    uint64_t epoch = 0;  // the sequence's when the step was formed
    int end = 0;         // the positions the sequence's KV-cache holds once the step is done
  };
  struct Pipeline {
    Pipeline(int stages, int slots, PipelineRole role, bool fed_by_last)
        : stages(stages), slots(slots), role(role), fed_by_last(fed_by_last) {}
    int stages = 1;
    KvSlotAllocator slots;
    std::optional<KvPageOwner> pages;  // with SchedulerOptions::kv_page_size
    PipelineRole role = PipelineRole::kBoth;
    bool fed_by_last = false;  // AddPipeline
    std::vector<uint64_t> running;  // sequence ids, admission order
    std::map<uint64_t, std::vector<StepEntry>> inflight;  // by step id
    uint64_t next_step = 1;
    bool draining = false;
    bool paused = false;  // forms no steps (its sequences are about to move)
    // The stage's time per step: a moving average of the gaps between results that came back
    // to back; zero until measured.
    absl::Duration step_time;
    absl::Time last_result = absl::InfinitePast();
    bool busy_at_last_result = false;  // steps were still in flight when the last result came
  };

  SequenceStep RowOf(const Sequence& seq, int num_tokens, bool sample) const;
  // Whether `seq` may go into the next step of a pipeline now, going up to `ahead` steps ahead.
  bool Ready(const Sequence& seq, int ahead) const;
  int DecodeAhead(const Pipeline& p) const;
  // Whether the token of the step in flight ends `seq` whatever it is (its length).
  bool EndsByLength(const Sequence& seq) const;
  // Where the next sequence goes: a pipeline that is not draining and has a free slot, the fewest
  // running sequences (the lowest id on ties), and, with prefill and decode pipelines serving, a
  // prefill one and the decode one with the fewest slots in use; none if they have no room.
  // `fed` (a sequence whose KV-cache is there already) prefers pipelines that decode.
  struct Placement {
    int pipeline = -1;
    int decode = -1;  // the decode pipeline whose slot it takes after its prompt; -1: none
  };
  // `need` (with pages): the tokens and max new tokens of the sequence to admit, which must fit
  // in the pipeline's pages.
  struct KvNeed {
    std::span<const int32_t> tokens;
    int max_new_tokens = 0;
    bool use_cache = true;
  };
  std::optional<Placement> PlacementForNext(bool fed = false, const KvNeed* need = nullptr) const;
  // What `seq` asks of a page owner to be admitted: its prompt and tokens so far.
  KvNeed NeedOf(const Sequence& seq, std::vector<int32_t>& tokens) const;
  // With pages: admits placed `seq` into its pipeline's owner and skips its cached prompt tokens.
  void AdmitPages(Sequence& seq);
  // With pages, n > 1: a running sibling of a new request `rq` (the same request id and prompt,
  // holding only its prompt) whose pipeline can take `rq` too (`need`) is the parent it forks
  // from; while the parent's steps have not yet written its prompt's full pages, `rq` waits.
  struct ForkFrom {
    Sequence* parent = nullptr;
    bool wait = false;
  };
  ForkFrom ForkParentOf(const ValidatedRequest& rq, const KvNeed& need) const;
  // Admits placed `seq` into its parent's owner sharing the parent's full prompt pages
  // (KvPageOwner::Fork) and skips them. False when the owner had no pages of its own for it.
  bool ForkPages(Sequence& seq, const Sequence& parent);
  // With pages: gives `seq` the pages for the `n` tokens of its next row (`ahead`: the row feeds
  // kPreviousSample), preempting the newest sequence of `p` not in `step_seqs` (the rows formed
  // so far) while none is free. False when `seq` itself was preempted. Preempted ones leave
  // `ready`.
  bool GrowPages(Pipeline& p, Sequence& seq, int n, bool ahead,
                 const std::vector<StepEntry>& step_seqs, std::vector<Sequence*>& ready);
  // Takes running `seq` out of `p` (its pages freed, a preemption counted) and back to the queue.
  void PreemptSequence(Pipeline& p, Sequence& seq);
  // Puts `seq` into the placement's pipeline (a free slot), with a decode slot set aside.
  void Place(Sequence& seq, const Placement& to);
  // With pages: gives hand-off `h` of `seq` the prefill pages it leaves and pages of the decode
  // pipeline's owner for its positions. False (nothing taken) when that owner has none now.
  bool HandoffPages(const Sequence& seq, Handoff& h);
  // Whether hand-off `h` can start (TakeHandoffs).
  struct PendingHandoff;
  bool HandoffCanStart(const PendingHandoff& h) const;
  // Whether no step in flight in pipeline `pipeline` uses slot `slot` (true for a pipeline gone).
  bool SlotIdle(int pipeline, int slot) const;
  // A KV stream of `seq` (in its prompt's last step `step`) to its decode slot, where that slot is
  // idle.
  void StartKvStream(Sequence& seq, uint64_t step);
  // Frees the decode slot set aside for `seq`, if any.
  void ReleaseDecodeSlot(Sequence& seq);
  // `seq` has its first token from a prefill pipeline: hands it off to its decode slot (or, where
  // that pipeline is gone, lets it decode where it is).
  void StartHandoff(Sequence& seq);
  // The prompt tokens `seq` would feed in its next row (at most prefill_chunk); 0 once it decodes.
  int PromptTokens(const Sequence& seq) const;
  // Adds `seq`'s row to `step`: its pending tokens (at most prefill_chunk and `max_tokens`), or
  // kPreviousSample for a sequence ahead of its step in flight.
  StepEntry AddRow(Sequence& seq, StepDescriptor& step, int max_tokens);
  // Going ahead through several stages: whether every running sequence of `p` is in flight in
  // one micro-batch (its newest step).
  bool OneMicroBatch(const Pipeline& p) const;
  // ... and which of `ready` (newcomers first) the next steps take: newcomers open micro-batches
  // while there are fewer than `lanes` (`ready` keeps them only; returns how many steps may
  // open), otherwise they join the oldest micro-batch that may go ahead, which goes as one step
  // (`ready` keeps the newcomers and that micro-batch; returns 1). 0: newcomers only, and no
  // micro-batch to join yet.
  int NextTurn(const Pipeline& p, int lanes, std::vector<Sequence*>& ready) const;
  // Moves up to `n` rows out of `ready` into a new step of `p`, in order: every decode, and
  // prompts while the step's prefill budget lasts.
  StepDescriptor FormStep(Pipeline& p, std::vector<Sequence*>& ready, int n);
  // Back to the front of the queue, out of any pipeline, to be fed its prompt and every token it
  // generated (or ended with `why` past max_resumes, or when it wants prompt logprobs and has no
  // token yet).
  // `preempted`: for want of pages, which neither counts as a resume nor fails it.
  void Recompute(Sequence& seq, const absl::Status& why, absl::Time now, bool preempted = false);
  void AppendToken(Sequence& seq, int32_t token, TokenLogprob* logprob, absl::Time now);
  void EndSequence(uint64_t seq_id, absl::Status status, FinishReason finish, int text_limit,
                   absl::Time now);

  const SchedulerOptions options_;
  CoordinatorMetrics* metrics_;
  uint64_t next_seq_id_ = 1;
  std::deque<std::shared_ptr<RequestState>> waiting_;
  absl::Time last_end_ = absl::InfinitePast();  // when a sequence last ended (freeing its slot)
  uint64_t ends_ = 0;                            // sequences ended so far
  // The last step result that ended a quarter or more of its pipeline's running sequences (two
  // or more) at once: when, and how many of their successors have not arrived yet.
  absl::Time burst_at_ = absl::InfinitePast();
  int burst_left_ = 0;
  // Whether a quarter or more of some pipeline's running sequences (two or more) reach their
  // length within kEndingSoonSteps tokens (SchedulerOptions::admission_quiet).
  bool ManyEndingSoon() const;
  // How many of `p`'s running sequences reach their length within kEndingSoonSteps tokens.
  int EndingSoon(const Pipeline& p) const;
  std::deque<uint64_t> resumed_;  // sequences whose pipeline was lost, admitted before waiting_
  std::vector<uint64_t> held_;    // sequences taken out of a paused pipeline, not yet placed
  struct PendingHandoff {
    Handoff handoff;
    bool taken = false;  // by TakeHandoffs
    uint64_t stream = 0;  // the KV stream it waits for; 0: none
    // With pages: the decode pipeline's next step when its pages were given. A step formed
    // before may still write them (a cancelled or preempted sequence's row in flight), so the
    // import waits for those steps to end.
    uint64_t pages_at_step = 0;
  };
  uint64_t next_handoff_ = 1;
  // By id (oldest first): every hand-off until HandedOff; it owns its two slots.
  std::map<uint64_t, PendingHandoff> handoffs_;
  struct PendingStream {
    KvStream stream;
    bool taken = false;  // by TakeKvStreams
    bool ended = false;
    absl::Status status;
    bool orphan = false;  // its sequence let go of the decode slot: freed when the stream ends
  };
  uint64_t next_stream_ = 1;
  std::map<uint64_t, PendingStream> streams_;
  std::map<int, Pipeline> pipelines_;
  absl::flat_hash_map<uint64_t, std::unique_ptr<Sequence>> seqs_;
  absl::flat_hash_map<const RequestState*, uint64_t> seq_of_request_;
};

}  // namespace tandem
