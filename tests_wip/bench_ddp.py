"""bench.py subcommands for data parallelism (SPEC §7.8, §7.9), to be pasted into bench.py:

    torchrun --nproc_per_node=2 bench.py allreduce [--sizes_mb 1 10 100 1000] [--iters 20]
    torchrun --nproc_per_node=2 bench.py ddp [--preset gpt2-xl] [--batch_size 8] [--context_length 1024]
                                             [--steps 10] [--warmup 3] [--variants local naive ... torch-fsdp2]
    torchrun --nproc_per_node=2 bench.py ddp --preset tiny --steps 2 --warmup 1   # CPU + gloo smoke test

Both print a Markdown table on rank 0 (with the command, date and device) and write JSON (--json). torch, ddp,
model and train are imported when a command runs, never at import time.
"""


def _env_line(device):
    import datetime
    import sys

    import torch
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo)"
    return (f"`{' '.join(['torchrun ... bench.py'] + sys.argv[1:])}`, {datetime.date.today().isoformat()}, {what}, "
            f"torch {torch.__version__}")


def _timer(device):
    """Wall-clock timer that first waits for the device (SPEC §7.1)."""
    import time

    import torch

    def now():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()
    return now


def _markdown(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _write_json(path, obj):
    import json
    import os
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def cmd_allreduce(argv):
    """All-reduce of fp32 tensors (SPEC §6.2, §7.8): per size, median and mean ms over timed iterations (each
    iteration's time is the slowest rank's, gathered with all_gather_object), algbw = bytes / median time and
    busbw = algbw * 2 (N - 1) / N, in GiB/s. NCCL on GPUs, gloo on CPU."""
    import argparse
    import statistics

    import torch
    import torch.distributed as dist

    import ddp

    ap = argparse.ArgumentParser(prog="bench.py allreduce")
    ap.add_argument("--sizes_mb", type=float, nargs="+", default=[1, 10, 100, 1000], help="MiB per tensor")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default="bench_allreduce.json")
    args = ap.parse_args(argv)
    rank, _, world_size, device = ddp.init_distributed()
    if not dist.is_initialized():
        raise SystemExit("bench.py allreduce needs several processes: run it under torchrun --nproc_per_node=N")
    now = _timer(device)
    rows, records = [], []
    for mb in args.sizes_mb:
        nbytes = int(mb * 2**20)
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        for _ in range(args.warmup):
            dist.all_reduce(x)
            x.fill_(1.0)
        times = []
        for _ in range(args.iters):
            dist.barrier()
            t0 = now()
            dist.all_reduce(x)
            times.append(now() - t0)
            x.fill_(1.0)  # keep values finite (a sum of ones grows by N per call)
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, times)
        slowest = [max(ts[i] for ts in per_rank) for i in range(args.iters)]
        median, mean = statistics.median(slowest), statistics.mean(slowest)
        algbw = x.numel() * 4 / median / 2**30
        busbw = algbw * 2 * (world_size - 1) / world_size
        records.append(dict(size_mib=mb, world_size=world_size, median_ms=median * 1e3, mean_ms=mean * 1e3,
                            algbw_gib_s=algbw, busbw_gib_s=busbw, backend=dist.get_backend()))
        rows.append([f"{mb:g}", world_size, f"{median * 1e3:.3f}", f"{mean * 1e3:.3f}", f"{algbw:.1f}",
                     f"{busbw:.1f}"])
        if rank == 0:
            print(f"all-reduce {mb:g} MiB: median {median * 1e3:.3f} ms, busbw {busbw:.1f} GiB/s", flush=True)
        del x
    if rank == 0:
        print(f"\nAll-reduce, fp32, {dist.get_backend()}: {_env_line(device)}\n")
        print(_markdown(["MiB", "ranks", "median ms", "mean ms", "algbw GiB/s", "busbw GiB/s"], rows))
        _write_json(args.json, dict(command="allreduce", env=_env_line(device), results=records))
    ddp.cleanup_distributed()


DDP_VARIANTS = ("local", "naive", "flat", "overlap", "bucketed-1", "bucketed-10", "bucketed-25", "bucketed-100",
                "bucketed-1000", "bucketed-25+zero1", "fsdp", "fsdp-bf16", "torch-ddp", "torch-zero", "torch-fsdp2")
_TINY = dict(d_model=64, d_ff=172, num_layers=2, num_heads=4)


def _optimizer_state_bytes(optimizer):
    """Bytes of optimizer state held by this rank (ZeRO wrappers: their local inner optimizer; DTensors: the
    local shard)."""
    import torch
    inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "optim", None) or optimizer
    total = 0
    for state in inner.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                v = getattr(v, "_local_tensor", v)
                total += v.numel() * v.element_size()
    return total


