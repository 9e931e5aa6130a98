"""A kernel of hf_paged's kernels/ compiled for the H200 (sm_90) on any machine, no GPU needed:
registers, spills, shared memory, the kinds of global loads and the instruction mix.

    python evals/profiling/kernel_sass.py MODULE:KERNEL [--const NAME=VALUE ...]
        [--type NAME=TYPE ...] [--div16 NAME,...] [--warps 4] [--stages 3] [--dump DIR]

    e.g. python evals/profiling/kernel_sass.py fused_gemv:_fused_gemv_kernel \\
        --const K=4096 K_PAD=4096 BLOCK_M=1 BLOCK_N=4 NORM=1 ... --warps 8

What a GPU is scarce for: whether a change vectorises the weight loads, spills, or adds
shuffles, barriers or conversions a thread, before it is timed on the H200. It is no timing.
Compiled as a launch would be (Triton's own compiler and ptxas, from the triton package):
pointers 16-byte aligned (a launch specialises them so; without it no load is vectorised), ints
named in --div16 divisible by 16 (strides, sizes). Every constexpr the kernel takes must be given
with --const (True/False/ints/floats/strings); other arguments default to bf16 pointers and i32
ints (--type NAME=*fp8e4nv / *fp32 / *i32 / i64 / fp32 ...). Run it under the Triton version of
the machine it stands for (the H200 image has its own: `pip install --target DIR triton==X`
and put DIR first on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

if triton.knobs.runtime.interpret:  # triton.language was built for the interpreter at import
    raise SystemExit(
        "kernel_sass.py compiles kernels for the GPU: run it without TRITON_INTERPRET=1"
    )
triton.knobs.language.default_fp_fusion = True  # as Triton's default launch has it, stated

H200 = GPUTarget("cuda", 90, 32)
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_OP = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def _value(text: str):
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def compile_sm90(fn, consts: dict, types: dict, div16=(), warps: int = 4, stages: int = 3):
    """(the compiled kernel's cubin, its TTGIR) for the H200, as a launch with these values
    would compile it."""
    names = fn.arg_names
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in consts]
    if missing:
        raise ValueError(f"--const: give every constexpr; missing {missing}")
    signature = {}
    for n in names:
        if n in consts:
            signature[n] = "constexpr"
        else:
            signature[n] = types.get(n, "*bf16" if n.endswith("_ptr") else "i32")
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if signature[n].startswith("*") or (n in div16 and signature[n] != "constexpr")
    }
    src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=H200, options=dict(num_warps=warps, num_stages=stages))
    return kernel.asm["cubin"], kernel.asm["ttgir"]


def report(cubin: bytes) -> dict:
    """Registers / spill stack / shared memory, load kinds and the instruction mix of a cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run(
            [BIN / "cuobjdump", "--dump-resource-usage", path], capture_output=True, text=True
        ).stdout
        sass = subprocess.run([BIN / "cuobjdump", "-sass", path], capture_output=True, text=True)
    resources = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    ops = collections.Counter(m.group(1) for m in map(_OP.match, sass.stdout.splitlines()) if m)
    loads = {op: n for op, n in ops.items() if op.startswith(("LDG", "LDS", "STS", "LDGSTS"))}
    kinds = collections.Counter()
    for op, n in ops.items():
        kinds[op.split(".")[0]] += n
    return {
        "resources": {k: int(v) for k, v in resources.items()},
        "loads": dict(sorted(loads.items())),
        "mix": dict(kinds.most_common()),
        "instructions": sum(ops.values()),
        "sass": sass.stdout,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kernel", help="MODULE:KERNEL, MODULE in hf_paged/kernels")
    parser.add_argument("--const", nargs="*", default=[], metavar="NAME=VALUE")
    parser.add_argument("--type", nargs="*", default=[], metavar="NAME=TYPE")
    parser.add_argument("--div16", default="", help="int arguments divisible by 16, comma list")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--dump", default=None, help="a folder for the TTGIR and the SASS")
    args = parser.parse_args()
    module, name = args.kernel.split(":")
    fn = getattr(importlib.import_module(f"hf_paged.kernels.{module}"), name)
    consts = {k: _value(v) for k, v in (c.split("=", 1) for c in args.const)}
    types = dict(t.split("=", 1) for t in args.type)
    div16 = tuple(d for d in args.div16.split(",") if d)
    cubin, ttgir = compile_sm90(fn, consts, types, div16, args.warps, args.stages)
    out = report(cubin)
    print(f"{args.kernel} for sm_90, Triton {triton.__version__}, {args.warps} warps")
    print("resources:", out["resources"])
    print("loads and stores:", out["loads"])
    print(f"instructions: {out['instructions']} (the kernel's code, not its executed count)")
    print("mix:", out["mix"])
    if args.dump:
        folder = Path(args.dump)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.ttgir").write_text(ttgir)
        (folder / f"{name}.sass").write_text(out["sass"])
        print(f"TTGIR and SASS in {folder}")


if __name__ == "__main__":
    main()
