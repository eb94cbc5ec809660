#!/usr/bin/env bash
# Installs the tools scripts/check_deploy.py runs on deploy/: kubernetes-validate (the Kubernetes OpenAPI schemas)
# and checkov (Kubernetes and Dockerfile checks), into their own venv /opt/mita/deploy-check (checkov's many
# dependencies stay apart from the peers' pinned torch/timm in /opt/mita/peers). Every package is pinned in
# scripts/deploy-check-requirements.txt; the venv is made afresh when that list changes (its hash is the identity),
# else left as it is. Run by scripts/install_deps.sh; as root.
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
here="$(cd "$(dirname "$0")" && pwd)"
PREFIX=/opt/mita/deploy-check
identity="$(sha256sum "$here/deploy-check-requirements.txt" | cut -d' ' -f1)"
if [ "$(cat "$PREFIX/.requirements" 2>/dev/null)" != "$identity" ]; then
  # A venv's scripts name its folder: it is made in place, and the identity marker written last.
  $SUDO rm -rf "$PREFIX"
  $SUDO /usr/bin/python3 -m venv "$PREFIX"
  $SUDO "$PREFIX/bin/python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    --no-deps --no-cache-dir -r "$here/deploy-check-requirements.txt"
  echo "$identity" | $SUDO tee "$PREFIX/.requirements" > /dev/null
fi
