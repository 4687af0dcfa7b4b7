"""bench/lab.py: the quick variants of three grids run end to end (subprocess, --jobs 2) and write a report with the
pre-registered texts, one table row per arm over its seeds and the plots; a second invocation skips finished runs;
--only-report rebuilds the same report from the compact metrics file alone. Plus the interval and comparison helpers."""

import importlib.util
import math
import os
import re
import shutil
from pathlib import Path

import pytest

from conftest import REPO, run

spec = importlib.util.spec_from_file_location("lab", os.path.join(REPO, "bench", "lab.py"))
lab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lab)  # puts bench/ on sys.path
import lab_stats  # noqa: E402


def run_lab(*args):
    out = run("bench/lab.py", *args, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


# The smallest runs that exercise every part. mismatch: one arm over 2 seeds (4 steps each), the runs the skip, resume,
# only-report and set-aside tests reuse, and the interval cells (which need 2 seeds). horizon (a GRPO arm: the
# identical-reward plot) and moe (the routing table and plots): both arms, one seed, for the parts of the report only
# they have and the rows of several arms; credit (sort, a per-task arm, a critic-free arm, verdict_credit's table): both
# arms, one seed. 8 runs.
GRIDS = {"mismatch": (["ppo-int4-icepop"], [0, 1]), "horizon": (None, [0]), "moe": (None, [0]), "credit": (None, [0])}


def selection(grid):
    arms, seeds = GRIDS[grid]
    return [*(["--arms", ",".join(arms)] if arms else []), "--seeds", ",".join(map(str, seeds))]


MISMATCH = ["mismatch", "--quick", *selection("mismatch")]
N_MISMATCH = len(GRIDS["mismatch"][0]) * len(GRIDS["mismatch"][1])  # its runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The quick grids, run once into one runs dir; returns (runs dir, {grid: stdout})."""
    d = tmp_path_factory.mktemp("lab_runs")
    return d, {grid: run_lab(grid, "--quick", "--jobs", "2", "--runs-dir", str(d), *selection(grid)) for grid in GRIDS}


def test_ci95_hand_case():
    mean, hw, n = lab.ci95([1.0, 2.0, 3.0])  # sd 1, t_{0.975, 2} = 4.303
    assert (
        (mean, n) == (2.0, 3)
        and hw == pytest.approx(4.303 / math.sqrt(3), abs=1e-4)
        and hw == pytest.approx(2.484, abs=1e-3)
    )
    assert lab.ci95([5.0])[0] == 5.0 and math.isnan(lab.ci95([5.0])[1])
    assert lab.ci95([float("nan"), 1.0, 3.0])[2] == 2  # NaN values are dropped
    assert lab.ci95([1.0, 2.0, 3.0] * 20)[1] == pytest.approx(
        2.001 * math.sqrt(40 / 59) / math.sqrt(60), rel=2e-3
    )  # beyond the table


def test_compare_needs_both_margin_and_separate_intervals():
    assert lab.compare((60, 2, 5), (50, 2, 5)) == 1 and lab.compare((50, 2, 5), (60, 2, 5)) == -1
    assert lab.compare((60, 4, 5), (54, 4, 5)) == 0  # 6 points apart but the intervals overlap
    assert lab.compare((53, 0.5, 5), (50, 0.5, 5)) == 0  # separate intervals but under 5 points
    assert lab.compare((60, 1, 1), (50, 1, 5)) is None and lab.compare(None, (50, 1, 5)) is None
    stats = {
        "addition": {
            "ppo-bf16-none": {"final_sampled": (70, 1, 5)},
            "ppo-int4-none": {"final_sampled": (60, 1, 5)},
            "ppo-int4-icepop": {"final_sampled": (69, 1, 5)},
        }
    }
    text = "\n".join(lab.verdict_mismatch(stats))
    assert (
        "DEGRADED int4-none" in text and "int4-icepop HELPS over int4-none" in text and "hypothesis supported" in text
    )
    assert "Null result" in "\n".join(
        lab.verdict_mismatch({"addition": {"ppo-bf16-none": {"final_sampled": (70, 1, 5)}}})
    )

    def mt(ppo, grpo):
        return "\n".join(
            lab.verdict_multi_turn({"guess": {"ppo": {"final_greedy": ppo}, "grpo-n4": {"final_greedy": grpo}}})
        )

    assert "PPO BETTER (PPO minus GRPO n4: +10.0 points)" in mt((60, 2, 5), (50, 2, 5)) and "PPO WORSE" in mt(
        (50, 2, 5), (60, 2, 5)
    )
    assert "Null result" in mt((60, 4, 5), (54, 4, 5)) and "not evaluated" in mt((60, 4, 1), (54, 4, 5))

    def gl(gain):
        return "\n".join(
            lab.verdict_guess_learns({"guess": {"ppo": {"gain_greedy": gain, "gain_sampled": (1.0, 2.0, 5)}}})
        )

    assert "RL LEARNS (greedy gain +6.0 ± 5.0" in gl((6.0, 5.0, 5)) and "Null result" in gl(
        (6.0, 7.0, 5)
    )  # interval reaches below 0
    assert "Null result" in gl((4.0, 1.0, 5)) and "not evaluated" in gl((9.0, 1.0, 1))  # under 5 points; one seed
    run = {
        "steps": 2,
        "rows": [
            {"step": 0, "eval/greedy_acc": 0.3, "eval/sampled_acc": 0.4},
            {"step": 2, "eval/greedy_acc": 0.35, "eval/sampled_acc": 0.38},
        ],
    }
    st = lab.run_stats(run)
    assert st["gain_greedy"] == pytest.approx(5.0) and st["gain_sampled"] == pytest.approx(-2.0)


def test_a_failed_run_is_reported_with_its_log_and_does_not_stop_the_others(tmp_path, capsys, monkeypatch):
    fake = tmp_path / "fake_train.py"  # stands in for train_ppo.py: fails on seed 0, finishes on seed 1
    fake.write_text(
        "import json, os, sys\na = dict(zip(sys.argv[1::2], sys.argv[2::2]))\n"
        "if a['--seed'] == '0': sys.exit(print('boom: ' + a['--task']) or 3)\n"
        "open(os.path.join(a['--out-dir'], 'metrics.jsonl'), 'w').write(json.dumps({'step': 2, 'eval/greedy_acc': 0.5}) + '\\n')\n"
    )
    monkeypatch.setattr(lab, "TRAIN", str(fake))
    g = {
        "steps": 2,
        "base": [],
        "arms": {"a": [], "b": {"addition": ["--x", "1"], "sort": ["--y", "2"]}},
    }  # b: flags per task
    jobs = [("addition", "a", 0), ("addition", "b", 0), ("addition", "a", 1), ("sort", "b", 1)]
    failed = lab.run_all(g, str(tmp_path / "runs"), jobs, jobs=2)
    out = capsys.readouterr().out
    assert sorted(failed) == ["addition/a/seed0", "addition/b/seed0"] and "boom: addition" in failed["addition/b/seed0"]
    assert (
        "FAILED addition/a/seed0 (exit 3)" in out
        and "done addition/a/seed1: final greedy acc 50.0%" in out
        and "done sort/b/seed1" in out
    )
    assert lab.finished(str(tmp_path / "runs/sort/b/seed1"), 2) and not lab.finished(
        str(tmp_path / "runs/addition/a/seed0"), 2
    )
    cmds = {
        k: (tmp_path / f"runs/{k}/log.txt").read_text().splitlines()[1]
        for k in ("sort/b/seed1", "addition/b/seed0", "addition/a/seed1")
    }
    assert cmds["sort/b/seed1"].endswith("--task sort --steps 2 --y 2") and cmds["addition/b/seed0"].endswith(
        "--steps 2 --x 1"
    )
    assert cmds["addition/a/seed1"].endswith("--steps 2")


@pytest.mark.lab
@pytest.mark.parametrize("grid", ["mismatch", "horizon", "moe", "credit"])
def test_quick_report(runs, grid):
    d, stdout = runs
    g = lab.grid_spec(grid, quick=True)
    report = d / f"{grid}-quick" / "report.md"
    text = report.read_text()
    assert g["hypothesis"] in text and g["decision_rule"] in text and "## Verdict" in text
    arms, seeds = GRIDS[grid]
    arms, n, task = arms or list(g["arms"]), len(seeds), g["tasks"][0]
    assert len(re.findall(rf"^\[\d/{len(arms) * n}\] done {task}/", stdout[grid], re.MULTILINE)) == len(arms) * n, (
        stdout[grid]
    )
    cell = r"\d+\.\d ± \d+\.\d" if n > 1 else r"\d+\.\d"  # the 95% interval needs 2 seeds
    for arm in arms:  # one row per arm, its seeds, accuracies (with an interval)
        rows = [line for line in text.split("## Verdict")[0].splitlines() if line.startswith(f"| {arm} | {n} | ")]
        assert len(rows) == 1 and re.match(rf"\| {re.escape(arm)} \| {n} \| {cell} \| {cell} \| {cell} \|", rows[0]), (
            text
        )
    images = re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)
    expected = ["accuracy", "k3", "masked", "grad_norm", "ev", "ev_per_position"] + (
        ["identical_reward_groups"] if grid == "horizon" else []
    )
    expected += ["routing", "ratio_tail"] if grid == "moe" else []
    if grid == "moe":  # the routing table: one row per arm
        assert (
            sum(
                bool(re.match(rf"\| {arm} \| \d+\.\d\d% \| \d+\.\d\d% \| ", line))
                for arm in arms
                for line in text.splitlines()
            )
            == 2
        ), text
    if grid == "credit":  # verdict_credit's table (AUC, final, EV) and its comparisons, judged on too few seeds
        assert re.search(
            r"^\| ppo-priv \| 1 \| \d+\.\d \| \d+\.\d \| \d+\.\d \| -?\d\.\d\d / 0\.31 \| - \| - \|$",
            text,
            re.MULTILINE,
        ), text
        assert re.search(
            r"^\| reinforce \| 1 \| \d+\.\d \| \d+\.\d \| \d+\.\d \| - \| - \| - \|$", text, re.MULTILINE
        ), text
        assert (
            "**sort: the oracle is not judged yet**" in text
            and "| ppo-priv | `sort: --algo ppo --critic-context answer` |" in text
        )
        assert "**Not judged**: no comparison has 5 paired seeds yet." in text
    assert {f"report/{task}_{name}.png" for name in expected} <= set(images)
    assert all((report.parent / img).stat().st_size > 1000 for img in images)
    assert (d / f"{grid}-quick" / "report" / "metrics.jsonl.gz").is_file() and (d / ".gitignore").read_text() == "*\n"
    kept = list((d / f"{grid}-quick" / "report" / "start").glob("tiny-*"))  # the start model, kept for another machine
    assert (
        len(kept) == 1
        and lab.start_model(str(kept[0]))
        == lab.load_compact(str(report.parent / "report" / "metrics.jsonl.gz"))[1][0]["start_model"]
    )


