import os, sys, torch
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from pathlib import Path
_HERE = Path(__file__).resolve().parent
ROOT = _HERE.parent if _HERE.name == "tests_wip" else _HERE
sys.path.insert(0, str(ROOT))

import importlib.util
import io
import json
import math
import socket
import subprocess
import unittest

import numpy as np

import train
from model import TransformerLM, cross_entropy


# --- train.py ---

def _write_dataset(data_dir, vocab_size=97, n_docs=(120, 30), seed=0, dtype=np.uint16):
    """A tiny dataset in data/prepare.py's format: documents of random length whose tokens follow a learnable
    rule (next = 3*prev + 1 mod (V-1)), each ending with eot = V-1."""
    rng = np.random.default_rng(seed)
    os.makedirs(data_dir, exist_ok=True)
    eot = vocab_size - 1
    meta = {"dataset": os.path.basename(data_dir), "dtype": np.dtype(dtype).name, "vocab_size": vocab_size,
            "eot_id": eot, "special_tokens": ["<|endoftext|>"], "vocab": "vocab.json", "merges": "merges.txt"}
    for split, n in zip(("train", "val"), n_docs):
        docs, offsets = [], [0]
        for _ in range(n):
            length = int(rng.integers(2, 70))
            t = [int(rng.integers(0, eot))]
            while len(t) < length - 1:
                t.append((3 * t[-1] + 1) % eot)
            docs.append(np.array(t + [eot], dtype=dtype))
            offsets.append(offsets[-1] + len(docs[-1]))
        tokens = np.concatenate(docs)
        tokens.tofile(os.path.join(data_dir, f"{split}.bin"))
        np.save(os.path.join(data_dir, f"{split}_docs.npy"), np.array(offsets, dtype=np.int64))
        meta[f"{split}_tokens"], meta[f"{split}_docs"] = int(len(tokens)), n
    with open(os.path.join(data_dir, "meta.json"), "w") as f:
        json.dump(meta, f)
    with open(os.path.join(data_dir, "vocab.json"), "w") as f:
        json.dump({str(i): i for i in range(vocab_size)}, f)
    open(os.path.join(data_dir, "merges.txt"), "w").close()
    return meta


TINY = ["--d_model=32", "--num_layers=2", "--num_heads=2", "--d_ff=64", "--context_length=24", "--batch_size=4",
        "--learning_rate=1e-2", "--min_lr=1e-3", "--warmup_iters=2", "--eval_iters=2", "--device=cpu",
        "--attn_impl=naive"]


def _spec_adamw_step(params, grads, states, lr, betas, eps, wd):
    """SPEC §3.1 written plainly, one tensor at a time."""
    for p, g, s in zip(params, grads, states):
        s["t"] += 1
        s["m"] = betas[0] * s["m"] + (1 - betas[0]) * g
        s["v"] = betas[1] * s["v"] + (1 - betas[1]) * g * g
        alpha_t = lr * math.sqrt(1 - betas[1] ** s["t"]) / (1 - betas[0] ** s["t"])
        p -= alpha_t * s["m"] / (torch.sqrt(s["v"]) + eps)
        p -= lr * wd * p


def test_adamw_matches_spec_algorithm_per_tensor():
    torch.manual_seed(0)
    shapes = [(7, 5), (13,), (3, 4, 2)]
    ours = [torch.nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in shapes]
    ref = [p.detach().clone() for p in ours]
    betas, eps = (0.9, 0.95), 1e-8
    opt = train.AdamW([{"params": ours[:2], "weight_decay": 0.1}, {"params": ours[2:], "weight_decay": 0.0}],
                      lr=1e-2, betas=betas, eps=eps)
    states = [{"t": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)} for p in ref]
    for step in range(6):
        lr = 1e-2 * (0.5 + 0.1 * step)  # the schedule rewrites group["lr"] every step
        grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
        for g in opt.param_groups:
            g["lr"] = lr
        for p, g in zip(ours, grads):
            p.grad = g.clone()
        opt.step()
        _spec_adamw_step(ref[:2], grads[:2], states[:2], lr, betas, eps, 0.1)
        _spec_adamw_step(ref[2:], grads[2:], states[2:], lr, betas, eps, 0.0)
    for p, r, s in zip(ours, ref, states):
        torch.testing.assert_close(p.detach(), r, rtol=1e-12, atol=1e-12)
        assert opt.state[p]["step"] == s["t"] == 6
        torch.testing.assert_close(opt.state[p]["exp_avg"], s["m"], rtol=1e-12, atol=1e-12)


