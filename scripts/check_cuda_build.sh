#!/usr/bin/env bash
# The CUDA build check, on a machine without a GPU: builds dhp against Debian 13's CUDA
# libtorch 2.6 (with NCCL) inside a Debian 13 root, links every target, and runs the whole test
# suite there on the CPU. It proves what the Debian 12 build (libtorch 1.13, CPU only) cannot:
# that the CUDA/NCCL code compiles and links, and that the 2.x API is right at run time.
#
#   sudo bash scripts/check_cuda_build.sh [root|build|test|all] [NINJA TARGET...]   (default: all)
#
# DHP_CTEST_ARGS adds ctest arguments to `test`, e.g. DHP_CTEST_ARGS="-R Tokenizer".
# Targets (after `build`) restrict the build to them, e.g. one object file:
#   bash scripts/check_cuda_build.sh build CMakeFiles/dhp_dist.dir/src/dhp/dist/comm.cpp.o
#
# The root is kept in $DHP_CUDA_ROOT (default /var/cache/dhp/debian13-cuda, outside the
# repository) and reused when present: the first run downloads a few GB (~10 minutes), a rerun
# only rebuilds dhp. The build tree is $DHP_CUDA_ROOT/build (ccache in $DHP_CUDA_ROOT/ccache).
# Needs root (debootstrap, chroot, mount) and Debian's mirror.
#
# cuDNN: Debian 13's `nvidia-cudnn` is an installer that downloads from NVIDIA, which this
# machine cannot reach. The script installs a local placeholder package of that name instead
# (built with dpkg-deb, "Version: 9.99-dhp-placeholder"), and copies the host CUDA toolkit's
# libcudnn*.so.9 (found under /usr/local/cuda*/lib*, or $DHP_CUDNN_DIR) into the root's
# /usr/local/lib: libtorch_cuda.so needs libcudnn.so.9 to link and to load.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
croot=${DHP_CUDA_ROOT:-/var/cache/dhp/debian13-cuda}
mirror=${DHP_DEBIAN_MIRROR:-http://deb.debian.org/debian}
stage=${1:-all}
targets=("${@:2}")
log() { echo "[check_cuda_build] $*"; }

in_root() { chroot "$croot" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 "$@"; }

mount_all() {
  mountpoint -q "$croot/proc" || mount -t proc proc "$croot/proc"
  mountpoint -q "$croot/dev" || mount --bind /dev "$croot/dev"
  mountpoint -q "$croot/dev/shm" || mount -t tmpfs shm "$croot/dev/shm"
  mkdir -p "$croot/src/dhp"
  mountpoint -q "$croot/src/dhp" || mount --bind "$repo" "$croot/src/dhp"
}
umount_all() {
  for m in src/dhp dev/shm dev proc; do mountpoint -q "$croot/$m" && umount -l "$croot/$m" || true; done
}

find_cudnn() {
  if [ -n "${DHP_CUDNN_DIR:-}" ]; then echo "$DHP_CUDNN_DIR"; return; fi
  local f
  f=$(find /usr/local /usr/lib /opt -name 'libcudnn.so.9' 2>/dev/null | head -1 || true)
  [ -n "$f" ] && dirname "$f"
}

# Packages added after a root was made: installed into it on the next run.
later_packages=(pkg-config libavformat-dev libavcodec-dev libswscale-dev libavutil-dev)

make_root() {
  if [ -f "$croot/.dhp-root-ready" ]; then
    local missing=()
    for p in "${later_packages[@]}"; do
      in_root dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
      log "installing into the root: ${missing[*]}"
      in_root apt-get update >>"$croot/apt.log" 2>&1
      in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" \
        >>"$croot/apt.log" 2>&1 || { log "apt-get install failed: $croot/apt.log"; exit 1; }
    fi
    log "root ready: $croot"
    return
  fi
  command -v debootstrap >/dev/null || { apt-get update -qq; apt-get install -y -qq debootstrap; }
  if [ ! -x "$croot/usr/bin/apt-get" ]; then
    log "debootstrap trixie into $croot"
    mkdir -p "$croot"
    debootstrap --variant=minbase --components=main,contrib,non-free,non-free-firmware trixie "$croot" "$mirror" \
      >"$croot.debootstrap.log" 2>&1 || { log "debootstrap failed: $croot.debootstrap.log"; exit 1; }
  fi
  echo "deb $mirror trixie main contrib non-free non-free-firmware" >"$croot/etc/apt/sources.list"
  mount_all
  trap umount_all EXIT
  log "cuDNN placeholder package (nvidia-cudnn is an internet installer)"
  rm -rf "$croot/tmp/cudnn-pkg" && mkdir -p "$croot/tmp/cudnn-pkg/DEBIAN"
  cat >"$croot/tmp/cudnn-pkg/DEBIAN/control" <<'EOF'
Package: nvidia-cudnn
Version: 9.99-dhp-placeholder
Architecture: amd64
Maintainer: dhp <dhp@localhost>
Description: placeholder for the nvidia-cudnn installer
 dhp's check_cuda_build.sh installs the host's libcudnn.so.9 into /usr/local/lib instead.
EOF
  in_root dpkg-deb --build /tmp/cudnn-pkg /tmp/nvidia-cudnn.deb >/dev/null
  in_root dpkg -i /tmp/nvidia-cudnn.deb >/dev/null
  local cudnn
  cudnn=$(find_cudnn || true)
  [ -n "$cudnn" ] || { log "no libcudnn.so.9 on this machine (set DHP_CUDNN_DIR)"; exit 1; }
  log "copying libcudnn*.so.9 from $cudnn"
  cp -a "$cudnn"/libcudnn*.so* "$croot/usr/local/lib/"
  echo /usr/local/lib >"$croot/etc/ld.so.conf.d/dhp-cudnn.conf"
  log "apt-get install (a few GB; log: $croot/apt.log)"
  in_root apt-get update >"$croot/apt.log" 2>&1
  in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    libtorch-cuda-dev nvidia-cuda-toolkit nvidia-cuda-dev libnccl-dev libgloo-cuda-dev \
    build-essential cmake ninja-build ccache libopenblas0-openmp libyaml-cpp-dev libgtest-dev \
    gnuplot-nox libicu-dev libjpeg62-turbo-dev libpng-dev iproute2 procps python3 "${later_packages[@]}" >>"$croot/apt.log" 2>&1 || { log "apt-get install failed: $croot/apt.log"; tail -20 "$croot/apt.log"; exit 1; }
  in_root ldconfig
  touch "$croot/.dhp-root-ready"
  log "root ready: $croot"
}

build() {
  mount_all
  trap umount_all EXIT
  log "configure and build against $(in_root dpkg-query -W -f='${Version}' libtorch-cuda-dev 2>/dev/null || echo '?') (log: $croot/build.log)"
  in_root bash -c "export CCACHE_DIR=/ccache CCACHE_BASEDIR=/; mkdir -p /build && cd /build &&
    cmake -G Ninja /src/dhp -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER_LAUNCHER=ccache &&
    ninja -j${DHP_JOBS:-2} ${targets[*]}" >"$croot/build.log" 2>&1 || { log "build failed: $croot/build.log"; grep -m20 -E 'error|Error' "$croot/build.log"; exit 1; }
  grep -E 'DHP_WITH_CUDA|NCCL|CUDA' "$croot/build.log" | grep -v '^\[' | head -10 || true
  [ ${#targets[@]} -eq 0 ] || { log "built ${targets[*]}"; return; }
  local n
  n=$(in_root bash -c "cd /build && ninja -t targets all | grep -cE '^[^ ]+: (CXX_EXECUTABLE|CXX_SHARED|CXX_STATIC)_LINKER'" || echo '?')
  log "linked: $n targets"
}

run_tests() {
  mount_all
  trap umount_all EXIT
  log "ctest on the CPU against libtorch 2.6 (log: $croot/test.log)"
  local rc=0
  in_root bash -c "cd /build && ctest -j${DHP_JOBS:-2} --output-on-failure --timeout 900 ${DHP_CTEST_ARGS:-}" >"$croot/test.log" 2>&1 || rc=$?
  grep -E 'tests passed|tests failed|Total Test time' "$croot/test.log" || true
  grep -E '^\s+[0-9]+ - ' "$croot/test.log" || true
  return $rc
}

case "$stage" in
  root) make_root ;;
  build) make_root; build ;;
  test) run_tests ;;
  all) make_root; build; run_tests ;;
  *) echo "usage: $0 [root|build|test|all]" >&2; exit 2 ;;
esac
