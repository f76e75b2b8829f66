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
// INVALID_ARGUMENT naming what else it is (a pipe, a directory, a device), told by the file the
// path resolves to at the read and never opened, so that a file swapped for a pipe after a
// caller's own check neither blocks the read nor wakes the pipe's writer; INTERNAL where
// /proc is not mounted (the regular file is opened through /proc/self/fd).
absl::StatusOr<std::string> ReadFileToString(const std::string& path,
                                             FileKind kind = FileKind::kAny);

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_FILE_UTIL_H_
