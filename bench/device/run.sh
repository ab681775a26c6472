#!/usr/bin/env bash
# The device check, prepared to run in one call of the device tool on a CUDA machine with
# PyTorch (its Python and its libtorch) and no package registry:
#   bash bench/device/fetch_deps.sh            # here, once: Debian 12 .debs of dhp's libraries
#   run(command="bash bench/device/run.sh", carry=[".devdeps", "third_party"], timeout_s=590)
# Steps, in this order, each under a share of one deadline (DHP_DEVICE_BUDGET_S, default
# 560 s), so that what ran comes back even when a later step runs long:
# 1. The GPU, the CUDA toolkit (nvcc: CMake's Torch package needs it) and the libtorch's C++
#    ABI (dhp's Debian libraries use the C++11 one), before configuring.
# 2. Configure and build dhp against that libtorch (the carried .debs unpacked under a
#    prefix of their own, never over /), make going on past errors so that every one is seen.
# 3. The device tests (Device.CudaTrainsLikeCpu: GPU against CPU training; Device.Flash*:
#    flash against dhp's attention; Device.NcclGroupOfOne*), the parity matrix on cuda:0 over
#    Gloo (DHP_TEST_DEVICE=cuda), the demo on the GPU (training.device=cuda).
# 4. The measured figures (dhp bench on the GPU, bench/device/summarize.py -> figures.json).
# 5. bench/device/reference_layers.py: the reference's TP (DTensor) and plain layers, host
#    and GPU time per layer (the planner's missing measurement; ~1-2 minutes), alone.
# 6. Every other test (the CPU paths) in the time left: what breaks on libtorch 2.x.
# Everything goes to $OUT (or ./runs/device): gpu.txt, reference_layers.{json,log},
# build.log, ctest_device.log, ctest_parity_cuda.log, demo_cuda.log, bench_*/, figures.json,
# ctest.log. Then, here:
#   ./build/dhp plan --model qwen2.5-vl-32b --cluster h100x8 --conventions reference \
#     --vision-tokens 1024,4096,9216,16384,25600,65536 --batch-sizes 1,2,4,8 --host-times reference_layers.json
set -u
start=$SECONDS
budget=${DHP_DEVICE_BUDGET_S:-560}
left() { echo $((budget - (SECONDS - start))); }
cd "$(dirname "$0")/../.."
root=$PWD
out="${OUT:-runs/device}"
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: the test steps run from build-device/
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; 
  grep -m1 "model name" /proc/cpuinfo; python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)';
  g++ --version | head -1; cmake --version | head -1; cat /etc/os-release | head -2;
  echo "nvcc: $(nvcc --version 2>/dev/null | tail -1 || echo missing)";
  python3 -c 'import torch; print("libtorch cxx11 abi:", torch._C._GLIBCXX_USE_CXX11_ABI)'; } 2>&1 | tee "$out/gpu.txt"
# Before configuring: find_package(Torch) needs nvcc for a CUDA libtorch, and dhp's Debian
# libraries (yaml-cpp, GoogleTest) use the C++11 ABI, which the libtorch must share.
command -v nvcc >/dev/null || echo "== WARNING: no nvcc on PATH: CMake's Torch package will not configure"
grep -q "cxx11 abi: True" "$out/gpu.txt" || echo "== WARNING: this libtorch is not built with the C++11 ABI: linking with Debian's libraries will fail"


