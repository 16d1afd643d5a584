// Plain step types to and from the worker service's messages (coordinator/step_proto.h).
#include "coordinator/step_proto.h"

namespace tandem {
namespace {

TokenLogprob FromProto(const v1::TokenLogprob& in) {
  TokenLogprob out{.token = in.token_id(), .logprob = in.logprob(), .top = {}};
  for (const v1::TopLogprob& t : in.top_logprobs()) out.top.emplace_back(t.token_id(), t.logprob());
  return out;
}

}  // namespace

v1::StepRequest ToStepRequest(const StepDescriptor& step, uint64_t assignment_id) {
  v1::StepRequest req;
  req.set_assignment_id(assignment_id);
  req.set_step_id(step.id);
  for (const SequenceStep& row : step.seqs) {
    const SamplingParams& sp = row.sampling;
    v1::SequenceStep* ss = req.add_seqs();
    ss->set_slot(row.slot);
    ss->set_position(row.position);
    ss->set_num_tokens(row.num_tokens);
    ss->set_sample(row.sample);
    ss->set_kv_out_key(row.kv_out_key);
    ss->set_temperature(sp.temperature);
    ss->set_top_k(sp.top_k);
    ss->set_top_p(sp.top_p);
    ss->set_seed(sp.seed);
    ss->set_sample_index(row.sample_index);
    ss->set_min_p(sp.min_p);
    ss->set_presence_penalty(sp.presence_penalty);
    ss->set_frequency_penalty(sp.frequency_penalty);
    ss->set_repetition_penalty(sp.repetition_penalty);
    for (const SeenToken& seen : row.seen) {
      ss->add_seen_token_ids(seen.id);
      ss->add_seen_output_counts(seen.output_count);
      ss->add_seen_in_prompt(seen.in_prompt);
    }
    if (row.logprobs >= 0) {
      ss->set_logprobs(true);
      ss->set_top_logprobs(row.logprobs);
    }
    if (row.prompt_logprobs >= 0) {
      ss->set_prompt_logprobs(true);
      ss->set_prompt_top_logprobs(row.prompt_logprobs);
      ss->set_next_prompt_token(row.next_prompt_token);
    }
  }
  req.mutable_tokens()->Add(step.tokens.begin(), step.tokens.end());
  return req;
}

std::vector<SequenceLogprobs> LogprobsFromProto(const v1::StepResult& result) {
  std::vector<SequenceLogprobs> out;
  out.reserve(result.logprobs_size());
  for (const v1::SequenceLogprobs& l : result.logprobs()) {
    SequenceLogprobs s;
    s.seq = l.seq();
    s.has_sampled = l.has_sampled();
    if (s.has_sampled) s.sampled = FromProto(l.sampled());
    for (const v1::TokenLogprob& p : l.prompt()) s.prompt.push_back(FromProto(p));
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace tandem
