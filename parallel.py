"""Runtime, device mesh, tensor parallelism and full-weight gathering for Hugging Face Llama / Qwen models.

    torchrun --standalone --nproc_per_node 2 train_ppo.py --tp 2      # 2 ranks: dp=1, tp=2
    python train_ppo.py                                              # one process, no process group

The mesh is 2-D, ("dp", "tp"). Tensor parallelism is Megatron-style and written as one
``parallelize_module`` plan keyed by Hugging Face module names (torchtitan's ``apply_tp``): attention
heads and MLP columns are split over the "tp" ranks, the embedding and the LM head over the vocabulary.
Activations between blocks stay replicated (no sequence parallelism), so RMSNorms, the rotary embedding
and a critic's ``score`` head are ordinary replicated modules that every TP rank runs in full. In an MoE
(Qwen3-MoE) the router is replicated and the experts are placed per rank (moe.shard_experts).
Data parallelism is explicit: each "dp" rank runs its share of the batch, with the loss divided by the
global token count, then ``all_reduce_grads`` sums the gradients.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from fnmatch import fnmatch

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from lora import hf_weights
from moe import is_moe, shard_experts

# The models the project implements (the TP plan, embedded_engine.EmbeddedEngine's forward pass, the critic): Hugging
# Face model_type -> class-name prefix. The plan below relies on their module names and on their attention reshaping
# with ``view(*shape, -1, head_dim)``, which makes a rank's q/k/v projection output read as its local heads.
# Qwen3-MoE's experts are placed per rank (moe.shard_experts).
SUPPORTED_MODELS = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}
_TP_CLASSES = tuple(
    f"{prefix}For{head}" for prefix in SUPPORTED_MODELS.values() for head in ("CausalLM", "TokenClassification")
)


# ----------------------------------------------------------------------------- runtime


@dataclass
class Runtime:
    """Where this process runs. ``distributed`` is True under torchrun (a process group exists)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    distributed: bool


def init_runtime() -> Runtime:
    """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK and start the process group (nccl on CUDA, gloo on CPU).

    Without torchrun: a single process on cuda:0 (or CPU), no process group.
    """
    if "RANK" not in os.environ:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        return Runtime(rank=0, world_size=1, local_rank=0, device=device, distributed=False)
    rank, world_size, local_rank = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    # die with the torchrun agent: a kill -9 of it must not leave workers writing into the run
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        # Before init_process_group, so NCCL binds each rank to its own GPU rather than all to cuda:0.
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return Runtime(rank=rank, world_size=world_size, local_rank=local_rank, device=device, distributed=True)


class Preemption:
    """Save on SIGTERM (a scheduler preempting the job; torchrun forwards its own SIGTERM to every worker). install()
    (the training script's processes) makes a SIGTERM set a flag once `armed` (the RL steps have begun); agreed(), called
    by every rank at each step boundary, is whether any rank got one (a MAX over the world), so all of them join the
    checkpoint the trainer then writes before it stops with exit code 143 = 128 + SIGTERM (not 0, which would tell the
    scheduler the job is done: non-zero lets it requeue the job, and the rerun resumes). torchrun waits
    --shutdown-timeout seconds (default 30, or TORCH_ELASTIC_SHUTDOWN_TIMEOUT) after forwarding a SIGTERM before its
    SIGKILL: the rest of a step plus a checkpoint must fit in it. A second SIGTERM, one before `armed` (setup, critic
    pretraining: nothing is saved then), and SIGINT (Ctrl-C) stop at once, as without the handler."""

    def __init__(self):
        self.armed = False
        self.requested = False
        self.stopped = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if self.requested or not self.armed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.requested = True
        os.write(
            2,
            b"SIGTERM: a checkpoint is written at the end of this step, then the run stops (a second SIGTERM stops it now)\n",
        )

    def agreed(self, device: torch.device) -> bool:
        """Collective (every rank, every step): whether any rank got a SIGTERM. One float all-reduced: no RNG or
        numerics touched."""
        return bool(all_reduce(torch.tensor(float(self.requested), device=device), op=dist.ReduceOp.MAX))


PREEMPTION = Preemption()