def _build_variant(variant, net, device, opt_cls, lr):
    """(model to call, optimizer, finish function or None) for one variant; the model is already on device."""
    import torch

    import ddp
    kwargs = dict(lr=lr, weight_decay=0.1)
    if variant == "local":  # no wrapper, no communication: the per-GPU compute baseline
        return net, opt_cls(net.parameters(), **kwargs), None
    if variant in ("naive", "flat", "overlap") or variant.startswith("bucketed"):
        size = variant.split("+")[0].split("-")[1] if variant.startswith("bucketed") else None
        wrapped = {"naive": ddp.DDPNaive, "flat": ddp.DDPFlat, "overlap": ddp.DDPIndividualParameters}.get(
            variant, lambda m: ddp.DDPBucketed(m, float(size)))(net)
        if variant.endswith("+zero1"):
            optimizer = ddp.ShardedOptimizer(net.parameters(), opt_cls, **kwargs)
        else:
            optimizer = opt_cls(net.parameters(), **kwargs)
        return wrapped, optimizer, wrapped.finish_gradient_synchronization
    if variant in ("fsdp", "fsdp-bf16"):
        wrapped = ddp.FSDP(net, compute_dtype=torch.bfloat16 if variant == "fsdp-bf16" else None)
        return wrapped, opt_cls(wrapped.parameters(), **kwargs), wrapped.finish_gradient_synchronization
    if variant in ("torch-ddp", "torch-zero"):
        from torch.nn.parallel import DistributedDataParallel
        wrapped = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
        if variant == "torch-zero":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            return wrapped, ZeroRedundancyOptimizer(net.parameters(), optimizer_class=opt_cls, **kwargs), None
        return wrapped, opt_cls(net.parameters(), **kwargs), None
    if variant == "torch-fsdp2":  # the anchors' setup: fully_shard per block, bf16 params, fp32 reduce
        try:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in net.layers:
            fully_shard(block, mp_policy=policy)
        fully_shard(net, mp_policy=policy)
        return net, opt_cls(net.parameters(), **kwargs), None
    raise ValueError(f"unknown variant {variant!r}; expected one of {DDP_VARIANTS}")


