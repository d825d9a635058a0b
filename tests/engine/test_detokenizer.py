"""IncrementalText (engine/detokenizer.py): a growing token list's text, decoding only a window.

The oracle is the tokenizer's own `decode` of the whole list, asked after every growth, for three
decoders: byte-level BPE (the embedded model's, whose characters span tokens as raw bytes), and a
SentencePiece-style one built here (a space marker, byte fallback, the first token's leading space
stripped), with and without skipping special tokens. Token lists are seeded random ids (which
break UTF-8 characters at every turn) and real multilingual text grown one token at a time."""
from __future__ import annotations

import queue
import random

import pytest

from jupyter_pagedkv.core.sampling_params import SamplingParams
from jupyter_pagedkv.engine.detokenizer import IncrementalText, WindowDecoder, decodes_locally
from jupyter_pagedkv.testing.models import byte_tokenizer, tiny_model

TEXT = ("Paged attention, explained: «blocks» of 16 tokens — naïve vs paged. 日本語のテキスト, "
        "emoji 🧠🚀 and Ελληνικά; the end.\n")


def sentencepiece_tokenizer():
    """A Llama-style decoder over a hand-made vocabulary: '▁' marks a space, <0xNN> tokens carry raw
    bytes (fused into characters once complete), and the decoded text's first space is stripped."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [
        "▁", "▁the", "▁cat", "s", "▁paged", "▁block", "é", "日本", ".", ",", "▁a", "b", "c", "▁▁", "ing"]
    core = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def metaspace_tokenizer():
    """The same idea through tokenizers' Metaspace decoder (the first token's space dropped), with a
    second special token that is not EOS ([INST], as chat models emit mid-output)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "▁the", "▁cat", "▁sat", "[INST]", "s", "▁", "."]
    core = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=["[INST]"])


def sentencepiece_text_ids(tok) -> list[int]:
    """TEXT-like ids for the hand-made vocabulary: known pieces where they exist, else UTF-8 bytes."""
    vocab = tok.get_vocab()
    ids = []
    for word in ["▁the", "▁cat", "s", "▁", *"€", "▁paged", "é", "日本", *"🧠", "▁a", "b", ".", "</s>", "▁block", "ing"]:
        if word in vocab:
            ids.append(vocab[word])
        else:
            ids += [vocab[f"<0x{b:02X}>"] for b in word.encode()]
    return ids


@pytest.fixture(scope="module")
def embedded_tokenizer():
    from transformers import AutoTokenizer

    from jupyter_pagedkv.worker.loader import embedded_gguf, gguf_metadata_dir

    return AutoTokenizer.from_pretrained(gguf_metadata_dir(embedded_gguf()))


def grow_and_compare(tok, ids: list[int], skip: bool, rng: random.Random) -> int:
    """Grow a list to `ids` a few tokens at a time, checking the text against decode's each time;
    returns how many tokens the incremental decodes were given in all."""
    given = 0
    plain = WindowDecoder.of(tok, skip)

    def count(part: list[int]) -> str:
        nonlocal given
        given += len(part)
        return plain.decode(part)

    decode = WindowDecoder(count, plain.byte_ids, plain.skipped)
    text, n = IncrementalText(), 0
    while n < len(ids):
        n = min(len(ids), n + rng.choice([1, 1, 1, 2, 3]))
        assert text.extend(decode, ids[:n]) == tok.decode(ids[:n], skip_special_tokens=skip), (n, ids[:n])
    return given


@pytest.mark.parametrize("make", [sentencepiece_tokenizer, metaspace_tokenizer])
@pytest.mark.parametrize("skip", [True, False])
def test_sentencepiece_style_text_matches_the_whole_decode_after_every_token(make, skip):
    """Random ids, a quarter of them special tokens: a skipped special token between two words must
    not take the next word's space with it (it once did: "the cat</s> sat" grew as "the catsat")."""
    tok, rng = make(), random.Random(1)
    vocab, special = tok.get_vocab(), tok.all_special_ids
    if make is sentencepiece_tokenizer:
        grow_and_compare(tok, sentencepiece_text_ids(tok), skip, rng)
    words = [vocab["▁the"], vocab["▁cat"], vocab["</s>"], vocab["</s>"], vocab["▁cat"], vocab["</s>"], vocab["▁the"]]
    for steps in ([1] * 7, [2, 1, 3, 1], [3, 4]):
        text, n = IncrementalText(), 0
        for k in steps:
            n += k
            assert text.extend(WindowDecoder.of(tok, skip), words[:n]) == \
                tok.decode(words[:n], skip_special_tokens=skip)
    for _ in range(150):
        grow_and_compare(tok, [rng.choice(special) if rng.random() < 0.25 else rng.randrange(len(tok))
                               for _ in range(rng.randrange(1, 60))], skip, rng)


