"""The tables bench/aggregate.py prints from its ranks' rows (pure: rows in, lines out).

`summarize`: every pipeline against the plaintext floor and ours against the usual one; `summarize_defence`:
the sum checks' cost, checked / unchecked per alternating pair; `summarize_t_of_n`: t-out-of-N against
N-out-of-N. A row is one rank's (`rank`, then per pipeline its repeats' measures).
"""

from __future__ import annotations

from typing import Any

from flodld_fhelium.transport import KEY_HOLDER

DEFENCE_ROADS = (
    ("fused (process-group road)", "threshold"),
    ("Program (relay-road form)", "threshold_program"),
)
"""The threshold pipelines `--defence-ratio` runs: the table's name of each, and its key in a row."""


def summarize_t_of_n(world: int, values: int, rows: list[dict[str, Any]]) -> None:
    pairs = len(rows[0]["t_of_n"])
    t = rows[0]["t"]
    errors = {key: max(run["error"] for row in rows for run in row[key]) for key in ("n_of_n", "t_of_n")}
    print(
        f"\n{world} ranks, {values} values per rank: t-out-of-N (t = {t}) / N-out-of-N (fused), no dropout; "
        f"{pairs} alternating pairs, median [min-max]; max error of the mean N-of-N {errors['n_of_n']:.2e}, "
        f"t-of-N {errors['t_of_n']:.2e}"
    )
    for label, field, combine in (
        ("aggregate wall", "aggregate_seconds", max),
        ("aggregate CPU, busiest rank", "aggregate_cpu_seconds", max),
        ("whole wall (keys + dealing + aggregate)", "seconds", max),
    ):
        ratios = [
            combine(row["t_of_n"][index][field] for row in rows)
            / combine(row["n_of_n"][index][field] for row in rows)
            for index in range(pairs)
        ]
        n_of_n = sorted(combine(row["n_of_n"][index][field] for row in rows) for index in range(pairs))
        print(f"  {label:<42}{_spread(ratios)}   (N-of-N median {n_of_n[len(n_of_n) // 2]:.3f} s)")


def _spread(ratios: list[float]) -> str:
    ordered = sorted(ratios)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return f"{median:.3f} [{ordered[0]:.3f}-{ordered[-1]:.3f}]"


def summarize_defence(world: int, values: int, rows: list[dict[str, Any]]) -> None:
    """Checked / unchecked per pair: median [min-max] over the pairs, per road and measure."""
    print(f"\n{world} ranks, {values} values per rank: the malicious-fold defence, checked / unchecked")
    print(
        "  per alternating pair; median [min-max] over the pairs. 'aggregate' spans "
        "ThresholdSession.aggregate alone (encrypt, sum, check, decrypt, decode); 'whole' adds "
        "collective key generation (the threshold rows' span). CPU: process CPU seconds (the busiest "
        "rank's; summed over the ranks)"
    )
    measures = (
        ("aggregate CPU, busiest rank", "aggregate_cpu_seconds", max),
        ("aggregate CPU, summed", "aggregate_cpu_seconds", sum),
        ("aggregate wall", "aggregate_seconds", max),
        ("whole CPU, busiest rank", "cpu_seconds", max),
        ("whole wall", "seconds", max),
    )
    for name, key in DEFENCE_ROADS:
        pairs = len(rows[0][key][True])
        errors = max(run["error"] for row in rows for checked in (True, False) for run in row[key][checked])
        unchecked_cpu = sorted(
            max(row[key][False][index]["aggregate_cpu_seconds"] for row in rows) for index in range(pairs)
        )
        print(
            f"  {name}: {pairs} pairs, max error {errors:.2e}, unchecked aggregate CPU (busiest rank) "
            f"median {unchecked_cpu[len(unchecked_cpu) // 2]:.3f} s"
        )
        for label, field, combine in measures:
            ratios = [
                combine(row[key][True][index][field] for row in rows)
                / combine(row[key][False][index][field] for row in rows)
                for index in range(pairs)
            ]
            print(f"    {label:<30}{_spread(ratios)}")


def best(rows: list[dict[str, Any]], key: str) -> tuple[float, int]:
    """The fastest repeat (slowest rank of it) and its index."""
    per_repeat = [max(row[key][index]["seconds"] for row in rows) for index in range(len(rows[0][key]))]
    fastest = min(range(len(per_repeat)), key=per_repeat.__getitem__)
    return per_repeat[fastest], fastest


