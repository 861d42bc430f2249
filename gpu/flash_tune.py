"""Tile-config sweep for flash.py's three kernels on the GPU (issue 4 §4): each candidate (BLOCK_M, BLOCK_N,
warps, stages) is forced in turn and timed with triton.testing.do_bench on a causal bf16 shape, results checked
against the autotuned kernels. Prints the best per kernel and head dim. Run from the repository root:
python gpu/flash_tune.py"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import flash  # noqa: E402  (first: on a machine without CUDA it selects Triton's interpreter)
import triton  # noqa: E402

CANDIDATES = {  # head dim -> kernel -> configs; the first is flash.py's current choice (FLASH_TMA picks the load
    # path being tuned: with TMA the best tiles can differ from the pointer-load kernels')
    128: {"fwd": [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (128, 128, 8, 3), (64, 64, 4, 3),
                  (128, 64, 4, 3), (128, 32, 8, 3)],
          "dq": [(128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2),
                 (64, 32, 4, 3), (128, 64, 4, 3), (128, 64, 8, 4)],
          "dkdv": [(64, 128, 8, 3), (32, 128, 4, 3), (64, 128, 8, 2), (32, 128, 8, 3), (64, 128, 4, 3),
                   (128, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 4)]},
    64: {"fwd": [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 4, 3), (128, 64, 4, 4),
                 (64, 64, 4, 4)],
         "dq": [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3),
                (64, 64, 4, 4)],
         "dkdv": [(32, 128, 4, 3), (32, 64, 4, 3), (64, 128, 8, 3), (64, 128, 4, 3), (32, 128, 4, 4),
                  (64, 64, 4, 3), (128, 128, 8, 3)]},
}
NAMES = {"fwd": ("_fwd_kernel", flash._attn_fwd), "dq": ("_dq_kernel", flash._attn_bwd_dq),
         "dkdv": ("_dkdv_kernel", flash._attn_bwd_dkdv)}


class Forced:
    """Stands in for an autotuned kernel: launches the plain kernel with one fixed config (None: does nothing)."""

    def __init__(self, fn, cfg):
        self.fn, self.cfg = fn, cfg

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if self.cfg is None:
                return
            m, n, w, s = self.cfg
            meta = dict(BLOCK_M=m, BLOCK_N=n)
            kwargs.update(meta)
            self.fn[grid(meta)](*args, **kwargs, num_warps=w, num_stages=s)
        return launch


def main():
    torch.manual_seed(0)
    smoke = not torch.cuda.is_available()  # a tiny interpreter run that only checks the script
    device = "cpu" if smoke else "cuda"
    autotuned = {k: getattr(flash, attr) for k, (attr, _) in NAMES.items()}
    lines = []
    for d, kernels in CANDIDATES.items():
        B, H, S = (1, 1, 64) if smoke else (4, 2048 // d, 4096)
        if smoke:
            kernels = {name: cfgs[:2] for name, cfgs in kernels.items()}
        q, k, v, do = (torch.randn(B, H, S, d, device=device, dtype=torch.float32 if smoke else torch.bfloat16)
                       for _ in range(4))
        o, lse = flash._forward(q, k, v, True)
        ref = (o, *flash._backward(do, q, k, v, o, lse, True))
        for name, cfgs in kernels.items():
            results = []
            for cfg in cfgs:
                for other, (attr, fn) in NAMES.items():  # only this kernel runs (the others do nothing)
                    setattr(flash, attr, Forced(fn, cfg if other == name else None))
                try:
                    if name == "fwd":
                        run = lambda: flash._forward(q, k, v, True)
                        got = run()[0]
                        err = (got.float() - ref[0].float()).abs().max().item()
                    else:
                        run = lambda: flash._backward(do, q, k, v, o, lse, True)
                        got = run()
                        pick = [1] if name == "dq" else [2, 3]
                        err = max((got[i - 1].float() - ref[i].float()).abs().max().item() for i in pick)
                    ms = triton.testing.do_bench(run, warmup=10, rep=30) if not smoke else 0.0
                    results.append((ms, cfg, err))
                    print(f"D={d} {name} {cfg}: {ms:.3f} ms, max diff {err:.2e}", flush=True)
                except Exception as e:  # e.g. out of shared memory
                    print(f"D={d} {name} {cfg}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
            for k_, (attr, _) in NAMES.items():
                setattr(flash, attr, autotuned[k_])
            if results:
                best = min(results)
                cur = next((r for r in results if r[1] == cfgs[0]), None)
                lines.append(f"| {d} | {name} | {cfgs[0]} | {cur[0] if cur else float('nan'):.3f} | {best[1]} | "
                             f"{best[0]:.3f} | {best[2]:.1e} |")
    print(f"\nB*S = 16384, H*D = 2048, causal bf16, FLASH_TMA={flash.TMA}, {torch.cuda.get_device_name() if not smoke else 'CPU smoke run'}, {time.strftime('%Y-%m-%d')}")
    print("| D | kernel | current config | ms | best config | ms | max diff |\n|---|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
