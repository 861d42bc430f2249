"""The goal table of BENCHMARKS.md from the steps of
`PART=goals bash gpu/h200.sh`, ours and each peer timed in that call:

    python3 gpu/goals.py PREFIX STEPS --machine M --commit C --versions V

PREFIX.STEP.json: a step's bench.py --json; PREFIX.train_small.jsonl:
train.py's log; PREFIX.log: nanoGPT's lines. STEPS: the runner's
steps.txt, how each step ended. A row whose step failed, was cut or
did not run says so. Markdown on stdout.
"""
import argparse
import datetime
import json
import re
import statistics

NONE = "—"
# (B, H, S, D) of the attention goals: bench.py attention's anchors
SHAPES = [(4, 16, 4096, 128), (1, 16, 16384, 128),
          (1, 32, 32768, 128), (16, 32, 1024, 64),
          (4, 32, 4096, 64), (1, 32, 16384, 64)]
# the least ratio each attention goal asks: (forward, fwd+bwd)
CUDNN = {128: (1.10, 1.05), 64: (None, 1.0)}
FLEX, PACKED = (None, 1.3), (None, 2.0)
DIRECTIONS = ("fwd_tflops", "fwd_bwd_tflops")


class Steps:
    """How each step ended (steps.txt), and what it wrote."""

    def __init__(self, prefix, steps_path):
        self.prefix, self.ended = prefix, {}
        for line in read(steps_path).splitlines():
            name, _, how = line.partition(": ")
            if name.startswith("goals/"):  # a rerun's line wins
                self.ended[name[6:]] = how

    def why(self, step):
        """What a row shows for a step that gave no result."""
        how = self.ended.get(step, "not run")
        code = re.match(r"exit (\d+)", how)
        if how.startswith("not run (part time limit"):
            return "not run (time)"
        if code is None:
            return how
        if code[1] in ("124", "137"):
            return f"cut at its time limit ({step})"
        return f"exit {code[1]}, no result ({step})"

    def rows(self, step):
        try:
            return json.loads(self.text(f".{step}.json"))["rows"]
        except (ValueError, KeyError):
            return []

    def text(self, suffix):
        return read(self.prefix + suffix)


def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def pick(rows, **want):
    """The first row with these values, or None."""
    for r in rows:
        if all(r.get(k) == v for k, v in want.items()):
            return r
    return None


def status(r, step, steps):
    """None for a row with numbers, else what to show instead."""
    if r is None:
        return steps.why(step)
    if r.get("status", "ok") == "ok":
        return None
    if r["status"] == "OOM":
        return f"OOM: does not fit this GPU ({step})"
    return f"{r['status']} ({step})"


def number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def ratio(a, b):
    """a / b, or None unless both are numbers (b not 0)."""
    if number(a) and number(b) and b:
        return a / b
    return None


def fmt(x, digits=0):
    if number(x):
        return f"{x:,.{digits}f}"
    return NONE if x is None else str(x)


def times(x):
    return fmt(x, 2) + "x" if number(x) else NONE


def percent(share):
    return f"{100 * share:.1f}%" if number(share) else NONE


def met(x, bound, at_most=False):
    """yes / no: x against the goal's bound (a floor unless at_most)."""
    if not number(x) or bound is None:
        return NONE
    if at_most:
        return "yes" if x <= bound else "no"
    return "yes" if x >= bound else "no"


def spread(r):
    """Noise within a run: std over mean of the timed steps."""
    share = ratio(r.get("std_ms"), r.get("mean_ms"))
    return NONE if share is None else f"±{100 * share:.1f}%"


def both(cells):  # forward / forward+backward
    return " / ".join(cells)


def row(goal, ours, peer=NONE, x=NONE, noise=NONE, verdict=NONE):
    return [goal, ours, peer, x, noise, verdict]


