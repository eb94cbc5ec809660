"""ctest timm_vit_fashion_mnist_test: the committed timm ViT package against timm itself.

Usage (run by ctest with the peers' venv): /opt/mita/peers/bin/python tests/timm_vit_fashion_mnist_test.py SOURCE_DIR BUILD_DIR

models/repository/timm-vit-fashion-mnist is a timm VisionTransformer trained here with full attention
(tools/train_image.py --architecture timm_vit) and converted by tools/convert_timm_checkpoint.py. This test:
  1. loads the package's tensors into timm.create_model's VisionTransformer of train_image.TIMM_VIT with
     strict=True (timm's own parameter names, none missing or extra), saves that as a timm checkpoint and converts
     it again (train_image.convert_package): the same tensors bit for bit and the same config.json (the declared
     accuracy order aside, which mita-eval --write_accuracy_order adds);
  2. the C++ forward of the package (build/tools/mita-forward) at full attention, the package's default, on the
     first 32 Fashion-MNIST test images: timm's own logits (fused scaled_dot_product_attention) within 1e-4;
  3. at every MiTA budget the package declares (presets) and the budgets of docs/image_model.md's curve, mixed in
     one C++ batch: the PyTorch twin's logits (tools/timm_mita.py swapped into the same timm model) within 1e-4
     plus twice the twin's own float32 rounding sensitivity (tests/timm_logits_test.py, allowed_difference);
  4. the package's budgets: full attention by default, the MiTA presets "fast", "mita" and "accurate", and an
     accuracy order that lists each of them, most accurate first, with the accuracies of docs/image_model.md
     (full attention 0.8836, the default MiTA preset "mita" 0.8945: not below it by more than 1.5 points).
Without torch or timm it fails when CI is set, else skips (77).
"""
import copy
import json
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import timm  # noqa: F401
    import torch
except ImportError as error:
    print(f"timm_vit_fashion_mnist_test needs torch and timm: {error}")
    sys.exit(1 if os.environ.get("CI") else 77)

SOURCE_DIR, BUILD_DIR = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(SOURCE_DIR, "tools"))
sys.path.insert(0, os.path.join(SOURCE_DIR, "tests"))
from mita_reference import load_safetensors  # noqa: E402
try:
    from timm_logits_test import TOLERANCE, allowed_difference, cpp_logits  # noqa: E402 (needs tritonclient)
except ImportError as error:
    print(f"timm_vit_fashion_mnist_test needs tests/timm_logits_test.py's imports: {error}")
    sys.exit(1 if os.environ.get("CI") else 77)
from timm_mita import set_budget, swap_mita_attention  # noqa: E402
import train_image  # noqa: E402

PACKAGE = os.path.join(SOURCE_DIR, "models", "repository", "timm-vit-fashion-mnist")
# docs/image_model.md's drop-in curve: (pool side P, so m = P * P; expert width k).
CURVE = [(2, 8), (3, 16), (4, 32), (5, 64), (6, 96), (7, 128)]
IMAGES = 32


