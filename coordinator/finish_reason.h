// Why a sequence ended, in the scheduler's own terms (stop_rules.h says when each applies). The
// wire's v1::FinishReason is made from it in one place: RequestState, which the front ends read.
#pragma once

#include "proto/tandem.pb.h"

namespace tandem {

enum class FinishReason {
  kNone,    // not ended, or ended by an error or a cancel (the status says which)
  kEos,     // an EOS token
  kStop,    // a stop token or stop string
  kLength,  // max_new_tokens, or the context is full
};

v1::FinishReason FinishReasonToProto(FinishReason finish);

}  // namespace tandem