def summarize(world: int, values: int, rows: list[dict[str, Any]], usual_name: str) -> None:
    floor_s = max(row["floor"] for row in rows)
    ours_s, ours_at = best(rows, "ours")
    usual_s, usual_at = best(rows, "usual")
    threshold_s, threshold_at = best(rows, "threshold")
    program_s, program_at = best(rows, "threshold_program")
    program_error = max(row["threshold_program"][program_at]["error"] for row in rows)
    ours_error = rows[KEY_HOLDER]["ours"][ours_at]["error"]
    threshold_error = max(row["threshold"][threshold_at]["error"] for row in rows)
    usual_error = rows[KEY_HOLDER]["usual"][usual_at]["error"]
    encrypt_s = max(row["ours"][ours_at]["encrypt_seconds"] for row in rows)
    mib = 2**20
    print(f"\n{world} ranks, {values} values per rank")
    print(
        f"  {'pipeline':<34}{'time':>9}{'vs floor':>10}{'max error':>11}"
        f"{'MiB sent/rank (max)':>21}{'rounds':>8}"
    )
    print(
        f"  {'floor: gloo all_reduce float32':<34}{floor_s:>8.3f}s{1.0:>9.1f}x{'exact':>11}"
        f"{values * 4 * 2 * (world - 1) / world / mib:>20.1f}~{2 * (world - 1):>7}~"
    )
    for name, key, seconds, error in (
        ("ours: compiled all_reduce", "ours", ours_s, ours_error),
        ("ours, threshold, Program", "threshold_program", program_s, program_error),
        ("ours, threshold, fused", "threshold", threshold_s, threshold_error),
        (usual_name, "usual", usual_s, usual_error),
    ):
        sent = max(row[key][0]["bytes_sent"] for row in rows) / mib
        rounds = max(row[key][0]["rounds"] for row in rows)
        print(f"  {name:<34}{seconds:>8.3f}s{seconds / floor_s:>9.1f}x{error:>11.2e}{sent:>21.1f}{rounds:>8}")
    verdict = "meets" if ours_s <= usual_s / 2 and ours_error <= usual_error else "misses"
    print(
        f"  ours / usual time: {ours_s / usual_s:.2f}  (goal <= 0.50 with equal or better error: {verdict}); "
        f"encryption is {encrypt_s / ours_s:.0%} of ours"
    )
    threshold_encrypt = max(row["threshold"][threshold_at]["encrypt_seconds"] for row in rows)
    met = threshold_s <= 1.3 * ours_s and threshold_s <= usual_s / 2 and threshold_error <= 1e-6
    print(
        f"  threshold (fused) / single-key time: {threshold_s / ours_s:.2f} (goal <= 1.3), threshold / usual:"
        " "
        f"{threshold_s / usual_s:.2f} (goal <= 0.50), max error {threshold_error:.2e} on any rank (goal <= "
        f"1e-6): {'meets' if met else 'misses'}; encryption is {threshold_encrypt / threshold_s:.0%} of "
        "threshold; threshold with the compiled Program (the flagship's relay-road form) / single-key: "
        f"{program_s / ours_s:.2f}"
    )
    cpu = {
        key: max(row[key][at]["cpu_seconds"] for row in rows)
        for key, at in (
            ("ours", ours_at),
            ("threshold", threshold_at),
            ("threshold_program", program_at),
            ("usual", usual_at),
        )
    }
    print(
        f"  CPU seconds of the busiest rank (same repeats; less sensitive to other load on the machine): "
        f"single-key {cpu['ours']:.3f}, threshold fused {cpu['threshold']:.3f} "
        f"({cpu['threshold'] / cpu['ours']:.2f}x), threshold Program {cpu['threshold_program']:.3f} "
        f"({cpu['threshold_program'] / cpu['ours']:.2f}x), "
        f"usual {cpu['usual']:.3f} (threshold / usual {cpu['threshold'] / cpu['usual']:.2f})"
    )
    total = {
        key: sum(row[key][at]["cpu_seconds"] for row in rows)
        for key, at in (("ours", ours_at), ("threshold", threshold_at), ("threshold_program", program_at))
    }
    print(
        f"  CPU seconds summed over the ranks (what a machine shared by the ranks pays): single-key "
        f"{total['ours']:.3f}, threshold fused {total['threshold']:.3f} "
        f"({total['threshold'] / total['ours']:.2f}x), threshold Program {total['threshold_program']:.3f} "
        f"({total['threshold_program'] / total['ours']:.2f}x)"
    )
    print(
        "  (~ = gloo ring all_reduce estimate; ours: the 'sum' schedule's one gloo all_reduce counted as a "
        "ring, or under 'tree' the tree messages plus the root sending one broadcast copy per peer; MiB "
        "sent is the busiest rank's)"
    )
