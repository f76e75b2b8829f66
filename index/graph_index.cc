#include "index/graph_index.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>


#include "absl/strings/str_cat.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/mapped_memory.h"

namespace kvrecall {
namespace {

using Clock = std::chrono::steady_clock;

// Edges into a new (or repaired) key from the best keys its own search finds that survive
// pruning: enough ways in, few enough to leave the rest of the graph to the projection.
constexpr int kKeptLinksPerKey = 4;

// Random links from each member of a sampled query's top-k list to others of the list.
constexpr int kListLinks = 4;

// SplitMix64's finalizer: the deterministic "random" choice of list links.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The search loop (SearchGraph) is shaped by its profile (issue 15; bench/results/index_bench.md,
// "Search loop cost per scored key" and "RoarGraph on the same data, and a blocked search pool"). A
// hop expands one node but scores only 2.5-5 keys on average (most of its ~27 neighbors are already
// visited), so the cost is per hop more than per key: the node's adjacency row, then its fresh
// neighbors' rows (4 cache lines each in bf16 at d = 128), then the pool insertions. The fresh rows
// are scored together (cpu::DotProductRows: cpu::DotProduct's arithmetic, bit for bit), the
// adjacency row of every accepted candidate and of the likely next node is prefetched ahead of its
// expansion, and the visited set is a bitset (4 KiB at 32K keys, so it stays in L1). The pool
// (CandidatePool) is blocked: a flat sorted array's insertions (a binary search, then a memmove of
// every entry after the place: 80-430 of them per insertion at lists of 200-2000) were 27-38 % of
// the search's time; with blocks the moves are short. The results are bit-identical to a flat
// array's: the same scores, the same pool order (ties after the entries already there), hence the
// same expansions. (Tried and dropped, no gain measured: prefetching the guessed next node's
// neighbors' rows, prefetching every other line of a row, prefetching every fresh neighbor's
// adjacency row before scoring, a branch-free visited test, blocks of 32 or 128 entries, scores and
// ids in separate arrays, an AVX2 in-block shift instead of memmove.)

// A search's candidate pool: the best `capacity` (score, id) pairs scored so far, best first
// (equal scores in the order they came), each expanded or not. Held in blocks of kBlock
// entries, kept in order by small per-slot arrays (block, entry count, first score, a bit per
// unexpanded entry), so that an insertion moves at most one block's entries (a flat sorted
// array moved 80-430 of them per insertion at lists of 200-2000) and finds its place by
// counting (CountNotBelow) over the blocks' first scores and then one block's scores, and the
// best unexpanded entry is the lowest bit of the first nonzero mask. A full block splits in
// two halves; every block but the last is at least half full (entries leave only from the
// end), so capacity / (kBlock / 2) + 2 blocks suffice. The order, hence every search's
// expansions and result, is the flat array's (std::upper_bound's place, the last entry
// dropped when full) entry for entry.
class CandidatePool {
 public:
  static constexpr int kBlock = 64;  // a block's unexpanded entries are one 64-bit mask

  // Empties the pool, to hold at most `capacity` (>= 1) entries.
  void Reset(size_t capacity) {
    capacity_ = capacity;
    size_ = 0;
    slots_ = 0;
    first_open_ = 0;
    const size_t max_blocks = capacity / (kBlock / 2) + 2;
    const size_t padded = (max_blocks + 8) & ~size_t{7};
    if (blocks_.size() < max_blocks) blocks_.resize(max_blocks);
    if (order_.size() < padded) {
      order_.resize(padded);
      count_.resize(padded);
      firsts_.resize(padded);
      open_.resize(padded);
    }
    free_.resize(max_blocks);
    for (size_t b = 0; b < max_blocks; ++b) free_[b] = static_cast<int>(max_blocks - 1 - b);
  }

  size_t size() const { return size_; }

  // Inserts (score, id), unexpanded, unless the pool is full and it is no better than the last
  // entry (then returns false); a full pool drops its last entry.
  bool Insert(float score, int32_t id) {
    if (Rejects(score)) return false;
    InsertAccepted(score, id);
    return true;
  }

  // Whether Insert would drop `score`: the pool is full and its last entry is no worse.
  bool Rejects(float score) const { return size_ == capacity_ && score <= last_score_; }

  // Insert for a score that Rejects does not drop.
  void InsertAccepted(float score, int32_t id) {
    if (size_ == capacity_) PopLast();
    if (slots_ == 0) {
      order_[0] = free_.back();
      free_.pop_back();
      count_[0] = 0;
      open_[0] = 0;
      slots_ = 1;
    }
    // The slot: the last whose first entry goes before `score` (the first when none does).
    int slot = 0;
    int offset = 0;
    const float* firsts = firsts_.data();
    if (const int before = CountNotBelow(slots_, score, [&](int i) { return firsts[i]; });
        before > 0) {
      slot = before - 1;
      const Entry* entry = blocks_[order_[slot]].entry;
      offset = CountNotBelow(count_[slot], score, [&](int i) { return entry[i].score; });
    }
    if (count_[slot] == kBlock) {
      Split(slot);
      if (offset > kBlock / 2) {
        ++slot;
        offset -= kBlock / 2;
      }
    }
    Block& block = blocks_[order_[slot]];
    const int moved = count_[slot] - offset;
    std::memmove(block.entry + offset + 1, block.entry + offset, moved * sizeof(Entry));
    block.entry[offset] = {score, id};
    ++count_[slot];
    if (offset == 0) firsts_[slot] = score;
    // Bits from `offset` up move up one (a block below kBlock entries has its top bit clear).
    const uint64_t below = (uint64_t{1} << offset) - 1;
    open_[slot] = (open_[slot] & below) | ((open_[slot] & ~below) << 1) | (below + 1);
    ++size_;
    first_open_ = std::min(first_open_, slot);
    if (size_ == capacity_) last_score_ = LastScore();
  }

  // Marks the best unexpanded entry expanded and sets *id to it; false when none is left.
  bool ExpandBest(int32_t* id) {
    while (first_open_ < slots_ && open_[first_open_] == 0) ++first_open_;
    if (first_open_ == slots_) return false;
    const int offset = std::countr_zero(open_[first_open_]);
    open_[first_open_] &= open_[first_open_] - 1;
    *id = blocks_[order_[first_open_]].entry[offset].id;
    return true;
  }

  // The best unexpanded entry, or -1 when none is left.
  int32_t BestUnexpanded() const {
    for (int slot = first_open_; slot < slots_; ++slot) {
      if (open_[slot] != 0) return blocks_[order_[slot]].entry[std::countr_zero(open_[slot])].id;
    }
    return -1;
  }

  // Calls f(score, id) for every entry, best first.
  template <typename F>
  void ForEach(const F& f) const {
    for (int slot = 0; slot < slots_; ++slot) {
      const Block& block = blocks_[order_[slot]];
      for (int i = 0; i < count_[slot]; ++i) f(block.entry[i].score, block.entry[i].id);
    }
  }

 private:
  struct Entry {
    float score;
    int32_t id;
  };
  struct alignas(64) Block {
    Entry entry[kBlock];
  };

  // How many of the first n scores (score(i), i < n) an entry of score x goes after: those with
  // !(x > score(i)), which in a run sorted best first are the entries before x's place, equal
  // scores included (std::upper_bound's place). Independent compares that vectorize, not a
  // binary search's chain of dependent loads; n is rounded up to a multiple of 8 and the rest
  // masked (every array read is at least that long).
  template <typename Score>
  static int CountNotBelow(int n, float x, const Score& score) {
    const int padded = (n + 7) & ~7;
    int count = 0;
    for (int i = 0; i < padded; ++i) count += (i < n) & !(x > score(i));
    return count;
  }

  float LastScore() const {
    const int slot = slots_ - 1;
    return blocks_[order_[slot]].entry[count_[slot] - 1].score;
  }

