"""
Train a TransformerLM on a tokenized dataset (SPEC §3). Example commands:

    python train.py                                    # CPU default: Shakespeare, vocab 2048, a few minutes on 2 cores
    python train.py --max_iters=200 --batch_size=8     # any config global can be overridden with --key=value
    python train.py config/pack.py                     # a config file of overrides (then --key=value on top)
    python train.py --init_from=resume                 # continue exactly from out_dir/ckpt.pt
    torchrun --standalone --nproc_per_node=4 train.py config/small.py                 # 4 GPUs, our bucketed DDP
    torchrun --standalone --nproc_per_node=4 train.py config/small.py --ddp_impl=torch --zero1=False

The data directory comes from `python data/prepare.py NAME` (run automatically for the default `shakespeare`).
Everything below the config block is importable without side effects: AdamW, get_lr_cosine_schedule,
clip_grad_norm, get_batch, load_dataset, sample_documents / pad_batch / pack_batch, save_checkpoint /
load_checkpoint. The run itself sits in main(), called under `if __name__ == "__main__"`.
"""
import ast
import builtins
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch

import ddp
import flash
from model import TransformerLM, count_params, cross_entropy, flops_per_token


# -----------------------------------------------------------------------------------------------------------------
# config: plain globals, overridden by a config file and then --key=value (apply_config). Defaults = a CPU run.
# I/O
out_dir = "out"                 # checkpoints (ckpt.pt), log.jsonl and loss.png
init_from = "scratch"           # 'scratch' or 'resume' (from out_dir/ckpt.pt, continuing exactly)
log_interval = 10               # optimizer steps between log lines
eval_interval = 100             # steps between validation-loss evaluations (and at the last step)
eval_iters = 10                 # number of FIXED validation batches per evaluation
ckpt_interval = 200             # steps between checkpoints (and always one at the end)
seed = 1337                     # model init and every data draw derive from it
# data
dataset = "shakespeare"         # name under data/ (made by `python data/prepare.py NAME`)
data_dir = ""                   # '' = data/<dataset> next to this file
batching = "concat"             # 'concat' | 'pad' | 'dynamic_pad' | 'pack' (SPEC §5.7; README says when to use which)
batch_size = 16                 # sequences per micro-batch; doc strategies use batch_size*context_length real tokens
context_length = 128            # tokens per sequence (RoPE table size)
grad_accum = 1                  # micro-batches per optimizer step, split across ranks (must divide by world size)
# model (SPEC §2; config/*.py hold the §2.10 presets)
d_model = 256                   # residual width
num_layers = 4                  # transformer blocks
num_heads = 8                   # attention heads (d_model / num_heads = head dim)
d_ff = 704                      # SwiGLU hidden width (about 8/3 d_model, a multiple of 64)
rope_theta = 10000.0            # RoPE base
tie_embeddings = False          # share token_embeddings and lm_head
attn_impl = "auto"              # 'auto' (flash on CUDA, naive on CPU) | 'flash' | 'flash_ref' | 'sdpa' | 'naive'
act_ckpt_every = 0              # activation checkpointing every k blocks (0 = off, SPEC §3.9)
# optimizer (SPEC §3.1-3.3, starting points of §3.11)
learning_rate = 3e-3            # peak learning rate
min_lr = 3e-4                   # floor of the cosine schedule
warmup_iters = 20               # linear warm-up steps
max_iters = 400                 # optimizer steps in total
lr_decay_iters = 0              # last step of the cosine phase (0 = max_iters)
weight_decay = 0.1              # decoupled decay of matrices (RMSNorm gains are not decayed)
beta1 = 0.9
beta2 = 0.95
eps = 1e-8
grad_clip = 1.0                 # global-norm clip (0 = off; the norm is still logged)
# system
device = "auto"                 # 'auto' (cuda if available), 'cpu', 'cuda', 'cuda:1', ...
dtype = "auto"                  # 'auto' (bfloat16 on CUDA, float32 on CPU) | 'float32' | 'bfloat16' (autocast)
compile = False                 # torch.compile the model
ddp_impl = "bucketed"           # torchrun: 'bucketed'|'naive'|'flat'|'overlap'|'fsdp'|'torch'|'torch_fsdp'
zero1 = False                   # shard AdamW state across ranks (ddp.ShardedOptimizer; not with fsdp)
bucket_size_mb = 25.0           # bucket size of ddp_impl='bucketed'
peak_flops = 0.0                # per-GPU peak FLOP/s for MFU (0 = 989e12 on H100/H200, else MFU is not reported)
# -----------------------------------------------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))]

BATCHING = ("concat", "pad", "dynamic_pad", "pack")
DDP_IMPLS = ("bucketed", "naive", "flat", "overlap", "fsdp", "torch", "torch_fsdp")


