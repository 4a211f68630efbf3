"""`runtime report`: numbers in the report are the JSON's numbers, workloads that differ are never
compared, the HTML stands alone, and bad inputs stop everything before a file is written."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pytest

from runtime.bench.report import decompose, write_report
from runtime.bench.schema import (
    Conditions,
    DeviceInfo,
    Env,
    MethodParams,
    Phase,
    Profile,
    Quality,
    Sampling,
    Workload,
    load_bench,
    make_bench,
    make_run,
    save_bench,
)

TOKENS = 16


def write_bench(
    path: Path,
    backend: str,
    name: str,
    runs: list[tuple[str, dict[str, Any], float, int, Quality | None]],
    num_images: int = 4,
    samples: bool = True,
    spread: float = 0.05,
) -> Path:
    """A bench file; `runs` = (method, params, p50 seconds, target forwards, quality). With
    `samples`, every run carries per-image latencies (repeat totals split over images of
    unequal cost) and per-image counts; `spread` is the repeats' relative spread."""
    workload = Workload(
        model="GPT-demo", params=2_000_000, tokens_per_image=TOKENS, image_size=64,
        conditions=Conditions.for_classes(list(range(num_images))), num_images=num_images,
        seeds=list(range(100, 100 + num_images)),
        sampling=Sampling(greedy=False, temperature=1.0, top_k=0, top_p=1.0, cfg=1.0),
    )
    env = Env(
        torch="2.13.0", python="3.11.9", platform="Linux", git_commit=None, profile=Profile(name=backend, values={}),
        command_line=["runtime", "bench"], started_at="2026-01-01T00:00:00+00:00", bench_seconds=3.0,
        warmup=1, repeats=3, timer="perf_counter",
    )
    tokens = num_images * TOKENS
    weights = [1.0 + 0.1 * i for i in range(num_images)]

    def split(total: float, r: int) -> list[float]:
        shares = [w * (1 + 0.02 * ((r + i) % 3 - 1)) for i, w in enumerate(weights)]
        return [total * x / sum(shares) for x in shares]

    def counts(forwards: int) -> list[list[int]]:
        each = [forwards // num_images + (1 if i < forwards % num_images else 0) for i in range(num_images)]
        return [[TOKENS, f] for f in each]

    built = []
    for method, params, p50, forwards, quality in runs:
        latencies = [p50 * (1 - spread), p50, p50 * (1 + 2 * spread)]
        built.append(make_run(
            method, latencies=latencies, num_images=num_images, target_forwards=forwards,
            tokens=tokens, mean_accepted_length=tokens / forwards * 0.97, params=MethodParams(**params),
            phases={"draft": Phase(seconds=p50 * 0.3, count=forwards),
                    "verify": Phase(seconds=p50 * 0.6, count=forwards)}, quality=quality,
            per_image_latencies=[split(t, r) for r, t in enumerate(latencies)] if samples else None,
            image_counts=counts(forwards) if samples else None))
    device = DeviceInfo(backend=backend, name=name, count=1, versions={"torch": "2.13.0"})
    return save_bench(make_bench(device, workload, env, built), path)


@pytest.fixture(scope="module")
def cpu_and_gpu(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp_path = tmp_path_factory.mktemp("benches")
    lpp = {"tree": "t7", "lantern_k": 100, "lantern_lambda": 2.0}
    cpu = write_bench(tmp_path / "cpu.json", "cpu", "Xeon", [
        ("ar", {}, 3.3, 64, Quality.of(class_accuracy=0.8)),
        ("eagle2", {"depth": 4}, 1.7, 26, None),
        ("lantern++", lpp, 1.37, 20, Quality.of(class_accuracy=0.78)),
    ])
    gpu = write_bench(tmp_path / "gpu.json", "cuda", "RTX 3090", [
        ("ar", {}, 0.41, 64, None),
        ("eagle2", {"depth": 4}, 0.29, 26, None),
        ("lantern++", lpp, 0.23, 20, None),
    ])
    return cpu, gpu


@pytest.fixture(scope="module")
def rendered(cpu_and_gpu: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report of the cpu and gpu files, rendered once for the tests that only read it."""
    out = tmp_path_factory.mktemp("report")
    write_report(cpu_and_gpu, out)
    return out


def md_tables(markdown: str) -> list[list[dict[str, str]]]:
    """Every markdown table as a list of {header: cell} rows."""
    tables, lines = [], markdown.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("| ") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            headers = [h.strip() for h in lines[i].strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("| "):
                rows.append(dict(zip(headers, (c.strip() for c in lines[i].strip("|").split("|")))))
                i += 1
            tables.append(rows)
        else:
            i += 1
    return tables


def section(markdown: str, heading: str) -> str:
    """The text from `heading` to the next heading of the same or a higher level."""
    level = heading.split(" ")[0]
    start = markdown.index(heading)
    rest = markdown[start + len(heading):]
    ends = [m.start() for m in re.finditer(rf"^#{{1,{len(level)}}} ", rest, flags=re.M)]
    return heading + (rest[: ends[0]] if ends else rest)


def test_speedups_and_tau_in_the_report_are_the_json_ratios(rendered: Path, cpu_and_gpu: tuple[Path, Path]) -> None:
    markdown = (rendered / "report.md").read_text()
    for path in cpu_and_gpu:
        result = load_bench(path)
        table = md_tables(section(markdown, f"### {result.device.backend}: {result.device.name} x1"))[0]
        ar = next(r for r in result.runs if r.method == "ar")
        assert [row["method"] for row in table] == [r.method for r in result.runs]
        for row, run in zip(table, result.runs):
            expected = "1 (baseline)" if run is ar else f"{ar.latency_s.mean / run.latency_s.mean:.2f}x ["
            assert row["speedup [95% CI]"].startswith(expected)  # the mean-based ratio, with its interval
            assert row["tau"] == f"{run.stats.mean_accepted_length:.2f}" and row["tau [95% CI]"].endswith("]")
            assert float(row["p50 s"]) == pytest.approx(run.latency_s.p50, abs=5e-4)
    assert re.search(r"\| lantern\+\+ \| tree=t7 k=100 lambda=2 \| [\d.]+ \| [\d.]+ \[[^]]+\] \| 2\.41x \[", markdown)  # 3.3 / 1.37


def test_decomposition_multiplies_back_to_the_speedup(rendered: Path, cpu_and_gpu: tuple[Path, Path]) -> None:
    result = load_bench(cpu_and_gpu[0])
    ar, _, lantern = result.runs
    d = decompose(lantern, ar)
    assert d.tau == pytest.approx(64 / 20)
    assert d.ar_step_s == pytest.approx(ar.latency_s.mean / 64) and d.iteration_s == pytest.approx(lantern.latency_s.mean / 20)
    assert d.tau * d.step_ratio == pytest.approx(d.speedup) == pytest.approx(lantern.speedup_vs_ar)
    markdown = (rendered / "report.md").read_text()
    rows = [row for table in md_tables(markdown) for row in table if "x step ratio" in row]
    assert rows, "no decomposition table"
    for row in rows:
        product = float(row["= tau (AR fwd / fwd)"]) * float(row["x step ratio"])
        speedup = row.get("speedup") or row["speedup [95% CI]"].split(" ")[0]
        assert product == pytest.approx(float(speedup.rstrip("x")), abs=0.03)


def test_same_workload_is_compared_side_by_side_with_the_cause_named(rendered: Path) -> None:
    markdown = (rendered / "report.md").read_text()
    across = section(markdown, "### Across devices")
    devices = {row["device"] for row in md_tables(across)[0] if row["method"].startswith("lantern++")}
    assert devices == {"cpu: Xeon x1", "cuda: RTX 3090 x1"}
    # Same tau on both devices and a gap far outside the noise: attributed to the step ratio.
    assert re.search(r"`lantern\+\+ \[tree=t7 k=100 lambda=2\]`: 1\.78x on cuda: RTX 3090 x1 to 2\.41x on cpu: "
                     r"Xeon x1; tau differs by 1\.00x .* outside the noise, mainly through the step ratio", across)


def test_speedups_and_tau_carry_their_intervals(rendered: Path) -> None:
    markdown = (rendered / "report.md").read_text()
    rows = [row for table in md_tables(markdown) for row in table if "speedup [95% CI]" in row and "params" in row]
    lantern = next(row for row in rows if row["method"] == "lantern++")
    point, low, high = map(float, re.match(r"([\d.]+)x \[([\d.]+), ([\d.]+)\]",
                                           lantern["speedup [95% CI]"]).groups())
    assert low < point < high and point == pytest.approx(2.41, abs=0.05)
    assert re.match(r"[\d.]+ \[[\d.]+, [\d.]+\]", lantern["tau [95% CI]"])


def test_without_per_image_samples_no_cause_is_named(tmp_path: Path) -> None:
    lpp = {"tree": "t7", "lantern_k": 100, "lantern_lambda": 2.0}
    a = write_bench(tmp_path / "a.json", "cpu", "Xeon", [("ar", {}, 3.3, 64, None), ("lantern++", lpp, 1.37, 20, None)],
                    samples=False)
    b = write_bench(tmp_path / "b.json", "cuda", "A100", [("ar", {}, 0.4, 64, None), ("lantern++", lpp, 0.3, 20, None)],
                    samples=False)
    write_report([a, b], tmp_path / "out")
    across = section((tmp_path / "out" / "report.md").read_text(), "### Across devices")
    assert "Not tested against noise" in across and "mainly" not in across


def test_two_benches_of_one_setting_on_one_device_are_within_noise_and_compared_as_runs(tmp_path: Path) -> None:
    lpp = {"tree": "t7", "lantern_k": 100, "lantern_lambda": 2.0}
    a = write_bench(tmp_path / "a.json", "cpu", "Xeon", [("ar", {}, 3.3, 64, None), ("lantern++", lpp, 1.75, 20, None)],
                    spread=0.15)
    b = write_bench(tmp_path / "b.json", "cpu", "Xeon", [("ar", {}, 3.3, 64, None), ("lantern++", lpp, 1.86, 20, None)],
                    spread=0.15)
    write_report([a, b], tmp_path / "out")
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "### Across devices" not in markdown
    one = section(markdown, "### Across modes and repeated benches (one device)")
    assert "within noise" in one and "mainly" not in one


def test_different_workloads_go_to_separate_sections_with_the_difference_named(
    tmp_path: Path, cpu_and_gpu: tuple[Path, Path]
) -> None:
    bigger = write_bench(tmp_path / "cpu8.json", "cpu", "Xeon", [("ar", {}, 6.0, 128, None)], num_images=8)
    write_report([*cpu_and_gpu, bigger], tmp_path / "out")
    markdown = (tmp_path / "out" / "report.md").read_text()
    first = section(markdown, "## Workload A")
    second = section(markdown, "## Workload B")
    assert "cpu8.json" not in first and "cpu8.json" in second
    assert "workload differs from workload A:" in second and "num_images 4 vs 8" in second
    assert "### Across devices" in first and "### Across devices" not in second


def test_html_is_self_contained(rendered: Path) -> None:
    page = (rendered / "report.html").read_text()
    sources = re.findall(r'\bsrc="([^"]*)"', page)
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources)
    assert not re.search(r"<link\b|<script\b|url\(|https?://", page)
    assert "2.41x" in page
    plots = sorted(p.name for p in (rendered / "plots").iterdir())
    pngs = [p for p in plots if p.endswith(".png")]
    assert len(sources) == len(pngs) and "w1-speedup.png" in pngs
    assert sorted(p[:-4] for p in plots if p.endswith(".svg")) == sorted(p[:-4] for p in pngs)  # each also as SVG


def test_sweep_gets_a_speed_quality_curve_only_when_quality_was_measured(tmp_path: Path) -> None:
    def sweep(quality: bool) -> Path:
        return write_bench(tmp_path / f"sweep-{quality}.json", "cpu", "Xeon", [
            ("ar", {}, 3.0, 64, Quality.of(fd=10.0) if quality else None),
            *[("lantern++", {"lantern_lambda": lam}, 3.0 / (1 + lam / 2), 64 // (1 + int(lam)),
               Quality.of(fd=10.0 + lam) if quality else None) for lam in (1.0, 2.0, 4.0)],
        ])

    write_report([sweep(True)], tmp_path / "with")
    assert "w1-d1-speed-quality.png" in (tmp_path / "with" / "report.md").read_text()
    write_report([sweep(False)], tmp_path / "without")
    assert "Sweep of lantern++ present but no measured quality" in (tmp_path / "without" / "report.md").read_text()


def test_a_file_without_ar_reports_why_speedup_is_missing(tmp_path: Path) -> None:
    lone = write_bench(tmp_path / "lone.json", "cpu", "Xeon", [("lantern++", {}, 1.0, 20, None)])
    write_report([lone], tmp_path / "out")
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert md_tables(markdown)[0][0]["speedup [95% CI]"] == "n/a"
    assert "this file has no `ar` run" in markdown


def test_cli_writes_the_report(run_cli: Any, tmp_path: Path, cpu_and_gpu: tuple[Path, Path]) -> None:
    result = run_cli("report", *map(str, cpu_and_gpu), "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.stderr
    assert str(tmp_path / "out" / "report.html") in result.stdout
    assert (tmp_path / "out" / "report.md").is_file()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{ not json", "not valid JSON (line 1, column 3"),
        ('{"schema_version": 9}', "schema_version 9 is not supported"),
        (None, "runs[1].latency_s.p50 must be a number"),
    ],
)
def test_a_bad_file_stops_the_report_before_anything_is_written(
    run_cli: Any, tmp_path: Path, cpu_and_gpu: tuple[Path, Path], content: str | None, message: str
) -> None:
    bad = tmp_path / "bad.json"
    if content is None:
        bad.write_text(cpu_and_gpu[0].read_text().replace('"p50": 1.7,', '"p50": "1.7",', 1))
    else:
        bad.write_text(content)
    out = tmp_path / "out"
    result = run_cli("report", *map(str, cpu_and_gpu), str(bad), "--out", str(out))
    assert result.exit_code != 0
    assert result.stderr.strip() == f"error: {bad}: " + result.stderr.strip().split(f"{bad}: ", 1)[1]
    assert message in result.stderr and result.stderr.count("\n") == 1
    assert not out.exists()


def test_a_bad_file_leaves_an_earlier_report_untouched(run_cli: Any, tmp_path: Path, cpu_and_gpu: tuple[Path, Path]) -> None:
    out = tmp_path / "out"
    write_report(cpu_and_gpu[:1], out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    result = run_cli("report", str(cpu_and_gpu[1]), str(tmp_path / "missing.json"), "--out", str(out))
    assert result.exit_code == 2 and "missing.json: no such file" in result.stderr
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_device_budget_round_trips_and_is_reported_with_the_loop_efficiency(tmp_path: Path) -> None:
    from runtime.bench.schema import DeviceOps

    path = write_bench(tmp_path / "b.json", "cpu", "Xeon", [("ar", {}, 4.0, 64, None), ("lantern++", {}, 2.0, 20, None)])
    bench = load_bench(path)
    bench.runs[1].device_ops = {"draft": DeviceOps(ops_per_iteration=300.0, kernels_per_step=12),
                                "verify": DeviceOps(ops_per_iteration=760.0, kernels_per_step=40),
                                "accept": DeviceOps(ops_per_iteration=120.5, kernels_per_step=None)}
    save_bench(bench, path)
    again = load_bench(path)
    assert again.runs[1].device_ops["accept"].ops_per_iteration == 120.5
    assert again.runs[1].device_ops["draft"].kernels_per_step == 12
    out = tmp_path / "report"
    write_report([path], out)
    md = (out / "report.md").read_text()
    budget = [t for t in md_tables(md) if t and "loop efficiency" in t[0]][0]
    row = [r for r in budget if r["method"] == "lantern++"][0]
    assert row["draft ops / kernels"] == "300 / 12" and row["accept ops / kernels"] == "120"
    assert row["(draft + accept) / verify ops"] == f"{100 * 420.5 / 760:.0f}%"
    # verify time per call / iteration time (the mean repeat): (2.0 * 0.6 / 20) / (mean / 20)
    lpp = again.runs[1]
    assert row["loop efficiency"] == f"{0.6 * lpp.latency_s.p50 / lpp.latency_s.mean:.2f}"


def test_an_unknown_device_ops_phase_is_refused(tmp_path: Path) -> None:
    import json

    from runtime.utils.errors import UserError

    path = write_bench(tmp_path / "b.json", "cpu", "Xeon", [("ar", {}, 4.0, 64, None)])
    data = json.loads(path.read_text())
    data["runs"][0]["device_ops"] = {"decode": {"ops_per_iteration": 1.0, "kernels_per_step": None}}
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match="device_ops.decode"):
        load_bench(path)


def test_drafted_depth_and_dynamic_depth_params_round_trip_and_are_reported(tmp_path: Path) -> None:
    path = write_bench(tmp_path / "b.json", "cpu", "Xeon", [
        ("ar", {}, 4.0, 64, None),
        ("ddd", {"depth": 10, "ddd_threshold": -0.3, "ddd_check_every": 2, "ddd_min_depth": 4}, 2.5, 24, None),
        ("lantern++", {"tree": "/somewhere/cpu-tuned.tree.toml", "dynamic_depth": 0.1}, 2.0, 20, None),
    ])
    bench = load_bench(path)
    bench.runs[1].stats.per_depth_acceptance = [0.7, 0.6, 0.5]
    bench.runs[1].stats.mean_drafted_depth = 6.25
    bench.runs[2].stats.per_depth_acceptance = [0.8, 0.4]
    bench.runs[2].stats.mean_drafted_depth = 1.5
    save_bench(bench, path)
    again = load_bench(path)
    assert again.runs[1].params.ddd_threshold == -0.3 and again.runs[1].stats.mean_drafted_depth == 6.25
    assert again.runs[2].params.dynamic_depth == 0.1
    assert "tree=cpu-tuned.tree" in again.runs[2].params.label()  # a tree file shows by name
    out = tmp_path / "report"
    write_report([path], out)
    md = (out / "report.md").read_text()
    depths = [t for t in md_tables(md) if t and "mean drafted depth" in t[0]][0]
    assert [(r["method"], r["mean drafted depth"], r["acceptance at depth 1, 2, ..."]) for r in depths] == [
        ("ddd", "6.25", "0.70 0.60 0.50"), ("lantern++", "1.50", "0.80 0.40")]
    assert "-depth.png" in md


def test_kept_grids_show_each_method_beside_ar(tmp_path: Path) -> None:
    import numpy as np

    from runtime.bench.grids import grids_dir, read_grid, write_grids

    lpp = {"tree": "t7", "lantern_k": 100, "lantern_lambda": 2.0}
    path = write_bench(tmp_path / "b.json", "cpu", "Xeon", [("ar", {}, 3.3, 64, None), ("lantern++", lpp, 1.4, 20, None)])
    images = np.random.default_rng(0).integers(0, 255, size=(4, 16, 16, 3), dtype=np.uint8)
    write_grids([(0, images), (1, images[::-1])], grids_dir(path))
    assert read_grid(path, 0).shape == (2 * 18 + 2, 2 * 18 + 2, 3) and read_grid(path, 5) is None
    write_report([path], tmp_path / "out")
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "Images of ar (left) and lantern++ [tree=t7 k=100 lambda=2] (right), same seeds" in markdown
    assert (tmp_path / "out" / "plots" / "w1-d1-images-01.png").is_file()


def test_every_table_is_also_written_as_csv(rendered: Path) -> None:
    import csv

    tables = sorted((rendered / "tables").glob("*.csv"))
    assert tables and tables[0].name.startswith("01-")
    markdown = (rendered / "report.md").read_text()
    assert len(tables) == len(md_tables(markdown))
    rows = [row for path in tables for row in csv.DictReader(path.open())]
    lantern = [row for row in rows if row.get("method") == "lantern++" and row.get("speedup low")]
    assert lantern and all(float(row["speedup low"]) < float(row["speedup"]) < float(row["speedup high"])
                           for row in lantern)
    assert any(row["speedup"] == "2.41" for row in lantern)  # numbers, not "2.41x [..]" strings


def test_summary_line_and_warnings_of_a_committed_bench() -> None:
    from runtime.bench.report import bench_warnings, summary_line

    result = load_bench(Path(__file__).resolve().parents[1] / "results" / "frontier_lanternpp_chain3_sampling.json")
    line = summary_line(result)
    assert line is not None and line.startswith("Summary: fastest `lantern++`") and "(mean-based, 95% interval)" in line
    warnings = bench_warnings(result)
    assert any("only 3 timed repeats" in w for w in warnings)
    assert any("spans 1: not distinguishable from ar" in w for w in warnings)


def test_the_results_index_lists_each_file_with_its_fastest_method_and_command(run_cli: Any, tmp_path: Path) -> None:
    committed = Path(__file__).resolve().parents[1] / "results" / "frontier_lanternpp_chain3_sampling.json"
    index = tmp_path / "README.md"
    result = run_cli("report", str(committed), "--index", str(index))
    assert result.exit_code == 0, result.stderr
    text = index.read_text()
    row = next(line for line in text.splitlines() if "frontier_lanternpp_chain3_sampling.json" in line)
    assert "1.61x [1.25, 2.04], tau 2.42" in row and "`runtime bench" in row and "cpu: AMD EPYC x1" in row
    # a file without per-image timings still names its fastest method, by the same (mean) ratio
    older = committed.with_name("cpu_demo_graph_ddd_greedy.json")
    assert run_cli("report", str(older), "--index", str(index)).exit_code == 0
    row = next(line for line in index.read_text().splitlines() if older.name in line)
    assert "fastest `ddd`" in row and "0.96x (no interval: no per-image timings)" in row
    refused = run_cli("report", str(committed))
    assert refused.exit_code == 2 and "give --out DIR" in refused.stderr


def test_the_bench_console_table_fits_80_columns() -> None:
    from rich.console import Console

    from runtime.bench.schema import load_bench
    from runtime.cli.bench_cmd import bench_table

    path = Path(__file__).resolve().parents[1] / "results" / "frontier_lanternpp_chain3_sampling.json"
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(bench_table(load_bench(path), path))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "1.61x [1.25, 2.04]" in text and "rule=paper" in text  # nothing cut off: speedup and settings


def test_phase_floors_round_trip_and_are_reported_as_measured_over_floor(tmp_path: Path) -> None:
    from runtime.bench.schema import DeviceOps, Roof

    path = write_bench(tmp_path / "b.json", "cpu", "Xeon", [("ar", {}, 4.0, 64, None), ("lantern++", {}, 2.0, 20, None)])
    bench = load_bench(path)
    bench.device.roof = Roof(name="toy", bandwidth_bytes_per_s=1e10, matmul_flops_per_s={"fp32": 1e11}, source="test")
    verify = bench.runs[1].phases["verify"]
    floor = verify.seconds / verify.count / 4  # the verify runs at 4x its floor
    bench.runs[1].device_ops = {"verify": DeviceOps(ops_per_iteration=760.0, kernels_per_step=None, floor_s=floor)}
    save_bench(bench, path)
    again = load_bench(path)
    assert again.device.roof.name == "toy" and again.runs[1].device_ops["verify"].floor_s == pytest.approx(floor)
    out = tmp_path / "report"
    write_report([path], out)
    md = (out / "report.md").read_text()
    assert "Against the physical floor" in md and "toy, 10 GB/s (test)" in md
    table = [t for t in md_tables(md) if t and "verify: measured / floor" in t[0]][0]
    row = [r for r in table if r["method"] == "lantern++"][0]
    assert row["verify: measured / floor"].endswith("= 4.0x") and row["draft: measured / floor"] == "-"


def test_error_bars_of_an_interval_that_misses_its_point_are_drawn_not_refused():
    """A bootstrap interval may lie beside its point (FD at few images); the plots draw that end at
    the point instead of handing matplotlib a negative bar (which raised, failing the report)."""
    from runtime.bench.report.plots import _yerr

    assert _yerr([(23.2, 25.4, 57.2), (1.0, 0.5, 1.5)]) == [[0.0, 0.5], [34.0, 0.5]]
    assert _yerr([(1.0, None, None)]) is None
