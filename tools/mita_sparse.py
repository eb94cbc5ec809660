"""MiTA attention for training: the serving forward's math (docs/design.md section 2) in O(N (M + k) d) time and
memory per head, differentiable, on any device PyTorch runs on.

The dense twin (tools/mita_reference.py `mita_attention`) masks an [N, N] matrix; this one gathers instead. Per
(batch item, head), with q, k, v: [N, d], landmarks l: [M, d], expert width k and s = 1/sqrt(d):
  1. scores S = l k^T [M, N] (no scale); expert i owns the k keys with the largest S[i, :]
     (mita_reference.expert_keys, the kernels' tie rule); not differentiated (an index set);
  2. shared expert A = softmax(S s) v [M, d], differentiated in l, k and v;
  3. routing e(n) = argmax_i (l q^T)[i, n] (first maximum); not differentiated;
  4. queries are sorted by expert and cut into query tiles of at most `tile_rows` queries of one expert. A tile's
     key set is the same for all its queries: the M landmarks scaled by s s (values A) and its expert's k keys
     scaled by s (values v), so the tile is one attention [T, d] x [M + k, d] whose single softmax over M + k
     logits is exactly design.md 2.5 (compressed logits q . l s s, routed logits q . k s);
  5. tile outputs are scattered back to the queries' rows.
Everything after the two index choices is ordinary autograd (gathers, matmuls, softmax), so gradients flow to q,
k, v and the landmarks through the compressed logits, the routed logits and the shared expert. Memory: the
[M, N] scores, tiles of (N / T + M) x (M + k) keys and values, and N x (M + k) attention weights per head.
"""
import torch

from mita_reference import expert_keys


def sparse_mita_attention(q, k, v, landmarks, expert_width: int, tile_rows: int = 64):
    """MiTA attention, trainable. q, k, v: [B, H, N, d]; landmarks: [B, H, M, d] (any M >= 1; computed from q by
    the caller, e.g. mita_reference.sequence_landmarks, so their gradient reaches q); expert_width k >= 1, used as
    min(k, N). Returns [B, H, N, d] equal to mita_reference.mita_attention up to float rounding. tile_rows: queries per tile (speed only). Float32, float64 or bfloat16; CPU or CUDA."""
    b, h, n, d = q.shape
    m = landmarks.shape[2]
    width = min(int(expert_width), n)
    groups = b * h
    scale = d ** -0.5
    q2 = q.reshape(groups, n, d)
    k2 = k.reshape(groups, n, d)
    v2 = v.reshape(groups, n, d)
    l2 = landmarks.reshape(groups, m, d)
    device = q.device

    scores = l2 @ k2.transpose(1, 2)  # [G, M, N], no scale
    with torch.no_grad():
        keys = expert_keys(scores, width)  # [G, M, k]
        expert = (q2 @ l2.transpose(1, 2)).argmax(dim=2)  # [G, N], first maximum (gate G = l q^T, transposed)
    shared = torch.softmax(scores * scale, dim=-1) @ v2  # [G, M, d]

    # Each expert's keys and values, gathered once: [G * M, k, d].
    flat_keys = (keys + (torch.arange(groups, device=device) * n).view(groups, 1, 1)).reshape(-1)
    expert_k = k2.reshape(groups * n, d).index_select(0, flat_keys).view(groups * m, width, d)
    expert_v = v2.reshape(groups * n, d).index_select(0, flat_keys).view(groups * m, width, d)

    with torch.no_grad():
        # Queries sorted by (group, expert); the queries of one expert fill ceil(count / T) tiles.
        bucket = (expert + (torch.arange(groups, device=device) * m).view(groups, 1)).reshape(-1)  # [G * N]
        order = torch.sort(bucket, stable=True).indices  # query rows, grouped by bucket
        counts = torch.bincount(bucket, minlength=groups * m)
        tiles_per_bucket = (counts + tile_rows - 1) // tile_rows
        tile_bucket = torch.repeat_interleave(torch.arange(groups * m, device=device), tiles_per_bucket)
        tile_count = tile_bucket.numel()
        bucket_start = torch.cumsum(counts, 0) - counts
        tile_start = torch.cumsum(tiles_per_bucket, 0) - tiles_per_bucket
        sorted_bucket = bucket[order]
        rank = torch.arange(groups * n, device=device) - bucket_start[sorted_bucket]
        slot_of_sorted = (tile_start[sorted_bucket] + rank // tile_rows) * tile_rows + rank % tile_rows
        # The tile slot of every query row, and the query row of every tile slot (padding: row G * N, zeros).
        slot_of_query = torch.empty_like(slot_of_sorted)
        slot_of_query[order] = slot_of_sorted
        query_of_slot = torch.full((tile_count * tile_rows,), groups * n, dtype=torch.long, device=device)
        query_of_slot[slot_of_sorted] = order
        tile_group = torch.div(tile_bucket, m, rounding_mode="floor")

    padded_q = torch.cat([q2.reshape(groups * n, d), q2.new_zeros(1, d)])
    tile_q = padded_q.index_select(0, query_of_slot).view(tile_count, tile_rows, d)
    # Per tile: the M landmarks and the expert's k keys, with their softmax scales folded in (compressed logits
    # are q . l s s, routed logits q . k s), then the values A and the expert's k values.
    tile_k = torch.cat([(l2 * (scale * scale)).index_select(0, tile_group),
                        (expert_k * scale).index_select(0, tile_bucket)], dim=1)
    tile_v = torch.cat([shared.index_select(0, tile_group), expert_v.index_select(0, tile_bucket)], dim=1)
    weights = torch.softmax(tile_q @ tile_k.transpose(1, 2), dim=-1)  # [tiles, T, M + k]
    tile_out = weights @ tile_v  # [tiles, T, d]
    out = tile_out.reshape(tile_count * tile_rows, d).index_select(0, slot_of_query)
    return out.view(b, h, n, d)
