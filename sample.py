"""Generate text from a checkpoint written by train.py.

    python sample.py                                   # out/ckpt.pt, 1 sample of 256 tokens from <|endoftext|>
    python sample.py --prompt "ROMEO:" --num_samples 3 --temperature 0.8 --top_p 0.9
    echo "To be, or not" | python sample.py --max_new_tokens 100
    python sample.py --prompt "KING:" --prompt "First Citizen:" --temperature 0   # batched prompts, greedy
    python sample.py --ckpt out/llama                  # a Llama-format directory (hf.save_llama)

Decoding keeps a KV cache (model.KVCache), so each new token runs the model on one position, not the whole prefix;
prompts of different lengths decode together in one batch.
"""
import argparse
import contextlib
import json
import os
import sys

import torch

from bpe import Tokenizer
from hf import load_llama
from model import TransformerLM, softmax

EOT = "<|endoftext|>"


# ---------------------------------------------------------------------------------------------------------------
# decoding
# ---------------------------------------------------------------------------------------------------------------

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
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate(model, prompt_ids, max_new_tokens, temperature=1.0, top_p=1.0, eot_id=None, top_k=0,
             generator=None, use_cache=True, crop_prompt=False):
    """Continue prompt_ids (a list of ids, or a list of such lists for a batch) by up to max_new_tokens ids.

    Returns the new ids only (a list, or a list of lists for a batch), stopping a row at eot_id, which is left out.
    Each step sees the last context_length tokens. A prompt longer than context_length is an error
    unless crop_prompt=True.
    use_cache=False runs the whole window every step: the reference the KV cache is held to (same greedy output).
    """
    if max_new_tokens < 0 or temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"need max_new_tokens >= 0, temperature >= 0, 0 < top_p <= 1, top_k >= 0; got "
                         f"{max_new_tokens}, {temperature}, {top_p}, {top_k}")
    if torch.is_tensor(prompt_ids):
        prompt_ids = prompt_ids.tolist()
    batched = len(prompt_ids) > 0 and not isinstance(prompt_ids[0], int)
    seqs = [list(p) for p in prompt_ids] if batched else [list(prompt_ids)]
    ctx = model.context_length
    for i, s in enumerate(seqs):
        if not s:
            raise ValueError(f"prompt {i} is empty: start it with the <|endoftext|> id")
        if len(s) > ctx and not crop_prompt:
            raise ValueError(f"prompt {i} has {len(s)} tokens but the model's context_length is {ctx}: shorten it "
                             f"or pass crop_prompt=True (sample.py: --crop_prompt) to keep its last {ctx} tokens")
    device = model.lm_head.weight.device
    autocast_on = torch.is_autocast_enabled(device.type)
    cache_dtype = torch.get_autocast_dtype(device.type) if autocast_on else model.lm_head.weight.dtype
    B = len(seqs)
    cache = model.make_kv_cache(B, dtype=cache_dtype) if use_cache else None
    new = [[] for _ in seqs]
    was_training = model.training
    model.eval()
    try:
        _decode(model, seqs, new, max_new_tokens, temperature, top_p, top_k, eot_id, generator, cache)
    finally:
        model.train(was_training)
    return new if batched else new[0]


def _decode(model, seqs, new, max_new_tokens, temperature, top_p, top_k, eot_id, generator, cache):
    """generate's loop: appends to seqs (prompt + new ids) and new (new ids only), row by row."""
    ctx, device, B = model.context_length, model.lm_head.weight.device, len(seqs)
    done = [False] * B
    for _ in range(max_new_tokens):
        lens = [len(s) for s in seqs]
        fits = max(lens) <= ctx  # once a window slides, positions shift and cached keys no longer apply
        if cache is not None and fits and 0 < cache.length < cache.max_len:
            # decode: every row feeds its last token at its own position (a finished row rewrites its last slot)
            idx = torch.tensor([[s[-1]] for s in seqs], device=device)
            pos = torch.tensor([[n - 1] for n in lens], device=device)
            logits = model(idx, position_ids=pos, kv_cache=cache)[:, -1]
        else:
            # whole windows, right-padded: causal attention keeps the padding out of every real token's view
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
        next_ids = sample_next(logits, temperature, top_p, top_k, generator).tolist()
        for b, t in enumerate(next_ids):
            if done[b]:
                continue
            if t == eot_id:
                done[b] = True
            else:
                seqs[b].append(t)
                new[b].append(t)
        if all(done):
            break