def test_adamw_close_to_torch_adamw():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.ReLU(), torch.nn.Linear(17, 3))
    model_ref = torch.nn.Sequential(torch.nn.Linear(9, 17), torch.nn.ReLU(), torch.nn.Linear(17, 3))
    model_ref.load_state_dict(model.state_dict())
    kw = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    opt, opt_ref = train.AdamW(model.parameters(), **kw), torch.optim.AdamW(model_ref.parameters(), **kw)
    for _ in range(20):
        x, y = torch.randn(11, 9), torch.randn(11, 3)
        for m, o in ((model, opt), (model_ref, opt_ref)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for p, r in zip(model.parameters(), model_ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-3, atol=5e-5)  # decay order differs at second order (SPEC §3.1 Δ)


def test_adamw_late_added_params_and_params_without_grad():
    torch.manual_seed(2)
    a, b, frozen = (torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3))
    opt = train.AdamW([a, frozen], lr=1e-2, weight_decay=0.1)
    frozen_before = frozen.detach().clone()
    for _ in range(3):
        a.grad = torch.randn(5, 3)
        opt.step()
    assert frozen not in opt.state and torch.equal(frozen, frozen_before)  # no grad: untouched, no state
    b_ref = torch.nn.Parameter(b.detach().clone())
    opt.add_param_group({"params": [b], "lr": 5e-3})
    opt_ref = train.AdamW([b_ref], lr=5e-3, weight_decay=0.1)
    for _ in range(2):
        g = torch.randn(5, 3)
        a.grad, b.grad, b_ref.grad = torch.randn(5, 3), g.clone(), g.clone()
        opt.step()
        opt_ref.step()
    assert opt.state[a]["step"] == 5 and opt.state[b]["step"] == 2  # t per parameter
    torch.testing.assert_close(b, b_ref, rtol=0, atol=0)


def test_adamw_low_precision_params_keep_fp32_state():
    torch.manual_seed(3)
    p32 = torch.nn.Parameter(torch.randn(64))
    p16 = torch.nn.Parameter(p32.detach().to(torch.bfloat16))
    o32, o16 = train.AdamW([p32], lr=1e-2), train.AdamW([p16], lr=1e-2)
    for _ in range(3):
        g = torch.randn(64)
        p32.grad, p16.grad = g.clone(), g.to(torch.bfloat16)
        o32.step()
        o16.step()
    assert p16.dtype == torch.bfloat16 and o16.state[p16]["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(p16.float(), p32.detach(), rtol=2e-2, atol=2e-2)


def test_lr_cosine_schedule_values():
    f = lambda it: train.get_lr_cosine_schedule(it, 1.0, 0.1, 10, 110)
    assert f(0) == 0.0 and abs(f(5) - 0.5) < 1e-12 and abs(f(10) - 1.0) < 1e-12
    assert abs(f(60) - (0.1 + 0.5 * 0.9)) < 1e-12  # halfway through the cosine
    assert abs(f(35) - (0.1 + 0.5 * (1 + math.cos(math.pi * 0.25)) * 0.9)) < 1e-12
    assert abs(f(110) - 0.1) < 1e-12 and f(111) == 0.1 and f(10 ** 6) == 0.1
    assert all(f(i) >= f(i + 1) for i in range(10, 120))


def test_clip_grad_norm_matches_torch_and_skips_missing_grads():
    torch.manual_seed(4)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in ((4, 3), (7,), (2, 2))]
    refs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for p, r in zip(ps[:2], refs[:2]):  # the last parameter has no gradient
        p.grad = torch.randn(p.shape) * 3
        r.grad = p.grad.clone()
    norm = train.clip_grad_norm(ps, 1.0)
    norm_ref = torch.nn.utils.clip_grad_norm_(refs, 1.0)
    torch.testing.assert_close(norm, norm_ref)
    for p, r in zip(ps[:2], refs[:2]):
        torch.testing.assert_close(p.grad, r.grad)
    assert ps[2].grad is None
    total = math.sqrt(sum(float(p.grad.square().sum()) for p in ps[:2]))
    assert abs(total - 1.0) < 1e-5  # lands at the limit (just under it in exact arithmetic)
    before = [p.grad.clone() for p in ps[:2]]
    assert abs(float(train.clip_grad_norm(ps, 10.0)) - total) < 1e-5  # below the limit: untouched
    assert all(torch.equal(p.grad, b) for p, b in zip(ps[:2], before))
    assert float(train.clip_grad_norm([torch.nn.Parameter(torch.ones(2))], 1.0)) == 0.0