def default_config():
    return {k: globals()[k] for k in config_keys}


def apply_config(argv, config):
    """Apply config files (paths) and --key=value overrides, in order, to the dict `config` (nanoGPT's
    configurator, as a function). A file is executed with the current values in scope; new names it defines are
    unknown keys. Values are parsed with ast.literal_eval (else kept as strings). Unknown keys and values whose type
    differs from the default (int is accepted for float) raise ValueError naming the key."""
    def checked(key, value, source):
        if key not in config:
            raise ValueError(f"unknown config key {key!r} (from {source})")
        default = config[key]
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not type(default):
            raise ValueError(f"config key {key!r} expects {type(default).__name__}, got {value!r} "
                             f"({type(value).__name__}) from {source}")
        return value

    for arg in argv:
        if arg.startswith("--"):
            if "=" not in arg:
                raise ValueError(f"override {arg!r} must look like --key=value")
            key, text = arg[2:].split("=", 1)
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text
            if key in config and isinstance(config[key], str):
                value = text  # strings are taken verbatim (--out_dir=123 is a directory name)
            config[key] = checked(key, value, arg)
        else:
            if not os.path.isfile(arg):
                raise FileNotFoundError(f"config file {arg!r} not found")
            scope = dict(config, __file__=os.path.abspath(arg))  # so a config file can build on a sibling
            with open(arg) as f:
                exec(builtins.compile(f.read(), arg, "exec"), scope)  # the config global `compile` shadows the builtin
            for key, value in scope.items():
                if key.startswith("_") or type(value).__name__ == "module" or callable(value):
                    continue
                if key not in config or value is not config[key]:
                    config[key] = checked(key, value, arg)
    return config


# -----------------------------------------------------------------------------------------------------------------
# optimizer, schedule, clipping (SPEC §3.1-3.3)

class AdamW(torch.optim.Optimizer):
    """AdamW exactly as SPEC §3.1 (t per parameter, ε after sqrt(v), decay by α·λ after the Adam update). m and v
    are fp32 (fp64 for fp64 parameters); bf16/fp16 parameters are updated in fp32 and rounded once.
    fused=None (default) steps CUDA parameters with one fused Triton kernel per (group, dtype) and everything else
    with torch._foreach_* ops; fused=True insists on the kernel (on CPU it then runs in Triton's interpreter: for
    tests), fused=False always uses foreach."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=None):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"AdamW: lr, eps and weight_decay must be >= 0 (got {lr}, {eps}, {weight_decay})")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamW: betas must lie in [0, 1) (got {betas})")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.fused = fused
        self._tables = {}  # bucket -> flash.adamw_step's cache (chunk table, gradient offsets)

    def _use_kernel(self, p):
        if self.fused is False or p.dtype == torch.float64:
            return False
        dense = p.is_contiguous() and p.grad.is_contiguous()
        if self.fused is None:
            return dense and p.is_cuda
        if not dense:
            raise ValueError("AdamW(fused=True) needs contiguous parameters and gradients")
        return True

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            buckets = {}  # (fused, device, dtype, grad dtype, t) -> tensor lists for one launch / foreach call each
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state_dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype, memory_format=torch.preserve_format)
                state["step"] += 1
                key = (self._use_kernel(p), p.device, p.dtype, p.grad.dtype, state["step"])
                b = buckets.setdefault(key, ([], [], [], []))
                for lst, t in zip(b, (p, p.grad, state["exp_avg"], state["exp_avg_sq"])):
                    lst.append(t)
            for (fused, device, dt, g_dt, t), columns in buckets.items():
                neg_step = -lr * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)  # -α_t
                if fused:  # flash.py's kernel; the cache keeps its chunk table between steps
                    cache = self._tables.setdefault((gi, device, dt, g_dt), {})
                    flash.adamw_step(cache, *columns, neg_step, beta1, beta2, eps, 1 - lr * weight_decay)
                else:
                    self._foreach_step(*columns, neg_step, beta1, beta2, eps, lr * weight_decay)
        return loss

    @staticmethod
    def _foreach_step(params, grads, exp_avgs, exp_avg_sqs, neg_step, beta1, beta2, eps, lr_wd):
        work = params if params[0].dtype == exp_avgs[0].dtype else [p.float() for p in params]
        if grads[0].dtype != exp_avgs[0].dtype:
            grads = [g.to(exp_avgs[0].dtype) for g in grads]
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)                 # m ← β1·m + (1−β1)·g
        torch._foreach_mul_(exp_avg_sqs, beta2)                          # v ← β2·v + (1−β2)·g²
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(work, exp_avgs, denom, neg_step)         # θ ← θ − α_t·m/(sqrt(v)+ε)
        if lr_wd != 0:
            torch._foreach_mul_(work, 1 - lr_wd)                         # θ ← θ − α·λ·θ
        if work is not params:
            torch._foreach_copy_(params, work)


def get_lr_cosine_schedule(it, max_learning_rate, min_learning_rate, warmup_iters, cosine_cycle_iters):
    """SPEC §3.2: linear warm-up to max over warmup_iters, cosine down to min at cosine_cycle_iters, then min."""
    if it < warmup_iters:
        return it / warmup_iters * max_learning_rate
    if it <= cosine_cycle_iters:
        progress = (it - warmup_iters) / max(1, cosine_cycle_iters - warmup_iters)
        return min_learning_rate + 0.5 * (1 + math.cos(math.pi * progress)) * (max_learning_rate - min_learning_rate)
    return min_learning_rate


@torch.no_grad()
def clip_grad_norm(parameters, max_l2_norm):
    """SPEC §3.3: global L2 norm over all gradients (parameters without one are skipped); if it exceeds
    max_l2_norm, scale every gradient in place by max_l2_norm / (norm + 1e-6). Returns the norm before clipping as
    a 0-dim fp32 tensor (no host sync: the scale is clamp(max/(n+1e-6), max=1), exactly 1 when not clipping)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    by_device = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    first = grads[0].device
    squares = [torch.stack(torch._foreach_norm(gs)).float().square().sum().to(first) for gs in by_device.values()]
    total = torch.stack(squares).sum().sqrt()
    scale = (max_l2_norm / (total + 1e-6)).clamp(max=1.0)
    for dev, gs in by_device.items():
        torch._foreach_mul_(gs, scale.to(dev, gs[0].dtype))
    return total