# ---------------------------------------------------------------------------------------------------------------
# loading a checkpoint and its tokenizer
# ---------------------------------------------------------------------------------------------------------------

def _find(path, ckpt_path, what):
    """Tokenizer paths are stored as written by train.py: try them as given, then next to the checkpoint, then
    relative to this repository."""
    here = os.path.dirname(os.path.abspath(__file__))
    for cand in (path, os.path.join(os.path.dirname(ckpt_path), os.path.basename(path)), os.path.join(here, path)):
        if os.path.isfile(cand):
            return cand
    raise FileNotFoundError(f"the checkpoint's tokenizer {what} {path!r} is missing: recreate it with "
                            f"`python data/prepare.py NAME` (the dataset the model was trained on)")


def load_llama_dir(path, device="cpu"):
    """A Llama-format directory (config.json + model.safetensors, e.g. from hf.save_llama) with our tokenizer
    files beside it -> (model in eval mode on device, Tokenizer, eot_id, {"llama_config": its config.json}).
    The tokenizer must be our BPE's vocab.json + merges.txt (tokenizer.json is not read); special tokens come from
    special_tokens_map.json when present, else <|endoftext|>."""
    missing = [name for name in ("vocab.json", "merges.txt") if not os.path.isfile(os.path.join(path, name))]
    if missing:
        raise FileNotFoundError(f"Llama directory {path} has no {' or '.join(missing)}: sample.py needs our BPE "
                                f"tokenizer files beside the weights (hf.save_llama(..., tokenizer=tok) writes "
                                f"them; Hugging Face tokenizer.json is not read)")
    special_tokens = [EOT]
    specials_path = os.path.join(path, "special_tokens_map.json")
    if os.path.isfile(specials_path):
        with open(specials_path) as f:
            specials = json.load(f)
        listed = [s if isinstance(s, str) else s.get("content") for s in specials.get("additional_special_tokens", [])]
        special_tokens = list(dict.fromkeys([s for s in listed if s] + [EOT]))
    attn_impl = "flash" if torch.device(device).type == "cuda" else "naive"
    model = load_llama(path, device=device, attn_impl=attn_impl)
    tokenizer = Tokenizer.from_files(os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt"),
                                     special_tokens=special_tokens)
    num_tokens = max(tokenizer.vocab) + 1
    if model.vocab_size != num_tokens:
        raise ValueError(f"vocabulary mismatch: {path}'s model has vocab_size {model.vocab_size} but its tokenizer "
                         f"has {num_tokens} tokens")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    return model, tokenizer, tokenizer.special_ids[EOT], {"llama_config": config}


def load_model(ckpt_path, device="cpu"):
    """-> (model in eval mode on device, Tokenizer, eot_id, checkpoint dict). A directory is read as a Llama-format
    checkpoint (load_llama_dir)."""
    if os.path.isdir(ckpt_path):
        return load_llama_dir(ckpt_path, device)
    if not os.path.isfile(ckpt_path):
        raise FileNotFoundError(f"no checkpoint at {ckpt_path}: train a model first with `python train.py` "
                                f"(or point --out_dir / --ckpt at one)")
    try:
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=True)
    except Exception as e:
        raise RuntimeError(f"cannot read checkpoint {ckpt_path}: the file is corrupt or truncated ({e})") from e
    missing = [key for key in ("model", "model_args", "tokenizer") if key not in ckpt] if isinstance(ckpt, dict) \
        else ["model", "model_args", "tokenizer"]
    if missing:
        raise RuntimeError(f"checkpoint {ckpt_path} lacks {missing}: not a checkpoint written by train.py")

    model_args = dict(ckpt["model_args"])
    # the prompt runs through the cache's masked attention anyway; flash only serves windows past the context
    model_args["attn_impl"] = "flash" if torch.device(device).type == "cuda" else "naive"
    model_args["act_ckpt_every"] = 0
    model = TransformerLM(**model_args)
    prefixes = ("_orig_mod.", "module.")  # added by torch.compile and by data-parallel wrappers
    state = {}
    for name, tensor in ckpt["model"].items():
        while name.startswith(prefixes):
            name = name.split(".", 1)[1]
        state[name] = tensor
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise RuntimeError(f"checkpoint {ckpt_path} does not match its model_args {ckpt['model_args']}: {e}") from e
    model.to(device).eval()

    tok = ckpt["tokenizer"]
    vocab_path = _find(tok["vocab"], ckpt_path, "vocab")
    merges_path = _find(tok["merges"], ckpt_path, "merges")
    special_tokens = list(tok.get("special_tokens") or [EOT])
    tokenizer = Tokenizer.from_files(vocab_path, merges_path, special_tokens=special_tokens)
    if EOT not in tokenizer.special_ids:
        raise ValueError(f"the checkpoint's tokenizer has no {EOT} special token (special_tokens={special_tokens})")
    num_tokens = max(tokenizer.vocab) + 1
    if model.vocab_size != num_tokens:
        raise ValueError(f"vocabulary mismatch: the checkpoint's model has vocab_size {model.vocab_size} but its "
                         f"tokenizer ({vocab_path}) has {num_tokens} tokens")
    return model, tokenizer, tokenizer.special_ids[EOT], ckpt


