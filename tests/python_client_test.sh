#!/usr/bin/env bash
# ctest python_client_test: starts mita-server on free ports with the embedded model, classifies 50 real
# Fashion-MNIST test images (PNG, from mita-export-images) with the Python example client
# (client/python/mita_client.py, grpcio) over mita.v1 and over the Open Inference Protocol at a chosen budget,
# checks accuracy and the applied budget and mita-health-probe, then stops the server with SIGTERM (exit 0 expected).
# Usage: python_client_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
source_dir=$1
build_dir=$2
python=/usr/bin/python3
work=$(mktemp -d)
server_pid=
cleanup() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then kill -TERM "$server_pid"; wait "$server_pid" || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

"$build_dir/tools/mita-export-images" --count=50 --out="$work/images" > /dev/null
OMP_WAIT_POLICY=passive "$build_dir/server/mita-server" --listen=127.0.0.1:0 --metrics_listen= \
  --model_repository="$source_dir/models/repository" --torch_threads=2 2> "$work/server.log" &
server_pid=$!
port=
for _ in $(seq 1 600); do
  port=$(sed -n 's/.*serving gRPC on [^ ]* (port \([0-9]*\);.*/\1/p' "$work/server.log")
  [ -n "$port" ] && break
  kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.log"; echo "mita-server exited"; exit 1; }
  sleep 0.1
done
[ -n "$port" ] || { cat "$work/server.log"; echo "mita-server did not start"; exit 1; }

# The container HEALTHCHECK's probe: SERVING for the server, both APIs; a failure for an unknown service.
"$build_dir/server/mita-health-probe" --address="127.0.0.1:$port"
"$build_dir/server/mita-health-probe" --address="127.0.0.1:$port" --service=inference.GRPCInferenceService
"$build_dir/server/mita-health-probe" --address="127.0.0.1:$port" --service=mita.v1.MitaService
if "$build_dir/server/mita-health-probe" --address="127.0.0.1:$port" --service=no.such.Service; then
  echo "the probe passed for an unknown service"; exit 1
fi

client=("$python" "$source_dir/client/python/mita_client.py" --server="127.0.0.1:$port"
        --stubs="$build_dir/client/python" --manifest="$work/images/manifest.csv" --json)
"$python" "$source_dir/client/python/mita_client.py" --server="127.0.0.1:$port" --stubs="$build_dir/client/python" --list
"$python" "$source_dir/client/python/mita_client.py" --server="127.0.0.1:$port" --stubs="$build_dir/client/python" \
  --protocol=kserve --list --json > "$work/kserve_metadata.json"
# The client's own checks: two budget forms at once, a top_n over 32 bits: exit 2 with the reason, nothing sent.
for bad in "--preset=fast --full_attention" "--top_n=2147483648"; do
  # shellcheck disable=SC2086
  if "${client[@]}" $bad > "$work/bad.out" 2> "$work/bad.err"; then echo "the client accepted $bad"; exit 1; fi
  grep -E "set one budget|does not fit in 32 bits" "$work/bad.err" || { cat "$work/bad.err"; exit 1; }
done
"${client[@]}" --expert_count=16 --expert_width=32 > "$work/mita.json"
"${client[@]}" --protocol=kserve --expert_count=16 --expert_width=32 > "$work/kserve.json"
"${client[@]}" --protocol=kserve --preset=fast > "$work/kserve_fast.json"
cat "$work"/kserve.json "$work"/kserve_fast.json "$work"/mita.json
"$python" - "$work" <<'PY'
import json, sys
work = sys.argv[1]
mita = json.load(open(f"{work}/mita.json"))
kserve = json.load(open(f"{work}/kserve.json"))
fast = json.load(open(f"{work}/kserve_fast.json"))
metadata = json.load(open(f"{work}/kserve_metadata.json"))
# ModelMetadata over the Open Inference Protocol, the knobs from the "mita-parameters" initial metadata.
assert metadata["inputs"] == [["image", "BYTES", [1]]], metadata
assert metadata["outputs"] == [["scores", "FP32", [10]], ["labels", "BYTES", [-1]]], metadata
assert metadata["parameters"]["mita_expert_count"]["allowed"] == [1, 4, 9, 16, 25, 36, 49], metadata
assert metadata["parameters"]["mita_expert_width"]["max"] == 50, metadata
# The embedded model reaches 0.883 on the 10,000 test images at (16, 32) (README); 50 images: >= 0.8.
for summary in (mita, kserve, fast):
    assert summary["labelled"] == 50, summary
    assert summary["accuracy"] >= 0.8, summary
# Both protocols run the same model at the same budget: the same predictions.
assert mita["accuracy"] == kserve["accuracy"], (mita, kserve)
assert mita["applied"] == {"full_attention": False, "expert_count": 16, "expert_width": 32, "preset": ""}, mita
assert kserve["applied"]["mita_expert_count"] == 16 and kserve["applied"]["mita_expert_width"] == 32, kserve
assert kserve["applied"]["mita_attention"] == "mita", kserve
assert fast["applied"]["mita_preset"] == "fast" and fast["applied"]["mita_expert_count"] == 4, fast
print("python client: OK")
PY
kill -TERM "$server_pid"
wait "$server_pid"
server_pid=
