"""The int8 decode GEMV (or the vision tower's attention) as a GPU would compile it, read without a GPU: registers,
layout conversions, SASS opcodes (the kernel's and its longest loop's: a loop step is what every program repeats,
the rest runs once a program).

    python benchmarks/inspect_kernel.py --out 17408 --in 5120 --tiles 16,4,8 [--prefetch] [--dtype float32]
    python benchmarks/inspect_kernel.py ... --triton /path/to/venv/bin/python   (a Python with PyPI's triton)
    python benchmarks/inspect_kernel.py --vision 3900,16,72 --tiles 128,64,8,3   (tokens, heads, head dim; block_q,
        block_k, warps, stages: HGMMA among the opcodes means Triton chose Hopper's warpgroup MMA)

Pallas lowers a kernel to Triton IR in Python, for any platform (`lower(lowering_platforms=("cuda",))` needs no
GPU); this script captures that IR from the lowering and hands it to PyPI's Triton, which compiles it for sm_90 and
bundles ptxas and cuobjdump. XLA compiles the same IR with its own copy of Triton's passes (another Triton version),
so registers and instruction counts can differ from the device's: use it to compare variants before spending device
time, and time them on the GPU.
Triton is not a project dependency: install it in a separate environment (`python -m venv /tmp/tv &&
/tmp/tv/bin/pip install triton==3.6.0`) and pass its Python with --triton.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402
from jax._src.pallas.triton import lowering  # noqa: E402

from luxjax.checkpoint.quant_formats import FORMATS  # noqa: E402
from luxjax.checkpoint.quants import QuantizedTensor  # noqa: E402
from pallas_kernels import quant_gemv_int8 as qi, vision_attention as va  # noqa: E402

# Run by the Triton Python: compile the IR file for sm_90, print one JSON line of what it found.
_COMPILE = r"""
import collections, json, os, re, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
path, warps, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = triton.compile(path, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
cubin = path + ".cubin"
open(cubin, "wb").write(k.asm["cubin"])
tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", cubin], capture_output=True,
                       text=True).stdout
