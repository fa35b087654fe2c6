// Outputs written atomically: a refused, failed or interrupted write leaves the target as it
// was, a link keeps pointing at the file it names, a device is written in place; the library
// installs no signal handler of its own (install_output_cleanup is the program's choice).
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "ess/core/error.h"
#include "ess/io/output_file.h"
#include "testing/testing.h"

namespace ess {
namespace {

namespace fs = std::filesystem;

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class Files : public test::TempDirTest {
 protected:
  std::size_t entries() const { return static_cast<std::size_t>(std::distance(fs::directory_iterator(dir_), {})); }
};

TEST_F(Files, AnUncommittedWriteLeavesTheTargetAndNoTemporary) {
  const auto target = dir_ / "out.txt";
  std::ofstream(target) << "old";
  {
    AtomicFile f(target.string(), "out");
    f.write(std::string("new, half"));
  }  // no commit: an error happened
  EXPECT_EQ(slurp(target), "old");
  EXPECT_EQ(entries(), 1u);
  write_text_file(target.string(), "new", "out");
  EXPECT_EQ(slurp(target), "new");
  EXPECT_EQ(entries(), 1u);
}

TEST_F(Files, AnInterruptedWriteLeavesTheTargetAndNoTemporary) {
  const auto target = dir_ / "out.txt";
  std::ofstream(target) << "old";
  for (const int sig : {SIGTERM, SIGINT, SIGHUP}) {
    struct sigaction now {};
    ASSERT_EQ(::sigaction(sig, nullptr, &now), 0);
    if (now.sa_handler == SIG_IGN) continue;  // ignored by whoever started the test (nohup, a background job)
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {  // the child, which chose the cleanup, is killed half-way through its write
      install_output_cleanup();
      AtomicFile f(target.string(), "out");
      f.write(std::string("new, half"));
      ::raise(sig);
      ::_exit(0);  // not reached
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFSIGNALED(status)) << "signal " << sig;
    EXPECT_EQ(WTERMSIG(status), sig);
    EXPECT_EQ(slurp(target), "old");
    EXPECT_EQ(entries(), 1u) << "a temporary is left after signal " << sig;
  }
}

TEST_F(Files, ALinkKeepsPointingAtTheFileItNames) {
  const auto real = dir_ / "real.txt", link = dir_ / "link.txt";
  std::ofstream(real) << "old";
  fs::create_symlink(real, link);
  write_text_file(link.string(), "new", "out");
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(slurp(real), "new");
}

TEST_F(Files, ADeviceIsWrittenInPlace) {
  write_text_file("/dev/null", "discarded", "out");
  struct stat st {};
  ASSERT_EQ(::stat("/dev/null", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
}

TEST_F(Files, TheLibraryInstallsNoSignalHandler) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // a program that did not call install_output_cleanup: its handlers stay its own
    struct sigaction before[3] {}, after[3] {};
    const int sigs[3] = {SIGINT, SIGTERM, SIGHUP};
    for (int i = 0; i < 3; ++i) ::sigaction(sigs[i], nullptr, &before[i]);
    AtomicFile f((dir_ / "out.txt").string(), "out");
    f.write(std::string("x"));
    f.commit();
    write_text_file((dir_ / "out2.txt").string(), "y", "out");
    bool same = true;
    for (int i = 0; i < 3; ++i) {
      ::sigaction(sigs[i], nullptr, &after[i]);
      same = same && after[i].sa_handler == before[i].sa_handler;
    }
    ::_exit(same ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "writing an output changed the program's signal handlers";
}

TEST_F(Files, BadOutputsAreRefusedByName) {
  EXPECT_NE(test::error_of([&] { check_output_file(dir_.string(), "--output"); }).find("is a directory"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { check_output_file((dir_ / "no" / "x").string(), "--output"); }).find("does not exist"),
            std::string::npos);
  const auto in = dir_ / "in.json";
  std::ofstream(in) << "{}";
  const std::string same = (dir_ / "." / "in.json").string();
  EXPECT_NE(test::error_of([&] { check_output_file(same, "--output", {in.string()}); }).find("also an input"),
            std::string::npos);
  EXPECT_TRUE(same_file((dir_ / "new.txt").string(), (dir_ / "." / "new.txt").string()));
}

}  // namespace
}  // namespace ess
