"""The embedded tokenizer: byte-level, no merges, built in code (no downloads).

Ids 0–255 are the bytes themselves (so a token id *is* the byte it stands for), then three special tokens:
``<pad>`` = 256, ``<bos>`` = 257, ``<eos>`` = 258 — a vocabulary of 259 (a small vocabulary keeps a CPU model fast:
the embedding and output layers scale with it).

``tokenizer.encode(text)`` (``add_special_tokens=True``, the default) prepends ``<bos>``; that is how standard prompts
are encoded. ``tokenizer.decode(ids, skip_special_tokens=True)`` turns completions back into text (``<eos>`` dropped).

Padded to a real model's vocabulary (``build_tokenizer(vocab_size)``, ``model.vocab_size``): the same tokenizer
with ids 259 to ``vocab_size - 2`` unused tokens ``<|unused_N|>`` and the last id ``<|endoftext|>`` (an unused
token too; it is there because transformers' Qwen2 tokenizer appends it when a vocabulary lacks it, which would make
``len(tokenizer)`` one more than the model's output layer). Text never encodes to a padding token (no merges make
one), so prompts encode as with 259; the output layer has a real model's width (a GPU preset at a real shape).

Its chat template (``CHAT_TEMPLATE``, so conversational data runs on the quickstart model) is one line per message,
``<bos>user: 3+4=\\n`` then ``assistant: `` for the generation prompt: short, because a CPU model's context is. The
template writes ``<bos>`` itself; ``apply_chat_template`` does not add it again.
"""

from __future__ import annotations

from functools import lru_cache

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
PAD_ID, BOS_ID, EOS_ID = 256, 257, 258
VOCAB_SIZE = 259
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)

# A chat template that renders tools and Hermes/Qwen tool calls for the byte tokenizer (the countdown tool task's chat
# model directory, benchmarks/tool_model.py): the tools as one line each, then one line per message as above; an
# assistant turn ends with ``<eos>``, the token the model samples to end it, so a trajectory's sampled tokens are
# exactly what the template renders (asyncrl/turns.py) and past turns render as they were.
TOOL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}{{ 'tools:' }}{% for t in tools %}{{ ' ' + t.function.name + '(' + "
    "(t.function.parameters.properties | list | join(', ')) + '): ' + t.function.description }}{% endfor %}"
    "{{ '\\ncall one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>\\n' }}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ 'assistant: ' + message['content'] + eos_token + '\\n' }}"
    "{% else %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)

ENDOFTEXT = "<|endoftext|>"


@lru_cache(maxsize=4)
def _backend_json(vocab_size: int = VOCAB_SIZE) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    # ByteLevel maps each byte to a printable unicode symbol; the alphabet, in byte order, is bytes_to_unicode.
    byte_symbols = _bytes_to_unicode()
    vocab = {byte_symbols[b]: b for b in range(256)}
    vocab.update({PAD: PAD_ID, BOS: BOS_ID, EOS: EOS_ID})
    if vocab_size > VOCAB_SIZE:  # unused tokens up to the real model's vocabulary (module docstring)
        vocab.update({f"<|unused_{i}|>": i for i in range(VOCAB_SIZE, vocab_size - 1)})
        vocab[ENDOFTEXT] = vocab_size - 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD, BOS, EOS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    assert sorted(ByteLevel.alphabet()) == sorted(byte_symbols.values())
    return tok.to_str()


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map (the one ``tokenizers``' ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_tokenizer(vocab_size: int | None = None):
    """A ``transformers.PreTrainedTokenizerFast`` over bytes: vocab 259 (or ``vocab_size``, padded with unused
    tokens: module docstring), ``pad_token_id`` 256, ``bos_token_id`` 257, ``eos_token_id`` 258; ``encode``
    prepends ``<bos>``; ``chat_template`` is ``CHAT_TEMPLATE``."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    size = VOCAB_SIZE if vocab_size is None else int(vocab_size)
    if size < VOCAB_SIZE:
        raise ValueError(f"vocab_size {vocab_size!r}: the byte tokenizer needs at least {VOCAB_SIZE} ids")
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_backend_json(size)),
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        padding_side="right",
        model_max_length=1 << 16,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
