// Shared-memory all-reduce / all-gather for the tensor-parallel ranks of one host (the idea of vLLM's CPU
// csrc/cpu/shm.cpp, written for pagemill). One POSIX segment per group: a header with one sequence counter per rank
// (each on its own cache line), then per rank two input slots used alternately. A collective with sequence s:
//   copy the input into slot[rank][s % 2]; arrive[rank] = s (release); wait until every arrive[j] >= s (acquire);
//   read every rank's slot in rank order 0..n-1.
// Every rank reduces in the same order, so all ranks get bit-identical results. Two slots per rank make one barrier
// per collective enough: a rank rewrites slot s % 2 only at s + 2, after every peer arrived at s + 1, i.e. after
// every peer finished reading collective s. Waiters spin briefly, then yield; a timeout and a peer-liveness check
// (kill(pid, 0); a zombie counts as gone) turn a dead or stuck peer into an error instead of a hang.
#include <torch/extension.h>

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PAGEMILL_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define PAGEMILL_PAUSE() __asm__ __volatile__("yield")
#else
#define PAGEMILL_PAUSE() ((void)0)
#endif

namespace py = pybind11;

namespace {

constexpr uint64_t kMagic = 0x706d5f73686d3031ULL;  // "pm_shm01"
constexpr int kMaxRanks = 64;
constexpr int kSpinIterations = 4096;     // pause-loop checks before yielding (~tens of microseconds)
constexpr int kYieldsPerClockCheck = 64;  // yields between reads of the clock
constexpr double kLivenessPeriodS = 0.05;

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory counters need lock-free 64-bit atomics");

struct alignas(64) Counter {
  std::atomic<uint64_t> value;
};

struct Header {
  uint64_t magic;
  uint64_t token;  // rank 0's random number: the others check they opened the segment it created
  int64_t world;
  int64_t slot_bytes;
  std::atomic<int64_t> pids[kMaxRanks];
  Counter arrive[kMaxRanks];
};

constexpr size_t kDataOffset = (sizeof(Header) + 4095) / 4096 * 4096;

std::string errno_text(const std::string& what) { return what + ": " + std::strerror(errno); }

// Whether process `pid` still runs: gone (ESRCH) or a zombie (exited, not yet reaped by its parent) is dead.
bool process_alive(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
#ifdef __linux__
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;  // no /proc: kill's answer stands
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* paren = std::strrchr(buf, ')');  // "pid (comm) state ...": comm may hold spaces and parentheses
  if (paren != nullptr && paren[1] == ' ' && (paren[2] == 'Z' || paren[2] == 'X')) return false;
#endif
  return true;
}

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", s);
  return buf;
}

// out = sum over ranks of slots[j] (in rank order), float32 accumulation for 16-bit types (one rounding).
template <typename T>
void reduce_slots(T* out, const char* const* slots, int world, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    const float* a = reinterpret_cast<const float*>(slots[0]);
    const float* b = reinterpret_cast<const float*>(slots[1]);
    for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
    for (int j = 2; j < world; ++j) {
      const float* c = reinterpret_cast<const float*>(slots[j]);
      for (int64_t i = 0; i < n; ++i) out[i] += c[i];
    }
  } else {
    constexpr int64_t kBlock = 512;
    float acc[kBlock];
    for (int64_t start = 0; start < n; start += kBlock) {
      const int64_t len = std::min(kBlock, n - start);
      const T* a = reinterpret_cast<const T*>(slots[0]) + start;
      for (int64_t i = 0; i < len; ++i) acc[i] = static_cast<float>(a[i]);
      for (int j = 1; j < world; ++j) {
        const T* c = reinterpret_cast<const T*>(slots[j]) + start;
        for (int64_t i = 0; i < len; ++i) acc[i] += static_cast<float>(c[i]);
      }
      for (int64_t i = 0; i < len; ++i) out[start + i] = static_cast<T>(acc[i]);
    }
  }
}

