"""All tests, one section per script in the order of the files.

    python test_all.py            # built-in runner (no pytest needed); prints "N passed, N failed, N skipped"
    python test_all.py bpe flash  # only tests whose name contains one of the words
    python -m pytest test_all.py  # also works

On a machine without CUDA the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set below before
anything imports triton). Tests that need a GPU or several processes skip with a reason when they cannot run.
"""
import os
import sys
import tempfile
import time
import traceback
import unittest
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent
SHARED = ROOT.parent / "shared"
sys.path.insert(0, str(ROOT))


def skip(reason):
    raise unittest.SkipTest(reason)


# ---------------------------------------------------------------------------------------------------------------
# runner
# ---------------------------------------------------------------------------------------------------------------

def main(argv):
    tests = [(n, f) for n, f in globals().items() if n.startswith("test_") and callable(f)]
    if argv:
        tests = [(n, f) for n, f in tests if any(w in n for w in argv)]
    passed, failed, skipped = 0, [], 0
    t_all = time.time()
    for name, fn in tests:
        t0 = time.time()
        try:
            if "tmp_path" in fn.__code__.co_varnames[:fn.__code__.co_argcount]:
                with tempfile.TemporaryDirectory() as d:
                    fn(tmp_path=Path(d))
            else:
                fn()
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
