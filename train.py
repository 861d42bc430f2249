"""
Train a TransformerLM on a tokenized dataset. Example commands:

    python train.py                                    # CPU default: Shakespeare, vocab 2048, a few minutes on 2 cores
    python train.py --max_iters=200 --batch_size=8     # any config global can be overridden with --key=value
    python train.py config/pack.py                     # a config file of overrides (then --key=value on top)
    python train.py --init_from=resume                 # continue out_dir/ckpt.pt exactly, with its saved config
    python train.py --force=True                       # start over in an out_dir that holds a run (old files -> *.old)
    torchrun --standalone --nproc_per_node=4 train.py config/small.py                 # 4 GPUs, our bucketed DDP
    torchrun --standalone --nproc_per_node=4 train.py config/small.py --ddp_impl=torch --zero1=False

The data directory comes from `python data/prepare.py NAME` (run automatically for the default `shakespeare`).
Everything below the config block is importable without side effects: AdamW, get_lr_cosine_schedule,
clip_grad_norm, get_batch, load_dataset, sample_documents / pad_batch / pack_batch / pad_packed, save_checkpoint /
load_checkpoint. The run itself sits in main() (cli() for the command line, called under
`if __name__ == "__main__"`). Ctrl-C (SIGINT) or SIGTERM end a run after the step in progress, with a checkpoint
of it and the command that continues it.
"""
import ast
import builtins
import contextlib
import difflib
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import torch

import ddp
from flash import AdamW  # noqa: F401  (train.AdamW: the optimizer lives beside its kernel)
from hf import llama_init
from model import TransformerLM, auto_attn_impl, count_params, flops_per_token

_ROOT = os.path.dirname(os.path.abspath(__file__))


# -----------------------------------------------------------------------------------------------------------------
# config: plain globals, overridden by a config file and then --key=value (apply_config). Defaults = a CPU run.
# I/O
out_dir = "out"                 # checkpoints (ckpt.pt), log.jsonl and loss.png
init_from = "scratch"           # 'scratch', 'resume' (out_dir/ckpt.pt with its saved config, exactly) or a Llama dir
force = False                   # scratch into an out_dir that holds a run: move its ckpt.pt / log.jsonl to *.old
log_interval = 10               # optimizer steps between log lines
eval_interval = 100             # steps between validation-loss evaluations (and at the last step)
eval_iters = 10                 # number of FIXED validation batches per evaluation
save_interval = 200             # steps between checkpoints (and at the end, and when SIGINT / SIGTERM stop the run)
seed = 1337                     # model init and every data draw derive from it
# data
dataset = "shakespeare"         # name under data/ (made by `python data/prepare.py NAME`)
data_dir = ""                   # '' = data/<dataset> next to this file
batching = "concat"             # 'concat' | 'pad' | 'dynamic_pad' | 'pack' (README says when to use which)
pack_static = False             # 'pack' at a few static shapes: every micro-batch padded to (batch_size + 1) *
                                # context_length tokens and to a power of two of documents (pad_packed), so it
                                # compiles without dynamic shapes and cuda_graphs can capture it
batch_size = 16                 # sequences per micro-batch; doc strategies use batch_size*context_length real tokens
context_length = 128            # tokens per sequence (RoPE table size)
grad_accum = 1                  # micro-batches per optimizer step, split across ranks (must divide by world size)
# model (config/*.py hold the preset shapes)
d_model = 256                   # residual width
num_layers = 4                  # transformer blocks
num_heads = 8                   # attention heads (d_model / num_heads = head dim)
d_ff = 704                      # SwiGLU hidden width (about 8/3 d_model, a multiple of 64)
rope_theta = 10000.0            # RoPE base
tie_embeddings = False          # share token_embeddings and lm_head
attn_impl = "auto"              # 'auto' (model.auto_attn_impl: the fastest measured) | 'flash' | 'flash_ref' | 'sdpa' |
                                # 'naive'
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
beta1 = 0.9
beta2 = 0.95
eps = 1e-8
grad_clip = 1.0                 # global-norm clip (0 = off; the norm is still logged)
# system
device = "auto"                 # 'auto' (cuda if available), 'cpu', 'cuda', 'cuda:1', ...
dtype = "auto"                  # 'auto' (bfloat16 on CUDA, float32 on CPU) | 'float32' | 'bfloat16' (autocast)
compile = False                 # torch.compile the model
cuda_graphs = False             # with compile on CUDA, static shapes (batching 'concat', or 'pack' with
                                # pack_static), one process: no launch cost on the host. concat: the whole step
                                # (every micro-batch, clip, AdamW) is one CUDA graph from the third step on
                                # (capture_step); pack_static: mode='reduce-overhead', each micro-step replayed
