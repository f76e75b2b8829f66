#include "server/tls_identity.h"

#include <openssl/bio.h>
#include <openssl/buffer.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <sys/stat.h>

#include <ctime>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/file_util.h"

namespace kvrecall {

std::string OpenSslReason() {
  const unsigned long error = ERR_peek_last_error();  // NOLINT(runtime/int): OpenSSL's type
  ERR_clear_error();
  if (error == 0) return "";
  const char* reason = ERR_reason_error_string(error);
  return reason != nullptr ? reason : absl::StrCat("OpenSSL error ", error);
}

namespace {

// The file's PEM text when it holds a block of `kind` ("CERTIFICATE", "PRIVATE KEY" matches
// "RSA PRIVATE KEY" and "EC PRIVATE KEY" too); `flag` names it in errors.
absl::StatusOr<std::string> ReadPem(const std::string& path, absl::string_view kind,
                                    absl::string_view flag, FileKind file_kind) {
  absl::StatusOr<std::string> text = ReadFileToString(path, file_kind);
  if (!text.ok()) {
    return absl::Status(text.status().code(), absl::StrCat(flag, ": ", text.status().message()));
  }
  if (!absl::StrContains(*text, "-----BEGIN ") ||
      !absl::StrContains(*text, absl::StrCat(kind, "-----"))) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", path, " holds no PEM ", kind, " block"));
  }
  return text;
}

using UniqueX509 = std::unique_ptr<X509, decltype(&X509_free)>;

// The certificates of PEM `text` (the file `path` of `flag`), each parsed, in order, as gRPC
// reads them (PEM_read_bio_X509_AUX: CERTIFICATE, TRUSTED CERTIFICATE and X509 CERTIFICATE
// blocks; other blocks, a key beside the certificate, skipped): a block that does not parse is
// named, where gRPC would only fail to listen later, blaming no file.
absl::StatusOr<std::vector<UniqueX509>> ParseCertificates(const std::string& text,
                                                          const std::string& path,
                                                          absl::string_view flag) {
  std::vector<UniqueX509> certificates;
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(
      BIO_new_mem_buf(text.data(), static_cast<int>(text.size())), &BIO_free);
  if (bio == nullptr) return absl::ResourceExhaustedError("no memory to read a PEM file");
  ERR_clear_error();
  while (true) {
    UniqueX509 certificate(PEM_read_bio_X509_AUX(bio.get(), nullptr, nullptr, nullptr),
                           &X509_free);
    if (certificate == nullptr) {
      const unsigned long error = ERR_peek_last_error();  // NOLINT(runtime/int): OpenSSL's
      if (ERR_GET_LIB(error) == ERR_LIB_PEM && ERR_GET_REASON(error) == PEM_R_NO_START_LINE) {
        ERR_clear_error();  // no block left: the end of the file
        break;
      }
      return absl::InvalidArgumentError(absl::StrCat(
          flag, ": ", path, ": certificate ", certificates.size() + 1,
          " does not parse (", OpenSslReason(), ")"));
    }
    certificates.push_back(std::move(certificate));
  }
  if (certificates.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", path, " holds no PEM certificate block"));
  }
  return certificates;
}

// Refuses key material a listener would take and then fail with: a certificate or CA block
// that does not parse, a key that does not, or a key that is not the certificate's. Sets
// identity->not_after.
absl::Status CheckKeyMaterial(TlsIdentity* identity_out, const std::string& cert_file,
                              const std::string& key_file, const std::string& client_ca_file,
                              absl::string_view flag_prefix) {
  const std::string cert_flag = absl::StrCat("--", flag_prefix, "tls_cert");
  const std::string key_flag = absl::StrCat("--", flag_prefix, "tls_key");
  const TlsIdentity& identity = *identity_out;
  absl::StatusOr<std::vector<UniqueX509>> chain =
      ParseCertificates(identity.cert_chain, cert_file, cert_flag);
  if (!chain.ok()) return chain.status();
  // The chain ends when its first certificate to expire does (an intermediate may before the
  // server's own).
  for (size_t i = 0; i < chain->size(); ++i) {
    tm not_after = {};
    if (ASN1_TIME_to_tm(X509_get0_notAfter((*chain)[i].get()), &not_after) != 1) {
      return absl::InvalidArgumentError(absl::StrCat(cert_flag, ": ", cert_file, ": certificate ",
                                                     i + 1, "'s notAfter does not parse"));
    }
    const int64_t seconds = static_cast<int64_t>(timegm(&not_after));
    if (i == 0 || seconds < identity_out->not_after) identity_out->not_after = seconds;
  }
  const std::string& key = identity.private_key;
  std::unique_ptr<BIO, decltype(&BIO_free)> bio(
      BIO_new_mem_buf(key.data(), static_cast<int>(key.size())), &BIO_free);
  // No passphrase callback's prompt: a key that wants one is refused (an encrypted key was
  // refused before this, by its PEM header).
  pem_password_cb* no_passphrase = [](char*, int, int, void*) { return -1; };
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> private_key(
      bio ? PEM_read_bio_PrivateKey(bio.get(), nullptr, no_passphrase, nullptr) : nullptr,
      &EVP_PKEY_free);
  if (private_key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(key_flag, ": ", key_file,
                                                   ": the private key does not parse (",
                                                   OpenSslReason(), ")"));
  }
  if (X509_check_private_key(chain->front().get(), private_key.get()) != 1) {
    OpenSslReason();  // empties the queue
    return absl::InvalidArgumentError(absl::StrCat(
        key_flag, ": ", key_file, " is not the key of ", cert_flag, "'s certificate (",
        cert_file, "; its first, the server's own)"));
  }
  // The key alone, as PKCS#8 PEM: whatever else its file holds (certificates, parameters) must
  // not reach a listener, which would serve a certificate of the key file as the chain's first
  // where the two are read from one text (GrpcTlsFiles).
  std::unique_ptr<BIO, decltype(&BIO_free)> written(BIO_new(BIO_s_mem()), &BIO_free);
  BUF_MEM* pem = nullptr;
  if (written == nullptr ||
      PEM_write_bio_PrivateKey(written.get(), private_key.get(), nullptr, nullptr, 0, nullptr,
                               nullptr) != 1 ||
      BIO_get_mem_ptr(written.get(), &pem) != 1 || pem == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        key_flag, ": ", key_file, ": the key could not be written again (", OpenSslReason(), ")"));
  }
  identity_out->private_key.assign(pem->data, pem->length);
  OPENSSL_cleanse(pem->data, pem->length);
  // What OpenSSL will not serve at its security level (a key too small, a certificate signed
  // with a digest it no longer trusts): a listener would only fail later, blaming no file (the
  // gRPC port said "address in use or invalid?").
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> server(SSL_CTX_new(TLS_server_method()),
                                                           &SSL_CTX_free);
  if (server != nullptr) {
    if (SSL_CTX_use_certificate(server.get(), chain->front().get()) != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          cert_flag, ": ", cert_file, ": OpenSSL will not serve this certificate (",
          OpenSslReason(), ")"));
    }
    if (SSL_CTX_use_PrivateKey(server.get(), private_key.get()) != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          key_flag, ": ", key_file, ": OpenSSL will not serve this key (", OpenSslReason(), ")"));
    }
  }
  if (identity.client_ca) {
    absl::StatusOr<std::vector<UniqueX509>> roots = ParseCertificates(
        *identity.client_ca, client_ca_file, absl::StrCat("--", flag_prefix, "tls_client_ca"));
    if (!roots.ok()) return roots.status();
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TlsIdentity> ReadTlsIdentity(const std::string& cert_file,
                                            const std::string& key_file,
                                            const std::string& client_ca_file,
                                            absl::string_view flag_prefix, FileKind files) {
  const std::string cert_flag = absl::StrCat("--", flag_prefix, "tls_cert");
  const std::string key_flag = absl::StrCat("--", flag_prefix, "tls_key");
  if (cert_file.empty() || key_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        cert_flag, " and ", key_flag, " go together: give both (TLS) or neither (plaintext)"));
  }
  TlsIdentity identity;
  absl::StatusOr<std::string> cert = ReadPem(cert_file, "CERTIFICATE", cert_flag, files);
  if (!cert.ok()) return cert.status();
  identity.cert_chain = *std::move(cert);
  absl::StatusOr<std::string> key = ReadPem(key_file, "PRIVATE KEY", key_flag, files);
  // Nothing can ask for a passphrase: an encrypted key only failed later, as an address that
  // could not be listened on.
  if (key.ok() && (absl::StrContains(*key, "ENCRYPTED PRIVATE KEY") ||
                   absl::StrContains(*key, "Proc-Type: 4,ENCRYPTED"))) {
    return absl::InvalidArgumentError(absl::StrCat(
        key_flag, ": ", key_file,
        " is encrypted, which kvrecalld cannot use; decrypt it (openssl pkey -in KEY -out "
        "PLAIN) and protect the file instead"));
  }
  if (!key.ok()) return key.status();
  identity.private_key = *std::move(key);
  if (!client_ca_file.empty()) {
    absl::StatusOr<std::string> read = ReadPem(
        client_ca_file, "CERTIFICATE", absl::StrCat("--", flag_prefix, "tls_client_ca"), files);
    if (!read.ok()) return read.status();
    identity.client_ca = *std::move(read);
  }
  if (absl::Status s =
          CheckKeyMaterial(&identity, cert_file, key_file, client_ca_file, flag_prefix);
      !s.ok()) {
    return s;
  }
  return identity;
}

