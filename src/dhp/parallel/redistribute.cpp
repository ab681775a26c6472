#include "dhp/parallel/redistribute.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "dhp/core/error.h"

namespace dhp::parallel {
namespace {

// Ranks of each data-parallel replica of a module, in module-rank order.
std::vector<std::vector<int64_t>> replica_ranks(const dist::ModuleLayout& l) {
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(l.dp));
  for (int64_t i = 0; i < l.size(); ++i) out[static_cast<size_t>(l.coord(i).dp)].push_back(l.ranks[i]);
  return out;
}

// Where each sample's rows sit under an assignment: its replica and its first row there.
struct RowHome {
  std::vector<int64_t> replica, row;
};
RowHome row_homes(const ReplicaSamples& a, const std::vector<int64_t>& rows_per_sample) {
  const auto n = rows_per_sample.size();
  RowHome h{std::vector<int64_t>(n, -1), std::vector<int64_t>(n, 0)};
  for (size_t r = 0; r < a.size(); ++r) {
    int64_t at = 0;
    for (auto i : a[r]) {
      DHP_CHECK(i >= 0 && static_cast<size_t>(i) < n && h.replica[static_cast<size_t>(i)] < 0, "redistribute: sample ",
                i, " of a micro-batch of ", n, " is assigned twice or does not exist");
      h.replica[static_cast<size_t>(i)] = static_cast<int64_t>(r);
      h.row[static_cast<size_t>(i)] = at;
      at += rows_per_sample[static_cast<size_t>(i)];
    }
  }
  for (size_t i = 0; i < n; ++i) DHP_CHECK(h.replica[i] >= 0, "redistribute: sample ", i, " has no replica");
  return h;
}

// One direction: replicas `from` (each holding the rows of its samples) to every rank of
// replicas `to` (each needing the rows of its samples).
std::vector<RowPiece> plan_direction(const std::vector<std::vector<int64_t>>& from, const ReplicaSamples& from_samples,
                                     const std::vector<std::vector<int64_t>>& to, const ReplicaSamples& to_samples,
                                     const std::vector<int64_t>& rows_per_sample) {
  DHP_CHECK(from.size() == from_samples.size() && to.size() == to_samples.size(), "redistribute: an assignment has ",
            from_samples.size(), " and ", to_samples.size(), " replicas for modules of ", from.size(), " and ",
            to.size());
  const auto home = row_homes(from_samples, rows_per_sample);
  row_homes(to_samples, rows_per_sample);  // checks the destination's assignment too
  std::vector<size_t> turn(from.size(), 0);  // next source rank of each replica
  std::vector<RowPiece> pieces;
  for (size_t t = 0; t < to.size(); ++t) {
    for (int64_t dst : to[t]) {
      std::map<int64_t, int64_t> source;  // source replica -> the rank that sends to dst
      int64_t dst_row = 0;
      for (auto i : to_samples[t]) {
        const int64_t rows = rows_per_sample[static_cast<size_t>(i)];
        if (rows == 0) continue;
        const int64_t f = home.replica[static_cast<size_t>(i)], src_row = home.row[static_cast<size_t>(i)];
        auto it = source.find(f);
        if (it == source.end()) {
          const auto& src_ranks = from[static_cast<size_t>(f)];
          int64_t src = dst;
          if (std::find(src_ranks.begin(), src_ranks.end(), dst) == src_ranks.end()) {
            src = src_ranks[turn[static_cast<size_t>(f)] % src_ranks.size()];
            ++turn[static_cast<size_t>(f)];
          }
          it = source.emplace(f, src).first;
        }
        auto* last = pieces.empty() ? nullptr : &pieces.back();
        if (last && last->src == it->second && last->dst == dst && last->src_row + last->rows == src_row &&
            last->dst_row + last->rows == dst_row) {
          last->rows += rows;
        } else {
          pieces.push_back({it->second, dst, src_row, dst_row, rows});
        }
        dst_row += rows;
      }
    }
  }
  return pieces;
}

}  // namespace

