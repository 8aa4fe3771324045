"""GGUF checkpoints (llama.cpp's format) as a model source.

A GGUF file holds a model's config, tokenizer, chat template and weights, most of them quantized in
llama.cpp's block formats (Q4_1: 32 weights share an fp16 scale and minimum). jetrl trains BF16 masters,
so a GGUF file is read once into a HuggingFace folder: ``config.json`` (as jetrl writes it), the weights
dequantized to BF16 in ``model.safetensors``, the tokenizer with its chat template. The reading is
transformers' own (``AutoConfig`` / ``AutoTokenizer`` with ``gguf_file=`` and its GGUF tensor mapping, which
undoes llama.cpp's Q/K row permutation of Llama checkpoints); the dequantization is the ``gguf`` package's.

Two ways in:

* ``model.path: /path/model.gguf`` (any command): the file is converted at first use into a folder under
  the cache (``$JETRL_CACHE``, default ``~/.cache/jetrl``; ``gguf/<name>-<hash of path, size, mtime>``) and
  read from there afterwards; the conversion is written to a temporary folder and renamed, so an
  interrupted one leaves nothing half-written, and concurrent ranks agree on one folder.
* ``jetrl export model.gguf out/`` writes that folder where the user wants it (``--fp8``: the block-FP8
  export of the dequantized weights).

What is checked before any tensor is read: the ``gguf`` package is installed, the file is GGUF, its
architecture is one jetrl builds (``llama``, ``qwen2``, ``qwen3``) and every tensor's type is one
:data:`DEQUANTIZED_TYPES` names. Each is one ``ValueError`` (``ImportError`` for the package) saying what to do.
The weights keep their GGUF rounding: a Q4 file gives a BF16 model with 4-bit-rounded weights, not the
model it was quantized from.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from jetrl.models.config import DecoderConfig
from jetrl.models.transformer import build_model

GGUF_SUFFIX = ".gguf"
# GGUF ``general.architecture`` values jetrl builds, and their HuggingFace model_type
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# tensor types the gguf package dequantizes that jetrl accepts (llama.cpp's float and block formats)
DEQUANTIZED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                     "Q6_K")
INSTALL_HINT = "pip install 'jetrl[gguf]' (the gguf package)"


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix; :func:`convert_gguf` checks the contents)."""
    return os.fspath(path).lower().endswith(GGUF_SUFFIX)


def _reader(path: str):
    try:
        import gguf
    except ImportError:
        raise ImportError(f"reading the GGUF file {path} needs the gguf package: {INSTALL_HINT}") from None
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # wrong magic, truncated, ...
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None


def check_destination(output: str, overwrite: bool) -> None:
    """An export's ``output`` must be a new or empty folder, or ``overwrite`` given; nothing is deleted here."""
    if os.path.exists(output) and not os.path.isdir(output):
        raise FileExistsError(f"the export destination {output} is a file; give a folder")
    if os.path.isdir(output) and os.listdir(output) and not overwrite:
        raise FileExistsError(f"the export destination {output} is not empty; choose a new folder, or pass --overwrite")


def _inspect(path: str):
    """The HuggingFace model_type of the GGUF file at ``path`` and its reader, whose header the caller may read
    further (parsing it reads the whole vocabulary: seconds for a 49K-token tokenizer, so once per conversion).
    Raises a ValueError for an architecture jetrl does not build or a tensor type it does not dequantize, from the
    header alone, before any tensor data is read."""
    reader = _reader(path)
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path} names no general.architecture; it is not a model GGUF file")
    arch = field.contents()
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path} holds a {arch!r} model; jetrl builds {sorted(ARCHITECTURES)} (Llama, Qwen2, Qwen3)")
    unsupported = sorted({tensor.tensor_type.name for tensor in reader.tensors} - set(DEQUANTIZED_TYPES))
    if unsupported:
        raise ValueError(f"{path} has tensors of type {unsupported}, which jetrl does not dequantize (it reads "
                         f"{', '.join(DEQUANTIZED_TYPES)}); convert the model with another quantization type, or "
                         f"use its original HuggingFace checkpoint")
    return ARCHITECTURES[arch], reader


SPECIAL_TOKEN_FIELDS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                        "unk_token": "tokenizer.ggml.unknown_token_id", "pad_token": "tokenizer.ggml.padding_token_id"}


