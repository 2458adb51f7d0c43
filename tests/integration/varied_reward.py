"""A reward for system tests on the tiny random model: deterministic, and varied within a group (so
advantages and gradients are non-zero), unlike `arith` which a random model never satisfies."""


def varied(prompt, completion, reference, **meta):
    return (sum(map(ord, completion)) % 7) / 6.0
