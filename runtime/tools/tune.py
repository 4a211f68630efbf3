"""`runtime tune`: choose a static draft tree (and the DDD threshold) by measurement on a device.

Two measurements, then a choice:

1. Positional acceptance (device-free: the tokens do not depend on the device or on graph
   mode). The chosen method (lantern++ at its lambda, or sd) decodes a calibration workload
   over a *calibration tree*: a rank-0 spine `max_depth` deep with ranks 0..R-1 under every
   spine node. Counting how often each node was accepted gives, for every (depth d, rank r),

       rate[d][r] = P(rank-r child at depth d accepted | its parent accepted, ranks < r rejected)

   (shrunk towards rank r's rate over all depths where a depth was reached rarely).
2. Step costs on this device, in its mode (graph or eager) and at the batch size: the verify
   and accept steps of probe trees of n nodes (complete ternary trees), the draft step of
   chains of depth 1 and `max_depth` (one drafter forward per level) and the AR step. All are
   captured first and then timed in interleaved rounds (medians); verify and accept costs are
   fitted non-decreasing in n (a noisy probe must not make a bigger tree look cheaper).

The model. A node at path (r_1..r_d) is accepted with probability prod_j w[j][r_j], where
w[d][r] = rate[d][r] * prod_{s<r} (1 - rate[d][s]) (Sequoia's positional model: acceptance
depends on depth and rank only). A tree T with n nodes and depth D yields 1 + E(T) tokens
per iteration (E = sum of its nodes' probabilities, plus the bonus) and costs

    cost(n, D) = draft(D) + verify(n) + accept(n),  draft(D) = draft(1) + (D - 1) * level

(verify and accept interpolated between probes; a drafter level's cost is taken as
independent of its width: the width-1 and widest probes are recorded to show the error).
The choice maximises (1 + E(T)) / cost(n, D) over trees of at most `max_nodes` nodes and
`max_depth` levels whose nodes have at most R children. `best_trees` finds, for every (n, D),
the tree of largest E by a dynamic program over (depth, nodes left) with a knapsack over the
ranks of a node's children (children take ranks 0, 1, ... in order); since cost grows with D,
the best ratio over (n, D) is the best ratio over trees.

DDD: the threshold is chosen by decoding the calibration workload with `ddd` at each
candidate threshold (one capture; the threshold is a device tensor) and keeping the fastest.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from runtime.core.methods import MethodSpec
from runtime.core.tree import StaticTree, validate_paths
from runtime.utils.errors import UserError
from runtime.config.method_options import Drafting

if TYPE_CHECKING:
    from backends import Backend


Path_ = tuple[int, ...]


# -- the tree search (pure) ----------------------------------------------------------------------
def node_weights(rate: Sequence[Sequence[float]]) -> list[list[float]]:
    """w[d][r] = rate[d][r] * prod_{s<r} (1 - rate[d][s]): the probability that the rank-r child
    (of an accepted parent at depth d) is the one accepted."""
    out = []
    for row in rate:
        left, w = 1.0, []
        for a in row:
            w.append(left * a)
            left *= 1.0 - a
        out.append(w)
    return out


def tree_value(paths: Sequence[Path_], weights: Sequence[Sequence[float]]) -> float:
    """E(T): expected accepted drafts per iteration, sum over nodes of prod_j w[j][r_j]."""
    return sum(math.prod(weights[j][r] for j, r in enumerate(p)) for p in paths)


def best_trees(weights: Sequence[Sequence[float]], max_nodes: int, max_depth: int
               ) -> dict[int, tuple[float, tuple[Path_, ...]]]:
    """For every n in 1..max_nodes: (E, paths) of the rank-closed tree of exactly n nodes and
    depth <= max_depth (weights has at least max_depth rows) with the largest E; n absent when
    no such tree exists. Children of a node at depth d take ranks 0..R-1 (R = len(weights[d]))."""
    if max_depth < 1 or max_nodes < 1:
        return {}
    ranks = len(weights[0])
    neg = float("-inf")
    # f[d][n]: best value below a node at depth d using exactly n descendants (depth <= max_depth)
    # g[d][r][n]: best value of children ranks r.. of such a node using exactly n nodes
    f = [[neg] * (max_nodes + 1) for _ in range(max_depth + 1)]
    choice: dict[tuple[int, int, int], int] = {}  # (d, r, n) -> nodes given to rank r (0 = stop)
    g = [[[neg] * (max_nodes + 1) for _ in range(ranks + 1)] for _ in range(max_depth + 1)]
    for d in range(max_depth, -1, -1):
        f[d][0] = 0.0
        for r in range(ranks, -1, -1):
            g[d][r][0] = 0.0
            choice[(d, r, 0)] = 0
            if r == ranks or d == max_depth:
                continue
            w = weights[d][r]
            for n in range(1, max_nodes + 1):
                best, best_m = neg, 0
                for m in range(1, n + 1):  # rank r's subtree: itself and m - 1 below
                    below, rest = f[d + 1][m - 1], g[d][r + 1][n - m]
                    if below == neg or rest == neg:
                        continue
                    value = w * (1.0 + below) + rest
                    if value > best:
                        best, best_m = value, m
                g[d][r][n] = best
                choice[(d, r, n)] = best_m
        for n in range(1, max_nodes + 1):
            f[d][n] = g[d][0][n]

    def build(d: int, prefix: Path_, n: int) -> list[Path_]:
        paths, r = [], 0
        while n > 0:
            m = choice[(d, r, n)]
            node = prefix + (r,)
            paths.append(node)
            paths += build(d + 1, node, m - 1)
            n -= m
            r += 1
        return paths

    return {n: (f[0][n], tuple(sorted(build(0, (), n), key=lambda p: (len(p), p))))
            for n in range(1, max_nodes + 1) if f[0][n] != neg}


@dataclass
class Costs:
    """Seconds per step on the device: verify / accept of probe trees by node count, the
    draft of a chain of each probed depth, and one AR iteration."""

    verify: dict[int, float]
    accept: dict[int, float]
    draft: dict[int, float]
    ar_step: float
    level_width: dict[int, float] = field(default_factory=dict)  # drafter level cost by width (recorded)

    def _interp(self, table: dict[int, float], n: int) -> float:
        xs = sorted(table)
        if n <= xs[0]:
            return table[xs[0]]
        for lo, hi in zip(xs, xs[1:]):
            if n <= hi:
                return table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)
        lo, hi = xs[-2], xs[-1]  # beyond the last probe: extend the last segment
        return table[hi] + (table[hi] - table[lo]) * (n - hi) / (hi - lo)

    def draft_cost(self, depth: int) -> float:
        xs = sorted(self.draft)
        if len(xs) == 1:
            return self.draft[xs[0]]
        per_level = (self.draft[xs[-1]] - self.draft[xs[0]]) / (xs[-1] - xs[0])
        return self.draft[xs[0]] + per_level * (depth - xs[0])

    def iteration(self, nodes: int, depth: int) -> float:
        return self.draft_cost(depth) + self._interp(self.verify, nodes) + self._interp(self.accept, nodes)


@dataclass
class Choice:
    paths: tuple[Path_, ...]
    nodes: int
    depth: int
    expected_tokens: float  # per iteration, bonus included
    iteration_s: float
    expected_speedup: float  # over AR on this device, from the model


def choose_tree(weights: Sequence[Sequence[float]], costs: Costs, max_nodes: int, max_depth: int
                ) -> tuple[Choice, list[Choice]]:
    """The tree of largest expected tokens per second, and the best tree of each depth."""
    per_depth: list[Choice] = []
    for d in range(1, max_depth + 1):
        best: Choice | None = None
        for n, (value, paths) in best_trees(weights, max_nodes, d).items():
            t = costs.iteration(n, d)
            c = Choice(paths, n, d, 1.0 + value, t, (1.0 + value) / t * costs.ar_step)
            if best is None or c.expected_speedup > best.expected_speedup:
                best = c
        if best is not None:
            per_depth.append(best)
    if not per_depth:
        raise UserError("no tree fits --max-nodes / --max-depth; raise them")
    return max(per_depth, key=lambda c: c.expected_speedup), per_depth


# -- calibration on the model ---------------------------------------------------------------------
def calibration_tree(depth: int, ranks: int) -> StaticTree:
    """A rank-0 spine `depth` deep with ranks 0..ranks-1 under every spine node."""
    paths = [(0,) * (d - 1) + (r,) for d in range(1, depth + 1) for r in range(ranks)]
    return validate_paths(f"calibration_{depth}x{ranks}", paths)


def acceptance_rates(tree: StaticTree, hits: Sequence[int], iterations: int, ranks: int,
                     prior: float = 4.0) -> tuple[list[list[float]], list[list[int]]]:
    """rate[d][r] and its sample size (times the node was reached) from node acceptance counts
    over a `calibration_tree` (hits[i] for node i, root 0). Reached = parent accepted (or every
    iteration, for depth 1) minus the accepts of its earlier siblings. Rates are shrunk towards
    rank r's pooled rate with `prior` pseudo-samples."""
    index = {(): 0, **{p: i for i, p in enumerate(tree.paths, start=1)}}
    depth = tree.max_depth
    acc = [[0] * ranks for _ in range(depth)]
    reached = [[0] * ranks for _ in range(depth)]
    for p, i in index.items():
        if not p:
            continue
        parent = iterations if len(p) == 1 else hits[index[p[:-1]]]
        earlier = sum(hits[index[p[:-1] + (s,)]] for s in range(p[-1]))
        acc[len(p) - 1][p[-1]] = hits[i]
        reached[len(p) - 1][p[-1]] = max(parent - earlier, 0)
    pooled = [(sum(acc[d][r] for d in range(depth)) + 0.5) / (sum(reached[d][r] for d in range(depth)) + 1.0)
              for r in range(ranks)]
    rate = [[(acc[d][r] + prior * pooled[r]) / (reached[d][r] + prior) for r in range(ranks)] for d in range(depth)]
    return rate, reached