def test_get_batch_bounds_dtypes_determinism(tmp_path):
    n = 1000
    np.arange(n, dtype=np.uint16).tofile(tmp_path / "x.bin")
    data = np.memmap(tmp_path / "x.bin", dtype=np.uint16, mode="r")
    x, y = train.get_batch(data, 64, 17, "cpu", torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (64, 17) and x.dtype == y.dtype == torch.int64 and x.device.type == "cpu"
    assert torch.equal(y, x + 1) and int(x.min()) >= 0 and int(y.max()) <= n - 1
    x2, _ = train.get_batch(data, 64, 17, "cpu", torch.Generator().manual_seed(0))
    x3, _ = train.get_batch(data, 64, 17, "cpu", torch.Generator().manual_seed(1))
    assert torch.equal(x, x2) and not torch.equal(x, x3)
    starts = set()  # every start in {0, ..., n - T - 1} occurs, nothing beyond
    g = torch.Generator().manual_seed(5)
    for _ in range(50):
        starts.update(train.get_batch(data[:30], 64, 17, "cpu", g)[0][:, 0].tolist())
    assert starts == set(range(30 - 17))
    try:
        train.get_batch(data[:17], 1, 17, "cpu")
        raise AssertionError("expected ValueError")
    except ValueError as e:
        assert "context_length" in str(e)


def _expect(exc, words, fn, *args):
    try:
        fn(*args)
    except exc as e:
        assert all(w in str(e) for w in words), f"{e!r} lacks {words}"
        return
    raise AssertionError(f"expected {exc.__name__} mentioning {words}")


def test_load_dataset_validates_and_names_the_prepare_command(tmp_path):
    d = tmp_path / "tiny"
    meta = _write_dataset(d)
    tokens, docs, m = train.load_dataset(d, "train")
    assert len(tokens) == meta["train_tokens"] and docs[-1] == len(tokens) and m["vocab_size"] == 97
    _expect(FileNotFoundError, ["python data/prepare.py nothere"], train.load_dataset, tmp_path / "nothere", "train")
    _expect(ValueError, ["split"], train.load_dataset, d, "test")
    good = (d / "train.bin").read_bytes()
    (d / "train.bin").write_bytes(good + b"\x00")  # odd byte count for uint16
    _expect(ValueError, ["not a multiple of 2"], train.load_dataset, d, "train")
    bad = np.frombuffer(good, dtype=np.uint16).copy()
    bad[3] = 500
    bad.tofile(d / "train.bin")
    _expect(ValueError, ["token id 500", "vocab_size 97"], train.load_dataset, d, "train")
    (d / "train.bin").write_bytes(good[:-2])
    _expect(ValueError, ["meta.json says"], train.load_dataset, d, "train")
    (d / "train.bin").write_bytes(good)
    np.save(d / "train_docs.npy", np.array([0, 5, 3, meta["train_tokens"]], dtype=np.int64))
    _expect(ValueError, ["document index"], train.load_dataset, d, "train")
    os.remove(d / "val_docs.npy")
    _expect(FileNotFoundError, ["val_docs.npy", "python data/prepare.py tiny"], train.load_dataset, d, "val")


def test_batching_strategies_cover_documents_and_never_cross_them(tmp_path):
    meta = _write_dataset(tmp_path / "d", n_docs=(200, 10))
    tokens, docs, _ = train.load_dataset(tmp_path / "d", "train")
    ctx, budget = 16, 100
    # the pieces of every document: it split into ctx-sized pieces from its start (pieces of 1 token dropped)
    partition = {(s, min(s + ctx, int(e))) for s, e in zip(docs[:-1], docs[1:]) for s in range(int(s), int(e), ctx)}
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(40):
        spans = train.sample_documents(docs, budget, ctx, g)
        real = sum(e - s - 1 for s, e in spans)
        assert budget <= real < budget + ctx  # the budget is met, overshoot below one piece
        assert all(sp in partition and sp[1] - sp[0] >= 2 for sp in spans)
        seen.update(spans)
        x, y = train.pad_batch(tokens, spans, ctx, meta["eot_id"])
        assert x.shape == y.shape == (len(spans), ctx) and x.dtype == y.dtype == torch.int64
        assert int((y != -100).sum()) == real
        for i, (s, e) in enumerate(spans):
            L = e - s
            assert x[i, :L].tolist() == tokens[s:e].tolist() and (x[i, L:] == meta["eot_id"]).all()
            assert y[i, :L - 1].tolist() == tokens[s + 1:e].tolist() and (y[i, L - 1:] == -100).all()
        xd, yd = train.pad_batch(tokens, spans, max(e - s for s, e in spans), meta["eot_id"])
        assert torch.equal(xd, x[:, :xd.shape[1]]) and torch.equal(yd, y[:, :xd.shape[1]])
        xp, yp, cu_seqlens, max_seqlen = train.pack_batch(tokens, spans)
        assert xp.shape == yp.shape == (1, real) and cu_seqlens.dtype == torch.int32
        assert cu_seqlens[0] == 0 and cu_seqlens[-1] == real and max_seqlen == max(e - s - 1 for s, e in spans)
        for k, (s, e) in enumerate(spans):  # per piece: inputs piece[:-1], targets piece[1:]
            a, b = int(cu_seqlens[k]), int(cu_seqlens[k + 1])
            assert xp[0, a:b].tolist() == tokens[s:e - 1].tolist() and yp[0, a:b].tolist() == tokens[s + 1:e].tolist()
    assert len(seen) > len(partition) // 3  # draws spread over the documents
    _expect(ValueError, ["does not fit"], train.pad_batch, tokens, [(0, 20)], 16, 0)


def test_pad_and_pack_give_the_same_loss(tmp_path):
    _write_dataset(tmp_path / "d")
    tokens, docs, meta = train.load_dataset(tmp_path / "d", "train")
    torch.manual_seed(0)
    model = TransformerLM(97, 24, 32, 2, 2, 64)
    spans = train.sample_documents(docs, 60, 24, torch.Generator().manual_seed(1))
    x, y = train.pad_batch(tokens, spans, 24, meta["eot_id"])
    xp, yp, cu_seqlens, max_seqlen = train.pack_batch(tokens, spans)
    loss_pad = cross_entropy(model(x).reshape(-1, 97), y.reshape(-1), ignore_index=-100)
    loss_pack = cross_entropy(model(xp, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen).reshape(-1, 97),
                              yp.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss_pack, loss_pad, rtol=1e-5, atol=1e-5)


def test_config_files_overrides_and_errors(tmp_path):
    cfg = train.default_config()
    f = tmp_path / "c.py"
    f.write_text("batch_size = 3\nbatching = 'pack'\nlearning_rate = 1\n")
    train.apply_config([str(f), "--max_iters=7", "--out_dir=123", "--compile=True", "--min_lr=2"], cfg)
    assert cfg["batch_size"] == 3 and cfg["batching"] == "pack" and cfg["max_iters"] == 7
    assert cfg["out_dir"] == "123" and cfg["compile"] is True
    assert cfg["learning_rate"] == 1.0 and isinstance(cfg["min_lr"], float)
    _expect(ValueError, ["'no_such_key'"], train.apply_config, ["--no_such_key=1"], train.default_config())
    _expect(ValueError, ["'batch_size'", "int"], train.apply_config, ["--batch_size=2.5"], train.default_config())
    _expect(ValueError, ["'compile'"], train.apply_config, ["--compile=1"], train.default_config())
    _expect(ValueError, ["--key=value"], train.apply_config, ["--max_iters"], train.default_config())
    f.write_text("batchsize = 3\n")
    _expect(ValueError, ["'batchsize'", str(f)], train.apply_config, [str(f)], train.default_config())
    _expect(FileNotFoundError, ["nothere.py"], train.apply_config, ["nothere.py"], train.default_config())
    for name in ("small", "medium", "large", "xl", "2.7B", "pack", "pad", "dynamic_pad"):  # shipped files parse
        path = ROOT / "config" / f"{name}.py"
        if path.exists():
            train.apply_config([str(path)], train.default_config())


def test_config_presets_match_model_presets():
    from model import PRESETS
    for name in ("small", "medium", "large", "xl", "2.7B"):
        cfg = train.apply_config([str(ROOT / "config" / f"{name}.py")], train.default_config())
        assert {k: cfg[k] for k in PRESETS[name]} == PRESETS[name], name


def test_checkpoint_round_trip_and_corrupt_file(tmp_path):
    torch.manual_seed(0)
    model = TransformerLM(50, 16, 32, 2, 2, 64)
    opt = train.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 50, (2, 16))).sum().backward()
    opt.step()
    path = tmp_path / "ckpt.pt"
    compiled_like = torch.nn.Module()  # state-dict names as torch.compile's wrapper reports them
    compiled_like._orig_mod = model
    train.save_checkpoint(compiled_like, opt, 7, path, model_args={"vocab_size": 50})
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]  # the temp file was renamed away
    ckpt = torch.load(path, weights_only=True)
    assert not any("_orig_mod" in k for k in ckpt["model"]) and ckpt["model_args"] == {"vocab_size": 50}
    model2 = TransformerLM(50, 16, 32, 2, 2, 64)
    opt2 = train.AdamW(model2.parameters(), lr=1e-3)
    assert train.load_checkpoint(path, model2, opt2) == 7
    for (k, v), v2 in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(v, v2), k
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    assert all(torch.equal(s1["state"][i]["exp_avg_sq"], s2["state"][i]["exp_avg_sq"]) for i in s1["state"])
    buf = io.BytesIO()  # file objects work too
    train.save_checkpoint(model, None, 3, buf)
    buf.seek(0)
    assert train.load_checkpoint(buf, model2, None) == 3
    data = path.read_bytes()
    (tmp_path / "trunc.pt").write_bytes(data[: len(data) // 2])
    _expect(RuntimeError, ["truncated or corrupt"], train.load_checkpoint, tmp_path / "trunc.pt", model2, opt2)
    _expect(FileNotFoundError, ["not found"], train.load_checkpoint, tmp_path / "none.pt", model2, opt2)


def _log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_short_training_run_loss_falls_for_every_batching(tmp_path):
    data = tmp_path / "d"
    _write_dataset(data)
    for batching, iters in (("concat", 40), ("pad", 4), ("dynamic_pad", 4), ("pack", 4)):
        out = tmp_path / batching
        train.main(TINY + [f"--data_dir={data}", f"--out_dir={out}", f"--batching={batching}",
                           f"--max_iters={iters}", "--log_interval=1", "--eval_interval=20"])
        records = _log(out)
        losses = [r["loss"] for r in records if "loss" in r]
        vals = [r["val_loss"] for r in records if "val_loss" in r]
        assert len(losses) == iters and all(math.isfinite(v) for v in losses + vals)
        assert all(r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 for r in records if "loss" in r)
        ckpt = torch.load(out / "ckpt.pt", weights_only=True)
        assert ckpt["iteration"] == iters and ckpt["config"]["batching"] == batching
        assert set(ckpt["tokenizer"]) == {"vocab", "merges", "special_tokens"}
        if batching == "concat":  # the rule is learnable: loss far below the start (ln 97 = 4.6)
            assert losses[-1] < 0.6 * losses[0] and vals[-1] < 0.6 * vals[0], (losses, vals)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "concat" / "loss.png").stat().st_size > 0


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path):
    data = tmp_path / "d"
    _write_dataset(data)
    for batching in ("concat", "pack"):
        common = TINY + [f"--data_dir={data}", "--log_interval=1", "--eval_interval=2", "--lr_decay_iters=6",
                         f"--batching={batching}", "--grad_accum=2"]
        train.main(common + [f"--out_dir={tmp_path / 'full'}", "--max_iters=6"])
        train.main(common + [f"--out_dir={tmp_path / 'part'}", "--max_iters=3"])
        train.main(common + [f"--out_dir={tmp_path / 'part'}", "--max_iters=6", "--init_from=resume"])
        full = [(r["step"], r["loss"], r["grad_norm"]) for r in _log(tmp_path / "full") if "loss" in r]
        part = [(r["step"], r["loss"], r["grad_norm"]) for r in _log(tmp_path / "part") if "loss" in r]
        assert len(full) == 6 and full == part, (full, part)  # bit-for-bit
        a = torch.load(tmp_path / "full" / "ckpt.pt", weights_only=True)["model"]
        b = torch.load(tmp_path / "part" / "ckpt.pt", weights_only=True)["model"]
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_bad_input_errors(tmp_path):
    data = tmp_path / "d"
    _write_dataset(data, n_docs=(120, 1))
    base = TINY + [f"--data_dir={data}", f"--out_dir={tmp_path / 'o'}", "--max_iters=1"]
    _expect(ValueError, ["val split", "context_length"], train.main, base + ["--context_length=500"])
    _expect(ValueError, ["batching"], train.main, base + ["--batching=nope"])
    _expect(FileNotFoundError, ["ckpt.pt", "not found"], train.main, base + ["--init_from=resume"])
    train.main(base)
    other = tmp_path / "other"
    _write_dataset(other, vocab_size=50)
    _expect(ValueError, ["vocab_size 97", "has 50"], train.main,
            TINY + [f"--data_dir={other}", f"--out_dir={tmp_path / 'o'}", "--max_iters=2", "--init_from=resume"])


