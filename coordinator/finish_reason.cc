#include "coordinator/finish_reason.h"

namespace tandem {

v1::FinishReason FinishReasonToProto(FinishReason finish) {
  switch (finish) {
    case FinishReason::kNone: return v1::FINISH_REASON_UNSPECIFIED;
    case FinishReason::kEos: return v1::FINISH_REASON_EOS;
    case FinishReason::kStop: return v1::FINISH_REASON_STOP;
    case FinishReason::kLength: return v1::FINISH_REASON_LENGTH;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

}  // namespace tandem
