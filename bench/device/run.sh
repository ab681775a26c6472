#!/usr/bin/env bash
# The device check, prepared to run in one call of the device tool on a CUDA machine with
# PyTorch (its Python and its libtorch):
#   run(command="bash bench/device/run.sh", timeout_s=540)
# 1. bench/device/reference_layers.py: the reference's TP (DTensor) and plain layers, host
#    and GPU time per layer (the planner's missing measurement; ~2-4 minutes).
# 2. Configure and build dhp against that libtorch and run its tests (CPU paths; dhp has no
#    CUDA device path yet): what breaks on libtorch 2.x.
# Everything goes to $OUT (or ./runs/device): reference_layers.{json,log}, build.log, ctest.log.
set -u
out="${OUT:-runs/device}"
mkdir -p "$out"
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$out/gpu.txt"
PYTHONUNBUFFERED=1 timeout 300 python3 bench/device/reference_layers.py --out "$out/reference_layers.json" \
  2>&1 | tee "$out/reference_layers.log"
prefix=$(python3 -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
{
  timeout 60 cmake -S . -B build-device -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" &&
    timeout 420 cmake --build build-device -j16
} >"$out/build.log" 2>&1
echo "build rc=$? (last lines of $out/build.log:)"; tail -25 "$out/build.log"
if [ -x build-device/dhp ]; then
  (cd build-device && timeout 300 ctest -j8 --timeout 120 >"../$out/ctest.log" 2>&1; echo "ctest rc=$?"; tail -15 "../$out/ctest.log")
fi