class ShmComm {
 public:
  // create: rank 0 makes the segment (O_EXCL: a name in use is an error) and reserves its pages; the others open it.
  ShmComm(const std::string& name, int64_t rank, int64_t world, int64_t slot_bytes, bool create, uint64_t token,
          double timeout_s)
      : name_(name), rank_(rank), world_(world), slot_bytes_(slot_bytes), timeout_s_(timeout_s) {
    TORCH_CHECK(world >= 2 && world <= kMaxRanks, "shm communicator: world size ", world, " not in [2, ", kMaxRanks,
                "]");
    TORCH_CHECK(rank >= 0 && rank < world, "shm communicator: rank ", rank, " not in [0, ", world, ")");
    TORCH_CHECK(slot_bytes > 0 && slot_bytes % 64 == 0,
                "shm communicator: slot_bytes must be a positive multiple of 64");
    size_ = kDataOffset + static_cast<size_t>(world) * 2 * static_cast<size_t>(slot_bytes);
    fd_ = shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
    if (fd_ < 0) throw std::runtime_error(errno_text("shm_open(" + name + ")"));
    owner_ = create;
    if (create) {
      // posix_fallocate, not ftruncate alone: a tmpfs too small must fail here, not SIGBUS on first touch.
#ifdef __linux__
      const int err = posix_fallocate(fd_, 0, static_cast<off_t>(size_));
#else
      const int err = ftruncate(fd_, static_cast<off_t>(size_)) == 0 ? 0 : errno;
#endif
      if (err != 0) {
        errno = err;
        const std::string msg = errno_text("posix_fallocate(" + name + ", " + std::to_string(size_) + " bytes)");
        release();
        throw std::runtime_error(msg);
      }
    } else {
      struct stat st;
      if (fstat(fd_, &st) != 0 || static_cast<size_t>(st.st_size) != size_) {
        release();
        throw std::runtime_error("shm communicator: segment " + name + " has the wrong size");
      }
    }
    void* base = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (base == MAP_FAILED) {
      const std::string msg = errno_text("mmap(" + name + ")");
      release();
      throw std::runtime_error(msg);
    }
    base_ = static_cast<char*>(base);
    header_ = reinterpret_cast<Header*>(base_);
    if (create) {
      header_->magic = 0;  // published last, after the counters exist
      header_->token = token;
      header_->world = world;
      header_->slot_bytes = slot_bytes;
      for (int j = 0; j < kMaxRanks; ++j) {
        new (&header_->pids[j]) std::atomic<int64_t>(0);
        new (&header_->arrive[j].value) std::atomic<uint64_t>(0);
      }
      std::atomic_thread_fence(std::memory_order_release);
      header_->magic = kMagic;
    } else if (header_->magic != kMagic || header_->token != token || header_->world != world ||
               header_->slot_bytes != slot_bytes) {
      release();
      throw std::runtime_error("shm communicator: segment " + name + " is not the one rank 0 created");
    }
    header_->pids[rank].store(getpid(), std::memory_order_release);
  }

  ~ShmComm() { release(); }

  // Remove the name (the mapping lives on while some rank has it mapped); rank 0 calls it once all ranks opened.
  void unlink() {
    if (owner_ && !unlinked_) {
      shm_unlink(name_.c_str());
      unlinked_ = true;
    }
  }

  void close() { release(); }

  // In place: t = sum over ranks of t (every rank gets the same, bit for bit).
  void all_reduce(torch::Tensor t) {
    check_tensor(t, "all_reduce");
    const int64_t nbytes = t.numel() * t.element_size();
    char* data = static_cast<char*>(t.data_ptr());
    const auto dtype = t.scalar_type();
    py::gil_scoped_release nogil;
    const uint64_t seq = arrive_with(data, nbytes);
    const char* slots[kMaxRanks];
    for (int j = 0; j < world_; ++j) slots[j] = slot(j, seq);
    switch (dtype) {
      case at::kFloat:
        reduce_slots(reinterpret_cast<float*>(data), slots, world_, t.numel());
        break;
      case at::kBFloat16:
        reduce_slots(reinterpret_cast<c10::BFloat16*>(data), slots, world_, t.numel());
        break;
      case at::kHalf:
        reduce_slots(reinterpret_cast<c10::Half*>(data), slots, world_, t.numel());
        break;
      default:
        break;  // check_tensor refused it
    }
  }

  // out = the ranks' `in` concatenated along the last dimension (out: in's shape with the last size x world).
  void all_gather(torch::Tensor out, torch::Tensor in) {
    check_tensor(in, "all_gather");
    TORCH_CHECK(out.is_contiguous() && out.scalar_type() == in.scalar_type() && out.numel() == in.numel() * world_,
                "shm all_gather: out must be contiguous, of in's dtype and world x its size");
    const int64_t last = in.dim() == 0 ? 1 : in.size(-1);
    const int64_t rows = last == 0 ? 0 : in.numel() / last;
    const int64_t row_bytes = last * in.element_size();
    const int64_t nbytes = in.numel() * in.element_size();
    char* src = static_cast<char*>(in.data_ptr());
    char* dst = static_cast<char*>(out.data_ptr());
    py::gil_scoped_release nogil;
    const uint64_t seq = arrive_with(src, nbytes);
    for (int j = 0; j < world_; ++j) {
      const char* part = slot(j, seq);
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(dst + (r * world_ + j) * row_bytes, part + r * row_bytes, row_bytes);
    }
  }

