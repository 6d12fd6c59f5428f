"""Reproduce paper 000 (locality-aware routing) §4 in the simulator.

* Fig. 8 (§4.2): throughput of a two-stage application when the share of
  tuples whose two keys "match" (the locality parameter L) varies, for
  locality-aware tables, hash routing and the worst case, 12 kB tuples.
* Fig. 11 (§4.3): next-window locality and load imbalance of online
  (retrained every window), offline (trained once) and hash routing on a
  drifting (region, hashtag) stream, 6 instances per stage; online is run
  with both history policies, reset (000 §3.2) and decay (keyplane's
  "decayed statistics").
* Fig. 12 (§4.3): next-window locality when only the E most frequent key
  pairs (edges) are kept, for several parallelisms.

    python bench/reproduce_locality.py --quick
    python bench/reproduce_locality.py --out docs/reproduction/000-locality.md
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from keyplane.algorithms.baselines import HashPartitioner
from keyplane.algorithms.locality import build_plan
from keyplane.algorithms.locality_plan import LocalityPlan, TableRouter
from keyplane.algorithms.pair_history import HistoryPolicy, PairHistory
from keyplane.algorithms.pair_statistics import KeyWeights, PairStatistics, aggregate_pairs
from keyplane.algorithms.partitioner import Partitioner
from keyplane.reference.workloads import GeoTagsWorkload, PairsWorkload
from keyplane.sim import ClusterConfig, SimulationMetrics, Stage, Trace, simulate, summarize
from keyplane.sim.report import Cell, markdown_table

B_NAMESPACE = 1 << 40
"""Offset added to field-2 keys. Stage B's keys (hashtags, or j) are not the
same things as stage A's (regions, or i), so they must not share hash values:
with one hash function for both stages, a tuple (i, i) would be local under
hash routing by construction, which real fields grouping (different tasks,
placed by the scheduler) does not give."""

ALPHA = 1.03
"""000 §4.3: METIS' default imbalance tolerance, the value the paper used."""

HEADER_BYTES = 100
"""Bytes of a tuple besides its padding (two ids and framing)."""

LINK_BANDWIDTH = 1.25e9
"""10 Gb/s per server, the paper's network (000 §4.1)."""

NETWORK_DELAY = 50e-6
"""One-way delay of a remote hop inside a rack."""

N_REGIONS = 200
"""Regions of the Fig. 11 stream. The paper's Twitter locations are countries,
cities and points of interest, i.e. many; with the workload's default of 50
Zipf-popular regions, hashing them onto 6 instances is already 2x imbalanced,
which would hide what the tables do to balance."""

FIG8_SERVICE_TIME = 1e-6
"""Processing time of a tuple, chosen so that sending a 12 kB tuple over
10 Gb/s (9.8 µs) costs ten times more than processing it: the network is the
bottleneck below L = 0.9 and the CPU above, which is where Fig. 8 plateaus."""


DEFAULT_SEED = 7

FINDINGS = """## Findings (full run, default seed)

* Fig. 11: online routing keeps 66 % next-window locality (reset; 64 % with
  decay) against 17 % for hash, with mean imbalance 1.07 (1.13 with decay):
  the target (≥ 45 %, ≤ 1.2) is met. Every table's realised locality is well
  below what METIS predicts on its training window (82 %), as in the paper
  (75 % predicted, about 50 % realised).
* Offline starts like online (66 %) but falls to the hash level (15–18 %)
  within five windows, where the paper's offline held about 40 %:
  `GeoTagsWorkload` replaces every favourite tag within five windows, so it
  has none of the stable associations the Twitter data kept.
* History policy: decayed statistics were slightly *worse* than reset here
  (64.2 % against 66.3 % mean locality, worst imbalance 1.27 against 1.23).
  This stream changes a fifth of its associations every window and its
  flashes last a fifth of a window, so older windows mostly add stale pairs.
  The design brief's observation (decay clearly better on a real drifting
  trace) is not reproduced on this synthetic stream; the setting stays a
  choice to measure per workload.
* Fig. 12: locality grows with the number of edges kept, roughly with its
  logarithm, and saturates: at n = 6, 300 edges (1.7 % of a window's pairs)
  more than double hash's locality (0.39 against 0.17) and 3 000 edges (17 %)
  reach 96 % of what all pairs give. The paper doubled locality with 0.1 %
  of the edges; our windows hold about 17 000 distinct pairs, the paper's
  millions.
* Fig. 8: hash routing is flat in L (locality about 1/n), the paper's table
  gains throughput with L and plateaus from L = 0.9 (where the CPU, not the
  link, becomes the bottleneck by construction of the service time), and the
  worst case loses throughput as L grows. keyplane's `build_plan` trained on
  the same data matches or beats the paper's hand-written table (it is scored
  in-sample and also co-locates chance (i, j) pairs). Hash is slightly below
  the worst case at n = 4 and 6 because hashing 100 keys per instance leaves
  about 10 % load imbalance, while the tables are exactly balanced.
"""