@pytest.mark.lab
def test_second_invocation_skips_finished_runs(runs):
    d, _ = runs
    metrics = sorted((d / "mismatch-quick").glob("addition/*/seed*/metrics.jsonl"))
    assert len(metrics) == N_MISMATCH
    before = [(p.stat().st_mtime_ns, p.read_bytes()) for p in metrics]
    out = run_lab(*MISMATCH, "--jobs", "2", "--runs-dir", str(d))
    assert out.count("skip addition/") == N_MISMATCH and "] done " not in out, out
    assert [(p.stat().st_mtime_ns, p.read_bytes()) for p in metrics] == before


@pytest.mark.lab
def test_only_report_rebuilds_from_the_compact_file_alone(runs, tmp_path):
    d, _ = runs
    shutil.copytree(
        d / "mismatch-quick" / "report", tmp_path / "mismatch-quick" / "report", ignore=shutil.ignore_patterns("*.png")
    )
    assert sorted(os.listdir(tmp_path / "mismatch-quick")) == ["report"]  # no run folders
    out = run_lab("mismatch", "--quick", "--only-report", "--runs-dir", str(tmp_path))
    assert f"{N_MISMATCH} finished runs" in out, out
    rebuilt = (tmp_path / "mismatch-quick" / "report.md").read_text()
    assert rebuilt == (d / "mismatch-quick" / "report.md").read_text()
    assert (tmp_path / "mismatch-quick" / "report" / "addition_accuracy.png").is_file()