# -----------------------------------------------------------------------------------------------------------------
# data (SPEC §3.4, §5.7)

def load_dataset(data_dir, split):
    """Open data_dir/{split}.bin as a read-only memmap, with its document offsets and meta.json (the format of
    data/prepare.py). Validates everything train.py relies on and names the prepare command when files are missing.
    Returns (tokens, docs, meta)."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    name = os.path.basename(os.path.normpath(data_dir))
    make = f"run `python data/prepare.py {name}` to create it"
    meta_path = os.path.join(data_dir, "meta.json")
    bin_path = os.path.join(data_dir, f"{split}.bin")
    docs_path = os.path.join(data_dir, f"{split}_docs.npy")
    for path in (meta_path, bin_path, docs_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"dataset file {path} is missing: {make}")
    with open(meta_path) as f:
        meta = json.load(f)
    for key in ("dtype", "vocab_size", "eot_id", "special_tokens", "vocab", "merges", f"{split}_tokens",
                f"{split}_docs"):
        if key not in meta:
            raise ValueError(f"{meta_path} lacks {key!r}: {make}")
    np_dtype = np.dtype(meta["dtype"])
    if np_dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)):
        raise ValueError(f"{meta_path}: dtype {meta['dtype']!r} is neither uint16 nor uint32")
    nbytes = os.path.getsize(bin_path)
    if nbytes % np_dtype.itemsize:
        raise ValueError(f"{bin_path} has {nbytes} bytes, not a multiple of {np_dtype.itemsize} ({np_dtype}): "
                         f"truncated or written with another dtype; {make}")
    n = nbytes // np_dtype.itemsize
    if n != meta[f"{split}_tokens"]:
        raise ValueError(f"{bin_path} holds {n} tokens but meta.json says {meta[f'{split}_tokens']}; {make}")
    if n == 0:
        raise ValueError(f"{bin_path} is empty; {make}")
    tokens = np.memmap(bin_path, dtype=np_dtype, mode="r", shape=(n,))
    max_id = int(tokens.max())
    if max_id >= meta["vocab_size"]:
        raise ValueError(f"{bin_path} contains token id {max_id} >= vocab_size {meta['vocab_size']}")
    docs = np.load(docs_path)
    if (docs.ndim != 1 or docs.dtype != np.int64 or len(docs) != meta[f"{split}_docs"] + 1 or docs[0] != 0
            or docs[-1] != n or np.any(np.diff(docs) <= 0)):
        raise ValueError(f"{docs_path} is not a valid document index for {n} tokens and {meta[f'{split}_docs']} "
                         f"documents (int64, starts at 0, strictly increasing, ends at {n}); {make}")
    if np.any(tokens[docs[1:] - 1] != meta["eot_id"]):
        raise ValueError(f"{bin_path}: not every document ends with eot_id {meta['eot_id']}; {make}")
    return tokens, docs, meta


def _to_device(t, device):
    # pinned host memory lets the copy run asynchronously to the GPU (SPEC §3.4)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def get_batch(dataset, batch_size, context_length, device, generator=None):
    """SPEC §3.4: batch_size random windows, starts uniform in {0, ..., n - context_length - 1}; returns int64
    inputs and next-token targets (B, T) on device. Only the windows are read from the memmap."""
    n = len(dataset)
    if n < context_length + 1:
        raise ValueError(f"dataset has {n} tokens, fewer than context_length + 1 = {context_length + 1}")
    starts = torch.randint(0, n - context_length, (batch_size,), generator=generator).tolist()
    rows = np.stack([np.asarray(dataset[s:s + context_length + 1], dtype=np.int64) for s in starts])
    x, y = torch.from_numpy(np.ascontiguousarray(rows[:, :-1])), torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))
    return _to_device(x, device), _to_device(y, device)


def sample_documents(docs, token_budget, context_length, generator):
    """Random document pieces until they hold at least token_budget real (target) tokens. A document longer than
    context_length is split into context_length-sized pieces (the pieces partition it); pieces are drawn uniformly
    (so each token is equally likely, as with concat windows) and a piece of L tokens yields L - 1 targets, so
    pieces of one token are never drawn. The batch overshoots the budget by less than one piece.
    Returns a list of (start, end) token ranges."""
    docs = np.asarray(docs, dtype=np.int64)
    if context_length < 2:
        raise ValueError(f"context_length must be >= 2, got {context_length}")
    lengths = np.diff(docs)
    if len(lengths) == 0 or lengths.max() < 2:
        raise ValueError("no document has 2 or more tokens: nothing to predict")
    first_piece = np.concatenate([[0], np.cumsum((lengths + context_length - 1) // context_length)])
    drawn, spans = 0, []
    while drawn < token_budget:
        draw = torch.randint(0, int(first_piece[-1]), (max(8, 2 * token_budget // context_length),),
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
    """One row per piece, right-padded to `length` with pad_id: x (B, length) int64 holds the piece, y the next
    token inside the piece and -100 on padding and at the piece's last position (no target crosses its end)."""
    x = np.full((len(spans), length), pad_id, dtype=np.int64)
    y = np.full((len(spans), length), -100, dtype=np.int64)
    for i, (s, e) in enumerate(spans):
        if e - s > length:
            raise ValueError(f"piece ({s}, {e}) of {e - s} tokens does not fit a row of length {length}")
        piece = np.asarray(tokens[s:e], dtype=np.int64)
        x[i, :e - s] = piece
        y[i, :e - s - 1] = piece[1:]
    return torch.from_numpy(x), torch.from_numpy(y)


