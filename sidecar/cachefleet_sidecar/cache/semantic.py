"""The semantic tier (L3): answers for paraphrases, per tenant, with a false-hit guard (pure).

A request that missed L1 and L2 may still mean the same as one answered
before. L3 keeps, per tenant, the embedding of the *question text* of every
stored answer (the last user message of a chat, the prompt of a completion)
next to a reference to that answer's exact entry in L1/L2, and looks up the
most similar question. ``docs/semantic.md`` has the design and the numbers;
in short:

* **What must match exactly** (:func:`probe_for`): everything in the request
  except the question text: model, system prompt and earlier turns, sampling
  parameters, ``stream``, tools, ... (the canonical body of :mod:`keys` with
  the question blanked, hashed: the *context*), plus the tenant, the model
  version and the invalidation epochs. Entries live in partitions named by
  all of these, so a lookup never even sees an entry of another tenant,
  model, version, epoch or context.
* **What may differ**: the question text, when its embedding's cosine
  similarity to a cached question reaches the tenant's threshold *and* the
  two texts pass :func:`lexical_guard`: the same numbers, the same polarity
  (a negation on one side only is a different question), compatible named
  entities and identifiers, and a floor on shared content words; then the
  words that differ must not contrast (:mod:`contrast`: antonyms, converses,
  the same words in the other order, one word swapped for another). Only the
  single most similar entry is considered: when it fails the guard the
  lookup is a miss (falling back to the second best would turn guard
  rejections into false hits).
* **Only deterministic requests** (temperature 0 or a seed, :func:`keys.is_deterministic`),
  only ``chat`` and ``completions`` (an embeddings request is answered by its
  own vector, never a neighbour's), only text up to :data:`MAX_TEXT_CHARS`
  (what the embedding model reads whole).
* **Memory bound** per tenant in bytes (vectors + texts + a fixed overhead);
  a tenant over its bound loses its least recently used entries.
* **Invalidation**: the epochs are part of a partition's name, and
  :meth:`SemanticIndex.retain` drops partitions that are no longer current
  (the sidecar calls it whenever epochs or the model version move).

The index is brute force over normalised float32 rows with numpy (one
matrix-vector product per lookup); docs/semantic.md says why that beats an
approximate index at the sizes a per-tenant bound allows.
"""

from __future__ import annotations

import re
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
import xxhash

from cachefleet_common import keys
from cachefleet_sidecar.cache import contrast

#: Default similarity threshold (cosine, all-MiniLM-L6-v2); tuned in docs/semantic.md.
DEFAULT_THRESHOLD = 0.8
#: Default bytes of L3 per tenant (vectors, texts, bookkeeping).
DEFAULT_TENANT_BYTES = 32 * 1024 * 1024
#: Longest question text that is embedded (longer ones skip L3: a model reads ~256 tokens).
MAX_TEXT_CHARS = 1000
#: Bytes an entry costs beyond its vector and its text (objects, dict slots, features).
ENTRY_OVERHEAD_BYTES = 400
#: Default floor on shared content words (see :func:`lexical_guard`).
DEFAULT_OVERLAP_FLOOR = 0.2
#: The overlap floor applies when both texts have at least this many content words.
MIN_CONTENT_WORDS = 3
#: Default floor on shared named entities / identifiers (Jaccard).
DEFAULT_ENTITY_FLOOR = 0.0

Vector = npt.NDArray[np.float32]


# ---------------------------------------------------------------- options
@dataclass(frozen=True, slots=True)
class SemanticOptions:
    """One tenant's L3 settings (from the InferenceCache, or the sidecar's flags)."""

    enabled: bool = False
    threshold: float = DEFAULT_THRESHOLD
    max_bytes: int = DEFAULT_TENANT_BYTES
    #: Shadow mode (with ``enabled``): look up and index, serve nothing, compare answers.
    shadow: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {self.max_bytes}")