  void PopLast() {
    const int slot = slots_ - 1;
    --size_;
    open_[slot] &= ~(uint64_t{1} << --count_[slot]);
    if (count_[slot] == 0) {
      free_.push_back(order_[slot]);
      slots_ = slot;
      first_open_ = std::min(first_open_, slots_);
    }
  }

  // Moves the upper half of the full block in `slot` to a new block in the slot after it.
  void Split(int slot) {
    constexpr int kHalf = kBlock / 2;
    const int fresh = free_.back();
    free_.pop_back();
    Block& from = blocks_[order_[slot]];
    Block& to = blocks_[fresh];
    std::memcpy(to.entry, from.entry + kHalf, kHalf * sizeof(Entry));
    const int after = slots_ - slot - 1;
    std::memmove(&order_[slot + 2], &order_[slot + 1], after * sizeof(int));
    std::memmove(&count_[slot + 2], &count_[slot + 1], after * sizeof(int));
    std::memmove(&firsts_[slot + 2], &firsts_[slot + 1], after * sizeof(float));
    std::memmove(&open_[slot + 2], &open_[slot + 1], after * sizeof(uint64_t));
    order_[slot + 1] = fresh;
    count_[slot + 1] = kHalf;
    firsts_[slot + 1] = to.entry[0].score;
    open_[slot + 1] = open_[slot] >> kHalf;
    count_[slot] = kHalf;
    open_[slot] &= (uint64_t{1} << kHalf) - 1;
    ++slots_;
  }

  size_t capacity_ = 0;
  size_t size_ = 0;
  float last_score_ = 0.0f;  // the last entry's score once the pool is full
  int slots_ = 0;       // blocks in order
  int first_open_ = 0;  // no slot before it has an unexpanded entry
  std::vector<Block> blocks_;
  std::vector<int> order_;      // per slot: its block
  std::vector<int> count_;      // per slot: its block's entries
  std::vector<float> firsts_;   // per slot: its block's first score
  std::vector<uint64_t> open_;  // per slot: bit i set when entry i is unexpanded
  std::vector<int> free_;       // blocks in no slot
};

// Per-thread search state, reused across searches (and indexes) so that a search allocates
// nothing once warm: a visited bit per key (4 KiB at 32K keys, so it stays in L1; cleared per
// search, linked keys / 8 bytes, which is small next to the keys a search scores), the pool,
// and the expanded node's unvisited neighbors with their scores.
struct SearchScratch {
  std::vector<uint64_t> visited;
  CandidatePool pool;
  std::vector<int32_t> fresh;
  std::vector<float> fresh_scores;

  // fresh_rows: the most neighbors one round of a search can score (width x max_degree).
  void Begin(int64_t nodes, size_t capacity, int fresh_rows) {
    const size_t words = static_cast<size_t>((nodes + 63) / 64);
    if (visited.size() < words) visited.resize(words);
    std::fill_n(visited.begin(), words, 0);
    pool.Reset(capacity);
    if (fresh.size() < static_cast<size_t>(fresh_rows)) {
      fresh.resize(fresh_rows);
      fresh_scores.resize(fresh_rows);
    }
  }
  bool Visit(int32_t id) {
    uint64_t& word = visited[static_cast<uint32_t>(id) >> 6];
    const uint64_t bit = uint64_t{1} << (id & 63);
    if (word & bit) return false;
    word |= bit;
    return true;
  }
};

SearchScratch& ThreadScratch() {
  thread_local SearchScratch scratch;
  return scratch;
}

// mean += the keys [begin, end) / (end - begin), widened to f32.
void AddToMean(const VectorSet& keys, int64_t begin, int64_t end, std::vector<float>* mean) {
  std::vector<float> key(keys.dim);
  const float weight = 1.0f / static_cast<float>(end - begin);
  for (int64_t t = begin; t < end; ++t) {
    cpu::LoadRow(keys.row_data(t), keys.element, keys.dim, key.data());
    for (int j = 0; j < keys.dim; ++j) (*mean)[j] += key[j] * weight;
  }
}

void PrefetchVector(const void* v, int bytes) {
  const char* p = static_cast<const char*>(v);
  for (int offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset);
}

// Dissimilarity of two keys for the occlusion rule: squared L2. (The negated inner product,
// which RoarGraph uses for inner-product data, lets one long key occlude everything; attention
// keys carry large common offsets and norms, and L2 gave more recall per key scored on tinylm.)
float KeyDistance(const VectorSet& keys, int32_t a, int32_t b) {
  return cpu::SquaredDistance(keys.row_data(a), keys.row_data(b), keys.element, keys.dim);
}

// A distance not known yet (Targets::distances, row_distances_).
constexpr float kUnknownDistance = std::numeric_limits<float>::quiet_NaN();

// MergeNode sorts (id, distance) and (distance, id) pairs packed in 64 bits: the bits of a
// non-negative float order as the float does, and a NaN (unknown) after every number.
uint64_t PackIdFirst(int32_t id, float distance) {
  return uint64_t{static_cast<uint32_t>(id)} << 32 | std::bit_cast<uint32_t>(distance);
}
uint64_t PackDistanceFirst(float distance, int32_t id) {
  return uint64_t{std::bit_cast<uint32_t>(distance)} << 32 | static_cast<uint32_t>(id);
}
int32_t HighId(uint64_t packed) { return static_cast<int32_t>(packed >> 32); }
int32_t LowId(uint64_t packed) { return static_cast<int32_t>(packed & 0xffffffffu); }
float HighDistance(uint64_t packed) {
  return std::bit_cast<float>(static_cast<uint32_t>(packed >> 32));
}
float LowDistance(uint64_t packed) {
  return std::bit_cast<float>(static_cast<uint32_t>(packed & 0xffffffffu));
}

// MergeNode's per-thread scratch, reused so that merging allocates nothing once warm.
struct MergeScratch {
  std::vector<uint64_t> seen;         // a bit per key: a candidate of the node being merged
  std::vector<uint64_t> candidates;   // PackIdFirst
  std::vector<uint64_t> by_distance;  // PackDistanceFirst
  std::vector<uint8_t> chosen;        // per by_distance entry: already in the pruned row
  std::vector<uint64_t> pruned;       // PackIdFirst
  std::vector<int32_t> must_keep;
  std::vector<int32_t> unknown;       // positions in `candidates` of unknown distances
  std::vector<float> node_key;        // [dim]: the node's key, widened to f32
  std::vector<float> kept_keys;       // [max_degree, dim]: the pruned row's keys, widened to f32
};

// How many candidates ahead MergeNode's pruning requests their keys (2 to 64 measured the
// same on the development machine).
constexpr size_t kPruneAhead = 4;

// A build's own copy of its keys, packed ([count, dim] in their element type) in mapped memory
// (huge pages where the kernel offers them), freed when the build ends. Left uninitialized:
// the copy writes every byte.
class PackedKeys {
 public:
  explicit PackedKeys(const VectorSet& keys)
      : bytes_(static_cast<size_t>(keys.count) * keys.dim * KvElementBytes(keys.element)),
        data_(bytes_ > 0 ? cpu::MappedAllocator<char>().allocate(bytes_) : nullptr),
        keys_{data_, keys.count, keys.dim, keys.dim, keys.element} {
    const size_t row_bytes = static_cast<size_t>(keys.dim) * KvElementBytes(keys.element);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < keys.count; ++i) {
      std::memcpy(data_ + i * row_bytes, keys.row_data(i), row_bytes);
    }
  }
  ~PackedKeys() {
    if (data_ != nullptr) cpu::MappedAllocator<char>().deallocate(data_, bytes_);
  }
  PackedKeys(const PackedKeys&) = delete;
  PackedKeys& operator=(const PackedKeys&) = delete;

  const VectorSet& keys() const { return keys_; }

 private:
  size_t bytes_;
  char* data_;
  VectorSet keys_;
};

}  // namespace

