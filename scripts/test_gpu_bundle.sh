#!/usr/bin/env bash
# Tests the GPU bundle (scripts/gpu_bundle.sh) and the GPU run's script (scripts/gpu_check.sh) on this CPU
# machine as far as one can without a GPU: in a bare Debian 12 root (debootstrap minbase plus python3, as the GPU
# machine has: glibc and libstdc++, none of our Debian libraries) with the GPU machine's LibTorch, the cp312
# torch 2.11.0 wheel's torch/ and the NVIDIA wheels, laid out as that machine's /opt/torch/.venv. There it runs
# scripts/gpu_check.sh, whose GPU steps skip: the bundle check (every binary resolves), device_test's CPU tests,
# and the main job's requests on a CPU server compared with those of a second CPU server (the comparison code
# the GPU run uses, MITA_GPU_CHECK_PLACEMENTS=cpu/float32); then the whole kernels_test; all of it again through
# the bundle's own glibc and libstdc++ (MITA_BUNDLE_FALLBACK). Run as root from the repository root, after
# `scripts/gpu_bundle.sh pack BUILD BUNDLE`. Needs pip and debootstrap (installed when missing); downloads the
# 530 MB cp312 wheel once, and the root, into WORK. gpu_check.sh's output of each run is copied to WORK/output-*.
# Usage: scripts/test_gpu_bundle.sh [BUNDLE] [WORK]   (defaults: build-gpu-bundle, /srv/mita-gpu-bundle-test)
# Exit status 0 when both runs pass (gpu_check.sh, the main job's answers on both CPU servers, kernels_test), 1
# otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=$(realpath "${1:-build-gpu-bundle}")
work=${2:-/srv/mita-gpu-bundle-test}
root=$work/root
site=$root/opt/torch/.venv/lib/python3.12/site-packages
# The NVIDIA wheels: the same versions as the GPU machine's (torch 2.11.0's pins), from install_deps.sh's folder.
nvidia=${MITA_NVIDIA_DIR:-/opt/mita/torch-2.11.0/nvidia}
mkdir -p "$work"
command -v debootstrap > /dev/null || { apt-get update -qq && apt-get install -y -qq --no-install-recommends debootstrap; }
if [ ! -x "$root/bin/bash" ]; then
  debootstrap --variant=minbase --include=python3 bookworm "$root" http://deb.debian.org/debian \
    > "$work/debootstrap.log"
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
cp scripts/gpu_bundle.sh scripts/gpu_check.sh "$root/work/repo/scripts/"
cp -a "$bundle" "$root/work/repo/build-gpu-bundle"
cat > "$root/work/repo/bundle-test.sh" <<'EOF'
#!/usr/bin/env bash
set -u
cd /work/repo
export MITA_TORCH_LIB=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib
b=$PWD/build-gpu-bundle
rm -rf /tmp/gpu-check
OUT=/tmp/gpu-check MITA_GPU_CHECK_PLACEMENTS=cpu/float32 scripts/gpu_check.sh "$b"
check_status=$?
MITA_SOURCE_DIR=/work/repo scripts/gpu_bundle.sh run "$b" kernels_test > /tmp/gpu-check/kernels_test_all.txt 2>&1
kernels_status=$?
tail -1 /tmp/gpu-check/kernels_test_all.txt
grep -q "images: 200 (0 failed)" /tmp/gpu-check/cpu-images-9x16.txt &&
  grep -q "documents: 443 (0 failed)" /tmp/gpu-check/cpu-documents-default.txt &&
  grep -q "cpu-float32-images-9x16 vs cpu: 200/200 inputs answered.*PASS" /tmp/gpu-check/summary.txt &&
  [ $check_status = 0 ] && [ $kernels_status = 0 ]
EOF
chmod +x "$root/work/repo/bundle-test.sh"
status=0
for fallback in "" "libstdc++,glibc"; do
  echo "== MITA_BUNDLE_FALLBACK=$fallback"
  chroot "$root" env MITA_BUNDLE_FALLBACK="$fallback" /work/repo/bundle-test.sh || status=1
  rm -rf "$work/output-${fallback:-machine}" && cp -a "$root/tmp/gpu-check" "$work/output-${fallback:-machine}"
done
echo "== test_gpu_bundle status $status"
exit $status
