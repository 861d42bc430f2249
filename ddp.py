"""Data parallelism from scratch: four DDP wrappers, ZeRO-1 optimizer sharding and FSDP (ZeRO-3), and wrap(), the
one factory train.py and bench.py build every data-parallel setup with.

Launch one process per GPU with torchrun; init_distributed() reads its environment:

    rank, local_rank, world_size, device = init_distributed()
    w = wrap(TransformerLM(...).to(device), "bucketed")             # or naive, flat, overlap, fsdp, torch, ...
    optimizer = w.make_optimizer(AdamW, zero1=True, lr=3e-4)        # ZeRO-1 (ShardedOptimizer), or plain
    for micro in range(grad_accum):                                 # gradient accumulation
        with w.no_sync() if micro < grad_accum - 1 else contextlib.nullcontext():
            cross_entropy(w(x), y).backward()
    w.finish()                                                      # gradients now averaged over ranks
    w.clip_grad_norm(1.0)
    optimizer.step()
    cleanup_distributed()

The wrapper classes (DDPNaive, DDPFlat, DDPIndividualParameters, DDPBucketed, ShardedOptimizer, FSDP) can also be
used alone. Every wrapper broadcasts rank 0's parameters and buffers when it wraps, so all replicas start
identical, and averages gradients (NCCL's AVG; SUM then / N on gloo). Collectives must be issued identically on
every rank: the wrappers only rely on every rank running the same model code.
"""
import contextlib
import inspect
import os
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

# newer torch renamed the single-tensor collectives (same signatures); older builds have only the old names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---------------------------------------------------------------------------------------------------------------
# process group
# ---------------------------------------------------------------------------------------------------------------

def init_distributed():
    """(rank, local_rank, world_size, device) from torchrun's RANK / LOCAL_RANK / WORLD_SIZE: NCCL with one GPU per
    process on CUDA, gloo on CPU. Without those variables: one process and no process group. NCCL settings in the
    environment (e.g. NCCL_NVLS_ENABLE=0) are left as they are."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("gloo")
    return rank, local_rank, world_size, device


def cleanup_distributed():
    """Barrier, then tear the process group down (nothing to do without one)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _rank_and_world():
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: launch with torchrun and call init_distributed()")
    return dist.get_rank(), dist.get_world_size()


def _avg_op():
    """NCCL averages inside the collective; gloo sums and the caller divides by N."""
    return dist.ReduceOp.AVG if dist.get_backend() == "nccl" else dist.ReduceOp.SUM


def _finish_average(t, world_size):
    if dist.get_backend() != "nccl":
        t.div_(world_size)


def _broadcast_from_rank0(module):
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=0)


# ---------------------------------------------------------------------------------------------------------------
# DDP, four ways
# ---------------------------------------------------------------------------------------------------------------