def _free_port():
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    except OSError as e:
        raise unittest.SkipTest(f"no local TCP port for the gloo rendezvous: {e}")


def _run_ranks(world_size, args, timeout=300):
    """Launch train.py world_size times with torchrun's environment variables (gloo on CPU)."""
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "train.py")] + args, env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(f"{world_size}-process run timed out after {timeout}s")
    if any(p.returncode for p in procs):
        text = "\n".join(outputs)
        if any(w in text for w in ("init_process_group", "Address already in use", "Connection refused",
                                   "Gloo connectFullMesh", "failed to bind")):
            raise unittest.SkipTest(f"could not start {world_size} gloo processes: {text[-500:]}")
        raise AssertionError(f"{world_size}-process run failed:\n{text[-4000:]}")
    return outputs


def _assert_same_weights(dir_a, dir_b, atol):
    a = torch.load(os.path.join(dir_a, "ckpt.pt"), weights_only=True)["model"]
    b = torch.load(os.path.join(dir_b, "ckpt.pt"), weights_only=True)["model"]
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=k)


def test_two_process_gloo_training_equals_one_process_with_accumulation(tmp_path):
    data = tmp_path / "d"
    _write_dataset(data)
    common = TINY + [f"--data_dir={data}", "--max_iters=3", "--log_interval=1", "--eval_interval=100",
                     "--grad_accum=2", "--batching=pack"]
    train.main(common + [f"--out_dir={tmp_path / 'single'}"])
    for impl in ("bucketed", "naive", "flat", "overlap", "torch"):
        _run_ranks(2, common + [f"--out_dir={tmp_path / impl}", f"--ddp_impl={impl}"])
        _assert_same_weights(tmp_path / "single", tmp_path / impl, atol=1e-5)
        assert not os.path.exists(tmp_path / impl / "ckpt.pt.tmp")