// Edges grouped by source, as compressed rows: node i's targets are ids[offsets[i],
// offsets[i + 1]), in the order they were emitted, with their keep marks when any edge was
// kept. Mapped memory: a 128K-key build groups millions of edges.
struct GraphIndex::GroupedTargets {
  cpu::MappedVector<int64_t> offsets;  // [nodes + 1]
  cpu::MappedVector<int32_t> ids;
  std::vector<uint8_t> kept;             // aligned with ids, or empty: none kept
  cpu::MappedVector<float> distances;    // aligned with ids, or empty: none known

  // Groups the edges `for_each` emits over `nodes` sources: for_each(emit) calls
  // emit(from, to, keep, distance) for every edge, the same edges in the same order each time;
  // it is called twice, once to count and once to place (a stable counting sort without an
  // edge list). `with_kept` / `with_distances`: hold the keep marks / the distances (else
  // every edge's keep must be false and its distance unknown).
  template <typename ForEach>
  void Group(int64_t nodes, bool with_kept, bool with_distances, const ForEach& for_each) {
    offsets.assign(static_cast<size_t>(nodes) + 1, 0);
    for_each([&](int32_t from, int32_t, bool, float) { ++offsets[from + 1]; });
    for (int64_t i = 0; i < nodes; ++i) offsets[i + 1] += offsets[i];
    ids.resize(static_cast<size_t>(offsets[nodes]));
    kept.assign(with_kept ? ids.size() : 0, 0);
    distances.resize(with_distances ? ids.size() : 0);
    // offsets[from] is the next free slot of `from` while placing, which leaves it at the
    // start of from + 1; shifting back restores the starts.
    for_each([&](int32_t from, int32_t to, bool keep, float distance) {
      const int64_t at = offsets[from]++;
      ids[at] = to;
      if (with_kept) kept[at] = keep;
      if (with_distances) distances[at] = distance;
    });
    for (int64_t i = nodes; i > 0; --i) offsets[i] = offsets[i - 1];
    offsets[0] = 0;
  }
};

GraphBuildStats& GraphBuildStats::operator+=(const GraphBuildStats& other) {
  build_queries += other.build_queries;
  covered_keys += other.covered_keys;
  repaired_keys += other.repaired_keys;
  unreachable_keys += other.unreachable_keys;
  average_degree += other.average_degree;
  topk_seconds += other.topk_seconds;
  graph_seconds += other.graph_seconds;
  key_copy_seconds += other.key_copy_seconds;
  projection_seconds += other.projection_seconds;
  reverse_seconds += other.reverse_seconds;
  entry_seconds += other.entry_seconds;
  outlier_seconds += other.outlier_seconds;
  repair_seconds += other.repair_seconds;
  pruning_distances += other.pruning_distances;
  return *this;
}

GraphIndex::GraphIndex(const GraphIndexParams& params, BatchTopKFunction batch_topk)
    : params_(params.WithDefaults()), batch_topk_(std::move(batch_topk)) {}

int64_t GraphIndex::MemoryBytes() const {
  return cpu::MappedCapacityBytes(adjacency_) +
         static_cast<int64_t>(degree_.capacity() * sizeof(uint16_t));
}

int64_t GraphIndex::GraphBytes(const GraphIndexParams& params, int64_t keys) {
  const GraphIndexParams p = params.WithDefaults();
  return static_cast<int64_t>(
             cpu::MappedBytes(static_cast<size_t>(keys) * p.max_degree * sizeof(int32_t))) +
         keys * int64_t{sizeof(uint16_t)};
}

int64_t GraphIndex::SampledQueryBytes(const GraphIndexParams& params, int64_t keys,
                                      int64_t queries, int dim) {
  const int64_t sampled = std::min<int64_t>(params.WithDefaults().build_queries,
                                            queries > 0 ? queries : keys);
  if (keys == 0) return 0;
  return static_cast<int64_t>(cpu::MappedBytes(static_cast<size_t>(sampled) * dim * 4)) +
         sampled * 8;
}

int64_t GraphIndex::TopKListBytes(const GraphIndexParams& params, int64_t keys,
                                  int64_t queries) {
  const GraphIndexParams p = params.WithDefaults();
  const int64_t sampled = std::min<int64_t>(p.build_queries, queries > 0 ? queries : keys);
  return keys == 0 ? 0 : sampled * std::min<int64_t>(p.build_topk, keys) * 4;
}

int64_t GraphIndex::GraphScratchBytesBound(const GraphIndexParams& params, int64_t keys,
                                           int64_t queries, int dim, int threads, int heads) {
  const GraphIndexParams p = params.WithDefaults();
  if (keys == 0) return 0;
  const int64_t sampled =
      std::min<int64_t>(p.build_queries, queries > 0 ? queries : keys) * std::max(1, heads);
  const int64_t k = std::min<int64_t>(p.build_topk, keys);
  const int64_t t = std::max(1, threads);
  // The packed copy of the keys (PackedKeys), the pivots' and covered keys' flags, each list's
  // length and pivot.
  int64_t bytes = static_cast<int64_t>(cpu::MappedBytes(static_cast<size_t>(keys) * dim * 4)) +
                  keys * 2 + sampled * 8;
  // The distances found while pruning (row_distances_).
  bytes += static_cast<int64_t>(cpu::MappedBytes(static_cast<size_t>(keys) * p.max_degree * 4));
  // The grouped edges, one buffer for every pass: offsets, and targets with their distances
  // and keep marks, for the most edges a pass groups: the projection's (every list member's
  // pivot edge and fellow links, and the token chain) or the reverse edges (one per slot).
  const int64_t edges =
      std::max(sampled * k * (1 + kListLinks) + 2 * keys, keys * int64_t{p.max_degree});
  bytes += static_cast<int64_t>(cpu::MappedBytes(static_cast<size_t>(keys + 1) * 8) +
                                cpu::MappedBytes(static_cast<size_t>(edges) * 4) * 2) +
           edges;
  // MergeNode's scratch per thread: a bit per key, a few candidate lists, and the node's and
  // its chosen neighbors' keys in f32.
  bytes += t * (keys / 8 + 64 * int64_t{p.max_degree} * 8 + (p.max_degree + 2) * int64_t{dim} * 4);
  // The outliers' and repairs' own searches and edges (at most 4096 nodes at a time), the
  // outliers' ranking and the connectivity pass's marks and frontier.
  bytes += std::min<int64_t>(keys, 4096) * 2 * kKeptLinksPerKey * int64_t{sizeof(Edge)} +
           keys * 17;
  return bytes;
}

void GraphIndex::ReserveCapacity(int64_t keys) {
  adjacency_.reserve(static_cast<size_t>(keys) * params_.max_degree);
  degree_.reserve(static_cast<size_t>(keys));
}

void GraphIndex::Reserve(int64_t nodes) {
  adjacency_.resize(static_cast<size_t>(nodes) * params_.max_degree);
  degree_.resize(nodes, 0);
}

absl::Status GraphIndex::CheckBuildArgs(const VectorSet& keys) const {
  if (params_.max_degree < 1 || params_.max_degree > kMaxGraphDegree) {
    return absl::InvalidArgumentError(absl::StrCat(
        "graph index max_degree must be in [1, ", kMaxGraphDegree, "], got ", params_.max_degree));
  }
  if (params_.build_topk < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("graph index build_topk must be >= 2, got ", params_.build_topk));
  }
  if (keys.count > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("graph index over ", keys.count, " keys: ids must fit in int32"));
  }
  return absl::OkStatus();
}

int64_t GraphIndex::SampledQueryCount(const GraphIndexParams& params, int64_t key_count,
                                      const BuildQueries& build_queries) {
  const int64_t available =
      build_queries.queries.count > 0 ? build_queries.queries.count : key_count;
  return std::min<int64_t>(params.WithDefaults().build_queries, available);
}

