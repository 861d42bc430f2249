"""The Hugging Face and Llama bridge: the one file needing the optional
extras (requirements-extra.txt), imported where they are used.

  1. Llama-format checkpoints: save_llama writes a directory that
     LlamaForCausalLM and AutoTokenizer read; load_llama reads one back;
     llama_init is train.py's init_from=<directory>.
  2. flash.py's kernels inside transformers (register_hf_attention).
"""
import inspect
import json
import math
import os
import weakref
import zlib

import torch

from bpe import atomic_open
from flash import flash_attention, flash_attn_varlen
from model import RMSNorm, RotaryEmbedding, TransformerLM, unwrap

# ---- 1. Llama-format checkpoints
# Only RoPE's pairs differ: ours turns (x[2j], x[2j+1]), Llama's
# (x[j], x[j + d_k/2]); reordering the rows of q_proj and k_proj in each
# head maps one onto the other.

LLAMA_WEIGHTS = "model.safetensors"
LLAMA_INDEX = "model.safetensors.index.json"
# (ours, Llama's) .weight in layer i; SwiGLU's w1 (under SiLU) is gate_proj
_LLAMA_LAYER_NAMES = (
    ("ln1", "input_layernorm"),
    ("attn.q_proj", "self_attn.q_proj"),
    ("attn.k_proj", "self_attn.k_proj"),
    ("attn.v_proj", "self_attn.v_proj"),
    ("attn.output_proj", "self_attn.o_proj"),
    ("ln2", "post_attention_layernorm"),
    ("ffn.w1", "mlp.gate_proj"),
    ("ffn.w3", "mlp.up_proj"),
    ("ffn.w2", "mlp.down_proj"))
_LLAMA_ROPE_ROWS = ("attn.q_proj.weight", "attn.k_proj.weight")
EOT = "<|endoftext|>"


def _safetensors():
    try:
        import safetensors.torch
        return safetensors.torch
    except ImportError as e:
        raise ImportError("Llama-format checkpoints need safetensors: pip "
                          "install -r requirements-extra.txt") from e


