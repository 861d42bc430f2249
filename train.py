"""
Train a TransformerLM on a tokenized dataset.

    python train.py                                    # CPU default: Shakespeare, vocab 2048, a few minutes on 2 cores
    python train.py config/pack.py --max_iters 200     # config files of overrides, then --key=value / --key value
    python train.py --init_from=resume                 # continue out_dir/ckpt.pt exactly, with its saved config
    python train.py --force                            # start over in an out_dir that holds a run (kept in old/N)
    torchrun --standalone --nproc_per_node=4 train.py config/small.py   # 4 GPUs; --ddp_impl=..., --zero1=True
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST0:29500 train.py  # on each host

The file, top-down: the config globals; train(), the loop; the parts it
calls: set-up, the step (eager or as CUDA graphs), data, checkpoints; the
command line (main, cli: --help and bad flags are answered before torch is
imported); AdamW, Muon, the schedule and clipping. Importing it has no side
effects. SIGINT (Ctrl-C) or SIGTERM end a run after the step in progress,
with a checkpoint and the command that continues it.
"""
import ast
import builtins
import contextlib
import difflib
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from types import SimpleNamespace

_ROOT = os.path.dirname(os.path.abspath(__file__))

# -----------------------------------------------------------------------------
# config: defaults are a CPU run
# I/O
out_dir = "out"                 # checkpoint (ckpt.pt), log.jsonl and loss.png
init_from = "scratch"           # 'scratch', 'resume' (out_dir/ckpt.pt with its saved config) or a Llama directory
force = False                   # scratch into an out_dir holding a run: move that run to out_dir/old/N first
log_interval = 10               # optimizer steps between log lines
eval_interval = 100             # steps between validation-loss evaluations (and at the last step)
eval_iters = 10                 # fixed validation batches per evaluation
save_interval = 200             # steps between checkpoints (and at the end, and when a signal stops the run)
seed = 1337                     # model init and every data draw derive from it
# data
dataset = "shakespeare"         # name under data/ (made by `python data/prepare.py NAME`)
data_dir = ""                   # '' = data/<dataset> next to this file
batching = "concat"             # 'concat' | 'pad' | 'dynamic_pad' | 'pack' (make_batch)
pack_static = False             # 'pack' padded to a few static shapes (pad_packed): compiles without dynamic shapes
batch_size = 16                 # sequences per micro-batch; document batching: batch_size*context_length real tokens
context_length = 128            # tokens per sequence
grad_accum = 0                  # micro-batches per optimizer step, split across ranks (0: one per rank)
# model (config/*.py hold the preset shapes)
d_model = 256                   # residual width
num_layers = 4                  # transformer blocks
num_heads = 8                   # attention heads
d_ff = 704                      # SwiGLU hidden width (about 8/3 d_model, a multiple of 64)
rope_theta = 10000.0            # RoPE base
tie_embeddings = False          # share token_embeddings and lm_head
attn_impl = "auto"              # 'auto' (model.auto_attn_impl) | 'flash' | 'flash_ref' | 'sdpa' | 'naive'
act_ckpt_every = 0              # activation checkpointing in segments of k blocks (0 = off)
act_ckpt_layers = -1            # ... over the first n blocks only (-1: all)
selective_recompute = False     # the other blocks keep only matmul/attention outputs, recompute the elementwise rest
# optimizer
learning_rate = 3e-3            # peak learning rate
min_lr = 3e-4                   # floor of the cosine schedule
warmup_iters = 20               # linear warm-up steps
max_iters = 400                 # optimizer steps in total
lr_decay_iters = 0              # last step of the cosine phase (0 = max_iters)
weight_decay = 0.1              # decoupled decay of matrices (RMSNorm gains are not decayed)
beta1 = 0.9                     # AdamW first-moment decay
beta2 = 0.95                    # AdamW second-moment decay
eps = 1e-8                      # AdamW denominator epsilon
grad_clip = 1.0                 # global-norm clip (0 = off; the norm is still logged)
optimizer = "adamw"             # 'adamw' | 'muon' (Muon for the blocks' matrices)
muon_lr = 0.02                  # Muon's peak rate, scheduled like learning_rate
muon_momentum = 0.95            # Muon's Nesterov momentum
# system
device = "auto"                 # 'auto' (cuda if available), 'cpu', 'cuda', 'cuda:1', ...
dtype = "auto"                  # 'auto' (bfloat16 on CUDA, float32 on CPU) | 'float32' | 'bfloat16' (autocast)
compile = False                 # torch.compile the model
cuda_graphs = False             # CUDA graphs (with compile, static shapes and one process: make_step)
ddp_impl = "bucketed"           # under torchrun: one of DDP_IMPLS
zero1 = False                   # shard AdamW state across ranks (ddp.ShardedOptimizer; not with fsdp)
bucket_size_mb = 25.0           # bucket size of ddp_impl='bucketed'
peak_flops = 0.0                # per-GPU peak FLOP/s for MFU (0 = PEAK_FLOPS of the GPU, else no MFU)
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items()
               if not k.startswith("_") and isinstance(v, (int, float, bool, str))]

BATCHING = ("concat", "pad", "dynamic_pad", "pack")
OPTIMIZERS = ("adamw", "muon")
# ddp.IMPLS but 'none'
DDP_IMPLS = ("naive", "flat", "overlap", "bucketed", "fsdp", "torch", "torch_fsdp")


# -----------------------------------------------------------------------------
# the training loop

