// The decode pipeline of one Decode stream: validates a request (one layer of one token for
// one or more sequences) in full, then appends each sequence's token, selects every query
// head's support, attends, and fills the reply — optionally with the fidelity shadow.
#ifndef KVRECALL_SERVER_DECODE_H_
#define KVRECALL_SERVER_DECODE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "kvrecall/v1/kvrecall.pb.h"
#include "server/session.h"

namespace kvrecall {

class DecodeStream {
 public:
  explicit DecodeStream(const SessionRegistry* registry) : registry_(registry) {}

  // Serves one request into `response` (which the caller cleared). A request with no steps
  // gets an empty reply. On error nothing was appended for any sequence of the request.
  // The sessions of a request are locked together, so streams sharing a session serialize.
  absl::Status Serve(const v1::DecodeRequest& request, v1::DecodeResponse* response);

 private:
  // Selects, attends and reports for one sequence whose token is already appended.
  void Attend(Session& session, int layer, const float* q, const v1::DecodeRequest& request,
              bool as_values, v1::SequenceResult* result);
  // Fills the fidelity fields of result->heads() against full attention over the same KV.
  void CompareExact(const Session& session, const Session::Layer& layer, const float* q,
                    v1::SequenceResult* result);

  const SessionRegistry* registry_;
  // Scratch reused across requests so that steady-state decoding allocates little.
  std::vector<std::shared_ptr<Session>> sessions_;
  std::vector<int64_t> query_offsets_;
  std::vector<float> queries_;
  std::vector<float> output_;
  std::vector<float> lse_;
  std::vector<float> full_output_;
  std::vector<float> full_lse_;
};

}  // namespace kvrecall

#endif  // KVRECALL_SERVER_DECODE_H_
