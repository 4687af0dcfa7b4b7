"""The run's metrics log: the Metrics accumulator, timed phases, and RunLog, which writes the run folder's records:
metrics.jsonl (+ optional wandb / TensorBoard), config.json, samples and PNG plots.

    out_dir/config.json                 resolved config, derived sizes, git revision, package versions, and
                                        the options each resume changed ("resumes")
    out_dir/metrics.jsonl               one JSON line per step (every metric of every phase); critic
                                        pretraining rows have step 0 and a pretrain/step key
    out_dir/plots/*.png                 reward & accuracy, mismatch (KL apart from masked fractions), critic,
                                        critic pretraining, time per phase
    out_dir/tokens/step_N-dpR.parquet   with --token-records: one row per model token of the step (TOKEN_COLUMNS);
                                        a resume drops those of the steps after its checkpoint, as it drops their
                                        metrics rows

The checkpoints, the lock and the checks a resume makes against these records: checkpoint.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

import losses
from checkpoint import atomic_write, read_metrics, run_record


class Metrics:
    """One step's metrics, reduced over repeats and ranks once, into float32 figures.

    add(d): values repeated over micro-batches, minibatches or phases; reduce() gives their mean over repeats and
    ranks (TP peers hold equal values), or the max / min for keys ending in _max / _min.
    add_ratio(key, total, count): a ratio of sums; reduce() gives sum(total) / sum(count) over every call and rank
    (NaN where the count is 0), so it weighs each token or sample alike however they fall into calls and ranks.
    add_ev({key: stats}): an explained variance, from the [5] sufficient statistics of losses.ev_stats; reduce()
    sums them over every call and rank, then gives losses.ev_from_stats of the sums: the EV of all the tokens at once,
    not a mean of per-call or per-rank EVs (NaN where the returns are constant or there is no token). TP peers add the
    same statistics, which scales every sum alike and leaves the EV as it is (the same holds for the ratios).
    A rank may add ratio or EV keys the others lack (a reward's extra keys): the key sets are merged first.
    """

    def __init__(self):
        self.values: dict[str, list[torch.Tensor]] = {}
        self.ratios: dict[str, list[float]] = {}
        self.evs: dict[str, torch.Tensor] = {}

    def add(self, new: dict) -> None:
        for k, v in new.items():
            self.values.setdefault(k, []).append(torch.as_tensor(v).detach().float().cpu().reshape(()))

    def add_ratio(self, key: str, total, count) -> None:
        acc = self.ratios.setdefault(key, [0.0, 0.0])
        acc[0] += float(total)
        acc[1] += float(count)

    def add_ev(self, stats: dict) -> None:
        for k, st in stats.items():
            st = torch.as_tensor(st).detach().double().cpu().reshape(5)
            self.evs[k] = self.evs[k] + st if k in self.evs else st

    def reduce(self) -> dict[str, float]:
        """Collective: every rank calls it, with the same add() keys."""
        keys = sorted(self.values)

        def pick(k, v):
            if k.endswith("_max"):
                return v.max()
            if k.endswith("_min"):
                return v.min()
            return v.mean()

        vals = torch.stack([pick(k, torch.stack(self.values[k])) for k in keys]) if keys else torch.zeros(0)
        ratio_keys = sorted(self.ratios)
        ev_keys = sorted(self.evs)
        if dist.is_initialized():
            mx, mn = vals.clone(), vals.clone()
            for t, op in ((vals, dist.ReduceOp.SUM), (mx, dist.ReduceOp.MAX), (mn, dist.ReduceOp.MIN)):
                dist.all_reduce(t, op=op)
            vals = vals / dist.get_world_size()
            vals = torch.where(torch.tensor([k.endswith("_max") for k in keys], dtype=torch.bool), mx, vals)
            vals = torch.where(torch.tensor([k.endswith("_min") for k in keys], dtype=torch.bool), mn, vals)
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, (ratio_keys, ev_keys))
            ratio_keys = sorted({k for p in parts for k in p[0]})
            ev_keys = sorted({k for p in parts for k in p[1]})
        sums = torch.tensor([self.ratios.get(k, [0.0, 0.0]) for k in ratio_keys], dtype=torch.float64).reshape(-1, 2)
        # A rank without an EV key adds zeros: no token.
        stats = torch.tensor(
            [self.evs[k].tolist() if k in self.evs else [0.0] * 5 for k in ev_keys], dtype=torch.float64
        )
        stats = stats.reshape(-1, 5)
        if dist.is_initialized():  # one collective for both kinds of sums
            both = torch.cat([sums.flatten(), stats.flatten()])
            dist.all_reduce(both)
            sums = both[: sums.numel()].reshape(-1, 2)
            stats = both[sums.numel() :].reshape(-1, 5)
        # A ratio is a float32 figure like every other metric (its sums are float64: counts of many tokens).
        ratios = [float(torch.tensor(t / c if c else float("nan"), dtype=torch.float32)) for t, c in sums.tolist()]
        # Summed before the division: the EV of the global batch.
        evs = losses.ev_from_stats(stats).tolist()
        return {**dict(zip(keys, vals.tolist())), **dict(zip(ratio_keys, ratios)), **dict(zip(ev_keys, evs))}


@contextlib.contextmanager
def timed(m: Metrics, name: str):
    """The phase's seconds as time/<name>; on CUDA also its peak allocated GiB as mem/<name>_gib_max."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    yield
    m.add({f"time/{name}": time.perf_counter() - start})
    if cuda:
        m.add({f"mem/{name}_gib_max": torch.cuda.max_memory_allocated() / 2**30})


K3_SLOPE_WINDOW = 10  # steps in mismatch/k3_slope (losses.window_slope), logged with every step's row


class RunLog:
    """Rank 0 writes; other ranks' calls are no-ops. ``history`` holds every logged row (for the plots)."""

    def __init__(
        self,
        out_dir: str,
        rank: int,
        config: dict,
        resume_step: int,
        wandb: bool = False,
        tensorboard: bool = False,
        changes: dict | None = None,
        inputs: dict | None = None,
    ):
        """changes: the options (and inputs) a resume changed, {name: [old, new]}; config.json keeps a list of them
        ("resumes"). inputs: the run's input fingerprints (checkpoint.input_fingerprints), recorded for the next resume
        to compare."""
        self.dir = out_dir
        self.rank = rank
        self.history = []
        self.writers = []
        self.wandb = wandb
        self.bar = None
        if rank != 0:
            return
        os.makedirs(os.path.join(out_dir, "plots"), exist_ok=True)
        resumes = []
        if resume_step >= 0:  # check_resume has read config.json
            resumes = run_record(out_dir).get("resumes", [])
        if changes:
            resumes.append({"step": resume_step, "changed": changes})
        meta = {
            "config": config,
            "inputs": inputs,
            "resumes": resumes,
            "git": _git_revision(),
            "argv": sys.argv,
            "versions": _versions(),
        }
        atomic_write(os.path.join(out_dir, "config.json"), json.dumps(meta, indent=1))
        path = os.path.join(out_dir, "metrics.jsonl")
        if os.path.exists(path):  # keep what the checkpoint we resume from had seen; drop what came after it
            self.history = [row for row in read_metrics(path) if row["step"] <= resume_step]
        atomic_write(path, "".join(json.dumps(row) + "\n" for row in self.history))
        tokens = os.path.join(out_dir, "tokens")  # so do the per-token records of the steps after it
        for name in os.listdir(tokens) if os.path.isdir(tokens) else []:
            if name.startswith("step_") and int(name[5:11]) > resume_step:
                os.remove(os.path.join(tokens, name))
        if wandb:
            import wandb as wb

            self.writers.append(lambda row: wb.log(row, step=row["step"]))
            wb.init(project="icepop-ppo", dir=out_dir, config=config, resume="allow")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            tb = SummaryWriter(os.path.join(out_dir, "tb"))
            self.writers.append(lambda row: [tb.add_scalar(k, v, row["step"]) for k, v in row.items() if k != "step"])

    def log(self, row: dict) -> None:
        if self.rank != 0:
            return
        # k3's trend over the last K3_SLOPE_WINDOW steps (issue: collapse), from the 2nd step
        if "mismatch/k3" in row and "pretrain/step" not in row:
            earlier = [r["mismatch/k3"] for r in self.history if "mismatch/k3" in r and "pretrain/step" not in r]
            ks = earlier[1 - K3_SLOPE_WINDOW :]
            if ks:
                row["mismatch/k3_slope"] = losses.window_slope(ks + [row["mismatch/k3"]])
        self.history.append(row)
        with open(os.path.join(self.dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        for write in self.writers:
            write(row)

    def start_progress(self, total: int, initial: int) -> None:
        """A progress bar over the steps (rank 0)."""
        self.bar = tqdm(total=total, initial=initial, disable=self.rank != 0, dynamic_ncols=True)

    def progress(self, row: dict) -> None:
        self.bar.update(1)
        self.bar.set_postfix(
            reward=f"{row['rollout/reward_mean']:.2f}",
            acc=f"{row.get('eval/greedy_acc', float('nan')):.2f}",
            masked=f"{row['mismatch/masked_frac']:.2%}",
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def samples(self, step: int, records: list[dict]) -> None:
        """One evaluation's completions: <out-dir>/samples/step_<step:06d>.jsonl, a JSON object per completion
        (kind greedy / sampled, problem, sample, prompt, answer, completion, reward and the reward's extra keys;
        values JSON cannot hold are written as their repr), and with --report-to wandb a Table "eval/samples"."""
        if self.rank != 0:
            return
        os.makedirs(os.path.join(self.dir, "samples"), exist_ok=True)
        lines = "".join(json.dumps({"step": step, **r}, default=repr) + "\n" for r in records)
        atomic_write(os.path.join(self.dir, "samples", f"step_{step:06d}.jsonl"), lines)
        if self.wandb and records:
            import wandb as wb

            columns = list(dict.fromkeys(k for r in records for k in r))

            def cell(v):
                return v if isinstance(v, (str, int, float, bool)) or v is None else json.dumps(v, default=repr)

            table = wb.Table(columns=columns, data=[[cell(r.get(c)) for c in columns] for r in records])
            wb.log({"eval/samples": table}, step=step)

    def plot(self) -> None:
        """One PNG per panel, redrawn from the whole history; one family of quantities (one unit) per axis."""
        if self.rank != 0 or not self.history:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rl = [row for row in self.history if "pretrain/step" not in row]
        pre = [row for row in self.history if "pretrain/step" in row]
        ev_pos = sorted(
            {k for row in rl for k in row if k.startswith("critic/ev_pos_")},
            key=lambda k: int(k.split("_")[-1].split("-")[0]),
        )
        panels = {  # file -> (rows, x key, [(y label, keys), ...]): one subplot per family
            "reward": (
                rl,
                "step",
                [("reward / accuracy", ["rollout/reward_mean", "eval/greedy_acc", "eval/sampled_acc"])],
            ),
            "mismatch": (
                rl,
                "step",
                [
                    ("KL estimate (nats/token)", ["mismatch/k1", "mismatch/k3"]),
                    (
                        "fraction of tokens",
                        ["mismatch/masked_frac", "mismatch/masked_frac_low", "mismatch/masked_frac_high"],
                    ),
                ],
            ),
            "collapse": (
                rl,
                "step",
                [
                    ("effective sample size", ["mismatch/ess", "mismatch/seq_ess"]),
                    ("max |log k|", ["mismatch/abs_diff_max"]),
                    ("k3 slope per step", ["mismatch/k3_slope"]),
                    ("policy", ["ppo/grad_norm", "ppo/entropy"]),
                ],
            ),
            "critic": (
                rl,
                "step",
                [
                    ("explained variance", ["critic/explained_variance", *ev_pos]),
                    ("value loss", ["critic/value_loss"]),
                    ("mean value", ["critic/value_mean"]),
                ],
            ),
            "critic_pretrain": (
                pre,
                "pretrain/step",
                [("explained variance", ["critic/explained_variance"]), ("value loss", ["critic/value_loss"])],
            ),
            "time": (rl, "step", [("seconds", sorted({k for row in rl for k in row if k.startswith("time/")}))]),
        }
        for name, (rows, x, axes) in panels.items():
            if not rows:
                continue
            fig, subs = plt.subplots(len(axes), 1, figsize=(7, 2.2 + 2 * len(axes)), sharex=True, squeeze=False)
            for ax, (ylabel, keys) in zip(subs[:, 0], axes):
                for key in keys:
                    pts = [(row[x], row[key]) for row in rows if key in row]
                    if pts:
                        ax.plot(*zip(*pts), marker="." if len(pts) < 30 else None, label=key)
                ax.set_ylabel(ylabel)
                ax.grid(alpha=0.3)
                if ax.lines:
                    ax.legend(fontsize=7)
            subs[-1, 0].set_xlabel(x)
            subs[0, 0].set_title(name)
            fig.tight_layout()
            fig.savefig(os.path.join(self.dir, "plots", f"{name}.png"), dpi=90)
            plt.close(fig)


def _git_revision() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _versions() -> dict:
    from importlib.metadata import distributions

    return {
        d.metadata["Name"]: d.version
        for d in distributions()
        if d.metadata["Name"] in ("torch", "transformers", "datasets", "sglang")
    }


# ----------------------------------------------------------------------------- per-token records (--token-records)

TOKEN_COLUMNS = {
    "step": "the RL step",
    "row": "the row in the step's global batch (dp rank r's rows follow rank r - 1's)",
    "position": "the token's column in the row's response (observations of multi-turn rows are left out)",
    "token": "the token id",
    "engine_logp": "the rollout engine's log-prob (pi_infer)",
    "trainer_logp": "the trainer's recompute at the rollout weights (pi_old)",
    "ratio": "k = pi_old / pi_infer",
    "side": "where k lies against the band [--icepop-low, --icepop-high]: below, in or above",
    "weight": "the correction's weight on the token's policy gradient (IcePop's M(k): k in the band, else 0; TIS's "
    "min(k, C); the geometric sequence mask), 0 on untrained tokens; null with --correction none or dis (DIS acts "
    "inside its loss)",
    "trained": "the token is in the losses (its row has a reward, and for GRPO a group with >= 2 rewarded rows)",
    "advantage": "the policy's advantage (after whitening)",
    "value": "the critic's value V_old (null without a critic)",
    "return": "the critic's target, GAE(1) return (null without a critic)",
    "reward": "the row's reward (multi-turn: its episode's return)",
}


def write_token_records(out_dir: str, step: int, dp_rank: int, columns: dict) -> str:
    """One parquet file of per-token records (columns: TOKEN_COLUMNS' names; None = a null column), written through a
    dot-named temp file and a rename, so a kill leaves the whole file or none. Returns its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    assert list(columns) == list(TOKEN_COLUMNS), list(columns)
    n = len(columns["position"])
    table = pa.table(
        {
            k: pa.nulls(n, pa.float32()) if v is None else pa.array(v if isinstance(v, list) else v.numpy())
            for k, v in columns.items()
        }
    )
    folder = os.path.join(out_dir, "tokens")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"step_{step:06d}-dp{dp_rank}.parquet")
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path