def llama_rope_rows(w, num_heads, to_llama=True):
    """Rows of a q/k projection from our RoPE pairing to Llama's: in each
    head, rows 2j and 2j+1 move to j and j + d_k/2 (to_llama=False: back)."""
    d_k = w.shape[0] // num_heads
    pairs = (num_heads, d_k // 2, 2, -1)
    if not to_llama:
        pairs = (num_heads, 2, d_k // 2, -1)
    return w.reshape(pairs).transpose(1, 2).reshape(w.shape)


def _llama_names(num_layers, tied):
    """{our state-dict name: Llama's}; without a tied lm_head."""
    names = {"token_embeddings.weight": "model.embed_tokens.weight",
             "ln_final.weight": "model.norm.weight"}
    if not tied:
        names["lm_head.weight"] = "lm_head.weight"
    for i in range(num_layers):
        for mine, theirs in _LLAMA_LAYER_NAMES:
            ours = f"layers.{i}.{mine}.weight"
            names[ours] = f"model.layers.{i}.{theirs}.weight"
    return names


def rope_theta_of(model):
    """rope_theta read back from the RoPE tables: pair 1 at position 1
    turns by theta^(-2/d_k); the shortest rounding of that estimate that
    rebuilds the tables bit for bit."""
    rope = model.layers[0].attn.rope
    if rope is None:
        raise ValueError("the model has no RoPE (rope_theta=None): Llama "
                         "has no equivalent")
    d_k = model.d_model // model.num_heads
    if d_k < 4:
        return 10000.0  # one pair per head: frequency 1 whatever theta is
    if rope.cos.shape[0] >= 2:
        angle = math.atan2(float(rope.sin[1, 1]), float(rope.cos[1, 1]))
        estimate = angle ** (-d_k / 2)
        for digits in range(1, 10):
            candidate = float(f"{estimate:.{digits}g}")
            rebuilt = RotaryEmbedding(candidate, d_k, rope.cos.shape[0])
            same_cos = torch.equal(rebuilt.cos, rope.cos.cpu())
            if same_cos and torch.equal(rebuilt.sin, rope.sin.cpu()):
                return candidate
    raise ValueError("cannot tell the model's rope_theta from its RoPE "
                     "tables: pass it (save_llama(..., rope_theta=...))")


def llama_config(model, rope_theta=None):
    """LlamaForCausalLM's config.json for a TransformerLM."""
    theta = rope_theta_of(model) if rope_theta is None else float(rope_theta)
    dtype = str(model.lm_head.weight.dtype).replace("torch.", "")
    tied = model.token_embeddings.weight is model.lm_head.weight
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": model.vocab_size, "hidden_size": model.d_model,
        "intermediate_size": model.layers[0].ffn.w1.out_features,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_heads,
        "head_dim": model.d_model // model.num_heads, "hidden_act": "silu",
        "max_position_embeddings": model.context_length,
        "rms_norm_eps": model.ln_final.eps, "tie_word_embeddings": tied,
        # both spellings: older transformers read rope_theta
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "attention_bias": False, "attention_dropout": 0.0,
        "mlp_bias": False, "pretraining_tp": 1, "initializer_range": 0.02,
        "use_cache": True, "dtype": dtype,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def llama_state_dict(model):
    """Our weights under Llama's names, on the CPU, q/k rows reordered."""
    ours, out = model.state_dict(), {}
    tied = model.token_embeddings.weight is model.lm_head.weight
    for mine, theirs in _llama_names(model.num_layers, tied).items():
        w = ours[mine].detach().cpu()
        if mine.endswith(_LLAMA_ROPE_ROWS):
            w = llama_rope_rows(w, model.num_heads)
        out[theirs] = w
    return out


def save_llama(model, out_dir, tokenizer=None, rope_theta=None,
               overwrite=False):
    """Write out_dir/config.json and model.safetensors (with a CRC-32 per
    tensor), which LlamaForCausalLM.from_pretrained loads into the same
    function as `model` (a TransformerLM, maybe wrapped). With tokenizer (a
    bpe.Tokenizer), its files too, ours and AutoTokenizer's. Existing files
    are an error unless overwrite=True; config.json is written last."""
    model = unwrap(model)
    if not isinstance(model, TransformerLM):
        raise TypeError(f"save_llama needs a TransformerLM, got "
                        f"{type(model).__name__}")
    st = _safetensors()
    config = llama_config(model, rope_theta)
    tensors = llama_state_dict(model)
    os.makedirs(out_dir, exist_ok=True)
    names = ["config.json", LLAMA_WEIGHTS]
    if tokenizer is not None:
        names += ["vocab.json", "merges.txt", "special_tokens_map.json",
                  *HF_TOKENIZER_FILES]
    existing = [n for n in names if os.path.exists(os.path.join(out_dir, n))]
    if existing and not overwrite:
        raise FileExistsError(f"save_llama: {out_dir} already holds "
                              f"{', '.join(existing)} (pass overwrite=True)")
    if tokenizer is not None:
        eot = tokenizer.special_ids.get(EOT)
        config.update(bos_token_id=eot, eos_token_id=eot)
        _save_tokenizer(tokenizer, out_dir, model.context_length)
    crcs = json.dumps({name: _crc32(t) for name, t in tensors.items()})
    metadata = {"format": "pt", "crc32": crcs}
    with atomic_open(os.path.join(out_dir, LLAMA_WEIGHTS), "wb") as f:
        f.write(st.save(tensors, metadata=metadata))
    # last: its presence means the directory is done
    with atomic_open(os.path.join(out_dir, "config.json")) as f:
        json.dump(config, f, indent=2)
    return out_dir


def _save_tokenizer(tokenizer, out_dir, max_length):
    """Ours, special_tokens_map.json and HF_TOKENIZER_FILES."""
    tokenizer.save(out_dir)
    specials = {"additional_special_tokens": list(tokenizer.special_ids)}
    if EOT in tokenizer.special_ids:
        specials.update(bos_token=EOT, eos_token=EOT)
    path = os.path.join(out_dir, "special_tokens_map.json")
    with atomic_open(path) as f:
        json.dump(specials, f, indent=1)
    hf_files = hf_tokenizer_files(tokenizer, max_length)
    for name, content in zip(HF_TOKENIZER_FILES, hf_files):
        with atomic_open(os.path.join(out_dir, name), encoding="utf-8") as f:
            json.dump(content, f, indent=1, ensure_ascii=False)


HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def hf_tokenizer_files(tokenizer, max_length):
    """(tokenizer.json, tokenizer_config.json) dicts for a bpe.Tokenizer:
    GPT-2's byte-level BPE, the special tokens as added tokens."""
    mapped, merges = tokenizer.gpt2_strings()
    # as vocab.json, the specials last (an added token takes its text's id)
    special_ids = set(tokenizer.special_ids.values())
    vocab = {s: i for s, i in mapped.items() if i not in special_ids}
    vocab.update(tokenizer.special_ids)
    by_id = sorted(tokenizer.special_ids.items(), key=lambda item: item[1])
    added = [dict(id=i, content=content, single_word=False, lstrip=False,
                  rstrip=False, normalized=False, special=True)
             for content, i in by_id]
    byte_level = dict(type="ByteLevel", add_prefix_space=False,
                      trim_offsets=True, use_regex=True)
    bpe = dict(type="BPE", dropout=None, unk_token=None,
               continuing_subword_prefix=None, end_of_word_suffix=None,
               fuse_unk=False, byte_fallback=False, ignore_merges=False,
               vocab=vocab, merges=merges)
    tokenizer_json = dict(version="1.0", truncation=None, padding=None,
                          added_tokens=added, normalizer=None,
                          pre_tokenizer=byte_level, post_processor=None,
                          decoder=byte_level, model=bpe)
    eot = EOT if EOT in tokenizer.special_ids else None
    config = dict(tokenizer_class="PreTrainedTokenizerFast",
                  model_max_length=max_length, bos_token=eot, eos_token=eot,
                  clean_up_tokenization_spaces=False)
    return tokenizer_json, config


def _llama_tensors(path):
    """Every tensor of a Llama directory, sharded or not, on the CPU."""
    index = os.path.join(path, LLAMA_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, LLAMA_WEIGHTS)):
        files = [LLAMA_WEIGHTS]
    else:
        raise FileNotFoundError(
            f"{path} has neither {LLAMA_WEIGHTS} nor {LLAMA_INDEX}: not a "
            f"safetensors Llama checkpoint (pytorch_model.bin is not read)")
    tensors = {}
    for name in files:
        tensors.update(_read_safetensors(os.path.join(path, name)))
    return tensors


def _crc32(tensor):
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    return zlib.crc32(data)


def _read_safetensors(path):
    """A safetensors file's tensors, checked against save_llama's CRC-32s."""
    st = _safetensors()
    try:
        with st.safe_open(path, framework="pt") as f:
            crcs = json.loads((f.metadata() or {}).get("crc32", "{}"))
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:
        lines = str(e).strip().splitlines() or [type(e).__name__]
        raise RuntimeError(f"cannot read {path}: truncated or corrupt, or "
                           f"not a safetensors file ({lines[0]})") from None
    for name, tensor in tensors.items():
        if name in crcs and _crc32(tensor) != crcs[name]:
            raise RuntimeError(f"{path} is damaged: tensor {name} does not "
                               f"match the CRC-32 saved with it (a disk or "
                               f"copy error)")
    return tensors


def _read_config(path):
    """-> (path, dict) of a Llama directory's config.json, checked."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no config.json in {path}: not a Llama "
                                f"checkpoint directory")
    with open(config_path) as f:
        try:
            cfg = json.load(f)
        except ValueError as e:
            raise ValueError(f"{config_path} is not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{config_path} is not a JSON object")
    if cfg.get("model_type", "llama") != "llama":
        raise ValueError(f"{config_path}: model_type "
                         f"{cfg['model_type']!r}, expected 'llama'")
    sizes = ("vocab_size", "hidden_size", "intermediate_size",
             "num_hidden_layers", "num_attention_heads")
    missing = [k for k in sizes if k not in cfg]
    if missing:
        raise ValueError(f"{config_path} lacks {', '.join(missing)}")
    return config_path, cfg


def _few(names):
    """The first four names, then ' ...' if there are more."""
    more = " ..." if len(names) > 4 else ""
    return f"{names[:4]}{more}"


def read_llama(path):
    """A Llama directory -> (model_args, state dict under our names,
    rms_norm_eps). What TransformerLM cannot express (GQA, biases, RoPE
    scaling, ...) is an error naming the setting."""
    config_path, cfg = _read_config(path)
    d_model, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    layers = cfg["num_hidden_layers"]
    expected = dict(num_key_value_heads=heads, head_dim=d_model // heads,
                    hidden_act="silu", attention_bias=False, mlp_bias=False)
    unsupported = [f"{k}={cfg[k]!r} (needs {want!r})"
                   for k, want in expected.items()
                   if cfg.get(k) is not None and cfg[k] != want]
    rope = {**(cfg.get("rope_parameters") or {}),
            **(cfg.get("rope_scaling") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        unsupported.append(f"rope_type={rope_type!r} (needs 'default')")
    if unsupported:
        raise ValueError(f"{config_path}: TransformerLM cannot express "
                         + ", ".join(unsupported))
    tied = bool(cfg.get("tie_word_embeddings", False))
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    model_args = dict(
        vocab_size=cfg["vocab_size"],
        context_length=cfg.get("max_position_embeddings", 2048),
        d_model=d_model, num_layers=layers, num_heads=heads,
        d_ff=cfg["intermediate_size"], rope_theta=float(theta),
        tie_embeddings=tied)
    tensors = _llama_tensors(path)
    if tied:  # some writers store the shared matrix twice
        tensors.pop("lm_head.weight", None)
    rename = {theirs: mine for mine, theirs in _llama_names(layers, tied).items()}
    absent = [name for name in rename if name not in tensors]
    extra = [name for name in tensors if name not in rename
             and not name.endswith("rotary_emb.inv_freq")]
    if absent or extra:
        raise ValueError(f"{path}: tensors do not match its config.json: "
                         f"missing {_few(absent)}, unexpected {_few(extra)}")
    state = {mine: tensors[theirs] for theirs, mine in rename.items()}
    for name in state:
        if name.endswith(_LLAMA_ROPE_ROWS):
            state[name] = llama_rope_rows(state[name], heads, to_llama=False)
    if tied:
        state["lm_head.weight"] = state["token_embeddings.weight"]
    return model_args, state, float(cfg.get("rms_norm_eps", 1e-5))


def load_llama(path, device=None, attn_impl="naive", dtype=None,
               act_ckpt_every=0):
    """A TransformerLM in eval mode with a Llama directory's weights
    (save_llama's or save_pretrained's); fp32 unless dtype is given."""
    model_args, state, eps = read_llama(path)
    model = TransformerLM(**model_args, attn_impl=attn_impl,
                          act_ckpt_every=act_ckpt_every, dtype=dtype)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise RuntimeError(f"{path}: tensor shapes do not match its "
                           f"config.json: {e}") from e
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.eps = eps
    if device is not None:
        model = model.to(device)
    return model.eval()


def llama_init(path, vocab_size=None, context_length=None):
    """train.py's init_from=<Llama directory> -> (model_args, state dict),
    checked against the run's vocab_size and context_length and against
    RMSNorm's eps (a resumed run could not restore another)."""
    model_args, state, eps = read_llama(path)
    default_eps = inspect.signature(RMSNorm).parameters["eps"].default
    if eps != default_eps:
        raise ValueError(f"{path}: rms_norm_eps={eps}, but TransformerLM's "
                         f"RMSNorm uses {default_eps}")
    theirs = model_args["vocab_size"]
    if vocab_size is not None and theirs != vocab_size:
        raise ValueError(f"{path} has vocab_size {theirs} but the dataset "
                         f"has {vocab_size}: fine-tune on data tokenized "
                         f"with the checkpoint's tokenizer")
    positions = model_args["context_length"]
    if context_length is not None and context_length > positions:
        raise ValueError(f"context_length={context_length} exceeds "
                         f"{path}'s max_position_embeddings {positions}")
    return model_args, state


# ---- 2. Hugging Face attention
# hf_attention runs flash.py's kernels in a transformers model. A call
# attends to
# - cu_seq_lens_q (DataCollatorWithFlattening): those documents, with no
#   host read (the path to compile);
# - a 2-D padding mask: each row as three segments, pads / real / pads;
# - position_ids alone: documents start where positions restart (a host
#   read per forward; compiled, every token is a boundary);
# - none of these: dense flash_attention.

# eager: the last position_ids seen -> its documents (all layers share it)
_HF_DOCS = {}


def _hf_fail(what):
    raise ValueError(f"hf_attention: {what}")


def _hf_boundaries(position_ids, batch, seqlen):
    """Documents of position_ids, no host read: boundary t is the first
    token of token t's document, then the end (equal ones: empty
    segments)."""
    pos = position_ids.expand(batch, seqlen)
    starts = torch.ones(batch, seqlen, dtype=torch.bool, device=pos.device)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    token = torch.arange(batch * seqlen, device=pos.device)
    first = torch.cummax(torch.where(starts.flatten(), token, 0), 0).values
    end = first.new_full((1,), batch * seqlen)
    return torch.cat([first, end]).to(torch.int32)


def _hf_documents_eager(position_ids, batch, seqlen):
    """(cu_seqlens, max_seqlen) of those documents, or None when each row
    is one; a host read per position_ids tensor."""
    cached = _HF_DOCS.get("entry")
    if (cached is not None and cached[0]() is position_ids
            and cached[1] == position_ids._version):
        return cached[2]
    boundaries = _hf_boundaries(position_ids, batch, seqlen)
    cu, docs = torch.unique_consecutive(boundaries), None
    if len(cu) > batch + 1:
        docs = cu, int((cu[1:] - cu[:-1]).max())
    entry = (weakref.ref(position_ids), position_ids._version, docs)
    _HF_DOCS["entry"] = entry
    return docs


def _hf_runs(mask):
    """Per row of a padding mask (True: real): the first real token, the
    number of them, and whether they form one run."""
    real = mask.sum(dim=-1)
    first = mask.to(torch.int8).argmax(dim=-1)
    from_end = mask.flip(-1).to(torch.int8).argmax(dim=-1)
    last = mask.shape[-1] - 1 - from_end
    return first, real, (real == 0) | (last - first + 1 == real)


def _hf_segments(mask):
    """A padding mask as 3 segments a row: 3 * batch + 1 boundaries."""
    batch, seqlen = mask.shape
    first, real, _ = _hf_runs(mask)
    row = torch.arange(batch, device=mask.device) * seqlen
    cu = torch.stack([row, row + first, row + first + real], dim=-1)
    end = cu.new_full((1,), batch * seqlen)
    return torch.cat([cu.flatten(), end]).to(torch.int32)


def hf_attention_mask(batch_size, q_length, kv_length, q_offset=0,
                      kv_offset=0, mask_function=None, attention_mask=None,
                      **kwargs):
    """transformers' mask hook: the 2-D padding mask as booleans, or None
    (eagerly also for no pad). A pad between real tokens is an error."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        _hf_fail(f"only 2-D padding masks (batch, keys) can be honoured, "
                 f"got shape {tuple(attention_mask.shape)}")
    mask = attention_mask[:, -kv_length:].to(torch.bool)
    one_run = _hf_runs(mask)[2]
    if torch.compiler.is_compiling():
        torch._assert_async(one_run.all(), "hf_attention: a padding mask "
                            "with a pad between real tokens")
        return mask
    if not bool(one_run.all()):
        rows = (~one_run).nonzero().flatten().tolist()[:8]
        _hf_fail(f"padding mask rows {rows} have a pad between real "
                 f"tokens: only one run of real tokens per row (left "
                 f"and/or right padding) can be honoured")
    return None if bool(mask.all()) else mask


def _hf_check(attention_mask, dropout, extras):
    """Arguments hf_attention cannot honour, each an error."""
    if dropout:
        _hf_fail(f"attention dropout ({dropout}) is not implemented: set "
                 f"the config's attention dropout (attn_pdrop / "
                 f"attention_dropout) to 0")
    for name, val in extras.items():
        if val is not None:
            _hf_fail(f"{name} is not supported")
    if attention_mask is None:
        return
    if not torch.is_tensor(attention_mask) or attention_mask.dim() != 2:
        _hf_fail("got a mask that is not a 2-D padding mask: build the model "
                 "with this attention's name so its mask hook "
                 "(hf_attention_mask) makes the mask")


def hf_attention(module, query, key, value, attention_mask, scaling=None,
                 dropout=0.0, is_causal=None, sliding_window=None,
                 softcap=None, s_aux=None, **kwargs):
    """transformers' attention hook: query, key, value (B, H, S, D) ->
    (output (B, S, H, D), None)."""
    extras = dict(sliding_window=sliding_window, softcap=softcap,
                  s_aux=s_aux)
    _hf_check(attention_mask, dropout, extras)
    causal = is_causal
    if is_causal is None:
        causal = getattr(module, "is_causal", True)
    B, H, S, D = query.shape
    if key.shape[2] != S:
        _hf_fail(f"{S} queries against {key.shape[2]} keys (decoding with a "
                 f"KV cache) is not supported: use "
                 f"attn_implementation='sdpa' to generate")
    key, value = key.to(query.dtype), value.to(query.dtype)
    if scaling is not None and not math.isclose(scaling, D ** -0.5,
                                                rel_tol=1e-6):
        query = query * (scaling * math.sqrt(D))  # kernels scale 1/sqrt(D)

    def flat(x):  # (B, H, S, D) -> (B * S, H, D), a view of HF's memory
        return x.transpose(1, 2).reshape(B * S, x.shape[1], D)

    def packed(cu, max_seqlen, cu_k=None, max_k=None):
        out = flash_attn_varlen(flat(query), flat(key), flat(value), cu,
                                max_seqlen, causal=causal, cu_seqlens_k=cu_k,
                                max_seqlen_k=max_k)
        return out.view(B, S, H, D), None

    cu_q = kwargs.get("cu_seq_lens_q")
    if cu_q is not None:
        if attention_mask is not None or B != 1:
            mask = " and a mask" if attention_mask is not None else ""
            _hf_fail(f"cu_seq_lens_q describes one packed row (batch 1) "
                     f"without a padding mask, got batch {B}{mask}")
        max_q = kwargs.get("max_length_q")
        if max_q is None:
            _hf_fail("cu_seq_lens_q needs max_length_q (a Python int, the "
                     "longest document)")
        cu_k, max_k = kwargs.get("cu_seq_lens_k"), None
        if cu_k is cu_q:
            cu_k = None
        if cu_k is not None:
            cu_k = cu_k.to(torch.int32)
            max_k = kwargs.get("max_length_k", max_q)
        return packed(cu_q.to(torch.int32), max_q, cu_k, max_k)
    if attention_mask is not None:
        return packed(_hf_segments(attention_mask), S)
    position_ids = kwargs.get("position_ids")
    compiling = torch.compiler.is_compiling()
    if position_ids is not None and compiling:  # a boundary a token
        cu = _hf_boundaries(position_ids, B, S)
        config = getattr(module, "config", None)
        bound = getattr(config, "max_position_embeddings", None) or S
        if bound < S:  # no document can be longer than the positions
            longest = (cu[1:] - cu[:-1]).max()
            torch._assert_async(longest <= bound, "hf_attention: a document "
                                "is longer than max_position_embeddings")
        return packed(cu, min(bound, S))
    if position_ids is not None:
        docs = _hf_documents_eager(position_ids, B, S)
        if docs is not None:
            return packed(*docs)
    out = flash_attention(query, key, value, causal=causal)
    return out.transpose(1, 2), None


# names holding these are transformers' own ("flash": a hub kernel)
HF_RESERVED = ("flash", "sdpa", "flex", "eager", "paged", "|", "/")


def register_hf_attention(name="ours"):
    """Register hf_attention and its mask hook under `name` -> name; then
    from_config(cfg, attn_implementation=name) runs flash.py's kernels."""
    clash = [word for word in HF_RESERVED if word in name]
    if clash or not name:
        reserved = ", ".join(map(repr, HF_RESERVED))
        raise ValueError(f"register_hf_attention: name {name!r} contains "
                         f"{clash or 'nothing'}; transformers reads names "
                         f"containing {reserved} as its own implementations")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError("register_hf_attention needs transformers: pip "
                          "install -r requirements-extra.txt") from e
    AttentionInterface.register(name, hf_attention)
    AttentionMaskInterface.register(name, hf_attention_mask)
    return name
