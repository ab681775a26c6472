#!/usr/bin/python3
"""What qwen-vl-utils' fetch_video and Hugging Face's Qwen2.5-VL processor make of one video,
computed independently of dhp with PyAV, torch and torchvision (Debian's python3-av,
python3-torch, python3-torchvision), following their published steps:

  decode every frame with PyAV (as torchvision.io.read_video does), frame rate = the
  stream's average rate; the frame range of video_start / video_end; smart_nframes;
  indices = torch.linspace(first, last, n).round(); torchvision resize (BICUBIC,
  antialias=True) of the uint8 frames to smart_resize(factor 28) within [min_pixels,
  max(min(768*28*28, total_pixels / n * 2), int(min_pixels * 1.05))] (capped by a given
  max_pixels); then the processor: rescale 1/255 in float64 stored as float32, normalise in
  float32, 2 frames per temporal patch, patches in merge-window order; second_per_grid_ts =
  2 / sample_fps.

    /usr/bin/python3 scripts/video_reference.py CLIP OUT.safetensors [--fps F | --nframes N]
        [--video-start S] [--video-end E] [--min-pixels A] [--max-pixels B] [--total-pixels T]

Writes pixel_values_videos, video_grid_thw, second_per_grid_ts, frame_indices and the resized
uint8 frames (resized_frames, [n, H, W, 3]); tests/test_video.cpp compares dhp's with them.
"""
import argparse
import json
import math
import struct
from pathlib import Path

import av
import numpy as np
import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

MEAN = [0.48145466, 0.4578275, 0.40821073]
STD = [0.26862954, 0.26130258, 0.27577711]
PATCH, MERGE, TEMPORAL, FACTOR = 14, 2, 2, 28


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    names = {np.dtype(np.uint8): "U8", np.dtype(np.float32): "F32", np.dtype(np.int64): "I64"}
    for name, a in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def by_factor(x, f, how):
    return {"round": round, "ceil": math.ceil, "floor": math.floor}[how](x / f) * f


def smart_resize(height, width, min_pixels, max_pixels):
    h = max(FACTOR, by_factor(height, FACTOR, "round"))
    w = max(FACTOR, by_factor(width, FACTOR, "round"))
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(FACTOR, by_factor(height / beta, FACTOR, "floor"))
        w = max(FACTOR, by_factor(width / beta, FACTOR, "floor"))
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = by_factor(height * beta, FACTOR, "ceil")
        w = by_factor(width * beta, FACTOR, "ceil")
    return h, w


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("clip")
    ap.add_argument("out")
    ap.add_argument("--fps", type=float)
    ap.add_argument("--nframes", type=int)
    ap.add_argument("--video-start", type=float)
    ap.add_argument("--video-end", type=float)
    ap.add_argument("--min-pixels", type=float, default=128 * 28 * 28)
    ap.add_argument("--max-pixels", type=float)
    ap.add_argument("--total-pixels", type=float, default=int(128000 * 28 * 28 * 0.9))
    a = ap.parse_args()

    with av.open(a.clip) as container:
        stream = container.streams.video[0]
        video_fps = float(stream.average_rate)
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
    total = len(frames)

    first, last = 0, total - 1
    if a.video_start is not None or a.video_end is not None:
        duration = total / video_fps
        if a.video_start is not None:
            first = math.ceil(max(0.0, min(a.video_start, duration)) * video_fps)
        if a.video_end is not None:
            last = min(math.floor(max(0.0, min(a.video_end, duration)) * video_fps), total - 1)
        assert first < last, "empty range"
    count = last - first + 1

    if a.nframes is not None:
        n = by_factor(a.nframes, 2, "round")
    else:
        fps = a.fps if a.fps is not None else 2.0
        min_frames = by_factor(4, 2, "ceil")
        max_frames = by_factor(min(768, count), 2, "floor")
        x = count / video_fps * fps
        x = min(min(max(x, min_frames), max_frames), count)
        n = by_factor(x, 2, "floor")
    assert 2 <= n <= count, f"nframes {n} of {count}"
    idx = torch.linspace(first, last, n).round().long()
    sample_fps = n / max(count, 1e-6) * video_fps

    video = torch.from_numpy(np.stack(frames))[idx].permute(0, 3, 1, 2)  # n, 3, H, W uint8
    height, width = video.shape[2], video.shape[3]
    max_pixels = max(min(768 * 28 * 28, a.total_pixels / n * 2), int(a.min_pixels * 1.05))
    if a.max_pixels is not None:
        max_pixels = min(a.max_pixels, max_pixels)
    h, w = smart_resize(height, width, a.min_pixels, max_pixels)
    video = TF.resize(video, [h, w], interpolation=InterpolationMode.BICUBIC, antialias=True)
    resized = video.permute(0, 2, 3, 1).contiguous().numpy()  # n, H, W, 3 uint8

    x = (video.numpy().astype(np.float64) * (1 / 255)).astype(np.float32)
    x = (x - np.array(MEAN, np.float32)[None, :, None, None]) / np.array(STD, np.float32)[None, :, None, None]
    x = x.astype(np.float32)
    gt, gh, gw = n // TEMPORAL, h // PATCH, w // PATCH
    x = x.reshape(gt, TEMPORAL, 3, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gt * gh * gw, 3 * TEMPORAL * PATCH * PATCH)
    seconds = np.array(torch.tensor([TEMPORAL / sample_fps]).numpy(), np.float32)  # the processor's tensor

    write_safetensors(a.out, {
        "pixel_values_videos": np.ascontiguousarray(x),
        "video_grid_thw": np.array([[gt, gh, gw]], np.int64),
        "second_per_grid_ts": seconds,
        "frame_indices": idx.numpy().astype(np.int64),
        "resized_frames": resized,
    })
    print(f"{a.clip}: {total} frames at {video_fps:.4f} fps -> {n} frames at {sample_fps:.4f} fps, {w}x{h}")


if __name__ == "__main__":
    main()
