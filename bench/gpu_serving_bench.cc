// gpu_serving_bench: what a decode layer-step of a GPU-placed session costs end to end over
// loopback gRPC, per selector, batch and context, against the server's own time for it. For
// every (selector, context) it creates max(batches) one-layer sessions of the Llama-3-8B
// geometry (32 query / 8 KV heads, d = 128, bf16) on --server, prefills them (queries only where
// the selector needs them), then times `--steps` requests of each batch size after `--warmup`
// untimed ones. The tensors (--data): `synth`, the project's synthetic generator
// (client/trace/synthetic.h, what `kvrecall synth` writes: keys and queries of different
// distributions, attention sinks, RoPE recency, decode drift calibrated against tinylm-a), one
// trace per session; or `random`, N(0, 1) keys and values with decode queries that drift at
// --query_rho (consecutive cosine ~0.97 by default), the structure-free case every index finds
// hardest. The path mix ReTopK took and, for tiered sessions, each head's bulk time by path are
// reported; with --fidelity_steps, untimed steps after each run measure the heads' support
// recall, retained mass and output cosine against full attention (compare_exact). Prints one
// JSON document.
//
//   gpu_serving_bench --server=127.0.0.1:PORT --out=gpu_serving.json
#include <algorithm>
#include <cstring>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/int_list.h"
#include "client/kvrecall_client.h"
#include "client/stats.h"
#include "client/trace/synthetic.h"
#include "grpcpp/create_channel.h"
#include "kernels/dtype.h"
#include "kvrecall/v1/kvrecall.grpc.pb.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, server, "127.0.0.1:50051", "kvrecalld to measure, HOST:PORT or unix:PATH");
ABSL_FLAG(std::string, contexts, "16384,65536,131072,262144,1048576", "prompt tokens");
ABSL_FLAG(std::string, batches, "1,8", "sequences per request");
ABSL_FLAG(std::string, selectors, "full,exact_topk,retopk", "GPU selectors to time");
ABSL_FLAG(std::string, placement, "gpu", "placement of the sessions: gpu or tiered");
ABSL_FLAG(int32_t, top_k, 512, "K of exact_topk and retopk");
ABSL_FLAG(int32_t, steps, 64, "timed requests per (selector, batch, context)");
ABSL_FLAG(int32_t, warmup, 8, "untimed requests before them");
ABSL_FLAG(int32_t, q_heads, 32, "query heads");
ABSL_FLAG(int32_t, kv_heads, 8, "KV heads");
ABSL_FLAG(int32_t, head_dim, 128, "head dimension");
ABSL_FLAG(int32_t, prefill_threads, 8, "sessions prefilled at once, each on its own stream");
ABSL_FLAG(std::string, data, "synth",
          "the sessions' tensors: synth (client/trace/synthetic.h, a trace per session) or "
          "random (N(0, 1) keys and values, queries drifting at --query_rho)");
ABSL_FLAG(double, query_rho, 0.97,
          "--data=random: correlation of a head's decode query with its previous one (the "
          "drift: lower means ReTopK reuses fewer steps)");
ABSL_FLAG(bool, auto_tau, false, "ReTopK calibrates tau per head from the prefill queries");
ABSL_FLAG(int32_t, shortlist, 0,
          "tiered: the exact path rescores each head's best N keys by product-quantized score "
          "(policy.index.shortlist; 0: 2 * K where the shortlist is the exact search)");
ABSL_FLAG(std::string, exact_search, "",
          "tiered index / retopk: graph or shortlist (policy.index.exact_search; empty: the "
          "server's default, the shortlist on a GPU, or the graph when --search_list_size or "
          "--search_width is set)");
ABSL_FLAG(int32_t, fidelity_steps, 0,
          "after each run's timed steps, this many more with compare_exact (untimed): the "
          "heads' mean support recall, retained mass and output cosine against full attention");
ABSL_FLAG(int32_t, search_list_size, 0,
          "the graph index's search list (policy.index.search_list_size; 0: the server's "
          "default; set, asks for the graph)");
ABSL_FLAG(int32_t, search_width, 0,
          "the graph index's search width (policy.index.search_width; 0: the server's default; "
          "set, asks for the graph)");
ABSL_FLAG(std::string, out, "", "also write the JSON here");
ABSL_FLAG(std::string, gaps_us, "0",
          "pauses between a reply and the next request to time, one run per value: the gap a "
          "runner computing its other layers leaves (work the server defers, such as linking the "
          "graph index, runs in it)");

