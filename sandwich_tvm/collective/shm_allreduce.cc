// Sandwich's CPU all-reduce over one shared-memory segment (paper §5.3 / §7.2).
//
// Segment layout (bytes), created by the controller and mapped by every rank:
//   [0, 128 * world)                 one arrival counter per rank, each on its own 128-byte line
//   then 2 buffer sets (by op parity), each: world input slots + one result slot of `slot` bytes
// An op with sequence number s (1, 2, ... in the same order on every rank) uses set s & 1, so
// the next op never overwrites a set a slower rank may still read: writing set s & 1 again (op
// s + 2) waits at op s + 1's barrier, which every rank passes only after finishing op s.
//
// Each rank copies its input into its slot in rank-shifted circular order (rank r starts at
// chunk r), so ranks write different pages at the same moment; then all ranks meet at a barrier
// (release/acquire counters, spinning, yielding after a while, with a deadline). Small
// messages are reduced one-shot: every rank sums all slots. Large ones go in blocks of
// `block_bytes` (so a block's slots, result and output stay in cache instead of streaming the
// whole message through DRAM five times): each block is reduce-scattered (rank r sums chunk r
// of the block, plus the residual when asked, into its output and the result slot) and
// all-gathered (every rank copies the other ranks' chunks of the result, rank-shifted). Chunks are whole cache lines. Sums run in rank order 0..P-1
// everywhere, so every rank gets bit-identical results. Barrier i of op s waits for the
// counter value (s << 24) + i: monotonic over ops and over the blocks of one op.
//
// Each rank's line also holds its pid (word 1) and an abort flag (word 2). A waiting rank
// checks, every few thousand spins, whether a late peer has set its flag (it failed and said
// why) or has exited (its /proc entry is gone or a zombie), and raises instead of waiting out
// the deadline: a killed worker ends the request within milliseconds.
#include <sched.h>
#include <time.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>

namespace {

constexpr int64_t kLine = 128;
constexpr int64_t kFloatsPerLine = 16;  // 64-byte cache lines of fp32

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

uint64_t* counter(uint8_t* seg, int64_t rank) { return reinterpret_cast<uint64_t*>(seg + rank * kLine); }

// True when process `pid` no longer runs (no /proc entry, or a zombie awaiting its parent).
bool exited(uint64_t pid) {
  if (pid == 0) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%llu/stat", static_cast<unsigned long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;
  char buf[512];
  size_t len = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[len] = 0;
  const char* paren = std::strrchr(buf, ')');
  return paren != nullptr && (paren[2] == 'Z' || paren[2] == 'X');
}

// Raise if rank j aborted or exited.
void check_peer(uint8_t* seg, int64_t j, int64_t rank, uint64_t target) {
  uint64_t* line = counter(seg, j);
  if (__atomic_load_n(line + 2, __ATOMIC_ACQUIRE) != 0) {
    TVM_FFI_THROW(RuntimeError) << "shm all-reduce: rank " << j << " failed (its error is above); rank "
                                << rank << " stopped waiting at step " << target;
  }
  uint64_t pid = __atomic_load_n(line + 1, __ATOMIC_ACQUIRE);
  if (exited(pid)) {
    TVM_FFI_THROW(RuntimeError) << "shm all-reduce: rank " << j << " (pid " << pid << ") exited; rank "
                                << rank << " stopped waiting at step " << target;
  }
}

void barrier(uint8_t* seg, int64_t rank, int64_t world, uint64_t target, double timeout_s) {
  __atomic_store_n(counter(seg, rank), target, __ATOMIC_RELEASE);
  for (int64_t j = 0; j < world; ++j) {
    if (j == rank) continue;
    int64_t spins = 0;
    double deadline = 0;
    while (__atomic_load_n(counter(seg, j), __ATOMIC_ACQUIRE) < target) {
      if (++spins < 4096) continue;
      sched_yield();
      if ((spins & 1023) == 0) {
        check_peer(seg, j, rank, target);
        double t = now_s();
        if (deadline == 0) deadline = t + timeout_s;
        if (t > deadline) {
          TVM_FFI_THROW(RuntimeError) << "shm all-reduce: rank " << j << " did not arrive within "
                                      << timeout_s << " s (rank " << rank << " waited at step " << target
                                      << "); the process group is broken";
        }
      }
    }
  }
}

// 16 floats as one value: GCC and Clang keep it in vector registers (one zmm on AVX-512, two
// ymm on AVX2, four q registers on Neon). Copies go through it rather than memcpy: glibc's
// `rep movsb` is several times slower on AMD Zen when source and destination are 4 KB-aliased,
// which the segment's slots are.
typedef float f32x16 __attribute__((vector_size(64), aligned(4)));
constexpr int64_t kVec = 16;

inline f32x16 load(const float* p) { return *reinterpret_cast<const f32x16*>(p); }
inline void store(float* p, f32x16 v) { *reinterpret_cast<f32x16*>(p) = v; }

void copy(float* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) store(dst + i, load(src + i));
  for (; i < n; ++i) dst[i] = src[i];
}

