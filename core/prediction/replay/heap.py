"""The replay's ledger: bytes held by live tensors as allocations and frees come in order, and what a pass returns."""

from __future__ import annotations

from dataclasses import dataclass

FP32 = 4


@dataclass(frozen=True)
class PrefillPeak:
    """The most bytes the prefill's forward pass holds at once beyond the weights (``peak``), and what it
    holds when it returns (``end``: the KV it wrote and the logits of the last position).

    ``where`` names the moment of the peak (e.g. "layer 2 softmax"), ``exact`` says whether the replay
    follows this model type's own code (False: the Llama layer stood in for it)."""

    peak: int
    end: int
    where: str
    exact: bool
    logits: int = 0  # of ``end``: the logits returned (the rest is the KV the pass added)

    @property
    def transient(self) -> int:
        """The peak less the KV the pass added: bytes beyond the weights and the cache it leaves (its temporaries
        at the peak, the logits included)."""
        return self.peak - (self.end - self.logits)


class Heap:
    """Bytes held by live tensors, and the high-water mark, as allocations and frees come in order."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0
        self.where = ""
        self.at = ""

    def alloc(self, n: int) -> int:
        """Allocate ``n`` bytes at the moment named ``at``; returns ``n`` (the tensor's size, to free later)."""
        self.now += n
        if self.now > self.peak:
            self.peak, self.where = self.now, self.at
        return n

    def free(self, *sizes: int) -> None:
        """Free tensors of these sizes (0: a tensor that was never allocated)."""
        self.now -= sum(sizes)