ddp_impl = "bucketed"           # torchrun: 'bucketed'|'naive'|'flat'|'overlap'|'fsdp'|'torch'|'torch_fsdp' (ddp.wrap)
zero1 = False                   # shard AdamW state across ranks (ddp.ShardedOptimizer; not with fsdp)
bucket_size_mb = 25.0           # bucket size of ddp_impl='bucketed'
peak_flops = 0.0                # per-GPU peak FLOP/s for MFU (0 = PEAK_FLOPS of the GPU, else MFU is not reported)
# -----------------------------------------------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))]

BATCHING = ("concat", "pad", "dynamic_pad", "pack")
DDP_IMPLS = ("bucketed", "naive", "flat", "overlap", "fsdp", "torch", "torch_fsdp")  # ddp.IMPLS under torchrun
# keys a resumed run must keep: changing any of them would draw other batches or build another model
RESUME_FIXED = ("dataset", "batching", "batch_size", "context_length", "grad_accum", "seed", "d_model",
                "num_layers", "num_heads", "d_ff", "rope_theta", "tie_embeddings")
RENAMED = {"ckpt_interval": "save_interval"}  # old config keys -> their names now (for the error's suggestion)
# dense bf16 tensor-core FLOP/s from the datasheets (SXM parts): the MFU denominator, matched by device name
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12}


class ConfigError(ValueError):
    """A bad config key or value, or a run the config would damage: the command line prints it as one line and
    exits with status 2."""


def gpu_peak_flops(device):
    """PEAK_FLOPS of a CUDA device whose name contains one of its keys, else 0.0 (MFU not reported)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), 0.0)


def default_config():
    return {k: globals()[k] for k in config_keys}


def apply_config(argv, config, given=None):
    """Apply config files (paths) and --key=value overrides, in order, to the dict `config` (nanoGPT's
    configurator, as a function). A file is executed with the current values in scope; new names it defines are
    unknown keys. Values are parsed with ast.literal_eval (else kept as strings). Unknown keys (with the closest
    known one as a suggestion) and values whose type differs from the default (int is accepted for float) raise
    ConfigError (a ValueError) naming the key. The keys set are added to the set `given` when one is passed."""
    def checked(key, value, source):
        if key not in config:
            close = [RENAMED[key]] if key in RENAMED else difflib.get_close_matches(key, list(config), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key {key!r} (from {source}){hint}")
        default = config[key]
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not type(default):
            raise ConfigError(f"config key {key!r} expects {type(default).__name__}, got {value!r} "
                              f"({type(value).__name__}) from {source}")
        if given is not None:
            given.add(key)
        return value

    for arg in argv:
        if arg.startswith("--"):
            if "=" not in arg:
                raise ConfigError(f"override {arg!r} must look like --key=value")
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
                raise ConfigError(f"config file {arg!r} not found")
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
# optimizer, schedule, clipping

def get_lr_cosine_schedule(it, max_learning_rate, min_learning_rate, warmup_iters, cosine_cycle_iters):
    """Linear warm-up to max over warmup_iters, cosine down to min at cosine_cycle_iters, then min."""
    if it < warmup_iters:
        return it / warmup_iters * max_learning_rate
    if it <= cosine_cycle_iters:
        progress = (it - warmup_iters) / max(1, cosine_cycle_iters - warmup_iters)
        return min_learning_rate + 0.5 * (1 + math.cos(math.pi * progress)) * (max_learning_rate - min_learning_rate)
    return min_learning_rate


def warmup_step(step, stream):
    """step() on the side stream `stream`, after the work queued before it and before the work queued after it:
    how the eager steps before capture_step run (torch.cuda.graph asks for warm-up off the default stream). Returns
    step()'s result."""
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        out = step()
    current.wait_stream(stream)
    return out


def capture_step(step, optimizer):
    """Capture step(), all the GPU work of one training step (every micro-batch's forward and backward, the
    clip, optimizer.step()) reading its batch from tensors that stay where they are, as one CUDA graph; returns
    replay(), which runs optimizer.advance() (the step count and the step size, on the host) and replays the graph,
    and gives back step()'s outputs: the same tensors after every replay, holding that replay's values.
    optimizer must be AdamW(capturable=True), stepped eagerly at least once already (that step compiles and
    autotunes the kernels and makes the state; warmup_step runs it on a side stream). A torch.optim optimizer made
    with capturable=True works too (it keeps its step count on the device and has no advance(); its lr is read at
    every replay only when it is a tensor). The gradients are set to None first, so the capture allocates them from
    the graph's memory and every replay's first backward writes them afresh (no zeroing pass). After the capture,
    step the optimizer only through replay(). replay.graph is the torch.cuda.CUDAGraph."""
    if not (getattr(optimizer, "capturable", False)
            or all(group.get("capturable", False) for group in optimizer.param_groups)):
        raise ValueError("capture_step needs an optimizer made with capturable=True (train.AdamW or torch.optim)")
    advance = getattr(optimizer, "advance", lambda: None)
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the eager steps' cached blocks: the graph has its own pool
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()

    def replay():
        advance()
        graph.replay()
        return outputs
    replay.graph = graph
    return replay


