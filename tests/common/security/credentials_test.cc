// common/security/credentials.cc: key comparison, the Bearer header check, and the errors of
// credentials built from files that are missing or incomplete.
#include "common/security/credentials.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tandem {
namespace {

using ::testing::HasSubstr;

TEST(ConstantTimeEqualsTest, EqualOnlyForTheSameBytes) {
  EXPECT_TRUE(ConstantTimeEquals("s3cret", "s3cret"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_FALSE(ConstantTimeEquals("s3cret", "s3creT"));
  EXPECT_FALSE(ConstantTimeEquals("s3cret", "x3cret"));
  EXPECT_FALSE(ConstantTimeEquals("s3cret", "s3cre"));
  EXPECT_FALSE(ConstantTimeEquals("s3cre", "s3cret"));
  EXPECT_FALSE(ConstantTimeEquals("", "s"));
  // A shorter string is not a match for its zero-padded form.
  EXPECT_FALSE(ConstantTimeEquals(std::string_view("ab\0", 3), "ab"));
}

const CallerPolicy kPolicy{.key = "k-123", .key_name = "api key"};

TEST(CheckBearerTest, AcceptsTheKeyWithAnyCaseOfTheScheme) {
  EXPECT_TRUE(CheckBearer("Bearer k-123", kPolicy).ok());
  EXPECT_TRUE(CheckBearer("bearer k-123", kPolicy).ok());
  EXPECT_TRUE(CheckBearer("BEARER  k-123 ", kPolicy).ok());
}

TEST(CheckBearerTest, RefusesAMissingHeaderNamingTheKey) {
  absl::Status s = CheckBearer("", kPolicy);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(s.message(), HasSubstr("no api key given"));
}

TEST(CheckBearerTest, RefusesAWrongKeyWithoutRevealingIt) {
  absl::Status s = CheckBearer("Bearer k-124", kPolicy);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(s.message(), "invalid api key");
  EXPECT_EQ(CheckBearer("Bearer k-12", kPolicy).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(CheckBearer("Bearer ", kPolicy).code(), absl::StatusCode::kUnauthenticated);
}

TEST(CheckBearerTest, RefusesAnotherScheme) {
  EXPECT_EQ(CheckBearer("Basic k-123", kPolicy).code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(CheckBearer("k-123", kPolicy).code(), absl::StatusCode::kUnauthenticated);
}

TEST(CheckBearerTest, NoKeyConfiguredLetsEveryoneIn) {
  EXPECT_TRUE(CheckBearer("", CallerPolicy{}).ok());
  EXPECT_TRUE(CheckBearer("Bearer anything", CallerPolicy{}).ok());
}

TEST(MakeServerCredentialsTest, PlainWithoutFiles) {
  EXPECT_TRUE(MakeServerCredentials({}, ClientCerts::kRequired).ok());
}

TEST(MakeServerCredentialsTest, RefusesACaWithoutACertificate) {
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> c =
      MakeServerCredentials({.ca = "/some/ca.pem"}, ClientCerts::kRequired);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("--tls_ca without --tls_cert"));
}

TEST(MakeServerCredentialsTest, RefusesACertificateWithoutItsKey) {
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> c =
      MakeServerCredentials({.cert = "/some/cert.pem"}, ClientCerts::kRequired);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("--tls_key"));
}

TEST(MakeServerCredentialsTest, NamesTheFlagOfAnUnreadableFile) {
  const std::filesystem::path dir = std::filesystem::path(TANDEM_TEST_TMPDIR) / "credentials";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "cert.pem") << "-----BEGIN CERTIFICATE-----\n";
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> c = MakeServerCredentials(
      {.cert = (dir / "cert.pem").string(), .key = (dir / "missing-key.pem").string()},
      ClientCerts::kRequired);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("--tls_key: cannot read"));
  EXPECT_THAT(c.status().message(), HasSubstr("missing-key.pem"));
}

TEST(MakeClientAuthTest, PlainChannelCarriesTheKey) {
  absl::StatusOr<ClientAuth> a = MakeClientAuth({}, "k");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->credentials, nullptr);
  EXPECT_EQ(a->key, "k");
}

TEST(MakeClientAuthTest, NamesTheFlagOfAnUnreadableCa) {
  absl::StatusOr<ClientAuth> a = MakeClientAuth({.ca = "/nonexistent/ca.pem"}, "");
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(a.status().message(), HasSubstr("--tls_ca: cannot read '/nonexistent/ca.pem'"));
}

TEST(FlagOrEnvTest, FlagFirstThenEnvironment) {
  ::setenv("TANDEM_TEST_KEY", "from-env", 1);
  EXPECT_EQ(FlagOrEnv("from-flag", "TANDEM_TEST_KEY"), "from-flag");
  EXPECT_EQ(FlagOrEnv("", "TANDEM_TEST_KEY"), "from-env");
  ::unsetenv("TANDEM_TEST_KEY");
  EXPECT_EQ(FlagOrEnv("", "TANDEM_TEST_KEY"), "");
}

}  // namespace
}  // namespace tandem
