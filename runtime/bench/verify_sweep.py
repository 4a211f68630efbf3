"""Where a multi-token verify's time goes: the target forward over T new tokens, timed per T on
a model's shape (random weights), against its AR step (T = 1) and its floor, with the
operators that take the time.

    python -m runtime.bench.verify_sweep --shape llamagen-xl --tokens 1,2,4,8,16,58 \\
        --out results/cpu_speed/xl_verify_sweep_fp32.json

Every T runs with and without classifier-free guidance's second row (`rows` 1 and 2 per image)
and, on a backend that prepares weights (`Backend.prepare_inference`: the CPU's packed linear
layers), both on the prepared weights and on the plain ones, alternating within each repeat so
both see the same machine; the ratios carry bootstrap intervals. A verify here is one
`forward_cached` over the block plus the output head over every row (the head over read rows
only, `lazy_head`, is smaller still). The context is the mean committed length over an image.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from runtime.utils.errors import UserError

PREPARED, PLAIN = "prepared", "plain"


def _ratio_interval(num: Sequence[float], den: Sequence[float], draws: int = 2000) -> dict[str, float]:
    """median(num) / median(den) with a 95 % bootstrap interval over both samples."""
    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    rng = np.random.default_rng(0)
    boot = (np.median(rng.choice(a, size=(draws, a.size)), axis=1)
            / np.median(rng.choice(b, size=(draws, b.size)), axis=1))
    low, high = np.quantile(boot, [0.025, 0.975])
    return {"point": float(np.median(a) / np.median(b)), "low": float(low), "high": float(high)}


def _top_ops(step: Callable[[], Any], backend: Any, n: int = 6) -> list[dict[str, Any]]:
    """The `n` operators with the most self time (host, and device where the profiler sees one)
    in one call of `step` (torch.profiler)."""
    with torch.profiler.profile(activities=backend.profiler_activities()) as prof:
        step()
        backend.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total + e.self_device_time_total,
                  reverse=True)[:n]
    return [{"op": e.key, "calls": int(e.count), "self_ms": (e.self_cpu_time_total + e.self_device_time_total) / 1e3}
            for e in rows]


def sweep(shape_name: str, tokens: Sequence[int], *, repeats: int, warmup: int, graph: bool, dtype: str | None = None,
          device: str = "cpu",
          cfg_rows: Sequence[int] = (1, 2), progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Time the target forward of `shape_name` over each T in `tokens` (see the module doc);
    returns the JSON-ready body."""
    from backends import dtype_name, get_backend
    from runtime.bench.projection import model_shape
    from runtime.tools.roofline import device_roof, target_forward, target_shape
    from runtime.tools.step_timing import random_models

    shape = model_shape(shape_name)
    config = shape.config()
    backend = get_backend(device, graph_mode=graph, dtype=dtype)
    target, _ = random_models(config, backend)
    context = config.cls_token_num + config.block_size // 2
    roof = device_roof(backend)
    stack = target_shape(config)
    itemsize = torch.empty((), dtype=backend.dtype).element_size()
    modes = [PLAIN, PREPARED] if backend.prepare_inference(target) else [PLAIN]

    def forward(rows: int, t: int) -> Callable[[], None]:
        cache = target.new_cache(rows, context + max(tokens) + 16, backend.device)
        dev = backend.device
        x = torch.randn(rows, t, config.dim, dtype=backend.dtype, device=dev)
        positions = torch.arange(context, context + t, device=dev)
        block = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        out = torch.empty(rows, t, config.vocab_size, device=dev)

        def step() -> None:
            cache.length.fill_(context)
            out.copy_(target.logits(target.forward_cached(x, positions, block, cache)))
        return backend.capture(step, name=f"verify_T{t}_rows{rows}") if graph else step

    results = []
    for rows in cfg_rows:
        for t in tokens:
            progress(f"{shape.name}: T={t}, {rows} row(s) per image")
            samples: dict[str, list[float]] = {m: [] for m in modes}
            steps: dict[str, Callable[[], None]] = {}
            for mode in modes:
                _set_mode(backend, target, mode)
                steps[mode] = forward(rows, t)
            with torch.no_grad():
                for i in range(warmup + repeats):
                    for mode in modes:
                        _set_mode(backend, target, mode)
                        backend.synchronize()
                        began = time.perf_counter()
                        steps[mode]()
                        backend.synchronize()
                        if i >= warmup:
                            samples[mode].append(time.perf_counter() - began)
                ops = {}
                for mode in modes:
                    _set_mode(backend, target, mode)
                    ops[mode] = _top_ops(steps[mode], backend)
            work = target_forward(stack, config.vocab_size, rows=rows, tokens=t, context=context, itemsize=itemsize)
            floor = None if roof is None else work.floor_s(roof, dtype_name(backend.dtype))
            results.append({"tokens": t, "rows": rows, "seconds": samples, "floor_s": floor,
                            "median_s": {m: float(np.median(v)) for m, v in samples.items()},
                            "over_floor": {m: float(np.median(v)) / floor if floor else None
                                           for m, v in samples.items()},
                            "top_ops": ops})
    _set_mode(backend, target, modes[-1])
    for entry in results:
        step1 = next(r for r in results if r["rows"] == entry["rows"] and r["tokens"] == min(tokens))
        entry["over_ar_step"] = {m: _ratio_interval(entry["seconds"][m], step1["seconds"][m]) for m in modes}
        if len(modes) == 2:
            entry["prepared_speedup"] = _ratio_interval(entry["seconds"][PLAIN], entry["seconds"][PREPARED])
    return {"kind": "verify_sweep", "shape": {"name": shape.name, "description": shape.description,
                                              "layers": config.n_layer, "width": config.dim,
                                              "vocab_size": config.vocab_size},
            "context": context, "dtype": dtype_name(backend.dtype), "graph": graph,
            "threads": torch.get_num_threads(), "modes": modes, "repeats": repeats, "warmup": warmup,
            "roof": None if roof is None else roof.to_dict(), "device": backend.info(), "runs": results}