def train(config, given, rank, world_size, dev, stops):
    """The run on this rank; returns 0, or 128 + the number of the signal
    that stopped it (after a checkpoint)."""
    master = rank == 0

    def log(*args):
        if master:
            print(*args, flush=True)

    r = setup(config, given, rank, world_size, dev, log)
    c, w, optimizer, dev = r.c, r.w, r.optimizer, r.dev
    local_accum = c.grad_accum // world_size
    autocast = torch.autocast(dev.type, dtype=r.ptdtype,
                              enabled=r.ptdtype != torch.float32)
    # the loss summed since step loss_from (a resume's on rank 0), in fp64:
    # exact, so any number of ranks logs the same loss
    loss_from = r.loss_window["from"]
    carried = r.loss_window["loss_sum"] if master else 0.0
    loss_sum = torch.full((), carried, dtype=torch.float64, device=dev)

    def micro_step(j, batch):
        x, y, cu_seqlens, max_seqlen = batch
        last = j == local_accum - 1  # the gradients sync after the last
        with contextlib.nullcontext() if last else w.no_sync():
            with autocast:  # targets given: no full logits
                loss = w(x, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                         targets=y)
            # the wrappers average over ranks: 1 / grad_accum overall
            (loss / local_accum).backward()
        loss_sum.add_(loss.detach())

    max_norm = c.grad_clip if c.grad_clip > 0 else float("inf")
    train_step = make_step(w, optimizer, micro_step, max_norm, r.graphs)

    def sum_over_ranks(*values):  # in fp64, one all-reduce
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        if world_size > 1:
            torch.distributed.all_reduce(t)
        return t.tolist()

    def evaluate(step):  # on every rank; returns the seconds it took
        t0 = time.time()
        model = w.module if r.graphs else w  # not a second set of graphs
        total = torch.zeros((), dtype=torch.float64)
        count = 0
        model.eval()
        with torch.no_grad(), autocast:
            for x, y, cu_seqlens, max_seqlen, n_real in r.val_batches:
                loss = model(x, cu_seqlens=cu_seqlens,
                             max_seqlen=max_seqlen, targets=y)
                total = total + loss.double().cpu() * n_real
                count = count + n_real
        model.train()
        total, count = sum_over_ranks(total.item(), count)
        val_loss = total / count
        log(f"step {step}: val loss {val_loss:.4f}, "
            f"perplexity {math.exp(val_loss):.2f}")
        if master:
            elapsed = time.time() - t_start
            log_record(r.log_path, {"step": step, "val_loss": val_loss,
                                    "time_s": elapsed})
        return time.time() - t0

    def save(step):  # every rank calls it (collective under sharding)
        state = w.state_dict()
        opt_state = w.optimizer_state_dict(optimizer)
        window_sum = sum_over_ranks(loss_sum.item())[0]
        loss_window = {"from": loss_from, "loss_sum": window_sum}
        if not master:
            return
        rng = {"torch": torch.get_rng_state()}
        if dev.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(dev)
        save_checkpoint(state, opt_state, step, r.ckpt_path,
                        model_args=r.model_args, config=vars(c),
                        tokenizer=r.tokenizer, rng=rng,
                        world_size=world_size, loss_window=loss_window)

    def log_progress(step, lr, grad_norm):
        nonlocal t_last, step_last, tokens_since, eta_from, loss_from
        # the whole global batch's loss: every rank's micro-batches
        loss_total, tokens = sum_over_ranks(loss_sum.item(), tokens_since)
        train_loss = loss_total / c.grad_accum / (step - loss_from)
        now = time.time()
        seconds = now - t_last
        dt = seconds / (step - step_last)
        tok_s = tokens / seconds
        mfu, mfu_text = None, ""
        if r.peak:
            mfu = r.flops_tok * tok_s / (r.peak * world_size)
            mfu_text = f"MFU {100 * mfu:.1f}%, "
        # the ETA from the mean step since the first log line (warmed up)
        t0, step0 = eta_from or (t_last, step_last)
        eta = (now - t0) / (step - step0) * (c.max_iters - step)
        eta_from = eta_from or (now, step)
        log(f"step {step}/{c.max_iters}: loss {train_loss:.4f}, "
            f"lr {lr:.2e}, grad norm {grad_norm:.3f}, {tok_s:,.0f} tok/s, "
            f"{mfu_text}{1000 * dt:.1f} ms/step, ETA {eta / 60:.1f} min")
        if master:
            log_record(r.log_path, {
                "step": step, "loss": train_loss, "lr": lr,
                "grad_norm": grad_norm, "tokens_per_s": tok_s, "mfu": mfu,
                "ms_per_step": 1000 * dt, "eta_s": eta,
                "time_s": now - t_start})
        t_last, step_last, tokens_since = now, step, 0
        if step % c.log_interval == 0:  # else it stays open for a resume
            loss_sum.zero_()
            loss_from = step

    resumed = c.init_from == "resume"
    saved_at = r.start_iter if resumed else None
    decay_end = c.lr_decay_iters or c.max_iters
    pad_id = r.meta["eot_id"]
    stops.install()
    # the same bits on CPU: else the embedding's backward adds rows in the
    # threads' order
    deterministic = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(deterministic[0] or dev.type == "cpu",
                                       warn_only=True)
    t_start = t_last = time.time()
    step_last, tokens_since, eta_from = r.start_iter, 0, None
    w.train()
    try:
        for it in range(r.start_iter, c.max_iters):
            stop = stops.requested()
            resuming = resumed and it == r.start_iter
            if it % c.eval_interval == 0 and not resuming:
                t_last += evaluate(it)  # not counted as training time
            if stop:  # `it` steps are complete: keep them
                if saved_at != it:
                    save(it)
                log(f"stopped by {signal.Signals(stop).name} after step "
                    f"{it}: checkpoint in {r.ckpt_path}; continue with "
                    f"`{launcher(world_size)} train.py --out_dir="
                    f"{c.out_dir} --init_from=resume`")
                return 128 + stop

            lr = get_lr_cosine_schedule(it, c.learning_rate, c.min_lr,
                                        c.warmup_iters, decay_end)
            for group in optimizer.param_groups:
                group["lr"] = lr
                if group.get("muon"):  # the same schedule at Muon's peak
                    group["lr"] = lr * c.muon_lr / c.learning_rate

            batches = []
            for j in range(local_accum):  # this rank's micro-batches
                draw = batch_generator(c.seed, it, rank * local_accum + j)
                batches.append(make_batch(r.train_tokens, r.train_docs, c,
                                          draw, dev, pad_id))
            tokens_since += sum(batch[-1] for batch in batches)
            grad_norm = train_step([batch[:-1] for batch in batches])

            step = it + 1
            last = step == c.max_iters
            if step % c.log_interval == 0 or last:
                log_progress(step, lr, float(grad_norm))
            if last:
                evaluate(step)
            if step % c.save_interval == 0 or last:
                save(step)
                saved_at = step
                log(f"saved {r.ckpt_path} at step {step}")
        minutes = (time.time() - t_start) / 60
        log(f"done: {c.max_iters - r.start_iter} steps in {minutes:.1f} min")
        return 0
    finally:
        torch.use_deterministic_algorithms(deterministic[0],
                                           warn_only=deterministic[1])


# -----------------------------------------------------------------------------
# set-up

# dense bf16 FLOP/s (datasheets, SXM), matched by the device's name
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12}
# keys a resumed run must keep: another value would draw other batches or
# build another model
RESUME_FIXED = ("dataset", "batching", "batch_size", "context_length",
                "grad_accum", "seed", "d_model", "num_layers", "num_heads",
                "d_ff", "rope_theta", "tie_embeddings", "optimizer")