def namespaced(a: np.ndarray, b: np.ndarray, pad: np.ndarray | None = None) -> Trace:
    sizes = None if pad is None else pad.astype(np.float64) + HEADER_BYTES
    return Trace(fields=(a, b + B_NAMESPACE), sizes=sizes)


def generated(workload: PairsWorkload | GeoTagsWorkload) -> Trace:
    raw = Trace.from_batches(workload.batches(1 << 18))
    return namespaced(raw.fields[0], raw.fields[1], raw.sizes)


def window_statistics(window: Trace, max_edges: int | None = None) -> PairStatistics:
    """Exact pair counts of a window, optionally only its ``max_edges`` top pairs.

    With every pair kept, the key frequencies are given too (the paper's
    statistics count keys as well as pairs); with a budget, only what the
    kept edges say is known, as in Fig. 12.
    """
    a, b = window.fields
    a_keys, b_keys, counts = aggregate_pairs(a, b, np.ones(a.shape[0]))
    if max_edges is not None and counts.size > max_edges:
        keep = np.argsort(-counts, kind="stable")[:max_edges]
        return PairStatistics(a_keys[keep], b_keys[keep], counts[keep])
    freq_a = KeyWeights(*np.unique(a, return_counts=True))
    freq_b = KeyWeights(*np.unique(b, return_counts=True))
    return PairStatistics(a_keys, b_keys, counts, freq_a=freq_a, freq_b=freq_b)


def plan_from(statistics: PairStatistics, n: int) -> LocalityPlan:
    return build_plan(statistics, n, alpha=ALPHA, heavy_key_policy="pin")


def two_stage(
    trace: Trace, router_a: Partitioner, router_b: Partitioner, cluster: ClusterConfig
) -> SimulationMetrics:
    return summarize(simulate(trace, [Stage(router_a, 0), Stage(router_b, 1)], cluster))


def tabled(plan: LocalityPlan) -> tuple[Partitioner, Partitioner]:
    n = plan.n_instances
    return TableRouter(plan.table_a, n, "a"), TableRouter(plan.table_b, n, "b")


def hashed(n: int) -> tuple[Partitioner, Partitioner]:
    return HashPartitioner(n), HashPartitioner(n)


def worst_imbalance(m: SimulationMetrics) -> float:
    return max(stage.imbalance for stage in m.stages)


# --- Fig. 11 -----------------------------------------------------------------


def online_offline(
    windows: list[Trace], n: int, log: Callable[[str], None]
) -> tuple[str, dict[str, tuple[float, float]]]:
    """Each window scored with tables trained on earlier windows only."""
    cluster = ClusterConfig(n_servers=n)
    statistics = [window_statistics(w) for w in windows]
    offline = plan_from(statistics[0], n)
    reset = PairHistory(HistoryPolicy(mode="reset"))
    decay = PairHistory(HistoryPolicy(mode="decay", decay=0.5))
    columns = ("hash", "offline", "online, reset", "online, decay")
    sums = {c: [0.0, 0.0] for c in columns}
    worst = dict.fromkeys(columns, 0.0)
    rows: list[list[Cell]] = []
    predicted = []
    for w in range(1, len(windows)):
        reset.add(statistics[w - 1])
        decay.add(statistics[w - 1])
        online_reset = plan_from(reset.statistics, n)
        online_decay = plan_from(decay.statistics, n)
        predicted.append(online_reset.predicted_locality)
        routers = {
            "hash": hashed(n),
            "offline": tabled(offline),
            "online, reset": tabled(online_reset),
            "online, decay": tabled(online_decay),
        }
        row: list[Cell] = [w]
        for column in columns:
            m = two_stage(windows[w], *routers[column], cluster)
            imbalance = worst_imbalance(m)
            row += [m.locality, imbalance]
            sums[column][0] += m.locality
            sums[column][1] += imbalance
            worst[column] = max(worst[column], imbalance)
        rows.append(row)
        log(
            f"  window {w}: "
            + ", ".join(f"{c} {row[1 + 2 * i]:.3f}" for i, c in enumerate(columns))
        )
    count = len(windows) - 1
    means = {c: (s[0] / count, s[1] / count) for c, s in sums.items()}
    mean_row: list[Cell] = ["mean"]
    worst_row: list[Cell] = ["worst imbalance"]
    for column in columns:
        mean_row += list(means[column])
        worst_row += [None, worst[column]]
    rows += [mean_row, worst_row]
    headers = ["window"]
    for column in columns:
        headers += [f"{column}: locality", f"{column}: imbalance"]
    table = markdown_table(headers, rows)
    means["predicted (training window)"] = (float(np.mean(predicted)), float("nan"))
    return table, means


