"""Tokenizers built in code, for models that are built in code: the tiny test models and the random-weight
real-shape checkpoints of benchmarks/scale.py (which must not depend on the demo model: the GPU machine
cannot install it).

One builder, `build_tokenizer`: a byte-level BPE tokenizer (GPT-2 style byte alphabet, so any UTF-8 text
encodes and decodes back exactly) with three special tokens, `<unk>` = 0, `<s>` = 1 and `</s>` = 2 (also the
padding token), and a small chat template. Given texts and a vocabulary size it learns BPE merges on them
(the tests' tokenizer); without texts it has no merges at all: one token per byte, ids 0..258, so its ids
fall below any real model's vocabulary and a corpus yields as many tokens as it has bytes (what a 128 x 2048
calibration set needs from quantkit's own ~450 kB of text). Nothing is downloaded, and the same arguments
always give the same files.

Left out: normalization, added tokens beyond the three specials, and any claim that its merges make good
text statistics; it exists to feed shapes and pipelines, not to model language.
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
BYTE_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256  # the byte-only tokenizer's size (no merges)
# <|role|>content</s> per message, then <|assistant|> when a reply is wanted
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tokenizer(folder: Path | None = None, texts: list[str] | None = None, vocab_size: int = BYTE_VOCAB_SIZE,
                    chat_template: str | None = CHAT_TEMPLATE):
    """A byte-level BPE tokenizer (transformers' fast tokenizer), saved to `folder` when given
    (tokenizer.json, tokenizer_config.json and the chat template).

    texts=None: no merges, one token per byte (`vocab_size` must then be BYTE_VOCAB_SIZE). With texts:
    BPE merges learned on them up to `vocab_size` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    if texts is None:
        if vocab_size != BYTE_VOCAB_SIZE:
            raise ValueError(f"vocab_size {vocab_size}: a tokenizer without training texts has exactly "
                             f"{BYTE_VOCAB_SIZE} tokens (3 specials + 256 bytes); pass texts to learn merges")
        vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *sorted(alphabet)])}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    else:
        if vocab_size < BYTE_VOCAB_SIZE:
            raise ValueError(f"vocab_size {vocab_size}: at least {BYTE_VOCAB_SIZE} (3 specials + 256 bytes)")
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if texts is not None:
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                      initial_alphabet=alphabet)
        tok.train_from_iterator(texts, trainer=trainer)
    else:
        tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")
    if chat_template is not None:
        fast.chat_template = chat_template
    if folder is not None:
        fast.save_pretrained(folder)
    return fast
