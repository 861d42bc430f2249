"""Packed documents: flash.py against an earlier flash.py, same run. Session 5 made the dK/dV pass's diagonal loop run
a fixed BLOCK_N / BLOCK_M query tiles (a variable count made ptxas serialize the tensor-core instructions); on short
documents that loop now also covers rows past a document's end, masked. This times both versions' varlen forward and
backward (direct calls) on short log-normal documents (median 200 tokens, as `bench.py varlen`) and on the ANCHORS
packed cases, and checks the gradients agree.

    git show 0e34615:flash.py > gpu/flash_prev.py     # the fourth session's kernels
    python gpu/varlen_prev.py gpu/flash_prev.py"""
import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import triton  # noqa: E402

import flash  # noqa: E402


def lengths(total, median, max_len, gen):
    lens = []
    while sum(lens) < total:
        lens.append(int(min(max_len, max(16, torch.empty(1).log_normal_(float(torch.tensor(median).log()), 1.0,
                                                                          generator=gen).item()))))
    lens[-1] -= sum(lens) - total
    return [n for n in lens if n > 0]


def main():
    spec = importlib.util.spec_from_file_location("flash_prev", sys.argv[1])
    prev = sys.modules["flash_prev"] = importlib.util.module_from_spec(spec)  # Triton looks kernels' modules up
    spec.loader.exec_module(prev)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, total, median, max_len, H, d in (("short docs", 32768, 200, 1024, 12, 64),
                                               ("short docs", 32768, 200, 1024, 16, 128),
                                               ("ANCHORS", 16384, 403, 4096, 32, 64),
                                               ("ANCHORS", 16384, 403, 1075, 16, 128)):
        lens = lengths(total, median, max_len, gen)
        cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
        q, k, v, do = (torch.randn(total, H, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        res = {}
        for tag, mod in (("prev", prev), ("now", flash)):
            o, lse = mod._forward(q, k, v, True, cu, cu, max(lens), max(lens))
            grads = mod._backward(do, q, k, v, o, lse, True, cu, cu, max(lens), max(lens))
            fwd = triton.testing.do_bench(lambda: mod._forward(q, k, v, True, cu, cu, max(lens), max(lens)),
                                          warmup=10, rep=50)
            bwd = triton.testing.do_bench(lambda: mod._backward(do, q, k, v, o, lse, True, cu, cu, max(lens),
                                                                max(lens)), warmup=10, rep=50)
            res[tag] = (fwd, bwd, grads)
        err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                  for a, b in zip(res["now"][2], res["prev"][2]))
        rows.append(f"| {name}: {len(lens)} docs, {total} tokens, H={H} D={d} | {res['prev'][0]:.3f} | "
                    f"{res['now'][0]:.3f} | {res['prev'][1]:.3f} | {res['now'][1]:.3f} | "
                    f"{res['prev'][1] / res['now'][1]:.2f}x | {err:.1e} |")
        print(rows[-1], flush=True)
    print(f"\ncausal bf16, {torch.cuda.get_device_name()}, triton {triton.__version__}; direct calls, ms")
    print("| case | fwd prev | fwd now | bwd prev | bwd now | bwd speedup | grads rel diff |\n|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