std::pair<int64_t, int64_t> replica_chunk(int64_t n, int64_t replicas, int64_t r) {
  TORCH_INTERNAL_ASSERT(replicas >= 1 && r >= 0 && r < replicas);
  const int64_t base = n / replicas, rem = n % replicas;
  const int64_t begin = r * base + std::min(r, rem);
  return {begin, begin + base + (r < rem ? 1 : 0)};
}

ReplicaSamples contiguous_replicas(int64_t n, int64_t replicas) {
  ReplicaSamples out(static_cast<size_t>(replicas));
  for (int64_t r = 0; r < replicas; ++r) {
    const auto c = replica_chunk(n, replicas, r);
    for (int64_t i = c.first; i < c.second; ++i) out[static_cast<size_t>(r)].push_back(i);
  }
  return out;
}

ReplicaSamples balanced_replicas(const std::vector<double>& cost, int64_t replicas, const std::vector<bool>& first) {
  DHP_CHECK(replicas >= 1, "balanced_replicas: ", replicas, " replicas");
  DHP_CHECK(first.empty() || first.size() == cost.size(), "balanced_replicas: ", first.size(), " flags for ",
            cost.size(), " samples");
  const auto n = static_cast<int64_t>(cost.size());
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    DHP_CHECK(std::isfinite(cost[static_cast<size_t>(i)]) && cost[static_cast<size_t>(i)] >= 0, "sample ", i,
              " has cost ", cost[static_cast<size_t>(i)]);
    order[static_cast<size_t>(i)] = i;
  }
  auto early = [&](int64_t i) { return !first.empty() && first[static_cast<size_t>(i)]; };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    if (early(a) != early(b)) return early(a);
    return cost[static_cast<size_t>(a)] > cost[static_cast<size_t>(b)];
  });
  ReplicaSamples out(static_cast<size_t>(replicas));
  std::vector<double> load(static_cast<size_t>(replicas), 0.0);
  for (auto i : order) {
    size_t best = 0;
    for (size_t r = 1; r < out.size(); ++r) {
      if (load[r] < load[best] || (load[r] == load[best] && out[r].size() < out[best].size())) best = r;
    }
    out[best].push_back(i);
    load[best] += cost[static_cast<size_t>(i)];
  }
  for (auto& r : out) std::sort(r.begin(), r.end());
  return out;
}

RedistributePlan plan_redistribute(const dist::ModuleLayout& encoder, const ReplicaSamples& encoder_samples,
                                   const dist::ModuleLayout& decoder, const ReplicaSamples& decoder_samples,
                                   const std::vector<int64_t>& rows_per_sample) {
  for (size_t i = 0; i < rows_per_sample.size(); ++i) {
    DHP_CHECK(rows_per_sample[i] >= 0, "sample ", i, " has ", rows_per_sample[i], " image rows");
  }
  const auto er = replica_ranks(encoder), dr = replica_ranks(decoder);
  RedistributePlan p;
  p.forward = plan_direction(er, encoder_samples, dr, decoder_samples, rows_per_sample);
  p.backward = plan_direction(dr, decoder_samples, er, encoder_samples, rows_per_sample);
  auto rows_of = [&](const ReplicaSamples& a, const std::vector<std::vector<int64_t>>& replicas,
                     std::map<int64_t, int64_t>& out) {
    for (size_t r = 0; r < a.size(); ++r) {
      int64_t rows = 0;
      for (auto i : a[r]) rows += rows_per_sample[static_cast<size_t>(i)];
      for (int64_t rank : replicas[r]) out[rank] = rows;
    }
  };
  rows_of(encoder_samples, er, p.encoder_rows);
  rows_of(decoder_samples, dr, p.decoder_rows);
  return p;
}

RedistributePlan plan_redistribute(const dist::ModuleLayout& encoder, const dist::ModuleLayout& decoder,
                                   const std::vector<int64_t>& rows_per_sample) {
  const auto n = static_cast<int64_t>(rows_per_sample.size());
  return plan_redistribute(encoder, contiguous_replicas(n, encoder.dp), decoder, contiguous_replicas(n, decoder.dp),
                           rows_per_sample);
}

