"""The SGLang rollout engine: rollout.py's engine interface on `sglang.Engine`, in-process.

    engine = SGLangEngine("path/to/policy", dtype="fp32")        # under `if __name__ == "__main__":`
    ro = engine.generate([[5, 7, 9], [5, 8]], Sampling(temperature=0.7, max_new_tokens=32, n=4, stop_token_ids=(2,)))
    engine.sleep(); ...train...; engine.wake()
    engine.update_weights(policy.named_parameters())           # buckets, no disk; flushes the prefix cache

Install with `bash scripts/install_sglang_cpu.sh` (its own venv, .venv-sglang). `import sglang` happens in
the constructor, so this module imports without it. sglang.Engine spawns its scheduler and detokenizer
processes (multiprocessing "spawn", set globally by SGLang), so create the engine under
`if __name__ == "__main__":`. On a machine without CUDA it runs SGLang's official CPU mode
(SGLANG_USE_CPU_ENGINE=1, device="cpu", attention_backend="torch_native").

Which log-prob SGLang returns (sglang 0.5.23, sglang/srt/layers/sampler.py):
- By default, log softmax(logits / temperature) of the sampled token (line 275 scales the logits,
  line 315 returns log of those probabilities), taken BEFORE top-k / top-p: the filter works on a
  sorted copy (lines 822-827), so with top-k or top-p on, the default log-prob is not the log-prob of
  the distribution sampled from (it is not renormalised over the kept tokens).
- Greedy rows (temperature < 1e-6 or top_k = 1) get log softmax(logits) at temperature 1 (line 221);
  SGLANG_RETURN_ORIGINAL_LOGPROB=1 also returns that unscaled log-prob (lines 237, 323).
- With `return_sampling_mask=True` (a GenerateReqInput field that `Engine.generate` does not expose),
  SGLang returns log(p_token / p_kept), the behaviour log-prob under the filtered, renormalised
  distribution it sampled from (line 574), in meta_info["output_token_sampling_logprobs"]. It
  requires a finite top_k <= --sampling-mask-max-tokens (scheduler.py:3174).
So this class returns the default log-prob when neither top-k nor top-p is on (it is then exactly the
sampled distribution), and the sampling-mask log-prob when one of them is (top-p alone is sent as
top_k = vocab size, which keeps every token, with sampling_mask_max_tokens = vocab size).
Both equal logprobs.token_logprobs(logits, tokens, temperature, top_k=, top_p=) up to float rounding.
top-k and top-p together are refused: SGLang's nucleus cut uses the cumulative mass of the
unfiltered probabilities (line 827), logprobs.process_logits the mass renormalised after top-k, so the
kept sets differ. Ties: SGLang keeps exactly k tokens by sort order, logprobs every token tied with the
k-th (only matters for exactly equal logits).

Stopping: SGLang always stops at the model's own EOS ids (config.json and generation_config.json)
unless `ignore_eos`, which also disables stop_token_ids. When Sampling.stop_token_ids contains every
EOS id, SGLang stops natively; otherwise rows run with ignore_eos and are cut here at the first stop
token (correct, but rows keep generating to max_new_tokens).

Not available in this mode: Sampling.seed reaches SGLang as a per-row `sampling_seed`, which SGLang
honours only with enable_deterministic_inference=True, and that needs a GPU attention backend
(fa3, flashinfer, triton, ...). On CPU the sampling stream is seeded once, by `random_seed` at start.
release/resume_memory_occupation succeed on CPU but free nothing (sleep then returns about 0 bytes).

Precision knobs (embedded_engine.EmbeddedEngine's names), mapped to SGLang 0.5.23's own options or refused:
- kv_cache_dtype="fp8" -> kv_cache_dtype="fp8_e4m3": float8_e4m3fn KV cache, scale 1.0 without
  quantization_param_path (the embedded engine's rule). On GPU, SGLang's prefill (e.g. the triton
  backend's extend kernel) attends over the fresh k/v of the tokens it computes and reads fp8 only for
  cached prefixes and decode steps (the embedded engine rounds the prefill's k/v too), so the first
  response token's log-prob differs slightly. On CPU
  SGLang's fp8 KV cache needs Intel AMX and attention_backend="intel_amx"
  (sglang/srt/mem_cache/kv_cache_configurator.py); the torch_native backend used here has none: refused.
- dtype="int4" is refused: SGLang 0.5.23 has no torchao_config option, so no torchao "int4wo-32" (which
  would be torchao's asymmetric int4 weight-only anyway, not bit-identical to the embedded engine's
  symmetric rule), and its int4 methods (--quantization gptq, awq, ...) load pre-quantised checkpoints,
  which update_weights cannot refresh from the trainer's weights.
"""

