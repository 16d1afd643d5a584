// Starting and stopping the daemons for integration tests.
#include "tests/integration/cluster.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace tandem::testing {

absl::StatusOr<std::unique_ptr<Process>> Process::Start(const std::vector<std::string>& argv,
                                                        const std::filesystem::path& log,
                                                        const std::filesystem::path& cwd) {
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    // Die with the test, whatever happens to it.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    if (!cwd.empty() && chdir(cwd.c_str()) != 0) _exit(127);
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  return std::unique_ptr<Process>(new Process(pid, log));
}

Process::~Process() { Kill(SIGKILL); }

void Process::Kill(int signal) {
  if (reaped_) return;
  ::kill(pid_, signal);
  if (signal == SIGKILL) {
    int status = 0;
    waitpid(pid_, &status, 0);
    reaped_ = true;
  }
}

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int PrintedMetricsPort(const std::string& log, const std::string& program) {
  std::smatch m;
  const std::regex re(program + " metrics on port ([0-9]+)");
  return std::regex_search(log, m, re) ? std::stoi(m[1].str()) : -1;
}

std::string Process::Log() const { return ReadFile(log_); }

absl::StatusOr<int> Process::WaitForPort(double timeout_s) {
  static const std::regex kLine("listening on port ([0-9]+)");
  const absl::Time deadline = absl::Now() + absl::Seconds(timeout_s);
  while (absl::Now() < deadline) {
    std::smatch m;
    const std::string log = Log();
    if (std::regex_search(log, m, kLine)) return std::stoi(m[1].str());
    int status = 0;
    if (!reaped_ && waitpid(pid_, &status, WNOHANG) == pid_) {
      reaped_ = true;
      return absl::InternalError(absl::StrCat("process exited before listening:\n", log));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return absl::DeadlineExceededError(absl::StrCat("no port within the timeout:\n", Log()));
}

namespace {
// A daemon's binary: next to the test's where both were copied elsewhere (a GPU machine's
// .carry/bin), else the build's.
std::string Binary(const std::string& name, const std::string& built) {
  std::error_code ec;
  const std::filesystem::path here = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec && std::filesystem::exists(here.parent_path() / name) &&
      !std::filesystem::exists(built)) {
    return (here.parent_path() / name).string();
  }
  return built;
}
}  // namespace

absl::StatusOr<std::unique_ptr<Cluster>> Cluster::Start(const ClusterOptions& o) {
  static std::atomic<int> counter{0};
  auto c = std::make_unique<Cluster>();
  c->dir_ = std::filesystem::path(::testing::TempDir()) /
            absl::StrFormat("cluster-%d-%d", getpid(), counter++);
  std::filesystem::create_directories(c->dir_);
  std::vector<std::string> argv = {Binary("tandem-coordinator", TANDEM_COORDINATOR_BIN),
                                   "--listen=127.0.0.1:0",
                                   absl::StrCat("--model_dir=", o.model_dir.string()),
                                   absl::StrCat("--stages=", o.stages),
                                   absl::StrCat("--replicas=", o.replicas)};
  if (!o.default_heartbeats) {
    argv.insert(argv.end(), {"--heartbeat_interval_ms=100", "--heartbeat_timeout_ms=700"});
  }
  argv.insert(argv.end(), o.coordinator_flags.begin(), o.coordinator_flags.end());
  absl::StatusOr<std::unique_ptr<Process>> coord =
      Process::Start(argv, c->dir_ / "coordinator.log", o.coordinator_cwd);
  if (!coord.ok()) return coord.status();
  c->coordinator_ = *std::move(coord);
  absl::StatusOr<int> port = c->coordinator_->WaitForPort();
  if (!port.ok()) return port.status();
  c->address_ = absl::StrCat("127.0.0.1:", *port);
  argv[1] = absl::StrCat("--listen=", c->address_);  // a restart takes the same port
  c->coordinator_argv_ = std::move(argv);
  for (int i = 0; i < o.workers; ++i) {
    std::vector<std::string> worker_argv = {Binary("tandem-worker", TANDEM_WORKER_BIN),
                                            absl::StrCat("--coordinator=", c->address_),
                                            "--listen=127.0.0.1:0", "--recv_timeout_s=30",
                                            // CPU stages too hold a launched step, so that the
                                            // tests go through the path CUDA stages take.
                                            "--launch_ahead=always"};
    worker_argv.insert(worker_argv.end(), o.worker_flags.begin(), o.worker_flags.end());
    if (i < static_cast<int>(o.flags_of_worker.size())) {
      worker_argv.insert(worker_argv.end(), o.flags_of_worker[i].begin(),
                         o.flags_of_worker[i].end());
    }
    c->worker_argv_.push_back(std::move(worker_argv));
    c->workers_.emplace_back();
    c->worker_ports_.push_back(0);
    if (absl::Status s = c->StartWorker(i, absl::StrFormat("worker-%d.log", i)); !s.ok()) return s;
  }
  c->channel_ = MakeChannel(c->address_, o.inference_auth);
  c->inference_ = v1::Inference::NewStub(c->channel_);
  c->admin_ = v1::Admin::NewStub(MakeChannel(c->address_, o.admin_auth));
  if (!o.wait_until_serving) return c;
  if (absl::Status s = c->WaitForTopology(o.replicas, o.stages); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(s.message(), "\n", c->Logs()));
  }
  // The pipelines may serve before the workers they leave idle have registered.
  if (absl::Status s = c->WaitForLiveWorkers(o.workers); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(s.message(), "\n", c->Logs()));
  }
  return c;
}

