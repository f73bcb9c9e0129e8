"""The two spellings of a config.json: the checkpoint respelled in the hub's older schema, for the kit.

transformers 5 writes RoPE as ``rope_parameters`` (one dict, or one per layer type) and the
layer kinds as ``layer_types``; hub checkpoints of the older model types spell the same thing
the older way (``/work/shared/hub-configs``, ``lollm.cli.hub_configs``):

=========  ===================================================================================
qwen2/3    ``rope_theta`` and ``rope_scaling`` at the top level, no ``layer_types``
gemma2     ``rope_theta``, no ``layer_types`` (transformers alternates sliding and global layers)
gemma3     ``rope_theta`` (global layers), ``rope_local_base_freq`` (sliding layers),
           ``rope_scaling`` (global layers only), ``sliding_window_pattern`` N (every N-th
           layer global) or ``layer_types``
gemma4,    ``rope_parameters`` already: there is no older schema (transformers ignores
qwen3_5    ``rope_theta`` for them)
=========  ===================================================================================

The kit's tiny checkpoints are written by transformers 5, so a family's parsing of the older
spelling would never run. :func:`respell_in_hub_schema` rewrites a checkpoint's config dict the
older way (and :func:`respell_in_transformers5_schema` a hub-schema checkpoint the new way: the
kit checks every checkpoint in both, :func:`other_schema`); :func:`hub_schema_copy` writes the copy folder (the new config.json, the same weight
files linked); :func:`transformers_reads_it_the_same` proves, with transformers, that the two
spellings mean the same model (or says why not). The kit's test
(``test_hub_schema_gives_the_same_logits``, :mod:`lollm.testing.parity_checks`) then asks the
family for the same logits, bit for bit, from both folders.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import torch

from lollm.load.loader import load_checkpoint
from lollm.proof.parity import load_reference_model, relabel_model_types

SLIDING, FULL = "sliding_attention", "full_attention"
#: The keys of the older schema :func:`respell_in_hub_schema` may write, each checked to be read by transformers.
OLDER_KEYS = ("rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern")


class NoOlderSchema(Exception):
    """The checkpoint's config has no older spelling (the message says why): the kit's test skips with it."""


def _text_part(config: dict) -> dict:
    """The dict that holds the decoder's keys: ``text_config`` when the config nests one, else the config."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def _scaling(params: dict) -> dict | None:
    """A RoPE dict without its base, as ``rope_scaling`` (None for a plain default RoPE)."""
    rest = {k: v for k, v in params.items() if k != "rope_theta"}
    if rest.get("rope_type", rest.get("type", "default")) == "default" and set(rest) <= {"rope_type", "type"}:
        return None
    return rest


def respell_in_hub_schema(config: dict) -> dict:
    """A copy of the config.json dict ``config`` with RoPE and the layer kinds spelled the hub's older way.

    * a flat ``rope_parameters`` -> ``rope_theta`` (+ ``rope_scaling`` when it is not a plain default);
    * one per layer type (``sliding_attention``, ``full_attention``) -> ``rope_theta`` and
      ``rope_scaling`` from the full layers', ``rope_local_base_freq`` from the sliding layers'
      (which must be a plain default RoPE: the older schema has no scaling for them);
    * ``layer_types`` is removed; :func:`layer_types_kept` puts it back when transformers cannot
      derive it from the rest (it stays in gemma-3-270m's hub config.json too).

    NoOlderSchema, naming why, when there is nothing to respell or no older spelling says it.
    """
    out = copy.deepcopy(config)
    text = _text_part(out)
    params = text.pop("rope_parameters", None)
    if params is None and "layer_types" not in text:
        raise NoOlderSchema("config.json has neither 'rope_parameters' nor 'layer_types': it is in the hub's "
                            "older schema already (other_schema respells it the transformers-5 way)")
    text.pop("layer_types", None)
    if params is None:
        return out
    if not isinstance(params, dict):
        raise NoOlderSchema(f"'rope_parameters' is {params!r}, not a mapping: no older spelling says it")
    nested = {k: v for k, v in params.items() if isinstance(v, dict)}
    if not nested:
        flat = params
    elif set(nested) == {SLIDING, FULL} and len(nested) == len(params):
        local = params[SLIDING]
        if _scaling(local) is not None:
            raise NoOlderSchema(f"the sliding layers' RoPE {local!r} is not a plain default RoPE: the older "
                                f"schema ('rope_local_base_freq') has no scaling for them")
        text["rope_local_base_freq"] = local["rope_theta"]
        flat = params[FULL]
    else:
        raise NoOlderSchema(f"'rope_parameters' holds {sorted(params)}: the older schema spells only one RoPE, or "
                            f"one for {SLIDING!r} and one for {FULL!r}")
    if "rope_theta" not in flat:
        raise NoOlderSchema(f"'rope_parameters' {flat!r} has no 'rope_theta'")
    text["rope_theta"] = flat["rope_theta"]
    scaling = _scaling(flat)
    if scaling is not None:
        text["rope_scaling"] = scaling
    return out


def respell_in_transformers5_schema(config: dict, model_types: dict[str, str]) -> dict:
    """The config.json dict ``config`` as transformers 5's ``save_pretrained`` writes it (``rope_parameters``,
    ``layer_types``): transformers' own config object of it, ``to_diff_dict()``, the model types as they were."""
    import transformers

    raw = relabel_model_types(copy.deepcopy(config), model_types)
    out = transformers.CONFIG_MAPPING[raw["model_type"]].from_dict(raw).to_diff_dict()
    return relabel_model_types(out, {ours: theirs for theirs, ours in model_types.items()})


