// Thread names through pthread_setname_np (common/thread_name.h).
#include "common/thread_name.h"

#include <pthread.h>

#include <string>

namespace tandem {

void SetThreadName(std::string_view name) {
  // The kernel's limit is 16 bytes with the terminating NUL; a longer name fails with ERANGE.
  const std::string cut(name.substr(0, 15));
  pthread_setname_np(pthread_self(), cut.c_str());
}

}  // namespace tandem
