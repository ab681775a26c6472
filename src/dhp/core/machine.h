// What this process runs on: CPU threads and the BLAS behind libtorch's fp32 GEMMs.
#pragma once

#include <string>

namespace dhp {

// "OpenBLAS 0.3.21 core SkylakeX" when libtorch's BLAS is OpenBLAS, else "unknown BLAS".
std::string blas_description();
// Non-empty when the BLAS runs slow generic kernels (OpenBLAS detected a generic CPU, as under
// some hypervisors): a hint saying how to select the right kernels. dhp never sets it itself.
std::string blas_hint();

}  // namespace dhp