def other_schema(config: dict, model_types: dict[str, str]) -> tuple[str, dict]:
    """(which schema, ``config`` respelled in it): the hub's older schema for a config in the
    transformers-5 one (:func:`respell_in_hub_schema`, :func:`layer_types_kept`), else the transformers-5
    schema (:func:`respell_in_transformers5_schema`). NoOlderSchema when neither says it."""
    text = _text_part(config)
    if "rope_parameters" not in text and "layer_types" not in text:
        respelled = respell_in_transformers5_schema(config, model_types)
        if "rope_parameters" not in _text_part(respelled):
            raise NoOlderSchema("transformers writes this config.json without 'rope_parameters' too: there is "
                                "nothing to respell")
        return "the transformers-5 schema", respelled
    return "the hub's older schema", layer_types_kept(config, respell_in_hub_schema(config), model_types)


def _transformers_config(raw: dict, model_types: dict[str, str]):
    """transformers' config object of a config.json dict (its text config for a multimodal one)."""
    import transformers

    raw = relabel_model_types(copy.deepcopy(raw), model_types)
    config = transformers.CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_types_kept(original: dict, respelled: dict, model_types: dict[str, str]) -> dict:
    """``respelled`` with ``layer_types`` put back when transformers does not derive the original's
    list from the rest (``sliding_window_pattern``, Gemma 2's alternation, Qwen's ``use_sliding_window``)."""
    types = getattr(_transformers_config(original, model_types), "layer_types", None)
    try:
        derived = getattr(_transformers_config(respelled, model_types), "layer_types", None)
    except Exception:  # transformers refuses the respelling: transformers_reads_it_the_same says so
        return respelled
    if types is None or derived == types:
        return respelled
    out = copy.deepcopy(respelled)
    _text_part(out)["layer_types"] = list(types)
    return out


def transformers_reads_it_the_same(original: dict, respelled: dict, model_types: dict[str, str]) -> str | None:
    """None when transformers reads ``respelled`` as the same model as ``original``; else why not.

    Two conditions: transformers' config objects of both agree on ``rope_parameters`` and
    ``layer_types``; and (for a respelling in the older schema) transformers *reads* every older key written (doubling a RoPE base, or
    changing the pattern, changes its config): a model type that never had the older schema
    ignores them, and agreeing only through its defaults proves nothing.
    """
    first = _transformers_config(original, model_types)
    try:
        second = _transformers_config(respelled, model_types)
    except Exception as exc:  # transformers raises KeyError, ValueError ... for a config it cannot read
        return f"transformers refuses the respelled config.json ({type(exc).__name__}: {exc})"
    for attr in ("rope_parameters", "layer_types"):
        if getattr(first, attr, None) != getattr(second, attr, None):
            return (f"transformers reads the respelled config.json differently: {attr} "
                    f"{getattr(second, attr, None)!r} for {getattr(first, attr, None)!r}")
    text = _text_part(respelled)
    if "rope_parameters" in text:  # respelled the transformers-5 way: its keys are the ones transformers writes
        return None
    for key in OLDER_KEYS:
        value = text.get(key)
        if value is None:
            continue
        changed = copy.deepcopy(respelled)
        if key == "rope_scaling":
            _text_part(changed)[key] = {**value, "factor": float(value.get("factor", 1.0)) * 2 + 1}
        elif key == "sliding_window_pattern":
            _text_part(changed)[key] = int(value) + 1
        else:
            _text_part(changed)[key] = float(value) * 2
        try:
            third = _transformers_config(changed, model_types)
        except Exception:  # it reads the key, and refuses the changed value: read all the same
            continue
        if all(getattr(third, a, None) == getattr(second, a, None) for a in ("rope_parameters", "layer_types")):
            return (f"transformers ignores {key!r} for model type {original.get('model_type')!r}: that model type "
                    f"never had the older schema")
    return None


def hub_schema_copy(checkpoint_dir: str | Path, folder: str | Path, config: dict) -> Path:
    """``folder`` holding ``config`` as config.json and every other file of ``checkpoint_dir`` linked (or copied)."""
    source, folder = Path(checkpoint_dir), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name == "config.json" or not path.is_file():
            continue
        try:
            os.symlink(path.resolve(), folder / path.name)
        except OSError:  # a file system without links
            shutil.copy2(path, folder / path.name)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder


#: Verdicts of :func:`reference_logits_agree`, by checkpoint files, respelled config and prompt.
_VERDICTS: dict[tuple, str | None] = {}


def reference_logits_agree(checkpoint_dir: Path, respelled_dir: Path, ids: torch.Tensor,
                           model_types: dict[str, str]) -> str | None:
    """None when transformers' float32 model gives the same logits (``torch.equal``) on both folders; else
    what differs. Measured once per process for the same files, respelled config and prompt."""
    from lollm.testing.reference import _files_stamp

    key = (str(Path(checkpoint_dir).resolve()), _files_stamp(checkpoint_dir),
           (Path(respelled_dir) / "config.json").read_text(encoding="utf-8"), ids.numpy().tobytes())
    if key not in _VERDICTS:
        runs = []
        for folder in (checkpoint_dir, respelled_dir):
            model = load_reference_model(load_checkpoint(Path(folder)), torch.float32, model_types)
            with torch.inference_mode():
                runs.append(model(ids, use_cache=False).logits[0])
        same = torch.equal(runs[0], runs[1])
        _VERDICTS[key] = None if same else (f"transformers' logits differ between the two spellings "
                                            f"(max |Δ| {float((runs[0] - runs[1]).abs().max()):.3e})")
    return _VERDICTS[key]