def test_four_process_gloo_bucketed_ddp_with_zero1_equals_one_process(tmp_path):
    data = tmp_path / "d"
    _write_dataset(data)
    common = TINY + [f"--data_dir={data}", "--max_iters=4", "--log_interval=2", "--eval_interval=100",
                     "--grad_accum=4", "--bucket_size_mb=0.01"]
    train.main(common + [f"--out_dir={tmp_path / 'single'}"])
    _run_ranks(4, common + [f"--out_dir={tmp_path / 'zero1'}", "--ddp_impl=bucketed", "--zero1=True"])
    _assert_same_weights(tmp_path / "single", tmp_path / "zero1", atol=1e-5)
    ckpt = torch.load(tmp_path / "zero1" / "ckpt.pt", weights_only=True)
    assert ckpt["world_size"] == 4 and len(ckpt["optimizer"]["state"]) == len(ckpt["model"])  # consolidated


def test_two_process_gloo_fsdp_and_torch_fsdp_train_save_and_resume(tmp_path):
    data = tmp_path / "d"
    _write_dataset(data)
    common = TINY + [f"--data_dir={data}", "--log_interval=1", "--eval_interval=100", "--grad_accum=2",
                     "--lr_decay_iters=4"]
    train.main(common + [f"--out_dir={tmp_path / 'single'}", "--max_iters=4"])
    for impl in ("torch_fsdp", "fsdp"):
        out = tmp_path / impl
        _run_ranks(2, common + [f"--out_dir={out}", f"--ddp_impl={impl}", "--max_iters=2"])
        _run_ranks(2, common + [f"--out_dir={out}", f"--ddp_impl={impl}", "--max_iters=4", "--init_from=resume"])
        _assert_same_weights(tmp_path / "single", out, atol=1e-5)  # full weights gathered, optimizer state resumed