std::vector<float> GraphIndex::SampleQueries(const GraphIndexParams& params,
                                             const VectorSet& keys,
                                             const BuildQueries& build_queries, float* queries,
                                             std::vector<int64_t>* visible) {
  // Without queries the keys stand in for them (the graph is then a key-key graph).
  const VectorSet& given = build_queries.queries;
  const bool have_queries = given.count > 0;
  const VectorSet& source = have_queries ? given : keys;
  const int64_t sampled = SampledQueryCount(params, keys.count, build_queries);
  std::vector<float> sum(keys.dim, 0.0f);
  for (int64_t i = 0; i < sampled; ++i) {
    const int64_t position = i * source.count / sampled;
    float* copy = queries + i * keys.dim;
    cpu::LoadRow(source.row_data(position), source.element, keys.dim, copy);
    for (int j = 0; j < keys.dim; ++j) sum[j] += copy[j];
    if (have_queries && build_queries.causal) {
      visible->push_back(position - build_queries.first_key_position + 1);
    }
  }
  return sum;
}

absl::Status GraphIndex::Build(const VectorSet& keys, const BuildQueries& build_queries) {
  const Clock::time_point start = Clock::now();
  if (absl::Status s = CheckBuildArgs(keys); !s.ok()) return s;
  const VectorSet& given = build_queries.queries;
  if (given.count > 0 && given.dim != keys.dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("build query dim ", given.dim, " differs from key dim ", keys.dim));
  }
  const int64_t sampled = SampledQueryCount(params_, keys.count, build_queries);
  cpu::MappedVector<float> queries(static_cast<size_t>(sampled) * keys.dim);
  std::vector<int64_t> visible;
  const std::vector<float> query_sum =
      SampleQueries(params_, keys, build_queries, queries.data(), &visible);
  TopKLists lists;
  if (keys.count > 0) {
    if (absl::Status s = batch_topk_(VectorSet{queries.data(), sampled, keys.dim, keys.dim}, keys,
                                     params_.build_topk, &lists, visible, BuildStop());
        !s.ok()) {
      return s;
    }
  }
  queries = cpu::MappedVector<float>();
  return BuildFromLists(keys, query_sum, lists, SecondsSince(start));
}

absl::Status GraphIndex::BuildFromLists(const VectorSet& stored_keys,
                                        std::span<const float> query_sum,
                                        const TopKLists& lists, double topk_seconds,
                                        const BuildStop& stop) {
  if (absl::Status s = CheckBuildArgs(stored_keys); !s.ok()) return s;
  if (stored_keys.count > 0) {
    const int expected_k =
        static_cast<int>(std::min<int64_t>(params_.build_topk, stored_keys.count));
    if (lists.k != expected_k ||
        static_cast<int64_t>(lists.ids.size()) != lists.queries * lists.k) {
      return absl::InvalidArgumentError(absl::StrCat(
          "graph build from ", lists.queries, " top-k lists of ", lists.k, " ids (",
          lists.ids.size(), " in all): expected lists of ", expected_k));
    }
    for (const int32_t id : lists.ids) {
      if (id < -1 || id >= stored_keys.count) {
        return absl::InvalidArgumentError(absl::StrCat(
            "graph build from top-k lists holding key ", id, " of ", stored_keys.count));
      }
    }
    if (static_cast<int64_t>(query_sum.size()) != stored_keys.dim) {
      return absl::InvalidArgumentError(absl::StrCat("graph build from a query sum of ",
                                                     query_sum.size(), " dims over keys of ",
                                                     stored_keys.dim));
    }
  }
  build_stats_ = GraphBuildStats();
  adjacency_.clear();
  key_mean_.clear();
  degree_.clear();
  size_ = linked_ = stored_keys.count;
  entry_ = -1;
  projection_credit_ = projection_cursor_ = 0;
  last_link_ = GraphLinkStats();
  // Asked before each step of the build (the longest, at 128K keys on one thread, takes a few
  // tenths of a second): a stopped build leaves the index empty, holding nothing.
  auto stopped = [&] {
    if (!stop.requested()) return false;
    adjacency_ = cpu::MappedVector<int32_t>();
    degree_ = std::vector<uint16_t>();
    key_mean_ = std::vector<float>();
    row_distances_ = cpu::MappedVector<float>();
    size_ = linked_ = 0;
    entry_ = -1;
    return true;
  };
  if (stored_keys.count > 0 && stopped()) return BuildStop::Status("the graph build");
  Reserve(stored_keys.count);
  if (stored_keys.count == 0) return absl::OkStatus();
  const int64_t sampled = lists.queries;
  build_stats_.build_queries = sampled;
  build_stats_.topk_seconds = topk_seconds;

  const Clock::time_point graph_start = Clock::now();
  // The build reads keys at random (pruning, the outliers' searches) and all of them in turn
  // (the entry point, the mean): from a packed copy of its own. The caller's rows are a KV
  // head's, a token's KV heads apart (2 KiB at 8 heads of 128 bf16 values), so each random read
  // is a page of its own (a TLB miss where the KV is not on huge pages), rows a multiple of
  // 4 KiB apart share their L1 sets, and a pass over all the keys reads every other head's too.
  // Only where the keys are read from differs: the graph is the same
  // (bench/results/index_bench.md, "The graph build's key reads").
  const PackedKeys packed(stored_keys);
  const VectorSet& keys = packed.keys();
  build_stats_.key_copy_seconds = SecondsSince(graph_start);
  std::vector<uint8_t> is_pivot(keys.count, 0);
  // Each list's pivot: its best key not yet a pivot (in list order, so the choice depends on
  // the lists before). Lists of early causal queries are shorter (padded with -1).
  std::vector<int32_t> lengths(sampled), pivot_ranks(sampled);
  {
    std::vector<uint8_t> covered(keys.count, 0);
    for (int64_t i = 0; i < sampled; ++i) {
      const int32_t* list = lists.list(i);
      int length = 0;
      while (length < lists.k && list[length] >= 0) ++length;
      lengths[i] = length;
      if (length < 2) continue;
      int pivot_rank = 0;
      while (pivot_rank < length && is_pivot[list[pivot_rank]]) ++pivot_rank;
      if (pivot_rank == length) pivot_rank = 0;
      pivot_ranks[i] = pivot_rank;
      is_pivot[list[pivot_rank]] = 1;
      for (int j = 0; j < length; ++j) covered[list[j]] = 1;
    }
    for (uint8_t c : covered) build_stats_.covered_keys += c;
  }
  // Distances found while pruning, reused by the reverse edges (build only).
  row_distances_.assign(static_cast<size_t>(keys.count) * params_.max_degree, kUnknownDistance);
  // One grouping buffer for the passes below (mapped once).
  GroupedTargets grouped;
  // The projected edges, grouped by source in one pass that counts and one that places (a
  // stable counting sort without the edge list): for each list, the pivot's edges to the
  // other members and each member's links to kListLinks random fellow members (without them
  // a member's only way on is back to its pivots, and with few sampled queries most keys
  // would have no projected edges at all); then the token chain, both ways.
  auto for_each_projected = [&](auto&& emit) {
    for (int64_t i = 0; i < sampled; ++i) {
      const int32_t* list = lists.list(i);
      const int length = lengths[i];
      if (length < 2) continue;
      const int pivot_rank = pivot_ranks[i];
      const int32_t pivot = list[pivot_rank];
      for (int j = 0; j < length; ++j) {
        if (j != pivot_rank) emit(pivot, list[j], false, kUnknownDistance);
        for (int f = 0; f < kListLinks; ++f) {
          const int other = static_cast<int>(Mix(static_cast<uint64_t>(i) << 32 | j << 8 | f) %
                                             static_cast<uint64_t>(length));
          if (other != j) emit(list[j], list[other], false, kUnknownDistance);
        }
      }
    }
    for (int32_t t = 0; t + 1 < keys.count; ++t) {
      emit(t, t + 1, false, kUnknownDistance);
      emit(t + 1, t, false, kUnknownDistance);
    }
  };
  grouped.Group(keys.count, /*with_kept=*/false, /*with_distances=*/false, for_each_projected);
  if (stopped()) return BuildStop::Status("the graph build");
  build_stats_.pruning_distances += MergeGrouped(keys, grouped);
  if (stopped()) return BuildStop::Status("the graph build");
  Clock::time_point step_start = Clock::now();
  build_stats_.projection_seconds =
      std::chrono::duration<double>(step_start - graph_start).count() -
      build_stats_.key_copy_seconds;
  // Ends a step of the build: its seconds since the previous one's end.
  auto step_done = [&step_start](double* seconds) {
    const Clock::time_point now = Clock::now();
    *seconds = std::chrono::duration<double>(now - step_start).count();
    step_start = now;
  };
  build_stats_.pruning_distances += AddReverseEdges(keys, &grouped);
  step_done(&build_stats_.reverse_seconds);
  ChooseEntry(keys, query_sum);
  key_mean_.assign(keys.dim, 0.0f);
  AddToMean(keys, 0, keys.count, &key_mean_);
  step_done(&build_stats_.entry_seconds);
  if (stopped()) return BuildStop::Status("the graph build");
  build_stats_.pruning_distances += LinkOutliers(keys, &grouped);
  step_done(&build_stats_.outlier_seconds);
  if (stopped()) return BuildStop::Status("the graph build");
  build_stats_.repaired_keys = RepairConnectivity(
      keys, &grouped, &build_stats_.unreachable_keys, &build_stats_.pruning_distances);
  step_done(&build_stats_.repair_seconds);
  row_distances_ = cpu::MappedVector<float>();
  int64_t degree_sum = 0;
  for (int64_t i = 0; i < linked_; ++i) degree_sum += degree_[i];
  build_stats_.average_degree = static_cast<double>(degree_sum) / linked_;
  build_stats_.graph_seconds = SecondsSince(graph_start);
  return absl::OkStatus();
}

