#!/usr/bin/env python3
"""MiTA Serve example client in Python (grpcio), over mita.v1 or the Open Inference Protocol (KServe V2).

Stubs: generated from proto/ by protoc with grpc_python_plugin (Debian protobuf-compiler-grpc); the build
does it into build/client/python (target mita_python_stubs), or by hand:

    mkdir -p stubs && protoc -I proto --python_out=stubs --grpc_python_out=stubs \
        --plugin=protoc-gen-grpc_python=/usr/bin/grpc_python_plugin \
        proto/mita/v1/mita.proto proto/kserve/grpc_predict_v2.proto

Examples (Debian python3-grpcio and python3-protobuf):

    /usr/bin/python3 client/python/mita_client.py --server=localhost:50051 --list
    /usr/bin/python3 client/python/mita_client.py --model=fashion-mnist-vit --expert_count=16 \
        --expert_width=32 image.png
    /usr/bin/python3 client/python/mita_client.py --protocol=kserve --preset=fast --manifest=images/manifest.csv

With --manifest (CSV "path,label_index", as written by mita-export-images) it prints the accuracy; --json
prints one JSON summary object instead of text (used by tests/python_client_test.sh).
"""
import argparse
import csv
import json
import os
import sys
import time


def load_stubs(directory):
    sys.path.insert(0, directory)
    global grpc, mita_pb2, mita_pb2_grpc, kserve_pb2, kserve_pb2_grpc
    import grpc
    from mita.v1 import mita_pb2, mita_pb2_grpc
    from kserve import grpc_predict_v2_pb2 as kserve_pb2
    from kserve import grpc_predict_v2_pb2_grpc as kserve_pb2_grpc


def classify_mita(stub, args, image):
    """One mita.v1 Classify call; returns (best label index, labels best first, applied budget dict)."""
    request = mita_pb2.ClassifyRequest(model=args.model, image=image, top_n=args.top_n)
    if args.full_attention:
        request.budget.full_attention.SetInParent()
    elif args.preset:
        request.budget.preset = args.preset
    elif args.expert_count or args.expert_width:
        request.budget.experts.expert_count = args.expert_count
        request.budget.experts.expert_width = args.expert_width
    response = stub.Classify(request, timeout=args.deadline_s)
    budget = response.budget
    applied = {"full_attention": budget.full_attention, "expert_count": budget.expert_count,
               "expert_width": budget.expert_width, "preset": budget.preset}
    return response.classes[0].index, [c.label for c in response.classes], applied


