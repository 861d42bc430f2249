"""The Hugging Face and Llama bridge, the one file that needs the optional extras (requirements-extra.txt; imported
inside the functions that use them, so this file imports without them).

  1. Llama-format checkpoints (needs safetensors): save_llama writes a directory that
     LlamaForCausalLM and AutoTokenizer read; read_llama / load_llama read one back;
     llama_init is train.py's init_from=<directory>.
  2. flash.py's kernels inside transformers: register_hf_attention() adds hf_attention and its mask hook, so
     AutoModelForCausalLM.from_config(cfg, attn_implementation="ours") runs them, padding-free where it can.
"""
import inspect
import json
import math
import os
import weakref
import zlib

import torch
import torch.nn as nn

from bpe import atomic_open, bytes_to_unicode
from flash import flash_attention, flash_attn_varlen
from model import RMSNorm, RotaryEmbedding, TransformerLM

# ---------------------------------------------------------------------------------------------------------------
# 1. Llama-format checkpoints. The architectures are the same except for which two elements of a head vector RoPE
#    turns together: ours pairs neighbours (x[2j], x[2j+1]), Llama's rotate-half pairs halves (x[j], x[j + d_k/2]),
#    at the same frequency. Reordering the rows of q_proj and k_proj inside every head turns one into the other (a
#    score q . k sums over the pairs, so it does not change); the other weights keep their rows. config.json is
#    plain JSON written here, so export and load need neither transformers nor a network.
# ---------------------------------------------------------------------------------------------------------------

LLAMA_WEIGHTS = "model.safetensors"
LLAMA_INDEX = "model.safetensors.index.json"  # sharded checkpoints: {"weight_map": {tensor name: file}}
_LLAMA_LAYER_NAMES = (  # (ours, Llama's) .weight inside layer i; SwiGLU's w1 is gate_proj (under SiLU), w3 up, w2 down
    ("ln1", "input_layernorm"), ("attn.q_proj", "self_attn.q_proj"), ("attn.k_proj", "self_attn.k_proj"),
    ("attn.v_proj", "self_attn.v_proj"), ("attn.output_proj", "self_attn.o_proj"), ("ln2", "post_attention_layernorm"),
    ("ffn.w1", "mlp.gate_proj"), ("ffn.w3", "mlp.up_proj"), ("ffn.w2", "mlp.down_proj"))
_LLAMA_ROPE_ROWS = ("attn.q_proj.weight", "attn.k_proj.weight")


def _safetensors():
    try:
        import safetensors.torch
        return safetensors.torch
    except ImportError as e:
        raise ImportError("Llama-format checkpoints need safetensors: pip install -r requirements-extra.txt") from e