namespace kvrecall::bench {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;


// The JSON document printed at the end, or at the first failure with what failed as its
// "error", so that a run that fails at its last context keeps the figures of the others.
json& Doc() {
  static json doc = json::object();
  return doc;
}

void Emit() {
  const std::string text = Doc().dump(1);
  std::puts(text.c_str());
  if (const std::string out = absl::GetFlag(FLAGS_out); !out.empty()) std::ofstream(out) << text;
}

void Check(const absl::Status& s, const std::string& what) {
  if (!s.ok()) {
    std::fprintf(stderr, "gpu_serving_bench: %s: %s\n", what.c_str(), s.ToString().c_str());
    Doc()["error"] = absl::StrCat(what, ": ", s.ToString());
    Emit();
    std::exit(1);
  }
}
void Check(const grpc::Status& s, const std::string& what) {
  Check(s.ok() ? absl::OkStatus()
               : absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message()),
        what);
}

// bf16 bytes of N(0, 1) values, made once and sliced for every session's keys and values.
std::string RandomBf16(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::string out(count * 2, '\0');
  for (size_t i = 0; i < count; ++i) {
    const uint16_t b = FloatToBf16(normal(rng));
    std::memcpy(out.data() + 2 * i, &b, 2);
  }
  return out;
}

// Queries that drift per head: q_{t+1} = rho q_t + sqrt(1 - rho^2) 1.85 n_t, stationary at
// N(0, 1.85^2) per coordinate ([steps, q_heads, head_dim]).
std::vector<float> DriftingQueries(int steps, int row, double rho, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> state(row), out;
  for (float& x : state) x = 1.85f * normal(rng);
  const float a = static_cast<float>(rho);
  const float b = static_cast<float>(1.85 * std::sqrt(1.0 - rho * rho));
  out.reserve(static_cast<size_t>(steps) * row);
  for (int t = 0; t < steps; ++t) {
    for (float& x : state) {
      x = a * x + b * normal(rng);
      out.push_back(x);
    }
  }
  return out;
}

v1::Tensor Bf16Tensor(std::vector<int64_t> shape, std::string bytes) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_BF16);
  for (int64_t d : shape) t.add_shape(d);
  t.set_data(std::move(bytes));
  return t;
}

std::string ToBf16(const float* x, size_t n) {
  std::string out(2 * n, '\0');
  for (size_t i = 0; i < n; ++i) {
    const uint16_t b = FloatToBf16(x[i]);
    std::memcpy(out.data() + 2 * i, &b, 2);
  }
  return out;
}

struct Geometry {
  int q_heads, kv_heads, head_dim;
  int q_row() const { return q_heads * head_dim; }
  int kv_row() const { return kv_heads * head_dim; }
};

// Prefills one session's single layer with `context` tokens: keys and values sliced out of
// `pool` at a per-session offset, queries for the last `with_queries` tokens (`last_queries`)
// and, with `all_queries` (the graph index of the tiered placement is built from every prompt
// query), before them each token's query heads copies of its own key (bf16 bytes as they are).
// Returns the server's build seconds (PrefillResponse.build_seconds: the layer's selector
// state, the graph index for index and retopk, apart from the prompt's transfer).
double PrefillSession(v1::KvRecall::Stub& stub, const std::string& id, const Geometry& g,
                      int64_t context, const std::string& pool, int64_t offset,
                      const std::vector<float>& last_queries, int with_queries,
                      bool all_queries) {
  grpc::ClientContext ctx;
  v1::PrefillResponse response;
  auto writer = stub.Prefill(&ctx, &response);
  constexpr int64_t kChunk = 4096;  // tokens: 8 MiB of keys and values per message
  const int64_t pool_tokens = static_cast<int64_t>(pool.size()) / (2 * g.kv_row());
  v1::PrefillChunk chunk;
  for (int64_t begin = 0; begin < context; begin += kChunk) {
    const int64_t n = std::min(kChunk, context - begin);
    chunk.Clear();
    chunk.set_session_id(id);
    chunk.set_layer(0);
    chunk.set_offset(begin);
    const int64_t at = (offset + begin) % (pool_tokens - n);
    const size_t bytes = static_cast<size_t>(n) * g.kv_row() * 2;
    *chunk.mutable_k() = Bf16Tensor({n, g.kv_heads, g.head_dim},
                                    pool.substr(static_cast<size_t>(at) * g.kv_row() * 2, bytes));
    *chunk.mutable_v() = Bf16Tensor(
        {n, g.kv_heads, g.head_dim},
        pool.substr(static_cast<size_t>(pool_tokens - n - at) * g.kv_row() * 2, bytes));
    // Queries for the chunk's tokens among the last `with_queries` (all of them, random, when
    // the chunk holds only part of that window: the selector reads only its seeds).
    const int64_t q_from = context - with_queries;
    if (all_queries && begin + n <= q_from) {
      const std::string keys = pool.substr(static_cast<size_t>(at) * g.kv_row() * 2, bytes);
      const int group = g.q_heads / g.kv_heads;
      std::string q(static_cast<size_t>(n) * g.q_row() * 2, '\0');
      for (int64_t t = 0; t < n; ++t) {
        for (int h = 0; h < g.q_heads; ++h) {
          std::memcpy(q.data() + (t * g.q_row() + int64_t{h} * g.head_dim) * 2,
                      keys.data() + (t * g.kv_row() + int64_t{h / group} * g.head_dim) * 2,
                      static_cast<size_t>(g.head_dim) * 2);
        }
      }
      *chunk.mutable_q() = Bf16Tensor({n, g.q_heads, g.head_dim}, std::move(q));
    } else if (begin + n > q_from) {
      std::vector<float> q(static_cast<size_t>(n) * g.q_row(), 0.0f);
      if (all_queries) {
        // The tokens of this chunk before the last `with_queries`: their keys, as above.
        const int group = g.q_heads / g.kv_heads;
        for (int64_t t = begin; t < q_from; ++t) {
          for (int h = 0; h < g.q_heads; ++h) {
            for (int j = 0; j < g.head_dim; ++j) {
              uint16_t bits;
              std::memcpy(&bits,
                          pool.data() + ((at + t - begin) * g.kv_row() +
                                         int64_t{h / group} * g.head_dim + j) * 2,
                          2);
              const uint32_t word = uint32_t{bits} << 16;
              std::memcpy(&q[(t - begin) * g.q_row() + int64_t{h} * g.head_dim + j], &word, 4);
            }
          }
        }
      }
      for (int64_t t = std::max(begin, q_from); t < begin + n; ++t) {
        const int64_t i = t - q_from;  // index into last_queries
        std::copy_n(last_queries.data() + i * g.q_row(), g.q_row(),
                    q.data() + (t - begin) * g.q_row());
      }
      *chunk.mutable_q() = Bf16Tensor({n, g.q_heads, g.head_dim}, ToBf16(q.data(), q.size()));
    }
    if (!writer->Write(chunk)) break;
  }
  writer->WritesDone();
  Check(writer->Finish(), absl::StrCat("prefilling ", id));
  return response.build_seconds();
}

