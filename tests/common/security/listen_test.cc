// Which listening addresses other hosts reach, and when one without a cluster secret is refused
// (common/security/listen.h).
#include "common/security/listen.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(IsLoopbackAddressTest, LoopbackHostsAndUnixSocketsOnly) {
  for (const char* a : {"127.0.0.1:50051", "127.1.2.3:0", "localhost:80", "[::1]:50051",
                        "unix:/tmp/tandem.sock", "unix-abstract:tandem"}) {
    EXPECT_TRUE(IsLoopbackAddress(a)) << a;
  }
  for (const char* a :
       {"0.0.0.0:50051", "[::]:50051", ":50051", "10.0.0.7:50051", "node17:50051",
        "127.0.0.1.example.com:1", "128.0.0.1:50051", "[::ffff:10.0.0.1]:1", "127.0.0.256:1"}) {
    EXPECT_FALSE(IsLoopbackAddress(a)) << a;
  }
}

TEST(CheckClusterListenTest, OpenAddressNeedsASecretACaOrTheExplicitFlag) {
  const absl::Status refused = CheckClusterListen("--listen", "0.0.0.0:50051", {});
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(),
              AllOf(HasSubstr("--listen 0.0.0.0:50051"), HasSubstr("--cluster_secret"),
                    HasSubstr("--tls_ca"), HasSubstr("--allow_insecure")));
  EXPECT_TRUE(CheckClusterListen("--listen", "0.0.0.0:1", {.has_secret = true}).ok());
  EXPECT_TRUE(CheckClusterListen("--listen", "0.0.0.0:1", {.has_client_ca = true}).ok());
  EXPECT_TRUE(CheckClusterListen("--listen", "0.0.0.0:1", {.allow_insecure = true}).ok());
  EXPECT_TRUE(CheckClusterListen("--listen", "127.0.0.1:1", {}).ok());
}

TEST(CannotListenMessageTest, NamesThePortAndWhatToDo) {
  EXPECT_THAT(CannotListenMessage("--listen", "127.0.0.1:50051"),
              AllOf(HasSubstr("--listen 127.0.0.1:50051"), HasSubstr("port 50051 is taken"),
                    HasSubstr("choose a free port")));
}

}  // namespace
}  // namespace tandem