def whole_step_graph(step, optimizer, device, eager_steps=2):
    """step() (a whole training step ending in optimizer.step()) as one CUDA graph, every call one step: the first
    eager_steps calls run it eagerly on a side stream (warmup_step: they compile, autotune and make the optimizer's
    state) and set the gradients to None after it, the next one captures it (capture_step) and replays it, every
    later call replays. optimizer: capturable (AdamW or a torch.optim one). Returns the function to call."""
    side, state = torch.cuda.Stream(device), dict(eager_left=eager_steps, replay=None)

    def run():
        if state["replay"] is None and state["eager_left"]:
            state["eager_left"] -= 1
            out = warmup_step(step, side)
            optimizer.zero_grad(set_to_none=True)
            return out
        if state["replay"] is None:
            state["replay"] = capture_step(step, optimizer)
        return state["replay"]()
    return run


def clip_grad_norm(parameters, max_l2_norm):
    """Global L2 norm over all gradients (parameters without one are skipped); if it exceeds max_l2_norm, scale
    every gradient in place by max_l2_norm / (norm + 1e-6). Returns the norm before clipping as a 0-dim fp32 tensor
    without a host sync (the scale is clamp(max/(n+1e-6), max=1), exactly 1 when not clipping). ddp.clip_grad_norm
    is the one implementation (it also sums sharded gradients over ranks)."""
    return ddp.clip_grad_norm(list(parameters), max_l2_norm)


# -----------------------------------------------------------------------------------------------------------------
# data

def load_dataset(data_dir, split):
    """Open data_dir/{split}.bin as a read-only memmap, with its document offsets and meta.json (the format of
    data/prepare.py). Validates everything train.py relies on and names the prepare command when files are missing.
    Returns (tokens, docs, meta)."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    name = os.path.basename(os.path.normpath(data_dir))
    if os.path.abspath(data_dir) == os.path.join(_ROOT, "data", name):
        make = f"run `python data/prepare.py {name}` to create it"
    else:  # prepare.py writes data/<name> unless told where
        make = f"run `python data/prepare.py {name} --input <files> --out_dir {data_dir}` to create it"
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
    # pinned host memory lets the copy run asynchronously to the GPU
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def get_batch(dataset, batch_size, context_length, device, generator=None):
    """batch_size random windows, starts uniform in {0, ..., n - context_length - 1}; returns int64
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
    """All pieces in one row: x = concat(piece[:-1]), y = concat(piece[1:]) as (1, N) int64, with
    int32 cu_seqlens (len num_pieces + 1) over those N positions and max_seqlen (a Python int)."""
    pieces = [np.asarray(tokens[s:e], dtype=np.int64) for s, e in spans]
    if not pieces or min(len(p) for p in pieces) < 2:
        raise ValueError("pack_batch needs at least one piece, each of at least 2 tokens")
    seqlens = np.array([len(p) - 1 for p in pieces])
    x = torch.from_numpy(np.concatenate([p[:-1] for p in pieces]))[None]
    y = torch.from_numpy(np.concatenate([p[1:] for p in pieces]))[None]
    cu_seqlens = torch.from_numpy(np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32))
    return x, y, cu_seqlens, int(seqlens.max())


def pad_packed(x, y, cu_seqlens, length, pad_id):
    """A packed batch (pack_batch's x, y, cu_seqlens) at a static shape: x and y right-padded to `length` tokens
    (pad_id in x, -100 in y: no targets), the padding a document of its own so that no real token attends to it,
    and cu_seqlens then extended to the next power of two of offsets by repeating its last one (empty documents at
    the end). The loss and the gradients are the unpadded batch's; batches take one shape per power of two."""
    n = x.shape[1]
    if n > length:
        raise ValueError(f"a packed batch of {n} tokens does not fit a static length of {length}")
    if n < length:
        x = torch.cat([x, x.new_full((1, length - n), pad_id)], 1)
        y = torch.cat([y, y.new_full((1, length - n), -100)], 1)
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([length])])
    entries = 1 << (len(cu_seqlens) - 1).bit_length()  # the next power of two >= len(cu_seqlens)
    cu_seqlens = torch.cat([cu_seqlens, cu_seqlens[-1:].expand(entries - len(cu_seqlens))])
    return x, y, cu_seqlens


def make_batch(tokens, docs, c, generator, device, pad_id):
    """One micro-batch for c.batching: (x, y, cu_seqlens or None, max_seqlen or None, real target tokens)."""
    if c.batching == "concat":
        x, y = get_batch(tokens, c.batch_size, c.context_length, device, generator)
        return x, y, None, None, c.batch_size * c.context_length
    spans = sample_documents(docs, c.batch_size * c.context_length, c.context_length, generator)
    n_real = sum(e - s - 1 for s, e in spans)
    if c.batching == "pack":
        x, y, cu_seqlens, max_seqlen = pack_batch(tokens, spans)
        if c.pack_static:  # the pieces overshoot the budget by less than one: at most context_length of padding
            x, y, cu_seqlens = pad_packed(x, y, cu_seqlens, (c.batch_size + 1) * c.context_length, pad_id)
            max_seqlen = c.context_length
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
# checkpoints