def setup(config, given, rank, world_size, dev, log):
    """Everything the loop needs, as a namespace; every input is judged
    before anything is written."""
    c = SimpleNamespace(**config)
    ckpt = None
    ckpt_path = os.path.join(c.out_dir, "ckpt.pt")
    if c.init_from == "resume":  # the saved config, with this command line
        ckpt = _user_input(read_checkpoint, ckpt_path)
        saved = ckpt.get("config", {})
        c = SimpleNamespace(**resume_config(config, given, saved, log))
        if c.device != "auto" and world_size == 1:  # the saved device
            dev = chosen_device(c.device)
    check_config(c, world_size)
    # saved resolved: a resume on another world size keeps the batch
    c.grad_accum = c.grad_accum or world_size
    _require(not c.cuda_graphs or dev.type == "cuda",
             f"cuda_graphs needs a CUDA device, got {dev}", ConfigError)
    ptdtype = torch.float32
    if c.dtype == "bfloat16" or c.dtype == "auto" and dev.type == "cuda":
        ptdtype = torch.bfloat16
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    data_dir = c.data_dir or os.path.join(_ROOT, "data", c.dataset)
    has_meta = os.path.isfile(os.path.join(data_dir, "meta.json"))
    if not has_meta and c.dataset == "shakespeare" and not c.data_dir:
        if rank == 0:  # the default data, made on first use
            log(f"{data_dir} is missing: running "
                f"`python data/prepare.py shakespeare`")
            prepare = os.path.join(_ROOT, "data", "prepare.py")
            subprocess.run([sys.executable, prepare, "shakespeare"],
                           check=True)
        if world_size > 1:
            torch.distributed.barrier()
    train_tokens, train_docs, meta = _user_input(load_dataset, data_dir,
                                                 "train")
    val_tokens, val_docs, _ = _user_input(load_dataset, data_dir, "val")
    vocab_size = meta["vocab_size"]
    for name, tokens in (("train", train_tokens), ("val", val_tokens)):
        _require(c.batching != "concat" or len(tokens) > c.context_length,
                 f"{name} split has {len(tokens)} tokens, fewer than "
                 f"context_length + 1 = {c.context_length + 1}: lower "
                 f"context_length or prepare more data", ConfigError)

    # the model: from scratch, with the checkpoint's model_args, or a Llama
    # directory's weights
    model_args = dict(vocab_size=vocab_size, context_length=c.context_length,
                      d_model=c.d_model, num_layers=c.num_layers,
                      num_heads=c.num_heads, d_ff=c.d_ff,
                      rope_theta=c.rope_theta,
                      tie_embeddings=c.tie_embeddings)
    # how much is recomputed is a run setting: never saved with model_args
    recompute = dict(act_ckpt_every=c.act_ckpt_every,
                     act_ckpt_layers=c.act_ckpt_layers,
                     selective_recompute=c.selective_recompute)
    if c.act_ckpt_layers < 0:  # all blocks
        recompute["act_ckpt_layers"] = None
    if ckpt is not None:
        model_args = {k: v for k, v in ckpt["model_args"].items()
                      if k not in recompute}
        _require(model_args["vocab_size"] == vocab_size,
                 f"checkpoint {ckpt_path} has vocab_size "
                 f"{model_args['vocab_size']} but dataset {data_dir} has "
                 f"{vocab_size}: resume on the data it was trained on",
                 ConfigError)
    llama_state = None
    if c.init_from not in ("scratch", "resume"):
        model_args, llama_state = _user_input(llama_init, c.init_from,
                                              vocab_size, c.context_length)
    claim_out_dir(c, rank == 0, log)  # every input judged: the run writes
    attn = c.attn_impl
    if attn == "auto":
        attn = auto_attn_impl(dev.type, packed=c.batching == "pack")
    torch.manual_seed(c.seed)
    model = TransformerLM(**model_args, **recompute, attn_impl=attn,
                          device=dev)
    if llama_state is not None:
        model.load_state_dict(llama_state)
    impl = c.ddp_impl if world_size > 1 else "none"
    flops_tok = flops_per_token(
        vocab_size, model_args["context_length"], model_args["d_model"],
        model_args["num_layers"], model_args["d_ff"], causal=True)
    peak = c.peak_flops or gpu_peak_flops(dev)  # MFU's denominator
    zero1 = " + zero1" if c.zero1 and world_size > 1 else ""
    log(f"model: {count_params(model) / 1e6:.2f}M parameters, "
        f"{flops_tok / 1e6:.1f} MFLOP/token (training, causal), "
        f"attn_impl={attn}, dtype={ptdtype}, device={dev}, "
        f"world_size={world_size}, ddp_impl={impl}{zero1}, "
        f"batching={c.batching}")

    # CUDA graphs: the whole step for concat batches, else one per
    # micro-step (torch.compile's mode reduce-overhead)
    graphs = None
    if c.cuda_graphs:
        graphs = "whole" if c.batching == "concat" else "micro"
    # document batches change shape every step: compiled for dynamic
    # shapes at once rather than on the second
    static = c.batching == "concat" or c.pack_static
    compile_kwargs = dict(dynamic=not static)
    if graphs == "micro":
        compile_kwargs["mode"] = "reduce-overhead"
    compute_dtype = None if ptdtype == torch.float32 else ptdtype
    w = ddp.wrap(model, impl, bucket_size_mb=c.bucket_size_mb,
                 compute_dtype=compute_dtype, compile=c.compile,
                 compile_kwargs=compile_kwargs)
    optimizer = make_optimizer(c, w, graphs)

    start_iter = 0
    loss_window = {"from": 0, "loss_sum": 0.0}
    if ckpt is not None:
        w.load_state_dict(_clean_state_dict(ckpt["model"]))
        w.load_optimizer_state_dict(optimizer, ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        if dev.type == "cuda" and "cuda" in ckpt["rng"]:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"], dev)
        start_iter = ckpt["iteration"]
        # the open log window (older checkpoints have none: it starts here)
        loss_window = ckpt.get("loss_window",
                               {"from": start_iter, "loss_sum": 0.0})
        log(f"resumed from {ckpt_path} at iteration {start_iter}")
    val_batches = validation_batches(val_tokens, val_docs, c, rank,
                                     world_size, dev, meta["eot_id"])

    log_path = os.path.join(c.out_dir, "log.jsonl")
    if rank == 0 and c.init_from == "resume":
        log_record(log_path, {"step": start_iter, "resumed_from": ckpt_path})
    elif rank == 0:
        open(log_path, "w").close()  # claim_out_dir cleared the way
        counts = np.bincount(np.asarray(train_tokens), minlength=vocab_size)
        p = counts[counts > 0] / counts.sum()
        entropy = -(p * np.log(p)).sum()
        log(f"data: {len(train_tokens):,} train / {len(val_tokens):,} val "
            f"tokens, vocab_size {vocab_size}; unigram entropy "
            f"{entropy:.3f} nats/token (the loss of a model that ignores "
            f"context)")
    if importlib.util.find_spec("matplotlib") is None:
        log("matplotlib is not installed: no loss.png is written "
            "(pip install matplotlib to get it)")
    tokenizer = {"vocab": os.path.join(data_dir, meta["vocab"]),
                 "special_tokens": list(meta["special_tokens"]),
                 "merges": os.path.join(data_dir, meta["merges"])}
    return SimpleNamespace(
        c=c, w=w, optimizer=optimizer, graphs=graphs, ptdtype=ptdtype,
        start_iter=start_iter, loss_window=loss_window, meta=meta,
        train_tokens=train_tokens, train_docs=train_docs,
        val_batches=val_batches, model_args=model_args,
        tokenizer=tokenizer, flops_tok=flops_tok, peak=peak,
        ckpt_path=ckpt_path, log_path=log_path, dev=dev)


def resume_config(config, given, saved, log):
    """The saved config under the keys this command line gives: a change
    is warned of, one of RESUME_FIXED refused."""
    this_run = ("init_from", "force", "out_dir")  # where and how it starts
    kept = {k: v for k, v in saved.items()
            if k in config and k not in this_run}
    merged = dict(config, **kept)
    merged.update({k: config[k] for k in given if k not in this_run})
    changed = [k for k in sorted(given - set(this_run))
               if k in saved and config[k] != saved[k]]
    refused = [f"{k}={config[k]!r} (saved {saved[k]!r})"
               for k in changed if k in RESUME_FIXED]
    _require(not refused, f"cannot resume exactly with "
             f"{', '.join(refused)}: drop these flags, or start a new run "
             f"in another out_dir", ConfigError)
    for key in changed:
        log(f"warning: resume changes {key} from {saved[key]!r} "
            f"to {config[key]!r}")
    return merged


def claim_out_dir(c, master, log):
    """A scratch run must not destroy a run in out_dir: refuse, or with
    force=True move it to a new out_dir/old/N."""
    def inside(name):
        return os.path.join(c.out_dir, name)

    old = [n for n in ("ckpt.pt", "log.jsonl") if os.path.exists(inside(n))]
    if c.init_from != "resume" and old:
        _require(c.force, f"{c.out_dir} already holds a run "
                 f"({', '.join(old)}): pass --init_from=resume to continue "
                 f"it, or --force=True to start over (that run is then "
                 f"moved to {c.out_dir}/old/N)", ConfigError)
        if master:
            numbers = [0]
            if os.path.isdir(inside("old")):
                numbers += [int(n) for n in os.listdir(inside("old"))
                            if n.isdigit()]
            keep = os.path.join(c.out_dir, "old", str(1 + max(numbers)))
            os.makedirs(keep)
            if os.path.exists(inside("loss.png")):
                old.append("loss.png")
            for name in old:
                os.replace(inside(name), os.path.join(keep, name))
            log(f"force: moved the run that was in {c.out_dir} to {keep}")
    os.makedirs(c.out_dir, exist_ok=True)


def _user_input(load, *args):
    """load(*args); a bad dataset or checkpoint is a ConfigError."""
    try:
        return load(*args)
    except (OSError, ValueError, RuntimeError) as e:
        raise ConfigError(e) from None


def gpu_peak_flops(dev):
    if dev.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(dev)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), 0.0)


def make_optimizer(c, w, graphs):
    """AdamW, or Muon for the blocks' matrices beside AdamW for the rest;
    weight decay on the matrices only."""
    def decay_groups(named):  # none on the RMSNorm gains (ln1, ln2, ...)
        decayed, gains = [], []
        for name, p in named:
            if any(part.startswith("ln") for part in name.split(".")):
                gains.append(p)
            else:
                decayed.append(p)
        return [{"params": decayed, "weight_decay": c.weight_decay},
                {"params": gains, "weight_decay": 0.0}]

    def muon_groups(named):  # Muon's group, then AdamW's
        named = list(named)
        hidden = {n for n, p in named
                  if n.startswith("layers.") and p.dim() == 2}
        muon = {"params": [p for n, p in named if n in hidden],
                "muon": True, "weight_decay": c.weight_decay}
        rest = decay_groups([(n, p) for n, p in named if n not in hidden])
        return [muon] + [dict(g, muon=False, lr=c.learning_rate)
                         for g in rest]

    adamw = dict(betas=(c.beta1, c.beta2), eps=c.eps,
                 capturable=graphs == "whole")
    if c.optimizer == "muon":  # a rank orthogonalizes its share: ZeRO-1
        return w.make_optimizer(Muon, muon_groups, zero1=not w.sharded,
                                lr=c.muon_lr, momentum=c.muon_momentum,
                                compiled=c.compile, **adamw)
    return w.make_optimizer(AdamW, decay_groups, zero1=c.zero1,
                            lr=c.learning_rate, **adamw)


