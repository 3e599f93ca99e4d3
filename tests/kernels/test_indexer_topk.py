"""indexer_topk: the Triton kernel against the plain-torch reference, and the reference against the engine.

CPU runs interpret the Triton kernels (TRITON_INTERPRET=1, tests/conftest.py) on small real-layout pools:
B in {1, 3, 17, 64}, contexts {0, 1, 37, 511, 512, 513, 4096}, ragged rows in one batch. GPU tests
(``-m gpu``, compiled Triton, inputs made on the GPU) add the 70K-entry context and the real pool size.

Tolerance: none between kernel and reference. Every per-block term q.k is exact in fp32 and both sum
them in one fixed order (block order, then a pairwise head tree), so scores must be bit-identical and
sel_idx / counts / candidate blocks identical (``torch.equal``). Against the engine's einsum (another
summation order) the reference's scores agree to 2e-6 of sum_h |w_h relu(d_h)| in fp32; selections are
compared on data without near-ties (the engine's own select_topk applied to the reference's scores must
give the same indices exactly).
"""

import os

import pytest
import torch

from flashtier.engine.kv.block_table import BlockTable
from flashtier.engine.model.indexer import candidate_pool, index_scores, select_topk
from flashtier.engine.kv.paged_entries import PagedEntries
from flashtier.kernels.indexer_topk.op import IndexerTopKConfig, indexer_topk, indexer_topk_with_candidates
from flashtier.kernels.quant.mxfp4 import mxfp4_qdq, pack_mxfp4_record, quantize_mxfp4
from flashtier.kvstore.kv_pool import GlobalKVPool
from flashtier.kvstore.layout import BlockLayout, KVGeometry

IH, ID, K = 32, 128, 512
GEO = KVGeometry(head_dim=512, index_head_dim=ID, source_ratios=(2, 2, 2, 1), window=128, n_window_layers=2,
                 n_encoder_window_layers=1)
S2, S20 = 0, 3  # encoder stream (32 entries per 64-token block) and the decoder's (64 per block)
CONTEXTS = [0, 1, 37, 511, 512, 513]
NORMAL = IndexerTopKConfig(normal_decode=True, block_n=32)
CHUNKED = IndexerTopKConfig(final_block=64, final_tiles=2)  # 128-position finalize chunks: picks and ties span many


