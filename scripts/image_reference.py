#!/usr/bin/python3
"""Writes the test images of tests/test_image.cpp and what Hugging Face's Qwen2-VL image
processor makes of them, computed with Pillow and numpy (Debian's python3-pil,
python3-numpy) following transformers' steps: load_image (EXIF transpose), convert_to_rgb
(alpha over white), smart_resize, PIL bicubic resize (reducing_gap=None), rescale 1/255 in
float64 stored as float32, normalise in float32, repeat to 2 frames, patches in merge-window
order. Run once by hand; the outputs are committed:
    /usr/bin/python3 scripts/image_reference.py tests/data/images
"""
import json
import math
import struct
import sys
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

MEAN = [0.48145466, 0.4578275, 0.40821073]
STD = [0.26862954, 0.26130258, 0.27577711]


def smart_resize(height, width, factor, min_pixels, max_pixels):
    if max(height, width) / min(height, width) > 200:
        raise ValueError("aspect")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def process(path, min_pixels, max_pixels):
    img = ImageOps.exif_transpose(Image.open(path))
    if img.mode != "RGB":
        rgba = img.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, (255, 255, 255))
        img = Image.alpha_composite(bg, rgba).convert("RGB")
    h, w = smart_resize(img.height, img.width, 28, min_pixels, max_pixels)
    resized = np.array(img.resize((w, h), resample=Image.BICUBIC, reducing_gap=None))
    x = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)
    x = (x - np.array(MEAN, dtype=np.float32)) / np.array(STD, dtype=np.float32)
    x = x.transpose(2, 0, 1)
    frames = np.stack([x, x])
    gh, gw = h // 14, w // 14
    p = frames.reshape(1, 2, 3, gh // 2, 2, 14, gw // 2, 2, 14).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return resized, p.reshape(gh * gw, 3 * 2 * 14 * 14), np.array([1, gh, gw], dtype=np.int64)


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


def main(out):
    out = Path(out)
    rng = np.random.default_rng(5)

    def picture(w, h):
        yy, xx = np.mgrid[0:h, 0:w]
        base = np.stack([xx * 255 // max(1, w - 1), yy * 255 // max(1, h - 1), (xx + yy) * 127 // max(1, w + h - 2)], -1)
        noise = rng.integers(-40, 41, size=(h, w, 3))
        return np.clip(base + noise, 0, 255).astype(np.uint8)

    cases = {}
    Image.fromarray(picture(100, 75)).save(out / "rgb_up.png")
    cases["rgb_up.png"] = (3136, 12845056)
    Image.fromarray(picture(300, 200)).save(out / "rgb_down.jpg", quality=90)
    cases["rgb_down.jpg"] = (3136, 28 * 28 * 16)
    Image.fromarray(picture(64, 48)[:, :, 0]).save(out / "grey.png")
    cases["grey.png"] = (3136, 12845056)
    rgba = np.concatenate([picture(80, 60), rng.integers(0, 256, size=(60, 80, 1)).astype(np.uint8)], -1)
    Image.fromarray(rgba, "RGBA").save(out / "rgba.png")
    cases["rgba.png"] = (3136, 12845056)
    la = np.stack([picture(50, 40)[:, :, 1], rng.integers(0, 256, size=(40, 50)).astype(np.uint8)], -1)
    Image.fromarray(la, "LA").save(out / "la.png")
    cases["la.png"] = (3136, 12845056)
    pal = Image.fromarray(picture(70, 70)).quantize(16)
    pal.info["transparency"] = 3
    pal.save(out / "palette.png", transparency=3)
    cases["palette.png"] = (3136, 12845056)
    im = Image.fromarray(picture(90, 60))
    exif = Image.Exif()
    exif[0x0112] = 6
    im.save(out / "exif6.jpg", quality=92, exif=exif.tobytes())
    cases["exif6.jpg"] = (3136, 12845056)
    Image.fromarray(picture(420, 280)).save(out / "big_down.png")
    cases["big_down.png"] = (3136, 28 * 28 * 20)

    tensors = {}
    for name, (lo, hi) in cases.items():
        resized, pixels, grid = process(out / name, lo, hi)
        tensors[name + ".resized"] = resized
        tensors[name + ".pixel_values"] = pixels.astype(np.float32)
        tensors[name + ".grid"] = grid
        tensors[name + ".pixels"] = np.array([lo, hi], dtype=np.int64)
    write_safetensors(out / "expected.safetensors", tensors)


if __name__ == "__main__":
    main(sys.argv[1])
