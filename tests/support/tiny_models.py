"""Build tiny random Llama / Qwen2 / Qwen3 checkpoints (with a real tokenizer and chat
template) through transformers' own save_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 384
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Speculative decoding drafts tokens and verifies them in one forward pass. " * 4,
    "Paged attention stores keys and values in fixed size pages. " * 4,
    "Héllo wörld, naïve café — ünïcödé 你好 世界 🙂 text. " * 4,
]


def make_tokenizer(folder: Path):
    """A byte-level BPE tokenizer trained on a few sentences, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def make_sentencepiece_tokenizer(folder: Path | None = None):
    """A Llama-2-style tokenizer (SentencePiece's conventions: "▁" for spaces, byte fallback
    to the ordinary tokens <0xNN>, a decoder that strips the text's first space, BOS added),
    trained on a few sentences; fewer than VOCAB tokens."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = metaspace
    special = ["<unk>", "<s>", "</s>"]
    tok.train_from_iterator(
        _CORPUS[:3], trainers.BpeTrainer(vocab_size=120, special_tokens=special)
    )
    trained = json.loads(tok.to_str())["model"]
    vocab = trained["vocab"]
    for b in range(256):  # (the byte pieces: ordinary tokens, as in Llama 2's vocabulary)
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens(special)
    tok.pre_tokenizer = metaspace
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    bos = [("<s>", tok.token_to_id("<s>"))]
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=bos)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    assert len(fast) < VOCAB
    fast.chat_template = CHAT_TEMPLATE
    if folder is not None:
        fast.save_pretrained(folder)
    return fast


def make_tiny_model(
    folder: Path,
    family: str = "llama",
    tie: bool | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    num_layers: int = 2,
    overrides: dict | None = None,
) -> Path:
    """Write config.json, model.safetensors and a tokenizer for a random model (`overrides`:
    config fields to change, e.g. head counts)."""
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(overrides or {})
    if family == "llama":
        cfg = transformers.LlamaConfig(
            **common,
            tie_word_embeddings=bool(tie),
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=10000.0,
        )
        cls = transformers.LlamaForCausalLM
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=tie is not False)
        cls = transformers.Qwen2ForCausalLM
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**{"head_dim": 16, **common}, tie_word_embeddings=bool(tie))
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype)
    if family == "qwen2":
        # Random init leaves biases at zero; make them matter.
        with torch.no_grad():
            for layer in model.model.layers:
                attn = layer.self_attn
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(folder)
    make_tokenizer(folder)
    return Path(folder)


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: transformers' own generate, one prompt at a time, fp32, never stopping."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(out[0, len(p) :].tolist())
    return outs


def resized_vocab_copy(src: Path, dst: Path, vocab: int) -> Path:
    """The model at `src` with its embedding and lm_head cut or padded (zeros) to `vocab`
    rows, as a draft model: the same tokenizer, another embedding size."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for name, t in tensors.items():
        if t.shape[0] == VOCAB and name.endswith(("embed_tokens.weight", "lm_head.weight")):
            fitted = t.new_zeros((vocab, *t.shape[1:]))
            rows = min(vocab, VOCAB)
            fitted[:rows] = t[:rows]
            tensors[name] = fitted
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["vocab_size"] = vocab
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def make_random_eagle3_head(
    folder: Path, target_folder: Path, draft_vocab: int = 200, seed: int = 0
) -> Path:
    """A random EAGLE-3 head in the public layout (real names and shapes) for a target."""
    from specserve.core.model_config import load_hf_config
    from specserve.model.eagle3 import Eagle3Config, Eagle3Head, save_eagle3_head

    target = load_hf_config(target_folder)
    low, mid, high = 1, target.num_layers // 2, target.num_layers - 1  # needs >= 4 layers
    cfg = Eagle3Config.for_target(target, draft_vocab, (low, mid, high))
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, cfg.aux_layer_ids(target.num_layers))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.2)
        # Draft vocabulary: a random sorted subset of the target's ids.
        target_ids = torch.randperm(target.vocab_size)[:draft_vocab].sort().values
        head.d2t = target_ids - torch.arange(draft_vocab)
        head.t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
        head.t2d[target_ids] = True
    save_eagle3_head(head, folder)
    return Path(folder)
