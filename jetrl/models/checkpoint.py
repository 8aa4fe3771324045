"""Load and save HuggingFace-format checkpoints (safetensors), including the block-FP8 export.

Loading builds the model on the meta device, allocates it once on the target device, then copies one
checkpoint tensor at a time into its parameter: peak memory is the model plus one tensor, never two
copies of the model. Every parameter must come from the checkpoint and every checkpoint tensor must
land somewhere; anything else (missing shard, unreadable file, wrong shape, stray tensor) raises with
the offending name.

The FP8 export (``save_model(..., fp8=True)``) writes the layout vLLM and SGLang serve: each block
linear's ``weight`` as ``float8_e4m3fn`` bytes and ``weight_scale_inv`` as the fp32 scale of each
128x128 block (jetrl's scale, so ``dequantized = fp8 * weight_scale_inv``), and in ``config.json``::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}

The bytes are exactly ``FP8Linear.quantized_weight()``: a server computes with the weights the rollout
used. Loading the export back sets each BF16 master to the dequantized values; re-quantizing such a
master reproduces the exported bytes and scales bit for bit (tested), so the FP8 policy survives the
round trip unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Any, Iterable

import torch
import torch.nn as nn
from huggingface_hub import snapshot_download
from safetensors import safe_open
from safetensors.torch import save_file

from jetrl.models.config import DecoderConfig
from jetrl.models.gguf import check_destination, convert_gguf, gguf_folder, is_gguf
from jetrl.models.transformer import DecoderLM, build_model
from jetrl.quant import WEIGHT, FP8Linear, apply_recipe, get_backend, get_recipe
from jetrl.quant.reference import dequantize

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"
FP8_BLOCK = [128, 128]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json")
# tensors some checkpoints carry that hold no weights of the model
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)
DEFAULT_SHARD_BYTES = 5 * 1024 ** 3


def resolve_checkpoint(path: str | os.PathLike) -> str:
    """A local checkpoint folder for ``path``: the folder itself, the folder a GGUF file converts to
    (:func:`jetrl.models.gguf.gguf_folder`, converted at first use), or a hub id fetched by ``huggingface_hub``."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return path
    if is_gguf(path):
        return gguf_folder(path)
    if os.path.exists(path):
        raise ValueError(f"{path} is a file; give the checkpoint folder (holding config.json and *.safetensors) "
                         f"or a .gguf file")
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise FileNotFoundError(f"checkpoint folder {path} does not exist (and it is not a hub id 'org/name')")
    try:
        return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
    except Exception as e:  # offline, unknown repo, gated, ...
        raise FileNotFoundError(f"{path!r} is not a local folder and could not be fetched from the HuggingFace hub "
                                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def _weight_map(folder: str) -> dict[str, str]:
    """Tensor name -> safetensors file path, from the index or the single file."""
    index_path = os.path.join(folder, INDEX_NAME)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"corrupt checkpoint index {index_path}: {type(e).__name__}: {e}") from None
        missing = sorted({shard for shard in weight_map.values() if not os.path.isfile(os.path.join(folder, shard))})
        if missing:
            raise FileNotFoundError(f"checkpoint shards listed in {INDEX_NAME} are missing from {folder}: {missing}")
        return {name: os.path.join(folder, shard) for name, shard in weight_map.items()}
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        other = [f for f in os.listdir(folder) if f.endswith((".bin", ".pt", ".pth", ".gguf"))]
        hint = f" (found {other}: convert them to safetensors; give a .gguf file itself as the path)" if other else ""
        raise FileNotFoundError(f"no *.safetensors weights in {folder}{hint}")
    if len(files) > 1:
        raise ValueError(f"{folder} holds several safetensors files {files} but no {INDEX_NAME}")
    path = os.path.join(folder, files[0])
    return {name: path for name in _open(path).keys()}


