#!/usr/bin/env bash
# The device check, prepared to run in one call of the device tool on a CUDA machine with
# PyTorch (its Python and its libtorch) and no package registry:
#   bash bench/device/fetch_deps.sh            # here, once: Debian 12 .debs of dhp's libraries
#   run(command="bash bench/device/run.sh", carry=[".devdeps", "third_party"], timeout_s=590)
# Steps, each under a share of one deadline (DHP_DEVICE_BUDGET_S, default 560 s), so that
# what ran comes back even when a later step runs long:
# 1. bench/device/reference_layers.py: the reference's TP (DTensor) and plain layers, host
#    and GPU time per layer (the planner's missing measurement; ~1-2 minutes). First and
#    alone, so that no compiler competes with the host time it measures.
# 2. Configure and build dhp against that libtorch (the carried .debs unpacked under a
#    prefix of their own, never over /), make going on past errors so that every one is seen.
# 3. The demo on the GPU (training.device=cuda) and 100 steps of it on the CPU, then the tests
#    (Device.CudaTrainsLikeCpu compares GPU and CPU training; the rest run the CPU paths):
#    what breaks on libtorch 2.x and on CUDA.
# Everything goes to $OUT (or ./runs/device): gpu.txt, reference_layers.{json,log},
# build.log, demo_cuda.log, demo.log, ctest.log.
set -u
start=$SECONDS
budget=${DHP_DEVICE_BUDGET_S:-560}
left() { echo $((budget - (SECONDS - start))); }
out="${OUT:-runs/device}"
mkdir -p "$out"
cd "$(dirname "$0")/../.."
root=$PWD
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; 
  grep -m1 "model name" /proc/cpuinfo; python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)';
  g++ --version | head -1; cmake --version | head -1; cat /etc/os-release | head -2; } 2>&1 | tee "$out/gpu.txt"

PYTHONUNBUFFERED=1 timeout 200 python3 bench/device/reference_layers.py --out "$out/reference_layers.json" \
  2>&1 | tee "$out/reference_layers.log"
echo "== reference_layers done at $((SECONDS - start)) s"

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
    timeout $(($(left) - 150)) cmake --build build-device -j"$(nproc)" -- "${keep[@]}"
} >"$out/build.log" 2>&1
echo "== build rc=$? at $((SECONDS - start)) s; errors (first 40 of $out/build.log):"
grep -m40 -E "error|Error|undefined reference" "$out/build.log"
tail -5 "$out/build.log"

if [ -x build-device/dhp ]; then
  # The demo on the GPU (training.device=cuda, one process), then 100 steps of it on the CPU.
  timeout 120 build-device/dhp train --set training.device=cuda --out /tmp/dhp-demo-cuda >"$out/demo_cuda.log" 2>&1
  echo "== demo on cuda rc=$? at $((SECONDS - start)) s"; tail -12 "$out/demo_cuda.log"
  timeout 60 build-device/dhp train --set training.steps=100 --out /tmp/dhp-demo >"$out/demo.log" 2>&1
  echo "== demo on cpu (100 steps) rc=$? at $((SECONDS - start)) s"; tail -6 "$out/demo.log"
fi
if [ -d build-device/tests ]; then
  t=$(($(left) - 15))
  (cd build-device && timeout "$t" ctest -j"$(nproc)" --timeout 150 >"$root/$out/ctest.log" 2>&1
   echo "== ctest rc=$? at $((SECONDS - start)) s"; grep -E "tests passed|\*\*\*|Failed|Timeout" "$root/$out/ctest.log" | tail -40)
fi
echo "== done at $((SECONDS - start)) s"
