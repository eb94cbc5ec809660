#!/usr/bin/env bash
# Checks that the binaries the container image ships run from the runtime stage's package set: every shared
# library `ldd` resolves for them must belong (dpkg -S) to a package of deploy/runtime-packages.txt, to one
# of their dependencies (apt-cache depends --recurse: what `apt-get install` pulls in), or to the base image
# (approximated by the Essential and Priority: required packages, which debian:12-slim holds); and every
# listed package must own at least one of those libraries (nothing listed that is not needed).
# What it cannot check without a Docker engine: that apt resolves the same versions in the image.
# With --wheel=DIR (a build against the PyPI torch wheel, MITA_LIBTORCH=pypi; DIR is the folder the wheels were
# installed into, which an image copies whole as deploy/Dockerfile.cuda does): libraries under DIR come from
# the wheels, and the packages the wheel replaces (Debian's LibTorch, OpenBLAS and libgomp) are left out of
# the list.
# Usage: scripts/check_runtime_libraries.sh [--wheel=DIR] [BINARY...]  (default: build/server/mita-server and
# build/server/mita-health-probe). Exit 0 when the set is exact, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
wheel_dir=
if [[ ${1:-} == --wheel=* ]]; then
  wheel_dir=$(readlink -f "${1#--wheel=}")
  shift
fi
binaries=("$@")
[ ${#binaries[@]} -gt 0 ] || binaries=(build/server/mita-server build/server/mita-server-core build/server/mita-health-probe)
mapfile -t listed < <(grep -v -E '^\s*(#|$)' deploy/runtime-packages.txt)
if [ -n "$wheel_dir" ]; then
  mapfile -t listed < <(printf '%s\n' "${listed[@]}" | grep -v -E '^(libtorch|libopenblas|libgomp1$)')
fi

declare -A allowed=()
while read -r package; do allowed[$package]=1; done < <(
  apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces \
    --no-enhances "${listed[@]}" | grep -v '^ ' | tr -d '<>' | sort -u)
while read -r package essential priority; do
  if [ "$essential" = yes ] || [ "$priority" = required ]; then allowed[$package]=1; fi
done < <(dpkg-query -W -f='${Package} ${Essential} ${Priority}\n')

# Every resolved library, its real path and the usrmerge twins (/usr/lib and /lib are the same files), are
# looked up in one dpkg -S call (each call reads the whole file database).
declare -A owners=() real=()
# Libraries of the wheels (--wheel) are set aside: they belong to no Debian package.
declare -A from_wheel=()
mapfile -t libraries < <(for binary in "${binaries[@]}"; do
  [ -x "$binary" ] && ldd "$binary" | awk '/=>/ && $3 ~ /^\// {print $3}'; done | sort -u)
if [ -n "$wheel_dir" ]; then
  kept=()
  for library in "${libraries[@]}"; do
    if [[ $(readlink -f "$library") == "$wheel_dir"/* ]]; then from_wheel[$library]=1; else kept+=("$library"); fi
  done
  libraries=("${kept[@]}")
fi
mapfile -t real_paths < <(readlink -f "${libraries[@]}")
candidates=()
for i in "${!libraries[@]}"; do
  real[${libraries[$i]}]=${real_paths[$i]}
  for path in "${libraries[$i]}" "${real_paths[$i]}"; do candidates+=("$path" "${path#/usr}" "/usr${path}"); done
done
while IFS= read -r line; do
  package=${line%%: *}
  owners[${line#*: }]=${package%%:*}
done < <(dpkg -S "${candidates[@]}" 2>/dev/null | grep -v '^diversion' || true)
# Sets `package` to the owner of library $1, or "?".
find_owner() {
  local path candidate
  package="?"
  for path in "$1" "${real[$1]}"; do
    for candidate in "$path" "${path#/usr}" "/usr${path}"; do
      if [ -n "${owners[$candidate]:-}" ]; then package=${owners[$candidate]}; return; fi
    done
  done
}

status=0
declare -A used=()
for binary in "${binaries[@]}"; do
  [ -x "$binary" ] || { echo "missing binary: $binary (build it first)"; exit 1; }
  if ldd "$binary" | grep -q "not found"; then
    echo "$binary: unresolved libraries:"; ldd "$binary" | grep "not found"; status=1
  fi
  count=0 wheel_count=0
  while read -r library; do
    if [ -n "${from_wheel[$library]:-}" ]; then wheel_count=$((wheel_count + 1)); continue; fi
    find_owner "$library"
    count=$((count + 1))
    if [ "$package" = "?" ]; then
      echo "$binary: $library belongs to no Debian package"; status=1
    elif [ -z "${allowed[$package]:-}" ]; then
      echo "$binary: $library is in $package, which the runtime stage does not install"; status=1
    fi
    used[$package]=1
  done < <(ldd "$binary" | awk '/=>/ && $3 ~ /^\// {print $3}')
  echo "$binary: $count shared libraries resolved${wheel_dir:+, $wheel_count more from the wheels in $wheel_dir}"
done
for package in "${listed[@]}"; do
  if [ -z "${used[$package]:-}" ]; then
    echo "deploy/runtime-packages.txt: $package owns none of the libraries: not needed"; status=1
  fi
done
if [ $status -eq 0 ]; then
  echo "runtime libraries OK: ${#used[@]} packages own them, all installed by the ${#listed[@]} packages of" \
       "deploy/runtime-packages.txt, their dependencies, or the base image"
fi
exit $status
