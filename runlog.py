"""The run folder: metrics.jsonl (+ optional wandb / TensorBoard), PNG plots, atomic checkpoints.

    out_dir/config.json                 resolved config, derived sizes, git revision, package versions
    out_dir/metrics.jsonl               one JSON line per step (every metric of every phase); critic
                                        pretraining rows have step 0 and a pretrain/step key
    out_dir/plots/*.png                 reward & accuracy, mismatch (KL apart from masked fractions), critic,
                                        critic pretraining, time per phase
    out_dir/checkpoints/step_000050/    policy/ and critic/ (HF folders), trainer_rank{r}.pt, meta.json

A checkpoint is written into a hidden temp folder, its meta.json last, and renamed into place: a
step_* folder with a meta.json is complete, and resume takes the newest one, so a kill at any moment
leaves the previous checkpoint usable.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from parallel import full_weights


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class RunLog:
    """Rank 0 writes; other ranks' calls are no-ops. ``history`` holds every logged row (for the plots)."""

    def __init__(self, out_dir: str, rank: int, config: dict, resume_step: int, wandb: bool = False, tensorboard: bool = False):
        self.dir, self.rank, self.history = out_dir, rank, []
        self.writers = []
        if rank != 0:
            return
        os.makedirs(os.path.join(out_dir, "plots"), exist_ok=True)
        meta = {"config": config, "git": _git_revision(), "argv": sys.argv, "versions": _versions()}
        _atomic_write(os.path.join(out_dir, "config.json"), json.dumps(meta, indent=1))
        path = os.path.join(out_dir, "metrics.jsonl")
        if os.path.exists(path):  # keep what the checkpoint we resume from had seen; drop what came after it
            with open(path) as f:
                self.history = [row for row in map(json.loads, f) if row["step"] <= resume_step]
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
        self.history.append(row)
        with open(os.path.join(self.dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        for write in self.writers:
            write(row)

    def plot(self) -> None:
        """One PNG per panel, redrawn from the whole history; one family of quantities (one unit) per axis."""
        if self.rank != 0 or not self.history:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rl = [row for row in self.history if "pretrain/step" not in row]
        pre = [row for row in self.history if "pretrain/step" in row]
        ev_pos = sorted({k for row in rl for k in row if k.startswith("critic/ev_pos_")}, key=lambda k: int(k.split("_")[-1].split("-")[0]))
        panels = {  # file -> (rows, x key, [(y label, keys), ...]): one subplot per family
            "reward": (rl, "step", [("reward / accuracy", ["rollout/reward_mean", "eval/greedy_acc", "eval/sampled_acc"])]),
            "mismatch": (rl, "step", [("KL estimate (nats/token)", ["mismatch/k1", "mismatch/k3"]),
                                      ("fraction of tokens", ["mismatch/masked_frac", "mismatch/masked_frac_low", "mismatch/masked_frac_high"])]),
            "critic": (rl, "step", [("explained variance", ["critic/explained_variance", *ev_pos]),
                                    ("value loss", ["critic/value_loss"]), ("mean value", ["critic/value_mean"])]),
            "critic_pretrain": (pre, "pretrain/step", [("explained variance", ["critic/explained_variance"]), ("value loss", ["critic/value_loss"])]),
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
        return subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "transformers", "datasets", "accelerate", "sglang"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


# ----------------------------------------------------------------------------- checkpoints


def latest_checkpoint(out_dir: str) -> str | None:
    """The newest complete checkpoint (a step_* folder holding meta.json), or None."""
    root = os.path.join(out_dir, "checkpoints")
    done = sorted(d for d in os.listdir(root) if d.startswith("step_") and os.path.isfile(os.path.join(root, d, "meta.json"))) if os.path.isdir(root) else []
    return os.path.join(root, done[-1]) if done else None


def _save_hf(model, path: str, rank: int, tokenizer=None) -> None:
    """A Hugging Face folder (config + model.safetensors) from the full weights; every TP rank gathers."""
    state = {name: t.cpu() for bucket in full_weights(model) for name, t in bucket}
    if rank == 0:
        os.makedirs(path)
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(path)
        save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)


def _local_optimizer_state(opt: torch.optim.Optimizer) -> dict:
    """Optimizer state with DTensors replaced by this rank's shard (plain tensors pickle anywhere)."""
    sd = opt.state_dict()
    sd["state"] = {i: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in s.items()} for i, s in sd["state"].items()}
    return sd


def _load_optimizer_state(opt: torch.optim.Optimizer, sd: dict) -> None:
    params = [p for group in opt.param_groups for p in group["params"]]
    for i, s in sd["state"].items():
        p = params[i]
        if isinstance(p, DTensor):
            s.update({k: DTensor.from_local(v, p.device_mesh, p.placements) for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0})
    opt.load_state_dict(sd)


def save_checkpoint(out_dir: str, step: int, rank: int, world_size: int, keep: int, *, policy, critic, tokenizer, optimizers: dict, extra: dict) -> str:
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
        _atomic_write(os.path.join(tmp, "meta.json"), json.dumps({"step": step, "world_size": world_size}))
        shutil.rmtree(final, ignore_errors=True)  # only when re-saving a step; older checkpoints stay usable meanwhile
        os.replace(tmp, final)
        done = sorted(d for d in os.listdir(root) if d.startswith("step_"))
        for old in done[:-keep]:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    _barrier()
    return final


def load_trainer_state(ckpt: str, rank: int, world_size: int, optimizers: dict) -> dict:
    """Restore this rank's optimizer and RNG states; returns the saved dict (step and extras)."""
    with open(os.path.join(ckpt, "meta.json")) as f:
        meta = json.load(f)
    if meta["world_size"] != world_size:
        raise ValueError(f"checkpoint {ckpt} was written by {meta['world_size']} processes, this run has {world_size}; resume with the same launch")
    state = torch.load(os.path.join(ckpt, f"trainer_rank{rank}.pt"), weights_only=False)
    for k, opt in optimizers.items():
        _load_optimizer_state(opt, state["optimizers"][k])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return state
