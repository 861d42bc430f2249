"""Where flash.py's attention kernels spend their time, read off Nsight Compute: the workload to profile, and the
tables made from ncu's CSV pages.

    python gpu/ncu_attention.py run B H S D         # 3 warm-up calls, then one causal bf16 forward+backward
                                                    # between cudaProfilerStart/Stop (for ncu --profile-from-start off)
    python gpu/ncu_attention.py summary RAW.csv SOURCE.csv [--top 20]

RAW.csv is `ncu -i REPORT --page raw --csv`, SOURCE.csv `ncu -i REPORT --page source --csv --print-source sass` (the
report taken with `--set full`). Per kernel the summary gives its time and clock, the tensor cores' bf16 work as a
share of their peak at that clock, the warp-state samples by stall reason, the SASS instructions that collect the
most samples, and the shared-memory wavefronts by opcode against the ideal count (the excess is bank conflicts).
`PART=ncu_attention bash gpu/h200.sh` profiles the Gluon kernels at D=128 S=4096 and the D=64 forward at S=1024.
"""
import argparse
import collections
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

TENSOR = "sm__ops_path_tensor_op_hgmma_src_bf16_dst_fp32_sparsity_off.sum.pct_of_peak_sustained_elapsed"
TO_MS = {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "s": 1e3, "second": 1e3}


def run(b, h, s, d):
    import flash
    if not torch.cuda.is_available():
        raise SystemExit("gpu/ncu_attention.py run: needs a CUDA GPU")
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # warm-ups: compiling and autotuning stay outside the profiled range
        flash.flash_attention(q, k, v, causal=True).backward(do)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    flash.flash_attention(q, k, v, causal=True).backward(do)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one forward+backward: B={b} H={h} S={s} D={d}, causal bf16")


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def raw_rows(path):
    """ncu's raw page: a header row, a units row, one row per kernel launch -> [(name, {metric: (value, unit)})]."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 3 or rows[0][:1] != ["ID"] or "Kernel Name" not in rows[0] or any(
            len(r) != len(rows[0]) for r in rows[1:]):
        raise SystemExit(f"{path}: not ncu's raw CSV page (its 'ID' and 'Kernel Name' columns, a row per launch)")
    header, units = rows[0], rows[1]
    return [(r[header.index("Kernel Name")], {h: (r[i], units[i]) for i, h in enumerate(header)}) for r in rows[2:]]


def source_blocks(path):
    """ncu's source page with --csv: per kernel a line '"Kernel Name","NAME"', then a table -> {name: [row dicts]}."""
    blocks, name, lines = {}, None, []
    with open(path, newline="") as f:
        for line in f:
            if line.startswith('"Kernel Name"'):
                if name is not None:
                    blocks[name] = list(csv.DictReader(lines))
                name, lines = next(csv.reader([line]))[1], []
            elif name is not None:
                lines.append(line)
    if name is not None:
        blocks[name] = list(csv.DictReader(lines))
    if not blocks:
        raise SystemExit(f"{path}: not ncu's source CSV page (no 'Kernel Name' line)")
    return blocks


def opcode(sass):
    words = sass.split()
    return words[1] if words and words[0].startswith("@") else (words[0] if words else "")


def summary(raw_path, source_path, top):
    out = []
    for name, m in raw_rows(raw_path):
        value, unit = m.get("gpu__time_duration.sum", ("0", "ms"))
        out.append(f"## {name}\n\n{number(value) * TO_MS.get(unit, 1.0):.3f} ms at "
                   f"{number(m.get('sm__cycles_elapsed.avg.per_second', ('0', ''))[0]):.2f} GHz; tensor cores (bf16 "
                   f"wgmma) at {number(m.get(TENSOR, ('0', ''))[0]):.1f}% of their peak at that clock\n")
    for name, rows in source_blocks(source_path).items():
        reasons = [c for c in (rows[0] if rows else {}) if c.startswith("stall_") and "Not Issued" not in c]
        totals = collections.Counter()
        for r in rows:
            for c in reasons:
                totals[c[6:]] += int(number(r[c]))
        all_samples = sum(totals.values()) or 1
        out.append(f"## {name}: warp-state samples ({all_samples:,})\n\n| reason | samples | share |\n|---|---|---|")
        out += [f"| {c} | {n:,} | {n / all_samples:.1%} |" for c, n in totals.most_common(8)]
        out.append("\n| # | SASS | executed | samples | main reasons |\n|---|---|---|---|---|")
        key = "Warp Stall Sampling (All Samples)"
        for i, r in sorted(enumerate(rows), key=lambda x: -number(x[1][key]))[:top]:
            main = sorted(((number(r[c]), c[6:]) for c in reasons), reverse=True)[:2]
            why = ", ".join(f"{c} {n:.0f}" for n, c in main if n)
            out.append(f"| {i} | `{r['Source'].strip()[:60]}` | {number(r['Instructions Executed']):,.0f} | "
                       f"{number(r[key]):,.0f} | {why} |")
        wave, ideal = collections.Counter(), collections.Counter()
        for r in rows:
            op = opcode(r["Source"].strip())
            wave[op] += number(r.get("L1 Wavefronts Shared", "0"))
            ideal[op] += number(r.get("L1 Wavefronts Shared Ideal", "0"))
        total = sum(wave.values()) or 1
        out.append("\n| shared-memory opcode | wavefronts | share | ideal | excess |\n|---|---|---|---|---|")
        out += [f"| {op} | {n:,.0f} | {n / total:.1%} | {ideal[op]:,.0f} | {max(n - ideal[op], 0):,.0f} |"
                for op, n in wave.most_common() if n]
        out.append("")
    print("\n".join(out))


def main(argv):
    p = argparse.ArgumentParser(prog="gpu/ncu_attention.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the workload to run under ncu")
    for dim in ("B", "H", "S", "D"):
        r.add_argument(dim, type=int)
    sm = sub.add_parser("summary", help="tables from ncu's raw and source CSV pages")
    sm.add_argument("raw")
    sm.add_argument("source")
    sm.add_argument("--top", type=int, default=20, help="instructions listed by warp-state samples")
    args = p.parse_args(argv)
    if args.cmd == "run":
        run(args.B, args.H, args.S, args.D)
    else:
        summary(args.raw, args.source, args.top)


if __name__ == "__main__":
    main(sys.argv[1:])
