#!/usr/bin/env bash
# The layering of src/dhp (docs/architecture.md), enforced: every `#include "dhp/<folder>/..."`
# in src/dhp/<folder>/ must name its own folder or one listed for it below, and the planner's
# files must not reach torch through any chain of dhp headers. No exceptions list: a new
# include that points up the layering fails this check (run by .ci/run before the build).
set -euo pipefail
cd "$(dirname "$0")/.."

# folder -> the folders below it that it may include (its own is always allowed).
declare -A allowed=(
  [core]=""
  [io]="core"
  [nn]="core"
  [dist]="core"
  [optim]="core"
  [parallel]="core nn dist optim"
  [models]="core io nn dist optim parallel"
  [data]="core io models"
  [plan]="core io dist models"
  [train]="core io nn dist optim parallel models data plan"
  [bench]="core io nn dist optim parallel models data plan train"
)
torch_free=(plan)  # folders whose files must not include torch, even through other dhp headers

fail=0
for dir in src/dhp/*/; do
  folder=$(basename "$dir")
  if [[ -z ${allowed[$folder]+set} ]]; then
    echo "check_layers: src/dhp/$folder has no place in the layering (add it to scripts/check_layers.sh and docs/architecture.md)"
    fail=1
    continue
  fi
  ok=" $folder ${allowed[$folder]} "
  while IFS= read -r hit; do
    file=${hit%%:*}
    target=$(sed -E 's|.*#include "dhp/([^/"]+)/.*|\1|' <<< "${hit#*:}")
    if [[ $ok != *" $target "* ]]; then
      echo "check_layers: $file includes dhp/$target/, above $folder (allowed: ${allowed[$folder]:-nothing})"
      fail=1
    fi
  done < <(grep -rHE '^#include "dhp/' "$dir" || true)
done

# Transitive torch check: follow dhp includes from each file of the torch-free folders.
declare -A seen=()
reaches_torch() {  # $1: path under src/; prints the chain to torch when found
  local f=$1
  [[ -n ${seen[$f]+set} ]] && return 1
  seen[$f]=1
  if grep -qE '^#include <(torch|ATen|c10)/' "src/$f"; then
    echo "$f"
    return 0
  fi
  local inc
  for inc in $(grep -E '^#include "dhp/' "src/$f" | sed -E 's|#include "([^"]+)".*|\1|'); do
    if chain=$(reaches_torch "$inc"); then
      echo "$f -> $chain"
      return 0
    fi
  done
  return 1
}
for folder in "${torch_free[@]}"; do
  for f in src/dhp/"$folder"/*.h src/dhp/"$folder"/*.cpp; do
    seen=()
    if chain=$(reaches_torch "${f#src/}"); then
      echo "check_layers: $f reaches torch: $chain (the $folder folder is arithmetic without torch)"
      fail=1
    fi
  done
done

if [[ $fail -ne 0 ]]; then exit 1; fi
echo "check_layers: every include of src/dhp points down the layering; ${torch_free[*]} without torch"