absl::Status Cluster::KillAndRestartCoordinator() {
  coordinator_->Kill(SIGKILL);
  absl::StatusOr<std::unique_ptr<Process>> coord = Process::Start(
      coordinator_argv_, dir_ / absl::StrFormat("coordinator-%d.log", ++coordinator_starts_));
  if (!coord.ok()) return coord.status();
  coordinator_ = *std::move(coord);
  return coordinator_->WaitForPort().status();
}

absl::Status Cluster::StartWorker(int i, const std::string& log_name) {
  absl::StatusOr<std::unique_ptr<Process>> worker =
      Process::Start(worker_argv_[i], dir_ / log_name);
  if (!worker.ok()) return worker.status();
  workers_[i] = *std::move(worker);
  absl::StatusOr<int> port = workers_[i]->WaitForPort();
  if (!port.ok()) return port.status();
  worker_ports_[i] = *port;
  return absl::OkStatus();
}

absl::Status Cluster::RestartWorker(int i) {
  workers_[i]->Kill(SIGKILL);
  return StartWorker(i, absl::StrFormat("worker-%d-%d.log", i, ++worker_starts_));
}

Cluster::~Cluster() {
  workers_.clear();
  coordinator_.reset();
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

absl::Status Cluster::WaitForLiveWorkers(int n, double timeout_s) {
  const absl::Time deadline = absl::Now() + absl::Seconds(timeout_s);
  std::string last;
  while (absl::Now() < deadline) {
    grpc::ClientContext ctx;
    v1::ListWorkersResponse resp;
    if (admin().ListWorkers(&ctx, {}, &resp).ok()) {
      bool ok = resp.workers_size() == n;
      for (const v1::WorkerInfo& w : resp.workers()) ok &= w.state() != v1::WORKER_STATE_DOWN;
      if (ok) return absl::OkStatus();
      last = resp.DebugString();
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(
      absl::StrFormat("ListWorkers did not show %d live workers; last seen:\n%s", n, last));
}

absl::Status Cluster::WaitForTopology(int pipelines, int stages, double timeout_s) {
  const absl::Time deadline = absl::Now() + absl::Seconds(timeout_s);
  std::string last;
  while (absl::Now() < deadline) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::Topology t;
    if (admin_->GetTopology(&ctx, v1::GetTopologyRequest(), &t).ok()) {
      bool ok = t.pipelines_size() == pipelines;
      for (const auto& p : t.pipelines()) ok &= p.stages_size() == stages;
      if (ok) return absl::OkStatus();
      last = t.DebugString();
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrFormat(
      "topology did not become %d x %d stages; last seen:\n%s", pipelines, stages, last));
}

std::string Cluster::Logs() const {
  std::string out = absl::StrCat("--- coordinator\n", coordinator_ ? coordinator_->Log() : "");
  for (size_t i = 0; i < workers_.size(); ++i) {
    absl::StrAppend(&out, "--- worker ", i, "\n", workers_[i]->Log());
  }
  return out;
}

}  // namespace tandem::testing
