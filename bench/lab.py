"""The lab: run a named grid of train_ppo.py configurations x seeds, then write a report.

    .venv/bin/python bench/lab.py mismatch --arms core    # the core arms first (all seeds); rerun to resume
    .venv/bin/python bench/lab.py mismatch                # the whole grid (finished runs are skipped)
    .venv/bin/python bench/lab.py horizon --quick         # smoke run: 2 seeds, 2 arms, 4 steps; report under lab_runs/
    .venv/bin/python bench/lab.py multi-turn              # --task guess: PPO with a critic vs GRPO, 5 seeds
    .venv/bin/python bench/lab.py credit --quick          # smoke run of issue 22's credit grid (refused without --quick until registered)
    .venv/bin/python bench/lab.py mismatch --only-report  # rebuild docs/lab/mismatch.md, e.g. from docs/lab/mismatch/metrics.jsonl.gz

Each (task, arm, seed) is a normal run folder <runs-dir>/<grid>/<task>/<arm>/seed<k> written by one single-process
train_ppo.py (its output in log.txt); --jobs of them run at once. A run is finished when its metrics.jsonl has an
evaluation row at the last step; any other is relaunched, and train_ppo.py resumes it from its last checkpoint (one
stopped before its first checkpoint starts over: clear_unsaved). The report (docs/lab/<grid>.md; PNGs and the compact
metrics in docs/lab/<grid>/) opens with the grid's hypothesis and decision rule, written below before the grid was
run: never edit them after seeing results; add a new grid instead.
"""

import argparse
import gzip
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/, when imported from elsewhere (tests)
from lab_stats import (  # noqa: E402
    NAN,
    auc,
    ci95,
    collapse_step,
    finite,
    first_crossing,
    fisher_exact,
    survival,
    verdict_credit,
)