def llama_rope_rows(w, num_heads, to_llama=True):
    """Rows of a q/k projection (num_heads * d_k, d_model) from our RoPE pairing to Llama's: inside each head, rows
    2j and 2j+1 (one rotated pair) move to rows j and j + d_k/2; to_llama=False moves them back."""
    d_k = w.shape[0] // num_heads
    pairs = (num_heads, d_k // 2, 2, -1) if to_llama else (num_heads, 2, d_k // 2, -1)
    return w.reshape(pairs).transpose(1, 2).reshape(w.shape)


def _llama_names(num_layers, tied):
    """{our state-dict name: Llama's}; a tied lm_head is left out (tie_word_embeddings shares the embedding)."""
    names = {"token_embeddings.weight": "model.embed_tokens.weight", "ln_final.weight": "model.norm.weight"}
    if not tied:
        names["lm_head.weight"] = "lm_head.weight"
    names.update({f"layers.{i}.{mine}.weight": f"model.layers.{i}.{theirs}.weight"
                  for i in range(num_layers) for mine, theirs in _LLAMA_LAYER_NAMES})
    return names


def rope_theta_of(model):
    """rope_theta of a TransformerLM, read back from its RoPE tables: pair 1 at position 1 turns by theta^(-2/d_k);
    the first rounding of that estimate (1, 2, ... significant digits) that rebuilds the tables bit for bit."""
    rope = model.layers[0].attn.rope
    if rope is None:
        raise ValueError("the model has no RoPE (rope_theta=None): Llama has no equivalent")
    d_k = model.d_model // model.num_heads
    if d_k < 4:
        return 10000.0  # one pair per head, which turns at frequency 1 whatever theta is
    if rope.cos.shape[0] >= 2:
        estimate = math.atan2(float(rope.sin[1, 1]), float(rope.cos[1, 1])) ** (-d_k / 2)
        for digits in range(1, 10):
            candidate = float(f"{estimate:.{digits}g}")
            rebuilt = RotaryEmbedding(candidate, d_k, rope.cos.shape[0])
            if torch.equal(rebuilt.cos, rope.cos.cpu()) and torch.equal(rebuilt.sin, rope.sin.cpu()):
                return candidate
    raise ValueError("cannot tell the model's rope_theta from its RoPE tables: pass it (save_llama(..., "
                     "rope_theta=...))")


def llama_config(model, rope_theta=None):
    """LlamaForCausalLM's config.json for a TransformerLM: no GQA, no biases, SiLU, positions = context_length."""
    theta = rope_theta_of(model) if rope_theta is None else float(rope_theta)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": model.vocab_size,
        "hidden_size": model.d_model, "intermediate_size": model.layers[0].ffn.w1.out_features,
        "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_heads, "head_dim": model.d_model // model.num_heads, "hidden_act": "silu",
        "max_position_embeddings": model.context_length, "rms_norm_eps": model.ln_final.eps,
        "tie_word_embeddings": model.token_embeddings.weight is model.lm_head.weight,
        # both spellings: older transformers read rope_theta, newer ones rope_parameters
        "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
        "initializer_range": 0.02, "use_cache": True, "dtype": str(model.lm_head.weight.dtype).replace("torch.", ""),
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def llama_state_dict(model):
    """Our weights under Llama's names (CPU tensors, q/k rows reordered for rotate-half RoPE)."""
    ours, out = model.state_dict(), {}
    tied = model.token_embeddings.weight is model.lm_head.weight
    for mine, theirs in _llama_names(model.num_layers, tied).items():
        w = ours[mine].detach().cpu()
        out[theirs] = llama_rope_rows(w, model.num_heads) if mine.endswith(_LLAMA_ROPE_ROWS) else w
    return out


def save_llama(model, out_dir, tokenizer=None, rope_theta=None, overwrite=False):
    """Write out_dir/config.json and model.safetensors (a CRC-32 per tensor in its metadata)
    that LlamaForCausalLM.from_pretrained(out_dir) loads into the same function as `model` (a
    TransformerLM, or a torch.compile / DDP wrapper of one). tokenizer (a bpe.Tokenizer): our
    vocab.json and merges.txt beside them, and the tokenizer.json and tokenizer_config.json
    AutoTokenizer reads; <|endoftext|> as bos/eos id. Existing files are an error unless
    overwrite=True; each file is written to a temporary name and renamed, config.json last."""
    while hasattr(model, "_orig_mod") or isinstance(getattr(model, "module", None), nn.Module):
        model = model._orig_mod if hasattr(model, "_orig_mod") else model.module
    if not isinstance(model, TransformerLM):
        raise TypeError(f"save_llama needs a TransformerLM, got {type(model).__name__}")
    st, config, tensors = _safetensors(), llama_config(model, rope_theta), llama_state_dict(model)
    os.makedirs(out_dir, exist_ok=True)
    names = ["config.json", LLAMA_WEIGHTS]
    if tokenizer is not None:
        names += ["vocab.json", "merges.txt", "special_tokens_map.json", *HF_TOKENIZER_FILES]
    existing = [n for n in names if os.path.exists(os.path.join(out_dir, n))]
    if existing and not overwrite:
        raise FileExistsError(f"save_llama: {out_dir} already holds {', '.join(existing)} (pass overwrite=True)")
    if tokenizer is not None:
        eot = tokenizer.special_ids.get("<|endoftext|>")
        config.update(bos_token_id=eot, eos_token_id=eot)
        tokenizer.save(out_dir)
        specials = {"additional_special_tokens": list(tokenizer.special_ids)}
        if eot is not None:
            specials.update(bos_token="<|endoftext|>", eos_token="<|endoftext|>")
        with atomic_open(os.path.join(out_dir, "special_tokens_map.json")) as f:
            json.dump(specials, f, indent=1)
        hf_files = hf_tokenizer_files(tokenizer, model.context_length)
        for name, content in zip(HF_TOKENIZER_FILES, hf_files):
            with atomic_open(os.path.join(out_dir, name), encoding="utf-8") as f:
                json.dump(content, f, indent=1, ensure_ascii=False)
    crcs = json.dumps({name: _crc32(t) for name, t in tensors.items()})
    with atomic_open(os.path.join(out_dir, LLAMA_WEIGHTS), "wb") as f:
        f.write(st.save(tensors, metadata={"format": "pt", "crc32": crcs}))
    with atomic_open(os.path.join(out_dir, "config.json")) as f:  # last: its presence means the directory is done
        json.dump(config, f, indent=2)
    return out_dir


HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def hf_tokenizer_files(tokenizer, max_length):
    """(tokenizer.json, tokenizer_config.json) as dicts: a bpe.Tokenizer in the format of
    Hugging Face tokenizers, which AutoTokenizer.from_pretrained reads. GPT-2's byte-level
    BPE: the regex pre-tokenizer, merges applied by rank, the special tokens matched first
    (the longest wins) as added tokens."""
    byte_char = bytes_to_unicode()

    def text(token):
        return "".join(byte_char[x] for x in token)
    # as vocab.json: specials verbatim (an added token takes its text's id), the rest mapped
    special_ids = set(tokenizer.special_ids.values())
    ordinary = sorted(i for i in tokenizer.vocab if i not in special_ids)
    vocab = {text(tokenizer.vocab[i]): i for i in ordinary}
    vocab.update(tokenizer.special_ids)
    merges = [f"{text(a)} {text(b)}" for a, b in tokenizer.merges]  # no mapped byte is a space
    added = []
    for content, i in sorted(tokenizer.special_ids.items(), key=lambda item: item[1]):
        added.append(dict(id=i, content=content, single_word=False, lstrip=False,
                          rstrip=False, normalized=False, special=True))
    byte_level = dict(type="ByteLevel", add_prefix_space=False, trim_offsets=True,
                      use_regex=True)
    bpe = dict(type="BPE", dropout=None, unk_token=None, continuing_subword_prefix=None,
               end_of_word_suffix=None, fuse_unk=False, byte_fallback=False,
               ignore_merges=False, vocab=vocab, merges=merges)
    tokenizer_json = dict(version="1.0", truncation=None, padding=None, added_tokens=added,
                          normalizer=None, pre_tokenizer=byte_level, post_processor=None,
                          decoder=byte_level, model=bpe)
    eot = "<|endoftext|>"
    if eot not in tokenizer.special_ids:
        eot = None
    config = dict(tokenizer_class="PreTrainedTokenizerFast", model_max_length=max_length,
                  bos_token=eot, eos_token=eot, clean_up_tokenization_spaces=False)
    return tokenizer_json, config


def _llama_tensors(path):
    """Every tensor of a Llama directory (model.safetensors, or the shards its index names), on the CPU."""
    index = os.path.join(path, LLAMA_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, LLAMA_WEIGHTS)):
        files = [LLAMA_WEIGHTS]
    else:
        raise FileNotFoundError(f"{path} has neither {LLAMA_WEIGHTS} nor {LLAMA_INDEX}: not a safetensors Llama "
                                f"checkpoint (pytorch_model.bin is not read)")
    tensors = {}
    for name in files:
        tensors.update(_read_safetensors(os.path.join(path, name)))
    return tensors