void GraphIndex::ChooseEntry(const VectorSet& keys, const VectorSet& queries) {
  std::vector<float> sum(keys.dim, 0.0f);
  for (int64_t i = 0; i < queries.count; ++i) {
    const float* q = queries.row(i);
    for (int j = 0; j < keys.dim; ++j) sum[j] += q[j];
  }
  ChooseEntry(keys, sum);
}

void GraphIndex::ChooseEntry(const VectorSet& keys, std::span<const float> query_sum) {
  std::vector<int32_t> best;
  cpu::ExactTopK(query_sum.data(), keys.Slice(0, linked_).AsKeyView(), 0, 1.0f, 1, &best);
  entry_ = best.empty() ? -1 : best[0];
}

int64_t GraphIndex::MergeEdges(const VectorSet& keys, std::vector<Edge>* edges,
                               GroupedTargets* grouped) {
  const int64_t m = static_cast<int64_t>(edges->size());
  if (m == 0) return 0;
  if (m * 16 < linked_) {
    // A few edges (an incremental link): sort them by source instead of counting over every
    // node, whose O(linked keys) arrays would dominate linking one key into a large graph.
    // Stable, so that a node's targets keep their order, as the counting sort keeps it. On one
    // thread unless there are many sources: a parallel region costs more than a few merges
    // (and the selector already links its heads in parallel).
    std::stable_sort(edges->begin(), edges->end(),
                     [](const Edge& x, const Edge& y) { return x.from < y.from; });
    std::vector<int64_t> starts;
    for (int64_t e = 0; e < m; ++e) {
      if (e == 0 || (*edges)[e].from != (*edges)[e - 1].from) starts.push_back(e);
    }
    starts.push_back(m);
    std::vector<int32_t> targets(m);
    std::vector<uint8_t> kept(m);
    for (int64_t e = 0; e < m; ++e) {
      targets[e] = (*edges)[e].to;
      kept[e] = (*edges)[e].keep;
    }
    const int64_t sources = static_cast<int64_t>(starts.size()) - 1;
    int64_t distances = 0;
#pragma omp parallel for schedule(dynamic, 16) reduction(+ : distances) if (sources > 1024)
    for (int64_t i = 0; i < sources; ++i) {
      const int64_t begin = starts[i];
      const int64_t count = starts[i + 1] - begin;
      distances += MergeNode(keys, (*edges)[begin].from,
                             Targets{{targets.data() + begin, static_cast<size_t>(count)},
                                     {kept.data() + begin, static_cast<size_t>(count)},
                                     {}});
    }
    edges->clear();
    return distances;
  }
  GroupedTargets local;
  if (grouped == nullptr) grouped = &local;
  grouped->Group(linked_, /*with_kept=*/true, /*with_distances=*/false, [&](auto&& emit) {
    for (const Edge& e : *edges) emit(e.from, e.to, e.keep, kUnknownDistance);
  });
  edges->clear();
  return MergeGrouped(keys, *grouped);
}

