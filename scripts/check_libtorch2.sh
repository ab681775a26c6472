#!/usr/bin/env bash
# Portability check against a libtorch 2.x, on this Debian 12 machine without a GPU: downloads
# (does not install) Debian 13's libtorch-dev 2.6 headers, libgloo-dev and libfmt-dev into a
# scratch prefix and compiles every translation unit of dhp (src, apps, tests, bench) with
# -fsyntax-only against them, two at a time (~10 minutes). Catches what the libtorch 1.13
# build cannot: includes that 1.13 brought in transitively, changed c10d / ATen signatures.
# Not a link or a run (Debian 13's libraries need a newer glibc), and not the NCCL branch of
# dist/comm.cpp (no CUDA headers here). Not part of the test suite: it needs the network.
#
#   bash scripts/check_libtorch2.sh [FILE.cpp...]   # default: every .cpp; prefix and logs in
#                                                   # $DIR (default /tmp/dhp-libtorch2)
set -u
cd "$(dirname "$0")/.."
root=$PWD
dir=${DIR:-/tmp/dhp-libtorch2}
mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial" "$dir/debs" "$dir/logs"
echo "deb http://deb.debian.org/debian trixie main" >"$dir/sources.list"
o=(-o Dir::Etc::SourceList="$dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
   -o Dir::State::Lists="$dir/lists" -o Dir::Cache="$dir/cache")
apt-get "${o[@]}" update >"$dir/logs/apt.log" 2>&1 || { echo "apt-get update (trixie) failed: $dir/logs/apt.log"; exit 1; }
(cd "$dir/debs" && apt-get "${o[@]}" download libtorch-dev libgloo-dev libfmt-dev >>"$dir/logs/apt.log" 2>&1) ||
  { echo "download failed: $dir/logs/apt.log"; exit 1; }
rm -rf "$dir/prefix" && mkdir -p "$dir/prefix"
for f in "$dir"/debs/*.deb; do dpkg -x "$f" "$dir/prefix"; done
version=$(sed -n 's/^Version: //p' < <(dpkg-deb -f "$dir"/debs/libtorch-dev_*.deb) 2>/dev/null)
inc="$dir/prefix/usr/include"
echo "libtorch-dev ${version:-?} headers in $inc"

check() {
  local f=$1 log="$dir/logs/$(echo "$1" | tr / _).log"
  if g++ -std=gnu++17 -fsyntax-only -D_GLIBCXX_USE_CXX11_ABI=1 -DDHP_VERSION='"check"' \
      -DUSE_C10D_GLOO -DUSE_DISTRIBUTED -DUSE_RPC -DUSE_TENSORPIPE \
      -DDHP_BINARY='"dhp"' -DDHP_SOURCE_DIR="\"$root\"" -DDHP_TEST_DATA='"data"' -DDHP_QWEN_TOKENIZER='"tokenizer.json"' \
      -I"$root/src" -I"$root/tests" -isystem "$inc/torch/csrc/api/include" -isystem "$inc" "$f" >"$log" 2>&1; then
    echo "ok   $f"
  else
    echo "FAIL $f ($log)"
  fi
}
export -f check
export dir inc root
if [ $# -gt 0 ]; then printf '%s\n' "$@"; else find src apps tests bench -name '*.cpp' | sort; fi | xargs -P2 -I{} bash -c 'check {}' | tee "$dir/logs/summary.txt"
failed=$(grep -c '^FAIL' "$dir/logs/summary.txt")
total=$(wc -l <"$dir/logs/summary.txt")
echo "$((total - failed)) of $total translation units compile against libtorch ${version:-2.x} headers"
for l in $(grep '^FAIL' "$dir/logs/summary.txt" | sed 's/.*(\(.*\))/\1/'); do grep -m3 'error' "$l"; done
[ "$failed" -eq 0 ]
