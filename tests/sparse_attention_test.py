"""The training attention (tools/mita_sparse.py sparse_mita_attention) against two independent computations of the
same math (docs/design.md section 2): the dense twin (tools/mita_reference.py mita_attention, an [N, N] mask) and the
serving CPU kernel (kernels::MitaAttentionForward through build/tools/mita-attention-forward), in float64.

  python tests/sparse_attention_test.py SOURCE_DIR BUILD_DIR

Checked: forward values and top-k sets on ragged shapes (N not a multiple of the tile, M not dividing N, batch and
heads > 1), M > N, k > N, exact ties among keys and among gate values; gradients of q, k, v and the landmarks
against autograd through the dense twin (and torch.autograd.gradcheck's finite differences where no tie makes the
function non-differentiable); the whole document model (attention pooling included) trained either way gives the
same parameter gradients. Exits 1 on the first failure. Without torch it fails when CI is set, else skips (77).
"""
import json
import os
import subprocess
import sys
import tempfile

try:
    import torch
except ImportError:
    print("sparse_attention_test: this Python has no torch (scripts/install_peers.sh installs it)")
    sys.exit(1 if os.environ.get("CI") else 77)

SOURCE, BUILD = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(SOURCE, "tools"))
from mita_reference import (MitaDocument, document_config, expert_keys, mita_attention,  # noqa: E402
                            sequence_landmarks)
from mita_sparse import sparse_mita_attention  # noqa: E402

FAILURES = []


def check(condition, message):
    if not condition:
        FAILURES.append(message)
        print("FAIL:", message, flush=True)


def close(actual, expected, tolerance, what):
    difference = (actual - expected).abs().max().item() if actual.numel() else 0.0
    check(difference <= tolerance, f"{what}: largest difference {difference:.3g} > {tolerance:.1g}")
    return difference


def random_inputs(b, h, n, d, m, generator, integer=False):
    """q, k, v [B, H, N, d] and landmarks [B, H, M, d] in float64; `integer`: small integers, so that products
    are exact and equal rows give exact ties."""
    def make(*shape):
        if integer:
            return torch.randint(-2, 3, shape, generator=generator).double()
        return torch.randn(*shape, generator=generator, dtype=torch.float64)
    return make(b, h, n, d), make(b, h, n, d), make(b, h, n, d), make(b, h, m, d)


def kernel_forward(q, k, v, landmarks, width, backend="kernel"):
    """The serving forward of the same inputs (every batch item with these landmarks and width)."""
    with tempfile.TemporaryDirectory() as folder:
        b = q.shape[0]
        items = [{"expert_count": landmarks.shape[2], "expert_width": min(width, q.shape[2])} for _ in range(b)]
        with open(os.path.join(folder, "inputs.json"), "w") as f:
            json.dump({"dtype": "float64", "shape": list(q.shape), "items": items}, f)
        for name, tensor in (("q", q), ("k", k), ("v", v)):
            tensor.detach().contiguous().numpy().tofile(os.path.join(folder, f"{name}.bin"))
        for i in range(b):
            landmarks[i].detach().contiguous().numpy().tofile(os.path.join(folder, f"landmarks_{i}.bin"))
        out = os.path.join(folder, "out.bin")
        subprocess.run([os.path.join(BUILD, "tools", "mita-attention-forward"), f"--inputs={folder}", f"--out={out}",
                        f"--backend={backend}"], check=True)
        return torch.from_file(out, size=q.numel(), dtype=torch.float64).reshape(q.shape).clone()


