"""Byte-level BPE: a parallel trainer, its slow reference twin, and a GPT-2
compatible Tokenizer.

    python bpe.py train --input corpus.txt --vocab_size 10000 \\
        --special '<|endoftext|>' --out out/tok
    python bpe.py encode --vocab out/tok/vocab.json --merges out/tok/merges.txt \\
        --special '<|endoftext|>' --input corpus.txt --out corpus.bin

  1. helpers     progress lines, GPT-2's byte <-> unicode map, special tokens,
                 chunks cut at safe boundaries
  2. training    train_bpe (parallel pre-tokenization, incremental merge loop)
                 and train_bpe_reference
  3. Tokenizer   GPT-2 files in and out; encode through tiktoken's core,
                 encode_reference in pure Python
  4. the command line (its arguments, cli, come first: before numpy)

Training: ids 0-255 are the bytes, then the special tokens; each merge joins
the most frequent adjacent pair of tokens (ties: the lexicographically greatest
pair of byte strings) inside pre-tokens, never across a special token.
Encoding: tiktoken's Rust BPE built from our ranks (token ids); the pure-Python
merges-in-order encoder is the reference and the fallback for vocabularies
tiktoken cannot express.
"""
import argparse
import contextlib
import heapq
import json
import os
import re
import sys
import time
import warnings
from collections import Counter, defaultdict, deque
from concurrent.futures import (ProcessPoolExecutor, ThreadPoolExecutor,
                                as_completed)


def cli(argv):
    parser = argparse.ArgumentParser(
        "bpe.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    train = sub.add_parser(
        "train", help="train a tokenizer and save vocab.json + merges.txt")
    train.add_argument("--vocab_size", type=int, required=True)
    train.add_argument("--out", required=True, help="output folder")
    encode = sub.add_parser(
        "encode", help="encode a text file into a header-less token array")
    encode.add_argument("--vocab", required=True)
    encode.add_argument("--merges", required=True)
    encode.add_argument(
        "--out", required=True,
        help=".bin file: uint16 if the vocabulary fits, else uint32")
    for p in (train, encode):
        p.add_argument("--input", required=True)
        p.add_argument("--special", nargs="*", default=["<|endoftext|>"],
                       help="special tokens")
        p.add_argument("--num_workers", type=int, default=None,
                       help="default: all cores")
    for p in (parser, train, encode):  # one line, no usage block, status 2
        p.error = lambda message, p=p: p.exit(2, f"{p.prog}: error: {message}\n")
    return parser.parse_args(argv)


if __name__ == "__main__":
    # --help and mistakes answer before numpy is imported; main() parses again
    cli(sys.argv[1:])

import numpy as np  # noqa: E402
import regex  # noqa: E402

# GPT-2's pre-tokenizer: contractions | letters | numbers | other symbols |
# trailing whitespace | whitespace
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
PAT = regex.compile(GPT2_PAT)
# the work unit of pre-tokenization and encoding: memory stays near this
# times the workers
CHUNK_BYTES = 4 << 20


# -----------------------------------------------------------------------------
# 1. helpers: progress lines, GPT-2's byte <-> unicode map, special-token
# splitting, file chunking

class Progress:
    """Prints `label: done/total unit (rate, ETA)` at most every `every`
    seconds, and once at the end."""

    def __init__(self, label, total, unit, every=5.0, verbose=True):
        self.label = label
        self.total = total
        self.unit = unit
        self.every = every
        self.verbose = verbose
        self.t0 = self.t_last = time.time()

    def update(self, done, final=False):
        now = time.time()
        too_soon = not final and now - self.t_last < self.every
        if not self.verbose or too_soon:
            return
        self.t_last, dt = now, max(now - self.t0, 1e-9)
        eta = 0.0
        if done and not final:
            eta = (self.total - done) * dt / done
        scale, prefix = 1, ""
        if self.unit == "B":  # bytes in MB
            scale, prefix = 1e6, "M"
        amount = f"{done / scale:,.1f}{prefix}/{self.total / scale:,.1f}{prefix}"
        rate = f"{done / dt / scale:,.2f}{prefix} {self.unit}/s"
        print(f"{self.label}: {amount} {self.unit} ({rate}, {dt:.1f}s elapsed, "
              f"ETA {eta:.0f}s)", flush=True)


