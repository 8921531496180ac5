"""Synthetic long-context retrieval prompts (passkey and multi-key), offline.

A stand-in for RULER's needle tasks that needs no data files: a repeated
filler haystack with the needle(s) at chosen depths, sized with the served
model's tokenizer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and "
    "memorize it. I will quiz you about the important information there. "
)
QUESTION = "What is the pass key? The pass key is"


def needle_prompt(tokenizer, key: int, target_tokens: int = 3000, depth: float = 0.5) -> str:
    """A passkey-retrieval prompt of about ``target_tokens`` with the key at ``depth``."""
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    filler_tokens = len(tokenizer(FILLER).input_ids)
    repeats = (target_tokens - 60) // filler_tokens
    before = int(repeats * depth)
    return INTRO + FILLER * before + needle + FILLER * (repeats - before) + QUESTION


@dataclass(frozen=True)
class RetrievalSample:
    prompt: str
    answer: str


MULTIKEY_WORDS = [
    "apple", "river", "candle", "falcon", "marble", "violin", "harbor", "lantern",
    "meadow", "copper", "glacier", "orchid", "saddle", "thimble", "walnut", "zephyr",
]


def multikey_sample(tokenizer, seed: int, target_tokens: int = 4000, num_keys: int = 4) -> RetrievalSample:
    """RULER-style multi-key needle: several "special magic number for WORD"
    needles spread through the haystack; the question asks for one of them."""
    rng = random.Random(seed)
    words = rng.sample(MULTIKEY_WORDS, num_keys)
    values = [rng.randint(1_000_000, 9_999_999) for _ in words]
    needles = [f"One of the special magic numbers for {w} is: {v}. " for w, v in zip(words, values)]
    target = rng.randrange(num_keys)
    question = (
        f"What is the special magic number for {words[target]} mentioned in the provided "
        f"text? The special magic number for {words[target]} mentioned in the provided text is"
    )
    filler_tokens = len(tokenizer(FILLER).input_ids)
    needle_tokens = sum(len(tokenizer(n).input_ids) for n in needles)
    repeats = max(num_keys + 1, (target_tokens - needle_tokens - 80) // filler_tokens)
    slots = sorted(rng.sample(range(1, repeats), num_keys))
    parts, last = [INTRO], 0
    for slot, needle in zip(slots, needles):
        parts.append(FILLER * (slot - last) + needle)
        last = slot
    parts.append(FILLER * (repeats - last) + question)
    return RetrievalSample("".join(parts), str(values[target]))


def needle_sample(tokenizer, seed: int, target_tokens: int = 4000) -> RetrievalSample:
    rng = random.Random(seed)
    key = rng.randint(10_000, 99_999)
    depth = rng.uniform(0.2, 0.8)
    return RetrievalSample(needle_prompt(tokenizer, key, target_tokens, depth), str(key))
