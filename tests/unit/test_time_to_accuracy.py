"""The time-to-accuracy race of benchmarks/learning.py: forward passes per step from a run's
config, the first evaluation over a threshold, the sweep's winner, the summary over seeds
and the plot, on run directories written here (the real race needs SmolLM2 and hours)."""

import json
import sys
from pathlib import Path

import pytest

from tests.helpers.scripts import benchmark_script


@pytest.fixture(scope="module")
def learning():
    with benchmark_script("learning") as module:
        yield module


def write_run(path: Path, optim: str, accuracies: list[float], step_s: float, every: int) -> Path:
    path.mkdir(parents=True)
    (path / "config.toml").write_text(f"[optim]\n{optim}\n")
    steps = every * (len(accuracies) - 1)
    (path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, "loss": 1.0, "step_s": step_s}) + "\n" for i in range(steps))
    )
    (path / "eval.jsonl").write_text(
        "".join(
            json.dumps({"step": k * every, "eval_accuracy": a}) + "\n"
            for k, a in enumerate(accuracies)
        )
    )
    return path


def test_forward_passes_per_step_follow_the_estimator(learning):
    assert learning.passes_per_step({"optim": {"num_queries": 1}}) == 2  # MeZO
    assert learning.passes_per_step({"optim": {"estimator": "spsa", "num_queries": 4}}) == 8
    assert learning.passes_per_step({"optim": {"estimator": "fzoo", "num_queries": 8}}) == 9
    assert learning.passes_per_step({"optim": {"estimator": "lozo", "num_queries": 1}}) == 2
    with pytest.raises(SystemExit, match="unknown estimator 'adam2'"):
        learning.passes_per_step({"optim": {"estimator": "adam2"}})


def test_a_curve_counts_passes_and_seconds_up_to_each_evaluation(learning, tmp_path):
    run = write_run(
        tmp_path / "r", 'estimator = "fzoo"\nnum_queries = 8', [0.5, 0.61, 0.7], 0.5, 10
    )
    points = learning.race_curve(run)
    assert [p["step"] for p in points] == [0, 10, 20]
    assert [p["forward_passes"] for p in points] == [0, 90, 180]
    assert [p["wall_s"] for p in points] == [0.0, 5.0, 10.0]
    assert learning.first_reaching(points, 0.65)["step"] == 20
    assert learning.first_reaching(points, 0.8) is None


def test_a_threshold_counts_from_where_accuracy_stays_above_it(learning):
    points = [{"step": k, "eval_accuracy": a} for k, a in enumerate([0.5, 0.67, 0.62, 0.66, 0.7])]
    assert learning.first_reaching(points, 0.65)["step"] == 1
    assert learning.first_holding(points, 0.65)["step"] == 3  # 0.67 fell back to 0.62
    assert learning.first_holding(points, 0.60)["step"] == 1
    assert learning.first_holding(points[:3], 0.65) is None  # ends below: never held


def test_the_sweep_picks_the_fewest_passes_to_the_highest_threshold_reached(learning):
    def curve(accs, per_eval=100):
        return [
            {"forward_passes": k * per_eval, "wall_s": k, "eval_accuracy": a}
            for k, a in enumerate(accs)
        ]

    sweep = {
        1e-5: curve([0.5, 0.62, 0.63, 0.64]),  # 0.60 only, early; best final of the misses
        3e-5: curve([0.5, 0.55, 0.66, 0.67]),  # 0.65 at 200 passes
        1e-4: curve([0.5, 0.58, 0.61, 0.67]),  # 0.65 at 300 passes
        3e-4: curve([0.5, 0.68, 0.55, 0.52]),  # 0.65 at 100 passes, then lost: not reached
    }
    assert learning.sweep_winner(sweep, [0.60, 0.65]) == 3e-5
    misses = {1e-5: curve([0.5, 0.52]), 3e-5: curve([0.5, 0.55])}
    assert learning.sweep_winner(misses, [0.60, 0.65]) == 3e-5


def test_the_summary_takes_the_median_of_the_seeds_that_reach(learning):
    def curve(accs):
        return [
            {"forward_passes": 10 * k, "wall_s": 2.0 * k, "eval_accuracy": a}
            for k, a in enumerate(accs)
        ]

    runs = {0: curve([0.5, 0.6, 0.66]), 1: curve([0.5, 0.65, 0.7]), 2: curve([0.5, 0.66, 0.55])}
    out = learning.race_summary(runs, [0.60, 0.65])
    assert out["reached_0.60"] == 2 and out["passes_to_0.60"] == 10  # seed 2 fell back
    assert out["reached_0.65"] == 2 and out["passes_to_0.65"] == 15 and out["wall_s_to_0.65"] == 3
    assert out["first_passes_to_0.65"] == 10  # seeds 0, 1, 2 touched it at 20, 10, 10
    # over every seed, seed 2 (never held) counting as beyond the budget: 10, 20, inf
    assert out["seed_median_passes_to_0.60"] == 10 and out["seed_median_passes_to_0.65"] == 20
    assert learning.race_summary({0: runs[2], 1: runs[2]}, [0.65])[
        "seed_median_passes_to_0.65"
    ] == float("inf")
    # the seeds' mean curve: 0.5, 0.6367, 0.6367: holds 0.60 from 10 passes, never 0.65
    assert out["mean_curve_passes_to_0.60"] == 10 and "mean_curve_passes_to_0.65" not in out
    assert out["final_accuracy"] == pytest.approx((0.66 + 0.7 + 0.55) / 3)


