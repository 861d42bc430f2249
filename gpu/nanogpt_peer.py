"""nanoGPT's own benchmark as the peer of `bench.py model --peer gpt2`:

    python gpu/nanogpt_peer.py PATH_TO_NANOGPT

runs bench.py of a karpathy/nanoGPT checkout on random data with its defaults
(GPT-2 124M, batch 12 x 1024, compiled, bf16) and prints its time per step,
tokens/s and, on CUDA, the peak of torch's allocator.
`PART=nanogpt bash gpu/h200.sh` hands the last line, `nanoGPT tokens/s N`,
to `bench.py model --reference_tokens_per_s`."""
import contextlib
import io
import os
import re
import runpy
import sys

import torch


def main():
    usage = ("usage: python gpu/nanogpt_peer.py PATH_TO_NANOGPT"
             " (a checkout with bench.py and model.py)")
    if len(sys.argv) != 2:
        raise SystemExit(usage)
    root = os.path.abspath(sys.argv[1])
    if not os.path.isfile(os.path.join(root, "bench.py")):
        raise SystemExit(usage)
    os.chdir(root)  # its bench.py reads configurator.py, imports its model
    sys.path.insert(0, root)
    sys.argv = ["bench.py", "--real_data=False"]
    if cuda := torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        config = runpy.run_path("bench.py", run_name="__main__")
    found = re.search(r"time per iteration: ([0-9.]+)ms", log.getvalue())
    if found is None:
        raise SystemExit("gpu/nanogpt_peer.py: nanoGPT's bench.py printed"
                         " no 'time per iteration'")
    ms = float(found.group(1))
    peak = "no CUDA"
    if cuda:
        peak = f"{torch.cuda.max_memory_allocated() / 2**20:,.0f} MiB"
    batch, block = config["batch_size"], config["block_size"]
    print(f"nanoGPT: batch {batch} x {block}, compile {config['compile']}, "
          f"{config['dtype']}, random data: {ms:.2f} ms/step, peak {peak}")
    print(f"nanoGPT tokens/s {batch * block / ms * 1e3:.0f}")


if __name__ == "__main__":
    main()