bool moves_between_ranks(const dist::ModuleLayout& encoder, const dist::ModuleLayout& decoder) {
  if (encoder.dp != decoder.dp || encoder.size() != decoder.size()) return true;
  for (int64_t i = 0; i < encoder.size(); ++i) {
    const int64_t j = decoder.module_rank(encoder.ranks[static_cast<size_t>(i)]);
    if (j < 0 || encoder.coord(i).dp != decoder.coord(j).dp) return true;
  }
  return false;
}

namespace {

// This rank's outgoing pieces (src == rank != dst): rows of `from`, each with its destination.
std::vector<std::pair<torch::Tensor, int64_t>> outgoing(const std::vector<RowPiece>& pieces,
                                                        const torch::Tensor& from, int64_t rank) {
  std::vector<std::pair<torch::Tensor, int64_t>> out;
  for (const auto& p : pieces) {
    if (p.src != rank || p.dst == rank) continue;
    DHP_CHECK(from.defined() && from.size(0) >= p.src_row + p.rows, "redistribute: rank ", rank, " must send rows [",
              p.src_row, ", ", p.src_row + p.rows, ") to rank ", p.dst, " but holds ",
              from.defined() ? from.size(0) : 0);
    out.emplace_back(from.detach().narrow(0, p.src_row, p.rows).contiguous(), p.dst);
  }
  return out;
}

}  // namespace

void send_pieces(const std::vector<RowPiece>& pieces, const torch::Tensor& from, const dist::Group& job,
                 int64_t rank, int64_t tag) {
  for (const auto& [t, dst] : outgoing(pieces, from, rank)) job.send(t, dst, tag);
}

torch::Tensor exchange_pieces(const std::vector<RowPiece>& pieces, bool send, const torch::Tensor& local, int64_t rows,
                              int64_t cols, const torch::TensorOptions& options, const dist::Group& group,
                              int64_t rank, int64_t tag) {
  std::vector<std::pair<torch::Tensor, int64_t>> recvs;
  const auto sends = send ? outgoing(pieces, local, rank) : std::vector<std::pair<torch::Tensor, int64_t>>();
  std::vector<const RowPiece*> mine;
  for (const auto& p : pieces)
    if (p.dst == rank) mine.push_back(&p);
  // Already where it is needed: no copy.
  if (sends.empty() && mine.size() == 1 && mine[0]->src == rank && local.defined() && mine[0]->src_row == 0 &&
      mine[0]->dst_row == 0 && mine[0]->rows == rows && local.size(0) == rows) {
    return local.detach();
  }
  auto out = torch::zeros({rows, cols}, options);
  for (const auto* p : mine) {
    DHP_CHECK(p->dst_row + p->rows <= rows, "redistribute: rank ", rank, " gets rows [", p->dst_row, ", ",
              p->dst_row + p->rows, ") of only ", rows);
    auto dst = out.narrow(0, p->dst_row, p->rows);  // contiguous: rows of a row-major tensor
    if (p->src == rank) {
      DHP_CHECK(local.defined() && local.size(0) >= p->src_row + p->rows, "redistribute: rank ", rank,
                " has no local rows [", p->src_row, ", ", p->src_row + p->rows, ")");
      dst.copy_(local.detach().narrow(0, p->src_row, p->rows));
    } else {
      recvs.emplace_back(dst, p->src);
    }
  }
  group.exchange(sends, recvs, tag);
  return out;
}

torch::Tensor recv_pieces(const std::vector<RowPiece>& pieces, const torch::Tensor& local, int64_t rows,
                          int64_t cols, const torch::TensorOptions& options, const dist::Group& job,
                          int64_t rank, int64_t tag) {
  return exchange_pieces(pieces, /*send=*/false, local, rows, cols, options, job, rank, tag);
}

}  // namespace dhp::parallel