absl::Status RefreshableTlsFiles(const std::vector<std::string>& files,
                                 absl::string_view flag_prefix) {
  static constexpr const char* kFlags[] = {"tls_cert", "tls_key", "tls_client_ca"};
  for (size_t i = 0; i < files.size() && i < std::size(kFlags); ++i) {
    if (files[i].empty()) continue;
    // A file that cannot be stat'ed is left to the read, which says why it cannot be read.
    struct stat file;
    if (::stat(files[i].c_str(), &file) == 0 && !S_ISREG(file.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag_prefix, kFlags[i], ": ", files[i],
                       " is not a regular file, which cannot be read again (a pipe is read once)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<TlsIdentity>> ReadTlsIdentityAgain(
    const std::string& cert_file, const std::string& key_file, const std::string& client_ca_file,
    absl::string_view flag_prefix, const TlsIdentity& in_force, const absl::Status& at_start) {
  if (!at_start.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(at_start.message(), ": the TLS files were read at start only"));
  }
  // A file replaced by a pipe since the start would be read (and emptied) here.
  if (absl::Status s = RefreshableTlsFiles({cert_file, key_file, client_ca_file}, flag_prefix);
      !s.ok()) {
    return s;
  }
  // Regular files alone, checked again at each read itself: one swapped for a pipe after the
  // check above would otherwise block this read until a writer came.
  absl::StatusOr<TlsIdentity> read =
      ReadTlsIdentity(cert_file, key_file, client_ca_file, flag_prefix, FileKind::kRegular);
  if (!read.ok()) return read.status();
  if (read->cert_chain == in_force.cert_chain && read->private_key == in_force.private_key &&
      read->client_ca == in_force.client_ca) {
    return std::nullopt;
  }
  return *std::move(read);
}

std::string StalledTlsRead::Message(absl::string_view files) const {
  return absl::StrCat("kvrecalld: ", files, " TLS files have been read by one read for over ",
                      absl::FormatDuration(bound_),
                      " (a stalled filesystem?): they are not read meanwhile, and the "
                      "certificate in force stays\n");
}

absl::Status TlsFilesForAPeriod(const std::vector<std::string>& files,
                                absl::string_view flag_prefix) {
  absl::Status s = RefreshableTlsFiles(files, flag_prefix);
  if (s.ok()) return s;
  return absl::InvalidArgumentError(absl::StrCat(
      s.message(), ": give a regular file, or --tls_refresh_seconds=0 to read it at start only"));
}

}  // namespace kvrecall