def pack_batch(tokens, spans):
    """All pieces in one row (SPEC §5.7): x = concat(piece[:-1]), y = concat(piece[1:]) as (1, N) int64, with
    int32 cu_seqlens (len num_pieces + 1) over those N positions and max_seqlen (a Python int)."""
    pieces = [np.asarray(tokens[s:e], dtype=np.int64) for s, e in spans]
    if not pieces or min(len(p) for p in pieces) < 2:
        raise ValueError("pack_batch needs at least one piece, each of at least 2 tokens")
    seqlens = np.array([len(p) - 1 for p in pieces])
    x = torch.from_numpy(np.concatenate([p[:-1] for p in pieces]))[None]
    y = torch.from_numpy(np.concatenate([p[1:] for p in pieces]))[None]
    cu_seqlens = torch.from_numpy(np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32))
    return x, y, cu_seqlens, int(seqlens.max())


def make_batch(tokens, docs, c, generator, device, pad_id):
    """One micro-batch for c.batching: (x, y, cu_seqlens or None, max_seqlen or None, real target tokens)."""
    if c.batching == "concat":
        x, y = get_batch(tokens, c.batch_size, c.context_length, device, generator)
        return x, y, None, None, c.batch_size * c.context_length
    spans = sample_documents(docs, c.batch_size * c.context_length, c.context_length, generator)
    n_real = sum(e - s - 1 for s, e in spans)
    if c.batching == "pack":
        x, y, cu_seqlens, max_seqlen = pack_batch(tokens, spans)
        return _to_device(x, device), _to_device(y, device), _to_device(cu_seqlens, device), max_seqlen, n_real
    length = c.context_length if c.batching == "pad" else max(e - s for s, e in spans)
    x, y = pad_batch(tokens, spans, length, pad_id)
    return _to_device(x, device), _to_device(y, device), None, None, n_real


def batch_generator(seed, iteration, micro):
    """The data RNG of one micro-batch: a pure function of (seed, iteration, global micro-batch index). Ranks own
    different micro indices, so they draw different windows; a resumed run draws exactly the batches the
    uninterrupted run would; N ranks see the batches 1 process with N-fold accumulation sees. Validation uses
    negative iterations."""
    g = torch.Generator()
    g.manual_seed(((seed * 1_000_003 + iteration) * 1_000_003 + micro) & (2 ** 63 - 1))
    return g


# -----------------------------------------------------------------------------------------------------------------
# checkpoints (SPEC §3.5)

