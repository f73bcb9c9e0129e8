"""Write a random-weight Qwen3.5 checkpoint of the real 0.8B configuration, for `lollm bench`.

No Qwen3.5 weights are reachable from the project's machines, so speed is
measured on random weights of the real shape: the cost of a forward depends
on the shapes, not on the values. transformers writes the checkpoint (fp32),
and the tokenizer files of the real Qwen2.5 checkpoint (fetched through pip by
lollm.cli.real_models) are copied beside it so `lollm bench` can build its
prompt. Usage::

    python lollm-qwen3_5/benchmarks/make_bench_checkpoint.py OUT_FOLDER [HUB_CONFIGS]

Prints OUT_FOLDER; does nothing when the folder is already complete.
"""

import copy
import json
import shutil
import sys
from pathlib import Path


def main() -> None:
    out = Path(sys.argv[1])
    from lollm.cli.hub_configs import hub_configs_dir

    hub = Path(sys.argv[2]) if len(sys.argv) > 2 else hub_configs_dir()
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        print(out)
        return
    import torch
    import transformers

    from lollm.cli.real_models import derive_safetensors

    raw = json.loads((hub / "Qwen__Qwen3.5-0.8B" / "config.json").read_text())
    text = copy.deepcopy(raw["text_config"])  # the text decoder only
    text["model_type"] = "qwen3_5_text"
    text["tie_word_embeddings"] = True
    config = transformers.Qwen3_5TextConfig.from_dict(text)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).float()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer_dir = derive_safetensors("qwen2.5-coder-0.5b-instruct")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    shutil.copy(hub / "Qwen__Qwen3.5-0.8B" / "chat_template.jinja", out / "chat_template.jinja")
    print(out)


if __name__ == "__main__":
    main()
