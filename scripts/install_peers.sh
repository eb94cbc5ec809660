#!/usr/bin/env bash
# Installs the peers MiTA Serve is checked and measured against (docs/peers.md); run by scripts/install_deps.sh,
# as root, after the torch wheel is in /opt/mita/torch-2.11.0.
#   /opt/mita/peers                  a venv of Debian's python3 with the pinned wheels of
#                                    scripts/peers-requirements.txt (--no-deps: the list is complete); its torch is
#                                    the wheel's 2.11.0, the one the C++ build links, added by a .pth file
#   /opt/mita/perf-analyzer-2.60.0   Triton's perf_analyzer: the binary of the tritonclient 2.60.0 wheel (the last
#                                    tritonclient that ships it; this registry serves PyPI's perf-analyzer only as
#                                    its 0.1.0 placeholder, without the binary). It needs glibc 2.38 and GCC 13's
#                                    libstdc++ (GLIBCXX_3.4.32), newer than Debian 12's (2.36, GCC 12): Debian 13's
#                                    libc6, libstdc++6 and libgcc-s1 are unpacked beside it (not installed: the
#                                    system's stay as they are) and the wrapper `perf_analyzer` runs it through
#                                    their loader.
# Each is made afresh when its identity (the pins) changes, in a staging folder moved in place when complete.
set -euo pipefail
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
here="$(cd "$(dirname "$0")" && pwd)"
TORCH_PREFIX=/opt/mita/torch-2.11.0

PEERS_PREFIX=/opt/mita/peers
peers_identity="$(sha256sum "$here/peers-requirements.txt" | cut -d' ' -f1) $TORCH_PREFIX"
if [ "$(cat "$PEERS_PREFIX/.requirements" 2>/dev/null)" != "$peers_identity" ]; then
  # A venv's scripts name its folder: it is made in place, and the identity marker written last.
  $SUDO rm -rf "$PEERS_PREFIX"
  $SUDO /usr/bin/python3 -m venv "$PEERS_PREFIX"
  site_packages=$("$PEERS_PREFIX/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  echo "$TORCH_PREFIX" | $SUDO tee "$site_packages/mita-torch.pth" > /dev/null
  $SUDO "$PEERS_PREFIX/bin/python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    --no-deps --no-compile --no-cache-dir --only-binary=:all: -r "$here/peers-requirements.txt"
  echo "$peers_identity" | $SUDO tee "$PEERS_PREFIX/.requirements" > /dev/null
fi

PERF_ANALYZER_PREFIX=/opt/mita/perf-analyzer-2.60.0
if [ ! -x "$PERF_ANALYZER_PREFIX/perf_analyzer" ]; then
  staging="$PERF_ANALYZER_PREFIX.partial"
  $SUDO rm -rf "$staging"
  $SUDO mkdir -p "$staging/download" "$staging/bin" "$staging/root" "$staging/apt/lists/partial" \
    "$staging/apt/cache/archives/partial" "$staging/apt/sources"
  $SUDO /usr/bin/python3 -m pip download --quiet --disable-pip-version-check --no-deps --no-cache-dir \
    --only-binary=:all: --platform manylinux1_x86_64 -d "$staging/download" tritonclient==2.60.0
  $SUDO /usr/bin/python3 -c '
import glob, os, sys, zipfile
staging = sys.argv[1]
wheel, = glob.glob(os.path.join(staging, "download", "tritonclient-2.60.0-*.whl"))
with zipfile.ZipFile(wheel) as archive:
    data = archive.read("tritonclient-2.60.0.data/data/bin/perf_analyzer")
path = os.path.join(staging, "bin", "perf_analyzer")
with open(path, "wb") as f:
    f.write(data)
os.chmod(path, 0o755)
' "$staging"
  # Debian 13's packages through a private apt configuration: the system's sources and package state are not
  # touched.
  printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: trixie\nComponents: main\nSigned-By: %s\n' \
    /usr/share/keyrings/debian-archive-keyring.gpg | $SUDO tee "$staging/apt/sources/trixie.sources" > /dev/null
  apt_options=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$staging/apt/sources"
               -o "Dir::State::Lists=$staging/apt/lists" -o "Dir::Cache=$staging/apt/cache"
               -o Dir::State::Status=/dev/null -o APT::Sandbox::User=root)
  $SUDO apt-get "${apt_options[@]}" update -qq
  (cd "$staging/download" && $SUDO apt-get "${apt_options[@]}" download -qq libc6 libstdc++6 libgcc-s1)
  for deb in "$staging"/download/*.deb; do $SUDO dpkg-deb -x "$deb" "$staging/root"; done
  libraries="$PERF_ANALYZER_PREFIX/root/usr/lib/x86_64-linux-gnu"
  printf '%s\n' '#!/bin/sh' \
    '# perf_analyzer of tritonclient 2.60.0 through Debian 13'"'"'s glibc loader and libstdc++ (scripts/install_peers.sh).' \
    "exec $libraries/ld-linux-x86-64.so.2 --library-path $libraries:/lib/x86_64-linux-gnu \\" \
    "  $PERF_ANALYZER_PREFIX/bin/perf_analyzer \"\$@\"" | $SUDO tee "$staging/perf_analyzer" > /dev/null
  $SUDO chmod 755 "$staging/perf_analyzer"
  (cd "$staging/download" && ls ./*.deb) | $SUDO tee "$staging/PACKAGES" > /dev/null
  $SUDO rm -rf "$staging/apt" "$staging/download"
  $SUDO rm -rf "$PERF_ANALYZER_PREFIX"
  $SUDO mv "$staging" "$PERF_ANALYZER_PREFIX"
fi