# dhp's libraries (yaml-cpp, ICU, libjpeg, libpng, GoogleTest) as Debian 12 packages, unpacked
# under their own prefix.
deps=/tmp/dhp-deps
mkdir -p "$deps"
for f in .devdeps/*.deb; do
  [ -e "$f" ] || continue
  if command -v dpkg >/dev/null; then dpkg -x "$f" "$deps"; else
    (t=$(mktemp -d) && cd "$t" && ar x "$root/$f" && tar xf data.tar.* -C "$deps" && rm -rf "$t"); fi
done
export LD_LIBRARY_PATH="$deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
prefix=$(python3 -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
export TORCH_CUDA_ARCH_LIST=9.0
if command -v make >/dev/null; then gen=("Unix Makefiles"); keep=(-k); else gen=(Ninja); keep=(-k 0); fi
{
  timeout 90 cmake -S . -B build-device -G "${gen[0]}" -DCMAKE_BUILD_TYPE=Release -DDHP_BUILD_BENCH=OFF \
    -DCMAKE_PREFIX_PATH="$prefix;$deps/usr" &&
    timeout $(($(left) - 300)) cmake --build build-device -j"$(nproc)" -- "${keep[@]}"
} >"$out/build.log" 2>&1
echo "== build rc=$? at $((SECONDS - start)) s; errors (first 40 of $out/build.log):"
grep -m40 -E "error|Error|undefined reference" "$out/build.log"
tail -5 "$out/build.log"

if [ -d build-device/tests ]; then
  # First the device tests (CUDA against CPU training, flash against dhp's attention in bf16,
  # the one-rank NCCL group, placement), then the parity matrix on cuda:0 over Gloo (2 and 4
  # ranks sharing the GPU), then the demo.
  (cd build-device && timeout 120 ctest -R 'Device|Config|Attention' --timeout 110 >"$out/ctest_device.log" 2>&1
   echo "== device tests rc=$? at $((SECONDS - start)) s"; grep -E "tests passed|\*\*\*|Failed|Skipped" "$out/ctest_device.log" | tail -12)
  (cd build-device && DHP_TEST_DEVICE=cuda timeout 150 ctest -j4 -R 'StrategyParity' --timeout 140 >"$out/ctest_parity_cuda.log" 2>&1
   echo "== parity matrix on cuda:0 (Gloo) rc=$? at $((SECONDS - start)) s"; grep -E "tests passed|\*\*\*|Failed" "$out/ctest_parity_cuda.log" | tail -12)
fi
if [ -x build-device/dhp ]; then
  timeout 100 build-device/dhp train --set training.device=cuda --out /tmp/dhp-demo-cuda >"$out/demo_cuda.log" 2>&1
  echo "== demo on cuda rc=$? at $((SECONDS - start)) s"; tail -12 "$out/demo_cuda.log"
  # The measured figures: step time, model FLOP/s and MFU, peak memory, for the bench preset
  # and a Qwen2.5-VL-3B-shaped model (random weights, bf16, activation checkpointing,
  # attention auto: flash where it runs, the fallback logged in the job's log) at 1k and 4k
  # patches per image, one GPU, batch 1; bench/device/summarize.py -> figures.json.
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  for model in bench qwen2.5-vl-3b; do
    t=$(( ($(left) - 60) / 2 ))
    [ "$t" -gt 40 ] || { echo "== bench $model skipped: $(left) s left"; continue; }
    timeout "$t" build-device/dhp bench --nproc 1 --strategies '' --point "$model:model.preset=$model" \
      --set training.device=cuda --set training.precision=bf16 --set training.activation_checkpointing=true \
      --set training.attention=auto --vision-tokens 1024,4096 --batch-sizes 1 --steps 5 --warmup 2 --no-plot \
      --out "$out/bench_$model" >"$out/bench_$model.log" 2>&1
    echo "== bench $model rc=$? at $((SECONDS - start)) s"; tail -4 "$out/bench_$model.log"
  done
  python3 bench/device/summarize.py --gpu "$gpu" "$out"/bench_*/results.json >"$out/figures.json"
  cat "$out/figures.json"
fi
# The reference's per-layer timings (the planner's input), alone: no compiler or test competes
# with the host time it measures.
t=$(($(left) - 60))
if [ "$t" -gt 60 ]; then
  PYTHONUNBUFFERED=1 timeout "$((t < 200 ? t : 200))" python3 bench/device/reference_layers.py \
    --out "$out/reference_layers.json" 2>&1 | tee "$out/reference_layers.log"
  echo "== reference_layers done at $((SECONDS - start)) s"
fi
t=$(($(left) - 15))
if [ -d build-device/tests ] && [ "$t" -gt 20 ]; then
  (cd build-device && timeout "$t" ctest -j"$(nproc)" -E 'Device' --timeout 150 >"$out/ctest.log" 2>&1
   echo "== ctest rc=$? at $((SECONDS - start)) s: $(grep -c ' Passed ' "$out/ctest.log") passed, $(grep -c '\*\*\*' "$out/ctest.log") not"
   grep -E "tests passed|\*\*\*|Failed|Timeout" "$out/ctest.log" | tail -40)
fi
echo "== done at $((SECONDS - start)) s"
