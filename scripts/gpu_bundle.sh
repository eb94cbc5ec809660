#!/usr/bin/env bash
# The GPU run's artefacts (docs/libtorch.md, "Running a build from here on the GPU machine"). The GPU machine has
# NVIDIA's driver, CUDA 13 and a Python torch 2.11 with CUDA, and no Abseil, gRPC, protobuf or GoogleTest, and
# no network. A build made here against the pinned torch 2.11.0 wheel (scripts/install_deps.sh) runs there on
# that machine's own LibTorch and CUDA libraries (the same 2.11.0 exports, checked by `check`); what travels
# is the bundle: the binaries, the Debian shared libraries they load beyond glibc and LibTorch, libstdc++ and
# glibc for a machine whose own are older than this build needs, and the main job's inputs.
#
#   scripts/gpu_bundle.sh pack [BUILD] [BUNDLE]     here: BUILD (default build-gpu) -> BUNDLE (build-gpu-bundle)
#   scripts/gpu_bundle.sh check [BUNDLE]            there (or here): finds torch, resolves every binary's libraries
#   eval "$(scripts/gpu_bundle.sh env [BUNDLE])"    there: sets LD_LIBRARY_PATH, MITA_SENTENCEPIECE_MODULE, ...
#   scripts/gpu_bundle.sh run BUNDLE BINARY ARGS... there: runs BUNDLE/bin/BINARY with that environment
#
# The torch there: MITA_TORCH_LIB (a torch/lib folder) if set, else python3's torch. The bundle's libstdc++ and
# glibc are used when the machine's lack a symbol version the build needs (MANIFEST), or when
# MITA_BUNDLE_FALLBACK names them (libstdc++,glibc: to test that path). Exit status of pack and check: 0 when
# everything fits and resolves, 1 otherwise, 2 for bad usage.
set -euo pipefail
self=$(readlink -f "$0")
command=${1:-}
shift || true

# What the bundle must stay under: the device tool's 64 MiB for the working tree and carried paths together.
LIMIT_BYTES=$((64 * 1024 * 1024))
TORCH_VERSION_PREFIX=2.11.
TORCH_CUDA=13.0
# What scripts/gpu_check.sh runs there (models_test and document_model_test stay here: their references need
# Debian's python3-torch, and their GPU cases are device_test's).
BINARIES=(server/mita-server server/mita-server-core server/mita-health-probe client/mita-client client/mita-bench tools/mita-eval
          tools/mita-bench-documents tools/mita-batching-bench tests/kernels_test tests/device_test
          tests/mita_cuda_check)
# glibc's own libraries: the machine's are used when new enough (see `env`), else the bundle's glibc/ folder.
GLIBC_LIBRARIES='^(libc|libm|libdl|libpthread|librt|libutil|libresolv|ld-linux-x86-64)\.so'

# Prints the torch/lib folder the bundle runs on: MITA_TORCH_LIB, else python3's torch (version-checked).
torch_library_dir() {
  if [ -n "${MITA_TORCH_LIB:-}" ]; then echo "$MITA_TORCH_LIB"; return; fi
  python3 - "$TORCH_VERSION_PREFIX" "$TORCH_CUDA" <<'PY'
import importlib.util, os, sys
spec = importlib.util.find_spec("torch")
if spec is None:
    sys.exit("python3 has no torch")
root = spec.submodule_search_locations[0]
version = {}
exec(open(os.path.join(root, "version.py")).read(), version)  # no `import torch`: fast, and no GPU init
if not version["__version__"].startswith(sys.argv[1]) or version["cuda"] != sys.argv[2]:
    sys.exit(f"torch {version['__version__']} (CUDA {version['cuda']}) at {root}: the bundle needs "
             f"{sys.argv[1]}x with CUDA {sys.argv[2]}")
print(os.path.join(root, "lib"))
PY
}

