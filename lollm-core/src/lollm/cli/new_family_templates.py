"""The files ``lollm new-family`` writes beside the copied family, as ``str.format`` templates.

:func:`lollm.cli.new_family.render` fills the fields (``{name}``, ``{top}``, ``{dist}`` ...) and
writes each one into the new distribution; literal braces are doubled.
"""

MANIFEST_TAIL = '''\
#: Made by ``lollm new-family {name} --like {like}`` from ``{ref_package}`` ({dist} {version}).
#: Each model type of this family -> the transformers model type whose math it copies: the
#: parity reference (``parity.py``) builds transformers' class of that type on the same config
#: and weights, and the tests relabel a transformers checkpoint the other way.
REFERENCE_MODEL_TYPES = {back!r}

#: ``module:function`` of the parity reference (``lollm parity`` and the conformance kit call it).
PARITY_REFERENCE = "{top}.{name}.parity:reference"'''

PARITY = '''\
"""The parity reference of the ``{name}`` family: transformers' model of the reference's model type.

``lollm parity`` and the conformance kit call :func:`reference` as
``reference(checkpoint, dtype)``. ``checkpoint`` is the :class:`lollm.load.loader.Checkpoint`
lollm read (``.path`` the folder, ``.fmt`` "safetensors" or "gguf", ``.config`` config.json
as a dict or the GGUF metadata, ``.weights`` the tensors under the file's names);
``dtype`` a torch floating dtype. It returns ``run(ids) -> (logits, hidden_states)``:
ids (1, T) int64 on the CPU, logits (T, V) float, hidden_states the
``num_layers + 1`` tensors (1, T, C) of transformers' ``output_hidden_states``.

transformers does not know this family's model types, so its class is chosen by
``REFERENCE_MODEL_TYPES`` (the architecture this family was copied from), built
from the same config.json, and fed exactly the weight files lollm read
(:func:`lollm.proof.parity.reference_weights`). When your family's math departs from
that architecture, this reference no longer fits: write your own here (the
Llama example in lollm's docs/examples/lollm-llama does, for GGUF).
"""

from __future__ import annotations

import torch

from lollm.errors import LollmError
from lollm.proof.parity import default_reference, reference_weights

from . import REFERENCE_MODEL_TYPES


def to_reference_types(raw):
    """A copy of the config dict with every ``model_type`` of this family (nested ones too) set to transformers'."""
    if isinstance(raw, dict):
        out = {{k: to_reference_types(v) for k, v in raw.items()}}
        if out.get("model_type") in REFERENCE_MODEL_TYPES:
            out["model_type"] = REFERENCE_MODEL_TYPES[out["model_type"]]
        return out
    if isinstance(raw, list):
        return [to_reference_types(v) for v in raw]
    return raw


def reference(checkpoint, dtype: torch.dtype):
    """(see the module docstring) Raises LollmError when transformers refuses the checkpoint."""
    if checkpoint.fmt != "safetensors" or REFERENCE_MODEL_TYPES.get(checkpoint.model_type, checkpoint.model_type) == checkpoint.model_type:
        return default_reference(checkpoint, dtype)  # transformers reads it as it is
    import transformers

    raw = to_reference_types(checkpoint.config)
    config = transformers.CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    folder, kwargs = reference_weights(checkpoint)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=dtype, **kwargs).eval()
    except Exception as exc:  # transformers raises many kinds for a checkpoint it refuses
        raise LollmError(f"transformers could not load {{folder}} as {{raw['model_type']!r}}: {{type(exc).__name__}}: {{exc}}") from None

    @torch.inference_mode()
    def run(ids: torch.Tensor):
        out = model(ids, output_hidden_states=True, use_cache=False)
        return out.logits[0].float(), [h.float() for h in out.hidden_states]

    return run
'''

PACKAGE_INIT = '''\
"""{dist}: the lollm family ``{name}`` (made with ``lollm new-family {name} --like {like}``).

    plugin.py     registers the family with lollm-core (no torch import)
    {name}/       the family: manifest (__init__.py), config, blocks, modeling, kv cache, weights, parity

Importing this package imports no torch: the model code is imported only when a model is loaded.
"""

__version__ = "0.1.0"
'''