@pytest.mark.lab
def test_runs_in_the_compact_file_are_not_rerun_on_a_fresh_machine(runs, tmp_path):
    """A grid resumed where only the committed report exists (the run folders were on another machine) trains nothing."""
    d, _ = runs
    shutil.copytree(d / "mismatch-quick" / "report", tmp_path / "mismatch-quick" / "report")
    out = run_lab(*MISMATCH, "--jobs", "2", "--runs-dir", str(tmp_path))
    assert (
        out.count("(finished: in the compact metrics file)") == N_MISMATCH
        and "] done " not in out
        and f"{N_MISMATCH} finished runs" in out
    ), out
    assert not list((tmp_path / "mismatch-quick").glob("addition/*/seed*"))
    tables = [(p / "mismatch-quick" / "report.md").read_text().split("## addition")[1] for p in (tmp_path, d)]
    assert tables[0] == tables[1]


def test_start_model_fingerprint(tmp_path):
    assert (
        lab.start_model(str(tmp_path)) is None
        and lab.start_model(None) is None
        and lab.start_model(str(tmp_path / "gone")) is None
    )
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    (tmp_path / "config.json").write_text("{}")  # not part of the fingerprint
    assert lab.start_model(str(tmp_path)) == "ba7816bf8f01cfea"  # sha256("abc")


