#include "server/auth.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "proto/tsan_handoff.h"
#include "server/file_util.h"

namespace kvrecall {
namespace {

constexpr absl::string_view kHealthPrefix = "/grpc.health.v1.Health/";

bool IsTenantChar(char c) { return absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-'; }

// Equal length and content, in time that depends only on the lengths.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

absl::StatusOr<TokenTable> TokenTable::Parse(absl::string_view text, absl::string_view source,
                                             absl::string_view lone_token_tenant) {
  const std::string form = lone_token_tenant.empty() ? "'TOKEN TENANT'" : "'TOKEN' or 'TOKEN NAME'";
  TokenTable table;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> fields =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    auto error = [&](absl::string_view what) {
      return absl::InvalidArgumentError(absl::StrCat(source, ":", line_number, ": ", what));
    };
    if (fields.size() == 1 && !lone_token_tenant.empty()) fields.push_back(lone_token_tenant);
    if (fields.size() != 2) {
      return error(absl::StrCat("expected ", form, ", got ", fields.size(), " fields"));
    }
    const absl::string_view token = fields[0];
    const absl::string_view tenant = fields[1];
    // The second field is never echoed: a line of two tokens (a rotation written on one line)
    // would print a secret into the log.
    const absl::string_view second = lone_token_tenant.empty() ? "tenant" : "name";
    if (token.size() < kMinTokenLength) {
      return error(absl::StrCat("token is ", token.size(), " characters, at least ",
                                kMinTokenLength, " are required"));
    }
    for (char c : token) {
      if (!absl::ascii_isgraph(c)) return error("token has a character that is not printable");
    }
    if (tenant.size() > kMaxTenantLength) {
      return error(absl::StrCat(second, " is longer than ", kMaxTenantLength, " characters"));
    }
    if (!lone_token_tenant.empty() && tenant.size() >= kMinTokenLength) {
      return error(absl::StrCat("the name is ", tenant.size(),
                                " characters: a second token? Put each token on a line of its own "
                                "(a name is at most ", kMinTokenLength - 1, " characters)"));
    }
    for (size_t i = 0; i < tenant.size(); ++i) {
      if (!IsTenantChar(tenant[i])) {
        return error(absl::StrCat(second, " has a character not in [A-Za-z0-9._-] (character ",
                                  i + 1, " of ", tenant.size(), ")"));
      }
    }
    for (const Entry& e : table.entries_) {
      if (e.token == token) {
        return error("this token is already listed (each token is listed once)");
      }
    }
    table.entries_.push_back({std::string(token), std::string(tenant)});
  }
  if (table.entries_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": no ", form, " line"));
  }
  return table;
}

absl::StatusOr<TokenTable> TokenTable::Load(const std::string& path,
                                            absl::string_view lone_token_tenant, FileKind kind) {
  absl::StatusOr<std::string> text = ReadFileToString(path, kind);
  if (!text.ok()) return text.status();
  return Parse(*text, path, lone_token_tenant);
}

namespace {

// Whether `path` names a regular file (its links followed), or nothing that can be stat'ed (the
// read says why it cannot be read).
bool RegularFileOrGone(const std::string& path) {
  struct stat file;
  return ::stat(path.c_str(), &file) != 0 || S_ISREG(file.st_mode);
}

}  // namespace

absl::StatusOr<std::shared_ptr<TokenStore>> TokenStore::FromFile(std::string flag,
                                                                 std::string path,
                                                                 std::string lone_token_tenant) {
  absl::StatusOr<TokenTable> table = TokenTable::Load(path, lone_token_tenant);
  if (!table.ok()) {
    return absl::Status(table.status().code(), absl::StrCat(flag, ": ", table.status().message()));
  }
  auto store = std::make_shared<TokenStore>(std::make_shared<const TokenTable>(*std::move(table)));
  store->read_once_ = !RegularFileOrGone(path);
  store->flag_ = std::move(flag);
  store->path_ = std::move(path);
  store->lone_token_tenant_ = std::move(lone_token_tenant);
  return store;
}

absl::StatusOr<size_t> TokenStore::Reload() {
  if (path_.empty()) return absl::FailedPreconditionError("the token store has no file to read");
  // A pipe (--auth_token_file=<(...)) would block the read until a writer came, or read what
  // another reader left.
  if (read_once_ || !RegularFileOrGone(path_)) {
    return absl::FailedPreconditionError(absl::StrCat(
        flag_, ": ", path_,
        " is not a regular file, which cannot be read again (a pipe is read once): the tokens "
        "were read at start only"));
  }
  // Checked again at the read itself: a file swapped for a pipe after the check above is
  // refused, not read (blocking until a writer came).
  absl::StatusOr<TokenTable> table =
      TokenTable::Load(path_, lone_token_tenant_, FileKind::kRegular);
  if (!table.ok()) {
    return absl::Status(table.status().code(),
                        absl::StrCat(flag_, ": ", table.status().message()));
  }
  const size_t size = table->size();
  Replace(std::make_shared<const TokenTable>(*std::move(table)));
  return size;
}

const std::string* TokenTable::Find(absl::string_view token) const {
  const std::string* found = nullptr;
  for (const Entry& e : entries_) {
    if (ConstantTimeEquals(e.token, token) && found == nullptr) found = &e.tenant;
  }
  return found;
}

TokenAuthProcessor::~TokenAuthProcessor() { ReactionFromGrpc(this); }

grpc::Status TokenAuthProcessor::Process(const InputMetadata& auth_metadata, grpc::AuthContext*,
                                         OutputMetadata*, OutputMetadata*) {
  const GrpcReaction from_grpc(this);  // on gRPC's threads; gRPC destroys it after the last
  auto path = auth_metadata.find(":path");
  if (path != auth_metadata.end() &&
      absl::StartsWith(absl::string_view(path->second.data(), path->second.size()),
                       kHealthPrefix)) {
    return grpc::Status::OK;
  }
  auto refuse = [this](const char* message) {
    if (metrics_ != nullptr) metrics_->CountUnauthenticated();
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, message);
  };
  auto header = auth_metadata.find("authorization");
  if (header == auth_metadata.end()) {
    return refuse("this server requires a bearer token: send 'authorization: Bearer TOKEN'");
  }
  const absl::string_view token =
      BearerToken(absl::string_view(header->second.data(), header->second.size()));
  if (token.empty()) return refuse("the authorization header must be 'Bearer TOKEN'");
  if (tokens_->table()->Find(token) == nullptr) return refuse("unknown bearer token");
  // Not consumed: the service reads the call's tenant from it (TenantOf).
  return grpc::Status::OK;
}

absl::string_view BearerToken(absl::string_view authorization) {
  if (authorization.size() < 7 || !absl::EqualsIgnoreCase(authorization.substr(0, 7), "Bearer ")) {
    return "";
  }
  return absl::StripAsciiWhitespace(authorization.substr(7));
}

absl::string_view CallBearerToken(const grpc::ServerContextBase& context) {
  const auto& metadata = context.client_metadata();
  const auto header = metadata.find("authorization");
  if (header == metadata.end()) return "";
  return BearerToken(absl::string_view(header->second.data(), header->second.size()));
}

std::string TenantOf(const TokenTable& tokens, absl::string_view token) {
  const std::string* tenant = tokens.Find(token);  // "" is no token's (kMinTokenLength)
  return tenant != nullptr ? *tenant : kNoTenant;
}

}  // namespace kvrecall