def _set_special_tokens(tokenizer, reader, path: str) -> None:
    """Name the file's own BOS/EOS/UNK/PAD tokens (read by ``reader``) on the tokenizer (transformers versions
    differ in which ones their GGUF reading sets: 5.17 makes SmolLM2's BOS its EOS)."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    for attribute, key in SPECIAL_TOKEN_FIELDS.items():
        field = reader.fields.get(key)
        if field is None or tokens is None:
            continue
        index = int(field.contents())
        if not 0 <= index < len(tokens.data):
            raise ValueError(f"{path}: {key} = {index} is not a token of its {len(tokens.data)}-token vocabulary")
        setattr(tokenizer, attribute, tokens.contents(index))


def _hf_parts(path: str, reader):
    """transformers' reading of the file: (config dict, tokenizer, {HF tensor name: fp32 tensor})."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as e:
        raise ImportError(f"reading GGUF files needs transformers' GGUF support ({e}); {INSTALL_HINT}") from None
    folder, name = os.path.split(os.path.abspath(path))
    hf_config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _set_special_tokens(tokenizer, reader, path)
    with torch.device("meta"):  # names and shapes only: transformers maps GGUF tensor names through it
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]
    return hf_config.to_dict(), tokenizer, tensors


def _check_tensors(config: DecoderConfig, tensors: dict[str, torch.Tensor], path: str) -> None:
    """The tensors read from ``path`` are exactly the parameters of the decoder ``config`` describes, shape for
    shape (a tied LM head appears once, as the embedding); else a ValueError naming the differences."""
    with torch.device("meta"):
        model = build_model(config, device="meta", init=False)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    wrong = sorted(n for n in set(expected) & set(got) if expected[n] != got[n])
    if missing or extra or wrong:
        shapes = [(n, got[n], expected[n]) for n in wrong[:4]]
        raise ValueError(f"{path} does not hold the {config.model_type} decoder its config describes: missing "
                         f"{missing[:4]}, unexpected {extra[:4]}, shapes differ {shapes}")


def convert_gguf(path: str | os.PathLike, output: str | os.PathLike, overwrite: bool = False) -> str:
    """Write the GGUF file ``path`` as a HuggingFace folder at ``output``: config.json, BF16 weights in
    model.safetensors, tokenizer files with the chat template. Returns ``output``.

    ``output`` must be new or empty unless ``overwrite``. The folder appears whole or not at all (written
    beside it, then renamed). Every tensor must map to a parameter of the decoder jetrl builds from the
    config, with its shape, and every parameter must have one, so a file transformers reads differently is an
    error, not a silently different model."""
    path, output = os.fspath(path), os.fspath(output)
    model_type, reader = _inspect(path)
    check_destination(output, overwrite)
    hf, tokenizer, tensors = _hf_parts(path, reader)
    config = DecoderConfig.from_hf(hf, source=path)
    if config.model_type != model_type:
        raise ValueError(f"{path}: transformers reads a {config.model_type!r} config from a {model_type!r} file")
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    _check_tensors(config, tensors, path)
    parent = os.path.dirname(os.path.abspath(output)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".gguf-", dir=parent)
    try:
        weights = {name: t.to(torch.bfloat16).contiguous() for name, t in tensors.items()}
        save_file(weights, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        del weights, tensors
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump({**config.to_hf(), "torch_dtype": "bfloat16"}, f, indent=2)
        tokenizer.save_pretrained(tmp)
        mode = 0o777 & ~_umask()  # mkdtemp and safetensors create owner-only; give the modes other files get
        os.chmod(tmp, mode)
        for file in os.listdir(tmp):
            os.chmod(os.path.join(tmp, file), mode & 0o666)
        if os.path.isdir(output):
            shutil.rmtree(output)
        try:
            os.rename(tmp, output)
        except OSError:
            if not os.path.isfile(os.path.join(output, "config.json")):  # not a concurrent writer's finished copy
                raise
    except OSError as e:
        raise OSError(f"could not write the converted GGUF folder {output}: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return output


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def gguf_folder(path: str | os.PathLike) -> str:
    """The HuggingFace folder converted from the GGUF file ``path``, converted now if the cache lacks it: under
    ``$JETRL_CACHE/gguf`` (default ``~/.cache/jetrl/gguf``), keyed by the file's absolute path, size and
    modification time (a replaced file converts anew)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    stat = os.stat(path)
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cache = Path(os.environ.get("JETRL_CACHE") or Path.home() / ".cache" / "jetrl") / "gguf"
    folder = cache / f"{Path(path).stem}-{key}"
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return str(folder)
    print(f"jetrl: converting {path} to a HuggingFace folder at {folder} (once; jetrl export writes one "
          f"elsewhere)", file=sys.stderr)
    return convert_gguf(path, folder, overwrite=True)


__all__ = ["ARCHITECTURES", "DEQUANTIZED_TYPES", "check_destination", "convert_gguf", "gguf_folder", "is_gguf"]
