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

// `path` opened for reading, a regular file or nothing: O_NONBLOCK so that a pipe's open does
// not wait for a writer (it is refused by its fstat); cleared again for the read.
absl::StatusOr<FILE*> OpenRegularFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return CannotOpen(path, errno);
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return absl::FailedPreconditionError(absl::StrCat(
        path, " is not a regular file, which cannot be read again (a pipe is read once)"));
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  FILE* file = fdopen(fd, "rb");
  if (file == nullptr) {
    const int error = errno;
    close(fd);
    return CannotOpen(path, error);
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
