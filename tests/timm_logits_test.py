"""ctest timm_logits_test: timm models in, the same logits out.

Usage (run by ctest with the peers' venv): /opt/mita/peers/bin/python tests/timm_logits_test.py SOURCE_DIR BUILD_DIR

For timm's deit_tiny_patch16_224 (with the DWC variant) and deit_small_patch16_224 (without), built by timm with
random weights (no download; noise on every parameter so that none keeps a constant initial value):
  1. the project's MiTA attention (tools/timm_mita.py: the PyTorch twin) is swapped into timm's blocks, the state
     dict saved as a timm checkpoint and converted by tools/convert_timm_checkpoint.py;
  2. PyTorch eager logits on 224x224 RGB images (PNG, made here) at three budgets (the official default m = 25,
     k = 25, and m = 9, k = 16 and m = 49, k = 64) and full attention;
  3. the C++ forward of the converted package (build/tools/mita-forward, all budgets mixed in one batch) must give
     the same logits within 1e-4 plus twice the reference's own rounding sensitivity (|float32 - float64 PyTorch
     logits|): random weights put the k-th and (k+1)-th landmark scores, or the top two gate scores, within a
     float32 ulp of each other somewhere, and there the chosen keys depend on the order of summation (a few of
     9 MiTA rows per model; their count is bounded and printed);
  4. mita-server serves the package: the PNGs sent through Triton's client (tritonclient.grpc) at each budget
     must come back with softmax(PyTorch logits) as scores (log-scores within 1e-4 of log-softmax), the server's
     decoding and normalisation included.
A stock timm DeiT-Tiny (timm's own attention, fused scaled_dot_product_attention; no MiTA) converts with
--full_attention_default and runs with full attention: the C++ logits equal timm's own within 1e-4, and its
MiTA preset runs.
"""
import copy
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import timm
import torch
import tritonclient.grpc as grpcclient
from PIL import Image

SOURCE_DIR, BUILD_DIR = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(SOURCE_DIR, "tools"))
from timm_mita import add_noise, set_budget, swap_mita_attention  # noqa: E402
from mita_server_process import start_server  # noqa: E402

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
# (pool side P, expert width k) for the twin; the C++ budget "m x k" with m = P * P. None: full attention.
BUDGETS = [(5, 25), (3, 16), (7, 64), None]
TOLERANCE = 1e-4


def cpp_budget(budget):
    return "full" if budget is None else f"{budget[0] * budget[0]}x{budget[1]}"


def make_images(work, count, seed):
    """`count` 224x224 RGB PNGs with structure at several scales (smooth colour fields plus edges and noise);
    returns (PNG paths, the model inputs [count, 3, 224, 224] float32 normalised as the server does)."""
    rng = np.random.default_rng(seed)
    paths, inputs = [], []
    for i in range(count):
        coarse = Image.fromarray(rng.integers(0, 256, (7, 7, 3), dtype=np.uint8)).resize((224, 224), Image.BILINEAR)
        pixels = np.asarray(coarse).astype(np.int32)
        pixels[:, 100 + 10 * i: 110 + 10 * i, :] = 255 - pixels[:, 100 + 10 * i: 110 + 10 * i, :]
        pixels = np.clip(pixels + rng.integers(-20, 21, pixels.shape), 0, 255).astype(np.uint8)
        path = os.path.join(work, f"image{i}.png")
        Image.fromarray(pixels, "RGB").save(path)
        decoded = np.asarray(Image.open(path).convert("RGB"))
        assert (decoded == pixels).all()
        # (x / 255 - mean) / std in float32, channel first: models/image_decoder.cc PreprocessImage.
        normalised = (torch.from_numpy(decoded.copy()).permute(2, 0, 1).float() / 255.0
                      - torch.from_numpy(MEAN)[:, None, None]) / torch.from_numpy(STD)[:, None, None]
        paths.append(path)
        inputs.append(normalised)
    return paths, torch.stack(inputs)