def weak_hook(method):
    """A gradient hook that holds its wrapper weakly. Tensor hooks live in C++, where Python's cycle collector cannot
    see them: a strong reference (parameter -> hook -> wrapper -> module -> parameter) would keep a dropped wrapper,
    its model and its gradient buffers alive for good."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        if bound is not None:
            bound(*args)
    return hook

class _DataParallel(nn.Module):
    """What all four DDP wrappers share: .module, forward passthrough, the rank-0 broadcast at wrap time, no_sync().
    Parameters are taken once from module.parameters(), so tied weights count once; frozen ones are skipped."""

    def __init__(self, module):
        super().__init__()
        self.rank, self.world_size = _rank_and_world()
        self.module = module
        self.require_sync = True  # False inside no_sync(): hooks stay quiet, gradients accumulate locally
        _broadcast_from_rank0(module)
        self.params = [p for p in module.parameters() if p.requires_grad]

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside communicate nothing (and
        finish_gradient_synchronization() is a no-op there); the next synchronized backward sends the sum."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous


class DDPNaive(_DataParallel):
    """After backward: one all-reduce per parameter gradient. No overlap with backward."""

    def finish_gradient_synchronization(self):
        if not self.require_sync:
            return
        for p in self.params:
            if p.grad is not None:
                dist.all_reduce(p.grad, op=_avg_op())
                _finish_average(p.grad, self.world_size)


class DDPFlat(_DataParallel):
    """After backward: all gradients flattened into one buffer per dtype, one all-reduce each, copied back
    One call instead of hundreds, plus a temporary buffer as large as the gradients."""

    def finish_gradient_synchronization(self):
        if not self.require_sync:
            return
        _all_reduce_flat([p.grad for p in self.params if p.grad is not None], self.world_size)


class DDPIndividualParameters(_DataParallel):
    """Overlap per parameter: a post-accumulate-grad hook starts an async all-reduce of each gradient
    the moment autograd has finished accumulating it (tied weights: once, after both uses), so communication runs
    while backward continues. A parameter without gradient this step fires no hook; that must hold on every rank.
    A gradient accumulated under no_sync() whose parameter the last backward did not reach is all-reduced in
    finish_gradient_synchronization()."""

    def __init__(self, module):
        super().__init__(module)
        self.pending = {}  # parameter -> its all-reduce in flight, in launch order
        for p in self.params:
            p.register_post_accumulate_grad_hook(weak_hook(self._hook))

    def _hook(self, p):
        if self.require_sync:
            self.pending[p] = dist.all_reduce(p.grad, op=_avg_op(), async_op=True)

    def finish_gradient_synchronization(self):
        if not self.require_sync:
            return
        for p, work in self.pending.items():
            work.wait()
            _finish_average(p.grad, self.world_size)
        for p in self.params:
            if p.grad is not None and p not in self.pending:
                dist.all_reduce(p.grad, op=_avg_op())
                _finish_average(p.grad, self.world_size)
        self.pending.clear()


class _Bucket:
    """Parameters sharing one flat gradient buffer; p.grad is a view into it after the first backward."""

    def __init__(self, params):
        self.params = params
        numel = sum(p.numel() for p in params)
        # one extra slot per parameter: a "had a gradient" flag all-reduced with the gradients (see finish)
        self.buffer = torch.zeros(numel + len(params), dtype=params[0].dtype, device=params[0].device)
        self.views, offset = [], 0
        for p in params:
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.flags = self.buffer[numel:]
        self.ready = [False] * len(params)
        self.num_ready = 0
        self.work = None


class DDPBucketed(_DataParallel):
    """Overlap per bucket. Parameters go into buckets of at most bucket_size_mb MiB in reverse
    registration order (about the order backward produces them; a larger parameter gets a bucket of its own).
    Each bucket owns one flat buffer and every p.grad becomes a view into it, so the all-reduce needs no
    flatten/unflatten copies; a bucket's async all-reduce starts as soon as its last gradient is ready.

    Buckets are launched strictly in index order (a ready bucket waits for the ones before it), and
    finish_gradient_synchronization() launches the rest in the same order, so every rank issues identical
    collectives even when a parameter is unused on some ranks. Missing gradients count as zeros; a parameter
    unused on every rank keeps grad None, as in single-process training (the flag slots tell)."""

    def __init__(self, module, bucket_size_mb):
        super().__init__(module)
        if bucket_size_mb <= 0:
            raise ValueError(f"bucket_size_mb={bucket_size_mb} must be > 0")
        limit = bucket_size_mb * 2**20
        self.buckets, current, size = [], [], 0
        for p in reversed(self.params):
            nbytes = p.numel() * p.element_size()
            if current and (size + nbytes > limit or p.dtype != current[0].dtype or p.device != current[0].device):
                self.buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self.buckets.append(_Bucket(current))
        self.next_bucket = 0  # index of the first bucket not launched yet in this step
        hook = weak_hook(self._hook)
        for b, bucket in enumerate(self.buckets):
            for j, p in enumerate(bucket.params):
                p.register_post_accumulate_grad_hook(lambda p, b=b, j=j: hook(b, j))

    @staticmethod
    def _grad_into_view(bucket, j):
        """Point p.grad at its slot of the bucket buffer. After zero_grad(set_to_none=True) autograd hands us a
        fresh tensor: one copy into the slot; with set_to_none=False it accumulated into the view already."""
        p, view = bucket.params[j], bucket.views[j]
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        p.grad = view

    def _hook(self, b, j):
        if not self.require_sync:
            return
        bucket = self.buckets[b]
        if bucket.ready[j]:
            raise RuntimeError("a gradient became ready twice before finish_gradient_synchronization(): run all "
                               "but the last backward of an accumulation inside no_sync()")
        self._grad_into_view(bucket, j)
        bucket.ready[j] = True
        bucket.num_ready += 1
        while self.next_bucket < len(self.buckets):
            nxt = self.buckets[self.next_bucket]
            if nxt.num_ready < len(nxt.params):
                break
            self._launch(nxt)
            self.next_bucket += 1

    @staticmethod
    def _launch(bucket):
        bucket.flags.fill_(1.0)
        for j, ready in enumerate(bucket.ready):
            if not ready:
                bucket.flags[j] = 0.0
        bucket.work = dist.all_reduce(bucket.buffer, op=_avg_op(), async_op=True)

    def finish_gradient_synchronization(self):
        if not self.require_sync:
            return
        for bucket in self.buckets[self.next_bucket:]:  # incomplete on this rank: missing gradients are zeros
            for j, p in enumerate(bucket.params):
                if not bucket.ready[j]:
                    if p.grad is not None:  # accumulated under no_sync(), unused in this last backward
                        bucket.ready[j] = True
                        bucket.num_ready += 1
                    self._grad_into_view(bucket, j)
            self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            _finish_average(bucket.buffer, self.world_size)
            if bucket.num_ready < len(bucket.params):
                # rare path (unused parameters): one host read of the flags tells which were used anywhere
                used = bucket.flags.tolist()
                for j, p in enumerate(bucket.params):
                    p.grad = bucket.views[j] if bucket.ready[j] or used[j] > 0 else None
            bucket.ready = [False] * len(bucket.params)
            bucket.num_ready = 0
            bucket.work = None
        self.next_bucket = 0


def DDP(module, bucket_size_mb=None):
    """The public entry: per-parameter overlap when bucket_size_mb is None, else bucketed overlap."""
    if bucket_size_mb is None:
        return DDPIndividualParameters(module)
    return DDPBucketed(module, bucket_size_mb)


# ---------------------------------------------------------------------------------------------------------------
# ZeRO-1: optimizer-state sharding
# ---------------------------------------------------------------------------------------------------------------

class ShardedOptimizer(torch.optim.Optimizer):
    """Each rank owns about 1/N of the parameter elements (greedy by size, largest first, to the rank with the
    fewest so far: identical on every rank), keeps optimizer state only for those and steps only them with an
    inner optimizer_cls. Gradients must already be averaged (a DDP wrapper does that).

    After the inner step the updated parameters are synchronized with one in-place all-gather per parameter group
    and dtype: when a group is added its parameters move into a flat buffer laid out as N equal segments (segment
    r holds rank r's parameters, padded to the longest), and p.data becomes a view into it, so the all-gather
    needs no copies. (Broadcasts from each owner would also do; the all-gather uses every link at once instead of
    one owner at a time.)"""

    def __init__(self, params, optimizer_cls, **kwargs):
        self.rank, self.world_size = _rank_and_world()
        self.optimizer_cls, self.inner_kwargs = optimizer_cls, kwargs
        self.optimizer = None        # the inner optimizer over this rank's parameters (None while it owns none)
        self.inner_index = []        # per wrapper group: index of its inner group, None if this rank owns none
        self.owner = {}              # parameter -> owning rank
        self.owned_numel = [0] * self.world_size
        self.flat_buffers = []       # (buffer, segment length) per group and dtype, all-gathered after step
        # the inner class's full defaults (betas, eps, ...) so the wrapper's groups and state_dict() look exactly
        # like an unsharded optimizer's; learned from a throwaway instance on a one-element probe
        params = list(params)
        first = params[0]["params"][0] if isinstance(params[0], dict) else params[0]
        probe = torch.zeros(1, dtype=first.dtype, device=first.device, requires_grad=True)
        super().__init__(params, optimizer_cls([probe], **kwargs).defaults)  # calls add_param_group per group

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        params = group["params"]
        for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
            r = min(range(self.world_size), key=lambda r: (self.owned_numel[r], r))
            self.owner[params[i]] = r
            self.owned_numel[r] += params[i].numel()
        self._flatten(params)
        owned = [p for p in params if self.owner[p] == self.rank]
        if not owned:
            self.inner_index.append(None)
            return
        inner = dict(params=owned, **{k: v for k, v in group.items() if k != "params"})
        if self.optimizer is None:
            self.optimizer = self.optimizer_cls([inner], **self.inner_kwargs)
        else:
            self.optimizer.add_param_group(inner)
        self.inner_index.append(len(self.optimizer.param_groups) - 1)

    @torch.no_grad()
    def _flatten(self, params):
        for key in dict.fromkeys((p.dtype, p.device) for p in params):
            same = [p for p in params if (p.dtype, p.device) == key]
            segments = [[p for p in same if self.owner[p] == r] for r in range(self.world_size)]
            seg_len = max(sum(p.numel() for p in seg) for seg in segments)
            buffer = torch.zeros(self.world_size * seg_len, dtype=key[0], device=key[1])
            for r, seg in enumerate(segments):
                offset = r * seg_len
                for p in seg:
                    view = buffer[offset:offset + p.numel()].view_as(p)
                    view.copy_(p.data)
                    p.data = view
                    offset += p.numel()
            self.flat_buffers.append((buffer, seg_len))

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # the schedule writes the wrapper's groups; the inner groups follow
        for group, k in zip(self.param_groups, self.inner_index):
            if k is not None:
                self.optimizer.param_groups[k].update({key: v for key, v in group.items() if key != "params"})
        if self.optimizer is not None:
            self.optimizer.step(**kwargs)
        for buffer, seg_len in self.flat_buffers:
            _all_gather(buffer, buffer[self.rank * seg_len:(self.rank + 1) * seg_len])
        return loss

    def _all_params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self):
        """The consolidated state in torch.optim's format (parameters numbered across the wrapper's groups) on
        every rank, tensors on CPU. Call on all ranks: each owner broadcasts its parameters' state."""
        params = self._all_params()
        index = {p: i for i, p in enumerate(params)}
        local = self.optimizer.state if self.optimizer is not None else {}
        device = self.flat_buffers[0][0].device if dist.get_backend() == "nccl" else torch.device("cpu")
        state = {}
        for r in range(self.world_size):
            # per owner: metadata first (parameter indices, tensor shapes and dtypes, plain values), then tensors
            meta = [None]
            if r == self.rank:
                meta[0] = {index[p]: ({k: (v.shape, v.dtype) for k, v in s.items() if torch.is_tensor(v)},
                                      {k: v for k, v in s.items() if not torch.is_tensor(v)})
                           for p, s in local.items()}
            dist.broadcast_object_list(meta, src=r)
            for i in sorted(meta[0]):
                tensors, values = meta[0][i]
                entry = dict(values)
                for k, (shape, dtype) in tensors.items():
                    if r == self.rank:
                        t = local[params[i]][k].to(device)
                    else:
                        t = torch.empty(shape, dtype=dtype, device=device)
                    dist.broadcast(t, src=r)
                    entry[k] = t.to("cpu", copy=True)  # a snapshot, never the live state tensor
                state[i] = entry
        groups, start = [], 0
        for group in self.param_groups:
            n = len(group["params"])
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({**hyper, "params": list(range(start, start + n))})
            start += n
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Load a consolidated state (from state_dict() or a checkpoint); each rank keeps its own parameters'."""
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("state dict and optimizer disagree on the parameter groups or their sizes")
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        if self.optimizer is None:
            return
        params = self._all_params()
        inner_params = [p for g in self.optimizer.param_groups for p in g["params"]]
        position = {p: j for j, p in enumerate(inner_params)}
        inner_state = {position[params[int(i)]]: s for i, s in state_dict["state"].items()
                       if params[int(i)] in position}
        inner_groups = []
        for group, k_inner in zip(self.param_groups, self.inner_index):
            if k_inner is not None:
                inner = self.optimizer.param_groups[k_inner]  # keeps the inner optimizer's own extra keys
                inner_groups.append({**{k: v for k, v in inner.items() if k != "params"},
                                     **{k: v for k, v in group.items() if k != "params"},
                                     "params": [position[p] for p in inner["params"]]})
        self.optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})


