// Real processes on loopback for integration tests: a coordinator and its workers, started from
// the built binaries on free ports and always killed when the test ends (even on failure: the
// children also die with the test process).
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/security/credentials.h"
#include "grpcpp/grpcpp.h"
#include "proto/tandem.grpc.pb.h"

namespace tandem::testing {

// The whole file; empty when it cannot be read.
std::string ReadFile(const std::filesystem::path& path);
// N of the "<program> metrics on port N" line a daemon printed to `log`; -1 when absent.
int PrintedMetricsPort(const std::string& log, const std::string& program);

// One child process; its stdout and stderr go to `log`. Killed (SIGKILL) and reaped on
// destruction.
class Process {
 public:
  // `cwd`: the working directory (empty: the test's).
  static absl::StatusOr<std::unique_ptr<Process>> Start(const std::vector<std::string>& argv,
                                                        const std::filesystem::path& log,
                                                        const std::filesystem::path& cwd = {});
  ~Process();
  // Waits for the "listening on port N" line that the daemons print; returns N.
  absl::StatusOr<int> WaitForPort(double timeout_s = 30);
  void Kill(int signal);
  pid_t pid() const { return pid_; }
  std::string Log() const;

 private:
  Process(pid_t pid, std::filesystem::path log) : pid_(pid), log_(std::move(log)) {}
  pid_t pid_;
  std::filesystem::path log_;
  bool reaped_ = false;
};

struct ClusterOptions {
  std::filesystem::path model_dir;
  int workers = 1;
  int stages = 1;
  int replicas = 1;
  std::vector<std::string> coordinator_flags;  // extra --flag=value
  std::vector<std::string> worker_flags;       // extra --flag=value of every worker
  // How the test's stubs reach the coordinator: inference() and channel() with the first,
  // admin() with the second (TLS, keys; default: plain, no key).
  ClientAuth inference_auth;
  ClientAuth admin_auth;
  std::vector<std::vector<std::string>> flags_of_worker;  // more flags of worker i (e.g. --gpu=i)
  // The coordinator's working directory (empty: the test's, as the workers').
  std::filesystem::path coordinator_cwd;
  // The coordinator's own heartbeat settings instead of the short ones of the tests.
  bool default_heartbeats = false;
  // false: Start returns once every process listens, serving or not.
  bool wait_until_serving = true;
};

class Cluster {
 public:
  // Starts the coordinator and the workers and waits until the topology serves.
  static absl::StatusOr<std::unique_ptr<Cluster>> Start(const ClusterOptions& options);
  ~Cluster();

  // Waits until exactly `pipelines` pipelines of `stages` stages each serve.
  absl::Status WaitForTopology(int pipelines, int stages, double timeout_s = 60);
  // Waits until ListWorkers shows `n` workers, none of them down.
  absl::Status WaitForLiveWorkers(int n, double timeout_s = 60);
  // Kills the coordinator (SIGKILL) and starts it again with the same flags on the same port;
  // returns once it listens (the workers find it on their own).
  absl::Status KillAndRestartCoordinator();
  // Kills worker i (SIGKILL, if it still runs) and starts it again with the same flags; it listens
  // on a new port (worker_port(i)) and registers as a new worker. Returns once it listens.
  absl::Status RestartWorker(int i);
  pid_t coordinator_pid() const { return coordinator_->pid(); }
  std::string address() const { return address_; }
  v1::Inference::Stub& inference() { return *inference_; }
  v1::Admin::Stub& admin() { return *admin_; }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }
  Process& worker(int i) { return *workers_[i]; }
  int worker_port(int i) const { return worker_ports_[i]; }
  // The logs of every process, for failure messages.
  std::string Logs() const;

 private:
  std::filesystem::path dir_;
  std::unique_ptr<Process> coordinator_;
  std::vector<std::string> coordinator_argv_;
  int coordinator_starts_ = 0;
  // Starts worker i from worker_argv_[i], logging to `log_name`, and waits until it listens.
  absl::Status StartWorker(int i, const std::string& log_name);

  std::vector<std::unique_ptr<Process>> workers_;
  std::vector<std::vector<std::string>> worker_argv_;
  int worker_starts_ = 0;
  std::vector<int> worker_ports_;
  std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Inference::Stub> inference_;
  std::unique_ptr<v1::Admin::Stub> admin_;
};

}  // namespace tandem::testing