def convert(checkpoint, package, heads, extra=()):
    subprocess.run([sys.executable, os.path.join(SOURCE_DIR, "tools", "convert_timm_checkpoint.py"),
                    "--checkpoint", checkpoint, "--out", package, "--num_heads", str(heads),
                    "--pool_size", "5", "--kv_topk", "5", *extra], check=True)


def cpp_logits(package, inputs, budgets, work):
    """Logits of the C++ forward (mita-forward), all items in one batch with their own budgets."""
    inputs_path, logits_path = os.path.join(work, "inputs.f32"), os.path.join(work, "logits.f32")
    inputs.contiguous().numpy().astype("<f4").tofile(inputs_path)
    subprocess.run([os.path.join(BUILD_DIR, "tools", "mita-forward"), f"--model={package}",
                    f"--images={inputs_path}", f"--budgets={','.join(budgets)}", f"--out={logits_path}",
                    "--threads=2"], check=True)
    return torch.from_numpy(np.fromfile(logits_path, dtype="<f4").reshape(inputs.shape[0], -1))


def served_scores(client, model, png_path, budget):
    tensor = grpcclient.InferInput("image", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([open(png_path, "rb").read()], dtype=np.object_))
    if budget is None:
        parameters = {"mita_attention": "full"}
    else:
        parameters = {"mita_expert_count": budget[0] * budget[0], "mita_expert_width": budget[1]}
    result = client.infer(model, [tensor], outputs=[grpcclient.InferRequestedOutput("scores")],
                          parameters=parameters, client_timeout=120)
    applied = result.get_response().parameters
    if budget is None:
        assert applied["mita_attention"].string_param == "full", applied
    else:
        assert applied["mita_expert_count"].int64_param == budget[0] * budget[0], applied
        assert applied["mita_expert_width"].int64_param == budget[1], applied
    return torch.from_numpy(result.as_numpy("scores").copy())


def allowed_difference(reference, reference64):
    """Per (image, budget): TOLERANCE plus twice the largest |float32 - float64| reference logit difference, the
    width of the rounding-decided key choices (see the module doc). reference*: [images, budgets, C]."""
    return TOLERANCE + 2 * (reference - reference64).abs().amax(dim=-1)


def check_served(client, model, paths, reference_logits, allowed):
    """The served scores of each (image, budget) against softmax of the reference logits [images, budgets, C],
    within allowed[image, budget]."""
    worst = 0.0
    for i, path in enumerate(paths):
        for j, budget in enumerate(BUDGETS if reference_logits.shape[1] == len(BUDGETS) else [None]):
            scores = served_scores(client, model, path, budget)
            expected = torch.log_softmax(reference_logits[i, j].double(), dim=0)
            difference = (scores.double().log() - expected).abs().max().item()
            worst = max(worst, difference)
            assert difference <= allowed[i, j], (model, path, budget, difference, allowed[i, j].item())
    print(f"{model}: served log-scores within {worst:.2e} of PyTorch's log-softmax")


