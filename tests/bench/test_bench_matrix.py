"""The adaptive-speculation matrix without a server: which servers for which acceptance (and
which the engine would refuse), the flags and file that choose them, the run order, the
ratios, and the markdown page and plot written from synthetic result rows."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest

from specserve.bench import matrix_run, sweep
from specserve.bench.datasets import BenchPrompt, Dataset
from specserve.bench.load import LoadConfig
from specserve.bench.matrix import (
    MatrixSpec,
    Point,
    matrix_spec,
    poisson_points,
    requests_for,
    servers,
)
from specserve.bench.matrix_report import (
    point_ratios,
    ratio_summary,
    ratio_table,
    write_matrix_outputs,
)
from specserve.bench.report import summarize
from specserve.cli import build_parser, main


def _flag(run, name: str) -> str | None:
    return run.flags[run.flags.index(name) + 1] if name in run.flags else None


def _mean_len(rate: float, k: int) -> float:
    return sum(rate**i for i in range(k + 1))


def test_default_matrix_runs_every_k_with_one_drafter_quality_per_acceptance():
    runs, skipped = servers(MatrixSpec())
    assert skipped == []
    assert [r.name for r in runs] == ["off"] + [
        f"{c}@L{a}"
        for a in ("1.5", "3", "4.5")
        for c in ("fixed-k1", "fixed-k2", "fixed-k3", "fixed-k5", "goodput")
    ]
    assert runs[0].flags == ["--speculative-policy", "off"] and runs[0].acceptance is None
    for acceptance, k_max in ((1.5, 3), (3.0, 3), (4.5, 5)):
        here = [r for r in runs if r.acceptance == acceptance]
        goodput = here[-1]
        assert goodput.policy == "goodput" and goodput.k == k_max
        assert _flag(goodput, "--speculative-num-steps") == str(k_max)
        # every configuration drafts with the same per-token rate: the one whose mean
        # acceptance length at goodput's K_max is the acceptance asked for
        rates = {_flag(r, "--speculative-simulate-acceptance") for r in here}
        assert len(rates) == 1
        assert _mean_len(float(rates.pop()), k_max) == pytest.approx(acceptance, abs=1e-4)
        assert [(r.policy, r.k) for r in here[:-1]] == [("fixed", k) for k in (1, 2, 3, 5)]


def test_length_mode_skips_what_the_server_refuses_and_says_why():
    runs, skipped = servers(MatrixSpec(simulate_as="length"))
    assert [(s["config"], s["acceptance"]) for s in skipped] == [
        ("fixed-k1", 3.0),
        ("fixed-k1", 4.5),
        ("fixed-k2", 4.5),
        ("fixed-k3", 4.5),
    ]
    assert "at most K+1 = 2" in skipped[0]["reason"]
    assert [r.config for r in runs if r.acceptance == 4.5] == ["fixed-k5", "goodput"]
    assert all(
        _flag(r, "--speculative-simulate-acceptance") == f"{r.acceptance:g}"
        for r in runs
        if r.acceptance is not None
    )
    # a rate (<= 1) is valid at every K and goes to the servers as it is
    runs, skipped = servers(MatrixSpec(acceptance=[0.7], fixed_k=[1], simulate_as="length"))
    assert skipped == [] and {_flag(r, "--speculative-simulate-acceptance") for r in runs[1:]} == {
        "0.7"
    }


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"policies": ["fixed", "goodput"]}, "fractions of the off"),
        ({"arrival": ["poisson"]}, "fractions of the off"),
        ({"relative_rates": [], "request_rates": []}, "need request rates"),
        ({"fixed_k": [0]}, r"\[1, 16\]"),
        ({"policies": ["eagle"]}, "policies must be among"),
        ({"arrival": ["open"]}, "arrival must be among"),
        ({"acceptance": [4.5], "goodput_k_max": {4.5: 3}}, "raise goodput_k_max"),
        ({"simulate_as": "both"}, "rate or length"),
    ],
)
def test_spec_refuses_what_cannot_run(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MatrixSpec(**kwargs)


def test_flags_override_the_file_which_overrides_defaults(tmp_path):
    f = tmp_path / "matrix.json"
    f.write_text(
        json.dumps(
            {
                "acceptance": [3.0],
                "fixed_k": [2, 5],
                "concurrency": [1, 8],
                "request_rates": [4, "0.5x"],
                "goodput_k_max": {"3.0": 4},
                "poisson_seconds": 5,
            }
        )
    )
    args = build_parser().parse_args(
        [
            "bench",
            "sweep",
            "--matrix-file",
            str(f),
            "--k",
            "1,3",
            "--arrival",
            "closed",
            "--concurrency",
            "1,64,256",
        ]
    )
    spec = matrix_spec(args.matrix_file, args)
    assert spec.acceptance == [3.0] and spec.fixed_k == [1, 3]
    assert spec.concurrency == [1, 64, 256] and spec.arrival == ["closed"]
    assert spec.request_rates == [4.0] and spec.relative_rates == [0.5]
    assert spec.k_max_for(3.0) == 4 and spec.poisson_seconds == 5
    args = build_parser().parse_args(
        ["bench", "sweep", "--matrix", "adaptive", "--k-max", "1.5:2", "--request-rates", "2,0.25x"]
    )
    spec = matrix_spec(None, args)
    assert spec.k_max_for(1.5) == 2 and spec.k_max_for(4.5) == 5
    assert spec.request_rates == [2.0] and spec.relative_rates == [0.25]
    f.write_text('{"acceptence": [3.0]}')
    with pytest.raises(ValueError, match="unknown key"):
        matrix_spec(str(f), args)


def test_matrix_flags_need_matrix_mode_and_exclude_config(capsys):
    assert main(["bench", "sweep", "--k", "1,3"]) == 2
    assert "--k need --matrix" in capsys.readouterr().err
    assert main(["bench", "sweep", "--matrix", "adaptive", "--config", "x="]) == 2
    assert "exclusive" in capsys.readouterr().err


def test_requests_per_point_reach_a_steady_state():
    spec = MatrixSpec(requests_per_concurrency=2, poisson_seconds=20)
    assert requests_for(spec, Point("closed", 1), 8) == 8
    assert requests_for(spec, Point("closed", 64), 8) == 128
    assert requests_for(spec, Point("closed", 4), 50) == 50
    assert requests_for(spec, Point("poisson", 3.3), 8) == 66
    points = poisson_points(MatrixSpec(request_rates=[30.0], relative_rates=[0.5, 0.9]), 40.0)
    assert [(p.level, p.fraction) for p in points] == [(20.0, 0.5), (30.0, None), (36.0, 0.9)]
    assert points[0].label == "20 req/s (0.5x)" and Point("closed", 16).label == "c=16"
    # without off's peak (off did not start) the relative rates are left out, not the run;
    # a rate given twice (absolute and resolved) is one point
    spec = MatrixSpec(request_rates=[30.0, 20.0], relative_rates=[0.5])
    assert [(p.level, p.fraction) for p in poisson_points(spec, None)] == [
        (20.0, None),
        (30.0, None),
    ]
    assert [p.level for p in poisson_points(spec, 40.0)] == [20.0, 30.0]


def _row(config, policy, k, acceptance, arrival, level, tput, ok=True, mix=None, e2e=None):
    r = summarize([], 1.0, None, config={"max_concurrency": level})
    r.update(
        output_throughput=tput,
        request_throughput=tput / 10,
        label=config,
        num_requests=4,
        completed=4 if ok else 3,
        total_output_tokens=400,
    )
    r["e2e_latency_ms"]["mean"] = e2e
    r["server"] = (
        {"speculation": {"draft_length_mix": mix, "mean_acceptance_length": 2.5}} if mix else None
    )
    r["matrix"] = {
        "config": config,
        "policy": policy,
        "k": k,
        "acceptance": acceptance,
        "arrival": arrival,
        "level": level,
        "rate_fraction": None,
        "server": config,
    }
    return r


def _rows():
    rows = []
    # (Poisson points: their mean e2e latencies, ms, which their ratios compare)
    for arrival, level, off, k1, k3, goodput, e2e in (
        ("closed", 1, 100, 150, 180, 190, {}),
        ("closed", 64, 1000, 900, 700, 990, {}),
        ("poisson", 5.0, 300, 310, 305, 320, {"off": 1000, "k1": 900, "k3": 950, "g": 850}),
    ):
        rows.append(_row("off", "off", None, None, arrival, level, off, e2e=e2e.get("off")))
        rows.append(_row("fixed-k1", "fixed", 1, 3.0, arrival, level, k1, e2e=e2e.get("k1")))
        rows.append(
            _row("fixed-k3", "fixed", 3, 3.0, arrival, level, k3, level != 64, e2e=e2e.get("k3"))
        )
        mix = {"0": 0.25, "3": 0.75}
        rows.append(
            _row("goodput", "goodput", 3, 3.0, arrival, level, goodput, mix=mix, e2e=e2e.get("g"))
        )
    rows.append(_row("fixed-k1", "fixed", 1, 1.5, "closed", 1, 120))  # no goodput at 1.5
    return rows


def test_ratios_against_the_best_baseline_and_off():
    ratios = point_ratios(_rows(), [3.0, 1.5])
    by_point = {(r["acceptance"], r["arrival"], r["level"]): r for r in ratios}
    low = by_point[(3.0, "closed", 1)]
    assert low["best_baseline"] == "fixed-k3"
    assert low["goodput_over_best"] == pytest.approx(190 / 180)
    assert low["goodput_over_off"] == pytest.approx(1.9)
    assert low["output_throughput"] == {
        "off": 100,
        "fixed-k1": 150,
        "fixed-k3": 180,
        "goodput": 190,
    }
    high = by_point[(3.0, "closed", 64)]
    assert high["best_baseline"] == "off" and high["goodput_over_best"] == pytest.approx(0.99)
    assert not high["all_requests_ok"] and low["all_requests_ok"]
    # under Poisson arrivals by latency: the best baseline is the fastest, the ratio its
    # latency over goodput's (the throughputs, ~the arrival rate, say little)
    poisson = by_point[(3.0, "poisson", 5.0)]
    assert poisson["best_baseline"] == "fixed-k1" and poisson["ratio_of"] == "e2e_latency_ms_mean"
    assert poisson["goodput_over_best"] == pytest.approx(900 / 850)
    assert poisson["goodput_over_off"] == pytest.approx(1000 / 850)
    assert high["goodput_speculation"]["draft_length_mix"] == {"0": 0.25, "3": 0.75}
    # off serves every acceptance; without goodput there is no ratio
    alone = by_point[(1.5, "closed", 1)]
    assert alone["best_baseline"] == "fixed-k1" and alone["goodput_over_best"] is None
    assert [r["level"] for r in ratios if r["acceptance"] == 1.5] == [1, 64, 5.0]
    here = [r for r in ratios if r["acceptance"] == 3.0]
    # the point where a run failed requests is left out of the summary (and the plot), as
    # is one whose runs did different work (output token totals apart)
    assert ratio_summary(here) == (
        "goodput ÷ best: below 1.00 at 0 of 2 points; minimum 1.056 (c=1), median 1.057 "
        "(1 more left out: failed requests or unequal output token totals)"
    )
    rows = _rows()
    rows[0]["total_output_tokens"] = 380  # off at c=1: EOS ended some requests earlier
    at_one = point_ratios(rows, [3.0])[0]
    assert at_one["output_tokens_spread"] == pytest.approx(400 / 380 - 1)
    assert "(output tokens 5% apart)" in ratio_table([at_one], ["off"])


def test_page_and_plot_from_rows(tmp_path, capsys):
    spec = MatrixSpec(acceptance=[3.0, 1.5], fixed_k=[1, 3], simulate_as="length")
    runs, skipped = servers(spec)
    rows = _rows()
    matrix = {
        "kind": "specserve-bench-matrix",
        "title": "t",
        "command": "specserve bench x",
        "machine": {"cpu": "cpu"},
        "server_args": ["--model", "m"],
        "spec": json.loads(json.dumps(spec.__dict__)),
        "simulated": {"3.0": 3.0},
        "servers": [{**r.__dict__, "name": r.name} for r in runs],
        "skipped": skipped,
        "results": rows,
        "ratios": point_ratios(rows, [3.0, 1.5]),
    }
    paths = write_matrix_outputs(matrix, tmp_path, "mx")
    page = paths["markdown"].read_text()
    assert "## Acceptance 3 (--speculative-simulate-acceptance 3.0)" in page
    assert "## Acceptance 1.5" in page and "skipped `fixed-k1` at 3" in page
    assert (
        "| arrival | load | off | fixed-k1 | fixed-k3 | goodput | goodput ÷ best | goodput ÷ off |"
    ) in page
    assert (
        "| closed | c=64 (errors) | 1000.0 | 900.0 | 700.0 | 990.0 | 0.990 | 0.990 | off | "
        "0:25%, 3:75% | 2.50 |"
    ) in page
    assert "| poisson | 5 req/s |" in page
    assert "![goodput ÷ best baseline per point](mx.png)" in page
    assert page.count("\n| fixed-k1 | ") == 4  # the detail table: every run
    png = paths["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    saved = json.loads(paths["json"].read_text())
    assert saved["ratios"][0]["goodput_over_best"] == pytest.approx(190 / 180)
    out = tmp_path / "again.png"
    assert main(["bench", "plot", str(paths["json"]), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_server_serves_every_point_before_the_next_starts(monkeypatch, tmp_path):
    events = []

    @contextmanager
    def fake_server(args, log_path, env=None):
        events.append(("start", log_path.stem))
        yield type("Server", (), {"url": "http://127.0.0.1:1"})()
        events.append(("stop", log_path.stem))

    def fake_benchmark(cfg, dataset, progress=True, desc=""):
        if cfg.max_concurrency == 1 and len(dataset.prompts) == 1:  # the warm-up
            return {}
        events.append(("run", cfg.max_concurrency, cfg.request_rate, len(dataset.prompts)))
        level = cfg.max_concurrency or 0
        r = _row("x", "off", None, None, "closed", level, 10.0 * level)
        r["request_throughput"] = 2.0 * level  # off's peak: 8 req/s at c=4
        return r

    monkeypatch.setattr(matrix_run, "ServerProcess", fake_server)
    monkeypatch.setattr(sweep, "benchmark", fake_benchmark)
    spec = MatrixSpec(
        acceptance=[3.0], fixed_k=[2], concurrency=[4, 1], relative_rates=[0.5], poisson_seconds=2
    )
    runs, _ = servers(spec)
    load = LoadConfig("http://127.0.0.1")
    made = []

    def make_dataset(n, part):
        made.append((n, part))
        return Dataset("d", [BenchPrompt(f"p{part}", 4)] * n)

    plan = matrix_run.MatrixPlan(spec, runs, 2, [], load, warmup_requests=1, log_dir=tmp_path)
    saved = []
    result = matrix_run.run_matrix(
        plan, make_dataset, progress=False, on_server_done=lambda res: saved.append(len(res.rows))
    )
    rows, poisson = result.rows, result.poisson
    assert saved == [3, 6, 9]  # the rows so far, after each server
    assert result.failed_servers == []
    assert [(p.level, p.fraction) for p in poisson] == [(4.0, 0.5)]
    inf = float("inf")
    per_server = [("run", 1, inf, 8), ("run", 4, inf, 8), ("run", None, 4.0, 8)]
    assert events == [
        ("start", "off"),
        *per_server,
        ("stop", "off"),
        ("start", "fixed-k2@L3"),
        *per_server,
        ("stop", "fixed-k2@L3"),
        ("start", "goodput@L3"),
        *per_server,
        ("stop", "goodput@L3"),
    ]
    # a dataset per point, shared by every server (no point replays another's prompts
    # into a server that cached them), and the warm-up's own prompt
    assert made == [(1, -1), (8, 1), (8, 2), (8, 3), (1, -1), (1, -1)]
    assert [
        (r["matrix"]["config"], r["matrix"]["arrival"], r["matrix"]["level"]) for r in rows[:3]
    ] == [("off", "closed", 1), ("off", "closed", 4), ("off", "poisson", 4.0)]
    assert rows[-1]["matrix"] == {
        "config": "goodput",
        "policy": "goodput",
        "k": 3,
        "acceptance": 3.0,
        "arrival": "poisson",
        "level": 4.0,
        "rate_fraction": 0.5,
        "server": "goodput@L3",
    }


def test_a_matrix_without_a_baseline_keeps_its_results(tmp_path, capsys):
    # goodput alone (no off, no fixed K): nothing to divide by, yet the JSON and page are
    # written (a plot error must not lose a run's results)
    rows = [r for r in _rows() if r["label"].startswith("goodput")]
    spec = MatrixSpec(acceptance=[3.0], policies=["goodput"], arrival=["closed"])
    matrix = {
        "kind": "specserve-bench-matrix",
        "title": "t",
        "command": "specserve bench x",
        "machine": {"cpu": "cpu"},
        "server_args": [],
        "spec": json.loads(json.dumps(spec.__dict__)),
        "simulated": {},
        "servers": [],
        "skipped": [],
        "results": rows,
        "ratios": point_ratios(rows, [3.0]),
    }
    paths = write_matrix_outputs(matrix, tmp_path, "alone")
    assert set(paths) == {"json", "markdown"} and paths["json"].is_file()
    assert "no plot" in capsys.readouterr().out


def test_a_server_that_cannot_start_costs_only_its_own_points(monkeypatch, tmp_path):
    from specserve.bench.server_process import ServerStartError

    started = []

    @contextmanager
    def healthy(log_path):
        yield type("Server", (), {"url": "http://127.0.0.1:1"})()

    def fake_server(args, log_path, env=None):
        started.append(log_path.stem)
        if log_path.stem.startswith("fixed-k5"):
            raise ServerStartError("the server exited with 1:\n...\ntorch.OutOfMemoryError: CUDA")
        return healthy(log_path)

    def fake_benchmark(cfg, dataset, progress=True, desc=""):
        level = cfg.max_concurrency or 0
        return _row("x", "off", None, None, "closed", level, 10.0 * level)

    monkeypatch.setattr(matrix_run, "ServerProcess", fake_server)
    monkeypatch.setattr(sweep, "benchmark", fake_benchmark)
    spec = MatrixSpec(acceptance=[4.5], fixed_k=[3, 5], concurrency=[1], arrival=["closed"])
    runs, _ = servers(spec)
    plan = matrix_run.MatrixPlan(
        spec, runs, 2, [], LoadConfig("http://127.0.0.1"), warmup_requests=0, log_dir=tmp_path
    )
    seen = []
    result = matrix_run.run_matrix(
        plan,
        lambda n, part: Dataset("d", [BenchPrompt("p", 4)] * n),
        progress=False,
        on_server_done=lambda res: seen.append(len(res.failed_servers)),
    )
    assert started == ["off", "fixed-k3@L4.5", "fixed-k5@L4.5", "goodput@L4.5"]
    assert [r["matrix"]["server"] for r in result.rows] == ["off", "fixed-k3@L4.5", "goodput@L4.5"]
    assert [f["server"] for f in result.failed_servers] == ["fixed-k5@L4.5"]
    assert "OutOfMemoryError" in result.failed_servers[0]["error"]
    assert seen == [0, 0, 1, 1]


def test_a_sweep_hands_its_rows_on_after_each_server(monkeypatch, tmp_path):
    """The plain sweep saves as it goes, as the matrix does: a server that fails (or a
    SIGTERM) later loses none of the rows before it."""

    @contextmanager
    def fake_server(args, log_path, env=None):
        yield type("Server", (), {"url": "http://127.0.0.1:1"})()

    def fake_benchmark(cfg, dataset, progress=True, desc=""):
        return _row("x", "off", None, None, "closed", cfg.max_concurrency, 1.0)

    monkeypatch.setattr(sweep, "ServerProcess", fake_server)
    monkeypatch.setattr(sweep, "benchmark", fake_benchmark)
    monkeypatch.setattr(sweep, "warm_up", lambda *a, **k: None)

    def data(c, r):
        return Dataset("d", [BenchPrompt("p", 4)] * 2)

    plan = sweep.SweepPlan(
        {"a": [], "b": ["--x"]}, [1, 2], 2, [], LoadConfig("http://h"), 0, None, tmp_path
    )
    saved = []
    rows = sweep.run_sweep(
        plan,
        data,
        BenchPrompt("w", 4),
        progress=False,
        on_server_done=lambda r: saved.append(len(r)),
    )
    assert saved == [2, 4] and len(rows) == 4


def test_the_matrix_sends_ignore_eos(monkeypatch, tmp_path):
    """Its simulated acceptance changes the tokens: with EOS free to end requests the
    configurations would do different work, whose throughputs compare nothing."""
    seen = []

    def fake_run(plan, make_dataset, progress=True, on_server_done=None):
        seen.append(plan.load.ignore_eos)
        return matrix_run.MatrixResult()

    monkeypatch.setattr(matrix_run, "run_matrix", fake_run)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    argv = ["bench", "sweep", "--matrix", "adaptive", "--dataset", "jsonl", "--dataset-path"]
    main([*argv, str(data), "--output-dir", str(tmp_path / "out"), "--no-progress"])
    assert seen == [True]


class _Recorder:
    """A fake server and `benchmark` for a whole `bench sweep` command: records each run's
    prompts and dataset notes; `failing` names the (concurrency, config) points that lose
    one request."""

    def __init__(self, monkeypatch, failing=()):
        self.runs, self.warm_prompts, self.failing = [], set(), failing
        self.server = None

        @contextmanager
        def fake_server(args, log_path, env=None):
            self.server = log_path.stem
            yield type("Server", (), {"url": "http://127.0.0.1:1", "log_tail": str})()

        monkeypatch.setattr(sweep, "ServerProcess", fake_server)
        monkeypatch.setattr(matrix_run, "ServerProcess", fake_server)
        monkeypatch.setattr(sweep, "benchmark", self.benchmark)

    def benchmark(self, cfg, dataset, progress=True, desc=""):
        prompts = {p.prompt for p in dataset.prompts}
        if dataset.name == "warmup":
            self.warm_prompts |= prompts
            return {}
        level = cfg.max_concurrency
        self.runs.append((desc.split(" c=")[-1].split(" ")[0], desc, prompts))
        r = summarize([], 1.0, None, config={"max_concurrency": level}, dataset={})
        lost = int((level, self.server) in self.failing)
        r.update(num_requests=len(dataset.prompts), completed=len(dataset.prompts) - lost)
        r.update(failed=lost, dataset={"notes": list(dataset.notes)})
        return r

    def point_prompts(self) -> dict[str, set]:
        """Each point's prompts (its key: the run's description less the configuration),
        checked to be the same for every configuration."""
        points: dict[str, set] = {}
        for _, desc, prompts in self.runs:
            point = desc.split(" ", 1)[1]
            assert points.setdefault(point, prompts) == prompts, point
        return points


def _jsonl(tmp_path, count: int):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(f'{{"prompt": "q{i}"}}\n' for i in range(count)))
    return str(path)


SWEEP = ["bench", "sweep", "--dataset", "jsonl", "--num-prompts", "4", "--warmup", "1"]


def test_jsonl_sweep_points_and_rounds_resend_no_prompt(monkeypatch, tmp_path, capsys):
    """Levels of different sizes took records from part x n on: round 2 resent round 1's
    records (a prefix-caching server had them cached) and the warm-up's was a point's. A
    file too small for the sweep is said, in the notes and on the console."""
    seen = _Recorder(monkeypatch)
    argv = [*SWEEP, "--concurrency", "1,4,8", "--rounds", "2", "--config", "a=", "--config"]
    argv += ["b=--x", "--server-args", "--num-kv-pages 8", "--no-progress"]
    out = ["--output-dir", str(tmp_path / "out")]
    assert main([*argv, "--dataset-path", _jsonl(tmp_path, 200), *out]) == 0
    points = seen.point_prompts()
    assert len(points) == 6 and len(seen.warm_prompts) == 1
    sent = [q for prompts in points.values() for q in prompts]
    assert len(sent) == len(set(sent)) == 2 * (4 + 8 + 16)
    assert not seen.warm_prompts & set(sent)
    saved = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert all(r["dataset"]["notes"] == [] for r in saved["results"])  # (no empty note)
    assert "resend" not in capsys.readouterr().out
    seen.runs.clear()
    assert main([*argv, "--dataset-path", _jsonl(tmp_path, 40), *out]) == 0
    assert "the points need more prompts than" in capsys.readouterr().out
    saved = json.loads((tmp_path / "out" / "sweep.json").read_text())
    notes = [r["dataset"]["notes"] for r in saved["results"]]  # (2 configurations a point)
    assert notes[:8] == [[]] * 8  # round 1 and round 2's c=1: records 1..32 of 40
    assert "1 of these 8 are records reused from the start" in notes[8][0]  # 33..39, 0
    assert all("16 of these 16 are records reused" in n[0] for n in notes[10:])


def test_a_sweep_with_failed_requests_exits_1_and_says_why(monkeypatch, tmp_path, capsys):
    """It exited 0 when any request of each point completed (a count tested for truth)."""
    _Recorder(monkeypatch, failing={(4, "b")})
    argv = [*SWEEP, "--dataset-path", _jsonl(tmp_path, 100), "--concurrency", "1,4"]
    argv += ["--config", "a=", "--config", "b=--x", "--output-dir", str(tmp_path), "--no-progress"]
    assert main(argv) == 1
    said = "[sweep] 1 of 24 requests failed in 1 of 4 runs: exit status 1"
    assert said in capsys.readouterr().err


def test_jsonl_matrix_points_resend_no_prompt_and_failures_exit_1(monkeypatch, tmp_path, capsys):
    """The matrix's points take the file's records after the warm-up's, as a sweep's do
    (its last record, the warm-up's, was the third point's); a point with a failed request
    fails the run, saying so."""
    seen = _Recorder(monkeypatch, failing={(2, "fixed-k1@L3")})
    argv = [*SWEEP, "--dataset-path", _jsonl(tmp_path, 32), "--matrix", "adaptive"]
    argv += ["--acceptance", "3.0", "--k", "1", "--policies", "off,fixed", "--arrival", "closed"]
    argv += ["--concurrency", "1,2,4", "--output-dir", str(tmp_path), "--no-progress"]
    assert main(argv) == 1
    points = seen.point_prompts()
    sent = [q for prompts in points.values() for q in prompts]
    assert len(points) == 3 and len(sent) == len(set(sent)) == 3 * 8  # (at least 8 a point)
    assert len(seen.warm_prompts) == 1 and not seen.warm_prompts & set(sent)
    assert "[matrix] 1 of 48 requests failed in 1 of 6 runs" in capsys.readouterr().err
