"""What cache hits saved the model, and the optional price table that turns it into money (pure).

Every entry records the token ``usage`` of its answer and the upstream
seconds its fill took (:mod:`cachefleet_sidecar.cache.entry`); a hit adds them to
its tenant's :class:`Saved` counters, per model. With a price table
(``--price-table FILE``) a hit also adds what those tokens would have cost.

The price table is a JSON object from model name to prices per 1,000
tokens, in any one currency (the metric has no currency)::

    {"meta-llama/Llama-3.1-8B-Instruct": {"prompt": 0.0002, "completion": 0.0006},
     "*": {"prompt": 0.0005, "completion": 0.0015}}

``"*"`` prices every model the table does not name; a model with no price
adds nothing to the cost counter. The flag takes the file's name or, when
it starts with ``{``, the JSON itself: that is how the operator passes an
InferenceCache's ``spec.savings.prices`` (:func:`format_price_table`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import orjson

#: The price-table key that prices every model it does not name.
ANY_MODEL = "*"

#: Prices per 1,000 tokens: (prompt, completion).
Price = tuple[float, float]


class PriceTableError(ValueError):
    """A price table that cannot be used; the message names the entry."""


def parse_price_table(raw: bytes) -> dict[str, Price]:
    """``{model: (prompt, completion)}`` per 1,000 tokens from the JSON text ``raw``."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise PriceTableError(f"not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise PriceTableError("must be a JSON object of model -> {prompt, completion}")
    out: dict[str, Price] = {}
    for model, prices in doc.items():
        if not isinstance(prices, dict) or set(prices) - {"prompt", "completion"}:
            raise PriceTableError(
                f"{model!r}: must be an object with only 'prompt' and 'completion' prices"
            )
        pair = []
        for kind in ("prompt", "completion"):
            value = prices.get(kind, 0)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise PriceTableError(f"{model!r}.{kind}: must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise PriceTableError(f"{model!r}.{kind}: must be a finite number >= 0")
            pair.append(float(value))
        out[str(model)] = (pair[0], pair[1])
    return out


def load_price_table(path: str) -> dict[str, Price]:
    """:func:`parse_price_table` of the file ``path``."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise PriceTableError(f"cannot read {path}: {exc.strerror}") from exc
    return parse_price_table(raw)


def price_table_flag(value: str) -> dict[str, Price]:
    """The ``--price-table`` flag: the JSON itself when it starts with ``{``, else its file."""
    if value.lstrip().startswith("{"):
        return parse_price_table(value.encode())
    return load_price_table(value)


def format_price_table(table: Mapping[str, Price]) -> str:
    """The JSON of ``table`` that :func:`parse_price_table` reads back."""
    doc = {
        model: {"prompt": prompt, "completion": completion}
        for model, (prompt, completion) in table.items()
    }
    return orjson.dumps(doc, option=orjson.OPT_SORT_KEYS).decode()


def cost(table: Mapping[str, Price], model: str, prompt: int, completion: int) -> float | None:
    """What ``prompt`` and ``completion`` tokens of ``model`` cost; None when unpriced."""
    price = table.get(model) or table.get(ANY_MODEL)
    if price is None:
        return None
    return (prompt * price[0] + completion * price[1]) / 1000.0


@dataclass(slots=True)
class Saved:
    """What hits on one (tenant, model) saved: tokens not sent, model seconds, cost."""

    hits: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model_seconds: float = 0.0
    cost: float = 0.0

    def add(self, prompt: int, completion: int, seconds: float, price: float | None) -> None:
        self.hits += 1
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.model_seconds += seconds
        if price is not None:
            self.cost += price

    def add_many(
        self, hits: int, prompt: int, completion: int, seconds: float, cost: float
    ) -> None:
        """Count ``hits`` hits at once: the sums of what they saved (and cost)."""
        self.hits += hits
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.model_seconds += seconds
        self.cost += cost

    def as_dict(self) -> dict[str, float | int]:
        return {
            "hits": self.hits,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "model_seconds": round(self.model_seconds, 3),
            "cost": round(self.cost, 6),
        }