class _open:
    """``safe_open`` that turns a corrupt file into a ValueError naming it."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.handle = safe_open(path, framework="pt", device="cpu")
        except Exception as e:
            raise ValueError(f"cannot read safetensors file {path}: {type(e).__name__}: {e}") from None

    def keys(self) -> list[str]:
        return list(self.handle.keys())

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.handle.get_tensor(name)
        except Exception as e:
            raise ValueError(f"cannot read tensor {name!r} from {self.path}: {type(e).__name__}: {e}") from None


def load_weights(model: DecoderLM, folder: str) -> None:
    """Fill every parameter of ``model`` from the safetensors checkpoint in ``folder`` (in place)."""
    weight_map = _weight_map(folder)
    params = dict(model.named_parameters())  # tied LM head appears once, as the embedding
    tied = model.config.tie_word_embeddings
    handles: dict[str, _open] = {}

    def read(name: str) -> torch.Tensor:
        path = weight_map[name]
        if path not in handles:
            handles[path] = _open(path)
        return handles[path].get(name)

    loaded, unexpected = set(), []
    with torch.no_grad():
        for name in weight_map:
            # (some tied checkpoints store the shared matrix twice, as lm_head.weight too)
            if name.endswith((SCALE_SUFFIX, *IGNORED_TENSOR_SUFFIXES)) or (tied and name == "lm_head.weight"):
                continue
            if name not in params:
                unexpected.append(name)
                continue
            tensor = read(name)
            if tensor.dtype == torch.float8_e4m3fn:
                scale_name = name + SCALE_SUFFIX
                if scale_name not in weight_map:
                    raise ValueError(f"FP8 tensor {name!r} has no {scale_name!r} in the checkpoint")
                try:
                    tensor = dequantize(tensor, read(scale_name).float(), WEIGHT)
                except ValueError as e:  # not 2-D, or scales of another shape
                    raise ValueError(f"FP8 tensor {name!r}: {e}") from None
            param = params[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"shape mismatch for {name!r}: checkpoint has {tuple(tensor.shape)}, the model "
                                 f"built from config.json expects {tuple(param.shape)}")
            owner = _fp8_owner(model, name)
            if owner is not None:  # its weight may live in an optimizer's master (FP8Linear.release_weight)
                owner.copy_weight_(tensor.to(device=param.device, dtype=param.dtype))
            else:
                param.copy_(tensor.to(device=param.device, dtype=param.dtype))
            loaded.add(name)
    unexpected += [n for n in weight_map if n.endswith(SCALE_SUFFIX) and n[:-len(SCALE_SUFFIX)] not in loaded]
    if unexpected:  # tensors of no parameter, or scales of no loaded tensor
        raise ValueError(f"checkpoint in {folder} has {len(unexpected)} tensors the model does not have: "
                         f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    missing = [n for n in params if n not in loaded]
    if missing:
        raise ValueError(f"checkpoint in {folder} lacks {len(missing)} tensors: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
               recipe: str | object = "bf16", strict: bool = True) -> DecoderLM:
    """Load a HF Llama/Qwen2/Qwen3 checkpoint (local folder, ``.gguf`` file or hub id) and apply a precision recipe.

    BF16/fp32 and block-FP8 checkpoints are accepted; ``dtype`` is the master-weight dtype. ``strict``
    rejects unknown config fields. The returned model remembers ``source_path`` (tokenizer files are
    copied from there on save).
    """
    folder = resolve_checkpoint(path)
    config = DecoderConfig.from_file(folder, strict=strict)
    model = build_model(config, dtype=dtype, device=device, recipe="bf16", init=False)
    load_weights(model, folder)
    apply_recipe(model, recipe)
    model.source_path = folder
    return model


def load_tokenizer(path: str | os.PathLike):
    """The checkpoint's tokenizer, through ``transformers.AutoTokenizer``."""
    from transformers import AutoTokenizer  # heavy (seconds): imported when a tokenizer is first loaded

    folder = resolve_checkpoint(path)
    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as e:
        raise ValueError(f"cannot load a tokenizer from {folder}: {type(e).__name__}: {e}") from None


def check_eos(tokenizer: Any, where: str, model_folder: str | os.PathLike | None = None) -> None:
    """Generation needs an end-of-sequence token: the tokenizer's, or the ``eos_token_id`` of the config.json
    in ``model_folder``. Raises a ValueError saying where to set one."""
    if getattr(tokenizer, "eos_token_id", None) is not None or _config_eos(model_folder):
        return
    raise ValueError(f"the tokenizer at {where} has no end-of-sequence token and its config.json names no "
                     f"eos_token_id, so generation could never stop: set \"eos_token\" in its "
                     f"tokenizer_config.json (or \"eos_token_id\" in config.json)")