int64_t GraphIndex::MergeNode(const VectorSet& keys, int64_t node, const Targets& targets) {
  thread_local MergeScratch scratch;
  const int degree = params_.max_degree;
  int32_t* row = adjacency_.data() + node * degree;
  float* row_distance = row_distances_.empty() ? nullptr : row_distances_.data() + node * degree;
  // The candidates: the row, then the targets not in it, each once, not the node itself
  // (duplicates found with a bit per key, cleared again below).
  std::vector<uint64_t>& seen = scratch.seen;
  if (seen.size() * 64 < static_cast<size_t>(linked_)) seen.resize((linked_ + 63) / 64, 0);
  auto first_sight = [&seen](int32_t id) {
    uint64_t& word = seen[static_cast<uint32_t>(id) >> 6];
    const uint64_t bit = uint64_t{1} << (id & 63);
    const bool first = !(word & bit);
    word |= bit;
    return first;
  };
  std::vector<uint64_t>& candidates = scratch.candidates;
  candidates.clear();
  first_sight(static_cast<int32_t>(node));
  for (int j = 0; j < degree_[node]; ++j) {
    if (first_sight(row[j])) {
      candidates.push_back(
          PackIdFirst(row[j], row_distance != nullptr ? row_distance[j] : kUnknownDistance));
    }
  }
  const size_t from_row = candidates.size();
  for (size_t e = 0; e < targets.ids.size(); ++e) {
    const int32_t id = targets.ids[e];
    if (first_sight(id)) {
      candidates.push_back(
          PackIdFirst(id, targets.distances.empty() ? kUnknownDistance : targets.distances[e]));
    } else if (!targets.distances.empty() && !std::isnan(targets.distances[e])) {
      // A reverse edge to a key already in the row, whose distance the row may not know.
      for (size_t i = 0; i < from_row; ++i) {
        if (HighId(candidates[i]) == id) {
          if (std::isnan(LowDistance(candidates[i]))) {
            candidates[i] = PackIdFirst(id, targets.distances[e]);
          }
          break;
        }
      }
    }
  }
  seen[static_cast<uint32_t>(node) >> 6] &= ~(uint64_t{1} << (node & 63));
  for (const uint64_t c : candidates) {
    const int32_t id = HighId(c);
    seen[static_cast<uint32_t>(id) >> 6] &= ~(uint64_t{1} << (id & 63));
  }
  if (candidates.size() <= static_cast<size_t>(degree)) {
    for (size_t j = 0; j < candidates.size(); ++j) {
      row[j] = HighId(candidates[j]);
      if (row_distance != nullptr) row_distance[j] = LowDistance(candidates[j]);
    }
    degree_[node] = static_cast<uint16_t>(candidates.size());
    return 0;
  }

  // Pruning: nearest first, dropping a candidate that is closer (KeyDistance) to an already
  // chosen neighbor than to the node, then filling the remaining slots with the nearest
  // dropped ones. The distances not known yet are computed.
  // The candidates' keys are rows scattered in memory (each likely a miss) read in an order
  // the hardware cannot guess: each is requested kPruneAhead candidates ahead. The node's key
  // and the chosen ones', read again for every later candidate, are widened once into an f32
  // scratch (packed, so they do not evict each other from L1 as rows a multiple of 4 KiB apart
  // would). Widening is exact and cpu::SquaredDistance of an f32 vector and a stored row is
  // the same arithmetic, so every distance is KeyDistance's, bit for bit.
  const int dim = keys.dim;
  auto key_row = [&keys](int32_t id) { return keys.row_data(id); };
  const int row_bytes = dim * KvElementBytes(keys.element);
  int64_t evaluations = 0;
  std::vector<float>& node_key = scratch.node_key;
  node_key.resize(dim);
  cpu::LoadRow(key_row(static_cast<int32_t>(node)), keys.element, dim, node_key.data());
  std::vector<int32_t>& unknown = scratch.unknown;
  unknown.clear();
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (std::isnan(LowDistance(candidates[i]))) unknown.push_back(static_cast<int32_t>(i));
  }
  for (size_t u = 0; u < std::min<size_t>(unknown.size(), kPruneAhead); ++u) {
    PrefetchVector(key_row(HighId(candidates[unknown[u]])), row_bytes);
  }
  for (size_t u = 0; u < unknown.size(); ++u) {
    if (u + kPruneAhead < unknown.size()) {
      PrefetchVector(key_row(HighId(candidates[unknown[u + kPruneAhead]])), row_bytes);
    }
    uint64_t& candidate = candidates[unknown[u]];
    const int32_t id = HighId(candidate);
    candidate = PackIdFirst(
        id, cpu::SquaredDistance(node_key.data(), key_row(id), keys.element, dim));
  }
  evaluations += static_cast<int64_t>(unknown.size());
  std::vector<uint64_t>& by_distance = scratch.by_distance;
  by_distance.clear();
  std::vector<uint8_t>& chosen = scratch.chosen;
  chosen.assign(candidates.size(), 0);
  for (const uint64_t c : candidates) {
    by_distance.push_back(PackDistanceFirst(LowDistance(c), HighId(c)));
  }
  std::sort(by_distance.begin(), by_distance.end());
  std::vector<uint64_t>& pruned = scratch.pruned;
  pruned.clear();
  std::vector<float>& kept_keys = scratch.kept_keys;
  kept_keys.resize(static_cast<size_t>(degree) * dim);
  for (size_t i = 0; i < std::min<size_t>(by_distance.size(), kPruneAhead); ++i) {
    PrefetchVector(key_row(LowId(by_distance[i])), row_bytes);
  }
  for (size_t i = 0; i < by_distance.size() && pruned.size() < static_cast<size_t>(degree); ++i) {
    if (i + kPruneAhead < by_distance.size()) {
      PrefetchVector(key_row(LowId(by_distance[i + kPruneAhead])), row_bytes);
    }
    const float distance = HighDistance(by_distance[i]);
    const int32_t c = LowId(by_distance[i]);
    const void* key = key_row(c);
    bool occluded = false;
    for (size_t j = 0; j < pruned.size(); ++j) {
      ++evaluations;
      // KeyDistance(c, chosen j): the same terms, (c - j)^2 = (j - c)^2 exactly.
      if (cpu::SquaredDistance(kept_keys.data() + j * dim, key, keys.element, dim) < distance) {
        occluded = true;
        break;
      }
    }
    if (!occluded) {
      cpu::LoadRow(key, keys.element, dim, kept_keys.data() + pruned.size() * dim);
      pruned.push_back(PackIdFirst(c, distance));
      chosen[i] = 1;
    }
  }
  for (size_t i = 0; i < by_distance.size() && pruned.size() < static_cast<size_t>(degree); ++i) {
    if (!chosen[i]) {
      pruned.push_back(PackIdFirst(LowId(by_distance[i]), HighDistance(by_distance[i])));
    }
  }
  // Kept targets displace the last (least useful) unkept choices.
  // Token neighbors are always kept: the chain keeps every key reachable.
  std::vector<int32_t>& must_keep = scratch.must_keep;
  must_keep.clear();
  for (const uint64_t c : candidates) {
    if (HighId(c) == node - 1 || HighId(c) == node + 1) must_keep.push_back(HighId(c));
  }
  for (size_t e = 0; e < targets.kept.size(); ++e) {
    if (targets.kept[e] && targets.ids[e] != node) must_keep.push_back(targets.ids[e]);
  }
  if (!must_keep.empty()) {
    std::sort(must_keep.begin(), must_keep.end());
    must_keep.erase(std::unique(must_keep.begin(), must_keep.end()), must_keep.end());
    if (must_keep.size() > static_cast<size_t>(degree)) must_keep.resize(degree);
    auto is_kept = [&](int32_t id) {
      return std::binary_search(must_keep.begin(), must_keep.end(), id);
    };
    size_t slot = pruned.size();
    for (int32_t id : must_keep) {
      if (std::any_of(pruned.begin(), pruned.end(),
                      [id](uint64_t p) { return HighId(p) == id; })) {
        continue;
      }
      while (slot > 0 && is_kept(HighId(pruned[slot - 1]))) --slot;
      if (slot == 0) break;
      // Its distance: every candidate's is known by now.
      pruned[--slot] = *std::find_if(candidates.begin(), candidates.end(),
                                     [id](uint64_t c) { return HighId(c) == id; });
    }
  }
  for (size_t j = 0; j < pruned.size(); ++j) {
    row[j] = HighId(pruned[j]);
    if (row_distance != nullptr) row_distance[j] = LowDistance(pruned[j]);
  }
  degree_[node] = static_cast<uint16_t>(pruned.size());
  return evaluations;
}

int64_t GraphIndex::MergeGrouped(const VectorSet& keys, const GroupedTargets& grouped) {
  int64_t distances = 0;
#pragma omp parallel for schedule(dynamic, 64) reduction(+ : distances)
  for (int64_t node = 0; node < linked_; ++node) {
    const int64_t begin = grouped.offsets[node];
    const size_t count = static_cast<size_t>(grouped.offsets[node + 1] - begin);
    if (count == 0) continue;
    Targets targets{{grouped.ids.data() + begin, count}, {}, {}};
    if (!grouped.kept.empty()) targets.kept = {grouped.kept.data() + begin, count};
    if (!grouped.distances.empty()) targets.distances = {grouped.distances.data() + begin, count};
    distances += MergeNode(keys, node, targets);
  }
  return distances;
}

int64_t GraphIndex::AddReverseEdges(const VectorSet& keys, GroupedTargets* grouped) {
  // A reverse edge's distance is its forward edge's when the forward row knows it.
  const bool with_distances = !row_distances_.empty();
  grouped->Group(linked_, /*with_kept=*/false, with_distances, [&](auto&& emit) {
    for (int64_t u = 0; u < linked_; ++u) {
      const std::span<const int32_t> row = neighbors(u);
      const float* distance =
          with_distances ? row_distances_.data() + u * params_.max_degree : nullptr;
      for (size_t j = 0; j < row.size(); ++j) {
        emit(row[j], static_cast<int32_t>(u), false,
             with_distances ? distance[j] : kUnknownDistance);
      }
    }
  });
  return MergeGrouped(keys, *grouped);
}

int64_t GraphIndex::LinkByOwnSearch(const VectorSet& keys, std::span<const int32_t> nodes,
                                 GroupedTargets* grouped) {
  std::vector<Edge> edges(nodes.size() * 2 * kKeptLinksPerKey, Edge{-1, -1});
#pragma omp parallel if (nodes.size() >= 16)
  {
    std::vector<std::pair<float, int32_t>> found;
    std::vector<float> centered(keys.dim);
    SearchStats ignored;
#pragma omp for schedule(dynamic, 16)
    for (size_t i = 0; i < nodes.size(); ++i) {
      const int32_t x = nodes[i];
      CenteredKey(keys, x, centered.data());
      SearchGraph(keys, centered.data(), 2 * params_.max_degree, /*width=*/1, &found, &ignored);
      size_t links = 0;
      for (size_t j = 0; j < found.size() && links < kKeptLinksPerKey; ++j) {
        if (found[j].second == x) continue;
        edges[(i * kKeptLinksPerKey + links) * 2] = {x, found[j].second};
        edges[(i * kKeptLinksPerKey + links) * 2 + 1] = {found[j].second, x, true};
        ++links;
      }
    }
  }
  edges.erase(std::remove_if(edges.begin(), edges.end(), [](const Edge& e) { return e.from < 0; }),
              edges.end());
  return MergeEdges(keys, &edges, grouped);
}

