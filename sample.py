"""Generate text from a checkpoint written by train.py.

    python sample.py                                   # out/ckpt.pt, 1 sample of 256 tokens from <|endoftext|>
    python sample.py --prompt "ROMEO:" --num_samples 3 --temperature 0.8 --top_p 0.9
    echo "To be, or not" | python sample.py --max_new_tokens 100
    python sample.py --prompt "KING:" --prompt "First Citizen:" --temperature 0   # batched prompts, greedy
    python sample.py --ckpt out/llama                  # a Llama-format directory (hf.save_llama)

The file: its arguments (cli, read before torch is imported), decoding (sample_next, generate: a KV cache, so each new
token runs the model on one position; prompts of different lengths decode together), loading a checkpoint and its
tokenizer (load_model), the command line (main).
"""
import argparse
import difflib
import json
import os
import re
import sys


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, but not an empty one (None, or off for a switch)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _did_you_mean(message, parser):
    """argparse's message for unknown flags, with the closest known flag of each."""
    if not message.startswith("unrecognized arguments: "):
        return message
    known = [flag[2:] for action in parser._actions for flag in action.option_strings]
    hints = []
    for arg in message.split(": ", 1)[1].split():
        flag = arg.split("=")[0]
        close = difflib.get_close_matches(flag[2:], known, n=1)
        if flag.startswith("--") and close:
            hints.append((flag, f"--{close[0]}"))
    if len(hints) == 1:
        return f"{message}; did you mean {hints[0][1]}?"
    if hints:
        named = ", ".join(f"{hint} (for {flag})" for flag, hint in hints)
        return f"{message}; did you mean {named}?"
    return message


def cli(argv=None):
    """The command line, read and checked before torch is imported (--help and a mistake answer at once) ->
    (args, error): error(message) prints one line, `sample.py: error: ...`, and exits with status 2."""
    p = argparse.ArgumentParser(description="Generate text from a train.py checkpoint.",
                                formatter_class=_HelpFormatter)

    def error(message):  # one line: no usage block
        p.exit(2, f"sample.py: error: {_did_you_mean(str(message), p)}\n")
    p.error = error
    p.add_argument("--out_dir", default="out", help="where train.py wrote ckpt.pt")
    p.add_argument("--ckpt", default=None, help="checkpoint path (default OUT_DIR/ckpt.pt), or a Llama-format "
                   "directory (config.json + model.safetensors + our vocab.json / merges.txt)")
    p.add_argument("--prompt", action="append", default=None, help="prompt text; repeat for a batch of prompts; "
                   "default: read stdin if piped, else start from <|endoftext|>")
    p.add_argument("--num_samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--max_new_tokens", type=int, default=256, help="new tokens per sample")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_p", type=float, default=0.9, help="1 = off")
    p.add_argument("--top_k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=1337, help="of the sampling generator")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--crop_prompt", action="store_true", help="keep the last context_length tokens of a long prompt")
    p.add_argument("--no_kv_cache", action="store_true", help="rerun the whole window every step (slow; a check)")
    args = p.parse_args(argv)
    args.ckpt = args.ckpt or os.path.join(args.out_dir, "ckpt.pt")
    for bad, msg in ((args.num_samples < 1, "--num_samples must be >= 1"),
                     (args.max_new_tokens < 0, "--max_new_tokens must be >= 0"),
                     (args.temperature < 0, "--temperature must be >= 0 (0 = greedy)"),
                     (not 0 < args.top_p <= 1, "--top_p must be in (0, 1]"),
                     (args.top_k < 0, "--top_k must be >= 0 (0 = off)"),
                     (not re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device), "--device must be auto, cpu, cuda or "
                      f"cuda:N, not {args.device!r}"),
                     (not os.path.exists(args.ckpt), f"no checkpoint at {args.ckpt}: train a model first with "
                      f"`python train.py` (or point --out_dir / --ckpt at one)")):
        if bad:
            p.error(msg)
    return args, p.error


if __name__ == "__main__":
    cli()  # --help and a bad argument answer before torch is imported; main() reads them again

import torch  # noqa: E402

from bpe import Tokenizer  # noqa: E402
from hf import load_llama  # noqa: E402
from model import TransformerLM, read_checkpoint, softmax  # noqa: E402

EOT = "<|endoftext|>"


# ---------------------------------------------------------------------------------------------------------------
# decoding