def expert_keys_by_sort(scores, width):
    """The first `width` keys of a stable descending sort, in increasing index order (the kernels' rule)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :width]
    return torch.sort(order, dim=-1).values


def gradients(function, inputs, seed_gradient):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    output = function(*leaves)
    return torch.autograd.grad((output * seed_gradient).sum(), leaves)


def test_shapes():
    generator = torch.Generator().manual_seed(1)
    # (B, H, N, d, M, k, tile rows, integer values)
    cases = [(2, 3, 50, 8, 4, 7, 4, False),      # ragged: 50 queries in tiles of 4, M = 4 does not divide 50
             (1, 2, 33, 5, 5, 40, 64, False),    # k > N: every key in every expert
             (3, 1, 17, 4, 3, 17, 2, False),     # k = N
             (1, 2, 9, 4, 12, 3, 8, False),      # M > N: more landmarks than tokens
             (2, 2, 64, 16, 16, 64, 64, False),  # k = N = tile
             (1, 1, 1, 3, 1, 1, 64, False),      # one token
             (2, 2, 40, 4, 5, 6, 8, True),       # exact ties among keys' scores and among gate values
             (1, 3, 31, 2, 7, 9, 3, True)]
    for b, h, n, d, m, width, tile, integer in cases:
        name = f"B={b} H={h} N={n} d={d} M={m} k={width} tile={tile}{' ties' if integer else ''}"
        q, k, v, landmarks = random_inputs(b, h, n, d, m, generator, integer)
        if integer:
            scores = landmarks @ k.transpose(-1, -2)
            gates = landmarks @ q.transpose(-1, -2)
            check(scores.unique().numel() < scores.numel() and gates.unique().numel() < gates.numel(),
                  f"{name}: the integer inputs have no ties")
            check(torch.equal(expert_keys(scores, width), expert_keys_by_sort(scores, min(width, n))),
                  f"{name}: expert_keys differs from a stable descending sort")
        sparse = sparse_mita_attention(q, k, v, landmarks, width, tile_rows=tile)
        dense = mita_attention(q, k, v, landmarks, width)
        close(sparse, dense, 1e-12, f"{name}: forward against the dense twin")
        close(sparse, kernel_forward(q, k, v, landmarks, width), 1e-12, f"{name}: forward against the C++ kernel")
        if integer:
            close(sparse, kernel_forward(q, k, v, landmarks, width, "reference"), 1e-12,
                  f"{name}: forward against the C++ reference")
        seed_gradient = torch.randn(sparse.shape, generator=generator, dtype=torch.float64)
        got = gradients(lambda *x: sparse_mita_attention(*x, width, tile_rows=tile), (q, k, v, landmarks),
                        seed_gradient)
        want = gradients(lambda *x: mita_attention(*x, width), (q, k, v, landmarks), seed_gradient)
        for label, g, w in zip(("q", "k", "v", "landmarks"), got, want):
            close(g, w, 1e-11, f"{name}: gradient of {label} against the dense twin")
        print(f"ok {name}", flush=True)


def test_gradcheck():
    """Finite differences where the top-k sets and the routing are away from ties (random float64)."""
    generator = torch.Generator().manual_seed(2)
    for b, h, n, d, m, width, tile in [(1, 2, 12, 3, 3, 4, 4), (2, 1, 7, 2, 2, 9, 3)]:
        q, k, v, landmarks = [x.requires_grad_(True) for x in random_inputs(b, h, n, d, m, generator)]
        check(torch.autograd.gradcheck(lambda *x: sparse_mita_attention(*x, width, tile_rows=tile),
                                       (q, k, v, landmarks), eps=1e-6, atol=1e-7, raise_exception=False),
              f"gradcheck B={b} H={h} N={n} M={m} k={width}")
        # Landmarks computed from q (as the model does): their gradient reaches q.
        check(torch.autograd.gradcheck(
            lambda q, k, v: sparse_mita_attention(q, k, v, sequence_landmarks(q, m), width, tile_rows=tile),
            (q, k, v), eps=1e-6, atol=1e-7, raise_exception=False), f"gradcheck with landmarks from q, N={n}")
    print("ok gradcheck", flush=True)


def test_document_model():
    """The document model with either attention: equal logits and parameter gradients (mean and attention
    pooling; budgets with m or k above N)."""
    torch.manual_seed(3)
    for pooling in (None, {"type": "attention", "heads": 2, "position_buckets": 17}):
        cfg = document_config(vocab_size=256, num_classes=5, embed_dim=16, depth=2, num_heads=2, mlp_hidden_dim=32,
                              kernel_size=5, pooling=pooling)
        dense = MitaDocument(cfg).double()
        sparse = MitaDocument(cfg, attention=sparse_mita_attention).double()
        sparse.load_state_dict(dense.state_dict())
        with torch.no_grad():
            for parameter in dense.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.1)
        sparse.load_state_dict(dense.state_dict())
        ids = torch.randint(0, 256, (3, 90))
        start = torch.tensor([0, 5, 4000])
        for budget in [(4, 16), (100, 8), (6, 200)]:
            losses = [model(ids, budget, start).logsumexp(-1).sum() for model in (dense, sparse)]
            close(losses[1].detach(), losses[0].detach(), 1e-12, f"model pooling={pooling} {budget}: logits")
            for model, loss in zip((dense, sparse), losses):
                model.zero_grad()
                loss.backward()
            for (label, p), q in zip(dense.named_parameters(), sparse.parameters()):
                close(q.grad, p.grad, 1e-11, f"model pooling={pooling} {budget}: gradient of {label}")
    print("ok document model", flush=True)


def test_cuda():
    """The same forward and gradients on a CUDA device, when this machine has one (not on CI)."""
    if not torch.cuda.is_available():
        print("cuda: no CUDA device here, not checked", flush=True)
        return
    generator = torch.Generator().manual_seed(4)
    q, k, v, landmarks = random_inputs(2, 2, 300, 16, 8, generator)
    seed_gradient = torch.randn(q.shape, generator=generator, dtype=torch.float64)
    on_cpu = gradients(lambda *x: sparse_mita_attention(*x, 32), (q, k, v, landmarks), seed_gradient)
    on_gpu = gradients(lambda *x: sparse_mita_attention(*x, 32),
                       [x.cuda() for x in (q, k, v, landmarks)], seed_gradient.cuda())
    for g, c in zip(on_gpu, on_cpu):
        close(g.cpu(), c, 1e-10, "cuda gradients against the CPU")
    print("ok cuda", flush=True)


def main():
    torch.set_num_threads(1)
    test_shapes()
    test_gradcheck()
    test_document_model()
    test_cuda()
    if FAILURES:
        print(f"{len(FAILURES)} failures")
        sys.exit(1)
    print("all passed")


if __name__ == "__main__":
    main()