// out[i] = src[0][i] + ... + src[world-1][i] (+ res[i]) for i in [begin, end), in that order on
// every rank (bit-identical results); `also`, when given, gets a copy of out. out may alias res.
void reduce(float* out, float* also, float* const* src, int64_t world, const float* res, int64_t begin,
            int64_t end) {
  int64_t i = begin;
  for (; i + kVec <= end; i += kVec) {
    f32x16 acc = load(src[0] + i);
    for (int64_t j = 1; j < world; ++j) acc += load(src[j] + i);
    if (res != nullptr) acc += load(res + i);
    store(out + i, acc);
    if (also != nullptr) store(also + i, acc);
  }
  for (; i < end; ++i) {
    float acc = src[0][i];
    for (int64_t j = 1; j < world; ++j) acc += src[j][i];
    if (res != nullptr) acc += res[i];
    out[i] = acc;
    if (also != nullptr) also[i] = acc;
  }
}

}  // namespace

// x, out: float32, the same number of elements on every rank; residual: the same shape, added to
// the sum when add_residual (the transformer's residual stream; equal on every rank); out may be
// x or residual. seg: the mapped segment (uint8); slot: bytes per slot; seq: this op's number
// (1, 2, ...); one_shot_bytes: the size up to which every rank reduces the whole message itself;
// block_bytes: the block of larger ones.
void shm_allreduce_f32(tvm::ffi::TensorView seg_t, int64_t rank, int64_t world, int64_t slot, int64_t seq,
                       tvm::ffi::TensorView x, tvm::ffi::TensorView residual, bool add_residual,
                       tvm::ffi::TensorView out, int64_t one_shot_bytes, int64_t block_bytes, double timeout_s) {
  DLDataType f32{kDLFloat, 32, 1};
  TVM_FFI_ICHECK(x.dtype() == f32 && out.dtype() == f32) << "shm all-reduce takes float32 tensors";
  int64_t n = x.numel();
  TVM_FFI_ICHECK(out.numel() == n) << "input and output differ in size";
  TVM_FFI_ICHECK(!add_residual || (residual.dtype() == f32 && residual.numel() == n))
      << "the residual must be float32 of the input's size";
  TVM_FFI_ICHECK(n * 4 <= slot) << "message of " << n * 4 << " bytes exceeds the segment's slot of " << slot;
  TVM_FFI_ICHECK(0 <= rank && rank < world && seq >= 1) << "bad rank, world or sequence number";
  uint8_t* seg = static_cast<uint8_t*>(seg_t.data_ptr());
  uint8_t* set = seg + kLine * world + (seq & 1) * (world + 1) * slot;
  float* slots[64];
  TVM_FFI_ICHECK(world <= 64) << "at most 64 ranks";
  for (int64_t j = 0; j < world; ++j) slots[j] = reinterpret_cast<float*>(set + j * slot);
  float* result = reinterpret_cast<float*>(set + world * slot);
  const float* in = static_cast<const float*>(x.data_ptr());
  const float* res = add_residual ? static_cast<const float*>(residual.data_ptr()) : nullptr;
  float* dst = static_cast<float*>(out.data_ptr());

  uint64_t step = static_cast<uint64_t>(seq) << 24;
  bool one_shot = n * 4 <= one_shot_bytes;
  // Blocks of at most block_bytes, all of one size (whole cache lines): a 300 KB message goes as
  // two 150 KB blocks, not 256 + 44. Two blocks' staging fits the slot, which has a page to spare.
  int64_t max_block = block_bytes / 4 / kFloatsPerLine * kFloatsPerLine;
  TVM_FFI_ICHECK(max_block > 0 && (n + max_block - 1) / max_block < (1 << 22)) << "block_bytes too small";
  int64_t blocks = (n + max_block - 1) / max_block;
  int64_t block = one_shot ? n : ((n + blocks - 1) / blocks + kFloatsPerLine - 1) / kFloatsPerLine * kFloatsPerLine;
  TVM_FFI_ICHECK(one_shot || blocks == 1 || 2 * block * 4 <= slot) << "slot too small for two blocks";
  for (int64_t lo = 0; lo < n; lo += block) {
    int64_t hi = lo + block < n ? lo + block : n;
    // Block b is staged at offset (b & 1) * block of every slot and of the result, not at its
    // own offset: the staging stays cache-resident, so DRAM sees only the input read and the
    // output write. Block b + 2 reuses block b's buffers only after every rank passed block
    // b + 1's first barrier, by which time all of block b's reads are done.
    int64_t shift = one_shot ? 0 : ((lo / block) & 1) * block - lo;  // message index -> staging index
    // chunks of whole cache lines, one per rank
    int64_t chunk = ((hi - lo + world - 1) / world + kFloatsPerLine - 1) / kFloatsPerLine * kFloatsPerLine;
    auto span = [&](int64_t c, int64_t* b, int64_t* e) {
      *b = lo + c * chunk < hi ? lo + c * chunk : hi;
      *e = lo + (c + 1) * chunk < hi ? lo + (c + 1) * chunk : hi;
    };
    for (int64_t i = 0; i < world; ++i) {  // rank-shifted circular write
      int64_t b, e;
      span((rank + i) % world, &b, &e);
      if (e > b) copy(slots[rank] + shift + b, in + b, e - b);
    }
    barrier(seg, rank, world, ++step, timeout_s);
    if (one_shot) {  // every rank sums the whole message: one pass, no second barrier
      reduce(dst, nullptr, slots, world, res, 0, n);
      return;
    }
    float* staged[64];
    for (int64_t j = 0; j < world; ++j) staged[j] = slots[j] + shift;
    int64_t b, e;
    span(rank, &b, &e);
    // reduce-scatter: this rank's chunk of the block, into its output and the shared result
    reduce(dst, result + shift, staged, world, res, b, e);
    barrier(seg, rank, world, ++step, timeout_s);
    for (int64_t i = 1; i < world; ++i) {  // all-gather the other ranks' chunks, rank-shifted
      span((rank + i) % world, &b, &e);
      if (e > b) copy(dst + b, result + shift + b, e - b);
    }
  }
}

