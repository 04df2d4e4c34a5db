"""Decode matmuls that read one layer of a weight stacked over layers in place (dense stacked_gemv, packed
stacked_quant_matmul, and linear() on a LayerSlice), against float64 products of that layer's stored values.
Interpreted on CPU, compiled on a GPU."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as T

from luxjax.checkpoint.quants import QuantizedTensor, dequantize
from luxjax.ops import backend, linear as linear_mod
from luxjax.ops.linear import LayerSlice
from pallas_kernels import dense_gemm
from pallas_kernels.common import ROCM_SHARED_BYTES
from pallas_kernels.dense_gemv import BlockSizes, split_count, stacked_gemv, stacked_gemv_reference
from pallas_kernels.quant_matmul import stacked_quant_matmul
from test_quant_matmul import check, random_weight


def stack(weights):
    return jax.tree.map(lambda *a: jnp.stack(a), *weights)


@pytest.mark.parametrize("m", [1, 5, 16, 27])  # 27: the dot at 32 rows (both parts of a float32 x)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("out,k", [(48, 80), (64, 1536)])
def test_stacked_gemv_reads_the_chosen_layer(m, dtype, out, k, seed, interpret):
    rng = np.random.default_rng(seed)
    layers = int(rng.integers(2, 5))
    w = jnp.asarray(rng.standard_normal((layers, out, k)), dtype)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    layer = int(rng.integers(0, layers))
    got = stacked_gemv(x, w, jnp.int32(layer), interpret=interpret)
    msg = f"x[{m},{k}] {jnp.dtype(dtype).name} W[{layers},{out},{k}] layer {layer} seed {seed}"
    assert got.dtype == x.dtype, msg
    dense = np.asarray(w[layer].astype(jnp.float32), np.float64)
    check(got, x, dense, dtype, msg)
    check(stacked_gemv_reference(x, w, jnp.int32(layer)), x, dense, dtype, f"{msg} (reference)")
    wide = stacked_gemv(x, w, jnp.int32(layer), out_dtype=jnp.float32, interpret=interpret)
    check(wide, x, dense, dtype, f"{msg} (float32 out)", tol=2e-5 if dtype == jnp.float32 else 4e-3)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("splits", [1, 2, 8])
def test_stacked_gemv_split_k_sums_every_part(m, splits, seed, interpret):
    """K split over several programs per row tile (few output rows): the partial sums add up to the product."""
    rng = np.random.default_rng(seed)
    layers, out, k = 3, 48, 1024
    w = jnp.asarray(rng.standard_normal((layers, out, k)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    layer = int(rng.integers(0, layers))
    bs = BlockSizes(16, 64, 4, 1, splits)
    got = stacked_gemv(x, w, jnp.int32(layer), block_sizes=bs, out_dtype=jnp.float32, interpret=interpret)
    check(got, x, np.asarray(w[layer].astype(jnp.float32), np.float64), jnp.bfloat16,
          f"x[{m},{k}] W[{layers},{out},{k}] layer {layer} splits {splits} seed {seed}", tol=4e-3)


def test_split_count_fills_the_device_within_the_steps():
    assert split_count(row_tiles=544, steps=20, min_programs=512) == 1
    assert split_count(row_tiles=160, steps=68, min_programs=512) == 4  # 640 programs
    assert split_count(row_tiles=160, steps=68, min_programs=264) == 2  # 320 programs
    assert split_count(row_tiles=3, steps=20, min_programs=512) == 4  # stops where the steps no longer split evenly
    assert split_count(row_tiles=3, steps=64, min_programs=512) == 64  # every step its own program, still short


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("out,k", [(48, 80), (256, 512)])
def test_stacked_gemm_reads_the_chosen_layer(dtype, out, k, seed, interpret):
    """The prefill-sized product on a stacked weight, at a random row count (x padded to the row tile inside)."""
    rng = np.random.default_rng(seed)
    layers, m = int(rng.integers(2, 5)), int(rng.integers(17, 200))
    w = jnp.asarray(rng.standard_normal((layers, out, k)), dtype)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    layer = int(rng.integers(0, layers))
    msg = f"x[{m},{k}] {jnp.dtype(dtype).name} W[{layers},{out},{k}] layer {layer} seed {seed}"
    assert dense_gemm.supported(x.shape, w.shape, x.dtype, w.dtype), msg
    got = dense_gemm.stacked_gemm(x, w, jnp.int32(layer), interpret=interpret)
    assert got.dtype == x.dtype, msg
    dense = np.asarray(w[layer].astype(jnp.float32), np.float64)
    tol = 2e-3 if dtype == jnp.float16 else None  # the float16 output's rounding; bf16's is TOL's
    check(got, x, dense, jnp.bfloat16, msg, tol=tol)
    check(dense_gemm.stacked_gemm_reference(x, w, jnp.int32(layer)), x, dense, jnp.bfloat16, f"{msg} (reference)",
          tol=tol)
    wide = dense_gemm.stacked_gemm(x, w, jnp.int32(layer), out_dtype=jnp.float32, interpret=interpret)
    check(wide, x, dense, dtype, f"{msg} (float32 out)", tol=4e-3)


@pytest.mark.parametrize("splits", [None, 2])
def test_stacked_gemm_two_parts_of_x(splits, seed, interpret):
    """x_lo: float32 x as its bf16 high part and the bf16 rounding of the rest, both times each W tile into one
    accumulator: (hi + lo) @ W keeps ~16 bits of x, far closer to float32 x @ W than hi @ W alone."""
    rng = np.random.default_rng(seed)
    layers, m, out, k = 3, int(rng.integers(17, 150)), 64, 512
    w = jnp.asarray(rng.standard_normal((layers, out, k)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    hi = x.astype(jnp.bfloat16)
    lo = (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)
    layer = int(rng.integers(0, layers))
    bs = None if splits is None else dense_gemm.BlockSizes(64, 32, 64, 4, 2, splits)
    got = dense_gemm.stacked_gemm(hi, w, jnp.int32(layer), x_lo=lo, block_sizes=bs, out_dtype=jnp.float32,
                                  interpret=interpret)
    dense = np.asarray(w[layer].astype(jnp.float32), np.float64)
    msg = f"x[{m},{k}] W[{layers},{out},{k}] layer {layer} splits {splits} seed {seed}"
    check(got, x, dense, jnp.float32, msg, tol=1e-4)
    with pytest.raises(AssertionError):  # the high part alone misses by bf16's rounding of x
        check(dense_gemm.stacked_gemm(hi, w, jnp.int32(layer), out_dtype=jnp.float32, interpret=interpret), x, dense,
              jnp.float32, msg, tol=1e-4)


@pytest.mark.parametrize("splits", [2, 4])
def test_stacked_gemm_split_k_sums_every_part(splits, seed, interpret):
    rng = np.random.default_rng(seed)
    layers, m, out, k = 2, int(rng.integers(17, 64)), 32, 256
    w = jnp.asarray(rng.standard_normal((layers, out, k)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    layer = int(rng.integers(0, layers))
    bs = dense_gemm.BlockSizes(64, 16, 32, 4, 1, splits)
    got = dense_gemm.stacked_gemm(x, w, jnp.int32(layer), block_sizes=bs, out_dtype=jnp.float32, interpret=interpret)
    check(got, x, np.asarray(w[layer].astype(jnp.float32), np.float64), jnp.bfloat16,
          f"x[{m},{k}] W[{layers},{out},{k}] layer {layer} splits {splits} seed {seed}", tol=4e-3)


# The 27B's prefill products at a 1,024-row step: (out, in)
PREFILL_SHAPES = [(17408, 5120), (5120, 17408), (6144, 5120), (12288, 5120), (1024, 5120), (10240, 5120)]


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
def test_stacked_gemm_stages_fit_the_platforms_shared_memory(monkeypatch, platform):
    """On ROCm the default tiles keep fewer pipeline stages, so that AMD's pipeliner's num_stages - 1 sets of tiles
    (one or two x tiles and a W tile per stage, 16-bit) fit gfx942's 64 KiB of LDS; on CUDA the tuned stages stay."""
    monkeypatch.setattr(backend, "gpu_platform", lambda: platform)
    for (n, k), x_tiles in itertools.product(PREFILL_SHAPES, (1, 2)):
        bs = dense_gemm.BlockSizes.get_default(1024, n, k)
        monkeypatch.setattr(backend, "gpu_platform", lambda: "cuda")
        tuned = dense_gemm.BlockSizes.get_default(1024, n, k)
        monkeypatch.setattr(backend, "gpu_platform", lambda: platform)
        stages = bs.num_stages if x_tiles == 1 else bs.fitted_stages(x_tiles=2)
        lds = (stages - 1) * 2 * (x_tiles * bs.block_m + bs.block_n) * bs.block_k
        if platform == "rocm":
            assert 1 <= stages and lds <= ROCM_SHARED_BYTES, (n, k, x_tiles, bs)
            assert stages == 1 or (stages * 2 * (x_tiles * bs.block_m + bs.block_n) * bs.block_k > ROCM_SHARED_BYTES
                                   or stages == tuned.num_stages), f"{n}x{k}: fewer stages than fit ({bs})"
        else:
            assert bs == tuned and bs.fitted_stages(x_tiles) == bs.num_stages


