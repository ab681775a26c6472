// Vocabulary-parallel embedding and cross-entropy (Megatron): each TP rank holds the rows
// [vocab_start, vocab_start + V/tp) of the embedding / lm_head; full logits are never
// gathered. Collective over the TP group.
#pragma once

#include <torch/types.h>

#include "dhp/dist/comm.h"
#include "dhp/nn/layers.h"

namespace dhp::parallel {

// ids (L) int64 global -> (L, C): this rank looks up the ids in its range (zero rows
// elsewhere) and the rows are summed over the group. forward: masked lookup + all-reduce;
// backward: gradient to this rank's rows only.
torch::Tensor vocab_parallel_embedding(const torch::Tensor& ids, const torch::Tensor& weight_shard,
                                       int64_t vocab_start, const dist::Group& group);

// logits_shard (n, V/tp) [sharded over vocab], targets (n) global ids -> per-token
// cross-entropy (n), fp32, identical on every rank. Uses the global max and sum of exp
// (all-reduces of n numbers), never the full logits.
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& logits_shard, const torch::Tensor& targets,
                                           int64_t vocab_start, const dist::Group& group);

// The embedding of a model cut to this rank's vocabulary rows [vocab_start, +V/tp) of the
// full one (parameter "weight", the shard); forward: vocab_parallel_embedding.
class VocabParallelEmbeddingImpl : public nn::EmbeddingImpl {
 public:
  VocabParallelEmbeddingImpl(const nn::EmbeddingImpl& full, dist::Group group);
  torch::Tensor forward(const torch::Tensor& ids) override;
  dist::Group group;
  int64_t vocab_start = 0;
};

// The loss head over a vocabulary-sharded output weight (rows [vocab_start, +V/tp)):
// logits shard = copy_to(h) W_shard^T, then vocab_parallel_cross_entropy, summed.
class VocabParallelCrossEntropyHeadImpl : public nn::CrossEntropyHeadImpl {
 public:
  VocabParallelCrossEntropyHeadImpl(dist::Group group, int64_t vocab_start);
  torch::Tensor forward(const torch::Tensor& h, const torch::Tensor& targets, const torch::Tensor& weight) override;
  dist::Group group;
  int64_t vocab_start = 0;
};

}  // namespace dhp::parallel