ALGOS = {"ppo": ["--algo", "ppo"], "grpo": ["--algo", "grpo", "--n-samples", "8"]}
MISMATCH_ARMS = {  # appended to each algorithm's flags: arm "<algo>-<label>"
    "bf16-none": ["--engine-dtype", "bf16", "--correction", "none"],
    "int4-none": ["--engine-dtype", "int4", "--correction", "none"],
    "int4-tis": ["--engine-dtype", "int4", "--correction", "tis"],
    "int4-icepop": ["--engine-dtype", "int4", "--correction", "icepop"],
    "int4-geo": ["--engine-dtype", "int4", "--correction", "geo"],
    "kvfp8-none": ["--engine-dtype", "bf16", "--kv-cache-dtype", "fp8", "--correction", "none"],
    "kvfp8-icepop": ["--engine-dtype", "bf16", "--kv-cache-dtype", "fp8", "--correction", "icepop"],
    "int4-none-mb4": [
        "--engine-dtype",
        "int4",
        "--correction",
        "none",
        "--minibatches",
        "4",
    ],  # 4 optimiser steps per batch
    "int4-icepop-mb4": ["--engine-dtype", "int4", "--correction", "icepop", "--minibatches", "4"],
}
MOE_ARMS = {  # the tiny MoE (--tiny moe); appended to each algorithm's flags: arm "<algo>-<label>"
    "bf16-none": ["--engine-dtype", "bf16", "--correction", "none"],
    **{
        f"kvfp8-{c}": ["--engine-dtype", "bf16", "--kv-cache-dtype", "fp8", "--correction", c]
        for c in ("none", "tis", "icepop", "dis")
    },
    "kvfp8-replay": ["--engine-dtype", "bf16", "--kv-cache-dtype", "fp8", "--correction", "none", "--routing-replay"],
}
# --quick: 2 seeds, addition only, 2 arms, 4 steps of 16 completions, 50 evaluation problems, 2 critic pretraining steps
QUICK = {
    "seeds": [0, 1],
    "tasks": ["addition"],
    "steps": 4,
    "base": [
        "--rollout-batch",
        "16",
        "--eval-every",
        "2",
        "--eval-size",
        "50",
        "--save-every",
        "25",
        "--critic-pretrain",
        "2",
    ],
}
GRIDS = {
    "mismatch": {
        "hypothesis": "An int4 rollout engine (and, less so, an fp8 KV cache) against the fp32 trainer raises the train-inference mismatch "
        "(k3) well above the bf16 engine's, and without a correction this lowers the final held-out sampled accuracy relative to bf16-none. "
        "Token-level correction (IcePop; also TIS and the geometric sequence mask) recovers most of that loss. Both the loss and the "
        "recovery are larger when later minibatches are off-policy (--minibatches 4). This holds for PPO with a learned critic and for "
        "GRPO with 8 samples per prompt.",
        "decision_rule": "Primary endpoint: held-out sampled accuracy at the last step (all 3000 test problems, sampled by an fp32 copy of the "
        "policy, --eval-dtype fp32, so int4 arms are judged on the policy they trained, not on its quantised copy), one value per seed; 95% t-interval "
        "of the seed mean; each task and algorithm judged separately. (1) An arm is DEGRADED if its mean is at least 5 points below "
        "<algo>-bf16-none's and the two intervals do not overlap. (2) A correction HELPS if its arm's mean is at least 5 points above the "
        "uncorrected arm's with the same engine and minibatches (int4-tis, int4-icepop, int4-geo vs int4-none; kvfp8-icepop vs "
        "kvfp8-none; int4-icepop-mb4 vs int4-none-mb4) and the intervals do not overlap; it HURTS if at least 5 points below with "
        "non-overlapping intervals. The hypothesis is supported for a task and algorithm if int4-none is DEGRADED and int4-icepop HELPS "
        "over it (or the same for the -mb4 pair). A comparison with fewer than 2 finished seeds in either arm is not evaluated. "
        "Anything else is a null result for that comparison.",
        "tasks": ["addition", "sort"],
        "seeds": [0, 1, 2, 3, 4],
        "steps": {"addition": 80, "sort": 80},  # set before running, never after seeing results
        "base": [
            "--rollout-batch",
            "64",
            "--eval-every",
            "20",
            "--eval-size",
            "3000",
            "--eval-dtype",
            "fp32",
            "--save-every",
            "20",
            "--keep-checkpoints",
            "1",
        ],
        "arms": {f"{algo}-{label}": ALGOS[algo] + flags for algo in ALGOS for label, flags in MISMATCH_ARMS.items()},
        "core": [
            f"{algo}-{label}" for algo in ALGOS for label in ("bf16-none", "int4-none", "int4-icepop", "int4-tis")
        ],
        "split_by_algo": True,  # plots: one column of axes per algorithm
        "quick": {**QUICK, "arms": ["ppo-int4-none", "ppo-int4-icepop"]},
    },
    "horizon": {
        "hypothesis": "At equal completions per step (64) and equal steps, PPO with a learned critic reaches a higher final held-out greedy "
        "accuracy than GRPO with 4 or 8 samples per prompt: token-level GAE assigns credit within every completion, while GRPO gets no "
        "signal from groups whose rewards are all equal. The advantage is larger on sort (longer responses) than on addition. PPO runs "
        "with train_ppo.py's default critic pretraining (critic-only steps on the start policy before step 1, until the critic's "
        "explained variance plateaus); those rollouts are not counted in the equal budget.",
        "decision_rule": "Primary endpoint: held-out greedy accuracy at the last step (all 3000 test problems, fp32 copy of the policy), one value per seed (5 seeds); 95% "
        "t-interval of the seed mean; each task judged separately. PPO is BETTER if its mean is at least 5 points above the mean of each "
        "GRPO arm (grpo-n4, grpo-n8) and its interval overlaps neither; PPO is WORSE if its mean is at least 5 points below each GRPO "
        "arm's and its interval overlaps neither; otherwise the task is a null result. 'Larger on sort' holds only if PPO is BETTER on "
        "sort and its margin over the better GRPO arm is larger on sort than on addition. Arms with fewer than 2 finished seeds are not "
        "evaluated.",
        "tasks": ["sort", "addition"],
        "seeds": [0, 1, 2, 3, 4],
        "steps": {"sort": 80, "addition": 80},  # set before running, never after seeing results
        "base": [
            "--rollout-batch",
            "64",
            "--engine-dtype",
            "bf16",
            "--correction",
            "icepop",
            "--eval-every",
            "20",
            "--eval-size",
            "3000",
            "--eval-dtype",
            "fp32",
            "--save-every",
            "20",
            "--keep-checkpoints",
            "1",
        ],
        "arms": {
            "ppo": ["--algo", "ppo"],
            "grpo-n4": ["--algo", "grpo", "--n-samples", "4"],
            "grpo-n8": ["--algo", "grpo", "--n-samples", "8"],
        },
        "core": ["ppo", "grpo-n4", "grpo-n8"],
        "quick": {**QUICK, "arms": ["ppo", "grpo-n4"]},
    },
    "multi-turn": {
        "hypothesis": "On --task guess (up to 6 turns, reward 1 only when the secret is found, about 85% of each row's tokens are "
        "observations), at equal episodes per step (64) and equal steps, PPO with a pretrained critic reaches a higher final held-out "
        "greedy success rate than GRPO with 4 episodes per prompt: the critic gives every turn its own baseline, while GRPO's advantage "
        "is one number per episode and vanishes in groups whose episodes all win or all lose. PPO runs with train_ppo.py's default "
        "critic pretraining; those rollouts are not counted in the equal budget.",
        "decision_rule": "Primary endpoint: held-out greedy success rate at the last step (500 test problems, whose ranges never occur in "
        "train), one value per seed (5 seeds); 95% t-interval of the seed mean. PPO is BETTER if its mean is at least 5 points above "
        "grpo-n4's and the two intervals do not overlap; PPO is WORSE if at least 5 points below with non-overlapping intervals; "
        "otherwise a null result. Arms with fewer than 2 finished seeds are not evaluated.",
        "tasks": ["guess"],
        "seeds": [0, 1, 2, 3, 4],
        "steps": {"guess": 60},  # set before running, never after seeing results
        "base": [
            "--rollout-batch",
            "64",
            "--engine-dtype",
            "fp32",
            "--eval-every",
            "20",
            "--eval-size",
            "500",
            "--save-every",
            "20",
            "--keep-checkpoints",
            "1",
        ],
        "arms": {"ppo": ["--algo", "ppo"], "grpo-n4": ["--algo", "grpo", "--n-samples", "4"]},
        "core": ["ppo", "grpo-n4"],
        "quick": {**QUICK, "tasks": ["guess"], "base": QUICK["base"] + ["--engine-dtype", "fp32"]},
    },
    "guess-learns": {
        "hypothesis": "On --task guess, IcePop PPO with a pretrained critic (runs/cpu_guess.sh's settings, one process) raises the "
        "held-out greedy success rate of the warmed-up tiny model within 150 steps of 64 episodes (about 30 CPU-minutes per seed on "
        "one core of this machine).",
        "decision_rule": "Primary endpoint: the gain of held-out greedy success (500 test problems, whose ranges never occur in train) "
        "from step 0 to step 150, one value per seed (5 seeds); 95% t-interval of the seed mean. RL LEARNS if the mean gain is at "
        "least 5 points and the interval excludes 0; otherwise a null result. Secondary (reported, not decisive): the same gain of "
        "the sampled success rate.",
        "tasks": ["guess"],
        "seeds": [0, 1, 2, 3, 4],
        "steps": {"guess": 150},  # set before running, never after seeing results
        "base": [
            "--rollout-batch",
            "64",
            "--engine-dtype",
            "fp32",
            "--max-turns",
            "6",
            "--eval-every",
            "50",
            "--eval-size",
            "500",
            "--save-every",
            "25",
            "--keep-checkpoints",
            "1",
        ],
        "arms": {"ppo": ["--algo", "ppo"]},
        "core": ["ppo"],
        "quick": {**QUICK, "tasks": ["guess"], "base": QUICK["base"] + ["--engine-dtype", "fp32"]},
    },
}
# Written 2026-12-02, after 8 moe and 2 guess-learns-rep runs had finished and before any further run.
REBUILT = (
    "The start model cannot be rebuilt bit for bit: its warm-up depended on the torch thread count of whichever "
    "process built it first, and neither 1 nor 2 threads reproduces the build those runs used. data/tiny.py now builds with a "
    "fixed 2 threads (a new cache name); the {runs} from the earlier build are set aside (set-aside.jsonl.gz beside the "
    "metrics, in no table or verdict) and every seed runs from the new build ({start}). Hypothesis, arms, seeds, steps and "
    "decision rule are unchanged."
)
GRIDS["moe"] = {
    "hypothesis": "On the tiny Qwen3-MoE (8 experts, top-2, 4 layers) trained on addition, a bf16 engine with an fp8 KV "
    "cache against the fp32 trainer flips more router choices and raises the train-inference mismatch well above the plain "
    "bf16 engine's, and without a correction this lowers the final held-out sampled accuracy relative to bf16-none. "
    "Token-level corrections (IcePop, TIS, DIS) and routing replay (the trainer reuses the engine's experts) recover most of "
    "that loss. This holds for PPO with a learned critic and for GRPO with 8 samples per prompt. Sized before registering "
    "(bench/bench_mismatch.py --tiny moe --prompts 512, the warmed start model): bf16 engine k3 7.2e-4, 0 per mille of "
    "tokens outside IcePop's [0.5, 2], 0.48% of token-layer router choices flipped (1.8% of tokens in some layer); int4 "
    "weights 4.0e-3, 0.8 per mille, 1.1% (4.1%); bf16 + fp8 KV cache 1.7e-2, 21 per mille, 1.8% (7.0%). The fp8 KV cache "
    "is the mismatch source here because it is the only realistic knob that puts tokens outside the band.",
    "decision_rule": "The mismatch grid's rule, on these arms: primary endpoint held-out sampled accuracy at the last step "
    "(all 3000 test problems, sampled by an fp32 copy of the policy, --eval-dtype fp32), one value per seed; 95% t-interval "
    "of the seed mean; each algorithm judged separately. (1) An arm is DEGRADED if its mean is at least 5 points below "
    "<algo>-bf16-none's and the two intervals do not overlap. (2) A correction HELPS if its arm's mean is at least 5 points "
    "above kvfp8-none's (kvfp8-tis, kvfp8-icepop, kvfp8-dis, kvfp8-replay) and the intervals do not overlap; it HURTS if at "
    "least 5 points below with non-overlapping intervals. The hypothesis is supported for an algorithm if kvfp8-none is "
    "DEGRADED and kvfp8-icepop or kvfp8-replay HELPS over it. A comparison with fewer than 2 finished seeds in either arm "
    "is not evaluated. Anything else is a null result for that comparison. Reported alongside, not decisive: router flips "
    "(all layers, any layer), the ratio's max and 99.9% quantile, masked fractions, grad norms.",
    "tasks": ["addition"],
    "seeds": [0, 1, 2, 3, 4],
    "steps": {"addition": 80},  # set before running, never after seeing results
    "base": [
        "--tiny",
        "moe",
        "--rollout-batch",
        "64",
        "--eval-every",
        "20",
        "--eval-size",
        "3000",
        "--eval-dtype",
        "fp32",
        "--save-every",
        "20",
        "--keep-checkpoints",
        "1",
    ],
    "arms": {f"{algo}-{label}": ALGOS[algo] + flags for algo in ALGOS for label, flags in MOE_ARMS.items()},
    "core": [
        f"{algo}-{label}" for algo in ALGOS for label in ("bf16-none", "kvfp8-none", "kvfp8-icepop", "kvfp8-replay")
    ],
    "split_by_algo": True,
    "moe": True,  # the report adds the routing table
    "quick": {**QUICK, "arms": ["ppo-kvfp8-none", "ppo-kvfp8-replay"], "base": QUICK["base"] + ["--tiny", "moe"]},
    "amendments": [
        REBUILT.format(
            runs="8 runs (seed 0 of each core arm; greedy accuracy 50.4% at step 0)",
            start="45.0% greedy accuracy on the 3000 test problems, warm-up 500 steps to 43.8% on its validation rows",
        )
    ],
}
# A replication on fresh seeds, registered after guess-learns came out null (+5.8 +- 6.0 over 5 seeds). Its seeds are
# judged alone, never pooled with guess-learns' (pooling after seeing a result would be optional stopping).
GRIDS["guess-learns-rep"] = {
    **GRIDS["guess-learns"],
    "hypothesis": "Replication of guess-learns on 10 fresh seeds (5-14), every setting unchanged: IcePop PPO with a pretrained "
    "critic raises the held-out greedy success rate of the warmed-up tiny model on --task guess within 150 steps of 64 episodes.",
    "decision_rule": "As guess-learns, on these 10 seeds alone: primary endpoint the gain of held-out greedy success (500 test "
    "problems) from step 0 to step 150, one value per seed; 95% t-interval of the seed mean. RL LEARNS if the mean gain is at least "
    "5 points and the interval excludes 0; otherwise a null result. Secondary (reported, not decisive): the sampled success gain.",
    "seeds": list(range(5, 15)),
    "amendments": [
        REBUILT.format(
            runs="2 runs (seeds 5 and 6; greedy success 31.8% at step 0)",
            start="33.8% greedy success on the "
            "500 test problems at step 0, warm-up 425 steps to 36.7% on its validation rows",
        )
    ],
}
# Registered 2026-12-02 after guess-learns-rep (null by its rule at 150 steps: greedy +4.6 +- 3.5, sampled +5.8 +- 2.9, both
# seed-mean curves still rising at step 150) and before any run of this grid. Fresh seeds; judged alone, never pooled.
GRIDS["guess-learns-300"] = {
    **GRIDS["guess-learns"],
    "hypothesis": "Given twice the training (300 steps of 64 episodes, about 45 CPU-minutes per seed on one core of this machine), "
    "IcePop PPO with a pretrained critic raises the held-out greedy success rate of the warmed-up tiny model on --task guess by at "
    "least 5 points. Sized from guess-learns-rep's seed-mean curve (+0.1, +1.5, +4.6 points at steps 50, 100, 150; seed SD of "
    "the gain about 5 points): a roughly linear rise after step 50 projects +9 to +11 at step 300.",
    "decision_rule": "Primary endpoint: the gain of held-out greedy success (500 test problems, whose ranges never occur in train) "
    "from step 0 to step 300, one value per seed (5 fresh seeds, 15-19); 95% t-interval of the seed mean. RL LEARNS if the mean "
    "gain is at least 5 points and the interval excludes 0; otherwise a null result. Fewer than 5 finished seeds: not judged. "
    "Secondary (reported, not decisive): the sampled success gain.",
    "seeds": list(range(15, 20)),
    "steps": {"guess": 300},  # set before running, never after seeing results
    "base": [
        "--rollout-batch",
        "64",
        "--engine-dtype",
        "fp32",
        "--max-turns",
        "6",
        "--eval-every",
        "100",
        "--eval-size",
        "500",
        "--save-every",
        "50",
        "--keep-checkpoints",
        "1",
    ],
}
TODO = (
    "TODO(lead)"  # a grid spec field holding this is unregistered: bench/lab.py refuses to run the grid (unregistered)
)
# Issue 22's credit grid, registered 2026-12-04 before any of its runs, after a calibration on seed 1000 (in no table).
GRIDS["credit"] = {
    "hypothesis": "Token-level credit speeds up learning where the headroom bound says it can, at equal episodes per step (32) and equal "
    "steps (40). Calibration before registering (seed 1000, not a grid seed; /tmp runs, in no table): on walk at the default lr 2e-4 "
    "every arm moved at one speed (held-out sampled success at step 40: reinforce 51.2, ppo 50.7, grpo-n8 49.5, from 41.5; vine 49.3 at "
    "step 30 against reinforce's 48.2), a regime limited by the step size, where the gradient's noise, which credit removes, does not "
    "bind. At lr 6e-4 reinforce went 41.5 -> 64.2 by step 30 and fell back to 50.7 at step 40 (greedy 68.5): fast and noisy, where a "
    "lower-variance advantage should help; at 1.2e-3 it reached 73.0 (near the 80% optimum, which would compress the AUC). Walk runs at "
    "6e-4. On sort lr 6e-4 collapsed reinforce to 0% by step 10, while 2e-4 went 11.0 -> 21.5 (greedy 26 -> 49): sort keeps 2e-4. "
    "The critic's lr is 1e-3 on both (the walk positive control's and the offline fit's). Predictions, per task, on the AUC of "
    "held-out sampled success: "
    "WALK (headroom bound 3.66x for the start model, docs/lab/credit/ceiling_walk.json: a perfect critic leaves 1/3.66 of the squared "
    "error of a prompt-only baseline, EV 0.735 against 0.143; reinforce's running mean over the 8 last rewards of each of the 71 "
    "prompts, each drawn about 18 times in a run, approximates that prompt-only baseline): (1) vine, the oracle (Monte Carlo values "
    "from 4 continuations per turn start, about 12x extra tokens), is BETTER than reinforce; (2) ppo (the plain critic) is BETTER than "
    "reinforce, the weaker prediction: online the critic reached EV 0.2 by step 40 at lr 2e-4 in calibration, 0.44 only after ~50 "
    "steps of 64 in the positive control; (3) ppo-priv (the critic also told the gust, --critic-context env) is BETTER than ppo, the "
    "weakest: the gust is only unknown on turn 1; (4) ppo is BETTER than grpo-n8 (4 prompts per step; 9% of its groups had identical "
    "rewards in calibration). SORT (the contrast; headroom bound 1.35x, perfect-critic EV 0.313 against 0.075 prompt-only, docs/lab/credit/ceiling_sort.json): (1) smaller than "
    "on walk, and (2) and (3) NULL, as the tiny critic's EV stays at 0.00-0.05 on single-turn tasks. Critic pretraining (10 "
    "critic-only steps of 32 episodes before step 1, ppo arms) is outside the equal budget: the policy does not change in it.",
    "decision_rule": "Primary endpoint: the AUC of held-out sampled success, the trapezoid mean of the success rate (400 test episodes or "
    "problems, never trained on, sampled at temperature 1; the same episodes and sampling seeds in every arm) over the evaluations at "
    "steps 0, 10, 20, 30, 40, in points; one value per run. Each task judged separately, on the seeds finished in both arms of a "
    "comparison (paired: seed k gives every arm the same prompt order and sampling seeds). A comparison a vs b is BETTER if the mean "
    "paired difference a - b is at least 2 points and its 95% t-interval excludes 0; WORSE if at most -2 points and the interval excludes "
    "0; otherwise NULL; with fewer than 5 paired seeds NOT JUDGED. (2 points of AUC is the gap two curves that part linearly from a "
    "common start leave when they end 4 points apart.) Order, per task: (1) the oracle first, vine vs reinforce: if vine is not BETTER, "
    "the task cannot show a credit effect at this budget and comparisons 2-4 on it are reported as uninformative; (2) ppo vs reinforce; "
    "(3) ppo-priv vs ppo; (4) ppo vs grpo-n8. Secondary, reported and not decisive: the same comparisons on the final sampled success "
    "(step 40). Reported beside them: each arm's EV over the last 20% of steps (the critic's; vine's Monte Carlo values') against the "
    "perfect-critic ceiling, GRPO's identical-reward fraction and vine's extra tokens per rollout token. A null result is reported as "
    "one, with what it would take to see an effect.",
    "tasks": ["walk", "sort"],
    "seeds": list(range(10)),  # paired: seed k gives every arm the same prompt order and sampling seeds
    "steps": {"walk": 40, "sort": 40},  # set before running, never after seeing results
    "base": [
        "--rollout-batch",
        "32",
        "--critic-lr",
        "1e-3",
        "--critic-pretrain",
        "10",
        "--engine-dtype",
        "fp32",
        "--correction",
        "none",
        "--eval-every",
        "10",
        "--eval-size",
        "400",
        "--save-every",
        "10",
        "--keep-checkpoints",
        "1",
    ],
    "task_flags": {"walk": ["--lr", "6e-4"], "sort": ["--lr", "2e-4"]},
    "arms": {
        "grpo-n8": ["--algo", "grpo", "--n-samples", "8"],
        "ppo": ["--algo", "ppo"],  # 32 rollouts per step in every arm
        "ppo-priv": {
            "walk": ["--algo", "ppo", "--critic-context", "env"],
            "sort": ["--algo", "ppo", "--critic-context", "answer"],
        },
        "vine": ["--algo", "vine", "--vine-k", "4"],
        "reinforce": ["--algo", "reinforce"],
    },
    "core": ["vine", "reinforce"],  # the oracle comparison first: it says whether a task can show an effect at all
    "points": 2.0,
    "need": 5,  # verdict_credit's thresholds (lab_stats.judge)
    "ceilings": {
        t: f"docs/lab/credit/ceiling_{t}.json" for t in ("walk", "sort")
    },  # the start models' perfect-critic EV
    "quick": {
        **QUICK,
        "tasks": ["sort"],
        "arms": ["reinforce", "ppo-priv"],
        "base": QUICK["base"] + ["--engine-dtype", "fp32", "--correction", "none"],
    },
}
# Issue 23's positive control, registered 2026-12-04 before any of its runs, after a calibration on seed 900 (in no
# table): PPO on addition, 60 steps of 64, fp32 engine; held-out greedy accuracy at steps 0 / 20 / 40 / 60:
#   --lr 1e-3 on-policy collapsed by itself (34.2 / 4.2 / 2.2 / 3.0): too high to blame any mismatch, so not used;
#   --lr 4e-4 on-policy (--sync-every 1) learned: 34.2 / 46.6 / 55.6 / 60.0;
#   --lr 4e-4 --sync-every 4 (rollouts up to 3 updates stale), no correction: 34.2 / 11.4 / 9.0 / 9.6 (sequence ESS
#     0.22-0.38 and k3 0.1-0.3 on the stale steps); IcePop: 34.2 / 44.6 / 39.8 / 53.0; TIS: 34.2 / 36.8 / 48.6 / 62.0;
#   --lr 2e-4 --sync-every 10, no correction: 34.2 / 16.2 / 7.6 / 15.0;
#   the tiny MoE with --moe-flip 0.5 (51% of router choices flipped), lr 4e-4, no correction, did not collapse: 47.2 /
#     57.4 / 62.8 / 63.4 (evaluated by the flipped engine; the grids below evaluate an fp32 copy).
COLLAPSE = {
    "key": "eval/greedy_acc",
    "margin": 0.10,
    "ess": 0.5,
    "logk": 2.0,
    "control": "stale-none",
    "control_share": 0.6,
    "alpha": 0.05,
    "need": 5,
}
COLLAPSE_RULE = (
    "Outcome per seed: COLLAPSED if the held-out greedy accuracy (500 test problems, sampled by an fp32 copy of the policy, "
    "--eval-dtype fp32) at any evaluation after step 0 (every 10 steps, to step 60) is at least 10 points below its step-0 "
    "value, or if the trainer stops on non-finite updates; the step of collapse is the first such evaluation (or the stop). "
    "(1) The positive control HOLDS if {control} collapses in at least 60% of its seeds; otherwise the grid cannot show a "
    "correction preventing collapse and the comparisons against it are reported as uninformative. (2) For each pair (a, b): "
    "a PREVENTS collapse if it collapses in fewer seeds than b and the two-sided Fisher's exact p < 0.05 on the 2x2 table "
    "(collapsed or not, by arm); a CAUSES collapse if more often with p < 0.05; otherwise NULL; fewer than 5 finished seeds "
    "in either arm: NOT JUDGED. Reported beside them, not decisive: the time-to-collapse curves, and for each collapse "
    "whether the sequence ESS of the importance weights fell below 0.5, or max |log k| rose above 2, at or before its step."
)
COLLAPSE_BASE = [
    *("--algo", "ppo", "--rollout-batch", "64", "--lr", "4e-4", "--critic-pretrain", "10"),
    *(
        "--eval-every",
        "10",
        "--eval-size",
        "500",
        "--eval-dtype",
        "fp32",
        "--save-every",
        "20",
        "--keep-checkpoints",
        "1",
    ),
]
GRIDS["collapse"] = {
    "hypothesis": "Rollouts from weights up to 3 updates stale (--sync-every 4) at lr 4e-4 make uncorrected PPO collapse on addition "
    "within 60 steps of 64, while the same lr on-policy does not (calibration on seed 900, in the comments above the spec). "
    "Predictions: (1) stale-none collapses in at least 60% of the seeds; (2) IcePop, TIS and DIS (token-level corrections of "
    "pi_old / pi_infer) each PREVENT it; (3) staleness CAUSES it: stale-none collapses more often than fresh-none; (4) the int4 "
    "engine, a dense and mild mismatch (k3 about 4e-3, 0.8 per mille of tokens outside [0.5, 2]), does not: int4-none against "
    "fresh-none is NULL (the negative control); (5) in most collapses the sequence ESS falls below 0.5 at or before the collapse "
    "step. PPO only: the budget does not allow GRPO arms here.",
    "decision_rule": COLLAPSE_RULE.format(control="stale-none")
    + " Pairs: (stale-icepop, stale-none), (stale-tis, stale-none), "
    "(stale-dis, stale-none), (stale-none, fresh-none), (int4-none, fresh-none).",
    "tasks": ["addition"],
    "seeds": list(range(10)),
    "steps": {"addition": 60},  # set before running, never after seeing results
    "base": COLLAPSE_BASE,
    "arms": {
        "fresh-none": ["--engine-dtype", "fp32", "--sync-every", "1", "--correction", "none"],
        **{
            f"stale-{c}": ["--engine-dtype", "fp32", "--sync-every", "4", "--correction", c]
            for c in ("none", "icepop", "tis", "dis")
        },
        "int4-none": ["--engine-dtype", "int4", "--sync-every", "1", "--correction", "none"],
    },
    "core": ["stale-none", "stale-icepop", "fresh-none"],
    "collapse": {
        **COLLAPSE,
        "pairs": [
            ("stale-icepop", "stale-none"),
            ("stale-tis", "stale-none"),
            ("stale-dis", "stale-none"),
            ("stale-none", "fresh-none"),
            ("int4-none", "fresh-none"),
        ],
    },
    "nonfinite_is_outcome": True,
    "quick": {
        **QUICK,
        "arms": ["stale-none", "stale-icepop"],
        "base": ["4" if x == "25" else x for x in QUICK["base"]]  # --save-every 4: a multiple of --sync-every
        + ["--lr", "4e-4", "--eval-dtype", "fp32"],
    },
}
GRIDS["collapse-flip"] = {
    "hypothesis": "The heavy-tailed discrete knob: on the tiny MoE with --moe-flip 0.5 (the engine swaps a token's second expert for "
    "the third with probability 0.5 per token and layer: 51% of router choices and 94% of tokens flipped, k3 5.0e-2, 4.6% of "
    "tokens outside [0.5, 2]), lr 4e-4, on-policy, uncorrected PPO collapses in at least 60% of the seeds within 60 steps, and "
    "IcePop or routing replay PREVENT it. Calibration (seed 900) did not collapse, so the expected result is a failed positive "
    "control: at this scale the flips alone are not enough.",
    "decision_rule": COLLAPSE_RULE.format(control="flip-none")
    + " Pairs: (flip-icepop, flip-none), (flip-replay, flip-none).",
    "tasks": ["addition"],
    "seeds": list(range(10)),
    "steps": {"addition": 60},  # set before running, never after seeing results
    "base": ["--tiny", "moe", *COLLAPSE_BASE, "--engine-dtype", "fp32", "--moe-flip", "0.5"],
    "arms": {
        "flip-none": ["--correction", "none"],
        "flip-icepop": ["--correction", "icepop"],
        "flip-replay": ["--correction", "none", "--routing-replay"],
    },
    "core": ["flip-none", "flip-replay"],
    "collapse": {
        **COLLAPSE,
        "control": "flip-none",
        "pairs": [("flip-icepop", "flip-none"), ("flip-replay", "flip-none")],
    },
    "nonfinite_is_outcome": True,
    "moe": True,
    "quick": {
        **QUICK,
        "arms": ["flip-none", "flip-replay"],
        "base": QUICK["base"]
        + ["--tiny", "moe", "--moe-flip", "0.5", "--eval-dtype", "fp32", "--engine-dtype", "fp32"],
    },
}
# Issue 41's int4 grid, registered 2026-12-08 before any of its runs: the seed's own kind of mismatch (number formats
# and kernels), with and without a correction. Calibration, set aside (in no table): the collapse grid's int4-none and
# fresh-none arms (seeds 0-9, 60 steps, this start model 582ca8f9d3d2fdd8), and int4-none on seeds 900 and 901 to step
# 120 under a rule written before they ran (N = 120 if either first collapses after step 60, else 80). Held-out greedy
# accuracy every 10 steps:
#   seed 900: 34.2 / 24.0 / 12.4 / 7.8 / 6.2 / 1.6 / 1.4 / 1.0 / 1.0 / 0.0 / 0.2 / 0.2 / 0.6 (collapsed at step 10;
#     k3 1.0e-2 to 9e-2 and 0.6-8% of tokens outside [0.5, 2] as it fell);
#   seed 901: 34.2 / 35.6 / 33.6 / 43.2 / 42.0 / 40.2 / 48.0 / 39.2 / 35.6 / 29.4 / 8.2 / 5.6 / 5.8 (learned to step 60,
#     then collapsed at step 100): so 120 steps.
INT4_HYPOTHESIS = (
    "The seed's own kind of mismatch, corrected or not: the int4 engine (weights fake-quantised to int4 in groups of 32, "
    "against the fp32 trainer: number formats and kernels) on-policy (--sync-every 1) at lr 4e-4 on addition, 120 steps of "
    "64. On this dense start model it measured k3 1.1-1.7e-2 and 1.4% of tokens outside [0.5, 2] in the collapse grid, "
    "where uncorrected PPO collapsed in 5 of 10 seeds by step 60, gradually; in calibration one seed collapsed by step 10 "
    "and one learned to step 60 and collapsed at step 100 (the comments above the spec). Predictions: (1) the positive "
    "control: int4-none collapses in at least 40% of its seeds and CAUSES collapse against fresh-none (the fp32 engine, "
    "on-policy); (2) int4-tis PREVENTS it against int4-none; (3) int4-icepop PREVENTS it against int4-none. What an int4 "
    "collapse rides on: inside the band IcePop and TIS weight a token alike (by k = pi_old / pi_infer, M(k) = k for IcePop, "
    "min(k, 2) for TIS), so the biased in-band majority is reweighted by both; they differ only on the tokens outside it, "
    "which IcePop drops and TIS keeps (weight k below the band, 2 above). We expect both to prevent the collapse, and "
    "IcePop's and TIS's collapse counts to lie within 3 of each other; if TIS prevents it and IcePop does not, the collapse "
    "rides on the out-of-band tokens IcePop discards the gradient of, or on the loss of their signal; if neither does, on "
    "something weighting by k does not remove. Dose, reported beside the verdicts: each arm's k3 and share of tokens "
    "outside the band; the per-token records (--token-records 10) say which tokens IcePop masks."
)
GRIDS["collapse-int4"] = {
    "hypothesis": INT4_HYPOTHESIS,
    "decision_rule": COLLAPSE_RULE.replace("to step 60", "to step 120")
    .replace("60% of its seeds", "40% of its seeds")
    .format(control="int4-none")
    + " Pairs: (int4-none, fresh-none), (int4-icepop, int4-none), (int4-tis, int4-none). Secondary, reported and not "
    "decisive: the same pairs at margins of 5 and 15 points. Power (Fisher's exact test, two-sided, 0.05, 20 seeds per "
    "arm, by simulation): 0.90 if the uncorrected arm collapses in 50% of seeds and a corrected one in 5%, 0.75 at 50% "
    "against 10%, 0.40 at 50% against 20%.",
    "tasks": ["addition"],
    "seeds": list(range(100, 120)),  # fresh: the collapse grid used 0-9
    "steps": {"addition": 120},  # set by the calibration before registering, never after seeing results
    "base": COLLAPSE_BASE + ["--sync-every", "1", "--token-records", "10"],
    "arms": {
        "fresh-none": ["--engine-dtype", "fp32", "--correction", "none"],
        **{f"int4-{c}": ["--engine-dtype", "int4", "--correction", c] for c in ("none", "icepop", "tis")},
    },
    "core": ["int4-none", "int4-icepop", "fresh-none"],
    "collapse": {
        **COLLAPSE,
        "control": "int4-none",
        "control_share": 0.4,
        "secondary": [0.05, 0.15],
        "pairs": [("int4-none", "fresh-none"), ("int4-icepop", "int4-none"), ("int4-tis", "int4-none")],
    },
    "nonfinite_is_outcome": True,
    "quick": {**QUICK, "arms": ["int4-none", "int4-icepop"], "base": QUICK["base"] + ["--eval-dtype", "fp32"]},
}
# Issue 41's credit grid where the oracle can win, registered 2026-12-08 before any of its runs. Calibration, set aside
# (in no table), under a rule written before it ran: the control (reinforce --baseline-window 4, 16 episodes per step) on
# seeds 1100 and 1101 at lr 3e-4, 6e-4, 1.2e-3 (and 2.4e-3 only if 1.2e-3 qualified); Gain20 = the seed mean of held-out
# sampled success at step 20 minus step 0, Late = step 40 minus step 30; the largest lr with Gain20 >= 6 and Late >= 3.
# Held-out sampled success at steps 0 / 10 / 20 / 30 / 40, seeds 1100 and 1101:
#   3e-4: 42.8 / 41.7 / 42.8 / 43.5 / 44.2 and 42.0 / 44.5 / 46.3 / 49.3 / 52.2 (Gain20 2.2: too slow);
#   6e-4: 42.8 / 40.7 / 42.8 / 44.2 / 56.0 and 42.0 / 46.3 / 51.7 / 60.8 / 66.3 (Gain20 4.9);
#   1.2e-3: 42.8 / 43.3 / 55.8 / 68.8 / 70.2 and 42.0 / 53.3 / 60.5 / 62.0 / 67.5 (Gain20 15.8, Late 3.5: qualifies);
#   2.4e-3: 42.8 / 0.0 / 38.0 / 0.0 / 0.0 and 42.0 / 61.8 / 61.0 / 60.5 / 61.3 (Gain20 7.1, Late 0.4: a plateau, and seed
#     1100 collapsed to 0): so 1.2e-3.
# ppo-fit's critic lr, by a rule written after a smoke run (critic lr 6e-3) saw the fitted critic's EV fall from 0.42 to
# 0.01 in one update, and before these runs: keep the grid's 1e-3 if the median over seeds 1100 and 1101 of the mean
# critic EV over steps 1-5 is >= 0.30. Per-step EV, steps 1-10: 0.36 0.30 0.50 0.05 0.51 0.05 0.39 0.38 0.42 0.34 and
# 0.40 0.45 0.38 0.37 0.54 0.31 0.36 0.35 0.50 0.48 (means over 1-5: 0.35 and 0.43): 1e-3 is kept.
# The fitted critic (docs/lab/credit-b16/critic, its record critic_init.json and critic_fit.json):
# `bench/value_fit.py --task walk --model <the kept start model> --rollouts 1024 --epochs 8 --lr 1e-3 --seed 0`, held-out
# EV 0.469 (0.64 of the 0.734 ceiling; 0.62-0.67 at response positions 64 on), above the 0.40 registration bar.
CREDIT_B16_PAIRS = (
    ("vine-k16", "reinforce"),
    ("vine-k4", "reinforce"),
    ("ppo-fit", "reinforce"),
    ("ppo", "reinforce"),
    ("ppo-fit", "ppo"),
)
GRIDS["credit-b16"] = {
    "hypothesis": "Token-level credit speeds up learning on walk when the gradient's noise binds: 16 episodes per step (half "
    "the credit grid's), 40 steps, at the largest lr the control still climbs with (calibration above the spec), with an "
    "oracle of about 2.7x the baseline's gradient signal-to-noise (Monte Carlo values from K = 16 continuations per turn "
    "start; an exact noise model of walk gives 2.3x for K = 4 and 2.9x for exact values) and a critic that knows the values "
    "from step 1 (fitted offline on 1,024 rollouts of the start policy, held-out EV 0.47, loaded with --critic-init, no "
    "pretraining). The control is SAO's running-mean baseline over the 4 last rewards of each prompt (--baseline-window 4: "
    "the credit grid's window 8 at 32 episodes, the same memory in steps). Predictions, on the AUC of held-out sampled "
    "success: (1) vine-k16, the oracle, is BETTER than reinforce; (2) vine-k4 is BETTER than reinforce, by less than "
    "vine-k16; (3) ppo-fit (the pre-fitted critic) is BETTER than reinforce; (4) ppo (today's online critic, 10 steps of "
    "critic pretraining outside the budget) is NULL against reinforce: its critic reached EV 0.07 in 40 steps of the "
    "credit grid; (5) ppo-fit is BETTER than ppo. The walk start model is the credit grid's (kept in "
    "docs/lab/credit-b16/start, fingerprint c9ee8615bbd4d40a).",
    "decision_rule": "Primary endpoint: the AUC of held-out sampled success, the trapezoid mean of the success rate (400 "
    "test episodes, never trained on, sampled at temperature 1; the same episodes and sampling seeds in every arm) over the "
    "evaluations at steps 0, 10, 20, 30, 40, in points; one value per run, on the seeds finished in both arms of a "
    "comparison (paired: seed k gives every arm the same prompt order and sampling seeds). A comparison a vs b is BETTER if "
    "the mean paired difference a - b is at least 2 points and its 95% t-interval excludes 0; WORSE if at most -2 points "
    "and the interval excludes 0; otherwise NULL; with fewer than 5 paired seeds NOT JUDGED. Order: (1) the oracle first, "
    "vine-k16 vs reinforce: if it is not BETTER, the task cannot show a credit effect at this budget and comparisons 2-5 "
    "are reported as uninformative; (2) vine-k4 vs reinforce; (3) ppo-fit vs reinforce; (4) ppo vs reinforce; (5) "
    "ppo-fit vs ppo. Manipulation check for the pre-fitted critic: the median over seeds of ppo-fit's critic EV (its mean "
    "over steps 1-5) is at least 0.30; if not, comparisons 3 and 5 do not test a pre-fitted critic and are reported as uninformative. "
    "Secondary, not decisive: the same comparisons on the final sampled success (step 40). Power of each comparison (by "
    "simulation, 20 paired seeds, this rule, a paired SD of 3 points): 0.51 for a true effect of 2 points, 0.77 for 2.5, "
    "0.93 for 3, 0.99 for 3.5. A null result is reported as one.",
    "tasks": ["walk"],
    "seeds": list(range(20)),  # paired; calibration seeds 1100 and 1101 are set aside
    "steps": {"walk": 40},  # set before running, never after seeing results
    "base": [
        *("--rollout-batch", "16", "--critic-lr", "1e-3", "--critic-pretrain", "10", "--engine-dtype", "fp32"),
        *("--correction", "none", "--eval-every", "10", "--eval-size", "400", "--save-every", "10"),
        *("--keep-checkpoints", "1", "--token-records", "10"),
    ],
    "task_flags": {"walk": ["--lr", "1.2e-3"]},
    "arms": {
        "reinforce": ["--algo", "reinforce", "--baseline-window", "4"],
        "vine-k16": ["--algo", "vine", "--vine-k", "16"],
        "vine-k4": ["--algo", "vine", "--vine-k", "4"],
        "ppo-fit": ["--algo", "ppo", "--critic-init", "docs/lab/credit-b16/critic", "--critic-pretrain", "0"],
        "ppo": ["--algo", "ppo"],
    },
    "core": ["vine-k16", "reinforce"],  # the oracle comparison first
    "points": 2.0,
    "need": 5,
    "ceilings": {"walk": "docs/lab/credit/ceiling_walk.json"},
    "quick": {
        **QUICK,
        "tasks": ["walk"],
        "arms": ["reinforce", "ppo-fit"],
        "base": QUICK["base"] + ["--engine-dtype", "fp32", "--correction", "none"],
    },
}


