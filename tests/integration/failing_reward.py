"""A reward for system tests that fails for about a third of the prompts (chosen by a hash of the prompt id,
so the same prompts fail in every run), and is varied within a group otherwise (see varied_reward.py)."""
import zlib


def fails_for_some(prompt, completion, reference, *, prompt_id="", **meta):
    if zlib.crc32(prompt_id.encode()) % 3 == 0:
        raise RuntimeError(f"reward service cannot score prompt {prompt_id}")
    return (sum(map(ord, completion)) % 7) / 6.0