// Rows [begin, begin + n) of one tensor of `trace`'s layer 0 as bf16 bytes.
std::string SynthBf16(const SyntheticTrace& trace, TracePhase phase, TraceTensor tensor,
                      int64_t begin, int64_t n) {
  const TraceGeometry g = trace.geometry();
  std::vector<float> rows(static_cast<size_t>(n) * g.heads(tensor) * g.head_dim);
  trace.GenerateRows(0, phase, tensor, begin, n, rows.data());
  return ToBf16(rows.data(), rows.size());
}

// Prefills one session's single layer with the prompt of `trace`: keys and values, and the
// queries of the last `with_queries` tokens (every token's with `all_queries`). `threads`
// generate the chunks side by side, a round of them at a time, so that a 512K prompt is not
// bound by the generator.
double PrefillSynth(v1::KvRecall::Stub& stub, const std::string& id, const Geometry& g,
                    const SyntheticTrace& trace, int with_queries, bool all_queries,
                    int threads) {
  grpc::ClientContext ctx;
  v1::PrefillResponse response;
  auto writer = stub.Prefill(&ctx, &response);
  constexpr int64_t kChunk = 4096;
  const int64_t context = trace.params().context;
  std::vector<v1::PrefillChunk> round(std::max(1, threads));
  for (int64_t first = 0; first < context; first += kChunk * static_cast<int64_t>(round.size())) {
    std::vector<std::thread> makers;
    for (size_t c = 0; c < round.size(); ++c) {
      makers.emplace_back([&, c] {
        v1::PrefillChunk& chunk = round[c];
        chunk.Clear();
        const int64_t begin = first + static_cast<int64_t>(c) * kChunk;
        if (begin >= context) return;
        const int64_t n = std::min(kChunk, context - begin);
        chunk.set_session_id(id);
        chunk.set_layer(0);
        chunk.set_offset(begin);
        *chunk.mutable_k() = Bf16Tensor(
            {n, g.kv_heads, g.head_dim},
            SynthBf16(trace, TracePhase::kPrefill, TraceTensor::kK, begin, n));
        *chunk.mutable_v() = Bf16Tensor(
            {n, g.kv_heads, g.head_dim},
            SynthBf16(trace, TracePhase::kPrefill, TraceTensor::kV, begin, n));
        if (all_queries || begin + n > context - with_queries) {
          *chunk.mutable_q() = Bf16Tensor(
              {n, g.q_heads, g.head_dim},
              SynthBf16(trace, TracePhase::kPrefill, TraceTensor::kQ, begin, n));
        }
      });
    }
    for (std::thread& t : makers) t.join();
    for (const v1::PrefillChunk& chunk : round) {
      if (chunk.has_k() && !writer->Write(chunk)) break;
    }
  }
  writer->WritesDone();
  Check(writer->Finish(), absl::StrCat("prefilling ", id));
  return response.build_seconds();
}

