"""y = x @ W.T for dense or packed quantized weights, and embedding lookups.

`_impl` is the single dispatch point: packed weights in a format with a fused kernel, with at most
quant_matmul.SKINNY_MAX_ROWS (32) rows of x (decode, up to 32 sequences), go to the Pallas dequantize-matmul when
luxjax.ops.backend chooses Pallas (GPU by default, LUXJAX_KERNELS overrides), or, for IQ4_XS, Q4_K, Q5_K and Q6_K at
1..4 rows where the GPU has integer dot products (CUDA), to the int8 GEMV (pallas_kernels/quant_gemv_int8.py: x in
int8 levels; LUXJAX_INT8_GEMV=off declines it);
larger products of packed weights decode them with the Pallas dequantize kernel and run one vendor GEMM (the
fused GEMM measured 116 TFLOP/s on an H200 (Q8_0, M=1024) where cuBLAS on bf16 runs near 700); everything else
takes the XLA path, which dequantizes inside the jitted graph and is the kernels' oracle.

A weight may also come as a LayerSlice: one layer of a weight stacked over the scanned layers, not yet sliced.
Decode-sized products read it in place with the stacked kernels (dense or packed), and so do larger products of
dense 16-bit weights (pallas_kernels/dense_gemm.py: XLA would copy the slice before cuBLAS) and the dequantize
kernel; everything else slices it.
"""
from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax import lax

from luxjax.checkpoint.quants import QuantizedTensor, Weight, dequantize, dequantize_rows
from luxjax.ops import backend
from luxjax.ops.deferred import Deferred, GatedInput, materialize
from pallas_kernels.quant_decode import KERNEL_FORMATS

# Decode-sized rows for dense weights (dense_gemv) and for a float32 x's two parts (split_linear_many: the low part on
# every output row up to here); packed products are decode-sized where the fused kernel takes them (up to 32 rows)
_PALLAS_MAX_ROWS = 16
_KERNEL_X_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)  # x dtypes the matmul kernels take


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LayerSlice:
    """Layer `index` of a weight stacked over layers (leading axis of the array, or of every plane of a packed
    tensor, whose `shape` is one layer's). Inside a layer scan, XLA copies a sliced weight into its own buffer
    before a GEMM or kernel call (measured on an H200: benchmarks/bench_layer_scan.py), tripling the bytes a decode
    step reads; kept unsliced, the stacked kernels read the layer in place.

    A stacked cache [L, Bc, ...] may be sliced for fewer sequences than it holds (`sequences`: a decode step of
    the first B <= Bc slots): take() gives their rows only, and the rest of the stack is neither read nor written."""

    stacked: Weight
    index: jax.Array  # int32 scalar
    sequences: int | None = field(default=None, metadata=dict(static=True))  # the first rows of axis 1; None: all

    def take(self) -> Weight:
        def one(a):
            layer = lax.dynamic_index_in_dim(a, self.index, 0, keepdims=False)
            return layer if self.sequences is None else layer[: self.sequences]

        return jax.tree.map(one, self.stacked)

    def scatter(self, indices: tuple, value: jax.Array) -> LayerSlice:
        """For a stacked cache: `value` written at stacked[index, *indices] (indices past the end dropped), the stack
        updated where it lies instead of the layer's whole slice being rewritten."""
        stack = self.stacked.at[(self.index, *indices)].set(value.astype(self.stacked.dtype), mode="drop")
        return self.of(stack)

    def of(self, stacked: Weight) -> LayerSlice:
        """The same slice of `stacked` (a kernel's updated stack)."""
        return dataclasses.replace(self, stacked=stacked)

    def put_sequences(self, pick: jax.Array, value: jax.Array) -> LayerSlice:
        """For a stacked cache [L, Bc, ...]: this layer with value [B, ...] (B <= Bc: the first B sequences) written
        for the sequences where pick [B] holds (the other sequences' rows are not rewritten)."""
        past_the_end = self.stacked.shape[1]  # dropped
        return self.scatter((jnp.where(pick, jnp.arange(value.shape[0]), past_the_end),), value)


