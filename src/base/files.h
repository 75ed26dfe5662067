// File-system calls for the library, its tools and its tests, written with
// POSIX calls instead of std::filesystem.
//
// Why: some LibTorch builds export std::filesystem functions of their own
// (the torch 2.11 CUDA wheel's libtorch.so defines 208 of them, built
// against an older libstdc++). A program that loads such a libtorch.so has
// its own std::filesystem calls bound to those definitions, and they crash
// (remove_all and directory_iterator did, on an H100 machine: docs/gpu.md).
// Nothing built here may import a std::filesystem symbol; the ctest
// `build.no_std_filesystem_imports` checks every binary.
//
// Errors throw shardtorch::Error naming the call, the path and errno's text.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace shardtorch::files {

/// True if `path` names anything (a dangling symbolic link counts).
bool exists(const std::string& path);
bool is_directory(const std::string& path);
bool is_regular_file(const std::string& path);
/// A directory with no entries; false for anything else.
bool is_empty_directory(const std::string& path);
/// Bytes of a regular file; throws if it cannot be read.
int64_t file_size(const std::string& path);
/// What `path` is, in words, if it is there and not a regular file (links
/// followed): "a FIFO", "a directory", "a character device", ...; empty for
/// a regular file or nothing at all.
std::string irregular_kind(const std::string& path);
/// Opens a regular file to read (O_CLOEXEC) without ever blocking on
/// something else: a FIFO or a device is opened non-blocking, found by fstat
/// and closed. Returns the descriptor, or -1 with `why` set ("No such file or
/// directory", "is a FIFO, not a regular file", ...).
int open_regular_for_reading(const std::string& path, std::string& why);

/// Entry names of `dir` ("." and ".." left out), sorted; throws if `dir`
/// cannot be read.
std::vector<std::string> list_directory(const std::string& dir);

/// `path` and everything under it, links not followed; nothing to do if it
/// is absent. Throws on the first entry that cannot be removed.
void remove_all(const std::string& path);
/// As remove_all, but failures are ignored (clean-up on an error path).
void remove_all_quietly(const std::string& path) noexcept;
/// One file, link or empty directory; false if it was absent.
bool remove(const std::string& path);
void rename(const std::string& from, const std::string& to);
/// fsync of a regular file, or of a directory (`directory`): what makes the
/// creations, removals and renames in it durable. A directory whose file
/// system cannot sync one (EINVAL, ENOTSUP: CIFS, some FUSE and network file
/// systems) counts as synced: nothing more can be done there.
void sync(const std::string& path, bool directory = false);
/// rename(from, to), then sync of the directory `to` is in, so that the
/// rename survives a crash. `renamed`, if given, runs between the two.
void rename_durably(const std::string& from, const std::string& to, const std::function<void()>& renamed = {});
/// `dir` and its missing parents.
void create_directories(const std::string& dir);
/// Copies a regular file, replacing `to`.
void copy_file(const std::string& from, const std::string& to);
/// Copies a directory tree (directories and regular files).
void copy_tree(const std::string& from, const std::string& to);
/// The tree at `from` again at `to`, durably: directories made anew,
/// symbolic links made anew as links, regular files hard-linked, or copied
/// (with their mode, synced) where the file system cannot link them. An
/// entry that vanished meanwhile is skipped. Returns the paths under `from`
/// left out: neither a directory, a link nor a regular file (a FIFO, a
/// socket).
std::vector<std::string> link_tree(const std::string& from, const std::string& to);
void resize_file(const std::string& path, int64_t bytes);

/// A new directory "PREFIX-XXXXXX" under $TMPDIR (or /tmp), made by mkdtemp.
std::string make_temp_dir(const std::string& prefix);

/// Path arithmetic on strings, as std::filesystem::path does it:
/// parent_path("a/b") == "a", parent_path("b") == "", filename("a/b") == "b",
/// lexically_normal("a/./b/../c/") == "a/c/".
std::string parent_path(const std::string& path);
/// The directory a path is in: parent_path(path), or "." when it has none.
std::string directory_of(const std::string& path);
std::string filename(const std::string& path);
std::string lexically_normal(const std::string& path);
/// "a" + "/" + "b", without doubling a trailing slash of `a`.
std::string join(const std::string& a, const std::string& b);

}  // namespace shardtorch::files
