"""The run folder's checkpoints and the checks around a resume: checkpoint integrity, atomic save and load, the
fresh-start and resume checks, the inputs' fingerprints, and the lock that keeps a second run out.

    out_dir/.lock                       held by the live run (a second run into the folder is refused)
    out_dir/checkpoints/step_000050/    policy/ and critic/ (HF folders), trainer_rank{r}.pt, meta.json

A checkpoint is written into a hidden temp folder, its meta.json last, and renamed into place: every step_* folder
is a checkpoint, and one that lacks a file is damaged. A resume takes the newest whose files check out
(checkpoint_problem), so a kill at any moment leaves the previous checkpoint usable, and a damaged newest checkpoint
(a full disk, a copy cut short) falls back to the one before, with a note. A folder with records but no usable
checkpoint is never overwritten (check_fresh_start). A resume must mean what the run meant: the same options
(check_resume) and the same inputs by content (input_fingerprints, check_inputs).

The checks read the records runlog.RunLog writes (config.json, metrics.jsonl) with the readers here (run_record,
read_metrics), which RunLog shares. The options come in as values, or as a plain dict (dataclasses.asdict of the
config) where a resume compares the whole recorded config.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import random
import shutil
import socket
import zipfile
from dataclasses import MISSING

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from lora import ADAPTER_CONFIG, ADAPTER_FILE, save_adapter
from moe import checkpoint_tensors
from parallel import full_weights, print0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


# ----------------------------------------------------------------------------- the run folder's records


def atomic_write(path: str, text: str) -> None:
    """Write through a temp file and a rename: a kill leaves the old file or the new one, never half of one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def read_metrics(path: str) -> list[dict]:
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


# ----------------------------------------------------------------------------- checkpoints


MAX_HEADER_BYTES = 100 * 2**20  # the safetensors format's own bound on a header (the Rust reader refuses more)


