// CheckpointPiece: what one rank holds of one global tensor (a parameter or an optimizer
// state tensor, named with its single-process name), described so that a checkpoint can be
// written and read in any layout (train/checkpoint.h, docs/checkpoint_format.md). Module
// strategies produce them (parallel/strategy.h); they are views into live tensors.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "dhp/parallel/tensor_parallel.h"

namespace dhp::parallel {

struct CheckpointPiece {
  std::string name;             // global tensor name, e.g. "exp_avg/model.norm.weight"
  std::vector<int64_t> shape;   // its global (single-process) shape
  TpShard tp;                   // how the local tensor is cut from it (dim -1: the whole tensor)
  int64_t tp_rank = 0, tp_size = 1;
  int64_t begin = 0;            // first local element (row-major) that `data` holds
  torch::Tensor data;           // 1-D view of the elements, in the local dtype; loading writes through it
  bool write = false;           // this rank saves these elements (exactly one writer per element in a job)
  bool frozen = false;          // a frozen parameter (fine-tuning): left out of checkpoints, which hold what
                                // trains; it comes from model.from or the seed (loaded like any piece from an HF directory)
};

}  // namespace dhp::parallel
