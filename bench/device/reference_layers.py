#!/usr/bin/env python3
"""Per-layer time of the reference system's layers on one GPU: the measurement that the
planner's reference study lacks (docs/cost_model.md, "Against the reference's published
study"). Runs on a CUDA machine with torch >= 2.4 (DTensor public API); not part of the
test suite (this project's CI has no GPU).

The reference (ray-project/multimodal-training) runs its tensor-parallel vision blocks and
text layers as PyTorch DTensor modules (`parallelize_module` with ColwiseParallel on q, k, v,
gate, up and RowwiseParallel on the output projections), eager, with activation
checkpointing. On a 1280-wide ViT the host's per-operator cost can exceed the GPU's work, so
the step is host-bound. This script times one layer's forward + recomputation + backward:

  plain   : the same layer as plain modules (eager, no DTensor)
  dtensor : the layer after parallelize_module on a one-device mesh

each at the per-rank shapes of 8-way tensor parallelism (weights sliced as the reference's
TP8 slices them; DTensor's sharding propagation and hooks run as on 8 ranks, its
collectives are no-ops on one device) and, for the vision, the per-rank shapes of 8-way
Ulysses (full weights, an eighth of the patches). Also the DTensor-level operator count per
layer (a TorchDispatchMode) and the host time to enqueue a layer with tiny inputs (GPU idle),
so that host time per layer and GPU time per layer can enter the model separately.

  python3 bench/device/reference_layers.py [--out FILE] [--quick]

Writes JSON (default $OUT/reference_layers.json or ./reference_layers.json) and prints a table.
"""
import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt

# Qwen2.5-VL-32B (its config.json): vision 32 blocks of 1280 (16 heads, MLP 3420, windows of
# 8x8 patches, full attention in blocks 7, 15, 23, 31); text 64 layers of 5120 (40 heads, 8 kv
# heads, MLP 27648).
VISION = dict(hidden=1280, heads=16, inter=3420, window=64)
TEXT = dict(hidden=5120, heads=40, kv_heads=8, inter=27648)
TP = 8
IMAGES = 8          # the reference's batch of 8 samples, one image each
TEXT_TOKENS = 64    # besides the image's merged tokens


def shard(n, k=TP):
    """Rows of one rank's slice under torch.chunk semantics (DTensor's Shard)."""
    return -(-n // k)


def rms_norm(x, w, eps=1e-6):
    v = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(v + eps)).to(x.dtype) * w


