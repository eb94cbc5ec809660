#!/usr/bin/env python3
"""Wire mutation fuzzer at a fixed rate, for soaks (scripts/soak_memory.sh): real requests of every method of
both front ends (mita.v1 and the Open Inference Protocol, images and documents of the embedded models),
serialized, then mutated (byte flips, insertions, deletions, truncation, duplicated spans, huge varints;
seeded) and sent as they are, 15% of them gzip- or deflate-compressed, with gzip bombs (0.5%: 64 MiB of
zeros, about 64 KiB on the wire) and messages over the 4 MiB limit (2%) among them. Open loop: --rate calls per second for --duration_s, at most --max_in_flight at once.

Every answer must be OK or a code a bad request may get; INTERNAL and UNKNOWN are counted as faults (exit 1).
Prints the count of each code every minute and at the end.

    /usr/bin/python3 scripts/wire_fuzz.py --server=127.0.0.1:50051 --rate=10 --duration_s=1800 \
        --stubs=build/client/python --images=DIR --documents=FILE[,FILE...]
"""
import argparse
import collections
import glob
import os
import random
import struct
import sys
import threading
import time
import zlib


def varint(value):
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def mutate(data, rng):
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(6)
        if not data:
            data = bytearray(rng.randbytes(rng.randint(1, 16)))
            continue
        i = rng.randrange(len(data))
        if kind == 0:  # flip bits
            data[i] ^= 1 << rng.randrange(8)
        elif kind == 1:  # insert random bytes
            data[i:i] = rng.randbytes(rng.randint(1, 8))
        elif kind == 2:  # delete a span
            del data[i:i + rng.randint(1, 32)]
        elif kind == 3:  # truncate
            del data[i:]
        elif kind == 4:  # duplicate a span
            j = min(len(data), i + rng.randint(1, 64))
            data[j:j] = data[i:j]
        else:  # a huge varint (a length or a count)
            data[i:i + 1] = varint(rng.choice([2**31 - 1, 2**32 + 5, 2**63 - 1, 2**28]))
    return bytes(data)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default="127.0.0.1:50051")
    parser.add_argument("--rate", type=float, default=10, help="calls per second")
    parser.add_argument("--duration_s", type=float, default=60)
    parser.add_argument("--max_in_flight", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--stubs", required=True, help="folder of the generated *_pb2.py modules")
    parser.add_argument("--images", required=True, help="folder of PNG/JPEG files for the image model")
    parser.add_argument("--documents", required=True, help="comma list of UTF-8 text files")
    parser.add_argument("--token_file", default="", help="bearer token to send, if the server wants one")
    args = parser.parse_args()
    sys.path.insert(0, args.stubs)
    import grpc
    from kserve import grpc_predict_v2_pb2 as kserve_pb2
    from mita.v1 import mita_pb2

    rng = random.Random(args.seed)
    images = [open(p, "rb").read() for p in sorted(glob.glob(os.path.join(args.images, "*.png")))[:20]]
    documents = [open(p, "rb").read()[:20000] for p in args.documents.split(",")]
    seeds = []  # (method path, serialized request)
    for image in images[:5]:
        for budget in (mita_pb2.Budget(), mita_pb2.Budget(preset="fast"),
                       mita_pb2.Budget(experts=mita_pb2.ExpertBudget(expert_count=16, expert_width=32))):
            seeds.append(("/mita.v1.MitaService/Classify",
                          mita_pb2.ClassifyRequest(model="fashion-mnist-vit", image=image, budget=budget,
                                                   return_statistics=True).SerializeToString()))
        request = kserve_pb2.ModelInferRequest(model_name="fashion-mnist-vit")
        request.inputs.add(name="image", datatype="BYTES", shape=[1]).contents.bytes_contents.append(image)
        seeds.append(("/inference.GRPCInferenceService/ModelInfer", request.SerializeToString()))
    for model in ("linux-doc-mita", "texlive-doc-mita"):
        for text in documents:
            seeds.append(("/mita.v1.MitaService/Classify", mita_pb2.ClassifyRequest(
                model=model, document=mita_pb2.Document(text=text, truncate=True)).SerializeToString()))
            seeds.append(("/mita.v1.MitaService/Classify", mita_pb2.ClassifyRequest(
                model=model, document=mita_pb2.Document(token_ids=mita_pb2.TokenIds(ids=list(text[:500])))
            ).SerializeToString()))
            request = kserve_pb2.ModelInferRequest(model_name=model)
            request.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.append(text)
            seeds.append(("/inference.GRPCInferenceService/ModelInfer", request.SerializeToString()))
        seeds.append(("/mita.v1.MitaService/GetModel", mita_pb2.GetModelRequest(name=model).SerializeToString()))
        seeds.append(("/inference.GRPCInferenceService/ModelMetadata",
                      kserve_pb2.ModelMetadataRequest(name=model).SerializeToString()))
        seeds.append(("/inference.GRPCInferenceService/ModelConfig",
                      kserve_pb2.ModelConfigRequest(name=model).SerializeToString()))
    seeds.append(("/mita.v1.MitaService/ListModels", b""))
    seeds.append(("/grpc.health.v1.Health/Check", b"\x0a\x13mita.v1.MitaService"))
    # A compression bomb: a 64 MiB image of zeros, which grpcio gzips to about 64 KiB; the server must refuse it
    # at its receive limit without inflating the rest.
    bomb = b"\x0a\x11fashion-mnist-vit" + b"\x12" + varint(64 << 20) + bytes(64 << 20)

    channel = grpc.insecure_channel(args.server, options=[("grpc.max_send_message_length", 64 << 20)])
    metadata = ()
    if args.token_file:
        metadata = (("authorization", "Bearer " + open(args.token_file).read().strip()),)
    methods = {}
    counts = collections.Counter()
    lock = threading.Lock()
    in_flight = threading.Semaphore(args.max_in_flight)

    def done(future):
        try:
            future.result()
            code = "OK"
        except grpc.RpcError as error:
            code = error.code().name
        except Exception as error:  # noqa: BLE001 - the client's own failure, counted
            code = f"CLIENT:{type(error).__name__}"
        with lock:
            counts[code] += 1
        in_flight.release()

    start = time.monotonic()
    next_report = start + 60
    sent = 0
    while True:
        now = time.monotonic()
        if now - start >= args.duration_s:
            break
        if now >= next_report:
            with lock:
                print(f"wire_fuzz: {sent} sent in {now - start:.0f} s: {dict(counts)}", flush=True)
            next_report += 60
        sent += 1
        target = start + sent / args.rate
        if target > now:
            time.sleep(target - now)
        path, request = rng.choice(seeds)
        compression = None
        draw = rng.random()
        if draw < 0.005:
            path, request, compression = "/mita.v1.MitaService/Classify", bomb, grpc.Compression.Gzip
        elif draw < 0.025:
            request = request + b"\x3a" + varint(5 << 20) + rng.randbytes(16) * (5 << 16)  # over 4 MiB
        else:
            request = mutate(request, rng)
            if draw < 0.14:
                compression = grpc.Compression.Gzip
            elif draw < 0.19:
                compression = grpc.Compression.Deflate
        if path not in methods:
            methods[path] = channel.unary_unary(path)
        if not in_flight.acquire(blocking=False):
            with lock:
                counts["NOT_SENT"] += 1
            continue
        future = methods[path].future(request, timeout=10, metadata=metadata, compression=compression)
        future.add_done_callback(done)
    for _ in range(args.max_in_flight):
        in_flight.acquire()
    faults = counts["INTERNAL"] + counts["UNKNOWN"]
    print(f"wire_fuzz: done, {sent} sent in {time.monotonic() - start:.0f} s: {dict(counts)}; "
          f"faults (INTERNAL, UNKNOWN): {faults}", flush=True)
    return 1 if faults else 0


if __name__ == "__main__":
    sys.exit(main())