def bytes_to_unicode():
    """GPT-2's file encoding of bytes: byte -> printable character (printable
    Latin-1 bytes map to themselves, the 68 others to chr(256), chr(257), ...
    in byte order), so vocab.json and merges.txt hold every token as text."""
    keep = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    others = [b for b in range(256) if b not in keep]
    return {b: chr(b) if b in keep else chr(256 + others.index(b)) for b in range(256)}


def check_special_tokens(special_tokens):
    special_tokens = list(special_tokens or [])
    for s in special_tokens:
        if not isinstance(s, str):
            raise TypeError(f"special tokens must be str, got "
                            f"{type(s).__name__}: {s!r}")
        if not s:
            raise ValueError("special tokens must be non-empty strings")
    return special_tokens


def special_splitter(special_tokens):
    """Capturing alternation, longest first (where one special contains
    another, the longer wins), so re.split puts the specials at the odd
    indices; None without specials (an empty one would match everywhere)."""
    if not special_tokens:
        return None
    longest_first = sorted(set(special_tokens), key=len, reverse=True)
    alternation = "|".join(re.escape(s) for s in longest_first)
    return re.compile(f"({alternation})")


def _overlap(a, b):
    """True if matches of `a` and `b` can share a character."""
    contains = a in b or b in a
    chains = any(a.endswith(b[:i]) or b.endswith(a[:i])
                 for i in range(1, min(len(a), len(b))))
    return contains or chains


def chunk_split_token(special_tokens):
    """The token whose occurrences are safe chunk boundaries for training and
    encoding. A boundary at the first byte of special token s is safe when no
    other special can overlap s (else the longest-first split could place s
    differently). Else b"\\n" between two printable ASCII characters is safe:
    that newline is a pre-token of its own whether or not the text goes on
    (GPT2_PAT). None: no boundary is safe, the file is one chunk."""
    for s in special_tokens:
        if all(t == s or not _overlap(s, t) for t in special_tokens):
            return s.encode("utf-8")
    if any("\n" in s for s in special_tokens):
        return None
    return b"\n"


