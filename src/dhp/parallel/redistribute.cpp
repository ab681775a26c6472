#include "dhp/parallel/redistribute.h"

#include <torch/torch.h>

#include <algorithm>

#include "dhp/core/error.h"

namespace dhp::parallel {
namespace {

// Ranks of each data-parallel replica of a module, in module-rank order.
std::vector<std::vector<int64_t>> replica_ranks(const dist::ModuleLayout& l) {
  std::vector<std::vector<int64_t>> out(static_cast<size_t>(l.dp));
  for (int64_t i = 0; i < l.size(); ++i) out[static_cast<size_t>(l.coord(i).dp)].push_back(l.ranks[i]);
  return out;
}

// First row of each sample (prefix sums), n + 1 entries.
std::vector<int64_t> row_offsets(const std::vector<int64_t>& rows_per_sample) {
  std::vector<int64_t> off(rows_per_sample.size() + 1, 0);
  for (size_t i = 0; i < rows_per_sample.size(); ++i) {
    DHP_CHECK(rows_per_sample[i] >= 0, "sample ", i, " has ", rows_per_sample[i], " image rows");
    off[i + 1] = off[i] + rows_per_sample[i];
  }
  return off;
}

// One direction: replicas `from` (each holding the rows of its chunk) to every rank of
// replicas `to` (each needing the rows of its chunk).
std::vector<RowPiece> plan_direction(const std::vector<std::vector<int64_t>>& from,
                                     const std::vector<std::vector<int64_t>>& to, const std::vector<int64_t>& off) {
  const int64_t n = static_cast<int64_t>(off.size()) - 1;
  const int64_t nf = static_cast<int64_t>(from.size()), nt = static_cast<int64_t>(to.size());
  std::vector<size_t> turn(from.size(), 0);  // next source rank of each replica
  std::vector<RowPiece> pieces;
  for (int64_t t = 0; t < nt; ++t) {
    const auto tc = replica_chunk(n, nt, t);
    for (int64_t dst : to[t]) {
      for (int64_t f = 0; f < nf; ++f) {
        const auto fc = replica_chunk(n, nf, f);
        const int64_t lo = std::max(tc.first, fc.first), hi = std::min(tc.second, fc.second);
        if (lo >= hi || off[hi] == off[lo]) continue;
        const auto& src_ranks = from[f];
        int64_t src = dst;
        if (std::find(src_ranks.begin(), src_ranks.end(), dst) == src_ranks.end()) {
          src = src_ranks[turn[f] % src_ranks.size()];
          ++turn[f];
        }
        pieces.push_back({src, dst, off[lo] - off[fc.first], off[lo] - off[tc.first], off[hi] - off[lo]});
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

RedistributePlan plan_redistribute(const dist::ModuleLayout& encoder, const dist::ModuleLayout& decoder,
                                   const std::vector<int64_t>& rows_per_sample) {
  const auto off = row_offsets(rows_per_sample);
  const int64_t n = static_cast<int64_t>(rows_per_sample.size());
  const auto er = replica_ranks(encoder), dr = replica_ranks(decoder);
  RedistributePlan p;
  p.forward = plan_direction(er, dr, off);
  p.backward = plan_direction(dr, er, off);
  auto rows_of = [&](const dist::ModuleLayout& m, const std::vector<std::vector<int64_t>>& replicas,
                     std::map<int64_t, int64_t>& out) {
    for (int64_t r = 0; r < m.dp; ++r) {
      const auto c = replica_chunk(n, m.dp, r);
      for (int64_t rank : replicas[static_cast<size_t>(r)]) out[rank] = off[c.second] - off[c.first];
    }
  };
  rows_of(encoder, er, p.encoder_rows);
  rows_of(decoder, dr, p.decoder_rows);
  return p;
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