def validation_batches(tokens, docs, c, rank, world_size, dev, pad_id):
    """The fixed validation batches, every world_size-th one here. Every
    rank runs as many (FSDP): the extras count 0 tokens."""
    per_rank = -(-c.eval_iters // world_size)
    batches = []
    for i in range(rank, per_rank * world_size, world_size):
        draw = batch_generator(c.seed, -1 - (i % c.eval_iters), 0)
        batch = make_batch(tokens, docs, c, draw, dev, pad_id)
        if i >= c.eval_iters:
            batch = batch[:4] + (0,)
        batches.append(batch)
    return batches


class StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM (a scheduler's warning) set a flag that
    each step asks for first, all-reduced (max) over a CPU gloo group under
    several processes: every rank stops at the same step."""

    def __init__(self, world_size):
        self.signum = 0
        self.previous = {}
        self.group = None
        if world_size > 1:
            self.group = torch.distributed.new_group(backend="gloo")

    def install(self):  # before this, Ctrl-C interrupts at once
        # Python runs signal handlers in the main thread only
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle)
                             for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, frame):
        if self.signum:  # a second one (torchrun forwards Ctrl-C too)
            return
        self.signum = signum
        print(f"received {signal.Signals(signum).name}: stopping after the "
              f"current step and saving a checkpoint", file=sys.stderr,
              flush=True)

    def requested(self):
        """The signal to stop for (the same on every rank), or 0."""
        if self.group is None:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int32)
        torch.distributed.all_reduce(flag, group=self.group,
                                     op=torch.distributed.ReduceOp.MAX)
        return int(flag)

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def launcher(world_size):  # the command that starts as many processes
    if world_size == 1:
        return "python"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # per node
    command = f"torchrun --nproc_per_node={local} "
    if local == world_size:
        return command + "--standalone"
    return (command + f"--nnodes={world_size // local} "
            "--rdzv_backend=c10d --rdzv_endpoint=HOST0:PORT")


def log_record(log_path, record):
    """Append a record to log.jsonl and redraw loss.png beside it (when
    matplotlib is installed)."""
    with open(log_path, "a") as f:
        f.write(json.dumps(record) + "\n")
    if "val_loss" not in record:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # setup said so once
        return
    with open(log_path) as f:
        records = [json.loads(line) for line in f]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style, label in (("loss", "-", "train"),
                              ("val_loss", "o-", "val (fixed batches)")):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            ax.plot(*zip(*points), style, label=label)
    ax.set(xlabel="step", ylabel="loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(os.path.dirname(log_path), "loss.png"), dpi=100)
    plt.close(fig)


# -----------------------------------------------------------------------------
# the training step, eager or as CUDA graphs

def make_step(w, optimizer, micro_step, max_norm, graphs=None):
    """step(batches) -> gradient norm: micro_step(j, batch) per micro-batch,
    sync, clip, optimizer step. graphs: None, 'micro' (one per micro-step,
    torch.compile's reduce-overhead) or 'whole' (whole_step_graph)."""
    if graphs == "micro":  # a None gradient would be a replay's output
        for p in w.parameters():
            p.grad = torch.zeros_like(p)

    def step(batches):
        for j, batch in enumerate(batches):
            if graphs == "micro":  # a replay's outputs live until the next
                torch.compiler.cudagraph_mark_step_begin()
            micro_step(j, batch)
        w.finish()
        norm = w.clip_grad_norm(max_norm)
        optimizer.step()
        return norm

    def eager(batches):
        norm = step(batches)
        optimizer.zero_grad(set_to_none=graphs is None)
        return norm

    buffers, replay = [], []

    def whole(batches):
        if not replay:
            for batch in batches:
                buffers.append([t.clone() if torch.is_tensor(t) else t
                                for t in batch])
            device = buffers[0][0].device
            replay.append(whole_step_graph(lambda: step(buffers), optimizer,
                                           device))
        for buffer, batch in zip(buffers, batches):
            for b, t in zip(buffer, batch):
                if torch.is_tensor(t):
                    b.copy_(t)
        return replay[0]()

    return whole if graphs == "whole" else eager


def whole_step_graph(step, optimizer, device, eager_steps=2):
    """step() (ending in a capturable optimizer's step) as one CUDA graph:
    eager_steps calls on a side stream (compiling, autotuning, making the
    optimizer state), then capture_step, then replays."""
    side, calls, replay = torch.cuda.Stream(device), [0], []

    def run():
        calls[0] += 1
        if calls[0] <= eager_steps:
            # after the work queued before, before the work queued after
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                out = step()
            torch.cuda.current_stream(device).wait_stream(side)
            optimizer.zero_grad(set_to_none=True)
            return out
        if not replay:
            replay.append(capture_step(step, optimizer))
        return replay[0]()
    return run


def capture_step(step, optimizer):
    """step() (its batch in tensors that stay in place; the optimizer
    capturable, stepped once) as a CUDA graph: replay() advances the
    optimizer on the host, replays, and returns step()'s outputs."""
    capturable = getattr(optimizer, "capturable", False) or all(
        g.get("capturable", False) for g in optimizer.param_groups)
    _require(capturable,
             "capture_step needs an optimizer made with capturable=True")
    advance = getattr(optimizer, "advance", lambda: None)
    optimizer.zero_grad(set_to_none=True)  # each replay's backward writes
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the eager steps' blocks: the graph has a pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()

    def replay():
        advance()
        graph.replay()
        return outputs
    return replay


# -----------------------------------------------------------------------------
# data

def load_dataset(data_dir, split):
    """(tokens: data_dir/{split}.bin as a read-only memmap, docs: its
    document offsets, meta.json), all checked."""
    _require(split in ("train", "val"),
             f"split must be 'train' or 'val', got {split!r}")
    make = prepare_command(data_dir)
    meta_path = os.path.join(data_dir, "meta.json")
    bin_path = os.path.join(data_dir, f"{split}.bin")
    docs_path = os.path.join(data_dir, f"{split}_docs.npy")
    for path in (meta_path, bin_path, docs_path):
        _require(os.path.isfile(path),
                 f"dataset file {path} is missing: {make}", FileNotFoundError)
    with open(meta_path) as f:
        meta = json.load(f)
    needed = ("dtype", "vocab_size", "eot_id", "special_tokens", "vocab",
              "merges", f"{split}_tokens", f"{split}_docs")
    missing = [k for k in needed if k not in meta]
    _require(not missing, f"{meta_path} lacks {missing}: {make}")
    np_dtype = np.dtype(meta["dtype"])
    nbytes = os.path.getsize(bin_path)
    _require(np_dtype in (np.uint16, np.uint32), f"{meta_path}: dtype "
             f"{meta['dtype']!r} is neither uint16 nor uint32")
    _require(nbytes % np_dtype.itemsize == 0, f"{bin_path} has {nbytes} "
             f"bytes, not a multiple of {np_dtype.itemsize} ({np_dtype}): "
             f"truncated or written with another dtype; {make}")
    n = nbytes // np_dtype.itemsize
    n_meta = meta[f"{split}_tokens"]
    _require(n == n_meta, f"{bin_path} holds {n} tokens but meta.json says "
             f"{n_meta}; {make}")
    _require(n > 0, f"{bin_path} is empty; {make}")
    tokens = np.memmap(bin_path, dtype=np_dtype, mode="r", shape=(n,))
    top = int(tokens.max())
    _require(top < meta["vocab_size"], f"{bin_path} contains token id "
             f"{top} >= vocab_size {meta['vocab_size']}; {make}")
    docs = np.load(docs_path)
    n_docs = meta[f"{split}_docs"]
    valid = (docs.ndim == 1 and docs.dtype == np.int64
             and len(docs) == n_docs + 1 and docs[0] == 0 and docs[-1] == n
             and np.all(np.diff(docs) > 0))
    _require(valid, f"{docs_path} is not a valid document index for {n} "
             f"tokens and {n_docs} documents (int64, from 0, strictly "
             f"increasing, to {n}); {make}")
    _require(np.all(tokens[docs[1:] - 1] == meta["eot_id"]),
             f"{bin_path}: not every document ends with eot_id "
             f"{meta['eot_id']}; {make}")
    return tokens, docs, meta


def prepare_command(data_dir):
    name = os.path.basename(os.path.normpath(data_dir))
    command = f"python data/prepare.py {name}"
    if name not in ("shakespeare", "tinystories", "owt"):
        command += " --input <files>"
    if os.path.abspath(data_dir) != os.path.join(_ROOT, "data", name):
        command += f" --out_dir {data_dir}"
    return f"run `{command}` to create it"


def _to_device(t, device):
    if torch.device(device).type == "cuda":  # pinned: an asynchronous copy
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def get_batch(dataset, batch_size, context_length, device, generator=None):
    """batch_size uniform random windows: int64 inputs and next-token
    targets (B, T) on device; only the windows are read from the memmap."""
    n = len(dataset)
    _require(n >= context_length + 1, f"dataset has {n} tokens, fewer "
             f"than context_length + 1 = {context_length + 1}")
    starts = torch.randint(0, n - context_length, (batch_size,),
                           generator=generator).tolist()
    rows = np.stack([np.asarray(dataset[s:s + context_length + 1],
                                dtype=np.int64) for s in starts])
    x = torch.from_numpy(np.ascontiguousarray(rows[:, :-1]))
    y = torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))
    return _to_device(x, device), _to_device(y, device)


def sample_documents(docs, token_budget, context_length, generator):
    """(start, end) of random document pieces holding token_budget targets
    or less than one piece more. Documents are cut into context_length
    pieces drawn uniformly (each token equally likely, as with concat);
    one-token pieces have no target and are skipped."""
    docs = np.asarray(docs, dtype=np.int64)
    _require(context_length >= 2,
             f"context_length must be >= 2, got {context_length}")
    lengths = np.diff(docs)
    _require(len(lengths) and lengths.max() >= 2,
             "no document has 2 or more tokens: nothing to predict")
    pieces = (lengths + context_length - 1) // context_length
    first_piece = np.concatenate([[0], np.cumsum(pieces)])
    draws = max(8, 2 * token_budget // context_length)
    drawn, spans = 0, []
    while drawn < token_budget:
        draw = torch.randint(0, int(first_piece[-1]), (draws,),
                             generator=generator).numpy()
        d = np.searchsorted(first_piece, draw, side="right") - 1
        starts = docs[d] + (draw - first_piece[d]) * context_length
        ends = np.minimum(starts + context_length, docs[d + 1])
        for s, e in zip(starts.tolist(), ends.tolist()):
            if e - s < 2:
                continue
            spans.append((s, e))
            drawn += e - s - 1
            if drawn >= token_budget:
                break
    return spans


def pad_batch(tokens, spans, length, pad_id):
    """One row per piece, right-padded to `length`: x (B, length) int64
    holds the piece (then pad_id), y its next tokens (then -100)."""
    x = np.full((len(spans), length), pad_id, dtype=np.int64)
    y = np.full((len(spans), length), -100, dtype=np.int64)
    for i, (s, e) in enumerate(spans):
        _require(e - s <= length, f"piece ({s}, {e}) of {e - s} tokens "
                 f"does not fit a row of length {length}")
        x[i, :e - s] = tokens[s:e]
        y[i, :e - s - 1] = tokens[s + 1:e]
    return torch.from_numpy(x), torch.from_numpy(y)


def pack_batch(tokens, spans):
    """All pieces in one row: x = concat(piece[:-1]), y = concat(piece[1:])
    (1, N) int64, int32 cu_seqlens (num_pieces + 1 offsets), max_seqlen."""
    pieces = [np.asarray(tokens[s:e], dtype=np.int64) for s, e in spans]
    _require(pieces and min(len(p) for p in pieces) >= 2, "pack_batch needs"
             " at least one piece, each of at least 2 tokens")
    seqlens = np.array([len(p) - 1 for p in pieces])
    x = torch.from_numpy(np.concatenate([p[:-1] for p in pieces]))[None]
    y = torch.from_numpy(np.concatenate([p[1:] for p in pieces]))[None]
    offsets = np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32)
    return x, y, torch.from_numpy(offsets), int(seqlens.max())


def pad_packed(x, y, cu_seqlens, length, pad_id):
    """A packed batch at a static shape with the same loss and gradients:
    padded to `length` (a document of its own), cu_seqlens to a power of
    two of entries (empty documents)."""
    n = x.shape[1]
    _require(n <= length, f"a packed batch of {n} tokens does not fit a "
             f"static length of {length}")
    if n < length:
        x = torch.cat([x, x.new_full((1, length - n), pad_id)], 1)
        y = torch.cat([y, y.new_full((1, length - n), -100)], 1)
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([length])])
    entries = 1 << (len(cu_seqlens) - 1).bit_length()  # a power of two
    repeats = cu_seqlens[-1:].expand(entries - len(cu_seqlens))
    return x, y, torch.cat([cu_seqlens, repeats])