int Main() {
  const std::vector<int> contexts = bench::IntListOrExit("contexts", absl::GetFlag(FLAGS_contexts));
  const std::vector<int> batches = bench::IntListOrExit("batches", absl::GetFlag(FLAGS_batches));
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  // (batch, gap) in the order timed: every gap of a batch before the next batch.
  std::vector<std::pair<int, int>> runs;
  const std::vector<int> gaps = bench::IntListOrExit("gaps_us", absl::GetFlag(FLAGS_gaps_us), 0);
  for (int batch : batches) {
    for (int gap : gaps) runs.push_back({batch, gap});
  }
  const Geometry g{absl::GetFlag(FLAGS_q_heads), absl::GetFlag(FLAGS_kv_heads),
                   absl::GetFlag(FLAGS_head_dim)};
  const int steps = absl::GetFlag(FLAGS_steps);
  const int warmup = absl::GetFlag(FLAGS_warmup);
  const int fidelity_steps = absl::GetFlag(FLAGS_fidelity_steps);
  // Every run reports its timed steps' percentiles: it needs one (probe 24: --steps=0 read
  // past an empty list).
  if (steps < 1) {
    Check(absl::InvalidArgumentError(absl::StrCat("must be >= 1, got ", steps)), "--steps");
  }
  if (warmup < 0) {
    Check(absl::InvalidArgumentError(absl::StrCat("must be >= 0, got ", warmup)), "--warmup");
  }
  if (fidelity_steps < 0) {
    Check(absl::InvalidArgumentError(absl::StrCat("must be >= 0, got ", fidelity_steps)),
          "--fidelity_steps");
  }
  const int top_k = absl::GetFlag(FLAGS_top_k);
  absl::StatusOr<v1::Placement> placement = client::ParsePlacement(absl::GetFlag(FLAGS_placement));
  Check(placement.status(), "--placement");
  const std::string data = absl::GetFlag(FLAGS_data);
  if (data != "synth" && data != "random") {
    Check(absl::InvalidArgumentError(absl::StrCat("not synth or random: ", data)), "--data");
  }
  const bool synth = data == "synth";

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);
  args.SetMaxSendMessageSize(256 << 20);
  auto channel = grpc::CreateCustomChannel(absl::GetFlag(FLAGS_server),
                                           grpc::InsecureChannelCredentials(), args);
  auto stub = v1::KvRecall::NewStub(channel);
  // One pool of random KV (64K tokens) that every session slices at its own offset.
  const int64_t pool_tokens = 65536 + 4096;
  const std::string pool =
      synth ? std::string() : RandomBf16(static_cast<size_t>(pool_tokens) * g.kv_row(), 1);

  json& doc = Doc();
  doc = {{"q_heads", g.q_heads},
         {"kv_heads", g.kv_heads},
         {"head_dim", g.head_dim},
         {"dtype", "bf16"},
         {"top_k", top_k},
         {"data", data},
         {"query_rho", synth ? json(nullptr) : json(absl::GetFlag(FLAGS_query_rho))},
         {"auto_tau", absl::GetFlag(FLAGS_auto_tau)},
         {"search_width", absl::GetFlag(FLAGS_search_width)},
         {"search_list_size", absl::GetFlag(FLAGS_search_list_size)},
         {"shortlist", absl::GetFlag(FLAGS_shortlist)},
         {"records", json::array()}};
  json& records = doc["records"];
  for (const std::string& selector_name :
       std::vector<std::string>(absl::StrSplit(absl::GetFlag(FLAGS_selectors), ','))) {
    absl::StatusOr<v1::Selector> selector = client::ParseSelector(selector_name);
    Check(selector.status(), "--selectors");
    for (int context : contexts) {
      // Sessions: queries for ReTopK's seeds (the C = 32 before the decode steps).
      // auto_tau calibrates on 256 prompt queries more.
      const int with_queries =
          *selector == v1::SELECTOR_RETOPK ? (absl::GetFlag(FLAGS_auto_tau) ? 32 + 256 : 32) : 0;
      // The tiered graph index (the index selector, ReTopK's exact path) needs every query;
      // a shortlist replaces the graph. The sessions' effective policy says which they have.
      bool all_queries = false;
      v1::Policy policy = client::CpuPolicy(*selector, top_k);
      policy.set_placement(*placement);
      if (absl::GetFlag(FLAGS_auto_tau)) policy.mutable_retopk()->set_auto_tau(true);
      policy.mutable_index()->set_search_width(absl::GetFlag(FLAGS_search_width));
      policy.mutable_index()->set_search_list_size(absl::GetFlag(FLAGS_search_list_size));
      policy.mutable_index()->set_shortlist(absl::GetFlag(FLAGS_shortlist));
      if (const std::string search = absl::GetFlag(FLAGS_exact_search); !search.empty()) {
        absl::StatusOr<v1::ExactSearch> parsed = client::ParseExactSearch(search);
        Check(parsed.status(), "--exact_search");
        policy.mutable_index()->set_exact_search(*parsed);
      }
      v1::Policy effective;  // the first session's, as CreateSession answered
      std::vector<std::string> ids(max_batch);
      std::vector<std::vector<float>> queries(max_batch);
      std::vector<SyntheticTrace> traces;
      const int total_steps =
          with_queries + (warmup + steps + fidelity_steps) * static_cast<int>(runs.size());
      for (int b = 0; b < max_batch; ++b) {
        v1::CreateSessionRequest request;
        v1::Geometry* geo = request.mutable_geometry();
        geo->set_layers(1);
        geo->set_q_heads(g.q_heads);
        geo->set_kv_heads(g.kv_heads);
        geo->set_head_dim(g.head_dim);
        geo->set_dtype(v1::DTYPE_BF16);
        *request.mutable_policy() = policy;
        request.set_max_tokens(context + total_steps);
        request.set_label(absl::StrCat("gpu_serving_bench ", selector_name, " ", context));
        v1::CreateSessionResponse response;
        grpc::ClientContext ctx;
        Check(stub->CreateSession(&ctx, request, &response), "CreateSession");
        ids[b] = response.session_id();
        effective = response.policy();
        all_queries = *placement == v1::PLACEMENT_TIERED &&
                      effective.index().exact_search() == v1::EXACT_SEARCH_GRAPH;
        if (synth) {
          SyntheticTraceParams params;
          params.q_heads = g.q_heads;
          params.kv_heads = g.kv_heads;
          params.head_dim = g.head_dim;
          params.context = context;
          params.decode_steps = total_steps;
          params.seed = 100 + b;
          absl::StatusOr<SyntheticTrace> trace = SyntheticTrace::Create(params);
          Check(trace.status(), "the synthetic trace");
          traces.push_back(*std::move(trace));
        } else {
          queries[b] = DriftingQueries(total_steps, g.q_row(), absl::GetFlag(FLAGS_query_rho),
                                       100 + b);
        }
      }
      const auto prefill_start = Clock::now();
      std::vector<double> build_seconds(max_batch);
      {
        std::vector<std::thread> threads;
        const int parallel = std::max(1, absl::GetFlag(FLAGS_prefill_threads));
        // The host's cores, shared by the sessions prefilled at once.
        const int generator_threads = std::max<int>(
            1, static_cast<int>(std::thread::hardware_concurrency()) / std::min(parallel, max_batch));
        for (int t = 0; t < parallel; ++t) {
          threads.emplace_back([&, t] {
            for (int b = t; b < max_batch; b += parallel) {
              build_seconds[b] =
                  synth ? PrefillSynth(*stub, ids[b], g, traces[b], with_queries, all_queries,
                                       generator_threads)
                        : PrefillSession(*stub, ids[b], g, context, pool, 7919LL * b, queries[b],
                                         with_queries, all_queries);
            }
          });
        }
        for (std::thread& th : threads) th.join();
      }
      const double prefill_s =
          std::chrono::duration<double>(Clock::now() - prefill_start).count();

      grpc::ClientContext ctx;
      auto stream = stub->Decode(&ctx);
      int step_index = with_queries;  // the drift continues from the seeds
      v1::DecodeRequest request;
      v1::DecodeResponse response;
      std::vector<float> kv(g.kv_row());
      std::mt19937_64 rng(context);
      std::normal_distribution<float> normal(0.0f, 1.0f);
      const size_t first_record = records.size();  // these sessions' runs' records from here
      for (const auto& [batch, gap_us] : runs) {
        std::vector<double> e2e, server, beyond;  // beyond: e2e - server, step by step
        // Tiered: tier_micros.
        std::vector<double> static_set, bulk, link_wait, shortlist, launch, shortlists_ready,
            device_exact, plan, decide, device_exact_wait, finish_wait, finish, reserve;
        std::vector<v1::TierMicros> tier_by_step;  // the timed steps' phases, in their order
        int64_t paths[5] = {};
        // Tiered: each head's bulk time and candidates, by the path it took.
        std::vector<double> head_micros[5], head_candidates[5];
        // Tiered: heads whose exact paths ran on the GPU (no host time: not in head_micros).
        int64_t device_heads = 0;
        // Tiered: the heads' intervals from the bulk's start, step by step: when the first began
        // and the last ended, and their summed time (over the span: how many ran at once).
        std::vector<double> heads_first_start, heads_last_end, heads_busy, heads_concurrency;
        json head_intervals = json::array();  // the last steps' [path, start, micros, keys]
        std::vector<json> step_intervals;  // every timed step's, for the slowest steps
        // The fidelity steps' sums over heads (support recall, retained mass, output cosine).
        double fidelity_sums[3] = {};
        int64_t fidelity_heads = 0;
        for (int i = 0; i < warmup + steps + fidelity_steps; ++i, ++step_index) {
          const bool fidelity_step = i >= warmup + steps;
          request.Clear();
          request.set_layer(0);
          request.set_diagnostics(*selector == v1::SELECTOR_RETOPK ||
                                  *placement == v1::PLACEMENT_TIERED);
          request.set_compare_exact(fidelity_step);
          for (int b = 0; b < batch; ++b) {
            v1::SequenceStep* s = request.add_steps();
            s->set_session_id(ids[b]);
            if (synth) {
              // The trace's decode rows (the drift runs on from the prompt's end).
              const int64_t row = step_index - with_queries;
              *s->mutable_q() = Bf16Tensor(
                  {g.q_heads, g.head_dim},
                  SynthBf16(traces[b], TracePhase::kDecode, TraceTensor::kQ, row, 1));
              *s->mutable_k_new() = Bf16Tensor(
                  {g.kv_heads, g.head_dim},
                  SynthBf16(traces[b], TracePhase::kDecode, TraceTensor::kK, row, 1));
              *s->mutable_v_new() = Bf16Tensor(
                  {g.kv_heads, g.head_dim},
                  SynthBf16(traces[b], TracePhase::kDecode, TraceTensor::kV, row, 1));
              continue;
            }
            *s->mutable_q() =
                Bf16Tensor({g.q_heads, g.head_dim},
                           ToBf16(queries[b].data() + static_cast<size_t>(step_index) * g.q_row(),
                                  g.q_row()));
            for (float& x : kv) x = normal(rng);
            *s->mutable_k_new() = Bf16Tensor({g.kv_heads, g.head_dim}, ToBf16(kv.data(), kv.size()));
            *s->mutable_v_new() = Bf16Tensor({g.kv_heads, g.head_dim}, ToBf16(kv.data(), kv.size()));
          }
          if (gap_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(gap_us));
          const auto t0 = Clock::now();
          if (!stream->Write(request) || !stream->Read(&response)) {
            Check(stream->Finish(), "Decode");
          }
          const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
          if (fidelity_step) {
            for (const v1::SequenceResult& r : response.results()) {
              for (const v1::HeadDiagnostics& h : r.heads()) {
                fidelity_sums[0] += h.support_recall();
                fidelity_sums[1] += h.retained_mass();
                fidelity_sums[2] += h.output_cosine();
                ++fidelity_heads;
              }
            }
            continue;
          }
          if (i < warmup) continue;
          e2e.push_back(us);
          server.push_back(response.server_micros());
          beyond.push_back(us - response.server_micros());
          if (response.has_tier_micros()) {
            static_set.push_back(response.tier_micros().static_set());
            bulk.push_back(response.tier_micros().bulk());
            link_wait.push_back(response.tier_micros().link_wait());
            shortlist.push_back(response.tier_micros().shortlist());
            launch.push_back(response.tier_micros().launch());
            shortlists_ready.push_back(response.tier_micros().shortlists_ready());
            device_exact.push_back(response.tier_micros().device_exact());
            plan.push_back(response.tier_micros().plan());
            decide.push_back(response.tier_micros().decide());
            device_exact_wait.push_back(response.tier_micros().device_exact_wait());
            finish_wait.push_back(response.tier_micros().finish_wait());
            finish.push_back(response.tier_micros().finish());
            reserve.push_back(response.tier_micros().reserve());
            tier_by_step.push_back(response.tier_micros());
          }
          double first_start = 1e30, last_end = 0, busy = 0;
          json intervals = json::array();
          for (const v1::SequenceResult& r : response.results()) {
            for (const v1::HeadDiagnostics& h : r.heads()) {
              ++paths[h.path()];
              if (response.has_tier_micros() && h.bulk_micros() == 0.0f) {
                ++device_heads;
              } else if (response.has_tier_micros()) {
                head_micros[h.path()].push_back(h.bulk_micros());
                head_candidates[h.path()].push_back(h.candidates());
                first_start = std::min<double>(first_start, h.bulk_start_micros());
                last_end = std::max<double>(last_end, h.bulk_start_micros() + h.bulk_micros());
                busy += h.bulk_micros();
                intervals.push_back({static_cast<int>(h.path()), h.bulk_start_micros(),
                                     h.bulk_micros(), h.candidates()});
              }
            }
          }
          if (busy > 0) {
            heads_first_start.push_back(first_start);
            heads_last_end.push_back(last_end);
            heads_busy.push_back(busy);
            heads_concurrency.push_back(busy / std::max(1e-3, last_end - first_start));
            if (i >= warmup + steps - 5) head_intervals.push_back(intervals);
          }
          step_intervals.push_back(std::move(intervals));
        }
        const double heads = static_cast<double>(steps) * batch * g.q_heads;
        json fidelity = nullptr;
        if (fidelity_heads > 0) {
          const auto n = static_cast<double>(fidelity_heads);
          fidelity = {{"steps", fidelity_steps},
                      {"support_recall", fidelity_sums[0] / n},
                      {"retained_mass", fidelity_sums[1] / n},
                      {"output_cosine", fidelity_sums[2] / n}};
          std::fprintf(stderr, "%s %d x%d fidelity over %d steps: support recall %.4f, retained "
                       "mass %.4f, output cosine %.5f\n", selector_name.c_str(), context, batch,
                       fidelity_steps, fidelity_sums[0] / n, fidelity_sums[1] / n,
                       fidelity_sums[2] / n);
        }
        json rec = {{"selector", selector_name},
                    {"placement", absl::GetFlag(FLAGS_placement)},
                    {"context", context},
                    {"batch", batch},
                    {"steps", steps},
                    // The sessions' effective exact search and shortlist N (0: none).
                    {"exact_search", client::ExactSearchName(effective.index().exact_search())},
                    {"effective_shortlist", effective.index().shortlist()},
                    {"fidelity", fidelity},
                    {"e2e_p50_us", client::Percentile(e2e, 0.5)},
                    {"e2e_p99_us", client::Percentile(e2e, 0.99)},
                    {"server_p50_us", client::Percentile(server, 0.5)},
                    {"server_p99_us", client::Percentile(server, 0.99)},
                    // A step that waited (a take-over of relearned codes, a store's growth)
                    // shows here and in the per-step times, in the timed steps' order.
                    {"server_max_us", *std::max_element(server.begin(), server.end())},
                    {"server_us_by_step", server},
                    {"e2e_minus_server_p50_us", client::Percentile(beyond, 0.5)},
                    {"e2e_minus_server_p99_us", client::Percentile(beyond, 0.99)},
                    {"prefill_seconds", prefill_s},
                    // Per session (one layer each): the server's build alone.
                    {"build_seconds_max",
                     *std::max_element(build_seconds.begin(), build_seconds.end())},
                    {"build_seconds_first", build_seconds[0]},
                    {"sessions", max_batch},
                    {"gap_us", gap_us}};
        if (!bulk.empty()) {
          // The halves apart: the static tier's own time overlaps the bulk's.
          rec["static_set_p50_us"] = client::Percentile(static_set, 0.5);
          rec["static_set_p99_us"] = client::Percentile(static_set, 0.99);
          rec["bulk_p50_us"] = client::Percentile(bulk, 0.5);
          rec["bulk_p99_us"] = client::Percentile(bulk, 0.99);
          rec["link_wait_p50_us"] = client::Percentile(link_wait, 0.5);
          rec["link_wait_p99_us"] = client::Percentile(link_wait, 0.99);
          rec["shortlist_p50_us"] = client::Percentile(shortlist, 0.5);
          rec["shortlist_p99_us"] = client::Percentile(shortlist, 0.99);
          rec["launch_p50_us"] = client::Percentile(launch, 0.5);
          rec["shortlists_ready_p50_us"] = client::Percentile(shortlists_ready, 0.5);
          rec["device_exact_p50_us"] = client::Percentile(device_exact, 0.5);
          rec["plan_p50_us"] = client::Percentile(plan, 0.5);
          rec["decide_p50_us"] = client::Percentile(decide, 0.5);
          rec["device_exact_wait_p50_us"] = client::Percentile(device_exact_wait, 0.5);
          rec["finish_wait_p50_us"] = client::Percentile(finish_wait, 0.5);
          rec["finish_p50_us"] = client::Percentile(finish, 0.5);
          rec["reserve_p50_us"] = client::Percentile(reserve, 0.5);
          // Where a stall went: the slowest timed steps (by server time) with their phases.
          std::vector<size_t> order(server.size());
          std::iota(order.begin(), order.end(), size_t{0});
          const size_t slowest = std::min<size_t>(5, order.size());
          std::partial_sort(order.begin(), order.begin() + slowest, order.end(),
                            [&](size_t a, size_t b) { return server[a] > server[b]; });
          json slow = json::array();
          for (size_t j = 0; j < slowest && order[j] < tier_by_step.size(); ++j) {
            const v1::TierMicros& t = tier_by_step[order[j]];
            slow.push_back({{"step", order[j]}, {"server_us", server[order[j]]},
                            {"reserve_us", t.reserve()}, {"plan_us", t.plan()},
                            {"launch_us", t.launch()}, {"bulk_us", t.bulk()},
                            {"static_set_us", t.static_set()}, {"finish_us", t.finish()},
                            {"link_wait_us", t.link_wait()}, {"decide_us", t.decide()},
                            {"shortlist_us", t.shortlist()},
                            {"shortlists_ready_us", t.shortlists_ready()},
                            {"device_exact_us", t.device_exact()},
                            {"device_exact_wait_us", t.device_exact_wait()},
                            {"finish_wait_us", t.finish_wait()},
                            // The step's host heads: [path, start, micros, keys] each.
                            {"heads", order[j] < step_intervals.size()
                                          ? step_intervals[order[j]]
                                          : json::array()}});
          }
          rec["slowest_steps"] = slow;
          std::fprintf(stderr, "  static set p50 %.1f us (p99 %.1f), bulk p50 %.1f us (p99 %.1f), "
                       "link wait p50 %.1f us (p99 %.1f)\n",
                       rec["static_set_p50_us"].get<double>(), rec["static_set_p99_us"].get<double>(),
                       rec["bulk_p50_us"].get<double>(), rec["bulk_p99_us"].get<double>(),
                       rec["link_wait_p50_us"].get<double>(), rec["link_wait_p99_us"].get<double>());
        }
        if (!heads_busy.empty()) {
          rec["heads_first_start_p50_us"] = client::Percentile(heads_first_start, 0.5);
          rec["heads_last_end_p50_us"] = client::Percentile(heads_last_end, 0.5);
          rec["heads_busy_p50_us"] = client::Percentile(heads_busy, 0.5);
          rec["heads_concurrency_p50"] = client::Percentile(heads_concurrency, 0.5);
          rec["last_steps_head_intervals"] = head_intervals;
          std::fprintf(stderr,
                       "  heads: first start p50 %.1f us, last end p50 %.1f us, summed %.1f us "
                       "(%.1f at once)\n",
                       rec["heads_first_start_p50_us"].get<double>(),
                       rec["heads_last_end_p50_us"].get<double>(),
                       rec["heads_busy_p50_us"].get<double>(),
                       rec["heads_concurrency_p50"].get<double>());
        }
        // Per path: a head's bulk time and the tokens it scored (what a step waits for is its
        // slowest head).
        for (const auto& [path, name] :
             {std::pair{v1::PATH_EXACT, "exact"}, std::pair{v1::PATH_REUSE, "reuse"},
              std::pair{v1::PATH_FALLBACK, "fallback"}, std::pair{v1::PATH_REFRESH, "refresh"}}) {
          const std::vector<double>& us = head_micros[path];
          if (us.empty()) continue;
          double candidates = 0;
          for (double c : head_candidates[path]) candidates += c;
          rec["head_bulk_by_path"][name] = {
              {"heads", us.size()},
              {"bulk_p50_us", client::Percentile(us, 0.5)},
              {"bulk_p99_us", client::Percentile(us, 0.99)},
              {"candidates_mean", candidates / static_cast<double>(us.size())}};
          std::fprintf(stderr, "  %s heads: bulk p50 %.1f us (p99 %.1f), %.0f candidates\n", name,
                       client::Percentile(us, 0.5), client::Percentile(us, 0.99),
                       candidates / static_cast<double>(us.size()));
        }
        rec["device_exact_heads_per_step"] = static_cast<double>(device_heads) / steps;
        if (*selector == v1::SELECTOR_RETOPK) {
          rec["path_mix"] = {{"reuse", paths[v1::PATH_REUSE] / heads},
                             {"fallback", paths[v1::PATH_FALLBACK] / heads},
                             {"refresh", paths[v1::PATH_REFRESH] / heads}};
        }
        std::fprintf(stderr,
                     "%s %d x%d gap %d us: e2e p50 %.1f us (p99 %.1f), server p50 %.1f us, e2e - "
                     "server p50 %.1f us\n",
                     selector_name.c_str(), context, batch, gap_us, rec["e2e_p50_us"].get<double>(),
                     rec["e2e_p99_us"].get<double>(), rec["server_p50_us"].get<double>(),
                     rec["e2e_minus_server_p50_us"].get<double>());
        records.push_back(rec);
      }
      stream->WritesDone();
      Check(stream->Finish(), "Decode");
      v1::GetSessionRequest get;
      get.set_session_id(ids[0]);
      v1::SessionInfo info;
      grpc::ClientContext get_ctx;
      Check(stub->GetSession(&get_ctx, get, &info), "GetSession");
      // Per session, the same for every batch run of these sessions.
      for (size_t r = first_record; r < records.size(); ++r) {
        records[r]["session_gpu_bytes"] = info.gpu_bytes();
        records[r]["session_host_bytes"] = info.host_bytes();
      }
      for (const std::string& id : ids) {
        v1::CloseSessionRequest close;
        close.set_session_id(id);
        v1::CloseSessionResponse closed;
        grpc::ClientContext close_ctx;
        Check(stub->CloseSession(&close_ctx, close, &closed), "CloseSession");
      }
    }
  }
  Emit();
  return 0;
}

}  // namespace
}  // namespace kvrecall::bench

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("gpu_serving_bench --server=HOST:PORT: GPU layer-steps over gRPC");
  absl::ParseCommandLine(argc, argv);
  return kvrecall::bench::Main();
}
