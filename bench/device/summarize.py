#!/usr/bin/env python3
"""The device run's measured figures as one JSON (bench/device/run.sh, last step).

Reads the results.json of `dhp bench` runs on one GPU (one process each) and writes, per
(model, vision patches per image): step time, model FLOP/s (dhp's count: forward + backward
of every linear and attention product, train/flops.h), MFU against the GPU's dense bf16
peak, peak GPU memory (the CUDA caching allocator's, per rank), and what failed. The peak
comes from the GPU's name (datasheet figures, dense, no sparsity); an unknown GPU gets
no MFU, never a guessed one.

    python3 bench/device/summarize.py --gpu "NVIDIA H100 80GB HBM3" out/bench_*/results.json
"""
import argparse
import json
import sys

# Dense bf16 tensor-core peaks, FLOP/s, by a substring of nvidia-smi's name (first match).
DENSE_BF16_PEAK = [
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100 NVL", 835.0e12),
    ("H100", 989.4e12),  # SXM (HBM3)
    ("A100", 312.0e12),
]


def peak_for(gpu):
    for key, peak in DENSE_BF16_PEAK:
        if key in gpu:
            return peak
    return None


def rows(results, peak):
    preset = results.get("model", {}).get("preset", "?")
    nproc = results.get("settings", {}).get("nproc", 1)
    for p in results.get("points", []):
        row = {
            "model": preset,
            "point": p.get("strategy"),
            "vision_tokens": p.get("vision_tokens"),
            "batch_size": p.get("batch_size"),
            "oom": p.get("oom", False),
        }
        if "error" in p:
            row["error"] = p["error"]
        if "step_time_s" in p and p["step_time_s"] > 0:
            flops_per_s = p["model_flops_per_step"] / p["step_time_s"] / nproc
            row.update({
                "step_time_s": p["step_time_s"],
                "model_tflops_per_gpu": flops_per_s / 1e12,
                "mfu": flops_per_s / peak if peak else None,
                "peak_gib_per_rank": [b / 2**30 for b in p.get("peak_bytes_per_rank", [])],
            })
        yield row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", required=True, help="the GPU's name, as nvidia-smi prints it")
    ap.add_argument("results", nargs="*", help="results.json files of dhp bench")
    a = ap.parse_args()
    peak = peak_for(a.gpu)
    out = {"gpu": a.gpu, "dense_bf16_peak_tflops": peak / 1e12 if peak else None, "runs": [], "unreadable": []}
    for path in a.results:
        try:
            with open(path) as f:
                out["runs"].extend(rows(json.load(f), peak))
        except (OSError, ValueError) as e:
            out["unreadable"].append({"path": path, "error": str(e)})
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
