"""The run folder: metrics.jsonl (+ optional wandb / TensorBoard), PNG plots, atomic checkpoints.

    out_dir/.lock                       held by the live run (a second run into the folder is refused)
    out_dir/config.json                 resolved config, derived sizes, git revision, package versions, and
                                        the options each resume changed ("resumes")
    out_dir/metrics.jsonl               one JSON line per step (every metric of every phase); critic
                                        pretraining rows have step 0 and a pretrain/step key
    out_dir/plots/*.png                 reward & accuracy, mismatch (KL apart from masked fractions), critic,
                                        critic pretraining, time per phase
    out_dir/checkpoints/step_000050/    policy/ and critic/ (HF folders), trainer_rank{r}.pt, meta.json

A checkpoint is written into a hidden temp folder, its meta.json last, and renamed into place: every step_* folder
is a checkpoint, and one that lacks a file is damaged. A resume takes the newest whose files check out
(checkpoint_problem), so a kill at any moment leaves the previous checkpoint usable, and a damaged newest checkpoint
(a full disk, a copy cut short) falls back to the one before, with a note. A folder with records but no usable
checkpoint is never overwritten (check_fresh_start). A resume must mean what the run meant: the same options
(check_resume) and the same inputs by content (input_fingerprints, check_inputs).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from dataclasses import MISSING, asdict, fields

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from tqdm import tqdm

import losses
from moe import checkpoint_tensors
from parallel import full_weights, print0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


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
            return v.max() if k.endswith("_max") else v.min() if k.endswith("_min") else v.mean()

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
        if dist.is_initialized():
            dist.all_reduce(sums)
        # A ratio is a float32 figure like every other metric (its sums are float64: counts of many tokens).
        ratios = [float(torch.tensor(t / c if c else float("nan"), dtype=torch.float32)) for t, c in sums.tolist()]
        # Summed before the division: the EV of the global batch (a rank without a key adds zeros, no token).
        no_token = torch.zeros(5, dtype=torch.float64)
        stats = (
            torch.stack([self.evs.get(k, no_token) for k in ev_keys])
            if ev_keys
            else torch.zeros(0, 5, dtype=torch.float64)
        )
        if dist.is_initialized() and ev_keys:
            dist.all_reduce(stats)
        evs = losses.ev_from_stats(stats).tolist()
        return {**dict(zip(keys, vals.tolist())), **dict(zip(ratio_keys, ratios)), **dict(zip(ev_keys, evs))}


@contextlib.contextmanager
def timed(m: Metrics, name: str):
    """The phase's seconds as time/<name>; on CUDA also its peak allocated GiB as mem/<name>_gib_max."""
    if cuda := torch.cuda.is_available():
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
        ("resumes"). inputs: the run's input fingerprints (input_fingerprints), recorded for the next resume to compare."""
        self.dir, self.rank, self.history = out_dir, rank, []
        self.writers, self.wandb, self.bar = [], wandb, None
        if rank != 0:
            return
        os.makedirs(os.path.join(out_dir, "plots"), exist_ok=True)
        resumes = []
        if resume_step >= 0:  # check_resume has read config.json
            resumes = _recorded(out_dir).get("resumes", [])
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
        _atomic_write(os.path.join(out_dir, "config.json"), json.dumps(meta, indent=1))
        path = os.path.join(out_dir, "metrics.jsonl")
        if os.path.exists(path):  # keep what the checkpoint we resume from had seen; drop what came after it
            self.history = [row for row in _read_metrics(path) if row["step"] <= resume_step]
        _atomic_write(path, "".join(json.dumps(row) + "\n" for row in self.history))
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
        if (
            "mismatch/k3" in row and "pretrain/step" not in row
        ):  # k3's trend over the last K3_SLOPE_WINDOW steps (issue: collapse)
            ks = [r["mismatch/k3"] for r in self.history if "mismatch/k3" in r and "pretrain/step" not in r][
                1 - K3_SLOPE_WINDOW :
            ]
            row.update(
                {"mismatch/k3_slope": losses.window_slope(ks + [row["mismatch/k3"]])} if ks else {}
            )  # from the 2nd step
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
        values JSON cannot hold are written as their repr), and with --wandb a Table "eval/samples"."""
        if self.rank != 0:
            return
        os.makedirs(os.path.join(self.dir, "samples"), exist_ok=True)
        lines = "".join(json.dumps({"step": step, **r}, default=repr) + "\n" for r in records)
        _atomic_write(os.path.join(self.dir, "samples", f"step_{step:06d}.jsonl"), lines)
        if self.wandb and records:
            import wandb as wb

            columns = list(dict.fromkeys(k for r in records for k in r))

            def cell(v):
                return v if isinstance(v, (str, int, float, bool)) or v is None else json.dumps(v, default=repr)

            wb.log(
                {"eval/samples": wb.Table(columns=columns, data=[[cell(r.get(c)) for c in columns] for r in records])},
                step=step,
            )

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


def _read_metrics(path: str) -> list[dict]:
    """The rows of metrics.jsonl. A torn last line (a kill while it was written) is dropped with a note; a bad
    line elsewhere is an error naming the file and the line."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    rows = []
    for i, line in enumerate(lines, start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i < len(lines):
                raise ValueError(f"{path}: line {i} is not valid JSON ({e}); repair or remove it to resume") from None
            print(f"note: {path}: dropped a torn last line (line {i}, written when the run was killed)", flush=True)
    return rows


def _git_revision() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(
            ["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _versions() -> dict:
    from importlib.metadata import distributions

    return {
        d.metadata["Name"]: d.version
        for d in distributions()
        if d.metadata["Name"] in ("torch", "transformers", "datasets", "sglang")
    }


# ----------------------------------------------------------------------------- checkpoints


def safetensors_problem(folder: str) -> str | None:
    """Why a *.safetensors file in a model folder is unusable (truncated, unreadable header), or None.
    Reads only the headers: the data must end exactly where the header's last tensor does."""
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            need = 8 + n + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, OSError) as e:
            return f"{path} has an unreadable header ({type(e).__name__}: {e})"
        if os.path.getsize(path) != need:
            return f"{path} is truncated or damaged: {os.path.getsize(path)} bytes where its header needs {need}"
    return None


def checkpoint_problem(ckpt: str, algo: str = "ppo") -> str | None:
    """Why a checkpoint folder cannot be resumed from, or None. It checks every file a resume loads: meta.json, each
    model folder meta.json lists (older checkpoints: policy, and critic for --algo ppo) with its config.json and
    model.safetensors (sizes against the header), and every rank's trainer state (CRCs)."""
    try:
        with open(os.path.join(ckpt, "meta.json")) as f:
            meta = json.load(f)
        world_size, _ = int(meta["world_size"]), int(meta["step"])  # what check_resume and the resume read
    except FileNotFoundError:
        return "meta.json is missing (the writer renames only complete checkpoints into place: this one was damaged)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"meta.json is unreadable ({type(e).__name__}: {e})"
    for model in meta.get("models") or (["policy", "critic"] if algo == "ppo" else ["policy"]):
        folder = os.path.join(ckpt, model)
        for name in ("config.json", "model.safetensors"):
            if not os.path.isfile(os.path.join(folder, name)):
                return f"{model}/{name} is missing"
        try:
            with open(os.path.join(folder, "config.json")) as f:
                json.load(f)
        except (OSError, ValueError) as e:
            return f"{model}/config.json is not valid JSON ({type(e).__name__}: {e})"
        if bad := safetensors_problem(folder):
            return bad
    for r in range(world_size):
        path = os.path.join(ckpt, f"trainer_rank{r}.pt")
        try:
            with zipfile.ZipFile(path) as z:  # torch.save writes a zip archive; testzip checks every CRC
                if z.testzip() is not None:
                    return f"{path} is damaged (CRC mismatch)"
        except (OSError, zipfile.BadZipFile) as e:
            return f"{path} is missing or damaged ({type(e).__name__}: {e})"
    return None


def _checkpoint_names(out_dir: str) -> list[str]:
    """Every step_* folder under checkpoints/, newest first: each is a checkpoint, intact or damaged."""
    root = os.path.join(out_dir, "checkpoints")
    return sorted(
        (
            d
            for d in (os.listdir(root) if os.path.isdir(root) else [])
            if d.startswith("step_") and os.path.isdir(os.path.join(root, d))
        ),
        reverse=True,
    )


def latest_checkpoint(out_dir: str, algo: str = "ppo") -> str | None:
    """The newest intact checkpoint (checkpoint_problem), or None if there is none. A damaged newer one is skipped
    with a printed note naming it and why."""
    damaged = []
    for name in _checkpoint_names(out_dir):
        path = os.path.join(out_dir, "checkpoints", name)
        if (bad := checkpoint_problem(path, algo)) is None:
            if damaged:
                print(
                    f"note: resuming from {name}, the newest intact checkpoint; skipped damaged " + "; ".join(damaged),
                    flush=True,
                )
            return path
        damaged.append(f"{name} ({bad})")
    return None


def check_fresh_start(out_dir: str, algo: str = "ppo") -> None:
    """Refuse to start a run in a folder that holds a run's records (config.json, metrics rows, samples, checkpoints)
    but no usable checkpoint: a fresh start would overwrite them. The error lists what was found and why each
    checkpoint is unusable. A folder with only the lock file (or nothing) is fine."""
    found = []
    if os.path.isfile(os.path.join(out_dir, "config.json")):
        found.append("config.json")
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        try:
            steps = [row.get("step") for row in _read_metrics(metrics) if isinstance(row, dict)]
            found.append(
                f"metrics.jsonl ({len(steps)} rows, up to step {max((s for s in steps if isinstance(s, int)), default='?')})"
            )
        except ValueError as e:
            found.append(f"metrics.jsonl ({e})")
    if os.path.isdir(samples := os.path.join(out_dir, "samples")) and os.listdir(samples):
        found.append(f"samples/ ({len(os.listdir(samples))} files)")
    found += [
        f"checkpoints/{name} ({checkpoint_problem(os.path.join(out_dir, 'checkpoints', name), algo)})"
        for name in _checkpoint_names(out_dir)
    ]
    if found:
        raise RuntimeError(
            f"--out-dir {out_dir} holds a run's records but no usable checkpoint to resume from: "
            + "; ".join(found)
            + ". Starting afresh would overwrite them: use a new --out-dir, or remove those files (config.json, "
            "metrics.jsonl, samples/, checkpoints/) to start over in this folder"
        )


# What a resume may change: options that do not change what the run means (its length, evaluation, logging,
# checkpointing, the user-code time limit) and the learning rates, applied for real to the optimisers (to resume after a blow-up).
RESUMABLE = (
    "steps",
    "eval_every",
    "eval_size",
    "eval_dtype",
    "eval_task",
    "eval_split",
    "eval_samples",
    "save_every",
    "keep_checkpoints",
    "wandb",
    "tensorboard",
    "lr",
    "critic_lr",
    "max_bad_steps",
    "deterministic",
    "accept_changed_inputs",
    "user_timeout",
)


def read_json(path: str, fix: str):
    """A JSON file of the run folder; unreadable or invalid (a copy cut short): an error naming it and `fix`, what to do."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is unreadable or not valid JSON ({type(e).__name__}: {e}); {fix}") from None


def _recorded(out_dir: str) -> dict:  # config.json, checked
    path = os.path.join(out_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"{path} is missing, so a resume cannot check that its options match the run's; restore it or use a new --out-dir"
        )
    meta = read_json(path, "restore it from a copy, or use a new --out-dir")
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        raise ValueError(
            f'{path} has no "config" object (it is not this project\'s run record); restore it or use a new --out-dir'
        )
    return meta


def check_resume(cfg, ckpt: str, world_size: int) -> dict:
    """Compare this run's options (cfg: a config.Config) with those recorded in the run folder; refuse, naming them, the
    changes a resume cannot honour (an option the record lacks counts as changed unless at its default, the behaviour of
    the code before it); return the accepted ones as {name: [old, new]}. --out-dir is not compared (the folder found is
    the run, however spelled or moved); a path spelled differently that resolves to the recorded file is no change, and
    a file moved elsewhere is left to check_inputs (same content: the same input)."""
    meta = read_json(os.path.join(ckpt, "meta.json"), "remove that checkpoint folder to resume from the one before")
    if meta["world_size"] != world_size:
        raise ValueError(
            f"checkpoint {ckpt} was written by {meta['world_size']} processes, this run has {world_size}; resume with the same launch"
        )
    record = _recorded(cfg.out_dir)
    if os.path.isfile(metrics := os.path.join(cfg.out_dir, "metrics.jsonl")):
        _read_metrics(metrics)  # a bad line mid-file is named now, before any model loads
    recorded, inputs = record["config"], record.get("inputs") or {}
    defaults = {
        f.name: f.default for f in fields(cfg) if f.default is not MISSING
    }  # an option newer than the run: its default
    changed = {
        k: [recorded.get(k), v]
        for k, v in asdict(cfg).items()
        if k != "out_dir" and recorded.get(k, defaults.get(k, MISSING)) != v
    }
    for k in set(changed) & set(PATH_OPTIONS):
        old, new = changed[k]
        now, before = input_path(k, new), inputs.get(k, {}).get("path")
        if (
            now is None
            or not isinstance(old, str)
            or (k in ("reward", "env") and old.rpartition(":")[2] != new.rpartition(":")[2])
        ):
            continue  # not a file now (a built-in task, a hub dataset), or another function of the file
        if now == before or (k != "model" and before is not None):
            del changed[k]  # the same file; or moved, for check_inputs to compare by content
    refused = [
        f"--{k.replace('_', '-')} {'(not recorded)' if k not in recorded else repr(old)} -> {new!r}"
        for k, (old, new) in changed.items()
        if k not in RESUMABLE
    ]
    if cfg.steps < meta["step"]:
        refused.append(f"--steps {cfg.steps} is below the checkpoint's step {meta['step']}")
    if refused:
        raise ValueError(
            f"--out-dir {cfg.out_dir} holds a run (checkpoint at step {meta['step']}) that this resume would change: "
            + "; ".join(refused)
            + ". Resume with the recorded options, or use a new --out-dir. A resume may change only "
            + ", ".join("--" + k.replace("_", "-") for k in RESUMABLE)
        )
    if changed:
        print0(f"resume: applying changed options {changed}")
    return changed


# ----------------------------------------------------------------------------- the run's inputs, by content

PATH_OPTIONS = (
    "model",
    "task",
    "eval_task",
    "reward",
    "env",
)  # options that name files: compared by resolved path / content
_LABELS = {
    "task": "--task",
    "eval_task": "--eval-task",
    "reward": "--reward's file",
    "env": "--env's file",
    "train_split": "the train split",
    "test_split": "the held-out split",
}


def input_path(key: str, spec: str) -> str | None:
    """The resolved file or folder an option value names, or None (empty, a built-in task or reward, a hub dataset, a
    module without a file): --model, --task / --eval-task as paths, the file part of --reward / --env
    ('path.py:name', or 'package.module:name' resolved to the module's file)."""
    if key in ("reward", "env"):
        where, sep, _ = spec.rpartition(":")
        if not sep or not where:
            return None
        if not (where.endswith(".py") or os.sep in where):
            try:
                where = getattr(importlib.util.find_spec(where), "origin", None) or ""
            except (ImportError, ValueError):
                return None
        spec = where
    return os.path.realpath(spec) if spec and os.path.exists(spec) else None


def _sha256_path(path: str) -> str:
    """sha256 of a file; of a folder, of its files' relative paths and bytes (datasets' cache-*.arrow map caches and
    hidden files left out: datasets writes them into the folder it loads)."""
    h = hashlib.sha256()
    files = (
        [path]
        if os.path.isfile(path)
        else sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if not f.startswith((".", "cache-")))
    )
    for file in files:
        h.update(os.path.relpath(file, path).encode() + b"\0")
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _sha256_rows(ds) -> str:
    """sha256 of a split's rows in order, every column but `where` (a row's file name and line: a moved file's rows
    are the same rows)."""
    h, keys = hashlib.sha256(), sorted(set(ds.column_names) - {"where"})
    for batch in ds.iter(batch_size=4096):  # by batch: row by row, datasets' formatting costs 5x (100k rows: 1 s)
        for row in zip(*(batch[k] for k in keys)):
            h.update(json.dumps(dict(zip(keys, row)), sort_keys=True, default=repr).encode() + b"\n")
    return h.hexdigest()


def input_fingerprints(cfg, task) -> dict:
    """The run's inputs by content, recorded in config.json ("inputs"): {"path", "sha256"} of --task and --eval-task
    when they are files or folders and of the files of --reward and --env; {"rows", "sha256"} of the train and the
    held-out split as loaded (for a built-in task only these: its rows are generated); the resolved --model folder."""
    out = {
        k: {"path": path} if k == "model" else {"path": path, "sha256": _sha256_path(path)}
        for k in PATH_OPTIONS
        if (path := input_path(k, getattr(cfg, k))) is not None
    }
    return {
        **out,
        **{
            k: {"rows": len(ds), "sha256": _sha256_rows(ds)}
            for k, ds in (("train_split", task.train), ("test_split", task.test))
        },
    }


def check_inputs(cfg, now: dict, changes: dict) -> dict:
    """Compare the inputs' fingerprints (input_fingerprints) with config.json's. A changed one (edited, rows appended,
    another file) is refused by name, recorded vs now, unless --accept-changed-inputs; a moved file of the same content
    is the same input. Returns the differences accepted, {"inputs/<name>": [recorded, now]}, for config.json's "resumes"
    (a changed --eval-task / --eval-split, in the resume's `changes`, may change the held-out split)."""
    recorded, out = _recorded(cfg.out_dir).get("inputs"), {}
    refused = (
        [] if recorded is not None else ["config.json records no fingerprints (a run from before they were recorded)"]
    )
    skip = {"model"} | ({"eval_task", "test_split"} if {"eval_task", "eval_split"} & set(changes) else set())
    for k in sorted((set(recorded or {}) | set(now)) - skip):
        old, new = (recorded or {}).get(k) or {}, now.get(k) or {}
        if old.get("sha256") == new.get("sha256"):
            if old.get("path") != new.get("path"):
                out[f"inputs/{k}"] = [old.get("path"), new.get("path")]  # moved, same content
            continue
        out[f"inputs/{k}"] = [old, new]

        def what(fp):
            return f"{fp['rows']} rows" if "rows" in fp else fp.get("path", "(none)")

        refused.append(
            f"{_LABELS[k]}: {what(old)} (sha256 {str(old.get('sha256'))[:12]}) recorded, {what(new)} (sha256 {str(new.get('sha256'))[:12]}) now"
        )
    if refused and not cfg.accept_changed_inputs:
        raise ValueError(
            f"--out-dir {cfg.out_dir}: the run's inputs changed since it was launched: "
            + "; ".join(refused)
            + ". Resume with the run's inputs, pass --accept-changed-inputs to go on with these (recorded in config.json), "
            "or use a new --out-dir"
        )
    if refused:
        print0("resume: --accept-changed-inputs: going on with changed inputs: " + "; ".join(refused))
    return out


def lock_run_dir(out_dir: str):
    """Hold an exclusive lock on the run folder while this process lives (the OS drops it on any exit, kill -9
    included); a second live run into the same folder is refused. Returns the open lock file: keep it. (flock:
    on a network filesystem without flock support two runs may not exclude each other.)"""
    os.makedirs(out_dir, exist_ok=True)
    f = open(os.path.join(out_dir, ".lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        raise RuntimeError(
            f"--out-dir {out_dir} is in use by a live run ({f.read().strip() or 'unknown process'}); "
            "wait for it or stop it, or choose another --out-dir"
        ) from None
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


def _save_hf(model, path: str, rank: int, tokenizer=None) -> None:
    """A Hugging Face folder (config + model.safetensors) from the full weights; every TP rank gathers. MoE experts are
    written one by one under the checkpoint's names (what from_pretrained, SGLang and vLLM load)."""
    state = {
        n: t.to("cpu", copy=True)
        for bucket in full_weights(model)
        for pair in bucket
        for n, t in checkpoint_tensors(*pair)
    }
    if rank == 0:
        os.makedirs(path)
        model.config.architectures = [
            type(model).__name__.removeprefix("FSDP")
        ]  # fully_shard renames the class FSDP<name>
        model.config.save_pretrained(path)
        save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)


def _local_optimizer_state(opt: torch.optim.Optimizer) -> dict:
    """Optimizer state with DTensors replaced by this rank's shard (plain tensors pickle anywhere)."""
    sd = opt.state_dict()
    sd["state"] = {
        i: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in s.items()} for i, s in sd["state"].items()
    }
    return sd


def _load_optimizer_state(opt: torch.optim.Optimizer, sd: dict) -> None:
    params = [p for group in opt.param_groups for p in group["params"]]
    for i, s in sd["state"].items():
        p = params[i]
        if isinstance(p, DTensor):
            # shape and stride given: an FSDP shard can be uneven (the last dp rank's rows fewer), which from_local cannot infer
            s.update(
                {
                    k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                    for k, v in s.items()
                    if torch.is_tensor(v) and v.dim() > 0
                }
            )
    opt.load_state_dict(sd)


def save_checkpoint(
    out_dir: str,
    step: int,
    rank: int,
    world_size: int,
    keep: int,
    *,
    policy,
    critic,
    tokenizer,
    optimizers: dict,
    extra: dict,
) -> str:
    """Write checkpoints/step_{step}: policy/ and critic/ as HF folders (rank 0), each rank's optimizer and
    RNG states, meta.json last, then rename into place. Collective: all ranks call it."""
    root = os.path.join(out_dir, "checkpoints")
    name = f"step_{step:06d}"
    tmp, final = os.path.join(root, f".{name}.tmp"), os.path.join(root, name)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    _save_hf(policy, os.path.join(tmp, "policy"), rank, tokenizer)
    if critic is not None:
        _save_hf(critic, os.path.join(tmp, "critic"), rank)
    state = {
        "step": step,
        "optimizers": {k: _local_optimizer_state(o) for k, o in optimizers.items()},
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        **extra,
    }
    torch.save(state, os.path.join(tmp, f"trainer_rank{rank}.pt"))
    _barrier()
    if rank == 0:
        models = ["policy"] + (["critic"] if critic is not None else [])  # what checkpoint_problem checks
        _atomic_write(
            os.path.join(tmp, "meta.json"), json.dumps({"step": step, "world_size": world_size, "models": models})
        )
        shutil.rmtree(final, ignore_errors=True)  # only when re-saving a step; older checkpoints stay usable meanwhile
        os.replace(tmp, final)
        done = sorted(d for d in os.listdir(root) if d.startswith("step_"))
        for old in done[:-keep]:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    _barrier()
    return final


def load_trainer_state(ckpt: str, rank: int, world_size: int, optimizers: dict) -> dict:
    """Restore this rank's optimizer and RNG states; returns the saved dict (step and extras). The caller has
    checked that the launch matches (check_resume). weights_only=True: tensors, numbers, strings and containers load;
    any other pickled object (code) is refused, so a tampered checkpoint cannot run anything on resume."""
    state = torch.load(os.path.join(ckpt, f"trainer_rank{rank}.pt"), weights_only=True)
    for k, opt in optimizers.items():
        _load_optimizer_state(opt, state["optimizers"][k])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return state
