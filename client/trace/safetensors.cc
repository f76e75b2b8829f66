#include "client/trace/safetensors.h"

#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <tuple>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "proto/tensor_codec.h"

namespace kvrecall {
namespace {

constexpr char kMetadataKey[] = "__metadata__";
// The safetensors reference implementation refuses larger headers; so do we, before parsing.
constexpr uint64_t kMaxHeaderBytes = 100 << 20;

v1::DType ParseSafetensorsDType(const std::string& name) {
  for (v1::DType d : {v1::DTYPE_F32, v1::DTYPE_F16, v1::DTYPE_BF16}) {
    if (name == SafetensorsDTypeName(d)) return d;
  }
  return v1::DTYPE_UNSPECIFIED;
}

// a * b, or false when it overflows int64.
bool CheckedMul(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

std::string ShapeString(std::span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// The JSON header of `tensors` laid out back to back in order, padded with spaces to a multiple
// of 8 bytes so the data region is aligned.
absl::StatusOr<std::string> BuildHeader(std::span<const SafetensorsTensorSpec> tensors,
                                        const std::map<std::string, std::string>& metadata,
                                        std::vector<int64_t>* elements) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  int64_t offset = 0;
  elements->clear();
  for (const SafetensorsTensorSpec& t : tensors) {
    if (t.name.empty() || t.name == kMetadataKey) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors writer: invalid tensor name '", t.name, "'"));
    }
    if (header.contains(t.name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors writer: tensor '", t.name, "' declared twice"));
    }
    const char* dtype_name = SafetensorsDTypeName(t.dtype);
    if (dtype_name == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "safetensors writer: tensor '", t.name, "' has unsupported dtype ", DTypeName(t.dtype)));
    }
    int64_t count = 1;
    for (int64_t d : t.shape) {
      if (d < 0 || !CheckedMul(count, d, &count)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "safetensors writer: tensor '", t.name, "' has invalid shape ", ShapeString(t.shape)));
      }
    }
    int64_t bytes = 0;
    int64_t end = 0;
    if (!CheckedMul(count, static_cast<int64_t>(DTypeSize(t.dtype)), &bytes) ||
        __builtin_add_overflow(offset, bytes, &end)) {
      return absl::InvalidArgumentError(absl::StrCat("safetensors writer: tensor '", t.name,
                                                     "' of shape ", ShapeString(t.shape),
                                                     " takes the file past 2^63 bytes"));
    }
    header[t.name] = {
        {"dtype", dtype_name}, {"shape", t.shape}, {"data_offsets", {offset, end}}};
    offset = end;
    elements->push_back(count);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += text;
  return out;
}

}  // namespace

const char* SafetensorsDTypeName(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32:
      return "F32";
    case v1::DTYPE_F16:
      return "F16";
    case v1::DTYPE_BF16:
      return "BF16";
    default:
      return nullptr;
  }
}

int64_t SafetensorsTensor::row_elements() const {
  // SafetensorsFile::Parse refuses shapes whose rows overflow.
  if (shape.size() <= 1) return 1;
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  // O_NONBLOCK: a FIFO given as a trace is refused below instead of blocking the open.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    return absl::ErrnoToStatus(err, absl::StrCat("cannot open ", path));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::ErrnoToStatus(err, absl::StrCat("cannot stat ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not a regular file (a safetensors file is mapped)"));
  }
  SafetensorsFile file;
  file.label_ = path;
  file.size_ = static_cast<size_t>(st.st_size);
  if (file.size_ > 0) {
    void* m = ::mmap(nullptr, file.size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return absl::ErrnoToStatus(err, absl::StrCat("cannot map ", path));
    }
    file.mapping_ = m;
    file.base_ = static_cast<const char*>(m);
  }
  ::close(fd);
  if (absl::Status s = file.Parse(); !s.ok()) return s;
  return file;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::FromBytes(std::string bytes, std::string label) {
  SafetensorsFile file;
  file.label_ = std::move(label);
  file.owned_ = std::move(bytes);
  file.base_ = file.owned_.data();
  file.size_ = file.owned_.size();
  if (absl::Status s = file.Parse(); !s.ok()) return s;
  return file;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept { *this = std::move(other); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this == &other) return *this;
  if (mapping_ != nullptr) ::munmap(mapping_, size_);
  label_ = std::move(other.label_);
  size_ = other.size_;
  mapping_ = std::exchange(other.mapping_, nullptr);
  // Moving a std::string may move its (small) buffer, so data pointers into an in-memory copy
  // are rebased onto the new owner.
  const char* old_base = other.base_;
  const bool was_owned = old_base != nullptr && old_base == other.owned_.data();
  owned_ = std::move(other.owned_);
  base_ = was_owned ? owned_.data() : old_base;
  other.base_ = nullptr;
  other.size_ = 0;
  metadata_ = std::move(other.metadata_);
  tensors_ = std::move(other.tensors_);
  if (was_owned) {
    for (auto& [name, t] : tensors_) t.data = base_ + (t.data - old_base);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, size_);
}