def cmd_ddp(argv):
    """Data-parallel variants on TransformerLM in one run (SPEC §7.9): ours (naive, flat, per-parameter overlap,
    bucketed at several sizes, bucketed + ZeRO-1, FSDP fp32 and bf16 gathers) beside torch DDP,
    ZeroRedundancyOptimizer and FSDP2, plus "local" (no wrapper, no communication: the per-GPU compute that
    scaling is measured against). Per variant: median ms/step over --steps timed steps (each the slowest rank's),
    scaling = local / variant, communication ms (naive, flat: timed between synchronizes around
    finish_gradient_synchronization; others: step - local, the communication not hidden behind compute), peak
    memory after init, just before optimizer.step() and just after it (SPEC §6.9), and optimizer-state bytes on
    this rank."""
    import argparse
    import gc
    import statistics
    import time
    import contextlib

    import torch
    import torch.distributed as dist

    import ddp
    import model

    ap = argparse.ArgumentParser(prog="bench.py ddp")
    ap.add_argument("--preset", default="gpt2-xl", help=f"model.PRESETS key or 'tiny' {_TINY}")
    ap.add_argument("--vocab_size", type=int, default=50304)
    ap.add_argument("--batch_size", type=int, default=8, help="per rank")
    ap.add_argument("--context_length", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=list(DDP_VARIANTS), choices=DDP_VARIANTS)
    ap.add_argument("--attn_impl", default=None, help="default: flash on CUDA, naive on CPU")
    ap.add_argument("--amp", default=None, choices=["bf16", "none"], help="default: bf16 on CUDA, none on CPU")
    ap.add_argument("--optimizer", default="ours", choices=["ours", "torch"],
                    help="the same optimizer for every variant: train.AdamW or torch.optim.AdamW (fused on CUDA)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--json", default="bench_ddp.json")
    args = ap.parse_args(argv)
    rank, _, world_size, device = ddp.init_distributed()
    if not dist.is_initialized():
        raise SystemExit("bench.py ddp needs a process group: run it under torchrun --nproc_per_node=N")
    cuda = device.type == "cuda"
    dims = _TINY if args.preset == "tiny" else model.PRESETS[args.preset]
    if args.preset == "tiny" and args.vocab_size == 50304:
        args.vocab_size = 512
    attn_impl = args.attn_impl or ("flash" if cuda else "naive")
    amp = (args.amp or ("bf16" if cuda else "none")) == "bf16"
    if args.optimizer == "ours":
        from train import AdamW as opt_cls
    else:
        import functools
        opt_cls = functools.partial(torch.optim.AdamW, fused=True) if cuda else torch.optim.AdamW
    now = _timer(device)
    gib = 2**30
    g = torch.Generator(device=device).manual_seed(1234 + rank)  # each rank its own slice of the global batch
    x = torch.randint(0, args.vocab_size, (args.batch_size, args.context_length), device=device, generator=g)
    y = torch.randint(0, args.vocab_size, (args.batch_size, args.context_length), device=device, generator=g)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if amp else contextlib.nullcontext
    mem = (lambda: torch.cuda.max_memory_allocated(device) / gib) if cuda else (lambda: float("nan"))
    if rank == 0:
        print(f"bench ddp: {args.preset} {dims}, vocab {args.vocab_size}, batch {args.batch_size}/rank x "
              f"{world_size} ranks, T {args.context_length}, attn {attn_impl}, bf16 autocast {amp}, "
              f"optimizer {args.optimizer}", flush=True)

    results, t_start = [], time.time()
    for k, variant in enumerate(args.variants):
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        record = dict(variant=variant)
        try:
            torch.manual_seed(0)
            net = model.TransformerLM(args.vocab_size, args.context_length, **dims, attn_impl=attn_impl,
                                      device=device)
            wrapped, optimizer, finish = _build_variant(variant, net, device, opt_cls, args.lr)
            record["peak_after_init_gib"] = mem()
            steps, comm, before, after = [], [], [], []
            for it in range(args.warmup + args.steps):
                dist.barrier()
                t0 = now()
                with autocast():
                    logits = wrapped(x)
                loss = model.cross_entropy(logits, y)
                del logits
                loss.backward()
                if finish is not None and variant in ("naive", "flat"):
                    t1 = now()
                    finish()
                    comm.append(now() - t1)
                elif finish is not None:
                    finish()
                before.append(mem())
                optimizer.step()
                after.append(mem())
                optimizer.zero_grad(set_to_none=True)
                steps.append(now() - t0)
            per_rank = [None] * world_size
            dist.all_gather_object(per_rank, (steps[args.warmup:], comm[args.warmup:]))
            slowest = [max(r[0][i] for r in per_rank) for i in range(args.steps)]
            record["ms_per_step"] = statistics.median(slowest) * 1e3
            if comm:
                record["comm_ms"] = statistics.median(max(r[1][i] for r in per_rank) for i in range(args.steps)) * 1e3
            record["peak_before_step_gib"] = max(before)
            record["peak_after_step_gib"] = max(after)
            record["optimizer_state_gib"] = _optimizer_state_bytes(optimizer) / gib
            record["loss"] = loss.item()
            del wrapped, optimizer, finish, net, loss
        except Exception as e:  # a baseline missing from this torch build must not sink the other rows
            record["error"] = f"{type(e).__name__}: {e}"[:200]
        statuses = [None] * world_size
        dist.all_gather_object(statuses, record.get("error"))
        if any(statuses) and "error" not in record:
            record["error"] = next(s for s in statuses if s)
        results.append(record)
        if rank == 0:
            done = time.time() - t_start
            eta = done / (k + 1) * (len(args.variants) - k - 1)
            status = record.get("error") or f"{record['ms_per_step']:.1f} ms/step"
            print(f"[{k + 1}/{len(args.variants)}] {variant}: {status}  ({done:.0f}s, ETA {eta:.0f}s)", flush=True)

    local = next((r["ms_per_step"] for r in results if r["variant"] == "local" and "ms_per_step" in r), None)
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["variant"], r["error"]] + [""] * 7)
            continue
        scaling = f"{100 * local / r['ms_per_step']:.1f}%" if local else "-"
        if "comm_ms" in r:
            comm = f"{r['comm_ms']:.1f}"
        elif local and r["variant"] != "local":
            comm = f"~{r['ms_per_step'] - local:.1f}"
        else:
            comm = "-"
        rows.append([r["variant"], f"{r['ms_per_step']:.1f}", scaling, comm, f"{r['peak_after_init_gib']:.2f}",
                     f"{r['peak_before_step_gib']:.2f}", f"{r['peak_after_step_gib']:.2f}",
                     f"{r['optimizer_state_gib']:.3g}", f"{r['loss']:.3f}"])
    if rank == 0:
        print(f"\nData parallel, {args.preset}, batch {args.batch_size}/rank, T {args.context_length}, "
              f"{world_size} ranks: {_env_line(device)}\n")
        print(_markdown(["variant", "ms/step", "scaling vs local", "comm ms", "peak init GiB",
                         "peak before step GiB", "peak after step GiB", "opt state GiB/rank", "loss"], rows))
        print("\ncomm ms: naive/flat measured between synchronizes; ~x = step - local (communication not hidden).")
        _write_json(args.json, dict(command="ddp", env=_env_line(device), args=vars(args), world_size=world_size,
                                    results=results))
    ddp.cleanup_distributed()
