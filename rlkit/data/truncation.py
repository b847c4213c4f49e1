"""Bounded work on any row: text is cut before it is tokenized, so a 40 MB document costs what its
first few thousand tokens cost, not gigabytes."""


def head_for_tokens(tokenizer, text: str, tokens: int) -> str:
    """`text`, or a prefix of it that tokenizes to more than `tokens` tokens and ends before a space.

    The first `tokens` tokens of any conversation holding the prefix in place of `text` are then
    the same as with the whole text: tokenizers split words at whitespace before merging, so the
    cut, made at a word boundary past the window, changes no token inside it.
    """
    chars = 4 * (tokens + 1)
    while chars < len(text):
        head = text[:chars]
        boundary = max(head.rfind(" "), head.rfind("\n"))
        if boundary > chars // 2:  # one long "word" (no whitespace) is cut where it is
            head = head[:boundary]
        if len(tokenizer(head, add_special_tokens=False)["input_ids"]) > tokens:
            return head
        chars *= 2
    return text