from __future__ import annotations

import glob
import json
import os
from contextlib import contextmanager
from typing import Iterable

import torch
from torch import Tensor

from moe import checkpoint_tensors
from rollout import Rollout, Sampling, check_request

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SGLANG_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
# embedded_engine.EmbeddedEngine's kv_cache_dtype -> SGLang's
SGLANG_KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8_e4m3"}
# SGLang turns temperature below this into greedy sampling (sglang/srt/sampling/sampling_params.py:245),
# whose returned log-prob is at temperature 1: refuse rather than return the wrong log-prob.
SGLANG_GREEDY_TEMPERATURE = 1e-6
# KV-cache bound on CPU: SGLang's default sizes the cache from free memory (15 GB and 70 s to start here).
CPU_MAX_TOTAL_TOKENS = 16384
# Spreads each row's seed (Sampling.row_seed: seed + r, the embedded engine's rule, so a batch split over calls
# whose seeds are offset by their first row gives the same rows) over SGLang's 64-bit seeds; odd (golden ratio).
_SEED_MIX = 0x9E3779B97F4A7C15


class SGLangEngine:
    """Rollout engine on sglang.Engine; same interface and Rollout alignment as embedded_engine.EmbeddedEngine.

    model_path: a Hugging Face folder (config.json + safetensors); no tokenizer is needed, prompts are ids.
    dtype: "fp32" or "bf16" (SGLang's model dtype; log-probs come back as float32 either way); "int4" is
        refused (see the module docstring).
    kv_cache_dtype: "auto" (the model dtype) or "fp8" (SGLang's "fp8_e4m3"; CUDA only, see the module docstring).
    max_total_tokens: KV-cache capacity in tokens; None = CPU_MAX_TOTAL_TOKENS on CPU, SGLang's choice on GPU.
    bucket_bytes: update_weights sends tensors in buckets of about this many bytes.
    cpu_threads: OMP threads of SGLang's processes (set in their environment only).
    random_seed: seeds SGLang's sampling stream once at start (see the module docstring on seeds).
    server_args: passed on to sglang.Engine (e.g. tp_size, mem_fraction_static, enable_deterministic_inference).
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "fp32",
        kv_cache_dtype: str = "auto",
        max_total_tokens: int | None = None,
        bucket_bytes: int = 1 << 29,
        cpu_threads: int = 1,
        random_seed: int = 0,
        log_level: str = "warning",
        **server_args,
    ):
        if dtype == "int4":
            raise ValueError(
                "SGLangEngine: dtype 'int4' has no SGLang 0.5.23 counterpart: there is no torchao_config "
                "option (torchao 'int4wo-32'), and --quantization gptq / awq load pre-quantised checkpoints "
                "that update_weights cannot refresh; use EmbeddedEngine(dtype='int4')"
            )
        if dtype not in DTYPES:
            raise ValueError(f"SGLangEngine: dtype must be one of {list(DTYPES)}, got {dtype!r}")
        if not os.path.isfile(os.path.join(model_path, "config.json")):
            raise FileNotFoundError(f"SGLangEngine: {model_path!r} is not a Hugging Face model folder (no config.json)")
        if bucket_bytes < 1:
            raise ValueError(f"SGLangEngine: bucket_bytes must be >= 1, got {bucket_bytes}")
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
        self.vocab_size = config["vocab_size"]
        self.context_len = config["max_position_embeddings"]
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.eos_ids = _model_eos_ids(model_path, config)
        self.shapes = _checkpoint_shapes(model_path)
        self.dtype = DTYPES[dtype]
        self.bucket_bytes = bucket_bytes

        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        args = dict(
            model_path=model_path,
            dtype=SGLANG_DTYPES[dtype],
            device=self.device,
            random_seed=random_seed,
            skip_tokenizer_init=True,
            log_level=log_level,
            # top-p alone is sent as top_k = vocab size; its sampling mask may then hold the whole vocabulary.
            sampling_mask_max_tokens=max(self.vocab_size, 4096),
        )
        if self.device == "cpu":
            args.update(attention_backend="torch_native", max_total_tokens=max_total_tokens or CPU_MAX_TOTAL_TOKENS)
        else:
            args.update(enable_memory_saver=True, max_total_tokens=max_total_tokens)  # sleep frees weights + KV cache
        args.update(server_args)
        args["kv_cache_dtype"] = sglang_kv_cache_dtype(kv_cache_dtype, self.device, args.get("attention_backend"))
        if self.device == "cpu":
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"  # read once (lru_cache): before the first sglang import
        import sglang

        env = {
            "OMP_NUM_THREADS": str(cpu_threads),
            # Under torchrun this makes SGLang's own process group join torchrun's agent store: its
            # scheduler then hangs at start-up.
            "TORCHELASTIC_USE_AGENT_STORE": None,
        }

        with _environment(env):  # the spawned processes copy the environment at start
            self._engine = sglang.Engine(**args)
        self._asleep = False
        self._closed = False

    # ---- generation ------------------------------------------------------------------------------

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> Rollout:
        """Sample sampling.n responses per prompt. Returns a Rollout with B = len(prompt_ids) * n rows."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        self._check_ready("generate")
        self._check_request(prompt_ids, sampling)
        rows = [list(p) for p in prompt_ids for _ in range(sampling.n)]
        top_k = self._top_k(sampling)
        filtered = top_k > 0 or sampling.top_p < 1.0
        native_stop = self.eos_ids <= set(sampling.stop_token_ids)
        params = [
            dict(
                max_new_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                # SGLang: -1 = off; a finite top_k is what return_sampling_mask needs (see module docstring).
                top_k=top_k or (self.vocab_size if filtered else -1),
                stop_token_ids=list(sampling.stop_token_ids),
                ignore_eos=not native_stop,
                sampling_seed=(sampling.row_seed(r) * _SEED_MIX) % 2**63,
            )
            for r in range(len(rows))
        ]
        # Engine.generate without its missing return_sampling_mask argument (sglang/srt/entrypoints/engine.py:433).
        req = GenerateReqInput(
            input_ids=rows, sampling_params=params, return_logprob=True, return_sampling_mask=filtered
        )
        outs = self._engine.loop.run_until_complete(
            self._engine.tokenizer_manager.generate_request(req, None).__anext__()
        )

        stop = set(sampling.stop_token_ids)
        toks, logps, reasons = [], [], []
        for r, out in enumerate(outs):
            meta = out["meta_info"]
            ids = out["output_ids"]
            kind = meta["finish_reason"]["type"]
            if kind not in ("stop", "length"):
                raise RuntimeError(f"SGLangEngine.generate: SGLang ended row {r} with {meta['finish_reason']}")
            if filtered:
                logp = meta["output_token_sampling_logprobs"]
            else:
                logp = [lp for lp, _, _ in meta["output_token_logprobs"]]
            if len(logp) != len(ids):
                raise RuntimeError(f"SGLangEngine.generate: row {r} has {len(ids)} tokens but {len(logp)} log-probs")
            cut = next((i + 1 for i, t in enumerate(ids) if t in stop), None)  # the stop token stays in
            if cut is not None:
                ids, logp = ids[:cut], logp[:cut]
                kind = "stop"
            toks.append(ids)
            logps.append(logp)
            reasons.append(kind)

        return Rollout.from_ragged(toks, rows, reasons, infer_logp=logps)

    def _top_k(self, sampling: Sampling) -> int:
        """Sampling.top_k, with 0 for a top_k that keeps the whole vocabulary (as logprobs.process_logits does)."""
        return sampling.top_k if sampling.top_k < self.vocab_size else 0

    def _check_request(self, prompt_ids, sampling: Sampling) -> None:
        check_request(prompt_ids, sampling, self.vocab_size, self.context_len)
        if self._top_k(sampling) > 0 and sampling.top_p < 1.0:
            raise NotImplementedError(
                "SGLangEngine: top_k and top_p together are refused: SGLang cuts the nucleus on the cumulative "
                "mass before top-k renormalisation (sglang/srt/layers/sampler.py:827), logprobs.process_logits after "
                "it, so engine and trainer would keep different tokens. Use one of them."
            )
        if sampling.temperature < SGLANG_GREEDY_TEMPERATURE:
            raise ValueError(
                f"SGLangEngine: temperature {sampling.temperature} < {SGLANG_GREEDY_TEMPERATURE} is greedy "
                "in SGLang, whose log-prob is then at temperature 1; use top_k=1 for greedy decoding"
            )

    # ---- weights ---------------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Load full tensors under their Hugging Face state_dict names, in buckets of about bucket_bytes.

        Every name and shape is checked against the checkpoint before it is sent (SGLang only logs a
        warning for an unknown name). The whole update is one begin/end_weight_update session: in
        sglang 0.5.23 update_weights_from_tensor outside one returns False and changes nothing. The
        last bucket also flushes the prefix cache, whose KV entries the old weights computed (inside
        the scheduler: 0.05 s here, a separate flush_cache() call takes 0.4 s).
        """
        self._check_ready("update_weights")
        _ok(self._engine.begin_weight_update(), "begin_weight_update")
        try:
            # One bucket is held back until the next is full, so that the last one is known and flushes.
            # At most two buckets of copies are alive; SGLang has loaded a bucket when the call returns.
            pending = None
            for bucket in self._buckets(named_tensors):
                if pending is not None:
                    self._send(pending, flush_cache=False)
                pending = bucket
            if pending is not None:
                self._send(pending, flush_cache=True)
        finally:
            _ok(self._engine.end_weight_update(), "end_weight_update")

    def _buckets(self, named_tensors: Iterable[tuple[str, Tensor]]):
        """Checked copies in the engine dtype, grouped into lists of about bucket_bytes."""
        bucket, size = [], 0
        # MoE: experts one by one
        pairs = (pair for named in named_tensors for pair in checkpoint_tensors(*named))
        for name, t in pairs:
            if name == "lm_head.weight" and self.tied:
                continue  # the embedding itself; SGLang skips it too
            self._check_weight(name, t)
            # A copy: serialising a CPU tensor moves its storage into shared memory in place, which
            # must not happen to the trainer's own parameters.
            bucket.append((name, t.detach().to(self.dtype, copy=True).contiguous()))
            size += bucket[-1][1].nbytes
            if size >= self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def _send(self, bucket: list[tuple[str, Tensor]], flush_cache: bool) -> None:
        _ok(self._engine.update_weights_from_tensor(bucket, flush_cache=flush_cache), "update_weights_from_tensor")

    def _check_weight(self, name: str, t: Tensor) -> None:
        if name not in self.shapes:
            raise KeyError(
                f"SGLangEngine.update_weights: unknown parameter {name!r} (expected the checkpoint's "
                f"names, e.g. {next(iter(self.shapes))!r})"
            )
        if tuple(t.shape) != self.shapes[name]:
            raise ValueError(
                f"SGLangEngine.update_weights: {name!r} has shape {tuple(t.shape)}, "
                f"the checkpoint {self.shapes[name]} (pass full, unsharded tensors)"
            )

    def check_weights(self, named_tensors: Iterable[tuple[str, Tensor]], atol: float = 0.0) -> None:
        """Raise ValueError naming the first parameter whose engine copy differs from the given tensor
        (cast to the engine dtype) by more than atol. Reads every tensor back as a Python list: a debugging
        check for small models, not for every step."""
        self._check_ready("check_weights")
        for name, t in (pair for named in named_tensors for pair in checkpoint_tensors(*named)):
            if name == "lm_head.weight" and self.tied:
                continue
            self._check_weight(name, t)
            got = self._engine.get_weights_by_name(name, truncate_size=t.shape[0])
            if got is None:
                raise RuntimeError(f"SGLangEngine.check_weights: SGLang could not read back {name!r}")
            want = t.detach().to(self.dtype).float().cpu()
            diff = (torch.tensor(got, dtype=torch.float32) - want).abs().max().item()
            if not diff <= atol:
                raise ValueError(
                    f"SGLangEngine.check_weights: {name!r} differs from the engine's copy "
                    f"(max abs diff {diff:.3g} > atol {atol})"
                )

    # ---- memory and lifetime ---------------------------------------------------------------------

    def sleep(self) -> int:
        """release_memory_occupation (weights and KV cache on GPU; on CPU it frees nothing).

        Returns the bytes released: the drop of the device's used memory on GPU, of the resident set
        size of SGLang's processes on CPU (clamped at 0)."""
        self._check_ready("sleep")
        before = self.memory_in_use()
        self._engine.release_memory_occupation()
        self._asleep = True
        return max(0, before - self.memory_in_use())

    def wake(self) -> None:
        """resume_memory_occupation; generate and update_weights work again."""
        self._check_open("wake")
        if self._asleep:
            self._engine.resume_memory_occupation()
        self._asleep = False

    def memory_in_use(self) -> int:
        """Bytes in use: the whole device's on GPU, SGLang's processes' resident set on CPU."""
        if self.device == "cuda":
            free, total = torch.cuda.mem_get_info()
            return total - free
        import psutil  # an SGLang dependency

        return sum(psutil.Process(pid).memory_info().rss for pid in self._engine.get_all_child_pids())

    def shutdown(self) -> None:
        """Stop SGLang's processes; the engine cannot be used afterwards. Safe to call twice."""
        if not self._closed:
            self._engine.shutdown()
        self._closed = True

    def _check_open(self, caller: str) -> None:
        if self._closed:
            raise RuntimeError(f"SGLangEngine.{caller}: the engine was shut down")

    def _check_ready(self, caller: str) -> None:
        self._check_open(caller)
        if self._asleep:
            raise RuntimeError(f"SGLangEngine.{caller}: the engine is asleep; call wake() first")


