#include "server/file_util.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvrecall {

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  constexpr size_t kMaxBytes = size_t{16} << 20;
  std::unique_ptr<FILE, int (*)(FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (file == nullptr) {
    const int error = errno;
    const std::string message = absl::StrCat("cannot read ", path, ": ", std::strerror(error));
    if (error == ENOENT) return absl::NotFoundError(message);
    if (error == EACCES || error == EPERM) return absl::PermissionDeniedError(message);
    return absl::InvalidArgumentError(message);
  }
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