def test_stacked_gemm_with_rocms_tiles(monkeypatch, seed, interpret):
    """The product with the default tiles chosen for ROCm (fewer stages) keeps its values."""
    monkeypatch.setattr(backend, "gpu_platform", lambda: "rocm")
    rng = np.random.default_rng(seed)
    layers, m, out, k = 2, int(rng.integers(17, 130)), 256, 512
    w = jnp.asarray(rng.standard_normal((layers, out, k)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    layer = int(rng.integers(0, layers))
    tiles = dense_gemm.BlockSizes.get_default(m, out, k)  # passed on: the jitted kernel's cache does not know it
    got = dense_gemm.stacked_gemm(x, w, jnp.int32(layer), block_sizes=tiles, out_dtype=jnp.float32,
                                  interpret=interpret)
    check(got, x, np.asarray(w[layer].astype(jnp.float32), np.float64), jnp.bfloat16,
          f"x[{m},{k}] W[{layers},{out},{k}] layer {layer} (ROCm tiles {tiles}) seed {seed}", tol=4e-3)


def test_stacked_gemm_refuses_what_it_cannot_tile():
    assert not dense_gemm.supported((16, 64), (2, 32, 64), jnp.bfloat16, jnp.bfloat16)  # decode rows: the GEMV's
    assert not dense_gemm.supported((40, 64), (2, 32, 64), jnp.float32, jnp.bfloat16)  # mixed dtypes
    assert not dense_gemm.supported((40, 64), (2, 32, 64), jnp.float32, jnp.float32)  # float32 stays on cuBLAS
    assert not dense_gemm.supported((40, 72), (2, 24, 72), jnp.bfloat16, jnp.bfloat16)  # 24 rows: no 16-row tile
    assert dense_gemm.supported((2, 20, 64), (2, 48, 64), jnp.bfloat16, jnp.bfloat16)


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS], ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 2, 4, 6])  # the GEMV reduce over 1, 2 and 4 rows (each format up to its own), skinny
def test_stacked_quant_matmul_reads_the_chosen_layer(ggml_type, m, seed, interpret):
    rng = np.random.default_rng(seed)
    layers, out, k = int(rng.integers(2, 4)), 64, 512
    pairs = [random_weight(rng, ggml_type, out, k) for _ in range(layers)]
    stacked = stack([w for w, _ in pairs])
    assert stacked.shape == (out, k), "a stacked tensor keeps one layer's logical shape"
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    layer = int(rng.integers(0, layers))
    got = stacked_quant_matmul(x, stacked, jnp.int32(layer), interpret=interpret)
    check(got, x, pairs[layer][1], jnp.float32, f"{ggml_type.name} x[{m},{k}] layer {layer}/{layers} seed {seed}")


