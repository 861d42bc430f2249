"""Compile flash.py's kernels for an H100/H200 (sm_90) on any machine, no GPU needed, and print what the compiler
made of them: registers per thread, stack bytes, spill loads and stores, SASS instructions, and whether ptxas
serialized the wgmma (tensor-core) instructions (its note C7515, "Potential Performance Loss: wgmma.mma_async
instructions are serialized"). A free first look before spending device time: with that note on it, the dK/dV pass
ran 16-20% slower than the same loop without it (BENCHMARKS.md, "What we tried"). Run it after changing a kernel's
loop structure.

Use the Triton the GPU machine has, e.g. 3.6, installed aside so the project's own stays:
    pip install --no-deps --target /tmp/triton36 triton==3.6.0
    PYTHONPATH=/tmp/triton36 python gpu/sass_stats.py [--head_dims 128,64] [--no_specialize] [--varlen] [--full]

Integer arguments are marked divisible by 16 as the runtime would mark them for the benchmark shapes (B·S = 16384,
H·D = 2048), except those in a kernel's do_not_specialize list (or none of them with --no_specialize, to see what
specializing would give)."""
import argparse
import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "0"  # compile for real even without a GPU (flash.py would pick the interpreter)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import flash  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
PTXAS = os.path.join(os.path.dirname(CUOBJDUMP), "ptxas")
TYPES = {"LSE": "*fp32", "DELTA": "*fp32", "cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32", "qk_scale": "fp32",
         "sm_scale": "fp32", **{t: "*bf16" for t in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV")}}  # other args: i32


def stats(fn, constexprs, warps, stages, specialize_all=False):
    sig = {n: "constexpr" if n in constexprs else TYPES.get(n, "i32") for n in fn.arg_names}
    skip = set() if specialize_all else {fn.arg_names[d] if isinstance(d, int) else d
                                         for d in getattr(fn, "do_not_specialize", ()) or ()}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if sig[n].startswith("*") or (sig[n] == "i32" and n not in skip)}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    path = f"/tmp/sass_stats_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    res = subprocess.run([CUOBJDUMP, "-res-usage", path], capture_output=True, text=True).stdout
    sass = subprocess.run([CUOBJDUMP, "-sass", path], capture_output=True, text=True).stdout
    with open(path[:-5] + "ptx", "w") as f:  # ptxas again, verbose, for its performance notes
        f.write(kernel.asm["ptx"])
    notes = subprocess.run([PTXAS, "-arch=sm_90a", "-v", path[:-5] + "ptx", "-o", path], capture_output=True,
                           text=True).stderr
    for p in (path, path[:-5] + "ptx"):
        os.remove(p)
    usage = dict(t.split(":", 1) for t in next(l for l in res.splitlines() if "REG:" in l).split() if ":" in t)
    instr = sum(1 for line in sass.splitlines() if line.strip().startswith("/*") and "*/" in line.strip()[2:])
    serialized = "yes" if "C7515" in notes else "no"
    return f"{usage['REG']} | {usage['STACK']} | {sass.count(' LDL')} | {sass.count(' STL')} | {instr} | {serialized}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head_dims", default="128,64")
    p.add_argument("--no_specialize", action="store_true", help="ignore do_not_specialize (all ints specialized)")
    p.add_argument("--varlen", action="store_true", help="the packed (variable-length) kernels instead of dense")
    p.add_argument("--full", action="store_true", help="non-causal instead of causal")
    args = p.parse_args()
    print(f"Triton {triton.__version__}, sm_90, bf16, {'non-causal' if args.full else 'causal'}, "
          f"{'packed' if args.varlen else 'dense'}; "
          f"{'every int specialized' if args.no_specialize else 'as flash.py compiles them'}\n")
    print("| D | kernel | config | registers | stack bytes | spill loads | spill stores | SASS instructions "
          "| wgmma serialized |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d in (int(x) for x in args.head_dims.split(",")):
        common = dict(HEAD_DIM=d, CAUSAL=not args.full, VARLEN=args.varlen, PREC="tf32", TMA=False)
        rows = [("fwd", flash._attn_fwd, flash.FWD_CONFIGS[(d, 2)][0], {}),
                ("dq", flash._attn_bwd_dq, flash.DQ_CONFIGS[(d, 2)][0], {}),
                ("dkdv", flash._attn_bwd_dkdv, flash.DKDV_CONFIGS[(d, 2)][0], dict(GROUP=1, EVEN_Q=not args.varlen))]
        for name, fn, (m, n, w, s), extra in rows:
            cx = dict(common, BLOCK_M=m, BLOCK_N=n, **extra)
            print(f"| {d} | {name} | {(m, n, w, s)} | {stats(fn, cx, w, s, args.no_specialize)} |", flush=True)


if __name__ == "__main__":
    main()