def _clean_state_dict(state_dict):
    # torch.compile wraps the model as _orig_mod; store the plain model's names
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
    except pickle.UnpicklingError:  # torch's message would suggest the unsafe full unpickler: we never use it
        raise RuntimeError(f"checkpoint {src} holds Python objects other than tensors, numbers, strings and "
                           f"containers: not a train.py checkpoint, and it is not loaded") from None
    except Exception as e:
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights_only" in detail:
            detail = type(e).__name__
        raise RuntimeError(f"checkpoint {src} is truncated or corrupt and cannot be loaded ({detail})") from None
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
    data_dir = c.data_dir or os.path.join(_ROOT, "data", c.dataset)
    if not os.path.isfile(os.path.join(data_dir, "meta.json")) and c.dataset == "shakespeare" and not c.data_dir:
        if rank == 0:
            print(f"{data_dir} is missing: running `python data/prepare.py shakespeare`", flush=True)
            prepare = os.path.join(_ROOT, "data", "prepare.py")
            subprocess.run([sys.executable, prepare, "shakespeare"], check=True)
        if world_size > 1:
            torch.distributed.barrier()
    return data_dir


def check_config(c, world_size):
    """Values apply_config cannot judge alone; raises ConfigError naming the key."""
    if c.init_from not in ("scratch", "resume") and not os.path.isfile(os.path.join(c.init_from, "config.json")):
        raise ConfigError(f"init_from must be 'scratch', 'resume' or a Llama-format checkpoint directory "
                          f"(config.json + model.safetensors, as hf.save_llama writes), got {c.init_from!r}")
    if c.batching not in BATCHING:
        raise ConfigError(f"batching must be one of {BATCHING}, got {c.batching!r}")
    if c.ddp_impl not in DDP_IMPLS:
        raise ConfigError(f"ddp_impl must be one of {DDP_IMPLS}, got {c.ddp_impl!r}")
    if c.zero1 and c.ddp_impl in ("fsdp", "torch_fsdp"):
        raise ConfigError(f"zero1 shards optimizer state on top of replicated DDP; ddp_impl={c.ddp_impl!r} "
                          f"shards it already")
    if c.grad_accum < 1 or c.grad_accum % world_size:
        raise ConfigError(f"grad_accum={c.grad_accum} must be a positive multiple of the world size {world_size} "
                          f"(micro-batches are split across ranks)")
    for key in ("batch_size", "context_length", "max_iters", "eval_iters", "log_interval", "eval_interval",
                "save_interval"):
        if getattr(c, key) < 1:
            raise ConfigError(f"{key} must be >= 1, got {getattr(c, key)}")
    if c.d_model % c.num_heads:
        raise ConfigError(f"d_model={c.d_model} is not divisible by num_heads={c.num_heads}")
    if c.act_ckpt_every < 0 or not -1 <= c.act_ckpt_layers <= c.num_layers:
        raise ConfigError(f"act_ckpt_every must be >= 0 and act_ckpt_layers in [-1, num_layers={c.num_layers}], got "
                          f"{c.act_ckpt_every} and {c.act_ckpt_layers}")
    if c.pack_static and c.batching != "pack":
        raise ConfigError(f"pack_static applies to batching='pack', got batching={c.batching!r}")
    if c.cuda_graphs and not (c.compile and static_shapes(c) and world_size == 1):
        raise ConfigError(f"cuda_graphs needs compile=True, static shapes (batching='concat', or 'pack' with "
                          f"pack_static=True) and one process (not yet under torchrun with several), got "
                          f"compile={c.compile}, batching={c.batching!r}, pack_static={c.pack_static}, world size "
                          f"{world_size}")
    if c.dtype not in ("auto", "float32", "bfloat16"):
        raise ConfigError(f"dtype must be 'auto', 'float32' or 'bfloat16' (no loss scaling for float16), "
                          f"got {c.dtype!r}")


def static_shapes(c):
    """Whether every micro-batch of config c has one of a few fixed shapes (compiled without dynamic shapes)."""
    return c.batching == "concat" or (c.batching == "pack" and c.pack_static)


