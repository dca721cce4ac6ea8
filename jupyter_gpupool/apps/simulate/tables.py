"""The simulator's tables and notes, as `jupyter gpupool simulate` prints them."""

from __future__ import annotations

from jupyter_gpupool.apps.cli import table
from jupyter_gpupool.apps.oracle import ORACLE_PROMISES
from jupyter_gpupool.apps.simulate.modes import ModeResult
from jupyter_gpupool.apps.simulate.plans import MODE_LABELS, SUSPENDING, RequestSizes
from jupyter_gpupool.apps.simulate.search import SearchResult
from jupyter_gpupool.units import (
    format_duration,
    format_size,
)


# --- presentation -----------------------------------------------------------------------------------
def results_table(results: dict[str, ModeResult]) -> str:
    """One row per mode; with pooled+suspend, also its suspends, resume waits and parked host RAM."""
    suspending = any(r.mode in SUSPENDING for r in results.values())
    elastic = any(r.mode == "elastic" for r in results.values())
    headers = ["mode", "leased", "used", "busy", "wait p50", "wait p95", "wait max", "served/day", "gave up/day", "reclaims", "Jain"]
    if suspending:
        headers += ["suspends", "resume wait p95", "parked peak / p95", "work lost"]
    if elastic:
        headers += ["guaranteed", "grows / taken back", "grow wait p95"]
    rows = [
        [
            MODE_LABELS[r.mode],
            f"{r.leased_pct:.1f}%",
            f"{r.used_pct:.1f}%",
            f"{r.busy_pct:.1f}%",
            format_duration(r.wait_p50),
            format_duration(r.wait_p95),
            format_duration(r.wait_max),
            f"{r.served_per_day:.1f}",
            f"{r.abandoned / r.days:.1f}",
            str(r.reclaims),
            f"{r.jain:.3f}",
            *(suspend_columns(r) if suspending else []),
            *(elastic_columns(r) if elastic else []),
        ]
        for r in results.values()
    ]
    return table(headers, rows)


def suspend_columns(r: ModeResult) -> list[str]:
    """Suspends, p95 resume wait and parked host RAM (peak / p95) of a pooled+suspend result (dashes for
    the other modes), and every mode's work lost: GPU-busy time culled kernels had computed."""
    lost = f"{r.work_lost / 3600:.1f} h"
    if r.mode not in SUSPENDING:
        return ["-", "-", "-", lost]
    return [str(r.suspends), format_duration(r.resume_wait_p95), f"{format_size(r.parked_peak)} / {format_size(r.parked_p95)}", lost]


def copy_rates(checkpoint_rate: float, restore_rate: float | None) -> str:
    """``suspend/restore at 25 GB/s``, or ``suspend at 2 GB/s, restore at 6 GB/s`` where they differ."""
    if not restore_rate or restore_rate == checkpoint_rate:
        return f"suspend/restore at {checkpoint_rate / 1e9:g} GB/s"
    return f"suspend at {checkpoint_rate / 1e9:g} GB/s, restore at {restore_rate / 1e9:g} GB/s"


def requests_note(requests: RequestSizes, default_slice: int, results: dict[str, ModeResult], keeps: tuple[str, ...] = ()) -> str:
    """What sessions asked for, and the rule for those that needed more (a note under the table)."""
    if requests.kind == "exact":
        asked = "exact: each session asks for its need rounded up to a GiB"
    elif requests.kind == "default":
        asked = f"default: each session asks for the pool's default slice ({format_size(default_slice)})"
    else:
        asked = f"a mix: {', '.join(f'{w:.0%} ask for {size}' for size, w in zip(requests.sizes, requests.weights, strict=True))}"
    note = f"Requests {asked}; exclusive GPUs ask for a whole GPU."
    pooled = [r for r in results.values() if r.mode not in ("exclusive", "elastic", "oracle")]
    if requests.kind != "exact" and pooled:
        note += (
            f" In the fixed-slice modes a session that needs more than it asked for is taken to have asked for its need "
            f"rounded up to a GiB ({pooled[0].raised} of {pooled[0].sessions} sessions here)."
        )
    if "elastic" in results:
        r = results["elastic"]
        note += (
            f" elastic: each is guaranteed what it asked for and its slice grows on demand up to the pool's burst limit "
            f"(PoolPolicy.burst) while its GPU has memory nobody is guaranteed; leased counts current sizes. A session "
            f"whose need is above that limit is taken to have asked for a limit of its need ({r.raised} of {r.sessions})."
        )
        if r.abandoned:
            note += (
                f" Of the {r.abandoned} elastic sessions given up, {r.gave_up_growing} waited for their slice to grow; "
                f"every kernel on a GPU waited to grow {r.grow_stalled_pct:.1f}% of the GPU time."
            )
    if "oracle" in results:
        note += oracle_note(results["oracle"], keeps)
    return note


def oracle_note(r: ModeResult, keeps: tuple[str, ...] = ()) -> str:
    """What the oracle plays: the physical limit, or that limit keeping some of the pool's promises."""
    if not keeps:
        return (
            f" oracle: the physical limit for these sessions, whatever they ask for: a cell holds exactly its use while it "
            f"computes and nothing while idle (parked and moved for free), and starts when the running cells pass a per-GPU "
            f"packing bound (the larger of total use over GPU size and the uses over half a GPU); every cell after an idle "
            f"spell is a request ({r.requests} here)."
        )
    kept = "; ".join(ORACLE_PROMISES[name] for name in keeps)
    return (
        f" oracle keeping {','.join(keeps)}: the physical limit for a scheduler that keeps these promises of the pool "
        f"({kept}); otherwise moved and parked for free and packed by the same per-GPU bound; {r.requests} of its "
        f"{r.cells} cells asked for memory."
    )


def elastic_columns(r: ModeResult) -> list[str]:
    """Elastic slices: memory guaranteed (leased is their current size), grows and burst taken back, and
    the p95 wait of a cell for its slice to grow (dashes for the other modes)."""
    if r.mode != "elastic":
        return ["-", "-", "-"]
    return [f"{r.guaranteed_pct:.1f}%", f"{r.grows} / {r.shrinks}", format_duration(r.grow_wait_p95)]


def search_table(searches: dict[str, SearchResult]) -> str:
    rows = []
    for s in searches.values():
        tried = ", ".join(f"{k}:{format_duration(v)}" for k, v in sorted(s.tried.items()))
        rows.append([MODE_LABELS[s.mode], str(s.gpus) if s.gpus else f"> {max(s.tried, default=0)}", tried])
    return table(["mode", "fewest GPUs", "p95 wait by GPU count"], rows)
