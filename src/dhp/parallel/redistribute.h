// Redistribute: moves an encoder's output rows (the vision embeddings) of one global
// micro-batch from the layout the encoder's group produced them in to the layout the
// decoder's group needs, and their gradients back. The plan is pure arithmetic over the two ModuleLayouts (every rank computes the
// same one); the transfers are point-to-point over a group whose member i is global rank i
// (the job group), and a rank that already holds the rows it needs copies nothing.
//
// Layout of the rows: each module's data-parallel replica r takes the contiguous samples
// replica_chunk(n, dp, r) of the micro-batch. Encoder replica v holds, on every one of its
// ranks, the rows (vision: merged patches) of its samples in sample order (after SP's
// all-gather, or TP's final reduce). Decoder replica t needs, on every one of its ranks, the
// rows of its own samples in sample order. Backward, any rank of a decoder replica holds the
// whole gradient of its rows (TP ranks hold identical ones), and every rank of an encoder
// replica needs the whole gradient of the replica's rows.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "dhp/dist/comm.h"
#include "dhp/dist/layout.h"

namespace dhp::parallel {

// Samples [first, second) of replica `replica` when n samples are split over `replicas`
// contiguous chunks (the first n % replicas replicas get one more).
std::pair<int64_t, int64_t> replica_chunk(int64_t n, int64_t replicas, int64_t replica);

// One block of rows moving from one rank's tensor to another's (src == dst: a local copy).
struct RowPiece {
  int64_t src = 0, dst = 0;          // global ranks
  int64_t src_row = 0, dst_row = 0;  // first row in the source's / the destination's tensor
  int64_t rows = 0;
};

struct RedistributePlan {
  std::vector<RowPiece> forward;   // activations, encoder -> decoder
  std::vector<RowPiece> backward;  // gradients, decoder -> encoder
  std::map<int64_t, int64_t> encoder_rows;  // rows each encoder rank holds (global rank -> rows)
  std::map<int64_t, int64_t> decoder_rows;  // rows each decoder rank needs
};

// rows_per_sample: the encoder's rows of each sample of the micro-batch (vision: merged
// tokens), 0 for a sample without its input. Pieces of zero rows are left out. The source of a piece is the
// destination itself when it holds the rows, otherwise the source replica's ranks take
// turns so that no one rank sends everything.
RedistributePlan plan_redistribute(const dist::ModuleLayout& encoder, const dist::ModuleLayout& decoder,
                                   const std::vector<int64_t>& rows_per_sample);

// Does some micro-batch move rows (or their gradients) between distinct ranks? False
// exactly when the two modules have the same ranks, the same number of replicas and every
// rank in the same replica of both: then every piece of every plan is a local copy.
bool moves_between_ranks(const dist::ModuleLayout& encoder, const dist::ModuleLayout& decoder);
// This rank's sends of `pieces` (those with src == rank != dst): rows of `from` (rows, C).
// Returns at once; the data leaves when the destination receives (job.wait_sends()).
void send_pieces(const std::vector<RowPiece>& pieces, const torch::Tensor& from, const dist::Group& job,
                 int64_t rank, int64_t tag);
// This rank's receives of `pieces` (dst == rank) into a new (rows, C) tensor, and, when
// `send` is true, its sends of `pieces` from `local` posted in the same batch (dist::Group::
// exchange: one NCCL group, so that two ranks that both send and receive cannot block each
// other). Local pieces are copied from `local` (this rank's source tensor, may be undefined
// when it is none). When one local piece is the whole of `local` and of the result, returns
// `local` itself. Blocks until every piece arrived (or the group's timeout).
torch::Tensor exchange_pieces(const std::vector<RowPiece>& pieces, bool send, const torch::Tensor& local, int64_t rows,
                              int64_t cols, const torch::TensorOptions& options, const dist::Group& group,
                              int64_t rank, int64_t tag);
// exchange_pieces without sends.
torch::Tensor recv_pieces(const std::vector<RowPiece>& pieces, const torch::Tensor& local, int64_t rows,
                          int64_t cols, const torch::TensorOptions& options, const dist::Group& job,
                          int64_t rank, int64_t tag);

}  // namespace dhp::parallel