def resume_config(config, given, saved, log):
    """The config of a resumed run: the checkpoint's saved config, with the keys given on this command line
    (config files and --key=value) on top. A given key that changes the run is applied with a warning naming it;
    one of RESUME_FIXED that differs from the saved value is refused (the run could not continue exactly)."""
    saved = dict(saved)
    for old, new in RENAMED.items():  # checkpoints written before a key was renamed
        if old in saved:
            saved.setdefault(new, saved.pop(old))
    this_run = ("init_from", "force", "out_dir")  # where the checkpoint is now, and how this run starts
    merged = dict(config)
    merged.update({k: v for k, v in saved.items() if k in config and k not in this_run})
    refused, changed = [], []
    for key in sorted(given - set(this_run)):
        merged[key] = config[key]
        if key in saved and config[key] != saved[key]:
            (refused if key in RESUME_FIXED else changed).append(key)
    if refused:
        details = ", ".join(f"{k}={config[k]!r} (saved {saved[k]!r})" for k in refused)
        raise ConfigError(f"cannot resume exactly with {details}: drop these flags, or start a new run in "
                          f"another out_dir")
    for key in changed:
        log(f"warning: resume changes {key} from {saved[key]!r} to {config[key]!r}")
    return merged


def claim_out_dir(c, master, log):
    """A scratch run must not destroy a run already in out_dir: refuse, or with force=True move its checkpoint
    and log aside (to *.old, replacing an older *.old) before anything is written."""
    os.makedirs(c.out_dir, exist_ok=True)
    old = [n for n in ("ckpt.pt", "log.jsonl") if os.path.exists(os.path.join(c.out_dir, n))]
    if c.init_from == "resume" or not old:
        return
    if not c.force:
        raise ConfigError(f"{c.out_dir} already holds a run ({', '.join(old)}): pass --init_from=resume to "
                          f"continue it, or --force=True to start over (its files are then moved to *.old)")
    if master:
        for name in old + [n for n in ("loss.png",) if os.path.exists(os.path.join(c.out_dir, n))]:
            path = os.path.join(c.out_dir, name)
            os.replace(path, path + ".old")
        log(f"force: moved {', '.join(old)} in {c.out_dir} to *.old")


class StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM (a scheduler's warning before it kills) only set a flag here; the loop asks
    requested() before each step and, when set, saves the last completed step and returns. Under several
    processes the flag is all-reduced (max) each step over a CPU gloo side group: every rank stops at the same
    step (a collective checkpoint needs all of them), and no GPU synchronization is added."""

    def __init__(self, world_size):
        self.signum = 0
        self.group = torch.distributed.new_group(backend="gloo") if world_size > 1 else None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():  # Python runs signal handlers there only
            self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, frame):
        if not self.signum:  # a second signal (torchrun forwards the terminal's Ctrl-C too) changes nothing
            self.signum = signum
            print(f"received {signal.Signals(signum).name}: stopping after the current step and saving a "
                  f"checkpoint", file=sys.stderr, flush=True)

    def requested(self):
        """The signal to stop for (the same on every rank), or 0."""
        if self.group is None:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return int(flag)

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def save_run(path, w, optimizer, iteration, model_args, c, data_dir, meta, dev, world_size):
    """Checkpoint the run at `iteration`. Collective under sharding and ZeRO-1 (every rank calls it); rank 0
    writes `path` atomically. The state dicts are full (unsharded) under every ddp_impl."""
    state, opt_state = w.state_dict(), w.optimizer_state_dict(optimizer)
    if w.rank == 0:
        tokenizer = {"vocab": os.path.join(data_dir, meta["vocab"]),
                     "merges": os.path.join(data_dir, meta["merges"]), "special_tokens": list(meta["special_tokens"])}
        save_checkpoint(state, opt_state, iteration, path, model_args=model_args, config=vars(c),
                        tokenizer=tokenizer, rng=_rng_state(dev), world_size=world_size)


def evaluate_and_log(w, val_batches, autocast, step, dev, log_path, elapsed, master, log, eager=False):
    """Validation loss over the fixed batches (every rank takes part), logged and plotted by rank 0; returns the
    seconds it took. eager: run the unwrapped, uncompiled model (w.module)."""
    t0 = time.time()
    total, count = evaluate(w.module if eager else w, val_batches, autocast)
    if w.world_size > 1:
        t = torch.tensor([total.item(), float(count)], dtype=torch.float64, device=dev)
        torch.distributed.all_reduce(t)
        total, count = t[0].cpu(), int(t[1].item())
    val_loss = float(total) / count
    log(f"step {step}: val loss {val_loss:.4f}, perplexity {math.exp(val_loss):.2f}")
    if master:
        with open(log_path, "a") as f:
            f.write(json.dumps({"step": step, "val_loss": val_loss, "time_s": elapsed}) + "\n")
        plot_losses(log_path, os.path.join(os.path.dirname(log_path), "loss.png"))
    return time.time() - t0


def evaluate(model, batches, autocast):
    """Mean validation loss over the fixed batches owned by this rank (summed over ranks): (loss sum, targets)."""
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for x, y, cu_seqlens, max_seqlen, n_real in batches:
            with autocast:  # the fused head: the loss without the full logits (model.linear_cross_entropy)
                loss = (model(x, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, targets=y) if cu_seqlens is not None
                        else model(x, targets=y))
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
    """Run train.py with command-line arguments; returns the exit status: 0, or 128 + the signal number when
    SIGINT / SIGTERM stopped the run (after it saved the checkpoint)."""
    if "-h" in argv or "--help" in argv:
        keys = "\n".join(f"  --{k}={v!r}" for k, v in default_config().items())
        print(f"{__doc__}\nconfig keys and defaults:\n{keys}")
        return 0
    given = set()
    config = apply_config(argv, default_config(), given)
    rank, _, world_size, dev = ddp.init_distributed()
    if config["device"] != "auto" and world_size == 1:
        dev = torch.device(config["device"])
    try:
        return train(config, given, rank, world_size, dev)
    finally:
        ddp.cleanup_distributed()


def train(config, given, rank, world_size, dev):
    """The run: config (a dict of every key) and the keys the command line set (given), on this rank."""
    master = rank == 0
    log = (lambda *a: print(*a, flush=True)) if master else (lambda *a: None)
    c = SimpleNamespace(**config)
    ckpt_path = os.path.join(c.out_dir, "ckpt.pt")
    log_path = os.path.join(c.out_dir, "log.jsonl")
    ckpt = None
    if c.init_from == "resume":  # the saved config, with this command line's changes (or refusals)
        ckpt = read_checkpoint(ckpt_path)
        c = SimpleNamespace(**resume_config(config, given, ckpt.get("config", {}), log))
    check_config(c, world_size)
    if c.cuda_graphs and dev.type != "cuda":
        raise ConfigError(f"cuda_graphs needs a CUDA device, got {dev}")
    claim_out_dir(c, master, log)
    ptdtype = {"auto": torch.bfloat16 if dev.type == "cuda" else torch.float32,
               "float32": torch.float32, "bfloat16": torch.bfloat16}[c.dtype]
    autocast = (torch.autocast(device_type=dev.type, dtype=ptdtype) if ptdtype != torch.float32
                else contextlib.nullcontext())
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    attn = c.attn_impl if c.attn_impl != "auto" else auto_attn_impl(dev.type, packed=c.batching == "pack")

    # data
    data_dir = prepare_data(c, rank, world_size)
    train_tokens, train_docs, meta = load_dataset(data_dir, "train")
    val_tokens, val_docs, _ = load_dataset(data_dir, "val")
    vocab_size = meta["vocab_size"]
    for name, toks in (("train", train_tokens), ("val", val_tokens)):
        if c.batching == "concat" and len(toks) < c.context_length + 1:
            raise ValueError(f"{name} split has {len(toks)} tokens, fewer than context_length + 1 = "
                             f"{c.context_length + 1}: lower context_length or prepare more data")

    # model: from scratch, or with the checkpoint's own model_args when resuming
    model_args = dict(vocab_size=vocab_size, context_length=c.context_length, d_model=c.d_model,
                      num_layers=c.num_layers, num_heads=c.num_heads, d_ff=c.d_ff, rope_theta=c.rope_theta,
                      tie_embeddings=c.tie_embeddings)
    # how much is recomputed is a run setting, not part of the architecture: never saved with model_args
    recompute = dict(act_ckpt_every=c.act_ckpt_every, act_ckpt_layers=None if c.act_ckpt_layers < 0 else
                     c.act_ckpt_layers, selective_recompute=c.selective_recompute)
    if ckpt is not None:
        model_args = {k: v for k, v in ckpt["model_args"].items() if k not in recompute}
        if model_args["vocab_size"] != vocab_size:
            raise ValueError(f"checkpoint {ckpt_path} has vocab_size {model_args['vocab_size']} but dataset "
                             f"{data_dir} has {vocab_size}: resume on the data it was trained on")
    llama_state = None
    if c.init_from not in ("scratch", "resume"):  # fine-tune a Llama-format checkpoint directory
        model_args, llama_state = llama_init(c.init_from, vocab_size=vocab_size, context_length=c.context_length)
    torch.manual_seed(c.seed)
    model = TransformerLM(**model_args, **recompute, attn_impl=attn, device=dev)
    if llama_state is not None:
        model.load_state_dict(llama_state)
    n_params = count_params(model)
    flops_tok = flops_per_token(vocab_size, model_args["context_length"], model_args["d_model"],
                                model_args["num_layers"], model_args["d_ff"], causal=True)
    impl = c.ddp_impl if world_size > 1 else "none"
    log(f"model: {n_params / 1e6:.2f}M parameters, {flops_tok / 1e6:.1f} MFLOP/token (training, causal), "
        f"attn_impl={attn}, dtype={ptdtype}, device={dev}, world_size={world_size}, ddp_impl={impl}"
        f"{' + zero1' if c.zero1 and world_size > 1 else ''}, batching={c.batching}")

    # data parallelism, compiled as ddp.wrap says (document batches change shape every step: compile for dynamic
    # shapes at once instead of recompiling on the second; static packed batches compile once per shape); the
    # optimizer decays matrices, not the RMSNorm gains
    compile_kwargs = dict(dynamic=not static_shapes(c))
    whole_step = c.cuda_graphs and c.batching == "concat"  # else graphs per micro-step, by torch.compile
    if c.cuda_graphs and not whole_step:
        compile_kwargs["mode"] = "reduce-overhead"
    w = ddp.wrap(model, impl, bucket_size_mb=c.bucket_size_mb,
                 compute_dtype=None if ptdtype == torch.float32 else ptdtype, compile=c.compile,
                 compile_kwargs=compile_kwargs)
    # CUDA graphs per micro-step (reduce-overhead): the outputs of a replay live in the graph's memory until the
    # next replay, so every training forward starts a new step explicitly (its loss is added up before the next
    # forward), and the gradients get buffers of their own that every backward adds into (a gradient left as None
    # takes the replay's output tensor itself, which the next micro-batch's replay overwrites). Both kinds of
    # graphs: evaluation runs the model uncompiled rather than record a second set of graphs for inference
    step_begin = torch.compiler.cudagraph_mark_step_begin if c.cuda_graphs and not whole_step else lambda: None
    if c.cuda_graphs and not whole_step:
        for p in w.parameters():
            p.grad = torch.zeros_like(p)
    optimizer = w.make_optimizer(AdamW, decay_groups(c.weight_decay), zero1=c.zero1, lr=c.learning_rate,
                                 betas=(c.beta1, c.beta2), eps=c.eps, capturable=whole_step)
    start_iter = 0
    if ckpt is not None:
        w.load_state_dict(_clean_state_dict(ckpt["model"]))
        w.load_optimizer_state_dict(optimizer, ckpt["optimizer"])
        _set_rng_state(ckpt["rng"], dev)
        start_iter = ckpt["iteration"]
        log(f"resumed from {ckpt_path} at iteration {start_iter}")
    del ckpt

    # fixed validation batches: the same ones at every evaluation; rank r takes every world_size-th one, and every
    # rank runs the same number of forwards (FSDP needs all ranks in each all-gather; extras count zero tokens)
    val_batches = []
    for i in range(rank, -(-c.eval_iters // world_size) * world_size, world_size):
        b = make_batch(val_tokens, val_docs, c, batch_generator(c.seed, -1 - (i % c.eval_iters), 0), dev,
                       meta["eot_id"])
        val_batches.append(b if i < c.eval_iters else b[:4] + (0,))
    if master and c.init_from != "resume":
        open(log_path, "w").close()  # claim_out_dir made sure no earlier run's log is here
        counts = np.bincount(np.asarray(train_tokens), minlength=vocab_size).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        log(f"data: {len(train_tokens):,} train / {len(val_tokens):,} val tokens, vocab_size {vocab_size}; "
            f"unigram entropy {-(p * np.log(p)).sum():.3f} nats/token (the loss of a model that ignores context)")
    lr_decay_iters = c.lr_decay_iters or c.max_iters
    local_accum = c.grad_accum // world_size
    peak = c.peak_flops or gpu_peak_flops(dev)
    max_norm = c.grad_clip if c.grad_clip > 0 else float("inf")

    # the loop: SIGINT / SIGTERM end it after the step in progress, with a checkpoint of that step
    stops, stopped = StopSignals(world_size), None
    t_start = time.time()
    t_last, it_last, tokens_since = t_start, start_iter, 0
    saved_at = start_iter if c.init_from == "resume" else None
    # fp64: every micro-batch loss enters the sum exactly, so the logged loss does not depend on how many ranks
    # computed the micro-batches (two ranks or one: bit for bit)
    loss_sum = torch.zeros((), dtype=torch.float64, device=dev)

    def optimizer_step(batches):
        """The GPU work of one optimizer step over this rank's micro-batches; returns the gradient norm."""
        for j, (x, y, cu_seqlens, max_seqlen) in enumerate(batches):
            step_begin()
            with w.no_sync() if j < local_accum - 1 else contextlib.nullcontext():
                with autocast:  # targets given: the mean loss through the fused head, never the full logits
                    loss = (w(x, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, targets=y) if cu_seqlens is not None
                            else w(x, targets=y))
                (loss / local_accum).backward()  # the wrappers average over ranks: 1/grad_accum overall
            loss_sum.add_(loss.detach())
        w.finish()
        grad_norm = w.clip_grad_norm(max_norm)
        optimizer.step()
        return grad_norm

    # whole_step: the step reads its micro-batches from fixed buffers, which every step fills first; two eager steps,
    # then the step is captured and replayed (whole_step_graph)
    run_whole_step, batch_buffers = None, None
    w.train()
    try:
        for it in range(start_iter, c.max_iters):
            stop = stops.requested()
            if stop:  # `it` steps are complete: keep them
                if saved_at != it:
                    save_run(ckpt_path, w, optimizer, it, model_args, c, data_dir, meta, dev, world_size)
                stopped = (stop, it)
                break
            if it % c.eval_interval == 0 and not (it == start_iter and c.init_from == "resume"):
                # evaluation time is not training time
                t_last += evaluate_and_log(w, val_batches, autocast, it, dev, log_path, time.time() - t_start,
                                           master, log, eager=c.cuda_graphs)

            lr = get_lr_cosine_schedule(it, c.learning_rate, c.min_lr, c.warmup_iters, lr_decay_iters)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batches = []
            for j in range(local_accum):
                generator = batch_generator(c.seed, it, rank * local_accum + j)
                *batch, n_real = make_batch(train_tokens, train_docs, c, generator, dev, meta["eot_id"])
                batches.append(batch)
                tokens_since += n_real
            if whole_step:
                if run_whole_step is None:
                    batch_buffers = [(x.clone(), y.clone(), None, None) for x, y, _, _ in batches]
                    run_whole_step = whole_step_graph(lambda: optimizer_step(batch_buffers), optimizer, dev)
                for (bx, by, _, _), (x, y, _, _) in zip(batch_buffers, batches):
                    bx.copy_(x)
                    by.copy_(y)
                grad_norm = run_whole_step()
            else:
                grad_norm = optimizer_step(batches)
                optimizer.zero_grad(set_to_none=not c.cuda_graphs)

            step = it + 1
            if step % c.log_interval == 0 or step == c.max_iters:
                # the loss of the whole global batch: every rank's micro-batch losses, summed in one all-reduce
                totals = torch.stack([loss_sum, torch.tensor(float(tokens_since), dtype=torch.float64, device=dev)])
                if world_size > 1:
                    torch.distributed.all_reduce(totals)
                loss_total, tokens = totals.tolist()
                train_loss = loss_total / c.grad_accum / (step - it_last)
                now = time.time()
                dt = (now - t_last) / (step - it_last)
                tok_s = tokens / (now - t_last)
                mfu = flops_tok * tok_s / (peak * world_size) if peak else None
                record = {"step": step, "loss": train_loss, "lr": lr, "grad_norm": float(grad_norm),
                          "tokens_per_s": tok_s, "mfu": mfu, "ms_per_step": 1000 * dt, "time_s": now - t_start}
                eta = dt * (c.max_iters - step)
                log(f"step {step}/{c.max_iters}: loss {train_loss:.4f}, lr {lr:.2e}, "
                    f"grad norm {float(grad_norm):.3f}, {tok_s:,.0f} tok/s, "
                    + (f"MFU {100 * mfu:.1f}%, " if mfu is not None else "")
                    + f"{1000 * dt:.1f} ms/step, ETA {eta / 60:.1f} min")
                if master:
                    with open(log_path, "a") as f:
                        f.write(json.dumps(record) + "\n")
                t_last, it_last, tokens_since = now, step, 0
                loss_sum.zero_()
            if step == c.max_iters:
                evaluate_and_log(w, val_batches, autocast, step, dev, log_path, time.time() - t_start, master,
                                 log, eager=c.cuda_graphs)
            if step % c.save_interval == 0 or step == c.max_iters:
                save_run(ckpt_path, w, optimizer, step, model_args, c, data_dir, meta, dev, world_size)
                saved_at = step
                log(f"saved {ckpt_path} at step {step}")
        else:
            log(f"done: {c.max_iters - start_iter} steps in {(time.time() - t_start) / 60:.1f} min")
    finally:
        stops.restore()
    if stopped is not None:
        launcher = (f"torchrun --standalone --nproc_per_node={world_size} train.py" if world_size > 1
                    else "python train.py")
        log(f"stopped by {signal.Signals(stopped[0]).name} after step {stopped[1]}: checkpoint in {ckpt_path}; "
            f"continue with `{launcher} --out_dir={c.out_dir} --init_from=resume`")
        return 128 + stopped[0]
    return 0


def decay_groups(weight_decay):
    """Parameter groups for AdamW: weight decay on the matrices, none on the RMSNorm gains (ln1, ln2, ln_final)."""
    def groups(named_parameters):
        decay, no_decay = [], []
        for name, p in named_parameters:
            (no_decay if any(part.startswith("ln") for part in name.split(".")) else decay).append(p)
        return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return groups


def cli(argv):
    """main() for the command line: a ConfigError becomes one line on stderr and status 2 (argparse's convention),
    a Ctrl-C before the training loop (nothing to save yet) one line and status 130; printed by rank 0 only."""
    quiet = os.environ.get("RANK", "0") != "0"
    try:
        return main(argv)
    except ConfigError as e:
        if not quiet:
            print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if not quiet:
            print("train.py: interrupted before training started; nothing was saved", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
