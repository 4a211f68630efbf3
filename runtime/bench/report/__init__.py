"""Hardware comparison report from bench result files: `report.md` + self-contained `report.html`.

The report is built once as a list of blocks (headings, paragraphs, tables, figures) and rendered
twice: markdown (figures as `plots/*.png` next to it) and HTML (figures embedded as base64 PNG, no
external references). Numbers come straight from the files; the only derived quantities are

    speedup     = mean(ar.latency_s.all) / mean(run.latency_s.all)   (ar from the same file)
                = tau x step ratio, exactly, where
    tau         = ar.stats.target_forwards / run.stats.target_forwards
    step ratio  = AR step time / iteration time
    AR step     = mean(ar.latency_s.all) / ar.stats.target_forwards     (seconds per AR forward)
    iteration   = mean(run.latency_s.all) / run.stats.target_forwards   (seconds per draft+verify step)

This is the one speedup the report, the bench's console table, the plots and the CSVs show: the
ratio of mean workload times (`speedup_vs_ar` in the file), with its 95% bootstrap interval over
repeats and images where the file records per-image latencies.

so a speedup that differs between devices is split into what acceptance bought (tau, a property
of the algorithm and the workload) and what an iteration costs relative to an AR step on that
device (the step ratio, a property of the hardware and kernels).

Files are grouped by workload; only files with identical workloads share a section and a
cross-device table. Every other group is reported separately with the differing fields named.

Modules: `blocks` (headings, paragraphs, tables, figures), `numbers` (what is derived: speedups
and tau with intervals, the decomposition, quality, summary lines, warnings, per-run tables),
`plots` (figures), `sections` (the report's sections), `render` (markdown, HTML, CSV); this
package reads the files and writes the report and the results index.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

from runtime.bench.report.blocks import PLOTS_DIR, REPORT_HTML, REPORT_MD, TABLES_DIR, BenchFile, Figure, Heading
from runtime.bench.report.numbers import (  # noqa: F401 - the names other modules and the tests use
    bench_warnings,
    decompose,
    device_label,
    fastest_run,
    fastest_text,
    floor_line,
    quality_estimates,
    quality_text,
    speedup_ci,
    speedup_text,
    summary_line,
)
from runtime.bench.report.render import render_html, render_markdown, table_csv, table_files
from runtime.bench.report.sections import build_report, projection_section
from runtime.bench.schema import load_bench
from runtime.utils.errors import UserError


def load_benches(paths: Sequence[str | os.PathLike[str]]) -> list[BenchFile]:
    """Load and validate every file first; the first bad one raises its one-line UserError."""
    if not paths:
        raise UserError("no bench files given; pass one or more files written by `runtime bench --out`")
    return [BenchFile(path=str(p), result=load_bench(p)) for p in paths]


def split_files(paths: Sequence[str | os.PathLike[str]]) -> tuple[list[BenchFile], list[tuple[str, Any]]]:
    """(bench files, projection files as (path, parsed model)), every file validated first."""
    from runtime.bench.projection import is_projection, validate_projection

    if not paths:
        raise UserError("no bench files given; pass one or more files written by `runtime bench --out`")
    benches, projections = [], []
    for p in paths:
        try:
            data = json.loads(Path(p).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = None  # load_bench names the problem
        if is_projection(data):
            projections.append((str(p), validate_projection(data, str(p))))
        else:
            benches.append(BenchFile(path=str(p), result=load_bench(p)))
    return benches, projections


def results_index(paths: Sequence[str | os.PathLike[str]], index: str | os.PathLike[str]) -> str:
    """A markdown index of result files (`results/README.md`): one row per bench file, linked
    relative to `index`, with its device, workload, fastest method (mean-based speedup with its
    interval, tau), commit and command; projection files are listed as projections."""
    benches, projections = split_files(paths)
    base = Path(index).absolute().parent
    rows = []
    for bench in sorted(benches, key=lambda b: b.result.env.started_at, reverse=True):
        r, e = bench.result, bench.result.env
        link = os.path.relpath(Path(bench.path).absolute(), base)
        best = fastest_text(r)
        commit = (e.git_commit or "unknown")[:7]
        rows.append([f"[{Path(bench.path).name}]({link})", e.started_at[:10], device_label(r),
                     f"{r.workload.model}, {r.workload.num_images} images x {e.repeats} repeats", best, commit,
                     "`" + " ".join(e.command_line).replace("|", "\\|") + "`"])
    lines = ["# Results", "",
             "Generated by `runtime report FILE... --index results/README.md` from the result files here; "
             "newest first. Speedups are the ratio of mean workload times with their 95% bootstrap interval; "
             "each file's full report: `runtime report FILE --out DIR`.", "",
             "| file | date | device | workload | fastest over ar [95% CI], tau | commit | command |",
             "|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    folders = sorted(f.parent.name for f in base.glob("*/README.md"))
    if folders:
        lines += ["", "Result folders with their own notes: " + ", ".join(f"[{f}/]({f}/README.md)" for f in folders)
                  + "."]
    if projections:
        lines += ["", "Projections (step costs measured on a model shape with random weights, times a measured tau):", ""]
        lines += [f"- [{Path(p).name}]({os.path.relpath(Path(p).absolute(), base)})" for p, _ in projections]
    return "\n".join(lines) + "\n"


def write_report(paths: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Validate `paths`, render everything in a temporary directory, then move `report.md`,
    `report.html` and `plots/` into `out_dir`. Nothing is written when any input is bad."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory; choose a directory path")
    benches, projections = split_files(paths)
    blocks = build_report(benches) if benches else [Heading(1, "lantern-runtime bench report")]
    if projections:
        blocks += projection_section(projections)
    markdown = render_markdown(blocks)
    page = render_html(blocks)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--out {out}: cannot create directory ({err.strerror}); choose a writable path") from None
    staging = Path(tempfile.mkdtemp(prefix=".report-", dir=out))
    try:
        (staging / PLOTS_DIR).mkdir()
        for block in blocks:
            if isinstance(block, Figure):
                (staging / PLOTS_DIR / f"{block.name}.png").write_bytes(block.png)
                if block.svg:
                    (staging / PLOTS_DIR / f"{block.name}.svg").write_bytes(block.svg)
        (staging / TABLES_DIR).mkdir()
        for name, table in table_files(blocks):
            (staging / TABLES_DIR / name).write_text(table_csv(table), encoding="utf-8")
        (staging / REPORT_MD).write_text(markdown, encoding="utf-8")
        (staging / REPORT_HTML).write_text(page, encoding="utf-8")
        old_plots = out / PLOTS_DIR
        if old_plots.exists():
            os.replace(old_plots, staging / "old-plots")
        os.replace(staging / PLOTS_DIR, old_plots)
        old_tables = out / TABLES_DIR
        if old_tables.exists():
            os.replace(old_tables, staging / "old-tables")
        os.replace(staging / TABLES_DIR, old_tables)
        os.replace(staging / REPORT_MD, out / REPORT_MD)
        os.replace(staging / REPORT_HTML, out / REPORT_HTML)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [out / REPORT_MD, out / REPORT_HTML, out / PLOTS_DIR, out / TABLES_DIR]