def print0(*args, **kwargs) -> None:
    """print() on global rank 0 only."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs)


def make_mesh(rt: Runtime, tp: int) -> DeviceMesh | None:
    """The 2-D ("dp", "tp") mesh, dp = world_size // tp; None in a single process (nothing to shard).

    Consecutive ranks share a "tp" group (rank = dp_index * tp + tp_index), so with one node per
    tp group the TP all-reduces stay on NVLink. ``mesh["tp"]`` goes to ``parallelize``,
    ``mesh["dp"].get_group()`` to ``all_reduce_grads``.
    """
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if rt.world_size % tp != 0:
        raise ValueError(f"world size {rt.world_size} is not divisible by tp={tp}; launch a multiple of {tp} processes")
    if not rt.distributed:
        return None
    return init_device_mesh(rt.device.type, (rt.world_size // tp, tp), mesh_dim_names=("dp", "tp"))


# ----------------------------------------------------------------------------- tensor parallelism


def check_tp(model: nn.Module, tp: int) -> None:
    """Raise a ValueError if ``parallelize`` cannot split ``model`` over ``tp`` ranks (before any work)."""
    name = type(model).__name__
    if name not in _TP_CLASSES:
        raise ValueError(f"tensor parallelism does not cover {name}; supported: {', '.join(_TP_CLASSES)}")
    cfg = model.config
    sizes = {
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        **({"num_experts": cfg.num_experts} if is_moe(cfg) else {}),
    }
    for key, size in sizes.items():
        if size % tp != 0:
            raise ValueError(f"{name}: {key}={size} is not divisible by tp={tp}; choose a tp that divides it")


def parallelize(model: nn.Module, tp_mesh: DeviceMesh | None, dp_mesh: DeviceMesh | None = None) -> nn.Module:
    """Shard ``model`` in place over ``tp_mesh`` (1-D, the "tp" axis), then with a ``dp_mesh`` (--fsdp) over the "dp"
    axis too (``shard_dp``); a no-op for None or 1-rank meshes.

    Serves the policy (*ForCausalLM) and the critic (*ForTokenClassification: ``.model`` backbone and a
    replicated ``.score`` head). Every rank must hold the same weights beforehand (same checkpoint or
    seed): sharded weights are scattered from tp rank 0, the replicated ones are kept as they are.
    After it, sharded parameters are DTensors and the rest plain tensors; the forward takes and
    returns ordinary full tensors (logits [B, L, V], values [B, L, 1]) on every rank.
    """
    if tp_mesh is None or tp_mesh.size() == 1:
        return shard_dp(model, dp_mesh)
    check_tp(model, tp_mesh.size())
    embed = model.model.embed_tokens
    tied = getattr(model, "lm_head", None) is not None and model.lm_head.weight is embed.weight
    plan = {
        # Vocab-parallel embedding: each rank looks up its rows, the partial sums are all-reduced.
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        # Column-parallel q/k/v: a rank's output columns are whole heads, returned as a plain local
        # tensor so HF's view(*shape, -1, head_dim) reads [B, L, heads / tp, head_dim].
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        # Qwen3's RMSNorm over head_dim runs on local heads unchanged. SequenceParallel on dim 2 (heads of
        # [B, L, heads, head_dim]) makes its weight a replicated DTensor, so its gradient sums all heads.
        "model.layers.*.self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "model.layers.*.self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        # Row-parallel output projections: inputs are the local heads / columns, outputs all-reduced.
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        # Vocab-sharded weight (Shard(0), like the embedding, so a tie survives); full logits gathered.
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    # One plan for all six classes: keep the entries this model has (Llama/Qwen2 have no q_norm,
    # a critic has no lm_head); parallelize_module would only warn about the others.
    names = [n for n, _ in model.named_modules()]
    plan = {key: style for key, style in plan.items() if any(fnmatch(n, key) for n in names)}
    # SequenceParallel re-creates q_norm / k_norm weights as trainable Parameters: keep frozen ones
    # frozen (e.g. a critic built with frozen attention).
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, tp_mesh, plan)
    shard_experts(model, tp_mesh)  # MoE layers: experts per rank, router replicated (a no-op for dense models)
    if tied:
        # Each style registered its own sharded copy of the shared weight; point the head back at the
        # embedding's (both Shard(0) over the vocabulary) so both uses accumulate into one gradient.
        model.lm_head.weight = model.model.embed_tokens.weight
    for n, p in model.named_parameters():
        p.requires_grad_(n not in frozen)
    return shard_dp(model, dp_mesh)


def shard_dp(model: nn.Module, dp_mesh: DeviceMesh | None) -> nn.Module:
    """FSDP2 over the "dp" axis (torchtitan's ``apply_fsdp``): each decoder layer is one ``fully_shard`` group and the
    root (embedding, final norm, LM head or score head, a tied weight with them) the last, so parameters, gradients
    and AdamW states are split over the dp ranks and a layer's full weights exist only during its forward and backward.
    On a TP model the parameters become 2-D DTensors (dp shard x tp placement). Backward reduce-scatters each layer's
    gradients as a SUM (divide factor 1; the losses are already divided by the global token count), so
    ``all_reduce_grads`` leaves an FSDP model alone. Every dp rank must then run the same forwards and backwards.
    A no-op for None or a 1-rank mesh."""
    if dp_mesh is None or dp_mesh.size() == 1:
        return model
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM / AVG)
    return model


# ----------------------------------------------------------------------------- weights and gradients


@torch.no_grad()
def full_weights(model: nn.Module, bucket_bytes: int = 64 << 20) -> Iterator[list[tuple[str, Tensor]]]:
    """Yield the model's full weights as buckets of (hf_name, tensor), for weight sync and checkpoints.

    Names and order are those of ``model.state_dict()``, i.e. what ``save_pretrained`` writes: a tied
    ``lm_head.weight`` is left out (it shares the embedding's tensor), persistent buffers are in. A LoRA
    model's adapted weights come merged under their own names (lora.hf_weights), its adapters not at all.
    A bucket holds at most ``bucket_bytes`` unless one tensor alone is larger (then it is alone).
    Each tensor is a fresh full copy on the model's device, in the model's dtype; the generator keeps
    no reference to a bucket once it is yielded, so the consumer may free it after use and peak extra
    memory is one bucket. Sharded weights are all-gathered (a collective): every TP rank must run this
    generator to the end, in lock-step, and all get the same full tensors.
    """
    bucket, size = [], 0
    seen = set()
    # keep_vars=True returns the Parameter objects themselves, so a tie shows up as the same object twice;
    # the embedding comes first in HF's module order, so the tied lm_head.weight is the one skipped.
    for name, t in hf_weights(model):  # state_dict(keep_vars=True); a LoRA layer's weight merged (W + scale B A)
        if id(t) in seen:
            continue
        seen.add(id(t))
        nbytes = t.numel() * t.element_size()  # a DTensor reports its global size: known before gathering
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        full = t.detach().full_tensor() if isinstance(t, DTensor) else t.detach().clone()
        bucket.append((name, full))
        size += nbytes
    if bucket:
        yield bucket


@torch.no_grad()
def all_reduce(x: Tensor, group=None, op=dist.ReduceOp.SUM) -> Tensor:
    """dist.all_reduce in place, returning x; the identity without a process group (one process)."""
    if dist.is_initialized():
        dist.all_reduce(x, op=op, group=group)
    return x


def tp_share(obj, tp_mesh: DeviceMesh | None):
    """The TP group's first rank's picklable object (its engine rank's rollout), on every rank of the group."""
    box = [obj]
    if tp_mesh is not None and tp_mesh.size() > 1:
        dist.broadcast_object_list(box, group_src=0, group=tp_mesh.get_group())
    return box[0]


def all_reduce_grads(model: nn.Module, dp_group: dist.ProcessGroup | None, bucket_bytes: int = 64 << 20) -> None:
    """Sum every trainable parameter's gradient over the data-parallel ranks (in place).

    SUM, not mean: each rank's loss is divided by the global token count (``losses.loss_denominator``
    summed over ranks), so the sum of the ranks' gradients is the full-batch gradient. A DTensor's
    local shard is reduced directly: its "tp" placement is untouched by the "dp" reduction.
    Gradients are flattened into buckets of about ``bucket_bytes`` (one collective per bucket, not per
    parameter: on small models the per-call latency dominates), reduced, and copied back.
    """
    if dp_group is None or dist.get_world_size(dp_group) == 1 or isinstance(model, FSDPModule):
        return  # FSDP summed them during backward
    # model.parameters() is in the same order on every rank (and lists a tied weight once), so the
    # buckets pair up; a parameter that got no gradient on this rank contributes zeros.
    grads = []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
    bucket, size = [], 0
    for i, g in enumerate(grads):
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= bucket_bytes or i == len(grads) - 1 or grads[i + 1].dtype != g.dtype:
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=dp_group)
            for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
                t.copy_(part.view_as(t))
            bucket, size = [], 0


@torch.no_grad()
def clip_grad_norm_(params: Iterable[Tensor], max_norm: float) -> Tensor:
    """Scale gradients in place so their global L2 norm is at most ``max_norm``; return the norm before.

    Gradients may be a mix of DTensors (sharded weights, on one or two meshes) and plain tensors (replicated
    norms, heads), which torch's own clip_grad_norm_ refuses to stack together. Each DTensor group's norm is
    reduced over its mesh (a shard counts once, a replicated DTensor once), the plain group's is local (its
    gradients are identical on every TP rank), and total = sqrt(sum of squares): the unsharded model's norm.
    Returns a 0-d float32 tensor on the gradients' device.
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    # DTensor gradients by mesh (with --fsdp and TP: 2-D for sharded weights, 1-D dp for the rest), then plain
    meshes = {}
    for p in params:
        meshes.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    groups = list(meshes.values())
    norms = []
    for group in groups:
        if group:
            norm = torch.nn.utils.get_total_norm([p.grad for p in group])
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total_norm = torch.linalg.vector_norm(torch.stack(norms).float())
    for group in groups:
        if group:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm)
    return total_norm