def main():
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as work:
        repository = os.path.join(work, "repository")
        paths, inputs = make_images(work, 3, seed=11)
        references = {}
        for name, heads, dwc, seed in [("deit_tiny_patch16_224", 3, True, 1), ("deit_small_patch16_224", 6, False, 2)]:
            torch.manual_seed(seed)
            model = timm.create_model(name, pretrained=False)
            swap_mita_attention(model, depthwise_conv=dwc)
            add_noise(model, 0.02, seed).eval()
            checkpoint = os.path.join(work, f"{name}.pth")
            torch.save({"model": model.state_dict()}, checkpoint)
            package = os.path.join(repository, name.replace("_", "-"))
            convert(checkpoint, package, heads)

            model64 = copy.deepcopy(model).double()
            with torch.no_grad():
                reference, reference64 = [], []
                for budget in BUDGETS:
                    set_budget(model, budget)
                    set_budget(model64, budget)
                    reference.append(model(inputs))
                    reference64.append(model64(inputs.double()).float())
            reference = torch.stack(reference, dim=1)  # [images, budgets, 1000]
            allowed = allowed_difference(reference, torch.stack(reference64, dim=1))
            # Full attention has no key choice: its rows stay at TOLERANCE; a few MiTA rows at most are
            # rounding-decided, or the test would no longer check the kernel.
            assert (allowed[:, 3] <= 1.1 * TOLERANCE).all(), allowed
            rounding_decided = int((allowed > 1.1 * TOLERANCE).sum())
            assert rounding_decided <= 3, allowed
            print(f"{name}: {rounding_decided} of {allowed[:, :3].numel()} MiTA rows rounding-decided "
                  f"(float32 and float64 PyTorch differ by more than {TOLERANCE / 20:.0e})")
            references[name] = (reference, allowed)
            # One C++ batch: every image at every budget, mixed.
            items = [(i, j) for i in range(inputs.shape[0]) for j in range(len(BUDGETS))]
            logits = cpp_logits(package, inputs[[i for i, _ in items]],
                                [cpp_budget(BUDGETS[j]) for _, j in items], work)
            for row, (i, j) in enumerate(items):
                difference = (logits[row] - reference[i, j]).abs().max().item()
                scale = reference[i, j].abs().max().item()
                print(f"{name} image {i} budget {cpp_budget(BUDGETS[j])}: max |C++ - PyTorch| = {difference:.2e} "
                      f"(logits up to {scale:.2f}, allowed {allowed[i, j]:.2e})")
                assert difference <= allowed[i, j], (name, i, BUDGETS[j], difference, allowed[i, j].item())
            # Different budgets are different computations: the comparison would catch a budget not applied.
            assert (reference[:, 0] - reference[:, 3]).abs().max() > 100 * TOLERANCE

        # A stock timm DeiT: timm's own attention (fused SDPA), converted with full attention as its default.
        torch.manual_seed(3)
        stock = add_noise(timm.create_model("deit_tiny_patch16_224", pretrained=False), 0.02, 3).eval()
        checkpoint = os.path.join(work, "stock.pth")
        torch.save(stock.state_dict(), checkpoint)
        stock_package = os.path.join(repository, "deit-tiny-stock")
        convert(checkpoint, stock_package, 3, ["--full_attention_default"])
        with torch.no_grad():
            stock_reference = stock(inputs)
        logits = cpp_logits(stock_package, inputs, ["full"], work)
        difference = (logits - stock_reference).abs().max().item()
        print(f"stock deit_tiny_patch16_224, full attention: max |C++ - timm| = {difference:.2e}")
        assert difference <= TOLERANCE, difference
        mita_logits = cpp_logits(stock_package, inputs, ["25x25"], work)
        assert torch.isfinite(mita_logits).all()

        process, port = start_server(BUILD_DIR, repository, work)
        try:
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
            for name, (reference, allowed) in references.items():
                check_served(client, name.replace("_", "-"), paths, reference, allowed)
            check_served(client, "deit-tiny-stock", paths, stock_reference[:, None],
                         torch.full((len(paths), 1), TOLERANCE))
            # The stock model's default budget is full attention, its preset "mita" the converter's MiTA budget.
            tensor = grpcclient.InferInput("image", [1], "BYTES")
            tensor.set_data_from_numpy(np.array([open(paths[0], "rb").read()], dtype=np.object_))
            applied = client.infer("deit-tiny-stock", [tensor]).get_response().parameters
            assert applied["mita_attention"].string_param == "full", applied
            applied = client.infer("deit-tiny-stock", [tensor], parameters={"mita_preset": "mita"}).get_response()
            assert applied.parameters["mita_expert_count"].int64_param == 25, applied
            client.close()
        finally:
            process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=60)
        assert code == 0, f"mita-server exited with {code}"
    print("timm logits: OK")


if __name__ == "__main__":
    main()