# --- Fig. 12 -----------------------------------------------------------------


def edges_sweep(windows: list[Trace], parallelisms: list[int], budgets: list[int | None]) -> str:
    """Next-window locality with only the top-E pairs known (online, reset)."""
    total_edges = float(np.mean([window_statistics(w).counts.size for w in windows[:-1]]))
    rows: list[list[Cell]] = []
    for budget in budgets:
        row: list[Cell] = [
            "all" if budget is None else budget,
            1.0 if budget is None else min(1.0, budget / total_edges),
        ]
        for n in parallelisms:
            cluster = ClusterConfig(n_servers=n)
            localities = []
            for w in range(1, len(windows)):
                plan = plan_from(window_statistics(windows[w - 1], budget), n)
                localities.append(two_stage(windows[w], *tabled(plan), cluster).locality)
            row.append(float(np.mean(localities)))
        rows.append(row)
    hash_row: list[Cell] = ["hash", 0.0]
    for n in parallelisms:
        cluster = ClusterConfig(n_servers=n)
        hash_row.append(
            float(np.mean([two_stage(w, *hashed(n), cluster).locality for w in windows[1:]]))
        )
    rows.append(hash_row)
    return markdown_table(
        ["edges kept", "share of edges", *(f"locality, n = {n}" for n in parallelisms)], rows
    )


# --- Fig. 8 ------------------------------------------------------------------


KEYS_PER_INSTANCE = 100
"""Fig. 8 keys per instance. The paper draws both fields from 1..n; with so
few keys hash routing is one random table of n entries, which by luck can be
the locality-aware table itself (for n = 2, one time in two). With many keys
hash routing is what the paper describes: flat in L, locality about 1/n."""


def pairs_routers(policy: str, n: int, trace: Trace) -> tuple[Partitioner, Partitioner]:
    """The fields groupings of 000 §4.2 for keys 1..n_keys."""
    keys = range(1, n * KEYS_PER_INSTANCE + 1)
    if policy == "hash":
        return hashed(n)
    if policy == "locality-aware":
        table_a = {i: (i - 1) % n for i in keys}
        table_b = {i + B_NAMESPACE: (i - 1) % n for i in keys}
    elif policy == "worst-case":
        table_a = {i: (i - 1) % n for i in keys}
        table_b = {i + B_NAMESPACE: i % n for i in keys}
    elif policy == "trained":
        return tabled(plan_from(window_statistics(trace), n))
    else:
        raise ValueError(f"unknown policy {policy!r}")
    return TableRouter(table_a, n, "a"), TableRouter(table_b, n, "b")


