// Micro-benchmark of the GEMV kernels' many-row path (17-64 rows: fp32 panels + micro-kernel) on synthetic weights
// (only the bytes and shapes matter): compiles csrc/cpu/variant/gemv.cpp itself with one variant's flags, e.g.
//   g++ -O3 -std=c++17 -fopenmp -ffast-math -fno-exceptions -DPAGEMILL_ISA=avx512_vbmi -mavx512f -mavx512bw \
//     -mavx512vl -mavx512dq -mavx512vbmi -mgfni -mavx512vnni -mavx2 -mfma -mf16c -Ipagemill/csrc/cpu \
//     benchmarks/kernels/gemv_panel.cpp -o /tmp/gemv_panel && /tmp/gemv_panel 32 640 4096 1
// (flags per variant: pagemill/kernels/build.py). Arguments: M K N threads. Prints the best of 200 calls per format
// and the micro-kernel alone ("nodeq": the panel is not refilled).
#include "variant/gemv.cpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

using namespace pagemill;
using namespace pagemill::PAGEMILL_ISA;

int main(int argc, char** argv) {
  const int64_t M = argc > 1 ? atol(argv[1]) : 32, K = argc > 2 ? atol(argv[2]) : 640;
  const int64_t N = argc > 3 ? atol(argv[3]) : 4096;
  const int threads = argc > 4 ? atoi(argv[4]) : 1;
  const int64_t tiles = (N + 63) / 64;
  std::vector<float> x(M * K, 0.5f), out(M * N);
  std::vector<int8_t> q(tiles * K * 64, 3);
  std::vector<float> scales(tiles * K / 32 * 64, 0.01f);
  std::vector<uint8_t> records(tiles * (K / 32) * 2048, 0x11);  // room for every record kind; 0x11: small fp16s
  GemvArgs a{};
  a.out = out.data(), a.out_dtype = DType::F32, a.x = x.data(), a.M = M, a.K = K, a.N = N, a.tiles = tiles;
  a.num_threads = threads;
  auto bench = [&](const char* name, auto f) {
    f();
    double best = 1e9;
    for (int r = 0; r < 200; ++r) {
      const auto t = std::chrono::steady_clock::now();
      f();
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
    }
    printf("%-6s M=%ld K=%ld N=%ld: %.3f ms %.1f GFLOP/s\n", name, long(M), long(K), long(N), best * 1e3,
           2.0 * M * K * N / best / 1e9);
  };
  bench("int8", [&] { gemv_int8(a, q.data(), scales.data(), nullptr, K, 32); });
  bench("q5_1", [&] { gemv_records(a, records.data(), RecordFormat::Q5_1); });
  bench("q4_k", [&] { gemv_records(a, records.data(), RecordFormat::Q4_K); });
  bench("q6_k", [&] { gemv_records(a, records.data(), RecordFormat::Q6_K); });
  bench("nodeq", [&] { run_panel(a, 32, nullptr, 0, [](int64_t, int64_t, int64_t, float*) {}); });
  return 0;
}
