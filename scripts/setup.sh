#!/usr/bin/env bash
# Installs llmdiff's build dependencies from Debian's packages when missing.
# Idempotent: a second run only checks. Runs apt-get as root, or via sudo.
set -euo pipefail
PACKAGES=(g++ cmake make libtorch-dev libopenblas0-pthread libcli11-dev libfmt-dev libgtest-dev nlohmann-json3-dev zlib1g-dev libtomlplusplus-dev golang-go rustc cargo python3-numpy python3-sentencepiece python3-torch clang libfuzzer-14-dev chromium parallel slurm-wlm munge)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "setup: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "setup: need root or sudo to install: ${missing[*]}" >&2; exit 2; }
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