def safetensors_header(path: str) -> dict:
    """The tensors a *.safetensors file's header lists, {name: {"dtype", "shape", "data_offsets"}}, read without the
    data and without trusting the file: the header's length is checked against the file's size (and the format's
    100 MB bound) before it is read, the header must be a JSON object of such entries, and the data must end exactly
    where its last tensor does. Anything else is a ValueError saying what is wrong with the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or n > min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(f"{path} is damaged: its header claims {n} bytes in a file of {size}")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{path} has an unreadable header ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} has an unreadable header: a JSON {type(header).__name__}, not an object")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = 0
    for k, v in tensors.items():
        ok = isinstance(v, dict) and isinstance(v.get("shape"), list) and isinstance(v.get("data_offsets"), list)
        ok = ok and all(isinstance(d, int) and d >= 0 for d in v["shape"] + v["data_offsets"])
        if not ok or len(v["data_offsets"]) != 2:
            raise ValueError(f"{path} has an unreadable header: tensor {k!r} is {str(v)[:100]}")
        end = max(end, v["data_offsets"][1])
    if size != 8 + n + end:
        raise ValueError(f"{path} is truncated or damaged: {size} bytes where its header needs {8 + n + end}")
    return tensors


def safetensors_problem(folder: str) -> str | None:
    """Why a *.safetensors file in a model folder is unusable (truncated, a damaged or unreadable header), or None.
    Reads only the headers (safetensors_header)."""
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        try:
            safetensors_header(os.path.join(folder, name))
        except OSError as e:
            return f"{os.path.join(folder, name)} cannot be read ({type(e).__name__}: {e})"
        except ValueError as e:
            return str(e)
    return None


def shape_problem(folder: str, model: torch.nn.Module) -> str | None:
    """The tensors of a model folder's *.safetensors files whose shape (from the headers, safetensors_header) is not
    the one `model` (a weightless copy built from the folder's config.json, on the meta device) gives them, or None.
    Run before a load, so a config.json that claims a vocabulary of 10^8 over 320-row weights is refused before
    transformers allocates for it. Names the files do not share with the model are left to the load's own check
    (decoder.load_pretrained)."""
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    bad = []
    for name in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        for k, v in safetensors_header(os.path.join(folder, name)).items():
            if k in want and tuple(v["shape"]) != want[k]:
                bad.append(f"{k} ({tuple(v['shape'])} in {name}, {want[k]} from config.json)")
    if not bad:
        return None
    more = ", ..." if len(bad) > 5 else ""
    return f"{len(bad)} tensor(s) have another shape than config.json gives them: {', '.join(bad[:5])}{more}"


def checkpoint_problem(ckpt: str, algo: str = "ppo") -> str | None:
    """Why a checkpoint folder cannot be resumed from, or None. It checks every file a resume loads: meta.json, each
    model folder meta.json lists (older checkpoints: policy, and critic for --algo ppo) with its config.json and
    model.safetensors (sizes against the header), or for a LoRA model its adapter.json and adapter.safetensors, and
    every rank's trainer state (CRCs)."""
    try:
        with open(os.path.join(ckpt, "meta.json")) as f:
            meta = json.load(f)
        # what check_resume and the resume read: both must be integers
        world_size = int(meta["world_size"])
        int(meta["step"])
    except FileNotFoundError:
        return "meta.json is missing (the writer renames only complete checkpoints into place: this one was damaged)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"meta.json is unreadable ({type(e).__name__}: {e})"
    for model in meta.get("models") or (["policy", "critic"] if algo == "ppo" else ["policy"]):
        folder = os.path.join(ckpt, model)
        files = (
            (ADAPTER_CONFIG, ADAPTER_FILE)
            if model in meta.get("adapters", [])
            else ("config.json", "model.safetensors")
        )
        for name in files:
            if not os.path.isfile(os.path.join(folder, name)):
                return f"{model}/{name} is missing"
        try:
            with open(os.path.join(folder, files[0])) as f:
                json.load(f)
        except (OSError, ValueError) as e:
            return f"{model}/{files[0]} is not valid JSON ({type(e).__name__}: {e})"
        bad = safetensors_problem(folder)
        if bad:
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
    if not os.path.isdir(root):
        return []
    steps = [d for d in os.listdir(root) if d.startswith("step_") and os.path.isdir(os.path.join(root, d))]
    return sorted(steps, reverse=True)


def latest_checkpoint(out_dir: str, algo: str = "ppo") -> str | None:
    """The newest intact checkpoint (checkpoint_problem), or None if there is none. A damaged newer one is skipped
    with a printed note naming it and why."""
    damaged = []
    for name in _checkpoint_names(out_dir):
        path = os.path.join(out_dir, "checkpoints", name)
        bad = checkpoint_problem(path, algo)
        if bad is None:
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
            steps = [row.get("step") for row in read_metrics(metrics) if isinstance(row, dict)]
            last = max((s for s in steps if isinstance(s, int)), default="?")
            found.append(f"metrics.jsonl ({len(steps)} rows, up to step {last})")
        except ValueError as e:
            found.append(f"metrics.jsonl ({e})")
    samples = os.path.join(out_dir, "samples")
    if os.path.isdir(samples) and os.listdir(samples):
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
# checkpointing, the user-code time limit) and the learning rates, applied for real to the optimisers (to resume
# after a blow-up).
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
    "report_to",
    "token_records",
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


def run_record(out_dir: str) -> dict:
    """The run folder's config.json (RunLog writes it), checked: missing, unreadable or not this project's record is
    an error naming it."""
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


def check_resume(ckpt: str, world_size: int, *, options: dict, defaults: dict) -> dict:
    """Compare this run's options (options: the resolved config as a plain dict, dataclasses.asdict(cfg)) with those
    recorded in the run folder (options["out_dir"]); refuse, naming them, the changes a resume cannot honour (an option
    the record lacks counts as changed unless at its default in defaults, {name: default}, the behaviour of the code
    before it); return the accepted ones as {name: [old, new]}. --out-dir is not compared (the folder found is the run,
    however spelled or moved); a path spelled differently that resolves to the recorded file is no change, and a file
    moved elsewhere is left to check_inputs (same content: the same input)."""
    meta = read_json(os.path.join(ckpt, "meta.json"), "remove that checkpoint folder to resume from the one before")
    if meta["world_size"] != world_size:
        raise ValueError(
            f"checkpoint {ckpt} was written by {meta['world_size']} processes, this run has {world_size}; resume with the same launch"
        )
    out_dir = options["out_dir"]
    steps = options["steps"]
    record = run_record(out_dir)
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if os.path.isfile(metrics):
        read_metrics(metrics)  # a bad line mid-file is named now, before any model loads
    recorded = record["config"]
    inputs = record.get("inputs") or {}
    # An option newer than the run is compared with its default (MISSING: an option without one counts as changed).
    changed = {
        k: [recorded.get(k), v]
        for k, v in options.items()
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
    if steps < meta["step"]:
        refused.append(f"--steps {steps} is below the checkpoint's step {meta['step']}")
    if refused:
        raise ValueError(
            f"--out-dir {out_dir} holds a run (checkpoint at step {meta['step']}) that this resume would change: "
            + "; ".join(refused)
            + ". Resume with the recorded options, or use a new --out-dir. A resume may change only "
            + ", ".join("--" + k.replace("_", "-") for k in RESUMABLE)
        )
    if changed:
        print0(f"resume: applying changed options {changed}")
    return changed


# ----------------------------------------------------------------------------- the run's inputs, by content

# options that name files: compared by resolved path / content
PATH_OPTIONS = ("model", "task", "eval_task", "reward", "env", "critic_init")
_LABELS = {
    "task": "--task",
    "eval_task": "--eval-task",
    "reward": "--reward's file",
    "env": "--env's file",
    "critic_init": "--critic-init",
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


def sha256_path(path: str) -> str:
    """sha256 of a file; of a folder, of its files' relative paths and bytes (datasets' cache-*.arrow map caches and
    hidden files left out: datasets writes them into the folder it loads)."""
    h = hashlib.sha256()
    if os.path.isfile(path):
        files = [path]
    else:
        files = sorted(
            os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if not f.startswith((".", "cache-"))
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
    h = hashlib.sha256()
    keys = sorted(set(ds.column_names) - {"where"})
    for batch in ds.iter(batch_size=4096):  # by batch: row by row, datasets' formatting costs 5x (100k rows: 1 s)
        for row in zip(*(batch[k] for k in keys)):
            h.update(json.dumps(dict(zip(keys, row)), sort_keys=True, default=repr).encode() + b"\n")
    return h.hexdigest()


def input_fingerprints(
    train, test, *, model: str, task: str, eval_task: str, reward: str, env: str, critic_init: str = ""
) -> dict:
    """The run's inputs by content, recorded in config.json ("inputs"): {"path", "sha256"} of --task and --eval-task
    when they are files or folders and of the files of --reward and --env; {"rows", "sha256"} of the train and the
    held-out split as loaded (for a built-in task only these: its rows are generated); the resolved --model folder;
    the --critic-init folder. train, test: the task's splits as loaded (datasets.Dataset); model, task, eval_task,
    reward, env, critic_init: the options' values (PATH_OPTIONS)."""
    specs = {"model": model, "task": task, "eval_task": eval_task, "reward": reward, "env": env}
    specs["critic_init"] = critic_init
    out = {}
    for k in PATH_OPTIONS:
        path = input_path(k, specs[k])
        if path is None:
            continue
        out[k] = {"path": path} if k == "model" else {"path": path, "sha256": sha256_path(path)}
    for k, ds in (("train_split", train), ("test_split", test)):
        out[k] = {"rows": len(ds), "sha256": _sha256_rows(ds)}
    return out


def check_inputs(out_dir: str, now: dict, changes: dict, *, accept_changed_inputs: bool) -> dict:
    """Compare the inputs' fingerprints (input_fingerprints) with the config.json of the run folder out_dir. A changed
    one (edited, rows appended, another file) is refused by name, recorded vs now, unless accept_changed_inputs
    (--accept-changed-inputs); a moved file of the same content is the same input. Returns the differences accepted,
    {"inputs/<name>": [recorded, now]}, for config.json's "resumes" (a changed --eval-task / --eval-split, in the
    resume's `changes`, may change the held-out split)."""
    recorded = run_record(out_dir).get("inputs")
    out = {}
    refused = []
    if recorded is None:
        refused.append("config.json records no fingerprints (a run from before they were recorded)")
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
    if refused and not accept_changed_inputs:
        raise ValueError(
            f"--out-dir {out_dir}: the run's inputs changed since it was launched: "
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
        # fully_shard renames the class FSDP<name>
        model.config.architectures = [type(model).__name__.removeprefix("FSDP")]
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
            # shape and stride given: an FSDP shard can be uneven (the last dp rank's rows fewer), which from_local
            # cannot infer
            shards = {
                k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                for k, v in s.items()
                if torch.is_tensor(v) and v.dim() > 0
            }
            s.update(shards)
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
    lora: dict | None = None,
    base: str = "",
) -> str:
    """Write checkpoints/step_{step}: policy/ and critic/ as HF folders (rank 0), each rank's optimizer and
    RNG states, meta.json last, then rename into place. Collective: all ranks call it. lora: {"policy" and/or "critic":
    lora.LoraSpec}: that model's folder holds only its trained tensors and `base`, the base model's fingerprint
    (lora.save_adapter)."""
    lora = lora or {}
    root = os.path.join(out_dir, "checkpoints")
    name = f"step_{step:06d}"
    tmp, final = os.path.join(root, f".{name}.tmp"), os.path.join(root, name)
    state = {
        "step": step,
        "optimizers": {k: _local_optimizer_state(o) for k, o in optimizers.items()},
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        **extra,
    }
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        _barrier()
        for what, model in (("policy", policy), ("critic", critic)):
            if model is None:
                continue
            if what not in lora:
                _save_hf(model, os.path.join(tmp, what), rank, tokenizer if what == "policy" else None)
            elif rank == 0:  # LoRA runs no TP: rank 0 holds the whole adapter
                save_adapter(model, os.path.join(tmp, what), lora[what], base)
        torch.save(state, os.path.join(tmp, f"trainer_rank{rank}.pt"))
    except Exception as e:  # torch.save says "basic_ios::clear: iostream error", safetensors raises its own error
        shutil.rmtree(tmp, ignore_errors=True)
        need = _tensor_bytes(policy, critic, state)
        free = shutil.disk_usage(root).free
        if getattr(e, "errno", None) != errno.ENOSPC and free >= need:
            raise
        raise OSError(
            errno.ENOSPC,
            f"saving checkpoint {name} failed: the disk holding {root} is full ({free / 2**20:.1f} MiB free once the "
            f"partial copy was removed; the checkpoint needs about {need / 2**20:.1f} MiB). The older checkpoints are "
            "intact: free space on that disk, then run the same command again to resume from the newest of them",
        ) from e
    _barrier()
    if rank == 0:
        models = ["policy"] + (["critic"] if critic is not None else [])  # what checkpoint_problem checks
        meta = {"step": step, "world_size": world_size, "models": models, "adapters": sorted(lora)}
        atomic_write(os.path.join(tmp, "meta.json"), json.dumps(meta))
        shutil.rmtree(final, ignore_errors=True)  # only when re-saving a step; older checkpoints stay usable meanwhile
        os.replace(tmp, final)
        done = sorted(d for d in os.listdir(root) if d.startswith("step_"))
        for old in done[:-keep]:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    _barrier()
    return final


def _tensor_bytes(*objects) -> int:
    """The bytes of the tensors in models (their full parameters) and nested containers: what a checkpoint of them
    holds, give or take the headers."""
    total = 0
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            total += sum(p.numel() * p.element_size() for p in obj.state_dict().values())
        elif torch.is_tensor(obj):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            total += _tensor_bytes(*obj.values())
        elif isinstance(obj, (list, tuple)):
            total += _tensor_bytes(*obj)
    return total


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