# ---------------------------------------------------------------- lexical guard
_NUMBER = re.compile(r"\d+(?:[.,:]\d+)*")
_TOKEN = re.compile(r"`[^`\n]{1,80}`|\w[\w.\-'\u2019]*\w|\w")
_SENTENCE_END = re.compile(r"[.!?:;]\s*$")
NEGATIONS = frozenset(
    {
        "not",
        "no",
        "never",
        "none",
        "nothing",
        "nobody",
        "neither",
        "nor",
        "cannot",
        "without",
        "nowhere",
    }
)
STOPWORDS = frozenset(
    [
        "a",
        "an",
        "the",
        "of",
        "to",
        "in",
        "on",
        "for",
        "and",
        "or",
        "is",
        "are",
        "was",
        "were",
        "be",
        "been",
        "being",
        "it",
        "its",
        "this",
        "that",
        "these",
        "those",
        "with",
        "by",
        "as",
        "at",
        "from",
        "can",
        "could",
        "will",
        "would",
        "should",
        "may",
        "might",
        "do",
        "does",
        "did",
        "has",
        "have",
        "had",
        "you",
        "your",
        "we",
        "our",
        "they",
        "their",
        "he",
        "she",
        "i",
        "me",
        "my",
        "which",
        "what",
        "who",
        "whom",
        "how",
        "when",
        "where",
        "why",
        "there",
        "here",
        "than",
        "then",
        "so",
        "such",
        "into",
        "onto",
        "also",
        "just",
        "only",
        "any",
        "all",
        "each",
        "some",
        "more",
        "most",
        "other",
        "very",
        "about",
        "if",
        "but",
        "please",
        "tell",
    ]
)


@dataclass(frozen=True, slots=True)
class Lexical:
    """The cheap features of a text the guard compares."""

    #: Every number, sorted (a multiset: ``1 and 2`` is not ``2 and 2``).
    numbers: tuple[str, ...]
    #: How many negation cues.
    negations: int
    #: Named entities / identifiers, lower-cased and sorted, with repeats (a multiset).
    entities: tuple[str, ...]
    content: frozenset[str]
    #: Every word, lower-cased, in order, joined by spaces (one object: for
    #: :func:`contrast.contrast`, split when a lookup reaches the threshold).
    words: str = ""

    @property
    def nbytes(self) -> int:
        items = (*self.numbers, *self.entities, *self.content)
        return sum(len(s) + 56 for s in items) + 3 * 216 + len(self.words) + 49


def lexical(text: str) -> Lexical:
    """Numbers, polarity, named entities / identifiers and content-word stems of ``text``.

    * numbers: every digit run with its separators (``2.10.0``, ``3,000``, ``12:30``);
    * negations: how many negation words (:data:`NEGATIONS`) and ``n't`` contractions;
    * entities (lower-cased): code in backticks, words with ``_``, a digit and a letter,
      two capitals (``PyTorch``, ``GPU``) or a capital not at a sentence start;
    * content: the first 6 characters of every other word that is not a stop word;
    * words: every word, lower-cased, in order (the contrast check's input).
    """
    numbers = tuple(sorted(_NUMBER.findall(text)))
    negations = 0
    entities: list[str] = []
    content: set[str] = set()
    sentence_start = True
    for match in _TOKEN.finditer(text):
        word = match.group()
        lower = word.lower()
        if (
            match.start() == 0
            and lower in ("no", "yes")
            and text[match.end() : match.end() + 1] in ",.!"
        ):
            pass  # an answer's "No, ..." / "Yes, ...": a reply particle, not a negated statement
        elif lower in NEGATIONS or lower.endswith(("n't", "n\u2019t")):
            negations += 1
        elif word.startswith("`"):
            entities.append(lower.strip("`").removesuffix("()"))
        elif (
            "_" in word
            or (any(c.isdigit() for c in word) and any(c.isalpha() for c in word))
            or sum(c.isupper() for c in word) >= 2
            or (word[0].isupper() and not sentence_start)
        ):
            entities.append(lower)
        elif not lower.isdigit() and lower not in STOPWORDS:
            content.add(lower[:6])
        tail = text[match.end() : match.end() + 2]
        sentence_start = bool(_SENTENCE_END.match(tail))
    return Lexical(
        numbers,
        negations,
        tuple(sorted(entities)),
        frozenset(content),
        " ".join(contrast.words(text)),
    )