# Highest symbol version of a family (GLIBC, GLIBCXX) that the bundle's binaries and libraries need.
needed_version() {
  local family=$1 bundle=$2
  objdump -T "$bundle"/bin/* "$bundle"/lib/*.so* 2>/dev/null | grep -o "${family}_[0-9.]*" | sort -u -V | tail -1 \
    | sed "s/${family}_//"
}

# Whether the machine's library named $1 (via ldconfig) provides symbol version $2 ($3: family).
machine_has_version() {
  local library path
  library=$1
  path=$(ldconfig -p 2>/dev/null | awk -v l="$library" '$1 == l && /x86-64/ {print $NF; exit}')
  [ -n "$path" ] && grep -a -q "${3}_${2}\b" "$path"
}

case "$command" in
pack)
  build=$(realpath -m "${1:-build-gpu}")
  bundle=$(realpath -m "${2:-build-gpu-bundle}")
  cd "$(dirname "$self")/.."  # the repository: tools/, git
  [ -x "$build/server/mita-server" ] || { echo "no $build/server/mita-server: build first" >&2; exit 1; }
  torch_lib=$(grep -E '^MITA_TORCH_ROOT:' "$build/CMakeCache.txt" | cut -d= -f2)/lib
  grep -q '^MITA_LIBTORCH:STRING=pypi' "$build/CMakeCache.txt" ||
    { echo "$build is not a MITA_LIBTORCH=pypi build: its LibTorch would have to travel too" >&2; exit 1; }
  rm -rf "$bundle"
  mkdir -p "$bundle/bin" "$bundle/lib" "$bundle/fallback/libstdc++" "$bundle/fallback/glibc" "$bundle/data"
  for binary in "${BINARIES[@]}"; do
    [ -x "$build/$binary" ] && strip --strip-unneeded -o "$bundle/bin/$(basename "$binary")" "$build/$binary"
  done
  strip --strip-unneeded -o "$bundle/bin/libmita_sentencepiece.so" "$build/models/libmita_sentencepiece.so"
  # Every library ldd resolves here, less LibTorch and the NVIDIA wheels (the machine's torch has the same ones).
  ldd "$bundle"/bin/* 2>/dev/null | awk '/=>/ && $3 ~ /^\// {print $3}' | sort -u | while read -r path; do
    name=$(basename "$path")
    case "$path" in "$torch_lib"/*|*/nvidia/*) continue ;; esac
    if [[ $name =~ $GLIBC_LIBRARIES ]]; then
      cp -L "$path" "$bundle/fallback/glibc/"
    elif [[ $name =~ ^(libstdc\+\+|libgcc_s)\.so ]]; then
      cp -L "$path" "$bundle/fallback/libstdc++/"
    else
      cp -L "$path" "$bundle/lib/"
    fi
  done
  cp -L /lib64/ld-linux-x86-64.so.2 "$bundle/fallback/glibc/"
  strip --strip-unneeded "$bundle"/lib/*.so* 2>/dev/null || true
  # The main job's inputs (scripts/run_main_job.sh), from Debian packages the GPU machine lacks: 200 Fashion-MNIST
  # test images (PNG; images/manifest.csv), the held-out Linux documentation (heldout.csv) and the long document
  # made of it (long.txt), each with paths relative to its own folder, as mita-client reads them; and the
  # Fashion-MNIST test split itself (fashion-mnist/, $MITA_FASHION_MNIST_DIR) for device_test and
  # mita-batching-bench.
  (cd "$bundle/data" && "$build/tools/mita-export-images" --split=t10k --count=200 --out=images > /dev/null)
  sed -i 's|^images/||' "$bundle/data/images/manifest.csv"  # the client reads paths relative to the manifest
  /usr/bin/python3 tools/build_document_corpus.py --out "$bundle/data/corpus" --vocab-size 0 \
    > "$bundle/data/corpus.log" 2>&1
  # Only the held-out documents travel (the training split stays here).
  awk -F'\t' '{print $1}' "$bundle/data/corpus/heldout.tsv" > "$bundle/data/heldout.list"
  find "$bundle/data/corpus" -type f ! -name heldout.tsv ! -name labels.txt | while read -r file; do
    grep -qxF "${file#"$bundle"/data/corpus/}" "$bundle/data/heldout.list" || rm -f "$file"
  done
  find "$bundle/data/corpus" -type d -empty -delete
  rm -f "$bundle/data/heldout.list"
  awk -F'\t' '{print "corpus/" $1 "," $2}' "$bundle/data/corpus/heldout.tsv" > "$bundle/data/heldout.csv"
  /usr/bin/python3 scripts/long_document.py "$bundle/data/corpus" > "$bundle/data/long.label"
  mv "$bundle/data/corpus/long.txt" "$bundle/data/long.txt"
  mkdir -p "$bundle/data/fashion-mnist"
  cp /usr/share/datasets/fashion-mnist/t10k-*-idx*-ubyte.gz "$bundle/data/fashion-mnist/"
  {
    echo "built $(date -u +%FT%TZ) from $(git rev-parse --short HEAD)$(git diff --quiet || echo '+changes') on" \
      "$(. /etc/os-release && echo "$PRETTY_NAME")"
    echo "torch $(grep -o "__version__ = '[^']*'" "$torch_lib/../version.py")"
    echo "needs GLIBC_$(needed_version GLIBC "$bundle") GLIBCXX_$(needed_version GLIBCXX "$bundle")"
  } > "$bundle/MANIFEST"
  bundle_bytes=$(du -sb "$bundle" | cut -f1)
  tree_bytes=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  du -sh "$bundle"/* | sed 's/^/  /'
  echo "bundle $((bundle_bytes / 1024 / 1024)) MiB + tracked files $((tree_bytes / 1024 / 1024)) MiB of" \
       "the 64 MiB that travels"
  cat "$bundle/MANIFEST"
  [ $((bundle_bytes + tree_bytes)) -le $LIMIT_BYTES ] || { echo "over the 64 MiB limit" >&2; exit 1; }
  ;;
env)
  bundle=$(cd "${1:-build-gpu-bundle}" && pwd)
  torch_lib=$(torch_library_dir)
  read -r glibc glibcxx < <(sed -n 's/^needs GLIBC_\([^ ]*\) GLIBCXX_\(.*\)/\1 \2/p' "$bundle/MANIFEST")
  path="$bundle/lib"
  fallback=",${MITA_BUNDLE_FALLBACK:-},"
  if [[ $fallback == *,libstdc++,* ]] || ! machine_has_version libstdc++.so.6 "$glibcxx" GLIBCXX; then
    path="$path:$bundle/fallback/libstdc++"
  fi
  path="$path:$torch_lib"
  echo "export LD_LIBRARY_PATH='$path'"
  echo "export MITA_SENTENCEPIECE_MODULE='$bundle/bin/libmita_sentencepiece.so'"
  echo "export MITA_FASHION_MNIST_DIR='$bundle/data/fashion-mnist'"
  # Set here, so that mita-server does not re-execute itself to set it (it would re-execute the loader below).
  echo "export OMP_WAIT_POLICY=passive"
  if [[ $fallback != *,glibc,* ]] && machine_has_version libc.so.6 "$glibc" GLIBC; then
    echo "export MITA_BUNDLE_LOADER="
  else
    echo "export LD_LIBRARY_PATH='$path:$bundle/fallback/glibc'"
    echo "export MITA_BUNDLE_LOADER='$bundle/fallback/glibc/ld-linux-x86-64.so.2'"
  fi
  ;;
run)
  bundle=${1:?usage: gpu_bundle.sh run BUNDLE BINARY ARGS...}
  binary=${2:?usage: gpu_bundle.sh run BUNDLE BINARY ARGS...}
  shift 2
  eval "$("$self" env "$bundle")"
  # mita-server's launcher would exec mita-server-core without the bundle's loader; env above does its part
  # (OMP_WAIT_POLICY), so the server runs directly.
  [ "$binary" = mita-server ] && binary=mita-server-core
  exec ${MITA_BUNDLE_LOADER:+"$MITA_BUNDLE_LOADER"} "$bundle/bin/$binary" "$@"
  ;;
check)
  bundle=${1:-build-gpu-bundle}
  eval "$("$self" env "$bundle")"
  echo "torch libraries: ${LD_LIBRARY_PATH##*:}"
  echo "library path: $LD_LIBRARY_PATH"
  [ -n "$MITA_BUNDLE_LOADER" ] && echo "the machine's glibc is older than the build's: running through $MITA_BUNDLE_LOADER"
  status=0
  for binary in "$bundle"/bin/*; do
    # ldd -r: every symbol bound, as at start-up (an export the machine's LibTorch lacks shows here).
    if [ -n "$MITA_BUNDLE_LOADER" ]; then
      report=$("$MITA_BUNDLE_LOADER" --list "$binary" 2>&1 || true)
    else
      report=$(ldd -r "$binary" 2>&1 || true)
    fi
    if grep -q -E "not found|undefined symbol" <<< "$report"; then
      echo "$(basename "$binary"): UNRESOLVED"; grep -E "not found|undefined symbol" <<< "$report" | head -5
      status=1
    else
      echo "$(basename "$binary"): $(grep -c '=>' <<< "$report") libraries resolved"
    fi
  done
  exit $status
  ;;
*)
  sed -n '2,17p' "$self" | sed 's/^# \{0,1\}//'
  exit 2
  ;;
esac