def make_batch(tokens, docs, c, generator, device, pad_id):
    """One micro-batch of c.batching: (x, y, cu_seqlens, max_seqlen, real
    targets), cu_seqlens and max_seqlen None unless packed."""
    if c.batching == "concat":
        x, y = get_batch(tokens, c.batch_size, c.context_length, device,
                         generator)
        return x, y, None, None, c.batch_size * c.context_length
    spans = sample_documents(docs, c.batch_size * c.context_length,
                             c.context_length, generator)
    n_real = sum(e - s - 1 for s, e in spans)
    cu_seqlens = max_seqlen = None
    if c.batching == "pack":
        x, y, cu_seqlens, max_seqlen = pack_batch(tokens, spans)
        if c.pack_static:  # the budget plus one piece holds the pieces
            static_length = (c.batch_size + 1) * c.context_length
            x, y, cu_seqlens = pad_packed(x, y, cu_seqlens, static_length,
                                          pad_id)
            max_seqlen = c.context_length
        cu_seqlens = _to_device(cu_seqlens, device)
    else:
        length = c.context_length
        if c.batching != "pad":  # dynamic_pad: the longest piece
            length = max(e - s for s, e in spans)
        x, y = pad_batch(tokens, spans, length, pad_id)
    x, y = _to_device(x, device), _to_device(y, device)
    return x, y, cu_seqlens, max_seqlen, n_real


def batch_generator(seed, iteration, micro):
    """The data RNG of one micro-batch, a function of (seed, iteration
    (negative: validation), global micro-batch) only: a resume draws the
    same batches, and N ranks those of one process accumulating N-fold."""
    key = (seed * 1_000_003 + iteration) * 1_000_003 + micro
    return torch.Generator().manual_seed(key & (2 ** 63 - 1))


# -----------------------------------------------------------------------------
# checkpoints

def _clean_state_dict(state_dict):  # without torch.compile's prefix
    return {k.replace("_orig_mod.", ""): v for k, v in state_dict.items()}


def save_checkpoint(model, optimizer, iteration, out, **extra):
    """torch.save {"model", "optimizer", "iteration", **extra} to a file
    object, or to a path through a temp file checked and then renamed.
    model: a module or a state dict; optimizer: one, a state dict or None."""
    if not isinstance(model, dict):
        model = unwrap(model).state_dict()
    if hasattr(optimizer, "state_dict"):
        optimizer = optimizer.state_dict()
    ckpt = {"model": _clean_state_dict(model), "optimizer": optimizer,
            "iteration": int(iteration), **extra}
    if not isinstance(out, (str, os.PathLike)):
        return torch.save(ckpt, out)
    tmp = os.fspath(out) + ".tmp"
    torch.save(ckpt, tmp)
    if crc_failure(tmp):  # damaged on its way: the old checkpoint stays
        os.remove(tmp)
        raise RuntimeError(f"checkpoint {tmp} was damaged on its way to the "
                           f"disk; {out} is left as it was")
    os.replace(tmp, out)


def load_checkpoint(src, model, optimizer):
    """Load a save_checkpoint file into model (and optimizer, unless None);
    returns the iteration."""
    ckpt = read_checkpoint(src)
    unwrap(model).load_state_dict(_clean_state_dict(ckpt["model"]))
    if optimizer is not None:
        _require(ckpt.get("optimizer") is not None,
                 f"checkpoint {src} holds no optimizer state", RuntimeError)
        optimizer.load_state_dict(ckpt["optimizer"])
    return ckpt["iteration"]


# -----------------------------------------------------------------------------
# the command line

# nanoGPT's keys (and our old ones) that ours differ from: the error for one
# names our key, or says why there is none
NANOGPT = dict(
    block_size="context_length", n_layer="num_layers", n_head="num_heads",
    n_embd="d_model", ckpt_interval="save_interval",
    gradient_accumulation_steps="grad_accum",
    always_save_checkpoint="save_interval",
    vocab_size="the dataset sets the vocabulary: "
               "`python data/prepare.py NAME --vocab_size N`",
    dropout="this model has no dropout", bias="this model has no biases",
    eval_only="no eval-only mode",
    decay_lr="the cosine schedule is always on "
             "(min_lr=learning_rate keeps the rate constant)",
    backend="NCCL on CUDA, gloo on CPU",
    **dict.fromkeys(("wandb_log", "wandb_project", "wandb_run_name"),
                    "no wandb: see out_dir/log.jsonl"))