sass = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-sass", cubin], capture_output=True, text=True).stdout
code = [(int(m.group(1), 16), m.group(2).split(".")[0], m.group(3)) for m in re.finditer(
    r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);", sass, re.M)]
ops = collections.Counter(op for _, op, _ in code)
# the main loop: the longest span a backward branch closes (the GEMV's one K loop, the attention's longest key
# loop; the final BRA to itself is not one)
spans = [(int(t.group(1), 16), at) for at, op, rest in code if op == "BRA"
         for t in [re.search(r"0x([0-9a-f]+)", rest)] if t and int(t.group(1), 16) < at]
first, last = max(spans, key=lambda s: s[1] - s[0], default=(1, 0))
loop = collections.Counter(op for at, op, _ in code if first <= at <= last)
print(json.dumps({"registers": int(re.search(r"REG:(\d+)", usage).group(1)), "shared_bytes": k.metadata.shared,
                  "layout_conversions": k.asm["ttgir"].count("ttg.convert_layout"),
                  "async_copies": ops.get("LDGSTS", 0),
                  "sass_instructions": sum(ops.values()), "opcodes": dict(ops.most_common(60)),
                  "loop_instructions": sum(loop.values()), "loop_opcodes": dict(loop.most_common(40))}))
"""


class KernelCapture:
    """Triton modules Pallas lowers while active, each once, with the kernel's name, warps and stages (read from
    Pallas's pallas_call lowering, the caller of lower_jaxpr_to_triton_module)."""

    def __init__(self):
        self.kernels: dict[str, dict] = {}
        self._original = lowering.lower_jaxpr_to_triton_module

    def __enter__(self):
        def capture(jaxpr, grid_mapping, *args, **kwargs):
            result = self._original(jaxpr, grid_mapping, *args, **kwargs)
            caller = sys._getframe(1).f_locals
            ir = result.module.operation.get_asm(enable_debug_info=False)
            digest = hashlib.sha1(ir.encode()).hexdigest()[:12]
            name = getattr(caller.get("debug_info"), "func_name", None) or caller.get("name") or "kernel"
            self.kernels.setdefault(digest, {"name": str(name), "ir": ir, "num_warps": caller.get("num_warps", 4),
                                             "num_stages": caller.get("num_stages", 1)})
            return result

        lowering.lower_jaxpr_to_triton_module = capture
        return self

    def __exit__(self, *exc):
        lowering.lower_jaxpr_to_triton_module = self._original


def capture_triton_ir(fn, *avals, platform: str = "cuda") -> list[str]:
    """The Triton IR text of every distinct Pallas kernel in jit(fn) lowered for `platform` (cuda, rocm) at these
    abstract inputs, in launch order."""
    with KernelCapture() as captured:
        jax.jit(fn).trace(*avals).lower(lowering_platforms=(platform,))
    return [kernel["ir"] for kernel in captured.kernels.values()]


def int8_gemv_ir(out: int, k: int, rows: int, dtype, block_sizes: qi.BlockSizes, ggml_type=T.IQ4_XS) -> str:
    """The int8 GEMV's Triton IR for x [rows, k] @ W[layer].T, W a packed weight stacked two layers deep (its
    planes as QuantizedTensor.from_gguf lays them out)."""
    blocks = k // GGML_QUANT_SIZES[ggml_type][0]
    avals = {f.name: jax.ShapeDtypeStruct((2, out, blocks, f.nbytes // np.dtype(f.dtype).itemsize), f.dtype)
             for f in FORMATS[ggml_type].fields}

    def product(x, planes):
        w = QuantizedTensor(planes, ggml_type, (out, k), jnp.bfloat16)
        return qi.int8_quant_matmul(x, w, jnp.int32(1), block_sizes=block_sizes)

    *_, ir = capture_triton_ir(product, jax.ShapeDtypeStruct((rows, k), dtype), avals)  # after x's quantization
    return ir


def vision_attention_ir(tokens: int, heads: int, head_dim: int, block_sizes) -> str:
    """The vision tower's attention kernel's Triton IR for one image of `tokens` patches, bf16 q, k, v."""
    qkv = jax.ShapeDtypeStruct((tokens, heads, head_dim), jnp.bfloat16)

    def attend(q, k, v, segments):
        return va.vision_attention(q, k, v, segments, scale=head_dim**-0.5, block_sizes=block_sizes)

    *_, ir = capture_triton_ir(attend, qkv, qkv, qkv, jax.ShapeDtypeStruct((tokens,), jnp.int32))
    return ir


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=int, default=17408)
    ap.add_argument("--in", dest="k", type=int, default=5120)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tiles", default="16,4,8", help="block_n, blocks_k, warps[, parts]")
    ap.add_argument("--prefetch", nargs="?", const="all", choices=["all", "small"],
                    help="load the next K step's planes ahead in registers (all, or the small planes only)")
    ap.add_argument("--flat", action="store_true", help="load the codes as one run a row (BlockSizes.flat)")
    ap.add_argument("--split-small", action="store_true",
                    help="load the small planes in pieces of fewer values than threads (BlockSizes.split_small)")
    ap.add_argument("--format", default="IQ4_XS", choices=[t.name for t in qi.FORMATS])
    ap.add_argument("--triton", default=sys.executable, help="a Python that has PyPI's triton")
    ap.add_argument("--keep", help="also write the Triton IR here")
    ap.add_argument("--vision", help="tokens,heads,head_dim: the vision attention kernel instead, --tiles as "
                    "block_q,block_k,warps,stages")
    args = ap.parse_args()
    if args.vision:
        bs = va.BlockSizes(*(int(v) for v in args.tiles.split(",")))
        ir = vision_attention_ir(*(int(v) for v in args.vision.split(",")), bs)
        warps, described = bs.num_warps, {"kernel": "vision_attention", "shape": args.vision, "block_sizes": str(bs)}
    else:
        block_n, blocks_k, warps, parts = (*(int(v) for v in args.tiles.split(",")), 1)[:4]
        bs = qi.BlockSizes(block_n, blocks_k, warps, parts=parts, flat=args.flat, split_small=args.split_small,
                           prefetch={"all": True, "small": "small", None: False}[args.prefetch])
        ir = int8_gemv_ir(args.out, args.k, args.rows, jnp.dtype(args.dtype), bs, T[args.format])
        described = {"format": args.format, "block_sizes": str(bs), "rows": args.rows, "x": args.dtype}
    with tempfile.TemporaryDirectory() as d:
        path = Path(args.keep) if args.keep else Path(d) / "kernel.ttir"
        path.write_text(ir)
        found = subprocess.run([args.triton, "-c", _COMPILE, str(path), str(warps), str(bs.num_stages)],
                               capture_output=True, text=True)
    if found.returncode:
        sys.exit(f"Triton could not compile the IR (is triton installed for {args.triton}?):\n{found.stderr[-2000:]}")
    report = json.loads(found.stdout.strip().splitlines()[-1])
    print(json.dumps({**described, **report}, indent=1))


if __name__ == "__main__":
    main()
