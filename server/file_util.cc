#include "server/file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvrecall {

namespace {

// fopen's errno as a status naming `path`.
absl::Status CannotOpen(const std::string& path, int error) {
  const std::string message = absl::StrCat("cannot read ", path, ": ", std::strerror(error));
  if (error == ENOENT) return absl::NotFoundError(message);
  if (error == EACCES || error == EPERM) return absl::PermissionDeniedError(message);
  return absl::InvalidArgumentError(message);
}

// What a file that is not a regular one is, for messages.
const char* FileTypeName(mode_t mode) {
  if (S_ISFIFO(mode)) return "a pipe";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "a special file";
}

// `path` opened for reading, a regular file or nothing. The path is resolved once, to an O_PATH
// descriptor, which opens nothing (a pipe's writer is not woken, a device not touched); its
// fstat says what it is, and only a regular file is then opened, through /proc/self/fd, the
// very file the fstat saw.
absl::StatusOr<FILE*> OpenRegularFile(const std::string& path) {
  // (Never FAILED_PRECONDITION, which the TLS ports read as "files read at start only".)
  const int located = open(path.c_str(), O_PATH | O_CLOEXEC);
  if (located < 0) return CannotOpen(path, errno);
  struct stat st;
  if (fstat(located, &st) != 0) {
    const int error = errno;
    close(located);
    return CannotOpen(path, error);
  }
  if (!S_ISREG(st.st_mode)) {
    close(located);
    return absl::InvalidArgumentError(absl::StrCat(path, " is ", FileTypeName(st.st_mode),
                                                   ", not a regular file, which cannot be read "
                                                   "again (a pipe is read once)"));
  }
  const int fd =
      open(absl::StrCat("/proc/self/fd/", located).c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY);
  const int error = errno;
  close(located);
  if (fd < 0 && (error == ENOENT || error == ENOTDIR)) {
    // The file is there (its O_PATH descriptor was): the way to it is what is missing.
    return absl::InternalError(absl::StrCat("cannot read ", path,
                                            " again: cannot open it through /proc/self/fd (is "
                                            "/proc mounted?)"));
  }
  if (fd < 0) return CannotOpen(path, error);
  FILE* file = fdopen(fd, "rb");
  if (file == nullptr) {
    const int fdopen_error = errno;
    close(fd);
    return CannotOpen(path, fdopen_error);
  }
  return file;
}

}  // namespace

absl::StatusOr<std::string> ReadFileToString(const std::string& path, FileKind kind) {
  constexpr size_t kMaxBytes = size_t{16} << 20;
  FILE* opened = nullptr;
  if (kind == FileKind::kRegular) {
    absl::StatusOr<FILE*> regular = OpenRegularFile(path);
    if (!regular.ok()) return regular.status();
    opened = *regular;
  } else {
    opened = std::fopen(path.c_str(), "rb");
    if (opened == nullptr) return CannotOpen(path, errno);
  }
  std::unique_ptr<FILE, int (*)(FILE*)> file(opened, &std::fclose);
  std::string out;
  char buffer[8192];
  while (true) {
    const size_t n = std::fread(buffer, 1, sizeof(buffer), file.get());
    out.append(buffer, n);
    if (out.size() > kMaxBytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat(path, " is larger than ", kMaxBytes >> 20, " MiB"));
    }
    if (n < sizeof(buffer)) break;
  }
  if (std::ferror(file.get())) {
    // Reading a directory opens fine and fails here (EISDIR).
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read ", path, ": ", std::strerror(errno)));
  }
  return out;
}

}  // namespace kvrecall
