"""The key/value tensors a KV-sharing layer may carry but never uses, and the name map that skips them.

Gemma 4's last ``num_kv_shared_layers`` layers compute no keys or values of their own: they
reuse those of the last earlier layer of the same type (``Gemma4Config.kv_source``), so the
model gives them no k_proj / v_proj / k_norm. Checkpoints may still carry those tensors
(transformers lists them as "ignored on load"). For those layers, and only those, they are
skipped by name; the same tensor on a layer that computes its own keys is loaded (and
required) like any other. :class:`SkipSharedKV` wraps a family name map with that rule;
``weights.layout_for`` builds one per format from the config.
"""

from __future__ import annotations

from dataclasses import dataclass

from lollm.load.build import NameMap, layer_template

#: The file names (``{i}``: the layer) of those tensors in a text checkpoint (v_norm has no
#: weight at all, but transformers' list of ignored names has it) ...
UNUSED_TEXT = frozenset({
    "model.layers.{i}.self_attn.k_proj.weight",
    "model.layers.{i}.self_attn.k_norm.weight",
    "model.layers.{i}.self_attn.v_proj.weight",
    "model.layers.{i}.self_attn.v_norm.weight",
})
#: ... and per layout, (format, multimodal) -> those names as that layout spells them.
KV_SHARED_UNUSED = {
    ("safetensors", False): UNUSED_TEXT,
    ("safetensors", True): frozenset(name.replace("model.", "model.language_model.", 1) for name in UNUSED_TEXT),
    ("gguf", False): frozenset({"blk.{i}.attn_k.weight", "blk.{i}.attn_k_norm.weight", "blk.{i}.attn_v.weight"}),
}


@dataclass(frozen=True)
class SkipSharedKV:
    """A name map that also skips the unused key/value tensors of the KV-sharing layers, and only theirs.

    names:   the layout's :class:`NameMap`, which maps (or refuses) every other name;
    unused:  file name templates of the tensors a KV-sharing layer may carry (:data:`KV_SHARED_UNUSED`);
    sharing: the indices of the KV-sharing layers (from the config: ``kv_source(i) != i``).

    Called with a file name it returns the model name, or None for a skipped tensor; a
    non-sharing layer's k_proj goes through ``names`` like any other tensor.
    """

    names: NameMap
    unused: frozenset[str]
    sharing: frozenset[int]

    def __call__(self, file_name: str) -> str | None:
        template, index = layer_template(file_name)
        if template in self.unused and int(index) in self.sharing:
            return None  # a KV-sharing layer's unused key/value weights
        return self.names(file_name)