void GraphIndex::CenteredKey(const VectorSet& keys, int32_t node, float* out) const {
  cpu::LoadRow(keys.row_data(node), keys.element, keys.dim, out);
  for (int j = 0; j < keys.dim; ++j) out[j] -= key_mean_[j];
}

int64_t GraphIndex::LinkOutliers(const VectorSet& keys, GroupedTargets* grouped) {
  // A key no prefill query wanted (a needle that only a later query asks for) has projection
  // edges only by chance; to win a softmax against every other key it must stand out, far from
  // the mean key. The farthest keys get the links their own search finds, so that a query
  // along one walks up to it.
  const int64_t count =
      std::min<int64_t>(linked_, std::clamp<int64_t>(linked_ / 100, 64, 4096));
  std::vector<std::pair<float, int32_t>> by_distance(linked_);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < linked_; ++i) {
    thread_local std::vector<float> key;
    key.resize(keys.dim);
    cpu::LoadRow(keys.row_data(i), keys.element, keys.dim, key.data());
    const float* k = key.data();
    float distance = 0.0f;
    for (int j = 0; j < keys.dim; ++j) distance += (k[j] - key_mean_[j]) * (k[j] - key_mean_[j]);
    by_distance[i] = {-distance, static_cast<int32_t>(i)};
  }
  std::partial_sort(by_distance.begin(), by_distance.begin() + count, by_distance.end());
  std::vector<int32_t> nodes(count);
  for (int64_t i = 0; i < count; ++i) nodes[i] = by_distance[i].second;
  return LinkByOwnSearch(keys, nodes, grouped);
}

int64_t GraphIndex::RepairConnectivity(const VectorSet& keys, GroupedTargets* grouped,
                                       int64_t* still_unreachable, int64_t* distances) {
  // With the token chain whole both ways every key is reachable from any other: one pass over
  // the rows (the walk below reads them in random order, ~10x longer at 128K keys).
  auto chain_is_whole = [&] {
    auto links = [&](int64_t from, int64_t to) {
      const std::span<const int32_t> row = neighbors(from);
      return std::find(row.begin(), row.end(), static_cast<int32_t>(to)) != row.end();
    };
    for (int64_t t = 0; t + 1 < linked_; ++t) {
      if (!links(t, t + 1) || !links(t + 1, t)) return false;
    }
    return true;
  };
  auto unreachable_nodes = [&] {
    if (chain_is_whole()) return std::vector<int32_t>();
    std::vector<uint8_t> reached(linked_, 0);
    std::vector<int32_t> frontier = {entry_};
    reached[entry_] = 1;
    while (!frontier.empty()) {
      const int32_t u = frontier.back();
      frontier.pop_back();
      for (int32_t v : neighbors(u)) {
        if (!reached[v]) {
          reached[v] = 1;
          frontier.push_back(v);
        }
      }
    }
    std::vector<int32_t> out;
    for (int64_t i = 0; i < linked_; ++i) {
      if (!reached[i]) out.push_back(static_cast<int32_t>(i));
    }
    return out;
  };
  // The token chain keeps every key reachable, so this is a safety net: each unreachable key is
  // linked both ways to the best keys its own search reaches (the links into it are kept).
  constexpr int kRounds = 3;
  int64_t repaired = 0;
  std::vector<int32_t> unreachable = unreachable_nodes();
  for (int round = 0; round < kRounds && !unreachable.empty(); ++round) {
    repaired += static_cast<int64_t>(unreachable.size());
    *distances += LinkByOwnSearch(keys, unreachable, grouped);
    unreachable = unreachable_nodes();
  }
  *still_unreachable = static_cast<int64_t>(unreachable.size());
  return repaired;
}

void GraphIndex::SearchGraph(const VectorSet& keys, const float* q, int list_size, int width,
                             std::vector<std::pair<float, int32_t>>* list, SearchStats* stats,
                             std::vector<std::pair<float, int32_t>>* scored) const {
  list->clear();
  if (scored != nullptr) scored->clear();
  if (linked_ == 0) return;
  const size_t capacity = static_cast<size_t>(std::max(list_size, 1));
  width = std::clamp(width, 1, kMaxSearchWidth);
  SearchScratch& scratch = ThreadScratch();
  scratch.Begin(linked_, capacity, width * params_.max_degree);
  CandidatePool& pool = scratch.pool;
  int32_t* fresh = scratch.fresh.data();
  float* fresh_scores = scratch.fresh_scores.data();
  const int dim = keys.dim;
  const int32_t* adjacency = adjacency_.data();
  const uint16_t* degree = degree_.data();
  const size_t row_bytes = static_cast<size_t>(params_.max_degree) * sizeof(int32_t);
  // The adjacency row (and degree) of a node about to be expanded, fetched while the current
  // node's neighbors are scored: otherwise its first id load is a miss on every hop.
  auto prefetch_adjacency = [&](int32_t node) {
    const char* row = reinterpret_cast<const char*>(adjacency + int64_t{node} * params_.max_degree);
    for (size_t offset = 0; offset < row_bytes; offset += 64) __builtin_prefetch(row + offset);
    __builtin_prefetch(degree + node);
  };
  // Fresh rows are prefetched kBatch at a time, the next batch while one is scored (a hop
  // seldom has more than one batch; the old loop requested every line of every fresh row
  // before scoring any).
  constexpr int kBatch = 4;
  const void* rows[kBatch];
  const int row_bytes_of_key = dim * KvElementBytes(keys.element);

  scratch.Visit(entry_);
  const float entry_score = cpu::DotProduct(q, keys.row_data(entry_), keys.element, dim);
  pool.Insert(entry_score, entry_);
  if (scored != nullptr) scored->push_back({entry_score, entry_});
  ++stats->scored;
  int32_t nodes[kMaxSearchWidth];
  while (true) {
    // This round's nodes: the best `width` unexpanded candidates. Their fresh neighbors are
    // scored together, so that the memory latency of one node's rows overlaps the other's (a
    // node expanded a round early may then score keys a strict best-first order would not).
    int taken = 0;
    while (taken < width && pool.ExpandBest(&nodes[taken])) ++taken;
    if (taken == 0) break;
    stats->hops += taken;
    // The likely next expansion: the best unexpanded candidate after this round's (unless one of
    // their neighbors overtakes it): its adjacency row is requested now, in case its prefetch
    // when it entered the pool has been evicted since.
    if (const int32_t peek = pool.BestUnexpanded(); peek >= 0) prefetch_adjacency(peek);
    int m = 0;
    for (int t = 0; t < taken; ++t) {
      const int32_t* neighbor = adjacency + int64_t{nodes[t]} * params_.max_degree;
      const int count = degree[nodes[t]];
      for (int j = 0; j < count; ++j) {
        const int32_t v = neighbor[j];
        if (scratch.Visit(v)) fresh[m++] = v;
      }
    }
    stats->scored += m;
    for (int j = 0; j < std::min(m, kBatch); ++j) {
      PrefetchVector(keys.row_data(fresh[j]), row_bytes_of_key);
    }
    for (int b = 0; b < m; b += kBatch) {
      const int batch = std::min(kBatch, m - b);
      for (int j = b + kBatch; j < std::min(m, b + 2 * kBatch); ++j) {
        PrefetchVector(keys.row_data(fresh[j]), row_bytes_of_key);
      }
      for (int j = 0; j < batch; ++j) rows[j] = keys.row_data(fresh[b + j]);
      cpu::DotProductRows(q, rows, keys.element, batch, dim, fresh_scores + b);
    }
    if (scored != nullptr) {
      for (int j = 0; j < m; ++j) scored->push_back({fresh_scores[j], fresh[j]});
    }
    // Inserted in neighbor order after all are scored: the same pool as scoring and inserting
    // one at a time, since an insertion depends only on the scores before it.
    for (int j = 0; j < m; ++j) {
      if (pool.Rejects(fresh_scores[j])) continue;
      pool.InsertAccepted(fresh_scores[j], fresh[j]);
      prefetch_adjacency(fresh[j]);
    }
  }
  list->reserve(pool.size());
  pool.ForEach([&](float score, int32_t id) { list->push_back({score, id}); });
}

