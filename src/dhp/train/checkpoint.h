// Training checkpoints in terms of a rank's local tensors. Every parameter and optimizer
// state tensor is saved as a global tensor with the single-process shape (see
// io/checkpoint_store.h for the files), whatever layout wrote it:
//   param/<name>       the parameter, in the model's dtype
//   master/<name>      fp32 master weights (only when the parameters are not fp32)
//   exp_avg/<name>, exp_avg_sq/<name>   AdamW moments (fp32)
// A rank describes what it holds as CheckpointPieces: elements [begin, begin + n) of its
// local tensor (a tensor-parallel shard of the global one, or all of it), in row-major
// order. A ZeRO-1 slice or a ZeRO-3 shard is such a range; a TP shard is a block of
// `parts` stacked pieces along one dim. map_to_global() turns a range into boxes of the
// global tensor, so any layout writes and reads any other's checkpoint.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "dhp/io/checkpoint_store.h"
#include "dhp/parallel/checkpoint_piece.h"
#include "dhp/parallel/tensor_parallel.h"
#include "dhp/train/config.h"

namespace dhp::qwen {
class HfWeights;
class PeftAdapter;
}

namespace dhp::train {

using parallel::CheckpointPiece;

// One run of local elements and the global box it is.
struct BoxSegment {
  int64_t flat = 0;                       // first element, relative to the piece's begin
  std::vector<int64_t> contig;            // the contiguous local run starting there, as a box shape
  int64_t dim = -1, start = 0, len = 0;   // narrow of that run along dim (-1: all of it)
  std::vector<int64_t> offset, shape;     // the global box
};

// The global boxes of local elements [begin, end) of the tensor-parallel shard (`tp`,
// `tp_rank` of `tp_size`) of a global tensor of `shape`. Throws when the shard does not
// divide the dim.
std::vector<BoxSegment> map_to_global(const std::vector<int64_t>& shape, const parallel::TpShard& tp, int64_t tp_rank,
                                      int64_t tp_size, int64_t begin, int64_t end);

// Adds the pieces this rank writes to `w`.
void add_pieces(io::SliceWriter& w, const std::vector<CheckpointPiece>& pieces);

// Where load_pieces reads global tensors from, box by box.
struct TensorSource {
  std::string where;  // names the source in errors
  std::function<bool(const std::string&)> has;
  std::function<std::vector<int64_t>(const std::string&)> shape;
  std::function<torch::Tensor(const std::string&, const std::vector<int64_t>& offset, const std::vector<int64_t>& shape)>
      read;
};
TensorSource checkpoint_source(const io::CheckpointReader& r);
// A Hugging Face model directory: param/<name> is its tensor <name> (either prefix
// convention); it has nothing else (so masters come from the parameters).
TensorSource hf_source(const qwen::HfWeights& w);

// A PEFT adapter directory: param/<adapter name> is its adapter (nothing else).
TensorSource peft_source(const qwen::PeftAdapter& a);

// Fills every piece (written or not) from `src`, converting dtypes. param/ of fp32 pieces
// prefers master/ (so a bf16 run's checkpoint continues in fp32 from its masters);
// master/ falls back to param/ (a checkpoint of an fp32 run, or an HF directory). Throws
// naming the source and tensor when one is missing or has another shape.
void load_pieces(const TensorSource& src, const std::vector<CheckpointPiece>& pieces);

// The resolved config a checkpoint was trained with (its meta), and every parameter in
// full by single-process name: param/ tensors, or master/ ones where `masters` and the
// checkpoint has them (fp32 masters of a bf16 run).
Config checkpoint_config(const io::CheckpointReader& r);
// A fine-tuning checkpoint holds only what trained: the frozen rest is rebuilt as the run
// started (its model.from, which must still be readable, or the seed's initialisation).
std::map<std::string, torch::Tensor> checkpoint_parameters(const io::CheckpointReader& r, bool masters);
// The model.from the checkpoint's run started from ("" when none).
std::string checkpoint_base_model(const io::CheckpointReader& r);
// `path` itself when it holds a manifest, else the newest complete step-N under it.
std::string find_checkpoint(const std::string& path);

}  // namespace dhp::train