def test_the_start_model_is_kept_with_the_grid_and_restored_into_a_fresh_cache(tmp_path, monkeypatch):
    """A grid keeps its start model (report folder/start/<cache name>) when its runs start; a machine whose cache lacks
    it gets that copy, not a rebuild (which can round differently); a cache holding another build is refused."""
    import data.tiny

    builds = []

    def build(cache, task, arch):  # stands in for the minutes-long build: each build's weights differ
        path = data.tiny.default_model_path(cache, task=task, arch=arch)
        if not os.path.isdir(path):
            os.makedirs(path)
            (Path(path) / "model.safetensors").write_bytes(f"build {len(builds)}".encode())
            builds.append(path)
        return path

    monkeypatch.setattr(data.tiny, "default_model", build)
    g, keep = {"base": []}, str(tmp_path / "report")
    first = lab.default_start_model(g, "walk", keep, str(tmp_path / "cache1"))
    lab.keep_start_model(first, keep)
    fp = lab.start_model(first)
    assert len(builds) == 1 and lab.start_model(os.path.join(keep, "start", os.path.basename(first))) == fp
    second = lab.default_start_model(
        g, "walk", keep, str(tmp_path / "cache2")
    )  # a fresh machine: restored, not rebuilt
    assert len(builds) == 1 and lab.start_model(second) == fp and second != first
    assert lab.start_model(build(str(tmp_path / "cache3"), "walk", "dense")) != fp  # a machine with its own build
    with pytest.raises(SystemExit, match="holds another build of the start model"):
        lab.default_start_model(g, "walk", keep, str(tmp_path / "cache3"))


@pytest.mark.lab
def test_runs_from_another_start_model_are_refused_then_set_aside(runs, tmp_path):
    """Stored runs that started from another build of the start model are never mixed with new ones."""
    d, _ = runs
    shutil.copytree(d / "mismatch-quick" / "report", tmp_path / "mismatch-quick" / "report")
    compact = tmp_path / "mismatch-quick" / "report" / "metrics.jsonl.gz"
    meta, stored = lab.load_compact(str(compact))
    assert (
        len({r["start_model"] for r in stored}) == 1 and stored[0]["start_model"]
    )  # every run fingerprinted, one model
    stored[0]["start_model"] = "0" * 16
    lab.save_compact(str(compact), meta, stored)
    out = run("bench/lab.py", *MISMATCH, "--runs-dir", tmp_path)
    assert (
        out.returncode != 0
        and "1 stored run(s) of mismatch started from another build of the start model" in out.stderr
    ), out.stderr
    assert not list((tmp_path / "mismatch-quick").glob("addition/*/seed*"))  # refused before any run started
    out = run_lab(*MISMATCH, "--jobs", "1", "--runs-dir", str(tmp_path), "--set-aside")
    assert (
        "set aside 1 stored run(s)" in out
        and out.count("] done ") == 1
        and out.count("(finished: in the compact metrics file)") == N_MISMATCH - 1
    ), out
    assert [r["start_model"] for r in lab.load_compact(str(compact.parent / "set-aside.jsonl.gz"))[1]] == ["0" * 16]
    text = (tmp_path / "mismatch-quick" / "report.md").read_text()
    assert f"{N_MISMATCH} finished runs" in out and "1 earlier run(s) that started from another build" in text
    assert len({r["start_model"] for r in lab.load_compact(str(compact))[1]}) == 1


def test_guess_learns_300_is_judged_only_with_all_five_seeds():
    def stats(n):
        return {"guess": {"ppo": {"gain_greedy": (6.0, 2.0, n), "gain_sampled": (1.0, 1.0, n)}}}

    assert "not evaluated" in lab.VERDICTS["guess-learns-300"](stats(4))[0]
    assert "RL LEARNS" in lab.VERDICTS["guess-learns-300"](stats(5))[0]
    assert "RL LEARNS" in lab.VERDICTS["guess-learns-rep"](stats(2))[0]  # the earlier grids keep their 2-seed floor


def test_auc_is_the_trapezoid_mean_success_from_step_0():
    rows = [
        {"step": 0, "eval/sampled_acc": 0.2},
        {"step": 5},
        {"step": 10, "eval/sampled_acc": 0.4},
        {"step": 40, "eval/sampled_acc": 0.1},
    ]
    assert lab.auc(rows, "eval/sampled_acc", 40) == pytest.approx(
        100 * (10 * 0.3 + 30 * 0.25) / 40
    )  # 26.25: uneven steps weighted
    assert lab.auc(rows[:1] + rows[-1:], "eval/sampled_acc", 40) == pytest.approx(15.0)
    with pytest.raises(ValueError, match="step 0 and at the last step 40"):  # no evaluation at step 0
        lab.auc(rows[2:], "eval/sampled_acc", 40)
    with pytest.raises(ValueError, match="last step 50"):  # the curve stops before the run's last step
        lab.auc(rows, "eval/sampled_acc", 50)


