#!/bin/sh
# Installs Debian's chromium for the dashboard's browser tests (tests/server/test_dashboard.py,
# tests/router/test_dashboard.py drive /usr/bin/chromium with Playwright). Idempotent: a
# chromium already there is kept. apt-get needs root, as `make test` has on this machine and in
# CI; without it this only says what to do (the browser tests then fail, saying the same).
#   deploy/tools/install-chromium.sh
set -eu
# The version the tests were written against. Debian's security updates replace a chromium
# version in the archive within weeks, so when this one is gone the archive's current one is
# taken (with a warning) rather than failing every set-up.
VERSION="150.0.7871.100-1~deb12u1"
BIN=/usr/bin/chromium

if [ -x "$BIN" ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install-chromium: not root; run 'apt-get install chromium' as root for the dashboard browser tests" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
try() { apt-get install -y -q --no-install-recommends "$@" >/dev/null; }
if ! try "chromium=$VERSION" 2>/dev/null; then
    apt-get update -q >/dev/null
    if ! try "chromium=$VERSION" 2>/dev/null; then
        echo "install-chromium: $VERSION is no longer in the archive; installing the current chromium" >&2
        try chromium
    fi
fi
"$BIN" --version