class ConfigError(ValueError):
    """A bad config key or value, dataset, checkpoint or device, or a run in
    the way: cli() prints one line."""


def _require(ok, message, error=ValueError):
    if not ok:
        raise error(message)


def default_config():
    return {k: globals()[k] for k in config_keys}


def apply_config(argv, config, given=None):
    """nanoGPT's configurator: config files (run with the values so far)
    and --key=value / --key value (ast.literal_eval; strings verbatim), in
    order, into `config`; the keys set into `given`. An unknown key or a
    value of another type than the default's raises ConfigError."""
    def checked(key, value, source):
        if key not in config:
            raise unknown_key(key, source, config)
        default = config[key]
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if isinstance(default, float) and is_int:
            value = float(value)
        _require(type(value) is type(default), f"config key {key!r} "
                 f"expects {type(default).__name__}, got {value!r} "
                 f"({type(value).__name__}) from {source}", ConfigError)
        if given is not None:
            given.add(key)
        return value

    args = list(argv)
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            _require(os.path.isfile(arg), f"config file {arg!r} not found",
                     ConfigError)
            # __file__: a config file can build on a sibling
            scope = dict(config, __file__=os.path.abspath(arg))
            run_config_file(arg, scope)
            for key, value in scope.items():
                is_module = type(value).__name__ == "module"
                if key.startswith("_") or is_module or callable(value):
                    continue
                if key not in config or value is not config[key]:
                    config[key] = checked(key, value, arg)
            continue
        key, eq, text = arg[2:].partition("=")
        if key not in config:  # a bare --forse: the unknown key's error
            checked(key, text, arg)
        takes_next = not eq
        if takes_next and isinstance(config[key], bool):
            text = "True"  # a bare flag, unless True or False follows
            takes_next = bool(args) and args[0].lower() in ("true", "false")
        source = arg
        if takes_next:
            _require(args, f"{arg} needs a value: {arg}=VALUE or {arg} VALUE",
                     ConfigError)
            text = args.pop(0)
            source = f"{arg} {text}"
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        if isinstance(config[key], str):
            value = text
        config[key] = checked(key, value, source)
    return config


def unknown_key(key, source, config):
    close = difflib.get_close_matches(key, config, n=1)
    hint = NANOGPT.get(key) or next(iter(close), "")
    message = f"unknown config key {key!r} (from {source})"
    if hint in config:
        message += f"; did you mean {hint!r}?"
    elif hint:
        message += f"; {hint}"
    return ConfigError(message)


def run_config_file(path, scope):
    """Run a config file; an error in it is a ConfigError naming the line."""
    with open(path) as f:
        source = f.read()
    try:  # (the config global `compile` shadows the builtin)
        exec(builtins.compile(source, path, "exec"), scope)
    except SyntaxError as e:
        message = f"config file {path}, line {e.lineno}: {e.msg}"
        raise ConfigError(message) from None
    except Exception as e:
        trace = traceback.extract_tb(e.__traceback__)
        frames = [f for f in trace if f.filename == path]
        where = f", line {frames[-1].lineno}" if frames else ""
        raise ConfigError(f"config file {path}{where}: "
                          f"{type(e).__name__}: {e}") from None


def check_config(c, world_size):
    """Values apply_config cannot judge alone; raises ConfigError naming
    the key."""
    def need(ok, message):
        _require(ok, message, ConfigError)

    llama_dir = os.path.isfile(os.path.join(c.init_from, "config.json"))
    need(c.init_from in ("scratch", "resume") or llama_dir,
         f"init_from must be 'scratch', 'resume' or a Llama-format "
         f"checkpoint directory (config.json + model.safetensors, as "
         f"hf.save_llama writes), got {c.init_from!r}")
    need(c.batching in BATCHING,
         f"batching must be one of {BATCHING}, got {c.batching!r}")
    need(c.ddp_impl in DDP_IMPLS,
         f"ddp_impl must be one of {DDP_IMPLS}, got {c.ddp_impl!r}")
    need(not (c.zero1 and c.ddp_impl in ("fsdp", "torch_fsdp")),
         f"zero1 shards optimizer state on top of replicated DDP; "
         f"ddp_impl={c.ddp_impl!r} shards it already")
    need(c.grad_accum >= 0 and c.grad_accum % world_size == 0,
         f"grad_accum={c.grad_accum} must be a multiple of the world size "
         f"{world_size} (micro-batches are split across ranks), or 0 for "
         f"one per rank")
    for key in ("batch_size", "context_length", "max_iters", "eval_iters",
                "log_interval", "eval_interval", "save_interval"):
        value = getattr(c, key)
        need(value >= 1, f"{key} must be >= 1, got {value}")
    need(c.d_model % c.num_heads == 0, f"d_model={c.d_model} is not "
         f"divisible by num_heads={c.num_heads}")
    layers_ok = -1 <= c.act_ckpt_layers <= c.num_layers
    need(c.act_ckpt_every >= 0 and layers_ok,
         f"act_ckpt_every must be >= 0 and act_ckpt_layers in [-1, "
         f"num_layers={c.num_layers}], got {c.act_ckpt_every} and "
         f"{c.act_ckpt_layers}")
    need(not c.pack_static or c.batching == "pack", f"pack_static applies "
         f"to batching='pack', got batching={c.batching!r}")
    static = c.batching == "concat" or c.pack_static
    need(not c.cuda_graphs or (c.compile and static and world_size == 1),
         f"cuda_graphs needs compile=True, static shapes (concat, or pack "
         f"with pack_static=True) and one process, got compile={c.compile}, "
         f"batching={c.batching!r}, pack_static={c.pack_static}, world size "
         f"{world_size}")
    need(c.dtype in ("auto", "float32", "bfloat16"), f"dtype must be "
         f"'auto', 'float32' or 'bfloat16' (no loss scaling for float16), "
         f"got {c.dtype!r}")
    need(c.optimizer in OPTIMIZERS,
         f"optimizer must be one of {OPTIMIZERS}, got {c.optimizer!r}")
    need(0 <= c.muon_momentum < 1,
         f"muon_momentum must lie in [0, 1), got {c.muon_momentum}")
    need(c.muon_lr >= 0, f"muon_lr must be >= 0, got {c.muon_lr}")
    need(c.optimizer != "muon" or c.learning_rate > 0,
         f"optimizer='muon' scales muon_lr by the schedule's lr / "
         f"learning_rate: learning_rate must be > 0, got {c.learning_rate}")


def help_keys():
    """--help's table: each config key, its default and its comment."""
    with open(os.path.abspath(__file__), encoding="utf-8") as f:
        comments = dict(re.findall(r"^(\w+) = .+?  # (.+)$", f.read(), re.M))
    rows = [(f"--{key}={value!r}", comments.get(key, ""))
            for key, value in default_config().items()]
    width = max(len(flag) for flag, _ in rows)
    header = ("config keys (--key=value or --key value; a bool alone, "
              "--force, means True):")
    lines = [f"  {flag:<{width}}  {comment}" for flag, comment in rows]
    return "\n".join([header] + lines)


def main(argv, check_only=False):
    """train.py with these arguments; returns the exit status or raises
    ConfigError. check_only (before torch is imported): judge them as far
    as can be without data and checkpoint, and return None."""
    if "-h" in argv or "--help" in argv:
        print(f"{__doc__}\n{help_keys()}")
        return 0
    given = set()
    config = apply_config(argv, default_config(), given)
    if config["init_from"] != "resume":  # a resume judges the saved config
        world_size = 1
        if "RANK" in os.environ:  # torchrun's, as init_distributed reads it
            world_size = int(os.environ.get("WORLD_SIZE", 1))
        check_config(SimpleNamespace(**config), world_size)
    if check_only:
        return None
    rank, _, world_size, dev = ddp.init_distributed()
    # held until the group is gone: torchrun signals a node's ranks one
    # after another
    stops = StopSignals(world_size)
    try:
        if config["device"] != "auto" and world_size == 1:
            dev = chosen_device(config["device"])
        status = train(config, given, rank, world_size, dev, stops)
        ddp.cleanup_distributed()
        return status
    except BaseException:  # no barrier: the other ranks may never reach it
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        raise
    finally:
        stops.restore()