def test_paired_differences_and_their_verdict():
    d, c = lab_stats.paired({0: 10.0, 1: 12.0, 2: 14.0, 3: 9.0}, {0: 8.0, 1: 9.0, 2: 10.0, 4: 50.0, 3: float("nan")})
    assert (
        d == {0: 2.0, 1: 3.0, 2: 4.0} and c[0] == 3.0 and c[2] == 3 and c[1] == pytest.approx(4.303 / math.sqrt(3))
    )  # sd 1
    assert lab_stats.judge(c, points=2.0, need=3) == "BETTER" and lab_stats.judge(c, points=2.0, need=5) == "NOT JUDGED"
    assert lab_stats.judge((-3.0, 1.0, 5)) == "WORSE" and lab_stats.judge((-3.0, 3.5, 5)) == "NULL" == lab_stats.judge(
        (3.0, 3.5, 5)
    )  # interval reaches 0
    assert (
        lab_stats.judge((1.9, 0.5, 5)) == "NULL" and lab_stats.judge((2.0, 1.9, 5)) == "BETTER"
    )  # under `points`; at it


def credit_run(seed, y0, y5, y10, **train):
    """A hand-made 10-step run: held-out success (sampled = greedy) y0, y5, y10 at steps 0, 5, 10, so its AUC is
    25 * (y0 + 2 * y5 + y10) points; train: {metric: value at steps 1-8, value at steps 9-10 (the last 20%)}."""
    rows = [{"step": 0, "eval/sampled_acc": y0, "eval/greedy_acc": y0}]
    for s in range(1, 11):
        rows.append({"step": s, **{k: v[s >= 9] for k, v in train.items()}})
        if s in (5, 10):
            rows[-1].update({"eval/sampled_acc": y5 if s == 5 else y10, "eval/greedy_acc": y5 if s == 5 else y10})
    return {"seed": seed, "steps": 10, "rows": rows}


def credit_stats():
    """walk: vine +5 over reinforce (BETTER); ppo over reinforce +1.5 by AUC (NULL) but +6 at the end (BETTER, secondary);
    ppo-priv on 4 seeds only (NOT JUDGED); ppo over grpo-n8 +5.5 by AUC (BETTER). sort: vine = reinforce (NULL, the
    oracle fails) and ppo +8 over reinforce (BETTER, but uninformative)."""
    b = {s: 0.30 + 0.01 * s for s in range(5)}
    j = {s: 0.002 * (s - 2) for s in range(5)}  # paired jitter: differences 4.6, 4.8, 5.0, 5.2, 5.4 points around +5

    def flat(y):
        return (y, y, y)

    walk = {
        "reinforce": [credit_run(s, *flat(b[s])) for s in b],
        "vine": [
            credit_run(
                s,
                *flat(b[s] + 0.05 + j[s]),
                **{"vine/explained_variance": (0.6, 0.6), "vine/extra_token_ratio": (3.0, 3.0)},
            )
            for s in b
        ],
        "ppo": [credit_run(s, b[s], b[s], b[s] + 0.06 + j[s], **{"critic/explained_variance": (0.1, 0.4)}) for s in b],
        "ppo-priv": [credit_run(s, *flat(b[s] + 0.2)) for s in range(4)],
        "grpo-n8": [
            credit_run(s, *flat(b[s] - 0.04 - j[s]), **{"grpo/identical_reward_frac": (0.25, 0.25)}) for s in b
        ],
    }
    sort = {
        "reinforce": [credit_run(s, *flat(b[s])) for s in b],
        "vine": [credit_run(s, *flat(b[s] + 0.01 * (s - 2))) for s in b],
        "ppo": [credit_run(s, *flat(b[s] + 0.08 + j[s])) for s in b],
    }
    return {task: {a: lab.arm_stats(rs) for a, rs in arms.items()} for task, arms in (("walk", walk), ("sort", sort))}


