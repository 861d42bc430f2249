import os, sys, torch
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from pathlib import Path
_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE.parent if _HERE.name == "tests_wip" else _HERE))

import contextlib
import io
import json
import math
import unittest

import bench
import model as model_py

# --- bench.py ---
# Smoke tests at tiny sizes on CPU: each subcommand's output has complete rows and positive times; OOM handling is
# exercised by injecting torch.OutOfMemoryError; NVTX emission is observed by replacing range_push / range_pop
# (Nsight Systems is not installed anywhere we run).

TINY = ["--size", "tiny", "--vocab_size", "64", "--context_length", "16", "--batch_size", "2"]


def run_bench(argv):
    """bench.main(argv) with stdout captured: returns the Markdown it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench.main(argv)
    return out.getvalue()


@contextlib.contextmanager
def recorded_nvtx():
    """Replace torch.cuda.nvtx.range_push / range_pop with recorders (restored afterwards)."""
    calls = []
    push, pop = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    torch.cuda.nvtx.range_push = lambda name: calls.append(("push", name))
    torch.cuda.nvtx.range_pop = lambda: calls.append(("pop", None))
    try:
        yield calls
    finally:
        torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop = push, pop


def test_bench_model_row_is_complete(tmp_path):
    path = tmp_path / "row.json"
    text = run_bench(["model"] + TINY + ["--warmup", "1", "--steps", "2", "--json", str(path)])
    assert "`python bench.py model --size tiny" in text and "| tiny |" in text
    payload = json.loads(path.read_text())
    assert payload["command"].startswith("python bench.py model") and payload["date"] and payload["device"]
    (row,) = payload["rows"]
    assert row["status"] == "ok" and row["mode"] == "train" and row["params"] > 0
    assert row["mean_ms"] > 0 and row["std_ms"] >= 0 and row["first_step_ms"] > 0
    assert set(row["phase_ms"]) == {"forward", "backward", "optimizer_step"}
    assert all(ms > 0 for ms in row["phase_ms"].values())
    assert row["tokens_per_s"] > 0 and row["tflops"] > 0


def test_bench_sweep_marks_oom_and_errors_and_continues(tmp_path):
    original = bench.run_step

    def failing_step(net, runner, optimizer, x, y, mode, dtype, phases):
        if x.shape[1] == 24 and mode == "train":  # pretend this configuration does not fit
            raise torch.OutOfMemoryError("injected by the test")
        if x.shape[1] == 16 and mode == "fwd":  # any other failure: an "error" row, the sweep goes on
            raise ValueError("injected by the test")
        return original(net, runner, optimizer, x, y, mode, dtype, phases)

    path, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    bench.run_step = failing_step
    try:
        text = run_bench(["model", "--sweep", "--sizes", "tiny", "--context_lengths", "16,24", "--dtypes", "fp32",
                          "--modes", "fwd,train", "--vocab_size", "64", "--batch_size", "2", "--warmup", "0",
                          "--steps", "1", "--json", str(path), "--plot", str(png)])
    finally:
        bench.run_step = original
    rows = json.loads(path.read_text())["rows"]
    assert [(r["context_length"], r["mode"], r["status"]) for r in rows] == \
        [(16, "fwd", "error"), (16, "train", "ok"), (24, "fwd", "ok"), (24, "train", "OOM")]
    assert all(r["mean_ms"] > 0 for r in rows if r["status"] == "ok")
    table = [line for line in text.splitlines() if line.startswith("| tiny")]
    assert len(table) == 2 and "OOM" in table[1] and "OOM" not in table[0] and "error" in table[0]
    try:
        import matplotlib  # noqa: F401 -- the plot is optional
        assert png.stat().st_size > 0
    except ImportError:
        pass
    text = run_bench(["model", "--sweep", "--sizes", "tiny", "--context_lengths", "16", "--dtypes", "fp32",
                      "--modes", "fwd", "--time_budget", "0", "--json", str(path)])
    assert [r["status"] for r in json.loads(path.read_text())["rows"]] == ["skipped"]


def test_bench_nvtx_ranges_are_emitted():
    with recorded_nvtx() as calls:
        run_bench(["model"] + TINY + ["--warmup", "1", "--steps", "2", "--nvtx"])
    names = [name for kind, name in calls if kind == "push"]
    for expected in ("warmup", "step", "forward", "backward", "optimizer_step", "attention_scores", "softmax",
                     "final_matmul"):
        assert expected in names, expected
    assert names.count("step") == 2 and names.count("softmax") == 3 * 2  # 3 steps x 2 layers
    depth = 0
    for kind, _ in calls:  # every push has its pop, in order
        depth += 1 if kind == "push" else -1
        assert depth >= 0
    assert depth == 0
    assert model_py.scaled_dot_product_attention is not bench.annotated_attention  # swapped back


def test_bench_annotated_attention_matches_model():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 13, 8, generator=g) for _ in range(3))
    mask = model_py.causal_mask(13, "cpu")
    with recorded_nvtx() as calls:
        got = bench.annotated_attention(q, k, v, mask)
    torch.testing.assert_close(got, model_py.scaled_dot_product_attention(q, k, v, mask))
    assert [n for kind, n in calls if kind == "push"] == ["attention_scores", "softmax", "final_matmul"]


def test_bench_profile_tables_and_trace(tmp_path):
    trace, path = tmp_path / "trace.json", tmp_path / "profile.json"
    text = run_bench(["model"] + TINY + ["--warmup", "1", "--steps", "1", "--profile", str(trace),
                                         "--json", str(path)])
    assert "traceEvents" in json.loads(trace.read_text())
    tables = json.loads(path.read_text())["profile"]
    assert set(tables) == {"forward", "backward", "optimizer_step"}
    for table in tables.values():
        rows = table["top"]
        assert table["steps"] == 1 and table["total_ms"] > 0
        assert rows and all(r["calls"] > 0 and r["total_ms"] >= 0 for r in rows)
        assert rows[0]["total_ms"] > 0 and sum(r["share"] for r in rows) <= 1 + 1e-9
    assert "**forward**" in text and "**optimizer_step**" in text


def test_bench_memory_snapshot_explains_cpu(tmp_path):
    if torch.cuda.is_available():
        raise unittest.SkipTest("the CPU explanation path; on CUDA a real snapshot is written")
    path = tmp_path / "mem.json"
    text = run_bench(["model"] + TINY + ["--warmup", "0", "--steps", "1", "--memory_snapshot",
                                         str(tmp_path / "snap.pickle"), "--json", str(path)])
    assert "need CUDA" in text and not (tmp_path / "snap.pickle").exists()
    est = json.loads(path.read_text())["cpu_memory_estimate_mib"]
    assert set(est) == {"forward", "backward", "optimizer_step"} and min(est.values()) > 0
    assert est["optimizer_step"] > est["backward"]


def test_bench_precision_side_by_side(tmp_path):
    path = tmp_path / "precision.json"
    text = run_bench(["precision", "--sizes", "tiny", "--modes", "fwd", "--vocab_size", "64", "--context_length",
                      "16", "--batch_size", "2", "--warmup", "0", "--steps", "1", "--json", str(path)])
    payload = json.loads(path.read_text())
    assert sorted(r["dtype"] for r in payload["rows"]) == ["bf16", "fp32"]
    assert all(r["status"] == "ok" and r["mean_ms"] > 0 for r in payload["rows"])
    acc = {r["case"]: r["total"] for r in payload["accumulation"]}
    assert abs(acc["fp32"] - 10) < 1e-3  # SPEC §3.7: fp32 is about right,
    assert abs(acc["fp16"] - 10) > 0.02  # fp16 visibly wrong,
    assert 0 < abs(acc["fp16 increments into fp32"] - 10) < 0.01  # fp16 increments into fp32: a small bias
    dtypes = payload["autocast_dtypes"]
    assert dtypes["Linear output"] == "bfloat16" and dtypes["loss"] == "float32"
    assert dtypes["parameters"] == dtypes["gradients"] == "float32"
    assert "Accumulation precision" in text


def test_bench_compile_side_by_side(tmp_path):
    path = tmp_path / "compile.json"
    run_bench(["compile", "--sizes", "tiny", "--modes", "fwd", "--vocab_size", "64", "--context_length", "16",
               "--batch_size", "2", "--warmup", "1", "--steps", "1", "--attn_batch", "2", "--attn_d", "8",
               "--attn_T", "24", "--json", str(path)])
    payload = json.loads(path.read_text())
    assert [(r["compile"], r["status"]) for r in payload["model_rows"]] == [("none", "ok"), ("model", "ok")]
    assert all(r["mean_ms"] > 0 for r in payload["model_rows"])
    (row,) = payload["attention_rows"]
    for name in ("eager", "compiled"):
        assert row[name]["status"] == "ok" and row[name]["fwd_ms"] > 0 and row[name]["bwd_ms"] > 0


def test_bench_gpt2_rows_and_flops(tmp_path):
    path = tmp_path / "gpt2.json"
    run_bench(["gpt2", "--no-compile", "--vocab_size", "96", "--context_length", "16", "--d_model", "32",
               "--num_layers", "1", "--num_heads", "2", "--d_ff", "64", "--batch_size", "2", "--attns", "sdpa",
               "--warmup", "1", "--steps", "1", "--json", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert [r["model"].split(":")[0] for r in rows] == ["ours", "peer"]
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 and r["tflops"] > 0 for r in rows)
    V, T, d, L = 96, 16, 32, 1
    # peer: embeddings (tied) + positions, per layer 12 d^2 weights + biases + 2 LayerNorms, final LayerNorm
    assert rows[1]["params"] == V * d + T * d + L * (12 * d * d + 13 * d) + 2 * d
    # SPEC §2.9 on the peer: qkv + out 8Td^2, MLP 16Td^2, causal T^2 terms 2T^2d, lm_head 2TdV; training x3
    assert math.isclose(bench.peer_flops_per_token(V, T, d, L), 3 * (L * (24 * T * d * d + 2 * T * T * d)
                                                                      + 2 * T * d * V) / T)


def test_bench_varlen_same_documents(tmp_path):
    path = tmp_path / "varlen.json"
    run_bench(["varlen", "--num_layers", "1", "--num_docs", "120", "--context_length", "96", "--batch_size", "2",
               "--warmup", "1", "--steps", "1", "--json", str(path)])
    payload = json.loads(path.read_text())
    rows = {(r["phase"], r["strategy"]): r for r in payload["rows"]}
    assert set(rows) == {(p, s) for p in ("eval", "train") for s in ("pad", "dynamic_pad", "pack")}
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows.values())
    real = {r["real_tokens"] for r in rows.values()}
    assert len(real) == 1  # the same documents, the same real (target) tokens, whatever the layout
    losses = [rows[("eval", s)]["loss_first_batch"] for s in ("pad", "dynamic_pad", "pack")]
    assert max(losses) - min(losses) < 1e-4  # same weights, same targets: padding and packing agree
    assert rows[("train", "pad")]["speedup_vs_pad"] == 1.0
    attn = {r["method"]: r for r in payload["attention_rows"]}
    for name, r in attn.items():
        if name.startswith("SDPA") or name.startswith("flash_attn_varlen"):
            assert r["status"] == "ok" and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0, (name, r["status"])
            assert r["max_diff"] < 1e-4, (name, r["max_diff"])
    flex = attn["FlexAttention document mask (compiled)"]
    assert flex["status"] == "ok" and flex["max_diff"] < 1e-4  # forward only on CPU (no FlexAttention backward)


def test_bench_varlen_helpers():
    g = torch.Generator().manual_seed(0)
    lengths = bench.document_lengths(2000, 200.0, 0.8, 512, g)
    assert lengths.min() >= 16 and lengths.max() <= 512 and 150 < lengths.median() < 250
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    index, lens = bench.padded_layout(cu, 6)
    assert lens.tolist() == [3, 5, 2]
    assert index.tolist() == [0, 1, 2, 6, 7, 8, 9, 10, 12, 13]  # row k starts at k * 6


def test_bench_bad_input_is_a_clear_error():
    for argv, words in ((["nope"], "unknown subcommand 'nope'"), ([], "usage"),
                        (["model", "--plot", "x.png"], "--plot draws the sweep"),
                        (["model", "--sweep", "--profile", "t.json"], "single run"),
                        (["model", "--sweep", "--sizes", "huge"], "unknown value 'huge'")):
        try:
            run_bench(argv)
        except SystemExit as e:
            assert words in str(e), (argv, str(e))
        else:
            raise AssertionError(f"{argv} did not fail")
