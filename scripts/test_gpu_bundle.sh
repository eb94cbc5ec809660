#!/usr/bin/env bash
# Tests the GPU bundle (scripts/gpu_bundle.sh) on this CPU machine as far as one can without a GPU: in a bare
# Debian 12 root (debootstrap minbase: glibc and libstdc++, none of our Debian libraries, no python3) with the
# GPU machine's LibTorch, the cp312 torch 2.11.0 wheel's torch/ and the NVIDIA wheels, laid out as that machine's
# /opt/torch/.venv. There it checks every binary, serves both embedded models from the bundle, classifies the
# main job's images and held-out documents, stops the server with SIGTERM, and runs kernels_test; then the same
# through the bundle's own glibc and libstdc++ (MITA_BUNDLE_FALLBACK). Run as root from the repository root,
# after `scripts/gpu_bundle.sh pack BUILD BUNDLE`. Needs debootstrap and pip (downloads the 530 MB cp312 wheel
# once, and the minbase root, into WORK).
# Usage: scripts/test_gpu_bundle.sh [BUNDLE] [WORK]   (defaults: build-gpu-bundle, /srv/mita-gpu-bundle-test)
# Exit status 0 when both runs serve and classify, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=$(realpath "${1:-build-gpu-bundle}")
work=${2:-/srv/mita-gpu-bundle-test}
root=$work/root
site=$root/opt/torch/.venv/lib/python3.12/site-packages
# The NVIDIA wheels: the same versions as the GPU machine's (torch 2.11.0's pins), from install_deps.sh's folder.
nvidia=${MITA_NVIDIA_DIR:-/opt/mita/torch-2.11.0/nvidia}
mkdir -p "$work"
if [ ! -x "$root/bin/bash" ]; then
  debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian > "$work/debootstrap.log"
fi
if [ ! -f "$work/torch/torch/version.py" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$work/wheel" torch==2.11.0
  unzip -q -o "$work"/wheel/torch-2.11.0-cp312-*.whl 'torch/lib/*' torch/version.py -d "$work/torch"
fi
mkdir -p "$site/torch" "$site/nvidia" "$root/work/repo"
cleanup() {
  for m in "$site/torch" "$site/nvidia" "$root/proc" "$root/dev"; do mountpoint -q "$m" && umount "$m"; done
}
trap cleanup EXIT
mount --bind "$work/torch/torch" "$site/torch"
mount --bind "$nvidia" "$site/nvidia"
mount -t proc proc "$root/proc"
mount --bind /dev "$root/dev"
rm -rf "$root/work/repo" && mkdir -p "$root/work/repo"
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$root/work/repo"
cp scripts/gpu_bundle.sh "$root/work/repo/scripts/"
cp -a "$bundle" "$root/work/repo/build-gpu-bundle"
cat > "$root/work/repo/bundle-test.sh" <<'EOF'
#!/usr/bin/env bash
set -u
cd /work/repo
export MITA_TORCH_LIB=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib
b=$PWD/build-gpu-bundle
scripts/gpu_bundle.sh check "$b" || exit 1
scripts/gpu_bundle.sh run "$b" mita-server --listen=127.0.0.1:50391 --metrics_listen= \
  --model_repository=models/repository --max_batch_size=16 --max_queue_delay_ms=2 > /tmp/server.log 2>&1 &
server=$!
client() { /work/repo/scripts/gpu_bundle.sh run "$b" mita-client --server=127.0.0.1:50391 "$@"; }
for _ in $(seq 1 120); do client --list > /dev/null 2>&1 && break; sleep 0.5; done
cd "$b/data"
client --model=fashion-mnist-vit --manifest=images/manifest.csv --concurrency=4 --quiet | tee /tmp/images.txt
client --model=linux-doc-mita --manifest=heldout.csv --concurrency=2 --truncate --quiet --deadline_ms=120000 |
  tee /tmp/documents.txt
kill "$server"; wait "$server"; server_status=$?
echo "server exit status $server_status"
MITA_SOURCE_DIR=/work/repo /work/repo/scripts/gpu_bundle.sh run "$b" kernels_test > /tmp/kernels_test.txt 2>&1
kernels_status=$?
tail -1 /tmp/kernels_test.txt
grep -q "images: 200 (0 failed)" /tmp/images.txt && grep -q "documents: 443 (0 failed)" /tmp/documents.txt &&
  [ $server_status = 0 ] && [ $kernels_status = 0 ]
EOF
chmod +x "$root/work/repo/bundle-test.sh"
status=0
for fallback in "" "libstdc++,glibc"; do
  echo "== MITA_BUNDLE_FALLBACK=$fallback"
  chroot "$root" env MITA_BUNDLE_FALLBACK="$fallback" /work/repo/bundle-test.sh || status=1
done
echo "== test_gpu_bundle status $status"
exit $status
