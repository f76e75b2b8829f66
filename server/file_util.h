// Reading the small files kvrecalld is pointed at by its flags (PEM certificates and keys,
// the token file) into memory, with errors that name the file.
#ifndef KVRECALL_SERVER_FILE_UTIL_H_
#define KVRECALL_SERVER_FILE_UTIL_H_

#include <string>

#include "absl/status/statusor.h"

namespace kvrecall {

// Which files a read takes.
enum class FileKind {
  kAny,      // a regular file, a pipe (--flag=<(...)), a device: read at start
  kRegular,  // a regular file alone: read again (a pipe would block the read until a writer
             // came, or give what another reader left)
};

// The whole file. NOT_FOUND, PERMISSION_DENIED or INVALID_ARGUMENT (a directory) naming `path`
// and the system's reason; RESOURCE_EXHAUSTED for files over 16 MiB; with FileKind::kRegular,
// FAILED_PRECONDITION for anything else, told by the opened file itself (opened without
// blocking), so that a file swapped for a pipe after a caller's stat never blocks the read.
absl::StatusOr<std::string> ReadFileToString(const std::string& path,
                                             FileKind kind = FileKind::kAny);

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_FILE_UTIL_H_