def probe_tree(nodes: int, arity: int = 3) -> StaticTree:
    """A complete `arity`-ary tree of `nodes` nodes in breadth-first order (a verify/accept probe)."""
    paths: list[Path_] = []
    frontier: list[Path_] = [()]
    while len(paths) < nodes:
        nxt = []
        for parent in frontier:
            for r in range(arity):
                if len(paths) == nodes:
                    break
                paths.append(parent + (r,))
                nxt.append(parent + (r,))
        frontier = nxt
    return validate_paths(f"probe{nodes}", paths)


def tree_toml(paths: Sequence[Path_], description: str) -> str:
    rows = ", ".join("[" + ", ".join(map(str, p)) + "]" for p in paths)
    return f'description = "{description}"\npaths = [{rows}]\n'


@dataclass
class TuneResult:
    method: str
    spec: dict[str, Any]
    device: dict[str, Any]
    graph: bool
    batch_size: int
    calibration: dict[str, Any]
    rate: list[list[float]]
    reached: list[list[int]]
    costs: dict[str, Any]
    choice: dict[str, Any]
    per_depth: list[dict[str, Any]]
    ddd: dict[str, Any] | None
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _timed_rounds(steps: dict[str, Callable[[], None]], backend: Backend, rounds: int) -> dict[str, float]:
    """Median seconds of each step over `rounds` rounds that call every step once, in turn
    (interleaved, so drift in the machine's speed falls on all of them alike), device-synchronised,
    after two untimed calls each."""
    for fn in steps.values():
        fn()
        fn()
    backend.synchronize()
    times: dict[str, list[float]] = {key: [] for key in steps}
    for _ in range(rounds):
        for key, fn in steps.items():
            t0 = time.perf_counter()
            fn()
            backend.synchronize()
            times[key].append(time.perf_counter() - t0)
    return {key: statistics.median(v) for key, v in times.items()}


