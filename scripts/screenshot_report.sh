#!/usr/bin/env bash
# Open a `sokutatsu analyze` report.html in headless Chromium and save a screenshot, so the
# report is known to render (issue #8). Installs Debian's chromium when missing and root.
#
#   scripts/screenshot_report.sh analysis/report.html [analysis/report.png]
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 REPORT_HTML [OUT_PNG]" >&2
  exit 2
fi
report=$(realpath "$1")
out=${2:-${report%.html}.png}
browser=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$browser" ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "$0: Chromium is not installed (Debian: apt-get install chromium)" >&2
    exit 2
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  browser=$(command -v chromium)
fi
# --no-sandbox: Chromium refuses to run as root with its sandbox.
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1280,8000 \
  --screenshot="$out" "file://$report" 2>/dev/null
echo "$out"
