// Redistribute: moves an encoder's output rows (the vision embeddings) of one global
// micro-batch from the layout the encoder's group produced them in to the layout the
// decoder's group needs, and their gradients back. The plan is pure arithmetic over the two ModuleLayouts (every rank computes the
// same one); the transfers are point-to-point over a group whose member i is global rank i
// (the job group), and a rank that already holds the rows it needs copies nothing.
//
// Layout of the rows: each module's data-parallel replica r takes the samples of the
// micro-batch that its assignment (`ReplicaSamples`: contiguous chunks, or balanced by cost)
// gives it. Encoder replica v holds, on every one of its ranks, the rows (vision: merged
// patches) of its samples in sample order (after SP's all-gather, or TP's final reduce).
// Decoder replica t needs, on every one of its ranks, the rows of its own samples in sample
// order. Backward, any rank of a decoder replica holds the
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

// The samples of one micro-batch that each data-parallel replica of a module takes: entry r
// lists replica r's sample indices, ascending (its rows are laid out in that order). Every
// sample belongs to exactly one replica.
using ReplicaSamples = std::vector<std::vector<int64_t>>;

// replica_chunk's contiguous split as an assignment.
ReplicaSamples contiguous_replicas(int64_t n, int64_t replicas);

// The samples assigned by cost, greedily largest first, each to the replica with the least
// cost so far (ties: the one with fewer samples, then the lower index; without `first` this
// is the LPT rule, whose largest replica cost is within 4/3 of the best split's). Samples marked in `first` (when given, one flag per sample)
// are placed before the others, so that every replica gets one of them while they last (a
// ZeRO-3 vision replica needs an image). Deterministic; equal costs keep sample order. Every
// replica gets a sample when there are at least as many samples as replicas.
ReplicaSamples balanced_replicas(const std::vector<double>& cost, int64_t replicas,
                                 const std::vector<bool>& first = {});

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
// tokens), 0 for a sample without its input; `encoder_samples` / `decoder_samples`: each
// module's assignment (one entry per replica, covering the same samples). Pieces of zero rows
// are left out; consecutive samples that travel between the same two ranks and sit next to
// each other at both ends are one piece. The source of a piece is the destination itself
// when it holds the rows, otherwise the source replica's ranks take turns (one per
// destination rank) so that no one rank sends everything.
RedistributePlan plan_redistribute(const dist::ModuleLayout& encoder, const ReplicaSamples& encoder_samples,
                                   const dist::ModuleLayout& decoder, const ReplicaSamples& decoder_samples,
                                   const std::vector<int64_t>& rows_per_sample);
// The same with both modules' replicas taking contiguous chunks.
RedistributePlan plan_redistribute(const dist::ModuleLayout& encoder, const dist::ModuleLayout& decoder,
                                   const std::vector<int64_t>& rows_per_sample);

// Does some micro-batch move rows (or their gradients) between distinct ranks? False
// exactly when the two modules have the same ranks, the same number of replicas and every
// rank in the same replica of both ("aligned"): then, with the same assignment for both,
// every piece of every plan is a local copy.
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