@pytest.mark.parametrize("weight", ["bf16", "IQ4_XS", "Q6_K odd rows"])
@pytest.mark.parametrize("pallas", [False, True])
def test_linear_on_layer_slice(monkeypatch, seed, weight, pallas):
    """linear() on a LayerSlice: when Pallas is chosen and the rows fit its tiles, the stacked kernels read the layer
    in place (decode-sized x: the GEMVs; more rows: the in-place GEMM for a dense weight and x of its dtype, the
    dequantize kernel for a packed one); otherwise the layer is sliced and takes the usual path. Same values."""
    rng = np.random.default_rng(seed)
    layers, k = 3, 256
    if weight == "bf16":
        out = 32
        ws = [jnp.asarray(rng.standard_normal((out, k)), jnp.bfloat16) for _ in range(layers)]
        dense = [np.asarray(w.astype(jnp.float32), np.float64) for w in ws]
    else:
        ggml_type, out = (T.IQ4_XS, 32) if weight == "IQ4_XS" else (T.Q6_K, 45)
        pairs = [random_weight(rng, ggml_type, out, k) for _ in range(layers)]
        ws, dense = [w for w, _ in pairs], [d for _, d in pairs]
    monkeypatch.setattr(backend, "use_pallas", lambda: pallas)
    monkeypatch.setattr(backend, "interpret", lambda: True)
    in_place = []
    real = linear_mod._in_place_linear
    monkeypatch.setattr(linear_mod, "_in_place_linear", lambda *a: (lambda y: in_place.append(y is not None) or y)(
        real(*a)))
    layer = int(rng.integers(0, layers))
    sliced = LayerSlice(stack(ws), jnp.int32(layer))
    prefill_rows = int(rng.integers(linear_mod._PALLAS_MAX_ROWS + 1, 100))
    cases = [(1, jnp.float32, True), (4, jnp.float32, True), (prefill_rows, jnp.float32, weight != "bf16"),
             (prefill_rows, jnp.bfloat16, True)]
    for rows, x_dtype, kernel_expected in cases:
        x = jnp.asarray(rng.standard_normal((rows, k)), x_dtype)
        got = linear_mod.linear(x, sliced)
        expect_kernel = pallas and kernel_expected and weight != "Q6_K odd rows"
        assert in_place[-1] == expect_kernel, f"{weight} rows {rows}: in-place kernel used: {in_place[-1]}"
        check(got, x, dense[layer], x_dtype, f"{weight} rows {rows} layer {layer} pallas {pallas} seed {seed}")