def _clean_state_dict(state_dict):
    # torch.compile wraps the model as _orig_mod; store the plain model's names (SPEC §2.7 layout)
    return {k.replace("_orig_mod.", ""): v for k, v in state_dict.items()}


def _unwrap(model):
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        else:
            return model


def save_checkpoint(model, optimizer, iteration, out, **extra):
    """Write {"model", "optimizer", "iteration", **extra} with torch.save. model is a module (wrappers and
    torch.compile are unwrapped, "_orig_mod." stripped) or a ready state dict (e.g. ddp.gather_full_params under
    FSDP); optimizer is an optimizer, a ready state dict (a collective one gathered on every rank) or None.
    A path is written atomically: a temp file in the same directory, then os.replace, so an interrupted save never
    leaves a broken checkpoint."""
    state_dict = model if isinstance(model, dict) else _unwrap(model).state_dict()
    ckpt = {"model": _clean_state_dict(state_dict),
            "optimizer": optimizer.state_dict() if hasattr(optimizer, "state_dict") else optimizer,
            "iteration": int(iteration), **extra}
    if isinstance(out, (str, os.PathLike)):
        out = os.fspath(out)
        tmp = out + ".tmp"
        torch.save(ckpt, tmp)
        os.replace(tmp, out)
    else:
        torch.save(ckpt, out)


def read_checkpoint(src):
    """torch.load(weights_only=True) onto the CPU, with a clear error for missing, truncated or corrupt files."""
    if isinstance(src, (str, os.PathLike)) and not os.path.isfile(src):
        raise FileNotFoundError(f"checkpoint {os.fspath(src)} not found (train with `python train.py` first)")
    try:
        ckpt = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as e:
        raise RuntimeError(f"checkpoint {src} is truncated or corrupt and cannot be loaded: {e}") from e
    if not isinstance(ckpt, dict) or "model" not in ckpt or "iteration" not in ckpt:
        raise RuntimeError(f"checkpoint {src} is not a train.py checkpoint (no 'model' / 'iteration')")
    return ckpt


def load_checkpoint(src, model, optimizer):
    """Load a save_checkpoint file into model (and optimizer, unless None); returns the iteration."""
    ckpt = read_checkpoint(src)
    _unwrap(model).load_state_dict(_clean_state_dict(ckpt["model"]))
    if optimizer is not None:
        if ckpt.get("optimizer") is None:
            raise RuntimeError(f"checkpoint {src} holds no optimizer state")
        optimizer.load_state_dict(ckpt["optimizer"])
    return ckpt["iteration"]


def _rng_state(dev):
    state = {"torch": torch.get_rng_state()}
    if dev.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(dev)
    return state


def _set_rng_state(state, dev):
    torch.set_rng_state(state["torch"])
    if dev.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], dev)


# -----------------------------------------------------------------------------------------------------------------
# the run

def prepare_data(c, rank, world_size):
    """data_dir of the run; prepares the default Shakespeare data on first use (rank 0, others wait)."""
    data_dir = c.data_dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", c.dataset)
    if not os.path.isfile(os.path.join(data_dir, "meta.json")) and c.dataset == "shakespeare" and not c.data_dir:
        if rank == 0:
            print(f"{data_dir} is missing: running `python data/prepare.py shakespeare`", flush=True)
            prepare = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "prepare.py")
            subprocess.run([sys.executable, prepare, "shakespeare"], check=True)
        if world_size > 1:
            torch.distributed.barrier()
    return data_dir


def check_config(c, world_size):
    if c.init_from not in ("scratch", "resume"):
        raise ValueError(f"init_from must be 'scratch' or 'resume', got {c.init_from!r}")
    if c.batching not in BATCHING:
        raise ValueError(f"batching must be one of {BATCHING}, got {c.batching!r}")
    if c.ddp_impl not in DDP_IMPLS:
        raise ValueError(f"ddp_impl must be one of {DDP_IMPLS}, got {c.ddp_impl!r}")
    if c.zero1 and c.ddp_impl in ("fsdp", "torch_fsdp"):
        raise ValueError(f"zero1 shards optimizer state on top of replicated DDP; ddp_impl={c.ddp_impl!r} "
                         f"shards it already")
    if c.grad_accum < 1 or c.grad_accum % world_size:
        raise ValueError(f"grad_accum={c.grad_accum} must be a positive multiple of the world size {world_size} "
                         f"(micro-batches are split across ranks)")
    for key in ("batch_size", "context_length", "max_iters", "eval_iters", "log_interval", "eval_interval",
                "ckpt_interval"):
        if getattr(c, key) < 1:
            raise ValueError(f"{key} must be >= 1, got {getattr(c, key)}")
    if c.d_model % c.num_heads:
        raise ValueError(f"d_model={c.d_model} is not divisible by num_heads={c.num_heads}")