def locality_sweep(
    parallelisms: list[int], localities: list[float], n_tuples: int, pad: int
) -> str:
    """Throughput versus the workload's locality L (Fig. 8)."""
    policies = ("hash", "worst-case", "locality-aware", "trained")
    rows: list[list[Cell]] = []
    for n in parallelisms:
        cluster = ClusterConfig(
            n_servers=n,
            service_time=FIG8_SERVICE_TIME,
            network_delay=NETWORK_DELAY,
            link_bandwidth=LINK_BANDWIDTH,
        )
        for share in localities:
            workload = PairsWorkload(
                n_events=n_tuples,
                n_keys=n * KEYS_PER_INSTANCE,
                locality=share,
                pad_min=pad,
                pad_max=pad,
                seed=3,
            )
            trace = generated(workload)
            row: list[Cell] = [n, share]
            for policy in policies:
                m = two_stage(trace, *pairs_routers(policy, n, trace), cluster)
                row += [m.throughput / 1e3, m.locality]
            rows.append(row)
    headers = ["n", "L"]
    for policy in policies:
        headers += [f"{policy}: k tuples/s", f"{policy}: locality"]
    return markdown_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description="Reproduce paper 000 §4 in the simulator.")
    parser.add_argument("--quick", action="store_true", help="small run")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--out", type=Path, default=None, help="write the report here")
    args = parser.parse_args()

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    started = time.perf_counter()
    window_size = 50_000 if args.quick else 100_000
    n_windows = 6 if args.quick else 12
    geo = GeoTagsWorkload(
        n_events=window_size * n_windows,
        n_regions=N_REGIONS,
        drift_every=window_size,
        flash_every=window_size * 5 // 2,
        flash_duration=window_size // 5,
        seed=args.seed,
    )
    windows = list(generated(geo).windows(n_windows))
    log("fig 11")
    fig11, means = online_offline(windows, 6, log)
    log("fig 12")
    budgets: list[int | None] = [10, 30, 100, 300, 1_000, 3_000, 10_000, None]
    fig12 = edges_sweep(windows[: 4 if args.quick else 6], [2, 4, 6], budgets)
    log("fig 8")
    fig8 = locality_sweep(
        [2, 4, 6],
        [0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0],
        20_000 if args.quick else 200_000,
        12_000,
    )
    elapsed = time.perf_counter() - started

    online_locality, online_imbalance = means["online, decay"]
    reset_locality, reset_imbalance = means["online, reset"]
    command = "python bench/reproduce_locality.py" + (" --quick" if args.quick else "")
    report = "\n".join(
        [
            "# Reproduction of paper 000 (locality-aware routing), §4, in the simulator",
            "",
            f"Command: `{command}` ({elapsed:.0f} s on one core).",
            "",
            "Locality is the share of stage A → stage B hops that stay on one server; "
            "imbalance is max/mean tuples per instance, the worse of the two stages. Stage "
            "B's keys are namespaced so that hash routing does not co-locate equal ids of "
            "the two fields by construction. Tables are built with α = 1.03 (000 §4.3) and "
            "heavy keys pinned (the simulator has no hot-key splitter in this chain).",
            "",
            "## Fig. 11: online vs offline vs hash, n = 6, drifting region → hashtag stream",
            "",
            f"`GeoTagsWorkload` (seed {args.seed}, {N_REGIONS} regions), {n_windows} windows "
            f"of {window_size:,} events; a share 0.2 of every region's favourite tags is "
            "replaced at each window boundary and flash events come and go. Offline "
            "trains once on window 0; online retrains before every window on the "
            "statistics of the windows before it, either the last one only (reset, "
            "000 §3.2) or all of them with "
            "weight 0.5 per window of age (decay). Every table is scored on the next "
            "window, which it has not seen.",
            "",
            "Paper 000 Fig. 11 (Twitter, week windows): hash 16.6 % locality and "
            "imbalance about 1.12; online about 50 % (49 % right after training); offline "
            "starts at 49 % and falls to about 40 %, with imbalance drifting to about "
            "1.4; METIS predicts 75 % on the training window.",
            "",
            f"Measured means: online (decay) {online_locality:.1%} locality, imbalance "
            f"{online_imbalance:.2f}; online (reset) {reset_locality:.1%}, "
            f"{reset_imbalance:.2f}; offline {means['offline'][0]:.1%}, "
            f"{means['offline'][1]:.2f}; hash {means['hash'][0]:.1%}, "
            f"{means['hash'][1]:.2f}; predicted on the training window "
            f"{means['predicted (training window)'][0]:.1%}. Target (online ≥ 45 % with "
            "imbalance ≤ 1.2): "
            + (
                "met."
                if max(online_locality, reset_locality) >= 0.45
                and min(online_imbalance, reset_imbalance) <= 1.2
                else "not met."
            ),
            "",
            fig11,
            "",
            "## Fig. 12: locality vs number of edges kept",
            "",
            "Online (reset) tables trained on the top-E pairs of one window, scored on the "
            "next, averaged over windows. Paper 000 Fig. 12: locality grows with E on a "
            "log scale; 0.1 % of the edges already doubles locality at n = 6; 10^6 edges "
            "suffice on the Twitter data.",
            "",
            fig12,
            "",
            "## Fig. 8: throughput vs locality L, 12 kB tuples",
            "",
            f"`PairsWorkload` with keys 1..{KEYS_PER_INSTANCE}n and a share L of tuples "
            "(i, i). Servers have "
            "a 10 Gb/s outgoing link on which remote tuples queue; a tuple takes "
            f"{FIG8_SERVICE_TIME * 1e6:.0f} µs to process, about a tenth of its 9.8 µs "
            "on the wire. Throughput is tuples over makespan with the whole stream "
            "available at once. `locality-aware` is the paper's table (i → instance i mod n), "
            "`worst-case` sends every (i, i) tuple to another server, `trained` is "
            "keyplane's `build_plan` on the same data. Paper 000 Fig. 8: hash is flat, "
            "locality-aware grows with L and plateaus above 90 %.",
            "",
            fig8,
        ]
    )
    if not args.quick and args.seed == DEFAULT_SEED:
        report += "\n\n" + FINDINGS
    report += "\n"
    print(report)
    if args.out is not None:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