def test_a_ratio_of_passes_bounds_a_recipe_that_never_held(learning):
    inf = float("inf")
    assert learning.passes_ratio(300, 150) == 2.0
    assert learning.passes_ratio(inf, 150) == inf  # only the other held it in the budget
    assert learning.passes_ratio(150, inf) == 0.0
    assert learning.passes_ratio(inf, inf) is None  # neither: no ratio
    assert learning.passes_ratio(0, 0) == 1.0  # both from the start


def test_the_plot_is_written(learning, tmp_path):
    def curve(accs):
        return [
            {"forward_passes": 10 * k, "wall_s": k, "eval_accuracy": a} for k, a in enumerate(accs)
        ]

    path = tmp_path / "race.png"
    curves = {"spsa": {0: curve([0.5, 0.6]), 1: curve([0.5, 0.62])}, "fzoo": {0: curve([0.7])}}
    learning.plot_race(path, curves, [0.6, 0.65])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp*"))


def test_given_lrs_replace_a_recipes_sweep(learning):
    assert learning.parse_lrs("fzoo=1e-3:1e-4,spsa=1e-5") == {"fzoo": (1e-3, 1e-4), "spsa": (1e-5,)}
    assert learning.parse_lrs("") == {}
    with pytest.raises(SystemExit, match="not RECIPE=LR"):
        learning.parse_lrs("fzoo=fast")
    with pytest.raises(SystemExit, match="names 'adam'"):
        learning.parse_lrs("adam=1e-3")


def test_a_sweep_run_that_diverges_loses_its_sweep_instead_of_ending_the_race(learning, tmp_path):
    run = tmp_path / "race-spsa-lr0.1-seed0"
    run.mkdir()
    (run / "config.toml").write_text("[optim]\nnum_queries = 1\n")
    (run / "metrics.jsonl").write_text("")
    job = [
        sys.executable,
        "-c",
        "import sys; print('error: training diverged at step 0: loss nan', file=sys.stderr); "
        f"sys.exit({learning.EXIT_DIVERGED})",
    ]
    with pytest.raises(SystemExit, match="the run race-spsa-lr0.1-seed0 failed"):
        learning.run_job(job, run, 10)  # one lr: a failure is the race's failure
    learning.run_job(job, run, 10, may_diverge=True)
    assert (run / learning.DIVERGED_MARK).read_text().startswith("error: training diverged")
    # read, not re-run: a command that would fail otherwise
    learning.run_job([sys.executable, "-c", "raise SystemExit(3)"], run, 10, may_diverge=True)
    points = learning.race_curve(run)  # it never evaluated
    assert points == []
    fine = [{"forward_passes": 0, "wall_s": 0, "eval_accuracy": 0.5}]
    assert learning.sweep_winner({0.1: points, 1e-5: fine}, [0.6]) == 1e-5