PLUGIN = '''\
"""The lollm plugin of this distribution: registers the family ``{name}``.

lollm-core finds this module through the entry point in pyproject.toml
(``[project.entry-points."lollm.families"]``) and calls
:func:`lollm_register_families` once per process. Everything here is plain data
from the family's manifest (``{name}/__init__.py``): listing the installed
families imports no torch and no model code.
"""

from lollm.family import Capabilities, Family
from lollm.hookspecs import hookimpl

from {top} import {name}

FAMILY = Family(
    name="{name}",
    # the plugin contract this family is written for: {contract}, load(checkpoint, options) (lollm's
    # docs/plugins.md, section 4); a lollm-core that speaks another refuses it, saying what changed
    contract={contract},
    model_types={name}.MODEL_TYPES,
    load={name}.LOAD,
    gguf_architectures={name}.GGUF_ARCHITECTURES,
    sampling_defaults=dict({name}.SAMPLING_DEFAULTS),
    capabilities=Capabilities({caps}),
    parity_reference={name}.PARITY_REFERENCE,
    description={name}.DESCRIPTION,
{vision})


@hookimpl
def lollm_register_families(register):
    """Register the family (see :func:`lollm.hookspecs.lollm_register_families`)."""
    register(FAMILY)
'''

PYPROJECT = '''\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "lollm family {name} (made from {like} with lollm new-family)"
readme = "README.md"
requires-python = ">=3.10"
dependencies = [
    "{core}",
    # a floor, not a pin: install the torch build for your backend first
    "torch>=2.4",
]

[project.optional-dependencies]
# the tests run lollm's conformance kit and compare against transformers
test = ["pytest>=8", "{core_test}"]

[project.entry-points."lollm.families"]
{name} = "{top}.plugin"

[tool.setuptools.packages.find]
where = ["src"]
'''

#: The plugin's line for a copy of a vision family (contract 3): the tower the manifest's VISION names.
VISION_LINE = '''\
    # contract 3: the vision tower (module:function), copied with the family; images in, docs/vision.md
    vision={name}.VISION,
'''

README = '''\
# {dist}

The lollm family `{name}`, serving config.json `model_type` `{model_type}`
(and GGUF `general.architecture` `{name}`). Made with

    lollm new-family {name} --like {like}

from `{ref_package}` ({ref_dist}): the files of `src/{top}/{name}/` are that family's,
with its names changed. They still describe {like}'s sources in places: read them top to
bottom (`modeling_{name}.py` first, `config.py` second) and make them say what your family does.

The family follows lollm's plugin contract {contract} (`contract={contract}` in `plugin.py`):
`weights.py`'s `load(checkpoint, options)` parses and checks the config, then hands the
family's `WeightLayout` (a `NameMap` per format, tied tensors, tensor-parallel plan, what may
stay packed) to `lollm.load.build.build_model`. lollm's docs/plugins.md, section 4, has the details.

## Try it

    pip install -e ".[test]"
    lollm families            # lists {name}, from {dist}
    pytest tests              # the conformance kit, parity with transformers included

The kit's converter check (section 12) runs llama.cpp's own `convert_hf_to_gguf.py`: the first
run fetches the pinned llama-cpp-python source distribution with `pip download` (about 76 MB)
into `~/.cache/lollm/llama-cpp-src`. Offline, point `LOLLM_LLAMA_CPP_SRC` at an unpacked copy
of that sdist instead.

## What to edit next

1. `src/{top}/{name}/config.py`: the config.json keys your model has; refuse the ones you do not implement.
2. `blocks.py`, `modeling_{name}.py`: the math, forward in numbered steps. Keep the batch seam you
   inherited where the reference has it (`cache_layers()`, `token_positions`, `keep_logit_rows`, the
   start passed to `attend` unchanged): it lets the batched engine run your family, and three kit
   tests hold each batched request to its run alone (lollm's docs/plugins.md, "Running batched").
3. `weights.py`: the tensor names of your checkpoints (safetensors and GGUF) as `NameMap` tables in `LAYOUT`,
   and what a converter did to them (a `transform` for `build_model`).
4. `parity.py`: the reference. It builds transformers' `{ref_model_type}` class; when your math
   differs, build the reference that matches it.
5. `tests/test_conformance.py`: write your tiny checkpoint (it is now a `{ref_model_type}` one from the
   hub config `{hub}`, relabelled `{model_type}`).

## Publish

    python -m build                 # dist/{dist}-0.1.0.tar.gz and the wheel
    twine upload dist/*
'''

