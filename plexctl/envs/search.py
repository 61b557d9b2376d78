"""The ``search`` environment: a BM25 retrieval tool over a local corpus, with optional latency.

The model writes ``search:apple;``; the observation is the top passage, ``=apple code 4821;``
(``=none;`` when no passage shares a term with the query); a turn without a call is the final
answer, scored by exact match (case and surrounding spaces ignored). ``latency_s`` makes every
search take at least that long, to reproduce real tool stalls in benchmarks: the sleep happens
in the pool, so the stalls of concurrent episodes overlap, as real remote calls would.

``BM25Index`` is Okapi BM25 (k1 = 1.5, b = 0.75, idf = ln(1 + (N - df + 0.5) / (df + 0.5))) over
lowercase alphanumeric terms, ties broken by corpus order. Indexes are built once per corpus
and process (``index_for``). It deliberately does not stem, expand queries or return more than
the top passage to the model.
"""

from __future__ import annotations

import collections
import functools
import math
import re
import time
from typing import Any

from plexctl.envs.base import MalformedCall, StepResult, final, malformed, observe, parse_tool_call
from plexctl.envs.corpus import builtin_corpus, load_corpus

_TERM = re.compile(r"[a-z0-9]+")


def terms(text: str) -> list[str]:
    return _TERM.findall(text.lower())


class BM25Index:
    def __init__(self, passages: list[dict[str, str]], k1: float = 1.5, b: float = 0.75) -> None:
        self.passages = passages
        self.k1, self.b = k1, b
        self.doc_terms = [collections.Counter(terms(p["text"])) for p in passages]
        self.lengths = [sum(c.values()) for c in self.doc_terms]
        self.avg_length = sum(self.lengths) / max(len(self.lengths), 1)
        self.postings: dict[str, list[int]] = collections.defaultdict(list)
        for i, counts in enumerate(self.doc_terms):
            for term in counts:
                self.postings[term].append(i)

    def idf(self, term: str) -> float:
        df = len(self.postings.get(term, ()))
        return math.log(1 + (len(self.passages) - df + 0.5) / (df + 0.5))

    def search(self, query: str, k: int = 1) -> list[tuple[float, dict[str, str]]]:
        """The ``k`` best (score, passage) pairs with a positive score, best first."""
        scores: dict[int, float] = collections.defaultdict(float)
        for term in set(terms(query)):
            idf = self.idf(term)
            for i in self.postings.get(term, ()):
                tf = self.doc_terms[i][term]
                norm = self.k1 * (1 - self.b + self.b * self.lengths[i] / self.avg_length)
                scores[i] += idf * tf * (self.k1 + 1) / (tf + norm)
        best = sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:k]
        return [(score, self.passages[i]) for i, score in best if score > 0]


@functools.lru_cache(maxsize=8)
def index_for(corpus_path: str | None = None, corpus_seed: int = 0) -> BM25Index:
    """The index of a corpus file, or of the built-in corpus when ``corpus_path`` is None."""
    passages = load_corpus(corpus_path) if corpus_path else builtin_corpus(corpus_seed)
    return BM25Index(passages)


def normalize_answer(text: str) -> str:
    return " ".join(text.lower().split())


class SearchEnv:
    """Config: ``prompt_field``, ``answer_field``, ``tool``, ``corpus_path`` (JSONL; None: the
    built-in corpus), ``corpus_seed``, ``latency_s``, ``max_observation_chars``."""

    def __init__(
        self,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        tool: str = "search",
        corpus_path: str | None = None,
        corpus_seed: int = 0,
        latency_s: float = 0.0,
        max_observation_chars: int = 48,
    ) -> None:
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        self.prompt_field = prompt_field
        self.answer_field = answer_field
        self.tool = tool
        self.index = index_for(corpus_path, corpus_seed)
        self.latency_s = latency_s
        self.max_observation_chars = max_observation_chars
        self.sample: dict[str, Any] = {}

    def reset(self, sample: dict) -> str:
        self.sample = sample
        return str(sample[self.prompt_field])

    def step(self, completion_text: str) -> StepResult:
        try:
            call = parse_tool_call(completion_text, [self.tool])
        except MalformedCall as e:
            return malformed(str(e))
        if call is None:
            answer = normalize_answer(str(self.sample[self.answer_field]))
            return final(1.0 if normalize_answer(completion_text) == answer else 0.0)
        return observe(f"={self.lookup(call.argument)};")

    def lookup(self, query: str) -> str:
        """The top passage's text (cut to ``max_observation_chars``), after the configured latency."""
        t0 = time.perf_counter()
        hits = self.index.search(query, k=1)
        text = hits[0][1]["text"][: self.max_observation_chars] if hits else "none"
        time.sleep(max(self.latency_s - (time.perf_counter() - t0), 0.0))
        return text
