#!/usr/bin/env bash
# System programs the UI tests drive: headless Chromium (the chat page), Xvfb and trayer (the tray icon).
# Installs the missing ones on Debian/Ubuntu; elsewhere it only says which tests will be skipped.
set -euo pipefail
declare -A package=([chromium]=chromium [chromedriver]=chromium-driver [Xvfb]=xvfb [trayer]=trayer)
missing=()
for program in "${!package[@]}"; do
  command -v "$program" >/dev/null 2>&1 || missing+=("${package[$program]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(uname -s)" != Linux ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "system-packages: not installing ${missing[*]} here; the tests that need them will be skipped" >&2
  exit 0
fi
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
