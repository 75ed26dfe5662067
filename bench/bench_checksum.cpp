// Checkpoint file checksums: XXH3-64 (written) against FNV-1a 64 (the
// algorithm of older checkpoints, still verified), over one in-memory buffer
// fed in the 1 MiB pieces the checkpoint reader uses. bytes_per_second is
// the hashing speed alone (a file read from the page cache or a disk adds
// its own cost).
//
//   build/bench/bench_checksum
#include <benchmark/benchmark.h>

#include <algorithm>
#include <string>

#include "../src/checkpoint/checksum.h"

namespace {

namespace checksum = shardtorch::checkpoint::checksum;

void run(benchmark::State& state, std::string_view algorithm) {
  const size_t n = static_cast<size_t>(state.range(0));
  std::string data(n, '\0');
  for (size_t i = 0; i < n; ++i) data[i] = static_cast<char>((i * 2654435761u) >> 13);
  constexpr size_t kPiece = size_t{1} << 20;
  for (auto _ : state) {
    checksum::Hasher h(algorithm);
    for (size_t at = 0; at < n; at += kPiece) h.update(data.data() + at, std::min(kPiece, n - at));
    benchmark::DoNotOptimize(h.value());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n));
}

void BM_ChecksumXxh3(benchmark::State& state) { run(state, checksum::kXxh3); }
void BM_ChecksumFnv1a(benchmark::State& state) { run(state, checksum::kFnv1a); }

BENCHMARK(BM_ChecksumXxh3)->Arg(64 << 20)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ChecksumFnv1a)->Arg(64 << 20)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