@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("pallas", [False, True])
def test_linear_many_projects_one_input_in_one_launch(monkeypatch, seed, x_dtype, pallas):
    """linear_many / split_linear_many on dense LayerSlices of one layer: one stacked_gemv_many launch for decode
    rows when Pallas is chosen (a packed weight among them: one product each), the same values as one linear()
    per weight, and each output is its own weight's product."""
    rng = np.random.default_rng(seed)
    layers, k, outs = 3, 256, (64, 16, 48)
    ws = [jnp.asarray(rng.standard_normal((layers, out, k)), jnp.bfloat16) for out in outs]
    layer = int(rng.integers(0, layers))
    dense = [np.asarray(w[layer].astype(jnp.float32), np.float64) for w in ws]
    monkeypatch.setattr(backend, "use_pallas", lambda: pallas)
    monkeypatch.setattr(backend, "interpret", lambda: True)
    launches, split_gemms = [], []
    real = linear_mod._fused_in_place_linear
    monkeypatch.setattr(linear_mod, "_fused_in_place_linear", lambda *a: (
        lambda y: launches.append(y is not None) or y)(real(*a)))
    real_split = linear_mod._split_in_place_gemm
    monkeypatch.setattr(linear_mod, "_split_in_place_gemm", lambda *a: (
        lambda y: split_gemms.append(y is not None) or y)(real_split(*a)))
    sliced = [LayerSlice(w, jnp.int32(layer)) for w in ws]
    for rows in (1, 2, linear_mod._PALLAS_MAX_ROWS + 1):
        x = jnp.asarray(rng.standard_normal((rows, k)), x_dtype)
        launches.clear()
        got = linear_mod.linear_many(x, sliced)
        fused = pallas and rows <= linear_mod._PALLAS_MAX_ROWS
        # 64 rows alone in the wide group (one weight: the single kernel, no fused launch tried); 16 and 48 rows
        # fused together where Pallas is chosen (prefill rows: tried, declined)
        assert launches == ([fused] if pallas else []), f"rows {rows}: fused launches {launches}"
        for y, d, out in zip(got, dense, outs):
            check(y, x, d, x_dtype, f"{out} rows of {outs}, x[{rows}] layer {layer} pallas {pallas} seed {seed}")
        if x_dtype == jnp.float32:  # split_linear_many: float32 x, about 16 bits of it through bf16 products
            split_gemms.clear()
            for y, d, out in zip(linear_mod.split_linear_many(x, sliced), dense, outs):
                check(y, x, d, jnp.float32, f"split, {out} rows, x[{rows}] pallas {pallas}", tol=1e-4)
            # prefill rows: each weight by the in-place GEMM taking both parts of x (decode rows: the stacked rows)
            want = [pallas and rows > linear_mod._PALLAS_MAX_ROWS] * len(outs)
            assert split_gemms == want, f"rows {rows}: two-part GEMMs {split_gemms}"
    packed, _ = random_weight(rng, T.Q8_0, 32, k)
    launches.clear()
    mixed = [sliced[0], LayerSlice(stack([packed] * layers), jnp.int32(layer))]
    linear_mod.linear_many(jnp.ones((1, k), x_dtype), mixed)
    assert not any(launches), "a packed weight among them: no fused launch"


