"""The pipeline stage split as the plain dynamic programme over every cut (``parts * n**2``):
what ``stage_split.balanced_split`` must answer, kept to check its pruned version against."""

from __future__ import annotations


def reference_split(costs: list[int], parts: int) -> list[int]:
    """Least largest group, then least sum of squares within it, ties to the earliest cut."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def solve(score, combine, cap=None):
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(parts + 1)]
        cut = [[0] * (n + 1) for _ in range(parts + 1)]
        best[0][0] = 0
        for k in range(1, parts + 1):
            for i in range(k, n - (parts - k) + 1):
                for j in range(k - 1, i):
                    group = prefix[i] - prefix[j]
                    if cap is not None and group > cap:
                        continue
                    value = combine(best[k - 1][j], score(group))
                    if value < best[k][i]:
                        best[k][i], cut[k][i] = value, j
        return best[parts][n], cut

    largest, _ = solve(lambda g: g, max)
    _, cut = solve(lambda g: g * g, lambda a, b: a + b, cap=largest)
    sizes, i = [], n
    for k in range(parts, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]