def make_case(b, contexts, *, device="cpu", stream=S20, seed=0, n_phys=None, distinct=None, packed_q=False):
    """B decode rows over a real-layout pool: every entry of ``stream`` holds a valid MXFP4 key (``distinct``:
    drawn from only that many key vectors, to make ties), other bytes random; each row its own blocks."""
    g = torch.Generator(device=device).manual_seed(seed)
    ctx = [contexts[i % len(contexts)] for i in range(b)]
    layout = BlockLayout(GEO, 64)
    e = layout.entries_per_block[stream]
    cols = max(1, -(-max(ctx) // e))
    n_phys = n_phys or b * cols
    image = torch.randint(0, 256, (n_phys, layout.block_bytes), generator=g, dtype=torch.uint8, device=device)
    pool = layout.split(image)[stream][1]
    if distinct:
        base = torch.randn(distinct, ID, generator=g, device=device)
        raw = base[torch.randint(0, distinct, (n_phys * e,), generator=g, device=device)]
    else:
        raw = torch.randn(n_phys * e, ID, generator=g, device=device)
    pool.copy_(pack_mxfp4_record(*quantize_mxfp4(raw)).view(pool.shape))
    table = torch.randperm(n_phys, generator=g, device=device)[: b * cols].view(b, cols).int() if n_phys >= b * cols \
        else torch.randint(0, n_phys, (b, cols), generator=g, device=device, dtype=torch.int32)
    q = 2 * torch.randn(b, IH, ID, generator=g, device=device)
    if packed_q:
        q = pack_mxfp4_record(*quantize_mxfp4(q))
    w = torch.randn(b, IH, generator=g, device=device) * (ID**-0.5 * IH**-0.5)
    return dict(q=q, weights=w, index_pool=pool, block_table=table,
                n_visible=torch.tensor(ctx, dtype=torch.int32, device=device))


def assert_same(out, ref, name=""):
    """Kernel == reference: identical indices, counts, candidate pool and score bits, row by row."""
    for field in ("sel_idx", "counts", "cand_blocks", "cand_counts"):
        a, r = getattr(out, field), getattr(ref, field)
        if r is None:
            continue
        assert a.dtype == r.dtype == torch.int32, f"{name}: {field} dtype {a.dtype}"
        for i in range(r.shape[0]):
            assert torch.equal(a[i].cpu(), r[i].cpu()), f"{name}: row {i} {field} differs"
    for field in ("scores", "block_scores"):
        a, r = getattr(out, field), getattr(ref, field)
        if r is not None:
            for i in range(r.shape[0]):  # bits, not values: -0.0 and +0.0 both count as 0 only through ==
                assert torch.equal(a[i].cpu(), r[i].cpu()), f"{name}: row {i} {field} differs"


def both(case, fn=indexer_topk, config=None, **kw):
    out = fn(**case, **kw, impl="triton", config=config, return_scores=True)
    ref = fn(**case, **kw, impl="reference", return_scores=True)
    return out, ref


SMALL = {  # name -> (B, contexts, extra make_case arguments)
    "b1_ctx0": (1, [0], {}),
    "b1_ctx1": (1, [1], {}),
    "b1_ctx4096": (1, [4096], {}),
    "b3_ragged": (3, [37, 511, 513], {}),
    "b3_packed_q": (3, [512, 1, 37], dict(packed_q=True)),
    "b3_encoder_stream": (3, [513, 0, 300], dict(stream=S2)),
    "b17_ragged": (17, CONTEXTS + [1000], {}),
    "b64_ragged": (64, CONTEXTS, dict(n_phys=40)),
}


@pytest.mark.parametrize("name", list(SMALL))
def test_kernel_matches_reference(name):
    b, contexts, extra = SMALL[name]
    case = make_case(b, contexts, **extra)
    out, ref = both(case, k=K)
    assert_same(out, ref, name)
    n = case["n_visible"].long()
    assert torch.equal(out.counts.long(), n.clamp(max=K)), "every visible entry is valid here"
    for i in range(b):  # ascending ids below n_visible, then -1
        row = out.sel_idx[i, : int(out.counts[i])]
        assert bool((row[1:] > row[:-1]).all()) and bool((row < n[i]).all()) and bool((out.sel_idx[i, len(row):] == -1).all())
    if b <= 3:  # the normal-fp16 decode variant, another tile size and small finalize chunks: the same bits
        assert_same(indexer_topk(**case, k=K, impl="triton", config=NORMAL, return_scores=True), ref, f"{name} normal")
        assert_same(indexer_topk(**case, k=K, impl="triton", config=CHUNKED, return_scores=True), ref, f"{name} chunked")


def test_ties_go_to_the_lower_index():
    # every key the same: all scores tie, so the first min(k, n) entries win
    case = make_case(3, [700, 513, 37], distinct=1)
    out, ref = both(case, k=K)
    assert_same(out, ref, "all equal")
    for i, n in enumerate([700, 513, 37]):
        assert out.sel_idx[i, : min(n, K)].tolist() == list(range(min(n, K)))
    # three distinct keys: hundreds of ties straddle the k-th score
    case = make_case(4, [513, 1000, 4096, 37], distinct=3, seed=1)  # one row per context (17 rows: test above)
    out, ref = both(case, k=K)
    assert_same(out, ref, "three keys")
    assert_same(both(case, config=CHUNKED, k=K)[0], ref, "three keys, ties across finalize chunks")
    s, thr = ref.scores[2], ref.scores[2].sort(descending=True).values[K - 1]
    tied = torch.nonzero(s == thr).flatten()
    assert len(tied) > 100 and int((s > thr).sum()) < K  # the cut falls inside a run of ties
    want = torch.cat((torch.nonzero(s > thr).flatten(), tied[: K - int((s > thr).sum())])).sort().values
    assert out.sel_idx[2].tolist() == want.tolist()
    # negative weights and all-negative dots: every score is -0.0 or 0.0, all tied
    case = make_case(3, [600, 37, 513], seed=2)
    case["weights"] = -case["weights"].abs()
    case["weights"][:, ::3] = 0.0
    out, ref = both(case, k=K)
    assert_same(out, ref, "signed zeros")
    assert bool((ref.scores[ref.scores > float("-inf")] <= 0).all())


@pytest.mark.parametrize("contexts,n_blocks", [([0, 1, 37, 300], 16), ([513, 4096, 8], 16), ([4096], 600)])
def test_candidate_pool_and_reindex(contexts, n_blocks):
    case = make_case(len(contexts), contexts, seed=3)
    out, ref = both(case, indexer_topk_with_candidates, k=K, n_blocks=n_blocks)
    assert_same(out, ref, "layer 20")
    assert_same(both(case, indexer_topk_with_candidates, config=CHUNKED, k=K, n_blocks=n_blocks)[0], ref, "chunked")
    n = case["n_visible"].long()
    assert torch.equal(out.cand_counts.long(), ((n + 7) // 8).clamp(max=n_blocks))
    for i in range(len(contexts)):  # the newest block is always kept
        if n[i] > 0:
            assert int((n[i] - 1) // 8) in out.cand_blocks[i].tolist()
    cand = (out.cand_blocks, out.cand_counts)
    out2, ref2 = both(case, k=64, candidates=cand)
    assert_same(out2, ref2, "reindex")
    assert_same(both(case, config=CHUNKED, k=64, candidates=cand)[0], ref2, "reindex chunked")
    kept = set()
    for i in range(len(contexts)):
        kept = {int(c) for c in out.cand_blocks[i] if c >= 0}
        assert all(int(j) // 8 in kept for j in out2.sel_idx[i] if j >= 0), "a reindex pick outside the pool"
    case_eq = make_case(2, [4096, 700], distinct=1, seed=4)  # all block maxima tie: newest + lowest blocks
    out, ref = both(case_eq, indexer_topk_with_candidates, k=K, n_blocks=16)
    assert_same(out, ref, "tied blocks")
    assert out.cand_blocks[0].tolist() == list(range(15)) + [511]


def test_corrupted_inputs_fail():
    """One flipped block-table entry, or one flipped key nibble, must break the comparison."""
    case = make_case(3, [513, 37, 1000], seed=5)
    ref = indexer_topk(**case, k=K, impl="reference", return_scores=True)
    for row in range(3):
        table = case["block_table"].clone()
        table[row, 0] = (table[row, 0] + 1) % case["index_pool"].shape[0]
        bad = indexer_topk(**{**case, "block_table": table}, k=K, impl="triton", return_scores=True)
        with pytest.raises(AssertionError, match=f"row {row} "):
            assert_same(bad, ref, "flipped table")
    pool = case["index_pool"].clone()
    j = int(ref.sel_idx[1, 0])
    blk = int(case["block_table"][1, j // pool.shape[1]])
    pool[blk, j % pool.shape[1], 0] ^= 0x07  # one code of the row's selected entry
    bad = indexer_topk(**{**case, "index_pool": pool}, k=K, impl="triton", return_scores=True)
    with pytest.raises(AssertionError, match="row 1 scores"):
        assert_same(bad, ref, "flipped nibble")


def test_row_result_does_not_depend_on_the_batch():
    case = make_case(17, CONTEXTS + [1000], seed=6)
    batch = indexer_topk(**case, k=K, impl="triton", return_scores=True)
    for i in (2, 5, 16):
        row = {k: (v[i : i + 1] if k != "index_pool" else v) for k, v in case.items()}
        n = max(1, -(-int(case["n_visible"][i]) // 64))
        row["block_table"] = row["block_table"][:, :n].contiguous()
        alone = indexer_topk(**row, k=K, impl="triton", return_scores=True)
        assert torch.equal(alone.sel_idx[0], batch.sel_idx[i]) and torch.equal(alone.counts[0], batch.counts[i])
        assert torch.equal(alone.scores[0], batch.scores[i, : alone.scores.shape[1]])


def test_auto_on_cpu_is_the_reference():
    case = make_case(3, [37, 513, 0], seed=7)
    a, r = indexer_topk(**case), indexer_topk(**case, impl="reference")
    assert torch.equal(a.sel_idx, r.sel_idx) and torch.equal(a.counts, r.counts)


# ------------------------------------------------------------------ the reference is the engine's math


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_equals_engine_indexer(dtype):
    """Per sequence as the engine runs it today (PagedEntries over GlobalKVPool, index_scores, select_topk,
    candidate_pool, then a Reindex selection inside the pool) vs the batched reference."""
    g = torch.Generator().manual_seed(8)
    layout = BlockLayout(GEO, 64)
    kv_pool = GlobalKVPool(layout, num_blocks=60)
    e, n_blocks, kk = layout.entries_per_block[S20], 12, 64
    rows = [300, 37, 0, 129]
    blocks = torch.randperm(60, generator=g).tolist()
    q_raw = 2 * torch.randn(len(rows), IH, ID, generator=g)
    w = torch.randn(len(rows), IH, generator=g) * (ID**-0.5 * IH**-0.5)
    tables, exp_sel, exp_pool, exp_re, eng_scores = [], [], [], [], []
    for b, n in enumerate(rows):
        table = BlockTable([blocks.pop() for _ in range(max(1, -(-n // e)))])
        store = PagedEntries(kv_pool, S20, e, 1, table, 512, ID, dtype)
        store.write(torch.arange(n), torch.randn(n, 512, generator=g), torch.randn(n, ID, generator=g))
        tables.append(table.ids + [0] * (5 - len(table)))
        if n == 0:
            exp_sel.append([]), exp_pool.append(set()), exp_re.append([]), eng_scores.append(None)
            continue
        qi = mxfp4_qdq(q_raw[b : b + 1]).to(dtype)
        s = index_scores(qi, w[b : b + 1].to(dtype), store.index_keys(n))
        vis = torch.tensor([n])
        pool_mask = candidate_pool(s, vis, 8, n_blocks)
        exp_sel.append(select_topk(s, vis, kk)[0].tolist())
        exp_pool.append({int(j) // 8 for j in torch.nonzero(pool_mask[0]).flatten()})
        exp_re.append(select_topk(s, vis, 16, pool_mask)[0].tolist())
        eng_scores.append(s[0])
    args = dict(q=q_raw, weights=w, index_pool=kv_pool.streams[S20][1],
                block_table=torch.tensor(tables, dtype=torch.int32), n_visible=torch.tensor(rows, dtype=torch.int32))
    ref = indexer_topk_with_candidates(**args, k=kk, n_blocks=n_blocks, impl="reference", return_scores=True)
    re = indexer_topk(**args, k=16, candidates=(ref.cand_blocks, ref.cand_counts), impl="reference")
    tol = 2e-6 if dtype == torch.float32 else 1e-6  # fp32 reference vs the engine's fp32 / fp64 einsum
    for b, n in enumerate(rows):
        got = ref.sel_idx[b][ref.sel_idx[b] >= 0].tolist()
        assert got == [j for j in exp_sel[b] if j >= 0], f"row {b}: top-k differs from the engine"
        assert {int(c) for c in ref.cand_blocks[b] if c >= 0} == exp_pool[b], f"row {b}: candidate pool differs"
        assert re.sel_idx[b][re.sel_idx[b] >= 0].tolist() == [j for j in exp_re[b] if j >= 0], f"row {b}: reindex"
        if n:
            s = ref.scores[b, :n].double()
            mag = (w[b].abs().sum() * 100).item()  # a bound on sum_h |w_h relu(d_h)| for these magnitudes
            assert (s - eng_scores[b].double()).abs().max() <= tol * mag
            assert s.abs().max() > 0.01  # not a vacuous comparison
            assert select_topk(ref.scores[b : b + 1, :n], torch.tensor([n]), kk)[0].tolist() == exp_sel[b]


# ------------------------------------------------------------------ argument checks


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(q=lambda c: c["q"].half()), "q must be float32 or bfloat16 or uint8"),
        (dict(q=lambda c: c["q"][..., :100]), "ID a positive multiple of 32"),
        (dict(weights=lambda c: c["weights"][:, :5]), r"weights must have shape \[3, 32\]"),
        (dict(index_pool=lambda c: c["index_pool"][..., :-1]), r"index_pool must have shape \[\*, \*, 68\]"),
        (dict(block_table=lambda c: c["block_table"].long()), "block_table must be int32"),
        (dict(n_visible=lambda c: c["n_visible"][:2]), r"n_visible must have shape \[3\]"),
    ],
)
def test_invalid_arguments_raise(change, match):
    case = make_case(3, [37, 513, 0], seed=9)
    bad = {k: (change[k](case) if k in change else v) for k, v in case.items()}
    with pytest.raises(ValueError, match=match):
        indexer_topk(**bad)


def test_invalid_scalars_and_unsupported_triton_shapes_raise():
    case = make_case(3, [37, 513, 0], seed=9)
    for kw, match in ((dict(k=0), "k must be a positive int"), (dict(cand_block=True), "cand_block"),
                      (dict(candidates=(case["block_table"],)), "candidates must be a")):
        with pytest.raises(ValueError, match=match):
            indexer_topk(**case, **kw)
    with pytest.raises(ValueError, match="n_blocks must be a positive int"):
        indexer_topk_with_candidates(**case, n_blocks=0)
    with pytest.raises(ValueError, match="cand_block a power of two"):
        indexer_topk(**case, cand_block=6, impl="triton")
    small = {**case, "q": case["q"][..., :64], "index_pool": torch.zeros(4, 8, 34, dtype=torch.uint8)}
    with pytest.raises(ValueError, match="needs ID = 128"):
        indexer_topk(**small, impl="triton")
    small["block_table"] = small["block_table"] % 4
    small["n_visible"] = torch.tensor([3, 8, 0], dtype=torch.int32)
    assert indexer_topk(**small, k=4, impl="reference").counts.tolist() == [3, 4, 0]  # the reference takes ID = 64
    with pytest.raises(ValueError, match="n_visible must lie in"):
        indexer_topk(**{**case, "n_visible": torch.tensor([37, 9999, 0], dtype=torch.int32)}, impl="reference")


# ------------------------------------------------------------------ real geometry on a GPU

REAL = {1: [70_000], 3: [0, 37, 70_000], 17: [1, 511, 512, 513, 4096, 70_000], 64: [513, 4096, 35_000, 70_000]}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("b", list(REAL))
@pytest.mark.parametrize("config", [None, NORMAL], ids=["default", "normal_decode"])
def test_kernel_matches_reference_real_gpu(b, config):
    """Real pool size and contexts up to 70K entries; the reference runs on the GPU too (exact either way)."""
    case = make_case(b, REAL[b], device="cuda", seed=b, n_phys=b * 1100 + 64)
    out, ref = both(case, indexer_topk_with_candidates, config=config, k=K, n_blocks=2048)
    assert_same(out, ref, f"real B={b}")
    assert int(out.cand_counts.max()) == 2048  # the 70K rows keep a strict subset of their 8750 blocks
    cand = (out.cand_blocks, out.cand_counts)
    assert_same(*both(case, config=config, k=K, candidates=cand), f"reindex B={b}")
    ties = make_case(b, REAL[b], device="cuda", seed=b, distinct=2, n_phys=b * 1100 + 64)
    assert_same(*both(ties, config=config, k=K), f"ties B={b}")


@pytest.mark.parametrize("path", ["kth-value", "sort"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_select_topk_reference_is_the_stable_sort_selection(dtype, path, monkeypatch):
    """Both paths of the reference, the sort-free one (k-th value, then ties in position order) and the sort,
    pick what the engine's stable descending sort picks, on rows full of ties and -inf (the engine's
    ``select_topk`` is the oracle), counts included; rows with a NaN take the sort. A selection that breaks
    ties to the higher position is caught."""
    from flashtier.kernels.indexer_topk import reference
    from flashtier.kernels.indexer_topk.reference import select_topk_reference

    monkeypatch.setattr(reference, "SORT_BELOW", 0 if path == "kth-value" else 1 << 30)

    g = torch.Generator().manual_seed(3)
    for trial in range(400):
        b, length, k = 1 + trial % 5, 1 + (trial * 13) % 97, 1 + trial % 19
        scores = torch.randint(-2, 3, (b, length), generator=g).to(dtype)  # ties everywhere
        if trial % 3 == 0:
            scores = torch.randn(b, length, generator=g, dtype=dtype)
        scores[torch.rand(b, length, generator=g) < (trial % 4) / 4] = float("-inf")
        if trial % 29 == 0:
            scores[0, length // 2] = float("nan")
        pos, counts = select_topk_reference(scores, k)
        finite = scores > float("-inf")  # NaN compares false: never selected, as the sort's gather of `valid` says
        want = select_topk(scores.masked_fill(~finite, float("-inf")), torch.full((b,), length), k, finite)
        if trial % 29 != 0:  # with a NaN the engine's masked sort and the reference's sort place NaN differently
            assert torch.equal(pos[:, : want.shape[1]], want), (trial, scores)
            assert torch.equal(counts, (want >= 0).sum(1))
        assert bool((pos[:, min(k, length):] == -1).all())
    ties = torch.tensor([[1.0, 5.0, 1.0, 1.0, 0.0]])
    assert select_topk_reference(ties, 3)[0].tolist() == [[0, 1, 2]]
    flipped = select_topk_reference(ties.flip(1), 3)[0]  # ties to the higher position: [1, 2, 3] in the original
    assert sorted(4 - int(i) for i in flipped[0]) != [0, 1, 2]