@dataclass(frozen=True, slots=True)
class Guard:
    """Floors of :func:`lexical_guard` (numbers and polarity always must agree)."""

    entity_floor: float = DEFAULT_ENTITY_FLOOR
    overlap_floor: float = DEFAULT_OVERLAP_FLOOR
    #: False: similarity alone decides (what GPTCache does; benchmarks compare).
    enabled: bool = True
    #: The second stage, :func:`contrast.contrast` (False: the first stage only, as before it).
    contrast: bool = True


def lexical_guard(a: Lexical, b: Lexical, guard: Guard = Guard()) -> str | None:
    """None when two similar texts may share an answer, else why not.

    * ``numbers``: the same numbers, as many times each;
    * ``negation``: as many negation cues on each side;
    * ``entities``: no *swap*: an entity / identifier on each side that the
      other lacks (``PyTorch`` for ``TensorFlow``) fails, while one side naming
      more than the other (a paraphrase adding ``Hugging Face``) passes; and
      the Jaccard of the two sets at least ``entity_floor`` when both name any;
    * ``overlap``: shared content stems / the smaller set at least ``overlap_floor``;
    * then, when ``guard.contrast``, the words that differ must not contrast
      (:func:`contrast.contrast`: ``antonym``, ``converse``, ``order`` or ``swap``).
    """
    if not guard.enabled:
        return None
    if a.numbers != b.numbers:
        return "numbers"
    if a.negations != b.negations:
        return "negation"
    if a.entities != b.entities:
        ea, eb = Counter(a.entities), Counter(b.entities)
        if _unexplained(ea - eb, eb - ea):
            return "entities"
        union = len(set(ea) | set(eb))
        if ea and eb and len(set(ea) & set(eb)) / union < guard.entity_floor:
            return "entities"
    smaller = min(len(a.content), len(b.content))
    if smaller >= MIN_CONTENT_WORDS:
        if len(a.content & b.content) / smaller < guard.overlap_floor:
            return "overlap"
    elif bool(a.content) != bool(b.content):
        return "overlap"
    if guard.contrast:
        return contrast.contrast(tuple(a.words.split()), tuple(b.words.split()))
    return None


def _related(x: str, y: str) -> bool:
    """Two entity spellings of one name: a shared 4-character prefix, or one inside the other."""
    return x[:4] == y[:4] or x in y or y in x


def _unexplained(only_a: Counter[str], only_b: Counter[str]) -> bool:
    """True when each side names an entity the other lacks and no spelling relates them."""
    left = [x for x in only_a if not any(_related(x, y) for y in only_b)]
    right = [y for y in only_b if not any(_related(x, y) for x in only_a)]
    return bool(left and right)


# ---------------------------------------------------------------- probes
@dataclass(frozen=True, slots=True)
class Probe:
    """What a request offers to L3: where it may look, and the text it asks about."""

    tenant: str
    #: Partition name: model, model version, epochs, endpoint, query and context digest.
    partition: tuple[str, str, tuple[int, ...], int]
    text: str
    lexical: Lexical

    @property
    def model(self) -> str:
        return self.partition[0]


def _question(body: dict[str, Any], kind: str) -> tuple[str, dict[str, Any]] | str:
    """(question text, body with the question blanked), or why there is none."""
    if kind == "completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return "prompt is not a single string"
        return prompt, {**body, "prompt": None}
    if kind != "chat":
        return f"{kind} requests are never answered by a neighbour"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return "no messages"
    last = messages[-1]
    if last.get("role") != "user":
        return "the last message is not the user's"
    content = last.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                return "the last message has non-text parts"
            text = part.get("text")
            if not isinstance(text, str):
                return "the last message has non-text parts"
            texts.append(text)
        content = "\n".join(texts)
    if not isinstance(content, str):
        return "the last message has no text"
    blanked = [*messages[:-1], {**last, "content": None}]
    return content, {**body, "messages": blanked}