// Every rank's x (rows x w floats) side by side in out (rows x full, full <= world * w; rank r's
// columns are [r * w, min((r + 1) * w, full))): each rank writes its part to its slot once, all
// meet at a barrier, and each copies the other parts out, rank-shifted. The vocabulary-split
// lm_head's logits move once per rank, not as an all-reduce of a mostly-zero full row.
void shm_allgather_f32(tvm::ffi::TensorView seg_t, int64_t rank, int64_t world, int64_t slot, int64_t seq,
                       tvm::ffi::TensorView x, tvm::ffi::TensorView out, double timeout_s) {
  DLDataType f32{kDLFloat, 32, 1};
  TVM_FFI_ICHECK(x.dtype() == f32 && out.dtype() == f32) << "shm all-gather takes float32 tensors";
  TVM_FFI_ICHECK(x.ndim() >= 1 && out.ndim() == x.ndim()) << "input and output differ in rank";
  int64_t w = x.shape()[x.ndim() - 1], full = out.shape()[out.ndim() - 1];
  int64_t rows = w > 0 ? x.numel() / w : 0;
  TVM_FFI_ICHECK(out.numel() == rows * full && full <= world * w)
      << "the output must hold the ranks' parts side by side (" << world << " x " << w << " >= " << full << ")";
  TVM_FFI_ICHECK(x.numel() * 4 <= slot) << "part of " << x.numel() * 4 << " bytes exceeds the slot of " << slot;
  TVM_FFI_ICHECK(0 <= rank && rank < world && world <= 64 && seq >= 1) << "bad rank, world or sequence number";
  uint8_t* seg = static_cast<uint8_t*>(seg_t.data_ptr());
  uint8_t* set = seg + kLine * world + (seq & 1) * (world + 1) * slot;
  const float* in = static_cast<const float*>(x.data_ptr());
  float* dst = static_cast<float*>(out.data_ptr());
  copy(reinterpret_cast<float*>(set + rank * slot), in, x.numel());
  barrier(seg, rank, world, (static_cast<uint64_t>(seq) << 24) + 1, timeout_s);
  for (int64_t i = 0; i < world; ++i) {
    int64_t j = (rank + i) % world;
    int64_t lo = j * w < full ? j * w : full, hi = lo + w < full ? lo + w : full;
    const float* part = reinterpret_cast<const float*>(set + j * slot);
    for (int64_t r = 0; r < rows && hi > lo; ++r) copy(dst + r * full + lo, part + r * w, hi - lo);
  }
}