def chosen_device(name):
    dev = _user_input(torch.device, name)
    n = torch.cuda.device_count()
    if dev.type == "cuda" and (dev.index or 0) >= n:
        why = "CUDA is not available on this machine"
        if n:
            why = f"this machine has {n} CUDA devices"
        raise ConfigError(f"--device={name}: {why}")
    return dev


def cli(argv, check_only=False):
    """main(), its ConfigError one line on stderr and status 2 (argparse's
    convention), a Ctrl-C before the loop one line and status 130; printed
    by the first process of each node."""
    try:
        return main(argv, check_only)
    except ConfigError as e:
        status, message = 2, f"train.py: error: {e}"
    except KeyboardInterrupt:
        status, message = 130, ("train.py: interrupted before training "
                                 "started; nothing was saved")
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(message, file=sys.stderr)
    return status


if __name__ == "__main__":
    status = cli(sys.argv[1:], check_only=True)
    if status is not None:  # --help or a bad command line
        sys.exit(status)  # answered before the heavy imports below

import numpy as np
import torch

import ddp
from flash import adamw_step
from hf import llama_init
from model import (TransformerLM, auto_attn_impl, count_params, crc_failure,
                   flops_per_token, read_checkpoint, unwrap)


# -----------------------------------------------------------------------------
# AdamW (its fused step: flash.adamw_step), Muon, schedule and clipping

def _capturing():  # inside a CUDA graph's capture
    return (torch.cuda.is_available()
            and torch.cuda.is_current_stream_capturing())


class AdamW(torch.optim.Optimizer):
    """AdamW with decoupled weight decay, t counted per parameter:
        m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
        p <- p - a_t m / (sqrt(v) + eps);  p <- p (1 - lr wd)
    with a_t = lr sqrt(1 - b2^t) / (1 - b1^t); m and v in fp32 (fp64 for
    fp64 parameters), bf16 parameters updated in fp32 and rounded once.
    fused: the kernel (None: on CUDA only), else torch._foreach_* ops.
    capturable=True: step() can be captured in a CUDA graph (advance())."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.01, fused=None, capturable=False):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"AdamW: lr, eps and weight_decay must be >= 0 "
                             f"(got {lr}, {eps}, {weight_decay})")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamW: betas must lie in [0, 1) (got {betas})")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.fused = fused
        self.capturable = capturable
        self._tables = {}  # bucket -> adamw_step's cache (chunk table, ...)
        self._scalars = {}  # bucket -> (neg_step, decay) on the device
        self._captured = set()  # the buckets a captured step() launches for

    def _use_kernel(self, p):
        if self.fused is False or p.dtype == torch.float64:
            return False
        dense = p.is_contiguous() and p.grad.is_contiguous()
        if self.fused and not dense:
            raise ValueError("AdamW(fused=True) needs contiguous parameters "
                             "and gradients")
        return dense and (p.is_cuda or self.fused)

    def _adamw_groups(self):  # (index, group) of the groups AdamW steps
        return list(enumerate(self.param_groups))

    def _buckets(self, count):
        """{(group, fused, device, dtype, grad dtype): (t, params, grads,
        exp_avgs, exp_avg_sqs)} over the parameters with a gradient, their
        state made first; count: add this step to every t. A parameter at
        another t than its bucket's gets a bucket of its own (eager)."""
        buckets = {}
        for gi, group in self._adamw_groups():
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse "
                                       "gradients")
                state = self.state[p]
                if not state:
                    if not count:
                        raise RuntimeError(
                            "AdamW: capturing step() needs the optimizer "
                            "state first; take one eager step before the "
                            "capture")
                    dtype = torch.promote_types(p.dtype, torch.float32)
                    state.update(step=0,
                                 exp_avg=torch.zeros_like(p, dtype=dtype),
                                 exp_avg_sq=torch.zeros_like(p, dtype=dtype))
                state["step"] += count
                t = state["step"]
                key = (gi, self._use_kernel(p), p.device, p.dtype,
                       p.grad.dtype)
                if key in buckets and buckets[key][0] != t:
                    if self.capturable:
                        raise RuntimeError(
                            f"AdamW(capturable=True): parameters of group "
                            f"{gi} are at different step counts "
                            f"({buckets[key][0]} and {t}); one kernel "
                            f"launch reads one step size")
                    key = (*key, t)
                bucket = buckets.setdefault(key, (t, [], [], [], []))
                tensors = (p, p.grad, state["exp_avg"], state["exp_avg_sq"])
                for column, tensor in zip(bucket[1:], tensors):
                    column.append(tensor)
        return buckets

    @staticmethod
    def _step_size(group, t):
        """(-α_t, α·λ) of a group at step t."""
        lr, (beta1, beta2) = group["lr"], group["betas"]
        neg_step = -lr * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
        return neg_step, lr * group["weight_decay"]

    def _write_scalars(self, key, neg_step, lr_wd):
        """A bucket's (neg_step, decay) into its device tensor, by a pinned
        copy the host need not wait for; returns the tensor."""
        scalars = self._scalars.get(key)
        if scalars is None:
            scalars = torch.empty(2, dtype=torch.float32, device=key[2])
            self._scalars[key] = scalars
        host = torch.tensor([neg_step, 1 - lr_wd], dtype=torch.float32)
        if scalars.is_cuda:
            host = host.pin_memory()
        scalars.copy_(host, non_blocking=True)
        return scalars

    def _device_scalars(self, key, capturing, neg_step, lr_wd, who):
        """The tensor a captured launch reads its step size and decay
        from: written by eager steps, taken as it is by the capture."""
        if not capturing:
            return self._write_scalars(key, neg_step, lr_wd)
        if key not in self._scalars:
            raise RuntimeError(f"{who}: capturing step() needs one eager "
                               f"step with capturable=True first")
        self._captured.add(key)
        return self._scalars[key]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        capturing = _capturing()
        if capturing and not self.capturable:
            raise RuntimeError("AdamW.step() is being captured in a CUDA "
                               "graph: make the optimizer with "
                               "capturable=True (its step size then comes "
                               "from the device)")
        buckets = self._buckets(count=0 if capturing else 1)
        for key, (t, *columns) in buckets.items():
            group = self.param_groups[key[0]]
            fused = key[1]
            beta1, beta2 = group["betas"]
            eps = group["eps"]
            neg_step, lr_wd = self._step_size(group, t)
            if not fused:
                if capturing:
                    raise RuntimeError(
                        f"AdamW(capturable=True) captures the fused kernel "
                        f"only; group {key[0]} has {key[3]} parameters on "
                        f"{key[2]} that take the foreach path")
                self._foreach_step(*columns, neg_step, beta1, beta2, eps,
                                   lr_wd)
                continue
            scalars = None
            if self.capturable:
                scalars = self._device_scalars(key, capturing, neg_step,
                                               lr_wd, "AdamW")
            cache = self._tables.setdefault(key, {})  # kept between steps
            adamw_step(cache, *columns, neg_step, beta1, beta2, eps,
                       1 - lr_wd, scalars=scalars)
        return loss

    @torch.no_grad()
    def advance(self):
        """The host's part of a captured step(), before each replay: every
        t + 1, and each bucket's step size and decay (the groups' lr now)
        written where the captured kernels read them."""
        if not self._captured:
            raise RuntimeError("AdamW.advance() is the host's part of a "
                               "replayed step: capture step() first, with "
                               "capturable=True")
        for key, (t, *_) in self._buckets(count=1).items():
            if key not in self._captured:
                raise RuntimeError(f"AdamW.advance(): the captured step() "
                                   f"does not step group {key[0]}'s "
                                   f"{key[3]} parameters on {key[2]}")
            group = self.param_groups[key[0]]
            self._write_scalars(key, *self._step_size(group, t))

    @staticmethod
    def _foreach_step(params, grads, exp_avgs, exp_avg_sqs, neg_step, beta1,
                      beta2, eps, lr_wd):
        work = params  # fp32 copies of bf16 parameters, rounded once
        if params[0].dtype != exp_avgs[0].dtype:
            work = [p.float() for p in params]
        if grads[0].dtype != exp_avgs[0].dtype:
            grads = [g.to(exp_avgs[0].dtype) for g in grads]
        # m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        # θ ← θ − α_t·m/(sqrt(v)+ε);  θ ← θ − α·λ·θ
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(work, exp_avgs, denom, neg_step)
        if lr_wd != 0:
            torch._foreach_mul_(work, 1 - lr_wd)
        if work is not params:
            torch._foreach_copy_(params, work)


NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)  # p(s) = a s + b s^3 + c s^5


def newton_schulz(G, steps=5, eps=1e-7):
    """About U V^T of G = U S V^T, for a matrix or a stack of them:
    X <- a X + b (X X^T) X + c (X X^T)^2 X, from X = G / ||G||_F.
    A step maps each singular value s to p(s); the coefficients trade
    exactness for a steep slope at 0: they end in a band around 1, not
    at 1. A tall G is iterated transposed (the smaller Gram matrix)."""
    a, b, c = NEWTON_SCHULZ
    X = G / (G.norm(dim=(-2, -1), keepdim=True) + eps)
    tall = G.size(-2) > G.size(-1)
    if tall:  # contiguous: baddbmm on a view rounds by thread count
        X = X.mT.contiguous()
    # beta C + alpha A B in one GEMM: no pass over X to add a X
    gemm = torch.baddbmm if X.dim() == 3 else torch.addmm
    for _ in range(steps):
        A = X @ X.mT
        B = gemm(A, A, A, beta=b, alpha=c)  # b A + c A A
        X = gemm(X, B, X, beta=a)           # a X + B X
    if tall:
        X = X.mT
    return X


def orthogonalize_stack(directions, scale):
    """newton_schulz of same-shape matrices as one stack, in bf16 on
    CUDA, else in fp32 (fp64 stays); each result times scale."""
    stack = torch.stack(directions)
    if stack.is_cuda:
        work = stack.bfloat16()
    else:
        work = stack.to(torch.promote_types(stack.dtype, torch.float32))
    return (newton_schulz(work).to(stack.dtype) * scale).unbind()


def orthogonalize(directions, by_stack=orthogonalize_stack):
    """Muon's update of each whole 2-D direction: newton_schulz(d) times
    sqrt(max(1, rows / cols)); same-shape matrices go through by_stack
    as one stack. The scale is modded-nanogpt's (its rates assume it):
    dW moves an output's RMS by up to sqrt(cols / rows) |dW|_2 per unit
    of input RMS."""
    by_shape = {}
    for i, d in enumerate(directions):
        by_shape.setdefault(tuple(d.shape), []).append(i)
    updates = [None] * len(directions)
    for (rows, cols), index in by_shape.items():
        scale = max(1.0, rows / cols) ** 0.5
        out = by_stack([directions[i] for i in index], scale)
        for i, update in zip(index, out):
            updates[i] = update
    return updates


def nesterov(buffers, grads, mu):
    """b <- mu b + g in place; returns g + mu b, the direction."""
    torch._foreach_mul_(buffers, mu)
    torch._foreach_add_(buffers, grads)
    return torch._foreach_add(grads, buffers, alpha=mu)


def apply_updates(params, updates, neg_lr, decay):
    """p <- (p - lr u)(1 - lr wd) in the updates' dtype, in place."""
    work = [p.to(updates[0].dtype) for p in params]  # bf16: rounded once
    torch._foreach_mul_(updates, neg_lr)
    torch._foreach_add_(work, updates)
    torch._foreach_mul_(work, decay)
    for p, w in zip(params, work):
        if w is not p:
            p.copy_(w)


class Muon(AdamW):
    """Muon on the groups marked muon=True (the default; 2-D weights),
    AdamW on those marked False: one optimizer for checkpoints, ZeRO-1,
    the schedule and CUDA graphs. Per matrix, with momentum mu:
        b <- mu b + g;  d = g + mu b                      (Nesterov)
        p <- p - lr orthogonalize(d);  p <- p (1 - lr wd)
    b in fp32 (fp64 for fp64 parameters). Matrices sharded by rows (FSDP)
    go through ddp.orthogonalize_rows. compiled=True: the momentum, each
    stack's Newton-Schulz and the update compiled (fewer passes over the
    weights; step sizes from a device tensor); capturable=True: as
    AdamW's."""

    def __init__(self, params, lr=0.02, momentum=0.95, betas=(0.9, 0.95),
                 eps=1e-8, weight_decay=0.0, fused=None, capturable=False,
                 compiled=False):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon: momentum must lie in [0, 1) "
                             f"(got {momentum})")
        self._muon_defaults = dict(muon=True, momentum=momentum)
        super().__init__(params, lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay, fused=fused,
                         capturable=capturable)
        self.defaults.update(self._muon_defaults)
        self.compiled = compiled
        self.nesterov = nesterov
        self.by_stack = orthogonalize_stack
        self.apply_updates = apply_updates
        if compiled:
            self.nesterov = torch.compile(nesterov, dynamic=False)
            self.by_stack = torch.compile(orthogonalize_stack, dynamic=False)
            self.apply_updates = torch.compile(apply_updates, dynamic=False)

    def add_param_group(self, param_group):
        for key, value in self._muon_defaults.items():
            param_group.setdefault(key, value)
        flat = [p for p in param_group["params"] if p.dim() != 2]
        if param_group["muon"] and flat:
            raise ValueError(f"Muon orthogonalizes 2-D weights; a group "
                             f"with muon=True holds shape "
                             f"{tuple(flat[0].shape)}: mark it muon=False "
                             f"(AdamW)")
        super().add_param_group(param_group)

    def _adamw_groups(self):
        return [(i, g) for i, g in enumerate(self.param_groups)
                if not g["muon"]]

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)  # AdamW's groups
        capturing = _capturing()
        for gi, group in enumerate(self.param_groups):
            if group["muon"]:
                self._muon_step(gi, group, capturing)
        return loss

    def _momentum(self, params, capturing):
        buffers = []
        for p in params:
            state = self.state[p]
            if not state and capturing:
                raise RuntimeError("Muon: capturing step() needs the "
                                   "momentum first; take one eager step "
                                   "before the capture")
            if not state:
                dtype = torch.promote_types(p.dtype, torch.float32)
                state["momentum_buffer"] = torch.zeros_like(p, dtype=dtype)
            buffers.append(state["momentum_buffer"])
        return buffers

    def _muon_step(self, gi, group, capturing):
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        buffers = self._momentum(params, capturing)
        grads = [p.grad.to(buffers[0].dtype) for p in params]
        directions = self.nesterov(buffers, grads, group["momentum"])
        if any(ddp.row_sharded(p) for p in params):
            updates = ddp.orthogonalize_rows(params, directions,
                                             self._orthogonalize)
        else:
            updates = self._orthogonalize(directions)
        neg_lr = -group["lr"]
        decay = 1 - group["lr"] * group["weight_decay"]
        if self.capturable or self.compiled:  # read from the device
            key = (gi, "muon", params[0].device)
            scalars = self._device_scalars(
                key, capturing, *self._muon_step_size(group), "Muon")
            neg_lr, decay = scalars[0], scalars[1]
        self.apply_updates(params, updates, neg_lr, decay)

    def _orthogonalize(self, directions):
        return orthogonalize(directions, self.by_stack)

    @staticmethod
    def _muon_step_size(group):  # (-lr, lr wd), as AdamW's _step_size
        return -group["lr"], group["lr"] * group["weight_decay"]

    @torch.no_grad()
    def advance(self):
        super().advance()
        for key in self._captured:
            if key[1] == "muon":
                group = self.param_groups[key[0]]
                self._write_scalars(key, *self._muon_step_size(group))


def get_lr_cosine_schedule(it, max_learning_rate, min_learning_rate,
                           warmup_iters, cosine_cycle_iters):
    """Linear warm-up to max over warmup_iters, cosine down to min at
    cosine_cycle_iters, then min."""
    if it < warmup_iters:
        return it / warmup_iters * max_learning_rate
    if it <= cosine_cycle_iters:
        progress = ((it - warmup_iters)
                    / max(1, cosine_cycle_iters - warmup_iters))
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        span = max_learning_rate - min_learning_rate
        return min_learning_rate + cosine * span
    return min_learning_rate


def clip_grad_norm(parameters, max_l2_norm):
    """Scale all gradients to a global L2 norm of at most max_l2_norm;
    returns the norm before (ddp.clip_grad_norm)."""
    return ddp.clip_grad_norm(list(parameters), max_l2_norm)


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