def test_verdict_credit_on_hand_made_runs(tmp_path):
    (tmp_path / "walk.json").write_text('{"perfect": 0.55, "prompt_only": 0.1}')
    text = "\n".join(
        lab.verdict_credit(
            credit_stats(),
            points=2.0,
            need=5,
            ceilings={"walk": str(tmp_path / "walk.json"), "sort": str(tmp_path / "absent.json")},
        )
    )
    walk, sort = text.split("### sort")
    auc, final = "AUC of held-out sampled success", "final sampled success (secondary)"
    assert (
        f"(1) vine vs reinforce, {auc}: **BETTER** (paired difference +5.0 ± 0.4 points over 5 seeds)" in walk
    )  # sd 0.316, t 2.776
    assert (
        f"(2) ppo vs reinforce, {auc}: **NULL** (paired difference +1.5 ± " in walk
    )  # 25 * 0.06: AUC, not the final value
    assert f"(2) ppo vs reinforce, {final}: **BETTER** (paired difference +6.0 ± " in walk
    assert f"(3) ppo-priv vs ppo, {auc}: **NOT JUDGED** (paired difference +18.5 ± " in walk and "over 4 seeds)" in walk
    assert (
        f"(4) ppo vs grpo-n8, {auc}: **BETTER** (paired difference +5.5 ± 0.5 points over 5 seeds)" in walk
    )  # 1.5 + 4 + 125 j
    assert "cannot show" not in walk and "uninformative" not in walk
    assert (
        "| vine | 5 | 37.0 | 37.0 | 37.0 | 0.60 / 0.55 | - | 3.00 |" in walk
        and "| ppo | 5 | 33.5 | 33.5 | 38.0 | 0.40 / 0.55 | - | - |" in walk
    )
    assert (
        "| grpo-n8 | 5 | 28.0 | 28.0 | 28.0 | - | 25.0% | - |" in walk
        and "exact one for walk): 0.55; prompt-only 0.10" in walk
    )
    assert re.search(
        r"\(1\) vine vs reinforce, AUC [^\n]*: \*\*NULL\*\* \(paired difference [+-]0\.0 ± 2\.0 points over 5 seeds\)",
        sort,
    )  # sd 1.58
    assert f"(4) ppo vs grpo-n8, {auc}: **NOT JUDGED** (no seeds finished in both arms), uninformative" in sort
    assert "**sort cannot show a credit effect**" in sort and "exact one for walk): not measured." in sort
    assert (
        f"(2) ppo vs reinforce, {auc}: **BETTER** (paired difference +8.0 ± 0.4 points over 5 seeds), uninformative"
        in sort
    )
    assert sort.strip().endswith(
        "Decisive comparisons (primary endpoint, informative tasks): walk: vine BETTER than reinforce; "
        "walk: ppo BETTER than grpo-n8."
    )
    null = "\n".join(lab.verdict_credit({"sort": credit_stats()["sort"]}))
    assert "**sort cannot show a credit effect**" in null and null.endswith(
        "**Null result**: no informative comparison on the primary endpoint is BETTER or WORSE."
    )
    registered = "\n".join(
        lab.VERDICTS["credit"](credit_stats())
    )  # the registered grid reads its committed ceiling files
    assert "not measured" not in registered and "(`docs/lab/credit/ceiling_walk.json`)" in registered
    few = "\n".join(lab.verdict_credit({"sort": credit_stats()["sort"]}, need=6))
    assert "**sort: the oracle is not judged yet**" in few and few.endswith(
        "**Not judged**: no comparison has 6 paired seeds yet."
    )


def test_flags_per_task_and_an_unregistered_grid(monkeypatch):
    g = lab.grid_spec("credit", quick=False)
    assert lab.arm_flags(g, "ppo-priv", "walk")[-2:] == ["--critic-context", "env"] and lab.arm_flags(
        g, "ppo", "sort"
    ) == ["--algo", "ppo"]
    assert (
        lab.flags_text(g["arms"]["ppo-priv"], g["tasks"])
        == "walk: --algo ppo --critic-context env; sort: --algo ppo --critic-context answer"
    )
    q = lab.grid_spec("credit", quick=True)
    assert q["tasks"] == ["sort"] and list(q["arms"]) == ["reinforce", "ppo-priv"]
    cmd = lab.run_command(g, "walk", "ppo-priv", 3, "d")  # base flags, then the task's, then the arm's
    assert cmd[2:10] == ["--out-dir", "d", "--seed", "3", "--task", "walk", "--steps", "40"]
    assert cmd[10:] == g["base"] + ["--lr", "6e-4", "--algo", "ppo", "--critic-context", "env"]
    assert lab.run_command(g, "sort", "vine", 0, "d")[-6:] == ["--lr", "2e-4", "--algo", "vine", "--vine-k", "4"]
    assert all(lab.unregistered(lab.GRIDS[n]) == [] for n in lab.GRIDS)
    assert all(
        lab.grid_spec(n, quick) for n in lab.GRIDS for quick in (False, True)
    )  # every arm covers its grid's tasks
    draft = {**lab.GRIDS["credit"], "hypothesis": f"{lab.TODO}: to write", "steps": {"walk": lab.TODO, "sort": 40}}
    monkeypatch.setitem(lab.GRIDS, "draft", draft)
    assert lab.unregistered(lab.grid_spec("draft", quick=True)) == ["hypothesis"]
    monkeypatch.setattr(lab.sys, "argv", ["lab.py", "draft"])
    with pytest.raises(SystemExit, match="grid draft is not registered: hypothesis, steps still hold TODO"):
        lab.main()
    monkeypatch.setitem(lab.GRIDS, "broken", {**lab.GRIDS["credit"], "arms": {"x": {"walk": []}}})
    with pytest.raises(ValueError, match=r"arm x has no flags for task\(s\) \['sort'\]"):
        lab.grid_spec("broken", quick=False)