def evaluate(model, batches, autocast):
    """Mean validation loss over the fixed batches owned by this rank (summed over ranks): (loss sum, targets)."""
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for x, y, cu_seqlens, max_seqlen, n_real in batches:
            with autocast:
                logits = model(x, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen) if cu_seqlens is not None else model(x)
                loss = cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=-100)
            total += loss.double().cpu() * n_real
            count += n_real
    model.train()
    return total, count


def plot_losses(log_path, png_path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    train, val = [], []
    with open(log_path) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r:
                train.append((r["step"], r["loss"]))
            if "val_loss" in r:
                val.append((r["step"], r["val_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train (rank 0 micro-batches)")
    if val:
        ax.plot(*zip(*val), "o-", label="val (fixed batches)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def main(argv):
    if "-h" in argv or "--help" in argv:
        keys = "\n".join(f"  --{k}={v!r}" for k, v in default_config().items())
        print(f"{__doc__}\nconfig keys and defaults:\n{keys}")
        return
    c = SimpleNamespace(**apply_config(argv, default_config()))
    rank, _, world_size, dev = ddp.init_distributed()
    if c.device != "auto" and world_size == 1:
        dev = torch.device(c.device)
    try:
        train(c, rank, world_size, dev)
    finally:
        ddp.cleanup_distributed()


def train(c, rank, world_size, dev):
    check_config(c, world_size)
    master = rank == 0
    log = (lambda *a: print(*a, flush=True)) if master else (lambda *a: None)
    ptdtype = {"auto": torch.bfloat16 if dev.type == "cuda" else torch.float32,
               "float32": torch.float32, "bfloat16": torch.bfloat16}.get(c.dtype)
    if ptdtype is None:
        raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16' (no loss scaling for float16), "
                         f"got {c.dtype!r}")
    autocast = (torch.autocast(device_type=dev.type, dtype=ptdtype) if ptdtype != torch.float32
                else contextlib.nullcontext())
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    attn = c.attn_impl if c.attn_impl != "auto" else ("flash" if dev.type == "cuda" else "naive")

    # data
    data_dir = prepare_data(c, rank, world_size)
    train_tokens, train_docs, meta = load_dataset(data_dir, "train")
    val_tokens, val_docs, _ = load_dataset(data_dir, "val")
    vocab_size = meta["vocab_size"]
    for name, toks in (("train", train_tokens), ("val", val_tokens)):
        if c.batching == "concat" and len(toks) < c.context_length + 1:
            raise ValueError(f"{name} split has {len(toks)} tokens, fewer than context_length + 1 = "
                             f"{c.context_length + 1}: lower context_length or prepare more data")

    # model: from scratch, or from the checkpoint's own model_args when resuming
    os.makedirs(c.out_dir, exist_ok=True)
    ckpt_path = os.path.join(c.out_dir, "ckpt.pt")
    model_args = dict(vocab_size=vocab_size, context_length=c.context_length, d_model=c.d_model,
                      num_layers=c.num_layers, num_heads=c.num_heads, d_ff=c.d_ff, rope_theta=c.rope_theta,
                      tie_embeddings=c.tie_embeddings, act_ckpt_every=c.act_ckpt_every)
    ckpt = None
    if c.init_from == "resume":
        ckpt = read_checkpoint(ckpt_path)
        model_args = dict(ckpt["model_args"], act_ckpt_every=c.act_ckpt_every)
        if model_args["vocab_size"] != vocab_size:
            raise ValueError(f"checkpoint {ckpt_path} has vocab_size {model_args['vocab_size']} but dataset "
                             f"{data_dir} has {vocab_size}: resume on the data it was trained on")
        if model_args["context_length"] < c.context_length:
            raise ValueError(f"context_length={c.context_length} exceeds the checkpoint's "
                             f"{model_args['context_length']}")
    torch.manual_seed(c.seed)
    model = TransformerLM(**model_args, attn_impl=attn, device=dev)
    if ckpt is not None:
        model.load_state_dict(_clean_state_dict(ckpt["model"]))
    raw_model = model
    n_params = count_params(model)
    flops_tok = flops_per_token(vocab_size, model_args["context_length"], model_args["d_model"],
                                model_args["num_layers"], model_args["d_ff"], causal=True)
    log(f"model: {n_params / 1e6:.2f}M parameters, {flops_tok / 1e6:.1f} MFLOP/token (training, causal), "
        f"attn_impl={attn}, dtype={ptdtype}, device={dev}, world_size={world_size}, ddp_impl={c.ddp_impl}"
        f"{' + zero1' if c.zero1 else ''}, batching={c.batching}")

    # data parallelism (SPEC §6): our wrappers compile inside, FSDP variants compile around. Document batches
    # differ in shape from step to step: compile for dynamic shapes at once instead of recompiling on the second
    compile_kw = dict(dynamic=True) if c.batching != "concat" else {}
    if c.compile and c.ddp_impl not in ("fsdp", "torch_fsdp"):
        model = torch.compile(model, **compile_kw)
    if world_size > 1:
        if c.ddp_impl == "bucketed":
            model = ddp.DDPBucketed(model, c.bucket_size_mb)
        elif c.ddp_impl == "naive":
            model = ddp.DDPNaive(model)
        elif c.ddp_impl == "flat":
            model = ddp.DDPFlat(model)
        elif c.ddp_impl == "overlap":
            model = ddp.DDPIndividualParameters(model)
        elif c.ddp_impl == "fsdp":
            model = ddp.FSDP(model, compute_dtype=None if ptdtype == torch.float32 else ptdtype)
        elif c.ddp_impl == "torch":
            model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[dev.index] if dev.type == "cuda" else None, broadcast_buffers=False)
        elif c.ddp_impl == "torch_fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            mp = MixedPrecisionPolicy(param_dtype=ptdtype, reduce_dtype=torch.float32)
            for block in model.layers:
                fully_shard(block, mp_policy=mp)
            fully_shard(model, mp_policy=mp)
    if c.compile and c.ddp_impl in ("fsdp", "torch_fsdp"):
        model = torch.compile(model, **compile_kw)

    # optimizer: decay matrices, not the RMSNorm gains (named ln1, ln2, ln_final in SPEC §2.7)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if any(part.startswith("ln") for part in name.split(".")) else decay).append(p)
    groups = [{"params": decay, "weight_decay": c.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt_kwargs = dict(lr=c.learning_rate, betas=(c.beta1, c.beta2), eps=c.eps)
    if c.zero1 and world_size > 1:
        optimizer = ddp.ShardedOptimizer(groups, AdamW, **opt_kwargs)
    else:
        optimizer = AdamW(groups, **opt_kwargs)
    fsdp_opt_path = os.path.join(c.out_dir, f"ckpt_optimizer_rank{rank}.pt")
    start_iter = 0
    if ckpt is not None:
        start_iter = ckpt["iteration"]
        if c.ddp_impl == "fsdp" and world_size > 1:
            if ckpt.get("world_size") != world_size:
                raise ValueError(f"FSDP optimizer shards were saved with world_size {ckpt.get('world_size')}, "
                                 f"this run has {world_size}")
            optimizer.load_state_dict(read_checkpoint(fsdp_opt_path)["optimizer"])
        elif c.ddp_impl == "torch_fsdp" and world_size > 1:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
            set_optimizer_state_dict(model, optimizer, ckpt["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))
        else:
            optimizer.load_state_dict(ckpt["optimizer"])
        _set_rng_state(ckpt["rng"], dev)
        log(f"resumed from {ckpt_path} at iteration {start_iter}")
    del ckpt

    def checkpoint(iteration):
        """Collective when sharded (every rank calls it); rank 0 writes ckpt.pt."""
        if c.ddp_impl == "fsdp" and world_size > 1:
            state, opt_state = ddp.gather_full_params(model), None
            save_checkpoint({}, optimizer, iteration, fsdp_opt_path)  # each rank's shard of the AdamW state
        elif c.ddp_impl == "torch_fsdp" and world_size > 1:
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                                 get_optimizer_state_dict)
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = get_model_state_dict(model, options=options)
            opt_state = get_optimizer_state_dict(model, optimizer, options=options)
        else:
            state, opt_state = raw_model.state_dict(), optimizer.state_dict()  # consolidating under zero1
        if master:
            tokenizer = {"vocab": os.path.join(data_dir, meta["vocab"]),
                         "merges": os.path.join(data_dir, meta["merges"]),
                         "special_tokens": list(meta["special_tokens"])}
            save_checkpoint(state, opt_state, iteration, ckpt_path, model_args=model_args, config=vars(c),
                            tokenizer=tokenizer, rng=_rng_state(dev), world_size=world_size)

    # fixed validation batches: the same ones at every evaluation; rank r takes every world_size-th one, and every
    # rank runs the same number of forwards (FSDP needs all ranks in each all-gather; extras count zero tokens)
    val_batches = []
    for i in range(rank, -(-c.eval_iters // world_size) * world_size, world_size):
        b = make_batch(val_tokens, val_docs, c, batch_generator(c.seed, -1 - (i % c.eval_iters), 0), dev,
                       meta["eot_id"])
        val_batches.append(b if i < c.eval_iters else b[:4] + (0,))

    log_path = os.path.join(c.out_dir, "log.jsonl")

    def eval_and_log(step):
        """Validation loss over the fixed batches (all ranks), logged by rank 0; returns the seconds it took."""
        t0 = time.time()
        total, count = evaluate(model, val_batches, autocast)
        if world_size > 1:
            t = torch.tensor([total.item(), float(count)], dtype=torch.float64, device=dev)
            torch.distributed.all_reduce(t)
            total, count = t[0].cpu(), int(t[1].item())
        val_loss = float(total) / count
        log(f"step {step}: val loss {val_loss:.4f}, perplexity {math.exp(val_loss):.2f}")
        if master:
            with open(log_path, "a") as f:
                f.write(json.dumps({"step": step, "val_loss": val_loss, "time_s": time.time() - t_start}) + "\n")
            plot_losses(log_path, os.path.join(c.out_dir, "loss.png"))
        return time.time() - t0
    if master and c.init_from == "scratch":
        open(log_path, "w").close()
        counts = np.bincount(np.asarray(train_tokens), minlength=vocab_size).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        log(f"data: {len(train_tokens):,} train / {len(val_tokens):,} val tokens, vocab_size {vocab_size}; "
            f"unigram entropy {-(p * np.log(p)).sum():.3f} nats/token (the loss of a model that ignores context)")
    lr_decay_iters = c.lr_decay_iters or c.max_iters
    local_accum = c.grad_accum // world_size
    if c.peak_flops:
        peak = c.peak_flops
    elif dev.type == "cuda" and any(g in torch.cuda.get_device_name(dev) for g in ("H100", "H200")):
        peak = 989e12  # dense bf16 datasheet figure (ANCHORS.md)
    else:
        peak = 0.0

    model.train()
    t_last, it_last, tokens_since = time.time(), start_iter, 0
    t_start = time.time()
    loss_sum = torch.zeros((), device=dev)
    for it in range(start_iter, c.max_iters):
        if it % c.eval_interval == 0 and not (it == start_iter and c.init_from == "resume"):
            t_last += eval_and_log(it)  # evaluation time is not training time

        lr = get_lr_cosine_schedule(it, c.learning_rate, c.min_lr, c.warmup_iters, lr_decay_iters)
        for group in optimizer.param_groups:
            group["lr"] = lr
        for j in range(local_accum):
            x, y, cu_seqlens, max_seqlen, n_real = make_batch(
                train_tokens, train_docs, c, batch_generator(c.seed, it, rank * local_accum + j), dev, meta["eot_id"])
            tokens_since += n_real
            last = j == local_accum - 1
            sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
            with sync:
                with autocast:
                    logits = model(x, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen) if cu_seqlens is not None \
                        else model(x)
                    loss = cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=-100)
                (loss / local_accum).backward()  # DDP averages over ranks: 1/grad_accum overall
            loss_sum += loss.detach()
        if hasattr(model, "finish_gradient_synchronization"):
            model.finish_gradient_synchronization()
        max_norm = c.grad_clip if c.grad_clip > 0 else float("inf")
        if c.ddp_impl == "fsdp" and world_size > 1:
            grad_norm = model.clip_grad_norm(max_norm)
        elif c.ddp_impl == "torch_fsdp" and world_size > 1:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        else:
            grad_norm = clip_grad_norm(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        step = it + 1
        if step % c.log_interval == 0 or step == c.max_iters:
            tokens = torch.tensor(float(tokens_since), device=dev)
            if world_size > 1:
                torch.distributed.all_reduce(tokens)
            train_loss = loss_sum.item() / local_accum / (step - it_last)
            now = time.time()
            dt = (now - t_last) / (step - it_last)
            tok_s = tokens.item() / (now - t_last)
            mfu = flops_tok * tok_s / (peak * world_size) if peak else None
            record = {"step": step, "loss": train_loss, "lr": lr, "grad_norm": float(grad_norm),
                      "tokens_per_s": tok_s, "mfu": mfu, "ms_per_step": 1000 * dt, "time_s": now - t_start}
            eta = dt * (c.max_iters - step)
            log(f"step {step}/{c.max_iters}: loss {train_loss:.4f}, lr {lr:.2e}, grad norm {float(grad_norm):.3f}, "
                f"{tok_s:,.0f} tok/s, " + (f"MFU {100 * mfu:.1f}%, " if mfu is not None else "")
                + f"{1000 * dt:.1f} ms/step, ETA {eta / 60:.1f} min")
            if master:
                with open(log_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            t_last, it_last, tokens_since = now, step, 0
            loss_sum.zero_()
        if step == c.max_iters:
            eval_and_log(step)
        if step % c.ckpt_interval == 0 or step == c.max_iters:
            checkpoint(step)
            log(f"saved {ckpt_path} at step {step}")
    log(f"done: {c.max_iters - start_iter} steps in {(time.time() - t_start) / 60:.1f} min")


if __name__ == "__main__":
    main(sys.argv[1:])
