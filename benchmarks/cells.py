"""One server's run at one offered load, as scripts/goodput and scripts/overload_check count it.

A `Cell` (made by `make_cell` from a run's request outputs) holds: requests offered (sent),
served, shed (HTTP 429: refused by admission control), failed otherwise (an admitted request
lost), goodput (served requests/s within both latency targets, as `pdserve bench --goodput`
counts it), the served requests' p99 TTFT and p99 TPOT and the p99 time to a 429.
`format_cells` prints cells one a line.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Cell:
    """One timed run of one server: what came of its requests."""

    rate: float  # offered load, req/s
    sent: int
    served: int
    shed: int  # HTTP 429: refused by admission control
    failed: int  # any other error: an admitted request lost ("lost")
    duration: float  # seconds, first send to last answer
    goodput: float  # served req/s within both targets
    ttft_p99_ms: float | None  # of the served requests; None when none was served
    tpot_p99_ms: float | None
    shed_p99_ms: float | None  # send to the 429; None when none was shed

    @property
    def admitted(self) -> int:
        return self.sent - self.shed

    @property
    def on_time(self) -> int:
        """Requests served within both targets."""
        return round(self.goodput * self.duration)


def is_shed(o) -> bool:
    return not o.success and o.error.startswith("HTTP 429")


def make_cell(rate: float, outputs, duration: float, ttft_ms: float, tpot_ms: float) -> Cell:
    from pdserve.bench.metrics import compute_metrics, summarize

    m = compute_metrics(outputs, duration, {"ttft": ttft_ms, "tpot": tpot_ms}, metrics=("ttft", "tpot"), percentiles=(99,))
    shed = [o.latency for o in outputs if is_shed(o)]
    served = m.completed
    return Cell(rate, len(outputs), served, len(shed), m.failed - len(shed), duration, m.request_goodput or 0.0,
                m.latency_ms["ttft"]["p99"] if served else None, m.latency_ms["tpot"]["p99"] if served else None,
                summarize(shed, (99,))["p99"] if shed else None)


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def format_cells(cells: list[tuple[str, Cell]]) -> list[str]:
    """One line per cell: label, offered load (req/s), requests offered (sent), admitted (not shed),
    served, shed, lost (admitted, then failed), goodput, p99s."""
    head = (f"{'':24s} {'req/s':>6s} {'offered':>7s} {'admitted':>8s} {'served':>6s} {'shed':>5s} {'lost':>4s} {'goodput':>7s} "
            f"{'TTFT p99':>8s} {'TPOT p99':>8s} {'429 p99':>7s}")
    lines = [head, "-" * len(head)]
    for label, c in cells:
        lines.append(f"{label:24s} {c.rate:6g} {c.sent:7d} {c.admitted:8d} {c.served:6d} {c.shed:5d} {c.failed:4d} {c.goodput:7.2f} "
                     f"{ms(c.ttft_p99_ms):>8s} {ms(c.tpot_p99_ms):>8s} {ms(c.shed_p99_ms):>7s}")
    lines.append("(goodput: served req/s within both targets; TTFT/TPOT: ms, p99 of the served requests; "
                 "429 p99: ms to a refusal)")
    return lines
