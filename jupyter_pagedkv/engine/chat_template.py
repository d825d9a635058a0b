"""A conversation's prompt from the tokenizer's chat template: the whole of it, or the next turn
appended to the tokens the model already saw, so that last turn's blocks hit the prefix cache."""
from __future__ import annotations

from .frontend import check_messages


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def apply(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of `messages` templated, ending in the assistant's turn."""
    check_messages(messages)
    if not has_template(tokenizer):
        raise ValueError("this model's tokenizer has no chat template: use generate() with plain text")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def next_prompt(tokenizer, messages: list[dict], previous: list[int] | None = None) -> tuple[list[int], bool]:
    """The next prompt of a conversation, and whether it extends `previous` (the tokens the model
    saw last turn, reply included); when the template rewrites earlier turns, the conversation is
    templated afresh."""
    if previous:
        full = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        kept = tokenizer.decode(previous, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if full.startswith(kept):
            return list(previous) + list(tokenizer(full[len(kept):], add_special_tokens=False).input_ids), True
    return apply(tokenizer, messages), False
