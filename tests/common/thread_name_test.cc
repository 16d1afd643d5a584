#include "common/thread_name.h"

#include <pthread.h>

#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace tandem {
namespace {

// The name a new thread reports after SetThreadName(name).
std::string NameSeenAfterSetting(const std::string& name) {
  std::string seen;
  std::thread t([&] {
    SetThreadName(name);
    char buf[32] = {};
    pthread_getname_np(pthread_self(), buf, sizeof(buf));
    seen = buf;
  });
  t.join();
  return seen;
}

TEST(SetThreadName, NamesTheCallingThread) {
  EXPECT_EQ(NameSeenAfterSetting("scheduler"), "scheduler");
}

TEST(SetThreadName, KeepsTheFirstFifteenBytesOfALongName) {
  EXPECT_EQ(NameSeenAfterSetting("p12a345-stage-reader"), "p12a345-stage-r");
}

}  // namespace
}  // namespace tandem