@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_text_matches_the_whole_decode_after_every_token(embedded_tokenizer, skip):
    tok, rng = embedded_tokenizer, random.Random(2)
    special = sorted(tok.all_special_ids)
    grow_and_compare(tok, tok.encode(TEXT * 3, add_special_tokens=False), skip, rng)
    for _ in range(30):   # random ids, with the special tokens (skipped or kept) among them
        grow_and_compare(tok, [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tok))
                               for _ in range(rng.randrange(1, 80))], skip, rng)


def test_the_decoded_tokens_grow_with_the_text_not_with_its_square(embedded_tokenizer):
    """2,000 tokens of text, one at a time: the windows given to decode add up to a few times the
    text's length, where decoding the whole list each time would give ~2 million."""
    tok = embedded_tokenizer
    ids = tok.encode(TEXT * 60, add_special_tokens=False)[:2000]
    given = grow_and_compare(tok, ids, True, random.Random(3))
    assert given < 6 * len(ids), given


def wordpiece_tokenizer(clean_up: bool):
    """BERT's decoder, which joins "a" "." as "a." across tokens (a clean-up of its own)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "a", ".", "b", ",", "c", "!", "d", "?", "e", "n", "'", "t", "f", "s"]
    core = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    core.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", clean_up_tokenization_spaces=clean_up)


def test_a_decode_that_cleans_up_spaces_is_decoded_whole(embedded_tokenizer):
    """Decoding is asked whether it cleans up spaces around punctuation (a rewrite that can reach
    across a window's edge): WordPiece's decoder does, flag or no flag, so its text is the whole
    list's every time; a byte-level BPE with the flag set does not (transformers ignores the flag
    for BPE; Llama 3's config sets it), so it stays incremental."""
    assert not decodes_locally(wordpiece_tokenizer(clean_up=False))
    assert not decodes_locally(wordpiece_tokenizer(clean_up=True))
    assert decodes_locally(embedded_tokenizer) and decodes_locally(byte_tokenizer())
    flagged = byte_tokenizer()
    flagged.clean_up_tokenization_spaces = True
    assert decodes_locally(flagged)


def test_a_rewritten_list_starts_over():
    tok = byte_tokenizer()
    text = IncrementalText()
    decode = WindowDecoder.of(tok, False)     # (its "!" is the pad token: skipped when skipping)
    a, b = tok.encode("hello world"), tok.encode("help")
    assert text.extend(decode, a) == "hello world"
    assert text.extend(decode, b) == "help"          # not a growth of the list seen: decoded afresh
    assert text.extend(decode, b + tok.encode("!")) == "help!"


def test_streams_outputs_and_stop_strings_keep_the_whole_decodes_text(make_engine):
    """Through the engine: each step's RequestOutput text is the decode of its tokens so far, the
    streamed deltas add up to the final text, and a stop string cuts where it did before."""
    tok = byte_tokenizer()
    engine = make_engine(tiny_model("llama", seed=5), tok)
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=7, ignore_eos=True)
    deltas = queue.SimpleQueue()
    rid = engine.add_request("Tell me about blocks", params, listener=deltas)
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(out)
            assert out.request_id == rid
            assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    final = seen[-1]
    assert final.finished and len(seen) == 40
    streamed = []
    while not deltas.empty():
        streamed.append(deltas.get().text)
    assert "".join(streamed) == final.outputs[0].text
    text = final.outputs[0].text
    stop = next(text[i:i + 3] for i in range(8, len(text)) if text.find(text[i:i + 3]) == i)   # first seen at i
    again, = engine.generate("Tell me about blocks", SamplingParams(max_tokens=40, temperature=0.8, seed=7,
                                                                   ignore_eos=True, stop=[stop]))
    assert again.outputs[0].text == text[:text.index(stop)] and again.outputs[0].stop_reason == stop


def test_a_sample_that_ends_before_its_siblings_shows_its_text(make_engine):
    """n=4 samples: one that hits a stop token while the others go on shows its text in every
    output from then on, not '' until the whole request ends."""
    tok = byte_tokenizer()
    engine = make_engine(tiny_model("llama", seed=3), tok)
    prompt, params = list(b"abc abc"), dict(max_tokens=30, n=4, temperature=1.0, seed=1, ignore_eos=True)
    free, = engine.generate([prompt], SamplingParams(**params))
    stop = free.outputs[0].token_ids[5]           # sample 0's sixth token ends it at its sixth step
    engine.add_request(prompt, SamplingParams(**params, stop_token_ids=[stop]))
    early = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
                early += not out.finished and c.finish_reason is not None
    assert early > 0