void GraphIndex::Search(const VectorSet& keys, const float* q, int k, const SearchParams& params,
                        SearchResult* out) const {
  out->ids.clear();
  out->scores.clear();
  out->stats = SearchStats();
  if (k < 1 || size_ == 0) return;
  const int configured = params.list_size > 0 ? params.list_size : params_.search_list_size;
  const int list_size = configured > 0 ? configured : std::max(k, kDefaultSearchListFloor);
  const int width = params.width > 0 ? params.width : params_.search_width;
  thread_local std::vector<std::pair<float, int32_t>> found;
  if (list_size >= k) {
    SearchGraph(keys, q, list_size, width, &found, &out->stats);
  } else {
    // A narrow beam: the best k of every key it scored, its list among them (with a list of k
    // or more that is the list's own top k).
    thread_local std::vector<std::pair<float, int32_t>> list;
    SearchGraph(keys, q, list_size, width, &list, &out->stats, &found);
  }

  // The tail is scanned exactly, then merged with the graph's candidates.
  for (int64_t t = linked_; t < size_; ++t) {
    found.push_back({cpu::DotProduct(q, keys.row_data(t), keys.element, keys.dim),
                     static_cast<int32_t>(t)});
  }
  out->stats.scored += size_ - linked_;
  thread_local std::vector<float> scores;
  thread_local std::vector<int32_t> positions;
  scores.clear();
  for (const auto& f : found) scores.push_back(f.first);
  cpu::TopKPositions(scores, k, &positions);
  for (int32_t p : positions) {
    out->ids.push_back(found[p].second);
    out->scores.push_back(found[p].first);
  }
}

absl::Status GraphIndex::Add(const VectorSet& keys, const VectorSet& recent_queries) {
  if (keys.count < size_) {
    return absl::InvalidArgumentError(absl::StrCat("graph index holds ", size_,
                                                   " keys; Add got a set of ", keys.count));
  }
  if (keys.count > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("graph index over ", keys.count, " keys: ids must fit in int32"));
  }
  if (recent_queries.count > 0 && recent_queries.dim != keys.dim) {
    return absl::InvalidArgumentError(absl::StrCat("recent query dim ", recent_queries.dim,
                                                   " differs from key dim ", keys.dim));
  }
  const int64_t count = KeysToLink(keys.count);
  size_ = keys.count;
  last_link_ = GraphLinkStats();
  if (count > 0) LinkOldest(keys, recent_queries, count);
  return absl::OkStatus();
}

int64_t GraphIndex::KeysToLink(int64_t key_count) const {
  const int64_t added = std::max<int64_t>(0, key_count - size_);
  const int64_t tail = size_ + added - linked_;
  if (tail < params_.link_threshold) return 0;
  if (params_.link_batch >= params_.link_threshold) return tail;  // the batch linking
  // Linking at least as many keys as were appended keeps the tail under link_threshold after
  // every Add; linking no more than max(link_batch, appended) bounds the Add's work.
  return std::min<int64_t>(tail, std::max<int64_t>(params_.link_batch, added));
}

void GraphIndex::LinkOldest(const VectorSet& keys, const VectorSet& recent_queries,
                            int64_t count) {
  const int64_t begin = linked_;
  const int64_t end = begin + count;
  const int degree = params_.max_degree;
  const int64_t threshold = std::max(params_.link_threshold, 1);
  // The window of fellow keys: the newest linked keys, these included. Linked in one batch of
  // the whole tail, it is the batch itself.
  const int64_t window_begin = std::max<int64_t>(0, end - std::max<int64_t>(threshold, count));
  const int64_t window = end - window_begin;
  // Projection by recent queries, now that their top-k may include new keys: a query's pivot
  // (its best key) links to its other top keys where either end is in the window, both ends
  // linked by now. (Searched before the new keys join the graph, while they are still scanned
  // exactly.) Rationed: recent_queries.count searches per link_threshold keys linked, each
  // query in turn, at most each query once.
  projection_credit_ += count * recent_queries.count;
  const int64_t searches = std::min(recent_queries.count, projection_credit_ / threshold);
  projection_credit_ = std::min(projection_credit_ - searches * threshold, threshold - 1);
  const int build_k = static_cast<int>(std::min<int64_t>(params_.build_topk, size_));
  std::vector<std::vector<Edge>> projected(searches);
#pragma omp parallel for schedule(dynamic, 1) if (searches >= 4)
  for (int64_t i = 0; i < searches; ++i) {
    SearchResult result;
    const int64_t query = (projection_cursor_ + i) % recent_queries.count;
    Search(keys, recent_queries.row(query), build_k, SearchParams(), &result);
    if (result.ids.empty() || result.ids[0] >= end) continue;
    const int32_t pivot = result.ids[0];
    for (size_t j = 1; j < result.ids.size(); ++j) {
      const int32_t id = result.ids[j];
      if (id < end && (pivot >= window_begin || id >= window_begin)) {
        projected[i].push_back({pivot, id});
      }
    }
  }
  if (searches > 0) projection_cursor_ = (projection_cursor_ + searches) % recent_queries.count;
  // Each new key's nearest (L2) fellow keys in the window, scored exactly since it is small.
  std::vector<Edge> edges(static_cast<size_t>(count) * degree, Edge{-1, -1});
#pragma omp parallel if (count >= 16)
  {
    std::vector<float> closeness(window);
    std::vector<int32_t> positions;
#pragma omp for schedule(dynamic, 8)
    for (int64_t i = 0; i < count; ++i) {
      const int32_t x = static_cast<int32_t>(begin + i);
      for (int64_t t = 0; t < window; ++t) {
        const int32_t other = static_cast<int32_t>(window_begin + t);
        closeness[t] = other == x ? -std::numeric_limits<float>::infinity()
                                  : -KeyDistance(keys, x, other);
      }
      cpu::TopKPositions(closeness, static_cast<int>(std::min<int64_t>(degree, window - 1)),
                         &positions);
      for (size_t j = 0; j < positions.size(); ++j) {
        edges[i * degree + j] = {x, static_cast<int32_t>(window_begin + positions[j])};
      }
    }
  }
  edges.erase(std::remove_if(edges.begin(), edges.end(), [](const Edge& e) { return e.from < 0; }),
              edges.end());
  for (const std::vector<Edge>& p : projected) edges.insert(edges.end(), p.begin(), p.end());
  // Token neighbors, including the last linked key.
  for (int64_t t = std::max<int64_t>(begin, 1); t < end; ++t) {
    edges.push_back({static_cast<int32_t>(t - 1), static_cast<int32_t>(t)});
  }
  // Every edge also goes the other way.
  const size_t forward = edges.size();
  for (size_t i = 0; i < forward; ++i) edges.push_back({edges[i].to, edges[i].from});

  if (key_mean_.empty()) {  // built over no keys: the first tail sets the mean
    key_mean_.assign(keys.dim, 0.0f);
    AddToMean(keys, begin, size_, &key_mean_);
  }
  Reserve(end);
  linked_ = end;
  if (entry_ < 0) {
    if (recent_queries.count > 0) {
      ChooseEntry(keys, recent_queries);
    } else {
      entry_ = static_cast<int32_t>(begin);
    }
  }
  MergeEdges(keys, &edges);
  // Last, the new keys' own searches over the graph they are now part of, with kept edges in:
  // what keeps each new key findable.
  std::vector<int32_t> nodes(count);
  for (int64_t i = 0; i < count; ++i) nodes[i] = static_cast<int32_t>(begin + i);
  LinkByOwnSearch(keys, nodes);
  last_link_ = GraphLinkStats{count, searches};
}

}  // namespace kvrecall