def _config_eos(folder: str | os.PathLike | None) -> bool:
    """Whether ``folder``/config.json names an ``eos_token_id`` (one or several); False when it is unreadable."""
    if folder is None or not os.path.isdir(folder):
        return False
    try:
        with open(os.path.join(folder, "config.json")) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, json.JSONDecodeError):
        return False
    return eos not in (None, [])


def check_tokenizer(tokenizer: Any, config: DecoderConfig, where: str) -> None:
    """The tokenizer must belong to the model: every token id it can produce is a row of the embedding
    (``len(tokenizer) <= vocab_size``; checkpoints often pad the matrix, so fewer is fine), and its BOS and
    EOS ids are the ones ``config.json`` names (when both sides name one). A tokenizer of another model
    with the same vocabulary size still fails the special-token check. Raises a ValueError naming both."""
    size = len(tokenizer)
    if size > config.vocab_size:
        raise ValueError(f"the tokenizer at {where} has {size} tokens but the model's config.json has vocab_size="
                         f"{config.vocab_size}: it belongs to another model (set model.tokenizer to the model's "
                         f"own tokenizer, or leave it unset to use the checkpoint's)")
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and config.bos_token_id is not None and bos != config.bos_token_id:
        raise ValueError(f"the tokenizer at {where} has BOS id {bos} but the model's config.json has bos_token_id="
                         f"{config.bos_token_id}: the tokenizer belongs to another model")
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and config.eos_token_ids and eos not in config.eos_token_ids:
        raise ValueError(f"the tokenizer at {where} has EOS id {eos} but the model's config.json has eos_token_id="
                         f"{config.eos_token_id}: the tokenizer belongs to another model")


def fp8_unaligned_layers(model: nn.Module) -> list[str]:
    """The linears the block-FP8 export stores in FP8 whose weight is not a whole number of 128x128
    blocks: transformers' FP8 loader cannot read them, and vLLM needs 128-divisible partitions."""
    return sorted(name for name, layer in _fp8_linears_to_export(model).items()
                  if layer.weight.shape[0] % FP8_BLOCK[0] or layer.weight.shape[1] % FP8_BLOCK[1])


def _fp8_linears_to_export(model: nn.Module) -> dict[str, nn.Linear]:
    """The linears whose weights the export stores in FP8: the model's FP8Linears, or (under ``bf16``)
    every block linear the default recipe would swap."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    fp8 = {n: m for n, m in linears.items() if isinstance(m, FP8Linear)}
    jet = get_recipe("jet")
    return fp8 or {n: m for n, m in linears.items() if not jet.excludes(n)}


def _fp8_owner(model: nn.Module, name: str) -> FP8Linear | None:
    """The FP8Linear whose weight the parameter ``name`` is, else None."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    return module if leaf == "weight" and isinstance(module, FP8Linear) else None


def _export_tensors(model: DecoderLM, fp8: bool) -> Iterable[tuple[str, torch.Tensor]]:
    quantized = _fp8_linears_to_export(model) if fp8 else {}
    for name, param in model.named_parameters():
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        owner = _fp8_owner(model, name)
        value = owner.weight_values() if owner is not None else param.detach()  # a released weight: its master's
        module_name, _, leaf = name.rpartition(".")
        layer = quantized.get(module_name)
        if layer is not None and leaf == "weight":
            # the bytes FP8Linear.quantized_weight() holds (its scaling), quantized here without caching a copy
            pow2 = layer.pow2_scale if isinstance(layer, FP8Linear) else False
            q = get_backend(param.device).quantize(value, WEIGHT, pow2)
            yield name, q.data
            yield name + SCALE_SUFFIX, q.scale.float()
        else:
            yield name, value


