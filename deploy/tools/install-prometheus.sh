#!/bin/sh
# Puts Debian's pinned prometheus + promtool under .tools/prometheus/ for the tests, without root
# and without starting any service: the .deb is downloaded and unpacked, never installed.
#   deploy/tools/install-prometheus.sh [DEST]      (DEST defaults to .tools/prometheus)
set -eu
VERSION="2.42.0+ds-5+deb12u1"
SHA256="81d59a24fce84f7fbe97a45a4f2914b6a5881b5cd1db2a6a0e129e515e1a5f55"  # amd64 .deb
POOL="https://deb.debian.org/debian/pool/main/p/prometheus"
DEST="${1:-.tools/prometheus}"
BIN="$DEST/usr/bin/prometheus"

if [ -x "$BIN" ] && "$BIN" --version 2>&1 | grep -q "version 2.42.0"; then
    exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
deb="$tmp/prometheus.deb"
# apt-get download needs no root (it uses the apt lists this machine already has); where it
# cannot, the same file comes straight from Debian's pool. Either way the hash is checked.
if ! (cd "$tmp" && apt-get download -q "prometheus=$VERSION" >/dev/null 2>&1 \
        && mv prometheus_*.deb "$deb"); then
    curl -fsSL -o "$deb" "$POOL/prometheus_$(echo "$VERSION" | sed 's/+/%2B/g')_amd64.deb"
fi
echo "$SHA256  $deb" | sha256sum -c - >/dev/null
rm -rf "$DEST"
mkdir -p "$DEST"
dpkg-deb -x "$deb" "$DEST"
"$BIN" --version >/dev/null 2>&1
"$DEST/usr/bin/promtool" --version >/dev/null 2>&1
echo "prometheus $VERSION in $DEST"