@pytest.mark.parametrize("weight", ["Q4_K", "IQ4_XS", "bf16"])
def test_split_linear_takes_both_parts_in_one_launch(monkeypatch, seed, weight):
    """split_linear_many at 5-16 rows of float32 x on layer slices of one layer (the decoder's DeltaNet projections
    at batch 5-16): both bf16 parts of x stacked as 10-32 rows in one decode-kernel launch (the fused kernel's skinny
    dot for packed weights, stacked_gemv for bf16; each weight read once) for the weights whose rows take the
    kernel's full row tile and one for the 48-row weight; an 8-row weight, which no decode kernel tiles, goes its
    old way. Every output within float32 rounding of float64 x times W as the bf16 products see it (packed W decoded
    and rounded to bf16), 20x closer than the product of x rounded to bf16."""
    from pallas_kernels import dense_gemv, quant_matmul

    rng = np.random.default_rng(seed)
    layers, k, outs = 3, 512, (128, 48, 64, 8)
    layer = int(rng.integers(0, layers))
    if weight == "bf16":
        stacked = [jnp.asarray(rng.standard_normal((layers, out, k)), jnp.bfloat16) for out in outs]
        w64 = [np.asarray(a[layer].astype(jnp.float32), np.float64) for a in stacked]
        module, kernel = dense_gemv, "stacked_gemv_many"
    else:
        pairs = [[random_weight(rng, T[weight], out, k) for _ in range(layers)] for out in outs]
        stacked = [stack([w for w, _ in per]) for per in pairs]
        w64 = [np.asarray(jnp.asarray(per[layer][1], jnp.bfloat16).astype(jnp.float32), np.float64) for per in pairs]
        module, kernel = quant_matmul, "quant_matmul_many"
    index = jnp.int32(layer)  # one index: the slices of one layer, as the decoder's scan gives them
    sliced = [LayerSlice(a, index) for a in stacked]
    monkeypatch.setattr(backend, "use_pallas", lambda: True)
    monkeypatch.setattr(backend, "interpret", lambda: True)
    launches = []
    real = getattr(module, kernel)
    monkeypatch.setattr(module, kernel, lambda x, *a, **kw: launches.append(x.shape[0]) or real(x, *a, **kw))
    for rows in (5, int(rng.integers(9, 17))):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        x_bf16 = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
        launches.clear()
        got = linear_mod.split_linear_many(jnp.asarray(x), sliced)
        assert launches == [2 * rows] * 2, f"rows {rows}: launches of {launches} rows, want two of {2 * rows}"
        for y, w, out in zip(got, w64, outs):
            exact = x.astype(np.float64) @ w.T
            err = np.abs(np.asarray(y, np.float64) - exact).max()
            bf16_err = np.abs(x_bf16 @ w.T - exact).max()
            scale = (np.abs(x.astype(np.float64)) @ np.abs(w).T).max()
            assert err <= 2e-5 * scale and err < bf16_err / 20, (weight, rows, out, seed, err, bf16_err)