def rotate(x, cos, sin):
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class VisionBlock(nn.Module):
    """A Qwen2.5-VL vision block as the reference builds it (separate q, k, v)."""

    def __init__(self, hidden, q_out, inter_out, head_dim):
        super().__init__()
        self.head_dim = head_dim
        self.norm1 = nn.Parameter(torch.ones(hidden))
        self.norm2 = nn.Parameter(torch.ones(hidden))
        self.q_proj = nn.Linear(hidden, q_out)
        self.k_proj = nn.Linear(hidden, q_out)
        self.v_proj = nn.Linear(hidden, q_out)
        self.proj = nn.Linear(q_out, hidden)
        self.gate_proj = nn.Linear(hidden, inter_out)
        self.up_proj = nn.Linear(hidden, inter_out)
        self.down_proj = nn.Linear(inter_out, hidden)

    def forward(self, x, cos, sin, segment):
        n = x.shape[0]
        h = rms_norm(x, self.norm1)
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        heads = q.shape[-1] // self.head_dim  # the heads this rank holds
        q, k, v = (t.view(n, heads, self.head_dim) for t in (q, k, v))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        # Segments (windows or whole images) as a batch: (segments, heads, len, dim).
        q, k, v = (t.view(n // segment, segment, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v)
        o = o.transpose(1, 2).reshape(n, heads * self.head_dim)
        x = x + self.proj(o)
        h = rms_norm(x, self.norm2)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TextLayer(nn.Module):
    """A Qwen2 decoder layer (GQA, q/k/v with bias, o without)."""

    def __init__(self, hidden, q_out, kv_out, inter_out, head_dim):
        super().__init__()
        self.head_dim = head_dim
        self.norm1 = nn.Parameter(torch.ones(hidden))
        self.norm2 = nn.Parameter(torch.ones(hidden))
        self.q_proj = nn.Linear(hidden, q_out)
        self.k_proj = nn.Linear(hidden, kv_out)
        self.v_proj = nn.Linear(hidden, kv_out)
        self.o_proj = nn.Linear(q_out, hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, inter_out, bias=False)
        self.up_proj = nn.Linear(hidden, inter_out, bias=False)
        self.down_proj = nn.Linear(inter_out, hidden, bias=False)

    def forward(self, x, cos, sin, segment):
        n = x.shape[0]
        h = rms_norm(x, self.norm1)
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        hq, hk = q.shape[-1] // self.head_dim, k.shape[-1] // self.head_dim
        q = rotate(q.view(n, hq, self.head_dim), cos, sin)
        k = rotate(k.view(n, hk, self.head_dim), cos, sin)
        v = v.view(n, hk, self.head_dim)
        q = q.view(n // segment, segment, hq, self.head_dim).transpose(1, 2)
        k, v = (t.view(n // segment, segment, hk, self.head_dim).transpose(1, 2) for t in (k, v))
        k, v = (t.repeat_interleave(hq // hk, dim=1) for t in (k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = o.transpose(1, 2).reshape(n, hq * self.head_dim)
        x = x + self.o_proj(o)
        h = rms_norm(x, self.norm2)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def tp_mapping(kind):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    out = "proj" if kind == "vision" else "o_proj"
    return {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
            out: RowwiseParallel(), "gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
            "down_proj": RowwiseParallel()}


def make_layers(kind, strategy, n_layers, mesh, device):
    """n_layers layers at one rank's shapes under `strategy` (tp or sp), DTensor when mesh."""
    layers = []
    for _ in range(n_layers):
        if kind == "vision":
            d = VISION["hidden"] // VISION["heads"]
            if strategy == "tp":
                m = VisionBlock(VISION["hidden"], VISION["hidden"] // TP, shard(VISION["inter"]), d)
            else:
                m = VisionBlock(VISION["hidden"], VISION["hidden"], VISION["inter"], d)
        else:
            d = TEXT["hidden"] // TEXT["heads"]
            m = TextLayer(TEXT["hidden"], TEXT["hidden"] // TP, TEXT["kv_heads"] * d // TP, shard(TEXT["inter"]), d)
        m = m.to(device=device, dtype=torch.bfloat16)
        if mesh is not None:
            from torch.distributed.tensor.parallel import parallelize_module
            parallelize_module(m, mesh, tp_mapping(kind))
        layers.append(m)
    return layers


def run_step(layers, x, cos, sin, segment):
    h = x
    for m in layers:
        h = ckpt.checkpoint(m, h, cos, sin, segment, use_reentrant=False)
    h.float().square().mean().backward()


def inputs(kind, tokens, segment, device):
    hidden = VISION["hidden"] if kind == "vision" else TEXT["hidden"]
    d = hidden // (VISION["heads"] if kind == "vision" else TEXT["heads"])
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    ang = torch.rand(tokens, 1, d // 2, device=device)
    cos = torch.cat((ang.cos(), ang.cos()), -1).to(torch.bfloat16)
    sin = torch.cat((ang.sin(), ang.sin()), -1).to(torch.bfloat16)
    return x, cos, sin


def time_layers(layers, x, cos, sin, segment, reps):
    """Median seconds per layer of forward + recompute + backward, and the host's share:
    the time until the last kernel is enqueued (wall when host-bound)."""
    for _ in range(2):
        run_step(layers, x, cos, sin, segment)
    torch.cuda.synchronize()
    walls, hosts = [], []
    for _ in range(reps):
        for m in layers:
            m.zero_grad(set_to_none=True)
        x.grad = None
        t0 = time.perf_counter()
        run_step(layers, x, cos, sin, segment)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        walls.append((t2 - t0) / len(layers))
        hosts.append((t1 - t0) / len(layers))
    walls.sort()
    hosts.sort()
    return walls[len(walls) // 2], hosts[len(hosts) // 2]


def count_ops(layers, x, cos, sin, segment):
    """Operators dispatched per layer (at the level a TorchDispatchMode sees: DTensor ops
    count once, not their local kernels)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        run_step(layers, x, cos, sin, segment)
    torch.cuda.synchronize()
    return Count.n / len(layers)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "reference_layers.json"))
    ap.add_argument("--quick", action="store_true", help="fewer lengths and repetitions")
    ap.add_argument("--layers", type=int, default=4, help="layers stacked per measurement")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("reference_layers.py: needs a CUDA device")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))
    reps = 3 if a.quick else 5
    lengths = [1024, 4096] if a.quick else [1024, 4096, 9216, 16384]
    result = dict(torch=torch.__version__, device=torch.cuda.get_device_name(device), tp=TP, images=IMAGES,
                  layers_stacked=a.layers, rows=[])
    print(f"torch {torch.__version__} on {result['device']}; per layer: fwd + recompute + bwd, bf16")
    print(f"{'module':7} {'strategy':8} {'patches':>7} {'tokens':>6} {'seg':>5} {'impl':8} "
          f"{'wall ms':>8} {'host ms':>8} {'ops':>6}")

    def measure(kind, strategy, patches, tokens, segment, impl):
        row = dict(module=kind, strategy=strategy, patches=patches, tokens=tokens, segment=segment, impl=impl)
        try:
            layers = make_layers(kind, strategy, a.layers, mesh if impl == "dtensor" else None, device)
            x, cos, sin = inputs(kind, tokens, segment, device)
            row["wall_s"], row["host_s"] = time_layers(layers, x, cos, sin, segment, reps)
            try:
                row["ops"] = count_ops(layers, x, cos, sin, segment)
            except Exception as e:  # the times stand without the count
                row["ops_error"] = f"{type(e).__name__}: {e}"
                row["ops"] = None
            del layers, x
            torch.cuda.empty_cache()
        except Exception as e:  # keep going: a partial table is still worth bringing back
            row["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        result["rows"].append(row)
        if "error" in row:
            print(f"{kind:7} {strategy:8} {patches:7} {tokens:6} {segment:5} {impl:8} error: {row['error'][:80]}")
        else:
            print(f"{kind:7} {strategy:8} {patches:7} {tokens:6} {segment:5} {impl:8} "
                  f"{1e3 * row['wall_s']:8.2f} {1e3 * row['host_s']:8.2f} {row['ops'] if row['ops'] is None else round(row['ops']):>6}")
        sys.stdout.flush()
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)

    # Host cost alone: tiny inputs (one 64-token segment), the GPU idle.
    for kind in ("vision", "text"):
        for impl in ("plain", "dtensor"):
            measure(kind, "tp", 0, 64, 64, impl)
    measure("vision", "sp", 0, 64, 64, "plain")  # Ulysses' plain vision block: whole weights
    for n in lengths:
        # Vision under TP8: every rank all 8 images, its slice of the weights; window and full layers.
        for seg, what in ((VISION["window"], "window"), (n, "full")):
            for impl in ("plain", "dtensor"):
                measure("vision", "tp", n, IMAGES * n, seg, impl)
        # Vision under Ulysses SP8, window layers: whole weights, an eighth of the patches.
        measure("vision", "sp", n, IMAGES * n // TP, VISION["window"], "plain")
        # Text under TP8: 8 samples of n/4 image tokens + 64 text tokens, causal.
        L = n // 4 + TEXT_TOKENS
        L = (L + 7) // 8 * 8
        for impl in ("plain", "dtensor"):
            measure("text", "tp", n, IMAGES * L, L, impl)
    print(f"wrote {a.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