def save_model(model: DecoderLM, path: str | os.PathLike, fp8: bool = False,
               max_shard_size: int = DEFAULT_SHARD_BYTES) -> None:
    """Write ``model`` as a HF checkpoint (config.json + safetensors, sharded above ``max_shard_size`` bytes).

    ``fp8=True`` writes the block-FP8 layout (see the module docstring). Tokenizer and generation files
    of the checkpoint the model was loaded from are copied along.
    """
    if not isinstance(model, DecoderLM):
        raise TypeError(f"save_model needs a jetrl DecoderLM, got {type(model).__name__}")
    if int(max_shard_size) <= 0:
        raise ValueError(f"max_shard_size must be positive, got {max_shard_size}")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    for stale in os.listdir(path):  # never mix shards of two saves
        if stale.endswith(".safetensors") or stale == INDEX_NAME:
            os.remove(os.path.join(path, stale))

    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    for name, tensor in _export_tensors(model, fp8):
        nbytes = tensor.numel() * tensor.element_size()
        if sizes[-1] and sizes[-1] + nbytes > max_shard_size:
            shards.append({})
            sizes.append(0)
        shards[-1][name] = tensor.to("cpu").contiguous()
        sizes[-1] += nbytes
    # writing shard by shard: each dict only references the model's tensors (CPU models: no copy)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, WEIGHTS_NAME), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
            weight_map.update({name: file for name in shard})
        with open(os.path.join(path, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, f, indent=2)

    hf = {**model.config.to_hf(), "torch_dtype": str(model.dtype).removeprefix("torch.")}
    if fp8:
        exported = set(_fp8_linears_to_export(model))
        kept = sorted(n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in exported
                      and n != "lm_head")
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": FP8_BLOCK}
        if kept:
            qc["ignored_layers"] = kept
            qc["modules_to_not_convert"] = kept + ["lm_head"]
        hf["quantization_config"] = qc
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    # safetensors writes its files owner-only (0600); give them the mode every other file gets (the umask's)
    mode = os.stat(os.path.join(path, "config.json")).st_mode & 0o777
    for file in os.listdir(path):
        if file.endswith(".safetensors"):
            os.chmod(os.path.join(path, file), mode)

    source = model.source_path
    if source and os.path.isdir(source) and os.path.abspath(source) != os.path.abspath(path):
        for file in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(source, file)):
                shutil.copyfile(os.path.join(source, file), os.path.join(path, file))


def export_model(source: str | os.PathLike, output: str | os.PathLike, fp8: bool = False,
                 overwrite: bool = False) -> str:
    """Write the checkpoint folder ``source`` to ``output`` as a HuggingFace BF16 folder, or block-FP8 with
    ``fp8`` (the layout vLLM and SGLang serve); returns ``output``.

    ``output`` must be new or empty: a folder that holds files is refused (nothing is deleted) unless
    ``overwrite``, which replaces its weights and config.json. With ``fp8``, FP8 layers whose weights are not
    whole 128x128 blocks are named in a warning: the export is exact and jetrl loads it, but transformers'
    FP8 loader and vLLM accept only 128-divisible shapes. A ``.gguf`` ``source`` is dequantized
    (:mod:`jetrl.models.gguf`): its BF16 folder, with tokenizer and chat template, is the export."""
    source, output = os.fspath(source), os.fspath(output)
    if is_gguf(source) and not fp8:
        return convert_gguf(source, output, overwrite=overwrite)
    if is_gguf(source):
        source = gguf_folder(source)
    if not os.path.isdir(source):
        raise FileNotFoundError(f"checkpoint folder {source} does not exist; give a HuggingFace model folder or a "
                                f".gguf file")
    if os.path.abspath(source) == os.path.abspath(output):
        raise ValueError("the export folder must differ from the source checkpoint")
    check_destination(output, overwrite)
    model = load_model(source, dtype=torch.bfloat16, device="cpu", recipe="bf16")
    if fp8:
        unaligned = fp8_unaligned_layers(model)
        if unaligned:
            shapes = sorted({tuple(model.get_submodule(n).weight.shape) for n in unaligned})
            warnings.warn(f"{len(unaligned)} FP8 layers have weights that are not whole 128x128 blocks (shapes "
                          f"{shapes}; e.g. {unaligned[:3]}): jetrl loads this export, but transformers' FP8 loader "
                          f"and vLLM need every dimension of an FP8 weight divisible by 128", stacklevel=2)
    save_model(model, output, fp8=fp8)
    return output


def resolve_device(name: str | torch.device | None) -> torch.device:
    """The device a config or command line names; ``"auto"`` (or None) is CUDA when present, else the CPU.
    A CUDA device that this machine or torch build does not have is a ValueError saying so."""
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {name!r} was asked for but {why}; use 'cpu' or 'auto'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} was asked for but only {torch.cuda.device_count()} CUDA GPUs are "
                             f"visible")
    return device


__all__ = ["load_model", "load_tokenizer", "save_model", "load_weights", "resolve_checkpoint", "export_model",
           "resolve_device", "check_eos", "check_tokenizer", "fp8_unaligned_layers"]