def sglang_kv_cache_dtype(kv_cache_dtype: str, device: str, attention_backend: str | None) -> str:
    """SGLang's kv_cache_dtype server arg for embedded_engine.EmbeddedEngine's kv_cache_dtype, or a ValueError where
    SGLang 0.5.23 cannot do it on this device and attention backend."""
    if kv_cache_dtype not in SGLANG_KV_CACHE_DTYPES:
        raise ValueError(
            f"SGLangEngine: kv_cache_dtype must be one of {list(SGLANG_KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    if kv_cache_dtype == "fp8" and device == "cpu" and attention_backend != "intel_amx":
        raise ValueError(
            f"SGLangEngine: kv_cache_dtype 'fp8' (SGLang's 'fp8_e4m3') on CPU needs Intel AMX and "
            f"attention_backend='intel_amx' in SGLang 0.5.23; this engine runs {attention_backend!r}"
        )
    return SGLANG_KV_CACHE_DTYPES[kv_cache_dtype]


def _ok(result, what: str) -> None:
    """SGLang's control calls return (success, message); turn a failure into an error."""
    success, message = result[0], result[1]
    if not success:
        raise RuntimeError(f"SGLangEngine: SGLang {what} failed: {message}")


def _model_eos_ids(model_path: str, config: dict) -> set[int]:
    """The ids SGLang always stops at: config.json's eos_token_id and generation_config.json's
    (sglang/srt/configs/model_config.py, _get_hf_eos_token_id)."""
    ids = set()
    sources = [config]
    gen_path = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            sources.append(json.load(f))
    for src in sources:
        eos = src.get("eos_token_id")
        ids |= {eos} if isinstance(eos, int) else set(eos or ())
    return ids


def _checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape, read from the folder's safetensors headers (no tensor is loaded)."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"SGLangEngine: no *.safetensors in {model_path!r} (save with save_pretrained)")
    shapes = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


@contextmanager
def _environment(changes: dict[str, str | None]):
    """Set (or, for None, remove) environment variables for the duration of the block, then restore."""
    saved = {k: os.environ.get(k) for k in changes}
    try:
        for k, v in changes.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
