#!/usr/bin/env bash
# The report page's browser test (tests/unit/cli/test_report_page.py) drives Debian's chromium
# with Playwright (no browser download). Only the tests need it, so `make test`, `make check`
# and `make coverage` run this, not `make setup` / `make run`: installed where this runs as root
# with apt, quietly skipped elsewhere (the test is then skipped and names the install line).
set -uo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "[setup] installing chromium (apt) for the report page's browser test"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
    >/dev/null 2>&1 || echo "[setup] chromium not installed (apt failed); its test is skipped"
fi
exit 0
