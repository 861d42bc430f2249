"""The 2.7B step (bench.py model --size xl --context_length 2048 --batch_size 4 --compile blocks --dtype bf16
--mode train --attn flash) with Linear's mixed-precision product varied, each variant built fresh one after another
in one process, in rounds (ABC ABC), then the PyTorch-native peer once:

    autocast    autocast's own x @ W.T (model.LINEAR_FP32_WEIGHT_GRADS off: weight gradients in bf16, then cast)
    fp32_wgrad  model._AutocastLinear (the default): the same products, the weight gradients written in fp32 by
                their GEMMs
    fused_norm  + every RMSNorm on impl="triton": each block's norms with their residual adds in one kernel
                each way (flash.add_rms_norm)

    python gpu/linear_ab.py [--rounds 2] [--steps 6] [--variants autocast,fp32_wgrad,fused_norm] [--no-peer]

Prints a table: ms per step of each round, the phases' mean, MFU (the causal half of attention, 989 TFLOP/s) and
peak MiB."""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402

import bench  # noqa: E402
import model  # noqa: E402

VARIANTS = {"autocast": (False, "torch"), "fp32_wgrad": (True, "torch"), "fused_norm": (True, "triton")}
# (model.LINEAR_FP32_WEIGHT_GRADS, every RMSNorm's impl)


def main(argv):
    p = argparse.ArgumentParser(prog="gpu/linear_ab.py")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args(argv)
    names = args.variants.split(",")
    for n in names:
        if n not in VARIANTS:
            raise SystemExit(f"--variants: {n!r} is not one of {', '.join(VARIANTS)}")
    device = torch.device("cuda")
    dims = dict(bench.SIZES["xl"])
    cfg = dict(size="xl", dims=dims, vocab_size=10000, context_length=2048, batch_size=4, dtype="bf16",
               compile="blocks", attn="flash", mode="train", recompute="none")
    rows = []
    for r in range(args.rounds):
        for name in names:
            model.LINEAR_FP32_WEIGHT_GRADS, norm_impl = VARIANTS[name]
            torch._dynamo.reset()
            torch.manual_seed(0)
            net = model.set_norm_impl(bench.build_model(dims, 10000, 2048, "flash", device), norm_impl)
            row = bench.run_config(net, bench.compiled(net, "blocks"), cfg, device, torch.Generator().manual_seed(0),
                                   args.warmup, args.steps)
            del net
            bench.free_memory(device)
            rows.append(dict(row, variant=name, round=r))
            print(f"round {r} {name:11s} {row['status']} {row.get('mean_ms', 0):8.2f} ms  {row.get('phase_ms')}",
                  flush=True)
    if args.peer:
        torch._dynamo.reset()
        peer = bench.build_native(dims, 10000, 2048, device)
        row = bench.run_config(peer, bench.compiled(peer, "blocks"), dict(cfg, attn="sdpa"), device,
                               torch.Generator().manual_seed(0), args.warmup, args.steps,
                               make_optimizer=bench.torch_adamw)
        rows.append(dict(row, variant="native peer", round=0))
    print(f"\nbf16, batch 4 x 2048, compiled per block, {args.warmup} warm-up and {args.steps} timed steps a run, "
          f"{args.rounds} rounds; {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| variant | ms/step (each round) | fwd / bwd / optimizer ms (mean) | MFU | peak MiB |")
    print("|---|---|---|---|---|")
    flops = bench.step_flops(dims, 10000, 2048, 4, "train", "flash")
    for name in names + (["native peer"] if args.peer else []):
        mine = [r for r in rows if r["variant"] == name and r["status"] == "ok"]
        if not mine:
            print(f"| {name} | failed | | | |")
            continue
        ms = [r["mean_ms"] for r in mine]
        phases = {k: sum(r["phase_ms"][k] for r in mine) / len(mine) for k in mine[0]["phase_ms"]}
        mean = sum(ms) / len(ms)
        print(f"| {name} | {' / '.join(f'{m:.2f}' for m in ms)} | "
              f"{' / '.join(f'{v:.1f}' for v in phases.values())} | {100 * flops / (mean / 1e3) / 989e12:.1f}% | "
              f"{max(r['peak_mib'] for r in mine):,.0f} |")
    bench.write_json(os.path.join(os.environ.get("OUT", "."), "linear_ab.json"), dict(rows=rows))


if __name__ == "__main__":
    main(sys.argv[1:])