def main(argv=None):
    p = argparse.ArgumentParser(description="Generate text from a train.py checkpoint.")
    p.add_argument("--out_dir", default="out", help="where train.py wrote ckpt.pt")
    p.add_argument("--ckpt", default=None, help="checkpoint path (default OUT_DIR/ckpt.pt), or a Llama-format "
                   "directory (config.json + model.safetensors + our vocab.json / merges.txt)")
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt text; repeat for a batch of prompts; default: read stdin if piped, else start "
                        "from <|endoftext|>")
    p.add_argument("--num_samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_p", type=float, default=0.9, help="1 = off")
    p.add_argument("--top_k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--crop_prompt", action="store_true", help="keep the last context_length tokens of a long prompt")
    p.add_argument("--no_kv_cache", action="store_true", help="rerun the whole window every step (slow; a check)")
    args = p.parse_args(argv)
    for bad, msg in ((args.num_samples < 1, "--num_samples must be >= 1"),
                     (args.max_new_tokens < 0, "--max_new_tokens must be >= 0"),
                     (args.temperature < 0, "--temperature must be >= 0 (0 = greedy)"),
                     (not 0 < args.top_p <= 1, "--top_p must be in (0, 1]"),
                     (args.top_k < 0, "--top_k must be >= 0 (0 = off)")):
        if bad:
            p.error(msg)

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {device}: CUDA is not available on this machine")
    ckpt_path = args.ckpt or os.path.join(args.out_dir, "ckpt.pt")
    try:
        model, tokenizer, eot_id, _ = load_model(ckpt_path, device)
    except (FileNotFoundError, ValueError, RuntimeError, ImportError) as e:
        sys.exit(f"sample.py: {e}")

    prompts = args.prompt
    if prompts is None:
        prompts = [sys.stdin.read()] if not sys.stdin.isatty() else [""]
    batch, texts = [], []
    for text in prompts:
        ids = tokenizer.encode(text) if text else [eot_id]
        batch += [ids] * args.num_samples
        texts += [text] * args.num_samples

    torch.manual_seed(args.seed)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    use_bf16 = torch.device(device).type == "cuda" and torch.cuda.is_bf16_supported()
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()
    longest = max(len(ids) for ids in batch)
    if longest > model.context_length and not args.crop_prompt:
        sys.exit(f"sample.py: the prompt has {longest} tokens but the model's context_length is "
                 f"{model.context_length}: shorten it, or pass --crop_prompt to keep its last "
                 f"{model.context_length} tokens")
    with amp:
        outs = generate(model, batch, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        eot_id=eot_id, top_k=args.top_k, generator=generator, use_cache=not args.no_kv_cache,
                        crop_prompt=args.crop_prompt)
    for text, ids in zip(texts, outs):
        print(text + tokenizer.decode(ids))
        print("-" * 40, flush=True)


if __name__ == "__main__":
    main()