absl::Status SafetensorsFile::Parse() {
  auto invalid = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(label_, ": ", parts...));
  };
  if (size_ < 8) return invalid("not a safetensors file: ", size_, " bytes, shorter than 8");
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) {
    header_len |= static_cast<uint64_t>(static_cast<unsigned char>(base_[i])) << (8 * i);
  }
  if (header_len > kMaxHeaderBytes || header_len > size_ - 8) {
    return invalid("header length ", header_len, " runs past the end of the file (", size_,
                   " bytes)");
  }
  const nlohmann::json header =
      nlohmann::json::parse(base_ + 8, base_ + 8 + header_len, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return invalid("header is not a JSON object");
  }
  const char* data_begin = base_ + 8 + header_len;
  const uint64_t data_size = size_ - 8 - header_len;

  struct Extent {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Extent> extents;
  for (const auto& [name, entry] : header.items()) {
    if (name == kMetadataKey) {
      if (!entry.is_object()) return invalid("__metadata__ is not an object");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) return invalid("__metadata__.", key, " is not a string");
        metadata_[key] = value.get<std::string>();
      }
      continue;
    }
    // An init-capture, not the structured binding itself: clang 16 cannot capture bindings
    // under -fopenmp (the sanitizer and fuzz builds).
    auto bad = [&, &tensor = name](auto&&... parts) {
      return invalid("tensor '", tensor, "': ", parts...);
    };
    if (!entry.is_object()) return bad("entry is not an object");
    const auto dtype_it = entry.find("dtype");
    const auto shape_it = entry.find("shape");
    const auto offsets_it = entry.find("data_offsets");
    if (dtype_it == entry.end() || !dtype_it->is_string()) return bad("dtype missing");
    if (shape_it == entry.end() || !shape_it->is_array()) return bad("shape missing");
    if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2 ||
        !(*offsets_it)[0].is_number_unsigned() || !(*offsets_it)[1].is_number_unsigned()) {
      return bad("data_offsets must be two non-negative integers");
    }
    SafetensorsTensor t;
    t.name = name;
    const std::string dtype_name = dtype_it->get<std::string>();
    t.dtype = ParseSafetensorsDType(dtype_name);
    if (t.dtype == v1::DTYPE_UNSPECIFIED) {
      return bad("dtype ", dtype_name, " is not supported (want BF16, F16 or F32)");
    }
    // The product of every dimension and, apart, of a row's (shape[1:]): a tensor with no rows
    // still has rows whose size must be representable (row_elements). Messages name the
    // offending dimension, never the untrusted JSON itself (dumping a deeply nested value
    // recurses once per level).
    int64_t count = 1;
    int64_t row = 1;
    for (const auto& dim : *shape_it) {
      const size_t i = t.shape.size();
      if (!dim.is_number_unsigned() || dim.get<uint64_t>() > std::numeric_limits<int64_t>::max()) {
        return bad("shape[", i, "] is not a non-negative integer (a JSON ", dim.type_name(), ")");
      }
      t.shape.push_back(dim.get<int64_t>());
      if (!CheckedMul(count, t.shape.back(), &count) ||
          (i > 0 && !CheckedMul(row, t.shape.back(), &row))) {
        return bad("shape ", ShapeString(t.shape), "... overflows 64-bit element counts");
      }
    }
    t.elements = count;
    const uint64_t begin = (*offsets_it)[0].get<uint64_t>();
    const uint64_t end = (*offsets_it)[1].get<uint64_t>();
    if (begin > end || end > data_size) {
      return bad("data_offsets [", begin, ", ", end, "] lie outside the data region of ", data_size,
                 " bytes");
    }
    int64_t want = 0;
    if (!CheckedMul(count, static_cast<int64_t>(DTypeSize(t.dtype)), &want) ||
        static_cast<uint64_t>(want) != end - begin) {
      return bad("data_offsets span ", end - begin, " bytes, shape ", ShapeString(t.shape), " of ",
                 dtype_name, " needs ", want);
    }
    t.bytes = want;
    t.data = data_begin + begin;
    extents.push_back({begin, end, nullptr});
    auto [it, inserted] = tensors_.emplace(name, std::move(t));
    extents.back().name = &it->first;
  }
  // The format requires the tensors to tile the data region exactly. By (begin, end), as the
  // reference implementation orders them: an empty tensor ([x, x], a trace with no decode
  // steps) sorts before a tensor that starts at x, and tiles nothing.
  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t covered = 0;
  for (const Extent& e : extents) {
    if (e.begin < covered) {
      return invalid("tensor '", *e.name, "' overlaps the tensor before it (data_offsets [",
                     e.begin, ", ", e.end, "])");
    }
    if (e.begin > covered) {
      return invalid("data region has a hole at bytes [", covered, ", ", e.begin, ")");
    }
    covered = e.end;
  }
  if (covered != data_size) {
    return invalid("data region has ", data_size - covered, " bytes after the last tensor");
  }
  return absl::OkStatus();
}