  void barrier() {
    py::gil_scoped_release nogil;
    arrive_with(nullptr, 0);
  }

  int64_t slot_bytes() const { return slot_bytes_; }
  uint64_t sequence() const { return seq_; }

 private:
  void check_tensor(const torch::Tensor& t, const char* op) const {
    TORCH_CHECK(base_ != nullptr, "shm ", op, ": the communicator is closed");
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "shm ", op, ": needs a contiguous CPU tensor");
    const auto d = t.scalar_type();
    TORCH_CHECK(d == at::kFloat || d == at::kBFloat16 || d == at::kHalf, "shm ", op,
                ": dtype must be float32, bfloat16 or float16, got ", d);
    TORCH_CHECK(t.numel() * t.element_size() <= slot_bytes_, "shm ", op, ": ", t.numel() * t.element_size(),
                " bytes exceed the slot of ", slot_bytes_);
  }

  char* slot(int64_t rank, uint64_t seq) const {
    return base_ + kDataOffset + (static_cast<size_t>(rank) * 2 + (seq & 1)) * static_cast<size_t>(slot_bytes_);
  }

  // Publish this rank's input for the next collective and wait for every peer's; returns the collective's number.
  uint64_t arrive_with(const char* data, int64_t nbytes) {
    const uint64_t seq = ++seq_;
    if (nbytes > 0) std::memcpy(slot(rank_, seq), data, nbytes);
    header_->arrive[rank_].value.store(seq, std::memory_order_release);
    for (int j = 0; j < world_; ++j)
      if (j != rank_) wait_for(j, seq);
    return seq;
  }

  void wait_for(int peer, uint64_t seq) {
    const std::atomic<uint64_t>& counter = header_->arrive[peer].value;
    for (int i = 0; i < kSpinIterations; ++i) {
      if (counter.load(std::memory_order_acquire) >= seq) return;
      PAGEMILL_PAUSE();
    }
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    auto last_liveness = start;
    for (int n = 1;; ++n) {
      if (counter.load(std::memory_order_acquire) >= seq) return;
      sched_yield();
      if (n % kYieldsPerClockCheck) continue;
      const auto now = clock::now();
      if (std::chrono::duration<double>(now - start).count() > timeout_s_)
        throw std::runtime_error("shm collective #" + std::to_string(seq) + ": rank " + std::to_string(peer) +
                                 " did not arrive within " + seconds_text(timeout_s_) + " s");
      if (std::chrono::duration<double>(now - last_liveness).count() > kLivenessPeriodS) {
        last_liveness = now;
        const pid_t pid = static_cast<pid_t>(header_->pids[peer].load(std::memory_order_acquire));
        if (pid > 0 && !process_alive(pid))
          throw std::runtime_error("shm collective #" + std::to_string(seq) + ": rank " + std::to_string(peer) +
                                   " (pid " + std::to_string(pid) + ") is gone");
      }
    }
  }

  void release() {
    unlink();
    if (base_ != nullptr) munmap(base_, size_);
    base_ = nullptr;
    header_ = nullptr;
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  std::string name_;
  int64_t rank_, world_, slot_bytes_;
  double timeout_s_;
  size_t size_ = 0;
  int fd_ = -1;
  bool owner_ = false, unlinked_ = false;
  char* base_ = nullptr;
  Header* header_ = nullptr;
  uint64_t seq_ = 0;
};

}  // namespace

// Its own extension module (pagemill_shm; pagemill/kernels/build.py builds it beside the kernels).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<ShmComm>(m, "ShmComm",
                      "Shared-memory all-reduce / all-gather between the processes of one host (csrc/shm/shm_comm.cpp)")
      .def(py::init<const std::string&, int64_t, int64_t, int64_t, bool, uint64_t, double>(), py::arg("name"),
           py::arg("rank"), py::arg("world"), py::arg("slot_bytes"), py::arg("create"), py::arg("token"),
           py::arg("timeout_s"))
      .def("all_reduce", &ShmComm::all_reduce, "In place: t = the sum over ranks (rank order)", py::arg("t"))
      .def("all_gather", &ShmComm::all_gather, "out = the ranks' inputs concatenated along the last dimension",
           py::arg("out"), py::arg("input"))
      .def("barrier", &ShmComm::barrier, "Wait until every rank arrives")
      .def("unlink", &ShmComm::unlink, "Remove the segment's name (rank 0; the mappings stay)")
      .def("close", &ShmComm::close, "Unmap the segment (and unlink it on rank 0)")
      .def_property_readonly("slot_bytes", &ShmComm::slot_bytes)
      .def_property_readonly("sequence", &ShmComm::sequence);
}
