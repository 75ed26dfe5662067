// shardtorch::files: the POSIX file calls that stand in for std::filesystem
// (src/base/files.h says why). Expected values are std::filesystem's.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <fstream>

#include "../src/base/files.h"
#include "temp_dir.h"

namespace files = shardtorch::files;
using testmodels::TempDir;

TEST(Files, PathArithmeticAgreesWithStdFilesystem) {
  EXPECT_EQ(files::parent_path("a/b"), "a");
  EXPECT_EQ(files::parent_path("a//b"), "a");
  EXPECT_EQ(files::parent_path("/a"), "/");
  EXPECT_EQ(files::parent_path("b"), "");
  EXPECT_EQ(files::parent_path("a/b/"), "a/b");
  EXPECT_EQ(files::directory_of("a/b"), "a");
  EXPECT_EQ(files::directory_of("b"), ".");
  EXPECT_EQ(files::directory_of("/b"), "/");
  EXPECT_EQ(files::filename("a/b"), "b");
  EXPECT_EQ(files::filename("b"), "b");
  EXPECT_EQ(files::filename("a/"), "");
  EXPECT_EQ(files::lexically_normal("a/./b/../c/"), "a/c/");
  EXPECT_EQ(files::lexically_normal("a/b/.."), "a/");
  EXPECT_EQ(files::lexically_normal("a/.."), ".");
  EXPECT_EQ(files::lexically_normal("./a"), "a");
  EXPECT_EQ(files::lexically_normal("../a/../../b"), "../../b");
  EXPECT_EQ(files::lexically_normal("/../a//b"), "/a/b");
  EXPECT_EQ(files::lexically_normal("ck/"), "ck/");
  EXPECT_EQ(files::lexically_normal("."), ".");
  EXPECT_EQ(files::lexically_normal(""), "");
  EXPECT_EQ(files::join("a", "b"), "a/b");
  EXPECT_EQ(files::join("a/", "b"), "a/b");
  EXPECT_EQ(files::join("", "b"), "b");
}

TEST(Files, TreesAreMadeCopiedListedAndRemoved) {
  const TempDir made("shardtorch-files");  // removed by the test itself; by this if an ASSERT stops it first
  const std::string root = made.string();
  ASSERT_TRUE(files::is_directory(root));
  EXPECT_TRUE(files::is_empty_directory(root));
  files::create_directories(root + "/a/b/c");
  ASSERT_TRUE(files::is_directory(root + "/a/b/c"));
  std::ofstream(root + "/a/b/f.txt") << "12345";
  std::ofstream(root + "/a/g.txt") << "x";
  ASSERT_EQ(::symlink("/nonexistent-target", (root + "/a/dangling").c_str()), 0);
  EXPECT_FALSE(files::is_empty_directory(root));
  EXPECT_EQ(files::file_size(root + "/a/b/f.txt"), 5);
  EXPECT_TRUE(files::exists(root + "/a/dangling"));  // the link itself, as remove_all must see it
  EXPECT_EQ(files::list_directory(root + "/a"), (std::vector<std::string>{"b", "dangling", "g.txt"}));

  files::copy_tree(root + "/a/b", root + "/copy");
  EXPECT_EQ(files::list_directory(root + "/copy"), (std::vector<std::string>{"c", "f.txt"}));
  EXPECT_EQ(files::file_size(root + "/copy/f.txt"), 5);
  files::resize_file(root + "/copy/f.txt", 2);
  EXPECT_EQ(files::file_size(root + "/copy/f.txt"), 2);
  EXPECT_EQ(files::file_size(root + "/a/b/f.txt"), 5) << "the copy shares the original's bytes";
  files::copy_file(root + "/a/g.txt", root + "/copy/f.txt");  // replaces
  EXPECT_EQ(files::file_size(root + "/copy/f.txt"), 1);

  EXPECT_NO_THROW(files::sync(root + "/copy/f.txt"));
  EXPECT_NO_THROW(files::sync(root + "/copy", /*directory=*/true));
  bool between = false;
  files::rename_durably(root + "/copy/f.txt", root + "/copy/h.txt",
                        [&] { between = files::exists(root + "/copy/h.txt") && !files::exists(root + "/copy/f.txt"); });
  EXPECT_TRUE(between) << "the callback runs after the rename";
  files::rename(root + "/copy/h.txt", root + "/copy/f.txt");
  files::rename(root + "/copy", root + "/moved");
  EXPECT_FALSE(files::exists(root + "/copy"));
  EXPECT_TRUE(files::is_regular_file(root + "/moved/f.txt"));
  EXPECT_TRUE(files::remove(root + "/moved/f.txt"));
  EXPECT_FALSE(files::remove(root + "/moved/f.txt")) << "absent: false, not an error";

  files::remove_all(root);
  EXPECT_FALSE(files::exists(root));
  EXPECT_NO_THROW(files::remove_all(root)) << "nothing to remove is no error";
}

