"""Compile the sparse kernels for Hopper (sm_90) on a machine without a GPU: registers, spills, shared memory.

    PYTHONPATH=src python3 bench/compile_sm90.py [--dump DIR]

Triton's wheel carries the CUDA backend and ptxas, so `triton.compile` builds the same cubin for a GPUTarget
as on the H100 (for the installed Triton version: check it against the GPU machine's). Each kernel is compiled
with the config it autotunes to at layout block 64 (one warpgroup per program). --dump writes the TTGIR, PTX
and SASS per kernel: where spills and barriers sit, whether a dot operand comes from registers or shared
memory, what the pipeliner did with the loads. It costs no device time; timing still needs the GPU.

Close to, not exactly, the GPU build: with triton 3.6 (the H100's) it gave registers forward 251, dQ 224,
dK/dV 255 with a 72-byte spill stack, where ncu read 225, 226 and 255 with spills on the H100 (f6265eb); the
launcher specialises more arguments than this signature does.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mtrain_cli.attention.sparse import kernels_bwd, kernels_fwd, kernels_vertical

BF16 = {"Q", "K", "V", "DO", "O", "DQ", "DK", "DV"}
FP32 = {"LSE", "DEL", "PDK", "PDV", "DK32", "DV32"}
INT32 = {"DOCQ", "DOCK", "KSTART", "ROWEND", "DELTA", "BITMAP", "VCOL", "ROW", "COL", "VCH"}
FLOATS = {"qk_scale", "scale"}
DIVISIBLE_INTS = {"H", "Sq", "Sk", "NKB"}  # at 128K with 16 query heads: Triton's launcher marks them 16-divisible

# kernel -> (constexprs, warps, stages, fp32 pointers besides FP32): the configs chosen on the H100 at block 64
KERNELS = {
    "forward": (kernels_fwd._forward_kernel, {"BLOCK": 64, "SUB_N": 64, "VCHUNK": 64, "HEAD_DIM": 128, "MERGE": False},
                4, 3, ()),
    "dq": (kernels_bwd._dq_kernel, {"BLOCK": 64, "SUB_N": 64, "VCHUNK": 64, "HEAD_DIM": 128, "ACCUM": False}, 4, 2, ()),
    "dkdv": (kernels_bwd._dkdv_kernel, {"BLOCK": 64, "SUB_M": 64, "HEAD_DIM": 128, "ACCUM": False}, 4, 2,
             ("DK", "DV")),  # the block pass writes fp32; the fold casts
    "vertical": (kernels_vertical._vertical_kernel, {"BLOCK": 64, "SUB_M": 32, "VCHUNK": 64, "HEAD_DIM": 128}, 4, 2,
                 ()),
    "fold": (kernels_vertical._fold_kernel, {"BLOCK": 64, "VCHUNK": 64, "HEAD_DIM": 128}, 8, 1, ()),
}


def signature(fn, constexprs: dict, fp32: tuple[str, ...]) -> tuple[dict, dict]:
    """Types from the kernels' naming (pointers upper case, strides s*), with the 16-divisibility that Triton's
    launcher finds on a 128K call (pointers, strides, lengths): it changes the address code and registers."""
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name in BF16 | FP32 | INT32:
            sig[name] = ("*fp32" if name in FP32 or name in fp32 else "*bf16" if name in BF16 else "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
            if name in DIVISIBLE_INTS or name.startswith("s"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", type=Path, help="write k.ttgir, k.ptx, k.sass per kernel under this folder")
    args = parser.parse_args()
    bin_dir = Path(triton.__file__).parent / "backends/nvidia/bin"
    print(f"triton {triton.__version__}, target sm_90")
    for name, (kernel, constexprs, warps, stages, fp32) in KERNELS.items():
        fn = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel  # the JIT function inside
        sig, attrs = signature(fn, constexprs, fp32)
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        out = args.dump / name if args.dump else Path("/tmp") / f"compile_sm90_{name}"
        out.mkdir(parents=True, exist_ok=True)
        (out / "k.cubin").write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([bin_dir / "cuobjdump", "-res-usage", out / "k.cubin"], capture_output=True,
                               text=True).stdout
        line = next((ln.strip() for ln in usage.splitlines() if "REG:" in ln), usage.strip())
        fields = dict(f.split(":", 1) for f in line.split() if ":" in f)
        print(f"{name:9s} warps {warps} stages {stages}: registers {fields.get('REG')}, spill stack "
              f"{fields.get('STACK')} B, shared {compiled.metadata.shared / 1024:.1f} KB")
        if args.dump:
            for ext in ("ttgir", "ptx"):
                (out / f"k.{ext}").write_text(compiled.asm[ext])
            sass = subprocess.run([bin_dir / "cuobjdump", "-sass", out / "k.cubin"], capture_output=True, text=True)
            (out / "k.sass").write_text(sass.stdout)


if __name__ == "__main__":
    main()