def test_fisher_exact_collapse_step_and_survival_by_hand():
    # [[8, 2], [1, 9]]: p = 0.005477 (R: fisher.test(matrix(c(8, 1, 2, 9), 2)))
    assert lab.fisher_exact(8, 2, 1, 9) == pytest.approx(0.005477, abs=1e-6)
    assert lab.fisher_exact(5, 5, 5, 5) == pytest.approx(1.0) and lab.fisher_exact(10, 0, 0, 10) == pytest.approx(
        2 / 184756
    )
    assert lab.fisher_exact(0, 10, 0, 10) == 1.0  # nothing collapsed anywhere
    rows = [
        {"step": 0, "acc": 0.40},
        {"step": 10, "acc": 0.35},
        {"step": 20, "acc": 0.29},
        {"step": 30, "acc": 0.45},
        {"step": 5, "x": 1},
    ]
    assert lab.collapse_step(rows, "acc", 0.10) == 20 and lab.collapse_step(rows, "acc", 0.2) is None
    assert (
        lab.collapse_step(rows, "acc", 0.2, nonfinite_step=17) == 17
        and lab.collapse_step(rows, "acc", 0.10, nonfinite_step=27) == 20
    )
    with pytest.raises(ValueError, match="at step 0"):
        lab.collapse_step(rows[1:], "acc", 0.1)
    assert lab.survival([None, 20, 10, None], [0, 10, 20, 30]) == [1.0, 0.75, 0.5, 0.5]
    ess = [{"step": s, "e": v} for s, v in ((1, 0.9), (2, 0.6), (3, 0.4), (4, 0.8))]
    assert (
        lab.first_crossing(ess, "e", 0.5) == 3
        and lab.first_crossing(ess, "e", 0.85, below=False) == 1
        and lab.first_crossing(ess, "e", 0.1) is None
    )


def test_verdict_collapse_on_hand_made_runs():
    """none collapses in 8 of 10 seeds (after its ESS fell), icepop in 1, tis in 6: control HOLDS, icepop PREVENTS
    (p = 0.0055), tis NULL; a stopped run counts at its non-finite step."""
    spec = {
        "key": "eval/greedy_acc",
        "margin": 0.10,
        "ess": 0.5,
        "logk": 2.0,
        "control": "none",
        "control_share": 0.6,
        "pairs": [("icepop", "none"), ("tis", "none")],
        "alpha": 0.05,
        "need": 5,
    }

    def run(seed, collapse_at=None, nonfinite=None):
        rows = [{"step": 0, "eval/greedy_acc": 0.4, "eval/sampled_acc": 0.3}] + [
            {
                "step": s,
                "mismatch/seq_ess": 0.3 if collapse_at and s >= collapse_at - 5 else 0.9,
                "mismatch/abs_diff_max": 1.0,
            }
            for s in range(1, 41)
        ]
        rows += [
            {"step": s, "eval/greedy_acc": 0.1 if collapse_at and s >= collapse_at else 0.45, "eval/sampled_acc": 0.3}
            for s in (10, 20, 30, 40)
        ]
        return {"seed": seed, "steps": 40, "rows": sorted(rows, key=lambda r: r["step"]), "nonfinite_step": nonfinite}

    arms = {
        "none": [run(s, 20 if s < 7 else None) for s in range(10)],
        "icepop": [run(s, 30 if s == 0 else None) for s in range(10)],
        "tis": [run(s, 10 if s < 6 else None) for s in range(10)],
    }
    arms["none"][9] = run(9, None, nonfinite=17)
    arms["none"][9]["rows"] = [r for r in arms["none"][9]["rows"] if r["step"] <= 17]
    stats = {"addition": {a: lab.arm_stats(rs, spec) for a, rs in arms.items()}}
    text = "\n".join(lab.verdict_collapse(stats, spec))
    assert "| none | 10 | 8 | 20, 20, 20, 20, 20, 20, 20, 17 | 7 of 8 | 0 of 8 |" in text
    assert "positive control (none collapses in >= 60% of its seeds): **HOLDS**" in text
    assert "- icepop vs none: **PREVENTS** (collapsed 1 of 10 against 8 of 10; Fisher's exact p = 0.00548)" in text
    assert "- tis vs none: **NULL**" in text and text.endswith(
        "Decisive comparisons: addition: icepop PREVENTS collapse against none."
    )
    few = "\n".join(
        lab.verdict_collapse({"addition": {a: lab.arm_stats(rs[:3], spec) for a, rs in arms.items()}}, spec)
    )
    assert "NOT JUDGED (too few seeds)" in few and "icepop vs none: NOT JUDGED (3 and 3 seeds; 5 needed)" in few
    assert few.endswith("**Not judged**: no comparison has enough seeds yet.")


