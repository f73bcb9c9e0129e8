"""lollm.testing.tiny_vision without pytest: the command a learner runs writes a tiny vision checkpoint.

(The checkpoints' use, run, parity and GGUF, is tested where the families are installed:
lollm-gemma/tests/test_tiny_vision_gemma.py, test_gemma3_vision_gguf.py, test_gemma4_vision_gguf.py and
lollm-qwen3_5/tests/test_tiny_vision_qwen3_5.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lollm.testing.tiny_vision import write_tiny_vision_checkpoint

WRITE = ("import sys; from lollm.testing.tiny_vision import main; main(sys.argv[1:]); "
         "print('pytest modules:', sorted(m for m in sys.modules if m.split('.')[0] in ('pytest', '_pytest')))")


def test_the_command_writes_a_checkpoint_without_importing_pytest(tmp_path):
    folder, picture = tmp_path / "tiny-gemma3-vision", tmp_path / "picture.png"
    done = subprocess.run([sys.executable, "-c", WRITE, "gemma3", str(folder), "--picture", str(picture)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "pytest modules: []" in done.stdout, done.stdout
    assert {p.name for p in folder.iterdir()} >= {"config.json", "model.safetensors", "preprocessor_config.json",
                                                   "tokenizer.json", "tokenizer.model", "tokenizer_config.json"}
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    vocab = {t["id"]: t["content"] for t in json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]}
    assert [vocab.get(config[k]) for k in ("boi_token_index", "eoi_token_index", "image_token_index")] == [
        "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    assert "<start_of_image>" in json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
    from PIL import Image

    with Image.open(picture) as img:
        assert img.size == (96, 64)


def test_an_unknown_family_is_refused_naming_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="'llama'.*gemma3, gemma4, qwen3_5, qwen3_5_moe"):
        write_tiny_vision_checkpoint("llama", tmp_path)
    assert not any(tmp_path.iterdir())
