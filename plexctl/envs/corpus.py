"""The local corpus the ``search`` environment retrieves from: generated in code, or read from JSONL.

``builtin_corpus(seed)`` is deterministic and small (about 300 short passages), written only
with lowercase letters, digits and spaces, so the tiny character-level model can read every
observation. Each item of ``WORDS`` has one *fact* passage (``apple code 4821``) and a few
*distractor* passages that mention it next to other words without a code, so that ranking
matters (BM25's idf and length normalisation put the fact first for the query ``apple``).
``search_tiny_dataset`` makes the matching task: ``code of apple?`` -> ``4821``.

``load_corpus(path)`` reads a user's corpus: JSONL records with a ``text`` field (and an
optional ``id``). It deliberately does not chunk long documents or dedupe passages.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS: tuple[str, ...] = (
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "maple",
    "ocean",
    "candle",
    "piano",
    "garden",
    "rocket",
    "violet",
    "falcon",
    "lemon",
    "harbor",
    "canyon",
    "pepper",
    "silver",
    "meadow",
    "comet",
    "badger",
    "willow",
    "copper",
    "island",
    "lantern",
    "mirror",
    "orchid",
    "pebble",
    "quartz",
    "saddle",
    "thunder",
    "velvet",
    "walnut",
    "zebra",
    "anchor",
    "beacon",
    "cactus",
    "dragon",
    "ember",
    "forest",
    "glacier",
    "hazel",
    "igloo",
    "jasmine",
    "kettle",
    "lizard",
    "magnet",
    "nutmeg",
    "otter",
    "parrot",
    "quill",
    "raven",
    "salmon",
    "tulip",
    "umber",
    "valley",
    "wizard",
    "yonder",
    "zephyr",
    "acorn",
    "bramble",
    "cobalt",
    "dune",
    "egret",
    "fjord",
    "gecko",
    "heron",
    "ivory",
    "juniper",
    "koala",
)
_LINKS = ("and", "near", "with", "after", "beside")


class CorpusError(Exception):
    """A corpus file that cannot be used; ``str()`` is one line."""


def fact_code(word: str, seed: int = 0) -> str:
    """The four-digit code the built-in corpus gives ``word``."""
    return str(random.Random(f"plexrl-corpus/{seed}/{word}").randrange(1000, 10000))


def builtin_corpus(seed: int = 0, distractors_per_word: int = 3) -> list[dict[str, str]]:
    """Fact and distractor passages, in a fixed shuffled order."""
    rng = random.Random(f"plexrl-corpus/{seed}")
    texts = [f"{word} code {fact_code(word, seed)}" for word in WORDS]
    for word in WORDS:
        for _ in range(distractors_per_word):
            first, second = rng.sample([w for w in WORDS if w != word], 2)
            texts.append(f"{word} {rng.choice(_LINKS)} {first} {rng.choice(_LINKS)} {second}")
    rng.shuffle(texts)
    return [{"id": f"p{i:04d}", "text": text} for i, text in enumerate(texts)]


def search_tiny_dataset(n: int, seed: int = 0, corpus_seed: int = 0) -> list[dict[str, str]]:
    """``n`` prompts ``code of <word>?`` with the word's code as answer (words repeat when n is large)."""
    words = list(WORDS)
    random.Random(seed).shuffle(words)
    return [
        {"prompt": f"code of {w}?", "answer": fact_code(w, corpus_seed)}
        for w in (words[i % len(words)] for i in range(n))
    ]


def load_corpus(path: str | Path) -> list[dict[str, str]]:
    """JSONL passages with a ``text`` field; ``id`` defaults to the line number."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path}: corpus file not found")
    passages = []
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path}: line {line_number}: not valid JSON: {e.msg}") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise CorpusError(f"{path}: line {line_number}: needs a string `text` field")
            passages.append({"id": str(record.get("id", line_number)), "text": record["text"]})
    if not passages:
        raise CorpusError(f"{path}: empty corpus")
    return passages