def test_verdict_collapse_secondary_margins_by_hand():
    """With spec["secondary"] the pairs are counted again at each margin, beside (not in) the decision: icepop's three
    7-point drops count at 5 points and not at 10; at 25 points only none's 30-point drops do."""
    spec = {
        "key": "eval/greedy_acc",
        "margin": 0.10,
        "secondary": [0.05, 0.25],
        "ess": 0.5,
        "logk": 2.0,
        "control": "none",
        "control_share": 0.6,
        "pairs": [("icepop", "none")],
        "alpha": 0.05,
        "need": 5,
    }

    def run(seed, drop=0.0):
        rows = [{"step": 0, "eval/greedy_acc": 0.4, "eval/sampled_acc": 0.3}]
        rows += [{"step": s, "mismatch/seq_ess": 0.9, "mismatch/abs_diff_max": 1.0} for s in range(1, 21)]
        rows += [{"step": s, "eval/greedy_acc": 0.4 - drop, "eval/sampled_acc": 0.3} for s in (10, 20)]
        return {"seed": seed, "steps": 20, "rows": sorted(rows, key=lambda r: r["step"]), "nonfinite_step": None}

    arms = {
        "none": [run(s, 0.3 if s < 8 else 0.0) for s in range(10)],
        "icepop": [run(s, 0.07 if s < 3 else 0.0) for s in range(10)],
    }
    text = "\n".join(lab.verdict_collapse({"t": {a: lab.arm_stats(rs, spec) for a, rs in arms.items()}}, spec))
    assert "- icepop vs none: **PREVENTS** (collapsed 0 of 10 against 8 of 10" in text
    assert (
        "- secondary, not decisive: at a margin of 5 points, collapsed icepop 3 of 10, none 8 of 10; icepop vs none "
        f"p = {lab.fisher_exact(3, 7, 8, 2):.3g}" in text
    )
    assert "at a margin of 25 points, collapsed icepop 0 of 10, none 8 of 10" in text
    assert text.endswith("Decisive comparisons: t: icepop PREVENTS collapse against none.")


def test_verdict_credit_b16_manipulation_check_by_hand():
    """credit-b16's verdict: the credit rule on its five pairs (the K = 16 oracle first), then the pre-fitted critic's
    check: with ppo-fit's early EV at 0.5 it HOLDS and ppo-fit's wins are decisive; at 0.1 it FAILS and they leave."""

    def run(seed, gain, ev=None):
        rows = [{"step": 0, "eval/greedy_acc": 0.4, "eval/sampled_acc": 0.4}]
        rows += [{"step": s, **({"critic/explained_variance": ev} if ev is not None else {})} for s in range(1, 41)]
        noise = 0.004 * (seed % 3)  # paired differences that vary a little between seeds
        for s in (10, 20, 30, 40):
            acc = 0.4 + (gain + noise) * s / 40
            rows.append({"step": s, "eval/greedy_acc": acc, "eval/sampled_acc": acc})
        return {"seed": seed, "steps": 40, "rows": sorted(rows, key=lambda r: r["step"]), "nonfinite_step": None}

    def verdict(fit_ev):
        gains = {"reinforce": 0.10, "vine-k16": 0.25, "vine-k4": 0.18, "ppo-fit": 0.25, "ppo": 0.10}
        stats = {
            "walk": {
                a: lab.arm_stats(
                    [run(s, g, fit_ev if a == "ppo-fit" else 0.0 if a == "ppo" else None) for s in range(6)]
                )
                for a, g in gains.items()
            }
        }
        return "\n".join(lab.verdict_credit_b16(stats))

    held = verdict(0.5)
    assert "- (1) vine-k16 vs reinforce, AUC of held-out sampled success: **BETTER**" in held
    assert "- (5) ppo-fit vs ppo, AUC of held-out sampled success: **BETTER**" in held
    assert "median of 6 seeds): 0.50 against 0.30: **HOLDS**." in held and "ppo-fit BETTER than reinforce" in held
    failed = verdict(0.1)
    assert "0.10 against 0.30: **FAILS**: comparisons 3 and 5 do not test a pre-fitted critic" in failed
    decisive = next(line for line in failed.splitlines() if line.startswith("Decisive comparisons"))
    assert "vine-k16 BETTER than reinforce" in decisive and "ppo-fit" not in decisive
