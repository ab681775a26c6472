// Whole-file reads and atomic writes (no torch: the planner uses them too).
#pragma once

#include <string>

namespace dhp::io {

// Writes `bytes` to `path` atomically (temporary name, fsync, rename, fsync of the
// directory): a reader sees the old file or the new one, never a part.
void write_file_atomic(const std::string& path, const std::string& bytes);
// The whole file as bytes; throws dhp::Error naming it when it cannot be read.
std::string read_file(const std::string& path);

}  // namespace dhp::io