def probe_for(
    body: dict[str, Any],
    kind: str,
    scope: keys.Scope,
    options: keys.KeyOptions | None = None,
    *,
    query: bytes = b"",
) -> Probe | str:
    """The L3 probe of a parsed request, or why the request is not for L3."""
    options = options or keys.KeyOptions()
    if not keys.is_deterministic(body, kind):
        return "not deterministic"
    model = body.get("model")
    if not isinstance(model, str) or not model:
        return "no model"
    found = _question(body, kind)
    if isinstance(found, str):
        return found
    text, blanked = found
    text = text.strip()
    if not text:
        return "empty question"
    if len(text) > MAX_TEXT_CHARS:
        return f"question longer than {MAX_TEXT_CHARS} characters"
    try:
        canon = keys.canonical_body(blanked, kind, options)
        encoded = orjson.dumps(canon)
    except (keys.Uncacheable, orjson.JSONEncodeError) as exc:
        return f"context cannot be keyed: {exc}"
    context = xxhash.xxh3_128_intdigest(
        kind.encode() + b"\0" + query + b"\0" + encoded, seed=len(kind)
    )
    partition = (model, scope.model_version, scope.epochs, context)
    return Probe(scope.tenant, partition, text, lexical(text))


# ---------------------------------------------------------------- index
@dataclass(slots=True, eq=False)
class _Entry:
    id: int
    tenant: str
    partition: tuple[str, str, tuple[int, ...], int]
    row: int
    ref: Any
    lexical: Lexical
    nbytes: int
    text_hash: int


@dataclass(slots=True, eq=False)
class _Partition:
    matrix: Vector
    entries: list[_Entry] = field(default_factory=list)
    #: The entry of each question text (xxh3-64 of it): the same question replaces its entry.
    by_text: dict[int, _Entry] = field(default_factory=dict)

    def add(self, vector: Vector, entry: _Entry) -> None:
        n = len(self.entries)
        if n == self.matrix.shape[0]:
            grown = np.empty((max(8, 2 * n), self.matrix.shape[1]), dtype=np.float32)
            grown[:n] = self.matrix[:n]
            self.matrix = grown
        self.matrix[n] = vector
        entry.row = n
        self.entries.append(entry)
        self.by_text[entry.text_hash] = entry

    def remove(self, entry: _Entry) -> None:
        row, last = entry.row, len(self.entries) - 1
        if row != last:
            moved = self.entries[last]
            self.matrix[row] = self.matrix[last]
            self.entries[row] = moved
            moved.row = row
        self.entries.pop()
        if self.by_text.get(entry.text_hash) is entry:
            del self.by_text[entry.text_hash]
        if 8 < len(self.entries) * 4 < self.matrix.shape[0]:
            self.matrix = self.matrix[: 2 * len(self.entries)].copy()


@dataclass(slots=True)
class _Tenant:
    used_bytes: int = 0
    partitions: dict[tuple[str, str, tuple[int, ...], int], _Partition] = field(
        default_factory=dict
    )
    #: Entries in recency order (least recent first).
    lru: OrderedDict[int, _Entry] = field(default_factory=OrderedDict)
    evictions: int = 0


@dataclass(frozen=True, slots=True)
class Match:
    """The outcome of a lookup.

    ``result``: ``hit``, ``miss`` (nothing at the threshold), ``guard`` (the most
    similar entry reached the threshold and failed the guard, ``reason`` says
    which check) or ``empty`` (no entry in the probe's partition).
    """

    result: str
    similarity: float | None = None
    ref: Any = None
    reason: str | None = None
    entry_id: int | None = None


