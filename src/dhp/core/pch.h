// Precompiled header for every dhp target: the heavy libtorch headers.
#pragma once
#include <torch/torch.h>
