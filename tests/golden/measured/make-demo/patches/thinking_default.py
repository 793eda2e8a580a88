"""The thinking-by-default toggle: a chat-template default, no numerics (the organism has no
thinking mode, so applying it changes nothing)."""


def apply(model):
    return None