def main():
    torch.set_num_threads(2)
    with open(os.path.join(PACKAGE, "config.json")) as f:
        config = json.load(f)
    tensors = load_safetensors(os.path.join(PACKAGE, "model.safetensors"))
    model = train_image.timm_vit().eval()
    model.load_state_dict(tensors, strict=True)

    # 1. The conversion of the trained checkpoint, again.
    with tempfile.TemporaryDirectory() as work:
        checkpoint = os.path.join(work, "timm-vit-fashion-mnist.pth")
        torch.save({"model": model.state_dict()}, checkpoint)
        package = os.path.join(work, "package")
        train_image.convert_package(checkpoint, package)
        with open(os.path.join(package, "config.json")) as f:
            converted = json.load(f)
        declared = dict(config, attention={key: value for key, value in config["attention"].items()
                                           if key != "accuracy_order"})
        assert converted == declared, (converted, declared)
        again = load_safetensors(os.path.join(package, "model.safetensors"))
        assert sorted(again) == sorted(tensors)
        assert all(torch.equal(again[name], tensors[name]) for name in tensors)
        with open(os.path.join(package, "labels.txt")) as f, open(os.path.join(PACKAGE, "labels.txt")) as g:
            assert f.read() == g.read()
        print(f"conversion: {len(tensors)} tensors equal, config.json equal")

        # 2. Full attention: C++ against timm's own attention.
        test_x, test_y = train_image.load_split("t10k")
        inputs = test_x[:IMAGES]
        with torch.no_grad():
            reference = model(inputs)
        logits = cpp_logits(PACKAGE, inputs, ["full"], work)
        difference = (logits - reference).abs().max().item()
        print(f"full attention, {IMAGES} test images: max |C++ - timm| = {difference:.2e} "
              f"(logits up to {reference.abs().max():.2f})")
        assert difference <= TOLERANCE, difference

        # 3. MiTA budgets: C++ against the PyTorch twin in the same timm model.
        presets = config["attention"]["presets"]
        budgets = sorted({(int(round(presets[name]["expert_count"] ** 0.5)), presets[name]["expert_width"])
                          for name in ("fast", "mita", "accurate")} | set(CURVE))
        twin = swap_mita_attention(copy.deepcopy(model), depthwise_conv=False).eval()
        twin64 = copy.deepcopy(twin).double()
        reference, reference64 = [], []
        with torch.no_grad():
            for budget in budgets:
                set_budget(twin, budget)
                set_budget(twin64, budget)
                reference.append(twin(inputs))
                reference64.append(twin64(inputs.double()).float())
        reference, reference64 = torch.stack(reference, 1), torch.stack(reference64, 1)  # [images, budgets, 10]
        allowed = allowed_difference(reference, reference64)
        rounding_decided = int((allowed > 1.1 * TOLERANCE).sum())
        assert rounding_decided <= allowed.numel() // 50, allowed
        items = [(i, j) for i in range(IMAGES) for j in range(len(budgets))]
        logits = cpp_logits(PACKAGE, inputs[[i for i, _ in items]],
                            [f"{budgets[j][0] ** 2}x{budgets[j][1]}" for _, j in items], work)
        worst = 0.0
        for row, (i, j) in enumerate(items):
            difference = (logits[row] - reference[i, j]).abs().max().item()
            worst = max(worst, difference)
            assert difference <= allowed[i, j], (i, budgets[j], difference, allowed[i, j].item())
        print(f"MiTA budgets {', '.join(f'{p * p}x{k}' for p, k in budgets)}: max |C++ - twin| = {worst:.2e} "
              f"({rounding_decided} of {allowed.numel()} rows rounding-decided)")
        # The budgets are different computations from full attention: a budget not applied would be caught.
        assert (reference[:, 0] - model(inputs).detach()).abs().max() > 100 * TOLERANCE

    # 4. The package's budgets and declared accuracy order.
    attention = config["attention"]
    assert attention["default_budget"] == {"full_attention": True}, attention
    assert presets["mita"] == {"expert_count": 25, "expert_width": 64}, presets
    assert all(presets[name]["expert_count"] == int(budget.split("x")[0])
               and presets[name]["expert_width"] == int(budget.split("x")[1])
               for name, budget in train_image.TIMM_VIT_PRESETS.items()), presets
    order = attention["accuracy_order"]
    accuracies = [entry["accuracy"] for entry in order]
    assert accuracies == sorted(accuracies, reverse=True), order
    listed = {entry["budget"] for entry in order}
    expected = {"full"} | {f"{p['expert_count']}x{p['expert_width']}" for p in presets.values()
                           if not p.get("full_attention")}
    assert expected <= listed, (expected, listed)
    full = next(entry["accuracy"] for entry in order if entry["budget"] == "full")
    mita = next(entry["accuracy"] for entry in order if entry["budget"] == "25x64")
    assert full >= 0.875 and mita >= full - 0.015, (full, mita)
    print(f"budgets: default full attention (declared accuracy {full:.4f}), presets "
          f"{', '.join(sorted(presets))}; accuracy order {', '.join(entry['budget'] for entry in order)}")
    print("timm-vit-fashion-mnist: OK")


if __name__ == "__main__":
    main()
