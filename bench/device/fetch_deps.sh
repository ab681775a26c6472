#!/usr/bin/env bash
# Downloads (does not install) the Debian 12 packages of dhp's libraries into .devdeps/, for
# bench/device/run.sh to carry to a device machine that has no package registry.
set -eu
cd "$(dirname "$0")/../.."
grep -qx '/.devdeps/' .git/info/exclude 2>/dev/null || echo '/.devdeps/' >>.git/info/exclude
mkdir -p .devdeps
cd .devdeps
apt-get download libyaml-cpp-dev libyaml-cpp0.7 libicu-dev libicu72 libjpeg62-turbo-dev \
  libjpeg62-turbo libpng-dev libpng16-16 zlib1g-dev libgtest-dev
ls -l