absl::StatusOr<const SafetensorsTensor*> SafetensorsFile::Find(absl::string_view name) const {
  const auto it = tensors_.find(std::string(name));
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(label_, ": no tensor named '", name, "'"));
  }
  return &it->second;
}

absl::Status SafetensorsFile::ReadRows(absl::string_view name, int64_t row_begin, int64_t rows,
                                       float* out) const {
  absl::StatusOr<const SafetensorsTensor*> t = Find(name);
  if (!t.ok()) return t.status();
  const int64_t total_rows = (*t)->shape.empty() ? 1 : (*t)->shape[0];
  if (row_begin < 0 || rows < 0 || row_begin + rows > total_rows) {
    return absl::OutOfRangeError(absl::StrCat(label_, ": rows [", row_begin, ", ", row_begin + rows,
                                              ") of tensor '", name, "' with ", total_rows,
                                              " rows"));
  }
  const int64_t row = (*t)->row_elements();
  ConvertToF32((*t)->data + row_begin * row * DTypeSize((*t)->dtype), (*t)->dtype, rows * row, out);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> SafetensorsFile::ReadF32(absl::string_view name) const {
  absl::StatusOr<const SafetensorsTensor*> t = Find(name);
  if (!t.ok()) return t.status();
  std::vector<float> out((*t)->elements);
  ConvertToF32((*t)->data, (*t)->dtype, (*t)->elements, out.data());
  return out;
}

namespace {

// The temporary files of writers not finished, for RemovePartialFilesOnSignals' handler: fixed
// slots of fixed-size paths, as a signal handler may read them (no allocation, no lock). A
// slot's state: 0 free, 1 being filled or cleared, 2 a path to remove.
constexpr int kTrackedPartialFiles = 8;
struct PartialFileSlot {
  std::atomic<int> state{0};
  char path[PATH_MAX];
};
PartialFileSlot partial_files[kTrackedPartialFiles];

// Tracks `path`; its slot, or -1 when every slot is taken or the path is too long (then an
// interrupted write leaves it behind, as before).
int TrackPartialFile(const std::string& path) {
  if (path.size() >= PATH_MAX) return -1;
  for (int i = 0; i < kTrackedPartialFiles; ++i) {
    int expected = 0;
    if (partial_files[i].state.compare_exchange_strong(expected, 1)) {
      std::memcpy(partial_files[i].path, path.c_str(), path.size() + 1);
      partial_files[i].state.store(2);
      return i;
    }
  }
  return -1;
}

void UntrackPartialFile(int slot) {
  if (slot >= 0) partial_files[slot].state.store(0);
}

extern "C" void RemovePartialFilesAndRaise(int signal_number) {
  for (PartialFileSlot& slot : partial_files) {
    if (slot.state.load() == 2) ::unlink(slot.path);
  }
  ::signal(signal_number, SIG_DFL);
  ::raise(signal_number);
}

}  // namespace

void RemovePartialFilesOnSignals() {
  struct sigaction action = {};
  action.sa_handler = RemovePartialFilesAndRaise;
  sigemptyset(&action.sa_mask);
  for (const int signal_number : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction previous = {};
    // A signal the process was started ignoring (nohup) stays ignored.
    if (::sigaction(signal_number, nullptr, &previous) == 0 && previous.sa_handler == SIG_IGN) {
      continue;
    }
    ::sigaction(signal_number, &action, nullptr);
  }
}

absl::StatusOr<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, std::vector<SafetensorsTensorSpec> tensors,
    const std::map<std::string, std::string>& metadata) {
  std::unique_ptr<SafetensorsWriter> w(new SafetensorsWriter());
  absl::StatusOr<std::string> header = BuildHeader(tensors, metadata, &w->elements_);
  if (!header.ok()) return header.status();
  w->path_ = path;
  w->tensors_ = std::move(tensors);
  // What the path names now, its links followed: a file that is not a regular one (/dev/null,
  // a FIFO, a device) is written in place, as it must not be replaced; a regular one (or none)
  // is written beside its real path and renamed over it, keeping its permission bits.
  struct stat existing;
  const bool exists = ::stat(path.c_str(), &existing) == 0;
  int fd = -1;
  if (exists && !S_ISREG(existing.st_mode)) {
    fd = ::open(path.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
  } else {
    std::string target = path;
    if (exists) {
      char* real = ::realpath(path.c_str(), nullptr);
      if (real != nullptr) {
        target = real;
        std::free(real);
      }
    }
    w->path_ = target;
    // A name of this process's own (pid and a counter) in the target's directory, so that the
    // rename stays on one filesystem; O_EXCL never reuses a stranger's file.
    static std::atomic<uint64_t> writers{0};
    w->temporary_path_ = absl::StrCat(target, ".partial-", ::getpid(), "-", writers++);
    // Tracked before it is made: a signal between the two left it behind
    // (CliTest.AnInterruptedSynthLeavesNoPartialFile caught that window).
    w->tracked_slot_ = TrackPartialFile(w->temporary_path_);
    fd = ::open(w->temporary_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC,
                exists ? existing.st_mode & 07777 : 0666);
    if (fd >= 0 && exists) ::fchmod(fd, existing.st_mode & 07777);  // beyond the umask, as before
  }
  if (fd < 0) {
    const int err = errno;
    return absl::ErrnoToStatus(
        err, absl::StrCat("cannot create ", path,
                          w->temporary_path_.empty()
                              ? ""
                              : absl::StrCat(" (written as ", w->temporary_path_, " first)")));
  }
  w->file_ = ::fdopen(fd, "wb");
  if (w->file_ == nullptr) {
    const int err = errno;
    ::close(fd);
    if (!w->temporary_path_.empty()) ::unlink(w->temporary_path_.c_str());
    return absl::ErrnoToStatus(err, absl::StrCat("cannot create ", path));
  }
  if (std::fwrite(header->data(), 1, header->size(), w->file_) != header->size()) {
    const int err = errno;
    return absl::ErrnoToStatus(err, absl::StrCat("cannot write ", path));
  }
  // Skip tensors with no elements so that current_ always names one that still needs data.
  while (w->current_ < w->elements_.size() && w->elements_[w->current_] == 0) ++w->current_;
  return w;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (file_ != nullptr) {  // not finished: the target stays as it was (unless written in place)
    std::fclose(file_);
    if (!temporary_path_.empty()) ::unlink(temporary_path_.c_str());
  }
  UntrackPartialFile(tracked_slot_);
}

int64_t SafetensorsWriter::remaining_elements() const {
  int64_t n = 0;
  for (size_t i = current_; i < elements_.size(); ++i) n += elements_[i];
  return n - written_in_current_;
}

absl::Status SafetensorsWriter::Append(std::span<const float> values) {
  if (file_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(path_, ": writer is finished"));
  }
  while (!values.empty()) {
    if (current_ == tensors_.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path_, ": ", values.size(), " values appended past the last declared tensor"));
    }
    const v1::DType dtype = tensors_[current_].dtype;
    const size_t n = static_cast<size_t>(
        std::min<int64_t>(values.size(), elements_[current_] - written_in_current_));
    scratch_.resize(n * DTypeSize(dtype));
    ConvertFromF32(values.first(n), dtype, scratch_.data());
    if (std::fwrite(scratch_.data(), 1, scratch_.size(), file_) != scratch_.size()) {
      const int err = errno;
      return absl::ErrnoToStatus(err, absl::StrCat("cannot write ", path_));
    }
    values = values.subspan(n);
    written_in_current_ += static_cast<int64_t>(n);
    while (current_ < tensors_.size() && written_in_current_ == elements_[current_]) {
      ++current_;
      written_in_current_ = 0;
    }
  }
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::Finish() {
  if (file_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(path_, ": writer is finished"));
  }
  if (const int64_t left = remaining_elements(); left != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": finished with ", left,
                                                   " elements not written, starting in tensor '",
                                                   tensors_[current_].name, "'"));
  }
  const bool ok = std::fclose(file_) == 0;
  const int close_error = errno;
  file_ = nullptr;
  if (temporary_path_.empty()) {  // written in place
    return ok ? absl::OkStatus()
              : absl::ErrnoToStatus(close_error, absl::StrCat("cannot write ", path_));
  }
  if (!ok) {
    ::unlink(temporary_path_.c_str());
    return absl::ErrnoToStatus(close_error, absl::StrCat("cannot write ", path_));
  }
  if (::rename(temporary_path_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(temporary_path_.c_str());
    return absl::ErrnoToStatus(err, absl::StrCat("cannot rename ", temporary_path_, " to ", path_));
  }
  // After the rename: a signal between the two unlinks a name that is gone, harmlessly.
  UntrackPartialFile(std::exchange(tracked_slot_, -1));
  return absl::OkStatus();
}

absl::StatusOr<std::string> SerializeSafetensors(
    std::span<const SafetensorsTensorSpec> tensors, std::span<const std::span<const float>> data,
    const std::map<std::string, std::string>& metadata) {
  if (tensors.size() != data.size()) {
    return absl::InvalidArgumentError(absl::StrCat("SerializeSafetensors: ", tensors.size(),
                                                   " tensors but ", data.size(), " data spans"));
  }
  std::vector<int64_t> elements;
  absl::StatusOr<std::string> out = BuildHeader(tensors, metadata, &elements);
  if (!out.ok()) return out.status();
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (static_cast<int64_t>(data[i].size()) != elements[i]) {
      return absl::InvalidArgumentError(absl::StrCat("SerializeSafetensors: tensor '",
                                                     tensors[i].name, "' has ", data[i].size(),
                                                     " values, its shape needs ", elements[i]));
    }
    const size_t at = out->size();
    out->resize(at + elements[i] * DTypeSize(tensors[i].dtype));
    ConvertFromF32(data[i], tensors[i].dtype, out->data() + at);
  }
  return out;
}

}  // namespace kvrecall