def layer_value(x):
    """x itself, or a LayerSlice's layer taken out of its stack."""
    return x.take() if isinstance(x, LayerSlice) else x


def layer_stacks(params) -> tuple[list, jax.Array]:
    """(stacks, layer) of a layer's parameters for a kernel that reads them where they lie: LayerSlices at one
    index give their stacks and that index; anything else (arrays, or slices at different indices) their values as
    one-layer stacks, at layer 0."""
    if all(isinstance(p, LayerSlice) for p in params) and all(p.index is params[0].index for p in params):
        return [p.stacked for p in params], params[0].index
    return [layer_value(p)[None] for p in params], jnp.zeros((), jnp.int32)


def vendor_matmul(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """x [..., in] @ w.T for a dense w [out, in] by XLA's dot (cuBLAS on a GPU): float32 accumulation, one rounding
    to out_dtype (default x's). On a GPU a 16-bit result is asked of the GEMM itself: cuBLAS rounds its float32
    accumulator once, as the convert after a float32 result would, but writes half the bytes and its consumer reads
    half (the vision MLP's GELU read a float32 [4096, 4304] per block). Elsewhere the product is float32 first."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    # float32 mode means full float32 products: GPUs would otherwise round inputs to TF32.
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    rounded_by_gemm = out_dtype.itemsize == 2 and jax.default_backend() == "gpu"
    y = lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=out_dtype if rounded_by_gemm else jnp.float32)
    return y.astype(out_dtype)


def _xla_linear(x: jax.Array, w: Weight, out_dtype=None) -> jax.Array:
    """Weights dequantized (or cast) to x's dtype, float32 accumulation, result in out_dtype (default x's)."""
    return vendor_matmul(x, dequantize(w, x.dtype), out_dtype)


def _pallas_linear(x: jax.Array, w: QuantizedTensor, out_dtype=None) -> jax.Array:
    from pallas_kernels.quant_matmul import quant_matmul  # Pallas imports only once Pallas is chosen

    y = _int8_linear(x, w, None, out_dtype)
    if y is not None:
        return y
    y = quant_matmul(x.reshape(-1, x.shape[-1]), w, out_dtype=out_dtype, interpret=backend.interpret())
    return y.reshape(*x.shape[:-1], w.shape[0])


def _int8_takes(x_shape, tensors, layer) -> bool:
    """Whether the int8 decode GEMV runs natively here and takes x of x_shape times the packed tensors (W[layer]
    for stacked ones) in one launch."""
    from pallas_kernels import quant_gemv_int8

    return quant_gemv_int8.uses_int8(backend.interpret()) and quant_gemv_int8.supported_many(
        x_shape, tuple(tensors), stacked=layer is not None)


def _int8_linear(x, w: QuantizedTensor, layer=None, out_dtype=None) -> jax.Array | None:
    """x @ W.T (W[layer].T for a stacked w) by the int8 decode GEMV where the platform runs it natively and it
    takes the format and rows, else None. x: an array or a deferred input (luxjax.ops.deferred)."""
    from pallas_kernels import quant_gemv_int8

    if not _int8_takes(x.shape, (w,), layer):
        return None
    y = quant_gemv_int8.int8_quant_matmul(x.reshape(-1, x.shape[-1]), w, layer, out_dtype=out_dtype,
                                          interpret=backend.interpret())
    return y.reshape(*x.shape[:-1], w.shape[0])


def _packed_layer(w) -> tuple[QuantizedTensor, jax.Array | None] | None:
    """(packed tensor, layer index or None) of a packed weight or a packed LayerSlice; None for dense ones."""
    if isinstance(w, LayerSlice):
        return (w.stacked, w.index) if isinstance(w.stacked, QuantizedTensor) else None
    return (w, None) if isinstance(w, QuantizedTensor) else None


def _packed_linear_many(x: jax.Array, ws, out_dtype=None) -> tuple[jax.Array, ...] | None:
    """(x @ W.T for W in ws) in one kernel launch (x quantized or permuted once) for packed weights of one format,
    all slices of one layer (the same index) or all unstacked, with decode-sized x: the int8 GEMV where the platform
    runs it and it takes them (as _int8_linear would each), else the fused dequantize-matmul. None where neither
    takes them together."""
    from pallas_kernels import quant_gemv_int8, quant_matmul

    packed = [_packed_layer(w) for w in ws]
    if len(ws) < 2 or None in packed or any(index is not packed[0][1] for _, index in packed):
        return None
    tensors, layer = tuple(t for t, _ in packed), packed[0][1]
    rows, stacked, interpret = x.reshape(-1, x.shape[-1]), layer is not None, backend.interpret()
    if _int8_takes(x.shape, tensors, layer):
        ys = quant_gemv_int8.int8_quant_matmul_many(rows, tensors, layer, out_dtype=out_dtype, interpret=interpret)
    elif quant_matmul.supported_many(x.shape, tensors, stacked):
        ys = quant_matmul.quant_matmul_many(materialize(rows), tensors, layer, out_dtype=out_dtype,
                                            interpret=interpret)
    else:
        return None
    return tuple(y.reshape(*x.shape[:-1], t.shape[0]) for y, t in zip(ys, tensors))


def _dequantized_linear(x: jax.Array, w: QuantizedTensor, layer=None, out_dtype=None) -> jax.Array | None:
    """x @ W.T (W[layer].T for a stacked w) for a prefill-sized x: W decoded by the Pallas dequantize kernel, then
    one vendor GEMM; None for decode-sized x (the fused GEMV's) or where the kernel does not take w."""
    if math.prod(x.shape[:-1]) <= _PALLAS_MAX_ROWS or not _dequantize_kernel_takes(w, x.dtype, layer):
        return None
    from pallas_kernels import quant_dequantize

    return quant_dequantize.dequantized_matmul(x, w, layer, out_dtype=out_dtype, interpret=backend.interpret())


def _dequantize_kernel_takes(w: QuantizedTensor, dtype, layer) -> bool:
    """Whether prefill decodes packed w (its layer `layer`, when stacked) to `dtype` by the Pallas dequantize
    kernel."""
    if not backend.use_pallas():
        return False
    from pallas_kernels import quant_dequantize

    return quant_dequantize.supported(w, dtype, stacked=layer is not None)


def _kernel_applies(x: jax.Array, w: Weight) -> bool:
    """Whether x @ W.T goes to the fused dequantize-matmul (or the int8 GEMV): packed W that the fused kernel takes
    at x's rows (decode-sized: up to its skinny dot's 32, a decode step of up to 32 sequences; past them, decoding
    W once for a GEMM wins)."""
    if not (isinstance(w, QuantizedTensor) and x.dtype in _KERNEL_X_DTYPES and backend.use_pallas()):
        return False
    from pallas_kernels import quant_matmul  # Pallas imports only once Pallas is chosen

    return quant_matmul.supported_many(x.shape, (w,), stacked=False)


def _in_place_linear(x: jax.Array, w: LayerSlice, out_dtype=None) -> jax.Array | None:
    """x @ W[layer].T by a stacked kernel reading the layer in place, or None where none applies."""
    if not backend.use_pallas() or x.dtype not in _KERNEL_X_DTYPES:
        return None
    rows = x.reshape(-1, x.shape[-1])
    if isinstance(w.stacked, QuantizedTensor):
        from pallas_kernels import quant_matmul as kernels

        y = _int8_linear(x, w.stacked, w.index, out_dtype)
        if y is not None:
            return y
        if not kernels.stacked_supported(x.shape, w.stacked):
            return _dequantized_linear(x, w.stacked, w.index, out_dtype)
        y = kernels.stacked_quant_matmul(rows, w.stacked, w.index, out_dtype=out_dtype, interpret=backend.interpret())
    else:
        from pallas_kernels import dense_gemm, dense_gemv

        if rows.shape[0] <= _PALLAS_MAX_ROWS and dense_gemv.supported(x.shape, w.stacked.shape, w.stacked.dtype):
            y = dense_gemv.stacked_gemv(rows, w.stacked, w.index, out_dtype=out_dtype, interpret=backend.interpret())
        elif dense_gemm.supported(x.shape, w.stacked.shape, x.dtype, w.stacked.dtype):
            y = dense_gemm.stacked_gemm(rows, w.stacked, w.index, out_dtype=out_dtype, interpret=backend.interpret())
        else:
            return None
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _is_dense_slice(w) -> bool:
    return isinstance(w, LayerSlice) and isinstance(w.stacked, jax.Array)


def _fused_in_place_linear(x: jax.Array, ws, out_dtype=None) -> tuple[jax.Array, ...] | None:
    """x @ W[layer].T for several dense LayerSlices of one layer in one kernel launch, or None where it does not
    apply (packed weights, mixed dtypes or widths, more rows than a decode product, XLA chosen)."""
    if (len(ws) < 2 or not backend.use_pallas() or x.dtype not in _KERNEL_X_DTYPES
            or not all(_is_dense_slice(w) for w in ws) or math.prod(x.shape[:-1]) > _PALLAS_MAX_ROWS):
        return None
    from pallas_kernels import dense_gemv

    stacked = tuple(w.stacked for w in ws)
    if not dense_gemv.supported_many(x.shape, [a.shape for a in stacked], [a.dtype for a in stacked]):
        return None
    ys = dense_gemv.stacked_gemv_many(materialize(x).reshape(-1, x.shape[-1]), stacked, ws[0].index,
                                      out_dtype=out_dtype, interpret=backend.interpret())
    return tuple(y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys)


def _impl(x, w: Weight | LayerSlice, out_dtype=None) -> jax.Array:
    if isinstance(x, Deferred):  # formed by the int8 GEMV's quantization where it takes w
        packed = _packed_layer(w)
        if packed is not None and backend.use_pallas() and x.dtype in _KERNEL_X_DTYPES:
            y = _int8_linear(x, *packed, out_dtype)
            if y is not None:
                return y
        x = materialize(x)
    if isinstance(w, LayerSlice):
        y = _in_place_linear(x, w, out_dtype)
        if y is not None:
            return y
        w = w.take()
    if _kernel_applies(x, w):
        return _pallas_linear(x, w, out_dtype)
    if isinstance(w, QuantizedTensor):
        y = _dequantized_linear(x, w, None, out_dtype)
        if y is not None:
            return y
    return _xla_linear(x, w, out_dtype)


def linear(x, w: Weight | LayerSlice, out_dtype=None) -> jax.Array:
    """x [..., in] @ W.T for W [out, in] (jnp array, QuantizedTensor or a LayerSlice of either) -> [..., out] in
    out_dtype (default: x's; float32 keeps the accumulator unrounded, e.g. for logits). x: an array, or a deferred
    input (luxjax.ops.deferred), which the int8 GEMV's quantization kernel forms where it takes W and XLA forms
    elsewhere."""
    return _impl(x, w, out_dtype)


def gated_linear(gate: jax.Array, up: jax.Array, w: Weight | LayerSlice, out_dtype=None) -> jax.Array:
    """swiglu(gate, up) @ W.T: an MLP's down projection. Where the int8 GEMV takes W, its x quantization kernel
    forms the activation (XLA's activation fusion was a launch of its own per layer: 64 of ~1.7 us in a 27B decode
    step on an H200); elsewhere XLA forms it and linear() runs the product."""
    return linear(GatedInput(gate, up), w, out_dtype)


_FUSED_ROW_TILE = 32  # weights fused in one launch share a row tile; few-row ones (48) would shrink everyone's


def linear_many(x: jax.Array, ws, out_dtype=None) -> tuple[jax.Array, ...]:
    """(linear(x, w, out_dtype) for w in ws): the projections of one input. Decode-sized products run as fewer
    kernel launches where they can: packed weights of one format as one launch (the int8 GEMV's or the fused
    dequantize-matmul's: _packed_linear_many), dense layer slices of one dtype as launches over several weights
    (dense_gemv.stacked_gemv_many: one for those whose rows are multiples of _FUSED_ROW_TILE, one for the rest);
    anything else, one product each."""
    ws = tuple(ws)
    out = [None] * len(ws)
    if backend.use_pallas() and x.dtype in _KERNEL_X_DTYPES:
        types = [_packed_type(w) for w in ws]
        dense = [i for i, w in enumerate(ws) if _is_dense_slice(w)]
        wide = tuple(i for i in dense if ws[i].stacked.shape[1] % _FUSED_ROW_TILE == 0)
        groups = [(tuple(i for i, u in enumerate(types) if u == t), _packed_linear_many) for t in set(types) - {None}]
        groups += [(wide, _fused_in_place_linear), (tuple(i for i in dense if i not in wide), _fused_in_place_linear)]
        for group, fuse in groups:
            ys = fuse(x, tuple(ws[i] for i in group), out_dtype) if len(group) > 1 else None
            for i, y in zip(group, ys or ()):
                out[i] = y
    return tuple(_impl(x, w, out_dtype) if y is None else y for w, y in zip(ws, out))


def _packed_type(w):
    """The ggml type of a packed weight (or layer slice) in a format with a fused kernel, else None."""
    packed = _packed_layer(w)
    return packed[0].ggml_type if packed is not None and packed[0].ggml_type in KERNEL_FORMATS else None


def split_linear(x: jax.Array, w: Weight | LayerSlice) -> jax.Array:
    """float32 x [..., in] @ W.T for low-precision (bf16 or packed) W at bf16 matmul speed: x is split into its
    bf16 high part and the bf16 rounding of the rest, both go through one bf16 product (stacked as rows, so W is read
    once where the rows allow), and the two float32 results are summed. x keeps about 16 significant bits instead
    of bf16's 8: for the layers whose bf16 input rounding dominates the error (Qwen3.5's DeltaNet)."""
    return split_linear_many(x, (w,))[0]


def split_linear_many(x, ws, low_rows=None) -> tuple[jax.Array, ...]:
    """(split_linear(x, w) for w in ws), float32 results (x may be deferred: formed by the GEMVs that take it whole,
    by XLA for the rest): prefill-sized products of dense layer slices by the in-place GEMM taking both parts at once
    (dense_gemm.stacked_gemm's x_lo); the rest through linear_many. Packed weights with few enough rows for the fused
    kernel's GEMV reduce take x in float32 as it is instead (exact float32 products, the weight decoded once): there
    the two parts would double the kernel's multiply-adds or, as stacked rows, send it to its slower tensor-core
    regime (4x slower in an H200 decode step).

    low_rows (prefill-sized products only): per weight, how many of its leading output rows get the low part's
    product (None: all; 0: none, an ordinary bf16 product of x rounded to bf16): in prefill the low part is a second
    GEMM as costly as the first, and only outputs whose consumers amplify the input rounding need it. Decode-sized
    products keep both parts on every row (or x whole in the GEMV reduce), which costs them nothing more."""
    ws = tuple(ws)
    low_rows = tuple(_out_features(w) if r is None else r
                     for w, r in zip(ws, low_rows or (None,) * len(ws), strict=True))
    rows = math.prod(x.shape[:-1])
    direct = [i for i, w in enumerate(ws) if backend.use_pallas() and _takes_x_whole(rows, w)]
    out = [None] * len(ws)
    for i, y in zip(direct, linear_many(x, [ws[i] for i in direct], jnp.float32)):
        out[i] = y
    rest = [i for i, y in enumerate(out) if y is None]
    if rest:  # (a deferred x formed only where something takes it formed)
        for i, y in zip(rest, _split_products(materialize(x), [ws[i] for i in rest], [low_rows[i] for i in rest])):
            out[i] = y
    return tuple(out)


def _out_features(w) -> int:
    """W's output rows (of one layer, for a LayerSlice)."""
    if isinstance(w, LayerSlice):
        return w.stacked.shape[0] if isinstance(w.stacked, QuantizedTensor) else w.stacked.shape[1]
    return w.shape[0]


def leading_rows(w: Weight | LayerSlice, count: int) -> Weight:
    """The first `count` output rows of W [out, in] (of its layer, for a LayerSlice) as a weight of their own: every
    array cut along its rows, a packed tensor's planes too (ggml blocks run within a row)."""
    base = w.stacked if isinstance(w, LayerSlice) else w

    def cut(a):
        if isinstance(w, LayerSlice):
            return lax.dynamic_slice(a, (w.index,) + (0,) * (a.ndim - 1), (1, count) + a.shape[2:])[0]
        return a[:count]

    if isinstance(base, QuantizedTensor):
        if len(base.shape) != 2:
            raise ValueError(f"leading_rows takes a matrix, got a packed tensor of shape {base.shape}")
        return QuantizedTensor({name: cut(p) for name, p in base.planes.items()}, base.ggml_type,
                               (count, base.shape[1]), base.dtype)
    return cut(base)


def _takes_x_whole(rows: int, w) -> bool:
    """Whether `rows` rows of float32 x times packed w go to a decode kernel that takes x as it is: the int8 GEMV
    (x in three int8 levels, within 2^-22 of each 32 values' largest) or the fused kernel's GEMV reduce (exact
    float32 products). Split into two bf16 parts, x would double the rows: past the int8 GEMV's at 3-4 rows (the
    27B Q4_K_M model's DeltaNet projections), into the float kernel's tensor-core regime."""
    packed = _packed_layer(w)
    if packed is None:
        return False
    tensor, layer = packed
    if _int8_takes((rows, tensor.shape[-1]), (tensor,), layer):
        return True
    return tensor.ggml_type in KERNEL_FORMATS and rows <= KERNEL_FORMATS[tensor.ggml_type].reduce_rows


def _split_products(x: jax.Array, ws, low_rows) -> tuple[jax.Array, ...]:
    """split_linear for each of ws, x split into its two bf16 parts; prefill-sized products take the low part's on
    the leading low_rows of each only (split_linear_many)."""
    hi = x.astype(jnp.bfloat16)
    lo = (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)
    rows = math.prod(x.shape[:-1])
    partly = [rows > _PALLAS_MAX_ROWS and r < _out_features(w) for w, r in zip(ws, low_rows)]
    out = [_partly_split_product(hi, lo, w, r) if p else None for w, r, p in zip(ws, low_rows, partly)]
    rest = [i for i, y in enumerate(out) if y is None]
    if rows <= _PALLAS_MAX_ROWS:  # decode: both parts in one launch where the kernels take them so
        for i, y in zip(rest, _parts_one_launch(hi, lo, [ws[i] for i in rest])):
            out[i] = y
        rest = [i for i, y in enumerate(out) if y is None]
    rest_ws = [ws[i] for i in rest]
    if not rest:
        return tuple(out)
    if any(isinstance(w, (LayerSlice, QuantizedTensor)) for w in rest_ws) and rows <= _PALLAS_MAX_ROWS < 2 * rows:
        # both parts on the decode kernels: one call each rather than a stack too tall for them
        both = zip(linear_many(hi, rest_ws, jnp.float32), linear_many(lo, rest_ws, jnp.float32))
        for i, (y_hi, y_lo) in zip(rest, both):
            out[i] = y_hi + y_lo
        return tuple(out)
    for i in rest:
        out[i] = _split_in_place_gemm(hi, lo, ws[i])
    stacked = [i for i in rest if out[i] is None]
    for i, both in zip(stacked, linear_many(jnp.stack([hi, lo]), [ws[i] for i in stacked], jnp.float32)):
        out[i] = both[0] + both[1]
    return tuple(out)


def _part_groups(ws, rows: int) -> dict:
    """Layer slices by kind (the ggml type of a packed one, the dtype of a dense one) and by the row tile its decode
    kernel would give each alone at `rows` rows of x: {(kind, tile): (indices into ws, their stacked arrays)}. A
    launch's weights share one row tile, so a weight of few rows (the DeltaNet's 48-row b and a) would hold its
    group's larger weights to 16-row tiles: it takes a launch of its own."""
    from pallas_kernels import dense_gemv, quant_matmul

    groups = {}
    for i, w in enumerate(ws):
        out, k = w.stacked.shape[-2:]
        if isinstance(w.stacked, QuantizedTensor):
            kind = w.stacked.ggml_type
            tiles = quant_matmul.BlockSizes.get_default(kind, rows) if kind in KERNEL_FORMATS else None
            tile = min(tiles.block_n, out & -out) if tiles else 0
        else:
            kind, tiles = jnp.dtype(w.stacked.dtype), dense_gemv.BlockSizes.get_default(rows, out, k)
            tile = tiles.block_n if tiles else 0
        indices, arrays = groups.setdefault((kind, tile), ([], []))
        indices.append(i)
        arrays.append(w.stacked)
    return groups


def _one_launch_groups(rows: int, ws) -> list[tuple[list[int], list]]:
    """The groups of ws (_part_groups) whose decode kernel takes both bf16 parts of `rows` rows of x stacked as 2 *
    rows rows in one launch: layer slices of one layer (one index; none where they are not) taken at that many rows
    by the fused kernel's skinny dot (packed, quant_matmul.SKINNY_MAX_ROWS) or by stacked_gemv (dense,
    dense_gemv.PARTS_MAX_ROWS)."""
    if not (backend.use_pallas() and ws and all(isinstance(w, LayerSlice) for w in ws)):
        return []
    if any(w.index is not ws[0].index for w in ws):
        return []
    from pallas_kernels import dense_gemv, quant_matmul

    shape, fitting = (2 * rows, ws[0].stacked.shape[-1]), []
    for indices, arrays in _part_groups(ws, 2 * rows).values():
        if isinstance(arrays[0], QuantizedTensor):
            fits = quant_matmul.supported_many(shape, tuple(arrays), stacked=True)
        else:
            fits = dense_gemv.supported_many(shape, [a.shape for a in arrays], [a.dtype for a in arrays])
        if fits:
            fitting.append((indices, arrays))
    return fitting


def _parts_one_launch(hi: jax.Array, lo: jax.Array, ws) -> list[jax.Array | None]:
    """(hi + lo) @ W[layer].T in float32 for each of ws in a group of _one_launch_groups (None for the others): per
    group one launch on both parts stacked as rows, so each weight is read (and a packed one decoded) once for both
    (the 27B's IQ4_XS DeltaNet four at 16 rows on an H200: 2 x 160 us as two launches, 112 us as one with session
    27's tiles; benchmarks/RESULTS.md)."""
    from pallas_kernels import dense_gemv, quant_matmul

    rows = math.prod(hi.shape[:-1])
    out = [None] * len(ws)
    groups = _one_launch_groups(rows, ws)
    if not groups:
        return out
    both = jnp.concatenate([hi.reshape(rows, -1), lo.reshape(rows, -1)])
    index, interpret = ws[0].index, backend.interpret()
    for indices, arrays in groups:
        if isinstance(arrays[0], QuantizedTensor):
            ys = quant_matmul.quant_matmul_many(both, tuple(arrays), index, out_dtype=jnp.float32, interpret=interpret)
        else:
            ys = dense_gemv.stacked_gemv_many(both, tuple(arrays), index, out_dtype=jnp.float32, interpret=interpret)
        for i, y in zip(indices, ys):
            out[i] = (y[:rows] + y[rows:]).reshape(*hi.shape[:-1], y.shape[-1])
    return out


def _partly_split_product(hi: jax.Array, lo: jax.Array, w, low_rows: int) -> jax.Array:
    """hi @ W.T + lo @ W[:low_rows].T, float32, for low_rows below W's rows: the low part's GEMM on the leading
    rows only. A packed W is decoded once for both GEMMs where x has more rows than the fused kernel's skinny dot
    takes; with fewer (a decode step of 17-32 sequences) each product takes that kernel on the packed bytes (an
    IQ4_XS 27B decode of 32 sequences on an H200: the DeltaNet's q, k, v for both parts 108 us a layer as the
    dequantize kernel, a slice copy and two GEMMs, 92 us as two skinny dots and the leading rows' copy)."""
    if low_rows == 0:
        return linear(hi, w, jnp.float32)
    decoded = _decoded_for_prefill(w, math.prod(hi.shape[:-1]))
    if decoded is not None:  # decoded once for both GEMMs
        w, leading = decoded, decoded[:low_rows]
    else:
        leading = leading_rows(w, low_rows)
    y, y_lo = linear(hi, w, jnp.float32), linear(lo, leading, jnp.float32)
    return jnp.concatenate([y[..., :low_rows] + y_lo, y[..., low_rows:]], axis=-1)


def _decoded_for_prefill(w, rows: int) -> jax.Array | None:
    """Packed w (or its layer) as the bf16 matrix a prefill-sized product of `rows` rows reads, decoded by the Pallas
    dequantize kernel (in W's own column order), or None where the product does not take that path (dense w, XLA
    chosen, formats without the kernel, decode-sized products: those the fused kernel takes)."""
    packed = _packed_layer(w)
    if packed is None:
        return None
    base, layer = packed
    if not _dequantize_kernel_takes(base, jnp.bfloat16, layer):
        return None
    from pallas_kernels import quant_dequantize, quant_matmul

    if quant_matmul.supported_many((rows, base.shape[1]), (base,), stacked=layer is not None):
        return None  # decode-sized: the fused kernel takes the packed bytes instead
    return quant_dequantize.dequantize_in_kernel_order(base, layer, dtype=jnp.bfloat16, natural_order=True,
                                                       interpret=backend.interpret())


def _split_in_place_gemm(hi: jax.Array, lo: jax.Array, w) -> jax.Array | None:
    """float32 (hi + lo) @ W[layer].T for a dense layer slice by the in-place prefill GEMM, or None where it does
    not apply."""
    if not (_is_dense_slice(w) and backend.use_pallas()):
        return None
    from pallas_kernels import dense_gemm

    if not dense_gemm.supported(hi.shape, w.stacked.shape, hi.dtype, w.stacked.dtype):
        return None
    k = hi.shape[-1]
    y = dense_gemm.stacked_gemm(hi.reshape(-1, k), w.stacked, w.index, x_lo=lo.reshape(-1, k),
                                out_dtype=jnp.float32, interpret=backend.interpret())
    return y.reshape(*hi.shape[:-1], y.shape[-1])


def embedding_lookup(w: Weight, ids: jax.Array, dtype) -> jax.Array:
    """Rows `ids` of the table w [vocab, dim] in `dtype`; packed tables decode only the gathered rows."""
    return dequantize_rows(w, ids, dtype)