def versus(goal, step, steps, ours, peer, key, bound, name,
           at_most=False, unit="", digits=0):
    """The row of a goal on ours[key] / peer[key]: rows of a step's
    JSON, or dicts made here (None: not there)."""
    if (why := status(ours, step, steps)) is not None:
        return row(goal, why)
    cell = fmt(ours[key], digits) + unit
    if isinstance(peer, str):  # why the peer has no result
        return row(goal, cell, f"{name}: {peer}")
    if (why := status(peer, step, steps)) is not None:
        return row(goal, cell, f"{name}: {why}")
    x = ratio(ours[key], peer[key])
    noise = spread(ours) if key in ("tokens_per_s", "mean_ms") else NONE
    return row(goal, cell, f"{name} {fmt(peer[key], digits)}{unit}",
               times(x), noise, met(x, bound, at_most))


# ---- a group of rows per goal ----------------------------------------

def case_rows(rows, case):
    """{method: row} of the rows whose case starts so."""
    return {r.get("method"): r for r in rows
            if r.get("case", "").startswith(case)}


def ratios(found, peer):
    o, p = found.get("ours"), found.get(peer)
    if o is None or p is None:
        return None
    return [ratio(o[k], p[k]) for k in DIRECTIONS]


def attention_noise(steps):
    """{case: |round 1 - round 2| of ours / cuDNN, per direction}:
    two rounds of the same code, the noise beside the ratios."""
    rounds = steps.rows("attention"), steps.rows("attention_2")
    noise = {}
    for b, h, s, d in SHAPES:
        case = f"B={b} H={h} S={s} D={d} "
        pair = [ratios(case_rows(r, case), "sdpa-cudnn") for r in rounds]
        if None not in pair:
            noise[case] = [abs(x - y) if number(x) and number(y)
                           else None for x, y in zip(*pair)]
    return noise


def attention_row(goal, found, peer, bounds, why, noise=None):
    o, p = found.get("ours"), found.get(peer)
    name = {"sdpa-cudnn": "cuDNN", "flex": "Flex"}[peer]
    if o is None:
        return row(goal, why)
    ours = both(fmt(o[k]) for k in DIRECTIONS) + " TFLOP/s"
    if p is None:
        return row(goal, ours, f"{name}: {why}")
    xs = ratios(found, peer)
    return row(goal, ours, name + " " + both(fmt(p[k])
                                             for k in DIRECTIONS),
               both(times(x) for x in xs),
               both(fmt(x, 2) for x in noise) if noise else NONE,
               both(met(x, g) for x, g in zip(xs, bounds)))


def attention(steps):
    rows, noise = steps.rows("attention"), attention_noise(steps)
    why, out = steps.why("attention"), []
    for b, h, s, d in SHAPES:
        case = f"B={b} H={h} S={s} D={d} "
        shape = f"attention {case.strip()}: "
        found = case_rows(rows, case)
        asked = ", ".join(f"{what} ≥ {g:.2f}x" for what, g in
                          zip(("fwd", "fwd+bwd"), CUDNN[d]) if g)
        out += [attention_row(f"{shape}{asked} cuDNN", found,
                              "sdpa-cudnn", CUDNN[d], why,
                              noise.get(case)),
                attention_row(f"{shape}fwd+bwd ≥ {FLEX[1]}x Flex",
                              found, "flex", FLEX, why)]
    for d in (64, 128):
        packed = [r for r in rows if r.get("case", "").startswith(
            "docs=") and r["case"].endswith(f" D={d}")]
        out.append(attention_row(
            f"packed documents, D={d}: fwd+bwd ≥ {PACKED[1]:.0f}x "
            "Flex's document mask", case_rows(packed, "docs="),
            "flex", PACKED, why))
    return out