def test_report_only_reads_the_finished_runs_and_starts_none(learning, tmp_path, monkeypatch):
    out = tmp_path / "race.json"
    work = tmp_path / "race-runs"
    fzoo = 'estimator = "fzoo"\nnum_queries = 8'
    # a budget of 90 forward passes is 10 FZOO steps of 9
    write_run(work / "race-fzoo-lr0.001-seed0", fzoo, [0.5, 0.62, 0.66], 1.0, 5)
    write_run(work / "race-fzoo-lr0.001-seed2", fzoo, [0.5, 0.58, 0.61], 1.0, 5)
    for run, steps in (("race-fzoo-lr0.001-seed0", 10), ("race-fzoo-lr0.001-seed2", 10)):
        (work / run / "summary.json").write_text(json.dumps({"steps": steps}))
    write_run(work / "race-fzoo-lr0.001-seed1", fzoo, [0.5], 1.0, 5)  # unfinished: left out
    argv = ["learning.py", "--time-to-accuracy", "--report-only", "--recipes", "fzoo,spsa",
            "--seeds", "0,1,2", "--lrs", "fzoo=1e-3", "--forward-passes", "90",
            "--evaluations", "2", "--out", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(learning.subprocess, "run", None)  # nothing may be launched
    args = learning.parse_args()
    report = learning.BenchReport("learning", "", 1)
    learning.race(args, work, tmp_path / "heldout.tsv", report)
    assert report.derived["seeds[fzoo]"] == 2  # seeds 0 and 2; spsa has no run at all
    assert report.derived["passes_to_0.60[fzoo]"] == (45 + 90) / 2  # the median of 2 seeds
    assert report.derived["reached_0.65[fzoo]"] == 1
    assert not any(key.endswith("[spsa]") for key in report.derived)
    assert out.with_suffix(".png").is_file()
    monkeypatch.setattr(sys, "argv", [*argv[:4], "spsa", *argv[5:]])
    with pytest.raises(SystemExit, match="found no finished run"):
        learning.race(learning.parse_args(), work, tmp_path / "heldout.tsv", report)


def test_the_seed_mean_leaves_out_a_run_that_diverged_before_evaluating(learning):
    def curve(accs):
        return [
            {"forward_passes": 10 * k, "wall_s": k, "eval_accuracy": a} for k, a in enumerate(accs)
        ]

    mean = learning.seed_mean({0: curve([0.5, 0.6, 0.7]), 1: [], 2: curve([0.5, 0.7])})
    assert [p["forward_passes"] for p in mean] == [0, 10]  # to the shortest evaluated run
    assert [p["eval_accuracy"] for p in mean] == pytest.approx([0.5, 0.65])
    assert [(p["low"], p["high"]) for p in mean] == [(0.5, 0.5), (0.6, 0.7)]
    assert learning.seed_mean({0: []}) == []


def test_the_bootstrap_bounds_the_ratio_by_resampling_shared_seeds(learning):
    def curve(accs):
        return [
            {"forward_passes": 50 * k, "wall_s": k, "eval_accuracy": a} for k, a in enumerate(accs)
        ]

    spsa = {s: curve([0.5, 0.6, 0.66, 0.67]) for s in range(5)}  # holds 0.65 from 100
    twice = {s: curve([0.5, 0.66, 0.67, 0.68]) for s in range(5)}  # from 50: 2x, every draw
    out = learning.bootstrap_ratio(spsa, twice, 0.65)
    assert out == {"p05": 2.0, "p95": 2.0, "share_2x": 1.0, "seeds": 5}
    # one seed of five that falls back to 0.40 at the end: a draw with it at all puts the
    # mean's end below 0.65 (ratio 0); (4/5)^5 = a third of the draws leave it out (ratio 2)
    mixed = {**twice, 4: curve([0.5, 0.66, 0.67, 0.40])}
    out = learning.bootstrap_ratio(spsa, mixed, 0.65)
    assert out["p05"] == 0.0 and out["p95"] == 2.0 and 0.28 < out["share_2x"] < 0.38
    assert out == learning.bootstrap_ratio(spsa, mixed, 0.65)  # seeded: the same each time
    # seeds not run by both are not resampled; fewer than 3 shared ones give no interval
    assert learning.bootstrap_ratio(spsa, {0: twice[0], 1: twice[1], 7: twice[2]}, 0.65) is None
    assert learning.bootstrap_ratio(spsa, {**twice, 2: []}, 0.65)["seeds"] == 4
    # neither holding it is no evidence either way: 1
    never = {s: curve([0.5, 0.55]) for s in range(3)}
    assert learning.bootstrap_ratio(never, never, 0.65)["p05"] == 1.0


def test_the_race_reports_the_interval_of_each_ratio_to_spsa(learning, tmp_path, monkeypatch):
    work = tmp_path / "race-runs"
    for seed in range(3):
        for name, optim, accuracies in (
            ("spsa", "num_queries = 1", [0.5, 0.6, 0.66, 0.67]),
            ("lozo", 'estimator = "lozo"', [0.5, 0.66, 0.67, 0.68]),
        ):
            run = write_run(work / f"race-{name}-lr1e-05-seed{seed}", optim, accuracies, 1.0, 5)
            (run / "summary.json").write_text(json.dumps({"steps": 15}))
    argv = ["learning.py", "--time-to-accuracy", "--report-only", "--recipes", "spsa,lozo",
            "--seeds", "0,1,2", "--lrs", "spsa=1e-5,lozo=1e-5", "--forward-passes", "30",
            "--evaluations", "3", "--out", str(tmp_path / "race.json")]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(learning.subprocess, "run", None)
    report = learning.BenchReport("learning", "", 1)
    learning.race(learning.parse_args(), work, tmp_path / "heldout.tsv", report)
    key = "spsa_over_lozo_mean_curve_passes_to_0.65"
    assert report.derived[key] == 2.0  # 20 passes against 10
    assert report.derived[f"{key}_p05"] == report.derived[f"{key}_p95"] == 2.0
    assert report.derived[f"{key}_share_2x"] == 1.0 and report.derived[f"{key}_seeds"] == 3
    assert not any(k.startswith("spsa_over_spsa") for k in report.derived)
