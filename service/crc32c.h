// CRC-32C (Castagnoli, the iSCSI / ext4 / gRPC-free checksum): guards the
// page bytes of an export stream and the records of a snapshot file
// (docs/export_format.md). With SSE 4.2 (x86-64-v2 and up) it runs on the
// crc32 instruction over three interleaved streams (about 15 GB/s at
// 3 GHz); elsewhere a table, byte by byte.
#ifndef TQKV_SERVICE_CRC32C_H_
#define TQKV_SERVICE_CRC32C_H_

#include <cstddef>
#include <cstdint>

namespace tqkv {

// The CRC-32C of `size` bytes continuing from `crc` (0 to start): Crc32c(a
// then b) == Crc32c(Crc32c(0, a), b). Crc32c(0, "123456789", 9) is
// 0xE3069283.
uint32_t Crc32c(uint32_t crc, const void* data, size_t size);

// The same, a table step per byte on any CPU (the reference in tests).
uint32_t Crc32cPortable(uint32_t crc, const void* data, size_t size);

}  // namespace tqkv

#endif  // TQKV_SERVICE_CRC32C_H_