# ---------------------------------------------------------------------------------------------------------------
# FSDP / ZeRO-3
# ---------------------------------------------------------------------------------------------------------------

class _ShardedLayer:
    """One Linear or Embedding under FSDP. Its weight (rows, cols) is zero-padded to N * rows_per_rank rows and
    rank r keeps rows [r * rows_per_rank, (r + 1) * rows_per_rank) as the fp32 nn.Parameter `shard` (a row block is
    a slice of the flattened weight, so this is flat sharding; it stays 2-D for weight-decay rules)."""

    def __init__(self, shard, rows, cols, is_embedding):
        self.shard, self.rows, self.cols = shard, rows, cols
        self.rows_per_rank = shard.shape[0]
        self.is_embedding = is_embedding


class _FSDPLinear(torch.autograd.Function):
    """y = x W^T with W all-gathered for this call only: saves x (in the matmul dtype), never the full W, and
    gathers W again in backward.

    Each product is the very call that model.Linear makes on the unsharded weight, so a sharded step does the same
    floating-point arithmetic as a single-process one: matmul folds x to 2-D (x2 = x.reshape(-1, in)) and runs
    mm(x2, W^T); the backward of that mm gives grad_x2 = mm(g2, W) and, W^T being a column-major view, the weight
    gradient as mm(g2^T, x2) (never as the transpose of x2^T g2, which sums in another order), written in the
    master weights' dtype under autocast (model.weight_grad)."""

    @staticmethod
    def forward(ctx, x, shard, fsdp, i):
        w = fsdp._before_forward(i)
        dtype = fsdp._matmul_dtype(x, w)
        x2 = x.to(dtype).reshape(-1, x.shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            y = x2.mm(w.to(dtype).t())
        ctx.save_for_backward(x2)
        ctx.fsdp, ctx.i, ctx.x_dtype, ctx.x_shape = fsdp, i, x.dtype, x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        (x2,) = ctx.saved_tensors
        fsdp, i = ctx.fsdp, ctx.i
        fsdp._before_backward(i)
        g2 = grad_y.to(x2.dtype).reshape(-1, grad_y.shape[-1])
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = g2.mm(fsdp._full_weight(i).to(x2.dtype)).to(ctx.x_dtype).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:  # in the shard's dtype, as model.Linear writes it (model.weight_grad)
            from model import weight_grad
            fsdp._reduce_scatter(i, weight_grad(g2, x2, fsdp.layers[i].shard.dtype))
        return grad_x, None, None, None


class _FSDPLinearCrossEntropy(torch.autograd.Function):
    """model.linear_cross_entropy(x, W, targets) with W all-gathered for this call only: the fused head computes
    the loss and both gradients in its forward (model.fused_head), so backward needs no second gather; the weight
    gradient (fp32) is scaled by the incoming gradient and reduce-scattered like a Linear's."""

    @staticmethod
    def forward(ctx, x, targets, shard, fsdp, i, ignore_index, need_grad):
        import model
        w = fsdp._before_forward(i)
        dtype = model.head_dtype(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            loss, dx, dw = model.fused_head(x2.to(dtype), w.to(dtype), targets.reshape(-1).contiguous(),
                                            ignore_index, model.head_chunk(w.shape[0]), need_grad)
        ctx.save_for_backward(dx, dw)
        ctx.fsdp, ctx.i, ctx.x_dtype, ctx.x_shape = fsdp, i, x.dtype, x.shape
        return loss

    @staticmethod
    def backward(ctx, grad):
        dx, dw = ctx.saved_tensors
        ctx.fsdp._before_backward(ctx.i)
        if ctx.needs_input_grad[2]:
            ctx.fsdp._reduce_scatter(ctx.i, dw * grad)
        return (dx * grad).to(ctx.x_dtype).view(ctx.x_shape), None, None, None, None, None, None


class _FSDPEmbedding(torch.autograd.Function):
    """out = W[ids] with W all-gathered for this call only. Backward needs no W: the output gradient rows are
    accumulated into a dense zero buffer exactly as autograd does for `weight[ids]` (index_put_ with
    accumulate=True, which is also the deterministic path on GPUs), in fp32, then reduce-scattered."""

    @staticmethod
    def forward(ctx, ids, shard, fsdp, i):
        w = fsdp._before_forward(i)
        ctx.save_for_backward(ids)
        ctx.fsdp, ctx.i = fsdp, i
        return w[ids]

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        fsdp, i = ctx.fsdp, ctx.i
        fsdp._before_backward(i)
        if ctx.needs_input_grad[1]:
            layer = fsdp.layers[i]
            grad_w = grad_out.new_zeros((fsdp.world_size * layer.rows_per_rank, layer.cols), dtype=layer.shard.dtype)
            grad_w.index_put_((ids,), grad_out.to(grad_w.dtype), accumulate=True)  # bf16 rows summed in fp32
            fsdp._reduce_scatter(i, grad_w)
        return None, None, None, None


class FSDP(nn.Module):
    """Fully sharded data parallel (ZeRO-3) for any model built from model.py's Linear and Embedding.

    Every Linear and Embedding weight is sharded across ranks (tied weights once); everything else (the RMSNorm
    gains) is replicated and its gradients are averaged in finish_gradient_synchronization(). model.parameters()
    then holds the fp32 shards and the replicated parameters, so a plain optimizer (our AdamW) updates each rank's
    part: build the optimizer after wrapping. Each sharded layer's forward is replaced by an autograd Function that
    all-gathers the weight (cast to compute_dtype first, halving the bytes), uses it, and frees it.

    Prefetch: the execution order of the sharded layers is recorded in the first forward; afterwards the gather of
    the next layer is issued just before a layer's compute is queued, so it overlaps that compute, and at most
    two gathered weights exist (layer k's gather starts once layer k - 2 is done). Backward mirrors it in
    reverse (the first layer of backward is prefetched when forward returns, overlapping the loss); weight
    gradients are reduce-scattered asynchronously into fp32 shard gradients, at most two in flight.
    Under activation checkpointing the recomputed forward gathers on demand. Gradient accumulation works by
    running several backward passes (the shard gradients accumulate); there is no no_sync()."""

    def __init__(self, module, compute_dtype=None):
        super().__init__()
        from model import Embedding, Linear  # found by type, so any model built from them works
        self.rank, self.world_size = _rank_and_world()
        self.module, self.compute_dtype = module, compute_dtype
        _broadcast_from_rank0(module)
        self.layers, shards = [], {}  # shards: original weight -> its shard (a tied weight is sharded once)
        for m in list(module.modules()):
            if not isinstance(m, (Linear, Embedding)):
                continue
            w = m.weight
            if w not in shards:
                shards[w] = self._make_shard(w)
            m.weight = shards[w]
            i = len(self.layers)
            self.layers.append(_ShardedLayer(shards[w], w.shape[0], w.shape[1], isinstance(m, Embedding)))
            fn = _FSDPEmbedding if isinstance(m, Embedding) else _FSDPLinear
            m.forward = lambda x, fn=fn, i=i: fn.apply(x, self.layers[i].shard, self, i)
            if isinstance(m, Linear):  # the fused LM head (model.Linear.cross_entropy) on the gathered weight
                m.cross_entropy = lambda x, targets, ignore_index=-100, i=i: _FSDPLinearCrossEntropy.apply(
                    x, targets, self.layers[i].shard, self, i, ignore_index, torch.is_grad_enabled())
        self.shards = list(shards.values())
        self.replicated = [p for p in module.parameters() if not hasattr(p, "_fsdp_full_shape")]
        self._gathered = {}         # layer index -> (full weight buffer, all-gather work) in flight or done
        self._pending = []          # (reduce-scatter work, shard gradient, shard) not yet accumulated
        self._order, self._order_recorded = [], False
        self._fwd_pos, self._bwd_pos, self._in_backward = 0, -1, False

    def _make_shard(self, w):
        rows, cols = w.shape
        rows_per_rank = -(-rows // self.world_size)
        dtype = torch.promote_types(w.dtype, torch.float32)  # fp32 master weights (fp64 stays fp64 for tests)
        padded = torch.zeros((self.world_size * rows_per_rank, cols), dtype=dtype, device=w.device)
        padded[:rows] = w.detach()
        shard = nn.Parameter(padded[self.rank * rows_per_rank:(self.rank + 1) * rows_per_rank].clone(),
                             requires_grad=w.requires_grad)
        shard._fsdp_full_shape = (rows, cols)  # marks a shard for gather_full_params / load_full_params
        return shard

    def forward(self, *inputs, **kwargs):
        self._drop_gathered()  # gathered before an optimizer step they would be stale
        self._fwd_pos, self._bwd_pos, self._in_backward = 0, -1, False
        if self._order_recorded and self._order:
            self._gather(self._order[0])
        out = self.module(*inputs, **kwargs)
        self._order_recorded = True
        if torch.is_grad_enabled() and self._order and self._fwd_pos == len(self._order):
            self._bwd_pos = len(self._order) - 1
            self._prefetch_for_backward(self._bwd_pos)
        return out

    # -- gathers ---------------------------------------------------------------------------------------------------
    def _gather(self, i):
        """Start the async all-gather of layer i's full weight (in compute_dtype) unless it is already underway."""
        if i in self._gathered:
            return
        layer = self.layers[i]
        shard = layer.shard.detach()
        if self.compute_dtype is not None:
            shard = shard.to(self.compute_dtype)
        full = torch.empty((self.world_size * layer.rows_per_rank, layer.cols), dtype=shard.dtype,
                           device=shard.device)
        self._gathered[i] = (full, _all_gather(full, shard, async_op=True))

    def _full_weight(self, i):
        """Layer i's full weight, gathered now unless prefetched; the buffer is forgotten here, so it is freed as
        soon as the caller is done with it."""
        self._gather(i)
        full, work = self._gathered.pop(i)
        work.wait()
        return full[:self.layers[i].rows]

    def _drop_gathered(self):
        for full, work in self._gathered.values():
            work.wait()
        self._gathered.clear()

    def _before_forward(self, i):
        if not self._in_backward:
            pos = self._fwd_pos
            self._fwd_pos += 1
            if not self._order_recorded:
                self._order.append(i)
            elif pos + 1 < len(self._order) and self._order[pos] == i:
                self._gather(self._order[pos + 1])  # queued before this layer's compute: they overlap
        return self._full_weight(i)

    def _before_backward(self, i):
        self._in_backward = True
        pos = self._bwd_pos
        self._bwd_pos -= 1
        if 0 < pos < len(self._order) and self._order[pos] == i:
            self._prefetch_for_backward(pos - 1)

    def _prefetch_for_backward(self, pos):
        if not self.layers[self._order[pos]].is_embedding:  # an Embedding's backward needs no weight
            self._gather(self._order[pos])

    def _matmul_dtype(self, x, w):
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return w.dtype if self.compute_dtype is not None else torch.promote_types(x.dtype, w.dtype)

    # -- gradients -------------------------------------------------------------------------------------------------
    def _reduce_scatter(self, i, grad_w):
        """Reduce-scatter layer i's full weight gradient (fp32, zero-padded) into this rank's shard gradient."""
        layer = self.layers[i]
        padded_rows = self.world_size * layer.rows_per_rank
        if grad_w.shape[0] != padded_rows:
            full = grad_w.new_zeros((padded_rows, layer.cols), dtype=layer.shard.dtype)
            full[:layer.rows] = grad_w
            grad_w = full
        grad_w = grad_w.to(layer.shard.dtype)  # reduce in fp32, like the master weights (no-op when already)
        shard_grad = torch.empty_like(layer.shard)
        work = _reduce_scatter(shard_grad, grad_w, op=_avg_op(), async_op=True)
        self._pending.append((work, shard_grad, layer.shard))
        while len(self._pending) > 2:
            self._accumulate(*self._pending.pop(0))

    def _accumulate(self, work, shard_grad, shard):
        work.wait()
        _finish_average(shard_grad, self.world_size)
        if shard.grad is None:
            shard.grad = shard_grad
        else:
            shard.grad += shard_grad

    def finish_gradient_synchronization(self):
        """Wait for every reduce-scatter (shard .grad are then fp32, averaged, shaped like the shards), average
        the replicated parameters' gradients, release gathered buffers."""
        while self._pending:
            self._accumulate(*self._pending.pop(0))
        _all_reduce_flat([p.grad for p in self.replicated if p.grad is not None], self.world_size)
        self._drop_gathered()
        self._in_backward = False

    def clip_grad_norm(self, max_l2_norm):
        """Clip all gradients as one vector and return the global norm: shard squares summed over ranks,
        replicated ones counted once. Branch-free (no host sync): the scale is clamped to 1."""
        return clip_grad_norm(self.replicated, max_l2_norm, sharded=self.shards)


@torch.no_grad()
def clip_grad_norm(parameters, max_l2_norm, sharded=()):
    """Global L2 norm over the gradients of `parameters` (replicated: counted once) and of `sharded` (each rank
    holds a disjoint part: their squares are summed over ranks with one all-reduce); parameters without a
    gradient are skipped. If the norm exceeds max_l2_norm every gradient is scaled in place by
    max_l2_norm / (norm + 1e-6). Returns the norm before clipping as a 0-dim fp32 tensor, without a host sync
    (the scale is clamp(max / (norm + 1e-6), max=1): exactly 1 when not clipping)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    shard_grads = [p.grad for p in sharded if p.grad is not None]
    if not grads and not shard_grads and not sharded:
        return torch.zeros(())
    first = (grads or shard_grads or [next(iter(sharded))])[0].device

    def sum_of_squares(gs):
        by_device = {}
        for g in gs:
            by_device.setdefault(g.device, []).append(g)
        squares = [torch.stack(torch._foreach_norm(same)).float().square().sum().to(first)
                   for same in by_device.values()]
        return torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float32, device=first)

    total = sum_of_squares(grads)
    if sharded:  # every rank takes part, also one whose shards got no gradient
        shard_total = sum_of_squares(shard_grads)
        dist.all_reduce(shard_total)
        total = total + shard_total
    norm = total.sqrt()
    scale = (max_l2_norm / (norm + 1e-6)).clamp(max=1.0)
    by_key = {}
    for g in grads + shard_grads:
        by_key.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), gs in by_key.items():
        torch._foreach_mul_(gs, scale.to(device, dtype))
    return norm


def _all_reduce_flat(grads, world_size):
    """Average a list of gradients with one all-reduce per dtype over a flattened copy."""
    for dtype in dict.fromkeys(g.dtype for g in grads):
        same = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, op=_avg_op())
        _finish_average(flat, world_size)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def gather_full_params(model):
    """The full state dict of an FSDP-wrapped model (FSDP or its .module), keyed like the unwrapped model's own
    state_dict() (no "module." prefix; tied weights under both names): shards all-gathered in fp32, padding
    stripped, reshaped. Call on all ranks; every rank gets the dict (rank 0 saves it)."""
    module = model.module if isinstance(model, FSDP) else model
    _, world_size = _rank_and_world()
    out, full_by_shard = {}, {}
    with torch.no_grad():
        for name, t in module.state_dict(keep_vars=True).items():
            if not hasattr(t, "_fsdp_full_shape"):
                out[name] = t.detach().clone()
                continue
            if id(t) not in full_by_shard:
                rows, cols = t._fsdp_full_shape
                full = torch.empty((world_size * t.shape[0], cols), dtype=t.dtype, device=t.device)
                _all_gather(full, t.detach())
                full_by_shard[id(t)] = full[:rows].clone() if full.shape[0] != rows else full
            out[name] = full_by_shard[id(t)]
    return out


def load_full_params(model, state_dict):
    """Load a full (unsharded) state dict, e.g. from gather_full_params or a single-process checkpoint, into an
    FSDP-wrapped model: each rank copies its own rows into its shards. No communication."""
    module = model.module if isinstance(model, FSDP) else model
    rank, _ = _rank_and_world()
    own = module.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise ValueError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, t in own.items():
            src = state_dict[name]
            if hasattr(t, "_fsdp_full_shape"):
                if tuple(src.shape) != t._fsdp_full_shape:
                    raise ValueError(f"{name}: shape {tuple(src.shape)}, expected {t._fsdp_full_shape}")
                rows = src[rank * t.shape[0]:(rank + 1) * t.shape[0]]
                t.zero_()
                t[:rows.shape[0]] = rows
            else:
                t.copy_(src)


def gather_full_optimizer_state(model, optimizer):
    """The state dict of an optimizer over an FSDP-wrapped model's parameters, with every shard-shaped state
    tensor (AdamW's moments) all-gathered, padding stripped: the same format, numbering and shapes as the optimizer
    of the unwrapped model would have, so the checkpoint loads at any world size and under any wrapper. Tensors
    on CPU. Call on all ranks (every rank then holds the dict)."""
    _, world_size = _rank_and_world()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = optimizer.state_dict()
    state = {}
    with torch.no_grad():
        for i in sorted(saved["state"]):  # the same keys on every rank: every rank steps the same parameters
            p, entry = params[i], {}
            for k, v in saved["state"][i].items():
                if torch.is_tensor(v) and hasattr(p, "_fsdp_full_shape") and v.shape == p.shape:
                    rows, cols = p._fsdp_full_shape
                    full = torch.empty((world_size * v.shape[0], cols), dtype=v.dtype, device=v.device)
                    _all_gather(full, v.contiguous())
                    v = full[:rows]
                entry[k] = v.to("cpu", copy=True) if torch.is_tensor(v) else v
            state[i] = entry
    return {"state": state, "param_groups": saved["param_groups"]}


def load_full_optimizer_state(model, optimizer, state_dict):
    """Load a full optimizer state (gather_full_optimizer_state's, or a single-process optimizer's) into the
    optimizer of an FSDP-wrapped model: each rank keeps its own rows of every full-shaped state tensor."""
    rank, _ = _rank_and_world()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(params) != sum(len(g["params"]) for g in state_dict["param_groups"]):
        raise ValueError("optimizer state and optimizer disagree on the number of parameters")
    state = {}
    for i, saved in state_dict["state"].items():
        p, entry = params[int(i)], {}
        for k, v in saved.items():
            if torch.is_tensor(v) and hasattr(p, "_fsdp_full_shape") and tuple(v.shape) == p._fsdp_full_shape:
                rows = v[rank * p.shape[0]:(rank + 1) * p.shape[0]]
                own = v.new_zeros(p.shape)
                own[:rows.shape[0]] = rows
                v = own
            entry[k] = v
        state[i] = entry
    optimizer.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})


# ---------------------------------------------------------------------------------------------------------------
# one factory for every data-parallel setup (train.py and bench.py build through it)
# ---------------------------------------------------------------------------------------------------------------

IMPLS = ("none", "naive", "flat", "overlap", "bucketed", "fsdp", "torch", "torch_fsdp")
_SHARDED_IMPLS = ("fsdp", "torch_fsdp")


def wrap(model, impl, bucket_size_mb=25.0, compute_dtype=None, compile=False, compile_kwargs=None):
    """Wrap `model` (on its device already) for data parallelism and return a Parallel, the only object a
    training loop needs. impl:
      none        one process, no communication (the plain model)
      naive, flat, overlap, bucketed   DDPNaive, DDPFlat, DDPIndividualParameters, DDPBucketed(bucket_size_mb)
      fsdp        FSDP(compute_dtype): weights all-gathered in compute_dtype (None: their own fp32)
      torch       torch.nn.parallel.DistributedDataParallel
      torch_fsdp  FSDP2: fully_shard per block of model.layers and around the whole model, params cast to
                  compute_dtype (None: fp32), gradients reduced in fp32
    compile=True applies torch.compile(**compile_kwargs): inside our DDP wrappers and torch's DDP (their hooks stay
    eager), around the FSDP variants (the gathers are part of the compiled forward)."""
    return Parallel(model, impl, bucket_size_mb, compute_dtype, compile, compile_kwargs or {})


class Parallel:
    """A model under one data-parallel impl (see wrap) with the operations a training loop needs, the same for
    every impl:

        w = ddp.wrap(model, "bucketed")
        optimizer = w.make_optimizer(AdamW, param_groups, zero1=True, lr=3e-4)   # over the right parameters
        for micro in range(grad_accum):
            with w.no_sync() if micro < grad_accum - 1 else contextlib.nullcontext():
                loss_fn(w(x), y).backward()
        w.finish()                           # gradients now averaged over ranks
        w.clip_grad_norm(1.0)                # the global norm
        optimizer.step()
        sd, osd = w.state_dict(), w.optimizer_state_dict(optimizer)   # full, unsharded (collective: all ranks)

    .module is the unwrapped model (its parameters are the shards under the FSDP variants), .model what is called.
    State dicts are in the unwrapped model's and a plain torch.optim optimizer's format under every impl
    (torch_fsdp: the complete dicts on rank 0), so a checkpoint of one impl and world size loads into any other."""

    def __init__(self, model, impl, bucket_size_mb=25.0, compute_dtype=None, compile=False, compile_kwargs=None):
        if impl not in IMPLS:
            raise ValueError(f"unknown data-parallel impl {impl!r}; expected one of {IMPLS}")
        self.impl, self.module = impl, model
        self.rank, self.world_size = (0, 1) if impl == "none" else _rank_and_world()
        inner = torch.compile(model, **(compile_kwargs or {})) if compile and impl not in _SHARDED_IMPLS else model
        if impl == "none":
            wrapped = inner
        elif impl == "naive":
            wrapped = DDPNaive(inner)
        elif impl == "flat":
            wrapped = DDPFlat(inner)
        elif impl == "overlap":
            wrapped = DDPIndividualParameters(inner)
        elif impl == "bucketed":
            wrapped = DDPBucketed(inner, bucket_size_mb)
        elif impl == "fsdp":
            wrapped = FSDP(model, compute_dtype=compute_dtype)
        elif impl == "torch":
            device = next(model.parameters()).device
            ddp_cls = nn.parallel.DistributedDataParallel
            # no buffer broadcast before every forward (the RoPE tables are equal everywhere); newer torch names it
            no_resync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(ddp_cls).parameters
                         else "broadcast_buffers")
            wrapped = ddp_cls(inner, device_ids=[device.index] if device.type == "cuda" else None,
                              **{no_resync: False})
        else:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            _broadcast_from_rank0(model)  # fully_shard keeps each rank's own values: start them all from rank 0's
            policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
            for block in model.layers:
                fully_shard(block, mp_policy=policy)
            wrapped = fully_shard(model, mp_policy=policy)
        if compile and impl in _SHARDED_IMPLS:
            wrapped = torch.compile(wrapped, **(compile_kwargs or {}))
        self.model = wrapped

    def __call__(self, *inputs, **kwargs):
        return self.model(*inputs, **kwargs)

    def train(self, mode=True):
        self.model.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def named_parameters(self):
        """The trainable parameters under their unwrapped names (the shards under the FSDP variants): what the
        optimizer must hold."""
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def make_optimizer(self, optimizer_cls, param_groups=None, zero1=False, **kwargs):
        """optimizer_cls(groups, **kwargs) over the wrapped parameters; param_groups(named_parameters) -> groups
        (default: one group of all). zero1=True shards the optimizer state over ranks (ShardedOptimizer; a plain
        optimizer under impl none); the FSDP variants shard it already and refuse it."""
        groups = param_groups(self.named_parameters()) if param_groups is not None else self.parameters()
        if zero1 and self.impl in _SHARDED_IMPLS:
            raise ValueError(f"zero1 shards optimizer state on top of replicated DDP; impl {self.impl!r} shards "
                             f"it already")
        if zero1 and self.impl != "none":
            return ShardedOptimizer(groups, optimizer_cls, **kwargs)
        return optimizer_cls(groups, **kwargs)

    def no_sync(self):
        """Backward passes inside accumulate gradients locally, communicating nothing (our DDP wrappers and torch's
        DDP). The FSDP variants keep gradients sharded instead: every backward reduce-scatters, so this is a null
        context there, and under impl none."""
        if self.impl in _SHARDED_IMPLS or self.impl == "none":
            return contextlib.nullcontext()
        return self.model.no_sync()

    def finish(self):
        """Finish the gradient synchronization of the last backward (our wrappers; torch's finish inside
        backward)."""
        if self.impl in ("naive", "flat", "overlap", "bucketed", "fsdp"):
            self._ours().finish_gradient_synchronization()

    def _ours(self):
        """Our wrapper object (DDP* or FSDP) under torch.compile's OptimizedModule, else the called model."""
        return getattr(self.model, "_orig_mod", self.model) if self.impl == "fsdp" else self.model

    def clip_grad_norm(self, max_norm):
        """Clip to the global gradient norm (max_norm = inf: only measure it); returns the norm as a 0-dim tensor
        without a host sync. Under fsdp the shards' squares are summed over ranks."""
        if self.impl == "fsdp":
            return self._ours().clip_grad_norm(max_norm)
        if self.impl == "torch_fsdp":  # DTensor gradients: torch reduces the norm over the mesh
            return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)
        return clip_grad_norm(self.parameters(), max_norm)

    def state_dict(self):
        """The full model state dict, keyed like the unwrapped model's own. Collective under the FSDP variants
        (call on all ranks); under torch_fsdp only rank 0's is complete (CPU tensors)."""
        if self.impl == "fsdp":
            return gather_full_params(self.module)
        if self.impl == "torch_fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
            return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True,
                                                                              cpu_offload=True))
        return self.module.state_dict()

    def load_state_dict(self, state_dict):
        """Load a full model state dict (from state_dict() under any impl, or a single-process model) on every
        rank."""
        if self.impl == "fsdp":
            load_full_params(self.module, state_dict)
        elif self.impl == "torch_fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
            set_model_state_dict(self.module, state_dict, options=StateDictOptions(full_state_dict=True))
        else:
            self.module.load_state_dict(state_dict)

    def optimizer_state_dict(self, optimizer):
        """The optimizer's full state in torch.optim's format (parameters numbered across groups, in the
        unwrapped model's shapes): consolidated under ZeRO-1, gathered under the FSDP variants (collective then;
        under torch_fsdp only rank 0's is complete)."""
        if self.impl == "fsdp":
            return gather_full_optimizer_state(self.module, optimizer)
        if self.impl == "torch_fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
            by_name = get_optimizer_state_dict(self.module, optimizer,
                                               options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            return _numbered(by_name)
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer, state_dict):
        """Load optimizer_state_dict()'s format (from any impl and world size) on every rank."""
        if self.impl == "fsdp":
            load_full_optimizer_state(self.module, optimizer, state_dict)
        elif self.impl == "torch_fsdp" and not any(torch.is_tensor(v) and v.dim() > 0
                                                   for s in state_dict["state"].values() for v in s.values()):
            optimizer.load_state_dict(state_dict)  # nothing to shard (e.g. plain SGD), which torch's loader refuses
        elif self.impl == "torch_fsdp":
            from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                                 set_optimizer_state_dict)
            names = [n for g in get_optimizer_state_dict(self.module, optimizer)["param_groups"] for n in g["params"]]
            set_optimizer_state_dict(self.module, optimizer, _named(state_dict, names),
                                     options=StateDictOptions(full_state_dict=True))
        else:
            optimizer.load_state_dict(state_dict)


def _numbered(by_name):
    """torch.distributed.checkpoint's optimizer state (keyed by parameter name) in torch.optim's numbering: the
    parameters of all groups in order. Ranks without the full dict (torch_fsdp's other ranks) get {}."""
    if not by_name:
        return {}
    index, groups = {}, []
    for g in by_name["param_groups"]:
        groups.append({**g, "params": [index.setdefault(n, len(index)) for n in g["params"]]})
    return {"state": {index[n]: s for n, s in by_name["state"].items()}, "param_groups": groups}


def _named(numbered, names):
    """The reverse of _numbered, with the names of the optimizer's parameters in order."""
    if len(names) != sum(len(g["params"]) for g in numbered["param_groups"]):
        raise ValueError("optimizer state and optimizer disagree on the number of parameters")
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in numbered["param_groups"]]
    return {"state": {names[int(i)]: s for i, s in numbered["state"].items()}, "param_groups": groups}