def _crc32(tensor):
    return zlib.crc32(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def _read_safetensors(path):
    """The tensors of a safetensors file, each checked against the CRC-32 save_llama
    records in its metadata (safetensors itself keeps no checksum; other writers: none)."""
    st = _safetensors()
    try:
        with st.safe_open(path, framework="pt") as f:
            crcs = json.loads((f.metadata() or {}).get("crc32", "{}"))
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:
        detail = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise RuntimeError(f"cannot read {path}: truncated or corrupt, or not a "
                           f"safetensors file ({detail})") from None
    for name, tensor in tensors.items():
        if name in crcs and _crc32(tensor) != crcs[name]:
            raise RuntimeError(f"{path} is damaged: tensor {name} does not match the "
                               f"CRC-32 saved with it (a disk or copy error)")
    return tensors


def read_llama(path):
    """A Llama directory as (model_args for TransformerLM, state dict under our names, rms_norm_eps). Only what
    TransformerLM can express is accepted; anything else (GQA, biases, another activation, RoPE scaling, a head dim
    other than hidden_size / heads) is an error naming the setting."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no config.json in {path}: not a Llama checkpoint directory")
    with open(config_path) as f:
        try:
            cfg = json.load(f)
        except ValueError as e:
            raise ValueError(f"{config_path} is not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{config_path} is not a JSON object")
    if cfg.get("model_type", "llama") != "llama":
        raise ValueError(f"{config_path}: model_type {cfg['model_type']!r}, expected 'llama'")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in cfg]
    if missing:
        raise ValueError(f"{config_path} lacks {', '.join(missing)}")
    d_model, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    expected = dict(num_key_value_heads=heads, head_dim=d_model // heads, hidden_act="silu", attention_bias=False,
                    mlp_bias=False)
    unsupported = [f"{k}={cfg[k]!r} (needs {want!r})" for k, want in expected.items()
                   if cfg.get(k) is not None and cfg[k] != want]
    rope = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        unsupported.append(f"rope_type={rope_type!r} (needs 'default')")
    if unsupported:
        raise ValueError(f"{config_path}: TransformerLM cannot express " + ", ".join(unsupported))
    tied = bool(cfg.get("tie_word_embeddings", False))
    model_args = dict(vocab_size=cfg["vocab_size"], context_length=cfg.get("max_position_embeddings", 2048),
                      d_model=d_model, num_layers=layers, num_heads=heads, d_ff=cfg["intermediate_size"],
                      rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))), tie_embeddings=tied)
    tensors = _llama_tensors(path)
    if tied:
        tensors.pop("lm_head.weight", None)  # some writers store the shared matrix twice
    rename = {theirs: mine for mine, theirs in _llama_names(layers, tied).items()}
    absent = [name for name in rename if name not in tensors]
    extra = [name for name in tensors if name not in rename and not name.endswith("rotary_emb.inv_freq")]
    if absent or extra:
        few = lambda names: f"{names[:4]}{' ...' if len(names) > 4 else ''}"
        raise ValueError(f"{path}: tensors do not match its config.json: missing {few(absent)}, "
                         f"unexpected {few(extra)}")
    state = {mine: tensors[theirs] for theirs, mine in rename.items()}
    for name in state:
        if name.endswith(_LLAMA_ROPE_ROWS):
            state[name] = llama_rope_rows(state[name], heads, to_llama=False)
    if tied:
        state["lm_head.weight"] = state["token_embeddings.weight"]
    return model_args, state, float(cfg.get("rms_norm_eps", 1e-5))


def load_llama(path, device=None, attn_impl="naive", dtype=None, act_ckpt_every=0):
    """A TransformerLM in eval mode holding the weights of a Llama directory (ours from save_llama, or
    LlamaForCausalLM's save_pretrained without GQA); fp32 unless dtype is given, RMSNorm eps from rms_norm_eps."""
    model_args, state, eps = read_llama(path)
    model = TransformerLM(**model_args, attn_impl=attn_impl, act_ckpt_every=act_ckpt_every, dtype=dtype)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise RuntimeError(f"{path}: tensor shapes do not match its config.json: {e}") from e
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.eps = eps
    return model.to(device).eval() if device is not None else model.eval()


def llama_init(path, vocab_size=None, context_length=None):
    """train.py's init_from=<Llama directory>: (model_args, state dict) for a TransformerLM, checked against the run:
    the dataset's vocab_size must be the checkpoint's, context_length must fit its max_position_embeddings, and its
    RMSNorm eps must be TransformerLM's (model_args has no eps, so a resumed run could not restore another)."""
    model_args, state, eps = read_llama(path)
    default_eps = inspect.signature(RMSNorm).parameters["eps"].default
    if eps != default_eps:
        raise ValueError(f"{path}: rms_norm_eps={eps}, but TransformerLM's RMSNorm uses {default_eps}")
    if vocab_size is not None and model_args["vocab_size"] != vocab_size:
        raise ValueError(f"{path} has vocab_size {model_args['vocab_size']} but the dataset has {vocab_size}: "
                         f"fine-tune on data tokenized with the checkpoint's tokenizer")
    if context_length is not None and context_length > model_args["context_length"]:
        raise ValueError(f"context_length={context_length} exceeds {path}'s max_position_embeddings "
                         f"{model_args['context_length']}")
    return model_args, state


# ---------------------------------------------------------------------------------------------------------------
# 2. Hugging Face attention: hf_attention runs flash.py's kernels inside a transformers model. What a call attends to:
#    - cu_seq_lens_q / max_length_q (DataCollatorWithFlattening(return_flash_attn_kwargs=True)): the packed
#      documents they name, by flash_attn_varlen with no host read (the path to compile);
#    - a 2-D padding mask: each row (one document) as three varlen segments, pads / real tokens / pads, cut on the
#      device (a fixed shape); a pad between real tokens is an error;
#    - position_ids alone: a document starts where a position does not follow the previous one; read on the host
#      once per forward (no restart: the dense kernel); compiled, every token is a boundary (a fixed shape, but
#      programs launch for each of the many empty segments);
#    - none of these: dense flash_attention.
#    Another `scaling` than 1/sqrt(d) is folded into q. Dropout, sliding windows, softcapping, attention sinks, 4-D
#    masks and fewer queries than keys (KV-cache decoding: generate with sdpa) are clear errors.
# ---------------------------------------------------------------------------------------------------------------

_HF_DOCS = {}  # eager only: the last position_ids tensor seen -> its documents (every layer of a forward shares it)


def _hf_fail(what):
    raise ValueError(f"hf_attention: {what}")


def _hf_boundaries(position_ids, batch, seqlen):
    """The documents position_ids mark in a (batch, seqlen) batch, with no host read: boundary t (int32) is the first
    token of token t's document, then comes the end; nondecreasing, so the segments between equal ones are empty."""
    pos = position_ids.expand(batch, seqlen)
    starts = torch.ones(batch, seqlen, dtype=torch.bool, device=pos.device)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    first = torch.cummax(torch.where(starts.flatten(), torch.arange(batch * seqlen, device=pos.device), 0), 0).values
    return torch.cat([first, first.new_full((1,), batch * seqlen)]).to(torch.int32)


def _hf_documents_eager(position_ids, batch, seqlen):
    """(cu_seqlens, max_seqlen) of those documents, each boundary once, or None when every row is one document;
    read on the host once per position_ids tensor."""
    cached = _HF_DOCS.get("entry")
    if cached is not None and cached[0]() is position_ids and cached[1] == position_ids._version:
        return cached[2]
    cu, docs = torch.unique_consecutive(_hf_boundaries(position_ids, batch, seqlen)), None
    if len(cu) > batch + 1:
        docs = cu, int((cu[1:] - cu[:-1]).max())
    _HF_DOCS["entry"] = (weakref.ref(position_ids), position_ids._version, docs)
    return docs


def _hf_runs(mask):
    """Per row of a (batch, seqlen) padding mask (True = real token): its first real token (0 for none), its number
    of real tokens, and whether they form one run (no pad between two real tokens)."""
    real = mask.sum(dim=-1)
    first = mask.to(torch.int8).argmax(dim=-1)
    last = mask.shape[-1] - 1 - mask.flip(-1).to(torch.int8).argmax(dim=-1)
    return first, real, (real == 0) | (last - first + 1 == real)


def _hf_segments(mask):
    """A padding mask as 3 segments per row, pads / real tokens / pads: 3 * batch + 1 int32 boundaries."""
    (batch, seqlen), (first, real, _) = mask.shape, _hf_runs(mask)
    row = torch.arange(batch, device=mask.device) * seqlen
    cu = torch.stack([row, row + first, row + first + real], dim=-1).flatten()
    return torch.cat([cu, cu.new_full((1,), batch * seqlen)]).to(torch.int32)


def hf_attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                      attention_mask=None, **kwargs):
    """transformers' mask hook for hf_attention: the 2-D padding mask (batch, kv_length) as booleans, or None when
    there is none (or, eagerly, when it has no pad). Checked here, once per forward: a mask with a hole is an error
    (eagerly a ValueError; under torch.compile an assertion on the device)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        _hf_fail(f"only 2-D padding masks (batch, keys) can be honoured, got shape {tuple(attention_mask.shape)}")
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    ok = _hf_runs(mask)[2]
    if torch.compiler.is_compiling():
        torch._assert_async(ok.all(), "hf_attention: a padding mask with a pad between real tokens")
        return mask
    if not bool(ok.all()):
        _hf_fail(f"padding mask rows {(~ok).nonzero().flatten().tolist()[:8]} have a pad between real tokens: only "
                 f"one run of real tokens per row (left and/or right padding) can be honoured")
    return None if bool(mask.all()) else mask


def hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=None,
                 sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers' attention hook (see the section comment): query (B, H, S, D), key/value (B, H_kv, S_k, D),
    attention_mask from hf_attention_mask -> (output (B, S, H, D), None)."""
    if dropout:
        _hf_fail(f"attention dropout ({dropout}) is not implemented: set the config's attention dropout "
                 f"(attn_pdrop / attention_dropout) to 0")
    for name, val in (("sliding_window", sliding_window), ("softcap", softcap), ("s_aux", s_aux)):
        if val is not None:
            _hf_fail(f"{name} is not supported")
    if attention_mask is not None and (not torch.is_tensor(attention_mask) or attention_mask.dim() != 2):
        _hf_fail("got a mask that is not a 2-D padding mask: build the model with this attention's name so its "
                 "mask hook (hf_attention_mask) makes the mask")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    B, H, S, D = query.shape
    if key.shape[2] != S:
        _hf_fail(f"{S} queries against {key.shape[2]} keys (decoding with a KV cache) is not supported: use "
                 f"attn_implementation='sdpa' to generate")
    key, value = key.to(query.dtype), value.to(query.dtype)
    if scaling is not None and not math.isclose(scaling, D ** -0.5, rel_tol=1e-6):
        query = query * (scaling * math.sqrt(D))  # the kernels scale by 1/sqrt(D)

    def packed(cu, max_seqlen, cu_k=None, max_k=None):
        flat = lambda x: x.transpose(1, 2).reshape(B * S, x.shape[1], D)  # a view for HF's (B, S, H, D) memory
        out = flash_attn_varlen(flat(query), flat(key), flat(value), cu, max_seqlen, causal=causal,
                                cu_seqlens_k=cu_k, max_seqlen_k=max_k)
        return out.view(B, S, H, D), None

    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is not None:
        if attention_mask is not None or B != 1:
            _hf_fail("cu_seq_lens_q describes one packed row (batch 1) without a padding mask, got batch "
                     f"{B}{' and a mask' if attention_mask is not None else ''}")
        max_q = kwargs.get("max_length_q")
        if max_q is None:
            _hf_fail("cu_seq_lens_q needs max_length_q (a Python int, the longest document)")
        cu_k = kwargs.get("cu_seq_lens_k")
        cu_k = None if cu_k is None or cu_k is cu_q else cu_k.to(torch.int32)
        max_k = kwargs.get("max_length_k", max_q) if cu_k is not None else None
        return packed(cu_q.to(torch.int32), max_q, cu_k, max_k)
    if attention_mask is not None:
        return packed(_hf_segments(attention_mask), S)
    position_ids = kwargs.get("position_ids")
    if position_ids is not None:
        if torch.compiler.is_compiling():  # every token's boundary: a fixed shape
            cu = _hf_boundaries(position_ids, B, S)
            bound = getattr(getattr(module, "config", None), "max_position_embeddings", None) or S
            if bound < S:  # a document longer than the model's positions cannot be valid
                torch._assert_async((cu[1:] - cu[:-1]).max() <= bound, "hf_attention: a document is longer than "
                                    "max_position_embeddings")
            return packed(cu, min(bound, S))
        docs = _hf_documents_eager(position_ids, B, S)
        if docs is not None:
            return packed(*docs)
    return flash_attention(query, key, value, causal=causal).transpose(1, 2), None


# transformers gives names holding these its own meaning ("flash": a FlashAttention kernel to fetch from the hub)
HF_RESERVED = ("flash", "sdpa", "flex", "eager", "paged", "|", "/")


def register_hf_attention(name="ours"):
    """Register hf_attention and its mask hook with transformers under `name`; returns the name. Then
    AutoModelForCausalLM.from_config(cfg, attn_implementation=name) (or model.set_attn_implementation(name)) uses
    these kernels. Needs transformers (requirements-extra.txt)."""
    clash = [word for word in HF_RESERVED if word in name]
    if clash or not name:
        raise ValueError(f"register_hf_attention: name {name!r} contains {clash or 'nothing'}; transformers reads "
                         f"names containing {', '.join(map(repr, HF_RESERVED))} as its own implementations")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError("register_hf_attention needs transformers: pip install -r requirements-extra.txt") from e
    AttentionInterface.register(name, hf_attention)
    AttentionMaskInterface.register(name, hf_attention_mask)
    return name
