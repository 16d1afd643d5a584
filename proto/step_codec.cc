// Steps to and from the Worker service's messages (proto/step_codec.h).
#include "proto/step_codec.h"

#include <algorithm>

namespace tandem {
namespace {

void ToProto(const TokenLogprob& in, v1::TokenLogprob& out) {
  out.set_token_id(in.token);
  out.set_logprob(in.logprob);
  for (const auto& [token, logprob] : in.top) {
    v1::TopLogprob* t = out.add_top_logprobs();
    t->set_token_id(token);
    t->set_logprob(logprob);
  }
}

TokenLogprob FromProto(const v1::TokenLogprob& in) {
  TokenLogprob out{.token = in.token_id(), .logprob = in.logprob(), .top = {}};
  for (const v1::TopLogprob& t : in.top_logprobs()) out.top.emplace_back(t.token_id(), t.logprob());
  return out;
}

void ToProto(const SequenceStep& row, v1::SequenceStep& out) {
  const SamplingParams& sp = row.sampling;
  out.set_slot(row.slot);
  out.set_position(row.position);
  out.set_num_tokens(row.num_tokens);
  out.set_sample(row.sample);
  out.set_kv_out_key(row.kv_out_key);
  out.mutable_block_table()->Add(row.block_table.begin(), row.block_table.end());
  out.set_temperature(sp.temperature);
  out.set_top_k(sp.top_k);
  out.set_top_p(sp.top_p);
  out.set_seed(sp.seed);
  out.set_sample_index(row.sample_index);
  out.set_min_p(sp.min_p);
  out.set_presence_penalty(sp.presence_penalty);
  out.set_frequency_penalty(sp.frequency_penalty);
  out.set_repetition_penalty(sp.repetition_penalty);
  for (const SeenToken& seen : row.seen) {
    out.add_seen_token_ids(seen.id);
    out.add_seen_output_counts(seen.output_count);
    out.add_seen_in_prompt(seen.in_prompt);
  }
  if (row.logprobs >= 0) {
    out.set_logprobs(true);
    out.set_top_logprobs(row.logprobs);
  }
  if (row.constraint != nullptr) *out.mutable_constraint() = ConstraintToProto(*row.constraint);
  if (row.prompt_logprobs >= 0) {
    out.set_prompt_logprobs(true);
    out.set_prompt_top_logprobs(row.prompt_logprobs);
    out.set_next_prompt_token(row.next_prompt_token);
  }
}

SequenceStep FromProto(const v1::SequenceStep& s) {
  SequenceStep q;
  q.slot = s.slot();
  q.position = s.position();
  q.num_tokens = s.num_tokens();
  q.sample = s.sample();
  q.sampling = {.temperature = s.temperature(),
                .top_k = s.top_k(),
                .top_p = s.top_p(),
                .seed = s.seed(),
                .min_p = s.min_p(),
                .presence_penalty = s.presence_penalty(),
                .frequency_penalty = s.frequency_penalty(),
                .repetition_penalty =
                    s.repetition_penalty() == 0.0f ? 1.0f : s.repetition_penalty()};
  q.sample_index = s.sample_index();
  const int seen =
      std::min({s.seen_token_ids_size(), s.seen_output_counts_size(), s.seen_in_prompt_size()});
  q.seen.reserve(seen);
  for (int k = 0; k < seen; ++k) {
    q.seen.push_back({.id = s.seen_token_ids(k),
                      .output_count = s.seen_output_counts(k),
                      .in_prompt = s.seen_in_prompt(k)});
  }
  q.logprobs = s.logprobs() ? s.top_logprobs() : -1;
  q.prompt_logprobs = s.prompt_logprobs() ? s.prompt_top_logprobs() : -1;
  q.next_prompt_token = s.prompt_logprobs() ? s.next_prompt_token() : -1;
  q.kv_out_key = s.kv_out_key();
  q.block_table.assign(s.block_table().begin(), s.block_table().end());
  if (s.has_constraint() && s.constraint().kind_case() != v1::OutputConstraint::KIND_NOT_SET) {
    q.constraint = std::make_shared<const structured::Constraint>(
        ConstraintFromProto(s.constraint()));
  }
  return q;
}

}  // namespace

structured::Constraint ConstraintFromProto(const v1::OutputConstraint& in) {
  structured::Constraint c;
  switch (in.kind_case()) {
    case v1::OutputConstraint::kJsonObject: c.kind = structured::Constraint::kJsonObject; break;
    case v1::OutputConstraint::kJsonSchema:
      c.kind = structured::Constraint::kJsonSchema;
      c.text = in.json_schema();
      break;
    case v1::OutputConstraint::kRegex:
      c.kind = structured::Constraint::kRegex;
      c.text = in.regex();
      break;
    case v1::OutputConstraint::kChoice:
      c.kind = structured::Constraint::kChoice;
      c.options.assign(in.choice().options().begin(), in.choice().options().end());
      break;
    case v1::OutputConstraint::KIND_NOT_SET: break;
  }
  return c;
}

v1::OutputConstraint ConstraintToProto(const structured::Constraint& in) {
  v1::OutputConstraint out;
  switch (in.kind) {
    case structured::Constraint::kJsonObject: out.set_json_object(true); break;
    case structured::Constraint::kJsonSchema: out.set_json_schema(in.text); break;
    case structured::Constraint::kRegex: out.set_regex(in.text); break;
    case structured::Constraint::kChoice:
      for (const std::string& o : in.options) out.mutable_choice()->add_options(o);
      break;
    case structured::Constraint::kNone: break;
  }
  return out;
}

v1::StepRequest ToStepRequest(const StepDescriptor& step, uint64_t assignment_id) {
  v1::StepRequest req;
  req.set_assignment_id(assignment_id);
  req.set_step_id(step.id);
  for (const SequenceStep& row : step.seqs) ToProto(row, *req.add_seqs());
  req.mutable_tokens()->Add(step.tokens.begin(), step.tokens.end());
  return req;
}

StepDescriptor FromStepRequest(const v1::StepRequest& req) {
  StepDescriptor d;
  d.id = req.step_id();
  d.seqs.reserve(req.seqs_size());
  for (const v1::SequenceStep& s : req.seqs()) d.seqs.push_back(FromProto(s));
  d.tokens.assign(req.tokens().begin(), req.tokens().end());
  return d;
}

void AddLogprobs(const std::vector<SequenceLogprobs>& logprobs, v1::StepResult& result) {
  for (const SequenceLogprobs& l : logprobs) {
    v1::SequenceLogprobs* m = result.add_logprobs();
    m->set_seq(l.seq);
    if (l.has_sampled) ToProto(l.sampled, *m->mutable_sampled());
    for (const TokenLogprob& p : l.prompt) ToProto(p, *m->add_prompt());
  }
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