def monotone(table: dict[int, float]) -> dict[int, float]:
    """The non-decreasing fit of a cost table by node count (pool adjacent violators): a bigger
    tree never costs less, and a noisy probe must not make one look cheaper."""
    keys = sorted(table)
    blocks: list[list[float]] = []  # [sum, count] per pooled block
    for k in keys:
        blocks.append([table[k], 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    out, i = {}, 0
    for s, c in blocks:
        for _ in range(int(c)):
            out[keys[i]] = s / c
            i += 1
    return out


@torch.no_grad()
def tune(loaded: Any, spec: MethodSpec, backend: Backend, conditions: Sequence[int], *, batch_size: int = 1,
         max_nodes: int = 32, max_depth: int = 6, ranks: int = 4, rounds: int = 30,
         ddd_thresholds: Sequence[float] = (-0.1, -0.3, -0.6, -1.0), ddd_images: int = 2,
         progress: Callable[[str, int, int], None] | None = None, seed: int = 0) -> TuneResult:
    """Measure and choose (see the module docstring). `spec`: the method to tune (sd or
    lantern++, with its sampling and relaxation); `conditions`: the calibration classes."""
    from runtime.core.decoder import Decoder
    from runtime.core import neighbours_for

    if spec.drafting != Drafting.STATIC:
        raise UserError(f"runtime tune chooses a static tree: --method lantern++ or sd, not {spec.method}")
    if loaded.drafter is None:
        raise UserError("runtime tune needs a drafter (the model has none)")
    t_start = time.perf_counter()
    step = [0]
    grid = sorted({n for n in (1, 2, 4, 8, 16, 32, 48, 64) if n < max_nodes} | {max_nodes})
    total = 1 + len(grid) + len({1, max_depth}) + 1 + (1 if ddd_thresholds else 0)

    def tick(what: str) -> None:
        step[0] += 1
        if progress is not None:
            progress(what, step[0], total)

    target, drafter, dev = loaded.target, loaded.drafter, backend.device
    neighbours = neighbours_for(loaded.vq, spec, loaded.config.vocab_size)
    cond = torch.tensor([int(c) for c in conditions], device=dev)

    # 1. positional acceptance (eager: the tokens are the same in any mode)
    cal = calibration_tree(max_depth, ranks)
    cal_file = _write_tree(cal)
    try:
        dec = Decoder(target, drafter, on_tree(spec, str(cal_file)), neighbours=neighbours, batch_size=batch_size, track_nodes=True)
        conds = [(cond[i:i + 1], None, seed + i) for i in range(len(cond))]
        _, stats = dec.generate_many(conds)
    finally:
        cal_file.unlink(missing_ok=True)
    iterations = sum(s.target_forwards - 1 for s in stats)
    hits = dec.buffers.node_hits.sum(0).tolist()
    rate, reached = acceptance_rates(cal, hits, iterations, ranks)
    tau = sum(s.accepted_tokens for s in stats) / max(sum(s.target_forwards for s in stats), 1)
    tick("acceptance measured")
    del dec

    # 2. step costs on the device
    def decoder_for(tree: str) -> Decoder:
        d = Decoder(target, drafter, on_tree(spec, tree), neighbours=neighbours, backend=backend, batch_size=batch_size)
        d.prefill(cond.repeat(batch_size)[:batch_size], None, seed)
        return d

    def captured(fn: Callable[[], None], name: str) -> Callable[[], None]:
        return backend.capture(fn, name=name) if getattr(backend, "graph_mode", False) else fn

    # every probe is captured first, then all are timed in interleaved rounds
    steps: dict[str, Callable[[], None]] = {}
    keep = []
    for n in grid:
        tfile = _write_tree(probe_tree(n))
        try:
            d = decoder_for(str(tfile))
        finally:
            tfile.unlink(missing_ok=True)
        d.draft_step()  # real drafts in the tree, so the accept step does real work
        steps[f"verify{n}"] = captured(d.verify_at[d.policy.tree.max_depth], f"tune.verify{n}")
        steps[f"accept{n}"] = captured(d.accept_at[d.policy.tree.max_depth], f"tune.accept{n}")
        keep.append(d)
        tick(f"capture: verify/accept of {n} nodes")
    depths = sorted({1, max_depth})
    for depth in depths:
        d = decoder_for(f"chain{depth}")
        steps[f"draft{depth}"] = captured(d.draft_step, f"tune.draft{depth}")
        keep.append(d)
        tick(f"capture: draft of depth {depth}")
    ar = Decoder(target, None, replace(spec, method="ar", tree="chain1", dynamic_depth=None), backend=backend,
                 batch_size=batch_size)
    ar.prefill(cond.repeat(batch_size)[:batch_size], None, seed)
    steps["ar_verify"] = captured(ar.verify_at[0], "tune.ar.verify")
    steps["ar_accept"] = captured(ar.accept_at[0], "tune.ar.accept")
    keep.append(ar)
    secs = _timed_rounds(steps, backend, rounds)
    del keep, steps
    tick("step costs timed")
    raw_verify = {n: secs[f"verify{n}"] for n in grid}
    raw_accept = {n: secs[f"accept{n}"] for n in grid}
    draft = {depth: secs[f"draft{depth}"] for depth in depths}
    ar_step = secs["ar_verify"] + secs["ar_accept"]
    verify, accept = monotone(raw_verify), monotone(raw_accept)
    costs = Costs(verify, accept, draft, ar_step)

    weights = node_weights(rate)
    best, per_depth = choose_tree(weights, costs, max_nodes, max_depth)

    # 3. DDD threshold (optional): fastest images/s on the calibration workload
    ddd = None
    if ddd_thresholds:
        # the EAGLE-2 budget (top-k, total tokens) the profile resolved, as `runtime bench` uses it
        ddd_spec = replace(spec, method="ddd", dynamic_depth=None)
        dd = Decoder(target, drafter, ddd_spec, backend=backend, batch_size=batch_size)
        conds = [(cond[i % len(cond):i % len(cond) + 1], None, seed + i) for i in range(max(ddd_images, batch_size))]
        dd.generate_many(conds[:batch_size])  # capture / warm-up
        runs = []
        for thr in ddd_thresholds:
            dd.policy.threshold.fill_(thr)
            backend.synchronize()
            t0 = time.perf_counter()
            _, st = dd.generate_many(conds)
            backend.synchronize()
            secs = time.perf_counter() - t0
            fw = sum(s.target_forwards for s in st)
            runs.append({"threshold": thr, "seconds": secs, "images_per_s": len(conds) / secs,
                         "tau": sum(s.accepted_tokens for s in st) / fw,
                         "mean_drafted_depth": sum(s.drafted_levels for s in st) / max(fw - len(st), 1)})
        ddd = {"runs": runs, "images": len(conds),
               "threshold": max(runs, key=lambda r: r["images_per_s"])["threshold"]}
        tick("ddd threshold")

    return TuneResult(
        method=spec.method, spec=spec.describe(), device=backend.info(), graph=bool(getattr(backend, "graph_mode", False)),
        batch_size=batch_size,
        calibration={"tree": f"spine {max_depth} x ranks {ranks}", "conditions": [int(c) for c in conditions],
                     "iterations": iterations, "tau": tau, "node_hits": hits},
        rate=rate, reached=reached,
        costs={"verify_s": verify, "accept_s": accept, "draft_s": draft, "ar_step_s": ar_step,
               "verify_measured_s": raw_verify, "accept_measured_s": raw_accept, "rounds": rounds,
               "level_s": (draft[max_depth] - draft[1]) / (max_depth - 1) if max_depth > 1 else None},
        choice=_choice_dict(best), per_depth=[_choice_dict(c) for c in per_depth], ddd=ddd,
        seconds=time.perf_counter() - t_start)


def on_tree(spec: MethodSpec, tree: str) -> MethodSpec:
    """`spec`'s drafting and acceptance over the static tree `tree`, uncut: a method drafting a
    tree (lantern++) as it is, one drafting a chain (sd) as lantern++ at lambda 1 (exact
    acceptance over any tree, not only its chain)."""
    if spec.decl.tree == "chain":
        return replace(spec, method="lantern++", tree=tree, lantern_lambda=1.0, dynamic_depth=None)
    return replace(spec, tree=tree, dynamic_depth=None)


def _choice_dict(c: Choice) -> dict[str, Any]:
    return {"paths": [list(p) for p in c.paths], "nodes": c.nodes, "depth": c.depth,
            "expected_tokens": c.expected_tokens, "iteration_s": c.iteration_s,
            "expected_speedup": c.expected_speedup}


def _write_tree(tree: StaticTree) -> Path:
    import tempfile

    fd, name = tempfile.mkstemp(suffix=".toml", prefix=f"{tree.name}-")
    with open(fd, "w") as fh:
        fh.write(tree_toml(tree.paths, tree.name))
    return Path(name)


def occupancy_table(loaded: Any, specs: dict[str, MethodSpec], backend: Backend, conditions: Sequence[int],
                    occupancies: Sequence[int], *, seed: int = 0,
                    progress: Callable[[str, int, int], None] | None = None) -> list[dict[str, Any]]:
    """Which lossless method is fastest at each batch occupancy, measured: for each occupancy B
    and method, a decoder of batch B makes 2B images (conditions cycled) after an untimed batch
    that captures its steps; images per second from the synchronised wall time.
    Rows {"occupancy", "images_per_s": {method: value}, "fastest"}."""
    from runtime.core.rng import derive_seed
    from runtime.generation.pipeline import make_decoder, timed_many

    rows = []
    total, done = len(occupancies) * len(specs), 0
    for b in occupancies:
        rates: dict[str, float] = {}
        for name, spec in specs.items():
            decoder = make_decoder(loaded, spec, backend, batch_size=b, watch_law=False)
            work = [(torch.tensor([int(conditions[i % len(conditions)])], device=backend.device), None,
                     derive_seed(seed, i)) for i in range(2 * b)]
            _, seconds = timed_many(decoder, work, backend)
            rates[name] = len(work) / seconds
            done += 1
            if progress is not None:
                progress("occupancy", done, total)
        rows.append({"occupancy": b, "images_per_s": rates, "fastest": max(rates, key=rates.get)})
    return rows
