// coordinator/peer_address.cc: a worker may register only an address where it runs itself.
#include "coordinator/peer_address.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

TEST(PeerAddressTest, LoopbackCallerMayRegisterLoopbackAddresses) {
  EXPECT_TRUE(CheckAddressMatchesPeer("127.0.0.1:5000", "ipv4:127.0.0.1:41234").ok());
  EXPECT_TRUE(CheckAddressMatchesPeer("localhost:5000", "ipv4:127.0.0.1:41234").ok());
  EXPECT_TRUE(CheckAddressMatchesPeer("[::1]:5000", "ipv6:[::1]:41234").ok());
  EXPECT_TRUE(CheckAddressMatchesPeer("127.0.0.1:5000", "ipv6:[::ffff:127.0.0.1]:41234").ok());
  EXPECT_TRUE(CheckAddressMatchesPeer("127.0.0.1:5000", "unix:/tmp/socket").ok());
}

TEST(PeerAddressTest, ARemoteCallerMayRegisterItsOwnIp) {
  // 192.0.2.0/24 (TEST-NET-1) is never an address of this machine.
  EXPECT_TRUE(CheckAddressMatchesPeer("192.0.2.7:5000", "ipv4:192.0.2.7:41234").ok());
}

TEST(PeerAddressTest, RefusesAnotherMachinesAddressFromLoopback) {
  absl::Status s = CheckAddressMatchesPeer("192.0.2.1:5000", "ipv4:127.0.0.1:41234");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), ::testing::HasSubstr("192.0.2.1:5000"));
  EXPECT_THAT(s.message(), ::testing::HasSubstr("ipv4:127.0.0.1:41234"));
}

TEST(PeerAddressTest, RefusesARemoteCallerRegisteringAnotherAddress) {
  EXPECT_EQ(CheckAddressMatchesPeer("192.0.2.8:5000", "ipv4:192.0.2.7:41234").code(),
            absl::StatusCode::kPermissionDenied);
  // This machine's loopback is not the remote caller's.
  EXPECT_EQ(CheckAddressMatchesPeer("127.0.0.1:5000", "ipv4:192.0.2.7:41234").code(),
            absl::StatusCode::kPermissionDenied);
}

TEST(PeerAddressTest, RefusesAHostThatDoesNotResolve) {
  absl::Status s = CheckAddressMatchesPeer("no-such-host.invalid:5000", "ipv4:127.0.0.1:1");
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(s.message(), ::testing::HasSubstr("does not resolve"));
}

TEST(PeerAddressTest, RefusesAnUnknownPeerKind) {
  EXPECT_EQ(CheckAddressMatchesPeer("127.0.0.1:5000", "").code(),
            absl::StatusCode::kPermissionDenied);
}

TEST(PeerAddressTest, MalformedAddressIsInvalid) {
  EXPECT_EQ(CheckAddressMatchesPeer("no-port", "ipv4:127.0.0.1:1").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckAddressMatchesPeer(":5000", "ipv4:127.0.0.1:1").code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tandem