@pytest.mark.parametrize("weight", ["bf16", "Q4_K", "bf16 stacked", "Q4_K stacked"])
@pytest.mark.parametrize("pallas", [False, True])
def test_split_linear_low_rows(monkeypatch, seed, weight, pallas):
    """split_linear_many's low_rows: in a prefill-sized product the leading rows asked for get float32-level
    products of x, the others (and a weight given 0) the product of x rounded to bf16; decode-sized products give
    every row the float32-level product. Oracle: float64 products of gguf's dequantized W (as bf16 matmuls see it,
    rounded to bf16, except where a decode kernel takes x whole: Q4_K at 1..4 rows goes to the int8 GEMV, interpreted
    here) with x or with x rounded to bf16. Packed W at 17-32 rows (a decode of 17-32 sequences) keeps the prefill
    rule's rows but is never decoded to a bf16 matrix there: the fused kernel's skinny dot takes both products."""
    from pallas_kernels import quant_dequantize
    from pallas_kernels.quant_matmul import SKINNY_MAX_ROWS

    rng = np.random.default_rng(seed)
    out, k, layers = 64, 512, 3
    layer = int(rng.integers(0, layers))
    if weight.startswith("bf16"):
        stacked = jnp.asarray(rng.standard_normal((layers, out, k)), jnp.bfloat16)
        dense = np.asarray(stacked[layer].astype(jnp.float32), np.float64)
        w = LayerSlice(stacked, jnp.int32(layer)) if "stacked" in weight else stacked[layer]
    else:
        pairs = [random_weight(rng, T.Q4_K, out, k) for _ in range(layers)]
        dense = pairs[layer][1]
        w = LayerSlice(stack([p for p, _ in pairs]), jnp.int32(layer)) if "stacked" in weight else pairs[layer][0]
    monkeypatch.setattr(backend, "use_pallas", lambda: pallas)
    monkeypatch.setattr(backend, "interpret", lambda: True)
    low = int(rng.integers(1, out))
    rounded_w = np.asarray(jnp.asarray(dense, jnp.bfloat16).astype(jnp.float32), np.float64)
    decoded = []
    real = quant_dequantize.dequantize_in_kernel_order
    monkeypatch.setattr(quant_dequantize, "dequantize_in_kernel_order", lambda *a, **kw: decoded.append(1) or real(
        *a, **kw))
    for rows in (3, int(rng.integers(linear_mod._PALLAS_MAX_ROWS + 1, SKINNY_MAX_ROWS + 1)), 40):
        decoded.clear()
        x = rng.standard_normal((rows, k)).astype(np.float32)
        x_bf16 = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
        whole = pallas and weight.startswith("Q4_K") and rows <= 4
        w64 = dense if whole else rounded_w
        exact, of_rounded_x = x.astype(np.float64) @ w64.T, x_bf16 @ w64.T
        scale = (np.abs(x.astype(np.float64)) @ np.abs(w64).T).max()
        some, none = (np.asarray(y, np.float64) for y in linear_mod.split_linear_many(jnp.asarray(x), [w, w], (low, 0)))
        where = f"{weight} rows {rows} low_rows {low} layer {layer} pallas {pallas} seed {seed}"
        decode_sized = rows <= linear_mod._PALLAS_MAX_ROWS
        expected_split = (("some", some, out if decode_sized else low), ("none", none, out if decode_sized else 0))
        for name, got, split_rows in expected_split:
            err_split = np.abs(got[:, :split_rows] - exact[:, :split_rows]).max(initial=0.0)
            err_rounded = np.abs(got[:, split_rows:] - of_rounded_x[:, split_rows:]).max(initial=0.0)
            assert err_split <= 2e-5 * scale, f"{where} ({name}): split rows off by {err_split:.3g} of {scale:.3g}"
            assert err_rounded <= 2e-5 * scale, f"{where} ({name}): other rows off by {err_rounded:.3g} of {scale:.3g}"
        if not decode_sized:  # the rounding is visible: the test tells the two apart
            assert np.abs(of_rounded_x - exact).max() > 5 * 2e-5 * scale, where
        if pallas and weight.startswith("Q4_K") and linear_mod._PALLAS_MAX_ROWS < rows <= SKINNY_MAX_ROWS:
            assert not decoded, f"{where}: W decoded to a bf16 matrix for a decode-sized product"


def test_leading_rows_of_packed_and_stacked_weights(seed):
    """leading_rows gives the first rows of a packed weight, of a stacked one's layer, and of dense arrays, as weights
    whose values are gguf's dequantization of those rows."""
    rng = np.random.default_rng(seed)
    out, k, layers = 48, 256, 3
    count, layer = int(rng.integers(1, out)), int(rng.integers(0, layers))
    pairs = [random_weight(rng, T.Q4_K, out, k) for _ in range(layers)]
    dense_stack = jnp.asarray(rng.standard_normal((layers, out, k)), jnp.float32)
    cases = [(pairs[layer][0], pairs[layer][1]),
             (LayerSlice(stack([p for p, _ in pairs]), jnp.int32(layer)), pairs[layer][1]),
             (dense_stack[layer], np.asarray(dense_stack[layer])),
             (LayerSlice(dense_stack, jnp.int32(layer)), np.asarray(dense_stack[layer]))]
    for w, want in cases:
        rows = linear_mod.leading_rows(w, count)
        got = np.asarray(dequantize(rows, jnp.float32)) if isinstance(rows, QuantizedTensor) else np.asarray(rows)
        assert got.shape == (count, k), (type(w).__name__, got.shape)
        np.testing.assert_array_equal(got, want[:count].astype(np.float32), err_msg=f"{type(w).__name__} seed {seed}")