def classify_kserve(stub, args, image):
    """One Open Inference Protocol ModelInfer call; returns (best class index, labels, applied parameters)."""
    request = kserve_pb2.ModelInferRequest(model_name=args.model)
    tensor = request.inputs.add(name="image", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append(image)
    if args.full_attention:
        request.parameters["mita_attention"].string_param = "full"
    elif args.preset:
        request.parameters["mita_preset"].string_param = args.preset
    else:
        if args.expert_count:
            request.parameters["mita_expert_count"].int64_param = args.expert_count
        if args.expert_width:
            request.parameters["mita_expert_width"].int64_param = args.expert_width
    if args.top_n:
        request.parameters["mita_top_n"].int64_param = args.top_n
    response = stub.ModelInfer(request, timeout=args.deadline_s)
    outputs = {output.name: output for output in response.outputs}
    scores = list(outputs["scores"].contents.fp32_contents)
    labels = [label.decode("utf-8") for label in outputs["labels"].contents.bytes_contents]
    applied = {}
    for name, parameter in response.parameters.items():
        applied[name] = getattr(parameter, parameter.WhichOneof("parameter_choice"))
    return max(range(len(scores)), key=scores.__getitem__), labels, applied


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("images", nargs="*", help="PNG or JPEG files to classify")
    parser.add_argument("--server", default="localhost:50051")
    parser.add_argument("--protocol", choices=["mita", "kserve"], default="mita",
                        help="mita.v1 Classify or Open Inference Protocol ModelInfer")
    parser.add_argument("--model", default="fashion-mnist-vit")
    parser.add_argument("--expert_count", type=int, default=0, help="expert count m (0: the model's default)")
    parser.add_argument("--expert_width", type=int, default=0, help="expert width k (0: the model's default)")
    parser.add_argument("--preset", default="", help="a preset of the model, e.g. fast")
    parser.add_argument("--full_attention", action="store_true")
    parser.add_argument("--top_n", type=int, default=0, help="labels returned (0: 5)")
    parser.add_argument("--manifest", help="CSV path,label_index: classify every image, print accuracy")
    parser.add_argument("--deadline_s", type=float, default=30.0)
    parser.add_argument("--list", action="store_true",
                        help="describe the models: mita.v1 ListModels, or with --protocol=kserve the Open "
                             "Inference Protocol ModelMetadata of --model and its knobs")
    parser.add_argument("--json", action="store_true", help="print one JSON summary object")
    default_stubs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "build", "client", "python")
    parser.add_argument("--stubs", default=os.environ.get("MITA_PYTHON_STUBS", default_stubs),
                        help="folder of the generated *_pb2.py modules")
    args = parser.parse_args()
    # Checked here, as mita-client does: one budget form, and a top_n that fits the int32 proto field (the server
    # checks the range against the model's classes).
    if sum([bool(args.expert_count or args.expert_width), bool(args.preset), args.full_attention]) > 1:
        parser.error("set one budget: --expert_count/--expert_width, --preset, or --full_attention")
    if not -2**31 <= args.top_n < 2**31:
        parser.error(f"--top_n: {args.top_n} does not fit in 32 bits (the server allows [0, classes])")
    load_stubs(args.stubs)

    channel = grpc.insecure_channel(args.server)
    if args.list and args.protocol == "kserve":
        stub = kserve_pb2_grpc.GRPCInferenceServiceStub(channel)
        metadata, call = stub.ModelMetadata.with_call(kserve_pb2.ModelMetadataRequest(name=args.model),
                                                      timeout=args.deadline_s)
        # The protocol's ModelMetadataResponse has no parameters field: MiTA Serve declares the knobs as JSON
        # in the initial metadata key "mita-parameters".
        knobs = json.loads(dict(call.initial_metadata())["mita-parameters"])
        description = {"name": metadata.name, "versions": list(metadata.versions), "platform": metadata.platform,
                       "inputs": [[t.name, t.datatype, list(t.shape)] for t in metadata.inputs],
                       "outputs": [[t.name, t.datatype, list(t.shape)] for t in metadata.outputs],
                       "parameters": knobs}
        print(json.dumps(description) if args.json else json.dumps(description, indent=2))
        return 0
    if args.list:
        stub = mita_pb2_grpc.MitaServiceStub(channel)
        for model in stub.ListModels(mita_pb2.ListModelsRequest(), timeout=args.deadline_s).models:
            knobs = model.knobs
            print(f"{model.name}: {model.architecture}, {len(model.labels)} classes, expert counts "
                  f"{list(knobs.allowed_expert_counts)}, expert width [{knobs.min_expert_width}, "
                  f"{knobs.max_expert_width}], presets {[p.name for p in knobs.presets]}")
        return 0

    items = [(path, None) for path in args.images]
    if args.manifest:
        base = os.path.dirname(args.manifest)
        with open(args.manifest, newline="") as f:
            for row in csv.reader(f):
                items.append((row[0] if os.path.isabs(row[0]) else os.path.join(base, row[0]), int(row[1])))
    if not items:
        parser.error("give image files or --manifest")

    if args.protocol == "mita":
        stub, classify = mita_pb2_grpc.MitaServiceStub(channel), classify_mita
    else:
        stub, classify = kserve_pb2_grpc.GRPCInferenceServiceStub(channel), classify_kserve
    correct = labelled = 0
    latencies = []
    applied = None
    for path, label in items:
        with open(path, "rb") as f:
            image = f.read()
        start = time.perf_counter()
        try:
            best, labels, applied = classify(stub, args, image)
        except grpc.RpcError as error:
            print(f"{path}: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
        latencies.append(time.perf_counter() - start)
        if label is not None:
            labelled += 1
            correct += int(best == label)
        if not args.json:
            print(f"{path}: {', '.join(labels)}")
    latencies.sort()
    summary = {"protocol": args.protocol, "images": len(items), "labelled": labelled,
               "accuracy": correct / labelled if labelled else None, "applied": applied,
               "latency_p50_ms": 1000 * latencies[len(latencies) // 2]}
    if args.json:
        print(json.dumps(summary))
    else:
        if labelled:
            print(f"accuracy {correct}/{labelled} = {summary['accuracy']:.4f}")
        print(f"applied budget {applied}; client latency p50 {summary['latency_p50_ms']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