// link_tree: the same tree again, its files the same inodes, its links
// links again (a dangling one too), a FIFO left out and named.
TEST(Files, ATreeIsLinkedAgainWithItsLinksAndWithoutAFifo) {
  const TempDir made("shardtorch-files-link");
  const std::string root = made.string();
  files::create_directories(root + "/a/logs");
  std::ofstream(root + "/a/logs/train.log") << "step 1\n";
  std::ofstream(root + "/a/config.json") << "{}";
  ASSERT_EQ(::chmod((root + "/a/config.json").c_str(), 0600), 0);
  ASSERT_EQ(::symlink("config.json", (root + "/a/latest").c_str()), 0);
  ASSERT_EQ(::symlink("/nonexistent-target", (root + "/a/dangling").c_str()), 0);
  ASSERT_EQ(::mkfifo((root + "/a/pipe").c_str(), 0600), 0);
  const auto left_out = files::link_tree(root + "/a", root + "/b");
  EXPECT_EQ(left_out, (std::vector<std::string>{root + "/a/pipe"}));
  EXPECT_EQ(files::list_directory(root + "/b"),
            (std::vector<std::string>{"config.json", "dangling", "latest", "logs"}));
  struct stat a, b;
  ASSERT_EQ(::stat((root + "/a/logs/train.log").c_str(), &a), 0);
  ASSERT_EQ(::stat((root + "/b/logs/train.log").c_str(), &b), 0);
  EXPECT_EQ(a.st_ino, b.st_ino) << "a file is linked, not copied";
  ASSERT_EQ(::lstat((root + "/b/latest").c_str(), &b), 0);
  EXPECT_TRUE(S_ISLNK(b.st_mode)) << "a link is made again as a link";
  char target[64] = {};
  ASSERT_GT(::readlink((root + "/b/dangling").c_str(), target, sizeof(target) - 1), 0);
  EXPECT_STREQ(target, "/nonexistent-target");
  ASSERT_EQ(::stat((root + "/b/config.json").c_str(), &b), 0);
  EXPECT_EQ(b.st_mode & 0777, 0600u);
  EXPECT_TRUE(files::link_tree(root + "/vanished", root + "/c").empty()) << "an entry gone meanwhile is skipped";
  EXPECT_FALSE(files::exists(root + "/c"));
}

TEST(Files, FailuresNameTheCallThePathAndTheReason) {
  const TempDir made("shardtorch-files");
  const std::string root = made.string();
  auto message = [](auto f) {
    try {
      f();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::string e = message([&] { files::file_size(root + "/absent"); });
  EXPECT_NE(e.find(root + "/absent"), std::string::npos) << e;
  EXPECT_NE(e.find("No such file"), std::string::npos) << e;
  e = message([&] { files::rename(root + "/absent", root + "/b"); });
  EXPECT_NE(e.find("renaming '" + root + "/absent'"), std::string::npos) << e;
  std::ofstream(root + "/file") << "x";
  e = message([&] { files::create_directories(root + "/file/sub"); });
  EXPECT_NE(e.find("'" + root + "/file/sub'"), std::string::npos) << e;
  EXPECT_NE(e.find("'" + root + "/file' exists and is not a directory"), std::string::npos) << e;
  e = message([&] { files::list_directory(root + "/file"); });
  EXPECT_NE(e.find("Not a directory"), std::string::npos) << e;
  e = message([&] { files::sync(root + "/absent"); });
  EXPECT_NE(e.find("fsync it) of '" + root + "/absent'"), std::string::npos) << e;
  e = message([&] { files::sync(root + "/file", /*directory=*/true); });
  EXPECT_NE(e.find("Not a directory"), std::string::npos) << e;
  files::remove_all(root);
  EXPECT_FALSE(files::exists(root));
}
