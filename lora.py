"""LoRA adapters (peft) on the policy and the critic, the engine's merged weights, and the adapters' checkpoint.

    policy = add_lora(policy, LoraSpec(rank=16, alpha=32))       # W stays frozen; y = x W^T + scale x A^T B^T
    critic = add_lora(critic, spec, train=("score.",))           # the value head stays fully trained
    dict(hf_weights(policy))                                     # {"...q_proj.weight": W + scale B A, ...}
    save_adapter(policy, "ckpt/policy", base="<sha256>"); load_adapter(policy, "ckpt/policy", base="<sha256>")

peft's `inject_adapter_in_model` replaces each targeted nn.Linear in place by a LoRA layer holding the frozen base
layer (`<module>.base_layer`) and the adapter (`<module>.lora_A.default`, `<module>.lora_B.default`; B starts at 0,
so a fresh adapter leaves the model's outputs exactly as they were). The model keeps its class and module tree, so
the trainer's forwards run unchanged. scale = alpha / rank.

The rollout engine never sees the adapter: hf_weights gives it the model's own state_dict names with each adapted
weight merged (W + scale B A, computed afresh on every sync), so the same bucketed weight sync serves the embedded
engine and SGLang. The trainer's weights are never merged: W stays the base's, bit for bit.

A checkpoint holds only the trained tensors (the adapters, and the critic's head) with the LoRA settings and the base
model folder's fingerprint; load_adapter refuses a checkpoint made on another base.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Iterator

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

ADAPTER_FILE = "adapter.safetensors"
ADAPTER_CONFIG = "adapter.json"
ADAPTER = "default"  # peft's adapter name: the one adapter of a model


@dataclass(frozen=True)
class LoraSpec:
    """A model's LoRA settings (--lora-* for the policy, --critic-lora-* for the critic)."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target: str = "all-linear"  # or comma-separated module names: "q_proj,v_proj"

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """{module name: peft LoRA layer} of the model; empty without adapters. Known by their attributes, so a model
    without adapters never imports peft (3 s)."""
    return {n: m for n, m in model.named_modules() if hasattr(m, "base_layer") and hasattr(m, "get_delta_weight")}


def target_modules(model: nn.Module, target: str) -> list[str]:
    """The short names of the nn.Linear modules in the backbone's decoder layers that `target` selects: all of them for
    "all-linear" (never the output head or a value head), else the comma-separated names, each of which must exist."""
    layers = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if ".layers." in name}
    linear = sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if ".layers." in name and type(m) is nn.Linear}
    )
    if target == "all-linear":
        return linear
    names = [t.strip() for t in target.split(",") if t.strip()]
    unknown = [t for t in names if t not in layers]
    if unknown or not names:
        raise ValueError(
            f"LoRA target {target!r}: no module {', '.join(unknown) or '(none given)'} in the model's decoder layers; "
            f"its linear layers are {', '.join(linear)} (or give all-linear)"
        )
    not_linear = [t for t in names if t not in linear]
    if not_linear:
        raise ValueError(f"LoRA target {target!r}: {', '.join(not_linear)} are not nn.Linear layers")
    return names


def add_lora(model: nn.Module, spec: LoraSpec, train: tuple[str, ...] = ()) -> nn.Module:
    """Inject the adapter (in place; returns the model): every parameter is frozen but the adapters' and those whose
    names start with one of `train` (the critic's head)."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=target_modules(model, spec.target),
        bias="none",
    )
    model = inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name or name.startswith(train))
    return model


@torch.no_grad()
def hf_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) in state_dict order under the model's own (HF) names: the parameters themselves (keep_vars, so a
    tie shows as the same object twice), and for an adapted layer W + scale B A, a fresh tensor, in W's place."""
    layers = lora_layers(model)
    for name, t in model.state_dict(keep_vars=True).items():
        if ".lora_" in name:
            continue
        module, _, leaf = name.rpartition(".")
        owner = module.removesuffix(".base_layer")
        if owner in layers:
            if leaf == "weight":
                t = t.detach() + layers[owner].get_delta_weight(ADAPTER).to(t.dtype)
            name = f"{owner}.{leaf}"
        yield name, t


def trained_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The parameters a LoRA model trains (the adapters, a critic's head), by name, as CPU copies."""
    return {n: p.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.requires_grad}


def save_adapter(model: nn.Module, folder: str, spec: LoraSpec, base: str) -> None:
    """The trained tensors (adapter.safetensors) and the LoRA settings with the base model's fingerprint
    (adapter.json) into `folder`, which is created."""
    os.makedirs(folder)
    save_file(trained_tensors(model), os.path.join(folder, ADAPTER_FILE), metadata={"format": "pt"})
    with open(os.path.join(folder, ADAPTER_CONFIG), "w") as f:
        json.dump({"lora": asdict(spec), "base_sha256": base}, f, indent=1)


def load_adapter(model: nn.Module, folder: str, spec: LoraSpec, base: str) -> None:
    """Copy a checkpoint's trained tensors into `model` (its adapter already added with `spec`). Refused: a checkpoint
    of another base model (its fingerprint), other LoRA settings, or tensors that are not the model's trained ones."""
    with open(os.path.join(folder, ADAPTER_CONFIG)) as f:
        saved = json.load(f)
    if saved.get("base_sha256") != base:
        raise ValueError(
            f"{folder}: this checkpoint's adapters were trained on another base model (sha256 "
            f"{str(saved.get('base_sha256'))[:12]}..., --model now {base[:12]}...): a LoRA checkpoint holds only the "
            "adapters, so it resumes only on the base it was made on. Give that --model, or use a new --out-dir"
        )
    if saved.get("lora") != asdict(spec):
        raise ValueError(f"{folder}: LoRA settings {saved.get('lora')} differ from this run's {asdict(spec)}")
    tensors = load_file(os.path.join(folder, ADAPTER_FILE))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    wrong = sorted(set(tensors) ^ set(params)) + [
        n for n in tensors if n in params and tensors[n].shape != params[n].shape
    ]
    if wrong:
        raise ValueError(f"{folder}: its tensors are not this model's trained ones: {', '.join(wrong[:5])}")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[n])