def verdict_credit_b16(stats):
    """verdict_credit on CREDIT_B16_PAIRS after the pre-fitted critic's manipulation check (the seed median of ppo-fit's
    mean critic EV over steps 1-5 >= 0.30): where it fails, comparisons 3 and 5 (ppo-fit's) are uninformative."""
    g = GRIDS["credit-b16"]
    evs = sorted(p["critic_ev_first5"] for p in stats.get("walk", {}).get("ppo-fit", {}).get("seeds", {}).values())
    if not evs:
        check, failed = "Manipulation check (ppo-fit's critic EV, steps 1-5): no run yet.", False
    else:
        median = (evs[(len(evs) - 1) // 2] + evs[len(evs) // 2]) / 2
        failed = median < 0.30
        check = (
            f"Manipulation check (ppo-fit's critic EV over steps 1-5, median of {len(evs)} seeds): {median:.2f} against "
            + (
                "0.30: **FAILS**: comparisons 3 and 5 do not test a pre-fitted critic (uninformative)."
                if failed
                else "0.30: **HOLDS**."
            )
        )
    skip = {3: "the manipulation check fails", 5: "the manipulation check fails"} if failed else {}
    return verdict_credit(stats, g["points"], g["need"], g["ceilings"], REPO, CREDIT_B16_PAIRS, skip) + ["", check]


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(REPO, "train_ppo.py")
KEEP = (
    "eval/greedy_acc",
    "eval/sampled_acc",
    "mismatch/k3",
    "mismatch/masked_frac_low",
    "moe/flip_frac",
    "moe/flip_any_layer_frac",
    "mismatch/ratio_max",
    "mismatch/ratio_p999",
    "mismatch/masked_frac_high",
    "ppo/grad_norm",
    "ppo/entropy",
    "critic/explained_variance",
    "grpo/identical_reward_frac",
    "rollout/turns_mean",
    "vine/explained_variance",
    "vine/extra_token_ratio",
    "mismatch/ess",
    "mismatch/seq_ess",
    "mismatch/abs_diff_max",
    "mismatch/k3_slope",
    "rollout/staleness",
)


def grid_spec(name, quick):
    """The grid, or its quick variant (the quick dict's keys replace the grid's; arms: a list of labels or a dict)."""
    g = dict(GRIDS[name])
    if quick:
        q = g["quick"]
        arms = q.get("arms", list(g["arms"]))
        g.update({k: v for k, v in q.items() if k != "arms"})
        g["arms"] = arms if isinstance(arms, dict) else {a: g["arms"][a] for a in arms}
        g["core"] = [a for a in g.get("core", []) if a in g["arms"]]
    for a, f in g["arms"].items():  # an arm's flags: one list for every task, or a dict {task: flags}
        if isinstance(f, dict) and (missing := [t for t in g["tasks"] if t not in f]):
            raise ValueError(f"grid {name}: arm {a} has no flags for task(s) {missing} (its dict has {sorted(f)})")
    return g


def arm_flags(g, arm, task):
    """The train_ppo.py flags of an arm on a task: its list, or its dict's entry for the task."""
    f = g["arms"][arm]
    return f[task] if isinstance(f, dict) else f


def flags_text(f, tasks):
    """An arm's flags for the report: the list, or each of the grid's tasks with its own."""
    return "; ".join(f"{t}: {shlex.join(f[t])}" for t in tasks) if isinstance(f, dict) else shlex.join(f)


def unregistered(g):
    """The fields of a grid spec still holding the lead's placeholder: a grid with any is never run (its rule must
    be written and committed before its first run)."""
    return [k for k in ("hypothesis", "decision_rule", "steps", "base", "task_flags") if TODO in json.dumps(g.get(k))]


def steps_of(g, task):
    return g["steps"][task] if isinstance(g["steps"], dict) else g["steps"]


def read_rows(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line train_ppo.py is writing right now
                pass
    return rows


def curve(rows):
    """Per-step rows, critic pretraining rows dropped, the last row of a step winning."""
    return sorted({r["step"]: r for r in rows if "pretrain/step" not in r}.values(), key=lambda r: r["step"])


NONFINITE = (
    "nonfinite.json"  # a run the trainer stopped on non-finite updates (update.check_finite): an outcome, not a failure
)
NONFINITE_LOG = re.compile(
    r"(?:step|critic pretraining step) (\d+): (?:the \w+ update made its weights non-finite|\d+ consecutive \w+ "
    r"updates had a non-finite loss)"
)


def finished(run_dir, steps):
    """A run that evaluated its last step, or that stopped on non-finite updates in a grid that counts that (NONFINITE)."""
    return os.path.isfile(os.path.join(run_dir, NONFINITE)) or any(
        r["step"] == steps and "eval/greedy_acc" in r for r in curve(read_rows(run_dir))
    )


def clear_unsaved(run_dir):
    """A run stopped before its first checkpoint is redone from the start: remove its records, which train_ppo.py
    refuses to overwrite (a folder with records and no checkpoint is never started over by the trainer itself)."""
    ckpts = os.path.join(run_dir, "checkpoints")
    if os.path.isdir(ckpts) and any(d.startswith("step_") for d in os.listdir(ckpts)):
        return
    for name in ("config.json", "metrics.jsonl", "samples", "checkpoints"):
        path = os.path.join(run_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def log_tail(path, n=15):
    with open(path, errors="replace") as f:
        return "\n".join([x for x in re.split(r"[\r\n]", f.read()) if x.strip()][-n:])  # tqdm bars end in \r


def start_model(path):
    """Fingerprint of a start model: sha256 of its weight files (16 hex digits), None if the folder is gone."""
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) if path and os.path.isdir(path) else []
    if not files:
        return None
    h = hashlib.sha256()
    for name in files:
        with open(os.path.join(path, name), "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:16]


def default_start_model(g, task, keep=None, cache=os.path.join(REPO, ".cache")):
    """The folder of the default model a run of this grid and task starts from (train_ppo.py uses the same one:
    data.tiny.default_model, the same cache), built now if this machine lacks it. With `keep` (the grid's committed
    folder, where keep_start_model puts it under start/<its cache name>) a kept model is restored into a cache that
    lacks it: a rebuild on another CPU or library version can round differently, and one grid needs one start model.
    A cache that holds another build than the kept one is refused, naming both."""
    sys.path.insert(0, REPO)
    from data.tiny import DEFAULT_WARMUP, default_model, default_model_path

    arch = g["base"][g["base"].index("--tiny") + 1] if "--tiny" in g["base"] else "dense"
    kw = dict(task=task if task in DEFAULT_WARMUP else "addition", arch=arch)
    path = default_model_path(cache, **kw)
    kept = os.path.join(keep, "start", os.path.basename(path)) if keep else None
    if kept and os.path.isdir(kept) and not os.path.isdir(path):
        os.makedirs(cache, exist_ok=True)
        shutil.rmtree(tmp := path + ".restoring", ignore_errors=True)
        shutil.copytree(kept, tmp)
        os.replace(tmp, path)
        print(f"restored the grid's start model {os.path.relpath(kept, REPO)} into {path}", flush=True)
    path = default_model(cache, **kw)
    if kept and os.path.isdir(kept) and (want := start_model(kept)) != (have := start_model(path)):
        sys.exit(
            f"{path} holds another build of the start model ({have}) than the grid's, kept in {kept} ({want}): "
            "move the cached one away (it is rebuilt or restored on the next run)"
        )
    return path


def keep_start_model(path, keep):
    """Keep a grid's start model in its committed folder (keep/start/<cache name>) if it is not kept yet."""
    if not os.path.isdir(kept := os.path.join(keep, "start", os.path.basename(path))):
        shutil.copytree(path, kept)
        print(f"kept the start model {path} in {os.path.relpath(kept, REPO)} (commit it with the report)", flush=True)


def run_command(g, task, arm, seed, run_dir):
    """The train_ppo.py command of one run: the grid's base flags, its task's (task_flags), then the arm's."""
    return [
        sys.executable,
        TRAIN,
        "--out-dir",
        run_dir,
        "--seed",
        str(seed),
        "--task",
        task,
        "--steps",
        str(steps_of(g, task)),
        *g["base"],
        *g.get("task_flags", {}).get(task, []),
        *arm_flags(g, arm, task),
    ]


def run_all(g, root, todo, jobs, stored=()):
    """Launch the unfinished runs of todo, `jobs` at a time; returns {run key: log tail} of the failed ones. A run is
    finished when its folder says so, or when it is in `stored` ((task, arm, seed) finished on another machine: its
    folder is gone, its metrics are in the committed compact file)."""
    pending, running, failed, done = [], {}, {}, 0
    for job in todo:
        key = "{}/{}/seed{}".format(*job)
        if finished(f"{root}/{key}", steps_of(g, job[0])):
            print(f"skip {key} (finished)", flush=True)
        elif job in stored:
            print(f"skip {key} (finished: in the compact metrics file)", flush=True)
        else:
            pending.append(job)
    total = len(pending)
    try:
        while pending or running:
            for job in list(pending):
                if len(running) >= jobs:
                    break
                pending.remove(job)
                task, arm, seed = job
                d = f"{root}/{task}/{arm}/seed{seed}"
                os.makedirs(d, exist_ok=True)
                clear_unsaved(d)
                cmd = run_command(g, task, arm, seed, d)
                with open(os.path.join(d, "log.txt"), "a") as log:
                    log.write(f"\n$ {shlex.join(cmd)}\n")
                    log.flush()
                    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
                    running[subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)] = (
                        job,
                        d,
                        time.time(),
                    )
            time.sleep(0.5)
            for p in [p for p in running if p.poll() is not None]:
                (task, arm, seed), d, t0 = running.pop(p)
                key, done = f"{task}/{arm}/seed{seed}", done + 1
                stop = (
                    g.get("nonfinite_is_outcome")
                    and p.returncode
                    and NONFINITE_LOG.findall(log_tail(os.path.join(d, "log.txt"), 40))
                )
                if stop:  # collapse grids: the trainer's non-finite stop is the run's outcome, at that step
                    with open(os.path.join(d, NONFINITE), "w") as f:
                        json.dump({"step": int(stop[-1])}, f)
                    print(f"[{done}/{total}] done {key}: stopped on non-finite updates at step {stop[-1]}", flush=True)
                elif p.returncode == 0 and finished(d, steps_of(g, task)):
                    acc = [r for r in curve(read_rows(d)) if "eval/greedy_acc" in r][-1]["eval/greedy_acc"]
                    print(
                        f"[{done}/{total}] done {key}: final greedy acc {acc:.1%}, {time.time() - t0:.0f} s", flush=True
                    )
                else:
                    failed[key] = log_tail(os.path.join(d, "log.txt"))
                    print(
                        f"[{done}/{total}] FAILED {key} (exit {p.returncode}), {d}/log.txt ends:\n{failed[key]}",
                        flush=True,
                    )
    finally:  # on Ctrl-C or an error here, stop the runs this process started (they resume on the next invocation)
        for p in running:
            p.terminate()
            p.wait()
    return failed


def collect(g, root):
    """The finished runs under root, reduced to what the report uses (compact: 4 significant digits)."""
    runs = []
    for task in g["tasks"]:
        for arm in g["arms"]:
            for seed in g["seeds"]:
                d, S = f"{root}/{task}/{arm}/seed{seed}", steps_of(g, task)
                if not finished(d, S):
                    continue
                with open(os.path.join(d, "config.json")) as f:
                    cfg = json.load(f)["config"]
                with open(os.path.join(d, "log.txt"), errors="replace") as f:
                    n_eval = re.findall(r"on (\d+) held-out problems", f.read())
                rows = read_rows(d)
                keep = [
                    {
                        k: float(f"{v:.4g}") if isinstance(v, float) else v
                        for k, v in r.items()  # per-position EV: last 20% only
                        if k == "step" or k in KEEP or k.startswith("critic/ev_pos_") and r["step"] > 0.8 * S
                    }
                    for r in curve(rows)
                ]
                marker = os.path.join(d, NONFINITE)
                nonfinite = json.load(open(marker))["step"] if os.path.isfile(marker) else None
                runs.append(
                    {
                        "task": task,
                        "arm": arm,
                        "seed": seed,
                        "steps": S,
                        "rollout_batch": cfg["rollout_batch"],
                        "nonfinite_step": nonfinite,
                        "eval_n": int(n_eval[-1]) if n_eval else None,
                        "pretrain_steps": sum("pretrain/step" in r for r in rows),
                        "start_model": start_model(cfg.get("model_path")),
                        "rows": keep,
                    }
                )
    return runs


def save_compact(path, meta, runs):
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:  # mtime 0: same data, same bytes
        f.write("".join(json.dumps(x) + "\n" for x in [{"meta": meta}, *runs]).encode())


def load_compact(path):
    if not os.path.isfile(path):
        return {}, []
    with gzip.open(path, "rt") as f:
        lines = [json.loads(line) for line in f]
    return lines[0]["meta"], lines[1:]


def run_stats(run, spec=None):
    """The table's per-run numbers: accuracies in points; AUC: the mean held-out success over training (lab_stats.auc);
    k3 over the first / last 20% of steps; masked fractions over all steps; EV over steps 51-80 and, for the credit
    grid, the critic's or vine's over the last 20%; identical-reward groups and vine's extra tokens over all steps. A run
    stopped on non-finite updates has its last evaluation's figures and no AUC. spec: a collapse grid's "collapse"
    dict (key, margin, ess, logk): adds the step of collapse (lab_stats.collapse_step, None if none) and the first
    steps the sequence ESS fell below spec["ess"] and max |log k| rose above spec["logk"]."""
    rows, S = run["rows"], run["steps"]
    whole = run.get("nonfinite_step") is None
    ev, w = [r for r in rows if "eval/greedy_acc" in r], max(1, round(0.2 * S))

    def mean(key, lo, hi):
        v = [r[key] for r in rows if lo <= r["step"] <= hi and finite(r.get(key))]
        return sum(v) / len(v) if v else NAN

    return {
        "final_greedy": 100 * ev[-1]["eval/greedy_acc"],
        "gain_greedy": 100 * (ev[-1]["eval/greedy_acc"] - ev[0]["eval/greedy_acc"]),
        "gain_sampled": 100 * (ev[-1]["eval/sampled_acc"] - ev[0]["eval/sampled_acc"]),
        "best_greedy": 100 * max([r["eval/greedy_acc"] for r in ev if r["step"] >= 1], default=NAN),
        "final_sampled": 100 * ev[-1]["eval/sampled_acc"],
        "k3_first": mean("mismatch/k3", 1, w),
        "k3_last": mean("mismatch/k3", S - w + 1, S),
        "masked_low": mean("mismatch/masked_frac_low", 1, S),
        "masked_high": mean("mismatch/masked_frac_high", 1, S),
        "ev_51_80": mean("critic/explained_variance", 51, 80),
        "pretrain": run.get("pretrain_steps", 0),
        "flips": mean("moe/flip_frac", 1, S),
        "flips_any": mean("moe/flip_any_layer_frac", 1, S),
        "ratio_p999": mean("mismatch/ratio_p999", 1, S),
        "ratio_max": max([r["mismatch/ratio_max"] for r in rows if finite(r.get("mismatch/ratio_max"))], default=NAN),
        "grad_norm": mean("ppo/grad_norm", 1, S),
        "auc_sampled": auc(ev, "eval/sampled_acc", S) if whole else NAN,
        "auc_greedy": auc(ev, "eval/greedy_acc", S) if whole else NAN,
        "critic_ev_last": mean("critic/explained_variance", S - w + 1, S),
        "critic_ev_first5": mean("critic/explained_variance", 1, 5),  # credit-b16's manipulation check
        "vine_ev_last": mean("vine/explained_variance", S - w + 1, S),
        "identical": mean("grpo/identical_reward_frac", 1, S),
        "vine_extra": mean("vine/extra_token_ratio", 1, S),
        **(
            {
                "collapse": collapse_step(rows, spec["key"], spec["margin"], run.get("nonfinite_step")),
                **{  # a grid's secondary margins (collapse-int4), reported beside the registered one
                    f"collapse_{m:g}": collapse_step(rows, spec["key"], m, run.get("nonfinite_step"))
                    for m in spec.get("secondary", ())
                },
                "ess_warn": first_crossing(rows, "mismatch/seq_ess", spec["ess"]),
                "logk_warn": first_crossing(rows, "mismatch/abs_diff_max", spec["logk"], below=False),
            }
            if spec
            else {}
        ),
    }


def arm_stats(runs, spec=None):
    """One arm's runs on one task: {run_stats key: ci95 triple over its seeds, "seeds": {seed: run_stats(run, spec)}}."""
    per = {r["seed"]: run_stats(r, spec) for r in runs}
    return {**{k: ci95([p[k] for p in per.values()]) for k in next(iter(per.values()), {})}, "seeds": per}


def compare(a, b, points=5.0):
    """+1: a's mean at least `points` above b's and the 95% intervals do not overlap; -1: the same below; 0: neither;
    None: not evaluated (an arm missing, or fewer than 2 seeds). a, b: ci95 triples or None."""
    if a is None or b is None or a[2] < 2 or b[2] < 2:
        return None
    apart = a[0] - a[1] > b[0] + b[1] or b[0] - b[1] > a[0] + a[1]
    return 0 if not apart or abs(a[0] - b[0]) < points else 1 if a[0] > b[0] else -1


def verdict_mismatch(
    stats,
    labels=MISMATCH_ARMS,
    pairs=(
        ("int4-tis", "int4-none"),
        ("int4-icepop", "int4-none"),
        ("int4-geo", "int4-none"),
        ("kvfp8-icepop", "kvfp8-none"),
        ("int4-icepop-mb4", "int4-none-mb4"),
    ),
    support_pairs=(("int4-icepop", "int4-none"), ("int4-icepop-mb4", "int4-none-mb4")),
):
    """The mismatch decision rule (and the moe grid's, with its labels and pairs); stats[task][arm][metric] = ci95 triple."""
    lines, passed = [], False
    for task, arms in stats.items():
        for algo in ALGOS:

            def s(label):
                return arms.get(f"{algo}-{label}", {}).get("final_sampled")

            if not any(a.startswith(f"{algo}-") for a in arms):
                continue
            ref = s("bf16-none")
            deg = {x: compare(s(x), ref) for x in labels if x != "bf16-none" and s(x) is not None and ref is not None}
            cor = {(c, u): compare(s(c), s(u)) for c, u in pairs if s(c) is not None and s(u) is not None}
            out = [f"DEGRADED {x}" for x, v in deg.items() if v == -1] + [
                f"{c} {'HELPS' if v == 1 else 'HURTS'} over {u}" for (c, u), v in cor.items() if v
            ]
            skipped = [x for x, v in deg.items() if v is None] + [
                f"{c} vs {u}" for (c, u), v in cor.items() if v is None
            ]
            support = any(deg.get(u) == -1 and cor.get((c, u)) == 1 for c, u in support_pairs)
            passed |= bool(out)
            lines.append(
                f"- {task} / {algo}: "
                + ("; ".join(out) if out else "null result (no comparison passes the rule)")
                + ("; **hypothesis supported**" if support else "")
                + (f" (not evaluated, < 2 seeds: {', '.join(skipped)})" if skipped else "")
                + ("" if ref else f" (no {algo}-bf16-none runs: DEGRADED not evaluated)")
            )
    return lines + ([] if passed else ["", "**Null result**: no comparison passes the decision rule."])


def verdict_horizon(stats):
    lines, margins = [], {}
    for task, arms in stats.items():
        ppo, grpo = (
            arms.get("ppo", {}).get("final_greedy"),
            [arms[a]["final_greedy"] for a in ("grpo-n4", "grpo-n8") if a in arms],
        )
        res = [compare(ppo, x) for x in grpo]
        if len(res) < 2 or None in res:
            lines.append(f"- {task}: not evaluated (ppo, grpo-n4 and grpo-n8 need >= 2 finished seeds each)")
            continue
        margins[task] = (
            "PPO BETTER" if set(res) == {1} else "PPO WORSE" if set(res) == {-1} else "null result",
            ppo[0] - max(x[0] for x in grpo),
        )
        lines.append(f"- {task}: {margins[task][0]} (PPO minus the better GRPO arm: {margins[task][1]:+.1f} points)")
    if "sort" in margins and "addition" in margins:
        ok = margins["sort"][0] == "PPO BETTER" and margins["sort"][1] > margins["addition"][1]
        lines.append(f"- larger on sort: {'yes' if ok else 'no (null result)'}")
    if not any(v != "null result" for v, _ in margins.values()):
        lines += ["", "**Null result**: no task passes the decision rule."]
    return lines


def verdict_multi_turn(stats):
    arms = stats.get("guess", {})
    res = compare(arms.get("ppo", {}).get("final_greedy"), arms.get("grpo-n4", {}).get("final_greedy"))
    if res is None:
        return ["- guess: not evaluated (ppo and grpo-n4 need >= 2 finished seeds each)"]
    margin = arms["ppo"]["final_greedy"][0] - arms["grpo-n4"]["final_greedy"][0]
    lines = [
        f"- guess: {({1: 'PPO BETTER', -1: 'PPO WORSE', 0: 'null result'})[res]} (PPO minus GRPO n4: {margin:+.1f} points)"
    ]
    return lines + ([] if res else ["", "**Null result**: the comparison does not pass the decision rule."])


def verdict_guess_learns(stats, need=2):
    ppo = stats.get("guess", {}).get("ppo")
    if ppo is None or ppo["gain_greedy"][2] < need:
        return [f"- guess: not evaluated (ppo needs >= {need} finished seeds)"]
    (g, h, n), (sg, sh, _) = ppo["gain_greedy"], ppo["gain_sampled"]
    learns = g >= 5 and g - h > 0
    return [
        f"- guess: {'RL LEARNS' if learns else 'null result'} (greedy gain {g:+.1f} ± {h:.1f} points over {n} seeds; "
        f"sampled gain {sg:+.1f} ± {sh:.1f})"
    ] + ([] if learns else ["", "**Null result**: the gain does not pass the decision rule."])


def verdict_moe(stats):
    pairs = tuple((f"kvfp8-{c}", "kvfp8-none") for c in ("tis", "icepop", "dis", "replay"))
    return verdict_mismatch(stats, MOE_ARMS, pairs, (("kvfp8-icepop", "kvfp8-none"), ("kvfp8-replay", "kvfp8-none")))


def verdict_collapse(stats, spec):
    """Issue 23's collapse rule on stats[task][arm] (arm_stats with the grid's collapse spec): per task, each arm's
    collapsed seeds; (1) the positive control: spec["control"] collapses in at least spec["control_share"] of its seeds;
    (2) each (arm, reference) of spec["pairs"]: PREVENTS if the arm collapses less often with Fisher's exact p <
    spec["alpha"], CAUSES if more often with p < alpha, else NULL (fewer than spec["need"] seeds in either: NOT JUDGED);
    the pairs are uninformative where the control fails. Beside them, the early warnings of each collapse: did the
    sequence ESS fall below spec["ess"], or max |log k| rise above spec["logk"], before (or at) the collapse step? And
    with spec["secondary"] (margins), the same pairs' counts and Fisher's p at each of those margins, not decisive."""
    lines, decided, judged = [], [], False
    for task, arms in stats.items():

        def steps(a):
            return [p["collapse"] for p in arms.get(a, {}).get("seeds", {}).values()]

        lines += [
            f"### {task}",
            "",
            "| arm | seeds | collapsed | steps of collapse | ESS fell first | max log k rose first |",
            "|---|---|---|---|---|---|",
        ]
        for a, c in arms.items():
            per = c["seeds"].values()
            hit = [p for p in per if p["collapse"] is not None]

            def first(k):
                return sum(p[k] is not None and p[k] <= p["collapse"] for p in hit)

            lines.append(
                f"| {a} | {len(per)} | {len(hit)} | {', '.join(str(p['collapse']) for p in hit) or '-'} | {first('ess_warn')} of {len(hit)} "
                f"| {first('logk_warn')} of {len(hit)} |"
            )
        ctrl = steps(spec["control"])
        ok = len(ctrl) >= spec["need"] and sum(s is not None for s in ctrl) >= spec["control_share"] * len(ctrl)
        lines += [
            "",
            f"- positive control ({spec['control']} collapses in >= {spec['control_share']:.0%} of its seeds): "
            + (
                "**HOLDS**"
                if ok
                else "NOT JUDGED (too few seeds)"
                if len(ctrl) < spec["need"]
                else "**FAILS**: the grid cannot show a correction preventing collapse"
            ),
        ]
        for a, ref in spec["pairs"]:
            x, y = steps(a), steps(ref)
            if min(len(x), len(y)) < spec["need"]:
                lines.append(f"- {a} vs {ref}: NOT JUDGED ({len(x)} and {len(y)} seeds; {spec['need']} needed)")
                continue
            cx, cy, judged = sum(s is not None for s in x), sum(s is not None for s in y), True
            pval = fisher_exact(cx, len(x) - cx, cy, len(y) - cy)
            v = "NULL" if pval >= spec["alpha"] else "PREVENTS" if cx < cy else "CAUSES"
            informative = ok or ref != spec["control"]
            if v != "NULL" and informative:
                decided.append(f"{task}: {a} {v} collapse against {ref}")
            lines.append(
                f"- {a} vs {ref}: **{v}** (collapsed {cx} of {len(x)} against {cy} of {len(y)}; Fisher's exact p = {pval:.3g})"
                + ("" if informative else ", uninformative: the positive control fails")
            )
        for m in spec.get("secondary", ()):
            cells = []
            for a in dict.fromkeys(x for pair in spec["pairs"] for x in pair):
                per = list(arms.get(a, {}).get("seeds", {}).values())
                cells.append(f"{a} {sum(p[f'collapse_{m:g}'] is not None for p in per)} of {len(per)}")
            tests = []
            for a, ref in spec["pairs"]:
                x, y = ([p[f"collapse_{m:g}"] for p in arms.get(k, {}).get("seeds", {}).values()] for k in (a, ref))
                if min(len(x), len(y)) >= spec["need"]:
                    cx, cy = sum(s is not None for s in x), sum(s is not None for s in y)
                    tests.append(f"{a} vs {ref} p = {fisher_exact(cx, len(x) - cx, cy, len(y) - cy):.3g}")
            lines.append(
                f"- secondary, not decisive: at a margin of {100 * m:g} points, collapsed {', '.join(cells)}"
                + (f"; {', '.join(tests)}" if tests else "")
            )
        lines.append("")
    if decided:
        return lines + [f"Decisive comparisons: {'; '.join(decided)}."]
    return lines + (
        ["**Null result**: no comparison passes the decision rule."]
        if judged
        else ["**Not judged**: no comparison has enough seeds yet."]
    )


VERDICTS = {
    "mismatch": verdict_mismatch,
    "moe": verdict_moe,
    "horizon": verdict_horizon,
    "multi-turn": verdict_multi_turn,
    "guess-learns": verdict_guess_learns,
    "guess-learns-rep": verdict_guess_learns,
    "guess-learns-300": lambda stats: verdict_guess_learns(stats, need=5),
    "credit": lambda stats: verdict_credit(
        stats, GRIDS["credit"]["points"], GRIDS["credit"]["need"], GRIDS["credit"]["ceilings"], REPO
    ),
    "collapse": lambda stats: verdict_collapse(stats, GRIDS["collapse"]["collapse"]),
    "collapse-flip": lambda stats: verdict_collapse(stats, GRIDS["collapse-flip"]["collapse"]),
    "collapse-int4": lambda stats: verdict_collapse(stats, GRIDS["collapse-int4"]["collapse"]),
    "credit-b16": lambda stats: verdict_credit_b16(stats),
}


def plots(g, runs, task, out_dir):
    """One PNG per family of quantities (rows of axes: quantities; columns: algorithms when split_by_algo).
    Lines: seed mean per arm; shaded: min-max over seeds. Returns the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    by_arm = {a: rs for a in g["arms"] if (rs := [r for r in runs if r["task"] == task and r["arm"] == a])}
    groups = {}
    for a in by_arm:
        groups.setdefault(a.split("-")[0] if g.get("split_by_algo") else "all arms", []).append(a)
    color = {
        a: plt.cm.tab10(i % 10) for arms in groups.values() for i, a in enumerate(arms)
    }  # same label, same colour in each column
    smooth = max(1, max(r["steps"] for r in runs) // 30)

    def seed_curve(rs, key, k):
        pts = {}
        for r in rs:
            for row in r["rows"]:
                if finite(row.get(key)):
                    pts.setdefault(row["step"], []).append(row[key])
        x = np.array(sorted(pts))
        k = min(k, len(x))
        ys = (
            [np.convolve([f(pts[s]) for s in x], np.ones(k) / k, mode="valid") for f in (np.mean, min, max)]
            if k
            else []
        )
        return x[k - 1 :], ys

    def figure(name, keys, k=smooth, samples=False, logy=False):
        keys = [key for key in keys if any(len(seed_curve(rs, key, 1)[0]) for rs in by_arm.values())]
        if not keys:
            return []
        fig, axes = plt.subplots(len(keys), len(groups), figsize=(6 * len(groups), 3.3 * len(keys)), squeeze=False)
        for i, key in enumerate(keys):
            for j, (gname, arms) in enumerate(groups.items()):
                ax = axes[i][j]
                for a in arms:
                    x, ys = seed_curve(by_arm[a], key, k)
                    if len(x):
                        x = x * by_arm[a][0]["rollout_batch"] if samples else x
                        ax.plot(
                            x,
                            ys[0],
                            color=color[a],
                            label=f"{a} (n={len(by_arm[a])})",
                            marker="." if len(x) < 12 else None,
                        )
                        ax.fill_between(x, ys[1], ys[2], color=color[a], alpha=0.15)
                ax.set(
                    title=f"{task}: {key} ({gname})" + (f", {k}-step moving mean" if k > 1 else ""),
                    xlabel="samples seen (critic pretraining not counted)" if samples else "step",
                    yscale="log" if logy else "linear",
                )
                ax.grid(alpha=0.3)
                if ax.lines:
                    ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"{task}_{name}.png"), dpi=80)
        plt.close(fig)
        return [f"{task}_{name}.png"]

    def single(fig, ax, name):  # a one-axis figure: grid, legend, saved as <task>_<name>.png
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, f"{task}_{name}.png"), dpi=80)
        plt.close(fig)
        return f"{task}_{name}.png"

    files = figure("accuracy", ["eval/greedy_acc", "eval/sampled_acc"], 1, samples=True) + figure(
        "k3", ["mismatch/k3"], logy=True
    )
    files += figure("masked", ["mismatch/masked_frac_low", "mismatch/masked_frac_high"]) + figure(
        "grad_norm", ["ppo/grad_norm"]
    )
    files += figure("entropy", ["ppo/entropy"]) + figure("ev", ["critic/explained_variance", "vine/explained_variance"])
    files += figure("collapse", ["mismatch/ess", "mismatch/seq_ess", "mismatch/abs_diff_max", "mismatch/k3_slope"])
    files += figure("identical_reward_groups", ["grpo/identical_reward_frac"])
    files += figure("routing", ["moe/flip_frac", "moe/flip_any_layer_frac"]) + figure(
        "ratio_tail", ["mismatch/ratio_p999", "mismatch/ratio_max"]
    )
    if spec := g.get(
        "collapse"
    ):  # the time-to-collapse curves: the share of each arm's seeds not collapsed by each step
        fig, ax = plt.subplots(figsize=(7, 3.5))
        grid = list(range(0, max(r["steps"] for r in runs) + 1))
        for a, rs in by_arm.items():
            ax.step(
                grid,
                survival(
                    [collapse_step(r["rows"], spec["key"], spec["margin"], r.get("nonfinite_step")) for r in rs], grid
                ),
                where="post",
                color=color[a],
                label=f"{a} (n={len(rs)})",
            )
        ax.set(title=f"{task}: seeds not collapsed", xlabel="step", ylabel="share of seeds", ylim=(-0.05, 1.05))
        files.append(single(fig, ax, "survival"))
    labels = sorted(
        {k for rs in by_arm.values() for r in rs for row in r["rows"] for k in row if k.startswith("critic/ev_pos_")},
        key=lambda k: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", k)],
    )
    if labels:  # per-position EV at the end: mean over the last 20% of steps per run, then over seeds
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for a, rs in by_arm.items():
            end = [
                [row.get(k) for r in rs for row in r["rows"] if row["step"] > 0.8 * r["steps"] and finite(row.get(k))]
                for k in labels
            ]
            if any(end):
                ax.plot(
                    range(len(labels)), [np.mean(v) if v else np.nan for v in end], marker="o", color=color[a], label=a
                )
        ax.set_xticks(range(len(labels)), [k.removeprefix("critic/ev_pos_") for k in labels], fontsize=7)
        ax.set(
            title=f"{task}: explained variance per response position (last 20% of steps)",
            xlabel="response position",
            ylabel="EV",
        )
        files.append(single(fig, ax, "ev_per_position"))
    return files


def report(name, g, runs, meta, md_path, asset_dir, quick, n_aside=0):
    def ci(c):
        return "-" if c[2] == 0 else f"{c[0]:.1f}" if c[2] < 2 else f"{c[0]:.1f} ± {c[1]:.1f}"

    def fmt(x, spec):
        return "-" if x != x else format(x, spec)

    out = [
        f"# Lab grid `{name}`" + (" (quick smoke variant: not evidence)" if quick else ""),
        "",
        "## Pre-registered hypothesis",
        "",
        g["hypothesis"],
        "",
        "## Decision rule",
        "",
        g["decision_rule"],
        "",
        *(
            ["## Amendments (each written before the runs it concerns)", "", *[f"- {a}" for a in g["amendments"]], ""]
            if g.get("amendments")
            else []
        ),
        "## How it was run",
        "",
        "```",
        *meta.get("commands", []),
        "```",
        "",
        f"Each run: `python train_ppo.py --out-dir <runs-dir>/{name}/<task>/<arm>/seed<k> --seed <k> --task <task> --steps <steps> <base> <task flags> <arm flags>`;"
        f" steps {g['steps']}, seeds {g['seeds']}, tasks {g['tasks']}.",
        "",
        f"Base flags: `{shlex.join(g['base'])}`"
        + "".join(f"; {t}: `{shlex.join(f)}`" for t, f in g.get("task_flags", {}).items()),
        "",
        "| arm | flags | seeds finished (all tasks) |",
        "|---|---|---|",
    ]
    out += [
        f"| {a} | `{flags_text(f, g['tasks'])}` | {sum(r['arm'] == a for r in runs)} of {len(g['seeds']) * len(g['tasks'])} |"
        for a, f in g["arms"].items()
    ]
    fps = {t: sorted({str(r.get("start_model")) for r in runs if r["task"] == t}) for t in g["tasks"]}
    out += [
        "",
        "Start model per task (sha256 of its weights, 16 hex digits; None: a run from before fingerprints): "
        + "; ".join(f"{t} {', '.join(f)}" for t, f in fps.items() if f)
        + ".",
    ]
    if n_aside:
        out += [
            f"{n_aside} earlier run(s) that started from another build of the start model are set aside (not in any table "
            f"or verdict): `{os.path.basename(asset_dir)}/set-aside.jsonl.gz`."
        ]
    n_eval = sorted({r["eval_n"] for r in runs if r.get("eval_n")})
    out += [
        "",
        f"Held-out problems per evaluation (from the run logs): {', '.join(map(str, n_eval)) or 'unknown'}. Accuracies in points: "
        "seed mean ± half-width of the 95% t-interval; best = max over the evaluations after step 0. k3: mean over the first / last 20% "
        "of steps; masked fractions: mean over all steps; EV: mean critic explained variance over steps 51-80; pretrain: critic "
        "pretraining steps (seed mean), whose rollouts are not counted in the samples seen.",
    ]
    for old in [
        f for f in os.listdir(asset_dir) if f.endswith(".png")
    ]:  # no stale plots of arms or tasks since removed
        os.remove(os.path.join(asset_dir, old))
    stats = {}
    for task in g["tasks"]:
        out += [
            "",
            f"## {task}",
            "",
            "| arm | seeds | final greedy | best greedy | final sampled | k3 first 20% | k3 last 20% | masked low "
            "| masked high | EV 51-80 | pretrain |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for a in g["arms"]:
            c = arm_stats([r for r in runs if r["task"] == task and r["arm"] == a], g.get("collapse"))
            if not c["seeds"]:
                out.append(f"| {a} | 0 |" + " - |" * 9)
                continue
            stats.setdefault(task, {})[a] = c
            out.append(
                f"| {a} | {len(c['seeds'])} | {ci(c['final_greedy'])} | {ci(c['best_greedy'])} | {ci(c['final_sampled'])} | {fmt(c['k3_first'][0], '.2e')} "
                f"| {fmt(c['k3_last'][0], '.2e')} | {fmt(c['masked_low'][0], '.3%')} | {fmt(c['masked_high'][0], '.3%')} "
                f"| {fmt(c['ev_51_80'][0], '.2f')} | {fmt(c['pretrain'][0], '.0f')} |"
            )
        if g.get("moe") and task in stats:  # routing and the ratio's tail: seed means of per-run values
            out += [
                "",
                "Routing and the ratio's tail (seed means; flips: mean over steps of the share of token-layer router choices, "
                "or of tokens in any layer, that differ between engine and trainer; ratio p99.9: mean over steps of the "
                "step's 99.9% quantile of pi_trainer / pi_engine; ratio max: the largest over the run; grad norm: the policy's, "
                "mean over steps):",
                "",
                "| arm | flips | flips any layer | ratio p99.9 | ratio max | grad norm |",
                "|---|---|---|---|---|---|",
            ]
            out += [
                f"| {a} | {fmt(c['flips'][0], '.2%')} | {fmt(c['flips_any'][0], '.2%')} | {fmt(c['ratio_p999'][0], '.3f')} "
                f"| {fmt(c['ratio_max'][0], '.2f')} | {fmt(c['grad_norm'][0], '.3f')} |"
                for a, c in stats[task].items()
            ]
        if task in stats:
            rel = os.path.relpath(asset_dir, os.path.dirname(md_path))
            out += [""] + [f"![{f}]({rel}/{f})" for f in plots(g, runs, task, asset_dir)]
    out += ["", "## Verdict (computed mechanically from the decision rule)", ""]
    if (done := len(runs)) < (planned := len(g["arms"]) * len(g["tasks"]) * len(g["seeds"])):
        out += [
            f"**Partial grid: {done} of {planned} runs finished.** What follows applies the rule to the finished runs only; "
            "the grid's verdict is the one computed once every run has finished.",
            "",
        ]
    out += VERDICTS[name](stats)
    if meta.get("failed"):
        out += ["", "## Failed runs", ""] + [f"- `{k}`, log ends:\n\n```\n{v}\n```" for k, v in meta["failed"].items()]
    with open(md_path, "w") as f:
        f.write("\n".join(out) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("grid", choices=sorted(GRIDS))
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke variant: 2 seeds, addition, 2 arms, 4 steps; report under the runs dir",
    )
    p.add_argument("--jobs", type=int, default=2, help="runs at once (default 2: one per core)")
    p.add_argument("--runs-dir", default="lab_runs")
    p.add_argument(
        "--only-report",
        action="store_true",
        help="train nothing: report from the run folders and the compact metrics file",
    )
    p.add_argument("--arms", help="comma-separated arm labels, or 'core'")
    p.add_argument("--tasks", help="comma-separated tasks")
    p.add_argument("--seeds", help="comma-separated seeds")
    p.add_argument(
        "--set-aside",
        action="store_true",
        help="move stored runs that started from another build of the start model "
        "out of the grid (into set-aside.jsonl.gz beside its metrics) instead of refusing to run",
    )
    args = p.parse_args()
    g = grid_spec(args.grid, args.quick)
    if not args.quick and (todo := unregistered(g)):
        sys.exit(
            f"grid {args.grid} is not registered: {', '.join(todo)} still hold {TODO}. Write them and commit before the first "
            "run (--quick runs the smoke variant)"
        )
    root = os.path.abspath(os.path.join(args.runs_dir, args.grid + ("-quick" if args.quick else "")))
    md_path, asset_dir = (
        (f"{root}/report.md", f"{root}/report")
        if args.quick
        else (f"{REPO}/docs/lab/{args.grid}.md", f"{REPO}/docs/lab/{args.grid}")
    )
    compact, aside = os.path.join(asset_dir, "metrics.jsonl.gz"), os.path.join(asset_dir, "set-aside.jsonl.gz")
    meta, stored = load_compact(compact)
    if not args.only_report:
        arms = g["core"] if args.arms == "core" else args.arms.split(",") if args.arms else list(g["arms"])
        tasks = args.tasks.split(",") if args.tasks else g["tasks"]
        seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else g["seeds"]
        if (
            bad := [x for x in arms if x not in g["arms"]]
            + [t for t in tasks if t not in g["tasks"]]
            + [s for s in seeds if s not in g["seeds"]]
        ):
            sys.exit(f"not in this grid: {bad}; arms {list(g['arms'])}, tasks {g['tasks']}, seeds {g['seeds']}")
        os.makedirs(root, exist_ok=True)
        if not os.path.exists(ignore := os.path.join(os.path.dirname(root), ".gitignore")):
            with open(ignore, "w") as f:
                f.write("*\n")  # run folders (checkpoints) are never committed; the report and its compact metrics are
        command = shlex.join(["python", "bench/lab.py", *sys.argv[1:]])
        meta["commands"] = [c for c in meta.get("commands", []) if c != command] + [command]
        # Core arms first; within a phase, every arm of a seed before the next seed, so a partial grid stays balanced.
        core = [a for a in g["core"] if a in arms]
        todo = [
            (t, a, s)
            for phase in (core, [a for a in arms if a not in core])
            for t in tasks
            for s in seeds
            for a in phase
        ]
        # One grid, one start model: stored runs that started from another build of it (another CPU, library or code
        # version; older runs carry no fingerprint) are never mixed with new ones. --set-aside moves them out. The start
        # models are kept beside the report (keep_start_model), so a grid resumed on a fresh machine restores them.
        paths = {t: default_start_model(g, t, asset_dir) for t in tasks}
        fps = {t: start_model(p) for t, p in paths.items()}
        if other := [r for r in stored if r["task"] in fps and r.get("start_model") != fps[r["task"]]]:
            if not args.set_aside:
                sys.exit(
                    f"{len(other)} stored run(s) of {args.grid} started from another build of the start model (fingerprints "
                    f"{sorted({str(r.get('start_model')) for r in other})}; this machine's: {fps}). New runs would not be "
                    f"comparable with them: rerun with --set-aside to move them to {aside} and run the grid anew."
                )
            aside_meta, aside_runs = load_compact(aside)
            save_compact(
                aside, {**aside_meta, "why": "started from another build of the start model"}, aside_runs + other
            )
            stored = [r for r in stored if r not in other]
            save_compact(compact, meta, stored)
            print(f"set aside {len(other)} stored run(s) into {aside}", flush=True)
        for p in paths.values():  # the runs about to start use these start models: a later machine restores them
            keep_start_model(p, asset_dir)
        try:
            failed = run_all(
                g,
                root,
                todo,
                args.jobs,
                {(r["task"], r["arm"], r["seed"]) for r in stored if r["steps"] == steps_of(g, r["task"])},
            )
        except (
            KeyboardInterrupt
        ):  # the runs this process started were stopped (they resume next time); report the finished ones
            print("interrupted: writing the report of the finished runs", flush=True)
            failed = {}
        old = {
            k: v for k, v in meta.get("failed", {}).items() if not finished(f"{root}/{k}", steps_of(g, k.split("/")[0]))
        }
        meta["failed"] = {**old, **failed}
    # Finished run folders win; runs only in the compact file (e.g. committed from another machine) are kept.
    local = collect(g, root) if os.path.isdir(root) else []
    have = {(r["task"], r["arm"], r["seed"]) for r in local}
    runs = local + [
        r
        for r in stored
        if (r["task"], r["arm"], r["seed"]) not in have
        and r["arm"] in g["arms"]
        and r["task"] in g["tasks"]
        and r["seed"] in g["seeds"]
        and r["steps"] == steps_of(g, r["task"])
    ]
    if not runs:
        sys.exit(f"nothing to report: no finished runs under {root} and none in {compact}")
    os.makedirs(asset_dir, exist_ok=True)
    if local:
        save_compact(compact, meta, runs)
    report(args.grid, g, runs, meta, md_path, asset_dir, args.quick, len(load_compact(aside)[1]))
    print(f"report: {md_path} ({len(runs)} finished runs; compact metrics {compact})", flush=True)
    if not args.only_report and failed:
        sys.exit(f"{len(failed)} run(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
