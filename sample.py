"""Generate text from a checkpoint written by train.py.

    python sample.py                      # out/ckpt.pt, from <|endoftext|>
    python sample.py --prompt "ROMEO:" --num_samples 3 --temperature 0.8
    echo "To be, or not" | python sample.py --max_new_tokens 100
    python sample.py --prompt "KING:" --prompt "First Citizen:" --temperature 0
    python sample.py --ckpt out/llama     # a Llama-format directory

The file: the command line (cli, read before torch is imported), decoding
(sample_next, generate, with a KV cache), loading (load_model), main.
"""
import argparse
import difflib
import json
import os
import re
import sys


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, unless None or off."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _did_you_mean(message, parser):
    """argparse's message, naming the closest flag to each unknown one."""
    if not message.startswith("unrecognized arguments: "):
        return message
    known = [flag[2:] for action in parser._actions
             for flag in action.option_strings]
    hints = []
    for arg in message.split(": ", 1)[1].split():
        flag = arg.split("=")[0]
        close = difflib.get_close_matches(flag[2:], known, n=1)
        if flag.startswith("--") and close:
            hints.append((flag, f"--{close[0]}"))
    if not hints:
        return message
    if len(hints) == 1:
        return f"{message}; did you mean {hints[0][1]}?"
    named = ", ".join(f"{hint} (for {flag})" for flag, hint in hints)
    return f"{message}; did you mean {named}?"


def _no_checkpoint(path):
    return (f"no checkpoint at {path}: train a model first with `python "
            f"train.py` (or point --out_dir / --ckpt at one)")


def cli(argv=None):
    """-> (args, error); error(message) prints one line and exits 2."""
    p = argparse.ArgumentParser(
        description="Generate text from a train.py checkpoint.",
        formatter_class=_HelpFormatter)

    def error(message):  # one line: no usage block
        hinted = _did_you_mean(str(message), p)
        p.exit(2, f"sample.py: error: {hinted}\n")
    p.error = error
    p.add_argument("--out_dir", default="out",
                   help="where train.py wrote ckpt.pt")
    p.add_argument("--ckpt", default=None,
                   help="checkpoint path (default OUT_DIR/ckpt.pt), or a "
                   "Llama-format directory (config.json + model.safetensors "
                   "+ our vocab.json / merges.txt)")
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt text; repeat for a batch of prompts; "
                   "default: read stdin if piped, else start from "
                   "<|endoftext|>")
    p.add_argument("--num_samples", type=int, default=1,
                   help="samples per prompt")
    p.add_argument("--max_new_tokens", type=int, default=256,
                   help="new tokens per sample")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="0 = greedy")
    p.add_argument("--top_p", type=float, default=0.9, help="1 = off")
    p.add_argument("--top_k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=1337,
                   help="of the sampling generator")
    p.add_argument("--device", default="auto",
                   help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--crop_prompt", action="store_true",
                   help="keep the last context_length tokens of a long "
                   "prompt")
    p.add_argument("--no_kv_cache", action="store_true",
                   help="rerun the whole window every step (slow; a check)")
    args = p.parse_args(argv)
    args.ckpt = args.ckpt or os.path.join(args.out_dir, "ckpt.pt")
    if args.num_samples < 1:
        p.error("--num_samples must be >= 1")
    if args.max_new_tokens < 0:
        p.error("--max_new_tokens must be >= 0")
    if args.temperature < 0:
        p.error("--temperature must be >= 0 (0 = greedy)")
    if not 0 < args.top_p <= 1:
        p.error("--top_p must be in (0, 1]")
    if args.top_k < 0:
        p.error("--top_k must be >= 0 (0 = off)")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device):
        p.error(f"--device must be auto, cpu, cuda or cuda:N, not "
                f"{args.device!r}")
    if not os.path.exists(args.ckpt):
        p.error(_no_checkpoint(args.ckpt))
    return args, p.error


if __name__ == "__main__":
    cli()  # --help and mistakes answer before torch is imported

import torch  # noqa: E402

from bpe import Tokenizer  # noqa: E402
from hf import load_llama  # noqa: E402
from model import (TransformerLM, autocast_dtype,  # noqa: E402
                   read_checkpoint, softmax)

EOT = "<|endoftext|>"


# ---- decoding

