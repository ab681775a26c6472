#include "dhp/train/checkpoint.h"

#include <torch/torch.h>

#include <algorithm>
#include <filesystem>

#include "dhp/core/error.h"
#include "dhp/core/options.h"
#include "dhp/models/qwen2_5_vl/hf.h"
#include "dhp/models/qwen2_5_vl/peft.h"
#include "dhp/train/parallel_model.h"

namespace dhp::train {
namespace {

int64_t volume(const std::vector<int64_t>& shape) {
  int64_t v = 1;
  for (auto d : shape) v *= d;
  return v;
}

torch::Tensor segment_view(const CheckpointPiece& p, const BoxSegment& s) {
  auto t = p.data.narrow(0, s.flat, volume(s.contig)).view(s.contig);
  return s.dim >= 0 ? t.narrow(s.dim, s.start, s.len) : t;
}

std::vector<std::string> candidates(const CheckpointPiece& p) {
  const auto slash = p.name.find('/');
  const std::string kind = p.name.substr(0, slash), rest = p.name.substr(slash + 1);
  if (kind == "param" && p.data.scalar_type() == torch::kFloat32) return {"master/" + rest, p.name};
  if (kind == "master") return {p.name, "param/" + rest};
  return {p.name};
}

}  // namespace

std::vector<BoxSegment> map_to_global(const std::vector<int64_t>& shape, const parallel::TpShard& tp, int64_t tp_rank,
                                      int64_t tp_size, int64_t begin, int64_t end) {
  const auto nd = static_cast<int64_t>(shape.size());
  std::vector<int64_t> local = shape;
  const int64_t d = tp.dim;
  const bool split = d >= 0 && tp_size > 1;
  int64_t block = 0, c = 0;  // a stacked block's global extent, this rank's part of it
  if (split) {
    DHP_CHECK(d < nd && tp.parts >= 1 && shape[d] % (tp.parts * tp_size) == 0, "checkpoint: dim ", d, " of shape ",
              c10::IntArrayRef(shape), " is not ", tp.parts, " block(s) divisible by tensor-parallel size ", tp_size);
    block = shape[d] / tp.parts;
    c = block / tp_size;
    local[d] = tp.parts * c;
  }
  DHP_CHECK(begin >= 0 && begin <= end && end <= volume(local), "checkpoint: element range [", begin, ", ", end,
            ") outside a local tensor of ", volume(local), " elements");
  std::vector<BoxSegment> out;
  if (begin == end) return out;
  if (nd == 0) {
    out.push_back(BoxSegment{});
    return out;
  }
  std::vector<int64_t> stride(nd, 1);
  for (int64_t k = nd - 2; k >= 0; --k) stride[k] = stride[k + 1] * local[k + 1];
  auto global_of = [&](int64_t i) { return (i / c) * block + tp_rank * c + i % c; };
  int64_t pos = begin;
  while (pos < end) {
    std::vector<int64_t> at(nd);
    for (int64_t k = 0, rem = pos; k < nd; ++k) {
      at[k] = rem / stride[k];
      rem %= stride[k];
    }
    // The outermost dim from which a box of whole trailing extents starts here and fits.
    int64_t j = nd - 1, count = 1;
    for (int64_t k = 0; k < nd; ++k) {
      if (pos % stride[k] != 0) continue;
      const int64_t n = std::min(local[k] - at[k], (end - pos) / stride[k]);
      if (n >= 1) {
        j = k;
        count = n;
        break;
      }
    }
    BoxSegment base;
    base.flat = pos - begin;
    base.contig.assign(nd, 1);
    base.contig[j] = count;
    for (int64_t k = j + 1; k < nd; ++k) base.contig[k] = local[k];
    base.offset = at;
    base.shape = base.contig;
    if (!split) {
      out.push_back(base);
    } else if (d < j) {
      base.offset[d] = global_of(at[d]);
      out.push_back(base);
    } else if (d == j) {
      for (int64_t a = at[j]; a < at[j] + count;) {
        const int64_t next = std::min(at[j] + count, (a / c + 1) * c);
        BoxSegment s = base;
        s.dim = j;
        s.start = a - at[j];
        s.len = next - a;
        s.offset[j] = global_of(a);
        s.shape[j] = s.len;
        out.push_back(std::move(s));
        a = next;
      }
    } else {
      for (int64_t b = 0; b < tp.parts; ++b) {
        BoxSegment s = base;
        s.dim = d;
        s.start = b * c;
        s.len = c;
        s.offset[d] = b * block + tp_rank * c;
        s.shape[d] = c;
        out.push_back(std::move(s));
      }
    }
    pos += count * stride[j];
  }
  return out;
}

void add_pieces(io::SliceWriter& w, const std::vector<CheckpointPiece>& pieces) {
  for (const auto& p : pieces) {
    if (!p.write) continue;
    for (const auto& s : map_to_global(p.shape, p.tp, p.tp_rank, p.tp_size, p.begin, p.begin + p.data.numel())) {
      w.add(p.name, p.shape, s.offset, segment_view(p, s));
    }
  }
}

TensorSource checkpoint_source(const io::CheckpointReader& r) {
  TensorSource s;
  s.where = r.dir();
  s.has = [&r](const std::string& n) { return r.has(n); };
  s.shape = [&r](const std::string& n) { return r.manifest().tensors.at(n).shape; };
  s.read = [&r](const std::string& n, const std::vector<int64_t>& o, const std::vector<int64_t>& sh) {
    return r.read(n, o, sh);
  };
  return s;
}

namespace {
// param/<name> of a directory of parameters by name (HF weights, PEFT adapters): anything with
// contains(name), shape(name) and read_box(name, offset, shape). Nothing else is there.
template <class Dir>
TensorSource parameter_source(const Dir& d, const std::string& where) {
  auto strip = [](const std::string& n) { return n.rfind("param/", 0) == 0 ? n.substr(6) : std::string(); };
  TensorSource s;
  s.where = where;
  s.has = [&d, strip](const std::string& n) { return !strip(n).empty() && d.contains(strip(n)); };
  s.shape = [&d, strip](const std::string& n) { return d.shape(strip(n)); };
  s.read = [&d, strip](const std::string& n, const std::vector<int64_t>& o, const std::vector<int64_t>& sh) {
    return d.read_box(strip(n), o, sh);
  };
  return s;
}
}  // namespace

TensorSource hf_source(const qwen::HfWeights& w) { return parameter_source(w, "Hugging Face model directory " + w.dir()); }

TensorSource peft_source(const qwen::PeftAdapter& a) { return parameter_source(a, "PEFT adapter directory " + a.dir()); }

void load_pieces(const TensorSource& src, const std::vector<CheckpointPiece>& pieces) {
  torch::NoGradGuard no_grad;
  for (const auto& p : pieces) {
    std::string name;
    for (const auto& n : candidates(p)) {
      if (src.has(n)) {
        name = n;
        break;
      }
    }
    DHP_CHECK(!name.empty(), src.where, ": no tensor for ", p.name,
              " (saved from another model, or without optimizer state?)");
    const auto have = src.shape(name);
    DHP_CHECK(have == p.shape, src.where, ": tensor ", name, " has shape ", c10::IntArrayRef(have),
              ", this model's is ", c10::IntArrayRef(p.shape), " (another model configuration?)");
    for (const auto& s : map_to_global(p.shape, p.tp, p.tp_rank, p.tp_size, p.begin, p.begin + p.data.numel())) {
      segment_view(p, s).copy_(src.read(name, s.offset, s.shape));
    }
  }
}

Config checkpoint_config(const io::CheckpointReader& r) {
  const std::string what = r.dir() + "/manifest.json meta";
  ConfigTree tree;
  tree.merge_text(r.manifest().meta.at("config", what).str(what + " config"), what + " config");
  // The resolved config spells out every model field: the HF directory it may have started
  // from is not needed (nor still there, perhaps).
  tree.merge_set("model.from=\"\"");
  return load_config(tree);
}

std::string checkpoint_base_model(const io::CheckpointReader& r) {
  const std::string what = r.dir() + "/manifest.json meta config";
  const YAML::Node model = YAML::Load(r.manifest().meta.at("config", what).str(what))["model"];
  return model && model["from"] ? model["from"].as<std::string>() : "";
}

std::map<std::string, torch::Tensor> checkpoint_parameters(const io::CheckpointReader& r, bool masters) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [name, rec] : r.manifest().tensors) {
    if (name.rfind("param/", 0) != 0) continue;
    const std::string p = name.substr(6), master = "master/" + p;
    out[p] = r.read_full(masters && r.has(master) ? master : name);
  }
  DHP_CHECK(!out.empty(), r.dir(), ": the checkpoint holds no parameters (param/ tensors)");
  const auto cfg = checkpoint_config(r);
  if (!cfg.model.freezing.any()) return out;
  // A fine-tuning run's checkpoint holds what trained; its frozen parameters are the run's
  // starting weights: model.from's, or the seed's initialisation.
  const std::string from = checkpoint_base_model(r);
  auto base = build_model(cfg, /*load_from=*/false);
  if (!from.empty()) {
    try {
      qwen::load_hf_weights(from, *base);
    } catch (const std::exception& e) {
      DHP_FAIL(r.dir(), " holds only the parameters that trained; the frozen ones are model.from=", from,
               "'s, which cannot be read: ", e.what());
    }
  }
  for (const auto& kv : base->named_parameters(true)) {
    if (!out.count(kv.key())) out[kv.key()] = kv.value().detach();
  }
  return out;
}

std::string find_checkpoint(const std::string& path) {
  namespace fs = std::filesystem;
  if (fs::exists(fs::path(path) / "manifest.json")) return path;
  const auto all = io::list_checkpoints(path);
  DHP_CHECK(!all.empty(), path, " is neither a checkpoint (no manifest.json) nor a directory of step-N checkpoints");
  return all.front().second;
}

}  // namespace dhp::train
