// Reading the small files kvrecalld is pointed at by its flags (PEM certificates and keys,
// the token file) into memory, with errors that name the file.
#ifndef KVRECALL_SERVER_FILE_UTIL_H_
#define KVRECALL_SERVER_FILE_UTIL_H_

#include <string>

#include "absl/status/statusor.h"

namespace kvrecall {

// The whole file. NOT_FOUND, PERMISSION_DENIED or INVALID_ARGUMENT (a directory) naming `path`
// and the system's reason; RESOURCE_EXHAUSTED for files over 16 MiB.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_FILE_UTIL_H_
