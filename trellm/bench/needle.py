"""Needle-in-a-haystack prompts for ``trellm bench ladder``.

The haystack is original prose made from sentence templates and word banks with a
seeded ``random.Random``: deterministic for a seed, varied enough that the model
does not fall into a loop on one repeated sentence, and free of digits, doors and
codes so nothing in it competes with the needle. Lengths are measured with a
local tokenizer; the filler is trimmed to the target token count.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Protocol

_NAMES = ["Mira", "Tobias", "Elena", "Rafael", "Ingrid", "Jonah", "Priya", "Oskar", "Lucia", "Henrik",
          "Amara", "Felix", "Sofia", "Matteo", "Greta", "Nadia", "Emil", "Clara", "Viktor", "Leona"]
_PLACES = ["harbor", "orchard", "mill", "market square", "library", "bakery", "lighthouse", "chapel",
           "workshop", "inn", "bridge", "greenhouse", "stable", "quarry", "boathouse", "tavern"]
_LANDSCAPES = ["river bank", "pine forest", "salt marsh", "hillside", "valley", "shoreline", "meadow",
               "moor", "canyon", "lake shore", "birch grove", "dune field", "glacier edge", "vineyard"]
_ANIMALS = ["heron", "fox", "mule", "goat", "owl", "badger", "crow", "otter", "stag", "hare", "swan"]
_JOBS = ["weaver", "ferryman", "potter", "beekeeper", "cartographer", "blacksmith", "shepherd",
         "glassblower", "miller", "fisherman", "carpenter", "herbalist", "clockmaker", "tailor"]
_THINGS = ["lanterns", "maps", "baskets", "ropes", "jars of honey", "wool blankets", "copper kettles",
           "dried herbs", "wooden spoons", "old letters", "fishing nets", "clay pots", "candles"]
_THING = ["lantern", "loom", "cart", "fiddle", "boat", "clock", "spinning wheel", "weather vane",
          "wagon", "telescope", "bellows", "plough", "sundial"]
_MATERIALS = ["twine", "birch bark", "beeswax", "scrap leather", "river clay", "pine resin", "linen"]
_SEASONS = ["spring", "summer", "autumn", "winter"]
_TIMES = ["dawn", "midday", "dusk", "nightfall", "early morning", "late afternoon"]
_SOUNDS = ["gulls", "church bells", "rain on the roof", "crickets", "the wind in the reeds", "the tide"]
_SMELLS = ["woodsmoke", "fresh bread", "wet moss", "pine needles", "sea salt", "ripe apples"]
_MOODS = ["quiet", "patient", "stubborn", "cheerful", "curious", "careful", "restless", "gentle"]

_TEMPLATES = [
    "{name} spent the {season} repairing an old {thing} with nothing but {material}.",
    "In the {place}, a {mood} {job} kept a collection of {things} that nobody else wanted.",
    "The wind carried the smell of {smell} across the {landscape} long after {time}.",
    "Every {season} the {job}s gathered near the {landscape} to trade {things} and gossip.",
    "Travelers often stopped at the {place} to rest their animals and listen to {sound}.",
    "{name} liked to walk along the {landscape} at {time}, counting the {animal}s along the way.",
    "Some people said the {place} was older than the {landscape} itself, which seemed unlikely.",
    "A {mood} {animal} had made its home under the {place}, and the children fed it in {season}.",
    "The {job} insisted that {things} should always be kept far away from {material}.",
    "When {name} finally opened the {place} again, the air inside smelled of {smell}.",
    "Nobody could explain why the {things} in the {place} were always moved by morning.",
    "{name} and {name2} argued for an hour about the best way to mend a {thing}.",
    "At {time} the {landscape} went still, except for {sound} somewhere in the distance.",
    "The {place} was never busier than in {season}, when the {job}s came down from the {landscape}.",
    "{name} wrote in a small notebook about the {animal}s, the weather and the price of {things}.",
    "It took the {mood} {job} most of the {season} to teach {name} how to handle a {thing}.",
    "From the {place} one could see the whole {landscape}, and on clear days the mountains beyond.",
    "Old stories claimed that a {animal} would guide lost travelers back to the {place}.",
]


def _sentence(rng: random.Random) -> str:
    t = rng.choice(_TEMPLATES)
    n1, n2 = rng.sample(_NAMES, 2)
    return t.format(name=n1, name2=n2, place=rng.choice(_PLACES), landscape=rng.choice(_LANDSCAPES),
                    animal=rng.choice(_ANIMALS), job=rng.choice(_JOBS), things=rng.choice(_THINGS),
                    thing=rng.choice(_THING), material=rng.choice(_MATERIALS), season=rng.choice(_SEASONS),
                    time=rng.choice(_TIMES), sound=rng.choice(_SOUNDS), smell=rng.choice(_SMELLS),
                    mood=rng.choice(_MOODS))


def prose(rng: random.Random, approx_words: int) -> str:
    """Paragraphs of 4-7 sentences, at least ``approx_words`` words."""
    paragraphs, words = [], 0
    while words < approx_words:
        para = " ".join(_sentence(rng) for _ in range(rng.randint(4, 7)))
        paragraphs.append(para)
        words += para.count(" ") + 1
    return "\n\n".join(paragraphs)


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def filler(tok: TextTokenizer, target_tokens: int, seed: int) -> str:
    """Prose of ``target_tokens`` tokens (within a couple: a cut can re-merge), same text for a seed."""
    if target_tokens <= 0:
        return ""
    rng = random.Random(seed)
    text = ""
    # English prose runs about 1.3 tokens a word; grow until long enough, then cut.
    words = int(target_tokens / 1.2) + 16
    while True:
        text = prose(rng, words) if not text else text + "\n\n" + prose(rng, words // 4 + 16)
        ids = tok.encode(text, add_special_tokens=False)
        if len(ids) >= target_tokens:
            break
    cut = tok.decode(ids[:target_tokens], skip_special_tokens=True)
    return cut.rstrip() + "."


@dataclass(frozen=True)
class Needle:
    """One fact to plant and the question that asks for it."""

    color: str
    code: str

    @property
    def fact(self) -> str:
        return f"The secret code of the {self.color} door is {self.code}."

    @property
    def question(self) -> str:
        return f"What is the secret code of the {self.color} door? Answer with the number only."

    def found_in(self, answer: str) -> bool:
        # The code as a whole number: "51234" or "12345" does not contain the code 1234.
        return re.search(rf"(?<!\d){re.escape(self.code)}(?!\d)", answer) is not None


_COLORS = ["blue", "red", "green", "yellow", "purple", "orange", "silver", "golden", "white", "black"]
_NONCE_WORDS = ["amber", "falcon", "willow", "cobalt", "juniper", "harbor", "ember", "thistle", "quartz",
                "saffron", "maple", "onyx", "cedar", "lark", "indigo", "fennel", "garnet", "heath",
                "plover", "sorrel", "basalt", "tansy", "marten", "alder"]


def make_needle(rng: random.Random) -> Needle:
    return Needle(color=rng.choice(_COLORS), code=str(rng.randint(1000, 9999)))


def nonce(rng: random.Random) -> str:
    """Words, not digits, so the nonce cannot be mistaken for the code."""
    return "-".join(rng.sample(_NONCE_WORDS, 4))


def plant(text: str, fact: str, depth: float) -> str:
    """``text`` with ``fact`` inserted at a sentence boundary near ``depth`` (0..1) of it."""
    if not text:
        return fact
    at = int(len(text) * min(max(depth, 0.0), 1.0))
    # The next sentence end at or after the depth point; else the last one before it.
    nxt = text.find(". ", at)
    if nxt < 0:
        nxt = text.rfind(". ", 0, at)
    if nxt < 0:
        return (fact + " " + text) if depth < 0.5 else (text + " " + fact)
    return text[:nxt + 1] + " " + fact + text[nxt + 1:]


@dataclass(frozen=True)
class LadderPrompt:
    """The first turn of one ladder cell, with what is needed to judge and size it."""

    user: str
    needle: Needle
    filler_tokens: int
    """Tokens of the filler alone (local tokenizer), without the needle."""
    filler_target: int


def user_message(tag: str, haystack: str, needle: Needle) -> str:
    return (f"Document {tag}.\n\nRead the text below. It contains one secret code.\n\n"
            f"{haystack}\n\n{needle.question}")
