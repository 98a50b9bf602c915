"""Choosing the next token from a row of logits: greedy, or sampled with temperature, top-k and
top-p (nucleus), from a generator seeded per sequence so that a seed reproduces a generation.
Pure NumPy; the runtime calls it once per sequence and step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# what a request may ask: past these the answer is a 400, not a slow or empty generation
MAX_STOP_STRINGS = 4
MAX_STOP_LENGTH = 128


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: every token
    seed: int | None = None
    stop: tuple[str, ...] = ()  # strings that end the generation (not included in the text)
    stop_token_ids: tuple[int, ...] = ()  # tokens that end it besides the model's end-of-sequence
    ignore_eos: bool = False
    min_tokens: int = 0  # end-of-sequence and stop tokens are never chosen before this many

    def problems(self) -> list[str]:
        """What is wrong with these parameters, each naming the field."""
        found = []
        if self.max_tokens < 1:
            found.append(f"max_tokens must be at least 1, not {self.max_tokens}")
        if not 0 <= self.temperature <= 2:
            found.append(f"temperature must be between 0 and 2, not {self.temperature}")
        if not 0 < self.top_p <= 1:
            found.append(f"top_p must be in (0, 1], not {self.top_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            found.append(
                f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), not {self.min_tokens}"
            )
        if self.seed is not None and not 0 <= self.seed < 2**64:
            found.append(f"seed must be between 0 and 2**64 - 1, not {self.seed}")
        if self.top_k < 0:
            found.append(f"top_k must be 0 (off) or positive, not {self.top_k}")
        if len(self.stop) > MAX_STOP_STRINGS:
            found.append(f"stop takes at most {MAX_STOP_STRINGS} strings, not {len(self.stop)}")
        for text in self.stop:
            if not text or len(text) > MAX_STOP_LENGTH:
                found.append(f"each stop string must be 1 to {MAX_STOP_LENGTH} characters, not {len(text)}")
        return found

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass
class Sampler:
    """One sequence's sampler: its parameters and its own random stream."""

    params: SamplingParams
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.params.seed)

    def choose(self, logits: np.ndarray) -> int:
        params = self.params
        if params.greedy:
            return int(np.argmax(logits))
        scores = logits.astype(np.float64) / params.temperature
        if 0 < params.top_k < scores.size:
            kth = np.partition(scores, -params.top_k)[-params.top_k]
            scores = np.where(scores < kth, -np.inf, scores)
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        if params.top_p < 1:
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            # the smallest prefix whose mass reaches top_p, always at least the likeliest token
            keep = order[: int(np.searchsorted(cumulative, params.top_p)) + 1]
            kept = np.zeros_like(probs)
            kept[keep] = probs[keep]
            probs = kept / kept.sum()
        return int(self.rng.choice(probs.size, p=probs))


__all__ = ["MAX_STOP_LENGTH", "MAX_STOP_STRINGS", "Sampler", "SamplingParams"]