CI = '''\
name: ci
on: [push, pull_request]
jobs:
  tests:
    runs-on: ubuntu-latest
    steps:
      - uses: actions/checkout@v4
      - uses: actions/setup-python@v5
        with:
          python-version: "3.12"
      - name: install (CPU torch first, so nothing pulls a CUDA build)
        run: |
          pip install torch --index-url https://download.pytorch.org/whl/cpu
          pip install -e ".[test]"
      - name: the family is registered
        run: lollm families --strict
      - name: tests
        env:
          HF_HUB_OFFLINE: "1"
          TRANSFORMERS_OFFLINE: "1"
        run: pytest tests -q -rs
'''

TESTS = '''\
"""The family ``{name}`` through lollm's conformance kit (lollm.testing.conformance).

The tiny checkpoint: a real hub config.json (``{hub}``, shipped in
:mod:`lollm.cli.hub_configs`) shrunk so that it shows every feature the kit
checks (``lollm.testing.tiny.kit_config``), random weights written by
transformers, then relabelled with this family's model type. Parity runs
against the family's own ``parity_reference`` (``{name}/parity.py``).
"""

from __future__ import annotations

import json

import pytest

from lollm.testing.conformance import BF16_ERROR_FRACTION, FamilyConformance
from lollm.testing.mutation import stated_attributes
from lollm.cli.hub_configs import hub_config
from lollm.testing.tiny import SENSITIVE_INIT_STD, kit_config, write_tiny_checkpoint

from {top}.{name} import GGUF_ARCHITECTURES, REFERENCE_MODEL_TYPES

HUB_CONFIG = "{hub}"


def relabel(raw):
    """The config dict with every transformers model type (nested ones too) set to this family's."""
    ours = {{old: new for new, old in REFERENCE_MODEL_TYPES.items()}}
    if isinstance(raw, dict):
        out = {{k: relabel(v) for k, v in raw.items()}}
        if out.get("model_type") in ours:
            out["model_type"] = ours[out["model_type"]]
        return out
    return [relabel(v) for v in raw] if isinstance(raw, list) else raw


def write_tiny(folder):
    """A tiny random checkpoint of this family in ``folder`` (config.json, model.safetensors).

    :func:`lollm.testing.tiny.kit_config` shrinks the hub config so that the kit's coverage
    check passes (every kind of layer, a window of 6, a visible norm epsilon and attention
    scalar, a few narrow experts); the weights are spread wider than transformers' default,
    so that a wrong RoPE, epsilon or scale moves the logits far past the parity bound.
    """
    write_tiny_checkpoint(kit_config(hub_config(HUB_CONFIG)), folder, init_std=SENSITIVE_INIT_STD)
    path = folder / "config.json"
    path.write_text(json.dumps(relabel(json.loads(path.read_text())), indent=2))
    return folder


class Test{camel}Conformance(FamilyConformance):
    reference_available = True
    reference_model_types = REFERENCE_MODEL_TYPES  # transformers' class for each of this family's model types
    # bfloat16: a copy rounds where the family it copies rounds, so it states that family's bound (qwen3_5's,
    # lollm.testing.mutation.FAMILY_ATTRIBUTES) or the kit's; state your own, saying why, once yours differs
    bf16_error_fraction = stated_attributes(REFERENCE_MODEL_TYPES.values()).get("bf16_error_fraction",
                                                                                BF16_ERROR_FRACTION)
    # llama.cpp's converter does not know this family's model type: the kit converts the checkpoint under the
    # reference's (REFERENCE_MODEL_TYPES), then relabels the file (general.architecture, the "<arch>." keys) to
    # this family's GGUF architecture, so that this family's own GGUF reader reads it (the kit's section 12)
    converter_architecture = GGUF_ARCHITECTURES[0]

    @pytest.fixture
    def family_name(self):
        return "{name}"

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint_dir(cls, tmp_path_factory):
        # one checkpoint for the class: the kit's tests only read it (the broken copies go elsewhere)
        return write_tiny(tmp_path_factory.mktemp("{name}"))
{vision}'''

#: The vision fixture of a copy of a vision family (the kit's section 13, lollm.testing.vision_checks).
TESTS_VISION = '''
    @pytest.fixture
    def vision_setup(self):
        # the kit's vision check on {like}'s tiny image checkpoint (FIRST_PARTY_VISION), written by transformers
        # under {like}'s model types; this family reads it relabelled with its own. Write your own VisionSetup
        # (tiny config, transformers' image processor and class) once your tower departs from {like}'s.
        import dataclasses

        from lollm.testing.vision_checks import FIRST_PARTY_VISION

        return dataclasses.replace(FIRST_PARTY_VISION[{like!r}], relabel=relabel)
'''
