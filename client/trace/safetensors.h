// Reading (memory-mapped, validated) and writing of safetensors files holding bf16, f16 or f32
// tensors: the container of kvrecall's replay traces.
//
// A safetensors file is: an 8-byte little-endian header length N, N bytes of JSON header
// ({"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
// "__metadata__": {"key": "string"}}), then the data region that the offsets index, every
// tensor row-major little-endian. See https://github.com/huggingface/safetensors.
#ifndef KVRECALL_CLIENT_TRACE_SAFETENSORS_H_
#define KVRECALL_CLIENT_TRACE_SAFETENSORS_H_

#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvrecall/v1/kvrecall.pb.h"

namespace kvrecall {

// The safetensors spelling of a dtype ("F32", "F16", "BF16"); nullptr for others.
const char* SafetensorsDTypeName(v1::DType dtype);

// One tensor of an open file: where its bytes are and how to read them.
struct SafetensorsTensor {
  std::string name;
  v1::DType dtype = v1::DTYPE_UNSPECIFIED;
  std::vector<int64_t> shape;
  const char* data = nullptr;  // inside the file's mapping
  int64_t elements = 0;        // product of shape
  int64_t bytes = 0;

  // Elements of one row (product of shape[1:]); 1 for a scalar or a vector.
  int64_t row_elements() const;
};

// A validated, read-only safetensors file. Open maps the file (nothing is read until used);
// FromBytes parses an in-memory copy. Every structural error is INVALID_ARGUMENT (a file that
// cannot be opened: NOT_FOUND or the errno's code) with a message naming the file and the fault:
// header length beyond the file, JSON that does not parse, an unknown or unsupported dtype, a
// shape or offsets that are not non-negative integers, offsets outside the data region, a byte
// size that disagrees with shape x dtype, overlapping tensors, or a data region with holes.
class SafetensorsFile {
 public:
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);
  static absl::StatusOr<SafetensorsFile> FromBytes(std::string bytes, std::string label);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  ~SafetensorsFile();

  const std::string& label() const { return label_; }  // the path, for messages
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::map<std::string, SafetensorsTensor>& tensors() const { return tensors_; }

  // The tensor `name`, or NOT_FOUND naming it and the file.
  absl::StatusOr<const SafetensorsTensor*> Find(absl::string_view name) const;

  // Rows [row_begin, row_begin + rows) of `name` (along its first dimension) as f32, written to
  // `out` (rows * row_elements floats). OUT_OF_RANGE when the rows exceed the tensor.
  absl::Status ReadRows(absl::string_view name, int64_t row_begin, int64_t rows, float* out) const;
  // The whole tensor as f32.
  absl::StatusOr<std::vector<float>> ReadF32(absl::string_view name) const;

 private:
  SafetensorsFile() = default;
  absl::Status Parse();

  std::string label_;
  const char* base_ = nullptr;  // the whole file
  size_t size_ = 0;
  void* mapping_ = nullptr;  // set when base_ is an mmap
  std::string owned_;        // set when base_ is an in-memory copy
  std::map<std::string, std::string> metadata_;
  std::map<std::string, SafetensorsTensor> tensors_;
};

// What a writer will write: tensors are laid out in the order declared.
struct SafetensorsTensorSpec {
  std::string name;
  v1::DType dtype = v1::DTYPE_BF16;
  std::vector<int64_t> shape;
};

// Makes SIGINT, SIGTERM and SIGHUP remove the temporary files of the SafetensorsWriters not
// finished (a large trace's is gigabytes: an interrupted `kvrecall synth` left them), then end
// the process as the signal would have. For command-line tools: a library leaves a process's
// signals to it. Up to 8 writers at once are tracked.
void RemovePartialFilesOnSignals();

// Streams a safetensors file to disk without holding it in memory: declare every tensor up
// front (Create writes the header), then Append f32 values in declaration order — a call may
// end mid-tensor or span several — converting each to its tensor's dtype, then Finish.
// INVALID_ARGUMENT for duplicate or empty names, "__metadata__" as a name, unsupported dtypes,
// negative dims, appending past the last tensor, or Finish before every element was written.
// The file is written beside `path` (its links followed) under a temporary name and renamed
// over it by Finish, with the old file's permission bits: a reader that has the old file
// mapped keeps reading it, and a writer that fails or is abandoned leaves `path` as it was
// (and removes its temporary file). A path that names something other than a regular file
// (/dev/null, a FIFO) is written in place.
class SafetensorsWriter {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsWriter>> Create(
      const std::string& path, std::vector<SafetensorsTensorSpec> tensors,
      const std::map<std::string, std::string>& metadata);
  ~SafetensorsWriter();

  absl::Status Append(std::span<const float> values);
  // Flushes and closes the file; the writer accepts nothing after.
  absl::Status Finish();

  // Elements still to be appended before Finish.
  int64_t remaining_elements() const;

 private:
  SafetensorsWriter() = default;

  std::string path_;
  std::string temporary_path_;  // where the file is written until Finish renames it
  int tracked_slot_ = -1;       // RemovePartialFilesOnSignals' slot of temporary_path_, or -1
  std::FILE* file_ = nullptr;
  std::vector<SafetensorsTensorSpec> tensors_;
  std::vector<int64_t> elements_;  // per tensor
  size_t current_ = 0;             // tensor being written
  int64_t written_in_current_ = 0;
  std::vector<char> scratch_;  // converted bytes of one Append
};

// The complete file (header + data) in memory, for small files and tests.
// `data[i]` holds the f32 values of `tensors[i]`.
absl::StatusOr<std::string> SerializeSafetensors(
    std::span<const SafetensorsTensorSpec> tensors, std::span<const std::span<const float>> data,
    const std::map<std::string, std::string>& metadata);

}  // namespace kvrecall

#endif  // KVRECALL_CLIENT_TRACE_SAFETENSORS_H_
