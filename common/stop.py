"""Stop-string matching whose cost per token does not grow with the number of stop strings.

Lifecycle: an `IncrementalDetokenizer` builds one `StopStrings` per request from its stop list
and, each time the output text grows, asks `first(text, start)` for the earliest stop string
that ends in the new text (from `start` on). The strings are grouped by length in sets, so one
check costs (new characters) x (distinct lengths) set lookups, bounded by the longest stop
string the coordinator accepts, not by the list. `first_slow` is the obvious twin (one
`str.find` per stop string), kept for the test that compares them.
"""
from __future__ import annotations


class StopStrings:
    def __init__(self, stops):
        self.by_len: dict[int, set[str]] = {}
        for s in stops:
            self.by_len.setdefault(len(s), set()).add(s)
        self.lengths = sorted(self.by_len)
        self.longest = self.lengths[-1] if self.lengths else 0

    def __bool__(self) -> bool:
        return bool(self.lengths)

    def first(self, text: str, start: int) -> tuple[int, str] | None:
        """The earliest (index, stop string) ending after `start` (the shortest at a tie), or None."""
        best: tuple[int, int] | None = None  # (index, length)
        for end in range(max(start + 1, 1), len(text) + 1):
            if best is not None and end - self.longest > best[0]:
                break  # every later occurrence starts after the best one
            for n in self.lengths:
                i = end - n
                if i < 0:
                    break
                if (best is None or (i, n) < best) and text[i:end] in self.by_len[n]:
                    best = (i, n)
        return None if best is None else (best[0], text[best[0]:best[0] + best[1]])


def first_slow(stops, text: str, start: int) -> tuple[int, str] | None:
    """The twin of `StopStrings.first`: one find per stop string from `start - (longest - 1)`."""
    lo = max(0, start - max((len(s) for s in stops), default=1) + 1)
    hits = [(i, s) for s in stops if (i := text.find(s, lo)) >= 0]
    return min(hits) if hits else None