def _set_mode(backend: Any, target: torch.nn.Module, mode: str) -> None:
    if mode == PREPARED:
        backend.prepare_inference(target)
    else:
        backend.release_inference(target)


def main(argv: Sequence[str] | None = None) -> int:
    from runtime.utils.atomic import atomic_write_text

    parser = argparse.ArgumentParser(prog="python -m runtime.bench.verify_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llamagen-xl")
    parser.add_argument("--tokens", default="1,2,4,8,16,58", help="block sizes T, comma-separated; the first is the AR step")
    parser.add_argument("--rows", default="1,2", help="model rows per image: 1 (no guidance), 2 (CFG)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or hpu")
    parser.add_argument("--dtype", default=None, choices=["fp32", "bf16"], help="default: the backend's")
    parser.add_argument("--graph", action="store_true", help="compile each forward (torch.compile) as graph mode does")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        print(f"error: --tokens and --rows take integers, comma-separated; got {args.tokens!r}, {args.rows!r}",
              file=sys.stderr)
        return 2
    if tokens[0] != 1 or any(t < 1 for t in tokens) or any(r not in (1, 2) for r in rows) or args.repeats < 3:
        print("error: --tokens must start at 1 (the AR step) and be >= 1, --rows 1 and/or 2, --repeats >= 3",
              file=sys.stderr)
        return 2
    try:
        body = sweep(args.shape, tokens, repeats=args.repeats, warmup=args.warmup, graph=args.graph, dtype=args.dtype, device=args.device, cfg_rows=rows,
                     progress=lambda s: print(s, file=sys.stderr, flush=True))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    body["started_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    body["command_line"] = ["python", "-m", "runtime.bench.verify_sweep", *(argv if argv is not None else sys.argv[1:])]
    atomic_write_text(Path(args.out), json.dumps(body, indent=2))
    for r in body["runs"]:
        cells = "  ".join(f"{m}: {r['median_s'][m] * 1e3:7.1f} ms ("
                          + (f"{r['over_floor'][m]:.2f}x floor, " if r["over_floor"][m] else "")
                          + f"{r['over_ar_step'][m]['point']:.2f}x step)" for m in body["modes"])
        print(f"T={r['tokens']:3d} rows={r['rows']}  {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
