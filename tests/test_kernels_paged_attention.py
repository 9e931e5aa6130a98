"""paged_attention (Triton) against paged_attention_ref on small shapes.

CI has no GPU: the kernels run in Triton's CPU interpreter on CPU tensors (tests/conftest.py
sets TRITON_INTERPRET=1 before triton is imported). On a CUDA machine they run compiled.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

ON_GPU = torch.cuda.is_available()

from hf_paged.worker.forward_context import AttentionMetadata  # noqa: E402

# import_module, not `import ... as`: the package re-exports a function named paged_attention,
# which shadows the submodule as an attribute.
kv_write_mod = importlib.import_module("hf_paged.kernels.kv_write")
pa_mod = importlib.import_module("hf_paged.kernels.paged_attention")
config_mod = importlib.import_module("hf_paged.kernels.attention_config")
kernel_mod = importlib.import_module("hf_paged.kernels.paged_attention_kernel")

# tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported when there is no GPU.
if not ON_GPU and not kv_write_mod.interpreting():
    raise RuntimeError(
        "no GPU and the kernels are not interpreted: TRITON_INTERPRET=1 was not set "
        "before triton was imported (tests/conftest.py sets it)"
    )


paged_attention = pa_mod.paged_attention
paged_attention_ref = pa_mod.paged_attention_ref
AttentionConfig = config_mod.AttentionConfig
decode_attention = importlib.import_module("hf_paged.kernels.decode_attention").decode_attention

DEVICE = torch.device("cuda" if ON_GPU else "cpu")
# (atol, rtol) against the float32 reference computed from the same (rounded) inputs. Outputs
# are convex combinations of V rows, so errors are counted in the dtype's spacing near 1:
# | dtype    | ulp at 1 | atol   | rtol | why                                                |
# | float32  | 1.2e-7   | 2e-5   | 1e-4 | exp2 softmax, another summation order than torch    |
# |          |          | 1e-4   | 1e-4 | on a GPU: hardware exp2 and the dot's own order     |
# | float16  | 9.8e-4   | 2e-3   | 5e-3 | P rounded to fp16 before P.V, output rounded: 2 ulp |
# | bfloat16 | 7.8e-3   | 1.6e-2 | 2e-2 | the same two roundings, 8-bit mantissa: 2 ulp       |
# NaN never passes (checked separately).
TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 5e-3), torch.bfloat16: (1.6e-2, 2e-2)}
if ON_GPU:
    TOL[torch.float32] = (1e-4, 1e-4)


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    num_blocks: int | None = None,
    high_block_ids: bool = False,
    unowned_tokens: int = 0,
    seed: int = 0,
):
    """Random query, a NaN-poisoned paged cache with each sequence's context written at random
    physical blocks, and the metadata. Unused block-table entries point far out of range."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    needed = sum(blocks_per_seq)
    if num_blocks is None:
        num_blocks = needed + 3
    num_tokens = sum(q_lens) + unowned_tokens
    query = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # NaN everywhere no sequence's context lives: reading any of it would poison the output.
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    if high_block_ids:
        ids = torch.arange(num_blocks - needed, num_blocks)[torch.randperm(needed, generator=gen)]
    else:
        ids = torch.randperm(num_blocks, generator=gen)[:needed]
    max_blocks = max(blocks_per_seq, default=0) + 2
    block_table = torch.full((len(seq_lens), max_blocks), 2**30, dtype=torch.int32)
    pos = 0
    for i, (n, seq_len) in enumerate(zip(blocks_per_seq, seq_lens)):
        block_table[i, :n] = ids[pos : pos + n].int()
        pos += n
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        for j in range(seq_len):
            key_cache[block_table[i, j // block_size], j % block_size] = k[j]
            value_cache[block_table[i, j // block_size], j % block_size] = v[j]
    # no host lists: the kernels must work from device metadata alone
    meta = AttentionMetadata.from_lengths(
        q_lens, seq_lens, block_table.to(DEVICE), num_tokens=num_tokens, host_lists=False
    )
    return query.to(DEVICE), key_cache.to(DEVICE), value_cache.to(DEVICE), meta


def check(
    q_lens,
    seq_lens,
    num_q_heads,
    num_kv_heads,
    head_dim,
    block_size=16,
    dtype=torch.float32,
    sliding_window=None,
    softcap=None,
    scale=None,
    num_kv_splits=None,
    config=None,
    **batch_kw,
):
    query, key_cache, value_cache, meta = make_batch(
        q_lens, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, **batch_kw
    )
    scale = scale if scale is not None else head_dim**-0.5
    out = torch.full_like(query, float("nan"))  # poisoned: every element must be written
    res = paged_attention(
        query,
        key_cache,
        value_cache,
        meta,
        scale,
        sliding_window,
        softcap,
        out=out,
        num_kv_splits=num_kv_splits,
        config=config,
    )
    assert res is out
    ref = paged_attention_ref(query, key_cache, value_cache, meta, scale, sliding_window, softcap)
    assert not torch.isnan(out).any(), "NaN in output (unwritten element or NaN leak)"
    assert not torch.isnan(ref).any()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    return out, ref


def test_runs_on_cpu_in_interpreter():
    if ON_GPU:
        pytest.skip("CUDA machine: kernels run compiled")
    # every kernel module shares this switch (kv_write.interpreting): one check covers them
    assert type(kernel_mod._paged_attention_kernel).__name__ == "InterpretedFunction"
    assert kv_write_mod.interpreting()
    query, key_cache, value_cache, meta = make_batch([1], [5], 2, 1, 64)
    assert query.device.type == "cpu"
    paged_attention(query, key_cache, value_cache, meta, 0.125)


# (num_q_heads, num_kv_heads, head_dim, block_size, dtype): GQA 1/4/7/8, odd head sizes, dtypes
SHAPES = [
    (2, 2, 64, 16, torch.float32),
    (4, 1, 128, 32, torch.bfloat16),
    (7, 1, 80, 16, torch.float32),
    (16, 2, 96, 16, torch.float16),
    (8, 1, 80, 32, torch.bfloat16),
]
SHAPE_IDS = [
    "g1-d64-b16-f32",
    "g4-d128-b32-bf16",
    "g7-d80-b16-f32",
    "g8-d96-b16-f16",
    "g8-d80-b32-bf16",
]


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_decode_only(shape):
    hq, hkv, d, bs, dtype = shape
    check([1, 1, 1, 1], [1, 17, 40, 70], hq, hkv, d, bs, dtype)


@pytest.mark.parametrize("shape", SHAPES[:3], ids=SHAPE_IDS[:3])
def test_prefill_only(shape):
    hq, hkv, d, bs, dtype = shape
    check([37, 5, 1], [37, 5, 1], hq, hkv, d, bs, dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_mixed_prefill_chunks_and_decodes(shape):
    hq, hkv, d, bs, dtype = shape
    # decode, prefill from scratch, chunk over a cached prefix, decode, short chunk
    check([1, 23, 30, 1, 3], [33, 23, 75, 9, 20], hq, hkv, d, bs, dtype)


@pytest.mark.parametrize("host_lists", [False, True])
def test_mixed_short_long_boundary(host_lists):
    # G = 4: decode tiles hold 4 tokens, so q_len 4 is "short" (decode launch), 5 is "long"
    query, key_cache, value_cache, meta = make_batch(
        [4, 5, 1, 0, 9], [30, 5, 17, 8, 40], 8, 2, 64, 16, unowned_tokens=2
    )
    if host_lists:
        meta.query_start_loc_host = meta.query_start_loc.tolist()
        meta.seq_lens_host = meta.seq_lens.tolist()
        meta.min_query_len = 0
    out = torch.full_like(query, float("nan"))
    paged_attention(query, key_cache, value_cache, meta, 0.125, out=out)
    ref = paged_attention_ref(query, key_cache, value_cache, meta, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_prefill_only_with_host_lists_single_launch():
    # no short sequence: the host lists let the wrapper skip the decode-shaped launch
    query, key_cache, value_cache, meta = make_batch([37, 5], [50, 5], 8, 2, 64, 16)
    meta.query_start_loc_host = meta.query_start_loc.tolist()
    meta.seq_lens_host = meta.seq_lens.tolist()
    meta.min_query_len = 5
    out = torch.full_like(query, float("nan"))
    paged_attention(query, key_cache, value_cache, meta, 0.125, out=out)
    ref = paged_attention_ref(query, key_cache, value_cache, meta, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_prefix_plus_chunk_many_q_tiles():
    # G = 1 -> BLOCK_Q = 128: a 300-token chunk spans 3 q-tiles over a 150-token prefix
    check([300], [450], 1, 1, 64, 16)


def test_head_dim_256():
    check([1, 9], [40, 30], 2, 1, 256, 16, torch.bfloat16)


@pytest.mark.parametrize("window", [1, 8, 33])
def test_sliding_window(window):
    check([1, 23, 30, 1], [80, 23, 75, 9], 4, 1, 64, 16, sliding_window=window)


def test_softcap():
    # a large scale pushes scores into tanh's saturating range
    check([1, 20, 1], [40, 50, 7], 4, 2, 64, 16, softcap=5.0, scale=1.0)


def test_softcap_and_window_bf16():
    check([1, 20], [70, 50], 8, 1, 80, 16, torch.bfloat16, sliding_window=16, softcap=30.0)


def test_high_block_ids():
    # ids near the top of a ~3k-block cache (the > 2^31-element case runs on the GPU)
    check([1, 12, 1], [60, 30, 100], 4, 1, 64, 16, num_blocks=3000, high_block_ids=True)


@pytest.mark.parametrize("splits", [2, 3, 8])
def test_split_kv_forced(splits):
    # 8 splits of a 70-key context leave some splits empty; the reduce must weigh them 0
    check([1, 1, 1], [70, 200, 5], 8, 2, 64, 16, num_kv_splits=splits)


def test_split_kv_spec_decode_window_softcap():
    # q_len 2 per sequence (speculative verify) still fits one q-tile at G = 4 (BLOCK_Q = 4)
    check(
        [2, 2, 1],
        [150, 90, 33],
        4,
        1,
        96,
        32,
        torch.float16,
        sliding_window=40,
        softcap=20.0,
        num_kv_splits=4,
    )


def test_small_tiles_many_edges():
    # 16x16 tiles: many q-tiles and KV tiles per sequence, every masked/unmasked segment kind
    cfg = AttentionConfig(
        block_m=16, block_q=4, block_n=16, num_warps=4, num_stages=2, one_tile_per_seq=False
    )
    check([1, 37, 20], [50, 37, 61], 8, 2, 64, 16, config=cfg)
    check([1, 37, 20], [50, 37, 61], 8, 2, 64, 16, sliding_window=13, config=cfg)


def test_small_tiles_odd_group():
    # G = 7 in 16 rows: BLOCK_Q = 2, rows 14-15 are padding and must not be stored
    cfg = AttentionConfig(
        block_m=16, block_q=2, block_n=16, num_warps=4, num_stages=2, one_tile_per_seq=False
    )
    check([5, 1, 3], [21, 18, 3], 7, 1, 80, 16, config=cfg)


@pytest.mark.parametrize("num_kv_splits", [None, 3])
def test_unowned_tokens_and_empty_sequences_zeroed(num_kv_splits):
    # a sequence with no new tokens this step, and 70 trailing tokens no sequence owns
    out, _ = check(
        [1, 0, 1], [20, 11, 64], 4, 1, 64, 16, unowned_tokens=70, num_kv_splits=num_kv_splits
    )
    assert (out[2:] == 0).all()


def test_unowned_tokens_prefill_path():
    out, _ = check([10, 0], [10, 5], 2, 1, 64, 16, unowned_tokens=3)
    assert (out[10:] == 0).all()


def test_no_sequences_all_unowned():
    query, key_cache, value_cache, meta = make_batch([1], [4], 4, 2, 64)
    meta = AttentionMetadata(
        meta.query_start_loc[:1],
        meta.seq_lens[:0],
        meta.block_table[:0],
        meta.slot_mapping,
        max_query_len=0,
        max_seq_len=0,
    )
    out = paged_attention(query, key_cache, value_cache, meta, 0.1, out=torch.full_like(query, 7))
    assert (out == 0).all()


def test_default_out_and_empty_batch():
    query, key_cache, value_cache, meta = make_batch([3, 1], [3, 9], 4, 2, 64)
    out = paged_attention(query, key_cache, value_cache, meta, 0.1)
    torch.testing.assert_close(
        out, paged_attention_ref(query, key_cache, value_cache, meta, 0.1), atol=2e-5, rtol=1e-4
    )
    empty = paged_attention(query[:0], key_cache, value_cache, meta, 0.1)
    assert empty.shape == (0, 4, 64)


def test_strided_query_and_out():
    # query as a view into a fused [T, Hq + 2 Hkv, D] projection; out into a wider buffer
    query, key_cache, value_cache, meta = make_batch([4, 1], [6, 20], 4, 2, 64)
    fused = torch.randn(5, 8, 64, device=DEVICE)
    fused[:, :4] = query
    q_view = fused[:, :4]
    buf = torch.full((5, 6, 64), float("nan"), device=DEVICE)
    res = paged_attention(q_view, key_cache, value_cache, meta, 0.125, out=buf[:, 1:5])
    ref = paged_attention_ref(query, key_cache, value_cache, meta, 0.125)
    torch.testing.assert_close(res, ref, atol=2e-5, rtol=1e-4)
    assert torch.isnan(buf[:, 0]).all() and torch.isnan(buf[:, 5]).all()


# ---- wrapper errors ---------------------------------------------------------------------------


def _args():
    query, key_cache, value_cache, meta = make_batch([2, 1], [2, 9], 4, 2, 64)
    return query, key_cache, value_cache, meta


def _meta_with(meta, **kw):
    fields = {
        "query_start_loc": meta.query_start_loc,
        "seq_lens": meta.seq_lens,
        "block_table": meta.block_table,
        "slot_mapping": meta.slot_mapping,
        "max_query_len": meta.max_query_len,
        "max_seq_len": meta.max_seq_len,
    }
    fields.update(kw)
    return AttentionMetadata(**fields)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda q, k, v, m: (q[0], k, v, m, {}), "query must be"),
        (lambda q, k, v, m: (q, k[0], v, m, {}), "key_cache must be"),
        (lambda q, k, v, m: (q, k, v[:, :, :1], m, {}), "value_cache shape"),
        (lambda q, k, v, m: (q[:, :3], k, v, m, {}), "multiple of key_cache kv heads"),
        (lambda q, k, v, m: (q[..., :32], k, v, m, {}), "head_dim"),
        (lambda q, k, v, m: (q.half(), k, v, m, {}), "key_cache dtype"),
        (lambda q, k, v, m: (q.int(), k, v, m, {}), "query dtype"),
        (
            lambda q, k, v, m: (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, m, {}),
            "query must be contiguous in head_dim",
        ),
        (
            lambda q, k, v, m: (q, k, v, _meta_with(m, seq_lens=m.seq_lens.long()), {}),
            "meta.seq_lens must be int32",
        ),
        (
            lambda q, k, v, m: (q, k, v, _meta_with(m, query_start_loc=m.query_start_loc[:2]), {}),
            "meta.query_start_loc must have shape",
        ),
        (
            lambda q, k, v, m: (q, k, v, _meta_with(m, block_table=m.block_table[:1]), {}),
            "meta.block_table must be",
        ),
        (
            lambda q, k, v, m: (
                q,
                k,
                v,
                _meta_with(m, block_table=m.block_table.t().contiguous().t()),
                {},
            ),
            "meta.block_table must be contiguous",
        ),
        (lambda q, k, v, m: (q, k, v, m, {"out": q[:, :2]}), "out shape"),
        (lambda q, k, v, m: (q, k, v, m, {"out": q.half()}), "out dtype"),
        (lambda q, k, v, m: (q, k, v, m, {"num_kv_splits": 0}), "num_kv_splits"),
    ],
)
def test_wrapper_errors(mutate, match):
    query, key_cache, value_cache, meta = _args()
    q, k, v, m, kw = mutate(query, key_cache, value_cache, meta)
    with pytest.raises(ValueError, match=match):
        paged_attention(q, k, v, m, 0.1, **kw)


def test_wrapper_error_block_size_not_power_of_two():
    query, _, _, meta = _args()
    cache = torch.zeros(4, 12, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="block_size must be a power of 2"):
        paged_attention(query, cache, cache, meta, 0.1)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device to mix devices")
def test_wrapper_error_device_mismatch():
    query, key_cache, value_cache, meta = _args()
    with pytest.raises(ValueError, match="key_cache is on"):
        paged_attention(query, key_cache.cpu(), value_cache, meta, 0.1)


# ---- kernels/decode_attention.py: one query token per sequence, cache read before the PDL wait


def check_decode(
    seq_lens, hq, hkv, d, block_size=16, dtype=torch.float32, window=None, softcap=None, splits=None
):
    q, kc, vc, meta = make_batch([1] * len(seq_lens), seq_lens, hq, hkv, d, block_size, dtype)
    scale = d**-0.5
    got = decode_attention(q, kc, vc, meta, scale, window, softcap, num_kv_splits=splits, pdl=False)
    ref = paged_attention_ref(q, kc, vc, meta, scale, window, softcap)
    assert not torch.isnan(got).any(), "NaN: a masked or unwritten element was read"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol)
    # the general kernel's decode tiles: same tiles, same order of keys
    general = paged_attention(q, kc, vc, meta, scale, window, softcap, num_kv_splits=splits)
    torch.testing.assert_close(got.float(), general.float(), atol=atol / 4, rtol=rtol / 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [None, 1, 3, 8])
def test_decode_attention_matches_reference_across_tiles_and_splits(dtype, splits):
    # 1 key; a full 128-key tile; one key past it (the new token opens a tile); several tiles
    check_decode([1, 128, 129, 300], 8, 2, 64, dtype=dtype, splits=splits)


@pytest.mark.parametrize("hq, hkv, d, block_size", [(4, 4, 32, 16), (8, 1, 80, 32), (6, 2, 16, 8)])
def test_decode_attention_head_layouts_and_page_sizes(hq, hkv, d, block_size):
    check_decode([5, 70, 140], hq, hkv, d, block_size, splits=2)


@pytest.mark.parametrize("splits", [None, 4])
def test_decode_attention_sliding_window_and_softcap(splits):
    # windows ending inside the first tile, on a tile edge, and covering everything
    check_decode([200, 257, 20], 4, 1, 32, window=64, splits=splits)
    check_decode([200, 257, 20], 4, 1, 32, window=129, softcap=30.0, splits=splits)
    check_decode([40], 4, 2, 32, dtype=torch.bfloat16, softcap=20.0, splits=splits)


@pytest.mark.parametrize(
    "kv_heads, max_seq_len, want",
    [(1, 100, 1), (1, 300, 2), (1, 2048, 16), (1, 1 << 20, 32), (4, 2048, 16), (8, 2048, 4)],
)
def test_decode_attention_default_split_is_one_key_tile(monkeypatch, kv_heads, max_seq_len, want):
    # each split's first key tile is read before the PDL wait, so splits of one tile (BLOCK_N
    # keys, 128 at head_dim 64), at most 32, unless that grid takes more than half the SMs
    # (8 KV heads x 16 on 132 SMs): then paged_attention's own count, >= 512 keys a split
    mod = importlib.import_module("hf_paged.kernels.decode_attention")  # the module
    monkeypatch.setattr(config_mod, "num_sms", lambda device: 132)  # an H200
    seen = []
    real = mod._reduce_splits
    monkeypatch.setattr(mod, "_reduce_splits", lambda *a: seen.append(a[4]) or real(*a))
    q, kc, vc, meta = make_batch([1], [20], 8, kv_heads, 64)
    meta.max_seq_len = max_seq_len  # as a CUDA graph captured for max_model_len sets it
    got = decode_attention(q, kc, vc, meta, 0.125)
    assert seen == ([want] if want > 1 else [])
    torch.testing.assert_close(got, paged_attention_ref(q, kc, vc, meta, 0.125))


@pytest.mark.parametrize(
    "q_lens, field",
    [([1, 2], "max_query_len"), ([1, 1], "num_kv_splits")],
)
def test_decode_attention_bad_batches_raise_value_error(q_lens, field):
    q, kc, vc, meta = make_batch(q_lens, [10, 12], 4, 2, 32)
    splits = 0 if field == "num_kv_splits" else None
    with pytest.raises(ValueError, match=field):
        decode_attention(q, kc, vc, meta, 0.1, num_kv_splits=splits)
