// NumPy's own files, as engines written in Python save their tensors:
// `.npy` (format versions 1-3, C or Fortran order) and `.npz` archives of them
// (numpy.savez, stored, or numpy.savez_compressed, deflated; zip64 included).
// Values are widened like a dump's: floats to float32, integers and booleans
// to int64. Errors name the file and the array.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "dumps/contract/dump.h"

namespace llmdiff {

// Parses one .npy image. `file` and `name` only label errors and the result.
TensorData parse_npy(const uint8_t* data, size_t size, const std::string& file, const std::string& name);
// Only the shape, from the header.
Shape npy_shape_of(const uint8_t* data, size_t size, const std::string& file, const std::string& name);

// One member of a zip archive.
struct ZipMember {
  std::string name;
  uint16_t method = 0;  // 0 stored, 8 deflated
  uint32_t crc = 0;
  uint64_t compressed = 0, size = 0, local_offset = 0;
};

// The members of a zip archive (from its central directory). Throws
// FormatError naming the file.
std::vector<ZipMember> zip_members(const uint8_t* data, size_t size, const std::string& file);

// The uncompressed bytes of one member (checked against its CRC-32).
std::vector<uint8_t> zip_extract(const uint8_t* data, size_t size, const ZipMember& m, const std::string& file);

}  // namespace llmdiff
