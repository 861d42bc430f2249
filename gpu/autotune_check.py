"""Which configs does flash.py's autotuner pick on the ANCHORS shapes, and is the pick the fastest? For each shape:
forward and backward times with autotuning (and the configs it chose), then with every kernel forced to each of its
two configs in turn (flash.FWD/DQ/DKDV_CONFIGS, first = the measured default). One table.
Run from the repository root on a GPU: python gpu/autotune_check.py"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import triton  # noqa: E402

import flash  # noqa: E402

KERNELS = {"fwd": (flash._fwd_kernel, flash.FWD_CONFIGS), "dq": (flash._dq_kernel, flash.DQ_CONFIGS),
           "dkdv": (flash._dkdv_kernel, flash.DKDV_CONFIGS)}


def picked_cfg(cfg):
    return (cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages)


def picked(kernel):
    return picked_cfg(kernel.best_config)


def times(q, k, v, do):
    o, lse = flash._forward(q, k, v, True)
    fwd = triton.testing.do_bench(lambda: flash._forward(q, k, v, True), warmup=10, rep=40)
    bwd = triton.testing.do_bench(lambda: flash._backward(do, q, k, v, o, lse, True), warmup=10, rep=40)
    return fwd, bwd


def main():
    torch.manual_seed(0)
    rows = []
    for B, H, S, d in ((16, 32, 1024, 64), (4, 32, 4096, 64), (1, 32, 16384, 64), (16, 16, 1024, 128),
                       (4, 16, 4096, 128), (1, 16, 16384, 128)):
        q, k, v, do = (torch.randn(B, H, S, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        flash.AUTOTUNE = True
        for kern, _ in KERNELS.values():
            kern.cache.clear()
        fwd, bwd = times(q, k, v, do)
        rows.append(f"| B={B} H={H} S={S} D={d} | autotuned | {picked(flash._fwd_kernel)} | "
                    f"{picked(flash._dq_kernel)} | {picked(flash._dkdv_kernel)} | {fwd:.3f} | {bwd:.3f} |")
        print(rows[-1], flush=True)
        for name, (kern, _) in KERNELS.items():  # what the tuner measured for each candidate
            print(f"  {name} tuning ms:", {picked_cfg(c): round(t[0] if isinstance(t, list) else t, 4)
                                           for c, t in getattr(kern, "configs_timings", {}).items()}, flush=True)
        for i in (0, 1):  # every kernel on its i-th config
            saved = {name: dict(table) for name, (_, table) in KERNELS.items()}
            for name, (kern, table) in KERNELS.items():
                for key in table:
                    table[key] = [table[key][i]]
                kern.cache.clear()
            fwd, bwd = times(q, k, v, do)
            rows.append(f"| B={B} H={H} S={S} D={d} | config {i} | {picked(flash._fwd_kernel)} | "
                        f"{picked(flash._dq_kernel)} | {picked(flash._dkdv_kernel)} | {fwd:.3f} | {bwd:.3f} |")
            print(rows[-1], flush=True)
            for name, (_, table) in KERNELS.items():
                table.update(saved[name])
    print(f"\ncausal bf16, {torch.cuda.get_device_name()}, triton {triton.__version__}, {time.strftime('%Y-%m-%d')}")
    print("| case | configs | fwd | dq | dk/dv | fwd ms | bwd ms |\n|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