def sample_next(logits, temperature=1.0, top_p=1.0, top_k=0, generator=None):
    """One id per row of logits (B, V): temperature 0 is greedy argmax; else softmax(logits / temperature) cut to
    the top_k most likely ids (0 = all) and to the smallest most-likely prefix whose mass is >= top_p (always holding
    the top id), renormalised, then one draw per row."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        sorted_probs = sorted_probs.masked_fill(sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate(model, prompt_ids, max_new_tokens, temperature=1.0, top_p=1.0, eot_id=None, top_k=0,
             generator=None, use_cache=True, crop_prompt=False):
    """Continue prompt_ids (a list of ids, or a list of such lists for a batch) by up to max_new_tokens ids; returns
    the new ids (a list, or a list of lists), a row stopping at eot_id, which is left out. Each step sees the last
    context_length tokens; a longer prompt is an error unless crop_prompt=True. use_cache=False reruns the whole
    window every step: the reference the KV cache is held to."""
    if max_new_tokens < 0 or temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"need max_new_tokens >= 0, temperature >= 0, 0 < top_p <= 1, top_k >= 0; got "
                         f"{max_new_tokens}, {temperature}, {top_p}, {top_k}")
    prompt_ids = prompt_ids.tolist() if torch.is_tensor(prompt_ids) else prompt_ids
    batched = len(prompt_ids) > 0 and not isinstance(prompt_ids[0], int)
    seqs = [list(p) for p in prompt_ids] if batched else [list(prompt_ids)]
    ctx, device, B = model.context_length, model.lm_head.weight.device, len(seqs)
    for i, s in enumerate(seqs):
        if not s:
            raise ValueError(f"prompt {i} is empty: start it with the <|endoftext|> id")
        if len(s) > ctx and not crop_prompt:
            raise ValueError(f"prompt {i} has {len(s)} tokens but the model's context_length is {ctx}: shorten it "
                             f"or pass crop_prompt=True (sample.py: --crop_prompt) to keep its last {ctx} tokens")
    dt = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else model.lm_head.weight.dtype
    cache = model.make_kv_cache(B, dtype=dt) if use_cache else None
    new, done, was_training = [[] for _ in seqs], [False] * B, model.training
    try:
        model.eval()
        for _ in range(max_new_tokens):
            lens = [len(s) for s in seqs]
            fits = max(lens) <= ctx  # once a window slides, positions shift and cached keys no longer apply
            if cache is not None and fits and 0 < cache.length < cache.max_len:
                # decode: every row feeds its last token at its own position (a finished row rewrites its last slot)
                idx = torch.tensor([[s[-1]] for s in seqs], device=device)
                pos = torch.tensor([[n - 1] for n in lens], device=device)
                logits = model(idx, position_ids=pos, kv_cache=cache)[:, -1]
            else:  # whole windows, right-padded: causal attention keeps the padding out of every real token's view
                windows = [s[-ctx:] for s in seqs]
                T = max(len(w) for w in windows)
                idx = torch.tensor([w + [w[-1]] * (T - len(w)) for w in windows], device=device)
                if cache is not None and fits:
                    cache.length = 0
                    logits = model(idx, position_ids=torch.arange(T, device=device), kv_cache=cache)
                else:
                    logits = model(idx)
                last = torch.tensor([len(w) - 1 for w in windows], device=device)
                logits = logits[torch.arange(B, device=device), last]
            for b, t in enumerate(sample_next(logits, temperature, top_p, top_k, generator).tolist()):
                done[b] = done[b] or t == eot_id
                if not done[b]:
                    seqs[b].append(t)
                    new[b].append(t)
            if all(done):
                break
    finally:
        model.train(was_training)
    return new if batched else new[0]


# ---------------------------------------------------------------------------------------------------------------
# loading a checkpoint and its tokenizer

def _tokenizer(vocab_path, merges_path, special_tokens, vocab_size, what):
    tokenizer = Tokenizer.from_files(vocab_path, merges_path, special_tokens=special_tokens)
    if EOT not in tokenizer.special_ids:
        raise ValueError(f"{what}'s tokenizer has no {EOT} special token (special_tokens={special_tokens})")
    if max(tokenizer.vocab) + 1 != vocab_size:
        raise ValueError(f"vocabulary mismatch: {what}'s model has vocab_size {vocab_size} but its tokenizer "
                         f"({vocab_path}) has {max(tokenizer.vocab) + 1} tokens")
    return tokenizer


def load_llama_dir(path, device="cpu"):
    """A Llama-format directory (config.json + model.safetensors, e.g. from hf.save_llama) with our BPE's vocab.json
    + merges.txt beside it -> (model in eval mode on device, Tokenizer, eot_id, {"llama_config": config.json}).
    Special tokens come from special_tokens_map.json when present, else <|endoftext|>."""
    missing = [name for name in ("vocab.json", "merges.txt") if not os.path.isfile(os.path.join(path, name))]
    if missing:
        raise FileNotFoundError(f"Llama directory {path} has no {' or '.join(missing)}: sample.py needs our BPE "
                                f"tokenizer files beside the weights (hf.save_llama(..., tokenizer=tok) writes "
                                f"them; Hugging Face tokenizer.json is not read)")
    listed = []
    if os.path.isfile(os.path.join(path, "special_tokens_map.json")):
        with open(os.path.join(path, "special_tokens_map.json")) as f:
            listed = json.load(f).get("additional_special_tokens", [])
    names = [s if isinstance(s, str) else s.get("content") for s in listed]  # a string or {"content": ...}
    special_tokens = [s for s in dict.fromkeys(names + [EOT]) if s]
    model = load_llama(path, device=device, attn_impl="flash" if torch.device(device).type == "cuda" else "naive")
    tokenizer = _tokenizer(os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt"), special_tokens,
                           model.vocab_size, path)
    with open(os.path.join(path, "config.json")) as f:
        return model, tokenizer, tokenizer.special_ids[EOT], {"llama_config": json.load(f)}


def _find(path, ckpt_path):
    """A tokenizer file as train.py stored it: as given, else next to the checkpoint, else in this repository."""
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (path, os.path.join(os.path.dirname(ckpt_path), os.path.basename(path)), os.path.join(here, path)):
        if os.path.isfile(cand):
            return cand
    raise FileNotFoundError(f"the checkpoint's tokenizer file {path!r} is missing: recreate it with `python "
                            f"data/prepare.py NAME` (the dataset the model was trained on; add --input FILE ... for "
                            f"your own text)")


def load_model(ckpt_path, device="cpu"):
    """-> (model in eval mode on device, Tokenizer, eot_id, checkpoint dict); a directory goes to load_llama_dir."""
    if os.path.isdir(ckpt_path):
        return load_llama_dir(ckpt_path, device)
    if not os.path.isfile(ckpt_path):
        raise FileNotFoundError(f"no checkpoint at {ckpt_path}: train a model first with `python train.py` "
                                f"(or point --out_dir / --ckpt at one)")
    ckpt = read_checkpoint(ckpt_path, needs=("model", "model_args", "tokenizer"))
    # the prompt runs through the cache's masked attention anyway; flash only serves windows past the context
    attn_impl = "flash" if torch.device(device).type == "cuda" else "naive"
    # names without the prefixes torch.compile and data-parallel wrappers add
    state = {re.sub(r"^((_orig_mod|module)\.)+", "", name): tensor for name, tensor in ckpt["model"].items()}
    try:
        model = TransformerLM(**dict(ckpt["model_args"], attn_impl=attn_impl, act_ckpt_every=0))
        model.load_state_dict(state, strict=True)
    except (TypeError, ValueError, RuntimeError) as e:
        detail = " ".join(str(e).split())  # load_state_dict's report spans lines
        raise RuntimeError(f"checkpoint {ckpt_path} does not match its model_args "
                           f"{ckpt['model_args']}: {detail}") from None
    tok = ckpt["tokenizer"]
    tokenizer = _tokenizer(_find(tok["vocab"], ckpt_path), _find(tok["merges"], ckpt_path),
                           list(tok.get("special_tokens") or [EOT]), model.vocab_size, "the checkpoint")
    return model.to(device).eval(), tokenizer, tokenizer.special_ids[EOT], ckpt


# ---------------------------------------------------------------------------------------------------------------
# the command line

def main(argv=None):
    args, error = cli(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        error(f"--device {device}: CUDA is not available on this machine")
    try:
        model, tokenizer, eot_id, _ = load_model(args.ckpt, device)
    except (FileNotFoundError, ValueError, RuntimeError, ImportError) as e:
        error(e)

    prompts = args.prompt
    if not prompts:  # a piped prompt; none where stdin is a terminal or closed
        piped = sys.stdin is not None and not sys.stdin.isatty()
        prompts = [sys.stdin.read() if piped else ""]
    texts = [text for text in prompts for _ in range(args.num_samples)]
    batch = [tokenizer.encode(text) if text else [eot_id] for text in texts]
    generator = torch.Generator(device=device).manual_seed(args.seed)
    use_bf16 = torch.device(device).type == "cuda" and torch.cuda.is_bf16_supported()
    try:  # a prompt longer than the context is refused by generate, naming --crop_prompt
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_bf16):
            outs = generate(model, batch, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            eot_id=eot_id, top_k=args.top_k, generator=generator, use_cache=not args.no_kv_cache,
                            crop_prompt=args.crop_prompt)
    except ValueError as e:
        error(e)
    for text, ids in zip(texts, outs):
        print(text + tokenizer.decode(ids))
        print("-" * 40, flush=True)


if __name__ == "__main__":
    main()
