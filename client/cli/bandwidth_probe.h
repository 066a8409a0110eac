// The memory bound of a benchmark: how fast this machine streams bytes from
// DRAM into the cores, measured in the same command as the figures it bounds
// (a figure from another run, or another machine, is not a bound).
#ifndef TQKV_CLIENT_CLI_BANDWIDTH_PROBE_H_
#define TQKV_CLIENT_CLI_BANDWIDTH_PROBE_H_

#include <cstddef>

namespace tqkv {
namespace cli {

// Read bandwidth in bytes per second: `threads` threads each sum their slice
// of a `bytes`-long buffer (well above the last-level cache: 256 MiB is a
// safe default) with the widest loads the CPU has; the median of repeated
// passes over at least `min_seconds`, after one pass that faults the pages in.
double MeasureReadBandwidth(size_t bytes, int threads, double min_seconds);

}  // namespace cli
}  // namespace tqkv

#endif  // TQKV_CLIENT_CLI_BANDWIDTH_PROBE_H_