def nanogpt(steps):
    log = steps.text(".log")
    rate = re.findall(r"^nanoGPT tokens/s (\d+)$", log, re.M)
    peak = re.findall(r"^nanoGPT: .*, peak ([0-9,]+) MiB$", log, re.M)
    peer = steps.why("nanogpt")
    if rate and peak:
        peer = dict(tokens_per_s=float(rate[-1]),
                    peak_mib=float(peak[-1].replace(",", "")))
    ours = pick(steps.rows("gpt2"), model="ours")
    return [versus("GPT-2 small: tokens/s ≥ 1.25x nanoGPT's", "gpt2",
                   steps, ours, peer, "tokens_per_s", 1.25, "nanoGPT",
                   unit=" tok/s"),
            versus("GPT-2 small: peak memory ≤ nanoGPT's", "gpt2",
                   steps, ours, peer, "peak_mib", 1.0, "nanoGPT",
                   at_most=True, unit=" MiB")]


def train_loop(records):
    """train.py's log over the logged steps after 40: tokens/s by the
    wall clock (evaluation and logging in), MFU at that rate, the
    logged MFU's median (evaluation out), ms per step as logged."""
    late = [r for r in records
            if "tokens_per_s" in r and r["step"] >= 40]
    if len(late) < 2:
        return None
    tokens = 0.0
    for last, r in zip(late, late[1:]):  # ms_per_step: evaluation out
        steps = r["step"] - last["step"]
        tokens += r["tokens_per_s"] * r["ms_per_step"] / 1e3 * steps
    rate = tokens / (late[-1]["time_s"] - late[0]["time_s"])
    loop = dict(tokens_per_s=rate, logged_mfu=None, mfu=None)
    ms = [r["ms_per_step"] for r in late[1:]]
    loop.update(mean_ms=statistics.fmean(ms), std_ms=statistics.pstdev(ms))
    mfu = [r["mfu"] for r in late[1:] if r.get("mfu") is not None]
    if mfu:  # MFU: tokens/s times a constant
        rates = [r["tokens_per_s"] for r in late[1:]]
        loop["logged_mfu"] = statistics.median(mfu)
        loop["mfu"] = rate * loop["logged_mfu"] / statistics.median(rates)
    return loop


def train(steps):
    goal = ("`train.py config/small.py`, one GPU: ≥ 45% MFU, "
            "evaluation included")
    lines = steps.text(".train_small.jsonl").splitlines()
    loop = train_loop([json.loads(x) for x in lines if x.strip()])
    bare = pick(steps.rows("bare_small"), model="ours")
    if loop is None:
        return [row(goal, steps.why("train_small"))] * 2
    return [row(goal, f"{percent(loop['mfu'])}; between evaluations "
                f"{percent(loop['logged_mfu'])}", NONE, NONE,
                spread(loop), met(loop["mfu"], 0.45)),
            versus("same run: tokens/s ≥ 0.95x the bare step's "
                   "(`bench.py model`, batch 16 x 1024)", "bare_small",
                   steps, loop, bare, "tokens_per_s", 0.95,
                   "bare step", unit=" tok/s")]


def xl(steps):
    rows = steps.rows("xl")
    ours, peer = pick(rows, model="ours"), pick(rows, model="native")
    goal = "2.7B (xl, ctx 2048, batch 4): ≥ 55% MFU"
    if (why := status(ours, "xl", steps)) is not None:
        mfu = row(goal, why)
    else:
        mfu = row(goal, f"{percent(ours['mfu'])} "
                  f"({fmt(ours['mean_ms'], 1)} ms)", NONE, NONE,
                  spread(ours), met(ours["mfu"], 0.55))
    return [mfu, versus("2.7B: tokens/s ≥ the PyTorch-native peer's",
                        "xl", steps, ours, peer, "tokens_per_s", 1.0,
                        "native", unit=" tok/s")]


def leaderboard(steps):
    rows = steps.rows("leaderboard")
    ours, peer = pick(rows, model="ours"), pick(rows, model="native")
    goal = "8B proxy (4 layers, 32k tokens), one GPU: {} ≤ {}"
    return [versus(goal.format("ms", "0.77x the native step's"),
                   "leaderboard", steps, ours, peer, "mean_ms", 0.77,
                   "native", at_most=True, unit=" ms", digits=1),
            versus(goal.format("peak memory", "the native step's"),
                   "leaderboard", steps, ours, peer, "peak_mib", 1.0,
                   "native", at_most=True, unit=" MiB")]


