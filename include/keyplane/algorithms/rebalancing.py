"""Heavy keys and the greedy repair of each stage's balance (paper 000 §3.1, 001 §4.2).

Steps 2 and 5 of :mod:`keyplane.algorithms.locality`'s planner.

*Heavy* keys, whose weight alone exceeds α times the stage's mean instance
load (heavy keys included, so that the test does not cascade), are taken out
first: no partition can meet α with one. They go to the hot-key splitter
(paper 001 §4.2), or are pinned to the least loaded instance on request, as
far as the table budget has room.

After METIS, one balance constraint does not bound each stage's balance, and
METIS may overshoot its tolerance. A greedy pass moves the cheapest keys
(locality lost per unit of load moved) out of overloaded instances; when none
fits, it moves or splits the key that saves most batch time under the
:class:`~keyplane.algorithms.costmodel.CostModel`, and stops when none saves
any (or half a stage's keys are split), since splitting just to meet α on the
training window buys a balance the next window does not keep
(``split_rule="alpha"`` splits until α holds, for comparisons).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from keyplane.algorithms.key_graph import _KeyGraph
from keyplane.algorithms.locality_plan import _imbalance, _stage_loads
from keyplane.algorithms.pair_statistics import BoolArray, FloatArray, _weighted_counts
from keyplane.algorithms.plan_settings import HeavyRule, PlanSettings

# Loads are sums of floats: a move or a split aims a hair below the bound, so
# that the recomputed loads land within α and the key is not moved back.
_BOUND_MARGIN = 1.0 - 1e-12


def _heavy_mask(weights: FloatArray, alpha: float, n: int, rule: HeavyRule = "mean") -> BoolArray:
    """Keys heavier than α × the stage's mean instance load (module docstring).

    ``cascade`` re-tests each next key against the mean of the keys that
    remain, which on a short key list marks one key after another.
    """
    if rule == "mean":
        return np.asarray(weights > alpha * float(weights.sum()) / n, dtype=np.bool_)
    heavy = np.zeros(weights.size, dtype=np.bool_)
    remaining = float(weights.sum())
    for index in np.argsort(-weights, kind="stable"):
        if remaining <= 0.0 or weights[index] <= alpha * remaining / n:
            break
        heavy[index] = True
        remaining -= float(weights[index])
    return heavy


def _split_cap(weights: FloatArray) -> int:
    """Most keys of a stage that may be split: half its keys with weight.

    A split key keeps state on several instances (paper 001 §6 counts these
    replicas as memory); splitting most keys of a short key list turns
    fields grouping into shuffle grouping, the memory cost the batch-time
    model does not see.
    """
    return int((weights > 0).sum()) // 2


class _Rebalancer:
    """Greedy repair of per-stage balance after METIS (module docstring).

    ``connection[v, i]`` is the pair weight between key v and the keys placed
    on instance i, so moving v from p to q loses ``connection[v, p] -
    connection[v, q]`` of local pair weight; it is kept up to date per move.
    """

    def __init__(
        self,
        graph: _KeyGraph,
        placement: npt.NDArray[np.int64],
        tabled: BoolArray,
        heavy: BoolArray,
        settings: PlanSettings,
    ) -> None:
        self.graph = graph
        self.placement = placement
        self.tabled = tabled
        self.heavy = heavy
        self.settings = settings
        n = settings.n_instances
        placed = np.flatnonzero(placement >= 0)
        indicator = sp.csr_matrix(
            (np.ones(placed.size), (placed, placement[placed])), shape=(placement.size, n)
        )
        self.connection = np.asarray((graph.adjacency @ indicator).todense())
        self.pair_weight = np.asarray(graph.adjacency.sum(axis=1)).ravel()
        self.edge_total = float(graph.edge_weight.sum())

    def _shift(self, vertex: int, source: int, target: int | None) -> None:
        neighbours, weights = self.graph.neighbours(vertex)
        self.connection[neighbours, source] -= weights
        if target is not None:
            self.connection[neighbours, target] += weights

    def balance_stage(self, stage_index: int) -> None:
        """Move (or, when it pays, split) keys until the stage is within α (000 §3.1).

        The loads are recomputed from the placement on each round, as
        :func:`~keyplane.algorithms.locality._finish_plan` sums them, and the stop test is the very
        ``max / mean ≤ α`` it reports, so with ``split_rule="alpha"`` the
        bound holds exactly, also at α = 1 for a perfect split. With
        ``"pays"``, once no move fits within α, the pass takes the action
        that saves most batch time under the cost model (a move that lowers
        the straggler without fitting, or a split) and stops when none saves
        any; splits stop at :func:`_split_cap`.
        """
        n = self.settings.n_instances
        alpha = self.settings.alpha
        stage = self.graph.stage_slice(stage_index)
        first = stage.start
        place = self.placement[stage]
        weight = self.graph.weight[stage]
        cap = _split_cap(weight)
        for _ in range(20 * (place.size + n)):
            loads = _stage_loads(place, weight, n)
            if _imbalance(loads) <= alpha:
                return
            total = float(loads.sum())
            bound = alpha * total / n * _BOUND_MARGIN
            overloaded = int(np.argmax(loads))
            excess = loads[overloaded] - bound
            room: FloatArray = bound - loads
            room[overloaded] = -np.inf
            on_part = first + np.flatnonzero((place == overloaded) & (weight > 0))
            movable = on_part[self.tabled[on_part]]
            move = self._cheapest_move(movable, overloaded, room, excess)
            if move is None and self.settings.split_rule == "pays":
                split_room = int((place < 0).sum()) < cap
                move = self._paying_action(on_part, loads, overloaded, stage_index, split_room)
                if move is None:
                    return
            if move is None or move[1] < 0:
                vertex = (
                    self._key_to_split(on_part, float(loads[overloaded]), total)
                    if move is None
                    else move[0]
                )
                self.heavy[vertex] = True
                self.tabled[vertex] = False
                self.placement[vertex] = -1
                self._shift(vertex, overloaded, None)
                continue
            vertex, target = move
            self.placement[vertex] = target
            self._shift(vertex, overloaded, target)

    def _key_to_split(self, on_part: npt.NDArray[np.int64], load: float, total: float) -> int:
        """The lightest key whose split brings its instance within the bound,
        else the heaviest key of the instance.

        A split key's weight is spread evenly
        (:mod:`keyplane.algorithms.locality_plan`), so it adds to every other
        instance; the lightest key that suffices adds least, so a
        split on one instance seldom overloads the next.
        """
        n = self.settings.n_instances
        alpha = self.settings.alpha
        weight = self.graph.weight[on_part]
        clears = load - weight + weight / n <= alpha * total / n * _BOUND_MARGIN
        if clears.any():
            candidates = np.flatnonzero(clears)
            return int(on_part[candidates[np.argmin(weight[candidates])]])
        return int(on_part[np.argmax(weight)])

    def _paying_action(
        self,
        on_part: npt.NDArray[np.int64],
        loads: FloatArray,
        overloaded: int,
        stage_index: int,
        split_room: bool,
    ) -> tuple[int, int] | None:
        """The move ``(key, target)`` or split ``(key, -1)`` of a key of the overloaded
        instance that saves most batch time under the cost model, if any saves some.

        Either lowers the straggler by what the stage's new maximum is below
        the old (the mean stays) and costs locality: a move loses the key's
        pairs local on its instance and gains those on the target; a split
        keeps them local only 1/n of the time.
        """
        if on_part.size == 0:
            return None
        n = self.settings.n_instances
        cost = self.settings.cost
        service = cost.stage_service(stage_index)
        edge_total = max(self.edge_total, 1e-300)
        weight = self.graph.weight[on_part]
        mean = float(loads.sum()) / n
        peak = float(loads.max())
        others = np.delete(loads, overloaded)
        rest = float(others.max()) if others.size else 0.0
        connection = self.connection[on_part]
        local_now = connection[:, overloaded]

        # Moves of table keys: the new max is over the source, the target and the rest.
        source_after = loads[overloaded] - weight
        target_after = loads[None, :] + weight[:, None]
        second = np.array([np.delete(others, i).max(initial=0.0) for i in range(n - 1)])
        rest_without = np.insert(second, overloaded, rest)
        move_max = np.maximum(np.maximum(source_after[:, None], target_after), rest_without)
        move_gain = service * (peak - move_max) / mean - cost.remote * (
            (local_now[:, None] - connection) / edge_total
        )
        move_gain[:, overloaded] = -np.inf
        move_gain[~self.tabled[on_part], :] = -np.inf

        best_gain, best = -np.inf, None
        if move_gain.size:
            row, column = np.unravel_index(int(np.argmax(move_gain)), move_gain.shape)
            best_gain, best = float(move_gain[row, column]), (int(on_part[row]), int(column))
        if split_room:
            after = np.broadcast_to(loads, (on_part.size, n)) + (weight / n)[:, None]
            after[:, overloaded] -= weight
            lost = (local_now - self.pair_weight[on_part] / n) / edge_total
            split_gain = service * (peak - after.max(axis=1)) / mean - cost.remote * lost
            pick = int(np.argmax(split_gain))
            if split_gain[pick] > best_gain:
                best_gain, best = float(split_gain[pick]), (int(on_part[pick]), -1)
        if best is None or best_gain <= 1e-12:
            return None
        return best

    def _cheapest_move(
        self,
        movable: npt.NDArray[np.int64],
        source: int,
        room: FloatArray,
        excess: float,
    ) -> tuple[int, int] | None:
        """The move losing least locality: one key clearing the excess, or the
        best loss-per-load key when a run of such keys is estimated cheaper."""
        if movable.size == 0:
            return None
        weight = self.graph.weight[movable]
        connection = self.connection[movable]
        loss = connection[:, [source]] - connection
        fits = weight[:, None] <= room[None, :]
        if not fits.any():
            return None
        rate = np.where(fits, loss / weight[:, None], np.inf)
        best_rate = np.unravel_index(int(np.argmin(rate)), rate.shape)
        clears = fits & (weight[:, None] >= excess)
        if clears.any():
            single = np.where(clears, loss, np.inf)
            best_single = np.unravel_index(int(np.argmin(single)), single.shape)
            if single[best_single] <= rate[best_rate] * excess:
                return int(movable[best_single[0]]), int(best_single[1])
        return int(movable[best_rate[0]]), int(best_rate[1])


def _pin_heavy(
    graph: _KeyGraph,
    placement: npt.NDArray[np.int64],
    tabled: BoolArray,
    heavy: BoolArray,
    settings: PlanSettings,
) -> None:
    """Put heavy keys, heaviest first, on their stage's least loaded instance.

    A pinned key takes a table entry, so at most the entries the table budget
    has left are pinned; the rest stay split keys. That covers the keys the
    rebalancer handed to the splitter too: they were not counted when the
    budget was first reserved for the heavy keys.
    """
    n = settings.n_instances
    for index in range(graph.n_stages):
        stage = graph.stage(index)
        placed = stage[placement[stage] >= 0]
        loads = _weighted_counts(placement[placed], graph.weight[placed], n)
        stage_heavy = stage[heavy[stage]]
        order = stage_heavy[np.argsort(-graph.weight[stage_heavy], kind="stable")]
        if settings.max_table_entries is not None:
            room = max(0, settings.max_table_entries - int(tabled[stage].sum()))
            order = order[:room]
        for vertex in order:
            target = int(np.argmin(loads))
            placement[vertex] = target
            tabled[vertex] = True
            loads[target] += graph.weight[vertex]