def find_chunk_boundaries(f, desired_chunks, split_token):
    """Byte offsets [0, ..., size] of about desired_chunks chunks whose
    boundaries fall on `split_token` (see chunk_split_token; b"\\n" means the
    safe newline rule). Fewer chunks than asked when tokens are rare."""
    size = f.seek(0, os.SEEK_END)
    if split_token is None or desired_chunks <= 1 or size == 0:
        return [0, size]
    if split_token == b"\n":
        boundary = re.compile(rb"(?<=[!-~]\n)(?=[!-~])")
    else:
        boundary = re.compile(re.escape(split_token))
    bounds, step = [0], max(size // desired_chunks, 1)
    for k in range(1, desired_chunks):
        # the first boundary at or after k steps into the file, else size
        f.seek(max(k * step, bounds[-1]))
        # tail: the end of the last read, to find a token across two reads
        tail, hit = b"", size
        while block := f.read(1 << 16):
            window = tail + block
            if m := boundary.search(window):
                hit = f.tell() - len(window) + m.start()
                break
            tail = window[-(len(split_token) + 2):]
        bounds.append(hit)
    return sorted(set(bounds + [size]))


def _read_chunk(path, start, end):
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        offset = start + e.start
        raise ValueError(f"{path}: not valid UTF-8 at byte offset {offset}") from None


def _file_chunks(path, special_tokens, num_workers, chunk_bytes=CHUNK_BYTES):
    size = os.path.getsize(path)
    desired = max(num_workers, -(-size // chunk_bytes))
    with open(path, "rb") as f:
        bounds = find_chunk_boundaries(f, desired, chunk_split_token(special_tokens))
    return [(path, a, b) for a, b in zip(bounds[:-1], bounds[1:])]


# -----------------------------------------------------------------------------
# 2. training: pre-tokenize the chunks in parallel, then one merge loop with
# incremental pair counts and a max-heap

def _initial_vocab(input_path, vocab_size, special_tokens):
    """Checks the training arguments -> (special_tokens as a list, vocab: ids
    0..255 are the bytes, then the special tokens not among them, in order)."""
    special_tokens = check_special_tokens(special_tokens)
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"training input {input_path} does not exist")
    if os.path.getsize(input_path) == 0:
        raise ValueError(f"training input {input_path} is empty")
    vocab = {i: bytes([i]) for i in range(256)}
    for s in special_tokens:
        if s.encode("utf-8") not in vocab.values():
            vocab[len(vocab)] = s.encode("utf-8")
    if not isinstance(vocab_size, int) or vocab_size < len(vocab):
        raise ValueError(f"vocab_size={vocab_size} is below 256 byte tokens + "
                         f"{len(vocab) - 256} special tokens")
    return special_tokens, vocab


def _pretokens(text, special_tokens):
    """The pre-tokens of text: special tokens split it and are dropped, so no
    pre-token (and no merge) spans one."""
    splitter = special_splitter(special_tokens)
    segments = [text]
    if splitter:
        segments = splitter.split(text)[::2]
    for seg in segments:
        yield from PAT.findall(seg)


def _pretokenize_chunk(args):
    """Worker: Counter of the pre-token strings of one chunk."""
    path, start, end, special_tokens = args
    text = _read_chunk(path, start, end)
    return Counter(_pretokens(text, special_tokens)), end - start


def _map_unordered(fn, jobs, workers):
    """fn over jobs, on a pool of processes when workers > 1. Not
    multiprocessing.Pool: its terminate(), which its with-block calls
    after a worker's error, can deadlock (a known CPython bug)."""
    if workers <= 1:
        yield from map(fn, jobs)
        return
    with ProcessPoolExecutor(workers) as pool:
        futures = [pool.submit(fn, job) for job in jobs]
        try:
            for future in as_completed(futures):
                yield future.result()
        finally:  # after an error the jobs not yet started never run
            for future in futures:
                future.cancel()


def pretokenize(input_path, special_tokens, num_workers=None, verbose=True):
    """{pre-token bytes: count} of the whole file, over all cores (chunks cut
    at safe boundaries)."""
    num_workers = num_workers or os.cpu_count() or 1
    chunks = _file_chunks(input_path, special_tokens, num_workers)
    jobs = [chunk + (special_tokens,) for chunk in chunks]
    total, done = Counter(), 0
    size = os.path.getsize(input_path)
    progress = Progress("pre-tokenize", size, "B", verbose=verbose)
    workers = min(num_workers, len(jobs))
    for counts, nbytes in _map_unordered(_pretokenize_chunk, jobs, workers):
        total.update(counts)
        done += nbytes
        progress.update(done)
    progress.update(done, final=True)
    return {w.encode("utf-8"): n for w, n in total.items()}


def _merge(parts, pair, joined):
    """parts with every occurrence of pair, left to right, replaced by joined."""
    out, i = [], 0
    while i < len(parts):
        if (parts[i] == pair[0] and i + 1 < len(parts)
                and parts[i + 1] == pair[1]):
            out.append(joined)
            i += 2
        else:
            out.append(parts[i])
            i += 1
    return out


def _desc_key(token):
    """Sort key ordering byte strings in REVERSE of Python's bytes order, so
    a min-heap on (-count, key) pops the lexicographically greatest pair among
    equal counts. Byte b becomes the 16-bit unit 256 - b; the terminator
    0xFFFF exceeds every unit, so keys are prefix-free and key(a) + key(b)
    orders pairs (a, b) like the tuple, reversed."""
    return b"".join((256 - x).to_bytes(2, "big") for x in token) + b"\xff\xff"


def train_bpe(input_path, vocab_size, special_tokens, num_workers=None, verbose=True):
    """Byte-level BPE training (see the module docstring) -> (vocab {id:
    bytes}, merges [(bytes, bytes)] in order); fewer than vocab_size tokens
    when the corpus runs out of pairs (said when verbose)."""
    special_tokens, vocab = _initial_vocab(input_path, vocab_size, special_tokens)
    t0, merges = time.time(), []
    word_counts = pretokenize(input_path, special_tokens, num_workers, verbose)
    # every distinct pre-token as a list of ids, its count, pair counts and a
    # lazy pair -> words index (a word stays under a pair it lost)
    words, counts = [list(w) for w in word_counts], list(word_counts.values())
    pair_counts, index = defaultdict(int), defaultdict(set)
    for wid, (w, n) in enumerate(zip(words, counts)):
        for pair in zip(w, w[1:]):
            pair_counts[pair] += n
            index[pair].add(wid)
    keys = [_desc_key(vocab[i]) for i in range(len(vocab))]
    # lazy max-heap: counts of pairs without the new token only fall, so a
    # stale popped entry is pushed again with its current count; pairs with
    # the new token are pushed once after each merge
    heap = [(-n, keys[a] + keys[b], a, b) for (a, b), n in pair_counts.items()]
    heapq.heapify(heap)
    n_merges = vocab_size - len(vocab)
    progress = Progress("merge", n_merges, "merges", verbose=verbose)
    if verbose:
        print(f"{len(words):,} distinct pre-tokens, {len(pair_counts):,} pairs "
              f"({time.time() - t0:.1f}s)", flush=True)

    while len(merges) < n_merges and heap:
        negn, key, a, b = heapq.heappop(heap)
        n_now = pair_counts.get((a, b), 0)
        if n_now != -negn:
            if n_now > 0:
                heapq.heappush(heap, (-n_now, key, a, b))
            continue
        new_id = len(vocab)
        vocab[new_id] = vocab[a] + vocab[b]
        keys.append(_desc_key(vocab[new_id]))
        merges.append((vocab[a], vocab[b]))
        fresh = set()
        for wid in index.pop((a, b)):
            w, n = words[wid], counts[wid]
            merged = _merge(w, (a, b), new_id)
            if len(merged) == len(w):
                continue  # the lazy index's word no longer holds the pair
            for pair in zip(w, w[1:]):
                pair_counts[pair] -= n
            for pair in zip(merged, merged[1:]):
                pair_counts[pair] += n
                if new_id in pair:  # the only pairs that can be new
                    fresh.add(pair)
                    index[pair].add(wid)
            words[wid] = merged
        del pair_counts[(a, b)]
        for left, right in fresh:
            key = keys[left] + keys[right]
            heapq.heappush(heap, (-pair_counts[left, right], key, left, right))
        progress.update(len(merges))
    progress.update(len(merges), final=True)
    if verbose and len(vocab) < vocab_size:
        print(f"asked {vocab_size}, got {len(vocab)}: the corpus has no more "
              f"pairs to merge", flush=True)
    return vocab, merges


def train_bpe_reference(input_path, vocab_size, special_tokens):
    """The slow twin of train_bpe: one process, every pair recounted from
    scratch per merge."""
    special_tokens, vocab = _initial_vocab(input_path, vocab_size, special_tokens)
    with open(input_path, encoding="utf-8", newline="") as f:
        text = f.read()
    word_counts = Counter(tuple(bytes([x]) for x in w.encode("utf-8"))
                          for w in _pretokens(text, special_tokens))
    merges = []
    while len(vocab) < vocab_size:
        pairs = Counter()
        for w, n in word_counts.items():
            for pair in zip(w, w[1:]):
                pairs[pair] += n
        if not pairs:
            break
        # the highest count, then the greatest pair of bytes
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        vocab[len(vocab)] = best[0] + best[1]
        new_counts = Counter()
        for w, n in word_counts.items():
            new_counts[tuple(_merge(w, best, best[0] + best[1]))] += n
        word_counts = new_counts
    return vocab, merges


# -----------------------------------------------------------------------------
# 3. the tokenizer

class Tokenizer:
    """Encode/decode with a trained vocabulary: specials are matched first
    (longest first) and become their ids; the text between them is
    pre-tokenized and each pre-token merged in merge order."""

    def __init__(self, vocab, merges, special_tokens=None):
        self.special_tokens = check_special_tokens(special_tokens)
        self.vocab = dict(vocab)
        for i, b in self.vocab.items():
            if not isinstance(i, int) or i < 0 or not isinstance(b, bytes):
                raise TypeError(f"vocab must map int ids >= 0 to bytes, "
                                f"got {i!r}: {b!r}")
        self.merges = [(bytes(a), bytes(b)) for a, b in merges]
        self.special_ids = {}
        for s in self.special_tokens:
            same = [i for i, b in self.vocab.items() if b == s.encode("utf-8")]
            next_free = max(self.vocab, default=-1) + 1
            self.special_ids[s] = max(same) if same else next_free
            self.vocab[self.special_ids[s]] = s.encode("utf-8")
        special_id_set = set(self.special_ids.values())
        # ordinary tokens: bytes -> id (the lowest of equal bytes), the special
        # ids left out (the split emits them)
        ordinary = [(b, i) for i, b in sorted(self.vocab.items())
                    if i not in special_id_set]
        self.bytes_to_id = dict(reversed(ordinary))
        self.ranks = {}
        for r, (a, b) in enumerate(self.merges):
            if a + b not in self.bytes_to_id:
                raise ValueError(f"merge {r} ({a!r}, {b!r}) makes {a + b!r}, "
                                 f"which is not in the vocabulary")
            self.ranks.setdefault((a, b), r)
        self._splitter = special_splitter(self.special_tokens)
        self._cache, self._tiktoken = {}, None
        reason = self._tiktoken_obstacle(ordinary)
        if reason:
            warnings.warn(f"bpe: tiktoken fast path off ({reason}); using the "
                          f"pure-Python encoder", stacklevel=2)
            return
        import tiktoken
        # ranks of the bytes and merge results only: a token no merge makes
        # must stay out of reach
        reachable = [bytes([x]) for x in range(256)]
        reachable += [a + b for a, b in self.merges]
        token_ranks = {b: self.bytes_to_id[b] for b in reachable}
        self._tiktoken = tiktoken.Encoding(
            name=f"bpe_{id(self)}", pat_str=GPT2_PAT,
            mergeable_ranks=token_ranks, special_tokens=dict(self.special_ids))

    def _tiktoken_obstacle(self, ordinary):
        """Why the vocabulary does not fit tiktoken, or None. tiktoken merges
        the adjacent pair whose concatenation has the lowest rank; with rank =
        token id that is merges-in-order when the ids of merge results grow
        with merge rank (the tests hold it to the reference)."""
        repeats = Counter(b for b, _ in ordinary)
        duplicated = [b for b, n in repeats.items() if n > 1]
        if duplicated:
            return (f"{len(duplicated)} tokens share their bytes with another, "
                    f"e.g. {duplicated[0]!r}")
        missing = [x for x in range(256) if bytes([x]) not in self.bytes_to_id]
        if missing:
            return (f"{len(missing)} single bytes have no ordinary token, "
                    f"e.g. byte {missing[0]}")
        results = [self.bytes_to_id[a + b] for a, b in self.merges]
        if any(x >= y for x, y in zip(results, results[1:])):
            return "token ids do not grow with merge rank"
        return None

    @classmethod
    def from_files(cls, vocab_path, merges_path, special_tokens=None):
        """Reads GPT-2 style vocab.json {mapped string: id} and merges.txt (one
        "a b" pair per line, an optional "#version" first line), strings in the
        bytes_to_unicode encoding; special tokens as their literal text."""
        special_tokens = check_special_tokens(special_tokens)
        decoder = {c: b for b, c in bytes_to_unicode().items()}

        def unmap(s, where):
            try:
                return bytes(decoder[c] for c in s)
            except KeyError as e:
                raise ValueError(f"{where}: {s!r} has character {e.args[0]!r} "
                                 f"outside the GPT-2 byte map") from None

        raw = _read(vocab_path, "vocab", json.load)
        is_object = isinstance(raw, dict)
        if not is_object or not all(isinstance(i, int) for i in raw.values()):
            raise ValueError(f"{vocab_path}: expected a JSON object of token "
                             f"string -> int id")
        specials, vocab = set(special_tokens), {}
        for s, i in raw.items():
            if i in vocab:
                raise ValueError(f"{vocab_path}: id {i} appears twice")
            vocab[i] = s.encode("utf-8") if s in specials else unmap(s, vocab_path)
        merges = []
        lines = _read(merges_path, "merges", lambda f: f.read().split("\n"))
        for lineno, line in enumerate(lines, 1):
            line = line.rstrip("\r")
            if not line or (lineno == 1 and line.startswith("#version")):
                continue
            where, parts = f"{merges_path}:{lineno}", line.split(" ")
            if len(parts) != 2 or not all(parts):
                raise ValueError(f"{where}: expected two tokens separated by "
                                 f"one space, got {line!r}")
            merges.append(tuple(unmap(part, where) for part in parts))
        return cls(vocab, merges, special_tokens)

    def gpt2_strings(self):
        """(vocab.json's {string: id}, merges.txt's "a b" lines): bytes in
        the bytes_to_unicode encoding, special tokens as their text."""
        enc = bytes_to_unicode()

        def text(token):
            return "".join(enc[x] for x in token)
        special_id_set, mapped = set(self.special_ids.values()), {}
        for i in sorted(self.vocab):
            if i in special_id_set:
                s = self.vocab[i].decode("utf-8")
            else:
                s = text(self.vocab[i])
            if s in mapped:
                raise ValueError(f"tokens {mapped[s]} and {i} have the same "
                                 f"vocab.json string {s!r}")
            mapped[s] = i
        # no mapped byte is a space
        return mapped, [f"{text(a)} {text(b)}" for a, b in self.merges]

    def save(self, out_dir):
        """Writes vocab.json and merges.txt (GPT-2 format)."""
        os.makedirs(out_dir, exist_ok=True)
        mapped, merge_lines = self.gpt2_strings()
        paths = (os.path.join(out_dir, "vocab.json"),
                 os.path.join(out_dir, "merges.txt"))
        contents = (json.dumps(mapped, ensure_ascii=False, indent=0),
                    "\n".join(["#version: 0.2"] + merge_lines) + "\n")
        for path, content in zip(paths, contents):
            with atomic_open(path, "w", encoding="utf-8") as f:
                f.write(content)
        return paths

    # --- encoding ---

    def _encode_pretoken(self, word):
        """Reference path: merge the lowest-ranked adjacent pair (all its
        occurrences) until no adjacent pair is a merge. Cached per pre-token."""
        ids = self._cache.get(word)
        if ids is not None:
            return ids
        parts = [bytes([x]) for x in word.encode("utf-8")]
        while len(parts) > 1:
            ranked = [self.ranks[p] for p in zip(parts, parts[1:]) if p in self.ranks]
            if not ranked:
                break
            a, b = self.merges[min(ranked)]
            parts = _merge(parts, (a, b), a + b)
        try:
            ids = [self.bytes_to_id[p] for p in parts]
        except KeyError as e:
            raise ValueError(f"the vocabulary has no token for byte "
                             f"{e.args[0]!r}") from None
        if len(self._cache) < 1_000_000:
            self._cache[word] = ids
        return ids

    def _segments(self, text):
        """(is_special, string) pieces of text, specials matched longest
        first."""
        parts = [text]
        if self._splitter:
            parts = self._splitter.split(text)
        return [(k % 2 == 1, p) for k, p in enumerate(parts) if p]

    def encode_reference(self, text):
        """encode in pure Python, its reference."""
        ids = []
        for is_special, seg in self._segments(text):
            if is_special:
                ids.append(self.special_ids[seg])
            else:
                for m in PAT.finditer(seg):
                    ids.extend(self._encode_pretoken(m.group()))
        return ids

    def encode(self, text):
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        if self._tiktoken is None:
            return self.encode_reference(text)
        ids = []
        for is_special, seg in self._segments(text):
            if is_special:
                ids.append(self.special_ids[seg])
            else:
                ids.extend(self._tiktoken.encode_ordinary(seg))
        return ids

    def encode_to_numpy(self, text, dtype=np.int64):
        """encode(text) as a NumPy array; the fast path skips Python ints."""
        if self._tiktoken is None:
            return np.asarray(self.encode_reference(text), dtype=dtype)
        arrays = []
        for is_special, seg in self._segments(text):
            if is_special:
                arrays.append(np.array([self.special_ids[seg]]))
            else:
                arrays.append(self._tiktoken.encode_to_numpy(
                    seg, allowed_special=set(), disallowed_special=()))
        if not arrays:
            return np.zeros(0, dtype=dtype)
        return np.concatenate(arrays).astype(dtype, copy=False)

    def _stable_cut(self, buf):
        """Largest c with encode(buf + more) == encode(buf[:c]) +
        encode(buf[c:] + more) for any `more`.

        A special token match is final once a longer special could no longer
        start at it; ordinary text before len(buf) - (longest special - 1) can
        no longer become part of a special. There every pre-token but the last
        is final, and cutting at the start of one whose previous character is
        not whitespace leaves the prefix's pre-tokens unchanged (only a
        whitespace run's end depends on the character after it, GPT2_PAT)."""
        longest = max((len(s) for s in self.special_tokens), default=0)
        limit, pos, cut = len(buf) - max(longest - 1, 0), 0, 0
        if self._splitter is not None:
            for m in self._splitter.finditer(buf):
                if m.start() + longest > len(buf):
                    limit = min(limit, m.start())
                    break
                pos = cut = m.end()
        region = buf[pos:max(limit, pos)]
        # the last may grow; the first is pos itself
        starts = [m.start() for m in PAT.finditer(region)][1:-1]
        for s in reversed(starts):
            if not region[s - 1].isspace():
                return pos + s
        return cut

    def encode_iterable(self, iterable):
        """Lazily yields encode("".join(iterable)), holding back only the tail
        that more text could change."""
        buf = ""
        for piece in iterable:
            buf += piece
            cut = self._stable_cut(buf)
            if cut:
                yield from self.encode(buf[:cut])
                buf = buf[cut:]
        yield from self.encode(buf)

    def encode_file(self, path, num_workers=None, chunk_bytes=CHUNK_BYTES,
                    verbose=True):
        """Yields the ids of a UTF-8 file as NumPy arrays, in file order,
        encoded on num_workers threads (tiktoken's core releases the GIL).
        Chunks end at safe boundaries, so the concatenation equals
        encode(whole text); at most 2 x num_workers chunks are in flight."""
        num_workers = num_workers or os.cpu_count() or 1
        jobs = _file_chunks(path, self.special_tokens, num_workers, chunk_bytes)
        progress = Progress(f"encode {os.path.basename(path)}",
                            os.path.getsize(path), "B", verbose=verbose)

        def encode(start, end):
            return self.encode_to_numpy(_read_chunk(path, start, end))
        pool = ThreadPoolExecutor(num_workers)
        pending, done = deque(), 0  # pending: (bytes, future), in file order
        try:
            for k, (_, start, end) in enumerate(jobs):
                pending.append((end - start, pool.submit(encode, start, end)))
                last = k == len(jobs) - 1
                while pending and (len(pending) >= 2 * num_workers or last):
                    nbytes, future = pending.popleft()
                    yield future.result()
                    done += nbytes
                    progress.update(done)
        finally:
            pool.shutdown(cancel_futures=True)
        progress.update(done, final=True)

    def encode_batch(self, texts, num_workers=None):
        """[encode(t) for t in texts] over all cores (threads: tiktoken's core
        releases the GIL)."""
        with ThreadPoolExecutor(num_workers or os.cpu_count() or 1) as pool:
            return list(pool.map(self.encode, texts))

    def decode(self, ids):
        try:
            data = b"".join(self.vocab[i] for i in ids)
        except (KeyError, TypeError):
            bad = next(i for i in ids if not isinstance(i, (int, np.integer))
                       or i not in self.vocab)
            raise ValueError(f"cannot decode id {bad!r}: not in the "
                             f"vocabulary") from None
        return data.decode("utf-8", errors="replace")


@contextlib.contextmanager
def atomic_open(path, mode="w", **kwargs):
    """open() for writing whose file appears at `path` only once the block
    finishes: written as path + ".tmp", then renamed; on any failure (Ctrl-C
    included) the temporary file goes and `path` is untouched."""
    tmp = path + ".tmp"
    try:
        with open(tmp, mode, **kwargs) as f:
            yield f
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    os.replace(tmp, path)


def _read(path, what, parse):
    try:
        with open(path, encoding="utf-8") as f:
            return parse(f)
    except (OSError, ValueError) as e:  # ValueError: bad JSON or UTF-8
        raise ValueError(f"cannot read {what} file {path}: {e}") from None


# -----------------------------------------------------------------------------
# 4. the command line

def peak_rss_mb():
    """Peak RSS of this process and of its largest finished child, in MB. Our
    own from /proc/self/status (VmHWM) where there is one: getrusage's starts
    from the parent's RSS, which a fork + exec child inherits."""
    import resource
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/status") as f:
            own = next(int(line.split()[1]) for line in f
                       if line.startswith("VmHWM:"))
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return own / 1024, children / 1024


def main(argv):
    args, t0 = cli(argv), time.time()
    try:
        if args.cmd == "train":
            vocab, merges = train_bpe(args.input, args.vocab_size, args.special,
                                      args.num_workers)
            tok = Tokenizer(vocab, merges, args.special)
            paths = tok.save(args.out)
            rss, worker_rss = peak_rss_mb()
            longest = sorted(vocab.values(), key=len)[-3:]
            print(f"wrote {', '.join(paths)}: {len(vocab)} tokens in "
                  f"{time.time() - t0:.1f}s, peak RSS {rss:.0f} MB (largest "
                  f"worker {worker_rss:.0f} MB), longest {longest}")
            return
        tok = Tokenizer.from_files(args.vocab, args.merges, args.special)
        dtype = np.uint16 if max(tok.vocab) < 65536 else np.uint32
        n = 0
        with atomic_open(args.out, "wb") as f:
            for ids in tok.encode_file(args.input, args.num_workers):
                f.write(ids.astype(dtype).tobytes())
                n += len(ids)
        print(f"wrote {args.out}: {n:,} tokens, {np.dtype(dtype).name}")
    except (ValueError, TypeError, OSError) as e:  # bad input: one line, status 2
        print(f"bpe.py {args.cmd}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main(sys.argv[1:])