def hf(steps):
    rows = steps.rows("hf")
    ours = pick(rows, strategy="ours:pack:compiled")
    return [versus(f"HF GPT-2 padding-free, ours compiled: ≥ {x}x "
                   f"{name}", "hf", steps, ours,
                   pick(rows, strategy=name), "tokens_per_s", x, name,
                   unit=" real tok/s")
            for name, x in (("sdpa:pad:compiled", 1.5),
                            ("sdpa:pad", 3.0))]


def adamw(steps):
    rows = steps.rows("adamw")
    return [versus(
        f"AdamW step ({size}): ≤ 1.2x torch's fused", "adamw", steps,
        pick(rows, size=size, optimizer="ours fused (the Triton kernel)"),
        pick(rows, size=size, optimizer="torch fused=True"), "ms", 1.2,
        "torch fused", at_most=True, unit=" ms", digits=3)
        for size in ("gpt2", "xl")]


def rmsnorm(steps):
    rows = [r for r in steps.rows("rmsnorm")
            if r.get("shape") == "32768 x 4096"]
    goal = "RMSNorm (32768, 4096) bf16: fwd / fwd+bwd ≥ inductor"
    ours, peer = pick(rows, method="ours"), pick(rows, method="inductor")
    if ours is None or peer is None:
        return [row(goal, steps.why("rmsnorm"))]
    copy = (pick(rows, method="copy") or {}).get("fwd_gb_s")

    def of_copy(r):  # GB/s over a copy's
        return both(percent(ratio(r[k], copy))
                    for k in ("fwd_gb_s", "fwd_bwd_gb_s"))
    xs = [ratio(peer[k], ours[k]) for k in ("fwd_ms", "fwd_bwd_ms")]
    return [row(goal, of_copy(ours) + " of a copy",
                "inductor " + of_copy(peer), both(map(times, xs)),
                NONE, both(met(x, 1.0) for x in xs))]


GROUPS = [attention, nanogpt, train, xl, leaderboard, hf, adamw,
          rmsnorm]


def table(steps):
    """The rows; a group that cannot read its results gives a row
    saying so rather than ending the table."""
    rows = []
    for group in GROUPS:
        try:
            rows += group(steps)
        except Exception as e:  # (a result of a shape not foreseen)
            rows.append(row(group.__name__,
                            f"unreadable result: {e!r}"))
    return rows


def noise_line(steps):
    gaps = [x for pair in attention_noise(steps).values()
            for x in pair if x is not None]
    if not gaps:
        return "not measured: " + steps.why("attention_2")
    return (f"ours / cuDNN moved by at most {max(gaps):.2f} (median "
            f"{statistics.median(gaps):.2f}) between two rounds of "
            "`bench.py attention --parts anchors`; other rows: the "
            "spread of ours's timed steps (std / mean)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prefix", help="the part's path prefix")
    p.add_argument("steps", help="the runner's steps.txt")
    for key in ("machine", "commit", "versions"):
        p.add_argument(f"--{key}", default="unknown")
    args = p.parse_args(argv)
    steps = Steps(args.prefix, args.steps)
    date = datetime.datetime.now(datetime.timezone.utc)
    print(f"## Goals, one GPU (`PART=goals bash gpu/h200.sh`)\n\n"
          f"- machine: {args.machine}\n"
          f"- date: {date:%Y-%m-%d %H:%M} UTC\n- {args.versions}\n"
          f"- git commit: {args.commit}\n"
          f"- noise: {noise_line(steps)}\n"
          "- ratio: ours over the peer (where the goal says ≤: ms, "
          "MiB)\n\n| goal | ours | peer | ratio | noise | met |\n"
          "|---|---|---|---|---|---|")
    for cells in table(steps):
        print("| " + " | ".join(str(c).replace("|", "\\|")
                                for c in cells) + " |")


if __name__ == "__main__":
    main()