def sample_next(logits, temperature=1.0, top_p=1.0, top_k=0, generator=None):
    """One id per row of logits (B, V): argmax at temperature 0, else a
    draw from softmax(logits / temperature) cut to the top_k ids (0: all)
    and to the shortest most-likely prefix holding top_p of the mass."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    if top_k > 0:
        k = min(top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _next_logits(model, seqs, cache):
    """Logits (B, V) for the next token of every row."""
    ctx, device = model.context_length, model.lm_head.weight.device
    lens = [len(s) for s in seqs]
    # once a window slides, positions shift and cached keys no longer apply
    fits = max(lens) <= ctx
    if cache is not None and fits and 0 < cache.length < cache.max_len:
        # a finished row rewrites its last slot
        idx = torch.tensor([[s[-1]] for s in seqs], device=device)
        pos = torch.tensor([[n - 1] for n in lens], device=device)
        return model(idx, position_ids=pos, kv_cache=cache)[:, -1]
    # whole windows, right-padded: causal attention hides the padding
    windows = [s[-ctx:] for s in seqs]
    T = max(len(w) for w in windows)
    rows = [w + [w[-1]] * (T - len(w)) for w in windows]
    idx = torch.tensor(rows, device=device)
    if cache is not None and fits:
        cache.length = 0
        positions = torch.arange(T, device=device)
        logits = model(idx, position_ids=positions, kv_cache=cache)
    else:
        logits = model(idx)
    last = torch.tensor([len(w) - 1 for w in windows], device=device)
    return logits[torch.arange(len(seqs), device=device), last]


@torch.inference_mode()
def generate(model, prompt_ids, max_new_tokens, temperature=1.0, top_p=1.0,
             eot_id=None, top_k=0, generator=None, use_cache=True,
             crop_prompt=False):
    """Continue prompt_ids (ids, or a list of id lists) by up to
    max_new_tokens ids -> the new ids, each row stopping before eot_id.
    Each step sees the last context_length tokens (a longer prompt needs
    crop_prompt=True); use_cache=False, the cache's reference, reruns the
    whole window every step."""
    if (max_new_tokens < 0 or temperature < 0 or not 0 < top_p <= 1
            or top_k < 0):
        raise ValueError(f"need max_new_tokens >= 0, temperature >= 0, "
                         f"0 < top_p <= 1, top_k >= 0; got {max_new_tokens}, "
                         f"{temperature}, {top_p}, {top_k}")
    if torch.is_tensor(prompt_ids):
        prompt_ids = prompt_ids.tolist()
    batched = len(prompt_ids) > 0 and not isinstance(prompt_ids[0], int)
    seqs = [list(p) for p in prompt_ids] if batched else [list(prompt_ids)]
    ctx = model.context_length
    for i, s in enumerate(seqs):
        if not s:
            raise ValueError(f"prompt {i} is empty: start it with the "
                             f"<|endoftext|> id")
        if len(s) > ctx and not crop_prompt:
            raise ValueError(
                f"prompt {i} has {len(s)} tokens but the model's "
                f"context_length is {ctx}: shorten it or pass "
                f"crop_prompt=True (sample.py: --crop_prompt) to keep its "
                f"last {ctx} tokens")
    cache = None
    if use_cache:
        weight = model.lm_head.weight
        dtype = autocast_dtype(weight) or weight.dtype
        cache = model.make_kv_cache(len(seqs), dtype=dtype)
    new = [[] for _ in seqs]
    done = [False] * len(seqs)
    was_training = model.training
    try:
        model.eval()
        for _ in range(max_new_tokens):
            logits = _next_logits(model, seqs, cache)
            ids = sample_next(logits, temperature, top_p, top_k, generator)
            for b, t in enumerate(ids.tolist()):
                done[b] = done[b] or t == eot_id
                if not done[b]:
                    seqs[b].append(t)
                    new[b].append(t)
            if all(done):
                break
    finally:
        model.train(was_training)
    return new if batched else new[0]


# ---- loading a checkpoint and its tokenizer

def _attn_impl(device):
    """flash on CUDA (for windows past the context), else naive."""
    return "flash" if torch.device(device).type == "cuda" else "naive"


def _tokenizer(vocab_path, merges_path, special_tokens, vocab_size, what):
    tokenizer = Tokenizer.from_files(vocab_path, merges_path,
                                     special_tokens=special_tokens)
    if EOT not in tokenizer.special_ids:
        raise ValueError(f"{what}'s tokenizer has no {EOT} special token "
                         f"(special_tokens={special_tokens})")
    size = max(tokenizer.vocab) + 1
    if size != vocab_size:
        raise ValueError(f"vocabulary mismatch: {what}'s model has "
                         f"vocab_size {vocab_size} but its tokenizer "
                         f"({vocab_path}) has {size} tokens")
    return tokenizer


def load_llama_dir(path, device="cpu"):
    """load_model of a Llama-format directory holding our vocab.json and
    merges.txt (hf.save_llama's); the dict: {"llama_config": ...}."""
    vocab = os.path.join(path, "vocab.json")
    merges = os.path.join(path, "merges.txt")
    missing = [os.path.basename(f) for f in (vocab, merges)
               if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(
            f"Llama directory {path} has no {' or '.join(missing)}: "
            f"sample.py needs our BPE tokenizer files beside the weights "
            f"(hf.save_llama(..., tokenizer=tok) writes them; Hugging Face "
            f"tokenizer.json is not read)")
    listed = []
    specials_map = os.path.join(path, "special_tokens_map.json")
    if os.path.isfile(specials_map):
        with open(specials_map) as f:
            listed = json.load(f).get("additional_special_tokens", [])
    # each a string or {"content": ...}
    names = [s if isinstance(s, str) else s.get("content") for s in listed]
    special_tokens = [s for s in dict.fromkeys(names + [EOT]) if s]
    model = load_llama(path, device=device, attn_impl=_attn_impl(device))
    tokenizer = _tokenizer(vocab, merges, special_tokens, model.vocab_size,
                           path)
    eot_id = tokenizer.special_ids[EOT]
    with open(os.path.join(path, "config.json")) as f:
        return model, tokenizer, eot_id, {"llama_config": json.load(f)}


def _find(path, ckpt_path):
    """A tokenizer file's path as given, else beside the checkpoint, else
    in this repository."""
    here = os.path.dirname(os.path.abspath(__file__))
    beside = os.path.join(os.path.dirname(ckpt_path), os.path.basename(path))
    for candidate in (path, beside, os.path.join(here, path)):
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(
        f"the checkpoint's tokenizer file {path!r} is missing: recreate it "
        f"with `python data/prepare.py NAME` (the dataset the model was "
        f"trained on; add --input FILE ... for your own text)")


def load_model(ckpt_path, device="cpu"):
    """-> (model in eval mode on device, Tokenizer, eot_id, checkpoint);
    a directory goes to load_llama_dir."""
    if os.path.isdir(ckpt_path):
        return load_llama_dir(ckpt_path, device)
    if not os.path.isfile(ckpt_path):
        raise FileNotFoundError(_no_checkpoint(ckpt_path))
    ckpt = read_checkpoint(ckpt_path,
                           needs=("model", "model_args", "tokenizer"))
    model_args = dict(ckpt["model_args"], attn_impl=_attn_impl(device),
                      act_ckpt_every=0)
    # less the prefixes of torch.compile and data-parallel wrappers
    prefixes = r"^((_orig_mod|module)\.)+"
    state = {re.sub(prefixes, "", name): tensor
             for name, tensor in ckpt["model"].items()}
    try:
        model = TransformerLM(**model_args)
        model.load_state_dict(state, strict=True)
    except (TypeError, ValueError, RuntimeError) as e:
        detail = " ".join(str(e).split())  # load_state_dict's spans lines
        raise RuntimeError(f"checkpoint {ckpt_path} does not match its "
                           f"model_args {ckpt['model_args']}: "
                           f"{detail}") from None
    tok = ckpt["tokenizer"]
    special_tokens = list(tok.get("special_tokens") or [EOT])
    tokenizer = _tokenizer(_find(tok["vocab"], ckpt_path),
                           _find(tok["merges"], ckpt_path), special_tokens,
                           model.vocab_size, "the checkpoint")
    eot_id = tokenizer.special_ids[EOT]
    return model.to(device).eval(), tokenizer, eot_id, ckpt


# ---- the command line

def main(argv=None):
    args, error = cli(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        error(f"--device {device}: CUDA is not available on this machine")
    try:
        model, tokenizer, eot_id, _ = load_model(args.ckpt, device)
    except (FileNotFoundError, ValueError, RuntimeError, ImportError) as e:
        error(e)

    prompts = args.prompt
    if not prompts:  # a piped prompt; none from a terminal or closed stdin
        piped = sys.stdin is not None and not sys.stdin.isatty()
        prompts = [sys.stdin.read() if piped else ""]
    texts = [text for text in prompts for _ in range(args.num_samples)]
    batch = [tokenizer.encode(text) if text else [eot_id] for text in texts]
    generator = torch.Generator(device=device).manual_seed(args.seed)
    cuda = torch.device(device).type == "cuda"
    use_bf16 = cuda and torch.cuda.is_bf16_supported()
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_bf16):
            outs = generate(model, batch, args.max_new_tokens,
                            temperature=args.temperature, top_p=args.top_p,
                            eot_id=eot_id, top_k=args.top_k,
                            generator=generator,
                            use_cache=not args.no_kv_cache,
                            crop_prompt=args.crop_prompt)
    except ValueError as e:
        error(e)
    for text, ids in zip(texts, outs):
        print(text + tokenizer.decode(ids))
        print("-" * 40, flush=True)


if __name__ == "__main__":
    main()