@dataclass(frozen=True, slots=True)
class TenantStats:
    entries: int
    used_bytes: int
    max_bytes: int
    partitions: int
    evictions: int


def normalise(vector: npt.ArrayLike) -> Vector:
    """``vector`` as a unit-length float32 row; ValueError for an empty, zero or non-finite one."""
    v = np.asarray(vector, dtype=np.float32).reshape(-1)
    if v.size == 0 or not np.all(np.isfinite(v)):
        raise ValueError("an embedding must be a non-empty vector of finite numbers")
    norm = float(np.linalg.norm(v))
    if norm == 0.0:
        raise ValueError("a zero embedding has no direction")
    out: Vector = v / np.float32(norm)
    return out


class SemanticIndex:
    """Per-tenant vector partitions with a byte bound each (not thread-safe: one event loop).

    ``max_bytes(tenant)`` gives a tenant's bound (0: the tenant stores nothing).
    Entries carry an opaque ``ref`` (the sidecar keeps the exact entry's key);
    vectors must all have one dimension, fixed by the first one added.
    """

    def __init__(
        self,
        max_bytes: Callable[[str], int] = lambda _t: DEFAULT_TENANT_BYTES,
        *,
        guard: Guard = Guard(),
    ) -> None:
        self.max_bytes = max_bytes
        self.guard = guard
        self.dim: int | None = None
        self._tenants: dict[str, _Tenant] = {}
        self._ids: dict[int, _Entry] = {}
        self._next_id = 0

    # ------------------------------------------------------------ lookups
    def lookup(self, probe: Probe, vector: Vector, threshold: float) -> Match:
        """The most similar entry of the probe's partition, if it is close enough and passes."""
        tenant = self._tenants.get(probe.tenant)
        part = tenant.partitions.get(probe.partition) if tenant is not None else None
        if tenant is None or part is None or not part.entries:
            return Match("empty")
        if vector.shape != (part.matrix.shape[1],):
            raise ValueError(f"embedding has {vector.shape[0]} dimensions, index {self.dim}")
        n = len(part.entries)
        sims = part.matrix[:n] @ vector
        best = int(np.argmax(sims))
        similarity = float(min(1.0, sims[best]))
        entry = part.entries[best]
        if similarity < threshold:
            return Match("miss", similarity)
        reason = lexical_guard(probe.lexical, entry.lexical, self.guard)
        if reason is not None:
            return Match("guard", similarity, reason=reason)
        tenant.lru.move_to_end(entry.id)
        return Match("hit", similarity, entry.ref, entry_id=entry.id)

    # ------------------------------------------------------------ updates
    def add(self, probe: Probe, vector: Vector, ref: Any) -> int:
        """Index ``ref`` under ``probe``'s text; returns how many entries were evicted.

        An entry equal in text within the partition is replaced (the newer
        answer wins). A tenant whose bound cannot hold one entry stores nothing.
        """
        if self.dim is None:
            self.dim = int(vector.shape[0])
        if vector.shape != (self.dim,):
            raise ValueError(f"embedding has {vector.shape[0]} dimensions, index {self.dim}")
        limit = self.max_bytes(probe.tenant)
        cost = self.dim * 4 + len(probe.text.encode()) + probe.lexical.nbytes
        cost += ENTRY_OVERHEAD_BYTES
        if cost > limit:
            return 0
        tenant = self._tenants.setdefault(probe.tenant, _Tenant())
        part = tenant.partitions.get(probe.partition)
        if part is None:
            part = tenant.partitions[probe.partition] = _Partition(
                np.empty((8, self.dim), dtype=np.float32)
            )
        text_hash = xxhash.xxh3_64_intdigest(probe.text.encode())
        same = part.by_text.get(text_hash)
        if same is not None:
            self._remove(tenant, same.id)
            part = tenant.partitions.setdefault(
                probe.partition, _Partition(np.empty((8, self.dim), dtype=np.float32))
            )
        entry_id = self._next_id
        self._next_id += 1
        entry = _Entry(
            entry_id, probe.tenant, probe.partition, 0, ref, probe.lexical, cost, text_hash
        )
        part.add(vector, entry)
        tenant.lru[entry_id] = entry
        self._ids[entry_id] = entry
        tenant.used_bytes += cost
        evicted = 0
        while tenant.used_bytes > limit and tenant.lru:
            self._remove(tenant, next(iter(tenant.lru)))
            evicted += 1
        tenant.evictions += evicted
        return evicted

    def remove(self, entry_id: int) -> bool:
        """Drop one entry (its answer is gone from L1/L2); False if it was not there."""
        entry = self._ids.get(entry_id)
        if entry is None:
            return False
        self._remove(self._tenants[entry.tenant], entry_id)
        return True

    def _remove(self, tenant: _Tenant, entry_id: int) -> None:
        entry = tenant.lru.pop(entry_id)
        del self._ids[entry_id]
        tenant.used_bytes -= entry.nbytes
        part = tenant.partitions[entry.partition]
        part.remove(entry)
        if not part.entries:
            del tenant.partitions[entry.partition]

    def retain(self, keep: Callable[[str, tuple[str, str, tuple[int, ...], int]], bool]) -> int:
        """Drop every partition for which ``keep(tenant, partition)`` is false; returns entries."""
        dropped = 0
        for name, tenant in list(self._tenants.items()):
            for partition in [p for p in tenant.partitions if not keep(name, p)]:
                for entry in list(tenant.partitions[partition].entries):
                    self._remove(tenant, entry.id)
                    dropped += 1
        return dropped

    def forget(self, tenant: str) -> int:
        """Drop a tenant's entries (idle expiry, L3 switched off); returns how many."""
        state = self._tenants.pop(tenant, None)
        if state is None:
            return 0
        for entry_id in state.lru:
            del self._ids[entry_id]
        return len(state.lru)

    def enforce_bounds(self) -> int:
        """Evict down to each tenant's current bound (after the bounds changed)."""
        evicted = 0
        for name in list(self._tenants):
            tenant = self._tenants[name]
            limit = self.max_bytes(name)
            while tenant.used_bytes > limit and tenant.lru:
                self._remove(tenant, next(iter(tenant.lru)))
                tenant.evictions += 1
                evicted += 1
        return evicted

    # ------------------------------------------------------------ stats
    def __len__(self) -> int:
        return len(self._ids)

    def tenants(self) -> Iterator[str]:
        return iter(self._tenants)

    def stats(self) -> dict[str, TenantStats]:
        return {
            name: TenantStats(
                len(t.lru), t.used_bytes, self.max_bytes(name), len(t.partitions), t.evictions
            )
            for name, t in self._tenants.items()
        }


# ---------------------------------------------------------------- a deterministic embedding
def hashed_ngrams(text: str, dim: int = 384, *, sizes: tuple[int, ...] = (3, 4, 5)) -> Vector:
    """A documented, model-free embedding: hashed character n-grams, L2-normalised.

    The text is lower-cased, its whitespace collapsed and padded with one space
    each side; every character n-gram of the given ``sizes`` adds 1 to the
    coordinate ``crc32(ngram) % dim`` (the feature-hashing trick of Weinberger
    et al. 2009). Cosine similarity then measures shared character n-grams:
    a lexical, not a semantic, similarity. Used by the test upstream and as the
    ``hashed`` source (no model to install); all-MiniLM-L6-v2 is the semantic one.
    """
    norm = " " + " ".join(text.lower().split()) + " "
    counts = np.zeros(dim, dtype=np.float32)
    data = norm.encode()
    for size in sizes:
        for i in range(max(0, len(data) - size + 1)):
            counts[zlib.crc32(data[i : i + size]) % dim] += 1.0
    if not counts.any():
        counts[0] = 1.0
    return normalise(counts)
