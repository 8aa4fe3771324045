"""How much of a step's communication is *exposed*: interval arithmetic over a profiled step's device kernels.

An NCCL kernel's device time over-counts what communication costs a step twice over: the kernel runs on its
own stream, overlapping compute kernels on other streams, and its duration includes the time it spins
waiting for the peer rank. What the step really pays is the time the GPU does communication *and nothing
else*. With ``C`` the union of the NCCL kernels' intervals and ``K`` the union of every other device
activity's (any stream), this module measures

* ``comm_busy_s``    = |C|       -- the time at least one NCCL kernel runs;
* ``compute_busy_s`` = |K|       -- the time at least one other kernel (or memcpy / memset) runs;
* ``exposed_comm_s`` = |C \\ K|  -- communication not hidden behind any compute: the overlap-corrected cost.

The wait for the peer stays in ``exposed_comm_s`` wherever nothing else runs meanwhile: there it measures
load imbalance between ranks as much as transfer time.

``exposed_comm_s <= comm_busy_s <= comm_kernel_s`` (the plain sum of the NCCL kernels' durations). Per
collective kind the same is done with that kind's kernels alone against ``K``; kinds that overlap each
other (an all-gather prefetched during a reduce-scatter) make the per-kind exposed times sum to more than
the total.

Everything here is pure: intervals are ``(start, end)`` pairs of floats (seconds) with ``start <= end``.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

Interval = tuple[float, float]

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals; overlapping or touching ones join, empty
    ones (``start == end``) vanish. Raises ``ValueError`` on an interval that ends before it starts."""
    items = []
    for start, end in intervals:
        if end < start:
            raise ValueError(f"interval ({start}, {end}) ends before it starts")
        if end > start:
            items.append((start, end))
    items.sort()
    out: list[Interval] = []
    for start, end in items:
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def length(intervals: Iterable[Interval]) -> float:
    """The measure of the union of ``intervals`` (each point counted once)."""
    return sum(end - start for start, end in merge(intervals))


def intersect(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """``(union of a) & (union of b)`` as sorted disjoint intervals."""
    a, b = merge(a), merge(b)
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """``(union of a) minus (union of b)`` as sorted disjoint intervals."""
    b = merge(b)
    out: list[Interval] = []
    j = 0
    for start, end in merge(a):
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def exposed_length(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """``|A \\ B|``: the time covered by ``a`` and not by ``b`` (e.g. communication no compute hides)."""
    return length(subtract(a, b))


def collective_kind(name: str) -> str | None:
    """The collective of a profiler event name (``ncclDevKernel_AllGather_RING_LL``, ``gloo:all_gather``):
    one of :data:`COLLECTIVES`, or ``None`` when the name names none of them."""
    squashed = name.lower().replace("_", "").replace(" ", "")
    for kind in COLLECTIVES:
        if kind.replace("_", "") in squashed:
            return kind
    return None


def is_nccl(name: str) -> bool:
    """Whether a device kernel is NCCL's (its name carries ``nccl``: ``ncclDevKernel_*``, ``ncclKernel_*``)."""
    return "nccl" in name.lower()


def overlap_summary(kernels: Sequence[tuple[str, float, float]], step: Sequence[Interval],
                    phases: Mapping[str, Sequence[Interval]] | None = None) -> dict:
    """Split one rank's profiled step into communication and compute.

    ``kernels``: ``(name, start_s, end_s)`` of every device activity (NCCL kernels by :func:`is_nccl`, all
    others count as compute); ``step``: the step's window(s), outside which kernels are ignored; ``phases``:
    optional windows per phase name (clipped to the step; the step's time outside every phase becomes
    ``"other"``). Returns ``comm_kernel_s``, ``comm_busy_s``, ``compute_busy_s``, ``exposed_comm_s`` and
    ``step_s`` (|step|) for the step, ``kinds`` (per collective, ``"other"`` for an NCCL kernel of none:
    ``kernel_s``, ``busy_s``, ``exposed_s``) and, with ``phases``, ``phases`` (per phase: ``seconds`` and the
    three busy / exposed numbers within it). Seconds, as the input."""
    step = merge(step)
    comm_by_kind: dict[str, list[Interval]] = {kind: [] for kind in COLLECTIVES + ("other",)}
    compute: list[Interval] = []
    for name, start, end in kernels:
        if is_nccl(name):
            comm_by_kind[collective_kind(name) or "other"].append((start, end))
        else:
            compute.append((start, end))
    compute_u = intersect(compute, step)
    comm_u = intersect([iv for ivs in comm_by_kind.values() for iv in ivs], step)

    def within(window: list[Interval]) -> dict[str, float]:
        c = intersect(comm_u, window)
        return {"seconds": length(window), "comm_busy_s": length(c),
                "compute_busy_s": length(intersect(compute_u, window)), "exposed_comm_s": exposed_length(c, compute_u)}

    kinds = {}
    for kind, ivs in comm_by_kind.items():
        clipped = [(max(s, lo), min(e, hi)) for s, e in ivs for lo, hi in step if s < hi and e > lo]
        union = merge(clipped)
        kinds[kind] = {"kernel_s": sum(e - s for s, e in clipped), "busy_s": length(union),
                       "exposed_s": exposed_length(union, compute_u)}
    whole = within(step)
    out = {"step_s": whole["seconds"], "comm_kernel_s": sum(k["kernel_s"] for k in kinds.values()),
           "comm_busy_s": whole["comm_busy_s"], "compute_busy_s": whole["compute_busy_s"],
           "exposed_comm_s": whole["exposed_comm_s"], "kinds": kinds}
    if phases is not None:
        out["phases"] = {name: within(intersect(windows, step)) for name, windows in phases.items()}
        out["phases"]["other"] = within(subtract(step, [iv for ws in phases.values() for iv in ws]))
    return out


__all__ = ["COLLECTIVES", "Interval", "merge", "length", "intersect", "subtract", "exposed_length",
           "collective_kind", "is_nccl", "overlap_summary"]
